"""Token trees in a cascade: a suffix level drafts trees for a middle model that verifies them in its inner rounds
(`Worker.verify_tree`, the accepted path plus one token extend its chain draft for the target). Greedy equals
plain decoding (fake and fp32 tiny HF models, ragged batches); the target's stream follows its exact law at
T 0.7 (rejection and coupled); the middle level's emitted distributions (`return_probs`) and confidences are read
along the accepted path; the round's tree verifications feed the planner's tree statistics."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate
from specray.engine.tree_rows import TokenTree
from specray.policy.planner import Planner
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.suffix import SuffixConfig, SuffixDrafter
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import assert_target_law
from tests.unit.test_tree_round import PROMPTS, Spy

CASCADE = Plan((0, 1, 2), (6, 6))


def suffix(width: int, k: int = 6) -> Level:
    sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=k, max_spec_factor=4.0, min_token_prob=0.0,
                                    tree_width=width))
    return Level("suffix", suffix=sx, k=k, tree_width=width)


def fakes(method: VerifyMethod, vocab: int = 16, **kw) -> list[Level]:
    mid = FakeWorker("mid", vocab=vocab, order=2, table_seed=0, noise=0.3, noise_seed=5, **kw)
    top = FakeWorker("target", vocab=vocab, order=2, table_seed=0, **kw)
    return [Level("mid", worker=mid, k=6, method=method), Level("target", worker=top, method=method)]


@pytest.mark.parametrize("method", [VerifyMethod.GREEDY, VerifyMethod.REJECTION, VerifyMethod.COUPLED])
def test_a_middle_level_verifies_trees_and_greedy_equals_plain(method):
    """Greedy rows (every method verifies them greedily) over a ragged batch: plain decoding's text; the middle
    level got branching trees and counts them (nodes, depth) under suffix->mid; the target got chains."""
    plain = generate([fakes(method)[1]], PROMPTS, max_tokens=24, ignore_eos=True, plain=True)
    levels = [suffix(3), *fakes(method)]
    spies = Spy(levels[1].worker), Spy(levels[2].worker)
    batch = generate(levels, PROMPTS, max_tokens=24, ignore_eos=True, plan=CASCADE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spies[0].branched > 0 and spies[0].chains == 0 and spies[1].trees == []
    st = batch.stats["mid"].pairs["suffix->mid"]
    assert st.tree_drafts > 0 and st.tree_nodes == st.draft_tokens and st.accepted_tokens > 0
    assert len(st.accepted_per_pos) <= max(t.max_depth for t in spies[0].trees if t is not None)
    assert all(lv.worker.stats().live_sequences == 0 for lv in levels[1:])


@pytest.mark.parametrize("overlap", ["bounded", "unbounded"])
def test_trees_at_the_middle_level_with_overlap_and_confidence_equal_plain(overlap):
    """The middle level drafts the next round beside the target's verification (its inner rounds verify trees, a
    bounded look-ahead stopping between them) and stops a row's draft after a token it is unsure of
    (`Level.confidence`, read along the accepted path): plain decoding's text."""
    plain = generate([fakes(VerifyMethod.GREEDY)[1]], PROMPTS, max_tokens=24, ignore_eos=True, plain=True)
    levels = [suffix(3), *fakes(VerifyMethod.GREEDY)]
    levels[1].confidence = 0.3
    spy = Spy(levels[1].worker)
    eng = CascadeEngine(levels, overlap=True)
    eng.ahead_bounded = overlap == "bounded"
    batch = generate(eng, PROMPTS, max_tokens=24, ignore_eos=True, plan=CASCADE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.branched > 0 and batch.stats["mid"].tree_drafts > 0


def test_return_probs_and_confidence_follow_the_accepted_path():
    """`verify_tree(return_probs=, confidence=)`: the distributions and this level's probabilities of the emitted
    tokens, read at the slots along the accepted path: what `verify` gives for the chain of that path."""
    sp = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.0, seed=1)]
    trees = [TokenTree((7, 9, 8, 10), (-1, -1, 0, 1)), TokenTree((4,), (-1,))]
    a, b = (FakeWorker("w", vocab=16, order=2, table_seed=0) for _ in range(2))
    for w in (a, b):
        w.add("x", [5, 6, 7, 8, 5, 6])
        w.add("y", [1, 2, 3])
    got = a.verify_tree(["x", "y"], trees, None, sp, VerifyMethod.DETERMINISTIC, level=1, return_probs=True,
                        confidence=True)
    chains = []
    for t, toks, n in zip(trees, got.token_ids, got.num_accepted):  # the accepted path as a chain
        chains.append(toks[:n])
        assert n == 0 or any(t.token_ids[i] == toks[0] for i in range(len(t.token_ids)))
    ref = b.verify(["x", "y"], chains, None, sp, VerifyMethod.DETERMINISTIC, level=1, return_probs=True,
                   confidence=True)
    assert ref.token_ids == got.token_ids
    n = max(len(e) for e in got.token_ids)
    assert got.probs.shape == (2, n, 16)
    for j, e in enumerate(got.token_ids):
        assert got.probs[j, : len(e)].allclose(ref.probs[j, : len(e)])
        assert got.confidence[j] == pytest.approx(ref.confidence[j])


