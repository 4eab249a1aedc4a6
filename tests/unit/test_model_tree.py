"""Model-level token trees: a model drafter with `Level.tree` drafts a tree per row (`Worker.propose_tree`, depth by
depth, the best `width` nodes expanded), the target verifies it in one forward, and the output is plain
decoding's (greedy, coupled with a seed) or an exact sample of the target (rejection / deterministic, chi-square).
The drafter keeps the accepted path's KV; config, the per-request override, statistics."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import Batch, generate, level_from_config
from specray.coordinator.scheduler import Request, Scheduler, Speculation
from specray.engine.protocol import DraftMode, SeqSync
from specray.serve.protocol import usage_from_stats
from specray.serve.protocol.requests import SpeculationOptions
from specray.spec.noise import sample_tokens
from specray.spec.params import SamplingParams, TreeShape, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.spec.tree import ROOT, draft_children
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import assert_target_law
from tests.unit.test_tree_round import Spy

#: ragged
PROMPTS = [[5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 3], [9], [3, 3, 4, 3, 3, 5, 3], [11, 12, 13, 14, 15]]
TREE = Plan((0, 1), (4,))
SHAPE = TreeShape(2, 4, 8)


def draft(noise: float = 0.6, **kw) -> FakeWorker:
    return FakeWorker("draft", vocab=16, order=2, table_seed=0, noise=noise, noise_seed=1, **kw)


def levels(shape: TreeShape | None = SHAPE, method=VerifyMethod.GREEDY, noise: float = 0.6,
           target_cls=FakeWorker) -> list[Level]:
    return [Level("draft", worker=draft(noise), k=4, method=method, tree=shape),
            Level("target", worker=target_cls("target", vocab=16, order=2, table_seed=0), method=method)]


# ----------------------------------------------------------------------------------------------- the worker


@pytest.mark.parametrize("mode", [DraftMode.GREEDY, DraftMode.COUPLED, DraftMode.RANDOM])
def test_propose_tree_shape_and_the_first_child_is_the_chain_draft(mode):
    """Depth and node budget hold, nodes are level by level, siblings are distinct (greedy / coupled), and the
    first child of every expanded node is the token a chain drafter proposes from that node's context (its q is
    the drafter's processed distribution there, sent in random mode)."""
    w, ref = draft(), draft()
    sps = [SamplingParams(0.0, seed=1), SamplingParams(1.0, seed=3), SamplingParams(0.7, top_k=4, top_p=0.9, seed=5),
           SamplingParams(0.9, seed=8)]
    texts = [[1, 2, 3], [4, 5], [6], [7, 7, 7, 2]]
    depth, budget = [3, 4, 2, 0], [6, 9, 3, 5]
    prop = w.propose_tree([f"s{b}" for b in range(4)], depth, sps, mode=mode, level=1,
                          sync=[SeqSync.start(t) for t in texts], width=3, max_nodes=budget)
    assert prop.trees[3].num_nodes == 0 and prop.token_ids[3] == []
    for b, tree in enumerate(prop.trees[:3]):
        assert 0 < tree.num_nodes <= budget[b] and tree.max_depth <= depth[b]
        assert list(tree.depths) == sorted(tree.depths) and prop.token_ids[b] == list(tree.token_ids)
        if mode != DraftMode.RANDOM or sps[b].greedy:
            assert tree.distinct_siblings
        for node in [ROOT, *range(tree.num_nodes)]:
            kids = tree.children(node)
            if not kids:
                continue
            assert len(kids) <= 3
            ctx = texts[b] + [tree.token_ids[i] for i in tree.path_to(node)] if node != ROOT else texts[b]
            sid = f"r{b}-{node}"
            ref.add(sid, ctx)
            chain = ref.propose([sid], [1], [sps[b]], mode=mode, level=1)
            assert tree.token_ids[kids[0]] == chain.token_ids[0][0]
            if prop.probs is not None:
                assert torch.allclose(prop.probs[b, node + 1], chain.probs[0, 0])
    assert (prop.probs is not None) == (mode == DraftMode.RANDOM)
    assert w.tokens("s0") == texts[0]  # nothing appended: the next sync brings the accepted path


