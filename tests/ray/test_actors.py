"""Level actors on a real single-node Ray: protocol round trips, exact cascades over actors, placement,
restart after a kill, and placement errors."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest
import ray
import torch

from specray.config import CascadeConfig, LevelConfig, PlacementConfig
from specray.coordinator.cascade import Level, Plan
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker
from specray.engine.protocol import DraftMode, SeqSync
from specray.engine.tokenizer_check import TokenizerMismatchError
from specray.serve.actors import ActorWorker, LevelRestarted, LevelStartError, LevelUnavailable
from specray.serve.launch import launch_levels
from specray.serve.placement import PlacementError
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker
from tests.ray.conftest import local_ray

pytestmark = pytest.mark.ray

RESOURCES = {"draft": 4, "target": 4, "accelerator_type:T4": 1}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]
G = SamplingParams(seed=0)


@pytest.fixture(scope="module", autouse=True)
def _ray():
    with local_ray(num_cpus=12, resources=RESOURCES):
        yield


def fake(name: str, noise: float = 0.0, seed: int = 1) -> functools.partial:
    """A picklable factory of the FakeWorker used by tests/unit/test_cascade.py."""
    return functools.partial(FakeWorker, name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)


def level(name: str, **kw) -> LevelConfig:
    kw.setdefault("num_cpus", 0.5)
    return LevelConfig(kind="hf", model="fake", name=name, **kw)


FAKES = {"d1": (1.0, 3), "d2": (0.4, 4), "target": (0.0, 1)}


@pytest.fixture(scope="module")
def fakes():
    """Three fake model levels in actors, launched once and shared (actor start-up dominates test time)."""
    cfg = CascadeConfig(levels=[level(name) for name in FAKES], follow=True)  # as on GPU levels
    with launch_levels(cfg, [fake(n, *FAKES[n]) for n in FAKES], name_prefix="fakes") as lc:
        yield lc


def fake_cascade(setup: str, method: VerifyMethod, workers) -> list[Level]:
    """The cascades of the in-process fake tests; `workers`: level name -> worker (actor or in-process)."""
    ngram = {"draft": None, "cascade3": NgramConfig(2, 1, 3), "models3": None}[setup]
    chain = {"draft": [("d2", 3)], "cascade3": [("d2", 4)], "models3": [("d1", 2), ("d2", 5)]}[setup]
    levels = [Level("ngram", ngram=ngram)] if ngram else []
    levels += [Level(n, worker=workers[n], k=k, method=method) for n, k in chain]
    return [*levels, Level("target", worker=workers["target"], method=method)]


def in_process() -> dict[str, FakeWorker]:
    return {n: fake(n, *FAKES[n])() for n in FAKES}


def test_protocol_round_trip_matches_in_process_worker(fakes):
    remote, local = fakes.workers["target"], in_process()["target"]
    assert (remote.name, remote.vocab_size, remote.max_context, remote.eos_token_ids) == ("target", 16, 4096, ())
    for w in (remote, local):
        w.add("a", [1, 2, 3])
        w.add("b", [4, 5])
    results = []
    for w in (remote, local):
        r = [w.propose(["a", "b"], [3, 1], [G, G]).token_ids]
        r.append(w.verify(["a", "b"], [[1, 2], []], None, [G, G], VerifyMethod.GREEDY,
                          sync=[SeqSync(3), SeqSync(2, (7,))]).token_ids)
        prop = w.propose(["a"], [2], [SamplingParams(temperature=0.8, seed=3)], mode=DraftMode.RANDOM)
        r.append(prop.token_ids)
        r.append(prop.probs)
        r.append(w.verify(["a"], [[5]], None, [G], VerifyMethod.GREEDY, sync=[SeqSync(4)], return_probs=True).probs)
        r.append(w.stats())
        results.append(r)
    for x, y in zip(*results):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0)  # tensors came through the object store
        else:
            assert x == y
    assert remote.stats().live_sequences == 2
    remote.free_many(["a", "b", "never-added"])
    assert remote.stats().live_sequences == 0
    with pytest.raises(KeyError, match="unknown sequence"):  # application errors keep their type
        remote.verify(["zzz"], [[]], None, [G], VerifyMethod.GREEDY)
    with pytest.raises(ValueError, match="already exists"):
        remote.add("c", [1])
        remote.add("c", [1])

    async def go():
        await remote.add_async("x", [1, 2, 3])
        p = await remote.propose_async(["x"], [4], [G])
        v = await remote.verify_async(["x"], [p.token_ids[0]], None, [G], VerifyMethod.GREEDY, sync=[SeqSync(3)])
        await remote.free_many_async(["x"])
        return p, v, await remote.stats_async()

    p, v, st = asyncio.run(go())
    assert v.num_accepted == [4] and st.live_sequences == 1  # "c" is still there
    remote.free("c")
    assert remote.ping() == remote.incarnation


@pytest.mark.parametrize("setup", ["draft", "cascade3", "models3"])
def test_cascade_over_actors_equals_in_process(setup, fakes):
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.REJECTION, sp), (VerifyMethod.COUPLED, sp)]:
        want = generate(fake_cascade(setup, method, in_process()), PROMPTS, max_tokens=20, sampling=sampling,
                        ignore_eos=True)
        got = generate(fake_cascade(setup, method, fakes.workers), PROMPTS, max_tokens=20, sampling=sampling,
                       ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], (setup, method)
        assert got.stats["target"].as_dict() == want.stats["target"].as_dict()
        assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())  # everything freed


@pytest.mark.parametrize("setup", ["draft", "models3"])
def test_every_transport_gives_the_in_process_output(setup, fakes):
    """The same actors reached through their own sockets (`direct`, the default), through a compiled graph per
    level, and by plain actor calls: identical outputs and statistics, equal to the in-process loop; sequences
    freed."""
    assert all(w.transport == "direct" for w in fakes.workers.values())
    others = {t: {n: ActorWorker(w.handle, info=w._info_cache, level=n, transport=t) for n, w in fakes.workers.items()}
              for t in ("compiled", "call")}
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    try:
        for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.COUPLED, sp)]:
            want = generate(fake_cascade(setup, method, in_process()), PROMPTS, max_tokens=20, sampling=sampling,
                            ignore_eos=True)
            for workers in (fakes.workers, *others.values()):
                got = generate(fake_cascade(setup, method, workers), PROMPTS, max_tokens=20, sampling=sampling,
                               ignore_eos=True)
                assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], (setup, method)
                assert got.stats["target"].as_dict() == want.stats["target"].as_dict()
            assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())
        assert others["compiled"]["target"]._graph is not None and fakes.workers["target"]._direct is not None
    finally:
        for w in others["compiled"].values():
            w.close()  # an idle compiled graph's reader keeps a core busy


def test_tree_rounds_over_actors_equal_plain(fakes):
    """A suffix level drafting token trees for the target's actor (`verify_tree` over the direct transport and a
    plain actor call: token ids and parents on the wire): greedy == plain decoding in process, with trees that
    branched; the same call in process and over the actor gives the same result."""
    from specray.engine.tree_rows import TokenTree
    from specray.spec.suffix import SuffixConfig, SuffixDrafter
    from specray.spec.tree import DraftTree

    prompts = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], [9],
               [3, 3, 4, 3, 3, 5, 3, 3, 4, 3, 3, 6, 3, 3]]
    remote = fakes.workers["target"]
    assert remote.capabilities().tree_verify
    local = in_process()["target"]
    trees = [TokenTree((7, 9, 8, 10), (-1, -1, 0, 1)), None]
    sp = [SamplingParams(temperature=0.8, seed=3), G]
    for w in (remote, local):
        w.add("tr", prompts[0])
        w.add("tr2", prompts[1])
    got = [w.verify_tree(["tr", "tr2"], trees, None, sp, VerifyMethod.DETERMINISTIC, level=1) for w in (remote, local)]
    assert got[0] == got[1] and got[0].tree_nodes == [4, 0]
    remote.free_many(["tr", "tr2"])

    def levels(target) -> list[Level]:
        sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=6, max_spec_factor=4.0, min_token_prob=0.0))
        return [Level("suffix", suffix=sx, k=6, tree_width=3), Level("target", worker=target)]

    sent: list[DraftTree] = []
    call = ActorWorker(remote.handle, info=remote._info_cache, level="target", transport="call")
    plain = generate([Level("target", worker=local)], prompts, max_tokens=20, ignore_eos=True, plain=True)
    for target in (remote, call):
        orig = target.verify_tree

        def spy(seq_ids, trees, *a, _orig=orig, **kw):
            sent.extend(trees)
            return _orig(seq_ids, trees, *a, **kw)

        target.verify_tree = spy
        try:
            got = generate(levels(target), prompts, max_tokens=20, ignore_eos=True, plan=Plan((0, 1), (6,)))
        finally:
            del target.verify_tree
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        assert got.stats["target"].tree_drafts > 0 and got.stats["target"].accepted_tokens > 0
        assert target.stats().live_sequences == 0  # everything freed (with this client's next call)
    assert any(t.num_nodes and not t.is_chain for t in sent)


def test_model_tree_rounds_over_actors_equal_plain(fakes):
    """A model level drafting token trees in its actor (`propose_tree`: trees back as token ids and parents, q
    when sampled) for the target's actor: the call equals the in-process one, and greedy == plain decoding over
    the direct transport and a plain actor call, with trees that branched."""
    from specray.spec.params import TreeShape

    remote, local = fakes.workers["d2"], in_process()["d2"]
    assert remote.capabilities().tree_propose
    sp = [SamplingParams(temperature=0.8, seed=3), G]
    got = [w.propose_tree(["pt", "pt2"], [3, 2], sp, mode=DraftMode.RANDOM, level=1, width=2, max_nodes=[5, 4],
                          sync=[SeqSync.start(PROMPTS[1]), SeqSync.start(PROMPTS[0])]) for w in (remote, local)]
    assert got[0].trees == got[1].trees and got[0].token_ids == got[1].token_ids
    assert torch.equal(got[0].probs, got[1].probs) and got[0].trees[0].num_nodes == 5
    remote.free_many(["pt", "pt2"])

    plain = generate([Level("target", worker=in_process()["target"])], PROMPTS, max_tokens=20, ignore_eos=True,
                     plain=True)
    target = fakes.workers["target"]
    for transport in ("direct", "call"):
        d2 = remote if transport == "direct" else ActorWorker(remote.handle, info=remote._info_cache, level="d2",
                                                             transport="call")
        levels = [Level("d2", worker=d2, k=4, tree=TreeShape(2, 4, 8)), Level("target", worker=target)]
        got = generate(levels, PROMPTS, max_tokens=20, ignore_eos=True, plan=Plan((0, 1), (4,)))
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        st = got.stats["target"]
        assert st.tree_drafts == st.num_drafts > 0 and st.tree_nodes > st.num_drafts and st.accepted_tokens > 0
        assert d2.stats().live_sequences == 0  # everything freed (with this client's next call)


def test_a_middle_level_actor_verifies_trees_and_equals_in_process(fakes):
    """suffix(trees) -> d2's actor -> the target's actor, with nested drafting on (a lookup level below runs in
    the coordinator, so the coordinator makes the inner rounds' calls): d2 verifies the suffix level's trees over
    the wire (`verify_tree` with return_probs for a rejection target): the in-process tokens and statistics,
    plain decoding's text when greedy; everything freed."""
    from specray.coordinator.cascade import CascadeEngine
    from specray.spec.suffix import SuffixConfig, SuffixDrafter

    prompts = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2], [9],
               [3, 3, 4, 3, 3, 5, 3, 3, 4, 3, 3, 6, 3, 3]]

    def levels(workers, method) -> list[Level]:
        sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=6, max_spec_factor=4.0, min_token_prob=0.0,
                                        tree_width=3))
        return [Level("suffix", suffix=sx, k=6, tree_width=3), Level("d2", worker=workers["d2"], k=6, method=method),
                Level("target", worker=workers["target"], method=method)]

    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(prompts))]
    plan = Plan((0, 1, 2), (6, 6))
    trees = []
    mid = fakes.workers["d2"]
    orig = mid.verify_tree

    def spy(seq_ids, ts, *a, **kw):
        trees.extend(ts)
        return orig(seq_ids, ts, *a, **kw)

    mid.verify_tree = spy
    try:
        plain = generate(fake_cascade("draft", VerifyMethod.GREEDY, in_process())[-1:], prompts, max_tokens=20,
                         ignore_eos=True, plain=True)
        for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.REJECTION, sp)]:
            want = generate(levels(in_process(), method), prompts, max_tokens=20, sampling=sampling,
                            ignore_eos=True, plan=plan)
            eng = CascadeEngine(levels(fakes.workers, method), nesting=fakes.nesting)
            got = generate(eng, prompts, max_tokens=20, sampling=sampling, ignore_eos=True, plan=plan)
            assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], method
            assert {n: st.as_dict() for n, st in got.stats.items()} == {n: st.as_dict() for n, st in want.stats.items()}
            if sampling is None:
                assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
            assert got.stats["d2"].tree_drafts > 0
            assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())
    finally:
        del mid.verify_tree
    assert any(t is not None and t.num_nodes and not t.is_chain for t in trees)


