"""A cascade's middle level drafts the next round on the target's verdict (`NestedDraft.follow`).

Without it, a relayed round's verdict goes to the coordinator, which commits it, plans the next round and sends
the middle level its next request; only then do the next round's inner rounds start. With it:

    round n     coordinator --NestedCall(follow)--> middle level --RelayedDrafts--> target
                target --Verdict--> middle level                   (one-way, before its reply to the coordinator)
                middle level: `follow_on` -> the request the coordinator will send if the plan holds; its inner
                rounds run now, with the level below (a row the verdict ended by a stop token gets none)
                target --VerifyResult--> coordinator: commit, plan, next request
    round n+1   coordinator --NestedCall--> middle level: the request it drafted for -> that outcome (its drafts
                relayed on under the new key the moment they are made); any other request cancels the follow-on
                (its inner rounds stop at the next boundary), then runs as sent

so the verdict's trip to the coordinator, the coordinator's work between rounds and its trip to the middle level
overlap the next round's drafting instead of preceding it.

Exact: drafts are only proposals, whoever asks for them. A follow-on syncs each level keeping only the prefix of
its text that agrees with the committed text, which is no less than the coordinator's own next sync keeps
(`specray.coordinator.calls.LevelCalls.sync` keeps at most the agreeing prefix of what it mirrors, and it
mirrors what the middle level reported), so whatever the coordinator asks next, its syncs still bring both levels
to the right text: a dropped follow-on only cost the levels' time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from specray.coordinator.inner import NestedDraft, NestedOutcome, follow_on
from specray.engine.protocol import DraftProposal
from specray.serve.wire import NestedCall, Verdict

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
    callable it is given says so), without relaying its drafts."""

    def __init__(self, run: Callable[[NestedCall, Callable[[], bool]], NestedOutcome],
                 relay: Callable[[NestedCall, NestedOutcome], NestedOutcome]) -> None:
        self._run = run
        self._relay = relay  # sends an outcome's drafts on to the target under the call's key
        self._lock = threading.Lock()
        self._last: tuple[str, NestedCall, NestedDraft, NestedOutcome] | None = None
        self._pending: _Pending | None = None
        self._heard = threading.Event()  # the verdict on `_last` came, or will not be waited for
        self._heard.set()
        #: follow-ons drafted, handed to their request (`joins`: of those, to a request with rows that joined since,
        #: drafted then), dropped (another request came)
        self.drafted = self.used = self.dropped = self.joins = 0

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
        with self._lock:
            last = self._last
            if last is None or last[0] != v.key:  # another request came first, or a late verdict of an older round
                return
            self._last = None
            self._heard.set()
            _, call, draft, out = last
            nxt = follow_on(draft, out, v.token_ids)
            if nxt is None:
                return
            n = len(nxt.seq_ids)
            ahead = NestedCall(nxt, [None] * n, [None] * n, call.low_at, (), poll=call.poll)
            pending = self._pending = _Pending(nxt, ahead)
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
        """Before any request touches the worker: a follow-on drafted for exactly this nested request (`draft`:
        its draft with the sampling resolved) is its outcome, with whether its drafts were relayed already (and
        the request remembered for its verdict: `ran`); raises the level's error if drafting it failed. Any
        other request drops it, after it finished. None: the request runs as sent."""
        with self._lock:
            heard = self._heard if self._last is not None else None
        if heard is not None and call is not None:  # its verdict may be a moment behind it
            heard.wait(VERDICT_WAIT_S)
        with self._lock:
            self._last = None
            self._heard.set()
            pending, self._pending = self._pending, None
            if pending is None:
                return None
            joined = _joined(call, draft, pending)
            if joined == [] and call is not None and call.low_frees:
                joined = None  # only the request's own first call below carries its frees there: run it as sent
            whole = joined == []
            if whole and not pending.finished and call is not None and draft is not None and call.relay is not None:
                pending.relay_to = (call, draft)  # the drafting thread relays its drafts the moment they are made
            elif joined is None:
                pending.cancel.set()  # its inner rounds end with the one under way
        pending.done.wait()
        if joined is None:
            self.dropped += 1
            return None
        self.used += 1
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None and call is not None and draft is not None
        if whole:
            return pending.outcome, pending.relayed
        # rows joined: draft only those now (the first call below carries the request's frees there)
        self.joins += 1
        rest = NestedCall(_rows(draft, joined), [call.mid_sampling[j] for j in joined],
                          [call.low_sampling[j] for j in joined], call.low_at, call.low_frees, poll=call.poll)
        taken = [j for j in range(len(draft.seq_ids)) if j not in set(joined)]
        return merged(len(draft.seq_ids), [(taken, pending.outcome), (joined, self._run(rest, _never))]), False

    def stats(self) -> dict[str, int]:
        return {"drafted": self.drafted, "used": self.used, "dropped": self.dropped, "joins": self.joins}


