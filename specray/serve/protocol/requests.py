"""Request schemas of /v1/completions and /v1/chat/completions (pydantic v2, strict types).

OpenAI's parameters and vLLM's extra sampling parameters are declared. Supported beyond the basics: n,
logprobs / top_logprobs, presence / frequency / repetition penalties, min_p (exact under speculation: they
are part of the target's distribution). Those specray cannot honour (echo, logit_bias, tools, response_format
other than text, guided decoding, ...) are accepted only at their neutral value (what vLLM's benchmark client
and evaluation harnesses send by default), with a 400 naming the field otherwise. A field neither declares is
accepted and named in a warning, as vLLM does (`unknown_fields`; `server.strict_fields` turns it into a 400).
Ignored without semantics: `user`, `request_id`, `parallel_tool_calls`, and for chat `metadata` and `store`.
Nested objects (`speculation`, `stream_options`, messages) refuse unknown fields: a typo there is ours to catch.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from specray.serve.protocol.errors import InvalidRequest
from specray.spec.params import MAX_LOGPROBS, SamplingParams, TreeShape, VerifyMethod

MAX_STOP_STRINGS = 4
#: Most choices per request (each is a sequence of the running batch)
MAX_N = 64


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


class TreeOptions(_Request):
    """The token tree the level drafting for the target drafts for this request (`speculation.tree`)."""

    width: int = Field(..., ge=1, le=16, description="Children per node (1: chains).")
    depth: int | None = Field(None, ge=1, le=64, description="Levels of a model level's tree; None: the round's K "
                              "(a suffix level's tree has at most K nodes whatever this says).")
    max_nodes: int | None = Field(None, ge=1, le=256, description="Most nodes of a model level's tree; None: "
                                  "width x depth.")


class SpeculationOptions(_Request):
    """Per-request speculation control (extension field `speculation`)."""

    method: Literal["none", "ngram", "draft", "draft_model", "cascade", "hybrid", "auto"] = Field(
        "auto",
        description="Which proposer drafts (the meaning of vLLM's speculative_config.method): none: plain "
        "decoding; ngram: prompt lookup only; draft (or vLLM's draft_model): the largest draft model only; "
        "cascade: every configured level; hybrid: per round and row, the n-gram's (or suffix's) match where it "
        "finds one, else the largest draft model's draft; auto: the planner chooses per round from live "
        "measurements.",
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=32, description="Tokens proposed per round (K); None lets the planner choose."
    )
    verify_method: Literal["greedy", "rejection", "deterministic", "coupled"] | None = Field(
        None, description="Override the configured verification method; None keeps the configured one."
    )
    tree: TreeOptions | Literal[False] | None = Field(
        None, description="Token trees for the level that drafts for the target: {width, depth, max_nodes} drafts a "
        "tree of that shape (a model level with tree support, or a suffix level: width only), false drafts chains; "
        "None keeps the level's configured `tree` / `tree_width`. Trees are only drafted where the target scores "
        "them (hf); elsewhere chains.",
    )

    @field_validator("method")
    @classmethod
    def _vllm_name(cls, v: str) -> str:
        return "draft" if v == "draft_model" else v

    @property
    def verify(self) -> VerifyMethod | None:
        return VerifyMethod(self.verify_method) if self.verify_method else None

    @property
    def tree_shape(self) -> TreeShape | None:
        """The request's tree as a `TreeShape` (false: width 1, chains; None: the configured one)."""
        if self.tree is None:
            return None
        if self.tree is False:
            return TreeShape(1)
        return TreeShape(self.tree.width, self.tree.depth, self.tree.max_nodes)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with usage (and speculation stats).")
    continuous_usage_stats: bool = Field(
        False, description="vLLM extension: every chunk carries the usage so far (with include_usage)."
    )


def _neutral(value: Any, neutral: tuple[Any, ...], message: str) -> Any:
    """Accept an unsupported OpenAI parameter only at its neutral value."""
    if value not in neutral:
        raise ValueError(f"{message} is not supported by specray")
    return value


#: vLLM's extra request fields that specray accepts only at these values (None: the field was not set)
VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "priority": (None, 0),
    "return_tokens_as_token_ids": (None, False),
}


#: vLLM's extra chat fields, likewise
CHAT_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "echo": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "functions": (None, []),  # OpenAI's deprecated form of tools
    "function_call": (None, "none"),
}


def _only(v: Any, neutral: tuple[Any, ...]) -> Any:
    """Accept a parameter specray does not implement only at a value that means "off"."""
    if v not in neutral:
        shown = " or ".join(repr(x) for x in neutral if x is not None) or "null"
        raise ValueError(f"only {shown} is supported by specray (got {v!r})")
    return v