def test_draft_children_rules():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 2
    sb = SamplingBatch.from_params([SamplingParams(0.0, seed=1), SamplingParams(1.0, seed=2),
                                    SamplingParams(0.8, top_k=2, seed=3), SamplingParams(1.0, seed=4)])
    p = processed_probs(logits[:, None], sb)[:, 0]
    pos = torch.tensor([5, 6, 7, 8])
    for mode in ("greedy", "coupled", "random"):
        toks, score, usable = draft_children(logits, p, sb, pos, 3, mode, 2)
        assert toks.shape == (4, 3)
        assert torch.equal(toks[:, 0], torch.where(sb.greedy, logits.argmax(-1), sample_tokens(p, sb, pos, mode, 2)))
        assert torch.equal(toks[0], torch.topk(logits[0], 3).indices)  # temperature 0: the best raw logits
        if mode != "random":
            assert usable[2].tolist() == [True, True, False]  # top_k 2: no mass for a third child
    with pytest.raises(ValueError, match="unknown draft mode"):
        draft_children(logits, p, sb, pos, 2, "beam", 0)


def test_the_drafter_keeps_the_accepted_paths_kv(tiny):
    """After propose_tree, a sync appending a path of the tree (and a bonus token) keeps that path's KV: the
    drafter then drafts exactly what a fresh drafter with the same text drafts, without recomputing the path."""
    from specray.engine.hf import HFWorker

    w = HFWorker(str(tiny.draft_dirs["mid"]), name="d", dtype="float32")
    fresh = HFWorker(str(tiny.draft_dirs["mid"]), name="f", dtype="float32")
    sps = [SamplingParams(0.0, seed=1), SamplingParams(0.8, seed=2)]
    texts = [[5, 9, 17, 30, 2, 8], [40, 41, 42]]
    prop = w.propose_tree(["a", "b"], [3, 3], sps, width=2, sync=[SeqSync.start(t) for t in texts])
    kept = []
    for tree in prop.trees:
        path = list(max(tree.paths(), key=len))[:-1] or list(tree.paths()[-1])[:1]  # fed nodes only are kept
        kept.append([tree.token_ids[i] for i in path])
    syncs = [SeqSync(len(t), tuple(k + [3])) for t, k in zip(texts, kept)]
    calls = w.forward_calls
    w.propose(["a", "b"], [0, 0], sps, sync=syncs)  # the sync alone: the path's KV is kept, the bonus is pending
    assert w.stats().cached_tokens == sum(len(t) + len(k) for t, k in zip(texts, kept))
    assert w.forward_calls == calls
    a = w.propose(["a", "b"], [4, 4], sps, mode=DraftMode.RANDOM, level=1)
    f = fresh.propose(["a", "b"], [4, 4], sps, mode=DraftMode.RANDOM, level=1,
                      sync=[SeqSync.start(t + k + [3]) for t, k in zip(texts, kept)])
    assert a.token_ids == f.token_ids and torch.allclose(a.probs, f.probs, atol=1e-5)
    assert all(len(k) >= 1 for k in kept)


# ------------------------------------------------------------------------------------------------ the round


