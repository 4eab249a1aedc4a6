"""What one round costs outside the models: a GPU-time simulation of the coordination overhead.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_overhead.py \
        --out benchmarks/results/overhead-<date>.json                     # all paths, plans, batches 1 16 64
    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_overhead.py --preset qwen-cpu --paths inproc actors

On a GPU a decode step takes a few milliseconds, and every millisecond a round spends outside the models
(coordinator Python, Ray hops, serialization) is paid every round; a CPU benchmark, whose steps take hundreds of
milliseconds, hides it. Here every level is a `specray.testing.sim.SimWorker`: the real protocol logic of the
fake Markov model (real tokens, real acceptance, every coordinator code path), whose calls sleep until they have
lasted what the model's forwards would take on its device (`PRESETS`: Llama 1B / 8B / 70B-TP4 on H100, or the
project's measured Qwen CPU steps). Everything else is measured.

Paths (the engine is driven the same way on each: `generate(CascadeEngine(levels, overlap=...), prompts,
max_tokens, ignore_eos=True)`):
  inproc     every level in this process
  actors     one Ray actor per level on one node (`launch_levels`, placement group PACK)
  multinode  one level per node of a local three-node Ray cluster on this box (`LocalCluster`, levels pinned to
             nodes by custom resources, placement SPREAD): cross-raylet calls, still over loopback
On the Ray paths each configuration runs once per transport (`--transports`, side by side, same actors; see
specray/serve/actors.py): `direct` (the level's own socket, the default, with nested drafting: the middle level
of the cascade runs its inner rounds in its actor, calling the level below directly; and relays: the level right
below the target sends it the drafts itself, specray/serve/relay.py; and follow-ons: the target sends its verdict
to the relaying middle level, which drafts the next round on it, specray/serve/follow.py), `nofollow` (direct,
nested and relayed, without follow-ons), `norelay` (direct and nested, the drafts back through the coordinator),
`flat` (direct, the coordinator making every call), `poll` (direct, nested and
relayed, both ends polling near a due frame instead of parking in `recv`: `cascade.poll`), `compiled` (a Ray
Compiled Graph per level) and `call` (plain actor calls), labelled `actors` / `actors-nofollow` / `actors-norelay` /
`actors-flat` /
`actors-poll` / `actors-compiled` / `actors-call` (and `multinode...`).
Plans: plain (target alone), draft (8B K -> 70B-TP4), cascade (1B K -> 8B K -> 70B-TP4), ngram-cascade (n-gram
lookup K -> 8B K -> 70B-TP4: the lookup runs in the coordinator, or beside the 8B with nested drafting; its
rounds are reported but not held to the targets below); greedy, K per level,
each with and without overlap (drafting the next round while the target verifies; not for plain). The qwen-cpu
preset has two levels (0.5B -> 1.5B): plain and draft. The h200-hf preset has the hf backend's own step times
measured on an H200 (benchmarks/bench_gpu.py: 1B -> 8B, plain and draft), to set the simulated round beside the
real one measured there.

`--churn` drives the engine as a server does instead (`stream`): the batch stays full, rows of varied lengths end
and new ones join between rounds, so a middle level's follow-ons meet the requests serving sends them (their
counts per run: JSON `follow`).

Definitions, per run (one timed `generate` after an untimed warm-up on the same prompts and engine):
  rounds              engine rounds (target verifications) = the most rounds any row took
  wall                seconds of the timed `generate`
  model               length of the union of all workers' busy intervals (each propose/verify call from its
                      start to the end of its simulated device time; levels computing at the same time, as
                      with overlap, count once). `time.monotonic()` is one clock for every process on the box.
  overhead / round    (wall - model) / rounds
  fraction of ideal   model / wall
  in calls            union of the coordinator's worker calls as its client sees them (an actor call from send
                      to result); in calls - model = hops (Ray, serialization, the actor's own dispatch);
                      wall - in calls = coordinator time with no call in flight
  calls / round       worker calls per level and kind, from the workers' traces, over rounds
  hop / call          per level: (client seconds - busy seconds) / calls, over its propose and verify calls
  add/free            the coordinator's calls other than propose / verify (sequence add and free) and their
                      client seconds: part of the overhead, paid per sequence rather than per round
  gaps                (JSON `gaps`, runs without overlap) the idle time between one model call's end and the next
                      one's start, per round and by transition (e.g. 'llama-70b-tp4:verify > llama-1b:propose': the
                      verdict back, the coordinator's commit and plan, the requests down to the small level), with
                      how often each occurs per round: where the overhead sits in the round
  coordinator GC      this process's garbage collections during the timed run, their total and longest pause
                      (flagged in the row when one lasts over 1 ms; the startup heap is frozen after the warm-up,
                      as the served coordinator and the level actors freeze theirs: specray/heap.py)
  worker Python over its cost / sleep overshoot
                      where a worker's real logic took longer than its cost model, or its sleep woke late, the
                      busy interval grows by that and it counts as model time (flagged in the row when large:
                      other work on the box, or the fake model's Python at large batches)
  speedup             plain's wall / this wall at the same batch and path (simulated speedup); model-only
                      speedup: plain's model / this model (what zero overhead would give)
  planner CPU         with --planner: the planner's own CPU time (thread time of the coordinator's thread in its
                      plan() and observer hooks) per round, part of the overhead; less sensitive than the wall
                      time to other work on the box (JSON: planner.cpu_ms_per_round, and per hook)
  acceptance          per verifying level, from `generate`'s stats: alpha1 = drafts whose first token was
                      accepted / drafts (the per-token rate), rate = accepted / drafted tokens
  bound               Leviathan et al.: E[L] / (K c + 1), E[L] from the measured per-position acceptance,
                      c = drafter step / target step at the run's batch size (the presets' one-token-per-row
                      forward). Cascade: the middle -> target pair's bound with the middle level's cost per
                      token it proposes made nested: c_eff = c_mid x (K_small c_small + 1) / E[L_mid], where
                      K_small = the small level's measured mean draft length (it drafts what the middle level
                      still owes, often fewer than K) and E[L_mid] = the middle level's measured tokens per inner
                      verification; bound = E[L_target] / (K c_eff + 1). `bound_pair`: the same pair with the
                      middle level as a plain drafter (c = c_mid, its measured acceptance at the target, the small
                      level ignored). Verification is priced as one
                      target step (the extra tokens a verification feeds are not), and with overlap drafting
                      hides behind verification, so there the bound is no upper bound.

Writes the JSON (`--out`) and, with matplotlib installed, a PNG next to it; prints a row per run as it goes
and the issue's targets with PASS/FAIL per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import functools
import gc
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from specray.config import LevelConfig, PolicyConfig
from specray.coordinator import drafting
from specray.coordinator.cascade import CascadeEngine, GenerationResult, Level, Seq, round_plans
from specray.coordinator.generate import Batch, generate
from specray.coordinator.stats import LevelStats, named_stats
from specray.heap import freeze_startup_heap
from specray.policy.planner import Planner
from specray.spec.bound import expected_accepted_length, speedup_bound
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams
from specray.testing.sim import PRESETS, SimWorker, StepCostModel, sim_factory, union_length

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64
ORDER = 3
PROMPT_LEN = 16
PATHS = ("inproc", "actors", "multinode")
PLANS = ("plain", "draft", "cascade", "ngram-cascade")
#: the n-gram level of the ngram-cascade plan (a lookup in the coordinator, or beside the middle level when nested)
NGRAM = "ngram"
TIMED_METHODS = ("add", "free", "free_many", "rollback", "propose", "verify", "propose_async", "verify_async",
                 "nested")
MODEL_KINDS = ("propose", "verify")
#: the issue's targets: overhead per round (ms) by (path kind, batch)
OVERHEAD_TARGET_MS = {("inproc", 1): 1.0, ("inproc", 64): 3.0, ("actors", 1): 2.0, ("actors", 64): 5.0}
FRACTION_TARGET = 0.95
#: the tail cut a middle level on a GPU gets by default (`LevelConfig.tail_cut`)
GPU_TAIL_CUT = LevelConfig(kind="hf", model="gpu", num_gpus=1).tail_cut
#: a one-minute load average above this before a run is flagged in its row (other work shares the cores)
BUSY_LOAD = 1.5
TARGETS_TEXT = ("targets (issue): overhead per round <= 1 ms (batch 1) / <= 3 ms (batch 64) in-process, <= 2 ms / "
                "<= 5 ms through actors; fraction of ideal >= 0.95 for the cascade at batch 1 through actors")
BOUND_TEXT = ("bound: Leviathan E[L] / (K c + 1), E[L] from the measured per-position acceptance at the target, "
              "c = drafter / target one-token-per-row forward at the run's batch; cascade (nested): c = c_eff = "
              "c_mid x (K_small c_small + 1) / E[L_mid] with the small level's measured mean draft length and the "
              "middle level's measured tokens per inner verification; bound_pair: the middle -> target pair alone "
              "(c = c_mid); verification priced as one target step; with overlap the bound is no upper bound")


@dataclass(frozen=True)
class LevelSpec:
    """One simulated level: its name (= its cost preset unless `step_cost` is given) and how far its table is
    from the target's."""

    name: str
    noise: float = 0.0
    noise_seed: int = 1
    step_cost: StepCostModel | None = None
    order: int = ORDER

    @property
    def cost(self) -> StepCostModel:
        return self.step_cost if self.step_cost is not None else PRESETS[self.name]

    def worker_kwargs(self) -> dict[str, Any]:
        return dict(vocab=VOCAB, order=self.order, table_seed=0, noise=self.noise, noise_seed=self.noise_seed)