def _equal_in_process_counting(fakes, setup: str, worker: str, method_name: str, check_calls) -> None:
    """The fake cascade `setup` over the actors equals the in-process loop (tokens and per-level statistics) for
    greedy, rejection and coupled verification, with `fakes.workers[worker].<method_name>` calls counted per run:
    `check_calls(calls, rounds, method)` asserts on them."""
    from specray.coordinator.cascade import CascadeEngine

    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    counted_on = fakes.workers[worker]
    calls = {"n": 0}
    orig = getattr(counted_on, method_name)

    def counted(*a, **kw):
        calls["n"] += 1
        return orig(*a, **kw)

    setattr(counted_on, method_name, counted)
    try:
        for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.REJECTION, sp), (VerifyMethod.COUPLED, sp)]:
            want = generate(fake_cascade(setup, method, in_process()), PROMPTS, max_tokens=20, sampling=sampling,
                            ignore_eos=True)
            calls["n"] = 0
            eng = CascadeEngine(fake_cascade(setup, method, fakes.workers), nesting=fakes.nesting)
            got = generate(eng, PROMPTS, max_tokens=20, sampling=sampling, ignore_eos=True)
            assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], method
            assert {n: st.as_dict() for n, st in got.stats.items()} == {n: st.as_dict() for n, st in want.stats.items()}
            check_calls(calls["n"], max(r.rounds for r in got.results), method)
            assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())
    finally:
        delattr(counted_on, method_name)


