"""Confidence-stopped drafts (`Level.confidence`): a model level ends a row's draft after a token it was unsure
of. The draft's length then depends only on the drafter, so outputs stay exact: greedy == plain greedy, the
sampled law is the target's; drafts get shorter where the drafter is unsure, and the workers' reports agree
with an independent computation of the probabilities.
"""

from __future__ import annotations

import pytest
import torch

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.engine.rows import token_confidence
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import PROMPTS, assert_target_law, draft, target


def test_token_confidence_is_the_raw_softmax_for_greedy_rows_and_the_drawn_probability_otherwise():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    p = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.6, 0.3]])  # row 0 greedy (one-hot), row 1 some processed law
    sb = SamplingBatch.from_params([SamplingParams(seed=1), SamplingParams(temperature=0.5, seed=2)])
    got = token_confidence(logits, p, torch.tensor([0, 2]), sb)
    assert got[0].item() == pytest.approx(torch.softmax(logits[0], -1)[0].item())
    assert got[1].item() == pytest.approx(0.3)


def test_verify_reports_the_probability_of_each_emitted_token():
    """confidence=True: per emitted token, the level's probability of it (here checked against the softmax of
    the same worker's logits, scored by a T=1 verification that returns its distributions)."""
    w = FakeWorker("w", vocab=16, order=2, table_seed=3, sharpness=1.0)
    sp = SamplingParams(seed=5)
    w.add("a", PROMPTS[0])
    res = w.verify(["a"], [[3, 4, 5]], None, [sp], VerifyMethod.GREEDY, confidence=True)
    assert res.confidence is not None and len(res.confidence[0]) == len(res.token_ids[0])
    # the same context scored at T = 1 without filters: processed probs == softmax of the raw logits
    w.add("b", PROMPTS[0])
    t1 = SamplingParams(temperature=1.0, seed=5)
    ref = w.verify(["b"], [res.token_ids[0][:-1]], None, [t1], VerifyMethod.DETERMINISTIC, return_probs=True)
    for j, tok in enumerate(res.token_ids[0]):
        assert res.confidence[0][j] == pytest.approx(ref.probs[0, j, tok].item(), rel=1e-5)
    # without the flag nothing is computed
    w.add("c", PROMPTS[0])
    assert w.verify(["c"], [[3]], None, [sp], VerifyMethod.GREEDY).confidence is None


def test_propose_stops_a_row_after_its_first_unsure_token():
    w = FakeWorker("w", vocab=16, order=2, table_seed=3, sharpness=1.0)
    sp = SamplingParams(seed=5)
    for sid in ("full", "cut"):
        w.add(sid, PROMPTS[1])
    full = w.propose(["full"], [8], [sp]).token_ids[0]
    # the probabilities of the full greedy draft, position by position
    w.add("score", PROMPTS[1])
    conf = w.verify(["score"], [full[:-1]], None, [sp], VerifyMethod.GREEDY, confidence=True).confidence[0]
    floor = sorted(conf)[len(conf) // 2]  # some tokens fall below it, some not
    cut = w.propose(["cut"], [8], [sp], stop_below=floor).token_ids[0]
    first_unsure = next(j for j, c in enumerate(conf) if c < floor)
    assert cut == full[: first_unsure + 1]
    w.add("tiny", PROMPTS[1])
    assert w.propose(["tiny"], [8], [sp], stop_below=1e-9).token_ids[0] == full  # never unsure: all 8


@pytest.mark.parametrize("overlap", [False, True])
def test_confidence_cascades_are_exact_greedy_and_draft_less(overlap):
    plain = generate([Level("target", worker=target())], PROMPTS, max_tokens=30, ignore_eos=True)

    def levels(conf: float) -> list[Level]:
        return [Level("ngram", ngram=NgramConfig(3, 1, 3)),
                Level("d", worker=draft(0.8), k=6, method=VerifyMethod.GREEDY, confidence=conf),
                Level("target", worker=target(), method=VerifyMethod.GREEDY)]

    def models(conf: float) -> list[Level]:
        return [Level("d1", worker=draft(1.0, "d1", 3), k=4, confidence=conf),
                Level("target", worker=target(), method=VerifyMethod.GREEDY)]

    def run(lv: list[Level], bounded: bool):
        eng = CascadeEngine(lv, overlap=overlap)
        eng.ahead_bounded = bounded
        return generate(eng, PROMPTS, max_tokens=30, ignore_eos=True)

    for make in (levels, models):
        for bounded in (True, False):  # bounded look-aheads: draft lengths follow timing as well
            loose, sure = run(make(0.0), bounded), run(make(0.5), bounded)
            assert [r.token_ids for r in sure.results] == [r.token_ids for r in plain.results]
            assert [r.token_ids for r in loose.results] == [r.token_ids for r in plain.results]
        # unsure drafts were cut: fewer draft tokens reached the target, and a larger share was accepted
        # (K-token look-aheads, so that draft lengths depend on the confidence alone)
        lo, hi = loose.stats["target"], sure.stats["target"]
        assert hi.draft_tokens < lo.draft_tokens
        assert hi.acceptance_rate > lo.acceptance_rate


@pytest.mark.parametrize("method", [VerifyMethod.DETERMINISTIC, VerifyMethod.REJECTION])
def test_confidence_cascade_sampled_law_is_the_targets(method):
    """Drafts cut at the drafters' unsure tokens (both model levels) keep the target's 3-token joint law."""
    vocab, n_draws, n_tok = 5, 6000, 3

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    levels = [Level("d1", worker=mk("d1", 0.3, 3), k=2, confidence=0.35),
              Level("d2", worker=mk("d2", 0.2, 4), k=3, method=method, confidence=0.35),
              Level("t", worker=mk("t", 0, 0), method=method)]
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [1, 2, 1, 2, 1]
    sps = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, 30_000 + i) for i in range(n_draws)]
    batch = generate(levels, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True)
    st = batch.stats["t"]
    assert 0 < st.draft_tokens < 3 * st.num_drafts  # some drafts were cut short
    assert_target_law(batch, levels[-1].worker, prompt, sp, n_tok)


def test_confidence_must_be_a_probability():
    with pytest.raises(ValueError, match="confidence"):
        Level("d", worker=draft(0.5), confidence=1.0)
