"""The worker protocol: what the coordinator may ask of one model level.

A worker holds one model and the token state of every sequence it serves. The coordinator is the only
owner of the canonical (committed) text; it keeps each worker in step by sending a `SeqSync` with every
batched call ("keep your first `keep` tokens, then append `append`"), so one round costs one call per
level, whatever the backend (in-process, a Ray actor, a vLLM engine).

Verification runs inside the verifying worker, next to its logits: only token ids (and draft
probabilities when the drafter sampled) cross between levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from specray.engine.caps import WorkerCaps
from specray.spec.params import SamplingParams, TokenLogprob, VerifyMethod

if TYPE_CHECKING:
    from specray.spec.tree import DraftTree

__all__ = ["DraftMode", "DraftProposal", "SeqSync", "VerifyResult", "Worker", "WorkerCaps", "WorkerStats"]


class SeqSync(NamedTuple):
    """Bring a worker's copy of a sequence in line: truncate to `keep` tokens, then append `append`.

    Truncation is a rollback: the worker sets its length and never copies KV. `keep == 0` (`SeqSync.start`)
    starts the sequence with `append` as its prompt, replacing any copy the worker still holds: a level joins
    a sequence (or rejoins it after a failure) inside the call that first uses it, without a call of its own.
    A named tuple: one per row per call, so it must be cheap to make and to send.
    """

    keep: int
    append: tuple[int, ...] = ()

    @staticmethod
    def start(prompt_ids: Sequence[int]) -> SeqSync:
        """(Re)start a sequence with this prompt."""
        return SeqSync(0, tuple(prompt_ids))


class DraftMode:
    """How a drafter draws its proposals; chosen from the verification method of the level above."""

    GREEDY = "greedy"  # argmax: deterministic drafts (greedy / deterministic verification)
    RANDOM = "random"  # sample from q and send q (rejection verification)
    COUPLED = "coupled"  # Gumbel-max with the request's shared noise (coupled verification)

    @staticmethod
    def for_method(method: VerifyMethod) -> str:
        return {
            VerifyMethod.GREEDY: DraftMode.GREEDY,
            VerifyMethod.DETERMINISTIC: DraftMode.GREEDY,
            VerifyMethod.REJECTION: DraftMode.RANDOM,
            VerifyMethod.COUPLED: DraftMode.COUPLED,
        }[VerifyMethod(method)]


@dataclass
class DraftProposal:
    """Tokens proposed for each sequence (ragged), and q when the drafter sampled (rejection).

    trees: a round that drafts token trees for a verifier with `WorkerCaps.tree_verify` (`Worker.verify_tree`):
    each row's `DraftTree` (None: no draft); `token_ids[b]` then holds the tree's nodes in its flat order, so
    `len(token_ids[b])` is the number of nodes drafted (what the statistics count)."""

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None  # [B, k_max, V] float32; rows padded past len(token_ids[b])
    trees: list[DraftTree | None] | None = None


@dataclass
class VerifyResult:
    """Per sequence: the accepted draft tokens followed by one correction or bonus token."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    probs: torch.Tensor | None = None  # [B, n_max, V] distributions of the emitted tokens, if asked for
    #: per sequence, draft tokens the verifier's own engine proposed and verified in this call (a native vLLM
    #: level: vLLM's speculative decoding); None (or 0 for a row) when only the given drafts were verified
    native_drafts: list[int] | None = None
    #: per sequence, True where the native engine's request started in this call: its first step is a prefill
    #: that cannot draft, so it says nothing about the native acceptance (the planner skips such rows)
    native_cold: list[bool] | None = None
    #: every row was served by steps of requests kept alive in the verifier's engine (its decode path, with
    #: the drafts verified inside the engine): the call is timed apart from verification by a forward pass
    stepped: bool = False
    #: per sequence, the probability this level gave each emitted token (`verify(..., confidence=True)`; None
    #: where the worker does not report it): a middle level's drafting stops after an unsure token
    confidence: list[list[float]] | None = None
    #: per sequence, the target's raw log-probabilities of the emitted tokens with the top alternatives the row's
    #: `SamplingParams.logprobs` asks for (an empty list for a row that asks for none); None when no row asks, or
    #: from a worker without `WorkerCaps.logprobs`
    logprobs: list[list[TokenLogprob]] | None = None
    #: per sequence, the nodes of the draft tree `Worker.verify_tree` verified (None from `verify`); then
    #: `num_accepted` is the accepted path's length and `token_ids` the path's tokens plus the final token
    tree_nodes: list[int] | None = None


@dataclass
class WorkerStats:
    """Cheap introspection, used by tests (leaks) and metrics."""

    live_sequences: int
    cached_tokens: int
    cache_bytes: int
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Worker(Protocol):
    """One model level. All batched methods take `seq_ids` and an optional aligned list of `SeqSync`, and `level`,
    the index of the level the worker serves in the cascade: its random draws (sampled drafts, accept/reject
    coins, corrections) are keyed by it, so two levels never share a stream."""

    name: str
    vocab_size: int

    def capabilities(self) -> WorkerCaps:
        """The worker's static facts and optional abilities, read once when its level is built."""

    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        """Register a sequence with its prompt. The prompt is prefilled lazily on the first call."""

    def free(self, seq_id: str) -> None:
        """Forget a sequence and release its cache slot (idempotent)."""

    def propose(
        self,
        seq_ids: Sequence[str],
        k: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        """Draft k[b] tokens for each sequence autoregressively and keep them tentatively.

        `stop_below` > 0: a row's draft ends after a token to which this worker gave a probability below it
        (its own confidence; for greedy rows the softmax of its raw logits). A worker without
        `WorkerCaps.draft_confidence` drafts all k[b] (any draft is valid)."""

    def propose_tree(
        self,
        seq_ids: Sequence[str],
        depth: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        width: int = 2,
        max_nodes: Sequence[int] | None = None,
    ) -> DraftProposal:
        """Draft a token tree per sequence (`DraftProposal.trees`): depth[b] levels, at most `width` children per
        node and max_nodes[b] nodes (default width x depth[b]); the children are made as `DraftMode` says, so the
        verification method the mode is for stays exact (`specray.spec.tree.draft_children`). In random mode
        `probs` is q per slot, [B, N_max + 1, V], as `verify_tree` reads it. Nothing is appended to the sequence:
        the next call's sync brings the accepted tokens. Only a worker with `WorkerCaps.tree_propose`; the others
        raise NotImplementedError."""

    def verify(
        self,
        seq_ids: Sequence[str],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """Score the drafts in one forward pass, accept a prefix, append it plus one correction/bonus token.

        `confidence`: also report `VerifyResult.confidence` (None from a worker without
        `WorkerCaps.draft_confidence`)."""

    def verify_tree(
        self,
        seq_ids: Sequence[str],
        trees: Sequence[DraftTree | None],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """`verify` for a draft tree per row (None: no draft; `specray.spec.tree` for the layout and the methods):
        score every node in one forward, accept a root-to-leaf path, append its tokens plus one correction/bonus
        token (the emitted tokens, as `verify`'s). `draft_probs` [B, N + 1, V] or [B, N, V]: each slot's q
        (rejection only); `return_probs` / `confidence` as in `verify` (a middle level verifying a suffix level's
        trees drafts for the level above with them). Only a worker with `WorkerCaps.tree_verify`; the others raise
        NotImplementedError."""

    def stats(self) -> WorkerStats:
        """Live sequences and cache usage."""

    def reset_prefix_cache(self) -> None:
        """Forget the prompt prefixes cached from finished sequences (a benchmark's modes each start cold); live
        sequences keep their KV."""
