"""The planner prices a confidence-stopped level (`Level.confidence`) at what it drafts: the round tells it what each
row asked for (`Verified.asked` -> `StopObserver.on_drafted`), it measures how far such drafts go, and its price of
a plan runs the level's proposal and the target's verification for that many tokens, with an acceptance in which a
short draft accepted whole ends the round. The vectorised ranking gives the same numbers as pricing one by one."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.policy.cost import linear_cost
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import PROMPTS, draft, target
from tests.unit.test_planner import Sim, _dummy
from tests.unit.test_ranking_table import Lockstep, OneByOne


class Seen:
    """Records the acceptance hooks a round calls."""

    def __init__(self) -> None:
        self.verified: list[tuple[int, int, list[int]]] = []
        self.drafted: list[tuple[int, int, list[int], list[int], list[int]]] = []
        self.steps: list[int] = []  # the drafter's timed proposals: steps reported

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        if level == 0 and kind == "propose":
            self.steps.append(tokens)

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None:
        self.verified.append((level, lower, list(draft_lens)))

    def on_drafted(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int],
                   asked: Sequence[int]) -> None:
        self.drafted.append((level, lower, list(draft_lens), list(accepted), list(asked)))


@pytest.mark.parametrize("conf", [0.0, 0.9])
def test_the_round_tells_the_planner_what_each_row_asked_of_a_stopping_level(conf):
    levels = [Level("d", worker=draft(0.8), k=8, method=VerifyMethod.GREEDY, confidence=conf),
              Level("target", worker=target(), method=VerifyMethod.GREEDY)]
    engine = CascadeEngine(levels)
    seen = Seen()
    engine.observers.append(seen)
    seqs = [engine.new_sequence(p, SamplingParams(0.0), max_tokens=40) for p in PROMPTS[:3]]
    for _ in range(6):
        engine.step([s for s in seqs if not s.finished], Plan((0, 1), (8,)))
    if conf == 0.0:  # a level that fills its K: the acceptance hook as ever
        assert seen.verified and not seen.drafted
        assert set(seen.steps) == {8}
        return
    assert seen.drafted and not [v for v in seen.verified if v[:2] == (1, 0)]
    lens = [n for *_, d, _a, _w in seen.drafted for n in d]
    for _lvl, _low, d, acc, asked in seen.drafted:
        assert all(0 < n <= w <= 8 and a <= n for n, a, w in zip(d, acc, asked))
    assert min(lens) < 8  # it stopped short somewhere: what the planner now measures
    # each proposal is timed as the steps it ran (its longest draft), not as the 8 it was asked for; the first
    # started the rows at the drafter (their prefill: `step_timed`) and is not timed
    assert len(seen.steps) == len(seen.drafted) - 1
    assert seen.steps == [max(d) for *_, d, _a, _w in seen.drafted][1:]


def _planner(conf: float) -> Planner:
    return Planner([Level("d", worker=_dummy("d"), k=8, confidence=conf), Level("t", worker=_dummy("t"))],
                   k_max=8, rerank_every=1)


def test_a_stopping_drafter_is_priced_at_the_drafts_it_makes():
    stop, full = _planner(0.6), _planner(0.0)
    for p in (stop, full):
        for _ in range(3):
            p.on_call(0, "propose", 1, 1, 0.05)
            for q in (1, 3, 9):
                p.on_call(1, "verify", 1, q, 0.1 + 0.01 * q)
    for _ in range(30):  # asked for 8, every row drafts 2 tokens, both accepted
        stop.on_drafted(1, 0, [2, 2], [2, 2], [8, 8])
        full.on_verify(1, 0, [2, 2], [2, 2])
    pr = stop.pricing
    assert 2.0 <= pr.drafted(0, 1, 8) < 2.3  # measured: drafts end at 2
    assert round(pr.drafted(0, 1, 8)) == 2 and pr.drafted(0, 4, 8) >= pr.drafted(0, 1, 8)
    assert pr.draft_lengths(0, 1, 8)[:3] == [0.0, 1.0, pytest.approx(2.0, abs=0.1)]  # shrunk a little
    assert full.pricing.drafted(0, 1, 8) == 8.0  # a level without the stop fills its K

    plan = Plan((0, 1), (8,))
    # the verification: over the lengths the drafts run to, nearly always 2 (verify_times: a stop after 2 measured
    # 30 times, shrunk a little towards going on)
    verify = pr.verify_times(0, 1, 8)[8]
    v2, v3 = pr._verify_time(1, 2), pr._verify_time(1, 3)
    assert v2 < verify < v2 + 0.1 * (v3 - v2)
    want = pr.drafted(0, 1, 8) * pr.step_time(0, 1, 1) + verify + pr.overhead
    assert pr.round_time(plan, 1) == pytest.approx(want)
    assert pr.round_time(plan, 1) < 0.6 * full.pricing.round_time(plan, 1)  # 8 drafter steps and 9 tokens fed
    # a stopped draft accepted whole ends the round: K 8 emits the 2 tokens and one more, not 8 more
    assert stop.expected_length(plan, 1) == pytest.approx(3.0, abs=0.2)
    assert full.expected_length(plan, 1) > 3.5  # the same counts read as "nothing past 2 was tried"


def test_a_middle_level_that_stops_runs_fewer_inner_rounds():
    def planner(conf: float) -> Planner:
        return Planner([Level("ngram", ngram=NgramConfig(3, 1, 3)),
                        Level("mid", worker=_dummy("mid"), k=8, confidence=conf), Level("t", worker=_dummy("t"))],
                       k_max=8, rerank_every=1)

    stop, full = planner(0.6), planner(0.0)
    for p in (stop, full):
        for q in (1, 3, 9):
            p.on_call(1, "verify", 1, q, 0.05)
            p.on_call(2, "verify", 1, q, 0.1 + 0.01 * q)
        for _ in range(20):
            p.on_verify(1, 0, [2], [1])  # the mid level gets ~2 tokens per inner round
    for _ in range(30):
        stop.on_drafted(2, 1, [3], [3], [8])
        full.on_verify(2, 1, [3], [3])
    plan = Plan((0, 1, 2), (2, 8))
    e = stop.pricing._elen(1, 0, 2)
    inner = -(-stop.pricing.drafted(1, 1, 8) // e)
    assert inner < -(-8 // full.pricing._elen(1, 0, 2))
    assert stop.pricing._produce(plan, 1, 1, 8) == pytest.approx(
        inner * (stop.pricing.ngram_cost + stop.pricing.step_time(1, 1, 3)))
    assert stop.pricing.round_time(plan, 1) < full.pricing.round_time(plan, 1)


class StopSim(Sim):
    """`Sim` whose confidence levels end each row's draft after a geometric number of tokens (continue rate
    `go`), reporting the target's verification of them through `on_drafted`."""

    def __init__(self, planner, costs, alpha, go: dict[int, float], **kw) -> None:
        super().__init__(planner, costs, alpha, **kw)
        self.go = go

    def _len(self, level: int, k: int) -> int:
        n = 1
        while n < k and self.rng.random() < self.go[level]:
            n += 1
        return n

    def round(self, plan: Plan, batch: int) -> tuple[int, float]:
        lower = plan.levels[-2] if len(plan.levels) > 1 and plan.k[-1] > 0 else None
        if lower not in self.go:
            return super().round(plan, batch)
        k, top = plan.k[-1], self.p.top
        lens = [self._len(lower, k) for _ in range(batch)]
        dt = self._produce(plan, len(plan.levels) - 2, lens)
        dv = self._t(top, batch, max(lens) + 1)
        self.p.on_call(top, "verify", batch, max(lens) + 1, dv)
        acc = [self._accept((top, lower), n) for n in lens]
        self.p.on_drafted(top, lower, lens, acc, [k] * batch)
        return sum(a + 1 for a in acc), dt + dv