@pytest.mark.parametrize("setup", ["models3", "cascade3"])
def test_nested_drafting_over_actors_equals_in_process(fakes, setup):
    """The middle level runs its inner rounds in its actor, calling the level below's actor directly (models3:
    d1 -> d2 -> target), or drafting with the n-gram level below itself (cascade3: n-gram -> d2 -> target): the
    same tokens and per-level statistics as the in-process loop, one coordinator call to it per round."""
    assert fakes.nesting is not None  # cascade.nested is on by default

    def check(calls: int, rounds: int, method) -> None:
        assert 0 < calls <= rounds

    _equal_in_process_counting(fakes, setup, "d2", "nested", check)


@pytest.mark.parametrize("setup", ["draft", "models3", "cascade3"])
def test_relayed_drafts_over_actors_equal_in_process(fakes, setup):
    """The level right below the target sends its drafts to the target's actor itself (`cascade.relay`, on by
    default: d2's `propose`, or d2's nested inner rounds over d1 or the n-gram), and the target replies to the
    coordinator: the same tokens and per-level statistics as the in-process loop, every round relayed."""

    def check(relayed: int, rounds: int, method) -> None:
        # every round that drafts is relayed: all but maybe the last (every row owes one token: nothing to draft)
        assert rounds - 1 <= relayed <= rounds, method

    _equal_in_process_counting(fakes, setup, "target", "verify_later", check)


