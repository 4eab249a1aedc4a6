"""The planner's live measurements: what it prices plans from, and the hooks that update them.

`Measurements` (a part of `specray.policy.planner.Planner`, read by its `Pricing` and `Ranking`) holds each model
level's step-cost fit (`StepCost`), the acceptance of each (verifier, drafter) pair (`Acceptance`), a lookup level's
match rate and the acceptance of its matches (hybrid plans), the token trees' acceptance and nodes fed, the native
target's own speculation, and the clock of each item's latest measurement, which exploration reads to find the
stalest. The engine feeds them through its observer hooks (`on_call`, `on_verify`, `on_native`, `on_tree`,
`on_propose_tree`, `on_shadow`, `on_host`: the typed events of `specray.coordinator.feed`, through the planner's
hooks of the same names); every measurement clears `memo`, the predictions derived from them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specray.policy.cost import Acceptance, StepCost
from specray.policy.host import HostTimes
from specray.spec.params import tree_feeds

if TYPE_CHECKING:
    from specray.coordinator.feed import TreeWalk
    from specray.coordinator.state import Level
    from specray.spec.params import TreeShape

__all__ = ["Measurements", "batch_bucket"]


def batch_bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...): where plain decoding is re-measured."""
    return 1 << max(0, int(batch) - 1).bit_length()


