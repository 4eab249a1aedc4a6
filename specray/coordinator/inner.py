"""A middle level's inner rounds, as one loop both sides of the wire run.

A middle level of a cascade makes its draft for the level above by inner rounds: the level below it proposes,
it verifies, and what it emitted (accepted tokens plus one correction or bonus token) extends the draft, until
each row has what was asked (`inner_rounds`). The coordinator runs the loop over its `LevelCalls`
(`specray.coordinator.drafting`), one call per level per inner round. Where the levels are separate processes,
the middle level can run the same loop beside its model (`run_nested`): the coordinator sends one `NestedDraft`,
the middle level calls the level below directly, and the coordinator gets the drafts with a log of every inner
round (`NestedOutcome`), which it replays into its mirrors, statistics and planner feed as if it had made the
calls itself. A round then costs the coordinator one hop to the middle level instead of two per inner round.

Nothing here imports Ray or torch at module level; the transport is the caller's (`Nesting`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

from specray.engine.protocol import DraftProposal, SeqSync, VerifyResult
from specray.spec.ngram import NgramConfig, TokenText
from specray.spec.params import SamplingParams, VerifyMethod

if TYPE_CHECKING:
    import torch

    from specray.engine.protocol import Worker
    from specray.spec.tree import DraftTree

__all__ = ["FollowOn", "InnerLog", "LookupHolder", "NestedDraft", "NestedOutcome", "Nesting", "PendingVerify",
           "follow_on", "inner_rounds", "run_nested"]

#: (rows of this inner round, each row's draft so far, tokens asked of the level below per row) -> its drafts
Propose = Callable[[list[int], list[list[int]], list[int]], DraftProposal]
#: (rows, each row's draft so far, the level below's drafts) -> the middle level's verdict
Verify = Callable[[list[int], list[list[int]], DraftProposal], VerifyResult]


@dataclass
class InnerLog:
    """One inner round: rows `idx` (of the request) verified `drafts` (from the level below) with `result`;
    `propose_s` 0 and `steps` 0 when the level below was not called. `trees`: the level below drafted a token
    tree per row (`drafts[j]` then holds its nodes, `result.tree_nodes` their count), verified as a tree."""

    idx: list[int]
    drafts: list[list[int]]
    result: VerifyResult
    verify_s: float
    propose_s: float = 0.0
    steps: int = 0
    trees: list[DraftTree | None] | None = None
    #: (most, total) tokens of a row's earlier text the call to the level below / to the middle level fed before
    #: its own work, and whether a row started there (its first forward at that level feeds its prompt): such a
    #: call is not a step's time (`specray.coordinator.calls.is_step`)
    low_caught: tuple[int, int, bool] = (0, 0, False)
    mid_caught: tuple[int, int, bool] = (0, 0, False)
    #: rows the level below was asked for tokens (the others, sent only for their syncs, ran no forward)
    asked: int = 0


def inner_rounds(
    want: Sequence[int], k_low: int, propose: Propose, verify: Verify, *, confidence: float = 0.0,
    need_probs: bool = False, vocab: int = 0, stop: Callable[[], Sequence[bool] | None] | None = None,
    on_round: Callable[[InnerLog], None] | None = None, always_propose_first: bool = False,
    min_share: float = 0.0,
) -> DraftProposal:
    """Inner rounds until row b has want[b] tokens or stopped: after a token the middle level gave a
    probability below `confidence` (the row keeps it and stops), or when `stop()` (checked after each inner
    round) marks the row. Each inner round asks the level below for up to k_low tokens, never more than the
    draft still needs minus the middle level's own correction or bonus token. `need_probs`: return the middle
    level's distributions of the draft tokens ([B, max(want), vocab]) for a rejection verifier above. A draft of
    the level below may be token trees (`DraftProposal.trees`, verified by `verify` as trees): the middle level
    emits the accepted path plus one token, as for a chain.
    `always_propose_first`: the first inner round calls the level below even if no row needs its tokens (its
    call carries the rows' syncs, see `run_nested`).
    `min_share`: after the first inner round, stop once fewer than this share of the rows still need tokens (the
    others keep the shorter drafts they have). On a GPU an inner round costs both levels a whole step whatever
    its rows, so a round for a few stragglers of a large batch costs more than their extra tokens are worth."""
    n = len(want)
    outs: list[list[int]] = [[] for _ in range(n)]
    prob_rows: list[list[torch.Tensor]] = [[] for _ in range(n)]
    stopped = [False] * n
    first = True
    while True:
        idx = [b for b in range(n) if len(outs[b]) < want[b] and not stopped[b]]
        if not idx or (not first and len(idx) < min_share * n):
            break
        sub_want = [max(0, min(k_low, want[b] - len(outs[b]) - 1)) for b in idx]
        sub_outs = [outs[b] for b in idx]
        t0 = time.perf_counter()
        if any(sub_want) or (first and always_propose_first):
            d = propose(idx, sub_outs, sub_want)
            propose_s, steps = time.perf_counter() - t0, max(sub_want, default=0)
        else:
            d, propose_s, steps = DraftProposal([[] for _ in idx]), 0.0, 0
        first = False
        t1 = time.perf_counter()
        res = verify(idx, sub_outs, d)
        log = InnerLog(idx, [list(x) for x in d.token_ids], res, time.perf_counter() - t1, propose_s, steps,
                       None if d.trees is None else list(d.trees), asked=sum(1 for w in sub_want if w > 0))
        for j, b in enumerate(idx):
            toks = res.token_ids[j]
            if res.confidence is not None and confidence > 0:  # keep up to the first unsure token, then stop
                unsure = next((m for m, c in enumerate(res.confidence[j]) if c < confidence), None)
                if unsure is not None:
                    toks, stopped[b] = toks[: unsure + 1], True
            outs[b].extend(toks)
            if res.probs is not None:
                prob_rows[b].append(res.probs[j, : len(toks)])
        if on_round is not None:
            on_round(log)
        marks = stop() if stop is not None else None
        if marks is not None:
            stopped = [x or bool(u) for x, u in zip(stopped, marks)]
    outs = [o[:w] for o, w in zip(outs, want)]
    probs = None
    if need_probs:
        import torch

        probs = torch.zeros(n, max(want, default=0), vocab)
        for b, chunks in enumerate(prob_rows):
            if chunks:
                cat = torch.cat(chunks)[: want[b]]
                probs[b, : cat.shape[0]] = cat
    return DraftProposal(outs, probs)


class FollowOn(NamedTuple):
    """What the next round will ask of a middle level whose drafts go straight to the target, if the plan holds
    and no row ends or joins: K of the target's draft, and each row's tokens left before this round
    (`Seq.remaining`). With it the middle level drafts the next round when the target's verdict reaches it
    (`follow_on`), instead of when the coordinator's next request does: the verdict's trip back to the
    coordinator, the coordinator's commit and plan, and its trip to the middle level leave the round's critical
    path."""

    k: int
    remaining: tuple[int, ...]
    #: each row's stop tokens (`Seq.stop_ids`): a row the verdict ended gets no follow-on, as it gets no request
    stops: tuple[tuple[int, ...], ...] = ()


@dataclass
class NestedDraft:
    """What the coordinator asks of a middle level that runs its inner rounds itself.

    Rows are the request's; `mid_syncs` / `low_syncs` bring the middle level and the level below in line with
    each row's context (the first call to each applies them: the first inner round always calls both); `method`:
    how the middle level verifies the level below; `mode`: how the level below drafts (`DraftMode`);
    `confidence`: the middle level's threshold (0: off); `stop_below`: the level below's."""

    mid: int
    low: int
    seq_ids: list[str]
    sampling: list[SamplingParams]
    mid_syncs: list[SeqSync]
    low_syncs: list[SeqSync]
    want: list[int]
    k_low: int
    method: VerifyMethod
    mode: str
    need_probs: bool
    confidence: float
    stop_below: float
    vocab: int
    min_share: float = 0.0  # `inner_rounds`
    #: the level below is this n-gram lookup, run beside the middle level's model (`LookupHolder`); `low_syncs`
    #: then bring the holder's copy of each row in line with its context
    lookup: NgramConfig | None = None
    #: per row, the tokens of its context that `mid_syncs` / `low_syncs` bring and that level's first forward over
    #: the row feeds before its own work (its catch-up, `InnerLog.mid_caught` / `low_caught`); empty: none
    mid_owed: list[int] = field(default_factory=list)
    low_owed: list[int] = field(default_factory=list)
    #: draft the next round on the target's verdict (`FollowOn`; a relayed round only); None: wait for the request
    follow: FollowOn | None = None


@dataclass
class NestedOutcome:
    """The drafts, and what the coordinator needs to account for the inner rounds it did not see: per row the
    tokens each level holds beyond the row's context after the request (`mid_held`, `low_held`), the inner
    rounds' log, and `low_error` if the level below failed (the drafts are then what was made before it; the
    coordinator drops that level and retries the round)."""

    drafts: DraftProposal
    mid_held: list[list[int]]
    low_held: list[list[int]]
    logs: list[InnerLog] = field(default_factory=list)
    low_error: BaseException | None = None
    #: the middle level sent the drafts on to the target itself (`Nesting.verify_later`)
    relayed: bool = False
    #: drafted on the target's verdict, before the request came (`follow_on`)
    followed: bool = False
    #: rows of the request that neither level took, drafts empty (rows that joined a follow-on's batch, left for
    #: the next follow-on: specray.serve.follow): the coordinator's next call starts them at both levels again
    unsynced: list[int] = field(default_factory=list)


def follow_on(call: NestedDraft, out: NestedOutcome, emitted: Sequence[Sequence[int]]) -> NestedDraft | None:
    """The request the coordinator sends after `call` (answered by `out`) if its plan holds and no row ends or
    joins, from the target's verdict: each row of `call` goes on from its context + `emitted` (the tokens the
    target committed to it), asking min(K, tokens left - 1) as a round does; each level is synced as the
    coordinator's mirror syncs it, keeping the longest prefix of what it holds that agrees with the new text and
    appending the rest. A level's text below that prefix is never touched, so if the coordinator asks for
    something else instead, its own syncs (which keep no more than that prefix) still hold. None: `call` asked
    for no follow-on, the level below failed, or no row needs a draft.

        context [5, 6], the middle level held [7, 8, 9] beyond it, the target emitted [7, 3]: the middle level's
        sync is (keep 3, append (3,)): it keeps [5, 6, 7] and drafts from [5, 6, 7, 3]."""
    f = call.follow
    if f is None or out.low_error is not None:
        return None
    rows = [b for b in range(len(call.seq_ids)) if min(f.k, f.remaining[b] - len(emitted[b]) - 1) > 0
            and not (f.stops and any(t in f.stops[b] for t in emitted[b]))]
    if not rows:
        return None

    mid_held = _Held.after(call.mid_syncs, out.mid_held, out.unsynced)
    low_held = _Held.after(call.low_syncs, out.low_held, out.unsynced)
    mid = [mid_held.sync(b, list(emitted[b])) for b in rows]
    low = [low_held.sync(b, list(emitted[b])) for b in rows]
    left = [f.remaining[b] - len(emitted[b]) for b in rows]
    return replace(call, seq_ids=[call.seq_ids[b] for b in rows], sampling=[call.sampling[b] for b in rows],
                   mid_syncs=mid, low_syncs=low, want=[min(f.k, n - 1) for n in left],
                   mid_owed=[len(y.append) for y in mid], low_owed=[len(y.append) for y in low],
                   follow=FollowOn(f.k, tuple(left), tuple(f.stops[b] for b in rows) if f.stops else ()))


class PendingVerify(Protocol):
    """The target's verification of a round, asked for before its drafts exist (`Nesting.verify_later`): the
    middle level sends them to the target itself, and the target's verdict comes back here."""

    def send_drafts(self, drafts: DraftProposal) -> None:
        """Send the drafts from here (the middle level could not: `NestedOutcome.relayed` is False)."""

    def result(self) -> VerifyResult:
        """Wait for the target's verdict (raises what the target's call raises)."""

    def abort(self, reason: str) -> None:
        """The drafts will never come: the target drops the verification; returns once it has (or failed)."""


