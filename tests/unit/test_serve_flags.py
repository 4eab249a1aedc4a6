"""`specray serve` flags -> AppConfig, Serve deployment options and HTTP options (pure; nothing is started)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from specray.compat import ConfigMappingError
from specray.config import vllm_installed
from specray.serve.command import add_serve_arguments, config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _config(*argv: str):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def _levels(cfg) -> list[tuple]:
    return [(lv.kind, lv.model, lv.num_speculative_tokens) for lv in cfg.cascade.levels]


def test_the_one_liner():
    cfg, options, http = _config("qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--ngram")
    assert _levels(cfg) == [("ngram", None, 4), ("hf", "qwen2.5-coder-0.5b-instruct", 4),
                            ("hf", "qwen2.5-coder-1.5b-instruct", 4)]
    ng = cfg.cascade.levels[0]
    assert (ng.prompt_lookup_min, ng.prompt_lookup_max, ng.prompt_lookup_occurrence) == (5, 5, "earliest")  # vLLM's
    assert cfg.server.model_name == "qwen2.5-coder-1.5b-instruct"  # vLLM's default served name: the model
    assert options == {} and http == {"host": "127.0.0.1", "port": 8000}


def test_vllm_flags_map_onto_their_fields():
    cfg, _, http = _config("t", "--draft", "d1", "--draft", "d2", "--k", "2", "--k", "6", "--served-model-name", "svc",
                           "--max-model-len", "2048", "--max-num-seqs", "12", "--dtype", "half", "--threads", "2",
                           "--num-cpus", "0.5", "--verify-method", "coupled", "--api-key", "k", "--host", "0.0.0.0",
                           "--port", "9001", "--in-process")
    assert _levels(cfg) == [("hf", "d1", 2), ("hf", "d2", 6), ("hf", "t", 4)]
    assert {(lv.max_context, lv.dtype, lv.num_threads, lv.num_cpus, lv.verify_method.value)
            for lv in cfg.cascade.levels} == {(2048, "float16", 2, 0.5, "coupled")}
    s = cfg.server
    assert (s.model_name, s.max_batch_size, s.api_key, s.in_process) == ("svc", 12, "k", True)
    assert http == {"host": "0.0.0.0", "port": 9001}


def test_speculative_config_json_is_vllms_shape():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    cfg, _, _ = _config("t", "--speculative-config", json.dumps(spec))
    ng = cfg.cascade.levels[0]
    assert (ng.kind, ng.num_speculative_tokens, ng.prompt_lookup_min, ng.prompt_lookup_max) == ("ngram", 3, 4, 4)
    casc = {"method": "cascade", "drafters": [{"method": "ngram", "num_speculative_tokens": 8},
                                              {"method": "draft_model", "model": "d", "num_speculative_tokens": 5}]}
    assert _levels(_config("t", "--speculative-config", json.dumps(casc))[0]) == \
        [("ngram", None, 8), ("hf", "d", 5), ("hf", "t", 4)]


def test_ngram_lookup_flags_follow_vllms_rule():
    ng = _config("t", "--ngram", "--prompt-lookup-max", "3")[0].cascade.levels[0]
    assert (ng.prompt_lookup_min, ng.prompt_lookup_max) == (3, 3)
    ng = _config("t", "--ngram", "--prompt-lookup-min", "1", "--prompt-lookup-max", "4")[0].cascade.levels[0]
    assert (ng.prompt_lookup_min, ng.prompt_lookup_max) == (1, 4)


@pytest.mark.parametrize(("argv", "message"), [
    (("t", "--ngram", "--speculative-config", "{}"), "not both"),
    (("t", "--speculative-config", "{oops"), "not JSON"),
    (("t", "--draft", "d", "--ngram", "--k", "1", "--k", "2", "--k", "3"), "one per drafter"),
    (("t", "--k", "3"), "no drafter"),
    ((), "give MODEL"),
    (("t", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'), "method must be one of"),
])
def test_flag_errors(argv, message):
    with pytest.raises((ConfigMappingError, ValueError), match=message):
        _config(*argv)


def test_config_file_with_flag_overrides(tmp_path):
    """A whole Serve config file: its application args, Coordinator deployment options and http_options are the
    base; flags given override them."""
    cfg, options, http = _config("--config", str(ROOT / "serve_config.yaml"), "--port", "8123",
                                 "--max-num-seqs", "4")
    assert [lv.kind for lv in cfg.cascade.levels] == ["ngram", "hf", "vllm" if vllm_installed() else "hf"]
    assert cfg.cascade.levels[0].num_speculative_tokens == 8 and not cfg.server.overlap  # from the file
    assert [lv.num_threads for lv in cfg.cascade.levels[1:]] == [2, 2]
    assert (cfg.server.model_name, cfg.server.max_batch_size) == ("qwen2.5-coder-1.5b-instruct", 4)
    assert options["max_ongoing_requests"] == 40 and "autoscaling_config" in options
    assert http == {"host": "127.0.0.1", "port": 8123}
    # MODEL replaces the file's levels (and names the served model, as vLLM), keeping the rest of the file
    cfg, _, _ = _config("--config", str(ROOT / "serve_config.yaml"), "other", "--draft", "small")
    assert _levels(cfg) == [("hf", "small", 4), ("hf", "other", 4)]
    assert cfg.server.model_name == "other" and not cfg.server.overlap and cfg.cascade.placement.strategy == "PACK"
    # an AppConfig file in vLLM's flat names, and a Ray Serve LLM llm_configs file
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"model": "t", "max_num_seqs": 5, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 2}}))
    cfg, _, _ = _config("--config", str(flat))
    assert _levels(cfg) == [("ngram", None, 2), ("hf", "t", 4)] and cfg.server.max_batch_size == 5
    llm = tmp_path / "llm.yaml"
    llm.write_text(yaml.safe_dump({"llm_configs": [{"model_loading_config": {"model_id": "m", "model_source": "t"},
                                                    "deployment_config": {"num_replicas": 2}}]}))
    cfg, options, _ = _config("--config", str(llm))
    assert cfg.server.model_name == "m" and options == {"num_replicas": 2}


def test_deployment_options_reach_the_coordinator_deployment():
    """The Serve file's Coordinator options (a custom autoscaling policy included) and Ray Serve LLM's
    deployment_config are the deployment's; GPUs asked for there stay with the model levels."""
    from specray.serve.app import build_coordinator_app

    cfg, options, _ = _config("--config", str(ROOT / "serve_config.yaml"))
    dep = build_coordinator_app(cfg, options)._bound_deployment
    assert dep.name == "Coordinator" and dep.max_ongoing_requests == 40 and dep.ray_actor_options == {"num_cpus": 0}
    assert dep._deployment_config.autoscaling_config.policy.policy_function.endswith(":CoordinatorPolicy")
    cfg, _, _ = _config("t")
    dep = build_coordinator_app(cfg, {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1}})._bound_deployment
    assert dep.num_replicas == 2 and dep.ray_actor_options == {"num_cpus": 0.5}
    assert dep.max_ongoing_requests == 2 * cfg.server.max_batch_size + 8  # specray's default kept
