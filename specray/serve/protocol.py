"""OpenAI-compatible request/response schemas (pydantic v2) for /v1/completions, /v1/chat/completions and
/v1/models, plus error bodies and SSE framing.

Requests forbid unknown fields: the official clients only send fields the user set, so an unknown field is
a typo or an unsupported feature and deserves a clear 400 rather than being silently ignored. OpenAI
parameters that specray cannot honour (n > 1, echo, logprobs, penalties, logit_bias, tools, ...) are
declared and accepted only at their neutral value, with a message that says so. The ignored fields are
exactly `user`, and for chat `metadata` and `store`: they carry no generation semantics.

Extensions (all optional, so plain OpenAI clients work unchanged; send them with ``extra_body=``):
`speculation` (SpeculationOptions), `top_k`, `ignore_eos` on requests, and `usage.speculation` (per-level
acceptance stats) and `ModelCard.max_model_len` on responses.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from specray.spec.params import SamplingParams, VerifyMethod

if TYPE_CHECKING:  # cascade imports torch; the schemas only need the attributes
    from specray.coordinator.cascade import LevelStats

MAX_STOP_STRINGS = 4
FinishReason = Literal["stop", "length"]


class InvalidRequest(ValueError):
    """A request that parsed but cannot be served (e.g. prompt longer than the context): HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_response_body(str(self), param=self.param)


class _Request(BaseModel):
    """Strict types: "5" is not an integer, 1 is not a boolean and 2.0 is not a token count (OpenAI refuses
    them too); integers are still accepted where a float is expected."""

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


