"""What a worker can do, declared once at start-up (`Worker.capabilities()`): the coordinator, the Ray actors
and the planner read this object and never probe a worker for attributes. Free of torch, so the coordinator's
state module and the planner can import it cheaply."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerCaps"]


@dataclass(frozen=True)
class WorkerCaps:
    """A model level's static facts and optional abilities.

    native_k: tokens the worker's own engine speculates per step on rows sent without a draft (a native vLLM
    level, `specray.engine.vllm_native`); 0: none.
    live_decode: rows without a draft are decoded on a path of the worker's own (a vLLM engine's live requests),
    cheaper than verification by a forward pass, so the planner times such calls apart.
    engine_verify: drafts of up to this many tokens are verified inside the worker's engine step; 0: by a forward
    pass over the draft. A step that prefills a sequence verifies none, so the coordinator sends a sequence's
    first round to such a worker without a draft.
    draft_confidence: the worker honours `propose(stop_below=)` and reports `verify(confidence=True)`; without
    it, drafts run their full length and `VerifyResult.confidence` is None (both still exact).
    penalties: the worker applies `SamplingParams`' presence / frequency / repetition penalties to its own
    distribution (a target without it cannot serve a penalized request; a drafter without it drafts from its
    unpenalized distribution, which stays exact: the target verifies).
    logprobs: the worker reports `VerifyResult.logprobs` for rows whose `SamplingParams.logprobs` is set.
    tree_verify: the worker scores a token tree per row in one forward (`score_tree`: tree attention mask,
    positions by depth) and keeps an accepted root-to-leaf path of it (`accept_paths`); without it a level
    verifies chains only, and those methods raise.
    tree_propose: the worker drafts a token tree per row (`propose_tree`: depth by depth, the best nodes of each
    level expanded with a tree mask), which a verifier with `tree_verify` checks in one forward; without it the
    level drafts chains.
    """

    name: str
    vocab_size: int
    max_context: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    native_k: int = 0
    live_decode: bool = False
    engine_verify: int = 0
    draft_confidence: bool = False
    penalties: bool = False
    logprobs: bool = False
    tree_verify: bool = False
    tree_propose: bool = False
