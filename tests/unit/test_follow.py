"""Follow-ons (`NestedDraft.follow`, `specray.coordinator.inner.follow_on`): a relaying middle level drafts the next
round on the target's verdict, before the coordinator asks. The coordinator's next request takes that outcome when
it asks exactly what the verdict implied; any other request drops it. Either way the tokens, the statistics and
every level's final state equal the rounds without follow-ons. In-process here (`FollowNesting` plays the middle
level's side as `specray.serve.follow.FollowOns` does); over Ray actors in tests/ray/test_actors.py."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from specray.coordinator.cascade import CascadeEngine, Plan
from specray.coordinator.generate import generate
from specray.coordinator.inner import FollowOn, NestedDraft, NestedOutcome, follow_on
from specray.engine.protocol import DraftProposal, SeqSync
from specray.serve.follow import FollowOns
from specray.serve.wire import Frees, NestedCall, Verdict
from specray.spec.params import SamplingParams, VerifyMethod
from tests.unit.test_nested import PROMPTS, SAMPLED, LocalNesting, RelayNesting, levels, run

EP = (("127.0.0.1", 1), "tok")


class FollowNesting(RelayNesting):
    """`RelayNesting` whose middle level drafts the next round when the target's verdict reaches it (the target
    forwards it from `LocalPending.deliver`), through the middle level actor's own `FollowOns`, in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.follow = FollowOns(self._run, relay=lambda call, out: out)
        self.forwards = 0
        self._keys = iter(range(1_000_000))
        self._key: str | None = None
        self._levels: tuple = ()

    def _run(self, call: NestedCall, cancel) -> NestedOutcome:
        mid, low = self._levels
        return LocalNesting.draft(self, mid, low, call.draft)

    def follows(self, mid, target) -> bool:
        return True

    def verify_later(self, target, seq_ids, sampling, method, *, level, sync, fill, forward=None):
        self.forwards += forward is not None
        return super().verify_later(target, seq_ids, sampling, method, level=level, sync=sync, fill=fill,
                                    forward=forward)

    def verdict(self, emitted: list[list[int]]) -> None:
        if self._key is not None:
            self.follow.verdict(Verdict(self._key, emitted))

    def draft(self, mid, low, call, relay=None):
        self._levels = (mid, low)
        n = len(call.seq_ids)
        self._key = f"k{next(self._keys)}" if relay is not None else None
        req = NestedCall(call, [None] * n, [None] * n, EP, (), relay=None if relay is None else (EP, self._key))
        ahead = self.follow.claim(req, call)
        out = ahead[0] if ahead is not None else LocalNesting.draft(self, mid, low, call)
        self.follow.ran(req, call, out)
        if relay is not None and out.low_error is None:
            relay.deliver(out.drafts)
            out.relayed = True
            self.relayed += 1
        return out


def test_follow_on_syncs_each_level_to_the_prefix_that_agrees():
    """The worked example of `follow_on`'s docstring, and a row whose next draft would be empty is left out."""
    call = NestedDraft(1, 0, ["a", "b"], [SamplingParams()] * 2, [SeqSync(2, ()), SeqSync(5, ())],
                       [SeqSync(0, (5, 6)), SeqSync(5, ())], [3, 3], 2, VerifyMethod.GREEDY, "greedy", False, 0.0, 0.0,
                       16, follow=FollowOn(3, (10, 3)))
    out = NestedOutcome(DraftProposal([[7, 8, 9], [1, 2]]), mid_held=[[7, 8, 9], [1, 2]], low_held=[[7, 4], [1]])
    nxt = follow_on(call, out, [[7, 3], [1, 2, 0]])
    assert nxt is not None
    assert nxt.seq_ids == ["a"]  # "b" had 3 tokens left and got 3: no draft next round
    assert nxt.mid_syncs == [SeqSync(3, (3,))] and nxt.low_syncs == [SeqSync(3, (3,))]
    assert nxt.want == [3] and nxt.mid_owed == [1] and nxt.low_owed == [1]
    assert nxt.follow == FollowOn(3, (8,))
    assert follow_on(replace(call, follow=None), out, [[7, 3], [1, 2, 0]]) is None


