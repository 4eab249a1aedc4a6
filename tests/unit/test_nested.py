"""Nested drafting (`specray.coordinator.inner`): a middle level running its inner rounds beside its model gives
the same tokens, statistics and worker state as the coordinator making every call, and a failure of the level
below it fails over the same way. In-process here (`LocalNesting`); over Ray actors in tests/ray/test_actors.py."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.coordinator.inner import NestedDraft, NestedOutcome, run_nested
from specray.engine.protocol import Worker
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


class LocalNesting:
    """Runs the middle level's side in this process, as a level actor would."""

    def __init__(self) -> None:
        self.calls: list[NestedDraft] = []
        self.mid_verifies = 0  # the middle level's verifications made inside nested calls

    def reaches(self, mid: Worker, low: Worker) -> bool:
        return True

    def draft(self, mid: Worker, low: Worker, call: NestedDraft) -> NestedOutcome:
        self.calls.append(call)
        before = mid.verifies
        try:
            return run_nested(call, mid, low.propose)
        finally:
            self.mid_verifies += mid.verifies - before


class Counting(FakeWorker):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.verifies = 0
        self.dead = False

    def verify(self, *a, **kw):
        self.verifies += 1
        return super().verify(*a, **kw)

    def propose(self, *a, **kw):
        if self.dead:
            raise ConnectionError("gone")
        return super().propose(*a, **kw)

    def stats(self):
        if self.dead:
            raise ConnectionError("gone")
        return super().stats()


def levels(method: VerifyMethod, conf: float = 0.0) -> list[Level]:
    def mk(name: str, noise: float, seed: int) -> Counting:
        return Counting(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)

    return [Level("d1", worker=mk("d1", 1.0, 3), k=2),
            Level("d2", worker=mk("d2", 0.4, 4), k=5, method=method, confidence=conf),
            Level("t", worker=mk("t", 0.0, 0), method=method)]


def run(method: VerifyMethod, sampling, nesting, overlap="off", max_tokens=23, conf=0.0):
    lv = levels(method, conf)
    eng = CascadeEngine(lv, overlap=overlap != "off", nesting=nesting)
    eng.ahead_bounded = overlap == "bounded"
    batch = generate(eng, PROMPTS, max_tokens=max_tokens, sampling=sampling, ignore_eos=True)
    for x in lv:
        assert x.worker.stats().live_sequences == 0  # everything freed, on every level
    return batch, lv


SAMPLED = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.DETERMINISTIC, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
@pytest.mark.parametrize("overlap", ["off", "bounded", "unbounded"])
def test_nested_equals_the_coordinator_making_every_call(method, sampling, overlap):
    nest = LocalNesting()
    flat, _ = run(method, sampling, None, overlap)
    nested, lv = run(method, sampling, nest, overlap)
    assert [r.token_ids for r in nested.results] == [r.token_ids for r in flat.results]
    if overlap == "bounded":  # a bounded look-ahead is stopped between inner rounds from here: not nested
        return
    assert nest.calls
    if overlap != "off":  # how far the look-ahead got depends on timing: only the tokens are the same
        return
    assert {n: s.as_dict() for n, s in nested.stats.items()} == {n: s.as_dict() for n, s in flat.stats.items()}
    # every verification of the middle level ran inside a nested call: one per round at most from the coordinator
    assert nest.calls and lv[1].worker.verifies == nest.mid_verifies > len(nest.calls)
    assert len(nest.calls) <= max(r.rounds for r in nested.results)


def test_nested_with_confidence_and_short_rows_matches():
    """Rows that stop early (an unsure token) and rows near their length limit (a shorter want)."""
    flat, _ = run(VerifyMethod.GREEDY, None, None, max_tokens=7, conf=0.5)
    nested, _ = run(VerifyMethod.GREEDY, None, LocalNesting(), max_tokens=7, conf=0.5)
    assert [r.token_ids for r in nested.results] == [r.token_ids for r in flat.results]
    assert {n: s.as_dict() for n, s in nested.stats.items()} == {n: s.as_dict() for n, s in flat.stats.items()}


def test_a_failing_lower_level_inside_a_nested_call_is_dropped_and_taken_back():
    lv = levels(VerifyMethod.GREEDY)
    eng = CascadeEngine(lv, nesting=LocalNesting())
    eng.retry_after_s = 0.0
    seqs = [eng.new_sequence(p, SamplingParams(), 40) for p in PROMPTS]
    small = lv[0].worker
    r = 0
    while any(not s.finished for s in seqs):
        if r == 2:
            small.dead = True
        if r == 5:
            assert eng.level_status()["d1"] == "down"
            small.dead = False  # back, and still holding its sequences: the epoch makes them start again
        eng.step(seqs)
        r += 1
    assert eng.level_status()["d1"] == "up"
    ref = generate([Level("t", worker=FakeWorker("t", vocab=16, order=2, table_seed=0))], PROMPTS, max_tokens=40,
                   ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]
    for s in seqs:
        eng.release(s)
    assert all(x.worker.stats().live_sequences == 0 for x in lv)
