"""Choose the speculation plan (which levels run, and K for each) per round from live measurements.

Each candidate is priced by `specray.policy.pricing` (goodput E[L] * B / T_round of plain decoding, one
drafter, cascades, a native vLLM target, overlapped rounds); this module chooses among them: a static
table, hysteresis, exploration of stale pairs, plain probes at new batch sizes.

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
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from specray.coordinator.state import Plan, plan_name
from specray.policy.chains import ChainTable
from specray.policy.cost import Acceptance, StepCost
from specray.policy.pricing import Pricing, _effective
from specray.spec.params import VerifyMethod, tree_feeds

if TYPE_CHECKING:
    from specray.coordinator.cascade import CascadeEngine
    from specray.coordinator.feed import TreeWalk
    from specray.coordinator.state import Level
    from specray.spec.params import TreeShape

__all__ = ["Planner", "regime_of"]

REGIMES = ("cascade", "draft", "ngram", "none")


def regime_of(plan: Plan, is_ngram: Sequence[bool]) -> str:
    """'none' (plain decoding), 'ngram' or 'draft' (one drafter), or 'cascade' (two or more drafters)."""
    eff = _effective(plan)
    if len(eff) == 1:
        return "none"
    if len(eff) == 2:
        return "ngram" if is_ngram[plan.levels[eff[0]]] else "draft"
    return "cascade"


def _bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...): where plain decoding is re-measured."""
    return 1 << max(0, int(batch) - 1).bit_length()


