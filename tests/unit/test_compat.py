"""vLLM's and Ray Serve LLM's configuration shapes and names, mapped onto specray's AppConfig (no Ray started)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from specray.compat import ConfigMappingError, app_from_llm_config, app_from_llm_serving_args, ngram_lookup
from specray.config import AppConfig, LevelConfig, ServerConfig
from specray.spec.params import VerifyMethod


def _levels(app: AppConfig) -> list[tuple]:
    return [(lv.kind, lv.model, lv.num_speculative_tokens) for lv in app.cascade.levels]


# ------------------------------------------------------------------------------------------ vLLM's names


def test_vllm_names_are_aliases_and_both_names_is_an_error():
    assert LevelConfig(kind="hf", model="m", max_model_len=2048).max_context == 2048
    server = ServerConfig.model_validate({"served_model_name": ["qwen"], "max_num_seqs": 8})
    assert (server.model_name, server.max_batch_size) == ("qwen", 8)
    assert ServerConfig(model_name="a", max_batch_size=4).model_dump()["max_batch_size"] == 4  # old names work
    with pytest.raises(ValidationError, match="give `max_context` or its vLLM name `max_model_len`, not both"):
        LevelConfig(kind="hf", model="m", max_context=1024, max_model_len=2048)
    with pytest.raises(ValidationError, match="`max_batch_size` or its vLLM name `max_num_seqs`"):
        ServerConfig.model_validate({"max_batch_size": 4, "max_num_seqs": 8})
    with pytest.raises(ValidationError, match="one model name"):
        ServerConfig.model_validate({"served_model_name": ["a", "b"]})


def test_a_levels_method_is_the_deprecated_name_of_verify_method():
    with pytest.warns(FutureWarning, match="verify_method"):
        old = LevelConfig(kind="hf", model="m", method="coupled")
    assert old.verify_method is VerifyMethod.COUPLED and old.method is VerifyMethod.COUPLED
    assert "method" not in old.model_dump() and LevelConfig.model_validate(old.model_dump()) == old
    with pytest.raises(ValidationError, match="not both"):
        LevelConfig(kind="hf", model="m", method="greedy", verify_method="coupled")


def test_request_speculation_method_takes_vllms_draft_model():
    from specray.serve.protocol import SpeculationOptions

    assert SpeculationOptions.model_validate({"method": "draft_model"}).method == "draft"
    assert SpeculationOptions.model_validate({"method": "cascade"}).method == "cascade"


# -------------------------------------------------------------------------------- speculative_config


def test_ngram_defaults_follow_vllm():
    assert ngram_lookup(None, None) == (5, 5)
    assert ngram_lookup(None, 3) == (3, 3) and ngram_lookup(2, None) == (2, 2) and ngram_lookup(1, 4) == (1, 4)
    app = AppConfig.model_validate({"model": "t", "speculative_config": {"method": "ngram",
                                                                          "num_speculative_tokens": 5}})
    ng = app.cascade.levels[0]
    assert (ng.kind, ng.prompt_lookup_min, ng.prompt_lookup_max, ng.prompt_lookup_occurrence) == \
        ("ngram", 5, 5, "earliest")
    assert app.server.model_name == "t"  # vLLM serves the model under its own name by default


def test_vllm_flat_shape_draft_model_and_cascade():
    app = AppConfig.model_validate({
        "model": "target", "served_model_name": "svc", "max_model_len": 1024, "max_num_seqs": 6,
        "dtype": "half", "speculative_config": {"model": "draft", "num_speculative_tokens": 3},  # method inferred
        "policy": {"adaptive": False},
    })
    assert _levels(app) == [("hf", "draft", 3), ("hf", "target", 4)]
    assert [lv.max_context for lv in app.cascade.levels] == [1024, 1024]
    assert {lv.dtype for lv in app.cascade.levels} == {"float16"}
    assert (app.server.model_name, app.server.max_batch_size, app.policy.adaptive) == ("svc", 6, False)
    casc = AppConfig.model_validate({"model": "t", "speculative_config": {
        "method": "cascade", "num_speculative_tokens": 2,
        "drafters": [{"method": "ngram", "prompt_lookup_max": 4}, {"method": "draft_model", "model": "d",
                                                                   "num_speculative_tokens": 6}]}})
    assert _levels(casc) == [("ngram", None, 2), ("hf", "d", 6), ("hf", "t", 4)]
    assert (casc.cascade.levels[0].prompt_lookup_min, casc.cascade.levels[0].prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "eagle", "model": "e", "num_speculative_tokens": 2}, r"method must be one of"),
    ({"method": "ngram"}, r"num_speculative_tokens is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs `model`"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "quantization": "fp8"},
     r"\['quantization'\] not supported by specray"),
    ({"method": "cascade", "drafters": []}, r"drafters: a non-empty list"),
    ({"method": "cascade", "drafters": [{"model": "d", "num_speculative_tokens": 2},
                                        {"method": "ngram", "num_speculative_tokens": 2}]},
     r"lookup level \(ngram\) can only"),
])
def test_speculative_config_errors_name_the_field(spec, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"model": "t", "speculative_config": spec})


def test_flat_and_specray_shapes_do_not_mix():
    with pytest.raises(ValidationError, match="not both"):
        AppConfig.model_validate({"model": "t", "cascade": {"levels": [{"model": "x"}]}})
    with pytest.raises(ValidationError, match="need `model`"):
        AppConfig.model_validate({"cascade": {"levels": [{"model": "x"}]}, "max_model_len": 5})
    with pytest.raises(ValidationError, match="give it once"):
        AppConfig.model_validate({"model": "t", "max_num_seqs": 4, "server": {"max_batch_size": 8}})


# ------------------------------------------------------------------------------------------ Ray Serve LLM

LLM_CONFIG = {
    "model_loading_config": {"model_id": "qwen-1.5b", "model_source": "qwen2.5-coder-1.5b-instruct"},
    "engine_kwargs": {"max_model_len": 4096, "max_num_seqs": 16, "dtype": "bfloat16",
                      "speculative_config": {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct",
                                             "num_speculative_tokens": 4}},
    "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2},
                          "max_ongoing_requests": 40},
    "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
}


def test_llm_config_maps_onto_the_app_and_its_deployment():
    app, deployment = app_from_llm_config(LLM_CONFIG)
    cfg = AppConfig.model_validate(app)
    assert _levels(cfg) == [("hf", "qwen2.5-coder-0.5b-instruct", 4), ("hf", "qwen2.5-coder-1.5b-instruct", 4)]
    assert (cfg.server.model_name, cfg.server.max_batch_size) == ("qwen-1.5b", 16)
    assert {lv.max_context for lv in cfg.cascade.levels} == {4096}
    assert deployment == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}, "max_ongoing_requests": 40,
                          "ray_actor_options": {"runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}}}
    assert app_from_llm_serving_args({"llm_configs": [LLM_CONFIG]}) == (app, deployment)


def test_llm_config_on_gpus_runs_vllm_levels():
    gpu = {**LLM_CONFIG, "accelerator_type": "A10G",
           "engine_kwargs": {**LLM_CONFIG["engine_kwargs"], "tensor_parallel_size": 2,
                             "gpu_memory_utilization": 0.85}}
    cfg = AppConfig.model_validate(app_from_llm_config(gpu)[0])
    draft, target = cfg.cascade.levels
    assert (target.kind, target.device, target.num_gpus, target.accelerator_type) == ("vllm", "cuda", 2, "A10G")
    assert target.engine_args == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85}
    assert (draft.kind, draft.num_gpus, draft.engine_args) == ("vllm", 1, {})
    ext = {**LLM_CONFIG, "experimental_configs": {"specray": {"kind": "vllm", "policy": {"k_max": 4},
                                                              "level_defaults": {"num_threads": 2}}}}
    cfg = AppConfig.model_validate(app_from_llm_config(ext)[0])
    assert {lv.kind for lv in cfg.cascade.levels} == {"vllm"} and cfg.policy.k_max == 4
    assert {lv.device for lv in cfg.cascade.levels} == {"cpu"} and {lv.num_threads for lv in cfg.cascade.levels} == {2}


@pytest.mark.parametrize(("change", "message"), [
    ({"engine_kwargs": {"gpu_memory_utilization": 0.9}}, r"\['gpu_memory_utilization'\] are vLLM engine settings"),
    ({"lora_config": {"dynamic_lora_loading_path": "s3://x"}}, r"lora_config: not supported"),
    ({"llm_engine": "SGLang"}, r"llm_engine"),
    ({"model_loading_config": {"model_id": "m", "model_source": {"bucket_uri": "s3://b/m"}}}, r"cloud mirrors"),
    ({"model_loading_config": {"model_source": "x"}}, r"model_id is required"),
    ({"placement_group_config": {"bundles": [{"GPU": 1}]}}, r"only `strategy`"),
    ({"experimental_configs": {"specray": {"levels": []}}}, r"\['levels'\] unknown"),
])
def test_llm_config_errors_name_what_does_not_map(change, message):
    with pytest.raises(ConfigMappingError, match=message):
        app_from_llm_config({**LLM_CONFIG, **change})


def test_one_model_per_application():
    with pytest.raises(ConfigMappingError, match="one model per application"):
        app_from_llm_serving_args({"llm_configs": [LLM_CONFIG, LLM_CONFIG]})
    with pytest.raises(ConfigMappingError, match="give only llm_configs"):
        app_from_llm_serving_args({"llm_configs": [LLM_CONFIG], "ingress_deployment_config": {"num_replicas": 2}})


def test_llm_config_from_a_yaml_path(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(LLM_CONFIG))
    assert app_from_llm_serving_args({"llm_configs": [str(path)]}) == app_from_llm_config(LLM_CONFIG)
    with pytest.raises(ConfigMappingError, match="no such file"):
        app_from_llm_serving_args({"llm_configs": [str(tmp_path / "missing.yaml")]})


def test_build_app_args_in_every_shape():
    from specray.serve.app import app_config_from_args

    cfg, opts = app_config_from_args({"llm_configs": [LLM_CONFIG]})
    assert cfg.server.model_name == "qwen-1.5b" and opts["max_ongoing_requests"] == 40
    flat, opts = app_config_from_args({"config": {"model": "t", "max_num_seqs": 3}})
    assert _levels(flat) == [("hf", "t", 4)] and flat.server.max_batch_size == 3 and opts == {}


def test_ray_serve_llm_accepts_the_tiny_yaml_too():
    """The test YAML is a genuine Ray Serve LLM config (needs ray[llm]'s own dependencies)."""
    from pathlib import Path

    llm = pytest.importorskip("ray.serve.llm")
    text = (Path(__file__).parents[1] / "ray" / "serve_config_llm_tiny.yaml").read_text()
    app = yaml.safe_load(text.replace("${TINY_MID}", "/m").replace("${TINY_TARGET}", "/t"))["applications"][0]
    llm.LLMServingArgs.model_validate(app["args"])
