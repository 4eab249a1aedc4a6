"""Continuous batching: requests join and leave the running batch between rounds.

The scheduler owns one asyncio loop task. Each iteration it admits waiting requests (up to
`max_batch_size`), groups the active sequences by their plan (a per-request `speculation` override or the
planner's choice) and runs one engine round per group in a worker thread, then streams the newly
committed tokens to each request (incremental detokenization, stop strings) and releases finished,
failed or cancelled sequences on every level. With `pipeline=True` and thread-safe workers (Ray actor
proxies), the groups' rounds run concurrently, so a drafter on one device works on one group while the
target on another device verifies the other.

Pure Python: no Ray, no HTTP. The Serve deployment wraps it; tests drive it with fake workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from specray.coordinator.cascade import CascadeEngine, Plan, Seq
from specray.coordinator.state import Planning
from specray.coordinator.stats import LevelStats, named_stats
from specray.coordinator.stream import IncrementalDetokenizer, StopChecker
from specray.spec.params import SamplingParams, TokenLogprob, TreeShape, VerifyMethod

log = logging.getLogger(__name__)

SPECULATION_CHOICES = ("auto", "none", "ngram", "draft", "cascade", "hybrid")


@runtime_checkable
class RoundTimed(Protocol):
    """A planner that is told how long each round it chose plans for took (wall seconds, every group): the cost
    of what no worker call's timing shows, such as a level catching up on rows it has not seen. `tokens`: what the
    round committed, where it was one group of the planner's rows, none of them in its first round (a prefill);
    else None (the round's time is not its plan's)."""

    def on_round(self, batch: int, seconds: float, tokens: int | None = None) -> None: ...


class RequestError(ValueError):
    """A request the cascade cannot serve as asked (maps to HTTP 400)."""


@dataclass(frozen=True)
class Speculation:
    """Per-request override of the server's speculation (the HTTP `speculation` extension field)."""

    method: str = "auto"
    num_speculative_tokens: int | None = None
    verify_method: VerifyMethod | None = None
    #: the token tree of the level drafting for the target (`TreeShape`; width 1: chains); None: the level's own
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_CHOICES:
            raise RequestError(f"speculation.method must be one of {SPECULATION_CHOICES}, got {self.method!r}")


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    speculation: Speculation | None = None
    request_id: str | None = None
    #: more tokens that end the sequence (besides EOS, which `ignore_eos` drops); their text is not output
    stop_token_ids: Sequence[int] = ()
    #: `time.perf_counter()` when the server received the request (None: when it reaches the coordinator)
    arrival: float | None = None