#: levels small -> large, and the levels of each plan. A drafter's table is the target's plus noise, chosen so that
#: its greedy choice agrees with the level above on most contexts, as a same-family drafter does (each run reports
#: the measured per-token acceptance and the accepted / drafted rate)
PRESET_LEVELS: dict[str, tuple[LevelSpec, ...]] = {
    "gpu": (LevelSpec("llama-1b", 0.3, 2), LevelSpec("llama-8b", 0.25, 1), LevelSpec("llama-70b-tp4")),
    "qwen-cpu": (LevelSpec("qwen-cpu-0.5b", 0.25, 1), LevelSpec("qwen-cpu-1.5b")),
    "h200-hf": (LevelSpec("h200-hf-1b", 0.3, 2), LevelSpec("h200-hf-8b")),
}
PLAN_LEVELS: dict[str, dict[str, tuple[str, ...]]] = {
    "gpu": {"plain": ("llama-70b-tp4",), "draft": ("llama-8b", "llama-70b-tp4"),
            "cascade": ("llama-1b", "llama-8b", "llama-70b-tp4"),
            "ngram-cascade": (NGRAM, "llama-8b", "llama-70b-tp4")},
    "qwen-cpu": {"plain": ("qwen-cpu-1.5b",), "draft": ("qwen-cpu-0.5b", "qwen-cpu-1.5b")},
    "h200-hf": {"plain": ("h200-hf-8b",), "draft": ("h200-hf-1b", "h200-hf-8b")},
}
#: multinode: which node (custom resource of `LocalCluster`'s DEFAULT_NODES) holds each level
NODE_OF: dict[str, dict[str, str]] = {
    "gpu": {"llama-1b": "head_node", "llama-8b": "draft", "llama-70b-tp4": "target"},
    "qwen-cpu": {"qwen-cpu-0.5b": "draft", "qwen-cpu-1.5b": "target"},
    "h200-hf": {"h200-hf-1b": "draft", "h200-hf-8b": "target"},
}


def make_prompts(batch: int, length: int = PROMPT_LEN, seed: int = 1000) -> list[list[int]]:
    """`batch` prompts of `length` distinct token ids each (a different permutation per row)."""
    out = []
    for b in range(batch):
        g = torch.Generator().manual_seed(seed + b)
        out.append(torch.randperm(VOCAB, generator=g)[:length].tolist())
    return out