@pytest.mark.parametrize("method,sampling", [
    (VerifyMethod.GREEDY, None),
    (VerifyMethod.REJECTION, SAMPLED),
    (VerifyMethod.COUPLED, SAMPLED),
])
def test_follow_ons_give_the_same_tokens_and_statistics(method, sampling):
    """Every relayed round asks for a follow-on; all but the rounds after a row ends take it, and the run gives
    the tokens and per-level statistics of relayed rounds without follow-ons."""
    plain, _ = run(method, sampling, RelayNesting())
    nest = FollowNesting()
    followed, lv = run(method, sampling, nest)
    assert [r.token_ids for r in followed.results] == [r.token_ids for r in plain.results]
    assert {n: s.as_dict() for n, s in followed.stats.items()} == {n: s.as_dict() for n, s in plain.stats.items()}
    assert nest.forwards == nest.relayed  # a batch of 4 rows: every relayed round asked for one
    st = nest.follow.stats()
    assert st["used"] >= nest.relayed // 2 and st["drafted"] == st["used"] + st["dropped"]


def test_a_dropped_follow_on_leaves_every_level_as_the_coordinator_mirrors_it():
    """A plan that changes K every round rarely asks what the follow-on drafted: it is dropped after it ran (it
    moved both levels on), and the coordinator's own syncs still bring them to the right text: greedy output
    equals plain decoding's, and every level ends up holding nothing."""
    lv = levels(VerifyMethod.GREEDY)
    nest = FollowNesting()
    eng = CascadeEngine(lv, nesting=nest)
    plans = [Plan((0, 1, 2), (2, 5)), Plan((0, 1, 2), (2, 3))]
    calls = iter(range(10_000))
    out = generate(eng, PROMPTS, max_tokens=23, ignore_eos=True, plan=lambda n: plans[next(calls) % 2])
    ref = generate(CascadeEngine([levels(VerifyMethod.GREEDY)[-1]]), PROMPTS, max_tokens=23, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in ref.results]
    # taken only where both K ask a row's last tokens (min(K, left - 1))
    assert nest.follow.dropped > 5 > nest.follow.used
    for x in lv:
        assert x.worker.stats().live_sequences == 0


def test_no_follow_on_beside_a_look_ahead_or_when_turned_off():
    """A look-ahead drafts the next round itself: its relayed rounds ask for no follow-on; nor does a drafter
    with follow-ons turned off (`Drafter.follow`)."""
    nest = FollowNesting()
    run(VerifyMethod.GREEDY, None, nest, overlap="unbounded")
    assert nest.forwards == 0
    lv = levels(VerifyMethod.GREEDY)
    nest = FollowNesting()
    eng = CascadeEngine(lv, nesting=nest)
    eng.drafter.follow = False
    generate(eng, PROMPTS, max_tokens=9, ignore_eos=True)
    assert nest.relayed > 0 and nest.forwards == 0


#: K 4, 10 tokens left, stop token 0
FOLLOW = FollowOn(4, (10,), ((0,),))


def _round(key: str, follow: FollowOn = FOLLOW) -> tuple[NestedCall, NestedDraft, NestedOutcome]:
    """A relayed one-row nested request (context [5, 6]) and its outcome (the middle level held [7, 8, 9])."""
    draft = NestedDraft(1, 0, ["a"], [SamplingParams()], [SeqSync(0, (5, 6))], [SeqSync(0, (5, 6))], [3], 2,
                        VerifyMethod.GREEDY, "greedy", False, 0.0, 0.0, 16, follow=follow)
    out = NestedOutcome(DraftProposal([[7, 8, 9]]), mid_held=[[7, 8, 9]], low_held=[[7, 8]])
    return NestedCall(draft, [None], [None], EP, (), relay=(EP, key)), draft, out


def _next(call: NestedCall, draft: NestedDraft, out: NestedOutcome, emitted, key: str):
    nxt = follow_on(draft, out, emitted)
    return replace(call, draft=nxt, relay=(EP, key)), nxt


