"""Serve's side of autoscaling by regime: the replicas' custom metrics and the policy callables.

Replicas report numbers through `record_autoscaling_stats()` (Serve calls it on every replica of a
deployment that has an `autoscaling_config`; `coordinator_stats` builds the dict). Serve averages each over
`look_back_period_s` into `ctx.aggregated_metrics[name][replica_id]`, and calls the deployment's
`autoscaling_config.policy.policy_function` with that `AutoscalingContext` about every 0.1 s. The classes
here are what `policy_function` names; Serve builds them once with `policy_kwargs` and calls them per tick:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 0          # Serve still applies its delays around a custom policy
      downscale_delay_s: 0
      policy:
        policy_function: specray.serve.autoscaling:TargetPoolPolicy
        policy_kwargs: {headroom: 1.0, downscale_after_s: 10}

The decisions themselves are pure (`specray.policy.autoscale`); this module only translates the context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from specray.policy.autoscale import (
    CoordinatorKnobs,
    Decision,
    DraftPoolKnobs,
    PoolMetrics,
    TargetPoolKnobs,
    coordinator_decision,
    draft_pool_decision,
    knobs_from,
    planner_break_even,
    target_pool_decision,
)

log = logging.getLogger("specray.autoscaling")

#: names of the custom metrics every coordinator-like replica reports (all plain floats)
METRICS = ("batch_size", "queued", "busy", "speculating", "break_even_batch", "max_batch_size")
BUSY_WINDOW_S = 2.0  # a replica whose last round is older than this counts as idle
BREAK_EVEN_REFRESH_S = 1.0  # how often a replica recomputes its break-even (a few planner rankings)


# ----------------------------------------------------------------------------------------- replica side
class BreakEvenCache:
    """A replica's planner break-even batch, recomputed at most every BREAK_EVEN_REFRESH_S (a few planner
    rankings each time)."""

    def __init__(self) -> None:
        self._at: float | None = None
        self._value = 0

    def get(self, planner: Any, max_batch_size: int) -> int:
        """The break-even batch; 0 = unknown (no planner: plain decoding only, or adaptive planning off)."""
        if planner is None:
            return 0
        now = time.monotonic()
        if self._at is None or now - self._at >= BREAK_EVEN_REFRESH_S:
            self._at, self._value = now, planner_break_even(planner, max_batch_size)
        return self._value


class ReplicaState(Protocol):
    """What a coordinator-like replica shows its autoscaling metrics."""

    scheduler: Any  #: `num_active` and `num_waiting`
    levels: Sequence[Any]  #: the cascade's levels (`is_ngram` each)
    config: Any  #: the replica's AppConfig
    planner: Any  #: the live planner, None without one
    #: (monotonic time, batch, {plan: sequences}) of the latest round, None before the first
    last_round: tuple[float, int, Mapping[Any, int]] | None
    break_even_cache: BreakEvenCache


def coordinator_stats(coord: ReplicaState) -> dict[str, float]:
    """The autoscaling metrics of a `Coordinator` replica (numbers only: Serve disables custom metrics of a
    replica whose first report has any other type)."""
    from specray.policy.planner import regime_of

    sched = coord.scheduler
    active, waiting = float(sched.num_active), float(sched.num_waiting)
    busy = speculating = 0.0
    last = coord.last_round
    if last is not None and active > 0 and time.monotonic() - last[0] <= BUSY_WINDOW_S:
        busy = 1.0
        is_ngram = [lv.is_ngram for lv in coord.levels]
        total = sum(last[2].values())
        spec = sum(n for p, n in last[2].items() if regime_of(p, is_ngram) != "none")
        speculating = spec / total if total else 0.0
    return {"batch_size": active, "queued": waiting, "busy": busy, "speculating": speculating,
            "break_even_batch": float(cached_break_even(coord)),
            "max_batch_size": float(coord.config.server.max_batch_size)}


def cached_break_even(coord: ReplicaState) -> int:
    """The replica's planner break-even batch (its `break_even_cache`); 0 = unknown."""
    return coord.break_even_cache.get(coord.planner, coord.config.server.max_batch_size)


