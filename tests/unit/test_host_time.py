"""The coordinator's own time per round (`specray.policy.host`): measured apart from the workers' calls, per kind of
round, and priced into every plan's round time, so the planner does not choose a draft whose own work (lookups,
bookkeeping) costs more than the tokens it gains. At a GPU step of a few milliseconds that work is a share of the
round; the workers here sleep for their step times (`SimWorker`) and the lookup is slowed on purpose."""

from __future__ import annotations

import time
from statistics import median

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.drafting import Drafter
from specray.coordinator.feed import HOST_RECENT
from specray.coordinator.generate import generate
from specray.policy.host import HostTimes
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.testing.sim import SimWorker, StepCostModel
from tests.unit.test_cascade import PROMPTS

STEP = StepCostModel(0.004, 0.0001)  # a GPU-like step: 4 ms plus 0.1 ms per token fed


class Hosted:
    """An observer of the round's own time (and nothing else)."""

    def __init__(self) -> None:
        self.events: list[tuple[tuple[int, ...], int, float]] = []

    def on_call(self, *a) -> None:
        pass

    def on_verify(self, *a) -> None:
        pass

    def on_host(self, drafting: tuple[int, ...], batch: int, seconds: float) -> None:
        self.events.append((drafting, batch, seconds))


def _levels(step: StepCostModel = STEP) -> list[Level]:
    """An n-gram level over a target whose greedy text soon repeats (order 1: each token fixes the next), so lookups
    match and their drafts are accepted."""
    return [Level("ngram", ngram=NgramConfig(4, 1, 3), k=4),
            Level("t", worker=SimWorker("t", step, vocab=16, order=1, table_seed=0), method="greedy")]


@pytest.fixture
def slow_lookup(monkeypatch):
    """Every n-gram drafting call of a round takes `delay` seconds more (the shadow lookups do not)."""
    delay = {"s": 0.0}
    real = Drafter._lookup

    def slow(self, *a, **kw):
        time.sleep(delay["s"])
        return real(self, *a, **kw)

    monkeypatch.setattr(Drafter, "_lookup", slow)
    return delay


def test_a_rounds_own_time_is_measured_apart_from_its_calls(slow_lookup):
    """A round's own time excludes its workers' calls (a 30 ms verification is not in it) and includes what the
    coordinator did itself (a 10 ms lookup is), per kind: plain rounds () and n-gram rounds (0,)."""
    slow_lookup["s"] = 0.010
    seen = Hosted()
    eng = CascadeEngine(_levels(StepCostModel(0.030)))
    eng.observers.append(seen)
    generate(eng, PROMPTS[:2], max_tokens=8, ignore_eos=True, plan=Plan((0, 1), (4,)))
    generate(eng, PROMPTS[:2], max_tokens=8, ignore_eos=True, plan=Plan((1,), ()))
    ngram = [s for d, _b, s in seen.events if d == (0,)]
    plain = [s for d, _b, s in seen.events if d == ()]
    assert len(ngram) >= 3 and len(plain) >= 7
    assert all(b == 2 or b == 1 for _d, b, _s in seen.events)
    assert 0.010 <= median(ngram) < 0.025  # the lookup's sleep, not the 30 ms verification
    assert median(plain) < 0.010


