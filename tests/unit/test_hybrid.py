"""Hybrid plans: per row the lookup level's match goes straight to the target, the other rows take the model's
draft, all verified in one call. Exactness per row (greedy and the law at T > 0 under rejection), per-row
statistics, the planner's choice, the per-request override."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import Batch, generate
from specray.coordinator.scheduler import RequestError, Scheduler, Speculation
from specray.coordinator.stats import named_stats
from specray.policy.cost import linear_cost
from specray.policy.planner import Planner
from specray.serve.protocol.requests import SpeculationOptions
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.fake import FakeWorker
from tests.unit.test_cascade import assert_target_law, draft, target
from tests.unit.test_planner import Sim, three_levels

#: ragged; the first three end with a token seen earlier in them (the n-gram matches), the last two do not
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [4, 5, 6, 7, 1, 2, 3, 4, 5], [1, 2, 1, 2, 1], [0], [9, 8, 7, 6, 5, 4, 3]]
MATCHING = [True, True, True, False, False]
HYBRID = Plan((0, 1, 2), (4, 3), hybrid=True)


def levels(method: VerifyMethod = VerifyMethod.GREEDY) -> list[Level]:
    return [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("d", worker=draft(0.7), k=3, method=method),
            Level("target", worker=target(), method=method)]


class Recorder:
    """A planner-feed observer that keeps the acceptance events."""

    def __init__(self) -> None:
        self.verified: list[tuple[int, int, list[int], list[int]]] = []

    def on_call(self, level, kind, batch, tokens, seconds) -> None:
        pass

    def on_verify(self, level, lower, draft_lens, accepted) -> None:
        self.verified.append((level, lower, list(draft_lens), list(accepted)))


def test_plan_validation():
    with pytest.raises(ValueError, match="hybrid"):
        Plan((0, 2), (4,), hybrid=True)  # needs a lookup and a model below the target
    with pytest.raises(ValueError, match="hybrid"):
        Plan((0, 1, 2), (4, 0), hybrid=True)
    models = [Level("d1", worker=draft(1.0, "d1", 3), k=2), Level("d2", worker=draft(0.4, "d2", 4), k=3),
              Level("target", worker=target())]
    eng = CascadeEngine(models)
    s = eng.new_sequence([1, 2, 3], SamplingParams(), 4)
    with pytest.raises(ValueError, match="'d1' must be a lookup level"):
        eng.step([s], HYBRID)
    assert Plan((0, 1, 2), (4, 3)) != HYBRID and len({HYBRID, Plan((0, 1, 2), (4, 3))}) == 2
    assert CascadeEngine(levels()).plan_name(HYBRID) == "ngram:4|d:3>target"


def test_first_round_drafts_per_row_and_stats_name_the_drafter():
    eng = CascadeEngine(levels())
    rec = Recorder()
    eng.observers.append(rec)
    seqs = [eng.new_sequence(p, SamplingParams(), 20) for p in PROMPTS]
    eng.step(seqs, HYBRID)
    found = [len(eng.levels[0].ngram.propose(p, 4)) for p in PROMPTS]
    assert [n > 0 for n in found] == MATCHING
    for s, matching, n in zip(seqs, MATCHING, found):
        assert list(s.stats) == [(2, 0) if matching else (2, 1)]  # (verifier, drafter)
        st = next(iter(s.stats.values()))
        assert st.draft_tokens == (n if matching else 3)  # the lookup's match, or the model's K
        pairs = named_stats(["ngram", "d", "target"], s.stats)["target"].pairs
        assert list(pairs) == ["ngram->target" if matching else "d->target"]
    # the model drafted only for the rows without a match (it holds nothing of the others)
    assert [1 in s.mirror for s in seqs] == [not m for m in MATCHING]
    # the feed: the lookup over every row (a row the model drafted for counts as no match), the model over its own
    (lv, lo, lens, acc), (lv2, lo2, lens2, _) = rec.verified
    assert (lv, lo, lv2, lo2) == (2, 0, 2, 1)
    assert lens == found and acc[3:] == [0, 0] and lens2 == [3, 3]
    for s in seqs:
        eng.release(s)


def test_greedy_hybrid_equals_plain_on_a_ragged_mixed_batch():
    # a row whose prompt holds its own continuation (the target's next token depends on the last two): the
    # n-gram's copy is accepted
    head = [1, 2, 3]
    cont = generate([Level("target", worker=target())], [head], max_tokens=8, ignore_eos=True).results[0].token_ids
    prompts = [*PROMPTS, head + cont + head]
    plain = generate(levels(), prompts, max_tokens=25, ignore_eos=True, plain=True)
    batch = generate(levels(), prompts, max_tokens=25, ignore_eos=True, plan=HYBRID)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    pairs = batch.stats["target"].pairs
    assert pairs["ngram->target"].accepted_tokens > 0 and pairs["d->target"].accepted_tokens > 0
    assert "d" not in batch.stats  # the model never verified anything: no inner rounds
    assert batch.rounds < plain.rounds
    # and a minimum match length: short matches go to the model instead; still exact
    eng = CascadeEngine(levels())
    eng.drafter.min_match = 3
    longer = generate(eng, prompts, max_tokens=25, ignore_eos=True, plan=HYBRID)
    assert [r.token_ids for r in longer.results] == [r.token_ids for r in plain.results]
    assert longer.stats["target"].pairs["d->target"].num_drafts > pairs["d->target"].num_drafts


def test_greedy_hybrid_with_a_suffix_lookup_equals_plain():
    from specray.spec.suffix import SuffixConfig, SuffixDrafter

    def lv() -> list[Level]:
        suffix = SuffixDrafter(SuffixConfig(num_speculative_tokens=4, max_spec_factor=4.0, min_token_prob=0.0))
        return [Level("suffix", suffix=suffix), Level("d", worker=draft(0.7), k=3), Level("target", worker=target())]

    plain = generate(lv(), PROMPTS, max_tokens=20, ignore_eos=True, plain=True)
    batch = generate(lv(), PROMPTS, max_tokens=20, ignore_eos=True, plan=HYBRID)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    pairs = batch.stats["target"].pairs
    assert pairs["suffix->target"].num_drafts > 0 and pairs["d->target"].num_drafts > 0


def test_greedy_hybrid_equals_plain_with_tiny_hf_models(tiny):
    """fp32 tiny models in process: the n-gram, the high-agreement draft, the target."""
    from specray.engine.hf import HFWorker

    def lv() -> list[Level]:
        return [Level("ngram", ngram=NgramConfig(4, 1, 3)),
                Level("mid", worker=HFWorker(str(tiny.draft_dirs["mid"]), name="mid", dtype="float32"), k=3),
                Level("t", worker=HFWorker(str(tiny.target_dir), name="t", dtype="float32"))]

    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown", "Hello",
               "def fibonacci(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n    def push"]
    plain = generate(lv(), prompts, max_tokens=16, ignore_eos=True, plain=True)
    batch = generate(lv(), prompts, max_tokens=16, ignore_eos=True, plan=Plan((0, 1, 2), (4, 3), hybrid=True))
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    pairs = batch.stats["t"].pairs
    assert pairs["ngram->t"].num_drafts > 0 and pairs["mid->t"].num_drafts > 0


def test_rejection_over_mixed_rows_samples_the_targets_law():
    """T = 0.7 under rejection: rows with a match (one-hot q) and rows with the model's sampled draft (its q) in
    the same verification calls; each prompt's 3-token outputs follow the target's joint law."""
    vocab, n_draws, n_tok = 5, 3000, 3

    def mk(name, noise, seed):
        return FakeWorker(name, vocab=vocab, order=1, table_seed=7, noise=noise, noise_seed=seed, sharpness=1.0)

    lv = [Level("ng", ngram=NgramConfig(2, 1, 2)), Level("d", worker=mk("d", 0.8, 2), k=2),
          Level("t", worker=mk("t", 0, 0), method=VerifyMethod.REJECTION)]
    sp = SamplingParams(temperature=0.7)
    match, miss = [1, 2, 1, 2, 1], [0, 1, 2, 3, 4]  # the n-gram matches the first, never the second's last token
    prompts = [match, miss] * n_draws
    sps = [SamplingParams(sp.temperature, seed=20_000 + i) for i in range(len(prompts))]
    batch = generate(lv, prompts, max_tokens=n_tok, sampling=sps, ignore_eos=True,
                     plan=Plan((0, 1, 2), (2, 2), hybrid=True))
    pairs = batch.stats["t"].pairs
    assert pairs["ng->t"].accepted_tokens > 0 and pairs["d->t"].accepted_tokens > 0
    assert pairs["ng->t"].accepted_tokens < pairs["ng->t"].draft_tokens  # rejections happened on lookup rows
    for j, prompt in enumerate((match, miss)):
        assert_target_law(Batch(batch.results[j::2], batch.stats), lv[-1].worker, prompt, sp, n_tok)


def test_every_row_matching_under_rejection_needs_no_q():
    """A hybrid round in which every row took the lookup's draft is verified as the lookup's (deterministic: the
    model made no draft, so there is no q to give a rejection verification)."""
    eng = CascadeEngine(levels(VerifyMethod.REJECTION))
    seqs = [eng.new_sequence(p, SamplingParams(temperature=0.8, seed=i), 12) for i, p in enumerate(PROMPTS[:3])]
    eng.step(seqs, HYBRID)
    assert all(list(s.stats) == [(2, 0)] and 1 not in s.mirror for s in seqs)
    while any(not s.finished for s in seqs):
        eng.step(seqs, HYBRID)
    assert all(len(s.output) == 12 for s in seqs)


def test_overlap_runs_hybrid_plans_immediately_and_stays_exact():
    plain = generate(levels(), PROMPTS, max_tokens=20, ignore_eos=True, plain=True)
    eng = CascadeEngine(levels(), overlap=True)
    batch = generate(eng, PROMPTS, max_tokens=20, ignore_eos=True, plan=HYBRID)
    assert [r.token_ids for r in batch.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_rows == 0
    cascade = generate(eng, PROMPTS, max_tokens=20, ignore_eos=True, plan=Plan((0, 1, 2), (4, 3)))
    assert [r.token_ids for r in cascade.results] == [r.token_ids for r in plain.results]
    assert eng.ahead_rows > 0  # the look-ahead still runs for the other plans


def test_a_failed_model_level_leaves_the_lookups_plan():
    lv = [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("d1", worker=draft(1.0, "d1", 3), k=2),
          Level("d2", worker=draft(0.4, "d2", 4), k=3), Level("target", worker=target())]
    eng = CascadeEngine(lv)
    eng.failover.retry_after_s = 1e9
    plan = Plan((0, 2, 3), (4, 3), hybrid=True)
    eng.failover.mark_down(1, RuntimeError("gone"))  # a level outside the plan: the plan stays hybrid
    assert eng.failover.available(plan) == plan
    eng.failover.mark_down(2, RuntimeError("gone"))  # its model: the lookup's plan
    assert eng.failover.available(plan) == Plan((0, 3), (4,))


# ----- the planner ----------------------------------------------------------------------------------------
class HybridSim(Sim):
    """`Sim` with a lookup that matches a row with probability `match` (a row without a match drafts nothing),
    and hybrid rounds: matched rows verify the lookup's K, the others the model's draft, in one target call."""

    def __init__(self, planner: Planner, costs, alpha, match: float, seed: int = 0) -> None:
        super().__init__(planner, costs, alpha, seed=seed)
        self.match = match

    def _verify(self, level, lower, lens):
        if lower is not None and self.is_ngram[lower]:
            lens = [n if self.rng.random() < self.match else 0 for n in lens]
        return super()._verify(level, lower, lens)

    def round(self, plan: Plan, batch: int):
        if not plan.hybrid:
            return super().round(plan, batch)
        (look, model, top), (k_l, k_d) = plan.levels, plan.k
        hit = [self.rng.random() < self.match for _ in range(batch)]
        miss = batch - sum(hit)
        dt = self._produce(Plan((model, top), (k_d,)), 0, [k_d] * miss) if miss else 0.0
        lens = [k_l if h else k_d for h in hit]
        dv = self._t(top, batch, max(lens) + 1)
        self.p.on_call(top, "verify", batch, max(lens) + 1, dv)
        acc = [self._accept((top, look) if h else (top, model), n) for h, n in zip(hit, lens)]
        self.p.on_verify(top, look, [n * h for h, n in zip(hit, lens)], [a * h for h, a in zip(hit, acc)])
        if miss:
            self.p.on_verify(top, model, [k_d] * miss, [a for h, a in zip(hit, acc) if not h])
        return sum(acc) + batch, dt + dv


def _planner_after(match: float, batch: int = 4, decay: float = 0.9, rounds: int = 200) -> Planner:
    """Lookup matches are free and accepted well, the target is slow (memory-bound), the model costs a fiftieth
    of it per step: drafting with the model for every row (or verifying the lookup with it) costs more than
    it brings on rows the lookup already covers."""
    p = Planner(three_levels(), decay=decay)
    truth = {2: linear_cost(0.2, 0.0002), 1: linear_cost(0.004, 0.0)}
    sim = HybridSim(p, truth, {(2, 0): 0.95, (2, 1): 0.85, (1, 0): 0.9}, match=match)
    sim.run(batch, rounds)
    return p


def test_planner_picks_hybrid_when_matches_are_frequent_and_the_model_costs():
    p = _planner_after(0.6)
    best = p.explain(4)[0][0]
    assert best.hybrid and p.current.hybrid, p.describe(4)
    assert p.match_rate() == pytest.approx(0.6, abs=0.15)
    assert "|" in p.plan_name(best) and p._parse(p.plan_name(best), 4) == best
    # the prediction it rests on: E[L] mixes a match's and the model's expected length by the match rate
    m = p.match_rate()
    want = m * p.matched[(2, 0)].expected_length(best.k[0]) + (1 - m) * p.pricing._elen(2, 1, best.k[1])
    assert p.expected_length(best, 4) == pytest.approx(want)
    assert p.regime(4) == "cascade"  # two drafters
    assert p._parse("hybrid", 4) == best and not p._parse("cascade", 4).hybrid  # table entries


def test_planner_picks_hybrid_at_batch_one_too():
    """At batch 1 a round in which the lookup found nothing verifies no draft at all: it must still count against
    the lookup's acceptance (one token for a round), else the lookup alone looks better than it is.

    One row, and the target verifies the lookup's matches only in probes (every `explore_every` rounds) until the
    hybrid is held: over 200 rounds half the seeds found it, over 800 every one of 20 tried."""
    p = _planner_after(0.6, batch=1, decay=0.99, rounds=800)  # a longer memory: one row per round is a noisy estimate
    best = p.explain(1)[0][0]
    assert best.hybrid and p.current.hybrid, p.describe(1)


def test_planner_leaves_hybrid_when_the_lookup_never_matches():
    p = _planner_after(0.0)
    assert p.match_rate() < 0.05
    ranked = p.explain(4)
    assert not ranked[0][0].hybrid and not p.current.hybrid
    for plan, gp in ranked:  # without matches a hybrid plan is the model's plan plus a lookup that finds nothing
        if plan.hybrid:
            assert gp <= p.goodput(Plan((1, 2), (plan.k[1],)), 4) + 1e-9


# ----- the per-request override -------------------------------------------------------------------------
def test_request_override_hybrid():
    sched = Scheduler(CascadeEngine(levels()))
    assert sched.plan_for(Speculation("hybrid")) == Plan((0, 1, 2), (4, 3), hybrid=True)
    assert sched.plan_for(Speculation("hybrid", 2)) == Plan((0, 1, 2), (2, 2), hybrid=True)
    no_lookup = Scheduler(CascadeEngine([Level("d", worker=draft(0.5)), Level("target", worker=target())]))
    with pytest.raises(RequestError, match="hybrid"):
        no_lookup.plan_for(Speculation("hybrid"))
    assert SpeculationOptions(method="hybrid").method == "hybrid"
