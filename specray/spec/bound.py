"""Closed-form expectations of speculative decoding, for the planner and the benchmarks.

Notation (Leviathan et al. 2023): alpha_i is the probability that the i-th draft token of a round is
accepted given that the ones before it were; K the number of draft tokens per round; c the cost of one
drafter step relative to one verifier step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["expected_accepted_length", "expected_accepted_length_iid", "optimal_k", "speedup_bound"]


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"acceptance rates must be in [0, 1], got {alpha}")


def expected_accepted_length(alphas: Sequence[float]) -> float:
    """Expected tokens emitted per round with K = len(alphas) drafts.

    E[L] = 1 + sum_{i=1..K} prod_{j<=i} alpha_j: the i-th draft counts only if drafts 1..i are all
    accepted, and the recovered/bonus token always counts.
    """
    total, survive = 1.0, 1.0
    for a in alphas:
        _check_alpha(a)
        survive *= a
        total += survive
    return total


def expected_accepted_length_iid(alpha: float, k: int) -> float:
    """E[L] when every draft is accepted with the same rate alpha: (1 - alpha^(K+1)) / (1 - alpha).

    The geometric series 1 + alpha + ... + alpha^K; alpha = 1 gives K + 1.
    """
    _check_alpha(alpha)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_bound(alphas: float | Sequence[float], cost_ratio: float, k: int | None = None) -> float:
    """Expected walltime improvement over plain decoding: E[L] / (K * c + 1).

    A round costs K drafter steps (c each) plus one verifier step and emits E[L] tokens, where plain
    decoding emits one token per verifier step (Leviathan et al. 2023, Theorem 3.8). `alphas` is either
    one iid rate (then `k` is required) or per-position rates (then K = k, default len(alphas)).
    Ignores verification overhead beyond one forward pass, so it is an upper bound in practice.
    """
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    if isinstance(alphas, int | float):
        if k is None:
            raise ValueError("k is required with a single acceptance rate")
        expected = expected_accepted_length_iid(float(alphas), k)
    else:
        k = len(alphas) if k is None else k
        if not 0 <= k <= len(alphas):
            raise ValueError(f"k must be in [0, {len(alphas)}], got {k}")
        expected = expected_accepted_length(list(alphas)[:k])
    return expected / (k * cost_ratio + 1.0)


def optimal_k(alpha: float, cost_ratio: float, k_max: int = 16) -> int:
    """The K in [0, k_max] maximising `speedup_bound` for an iid rate (smallest K on ties)."""
    return max(range(k_max + 1), key=lambda k: (speedup_bound(alpha, cost_ratio, k), -k))
