"""The round loop with fake workers (no torch model, no Ray): exactness, rollback bookkeeping, stats."""

from __future__ import annotations

import itertools

import pytest
import torch

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.testing.fake import FakeWorker
from specray.testing.goodness import chi2_crit, chi2_stat

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


def target(**kw) -> FakeWorker:
    return FakeWorker("target", vocab=16, order=2, table_seed=0, **kw)


def draft(noise: float, name: str = "draft", seed: int = 1) -> FakeWorker:
    return FakeWorker(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)


def cascades(method: VerifyMethod) -> dict[str, list[Level]]:
    return {
        "plain": [Level("target", worker=target(), method=method)],
        "ngram": [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=target(), method=method)],
        "draft": [Level("d", worker=draft(0.7), k=3), Level("target", worker=target(), method=method)],
        "cascade3": [
            Level("ngram", ngram=NgramConfig(2, 1, 3)),
            Level("d", worker=draft(0.5), k=4, method=method),
            Level("target", worker=target(), method=method),
        ],
        "cascade3_models": [
            Level("d1", worker=draft(1.0, "d1", 3), k=2),
            Level("d2", worker=draft(0.4, "d2", 4), k=5, method=method),
            Level("target", worker=target(), method=method),
        ],
    }


def test_greedy_equals_plain_greedy_for_every_cascade():
    outs = {}
    for name, levels in cascades(VerifyMethod.GREEDY).items():
        batch = generate(levels, PROMPTS, max_tokens=25, ignore_eos=True)
        outs[name] = [r.token_ids for r in batch.results]
        assert all(len(t) == 25 for t in outs[name])
        assert all(r.ttft_s is not None and r.ttft_s > 0 for r in batch.results)
        for lvl in levels:
            if lvl.worker is not None:
                assert lvl.worker.stats().live_sequences == 0  # everything freed
    for name, out in outs.items():
        assert out == outs["plain"], name
    # speculation actually happened and was accepted sometimes
    b = generate(cascades(VerifyMethod.GREEDY)["draft"], PROMPTS, max_tokens=25, ignore_eos=True)
    assert b.stats["target"].accepted_tokens > 0
    assert b.rounds < 4 * 25


@pytest.mark.parametrize("method", [VerifyMethod.REJECTION, VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED])
def test_coupled_and_seeded_outputs_are_reproducible(method):
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(4)]
    a = generate(cascades(method)["cascade3"], PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True)
    b = generate(cascades(method)["cascade3"], PROMPTS, max_tokens=20, sampling=sp, ignore_eos=True)
    assert [r.token_ids for r in a.results] == [r.token_ids for r in b.results]


def test_coupled_output_independent_of_drafter():
    sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + s) for s in range(4)]
    outs = {
        name: [r.token_ids for r in generate(levels, PROMPTS, max_tokens=30, sampling=sp, ignore_eos=True).results]
        for name, levels in cascades(VerifyMethod.COUPLED).items()
    }
    for name, out in outs.items():
        assert out == outs["plain"], name


def test_stats_add_up():
    levels = cascades(VerifyMethod.GREEDY)["cascade3"]
    batch = generate(levels, PROMPTS, max_tokens=20, ignore_eos=True)
    for r in batch.results:
        top = r.stats["target"]
        assert top.verify_calls == r.rounds
        assert top.emitted_tokens >= len(r.token_ids)  # the last round may overshoot max_tokens
        assert sum(top.accepted_per_pos) == top.accepted_tokens
        assert top.accepted_tokens <= top.draft_tokens
    mid = batch.stats["d"]
    assert mid.draft_tokens > 0 and sum(mid.accepted_per_pos) == mid.accepted_tokens


