"""Catch-up: a model drafter that sat out rounds, or never saw a row, first prefills that row's text. The engine
reports what each level lacks (`CascadeEngine.backlog`) and what catching up cost (`on_catch_up`), and the planner
weighs that cost against the rows' remaining tokens before it starts the drafter."""

from __future__ import annotations

from collections.abc import Sequence

from specray.coordinator.cascade import CascadeEngine, Level, Plan, run_to_completion
from specray.coordinator.state import Backlog
from specray.policy.planner import Planner
from specray.spec.params import SamplingParams
from specray.testing.fake import FakeWorker

PROMPT = list(range(1, 8)) * 6  # 42 tokens: more than a step's worth of catch-up


def _levels() -> list[Level]:
    return [Level("draft", worker=FakeWorker("draft", vocab=16, noise=0.5), k=4),
            Level("target", worker=FakeWorker("target", vocab=16))]


class CatchUps:
    """An observer that records the catch-up reports (and takes every other hook)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, int]] = []

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        pass

    def on_verify(self, level: int, lower: int, draft_lens: Sequence[int], accepted: Sequence[int]) -> None:
        pass

    def on_catch_up(self, level: int, kind: str, batch: int, tokens: int, caught: int, seconds: float) -> None:
        self.seen.append((level, kind, caught))


def test_the_backlog_counts_what_a_level_lacks_and_the_rows_remaining_tokens():
    engine = CascadeEngine(_levels())
    rec = CatchUps()
    engine.observers.append(rec)
    seqs = [engine.new_sequence(PROMPT, SamplingParams(0.0), max_tokens=60) for _ in range(2)]
    assert engine.backlog(seqs) == Backlog({0: 2 * len(PROMPT)}, 120)  # new rows: the whole prompt, each

    engine.step(seqs, Plan((0, 1), (4,)))  # the drafter catches up on both prompts in its first call
    assert engine.backlog(seqs).uncovered == {}
    assert (0, "propose", 2 * len(PROMPT)) in rec.seen  # and the call is reported as a catch-up
    assert (1, "verify", 2 * len(PROMPT)) in rec.seen  # so is the target's first verification
    made = len(seqs[0].output)

    plain = Plan((1,), ())
    while True:  # the drafter sits out plain rounds
        engine.step(seqs, plain)
        if engine.calls.uncovered(0, seqs[:1]):
            break
        assert engine.backlog(seqs).uncovered == {}  # a step's worth: the next round's ordinary work
    behind = [len(s.tokens) - engine.calls._kept(0, s) for s in seqs]
    assert engine.backlog(seqs) == Backlog({0: sum(behind)}, sum(s.remaining for s in seqs))
    assert len(seqs[0].output) > made

    rec.seen.clear()
    engine.step(seqs, Plan((0, 1), (4,)))
    assert rec.seen == [(0, "propose", sum(behind))]
    assert engine.backlog(seqs).uncovered == {}


def _planner(patience: int = 1, accepted: int = 1) -> Planner:
    """Plain steps of 0.1 s; the drafter's rounds predicted ~1.3x plain's goodput (`accepted` 1 of its 4 tokens per
    round; 0: plain's goodput ~1.4x the drafter's); its catch-up 2 ms per token."""
    p = Planner(_levels(), k_choices=[4], explore_every=0, patience=patience, warmup=0, hysteresis=0.05,
                prior_cost_ratio=0.1)
    p._current = p.plain
    for _ in range(20):
        p.on_call(1, "verify", 1, 1, 0.1)
        p.on_call(1, "verify", 1, 5, 0.1)
        p.on_call(0, "propose", 1, 4, 0.04)
        p.on_verify(1, 0, [4], [accepted])
    p.on_catch_up(0, "propose", 1, 4, 1000, 2.04)  # 1000 tokens caught up beside 4 steps (0.04 s): 2 s
    return p


def test_a_drafter_is_not_started_where_catching_up_costs_more_than_it_saves():
    p = _planner()
    draft = Plan((0, 1), (4,))
    gp = p.goodput(draft, 1)
    assert 1.2 < gp / p.goodput(p.plain, 1) < 1.5
    assert abs(p.pricing.catch_up_rate(0) - 0.002) < 1e-9

    # 1500 tokens to catch up (3 s) for 60 tokens left: plain finishes them in 6 s, the drafter in 3 + 60 / gp
    assert 60 / gp + 3.0 > 6.5
    assert p.plan(1, Backlog({0: 1500}, 60)) == p.plain
    assert p.plan(1, Backlog({0: 1500}, 60)) == p.plain
    # the same text with 600 tokens left is worth catching up on; so are 60 tokens left with little to catch up on
    assert p.plan(1, Backlog({0: 1500}, 600)) == draft
    p._current = p.plain
    assert p.plan(1, Backlog({0: 50}, 60)) == draft
    # without a backlog (a caller that does not say), the ranking alone, as before
    p._current = p.plain
    assert p.plan(1) == draft


def test_a_running_drafter_pays_nothing_to_go_on():
    p = _planner()
    draft = Plan((0, 1), (4,))
    p._current = draft
    assert p.plan(1, Backlog({}, 60)) == draft


def test_a_held_drafter_that_must_catch_up_is_left_at_once():
    """Patience keeps a drafter that is in step through noise: its head start would be paid again on the way back.
    A held drafter that lacks this round's text (rows that joined, rows it sat out) has no head start to keep:
    holding it pays a catch-up too, so a better plan is taken on the first round."""
    draft = Plan((0, 1), (4,))
    p = _planner(patience=3)
    p._current = draft
    assert p.plan(1, Backlog({0: 1500}, 60)) == p.plain  # not decisive (< 2x): only the backlog makes it free

    q = _planner(patience=3, accepted=0)  # plain ~1.4x the drafter, which is in step: patience as before
    q._current = draft
    assert q.goodput(q.plain, 1) < 2 * q.goodput(draft, 1)
    assert [q.plan(1, Backlog({}, 60)) for _ in range(3)] == [draft, draft, q.plain]


def test_catch_up_rate_is_measured_beyond_the_calls_own_work_else_taken_from_the_target():
    p = Planner(_levels(), k_choices=[4], explore_every=0, warmup=0)
    assert p.pricing.catch_up_rate(0) == p.costs[0].coefficients[1]  # nothing measured: the fit's cost per token
    for _ in range(10):
        p.on_call(1, "verify", 1, 1, 0.1)
        p.on_call(0, "propose", 1, 1, 0.02)
    p.on_catch_up(1, "verify", 1, 1, 500, 0.1 + 0.5)  # the target: 1 ms per token beyond its step
    assert abs(p.pricing.catch_up_rate(1) - 0.001) < 1e-6
    ratio = p.step_time(0, 1, 1) / p.step_time(1, 1, 1)
    assert abs(p.pricing.catch_up_rate(0) - 0.001 * ratio) < 1e-6  # the drafter: scaled by their steps
    p.on_catch_up(0, "propose", 1, 2, 100, 2 * 0.02 + 0.03)
    assert abs(p.pricing.catch_up_rate(0) - 0.0003) < 1e-6  # then its own


def test_a_few_tokens_caught_up_on_an_untimed_call_do_not_price_catching_up():
    """A drafter's first call on a short prompt (no step of it timed yet) takes as long as a step: counted whole as
    catching up on its 4 tokens, it priced catching up at a quarter of a step per token, and a 400-token prompt then
    looked like 100 steps to prefill. Such a call is left out; a prompt-sized one (the call's own step a small share
    of it) still counts whole, as before anything was timed."""
    p = Planner(_levels(), k_choices=[4], explore_every=0, warmup=0)
    p.on_catch_up(0, "propose", 1, 1, 4, 0.05)  # untimed, 4 tokens: left out
    assert 0 not in p.measurements.catch_up
    for _ in range(10):
        p.on_call(1, "verify", 1, 1, 0.1)
    p.on_catch_up(1, "verify", 1, 1, 400, 0.1 + 0.4)  # the target, timed: 1 ms per token beyond its step
    ratio = p.step_time(0, 1, 1) / p.step_time(1, 1, 1)
    assert abs(p.pricing.catch_up_rate(0) - 0.001 * ratio) < 1e-6  # the drafter's from the target's
    p.on_catch_up(0, "propose", 1, 1, 400, 0.2)  # untimed but prompt-sized: counted whole
    assert abs(p.pricing.catch_up_rate(0) - 0.2 / 400) < 1e-9


def test_the_engine_loop_hands_the_planner_its_backlog():
    levels = _levels()
    engine = CascadeEngine(levels)
    p = Planner(levels, k_choices=[4], warmup=0).attach(engine)
    asked: list[Backlog | None] = []
    ask = p.plan

    def plan(batch: int, backlog: Backlog | None = None) -> Plan:
        asked.append(backlog)
        return ask(batch, backlog)

    p.plan = plan  # type: ignore[method-assign]
    seqs = [engine.new_sequence(PROMPT, SamplingParams(0.0), max_tokens=8)]
    run_to_completion(engine, seqs, p)
    assert asked and all(b is not None for b in asked)
    assert asked[0] == Backlog({0: len(PROMPT)}, 8)


class Calls(CatchUps):
    """`CatchUps` that also records the timed calls (level, kind, batch, tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: list[tuple[int, str, int, int]] = []

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        self.timed.append((level, kind, batch, tokens))


def test_a_row_asked_for_no_draft_is_not_sent_and_its_first_draft_is_a_catch_up():
    """A worker runs no forward for a row asked for no tokens: sent, it would only hold the row's text until its
    next call, which would then prefill the prompt inside what the planner takes for one drafting step. So such a
    row is not sent, and the call that first drafts for it reports the prompt as a catch-up. A target that
    verifies in its engine step asks no draft in a new row's first round (its prefill)."""
    levels = _levels()
    levels[1] = Level("target", worker=levels[1].worker, engine_verify=4)
    engine = CascadeEngine(levels)
    rec = Calls()
    engine.observers.append(rec)
    seqs = [engine.new_sequence(PROMPT, SamplingParams(0.0), max_tokens=20) for _ in range(2)]
    engine.step(seqs, Plan((0, 1), (4,)))
    assert levels[0].worker.stats().live_sequences == 0  # the drafter has not met the rows
    assert not any(s.mirror.get(0) for s in seqs)
    assert engine.backlog(seqs).uncovered == {0: sum(len(s.tokens) for s in seqs)}
    assert rec.seen == [(1, "verify", 2 * len(PROMPT))] and all(t[0] == 1 for t in rec.timed)

    rec.seen.clear()
    engine.step(seqs, Plan((0, 1), (4,)))
    assert rec.seen == [(0, "propose", 2 * (len(PROMPT) + 1))]  # each row's prompt and first token
    assert not [t for t in rec.timed if t[0] == 0]  # no drafting step timed on that call
    engine.step(seqs, Plan((0, 1), (4,)))
    assert (0, "propose", 2, 4) in rec.timed  # the next one is a step's time


def test_a_row_with_nothing_to_draft_stays_out_of_a_batched_proposal():
    """In a batch, only the rows asked for tokens go to the drafter: one with a single token left is verified
    without a draft, and the call is timed at the batch it drafted for."""
    engine = CascadeEngine(_levels())
    rec = Calls()
    engine.observers.append(rec)
    seqs = [engine.new_sequence(PROMPT, SamplingParams(0.0), max_tokens=n) for n in (1, 30)]
    engine.step(seqs, Plan((0, 1), (4,)))  # the long row's drafter meets its prompt (a catch-up)
    assert rec.seen[0] == (0, "propose", len(PROMPT))
    assert not seqs[0].mirror.get(0)  # the one-token row never reached the drafter
    rec.timed.clear()
    engine.step(seqs[1:], Plan((0, 1), (4,)))
    assert (0, "propose", 1, 4) in rec.timed
