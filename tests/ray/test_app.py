"""The Serve application on a real local Ray: one actor per level, HTTP via the openai client, handle API."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from specray.serve.localcluster import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def tiny_app_args(tiny) -> dict:
    """The tiny test config (tests/ray/serve_config_tiny.yaml) with this session's model folders."""
    text = (Path(__file__).parent / "serve_config_tiny.yaml").read_text()
    text = text.replace("${TINY_MID}", str(tiny.draft_dirs["mid"])).replace("${TINY_TARGET}", str(tiny.target_dir))
    return yaml.safe_load(text)


@pytest.fixture(scope="module")
def serve_app(tiny):
    import ray
    from ray import serve

    from specray.serve.app import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    cfg = tiny_app_args(tiny)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_cfg = cfg["applications"][0]
    handle = serve.run(build_app(app_cfg["args"]), name=app_cfg["name"], route_prefix="/")
    try:
        yield handle, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_tiny_serve_config_validates(tiny):
    from ray.serve.schema import ServeDeploySchema

    from specray.config import AppConfig

    cfg = tiny_app_args(tiny)
    ServeDeploySchema.model_validate(cfg)
    AppConfig.model_validate(cfg["applications"][0]["args"]["config"])


def test_root_serve_config_validates():
    from ray.serve.schema import ServeDeploySchema

    from specray.config import AppConfig, vllm_installed

    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(cfg)
    app = AppConfig.model_validate(cfg["applications"][0]["args"]["config"])
    target = "vllm" if vllm_installed() else "hf"  # `kind: auto`: the vLLM engine where it is installed
    assert [lv.kind for lv in app.cascade.levels] == ["ngram", "hf", target]
    assert app.cascade.levels[-1].engine_verify == (16 if target == "vllm" else 0)
    assert cfg["http_options"]["host"] == "127.0.0.1"


def test_root_serve_config_starts_on_hf_without_vllm(monkeypatch, caplog):
    """On a machine without vLLM the default config still validates: its target runs on hf, and the log says why."""
    from specray.config import AppConfig

    monkeypatch.setenv("SPECRAY_NO_VLLM", "1")
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    with caplog.at_level("WARNING", logger="specray.config"):
        app = AppConfig.model_validate(cfg["applications"][0]["args"]["config"])
    assert [lv.kind for lv in app.cascade.levels] == ["ngram", "hf", "hf"]
    assert app.cascade.levels[-1].engine_verify == 0 and app.cascade.levels[-1].engine_args == {}
    assert "vLLM is not installed" in caplog.text and "engine_verify" in caplog.text


def test_openai_client_through_serve(serve_app):
    _, url = serve_app
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    kw = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    spec = client.completions.create(**kw)
    plain = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "speculation": {"method": "none"}}})
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_dump()["usage"]["speculation"]["target"]["draft_tokens"] > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-3)
    metrics = httpx.get(url + "/metrics").text
    assert "spec_decode_num_draft_tokens_total" in metrics
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok"
    target = health["levels"]["target"]  # the level actors' direct transport: requests served, idle between them
    assert target["transport_requests"] >= 4 and target["transport_busy_s"] > 0 and target["transport_idle_s"] > 0


