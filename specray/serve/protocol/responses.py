"""Response schemas (unary and streamed chunks), usage with per-level speculation stats, and SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

if TYPE_CHECKING:  # cascade imports torch; the schemas only need the attributes
    from specray.coordinator.stats import LevelStats

FinishReason = Literal["stop", "length"]


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class SpeculationPairUsage(_Response):
    """Acceptance stats of one drafter -> verifier pair in one request (extension)."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"tree_drafts", "tree_nodes"})

    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float = Field(description="accepted_tokens / draft_tokens (0 when nothing was drafted).")
    mean_acceptance_length: float = Field(description="Tokens emitted per verification call (accepted + 1).")
    tree_drafts: int | None = Field(None, description=(
        "Verifications of a draft token tree (a suffix level's `tree_width`); each counts in num_drafts with its "
        "nodes as draft_tokens and its accepted path's length as accepted_tokens. Left out without trees."))
    tree_nodes: int | None = Field(None, description="Nodes of those trees (left out without trees).")


class SpeculationLevelUsage(SpeculationPairUsage):
    """Per-level acceptance stats of one request (extension); a level counts the drafts proposed to it, by
    whichever level drafted them: `pair` names the drafter(s), `pairs` splits the counts by drafter."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"pair", "tree_drafts", "tree_nodes"})

    pair: str | None = Field(None, description=(
        '"<drafter>-><verifier>" whose drafts these are (e.g. "ngram->mid"); drafters joined by "+" when the '
        "level verified drafts from several in this request; left out when nothing drafted for it."))
    pairs: dict[str, SpeculationPairUsage] = Field(
        default_factory=dict, description='The same counts per "<drafter>-><verifier>" pair.')


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
    def counts(s: LevelStats) -> dict[str, Any]:
        out = {"num_drafts": s.num_drafts, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
               "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length}
        if s.tree_drafts:
            out.update(tree_drafts=s.tree_drafts, tree_nodes=s.tree_nodes)
        return out

    spec = {
        name: SpeculationLevelUsage(**counts(s), pair=s.pair,
                                    pairs={p: SpeculationPairUsage(**counts(ps)) for p, ps in s.pairs.items()})
        for name, s in (stats or {}).items()
    }
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        speculation=spec or None,
    )


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions shape: per token its text, log-probability, the most likely alternatives with
    the token itself (up to `logprobs` + 1 entries, keyed by text) and its character offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: BaseModel | Mapping[str, Any]) -> str:
    """One server-sent event: "data: {json}\\n\\n" (compact JSON, UTF-8 kept as is)."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json()
    else:
        payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n"
