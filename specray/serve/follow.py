"""A cascade's middle level drafts the next round on the target's verdict (`NestedDraft.follow`).

Without it, a relayed round's verdict goes to the coordinator, which commits it, plans the next round and sends
the middle level its next request; only then do the next round's inner rounds start. With it:

    round n     coordinator --NestedCall(follow)--> middle level --RelayedDrafts--> target
                target --Verdict--> middle level                   (one-way, before its reply to the coordinator)
                middle level: `follow_on` -> the request the coordinator will send if the plan holds; its inner
                rounds run now, with the level below (a row the verdict ended by a stop token gets none)
                target --VerifyResult--> coordinator: commit, plan, next request
    round n+1   coordinator --NestedCall--> middle level: the request it drafted for -> that outcome (its drafts
                relayed on under the new key the moment they are made); a row that joined since, new to both
                levels, gets no draft this round and joins the next follow-on (one they hold is drafted beside
                it), rows the request lacks (the coordinator ended them) are left out of it; a request that differs
                otherwise (another plan, another level below, a row asking something else) cancels the follow-on
                (its inner rounds stop at the next boundary), then runs as sent

so the verdict's trip to the coordinator, the coordinator's work between rounds and its trip to the middle level
overlap the next round's drafting instead of preceding it.

Exact: drafts are only proposals, whoever asks for them. A follow-on syncs each level keeping only the prefix of
its text that agrees with the committed text, which is no less than the coordinator's own next sync keeps
(`specray.coordinator.calls.LevelCalls.sync` keeps at most the agreeing prefix of what it mirrors, and it
mirrors what the middle level reported), so whatever the coordinator asks next, its syncs still bring both levels
to the right text: a dropped follow-on only cost the levels' time.

Frees: a request carries the sequences the coordinator finished since its last call to the level below
(`NestedCall.low_frees`), freed there with the first call the request makes below. A request that takes a
follow-on whole makes none, so its frees are owed: they go with the next call this level makes below (the next
follow-on's first inner round, usually the same round's verdict later), or on their own (`Frees`) when none
follows (the verdict ended every row, or the next request is not a nested one). Sequence ids are never reused while
a coordinator runs, so a free that comes a round late only holds the level's memory a round longer; if this level
dies owing frees, the coordinator sends again what its last requests carried (`ActorWorker.nested`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from specray.coordinator.inner import InnerLog, NestedDraft, NestedOutcome, follow_on
from specray.engine.protocol import DraftProposal
from specray.serve.wire import Endpoint, Frees, NestedCall, Verdict

__all__ = ["FollowOns", "merged"]

log = logging.getLogger(__name__)

#: a request that comes while the verdict it follows is still on its way (the target sends it before its reply to
#: the coordinator, but another thread of this actor reads it) waits this long for it
VERDICT_WAIT_S = 0.005


class _Pending:
    """A follow-on being drafted: its request (`draft`, resolved), and its outcome or error once `done`.
    `relay_to`: the request it was drafted for came first, and its drafts go on to the target under that
    request's key as soon as they are made, from the drafting thread (`relayed` then)."""

    def __init__(self, draft: NestedDraft, call: NestedCall) -> None:
        self.draft = draft
        self.call = call
        self.done = threading.Event()
        self.cancel = threading.Event()  # another request came: stop after the inner round under way
        self.finished = False  # the drafting is over (under `FollowOns._lock`)
        self.relay_to: tuple[NestedCall, NestedDraft] | None = None
        self.relayed = False
        self.outcome: NestedOutcome | None = None
        self.error: BaseException | None = None


