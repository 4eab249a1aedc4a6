"""The call plumbing under a level actor's client (`ActorClient`, the base of `specray.serve.actors.ActorWorker`).

A round's calls (`propose`, `propose_tree`, `verify`, `verify_tree`, a middle level's nested drafting) travel as one
`LevelRequest` each, by one of three transports (`TRANSPORTS`; `specray.serve.actors` compares them); the other
calls are plain actor calls. Sequences the coordinator finished are queued and freed inside the level's next request
(or before any other call), and a sequence's sampling parameters travel only when the actor does not hold them yet.

Failures: a Ray failure (a dead or restarting actor, a broken channel or connection, no answer within `timeout_s`)
becomes `LevelUnavailable`; a call that finds its sequences gone from an actor of a new incarnation (`ping`) raises
`LevelRestarted`. After a failure the connection is made again to the actor's new address (or the graph rebuilt),
and every sequence's sampling parameters are sent again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError, RayTaskError

from specray.engine.protocol import SeqSync, WorkerCaps
from specray.serve.direct import FrameClient, PendingReply, TransportError
from specray.serve.wire import (
    LevelRequest,
    NestedCall,
    ProposeCall,
    RelayedVerifyCall,
    TreeProposeCall,
    TreeVerifyCall,
    VerifyCall,
    WireSampling,
    WireSync,
    wire_syncs,
)
from specray.spec.params import SamplingParams

__all__ = ["TRANSPORTS", "ActorClient", "LevelRestarted", "LevelUnavailable"]

#: how a coordinator reaches its level actors (`specray.serve.actors` describes each)
TRANSPORTS = ("direct", "compiled", "call")

log = logging.getLogger(__name__)


class LevelUnavailable(RuntimeError):
    """A level's actor is dead, restarting or did not answer in time; its sequences may be gone."""

    def __init__(self, level: str, reason: str) -> None:
        super().__init__(f"level {level!r} is unavailable: {reason}")
        self.level = level


class LevelRestarted(LevelUnavailable):
    """The level's actor was restarted by Ray: it answers again, but every sequence it held is lost."""


class ActorClient:
    """A `LevelActor` handle with its call plumbing: static facts read once from `info()` (name, capabilities,
    tokenizer fingerprint, the direct transport's address), Ray failures mapped to `LevelUnavailable` and
    `LevelRestarted`, round calls sent over `transport`, and the queue of sequences to free."""

    def __init__(
        self, handle: Any, timeout_s: float | None = None, info: dict[str, Any] | None = None, level: str | None = None,
        transport: str = "direct", poll: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.handle = handle
        self.timeout_s = timeout_s
        self.transport = transport
        #: direct transport: poll near a reply that is due soon, and ask the actor to do so for our requests
        self.poll = poll
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
        #: the frees for the level below that this (middle) level's last two nested requests carried: a request
        #: that took a follow-on leaves them owed there until its next call below (specray.serve.follow), so if
        #: this level fails they are sent again (freeing is idempotent)
        self._carried: tuple[tuple[str, ...], ...] = ()
        self._frees_lock = threading.Lock()
        self._sampled: dict[str, SamplingParams] = {}  # the sampling parameters the actor holds per sequence
        self._graph: Any = None  # the compiled graph, built on first use and after a failure
        self._graph_lock = threading.Lock()  # one request in flight per level (the actor serves one at a time)
        self._direct: FrameClient | None = None  # the direct connection, made on first use and after a failure
        self._direct_at = i["direct"]  # (address, token) of the incarnation last seen
        self._direct_lock = threading.Lock()

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

    # ----- transport ------------------------------------------------------------------------------
    def _request(
        self, call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall | RelayedVerifyCall,
    ) -> LevelRequest:
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
        return self._finish_direct(self._begin_direct(call))

    def _begin_direct(
        self, call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall | RelayedVerifyCall,
    ) -> PendingReply:
        """Send `call` over the direct connection; its reply is read by `_finish_direct`, which must follow (the
        connection is the call's until then: `_direct_at` is where it went)."""
        self._direct_lock.acquire()
        try:
            if self._direct is None:
                self._direct = FrameClient(*self._direct_at, timeout_s=self.timeout_s, poll=self.poll)
            request = self._request(call)
            return self._direct.begin(request, request.shape() if self.poll else None)
        except TransportError as e:
            try:
                raise self._direct_failed(e) from e
            finally:
                self._direct_lock.release()
        except BaseException:
            self._direct_lock.release()
            raise

    def _finish_direct(self, pending: PendingReply) -> Any:
        try:
            return pending.result()
        except (TransportError, KeyError) as e:
            mapped = self._direct_failed(e)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            self._direct_lock.release()

    def _direct_failed(self, e: TransportError | KeyError) -> BaseException:
        """The exception for a failed direct call (with the connection lock held)."""
        if isinstance(e, TransportError):
            self._drop_direct()
            return LevelUnavailable(self.level, str(e))
        self._forget_samplings()  # an unknown sequence: a restarted actor lost them all
        if self.check_restarted():
            return LevelRestarted(self.level, "its actor was restarted and lost every sequence; re-add them")
        return e

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _last_line(exc: BaseException) -> str:
    """The last line of a remote traceback: the original exception ("RuntimeError: weights not found")."""
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""
