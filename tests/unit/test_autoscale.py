"""Autoscaling by regime: the pure decisions, the break-even batch from a live planner, and the Serve policy
callables driven by constructed `AutoscalingContext`s (a plain namespace and Serve's own class)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from specray.coordinator.cascade import Plan
from specray.policy.autoscale import (
    CoordinatorKnobs,
    DraftPoolKnobs,
    PoolMetrics,
    TargetPoolKnobs,
    break_even_batch,
    choose_pool,
    coordinator_decision,
    draft_pool_decision,
    knobs_from,
    planner_break_even,
    target_pool_decision,
)
from specray.policy.cost import linear_cost
from specray.policy.planner import Planner
from tests.unit.test_planner import Sim, two_levels


# ----- break-even and routing ---------------------------------------------------------------------------
@pytest.mark.parametrize("switch", [1, 2, 7, 31, 32, 33])
def test_break_even_batch_finds_the_switch_with_few_probes(switch):
    asked = []

    def plain(b: int) -> bool:
        asked.append(b)
        return b >= switch

    assert break_even_batch(plain, 32) == switch  # 33 = "speculation wins up to max_batch"
    assert len(asked) <= 6 and all(1 <= b <= 32 for b in asked)


def test_planner_break_even_matches_a_linear_scan_of_the_live_model():
    p = Planner(two_levels())
    sim = Sim(p, {1: linear_cost(0.01, 0.002), 0: linear_cost(0.001, 0.0002)}, {(1, 0): 0.8}, seed=1)
    for batch in (1, 4, 16, 64):  # measure the cost curves at a few batch sizes
        sim.run(batch, 40)
    scan = next(b for b in range(1, 129) if p.regime_of(p.explain(b)[0][0]) == "none")
    assert 1 < scan < 128  # speculation wins at batch 1 and loses at large batch on this curve
    assert planner_break_even(p, 128) == scan
    assert planner_break_even(p, scan - 1) == scan  # none within max_batch -> max_batch + 1


def test_planner_break_even_follows_the_static_table():
    p = Planner(two_levels(), table=[(1, 5, "default"), (6, 1024, "none")])
    assert planner_break_even(p, 32) == 6
    assert planner_break_even(Planner(two_levels(), table=[(1, 1024, "none")]), 32) == 1


@pytest.mark.parametrize("inflight,replicas,be,expected", [
    (0, 1, 4, True), (2, 1, 4, True), (3, 1, 4, False),  # the 4th sequence would reach break-even
    (5, 2, 4, True), (6, 2, 4, False),
    (0, 1, 1, False),  # plain wins at every batch: regime off, everything to the target pool
    (7, 1, 100, True), (8, 1, 100, False),  # speculation always wins, but a replica holds 8 (max_batch)
])
def test_choose_pool_keeps_the_speculative_pool_below_break_even(inflight, replicas, be, expected):
    assert choose_pool(inflight, replicas, be, max_batch=8) is expected


# ----- decisions ----------------------------------------------------------------------------------------
def metrics(n: int, batches, *, target: int | None = None, busy=None, spec=None, be=4.0, queued=None, now=0.0,
            max_batch=32) -> PoolMetrics:
    batches = tuple(float(b) for b in batches)
    return PoolMetrics(
        replicas=n, target_replicas=n if target is None else target, batch_sizes=batches,
        queued=tuple(queued or (0.0,) * len(batches)),
        busy=tuple(busy if busy is not None else (1.0 if b > 0 else 0.0 for b in batches)),
        speculating=tuple(spec if spec is not None else (0.0,) * len(batches)),
        break_even=(be,) * len(batches), max_batch_size=max_batch, now=now,
    )


def test_target_pool_grows_when_batch_per_replica_passes_break_even():
    knobs = TargetPoolKnobs(min_replicas=1, max_replicas=6, headroom=1.0)
    assert target_pool_decision(metrics(1, [4]), knobs, {}).replicas == 1  # at break-even: enough
    d = target_pool_decision(metrics(1, [9]), knobs, {})
    assert d.replicas == 3 and "grow" in d.reason  # 9 sequences at 4 per replica
    assert target_pool_decision(metrics(2, [20, 20]), knobs, {}).replicas == 6  # capped at max
    # headroom 2: each replica may carry twice the break-even batch
    assert target_pool_decision(metrics(1, [7]), TargetPoolKnobs(headroom=2.0), {}).replicas == 1
    # the break-even never sizes a replica past max_batch_size
    assert target_pool_decision(metrics(1, [17], be=100, max_batch=8), knobs, {}).replicas == 3
    # queued sequences count as load
    assert target_pool_decision(metrics(1, [4], queued=[4]), knobs, {}).replicas == 2


def test_target_pool_waits_for_starting_replicas_and_shrinks_slowly():
    knobs = TargetPoolKnobs(min_replicas=1, max_replicas=8, downscale_after_s=5, low_water=0.5)
    # 3 asked for, 1 running: more load does not pile on more replicas while they start
    d = target_pool_decision(metrics(1, [20], target=3), knobs, {})
    assert d.replicas == 3 and "starting" in d.reason
    # dead band: 3 replicas, load 5 -> shrinking to 2 needs load < 2 x 4 x 0.5 = 4
    assert target_pool_decision(metrics(3, [2, 2, 1], now=100), knobs, {}).replicas == 3
    state: dict = {}
    d = target_pool_decision(metrics(3, [1, 1, 0], now=100), knobs, state)
    assert d.replicas == 3 and "pending" in d.reason
    d = target_pool_decision(metrics(3, [1, 1, 0], now=103), knobs, d.state)
    assert d.replicas == 3  # not persisted long enough yet
    d = target_pool_decision(metrics(3, [1, 1, 0], now=105.5), knobs, d.state)
    assert d.replicas == 2  # one step at a time
    d = target_pool_decision(metrics(2, [1, 0], now=106), knobs, d.state)
    assert d.replicas == 2  # a fresh wish to shrink waits again
    d = target_pool_decision(metrics(2, [1, 0], now=111.5), knobs, d.state)
    assert d.replicas == 1
    # a burst in between resets the pending shrink
    st = target_pool_decision(metrics(3, [0, 0, 0], now=200), knobs, {}).state
    st = target_pool_decision(metrics(3, [6, 6, 6], now=202), knobs, st).state
    assert target_pool_decision(metrics(3, [0, 0, 0], now=206), knobs, st).replicas == 3


def test_draft_pool_shrinks_when_the_regime_turns_speculation_off_even_if_busy():
    knobs = DraftPoolKnobs(min_replicas=1, max_replicas=4, downscale_after_s=2)
    busy_plain = metrics(3, [3, 3, 3], spec=[0, 0, 0.2], now=10)  # busy, but 7% of rounds speculate
    d = draft_pool_decision(busy_plain, knobs, {})
    assert d.replicas == 3 and "regime off" in d.reason
    d = draft_pool_decision(metrics(3, [3, 3, 3], spec=[0, 0, 0.2], now=12.5), knobs, d.state)
    assert d.replicas == 2
    # the same load while speculating: sized for break-even x headroom = 3 per replica -> hold 3
    assert draft_pool_decision(metrics(3, [3, 3, 3], spec=[1, 1, 1], now=20), knobs, {}).replicas == 3
    # idle (no rounds in the window) counts as off too
    idle = metrics(2, [0, 0], now=0)
    assert idle.speculating_fraction is None
    st = draft_pool_decision(idle, knobs, {}).state
    assert draft_pool_decision(metrics(2, [0, 0], now=3), knobs, st).replicas == 1


def test_draft_pool_grows_back_when_speculating_and_busy_and_holds_in_the_band():
    knobs = DraftPoolKnobs(min_replicas=1, max_replicas=4, headroom=0.75)
    d = draft_pool_decision(metrics(1, [6], spec=[1.0]), knobs, {})
    assert d.replicas == 2  # 6 sequences, break-even 4 x 0.75 = 3 per replica
    # half the rounds speculate: between off (0.2) and on (0.5) -> hold
    assert draft_pool_decision(metrics(1, [6], spec=[0.3]), knobs, {}).replicas == 1
    # regime off never strands sequences: 70 queued + running at max_batch 32 need 3 replicas
    off = metrics(1, [32], queued=[38], spec=[0.0], max_batch=32)
    assert draft_pool_decision(off, knobs, {}).replicas == 3


def test_coordinator_decision_by_batch_and_regime():
    plain = CoordinatorKnobs(utilization=0.5, regime_aware=False, max_replicas=8)
    assert coordinator_decision(metrics(1, [16], max_batch=16), plain, {}).replicas == 2
    aware = CoordinatorKnobs(utilization=0.5, regime_aware=True, headroom=0.75, max_replicas=8)
    # replicas are kept below break-even (4 x 0.75 = 3 < 8 = 16 x 0.5): 16 sequences -> 6 replicas, even though
    # at 16 per replica the rounds no longer speculate (that is what scaling out is meant to bring back)
    assert coordinator_decision(metrics(1, [16], spec=[0.0], max_batch=16), aware, {}).replicas == 6
    # break-even unknown (0) or 1 (plain wins at every batch): only max_batch_size x utilization counts
    assert coordinator_decision(metrics(1, [16], be=0, max_batch=16), aware, {}).replicas == 2
    assert coordinator_decision(metrics(1, [16], be=1, max_batch=16), aware, {}).replicas == 2


def test_knobs_reject_unknown_and_inconsistent_values():
    with pytest.raises(ValueError, match="headrom"):
        knobs_from(TargetPoolKnobs, {"headrom": 2})
    with pytest.raises(ValueError):
        DraftPoolKnobs(off_fraction=0.6, on_fraction=0.5)
    with pytest.raises(ValueError):
        TargetPoolKnobs(min_replicas=3, max_replicas=2)


# ----- the Serve edge -----------------------------------------------------------------------------------
def ctx_fields(running: int, target: int, per_replica: dict[str, list[float]], state=None, lo=1, hi=4, now=None):
    from ray.serve._private.common import DeploymentID, ReplicaID

    dep = DeploymentID(name="TargetPool", app_name="specray")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(running)]
    agg = {name: dict(zip(replicas, values)) for name, values in per_replica.items()}
    return dict(deployment_id=dep, deployment_name="TargetPool", app_name="specray", current_num_replicas=running,
                target_num_replicas=target, running_replicas=replicas, total_num_requests=0.0,
                total_queued_requests=0.0, aggregated_metrics=agg, raw_metrics={},
                capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
                policy_state=dict(state or {}), last_scale_up_time=None, last_scale_down_time=None,
                current_time=time.time() if now is None else now, config=None)


def stats(batches, *, spec=None, be=4.0, max_batch=8) -> dict[str, list[float]]:
    n = len(batches)
    return {"batch_size": list(batches), "queued": [0.0] * n, "busy": [1.0 if b else 0.0 for b in batches],
            "speculating": list(spec or [0.0] * n), "break_even_batch": [be] * n, "max_batch_size": [max_batch] * n}


def test_policy_callables_read_a_namespace_context():
    from specray.serve.autoscaling import CoordinatorPolicy, DraftPoolPolicy, TargetPoolPolicy, pool_metrics

    ctx = SimpleNamespace(**ctx_fields(2, 2, stats([6, 5])))
    m = pool_metrics(ctx)
    assert m.load == 11 and m.replicas == 2 and m.max_batch_size == 8 and m.break_even_batch(9) == 4
    n, state = TargetPoolPolicy(headroom=1.0)(ctx)
    assert n == 3 and isinstance(state, dict)  # 11 sequences at break-even 4 per replica
    assert TargetPoolPolicy(headroom=2.0)(ctx)[0] == 2
    assert CoordinatorPolicy(utilization=1.0, regime_aware=False)(ctx)[0] == 2
    # bounds: knobs default to the deployment's capacity-adjusted min/max
    assert TargetPoolPolicy()(SimpleNamespace(**ctx_fields(2, 2, stats([20, 20]), hi=3)))[0] == 3
    off = SimpleNamespace(**ctx_fields(2, 2, stats([3, 3], spec=[0, 0]), now=50.0))
    policy = DraftPoolPolicy(downscale_after_s=1.0)
    n, state = policy(off)
    assert n == 2 and "regime off" in policy.last.reason
    later = SimpleNamespace(**ctx_fields(2, 2, stats([3, 3], spec=[0, 0]), state=state, now=51.5))
    assert policy(later)[0] == 1
    with pytest.raises(ValueError, match="unknown policy_kwargs"):
        DraftPoolPolicy(cooldown=3)


def test_policy_with_serves_own_context_and_wrapper_applies_serves_delays():
    """Serve's AutoscalingContext is constructible in 2.60; Serve wraps a custom policy with its delay logic,
    so the same decision is held back by upscale_delay_s (docs/serving.md, autoscaling by regime)."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from specray.serve.autoscaling import TargetPoolPolicy

    fields = ctx_fields(1, 1, stats([10]))
    policy = TargetPoolPolicy()
    n, _ = policy(AutoscalingContext(**fields))
    assert n == 3  # 10 sequences / 4 per replica
    for delay, expected in ((0.0, 3), (30.0, 1)):
        cfg = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=delay, downscale_delay_s=0)
        wrapped = _apply_autoscaling_config(TargetPoolPolicy())
        got, state = wrapped(AutoscalingContext(**{**fields, "config": cfg}))
        assert got == expected, (delay, got, state)