def test_only_steady_rounds_are_measured():
    """The first round of a kind after others costs a multiple of a steady round, and while one plan is held a probe
    of another kind is only ever such a round: a round is reported only if one of the `HOST_RECENT` rounds before it
    ran its kind (groups of one tick that alternate kinds are each steady). Nor are the planner's warm-up rounds
    (cold code paths)."""
    seen = Hosted()
    eng = CascadeEngine(_levels())
    eng.observers.append(seen)
    ngram, plain = Plan((0, 1), (4,)), Plan((1,), ())
    script = [ngram] * 3 + [plain] * 6 + [ngram] + [plain] * 6 + [ngram, plain] * 3  # then plain to the end
    chosen: list[Plan] = []

    def plans(batch: int) -> Plan:
        chosen.append(script[len(chosen)] if len(chosen) < len(script) else plain)
        return chosen[-1]

    generate(eng, PROMPTS[:2], max_tokens=48, ignore_eos=True, plan=plans)
    assert len(chosen) > len(script)
    assert HOST_RECENT == 4
    # unreported: round 0 (no round before it), 3 (the first plain one), 9 (an n-gram probe after six plain rounds)
    # and 16 (the first n-gram round of the alternation); 17-21 alternate with a kind seen two rounds before
    reported = [p.drafting for i, p in enumerate(chosen) if i not in (0, 3, 9, 16)]
    assert [d for d, _b, _s in seen.events] == reported
    assert reported.count((0,)) == 4

    lv = _levels()
    warm = CascadeEngine(lv)
    trace: list[dict] = []
    p = Planner(lv, k_choices=(4,), warmup=3, explore_every=0, trace=trace.append).attach(warm)
    hosted: list[tuple[int, ...]] = []
    record = p.measurements.on_host
    p.measurements.on_host = lambda d, b, sec: hosted.append(d) or record(d, b, sec)
    generate(warm, PROMPTS[:2], max_tokens=24, ignore_eos=True, plan=p)
    warming = sum(r["reason"] == "warmup" for r in trace)
    assert warming >= 3
    assert len(hosted) <= len(trace) - warming


def test_host_times_are_medians_per_kind_and_bucket_with_fallbacks():
    h = HostTimes(window=3)
    assert h.seconds((0,), 1) == 0.0  # nothing measured
    for s in (0.001, 0.002, 0.100):  # an outlier does not move the median
        h.observe((), 1, s)
    assert h.seconds((), 1) == pytest.approx(0.002)
    assert h.seconds((0,), 1) == pytest.approx(0.002)  # an unmeasured kind: plain decoding's
    h.observe((0,), 16, 0.005)
    assert h.seconds((0,), 16) == pytest.approx(0.005)
    assert h.seconds((0,), 8) == pytest.approx(0.005)  # the nearest bucket measured for the kind
    assert h.seconds((), 16) == pytest.approx(0.002)
    for s in (0.003, 0.004, 0.006):  # the window keeps the latest rounds
        h.observe((), 1, s)
    assert h.seconds((), 1) == pytest.approx(0.004)


def test_the_planner_prices_each_kinds_own_time_into_its_rounds():
    lv = _levels()
    p = Planner(lv, k_choices=(4,))
    ngram, plain = Plan((0, 1), (4,)), Plan((1,), ())
    before = {q: p.pricing.round_time(q, 2) for q in (ngram, plain)}
    for _ in range(5):
        p.on_host((0,), 2, 0.050)
        p.on_host((), 2, 0.001)
    assert p.pricing.round_time(ngram, 2) == pytest.approx(before[ngram] + 0.050)
    assert p.pricing.round_time(plain, 2) == pytest.approx(before[plain] + 0.001)
    # the ranking's vectorised chains price it too (bit for bit the scalar price)
    ranked = dict(p.explain(2))
    assert ranked[ngram] == pytest.approx(p.pricing.goodput(ngram, 2))


@pytest.mark.parametrize("delay, drafts", [(0.0, True), (0.030, False)])
def test_the_planner_leaves_a_draft_whose_own_work_costs_more_than_it_gains(slow_lookup, delay, drafts):
    """On text that repeats, the n-gram's drafts win over 4 ms steps, and the planner drafts; when its lookups take
    30 ms a round, no draft of at most 4 tokens pays for them, and the planner, which measures the round's own time,
    decodes plainly (priced at its calls alone, the n-gram would still look the winner)."""
    slow_lookup["s"] = delay
    lv = _levels()
    eng = CascadeEngine(lv)
    trace: list[dict] = []
    p = Planner(lv, k_choices=(2, 4), warmup=1, patience=1, explore_every=8, trace=trace.append).attach(eng)
    batch = generate(eng, PROMPTS, max_tokens=48, ignore_eos=True, plan=p)
    plans = [r["plan"] for r in trace[len(trace) // 2:]]  # the second half: after warm-up and the first probes
    plain = plans.count("t") / len(plans)
    assert (plain <= 0.25) if drafts else (plain >= 0.75), plans
    assert (p.measurements.host_time((0,), 4) >= 0.030) is not drafts
    assert batch.stats["t"].accepted_tokens > 0  # the n-gram's drafts were tried, and accepted
