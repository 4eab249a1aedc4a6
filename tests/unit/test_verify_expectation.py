"""The target's verification of drafts that stop short of their K (a capped lookup, a confidence-stopped model) is
priced at its expected time over the longest draft of the call (`Pricing.verify_times`), not at the time of the
expected length rounded: a CPU engine's step takes the tokens it verifies in blocks, so its cost is not linear in
them, and a rounded length flipped the price of one K more or less by a block."""

from __future__ import annotations

import itertools

import pytest

from specray.coordinator.cascade import Level, Plan
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from tests.unit.test_planner import _dummy


def _seconds(q: int) -> float:
    """A CPU-like step: 10 ms per extra token up to 6 tokens per row, then a second block of the matrix kernels."""
    return 0.15 + 0.01 * (q - 1) + (0.045 if q >= 7 else 0.0)


def _planner(first: Level) -> Planner:
    p = Planner([first, Level("t", worker=_dummy("t"))], k_max=8, rerank_every=1)
    for q in range(1, 10):
        for _ in range(3):
            p.on_call(1, "verify", 1, q, _seconds(q))
    return p


def _brute(pr, level: int, batch: int, k: int, match: float) -> float:
    """E[V(max of the rows' draft lengths)] over every combination of the rows' lengths: a row drafts nothing with
    probability 1 - match, else j tokens with probability S_j - S_{j+1} (K: S_K)."""
    reach, s = 1.0, []
    for c in pr.measured.stops[level].alphas(k):
        s.append(reach)
        reach *= c
    dist = [1.0 - match] + [match * (s[j - 1] - (s[j] if j < k else 0.0)) for j in range(1, k + 1)]

    def v(j: int) -> float:
        return pr.plain_verify_time(batch) if j == 0 else pr._verify_time(batch, j)

    total = 0.0
    for lens in itertools.product(range(k + 1), repeat=batch):
        prob = 1.0
        for j in lens:
            prob *= dist[j]
        total += prob * v(max(lens))
    return total


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_capped_lookup_is_priced_at_the_expected_verification_over_its_draft_lengths(batch):
    p = _planner(Level("ngram", ngram=NgramConfig(8, 1, 4, max_spec_factor=2), k=8))
    for _ in range(20):  # copies run to 8, one-token matches stop at 2, and a row in four finds nothing
        p.on_drafted(1, 0, [8, 2, 2, 0], [8, 2, 1, 0], [8, 8, 8, 8])
    pr = p.pricing
    match = pr.match_rate(prior=1.0)
    assert 0.7 < match < 0.8
    for k in (1, 2, 3, 5, 8):
        assert pr._lookup_verify_time(batch, k) == pytest.approx(_brute(pr, 0, batch, k, match), rel=1e-12)
    plan = Plan((0, 1), (8,))
    assert pr.round_time(plan, batch) == pytest.approx(
        _brute(pr, 0, batch, 8, match) + pr.ngram_cost + pr.overhead, rel=1e-12)
    # the vectorised ranking prices it as the one-by-one pricing does
    for plan_, gp in p.explain(batch):
        assert gp == pytest.approx(pr.goodput(plan_, batch), rel=1e-9)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_confidence_stopped_drafter_is_priced_at_the_expected_verification(batch):
    p = _planner(Level("d", worker=_dummy("d"), k=8, confidence=0.6))
    for _ in range(3):
        p.on_call(0, "propose", 1, 1, 0.05)
    for _ in range(20):
        p.on_drafted(1, 0, [8, 3, 1], [8, 2, 1], [8, 8, 8])
    pr = p.pricing
    for k in (2, 4, 8):
        assert pr.verify_times(0, batch, 8)[k] == pytest.approx(_brute(pr, 0, batch, k, 1.0), rel=1e-12)
    plan = Plan((0, 1), (8,))
    want = pr.drafted(0, batch, 8) * pr.step_time(0, batch, 1) + _brute(pr, 0, batch, 8, 1.0) + pr.overhead
    assert pr.round_time(plan, batch) == pytest.approx(want, rel=1e-12)
    for plan_, gp in p.explain(batch):
        assert gp == pytest.approx(pr.goodput(plan_, batch), rel=1e-9)


def test_drafts_that_are_short_or_long_are_not_priced_as_drafts_of_their_mean_length():
    """Copies of 8 on two rounds in five, stops after 2 on the others: on this step (past the kernels' first block of
    6 tokens) a round of K 8 costs more than the step at the drafts' mean length rounded, which the rounded price
    charged."""
    p = _planner(Level("ngram", ngram=NgramConfig(8, 1, 4, max_spec_factor=2), k=8))
    for r in range(60):
        p.on_drafted(1, 0, [8], [8], [8]) if r % 5 in (0, 2) else p.on_drafted(1, 0, [2], [2], [8])
    pr = p.pricing
    mean = round(pr.drafted(0, 1, 8))
    assert 4 <= mean <= 5
    price = pr._lookup_verify_time(1, 8)
    assert pr._verify_time(1, mean) + 0.005 < price < pr._verify_time(1, 8)
    assert price == pytest.approx(_brute(pr, 0, 1, 8, pr.match_rate(prior=1.0)), rel=1e-12)