def test_coordinator_stats_report_regime_of_the_last_round():
    from specray.config import AppConfig
    from specray.serve.autoscaling import BUSY_WINDOW_S, METRICS, BreakEvenCache, coordinator_stats

    cfg = AppConfig.model_validate({"cascade": {"levels": [{"kind": "ngram"}, {"kind": "hf", "model": "t"}]},
                                    "server": {"max_batch_size": 8}})
    levels = [SimpleNamespace(is_ngram=True), SimpleNamespace(is_ngram=False)]
    coord = SimpleNamespace(scheduler=SimpleNamespace(num_active=4, num_waiting=2), levels=levels, config=cfg,
                            planner=None, last_round=None, break_even_cache=BreakEvenCache())
    idle = coordinator_stats(coord)
    assert set(idle) == set(METRICS) and all(isinstance(v, float) for v in idle.values())
    assert idle["busy"] == 0 and idle["batch_size"] == 4 and idle["queued"] == 2 and idle["break_even_batch"] == 0
    spec, plain = Plan((0, 1), (3,)), Plan((1,), ())
    coord.last_round = (time.monotonic(), 4, {spec: 3, plain: 1})
    s = coordinator_stats(coord)
    assert s["busy"] == 1 and s["speculating"] == pytest.approx(0.75)
    coord.last_round = (time.monotonic() - BUSY_WINDOW_S - 1, 4, {spec: 4})
    assert coordinator_stats(coord)["busy"] == 0


