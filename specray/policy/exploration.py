"""Exploration: which plan a probe round runs, and whether the serving time has paid for it yet.

A planner that only ever runs the plan it ranks best stops measuring the levels it switched off: their acceptance
stays at what it was when they lost, however the text has changed since. So every `every` rounds the (verifier,
drafter) pair, or plain decoding, measured least recently gets one round in the best-ranked plan that measures it
(`probe`). Plain decoding's staleness counts per batch bucket, and the first time speculation reaches a new
bucket plain decoding is measured there once on the whole batch (`plain_probe`): the choice "stop speculating"
rests on its cost, which on a CPU changes with the batch far more than a fitted curve says.

A probe costs what its round takes beyond the held plan's. `budget` caps that at a share of the seconds served at
the batch's bucket since the latest probe (`affordable`), with the cost of a pair's latest probe as measured by
the round's wall time (`on_round`: it includes what no step measurement sees, a level catching up on the probed
rows' text). Pure: the planner owns the choice, this part only the probes' bookkeeping.
"""

from __future__ import annotations

import math

from specray.coordinator.state import Backlog, Plan
from specray.policy.measurements import Measurements, batch_bucket
from specray.policy.pricing import Pricing

__all__ = ["Exploration"]

Pair = tuple[int, int]


class Exploration:
    """Probe bookkeeping over the planner's `measurements` and `pricing` (its module docstring).

    `every`: rounds between probes (0: never). `budget`: the largest share of the serving time probes may cost
    (None: `every` alone). `probe_batch`: rows a speculative probe runs on (the rest keep the held plan)."""

    def __init__(self, measurements: Measurements, pricing: Pricing, every: int, budget: float | None,
                 probe_batch: int) -> None:
        if budget is not None and not 0 < budget <= 1:
            raise ValueError("explore_budget must be in (0, 1]")
        self.measurements, self.pricing = measurements, pricing
        self.every, self.budget, self.probe_batch = every, budget, max(1, probe_batch)
        self.served: dict[int, float] = {}  # batch bucket -> seconds of rounds there since the latest probe
        #: (verifier, drafter) pair -> seconds its latest probe round took beyond the held plan's predicted round
        self.cost: dict[Pair, float] = {}
        #: while a level's probe round runs: the held plan's predicted round time and the pairs probed
        self.pending: tuple[float, list[Pair]] | None = None
        self.checked_at = 0  # the planner's round count at the latest check that was due
        self.plain_probed: set[int] = set()  # buckets given their first plain probe

    def on_round(self, batch: int, seconds: float) -> None:
        """A planned round took `seconds` (wall): served time, or the cost of the probe under way."""
        if self.pending is None:
            bucket = batch_bucket(batch)
            self.served[bucket] = self.served.get(bucket, 0.0) + seconds
            return
        held, pairs = self.pending
        for pair in pairs:
            self.cost[pair] = max(0.0, seconds - held)
        self.pending = None
        self.served.clear()

    def plain_probe(self, bucket: int, rounds_there: int, speculating: bool) -> bool:
        """Whether this round measures plain decoding at a bucket reached while speculating: once, in its second
        round (the first carries the prefills of the requests that grew the batch)."""
        if not (self.every and speculating and rounds_there >= 2) or bucket in self.measurements.plain_at \
                or bucket in self.plain_probed:
            return False
        self.plain_probed.add(bucket)
        return True

    def probe(self, rounds: int, ranked: list[tuple[Plan, float]], batch: int, current: Plan,
              backlog: Backlog | None) -> Plan | None:
        """The probe this round runs, if one is due (`rounds`: the planner's rounds so far), stale and affordable;
        starting it records what its cost is measured against."""
        if not self.every or rounds - self.checked_at < self.every:
            return None
        probe = self._stalest(ranked, batch, current)
        if probe is not None and not self.affordable(probe, batch, current, backlog):
            return None  # not yet: checked again next round
        self.checked_at = rounds
        if probe is not None:
            if self.pricing.pairs(probe):  # a level's probe: what it costs beyond the held round is measured
                self.pending = (self.pricing.round_time(current, batch), self.pricing.pairs(probe))
            else:
                self.served.clear()
        return probe

    def _stalest(self, ranked: list[tuple[Plan, float]], batch: int, current: Plan) -> Plan | None:
        """The best plan measuring the stalest pair not in the current plan, if it is stale enough."""
        pricing, m = self.pricing, self.measurements
        held = set(pricing.items(current)) | ({"plain"} if not pricing.pairs(current) else set())
        items: list[tuple[int, ...] | str] = ["plain", *(pair for pair in m.acceptance if pair[0] != pair[1]),
                                              *m.tree_acceptance]
        stale = []
        for item in items:
            if item in held:
                continue
            last = m.plain_at.get(batch_bucket(batch)) if item == "plain" else m.measured_at.get(item)
            age = math.inf if last is None else m.clock - last
            if age >= self.every // 2:  # measured anyway (e.g. by overridden requests): skip
                stale.append((age, item))
        stale.sort(key=lambda x: -x[0])
        for _, item in stale:
            for p, _gp in ranked:
                if (item == "plain" and not pricing.pairs(p)) or (item != "plain" and item in pricing.items(p)):
                    return p
        return None

    def affordable(self, probe: Plan, batch: int, current: Plan, backlog: Backlog | None) -> bool:
        """Whether a probe round of `probe` fits `budget`: its extra seconds over a round of the held plan -- a
        speculative probe runs as a group of its own on `probe_batch` rows beside the held plan's group (its model
        drafters first catch up on those rows); plain decoding on the whole batch instead -- at most the budget's
        share of the seconds served at this batch bucket since the latest probe. So exploration stays a small share
        of the time at every load and, since a probe on a few rows measures the same acceptance at any batch, a
        burst at a batch size rarely served (a load peak, a benchmark's short wave) is not taxed by one."""
        if self.budget is None:
            return True
        pricing = self.pricing
        if pricing.pairs(probe):
            rows = min(batch, self.probe_batch)
            extra = max(pricing.round_time(probe, rows) + self.probe_catch_up(probe, rows / batch, backlog),
                        *(self.cost.get(pair, 0.0) for pair in pricing.pairs(probe)))
        else:
            extra = max(0.0, pricing.round_time(probe, batch) - pricing.round_time(current, batch))
        return extra <= self.budget * self.served.get(batch_bucket(batch), 0.0)

    def probe_catch_up(self, probe: Plan, share: float, backlog: Backlog | None) -> float:
        """Seconds the probe's model drafters take to catch up on `share` of this round's rows (their share of the
        backlog): what a probe round costs beyond its own work before any probe of its levels was measured."""
        if backlog is None or not backlog.uncovered:
            return 0.0
        return self.pricing.catch_up_time(self.pricing.drafters(probe),
                                          {i: n * share for i, n in backlog.uncovered.items()})