def stream(engine: CascadeEngine, batch: int, max_tokens: int, plan: Any, seed: int = 0) -> Batch:
    """Continuous batching, as a server runs it (`--churn`): `batch` rows at all times, each asking a length drawn
    from [max_tokens / 2, 3 max_tokens / 2] (the first rows from [1, 2 max_tokens], so that they end apart); a row
    that ends is freed and a new request takes its place before the next round, until the rows have
    `batch * max_tokens` tokens in all. Rows end and join every few rounds, as they do under load; the batch
    never drains. `out.results[0].rounds` holds the rounds of the whole stream."""
    rng = random.Random(seed)
    plan_of = round_plans(engine, plan)
    made = itertools.count()

    def new_row(lo: int, hi: int) -> Seq:
        i = next(made)
        return engine.new_sequence(make_prompts(1, seed=2000 + i)[0], SamplingParams(), rng.randint(lo, hi))

    rows = [new_row(1, 2 * max_tokens) for _ in range(batch)]
    done: list[Seq] = []
    tokens = rounds = 0
    try:
        while tokens < batch * max_tokens:
            tokens += sum(len(t) for t in engine.step(rows, plan_of(rows, batch)))
            rounds += 1
            for j, s in enumerate(rows):
                if s.finished:
                    engine.release(s)
                    done.append(s)
                    rows[j] = new_row(max(1, max_tokens // 2), max_tokens * 3 // 2)
    finally:
        for s in rows:
            engine.release(s)
    total: dict[str, LevelStats] = {}
    for s in [*done, *rows]:
        for name, st in named_stats([lv.name for lv in engine.levels], s.stats).items():
            total.setdefault(name, LevelStats()).merge(st)
    head = GenerationResult([0] * tokens, None, "length", rounds, {}, None, None)
    return Batch([head], total)


# ------------------------------------------------------------------------------------------ client-side timing


@dataclass
class Call:
    level: str
    method: str
    start: float
    end: float


class ClientLog:
    """Times the coordinator's calls into each level's worker (as its client sees them) by wrapping the worker
    instance's protocol methods in place (the worker keeps its class, so nothing that checks types changes)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def clear(self) -> None:
        self.calls = []

    def patch(self, level: str, worker: Any) -> None:
        for m in TIMED_METHODS:
            fn = getattr(worker, m, None)
            if fn is None or getattr(fn, "_overhead_timed", False):
                continue
            setattr(worker, m, self._wrap(level, m, fn))
        relayed = getattr(worker, "propose_relayed", None)  # a propose that also sends its drafts to the target
        if relayed is not None and not getattr(relayed, "_overhead_timed", False):
            worker.propose_relayed = self._wrap(level, "propose", relayed)
        later = getattr(worker, "verify_later", None)
        if later is not None and not getattr(later, "_overhead_timed", False):
            worker.verify_later = self._wrap_later(level, later)

    def _wrap_later(self, level: str, fn: Callable) -> Callable:
        """A relayed verification (specray.serve.relay) counts as a `verify` call from when the coordinator starts
        waiting for the verdict (after the middle level's reply and its replay) until it has it."""
        log = self

        @functools.wraps(fn)
        def later(*args, **kwargs):
            pending = fn(*args, **kwargs)
            result = pending.result

            def timed_result():
                t0 = time.monotonic()
                try:
                    return result()
                finally:
                    log.calls.append(Call(level, "verify", t0, time.monotonic()))
            pending.result = timed_result
            return pending
        later._overhead_timed = True  # type: ignore[attr-defined]
        return later

    def _wrap(self, level: str, method: str, fn: Callable) -> Callable:
        log = self
        if asyncio.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args, **kwargs):
                t0 = time.monotonic()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    log.calls.append(Call(level, method, t0, time.monotonic()))
            timed_async._overhead_timed = True  # type: ignore[attr-defined]
            return timed_async

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                log.calls.append(Call(level, method, t0, time.monotonic()))
        timed._overhead_timed = True  # type: ignore[attr-defined]
        return timed


# ------------------------------------------------------------------------------------------ backends (paths)


class InprocBackend:
    """Every level a `SimWorker` in this process; traces read from memory."""

    path = "inproc"
    nesting = None

    def __init__(self, specs: Sequence[LevelSpec], k: int, client: ClientLog) -> None:
        self.costs = {s.name: s.cost for s in specs}
        self.workers = {s.name: SimWorker(s.name, s.cost, **s.worker_kwargs()) for s in specs}
        self.levels = {n: Level(n, worker=w, k=k, method="greedy") for n, w in self.workers.items()}
        for n, lv in self.levels.items():
            client.patch(n, lv.worker)
        self.levels[NGRAM] = ngram_level(k)
        self.info: dict[str, Any] = {"levels": {n: {"pid": os.getpid()} for n in self.levels}}

    def drain(self) -> None:
        for w in self.workers.values():
            w.clear_trace()

    def traces(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [r for w in self.workers.values() for r in w.trace if r["start"] >= t0 and r["end"] <= t1]

    def close(self) -> None:
        self.drain()

    def rest(self) -> None:
        """Nothing runs between configurations here."""

    def follow_stats(self) -> dict[str, dict[str, float]]:
        return {}  # follow-ons are the level actors'


class TraceFiles:
    """Reads the JSON-lines traces level actors append to, from where the last read stopped."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.pos = dict.fromkeys(paths, 0)

    def read_new(self) -> list[dict[str, Any]]:
        out = []
        for p, pos in self.pos.items():
            try:
                with open(p, "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # complete lines only
            for line in data[:end].splitlines():
                if line.strip():
                    out.append(json.loads(line))
            self.pos[p] = pos + end
        return out


class RayBackend:
    """One Ray actor per level (`launch_levels` with SimWorker factories): on one node, or one level per node of
    a local multi-node cluster. Ray is started and stopped here, the way tests/ray/conftest.py does it."""

    def __init__(self, path: str, preset: str, specs: Sequence[LevelSpec], k: int, client: ClientLog,
                 trace_dir: str, transport: str = "direct") -> None:
        import ray

        from specray.config import CascadeConfig, LevelConfig, PlacementConfig
        from specray.serve.launch import launch_levels

        self.path = path_label(path, transport)
        self.costs = {s.name: s.cost for s in specs}
        self.cluster = None
        self.launched = None
        if ray.is_initialized():
            ray.shutdown()
        try:
            if path == "multinode":
                from specray.serve.localcluster import LocalCluster

                self.cluster = LocalCluster()
                self.cluster.start()
                ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
                self.cluster.wait_for_nodes()
                placement = PlacementConfig(strategy="SPREAD")
                pins = {s.name: {NODE_OF[preset][s.name]: 1.0} for s in specs}
            else:
                ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
                         log_to_driver=False)
                placement = PlacementConfig(strategy="PACK")
                pins = {}
            self.trace_paths = {s.name: os.path.join(trace_dir, f"{path}-{s.name}.jsonl") for s in specs}
            cfg = CascadeConfig(levels=[
                LevelConfig(kind="ngram", name=NGRAM, num_speculative_tokens=k, prompt_lookup_min=1,
                            prompt_lookup_max=3),
                *(LevelConfig(kind="hf", name=s.name, model=f"sim:{s.name}", num_speculative_tokens=k,
                              verify_method="greedy", num_cpus=1, num_threads=1, resources=pins.get(s.name, {}))
                  for s in specs),
            ], placement=placement, follow=True)  # simulated GPU levels (on CPU levels it defaults to off)
            factories = [None] + [sim_factory(s.name, s.cost, trace_path=self.trace_paths[s.name],
                                              **s.worker_kwargs()) for s in specs]
            self.launched = launch_levels(cfg, factories=factories, name_prefix=f"overhead-{path}",
                                          start_timeout_s=180, transport=_ray_transport(transport),
                                          poll=transport == "poll")
            self.levels = {lv.name: lv for lv in self.launched.levels}
            self.nesting = _nesting(self.launched.nesting, transport)
            for n, lv in self.levels.items():
                if lv.worker is not None:
                    client.patch(n, lv.worker)
            self.files = TraceFiles(list(self.trace_paths.values()))
            self.info = {"levels": {n: {k2: i.get(k2) for k2 in ("node_id", "pid", "num_threads")}
                                    for n, i in self.launched.info.items()},
                         "nodes": len({i.get("node_id") for i in self.launched.info.values()}),
                         "transfer_floor_ms": transfer_floor_ms(), "transfer_floor_step_s": FLOOR_STEP_S}
        except BaseException:
            self.close()
            raise

    def _flush(self) -> None:
        """Level actors write their traces when asked for their stats (never inside a timed call)."""
        for lv in self.levels.values():
            if lv.worker is not None:
                lv.worker.stats()

    def drain(self) -> None:
        self._flush()
        self.files.read_new()

    def follow_stats(self) -> dict[str, dict[str, float]]:
        """Each level actor's follow-on counters (`FollowOns.stats`, via its transport stats)."""
        out = {}
        for n, lv in self.levels.items():
            if lv.worker is not None:
                st = lv.worker.transport_stats()
                out[n] = {k[len("follow_"):]: v for k, v in st.items() if k.startswith("follow_")}
        return out

    def rest(self) -> None:
        """Between configurations: close the levels' connections / compiled graphs (an idle compiled graph's reader
        keeps a core busy, which would slow the next configuration down); the next warm-up makes them again."""
        for lv in self.levels.values():
            if lv.worker is not None:
                lv.worker.close()

    def over(self, transport: str, client: ClientLog) -> TransportView:
        """The same actors reached over another transport."""
        return TransportView(self, transport, client)

    def traces(self, t0: float, t1: float) -> list[dict[str, Any]]:
        self._flush()
        return [r for r in self.files.read_new() if r["start"] >= t0 and r["end"] <= t1]

    def close(self) -> None:
        import ray

        if self.launched is not None:
            self.launched.shutdown()
            self.launched = None
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.stop()
            left = self.cluster.pids()
            if left:
                print(f"warning: Ray processes of the local cluster left running: {left}", file=sys.stderr)
            self.cluster = None


#: how long the echo's handler sleeps, as a level computing a step: a process woken after blocking that long
#: answers more slowly than one woken at once (on a virtual machine, a halted virtual CPU must be woken too)
FLOOR_STEP_S = 0.008


class _Echo:
    """A bare `FrameServer` in an actor of its own: the cost of one request/reply between two processes on
    this box, with nothing of specray's in it."""

    def __init__(self) -> None:
        from specray.serve.direct import FrameServer

        self.server = FrameServer("127.0.0.1", self.handle, poll=False)  # the bare transport

    def handle(self, request: float) -> float:
        t0 = time.monotonic()
        time.sleep(request)
        return time.monotonic() - t0

    def at(self) -> tuple[tuple[str, int], str]:
        return self.server.address, self.server.token


def transfer_floor_ms(samples: int = 60) -> float:
    """Median round trip (ms) of a request to a bare echo actor that was idle FLOOR_STEP_S before it (as a level
    is while the others compute) and whose handler blocks FLOOR_STEP_S, less the time it blocked: the transport
    floor of one call on this box, with nothing of specray's in it."""
    import ray

    from specray.serve.direct import FrameClient

    actor = ray.remote(num_cpus=0)(_Echo).remote()
    try:
        client = FrameClient(*ray.get(actor.at.remote()))
        gaps = []
        for j in range(samples + 5):
            time.sleep(FLOOR_STEP_S)
            t0 = time.monotonic()
            inside = client.call(FLOOR_STEP_S)
            if j >= 5:
                gaps.append(time.monotonic() - t0 - inside)
        client.close()
        return 1000 * statistics.median(gaps)
    finally:
        ray.kill(actor)


# ------------------------------------------------------------------------------------------ one measurement


def conditional_alphas(accepted_per_pos: Sequence[int], num_drafts: int, k: int) -> list[float]:
    """Per-position acceptance given the earlier positions were accepted (Leviathan's alpha_i), from the
    counts of drafts whose first i + 1 tokens were accepted; padded with 0 to k positions."""
    alphas, prev = [], num_drafts
    for j in range(k):
        c = accepted_per_pos[j] if j < len(accepted_per_pos) else 0
        alphas.append(min(1.0, c / prev) if prev else 0.0)
        prev = c
    return alphas


def bound_for(plan_names: Sequence[str], stats: dict[str, Any], k: int, batch: int,
              costs: dict[str, StepCostModel]) -> dict[str, Any]:
    """Leviathan bound of the run (see the module docstring); {} for plain."""
    if len(plan_names) < 2 or NGRAM in plan_names:  # an n-gram level has no step cost of its own
        return {}
    step = {n: costs[n].step_s(batch) for n in plan_names}
    top, mid = plan_names[-1], plan_names[-2]
    st = stats.get(top)
    if st is None or not st["num_drafts"]:
        return {}
    alphas = conditional_alphas(st["accepted_per_pos"], st["num_drafts"], k)
    el_top = expected_accepted_length(alphas)
    c_mid = step[mid] / step[top]
    out = {"E_L": el_top, "alphas": alphas, "c": c_mid, "bound_pair": speedup_bound(alphas, c_mid, k)}
    if len(plan_names) == 2:
        out["bound"] = out["bound_pair"]
        out["formula"] = "E[L] / (K c + 1)"
        return out
    small = plan_names[-3]
    sm = stats.get(mid)
    if sm is None or not sm["num_drafts"]:
        out["bound"] = out["bound_pair"]
        out["formula"] = "pair (no inner drafts recorded)"
        return out
    # the middle level's inner rounds: the small level drafts what the middle level still owes (often fewer than
    # K), so its measured mean draft length prices them; E[L_mid] = tokens an inner verification emits on average
    k_small = sm["draft_tokens"] / sm["num_drafts"]
    el_mid = 1.0 + sum(sm["accepted_per_pos"]) / sm["num_drafts"]
    c_small = step[small] / step[mid]
    c_eff = c_mid * (k_small * c_small + 1.0) / el_mid
    out.update({"E_L_mid": el_mid, "K_small": k_small, "c_small": c_small, "c_eff": c_eff,
                "bound": el_top / (k * c_eff + 1.0),
                "formula": "E[L_top] / (K c_eff + 1), c_eff = c_mid (K_small c_small + 1) / E[L_mid]"})
    return out


class TimedPlanner:
    """Stands in for the planner (as the round's plan callable and as the engine's observer) and adds up the CPU
    time of this thread spent in it (`time.thread_time`: what other processes on the box do counts far less than
    in the wall time), per hook: the planner's own share of the coordinator's overhead."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.cpu: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def _timed(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.cpu[hook] += time.thread_time() - t0
            self.calls[hook] += 1

    def __call__(self, batch: int) -> Any:
        return self._timed("plan", self.planner.plan, batch)

    def plan_groups(self, batch: int, backlog: Any = None) -> Any:
        """As the scheduler asks it (`specray.coordinator.state.Planning`): with the rows' backlog."""
        return self._timed("plan", self.planner.plan_groups, batch, backlog)

    def reset(self) -> None:
        self.cpu.clear()
        self.calls.clear()


def _forwarded(hook: str) -> Callable[..., None]:
    def forward(self: TimedPlanner, *args: Any) -> None:
        self._timed(hook, getattr(self.planner, hook), *args)

    forward.__name__ = hook
    return forward


# the engine's observer hooks the planner takes, timed; defined on the class, so the feed's protocol checks see them
for _hook in ("on_catch_up", "on_call", "on_verify", "on_native", "on_shadow", "on_drafted", "on_host"):
    setattr(TimedPlanner, _hook, _forwarded(_hook))


class GcPauses:
    """The garbage collector's pauses in this process while the block runs (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def _hook(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._start)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)


def measure(backend: Any, client: ClientLog, preset: str, plan: str, batch: int, max_tokens: int, overlap: bool,
            k: int = 4, warmup_tokens: int = 8, planner: tuple[int, str] | None = None,
            inner_min_share: float = 0.0, churn: bool = False) -> dict[str, Any]:
    """One configuration: an untimed warm-up `generate`, then the timed one; the run's numbers (module docstring).
    `planner` = (k_max, how): the live planner chooses each round's plan over the plan's levels, its ranking
    included in the overhead; how: "served" (the app's defaults, a time budget for the ranking), "b<share>" (the
    same with another `rerank_budget`, e.g. b0.005) or N (it ranks one round in N)."""
    names = PLAN_LEVELS[preset][plan]
    levels = [backend.levels[n] for n in names]
    if inner_min_share:  # the middle levels' tail cut (`Level.inner_min_share`)
        levels = [replace(lv, inner_min_share=inner_min_share) if 0 < j < len(levels) - 1 else lv
                  for j, lv in enumerate(levels)]
    engine = CascadeEngine(levels, overlap=overlap, nesting=backend.nesting)
    policy = None
    if planner is not None:
        if planner[1] == "served" or planner[1].startswith("b"):
            pol = PolicyConfig()
            kw = dict(hysteresis=pol.hysteresis, patience=pol.patience, explore_every=pol.explore_every,
                      decisive=pol.decisive, rerank_every=pol.rerank_every,
                      rerank_budget=pol.rerank_budget if planner[1] == "served" else float(planner[1][1:]))
        else:
            kw = dict(rerank_every=int(planner[1]))
        policy = Planner(levels, k_max=planner[0], **kw).attach(engine)
    timed = None if policy is None else TimedPlanner(policy)
    if timed is not None:
        engine.observers[engine.observers.index(policy)] = timed
    prompts = make_prompts(batch)
    load = os.getloadavg()[0]
    try:
        generate(engine, prompts, max_tokens=min(warmup_tokens, max_tokens), ignore_eos=True, plan=timed or policy)
        freeze_startup_heap()  # as the served coordinator does once started (the level actors do at their start)
        backend.drain()
        client.clear()
        if timed is not None:
            timed.reset()
        follow0 = backend.follow_stats()
        with GcPauses() as pauses:
            t0 = time.monotonic()
            if churn:
                out = stream(engine, batch, max_tokens, timed or policy or engine.default_plan)
            else:
                out = generate(engine, prompts, max_tokens=max_tokens, ignore_eos=True, plan=timed or policy)
            t1 = time.monotonic()
        follow1 = backend.follow_stats()
    finally:
        gc.unfreeze()  # this run's engine and workers go with it (the next run freezes its own after its warm-up)
        pool = getattr(engine, "_ahead_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
    recs = backend.traces(t0, t1)
    calls = [c for c in client.calls if c.start >= t0 and c.end <= t1]
    wall = t1 - t0
    rounds = max(r.rounds for r in out.results)
    tokens = sum(len(r.token_ids) for r in out.results)
    busy = [(r["start"], r["end"]) for r in recs if r["kind"] in MODEL_KINDS]
    model = union_length(busy, t0, t1)
    in_calls = union_length([(c.start, c.end) for c in calls], t0, t1)

    per_level: dict[str, Any] = {}
    for n in names:
        w = [r for r in recs if r["worker"] == n]
        kinds = Counter(r["kind"] for r in w)
        mk = [r for r in w if r["kind"] in MODEL_KINDS]
        busy_s = sum(r["end"] - r["start"] for r in mk)
        cl = [c for c in calls if c.level == n]
        cl_model = [c for c in cl if c.method.replace("_async", "") in MODEL_KINDS]
        client_s = sum(c.end - c.start for c in cl_model)
        per_level[n] = {
            "calls": dict(kinds),
            "calls_per_round": {kk: v / rounds for kk, v in sorted(kinds.items())},
            "client_calls": dict(Counter(c.method for c in cl)),
            "busy_s": busy_s,
            "cost_model_s": sum(r["cost_s"] for r in mk),
            "logic_over_cost_s": sum(max(0.0, r["logic_s"] - r["cost_s"]) for r in mk),
            "sleep_overshoot_s": sum(max(0.0, (r["end"] - r["start"]) - max(r["logic_s"], r["cost_s"])) for r in mk),
            "client_s": client_s,
            "other_client_s": sum(c.end - c.start for c in cl) - client_s,
            "hop_ms_per_call": 1000 * (client_s - busy_s) / len(mk) if mk and len(cl_model) == len(mk) else None,
            # request/reply pairs between processes: the coordinator's calls into it (nested ones included), and
            # its proposes that a nested level above asked for (that level's own verifications are local)
            "round_trips": sum(c.method.replace("_async", "") in (*MODEL_KINDS, "nested") for c in cl)
            + max(0, kinds.get("propose", 0) - sum(c.method.replace("_async", "") == "propose" for c in cl)),
            "forwards": sum(r["forwards"] for r in mk),
            "tokens_fed": sum(r["tokens"] for r in mk),
        }
    stats = {n: st.as_dict() for n, st in out.stats.items()}
    acceptance = {}
    for lower, upper in zip(names[:-1], names[1:]):
        st = stats.get(upper)
        if st:
            alphas = conditional_alphas(st["accepted_per_pos"], st["num_drafts"], len(st["accepted_per_pos"]))
            acceptance[f"{lower}->{upper}"] = {"rate": st["acceptance_rate"], "alpha": alphas[0] if alphas else 0.0,
                                                "alphas": alphas, "mean_len": st["mean_acceptance_length"],
                                                "per_pos": st["accepted_per_pos"], "drafts": st["num_drafts"]}
    return {
        "path": backend.path, "preset": preset, "plan": plan, "levels": list(names), "overlap": overlap,
        "inner_min_share": inner_min_share, "churn": churn,
        # the middle levels' follow-ons in the timed run (`FollowOns.stats`; the Ray paths)
        "follow": {n: {k: v - follow0[n].get(k, 0) for k, v in st.items()} for n, st in follow1.items()},
        "planner": None if planner is None else {"k_max": planner[0], "rerank": planner[1],
                                                 "held": policy.plan_name(policy.current),
                                                 # its own CPU (thread time) per round, in all and per hook
                                                 "cpu_ms_per_round": 1000 * sum(timed.cpu.values()) / rounds,
                                                 "cpu_ms_per_round_by_hook": {k: 1000 * v / rounds
                                                                              for k, v in sorted(timed.cpu.items())},
                                                 "calls": dict(timed.calls)},
        "batch": batch, "max_tokens": max_tokens, "k": k,
        "rounds": rounds, "tokens": tokens, "wall_s": wall, "model_s": model, "in_calls_s": in_calls,
        "overhead_s": wall - model, "overhead_ms_per_round": 1000 * (wall - model) / rounds,
        "hop_ms_per_round": 1000 * (in_calls - model) / rounds,
        "coordinator_ms_per_round": 1000 * (wall - in_calls) / rounds,
        # this process's garbage collections during the timed run (the coordinator's; each pauses a round)
        "coordinator_gc": {"collections": len(pauses.seconds), "pause_ms": 1000 * sum(pauses.seconds),
                           "max_ms": 1000 * max(pauses.seconds, default=0.0)},
        "fraction_of_ideal": model / wall if wall > 0 else 0.0,
        "logic_over_cost_s": sum(pl["logic_over_cost_s"] for pl in per_level.values()),
        "sleep_overshoot_s": sum(pl["sleep_overshoot_s"] for pl in per_level.values()),
        "other_calls_s": sum(c.end - c.start for c in calls
                             if c.method.replace("_async", "") not in (*MODEL_KINDS, "nested")),
        "other_calls": sum(n for pl in per_level.values() for m, n in pl["client_calls"].items()
                           if m.replace("_async", "") not in (*MODEL_KINDS, "nested")),
        "nested_calls": sum(pl["client_calls"].get("nested", 0) for pl in per_level.values()),
        "round_trips_per_round": (sum(pl["round_trips"] for pl in per_level.values()) / rounds
                                  if backend.path != "inproc" else 0.0),
        "transfer_floor_ms": backend.info.get("transfer_floor_ms"),
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "per_level": per_level, "acceptance": acceptance, "stats": stats,
        "bound": bound_for(names, stats, k, batch, backend.costs),
        "ahead_rows": getattr(engine, "ahead_rows", None), "ahead_hits": getattr(engine, "ahead_hits", None),
        "load1_before": load, "load1_after": os.getloadavg()[0],
        "gaps": None if overlap else transition_gaps(recs, t0, t1, rounds),
    }


def transition_gaps(recs: Sequence[dict[str, Any]], t0: float, t1: float, rounds: int) -> dict[str, Any]:
    """Where a sequential round's overhead sits: the idle time between one model call's end and the next one's
    start, per transition (e.g. 'llama-70b-tp4:verify > llama-1b:propose': the target's verdict back, the
    coordinator's commit and plan, the next round's requests, down to the small level). Without overlap the
    calls run one at a time, so the gaps (and the time before the first and after the last call) add up to the
    overhead. Per round, in ms, largest first, with the count of each transition per round."""
    busy = sorted((r["start"], r["end"], f"{r['worker']}:{r['kind']}") for r in recs if r["kind"] in MODEL_KINDS)
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for (_, e0, a), (s1, _, b) in zip(busy, busy[1:]):
        total[f"{a} > {b}"] += max(0.0, s1 - e0)
        count[f"{a} > {b}"] += 1
    edges = (busy[0][0] - t0) + (t1 - busy[-1][1]) if busy else t1 - t0
    return {"ms_per_round": {k: 1000 * v / rounds for k, v in total.most_common()},
            "per_round": {k: count[k] / rounds for k, _ in total.most_common()},
            "edges_ms_per_round": 1000 * edges / rounds}


# ------------------------------------------------------------------------------------------ reporting


def _short(name: str) -> str:
    return name.replace("llama-", "").replace("qwen-cpu-", "q").replace("h200-hf-", "h").replace("-tp4", "")


def config_label(r: dict[str, Any]) -> str:
    pl = r.get("planner")
    tag = "+pl{}".format(pl["rerank"]) if pl else ""
    if r.get("inner_min_share"):
        tag += f"/t{r['inner_min_share']:g}"
    if r.get("churn"):
        tag += "/churn"
    return f"{r['plan']}{'+ov' if r['overlap'] else ''}{tag}"


HEADER = (f"{'path':<18} {'config':<12} {'B':>3} {'tok':>3} {'rounds':>6} {'wall s':>7} {'model s':>7} "
          f"{'ovh/rnd':>8} {'hop/rnd':>8} {'frac':>5} {'tok/s':>7} {'speedup':>7} {'bound':>5}  "
          "alpha1/rate  calls/round  hop ms/call  trips/round")


def row_text(r: dict[str, Any]) -> str:
    acc = " ".join(f"{v['alpha']:.2f}/{v['rate']:.2f}" for v in r["acceptance"].values()) or "-"
    calls = " ".join(
        f"{_short(n)}:" + ",".join(f"{kk[0]}{v:.2f}" for kk, v in pl["calls_per_round"].items() if kk in MODEL_KINDS)
        for n, pl in r["per_level"].items())
    hops = " ".join(f"{_short(n)}:{pl['hop_ms_per_call']:.2f}" for n, pl in r["per_level"].items()
                    if pl["hop_ms_per_call"] is not None)
    sp = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
    bd = f"{r['bound']['bound']:.2f}" if r["bound"].get("bound") is not None else "-"
    flags = []
    if r["load1_before"] > BUSY_LOAD:
        flags.append(f"load {r['load1_before']:.1f}")
    if r.get("planner") and "cpu_ms_per_round" in r["planner"]:
        flags.append(f"planner CPU {r['planner']['cpu_ms_per_round']:.2f} ms/round")
    gcp = r.get("coordinator_gc") or {}
    if gcp.get("max_ms", 0.0) > 1.0:  # a collection long enough to stall a round
        flags.append(f"coordinator GC {gcp['collections']}x, {gcp['pause_ms']:.1f} ms, longest {gcp['max_ms']:.1f}")
    for n, f in (r.get("follow") or {}).items():
        if f.get("drafted"):
            flags.append(f"follow-ons at {_short(n)}: {f['used']:.0f} used ({f.get('joins', 0):.0f} with rows joined, "
                         f"{f.get('trims', 0):.0f} with rows left), {f['dropped']:.0f} dropped of "
                         f"{f['drafted']:.0f} drafted")
    if r["logic_over_cost_s"] > 0.02 * r["model_s"]:
        flags.append(f"worker Python over its cost {r['logic_over_cost_s']:.3f}s, counted as model time")
    return (f"{r['path']:<18} {config_label(r):<12} {r['batch']:>3} {r['max_tokens']:>3} {r['rounds']:>6} "
            f"{r['wall_s']:>7.3f} {r['model_s']:>7.3f} {r['overhead_ms_per_round']:>6.2f}ms "
            f"{r['hop_ms_per_round']:>6.2f}ms {r['fraction_of_ideal']:>5.3f} {r['tokens_per_s']:>7.1f} {sp:>7} "
            f"{bd:>5}  {acc}  {calls}  {hops}  trips {r['round_trips_per_round']:.1f}"
            f"  add/free {r['other_calls']} in {r['other_calls_s']:.3f}s"
            + (f"  [{'; '.join(flags)}]" if flags else ""))


def add_speedups(runs: list[dict[str, Any]]) -> None:
    plain = {(r["path"], r["batch"]): r for r in runs if r["plan"] == "plain" and not r.get("planner")}
    for r in runs:
        p = plain.get((r["path"], r["batch"]))
        if p is not None:
            r["speedup"] = p["wall_s"] / r["wall_s"]
            r["model_speedup"] = p["model_s"] / r["model_s"] if r["model_s"] > 0 else None
            r["speedup_tokens_note"] = None if p["max_tokens"] == r["max_tokens"] else "plain ran another token count"


def target_checks(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """PASS/FAIL per cell of the issue's targets (multinode is held to the actor targets)."""
    out = []
    for r in runs:
        if r["plan"] == "ngram-cascade":  # not one of the issue's plans: reported, not held to its targets
            continue
        kind = "inproc" if r["path"] == "inproc" else "actors"
        limit = OVERHEAD_TARGET_MS.get((kind, r["batch"]))
        if limit is not None:
            v = r["overhead_ms_per_round"]
            out.append({"path": r["path"], "config": config_label(r), "batch": r["batch"], "metric": "overhead/round",
                        "value": v, "target": f"<= {limit:g} ms", "pass": v <= limit})
        if r["plan"] == "cascade" and r["batch"] == 1 and kind == "actors":
            v = r["fraction_of_ideal"]
            out.append({"path": r["path"], "config": config_label(r), "batch": 1, "metric": "fraction of ideal",
                        "value": v, "target": f">= {FRACTION_TARGET}", "pass": v >= FRACTION_TARGET})
    return out


def check_text(c: dict[str, Any]) -> str:
    val = f"{c['value']:.2f} ms" if c["metric"] == "overhead/round" else f"{c['value']:.3f}"
    return (f"{'PASS' if c['pass'] else 'FAIL'}  {c['path']:<18} {c['config']:<12} B={c['batch']:<3} "
            f"{c['metric']} {val} (target {c['target']})")


def write_png(runs: list[dict[str, Any]], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG written; the project does not depend on it)", flush=True)
        return False
    batches = sorted({r["batch"] for r in runs})
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 7), squeeze=False)
    for j, b in enumerate(batches):
        sub = [r for r in runs if r["batch"] == b]
        labels = [f"{r['path']}\n{config_label(r)}" for r in sub]
        xs = range(len(sub))
        axes[0][j].bar(xs, [r["overhead_ms_per_round"] for r in sub], color="tab:red")
        axes[0][j].set_title(f"batch {b}: overhead per round (ms)")
        axes[1][j].bar(xs, [r["fraction_of_ideal"] for r in sub], color="tab:blue")
        axes[1][j].set_title(f"batch {b}: fraction of ideal (model / wall)")
        axes[1][j].set_ylim(0, 1.05)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}", flush=True)
    return True


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except Exception:
        pass
    return platform.processor() or "unknown"


