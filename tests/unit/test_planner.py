"""The planner on synthetic cost curves (a simulator stands in for the engine) and end to end on fakes."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.feed import TreeWalk
from specray.coordinator.generate import generate
from specray.policy.cost import Acceptance, StepCost, linear_cost
from specray.policy.planner import Planner
from specray.spec.bound import expected_accepted_length_iid
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, TreeShape, VerifyMethod
from specray.testing.fake import FakeWorker

CostFn = Callable[[int, int], float]


def _dummy(name: str) -> FakeWorker:
    return FakeWorker(name, vocab=8)


def two_levels(k: int = 4) -> list[Level]:
    return [Level("draft", worker=_dummy("draft"), k=k), Level("target", worker=_dummy("target"))]


def three_levels() -> list[Level]:
    return [
        Level("ngram", ngram=NgramConfig(3, 1, 3)),
        Level("mid", worker=_dummy("mid"), k=4),
        Level("target", worker=_dummy("target")),
    ]


class Sim:
    """Replays what `CascadeEngine.step` reports to its observers for a plan, from a ground truth:
    cost curves per model level and an iid acceptance rate per (verifier, drafter) pair."""

    def __init__(self, planner: Planner, costs: dict[int, CostFn], alpha: dict[tuple[int, int], float],
                 noise: float = 0.0, seed: int = 0) -> None:
        self.p, self.costs, self.alpha, self.noise = planner, costs, alpha, noise
        self.rng = random.Random(seed)
        self.is_ngram = planner.is_ngram

    def _t(self, level: int, batch: int, q: int) -> float:
        return self.costs[level](batch, q) * self.rng.uniform(1 - self.noise, 1 + self.noise)

    def _accept(self, pair: tuple[int, int], n: int) -> int:
        a = 0
        while a < n and self.rng.random() < self.alpha[pair]:
            a += 1
        return a

    def _verify(self, level: int, lower: int | None, lens: list[int]) -> tuple[list[int], float]:
        dt = self._t(level, len(lens), max(lens, default=0) + 1)
        self.p.on_call(level, "verify", len(lens), max(lens, default=0) + 1, dt)
        acc = [self._accept((level, lower), n) if lower is not None else 0 for n in lens]
        if lower is not None:
            self.p.on_verify(level, lower, lens, acc)
        return [a + 1 for a in acc], dt

    def _produce(self, plan: Plan, ci: int, want: list[int]) -> float:
        lvl = plan.levels[ci]
        if ci == 0:
            if self.is_ngram[lvl]:
                return 0.0
            steps = max(want, default=0)
            dt = sum(self._t(lvl, len(want), 1) for _ in range(steps))
            self.p.on_call(lvl, "propose", len(want), steps, dt)
            return dt
        total, outs = 0.0, [0] * len(want)
        k_low = plan.k[ci - 1]
        while True:
            rows = [b for b in range(len(want)) if outs[b] < want[b]]
            if not rows:
                return total
            sub = [max(0, min(k_low, want[b] - outs[b] - 1)) for b in rows]
            if any(sub):
                total += self._produce(plan, ci - 1, sub)
            lower = plan.levels[ci - 1] if any(sub) else None
            emitted, dt = self._verify(lvl, lower if lower is not None else plan.levels[ci - 1], sub)
            total += dt
            for b, e in zip(rows, emitted):
                outs[b] += e

    def round(self, plan: Plan, batch: int) -> tuple[int, float]:
        """One round: (tokens committed over the batch, seconds)."""
        if len(plan.levels) == 1 or plan.k[-1] == 0:
            _, dt = self._verify(self.p.top, None, [0] * batch)
            return batch, dt
        dt = self._produce(plan, len(plan.levels) - 2, [plan.k[-1]] * batch)
        emitted, dv = self._verify(self.p.top, plan.levels[-2], [plan.k[-1]] * batch)
        return sum(emitted), dt + dv

    def run(self, batch: int, rounds: int) -> list[Plan]:
        chosen = []
        for _ in range(rounds):
            plan = self.p(batch)
            chosen.append(plan)
            self.round(plan, batch)
        return chosen


# ----- the models ---------------------------------------------------------------------------------------
def test_step_cost_fits_cpu_and_gpu_shapes():
    cpu, gpu = linear_cost(0.01, 0.004), linear_cost(0.02, 0.0)
    for truth in (cpu, gpu):
        c = StepCost()
        for b, q in [(1, 1), (1, 5), (4, 5), (8, 1), (16, 9)]:
            for _ in range(3):
                c.observe(b, q, truth(b, q))
        for b, q in [(2, 3), (32, 1), (64, 9)]:
            assert c.predict(b, q) == pytest.approx(truth(b, q), rel=0.05)
        assert min(c.coefficients) >= 0


def test_step_cost_extrapolates_from_one_point_with_prior_shape():
    c = StepCost(prior=(1.0, 0.0, 0.0))  # flat prior
    assert c.predict(8, 5) == pytest.approx(1.0)
    c.observe(1, 5, 0.03)
    assert c.predict(1, 5) == pytest.approx(0.03, rel=0.02)
    assert c.predict(4, 1) == pytest.approx(0.03, rel=0.05)  # the measured level, the prior's shape


def test_unmeasured_positions_extend_the_deepest_measured_one():
    """n-gram drafts: alpha rises with the position (a copy that started goes on). Run at K = 3 only, the
    estimate for positions 4..8 must follow position 3 (high), not the pooled rate (dragged down by position
    1), or a planner holding K = 3 never finds that K = 8 pays."""
    acc = Acceptance(prior_mean=0.3, decay=1.0)
    truth = [0.3, 0.8, 0.9]
    rng = random.Random(1)
    for _ in range(200):
        accepted = []
        for _row in range(4):
            a = 0
            while a < 3 and rng.random() < truth[a]:
                a += 1
            accepted.append(a)
        acc.observe([3] * 4, accepted)
    al = acc.alphas(8)
    assert al[0] == pytest.approx(0.3, abs=0.05) and al[2] == pytest.approx(0.9, abs=0.06)
    assert acc.pooled < 0.6
    assert all(a == pytest.approx(al[2], abs=1e-9) for a in al[3:])  # the deepest measured position, not pooled
    assert acc.expected_length(8) > acc.expected_length(3) + 0.15


def test_acceptance_estimates_and_expected_length():
    rng = random.Random(0)
    acc = Acceptance(prior_mean=0.5, decay=0.99)
    assert acc.alphas(3) == [0.5, 0.5, 0.5]
    for _ in range(300):
        lens = [4] * 8
        accepted = []
        for n in lens:
            a = 0
            while a < n and rng.random() < 0.8:
                a += 1
            accepted.append(a)
        acc.observe(lens, accepted)
    assert all(abs(a - 0.8) < 0.05 for a in acc.alphas(6))  # positions 5, 6 borrow position 4's estimate
    assert acc.expected_length(4) == pytest.approx(expected_accepted_length_iid(0.8, 4), rel=0.05)
    # a draft of n with a accepted: trials at 1..min(a+1, n), successes at 1..a
    one = Acceptance(prior_strength=0.0, pos_strength=1e-9)
    one.observe([3, 3], [3, 1])
    assert list(one.trials[:3]) == [2, 2, 1] and list(one.successes[:3]) == [2, 1, 1]
    # an n-gram that found no match (or a shorter one) for a row: a rejection at the next position
    ng = Acceptance(decay=1.0)
    ng.observe([0, 2, 4], [0, 2, 1], proposed=4)
    assert list(ng.trials[:4]) == [3, 2, 1, 0] and list(ng.successes[:4]) == [2, 1, 0, 0]


def test_goodput_formulas():
    p = Planner(three_levels(), decay=1.0)
    p.costs[2] = StepCost(prior=(1.0, 0.0, 0.0))
    p.costs[1] = StepCost(prior=(0.2, 0.0, 0.0))
    for pair, alpha in {(2, 1): 0.8, (1, 0): 0.5, (2, 0): 0.6}.items():
        acc = p.acceptance[pair]
        acc.prior_mean, acc.prior_strength, acc.pos_strength = alpha, 1.0, 1.0
    assert p.goodput(p.plain, 4) == pytest.approx(4.0)
    e = expected_accepted_length_iid(0.8, 3)
    assert p.goodput(Plan((1, 2), (3,)), 1) == pytest.approx(e / (3 * 0.2 + 1.0))
    assert p.goodput(Plan((0, 2), (5,)), 1) == pytest.approx(expected_accepted_length_iid(0.6, 5))
    inner = -(-4 // expected_accepted_length_iid(0.5, 2))  # ceil(K1 / E_mid(K0))
    assert p.round_time(Plan((0, 1, 2), (2, 4)), 1) == pytest.approx(inner * 0.2 + 1.0)


def test_an_ngram_round_without_a_match_is_priced_as_a_plain_step():
    """An n-gram drafts nothing where it finds no match, so at match rate m a batch-B round feeds K + 1 tokens per
    row only when some row matched (1 - (1 - m)^B): priced at K + 1 regardless, a long K looked dear on a target
    whose step grows with the tokens fed. Until lookups are measured every row is priced as matched."""
    levels = [Level("ngram", ngram=NgramConfig(8, 1, 3)), Level("target", worker=_dummy("target"))]
    p = Planner(levels, decay=1.0)
    p.costs[1] = StepCost(prior=(0.1, 0.01, 0.0))
    t = p.costs[1].predict
    assert p.round_time(Plan((0, 1), (8,)), 1) == pytest.approx(t(1, 9))  # nothing measured yet
    for _ in range(48):  # the lookup matched one row in four
        p.on_verify(1, 0, [0, 0, 0, 8], [0, 0, 0, 2], asked=8)
    m = p.measurements.match[0] / p.measurements.match[1]
    assert m == pytest.approx(0.25)
    m2 = (48 + 2.0) / (4 * 48 + 2.0)  # two pseudo-rows that matched
    for batch in (1, 4):
        none = (1.0 - m2) ** batch
        assert p.round_time(Plan((0, 1), (8,)), batch) == pytest.approx(
            (1.0 - none) * t(batch, 9) + none * t(batch, 1))
    # the ranking's table prices the same, bit for bit
    ranked = dict(p.explain(1))
    for k in (2, 8):
        plan = Plan((0, 1), (k,))
        assert ranked[plan] == p.goodput(plan, 1)


def test_overlap_is_priced():
    """With an overlapping engine a model-drafted round costs (1 - hit) * draft(K) + max(verify, draft(K + 1)),
    hit = prod alpha_1..K+1 (the look-ahead holds); n-gram-only plans and plain decoding are unchanged."""
    from specray.coordinator.cascade import CascadeEngine

    levels = three_levels()
    engine = CascadeEngine(levels, overlap=True)
    engine.ahead_bounded = False
    p = Planner(levels, decay=1.0).attach(engine)
    assert p.overlap and not p.bounded
    p.costs[2] = StepCost(prior=(1.0, 0.0, 0.0))
    p.costs[1] = StepCost(prior=(0.2, 0.0, 0.0))
    for pair, alpha in {(2, 1): 0.8, (1, 0): 0.5, (2, 0): 0.6}.items():
        acc = p.acceptance[pair]
        acc.prior_mean, acc.prior_strength, acc.pos_strength = alpha, 1.0, 1.0
    hit = 0.8**4
    assert p.round_time(Plan((1, 2), (3,)), 1) == pytest.approx((1 - hit) * 0.6 + max(1.0, 0.8))
    assert p.round_time(Plan((0, 2), (5,)), 1) == pytest.approx(1.0)  # the n-gram costs nothing to overlap
    assert p.round_time(p.plain, 1) == pytest.approx(1.0)
    off = Planner(three_levels(), decay=1.0).attach(CascadeEngine(three_levels()))
    assert not off.overlap


def _bounded_planner(alpha: float, target: tuple[float, float, float], t_mid: float, alpha_in: float = 1.0
                     ) -> Planner:
    levels = three_levels()
    p = Planner(levels, decay=1.0).attach(CascadeEngine(levels, overlap=True))
    assert p.overlap and p.bounded and p.ahead_chunk == 2
    p.costs[2] = StepCost(prior=target)
    p.costs[1] = StepCost(prior=(t_mid, 0.0, 0.0))
    for pair, a in {(2, 1): alpha, (1, 0): alpha_in, (2, 0): 0.5}.items():
        acc = p.acceptance[pair]
        acc.prior_mean, acc.prior_strength, acc.pos_strength = a, 1.0, 1.0
    return p


def _simulate_bounded(k: int, alpha: float, verify: CostFn, step_tokens: int, step_time: float,
                      rounds: int = 200_000, seed: int = 0) -> tuple[float, float]:
    """Monte Carlo of the engine's bounded look-ahead at batch 1 (lookahead.py), iid acceptance: a row without
    a usable look-ahead drafts one step (step_tokens in step_time); the target verifies while the drafter drafts
    ahead K + 1 tokens, stopping at the end of its step in progress once the verification is done; the
    look-ahead is the next draft (up to K) when every draft and the bonus token matched. (tokens/round, s/round)"""
    rng = random.Random(seed)
    full = -(-(k + 1) // step_tokens)
    look, tokens, seconds = 0, 0, 0.0
    for _ in range(rounds):
        if look >= 2:
            n, t = min(k, look - 1), 0.0
        else:
            n, t = min(k, step_tokens), step_time
        v = verify(1, n + 1)
        steps = min(full, max(1, -(-v // step_time)))
        made = min(k + 1, int(steps * step_tokens))
        a = 0
        while a < n and rng.random() < alpha:
            a += 1
        bonus_match = a == n and rng.random() < alpha
        look = made if bonus_match else 0
        tokens += a + 1
        seconds += t + max(v, steps * step_time)
    return tokens / rounds, seconds / rounds


@pytest.mark.parametrize("alpha,k,t_draft", [(0.8, 8, 0.15), (0.9, 16, 0.15), (0.6, 4, 0.4), (0.95, 16, 0.05)])
def test_bounded_overlap_is_priced_as_the_engine_runs(alpha, k, t_draft):
    """The bounded look-ahead (CascadeEngine.ahead_bounded): the planner's renewal chain (hit: the look-ahead
    made in the verification's time; miss: one step drafted with the target idle) agrees with a Monte Carlo
    of the engine's rules, for a first model level (steps of ahead_chunk proposals) and a middle level over
    an n-gram (an inner round yields K_low + 1 tokens at alpha_in = 1)."""
    p = _bounded_planner(alpha, (0.3, 0.03, 0.0), t_draft)
    verify = linear_cost(0.3, 0.03)
    plan = Plan((1, 2), (k,))
    e_sim, t_sim = _simulate_bounded(k, alpha, verify, step_tokens=2, step_time=2 * t_draft)
    assert p.expected_length(plan, 1) == pytest.approx(e_sim, rel=0.02)
    assert p.round_time(plan, 1) == pytest.approx(t_sim, rel=0.02)
    cascade = Plan((0, 1, 2), (3, k))  # the n-gram proposes 3, the middle level checks them: 4 tokens a step
    e_sim, t_sim = _simulate_bounded(k, alpha, verify, step_tokens=4, step_time=t_draft)
    assert p.expected_length(cascade, 1) == pytest.approx(e_sim, rel=0.02)
    assert p.round_time(cascade, 1) == pytest.approx(t_sim, rel=0.02)


def test_bounded_overlap_rates_a_slow_drafter_above_the_unbounded_price():
    """What the bounded round changes for plan choice: with a drafter a third of the target's speed the
    unbounded price pays (1 - hit) * K draft steps with the target idle, the bounded one a single step, so a
    large K no longer looks worse than a small one; at a batch where any row misses the drafted step is paid
    every round, and plain decoding still wins where verification grows with B * K."""
    bounded = _bounded_planner(0.85, (0.35, 0.02, 0.0), 0.13)
    unbounded = _bounded_planner(0.85, (0.35, 0.02, 0.0), 0.13)
    unbounded.bounded = False
    big, small = Plan((1, 2), (16,)), Plan((1, 2), (4,))
    assert bounded.goodput(big, 1) > 1.5 * unbounded.goodput(big, 1)
    assert bounded.goodput(big, 1) >= 0.95 * bounded.goodput(small, 1)
    assert bounded.goodput(big, 1) > 1.5 * bounded.goodput(bounded.plain, 1)
    # a miss by any row of the batch makes the round draft a step first (a flat target: same verification)
    flat = _bounded_planner(0.85, (0.5, 0.0, 0.0), 0.13)
    assert flat.expected_length(big, 8) == pytest.approx(flat.expected_length(big, 1))
    assert flat.round_time(big, 8) > flat.round_time(big, 1) + 0.5 * 2 * 0.13
    steep = _bounded_planner(0.85, (0.01, 0.004, 0.0), 0.001)  # verification grows with B * q
    assert max(steep.explain(256), key=lambda x: x[1])[0] == steep.plain


# ----- choices on synthetic curves -------------------------------------------------------------------------
def test_batch_one_speculates_with_cheap_accurate_drafter():
    p = Planner(two_levels())
    sim = Sim(p, {1: linear_cost(0.02, 0.0), 0: linear_cost(0.004, 0.0)}, {(1, 0): 0.8})
    sim.run(1, 100)
    plan = p.current
    assert p.regime(1) == "draft" and plan.levels == (0, 1) and plan.k[0] >= 3
    assert p.alphas(1, 0, 1)[0] == pytest.approx(0.8, abs=0.15)


def test_describe_reports_the_held_plan_and_the_ranking_it_comes_from():
    """/health shows this: the held plan, and the best candidates with goodput = E[L] x batch / round time."""
    p = Planner(two_levels())
    sim = Sim(p, {1: linear_cost(0.02, 0.0), 0: linear_cost(0.004, 0.0)}, {(1, 0): 0.8})
    sim.run(1, 100)
    view = p.describe(0, top=3)  # idle: described at batch 1
    assert view["batch"] == 1 and view["current"] == p.plan_name(p.current)
    assert [r["plan"] for r in view["ranked"]] == [p.plan_name(x) for x, _ in p.explain(1)[:3]]
    goodputs = [r["goodput"] for r in view["ranked"]]
    assert goodputs == sorted(goodputs, reverse=True) and len(goodputs) == 3
    for r in view["ranked"]:
        assert r["goodput"] == pytest.approx(r["tokens_per_round"] / r["round_s"], rel=1e-2)
    assert p.describe(16)["batch"] == 16


def test_large_compute_bound_batch_decodes_plainly():
    p = Planner(two_levels())
    sim = Sim(p, {1: linear_cost(0.01, 0.002), 0: linear_cost(0.001, 0.0002)}, {(1, 0): 0.8})
    sim.run(64, 60)
    assert p.current == Plan((1,), ())
    assert p.regime(64) == "none"


def test_cascade_regimes_shift_with_batch_size():
    p = Planner(three_levels())
    truth = {2: linear_cost(0.1, 0.004), 1: linear_cost(0.01, 0.0004)}
    sim = Sim(p, truth, {(2, 0): 0.9, (2, 1): 0.8, (1, 0): 0.9})
    sim.run(1, 150)
    assert p.regime(1) in ("cascade", "ngram", "draft")
    assert p.goodput(p.current, 1) > 1.3 * p.goodput(p.plain, 1)
    sim.run(512, 100)  # the free n-gram at K=1 stops paying at B ~ 0.9*0.1 / (0.1*0.004) = 225
    assert p.regime(512) == "none"
    assert p.current == p.plain


def test_ranking_every_few_rounds_reaches_the_same_plans_at_a_fraction_of_the_pricing(monkeypatch):
    """`rerank_every=4`: the candidates are priced on one round in four (a new batch size ranks at once), the
    other rounds keep the held plan, and the planner still finds the speculative regime at batch 1 and plain
    decoding at a large batch, as it does when it ranks every round."""
    truth = {2: linear_cost(0.1, 0.004), 1: linear_cost(0.01, 0.0004)}
    alpha = {(2, 0): 0.9, (2, 1): 0.8, (1, 0): 0.9}
    every, amortised = Planner(three_levels()), Planner(three_levels(), rerank_every=4)
    rankings = {id(every): 0, id(amortised): 0}
    explain = Planner.explain

    def counted(self, batch):
        rankings[id(self)] += 1
        return explain(self, batch)

    monkeypatch.setattr(Planner, "explain", counted)
    for p in (every, amortised):
        sim = Sim(p, truth, alpha)
        sim.run(1, 160)
        assert p.regime(1) in ("cascade", "ngram", "draft")
        assert p.goodput(p.current, 1) > 1.3 * p.goodput(p.plain, 1)
        sim.run(512, 160)
        assert p.current == p.plain and p.regime(512) == "none"
    assert rankings[id(every)] >= 300
    assert rankings[id(amortised)] <= rankings[id(every)] / 3
    batches = []
    p = Planner(three_levels(), rerank_every=4, warmup=0)
    monkeypatch.setattr(Planner, "explain", lambda self, batch: batches.append(batch) or explain(self, batch))
    for batch in (1, 1, 1, 8, 8, 8, 8, 8):
        p.plan(batch)
    assert batches == [1, 8, 8]  # the first round at a new batch size ranks; then one in four
    with pytest.raises(ValueError, match="rerank_every"):
        Planner(three_levels(), rerank_every=0)


def test_the_ranking_keeps_within_its_time_budget(monkeypatch):
    """`rerank_budget`: after a ranking that took t seconds of CPU the planner holds its plan until t / budget seconds
    have passed, so the ranking is at most that share of the time however short the rounds are; a new batch size
    still ranks at once."""
    import specray.policy.cadence as cadence_mod

    class Clock:
        now = 0.0  # wall
        cpu = 0.0  # the coordinator thread's CPU

        @staticmethod
        def perf_counter() -> float:
            return Clock.now

        @staticmethod
        def thread_time() -> float:
            return Clock.cpu

    monkeypatch.setattr(cadence_mod, "time", Clock)
    explain = Planner.explain
    rankings: list[float] = []
    waits = iter([0.0, 0.5, 0.0] * 50)

    def slow_explain(self, batch):
        rankings.append(Clock.now)
        Clock.now += 0.005 + next(waits)  # a ranking takes 5 ms of CPU, and once its thread waits half a second
        Clock.cpu += 0.005
        return explain(self, batch)

    monkeypatch.setattr(Planner, "explain", slow_explain)
    p = Planner(three_levels(), warmup=0, rerank_budget=0.05)  # 5 ms of ranking per 100 ms at most
    for _ in range(100):  # rounds of 10 ms
        p.plan(1)
        Clock.now += 0.010
    # a ranking in each 100 ms of rounds: a wait for the GIL or a core is not the ranking's cost (counted as one,
    # each such wait held the plan 10 s)
    assert 9 <= len(rankings) <= 11
    assert all(b - a >= 0.1 for a, b in zip(rankings, rankings[1:]))
    before = len(rankings)
    p.plan(16)  # a new batch size: ranked at once
    assert len(rankings) == before + 1
    with pytest.raises(ValueError, match="rerank_budget"):
        Planner(three_levels(), rerank_budget=0.0)


def test_hysteresis_holds_under_noise_and_follows_a_real_change():
    """Plan switches over 500 noisy rounds (costs +-20%): fewer than 5 in the median run (without hysteresis, 57-89
    in every one of 30 runs). The median over runs of several seeds, since one run's count is one draw of a spread
    (0-8 over 30 seeds) that any change to the rounds before it reshuffles."""
    def noisy(seed: int) -> tuple[Planner, Sim, int]:
        p = Planner(two_levels())
        sim = Sim(p, {1: linear_cost(0.02, 0.0005), 0: linear_cost(0.003, 0.0001)}, {(1, 0): 0.9}, noise=0.2,
                  seed=seed)
        sim.run(4, 50)
        switches, prev = 0, p.current
        for _ in range(500):
            sim.run(4, 1)
            switches += p.current != prev
            prev = p.current
        assert p.current.levels == (0, 1)
        return p, sim, switches

    runs = [noisy(seed) for seed in range(9)]
    assert sorted(n for _, _, n in runs)[4] < 5
    p, sim, _ = runs[0]
    sim.alpha[(1, 0)] = 0.1  # the drafter stops matching the target
    for _ in range(60):
        sim.run(4, 1)
        if p.current == p.plain:
            break
    assert p.current == p.plain


def test_a_decisive_gap_to_plain_switches_at_once_others_wait_for_patience():
    def planner_after(verify_seconds: float) -> tuple[Planner, list[Plan]]:
        p = Planner(two_levels(), k_choices=[4], explore_every=0, patience=3, warmup=0, hysteresis=0.05)
        for _ in range(20):  # plain: 0.1 s per round; the draft: accepted 2 of 4 on average
            p.on_call(1, "verify", 1, 1, 0.1)
            p.on_call(0, "propose", 1, 4, 0.004)
            p.on_call(1, "verify", 1, 5, verify_seconds)
            p.on_verify(1, 0, [4], [2])
        return p, [p.plan(1) for _ in range(4)]

    p, chosen = planner_after(1.0)  # the speculative plan is predicted ~3x slower than plain: switch now
    assert p.goodput(p.plain, 1) > 2 * p.goodput(p.default_plan, 1)
    assert chosen[0] == p.plain
    # the other way (speculation predicted far better than the held plain plan): its cost at this batch may be
    # an extrapolation, so patience still applies
    q = Planner(two_levels(), k_choices=[4], explore_every=0, patience=3, warmup=0, hysteresis=0.05)
    q._current = q.plain
    for _ in range(20):
        q.on_call(1, "verify", 1, 1, 0.1)
        q.on_call(0, "propose", 1, 4, 0.004)
        q.on_call(1, "verify", 1, 5, 0.11)
        q.on_verify(1, 0, [4], [4])
    assert q.goodput(q.default_plan, 1) > 2 * q.goodput(q.plain, 1)
    assert [q.plan(1) for _ in range(3)] == [q.plain, q.plain, q.default_plan]
    p, chosen = planner_after(0.37)  # ~0.8x of plain: noise-sized, so patience applies
    assert 1.05 < p.goodput(p.plain, 1) / p.goodput(p.default_plan, 1) < 2
    assert chosen[:2] == [p.default_plan] * 2 and chosen[2] == p.plain


def test_patience_counts_the_rounds_held_between_rankings():
    """Patience is in rounds: with rankings four rounds apart, a plan that led at two of them has led for five
    rounds and takes over at the second, not after three rankings (nine rounds) of the plan it beats."""
    def chosen(rerank_every: int) -> list[Plan]:
        q = Planner(two_levels(), k_choices=[4], explore_every=0, patience=3, warmup=0, hysteresis=0.05,
                    rerank_every=rerank_every, rerank_surprise=1.0)
        q._current = q.plain
        for _ in range(20):  # speculation predicted ~3x better than the held plain decoding
            q.on_call(1, "verify", 1, 1, 0.1)
            q.on_call(0, "propose", 1, 4, 0.004)
            q.on_call(1, "verify", 1, 5, 0.11)
            q.on_verify(1, 0, [4], [4])
        plans = [q.plan(1) for _ in range(10)]
        return [plan == q.default_plan for plan in plans]

    assert chosen(1).index(True) == 2  # every round ranked: the third ranking, three rounds
    assert chosen(4).index(True) == 4  # ranked at rounds 1 and 5: five rounds of the better plan leading


def test_a_held_plan_whose_price_falls_is_ranked_again_at_once(monkeypatch):
    """Between rankings the held plan is priced alone each round; fallen by `rerank_surprise` below the best it was
    priced at since it was chosen (a lookup whose copy ended, its drafts rejected round after round), it is ranked
    again at once, not after the rounds the cadence would hold it for: its K follows the falling acceptance, where
    without the wake the lookup's long K is held while its own price is below plain decoding's."""
    rankings = []
    explain = Planner.explain
    monkeypatch.setattr(Planner, "explain", lambda self, batch: rankings.append(batch) or explain(self, batch))

    def run(surprise: float) -> tuple[Planner, list[Plan], float]:
        """The plans of the 30 rounds after the copy ends, and the tokens per second those rounds really took."""
        levels = [Level("ngram", ngram=NgramConfig(3, 1, 3), k=4), Level("target", worker=_dummy("target"))]
        p = Planner(levels, k_max=8, explore_every=0, rerank_every=1000, rerank_surprise=surprise)
        sim = Sim(p, {1: linear_cost(0.1, 0.004)}, {(1, 0): 0.9})
        sim.run(1, 40)
        assert p.current == Plan((0, 1), (8,))  # copying: the lookup's longest K, held
        sim.alpha[(1, 0)] = 0.0  # the copy ends: every draft is rejected from here on
        rankings.clear()
        plans, tokens, seconds = [], 0, 0.0
        for _ in range(30):
            plans.append(p(1))
            n, dt = sim.round(plans[-1], 1)
            tokens, seconds = tokens + n, seconds + dt
        return p, plans, tokens / seconds

    p, after, woken = run(0.25)
    assert len(rankings) >= 3 and p.current.k[0] < 8
    p, after, held = run(1.0)  # without the wake: never ranked, K 8 held while priced below plain decoding
    assert rankings == [] and set(after) == {Plan((0, 1), (8,))}
    assert p.goodput(p.current, 1) < p.goodput(p.plain, 1)
    assert woken > 1.05 * held  # the shorter drafts cost less to verify
    with pytest.raises(ValueError, match="surprise"):
        Planner(two_levels(), rerank_surprise=0.0)


def test_switches_that_start_no_model_drafter_follow_the_ranking_at_once():
    """Patience guards switches that start or stop a model drafter (its cache catches up on every row first). A
    lookup's K, the lookup on or off, plain decoding: such switches cost nothing and follow the ranking on the
    round it changes, since holding the old K for `patience` rounds loses on text that moves between copying and
    not copying every few rounds."""
    levels = [Level("ngram", ngram=NgramConfig(8, 1, 3)), Level("mid", worker=_dummy("mid"), k=4),
              Level("target", worker=_dummy("target"))]
    p = Planner(levels, k_choices=[2, 8], explore_every=0, patience=3, warmup=0, hysteresis=0.05)
    p._current = p.plain
    for _ in range(20):  # the lookup's long drafts all accepted, its steps twice as dear as plain ones
        p.on_call(2, "verify", 1, 1, 0.1)
        p.on_call(2, "verify", 1, 9, 0.2)
        p.on_verify(2, 0, [8], [8])
        p.on_verify(2, 1, [4], [0])
    lookup8 = Plan((0, 2), (8,))
    assert p.explain(1)[0][0] == lookup8
    assert p.plan(1) == lookup8  # plain -> the lookup: at once
    for _ in range(60):  # the copy ended: each lookup draft rejected at its first token
        p.on_verify(2, 0, [8], [0])
    assert p.explain(1)[0][0] == p.plain
    assert p.plan(1) == p.plain  # and back, at once
    # a model drafter predicted far ahead: patience applies, as before
    for _ in range(20):
        p.on_verify(2, 1, [4], [4])
        p.on_call(1, "propose", 1, 4, 0.004)
        p.on_call(2, "verify", 1, 5, 0.1)
    best = p.explain(1)[0][0]
    assert 1 in best.levels
    assert [p.plan(1) for _ in range(3)] == [p.plain, p.plain, best]


def test_exploration_brings_a_level_back():
    p = Planner(two_levels(), explore_every=20)
    sim = Sim(p, {1: linear_cost(0.02, 0.0), 0: linear_cost(0.003, 0.0)}, {(1, 0): 0.05})
    sim.run(2, 80)
    assert p.current == p.plain
    sim.alpha[(1, 0)] = 0.9
    chosen = sim.run(2, 100)
    assert any(c.levels == (0, 1) for c in chosen[:25])  # a probe round measured it
    assert p.current.levels == (0, 1)


def test_exploration_probes_a_small_subset_of_a_large_batch():
    """At batch 16 a probe runs on `probe_batch` sequences; the others keep the held plan (no batch-wide
    catch-up prefill on a level the held plan does not use). At batch <= probe_batch nothing is split."""
    p = Planner(two_levels(), explore_every=10, probe_batch=2)
    sim = Sim(p, {1: linear_cost(0.02, 0.0), 0: linear_cost(0.003, 0.0)}, {(1, 0): 0.05})
    sim.run(16, 60)
    assert p.current == p.plain
    splits = []
    for _ in range(40):
        groups = p.plan_groups(16)
        assert sum(n for _, n in groups) == 16
        for plan, n in groups:
            sim.round(plan, n)
        if len(groups) > 1:
            splits.append(groups)
    assert splits, "no exploration round in 40 rounds with explore_every=10"
    for (probe, n_probe), (held, n_held) in splits:
        assert probe.levels == (0, 1) and n_probe == 2 and held == p.plain and n_held == 14
    for _ in range(40):
        assert len(p.plan_groups(2)) == 1


def test_plain_probe_runs_on_the_whole_batch():
    """Probing plain decoding needs no cache catch-up, and its cost must be measured at the batch it is for:
    while a speculative plan is held at batch 16, plain probes cover all 16 sequences."""
    p = Planner(two_levels(), explore_every=10, probe_batch=2)
    sim = Sim(p, {1: linear_cost(0.02, 0.0), 0: linear_cost(0.001, 0.0)}, {(1, 0): 0.95})
    sim.run(16, 60)
    assert p.current != p.plain
    plain_probes = 0
    for _ in range(60):
        groups = p.plan_groups(16)
        assert sum(n for _, n in groups) == 16
        for plan, n in groups:
            if plan == p.plain:
                assert groups == [(p.plain, 16)]
                plain_probes += 1
            sim.round(plan, n)
    assert plain_probes >= 1, "no plain probe in 60 rounds with explore_every=10"


def test_plain_is_measured_at_once_at_a_new_batch_bucket():
    """A CPU-like truth the linear fit cannot see: a 1-token row is a cheap matrix-vector product, a 5-token
    row pays full per-token cost. Speculation wins at batch 1; when the batch jumps to 16 the planner measures
    plain decoding on the whole batch in its second round there (the first carries the new requests'
    prefills), not after `explore_every` rounds of a plan priced off the fit, and drops speculation; only
    once per bucket."""
    cliff = lambda b, q: 0.1 + (0.001 * b if q == 1 else 0.02 * b * q)
    p = Planner(two_levels(), explore_every=1000, probe_batch=2)
    sim = Sim(p, {1: cliff, 0: lambda b, q: 0.003}, {(1, 0): 0.8})
    sim.run(1, 40)
    assert p.current != p.plain
    first = p.plan_groups(16)  # the round where the batch grew (its prefills): no probe yet
    assert first == [(p.current, 16)] and p.current != p.plain
    sim.round(p.current, 16)
    assert p.plan_groups(16) == [(p.plain, 16)]  # the next round at 16 is a plain probe on every sequence
    sim.round(p.plain, 16)
    chosen = sim.run(16, 15)
    assert p.current == p.plain and chosen[-1] == p.plain
    sim.run(1, 40)  # back to batch 1: speculation again; no new probe there (bucket 1 measured at start)
    assert p.current != p.plain
    assert all(plan != p.plain for plan in sim.run(1, 10))


def test_table_override_wins():
    table = [(2, 4, Plan((0, 1), (2,))), (5, 8, "none"), (9, 16, 3), (17, 32, "draft:6>target")]
    p = Planner(two_levels(), table=table)
    assert p(2) == Plan((0, 1), (2,))
    assert p(6) == p.plain and p.regime(6) == "none"
    assert p(10) == Plan((0, 1), (3,))
    assert p(20) == Plan((0, 1), (6,))
    # no entry: the planner, warming up on priors that favour the configured plan at small batch only
    assert p(1) == p.default_plan
    assert p(64) == p.plain
    with pytest.raises(ValueError):
        Planner(two_levels(), table=[(1, 2, "nosuch:3>target")])
    with pytest.raises(ValueError):
        Planner(two_levels(), table=[(1, 2, Plan((0,), ()))])


# ----- end to end on fake workers ---------------------------------------------------------------------------
def test_end_to_end_planner_switching_keeps_greedy_outputs():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]

    def levels() -> list[Level]:
        return [
            Level("ngram", ngram=NgramConfig(3, 1, 3)),
            Level("d", worker=FakeWorker("d", vocab=16, order=2, table_seed=0, noise=0.6, noise_seed=3), k=3),
            Level("target", worker=FakeWorker("target", vocab=16, order=2, table_seed=0),
                  method=VerifyMethod.GREEDY),
        ]

    plain = generate([levels()[-1]], prompts, max_tokens=60, ignore_eos=True)
    engine = CascadeEngine(levels())
    # no hysteresis and frequent probes, so the plan changes between rounds
    planner = Planner(engine.levels, k_max=5, hysteresis=0.0, patience=1, explore_every=3, decay=0.995)
    planner.attach(engine)
    rec = Recorder()
    engine.observers.append(rec)
    assert planner in engine.observers
    seqs = [engine.new_sequence(p, SamplingParams(temperature=0.0), 60) for p in prompts]
    used = set()
    while any(not s.finished for s in seqs):
        plan = planner(sum(not s.finished for s in seqs))
        used.add(plan)
        engine.step(seqs, plan)
    assert [s.output for s in seqs] == [r.token_ids for r in plain.results]
    assert len(used) > 1
    # the planner's estimate of alpha_1 approaches the acceptance the engine reported, per pair (an
    # n-gram row that drafted nothing while another row of its call did counts as a rejection; so does a shadow
    # lookup that found nothing: a round of the n-gram there would have emitted one token)
    checked = 0
    for (level, lower), calls in rec.calls.items():
        outcomes = []
        for lens, accepted, shadow in calls:
            for n, a in zip(lens, accepted):
                if n > 0:
                    outcomes.append(a >= 1)
                elif lower == 0 and (shadow or max(lens) > 0):
                    outcomes.append(False)
        if len(outcomes) >= 30:
            measured = sum(outcomes) / len(outcomes)
            assert planner.alphas(level, lower, 1)[0] == pytest.approx(measured, abs=0.1), (level, lower)
            checked += 1
    assert checked >= 1


class Recorder:
    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], list[tuple[list[int], list[int]]]] = {}

    def on_call(self, level, kind, batch, tokens, seconds) -> None:
        pass

    def on_verify(self, level, lower, draft_lens, accepted) -> None:
        self.calls.setdefault((level, lower), []).append((list(draft_lens), list(accepted), False))

    def on_shadow(self, level, lower, draft_lens, accepted, asked, latest=None) -> None:
        self.calls.setdefault((level, lower), []).append((list(draft_lens), list(accepted), True))


# ----- token trees (`Plan.tree`): a suffix level drafting trees is priced against its own chains -----


def tree_levels(width: int = 3) -> list[Level]:
    from specray.spec.suffix import SuffixConfig, SuffixDrafter

    sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=6, tree_width=width))
    return [Level("suffix", suffix=sx, k=6, tree_width=width), Level("target", worker=_dummy("target"))]


def tree_planner(per_token: float) -> Planner:
    p = Planner(tree_levels(), k_choices=(6,), decay=0.95, patience=2)
    p.costs[1] = StepCost(prior=(0.05, per_token, 0.0))  # the target: a fixed cost and a cost per token fed
    return p


def feed(p: Planner, walks, rounds: int = 30, chains: tuple[list[int], list[int]] | None = None) -> None:
    """Tree rounds (each row's `TreeWalk`), and chain rounds of the same pair if given."""
    for _ in range(rounds):
        p.on_call(1, "verify", len(walks), 7, 0.08)
        p.on_tree(1, 0, 3, walks)
        if chains is not None:
            p.on_call(1, "verify", len(chains[0]), 7, 0.08)
            p.on_verify(1, 0, *chains)


def test_tree_candidates_are_the_chain_and_the_configured_width_and_stay_few():
    p = tree_planner(0.001)
    assert set(p.candidates) == {p.plain, Plan((0, 1), (6,), tree=1), Plan((0, 1), (6,), tree=3)}
    many = Planner(tree_levels(), k_max=8)
    assert len(many.candidates) == 1 + 2 * 8  # widths {1, configured} per K: twice the chain candidates
    assert Planner(two_levels()).tree_acceptance == {}  # no suffix level: no tree candidates
    assert p.plan_name(Plan((0, 1), (6,), tree=3)) == "suffix:6/w3>target"
    assert p._parse("suffix:6/w3>target", 1) == Plan((0, 1), (6,), tree=3)


def test_a_wide_tree_whose_siblings_win_is_priced_above_its_chain_and_chosen():
    """Trees whose walk goes deep through siblings (accepted 4 of a reach of 5) while the chain along their
    first children stops after one token: the tree's E[L] and goodput beat the chain's, and the planner runs it."""
    from specray.coordinator.feed import TreeWalk

    p = tree_planner(0.001)
    feed(p, [TreeWalk(nodes=6, reach=5, accepted=4, spine=3, spine_accepted=1)] * 4)
    chain, tree = Plan((0, 1), (6,), tree=1), Plan((0, 1), (6,), tree=3)
    assert p.expected_length(tree, 4) > p.expected_length(chain, 4) + 2.0
    assert p.goodput(tree, 4) > p.goodput(chain, 4) > 0
    for _ in range(6):
        p.plan(4)
    assert p.current == tree


def test_a_tree_whose_siblings_rarely_win_is_priced_below_its_chain_and_not_chosen():
    """Trees shallow for their nodes (3 children per node leave depth 2 of 6 nodes) whose siblings never win:
    the chain of the same level, measured by its own rounds, goes deeper for the same cost: the planner runs
    chains. Fewer nodes fed make a tree round cheaper on a steep cost curve (its price reads the nodes fed)."""
    from specray.coordinator.feed import TreeWalk

    p = tree_planner(0.02)  # steep: a token fed costs 40% of the fixed cost
    walks = [TreeWalk(nodes=6, reach=2, accepted=1, spine=2, spine_accepted=1),
             TreeWalk(nodes=6, reach=2, accepted=2, spine=2, spine_accepted=2)]
    feed(p, walks, chains=([6, 6], [4, 5]))
    chain, tree = Plan((0, 1), (6,), tree=1), Plan((0, 1), (6,), tree=3)
    assert p.expected_length(tree, 2) < p.expected_length(chain, 2) - 1.0
    assert p.round_time(tree, 2) == pytest.approx(p.round_time(chain, 2))  # both feed 6 drafted tokens
    assert p.goodput(tree, 2) < p.goodput(chain, 2)
    for _ in range(6):
        p.plan(2)
    assert p.current == chain
    feed(p, [TreeWalk(nodes=2, reach=2, accepted=1, spine=2, spine_accepted=1)] * 2, rounds=80)
    assert p.tree_nodes[(1, 0, 3)] < 2.5 and p.round_time(tree, 2) < p.round_time(chain, 2)
    for _ in range(80):  # chain rounds that draft 2 tokens: priced at what they feed too
        p.on_verify(1, 0, [2, 1], [1, 1])
    assert p.tree_nodes[(1, 0, 1)] < 2.5 and p.round_time(tree, 2) == pytest.approx(p.round_time(chain, 2))


def test_tree_rounds_through_the_engine_feed_both_estimates():
    """Real tree rounds (a suffix level under a fake target): the planner's tree acceptance and node count for
    (target, suffix, 3) and, from the first children, the chain's acceptance of the pair are measured."""
    from tests.unit.test_tree_round import PROMPTS

    levels = [*tree_levels()[:1], Level("target", worker=FakeWorker("target", vocab=16, order=2, table_seed=0))]
    eng = CascadeEngine(levels)
    p = Planner(levels, k_choices=(6,)).attach(eng)
    generate(eng, PROMPTS, max_tokens=16, ignore_eos=True, plan=Plan((0, 1), (6,), tree=3))
    assert p.tree_acceptance[(1, 0, 3)].weight > 0 and p.acceptance[(1, 0)].weight > 0
    assert 1 <= p.tree_nodes[(1, 0, 3)] <= 6
    assert p.measurements.measured_at[(1, 0, 3)] == p.measurements.measured_at[(1, 0)]  # one round measures both


class _Clock:
    """A settable perf_counter for the planner's time budgets (its rankings take no CPU)."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now

    @staticmethod
    def thread_time() -> float:
        return 0.0


def _serve(p: Planner, sim: Sim, batch: int, rounds: int, catch_up: float, drafter: int = 0) -> tuple[float, float]:
    """`rounds` served rounds at `batch` on the simulated clock, the way the scheduler runs them: the groups of
    `plan_groups` one after the other, a group of a plan with the model drafter (`drafter`) that the held plan does
    not use paying `catch_up` seconds first (the drafter reads the probed rows' whole text: an untimed
    prefill no step measurement shows), then `on_round` with the round's wall time. Returns (seconds of
    all rounds, seconds of the rounds that probed a level)."""
    total = probing = 0.0
    for _ in range(rounds):
        groups = p.plan_groups(batch)
        held = p.current
        dt = 0.0
        for plan, n in groups:
            if drafter in plan.levels and drafter not in held.levels:
                dt += catch_up
            dt += sim.round(plan, n)[1]
        _Clock.now += dt
        p.on_round(batch, dt)
        total += dt
        if any(plan != held and len(plan.levels) > 1 for plan, _ in groups):
            probing += dt
    return total, probing


def test_exploration_cost_stays_within_its_budget_where_speculation_loses(monkeypatch):
    """At batch 8 where the drafter loses (plain held), probing it costs a round of its own plus the drafter's
    catch-up on the probed rows (3 s here against 0.1 s plain rounds). Every `explore_every` rounds that is
    ~60% of the time on top of serving; with `explore_budget=0.05` the probes' extra time stays within ~5% of
    the time served, and the probes still happen (a switched-off level can come back)."""
    import specray.policy.planner as planner_mod

    monkeypatch.setattr(planner_mod, "time", _Clock)
    truth = {1: lambda b, q: 0.1 * q, 0: lambda b, q: 0.01 * b}  # verification pays per token: drafts lose at b=8
    shares = {}
    for budget in (None, 0.05):
        _Clock.now = 0.0
        p = Planner(two_levels(), k_choices=[4], explore_every=10, warmup=0, explore_budget=budget)
        sim = Sim(p, truth, {(1, 0): 0.3})
        _serve(p, sim, 8, 30, catch_up=3.0)  # learns that plain wins here
        assert p.current == p.plain
        total, probing = _serve(p, sim, 8, 600, catch_up=3.0)
        plain_time = 600 * p.round_time(p.plain, 8)
        shares[budget] = (total - plain_time) / plain_time, probing
    assert shares[None][0] > 0.3  # unbounded: the probes cost a third of the serving time or more
    assert shares[0.05][0] < 0.08 and shares[0.05][1] > 0  # bounded, and still probing


def test_a_short_burst_at_a_new_batch_size_is_not_taxed_by_a_probe(monkeypatch):
    """A probe on a few rows measures the same acceptance at any batch, so one taken in the first seconds at a
    batch size rarely served (a load peak; a benchmark's short wave) buys nothing that waiting would not: the
    budget counts the seconds served at the batch's bucket. Without a budget the planner probes there; with one
    it still probes where it serves long, including a batch that keeps crossing a bucket boundary (4 <-> 5)."""
    import specray.policy.planner as planner_mod

    monkeypatch.setattr(planner_mod, "time", _Clock)
    truth = {1: lambda b, q: 0.1 * q, 0: lambda b, q: 0.01 * b}
    probes = {}
    for budget in (None, 0.05):
        _Clock.now = 0.0
        p = Planner(two_levels(), k_choices=[4], explore_every=10, warmup=0, explore_budget=budget)
        sim = Sim(p, truth, {(1, 0): 0.3})
        _, at_one = _serve(p, sim, 1, 300, catch_up=1.0)  # 30 s at batch 1: plain held, probes spent there
        assert p.current == p.plain and at_one > 0
        _, burst = _serve(p, sim, 8, 30, catch_up=1.0)  # a 3-second burst at batch 8
        probes[budget] = burst
        crossing = sum(_serve(p, sim, b, 1, catch_up=1.0)[1] for _ in range(400) for b in (4, 5))
        assert crossing > 0
    assert probes[None] > 0
    assert probes[0.05] == 0


def test_explore_budget_is_checked():
    with pytest.raises(ValueError, match="explore_budget"):
        Planner(two_levels(), explore_budget=0.0)
    with pytest.raises(ValueError, match="explore_budget"):
        Planner(two_levels(), explore_budget=1.5)


def test_the_margin_weighs_only_the_extra_time_a_speculative_round_takes():
    """A draft verified at the cost of a plain step (a step flat in the tokens it feeds) cannot lose to plain
    decoding: a round yields at least one token either way. `margin` then asks nothing of it, and a small predicted
    gain (E[L] ~1.06) is taken. A round that takes half again a plain one must win by the whole margin: a gain
    below it stays with plain decoding."""
    def planner(verify_seconds: float, accepted: Callable[[int], list[int]]) -> Planner:
        levels = [Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("target", worker=_dummy("target"))]
        p = Planner(levels, k_choices=[4], explore_every=0, patience=1, warmup=0, hysteresis=0.0, margin=0.1)
        for i in range(40):
            p.on_call(1, "verify", 4, 1, 0.1)  # plain: 0.1 s a round
            p.on_call(1, "verify", 4, 5, verify_seconds)
            p.on_verify(1, 0, [4] * 4, accepted(i))
        return p

    flat = planner(0.1, lambda i: [1, 0, 0, 0] if i % 4 == 0 else [0] * 4)  # one row in 16 accepts a token
    assert 1.02 < flat.goodput(flat.default_plan, 4) / flat.goodput(flat.plain, 4) < 1.1
    assert [flat.plan(4) for _ in range(3)][-1] == flat.default_plan
    slow = planner(0.15, lambda i: [2, 1, 0, 0] if i % 4 == 0 else [1, 1, 0, 0])
    ratio = slow.goodput(slow.default_plan, 4) / slow.goodput(slow.plain, 4)
    extra = slow.round_time(slow.default_plan, 4) / slow.round_time(slow.plain, 4) - 1.0
    assert 0.4 < extra < 0.6 and 1.0 < ratio < 1.05  # wins, by less than the margin asks
    assert [slow.plan(4) for _ in range(3)][-1] == slow.plain


def test_a_margin_keeps_plain_decoding_where_speculation_is_predicted_to_win_by_less():
    """`margin=0.1`: a speculative plan predicted to beat plain decoding by ~5% (near break-even, where an acceptance
    measured on other rows errs by more than that) does not replace it, nor is it kept over plain; one predicted
    to win by far more is chosen as before."""
    def planner(margin: float, verify_seconds: float) -> Planner:
        p = Planner(two_levels(), k_choices=[4], explore_every=0, patience=1, warmup=0, hysteresis=0.0,
                    margin=margin)
        for _ in range(30):  # plain: 0.1 s per round; the draft: 4 proposed, 1 accepted on average -> E[L] ~2
            p.on_call(1, "verify", 4, 1, 0.1)
            p.on_call(0, "propose", 4, 4, 0.0)
            p.on_call(1, "verify", 4, 5, verify_seconds)
            p.on_verify(1, 0, [4] * 4, [1, 1, 1, 1])
        return p

    for margin in (0.0, 0.1):
        p = planner(margin, 0.19)  # E[L] 2 in 0.19 s: ~5% above plain
        gain = p.goodput(p.default_plan, 4) / p.goodput(p.plain, 4)
        assert 1.02 < gain < 1.08
        chosen = [p.plan(4) for _ in range(3)]
        assert chosen[-1] == (p.default_plan if margin == 0.0 else p.plain)
        p._current = p.default_plan  # held from a smaller batch: the margin also lets it go
        assert [p.plan(4) for _ in range(2)][-1] == (p.default_plan if margin == 0.0 else p.plain)
    p = planner(0.1, 0.1)  # E[L] 2 at plain's round time: ~2x
    assert [p.plan(4) for _ in range(3)][-1] == p.default_plan
    with pytest.raises(ValueError, match="margin"):
        Planner(two_levels(), margin=-0.1)


def test_growing_into_a_bucket_where_plain_is_measured_to_win_drops_the_held_plan_at_once():
    """The batch grows from 1 to 4 (a wave of requests joins) while a speculative plan chosen at batch 1 is held.
    Plain decoding is measured at batch 4 and predicted ~1.4x better there (not `decisive`): the planner takes
    it on the first round at 4 instead of holding the drafter's plan for `patience` rounds -- rounds that would make
    the drafter catch up on every new row's prompt only to lose. Shrinking back keeps the usual patience."""
    p = Planner(two_levels(), k_choices=[4], explore_every=0, patience=3, warmup=0, hysteresis=0.05)
    for _ in range(20):
        for b, plain_s, spec_s in ((1, 0.1, 0.12), (4, 0.12, 0.5)):
            p.on_call(1, "verify", b, 1, plain_s)
            p.on_call(0, "propose", b, 4, 0.004)
            p.on_call(1, "verify", b, 5, spec_s)
            p.on_verify(1, 0, [4] * b, [2] * b)
    assert [p.plan(1) for _ in range(3)][-1] == p.default_plan
    assert 1.1 < p.goodput(p.plain, 4) / p.goodput(p.default_plan, 4) < 2
    assert p.plan(4) == p.plain
    assert [p.plan(1) for _ in range(3)] == [p.plain, p.plain, p.default_plan]  # back at 1: patience as before


def test_a_cheap_probe_does_not_erase_what_a_drafter_probe_costs():
    """Each level's probe is priced at what its own latest probe round took beyond the held plan: a cheap n-gram
    probe (1.9 s extra) after a mid-model probe that had to catch up (60 s extra, on the planner's prior step costs)
    leaves the next mid probe priced at 60 s -- it waits for 1200 s served at the bucket with a 5% budget -- while the
    n-gram's may run after 50 s."""
    p = Planner(three_levels(), k_choices=[4], explore_every=10, warmup=0, explore_budget=0.05)
    mid, ngram = Plan((1, 2), (4,)), Plan((0, 2), (4,))
    for probe, seconds in ((mid, 60.1), (ngram, 2.0)):  # two probe rounds at batch 8, held round predicted 0.1 s
        p.exploration.pending = (0.1, p.pricing.pairs(probe))
        p.on_round(8, seconds)
    p.on_round(8, 50.0)  # then 50 s of rounds at batch 8
    assert p.round_time(ngram, 2) < 2.5 and p.round_time(mid, 2) < 2.5  # what the step fits alone predict
    held, explore = p.current, p.exploration
    assert explore.affordable(ngram, 8, held, None) and not explore.affordable(mid, 8, held, None)
    p.on_round(8, 1150.0)
    assert explore.affordable(mid, 8, held, None)



def test_a_drafter_probe_is_priced_with_its_catch_up_on_the_probed_rows():
    """Before a drafter's probe was ever measured, its price includes catching up on the probed rows' share of the
    backlog: the first 0.5B probe at 4 requests took ~1 s where its round alone was predicted at 0.27 s."""
    from specray.coordinator.state import Backlog

    p = Planner(two_levels(), k_choices=[4], explore_every=10, warmup=0, explore_budget=0.02)
    probe = Plan((0, 1), (4,))
    for _ in range(10):
        p.on_call(1, "verify", 8, 1, 0.1)
        p.on_call(1, "verify", 2, 5, 0.12)
        p.on_call(0, "propose", 2, 4, 0.04)
    p.on_catch_up(0, "propose", 1, 1, 1000, 1.0)  # the drafter catches up at ~1 ms per token
    p.on_round(8, 50.0)  # 50 s served at batch 8: 1 s of budget
    assert p.round_time(probe, 2) < 0.5
    # 1000 tokens per row to catch up on: 2 s for two probed rows
    assert not p.exploration.affordable(probe, 8, p.current, Backlog({0: 8 * 1000}, 8 * 32))
    # rows the drafter kept up with: its round alone
    assert p.exploration.affordable(probe, 8, p.current, Backlog({}, 8 * 32))

# ----- a model level's token trees (`Level.tree`): priced per depth, against the same level's chains -----


def model_tree_levels(shape: TreeShape | None = None) -> list[Level]:
    shape = shape or TreeShape(3, 4, 12)
    return [Level("draft", worker=_dummy("draft"), k=4, tree=shape), Level("target", worker=_dummy("target"))]


def model_tree_planner(draft_per_token: float = 0.0005, target_per_token: float = 0.001) -> Planner:
    p = Planner(model_tree_levels(), k_choices=(4,), decay=0.95, patience=2, warmup=0)  # no drafter calls fed
    p.costs[0] = StepCost(prior=(0.005, draft_per_token, 0.0))  # the drafter: a fixed cost and a cost per token fed
    p.costs[1] = StepCost(prior=(0.05, target_per_token, 0.0))
    return p


def feed_model_trees(p: Planner, walks, rounds: int = 30) -> None:
    """Model tree rounds (each row's `TreeWalk`; the chain along the first children feeds the chain's acceptance)."""
    for _ in range(rounds):
        p.on_call(1, "verify", len(walks), max(w.nodes for w in walks) + 1, 0.08)
        p.on_tree(1, 0, 3, walks)


def test_model_tree_candidates_names_and_cascades():
    """A model level with a tree shape directly below a tree-verifying target: its plans are candidates as chains
    and as trees of the configured width (no more), the configured plan drafts trees, and 'draft:4/w3>target'
    round-trips. A model level with a tree in the middle of a cascade gets tree candidates only where it drafts
    directly for the target."""
    p = model_tree_planner()
    chain, tree = Plan((0, 1), (4,), tree=1), Plan((0, 1), (4,), tree=3)
    assert set(p.candidates) == {p.plain, chain, tree}
    assert p.default_plan == tree and p.pricing.width(Plan((0, 1), (4,)), 0) == 3  # tree=0: the level's own width
    assert p.plan_name(tree) == "draft:4/w3>target" and p._parse("draft:4/w3>target", 1) == tree
    assert p._parse(p.plan_name(chain), 1) == chain
    assert p.tree_acceptance.keys() == {(1, 0, 3)}
    assert Planner(model_tree_levels(TreeShape(1, 4))).tree_acceptance == {}  # width 1: chains only
    lv = [Level("ngram", ngram=NgramConfig(3, 1, 3)),
          Level("mid", worker=_dummy("mid"), k=4, tree=TreeShape(2)), Level("target", worker=_dummy("target"))]
    q = Planner(lv, k_choices=(2, 4))
    assert {c for c in q.candidates if c.tree} == {Plan((1, 2), (k,), tree=t) for k in (2, 4) for t in (1, 2)}
    assert len(q.candidates) == len(Planner(three_levels(), k_choices=(2, 4)).candidates) + 2


def test_model_tree_proposal_is_priced_per_depth_and_verification_at_its_nodes():
    """P(tree) = sum over depths of T_d(B, tokens fed there) (1, then min(w d, N)); the target's forward feeds the
    tree's nodes + 1 (the node budget until measured, then the measured largest tree); the chain is K steps of one
    token and a K + 1 verification. Both are priced on the scalar path, identically in the ranking."""
    p = model_tree_planner()
    chain, tree = Plan((0, 1), (4,), tree=1), Plan((0, 1), (4,), tree=3)
    b = 4
    propose = sum(p.step_time(0, b, q) for q in (1, 3, 6, 9))
    assert p.round_time(tree, b) == pytest.approx(propose + p.step_time(1, b, 13))
    assert p.round_time(chain, b) == pytest.approx(4 * p.step_time(0, b, 1) + p.step_time(1, b, 5))
    feed_model_trees(p, [TreeWalk(nodes=7, reach=2, accepted=1, spine=4, spine_accepted=1, depth=4)] * b, rounds=60)
    assert p.round_time(tree, b) == pytest.approx(propose + p.step_time(1, b, 8), rel=0.02)
    ranked = dict(p.explain(b))
    assert ranked[tree] == p.goodput(tree, b) and ranked[chain] == p.goodput(chain, b)
    shallow = Planner(model_tree_levels(TreeShape(2, 2)), k_choices=(4,))  # the shape's own depth, not K
    assert shallow.pricing._elen(1, 0, 4, 2) == shallow.tree_acceptance[(1, 0, 2)].expected_length(2)
    assert shallow.pricing._propose_tree(0, 1, 4, 2) == pytest.approx(shallow.step_time(0, 1, 1)
                                                                      + shallow.step_time(0, 1, 2))


def test_a_model_tree_whose_siblings_win_is_priced_above_its_chain_and_chosen():
    """Trees whose walk goes the whole depth through siblings while the first children's chain stops after one
    token: the tree's E[L] and goodput beat the chain's (a cheap drafter, a flat target), and the planner runs it."""
    p = model_tree_planner()
    feed_model_trees(p, [TreeWalk(nodes=12, reach=4, accepted=4, spine=4, spine_accepted=1, depth=4)] * 4)
    chain, tree = Plan((0, 1), (4,), tree=1), Plan((0, 1), (4,), tree=3)
    assert p.expected_length(tree, 4) > p.expected_length(chain, 4) + 2.0
    assert p.goodput(tree, 4) > p.goodput(chain, 4) > 0
    p._current = chain
    for _ in range(6):
        p.plan(4)
    assert p.current == tree


def test_a_model_tree_whose_siblings_never_win_is_not_chosen():
    """Trees whose accepted path is always the first children's (siblings never win): the same E[L] as the chain,
    for more tokens fed at each depth and in the verification: the chain wins and runs."""
    p = model_tree_planner(target_per_token=0.005)
    feed_model_trees(p, [TreeWalk(nodes=12, reach=3, accepted=2, spine=4, spine_accepted=2, depth=4),
                         TreeWalk(nodes=12, reach=4, accepted=4, spine=4, spine_accepted=4, depth=4)])
    chain, tree = Plan((0, 1), (4,), tree=1), Plan((0, 1), (4,), tree=3)
    assert p.expected_length(tree, 2) == pytest.approx(p.expected_length(chain, 2), rel=0.05)
    assert p.round_time(tree, 2) > p.round_time(chain, 2)
    assert p.goodput(tree, 2) < p.goodput(chain, 2)
    p._current = tree
    for _ in range(6):
        p.plan(2)
    assert p.current == chain


def test_an_expensive_model_tree_proposal_is_measured_and_not_chosen():
    """Siblings win, but the drafter's tree proposals are measured slow (wide forwards on a steep drafter): the
    timed proposals feed the drafter's curve at the sizes they fed, the tree's price rises past its gain, and the
    planner leaves trees for chains; the drafter's one-token steps stay priced as measured."""
    p = model_tree_planner()
    feed_model_trees(p, [TreeWalk(nodes=12, reach=4, accepted=4, spine=4, spine_accepted=1, depth=4)] * 4)
    chain, tree = Plan((0, 1), (4,), tree=1), Plan((0, 1), (4,), tree=3)
    assert p.goodput(tree, 4) > p.goodput(chain, 4)
    p._current = tree
    for _ in range(40):
        p.on_call(0, "propose", 4, 4, 4 * 0.006)  # chain steps: 6 ms each
        p.on_propose_tree(0, 4, 4, 3, 12, 0.006 + 3 * 0.2)  # a tree call: 4 forwards, the wide ones 200 ms
        p.on_call(1, "verify", 4, 13, 0.08)
        p.on_call(1, "verify", 4, 5, 0.07)
    assert p.round_time(tree, 4) > p.round_time(chain, 4) + 0.3
    assert p.step_time(0, 4, 1) < 0.05  # chain steps are not priced at a tree's forwards
    assert p.goodput(tree, 4) < p.goodput(chain, 4)
    for _ in range(6):
        p.plan(4)
    assert p.current == chain



def test_a_lookup_is_priced_by_whether_the_rows_last_draft_was_accepted_whole():
    """Code at T 0.7 moves between copying and writing every few rounds. One acceptance over both held K at 4 into
    copies (a K 4 round emitted 5 tokens seven rounds in a row). Split by the row's state after its previous round
    (its whole draft accepted: a copy under way), the planner drafts long while a copy runs and short after a miss,
    between rankings too; after a round that did not draft, the acceptance over all rows prices the lookup again."""
    def planner() -> Planner:
        levels = [Level("ngram", ngram=NgramConfig(8, 1, 4)), Level("target", worker=_dummy("target"))]
        p = Planner(levels, k_max=8, warmup=0, explore_every=0, patience=1, hysteresis=0.0)
        p.costs[1] = StepCost(prior=(0.1, 0.01, 0.0))  # a step grows by a tenth per token fed
        return p

    def verify(p: Planner, k: int, accepted: int) -> None:
        p.on_call(1, "verify", 1, k + 1, 0.1 + 0.01 * (k + 1))
        p.on_verify(1, 0, [k], [accepted])

    p = planner()
    for _ in range(12):  # a copy of four rounds (the last one partly accepted), then five of writing
        for accepted in (8, 8, 8, 3, 0, 1, 0, 0, 0):
            verify(p, 8, accepted)
    m = p.measurements
    assert m.hot[(1, 0)].expected_length(8) > 6.0 > 3.0 > m.cold[(1, 0)].expected_length(8)
    verify(p, 8, 8)
    assert m.hot_share((1, 0)) == 1.0 and p.plan(1) == Plan((0, 1), (8,))
    verify(p, 8, 0)
    short = p.plan(1)
    assert m.hot_share((1, 0)) == 0.0 and short.levels == (0, 1) and short.k[0] <= 4  # copies start from a miss
    p.on_call(1, "verify", 1, 1, 0.11)  # the plain round: no row state, the acceptance over all rows
    assert m.hot_share((1, 0)) is None
    assert p.expected_length(Plan((0, 1), (8,)), 1) == pytest.approx(m.acceptance[(1, 0)].expected_length(8))

    held = planner()  # ranking rarely (`rerank_every`): the held plan's K follows the state between rankings
    held.cadence.rerank_every = 1000
    for _ in range(12):
        for accepted in (8, 8, 8, 3, 0, 1, 0, 0, 0):
            verify(held, 8, accepted)
            held.plan(1)
    verify(held, 8, 8)
    assert held.plan(1) == Plan((0, 1), (8,)) and held.last_reason == "hold"
    verify(held, 8, 0)
    assert held.plan(1).k[0] <= 4 and held.last_reason == "hold"

    one = planner()
    one.measurements.hot_share = lambda pair: None  # one acceptance over both states
    for _ in range(12):
        for accepted in (8, 8, 8, 3, 0, 1, 0, 0, 0):
            verify(one, 8, accepted)
    ks = []
    for accepted in (8, 0):
        verify(one, 8, accepted)
        ks.append(one.plan(1).k[0])
    assert abs(ks[0] - ks[1]) <= 1, ks  # about the same K whatever the row's state
