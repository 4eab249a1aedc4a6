"""The planner's calibration: each plan family's price corrected by what its rounds delivered."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import Level, Plan
from specray.policy.calibration import Calibration, Expected, family
from specray.policy.cost import linear_cost
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.testing.fake import FakeWorker

NGRAM, CASCADE, PLAIN = Plan((0, 2), (4,)), Plan((0, 1, 2), (4, 4)), Plan((2,), ())


def _round(cal: Calibration, plan: Plan, predicted: tuple[float, float], measured: tuple[int, float],
           batch: int = 1, catch_up: float = 0.0) -> None:
    cal.expect(Expected(plan, batch, predicted[0], predicted[1], catch_up))
    cal.observe(batch, measured[1], measured[0])


def test_families_group_the_k_of_a_plan_and_a_plan_whose_drafting_is_off_is_plain():
    assert family(Plan((0, 2), (3,))) == family(Plan((0, 2), (9,))) != family(CASCADE)
    assert family(Plan((0, 1, 2), (0, 4))) == family(Plan((1, 2), (4,)))
    assert family(Plan((1, 2), (0,))) == family(PLAIN)
    assert family(Plan((0, 1, 2), (2, 2), hybrid=True)) != family(CASCADE)


def test_a_family_converges_to_its_measured_over_predicted_goodput_from_the_prior():
    cal = Calibration()
    assert cal.factor(NGRAM) == 1.0 and not cal.active
    _round(cal, NGRAM, (4.0, 0.125), (2, 0.125))
    one = cal.factor(NGRAM)
    assert 0.5 < one < 1.0  # a single round moves it part of the way (the prior's pseudo-rounds)
    for _ in range(60):
        _round(cal, Plan((0, 2), (8,)), (4.0, 0.125), (2, 0.125))  # another K of the same family
    assert cal.factor(NGRAM) == pytest.approx((20 + 3 * 4) / (40 + 3 * 4), rel=0.02)  # decayed sums: 10 rounds' worth
    assert cal.factor(NGRAM) < one
    assert cal.factor(CASCADE) == 1.0  # an unseen family keeps its price
    for _ in range(60):  # slower than predicted: the factor falls with the time, too
        _round(cal, CASCADE, (6.0, 0.4), (6, 0.8))
    assert cal.factor(CASCADE) == pytest.approx((4 + 3 * 0.4) / (8 + 3 * 0.4), rel=0.02)


def test_factors_are_bounded_and_rounds_that_say_nothing_are_ignored():
    cal = Calibration(bound=3.0)
    for _ in range(50):
        _round(cal, NGRAM, (8.0, 0.1), (1, 1.0))
    assert cal.factor(NGRAM) == pytest.approx(1 / 3)
    for _ in range(50):
        _round(cal, CASCADE, (1.0, 1.0), (9, 0.1))
    assert cal.factor(CASCADE) == pytest.approx(3.0)
    before = dict(cal._factors)
    cal.expect(Expected(PLAIN, 1, 1.0, 0.1, 0.0))
    cal.observe(1, 5.0, None)  # several groups, or a first round: nothing about its plan
    cal.expect(Expected(PLAIN, 2, 1.0, 0.1, 0.0))
    cal.observe(4, 5.0, 4)  # not the batch it was priced for
    cal.observe(1, 5.0, 1)  # no prediction held
    assert family(PLAIN) not in cal._factors and cal._factors == pytest.approx(before)


def test_the_priced_catch_up_is_not_held_against_the_round():
    cal = Calibration()
    for _ in range(30):  # each round also spent its priced 0.5 s catching up: the round itself went as predicted
        _round(cal, CASCADE, (6.0, 0.4), (6, 0.9), catch_up=0.5)
    assert cal.factor(CASCADE) == pytest.approx(1.0)
    for _ in range(30):  # a catch-up priced far above what the round took cannot make it look free
        _round(cal, NGRAM, (3.0, 0.1), (3, 0.1), catch_up=5.0)
    # its time is taken as a quarter of the round's: at most 4x the price, short of it by the prior
    assert cal.factor(NGRAM) == pytest.approx((1.0 + 3 * 0.1) / (0.25 + 3 * 0.1), rel=0.02)


def test_a_family_that_sits_out_fades_back_to_its_price():
    cal = Calibration(forget=0.95)
    for _ in range(20):
        _round(cal, NGRAM, (4.0, 0.1), (1, 0.1))
    low = cal.factor(NGRAM)
    assert low < 0.5
    for _ in range(30):
        _round(cal, CASCADE, (5.0, 0.4), (5, 0.4))
    assert low < cal.factor(NGRAM) < 1.0
    for _ in range(200):
        _round(cal, CASCADE, (5.0, 0.4), (5, 0.4))
    assert cal.factor(NGRAM) == 1.0 and cal.rounds(NGRAM) == 0.0


# ----- in the planner ----------------------------------------------------------------------------------------
def _levels() -> list[Level]:
    return [Level("ngram", ngram=NgramConfig(3, 1, 4)), Level("draft", worker=FakeWorker("draft", vocab=8), k=4),
            Level("target", worker=FakeWorker("target", vocab=8))]


def _serve(p: Planner, rounds: int, hidden: float) -> list[Plan]:
    """Rounds at batch 1 as the scheduler reports them, against a truth in which every n-gram-only round also costs
    `hidden` seconds that no worker call shows (the planner's feed reports each call as measured)."""
    target, draft = linear_cost(0.1, 0.005), linear_cost(0.02, 0.0)
    chosen = []
    for _ in range(rounds):
        plan = p.plan(1)
        chosen.append(plan)
        seconds, tokens = 0.0, 1
        if len(plan.levels) > 1:
            k = plan.k[-1]
            if plan.levels[-2] == 1:  # the draft model drafts k tokens (the n-gram's inner rounds aside)
                seconds += k * draft(1, 1)
                p.on_call(1, "propose", 1, k, k * draft(1, 1))
            accepted = min(k, 3)  # both drafters: 3 of their tokens accepted
            p.on_verify(2, plan.levels[-2], [k], [accepted])
            tokens = accepted + 1
            t = target(1, k + 1)
        else:
            t = target(1, 1)
        p.on_call(2, "verify", 1, (plan.k[-1] if plan.k else 0) + 1, t)
        seconds += t
        if plan.levels[-2:] == (0, 2):
            seconds += hidden
        p.on_round(1, seconds, tokens)
    return chosen


@pytest.mark.parametrize("calibrate", [True, False])
def test_the_planner_leaves_a_family_whose_rounds_deliver_less_than_priced(calibrate):
    """The n-gram (free to draft, as good as the draft model) is priced best, but its rounds carry a cost no call
    shows: calibrated, the planner leaves it for a plan with the draft model; without, it holds it."""
    p = Planner(_levels(), k_max=4, calibrate=calibrate, explore_every=10_000, explore_budget=None)
    for _ in range(20):  # both drafters measured alike: 3 of 4 tokens accepted (the n-gram matching every row)
        for pair in ((2, 0), (2, 1), (1, 0)):
            p.on_verify(*pair, [4], [3])
    _serve(p, 80, hidden=0.0)
    assert p.current.levels[-2:] == (0, 2)  # with nothing hidden, the free n-gram wins
    late = _serve(p, 150, hidden=0.3)[-20:]
    if calibrate:
        assert all(plan.levels[-2] == 1 for plan in late), [p.plan_name(x) for x in late]
        assert p.calibration.factor(Plan((0, 2), (4,))) < 0.9  # faded a little since it last ran
    else:
        assert all(plan.levels[-2:] == (0, 2) for plan in late)


def test_a_planner_told_no_tokens_prices_as_before():
    a, b = (Planner(_levels(), k_max=4, calibrate=c, explore_every=10_000, explore_budget=None) for c in (True, False))
    for p in (a, b):
        for _ in range(40):
            plan = p.plan(1)
            p.on_call(2, "verify", 1, (plan.k[-1] if plan.k else 0) + 1, 0.1)
            if plan.k:
                p.on_verify(2, plan.levels[-2], [plan.k[-1]], [1])
            p.on_round(1, 0.5, None)
    assert not a.calibration.active and a.current == b.current