def test_break_even_cache_ranks_at_most_once_per_refresh_interval(monkeypatch):
    import specray.serve.autoscaling as auto

    calls = []
    monkeypatch.setattr(auto, "planner_break_even", lambda planner, max_batch: calls.append(max_batch) or 7)
    clock = [100.0]
    monkeypatch.setattr(auto.time, "monotonic", lambda: clock[0])
    cache = auto.BreakEvenCache()
    assert cache.get(None, 16) == 0 and calls == []  # no planner: unknown, nothing ranked
    assert cache.get(object(), 16) == 7 and cache.get(object(), 16) == 7 and calls == [16]
    clock[0] += auto.BREAK_EVEN_REFRESH_S
    assert cache.get(object(), 16) == 7 and calls == [16, 16]


def test_pools_config_and_deployment_options():
    from specray.config import AppConfig
    from specray.coordinator.scheduler import RequestError, Speculation
    from specray.serve.pools import _request_check, deployment_options, target_only

    cfg = AppConfig.model_validate({
        "cascade": {"levels": [{"kind": "ngram"}, {"kind": "hf", "model": "d", "name": "d"},
                               {"kind": "hf", "model": "t", "name": "t"}]},
        "pools": {"target": {"autoscaling_config": {"max_replicas": 7}}},
    })
    opts = deployment_options("target", cfg.pools.target, 16)
    asc = opts["autoscaling_config"]
    assert asc["max_replicas"] == 7 and asc["min_replicas"] == 1  # merged key by key over the defaults
    assert asc["policy"]["policy_function"] == "specray.serve.autoscaling:TargetPoolPolicy"
    assert opts["max_ongoing_requests"] > 16  # a full batch plus control calls
    assert [lv.display_name for lv in target_only(cfg).cascade.levels] == ["t"]
    check = _request_check(cfg)
    assert check.plan_for(Speculation("draft")) == Plan((1, 2), (4,))
    no_draft = AppConfig.model_validate({"cascade": {"levels": [{"kind": "ngram"}, {"kind": "hf", "model": "t"}]},
                                         "pools": {}})
    with pytest.raises(RequestError, match="no draft model"):
        _request_check(no_draft).plan_for(Speculation("draft"))
    with pytest.raises(ValueError):
        AppConfig.model_validate({"cascade": {"levels": [{"kind": "hf", "model": "t"}]}, "pools": {"x": 1}})