def test_a_follow_on_goes_to_the_request_it_was_drafted_for_and_only_to_it():
    """`FollowOns` (the middle level actor's side): the verdict on the remembered round drafts the request that
    `follow_on` predicts; that request takes the outcome, marked `followed`. A verdict on another round, one
    after another request came, and a row the verdict ended (a stop token) draft nothing."""
    ran: list[NestedCall] = []

    def run(call, cancel):
        ran.append(call)
        return NestedOutcome(DraftProposal([[1, 2]]), [[1, 2]], [[1]])

    f = FollowOns(run, relay=lambda call, out: out)
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    f.verdict(Verdict("k0", [[7, 3]]))  # not the round remembered
    assert not ran
    f.verdict(Verdict("k1", [[7, 3]]))
    assert len(ran) == 1 and ran[0].draft.mid_syncs == [SeqSync(3, (3,))] and ran[0].relay is None
    real, resolved = _next(call, draft, out, [[7, 3]], "k2")
    got, relayed = f.claim(real, resolved)
    assert got.followed and got.drafts.token_ids == [[1, 2]] and not relayed
    assert f.stats() == {"drafted": 1, "used": 1, "dropped": 0, "joins": 0, "deferred": 0, "trims": 0,
                         "owed_frees": 0}
    f.ran(call, draft, out)
    f.claim(None, None)  # another request (a free) came first
    f.verdict(Verdict("k1", [[7, 3]]))
    f.ran(call, draft, out)
    f.verdict(Verdict("k1", [[7, 0]]))  # 0 is the row's stop token: it ended, nothing to draft
    assert len(ran) == 1 and f.claim(real, resolved) is None


def test_a_request_that_comes_first_has_its_drafts_relayed_by_the_drafting_thread():
    """The coordinator's request can reach the middle level before the follow-on's inner rounds end: the thread
    drafting it sends the drafts on to the target the moment they are made, remembering the request for its own
    verdict, and the request's reply says they went."""
    go, relays = threading.Event(), []

    def run(call, cancel):
        assert go.wait(10)
        return NestedOutcome(DraftProposal([[1, 2]]), [[1, 2]], [[1]])

    f = FollowOns(run, relay=lambda call, out: relays.append((call.relay[1], threading.current_thread().name)))
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    t = threading.Thread(target=f.verdict, args=(Verdict("k1", [[7, 3]]),), name="drafting")
    t.start()
    real, resolved = _next(call, draft, out, [[7, 3]], "k2")
    threading.Timer(0.2, go.set).start()  # the request is waiting by then
    got, relayed = f.claim(real, resolved)
    t.join(10)
    assert relayed and got.followed and relays == [("k2", "drafting")]
    ran = []
    f._run = lambda c, cancel: ran.append(c) or NestedOutcome(DraftProposal([[4]]), [[4]], [[4]])
    f.verdict(Verdict("k2", [[1, 2, 5]]))  # remembered by the drafting thread: the next follow-on drafts
    assert len(ran) == 1


def test_a_follow_on_nobody_asks_for_stops_after_the_inner_round_under_way():
    """Another request than the one predicted (the plan changed, a row joined) cancels the follow-on: its inner
    rounds stop at the next boundary, so the request waits for at most the one under way, then runs as sent."""
    started, rounds = threading.Event(), []

    def run(call, cancel):
        started.set()
        while not cancel() and len(rounds) < 1000:  # an inner round each 10 ms until cancelled
            rounds.append(1)
            time.sleep(0.01)
        return NestedOutcome(DraftProposal([[1]]), [[1]], [[1]])

    f = FollowOns(run, relay=lambda call, out: out)
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    t = threading.Thread(target=f.verdict, args=(Verdict("k1", [[7, 3]]),))
    t.start()
    assert started.wait(10)
    other, resolved = _next(call, replace(draft, follow=FollowOn(2, (10,), ((0,),))), out, [[7, 3]], "k2")
    assert f.claim(other, resolved) is None  # K 2 asked, not the K 4 drafted for
    t.join(10)
    assert len(rounds) < 100 and f.stats()["dropped"] == 1


