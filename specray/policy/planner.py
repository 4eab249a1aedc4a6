"""Choose the speculation plan (which levels run, and K for each) per round from live measurements.

`Planner` holds four parts: what it has measured (`measurements`, a `specray.policy.measurements.Measurements`: the
engine's observer hooks and the step-cost fits and acceptances they update), the price of a plan (`pricing`, a
`specray.policy.pricing.Pricing` over them: E[L] * B / T_round of plain decoding, one drafter, cascades, a native
vLLM target, overlapped rounds), the candidate plans ranked by it (`ranking`, a `specray.policy.ranking.Ranking`),
how often it ranks them (`cadence`, a `specray.policy.cadence.Cadence`: the held plan between rankings) and the
probes of levels outside the held plan (`exploration`, a `specray.policy.exploration.Exploration`: stale pairs,
plain decoding at new batch sizes, within a time budget). This module makes the choice among them: a static table,
warm-up, hysteresis, patience. The planner's own API forwards to its parts (what callers and tests read: `on_call`,
`goodput`, `explain`, `costs`, ...).

T_level(B, q) comes from `StepCost` (live fit per level), alpha from `Acceptance` (live, per pair). Plain
decoding is always a candidate, so speculation is only chosen where it is predicted to win; regimes
(cascade at small B, one drafter at medium, none at large) fall out of the measurements.

Hybrid plans (`Plan.hybrid`: per row the lookup level's match, else a model drafter's draft; candidates when
level 0 is a lookup level under a model drafter) are priced with the match rate learned from every round in
which the lookup drafted (`on_verify`); their regime is 'cascade' (two drafters).

Token trees: a first level that drafts trees (a suffix level with `tree_width`, a model level with `Level.tree`)
for a level that verifies them makes each of its plans a candidate twice, as chains (`Plan.tree` = 1) and as trees
of its configured width, priced from the trees' own acceptance and size (`on_tree`) and, for a model level, the
timed tree proposals (`on_propose_tree`).

Catch-up: asked with a `Backlog` (the scheduler's rounds: `plan_groups`), a plan whose model drafters lack the rows'
text (they sat out rounds, or the rows are new) is scored at the goodput it reaches over the rows' remaining tokens
after catching up (`Pricing.catch_up_time`), so a drafter predicted to win a little is not started on a batch of
long prompts that it would spend longer prefilling than it saves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from specray.coordinator.state import Backlog, Plan
from specray.policy.cadence import Cadence
from specray.policy.calibration import Calibration, Expected
from specray.policy.exploration import Exploration
from specray.policy.measurements import Measurements, batch_bucket
from specray.policy.pricing import Pricing
from specray.policy.ranking import REGIMES, Ranking, regime_of
from specray.policy.trace import PendingTrace
from specray.spec.params import VerifyMethod

if TYPE_CHECKING:
    from specray.coordinator.cascade import CascadeEngine
    from specray.coordinator.feed import TreeWalk
    from specray.coordinator.state import Level
    from specray.policy.cost import Acceptance, StepCost

__all__ = ["Planner", "regime_of"]


class Planner:
    """Picks a `Plan` per round for the best expected goodput; `planner(batch_size) -> Plan`.

    Only the levels' names, `is_ngram` and `k` (the default plan) are used. `attach(engine)` subscribes
    to the engine's measurements (`on_call`, `on_verify`, ...: its `measurements` take them); tests may call those
    hooks directly.

    Stability: the current plan is kept unless another beats it by more than `hysteresis` (relative) for
    `patience` consecutive rounds (rankings the cadence spaces out count the held rounds between them), so noise
    cannot make it flap (one call suffices to fall back to plain
    decoding when it is predicted better by more than `decisive`, relative: a 2x gap between two measured
    costs is not noise, and a losing plan can cost many times a round -- speculation scored on a vLLM target
    at batch 16 costs ~8 plain rounds; and one suffices for a switch that starts or stops no model drafter,
    `_free_switch`). Exploration: every `explore_every` calls (once it fits `explore_budget`),
    the (verifier, drafter) pair (or plain decoding) measured least recently, if not within the last
    `explore_every // 2` rounds, gets one round in the best plan containing it, so a switched-off level comes
    back once its acceptance recovers; plain decoding is also measured once at every new batch bucket (powers
    of two) reached while speculating, on the whole batch, in the second round there (the first carries the
    prefills of the requests that grew the batch). `table` = [(min_batch, max_batch, spec), ...]
    overrides where it matches (first match); spec is a Plan, an int K (default plan's levels, each with K;
    0 = plain), or a string: 'none'/'plain', 'default', 'auto' (no override), 'ngram'/'draft'/'cascade' (best
    plan of that regime), 'hybrid' (best hybrid plan) or a plan name like 'ngram:3>draft:4>target' (hybrid:
    'ngram:3|draft:4>target').
    """
    def __init__(
        self,
        levels: Sequence[Level],
        k_max: int = 8,
        k_choices: Sequence[int] | None = None,
        table: Sequence[tuple[int, int, Any]] | None = None,
        hysteresis: float = 0.05,
        patience: int = 3,
        explore_every: int = 50,
        decay: float = 0.9,
        *,
        overhead: float = 0.0,
        ngram_cost: float = 0.0,
        prior_alpha_model: float = 0.5,
        prior_alpha_ngram: float = 0.3,
        prior_alpha_match: float = 0.5,
        prior_match: float = 0.0,
        prior_cost_ratio: float = 0.1,
        prior_target: tuple[float, float, float] = (1.0, 0.02, 0.0),
        warmup: int = 2,
        warmup_timed: int = 3,
        warmup_drafted: int = 12,
        probe_batch: int = 2,
        decisive: float = 1.0,
        rerank_every: int = 1,
        rerank_budget: float | None = None,
        rerank_surprise: float = 0.25,
        explore_budget: float | None = None,
        margin: float = 0.0,
        calibrate: bool = False,
        trace: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not levels:
            raise ValueError("a planner needs at least the target level")
        self.names = [lvl.name for lvl in levels]
        self.is_ngram = [lvl.is_ngram for lvl in levels]
        if self.is_ngram[-1] or any(self.is_ngram[1:]):
            raise ValueError("only level 0 may be an n-gram, and the target must be a model")
        self.top = len(levels) - 1
        rejection_top = levels[-1].method == VerifyMethod.REJECTION
        self.k_choices = tuple(sorted(set(k_choices))) if k_choices else tuple(range(1, k_max + 1))
        if any(k < 1 for k in self.k_choices):
            raise ValueError("k_choices must be >= 1 (plain decoding is always a candidate)")
        self.hysteresis, self.patience = hysteresis, patience
        self.warmup = warmup
        #: warm-up goes on with its plan (for at most 4 x `warmup` answers) until each model drafter of that plan was
        #: timed on this many calls: priced from one call (its first, often with one-off work in it), a drafter that
        #: looks slow is switched off, and then only a probe that pays its catch-up on a new prompt can time it again
        self.warmup_timed = warmup_timed
        #: ... and, while they draft, until each pair of a model drafter in that plan has verified this many draft
        #: tokens (for at most 8 x `warmup` answers): a first request is often a short greeting (a server's warm-up
        #: request: a handful of one-token drafts), and a drafter priced from those is switched off before the text
        #: it is for, with only a probe that pays its catch-up on a prompt to measure it again
        self.warmup_drafted = warmup_drafted
        self.decisive = decisive
        if margin < 0:
            raise ValueError("margin must be >= 0")
        #: a speculative plan must be predicted to beat plain decoding by this much (relative) to be chosen: its
        #: extra round cost is certain, its gain rests on acceptance measured on earlier rows and rounds, and near
        #: break-even (a filling batch) the gain is smaller than that estimate's error
        self.margin = float(margin)
        self._probe_round = False
        #: why the latest plan() answer was chosen (metrics): 'table' (an override there), 'warmup', 'hold'
        #: (between rankings), 'ranked', 'plain_probe' (first plain round at a new batch bucket), 'explore'
        self.last_reason = "warmup"
        self.answers = 0  # plan() calls so far (a caller tells a round the planner chose for from one it did not)
        self.default_plan = Plan(tuple(range(len(levels))), tuple(max(0, lvl.k) for lvl in levels[:-1]))
        self.plain = Plan((self.top,), ())
        self.measurements = Measurements(levels, self.k_choices, decay, prior_alpha_model, prior_alpha_ngram,
                                         prior_alpha_match, prior_match, prior_cost_ratio, prior_target)
        self.pricing = Pricing(self.measurements, overhead=overhead, ngram_cost=ngram_cost,
                               rejection_top=rejection_top)
        if self.pricing.width(self.default_plan, 0) > 1:  # the configured plan drafts trees: name its width
            self.default_plan = Plan(self.default_plan.levels, self.default_plan.k,
                                     tree=self.measurements.tree_widths[self.default_plan.levels[0]])
        self.ranking = Ranking(self.pricing, self.names, self.plain, self.default_plan)
        #: when to rank again (`rerank_every`, `rerank_budget`) and the held plan between rankings
        self.cadence = Cadence(self.measurements, self.pricing, self.k_choices, rerank_every, rerank_budget,
                               rerank_surprise)
        #: probes of stale pairs and of plain decoding, within `explore_budget` (a share of the serving time; needs
        #: `on_round`, which the scheduler calls)
        self.exploration = Exploration(self.measurements, self.pricing, explore_every, explore_budget, probe_batch)
        self.table = [(int(lo), int(hi), spec) for lo, hi, spec in (table or [])]
        #: each plan family's goodput corrected by what its reported rounds delivered (`on_round` with their
        #: tokens); None: the prices stand
        self.calibration = Calibration() if calibrate else None

        self._lock = self.measurements.lock  # the measurements' hooks and the choice see one state
        self._current = self.default_plan
        self._streak = 0
        self._configured_start = False  # the warm-up runs the configured plan (`_start`)
        self._calls = 0  # plan() answers past the table (rounds), whether ranked or held
        self._last_bucket, self._bucket_run = 0, 0  # bucket of the latest plan() call, consecutive calls there
        self._last: tuple[int, Plan] | None = None  # (batch, plan) of the latest plan() answer
        self._backlog: Backlog | None = None  # the backlog of the plan() call under way
        self._catch_up: dict[frozenset[int], float] = {}  # its catch-up seconds per set of model drafters
        #: gets one record per answer (`_record`), completed with the round's seconds where the caller reports them
        #: (`on_round`): what to read when a deployment speculates more or less than expected
        self.trace = trace
        self._pending = PendingTrace(trace) if trace is not None else None  # the latest record, awaiting its seconds
        for lo, _hi, spec in self.table:  # fail at start-up, not mid-serving, on a bad table
            plan = None if spec in (*REGIMES, "hybrid") else self._parse(spec, lo)
            if plan is not None and (plan.levels[-1] != self.top or max(plan.levels) > self.top):
                raise ValueError(f"table entry {spec!r}: a plan must end with the target level")

    # ----- wiring ---------------------------------------------------------------------------------
    def attach(self, engine: CascadeEngine) -> Planner:
        """Subscribe to `engine`'s live measurements (its level list must be the one given here)."""
        if [lvl.name for lvl in engine.levels] != self.names:
            raise ValueError("the engine's levels differ from the planner's")
        if self not in engine.observers:
            engine.observers.append(self)
        self.pricing.overlap = engine.overlap
        self.pricing.bounded = engine.ahead_bounded
        self.pricing.ahead_chunk = max(1, engine.ahead_chunk)
        self.measurements.memo.clear()
        return self

    def on_round(self, batch: int, seconds: float, tokens: int | None = None) -> None:
        """A round the planner chose a plan for took `seconds` (wall, every group): its trace record's seconds, and
        served time or a probe's cost for exploration (`Exploration.on_round`). `tokens`: what it committed over its
        `batch` rows, where it ran one group of the planner's rows, none in its first round; the `calibration` of
        the plan's family reads it (None: a round that says nothing about its plan)."""
        with self._lock:
            if self._pending is not None:
                if tokens is not None:
                    self._pending.note(tokens=tokens)
                self._pending.flush(seconds)
            self.exploration.on_round(batch, seconds)
            if self.calibration is not None:
                self.calibration.observe(batch, seconds, tokens)

    # ----- choosing --------------------------------------------------------------------------------
    def _pairs(self, plan: Plan) -> list[tuple[int, int]]:
        return self.pricing.pairs(plan)

    def _free_switch(self, best: Plan) -> bool:
        """Whether switching from the held plan to `best` needs no `patience`: both run the same model drafters
        (they differ in K, or in the lookup level, or both are plain decoding or a lookup). Such a switch brings
        no level's cache up to date and a wrong one costs one round, so it follows the ranking at once; holding
        a lookup's old K or plain decoding for `patience` rounds is what loses on text that moves between
        copying and not copying every few rounds (code at T > 0). A switch that starts or stops a model drafter
        waits: the drafter catches up on every row's text first, a cost paid again on every switch back.

        Unless the held plan's own drafters lack text this round (`Backlog`: new rows, or rows they sat out): then
        holding it pays a catch-up as well, and its head start, which patience protects, is not there."""
        held = self.pricing.drafters(self._current)
        if self.pricing.drafters(best) == held:
            return True
        backlog = self._backlog
        return backlog is not None and any(backlog.uncovered.get(i, 0) > 0 for i in held)

    def _score(self, plan: Plan, batch: int) -> float:
        """Goodput as the choice weighs it: a speculative plan's discounted by `margin`, or by the share of time its
        round takes beyond a plain round where that is less. The gain is an estimate from earlier rows, the extra
        time is certain: a draft verified at no extra cost (a step flat in the tokens it feeds) cannot lose to plain
        decoding, since a round yields a token per row either way, and needs no margin; one whose round takes
        `margin` more time or beyond must be predicted `margin` better."""
        gp = self._weighed(plan, self.ranking.goodput(plan, batch, self._current))
        if not (self.margin and self._pairs(plan)):
            return gp
        plain = self.round_time(self.plain, batch)
        extra = max(0.0, self.round_time(plan, batch) / plain - 1.0) if plain > 0 else self.margin
        return gp / (1.0 + min(self.margin, extra))

    def _weighed(self, plan: Plan, gp: float) -> float:
        """Goodput `gp` of `plan` as priced, as the choice weighs it: times its family's calibration factor
        (`specray.policy.calibration`), then over the rows' remaining tokens once its catch-up is paid
        (`_paid_back`)."""
        if self.calibration is not None:
            gp *= self.calibration.factor(plan)
        return self._paid_back(plan, gp)

    def _reweighed(self) -> bool:
        """Whether `_weighed` can reorder the ranking this round (it leaves both corrections out, memoised)."""
        return (self.calibration is not None and self.calibration.active) or (
            self._backlog is not None and bool(self._backlog.uncovered))

    def _catch_up_time(self, drafters: frozenset[int]) -> float:
        """Seconds `drafters` spend catching up on this round's backlog, priced once per plan() call."""
        c = self._catch_up.get(drafters)
        if c is None:
            backlog = self._backlog
            c = 0.0 if backlog is None or not backlog.uncovered else self.pricing.catch_up_time(
                drafters, backlog.uncovered)
            self._catch_up[drafters] = c
        return c

    def _paid_back(self, plan: Plan, gp: float) -> float:
        """Goodput `gp` of `plan` over the remaining tokens R of this round's `Backlog` once its model drafters have
        caught up on the text they lack (C seconds): R / (R / gp + C). Without a backlog, or nothing to catch up
        on, `gp` itself."""
        backlog = self._backlog
        if backlog is None or gp <= 0 or not backlog.uncovered:
            return gp
        c = self._catch_up_time(self.pricing.drafters(plan))  # the same for every plan of these drafters
        if c <= 0:
            return gp
        r = max(1, backlog.remaining)
        return r / (r / gp + c)

    def _hold(self, batch: int) -> bool:
        """Whether this round keeps the held plan without a ranking: never at a new batch bucket or in the warm-up;
        otherwise as the `cadence` says."""
        if self._calls <= 1 or self.measurements.clock < self.warmup or batch_bucket(batch) != self._last_bucket:
            return False
        return self.cadence.hold(self._current, batch)

    def plan(self, batch_size: int, backlog: Backlog | None = None) -> Plan:
        """The plan for the next round over `batch_size` sequences (table, warm-up, hysteresis, exploration).
        `backlog`: what each model level lacks of those rows' text, and their remaining tokens (catch-up is then
        priced: module docstring)."""
        batch = max(1, int(batch_size))
        with self._lock:
            self._backlog = backlog
            self._catch_up.clear()
            try:
                chosen = self._choose(batch)
                if self._pending is not None:
                    self._pending.hold(self._record(batch, chosen))
                if self.calibration is not None:
                    self.calibration.expect(self._expected(batch, chosen))
                return chosen
            finally:
                self._backlog = None

    def _best_first(self, ranked: list[tuple[Plan, float]]) -> list[tuple[Plan, float]]:
        """The ranking in the order the choice weighs it (`_weighed`)."""
        return sorted(ranked, key=lambda pg: self._weighed(*pg), reverse=True) if self._reweighed() else ranked

    def _expected(self, batch: int, chosen: Plan) -> Expected | None:
        """What the calibration compares the round of `chosen` with: its predicted tokens per row, round seconds and
        priced catch-up; None for the warm-up's rounds (priced from priors, and their drafters' first calls) and a
        table's (no choice to correct)."""
        if self.last_reason in ("warmup", "table"):
            return None
        return Expected(chosen, batch, self.pricing.expected_length(chosen, batch),
                        self.pricing.round_time(chosen, batch), self._catch_up_time(self.pricing.drafters(chosen)))

    def _record(self, batch: int, chosen: Plan) -> dict[str, Any]:
        """The trace record of this answer: the plan and why; unless it held the plan, also the best-ranked candidates
        and plain decoding (goodput with the catch-up paid, tokens per round, predicted round seconds) and the
        backlog."""
        if self.last_reason == "hold":  # between rankings: nothing was priced
            return {"time": round(time.time(), 3), "batch": batch, "plan": self.plan_name(chosen), "reason": "hold"}

        def priced(plan: Plan, gp: float) -> dict[str, Any]:
            out = self.ranking.priced(plan, self._weighed(plan, gp), batch)
            if self.calibration is not None:
                out["calibration"] = round(self.calibration.factor(plan), 3)
            return out

        ranked = self.explain(batch) if self.last_reason != "table" else []
        backlog = self._backlog
        return {
            "time": round(time.time(), 3), "batch": batch, "plan": self.plan_name(chosen), "reason": self.last_reason,
            "clock": self.measurements.clock,
            "predicted_s": round(self.pricing.round_time(chosen, batch), 4),
            "top": [priced(p, g) for p, g in self._best_first(ranked)[:3]],
            "plain": priced(self.plain, self.pricing.goodput(self.plain, batch)),
            "backlog": None if backlog is None else {"uncovered": {self.names[i]: n for i, n in
                                                                   backlog.uncovered.items()},
                                                     "remaining": backlog.remaining}}

    def _choose(self, batch: int) -> Plan:
        self.answers += 1
        self._probe_round = False
        forced = self._override(batch)
        if forced is not None:
            self._last, self.last_reason = (batch, forced), "table"
            return forced
        self._calls += 1
        if self._hold(batch):  # between rankings: the held plan, priced at the latest ranking (its lookup K retuned)
            self._current = self.cadence.held(self._current, batch)
            self._last, self.last_reason = (batch, self._current), "hold"
            return self._current
        same_bucket = self._last is not None and batch_bucket(self._last[0]) == batch_bucket(batch)
        warming = self.last_reason == "warmup" and same_bucket
        phase = self._warming() if warming else None
        if phase == "timing":  # the warm-up plan's drafters are not timed enough yet: keep it, unranked
            self._last = (batch, self._current)
            return self._current
        if phase == "sampling":  # timed, too few drafts verified: the best-ranked plan running the same drafters
            with self.cadence.ranking(self._current):
                drafters = self.pricing.drafters(self._current)
                self._current = next((p for p, _ in self.explain(batch) if self.pricing.drafters(p) == drafters),
                                     self._current)
            self._last = (batch, self._current)
            return self._current
        held_rounds = self.cadence.unranked  # rounds the held plan ran unranked since the latest ranking
        with self.cadence.ranking(self._current):
            ranked = self.explain(batch)
            best = ranked[0][0]
            if self._reweighed():  # the best plan as the choice weighs it: calibrated, its catch-up paid
                best = max(ranked, key=lambda pg: self._weighed(*pg))[0]
        best_gp = self._weighed(best, self.ranking.goodput(best, batch, self._current))
        if self.margin and self._pairs(best):
            plain_gp = self._score(self.plain, batch)
            best_gp = self._score(best, batch)
            if plain_gp >= best_gp:
                best, best_gp = self.plain, plain_gp
        if warming and self.measurements.clock >= self.warmup and (best == self.plain or not self._configured_start):
            # the warm-up's plan was never ranked: the first ranking replaces it without hysteresis or patience. The
            # configured plan, measured by its warm-up rounds, gives way at once only to plain decoding (its drafters'
            # own rounds say they lose); another speculative plan, often priced from a few shadow lookups, must lead
            # it `patience` rounds like any held plan
            self._current, self._streak = best, 0
        if self.measurements.clock < self.warmup or self._calls <= self.warmup:
            # nothing measured yet, or nothing of the planner's own plans (a server's first requests may all name
            # their plan while the target's clock runs)
            start = self._start(batch, best)
            self._current, self._streak = start, 0
            self._configured_start = start == self.default_plan
            self._last, self.last_reason = (batch, start), "warmup"
            return start
        bucket, grew = batch_bucket(batch), 0 < self._last_bucket < batch_bucket(batch)
        self._bucket_run = self._bucket_run + 1 if bucket == self._last_bucket else 1
        self._last_bucket = bucket
        if grew and best == self.plain != self._current and bucket in self.measurements.plain_at:
            # the batch grew into a larger bucket where plain decoding is measured and predicted to win: patience
            # guards against noise at one batch size, but holding a plan chosen for a smaller one `patience` rounds
            # makes a drafter catch up on the rows that grew the batch (whole prefills) for rounds that lose anyway
            self._current, self._streak = best, 0
        if self.exploration.plain_probe(bucket, self._bucket_run, bool(self._pairs(self._current))):
            self._last, self.last_reason = (batch, self._current), "plain_probe"
            self._probe_round = True
            return self.plain
        probe = self.exploration.probe(self._calls, ranked, batch, self._current, self._backlog)
        if probe is not None:
            self._last = (batch, self._current)  # regime() reports the held plan, not the probe
            self.last_reason, self._probe_round = "explore", True
            return probe
        if best != self._current:
            cur_gp = self._score(self._current, batch)
            if best_gp > cur_gp * (1.0 + self.hysteresis):
                # patience counts rounds: a plan that led at the previous ranking too has led through the rounds
                # held since (rankings `cadence` spaces out would otherwise stretch patience to many rounds)
                self._streak += 1 + (held_rounds if self._streak else 0)
                # plain decoding predicted to beat the held plan by more than `decisive` (2x by default) is not
                # noise -- both costs are measured at this batch (the held plan runs; plain is probed at every new
                # bucket): switch at once, not after `patience` rounds of a plan that loses big. A speculative
                # plan's cost here may be an extrapolation: patience.
                decisive = best == self.plain and best_gp > cur_gp * (1.0 + self.decisive)
                if self._streak >= self.patience or decisive or self._free_switch(best):
                    self._current, self._streak = best, 0
            else:
                self._streak = 0
        else:
            self._streak = 0
        self._last, self.last_reason = (batch, self._current), "ranked"
        self.cadence.priced(self.pricing.goodput(self._current, batch))
        return self._current

    __call__ = plan

    def _start(self, batch: int, best: Plan) -> Plan:
        """The warm-up's plan: the configured one, unless it loses to plain decoding on what is known of it. While
        one of its model drafters is untimed (`warmup_timed` calls), that is its verification alone
        (`Pricing.verify_goodput`): a drafter's prior cost says nothing of that drafter, and priced at it, a long
        configured K (a cascade drafting 16 tokens with confidence stops) lost to plain decoding and the warm-up ran
        a short draft the ranking then left, rounds of a few tokens on text the configured plan copies in one.
        Once they are timed, its price. Where it loses, the best-ranked plan `best`."""
        plan, m = self.default_plan, self.measurements
        if any(m.costs[i].n_obs < self.warmup_timed for i in self.pricing.drafters(plan)):
            price = self._weighed(plan, self.pricing.verify_goodput(plan, batch))
        else:
            price = self._score(plan, batch)
        return plan if price >= self._score(self.plain, batch) else best

    def _warming(self) -> str | None:
        """Whether warm-up goes on with its plan's model drafters: 'timing' (the plan as it is) until each was timed
        on `warmup_timed` calls, for at most 4 x `warmup` answers; then 'sampling' (K as ranked) while they draft and
        a pair of them has verified fewer than `warmup_drafted` draft tokens (`Measurements.sampled`), for at most
        8 x `warmup`; None: warm-up is over."""
        if self._calls > 8 * self.warmup:
            return None
        m, drafters = self.measurements, self.pricing.drafters(self._current)
        if self._calls <= 4 * self.warmup and any(m.costs[i].n_obs < self.warmup_timed for i in drafters):
            return "timing"
        for pair in self.pricing.pairs(self._current):
            drafted, drafting = m.sampled.get(pair, (0, False))
            if pair[1] in drafters and drafting and drafted < self.warmup_drafted:
                return "sampling"
        return None

    def plan_groups(self, batch_size: int, backlog: Backlog | None = None) -> list[tuple[Plan, int]]:
        """Like `plan`, as [(plan, number of sequences)]: an exploration probe runs on at most `probe_batch`
        sequences while the rest keep the held plan. Measuring a level then costs a small-batch round instead of
        bringing every sequence's cache up to date on that level (a whole batch of prefills at batch 32).

        A probe of plain decoding runs on the whole batch instead: it needs no catch-up (the target is always
        in step), costs at most one round at one token per sequence, and is the measurement the choice
        "stop speculating" rests on, so it must be taken at the batch size it is for -- a plain step at
        batch 2 says little about batch 16 on a CPU, where a 1-token row and a 9-token row cost very
        differently per token."""
        batch = max(1, int(batch_size))
        chosen = self.plan(batch, backlog)
        rows = self.exploration.probe_batch
        if not self._probe_round or batch <= rows or not self._pairs(chosen):
            return [(chosen, batch)]
        return [(chosen, rows), (self._current, batch - rows)]

    @property
    def current(self) -> Plan:
        """The plan the hysteresis currently holds (what plan() returns outside table/exploration rounds)."""
        return self._current

    def regime(self, batch_size: int) -> str:
        """The regime for `batch_size` (for metrics): the plan held when plan() was last asked about this
        batch size (exploration probes aside), else the table's or the best-ranked plan (no side effects)."""
        batch = max(1, int(batch_size))
        with self._lock:
            if self._last is not None and self._last[0] == batch:
                return self.ranking.regime_of(self._last[1])
            forced = self._override(batch)
            return self.ranking.regime_of(forced if forced is not None else self.explain(batch)[0][0])

    def _parse(self, spec: Any, batch: int) -> Plan | None:
        """A table entry's plan at `batch` (None: no override; `Ranking.parse`)."""
        with self._lock:  # a regime entry ranks the candidates
            return self.ranking.parse(spec, batch, self._current)

    def _override(self, batch: int) -> Plan | None:
        for lo, hi, spec in self.table:
            if lo <= batch <= hi:
                return self._parse(spec, batch)
        return None

    # ----- its parts' API, as the planner's: the engine's observer hooks (measurements), prices, the ranking --------
    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        self.measurements.on_call(level, kind, batch, tokens, seconds)

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int | None = None) -> None:
        self.measurements.on_verify(level, lower, draft_lens, accepted, asked)

    def on_drafted(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                   asked: Sequence[int]) -> None:
        self.measurements.on_drafted(level, lower, draft_lens, accepted, asked)

    def on_native(self, level: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None:
        self.measurements.on_native(level, draft_lens, accepted)

    def on_shadow(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int, latest: Sequence[bool] | None = None) -> None:
        self.measurements.on_shadow(level, lower, draft_lens, accepted, asked, latest)

    def on_tree(self, level: int, lower: int, width: int, walks: Sequence[TreeWalk]) -> None:
        self.measurements.on_tree(level, lower, width, walks)

    def on_propose_tree(self, level: int, batch: int, depth: int, width: int, nodes: int, seconds: float) -> None:
        self.measurements.on_propose_tree(level, batch, depth, width, nodes, seconds)

    def on_catch_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None:
        self.measurements.on_catch_up(level, kind, batch, tokens, caught, seconds)

    def on_host(self, drafting: tuple[int, ...], batch: int, seconds: float) -> None:
        if self._calls and self.last_reason == "warmup":  # its first rounds run cold code paths: not steady ones
            return
        self.measurements.on_host(drafting, batch, seconds)

    @property
    def costs(self) -> dict[int, StepCost]:
        return self.measurements.costs

    @property
    def acceptance(self) -> dict[tuple[int, int], Acceptance]:
        return self.measurements.acceptance

    @property
    def matched(self) -> dict[tuple[int, int], Acceptance]:
        return self.measurements.matched

    @property
    def tree_acceptance(self) -> dict[tuple[int, int, int], Acceptance]:
        return self.measurements.tree_acceptance

    @property
    def tree_nodes(self) -> dict[tuple[int, int, int], float]:
        return self.measurements.tree_nodes

    @property
    def native_cost(self) -> StepCost | None:
        return self.measurements.native_cost

    @property
    def native_q(self) -> float:
        return self.measurements.native_q

    @property
    def native_k(self) -> int:
        return self.measurements.native_k

    @property
    def engine_verify(self) -> int:
        return self.measurements.engine_verify

    @property
    def overlap(self) -> bool:
        return self.pricing.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.pricing.overlap = on

    @property
    def bounded(self) -> bool:
        return self.pricing.bounded

    @bounded.setter
    def bounded(self, on: bool) -> None:
        self.pricing.bounded = on

    @property
    def ahead_chunk(self) -> int:
        return self.pricing.ahead_chunk

    @property
    def candidates(self) -> list[Plan]:
        return self.ranking.candidates

    def step_time(self, level: int, batch: int, tokens: int) -> float:
        return self.pricing.step_time(level, batch, tokens)

    def alphas(self, level: int, lower: int, k: int) -> list[float]:
        return self.pricing.alphas(level, lower, k)

    def match_rate(self) -> float:
        return self.pricing.match_rate()

    def round_time(self, plan: Plan, batch: int) -> float:
        return self.pricing.round_time(plan, batch)

    def expected_length(self, plan: Plan, batch: int = 1) -> float:
        return self.pricing.expected_length(plan, batch)

    def goodput(self, plan: Plan, batch: int) -> float:
        return self.pricing.goodput(plan, batch)

    def explain(self, batch_size: int) -> list[tuple[Plan, float]]:
        with self._lock:
            return self.ranking.explain(batch_size, self._current)

    def describe(self, batch_size: int, top: int = 5) -> dict[str, Any]:
        with self._lock:
            return self.ranking.describe(batch_size, self._current, top)

    def regime_of(self, plan: Plan) -> str:
        return self.ranking.regime_of(plan)

    def plan_name(self, plan: Plan) -> str:
        return self.ranking.plan_name(plan)