class FollowOns:
    """The middle level's side: remembers the last nested request that asked for a follow-on (`ran`), drafts the
    next one when its verdict comes (`verdict`), and hands it to the request it was drafted for (`claim`). `run`
    runs a nested call on the level's worker (holding the worker's lock; ending its inner rounds early once the
    callable it is given says so), without relaying its drafts; `post` sends a one-way message to a level below
    (the frees owed there)."""

    def __init__(self, run: Callable[[NestedCall, Callable[[], bool]], NestedOutcome],
                 relay: Callable[[NestedCall, NestedOutcome], NestedOutcome],
                 post: Callable[[Endpoint, Frees], None] | None = None) -> None:
        self._run = run
        self._relay = relay  # sends an outcome's drafts on to the target under the call's key
        self._post = post
        self._lock = threading.Lock()
        self._last: tuple[str, NestedCall, NestedDraft, NestedOutcome] | None = None
        self._pending: _Pending | None = None
        self._heard = threading.Event()  # the verdict on `_last` came, or will not be waited for
        self._heard.set()
        #: per level below: frees that requests taking a follow-on carried there (module docstring, "Frees")
        self._owed: dict[Endpoint, list[str]] = {}
        #: follow-ons drafted, handed to their request (`joins`: of those, to a request with rows that joined since;
        #: `deferred`: such rows left for the next follow-on; `trims`: to a request that lacked some of their rows),
        #: dropped (another request came)
        self.drafted = self.used = self.dropped = self.joins = self.deferred = self.trims = 0

    @property
    def waiting(self) -> bool:
        """A follow-on is drafted or a verdict expected: the next request is compared with it (`claim`)."""
        return self._last is not None or self._pending is not None

    def ran(self, call: NestedCall, draft: NestedDraft, outcome: NestedOutcome) -> None:
        """`call` (its draft resolved: `draft`) ran and will be relayed under its key: its verdict may come."""
        if call.relay is None or draft.follow is None:
            return
        with self._lock:
            self._last = (call.relay[1], call, draft, outcome)
            self._heard = threading.Event()

    def verdict(self, v: Verdict) -> None:
        """The target's verdict on the last relayed round: draft the next round now, in the calling thread (the
        transport's thread for the target's connection, idle until the next verdict)."""
        loose: dict[Endpoint, list[str]] = {}
        with self._lock:
            last = self._last
            if last is None or last[0] != v.key:  # another request came first, or a late verdict of an older round
                return
            self._last = None
            self._heard.set()
            _, call, draft, out = last
            nxt = follow_on(draft, out, v.token_ids)
            if nxt is not None:
                new = {draft.seq_ids[b] for b in out.unsynced}  # their parameters go with their first calls
                sp = [x if sid in new else None for sid, x in zip(nxt.seq_ids, nxt.sampling)]
                ahead = NestedCall(nxt, sp, list(sp), call.low_at, self._carry(call.low_at, nxt.seq_ids),
                                   poll=call.poll)
                pending = self._pending = _Pending(nxt, ahead)
            elif call.low_at is not None and call.low_at in self._owed:  # no call below soon: what is owed there
                loose = {call.low_at: self._owed.pop(call.low_at)}       # goes on its own
        if nxt is None:
            self._send(loose)
            return
        try:
            pending.outcome = self._run(ahead, pending.cancel.is_set)
            pending.outcome.followed = True
            self.drafted += 1
        except BaseException as exc:  # kept for the request it was drafted for (the level's own failure)
            pending.error = exc
        try:
            with self._lock:
                pending.finished = True
                to = pending.relay_to
            if to is not None and pending.outcome is not None:  # its request is waiting: relay from here, at once
                self.ran(*to, pending.outcome)  # first: the verdict on these drafts may follow at once
                self._relay(to[0], pending.outcome)
                pending.relayed = True
        finally:
            pending.done.set()

    def claim(self, call: NestedCall | None, draft: NestedDraft | None) -> tuple[NestedOutcome, bool] | None:
        """Before any request touches the worker: a follow-on drafted for this nested request (`draft`: its draft
        with the sampling resolved) is its outcome, with whether its drafts were relayed already (and the request
        remembered for its verdict: `ran`); rows that joined since are drafted now or left for the next follow-on
        (`_Match.split`), rows the request lacks are left out; raises the level's error if drafting it failed. A
        request that differs otherwise drops it, after it finished. None: the request runs as sent (`sent`).
        `call` None: a request that is not a nested one."""
        with self._lock:
            heard = self._heard if self._last is not None else None
        if heard is not None and call is not None:  # its verdict may be a moment behind it
            heard.wait(VERDICT_WAIT_S)
        loose: dict[Endpoint, list[str]] = {}
        owed_below: tuple[str, ...] = ()
        now: list[int] = []
        later: list[int] = []
        exact = False
        with self._lock:
            self._last = None
            self._heard.set()
            pending, self._pending = self._pending, None
            if call is None and self._owed:  # no call below is coming from here: what is owed there goes on its own
                loose, self._owed = self._owed, {}
            match = None if pending is None else _match(call, draft, pending)
            if match is None:
                if pending is not None:
                    pending.cancel.set()  # its inner rounds end with the one under way
            else:
                assert pending is not None and call is not None and draft is not None
                now, later = match.split(draft)
                exact = match.exact(len(draft.seq_ids))
                if exact and not pending.finished and call.relay is not None:
                    pending.relay_to = (call, draft)  # the drafting thread relays its drafts as they are made
                if call.low_at is not None:
                    if now:  # the call for those rows goes below: it carries what is owed there too
                        owed_below = (*self._carry(call.low_at, draft.seq_ids), *call.low_frees)
                    elif call.low_frees:  # nothing of this request goes below: its frees there wait for what does
                        self._owed.setdefault(call.low_at, []).extend(call.low_frees)
        if pending is not None:
            pending.done.wait()
        self._send(loose)  # after the follow-on's calls below: they hold the connection there
        if pending is None:
            return None
        if match is None:
            self.dropped += 1
            return None
        self.used += 1
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None and call is not None and draft is not None
        if exact:
            return pending.outcome, pending.relayed
        self.trims += match.trimmed
        parts: list[tuple[list[int | None], NestedOutcome]] = [(match.where, pending.outcome)]
        if match.joined:
            self.joins += 1
            self.deferred += len(later)
        if now:  # draft only those now
            rest = NestedCall(_rows(draft, now), [call.mid_sampling[j] for j in now],
                              [call.low_sampling[j] for j in now], call.low_at, owed_below, poll=call.poll)
            parts.append((list(now), self._run(rest, _never)))
        if later:  # no drafts: the target's step gives them a token, and the next follow-on takes them in
            parts.append((list(later), NestedOutcome(DraftProposal([[] for _ in later]), [[] for _ in later],
                                                     [[] for _ in later])))
        out = merged(len(draft.seq_ids), parts)
        out.unsynced = later
        return out, False

    def sent(self, call: NestedCall) -> NestedCall:
        """The nested request as it runs when no follow-on serves it: with the frees owed at its level below."""
        if call.low_at is None:
            return call
        with self._lock:
            owed = self._carry(call.low_at, call.draft.seq_ids)
        return replace(call, low_frees=(*owed, *call.low_frees)) if owed else call

    def stats(self) -> dict[str, int]:
        with self._lock:  # the owed frees change in the transport's threads
            owed = sum(len(v) for v in self._owed.values())
        return {"drafted": self.drafted, "used": self.used, "dropped": self.dropped, "joins": self.joins,
                "deferred": self.deferred, "trims": self.trims, "owed_frees": owed}

    def _carry(self, at: Endpoint | None, rows: Sequence[str]) -> tuple[str, ...]:
        """The frees owed at the level below `at`, taken by a call about to go there over `rows` (under the lock):
        a row of the call itself is live again, never freed."""
        owed = self._owed.pop(at, None) if at is not None else None
        if not owed:
            return ()
        live = set(rows)
        return tuple(s for s in owed if s not in live)

    def _send(self, loose: dict[Endpoint, list[str]]) -> None:
        for at, ids in loose.items():
            if not ids or self._post is None:
                continue
            try:
                self._post(at, Frees(tuple(ids)))
            except Exception as exc:  # the level below is gone: so are its sequences
                log.debug("frees to %s not sent: %s", at, exc)


