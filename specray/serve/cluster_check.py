"""Cross-check a Serve config against the clusters meant to run it (KubeRay RayService, Ray cluster launcher).

A cascade only starts when every level's placement-group bundle fits on one node, and each Coordinator
replica launches a whole cascade of its own, so the cluster must hold `max_replicas` cascades at once. Editing
one of the three files (serve config, `RayService`, launcher YAML) without the others fails late, on the
cluster, as a placement group that never fits. This module finds that on a laptop:

* the Serve config validates (Ray's `ServeDeploySchema`, specray's `AppConfig`, the Coordinator's
  `autoscaling_config`), and `max_ongoing_requests` lets a replica fill its batch;
* each model level's bundle (exactly what `specray.serve.placement.level_bundle` asks Ray for: CPU, GPU, custom
  resources, `accelerator_type:<X>`) fits on one node of some group, and all replicas' cascades fit together on
  the groups at their maximum size (first-fit decreasing; the placement strategy is honoured for the STRICT_*
  kinds); absolute model paths are mounted on every group that could host the level;
* the RayService embeds the same serve config, and its worker groups match the launcher's node types.

    python -m specray.serve.cluster_check            # the files in cluster/, from the repository root

Node groups are read the way Ray sees them: KubeRay `rayStartParams` (num-cpus, num-gpus, the escaped JSON of
`resources`; CPU/GPU fall back to the container limits), launcher `available_node_types[*].resources`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specray.config import AppConfig
from specray.serve.placement import level_bundle

IMPORT_PATH = "specray.serve.app:build_app"
COORDINATOR = "Coordinator"
#: the Coordinator's ray_actor_options when the Serve config gives none (see `specray.serve.app.build_app`)
DEFAULT_COORDINATOR_RESOURCES = {"CPU": 0.5}
#: Serve's default max_ongoing_requests per replica (ray.serve._private.constants)
SERVE_DEFAULT_MAX_ONGOING = 5
_EPS = 1e-9


@dataclass(frozen=True)
class NodeGroup:
    """One kind of node: its Ray resources per node and how many such nodes there can be."""

    name: str
    resources: Mapping[str, float]
    min_nodes: int
    max_nodes: int
    mounts: tuple[str, ...] = ()


@dataclass
class Demand:
    """What one Serve application needs per Coordinator replica, and at most how many replicas."""

    app: str
    replicas: int
    coordinator: dict[str, float]
    bundles: list[tuple[str, dict[str, float]]]  # (level name, placement-group bundle), model levels only
    strategy: str
    models: list[tuple[str, str]] = field(default_factory=list)  # (level name, model spec)


# ------------------------------------------------------------------------------------------ Serve config


def app_configs(serve_cfg: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], AppConfig]]:
    """(Serve application, its validated AppConfig) for every specray application with an inline config."""
    out = []
    for app in serve_cfg.get("applications") or []:
        if app.get("import_path") != IMPORT_PATH:
            continue
        args = app.get("args") or {}
        out.append((app, AppConfig.model_validate(args.get("config", args))))
    return out


def _coordinator(app: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((d for d in app.get("deployments") or [] if d.get("name") == COORDINATOR), {})


def serve_config_problems(serve_cfg: Mapping[str, Any]) -> list[str]:
    """Schema problems of a Serve config file (Ray's schema, specray's schema, the Coordinator's options)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    problems = []
    try:
        ServeDeploySchema.model_validate(serve_cfg)
    except Exception as exc:
        problems.append(f"serve config: not a valid Serve config: {exc}")
    apps = [a for a in serve_cfg.get("applications") or [] if a.get("import_path") == IMPORT_PATH]
    if not apps:
        problems.append(f"serve config: no application with import_path {IMPORT_PATH}")
    for app in apps:
        name = app.get("name", "?")
        args = app.get("args") or {}
        if "config_path" in args:
            problems.append(f"serve config: application {name!r} uses config_path; inline the config to check it")
            continue
        try:
            cfg = AppConfig.model_validate(args.get("config", args))
        except Exception as exc:
            problems.append(f"serve config: application {name!r}: invalid specray config: {exc}")
            continue
        dep = _coordinator(app)
        auto = dep.get("autoscaling_config")
        if auto:
            unknown = sorted(set(auto) - set(AutoscalingConfig.model_fields))
            if unknown:
                problems.append(f"serve config: {name!r} {COORDINATOR}.autoscaling_config: unknown keys {unknown} "
                                "(Serve ignores them silently)")
            try:
                AutoscalingConfig.model_validate(auto)
            except Exception as exc:
                problems.append(f"serve config: {name!r} {COORDINATOR}.autoscaling_config: {exc}")
        max_ongoing = dep.get("max_ongoing_requests", SERVE_DEFAULT_MAX_ONGOING)
        if isinstance(max_ongoing, int) and max_ongoing < cfg.server.max_batch_size:
            problems.append(
                f"serve config: {name!r} {COORDINATOR}.max_ongoing_requests is {max_ongoing} (Serve's default: "
                f"{SERVE_DEFAULT_MAX_ONGOING}) < server.max_batch_size {cfg.server.max_batch_size}: a replica never "
                "fills its batch"
            )
    return problems


def _actor_resources(opts: Mapping[str, Any] | None) -> dict[str, float]:
    if opts is None:
        return dict(DEFAULT_COORDINATOR_RESOURCES)
    res = {"CPU": float(opts.get("num_cpus", 1)), "GPU": float(opts.get("num_gpus", 0) or 0)}
    res.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    if opts.get("accelerator_type"):
        res[f"accelerator_type:{opts['accelerator_type']}"] = 0.001
    return {k: v for k, v in res.items() if v > 0}


def serve_demands(serve_cfg: Mapping[str, Any]) -> list[Demand]:
    """The resources of every specray application: per Coordinator replica, its actor and the level bundles."""
    out = []
    for app, cfg in app_configs(serve_cfg):
        dep = _coordinator(app)
        auto = dep.get("autoscaling_config") or {}
        replicas = dep.get("num_replicas", 1)
        replicas = int(auto["max_replicas"]) if "max_replicas" in auto else (replicas if isinstance(replicas, int)
                                                                             else 1)
        models = [lc for lc in cfg.cascade.levels if not lc.is_lookup]
        out.append(Demand(
            app=app.get("name", "?"), replicas=replicas, coordinator=_actor_resources(dep.get("ray_actor_options")),
            bundles=[(lc.display_name, level_bundle(lc)) for lc in models],
            strategy=cfg.cascade.placement.strategy if cfg.cascade.placement.enabled else "PACK",
            models=[(lc.display_name, lc.model or "") for lc in models],
        ))
    return out


# ------------------------------------------------------------------------------------------ node groups


def _cpu_quantity(q: Any) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def parse_kuberay_resources(value: str) -> dict[str, float]:
    """rayStartParams.resources as KubeRay wants it written: '"{\\"accelerator_type:L4\\": 1}"' -> {...: 1.0}."""
    s = value.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1]
    return {k: float(v) for k, v in json.loads(s.replace('\\"', '"')).items()}


