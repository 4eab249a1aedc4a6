"""The planner's candidate plans and their ranking by predicted goodput, and the names and table entries that
pick plans.

`Ranking` (a part of `specray.policy.planner.Planner`, over its `Pricing`) enumerates the candidates once (plain
decoding; every subset of the levels below the target with every K of `k_choices`, twice where the first level
drafts token trees; hybrid plans under a lookup level 0) and ranks them at a batch size: chains through
`ChainTable`'s vectorised pricing, the others one by one (`Pricing.goodput`), memoised until the next measurement.
The planner's held plan is ranked with them (an argument: the choice is the planner's). `regime_of` names a plan's
regime; a `policy.table` entry (`parse`) is a plan, a K, a regime or a plan name.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from specray.coordinator.state import Plan, plan_name
from specray.policy.chains import ChainTable
from specray.policy.pricing import _effective

if TYPE_CHECKING:
    from specray.policy.pricing import Pricing

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


class Ranking:
    """The candidate plans (fixed for the planner's life), their ranking by `pricing`'s goodput at a batch size
    (`explain`, `describe`), and the names and table entries that pick plans. Not locked: the planner holds its
    measurements' lock around every call."""

    def __init__(self, pricing: Pricing, names: Sequence[str], plain: Plan, default_plan: Plan) -> None:
        self.pricing = pricing
        self.names = list(names)
        self.plain, self.default_plan = plain, default_plan
        self.candidates = self._enumerate()
        self.index = {p: i for i, p in enumerate(self.candidates)}
        self.chains = ChainTable(self.candidates)  # the ranking's vectorised pricing of chain candidates
        self._n_levels = np.array([len(p.levels) for p in self.candidates])  # explain's tie-breaks
        self._k_sum = np.array([sum(p.k) for p in self.candidates])

    def _enumerate(self) -> list[Plan]:
        """Plain decoding, every subset of the lower levels with every K (chains and trees where the first level
        drafts trees), and the hybrid plans under a lookup level 0."""
        m = self.pricing.measured
        top, k_choices = m.top, m.k_choices
        plans = [self.plain]
        lower = list(range(top))
        for r in range(1, len(lower) + 1):
            for subset in itertools.combinations(lower, r):
                width = m.tree_widths.get(subset[0], 1)
                trees = width > 1 and (subset[1] if r > 1 else top, subset[0], width) in m.tree_acceptance
                for ks in itertools.product(k_choices, repeat=r):
                    if trees:  # the first level's chains and its trees: widths {1, configured}
                        plans += [Plan((*subset, top), ks, tree=1),
                                  Plan((*subset, top), ks, tree=width)]
                    else:
                        plans.append(Plan((*subset, top), ks))
        if m.is_ngram[0]:  # hybrid: the lookup's match per row, else a model drafter's draft
            for mid in range(1, top):
                for ks in itertools.product(k_choices, repeat=2):
                    plans.append(Plan((0, mid, top), ks, hybrid=True))
        return plans

    # ----- ranking ----------------------------------------------------------------------------------
    def scores(self, batch: int, held: Plan) -> tuple[list[Plan], np.ndarray, dict[Plan, int]]:
        """(plans, goodput of each, index of each plan): every candidate, then the `held` and default plans where
        they are not candidates, priced at `batch` -- chain candidates by `ChainTable` (the same values as `goodput`,
        in one vectorised pass), the others one by one. Memoised until the next measurement; callers must not
        modify."""
        extras = tuple(p for p in dict.fromkeys((held, self.default_plan)) if p not in self.index)
        memo = self.pricing.measured.memo
        key = ("g", batch, extras)
        got = memo.get(key)
        if got is not None:
            return got
        pricing = self.pricing
        gp, covered = self.chains.goodputs(pricing, batch)
        plans, index = self.candidates, self.index
        for i in np.flatnonzero(~covered).tolist():
            gp[i] = pricing.goodput(plans[i], batch)
        if extras:
            plans = [*plans, *extras]
            index = {**index, **{p: len(self.candidates) + j for j, p in enumerate(extras)}}
            gp = np.concatenate([gp, [pricing.goodput(p, batch) for p in extras]])
        got = memo[key] = (plans, gp, index)
        return got

    def goodput(self, plan: Plan, batch: int, held: Plan) -> float:
        """`Pricing.goodput(plan, batch)`, read from the ranking's table when the plan is in it."""
        plans, gp, index = self.scores(batch, held)
        i = index.get(plan)
        return float(gp[i]) if i is not None else self.pricing.goodput(plan, batch)

    def explain(self, batch_size: int, held: Plan) -> list[tuple[Plan, float]]:
        """Every candidate (and the `held` and default plans) with its predicted goodput, best first (ties: fewer
        levels, then a smaller total K, then candidate order)."""
        plans, gp, _ = self.scores(max(1, batch_size), held)
        if np.isnan(gp).any():  # no total order: what Python's sort makes of it
            return sorted(zip(plans, gp.tolist()), key=lambda x: (-x[1], len(x[0].levels), sum(x[0].k)))
        extra = plans[len(self.candidates):]
        n_levels = np.concatenate([self._n_levels, [len(p.levels) for p in extra]]) if extra else self._n_levels
        k_sum = np.concatenate([self._k_sum, [sum(p.k) for p in extra]]) if extra else self._k_sum
        order = np.lexsort((k_sum, n_levels, -gp))  # stable: equal keys keep the candidates' order
        return list(zip(map(plans.__getitem__, order.tolist()), gp[order].tolist()))

    def describe(self, batch_size: int, held: Plan, top: int = 5) -> dict[str, Any]:
        """The planner's view for `/health`: the plan it holds and its best-ranked candidates at `batch_size`,
        each with predicted goodput (tokens/s), tokens per round E[L] and round time -- what to look at when
        a deployment speculates less (or more) than expected."""
        batch = max(1, int(batch_size))
        ranked = [self.priced(p, g, batch) for p, g in self.explain(batch, held)[:top]]
        return {"batch": batch, "current": self.plan_name(held), "ranked": ranked}

    def priced(self, plan: Plan, goodput: float, batch: int) -> dict[str, Any]:
        """One candidate as `/health` and the planner's trace show it: name, goodput (tokens/s), tokens per round
        E[L] and predicted round seconds at `batch`."""
        return {"plan": self.plan_name(plan), "goodput": round(goodput, 3),
                "tokens_per_round": round(self.pricing.expected_length(plan, batch), 3),
                "round_s": round(self.pricing.round_time(plan, batch), 4)}

    # ----- names and the table ----------------------------------------------------------------------
    def regime_of(self, plan: Plan) -> str:
        return regime_of(plan, self.pricing.measured.is_ngram)

    def plan_name(self, plan: Plan) -> str:
        return plan_name(plan, self.names)

    def parse(self, spec: Any, batch: int, held: Plan) -> Plan | None:
        """A table entry's plan at `batch` (None: no override); a regime names the best-ranked plan of it, the
        `held` plan ranked among the candidates."""
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
            ranked = [p for p, _ in self.explain(batch, held)
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