def test_root_serve_config_policies_and_the_commented_pools_example_are_valid():
    """The documented examples must not rot: the Coordinator's policy imports and takes its policy_kwargs, and
    the commented `pools:` block in serve_config.yaml, uncommented, is a valid AppConfig whose policies build."""
    import importlib
    from pathlib import Path

    import yaml

    from specray.config import AppConfig

    root = Path(__file__).resolve().parents[2] / "serve_config.yaml"
    text = root.read_text()
    app = yaml.safe_load(text)["applications"][0]

    def build(policy: dict):
        module, name = policy["policy_function"].split(":")
        return getattr(importlib.import_module(module), name)(**policy.get("policy_kwargs", {}))

    (coord,) = [d for d in app["deployments"] if d["name"] == "Coordinator"]
    assert coord["max_ongoing_requests"] >= app["args"]["config"]["server"]["max_batch_size"]
    build(coord["autoscaling_config"]["policy"])
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# pools:")
    indent = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#"):
            break
        block.append(line[indent + 2:])
    pools = yaml.safe_load("\n".join(block))["pools"]
    cfg = AppConfig.model_validate({**app["args"]["config"], "pools": pools})
    for pool in (cfg.pools.speculative, cfg.pools.target):
        build(pool["autoscaling_config"]["policy"])