def _never() -> bool:
    return False


#: the per-row fields of a `NestedDraft` (the rest are the request's, the same for every row)
_ROW_FIELDS = ("seq_ids", "sampling", "mid_syncs", "low_syncs", "want", "mid_owed", "low_owed")


def _rows(draft: NestedDraft, rows: list[int]) -> NestedDraft:
    """The request restricted to `rows` (no follow-on of its own: the outcome is merged into the request's)."""
    return replace(draft, follow=None, **{f: [getattr(draft, f)[j] for j in rows] for f in _ROW_FIELDS})


def _starting(draft: NestedDraft, j: int) -> bool:
    """Row j of the request is new to both levels (each sync starts it: `SeqSync.keep` 0)."""
    return draft.mid_syncs[j].keep == 0 and draft.low_syncs[j].keep == 0


class _Match(NamedTuple):
    """How a request relates to the follow-on drafted for it: `where` each row of the follow-on is in the request
    (None: the request lacks it, the coordinator ended it), and the request's rows the follow-on did not draft
    (`joined`: rows that joined since)."""

    where: list[int | None]
    joined: list[int]

    @property
    def trimmed(self) -> bool:
        return any(w is None for w in self.where)

    def exact(self, rows: int) -> bool:
        """The follow-on drafted exactly the request's `rows` rows, in its order."""
        return not self.joined and self.where == list(range(rows))

    def split(self, draft: NestedDraft) -> tuple[list[int], list[int]]:
        """The joined rows to draft now, beside the follow-on (both levels hold them), and those that wait for the
        next follow-on (new to both levels: drafting them now would cost both levels inner rounds of their own
        after the follow-on's)."""
        later = [j for j in self.joined if _starting(draft, j)]
        return [j for j in self.joined if not _starting(draft, j)], later


