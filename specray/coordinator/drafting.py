"""Drafting: the levels below the target make each row's draft (`Drafter.produce`), and the round asks a
`DraftSource` for them: `Immediate` drafts now, before the target verifies; `specray.coordinator.lookahead`
drafts the next round while the target verifies this one.

The first level of a chain drafts in one call (a model) or by lookup (the n-gram, or the suffix drafter, which
also learns from earlier requests' outputs: `LevelCalls.release` hands it each sequence's final text). A middle
level runs inner rounds until each row has what the level above asked for: its drafter proposes, it verifies,
and what it emitted (accepted tokens plus one correction or bonus token) is its draft (`specray.coordinator.inner`:
the loop, run from here or, with a `Nesting` transport, beside the middle level's model). Each level's accepted
stream is an exact sample from that level, so the target's is an exact sample from the target.

A hybrid plan (`Plan.hybrid`, `Drafter.hybrid`) drafts per row instead of in a chain: the lookup level first for
every row, then one propose call of the model level for the rows the lookup found no match for (of at least
`Drafter.min_match` tokens); the target verifies both kinds of rows in one call. Which drafter a row gets
depends only on its text, and each row's draft is verified against the q of its own drafter: a lookup row's q
is the one-hot of its tokens (rejection with it is the deterministic method), so a batch verified by rejection
stays exact row by row.

Token trees: a suffix level with `Level.tree_width` > 1 (or the plan's `Plan.tree`) below a level with
`WorkerCaps.tree_verify` drafts a `DraftTree` per row (`Drafts.trees`; `Drafter.tree_shape` decides), which that
level verifies in one forward (`LevelCalls.verify_tree`): the target, or a middle model in each inner round,
whose emitted tokens (the accepted path plus one token) extend its chain draft for the level above. A model level
with `Level.tree` (and `WorkerCaps.tree_propose`) drafts trees as the first level of the plan directly below a
target with `tree_verify`, unless the plan says chains (`Plan.tree` = 1: the planner prices both and picks). The
request's `RoundState.tree` overrides the shape of the level drafting for the target. Elsewhere chains, logged once
per pair; a hybrid plan drafts chains.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from specray.coordinator.calls import (
    LevelCalls,
    Relayed,
    catch_up_rows,
    drafted_steps,
    is_step,
    longest_path,
    spread,
)
from specray.coordinator.failover import LevelCallError
from specray.coordinator.feed import Verified, fed_lengths
from specray.coordinator.inner import FollowOn, InnerLog, NestedDraft, Nesting, inner_rounds
from specray.coordinator.state import Plan, Seq
from specray.coordinator.stats import drafter_of, stats_for
from specray.engine.protocol import DraftMode
from specray.engine.protocol import DraftProposal as Drafts
from specray.spec.params import TreeShape, VerifyMethod
from specray.spec.tree import DraftTree

if TYPE_CHECKING:
    from specray.engine.protocol import VerifyResult

__all__ = ["DraftSource", "Drafter", "Drafts", "Immediate", "RoundState", "Until"]

log = logging.getLogger(__name__)

#: the most rows of a round whose middle level drafts the next round on the target's verdict (`Drafter._follows`):
#: the largest batch whose follow-ons were measured under continuous batching, rows ending and joining every round
#: (benchmarks/bench_overhead.py --churn); a request the follow-on does not fit (a plan switched) waits for the
#: inner round under way
FOLLOW_MAX_ROWS = 64

#: each row's draft for the level above and q when the drafter sampled: `DraftProposal` (token_ids, probs)


class Until:
    """Set when the target has verified this round: the rows marked in `rows` stop drafting then (a bounded
    look-ahead, `specray.coordinator.lookahead`)."""

    def __init__(self, rows: Sequence[bool], event: threading.Event | None = None) -> None:
        self.rows = list(rows)
        self._event = event or threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def select(self, idx: Sequence[int]) -> Until:
        """The same signal over a subset of the rows."""
        return Until([self.rows[b] for b in idx], self._event)


@dataclass
class RoundState:
    """What one round works on, built once per round instead of threading its values through every call.

    chain: plan.levels; ks: K asked of each non-target level of the chain; override: the request's verification
    method (None: each level's own); want: draft tokens the target gets per row this round; cold: rows no model
    level below the target holds yet (they get no draft, see lookahead.py); until: the bounded look-ahead's stop
    signal (None: unbounded, or no look-ahead).
    """

    rows: list[Seq]
    plan: Plan
    override: VerifyMethod | None
    source: DraftSource
    want: list[int]
    cold: set[int] = field(default_factory=set)
    until: Until | None = None
    #: a hybrid plan: the level that drafted each row's draft for the target (set when the drafts are made)
    drafters: list[int] | None = None
    #: the request's token-tree shape for the level drafting for the target (None: the level's own; width 1:
    #: chains)
    tree: TreeShape | None = None
    #: children per node of the trees drafted for the target this round (1: chains; set by `new_round`)
    tree_width: int = 1
    #: the target's verification is under way, its drafts relayed by the middle level (`Drafter._nested`)
    relayed: Relayed | None = None

    @property
    def chain(self) -> tuple[int, ...]:
        return self.plan.levels

    @property
    def top(self) -> int:
        return self.plan.levels[-1]

    @property
    def lower(self) -> int | None:
        """The level that drafts for the target (None: plain decoding)."""
        return self.plan.levels[-2] if len(self.plan.levels) > 1 else None

    @property
    def speculative(self) -> bool:
        return self.lower is not None and self.plan.k[-1] > 0

    @property
    def verify_lower(self) -> int | None:
        """The drafter the target's verification is made for: `lower`, except in a hybrid round whose rows
        all took the lookup's drafts (then the lookup level: deterministic drafts, no q)."""
        if self.drafters is not None and self.lower not in self.drafters:
            return self.plan.levels[0]
        return self.lower

    def k(self, level: int) -> int:
        return self.plan.k[self.plan.levels.index(level)]


class DraftSource(Protocol):
    """Where a round's drafts come from (`Immediate`, or `LookAhead`)."""

    def drafts(self, r: RoundState) -> Drafts:
        """This round's drafts for the target."""

    def start_ahead(self, r: RoundState, drafts: Drafts) -> object | None:
        """Start drafting the next round beside the target's verification (None: no look-ahead)."""

    def settle(self, r: RoundState, ahead: object | None) -> dict[int, list[int]]:
        """The target has verified: stop the look-ahead at its next step and collect it (row -> tokens)."""

    def keep(self, r: RoundState, b: int, s: Seq, look: list[int] | None, draft_len: int, res: VerifyResult,
             committed: list[int]) -> None:
        """After the target's verdict on row b: keep what was drafted ahead if it continues the committed text."""


class Drafter:
    """Makes drafts with the levels below the target (`produce`)."""

    def __init__(self, calls: LevelCalls, nesting: Nesting | None = None) -> None:
        self.calls = calls
        #: runs a middle level's inner rounds beside its model, where the transport allows (None: from here)
        self.nesting = nesting
        self.levels = calls.levels
        #: steps per call when a bounded first model level drafts (its calls are where it can stop)
        self.chunk = 2
        #: a hybrid plan: the shortest lookup match a row takes instead of the model's draft
        self.min_match = 1
        #: (tree level, verifier) pairs already logged as drafting chains instead of trees
        self._chains_logged: set[tuple[int, int]] = set()
        #: a nested middle level relaying to the target drafts the next round on its verdict where the transport
        #: allows (`_follows`); and how many nested drafts came so (`NestedOutcome.followed`)
        self.follow = True
        self.followed = 0

    def produce(
        self, r: RoundState, ci: int, rows: list[Seq], tails: list[list[int]], want: list[int],
        until: Until | None = None, relay: bool = False,
    ) -> Drafts:
        """Level r.chain[ci] drafts want[b] tokens beyond each row's context (its tokens + tails[b]) for the
        level above it. `until` (a bounded draft): once it is set, the rows it marks stop at the next step
        boundary with what they have (at least one step runs); no probabilities then. `relay`: these are the
        round's drafts for the target, which a nested middle level may send to it directly (`r.relayed`)."""
        i = r.chain[ci]
        lvl = self.levels[i]
        if lvl.is_ngram:
            width = self.tree_width(r, ci)
            if width > 1:
                trees = self._lookup_trees(i, rows, tails, want, width)
                return Drafts([list(t.token_ids) for t in trees], trees=list(trees))
            return Drafts(self._lookup(i, rows, tails, want))
        if ci == 0:
            shape = self.tree_shape(r, ci)
            if shape is not None:
                return self._propose_trees(r, rows, want, shape)
            if until is not None and any(until.rows):
                return Drafts(self._propose_bounded(r, rows, tails, want, until))
            if relay and any(want) and self._relays(r, ci):  # the round's drafts: the target verifies what i sends
                idx = [b for b in range(len(rows)) if want[b] > 0]  # the rows `LevelCalls.propose` would send
                return self._relaying(r, ci, idx, lambda rel: spread(self.calls.propose(
                    i, r.top, [rows[b] for b in idx], [tails[b] for b in idx], [want[b] for b in idx], r.override,
                    relay=rel), idx, len(rows)), "the drafting level failed")
            return self.calls.propose(i, r.chain[1], rows, tails, want, r.override)
        return self._inner_rounds(r, ci, rows, tails, want, until, relay)

    def tree_width(self, r: RoundState, ci: int) -> int:
        """Children per node of the trees level r.chain[ci] drafts this round (1: chains; `tree_shape`)."""
        shape = self.tree_shape(r, ci)
        return shape.width if shape is not None else 1

    def tree_shape(self, r: RoundState, ci: int) -> TreeShape | None:
        """The token tree level r.chain[ci] drafts this round, or None for chains.

        Its shape: the request's (`RoundState.tree`) for the level drafting for the target, else a suffix level's
        plan width (`Plan.tree`) or `Level.tree_width`, a model level's `Level.tree` at the plan's width (`Plan.tree`:
        0 keeps the level's shape, 1 drafts chains, another width keeps its depth, at most width x depth nodes).
        Trees need width > 1, no hybrid plan, a verifier that scores trees (`WorkerCaps.tree_verify`), and a suffix
        level (below the target or a middle model verifying them in its inner rounds), or a model level that is the
        plan's first level directly below the target whose worker drafts trees (`WorkerCaps.tree_propose`);
        otherwise chains, logged once per pair (a vLLM verifier, a middle model, an n-gram level)."""
        i = r.chain[ci]
        lvl = self.levels[i]
        upper = r.chain[ci + 1]
        if r.tree is not None and upper == r.top:
            shape: TreeShape | None = r.tree
        elif lvl.suffix is not None:
            shape = TreeShape(r.plan.tree or lvl.tree_width)
        elif r.plan.tree == 1:  # the plan (the planner's choice) drafts chains with this level
            shape = None
        elif r.plan.tree > 1 and (lvl.tree is None or lvl.tree.width != r.plan.tree):
            shape = replace(lvl.tree or TreeShape(), width=r.plan.tree, max_nodes=None)
        else:
            shape = lvl.tree
        if shape is None or not shape.branches:
            return None
        caps = self.levels[upper].caps
        why = None
        if r.plan.hybrid:
            why = "a hybrid plan drafts chains"
        elif lvl.ngram is not None:
            why = "an n-gram level drafts chains only"
        elif lvl.worker is not None and upper != r.top:
            why = "only a target directly above verifies a model level's trees"
        elif lvl.worker is not None and ci != 0:
            why = "a middle level drafts by inner rounds (chains)"
        elif lvl.worker is not None and not (lvl.caps is not None and lvl.caps.tree_propose):
            why = "its worker drafts chains only (no tree_propose)"
        elif caps is None or not caps.tree_verify:
            why = "it verifies chains only (no tree_verify)"
        if why is None:
            return shape
        if (i, upper) not in self._chains_logged:
            self._chains_logged.add((i, upper))
            log.info("level %s drafts chains, not trees (width %d), for level %s: %s", lvl.name, shape.width,
                     self.levels[upper].name, why)
        return None

    def _propose_trees(self, r: RoundState, rows: list[Seq], want: list[int], shape: TreeShape) -> Drafts:
        """A model level drafts a token tree per row for the target: `shape.depth` levels (default the round's K),
        never past a row's length limit, `shape` giving the width and the node budget."""
        depth = [0 if w <= 0 else max(1, min(shape.depth_for(r.k(r.lower)), s.remaining - 1))
                 for s, w in zip(rows, want)]
        return self.calls.propose_tree(r.chain[0], r.top, rows, depth, shape.width,
                                       [shape.nodes_for(d) for d in depth], r.override)

    def _lookup_trees(self, i: int, rows: list[Seq], tails: list[list[int]], want: list[int], width: int,
                      ) -> list[DraftTree]:
        """Suffix level `i`: each row's draft tree beyond its context, want[b] nodes at most (empty: no match)."""
        sx = self.levels[i].suffix
        return [sx.propose_tree_seq(s.seq_id, s.tokens, s.prompt_len, s.tokens + t if t else s.tokens, w, width)
                if w > 0 else DraftTree((), ()) for s, t, w in zip(rows, tails, want)]

    def _lookup(self, i: int, rows: list[Seq], tails: list[list[int]], want: list[int]) -> list[list[int]]:
        """Lookup level `i` (n-gram or suffix): each row's match beyond its context, want[b] tokens at most."""
        lvl = self.levels[i]
        if lvl.suffix is not None:
            sx = lvl.suffix
            return [sx.propose_seq(s.seq_id, s.tokens, s.prompt_len, s.tokens + t if t else s.tokens, w)
                    if w > 0 else [] for s, t, w in zip(rows, tails, want)]
        ng = lvl.ngram
        return [ng.propose_text(s.lookup_text(), w, t) if w > 0 else [] for s, t, w in zip(rows, tails, want)]

    def hybrid(self, r: RoundState) -> tuple[Drafts, list[int]]:
        """A hybrid plan's drafts for the target and who made each: the lookup level's match (up to K_lookup
        tokens) where it has at least `min_match` tokens, else the model level's draft (K_model tokens), made in
        one propose call for those rows. Under rejection verification the rows get the q of their own drafter:
        the model's probabilities, or the one-hot of a lookup row's tokens (rejection with it is the
        deterministic method, so one batched verification is exact for every row)."""
        look, model = r.plan.levels[0], r.plan.levels[1]
        k_look, k_model = r.plan.k
        n = len(r.rows)
        no_tails: list[list[int]] = [[] for _ in r.rows]
        found = self._lookup(look, r.rows, no_tails, [min(k_look, w) for w in r.want])
        matched = [len(d) >= max(1, self.min_match) for d in found]
        need = [b for b in range(n) if not matched[b] and r.want[b] > 0]
        drafts = [d if m else [] for d, m in zip(found, matched)]
        drafters = [look] * n
        for b in need:
            drafters[b] = model
        if not need:
            return Drafts(drafts), drafters
        prop = self.calls.propose(model, r.top, [r.rows[b] for b in need], [[] for _ in need],
                                  [min(k_model, r.want[b]) for b in need], r.override)
        for b, toks in zip(need, prop.token_ids):
            drafts[b] = list(toks)
        if prop.probs is None or self.calls.method(r.top, model, r.override) is not VerifyMethod.REJECTION:
            return Drafts(drafts), drafters
        q = prop.probs  # [len(need), K_model, V]
        width = max(q.shape[1], max(len(d) for d in drafts))
        probs = q.new_zeros(n, width, q.shape[-1])  # [B, K, V]
        probs[need, : q.shape[1]] = q
        for b in range(n):
            if matched[b]:
                probs[b, torch.arange(len(drafts[b])), torch.tensor(drafts[b])] = 1.0
        return Drafts(drafts, probs), drafters

    def _inner_rounds(
        self, r: RoundState, ci: int, rows: list[Seq], tails: list[list[int]], want: list[int], until: Until | None,
        relay: bool = False,
    ) -> Drafts:
        """A middle level: inner rounds (`specray.coordinator.inner`) until each row has want[b] tokens, or
        stopped (a token it was unsure of, `Level.confidence`; or `until` set after an inner round). Run beside
        the middle level's model when the transport allows it (`Nesting`), else from here."""
        i, lower = r.chain[ci], r.chain[ci - 1]
        lvl = self.levels[i]
        need_probs = self.calls.method(r.chain[ci + 1], i, r.override) is VerifyMethod.REJECTION
        bounded = until is not None and any(until.rows)
        low = self.levels[lower]
        nestable = low.worker is not None or (low.ngram is not None and self.tree_width(r, ci - 1) == 1)
        if (self.nesting is not None and not bounded and nestable
                and self.nesting.reaches(lvl.worker, low.worker)):
            return self._nested(r, ci, rows, tails, want, need_probs, relay)

        def propose(idx: list[int], outs: list[list[int]], k: list[int]) -> Drafts:
            return self.produce(r, ci - 1, [rows[b] for b in idx], [tails[b] + o for b, o in zip(idx, outs)], k)

        def verify(idx: list[int], outs: list[list[int]], d: Drafts) -> VerifyResult:
            sub, sub_tails = [rows[b] for b in idx], [tails[b] + o for b, o in zip(idx, outs)]
            if d.trees is not None:  # a suffix level's trees (`tree_width`): the accepted path + one token
                return self.calls.verify_tree(i, lower, sub, d.trees, d.probs, r.override, tails=sub_tails,
                                              width=self.tree_width(r, ci - 1), return_probs=need_probs,
                                              confidence=lvl.confidence > 0)
            return self.calls.verify(i, lower, sub, sub_tails, d.token_ids, d.probs, r.override,
                                     return_probs=need_probs, confidence=lvl.confidence > 0)

        def stop() -> list[bool] | None:
            return until.rows if until is not None and until.is_set() else None

        return inner_rounds(want, r.k(lower), propose, verify, confidence=lvl.confidence, need_probs=need_probs,
                            vocab=lvl.caps.vocab_size, stop=stop, on_round=lambda log: _record(rows, i, lower, log),
                            min_share=lvl.inner_min_share)

    def _nested(
        self, r: RoundState, ci: int, rows: list[Seq], tails: list[list[int]], want: list[int], need_probs: bool,
        relay: bool = False,
    ) -> Drafts:
        """The middle level runs the inner rounds beside its model; its log is replayed here into the mirrors,
        the statistics and the planner feed, as if the calls had been made from here. `relay` (the round's
        drafts for the target): where the transport allows, the target's verification is asked for first and
        the middle level sends it the drafts itself (`r.relayed`; the round then only waits for the verdict)."""
        idx = [b for b in range(len(rows)) if want[b] > 0]
        if not idx:
            return Drafts([[] for _ in rows])
        if relay and self._relays(r, ci):
            follow = self._follows(r, ci, len(idx))
            return self._relaying(r, ci, idx, lambda rel: self._nested_call(r, ci, rows, tails, want, need_probs,
                                                                            idx, rel, follow),
                                  "the middle level's drafting failed", forward=follow)
        return self._nested_call(r, ci, rows, tails, want, need_probs, idx, None)

    def _relays(self, r: RoundState, ci: int) -> bool:
        """Can level r.chain[ci], drafting the round's chains for the target right above it, send them to the
        target itself (`Nesting.relays`)?"""
        return (self.nesting is not None and r.tree_width == 1 and not r.plan.hybrid and r.chain[ci + 1] == r.top
                and self.nesting.relays(self.levels[r.chain[ci]].worker, self.levels[r.top].worker))

    def _follows(self, r: RoundState, ci: int, rows: int) -> bool:
        """Does middle level r.chain[ci], relaying the round's drafts over `rows` rows, draft the next round on
        the target's verdict (`NestedDraft.follow`)? Only for rounds drafted now (a look-ahead drafts the next
        round itself) and batches up to `FOLLOW_MAX_ROWS`: the next request must ask what the verdict implies, give
        or take rows that end and join (`specray.serve.follow`)."""
        assert self.nesting is not None
        return (self.follow and isinstance(r.source, Immediate) and rows <= FOLLOW_MAX_ROWS
                and self.nesting.follows(self.levels[r.chain[ci]].worker, self.levels[r.top].worker))

    def _relaying(self, r: RoundState, ci: int, fill: list[int], draft: Callable[[Relayed], Drafts],
                  failed: str, forward: bool = False) -> Drafts:
        """Ask the target for the round's verification first, then `draft` with level r.chain[ci], which sends the
        drafts (for the rows `fill`) to the target itself; the round then only waits for the verdict
        (`r.relayed`). If drafting fails, the drafts will not come: the target drops the verification (`failed`
        says why). `forward`: the target sends its verdict to level r.chain[ci] too."""
        assert self.nesting is not None
        relayed = self.calls.verify_later(r.top, r.chain[ci], r.rows, r.override, fill, self.nesting, forward)
        try:
            out = draft(relayed)
        except BaseException:
            self.calls.abandon(r.top, r.rows, relayed, failed)
            raise
        r.relayed = relayed
        return out

    def _nested_call(
        self, r: RoundState, ci: int, rows: list[Seq], tails: list[list[int]], want: list[int], need_probs: bool,
        idx: list[int], relayed: Relayed | None, follow: bool = False,
    ) -> Drafts:
        i, lower = r.chain[ci], r.chain[ci - 1]
        lvl, low = self.levels[i], self.levels[lower]
        sub, sub_tails = [rows[b] for b in idx], [tails[b] for b in idx]
        # an n-gram level below runs beside the middle level's model, on its own copy of each row's text
        low_key = lower if low.ngram is None else -1 - i
        low_syncs = ([self.calls.sync(lower, s, t) for s, t in zip(sub, sub_tails)] if low.ngram is None
                     else [self.calls.lookup_sync(i, s, t) for s, t in zip(sub, sub_tails)])
        mid_syncs = [self.calls.sync(i, s, t) for s, t in zip(sub, sub_tails)]
        call = NestedDraft(
            i, lower, [s.seq_id for s in sub], [s.sampling for s in sub], mid_syncs, low_syncs,
            [want[b] for b in idx], r.k(lower), self.calls.method(i, lower, r.override),
            DraftMode.for_method(self.calls.method(i, lower, r.override)), need_probs, lvl.confidence,
            low.confidence, lvl.caps.vocab_size, lvl.inner_min_share, low.ngram,
            mid_owed=catch_up_rows(mid_syncs, sub_tails), low_owed=catch_up_rows(low_syncs, sub_tails),
            follow=FollowOn(r.k(i), tuple(s.remaining for s in sub), tuple(tuple(s.stop_ids) for s in sub))
            if follow else None)
        if relayed is None:
            got = self.calls.call(i, self.nesting.draft, lvl.worker, low.worker, call)
        else:
            got = self.calls.call(i, self.nesting.draft, lvl.worker, low.worker, call, relay=relayed.pending)
            if got.low_error is None:  # else nothing to send: the round fails over
                relayed.drafted(got.drafts, got.relayed)
        self.followed += got.followed
        for s, mh, lh in zip(sub, got.mid_held, got.low_held):
            s.mirror[i].extend(mh)
            s.mirror[low_key].extend(lh)
        for b in got.unsynced:  # neither level took these rows (`NestedOutcome.unsynced`): start them there again
            sub[b].mirror.pop(i, None)
            sub[b].mirror.pop(low_key, None)
        width = self.tree_width(r, ci - 1)
        for log in got.logs:  # timed as `LevelCalls` times the calls it makes: not a call that caught a row up
            if log.steps and low.ngram is None:  # lookups are not timed (as when drafted from here)
                steps = log.steps if log.trees is not None else drafted_steps(low, [log.steps], log.drafts)
                if is_step(log.low_caught[2], log.low_caught[0]):
                    self.calls.feed.proposed(lower, log.asked, steps, log.propose_s)
                else:
                    self.calls.feed.caught_up(lower, "propose", log.asked, steps, log.low_caught[1], log.propose_s)
            timed, caught = is_step(log.mid_caught[2], log.mid_caught[0]), log.mid_caught[1]
            if log.trees is not None:
                self.calls.feed.verified(Verified(i, lower, [longest_path(t) for t in log.trees], log.result,
                                                  log.verify_s, trees=log.trees, width=width, timed=timed,
                                                  caught_up=caught))
            else:
                self.calls.feed.verified(Verified(i, lower, log.drafts, log.result, log.verify_s, timed=timed,
                                                  caught_up=caught))
            _record(sub, i, lower, log)
        if got.low_error is not None:
            raise LevelCallError(lower, low.name, got.low_error)
        return got.drafts if len(idx) == len(rows) else spread(got.drafts, idx, len(rows))

    def _propose_bounded(
        self, r: RoundState, rows: list[Seq], tails: list[list[int]], want: list[int], until: Until,
    ) -> list[list[int]]:
        """The first model level drafts in calls of `chunk` steps, so that the rows `until` marks can stop between
        calls once it is set (the other rows draft the rest of want[b] in one more call); the first call always
        runs. A row that got fewer tokens than it asked for stopped by itself (`confidence`). Drafts are keyed by
        position: chunking does not change them."""
        i, upper = r.chain[0], r.chain[1]
        outs: list[list[int]] = [[] for _ in rows]
        done = [w <= 0 for w in want]
        first = True
        while True:
            late, first = until.is_set() and not first, False
            idx = [b for b in range(len(rows)) if not done[b] and not (late and until.rows[b])]
            if not idx:
                return outs
            ask = [want[b] - len(outs[b]) if late or not until.rows[b] else
                   min(self.chunk, want[b] - len(outs[b])) for b in idx]
            prop = self.calls.propose(i, upper, [rows[b] for b in idx], [tails[b] + outs[b] for b in idx], ask,
                                      r.override)
            for b, a, toks in zip(idx, ask, prop.token_ids):
                outs[b].extend(toks)
                done[b] = len(toks) < a or len(outs[b]) >= want[b]


def _record(rows: Sequence[Seq], level: int, lower: int, log: InnerLog) -> None:
    """An inner round's statistics at the middle level (draft tokens fed, accepted, emitted; a tree: its nodes and
    depth), under the pair `lower` -> `level`."""
    res = log.result
    fed = fed_lengths(res, log.drafts)
    native = res.native_drafts is not None
    for j, b in enumerate(log.idx):
        key = (level, drafter_of(lower, bool(log.drafts[j]), native))
        tree = log.trees[j] if log.trees is not None else None
        stats_for(rows[b].stats, key).record(fed[j], res.num_accepted[j], len(res.token_ids[j]),
                                             tree.max_depth if tree is not None else None)


class Immediate:
    """Drafts made now, before the target verifies: the round costs draft + verify."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def drafts(self, r: RoundState) -> Drafts:
        if not r.speculative:
            return Drafts([[] for _ in r.rows])
        if r.plan.hybrid:
            drafts, r.drafters = self.drafter.hybrid(r)
            return drafts
        return self.drafter.produce(r, len(r.chain) - 2, r.rows, [[] for _ in r.rows], r.want, relay=True)

    def start_ahead(self, r: RoundState, drafts: Drafts) -> None:
        return None

    def settle(self, r: RoundState, ahead: object | None) -> dict[int, list[int]]:
        return {}

    def keep(self, r: RoundState, b: int, s: Seq, look: list[int] | None, draft_len: int, res: VerifyResult,
             committed: list[int]) -> None:
        s.ahead = None
