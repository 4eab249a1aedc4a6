"""Statistical exactness of sampled verification: emitted tokens follow the target's processed distribution.

Each case draws N = 100_000 independent rounds as one batch (row b has seed b, so its keyed noise is
independent of every other row's), with a fixed random target and a *different* drafter. The seeds are
fixed, so the tests are deterministic; the bounds below say why they would also hold for fresh seeds.

Concentration bound used throughout (Bretagnolle-Huber-Carol inequality): for the empirical distribution
p_hat of N draws from p over m categories, P(||p_hat - p||_1 >= lam) <= 2^m * exp(-N lam^2 / 2). Solving
for a failure probability delta gives TV(p_hat, p) = ||.||_1 / 2 < sqrt(2 (m ln 2 + ln(1/delta)) / N) / 2.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

from specray.spec.noise import sample_tokens
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.spec.verify import VerifyOutput, verify

N = 100_000
VOCAB = 10
K = 2
DELTA = 1e-6  # allowed failure probability of each concentration check

METHODS = [VerifyMethod.REJECTION, VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED]
TEMPERATURES = [0.7, 1.0]
FILTERS = {"plain": (0, 1.0), "top_k_top_p": (6, 0.85)}
CASES = [(m, t, f) for m in METHODS for t in TEMPERATURES for f in FILTERS]
CASE_IDS = [f"{m.value}-T{t}-{f}" for m, t, f in CASES]


def tv_bound(n: int, categories: int, delta: float = DELTA) -> float:
    """TV distance the empirical distribution of n draws stays below with probability 1 - delta (BHC)."""
    return 0.5 * math.sqrt(2 * (categories * math.log(2) + math.log(1 / delta)) / n)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value over the support of probs: Q(df/2, stat/2), the regularised upper gamma."""
    support = probs > 0
    expected = probs[support].double() * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@dataclass(frozen=True)
class Run:
    """One case: its processed distributions and the verification of N independent rounds."""

    p: torch.Tensor  # [K+1, V] target processed probs
    q: torch.Tensor  # [K, V] drafter processed probs
    draft_ids: torch.Tensor  # [N, K]
    out: VerifyOutput


@functools.cache
def run_case(method: VerifyMethod, temperature: float, filt: str) -> Run:
    top_k, top_p = FILTERS[filt]
    gen = torch.Generator().manual_seed(2024)
    target_logits = torch.randn(1, K + 1, VOCAB, generator=gen) * 1.5
    draft_logits = 0.5 * target_logits[:, :K] + torch.randn(1, K, VOCAB, generator=gen)  # a different drafter
    one = SamplingBatch.from_params([SamplingParams(temperature, top_k=top_k, top_p=top_p, seed=0)])
    p = processed_probs(target_logits, one)[0]
    q = processed_probs(draft_logits, one)[0]
    sb = one.select([0] * N)
    sb.seed = torch.arange(N, dtype=torch.int64) + 1_000_003 * CASES.index((method, temperature, filt))
    positions = torch.randint(0, 2**20, (N,), generator=gen)
    # The drafter samples from q with its own level's noise (salt 0); coupled drafting uses the shared noise.
    mode = "coupled" if method == VerifyMethod.COUPLED else "random"
    draft_ids = torch.stack(
        [sample_tokens(q[j].expand(N, VOCAB), sb, positions + j, mode, salt=0) for j in range(K)], dim=1
    )
    draft_probs = q.expand(N, K, VOCAB) if method == VerifyMethod.REJECTION else None
    out = verify(method, p.expand(N, K + 1, VOCAB), draft_ids, draft_probs, sb, positions, salt=1)
    return Run(p, q, draft_ids, out)


def _histogram(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB)