def _kuberay_group(name: str, spec: Mapping[str, Any], lo: int, hi: int) -> NodeGroup:
    params = spec.get("rayStartParams") or {}
    pod = spec["template"]["spec"]
    ray_container = pod["containers"][0]  # KubeRay runs Ray in the first container
    limits = (ray_container.get("resources") or {}).get("limits") or {}
    res = {
        "CPU": float(params["num-cpus"]) if "num-cpus" in params else _cpu_quantity(limits.get("cpu", 0)),
        "GPU": float(params["num-gpus"]) if "num-gpus" in params else float(limits.get("nvidia.com/gpu", 0)),
    }
    if "resources" in params:
        res.update(parse_kuberay_resources(params["resources"]))
    mounts = tuple(m["mountPath"] for m in ray_container.get("volumeMounts") or [])
    return NodeGroup(name, {k: v for k, v in res.items() if v > 0}, lo, hi, mounts)


def find_rayservice(docs: Iterable[Any]) -> Mapping[str, Any]:
    for doc in docs:
        if isinstance(doc, Mapping) and doc.get("kind") == "RayService":
            return doc
    raise ValueError("no RayService document")


def rayservice_groups(rayservice: Mapping[str, Any]) -> list[NodeGroup]:
    """Head ("head", one node) and worker groups of a RayService's cluster, as Ray will see them."""
    rc = rayservice["spec"]["rayClusterConfig"]
    groups = [_kuberay_group("head", rc["headGroupSpec"], 1, 1)]
    for g in rc.get("workerGroupSpecs") or []:
        replicas = int(g.get("replicas", 0))
        lo = int(g.get("minReplicas", replicas))
        hi = int(g.get("maxReplicas", max(replicas, lo)))
        groups.append(_kuberay_group(g["groupName"], g, lo, hi))
    return groups


