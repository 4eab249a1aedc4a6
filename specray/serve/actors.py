"""Model levels as Ray actors: one actor per level, with that level's own resources.

- `LevelActor` holds one worker (built inside the actor from a picklable zero-arg factory, so the
  weights never travel) and serves it. It is a plain class; `ray.remote` is applied only in
  `specray.serve.launch.launch_levels`, which starts one per model level and returns ready-to-use `Level`s.
- `ActorWorker` is the client side: it implements the worker protocol over the actor handle, so
  `CascadeEngine` drives a remote level exactly like an in-process one. Ray failures become
  `LevelUnavailable`, which the coordinator acts on (drop the level, or re-add its sequences).
- `RemoteNesting` lets a middle level run its inner rounds in its actor, calling the level below directly
  (`specray.coordinator.inner`; direct transport).

Transport. A round's calls (`propose`, `propose_tree`, `verify`, `verify_tree`) travel as one `LevelRequest` each,
by one of three transports (`cascade.transport`), compared side by side in benchmarks/bench_overhead.py:
- `direct` (default): a socket the actor serves beside Ray (`specray.serve.direct`): one pickle frame each way,
  a fraction of an actor call's cost, and an idle level sleeps;
- `compiled`: a Ray Compiled Graph of one node per level: a shared-memory channel to a loop running in the
  actor; about a quarter of an actor call, but the loop polls, so an idle level keeps a CPU core busy;
- `call`: a plain actor call (for nodes that cannot reach each other's ephemeral ports).
Sequences finished by the coordinator are freed inside the level's next request (or before any other call),
never by a call of their own, and a level joins a sequence inside the call that first uses it
(`SeqSync.start`). Only token ids travel (a draft tree: its token ids and parents), plus q when a drafter
sampled (rejection). After the actor restarts,
the connection is made again to its new address (or the graph rebuilt); a call that finds it broken raises
`LevelUnavailable` like a dead actor.

Restart semantics: actors run with max_restarts=-1 and max_task_retries=0. A killed actor is restarted
by Ray with a fresh, empty worker (every sequence is lost); calls in flight or made during the restart
raise `LevelUnavailable`, and the first call after the restart that names a lost sequence raises
`LevelRestarted`. Retrying is the coordinator's decision, never Ray's: a silent retry of `verify`
on a half-updated worker would not be safe.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError, RayTaskError

from specray.coordinator.inner import NestedDraft, NestedOutcome
from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, Worker, WorkerCaps, WorkerStats
from specray.serve.direct import FrameClient, FrameServer, TransportError
from specray.serve.wire import (
    Endpoint,
    LevelRequest,
    NestedCall,
    ProposeCall,
    Samplings,
    TreeProposeCall,
    TreeVerifyCall,
    VerifyCall,
    WireSampling,
    WireSync,
    wire_syncs,
    wire_trees,
)
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.tree import DraftTree

WorkerFactory = Callable[[], Worker]

#: how a coordinator reaches its level actors (module docstring)
TRANSPORTS = ("direct", "compiled", "call")

log = logging.getLogger(__name__)

_BUNDLE_RE = re.compile(r"_group_(\d+)_[0-9a-f]+$")


class LevelUnavailable(RuntimeError):
    """A level's actor is dead, restarting or did not answer in time; its sequences may be gone."""

    def __init__(self, level: str, reason: str) -> None:
        super().__init__(f"level {level!r} is unavailable: {reason}")
        self.level = level


class LevelRestarted(LevelUnavailable):
    """The level's actor was restarted by Ray: it answers again, but every sequence it held is lost."""


class LevelStartError(RuntimeError):
    """A level's actor could not be created or did not become ready."""


# ------------------------------------------------------------------------------------------ server side


