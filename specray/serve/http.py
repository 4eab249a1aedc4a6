"""OpenAI-compatible HTTP API over a `Coordinator` (FastAPI; built on the replica, closes over it).

Routes: POST /v1/completions, POST /v1/chat/completions (stream via SSE or not), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors use OpenAI's body {"error": {message, type, param,
code}}: 400 invalid request, 401 missing/wrong API key, 404 unknown model, 413 body too large,
503 model unavailable (the error is sent as a final SSE event when streaming had started).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

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


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_response_body(message, type=type_, param=param, code=code), status_code=status)


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def build_http_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="specray", description="OpenAI-compatible API with lossless speculative decoding")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = validation_error_to_openai(exc)
        return JSONResponse(body, status_code=status)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if coord.api_key and path.startswith("/v1/"):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), coord.api_key.encode()):
                return _error(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                              "authentication_error", code="invalid_api_key")
        if request.method == "POST":
            limit = coord.config.server.max_request_bytes
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                return _error(413, f"Request body of {length} bytes exceeds the limit of {limit} bytes.")
            ctype = request.headers.get("content-type", "")
            if path.startswith("/v1/") and "json" not in ctype.lower():
                return _error(415 if ctype else 400, "Content-Type must be application/json.")
        return await call_next(request)

    def check_model(model: str) -> JSONResponse | None:
        if model != coord.model_name:
            return JSONResponse(model_not_found_body(model), status_code=404)
        return None

    async def prepare(body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> GenRequest:
        max_tokens = body.resolve_max_tokens(len(prompt_ids), coord.max_context)
        sp = body.to_sampling_params()
        return coord.make_request(prompt_ids, max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                  top_k=sp.top_k, seed=sp.seed, stop=body.stop, speculation=body.speculation,
                                  ignore_eos=getattr(body, "ignore_eos", False))

    async def serve_request(body, make_prompt, chat: bool) -> Response:
        if (resp := check_model(body.model)) is not None:
            return resp
        try:
            prompt_ids = make_prompt()
            req = await prepare(body, prompt_ids)
        except InvalidRequest as exc:
            return JSONResponse(exc.body(), status_code=400)
        except RequestError as exc:
            return _error(400, str(exc))
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
        if chat:
            yield sse_event(ChatCompletionChunk(id=rid, model=model,
                                                choices=[ChatChunkChoice(delta=ChatDelta(role="assistant"))]))
        try:
            async for ev in coord.run(req):
                reason = _finish_reason(ev.finish_reason) if ev.finished else None
                if not ev.text and reason is None:
                    continue
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
    async def completions(body: CompletionRequest) -> Response:
        def prompt() -> list[int]:
            return coord.tokenize_prompt(body.prompt)

        return await serve_request(body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        def prompt() -> list[int]:
            return coord.apply_chat_template(body.template_messages())

        return await serve_request(body, prompt, chat=True)

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
