"""OpenAI-compatible HTTP API over a coordinator (FastAPI; built on the replica, closes over it).

Routes: POST /v1/completions, POST /v1/chat/completions (stream via SSE or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text of this replica's registry; the cluster-wide metrics are
exported by Ray's node metrics agents, see docs/metrics.md), POST /reset_prefix_cache (vLLM's route: every
level forgets its cached prompt prefixes, so that a benchmark's modes each start cold; 409 while requests run).
Every error uses OpenAI's body {"error": {message, type, param, code}}: 400 invalid request (bad field, body not
UTF-8 / not a JSON object), 401 missing/wrong API key, 404 unknown model or path, 405 wrong method, 409 busy, 413
body too large (enforced while reading, with or without Content-Length), 415 not application/json, 500 a server bug
(logged), 503 model unavailable (the error is sent as a final SSE event when streaming had started). Request bodies
are only ever parsed as JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specray.coordinator.scheduler import Event, RequestError
from specray.coordinator.scheduler import Request as GenRequest
from specray.coordinator.stats import LevelStats
from specray.serve.protocol import (
    SSE_DONE,
    Busy,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    InvalidRequest,
    ModelCard,
    ModelList,
    Usage,
    error_response_body,
    model_not_found_body,
    new_id,
    sse_event,
    usage_from_stats,
    validation_error_to_openai,
)
from specray.serve.protocol.logprobs import LogprobFormatter
from specray.spec.params import TokenLogprob

if TYPE_CHECKING:
    from specray.config import AppConfig
    from specray.metrics import SpecMetrics

log = logging.getLogger("specray")


class ServedCoordinator(Protocol):
    """What the routes use of the coordinator they serve (`specray.serve.replica.Coordinator`, or the regime
    pools' `Router`), declared here: the coordinator builds these routes, so this module cannot import it."""

    config: AppConfig
    scheduler: Any  # its `plan_for(speculation)` rejects an impossible speculation override first
    metrics: SpecMetrics
    tokenizer: Any
    api_key: str | None
    model_name: str
    max_context: int
    started: float

    def tokenize_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    def make_request(self, prompt_ids: list[int], *, max_tokens: int | None, **options: Any) -> GenRequest: ...

    def run(self, req: GenRequest) -> AsyncIterator[Event]: ...

    async def health(self) -> dict[str, Any]: ...

    async def reset_prefix_cache(self) -> list[str]: ...


class _ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: error messages may quote request text, which can hold lone surrogates
    (valid JSON escapes such as "\\ud800") that cannot be encoded as UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return _ErrorResponse(error_response_body(message, type=type_, param=param, code=code), status_code=status,
                          headers=headers)


def _json_problem(data: bytes) -> str | None:
    """Why the body is not a JSON object (None when it is one). Checked before FastAPI parses it, so the
    client learns the actual reason (FastAPI reports nesting/number-size errors only as "error parsing")."""
    if not data.strip():
        return "The request body is empty; send a JSON object."
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"The request body is not valid UTF-8 (invalid byte at offset {exc.start})."
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
    except RecursionError:
        return "The request body is not acceptable JSON: it is nested too deeply."
    except ValueError as exc:  # e.g. an integer literal with more digits than Python allows
        return f"The request body is not acceptable JSON: {exc}."
    if not isinstance(obj, dict):
        return f"The request body must be a JSON object, not a JSON {type(obj).__name__}."
    return None


_JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


class _RequestGuard:
    """ASGI middleware in front of the routes: API key, content type, body size and body encoding.

    The body of a POST is read here, at most `max_request_bytes` of it, whether or not a Content-Length came
    with it (chunked transfer has none, and a declared length is checked before anything is read), then
    handed to the app in one piece. Error answers end the connection when the body was not read out."""

    def __init__(self, app: ASGIApp, coord: ServedCoordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the server's latency clock starts here (request.state.arrival): what a client times, less the network
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        coord, path = self.coord, scope["path"]
        headers = Headers(scope=scope)
        if coord.api_key and (path.startswith("/v1/") or path == "/reset_prefix_cache"):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode("utf-8", "replace"), coord.api_key.encode()):
                await _reject(scope, receive, send, 401, "Missing or invalid API key: send 'Authorization: Bearer "
                              "<key>'.", "authentication_error", code="invalid_api_key")
                return
        if scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        limit = coord.config.server.max_request_bytes
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            await _reject(scope, receive, send, 400, "Invalid Content-Length header.")
            return
        if length is not None and int(length) > limit:
            await _reject(scope, receive, send, 413, f"Request body of {length} bytes exceeds the limit of {limit} "
                          "bytes.")
            return
        ctype = headers.get("content-type")
        media = (ctype or "").split(";", 1)[0].strip().lower()
        json_route = path in _JSON_ROUTES
        if json_route and media != "application/json":
            got = f"got {ctype!r}" if ctype else "none was sent"
            await _reject(scope, receive, send, 415, f"Content-Type must be application/json ({got}).")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reject(scope, receive, send, 413, f"Request body exceeds the limit of {limit} bytes.")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_route and (problem := _json_problem(body)) is not None:
            await _ErrorResponse(error_response_body(problem), status_code=400)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect is left to wait for

        await self._app(scope, replay, send)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The routes, with any exception they let escape answered as a logged 500 (OpenAI body) while the
        response has not started; caught here rather than left to Starlette's ServerErrorMiddleware, which
        re-raises and so makes the server drop the keep-alive connection."""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error in %s %s", scope["method"], scope["path"], exc_info=exc)
            await _error(500, "The server had an error while processing the request.", "server_error",
                         code="internal_error")(scope, receive, send)


async def _reject(scope: Scope, receive: Receive, send: Send, status: int, message: str,
                  type_: str = "invalid_request_error", code: str | None = None) -> None:
    """An error sent before the body was read: close the connection rather than read the rest of it."""
    await _error(status, message, type_, code=code, headers={"Connection": "close"})(scope, receive, send)


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(finals: list[Event]) -> Usage:
    """Usage of a request's choices: the prompt once, the completions summed, the levels' statistics merged."""
    stats: dict[str, LevelStats] = {}
    for ev in finals:
        for name, st in (ev.stats or {}).items():
            stats.setdefault(name, LevelStats()).merge(st)
    prompt = finals[0].prompt_tokens if finals else 0
    return usage_from_stats(prompt, sum(ev.completion_tokens for ev in finals), stats)


async def _merged(gens: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from each choice's event stream as they come; closing it (or a failing choice)
    closes every stream, which cancels their sequences."""
    if len(gens) == 1:
        try:
            async for ev in gens[0]:
                yield 0, ev
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Event | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Event]) -> None:
        try:
            async for ev in gen:
                await queue.put((i, ev, None))
            await queue.put((i, None, None))
        except Exception as exc:
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is None:
                left -= 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


