"""Token trees through the round: a suffix level with `tree_width` > 1 drafts a tree per row for a target with
`WorkerCaps.tree_verify`, the target verifies it in one call (`Worker.verify_tree`), and the text is what plain
decoding gives (greedy; coupled with a seed). A target without tree_verify (vLLM) never gets a tree."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.config import LevelConfig
from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate, level_from_config
from specray.engine.tree_rows import TokenTree
from specray.metrics import SpecMetrics
from specray.serve.protocol import usage_from_stats
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.suffix import SuffixConfig, SuffixDrafter
from specray.spec.tree import DraftTree
from specray.testing.fake import FakeWorker

TREE = Plan((0, 1), (6,))
#: ragged, with repeated text whose continuations differ (the trie branches after "5 6", "1 2", "3 3")
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8, 5, 6],
    [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2],
    [9],
    [3, 3, 4, 3, 3, 5, 3, 3, 4, 3, 3, 6, 3, 3],
    [11, 12, 13, 14, 15, 11, 12],
]


class Spy:
    """Wraps a worker's `verify_tree` / `verify` to record what the round sent it."""

    def __init__(self, worker) -> None:
        self.trees: list[DraftTree | None] = []
        self.chains = 0
        tree_call, chain_call = worker.verify_tree, worker.verify

        def verify_tree(seq_ids, trees, *a, **kw):
            self.trees.extend(trees)
            return tree_call(seq_ids, trees, *a, **kw)

        def verify(seq_ids, draft_ids, *a, **kw):
            self.chains += sum(1 for d in draft_ids if d)
            return chain_call(seq_ids, draft_ids, *a, **kw)

        worker.verify_tree, worker.verify = verify_tree, verify

    @property
    def branched(self) -> int:
        return sum(1 for t in self.trees if t is not None and t.num_nodes and not t.is_chain)


def suffix(width: int) -> Level:
    sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=6, max_spec_factor=4.0, min_token_prob=0.0,
                                    tree_width=width))
    return Level("suffix", suffix=sx, k=6, tree_width=width)


def fake_target(method=VerifyMethod.GREEDY, cls=FakeWorker) -> Level:
    return Level("target", worker=cls("target", vocab=16, order=2, table_seed=0), method=method)