# ----- the router's forwarding, with fake pool handles (no Ray) -----------------------------------------
class _FakeStream:
    """What `handle.options(stream=True).run_routed.remote(...)` returns: an async iterator with cancel()."""

    def __init__(self, events, error=None) -> None:
        self.events, self.error, self.cancelled = list(events), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _FakePool:
    def __init__(self) -> None:
        self.calls: list = []
        self.next: _FakeStream | None = None
        self.run_routed = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    def _remote(self, req, break_even):
        self.calls.append((req, break_even))
        return self.next


def _router(break_even: float = 3.0):
    from specray.config import AppConfig
    from specray.metrics import SpecMetrics
    from specray.serve.pools import Router

    r = Router.__new__(Router)  # the async Serve constructor needs live pools; set what run() uses
    r.config = AppConfig.model_validate({"cascade": {"levels": [{"kind": "ngram"}, {"kind": "hf", "model": "t"}]},
                                         "server": {"max_batch_size": 8}, "pools": {}})
    r.model_name, r.metrics = "m", SpecMetrics(model_name="m")
    r.handles = {"speculative": _FakePool(), "target": _FakePool()}
    r.inflight = {"speculative": 0, "target": 0}
    r.break_even, r.spec_replicas = break_even, 1
    return r


def test_router_routes_by_regime_and_override_and_forwards_break_even():
    from specray.coordinator.scheduler import Event, Request, Speculation

    r = _router(break_even=3.0)
    r.inflight["speculative"] = 2  # a third sequence would reach break-even on the one replica
    assert r.choose(Request([1])) == "target"
    assert r.choose(Request([1], speculation=Speculation("ngram"))) == "speculative"
    assert r.choose(Request([1], speculation=Speculation("auto", 2))) == "speculative"
    r.inflight["speculative"] = 1
    assert r.choose(Request([1])) == "speculative"
    assert r.choose(Request([1], speculation=Speculation("none"))) == "target"
    r.inflight["speculative"] = 0

    done = Event([5], "x", finished=True, finish_reason="length", prompt_tokens=1, completion_tokens=1)
    r.handles["target"].next = _FakeStream([done])

    async def collect(req):
        return [ev async for ev in r.run(req)]

    assert asyncio.run(collect(Request([1], speculation=Speculation("none")))) == [done]
    assert r.handles["target"].calls[0][1] == 3.0  # the target pool learns the break-even with the request
    assert r.inflight == {"speculative": 0, "target": 0}
    assert r.metrics.value("specray_routed_requests_total", pool="target") == 1


def test_router_maps_pool_errors_and_cancels_the_pool_stream():
    from specray.coordinator.scheduler import Event, Request, RequestError
    from specray.serve.replica import TargetUnavailable

    r = _router()
    tok = Event([5], "x")

    async def drain():
        return [ev async for ev in r.run(Request([1]))]

    r.handles["speculative"].next = _FakeStream([tok], RequestError("max_tokens: at most 3"))
    with pytest.raises(RequestError, match="max_tokens: at most 3"):
        asyncio.run(drain())
    r.handles["speculative"].next = stream = _FakeStream([tok], RuntimeError("actor died"))
    with pytest.raises(TargetUnavailable, match="actor died"):
        asyncio.run(drain())
    assert stream.cancelled and r.inflight["speculative"] == 0

    async def leave_after_one():  # a client that goes away: closing the generator cancels the pool's stream
        agen = r.run(Request([1]))
        await agen.__anext__()
        await agen.aclose()

    r.handles["speculative"].next = stream = _FakeStream([tok, tok, tok])
    asyncio.run(leave_after_one())
    assert stream.cancelled and r.inflight["speculative"] == 0
    # the two pool failures are errors (by the code they were answered with), the client leaving a cancel
    assert r.metrics.value("specray_requests_total", finish_reason="cancelled") == 1
    assert r.metrics.value("specray_requests_total", finish_reason="error") == 2
    assert r.metrics.value("specray_request_errors_total", code="invalid_request") == 1
    assert r.metrics.value("specray_request_errors_total", code="model_unavailable") == 1
