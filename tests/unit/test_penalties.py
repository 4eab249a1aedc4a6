"""Penalties, min_p and raw log-probabilities (specray/spec/sampling.py) and their exactness under speculation.

The batched code is checked against the per-row reference (`specray.spec.reference`); whole cascades of fake
workers (the real protocol logic, a closed-form target) are checked to emit exactly the target's penalized
distribution: greedy token for token against plain decoding, sampled statistically against the exact law
computed with the reference, which the emitted law must match far better than the unpenalized one.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.spec.ngram import NgramConfig
from specray.spec.params import PLACEHOLDER_TOKEN_ID as PH
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.reference import ref_penalized_logits_row, ref_processed_probs_row
from specray.spec.sampling import SamplingBatch, TokenHistory, apply_penalties, processed_probs, raw_logprobs
from specray.testing.fake import FakeWorker
from specray.testing.goodness import chi2_crit, chi2_stat

PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.8, repetition_penalty=1.5)


# ------------------------------------------------------------------------------------- the batched math


def test_params_validate_and_know_when_they_penalize():
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=-0.5).penalized and SamplingParams(frequency_penalty=2).penalized
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(frequency_penalty=-2.5),
                dict(repetition_penalty=0), dict(logprobs=21), dict(logprobs=-1), dict(prompt_len=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    sp = SamplingParams(temperature=0.5, min_p=0.1, **PENALTIES).with_seed().for_prompt(7)
    assert sp.seed is not None and sp.prompt_len == 7 and sp.min_p == 0.1 and sp.repetition_penalty == 1.5


def test_token_history_counts_output_and_marks_everything_seen():
    h = TokenHistory.from_tokens([[1, 2, 2, 3, 3, 3], [4, 0]], [2, 1], vocab=6)
    assert h.output_counts.tolist() == [[0, 0, 1, 3, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert h.seen.tolist() == [[False, True, True, True, False, False], [True, False, False, False, True, False]]
    h.add([1, 0], torch.tensor([5, 1]))
    assert h.output_counts[1, 5] == 1 and h.output_counts[0, 1] == 1 and bool(h.seen[1, 5])
    assert h.select([1]).output_counts.tolist() == [[1, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize("seed", range(4))
def test_apply_penalties_equals_the_reference_slot_by_slot(seed):
    """Slot j is penalized with the row's history plus its drafts before j, as plain decoding would be there."""
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 12, 4
    params = [SamplingParams(1.0, seed=0, **PENALTIES), SamplingParams(0.0, seed=0, repetition_penalty=0.7),
              SamplingParams(0.7, seed=0), SamplingParams(1.0, seed=0, presence_penalty=-1.0, frequency_penalty=0.3)]
    rows = len(params)
    lengths = torch.randint(1, 9, (rows,), generator=gen).tolist()
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    prompt_lens = [int(torch.randint(0, len(t) + 1, (1,), generator=gen)) for t in tokens]
    drafts = torch.randint(0, vocab, (rows, k), generator=gen)
    drafts[1, 2:] = PH  # ragged: padding after a row's real drafts
    drafts[3, :] = PH
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 3
    sb = SamplingBatch.from_params(params)
    got = apply_penalties(logits, sb, TokenHistory.from_tokens(tokens, prompt_lens, vocab), drafts)
    for b, sp in enumerate(params):
        real = [t for t in drafts[b].tolist() if t != PH]
        for j in range(len(real) + 1):
            out = tokens[b][prompt_lens[b]:] + real[:j]
            want = ref_penalized_logits_row(logits[b, j], tokens[b][: prompt_lens[b]], out, sp.presence_penalty,
                                            sp.frequency_penalty, sp.repetition_penalty)
            assert torch.equal(got[b, j], want), (b, j)
    assert torch.equal(got[2], logits[2])  # an unpenalized row is untouched


def test_no_penalty_no_work_and_history_required():
    logits = torch.randn(2, 3, 5)
    sb = SamplingBatch.from_params([SamplingParams(1.0, seed=0)] * 2)
    assert apply_penalties(logits, sb, None) is logits  # float32 logits of unpenalized rows: not even a copy
    with pytest.raises(ValueError, match="TokenHistory"):
        apply_penalties(logits, SamplingBatch.from_params([SamplingParams(1.0, seed=0, **PENALTIES)] * 2), None)


