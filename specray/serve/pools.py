"""Regime pools: a Router deployment in front of a speculative pool and a plain target pool, scaled apart.

    client -> Router (Serve ingress: HTTP + handle API, tokenizes, routes by regime)
                |-- SpeculativePool replicas: Coordinator over the whole cascade (drafts + target)
                '-- TargetPool replicas:      Coordinator over the target alone (plain decoding)

Why two pools: speculation wins at small batch and loses past the break-even batch, and the two regimes
need different hardware (drafts + target vs target only). The router sends a request to the speculative
pool while that pool's batch per replica, counting the request, stays below the break-even batch
(`choose_pool`), else to the target pool; the pools' custom Serve policies (`DraftPoolPolicy`,
`TargetPoolPolicy`) then grow the target pool when its batch per replica passes break-even and shrink the
speculative pool when its rounds stop speculating. Break-even comes live from the speculative pool's
planner (or `pools.break_even_batch`); the router passes it along with each request to the target pool,
whose replicas report it to their policy (they have no planner of their own).

Exactness: both pools verify against the same target, so greedy output is identical whichever pool served
it, and seeded sampling uses the coupled method (output depends on seed and target only). Requests that
ask for a drafter (`speculation.method` ngram/draft/cascade/hybrid, or auto with K) always go to the speculative
pool, `none` to the target pool. Streams are forwarded event by event; a client that goes away cancels the
pool's stream (`gen.cancel()`: leaving the loop alone would not), which frees the sequence on every level.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from specray.config import AppConfig
from specray.coordinator.cascade import Plan
from specray.coordinator.scheduler import Event, Request, RequestError, Scheduler
from specray.metrics import ROUTER_METRICS, OnlySink, SpecMetrics
from specray.policy.autoscale import choose_pool
from specray.serve.autoscaling import BreakEvenCache, cached_break_even, coordinator_stats
from specray.serve.protocol import Busy
from specray.serve.replica import Coordinator, SinkFactory, TargetUnavailable, error_code

log = logging.getLogger("specray")

SPECULATIVE, TARGET = "speculative", "target"
DEPLOYMENTS = {SPECULATIVE: "SpeculativePool", TARGET: "TargetPool"}
_DRAFTING = ("ngram", "draft", "cascade", "hybrid")


def _autoscaling(policy: str) -> dict[str, Any]:
    return {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "metrics_interval_s": 1.0,
            "look_back_period_s": 5.0, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": f"specray.serve.autoscaling:{policy}"}}


def deployment_options(pool: str, overrides: Mapping[str, Any], max_batch_size: int) -> dict[str, Any]:
    """Serve options of one pool: defaults (custom policy, room for a full batch plus control calls) with
    `pools.<pool>` merged over them (`autoscaling_config` key by key)."""
    policy = "DraftPoolPolicy" if pool == SPECULATIVE else "TargetPoolPolicy"
    opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 2 * max_batch_size + 8,
                            "autoscaling_config": _autoscaling(policy)}
    for key, value in overrides.items():
        if key == "autoscaling_config" and isinstance(value, Mapping):
            opts[key] = {**opts[key], **value}
        else:
            opts[key] = value
    return opts


def target_only(cfg: AppConfig) -> AppConfig:
    """The target pool's config: the same server and target level, no drafters."""
    cascade = cfg.cascade.model_copy(update={"levels": [cfg.cascade.levels[-1]]})
    return cfg.model_copy(update={"cascade": cascade, "pools": None})


