"""Per-request sampling parameters and verification method names (pure data, no torch).

Kept apart from the tensor code so that configs, workers and the coordinator can import them cheaply.
"""

from __future__ import annotations

import enum
import math
import secrets
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, applied to the verifier's logits exactly as plain sampling would apply them.

    temperature 0 means greedy. top_k <= 0 disables top-k; top_p = 1 disables nucleus filtering.
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

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """Return a copy with a concrete seed (a fresh random one if none was given)."""
        if self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, secrets.randbits(62), reproducible=False)