class Nesting(Protocol):
    """A transport that lets a middle level run its inner rounds beside its model (`run_nested`). `low` None: the
    level below is an n-gram lookup (`NestedDraft.lookup`), which the middle level runs itself (`LookupHolder`).

    Relays: where the level drafting for the target can reach it (`relays`), the coordinator asks the target for
    the round's verification first (`verify_later`) and the drafting level sends it the drafts when it has them
    (a middle level when its inner rounds end: `draft(..., relay=)`; a first level after its `propose`): the
    drafts skip a trip through the coordinator."""

    def reaches(self, mid: Worker, low: Worker | None) -> bool:
        """Can the middle level's worker call the lower level's directly (or run the n-gram lookup itself)?"""

    def relays(self, drafter: Worker, target: Worker) -> bool:
        """Can the level right below the target send its drafts to the target directly?"""

    def follows(self, mid: Worker, target: Worker) -> bool:
        """Can the target send its verdict to the middle level, which then drafts the next round on it
        (`NestedDraft.follow`)?"""

    def verify_later(
        self, target: Worker, seq_ids: list[str], sampling: list[SamplingParams], method: VerifyMethod, *,
        level: int, sync: list[SeqSync], fill: list[int], forward: Worker | None = None,
    ) -> PendingVerify:
        """Ask `target` to verify the rows once their drafts arrive (`fill`: the rows that get drafts, in the
        order of the middle level's request); `forward`: it also sends the verdict on those rows to this middle
        level (a `NestedDraft.follow`)."""

    def propose(
        self, worker: Worker, relay: PendingVerify, seq_ids: list[str], k: list[int], sampling: list[SamplingParams],
        *, mode: str, level: int, sync: list[SeqSync], stop_below: float,
    ) -> tuple[DraftProposal, bool]:
        """`Worker.propose` at the level right below the target, which also sends the drafts to `relay`'s target;
        the drafts, and whether they were sent."""

    def draft(self, mid: Worker, low: Worker | None, call: NestedDraft,
              relay: PendingVerify | None = None) -> NestedOutcome:
        """Run `call` at the middle level (sending its drafts on to `relay`'s target); raises if the middle level
        itself fails."""