class _SamplingFields(_Request):
    """Sampling fields shared by both endpoints, with OpenAI's defaults and ranges (unknown fields are kept in
    `model_extra`; see the module docstring)."""

    model_config = ConfigDict(extra="allow", strict=True, protected_namespaces=())
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
    n: int = Field(1, ge=1, le=MAX_N, description="Choices to sample, each an independent sequence.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(
        0.0, ge=-2, le=2, allow_inf_nan=False, description="Subtracted once from the logit of each token in the output."
    )
    frequency_penalty: float | None = Field(
        0.0, ge=-2, le=2, allow_inf_nan=False, description="Subtracted from a logit per occurrence in the output."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; only empty.")
    user: str | None = Field(None, description="Accepted and ignored.")
    speculation: SpeculationOptions | None = Field(None, description="Extension: speculation control.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS (benchmarks).")
    stop_token_ids: list[int] | None = Field(
        None, description="vLLM extension: token ids that end the completion (their text is not in the output)."
    )
    request_id: str | None = Field(None, description="vLLM extension: accepted and ignored.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored (there are no tools).")
    repetition_penalty: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="vLLM extension: tokens of the prompt or output get logit / r (if > 0) or logit * r; 1 is off.",
    )
    min_p: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False,
        description="vLLM extension: drop tokens less likely than min_p times the most likely one; 0 is off.",
    )
    min_tokens: int | None = Field(None, description="vLLM extension: only 0 is supported.")
    use_beam_search: bool | None = Field(None, description="vLLM extension: only false is supported.")
    length_penalty: float | None = Field(None, description="vLLM extension: only 1 is supported.")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM extension: only false is supported.")
    skip_special_tokens: bool | None = Field(None, description="vLLM extension: only true is supported.")
    spaces_between_special_tokens: bool | None = Field(None, description="vLLM extension: only true is supported.")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM extension: not supported; only null.")
    prompt_logprobs: int | None = Field(None, description="vLLM extension: not supported; only null.")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM extension: not supported; only null.")
    bad_words: list[str] | None = Field(None, description="vLLM extension: not supported; only null.")
    guided_json: Any = Field(None, description="vLLM extension: not supported; only null.")
    guided_regex: str | None = Field(None, description="vLLM extension: not supported; only null.")
    guided_choice: list[str] | None = Field(None, description="vLLM extension: not supported; only null.")
    guided_grammar: str | None = Field(None, description="vLLM extension: not supported; only null.")
    structured_outputs: Any = Field(None, description="vLLM extension: not supported; only null.")
    priority: int | None = Field(None, description="vLLM extension: only 0 is supported.")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM extension: only false is supported.")

    @field_validator(*VLLM_NEUTRAL)
    @classmethod
    def _vllm_neutral(cls, v: Any, info: ValidationInfo) -> Any:
        return _only(v, VLLM_NEUTRAL[info.field_name])

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @property
    def unknown_fields(self) -> list[str]:
        """Fields of the body that no parameter declares (kept, not used)."""
        return sorted(self.model_extra or ())

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
            min_p=float(self.min_p or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            logprobs=self.num_logprobs,
        )

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives to report per token; None: no log-probabilities at all."""
        return None

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` of a seeded request: seed + index (mod 2**63), as vLLM seeds n > 1 (choice
        0 is the request's seed, so n never changes the first choice); None when the request has no seed."""
        return None if self.seed is None else (self.seed + index) % 2**63

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage_chunk and self.stream_options and self.stream_options.continuous_usage_stats)

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
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="Log-probability of each token and of this many most likely alternatives (null: none).",
    )
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

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

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
    logprobs: bool | None = Field(None, description="Return the log-probability of each output token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Most likely alternatives per token (needs logprobs true)."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported; only empty.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only 'none'.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'}.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored.")
    add_generation_prompt: bool | None = Field(None, description="vLLM extension: only true is supported.")
    continue_final_message: bool | None = Field(None, description="vLLM extension: only false is supported.")
    echo: bool | None = Field(None, description="vLLM extension: only false is supported.")
    chat_template: str | None = Field(None, description="vLLM extension: not supported; only null.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: only empty.")
    documents: list[dict[str, Any]] | None = Field(None, description="vLLM extension: not supported; only null.")
    functions: list[dict[str, Any]] | None = Field(None, description="Deprecated tools: not supported; only empty.")
    function_call: str | dict[str, Any] | None = Field(None, description="Deprecated tool_choice: only 'none'.")

    @field_validator(*CHAT_NEUTRAL)
    @classmethod
    def _chat_neutral(cls, v: Any, info: ValidationInfo) -> Any:
        return _only(v, CHAT_NEUTRAL[info.field_name])

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
