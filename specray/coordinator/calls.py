"""Every worker call of a round goes through `LevelCalls`: it brings the worker's copy of each sequence in line
(a `SeqSync`: keep n tokens, append the rest; rollback is a shorter keep; keep 0 starts a sequence the level has
not seen), makes one batched call, maps a failure to `LevelCallError` (the engine's failover acts on it), and
reports the call's timing to the planner feed (`propose_tree` / `verify_tree`: a level drafting token trees, a
target verifying them). One call per level per (inner) round, nothing else.

A row's context is always the sequence's canonical tokens plus a short `tail` (drafted tokens not committed
yet), so a sync compares and sends only what changed since the worker last agreed with the canonical text:
the coordinator's work per call grows with the batch, not with the sequences' lengths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specray.coordinator.failover import Failover, LevelCallError
from specray.coordinator.feed import PlannerFeed, Verified
from specray.coordinator.state import Level, Seq
from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult
from specray.spec.params import VerifyMethod
from specray.spec.tree import DraftTree

if TYPE_CHECKING:
    from specray.coordinator.inner import Nesting, PendingVerify

__all__ = ["LevelCalls", "Relayed", "catch_up_rows", "drafted_steps", "is_step", "longest_path", "spread"]

#: a call in which some row first catches up on more tokens than this (a level that sat out rounds) runs a
#: prefill-sized forward: its time says nothing about a step, so the planner is not fed it (`step_timed`)
UNTIMED_CATCH_UP = 16


def drafted_steps(lvl: Level, want: Sequence[int], drafts: Sequence[Sequence[int]]) -> int:
    """Forwards a model level's proposal ran: one per token of the longest draft asked for, or, for a level that
    stops at a token it is unsure of (`Level.confidence`), of the longest draft it made (its rows all stopped
    there). Timed as that many steps, its step cost is not diluted by the ones it never ran."""
    if lvl.stops_drafts:
        return max((len(d) for d in drafts), default=0)
    return max(want, default=0)


def catch_up_rows(syncs: Sequence[SeqSync], tails: Sequence[Sequence[int]]) -> list[int]:
    """Per row, the tokens of canonical text it appends before the call's own work (its context beyond `tails`)."""
    return [max(0, len(y.append) - len(t)) for y, t in zip(syncs, tails)]


def _catch_up(syncs: Sequence[SeqSync], tails: Sequence[Sequence[int]]) -> int:
    """The most tokens of canonical text any row had to append before the call's own work."""
    return max(catch_up_rows(syncs, tails), default=0)


def is_step(started: bool, most_caught: int) -> bool:
    """Whether a call's time is a step's, for the planner: no row starts in it (`SeqSync.start`: the call runs
    that row's prefill, and at a batch size the level has not run before it grows its cache, a call of several
    steps' time, which the step cost at that batch would keep) and none catches up on more than
    `UNTIMED_CATCH_UP` tokens (`most_caught`)."""
    return not started and most_caught <= UNTIMED_CATCH_UP


def step_timed(syncs: Sequence[SeqSync], tails: Sequence[Sequence[int]]) -> bool:
    """`is_step` for a call made with `syncs`."""
    return is_step(any(y.keep == 0 for y in syncs), _catch_up(syncs, tails))


def _caught_up(syncs: Sequence[SeqSync], tails: Sequence[Sequence[int]]) -> int:
    """The tokens of canonical text all rows appended before the call's own work (what a prefill-sized call fed)."""
    return sum(catch_up_rows(syncs, tails))


