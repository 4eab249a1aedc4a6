"""Relayed verification: a cascade's middle level sends its drafts straight to the target's actor.

Without it, a round of a cascade whose levels are actors waits for the middle level's drafts and then asks the
target to verify them: the drafts travel middle level -> coordinator -> target, and the coordinator's work between
the two calls (replaying the inner rounds, building the request) is on the round's critical path. With it:

    coordinator --RelayedVerifyCall(key, rows, syncs, method)--> target   (sent first; the target parks it)
    coordinator --NestedCall(..., relay=(target, key))--> middle level     (inner rounds with the level below)
    middle level --RelayedDrafts(key, drafts)--> target                    (one-way; the target verifies now)
    middle level --drafts + inner-round log--> coordinator                 (replayed while the target verifies)
    target --VerifyResult--> coordinator

Each round thus saves a transfer and the coordinator's work between the calls. The coordinator still gets the
drafts and the log from the middle level and commits and accounts for them as before. The two halves meet in
the target's actor (`Rendezvous`, keyed by the round): whichever arrives second runs the verification, and the
reply goes back on the coordinator's connection (`specray.serve.direct.Reply`, deferred).

Follow-ons (`NestedDraft.follow`): the target also sends its verdict on the middle level's rows straight to the
middle level (`Verdict`, before its reply to the coordinator), which drafts the next round on it
(specray.serve.follow), so the next round's inner rounds run while the verdict travels to the coordinator and the
coordinator commits and plans.

Failures: the middle level sends nothing if it or the level below failed; the coordinator, which sees that
failure, sends `RelayedDrafts.abort` on its own connection, and the target answers the parked half with
`RelayAborted` without touching its worker (its syncs unapplied: the coordinator restarts those rows there).
If the middle level could not reach the target, it says so (`NestedOutcome.relayed`) and the coordinator sends
the drafts itself. A dead target fails the coordinator's connection, as an unrelayed call would.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from specray.serve.direct import Reply
from specray.serve.wire import Endpoint, LevelRequest, RelayedDrafts, RelayedVerifyCall, Verdict

__all__ = ["RelayAborted", "Rendezvous"]

log = logging.getLogger(__name__)


class RelayAborted(RuntimeError):
    """The drafts of a relayed verification will never come; it was dropped without running."""


class Rendezvous:
    """Where the two halves of a relayed verification meet in the target's actor. `run` runs a whole
    `LevelRequest` on the worker (frees, then the call); `free` frees sequences alone (an aborted verification's
    request still carries the coordinator's frees). At most `capacity` halves wait unmatched (a coordinator
    or middle level that died leaves one behind); the oldest go first."""

    def __init__(self, run: Callable[[LevelRequest], Any], free: Callable[[tuple[str, ...]], None],
                 capacity: int = 256, forward: Callable[[Endpoint, Verdict], None] | None = None) -> None:
        self._run = run
        self._free = free
        self._forward = forward
        self._capacity = capacity
        self._lock = threading.Lock()
        self._parked: OrderedDict[str, tuple[LevelRequest, Reply]] = OrderedDict()
        self._arrived: OrderedDict[str, RelayedDrafts] = OrderedDict()

    def verify(self, request: LevelRequest, reply: Reply) -> Any:
        """The coordinator's half (`request.call` a `RelayedVerifyCall`): run it if its drafts are here, else
        park it and defer the reply (returns None then)."""
        call = request.call
        assert isinstance(call, RelayedVerifyCall)
        with self._lock:
            drafts = self._arrived.pop(call.key, None)
            if drafts is None:
                self._parked[call.key] = (request, reply.defer())
                _trim(self._parked, self._capacity)
                return None
        return self._complete(request, drafts)

    def drafts(self, drafts: RelayedDrafts) -> None:
        """The drafts (or an abort): run the parked half they complete and reply to it, or keep them for it."""
        with self._lock:
            parked = self._parked.pop(drafts.key, None)
            if parked is None:
                self._arrived[drafts.key] = drafts
                _trim(self._arrived, self._capacity)
                return
        request, reply = parked
        try:
            reply.send(self._complete(request, drafts))
        except Exception as exc:  # the verification failed (or was aborted): the coordinator raises it
            reply.fail(exc)

    def waiting(self) -> tuple[int, int]:
        """Unmatched halves: parked verifications, drafts that came first."""
        with self._lock:
            return len(self._parked), len(self._arrived)

    def _complete(self, request: LevelRequest, drafts: RelayedDrafts) -> Any:
        if drafts.abort is not None:
            self._free(request.frees)
            raise RelayAborted(f"the relayed drafts will not come: {drafts.abort}")
        call = request.call
        assert isinstance(call, RelayedVerifyCall)
        res = self._run(LevelRequest(request.frees, call.with_drafts(drafts)))
        if call.forward is not None and self._forward is not None:  # before the reply: the next round starts there
            try:
                self._forward(call.forward, Verdict(call.key, [list(res.token_ids[b]) for b in call.fill]))
            except Exception as exc:  # the middle level then drafts when the coordinator asks, as without it
                log.debug("forwarding the verdict to %s failed: %s", call.forward, exc)
        return res


def _trim(d: OrderedDict[str, Any], capacity: int) -> None:
    while len(d) > capacity:
        d.popitem(last=False)