@pytest.mark.parametrize("method", [VerifyMethod.REJECTION, VerifyMethod.COUPLED])
def test_the_target_stream_stays_exact_with_trees_at_the_middle_level(method):
    """suffix(trees) -> mid -> target at T 0.7: the joint law of 4 generated tokens is the target's (chi-square).
    The suffix level learns earlier requests' outputs, so its trees branch; rejection at the target reads the
    middle level's distributions along its accepted paths."""
    vocab, n_draws, n_tok = 4, 3000, 4

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    levels = [suffix(3, k=3), Level("mid", worker=mk("mid", 0.6, 2), k=3, method=method),
              Level("t", worker=mk("t", 0, 0), method=method)]
    spy = Spy(levels[1].worker)
    prompt = [1, 2, 1, 3, 1]
    sps = [SamplingParams(0.7, seed=20_000 + i) for i in range(n_draws)]
    batch = generate(levels, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True,
                     plan=Plan((0, 1, 2), (3, 3)))
    assert_target_law(batch, levels[-1].worker, prompt, SamplingParams(0.7), n_tok)
    assert spy.branched > 0 and batch.stats["t"].accepted_tokens > 0
    assert batch.stats["mid"].pairs["suffix->mid"].accepted_tokens > 0


def test_the_planner_measures_the_middle_levels_trees_and_its_chain():
    """The inner rounds' tree verifications reach the planner as tree walks: the (mid, suffix, width) acceptance
    and node count, and the chain along the first children for the (mid, suffix) pair."""
    levels = [suffix(3), *fakes(VerifyMethod.GREEDY)]
    eng = CascadeEngine(levels)
    planner = Planner(levels, k_choices=(3, 6)).attach(eng)
    assert set(planner.tree_acceptance) == {(1, 0, 3), (2, 0, 3)}
    generate(eng, PROMPTS, max_tokens=24, ignore_eos=True, plan=CASCADE)
    assert planner.tree_acceptance[(1, 0, 3)].weight > 0 and planner.tree_nodes[(1, 0, 3)] >= 1
    assert planner.acceptance[(1, 0)].weight > 0  # the chain along the first children
    assert planner.tree_acceptance[(2, 0, 3)].weight == 0  # the target verified the middle level's chains
    chain, tree = Plan((0, 1, 2), (6, 6), tree=1), Plan((0, 1, 2), (6, 6), tree=3)
    assert chain in planner.candidates and tree in planner.candidates
    assert planner.expected_length(chain) == planner.expected_length(tree)  # E[L] is the target's: same pair
    # mid's inner rounds priced apart
    assert planner.pricing.width(tree, 0) == 3 and planner.pricing.width(chain, 0) == 1