class Measurements:
    """The measured state, each item at its prior until measured (the `Planner` arguments of the same names), and
    the engine's observer hooks. `lock` guards it: the hooks take it, and so must every reader that needs a
    consistent view (the planner does); `memo` holds what readers derive from it (predictions, rankings)."""

    def __init__(
        self,
        levels: Sequence[Level],
        k_choices: tuple[int, ...],
        decay: float,
        prior_alpha_model: float,
        prior_alpha_ngram: float,
        prior_alpha_match: float,
        prior_match: float,
        prior_cost_ratio: float,
        prior_target: tuple[float, float, float],
    ) -> None:
        self.top = len(levels) - 1
        self.is_ngram = [lvl.is_ngram for lvl in levels]
        self.k_choices = k_choices
        self.lock = threading.RLock()
        self.memo: dict[tuple, Any] = {}  # predictions (and rankings) derived from these, cleared by every measurement
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
        self.match = [0.0, 0.0]  # decayed (rows matched, rows looked up)
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
        self.suffix_trees = bool(self.tree_acceptance)
        top_caps = levels[-1].caps
        self.tree_shapes: dict[int, TreeShape] = {
            i: lvl.tree for i, lvl in enumerate(levels[:-1])
            if lvl.tree is not None and lvl.tree.branches and lvl.caps is not None and lvl.caps.tree_propose
            and top_caps is not None and top_caps.tree_verify}
        for i, shape in self.tree_shapes.items():
            self.tree_acceptance[(self.top, i, shape.width)] = Acceptance(prior_alpha_model, decay=decay, k_max=k_acc)
        #: the configured tree width of each level that drafts trees
        self.tree_widths: dict[int, int] = {**({0: self.tree_width} if self.suffix_trees else {}),
                                            **{i: shape.width for i, shape in self.tree_shapes.items()}}
        self.tree_nodes: dict[tuple[int, int, int], float] = {}
        self.decay_nodes = decay
        self.native_cost: StepCost | None = None
        if self.native_k:
            self.acceptance[(self.top, self.top)] = Acceptance(prior_alpha_ngram, decay=decay,
                                                               k_max=max(32, self.native_k + 1))
        if self.native_k or self.engine_verify or levels[-1].live_decode:
            self.native_cost = StepCost(self._scaled_prior(1.0), decay=fit_decay, table_decay=decay)
        #: a lookup level's drafts, by the row's state: after a round in which the row's whole draft was accepted
        #: (a copy under way: `hot`) or not (`cold`), per (verifier, lookup) pair, and each row's state after the
        #: pair's latest verification with the clock it was taken at (`expected_lengths`). Text moves between
        #: copying and not copying every few rounds, and one acceptance over both prices K for neither.
        self.hot: dict[tuple[int, int], Acceptance] = {}
        self.cold: dict[tuple[int, int], Acceptance] = {}
        self.row_hot: dict[tuple[int, int], tuple[int, list[bool]]] = {}
        if self.is_ngram[0]:
            for up in range(1, self.top + 1):
                for split in (self.hot, self.cold):
                    split[(up, 0)] = Acceptance(prior_alpha_ngram, decay=decay, k_max=k_acc)
        #: level that ends drafts short by a rule of its own (`Level.stops_drafts`: a model level's confidence, an
        #: n-gram level's match-length cap) -> the decayed chance that its draft goes on past each position
        #: (`on_drafted`; 1 until measured: a level that fills its K)
        self.stops: dict[int, Acceptance] = {
            i: Acceptance(1.0, decay=decay, k_max=max(32, max(self.k_choices) + 1))
            for i, lvl in enumerate(levels[:-1]) if lvl.stops_drafts}
        self.clock = 0  # target verify calls seen (~ engine rounds)
        #: pair, tree key or "plain" -> clock of its latest measurement
        self.measured_at: dict[tuple[int, ...] | str, int] = {}
        #: pair -> clock of its latest acceptance observation, a shadow lookup's included (`on_shadow`): how much the
        #: next one decays the estimate by; `measured_at` (what exploration reads) counts rounds that ran the pair
        self.observed_at: dict[tuple[int, int], int] = {}
        self.plain_at: dict[int, int] = {}  # batch bucket -> clock of the last plain measurement there
        #: model drafter pair -> (draft tokens verified, all calls; whether its latest call with rows asked to draft
        #: got a draft from any): how much of the pair was ever measured, where its acceptance's `weight` says how
        #: much its estimate rests on now; a drafter that drafts nothing (a confidence stop at its first token) is
        #: measured by that alone (`Planner`'s warm-up)
        self.sampled: dict[tuple[int, int], tuple[int, bool]] = {}
        #: model level -> decayed [tokens caught up, seconds beyond the calls' own work] (`on_catch_up`): what a
        #: level that sat out rounds, or meets a row for the first time, pays per token of text to catch up
        self.catch_up: dict[int, list[float]] = {}
        #: the same over the calls whose own work was priced (the level timed before): its `StepCost.slope_floor`
        self.floor: dict[int, list[float]] = {}
        self.decay_catch_up = decay
        #: the coordinator's own seconds per round, by the plan's drafting levels and batch bucket (`on_host`)
        self.host = HostTimes()

    def _scaled_prior(self, ratio: float):
        target = self.costs[self.top]
        return lambda: tuple(ratio * c for c in target.coefficients)

    def chain_fed(self, level: int, lower: int) -> bool:
        """Whether `lower`'s chains for `level` are priced at the tokens they fed: a suffix level that also drafts
        trees for it (its chains are often shorter than K)."""
        return self.is_ngram[lower] and (level, lower, self.tree_width) in self.tree_acceptance

    def host_time(self, drafting: tuple[int, ...], batch: int) -> float:
        """Seconds a round drafted by `drafting` (() plain decoding) spends outside the workers' calls at `batch`."""
        return self.host.seconds(drafting, batch_bucket(batch))

    # ----- engine observer hooks ------------------------------------------------------------------
    def on_host(self, drafting: tuple[int, ...], batch: int, seconds: float) -> None:
        """A round drafted by `drafting` (() plain decoding) over `batch` rows spent `seconds` outside its workers'
        calls (`specray.policy.host`)."""
        with self.lock:
            self.host.observe(drafting, batch_bucket(batch), seconds)
            self.memo.clear()

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        """A timed worker call: kind 'propose' (tokens = sequential steps) or 'verify' (tokens = q)."""
        with self.lock:
            cost = self.costs.get(level)
            if cost is None or tokens <= 0 or batch <= 0:
                return
            self.memo.clear()
            if kind == "propose":
                cost.observe(batch, 1, seconds / tokens, weight=float(tokens))
            elif kind == "native":
                if self.native_cost is not None and level == self.top:
                    self.native_cost.observe(batch, tokens, seconds)
                    self.clock += 1
                    self.plain_at[batch_bucket(batch)] = self.clock
                    if not self.native_k:  # plain decoding on the live path (no on_native follows)
                        self.measured_at["plain"] = self.clock
            else:
                cost.observe(batch, tokens, seconds)
                if level == self.top:
                    self.clock += 1
                    if tokens == 1:
                        self.measured_at["plain"] = self.clock
                        self.plain_at[batch_bucket(batch)] = self.clock

    def on_catch_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None:
        """A call that also caught its rows up on `caught` tokens of earlier text (untimed for `on_call`): the
        seconds beyond the call's own work (kind and tokens as `on_call`'s, predicted from the level's fit once
        that is measured; before, the whole call counts) are the catch-up's."""
        with self.lock:
            if caught <= 0 or level not in self.costs or batch <= 0:
                return
            if level == self.top:
                # the target reads new rows' prompts: the rows' copy state (`hot_share`) was their predecessors'.
                # Kept, a request that ended in a copy priced the next one's lookup chains at a copy's acceptance
                # for its first rounds, and on a long prompt that choice held (the drafter's catch-up grows)
                self.row_hot.clear()
            native = kind == "native" and self.native_cost is not None and level == self.top
            fit = self.native_cost if native and self.native_cost is not None else self.costs[level]
            if not fit.n_obs:
                if caught < MIN_UNTIMED_CATCH_UP:
                    return  # the call's own step, not yet timed, would count as the catch-up's (module constant)
                work = 0.0
            elif kind == "propose":  # `tokens` steps of one token
                work = tokens * fit.predict(batch, 1)
            else:
                work = fit.predict(batch, max(tokens, 1))
            extra = max(0.0, seconds - work)
            f = self.decay_catch_up
            _decayed_add(self.catch_up, level, f, caught, extra)
            # the level's cost per token fed, measured on calls far larger than a decode step's; not from a call made
            # before any step was timed: all of its time would count, a call's fixed cost with it, and a short first
            # prompt then priced every token of a verification at a fraction of a whole step
            if fit.n_obs:
                low = _decayed_add(self.floor, level, f, caught, extra)
                if low[0] >= 1.0:
                    for cost in (self.costs[level], self.native_cost if level == self.top else None):
                        if cost is not None:
                            cost.slope_floor = low[1] / low[0]
            self.memo.clear()

    def on_native(self, level: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None:
        """Acceptance of the native target's own speculation on rows it decoded without a specray draft (one
        entry per such row: vLLM's draft length and accepted count). A row drafted short (no n-gram match, or a
        fresh request) counts a failure at the next position, since its step ended there too."""
        with self.lock:
            acc = self.acceptance.get((level, level))
            if acc is None or level != self.top:
                return
            last = self.measured_at.get("plain")
            # the clock already advanced for this call (on_call comes first): the gap is to the call before it
            gap = 1.0 if last is None or last >= self.clock else float(self.clock - last)
            acc.observe(draft_lens, accepted, gap=gap, proposed=self.native_k)
            q = max(draft_lens, default=0) + 1
            self.native_q = self._native_decay * self.native_q + (1.0 - self._native_decay) * q
            self.measured_at["plain"] = self.clock
            self.memo.clear()

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int | None = None) -> None:
        """Acceptance of `lower`'s drafts by `level`, one entry per sequence of the call. `asked`: the tokens each
        row was asked for, where known (a lookup level: else the call's longest draft)."""
        # a drafter without a stop rule of its own drafts what it was asked: an empty row was asked for nothing
        stops = lower in self.stops
        self._sample(level, lower, draft_lens, [1 if stops else n for n in draft_lens])
        self._observe(level, lower, draft_lens, accepted, asked, ran=True)

    def on_drafted(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                   asked: Sequence[int]) -> None:
        """The target's verification of drafts from a level that stops short by a rule of its own (a model level at
        a token it is unsure of, an n-gram level at its match-length cap: `Level.stops_drafts`), one entry per
        row, with the tokens each row asked for. A draft shorter than asked stopped after its last token: its
        length is measured (`stops`: the level's calls and the target's verification are priced at what it
        drafts, `Pricing.draft_lengths`), and if it was accepted whole the round ended there, a failure after it
        (as for a lookup that drafted less than asked)."""
        with self.lock:
            self._sample(level, lower, draft_lens, asked)
            self._stopped(lower, draft_lens, asked)
            lens = [n + 1 if 0 < n < w and a >= n else n for n, a, w in zip(draft_lens, accepted, asked)]
            # every row's stop is in `lens` now; a lookup row that drafted nothing still counts a failure at the
            # first position (asked 1), and a row that filled its ask is censored there, whatever the others asked
            self._observe(level, lower, lens, accepted, 1, ran=True)

    def _sample(self, level: int, lower: int, draft_lens: Sequence[int], asked: Sequence[int]) -> None:
        """`sampled`: a model drafter's draft tokens verified, over its rows asked for some."""
        if self.is_ngram[lower]:
            return
        lens = [max(0, int(n)) for n, w in zip(draft_lens, asked) if w > 0]
        if lens:
            with self.lock:
                total, _ = self.sampled.get((level, lower), (0, False))
                self.sampled[(level, lower)] = (total + sum(lens), any(lens))

    def _stopped(self, lower: int, draft_lens: Sequence[int], asked: Sequence[int]) -> None:
        """How far `lower`'s drafts went, where it stops short by a rule of its own (`stops`)."""
        stops = self.stops.get(lower)
        if stops is None:
            return
        # went on past positions 1..n-1; stopped at n when short of what was asked (else n was the last)
        went = [(n, n - 1) if n < w else (n - 1, n - 1) for n, w in zip(draft_lens, asked) if 0 < n <= w]
        went = [(t, g) for t, g in went if t > 0]
        if went:
            stops.observe([t for t, _ in went], [g for _, g in went])

    def on_shadow(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int, latest: Sequence[bool] | None = None) -> None:
        """Drafts of lookup level `lower` that no round verified, checked against the text `level` committed after
        them (`PlannerFeed.shadowed`): its acceptance is measured as a round of the pair would have measured it,
        so a switched-off n-gram's price follows the text being generated now instead of what it was when it last
        ran, and so do how far its drafts go where it caps them by their match (`stops`) and the rows' state (a row
        whose whole shadow draft matched is copying: `hot_share`; `latest`: per row, whether its latest draft here
        was, where a row's drafts were replayed over a round's tokens; default: one draft per row). The pair still
        counts as unmeasured for exploration: what its rounds cost (a step feeding K + 1 tokens) is only measured by
        running them."""
        with self.lock:
            self._stopped(lower, draft_lens, [asked] * len(draft_lens))
            self._observe(level, lower, draft_lens, accepted, asked, ran=False)
            if (level, lower) in self.hot:  # the rows' state, as a round of the pair would have left it
                self.row_hot[(level, lower)] = (self.clock, list(latest) if latest is not None else
                                                _whole(draft_lens, accepted))

    def _observe(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int], asked: int | None,
                 ran: bool) -> None:
        with self.lock:
            acc = self.acceptance.get((level, lower))
            if acc is None:
                return
            last = self.observed_at.get((level, lower))
            gap = 1.0 if last is None else float(self.clock - last)
            # an n-gram drafts less than asked where it finds no match: the longest draft in the call
            # is the best lower bound on what was asked (model drafters always fill their K); at least 1, so that a
            # call in which no row matched (always the case at batch 1 without a match) counts a failure at the
            # first position of each row instead of nothing: such rounds emit one token, and the n-gram's price must
            # include them (else it is overrated at batch 1 against plain decoding and hybrid plans)
            proposed = (asked or max(max(draft_lens, default=0), 1)) if self.is_ngram[lower] else None
            acc.observe(draft_lens, accepted, gap=gap, proposed=proposed)
            if asked is None and self.chain_fed(level, lower) and draft_lens:
                # a chain round of a pair that also drafts trees: its tokens fed, priced like a tree's nodes
                self._fed_nodes((level, lower, 1), max(max(draft_lens), 1))
            if self.is_ngram[lower] and draft_lens:
                # the rows it matched on: the match rate, and the acceptance of a match (a hybrid plan's price)
                hit = [j for j, n in enumerate(draft_lens) if n > 0]
                f = self.decay_match
                self.match = [f * self.match[0] + len(hit), f * self.match[1] + len(draft_lens)]
                if hit and (level, lower) in self.matched:
                    self.matched[(level, lower)].observe([draft_lens[j] for j in hit], [accepted[j] for j in hit],
                                                         gap=gap, proposed=proposed)
            if ran and (level, lower) in self.hot:
                self._observe_split((level, lower), draft_lens, accepted, proposed)
            self.memo.clear()
            self.observed_at[(level, lower)] = self.clock
            if ran:
                self.measured_at[(level, lower)] = self.clock

    def _observe_split(self, pair: tuple[int, int], draft_lens: Sequence[int], accepted: Sequence[int],
                       proposed: int | None) -> None:
        """A verification of a lookup's drafts, each row counted in the acceptance of its state (hot: its whole
        draft was accepted in the pair's previous verification, one round ago, at the same batch size; rows whose
        previous round is not known count as cold); then each row's new state."""
        before = self.row_hot.get(pair)
        known = before is not None and before[0] >= self.clock - 1 and len(before[1]) == len(draft_lens)
        hot = before[1] if known and before is not None else [False] * len(draft_lens)
        for split, state in ((self.hot[pair], True), (self.cold[pair], False)):
            rows = [j for j, h in enumerate(hot) if h == state]
            if rows:
                split.observe([draft_lens[j] for j in rows], [accepted[j] for j in rows], proposed=proposed)
        self.row_hot[pair] = (self.clock, _whole(draft_lens, accepted))

    def hot_share(self, pair: tuple[int, int]) -> float | None:
        """The share of rows whose whole draft of `pair` was accepted in the latest round, where that round ran the
        pair and both states are measured; else None (the pair's acceptance over all rows prices it)."""
        before = self.row_hot.get(pair)
        if before is None or before[0] < self.clock or not before[1]:
            return None
        if self.hot[pair].weight < 1.0 or self.cold[pair].weight < 1.0:
            return None
        return sum(before[1]) / len(before[1])

    def expected_lengths(self, pair: tuple[int, int], k_max: int) -> list[float]:
        """E[L] of `pair`'s chains for K = 1..k_max: for a lookup pair whose rows' states are known, the mix of the
        hot and cold rows' (`hot_share`); else over all rows."""
        share = self.hot_share(pair) if pair in self.hot else None
        if share is None:
            return self.acceptance[pair].expected_lengths(k_max)
        hot, cold = self.hot[pair].expected_lengths(k_max), self.cold[pair].expected_lengths(k_max)
        return [share * h + (1.0 - share) * c for h, c in zip(hot, cold)]

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
        with self.lock:
            cost = self.costs.get(level)
            feeds = tree_feeds(depth, width, nodes)
            if cost is None or not feeds or batch <= 0:
                return
            self.memo.clear()
            cost.observe(batch, max(1, round(sum(feeds) / len(feeds))), seconds / len(feeds), weight=float(len(feeds)))

    def on_tree(self, level: int, lower: int, width: int, walks: Sequence[TreeWalk]) -> None:
        """A tree verification of `lower`'s trees (drafted `width` children per node) by `level`, one walk per
        row: the tree's acceptance per depth (a depth is a trial where the walk's node has children, a success
        where one of them is accepted; a walk that ends at a leaf before the node budget -- a model level's tree:
        before the tree's depth -- counts a failure after it, since the round ends there too) and the nodes fed;
        the chain along the first children feeds the pair's chain acceptance (`on_verify`), so running trees keeps
        the chain's price measured."""
        with self.lock:
            key = (level, lower, width)
            acc = self.tree_acceptance.get(key)
            if acc is not None and walks:
                last = self.measured_at.get(key)
                gap = 1.0 if last is None else float(self.clock - last)
                budget = max(max(w.nodes for w in walks), 1)
                bound = budget if self.is_ngram[lower] else max(max(w.depth for w in walks), 1)
                acc.observe([w.reach for w in walks], [w.accepted for w in walks], gap=gap, proposed=bound)
                self._fed_nodes(key, budget)
                self.measured_at[key] = self.clock
            # a spine ends where the tree's node budget went to siblings, not where a chain would end: a spine
            # accepted whole is cut short (no failure after it); a row without a tree is the lookup's miss
            self.on_verify(level, lower, [w.spine for w in walks], [w.spine_accepted for w in walks], asked=1)


def _whole(draft_lens: Sequence[int], accepted: Sequence[int]) -> list[bool]:
    """Per row, whether its whole draft was accepted: a copy under way (the row's state, `Measurements.hot_share`)."""
    return [0 < n <= a for n, a in zip(draft_lens, accepted)]


#: the fewest tokens a catch-up must have caught to be priced from a call whose level's step was never timed: the
#: whole call then counts as catching up, and for a few tokens (a short greeting's prompt on a drafter's first call)
#: that prices catching up at a whole step per token or two, several times a prompt's real rate, so that a drafter
#: looked too dear to start on the first long prompt that followed
MIN_UNTIMED_CATCH_UP = 32


def _decayed_add(table: dict[int, list[float]], level: int, f: float, tokens: float, seconds: float) -> list[float]:
    """table[level] ([tokens, seconds], decayed by `f` per call) with one call's tokens and seconds added."""
    rec = table.setdefault(level, [0.0, 0.0])
    rec[0] = f * rec[0] + tokens
    rec[1] = f * rec[1] + seconds
    return rec
