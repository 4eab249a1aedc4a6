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
from typing import Any

import ray
import torch

from specray.engine.protocol import DraftProposal, VerifyResult, Worker, WorkerStats
from specray.serve.direct import FrameClient, FrameServer, TransportError
from specray.serve.wire import Endpoint, LevelRequest, Samplings

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
        #: other levels' actors this one calls (nested drafting), per endpoint and polling choice
        self._peers: dict[tuple[Endpoint, bool], FrameClient] = {}
        threads = torch.get_num_threads()  # OpenMP's thread count is per thread: the server's threads set it too
        self._server = FrameServer(ray.util.get_node_ip_address(), self.run,
                                   on_thread_start=lambda: torch.set_num_threads(threads))
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

    # ----- protocol -------------------------------------------------------------------------------
    # A compiled graph's loop runs beside the actor's ordinary calls (Ray runs it in a system concurrency group):
    # the lock keeps the worker single-threaded.
    def run(self, request: LevelRequest) -> DraftProposal | VerifyResult:
        """A round's call (`ActorWorker`): free what the coordinator finished, then propose or verify."""
        with self._lock:
            for seq_id in request.frees:
                self.worker.free(seq_id)
                self._samplings.forget(seq_id)
            return request.call.run(self.worker, self._samplings, self._peer_call)

    def _peer_call(self, at: Endpoint, request: LevelRequest, poll: bool = False) -> Any:
        """A request to another level's actor over its direct transport (a middle level's `NestedCall`)."""
        client = self._peers.get((at, poll))
        if client is None:
            client = self._peers[(at, poll)] = FrameClient(*at, poll=poll)
        try:
            return client.call(request, request.shape() if poll else None)
        except TransportError:
            self._peers.pop((at, poll), None)
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
                self._samplings.forget(s)

    def stats(self) -> WorkerStats:
        with self._lock:
            return self.worker.stats()

    def transport_stats(self) -> dict[str, float]:
        """The direct transport's requests served, seconds busy and idle between requests, and the median idle
        gap (`FrameServer.stats`): where a round's time goes outside this level."""
        return self._server.stats()

    def reset_prefix_cache(self) -> None:
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
