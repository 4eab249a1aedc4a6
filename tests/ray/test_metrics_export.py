"""Cluster-wide metrics through Ray's metrics pipeline: two Coordinator replicas behind the Serve proxy, requests
over HTTP, and the node metrics agent's Prometheus endpoint scraped with real HTTP after every batch.

What must hold: the exported counters' increase equals the sum of the responses' usage (tokens, and the speculation
counts of every drafter -> verifier pair), scrape after scrape, whatever replica served each request; the queue
gauges come back to 0 when idle. A replica's own `/metrics` route only shows that replica.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.metrics import CATALOG
from specray.serve.localcluster import free_port
from tests.ray.test_app import tiny_app_args

pytestmark = pytest.mark.ray

MODEL = "tiny"
APP = "specray"
#: Ray's report interval for this test (default 10 s; Ray never reports more often than every second)
REPORT_MS = 1000
PROMPTS = ["def fibonacci(n):", "a b a b a b a b", "The quick brown fox", "class Stack:", "import os", "x = 1; y = 2"]


@pytest.fixture(scope="module")
def cluster_app(tiny):
    import ray
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    metrics_port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": REPORT_MS},
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    cfg = tiny_app_args(tiny)  # tests/ray/serve_config_tiny.yaml, deployed as `serve deploy` would, 2 replicas
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["deployments"][0]["num_replicas"] = 2
    client = serve_start(http_options=cfg["http_options"], proxy_location=cfg["proxy_location"])
    try:
        client.deploy_apps(ServeDeploySchema.model_validate(cfg), _blocking=True)
        node = ray.nodes()[0]
        assert node["MetricsExportPort"] == metrics_port
        yield f"http://127.0.0.1:{port}", f"http://{node['NodeManagerAddress']}:{metrics_port}/metrics"
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def scrape(url: str) -> list:
    """specray's samples on the node metrics agent (its body also holds every Ray and Serve metric)."""
    text = httpx.get(url, timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(("ray_vllm_", "ray_specray_"))]


def totals(samples: list) -> Counter:
    """Counter values summed over replicas, keyed like `expected` builds them."""
    out: Counter = Counter()
    for s in samples:
        lb = s.labels
        if s.name == "ray_vllm_request_success_total":
            out["requests", lb["finished_reason"]] += s.value
        elif s.name in ("ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total"):
            out[s.name] += s.value
        elif s.name.startswith("ray_vllm_spec_decode_num_") and "position" not in lb:
            out[s.name, lb["level"], lb["pair"]] += s.value
        elif s.name == "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total":
            out["per_pos", lb["level"], lb["pair"]] += s.value
    return out


def expected(responses: list[dict]) -> Counter:
    out: Counter = Counter()
    for r in responses:
        usage = r["usage"]
        out["requests", r["choices"][0]["finish_reason"]] += 1
        out["ray_vllm_prompt_tokens_total"] += usage["prompt_tokens"]
        out["ray_vllm_generation_tokens_total"] += usage["completion_tokens"]
        for level, st in (usage.get("speculation") or {}).items():
            assert sum(p["draft_tokens"] for p in st["pairs"].values()) == st["draft_tokens"]
            for pair, ps in st["pairs"].items():
                assert pair.endswith("->" + level)
                for field, name in (("num_drafts", "ray_vllm_spec_decode_num_drafts_total"),
                                    ("draft_tokens", "ray_vllm_spec_decode_num_draft_tokens_total"),
                                    ("accepted_tokens", "ray_vllm_spec_decode_num_accepted_tokens_total")):
                    out[name, level, pair] += ps[field]
                out["per_pos", level, pair] += ps["accepted_tokens"]
    return +out  # zero counts are never exported


async def batch(url: str, n: int, offset: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> dict:
            body = {"model": MODEL, "prompt": PROMPTS[(offset + i) % len(PROMPTS)], "max_tokens": 6 + (i * 5) % 17,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*[one(i) for i in range(n)])


def converge(metrics_url: str, want: Counter, timeout: float = 30.0) -> list:
    """Scrape until the exported counters equal `want` (Ray reports every REPORT_MS); fail on overshoot."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(metrics_url)
        got = totals(samples)
        if got == want:
            return samples
        over = {k: (got[k], want[k]) for k in got if got[k] > want[k]}
        assert not over, f"exported counters above the responses' usage (counted twice?): {over}"
        assert time.monotonic() < deadline, f"exported {dict(got)} != usage {dict(want)}"
        time.sleep(REPORT_MS / 1000)


def test_two_replicas_exported_counters_equal_summed_usage_scrape_after_scrape(cluster_app):
    url, metrics_url = cluster_app
    responses: list[dict] = []
    replicas: set[str] = set()
    for b in range(3):
        responses += asyncio.run(batch(url, 8, offset=b))
        samples = converge(metrics_url, expected(responses))
        replicas |= {s.labels["replica"] for s in samples if s.name == "ray_vllm_request_success_total"}
    assert any(key[0] == "ray_vllm_spec_decode_num_drafts_total" for key in expected(responses))  # it speculated
    assert len(replicas) == 2, f"requests reached {replicas}"  # both replicas served, the sums still agree
    # the labels a series carries: vLLM's model_name, specray's level and pair, Serve's replica labels
    drafts = [s for s in samples if s.name == "ray_vllm_spec_decode_num_drafts_total"]
    assert {"model_name", "level", "pair", "deployment", "replica", "application"} <= set(drafts[0].labels)
    assert {s.labels["deployment"] for s in drafts} == {"Coordinator"} and drafts[0].labels["model_name"] == MODEL
    # idle: the queue gauges of both replicas are back to 0
    deadline = time.monotonic() + 15
    while True:
        gauges = [s for s in scrape(metrics_url) if s.name in ("ray_vllm_num_requests_running",
                                                                "ray_vllm_num_requests_waiting")]
        if gauges and all(s.value == 0 for s in gauges):
            break
        assert time.monotonic() < deadline, gauges
        time.sleep(REPORT_MS / 1000)
    # every metric the replicas recorded comes out under the name `MetricSpec.exported` gives
    exported = {s.name for s in scrape(metrics_url)}
    recorded = {"vllm:spec_decode_num_drafts", "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "specray_requests",
                "specray_round_latency_seconds", "specray_batch_size", "specray_plan_sequences"}
    for spec in CATALOG:
        if spec.name in recorded:
            assert set(spec.exported) <= exported, (spec.name, spec.exported)
    # one replica's own route: that replica's registry (vLLM's names), never more than the cluster's total
    own = [s for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in fam.samples
           if s.name == "vllm:request_success_total"]
    assert 0 < sum(s.value for s in own) <= len(responses)

