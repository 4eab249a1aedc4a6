"""Bad input over real HTTP: every malformed, mistyped, out-of-range or hostile request gets a 4xx with an
OpenAI error body {"error": {"message", "type", "param", "code"}} whose message names the offending field,
and the server keeps serving (a valid request succeeds afterwards). Raw httpx (and a raw socket for lying
headers), not the openai client, so the exact bytes on the wire are under the test's control.

The server runs with a small context (MAX_CTX tokens) and body limit (LIMIT bytes) so both are easy to exceed.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specray.serve.replica import Coordinator
from tests.e2e.conftest import MODEL, Server, app_config

MAX_CTX = 128
LIMIT = 8192
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def srv(tiny):
    s = Server(Coordinator(app_config(tiny, max_context=MAX_CTX, max_request_bytes=LIMIT)))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def comp(**kw: Any) -> dict[str, Any]:
    """A valid completion request with `kw` merged in (a value of ... deletes the key)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}
    return {k: v for k, v in body.items() if v is not ...}


def chat(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}
    return {k: v for k, v in body.items() if v is not ...}


def msg(**kw: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": "Hi", **kw}])


def raw(body: dict[str, Any] | str) -> bytes:
    """JSON as Python writes it: NaN and Infinity are emitted as bare literals (not valid JSON)."""
    return (json.dumps(body) if isinstance(body, dict) else body).encode()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, *words: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
        assert param in err["message"], err
    for w in words:
        assert w in err["message"], err
    return err


LONG_TEXT = " ".join(f"word{i}" for i in range(300))  # far more than MAX_CTX tokens

# (id, path, json body, status, param, words in the message)
JSON_CASES: list[tuple[str, str, Any, int, str | None, tuple[str, ...]]] = [
    # model
    ("model-missing", COMPLETIONS, comp(model=...), 400, "model", ("required",)),
    ("model-int", COMPLETIONS, comp(model=123), 400, "model", ("string",)),
    ("model-null", COMPLETIONS, comp(model=None), 400, "model", ()),
    ("model-unknown", COMPLETIONS, comp(model="nope"), 404, "model", ("nope",)),
    ("model-unknown-chat", CHAT, chat(model="gpt-4o"), 404, "model", ("gpt-4o",)),
    # prompt
    ("prompt-missing", COMPLETIONS, comp(prompt=...), 400, "prompt", ("required",)),
    ("prompt-empty", COMPLETIONS, comp(prompt=""), 400, "prompt", ("empty",)),
    ("prompt-int", COMPLETIONS, comp(prompt=5), 400, "prompt", ()),
    ("prompt-null", COMPLETIONS, comp(prompt=None), 400, "prompt", ()),
    ("prompt-dict", COMPLETIONS, comp(prompt={"text": "hi"}), 400, "prompt", ()),
    ("prompt-batch", COMPLETIONS, comp(prompt=["a", "b"]), 400, "prompt", ("one prompt",)),
    ("prompt-empty-ids", COMPLETIONS, comp(prompt=[]), 400, "prompt", ("empty",)),
    ("prompt-negative-id", COMPLETIONS, comp(prompt=[1, -3]), 400, "prompt", ("non-negative",)),
    ("prompt-id-outside-vocab", COMPLETIONS, comp(prompt=[1, 10**9]), 400, "prompt", ("vocabulary",)),
    ("prompt-id-2**70", COMPLETIONS, comp(prompt=[2**70]), 400, "prompt", ("vocabulary",)),
    ("prompt-float-ids", COMPLETIONS, comp(prompt=[1.5, 2]), 400, "prompt", ()),
    ("prompt-bool-ids", COMPLETIONS, comp(prompt=[True]), 400, "prompt", ()),
    ("prompt-mixed-ids", COMPLETIONS, comp(prompt=[1, "a"]), 400, "prompt", ()),
    ("prompt-too-long", COMPLETIONS, comp(prompt=LONG_TEXT, max_tokens=None), 400, "prompt", (str(MAX_CTX),)),
    ("prompt-ids-too-long", COMPLETIONS, comp(prompt=[5] * MAX_CTX), 400, "prompt", (str(MAX_CTX),)),
    # max_tokens
    ("max_tokens-0", COMPLETIONS, comp(max_tokens=0), 400, "max_tokens", (">= 1",)),
    ("max_tokens--1", COMPLETIONS, comp(max_tokens=-1), 400, "max_tokens", (">= 1",)),
    ("max_tokens-huge", COMPLETIONS, comp(max_tokens=10**6), 400, "max_tokens", (str(MAX_CTX),)),
    ("max_tokens-2**64", COMPLETIONS, comp(max_tokens=2**64), 400, "max_tokens", ()),
    ("max_tokens-over-room", COMPLETIONS, comp(prompt=[5] * (MAX_CTX - 2), max_tokens=3), 400, "max_tokens",
     (str(MAX_CTX),)),
    ("max_tokens-string", COMPLETIONS, comp(max_tokens="5"), 400, "max_tokens", ()),
    ("max_tokens-float", COMPLETIONS, comp(max_tokens=2.5), 400, "max_tokens", ()),
    # temperature / top_p / top_k / seed
    ("temperature--1", COMPLETIONS, comp(temperature=-1), 400, "temperature", (">= 0",)),
    ("temperature-2.5", COMPLETIONS, comp(temperature=2.5), 400, "temperature", ("<= 2",)),
    ("temperature-string", COMPLETIONS, comp(temperature="hot"), 400, "temperature", ()),
    ("temperature-list", COMPLETIONS, comp(temperature=[1]), 400, "temperature", ()),
    ("top_p-0", COMPLETIONS, comp(top_p=0), 400, "top_p", ("> 0",)),
    ("top_p-1.01", COMPLETIONS, comp(top_p=1.01), 400, "top_p", ("<= 1",)),
    ("top_p--0.5", COMPLETIONS, comp(top_p=-0.5), 400, "top_p", ("> 0",)),
    ("top_k--5", COMPLETIONS, comp(top_k=-5), 400, "top_k", (">= -1",)),
    ("top_k-float", COMPLETIONS, comp(top_k=1.5), 400, "top_k", ()),
    ("seed--1", COMPLETIONS, comp(seed=-1), 400, "seed", (">= 0",)),
    ("seed-2**64", COMPLETIONS, comp(seed=2**64), 400, "seed", ()),
    ("seed-string", COMPLETIONS, comp(seed="42"), 400, "seed", ()),
    # stop
    ("stop-5-entries", COMPLETIONS, comp(stop=["a", "b", "c", "d", "e"]), 400, "stop", ("at most 4",)),
    ("stop-non-string", COMPLETIONS, comp(stop=[1, 2]), 400, "stop[0]", ()),
    ("stop-empty-string", COMPLETIONS, comp(stop=[""]), 400, "stop", ("empty",)),
    ("stop-int", COMPLETIONS, comp(stop=5), 400, "stop", ()),
    ("stop-nested", COMPLETIONS, comp(stop=[["a"]]), 400, "stop[0]", ()),
    # unsupported OpenAI parameters
    ("n-65", COMPLETIONS, comp(n=65), 400, "n", ("<= 64",)),
    ("n-0", COMPLETIONS, comp(n=0), 400, "n", ()),
    ("best_of-3", COMPLETIONS, comp(best_of=3), 400, "best_of", ()),
    ("echo-true", COMPLETIONS, comp(echo=True), 400, "echo", ()),
    ("logprobs-21", COMPLETIONS, comp(logprobs=21), 400, "logprobs", ("<= 20",)),
    ("suffix", COMPLETIONS, comp(suffix="end"), 400, "suffix", ()),
    ("presence_penalty", COMPLETIONS, comp(presence_penalty=2.5), 400, "presence_penalty", ("<= 2",)),
    ("frequency_penalty-nan-ish", COMPLETIONS, comp(frequency_penalty="x"), 400, "frequency_penalty", ()),
    ("logit_bias", COMPLETIONS, comp(logit_bias={"5": 10}), 400, "logit_bias", ()),
    ("stream-string", COMPLETIONS, comp(stream="yes"), 400, "stream", ()),
    ("stream-int", COMPLETIONS, comp(stream=1), 400, "stream", ()),
    ("stream_options-without-stream", COMPLETIONS, comp(stream_options={"include_usage": True}), 400,
     "stream_options", ()),
    ("stream_options-unknown-key", COMPLETIONS, comp(stream=True, stream_options={"x": 1}), 400,
     "stream_options.x", ("unknown field",)),
    ("ignore_eos-string", COMPLETIONS, comp(ignore_eos="no"), 400, "ignore_eos", ()),
    ("user-int", COMPLETIONS, comp(user=5), 400, "user", ()),
    # vLLM's extra parameters: out of range, or not implemented and accepted only where they mean "off"
    ("repetition_penalty", COMPLETIONS, comp(repetition_penalty=-1), 400, "repetition_penalty", ("> 0",)),
    ("min_p", COMPLETIONS, comp(min_p=2), 400, "min_p", ("<= 1",)),
    ("min_tokens", CHAT, chat(min_tokens=5), 400, "min_tokens", ()),
    ("guided_json", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json", ("null",)),
    ("chat-echo", CHAT, chat(echo=True), 400, "echo", ()),
    ("chat-template", CHAT, chat(chat_template="{{ x }}"), 400, "chat_template", ()),
    ("stop_token_ids-negative", COMPLETIONS, comp(stop_token_ids=[-1]), 400, "stop_token_ids", (">= 0",)),
    ("stop_token_ids-over-vocab", COMPLETIONS, comp(stop_token_ids=[10**9]), 400, "stop_token_ids", ()),
    # speculation extension
    ("speculation-unknown-method", COMPLETIONS, comp(speculation={"method": "warp"}), 400, "speculation.method",
     ("none",)),
    ("speculation-K-0", COMPLETIONS, comp(speculation={"num_speculative_tokens": 0}), 400,
     "speculation.num_speculative_tokens", (">= 1",)),
    ("speculation-K-999", COMPLETIONS, comp(speculation={"num_speculative_tokens": 999}), 400,
     "speculation.num_speculative_tokens", ("<= 32",)),
    ("speculation-K-string", COMPLETIONS, comp(speculation={"num_speculative_tokens": "4"}), 400,
     "speculation.num_speculative_tokens", ()),
    ("speculation-unknown-key", COMPLETIONS, comp(speculation={"depth": 3}), 400, "speculation.depth",
     ("unknown field",)),
    ("speculation-bad-verify", COMPLETIONS, comp(speculation={"verify_method": "magic"}), 400,
     "speculation.verify_method", ()),
    ("speculation-string", COMPLETIONS, comp(speculation="fast"), 400, "speculation", ()),
    # chat
    ("chat-no-messages", CHAT, chat(messages=...), 400, "messages", ("required",)),
    ("chat-empty-messages", CHAT, chat(messages=[]), 400, "messages", ("at least 1",)),
    ("chat-messages-string", CHAT, chat(messages="hi"), 400, "messages", ()),
    ("chat-message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]", ()),
    ("chat-bad-role", CHAT, msg(role="wizard"), 400, "messages[0].role", ("user",)),
    ("chat-missing-role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role", ("required",)),
    ("chat-content-int", CHAT, msg(content=5), 400, "messages[0].content", ()),
    ("chat-content-null", CHAT, msg(content=None), 400, "messages[0].content", ()),
    ("chat-image-part", CHAT, msg(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]), 400,
     "messages[0].content", ("image_url",)),
    ("chat-text-part-no-text", CHAT, msg(content=[{"type": "text"}]), 400, "messages[0].content", ()),
    ("chat-message-unknown-key", CHAT, msg(mood="happy"), 400, "messages[0].mood", ("unknown field",)),
    ("chat-max_completion_tokens-0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens",
     (">= 1",)),
    ("chat-max-tokens-disagree", CHAT, chat(max_tokens=2, max_completion_tokens=3), 400, "max_completion_tokens",
     ()),
    ("chat-too-long", CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=...), 400,
     "messages", (str(MAX_CTX),)),
    ("chat-max_tokens-over-context", CHAT, chat(max_tokens=10**6), 400, "max_completion_tokens", (str(MAX_CTX),)),
    ("chat-tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", ()),
    ("chat-tool_choice", CHAT, chat(tool_choice="required"), 400, "tool_choice", ()),
    ("chat-response_format", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", ()),
    ("chat-top_logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs", ("logprobs",)),
    ("chat-metadata-non-string", CHAT, chat(metadata={"a": 1}), 400, "metadata.a", ()),
    ("chat-metadata-nested-list", CHAT, chat(metadata=json.loads("[" * 200 + "]" * 200)), 400, "metadata",
     ()),
]


@pytest.mark.parametrize("path,body,status,param,words",
                         [pytest.param(*c[1:], id=c[0]) for c in JSON_CASES])
def test_bad_json_request(http, path, body, status, param, words):
    err = assert_openai_error(http.post(path, json=body), status, param, *words)
    if status == 404:
        assert err["code"] == "model_not_found"


# (id, path, raw body bytes, headers, status, param, words)
RAW_CASES: list[tuple[str, str, bytes, dict[str, str], int, str | None, tuple[str, ...]]] = [
    ("temperature-NaN", COMPLETIONS, raw(comp(temperature=float("nan"))), JSON, 400, "temperature", ("finite",)),
    ("temperature-Infinity", COMPLETIONS, raw(comp(temperature=float("inf"))), JSON, 400, "temperature", ()),
    ("top_p-NaN", COMPLETIONS, raw(comp(top_p=float("nan"))), JSON, 400, "top_p", ()),
    ("presence_penalty-NaN", COMPLETIONS, raw(comp(presence_penalty=float("nan"))), JSON, 400, "presence_penalty",
     ()),
    ("chat-temperature--Infinity", CHAT, raw(chat(temperature=float("-inf"))), JSON, 400, "temperature", ()),
    ("malformed-json", COMPLETIONS, b'{"model": "x", prompt}', JSON, 400, None, ("JSON",)),
    ("truncated-json", CHAT, raw(chat())[:-5], JSON, 400, None, ("JSON",)),
    ("trailing-garbage", COMPLETIONS, raw(comp()) + b" xyz", JSON, 400, None, ("JSON",)),
    ("empty-body", COMPLETIONS, b"", JSON, 400, None, ()),
    ("whitespace-body", CHAT, b"   \n", JSON, 400, None, ()),
    ("not-json-text", COMPLETIONS, b"hello world", JSON, 400, None, ("JSON",)),
    ("json-array", COMPLETIONS, b'[{"model": "tiny-cascade", "prompt": "hi"}]', JSON, 400, None, ("object",)),
    ("json-string", CHAT, b'"hello"', JSON, 400, None, ("object",)),
    ("json-null", COMPLETIONS, b"null", JSON, 400, None, ("object",)),
    ("json-number", COMPLETIONS, b"42", JSON, 400, None, ("object",)),
    ("deeply-nested-json", COMPLETIONS, b"[" * 3000 + b"]" * 3000, JSON, 400, None, ()),
    ("deeply-nested-field", CHAT, raw(chat(metadata=...))[:-1] + b', "metadata": ' + b'{"a":' * 1200
     + b"1" + b"}" * 1200 + b"}", JSON, 400, None, ()),
    ("huge-integer-literal", COMPLETIONS, raw(comp())[:-1] + b', "seed": ' + b"9" * 5000 + b"}", JSON, 400,
     None, ()),
    ("duplicate-keys-last-wins-still-checked", COMPLETIONS, b'{"model": "tiny-cascade", "prompt": "hi", '
     b'"max_tokens": 2, "max_tokens": -1}', JSON, 400, "max_tokens", ()),
    ("non-utf8-bytes", COMPLETIONS, b'{"model": "tiny-cascade", "prompt": "\xff\xfe\xfd"}', JSON, 400, None,
     ("UTF-8",)),
    ("latin1-body", CHAT, json.dumps(chat(messages=[{"role": "user", "content": "caf\u00e9"}]),
                                     ensure_ascii=False).encode("latin-1"), JSON, 400, None, ("UTF-8",)),
    ("utf16-body", COMPLETIONS, json.dumps(comp()).encode("utf-16"), JSON, 400, None, ("UTF-8",)),
    ("lone-surrogate-in-ignored-field", COMPLETIONS, raw(comp())[:-1] + b', "user": "\\ud800"}', JSON, 200, None,
     ()),
    ("lone-surrogate-in-prompt", COMPLETIONS, b'{"model": "tiny-cascade", "prompt": "a\\udc00b", "max_tokens": 2}',
     JSON, 400, "prompt", ()),
    ("model-lone-surrogate", COMPLETIONS, raw(comp(model="\ud800")), JSON, 404, "model", ()),
    ("chat-content-lone-surrogate", CHAT, raw(msg(content="a\udfffb")), JSON, 400, "messages[0].content",
     ("surrogate",)),
    ("wrong-content-type", COMPLETIONS, raw(comp()), {"content-type": "text/plain"}, 415, None, ("Content-Type",)),
    ("form-content-type", CHAT, b"model=tiny-cascade&prompt=hi",
     {"content-type": "application/x-www-form-urlencoded"}, 415, None, ("Content-Type",)),
    ("multipart-content-type", COMPLETIONS, raw(comp()), {"content-type": "multipart/form-data; boundary=x"}, 415,
     None, ("Content-Type",)),
    ("json-lookalike-content-type", COMPLETIONS, raw(comp()), {"content-type": "application/jsonp"}, 415, None,
     ("Content-Type",)),
    ("missing-content-type", COMPLETIONS, raw(comp()), {}, 415, None, ("Content-Type",)),
    ("pickle-bytes", COMPLETIONS, b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94.",
     {"content-type": "application/python-pickle"}, 415, None, ()),
    ("pickle-bytes-as-json", COMPLETIONS, b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94.", JSON,
     400, None, ()),
    ("body-over-limit", COMPLETIONS, raw(comp(prompt="x" * (2 * LIMIT))), JSON, 413, None, (str(LIMIT),)),
]


@pytest.mark.parametrize("path,content,headers,status,param,words",
                         [pytest.param(*c[1:], id=c[0]) for c in RAW_CASES])
def test_bad_raw_request(http, path, content, headers, status, param, words):
    r = http.post(path, content=content, headers=headers)
    if status == 200:  # a request that looks odd but is valid must not be refused
        assert r.status_code == 200, r.text
        return
    assert_openai_error(r, status, param, *words)


def test_body_over_limit_chunked_without_content_length(http):
    """Transfer-Encoding: chunked carries no Content-Length: the limit must be enforced while reading."""
    chunk = b'{"model": "tiny-cascade", "prompt": "' + b"x" * 1000

    def body():
        yield chunk
        for _ in range(3 * LIMIT // 1000):
            yield b"x" * 1000
        yield b'"}'

    r = http.post(COMPLETIONS, content=body(), headers=JSON)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_openai_error(r, 413, None, str(LIMIT))


def test_small_chunked_body_is_fine(http):
    def body():
        data = raw(comp())
        yield data[:10]
        yield data[10:]

    r = http.post(COMPLETIONS, content=body(), headers=JSON)
    assert r.status_code == 200, r.text


def _read_response(s: socket.socket) -> tuple[int, bytes]:
    """The status code and body of the next response on a raw socket (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = s.recv(65536)
        if not part:
            break
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        part = s.recv(65536)
        if not part:
            break
        rest += part
    return int(head.split(b" ", 2)[1]), rest[:length]


def _head(path: str, length: int | str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_lying_content_length_huge(srv, http):
    """A Content-Length over the limit is refused from the header alone (the body is never awaited)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(_head(COMPLETIONS, 10**12) + raw(comp()))
        status, body = _read_response(s)
    assert status == 413 and str(LIMIT) in json.loads(body)["error"]["message"]
    assert http.post(COMPLETIONS, json=comp()).status_code == 200


def test_lying_content_length_short(srv, http):
    """Content-Length shorter than the body: the server reads that many bytes only (broken JSON -> 400)."""
    data = raw(comp())
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(_head(COMPLETIONS, 10) + data[:10])
        status, body = _read_response(s)
        assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
        s.sendall(data[10:])  # the rest is not a valid next request: the server drops the connection
    assert http.post(COMPLETIONS, json=comp()).status_code == 200


def test_body_shorter_than_content_length_then_hang_up(srv, http):
    """The client promises more body than it sends and hangs up: no answer is owed, the server carries on."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(_head(CHAT, 500) + raw(chat())[:20])
        s.shutdown(socket.SHUT_WR)
        assert s.recv(65536) == b""
    assert http.post(CHAT, json=chat()).status_code == 200


@pytest.mark.parametrize("method,path,status", [
    ("GET", COMPLETIONS, 405), ("GET", CHAT, 405), ("PUT", CHAT, 405), ("DELETE", "/v1/models", 405),
    ("POST", "/v1/models", 405), ("PATCH", COMPLETIONS, 405), ("GET", "/v1/nope", 404), ("GET", "/nope", 404),
    ("POST", "/v1/embeddings", 404), ("GET", "/v1/completions/../../etc/passwd", 404), ("POST", "/v1", 404),
])
def test_wrong_method_or_path(http, method, path, status):
    r = http.request(method, path, json=comp() if method in ("POST", "PUT", "PATCH") else None)
    err = assert_openai_error(r, status)
    if status == 405:
        assert method in err["message"] and "allow" in r.headers
    else:
        assert err["code"] == "not_found"


def test_api_key(tiny):
    srv = Server(Coordinator(app_config(tiny, max_context=MAX_CTX, api_key="sekrit")))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic c2Vrcml0"},
                            {"authorization": "Bearer"}, {"authorization": "sekrit"},
                            {"authorization": "Bearer sekrit2"}, {"authorization": "Bearer sekri"},
                            {"authorization": "Bearer s\u00e9krit".encode("latin-1")}):
                for path in (COMPLETIONS, "/v1/models", "/v1/nope"):
                    r = c.post(path, json=comp(), headers=headers) if path == COMPLETIONS else c.get(path,
                                                                                                  headers=headers)
                    err = assert_openai_error(r, 401)
                    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
                    assert "sekrit" not in r.text
            ok = {"authorization": "Bearer sekrit"}
            assert c.get("/health").status_code == 200  # probes stay open
            assert c.post(COMPLETIONS, json=comp(), headers=ok).status_code == 200
            assert c.post(COMPLETIONS, json=comp(), headers={"authorization": "bearer sekrit"}).status_code == 200
            # auth is checked before the body is looked at: no information leaks to unauthenticated clients
            assert c.post(COMPLETIONS, content=b"{", headers=JSON).status_code == 401
    finally:
        srv.stop()


def test_unexpected_error_is_500_with_openai_body(srv, http, monkeypatch):
    """A bug in a route answers 500 with an OpenAI body (and is logged), and the server keeps serving."""

    def boom(*_a, **_k):
        raise RuntimeError("synthetic bug")

    monkeypatch.setattr(srv.coord, "tokenize_prompt", boom)
    err = assert_openai_error(http.post(COMPLETIONS, json=comp()), 500)
    assert err["type"] == "server_error" and "synthetic" not in err["message"]
    monkeypatch.undo()
    assert http.post(COMPLETIONS, json=comp()).status_code == 200


VLLM_DEFAULTS = {  # what vLLM's benchmark client and evaluation harnesses send along, at vLLM's defaults
    "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0,
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None, "prompt_logprobs": None, "priority": 0, "request_id": "abc",
    "parallel_tool_calls": True, "stop_token_ids": [], "ignore_eos": False,
}


def test_vllm_extras_at_their_defaults_succeed(http):
    r = http.post(COMPLETIONS, json=comp(**VLLM_DEFAULTS))
    assert r.status_code == 200, r.text
    r = http.post(CHAT, json=chat(**VLLM_DEFAULTS, add_generation_prompt=True, continue_final_message=False,
                                  echo=False, chat_template_kwargs={}))
    assert r.status_code == 200, r.text


def test_unknown_fields_are_accepted_and_named_in_a_warning(http, caplog):
    with caplog.at_level(logging.WARNING, logger="specray"):
        r = http.post(COMPLETIONS, json=comp(bogus_field=1, another={"x": 1}))
        assert r.status_code == 200, r.text
        r = http.post(CHAT, json=chat(prompt="hi"))  # a completions field on chat
        assert r.status_code == 200, r.text
    text = caplog.text
    assert "another, bogus_field" in text and "prompt" in text


def test_strict_fields_refuses_unknown_fields(tiny):
    srv = Server(Coordinator(app_config(tiny, max_context=MAX_CTX, strict_fields=True)))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for path, body, param in [(COMPLETIONS, comp(bogus_field=1), "bogus_field"),
                                      (COMPLETIONS, comp(messages=[]), "messages"),
                                      (CHAT, chat(prompt="hi"), "prompt")]:
                assert_openai_error(c.post(path, json=body), 400, param, "unknown field")
            assert c.post(COMPLETIONS, json=comp(**VLLM_DEFAULTS)).status_code == 200  # declared: still fine
    finally:
        srv.stop()


def test_hostile_text_is_only_data(http):
    """Template syntax and code in prompts are tokenized as text, never rendered or executed."""
    hostile = "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}__import__('os').system('false')"
    r = http.post(CHAT, json=chat(messages=[{"role": "user", "content": hostile}], max_tokens=1))
    assert r.status_code == 200, r.text
    r = http.post(COMPLETIONS, json=comp(prompt=hostile, max_tokens=1))
    assert r.status_code == 200, r.text


def test_valid_requests_succeed_after_bad_ones(http):
    r = http.post(COMPLETIONS, json=comp(temperature=0, ignore_eos=True, max_tokens=4))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    r = http.post(CHAT, json=chat(temperature=0.7, top_p=0.9, top_k=5, seed=1, stop=["\n\n"],
                                  speculation={"method": "cascade", "num_speculative_tokens": 2}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    r = http.post(COMPLETIONS, json=comp(prompt=[1, 2, 3], stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


# ------------------------------------------------------------------------------------------------ fuzzing

_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-5, 600), max_size=4), st.lists(st.text(max_size=3), max_size=6),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
)
_VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([MODEL, MODEL, "other"]),
    "prompt": st.one_of(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 399), min_size=1, max_size=5)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"]),
        "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5)}), max_size=2)),
    }), max_size=3),
    "max_tokens": st.integers(-1, 4),
    "max_completion_tokens": st.integers(-1, 4),
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.1, 1.1),
    "top_k": st.integers(-3, 10),
    "seed": st.integers(-2, 2**64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6)),
    "n": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "speculation": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["none", "ngram", "draft", "cascade", "auto", "warp"]),
        "num_speculative_tokens": st.integers(-1, 40),
        "verify_method": st.sampled_from(["greedy", "rejection", "deterministic", "coupled", "x"]),
    }),
    "echo": st.booleans(), "user": st.text(max_size=5), "logprobs": st.none(), "presence_penalty": st.floats(0, 0),
}
_JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_KEYS = st.sampled_from([*_VALID, "suffix", "best_of", "logit_bias", "tools", "metadata", "store", "zzz"])


@st.composite
def _fuzz_body(draw) -> tuple[str, bytes, str]:
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    kind = draw(st.sampled_from(["json", "json", "json", "bytes", "mutated", "value"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=200)), draw(st.sampled_from(["application/json", "text/plain"]))
    if kind == "value":  # any JSON document, arrays and scalars at the top included
        return path, json.dumps(draw(_JSON_VALUE)).encode(), "application/json"
    body: dict[str, Any] = {"model": MODEL}
    body.update(comp() if path == COMPLETIONS else chat())
    body.pop("model") if draw(st.booleans()) and draw(st.booleans()) else None
    for key in draw(st.lists(_KEYS, max_size=5, unique=True)):
        strategy = _VALID.get(key, _ANY)
        body[key] = draw(st.one_of(strategy, _ANY) if draw(st.booleans()) else strategy)
    data = json.dumps(body).encode()  # allow_nan: NaN/Infinity go out as bare literals
    if kind == "mutated" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + draw(st.binary(min_size=1, max_size=4)) + data[i + 1:]
    return path, data, "application/json"


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_fuzz_body())
def test_fuzz_never_5xx(http, case):
    path, data, ctype = case
    r = http.post(path, content=data, headers={"content-type": ctype})
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text, data)
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        if body["error"]["param"]:  # the message names the field it is about
            assert body["error"]["param"] in body["error"]["message"], body
    else:
        assert r.status_code == 200, r.text


def test_still_serving_after_fuzz(http):
    r = http.post(CHAT, json=chat(temperature=0))
    assert r.status_code == 200, r.text
    assert http.get("/health").json()["status"] == "ok"
