"""Closed-form speculative decoding expectations (specray/spec/bound.py)."""

from __future__ import annotations

import math

import pytest
import torch

from specray.spec.bound import (
    expected_accepted_length,
    expected_accepted_length_iid,
    optimal_k,
    speedup_bound,
)


def test_expected_accepted_length_worked_examples():
    assert expected_accepted_length([]) == 1.0
    assert expected_accepted_length([0.5]) == 1.5
    # 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25
    assert expected_accepted_length([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert expected_accepted_length([1.0] * 4) == 5.0
    assert expected_accepted_length([0.0, 1.0, 1.0]) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_iid_closed_form_equals_the_sum(alpha, k):
    assert expected_accepted_length_iid(alpha, k) == pytest.approx(expected_accepted_length([alpha] * k))


def test_iid_limits():
    assert expected_accepted_length_iid(1.0, 5) == 6.0
    assert expected_accepted_length_iid(0.0, 5) == 1.0
    assert expected_accepted_length_iid(0.5, 1000) == pytest.approx(2.0)  # 1 / (1 - alpha)


def test_expected_length_matches_simulation():
    gen = torch.Generator().manual_seed(0)
    alphas = [0.9, 0.7, 0.6, 0.3]
    accepted = torch.rand(200_000, len(alphas), generator=gen) < torch.tensor(alphas)
    emitted = accepted.long().cumprod(dim=1).sum(dim=1) + 1
    assert float(emitted.double().mean()) == pytest.approx(expected_accepted_length(alphas), abs=0.01)


def test_speedup_bound():
    # Leviathan et al.: alpha = 0.8, gamma = 5, c = 0.05 -> (1 - 0.8^6) / (0.2 * 1.25) ~ 2.95
    assert speedup_bound(0.8, 0.05, 5) == pytest.approx((1 - 0.8**6) / 0.2 / 1.25)
    assert speedup_bound([0.8, 0.5, 0.25], 0.1, 2) == pytest.approx((1 + 0.8 + 0.4) / 1.2)
    assert speedup_bound([0.8, 0.5, 0.25], 0.1) == pytest.approx(
        expected_accepted_length([0.8, 0.5, 0.25]) / 1.3
    )
    assert speedup_bound(0.9, 0.0, 0) == 1.0  # K = 0 is plain decoding
    assert speedup_bound(1.0, 0.0, 7) == 8.0  # free perfect drafter: K + 1 tokens per target step


def test_optimal_k():
    assert optimal_k(0.0, 0.1) == 0
    assert optimal_k(0.99, 0.0, k_max=12) == 12
    k = optimal_k(0.8, 0.05)
    assert all(speedup_bound(0.8, 0.05, k) >= speedup_bound(0.8, 0.05, j) for j in range(17))


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_accepted_length([1.5]),
        lambda: expected_accepted_length([math.nan]),
        lambda: expected_accepted_length_iid(0.5, -1),
        lambda: speedup_bound(0.5, -0.1, 3),
        lambda: speedup_bound(0.5, 0.1),
        lambda: speedup_bound([0.5], 0.1, 2),
    ],
)
def test_invalid_arguments(call):
    with pytest.raises(ValueError):
        call()
