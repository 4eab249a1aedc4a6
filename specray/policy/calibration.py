"""Realized against predicted: the planner's price of a plan corrected by what that kind of plan delivered.

The goodput model (`specray.policy.pricing`) composes a plan's price from per-level measurements: step-cost fits,
per-pair acceptances, match rates. A composite plan can be mispriced by its composition even where every part is
measured well: an n-gram inside a cascade copies whole spans that the middle model verifies in one forward (the
model prices the middle level's inner rounds from average acceptances), and an n-gram chain priced from the state
of the row it just copied (a copy goes on) can look several times faster than its rounds turn out. The planner then
holds the plan it overprices and never runs the one it underprices.

`Calibration` closes that loop per plan family (its levels, hybrid or not, its tree width; K aside, so the K
variants of a family share what their rounds showed): for every round the scheduler reports (one group, every row
past its first round, `Calibration.observe`), it adds the tokens per row the planner predicted and those the round
committed, and the seconds it predicted (the round plus the catch-up it priced) and those the round took, each sum
decayed by `decay` per round of the family. A family's factor is

    (measured tokens / predicted tokens) / (measured seconds / predicted seconds)

with `prior_rounds` pseudo-rounds that went as predicted (a family seen once moves a little), bounded to
[1 / `bound`, `bound`]; an unseen family's is 1. Every reported round also fades what the other families showed
(`forget` per round), so a family judged on a few bad rounds (a slow spell of the box) is trusted again as the
prior once it has sat out long enough, and is ranked, run and measured anew. The planner multiplies a plan's
goodput by its family's factor before it weighs the catch-up and the hysteresis (`Planner._calibrated`).

Example: n-gram rounds predicted at 4.0 tokens in 0.125 s that commit 2.5 tokens in 0.125 s give the n-gram family a
factor that tends to 2.5 / 4.0 = 0.625 (with decay 0.9 the sums settle at 10 rounds' worth: (25 + 3 * 4) / (40 + 12)
= 0.71 with the prior), so a cascade predicted at 80% of the n-gram's goodput ranks above it, runs, and is priced by
its own rounds in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.coordinator.state import Plan
from specray.policy.pricing import _effective

__all__ = ["Calibration", "Expected", "family"]


def family(plan: Plan) -> tuple:
    """The plans whose rounds calibrate each other: the same levels that run (below a K of 0 none does), hybrid or
    not, tree width (K aside)."""
    eff = _effective(plan)
    return tuple(plan.levels[j] for j in eff), plan.hybrid and len(eff) == len(plan.levels), plan.tree


@dataclass(frozen=True)
class Expected:
    """What the planner predicted for the round it just chose a plan for (`Calibration.expect`)."""

    plan: Plan
    batch: int
    tokens: float  # per row
    seconds: float  # the round's own, without the catch-up
    catch_up: float  # seconds the plan's drafters spend first on text they lack (priced apart)


class Calibration:
    """Per plan family, decayed sums of predicted and measured tokens per row and round seconds (module docstring)."""

    def __init__(self, decay: float = 0.9, prior_rounds: float = 3.0, bound: float = 3.0,
                 forget: float = 0.98) -> None:
        if not (0.0 < decay <= 1.0 and 0.0 < forget <= 1.0):
            raise ValueError("calibration decay and forget must be in (0, 1]")
        if prior_rounds < 0 or bound < 1.0:
            raise ValueError("calibration needs prior_rounds >= 0 and bound >= 1")
        self.decay, self.prior_rounds, self.bound, self.forget = decay, prior_rounds, bound, forget
        #: family -> [weight, predicted tokens, measured tokens, predicted seconds, measured seconds]
        self._sums: dict[tuple, list[float]] = {}
        self._factors: dict[tuple, float] = {}
        self._pending: Expected | None = None

    def expect(self, expected: Expected | None) -> None:
        """The prediction for the next round (None: that round calibrates nothing, e.g. the warm-up's)."""
        self._pending = expected

    def observe(self, batch: int, seconds: float, tokens: int | None) -> None:
        """The round the latest `expect` was for took `seconds` and committed `tokens` over its `batch` rows (None:
        a round that says nothing about its plan: several groups, or rows in their first round)."""
        exp, self._pending = self._pending, None
        if exp is None or tokens is None or batch != exp.batch or seconds <= 0 or exp.seconds <= 0:
            return
        # the catch-up is priced apart (`Pricing.catch_up_time`): what is left is the round's own time, never
        # taken below a quarter of the wall time so a mispriced catch-up cannot make a round look free
        own = max(seconds - exp.catch_up, 0.25 * seconds)
        key = family(exp.plan)
        s = self._sums.setdefault(key, [0.0] * 5)
        for j, v in enumerate((1.0, exp.tokens, tokens / batch, exp.seconds, own)):
            s[j] = s[j] * self.decay + v
        for other, sums in list(self._sums.items()):
            if other != key:
                sums[:] = [v * self.forget for v in sums]
                if sums[0] < 0.05:  # faded into the prior: unseen again
                    del self._sums[other]
                    self._factors.pop(other, None)
                    continue
            self._factors[other] = self._factor(sums)

    def _factor(self, sums: list[float]) -> float:
        w, pt, mt, ps, ms = sums
        n0 = self.prior_rounds
        length = (mt + n0 * pt / w) / (pt + n0 * pt / w) if pt > 0 else 1.0
        time = (ms + n0 * ps / w) / (ps + n0 * ps / w) if ps > 0 else 1.0
        factor = length / time if time > 0 else 1.0
        return min(self.bound, max(1.0 / self.bound, factor))

    def factor(self, plan: Plan) -> float:
        """The multiplier of `plan`'s predicted goodput (1 for a family no reported round has run)."""
        return self._factors.get(family(plan), 1.0)

    @property
    def active(self) -> bool:
        """Whether any family's factor is set (else goodputs stand as priced)."""
        return bool(self._factors)

    def rounds(self, plan: Plan) -> float:
        """The decayed number of reported rounds of `plan`'s family."""
        s = self._sums.get(family(plan))
        return s[0] if s is not None else 0.0