def test_follow_ons_default_on_gpu_levels_only():
    """`cascade.follow` unset: on where every model level runs on a GPU, off as soon as one runs on a CPU (the
    n-gram level does not count); set, it is what it says."""
    from specray.config import CascadeConfig, LevelConfig

    def cfg(*devices: str, **kw) -> CascadeConfig:
        levels = [LevelConfig(kind="ngram")] + [
            LevelConfig(kind="hf", model="m", name=f"m{i}", **({"num_gpus": 1} if d == "gpu" else {"device": d}))
            for i, d in enumerate(devices)]
        return CascadeConfig(levels=levels, **kw)

    assert cfg("gpu", "gpu").follows and cfg("cuda", "gpu").follows
    assert not cfg("cpu", "gpu").follows and not cfg("cpu", "cpu").follows
    assert cfg("cpu", "cpu", follow=True).follows and not cfg("gpu", "gpu", follow=False).follows


def _two_rows(want=(3, 2)) -> NestedDraft:
    sp = SamplingParams()
    return NestedDraft(1, 0, ["a", "b"], [sp, sp], [SeqSync(3, (3,)), SeqSync(4, (1,))],
                       [SeqSync(3, (3,)), SeqSync(4, ())], list(want), 2, VerifyMethod.GREEDY, "greedy", False, 0.0,
                       0.0, 16, mid_owed=[1, 1], low_owed=[1, 0], follow=FollowOn(3, (9, 7), ((0,), (0,))))


def test_a_request_with_rows_that_joined_takes_the_follow_on_for_the_others():
    """`_match`: the rows a request adds to the one drafted for (new sequences) are the only ones left to draft,
    and drafted rows it lacks (ended by the coordinator) are left out; any other difference (a drafted row asked
    something else; another K below) makes the follow-on of no use. `merged` puts the parts' drafts, held tokens,
    q and logs back in the request's row order, without the rows left out."""
    from specray.coordinator.inner import InnerLog
    from specray.engine.protocol import VerifyResult
    from specray.serve.follow import _match, _Pending, merged

    ahead = _two_rows()
    pending = _Pending(ahead, NestedCall(ahead, [None] * 2, [None] * 2, EP, ()))
    c = replace(pending.call)
    new = SamplingParams(temperature=0.5, seed=1)
    real = replace(ahead, seq_ids=["c", "b", "a"], sampling=[new, *ahead.sampling[::-1]],
                   mid_syncs=[SeqSync.start((9, 9)), *ahead.mid_syncs[::-1]],
                   low_syncs=[SeqSync.start((9, 9)), *ahead.low_syncs[::-1]], want=[2, 2, 3], mid_owed=[0, 1, 1],
                   low_owed=[0, 0, 1])
    assert _match(c, ahead, pending).exact(2) and not _match(c, real, pending).exact(3)
    assert _match(c, real, pending) == ([2, 1], [0])
    assert _match(c, replace(real, want=[2, 1, 3]), pending) is None  # b asks 1 token, it was drafted 2
    assert _match(c, replace(real, k_low=3), pending) is None
    gone = _match(c, replace(real, seq_ids=["c", "d", "a"]), pending)  # b went, d came
    assert gone == ([2, None], [0, 1]) and gone.trimmed
    assert _match(c, replace(ahead, seq_ids=["x", "y"]), pending) is None  # none of its rows: of no use
    assert _match(replace(c, low_at=None), real, pending) is None
    q1, q2 = torch.rand(2, 3, 16), torch.rand(1, 2, 16)
    log1 = InnerLog([0, 1], [[4], [5]], VerifyResult([[4, 6], [5]], [1, 0]), 0.01)
    log2 = InnerLog([0], [[7]], VerifyResult([[7]], [1]), 0.02)
    out = merged(3, [([2, 1], NestedOutcome(DraftProposal([[4, 6, 8], [5, 1]], q1), [[4, 6, 8], [5, 1]],
                                            [[4], [5]], [log1])),
                     ([0], NestedOutcome(DraftProposal([[7, 2]], q2), [[7, 2]], [[7]], [log2]))])
    assert out.drafts.token_ids == [[7, 2], [5, 1], [4, 6, 8]] and out.mid_held == [[7, 2], [5, 1], [4, 6, 8]]
    assert out.low_held == [[7], [5], [4]] and out.followed and out.low_error is None
    assert [log.idx for log in out.logs] == [[2, 1], [0]]
    assert torch.equal(out.drafts.probs[2], q1[0]) and torch.equal(out.drafts.probs[1], q1[1])
    assert torch.equal(out.drafts.probs[0, :2], q2[0]) and not out.drafts.probs[0, 2].any()
    # the first part's second row left out (the request lacks it): its drafts, q and log rows go
    log1 = InnerLog([0, 1], [[4], [5]], VerifyResult([[4, 6], [5]], [1, 0], probs=torch.rand(2, 2, 16),
                                                     confidence=[[0.9, 0.8], [0.4]]), 0.01, asked=2)
    log3 = InnerLog([1], [[5]], VerifyResult([[5]], [0]), 0.01)
    out = merged(2, [([1, None], NestedOutcome(DraftProposal([[4, 6, 8], [5, 1]], q1), [[4, 6, 8], [5, 1]],
                                               [[4], [5]], [log1, log3])),
                     ([0], NestedOutcome(DraftProposal([[7, 2]], q2), [[7, 2]], [[7]], [log2]))])
    assert out.drafts.token_ids == [[7, 2], [4, 6, 8]] and out.mid_held == [[7, 2], [4, 6, 8]]
    assert out.low_held == [[7], [4]] and torch.equal(out.drafts.probs[1], q1[0])
    assert [log.idx for log in out.logs] == [[1], [0]]  # log3 had only the row left out
    kept = out.logs[0]
    assert kept.drafts == [[4]] and kept.result.token_ids == [[4, 6]] and kept.result.num_accepted == [1]
    assert kept.result.confidence == [[0.9, 0.8]] and torch.equal(kept.result.probs, log1.result.probs[[0]])
    assert kept.asked == 1