class LevelActor:
    """One model level inside a Ray actor: builds its worker in-process and serves the protocol 1:1.

    Protocol dataclasses are returned as they are; Ray pickles them (tensors in `probs` go through the
    object store).
    """

    def __init__(self, factory: WorkerFactory, num_threads: int | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)  # before the model is built, so every op uses it
        self.worker = factory()
        self._lock = threading.Lock()
        self._samplings = Samplings()
        self._peers: dict[Endpoint, FrameClient] = {}  # other levels' actors this one calls (nested drafting)
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the server's threads set it too
        self._server = FrameServer(ray.util.get_node_ip_address(), self.run,
                                   on_thread_start=lambda: torch.set_num_threads(threads))
        self.incarnation = uuid.uuid4().hex  # changes on every (re)start; lets clients detect restarts
        self.caps = self.worker.capabilities()
        tok = getattr(self.worker, "tokenizer", None)  # backends without text (test fakes) have None
        fingerprint = eos_id = None
        if tok is not None:
            from specray.engine.models import tokenizer_fingerprint

            fingerprint, eos_id = tokenizer_fingerprint(tok), getattr(tok, "eos_token_id", None)
        self._static = {
            "caps": self.caps,
            "name": self.caps.name,
            "vocab_size": self.caps.vocab_size,
            "max_context": self.caps.max_context,
            "eos_token_ids": list(self.caps.eos_token_ids),
            "tokenizer_fingerprint": fingerprint,
            "tokenizer_eos_id": eos_id,
            "has_tokenizer": tok is not None,
            "direct": (self._server.address, self._server.token),
        }

    # ----- protocol -------------------------------------------------------------------------------
    # A compiled graph's loop runs beside the actor's ordinary calls (Ray runs it in a system concurrency group):
    # the lock keeps the worker single-threaded.
    def run(self, request: LevelRequest) -> DraftProposal | VerifyResult:
        """A round's call (`ActorWorker`): free what the coordinator finished, then propose or verify."""
        with self._lock:
            for seq_id in request.frees:
                self.worker.free(seq_id)
                self._samplings.by_seq.pop(seq_id, None)
            return request.call.run(self.worker, self._samplings, self._peer_call)

    def _peer_call(self, at: Endpoint, request: LevelRequest) -> Any:
        """A request to another level's actor over its direct transport (a middle level's `NestedCall`)."""
        client = self._peers.get(at)
        if client is None:
            client = self._peers[at] = FrameClient(*at)
        try:
            return client.call(request)
        except TransportError:
            self._peers.pop(at, None)
            client.close()
            raise

    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        with self._lock:
            self.worker.add(seq_id, prompt_ids)

    def free_many(self, seq_ids: Sequence[str]) -> None:
        """Free several sequences in one call (idempotent)."""
        with self._lock:
            for s in seq_ids:
                self.worker.free(s)
                self._samplings.by_seq.pop(s, None)

    def stats(self) -> WorkerStats:
        with self._lock:
            return self.worker.stats()

    # ----- introspection --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Static facts of the worker plus where this process runs (node, pid, placement bundle)."""
        ctx = ray.get_runtime_context()
        return {
            **self._static,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "placement_group_id": ctx.get_placement_group_id(),
            "bundle_index": _bundle_index(ctx),
            "resources": ctx.get_assigned_resources(),
            "num_threads": torch.get_num_threads(),
            "incarnation": self.incarnation,
            "reconstructed": _reconstructed(ctx),
            "rss_bytes": _rss_bytes(),
        }

    def get_tokenizer(self) -> Any:
        """The worker's tokenizer object (pickled), so a coordinator on another node needs no model files."""
        return getattr(self.worker, "tokenizer", None)

    def ping(self) -> str:
        return self.incarnation


def _rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; None elsewhere): leak checks under load."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _reconstructed(ctx: Any) -> bool:
    with warnings.catch_warnings():  # the property uses a deprecated accessor internally (Ray 2.60)
        warnings.simplefilter("ignore")
        return bool(ctx.was_current_actor_reconstructed)


