"""n-gram proposer: small integer tables with vLLM's knob semantics."""

import pytest

from specray.spec.ngram import NgramConfig, propose_ngram


@pytest.mark.parametrize(
    "tokens,k,lo,hi,expected",
    [
        ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # the docstring's worked example
        ([1, 2, 3, 4, 2, 3], 1, 2, 3, [4]),  # k caps the draft
        ([1, 2, 3], 2, 1, 2, []),  # no earlier occurrence
        ([5, 1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),  # most recent occurrence wins
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 3, [9, 2, 3]),  # longest suffix (3-gram) beats later 2-gram
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 2, [6, 1, 2]),  # capped at 2: most recent [2, 3]
        ([4, 4, 4, 4], 3, 1, 3, [4]),  # overlapping match runs into the suffix itself
        ([1, 2, 1], 3, 1, 1, [2, 1]),
        ([1], 3, 1, 3, []),
        ([], 3, 1, 3, []),
        ([1, 2, 1, 2], 0, 1, 3, []),  # k = 0
    ],
)
def test_table(tokens, k, lo, hi, expected):
    assert propose_ngram(tokens, k, lo, hi) == expected


def test_config_validation_and_default_k():
    cfg = NgramConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert cfg.propose([1, 2, 3, 1, 2]) == [3, 1]
    assert cfg.propose([1, 2, 3, 1, 2], k=1) == [3]
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_min=0)
