"""Relayed verification (`specray.serve.relay`): the two halves meet in the target's actor whichever comes first,
an abort drops the verification unrun but still frees what the coordinator finished, and unmatched halves stay
bounded. Over real actors: tests/ray/test_actors.py."""

from __future__ import annotations

import threading

import pytest
import torch

from specray.serve.relay import RelayAborted, Rendezvous
from specray.serve.wire import LevelRequest, RelayedDrafts, RelayedVerifyCall, VerifyCall
from specray.spec.params import VerifyMethod


class FakeReply:
    def __init__(self) -> None:
        self.deferred = False
        self.sent: list[object] = []
        self.failed: list[BaseException] = []
        self.done = threading.Event()

    def defer(self):
        self.deferred = True
        return self

    def send(self, value) -> None:
        self.sent.append(value)
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.failed.append(exc)
        self.done.set()


def _setup():
    ran: list[LevelRequest] = []
    freed: list[tuple[str, ...]] = []

    def run(request: LevelRequest):
        ran.append(request)
        return ("verdict", request.call.draft_ids)

    return Rendezvous(run, freed.append, capacity=3), ran, freed


def _half(key: str, method=VerifyMethod.GREEDY, frees=("old",)) -> LevelRequest:
    call = RelayedVerifyCall(key, ["a", "b", "c"], [None] * 3, method, 2, [(5, ()), (3, ()), (0, (1, 2))], fill=[0, 2])
    return LevelRequest(frees, call)


def test_the_verification_runs_when_its_second_half_comes_whichever_it_is():
    rv, ran, _ = _setup()
    # the coordinator's half first: parked, reply deferred, then run by the drafts' arrival
    reply = FakeReply()
    assert rv.verify(_half("k1"), reply) is None and reply.deferred
    rv.drafts(RelayedDrafts("k1", [[7, 8], [9]]))
    assert reply.sent == [("verdict", [[7, 8], [], [9]])]  # row 1 got no draft (not in fill)
    assert ran[0].frees == ("old",) and isinstance(ran[0].call, VerifyCall) and ran[0].call.level == 2
    # the drafts first: kept, and the coordinator's half runs at once
    rv.drafts(RelayedDrafts("k2", [[1], [2, 3]]))
    reply = FakeReply()
    assert rv.verify(_half("k2"), reply) == ("verdict", [[1], [], [2, 3]]) and not reply.deferred
    assert rv.waiting() == (0, 0)


def test_rejection_probabilities_are_scattered_to_the_rows_that_have_drafts():
    rv, ran, _ = _setup()
    q = torch.rand(2, 2, 5)  # [len(fill), K, V]
    rv.drafts(RelayedDrafts("k", [[1, 2], [3]], q))
    rv.verify(_half("k", VerifyMethod.REJECTION), FakeReply())
    probs = ran[0].call.draft_probs
    assert probs.shape == (3, 2, 5)
    assert torch.equal(probs[0], q[0]) and torch.equal(probs[2], q[1]) and not probs[1].any()


def test_an_abort_drops_the_verification_unrun_and_still_frees():
    rv, ran, freed = _setup()
    reply = FakeReply()
    rv.verify(_half("k", frees=("done-1", "done-2")), reply)
    rv.drafts(RelayedDrafts("k", [], None, abort="the middle level failed"))
    assert not ran and not reply.sent
    assert isinstance(reply.failed[0], RelayAborted) and "the middle level failed" in str(reply.failed[0])
    assert freed == [("done-1", "done-2")]
    # an abort that comes first: the half fails at once
    rv.drafts(RelayedDrafts("k2", [], None, abort="gone"))
    with pytest.raises(RelayAborted):
        rv.verify(_half("k2"), FakeReply())
    assert not ran


def test_a_failing_verification_reaches_the_waiting_coordinator():
    def run(request):
        raise KeyError("unknown sequence 'a'")

    rv = Rendezvous(run, lambda frees: None)
    reply = FakeReply()
    rv.verify(_half("k"), reply)
    rv.drafts(RelayedDrafts("k", [[1], [2]]))
    assert isinstance(reply.failed[0], KeyError)


def test_unmatched_halves_stay_bounded():
    rv, _, _ = _setup()
    for i in range(10):
        rv.verify(_half(f"p{i}"), FakeReply())
        rv.drafts(RelayedDrafts(f"d{i}", [[1], [2]]))
    assert rv.waiting() == (3, 3)  # the oldest went first
    reply = FakeReply()
    rv.verify(_half("d9"), reply)  # the newest drafts are still there
    assert not reply.deferred


def test_a_relayed_half_refuses_to_run_without_the_direct_transport():
    with pytest.raises(ValueError, match="direct transport"):
        _half("k").call.run(None, None)