def _never() -> bool:
    return False


#: the per-row fields of a `NestedDraft` (the rest are the request's, the same for every row)
_ROW_FIELDS = ("seq_ids", "sampling", "mid_syncs", "low_syncs", "want", "mid_owed", "low_owed")


def _rows(draft: NestedDraft, rows: list[int]) -> NestedDraft:
    """The request restricted to `rows` (no follow-on of its own: the outcome is merged into the request's)."""
    return replace(draft, follow=None, **{f: [getattr(draft, f)[j] for j in rows] for f in _ROW_FIELDS})


def _joined(call: NestedCall | None, draft: NestedDraft | None, pending: _Pending) -> list[int] | None:
    """The request's rows that the follow-on did not draft (rows that joined since: [] for exactly the request
    drafted for), or None if the request differs otherwise (another plan; a drafted row absent or asked
    something else) and the follow-on is of no use to it (logged at debug level, with why)."""
    if call is None or draft is None:
        return None
    why = _differs(call, draft, pending)
    if why is not None:
        log.debug("follow-on dropped: %s", why)
        return None
    drafted = set(pending.draft.seq_ids)
    return [j for j, sid in enumerate(draft.seq_ids) if sid not in drafted]


def _differs(call: NestedCall, draft: NestedDraft, pending: _Pending) -> str | None:
    """How the request differs from the follow-on other than by rows that joined (None: it does not)."""
    if call.low_at != pending.call.low_at or call.poll != pending.call.poll:
        return "another level below"
    ahead = pending.draft
    if replace(_rows(draft, []), follow=None) != replace(_rows(ahead, []), follow=None):
        return "another plan or method"
    where = {sid: j for j, sid in enumerate(draft.seq_ids)}
    if len(where) != len(draft.seq_ids) or any(sid not in where for sid in ahead.seq_ids):
        return "a drafted row is not in the request"
    for f in _ROW_FIELDS:
        mine, drafted_for = getattr(draft, f), getattr(ahead, f)
        if bool(mine) != bool(drafted_for) or (
                mine and any(mine[where[sid]] != drafted_for[p] for p, sid in enumerate(ahead.seq_ids))):
            return f"a drafted row asks another {f}"
    return None


def merged(n: int, parts: list[tuple[list[int], NestedOutcome]]) -> NestedOutcome:
    """One request's outcome from the outcomes of disjoint sets of its rows (each part: the request's index of each
    of its rows, in its order): drafts, held tokens and q per row; the inner rounds' logs of every part, their rows
    renumbered as the request's; the first failure of the level below."""
    ids: list[list[int]] = [[] for _ in range(n)]
    mid: list[list[int]] = [[] for _ in range(n)]
    low: list[list[int]] = [[] for _ in range(n)]
    logs = []
    probs = None
    for rows, out in parts:
        for j, b in enumerate(rows):
            ids[b], mid[b], low[b] = list(out.drafts.token_ids[j]), out.mid_held[j], out.low_held[j]
        logs += [replace(log, idx=[rows[j] for j in log.idx]) for log in out.logs]
        q = out.drafts.probs  # [len(rows), K, V]
        if q is not None and rows:
            width = max(q.shape[1], *(p.shape[1] for _, o in parts if (p := o.drafts.probs) is not None))
            if probs is None:
                probs = q.new_zeros(n, width, q.shape[-1])  # [B, K, V]
            probs[rows, : q.shape[1]] = q
    error = next((out.low_error for _, out in parts if out.low_error is not None), None)
    return NestedOutcome(DraftProposal(ids, probs), mid, low, logs, error, followed=True)