def test_greedy_model_trees_equal_plain_and_count_as_tree_drafts():
    plain = generate(levels()[1:], PROMPTS, max_tokens=20, ignore_eos=True, plain=True)
    lv = levels()
    spy = Spy(lv[1].worker)
    batch = generate(lv, PROMPTS, max_tokens=20, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.chains == 0 and spy.branched > 0
    assert all(t is None or t.num_nodes <= 8 and t.max_depth <= 4 for t in spy.trees)
    st = batch.stats["target"]
    assert st.tree_drafts == st.num_drafts > 0 and st.tree_nodes == st.draft_tokens
    assert st.accepted_tokens > 0 and st.pairs["draft->target"].tree_nodes == st.tree_nodes
    usage = usage_from_stats(10, 20, batch.stats).model_dump()
    assert usage["speculation"]["target"]["pairs"]["draft->target"]["tree_drafts"] == st.tree_drafts
    chains = generate(levels(None), PROMPTS, max_tokens=20, ignore_eos=True, plan=TREE)
    assert st.accepted_tokens / st.num_drafts > chains.stats["target"].accepted_tokens / \
        chains.stats["target"].num_drafts  # branches catch what the chain's first choice misses


def test_seeded_coupled_model_trees_equal_plain_coupled_decoding():
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    plain = generate(levels(method=VerifyMethod.COUPLED)[1:], PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True,
                     plain=True)
    lv = levels(method=VerifyMethod.COUPLED)
    spy = Spy(lv[1].worker)
    batch = generate(lv, PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.branched > 0 and batch.stats["target"].accepted_tokens > 0


STAT_CASES = [(VerifyMethod.REJECTION, SamplingParams(temperature=0.7, top_k=3)),
              (VerifyMethod.REJECTION, SamplingParams(temperature=1.0, top_p=0.8)),
              (VerifyMethod.DETERMINISTIC, SamplingParams(temperature=0.7, top_p=0.9)),
              (VerifyMethod.DETERMINISTIC, SamplingParams(temperature=1.0, top_k=4))]


@pytest.mark.parametrize(("method", "sp"), STAT_CASES, ids=[f"{m.value}-T{s.temperature}-k{s.top_k}-p{s.top_p}"
                                                            for m, s in STAT_CASES])
def test_sampled_model_trees_emit_the_targets_law(method, sp):
    """3-token outputs of one prompt, each sequence its own seed, follow the target's exact joint law (chi-square);
    the drafter's trees branch (rejection: i.i.d. sampled siblings, they may repeat)."""
    vocab, n_draws, n_tok = 5, 3000, 3

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    lv = [Level("d", worker=mk("d", 0.8, 2), k=2, tree=TreeShape(3, 2, 6)), Level("t", worker=mk("t", 0, 0),
                                                                               method=method)]
    spy = Spy(lv[1].worker)
    prompt = [1, 2, 3]
    sps = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=30_000 + i) for i in range(n_draws)]
    batch = generate(lv, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True, plan=Plan((0, 1), (2,)))
    assert spy.chains == 0 and spy.branched > n_draws // 2
    st = batch.stats["t"]
    assert st.tree_drafts > 0 and 0 < st.accepted_tokens < st.draft_tokens
    assert_target_law(Batch(batch.results, batch.stats), lv[-1].worker, prompt, sp, n_tok)


def test_penalized_model_trees_equal_plain():
    """The drafter penalizes each node along its path (its q); the target's penalties along the accepted path:
    greedy with penalties and seeded coupled sampling with penalties stay plain decoding's."""
    for method, sp in [(VerifyMethod.GREEDY, SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, seed=0)),
                       (VerifyMethod.COUPLED, SamplingParams(0.8, frequency_penalty=0.6, seed=9))]:
        plain = generate(levels(method=method)[1:], PROMPTS, max_tokens=16, sampling=sp, ignore_eos=True, plain=True)
        batch = generate(levels(method=method), PROMPTS, max_tokens=16, sampling=sp, ignore_eos=True, plan=TREE)
        assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results], method
        assert batch.stats["target"].tree_drafts > 0


def test_a_mixed_batch_under_rejection_keeps_greedy_rows_greedy():
    sps = [SamplingParams(0.0, seed=0) if b % 2 else SamplingParams(0.8, seed=b) for b in range(len(PROMPTS))]
    plain = generate(levels(method=VerifyMethod.REJECTION)[1:], PROMPTS, max_tokens=16, sampling=sps,
                     ignore_eos=True, plain=True)
    batch = generate(levels(method=VerifyMethod.REJECTION), PROMPTS, max_tokens=16, sampling=sps, ignore_eos=True,
                     plan=TREE)
    for b in range(1, len(PROMPTS), 2):
        assert batch.results[b].token_ids == plain.results[b].token_ids
    assert batch.stats["target"].tree_drafts > 0