class LookupHolder:
    """The n-gram level of a cascade, held beside a middle level's model for nested drafting: it keeps each row's
    text, brought in line by the same `SeqSync`s a worker takes (the coordinator mirrors it), so a round sends
    only what is new instead of every row's whole context, and the n-gram drafts from it (`proposer`). One holder
    per middle level: its rows go when the level frees them."""

    def __init__(self) -> None:
        self.texts: dict[str, TokenText] = {}

    def free(self, seq_id: str) -> None:
        self.texts.pop(seq_id, None)

    def proposer(self, config: NgramConfig) -> Callable[..., DraftProposal]:
        """`propose` with this n-gram configuration (a worker's `propose` signature, for `run_nested`)."""

        def propose(seq_ids: list[str], k: list[int], sampling: list, *, mode: str, level: int,
                    sync: list[SeqSync], stop_below: float) -> DraftProposal:
            return self.propose(config, seq_ids, k, sync)

        return propose

    def propose(self, config: NgramConfig, seq_ids: list[str], k: list[int], sync: list[SeqSync]) -> DraftProposal:
        out = []
        for sid, kk, y in zip(seq_ids, k, sync):
            if y.keep == 0:
                text = self.texts[sid] = TokenText(y.append)
            else:
                try:
                    text = self.texts[sid]
                except KeyError:
                    raise KeyError(f"unknown sequence {sid!r} (the n-gram text beside this level)") from None
                text.truncate(y.keep)
                text.extend(y.append)
            draft = config.propose_text(text, kk) if kk > 0 else []
            text.extend(draft)  # held like a model drafter's own draft (`run_nested` syncs against it)
            out.append(draft)
        return DraftProposal(out)