@dataclass
class Event:
    """One streamed update: new token ids and the text they complete; the last one carries the result."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[str, LevelStats] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: BaseException | None = None
    #: the target's log-probabilities of `token_ids`, one each (None: the request asked for none)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Live:
    req: Request
    seq: Seq
    plan: Plan | None
    method: VerifyMethod | None
    tree: TreeShape | None
    queue: asyncio.Queue
    detok: IncrementalDetokenizer | None
    stopper: StopChecker | None
    arrived: float
    cancelled: bool = False


@dataclass
class SchedulerStats:
    rounds: int = 0
    max_batch_observed: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # recent batch sizes (bounded)
    active: int = 0
    waiting: int = 0


class Scheduler:
    """Continuous-batching round loop over a `CascadeEngine`.

    planner(batch_size) -> Plan picks the plan for requests without an override (default: the engine's
    configured plan). Metrics hooks: on_round(batch_size, {plan: group size}, seconds) after each round;
    on_queue(running, waiting) whenever the number of sequences in the batch or waiting for a place changes.
    """

    def __init__(
        self,
        engine: CascadeEngine,
        tokenizer=None,
        *,
        max_batch_size: int = 32,
        planner: Callable[[int], Plan] | None = None,
        pipeline: bool = False,
        stop_token_ids: Sequence[int] = (),
        on_round: Callable[[int, dict[Plan, int], float], None] | None = None,
        on_queue: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.planner = planner
        self.pipeline = pipeline
        self.stop_token_ids = tuple(stop_token_ids)
        self.on_round = on_round
        self.on_queue = on_queue
        self._queue_seen = (0, 0)
        self._waiting: list[_Live] = []
        self._active: list[_Live] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Rounds run one after another in ONE thread unless pipelined: an in-process worker's OpenMP team belongs to
        # the OS thread that calls it, and a pool of several threads hands consecutive rounds to different ones
        # (the next round is submitted before the last thread is counted idle), whose teams then spin against
        # each other on the same cores between steps (docs/architecture.md, "One thread for the rounds").
        self._pool = ThreadPoolExecutor(max_workers=4 if pipeline else 1, thread_name_prefix="specray-round")
        self._ids = itertools.count()
        self.stats = SchedulerStats()

    # ----- plans ----------------------------------------------------------------------------------
    @property
    def planner(self) -> Callable[[int], Plan] | None:
        return self._planner

    @planner.setter
    def planner(self, planner: Callable[[int], Plan] | None) -> None:
        """What the planner takes is read once here, not checked against its protocols every round."""
        self._planner = planner
        self._groups_planner = planner if isinstance(planner, Planning) else None
        self._round_timed = planner if isinstance(planner, RoundTimed) else None

    def plan_for(self, spec: Speculation | None) -> Plan | None:
        """The fixed plan a request asked for, or None to let the planner decide each round."""
        if spec is None or spec.method == "auto":
            if spec is not None and spec.num_speculative_tokens is not None:
                p = self.engine.default_plan
                return Plan(p.levels, tuple(spec.num_speculative_tokens for _ in p.k))
            return None
        eng, top = self.engine, self.engine.top
        if spec.method == "none":
            return Plan((top,), ())
        if spec.method == "ngram":
            if not eng.levels[0].is_ngram or top == 0:
                raise RequestError("speculation.method 'ngram': this server has no n-gram level")
            levels = (0, top)
        elif spec.method == "draft":
            models = [i for i in range(top) if not eng.levels[i].is_ngram]
            if not models:
                raise RequestError("speculation.method 'draft': this server has no draft model level")
            levels = (models[-1], top)
        elif spec.method == "hybrid":  # per row: the lookup's match, else the largest draft model's draft
            models = [i for i in range(top) if not eng.levels[i].is_ngram]
            if not eng.levels[0].is_ngram or not models:
                raise RequestError("speculation.method 'hybrid': this server needs an n-gram (or suffix) level and a "
                                   "draft model level")
            levels = (0, models[-1], top)
        else:  # cascade
            levels = tuple(range(top + 1))
            if len(levels) < 2:
                raise RequestError("speculation.method 'cascade': this server runs the target alone")
        k = spec.num_speculative_tokens
        ks = tuple(k if k is not None else eng.levels[i].k for i in levels[:-1])
        return Plan(levels, ks, hybrid=spec.method == "hybrid")

    # ----- public API -----------------------------------------------------------------------------
    async def generate(self, req: Request) -> AsyncIterator[Event]:
        """Admit a request and yield its events; closing the iterator cancels it (freed within a round)."""
        live = self._admit(req)
        try:
            while True:
                ev: Event = await live.queue.get()
                yield ev
                if ev.finished:
                    return
        finally:
            if not live.seq.finished:
                live.cancelled = True
                self._wake.set()

    def _admit(self, req: Request) -> _Live:
        plan = self.plan_for(req.speculation)
        method = req.speculation.verify_method if req.speculation else None
        if method is None and req.sampling.seed is not None and req.sampling.temperature > 0:
            # A seed promises reproducible output, but which levels draft changes from round to round (the planner
            # follows live timings). Coupled verification is exact and its output depends only on (seed, target),
            # never on the drafter, so seeded requests use it unless they ask otherwise.
            method = VerifyMethod.COUPLED
        tree = req.speculation.tree if req.speculation else None
        stop_ids = (*(() if req.ignore_eos else self.stop_token_ids), *req.stop_token_ids)
        rid = req.request_id or f"req-{next(self._ids)}"
        try:
            seq = self.engine.new_sequence(req.prompt_ids, req.sampling, req.max_tokens, stop_ids, seq_id=rid)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids) if self.tokenizer is not None else None
        stopper = StopChecker(list(req.stop)) if req.stop else None
        live = _Live(req, seq, plan, method, tree, asyncio.Queue(), detok, stopper, time.perf_counter())
        self._waiting.append(live)
        self._report_queue()
        self._ensure_loop()
        self._wake.set()
        return live

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="specray-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for live in self._active + self._waiting:
            self._finish(live, "abort", error=RuntimeError("scheduler closed"))
        self._pool.shutdown(wait=False)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Admitted requests waiting for room in the running batch."""
        return len(self._waiting)

    # ----- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._reap_cancelled()
            room = self.max_batch_size - len(self._active)
            if room > 0 and self._waiting:
                self._active.extend(self._waiting[:room])
                del self._waiting[:room]
            self.stats.active, self.stats.waiting = len(self._active), len(self._waiting)
            self._report_queue()
            if not self._active:
                self._wake.clear()
                if not self._waiting:
                    await self._wake.wait()
                continue
            try:
                groups = self._groups()
            except Exception as exc:  # a planner that raises fails this round's requests, never the loop
                log.exception("planning a round failed")
                self._fail_group(list(self._active), exc)
                self._active = [x for x in self._active if not x.seq.finished]
                continue
            planned = any(live.plan is None for live in self._active)
            if self.pipeline and len(groups) == 1 and len(groups[0][3]) >= 2:
                plan, method, tree, members = groups[0]
                half = len(members) // 2
                groups = [(plan, method, tree, members[:half]), (plan, method, tree, members[half:])]
            # a round that measures its plan: one group of the planner's rows, none in its first round (a prefill)
            measures = len(groups) == 1 and all(live.plan is None and live.seq.rounds > 0 for live in self._active)
            t0 = time.perf_counter()
            if self.pipeline:  # groups overlap across levels (needs thread-safe workers, e.g. actor proxies)
                results = await asyncio.gather(
                    *[loop.run_in_executor(self._pool, self._run_group, *g) for g in groups], return_exceptions=True
                )
            else:
                results = []
                for g in groups:
                    try:
                        results.append(await loop.run_in_executor(self._pool, self._run_group, *g))
                    except Exception as exc:  # handed to the group's requests below
                        results.append(exc)
            dt = time.perf_counter() - t0
            batch = len(self._active)
            self.stats.rounds += 1
            self.stats.max_batch_observed = max(self.stats.max_batch_observed, batch)
            self.stats.batch_sizes.append(batch)
            del self.stats.batch_sizes[:-1000]
            for (_plan, _method, _tree, members), res in zip(groups, results):
                if isinstance(res, BaseException):
                    self._fail_group(members, res)
                else:
                    for live, toks in zip(members, res):
                        self._deliver(live, toks)
            if planned and self._round_timed is not None:
                tokens = None
                if measures and not isinstance(results[0], BaseException):
                    tokens = sum(len(t) for t in results[0])
                self._round_timed.on_round(batch, dt, tokens)
            if self.on_round is not None:
                sizes: dict[Plan, int] = {}
                for plan, _m, _t, members in groups:
                    sizes[plan] = sizes.get(plan, 0) + len(members)
                try:
                    self.on_round(batch, sizes, dt)
                except Exception:  # metrics must never break serving
                    log.exception("on_round hook failed")
            self._active = [x for x in self._active if not x.seq.finished]
            await asyncio.sleep(0)  # let consumers run and new requests arrive

    def _report_queue(self) -> None:
        now = (len(self._active), len(self._waiting))
        if self.on_queue is None or now == self._queue_seen:
            return
        self._queue_seen = now
        try:
            self.on_queue(*now)
        except Exception:  # metrics must never break serving
            log.exception("on_queue hook failed")

    def _groups(self) -> list[tuple[Plan, VerifyMethod | None, TreeShape | None, list[_Live]]]:
        """The active sequences by what their round runs: (plan, verification method, token-tree shape)."""
        auto = self._auto_plans()
        groups: dict[tuple[Plan, VerifyMethod | None, TreeShape | None], list[_Live]] = {}
        for live in self._active:
            if live.plan is not None:
                plan = live.plan
            else:  # the planner's share: the first (oldest) sequences take a probe plan when there is one
                plan = auto[0][0]
                auto[0][1] -= 1
                if auto[0][1] <= 0 and len(auto) > 1:
                    auto.pop(0)
            groups.setdefault((plan, live.method, live.tree), []).append(live)
        return [(plan, method, tree, members) for (plan, method, tree), members in groups.items()]

    def _auto_plans(self) -> list[list]:
        """[[plan, count], ...] for the sequences without an override (a planner may split them)."""
        if self.planner is None:
            return [[self.engine.default_plan, len(self._active)]]
        auto = [live.seq for live in self._active if live.plan is None]
        if not auto:  # every sequence runs its own override: a planner round here would spend a probe on nothing
            return []
        if self._groups_planner is not None:
            return [[p, c] for p, c in self._groups_planner.plan_groups(len(auto), self.engine.backlog(auto))]
        return [[self.planner(len(self._active)), len(self._active)]]

    def _run_group(self, plan: Plan, method: VerifyMethod | None, tree: TreeShape | None,
                   members: list[_Live]) -> list[list[int]]:
        return self.engine.step([m.seq for m in members], plan, method, tree)

    def _deliver(self, live: _Live, toks: list[int]) -> None:
        seq = live.seq
        shown = toks
        if seq.finish_reason == "stop" and toks and toks[-1] in seq.stop_ids:
            shown = toks[:-1]  # a stop token ends the text without being part of it (EOS decodes to nothing)
        text = live.detok.push(shown) if shown and live.detok is not None else ""
        stopped = False
        if live.stopper is not None and text:
            text, stopped = live.stopper.push(text)
        if not stopped and seq.finished:  # eos or length: flush what was held back
            tail = live.detok.flush() if live.detok is not None else ""
            if live.stopper is not None:
                tail, stopped = live.stopper.push(tail)
                if not stopped:
                    tail += live.stopper.flush()
            text += tail
        if stopped:
            seq.finished, seq.finish_reason = True, "stop"
        if seq.finished:
            self._finish(live, seq.finish_reason or "length", text=text, toks=toks)
        elif toks or text:
            live.queue.put_nowait(Event(toks, text, logprobs=self._logprobs(seq, toks)))

    @staticmethod
    def _logprobs(seq: Seq, toks: Sequence[int]) -> list[TokenLogprob] | None:
        """The log-probabilities of `toks`, the last tokens committed to `seq` (None: it asked for none)."""
        if seq.sampling.logprobs is None:
            return None
        end = len(seq.output)
        return seq.logprobs[end - len(toks) : end]

    def _finish(self, live: _Live, reason: str, text: str = "", toks: Sequence[int] = (),
                error: BaseException | None = None) -> None:
        seq = live.seq
        seq.finished, seq.finish_reason = True, reason
        try:
            self.engine.release(seq)
        except Exception:  # a dead level cannot free; it lost the state anyway
            log.warning("release of %s failed", seq.seq_id, exc_info=True)
        stats = named_stats([lv.name for lv in self.engine.levels], seq.stats)
        live.queue.put_nowait(Event(list(toks), text, True, reason, stats, seq.prompt_len, len(seq.output), error,
                                    self._logprobs(seq, toks)))

    def _fail_group(self, members: list[_Live], exc: BaseException) -> None:
        log.error("round failed for %d sequences: %s", len(members), exc)
        for live in members:
            if not live.seq.finished:
                self._finish(live, "error", error=exc)

    def _reap_cancelled(self) -> None:
        for pool in (self._active, self._waiting):
            for live in [x for x in pool if x.cancelled]:
                if not live.seq.finished:
                    self._finish(live, "cancelled")
                pool.remove(live)