def test_per_request_model_tree_through_serve(serve_app):
    """`speculation.tree` over HTTP with the openai client: the mid model drafts token trees for the target
    (greedy text == plain), `tree: false` drafts chains; usage.speculation and /metrics count the trees."""
    from prometheus_client.parser import text_string_to_metric_families

    _, url = serve_app
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt="class Stack:\n    def __init__(self):\n        self.items = []\n    def push",
              max_tokens=16, temperature=0)

    def run(spec: dict) -> tuple[str, dict]:
        out = client.completions.create(**kw, extra_body={"ignore_eos": True, "speculation": spec})
        return out.choices[0].text, out.model_dump()["usage"]["speculation"]["target"]

    plain, _ = run({"method": "none"})
    tree_text, tree = run({"method": "draft", "num_speculative_tokens": 3, "tree": {"width": 2, "depth": 3}})
    chain_text, chain = run({"method": "draft", "num_speculative_tokens": 3, "tree": False})
    assert tree_text == chain_text == plain
    assert tree["tree_drafts"] == tree["num_drafts"] > 0 and tree["pairs"]["mid->target"]["tree_nodes"] > 0
    assert tree["tree_nodes"] > tree["num_drafts"] and tree["accepted_tokens"] > 0
    assert "tree_drafts" not in chain and chain["num_drafts"] > 0
    with pytest.raises(openai.BadRequestError, match="tree"):
        client.completions.create(**kw, extra_body={"speculation": {"tree": {"width": 0}}})
    deadline = time.time() + 30
    while True:  # Ray exports the replica's metrics every few seconds
        got = {s.labels.get("pair"): s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in fam.samples if s.name.endswith("spec_decode_num_tree_drafts_total")}
        if got.get("mid->target", 0) > 0 or time.time() > deadline:
            break
        time.sleep(1)
    assert got.get("mid->target", 0) >= tree["tree_drafts"]


def test_handle_api_unary_and_streaming(serve_app):
    handle, _ = serve_app
    out = handle.generate.remote("def fibonacci(n):", max_tokens=12, temperature=0.0, ignore_eos=True).result()
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    plain = handle.generate.remote("def fibonacci(n):", max_tokens=12, ignore_eos=True,
                                   speculation={"method": "none"}).result()
    assert plain["token_ids"] == out["token_ids"]
    chunks = list(handle.options(stream=True).generate_stream.remote("def fibonacci(n):", max_tokens=12,
                                                                     ignore_eos=True))
    assert "".join(c["text"] for c in chunks) == out["text"]
    assert chunks[-1]["finished"] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_eight_concurrent_requests_batch_and_match_alone(serve_app):
    handle, _ = serve_app
    prompts = ["def f(x):", "Hello", "The quick brown fox", "class Stack:", "a b a b", "import os", "x = 1", "for i"]
    lengths = [5, 17, 9, 24, 12, 3, 20, 8]

    async def main():
        resps = [handle.generate.remote(p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
        return [await r for r in resps]

    together = asyncio.run(main())
    for p, n, got in zip(prompts, lengths, together):
        alone = handle.generate.remote(p, max_tokens=n, ignore_eos=True).result()
        assert got["token_ids"] == alone["token_ids"]
    text = httpx.get(serve_app[1] + "/metrics").text
    assert "specray_batch_size" in text


def test_vllm_benchmark_client_through_serve(serve_app, tiny, tmp_path):
    """vLLM's own serving benchmark client against the app deployed on Serve (as `serve run` deploys it): every
    request succeeds and its TTFT agrees with the server's histogram (the one replica's /metrics)."""
    pytest.importorskip("vllm")
    from tests.e2e.test_vllm_bench_client import check_client_against_server

    _, url = serve_app
    check_client_against_server(url, MODEL, str(tiny.target_dir), tmp_path)


def test_coordinator_replica_crash_is_restarted_by_serve(serve_app):
    """Runs last in this module: SIGKILL the coordinator replica; Serve starts a new one (with new level
    actors: the old ones die with their owner) and the app answers again, with the same greedy output."""
    handle, url = serve_app
    before = handle.generate.remote("def fibonacci(n):", max_tokens=10, ignore_eos=True).result()
    health = handle.health.remote().result()
    assert health["status"] == "ok" and set(health["cascade"].values()) == {"up"}
    old = health["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while True:
        try:
            health = handle.health.remote().result(timeout_s=30)
            if health["pid"] != old and health["status"] == "ok":
                break
        except Exception:  # the replica is dead or starting
            pass
        assert time.monotonic() < deadline, "Serve did not restart the coordinator replica"
        time.sleep(1)
    after = handle.generate.remote("def fibonacci(n):", max_tokens=10, ignore_eos=True).result()
    assert after["token_ids"] == before["token_ids"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 10,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == before["text"]