def test_stop_ids_and_max_tokens():
    lv = [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("target", worker=target())]
    plain = generate([Level("target", worker=target())], [[1, 2, 3]], max_tokens=30, ignore_eos=True)
    toks = plain.results[0].token_ids
    stop_tok = toks[5]
    first = toks.index(stop_tok)
    eng = CascadeEngine(lv)
    s = eng.new_sequence([1, 2, 3], SamplingParams(), 30, stop_ids=[stop_tok])
    while not s.finished:
        eng.step([s])
    assert s.output == toks[: first + 1] and s.finish_reason == "stop"
    eng.release(s)
    assert lv[1].worker.stats().live_sequences == 0


def test_plan_switches_levels_mid_sequence():
    """Switching plans between rounds (as the planner will) keeps greedy output exact."""
    levels = cascades(VerifyMethod.GREEDY)["cascade3"]
    eng = CascadeEngine(levels)
    seqs = [eng.new_sequence(p, SamplingParams(), 30) for p in PROMPTS]
    plans = [Plan((2,), ()), Plan((0, 1, 2), (2, 4)), Plan((1, 2), (3,)), Plan((0, 2), (4,))]
    r = 0
    while any(not s.finished for s in seqs):
        eng.step(seqs, plans[r % len(plans)])
        r += 1
    ref = generate([Level("target", worker=target())], PROMPTS, max_tokens=30, ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]


def _exact_joint(worker: FakeWorker, prompt: list[int], sp: SamplingParams, n: int) -> dict[tuple, float]:
    """Exact distribution of the next n tokens under the target's processed sampling distribution."""
    sb = SamplingBatch.from_params([SamplingParams(sp.temperature, sp.top_k, sp.top_p, 0)])
    out = {}
    for seq in itertools.product(range(worker.vocab_size), repeat=n):
        ctx, pr = list(prompt), 1.0
        for t in seq:
            p = processed_probs(worker.next_logits(ctx)[None, None], sb)[0, 0]
            pr *= float(p[t])
            ctx.append(t)
        if pr > 0:
            out[seq] = pr
    return out


def assert_target_law(batch, target: FakeWorker, prompt: list[int], sp: SamplingParams, n_tok: int) -> None:
    """The emitted n_tok-token sequences follow the target's exact joint law (chi-square goodness of fit)."""
    n_draws = len(batch.results)
    counts: dict[tuple, int] = {}
    for r in batch.results:
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_joint(target, prompt, sp, n_tok)
    assert set(counts) <= set(exact), "emitted a sequence the target cannot produce"
    stat, dof = chi2_stat(counts, exact, n_draws)  # over the cells with enough mass (others pooled)
    crit = chi2_crit(dof)
    assert stat < crit, f"chi2={stat:.1f} > {crit:.1f} (dof {dof})"


@pytest.mark.parametrize(
    "method,setup,sp",
    [
        (VerifyMethod.REJECTION, "draft", SamplingParams(temperature=1.0)),
        (VerifyMethod.REJECTION, "cascade3_models", SamplingParams(temperature=0.7, top_k=3)),
        (VerifyMethod.DETERMINISTIC, "cascade3", SamplingParams(temperature=1.0, top_p=0.8)),
        (VerifyMethod.COUPLED, "cascade3_models", SamplingParams(temperature=0.7)),
        (VerifyMethod.REJECTION, "draft_engine", SamplingParams(temperature=1.0, top_k=4)),
    ],
)
def test_cascade_output_distribution_is_the_targets(method, setup, sp):
    """End to end over whole cascades: the joint law of 2 generated tokens equals the target's."""
    vocab, n_draws, n_tok = 5, 6000, 2

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    levels = {
        "draft": [Level("d", worker=mk("d", 0.8, 2), k=2), Level("t", worker=mk("t", 0, 0), method=method)],
        # a target that verifies inside its engine's step: rejection becomes deterministic over greedy drafts
        "draft_engine": [Level("d", worker=mk("d", 0.8, 2), k=2),
                         Level("t", worker=mk("t", 0, 0), method=method, engine_verify=2)],
        "cascade3": [Level("ng", ngram=NgramConfig(2, 1, 2)), Level("d", worker=mk("d", 0.6, 2), k=3, method=method),
                     Level("t", worker=mk("t", 0, 0), method=method)],
        "cascade3_models": [Level("d1", worker=mk("d1", 1.2, 3), k=2), Level("d2", worker=mk("d2", 0.5, 4), k=3,
                            method=method), Level("t", worker=mk("t", 0, 0), method=method)],
    }[setup]
    prompt = [1, 2, 1, 2, 1]
    sps = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, 10_000 + i) for i in range(n_draws)]
    batch = generate(levels, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True)
    assert_target_law(batch, levels[-1].worker, prompt, sp, n_tok)
    assert batch.stats["t"].accepted_tokens > 0


