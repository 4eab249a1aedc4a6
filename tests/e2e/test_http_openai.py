"""The OpenAI-compatible API over real HTTP on 127.0.0.1, driven by the official `openai` client.

Levels run in-process here (tiny fp32 models) so the HTTP layer is tested without a Ray cluster;
tests/ray/test_app.py runs the same API through Ray Serve with one actor per level.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.serve.replica import Coordinator
from tests.e2e.conftest import MODEL, Server, app_config


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and set(h["levels"]) == {"ngram", "mid", "target"}
    plan = h["planner"]  # the live planner's view: held plan and best candidates at the running batch
    assert plan["batch"] >= 1 and plan["current"].endswith("target") and plan["ranked"]
    assert all(r["plan"].endswith("target") and r["goodput"] > 0 for r in plan["ranked"])


def test_completion_non_stream_greedy_equals_plain(client, server):
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    spec = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True, "speculation": {"method": "none"}})
    assert r.choices[0].text == spec.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    usage = r.model_dump()["usage"]
    assert "target" in usage["speculation"] and usage["speculation"]["target"]["draft_tokens"] > 0


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "user", "content": "Write a function."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content


def test_seed_reproducible_and_stop(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    # whatever drafts (the planner's choice or a forced plan), a seeded request gives the same text
    for method in ("none", "ngram", "draft", "cascade"):
        c = client.completions.create(seed=7, **{**kw, "extra_body": {"ignore_eos": True,
                                                                      "speculation": {"method": method}}})
        assert c.choices[0].text == a, method
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:6]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert ei.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"temperature": 5}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"n": 0},
    {"max_tokens": 100000}, {"speculation": {"method": "warp"}}, {"speculation": {"num_speculative_tokens": 999}},
    {"stop": ["a", "b", "c", "d", "e"]}, {"prompt": ""}, {"repetition_penalty": 0},
])
def test_invalid_parameters_are_400_with_openai_body(client, bad):
    kw = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **bad}
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(**{k: v for k, v in kw.items() if k in ("model", "prompt", "max_tokens")},
                                  extra_body={k: v for k, v in kw.items() if k not in ("model", "prompt", "max_tokens")}
                                  if bad.keys() - {"model", "prompt", "max_tokens"} else None)
    err = ei.value.body
    assert err["type"] == "invalid_request_error" and err["message"]


def test_malformed_json_and_content_type(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code in (400, 415) and "error" in r.json()


def test_metrics_counters_equal_sum_of_usage(server, client):
    before = _counter(httpx.get(server.url + "/metrics").text, "spec_decode_num_draft_tokens_total", "target")
    total = 0
    for p in ["a b a b a b", "def f(x):", "1 2 3 1 2 3"]:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        total += r.model_dump()["usage"]["speculation"]["target"]["draft_tokens"]
    after = _counter(httpx.get(server.url + "/metrics").text, "spec_decode_num_draft_tokens_total", "target")
    assert after - before == total


def test_planner_rounds_by_reason_on_metrics(server, client):
    """`specray_planner_rounds_total` / `_round_seconds_total`: rounds of a request that fixed its own speculation are
    counted as `reason="request"` (the planner was not asked), the planner's own rounds under its reason."""
    def rounds() -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
            for smp in fam.samples:
                if smp.name in ("specray_planner_rounds_total", "specray_planner_round_seconds_total"):
                    k = f"{smp.name}:{smp.labels['reason']}"
                    out[k] = out.get(k, 0.0) + smp.value
        return out

    before = rounds()
    client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True, "speculation": {"method": "none"}})
    mid = rounds()
    client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    after = rounds()
    grew = lambda a, b, key: b.get(key, 0.0) - a.get(key, 0.0)
    assert grew(before, mid, "specray_planner_rounds_total:request") >= 1
    assert grew(before, mid, "specray_planner_round_seconds_total:request") > 0
    assert {k for k in mid if grew(before, mid, k)} <= {"specray_planner_rounds_total:request",
                                                          "specray_planner_round_seconds_total:request"}
    planned = {k.split(":")[1] for k in after if grew(mid, after, k) and k.startswith("specray_planner_rounds")}
    assert planned and planned <= {"ranked", "hold", "warmup", "explore", "plain_probe"}


def _counter(text: str, name: str, level: str) -> float:
    """The samples of vLLM's `vllm:<name>` for `level`, summed over its drafter -> verifier pairs."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:" + name and s.labels.get("level") == level)


def test_api_key(tiny):
    srv = Server(Coordinator(app_config(tiny, api_key="sekrit")))
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open for probes
    finally:
        srv.stop()


def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True, "temperature": 0, "ignore_eos": True,
    }) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    json.loads(lines[0][6:])


def test_chat_role_chunk_goes_out_with_the_first_token(server, client):
    """A client times the first token by the first chunk: the assistant role must not go out before the first
    token is computed (vLLM sends it then too). The first round is held back 0.5 s here."""
    import time

    coord = server.coord
    run = coord.run

    async def slow_first(req):
        import asyncio

        await asyncio.sleep(0.5)
        async for ev in run(req):
            yield ev

    coord.run = slow_first
    try:
        t0 = time.monotonic()
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, stream=True)
        first = next(iter(stream))
        waited = time.monotonic() - t0
        rest = list(stream)
    finally:
        del coord.run
    assert waited >= 0.5, f"the first chunk came {waited:.3f}s after the request, before any token"
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices)


def test_planner_trace_file_has_a_line_per_planned_round(tiny, tmp_path):
    """`policy.trace_file`: one JSON line per round the planner chose for, with its measured seconds; a ranked round
    also names the best candidates and plain decoding with their predicted goodput and round time."""
    cfg = app_config(tiny)
    path = tmp_path / "planner.jsonl"
    cfg.policy.trace_file = str(path)
    srv = Server(Coordinator(cfg))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for prompt in ("def add(a, b):", "class Stack:"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        metrics = httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    planned = sum(s.value for fam in text_string_to_metric_families(metrics) for s in fam.samples
                  if s.name == "specray_planner_rounds_total" and s.labels["reason"] != "request")
    assert len(records) == planned >= 2
    assert all(r["batch"] == 1 and r["round_s"] > 0 and r["plan"].endswith("target") for r in records)
    reasons = {r["reason"] for r in records}
    assert reasons <= {"ranked", "hold", "warmup", "explore", "plain_probe"} and reasons & {"ranked", "warmup"}
    for r in records:
        if r["reason"] == "hold":
            assert "top" not in r
            continue
        assert r["top"] and r["plain"]["plan"] == "target" and r["plain"]["goodput"] > 0
        assert all(c["round_s"] > 0 and c["tokens_per_round"] >= 1 for c in (*r["top"], r["plain"]))
        assert r["predicted_s"] > 0 and r["backlog"]["remaining"] > 0