def test_repetition_penalty_changes_the_greedy_token():
    logits = torch.tensor([[[3.0, 2.5, -1.0, 0.0]]])
    sb = SamplingBatch.from_params([SamplingParams(0.0, seed=0, repetition_penalty=1.5)])
    hist = TokenHistory.from_tokens([[0, 2]], [1], vocab=4)  # token 0 in the prompt: 3 / 1.5 = 2 < 2.5
    probs = processed_probs(apply_penalties(logits, sb, hist), sb)
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_min_p_matches_reference_with_other_filters():
    gen = torch.Generator().manual_seed(3)
    vocab = 23
    params = [SamplingParams(t, top_k=k, top_p=p, min_p=m, seed=0)
              for t, k, p, m in itertools.product((0.0, 0.5, 1.0, 1.6), (0, 3, 40), (1.0, 0.8), (0.0, 0.05, 0.3, 1.0))]
    logits = torch.randn(len(params), 2, vocab, generator=gen) * 2
    got = processed_probs(logits, SamplingBatch.from_params(params))
    want = torch.stack([torch.stack([ref_processed_probs_row(logits[b, j], sp.temperature, sp.top_k, sp.top_p,
                                                             sp.min_p) for j in range(2)])
                        for b, sp in enumerate(params)])
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    probs = torch.tensor([0.5, 0.26, 0.24, 0.0, 0.0]) + 1e-9
    logits = probs.log().view(1, 1, -1)
    out = processed_probs(logits, SamplingBatch.from_params([SamplingParams(1.0, min_p=0.5, seed=0)]))[0, 0]
    assert (out > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(out[:2], torch.tensor([0.5, 0.26]) / 0.76)


def test_raw_logprobs_are_log_softmax_with_top_alternatives():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    chosen, ids, vals = raw_logprobs(logits, torch.tensor([2, 1]), 2)
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(chosen, torch.stack([lp[0, 2], lp[1, 1]]))
    assert ids.tolist()[0] == [1, 2] and ids.tolist()[1][0] == 0
    torch.testing.assert_close(vals, lp.gather(1, ids))
    assert raw_logprobs(logits, torch.tensor([0, 0]), 0)[1].shape == (2, 0)


# ------------------------------------------------------------------------------------- whole cascades

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


def _target() -> FakeWorker:
    return FakeWorker("target", vocab=16, order=2, table_seed=0)


def _draft(noise: float, name: str, seed: int) -> FakeWorker:
    return FakeWorker(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)


def _cascades(method: VerifyMethod) -> dict[str, list[Level]]:
    return {
        "plain": [Level("target", worker=_target(), method=method)],
        "ngram": [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=_target(), method=method)],
        "draft": [Level("d", worker=_draft(0.7, "d", 1), k=3), Level("target", worker=_target(), method=method)],
        "cascade3": [Level("ngram", ngram=NgramConfig(2, 1, 3)), Level("d", worker=_draft(0.5, "d", 1), k=4,
                     method=method), Level("target", worker=_target(), method=method)],
        "cascade3_models": [Level("d1", worker=_draft(1.0, "d1", 3), k=2),
                            Level("d2", worker=_draft(0.4, "d2", 4), k=5, method=method),
                            Level("target", worker=_target(), method=method)],
    }


def _plain_penalized_greedy(prompt: list[int], sp: SamplingParams, n: int) -> list[int]:
    """Plain greedy decoding from the reference: argmax of the penalized logits, token by token."""
    t, out = _target(), []
    for _ in range(n):
        x = ref_penalized_logits_row(t.next_logits(prompt + out), prompt, out, sp.presence_penalty,
                                     sp.frequency_penalty, sp.repetition_penalty)
        out.append(int(torch.argmax(x)))
    return out


@pytest.mark.parametrize("method", list(VerifyMethod))
def test_greedy_with_penalties_equals_plain_for_every_cascade(method):
    """Greedy rows (ragged prompts, each with other penalties) beside a sampled row, so that the configured
    method really verifies them (a batch of greedy rows alone is verified greedily whatever the method)."""
    sps = [SamplingParams(0.0, **PENALTIES), SamplingParams(0.9, seed=3, **PENALTIES),
           SamplingParams(0.0, presence_penalty=1.0, min_p=0.2), SamplingParams(0.0, frequency_penalty=0.5)]
    greedy = [0, 2, 3]
    want = [_plain_penalized_greedy(PROMPTS[b], sps[b], 16) for b in greedy]
    unpenalized = generate(_cascades(method)["plain"], PROMPTS, max_tokens=16, ignore_eos=True).results
    assert want != [unpenalized[b].token_ids for b in greedy]  # the penalties matter here
    for name, levels in _cascades(method).items():
        batch = generate(levels, PROMPTS, max_tokens=16, sampling=sps, ignore_eos=True)
        assert [batch.results[b].token_ids for b in greedy] == want, name
        if name != "plain":  # drafts were verified (penalized text rarely repeats: n-gram drafts may all fail)
            assert batch.stats["target"].draft_tokens > 0, name
            assert name == "ngram" or batch.stats["target"].accepted_tokens > 0, name


