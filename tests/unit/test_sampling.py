"""Keyed noise, logits processing and single-token sampling (specray/spec/sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from specray.spec.noise import (
    COUPLED_STREAM,
    accept_stream,
    coupled_argmax,
    gumbel_noise,
    keyed_uniform,
    keyed_uniform_at,
    philox4x32,
    residual_stream,
    sample_tokens,
)
from specray.spec.params import SamplingParams
from specray.spec.reference import ref_processed_probs_row, ref_sample_token
from specray.spec.sampling import SamplingBatch, processed_probs


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.from_params(params)


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic: Q(df/2, stat/2), the regularised upper incomplete gamma."""
    stat = ((observed.double() - expected.double()) ** 2 / expected.double()).sum()
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------------------------------------- Philox


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # Known-answer vectors of Philox-4x32-10 from the Random123 distribution (kat_vectors).
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
    assert tuple(int(o) for o in out) == expected


# ---------------------------------------------------------------------------------------- keyed_uniform


def test_keyed_uniform_golden_values_and_determinism():
    seed = torch.tensor([0, 123456789012345])
    pos = torch.tensor([0, 2**40 + 5])
    u = keyed_uniform(seed, pos, 3, 5)
    assert u.dtype == torch.float32 and u.shape == (2, 5)
    # Fixed forever: changing these changes every seeded output of specray.
    expected = torch.tensor(
        [[6853837, 6972275, 3127656, 5049232, 4198255], [6625994, 4913019, 3413804, 3818582, 5318214]]
    )
    assert torch.equal(u, (expected.float() + 0.5) * 2.0**-23)
    assert torch.equal(u, keyed_uniform(seed, pos, 3, 5))
    # The index is part of the counter: a shorter request is a prefix of a longer one.
    assert torch.equal(keyed_uniform(seed, pos, 3, 2), u[:, :2])


def test_keyed_uniform_range_and_extremes():
    seed = torch.arange(2000) * 7919 + 2**62
    u = keyed_uniform(seed, torch.arange(2000) + 2**33, 5, 257)
    assert bool((u > 0).all()) and bool((u < 1).all())
    # The extreme representable values still sit strictly inside (0, 1) in float32.
    lo, hi = torch.tensor(0.5 * 2.0**-23), (torch.tensor(2.0**23 - 1) + 0.5) * 2.0**-23
    assert float(lo) > 0 and float(hi) < 1


def test_keyed_uniform_every_key_component_matters():
    base = keyed_uniform(torch.tensor([42]), torch.tensor([7]), 1, 64)
    for other in (
        keyed_uniform(torch.tensor([43]), torch.tensor([7]), 1, 64),
        keyed_uniform(torch.tensor([42 + 2**32]), torch.tensor([7]), 1, 64),  # high limb of the seed
        keyed_uniform(torch.tensor([42]), torch.tensor([8]), 1, 64),
        keyed_uniform(torch.tensor([42]), torch.tensor([7 + 2**32]), 1, 64),  # high limb of the position
        keyed_uniform(torch.tensor([42]), torch.tensor([7]), 2, 64),
    ):
        assert not torch.equal(base, other)
        assert int((base == other).sum()) <= 2


def test_keyed_uniform_uniformity_chi_square():
    n = 200_000
    u = keyed_uniform(torch.arange(n // 8), torch.arange(n // 8) * 3, 0, 8).flatten()
    bins = 64
    counts = torch.bincount((u * bins).long(), minlength=bins)
    assert _chi2_pvalue(counts, torch.full((bins,), n / bins)) > 1e-4
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)


@pytest.mark.parametrize("axis", ["position", "stream", "seed", "index"])
def test_keyed_uniform_neighbours_uncorrelated(axis):
    n = 50_000
    seed = torch.arange(n) * 104729 + 11
    pos = torch.arange(n) * 13
    a = keyed_uniform(seed, pos, 4, 2)
    if axis == "position":
        b = keyed_uniform(seed, pos + 1, 4, 1)[:, 0]
    elif axis == "stream":
        b = keyed_uniform(seed, pos, 5, 1)[:, 0]
    elif axis == "seed":
        b = keyed_uniform(seed + 1, pos, 4, 1)[:, 0]
    else:
        b = a[:, 1]
    corr = torch.corrcoef(torch.stack([a[:, 0], b]).double())[0, 1]
    # Under independence the sample correlation is ~ N(0, 1/n); 5 sigma.
    assert abs(float(corr)) < 5 / math.sqrt(n)
    # Joint uniformity on a 4x4 grid catches dependence that correlation misses.
    joint = torch.bincount((a[:, 0] * 4).long() * 4 + (b * 4).long(), minlength=16)
    assert _chi2_pvalue(joint, torch.full((16,), n / 16)) > 1e-4


def test_keyed_uniform_at_picks_single_entries():
    seed, pos = torch.tensor([5, 2**40]), torch.tensor([9, 3])
    full = keyed_uniform(seed, pos, 7, 37)
    rows, index = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 36, 5, 19, 2])
    assert torch.equal(keyed_uniform_at(seed, pos, 7, rows, index), full[rows, index])