def test_a_fake_target_verifies_trees_greedy_equal_plain_and_stats_count_nodes_and_paths():
    plain = generate([fake_target()], PROMPTS, max_tokens=24, ignore_eos=True, plain=True)
    levels = [suffix(3), fake_target()]
    spy = Spy(levels[1].worker)
    batch = generate(levels, PROMPTS, max_tokens=24, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.chains == 0 and spy.branched > 0  # trees only, some of them really branched
    st = batch.stats["target"]
    assert st.tree_drafts == st.num_drafts > 0
    assert st.tree_nodes == st.draft_tokens == sum(t.num_nodes for t in spy.trees if t is not None)
    assert 0 < st.accepted_tokens <= st.draft_tokens and sum(st.accepted_per_pos) == st.accepted_tokens
    assert len(st.accepted_per_pos) <= max(t.max_depth for t in spy.trees if t is not None)  # by depth
    assert st.pairs["suffix->target"].tree_nodes == st.tree_nodes
    for r in batch.results:
        top = r.stats["target"]
        assert top.verify_calls == r.rounds and top.emitted_tokens >= len(r.token_ids)
    # usage.speculation and /metrics show them
    usage = usage_from_stats(10, 24, batch.stats).model_dump()
    assert usage["speculation"]["target"]["tree_nodes"] == st.tree_nodes
    assert usage["speculation"]["target"]["pairs"]["suffix->target"]["tree_drafts"] == st.tree_drafts
    no_trees = usage_from_stats(1, 1, plain.stats).model_dump()["speculation"]["target"]
    assert "tree_drafts" not in no_trees and "tree_nodes" not in no_trees
    m = SpecMetrics(model_name="x")
    m.observe_request(batch.stats, "length", 10, 24, 0.1, 1.0)
    got = {(s.name, s.labels.get("pair")): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert got[("specray_spec_decode_num_tree_nodes_total", "suffix->target")] == st.tree_nodes
    assert got[("specray_spec_decode_num_tree_drafts_total", "suffix->target")] == st.tree_drafts


def test_trees_feed_the_planner_as_chains_as_deep_as_the_tree():
    class Recorder:
        def __init__(self) -> None:
            self.verified: list[tuple[list[int], list[int]]] = []
            self.calls: list[int] = []

        def on_call(self, level, kind, batch, tokens, seconds) -> None:
            self.calls.append(tokens)

        def on_verify(self, level, lower, draft_lens, accepted) -> None:
            self.verified.append((list(draft_lens), list(accepted)))

    levels = [suffix(3), fake_target()]
    spy = Spy(levels[1].worker)
    eng = CascadeEngine(levels)
    rec = Recorder()
    eng.observers.append(rec)
    generate(eng, PROMPTS, max_tokens=16, ignore_eos=True, plan=TREE)
    depths = [t.max_depth for t in spy.trees]
    assert [n for lens, _ in rec.verified for n in lens] == depths
    assert all(a <= n for lens, acc in rec.verified for n, a in zip(lens, acc))
    # one timed call per verification but the first (it started the rows: `step_timed`)
    assert len(rec.calls) == len(rec.verified) - 1
    # a call is timed by the nodes it fed (the tree's), not by its depth
    assert all(c >= max(lens) + 1 for c, (lens, _) in zip(rec.calls, rec.verified[1:]))
    assert any(c > max(lens) + 1 for c, (lens, _) in zip(rec.calls, rec.verified[1:]))


def test_seeded_coupled_tree_rounds_equal_plain_coupled_decoding():
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    plain = generate([fake_target(VerifyMethod.COUPLED)], PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True,
                     plain=True)
    levels = [suffix(3), fake_target(VerifyMethod.COUPLED)]
    spy = Spy(levels[1].worker)
    batch = generate(levels, PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.branched > 0 and batch.stats["target"].accepted_tokens > 0


def test_penalties_and_logprobs_follow_the_accepted_path():
    """verify_tree applies a row's penalties along each slot's path and reports the emitted tokens' logprobs:
    the same as plain decoding (greedy with a repetition penalty)."""
    sp = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, logprobs=2)
    plain = generate([fake_target()], PROMPTS, max_tokens=16, sampling=sp, ignore_eos=True, plain=True)
    levels = [suffix(3), fake_target()]
    batch = generate(levels, PROMPTS, max_tokens=16, sampling=sp, ignore_eos=True, plan=TREE)
    assert batch.stats["target"].tree_drafts > 0
    for a, b in zip(batch.results, plain.results):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_worker_verify_tree_equals_verify_on_a_chain_and_refuses_without_tree_verify():
    w, ref = FakeWorker(vocab=16, order=2), FakeWorker(vocab=16, order=2)
    sps = [SamplingParams(temperature=0.8, seed=3), SamplingParams(seed=0)]
    for x in (w, ref):
        x.add("a", [1, 2, 3])
        x.add("b", [4, 5])
    for method in (VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED, VerifyMethod.GREEDY):
        a = w.verify_tree(["a", "b"], [TokenTree.chain([4, 5]), None], None, sps, method, level=1)
        b = ref.verify(["a", "b"], [[4, 5], []], None, sps, method, level=1)
        assert (a.token_ids, a.num_accepted, a.tree_nodes) == (b.token_ids, b.num_accepted, [2, 0])
        assert w.tokens("a") == ref.tokens("a") and w.tokens("b") == ref.tokens("b")

    class Chains(FakeWorker):
        tree_verify = False

    c = Chains(vocab=16)
    c.add("a", [1])
    with pytest.raises(NotImplementedError, match="chains only"):
        c.verify_tree(["a"], [TokenTree.chain([2])], None, [SamplingParams(seed=0)], VerifyMethod.GREEDY)


def test_a_target_without_tree_verify_gets_chains(caplog):
    """A vLLM target declares tree_verify False: the suffix level drafts chains for it (logged once)."""
    class ChainsOnly(FakeWorker):
        tree_verify = False

        def verify_tree(self, *a, **kw):
            raise AssertionError("a chains-only target was sent a tree")

    plain = generate([fake_target()], PROMPTS, max_tokens=20, ignore_eos=True, plain=True)
    levels = [suffix(3), fake_target(cls=ChainsOnly)]
    spy = Spy(levels[1].worker)
    with caplog.at_level(logging.INFO, logger="specray.coordinator.drafting"):
        batch = generate(levels, PROMPTS, max_tokens=20, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert spy.trees == [] and spy.chains > 0
    st = batch.stats["target"]
    assert st.tree_drafts == 0 and st.num_drafts > 0
    logged = [r for r in caplog.records if "drafts chains, not trees" in r.getMessage()]
    assert len(logged) == 1 and "no tree_verify" in logged[0].getMessage()


class ChainsOnly(FakeWorker):
    """A model level that verifies chains only (a vLLM level's `WorkerCaps`)."""

    tree_verify = False


def test_width_one_drafts_chains_and_a_middle_model_verifies_trees_only_if_it_can(caplog):
    levels = [suffix(1), fake_target()]
    spy = Spy(levels[1].worker)
    generate(levels, PROMPTS[:2], max_tokens=10, ignore_eos=True, plan=TREE)
    assert spy.trees == [] and spy.chains > 0
    plain = generate([fake_target()], PROMPTS, max_tokens=16, ignore_eos=True, plain=True)
    for cls in (FakeWorker, ChainsOnly):
        mid = Level("mid", worker=cls("mid", vocab=16, order=2, table_seed=0, noise=0.3), k=3)
        levels = [suffix(3), mid, fake_target()]
        spies = Spy(mid.worker), Spy(levels[2].worker)
        with caplog.at_level(logging.INFO, logger="specray.coordinator.drafting"):
            batch = generate(levels, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((0, 1, 2), (6, 6)))
        assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
        assert spies[1].trees == [] and spies[1].chains > 0  # the target gets the middle level's chains
        if cls is FakeWorker:  # the middle level verifies the suffix level's trees, which branch
            assert spies[0].branched > 0 and spies[0].chains == 0
            assert batch.stats["mid"].tree_drafts > 0
        else:
            assert spies[0].trees == [] and spies[0].chains > 0
            assert any("no tree_verify" in rec.getMessage() for rec in caplog.records)


def test_tree_width_config():
    lv = level_from_config(LevelConfig(kind="suffix", tree_width=3, num_speculative_tokens=8))
    assert lv.tree_width == 3 and lv.suffix.config.tree_width == 3 and lv.k == 8
    assert level_from_config(LevelConfig(kind="suffix")).tree_width == 1  # chains by default
    with pytest.raises(ValueError, match="tree_width is for suffix levels"):
        LevelConfig(kind="hf", model="fake", tree_width=2)
    with pytest.raises(ValueError, match="tree_width"):
        LevelConfig(kind="suffix", tree_width=0)
    with pytest.raises(ValueError, match="only for a suffix level"):
        Level("t", worker=FakeWorker(), tree_width=2)


@pytest.mark.parametrize("method", [VerifyMethod.GREEDY, VerifyMethod.COUPLED])
def test_tree_rounds_equal_plain_with_tiny_hf_models(tiny_root, method):
    """fp32 tiny models in process: a suffix level drafting trees for an HF target whose greedy text copies its
    context, ragged batch; trees branch and accept. Greedy, and seeded coupled sampling (T > 0): plain
    decoding's text."""
    from specray.engine.hf import HFWorker
    from specray.testing.tiny import repetitive_target

    path = str(repetitive_target(tiny_root))

    def target() -> Level:
        return Level("t", worker=HFWorker(path, name="t", dtype="float32"), method=method)

    prompts = [[p + 20 for p in row] for row in PROMPTS]
    sp = None
    if method == VerifyMethod.COUPLED:
        sp = [SamplingParams(temperature=0.7, top_p=0.95, seed=40 + b) for b in range(len(prompts))]
    plain = generate([target()], prompts, max_tokens=20, sampling=sp, ignore_eos=True, plain=True)
    levels = [suffix(3), target()]
    spy = Spy(levels[1].worker)
    batch = generate(levels, prompts, max_tokens=20, sampling=sp, ignore_eos=True, plan=TREE)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    st = batch.stats["t"]
    assert spy.branched > 0 and st.tree_drafts > 0 and st.accepted_tokens > 0
    assert st.pairs["suffix->t"].tree_nodes == st.tree_nodes
    assert batch.rounds < sum(len(r.token_ids) for r in batch.results)  # speculation paid
