"""Nested drafting (`specray.coordinator.inner`): a middle level running its inner rounds beside its model gives
the same tokens, statistics and worker state as the coordinator making every call, and a failure of the level
below it fails over the same way. In-process here (`LocalNesting`); over Ray actors in tests/ray/test_actors.py."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.coordinator.inner import LookupHolder, NestedDraft, NestedOutcome, run_nested
from specray.engine.protocol import SeqSync, Worker
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


class LocalNesting:
    """Runs the middle level's side in this process, as a level actor would."""

    def __init__(self) -> None:
        self.calls: list[NestedDraft] = []
        self.mid_verifies = 0  # the middle level's verifications made inside nested calls
        self.holders: dict[int, LookupHolder] = {}

    def reaches(self, mid: Worker, low: Worker) -> bool:
        return True

    def relays(self, mid: Worker, target: Worker) -> bool:
        return False

    def follows(self, mid: Worker, target: Worker) -> bool:
        return False

    def draft(self, mid: Worker, low: Worker | None, call: NestedDraft) -> NestedOutcome:
        self.calls.append(call)
        before = mid.verifies
        try:
            if low is None:  # an n-gram level below: the middle level's holder drafts (one per middle level)
                holder = self.holders.setdefault(id(mid), LookupHolder())
                return run_nested(call, mid, holder.proposer(call.lookup))
            return run_nested(call, mid, low.propose)
        finally:
            self.mid_verifies += mid.verifies - before


class Counting(FakeWorker):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.verifies = 0
        self.dead = False

    def verify(self, *a, **kw):
        self.verifies += 1
        return super().verify(*a, **kw)

    def propose(self, *a, **kw):
        if self.dead:
            raise ConnectionError("gone")
        return super().propose(*a, **kw)

    def stats(self):
        if self.dead:
            raise ConnectionError("gone")
        return super().stats()


def levels(method: VerifyMethod, conf: float = 0.0) -> list[Level]:
    def mk(name: str, noise: float, seed: int) -> Counting:
        return Counting(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)

    return [Level("d1", worker=mk("d1", 1.0, 3), k=2),
            Level("d2", worker=mk("d2", 0.4, 4), k=5, method=method, confidence=conf),
            Level("t", worker=mk("t", 0.0, 0), method=method)]


def run(method: VerifyMethod, sampling, nesting, overlap="off", max_tokens=23, conf=0.0):
    lv = levels(method, conf)
    eng = CascadeEngine(lv, overlap=overlap != "off", nesting=nesting)
    eng.ahead_bounded = overlap == "bounded"
    batch = generate(eng, PROMPTS, max_tokens=max_tokens, sampling=sampling, ignore_eos=True)
    for x in lv:
        assert x.worker.stats().live_sequences == 0  # everything freed, on every level
    return batch, lv


SAMPLED = [SamplingParams(temperature=0.9, top_k=10, seed=s) for s in range(len(PROMPTS))]


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.DETERMINISTIC, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
@pytest.mark.parametrize("overlap", ["off", "bounded", "unbounded"])
def test_nested_equals_the_coordinator_making_every_call(method, sampling, overlap):
    nest = LocalNesting()
    flat, _ = run(method, sampling, None, overlap)
    nested, lv = run(method, sampling, nest, overlap)
    assert [r.token_ids for r in nested.results] == [r.token_ids for r in flat.results]
    if overlap == "bounded":  # a bounded look-ahead is stopped between inner rounds from here: not nested
        return
    assert nest.calls
    if overlap != "off":  # how far the look-ahead got depends on timing: only the tokens are the same
        return
    assert {n: s.as_dict() for n, s in nested.stats.items()} == {n: s.as_dict() for n, s in flat.stats.items()}
    # every verification of the middle level ran inside a nested call: one per round at most from the coordinator
    assert nest.calls and lv[1].worker.verifies == nest.mid_verifies > len(nest.calls)
    assert len(nest.calls) <= max(r.rounds for r in nested.results)


def test_nested_with_confidence_and_short_rows_matches():
    """Rows that stop early (an unsure token) and rows near their length limit (a shorter want)."""
    flat, _ = run(VerifyMethod.GREEDY, None, None, max_tokens=7, conf=0.5)
    nested, _ = run(VerifyMethod.GREEDY, None, LocalNesting(), max_tokens=7, conf=0.5)
    assert [r.token_ids for r in nested.results] == [r.token_ids for r in flat.results]
    assert {n: s.as_dict() for n, s in nested.stats.items()} == {n: s.as_dict() for n, s in flat.stats.items()}


