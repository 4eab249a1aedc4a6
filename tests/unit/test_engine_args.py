"""`LevelConfig.engine_args` (vllm engine keyword arguments): validation and the way to the worker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import specray.engine.vllm as vllm_mod
from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.generate import create_worker, vllm_worker_kwargs


def _vllm(**kw) -> LevelConfig:
    return LevelConfig(kind="vllm", model="/models/x", **kw)


def test_engine_args_reach_the_vllm_worker(monkeypatch):
    seen = {}

    class FakeVLLMWorker:
        def __init__(self, model, **kwargs):
            seen.update(model=model, **kwargs)

    monkeypatch.setattr(vllm_mod, "VLLMWorker", FakeVLLMWorker)
    cfg = _vllm(name="big", dtype="bfloat16", num_gpus=4, max_context=8192,
                engine_args={"tensor_parallel_size": 4, "gpu_memory_utilization": 0.9, "enforce_eager": False})
    assert isinstance(create_worker(cfg), FakeVLLMWorker)
    assert seen["model"] == "/models/x" and seen["name"] == "big" and seen["dtype"] == "bfloat16"
    assert seen["max_context"] == 8192
    assert seen["engine_kwargs"] == {"tensor_parallel_size": 4, "gpu_memory_utilization": 0.9, "enforce_eager": False,
                                     "distributed_executor_backend": "mp"}
    assert seen["kv_cache_bytes"] is None  # GPU: sized by gpu_memory_utilization, not the CPU default
    assert "cpu_prepack" not in seen  # VLLMWorker has no such argument


def test_cpu_vllm_level_keeps_the_worker_defaults():
    kw = vllm_worker_kwargs(_vllm(num_threads=2))
    assert kw["engine_kwargs"] == {} and kw["num_threads"] == 2
    assert "kv_cache_bytes" not in kw  # the worker's own CPU default (1 GiB) applies


def test_explicit_executor_backend_is_kept():
    kw = vllm_worker_kwargs(_vllm(num_gpus=2, engine_args={"tensor_parallel_size": 2,
                                                           "distributed_executor_backend": "ray"}))
    assert kw["engine_kwargs"]["distributed_executor_backend"] == "ray"


def test_single_gpu_engine_gets_no_executor_override():
    kw = vllm_worker_kwargs(_vllm(num_gpus=1, engine_args={"gpu_memory_utilization": 0.8}))
    assert kw["engine_kwargs"] == {"gpu_memory_utilization": 0.8}


@pytest.mark.parametrize("kind", ["hf", "ngram"])
def test_engine_args_only_for_vllm(kind):
    model = None if kind == "ngram" else "m"
    with pytest.raises(ValidationError, match="engine_args is for vllm levels"):
        LevelConfig(kind=kind, model=model, engine_args={"enforce_eager": False})
    LevelConfig(kind=kind, model=model, engine_args={})  # empty is fine


def test_tensor_parallel_needs_matching_num_gpus():
    with pytest.raises(ValidationError, match=r"num_gpus: 4"):
        _vllm(num_gpus=1, engine_args={"tensor_parallel_size": 4})
    with pytest.raises(ValidationError, match=r"num_gpus: 4"):
        _vllm(num_gpus=8, engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    lvl = _vllm(num_gpus=4, engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert lvl.engine_world_size == 4
    assert _vllm().engine_world_size == 1


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_parallel_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValidationError, match="must be a positive integer"):
        _vllm(num_gpus=4, engine_args={"tensor_parallel_size": bad})


@pytest.mark.parametrize("key", ["model", "dtype", "max_model_len", "logprobs_mode", "enable_prefix_caching"])
def test_engine_args_cannot_override_what_specray_sets(key):
    with pytest.raises(ValidationError, match="set by specray"):
        _vllm(engine_args={key: "x"})


def test_engine_args_survive_the_json_round_trip_to_the_actors():
    cfg = CascadeConfig(levels=[_vllm(num_gpus=4, engine_args={"tensor_parallel_size": 4, "enforce_eager": False})])
    again = CascadeConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.levels[0].engine_args == {"tensor_parallel_size": 4, "enforce_eager": False}


def test_launch_timeouts_are_configurable():
    cfg = CascadeConfig.model_validate({"levels": [{"kind": "hf", "model": "m"}],
                                        "placement": {"timeout_s": 900}, "start_timeout_s": 1200})
    assert cfg.placement.timeout_s == 900 and cfg.start_timeout_s == 1200
    assert CascadeConfig(levels=[LevelConfig(model="m")]).placement.timeout_s == 60
    with pytest.raises(ValidationError):
        CascadeConfig.model_validate({"levels": [{"kind": "hf", "model": "m"}], "placement": {"timeout_s": 0}})


def test_cpu_vllm_actors_preload_the_intel_openmp_runtime(monkeypatch, tmp_path):
    """vLLM on CPU asks for libiomp5 in LD_PRELOAD, which only acts at process start: a vllm level's Ray actor
    on CPU gets it in its runtime_env (first, before anything already preloaded); GPU levels, other kinds and
    SPECRAY_NO_PRELOAD=1 do not."""
    import sys

    from specray.serve.placement import actor_options

    lib = tmp_path / "lib" / "libiomp5.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    monkeypatch.delenv("SPECRAY_NO_PRELOAD", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    assert vllm_mod.iomp_library() == str(lib)
    opts = actor_options(LevelConfig(kind="vllm", model="m"))
    # and its threads sleep 5 ms after a parallel region, not 200 (the runtime's default): unless set already
    assert opts["runtime_env"] == {"env_vars": {"LD_PRELOAD": f"{lib}:/opt/other.so", "KMP_BLOCKTIME": "5"}}
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    assert actor_options(LevelConfig(kind="vllm", model="m"))["runtime_env"] == {
        "env_vars": {"LD_PRELOAD": f"{lib}:/opt/other.so"}}
    assert "runtime_env" not in actor_options(LevelConfig(kind="vllm", model="m", num_gpus=1))
    assert "runtime_env" not in actor_options(LevelConfig(kind="hf", model="m"))
    monkeypatch.setenv("SPECRAY_NO_PRELOAD", "1")
    assert "runtime_env" not in actor_options(LevelConfig(kind="vllm", model="m"))
    lib.unlink()
    monkeypatch.delenv("SPECRAY_NO_PRELOAD")
    assert vllm_mod.iomp_library() is None and vllm_mod.preload_env() == {}


def test_kind_auto_is_vllm_where_installed_and_hf_with_a_log_line_elsewhere(monkeypatch, caplog):
    """`kind: auto` takes the vllm backend where vLLM is installed; elsewhere the level runs on hf, the log says
    why, and the vllm-only fields are dropped (they would fail validation on an hf level)."""
    from specray import config

    monkeypatch.setattr(config, "vllm_installed", lambda: True)
    lc = LevelConfig(kind="auto", model="m", engine_verify=8, engine_args={"enforce_eager": True})
    assert (lc.kind, lc.engine_verify, lc.engine_args) == ("vllm", 8, {"enforce_eager": True})
    monkeypatch.setattr(config, "vllm_installed", lambda: False)
    with caplog.at_level("WARNING", logger="specray.config"):
        lc = LevelConfig(kind="auto", name="target", model="m", engine_verify=8, engine_args={"enforce_eager": True})
    assert (lc.kind, lc.engine_verify, lc.engine_args, lc.native_speculation) == ("hf", 0, {}, None)
    assert "target" in caplog.text and "vLLM is not installed" in caplog.text and "engine_verify" in caplog.text
    assert LevelConfig.model_validate(lc.model_dump()).kind == "hf"  # resolved once, stays resolved


def test_specray_no_vllm_turns_kind_auto_to_hf(monkeypatch):
    from specray import config

    monkeypatch.setenv("SPECRAY_NO_VLLM", "1")
    assert not config.vllm_installed()
    assert LevelConfig(kind="auto", model="m", engine_verify=4).kind == "hf"
