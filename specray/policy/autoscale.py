"""Autoscaling by regime: replica-count decisions for the coordinator and the model pools (pure, no Ray).

Speculation pays at small batch and loses past a *break-even batch*: the smallest batch at which the
planner's best plan is plain decoding (from its live cost and acceptance model, or its static table). Every
decision here sizes a pool so that its load per replica sits at a chosen *capacity* per replica:

- coordinator (one whole cascade per replica): capacity = max_batch_size x utilization, optionally capped
  at break_even x headroom (< 1) so each replica stays in the speculative regime (`coordinator_capacity`).
- target pool (plain decoding, serves the traffic past break-even): capacity = break_even x headroom,
  never above max_batch_size: the pool grows when the batch per replica passes the break-even point.
- draft (speculative) pool: while its rounds speculate, capacity = break_even x headroom (< 1 keeps each
  replica below break-even, where speculation wins); when the regime turns speculation off (no speculative
  rounds in the look-back window, which includes "no traffic routed here"), it shrinks towards min.

Flapping is prevented three ways: a dead band (grow when load > n x cap, shrink only when
load < (n - 1) x cap x low_water), a persistence time (`downscale_after_s`: a shrink must be wanted that
long, and it removes at most `max_step_down` replicas per step), and a hold while replicas are still
starting. Serve applies its own upscale/downscale delays on top of these (see docs/serving.md).

All decisions are `f(metrics, knobs, state) -> (replicas, state)`; `state` is the JSON-able dict that
Serve keeps between calls as `policy_state` (our keys start with "specray_").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specray.policy.planner import Planner

__all__ = [
    "CoordinatorKnobs", "DraftPoolKnobs", "PoolMetrics", "TargetPoolKnobs", "break_even_batch",
    "choose_pool", "coordinator_decision", "draft_pool_decision", "planner_break_even", "target_pool_decision",
]

_DOWN_SINCE = "specray_down_since"
_LAST_CHANGE = "specray_last_change"
_REASON = "specray_reason"


# ----------------------------------------------------------------------------------------- break-even
def break_even_batch(best_is_plain: Callable[[int], bool], max_batch: int) -> int:
    """Smallest batch in [1, max_batch] whose best plan is plain decoding; max_batch + 1 if there is none.

    Binary search: the relative gain of speculation falls as the batch grows (verification of K+1 tokens
    costs more per sequence the more sequences share the forward), so "plain is best" is monotone in the
    batch under the planner's cost model. A non-monotone table override gets *a* switch point, not all.
    """
    lo, hi = 1, max(1, int(max_batch)) + 1  # invariant: answer in [lo, hi]; hi means "none"
    while lo < hi:
        mid = (lo + hi) // 2
        if best_is_plain(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def planner_break_even(planner: Planner, max_batch: int) -> int:
    """`break_even_batch` from a live `Planner`: its table where one matches, else its best-ranked plan
    (no hysteresis: the break-even is a property of the model, not of the plan currently held)."""

    def best_is_plain(batch: int) -> bool:
        forced = planner._override(batch)  # the table, exactly as plan() applies it
        plan = forced if forced is not None else planner.explain(batch)[0][0]
        return planner.regime_of(plan) == "none"

    return break_even_batch(best_is_plain, max_batch)


def choose_pool(spec_inflight: int, spec_replicas: int, break_even: float, max_batch: int) -> bool:
    """Routing by regime: True sends a request to the speculative pool, False to the plain target pool.

    The speculative pool takes a request while its batch per replica, counting the new request, stays below
    the break-even batch (speculation still wins there) and within max_batch; the rest goes to the target
    pool. break_even <= 1 (plain wins at every batch) sends everything to the target pool.
    """
    per_replica = math.ceil((spec_inflight + 1) / max(1, spec_replicas))
    return per_replica < break_even and per_replica <= max_batch


# ----------------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class PoolMetrics:
    """What one deployment's replicas reported (means over Serve's look-back window), plus replica counts.

    Per-replica sequences are lists aligned by replica; replicas that have not reported yet are absent.
    `busy[i]` is the fraction of the window replica i ran rounds, `speculating[i]` the fraction of its
    sequences whose rounds speculated (0 when idle), so sum(speculating) / sum(busy) is the pool's
    speculating fraction over the window.
    """

    replicas: int  # running replicas
    target_replicas: int  # what Serve is currently scaling to (> replicas while some start)
    batch_sizes: tuple[float, ...] = ()
    queued: tuple[float, ...] = ()
    busy: tuple[float, ...] = ()
    speculating: tuple[float, ...] = ()
    break_even: tuple[float, ...] = ()  # 0 = unknown at that replica
    max_batch_size: int = 32
    now: float = 0.0

    @property
    def load(self) -> float:
        """Sequences running or waiting in the pool."""
        return float(sum(self.batch_sizes) + sum(self.queued))

    @property
    def batch_per_replica(self) -> float:
        return self.load / max(1, self.replicas)

    @property
    def speculating_fraction(self) -> float | None:
        """Fraction of busy replica-time spent in speculative rounds; None when no replica was busy."""
        busy = sum(self.busy)
        if busy <= 1e-9:
            return None
        return min(1.0, sum(self.speculating) / busy)

    def break_even_batch(self, default: float) -> float:
        """The break-even the replicas report (the most recent planners agree; take the median), else default."""
        known = sorted(b for b in self.break_even if b > 0)
        return known[len(known) // 2] if known else float(default)


# ----------------------------------------------------------------------------------------- knobs
@dataclass(frozen=True)
class _Knobs:
    min_replicas: int = 1
    max_replicas: int = 8
    low_water: float = 0.6  # shrink only when load < (n - 1) x cap x low_water
    downscale_after_s: float = 10.0  # a shrink must be wanted this long, and waits this long after a change
    max_step_down: int = 1
    default_break_even: float = 4.0  # until a replica reports one

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if not 0 < self.low_water <= 1:
            raise ValueError("low_water must be in (0, 1]")
        if self.max_step_down < 1 or self.downscale_after_s < 0 or self.default_break_even <= 0:
            raise ValueError("max_step_down >= 1, downscale_after_s >= 0 and default_break_even > 0")


@dataclass(frozen=True)
class CoordinatorKnobs(_Knobs):
    """utilization: target fraction of max_batch_size per replica; regime_aware: also keep the batch per
    replica at most break_even x headroom (< 1: below break-even, where each replica still speculates)."""

    utilization: float = 0.75
    regime_aware: bool = True
    headroom: float = 0.75


@dataclass(frozen=True)
class TargetPoolKnobs(_Knobs):
    """headroom: the batch per replica the pool is sized for, in units of the break-even batch."""

    headroom: float = 1.0


@dataclass(frozen=True)
class DraftPoolKnobs(_Knobs):
    """off_fraction/on_fraction: the speculating fraction below which the regime counts as off (shrink to
    min) and at or above which it counts as on (size for break_even x headroom); in between: hold."""

    headroom: float = 0.75
    off_fraction: float = 0.2
    on_fraction: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.off_fraction <= self.on_fraction <= 1:
            raise ValueError("need 0 <= off_fraction <= on_fraction <= 1")


def knobs_from(cls: type[_Knobs], kwargs: Mapping[str, Any]) -> _Knobs:
    """Knobs from `policy_kwargs`, naming unknown keys (a typo must not be silently ignored)."""
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown policy_kwargs {unknown}; allowed: {sorted(fields)}")
    return cls(**dict(kwargs))


# ----------------------------------------------------------------------------------------- decisions
@dataclass
class Decision:
    replicas: int
    state: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def _sized(load: float, cap: float, knobs: _Knobs, n: int) -> tuple[int, int]:
    """(grow_to, shrink_to): replicas for `load` at `cap` each, and the shrink target with the dead band."""
    cap = max(cap, 1e-9)
    up = math.ceil(load / cap - 1e-9)
    down = math.ceil(load / (cap * knobs.low_water) - 1e-9)
    return up, min(n, down)


def _decide(
    m: PoolMetrics, knobs: _Knobs, state: Mapping[str, Any], grow_to: int, shrink_to: int, reason: str
) -> Decision:
    """Shared hysteresis: grow at once (unless replicas are still starting), shrink step-wise after the
    wish has persisted `downscale_after_s` and as long after the last change."""
    st = dict(state)
    n = max(m.target_replicas, 0)
    lo, hi = knobs.min_replicas, knobs.max_replicas
    grow_to, shrink_to = min(max(grow_to, lo), hi), min(max(shrink_to, lo), hi)
    if grow_to > n:
        st.pop(_DOWN_SINCE, None)
        if m.replicas < n:  # replicas are still starting: wait for them before asking for more
            return Decision(n, st, f"{reason}; waiting for {n - m.replicas} starting replica(s)")
        st[_LAST_CHANGE] = m.now
        return Decision(grow_to, st, f"{reason}; grow {n} -> {grow_to}")
    if shrink_to < n:
        since = st.setdefault(_DOWN_SINCE, m.now)
        last = st.get(_LAST_CHANGE, -math.inf)
        if m.now - since >= knobs.downscale_after_s and m.now - last >= knobs.downscale_after_s:
            to = max(shrink_to, n - knobs.max_step_down)
            st[_LAST_CHANGE] = m.now
            st.pop(_DOWN_SINCE, None)
            return Decision(to, st, f"{reason}; shrink {n} -> {to}")
        return Decision(n, st, f"{reason}; shrink to {shrink_to} pending")
    st.pop(_DOWN_SINCE, None)
    return Decision(max(min(n, hi), lo), st, f"{reason}; hold {n}")


def coordinator_capacity(m: PoolMetrics, knobs: CoordinatorKnobs) -> float:
    """Sequences per coordinator replica to size for (see the module docstring).

    Regime-aware sizing looks at the break-even the replicas report, not at whether they speculate right
    now: past break-even their rounds stop speculating, so "only while speculating" would never scale out
    to bring them back. It applies where speculation can win at all (break-even > 1, reported)."""
    cap = max(1.0, m.max_batch_size * knobs.utilization)
    be = m.break_even_batch(0.0)
    if knobs.regime_aware and be > 1:
        cap = min(cap, max(1.0, be * knobs.headroom))
    return cap


def coordinator_decision(m: PoolMetrics, knobs: CoordinatorKnobs, state: Mapping[str, Any]) -> Decision:
    """Coordinator replicas by batch (running + waiting) per replica against `coordinator_capacity`."""
    cap = coordinator_capacity(m, knobs)
    up, down = _sized(m.load, cap, knobs, m.target_replicas)
    return _decide(m, knobs, state, up, down, f"load {m.load:.1f}, capacity {cap:.1f}/replica")


def target_pool_decision(m: PoolMetrics, knobs: TargetPoolKnobs, state: Mapping[str, Any]) -> Decision:
    """Target pool: grow when the batch per replica passes break_even x headroom (capped at max_batch)."""
    be = m.break_even_batch(knobs.default_break_even)
    cap = max(1.0, min(be * knobs.headroom, float(m.max_batch_size)))
    up, down = _sized(m.load, cap, knobs, m.target_replicas)
    return _decide(m, knobs, state, up, down, f"load {m.load:.1f}, break-even {be:g}, capacity {cap:.1f}/replica")


def draft_pool_decision(m: PoolMetrics, knobs: DraftPoolKnobs, state: Mapping[str, Any]) -> Decision:
    """Draft (speculative) pool: shrink towards min when the regime is off over the window; while it is on,
    size for break_even x headroom per replica; in the band between, hold (but never below what the
    queued + running sequences need at max_batch_size)."""
    frac = m.speculating_fraction
    floor = math.ceil(m.load / max(1, m.max_batch_size) - 1e-9)  # never strand sequences for lack of slots
    be = m.break_even_batch(knobs.default_break_even)
    if frac is None or frac < knobs.off_fraction:
        what = "idle" if frac is None else f"speculating {frac:.0%}"
        return _decide(m, knobs, state, floor, max(floor, knobs.min_replicas), f"regime off ({what})")
    if frac < knobs.on_fraction:
        return _decide(m, knobs, state, floor, m.target_replicas, f"speculating {frac:.0%}: hold")
    cap = max(1.0, min(be * knobs.headroom, float(m.max_batch_size)))
    up, down = _sized(m.load, cap, knobs, m.target_replicas)
    return _decide(m, knobs, state, max(up, floor), max(down, floor),
                   f"speculating {frac:.0%}, load {m.load:.1f}, break-even {be:g}, capacity {cap:.1f}/replica")