class LevelCalls:
    """Sync, call, map failures, time: the only place that talks to workers during a round."""

    def __init__(self, levels: Sequence[Level], failover: Failover, feed: PlannerFeed) -> None:
        self.levels = list(levels)
        self.failover = failover
        self.feed = feed
        self._busy = threading.local()  # seconds each thread spent inside worker calls (`busy`)

    def method(self, level: int, lower: int | None, override: VerifyMethod | None = None) -> VerifyMethod:
        """How `level` verifies drafts from `lower`: the request's override or the level's configured method;
        rejection over a deterministic drafter (the n-gram) is the deterministic method (q = delta_x). So is
        rejection at a level that verifies inside its engine's step (`WorkerCaps.engine_verify`): its drafter
        then drafts greedily, and only token ids reach the engine (its rejection sampler takes no q)."""
        method = override if override is not None else self.levels[level].method
        if method is VerifyMethod.REJECTION and lower is not None and (
                self.levels[lower].is_ngram or self.levels[level].engine_verify > 0):
            return VerifyMethod.DETERMINISTIC
        return method

    def propose(
        self, i: int, upper: int, rows: Sequence[Seq], tails: Sequence[Sequence[int]], want: Sequence[int],
        override: VerifyMethod | None, relay: Relayed | None = None,
    ) -> DraftProposal:
        """Model level `i` drafts want[b] tokens beyond each row's context, for level `upper`, in one call.
        `relay`: it also sends them to the target for that verification (`verify_later`; sent from here if it
        could not), for every row of the call (`Drafter` relays only the rows asked for tokens).

        A row asked for nothing is not sent: a worker runs no forward for it and would only hold its new text
        until its next call, whose first forward would feed that text too. Sent then, the text is that call's
        catch-up, and a call that caught a row up on a prompt is never timed as a step."""
        asked = [b for b, w in enumerate(want) if w > 0]
        if relay is None and len(asked) < len(rows):
            if not asked:
                return DraftProposal([[] for _ in rows])
            sub = self.propose(i, upper, [rows[b] for b in asked], [tails[b] for b in asked],
                               [want[b] for b in asked], override)
            return spread(sub, asked, len(rows))
        lvl = self.levels[i]
        syncs = [self.sync(i, s, t) for s, t in zip(rows, tails)]
        mode = DraftMode.for_method(self.method(upper, i, override))
        t0 = time.perf_counter()
        args = ([s.seq_id for s in rows], list(want), [s.sampling for s in rows])
        kwargs = {"mode": mode, "level": i, "sync": syncs, "stop_below": lvl.confidence}
        if relay is None:
            prop = self.call(i, lvl.worker.propose, *args, **kwargs)
        else:
            prop, sent = self.call(i, relay.via.propose, lvl.worker, relay.pending, *args, **kwargs)
            relay.drafted(prop, sent)
        seconds = time.perf_counter() - t0
        steps = drafted_steps(lvl, want, prop.token_ids)
        if step_timed(syncs, tails):
            self.feed.proposed(i, len(rows), steps, seconds)
        else:
            self.feed.caught_up(i, "propose", len(rows), steps, _caught_up(syncs, tails), seconds)
        for s, toks in zip(rows, prop.token_ids):
            s.mirror[i].extend(toks)
        return prop

    def propose_tree(
        self, i: int, upper: int, rows: Sequence[Seq], depth: Sequence[int], width: int, max_nodes: Sequence[int],
        override: VerifyMethod | None,
    ) -> DraftProposal:
        """Model level `i` (with `WorkerCaps.tree_propose`) drafts a token tree per row beyond its text, for level
        `upper`, in one call (`Worker.propose_tree`). The worker appends nothing, so neither does its mirror: the
        next sync brings the accepted path, whose KV the worker keeps."""
        asked = [b for b, d in enumerate(depth) if d > 0]  # as `propose`: a row asked for nothing is not sent
        if len(asked) < len(rows):
            if not asked:
                return DraftProposal([[] for _ in rows], trees=[None] * len(rows))
            sub = self.propose_tree(i, upper, [rows[b] for b in asked], [depth[b] for b in asked], width,
                                    [max_nodes[b] for b in asked], override)
            return spread(sub, asked, len(rows))
        lvl = self.levels[i]
        syncs = [self.sync(i, s, ()) for s in rows]
        mode = DraftMode.for_method(self.method(upper, i, override))
        t0 = time.perf_counter()
        prop = self.call(i, lvl.worker.propose_tree, [s.seq_id for s in rows], list(depth),
                         [s.sampling for s in rows], mode=mode, level=i, sync=syncs, width=width,
                         max_nodes=list(max_nodes))
        if step_timed(syncs, [()] * len(rows)):
            self.feed.proposed_tree(i, len(rows), max(depth, default=0), width, max(max_nodes, default=0),
                                    time.perf_counter() - t0)
        return prop

    def verify(
        self, i: int, lower: int | None, rows: Sequence[Seq], tails: Sequence[Sequence[int]],
        drafts: Sequence[Sequence[int]], probs: torch.Tensor | None,  # probs: [B, K, V] (rejection only)
        override: VerifyMethod | None, return_probs: bool = False, confidence: bool = False,
        drafters: Sequence[int] | None = None, asked: Sequence[int] | None = None,
    ) -> VerifyResult:
        """Level `i` verifies each row's draft (from `lower`; None: plain decoding) in one call. `drafters`: a
        hybrid round's drafter of each row (for the planner feed; `lower` sets the method); `asked`: the draft
        tokens each row was asked for (for the planner feed, `Verified.asked`)."""
        worker = self.levels[i].worker
        syncs = [self.sync(i, s, t) for s, t in zip(rows, tails)]
        method = self.method(i, lower, override)
        t0 = time.perf_counter()
        res = self.call(i, worker.verify, [s.seq_id for s in rows], drafts,
                        probs if method is VerifyMethod.REJECTION else None, [s.sampling for s in rows], method,
                        level=i, sync=syncs, return_probs=return_probs, confidence=confidence)
        seconds = time.perf_counter() - t0
        for s, toks in zip(rows, res.token_ids):
            s.mirror[i].extend(toks)
        self.feed.verified(Verified(i, lower, drafts, res, seconds, drafters,
                                    timed=step_timed(syncs, tails),
                                    caught_up=_caught_up(syncs, tails), asked=asked, rows=rows))
        return res

    def verify_later(
        self, i: int, lower: int, rows: Sequence[Seq], override: VerifyMethod | None, fill: list[int],
        nesting: Nesting, forward: bool = False,
    ) -> Relayed:
        """Ask level `i` (the target) to verify the rows once the middle level `lower` sends it their drafts
        (`fill`: the rows that get drafts, in the middle level's order); finished by `finish_relayed`, or
        `abandon`ed. `forward`: the target also sends its verdict to `lower` (`NestedDraft.follow`)."""
        worker = self.levels[i].worker
        syncs = [self.sync(i, s, ()) for s in rows]
        method = self.method(i, lower, override)
        pending = self.call(i, nesting.verify_later, worker, [s.seq_id for s in rows], [s.sampling for s in rows],
                            method, level=i, sync=syncs, fill=fill,
                            forward=self.levels[lower].worker if forward else None)
        return Relayed(pending, nesting, step_timed(syncs, [()] * len(rows)))

    def finish_relayed(
        self, i: int, lower: int, rows: Sequence[Seq], relayed: Relayed, drafts: Sequence[Sequence[int]],
        asked: Sequence[int] | None = None,
    ) -> VerifyResult:
        """The target's verdict on a relayed verification (`verify_later`), accounted like `verify`'s. Its time
        for the planner runs from the middle level's reply to the verdict: about the target's call, which began
        when the drafts reached it, just before that reply."""
        res = self.call(i, relayed.pending.result)
        seconds = time.perf_counter() - relayed.since
        for s, toks in zip(rows, res.token_ids):
            s.mirror[i].extend(toks)
        self.feed.verified(Verified(i, lower, drafts, res, seconds, None, timed=relayed.timed, asked=asked))
        return res

    def abandon(self, i: int, rows: Sequence[Seq], relayed: Relayed, reason: str) -> None:
        """A relayed verification whose drafts will not come: the target drops it, and each row starts again
        at its next call there (the target may or may not have applied the verification's syncs)."""
        try:
            relayed.pending.abort(reason)
        finally:
            for s in rows:
                s.epoch[i] = -1  # never a level's epoch: `holds` is False, the next sync restarts the row

    def verify_tree(
        self, i: int, lower: int | None, rows: Sequence[Seq], trees: Sequence[DraftTree | None],
        probs: torch.Tensor | None,  # [B, N + 1, V] (rejection only)
        override: VerifyMethod | None, *, tails: Sequence[Sequence[int]] | None = None, width: int = 1,
        return_probs: bool = False, confidence: bool = False,
    ) -> VerifyResult:
        """Level `i` (with `WorkerCaps.tree_verify`) verifies a draft tree per row (from `lower`, drafted `width`
        children per node) beyond each row's context (its tokens + tails[b]: a middle level's inner round) in one
        call; like `verify`, the worker then holds the emitted tokens (the accepted path plus the final token),
        and so does its mirror here."""
        worker = self.levels[i].worker
        tails = tails if tails is not None else [()] * len(rows)
        syncs = [self.sync(i, s, t) for s, t in zip(rows, tails)]
        method = self.method(i, lower, override)
        t0 = time.perf_counter()
        res = self.call(i, worker.verify_tree, [s.seq_id for s in rows], list(trees),
                        probs if method is VerifyMethod.REJECTION else None, [s.sampling for s in rows], method,
                        level=i, sync=syncs, return_probs=return_probs, confidence=confidence)
        seconds = time.perf_counter() - t0
        for s, toks in zip(rows, res.token_ids):
            s.mirror[i].extend(toks)
        chains = [longest_path(t) for t in trees]
        self.feed.verified(Verified(i, lower, chains, res, seconds, timed=step_timed(syncs, tails),
                                    trees=list(trees), width=width, caught_up=_caught_up(syncs, tails)))
        return res

    def uncovered(self, i: int, rows: Sequence[Seq]) -> int:
        """The tokens of committed text level `i` lacks over `rows`, counting the rows that lack more than
        `UNTIMED_CATCH_UP` (its next call catches each of them up in a prefill-sized forward); the rest is a
        round's ordinary work."""
        total = 0
        for s in rows:
            n = len(s.tokens) - (self._kept(i, s) if self.holds(i, s) else 0)
            if n > UNTIMED_CATCH_UP:
                total += n
        return total

    @staticmethod
    def _kept(i: int, s: Seq) -> int:
        """How much of `s.tokens` level `i` holds: the agreed length, and as far beyond it as its mirror matches
        (the drafts it made that were accepted since)."""
        mirror, base = s.mirror[i], s.tokens
        keep, lim = s.agreed.get(i, 0), min(len(mirror), len(base))
        while keep < lim and mirror[keep] == base[keep]:
            keep += 1
        return keep

    def sync(self, i: int, s: Seq, tail: Sequence[int]) -> SeqSync:
        """What level `i` must do to hold `s.tokens + tail`; updates the mirror of what it holds."""
        return self._sync(i, self.failover.epoch[i], s, tail)

    def lookup_sync(self, mid: int, s: Seq, tail: Sequence[int]) -> SeqSync:
        """`sync` for the n-gram text held beside middle level `mid` (`LookupHolder`, nested drafting): mirrored
        under the key -1 - mid, and started again whenever that level is (its epoch)."""
        return self._sync(-1 - mid, self.failover.epoch[mid], s, tail)

    def holds(self, i: int, s: Seq, epoch: int | None = None) -> bool:
        """Whether level `i` (or the mirror key `i` with the level's `epoch`) has started `s` since it last
        (re)started: else its next call starts the sequence with its whole text."""
        return s.mirror.get(i) is not None and s.epoch.get(i) == (self.failover.epoch[i] if epoch is None else epoch)

    def _sync(self, i: int, epoch: int, s: Seq, tail: Sequence[int]) -> SeqSync:
        if not self.holds(i, s, epoch):
            # new to the level, or the level failed since (it may or may not still hold the sequence): keep 0
            # (`SeqSync.start`) makes the call itself (re)start the sequence with its whole text
            s.mirror[i] = []
            s.agreed[i] = 0
            s.epoch[i] = epoch
        mirror = s.mirror[i]
        base = s.tokens
        n, m = len(base), len(mirror)
        keep = self._kept(i, s)
        if keep == n:  # the worker holds the whole canonical text: compare the tail
            j = 0
            while keep < m and j < len(tail) and mirror[keep] == tail[j]:
                keep += 1
                j += 1
            append = list(tail[j:])
        else:
            append = base[keep:]
            append.extend(tail)
        del mirror[keep:]
        mirror.extend(append)
        s.agreed[i] = n
        return SeqSync(keep, tuple(append))

    def call(self, i: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except LevelCallError:
            raise
        except Exception as exc:
            raise LevelCallError(i, self.levels[i].name, exc) from exc
        finally:
            self._busy.seconds = self.busy() + time.perf_counter() - t0

    def busy(self) -> float:
        """Seconds the calling thread has spent inside worker calls (`call`) so far: a round's wall time less what
        this grew by is the coordinator's own work (`CascadeEngine.step`)."""
        return getattr(self._busy, "seconds", 0.0)

    def release(self, s: Seq) -> None:
        """Free the sequence on every level that has seen it (idempotent; a dead level lost it anyway). A suffix
        level keeps its output for later requests."""
        for lvl in self.levels:
            if lvl.suffix is not None:
                lvl.suffix.release(s.seq_id, s.tokens, s.prompt_len)
        for i in list(s.mirror):
            worker = self.levels[i].worker if i >= 0 else None  # < 0: a lookup's text, freed with its level
            if worker is not None:
                _free_quietly(worker, s.seq_id)
            del s.mirror[i]


@dataclass
class Relayed:
    """A target's verification in flight whose drafts the level below sends it (`LevelCalls.verify_later`), over
    the transport `via`. `timed`: no row catches up on a long text in it (the planner is fed its time); `since`:
    when the drafting level's reply came (`drafted`)."""

    pending: PendingVerify
    via: Nesting
    timed: bool
    since: float = 0.0

    def drafted(self, drafts: DraftProposal, sent: bool) -> None:
        """The drafting level replied with `drafts`: sent on to the target by it, or (it could not) from here."""
        self.since = time.perf_counter()
        if not sent:
            self.pending.send_drafts(drafts)


def spread(prop: DraftProposal, idx: Sequence[int], n: int) -> DraftProposal:
    """A proposal for the rows `idx` of n, as one for all n (no draft for the others; their q rows zero)."""
    out = DraftProposal([[] for _ in range(n)], None, None if prop.trees is None else [None] * n)
    for j, b in enumerate(idx):
        out.token_ids[b] = prop.token_ids[j]
        if out.trees is not None and prop.trees is not None:
            out.trees[b] = prop.trees[j]
    if prop.probs is not None:
        out.probs = prop.probs.new_zeros(n, *prop.probs.shape[1:])
        out.probs[list(idx)] = prop.probs
    return out


def longest_path(tree: DraftTree | None) -> list[int]:
    """The tokens of a tree's longest root-to-leaf path (the first of equal length): the chain it stands for in
    the planner's acceptance model."""
    if tree is None or not tree.num_nodes:
        return []
    return [tree.token_ids[j] for j in max(tree.paths(), key=len)]


def _free_quietly(worker: Any, seq_id: str) -> None:
    try:
        worker.free(seq_id)
    except Exception:
        pass