def test_tiny_hf_cascade_with_trees_at_the_middle_level_equals_plain(tiny_root):
    """fp32 tiny HF models in process: suffix(trees) -> a perturbed copy of a target whose greedy text copies
    its context -> that target, ragged batch of 5: plain decoding's text, with branching trees verified by the
    middle level."""
    from pathlib import Path

    from specray.engine.hf import HFWorker
    from specray.testing.tiny import make_draft, repetitive_target

    path = repetitive_target(tiny_root)
    mid_path = Path(tiny_root) / "rep-target-draft-n02"
    if not (mid_path / "config.json").is_file():
        make_draft(path, mid_path, noise=0.2, seed=4)

    def hf(p, name) -> HFWorker:
        return HFWorker(str(p), name=name, dtype="float32")

    prompts = [[p + 20 for p in row] for row in PROMPTS]
    plain = generate([Level("t", worker=hf(path, "t"))], prompts, max_tokens=20, ignore_eos=True, plain=True)
    levels = [suffix(3), Level("mid", worker=hf(mid_path, "mid"), k=6), Level("t", worker=hf(path, "t"))]
    spy = Spy(levels[1].worker)
    batch = generate(levels, prompts, max_tokens=20, ignore_eos=True, plan=CASCADE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.branched > 0 and batch.stats["mid"].tree_drafts > 0
    assert batch.stats["t"].accepted_tokens > 0


def test_a_failed_middle_level_leaves_the_plans_tree_width_to_the_suffix_level():
    """The planner chose chains (`Plan.tree` = 1) for suffix -> mid -> target; mid fails (its tree verification
    raises): the round retried without it keeps the plan's width, so the target gets the suffix level's chains, not
    the configured trees; greedy output is plain decoding's."""
    from tests.unit.test_cascade import Dying

    class DyingTrees(Dying):
        def verify_tree(self, *a, **kw):
            self._check()
            return super().verify_tree(*a, **kw)

    plain = generate([fakes(VerifyMethod.GREEDY)[1]], PROMPTS, max_tokens=16, ignore_eos=True, plain=True)
    top = fakes(VerifyMethod.GREEDY)[1]
    mid = DyingTrees("mid", vocab=16, order=2, table_seed=0, noise=0.3, noise_seed=5)
    mid.dead = True
    levels = [suffix(3), Level("mid", worker=mid, k=6), top]
    spy = Spy(top.worker)
    eng = CascadeEngine(levels)
    eng.retry_after_s = 1e9  # stays down
    for width, trees in ((1, False), (3, True)):
        batch = generate(eng, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((0, 1, 2), (6, 6), tree=width))
        assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
        assert eng.level_status()["mid"] == "down"
        assert (spy.branched > 0) is trees and spy.chains > 0


def test_tree_walk_reads_reach_and_the_first_childrens_chain():
    """`tree_walk`: the depths at which the accepted path's node had children (trials), and how much of the chain
    along the first children a chain verification would have accepted, and the tree's depth."""
    from specray.coordinator.feed import TreeWalk, tree_walk
    from specray.spec.tree import DraftTree

    t = DraftTree((7, 9, 8, 10, 11), (-1, -1, 0, 1, 2))  # spine 7 -> 8 -> 11; a sibling branch 9 -> 10
    assert tree_walk(t, [9, 10, 3], 2) == TreeWalk(5, 2, 2, 3, 0, 3)  # ended at a leaf: no trial after it
    assert tree_walk(t, [7, 8, 3], 2) == TreeWalk(5, 3, 2, 3, 2, 3)  # rejected below node 8: a third trial
    assert tree_walk(t, [7, 8, 11, 3], 3) == TreeWalk(5, 3, 3, 3, 3, 3)
    assert tree_walk(t, [5], 0) == TreeWalk(5, 1, 0, 3, 0, 3)
    assert tree_walk(None, [5], 0) == tree_walk(DraftTree((), ()), [5], 0) == TreeWalk(0, 0, 0, 0, 0)