class _Held:
    """What one level holds of each row beyond its context, so that the loop can send it minimal syncs."""

    def __init__(self, syncs: Sequence[SeqSync], owed: Sequence[int] = ()) -> None:
        self.start = [s.keep + len(s.append) for s in syncs]
        self.held: list[list[int]] = [[] for _ in syncs]
        self.first: list[SeqSync | None] = list(syncs)
        self.owed = list(owed) if owed else [0] * len(syncs)  # context tokens no forward of the level fed yet
        self.starting = [s.keep == 0 for s in syncs]  # rows the level starts (`SeqSync.start`) at their first forward

    @staticmethod
    def after(syncs: Sequence[SeqSync], held: Sequence[Sequence[int]], unsynced: Sequence[int] = ()) -> _Held:
        """What a level holds once a request with these syncs left it holding `held` beyond each row's context
        (the rows `unsynced` it never took: their syncs are still to apply)."""
        h, todo = _Held(syncs), set(unsynced)
        h.first = [syncs[b] if b in todo else None for b in range(len(syncs))]
        h.held = [list(x) for x in held]
        return h

    def feed(self, rows: Sequence[int]) -> tuple[int, int, bool]:
        """A forward over `rows` feeds what they owe: (most, total) tokens caught up, and whether it started one."""
        got = [self.owed[b] for b in rows]
        started = any(self.starting[b] for b in rows)
        for b in rows:
            self.owed[b] = 0
            self.starting[b] = False
        return max(got, default=0), sum(got), started

    def sync(self, b: int, target: list[int]) -> SeqSync:
        """Hold the row's context + `target`."""
        first = self.first[b]
        if first is not None:  # the coordinator's sync; the level holds its context after it
            self.first[b] = None
            self.held[b] = list(target)
            return SeqSync(first.keep, (*first.append, *target))
        held = self.held[b]
        c, lim = 0, min(len(held), len(target))
        while c < lim and held[c] == target[c]:
            c += 1
        self.held[b] = list(target)
        return SeqSync(self.start[b] + c, tuple(target[c:]))