def test_follow_ons_claim_drafts_only_the_rows_that_joined():
    """FollowOns with rows joined since the verdict: the follow-on is waited for (not cancelled). A row new to both
    levels (every sync starts it) is left for the next follow-on: no drafts now (`NestedOutcome.unsynced`), so
    nothing goes below and the request's frees there are owed. A row both levels hold already is drafted now,
    alone, with the request's frees for the level below; the outcomes merged. The next follow-on takes the new row
    in, starting it at both levels, its sampling parameters with it."""
    ran: list[NestedCall] = []

    def run(call, cancel):
        ran.append(call)
        n = len(call.draft.seq_ids)
        return NestedOutcome(DraftProposal([[len(ran)]] * n), [[len(ran)]] * n, [[]] * n)

    f = FollowOns(run, relay=lambda call, out: out)
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    f.verdict(Verdict("k1", [[7, 3]]))
    _, nxt = _next(call, draft, out, [[7, 3]], "k2")
    new = SamplingParams(temperature=0.5, seed=1)

    def joined(sync: SeqSync) -> NestedDraft:
        return replace(nxt, seq_ids=[*nxt.seq_ids, "z"], sampling=[*nxt.sampling, new],
                       mid_syncs=[*nxt.mid_syncs, sync], low_syncs=[*nxt.low_syncs, sync], want=[*nxt.want, 2],
                       mid_owed=[*nxt.mid_owed, 0], low_owed=[*nxt.low_owed, 0],
                       follow=FollowOn(4, (*nxt.follow.remaining, 10), (*nxt.follow.stops, (0,))))

    real = joined(SeqSync.start((1, 2)))
    req = NestedCall(real, [None, new], [None, new], EP, ("gone",), relay=(EP, "k2"))
    got, relayed = f.claim(req, real)
    assert not relayed and got.followed and got.drafts.token_ids == [[1], []] and got.unsynced == [1]
    assert len(ran) == 1 and f.stats()["owed_frees"] == 1 and f.stats()["deferred"] == 1
    f.ran(req, real, got)
    f.verdict(Verdict("k2", [[1, 4], [8]]))  # the next follow-on: "z" starts at both levels, with its parameters
    ahead = ran[-1]
    assert ahead.draft.seq_ids == ["a", "z"] and ahead.low_frees == ("gone",)
    assert ahead.draft.mid_syncs[1] == SeqSync(0, (1, 2, 8)) == ahead.draft.low_syncs[1]
    assert ahead.mid_sampling == [None, new] == ahead.low_sampling and ahead.draft.mid_owed[1] == 3

    f = FollowOns(run, relay=lambda call, out: out)
    ran.clear()
    f.ran(call, draft, out)
    f.verdict(Verdict("k1", [[7, 3]]))
    real = joined(SeqSync(2, (5,)))  # a row both levels hold (it sat a round out)
    req = NestedCall(real, [None, new], [None, new], EP, ("gone",), relay=(EP, "k2"))
    got, relayed = f.claim(req, real)
    assert not relayed and got.followed and got.drafts.token_ids == [[1], [2]] and got.unsynced == []
    assert ran[1].draft.seq_ids == ["z"] and ran[1].low_frees == ("gone",) and ran[1].mid_sampling == [new]
    assert f.stats() == {"drafted": 1, "used": 1, "dropped": 0, "joins": 1, "deferred": 0, "trims": 0,
                         "owed_frees": 0}


