"""Incremental detokenization and stop strings for streamed output (pure: no Ray, no HTTP, no pydantic).

Tokens arrive a few at a time (one verification round accepts 1..K+1 of them) and must become text
that never has to be taken back: a byte-level BPE token may hold half of a UTF-8 character, and
SentencePiece-style decoders drop the leading space of the first token they see, so decoding tokens one
by one is wrong. `IncrementalDetokenizer` decodes a short sliding window (the tokens of the last emitted
chunk plus the new ones) and emits only the difference to the window's already-emitted text, holding
back while the window ends in U+FFFD (an incomplete character). `StopChecker` then holds back text that
might be the beginning of a stop string, so that a stop string split across chunks is still caught.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"

#: Prompt tokens decoded as context before the first generated token (SentencePiece spaces, merges).
PROMPT_CONTEXT_TOKENS = 5
#: An incomplete UTF-8 character has at most 3 bytes, so it spans at most 3 tokens (every byte-level or
#: byte-fallback token holds at least one byte). Holding back more than this means the U+FFFD is real
#: (invalid bytes from the model) and is emitted rather than holding the stream forever.
MAX_PARTIAL_TOKENS = 3
#: Already-emitted ids kept before the window are dropped once there are this many (bounded memory).
_TRIM_AT = 4096

_DROPPED_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """Special ids that decode(skip_special_tokens=True) drops entirely, computed once per tokenizer."""
    try:
        return _DROPPED_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    special = getattr(tokenizer, "all_special_ids", None) or []
    ids = frozenset(
        i for i in special if tokenizer.decode([i], skip_special_tokens=True, clean_up_tokenization_spaces=False) == ""
    )
    with contextlib.suppress(TypeError):  # not weak-referenceable: just recompute next time
        _DROPPED_CACHE[tokenizer] = ids
    return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of final text chunks.

    Concatenating every `push` and the final `flush` gives ``tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` of the generated ids (which is plain ``decode`` for tokenizers that
    do not clean up spaces: Qwen2.5, Llama 3, SmolLM2 and the tiny test tokenizer). With `prompt_ids`, the
    last prompt tokens are decoded as context, so the result is the continuation of the prompt's text
    (a SentencePiece token "▁Hello" after a prompt gives " Hello", as in the full decode of prompt + output).

    Each push decodes only the window [prefix, end): the tokens of the previous emitted chunk (context for
    merges and spaces) plus the pending ones, so the cost is O(new tokens) amortised.

    Caveat: a SentencePiece byte-fallback decoder turns a whole run of <0xNN> tokens into U+FFFDs when any
    byte in it is invalid, so a model that emits invalid bytes after valid ones can make the full decode
    differ from what was already streamed. Valid text (the normal case) is always exact.
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Tokens that decode drops entirely are never stored: a long run of them would otherwise grow the
        # window, and a window made only of them would decode to "" and lose a SentencePiece leading space.
        self._dropped = _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix = 0  # window start: first token of the last emitted chunk
        self._read = 0  # tokens before this are emitted
        self._prefix_text = ""  # decode(ids[prefix:read])
        if prompt_ids:
            self._init_context([int(t) for t in prompt_ids if int(t) not in self._dropped])

    def _init_context(self, prompt: list[int]) -> None:
        start = max(len(prompt) - PROMPT_CONTEXT_TOKENS, 0)
        # Start the window on a character boundary: step back over tokens that begin mid-character.
        for _ in range(MAX_PARTIAL_TOKENS):
            if start == 0 or not self._decode_ids(prompt[start:]).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        self._ids = prompt[start:]
        self._read = len(self._ids)
        self._prefix_text = self._decode_ids(self._ids)

    def _decode_ids(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end])

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text that became final (possibly "")."""
        self._ids.extend(t for t in map(int, token_ids) if t not in self._dropped)
        end = len(self._ids)
        if end == self._read:
            return ""
        text = self._decode(self._prefix, end)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._commit(text, end)
        # The last few tokens may hold an incomplete character: emit up to the latest clean cut before them
        # (several tokens pushed at once may end mid-character after complete ones). Not required to be a
        # prefix of `text`: a byte-fallback run decodes to all U+FFFD until its last character is complete.
        for cut in range(end - 1, max(self._read, end - MAX_PARTIAL_TOKENS - 1), -1):
            head = self._decode(self._prefix, cut)
            if not head.endswith(REPLACEMENT_CHAR):
                return self._commit(head, cut)
        if end - self._read <= MAX_PARTIAL_TOKENS:
            return ""  # maybe an incomplete character: wait for its next bytes
        return self._force(text, end)

    def flush(self) -> str:
        """Return everything still held back (call once the sequence is finished)."""
        end = len(self._ids)
        if end == self._read:
            return ""
        text = self._decode(self._prefix, end)
        out = text[len(self._prefix_text) :]
        self._prefix, self._read, self._prefix_text = end, end, ""
        return out

    def _commit(self, text: str, end: int) -> str:
        """Emit `text` (the decode of [prefix, end)) beyond what was already emitted and slide the window."""
        # Lossy UTF-8 and the tokenizers' decoders are prefix-stable once a window starts on a character
        # boundary, so text extends _prefix_text; if a pathological byte-fallback run broke that, emitting
        # the length difference (as vLLM does) is the best that can be done without taking text back.
        out = text[len(self._prefix_text) :]
        if not out:
            return ""  # e.g. a token that decodes to nothing yet: keep it in the window
        self._prefix_text = self._decode(self._read, end)
        self._prefix, self._read = self._read, end
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return out

    def _force(self, text: str, end: int) -> str:
        """The window ends in U+FFFD although more than MAX_PARTIAL_TOKENS tokens are pending, so it is an
        invalid byte sequence rather than a character in progress: emit up to a cut at least
        MAX_PARTIAL_TOKENS tokens back whose text is a prefix of the window's (bytes that far back are
        decided: no later byte can complete a character that started before them)."""
        lowest = max(self._read, end - MAX_PARTIAL_TOKENS - 8)
        for cut in range(end - MAX_PARTIAL_TOKENS, lowest, -1):
            head = self._decode(self._prefix, cut)
            if len(head) > len(self._prefix_text) and text.startswith(head):
                return self._commit(head, cut)
        return ""


class StopChecker:
    """Cuts a text stream at the first stop string to complete, holding back text that may be a stop string's start.

    `push` returns (text safe to emit, stopped). The stop string itself is not emitted (OpenAI semantics);
    after a stop every push returns ("", True). Only a suffix that is a proper prefix of some stop string is
    held back (at most max(len(stop)) - 1 characters), so ordinary text is not delayed.
    """

    def __init__(self, stop: Sequence[str] | None) -> None:
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self._max_hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self._held = ""
        self.stopped = False
        #: The stop string that ended the stream (for finish_reason / logging), None until then.
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return text, False
        buf = self._held + text
        # The first stop string to be completed wins (earliest end, then earliest start), as when checking
        # character by character: the result does not depend on how the text was chunked.
        hit: tuple[int, int, str] | None = None
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0 and (hit is None or (i + len(s), i) < hit[:2]):
                hit = (i + len(s), i, s)
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit[2], ""
            return buf[: hit[1]], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def flush(self) -> str:
        """Held-back text at the end of the stream (nothing after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