# ----------------------------------------------------------------------------------------- controller side
def _per_replica(agg: Mapping[str, Mapping[Any, float]], name: str, replicas: list[Any]) -> tuple[float, ...]:
    values = agg.get(name) or {}
    return tuple(float(values[r]) for r in replicas if r in values)


def pool_metrics(ctx: Any) -> PoolMetrics:
    """`PoolMetrics` from a Serve `AutoscalingContext` (or any object with the same fields)."""
    agg = ctx.aggregated_metrics or {}
    replicas = list(ctx.running_replicas or [])
    if not replicas:  # a context without replica ids: take whatever reported
        replicas = list({r for values in agg.values() for r in values})
    max_batch = _per_replica(agg, "max_batch_size", replicas)
    now = getattr(ctx, "current_time", None)
    return PoolMetrics(
        replicas=int(ctx.current_num_replicas), target_replicas=int(ctx.target_num_replicas),
        batch_sizes=_per_replica(agg, "batch_size", replicas), queued=_per_replica(agg, "queued", replicas),
        busy=_per_replica(agg, "busy", replicas), speculating=_per_replica(agg, "speculating", replicas),
        break_even=_per_replica(agg, "break_even_batch", replicas),
        max_batch_size=int(max(max_batch)) if max_batch else 32,
        now=float(now if now is not None else time.time()),
    )


class _Policy:
    """A Serve custom autoscaling policy: `policy_function` names the class, `policy_kwargs` are its knobs
    (min/max default to the deployment's capacity-adjusted bounds, which Serve enforces anyway)."""

    knobs_cls: type = CoordinatorKnobs

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = dict(kwargs)
        knobs_from(self.knobs_cls, self.kwargs)  # fail at deploy time on a bad knob, not on the first tick
        self.last: Decision | None = None

    def knobs(self, ctx: Any) -> Any:
        kw = {"min_replicas": int(ctx.capacity_adjusted_min_replicas),
              "max_replicas": int(ctx.capacity_adjusted_max_replicas), **self.kwargs}
        return knobs_from(self.knobs_cls, kw)

    def decide(self, m: PoolMetrics, knobs: Any, state: Mapping[str, Any]) -> Decision:
        raise NotImplementedError

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        m = pool_metrics(ctx)
        d = self.decide(m, self.knobs(ctx), dict(ctx.policy_state or {}))
        if d.replicas != m.target_replicas:
            log.info("%s: %s", getattr(ctx, "deployment_name", "?"), d.reason)
        self.last = d
        return d.replicas, d.state


class CoordinatorPolicy(_Policy):
    """Coordinator replicas (one cascade each) by sequences per replica vs max_batch_size x utilization,
    capped at break_even x headroom while they speculate (regime_aware)."""

    knobs_cls = CoordinatorKnobs

    def decide(self, m: PoolMetrics, knobs: Any, state: Mapping[str, Any]) -> Decision:
        return coordinator_decision(m, knobs, state)


class TargetPoolPolicy(_Policy):
    """The plain target pool: grows when its batch per replica passes break_even x headroom."""

    knobs_cls = TargetPoolKnobs

    def decide(self, m: PoolMetrics, knobs: Any, state: Mapping[str, Any]) -> Decision:
        return target_pool_decision(m, knobs, state)


class DraftPoolPolicy(_Policy):
    """The speculative (draft + target) pool: shrinks towards min when the regime turns speculation off."""

    knobs_cls = DraftPoolKnobs

    def decide(self, m: PoolMetrics, knobs: Any, state: Mapping[str, Any]) -> Decision:
        return draft_pool_decision(m, knobs, state)


def coordinator_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """`CoordinatorPolicy` with default knobs, for `policy_function: specray.serve.autoscaling:coordinator_policy`."""
    return CoordinatorPolicy()(ctx)
