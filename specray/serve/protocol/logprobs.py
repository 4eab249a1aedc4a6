"""The target's log-probabilities in OpenAI's two shapes: chat (`choices[].logprobs.content[]`: token, logprob,
bytes, top_logprobs) and legacy completions (`logprobs`: tokens, token_logprobs, top_logprobs, text_offset).

Values are the target's raw log-probabilities (`TokenLogprob`), clamped at -9999 as vLLM does (JSON has no -inf).
A token's text is its own decode (special tokens included), or "token_id:N" on a server without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specray.serve.protocol.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from specray.spec.params import TokenLogprob

__all__ = ["LogprobFormatter"]

#: the lowest log-probability written (vLLM's floor)
LOGPROB_FLOOR = -9999.0


def _clamp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


class LogprobFormatter:
    """Formats one choice's log-probabilities chunk by chunk; `text_offset` runs on across chunks."""

    def __init__(self, decode: Callable[[int], str] | None) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}
        self.offset = 0

    def token(self, tid: int) -> str:
        text = self._cache.get(tid)
        if text is None:
            text = self._decode(tid) if self._decode is not None else f"token_id:{tid}"
            if len(self._cache) < 65536:
                self._cache[tid] = text
        return text

    def chat(self, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
        """One entry per token: the token with its log-probability and the most likely alternatives."""
        out = []
        for tid, lp in zip(ids, lps, strict=True):
            text = self.token(tid)
            top = [TopLogprob(token=(t := self.token(a)), logprob=_clamp(v), bytes=list(t.encode("utf-8", "replace")))
                   for a, v in lp.top]
            out.append(ChatTokenLogprob(token=text, logprob=_clamp(lp.logprob),
                                        bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
        return out

    def completion(self, ids: Sequence[int], lps: Sequence[TokenLogprob]) -> CompletionLogprobs:
        """The legacy shape: the alternatives' dict holds the token itself too (up to top + 1 entries)."""
        out = CompletionLogprobs()
        for tid, lp in zip(ids, lps, strict=True):
            text = self.token(tid)
            top = {self.token(a): _clamp(v) for a, v in lp.top}
            top.setdefault(text, _clamp(lp.logprob))
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out