def test_rejection_over_ngram_is_deterministic_method():
    lv = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=target(), method=VerifyMethod.REJECTION)]
    sp = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    batch = generate(lv, PROMPTS, max_tokens=10, sampling=sp, ignore_eos=True)
    assert all(len(r.token_ids) == 10 for r in batch.results)


def test_rejection_at_an_engine_verifying_level_is_deterministic_over_greedy_drafts():
    """An engine that verifies inside its step takes token ids only (no q): rejection there is the
    deterministic method, and its drafter drafts greedily; an explicit coupled request keeps its keyed noise."""
    from specray.coordinator.calls import LevelCalls
    from specray.engine.protocol import DraftMode

    R = VerifyMethod.REJECTION
    lv = [Level("d", worker=draft(0.5), k=2), Level("t", worker=target(), method=R, engine_verify=4),
          Level("t2", worker=target(), method=R)]
    calls = LevelCalls(lv, failover=None, feed=None)
    assert calls.method(1, 0) is VerifyMethod.DETERMINISTIC
    assert DraftMode.for_method(calls.method(1, 0)) == DraftMode.GREEDY
    assert calls.method(1, 0, VerifyMethod.COUPLED) is VerifyMethod.COUPLED
    assert calls.method(2, 0) is R  # no engine verification: q travels, rejection stays


class _DraftLog(FakeWorker):
    """A fake target that records the drafts of every verify call."""

    def __init__(self) -> None:
        super().__init__("target", vocab=16, order=2, table_seed=0)
        self.drafts: list[list[list[int]]] = []

    def verify(self, seq_ids, draft_ids, *args, **kwargs):
        self.drafts.append([list(d) for d in draft_ids])
        return super().verify(seq_ids, draft_ids, *args, **kwargs)


