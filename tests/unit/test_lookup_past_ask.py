"""One token past the ask: where an n-gram level's draft filled what its row asked for and the target accepted it
whole, the planner feed looks the lookup's next token up and checks it against the target's bonus token, so the
planner measures position K + 1 of a K it holds (`specray.coordinator.feed`, "One token past the ask"). Without it a
K held short never learns whether a longer one pays: the last position measured is where capped drafts after short
matches stop (failures all), and its estimate priced every longer K."""

from __future__ import annotations

from collections.abc import Sequence

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.feed import SHADOW_LOOKUPS, PlannerFeed, Verified
from specray.coordinator.state import Seq
from specray.engine.protocol import VerifyResult
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from tests.unit.test_cascade import PROMPTS, target
from tests.unit.test_confidence_pricing import Seen
from tests.unit.test_planner import _dummy

CAPPED = NgramConfig(8, 1, 4, max_spec_factor=2.0)
# [1, 2] matched at the start (2 tokens: a draft of at most 4): 3 4 5 6
COPY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
# [1] matched (1 token: a draft of at most 2): 2 3
SHORT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]


def _feed(ngram: NgramConfig = CAPPED) -> tuple[PlannerFeed, Seen]:
    feed = PlannerFeed([Level("ngram", ngram=ngram, k=8), Level("t", worker=_dummy("t"))])
    seen = Seen()
    feed.observers.append(seen)
    return feed, seen


def _row(tokens: Sequence[int], b: int = 0) -> Seq:
    return Seq(f"r{b}", 1, list(tokens), SamplingParams(0.0), 64)


def test_a_whole_draft_at_its_ask_is_reported_one_token_further():
    feed, seen = _feed()
    rows = [_row(COPY, 0), _row(COPY, 1), _row(SHORT, 2), _row(COPY, 3), _row(COPY, 4)]
    drafts = [[3, 4, 5], [3, 4, 5], [2, 3], [3, 4, 5], []]
    res = VerifyResult(token_ids=[[3, 4, 5, 6], [3, 4, 5, 9], [2, 3, 4], [3, 7], [5]], num_accepted=[3, 3, 2, 1, 0])
    feed.verified(Verified(1, 0, drafts, res, 0.1, asked=[3, 3, 2, 3, 3], rows=rows))
    (level, lower, lens, acc, asked), = seen.drafted
    assert (level, lower) == (1, 0)
    # the lookup's 4th token (6) is the bonus: accepted; a bonus of 9 rejects it; a 1-token match has no 3rd token
    # (its draft stops there: asked one more than it drafted); a draft rejected part way and a row without a match
    # are reported as verified
    assert lens == [4, 4, 2, 3, 0]
    assert acc == [4, 3, 2, 1, 0]
    assert asked == [4, 4, 3, 3, 3]


def test_at_most_a_few_rows_a_call_are_looked_up_again():
    feed, seen = _feed()
    n = SHADOW_LOOKUPS + 3
    rows = [_row(COPY, b) for b in range(n)]
    res = VerifyResult(token_ids=[[3, 4, 5, 6]] * n, num_accepted=[3] * n)
    feed.verified(Verified(1, 0, [[3, 4, 5]] * n, res, 0.1, asked=[3] * n, rows=rows))
    (_lvl, _low, lens, acc, asked), = seen.drafted
    assert lens == acc == asked == [4] * SHADOW_LOOKUPS + [3] * 3


def test_an_uncapped_lookup_is_reported_one_token_further_too():
    feed, seen = _feed(NgramConfig(8, 1, 4))
    res = VerifyResult(token_ids=[[3, 4, 5, 6]], num_accepted=[3])
    feed.verified(Verified(1, 0, [[3, 4, 5]], res, 0.1, asked=[3], rows=[_row(COPY)]))
    assert seen.drafted == [(1, 0, [4], [4], [4])] and not seen.verified


def test_without_the_rows_or_what_was_asked_the_feed_reports_what_was_verified():
    for asked, rows in ((None, [_row(COPY)]), ([3], None)):
        feed, seen = _feed()
        res = VerifyResult(token_ids=[[3, 4, 5, 6]], num_accepted=[3])
        feed.verified(Verified(1, 0, [[3, 4, 5]], res, 0.1, asked=asked, rows=rows))
        assert [d[2:] for d in seen.drafted] == ([([3], [3], [3])] if asked else [])


