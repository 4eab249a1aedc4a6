"""One model level inside a Ray actor: the server side of `specray.serve.actors`.

`LevelActor` builds its worker in-process from a picklable zero-arg factory (`WorkerFactory`), so the weights never
travel, and serves it: a round's `LevelRequest` (over the direct transport's socket, a compiled graph's channel or a
plain actor call) frees the sequences the coordinator finished, then proposes or verifies; `add`, `free_many` and
`stats` are plain actor calls. `info()` says where the actor runs (node, pid, placement bundle, resources, memory)
and its incarnation, which changes on every (re)start. It is a plain class; `ray.remote` is applied only in
`specray.serve.launch.launch_levels`.
"""

from __future__ import annotations

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

from specray.coordinator.inner import NestedDraft, NestedOutcome
from specray.engine.protocol import DraftProposal, VerifyResult, Worker, WorkerStats
from specray.heap import freeze_startup_heap
from specray.serve.direct import FrameClient, FrameServer, Reply, TransportError
from specray.serve.follow import FollowOns
from specray.serve.relay import Rendezvous
from specray.serve.wire import (
    Endpoint,
    Frees,
    LevelRequest,
    NestedCall,
    RelayedDrafts,
    RelayedVerifyCall,
    Samplings,
    Verdict,
)

__all__ = ["LevelActor", "LevelStartError", "WorkerFactory"]

WorkerFactory = Callable[[], Worker]

_BUNDLE_RE = re.compile(r"_group_(\d+)_[0-9a-f]+$")


