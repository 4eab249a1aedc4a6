"""The planner's candidate plans and their ranking by predicted goodput, and the names and table entries that
pick plans.

`Ranking` (a mixin of `specray.policy.planner.Planner`) enumerates the candidates once (plain decoding; every subset
of the levels below the target with every K of `k_choices`, twice where the first level drafts token trees; hybrid
plans under a lookup level 0) and ranks them at a batch size: chains through `ChainTable`'s vectorised pricing, the
others one by one (`Pricing.goodput`), memoised until the next measurement. `regime_of` names a plan's regime; a
`policy.table` entry (`_parse`) is a plan, a K, a regime or a plan name.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from specray.coordinator.state import Plan, plan_name
from specray.policy.chains import ChainTable
from specray.policy.pricing import Pricing, _effective

if TYPE_CHECKING:
    import threading

__all__ = ["REGIMES", "Ranking", "regime_of"]

REGIMES = ("cascade", "draft", "ngram", "none")


def regime_of(plan: Plan, is_ngram: Sequence[bool]) -> str:
    """'none' (plain decoding), 'ngram' or 'draft' (one drafter), or 'cascade' (two or more drafters)."""
    eff = _effective(plan)
    if len(eff) == 1:
        return "none"
    if len(eff) == 2:
        return "ngram" if is_ngram[plan.levels[eff[0]]] else "draft"
    return "cascade"


class Ranking(Pricing):
    """Mixin of `Planner`: its candidates (`_init_candidates`, once), their ranking (`explain`, `describe`) and the
    table's overrides. Uses the planner's levels (`names`, `top`, `is_ngram`), `k_choices`, its plain, default and
    held plans, `table` and `_lock`."""

    names: list[str]
    k_choices: tuple[int, ...]
    plain: Plan
    default_plan: Plan
    table: list[tuple[int, int, Any]]
    _current: Plan
    _lock: threading.RLock

    def _init_candidates(self) -> None:
        """The candidate list, fixed for the planner's life, and what ranks it fast (a `ChainTable`, tie-breaks)."""
        self.candidates = self._enumerate()
        self._index = {p: i for i, p in enumerate(self.candidates)}
        self._chains = ChainTable(self.candidates)  # the ranking's vectorised pricing of chain candidates
        self._n_levels = np.array([len(p.levels) for p in self.candidates])  # explain's tie-breaks
        self._k_sum = np.array([sum(p.k) for p in self.candidates])

    def _enumerate(self) -> list[Plan]:
        """Plain decoding, every subset of the lower levels with every K (chains and trees where the first level
        drafts trees), and the hybrid plans under a lookup level 0."""
        plans = [self.plain]
        lower = list(range(self.top))
        for r in range(1, len(lower) + 1):
            for subset in itertools.combinations(lower, r):
                width = self.tree_widths.get(subset[0], 1)
                trees = width > 1 and (subset[1] if r > 1 else self.top, subset[0], width) in self.tree_acceptance
                for ks in itertools.product(self.k_choices, repeat=r):
                    if trees:  # the first level's chains and its trees: widths {1, configured}
                        plans += [Plan((*subset, self.top), ks, tree=1),
                                  Plan((*subset, self.top), ks, tree=width)]
                    else:
                        plans.append(Plan((*subset, self.top), ks))
        if self.is_ngram[0]:  # hybrid: the lookup's match per row, else a model drafter's draft
            for m in range(1, self.top):
                for ks in itertools.product(self.k_choices, repeat=2):
                    plans.append(Plan((0, m, self.top), ks, hybrid=True))
        return plans

    # ----- ranking ----------------------------------------------------------------------------------
    def _scores(self, batch: int) -> tuple[list[Plan], np.ndarray, dict[Plan, int]]:
        """(plans, goodput of each, index of each plan): every candidate, then the held and default plans where they
        are not candidates, priced at `batch` -- chain candidates by `ChainTable` (the same values as `goodput`, in
        one vectorised pass), the others one by one. Memoised until the next measurement; callers must not modify."""
        extras = tuple(p for p in dict.fromkeys((self._current, self.default_plan)) if p not in self._index)
        key = ("g", batch, extras)
        got = self._memo.get(key)
        if got is not None:
            return got
        gp, covered = self._chains.goodputs(self, batch)
        plans, index = self.candidates, self._index
        for i in np.flatnonzero(~covered).tolist():
            gp[i] = self.goodput(plans[i], batch)
        if extras:
            plans = [*plans, *extras]
            index = {**index, **{p: len(self.candidates) + j for j, p in enumerate(extras)}}
            gp = np.concatenate([gp, [self.goodput(p, batch) for p in extras]])
        got = self._memo[key] = (plans, gp, index)
        return got

    def _goodput(self, plan: Plan, batch: int) -> float:
        """`goodput(plan, batch)`, read from the ranking's table when the plan is in it."""
        plans, gp, index = self._scores(batch)
        i = index.get(plan)
        return float(gp[i]) if i is not None else self.goodput(plan, batch)

    def explain(self, batch_size: int) -> list[tuple[Plan, float]]:
        """Every candidate (and the current and default plans) with its predicted goodput, best first (ties: fewer
        levels, then a smaller total K, then candidate order)."""
        with self._lock:
            plans, gp, _ = self._scores(max(1, batch_size))
            if np.isnan(gp).any():  # no total order: what Python's sort makes of it
                return sorted(zip(plans, gp.tolist()), key=lambda x: (-x[1], len(x[0].levels), sum(x[0].k)))
            extra = plans[len(self.candidates):]
            n_levels = np.concatenate([self._n_levels, [len(p.levels) for p in extra]]) if extra else self._n_levels
            k_sum = np.concatenate([self._k_sum, [sum(p.k) for p in extra]]) if extra else self._k_sum
            order = np.lexsort((k_sum, n_levels, -gp))  # stable: equal keys keep the candidates' order
            return list(zip(map(plans.__getitem__, order.tolist()), gp[order].tolist()))

    def describe(self, batch_size: int, top: int = 5) -> dict[str, Any]:
        """The planner's view for `/health`: the plan it holds and its best-ranked candidates at `batch_size`,
        each with predicted goodput (tokens/s), tokens per round E[L] and round time -- what to look at when
        a deployment speculates less (or more) than expected."""
        batch = max(1, int(batch_size))
        with self._lock:
            ranked = [{"plan": self.plan_name(p), "goodput": round(g, 3),
                       "tokens_per_round": round(self.expected_length(p, batch), 3),
                       "round_s": round(self.round_time(p, batch), 4)} for p, g in self.explain(batch)[:top]]
            return {"batch": batch, "current": self.plan_name(self._current), "ranked": ranked}

    # ----- names and the table ----------------------------------------------------------------------
    def regime_of(self, plan: Plan) -> str:
        return regime_of(plan, self.is_ngram)

    def plan_name(self, plan: Plan) -> str:
        return plan_name(plan, self.names)

    def _parse(self, spec: Any, batch: int) -> Plan | None:
        """A table entry's plan at `batch` (None: no override)."""
        if spec is None or isinstance(spec, Plan):
            return spec
        if isinstance(spec, int):
            return self.plain if spec <= 0 else Plan(self.default_plan.levels, tuple(spec for _ in self.default_plan.k))
        s = str(spec).strip()
        if s == "auto":
            return None
        if s in ("none", "plain"):
            return self.plain
        if s == "default":
            return self.default_plan
        if s in (*REGIMES, "hybrid"):  # 'cascade' is a chain of drafters; 'hybrid' the best hybrid plan
            ranked = [p for p, _ in self.explain(batch)
                      if (p.hybrid if s == "hybrid" else not p.hybrid and self.regime_of(p) == s)]
            if not ranked:
                raise ValueError(f"table entry {s!r}: no candidate plan of that regime")
            return ranked[0]
        levels, ks = [], []
        hybrid = "|" in s  # 'ngram:3|draft:4>target': the n-gram's match, else the draft's
        parts = s.replace("|", ">", 1).split(">")
        tree = 0
        for j, part in enumerate(parts):
            name, _, k = part.partition(":")
            if j == 0 and "/w" in k:  # 'suffix:8/w3>target': the first level's tree width (`Plan.tree`)
                k, _, w = k.partition("/w")
                tree = int(w)
            if name not in self.names:
                raise ValueError(f"table entry {s!r}: unknown level {name!r}")
            levels.append(self.names.index(name))
            if j < len(parts) - 1:
                ks.append(int(k) if k else 0)
        return Plan(tuple(levels), tuple(ks), hybrid=hybrid, tree=tree)

    def _override(self, batch: int) -> Plan | None:
        for lo, hi, spec in self.table:
            if lo <= batch <= hi:
                return self._parse(spec, batch)
        return None