class Planner(Pricing):
    """Picks a `Plan` per round for the best expected goodput; `planner(batch_size) -> Plan`.

    Only the levels' names, `is_ngram` and `k` (the default plan) are used. `attach(engine)` subscribes
    to the engine's measurements (`on_call`, `on_verify`); tests may call those hooks directly.

    Stability: the current plan is kept unless another beats it by more than `hysteresis` (relative) on
    `patience` consecutive calls, so noise cannot make it flap (one call suffices to fall back to plain
    decoding when it is predicted better by more than `decisive`, relative: a 2x gap between two measured
    costs is not noise, and a losing plan can cost many times a round -- speculation scored on a vLLM target
    at batch 16 costs ~8 plain rounds). Exploration: every `explore_every` calls (once it fits `explore_budget`),
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
        probe_batch: int = 2,
        decisive: float = 1.0,
        rerank_every: int = 1,
        rerank_budget: float | None = None,
        explore_budget: float | None = None,
        margin: float = 0.0,
    ) -> None:
        if not levels:
            raise ValueError("a planner needs at least the target level")
        self.names = [lvl.name for lvl in levels]
        self.is_ngram = [lvl.is_ngram for lvl in levels]
        if self.is_ngram[-1] or any(self.is_ngram[1:]):
            raise ValueError("only level 0 may be an n-gram, and the target must be a model")
        self.top = len(levels) - 1
        #: the engine drafts the next round while the target verifies (set by attach; round_time prices it), its
        #: look-ahead stops once the target has verified (`bounded`), a first model level stopping every
        #: `ahead_chunk` steps (CascadeEngine.ahead_bounded / ahead_chunk)
        self.overlap = False
        self.bounded = False
        self.ahead_chunk = 2
        self._rejection_top = levels[-1].method == VerifyMethod.REJECTION
        self.k_choices = tuple(sorted(set(k_choices))) if k_choices else tuple(range(1, k_max + 1))
        if any(k < 1 for k in self.k_choices):
            raise ValueError("k_choices must be >= 1 (plain decoding is always a candidate)")
        self.hysteresis, self.patience, self.explore_every = hysteresis, patience, explore_every
        self.overhead, self.ngram_cost, self.warmup = overhead, ngram_cost, warmup
        self.probe_batch = max(1, probe_batch)
        self.decisive = decisive
        if rerank_every < 1:
            raise ValueError("rerank_every must be >= 1")
        #: rank the candidate plans on one round in this many at the same batch bucket, keeping the held plan on
        #: the others: ranking prices every (levels, K) candidate, a cost paid by every round it runs on, which at
        #: GPU step times is a sizeable part of the round
        self.rerank_every = int(rerank_every)
        if rerank_budget is not None and not 0 < rerank_budget <= 1:
            raise ValueError("rerank_budget must be in (0, 1]")
        #: the largest share of the wall time the ranking may take: after a ranking that took t seconds, the next
        #: waits until t / rerank_budget seconds have passed (None: rank by `rerank_every` alone). Short rounds
        #: (GPU steps) then rank every many rounds, long ones (CPU steps) every round or two.
        self.rerank_budget = rerank_budget
        if explore_budget is not None and not 0 < explore_budget <= 1:
            raise ValueError("explore_budget must be in (0, 1]")
        #: the largest share of the serving time exploration may cost: a probe whose extra seconds over the held
        #: plan's round (predicted, or as the latest probe of its levels measured, whichever is more) exceed this
        #: share of the seconds served at the batch's bucket since the latest probe waits (None: `explore_every`
        #: alone). Needs `on_round` (the scheduler calls it).
        self.explore_budget = explore_budget
        if margin < 0:
            raise ValueError("margin must be >= 0")
        #: a speculative plan must be predicted to beat plain decoding by this much (relative) to be chosen: its
        #: extra round cost is certain, its gain rests on acceptance measured on earlier rows and rounds, and near
        #: break-even (a filling batch) the gain is smaller than that estimate's error
        self.margin = float(margin)
        self._served: dict[int, float] = {}  # batch bucket -> seconds of rounds there since the latest exploration
        #: (verifier, drafter) pair -> seconds its latest probe round took beyond the held plan's predicted round
        self._explore_cost: dict[tuple[int, int], float] = {}
        #: while a level's probe round runs: the held plan's predicted round time and the pairs probed
        self._explore_pending: tuple[float, list[tuple[int, int]]] | None = None
        self._unranked = 0  # rounds since the last ranking that kept the held plan
        self._rank_cost = 0.0  # seconds the latest ranking took
        self._rank_end = 0.0  # perf_counter() when it ended
        self._probe_round = False
        #: why the latest plan() answer was chosen (metrics): 'table' (an override there), 'warmup', 'hold'
        #: (between rankings), 'ranked', 'plain_probe' (first plain round at a new batch bucket), 'explore'
        self.last_reason = "warmup"
        self.answers = 0  # plan() calls so far (a caller tells a round the planner chose for from one it did not)
        self.default_plan = Plan(tuple(range(len(levels))), tuple(max(0, lvl.k) for lvl in levels[:-1]))
        self.plain = Plan((self.top,), ())
        #: K of the target's own (native vLLM) speculation on plain rounds; 0: plain decoding is one token
        self.native_k = int(levels[-1].native_k or 0)
        self.native_q = float(self.native_k + 1)  # decayed mean tokens fed per row in a native step
        self._native_decay = decay
        self.decay_match = decay

        fit_decay = decay**0.25  # the cost fit keeps a longer memory than the acceptance estimates
        self.costs: dict[int, StepCost] = {self.top: StepCost(prior_target, decay=fit_decay, table_decay=decay)}
        for i in range(self.top - 1, -1, -1):
            if not self.is_ngram[i]:
                ratio = prior_cost_ratio ** (self.top - i)
                self.costs[i] = StepCost(self._scaled_prior(ratio), decay=fit_decay, table_decay=decay)
        self.acceptance: dict[tuple[int, int], Acceptance] = {
            (up, lo): Acceptance(prior_alpha_ngram if self.is_ngram[lo] else prior_alpha_model, decay=decay,
                                 k_max=max(32, max(self.k_choices) + 1))
            for lo, up in itertools.combinations(range(self.top + 1), 2)
        }
        #: hybrid plans (a lookup level 0 under a model drafter): the acceptance of the lookup's drafts on rows
        #: where it matched, per (verifier, lookup) pair, and the decayed share of rows it matched on (the match
        #: rate; `prior_match` until measured: 0 keeps hybrid plans out until a lookup round has seen matches)
        self.matched: dict[tuple[int, int], Acceptance] = {
            (up, 0): Acceptance(prior_alpha_match, decay=decay, k_max=max(32, max(self.k_choices) + 1))
            for up in range(1, self.top + 1)} if self.is_ngram[0] else {}
        self.prior_match = prior_match
        self._match = [0.0, 0.0]  # decayed (rows matched, rows looked up)
        #: the target verifies drafts of up to this many tokens inside its engine, on its decode path
        self.engine_verify = int(levels[-1].engine_verify or 0)
        #: token trees: a suffix level 0 with `tree_width` w > 1 drafts trees for the levels above it that verify
        #: them (`WorkerCaps.tree_verify`); each such (verifier, 0, w) gets its own acceptance (at each depth: does
        #: some child of the walk's node win) and the decayed mean of the nodes a call fed (`on_tree`), and every
        #: plan of that pair is a candidate twice, as chains (`Plan.tree` = 1) and as trees (`Plan.tree` = w); the
        #: chains' tokens fed are measured the same way (key width 1), so both are priced at what they feed
        #: a model level with a tree shape (`Level.tree`, its worker with `tree_propose`) drafts trees as a plan's first
        #: level directly below a target that verifies them: (target, level, w) gets the same two measurements, its
        #: plans the same two candidates, and its proposal is priced per depth (pricing.py, "Token trees")
        first = levels[0]
        self.tree_width = first.tree_width if first.suffix is not None else 1
        k_acc = max(32, max(self.k_choices) + 1)
        self.tree_acceptance: dict[tuple[int, int, int], Acceptance] = {
            (up, 0, self.tree_width): Acceptance(prior_alpha_ngram, decay=decay, k_max=k_acc)
            for up in range(1, self.top + 1)
            if self.tree_width > 1 and levels[up].caps is not None and levels[up].caps.tree_verify}
        self._suffix_trees = bool(self.tree_acceptance)
        top_caps = levels[-1].caps
        self.tree_shapes: dict[int, TreeShape] = {
            i: lvl.tree for i, lvl in enumerate(levels[:-1])
            if lvl.tree is not None and lvl.tree.branches and lvl.caps is not None and lvl.caps.tree_propose
            and top_caps is not None and top_caps.tree_verify}
        for i, shape in self.tree_shapes.items():
            self.tree_acceptance[(self.top, i, shape.width)] = Acceptance(prior_alpha_model, decay=decay, k_max=k_acc)
        #: the configured tree width of each level that drafts trees
        self.tree_widths: dict[int, int] = {**({0: self.tree_width} if self._suffix_trees else {}),
                                            **{i: shape.width for i, shape in self.tree_shapes.items()}}
        self.tree_nodes: dict[tuple[int, int, int], float] = {}
        self.decay_nodes = decay
        if self._width(self.default_plan, 0) > 1:  # the configured plan drafts trees: name its width
            self.default_plan = Plan(self.default_plan.levels, self.default_plan.k,
                                     tree=self.tree_widths[self.default_plan.levels[0]])
        self.native_cost: StepCost | None = None
        if self.native_k:
            self.acceptance[(self.top, self.top)] = Acceptance(prior_alpha_ngram, decay=decay,
                                                               k_max=max(32, self.native_k + 1))
        if self.native_k or self.engine_verify or levels[-1].live_decode:
            self.native_cost = StepCost(self._scaled_prior(1.0), decay=fit_decay, table_decay=decay)
        self.candidates = self._enumerate()
        self._index = {p: i for i, p in enumerate(self.candidates)}
        self._chains = ChainTable(self.candidates)  # the ranking's vectorised pricing of chain candidates
        self._n_levels = np.array([len(p.levels) for p in self.candidates])  # explain's tie-breaks
        self._k_sum = np.array([sum(p.k) for p in self.candidates])
        self.table = [(int(lo), int(hi), spec) for lo, hi, spec in (table or [])]

        self._lock = threading.RLock()
        self._current = self.default_plan
        self._streak = 0
        self._calls = 0  # plan() answers past the table (rounds), whether ranked or held
        self._explored_at = 0  # _calls at the latest exploration check
        self._clock = 0  # target verify calls seen (~ engine rounds)
        self._measured: dict[tuple[int, ...] | str, int] = {}  # pair, tree key or "plain" -> clock of last measurement
        self._plain_at: dict[int, int] = {}  # batch bucket -> clock of the last plain measurement there
        self._plain_probed: set[int] = set()  # buckets given their first plain probe
        self._last_bucket, self._bucket_run = 0, 0  # bucket of the latest plan() call, consecutive calls there
        self._last: tuple[int, Plan] | None = None  # (batch, plan) of the latest plan() answer
        self._memo: dict[tuple, Any] = {}  # predictions (and rankings), cleared by every measurement
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
        self.overlap = engine.overlap
        self.bounded = engine.ahead_bounded
        self.ahead_chunk = max(1, engine.ahead_chunk)
        self._memo.clear()
        return self

    def _scaled_prior(self, ratio: float):
        target = self.costs[self.top]
        return lambda: tuple(ratio * c for c in target.coefficients)

    def _enumerate(self) -> list[Plan]:
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

    # ----- measurements (engine observer hooks) ---------------------------------------------------
    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        """A timed worker call: kind 'propose' (tokens = sequential steps) or 'verify' (tokens = q)."""
        with self._lock:
            cost = self.costs.get(level)
            if cost is None or tokens <= 0 or batch <= 0:
                return
            self._memo.clear()
            if kind == "propose":
                cost.observe(batch, 1, seconds / tokens, weight=float(tokens))
            elif kind == "native":
                if self.native_cost is not None and level == self.top:
                    self.native_cost.observe(batch, tokens, seconds)
                    self._clock += 1
                    self._plain_at[_bucket(batch)] = self._clock
                    if not self.native_k:  # plain decoding on the live path (no on_native follows)
                        self._measured["plain"] = self._clock
            else:
                cost.observe(batch, tokens, seconds)
                if level == self.top:
                    self._clock += 1
                    if tokens == 1:
                        self._measured["plain"] = self._clock
                        self._plain_at[_bucket(batch)] = self._clock

    def on_round(self, batch: int, seconds: float) -> None:
        """A round the planner chose a plan for took `seconds` (wall, every group): an exploration round's cost
        beyond the held plan's predicted round is what the next probe is priced at (`explore_budget`), since
        it includes what no step measurement sees -- a level catching up on the probed rows' whole text."""
        with self._lock:
            if self._explore_pending is None:
                bucket = _bucket(batch)
                self._served[bucket] = self._served.get(bucket, 0.0) + seconds
                return
            held, pairs = self._explore_pending
            for pair in pairs:
                self._explore_cost[pair] = max(0.0, seconds - held)
            self._explore_pending = None
            self._served.clear()

    def on_native(self, level: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None:
        """Acceptance of the native target's own speculation on rows it decoded without a specray draft (one
        entry per such row: vLLM's draft length and accepted count). A row drafted short (no n-gram match, or a
        fresh request) counts a failure at the next position, since its step ended there too."""
        with self._lock:
            acc = self.acceptance.get((level, level))
            if acc is None or level != self.top:
                return
            last = self._measured.get("plain")
            # the clock already advanced for this call (on_call comes first): the gap is to the call before it
            gap = 1.0 if last is None or last >= self._clock else float(self._clock - last)
            acc.observe(draft_lens, accepted, gap=gap, proposed=self.native_k)
            q = max(draft_lens, default=0) + 1
            self.native_q = self._native_decay * self.native_q + (1.0 - self._native_decay) * q
            self._measured["plain"] = self._clock
            self._memo.clear()

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int | None = None) -> None:
        """Acceptance of `lower`'s drafts by `level`, one entry per sequence of the call. `asked`: the tokens each
        row was asked for, where known (a lookup level: else the call's longest draft)."""
        with self._lock:
            acc = self.acceptance.get((level, lower))
            if acc is None:
                return
            last = self._measured.get((level, lower))
            gap = 1.0 if last is None else float(self._clock - last)
            # an n-gram drafts less than asked where it finds no match: the longest draft in the call
            # is the best lower bound on what was asked (model drafters always fill their K); at least 1, so that a
            # call in which no row matched (always the case at batch 1 without a match) counts a failure at the
            # first position of each row instead of nothing: such rounds emit one token, and the n-gram's price must
            # include them (else it is overrated at batch 1 against plain decoding and hybrid plans)
            proposed = (asked or max(max(draft_lens, default=0), 1)) if self.is_ngram[lower] else None
            acc.observe(draft_lens, accepted, gap=gap, proposed=proposed)
            if asked is None and self._chain_fed(level, lower) and draft_lens:
                # a chain round of a pair that also drafts trees: its tokens fed, priced like a tree's nodes
                self._fed_nodes((level, lower, 1), max(max(draft_lens), 1))
            if self.is_ngram[lower] and draft_lens:
                # the rows it matched on: the match rate, and the acceptance of a match (a hybrid plan's price)
                hit = [j for j, n in enumerate(draft_lens) if n > 0]
                f = self.decay_match
                self._match = [f * self._match[0] + len(hit), f * self._match[1] + len(draft_lens)]
                if hit and (level, lower) in self.matched:
                    self.matched[(level, lower)].observe([draft_lens[j] for j in hit], [accepted[j] for j in hit],
                                                         gap=gap, proposed=proposed)
            self._memo.clear()
            self._measured[(level, lower)] = self._clock

    def _fed_nodes(self, key: tuple[int, int, int], nodes: int) -> None:
        """The decayed mean of the largest draft (tree nodes, or a chain's tokens: width 1) per call of `key`."""
        old = self.tree_nodes.get(key)
        f = self.decay_nodes
        self.tree_nodes[key] = float(nodes) if old is None else f * old + (1.0 - f) * nodes

    def on_propose_tree(self, level: int, batch: int, depth: int, width: int, nodes: int, seconds: float) -> None:
        """A model level's timed tree proposal (`depth` forwards, `width` children per node, at most `nodes` nodes
        per row): its forwards, each feeding the paths to the nodes it expands (`tree_feeds`), are measurements of
        the level's step cost at those sizes -- as `depth` forwards of their mean size, exact for the linear cost
        model -- so a tree's proposal is priced from what tree proposals took, and its chain steps (one token each)
        are not priced at a tree's cost."""
        with self._lock:
            cost = self.costs.get(level)
            feeds = tree_feeds(depth, width, nodes)
            if cost is None or not feeds or batch <= 0:
                return
            self._memo.clear()
            cost.observe(batch, max(1, round(sum(feeds) / len(feeds))), seconds / len(feeds), weight=float(len(feeds)))

    def on_tree(self, level: int, lower: int, width: int, walks: Sequence[TreeWalk]) -> None:
        """A tree verification of `lower`'s trees (drafted `width` children per node) by `level`, one walk per
        row: the tree's acceptance per depth (a depth is a trial where the walk's node has children, a success
        where one of them is accepted; a walk that ends at a leaf before the node budget -- a model level's tree:
        before the tree's depth -- counts a failure after it, since the round ends there too) and the nodes fed;
        the chain along the first children feeds the pair's chain acceptance (`on_verify`), so running trees keeps
        the chain's price measured."""
        with self._lock:
            key = (level, lower, width)
            acc = self.tree_acceptance.get(key)
            if acc is not None and walks:
                last = self._measured.get(key)
                gap = 1.0 if last is None else float(self._clock - last)
                budget = max(max(w.nodes for w in walks), 1)
                bound = budget if self.is_ngram[lower] else max(max(w.depth for w in walks), 1)
                acc.observe([w.reach for w in walks], [w.accepted for w in walks], gap=gap, proposed=bound)
                self._fed_nodes(key, budget)
                self._measured[key] = self._clock
            # a spine ends where the tree's node budget went to siblings, not where a chain would end: a spine
            # accepted whole is cut short (no failure after it); a row without a tree is the lookup's miss
            self.on_verify(level, lower, [w.spine for w in walks], [w.spine_accepted for w in walks], asked=1)

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

    # ----- choosing ---------------------------------------------------------------------------------
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

    def _pairs(self, plan: Plan) -> list[tuple[int, int]]:
        if plan.hybrid:  # both drafters draft for the target
            return [(plan.levels[-1], plan.levels[0]), (plan.levels[-1], plan.levels[1])]
        eff = _effective(plan)
        return [(plan.levels[eff[j + 1]], plan.levels[eff[j]]) for j in range(len(eff) - 1)]

    def _items(self, plan: Plan) -> list[tuple[int, ...]]:
        """What a round of `plan` measures: its pairs, and (verifier, 0, width) where its suffix level drafts trees
        (a tree round measures its chain pair too: `on_tree`)."""
        items: list[tuple[int, ...]] = list(self._pairs(plan))
        width = self._width(plan, 0)
        if width > 1:
            items.append((plan.levels[1], plan.levels[0], width))
        return items

    def _exploration(self, ranked: list[tuple[Plan, float]], batch: int) -> Plan | None:
        """The best plan measuring the stalest pair not in the current plan, if it is stale enough. Plain
        decoding's staleness is counted at the batch's bucket: its cost is what the choice "stop speculating"
        rests on, and on a CPU it changes with the batch far more than a fitted curve says."""
        current = set(self._items(self._current)) | ({"plain"} if not self._pairs(self._current) else set())
        items: list[tuple[int, ...] | str] = ["plain", *(pair for pair in self.acceptance if pair[0] != pair[1]),
                                              *self.tree_acceptance]
        stale = []
        for item in items:
            if item in current:
                continue
            last = self._plain_at.get(_bucket(batch)) if item == "plain" else self._measured.get(item)
            age = math.inf if last is None else self._clock - last
            if age >= self.explore_every // 2:  # measured anyway (e.g. by overridden requests): skip
                stale.append((age, item))
        if not stale:
            return None
        stale.sort(key=lambda x: -x[0])
        for _, item in stale:
            for p, _gp in ranked:
                if (item == "plain" and not self._pairs(p)) or (item != "plain" and item in self._items(p)):
                    return p
        return None

    def _score(self, plan: Plan, batch: int) -> float:
        """Goodput as the choice weighs it: a speculative plan's discounted by `margin`."""
        gp = self._goodput(plan, batch)
        return gp / (1.0 + self.margin) if self.margin and self._pairs(plan) else gp

    def _affordable(self, probe: Plan, batch: int) -> bool:
        """Whether a probe round of `probe` fits `explore_budget`: its extra seconds over a round of the held plan
        -- a speculative probe runs as a group of its own on `probe_batch` rows beside the held plan's group;
        plain decoding on the whole batch instead -- at most the budget's share of the seconds served at this
        batch bucket since the latest exploration. So exploration stays a small share of the time at every load
        and, since a probe on a few rows measures the same acceptance at any batch, a burst at a batch size
        rarely served (a load peak, a benchmark's short wave) is not taxed by one."""
        if self.explore_budget is None:
            return True
        if self._pairs(probe):
            extra = max(self.round_time(probe, min(batch, self.probe_batch)),
                        *(self._explore_cost.get(pair, 0.0) for pair in self._pairs(probe)))
        else:
            extra = max(0.0, self.round_time(probe, batch) - self.round_time(self._current, batch))
        return extra <= self.explore_budget * self._served.get(_bucket(batch), 0.0)

    def _hold(self, batch: int) -> bool:
        """Whether this round keeps the held plan without a ranking: never at a new batch bucket or in the warm-up;
        otherwise until `rerank_every` rounds have passed and, with a `rerank_budget`, until the time since the
        last ranking is at least its cost over the budget."""
        if self._calls <= 1 or self._clock < self.warmup or _bucket(batch) != self._last_bucket:
            return False
        if self._unranked + 1 < self.rerank_every:
            return True
        return bool(self.rerank_budget) and (time.perf_counter() - self._rank_end) * self.rerank_budget < \
            self._rank_cost

    def plan(self, batch_size: int) -> Plan:
        """The plan for the next round over `batch_size` sequences (table, warm-up, hysteresis, exploration)."""
        batch = max(1, int(batch_size))
        with self._lock:
            self.answers += 1
            self._probe_round = False
            forced = self._override(batch)
            if forced is not None:
                self._last, self.last_reason = (batch, forced), "table"
                return forced
            self._calls += 1
            if self._hold(batch):
                self._unranked += 1  # between rankings: the held plan, priced at the last ranking
                self._last, self.last_reason = (batch, self._current), "hold"
                return self._current
            self._unranked = 0
            t0 = time.perf_counter()
            ranked = self.explain(batch)
            self._rank_end = time.perf_counter()
            self._rank_cost = self._rank_end - t0
            best, best_gp = ranked[0]
            if self.margin and self._pairs(best):
                plain_gp = self._score(self.plain, batch)
                best_gp = self._score(best, batch)
                if plain_gp >= best_gp:
                    best, best_gp = self.plain, plain_gp
            if self._clock < self.warmup:
                # nothing measured yet: run the configured plan unless even the priors say it loses
                start = self.default_plan if self._score(self.default_plan, batch) >= self._score(
                    self.plain, batch) else best
                self._current, self._streak = start, 0
                self._last, self.last_reason = (batch, start), "warmup"
                return start
            bucket, grew = _bucket(batch), 0 < self._last_bucket < _bucket(batch)
            self._bucket_run = self._bucket_run + 1 if bucket == self._last_bucket else 1
            self._last_bucket = bucket
            if grew and best == self.plain != self._current and bucket in self._plain_at:
                # the batch grew into a larger bucket where plain decoding is measured and predicted to win: patience
                # guards against noise at one batch size, but the held plan was chosen for a smaller one, and holding
                # it here for `patience` rounds is what makes a drafter catch up on the rows that grew the batch (a
                # whole prefill of each, which no step measurement prices) for rounds that lose anyway
                self._current, self._streak = best, 0
            if (self.explore_every and self._bucket_run >= 2 and bucket not in self._plain_at
                    and bucket not in self._plain_probed and self._pairs(self._current)):
                # second round at a new batch size while speculating (the first one carries the prefills of
                # the requests that grew the batch): measure plain decoding here, once
                self._plain_probed.add(bucket)
                self._last, self.last_reason = (batch, self._current), "plain_probe"
                self._probe_round = True
                return self.plain
            if self.explore_every and self._calls - self._explored_at >= self.explore_every:
                probe = self._exploration(ranked, batch)
                if probe is not None and not self._affordable(probe, batch):
                    probe = None  # not yet: checked again next round
                else:
                    self._explored_at = self._calls
                if probe is not None:
                    self._last = (batch, self._current)  # regime() reports the held plan, not the probe
                    self.last_reason = "explore"
                    if self._pairs(probe):  # a level's probe: what it costs beyond the held round is measured
                        self._explore_pending = (self.round_time(self._current, batch), self._pairs(probe))
                    else:
                        self._served.clear()
                    self._probe_round = True
                    return probe
            if best != self._current:
                cur_gp = self._score(self._current, batch)
                if best_gp > cur_gp * (1.0 + self.hysteresis):
                    self._streak += 1
                    # plain decoding predicted to beat the held plan by more than `decisive` (2x by default) is
                    # not noise -- both costs are measured at this batch (the held plan runs; plain is probed
                    # at every new batch bucket): switch at once instead of paying `patience` more rounds of a
                    # plan that loses big. A speculative plan's cost here may be an extrapolation: patience.
                    decisive = best == self.plain and best_gp > cur_gp * (1.0 + self.decisive)
                    if self._streak >= self.patience or decisive:
                        self._current, self._streak = best, 0
                else:
                    self._streak = 0
            else:
                self._streak = 0
            self._last, self.last_reason = (batch, self._current), "ranked"
            return self._current

    __call__ = plan

    def plan_groups(self, batch_size: int) -> list[tuple[Plan, int]]:
        """Like `plan`, as [(plan, number of sequences)]: an exploration probe runs on at most `probe_batch`
        sequences while the rest keep the held plan. Measuring a level then costs a small-batch round instead of
        bringing every sequence's cache up to date on that level (a whole batch of prefills at batch 32).

        A probe of plain decoding runs on the whole batch instead: it needs no catch-up (the target is always
        in step), costs at most one round at one token per sequence, and is the measurement the choice
        "stop speculating" rests on, so it must be taken at the batch size it is for -- a plain step at
        batch 2 says little about batch 16 on a CPU, where a 1-token row and a 9-token row cost very
        differently per token."""
        batch = max(1, int(batch_size))
        chosen = self.plan(batch)
        if not self._probe_round or batch <= self.probe_batch or not self._pairs(chosen):
            return [(chosen, batch)]
        return [(chosen, self.probe_batch), (self._current, batch - self.probe_batch)]

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
                return self.regime_of(self._last[1])
            forced = self._override(batch)
            return self.regime_of(forced if forced is not None else self.explain(batch)[0][0])