def kuberay_problems(rayservice: Mapping[str, Any]) -> list[str]:
    """Inner consistency of the RayService's groups (Ray's view vs. the pods' resources)."""
    problems = []
    rc = rayservice["spec"]["rayClusterConfig"]
    specs = [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc.get("workerGroupSpecs") or []]
    images = set()
    for name, spec in specs:
        params = spec.get("rayStartParams") or {}
        for key, val in params.items():
            if not isinstance(val, str):
                problems.append(f"rayservice: group {name!r} rayStartParams.{key} must be a string, got {val!r}")
        ctr = spec["template"]["spec"]["containers"][0]
        images.add(ctr.get("image"))
        limits = (ctr.get("resources") or {}).get("limits") or {}
        gpus = float(limits.get("nvidia.com/gpu", 0))
        if "num-gpus" in params and float(params["num-gpus"]) != gpus:
            problems.append(f"rayservice: group {name!r} advertises num-gpus {params['num-gpus']} to Ray but its "
                            f"container is given {gpus:g} (limits nvidia.com/gpu)")
        if "num-cpus" in params and "cpu" in limits and float(params["num-cpus"]) > _cpu_quantity(limits["cpu"]):
            problems.append(f"rayservice: group {name!r} advertises num-cpus {params['num-cpus']} > its cpu limit")
        if "resources" in params:
            try:
                custom = parse_kuberay_resources(params["resources"])
            except (ValueError, AttributeError) as exc:
                problems.append(f"rayservice: group {name!r} rayStartParams.resources is not KubeRay's escaped JSON "
                                f"('\"{{\\\"name\\\": 1}}\"'): {exc}")
                continue
            bad = sorted({"CPU", "GPU", "memory"} & set(custom))
            if bad:
                problems.append(f"rayservice: group {name!r} rayStartParams.resources may not set {bad}")
        if name != "head":
            lo, hi, n = spec.get("minReplicas", 0), spec.get("maxReplicas", 0), spec.get("replicas", 0)
            if not lo <= n <= hi:
                problems.append(f"rayservice: group {name!r} replicas {n} outside [minReplicas {lo}, maxReplicas {hi}]")
    if len(images) > 1:
        problems.append(f"rayservice: groups run different images {sorted(map(str, images))}; Ray and Python versions "
                        "must match across the cluster")
    return problems


def _docker_mounts(options: Sequence[str]) -> list[str]:
    out = []
    for opt in options or []:
        words = str(opt).replace("=", " ").split()
        for flag, val in zip(words, words[1:]):
            if flag in ("-v", "--volume", "--mount") and ":" in val:
                out.append(val.split(":")[1])
    return out


