"""Goodput of every chain candidate at once: the planner's ranking, vectorised over K.

A ranking prices each (levels, K) candidate -- 289 plans for three levels with K up to 16 -- and pricing them one
by one through `Pricing.round_time` (a recursion, dict memo look-ups per call) costs milliseconds of the
coordinator's CPU, paid on the rounds that rank. A chain [l_0(K_0), ..., l_{m-1}(K_{m-1}), target] without overlap
is priced from a few per-ranking tables: each level's step time T_l(B, q) for q = 1..k_max + 1, the target's
verification time per K, and E[L] per (verifier, drafter) pair and K. `ChainTable` groups the candidates by their
levels and evaluates each group's recursion (`Pricing._produce`) on arrays of K, with the same operations in the
same order as the scalar path, so every goodput is bit-for-bit the one `Pricing.goodput` gives (the planner's unit
tests and `tests/unit/test_ranking_table.py` hold it to that). Plans it does not cover (plain decoding, hybrid,
overlapped, a K of 0, a plan priced from token-tree measurements) are left to the scalar path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specray.coordinator.state import Plan

if TYPE_CHECKING:
    from specray.policy.pricing import Pricing

__all__ = ["ChainTable"]


class ChainTable:
    """The chain candidates of a fixed candidate list, grouped by levels; `goodputs` prices them per batch."""

    def __init__(self, plans: Sequence[Plan]) -> None:
        groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, p in enumerate(plans):
            if not p.hybrid and len(p.levels) >= 2 and all(k >= 1 for k in p.k):
                groups.setdefault((p.levels, p.tree), []).append(i)
        #: (levels, first plan, candidate indices (n,), K per drafting level (n, len(levels) - 1))
        self.groups: list[tuple[tuple[int, ...], Plan, np.ndarray, np.ndarray]] = [
            (levels, plans[idx[0]], np.array(idx, dtype=np.intp),
             np.array([plans[i].k for i in idx], dtype=np.intp).reshape(len(idx), len(levels) - 1))
            for (levels, _tree), idx in groups.items()]
        self.k_max = max((int(ks.max()) for *_, ks in self.groups), default=0)
        self.size = len(plans)

    def goodputs(self, pricing: Pricing, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(goodput per candidate (size,), covered (size,) bool): E[L] * B / T_round of each chain candidate that is
        not overlapped; the others are left at 0 and not covered."""
        out = np.zeros(self.size)
        covered = np.zeros(self.size, dtype=bool)
        if not self.groups:
            return out, covered
        kmax, m = self.k_max, pricing.measured
        steps: dict[int, np.ndarray] = {}  # level -> T_l(B, q) at index q (q = 0 unused)
        elens: dict[tuple[int, int], np.ndarray] = {}  # (verifier, drafter) -> E[L] at index K

        def step(level: int) -> np.ndarray:  # Pricing.step_time(level, batch, q) for every q at once
            t = steps.get(level)
            if t is None:
                t = steps[level] = np.full(kmax + 2, pricing.ngram_cost) if m.is_ngram[level] else \
                    m.costs[level].predict_many(batch, np.arange(kmax + 2))
            return t

        drafted: dict[int, np.ndarray] = {}  # model level -> Pricing.draft_lengths(level, batch, kmax)

        def dl(level: int) -> np.ndarray:
            d = drafted.get(level)
            if d is None:
                d = drafted[level] = np.array(pricing.draft_lengths(level, batch, kmax))
            return d

        def elen(up: int, lo: int) -> np.ndarray:
            e = elens.get((up, lo))
            if e is None:
                e = elens[(up, lo)] = np.array([1.0, *m.expected_lengths((up, lo), kmax)])
            return e

        if m.native_cost is None or not m.engine_verify:  # Pricing._verify_time: one forward of K + 1
            verify = np.concatenate([[0.0], step(m.top)[2:]])
        else:
            verify = np.array([0.0] + [pricing._verify_time(batch, k) for k in range(1, kmax + 1)])
        lookup_verify = None  # Pricing._lookup_verify_time per K, made when an n-gram chain needs it
        for levels, first, idx, kk in self.groups:
            if pricing._overlapped(first) or pricing._tree_priced(first):
                continue  # overlapped; or priced from token-tree measurements (the tokens fed, a tree's acceptance)
            # Pricing._produce, level by level: the first drafter's K_0 steps (an n-gram: its flat cost), then each
            # middle level's ceil(K_i / E_i) inner rounds of (its drafter's tokens + its own check)
            low = levels[0]
            produce = np.full(len(idx), pricing.ngram_cost) if m.is_ngram[low] else dl(low)[kk[:, 0]] * step(low)[1]
            for i in range(1, len(levels) - 1):
                lvl, k_low = levels[i], kk[:, i - 1]
                inner = np.ceil(dl(lvl)[kk[:, i]] / elen(lvl, levels[i - 1])[k_low] - 1e-9)
                produce = inner * (produce + step(lvl)[k_low + 1])
            k, host = kk[:, -1], pricing.host_of(tuple(levels[:-1]), batch)
            if m.is_ngram[levels[-2]] and not m.chain_fed(m.top, levels[-2]):  # no match: a plain step
                if lookup_verify is None:
                    per_k = [pricing._lookup_verify_time(batch, j) for j in range(1, kmax + 1)]
                    lookup_verify = np.array([0.0, *per_k])
                t = produce + lookup_verify[k] + host
            elif pricing.stops(levels[-2]):  # a model drafter that stops short: over its drafts' lengths
                t = produce + np.array(pricing.stopping_verify_times(levels[-2], batch, kmax))[k] + host
            else:  # a model drafter that fills its K
                t = produce + verify[k] + host
            out[idx] = np.divide(elen(m.top, levels[-2])[k] * batch, t, out=np.full(len(t), np.inf), where=t > 0)
            covered[idx] = True
        return out, covered
