"""The `Coordinator`: one replica's cascade (level actors or in-process workers), scheduler, metrics and Python
handle API.

A plain class: `specray.serve.app.build_app` binds it as a Serve deployment whose HTTP routes come from
`specray.serve.http.build_http_app(coordinator)`, built on the replica after the constructor (Serve's
`__serve_build_asgi_app__` hook), so routes close over the live scheduler. The regime pools' router and pool
replicas (`specray.serve.pools`) build on it.

Python handle API (non-streaming and streaming):

    h = serve.get_app_handle("specray")
    out = h.generate.remote("def f(x):", max_tokens=32, temperature=0.0, speculation={"method": "cascade"}).result()
    for chunk in h.options(stream=True).generate_stream.remote("def f(x):", max_tokens=32):
        print(chunk["text"], end="")
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from specray.config import AppConfig
from specray.coordinator.cascade import CascadeEngine
from specray.coordinator.scheduler import Event, Request, RequestError, Scheduler, Speculation
from specray.heap import freeze_startup_heap
from specray.metrics import MetricsSink, SpecMetrics
from specray.policy.trace import json_lines
from specray.serve.actors import ActorWorker
from specray.serve.autoscaling import BreakEvenCache, coordinator_stats
from specray.serve.protocol import Busy, SpeculationOptions, usage_from_stats
from specray.spec.params import SamplingParams

log = logging.getLogger("specray")



class TargetUnavailable(RuntimeError):
    """The target level failed: requests in flight end with a 503 error."""


def error_code(exc: BaseException) -> str:
    """The OpenAI error code a failed request is answered with (the `code` label of the error counter)."""
    return "invalid_request" if isinstance(exc, RequestError) else "model_unavailable"


def _speculation(spec: Mapping[str, Any] | SpeculationOptions | Speculation | None) -> Speculation | None:
    if spec is None or isinstance(spec, Speculation):
        return spec
    opts = spec if isinstance(spec, SpeculationOptions) else SpeculationOptions.model_validate(dict(spec))
    return Speculation(opts.method, opts.num_speculative_tokens, opts.verify, opts.tree_shape)


#: builds a metrics sink in the process that records (Serve: `RayMetricsSink`, made in the replica)
SinkFactory = Callable[[], MetricsSink]


class Coordinator:
    """Owns the cascade (level actors or in-process workers), the scheduler and the metrics.

    `metric_sinks`: where metrics go besides this process's registry (the `/metrics` route); `build_app`
    passes `RayMetricsSink` so the node metrics agents export them cluster-wide. `freeze_heap`: freeze the heap
    once started (`specray.heap`); `build_app` sets it for its replicas, each a process of its own (a
    coordinator built among others in one process, as in the tests, leaves the heap alone)."""

    def __init__(self, config: Mapping[str, Any] | AppConfig, factories: Sequence[Any] | None = None,
                 metric_sinks: Sequence[SinkFactory] = (), freeze_heap: bool = False) -> None:
        self.config = config if isinstance(config, AppConfig) else AppConfig.model_validate(dict(config))
        server = self.config.server
        t0 = time.perf_counter()
        self._launched = None
        if server.in_process:
            from specray.coordinator.generate import build_levels, level_from_config

            if factories is not None:
                levels = [level_from_config(lc, worker=f() if f and not lc.is_lookup else None)
                          for lc, f in zip(self.config.cascade.levels, factories)]
            else:
                levels = build_levels(self.config.cascade)
        else:
            from specray.serve.launch import launch_levels

            self._launched = launch_levels(self.config.cascade, factories, name_prefix=None)
            levels = self._launched.levels
        self.levels = levels
        target = levels[-1].worker
        self.tokenizer = getattr(target, "tokenizer", None)
        nesting = self._launched.nesting if self._launched is not None else None
        self.engine = CascadeEngine(levels, overlap=server.overlap, nesting=nesting)
        self.max_context = self.engine.max_context or 4096
        self.vocab_size = target.vocab_size
        self.model_name = server.model_name
        self.metrics = SpecMetrics(model_name=self.model_name, sinks=[make() for make in metric_sinks])
        self.planner = None
        self.last_round: tuple[float, int, dict] | None = None  # autoscaling: regime of the latest round
        self.break_even_cache = BreakEvenCache()
        self._answers_seen = 0  # planner.answers at the latest round (metrics: was the planner asked?)
        pol = self.config.policy
        if pol.adaptive and len(levels) > 1:
            from specray.policy.planner import Planner

            trace = json_lines(pol.trace_file) if pol.trace_file else None
            self.planner = Planner(levels, k_max=pol.k_max, trace=trace, **pol.planner_kwargs()).attach(self.engine)
        self.scheduler = Scheduler(
            self.engine, self.tokenizer, max_batch_size=server.max_batch_size, planner=self.planner,
            pipeline=server.pipeline and not server.in_process,
            stop_token_ids=getattr(target, "eos_token_ids", ()) or (), on_round=self._on_round,
            on_queue=self.metrics.observe_queue,
        )
        if self.scheduler.pipeline:  # two groups' rounds interleave at the middle level: no request would be the
            self.engine.drafter.follow = False  # one its follow-on was drafted for (docs/architecture.md)
        self.api_key = server.api_key or os.environ.get("SPECRAY_API_KEY") or None
        self.started = time.time()
        if freeze_heap:  # a Serve replica, this process's one long-lived object: its startup heap, the cascade
            freeze_startup_heap()  # and the planner included, stays out of the collector's walks while serving
        log.info("specray coordinator ready in %.1fs: %s", time.perf_counter() - t0,
                 " -> ".join(lv.name for lv in levels))

    # ----- Serve hooks ----------------------------------------------------------------------------
    def __serve_build_asgi_app__(self):
        from specray.serve.http import build_http_app

        return build_http_app(self)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics for Serve's policies (batch, queue, regime, break-even batch)."""
        return coordinator_stats(self)

    def __del__(self) -> None:  # best effort: owned actors die with the replica anyway
        launched = getattr(self, "_launched", None)
        if launched is not None:
            try:
                launched.shutdown()
            except Exception:
                pass

    # ----- metrics --------------------------------------------------------------------------------
    def _on_round(self, batch: int, plan_sizes: Mapping[Any, int], seconds: float) -> None:
        regime = self.planner.regime(batch) if self.planner is not None else None
        self.last_round = (time.monotonic(), batch, dict(plan_sizes))
        names = {self.engine.plan_name(p): n for p, n in plan_sizes.items()}
        reason = None
        if self.planner is not None:  # the planner is asked only when some sequence takes its plan
            answers = self.planner.answers
            reason = self.planner.last_reason if answers != self._answers_seen else "request"
            self._answers_seen = answers
        self.metrics.observe_round(batch, names, seconds, regime=regime, reason=reason)
        log.debug("round: batch %d, %s, %.3f s, planner: %s", batch, names, seconds, reason)

    # ----- core request path ----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this server has no tokenizer; send token ids")
            if chat:
                return self.apply_chat_template([{"role": "user", "content": prompt}])
            return list(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("messages: this model has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    async def run(self, req: Request) -> AsyncIterator[Event]:
        """Scheduler events for one request, with latency metrics; the caller closing it cancels it. The latency
        clock starts at `req.arrival` where the HTTP server set it: time to first token and end to end then
        include parsing, tokenization and the wait for admission, as a client sees them."""
        t0 = time.perf_counter() if req.arrival is None else req.arrival
        ttft = None
        agen = self.scheduler.generate(req)
        last: Event | None = None
        try:
            async for ev in agen:
                if ttft is None and ev.token_ids:
                    ttft = time.perf_counter() - t0
                last = ev
                if ev.finished and ev.error is not None:
                    raise self._map_error(ev.error)
                yield ev
        finally:
            await agen.aclose()
            if last is None or not last.finished:
                self.metrics.observe_cancelled()
            elif last.error is not None:
                self.metrics.observe_error(error_code(self._map_error(last.error)))
            else:
                self.metrics.observe_request(last.stats, last.finish_reason or "length", last.prompt_tokens,
                                             last.completion_tokens, ttft, time.perf_counter() - t0)

    @staticmethod
    def _map_error(exc: BaseException) -> BaseException:
        """A round that failed took its requests with it: the model is (at least briefly) unavailable."""
        if isinstance(exc, RequestError):
            return exc
        return TargetUnavailable(f"the model is unavailable: {exc}")

    def make_request(
        self, prompt_ids: list[int], *, max_tokens: int | None, temperature: float = 0.0, top_p: float = 1.0,
        top_k: int = 0, seed: int | None = None, stop: Sequence[str] | str | None = None,
        speculation: Mapping[str, Any] | SpeculationOptions | None = None, ignore_eos: bool = False,
        stop_token_ids: Sequence[int] | None = None, arrival: float | None = None, min_p: float = 0.0,
        presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
        logprobs: int | None = None,
    ) -> Request:
        """A scheduler request; `arrival` (`time.perf_counter()` when the HTTP server received it) starts its
        latency clock (`run`)."""
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise RequestError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context "
                               f"of {self.max_context}")
        if max_tokens is not None and max_tokens > room:
            raise RequestError(f"max_tokens: at most {room} for this prompt (context {self.max_context})")
        try:
            sampling = SamplingParams(float(temperature), int(top_k if top_k and top_k > 0 else 0), float(top_p),
                                      seed, min_p=float(min_p), presence_penalty=float(presence_penalty),
                                      frequency_penalty=float(frequency_penalty),
                                      repetition_penalty=float(repetition_penalty), logprobs=logprobs)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        self.check_target_supports(sampling)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        spec = _speculation(speculation)  # a seeded request verifies by the coupled method (`Scheduler._admit`)
        if stop_token_ids and any(not 0 <= t < self.vocab_size for t in stop_token_ids):
            raise RequestError(f"stop_token_ids: every id must be in [0, {self.vocab_size})")
        return Request(prompt_ids, sampling, max_tokens or room, stops, ignore_eos, spec,
                       stop_token_ids=tuple(stop_token_ids or ()), arrival=arrival)

    def check_target_supports(self, sampling: SamplingParams) -> None:
        """Refuse (400, naming the field) what the target's backend cannot serve exactly: penalties and
        log-probabilities need a worker that declares them (`WorkerCaps`; the hf backend does, vLLM's do not).
        A router holds no levels: the pool that runs the request checks it (`CascadeEngine.new_sequence`)."""
        if not self.levels:
            return
        caps = self.levels[-1].caps
        backend = f"the target level {self.levels[-1].name!r}"
        if sampling.penalized and not (caps is not None and caps.penalties):
            field = next(name for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                                     ("repetition_penalty", 1.0))
                         if getattr(sampling, name) != neutral)
            raise RequestError(f"{field}: penalties are not supported by {backend} (its backend does not apply "
                               "them); use a level of kind hf as the target")
        if sampling.logprobs is not None and not (caps is not None and caps.logprobs):
            raise RequestError(f"logprobs: log-probabilities are not reported by {backend} (its backend does not "
                               "give them); use a level of kind hf as the target")

    # ----- Python handle API ----------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: Sequence[str] | str | None = None, speculation: Mapping[str, Any] | None = None,
                       chat: bool = False, ignore_eos: bool = False,
                       stop_token_ids: Sequence[int] | None = None, min_p: float = 0.0,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0) -> dict[str, Any]:
        """Generate to completion; returns text, token ids, finish reason and usage (with speculation)."""
        req = self.make_request(self.tokenize_prompt(prompt, chat), max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop, speculation=speculation,
                                ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, min_p=min_p,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty)
        text, ids, last = [], [], None
        async for ev in self.run(req):
            text.append(ev.text)
            ids.extend(ev.token_ids)
            last = ev
        assert last is not None
        return {"text": "".join(text), "token_ids": ids, "finish_reason": last.finish_reason,
                "usage": usage_from_stats(last.prompt_tokens, last.completion_tokens, last.stats).model_dump()}

    async def generate_stream(self, prompt: str | Sequence[int], max_tokens: int = 64, temperature: float = 0.0,
                              top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                              stop: Sequence[str] | str | None = None,
                              speculation: Mapping[str, Any] | None = None, chat: bool = False,
                              ignore_eos: bool = False, stop_token_ids: Sequence[int] | None = None,
                              min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                              repetition_penalty: float = 1.0) -> AsyncIterator[dict[str, Any]]:
        """Stream dicts {text, token_ids, finished, finish_reason[, usage]} as tokens are accepted."""
        req = self.make_request(self.tokenize_prompt(prompt, chat), max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop, speculation=speculation,
                                ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, min_p=min_p,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty)
        async for ev in self.run(req):
            out: dict[str, Any] = {"text": ev.text, "token_ids": ev.token_ids, "finished": ev.finished,
                                   "finish_reason": ev.finish_reason}
            if ev.finished:
                out["usage"] = usage_from_stats(ev.prompt_tokens, ev.completion_tokens, ev.stats).model_dump()
            yield out

    async def reset_prefix_cache(self) -> list[str]:
        """Every model level forgets the prompt prefixes it cached from finished requests, as vLLM's
        `POST /reset_prefix_cache` does, and a suffix level the outputs it learned from: a benchmark's modes then
        each start cold on the same prompts. Only while no request runs (`Busy` otherwise: the levels' workers
        belong to the round loop). The levels reset."""
        if self.scheduler.num_active:
            raise Busy(f"{self.scheduler.num_active} requests are running: reset the prefix caches when idle")
        return [lv.name for lv in self.levels if await asyncio.to_thread(lv.forget_cached)]

    async def health(self) -> dict[str, Any]:
        """Liveness of every model level (ping through the protocol's stats call)."""
        out: dict[str, Any] = {"status": "ok", "levels": {}}
        for lv in self.levels:
            if lv.worker is None:
                out["levels"][lv.name] = "in-process"
                continue
            try:
                st = await asyncio.wait_for(asyncio.to_thread(lv.worker.stats), timeout=10)
                out["levels"][lv.name] = {"live_sequences": st.live_sequences, "cache_bytes": st.cache_bytes,
                                          **{k: v for k, v in st.extra.items() if k.startswith("prefix_cache_")}}
                if isinstance(lv.worker, ActorWorker):  # its actor's direct transport (docs/serving.md)
                    tr = await asyncio.wait_for(asyncio.to_thread(lv.worker.transport_stats), timeout=10)
                    out["levels"][lv.name].update({f"transport_{k}": v for k, v in tr.items()})
            except Exception as exc:
                out["levels"][lv.name] = f"unavailable: {exc}"
                if lv is self.levels[-1]:
                    out["status"] = "unavailable"
        out["active"] = self.scheduler.num_active
        out["cascade"] = self.engine.level_status()  # "down": dropped until it answers again
        if self.planner is not None:  # at the running batch (1 when idle)
            out["planner"] = self.planner.describe(self.scheduler.num_active)
        out["pid"] = os.getpid()
        return out