@pytest.mark.parametrize("setup", ["models3", "cascade3"])
def test_follow_ons_over_actors_are_used_and_equal_in_process(fakes, setup):
    """The target sends its verdict to the relaying middle level's actor, which drafts the next round on it
    (`NestedDraft.follow`, specray.serve.follow): most rounds take that outcome, and the tokens and per-level
    statistics equal the in-process loop's, greedy and sampled."""
    from specray.coordinator.cascade import CascadeEngine

    sp = [SamplingParams(temperature=0.8, seed=s) for s in range(len(PROMPTS))]
    for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.COUPLED, sp), (VerifyMethod.REJECTION, sp)]:
        want = generate(fake_cascade(setup, method, in_process()), PROMPTS, max_tokens=20, sampling=sampling,
                        ignore_eos=True)
        before = fakes.workers["d2"].transport_stats()
        eng = CascadeEngine(fake_cascade(setup, method, fakes.workers), nesting=fakes.nesting)
        got = generate(eng, PROMPTS, max_tokens=20, sampling=sampling, ignore_eos=True)
        after = fakes.workers["d2"].transport_stats()
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], method
        assert {n: st.as_dict() for n, st in got.stats.items()} == {n: st.as_dict() for n, st in want.stats.items()}
        used = after["follow_used"] - before["follow_used"]
        rounds = max(r.rounds for r in got.results)
        assert eng.drafter.followed == used >= rounds // 2, (method, used, rounds)
        assert after["follow_drafted"] - before["follow_drafted"] >= used
        assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())


def test_rows_joining_a_followed_batch_over_actors_equal_plain(fakes):
    """Sequences join a running batch (as the scheduler admits requests) while the middle level drafts on the
    target's verdicts: the follow-on is taken for the running rows and only the new ones are drafted in the same
    request (`FollowOns.claim`); every row gets the plain target's greedy tokens and every level ends empty."""
    from specray.coordinator.cascade import CascadeEngine

    want = generate([Level("target", worker=in_process()["target"])], PROMPTS, max_tokens=17, ignore_eos=True)
    before = fakes.workers["d2"].transport_stats()
    eng = CascadeEngine(fake_cascade("models3", VerifyMethod.GREEDY, fakes.workers), nesting=fakes.nesting)
    seqs = [eng.new_sequence(p, SamplingParams(), 17) for p in PROMPTS[:2]]
    waiting, r = list(PROMPTS[2:]), 0
    while any(not s.finished for s in seqs) or waiting:
        if r in (2, 4) and waiting:
            seqs.append(eng.new_sequence(waiting.pop(0), SamplingParams(), 17))
        eng.step(seqs)
        r += 1
    for s in seqs:
        eng.release(s)
    after = fakes.workers["d2"].transport_stats()
    assert [s.output for s in seqs] == [x.token_ids for x in want.results]
    assert after["follow_joins"] - before["follow_joins"] >= 2
    assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())


#: eight rows for the streams whose rows end apart
APART = PROMPTS + [[t + 1 for t in p] for p in PROMPTS]


def _plain_each(prompts, lengths) -> list[list[int]]:
    """The plain target's greedy tokens for each prompt, each with its own length."""
    return [generate([Level("target", worker=in_process()["target"])], [p], max_tokens=n, ignore_eos=True)
            .results[0].token_ids for p, n in zip(prompts, lengths)]


def _step_releasing(eng, seqs, before=None, after=None) -> int:
    """Rounds until every row ends, each ended row freed at once (as a scheduler does); `before(r)` / `after(r)`
    run around round r; returns the rounds run."""
    r = 0
    while any(not s.finished for s in seqs):
        if before is not None:
            before(r)
        eng.step(seqs)
        r += 1
        if after is not None:
            after(r)
        for s in seqs:
            if s.finished:
                eng.release(s)
    return r