def launcher_groups(launcher: Mapping[str, Any]) -> list[NodeGroup]:
    """Node types of a Ray cluster launcher config (the head type named "head", one node)."""
    head = launcher["head_node_type"]
    docker = launcher.get("docker") or {}
    mounts = tuple(_docker_mounts(docker.get("run_options") or []))
    groups = []
    for name, nt in launcher["available_node_types"].items():
        res = {k: float(v) for k, v in (nt.get("resources") or {}).items() if float(v) > 0}
        extra = nt.get("docker", {}).get("worker_run_options" if name != head else "head_run_options") or []
        lo, hi = (1, 1) if name == head else (int(nt.get("min_workers", 0)), int(nt.get("max_workers", 0)))
        groups.append(NodeGroup("head" if name == head else name, res, lo, hi, mounts + tuple(_docker_mounts(extra))))
    return groups


def launcher_problems(launcher: Mapping[str, Any]) -> list[str]:
    problems = []
    head = launcher["head_node_type"]
    total = sum(int(nt.get("max_workers", 0)) for name, nt in launcher["available_node_types"].items() if name != head)
    if int(launcher.get("max_workers", 0)) < total:
        problems.append(f"launcher: max_workers {launcher.get('max_workers')} < the node types' max_workers sum "
                        f"{total}: the autoscaler stops before the types are full")
    return problems


def compare_groups(a: Sequence[NodeGroup], b: Sequence[NodeGroup], a_name: str, b_name: str) -> list[str]:
    """Differences between two descriptions of the same cluster (names, resources per node, min/max nodes)."""
    problems = []
    ga, gb = {g.name: g for g in a}, {g.name: g for g in b}
    for name in sorted(set(ga) ^ set(gb)):
        where, other = (a_name, b_name) if name in ga else (b_name, a_name)
        problems.append(f"group {name!r} is in {where} but not in {other}")
    for name in sorted(set(ga) & set(gb)):
        x, y = ga[name], gb[name]
        if dict(x.resources) != dict(y.resources):
            problems.append(f"group {name!r}: resources {dict(x.resources)} in {a_name} vs {dict(y.resources)} in "
                            f"{b_name}")
        if (x.min_nodes, x.max_nodes) != (y.min_nodes, y.max_nodes):
            problems.append(f"group {name!r}: nodes {x.min_nodes}..{x.max_nodes} in {a_name} vs "
                            f"{y.min_nodes}..{y.max_nodes} in {b_name}")
    return problems


# ------------------------------------------------------------------------------------------ fitting


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items() if v > 0)