def run_with_a_failure(lv: list[Level], nesting, max_tokens: int, at_round) -> CascadeEngine:
    """Step a greedy batch of PROMPTS through `lv` to the end, calling `at_round(r, eng)` before round r (it kills
    and revives levels); every row must get the plain target's tokens and every level end up holding nothing."""
    eng = CascadeEngine(lv, nesting=nesting)
    eng.retry_after_s = 0.0
    seqs = [eng.new_sequence(p, SamplingParams(), max_tokens) for p in PROMPTS]
    r = 0
    while any(not s.finished for s in seqs):
        at_round(r, eng)
        eng.step(seqs)
        r += 1
    ref = generate([Level("t", worker=FakeWorker("t", vocab=16, order=2, table_seed=0))], PROMPTS,
                   max_tokens=max_tokens, ignore_eos=True)
    assert [s.output for s in seqs] == [x.token_ids for x in ref.results]
    for s in seqs:
        eng.release(s)
    assert all(x.worker.stats().live_sequences == 0 for x in lv)
    return eng


def test_a_failing_lower_level_inside_a_nested_call_is_dropped_and_taken_back():
    lv = levels(VerifyMethod.GREEDY)
    small = lv[0].worker

    def at_round(r: int, eng: CascadeEngine) -> None:
        if r == 2:
            small.dead = True
        if r == 5:
            assert eng.level_status()["d1"] == "down"
            small.dead = False  # back, and still holding its sequences: the epoch makes them start again

    eng = run_with_a_failure(lv, LocalNesting(), 40, at_round)
    assert eng.level_status()["d1"] == "up"


def ngram_levels(method: VerifyMethod) -> list[Level]:
    def mk(name: str, noise: float, seed: int) -> Counting:
        return Counting(name, vocab=16, order=2, table_seed=0, noise=noise, noise_seed=seed)

    return [Level("ngram", ngram=NgramConfig(3, 1, 3), k=3),
            Level("d2", worker=mk("d2", 0.4, 4), k=5, method=method),
            Level("t", worker=mk("t", 0.0, 0), method=method)]


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
@pytest.mark.parametrize("overlap", ["off", "unbounded"])
def test_an_ngram_level_below_runs_beside_the_middle_level(method, sampling, overlap):
    """n-gram -> d2 -> t: with nesting, d2 drafts with the n-gram itself (on its own copy of each row's text,
    kept in line by syncs): the same tokens and statistics as the coordinator running the lookups, and at most one
    coordinator call to d2 per round for its drafts."""
    out, mids = [], []
    for nesting in (None, LocalNesting()):
        lv = ngram_levels(method)
        eng = CascadeEngine(lv, overlap=overlap != "off", nesting=nesting)
        eng.ahead_bounded = False
        out.append(generate(eng, PROMPTS, max_tokens=30, sampling=sampling, ignore_eos=True))
        mids.append((nesting, lv[1].worker.verifies))
        assert all(x.worker.stats().live_sequences == 0 for x in lv[1:])
    flat, nested = out
    assert [r.token_ids for r in nested.results] == [r.token_ids for r in flat.results]
    nest, verifies = mids[1]
    assert nest.calls and all(c.lookup is not None for c in nest.calls)
    if overlap != "off":  # how far the look-ahead got depends on timing: only the tokens are the same
        return
    assert {n: s.as_dict() for n, s in nested.stats.items()} == {n: s.as_dict() for n, s in flat.stats.items()}
    assert verifies == nest.mid_verifies > len(nest.calls)  # every inner round ran beside d2
    assert len(nest.calls) <= max(r.rounds for r in nested.results)
    assert nested.stats["d2"].accepted_tokens > 0  # the n-gram's drafts were taken


def test_the_lookup_holder_drafts_from_the_synced_text():
    ng = NgramConfig(4, 1, 3)
    h = LookupHolder()
    text = [1, 2, 3, 4, 1, 2]
    d = h.propose(ng, ["a"], [4], [SeqSync(0, tuple(text))])
    assert d.token_ids == [ng.propose(text, 4)] == [[3, 4, 1, 2]]
    assert h.texts["a"].tokens() == text + [3, 4, 1, 2]  # held like a model drafter's own draft
    d = h.propose(ng, ["a"], [2], [SeqSync(7, (9,))])  # keep 7 (the draft's first token accepted), append 9
    assert h.texts["a"].tokens() == [*text, 3, 9, *ng.propose([*text, 3, 9], 2)]
    with pytest.raises(KeyError, match="unknown sequence"):
        h.propose(ng, ["b"], [2], [SeqSync(3, ())])
    h.free("a")
    assert "a" not in h.texts