class StopLockstep(Lockstep):
    def on_drafted(self, *args) -> None:
        self.fast.on_drafted(*args)
        self.ref.on_drafted(*args)


@pytest.mark.parametrize("case", ["draft", "cascade"])
def test_vectorised_ranking_prices_stopping_levels_as_one_by_one(case):
    if case == "draft":
        def levels():
            return [Level("d", worker=FakeWorker("d", vocab=8), k=4, confidence=0.5),
                    Level("t", worker=FakeWorker("t", vocab=8))]
        truth = {1: linear_cost(0.1, 0.004), 0: linear_cost(0.01, 0.0004)}
        alpha, go = {(1, 0): 0.8}, {0: 0.6}
    else:
        def levels():
            return [Level("ngram", ngram=NgramConfig(3, 1, 3)),
                    Level("mid", worker=FakeWorker("mid", vocab=8), k=4, confidence=0.5),
                    Level("t", worker=FakeWorker("t", vocab=8))]
        truth = {2: linear_cost(0.1, 0.004), 1: linear_cost(0.01, 0.0004)}
        alpha, go = {(2, 0): 0.7, (2, 1): 0.8, (1, 0): 0.6}, {1: 0.5}
    kw = dict(k_max=6, rerank_every=1, explore_every=12)
    fast, ref = Planner(levels(), **kw), OneByOne(levels(), **kw)
    both = StopLockstep(fast, ref)
    sim = StopSim(both, truth, alpha, go, noise=0.3, seed=7)
    rng = random.Random(3)
    for _ in range(12):
        sim.run(rng.choice([1, 2, 3, 8, 17]), rng.randint(3, 12))
    assert both.rounds >= 36
    stopper = next(iter(go))
    assert fast.measurements.stops[stopper].n_obs > 0  # the stops were measured, and priced in both rankings
    assert fast.pricing.drafted(stopper, 1, 6) < 5.0