def _stream(nesting, joins_at: dict[int, int]) -> tuple[list[list[int]], dict]:
    """Greedy rounds over PROMPTS[:2], the other prompts joining the batch before the rounds `joins_at` names (as
    a scheduler admits requests); the tokens of every row, and the per-level statistics."""
    lv = levels(VerifyMethod.GREEDY)
    eng = CascadeEngine(lv, nesting=nesting)
    seqs = [eng.new_sequence(p, SamplingParams(), 17) for p in PROMPTS[:2]]
    waiting = list(PROMPTS[2:])
    r = 0
    while any(not s.finished for s in seqs) or waiting:
        for _ in range(joins_at.get(r, 0)):
            if waiting:
                seqs.append(eng.new_sequence(waiting.pop(0), SamplingParams(), 17))
        eng.step(seqs)
        r += 1
    stats: dict = {}
    for s in seqs:
        for key, st in s.stats.items():
            stats.setdefault(key, []).append(st.as_dict())
        eng.release(s)
    for x in lv:
        assert x.worker.stats().live_sequences == 0
    return [s.output for s in seqs], stats


def test_rows_that_join_wait_for_the_next_follow_on_and_change_no_token():
    """Rows joining a running batch: the follow-on drafted for the running rows is taken for them, and the new rows
    (new to both levels) get no draft that round, the target's step giving them their first token; the next
    follow-on takes them in (`FollowOns.claim`). Every row gets plain greedy decoding's tokens, the running rows'
    statistics equal relayed rounds without follow-ons, and the joined rows' first round drafted nothing."""
    plain, stats = _stream(RelayNesting(), {2: 1, 4: 1})
    nest = FollowNesting()
    got, got_stats = _stream(nest, {2: 1, 4: 1})
    ref = generate(CascadeEngine([levels(VerifyMethod.GREEDY)[-1]]), PROMPTS, max_tokens=17, ignore_eos=True)
    assert got == plain == [r.token_ids for r in ref.results]
    assert {k: v[:2] for k, v in got_stats.items()} == {k: v[:2] for k, v in stats.items()}
    top = max(stats)  # (target, middle): the middle level's drafts for the target, per row
    for j in (2, 3):  # one verification more without a draft: the round they joined
        undrafted = [st[top][j]["verify_calls"] - st[top][j]["num_drafts"] for st in (got_stats, stats)]
        assert undrafted[0] == undrafted[1] + 1, (j, got_stats[top][j], stats[top][j])
    assert nest.follow.joins >= 2 and nest.follow.deferred == 2 and nest.follow.used > nest.follow.joins