@pytest.mark.parametrize(("engine_verify", "sp", "first_drafted"), [
    (4, SamplingParams(), False),  # greedy at an engine-verifying target: its first step is a prefill
    (4, SamplingParams(temperature=0.8), False),  # no seed given: nobody can replay it
    (4, SamplingParams(temperature=0.8, seed=3), True),  # seeded: its draws depend on the draft, keep it
    (0, SamplingParams(), True),  # a forward pass verifies the draft with the prefill
])
def test_first_round_at_an_engine_verifying_target_goes_without_a_draft(engine_verify, sp, first_drafted):
    """A target that verifies drafts inside its engine step (engine_verify) prefills a new sequence in a step
    that verifies no draft, so the first round sends it none (the first token is not held back a step); the
    rounds after it draft as usual, and greedy output is plain's."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the n-gram has a match from the first round on
    plain = generate([Level("target", worker=target())], [prompt], max_tokens=12, ignore_eos=True)
    t = _DraftLog()
    levels = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=t, engine_verify=engine_verify)]
    batch = generate(levels, [prompt], max_tokens=12, sampling=sp, ignore_eos=True)
    assert bool(t.drafts[0][0]) is first_drafted
    assert any(d[0] for d in t.drafts[1:])  # drafted after the first round
    if sp.greedy:
        assert batch.results[0].token_ids == plain.results[0].token_ids


def test_bad_levels_are_rejected():
    with pytest.raises(ValueError, match="first"):
        CascadeEngine([Level("t0", worker=target()), Level("ng", ngram=NgramConfig()), Level("t", worker=target())])
    with pytest.raises(ValueError, match="target"):
        CascadeEngine([Level("ng", ngram=NgramConfig())])
    with pytest.raises(ValueError):
        Plan((0, 1), (1, 2))


def test_worker_verify_ragged_batch_and_rollback():
    """A ragged greedy verify accepts exactly the greedy prefix; rollback then re-verify agrees."""
    w = target()
    sp = [SamplingParams(seed=0)] * 2
    w.add("a", [1, 2, 3])
    w.add("b", [5])
    greedy, ctx = [], [1, 2, 3]
    for _ in range(3):
        greedy.append(int(torch.argmax(w.next_logits(ctx))))
        ctx.append(greedy[-1])
    bad = (greedy[1] + 1) % 16
    res = w.verify(["a", "b"], [[greedy[0], bad, 7], []], None, sp, VerifyMethod.GREEDY)
    assert res.token_ids[0] == greedy[:2] and res.num_accepted == [1, 0]
    assert res.token_ids[1] == [int(torch.argmax(w.next_logits([5])))]
    assert w.tokens("a") == [1, 2, 3, *greedy[:2]]
    w.rollback("a", 3)
    res = w.verify(["a"], [greedy[:3]], None, sp[:1], VerifyMethod.GREEDY)
    assert res.num_accepted == [3] and res.token_ids[0][:3] == greedy
    w.free("a")
    w.free("b")
    assert w.stats().live_sequences == 0


class Dying(FakeWorker):
    """A drafter whose calls fail while `dead` is set, and which forgets every sequence when it 'restarts'."""

    dead = False

    def _check(self):
        if self.dead:
            raise ConnectionError(f"{self.name} is down")

    def propose(self, *a, **kw):
        self._check()
        return super().propose(*a, **kw)

    def verify(self, *a, **kw):
        self._check()
        return super().verify(*a, **kw)

    def add(self, *a, **kw):
        self._check()
        return super().add(*a, **kw)

    def stats(self):
        self._check()
        return super().stats()

    def restart(self):
        self._seqs.clear()
        self.dead = False


@pytest.mark.parametrize("which", ["bottom", "middle"])
def test_a_failing_draft_level_is_dropped_and_taken_back_exactly(which):
    small = Dying("small", vocab=16, order=2, table_seed=0, noise=1.0, noise_seed=5)
    mid = Dying("mid", vocab=16, order=2, table_seed=0, noise=0.4, noise_seed=6)
    lv = [Level("small", worker=small, k=2), Level("mid", worker=mid, k=4), Level("target", worker=target())]
    eng = CascadeEngine(lv)
    eng.retry_after_s = 0.0
    victim = small if which == "bottom" else mid
    seqs = [eng.new_sequence(p, SamplingParams(), 40) for p in PROMPTS]
    r = 0
    while any(not s.finished for s in seqs):
        if r == 2:
            victim.dead = True
        if r == 5:
            assert eng.level_status()[victim.name] == "down"
            victim.restart()  # back, with no sequences: they are re-added
            calls_at_restart = len(victim.calls)
        eng.step(seqs)
        r += 1
    assert eng.level_status()[victim.name] == "up"
    ref = generate([Level("target", worker=target())], PROMPTS, max_tokens=40, ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]
    assert len(victim.calls) > calls_at_restart  # it was taken back into the cascade
    for s in seqs:
        eng.release(s)
    assert victim.stats().live_sequences == 0 and lv[2].worker.stats().live_sequences == 0


def test_a_hanging_health_probe_never_stalls_the_rounds():
    """A level whose node is gone can leave calls pending for minutes: its probe must not block the rounds,
    and when it finally answers the level comes back."""
    import threading
    import time

    gate = threading.Event()

    class Hanging(Dying):
        def stats(self):
            if self.dead:
                gate.wait(30)  # the "node" answers only when the test opens the gate
                self.dead = False
            return super().stats()

    mid = Hanging("mid", vocab=16, order=2, table_seed=0, noise=0.4, noise_seed=6)
    eng = CascadeEngine([Level("mid", worker=mid, k=3), Level("target", worker=target())])
    eng.retry_after_s = 0.0
    seqs = [eng.new_sequence(p, SamplingParams(), 30) for p in PROMPTS]
    eng.step(seqs)
    mid.dead = True
    t0 = time.monotonic()
    for _ in range(4):  # each round probes (retry_after 0) and must not wait for the hanging answer
        eng.step(seqs)
    assert time.monotonic() - t0 < 2.0
    assert eng.level_status()["mid"] == "down"
    mid._seqs.clear()  # the answer comes from a restarted worker that lost its sequences
    gate.set()
    deadline = time.monotonic() + 5
    while eng.level_status()["mid"] == "down" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.level_status()["mid"] == "up"
    calls = len(mid.calls)
    while any(not s.finished for s in seqs):
        eng.step(seqs)
    assert len(mid.calls) > calls
    ref = generate([Level("target", worker=target())], PROMPTS, max_tokens=30, ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]


def test_target_failure_is_raised():
    t = Dying("target", vocab=16, order=2)
    eng = CascadeEngine([Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=t)])
    s = eng.new_sequence([1, 2, 3], SamplingParams(), 10)
    eng.step([s])
    t.dead = True
    from specray.coordinator.cascade import LevelCallError

    with pytest.raises(LevelCallError) as ei:
        eng.step([s])
    assert ei.value.level == 1 and "target" in str(ei.value)


def test_a_call_that_starts_a_row_is_not_timed_for_the_planner():
    """A row's first call at a level runs its prefill (and, at a batch size new to the level, grows its cache):
    however short the prompt, that call is not a step, so the planner gets no time for it; the calls after it are
    timed. (Timed, the first call of 32 rows made plain decoding at batch 32 look several times dearer than it is.)"""
    levels = [Level("target", worker=target())]
    engine = CascadeEngine(levels)
    timed: list[tuple[int, int]] = []

    class Recorder:
        def on_call(self, level, kind, batch, tokens, seconds):
            timed.append((level, batch))

    engine.feed.observers.append(Recorder())
    calls = []
    real = levels[0].worker.verify
    levels[0].worker.verify = lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw)
    generate(engine, [[5, 6], [7, 8, 9]], max_tokens=6, ignore_eos=True)
    assert calls[0] == 2 and len(calls) >= 6
    assert len(timed) == len(calls) - 1  # all but the call that started both rows


def test_a_level_catching_up_on_earlier_text_is_not_timed_for_the_planner():
    """A drafter that sat out rounds (or joins a sequence) first feeds everything it missed: that call is a prefill,
    not a step, so the planner feed gets no time for it (it would price every later draft at a prefill's cost);
    the calls after it are timed, and greedy output is unchanged."""
    levels = [Level("draft", worker=draft(0.3), k=3), Level("target", worker=target())]
    engine = CascadeEngine(levels)
    timed: list[tuple[int, str, int]] = []

    class Recorder:
        def on_call(self, level, kind, batch, tokens, seconds):
            timed.append((level, kind, tokens))

        def on_verify(self, level, lower, draft_lens, accepted):
            pass

    engine.feed.observers.append(Recorder())
    proposes = []
    real = levels[0].worker.propose
    levels[0].worker.propose = lambda *a, **kw: proposes.append(1) or real(*a, **kw)
    rounds = itertools.count()
    plain, spec = Plan((1,), ()), Plan((0, 1), (3,))
    out = generate(engine, [[5, 6, 7, 8]], max_tokens=48, ignore_eos=True,
                   plan=lambda batch: plain if next(rounds) < 30 else spec)  # the drafter joins after 30 rounds
    ref = generate(CascadeEngine([levels[1]]), [[5, 6, 7, 8]], max_tokens=48, ignore_eos=True)
    assert out.results[0].token_ids == ref.results[0].token_ids
    fed = [t for t in timed if t[0] == 0 and t[1] == "propose"]
    assert len(proposes) >= 3 and len(fed) == len(proposes) - 1  # all but the joining call