@pytest.mark.parametrize(("method", "temperature", "filt"), CASES, ids=CASE_IDS)
def test_first_token_follows_target(method, temperature, filt):
    run = run_case(method, temperature, filt)
    counts = _histogram(run.out.output_ids[:, 0])
    support = run.p[0] > 0
    assert int(counts[~support].sum()) == 0  # filtered tokens are never emitted
    bound = tv_bound(N, int(support.sum()))
    dist = tv(counts / N, run.p[0])
    assert dist < bound
    assert chi2_pvalue(counts, run.p[0]) > 1e-4
    # Power: the drafter's distribution and random references are all much farther away, so a verifier
    # that leaked the drafter's distribution (or any other bias of this size) would fail.
    refs = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((20,))
    assert tv(counts / N, run.q[0]) > 5 * bound
    assert min(tv(counts / N, r) for r in refs) > 5 * bound
    assert dist < 0.2 * tv(run.q[0], run.p[0])


@pytest.mark.parametrize(("method", "temperature", "filt"), CASES, ids=CASE_IDS)
def test_error_shrinks_with_draws(method, temperature, filt):
    """Ten disjoint 10k blocks vs all 100k draws: the error shrinks (~1/sqrt(N)) and varies like iid draws."""
    run = run_case(method, temperature, filt)
    p = run.p[0]
    support = p > 0
    m = int(support.sum())
    blocks = run.out.output_ids[:, 0].view(10, N // 10)
    small = [tv(_histogram(b) / (N // 10), p) for b in blocks]
    large = tv(_histogram(blocks.flatten()) / N, p)
    assert max(small) < tv_bound(N // 10, m) and large < tv_bound(N, m)
    assert large < sum(small) / len(small)  # expected ratio sqrt(10); averaging blocks makes it stable
    # Under independent draws the ten blocks' chi-square statistics add up to a chi-square with 10 (m - 1)
    # degrees of freedom: too small a sum would mean draws that are not independent, too large a bias.
    expected = p[support].double() * (N // 10)
    stat = sum(float(((_histogram(b)[support] - expected) ** 2 / expected).sum()) for b in blocks)
    dof = torch.tensor(10 * (m - 1) / 2, dtype=torch.float64)
    half = torch.tensor(stat / 2, dtype=torch.float64)
    assert min(float(torch.special.gammainc(dof, half)), float(torch.special.gammaincc(dof, half))) > 1e-4


@pytest.mark.parametrize(("method", "temperature", "filt"), CASES, ids=CASE_IDS)
def test_second_token_given_first_accepted_follows_target(method, temperature, filt):
    run = run_case(method, temperature, filt)
    accepted = run.out.num_accepted >= 1
    n = int(accepted.sum())
    assert n > N // 10
    counts = _histogram(run.out.output_ids[accepted, 1])
    assert int(counts[run.p[1] == 0].sum()) == 0
    assert tv(counts / n, run.p[1]) < tv_bound(n, int((run.p[1] > 0).sum()))
    assert chi2_pvalue(counts, run.p[1]) > 1e-4


@pytest.mark.parametrize(("method", "temperature", "filt"), CASES, ids=CASE_IDS)
def test_acceptance_rate_matches_theory(method, temperature, filt):
    run = run_case(method, temperature, filt)
    p, q = run.p[0].double(), run.q[0].double()
    rate = float((run.out.num_accepted >= 1).double().mean())
    if method == VerifyMethod.REJECTION:
        expected = float(torch.minimum(p, q).sum())  # 1 - TV(p, q): the optimal acceptance
    elif method == VerifyMethod.DETERMINISTIC:
        expected = float((p * q).sum())  # x ~ q accepted w.p. p(x)
    else:
        # Gumbel-max coupling matches with probability >= (1 - TV) / (1 + TV); no closed form.
        d = tv(p, q)
        assert rate > (1 - d) / (1 + d) - 5 * math.sqrt(0.25 / N)
        return
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / N) + 1e-9


def test_bound_has_power_against_a_small_bias():
    """The TV bound at N = 100k detects a 3% shift of mass, so passing it is a meaningful check."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(VOCAB, generator=gen), dim=0)
    biased = p.clone()
    biased[0] += 0.03
    biased[1:] *= (1 - biased[0]) / biased[1:].sum()
    counts = torch.bincount(torch.multinomial(biased, N, replacement=True, generator=gen), minlength=VOCAB)
    assert tv(counts / N, p) > tv_bound(N, VOCAB)
    assert chi2_pvalue(counts, p) < 1e-6