def _take(free: dict[str, float], need: Mapping[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _merge(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def fit_problems(demands: Sequence[Demand], groups: Sequence[NodeGroup], where: str) -> list[str]:
    """Can `groups` (each at its max size) hold every application's cascades at their max replicas?

    First each bundle on its own (names the level that fits nowhere), then everything at once by first-fit
    decreasing over the nodes (a heuristic: a "does not fit" there is worth a look, not a proof).
    """
    problems = []
    for d in demands:
        for lvl, need in [(COORDINATOR, d.coordinator), *d.bundles]:
            if not any(_fits(g.resources, need) for g in groups if g.max_nodes > 0):
                have = "; ".join(f"{g.name}: {dict(g.resources)}" for g in groups)
                problems.append(f"{where}: {d.app!r} {lvl!r} needs {need} on one node; no group has that ({have})")
        for lvl, model in d.models:
            if not model.startswith("/"):
                continue
            for g in groups:
                hosts = g.max_nodes > 0 and _fits(g.resources, dict(d.bundles)[lvl])
                if hosts and not any(model == m or model.startswith(m.rstrip("/") + "/") for m in g.mounts):
                    problems.append(f"{where}: group {g.name!r} can host level {lvl!r} but does not mount its model "
                                    f"{model} (mounts: {list(g.mounts)})")
    if problems:
        return problems
    nodes = [(g.name, i, dict(g.resources)) for g in groups for i in range(g.max_nodes)]
    items: list[tuple[str, dict[str, float], tuple[str, int] | None]] = []  # (label, need, spread group)
    for d in demands:
        for r in range(d.replicas):
            items.append((f"{d.app} replica {r + 1} {COORDINATOR}", d.coordinator, None))
            if d.strategy == "STRICT_PACK":
                items.append((f"{d.app} replica {r + 1} cascade (STRICT_PACK)", _merge(b for _, b in d.bundles), None))
                continue
            spread = (d.app, r) if d.strategy == "STRICT_SPREAD" else None
            items.extend((f"{d.app} replica {r + 1} level {lvl!r}", need, spread) for lvl, need in d.bundles)
    items.sort(key=lambda it: (it[1].get("GPU", 0.0), it[1].get("CPU", 0.0), sum(it[1].values())), reverse=True)
    used: dict[tuple[str, int], set[int]] = {}
    for label, need, spread in items:
        taken = used.setdefault(spread, set()) if spread else set()
        for idx, (_, _, free) in enumerate(nodes):
            if idx not in taken and _fits(free, need):
                _take(free, need)
                taken.add(idx)
                break
        else:
            total = {g.name: g.max_nodes for g in groups}
            problems.append(f"{where}: {label} ({need}) does not fit beside the other replicas' cascades on the groups "
                            f"at their max size ({total}): raise the groups' max or lower max_replicas")
            break
    return problems


# ------------------------------------------------------------------------------------------ all files


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'the first' if k in a else 'the second'}"
            diff = _first_difference(a[k], b[k], f"{path}.{k}")
            if diff:
                return diff
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = _first_difference(x, y, f"{path}[{i}]")
            if diff:
                return diff
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def check_manifests(serve_cfg: Mapping[str, Any], rayservice: Mapping[str, Any] | None = None,
                    launcher: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem found across the parsed files (empty: they agree and the cluster holds the config)."""
    problems = serve_config_problems(serve_cfg)
    if problems:
        return problems
    demands = serve_demands(serve_cfg)
    kuberay = launched = None
    if rayservice is not None:
        embedded = rayservice.get("spec", {}).get("serveConfigV2")
        if not isinstance(embedded, str):
            problems.append("rayservice: spec.serveConfigV2 must be the serve config as a YAML string")
        else:
            diff = _first_difference(yaml.safe_load(embedded), dict(serve_cfg))
            if diff:
                problems.append(f"rayservice: spec.serveConfigV2 differs from the serve config at {diff}")
        problems += kuberay_problems(rayservice)
        kuberay = rayservice_groups(rayservice)
        problems += fit_problems(demands, kuberay, "rayservice")
    if launcher is not None:
        problems += launcher_problems(launcher)
        launched = launcher_groups(launcher)
        problems += fit_problems(demands, launched, "launcher")
    if kuberay is not None and launched is not None:
        problems += compare_groups(kuberay, launched, "rayservice", "launcher")
    return problems


def load_yaml(path: str | Path) -> Any:
    return yaml.safe_load(Path(path).read_text())


def check_files(serve_config: str | Path, rayservice: str | Path | None = None,
                launcher: str | Path | None = None) -> list[str]:
    rs = find_rayservice(yaml.safe_load_all(Path(rayservice).read_text())) if rayservice else None
    return check_manifests(load_yaml(serve_config), rs, load_yaml(launcher) if launcher else None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specray.serve.cluster_check", description=__doc__.split("\n")[0])
    p.add_argument("--serve-config", default="cluster/serve_config_gpu.yaml")
    p.add_argument("--rayservice", default="cluster/rayservice.yaml", help="'' to skip")
    p.add_argument("--launcher", default="cluster/ray-cluster-gpu.yaml", help="'' to skip")
    args = p.parse_args(argv)
    problems = check_files(args.serve_config, args.rayservice or None, args.launcher or None)
    for line in problems:
        print(line)
    if not problems:
        print(f"ok: {args.serve_config} fits {' and '.join(f for f in (args.rayservice, args.launcher) if f)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