def _bundle_index(ctx: Any) -> int | None:
    """The bundle this actor's resources came from, read from Ray's PG-formatted resource names
    (CPU_group_<index>_<pg id>); the public `get_assigned_resources` strips exactly that part."""
    try:
        raw = ctx.worker.core_worker.resource_ids()
    except Exception:
        return None
    for key in raw:
        m = _BUNDLE_RE.search(key)
        if m:
            return int(m.group(1))
    return None


# ------------------------------------------------------------------------------------------ client side


class ActorWorker:
    """The worker protocol over a `LevelActor` handle (blocking; `*_async` variants await plain calls).

    Static facts (name, vocab size, context, eos ids, tokenizer fingerprint, capabilities) are read once from
    `info()`. `propose` and `verify` go over `transport` (module docstring); `free` only queues the sequence,
    which leaves with the level's next request, or before any other call.
    """

    def __init__(
        self, handle: Any, timeout_s: float | None = None, info: dict[str, Any] | None = None, level: str | None = None,
        transport: str = "direct",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.handle = handle
        self.timeout_s = timeout_s
        self.transport = transport
        self._run, self._add, self._free_many = handle.run, handle.add, handle.free_many
        self._stats, self._info, self._ping = handle.stats, handle.info, handle.ping
        self.level: str = level or "?"  # for error messages until info() answers
        self.name: str = self.level
        self._info_cache = info if info is not None else self._get(self._info.remote())
        i = self._info_cache
        self.name = i["name"]
        self.level = level or self.name  # the cascade's name for this level (in errors)
        self.caps: WorkerCaps = i["caps"]
        self.vocab_size: int = self.caps.vocab_size
        self.max_context: int | None = self.caps.max_context
        self.eos_token_ids: tuple[int, ...] = self.caps.eos_token_ids
        self.tokenizer_fingerprint: str | None = i["tokenizer_fingerprint"]
        self.incarnation: str = i["incarnation"]
        self._tokenizer: Any = None
        self._frees: list[str] = []  # finished sequences, freed with the next request
        self._frees_lock = threading.Lock()
        self._sampled: dict[str, SamplingParams] = {}  # the sampling parameters the actor holds per sequence
        self._graph: Any = None  # the compiled graph, built on first use and after a failure
        self._graph_lock = threading.Lock()  # one request in flight per level (the actor serves one at a time)
        self._direct: FrameClient | None = None  # the direct connection, made on first use and after a failure
        self._direct_at = i["direct"]  # (address, token) of the incarnation last seen
        self._direct_lock = threading.Lock()

    def capabilities(self) -> WorkerCaps:
        return self.caps

    @property
    def tokenizer(self) -> Any:
        """Fetched from the actor on first use (the coordinator may not have the model files)."""
        if self._tokenizer is None and self._info_cache.get("has_tokenizer"):
            self._tokenizer = self._get(self.handle.get_tokenizer.remote())
        return self._tokenizer

    # ----- error mapping --------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> BaseException:
        """Turn a Ray failure into the exception the coordinator should see."""
        if isinstance(exc, RayActorError | RayChannelError):
            return LevelUnavailable(self.level, f"{type(exc).__name__}: {_first_line(exc)}")
        if isinstance(exc, GetTimeoutError | RayChannelTimeoutError):
            return LevelUnavailable(self.level, f"no answer within {self.timeout_s}s")
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, KeyError) and self.check_restarted():
            return LevelRestarted(self.level, "its actor was restarted and lost every sequence; re-add them")
        return exc

    def check_restarted(self) -> bool:
        """True (once) if the actor is a new incarnation since we last looked; then its state is empty."""
        try:
            now = ray.get(self._ping.remote(), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError):
            return False
        if now != self.incarnation:
            self.incarnation = now
            return True
        return False

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError, RayTaskError) as e:
            mapped = self._failed(e)
            if mapped is e:
                raise  # an application error (ValueError, KeyError, ...) keeps its type
            raise mapped from e

    async def _aget(self, ref: Any) -> Any:
        """Await a call; no timeout here (wrap in asyncio.wait_for if needed)."""
        try:
            return await ref
        except (RayActorError, RayTaskError) as e:
            mapped = self._failed(e)
            if mapped is e:
                raise
            raise mapped from e

    # ----- transport ------------------------------------------------------------------------------
    def _request(self, call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall) -> LevelRequest:
        with self._frees_lock:
            frees, self._frees = tuple(self._frees), []
        return LevelRequest(frees, call)

    def _wire(self, seq_ids: list[str], sampling: Sequence[SamplingParams], sync: Sequence[SeqSync | None] | None,
              ) -> tuple[list[WireSampling], list[WireSync] | None]:
        """Sampling parameters only where the actor does not hold them already (a new or restarted sequence, or
        other parameters than last time), syncs as tuples."""
        wire_sp: list[WireSampling] = []
        with self._frees_lock:
            for b, (sid, sp) in enumerate(zip(seq_ids, sampling)):
                start = sync is not None and sync[b] is not None and sync[b].keep == 0
                held = self._sampled.get(sid)
                if start or held is None or (held is not sp and held != sp):
                    self._sampled[sid] = sp
                    wire_sp.append(sp)
                else:
                    wire_sp.append(None)
        return wire_sp, wire_syncs(sync)

    def _forget_samplings(self) -> None:
        """After a failure the actor may be a new incarnation without them: send them again."""
        with self._frees_lock:
            self._sampled.clear()

    def _send(self, call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall) -> Any:
        """One round call over the transport."""
        if self.transport == "direct":
            return self._send_direct(call)
        if self.transport == "call":
            try:
                return self._get(self._run.remote(self._request(call)))
            except Exception:
                self._forget_samplings()
                raise
        with self._graph_lock:
            graph = self._compiled()
            try:
                ref = graph.execute(self._request(call))
                # a compiled graph's own default wait is 10 s; a CPU prefill of a batch can take longer
                return ref.get(timeout=self.timeout_s if self.timeout_s is not None else 24 * 3600.0)
            except (RayActorError, RayChannelError, RayChannelTimeoutError) as e:
                self._drop_graph()  # broken with its actor: rebuilt on the next call
                self._forget_samplings()
                raise self._failed(e) from e
            except RayTaskError as e:
                self._forget_samplings()
                mapped = self._failed(e)
                if mapped is e:
                    raise
                raise mapped from e

    def _send_direct(self, call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall) -> Any:
        with self._direct_lock:
            try:
                if self._direct is None:
                    self._direct = FrameClient(*self._direct_at, timeout_s=self.timeout_s)
                return self._direct.call(self._request(call))
            except TransportError as e:
                self._drop_direct()
                raise LevelUnavailable(self.level, str(e)) from e
            except KeyError as e:  # an unknown sequence: a restarted actor lost them all
                self._forget_samplings()
                if self.check_restarted():
                    raise LevelRestarted(self.level, "its actor was restarted and lost every sequence; re-add them") \
                        from e
                raise

    def _drop_direct(self) -> None:
        """Close the connection; the next call connects to wherever the actor (maybe restarted) listens now."""
        self._forget_samplings()
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        try:  # a restarted actor listens on a new port with a new token; Ray tells where
            self._direct_at = ray.get(self._info.remote(), timeout=5.0)["direct"]
        except Exception as exc:  # dead or still restarting: asked again after the next failure
            log.debug("%s: no fresh address yet: %s", self.level, exc)

    def _compiled(self) -> Any:
        if self._graph is None:
            from ray.dag import InputNode

            try:
                with InputNode() as request:
                    dag = self.handle.run.bind(request)
                self._graph = dag.experimental_compile()
            except (RayActorError, RayChannelError, GetTimeoutError) as e:
                raise LevelUnavailable(self.level, f"compiling its graph failed: {_first_line(e)}") from e
        return self._graph

    def _drop_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.teardown()
            except Exception as exc:  # its actor is gone: nothing left to tear down
                log.debug("teardown of %s's graph: %s", self.level, exc)

    def close(self) -> None:
        """Close the direct connection and tear the compiled graph down (before the actor is killed, or when the
        cascade shuts down)."""
        with self._direct_lock:
            if self._direct is not None:
                self._direct.close()
                self._direct = None
        with self._graph_lock:
            self._drop_graph()

    def _flush(self) -> None:
        """Free the queued sequences now (before a call that is not a round's request)."""
        with self._frees_lock:
            frees, self._frees = self._frees, []
        if frees:
            self._get(self._free_many.remote(frees))

    # ----- protocol (blocking) --------------------------------------------------------------------
    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        self._flush()
        self._get(self._add.remote(seq_id, list(prompt_ids)))

    def free(self, seq_id: str) -> None:
        """Queue the sequence: it is freed with the level's next request (a restarted level lost it anyway)."""
        with self._frees_lock:
            self._frees.append(seq_id)
            self._sampled.pop(seq_id, None)

    def free_many(self, seq_ids: Sequence[str]) -> None:
        with self._frees_lock:
            frees, self._frees = [*self._frees, *seq_ids], []
            for sid in seq_ids:
                self._sampled.pop(sid, None)
        self._get(self._free_many.remote(frees))

    def propose(
        self, seq_ids: Sequence[str], k: Sequence[int], sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY, level: int = 0, sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        return self._send(ProposeCall(ids, list(k), sp, mode, level, sy, stop_below))

    def propose_tree(
        self, seq_ids: Sequence[str], depth: Sequence[int], sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY, level: int = 0, sync: Sequence[SeqSync | None] | None = None,
        width: int = 2, max_nodes: Sequence[int] | None = None,
    ) -> DraftProposal:
        """`Worker.propose_tree` in the actor (a level with `WorkerCaps.tree_propose`); the trees travel back as
        token ids and parents."""
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        prop: DraftProposal = self._send(TreeProposeCall(ids, list(depth), sp, mode, level, sy, width,
                                                         None if max_nodes is None else list(max_nodes)))
        if prop.trees is not None:
            prop.trees = [None if t is None else DraftTree(*t) for t in prop.trees]
        return prop

    def verify(
        self, seq_ids: Sequence[str], draft_ids: Sequence[Sequence[int]], draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams], method: VerifyMethod, level: int = 0,
        sync: Sequence[SeqSync | None] | None = None, return_probs: bool = False, confidence: bool = False,
    ) -> VerifyResult:
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        return self._send(VerifyCall(ids, [list(d) for d in draft_ids], draft_probs, sp, method, level, sy,
                                     return_probs, confidence))

    def verify_tree(
        self, seq_ids: Sequence[str], trees: Sequence[Any], draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams], method: VerifyMethod, level: int = 0,
        sync: Sequence[SeqSync | None] | None = None, return_probs: bool = False, confidence: bool = False,
    ) -> VerifyResult:
        """`Worker.verify_tree` in the actor (a level with `WorkerCaps.tree_verify`); the trees travel as token
        ids and parents."""
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        return self._send(TreeVerifyCall(ids, wire_trees(trees), draft_probs, sp, method, level, sy, return_probs,
                                         confidence))

    def nested(self, draft: NestedDraft, low: ActorWorker) -> NestedOutcome:
        """This (middle) level runs `draft`'s inner rounds beside its model, calling `low`'s actor directly
        (`specray.coordinator.inner`); direct transport only. A failure of `low` comes back as
        `NestedOutcome.low_error` (`LevelUnavailable` or `LevelRestarted`), one of this level raises."""
        if self.transport != "direct" or low.transport != "direct":
            raise ValueError("nested drafting needs the direct transport on both levels")
        mid_sp, _ = self._wire(draft.seq_ids, draft.sampling, draft.mid_syncs)
        low_sp, _ = low._wire(draft.seq_ids, draft.sampling, draft.low_syncs)
        with low._frees_lock:
            frees, low._frees = tuple(low._frees), []
        call = NestedCall(replace(draft, sampling=[]), mid_sp, low_sp, low._direct_at, frees)
        try:
            out: NestedOutcome = self._send_direct(call)
        except BaseException:
            with low._frees_lock:  # never reached the level below: free them with its next request
                low._frees[:0] = frees
            low._forget_samplings()
            raise
        if out.low_error is not None:
            out.low_error = low._peer_failed(out.low_error)
        return out

    def _peer_failed(self, exc: BaseException) -> BaseException:
        """Another level's actor could not reach this one (nested drafting): the exception the coordinator should
        see, after making ready to reconnect (a restarted actor has a new address)."""
        if isinstance(exc, KeyError):
            self._forget_samplings()
            if self.check_restarted():
                return LevelRestarted(self.level, "its actor was restarted and lost every sequence; re-add them")
            return exc
        if isinstance(exc, ConnectionError):
            self._drop_direct()
            return LevelUnavailable(self.level, f"{type(exc).__name__}: {exc}")
        self._forget_samplings()
        return exc

    def stats(self) -> WorkerStats:
        self._flush()
        return self._get(self._stats.remote())

    def info(self) -> dict[str, Any]:
        """Fresh info (node, pid, incarnation, ...) from the actor."""
        return self._get(self._info.remote())

    def ping(self) -> str:
        return self._get(self._ping.remote())

    # ----- protocol (asyncio, plain calls) ----------------------------------------------------------
    async def add_async(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        await self._aget(self._add.remote(seq_id, list(prompt_ids)))

    async def free_many_async(self, seq_ids: Sequence[str]) -> None:
        await self._aget(self._free_many.remote(list(seq_ids)))

    async def propose_async(
        self, seq_ids: Sequence[str], k: Sequence[int], sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY, level: int = 0, sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        call = ProposeCall(list(seq_ids), list(k), list(sampling), mode, level, wire_syncs(sync), stop_below)
        return await self._aget(self._run.remote(self._request(call)))

    async def verify_async(
        self, seq_ids: Sequence[str], draft_ids: Sequence[Sequence[int]], draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams], method: VerifyMethod, level: int = 0,
        sync: Sequence[SeqSync | None] | None = None, return_probs: bool = False, confidence: bool = False,
    ) -> VerifyResult:
        call = VerifyCall(list(seq_ids), [list(d) for d in draft_ids], draft_probs, list(sampling), method, level,
                          wire_syncs(sync), return_probs, confidence)
        return await self._aget(self._run.remote(self._request(call)))

    async def stats_async(self) -> WorkerStats:
        return await self._aget(self._stats.remote())

    def __repr__(self) -> str:
        return f"ActorWorker({self.level!r}, node={str(self._info_cache.get('node_id'))[:8]}, {self.transport})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _last_line(exc: BaseException) -> str:
    """The last line of a remote traceback: the original exception ("RuntimeError: weights not found")."""
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


class RemoteNesting:
    """`Nesting` over level actors: a middle level reaches the level below it directly when both are actors on
    the direct transport (`ActorWorker.nested`)."""

    def reaches(self, mid: Worker, low: Worker) -> bool:
        return (isinstance(mid, ActorWorker) and isinstance(low, ActorWorker)
                and mid.transport == "direct" and low.transport == "direct")

    def draft(self, mid: Worker, low: Worker, call: NestedDraft) -> NestedOutcome:
        assert isinstance(mid, ActorWorker) and isinstance(low, ActorWorker)
        return mid.nested(call, low)