def _match(call: NestedCall | None, draft: NestedDraft | None, pending: _Pending) -> _Match | None:
    """`_Match`, or None if the request differs otherwise (another plan or level below; a drafted row asked
    something else) or nothing the follow-on drafted is in it, and the follow-on is of no use to it (logged at
    debug level, with why)."""
    if call is None or draft is None:
        return None
    why = _differs(call, draft, pending)
    if why is not None:
        log.debug("follow-on dropped: %s", why)
        return None
    index = {sid: j for j, sid in enumerate(draft.seq_ids)}
    where = [index.get(sid) for sid in pending.draft.seq_ids]
    if all(w is None for w in where):
        log.debug("follow-on dropped: none of its rows is in the request")
        return None
    drafted = set(pending.draft.seq_ids)
    return _Match(where, [j for j, sid in enumerate(draft.seq_ids) if sid not in drafted])


def _differs(call: NestedCall, draft: NestedDraft, pending: _Pending) -> str | None:
    """How the request differs from the follow-on other than by rows that joined or left (None: it does not)."""
    if call.low_at != pending.call.low_at or call.poll != pending.call.poll:
        return "another level below"
    ahead = pending.draft
    if replace(_rows(draft, []), follow=None) != replace(_rows(ahead, []), follow=None):
        return "another plan or method"
    where = {sid: j for j, sid in enumerate(draft.seq_ids)}
    if len(where) != len(draft.seq_ids):
        return "a row twice in the request"
    both = [(p, where[sid]) for p, sid in enumerate(ahead.seq_ids) if sid in where]
    for f in _ROW_FIELDS:
        mine, drafted_for = getattr(draft, f), getattr(ahead, f)
        if bool(mine) != bool(drafted_for) or (mine and any(mine[j] != drafted_for[p] for p, j in both)):
            return f"a drafted row asks another {f}"
    return None


def merged(n: int, parts: list[tuple[list[int | None], NestedOutcome]]) -> NestedOutcome:
    """One request's outcome from the outcomes of disjoint sets of its rows (each part: the request's index of each
    of its rows, in its order; None for a row the request lacks, left out): drafts, held tokens and q per row; the
    inner rounds' logs of every part, their rows renumbered as the request's; the first failure of the level
    below."""
    ids: list[list[int]] = [[] for _ in range(n)]
    mid: list[list[int]] = [[] for _ in range(n)]
    low: list[list[int]] = [[] for _ in range(n)]
    logs = []
    probs = None
    for rows, out in parts:
        keep = [j for j, b in enumerate(rows) if b is not None]
        to = [rows[j] for j in keep]
        for j, b in zip(keep, to):
            ids[b], mid[b], low[b] = list(out.drafts.token_ids[j]), out.mid_held[j], out.low_held[j]
        for lg in out.logs:
            js = [m for m, i in enumerate(lg.idx) if rows[i] is not None]
            if js:
                lg = lg if len(js) == len(lg.idx) else _log_rows(lg, js)
                logs.append(replace(lg, idx=[rows[i] for i in lg.idx]))
        q = out.drafts.probs  # [len(rows), K, V]
        if q is not None and keep:
            width = max(q.shape[1], *(p.shape[1] for _, o in parts if (p := o.drafts.probs) is not None))
            if probs is None:
                probs = q.new_zeros(n, width, q.shape[-1])  # [B, K, V]
            probs[to, : q.shape[1]] = q[keep]
    error = next((out.low_error for _, out in parts if out.low_error is not None), None)
    return NestedOutcome(DraftProposal(ids, probs), mid, low, logs, error, followed=True)


def _log_rows(lg: InnerLog, js: list[int]) -> InnerLog:
    """An inner round's log restricted to its rows `js` (positions in `lg.idx`)."""
    def pick(v: list | None) -> list | None:
        return None if v is None else [v[j] for j in js]

    r = lg.result
    result = replace(r, token_ids=pick(r.token_ids), num_accepted=pick(r.num_accepted),
                     probs=None if r.probs is None else r.probs[js], native_drafts=pick(r.native_drafts),
                     native_cold=pick(r.native_cold), confidence=pick(r.confidence), logprobs=pick(r.logprobs),
                     tree_nodes=pick(r.tree_nodes))
    return replace(lg, idx=pick(lg.idx), drafts=pick(lg.drafts), result=result, trees=pick(lg.trees),
                   asked=min(lg.asked, len(js)))
