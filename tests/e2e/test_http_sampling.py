"""vLLM's sampling surface over real HTTP with the official `openai` client: logprobs / top_logprobs (chat and
completions, streamed and not), n > 1, penalties and min_p, stream_options, and clear 400s for what stays
unsupported. In-process tiny fp32 levels (ngram -> mid -> target), as in test_http_openai.py.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from specray.config import AppConfig
from specray.serve.replica import Coordinator
from specray.testing.fake import FakeWorker
from tests.e2e.conftest import MODEL, Server

GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.4, "repetition_penalty": 1.3}



def _extra(**kw) -> dict:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"], **kw}}


def test_a_vllm_request_body_with_its_sampling_extras_succeeds(server):
    body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0.8, "top_p": 0.95,
            "top_k": 20, "min_p": 0.05, "seed": 3, "n": 2, "logprobs": 2, **PENALTIES, "ignore_eos": True,
            "stop_token_ids": [], "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0,
            "prompt_logprobs": None, "truncate_prompt_tokens": None, "priority": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 16
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in out["choices"])
    chat = {k: v for k, v in body.items() if k not in ("prompt", "logprobs")}
    chat |= {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2,
             "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert all(ev["usage"] is not None for ev in events)  # continuous usage: on every chunk
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 16


def test_chat_logprobs_shape_and_equal_to_plain_decoding(client):
    msgs = [{"role": "user", "content": "Write a function."}]
    kw = dict(messages=msgs, max_tokens=10, logprobs=True, top_logprobs=3)
    spec = client.chat.completions.create(**kw, **_extra(speculation={"method": "cascade"}))
    plain = client.chat.completions.create(**kw, **_extra(speculation={"method": "none"}))
    content = spec.choices[0].logprobs.content
    assert len(content) == spec.usage.completion_tokens == 10
    assert spec.usage.model_dump()["speculation"]["target"]["draft_tokens"] > 0  # really speculated
    for e, p in zip(content, plain.choices[0].logprobs.content, strict=True):
        assert e.token == p.token and abs(e.logprob - p.logprob) < 1e-4
        assert e.bytes == list(e.token.encode("utf-8")) and e.logprob <= 0
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the top token
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    # streamed: the chunks' logprobs, in order, are the whole answer's
    chunks = list(client.chat.completions.create(stream=True, **kw, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    # without logprobs, none come back
    assert client.chat.completions.create(messages=msgs, max_tokens=3, **GREEDY).choices[0].logprobs is None


def test_completion_logprobs_shape_stream_and_offsets(client):
    kw = dict(prompt="The quick brown fox", max_tokens=12, logprobs=2)
    r = client.completions.create(**kw, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset[0] == 0
    for i, (tok, top) in enumerate(zip(lp.tokens, lp.top_logprobs)):
        assert tok in top and len(top) <= 3 and abs(top[tok] - lp.token_logprobs[i]) < 1e-6
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    chunks = list(client.completions.create(stream=True, **kw, **GREEDY))
    got = [(t, o) for c in chunks if c.choices and c.choices[0].logprobs
           for t, o in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.text_offset)]
    assert got == list(zip(lp.tokens, lp.text_offset))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_n_choices_seeded_streamed_and_summed(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == client.completions.create(
        **{**kw, "max_tokens": 1}).usage.prompt_tokens
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3  # independent samples
    assert texts[0] == client.completions.create(**kw).choices[0].text  # choice i has seed + i
    assert texts[1] == client.completions.create(**{**kw, "seed": 6}).choices[0].text
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    by_index = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert [by_index[i] for i in range(3)] == texts
    assert chunks[-1].usage.completion_tokens == 36 and not chunks[-1].choices
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                               max_tokens=6, temperature=1.0, seed=1, stream=True))
    roles = [c.choices[0].index for c in chat if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = [c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_greedy_n_gives_identical_choices(client):
    r = client.completions.create(prompt="def f(x):", max_tokens=8, n=3, **GREEDY)
    assert len({c.text for c in r.choices}) == 1 and len(r.choices) == 3


def test_penalties_and_min_p_through_http_equal_plain_decoding(client):
    kw = dict(prompt="The quick brown fox jumps over the lazy dog. The quick brown", max_tokens=16)  # it repeats
    spec = client.completions.create(**kw, **_extra(**PENALTIES, min_p=0.1, speculation={"method": "cascade"}))
    plain = client.completions.create(**kw, **_extra(**PENALTIES, min_p=0.1, speculation={"method": "none"}))
    bare = client.completions.create(**kw, **GREEDY)
    assert spec.choices[0].text == plain.choices[0].text != bare.choices[0].text
    chat = dict(messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=12)
    a = client.chat.completions.create(**chat, presence_penalty=1.5, frequency_penalty=1.0,
                                       **_extra(speculation={"method": "cascade"}))
    b = client.chat.completions.create(**chat, presence_penalty=1.5, frequency_penalty=1.0,
                                       **_extra(speculation={"method": "none"}))
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("path,body,param", [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"echo": True}, "echo"),
])
def test_unsupported_or_invalid_fields_are_400_naming_the_field(server, path, body, param):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {"prompt": "hi"})
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}",
                   json={"model": MODEL, "max_tokens": 2, **base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


class _NoExtras(FakeWorker):
    """A target whose backend declares neither penalties nor log-probabilities (as a vLLM level)."""

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), penalties=False, logprobs=False)


def test_a_target_without_the_ability_refuses_with_a_400_naming_the_field():
    cfg = AppConfig.model_validate({
        "cascade": {"levels": [{"kind": "hf", "model": "unused", "name": "target"}]},
        "server": {"model_name": MODEL, "in_process": True},
    })
    srv = Server(Coordinator(cfg, factories=[lambda: _NoExtras("target", vocab=16)]))
    try:
        url = srv.url + "/v1/completions"
        ok = httpx.post(url, json={"model": MODEL, "prompt": [1, 2], "max_tokens": 3, "min_p": 0.2}, timeout=60)
        assert ok.status_code == 200, ok.text  # min_p is part of the shared sampling code: every backend has it
        for field, value in [("repetition_penalty", 1.2), ("frequency_penalty", 0.5), ("logprobs", 1)]:
            r = httpx.post(url, json={"model": MODEL, "prompt": [1, 2], "max_tokens": 3, field: value}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and "target" in err["message"], err
    finally:
        srv.stop()