def _until_empty(workers, timeout_s: float = 10.0) -> None:
    """Wait for the levels to hold no sequence: frees sent on their own (`Frees`) are one-way and land a moment
    later."""
    deadline = time.monotonic() + timeout_s
    while any(w.stats().live_sequences for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_rows_ending_apart_in_a_followed_batch_over_actors_equal_plain(fakes, monkeypatch):
    """Eight rows of different lengths, one of them ended by the coordinator itself mid-stream (as a stop string
    ends a request), with follow-ons at every batch size: requests that free rows take the follow-on (the frees
    below go with the next call there, `FollowOns` "Frees"), a request that lacks a drafted row takes it for the
    others, every row gets the plain target's greedy tokens, and every level ends empty."""
    from specray.coordinator import drafting
    from specray.coordinator.cascade import CascadeEngine

    monkeypatch.setattr(drafting, "FOLLOW_MAX_ROWS", 64)
    lengths = [9, 21, 13, 17, 11, 19, 15, 23]
    plain = _plain_each(APART, lengths)
    before = fakes.workers["d2"].transport_stats()
    eng = CascadeEngine(fake_cascade("models3", VerifyMethod.GREEDY, fakes.workers), nesting=fakes.nesting)
    seqs = [eng.new_sequence(p, SamplingParams(), n) for p, n in zip(APART, lengths)]

    def stop_one(r: int) -> None:
        if r == 2:  # the coordinator ends a row the verdict did not (a stop string)
            seqs[1].finished, seqs[1].finish_reason = True, "stop"

    r = _step_releasing(eng, seqs, after=stop_one)
    after = fakes.workers["d2"].transport_stats()
    assert [s.output for s in seqs] == [plain[1][: len(seqs[1].output)] if j == 1 else x
                                        for j, x in enumerate(plain)]
    used, trims = (after[f"follow_{k}"] - before[f"follow_{k}"] for k in ("used", "trims"))
    assert used >= r // 2 and trims >= 1, (used, trims, r)
    _until_empty(fakes.workers.values())
    assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())
    assert fakes.workers["d2"].transport_stats()["follow_owed_frees"] == 0


def test_penalties_min_p_and_logprobs_over_actors_equal_in_process(fakes):
    """Per-sequence penalties, min_p and logprobs travel with the sampling parameters (sent once per sequence)
    to every level's actor, the nested middle level's included; the log-probabilities come back with the
    target's verdict: tokens and log-probabilities equal the in-process loop's."""
    from specray.coordinator.cascade import CascadeEngine

    sp = [SamplingParams(temperature=0.9 if s % 2 else 0.0, seed=s, min_p=0.05, presence_penalty=0.6,
                         frequency_penalty=0.4, repetition_penalty=1.4, logprobs=2) for s in range(len(PROMPTS))]
    for method in (VerifyMethod.REJECTION, VerifyMethod.COUPLED):
        want = generate(fake_cascade("models3", method, in_process()), PROMPTS, max_tokens=16, sampling=sp,
                        ignore_eos=True)
        eng = CascadeEngine(fake_cascade("models3", method, fakes.workers), nesting=fakes.nesting)
        got = generate(eng, PROMPTS, max_tokens=16, sampling=sp, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], method
        assert [r.logprobs for r in got.results] == [r.logprobs for r in want.results], method
        assert all(len(r.logprobs) == 16 and all(len(lp.top) == 2 for lp in r.logprobs) for r in got.results)
        assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())


