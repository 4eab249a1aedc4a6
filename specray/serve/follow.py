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
from specray.serve.wire import NestedCall, Verdict

__all__ = ["FollowOns"]

log = logging.getLogger(__name__)


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
        #: follow-ons drafted, handed to their request, dropped (another request came)
        self.drafted = self.used = self.dropped = 0

    def ran(self, call: NestedCall, draft: NestedDraft, outcome: NestedOutcome) -> None:
        """`call` (its draft resolved: `draft`) ran and will be relayed under its key: its verdict may come."""
        if call.relay is None or draft.follow is None:
            return
        with self._lock:
            self._last = (call.relay[1], call, draft, outcome)

    def verdict(self, v: Verdict) -> None:
        """The target's verdict on the last relayed round: draft the next round now, in the calling thread (the
        transport's thread for the target's connection, idle until the next verdict)."""
        with self._lock:
            last = self._last
            if last is None or last[0] != v.key:  # another request came first, or a late verdict of an older round
                return
            self._last = None
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
            self._last = None
            pending, self._pending = self._pending, None
            if pending is None:
                return None
            same = (call is not None and draft is not None and not call.low_frees
                    and call.low_at == pending.call.low_at and call.poll == pending.call.poll
                    and replace(draft, follow=None) == replace(pending.draft, follow=None))
            if same and not pending.finished and call is not None and draft is not None and call.relay is not None:
                pending.relay_to = (call, draft)  # the drafting thread relays its drafts the moment they are made
            elif not same:
                pending.cancel.set()  # its inner rounds end with the one under way
        pending.done.wait()
        if not same:
            self.dropped += 1
            return None
        self.used += 1
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None
        return pending.outcome, pending.relayed

    def stats(self) -> dict[str, int]:
        return {"drafted": self.drafted, "used": self.used, "dropped": self.dropped}
