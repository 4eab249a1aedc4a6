"""The planner feed: every timed worker call of a round reaches the planner (and any other observer) here, as one
typed event, and is classified here, not in the round.

An observer implements `Observer` (the planner does): `on_call(level, kind, batch, tokens, seconds)` for a timed
call, with kind "propose" (tokens = autoregressive steps), "verify" (tokens = the longest draft + 1, fed in one
forward) or "native" (a call served by the level's own engine path: live decoding, or its own speculation;
tokens = the longest fed span + 1); `on_verify(level, lower, draft_lens, accepted)` for the rows that verified a
draft from `lower` (a hybrid round: once per drafter, `PlannerFeed._hybrid`); and optionally (`NativeObserver`)
`on_native(level, draft_lens, accepted)` for the rows a native target speculated on by itself.

Token trees: an observer with `on_tree(level, lower, width, walks)` (`TreeObserver`, the planner) gets a tree
verification as one `TreeWalk` per row instead of `on_verify` (the tree's own acceptance per depth, and the
counterfactual of the chain along its first children); any other observer sees each tree as a chain as deep as
the tree (its longest path) through `on_verify`. A model level's timed tree proposal reaches an observer with
`on_propose_tree(level, batch, depth, width, nodes, seconds)` (`TreeProposeObserver`, the planner: each depth feeds
the frontier's paths, `specray.spec.params.tree_feeds`), any other as a propose of `depth` steps.

Shadow lookups: an n-gram level 0 costs nothing to consult, so on rounds whose target verified no draft of it (plain
decoding, a model drafter alone, a cascade where it drafts for a middle level) the feed looks its draft up anyway
and checks it against the text the target committed after it: exactly what a round of n-gram -> target would have
accepted there (the same greedy tokens; at temperature > 0 a deterministic draft token is accepted with the
probability that the target samples it). A `ShadowObserver` (the planner) gets those as
`on_shadow(level, 0, draft_lens, accepted, asked)`, so the n-gram's acceptance on the text being generated now is
measured while it is switched off: a level measured on an earlier request (a short chat prompt with nothing to
copy) is not left priced at that request's acceptance until an exploration round happens to try it. The lookups
replay the lookup's own rounds over the tokens a round committed: after a draft is checked, the next lookup drafts
from where the n-gram's next round would have started (past the accepted tokens and the target's one), on the text
before it, and is checked at once, up to `SHADOW_REPLAY` lookups a round. Looked up once per round, a cascade's
rounds of a dozen tokens sampled the text one point per round, where the lookup's own rounds are many one-token
rounds on text it cannot copy and one per copied span: on code editing the n-gram's chains were priced at half again
the tokens per round their own rounds commit, and the planner left the cascade for them.

Confidence-stopped drafts: a model level with `Level.confidence` > 0 ends a row's draft after a token it is unsure
of, so it often drafts fewer tokens than the round asked for. A `StopObserver` (the planner) gets the target's
verification of such drafts as `on_drafted(level, lower, draft_lens, accepted, asked)` instead of `on_verify`, with
the tokens each row was asked for (`Verified.asked`): how far the drafts go is a measurement of its own (what the
level's calls and the target's verification cost), and a short draft accepted whole ended the round there. An n-gram
level that caps a draft by its match's length (`NgramConfig.max_spec_factor`) reaches it the same way.

One token past the ask: a round measures its drafts' acceptance only up to the K it asked for, and the planner
prices a longer K from the deepest position measured. For an n-gram level that estimate is the wrong one: at the last
position of a short K, the drafts that stop there by their match-length cap (failures all, since the round ends
with them) sit beside copies that would have gone on, so the planner held K short and cut long copies into many
rounds. A lookup costs nothing to consult again, and the target's bonus token is what it would have said of one
more draft token: where a row's lookup draft filled its ask and was accepted whole, the feed looks the lookup's
next token up and reports the row as a round asking one token more would have measured it (`on_drafted`: that
token accepted if it equals the bonus token; a failure past the draft where the lookup had no next token), for at
most `SHADOW_LOOKUPS` rows a call. Each K measures K + 1, so a K held short learns whether the next one pays.

The round's own time: `CascadeEngine.step` reports the seconds each round spent outside its workers' calls (the
coordinator's lookups, drafts, syncs, commits and this feed) with the levels that drafted for the target (() for
plain decoding), to a `HostObserver` (the planner) as `on_host(drafting, batch, seconds)`; `specray.policy.host`.
Not a round of a kind that none of the `HOST_RECENT` rounds before it ran (`PlannerFeed.hosted`): the first round
of a kind after others costs a multiple of a steady one, and while one plan is held a probe of another kind is only
ever such a round, so a median of a few of them priced the kind at that multiple for as long as the plan held (plain
decoding held at one request, where the n-gram's lookups cost a fraction of what their probes took). A few rounds
back, not one: the scheduler runs the groups of a tick (per-request plans, a probe's rows) one after another, and
kinds that alternate so are each steady.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specray.coordinator.state import Level, Plan, Seq

if TYPE_CHECKING:
    from specray.engine.protocol import VerifyResult
    from specray.spec.tree import DraftTree

__all__ = ["SHADOW_LOOKUPS", "SHADOW_REPLAY", "CatchUpObserver", "Hears", "HostObserver", "NativeObserver",
           "Observer", "PlannerFeed", "ShadowObserver", "StopObserver", "TreeObserver", "TreeProposeObserver",
           "TreeWalk", "Verified", "fed_lengths", "tree_walk"]

#: at most this many rows of a round start a shadow lookup (an n-gram scan of the row's text each): a sample of the
#: batch measures the same acceptance, and the coordinator's work per round stays bounded at large batches
SHADOW_LOOKUPS = 4
#: at most this many lookups in all per round replay the lookup's rounds over the tokens the round committed
#: (`PlannerFeed.shadowed`); past them, a row's next lookup drafts from the end of the round's text
SHADOW_REPLAY = 16
#: a round's own time is reported when one of this many rounds before it ran the same kind (`PlannerFeed.hosted`)
HOST_RECENT = 4


class Observer(Protocol):
    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None: ...

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None: ...


@runtime_checkable
class NativeObserver(Protocol):
    def on_native(self, level: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None: ...


@runtime_checkable
class ShadowObserver(Protocol):
    def on_shadow(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                  asked: int, latest: Sequence[bool] | None = None) -> None: ...


@runtime_checkable
class CatchUpObserver(Protocol):
    """Gets the calls that also caught rows up on earlier text (`caught` tokens in all; a level's first call on a
    request, or one that sat out rounds): kind and tokens as `on_call`'s, for the call's own work."""

    def on_catch_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None: ...


@runtime_checkable
class HostObserver(Protocol):
    """Gets each round's own time outside the workers' calls (`CascadeEngine.step`): the levels that drafted for the
    target (() plain decoding), the batch, and the seconds (`specray.policy.host`)."""

    def on_host(self, drafting: tuple[int, ...], batch: int, seconds: float) -> None: ...


@runtime_checkable
class StopObserver(Protocol):
    """Gets the target's verification of a confidence-stopped level's drafts (module docstring): `asked`, the
    tokens each row was asked for; a row that drafted fewer stopped by itself."""

    def on_drafted(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                   asked: Sequence[int]) -> None: ...


@runtime_checkable
class TreeProposeObserver(Protocol):
    def on_propose_tree(self, level: int, batch: int, depth: int, width: int, nodes: int, seconds: float) -> None: ...


@dataclass(frozen=True)
class TreeWalk:
    """One row's tree verification as the planner's acceptance model reads it: `nodes` drafted; `reach`, the
    depths at which the walk down the accepted path met a node with children (a trial at each; the accepted path
    is `accepted` long, so reach is accepted + 1 where the walk stopped at a node with children, else accepted);
    `spine`, the length of the path through every node's first child (the chain a chain drafter proposes), and
    `spine_accepted`, how much of it a chain verification would have accepted (the walk follows the first child
    exactly as long as a chain's tokens are accepted: the same token, or the same first random number)."""

    nodes: int
    reach: int
    accepted: int
    spine: int
    spine_accepted: int
    #: the tree's depth (its longest path): a model drafter's trees are as deep as asked, whatever their nodes
    depth: int = 0


def tree_walk(tree: DraftTree | None, emitted: Sequence[int], accepted: int) -> TreeWalk:
    """Replay a verified tree's accepted path (`emitted`: its tokens, then the final token) over its nodes."""
    if tree is None or not tree.num_nodes:
        return TreeWalk(0, 0, 0, 0, 0)
    root = -1  # `specray.spec.tree.ROOT` (that module imports torch; this one does not)
    at, path = root, []
    for d in range(accepted):
        kid = next((c for c in tree.children(at) if tree.token_ids[c] == emitted[d]), None)
        if kid is None:  # cannot happen for a result of this tree; count what matched
            break
        path.append(kid)
        at = kid
    reach = len(path) + (1 if tree.children(at) else 0)
    spine, at = [], root
    while tree.children(at):
        at = tree.children(at)[0]
        spine.append(at)
    same = 0
    while same < min(len(path), len(spine)) and path[same] == spine[same]:
        same += 1
    return TreeWalk(tree.num_nodes, reach, len(path), len(spine), same, tree.max_depth)


@runtime_checkable
class TreeObserver(Protocol):
    def on_tree(self, level: int, lower: int, width: int, walks: Sequence[TreeWalk]) -> None: ...


@dataclass(frozen=True)
class Verified:
    """One verify call: `level` scored `drafts` (from `lower`; None for plain decoding) in `seconds`. A tree
    verification (`VerifyResult.tree_nodes`) gives each row's longest root-to-leaf path as its draft: the planner
    sees a tree round as a chain as deep as the tree whose accepted count is the accepted path's length (the call
    is timed by the nodes it fed)."""

    level: int
    lower: int | None
    drafts: Sequence[Sequence[int]]
    result: VerifyResult
    seconds: float
    #: a hybrid round: the level that drafted each row (None: `lower` drafted every row)
    drafters: Sequence[int] | None = None
    #: False: the call also caught a row up on much earlier text (a prefill-sized forward): not a step's time
    timed: bool = True
    #: a tree verification: each row's tree (`drafts` then holds each tree's longest path) and the width the
    #: drafter was asked for (`Plan.tree`)
    trees: Sequence[DraftTree | None] | None = None
    width: int = 1
    #: tokens of earlier text the call caught its rows up on, in all (an untimed call: `CatchUpObserver`)
    caught_up: int = 0
    #: the draft tokens each row was asked for, where the round knows it (the target's verification of a chain)
    asked: Sequence[int] | None = None
    #: the rows verified, before they commit (a lookup's next token past a draft: "One token past the ask")
    rows: Sequence[Seq] | None = None


def fed_lengths(res: VerifyResult, drafts: Sequence[Sequence[int]]) -> list[int]:
    """Draft tokens verified per row: the given draft (a tree: its nodes, `VerifyResult.tree_nodes`), or for a row
    without one the verifier's own native speculation (`VerifyResult.native_drafts`)."""
    if res.tree_nodes is not None:
        return [int(n) for n in res.tree_nodes]
    native = res.native_drafts
    if native is None:
        return [len(d) for d in drafts]
    return [len(d) if d else int(n) for d, n in zip(drafts, native)]


@dataclass(frozen=True)
class Hears:
    """The optional events one observer takes, read from its hooks once (`PlannerFeed.listening`): a protocol
    check per event and observer cost a round as much as the planner's own bookkeeping of that event."""

    native: bool
    shadow: bool
    catch_up: bool
    host: bool
    stop: bool
    tree: bool
    tree_propose: bool

    @staticmethod
    def of(ob: object) -> Hears:
        return Hears(isinstance(ob, NativeObserver), isinstance(ob, ShadowObserver), isinstance(ob, CatchUpObserver),
                     isinstance(ob, HostObserver), isinstance(ob, StopObserver), isinstance(ob, TreeObserver),
                     isinstance(ob, TreeProposeObserver))


class PlannerFeed:
    """Turns the round's calls into observer events. Costs nothing when nobody listens."""

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = list(levels)
        #: who listens; callers append to it (or replace an entry): `listening` sees the change
        self.observers: list[Observer] = []
        self._heard: list[tuple[Observer, Hears]] = []
        first = self.levels[0]
        #: the n-gram level 0 that shadow lookups consult (None: level 0 is a model or a suffix level)
        self._lookup = first.ngram if len(self.levels) > 1 and first.ngram is not None else None
        #: most lookups a round's shadow replay makes over all its rows (`shadowed`): a bound on the coordinator's
        #: work per round, which on a GPU step is a share of the step
        self.replay = SHADOW_REPLAY
        #: the drafting levels of the latest rounds `hosted` was told of
        self._kinds: deque[tuple[int, ...]] = deque(maxlen=HOST_RECENT)

    def listening(self) -> list[tuple[Observer, Hears]]:
        """Each observer with the events it takes, classified once per list of observers (by identity)."""
        obs, heard = self.observers, self._heard
        if len(heard) != len(obs) or any(ob is not known for ob, (known, _) in zip(obs, heard)):
            self._heard = heard = [(ob, Hears.of(ob)) for ob in obs]
        return heard

    def shadowed(self, rows: Sequence[Seq], plan: Plan) -> None:
        """After a round over `rows` (its tokens committed): check each row's pending shadow draft against the text
        committed since it, and replay the lookup's rounds over the rest of that text: a lookup where the n-gram's
        next round would have started (after the accepted tokens and the target's own), checked at once where the
        text after it is committed, until a draft runs past the committed text (pending) or `replay` lookups were
        made this round (module docstring). A round in which the target verified the n-gram's own drafts measures
        it directly: its rows' shadows are dropped."""
        if self._lookup is None:
            return
        shadows = [ob for ob, hears in self.listening() if hears.shadow]
        if not shadows:
            return
        if len(plan.levels) > 1 and plan.k[-1] > 0 and (plan.hybrid or plan.levels[-2] == 0):
            for s in rows:
                s.shadow = None
            return
        asked = max(1, self.levels[0].k)
        lens: list[int] = []
        accepted: list[int] = []
        latest: list[bool] = []
        replayed = rows_looked = 0
        for s in rows:
            whole: bool | None = None  # the row's latest resolved draft accepted whole (None: none resolved)
            at = len(s.tokens)  # where the row's next lookup drafts from
            if s.shadow is not None:
                if s.shadow[1]:
                    whole, at = self._resolve(s, lens, accepted)
                elif s.shadow[0] <= len(s.tokens) or s.finished:  # a lookup due at a position now committed
                    at, s.shadow = s.shadow[0], None
            if s.shadow is None and not s.finished and s.remaining > 1 and rows_looked < SHADOW_LOOKUPS:
                rows_looked += 1
                text = s.lookup_text()
                while True:
                    if at > len(s.tokens):  # the lookup's next round starts after a token not yet committed
                        s.shadow = (at, [])
                        break
                    if at < len(s.tokens) and replayed >= self.replay:
                        at = len(s.tokens)  # out of lookups: the next one drafts from the end of the round's text
                    end = at == len(s.tokens)
                    replayed += not end
                    draft = self._lookup.propose_text(text, asked, upto=at)
                    if not draft:  # no match: a round that would have emitted one token
                        lens.append(0)
                        accepted.append(0)
                        whole, at = False, at + 1
                        continue
                    s.shadow = (at, list(draft))
                    if end:  # open: nothing committed after it yet
                        break
                    got, at = self._resolve(s, lens, accepted)
                    if got is None:  # runs past the committed text: open
                        break
                    whole = got
            if whole is not None:
                latest.append(whole)
        if lens:
            for ob in shadows:
                ob.on_shadow(len(self.levels) - 1, 0, lens, accepted, asked, latest)

    @staticmethod
    def _resolve(s: Seq, lens: list[int], accepted: list[int]) -> tuple[bool | None, int]:
        """Check row `s`'s pending shadow draft against its committed text: (whether the draft was accepted whole,
        None while it is still open; where the lookup's next round would draft from). A resolved draft is appended
        to `lens` / `accepted` and cleared."""
        assert s.shadow is not None
        start, draft = s.shadow
        after = s.tokens[start:start + len(draft)]
        n = 0
        while n < len(after) and after[n] == draft[n]:
            n += 1
        if n < len(after) or n == len(draft):  # a token differs, or the whole draft was committed
            lens.append(len(draft))
            accepted.append(n)
            s.shadow = None
            # the round would have committed the n accepted tokens and the target's next one
            return n == len(draft), start + n + 1
        if s.finished:  # ended inside the draft: nothing to say about the rest
            s.shadow = None
        return None, len(s.tokens)

    def hosted(self, plan: Plan, batch: int, seconds: float) -> None:
        """A round of `plan` over `batch` rows spent `seconds` outside its workers' calls (`HostObserver`), told only
        if one of the rounds just before it drafted with the same levels (module docstring)."""
        steady = plan.drafting in self._kinds
        self._kinds.append(plan.drafting)
        if not steady:
            return
        for ob, hears in self.listening():
            if hears.host:
                ob.on_host(plan.drafting, batch, seconds)

    def proposed(self, level: int, batch: int, steps: int, seconds: float) -> None:
        for ob in self.observers:
            ob.on_call(level, "propose", batch, steps, seconds)

    def caught_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None:
        """An untimed call that caught its rows up on `caught` tokens of earlier text (`CatchUpObserver`)."""
        if caught <= 0:
            return
        for ob, hears in self.listening():
            if hears.catch_up:
                ob.on_catch_up(level, kind, batch, tokens, caught, seconds)

    def proposed_tree(self, level: int, batch: int, depth: int, width: int, nodes: int, seconds: float) -> None:
        """A timed tree proposal of a model level: `depth` forwards (the deepest row's), `width` children per node,
        at most `nodes` nodes per row."""
        for ob, hears in self.listening():
            if hears.tree_propose:
                ob.on_propose_tree(level, batch, depth, width, nodes, seconds)
            else:
                ob.on_call(level, "propose", batch, depth, seconds)

    def verified(self, ev: Verified) -> None:
        if not self.observers:
            return
        res, drafts = ev.result, ev.drafts
        fed = fed_lengths(res, drafts)
        tokens = max(fed, default=0) + 1
        # rows without a draft that the verifier speculated on by itself (a native target); on a target without
        # speculation of its own (live decoding) such a row is the drafter finding nothing, which counts against
        # its acceptance like on any other target
        own = res.native_drafts is not None and bool(self.levels[ev.level].native_k)
        nat = {b for b, d in enumerate(drafts) if not d} if own else set()
        cold = res.native_cold or [False] * len(drafts)
        warm = [b for b in sorted(nat) if not cold[b]]
        # a call made only of engine steps runs the engine's own (cheaper) path: timed apart
        kind = "native" if res.stepped or (nat and len(nat) == len(drafts)) else "verify"
        rows = [b for b in range(len(drafts)) if b not in nat]  # rows that verified a given draft
        # a stepped call in which a row's engine request started ran that row's prefill: its time says nothing
        # about a decode step (it would price plain decoding at a prefill's cost), so it is not timed
        timed = ev.timed and not (res.stepped and any(cold))
        if not timed:
            self.caught_up(ev.level, kind, len(drafts), tokens, ev.caught_up, ev.seconds)
        walks = None
        listening = self.listening()
        past = (self._one_more(ev, rows) if ev.drafters is None and ev.trees is None
                and any(hears.stop for _, hears in listening) else None)
        for ob, hears in listening:
            if timed:
                ob.on_call(ev.level, kind, len(drafts), tokens, ev.seconds)
            if ev.trees is not None and ev.lower is not None and hears.tree:
                if walks is None:
                    walks = [tree_walk(t, res.token_ids[b], res.num_accepted[b]) for b, t in enumerate(ev.trees)]
                ob.on_tree(ev.level, ev.lower, ev.width, walks)
            elif ev.drafters is not None and rows:
                self._hybrid(ob, ev, rows)
            elif ev.lower is not None and rows:
                lens, acc = [len(drafts[b]) for b in rows], [res.num_accepted[b] for b in rows]
                if past is not None and hears.stop:
                    ob.on_drafted(ev.level, ev.lower, *past)
                elif ev.asked is not None and self.levels[ev.lower].stops_drafts and hears.stop:
                    ob.on_drafted(ev.level, ev.lower, lens, acc, [ev.asked[b] for b in rows])
                else:
                    ob.on_verify(ev.level, ev.lower, lens, acc)
            if warm and hears.native:
                ob.on_native(ev.level, [fed[b] for b in warm], [res.num_accepted[b] for b in warm])

    def _one_more(self, ev: Verified, rows: Sequence[int]) -> tuple[list[int], list[int], list[int]] | None:
        """(draft lengths, accepted, asked) of the n-gram level 0's drafts verified by `ev`, a row whose draft filled
        its ask and was accepted whole extended by the lookup's next token (module docstring, "One token past the
        ask"); None where `ev` is not such a verification."""
        if self._lookup is None or ev.lower != 0 or ev.asked is None or ev.rows is None:
            return None
        res, lens, acc, asked = ev.result, [], [], []
        looked = 0
        for b in rows:
            draft = ev.drafts[b]
            n, a, w = len(draft), res.num_accepted[b], ev.asked[b]
            emitted = res.token_ids[b]
            if 0 < n == w <= a and len(emitted) > n and looked < SHADOW_LOOKUPS:
                looked += 1
                more = self._lookup.propose_text(ev.rows[b].lookup_text(), n + 1)
                if more[:n] == list(draft):  # the same match (the search does not depend on K)
                    w += 1
                    if len(more) > n:
                        a += int(more[n] == emitted[n])
                        n += 1
            lens.append(n)
            acc.append(a)
            asked.append(w)
        return lens, acc, asked

    def _hybrid(self, ob: Observer, ev: Verified, rows: Sequence[int]) -> None:
        """A hybrid round's acceptance, per drafter: the lookup level over every row, a row that took the model's
        draft counting as the lookup finding nothing (as in a round of the lookup alone: its match rate and its
        acceptance over all rows stay measured the same way), the model over its own rows."""
        res, drafts, who = ev.result, ev.drafts, ev.drafters
        look = 0  # a lookup level is only ever the first level
        mine = [who[b] == look for b in rows]
        ob.on_verify(ev.level, look, [len(drafts[b]) if m else 0 for b, m in zip(rows, mine)],
                     [res.num_accepted[b] if m else 0 for b, m in zip(rows, mine)])
        for j in dict.fromkeys(who[b] for b in rows if who[b] != look):
            own = [b for b in rows if who[b] == j]
            ob.on_verify(ev.level, j, [len(drafts[b]) for b in own], [res.num_accepted[b] for b in own])