def _until_taken_back(eng, name: str, prompts, max_tokens: int, timeout_s: float = 60.0):
    """Generate until level `name` is up again and d2 verified drafts in the run (Ray restarted the killed actor
    and the probe took it back); returns the last run and d2's statistics in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = generate(eng, prompts, max_tokens=max_tokens, ignore_eos=True)
        mid = got.stats.get("d2")
        if (eng.level_status()[name] == "up" and mid is not None and mid.draft_tokens > 0) \
                or time.monotonic() >= deadline:
            return got, mid
        time.sleep(0.2)


@pytest.mark.parametrize("victim", ["d1", pytest.param("d2", marks=pytest.mark.slow)])
def test_a_level_killed_during_nested_drafting_fails_over_exactly(victim):
    """d1 -> d2 -> target with d2 drafting nested: killing the level below (d1, reached from d2's actor) or the
    middle level itself drops it from the cascade; every row finishes with the plain target's tokens; Ray
    restarts the actor and the cascade takes it back."""
    from specray.coordinator.cascade import CascadeEngine

    cfg = CascadeConfig(levels=[level(n, num_speculative_tokens=k) for n, k in (("d1", 2), ("d2", 5))]
                        + [level("target")], follow=True)
    with launch_levels(cfg, [fake(n, *FAKES[n]) for n in ("d1", "d2", "target")], name_prefix=f"nk{victim}") as lc:
        eng = CascadeEngine(lc.levels, nesting=lc.nesting)
        eng.retry_after_s = 0.0
        seqs = [eng.new_sequence(p, SamplingParams(), 60) for p in PROMPTS]
        pid, r = lc.info[victim]["pid"], 0
        index = [lv.name for lv in eng.levels].index(victim)
        while any(not s.finished for s in seqs):
            if r == 2:
                os.kill(pid, signal.SIGKILL)
            eng.step(seqs)
            r += 1
        # marked down (its epoch bumped); with retry_after_s 0 the restarted actor may already be back in the
        # same step, so the status after a step need not show it
        assert eng.failover.epoch[index] > 0, "the killed level was never dropped"
        want = generate([Level("target", worker=in_process()["target"])], PROMPTS, max_tokens=60, ignore_eos=True)
        assert [s.output for s in seqs] == [x.token_ids for x in want.results]
        for s in seqs:
            eng.release(s)
        # restarted by Ray, probed, taken back: a fresh generation is exact and the level drafts again
        # (d2 verified drafts: both levels ran, d1's drafts are what d2 verifies)
        got, mid = _until_taken_back(eng, victim, PROMPTS[:2], 12)
        assert eng.level_status()[victim] == "up" and mid is not None and mid.draft_tokens > 0
        assert [x.token_ids for x in got.results] == [x.token_ids[:12] for x in want.results[:2]]
        assert lc.workers[victim].info()["pid"] != pid
        assert all(w.stats().live_sequences == 0 for w in lc.workers.values())


def test_a_middle_level_killed_while_rows_end_apart_leaves_nothing_behind_below(monkeypatch):
    """d1 -> d2 -> target with follow-ons while rows end round after round: a request that takes a follow-on leaves
    its frees for d1 owed at d2 until d2's next call there, so when d2 is killed the coordinator sends the frees
    its last requests carried again. Every row gets the plain target's tokens and d1 ends empty."""
    from specray.coordinator import drafting
    from specray.coordinator.cascade import CascadeEngine

    monkeypatch.setattr(drafting, "FOLLOW_MAX_ROWS", 64)
    cfg = CascadeConfig(levels=[level(n, num_speculative_tokens=k) for n, k in (("d1", 2), ("d2", 5))]
                        + [level("target")], follow=True)
    lengths = [6, 9, 12, 15, 18, 21, 40, 44]
    with launch_levels(cfg, [fake(n, *FAKES[n]) for n in ("d1", "d2", "target")], name_prefix="nkfree") as lc:
        eng = CascadeEngine(lc.levels, nesting=lc.nesting)
        eng.retry_after_s = 0.0
        seqs = [eng.new_sequence(p, SamplingParams(), n) for p, n in zip(APART, lengths)]
        pid = lc.info["d2"]["pid"]

        def kill(r: int) -> None:
            if r == 4:
                os.kill(pid, signal.SIGKILL)

        _step_releasing(eng, seqs, before=kill)
        assert [s.output for s in seqs] == _plain_each(APART, lengths)
        _until_empty([lc.workers["d1"]])
        assert lc.workers["d1"].stats().live_sequences == 0
        assert lc.workers["target"].stats().live_sequences == 0


def test_a_middle_level_killed_while_drafting_with_the_ngram_beside_it_fails_over_exactly():
    """n-gram -> d2 -> target, d2 drafting nested with the n-gram text it holds: killing d2 loses that text with
    it; every row finishes with the plain target's tokens, and once Ray restarts d2 the cascade takes it back and
    the n-gram texts start again from the rows' whole contexts (exact again, d2 verifying the n-gram's drafts)."""
    from specray.coordinator.cascade import CascadeEngine

    cfg = CascadeConfig(levels=[level("d2", num_speculative_tokens=5), level("target")])
    with launch_levels(cfg, [fake(n, *FAKES[n]) for n in ("d2", "target")], name_prefix="nkng") as lc:
        levels = [Level("ngram", ngram=NgramConfig(3, 1, 3), k=3), *lc.levels]
        eng = CascadeEngine(levels, nesting=lc.nesting)
        eng.retry_after_s = 0.0
        seqs = [eng.new_sequence(p, SamplingParams(), 60) for p in PROMPTS]
        pid, r = lc.info["d2"]["pid"], 0
        while any(not s.finished for s in seqs):
            if r == 3:
                os.kill(pid, signal.SIGKILL)
            eng.step(seqs)
            r += 1
        assert eng.failover.epoch[1] > 0, "the killed level was never dropped"
        want = generate([Level("target", worker=in_process()["target"])], PROMPTS, max_tokens=60, ignore_eos=True)
        assert [s.output for s in seqs] == [x.token_ids for x in want.results]
        for s in seqs:
            eng.release(s)
        got, mid = _until_taken_back(eng, "d2", PROMPTS, 24)  # d2 verified the n-gram's drafts
        assert eng.level_status()["d2"] == "up" and mid is not None and mid.draft_tokens > 0
        assert [x.token_ids for x in got.results] == [x.token_ids[:24] for x in want.results]
        assert all(w.stats().live_sequences == 0 for w in lc.workers.values())


@pytest.mark.parametrize("setup", ["draft", "models3"])
def test_overlap_over_actors_equals_in_process(setup, fakes):
    """Overlap with levels as actors: the look-ahead runs on the draft actors while the target actor
    verifies (concurrent calls on actor proxies); outputs equal the in-process loop without overlap."""
    from specray.coordinator.cascade import CascadeEngine

    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]
    for method, sampling in [(VerifyMethod.GREEDY, None), (VerifyMethod.COUPLED, sp)]:
        want = generate(fake_cascade(setup, method, in_process()), PROMPTS, max_tokens=20, sampling=sampling,
                        ignore_eos=True)
        eng = CascadeEngine(fake_cascade(setup, method, fakes.workers), overlap=True)
        got = generate(eng, PROMPTS, max_tokens=20, sampling=sampling, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], (setup, method)
        assert eng.ahead_rows > 0
        assert all(w.stats().live_sequences == 0 for w in fakes.workers.values())


