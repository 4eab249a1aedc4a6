"""The planner's ranking priced in one vectorised pass (`specray.policy.chains`) and its cheaper cost fit give the
same numbers -- hence the same plans -- as pricing every candidate one by one through `Pricing.goodput` and
solving each active set of the fit on its own."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from specray.coordinator.cascade import Level, Plan
from specray.policy.cost import Acceptance, StepCost, linear_cost
from specray.policy.planner import Planner
from specray.policy.ranking import Ranking
from tests.unit.test_planner import Sim, _dummy, three_levels, two_levels


def three_models() -> list[Level]:
    return [Level("small", worker=_dummy("small"), k=4), Level("mid", worker=_dummy("mid"), k=4),
            Level("target", worker=_dummy("target"))]


class OneByOneRanking(Ranking):
    """The reference ranking: every candidate priced by `goodput`, ranked by Python's sort."""

    def scores(self, batch: int, held: Plan):
        extras = [p for p in dict.fromkeys((held, self.default_plan)) if p not in self.index]
        plans = [*self.candidates, *extras]
        return plans, np.array([self.pricing.goodput(p, batch) for p in plans]), {p: i for i, p in enumerate(plans)}

    def goodput(self, plan: Plan, batch: int, held: Plan) -> float:
        return self.pricing.goodput(plan, batch)

    def explain(self, batch_size: int, held: Plan) -> list[tuple[Plan, float]]:
        plans, gp, _ = self.scores(max(1, batch_size), held)
        return sorted(zip(plans, gp.tolist()), key=lambda x: (-x[1], len(x[0].levels), sum(x[0].k)))


class OneByOne(Planner):
    """The reference planner: its ranking is `OneByOneRanking`."""

    def __init__(self, levels: list[Level], **kw) -> None:
        super().__init__(levels, **kw)
        self.ranking = OneByOneRanking(self.pricing, self.names, self.plain, self.default_plan)


class Lockstep:
    """Feeds one simulated engine's events to both planners and checks, every round, that they choose the same
    plan and rank every candidate with the same goodput."""

    def __init__(self, fast: Planner, ref: Planner) -> None:
        self.fast, self.ref = fast, ref
        self.top, self.is_ngram = fast.top, fast.is_ngram
        self.rounds = 0

    def __call__(self, batch: int) -> Plan:
        ranked = self.fast.explain(batch)
        assert ranked == self.ref.explain(batch)  # plans, order and goodputs, bit for bit
        plan = self.fast(batch)
        assert plan == self.ref(batch)
        assert (self.fast.current, self.fast._streak) == (self.ref.current, self.ref._streak)
        self.rounds += 1
        return plan

    def on_call(self, *args) -> None:
        self.fast.on_call(*args)
        self.ref.on_call(*args)

    def on_verify(self, *args) -> None:
        self.fast.on_verify(*args)
        self.ref.on_verify(*args)