def _text(v: str) -> str:
    """Text that will be tokenized must be encodable: JSON escapes can smuggle in lone surrogates."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text (lone surrogate at character {exc.start})") from None
    return v


class _Response(BaseModel):
    """Fields listed in `_omit_if_none` are left out of the JSON when None (OpenAI omits them; nulls there
    would confuse strict clients), every other None is written as null like OpenAI does."""

    model_config = ConfigDict(protected_namespaces=())
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


# ------------------------------------------------------------------------------------------- requests


class SpeculationOptions(_Request):
    """Per-request speculation control (extension field `speculation`)."""

    method: Literal["none", "ngram", "draft", "cascade", "auto"] = Field(
        "auto",
        description="none: plain decoding; ngram: prompt lookup only; draft: the largest draft model only; "
        "cascade: every configured level; auto: the planner chooses per round from live measurements.",
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=32, description="Tokens proposed per round (K); None lets the planner choose."
    )
    verify_method: Literal["greedy", "rejection", "deterministic", "coupled"] | None = Field(
        None, description="Override the configured verification method; None keeps the configured one."
    )

    @property
    def verify(self) -> VerifyMethod | None:
        return VerifyMethod(self.verify_method) if self.verify_method else None


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with usage (and speculation stats).")


def _neutral(value: Any, neutral: tuple[Any, ...], message: str) -> Any:
    """Accept an unsupported OpenAI parameter only at its neutral value."""
    if value not in neutral:
        raise ValueError(f"{message} is not supported by specray")
    return value


class _SamplingFields(_Request):
    """Sampling fields shared by both endpoints, with OpenAI's defaults and ranges."""

    _prompt_param: ClassVar[str] = "prompt"

    model: str = Field(description="A served model id (GET /v1/models).")
    temperature: float | None = Field(
        1.0, ge=0, le=2, allow_inf_nan=False, description="0 is greedy. None means the default, 1."
    )
    top_p: float | None = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="Nucleus mass; 1 disables.")
    top_k: int | None = Field(None, ge=-1, description="Extension: -1, 0 or None disable top-k.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Makes sampling reproducible.")
    stop: list[str] | None = Field(
        None, description="Up to 4 stop strings (a single string is accepted); not included in the output."
    )
    n: int = Field(1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; only empty.")
    user: str | None = Field(None, description="Accepted and ignored.")
    speculation: SpeculationOptions | None = Field(None, description="Extension: speculation control.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS (benchmarks).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            if len(v) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(v)})")
            if any(isinstance(s, str) and not s for s in v):
                raise ValueError("stop strings must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        return _neutral(v, (None, 0.0), "a penalty other than 0")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return _neutral(v or None, (None,), "logit_bias")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def to_sampling_params(self) -> SamplingParams:
        """The engine's sampling parameters (no seed yet: the coordinator draws one if None)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_k=self.top_k if self.top_k is not None and self.top_k > 0 else 0,
            top_p=1.0 if self.top_p is None else float(self.top_p),
            seed=self.seed,
        )

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _resolve(self, requested: int | None, param: str, prompt_tokens: int, max_context: int) -> int:
        room = max_context - prompt_tokens
        what = "prompt has" if self._prompt_param == "prompt" else "messages have"
        if room < 1:
            raise InvalidRequest(
                f"{self._prompt_param}: this model's maximum context length is {max_context} tokens, but the "
                f"{what} {prompt_tokens} tokens, which leaves no room to generate.",
                param=self._prompt_param,
            )
        if requested is None:
            return room
        if requested > room:
            raise InvalidRequest(
                f"{param}: must be <= {room} for this prompt. This model's maximum context length is "
                f"{max_context} tokens. However, you requested {prompt_tokens + requested} tokens "
                f"({prompt_tokens} in the {self._prompt_param}, {requested} in the completion). Please reduce "
                f"the {self._prompt_param} or {param}.",
                param=param,
            )
        return requested


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (one prompt per request)."""

    prompt: str | list[int] = Field(description="Text or token ids; a list of one string is accepted.")
    suffix: str | None = Field(None, description="Not supported; only empty.")
    max_tokens: int | None = Field(16, ge=1, description="Default 16 as in OpenAI; None: up to the context.")
    echo: bool = Field(False, description="Only false is supported.")
    logprobs: int | None = Field(None, description="Not supported; only null.")
    best_of: int | None = Field(None, description="Only 1 is supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        """Normalise OpenAI's four prompt shapes to one str or one token list, refusing batches."""
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported (got {len(v)})")
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return _text(v)
        if isinstance(v, list):
            if not v:
                raise ValueError("a token-id prompt must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
                raise ValueError("a token-id prompt must be a list of non-negative integers")
            return v
        raise ValueError("must be a string or a list of token ids")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        return _neutral(v or None, (None,), "suffix")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        return _neutral(v, (False,), "echo")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        return _neutral(v, (None,), "logprobs")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        return _neutral(v, (None, 1), "best_of other than 1")

    def resolve_max_tokens(self, prompt_tokens: int, max_context: int) -> int:
        """Tokens to generate; raises InvalidRequest (400) when prompt + max_tokens exceed the context."""
        return self._resolve(self.max_tokens, "max_tokens", prompt_tokens, max_context)


class ChatMessage(_Request):
    """One chat message; content is text (text parts are joined with newlines)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str = Field(description="A string or a list of {type: 'text', text} parts.")
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):
            texts = []
            for part in v:
                is_dict = isinstance(part, dict)
                if not is_dict or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if is_dict else type(part).__name__
                    raise ValueError(f"only text parts {{'type': 'text', 'text': str}} are supported (got {kind!r})")
                texts.append(part["text"])
            return _text("\n".join(texts))
        if not isinstance(v, str):
            raise ValueError("must be a string or a list of text parts")
        return _text(v)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    _prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, description="None: up to the context limit.")
    logprobs: bool | None = Field(None, description="Not supported; only false/null.")
    top_logprobs: int | None = Field(None, description="Not supported; only null.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported; only empty.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none'.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'}.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        return _neutral(v, (None, False), "logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return _neutral(v, (None,), "top_logprobs")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return _neutral(v or None, (None,), "tool calling")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        return _neutral(v, (None, "none"), "tool calling")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        old = info.data.get("max_tokens")
        if None not in (v, old) and v != old:
            raise ValueError(f"disagrees with max_tokens ({old}); send only max_completion_tokens")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for `tokenizer.apply_chat_template` ("developer" is OpenAI's new name for "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages]

    def resolve_max_tokens(self, prompt_tokens: int, max_context: int) -> int:
        """Tokens to generate (default: up to the context); raises InvalidRequest (400) when too many."""
        return self._resolve(self.max_new_tokens, "max_completion_tokens", prompt_tokens, max_context)


# ------------------------------------------------------------------------------------------ responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class SpeculationLevelUsage(_Response):
    """Per-level acceptance stats of one request (extension); a level counts the drafts proposed to it."""

    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float = Field(description="accepted_tokens / draft_tokens (0 when nothing was drafted).")
    mean_acceptance_length: float = Field(description="Tokens emitted per verification call (accepted + 1).")


class Usage(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculation"})

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: dict[str, SpeculationLevelUsage] | None = Field(
        None, description="Extension: acceptance stats keyed by level name, smallest level first."
    )


def usage_from_stats(
    prompt_tokens: int, completion_tokens: int, stats: Mapping[str, LevelStats] | None = None
) -> Usage:
    """Usage with the per-level speculation stats of one request (omitted when there are none)."""
    spec = {
        name: SpeculationLevelUsage(
            num_drafts=s.num_drafts,
            draft_tokens=s.draft_tokens,
            accepted_tokens=s.accepted_tokens,
            acceptance_rate=s.acceptance_rate,
            mean_acceptance_length=s.mean_acceptance_length,
        )
        for name, s in (stats or {}).items()
    }
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        speculation=spec or None,
    )


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionStreamChoice(_Response):
    index: int = 0
    text: str = ""
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionStreamChunk(_Response):
    """One SSE event of a streamed completion; the usage chunk (stream_options) has no choices."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(_Response):
    """The role comes in the first chunk only, content in the following ones (as OpenAI streams)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content"})

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta = Field(default_factory=ChatDelta)
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    """One SSE event of a streamed chat completion; the usage chunk (stream_options) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"max_model_len"})

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "specray"
    max_model_len: int | None = Field(None, description="Extension: context length of the target.")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error envelope: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


def error_response_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return ErrorBody(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def model_not_found_body(model: str) -> dict[str, Any]:
    """Body of the 404 for an unknown model (OpenAI's wording and code)."""
    return error_response_body(
        f"The model `{model}` does not exist or you do not have access to it.", param="model", code="model_not_found"
    )


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _param(loc: tuple[int | str, ...]) -> str | None:
    """Dotted field path ("messages[0].content"), without pydantic's union/validator tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_NAMES or any(c in part for c in "[]-"):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def _num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer() and math.isfinite(x):
        return str(int(x))
    return str(x)


def _got(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return _num(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} item{'' if len(value) == 1 else 's'}"
    return type(value).__name__


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _describe(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _BOUNDS:
        bound = ctx[{"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt"}.get(kind, "le")]
        text = f"must be {_BOUNDS[kind]} {_num(bound)}"
    elif kind == "missing":
        return "field required"
    elif kind == "extra_forbidden":
        return "unknown field (not supported by this API)"
    elif kind == "json_invalid":
        return f"invalid JSON body: {ctx.get('error', err['msg'])}"
    elif kind in ("model_type", "model_attributes_type") and not err["loc"]:
        return "the request body must be a JSON object"
    elif kind in ("too_short", "too_long"):
        n = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"must have at {'least' if kind == 'too_short' else 'most'} {n} item{'' if n == 1 else 's'}"
    elif kind == "literal_error":
        text = f"must be one of {ctx.get('expected')}"
    elif kind == "finite_number":
        text = "must be a finite number"
    elif kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error") or err["msg"].split(", ", 1)[-1])
    else:
        text = err["msg"].replace("Input should be", "must be").replace("Input", "value")
        text = text[:1].lower() + text[1:]
    if "(got" not in text and "input" in err and err["loc"]:
        text += f" (got {_got(err['input'])})"
    return text


def validation_error_to_openai(exc: ValidationError | Any) -> tuple[int, dict[str, Any]]:
    """400 and an OpenAI error body whose message names the field and what is allowed, e.g.
    "temperature: must be <= 2 (got 5)". Up to three problems are listed; `param` is the first field.

    Also takes FastAPI's RequestValidationError (same error dicts, locations prefixed with "body")."""
    raw = exc.errors(include_url=False) if isinstance(exc, ValidationError) else exc.errors()
    errors = []
    for err in raw:
        loc = tuple(err.get("loc", ()))
        errors.append({**err, "loc": loc[1:] if loc[:1] == ("body",) else loc})
    parts = []
    for err in errors[:3]:
        param = _param(err["loc"])
        parts.append(f"{param}: {_describe(err)}" if param else _describe(err))
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    first = _param(errors[0]["loc"]) if errors else None
    return 400, error_response_body("; ".join(parts) or "invalid request", param=first)


# ------------------------------------------------------------------------------------------------- SSE

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: BaseModel | Mapping[str, Any]) -> str:
    """One server-sent event: "data: {json}\\n\\n" (compact JSON, UTF-8 kept as is)."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json()
    else:
        payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"
