"""N-gram (prompt lookup) proposer: drafts cost ~0, so it pays wherever the output repeats its context.

Knobs and meaning follow vLLM: `num_speculative_tokens` (k), `prompt_lookup_min`, `prompt_lookup_max`.
Which occurrence of the longest matching suffix drafts is a choice (`occurrence`): the most recent one
(default: what the output just did is the best guess of what it does next) or the earliest, which is what
vLLM 0.32's proposer takes (`NgramProposer`; on code editing the earliest is usually in the prompt, the text
being copied). Offline, on Qwen2.5-Coder-1.5B greedy outputs of the benchmark prompts (96 tokens, K=4,
lookup 1..4), the earliest gave 2.70 tokens per round on code editing against 2.53 for the most recent,
and the same 1.75 on extraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

OCCURRENCES = ("recent", "earliest")


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int, occurrence: str = "recent") -> list[int]:
    """Draft up to k tokens by finding the sequence's own suffix earlier in the sequence.

    The longest suffix n-gram (max_n down to min_n) that occurs earlier wins; among its occurrences the
    most recent one is used (occurrence="earliest": the first one, as vLLM does); the draft is the tokens
    that followed it (possibly fewer than k, and possibly running into the suffix itself). The search covers
    prompt plus generated tokens.

    Worked example: tokens [1, 2, 3, 4, 2, 3], min_n 2, max_n 3, k 4. The 3-gram suffix [4, 2, 3] does not
    occur earlier; the 2-gram [2, 3] occurs at index 1, followed by [4, 2, 3] -> draft [4, 2, 3]. In
    [5, 1, 2, 9, 1, 2, 8, 1, 2] the suffix [1, 2] occurs at 1 and 4: the most recent drafts [8, 1], the
    earliest [9, 1].

    >>> propose_ngram([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3)
    [4, 2, 3]
    >>> propose_ngram([5, 1, 2, 9, 1, 2, 8, 1, 2], k=2, min_n=2, max_n=2)
    [8, 1]
    >>> propose_ngram([5, 1, 2, 9, 1, 2, 8, 1, 2], k=2, min_n=2, max_n=2, occurrence="earliest")
    [9, 1]
    >>> propose_ngram([1, 2, 3], k=2, min_n=1, max_n=2)
    []
    """
    if occurrence not in OCCURRENCES:
        raise ValueError(f"occurrence must be one of {OCCURRENCES}, not {occurrence!r}")
    if k <= 0 or min_n < 1 or max_n < min_n:
        return []
    n_tokens = len(tokens)
    seq = list(tokens)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = seq[n_tokens - n :]
        first = suffix[0]
        # earlier occurrences start before n_tokens - n (they may overlap the suffix itself)
        starts = range(n_tokens - n) if occurrence == "earliest" else range(n_tokens - n - 1, -1, -1)
        for start in starts:
            if seq[start] == first and seq[start : start + n] == suffix:
                follow = seq[start + n : start + n + k]
                if follow:
                    return follow
                break
    return []


@dataclass(frozen=True)
class NgramConfig:
    """vLLM-compatible n-gram speculation settings."""

    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    #: which occurrence of the longest matching suffix drafts: "recent" or "earliest" (vLLM's)
    occurrence: str = "recent"

    def __post_init__(self) -> None:
        if self.prompt_lookup_min < 1 or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.occurrence not in OCCURRENCES:
            raise ValueError(f"occurrence must be one of {OCCURRENCES}, not {self.occurrence!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        kk = self.num_speculative_tokens if k is None else k
        return propose_ngram(tokens, kk, self.prompt_lookup_min, self.prompt_lookup_max, self.occurrence)
