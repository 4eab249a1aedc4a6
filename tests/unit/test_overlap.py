"""Overlap ("draft ahead"): the levels below the target draft the next round while the target verifies.

The look-ahead is only ever used as a draft for the exact prefix it was drafted from, so outputs must be
those of the loop without overlap: greedy == plain greedy, seeded sampled outputs identical, the sampled law
the target's; a drafter failing during a look-ahead is dropped like in any round.
"""

from __future__ import annotations

import threading

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.drafting import RoundState
from specray.coordinator.generate import generate
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import PROMPTS, Dying, assert_target_law, cascades, target


@pytest.mark.parametrize("setup", ["draft", "cascade3", "cascade3_models"])
def test_overlap_greedy_equals_plain_and_uses_its_lookahead(setup):
    plain = generate(cascades(VerifyMethod.GREEDY)["plain"], PROMPTS, max_tokens=40, ignore_eos=True)
    levels = cascades(VerifyMethod.GREEDY)[setup]
    eng = CascadeEngine(levels, overlap=True)
    out = generate(eng, PROMPTS, max_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_rows > 0 and eng.ahead_hits > 0  # drafted ahead, and some of it was the next draft
    assert eng.ahead_hits <= eng.ahead_rows
    for lvl in levels:
        if lvl.worker is not None:
            assert lvl.worker.stats().live_sequences == 0


def test_overlap_saves_draft_calls_when_the_draft_is_the_target():
    """A perfect drafter: every look-ahead holds, so the drafter is called once per round (ahead), never twice."""
    proposals: list[int] = []

    class Counting(FakeWorker):
        def propose(self, *a, **kw):
            proposals.append(1)
            return super().propose(*a, **kw)

    exact = Counting("d", vocab=16, order=2, table_seed=0)
    eng = CascadeEngine([Level("d", worker=exact, k=3), Level("target", worker=target())], overlap=True)
    eng.ahead_bounded = False  # K + 1 tokens ahead whatever the timing (the bounded look-ahead: tests below)
    out = generate(eng, PROMPTS, max_tokens=41, ignore_eos=True)
    rounds = out.rounds
    assert rounds == 4 * 11  # round 1 decodes one token (the drafter prefills beside it), then 4 per round
    # every round's draft is the previous round's look-ahead (round 1's included): one drafter call per round,
    # none in the last one (too few tokens left to look ahead)
    assert eng.ahead_hits == 4 * 10
    assert len(proposals) == 10


def test_overlap_first_round_prefills_the_drafter_beside_the_target():
    """A new sequence's first round: the target decodes one token without a draft while the drafter, on the
    look-ahead thread, takes the prompt (its prefill) and drafts beyond it; the second round drafts nothing."""
    added: dict[str, str] = {}
    proposes: list[str] = []
    drafts_seen: list[list[list[int]]] = []

    class Recording(FakeWorker):
        def add(self, seq_id, prompt_ids):
            if self.name == "d":
                added[seq_id] = threading.current_thread().name
            return super().add(seq_id, prompt_ids)

        def propose(self, *a, **kw):
            proposes.append(threading.current_thread().name)
            return super().propose(*a, **kw)

        def verify(self, seq_ids, draft_ids, *a, **kw):
            if self.name == "target":
                drafts_seen.append([list(d) for d in draft_ids])
            return super().verify(seq_ids, draft_ids, *a, **kw)

    exact = Recording("d", vocab=16, order=2, table_seed=0)
    tgt = Recording("target", vocab=16, order=2, table_seed=0)
    eng = CascadeEngine([Level("d", worker=exact, k=3), Level("target", worker=tgt)], overlap=True)
    eng.ahead_bounded = False  # K + 1 tokens ahead whatever the timing
    seqs = [eng.new_sequence(p, SamplingParams(), 20) for p in PROMPTS]
    first = eng.step(seqs)
    assert [len(t) for t in first] == [1] * len(seqs)  # plain step: prefill + one token
    assert drafts_seen == [[[]] * len(seqs)]  # the target's only call: no drafts
    assert set(added) == {s.seq_id for s in seqs}
    assert all(name.startswith("specray-ahead") for name in added.values())
    assert proposes and all(name.startswith("specray-ahead") for name in proposes)
    n_propose = len(proposes)
    second = eng.step(seqs)
    assert [len(t) for t in second] == [4] * len(seqs)  # the look-ahead was the draft: all 3 + bonus
    assert drafts_seen[-1] == [s.tokens[-4:-1] for s in seqs]
    assert eng.ahead_hits == len(seqs)
    # round 2's draft came from the look-ahead; the only new drafter call is round 2's own look-ahead
    assert len(proposes) == n_propose + 1 and proposes[-1].startswith("specray-ahead")
    for s in seqs:
        eng.release(s)

    # deterministic verification at T > 0: a plain first round would draw other tokens than a drafted one
    # for the same seed, so there the drafter prefills in round 1 as without overlap (outputs stay identical)
    eng = CascadeEngine([Level("d", worker=Recording("d", vocab=16, order=2, table_seed=0), k=3),
                         Level("target", worker=target())], overlap=True)
    sampled = [eng.new_sequence(p, SamplingParams(temperature=0.8, seed=1), 20) for p in PROMPTS]
    added.clear()
    eng.step(sampled)
    assert all(not name.startswith("specray-ahead") for name in added.values())


def test_overlap_runs_beside_verification():
    """The look-ahead really runs on another thread while the target's verify call is in flight."""
    seen: set[str] = set()

    class Slow(FakeWorker):
        def verify(self, *a, **kw):
            seen.add(threading.current_thread().name)
            return super().verify(*a, **kw)

        def propose(self, *a, **kw):
            seen.add(threading.current_thread().name)
            return super().propose(*a, **kw)

    d = Slow("d", vocab=16, order=2, table_seed=0, noise=0.3)
    eng = CascadeEngine([Level("d", worker=d, k=3), Level("target", worker=target())], overlap=True)
    generate(eng, PROMPTS[:1], max_tokens=12, ignore_eos=True)
    assert any(name.startswith("specray-ahead") for name in seen)


@pytest.mark.parametrize("method", [VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED])
def test_overlap_seeded_sampling_is_unchanged(method):
    """At T > 0 with token-only drafts the output for a seed is the one without overlap."""
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(4)]
    a = generate(cascades(method)["cascade3_models"], PROMPTS, max_tokens=30, sampling=sp, ignore_eos=True)
    eng = CascadeEngine(cascades(method)["cascade3_models"], overlap=True)
    b = generate(eng, PROMPTS, max_tokens=30, sampling=sp, ignore_eos=True)
    assert [r.token_ids for r in a.results] == [r.token_ids for r in b.results]
    assert eng.ahead_rows > 0