class PoolCoordinator(Coordinator):
    """A pool replica: a `Coordinator` (scheduler, planner, level actors) fed by the router."""

    def __init__(self, config: Mapping[str, Any] | AppConfig, pool: str, metric_sinks: Sequence[SinkFactory] = (),
                 freeze_heap: bool = False) -> None:
        super().__init__(config, metric_sinks=metric_sinks, freeze_heap=freeze_heap)
        self.pool = pool
        self._routed_break_even = 0.0

    async def run_routed(self, req: Request, break_even: float = 0.0) -> AsyncIterator[Event]:
        """The scheduler's events for one routed request; `break_even` is the router's current value."""
        if break_even > 0:
            self._routed_break_even = float(break_even)
        async for ev in self.run(req):
            yield ev

    def describe(self) -> dict[str, Any]:
        """What the router needs to tokenize and validate requests itself."""
        import specray

        return {"tokenizer": self.tokenizer, "max_context": self.max_context, "vocab_size": self.vocab_size,
                "levels": [lv.name for lv in self.levels], "pid": os.getpid(), "specray_file": specray.__file__}

    def snapshot(self) -> dict[str, float]:
        """This replica's break-even batch (0: unknown) and load, for the router."""
        return {"break_even_batch": float(cached_break_even(self)), "batch_size": float(self.scheduler.num_active)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = coordinator_stats(self)
        if stats["break_even_batch"] <= 0:  # no planner here (target alone): the router's value
            stats["break_even_batch"] = self._routed_break_even
        return stats


def _request_check(cfg: AppConfig) -> SimpleNamespace:
    """`plan_for` of the speculative pool's scheduler, run over the level layout from the config, so the
    router rejects an impossible `speculation` override (400) before it streams anything."""
    levels = [SimpleNamespace(is_ngram=lc.is_lookup, k=lc.num_speculative_tokens) for lc in cfg.cascade.levels]
    top = len(levels) - 1
    engine = SimpleNamespace(levels=levels, top=top, default_plan=Plan(tuple(range(top + 1)),
                                                                       tuple(lv.k for lv in levels[:-1])))
    fake = SimpleNamespace(engine=engine)
    return SimpleNamespace(plan_for=lambda spec: Scheduler.plan_for(fake, spec), num_active=0, num_waiting=0)


def _running_replicas(app_name: str, deployment: str) -> int | None:
    from ray import serve

    try:
        dep = serve.status().applications[app_name].deployments[deployment]
    except Exception:
        return None
    return int(dep.replica_states.get("RUNNING", 0))


class Router(Coordinator):
    """The ingress in pools mode: the Coordinator's HTTP and handle API, with `run` forwarding each request
    to the pool its regime picks. Not a cascade itself (no levels, no scheduler).

    Metrics: the pools record the requests they run (so each is counted once cluster-wide); the router sends
    only its routing metrics to `metric_sinks`, and keeps its view of the requests in its own registry (its
    `/metrics` route)."""

    async def __init__(self, config: Mapping[str, Any] | AppConfig, speculative: Any, target: Any,  # type: ignore[misc]
                       metric_sinks: Sequence[SinkFactory] = ()) -> None:
        self.config = config if isinstance(config, AppConfig) else AppConfig.model_validate(dict(config))
        assert self.config.pools is not None
        self.pools_cfg = self.config.pools
        server = self.config.server
        self._launched = None
        self.handles = {SPECULATIVE: speculative, TARGET: target}
        info = await speculative.describe.remote()
        self.tokenizer, self.max_context, self.vocab_size = info["tokenizer"], info["max_context"], info["vocab_size"]
        self.model_name = server.model_name
        self.levels, self.planner, self.engine = [], None, None
        self.last_round, self.break_even_cache = None, BreakEvenCache()
        self.scheduler = _request_check(self.config)
        self.metrics = SpecMetrics(model_name=self.model_name,
                                   sinks=[OnlySink(make(), ROUTER_METRICS) for make in metric_sinks])
        self.api_key = server.api_key or os.environ.get("SPECRAY_API_KEY") or None
        self.started = time.time()
        self.inflight = {SPECULATIVE: 0, TARGET: 0}
        self.break_even = float(self.pools_cfg.break_even_batch or self.pools_cfg.initial_break_even)
        self.spec_replicas = 1
        try:
            from ray import serve

            self._app_name = serve.get_replica_context().app_name
        except Exception:
            self._app_name = None
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_loop())
        log.info("specray router ready: pools %s, pool code %s", info["levels"], info["specray_file"])

    # ----- routing --------------------------------------------------------------------------------
    async def _refresh_loop(self) -> None:
        """Keep break-even (live from the speculative pool) and its running replica count fresh."""
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # a pool restarting must not stop the router
                log.warning("router refresh failed: %s", exc)
            await asyncio.sleep(self.pools_cfg.refresh_s)

    async def refresh(self) -> None:
        if self.pools_cfg.break_even_batch is None:
            snap = await asyncio.wait_for(self.handles[SPECULATIVE].snapshot.remote(), timeout=10)
            if snap["break_even_batch"] > 0:
                self.break_even = float(snap["break_even_batch"])
        if self._app_name is not None:
            n = await asyncio.to_thread(_running_replicas, self._app_name, DEPLOYMENTS[SPECULATIVE])
            if n:
                self.spec_replicas = n
        self.metrics.observe_break_even(self.break_even)

    def choose(self, req: Request) -> str:
        """The pool for a request: its speculation override if it names one, else the regime."""
        spec = req.speculation
        if spec is not None and (spec.method in _DRAFTING or (spec.method == "auto" and spec.num_speculative_tokens)):
            return SPECULATIVE
        if spec is not None and spec.method == "none":
            return TARGET
        fits = choose_pool(self.inflight[SPECULATIVE], self.spec_replicas, self.break_even,
                           self.config.server.max_batch_size)
        return SPECULATIVE if fits else TARGET

    async def run(self, req: Request) -> AsyncIterator[Event]:
        """Forward one request to its pool and stream the pool's events back (metrics recorded here)."""
        pool = self.choose(req)
        self.metrics.observe_routed(pool)
        self.inflight[pool] += 1
        self.metrics.observe_pool_inflight(pool, self.inflight[pool])
        be = self.break_even if pool == TARGET else 0.0
        gen = self.handles[pool].options(stream=True).run_routed.remote(req, be)
        t0, ttft, last, failed = time.perf_counter(), None, None, None
        try:
            async for ev in gen:
                if ttft is None and ev.token_ids:
                    ttft = time.perf_counter() - t0
                last = ev
                yield ev
        except RequestError as exc:
            failed = RequestError(_cause_message(exc))
            raise failed from None
        except Exception as exc:
            failed = TargetUnavailable(f"the model is unavailable: {_cause_message(exc)}")
            raise failed from exc
        finally:
            if last is None or not last.finished:
                gen.cancel()  # leaving the loop alone does not stop the pool's generator
                if failed is not None:
                    self.metrics.observe_error(error_code(failed))
                else:
                    self.metrics.observe_cancelled()
            else:
                self.metrics.observe_request(last.stats, last.finish_reason or "length", last.prompt_tokens,
                                             last.completion_tokens, ttft, time.perf_counter() - t0)
            self.inflight[pool] -= 1
            self.metrics.observe_pool_inflight(pool, self.inflight[pool])

    async def reset_prefix_cache(self) -> list[str]:
        """The levels of one replica of each pool forget their cached prompt prefixes (a pool with several replicas
        resets only the one that takes the call); `Busy` while requests run."""
        if any(self.inflight.values()):
            raise Busy(f"{sum(self.inflight.values())} requests are running: reset the prefix caches when idle")
        done = []
        for pool, handle in self.handles.items():
            done += [f"{pool}/{name}" for name in await handle.reset_prefix_cache.remote()]
        return done

    async def health(self) -> dict[str, Any]:
        """Health of one replica of each pool (the target pool's is what decides 'ok')."""
        out: dict[str, Any] = {"status": "ok", "pools": {}, "pid": os.getpid(), "break_even_batch": self.break_even,
                               "inflight": dict(self.inflight)}
        for pool, handle in self.handles.items():
            try:
                out["pools"][pool] = await asyncio.wait_for(handle.health.remote(), timeout=15)
            except Exception as exc:
                out["pools"][pool] = {"status": f"unavailable: {exc}"}
            if out["pools"][pool].get("status") != "ok":
                out["status"] = "unavailable"
        return out

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"inflight": float(sum(self.inflight.values()))}

    def __del__(self) -> None:
        task = getattr(self, "_refresh_task", None)
        if task is not None:
            task.cancel()