def test_hf_cascades_over_actors_equal_plain_greedy(tiny):
    def hf(name: str, path, **kw) -> LevelConfig:
        return LevelConfig(kind="hf", model=str(path), name=name, dtype="float32", num_cpus=1, **kw)

    target = HFWorker(str(tiny.target_dir), name="t", dtype="float32")
    prompts = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]
    plain = generate([Level("t", worker=target)], prompts, max_tokens=16, ignore_eos=True)
    cfg = CascadeConfig(levels=[
        hf("small", tiny.draft_dirs["small"], num_speculative_tokens=2),
        hf("mid", tiny.draft_dirs["mid"], num_speculative_tokens=4),
        hf("t", tiny.target_dir),
    ])
    with launch_levels(cfg, name_prefix="hf3") as lc:  # default factories: create_worker inside the actors
        assert len({i["tokenizer_fingerprint"] for i in lc.info.values()}) == 1
        assert lc.levels[-1].worker.tokenizer.encode("Hello") == target.tokenizer.encode("Hello")
        got = generate(lc.levels, prompts, max_tokens=16, ignore_eos=True)  # text: tokenizer from the actor
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        assert [r.text for r in got.results] == [r.text for r in plain.results]
        assert got.stats["t"].accepted_tokens > 0 and got.stats["mid"].accepted_tokens > 0
        # ngram -> mid -> target, reusing the running actors
        levels = [Level("ngram", ngram=NgramConfig(3, 1, 3)), *lc.levels[1:]]
        got = generate(levels, prompts, max_tokens=16, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        # mid drafting token trees in its actor for the target's, ragged batch of 4 (reusing the actors)
        from dataclasses import replace

        from specray.spec.params import TreeShape

        prompts4 = [*prompts, "class Stack:\n    def __init__(self):\n        self.items = []\n    def push"]
        plain4 = generate([Level("t", worker=target)], prompts4, max_tokens=16, ignore_eos=True)
        levels = [replace(lc.levels[1], tree=TreeShape(2, 4, 8)), lc.levels[2]]
        got = generate(levels, prompts4, max_tokens=16, ignore_eos=True, plan=Plan((0, 1), (4,)))
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain4.results]
        assert got.stats["t"].tree_drafts > 0 and got.stats["t"].accepted_tokens > 0


def test_tokenizer_mismatch_fails_at_startup(tiny, tmp_path):
    from specray.testing.tiny import build_tiny_model, train_tokenizer

    other = build_tiny_model(tmp_path / "other", train_tokenizer(tmp_path / "tok1", variant=1), seed=0)
    cfg = CascadeConfig(levels=[
        LevelConfig(kind="hf", model=str(other), name="odd-draft", dtype="float32", num_cpus=0.5),
        LevelConfig(kind="hf", model=str(tiny.target_dir), name="target", dtype="float32", num_cpus=0.5),
    ])
    with pytest.raises(TokenizerMismatchError, match="odd-draft.*target"):
        launch_levels(cfg, name_prefix="mismatch")
    assert not [a for a in ray.util.list_named_actors() if a.startswith("mismatch.")]  # cleaned up


def test_each_level_lands_in_its_bundle_with_its_resources():
    cfg = CascadeConfig(
        levels=[LevelConfig(kind="ngram"),
                level("d", num_cpus=1, resources={"draft": 1}),
                level("t", num_cpus=2, resources={"target": 2}, accelerator_type="T4", num_threads=2)],
        placement=PlacementConfig(strategy="STRICT_PACK"),
    )
    with launch_levels(cfg, [None, fake("d", 0.5), fake("target")], name_prefix="pl") as lc:
        names = set(ray.util.list_named_actors())
        assert lc.levels[0].is_ngram and set(lc.actors) == {"d", "t"}
        pg_id = lc.placement_group.id.hex()
        for j, (name, res) in enumerate([("d", {"CPU": 1, "draft": 1}),
                                         ("t", {"CPU": 2, "target": 2, "accelerator_type:T4": 0.001})]):
            info = lc.workers[name].info()
            assert info["placement_group_id"] == pg_id
            assert info["bundle_index"] == j == lc.info[name]["expected_bundle_index"]
            assert info["node_id"] == lc.info[name]["bundle_node_id"]
            assert info["resources"] == pytest.approx(res)
        assert lc.info["t"]["num_threads"] == 2 and lc.info["d"]["num_threads"] == 1
        assert {"pl.d", "pl.t"} <= names
    assert not [a for a in ray.util.list_named_actors() if a.startswith("pl.")]
    # without a placement group the actors still get their resources
    cfg.placement.enabled = False
    with launch_levels(cfg, [None, fake("d", 0.5), fake("target")], name_prefix=None) as lc:
        info = lc.workers["t"].info()
        assert info["placement_group_id"] is None and info["resources"]["target"] == 2
        assert generate(lc.levels, PROMPTS[:1], max_tokens=5, ignore_eos=True).results[0].token_ids


def test_a_suffix_level_launches_in_the_coordinator():
    """A suffix level gets no actor (it drafts inside the coordinator); over an actor target it is exact, and its
    global trie learns each sequence's output."""
    cfg = CascadeConfig(levels=[LevelConfig(kind="suffix", num_speculative_tokens=5), level("t")])
    plain = generate([Level("t", worker=FakeWorker("t", vocab=16, order=2, table_seed=0))], PROMPTS, max_tokens=20,
                     ignore_eos=True)
    with launch_levels(cfg, [None, fake("t")], name_prefix="sfx") as lc:
        assert lc.levels[0].suffix is not None and set(lc.actors) == {"t"}
        out = generate(lc.levels, PROMPTS, max_tokens=20, ignore_eos=True)
        assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
        assert len(lc.levels[0].suffix.cached) == len(PROMPTS)