def build_http_app(coord: ServedCoordinator) -> FastAPI:
    app = FastAPI(title="specray", description="OpenAI-compatible API with lossless speculative decoding")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = validation_error_to_openai(exc)
        return _ErrorResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette/FastAPI's own errors (unknown path, wrong method, unparsable body) as OpenAI bodies."""
        status, method, path = exc.status_code, request.method, request.url.path
        if status == 404:
            message, code = f"Unknown path: {method} {path}.", "not_found"
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message, code = f"Method {method} is not allowed on {path}; allowed: {allowed}.", "method_not_allowed"
        else:
            message, code = str(exc.detail).rstrip(".") + ".", None
        return _error(status, message, param=None, code=code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A bug, not a bad request: log it and answer 500 with an OpenAI body (never a bare text page).
        Route errors are answered by `_RequestGuard`; this covers anything outside it."""
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, "The server had an error while processing the request.", "server_error",
                      code="internal_error")

    app.add_middleware(_RequestGuard, coord=coord)

    def check_model(model: str) -> JSONResponse | None:
        if model != coord.model_name:
            return _ErrorResponse(model_not_found_body(model), status_code=404)
        return None

    def _request_error(exc: RequestError, body: CompletionRequest | ChatCompletionRequest) -> JSONResponse:
        """A RequestError's message starts with the field it is about ("prompt: ...", "speculation.method
        'x': ..."): that field becomes `param` when the request has it."""
        head = str(exc).replace(":", " ").split(" ", 1)[0]
        param = head if head.split(".", 1)[0] in type(body).model_fields else None
        return _error(400, str(exc), param=param)

    async def prepare(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                      arrival: float) -> list[GenRequest]:
        """One engine request per choice (n): each an independent sequence of the batch; a seeded request's
        choice i is seeded with seed + i (`choice_seed`)."""
        max_tokens = body.resolve_max_tokens(len(prompt_ids), coord.max_context)
        sp = body.to_sampling_params()
        reqs = [coord.make_request(prompt_ids, max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                   top_k=sp.top_k, seed=body.choice_seed(i), stop=body.stop,
                                   speculation=body.speculation, ignore_eos=body.ignore_eos,
                                   stop_token_ids=body.stop_token_ids, min_p=sp.min_p,
                                   presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                                   repetition_penalty=sp.repetition_penalty, logprobs=sp.logprobs,
                                   arrival=arrival)
                for i in range(body.n)]
        coord.scheduler.plan_for(reqs[0].speculation)  # e.g. method "draft" without a draft level: 400 first
        return reqs

    async def serve_request(body, make_prompt, chat: bool, arrival: float) -> Response:
        if (resp := check_model(body.model)) is not None:
            return resp
        if unknown := body.unknown_fields:
            if coord.config.server.strict_fields:
                return _error(400, f"{unknown[0]}: unknown field (server.strict_fields is on); unknown: "
                              f"{', '.join(unknown)}", param=unknown[0])
            log.warning("request fields ignored (not parameters of specray): %s", ", ".join(unknown))
        param = body._prompt_param
        try:
            try:
                prompt_ids = make_prompt()
            except RequestError as exc:
                raise InvalidRequest(str(exc), param=param) from exc
            if not prompt_ids:
                raise InvalidRequest(f"{param}: the prompt is empty after tokenization", param=param)
            reqs = await prepare(body, prompt_ids, arrival)
        except InvalidRequest as exc:
            return _ErrorResponse(exc.body(), status_code=400)
        except RequestError as exc:
            return _request_error(exc, body)
        if coord.config.server.log_prompts:
            log.info("request: %r", body.model_dump(mode="json"))
        else:
            log.info("request: %d prompt tokens, max_tokens %d, n %d", len(prompt_ids), reqs[0].max_tokens, len(reqs))
        if body.stream:
            return StreamingResponse(stream(body, reqs, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(body, reqs, chat)

    def decode_token(tid: int) -> str:
        return coord.tokenizer.decode([tid], skip_special_tokens=False)

    def formatter() -> LogprobFormatter:
        return LogprobFormatter(decode_token if coord.tokenizer is not None else None)

    async def complete(body, reqs: list[GenRequest], chat: bool) -> Response:
        n = len(reqs)
        parts: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[Event | None] = [None] * n
        try:
            async with aclosing(_merged([coord.run(r) for r in reqs])) as events:
                async for i, ev in events:
                    parts[i].append(ev.text)
                    last[i] = ev
                    if ev.logprobs is not None:
                        ids[i].extend(ev.token_ids)
                        lps[i].extend(ev.logprobs)
        except RequestError as exc:
            return _error(400, str(exc))
        except Exception as exc:
            return _error(503, str(exc), "server_error", code="model_unavailable")
        finals = [ev for ev in last if ev is not None]
        assert len(finals) == n
        usage = _usage(finals)
        logprobs = body.num_logprobs is not None
        choices: list[Any] = []
        for i, ev in enumerate(finals):
            text, reason = "".join(parts[i]), _finish_reason(ev.finish_reason)
            if chat:
                lp = ChatLogprobs(content=formatter().chat(ids[i], lps[i])) if logprobs else None
                choices.append(ChatChoice(index=i, message=ChatResponseMessage(content=text), logprobs=lp,
                                          finish_reason=reason))
            else:
                clp = formatter().completion(ids[i], lps[i]) if logprobs else None
                choices.append(CompletionChoice(index=i, text=text, logprobs=clp, finish_reason=reason))
        cls: Any = ChatCompletionResponse if chat else CompletionResponse
        return JSONResponse(cls(model=coord.model_name, usage=usage, choices=choices).model_dump(mode="json"))

    async def stream(body, reqs: list[GenRequest], chat: bool) -> AsyncIterator[str]:
        rid = new_id("chatcmpl" if chat else "cmpl")
        model = coord.model_name
        n = len(reqs)
        role_sent = [not chat] * n
        fmts = [formatter() for _ in range(n)]
        finals: list[Event] = []
        prompt_tokens, completion = len(reqs[0].prompt_ids), [0] * n
        chunk_cls: Any = ChatCompletionChunk if chat else CompletionStreamChunk
        try:
            async with aclosing(_merged([coord.run(r) for r in reqs])) as events:
                async for i, ev in events:
                    completion[i] += len(ev.token_ids)
                    reason = _finish_reason(ev.finish_reason) if ev.finished else None
                    if ev.finished:
                        finals.append(ev)
                    lp = ev.logprobs if ev.logprobs and ev.token_ids else None
                    if not ev.text and reason is None and lp is None:
                        continue
                    usage = None
                    if body.continuous_usage:
                        usage = usage_from_stats(prompt_tokens, sum(completion))
                    if not role_sent[i]:  # with the first token, as vLLM does: clients time the first token by it
                        role_sent[i] = True
                        yield sse_event(ChatCompletionChunk(id=rid, model=model, usage=usage, choices=[
                            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant"))]))
                    if chat:
                        delta = ChatDelta(content=ev.text) if ev.text else ChatDelta()
                        clp = ChatLogprobs(content=fmts[i].chat(ev.token_ids, lp)) if lp is not None else None
                        choice: Any = ChatChunkChoice(index=i, delta=delta, logprobs=clp, finish_reason=reason)
                    else:
                        tlp = fmts[i].completion(ev.token_ids, lp) if lp is not None else None
                        choice = CompletionStreamChoice(index=i, text=ev.text, logprobs=tlp, finish_reason=reason)
                    yield sse_event(chunk_cls(id=rid, model=model, choices=[choice], usage=usage))
            if body.include_usage_chunk:
                yield sse_event(chunk_cls(id=rid, model=model, choices=[], usage=_usage(finals)))
        except Exception as exc:
            status = 400 if isinstance(exc, RequestError) else 503
            body_ = error_response_body(str(exc), type="server_error" if status == 503 else "invalid_request_error",
                                        code="model_unavailable" if status == 503 else None)
            body_["error"]["status"] = status
            yield f"data: {json.dumps(body_)}\n\n"
        yield SSE_DONE

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        def prompt() -> list[int]:
            return coord.tokenize_prompt(body.prompt)

        return await serve_request(body, prompt, chat=False, arrival=request.state.arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        def prompt() -> list[int]:
            return coord.apply_chat_template(body.template_messages())

        return await serve_request(body, prompt, chat=True, arrival=request.state.arrival)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=coord.model_name, created=int(coord.started), max_model_len=coord.max_context)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/health")
    async def health() -> Response:
        h = await coord.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            levels = await coord.reset_prefix_cache()
        except Busy as exc:
            return _error(409, str(exc), code="busy")
        return JSONResponse({"reset": levels})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(coord.metrics.render(), media_type=coord.metrics.content_type)

    return app