def run_nested(call: NestedDraft, mid: Worker, propose_low: Callable[..., DraftProposal],
               cancel: Callable[[], bool] | None = None) -> NestedOutcome:
    """The middle level's side of a `NestedDraft`: inner rounds with `mid` (the level's own worker) verifying,
    and `propose_low(seq_ids, k, sampling, mode=, level=, sync=, stop_below=)` reaching the level below.
    A failure of the level below ends the loop (`NestedOutcome.low_error`); a failure of `mid` raises.
    `cancel()` true after an inner round ends the loop there (a follow-on nobody will take)."""
    mid_held, low_held = _Held(call.mid_syncs, call.mid_owed), _Held(call.low_syncs, call.low_owed)
    logs: list[InnerLog] = []
    failed: list[BaseException] = []
    caught: dict[str, tuple[int, int, bool]] = {}  # this inner round's catch-up per level, for its log

    def propose(idx: list[int], outs: list[list[int]], k: list[int]) -> DraftProposal:
        if failed:
            return DraftProposal([[] for _ in idx])
        syncs = [low_held.sync(b, o) for b, o in zip(idx, outs)]
        caught["low"] = low_held.feed([b for b, kk in zip(idx, k) if kk > 0])  # rows asked nothing run no forward
        try:
            d = propose_low([call.seq_ids[b] for b in idx], k, [call.sampling[b] for b in idx], mode=call.mode,
                            level=call.low, sync=syncs, stop_below=call.stop_below)
        except Exception as exc:  # the level below failed: stop drafting, report it with what was made
            if call.lookup is not None:  # a lookup beside this level cannot fail alone: this level lost its rows
                raise
            failed.append(exc)
            return DraftProposal([[] for _ in idx])
        for b, o, toks in zip(idx, outs, d.token_ids):
            low_held.held[b] = [*o, *toks]
        return d

    def verify(idx: list[int], outs: list[list[int]], d: DraftProposal) -> VerifyResult:
        syncs = [mid_held.sync(b, o) for b, o in zip(idx, outs)]
        caught["mid"] = mid_held.feed(idx)
        check = mid.verify if d.trees is None else mid.verify_tree
        res = check([call.seq_ids[b] for b in idx], d.token_ids if d.trees is None else d.trees, d.probs,
                    [call.sampling[b] for b in idx], call.method, level=call.mid, sync=syncs,
                    return_probs=call.need_probs, confidence=call.confidence > 0)
        for b, o, toks in zip(idx, outs, res.token_ids):
            mid_held.held[b] = [*o, *toks]
        return res

    def stop() -> list[bool] | None:
        return [True] * len(call.want) if failed or (cancel is not None and cancel()) else None

    def record(log: InnerLog) -> None:
        log.low_caught, log.mid_caught = caught.pop("low", (0, 0, False)), caught.pop("mid", (0, 0, False))
        logs.append(log)

    drafts = inner_rounds(call.want, call.k_low, propose, verify, confidence=call.confidence,
                          need_probs=call.need_probs, vocab=call.vocab, stop=stop, on_round=record,
                          always_propose_first=True, min_share=call.min_share)
    return NestedOutcome(drafts, mid_held.held, low_held.held, logs, failed[0] if failed else None)