def test_a_restart_of_the_middle_level_restarts_the_lookup_text():
    eng = CascadeEngine(ngram_levels(VerifyMethod.GREEDY))
    s = eng.new_sequence([1, 2, 3], SamplingParams(), 10)
    calls = eng.calls
    assert calls.lookup_sync(1, s, [4]) == SeqSync(0, (1, 2, 3, 4))
    assert calls.lookup_sync(1, s, [4, 5]) == SeqSync(4, (5,))
    eng.failover.epoch[1] += 1  # the middle level failed: it (and the text beside it) may have lost the row
    assert calls.lookup_sync(1, s, [4]) == SeqSync(0, (1, 2, 3, 4))
    assert calls.sync(0, s, []) == SeqSync(0, (1, 2, 3))  # the n-gram level's own key is another mirror


class LocalPending:
    """A relayed verification in this process: the target verifies when the drafts are sent to it."""

    def __init__(self, nesting: RelayNesting, target: Worker, args: tuple, kwargs: dict) -> None:
        self.nesting, self.target, self.args, self.kwargs = nesting, target, args, kwargs
        self.verdict = None

    def deliver(self, drafts) -> None:
        seq_ids, sampling, method = self.args
        fill = self.kwargs["fill"]
        ids = [[] for _ in seq_ids]
        for j, b in enumerate(fill):
            ids[b] = list(drafts.token_ids[j])
        probs = None
        if drafts.probs is not None and method is VerifyMethod.REJECTION:
            probs = drafts.probs.new_zeros(len(seq_ids), *drafts.probs.shape[1:])
            probs[fill] = drafts.probs
        self.verdict = self.target.verify(seq_ids, ids, probs, sampling, method, level=self.kwargs["level"],
                                          sync=self.kwargs["sync"])
        if self.kwargs.get("forward") is not None:  # the target sends its verdict on to the middle level
            self.nesting.verdict([self.verdict.token_ids[b] for b in fill])

    def send_drafts(self, drafts) -> None:
        self.nesting.sent_by_coordinator += 1
        self.deliver(drafts)

    def result(self):
        assert self.verdict is not None, "the drafts never reached the target"
        return self.verdict

    def abort(self, reason: str) -> None:
        self.nesting.aborts.append(reason)


class RelayNesting(LocalNesting):
    """`LocalNesting` whose middle level sends its drafts straight to the target (`post`: it can reach it)."""

    def __init__(self, post: bool = True) -> None:
        super().__init__()
        self.post = post
        self.relayed = 0
        self.sent_by_coordinator = 0
        self.proposes = 0  # relayed proposals of a first level right below the target
        self.aborts: list[str] = []

    def relays(self, mid: Worker, target: Worker) -> bool:
        return True

    def verify_later(self, target, seq_ids, sampling, method, *, level, sync, fill, forward=None):
        return LocalPending(self, target, (seq_ids, sampling, method),
                            {"level": level, "sync": sync, "fill": fill, "forward": forward})

    def propose(self, worker, relay, seq_ids, k, sampling, *, mode, level, sync, stop_below):
        prop = worker.propose(seq_ids, k, sampling, mode=mode, level=level, sync=sync, stop_below=stop_below)
        self.proposes += 1
        if self.post:
            relay.deliver(prop)
            self.relayed += 1
        return prop, self.post

    def draft(self, mid, low, call, relay=None):
        out = super().draft(mid, low, call)
        if relay is not None and out.low_error is None and self.post:
            relay.deliver(out.drafts)
            out.relayed = True
            self.relayed += 1
        return out


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
@pytest.mark.parametrize("post", [True, False])
def test_relayed_drafts_give_the_same_tokens_and_statistics(method, sampling, post):
    """The middle level sends its drafts to the target itself (or, when it cannot reach it, the coordinator
    sends them after its reply): the same tokens and per-level statistics as drafts back through the
    coordinator, with one relayed verification per drafted round."""
    plain, _ = run(method, sampling, LocalNesting())
    nest = RelayNesting(post=post)
    relayed, lv = run(method, sampling, nest)
    assert [r.token_ids for r in relayed.results] == [r.token_ids for r in plain.results]
    assert {n: s.as_dict() for n, s in relayed.stats.items()} == {n: s.as_dict() for n, s in plain.stats.items()}
    assert nest.calls and (nest.relayed if post else nest.sent_by_coordinator) == len(nest.calls)
    assert not nest.aborts
    # the target verified once per round, relayed or not: its verifications equal the rounds of the run
    assert lv[2].worker.verifies == max(r.rounds for r in relayed.results)