def git_head() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else None
    except Exception:
        return None


class TransportView:
    """A `RayBackend`'s actors reached over another transport: a second `ActorWorker` per level (traces, costs and
    the actors are the base backend's)."""

    def __init__(self, base: RayBackend, transport: str, client: ClientLog) -> None:
        from specray.serve.actors import ActorWorker

        self.base = base
        self.path = path_label(base.path.split("-")[0], transport)
        self.costs, self.info = base.costs, base.info
        # direct / poll: nested drafting with relays and follow-ons, as the launched cascade has it; nofollow: the
        # same without follow-ons; norelay: nested, the drafts back through the coordinator; flat: the coordinator
        # makes every call
        self.nesting = _nesting(base.launched.nesting, transport)
        self.levels = {}
        for n, lv in base.levels.items():
            if lv.worker is None:  # the n-gram level: no actor
                self.levels[n] = lv
                continue
            w = ActorWorker(lv.worker.handle, info=lv.worker._info_cache, level=n,
                            transport=_ray_transport(transport), poll=transport == "poll")
            client.patch(n, w)
            self.levels[n] = Level(n, worker=w, k=lv.k, method=lv.method)

    def drain(self) -> None:
        self.base.drain()

    def follow_stats(self) -> dict[str, dict[str, float]]:
        return self.base.follow_stats()

    def traces(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return self.base.traces(t0, t1)

    def close(self) -> None:
        self.rest()

    def rest(self) -> None:
        for lv in self.levels.values():
            if lv.worker is not None:
                lv.worker.close()


def ngram_level(k: int) -> Level:
    """The ngram-cascade plan's first level: prompt lookup over each row's text (1-3 tokens matched)."""
    return Level(NGRAM, ngram=NgramConfig(k, 1, 3), k=k)


def _ray_transport(transport: str) -> str:
    """The cascade's transport behind a benchmark transport name (`flat`, `poll`, `norelay`: direct, used another
    way)."""
    return "direct" if transport in ("flat", "poll", "norelay", "nofollow") else transport


def _nesting(launched: Any, transport: str) -> Any:
    """The nesting a benchmark transport drafts with: the launched cascade's (nested, relayed), nested without
    relays (`norelay`), or none (`flat`, `compiled`, `call`: the coordinator makes every call)."""
    from specray.serve.actors import RemoteNesting

    if transport in ("direct", "poll"):
        return launched
    if launched is None:
        return None
    return {"norelay": RemoteNesting(relay=False), "nofollow": RemoteNesting(follow=False)}.get(transport)


def path_label(path: str, transport: str) -> str:
    return path if transport == "direct" else f"{path}-{transport}"


# ------------------------------------------------------------------------------------------ main


@dataclass
class Settings:
    preset: str = "gpu"
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    plans: list[str] = field(default_factory=lambda: list(PLANS))
    batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    max_tokens: int = 96
    max_tokens_large: int | None = None  # new tokens per row at the large batches (None: max_tokens)
    overlaps: list[bool] = field(default_factory=lambda: [False, True])
    transports: list[str] = field(default_factory=lambda: ["direct", "flat", "compiled", "call"])
    k: int = 4
    warmup_tokens: int = 8
    repeat: int = 1  # runs of each configuration per transport; the median-overhead one is reported
    #: each speculative configuration also runs under the live planner once per entry: "served" or rerank_every N
    planners: list[str] = field(default_factory=list)
    planner_k_max: int = 16
    #: the cascade's middle level runs each of these tail cuts (`Level.inner_min_share`; 0: none)
    inner_min_shares: list[float] = field(default_factory=lambda: [0.0])
    churn: bool = False  # continuous batching: rows end and join (`stream`)

    def tokens_for(self, batch: int) -> int:
        return self.max_tokens_large if (self.max_tokens_large and batch >= 64) else self.max_tokens


def median_run(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median overhead per round (the lower middle one for an even count), with every
    repeat's overhead beside it."""
    order = sorted(reps, key=lambda r: r["overhead_ms_per_round"])
    out = dict(order[(len(order) - 1) // 2])
    out["repeats_overhead_ms"] = [r["overhead_ms_per_round"] for r in reps]
    return out


def run_path(path: str, s: Settings, trace_dir: str, on_run: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    specs = PRESET_LEVELS[s.preset]
    client = ClientLog()
    t = time.monotonic()
    backend = (InprocBackend(specs, s.k, client) if path == "inproc"
               else RayBackend(path, s.preset, specs, s.k, client, trace_dir, s.transports[0]))
    # the Ray paths: every configuration once per transport, one after the other on the same actors
    backends = [backend] if path == "inproc" else [backend, *(backend.over(t, client) for t in s.transports[1:])]
    info = dict(backend.info, start_s=time.monotonic() - t)
    if info.get("transfer_floor_ms") is not None:
        print(f"{path}: transfer floor {info['transfer_floor_ms']:.3f} ms per request/reply (a bare echo actor "
              f"idle, then blocking, {1000 * FLOOR_STEP_S:.0f} ms each); trips/round x floor = what the round's "
              "transfers alone cost", flush=True)
    try:
        for b in s.batches:
            for plan in s.plans:
                for ov in s.overlaps:
                    if ov and plan == "plain":
                        continue
                    policies = [None] + ([(s.planner_k_max, n) for n in s.planners] if plan != "plain" else [])
                    shares = s.inner_min_shares if len(PLAN_LEVELS[s.preset][plan]) > 2 else s.inner_min_shares[:1]
                    for pol in policies:
                        variants = [(j, sh) for sh in shares for j in range(len(backends))]
                        reps: dict[tuple[int, float], list[dict[str, Any]]] = {v: [] for v in variants}
                        for _ in range(s.repeat):  # transports interleaved: a slow spell of the box hits all
                            for j, sh in variants:
                                be = backends[j]
                                reps[(j, sh)].append(measure(be, client, s.preset, plan, b, s.tokens_for(b), ov,
                                                             s.k, s.warmup_tokens, pol, sh, s.churn))
                                be.rest()
                        for v in variants:
                            on_run(median_run(reps[v]))
    finally:
        for be in reversed(backends):
            be.close()
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 16 64 (gpu), 1 (qwen-cpu)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 96 (gpu), 24 (qwen-cpu)")
    ap.add_argument("--max-tokens-large", type=int, default=None, help="new tokens at batch >= 64 (default: same)")
    ap.add_argument("--overlap", choices=("both", "on", "off"), default="both")
    ap.add_argument("--preset", choices=tuple(PRESET_LEVELS), default="gpu")
    ap.add_argument("--transports", nargs="+", choices=("direct", "poll", "norelay", "nofollow", "flat", "compiled",
                                                        "call"),
                    default=["direct", "flat", "compiled", "call"],
                    help="how the Ray paths reach the level actors (each configuration runs once per transport)")
    ap.add_argument("--k", type=int, default=4, help="tokens each level proposes per round")
    ap.add_argument("--inner-min-share", type=float, nargs="+", default=None,
                    help="run the cascade with each of these tail cuts of its middle level's inner rounds "
                         "(`Level.inner_min_share`: stop once fewer than this share of rows need tokens; 0: off). "
                         "Default: what a level's config gives it on its device: 0.25 for the GPU presets, 0 for "
                         "qwen-cpu")
    ap.add_argument("--planner", nargs="+", default=[], metavar="HOW",
                    help="also run each speculative configuration under the live planner, once per value: 'served' "
                         "(the app's defaults: the ranking within a time budget), b<share> (the same with another "
                         "rerank_budget, e.g. b0.005) or N (rank one round in N); its ranking counts in the overhead")
    ap.add_argument("--planner-k-max", type=int, default=16, help="the planner's largest K (the served default: 16)")
    ap.add_argument("--follow-max-rows", type=int, default=None,
                    help="an experiment: follow-ons up to this many rows (specray.coordinator.drafting.FOLLOW_MAX_ROWS,"
                         " 64 when serving); without --churn the rows never end or join, so every one is taken")
    ap.add_argument("--churn", action="store_true",
                    help="continuous batching, as served: rows of varied lengths end and are replaced at once "
                         "(`stream`), so that follow-ons meet rows that end and join")
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each configuration this many times (transports interleaved) and report the median "
                         "overhead: differences smaller than the box's noise need 3 or more")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/overhead-<date>.json)")
    ap.add_argument("--note", action="append", default=[], help="a line for the JSON's notes (e.g. which code ran)")
    args = ap.parse_args(argv)
    FOLLOW_MAX_ROWS_SERVED = drafting.FOLLOW_MAX_ROWS
    if args.follow_max_rows is not None:
        drafting.FOLLOW_MAX_ROWS = args.follow_max_rows
        args.note.append(f"follow-ons up to {args.follow_max_rows} rows (served: {FOLLOW_MAX_ROWS_SERVED})")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(1)  # the coordinator's CPU side: no OpenMP pool to wake after every sleep
    qwen = args.preset == "qwen-cpu"
    plans = [p for p in args.plans if p in PLAN_LEVELS[args.preset]]
    notes = list(args.note)
    for p in args.plans:
        if p not in plans:
            notes.append(f"plan {p!r} skipped: the {args.preset} preset has no such levels")
    s = Settings(
        preset=args.preset, paths=list(args.paths), plans=plans,
        batches=args.batches or ([1] if qwen else [1, 16, 64]),
        max_tokens=args.max_tokens or (24 if qwen else 96), max_tokens_large=args.max_tokens_large,
        overlaps={"both": [False, True], "on": [True], "off": [False]}[args.overlap], k=args.k,
        transports=list(dict.fromkeys(args.transports)),
        warmup_tokens=args.warmup_tokens, repeat=max(1, args.repeat), planners=list(args.planner),
        planner_k_max=args.planner_k_max,
        inner_min_shares=args.inner_min_share or [0.0 if qwen else GPU_TAIL_CUT], churn=args.churn,
    )
    if s.max_tokens_large and any(b >= 64 for b in s.batches):
        notes.append(f"batch >= 64 runs generate {s.max_tokens_large} tokens per row (others {s.max_tokens})")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"overhead-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    specs = PRESET_LEVELS[s.preset]
    print(f"bench_overhead: preset {s.preset}; levels " + ", ".join(
        f"{x.name} ({1000 * x.cost.step_s(1):.1f} ms/step at batch 1, noise {x.noise:g})" for x in specs), flush=True)
    print(f"paths {s.paths}, plans {s.plans}, batches {s.batches}, {s.max_tokens} new tokens, K {s.k}, greedy, "
          f"vocab {VOCAB}, prompts of {PROMPT_LEN} distinct ids; box: {cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    for n in notes:
        print(f"note: {n}", flush=True)
    print(HEADER, flush=True)

    runs: list[dict[str, Any]] = []
    path_info: dict[str, Any] = {}
    trace_dir = tempfile.mkdtemp(prefix="specray-overhead-")
    lock = threading.Lock()

    def on_run(r: dict[str, Any]) -> None:
        with lock:
            runs.append(r)
            add_speedups(runs)
            print(row_text(r), flush=True)

    t_all = time.monotonic()
    try:
        for path in s.paths:
            path_info[path] = run_path(path, s, trace_dir, on_run)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    add_speedups(runs)
    checks = target_checks(runs)
    print(f"\n{BOUND_TEXT}", flush=True)
    print("speedup = plain's wall / this wall (same path and batch); hop/rnd = in-call time outside the workers' "
          "busy intervals per round; hop ms/call = per level, client - busy over its propose/verify calls", flush=True)
    print(f"\n{TARGETS_TEXT}", flush=True)
    for c in checks:
        print(check_text(c), flush=True)
    if not checks:
        print("(no run at a batch / path the targets name)", flush=True)

    doc = {
        "meta": {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "date": _dt.datetime.now().isoformat(timespec="seconds"), "git": git_head(),
            "specray": str(Path(sys.modules["specray"].__file__).parent), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "settings": asdict(s), "levels": [dict(asdict(x), cost=asdict(x.cost)) for x in specs],
            "vocab": VOCAB, "order": ORDER, "prompt_len": PROMPT_LEN, "paths": path_info, "notes": notes,
            "bound": BOUND_TEXT, "targets": TARGETS_TEXT, "total_s": time.monotonic() - t_all,
        },
        "runs": runs,
        "checks": checks,
    }
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", flush=True)
    write_png(runs, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