class LevelStartError(RuntimeError):
    """A level's actor could not be created or did not become ready."""


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
        #: other levels' actors this one calls (nested drafting, relays)
        self._peers = PeerLinks()
        #: relayed verifications (this level as a target) meet their drafts here; their verdicts go on to the
        #: middle level that asked for a follow-on
        self._relay = Rendezvous(self.run, self.free_many, forward=self._peers.post)
        #: this level as a middle level: the next round drafted on the target's verdict (specray.serve.follow)
        self._follow = FollowOns(self._run_nested, lambda call, out: call.relay_outcome(out, self._peers),
                                 post=self._peers.post)
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the server's threads set it too
        self._server = FrameServer(ray.util.get_node_ip_address(), self._frame,
                                   on_thread_start=lambda: torch.set_num_threads(threads), replies=True)
        self.incarnation = uuid.uuid4().hex  # changes on every (re)start; lets clients detect restarts
        self.caps = self.worker.capabilities()
        tok = getattr(self.worker, "tokenizer", None)  # backends without text (test fakes) have None
        fingerprint = eos_id = None
        if tok is not None:
            from specray.engine.tokenizer_check import tokenizer_fingerprint

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
        freeze_startup_heap()  # the model and the modules: out of the collector's walks while serving

    # ----- protocol -------------------------------------------------------------------------------
    # A compiled graph's loop runs beside the actor's ordinary calls (Ray runs it in a system concurrency group):
    # the lock keeps the worker single-threaded.
    def run(self, request: LevelRequest) -> DraftProposal | VerifyResult | NestedOutcome:
        """A round's call (`ActorWorker`): free what the coordinator finished, then propose or verify; a nested
        request that a follow-on was drafted for takes its outcome (specray.serve.follow)."""
        call = request.call
        nested = call if isinstance(call, NestedCall) else None
        # its draft with the sampling resolved, only where a follow-on is compared with it or asked for
        draft = (self._resolved(nested) if nested is not None
                 and (nested.draft.follow is not None or self._follow.waiting) else None)
        ahead = self._follow.claim(nested, draft)
        with self._lock:
            self._free(request.frees)
            if nested is None:
                return call.run(self.worker, self._samplings, self._peers)
            if ahead is not None:
                out, relayed = ahead
            else:
                out, relayed = replace(self._follow.sent(nested), relay=None).run(self.worker, self._samplings,
                                                                                  self._peers), False
            if relayed:  # by the drafting thread, which remembered this request for its verdict too
                return out
            if draft is not None:
                self._follow.ran(nested, draft, out)  # before its drafts reach the target: its verdict may follow
            return nested.relay_outcome(out, self._peers)

    def _resolved(self, call: NestedCall) -> NestedDraft | None:
        """The nested request's draft with its sampling parameters resolved (None: a row this level never saw)."""
        try:
            return replace(call.draft, sampling=self._samplings.resolve(call.draft.seq_ids, call.mid_sampling))
        except KeyError:
            return None

    def _run_nested(self, call: NestedCall, cancel: Callable[[], bool]) -> NestedOutcome:
        with self._lock:
            return call.run(self.worker, self._samplings, self._peers, cancel)

    def _frame(self, request: LevelRequest | RelayedDrafts | Verdict | Frees, reply: Reply | None) -> Any:
        """A frame of the direct transport: a round's call, either half of a relayed verification
        (specray.serve.relay), whose reply may be deferred until the other half comes, a verdict to draft
        the next round on, or frees a middle level above owed this level (specray.serve.follow)."""
        if isinstance(request, RelayedDrafts):
            self._relay.drafts(request)
            return None
        if isinstance(request, Verdict):
            self._follow.verdict(request)
            return None
        if isinstance(request, Frees):
            with self._lock:
                self._free(request.seq_ids)
            return None
        if isinstance(request.call, RelayedVerifyCall):
            if reply is None:
                raise ValueError("a relayed verification needs a reply")
            return self._relay.verify(request, reply)
        return self.run(request)

    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        self._follow.claim(None, None)
        with self._lock:
            self.worker.add(seq_id, prompt_ids)

    def free_many(self, seq_ids: Sequence[str]) -> None:
        """Free several sequences in one call (idempotent)."""
        self._follow.claim(None, None)
        with self._lock:
            self._free(seq_ids)

    def _free(self, seq_ids: Sequence[str]) -> None:  # under the lock
        for s in seq_ids:
            self.worker.free(s)
            self._samplings.forget(s)

    def stats(self) -> WorkerStats:
        with self._lock:
            return self.worker.stats()

    def transport_stats(self) -> dict[str, float]:
        """The direct transport's requests served, seconds busy and idle between requests, and the median idle
        gap (`FrameServer.stats`): where a round's time goes outside this level; and its follow-ons drafted,
        used and dropped (`FollowOns.stats`)."""
        return {**self._server.stats(), **{f"follow_{k}": float(v) for k, v in self._follow.stats().items()}}

    def reset_prefix_cache(self) -> None:
        self._follow.claim(None, None)
        with self._lock:
            self.worker.reset_prefix_cache()

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


class PeerLinks:
    """Connections from a level actor to other level actors' direct transports (`wire.Peers`), one per endpoint
    and polling choice, made on first use and dropped when broken."""

    def __init__(self) -> None:
        self._clients: dict[tuple[Endpoint, bool], FrameClient] = {}
        self._lock = threading.Lock()

    def call(self, at: Endpoint, request: LevelRequest, poll: bool = False) -> Any:
        """A request to another level's actor (a middle level's proposes to the level below)."""
        client = self._client(at, poll)
        try:
            return client.call(request, request.shape() if poll else None)
        except TransportError:
            self._drop(at, poll, client)
            raise

    def post(self, at: Endpoint, request: Any) -> None:
        """A one-way request to another level's actor (a middle level's relayed drafts)."""
        client = self._client(at, False)
        try:
            client.post(request)
        except TransportError:
            self._drop(at, False, client)
            raise

    def _client(self, at: Endpoint, poll: bool) -> FrameClient:
        with self._lock:
            client = self._clients.get((at, poll))
            if client is None:
                client = self._clients[(at, poll)] = FrameClient(*at, poll=poll)
            return client

    def _drop(self, at: Endpoint, poll: bool, client: FrameClient) -> None:
        with self._lock:
            if self._clients.get((at, poll)) is client:
                del self._clients[(at, poll)]
        client.close()


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
