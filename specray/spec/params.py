"""Per-request sampling parameters and verification method names (pure data, no torch).

Kept apart from the tensor code so that configs, workers and the coordinator can import them cheaply.
"""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import dataclass, replace
from typing import NamedTuple

#: Padding value for ragged token tensors ([B, K] drafts, [B, K+1] outputs).
PLACEHOLDER_TOKEN_ID = -1


class VerifyMethod(str, enum.Enum):
    """How a level verifies the tokens proposed by the level below it.

    greedy:        temperature 0 only; accept while draft == argmax.
    rejection:     drafter sampled from q and sends q; accept w.p. min(1, p/q), residual max(p-q, 0).
    deterministic: q = delta_x (n-gram, greedy drafts, cascade outputs); accept w.p. p(x), residual p without x.
    coupled:       Gumbel-max with noise keyed by (seed, absolute position); accept while draft == argmax(log p + g).

    Rows whose temperature is 0 are verified greedily whatever the method: every method reduces to it.
    """

    GREEDY = "greedy"
    REJECTION = "rejection"
    DETERMINISTIC = "deterministic"
    COUPLED = "coupled"


class TokenLogprob(NamedTuple):
    """The target's raw log-probability of an emitted token and its `top` most likely alternatives
    (token id, log-probability), most likely first. Raw: the log-softmax of the target's logits at that
    position, before penalties, temperature and filters (vLLM's default `logprobs_mode`)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


#: Most alternatives a request may ask for per token (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, applied to the verifier's logits exactly as plain sampling would apply them.

    The distribution a level draws from (vLLM's order): the raw logits, then the penalties, then temperature,
    then min_p, then top-k, then top-p, then softmax; temperature 0 is the argmax of the penalized logits.

    temperature 0 means greedy. top_k <= 0 disables top-k; top_p = 1 disables nucleus filtering; min_p 0
    disables min_p (keep tokens with probability >= min_p * the top token's). Penalties as vLLM applies them:
    repetition_penalty (1 is off) divides the positive logits and multiplies the negative ones of every token
    seen in the prompt or the output; frequency_penalty subtracts its value times the token's count in the
    output, presence_penalty its value once for every token in the output. `prompt_len` says where the output
    starts in a sequence's tokens: the engine sets it when the sequence is admitted (`for_prompt`).
    logprobs: report the target's raw log-probability of each emitted token and this many top alternatives
    (None: none).
    seed None is replaced by a random seed when the request is admitted (see `with_seed`), so every
    random draw of a request is keyed and reproducible from its seed. `reproducible` False marks such an
    invented seed: nobody can ask for that output again, so an engine may draw the row with its own
    generator where its method is exact with any fresh randomness (a vLLM level's rejection sampler,
    `specray.engine.vllm_live`) instead of the keyed noise.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    reproducible: bool = True
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_len: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (they then depend on the tokens seen so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def with_seed(self) -> SamplingParams:
        """Return a copy with a concrete seed (a fresh random one if none was given)."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(62), reproducible=False)

    def for_prompt(self, prompt_len: int) -> SamplingParams:
        """A copy for a sequence whose output starts after `prompt_len` tokens (the penalties need it)."""
        return self if self.prompt_len == prompt_len else replace(self, prompt_len=prompt_len)


@dataclass(frozen=True)
class TreeShape:
    """How a model level drafts a token tree (EAGLE-2 / SpecInfer style, `draft_children`): level by level, the
    best `width` distinct nodes of the deepest level so far (by the drafter's path probability) each get `width`
    children, for `depth` levels (None: the round's K), with at most `max_nodes` nodes in all (None: width x
    depth; the best parents get their children first). width 1 is a chain of `depth` tokens."""

    width: int = 1
    depth: int | None = None
    max_nodes: int | None = None

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"tree width={self.width} must be >= 1 (1: chains)")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"tree depth={self.depth} must be >= 1 (or None: the round's K)")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"tree max_nodes={self.max_nodes} must be >= 1 (or None: width x depth)")

    @property
    def branches(self) -> bool:
        """Whether this shape makes trees rather than chains."""
        return self.width > 1

    def depth_for(self, k: int) -> int:
        """Levels of a tree drafted in a round whose K is k."""
        return self.depth if self.depth is not None else k

    def nodes_for(self, depth: int) -> int:
        """Node budget of a tree of `depth` levels."""
        return self.max_nodes if self.max_nodes is not None else self.width * depth


def tree_feeds(depth: int, width: int, nodes: int) -> list[int]:
    """Tokens per row a model drafter feeds at each of a tree's `depth` levels (`Worker.propose_tree`): the
    pending tokens at the root (about 1), then at depth d the nodes on the paths to the (at most `width`) parents
    being expanded: up to width x d of them, never more than the tree's `nodes`. What the planner prices a tree's
    proposal at, and how a timed proposal is read back."""
    return [1] + [max(1, min(width * d, nodes)) for d in range(1, depth)] if depth > 0 else []
