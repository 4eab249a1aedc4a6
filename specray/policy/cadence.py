"""When the planner ranks its candidate plans again, and what a held plan does between rankings.

A ranking prices every (levels, K) candidate: CPU time paid by the round it runs on, which at GPU step times is a
sizeable part of the round. So once warm, the planner keeps its held plan unranked on most rounds (`Cadence.hold`):
it ranks one round in `rerank_every` and, with a `rerank_budget`, no more often than that share of the wall time
allows. Two changes of the rows' state wake it early, since a copy of earlier text starts and ends within fewer
rounds than the budget lets pass:

- under a plan without the lookup level, a copy that the shadow lookups just saw start (`copy_share` moved);
- under a held lookup plan, its K follows the share of rows whose whole draft was just accepted without a full
  ranking (`held`: only that plan's K values are priced, the same drafters, a switch that costs nothing).

And one change of the held plan's own price: its goodput, priced again each held round (one plan, not every
candidate), fallen by `surprise` (relative) below the best it was priced at since the latest ranking chose it (or,
for a lookup's plan, since its rows' state last moved: `held` retunes its K to that, and the state's own price is
what a fall is measured from). Its rounds are then yielding
far less than it was chosen for (a copy that ended: a lookup plan drafting nothing for rounds on end), and a
ranking spaced out by the budget would hold it for many such rounds before another plan could be weighed.

The planner (`specray.policy.planner`) decides the warm-up and the batch buckets; this part only the cadence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from specray.coordinator.state import Plan
from specray.policy.measurements import Measurements
from specray.policy.pricing import Pricing

__all__ = ["Cadence"]


class Cadence:
    """The ranking's rhythm: `hold` (keep the held plan this round?), `held` (the held plan for the round, its lookup
    K retuned), `ranking` (a context around a ranking that times it and notes the rows' state it saw)."""

    def __init__(self, measurements: Measurements, pricing: Pricing, k_choices: Sequence[int], rerank_every: int = 1,
                 rerank_budget: float | None = None, surprise: float = 0.25) -> None:
        if rerank_every < 1:
            raise ValueError("rerank_every must be >= 1")
        if rerank_budget is not None and not 0 < rerank_budget <= 1:
            raise ValueError("rerank_budget must be in (0, 1]")
        if not 0 < surprise <= 1:
            raise ValueError("surprise must be in (0, 1]")
        self.measurements, self.pricing, self.k_choices = measurements, pricing, tuple(k_choices)
        self.top = len(measurements.is_ngram) - 1
        #: rank the candidates on one round in this many at the same batch bucket, keeping the held plan on the others
        self.rerank_every = int(rerank_every)
        #: the largest share of the wall time the ranking may take: after a ranking that took t CPU seconds, the next
        #: waits until t / rerank_budget seconds have passed (None: rank by `rerank_every` alone). Short rounds
        #: (GPU steps) then rank every many rounds, long ones (CPU steps) every round or two.
        self.rerank_budget = rerank_budget
        #: rank at once when the held plan's goodput, priced again on a held round, has fallen by this share below
        #: the best it was priced at since the latest ranking chose it (`priced`) or its rows' state last moved
        #: (1: never)
        self.surprise = float(surprise)
        self._chosen_gp: float | None = None  # the held plan's best goodput since the latest ranking
        self.unranked = 0  # rounds since the latest ranking that kept the held plan
        self.cost = 0.0  # CPU seconds the latest ranking took
        self.ended = 0.0  # perf_counter() when it ended
        self._hot_seen: float | None = None  # the held lookup plan's rows' state its K was priced for (`held`)
        self._copy_seen: float | None = None  # the lookup's rows' state (shadows) at the latest ranking (`hold`)

    def hot_share(self, plan: Plan) -> float | None:
        """`Measurements.hot_share` of `plan`'s pair where it is a lookup's chain for the target; else None."""
        if len(plan.levels) != 2 or plan.hybrid or not self.measurements.is_ngram[plan.levels[0]] or \
                self.pricing.width(plan, 0) > 1:
            return None
        return self.measurements.hot_share((plan.levels[1], plan.levels[0]))

    def copy_share(self, plan: Plan) -> float | None:
        """Under a plan without the lookup level: the share of rows whose whole shadow draft was just matched (a copy
        under way); None where there is no lookup level or `plan` runs it."""
        if not self.measurements.is_ngram[0] or 0 in plan.levels:
            return None
        return self.measurements.hot_share((self.top, 0))

    def hold(self, current: Plan, batch: int) -> bool:
        """Whether a warm planner at an unchanged batch bucket keeps `current` unranked this round at `batch` rows:
        until `rerank_every` rounds have passed and, with a `rerank_budget`, until the time since the latest ranking
        is at least its cost over the budget; never once a copy started under a plan without the lookup, nor once
        `current`'s own price fell by `surprise` below what it was chosen at."""
        if self.copy_share(current) not in (None, 0.0, self._copy_seen):
            return False
        if self.unranked + 1 < self.rerank_every:
            keep = True
        else:
            keep = bool(self.rerank_budget) and (time.perf_counter() - self.ended) * self.rerank_budget < self.cost
        if keep and self.surprise < 1:
            if self.hot_share(current) != self._hot_seen:
                # the rows' state moved (a copy started or ended): `held` retunes the lookup's K for it, and the price
                # of the new state is the one a fall is measured from
                self._chosen_gp = None
            else:
                gp = self.pricing.goodput(current, batch)
                self._chosen_gp = max(self._chosen_gp or 0.0, gp)
                keep = gp >= (1.0 - self.surprise) * self._chosen_gp
        return keep

    def priced(self, goodput: float) -> None:
        """The held plan's goodput as the ranking just chose it (what `hold` measures a fall against)."""
        self._chosen_gp = goodput if goodput > 0 else None

    def held(self, current: Plan, batch: int) -> Plan:
        """The plan of a round `hold` kept: `current`, or, where it is a lookup's chain and its rows' state changed
        since its K was priced, the same levels at the K that state prices best."""
        self.unranked += 1
        share = self.hot_share(current)
        if share is None or share == self._hot_seen:
            return current
        self._hot_seen = share
        return max((Plan(current.levels, (k,)) for k in self.k_choices),
                   key=lambda plan: self.pricing.goodput(plan, batch))

    @contextmanager
    def ranking(self, current: Plan) -> Iterator[None]:
        """Around a ranking under `current`: notes the rows' state it sees and times its CPU seconds. The thread's CPU
        time, not the wall: its thread waiting for the GIL or for a core (a busy event loop, a noisy neighbour) is not
        the ranking's cost, and one such wait of a switch interval held the plan for a second."""
        self.unranked = 0
        self._hot_seen = self.hot_share(current)
        self._copy_seen = self.copy_share(current)
        cpu0 = time.thread_time()
        try:
            yield
        finally:
            self.ended = time.perf_counter()
            self.cost = time.thread_time() - cpu0