CASES = {
    # levels, true step-time curves, true acceptance, overlap (None: off, else bounded?)
    "draft": (two_levels, {1: linear_cost(0.1, 0.004), 0: linear_cost(0.01, 0.0004)}, {(1, 0): 0.8}, None),
    "cascade": (three_models, {2: linear_cost(0.015, 0.0001, 0.0002), 1: linear_cost(0.008, 0.0001),
                               0: linear_cost(0.003, 0.00005)}, {(2, 1): 0.8, (2, 0): 0.6, (1, 0): 0.75}, None),
    "ngram+hybrid": (three_levels, {2: linear_cost(0.1, 0.004), 1: linear_cost(0.01, 0.0004)},
                     {(2, 0): 0.7, (2, 1): 0.8, (1, 0): 0.6}, None),
    "cascade+overlap": (three_models, {2: linear_cost(0.015, 0.0001), 1: linear_cost(0.008, 0.0001),
                                       0: linear_cost(0.003, 0.00005)}, {(2, 1): 0.8, (2, 0): 0.6, (1, 0): 0.75},
                        False),
    "draft+bounded": (two_levels, {1: linear_cost(0.015, 0.0001), 0: linear_cost(0.006, 0.0001)}, {(1, 0): 0.8},
                      True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vectorised_ranking_chooses_as_pricing_one_by_one(case):
    levels, truth, alpha, overlap = CASES[case]
    kw = dict(k_max=6, rerank_every=1, explore_every=12)
    fast, ref = Planner(levels(), **kw), OneByOne(levels(), **kw)
    for p in (fast, ref):
        p.overlap, p.bounded = overlap is not None, bool(overlap)
    both = Lockstep(fast, ref)
    sim = Sim(both, truth, alpha, noise=0.3, seed=7)
    rng = random.Random(3)
    for _ in range(12):
        sim.run(rng.choice([1, 2, 3, 8, 17, 64]), rng.randint(3, 12))
    assert both.rounds >= 36
    # the table did the ranking: its goodputs are covered for every chain candidate, except overlapped ones
    gp, covered = fast.ranking.chains.goodputs(fast.pricing, 4)
    chains = [i for i, p in enumerate(fast.candidates) if not p.hybrid and len(p.levels) > 1]
    assert covered[chains].all() if overlap is None else not covered[chains].any()
    assert all(gp[i] == fast.goodput(fast.candidates[i], 4) for i in chains if covered[i])


def _reference_fit(c: StepCost, prior: tuple[float, float, float]) -> tuple[float, float, float]:
    """The constrained least squares solved one active set at a time."""
    p, A, v, wx = np.array(prior), np.array(c._A), np.array(c._v), np.array(c._wx)
    denom = float(wx @ p)
    ref = p * (c._wt / denom) if denom > 0 else p
    m = np.maximum(np.diag(A) / c._w, 1e-12)
    lam = c.ridge * c._w
    H = A + lam * np.diag(m)
    g = v + lam * m * ref
    best, best_val = np.zeros(3), 0.0
    for r in range(1, 4):
        for free in itertools.combinations(range(3), r):
            idx = list(free)
            try:
                sol = np.linalg.solve(H[np.ix_(idx, idx)], g[idx])
            except np.linalg.LinAlgError:
                continue
            if np.any(sol < -1e-15):
                continue
            theta = np.zeros(3)
            theta[idx] = np.maximum(sol, 0.0)
            val = float(theta @ H @ theta - 2.0 * theta @ g)
            if val < best_val:
                best, best_val = theta, val
    return (float(best[0]), float(best[1]), float(best[2]))


def test_step_cost_fit_equals_solving_each_active_set_alone():
    rng = np.random.default_rng(5)
    fits = 0
    for _ in range(300):
        c = StepCost(tuple(rng.random(3) * 10 ** rng.uniform(-4, 0, 3)), decay=float(rng.uniform(0.7, 1.0)))
        a, b, s = rng.random(3) * 10 ** rng.uniform(-5, -1, 3)
        for _ in range(int(rng.integers(1, 10))):
            batch, q = int(rng.integers(1, 128)), int(rng.integers(1, 18))
            t = (a + b * batch * q + s * batch) * rng.uniform(0.5, 1.5) + rng.normal(0, 1e-3)
            c.observe(batch, q, max(0.0, float(t)))
            assert c.coefficients == _reference_fit(c, c.prior)
            fits += 1
    # a fit in which some active sets are singular (one batch size and one q: the features are collinear)
    c = StepCost((0.01, 0.001, 0.0))
    for _ in range(3):
        c.observe(4, 1, 0.02)
    assert c.coefficients == _reference_fit(c, c.prior)
    assert c.predict_many(4, np.array([1, 2, 9, 4])).tolist() == [c.predict(4, q) for q in (1, 2, 9, 4)]
    assert fits > 300


def test_expected_lengths_are_expected_length_per_k():
    acc = Acceptance(0.4, k_max=12)
    acc.observe([8, 8, 3, 12], [2, 8, 3, 5])
    acc.observe([0, 5], [0, 1], proposed=5)
    assert acc.expected_lengths(16) == [acc.expected_length(k) for k in range(1, 17)]


def test_acceptance_counts_equal_a_row_by_row_update():
    """`Acceptance.observe` adds the rows' prefix counts position by position: the same floats as adding 1.0 row by
    row (decayed counts are not integers, so adding a row count at once would round differently)."""
    rng = random.Random(11)
    acc = Acceptance(0.5, decay=0.83, k_max=8)
    trials, successes = np.zeros(8), np.zeros(8)
    for _ in range(200):
        batch = rng.choice([1, 3, 64])
        lens = [rng.randint(0, 10) for _ in range(batch)]
        accepted = [rng.randint(0, n) for n in lens]
        proposed = rng.choice([None, 0, 5, 12])
        gap = rng.choice([1.0, 3.0])
        acc.observe(lens, accepted, gap=gap, proposed=proposed)
        f = 0.83 ** gap
        trials *= f
        successes *= f
        for n, a in zip(lens, accepted):
            n = min(n, 8)
            a = min(a, n)
            if proposed is not None and a == n < min(proposed, 8):
                trials[: n + 1] += 1.0
                successes[:n] += 1.0
            elif n > 0:
                trials[: min(a + 1, n)] += 1.0
                successes[:a] += 1.0
        assert acc.trials.tolist() == trials.tolist() and acc.successes.tolist() == successes.tolist()
    assert acc.alphas(12)[:3] != [acc.pooled] * 3


def test_overhead_bench_reports_the_planners_own_cpu():
    """bench_overhead.py times the planner's hooks in the coordinator's thread (the number its README table gives)."""
    from specray.testing.sim import StepCostModel
    from tests._bench import load_bench

    b = load_bench("bench_overhead")
    tiny = StepCostModel(0.002, 0.0)
    specs = tuple(b.LevelSpec(s.name, s.noise, s.noise_seed, step_cost=tiny, order=2) for s in b.PRESET_LEVELS["gpu"])
    client = b.ClientLog()
    backend = b.InprocBackend(specs, 4, client)
    r = b.measure(backend, client, "gpu", "cascade", batch=1, max_tokens=8, overlap=False, k=4, warmup_tokens=4,
                  planner=(4, "b0.01"))
    pl = r["planner"]
    assert pl["calls"]["plan"] == r["rounds"] and pl["calls"]["on_call"] >= r["rounds"]
    assert set(pl["cpu_ms_per_round_by_hook"]) >= {"plan", "on_call"}
    assert pl["cpu_ms_per_round"] == pytest.approx(sum(pl["cpu_ms_per_round_by_hook"].values()))
    assert 0 < pl["cpu_ms_per_round"] < 1000 * r["wall_s"] / r["rounds"]


@pytest.mark.parametrize("native", [dict(engine_verify=3, live_decode=True), dict(native_k=2, engine_verify=4)])
def test_vectorised_ranking_on_a_target_verifying_in_its_engine(native):
    """A target that verifies drafts on its engine's decode path (`engine_verify`), with or without speculation of its
    own: the table prices verification in engine steps as `_verify_time` does, and every ranking stays bit for bit."""

    def levels() -> list[Level]:
        return [Level("small", worker=_dummy("small"), k=4), Level("mid", worker=_dummy("mid"), k=4),
                Level("target", worker=_dummy("target"), **native)]

    fast, ref = Planner(levels(), k_max=7), OneByOne(levels(), k_max=7)
    rng = random.Random(2)
    for _ in range(60):
        batch = rng.choice([1, 4, 16])
        for p in (fast, ref):
            assert p.native_cost is not None and p.engine_verify
        events = [("on_call", (0, "propose", batch, 4, 0.002 * rng.uniform(0.8, 1.2) * 4)),
                  ("on_call", (1, "verify", batch, 5, 0.006 * rng.uniform(0.8, 1.2))),
                  ("on_call", (2, rng.choice(["native", "verify"]), batch, rng.randint(1, 5),
                               0.012 * rng.uniform(0.8, 1.2))),
                  ("on_verify", (2, rng.choice([0, 1]), [4] * batch, [rng.randint(0, 4) for _ in range(batch)])),
                  ("on_verify", (1, 0, [4] * batch, [rng.randint(0, 4) for _ in range(batch)]))]
        for name, args in events:
            getattr(fast, name)(*args)
            getattr(ref, name)(*args)
        assert fast.explain(batch) == ref.explain(batch)
        assert fast(batch) == ref(batch)
    gp, covered = fast.ranking.chains.goodputs(fast.pricing, 4)
    assert covered.sum() == len(fast.candidates) - 1  # every chain; plain decoding is priced on its own


def test_ranking_with_token_tree_candidates_matches_one_by_one():
    """A suffix level drafting token trees: its pairs are priced at the tokens fed (the scalar path), the ranking
    still equals the one-by-one one, and the table leaves exactly those pairs out."""
    from specray.coordinator.feed import TreeWalk
    from tests.unit.test_planner import tree_levels

    fast, ref = Planner(tree_levels(), k_max=6), OneByOne(tree_levels(), k_max=6)
    assert fast.tree_acceptance
    rng = random.Random(4)
    for _ in range(40):
        batch = rng.choice([1, 2, 4])
        seconds = 0.05 * rng.uniform(0.9, 1.1)
        walks = [TreeWalk(nodes=6, reach=rng.randint(1, 6), accepted=rng.randint(0, 3), spine=3,
                          spine_accepted=rng.randint(0, 3)) for _ in range(batch)]
        accepted = [rng.randint(0, 6) for _ in range(batch)]
        for p in (fast, ref):
            p.on_call(1, "verify", batch, 7, seconds)
            p.on_tree(1, 0, 3, walks)
            p.on_verify(1, 0, [6] * batch, accepted)
        assert fast.explain(batch) == ref.explain(batch)
        assert fast(batch) == ref(batch)
    _, covered = fast.ranking.chains.goodputs(fast.pricing, 2)
    assert not covered.any()  # every speculative candidate here is a suffix pair that drafts trees


def test_ranking_with_model_tree_candidates_matches_one_by_one():
    """A model level drafting token trees: its tree plans go to the scalar path, its chain plans stay in the table
    (a model fills its K), and the ranking equals the one-by-one one through tree rounds, timed tree proposals and
    chain rounds."""
    from specray.coordinator.feed import TreeWalk
    from tests.unit.test_planner import model_tree_levels

    fast, ref = Planner(model_tree_levels(), k_max=6), OneByOne(model_tree_levels(), k_max=6)
    rng = random.Random(5)
    for _ in range(40):
        batch = rng.choice([1, 2, 4])
        walks = [TreeWalk(nodes=rng.randint(4, 12), reach=rng.randint(1, 4), accepted=rng.randint(0, 3), spine=4,
                          spine_accepted=rng.randint(0, 3), depth=4) for _ in range(batch)]
        accepted = [rng.randint(0, 4) for _ in range(batch)]
        seconds = 0.01 * rng.uniform(0.9, 1.1)
        for p in (fast, ref):
            p.on_propose_tree(0, batch, 4, 3, 12, seconds)
            p.on_call(0, "propose", batch, 4, 0.008)
            p.on_call(1, "verify", batch, 13, 0.05)
            p.on_tree(1, 0, 3, walks)
            p.on_verify(1, 0, [4] * batch, accepted)
        assert fast.explain(batch) == ref.explain(batch)
        assert fast(batch) == ref(batch)
    _, covered = fast.ranking.chains.goodputs(fast.pricing, 2)
    assert covered.any() and all(covered[i] == (p.tree == 1) for i, p in enumerate(fast.candidates) if p.k)