def test_killed_level_is_restarted_and_reports_lost_sequences():
    cfg = CascadeConfig(levels=[level("d2", num_speculative_tokens=3), level("target")])
    with launch_levels(cfg, [fake("d2", *FAKES["d2"]), fake("target")], name_prefix="kill") as lc:
        w = lc.workers["target"]
        w.add("a", [1, 2, 3])
        pid = lc.info["target"]["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        errors: list[LevelUnavailable] = []
        while time.monotonic() - t0 < 60:
            try:
                w.verify(["a"], [[]], None, [G], VerifyMethod.GREEDY)
                pytest.fail("a sequence survived the restart")
            except LevelRestarted as e:
                errors.append(e)
                break
            except LevelUnavailable as e:  # dead or restarting
                errors.append(e)
                time.sleep(0.1)
        assert isinstance(errors[-1], LevelRestarted), errors
        assert "'target'" in str(errors[-1])
        info = w.info()
        assert info["pid"] != pid and info["reconstructed"] and info["incarnation"] == w.incarnation
        assert w.stats().live_sequences == 0
        # the level serves again: a fresh generation through the same ActorWorkers is exact
        want = generate(fake_cascade("draft", VerifyMethod.GREEDY, in_process()), PROMPTS, max_tokens=12,
                        ignore_eos=True)
        got = generate(lc.levels, PROMPTS, max_tokens=12, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


@pytest.mark.parametrize("chain", [pytest.param(("d2",), marks=pytest.mark.slow), ("d1", "d2")])
def test_a_target_killed_during_relayed_rounds_fails_its_round_and_serves_again(chain):
    """Relayed rounds (the level below the target sends it the drafts): killing the target fails the round in
    flight with the target's error (its requests end, as the failure table says) instead of hanging on a
    verification whose drafts went nowhere; once Ray has restarted it, new requests are exact and relayed again."""
    from specray.coordinator.cascade import CascadeEngine
    from specray.coordinator.failover import LevelCallError

    names = (*chain, "target")
    cfg = CascadeConfig(levels=[level(n, num_speculative_tokens=3) for n in chain] + [level("target")], follow=True)
    with launch_levels(cfg, [fake(n, *FAKES[n]) for n in names], name_prefix=f"kr{len(chain)}") as lc:
        eng = CascadeEngine(lc.levels, nesting=lc.nesting)
        target = lc.workers["target"]
        relayed = {"n": 0}
        orig = target.verify_later

        def counted(*a, **kw):
            relayed["n"] += 1
            return orig(*a, **kw)

        target.verify_later = counted
        seqs = [eng.new_sequence(p, SamplingParams(), 40) for p in PROMPTS]
        eng.step(seqs)
        eng.step(seqs)
        assert relayed["n"] == 2
        os.kill(lc.info["target"]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(LevelCallError) as err:
            eng.step(seqs)
        assert err.value.level == len(names) - 1 and time.monotonic() - t0 < 30
        for s in seqs:
            eng.release(s)
        want = generate([Level("target", worker=in_process()["target"])], PROMPTS, max_tokens=12, ignore_eos=True)
        deadline = time.monotonic() + 60
        while True:  # Ray restarts the target; a request before it is back fails like the one above
            try:
                got = generate(eng, PROMPTS, max_tokens=12, ignore_eos=True)
                break
            except LevelCallError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
        assert relayed["n"] > 2 and target.info()["reconstructed"]
        assert all(w.stats().live_sequences == 0 for w in lc.workers.values())


def test_unsatisfiable_placement_fails_fast_with_a_clear_error():
    cfg = CascadeConfig(levels=[level("d"), level("t", resources={"no-such-gpu": 1})])
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"'t' \(bundle 1\).*no-such-gpu"):
        launch_levels(cfg, [fake("d"), fake("target")], name_prefix="bad", placement_timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"] == "bad.pg"] == ["REMOVED"]
    # two levels cannot be on different nodes of a one-node cluster
    cfg = CascadeConfig(levels=[level("d"), level("t")], placement=PlacementConfig(strategy="STRICT_SPREAD"))
    with pytest.raises(PlacementError, match="STRICT_SPREAD"):
        launch_levels(cfg, [fake("d"), fake("target")], name_prefix="bad2", placement_timeout_s=1)


def _broken() -> FakeWorker:
    raise RuntimeError("weights not found")


def test_a_level_that_cannot_start_is_a_clear_error():
    cfg = CascadeConfig(levels=[level("d"), level("t")])
    with pytest.raises(LevelStartError, match="'t' failed to start.*weights not found"):
        launch_levels(cfg, [fake("d"), _broken], name_prefix="broken", start_timeout_s=60)
    assert not [a for a in ray.util.list_named_actors() if a.startswith("broken.")]


def test_actor_worker_fits_the_protocol(fakes):
    from specray.engine.protocol import Worker

    assert all(isinstance(w, Worker) and isinstance(w, ActorWorker) for w in fakes.workers.values())