def _cause_message(exc: BaseException) -> str:
    """The original message of an exception raised in a pool replica (Ray prefixes a remote traceback)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return str(cause)
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    if len(lines) == 1:
        return lines[0]
    return lines[-1].split(": ", 1)[-1] if lines else type(exc).__name__  # "SomeError: message" of a traceback


def build_pools_app(cfg: AppConfig):
    """Bind Router -> (SpeculativePool, TargetPool) with each pool's autoscaling policy."""
    from ray import serve

    assert cfg.pools is not None
    mb = cfg.server.max_batch_size
    from specray.serve.raymetrics import RayMetricsSink

    sinks = (RayMetricsSink,)
    spec = serve.deployment(name=DEPLOYMENTS[SPECULATIVE], **deployment_options(SPECULATIVE, cfg.pools.speculative,
                                                                                mb))(PoolCoordinator)
    tgt = serve.deployment(name=DEPLOYMENTS[TARGET], **deployment_options(TARGET, cfg.pools.target, mb))(
        PoolCoordinator)
    plain = cfg.model_copy(update={"pools": None})
    router = serve.deployment(name="Router", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4 * mb)(
        serve.ingress()(Router))
    return router.bind(cfg.model_dump(mode="json"),
                       spec.bind(plain.model_dump(mode="json"), SPECULATIVE, metric_sinks=sinks, freeze_heap=True),
                       tgt.bind(target_only(cfg).model_dump(mode="json"), TARGET, metric_sinks=sinks,
                                freeze_heap=True),
                       metric_sinks=sinks)