def test_coupled_with_penalties_is_the_same_sample_whatever_the_drafter():
    sps = [SamplingParams(0.9, seed=50 + i, min_p=0.05, **PENALTIES) for i in range(len(PROMPTS))]
    outs = {name: [r.token_ids for r in generate(levels, PROMPTS, max_tokens=16, sampling=sps,
                                                  ignore_eos=True).results]
            for name, levels in _cascades(VerifyMethod.COUPLED).items()}
    for name, out in outs.items():
        assert out == outs["plain"], name


def _law(worker: FakeWorker, prompt: list[int], sp: SamplingParams, n: int, penalize: bool) -> dict[tuple, float]:
    """Exact joint law of the next n tokens under the reference's (penalized) processed distribution."""
    out = {}
    for seq in itertools.product(range(worker.vocab_size), repeat=n):
        pr = 1.0
        for j, t in enumerate(seq):
            logits = worker.next_logits(prompt + list(seq[:j]))
            if penalize:
                logits = ref_penalized_logits_row(logits, prompt, list(seq[:j]), sp.presence_penalty,
                                                  sp.frequency_penalty, sp.repetition_penalty)
            pr *= float(ref_processed_probs_row(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p)[t])
        if pr > 0:
            out[seq] = pr
    return out


def _tv(counts: dict[tuple, int], law: dict[tuple, float], n_draws: int) -> float:
    keys = set(counts) | set(law)
    return 0.5 * sum(abs(counts.get(k, 0) / n_draws - law.get(k, 0.0)) for k in keys)


@pytest.mark.parametrize(
    "method,setup,temperature",
    [
        (VerifyMethod.REJECTION, "cascade3_models", 0.7),
        (VerifyMethod.DETERMINISTIC, "cascade3", 1.0),
        (VerifyMethod.REJECTION, "draft", 1.0),
        pytest.param(VerifyMethod.COUPLED, "cascade3_models", 0.7, marks=pytest.mark.slow),
    ],
)
def test_penalized_output_distribution_is_the_targets(method, setup, temperature):
    """The joint law of 3 emitted tokens with penalties and min_p equals the target's penalized law (chi-square),
    and is far from the unpenalized law (the penalties are really applied, at every drafted position)."""
    vocab, n_draws, n_tok = 4, 6000, 3

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    levels = {
        "draft": [Level("d", worker=mk("d", 0.8, 2), k=3), Level("t", worker=mk("t", 0, 0), method=method)],
        "cascade3": [Level("ng", ngram=NgramConfig(2, 1, 2)), Level("d", worker=mk("d", 0.6, 2), k=3, method=method),
                     Level("t", worker=mk("t", 0, 0), method=method)],
        "cascade3_models": [Level("d1", worker=mk("d1", 1.2, 3), k=2), Level("d2", worker=mk("d2", 0.5, 4), k=3,
                            method=method), Level("t", worker=mk("t", 0, 0), method=method)],
    }[setup]
    prompt = [1, 2, 1, 2, 1]
    sp = SamplingParams(temperature, min_p=0.08, **PENALTIES)
    sps = [SamplingParams(temperature, seed=20_000 + i, min_p=0.08, **PENALTIES) for i in range(n_draws)]
    batch = generate(levels, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True)
    counts: dict[tuple, int] = {}
    for r in batch.results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    law = _law(levels[-1].worker, prompt, sp, n_tok, penalize=True)
    assert set(counts) <= set(law), "emitted a sequence the penalized target cannot produce"
    stat, dof = chi2_stat(counts, law, n_draws)
    assert stat < chi2_crit(dof), f"chi2={stat:.1f} > {chi2_crit(dof):.1f} (dof {dof})"
    wrong = _law(levels[-1].worker, prompt, sp, n_tok, penalize=False)
    tv_right, tv_wrong = _tv(counts, law, n_draws), _tv(counts, wrong, n_draws)
    # Bretagnolle-Huber-Carol: with probability 1 - 1e-6 the empirical law of n draws over m cells is within
    # TV 0.5 * sqrt(2 (m ln 2 + ln 1e6) / n) of the law it was drawn from (0.07 here); the unpenalized law is
    # about 0.4 away from the penalized one, so it lies far outside that ball
    bound = 0.5 * math.sqrt(2 * (vocab**n_tok * math.log(2) + math.log(1e6)) / n_draws)
    assert tv_right < bound < tv_wrong / 3, (tv_right, bound, tv_wrong)
    assert batch.stats["t"].accepted_tokens > 0
