"""OpenAI-compatible HTTP API over a `Coordinator` (FastAPI; built on the replica, closes over it).

Routes: POST /v1/completions, POST /v1/chat/completions (stream via SSE or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text of this replica's registry; the cluster-wide metrics are
exported by Ray's node metrics agents, see docs/metrics.md). Every error uses OpenAI's body {"error": {message,
type, param, code}}: 400 invalid request (bad field, body not UTF-8 / not a JSON object), 401 missing/wrong API key,
404 unknown model or path, 405 wrong method, 413 body too large (enforced while reading, with or without
Content-Length), 415 not application/json, 500 a server bug (logged), 503 model unavailable (the error is
sent as a final SSE event when streaming had started). Request bodies are only ever parsed as JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specray.coordinator.scheduler import Request as GenRequest
from specray.coordinator.scheduler import RequestError
from specray.serve.protocol import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    InvalidRequest,
    ModelCard,
    ModelList,
    error_response_body,
    model_not_found_body,
    new_id,
    sse_event,
    usage_from_stats,
    validation_error_to_openai,
)

if TYPE_CHECKING:
    from specray.serve.app import Coordinator

log = logging.getLogger("specray")


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

    def __init__(self, app: ASGIApp, coord: Coordinator) -> None:
        self.app, self.coord = app, coord

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the server's latency clock starts here (request.state.arrival): what a client times, less the network
        scope.setdefault("state", {})["arrival"] = time.perf_counter()
        coord, path = self.coord, scope["path"]
        headers = Headers(scope=scope)
        if coord.api_key and path.startswith("/v1/"):
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


def build_http_app(coord: Coordinator) -> FastAPI:
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
                      arrival: float) -> GenRequest:
        max_tokens = body.resolve_max_tokens(len(prompt_ids), coord.max_context)
        sp = body.to_sampling_params()
        req = coord.make_request(prompt_ids, max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                 top_k=sp.top_k, seed=sp.seed, stop=body.stop, speculation=body.speculation,
                                 ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids, arrival=arrival)
        coord.scheduler.plan_for(req.speculation)  # e.g. method "draft" without a draft level: 400 before streaming
        return req

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
            req = await prepare(body, prompt_ids, arrival)
        except InvalidRequest as exc:
            return _ErrorResponse(exc.body(), status_code=400)
        except RequestError as exc:
            return _request_error(exc, body)
        if coord.config.server.log_prompts:
            log.info("request: %r", body.model_dump(mode="json"))
        else:
            log.info("request: %d prompt tokens, max_tokens %d", len(prompt_ids), req.max_tokens)
        if body.stream:
            return StreamingResponse(stream(body, req, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await complete(body, req, chat)

    async def complete(body, req: GenRequest, chat: bool) -> Response:
        parts, last = [], None
        try:
            async for ev in coord.run(req):
                parts.append(ev.text)
                last = ev
        except RequestError as exc:
            return _error(400, str(exc))
        except Exception as exc:
            return _error(503, str(exc), "server_error", code="model_unavailable")
        assert last is not None
        usage = usage_from_stats(last.prompt_tokens, last.completion_tokens, last.stats)
        text, reason = "".join(parts), _finish_reason(last.finish_reason)
        if chat:
            out: Any = ChatCompletionResponse(model=coord.model_name, usage=usage, choices=[
                ChatChoice(message=ChatResponseMessage(content=text), finish_reason=reason)])
        else:
            out = CompletionResponse(model=coord.model_name, usage=usage,
                                     choices=[CompletionChoice(text=text, finish_reason=reason)])
        return JSONResponse(out.model_dump(mode="json"))

    async def stream(body, req: GenRequest, chat: bool) -> AsyncIterator[str]:
        rid = new_id("chatcmpl" if chat else "cmpl")
        model = coord.model_name
        role_sent = not chat
        try:
            async for ev in coord.run(req):
                reason = _finish_reason(ev.finish_reason) if ev.finished else None
                if not ev.text and reason is None:
                    continue
                if not role_sent:  # with the first token, as vLLM does: clients time the first token by it
                    role_sent = True
                    yield sse_event(ChatCompletionChunk(id=rid, model=model,
                                                        choices=[ChatChunkChoice(delta=ChatDelta(role="assistant"))]))
                if chat:
                    delta = ChatDelta(content=ev.text) if ev.text else ChatDelta()
                    chunk: Any = ChatCompletionChunk(id=rid, model=model,
                                                     choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])
                else:
                    chunk = CompletionStreamChunk(id=rid, model=model, choices=[
                        CompletionStreamChoice(text=ev.text, finish_reason=reason)])
                yield sse_event(chunk)
                if ev.finished and body.include_usage_chunk:
                    usage = usage_from_stats(ev.prompt_tokens, ev.completion_tokens, ev.stats)
                    cls = ChatCompletionChunk if chat else CompletionStreamChunk
                    yield sse_event(cls(id=rid, model=model, choices=[], usage=usage))
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(coord.metrics.render(), media_type=coord.metrics.content_type)

    return app