def test_overlap_runs_tree_rounds_immediately():
    plain = generate(levels()[1:], PROMPTS, max_tokens=16, ignore_eos=True, plain=True)
    eng = CascadeEngine(levels(), overlap=True)
    batch = generate(eng, PROMPTS, max_tokens=16, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_rows == 0 and batch.stats["target"].tree_drafts > 0


def test_chains_where_trees_cannot_be_verified_or_drafted(caplog):
    class ChainsOnly(FakeWorker):
        tree_verify = False

    class NoTreeDrafts(FakeWorker):
        tree_propose = False

    plain = generate(levels()[1:], PROMPTS, max_tokens=12, ignore_eos=True, plain=True)
    for lv, why in [(levels(target_cls=ChainsOnly), "no tree_verify"),
                    ([Level("draft", worker=NoTreeDrafts("d", vocab=16, order=2, noise=0.5), k=4,
                            tree=TreeShape(2)), levels()[1]], "no tree_propose")]:
        spy = Spy(lv[1].worker)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specray.coordinator.drafting"):
            batch = generate(lv, PROMPTS, max_tokens=12, ignore_eos=True, plan=TREE)
        assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
        assert spy.trees == [] and spy.chains > 0
        logged = [r.getMessage() for r in caplog.records if "drafts chains, not trees" in r.getMessage()]
        assert len(logged) == 1 and why in logged[0]


def test_a_middle_model_with_a_tree_drafts_chains_in_a_cascade_and_trees_when_below_the_target():
    mid = Level("mid", worker=draft(0.3), k=3, tree=TreeShape(2, 3))
    lv = [Level("small", worker=FakeWorker("small", vocab=16, order=2, noise=1.0, noise_seed=5), k=2), mid,
          levels()[1]]
    spy_mid, spy_top = Spy(mid.worker), Spy(lv[2].worker)
    plain = generate(levels()[1:], PROMPTS, max_tokens=16, ignore_eos=True, plain=True)
    cascade = generate(lv, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((0, 1, 2), (2, 3)))
    assert [r.token_ids for r in cascade.results] == [r.token_ids for r in plain.results]
    assert spy_mid.trees == spy_top.trees == []
    direct = generate(lv, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((1, 2), (3,)))
    assert [r.token_ids for r in direct.results] == [r.token_ids for r in plain.results]
    assert spy_top.branched > 0


@pytest.mark.parametrize("method", [VerifyMethod.GREEDY, VerifyMethod.COUPLED])
def test_model_trees_equal_plain_with_tiny_hf_models(tiny, method):
    """fp32 tiny models in process, ragged batch: the draft model drafts trees (KV of the accepted path kept),
    the target verifies them: greedy, and seeded coupled sampling, give plain decoding's text."""
    from specray.engine.hf import HFWorker

    def lv(shape: TreeShape | None = SHAPE) -> list[Level]:
        return [Level("mid", worker=HFWorker(str(tiny.draft_dirs["mid"]), name="mid", dtype="float32"), k=4,
                      method=method, tree=shape),
                Level("t", worker=HFWorker(str(tiny.target_dir), name="t", dtype="float32"), method=method)]

    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown", "Hello",
               "def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n    def push"]
    sp = None
    if method == VerifyMethod.COUPLED:
        sp = [SamplingParams(temperature=0.8, top_p=0.95, seed=60 + b) for b in range(len(prompts))]
    plain = generate(lv()[1:], prompts, max_tokens=16, sampling=sp, ignore_eos=True, plain=True)
    levels_ = lv()
    spy = Spy(levels_[1].worker)
    batch = generate(levels_, prompts, max_tokens=16, sampling=sp, ignore_eos=True, plan=Plan((0, 1), (4,)))
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    st = batch.stats["t"]
    assert spy.branched > 0 and st.tree_drafts > 0 and st.accepted_tokens > 0


# ------------------------------------------------------------------------------------ config and requests