def test_frees_for_the_level_below_go_with_the_next_call_there_or_on_their_own():
    """A request that takes a follow-on whole makes no call below, so the sequences it frees there are owed: the
    next follow-on's first call below carries them (never a row of that call itself), or a request as sent does;
    when the next request is not a nested one, they go on their own (`Frees`, one-way)."""
    ran: list[NestedCall] = []
    posted: list = []

    def run(call, cancel):
        ran.append(call)
        return NestedOutcome(DraftProposal([[1]]), [[1]], [[1]])

    f = FollowOns(run, relay=lambda c, o: o, post=lambda at, msg: posted.append((at, msg)))
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    f.verdict(Verdict("k1", [[7, 3]]))
    real, resolved = _next(call, draft, out, [[7, 3]], "k2")
    got = f.claim(replace(real, low_frees=("gone", "a")), resolved)  # "a": as if it ended and came back
    assert got is not None and got[0].followed and f.stats()["owed_frees"] == 2
    f.ran(real, resolved, got[0])
    f.verdict(Verdict("k2", [[1, 4]]))
    assert ran[-1].low_frees == ("gone",) and f.stats()["owed_frees"] == 0  # "a" is a row of that call: live
    real2, resolved2 = _next(real, resolved, got[0], [[1, 4]], "k3")
    got = f.claim(replace(real2, low_frees=("gone2",)), resolved2)
    assert f.sent(real2).low_frees == ("gone2",) and f.sent(real2).draft is real2.draft
    assert f.stats()["owed_frees"] == 0
    f.claim(replace(real2, low_frees=("gone3",)), resolved2)  # nothing pending: runs as sent, its own frees
    f._owed[EP] = ["gone4"]
    f.claim(None, None)  # a request that is not nested: nothing goes below from here
    assert posted == [(EP, Frees(("gone4",)))] and f.stats()["owed_frees"] == 0
    f._owed[EP] = ["gone5"]
    f.ran(real2, resolved2, got[0])
    f.verdict(Verdict("k3", [[0]]))  # the stop token ends the row: no follow-on, so no call below from here
    assert posted[-1] == (EP, Frees(("gone5",))) and f.stats()["owed_frees"] == 0


def test_a_request_that_lacks_a_drafted_row_takes_the_follow_on_for_the_others():
    """A row the coordinator ended without the verdict saying so (a stop string, a cancelled request) is absent
    from the next request: the follow-on serves the rows it has, the missing row's drafts left out."""
    f = FollowOns(lambda call, cancel: NestedOutcome(DraftProposal([[1], [2]]), [[1], [2]], [[1], [2]]),
                  relay=lambda c, o: o)
    ahead = _two_rows()
    call = NestedCall(ahead, [None] * 2, [None] * 2, EP, (), relay=(EP, "k1"))
    f.ran(call, replace(ahead, follow=ahead.follow), NestedOutcome(DraftProposal([[3, 3], [1]]), [[3, 3], [1]],
                                                                   [[3], [1]]))
    f.verdict(Verdict("k1", [[3, 3], [1, 5]]))
    nxt = f._pending.draft
    only_b = replace(nxt, **{k: [getattr(nxt, k)[1]] for k in ("seq_ids", "sampling", "mid_syncs", "low_syncs",
                                                                "want", "mid_owed", "low_owed")})
    got, relayed = f.claim(replace(call, draft=only_b, mid_sampling=[None], low_sampling=[None],
                                   relay=(EP, "k2")), only_b)
    assert got.drafts.token_ids == [[2]] and got.mid_held == [[2]] and not relayed
    assert f.stats()["trims"] == 1 and f.stats()["used"] == 1


def test_a_request_a_moment_ahead_of_its_verdict_waits_for_it():
    """The target sends its verdict before its reply, but another thread of the middle level's actor reads it: a
    request that comes first waits a moment for it (`VERDICT_WAIT_S`) and takes the follow-on drafted on it."""
    f = FollowOns(lambda call, cancel: NestedOutcome(DraftProposal([[1]]), [[1]], [[1]]), relay=lambda c, o: o)
    call, draft, out = _round("k1")
    f.ran(call, draft, out)
    real, resolved = _next(call, draft, out, [[7, 3]], "k2")
    threading.Timer(0.001, f.verdict, args=(Verdict("k1", [[7, 3]]),)).start()
    got = f.claim(real, resolved)
    assert got is not None and got[0].followed and f.stats()["used"] == 1