def test_overlap_is_off_for_rejection_and_ngram_only_plans():
    sp = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    eng = CascadeEngine(cascades(VerifyMethod.REJECTION)["draft"], overlap=True)
    generate(eng, PROMPTS, max_tokens=10, sampling=sp, ignore_eos=True)
    assert eng.ahead_rows == 0  # its drafts carry probabilities: no look-ahead
    ng = CascadeEngine([Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("target", worker=target())], overlap=True)
    generate(ng, PROMPTS, max_tokens=10, ignore_eos=True)
    assert ng.ahead_rows == 0 and ng.lookahead.pool is None  # an n-gram costs nothing to overlap


@pytest.mark.parametrize("setup", ["draft", "cascade3_models"])
def test_greedy_batches_overlap_under_a_configured_rejection_method(setup):
    """Temperature 0 verifies greedily under every method, so a batch of greedy rows drafts ahead even where the
    levels are configured for rejection (the CLI's and LevelConfig's default): greedy == plain; a batch with a
    sampled row does not (rejection drafts carry their probabilities)."""
    plain = generate(cascades(VerifyMethod.REJECTION)["plain"], PROMPTS, max_tokens=40, ignore_eos=True)
    eng = CascadeEngine(cascades(VerifyMethod.REJECTION)[setup], overlap=True)
    out = generate(eng, PROMPTS, max_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_rows > 0 and eng.ahead_hits > 0
    mixed = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(), SamplingParams()]
    eng = CascadeEngine(cascades(VerifyMethod.REJECTION)[setup], overlap=True)
    generate(eng, PROMPTS, max_tokens=10, sampling=mixed, ignore_eos=True)
    assert eng.ahead_rows == 0


