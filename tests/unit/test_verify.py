"""Exact behaviour of batched verification (specray/spec/verify.py): tables, reference equality, coupling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specray.spec.noise import sample_tokens
from specray.spec.params import PLACEHOLDER_TOKEN_ID as PH
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.reference import ref_verify
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.spec.verify import VerifyOutput, count_drafts, verify, verify_logits

ALL_METHODS = list(VerifyMethod)
SAMPLED_METHODS = [VerifyMethod.REJECTION, VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED]


def _one_hot(tokens: list[list[int]], vocab: int) -> torch.Tensor:  # -> [B, K+1, V]
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def _greedy_sb(rows: int) -> SamplingBatch:
    return SamplingBatch.from_params([SamplingParams(0.0, seed=100 + i) for i in range(rows)])


def _draft_probs_for(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """What a greedy drafter would send: one-hot at its token (uniform for padding)."""
    probs = torch.full((*draft_ids.shape, vocab), 1.0 / vocab)
    real = draft_ids != PH
    probs[real] = torch.nn.functional.one_hot(draft_ids[real], vocab).float()
    return probs


# ------------------------------------------------------------------------------- greedy exact tables

VOCAB = 8
GREEDY_TABLES = {
    # name: (target argmax per slot, draft ids, expected output_ids, expected num_accepted)
    "perfect_match": ([[1, 2, 3, 4]], [[1, 2, 3]], [[1, 2, 3, 4]], [3]),
    "early_mismatch": ([[1, 5, 3, 4]], [[1, 2, 3]], [[1, 5, PH, PH]], [1]),
    "first_mismatch": ([[7, 2, 3, 4]], [[1, 2, 3]], [[7, PH, PH, PH]], [0]),
    "last_mismatch": ([[1, 2, 6, 4]], [[1, 2, 3]], [[1, 2, 6, PH]], [2]),
    "empty_draft_k0": ([[6], [2]], [[], []], [[6], [2]], [0, 0]),
    "mixed_ragged_batch": (
        [[1, 2, 3, 4], [0, 1, 2, 3], [5, 6, 7, 0], [5, 6, 7, 0], [3, 3, 3, 3]],
        [[1, 2, 3], [PH, PH, PH], [5, 6, PH], [5, 1, PH], [3, PH, PH]],
        [[1, 2, 3, 4], [0, PH, PH, PH], [5, 6, 7, PH], [5, 6, PH, PH], [3, 3, PH, PH]],
        [3, 0, 2, 1, 1],
    ),
}


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("case", list(GREEDY_TABLES))
def test_greedy_tables(method, case):
    """At temperature 0 every method is greedy verification: exact expected outputs."""
    target, drafts, expected, accepted = GREEDY_TABLES[case]
    rows = len(target)
    draft_ids = torch.tensor(drafts, dtype=torch.int64).view(rows, len(target[0]) - 1)
    draft_probs = _draft_probs_for(draft_ids, VOCAB) if method == VerifyMethod.REJECTION else None
    out = verify(
        method, _one_hot(target, VOCAB), draft_ids, draft_probs, _greedy_sb(rows), torch.arange(rows), 1
    )
    assert out.output_ids.tolist() == expected
    assert out.num_accepted.tolist() == accepted
    assert out.num_emitted.tolist() == [a + 1 for a in accepted]
    assert out.output_ids.dtype == torch.int64 and out.num_accepted.dtype == torch.int64


def test_greedy_method_uses_argmax_of_soft_probs():
    probs = torch.softmax(torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]), dim=-1)
    sb = SamplingBatch.from_params([SamplingParams(1.0, seed=0)])
    out = verify(VerifyMethod.GREEDY, probs, torch.tensor([[1, 0]]), None, sb, torch.tensor([0]), 1)
    assert out.output_ids.tolist() == [[1, 0, 2]] and out.num_accepted.tolist() == [2]


def test_rejection_one_hot_target_overrides_inconsistent_draft_probs():
    """Greedy target; the drafter claims q = one-hot at a token it did not send: empty residual -> use p."""
    target = _one_hot([[3, 1]], VOCAB)
    draft_ids = torch.tensor([[5]])
    q = _one_hot([[3]], VOCAB)  # q(5) = 0 and max(p - q, 0) = 0 everywhere
    out = verify(VerifyMethod.REJECTION, target, draft_ids, q, _greedy_sb(1), torch.tensor([0]), 1)
    assert out.output_ids.tolist() == [[3, PH]]
    # q(x) = 0 but p(x) = 1: min(1, p/q) = 1, accepted.
    out = verify(
        VerifyMethod.REJECTION,
        target,
        torch.tensor([[3]]),
        _one_hot([[5]], VOCAB),
        _greedy_sb(1),
        torch.tensor([0]),
        1,
    )
    assert out.output_ids.tolist() == [[3, 1]]


def test_count_drafts_and_token_lists():
    draft_ids = torch.tensor([[4, 5, 6], [PH, PH, PH], [1, PH, PH], [2, PH, 3]])
    assert count_drafts(draft_ids).tolist() == [3, 0, 1, 1]  # placeholders end a row's draft
    out = VerifyOutput(torch.tensor([[4, 5, PH], [7, PH, PH]]), torch.tensor([1, 0]))
    assert out.token_lists() == [[4, 5], [7]]


# -------------------------------------------------------------------------- batched == reference


def _random_problem(
    gen: torch.Generator, method: VerifyMethod, rows: int, k: int, vocab: int, temps: tuple[float, ...]
) -> tuple:
    params = []
    for i in range(rows):
        t = temps[int(torch.randint(len(temps), (1,), generator=gen))]
        top_k = int(torch.randint(0, vocab + 2, (1,), generator=gen)) if i % 2 else 0
        top_p = (1.0, 0.95, 0.7, 0.3)[int(torch.randint(4, (1,), generator=gen))]
        params.append(
            SamplingParams(t, top_k=top_k, top_p=top_p, seed=int(torch.randint(2**62, (1,), generator=gen)))
        )
    sb = SamplingBatch.from_params(params)
    scale = float(torch.rand((), generator=gen)) * 4
    target_probs = processed_probs(torch.randn(rows, k + 1, vocab, generator=gen) * scale, sb)
    draft_probs = processed_probs(torch.randn(rows, k, vocab, generator=gen) * scale, sb)
    positions = torch.randint(0, 2**40, (rows,), generator=gen)
    # Drafts: the drafter's own samples, the target's argmax (to get long accepted runs) or arbitrary ids.
    sampled = (
        torch.stack(
            [sample_tokens(draft_probs[:, j], sb, positions + j, "random", 0) for j in range(k)], dim=1
        )
        if k
        else torch.zeros(rows, 0, dtype=torch.int64)
    )
    kind = torch.randint(3, (rows, 1), generator=gen)
    arbitrary = torch.randint(vocab, (rows, k), generator=gen)
    draft_ids = torch.where(
        kind == 0, sampled, torch.where(kind == 1, target_probs[:, :k].argmax(-1), arbitrary)
    )
    num_draft = torch.randint(0, k + 1, (rows, 1), generator=gen)
    draft_ids = torch.where(torch.arange(k) < num_draft, draft_ids, PH)
    return target_probs, draft_ids, draft_probs if method == VerifyMethod.REJECTION else None, sb, positions


def _assert_matches_reference(
    method, target_probs, draft_ids, draft_probs, sb, positions, salt
) -> VerifyOutput:
    got = verify(method, target_probs, draft_ids, draft_probs, sb, positions, salt)
    want = ref_verify(method, target_probs, draft_ids, draft_probs, sb, positions, salt)
    assert torch.equal(got.output_ids, want.output_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    return got


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("temps", [(0.0,), (0.7,), (1.0,), (0.0, 0.7, 1.0)])
def test_batched_equals_reference_seeded(method, temps):
    gen = torch.Generator().manual_seed(ALL_METHODS.index(method) * 100 + round(sum(temps) * 10) + len(temps))
    accepted = 0
    for _ in range(6):
        rows, k, vocab = (
            24,
            int(torch.randint(0, 6, (1,), generator=gen)),
            int(torch.randint(2, 14, (1,), generator=gen)),
        )
        problem = _random_problem(gen, method, rows, k, vocab, temps)
        accepted += int(_assert_matches_reference(method, *problem, salt=3).num_accepted.sum())
    assert accepted > 0  # the cases exercise acceptance, not only first-slot rejection


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 9),
    k=st.integers(0, 5),
    vocab=st.integers(1, 12),
    method=st.sampled_from(ALL_METHODS),
    salt=st.integers(0, 5),
)
def test_batched_equals_reference_hypothesis(seed, rows, k, vocab, method, salt):
    gen = torch.Generator().manual_seed(seed)
    problem = _random_problem(gen, method, rows, k, vocab, (0.0, 0.7, 1.0))
    _assert_matches_reference(method, *problem, salt=salt)


# ------------------------------------------------------------------------------------------ coupling


def _coupled_tokens(
    target_probs, sb, positions, salt
) -> torch.Tensor:  # [B, K+1]: what plain decoding samples
    return torch.stack(
        [
            sample_tokens(target_probs[:, j], sb, positions + j, "coupled", salt)
            for j in range(target_probs.shape[1])
        ],
        dim=1,
    )


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_coupled_output_does_not_depend_on_the_draft(temperature):
    gen = torch.Generator().manual_seed(7)
    rows, k, vocab = 300, 4, 12
    sb = SamplingBatch.from_params(
        [SamplingParams(temperature, top_k=(0, 6)[i % 2], seed=i) for i in range(rows)]
    )
    target_probs = processed_probs(torch.randn(rows, k + 1, vocab, generator=gen), sb)
    draft_probs = processed_probs(torch.randn(rows, k, vocab, generator=gen), sb)
    positions = torch.randint(0, 1000, (rows,), generator=gen)
    y = _coupled_tokens(target_probs, sb, positions, salt=2)
    drafts = {
        "random": torch.randint(vocab, (rows, k), generator=gen),
        "perfect": y[:, :k],
        "coupled_drafter": _coupled_tokens(draft_probs, sb, positions, salt=0)[:, :k],
        "none": torch.full((rows, k), PH),
        "ragged": torch.where(
            torch.arange(k) < torch.randint(0, k + 1, (rows, 1), generator=gen), y[:, :k], PH
        ),
    }
    for name, draft_ids in drafts.items():
        out = verify(VerifyMethod.COUPLED, target_probs, draft_ids, None, sb, positions, salt=2)
        slots = torch.arange(k + 1)
        emitted = slots <= out.num_accepted.unsqueeze(1)
        assert torch.equal(out.output_ids[emitted], y[emitted]), name
        if name == "perfect":
            assert out.num_accepted.tolist() == [k] * rows
    # K = 0 is plain coupled decoding.
    out = verify(
        VerifyMethod.COUPLED,
        target_probs[:, :1],
        torch.zeros(rows, 0, dtype=torch.long),
        None,
        sb,
        positions,
        salt=2,
    )
    assert torch.equal(out.output_ids[:, 0], y[:, 0])
    # A coupled drafter that resembles the target gets many tokens accepted.
    close = processed_probs(
        torch.log(target_probs[:, :k]) + 0.1 * torch.randn(rows, k, vocab, generator=gen), sb
    )
    out = verify(
        VerifyMethod.COUPLED, target_probs, _coupled_tokens(close, sb, positions, 0), None, sb, positions, 2
    )
    assert float(out.num_accepted.float().mean()) > 2.5


def _speculative_stream(
    method: VerifyMethod,
    target_table: torch.Tensor,
    draft_table: torch.Tensor | None,
    sb: SamplingBatch,
    k: int,
    length: int,
    draft_mode: str,
) -> torch.Tensor:
    """Decode `length` tokens per row with a bigram target (logits = table[previous token]).

    The drafter is another bigram table (None: no drafter, plain decoding). Rows progress at different
    speeds, so every round is a ragged batch. Returns [B, length].
    """
    rows, vocab = len(sb), target_table.shape[0]
    streams = [[0] for _ in range(rows)]  # token 0 acts as BOS at position 0
    while min(len(s) for s in streams) < length + 1:
        last = torch.tensor([s[-1] for s in streams])
        positions = torch.tensor([len(s) for s in streams])
        prev, draft_ids, draft_probs = last, [], []
        for j in range(k if draft_table is not None else 0):
            q = processed_probs(draft_table[prev].unsqueeze(1), sb)[:, 0]
            tok = sample_tokens(q, sb, positions + j, draft_mode, salt=0)
            draft_ids.append(tok)
            draft_probs.append(q)
            prev = tok
        kk = len(draft_ids)
        draft_ids_t = torch.stack(draft_ids, 1) if kk else torch.zeros(rows, 0, dtype=torch.long)
        prevs = torch.cat([last.unsqueeze(1), draft_ids_t], dim=1)  # [B, K+1]: token before each slot
        target_probs = processed_probs(target_table[prevs], sb)
        out = verify(
            method, target_probs, draft_ids_t, torch.stack(draft_probs, 1) if kk else None, sb, positions, 1
        )
        for s, toks in zip(streams, out.token_lists(), strict=True):
            s.extend(toks)
    assert all(0 <= t < vocab for s in streams for t in s)
    return torch.tensor([s[1 : length + 1] for s in streams])


def test_coupled_stream_identical_whatever_the_drafter():
    gen = torch.Generator().manual_seed(8)
    vocab, rows = 16, 32
    target = torch.randn(vocab, vocab, generator=gen) * 2
    similar = target + 0.3 * torch.randn(vocab, vocab, generator=gen)
    unrelated = torch.randn(vocab, vocab, generator=gen) * 2
    sb = SamplingBatch.from_params(
        [SamplingParams(0.9, top_p=(1.0, 0.9)[i % 2], seed=1000 + i) for i in range(rows)]
    )
    plain = _speculative_stream(VerifyMethod.COUPLED, target, None, sb, 0, 12, "coupled")
    for drafter, mode in (
        (similar, "coupled"),
        (unrelated, "coupled"),
        (similar, "random"),
        (target, "coupled"),
    ):
        for k in (1, 3):
            got = _speculative_stream(VerifyMethod.COUPLED, target, drafter, sb, k, 12, mode)
            assert torch.equal(got, plain)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_assisted_greedy_equals_plain_greedy(method):
    gen = torch.Generator().manual_seed(9)
    vocab, rows = 16, 16
    target = torch.randn(vocab, vocab, generator=gen)
    drafter = target + 0.5 * torch.randn(vocab, vocab, generator=gen)
    sb = _greedy_sb(rows)
    plain = _speculative_stream(method, target, None, sb, 0, 10, "greedy")
    assert torch.equal(_speculative_stream(method, target, drafter, sb, 3, 10, "greedy"), plain)


@pytest.mark.parametrize("method", [VerifyMethod.REJECTION, VerifyMethod.DETERMINISTIC])
def test_k0_verification_is_plain_random_sampling(method):
    gen = torch.Generator().manual_seed(10)
    rows, vocab = 100, 9
    sb = SamplingBatch.from_params([SamplingParams(1.0, seed=i) for i in range(rows)])
    probs = processed_probs(torch.randn(rows, 1, vocab, generator=gen), sb)
    positions = torch.arange(rows) * 5
    none = torch.zeros(rows, 0, dtype=torch.long)
    q = torch.zeros(rows, 0, vocab) if method == VerifyMethod.REJECTION else None
    out = verify(method, probs, none, q, sb, positions, salt=4)
    assert torch.equal(out.output_ids[:, 0], sample_tokens(probs[:, 0], sb, positions, "random", salt=4))


# --------------------------------------------------------------------------------- determinism & API


@pytest.mark.parametrize("method", SAMPLED_METHODS)
def test_seeded_determinism(method):
    gen = torch.Generator().manual_seed(11)
    problem = list(_random_problem(gen, method, 64, 4, 10, (1.0,)))
    a = verify(method, *problem, salt=1)
    b = verify(method, *problem, salt=1)
    assert torch.equal(a.output_ids, b.output_ids)
    # Rows are independent of their batch: verifying a sub-batch gives the same rows.
    tp, d, q, sb, pos = problem
    rows = [5, 3, 60]
    sub = verify(
        method, tp[rows], d[rows], None if q is None else q[rows], sb.select(rows), pos[rows], salt=1
    )
    assert torch.equal(sub.output_ids, a.output_ids[rows])
    # Different seeds (or another level's salt) give different outputs.
    problem[3] = SamplingBatch(sb.temperature, sb.top_k, sb.top_p, sb.seed + 1)
    assert not torch.equal(verify(method, *problem, salt=1).output_ids, a.output_ids)
    problem[3] = sb
    if method != VerifyMethod.COUPLED:  # coupled noise is shared by all levels on purpose
        assert not torch.equal(verify(method, *problem, salt=2).output_ids, a.output_ids)


def test_verify_logits_applies_sampling_params():
    gen = torch.Generator().manual_seed(12)
    sb = SamplingBatch.from_params([SamplingParams(0.7, top_k=4, top_p=0.8, seed=i) for i in range(8)])
    logits = torch.randn(8, 3, 10, generator=gen)
    draft_ids = torch.randint(10, (8, 2), generator=gen)
    pos = torch.arange(8)
    for method in SAMPLED_METHODS:
        q = (
            processed_probs(torch.randn(8, 2, 10, generator=gen), sb)
            if method == VerifyMethod.REJECTION
            else None
        )
        a = verify_logits(method, logits, draft_ids, q, sb, pos, 1)
        b = verify(method, processed_probs(logits, sb), draft_ids, q, sb, pos, 1)
        assert torch.equal(a.output_ids, b.output_ids)


def test_verify_rejects_bad_inputs():
    sb = _greedy_sb(2)
    probs = _one_hot([[1, 2], [3, 4]], VOCAB)
    draft_ids = torch.tensor([[1], [3]])
    pos = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(VerifyMethod.REJECTION, probs, draft_ids, None, sb, pos, 1)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(VerifyMethod.REJECTION, probs, draft_ids, torch.zeros(2, 2, VOCAB), sb, pos, 1)
    with pytest.raises(ValueError, match="draft_ids"):
        verify(VerifyMethod.GREEDY, probs, torch.tensor([[1, 2], [3, 4]]), None, sb, pos, 1)
    with pytest.raises(ValueError):
        verify(VerifyMethod.GREEDY, probs, draft_ids, None, _greedy_sb(3), pos, 1)
    with pytest.raises(ValueError):
        verify("nucleus", probs, draft_ids, None, sb, pos, 1)  # type: ignore[arg-type]
    # Method names as plain strings are accepted (VerifyMethod is a str enum).
    assert verify("greedy", probs, draft_ids, None, sb, pos, 1).output_ids.tolist() == [[1, 2], [3, 4]]