def test_a_failure_below_a_relay_aborts_the_verification_and_the_target_restarts_its_rows():
    """The level below fails inside the middle level's inner rounds: the drafts never go to the target, the
    coordinator aborts the relayed verification (its syncs unapplied), drops the failed level and the rows start
    again at the target on its next call; every row still gets the plain target's tokens."""
    lv = levels(VerifyMethod.GREEDY)
    nest = RelayNesting()
    small = lv[0].worker

    def at_round(r: int, eng: CascadeEngine) -> None:
        if r == 2:
            small.dead = True
        if r == 5:
            small.dead = False

    eng = run_with_a_failure(lv, nest, 40, at_round)
    assert nest.aborts and "drafting failed" in nest.aborts[0]
    assert eng.level_status()["d1"] == "up" and nest.relayed > 0


def test_a_look_ahead_is_not_relayed():
    """Only a round's own drafts for the target are relayed: with overlap the look-ahead drafts the next round
    while the target verifies this one, and its drafts are there before the round asks the target."""
    nest = RelayNesting()
    run(VerifyMethod.GREEDY, None, nest, overlap="unbounded")
    assert nest.relayed <= 1  # at most the first round, which has nothing drafted ahead


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
@pytest.mark.parametrize("post", [True, False])
def test_a_first_level_right_below_the_target_relays_its_drafts_too(method, sampling, post):
    """d2 -> t: the drafting level's `propose` also sends its drafts to the target (or the coordinator does,
    when it could not): the same tokens and statistics as without relays, one relayed verification per round
    that asks for a draft. A round that asks none (every row has one token left) is not relayed: the drafting
    level is not called."""
    out = []
    for nesting in (None, RelayNesting(post=post)):
        lv = levels(method)[1:]
        eng = CascadeEngine(lv, nesting=nesting)
        out.append(generate(eng, PROMPTS, max_tokens=23, sampling=sampling, ignore_eos=True))
        assert all(x.worker.stats().live_sequences == 0 for x in lv)
    plain, relayed = out
    assert [r.token_ids for r in relayed.results] == [r.token_ids for r in plain.results]
    assert {n: s.as_dict() for n, s in relayed.stats.items()} == {n: s.as_dict() for n, s in plain.stats.items()}
    rounds = max(r.rounds for r in relayed.results)
    assert (nesting.relayed if post else nesting.sent_by_coordinator) == nesting.proposes
    assert rounds - 1 <= nesting.proposes <= rounds
    assert lv[1].worker.verifies == rounds


def test_a_first_level_that_fails_aborts_its_relayed_verification():
    lv = levels(VerifyMethod.GREEDY)[1:]
    nest = RelayNesting()

    def at_round(r: int, eng: CascadeEngine) -> None:
        lv[0].worker.dead = r in (2, 3)

    run_with_a_failure(lv, nest, 30, at_round)
    assert nest.aborts and "drafting level failed" in nest.aborts[0]


class Feed:
    """Records what the planner is fed: timed calls (without their seconds) and catch-ups."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        self.events.append(("call", level, kind, batch, tokens))

    def on_verify(self, level: int, lower: int, draft_lens, accepted) -> None:
        self.events.append(("verify", level, lower, list(draft_lens), list(accepted)))

    def on_catch_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None:
        self.events.append(("catch_up", level, kind, batch, tokens, caught))


@pytest.mark.parametrize("engine_verify", [0, 4])
def test_a_nested_level_feeds_the_planner_what_the_coordinators_calls_would(engine_verify):
    """The inner rounds' calls reach the planner as the same timed calls and catch-ups as when the coordinator
    makes them: a row's first forward at each level (its prompt, here longer than a step's worth) is a catch-up,
    never a step's time, whichever side runs the loop. With a target that verifies in its engine step, a new
    row's first round asks no draft, so the drafters meet the prompt one round later."""
    prompts = [list(range(1, 13)) * 3, [5, 6, 7] * 9]
    fed = []
    for nesting in (None, LocalNesting()):
        lv = levels(VerifyMethod.GREEDY)
        lv[-1] = Level("t", worker=lv[-1].worker, engine_verify=engine_verify)
        eng = CascadeEngine(lv, nesting=nesting)
        feed = Feed()
        eng.observers.append(feed)
        generate(eng, prompts, max_tokens=17, ignore_eos=True)
        fed.append(feed.events)
    assert fed[0] == fed[1]
    caught = [e for e in fed[0] if e[0] == "catch_up"]
    assert {(e[1], e[2]) for e in caught} == {(0, "propose"), (1, "verify"), (2, "verify")}
    assert all(e[5] >= 27 for e in caught)  # each a whole prompt (at least the shorter one's 27 tokens)