class Snapshot(Seen):
    """Seen, with the rows of each reported call and their text lengths then (the round has not committed yet)."""

    def __init__(self, seqs: list[Seq]) -> None:
        super().__init__()
        self.seqs = seqs
        self.at: list[list[tuple[Seq, int]]] = []

    def on_drafted(self, level, lower, draft_lens, accepted, asked) -> None:
        super().on_drafted(level, lower, draft_lens, accepted, asked)
        self.at.append([(s, len(s.tokens)) for s in self.seqs if not s.finished])  # the round's rows, in order


def test_what_a_round_reports_past_its_ask_is_what_the_target_wrote_there():
    """Rounds of a capped lookup held at K 3 over texts that repeat themselves: every row reported one token past
    its ask says of that token what the target's text says (accepted where the lookup's next token is the one the
    target wrote next; a failure where the lookup has no next token), and some rows are."""
    prompts = [[5, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4, 6], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], [1, 2, 1, 2, 1, 2, 1, 2],
               *PROMPTS]
    engine = CascadeEngine([Level("ngram", ngram=CAPPED, k=8), Level("t", worker=target(), method=VerifyMethod.GREEDY)])
    seqs = [engine.new_sequence(p, SamplingParams(0.0), max_tokens=60) for p in prompts]
    seen = Snapshot(seqs)
    engine.observers.append(seen)
    while not all(s.finished for s in seqs):
        engine.step([s for s in seqs if not s.finished], Plan((0, 1), (3,)))
    checked = 0
    for (_lvl, _low, lens, acc, asked), rows in zip(seen.drafted, seen.at):
        assert len(rows) == len(lens)
        for (s, length), n, a, w in zip(rows, lens, acc, asked):
            if w != 4:  # not reported past its ask
                continue
            more = CAPPED.propose(s.tokens[:length], 4)
            assert more[:3] == s.tokens[length:length + 3]  # its draft of 3, accepted whole
            if len(more) == 4:
                assert (n, a) == (4, 4 if more[3] == s.tokens[length + 3] else 3)
            else:
                assert (n, a) == (3, 3)
            checked += 1
    assert checked >= 3


def _priced(peeks: bool) -> Planner:
    """A planner that held a capped lookup at K 3 on text copying long spans: of two rows, one finds one-token matches
    (drafts of 2, accepted whole: the round ends there), the other copies (drafts of 3 accepted whole, and the copy
    goes on past them). Verifying costs a step plus a fifteenth of one per draft token."""
    p = Planner([Level("ngram", ngram=CAPPED, k=8), Level("t", worker=_dummy("t"))], k_max=8, rerank_every=1)
    for q in (1, 4, 9):
        for _ in range(3):
            p.on_call(1, "verify", 1, q, 0.15 + 0.01 * q)
    for _ in range(40):  # two rows: one whose matches are one token, one copying
        if peeks:
            p.on_drafted(1, 0, [2, 4], [2, 4], [3, 4])
        else:
            p.on_drafted(1, 0, [2, 3], [2, 3], [3, 3])
    return p


def test_a_k_held_short_learns_that_a_longer_one_pays():
    with_peeks, without = _priced(True), _priced(False)
    # position 4 is measured (the copies went on), not taken from position 3 (half of whose drafts stopped there)
    a_with, a_without = (p.acceptance[(1, 0)].alphas(8) for p in (with_peeks, without))
    assert a_with[3] > 0.9 > a_without[3]
    best = {}
    for name, p in (("with", with_peeks), ("without", without)):
        ranked = [(plan, gp) for plan, gp in p.explain(2) if plan.levels == (0, 1)]
        best[name] = max(ranked, key=lambda x: x[1])[0].k[-1]
    assert best["with"] > 3


def test_a_row_that_filled_its_ask_is_censored_there_whatever_the_others_asked():
    """A row whose draft filled its ask and was accepted whole says nothing of the next position, even when another
    row of the call was asked for more (a row near its length limit asks less; a row looked up past its ask asks
    one more): only a draft that stopped short of its ask, or found no match, counts a failure after it."""
    p = Planner([Level("ngram", ngram=CAPPED, k=8), Level("t", worker=_dummy("t"))], k_max=8)
    p.on_drafted(1, 0, [3, 5, 2, 0], [3, 5, 2, 0], [3, 8, 8, 8])
    acc = p.acceptance[(1, 0)]
    # position 4: row 2's draft reached it and was accepted there; row 1 filled its ask of 3 (censored)
    assert (acc.trials[3], acc.successes[3]) == (1.0, 1.0)
    # position 3: rows 1 and 2 accepted, row 3 stopped after 2 tokens (a failure); position 1: row 4 had no match
    assert (acc.trials[2], acc.successes[2]) == (3.0, 2.0)
    assert (acc.trials[0], acc.successes[0]) == (4.0, 3.0)