def test_tree_config_and_its_errors():
    cfg = LevelConfig(kind="hf", model="m", tree={"width": 3, "depth": 2})
    assert cfg.tree.shape() == TreeShape(3, 2, None)
    lv = level_from_config(cfg, worker=draft())
    assert lv.tree == TreeShape(3, 2) and lv.tree.nodes_for(2) == 6
    assert level_from_config(LevelConfig(kind="hf", model="m"), worker=draft()).tree is None
    with pytest.raises(ValueError, match="tree.width"):
        LevelConfig(kind="hf", model="m", tree={"width": 0})
    with pytest.raises(ValueError, match="tree.max_nodes"):
        LevelConfig(kind="hf", model="m", tree={"width": 2, "max_nodes": 0})
    with pytest.raises(ValueError, match="tree.depth"):
        LevelConfig(kind="hf", model="m", tree={"width": 2, "depth": "deep"})
    with pytest.raises(ValueError, match="a suffix level takes tree_width"):
        LevelConfig(kind="suffix", tree={"width": 2})
    with pytest.raises(ValueError, match="tree is for model levels, not a ngram level"):
        LevelConfig(kind="ngram", tree={"width": 2})
    with pytest.raises(ValueError, match="vllm level drafts chains only"):
        LevelConfig(kind="vllm", model="m", tree={"width": 2})
    with pytest.raises(ValueError, match="the target verifies"):
        CascadeConfig(levels=[{"kind": "hf", "model": "d"}, {"kind": "hf", "model": "t", "tree": {"width": 2}}])
    with pytest.raises(ValueError, match="width=0"):
        TreeShape(0)
    with pytest.raises(ValueError, match="tree is for model levels"):
        Level("ng", suffix=None, ngram=__import__("specray.spec.ngram", fromlist=["NgramConfig"]).NgramConfig(),
              tree=TreeShape(2))


def test_speculation_tree_option():
    assert SpeculationOptions.model_validate({"tree": {"width": 3, "depth": 2}}).tree_shape == TreeShape(3, 2)
    assert SpeculationOptions.model_validate({"tree": False}).tree_shape == TreeShape(1)
    assert SpeculationOptions.model_validate({}).tree_shape is None
    for bad in ({"tree": True}, {"tree": {"width": 0}}, {"tree": {"width": 2, "deep": 1}}):
        with pytest.raises(ValueError, match="tree"):
            SpeculationOptions.model_validate(bad)


def test_per_request_tree_override_in_the_scheduler():
    """Requests with different trees run in their own groups: off, the level's own, and a wider one."""
    eng = CascadeEngine(levels())
    sched = Scheduler(eng)
    spy = Spy(eng.levels[1].worker)

    async def one(spec):
        async for ev in sched.generate(Request(PROMPTS[1], SamplingParams(), 16, ignore_eos=True, speculation=spec)):
            if ev.finished:
                return ev

    async def main():
        return await asyncio.gather(one(Speculation("draft", 4, tree=TreeShape(1))), one(None),
                                    one(Speculation(tree=TreeShape(3, 2, 5))))

    off, own, wide = asyncio.run(main())
    assert off.token_ids is not None and off.stats["target"].tree_drafts == 0 and off.stats["target"].num_drafts > 0
    assert own.stats["target"].tree_drafts > 0 and wide.stats["target"].tree_drafts > 0
    assert any(t is not None and t.num_nodes == 5 and t.max_depth == 2 for t in spy.trees)  # the override's shape
    assert spy.chains > 0


def test_the_request_tree_overrides_a_suffix_levels_width():
    """A suffix level configured for chains drafts trees for a request asking for width 3 (its node budget stays
    K), and the text is plain decoding's."""
    from tests.unit.test_tree_round import suffix

    plain = generate(levels()[1:], PROMPTS, max_tokens=12, ignore_eos=True, plain=True)
    lv = [suffix(1), levels()[1]]
    spy = Spy(lv[1].worker)
    eng = CascadeEngine(lv)
    seqs = [eng.new_sequence(p, SamplingParams(), 12) for p in PROMPTS]
    while any(not s.finished for s in seqs):
        eng.step(seqs, Plan((0, 1), (6,)), None, TreeShape(3, 9, 99))
    assert [s.output for s in seqs] == [r.token_ids for r in plain.results]
    assert spy.branched > 0 and all(t.num_nodes <= 6 for t in spy.trees if t is not None)


# ------------------------------------------------------------------------------------- the planner's choice


