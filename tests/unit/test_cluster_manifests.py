"""The GPU deployment files in cluster/ parse, validate and agree with each other (no cluster is started).

cluster/serve_config_gpu.yaml (Serve config), cluster/rayservice.yaml (KubeRay) and cluster/ray-cluster-gpu.yaml
(Ray cluster launcher) describe one deployment; `specray.serve.cluster_check` cross-checks them. Each check here
also has a mutated manifest that it must reject, so a checker that says yes to everything fails this file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from specray.config import AppConfig
from specray.serve import cluster_check as cc

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
GPU_LEVELS = {"llama-3.2-1b": "gpu-l4", "llama-3.1-8b": "gpu-a100", "llama-3.1-70b": "gpu-h100x8"}


@pytest.fixture(scope="module")
def serve_cfg():
    return yaml.safe_load((CLUSTER / "serve_config_gpu.yaml").read_text())


@pytest.fixture(scope="module")
def rayservice():
    return cc.find_rayservice(yaml.safe_load_all((CLUSTER / "rayservice.yaml").read_text()))


@pytest.fixture(scope="module")
def launcher():
    return yaml.safe_load((CLUSTER / "ray-cluster-gpu.yaml").read_text())


def _app(cfg) -> AppConfig:
    return AppConfig.model_validate(cfg["applications"][0]["args"]["config"])


def _level(cfg, name):
    return next(lv for lv in cfg["applications"][0]["args"]["config"]["cascade"]["levels"] if lv.get("name") == name)


def _worker_group(rs, name):
    return next(g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == name)


# ------------------------------------------------------------------------------------ (a) the serve config


def test_serve_config_validates_against_ray_and_specray(serve_cfg):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_cfg)
    app = _app(serve_cfg)
    assert [lv.kind for lv in app.cascade.levels] == ["ngram", "vllm", "vllm", "vllm"]
    assert [lv.display_name for lv in app.cascade.levels[1:]] == list(GPU_LEVELS)
    assert app.cascade.placement.strategy == "SPREAD"
    assert [lv.accelerator_type for lv in app.cascade.levels[1:]] == ["L4", "A100", "H100"]
    assert all(lv.model.startswith("/models/") for lv in app.cascade.levels[1:])
    dep = serve_cfg["applications"][0]["deployments"][0]
    assert dep["name"] == "Coordinator"
    auto = dep["autoscaling_config"]
    assert 1 <= auto["min_replicas"] < auto["max_replicas"] and auto["target_ongoing_requests"] > 0
    assert cc.serve_config_problems(serve_cfg) == []


def test_model_paths_are_taken_as_local_folders(serve_cfg, tmp_path):
    from specray.engine.models import lookup, resolve_model

    for lv in _app(serve_cfg).cascade.levels[1:]:
        assert lookup(lv.model) is None  # not captured by a known short name
        local = tmp_path / Path(lv.model).name
        local.mkdir()
        assert resolve_model(str(local)) == str(local)


def test_serve_config_problems_are_reported(serve_cfg):
    bad = copy.deepcopy(serve_cfg)
    dep = bad["applications"][0]["deployments"][0]
    dep.pop("max_ongoing_requests")  # Serve's default 5 < max_batch_size 64
    dep["autoscaling_config"]["target_ongoing_request"] = 8  # typo: Serve would ignore it
    problems = cc.serve_config_problems(bad)
    assert any("max_ongoing_requests is 5" in p for p in problems)
    assert any("unknown keys ['target_ongoing_request']" in p for p in problems)
    bad = copy.deepcopy(serve_cfg)
    _level(bad, "llama-3.1-8b")["dtyp"] = "bfloat16"
    assert any("invalid specray config" in p and "dtyp" in p for p in cc.serve_config_problems(bad))


# ------------------------------------------------------------------------------------ (d) tensor parallelism


def test_tensor_parallel_size_equals_num_gpus(serve_cfg):
    for lv in _app(serve_cfg).cascade.levels[1:]:
        assert lv.engine_world_size == lv.num_gpus, lv.display_name
    target = _app(serve_cfg).cascade.levels[-1]
    assert target.engine_args["tensor_parallel_size"] == 4 and target.num_gpus == 4
    bad = copy.deepcopy(serve_cfg)
    _level(bad, "llama-3.1-70b")["num_gpus"] = 1
    assert any("num_gpus: 4" in p for p in cc.serve_config_problems(bad))


# ------------------------------------------------------------------------------------ (b) embedded serve config


def test_rayservice_embeds_the_same_serve_config(serve_cfg, rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == serve_cfg
    bad = copy.deepcopy(rayservice)
    bad["spec"]["serveConfigV2"] = bad["spec"]["serveConfigV2"].replace("max_batch_size: 64", "max_batch_size: 32")
    problems = cc.check_manifests(serve_cfg, bad, None)
    assert any("serveConfigV2 differs" in p and "max_batch_size: 32 vs 64" in p for p in problems), problems


# ------------------------------------------------------------------------------------ (c) resources fit


@pytest.mark.parametrize("which", ["rayservice", "launcher"])
def test_each_level_fits_exactly_its_accelerator_group(which, serve_cfg, rayservice, launcher):
    groups = cc.rayservice_groups(rayservice) if which == "rayservice" else cc.launcher_groups(launcher)
    (demand,) = cc.serve_demands(serve_cfg)
    hosts = {lvl: [g.name for g in groups if g.max_nodes and cc._fits(g.resources, need)]
             for lvl, need in demand.bundles}
    assert hosts == {lvl: [grp] for lvl, grp in GPU_LEVELS.items()}
    assert "head" not in [g.name for g in groups if cc._fits(g.resources, demand.coordinator)]  # head: num-cpus 0
    assert cc.fit_problems([demand], groups, which) == []


@pytest.mark.parametrize("which", ["rayservice", "launcher"])
def test_groups_hold_max_replicas_cascades_and_no_more(which, serve_cfg, rayservice, launcher):
    groups = cc.rayservice_groups(rayservice) if which == "rayservice" else cc.launcher_groups(launcher)
    (demand,) = cc.serve_demands(serve_cfg)
    assert demand.replicas == serve_cfg["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"]
    gpus_needed = demand.replicas * sum(b.get("GPU", 0) for _, b in demand.bundles)
    assert sum(g.max_nodes * g.resources.get("GPU", 0) for g in groups) >= gpus_needed
    assert cc.fit_problems([demand], groups, which) == []
    one_more = dataclasses.replace(demand, replicas=demand.replicas + 1)
    problems = cc.fit_problems([one_more], groups, which)
    assert len(problems) == 1 and "does not fit beside" in problems[0]


def test_level_without_a_matching_group_is_reported(serve_cfg, rayservice, launcher):
    bad = copy.deepcopy(serve_cfg)
    _level(bad, "llama-3.1-8b")["accelerator_type"] = "A10G"
    problems = cc.check_manifests(bad, None, launcher)
    assert any("launcher" in p and "'llama-3.1-8b'" in p and "accelerator_type:A10G" in p and "no group" in p
               for p in problems), problems
    bad = copy.deepcopy(serve_cfg)
    _level(bad, "llama-3.1-70b")["num_gpus"] = 16
    _level(bad, "llama-3.1-70b")["engine_args"]["tensor_parallel_size"] = 16
    assert any("'llama-3.1-70b' needs" in p for p in cc.check_manifests(bad, None, launcher))


def test_strict_strategies_are_honoured(serve_cfg, launcher):
    groups = cc.launcher_groups(launcher)
    (demand,) = cc.serve_demands(serve_cfg)
    packed = dataclasses.replace(demand, strategy="STRICT_PACK")  # L4 + A100 + H100 on one node: no such node
    assert any("STRICT_PACK" in p for p in cc.fit_problems([packed], groups, "launcher"))
    spread = dataclasses.replace(demand, strategy="STRICT_SPREAD")  # each level on its own node type anyway
    assert cc.fit_problems([spread], groups, "launcher") == []


def test_models_volume_is_mounted_where_levels_run(serve_cfg, rayservice):
    assert cc.check_manifests(serve_cfg, rayservice, None) == []
    bad = copy.deepcopy(rayservice)
    ctr = _worker_group(bad, "gpu-l4")["template"]["spec"]["containers"][0]
    ctr["volumeMounts"] = [m for m in ctr["volumeMounts"] if m["mountPath"] != "/models"]
    problems = cc.check_manifests(serve_cfg, bad, None)
    assert any("'gpu-l4'" in p and "does not mount" in p and "Llama-3.2-1B" in p for p in problems), problems


# ------------------------------------------------------------------------------------ (e) the two clusters agree


def test_rayservice_and_launcher_describe_the_same_groups(rayservice, launcher):
    ks, ls = cc.rayservice_groups(rayservice), cc.launcher_groups(launcher)
    assert [g.name for g in ks] == ["head", "cpu", *GPU_LEVELS.values()]
    assert {g.name for g in ls} == {g.name for g in ks}
    assert cc.compare_groups(ks, ls, "rayservice", "launcher") == []
    by = {g.name: g for g in ks}
    assert by["head"].resources == {}  # num-cpus 0, no GPU: nothing is scheduled on the head
    assert by["gpu-h100x8"].resources["GPU"] == 8 and by["gpu-l4"].resources["accelerator_type:L4"] == 1


def test_group_mismatch_is_reported(serve_cfg, rayservice, launcher):
    bad = copy.deepcopy(launcher)
    bad["available_node_types"]["gpu-h100x8"]["resources"]["GPU"] = 4
    problems = cc.check_manifests(serve_cfg, rayservice, bad)
    assert any("group 'gpu-h100x8': resources" in p for p in problems), problems
    bad = copy.deepcopy(launcher)
    bad["available_node_types"]["gpu-l4x2"] = bad["available_node_types"].pop("gpu-l4")
    problems = cc.check_manifests(serve_cfg, rayservice, bad)
    assert "group 'gpu-l4' is in rayservice but not in launcher" in problems
    assert "group 'gpu-l4x2' is in launcher but not in rayservice" in problems


def test_gpu_pods_mount_the_models_claim(rayservice):
    pvc = yaml.safe_load((CLUSTER / "models-pvc.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        if not g["groupName"].startswith("gpu-"):
            continue
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: m for m in g["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert claims[mounts["/models"]["name"]] == pvc["metadata"]["name"], g["groupName"]
        assert mounts["/models"]["readOnly"] is True


def test_rayservice_groups_are_consistent_with_their_pods(rayservice):
    rc = rayservice["spec"]["rayClusterConfig"]
    assert rc["rayVersion"] == "2.60.0"
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cc.kuberay_problems(rayservice) == []
    bad = copy.deepcopy(rayservice)
    params = _worker_group(bad, "gpu-a100")["rayStartParams"]
    params["num-gpus"] = "2"  # the container only gets 1
    params["resources"] = '"{\\"GPU\\": 1}"'
    problems = cc.kuberay_problems(bad)
    assert any("'gpu-a100' advertises num-gpus 2" in p for p in problems)
    assert any("may not set ['GPU']" in p for p in problems)


def test_kuberay_custom_resources_format():
    assert cc.parse_kuberay_resources('"{\\"accelerator_type:L4\\": 1, \\"draft\\": 2}"') == {
        "accelerator_type:L4": 1.0, "draft": 2.0}
    assert cc.parse_kuberay_resources('{"x": 0.5}') == {"x": 0.5}


def test_launcher_validates_against_rays_schema(launcher):
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)
    assert launcher["provider"]["type"] in {"gcp", "aws", "azure"}
    assert any("specray" in cmd for cmd in launcher["setup_commands"])
    assert cc.launcher_problems(launcher) == []
    bad = copy.deepcopy(launcher)
    bad["available_node_types"]["gpu-l4"]["accelerator"] = "L4"  # not a launcher field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad["max_workers"] = 2
    assert any("max_workers 2 <" in p for p in cc.launcher_problems(bad))


def test_checker_cli_on_the_repository_files(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cc.main([]) == 0
    assert capsys.readouterr().out.startswith("ok:")


# ------------------------------------------------------------------------------------ (f) local.sh


def test_local_sh_supports_up_down_status_without_starting_anything():
    script = CLUSTER / "local.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for cmd in ("up", "down", "status"):
        assert f"\n  {cmd}) {cmd} ;;" in text
    # RAY=true: a bad argument reaches the usage line without looking for a ray binary or touching a cluster
    proc = subprocess.run([str(script), "bogus"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "RAY": "true", "SPECRAY_CLUSTER_STATE": "/nonexistent/state.env"})
    assert proc.returncode == 2 and "usage:" in proc.stderr and "up|down|status" in proc.stderr
