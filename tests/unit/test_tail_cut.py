"""The tail cut of a middle level's inner rounds (`Level.inner_min_share`): once fewer than that share of a round's
rows still need draft tokens, the middle level stops drafting and the others keep the shorter drafts they have.
Only draft lengths change, so outputs stay exact (greedy == plain, the sampled law is the target's); the cut is
the same whether the coordinator runs the inner rounds or the middle level does (nested), and it saves inner
rounds."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.coordinator.inner import inner_rounds
from specray.engine.protocol import DraftProposal, VerifyResult
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import assert_target_law
from tests.unit.test_nested import PROMPTS, Counting, LocalNesting


def _loop(want: list[int], accept: dict[int, int], min_share: float) -> tuple[list[list[int]], int]:
    """inner_rounds over rows whose drafts the middle level accepts `accept[b]` tokens of (then corrects one)."""
    rounds = [0]

    def propose(idx, outs, k):
        return DraftProposal([[7] * kk for kk in k])

    def verify(idx, outs, d):
        rounds[0] += 1
        toks = [d.token_ids[j][: accept.get(b, 0)] + [1] for j, b in enumerate(idx)]
        return VerifyResult(toks, [len(t) - 1 for t in toks])

    out = inner_rounds(want, 4, propose, verify, min_share=min_share)
    return out.token_ids, rounds[0]


def test_the_loop_stops_once_too_few_rows_need_tokens_but_always_runs_its_first_round():
    want = [5, 5, 5, 5]
    accept = {0: 4, 1: 4, 2: 4}  # rows 0-2 get their 5 tokens in one inner round; row 3 one token per round
    full, n_full = _loop(want, accept, 0.0)
    cut, n_cut = _loop(want, accept, 0.5)
    assert [len(x) for x in full] == [5, 5, 5, 5] and n_full == 5
    assert [len(x) for x in cut] == [5, 5, 5, 1] and n_cut == 1  # 1 of 4 rows left: below half, stop
    assert cut[:3] == full[:3] and full[3][:1] == cut[3]
    assert _loop(want, accept, 0.25)[1] == 5  # 1 of 4 is not below a quarter: it goes on
    one, n_one = _loop([5], {}, 1.0)  # a single row always gets its first inner round, and then all of them
    assert len(one[0]) == 5 and n_one == 5


def levels(method: VerifyMethod, share: float) -> list[Level]:
    def mk(name: str, noise: float, seed: int) -> Counting:
        return Counting(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)

    return [Level("d1", worker=mk("d1", 1.0, 3), k=2),
            Level("d2", worker=mk("d2", 0.4, 4), k=5, method=method, inner_min_share=share),
            Level("t", worker=mk("t", 0.0, 0), method=method)]


@pytest.mark.parametrize("nested", [False, True])
def test_greedy_outputs_equal_plain_decoding_with_the_cut(nested):
    plain = generate([Level("t", worker=FakeWorker("t", vocab=16, order=2, table_seed=0))], PROMPTS, max_tokens=23,
                     ignore_eos=True)
    runs = {}
    for share in (0.0, 0.6):
        lv = levels(VerifyMethod.GREEDY, share)
        eng = CascadeEngine(lv, nesting=LocalNesting() if nested else None)
        runs[share] = (generate(eng, PROMPTS, max_tokens=23, ignore_eos=True), lv[1].worker.verifies)
        assert [r.token_ids for r in runs[share][0].results] == [r.token_ids for r in plain.results]
        assert all(x.worker.stats().live_sequences == 0 for x in lv)
    # the cut saved inner rounds (verifications of the middle level) and sent shorter drafts to the target
    assert runs[0.6][1] < runs[0.0][1]
    assert runs[0.6][0].stats["t"].draft_tokens < runs[0.0][0].stats["t"].draft_tokens


@pytest.mark.parametrize("method", [VerifyMethod.GREEDY, VerifyMethod.COUPLED])
def test_nested_and_coordinator_loops_cut_alike(method):
    sampling = None if method is VerifyMethod.GREEDY else [
        SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    out = []
    for nesting in (None, LocalNesting()):
        eng = CascadeEngine(levels(method, 0.6), nesting=nesting)
        out.append(generate(eng, PROMPTS, max_tokens=23, sampling=sampling, ignore_eos=True))
    assert [r.token_ids for r in out[0].results] == [r.token_ids for r in out[1].results]
    assert {n: s.as_dict() for n, s in out[0].stats.items()} == {n: s.as_dict() for n, s in out[1].stats.items()}


@pytest.mark.parametrize("method", [VerifyMethod.DETERMINISTIC, VerifyMethod.REJECTION])
def test_cut_cascade_sampled_law_is_the_targets(method):
    """A large batch, so the cut acts on most rounds: the target's 3-token joint law holds."""
    vocab, n_draws, n_tok = 5, 6000, 3

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    def cascade(share: float) -> list[Level]:
        return [Level("d1", worker=mk("d1", 0.5, 3), k=1),
                Level("d2", worker=mk("d2", 0.3, 4), k=3, method=method, inner_min_share=share),
                Level("t", worker=mk("t", 0, 0), method=method)]

    sp = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [1, 2, 1, 2, 1]
    sps = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, 40_000 + i) for i in range(n_draws)]
    few = {share: generate(cascade(share), [prompt] * 500, max_tokens=n_tok, sampling=sps[:500],
                           ignore_eos=True).stats["t"].draft_tokens for share in (0.0, 0.9)}
    assert few[0.9] < few[0.0]  # the cut acts in this cascade: shorter drafts
    levels = cascade(0.9)
    batch = generate(levels, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True)
    assert_target_law(batch, levels[-1].worker, prompt, sp, n_tok)


def test_the_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="inner_min_share"):
        levels(VerifyMethod.GREEDY, 1.5)


def test_the_config_default_cuts_on_a_gpu_only_and_reaches_the_level():
    from specray.config import LevelConfig
    from specray.coordinator.generate import level_from_config

    cpu = LevelConfig(kind="hf", model="m")
    assert cpu.tail_cut == 0.0
    assert LevelConfig(kind="hf", model="m", num_gpus=1).tail_cut == 0.25
    assert LevelConfig(kind="hf", model="m", device="cuda").tail_cut == 0.25
    assert LevelConfig(kind="hf", model="m", num_gpus=1, inner_min_share=0.0).tail_cut == 0.0
    lvl = level_from_config(LevelConfig(kind="hf", model="m", inner_min_share=0.4), worker=FakeWorker("m", vocab=16))
    assert lvl.inner_min_share == 0.4