def test_the_plans_tree_width_decides_what_a_model_level_drafts():
    """`Plan.tree` for a model level: 1 drafts chains (what the planner chose runs), 0 the level's own shape, a
    wider width trees of that width at the shape's depth; the request's tree still overrides a chain plan. The text
    is plain decoding's throughout; a tree width for an n-gram first level is refused."""
    plain = generate(levels()[1:], PROMPTS, max_tokens=16, ignore_eos=True, plain=True)
    for tree, branched in ((1, False), (0, True), (3, True)):
        lv = levels()
        spy = Spy(lv[1].worker)
        batch = generate(lv, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((0, 1), (4,), tree=tree))
        assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
        assert (spy.branched > 0) is branched and (spy.chains > 0) is not branched
        assert (batch.stats["target"].tree_drafts > 0) is branched
        if tree == 3:
            assert all(t is None or t.num_nodes <= 12 and t.max_depth <= 4 for t in spy.trees)
            assert max(len(t.children(n)) for t in spy.trees if t is not None for n in [ROOT, *range(t.num_nodes)]) == 3
        else:
            assert all(t is None or t.num_nodes <= 8 and t.max_depth <= 4 for t in spy.trees)
    lv = levels()
    spy = Spy(lv[1].worker)
    eng = CascadeEngine(lv)
    seqs = [eng.new_sequence(p, SamplingParams(), 12) for p in PROMPTS]
    while any(not s.finished for s in seqs):
        eng.step(seqs, Plan((0, 1), (4,), tree=1), None, TreeShape(3, 2, 5))
    assert [s.output for s in seqs] == [r.token_ids[:12] for r in plain.results]
    assert spy.branched > 0 and all(t.num_nodes <= 5 and t.max_depth <= 2 for t in spy.trees if t is not None)
    from specray.coordinator.state import check_plan
    from specray.spec.ngram import NgramConfig

    with pytest.raises(ValueError, match="only a suffix or model first level"):
        check_plan(Plan((0, 1), (4,), tree=2), [Level("ngram", ngram=NgramConfig(3, 1, 3)), levels()[1]])


def test_model_tree_rounds_feed_the_planners_tree_estimates_and_the_drafters_curve():
    """Real model-tree rounds under a planner: the tree acceptance and node count of (target, draft, 2), the
    chain's acceptance from the first children (the same rounds), and the tree proposals timed at the tokens they
    fed (`on_propose_tree`: the drafter's cost curve gets forwards wider than one token); an observer without
    `on_propose_tree` sees them as proposals of `depth` steps."""
    from specray.policy.planner import Planner

    class Calls:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def on_call(self, level, kind, batch, tokens, seconds) -> None:
            self.calls.append((level, kind, batch, tokens))

        def on_verify(self, level, lower, draft_lens, accepted) -> None:
            pass

    lv = levels()
    eng = CascadeEngine(lv)
    p = Planner(lv, k_choices=(4,)).attach(eng)
    rec = Calls()
    eng.observers.append(rec)
    generate(eng, PROMPTS, max_tokens=16, ignore_eos=True, plan=TREE)
    assert p.tree_acceptance[(1, 0, 2)].weight > 0 and p.acceptance[(1, 0)].weight > 0
    assert 1 <= p.tree_nodes[(1, 0, 2)] <= 8
    assert p.measurements.measured_at[(1, 0, 2)] == p.measurements.measured_at[(1, 0)]  # one round measures both
    assert any(q > 1 for _b, q in p.costs[0]._table)  # tree forwards, priced at what they fed
    assert any(c[:2] == (0, "propose") and c[3] == 4 for c in rec.calls)


def test_the_planner_drives_model_tree_rounds_and_the_text_is_plain_decodings():
    """The planner choosing per round between the level's chains and trees (its configured plan drafts trees):
    greedy output is plain decoding's, whatever it picks."""
    from specray.policy.planner import Planner

    # The priors rank the configured tree plan below plain decoding and a chain, so trees run only when exploration
    # probes them: after plain decoding or before it, depending on timings. 32 tokens leave room for both probes.
    plain = generate(levels()[1:], PROMPTS, max_tokens=32, ignore_eos=True, plain=True)
    lv = levels()
    eng = CascadeEngine(lv)
    p = Planner(lv, k_choices=(2, 4), warmup=1, patience=1, explore_every=4).attach(eng)
    assert p.default_plan == Plan((0, 1), (4,), tree=2)
    batch = generate(eng, PROMPTS, max_tokens=32, ignore_eos=True, plan=p)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert batch.stats["target"].tree_drafts > 0 and p.tree_acceptance[(1, 0, 2)].weight > 0