def test_overlap_lookahead_is_dropped_when_the_plan_changes():
    """A look-ahead drafted for one plan is not the draft of another (different K or levels)."""
    levels = cascades(VerifyMethod.GREEDY)["cascade3"]
    eng = CascadeEngine(levels, overlap=True)
    plans = [Plan((0, 1, 2), (2, 4)), Plan((1, 2), (3,)), Plan((2,), ()), Plan((0, 2), (3,))]
    n = iter(range(10**6))
    out = generate(eng, PROMPTS, max_tokens=40, ignore_eos=True, plan=lambda b: plans[next(n) // 2 % len(plans)])
    plain = generate(cascades(VerifyMethod.GREEDY)["plain"], PROMPTS, max_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]


@pytest.mark.parametrize("which", ["bottom", "middle"])
def test_overlap_a_drafter_failing_during_lookahead_is_dropped_exactly(which):
    small = Dying("small", vocab=16, order=2, table_seed=0, noise=1.0, noise_seed=5)
    mid = Dying("mid", vocab=16, order=2, table_seed=0, noise=0.4, noise_seed=6)
    lv = [Level("small", worker=small, k=2), Level("mid", worker=mid, k=4), Level("target", worker=target())]
    eng = CascadeEngine(lv, overlap=True)
    eng.retry_after_s = 0.0
    victim = small if which == "bottom" else mid
    seqs = [eng.new_sequence(p, SamplingParams(), 40) for p in PROMPTS]
    r = 0
    while any(not s.finished for s in seqs):
        if r == 2:
            victim.dead = True
        if r == 5:
            victim.restart()
        eng.step(seqs)
        r += 1
    ref = generate([Level("target", worker=target())], PROMPTS, max_tokens=40, ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]
    assert eng.level_status()[victim.name] == "up"
    for s in seqs:
        eng.release(s)
    assert victim.stats().live_sequences == 0 and lv[2].worker.stats().live_sequences == 0


def test_overlap_sampled_law_is_the_targets():
    """Deterministic verification over a drafted-ahead cascade: the 4-token joint law == the target's."""
    vocab, n_draws, n_tok = 5, 6000, 4

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    m = VerifyMethod.DETERMINISTIC
    levels = [Level("d1", worker=mk("d1", 0.3, 3), k=1), Level("d2", worker=mk("d2", 0.2, 4), k=1, method=m),
              Level("t", worker=mk("t", 0, 0), method=m)]
    eng = CascadeEngine(levels, overlap=True)
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [1, 2, 1, 2, 1]
    sps = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, 20_000 + i) for i in range(n_draws)]
    batch = generate(eng, [prompt] * n_draws, max_tokens=n_tok, sampling=sps, ignore_eos=True)
    assert eng.ahead_hits > 0  # later rounds drafted from look-aheads
    assert_target_law(batch, levels[-1].worker, prompt, sp, n_tok)


# ----- bounded look-ahead: it stops once the target has verified ------------------------------------------
class Gated(FakeWorker):
    """A drafter whose calls on the look-ahead thread wait until the round's stop signal is set, so the target's
    verdict always arrives while the look-ahead is at its first step (a slow drafter, made deterministic)."""

    def __init__(self, *a, gate: threading.Event, **kw):
        super().__init__(*a, **kw)
        self.gate = gate
        self.ahead_lens: list[int] = []  # tokens asked per look-ahead call

    def _wait(self):
        if threading.current_thread().name.startswith("specray-ahead"):
            assert self.gate.wait(10), "the round never signalled the look-ahead to stop"

    def propose(self, seq_ids, k, *a, **kw):
        self._wait()
        if threading.current_thread().name.startswith("specray-ahead"):
            self.ahead_lens.extend(k)
        return super().propose(seq_ids, k, *a, **kw)

    def verify(self, *a, **kw):
        self._wait()
        return super().verify(*a, **kw)


def gated_engine(levels, gate: threading.Event) -> CascadeEngine:
    """An engine whose stop signal also opens the drafters' gate (and closes it for the next round)."""
    from specray.coordinator.drafting import Until

    class GatedUntil(Until):
        def set(self):
            super().set()
            gate.set()

    eng = CascadeEngine(levels, overlap=True)
    until = eng.lookahead.until

    def gated_until(r):
        gate.clear()
        u = until(r)
        return GatedUntil(u.rows) if u is not None else None

    eng.lookahead.until = gated_until
    return eng