@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])
def test_coupled_argmax_pruning_is_exact(scale):
    """Skipping the noise of tokens >= 20 nats behind the best never changes the Gumbel-max winner."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    rows, vocab = 400, 300
    params = [SamplingParams(1.0, top_k=(0, 5)[i % 2], seed=i) for i in range(rows)]
    probs = processed_probs(torch.randn(rows, 1, vocab, generator=gen) * scale, _batch(params))[:, 0]
    seed, pos = torch.arange(rows) * 3 + 1, torch.randint(0, 2**35, (rows,), generator=gen)
    full = (torch.log(probs.double()) + gumbel_noise(seed, pos, vocab).double()).argmax(dim=-1)
    assert torch.equal(coupled_argmax(probs, seed, pos), full)
    # Halves of the batch take whichever path their own density picks; the rows' results do not change.
    assert torch.equal(coupled_argmax(probs[1::2], seed[1::2], pos[1::2]), full[1::2])


def test_streams_are_distinct_per_level():
    streams = [COUPLED_STREAM] + [accept_stream(s) for s in range(8)] + [residual_stream(s) for s in range(8)]
    assert len(set(streams)) == len(streams)
    assert accept_stream(3) == 7 and residual_stream(3) == 8


def test_gumbel_noise_moments_and_coupled_stream():
    n = 4000
    g = gumbel_noise(torch.arange(n), torch.zeros(n, dtype=torch.long), 50)
    assert g.shape == (n, 50) and g.dtype == torch.float32
    assert abs(float(g.double().mean()) - 0.5772156649) < 0.01
    assert abs(float(g.double().var()) - math.pi**2 / 6) < 0.03
    u = keyed_uniform(torch.arange(3), torch.zeros(3, dtype=torch.long), COUPLED_STREAM, 50)
    assert torch.allclose(g[:3], -torch.log(-torch.log(u.double())).float())


# ---------------------------------------------------------------------------------------- SamplingBatch


def test_sampling_batch_from_params_select_and_greedy():
    params = [SamplingParams(0.0, seed=1), SamplingParams(0.7, top_k=5, top_p=0.9, seed=2**62)]
    sb = _batch(params)
    assert len(sb) == 2 and not sb.all_greedy
    assert sb.temperature.dtype == torch.float32 and sb.top_p.dtype == torch.float32
    assert sb.top_k.dtype == torch.int64 and sb.seed.dtype == torch.int64
    assert sb.seed.tolist() == [1, 2**62] and sb.top_k.tolist() == [0, 5]
    first = sb.select([0])
    assert len(first) == 1 and first.all_greedy
    assert sb.select(torch.tensor([1, 0])).seed.tolist() == [2**62, 1]


def test_sampling_batch_requires_seeds():
    with pytest.raises(ValueError, match="seed"):
        _batch([SamplingParams(1.0, seed=3), SamplingParams(1.0)])
    assert len(_batch([SamplingParams(1.0).with_seed()])) == 1


# -------------------------------------------------------------------------------------- processed_probs


def _reference_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack([ref_processed_probs_row(row, p.temperature, p.top_k, p.top_p) for row in logits[b]])
            for b, p in enumerate(params)
        ]
    )


def test_processed_probs_matches_reference_with_per_row_params():
    gen = torch.Generator().manual_seed(0)
    vocab = 23
    params = [
        SamplingParams(t, top_k=k, top_p=p, seed=i)
        for i, (t, k, p) in enumerate(
            (t, k, p)
            for t in (0.0, 0.3, 0.7, 1.0, 1.7)
            for k in (0, 1, 4, 23, 40)
            for p in (1.0, 0.9, 0.5, 0.05)
        )
    ]
    logits = torch.randn(len(params), 3, vocab, generator=gen) * 2
    got = processed_probs(logits, _batch(params))
    want = _reference_probs(logits, params)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(params), 3))


def test_processed_probs_unfiltered_is_tempered_softmax():
    logits = torch.randn(4, 2, 31, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(t, seed=0) for t in (0.5, 1.0, 1.5, 2.0)]
    want = torch.softmax(logits / torch.tensor([0.5, 1.0, 1.5, 2.0]).view(4, 1, 1), dim=-1)
    torch.testing.assert_close(processed_probs(logits, _batch(params)), want)


def test_processed_probs_greedy_rows_are_one_hot_first_on_ties():
    logits = torch.tensor([[[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]]])
    probs = processed_probs(logits, _batch([SamplingParams(0.0, top_k=1, top_p=0.1, seed=0)]))
    assert probs.tolist() == [[[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]]


def test_processed_probs_ties_at_the_cut_are_kept():
    logits = torch.tensor([[[2.0, 1.0, 1.0, 0.0, 1.0]]])
    top_k = processed_probs(logits, _batch([SamplingParams(1.0, top_k=2, seed=0)]))
    assert (top_k[0, 0] > 0).tolist() == [True, True, True, False, True]
    # softmax ~ [.45, .16, .16, .06, .16]: 0.5 is reached inside the tied group, so all of it is kept.
    top_p = processed_probs(logits, _batch([SamplingParams(1.0, top_p=0.5, seed=0)]))
    assert (top_p[0, 0] > 0).tolist() == [True, True, True, False, True]
    tiny = processed_probs(logits, _batch([SamplingParams(1.0, top_p=1e-6, seed=0)]))
    assert tiny[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_processed_probs_large_flat_vocab_grows_the_top_p_prefix():
    # Flat logits need far more than the first candidate prefix of 1024 tokens to reach top_p.
    vocab = 6000
    logits = torch.randn(2, 1, vocab, generator=torch.Generator().manual_seed(2)) * 0.1
    params = [SamplingParams(1.0, top_p=0.9, seed=0), SamplingParams(0.8, top_k=3000, top_p=0.5, seed=1)]
    got = processed_probs(logits, _batch(params))
    want = _reference_probs(logits, params)
    assert torch.equal(got > 0, want > 0)
    assert 1024 < int((got[0] > 0).sum()) < vocab
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_processed_probs_any_float_dtype(dtype):
    logits = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    params = [SamplingParams(0.9, top_k=6, top_p=0.8, seed=0), SamplingParams(0.0, seed=1)]
    probs = processed_probs(logits, _batch(params))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, _reference_probs(logits.float(), params), atol=1e-6, rtol=1e-5)


def test_processed_probs_rejects_bad_shapes():
    with pytest.raises(ValueError):
        processed_probs(torch.zeros(2, 5), _batch([SamplingParams(1.0, seed=0)] * 2))
    with pytest.raises(ValueError):
        processed_probs(torch.zeros(3, 1, 5), _batch([SamplingParams(1.0, seed=0)] * 2))


# ---------------------------------------------------------------------------------------- sample_tokens


def _random_case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, SamplingBatch, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        SamplingParams(
            (0.0, 0.7, 1.0)[i % 3], top_k=(0, 3)[i % 2], top_p=(1.0, 0.8)[(i // 2) % 2], seed=i * 31
        )
        for i in range(rows)
    ]
    sb = _batch(params)
    probs = processed_probs(torch.randn(rows, 1, vocab, generator=gen) * 2, sb)[:, 0]
    return probs, sb, torch.randint(0, 10_000, (rows,), generator=gen)


@pytest.mark.parametrize("mode", ["random", "coupled", "greedy"])
def test_sample_tokens_matches_reference(mode):
    probs, sb, pos = _random_case(60, 12, seed=4)
    got = sample_tokens(probs, sb, pos, mode, salt=2)
    want = [ref_sample_token(probs[b], int(sb.seed[b]), int(pos[b]), mode, 2) for b in range(60)]
    assert got.dtype == torch.int64 and got.tolist() == want
    # Never a token the processed distribution excludes; greedy rows always give their argmax.
    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())
    greedy = sb.temperature == 0
    assert torch.equal(got[greedy], probs[greedy].argmax(-1))


@pytest.mark.parametrize("mode", ["random", "coupled"])
def test_sample_tokens_distribution(mode):
    n, vocab = 40_000, 6
    probs = torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05, 0.0]]).expand(n, vocab)
    sb = _batch([SamplingParams(1.0, seed=0)]).select([0] * n)
    sb.seed = torch.arange(n) + 99
    counts = torch.bincount(sample_tokens(probs, sb, torch.full((n,), 5), mode, salt=0), minlength=vocab)
    assert int(counts[5]) == 0
    assert _chi2_pvalue(counts[:5], probs[0, :5] * n) > 1e-4


def test_sample_tokens_seeded_and_salted():
    probs, sb, pos = _random_case(200, 50, seed=5)
    probs = torch.softmax(torch.randn(200, 50, generator=torch.Generator().manual_seed(6)), dim=-1)
    a = sample_tokens(probs, sb, pos, "random", salt=0)
    assert torch.equal(a, sample_tokens(probs, sb, pos, "random", salt=0))
    assert not torch.equal(a, sample_tokens(probs, sb, pos, "random", salt=1))
    assert not torch.equal(a, sample_tokens(probs, sb, pos + 1, "random", salt=0))
    with pytest.raises(ValueError, match="mode"):
        sample_tokens(probs, sb, pos, "nucleus", salt=0)