def test_bounded_lookahead_stops_when_the_target_has_verified():
    """The first model level drafts ahead in calls of `ahead_chunk` steps and stops after the call in flight
    when the target's verdict arrives: the next draft is what it made by then (here 1 token + the bonus guess),
    not K + 1 tokens; greedy output is still plain greedy, and every round after the first drafts ahead."""
    gate = threading.Event()
    d = Gated("d", vocab=16, order=2, table_seed=0, gate=gate)  # exact drafter: every look-ahead holds
    eng = gated_engine([Level("d", worker=d, k=6), Level("target", worker=target())], gate)
    out = generate(eng, PROMPTS, max_tokens=30, ignore_eos=True)
    plain = generate(cascades(VerifyMethod.GREEDY)["plain"], PROMPTS, max_tokens=30, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
    assert d.ahead_lens and set(d.ahead_lens) == {eng.ahead_chunk}  # one chunk per look-ahead, never K + 1
    assert eng.ahead_hits > 0
    # round 1 decodes 1 token, every later round verifies the 1-token draft the look-ahead left: 2 tokens each
    assert out.rounds == len(PROMPTS) * (1 + 29 // 2 + 29 % 2)
    unbounded = CascadeEngine([Level("d", worker=FakeWorker("d", vocab=16, order=2, table_seed=0), k=6),
                               Level("target", worker=target())], overlap=True)
    unbounded.ahead_bounded = False
    assert generate(unbounded, PROMPTS, max_tokens=30, ignore_eos=True).rounds < out.rounds  # K + 1 ahead


def test_bounded_lookahead_of_a_middle_level_stops_between_inner_rounds():
    """d1 -> d2 -> target: the middle level's inner rounds stop at the first boundary after the verdict."""
    gate = threading.Event()
    d1 = FakeWorker("d1", vocab=16, order=2, table_seed=0)  # exact drafters: every inner round emits K0 + 1
    d2 = Gated("d2", vocab=16, order=2, table_seed=0, gate=gate)
    levels = [Level("d1", worker=d1, k=2), Level("d2", worker=d2, k=6, method=VerifyMethod.GREEDY),
              Level("target", worker=target(), method=VerifyMethod.GREEDY)]
    eng = gated_engine(levels, gate)
    drafts: list[int] = []
    orig = eng.calls.verify

    def spy(i, lower, seqs, tails, ds, *a, **kw):
        if i == eng.top:
            drafts.extend(len(x) for x in ds)
        return orig(i, lower, seqs, tails, ds, *a, **kw)

    eng.calls.verify = spy
    out = generate(eng, PROMPTS, max_tokens=30, ignore_eos=True)
    plain = generate(cascades(VerifyMethod.GREEDY)["plain"], PROMPTS, max_tokens=30, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_hits > 0
    # a look-ahead is one inner round: K0 + 1 = 3 tokens, so a draft taken from it has 2 (not K = 6)
    assert max(drafts) == 2 and eng.ahead_hits > 0  # (drafts near the end are cut by max_tokens)


def test_bounded_lookahead_marks_only_rows_whose_seeded_output_cannot_change():
    """Greedy rows and coupled verification stop early; deterministic verification at T > 0 drafts K + 1
    (a shorter draft would draw other tokens for the same seed), so seeded outputs stay those without overlap."""
    levels = cascades(VerifyMethod.DETERMINISTIC)["cascade3_models"]
    eng = CascadeEngine(levels, overlap=True)
    seqs = [eng.new_sequence(PROMPTS[0], SamplingParams(), 5),
            eng.new_sequence(PROMPTS[1], SamplingParams(temperature=0.8, seed=3), 5)]
    def until(method):
        return eng.lookahead.until(RoundState(seqs, eng.default_plan, method, eng.lookahead, [4, 4]))

    assert until(None).rows == [True, False]
    assert until(VerifyMethod.COUPLED).rows == [True, True]
    eng.ahead_bounded = False
    assert until(None) is None

    gate = threading.Event()
    sp = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(4)]
    mixed = [SamplingParams(), sp[1], SamplingParams(), sp[3]]
    ref = generate(cascades(VerifyMethod.DETERMINISTIC)["cascade3_models"], PROMPTS, max_tokens=24,
                   sampling=mixed, ignore_eos=True)
    lv = cascades(VerifyMethod.DETERMINISTIC)["cascade3_models"]
    lv[1].worker = Gated("d2", vocab=16, order=2, table_seed=0, noise=0.4, noise_seed=4, gate=gate)
    ref2 = generate(cascades(VerifyMethod.DETERMINISTIC)["cascade3_models"], PROMPTS, max_tokens=24,
                    sampling=mixed, ignore_eos=True)
    assert [r.token_ids for r in ref.results] == [r.token_ids for r in ref2.results]
    out = generate(gated_engine(lv, gate), PROMPTS, max_tokens=24, sampling=mixed, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in ref.results]
