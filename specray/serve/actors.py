"""Model levels as Ray actors: one actor per level, with that level's own resources.

- `LevelActor` (`specray.serve.level_actor`) holds one worker (built inside the actor from a picklable zero-arg
  factory, so the weights never travel) and serves it. It is a plain class; `ray.remote` is applied only in
  `specray.serve.launch.launch_levels`, which starts one per model level and returns ready-to-use `Level`s.
- `ActorWorker` (here) is the client side: it implements the worker protocol over the actor handle, so
  `CascadeEngine` drives a remote level exactly like an in-process one. Its call plumbing (transports, the queue
  of frees, Ray failures mapped to `LevelUnavailable`, restarts detected) is `ActorClient`
  (`specray.serve.actor_client`); the coordinator acts on `LevelUnavailable` (drop the level, or re-add its
  sequences).
- `RemoteNesting` lets a middle level run its inner rounds in its actor, calling the level below directly
  (`specray.coordinator.inner`; direct transport), and send its drafts straight to the target's actor
  (`ActorWorker.verify_later`, `RelayedVerify`; specray.serve.relay).

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
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from specray.coordinator.inner import NestedDraft, NestedOutcome, PendingVerify
from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, Worker, WorkerCaps, WorkerStats
from specray.serve.actor_client import TRANSPORTS, ActorClient, LevelRestarted, LevelUnavailable
from specray.serve.direct import PendingReply, TransportError
from specray.serve.level_actor import LevelActor, LevelStartError, WorkerFactory
from specray.serve.wire import (
    Endpoint,
    NestedCall,
    ProposeCall,
    RelayedDrafts,
    RelayedVerifyCall,
    TreeProposeCall,
    TreeVerifyCall,
    VerifyCall,
    wire_syncs,
    wire_trees,
)
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.tree import DraftTree

log = logging.getLogger(__name__)

__all__ = [
    "TRANSPORTS",
    "ActorWorker",
    "LevelActor",
    "LevelRestarted",
    "LevelStartError",
    "LevelUnavailable",
    "RelayedVerify",
    "RemoteNesting",
    "WorkerFactory",
]


class ActorWorker(ActorClient):
    """The worker protocol over a `LevelActor` handle (blocking; `*_async` variants await plain calls).

    Static facts (name, vocab size, context, eos ids, tokenizer fingerprint, capabilities) are read once from
    `info()`. `propose` and `verify` go over `transport` (module docstring); `free` only queues the sequence,
    which leaves with the level's next request, or before any other call.
    """

    def capabilities(self) -> WorkerCaps:
        return self.caps

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
        return self._send(self._propose_call(seq_ids, k, sampling, mode, level, sync, stop_below))

    def _propose_call(
        self, seq_ids: Sequence[str], k: Sequence[int], sampling: Sequence[SamplingParams], mode: str, level: int,
        sync: Sequence[SeqSync | None] | None, stop_below: float, relay: RelayedVerify | None = None,
    ) -> ProposeCall:
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        return ProposeCall(ids, list(k), sp, mode, level, sy, stop_below,
                           relay=None if relay is None else (relay.at, relay.key))

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

    def propose_relayed(
        self, relay: RelayedVerify, seq_ids: Sequence[str], k: Sequence[int], sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY, level: int = 0, sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> tuple[DraftProposal, bool]:
        """`propose`, the actor also sending the drafts to `relay`'s target; the drafts, and whether it sent
        them. Direct transport only."""
        if self.transport != "direct":
            raise ValueError("relayed drafts need the direct transport")
        return self._send_direct(self._propose_call(seq_ids, k, sampling, mode, level, sync, stop_below, relay))

    def verify_later(
        self, seq_ids: Sequence[str], sampling: Sequence[SamplingParams], method: VerifyMethod, level: int,
        sync: Sequence[SeqSync | None] | None, fill: Sequence[int], forward: ActorWorker | None = None,
    ) -> RelayedVerify:
        """Ask this level to verify the rows once a middle level sends it their drafts (`fill`: the rows that get
        drafts, in the order sent; specray.serve.relay); direct transport only. `forward`: send the verdict on
        those rows to that middle level's actor too (specray.serve.follow)."""
        if self.transport != "direct":
            raise ValueError("a relayed verification needs the direct transport")
        ids = list(seq_ids)
        sp, sy = self._wire(ids, sampling, sync)
        key = uuid.uuid4().hex
        to = None if forward is None else forward._direct_at
        pending = self._begin_direct(RelayedVerifyCall(key, ids, sp, method, level, sy, list(fill), forward=to))
        return RelayedVerify(self, pending, self._direct_at, key)  # where it went (the connection is ours)

    def nested(self, draft: NestedDraft, low: ActorWorker | None, relay: RelayedVerify | None = None) -> NestedOutcome:
        """This (middle) level runs `draft`'s inner rounds beside its model, calling `low`'s actor directly
        (`specray.coordinator.inner`), or with `low` None drafting with the n-gram lookup `draft.lookup` itself;
        direct transport only. A failure of `low` comes back as `NestedOutcome.low_error` (`LevelUnavailable` or
        `LevelRestarted`), one of this level raises. `relay`: send the drafts on to that target's verification."""
        if self.transport != "direct" or (low is not None and low.transport != "direct"):
            raise ValueError("nested drafting needs the direct transport on both levels")
        mid_sp, _ = self._wire(draft.seq_ids, draft.sampling, draft.mid_syncs)
        to = None if relay is None else (relay.at, relay.key)
        if low is None:
            return self._send_direct(NestedCall(replace(draft, sampling=[]), mid_sp, [], None, (), poll=self.poll,
                                                relay=to))
        low_sp, _ = low._wire(draft.seq_ids, draft.sampling, draft.low_syncs)
        with low._frees_lock:
            frees, low._frees = tuple(low._frees), []
        call = NestedCall(replace(draft, sampling=[]), mid_sp, low_sp, low._direct_at, frees, poll=self.poll,
                          relay=to)
        try:
            out: NestedOutcome = self._send_direct(call)
        except BaseException:
            with low._frees_lock:  # never reached the level below, or owed there by this level: free them again
                low._frees[:0] = [*(f for carried in self._carried for f in carried), *frees]
            self._carried = ()
            low._forget_samplings()
            raise
        if frees:
            self._carried = (*self._carried[-1:], frees)
        if out.low_error is not None:
            out.low_error = low._peer_failed(out.low_error)
        return out

    def stats(self) -> WorkerStats:
        self._flush()
        return self._get(self._stats.remote())

    def reset_prefix_cache(self) -> None:
        self._flush()
        self._get(self.handle.reset_prefix_cache.remote())

    def transport_stats(self) -> dict[str, float]:
        """The actor's direct transport: requests served, seconds busy and idle between them, the median idle gap
        in ms (`specray.serve.direct.FrameServer.stats`)."""
        return self._get(self.handle.transport_stats.remote())

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


class RelayedVerify:
    """A relayed verification in flight at a target's actor (`ActorWorker.verify_later`, `PendingVerify`): `at`
    and `key` tell the middle level where to send the drafts."""

    def __init__(self, target: ActorWorker, pending: PendingReply, at: Endpoint, key: str) -> None:
        self.target = target
        self.at = at
        self.key = key
        self._pending: PendingReply | None = pending

    def send_drafts(self, drafts: DraftProposal) -> None:
        self._post(RelayedDrafts(self.key, drafts.token_ids, drafts.probs))

    def result(self) -> VerifyResult:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("the relayed verification's result was read already")
        return self.target._finish_direct(pending)

    def abort(self, reason: str) -> None:
        if self._pending is None:
            return
        try:
            self._post(RelayedDrafts(self.key, [], None, abort=reason))
        finally:
            try:
                self.result()  # RelayAborted, or the verdict if it ran already: either way the call is over
            except Exception as exc:
                log.debug("%s: relayed verification aborted: %s", self.target.level, exc)

    def _post(self, drafts: RelayedDrafts) -> None:
        if self._pending is None:
            raise RuntimeError("the relayed verification is over")
        try:
            self._pending.post(drafts)
        except TransportError as e:  # the connection broke: `result` reports the failure
            log.debug("%s: sending the relayed drafts failed: %s", self.target.level, e)


class RemoteNesting:
    """`Nesting` over level actors: a middle level reaches the level below it directly when both are actors on
    the direct transport (`ActorWorker.nested`), and sends its drafts straight to the target when that is one too
    and `relay` is on (`ActorWorker.verify_later`, specray.serve.relay)."""

    def __init__(self, relay: bool = True, follow: bool = True) -> None:
        self.relay = relay
        self.follow = follow

    def reaches(self, mid: Worker, low: Worker | None) -> bool:
        return _direct(mid) and (low is None or _direct(low))

    def relays(self, drafter: Worker, target: Worker) -> bool:
        return self.relay and _direct(drafter) and _direct(target)

    def follows(self, mid: Worker, target: Worker) -> bool:
        return self.follow and self.relays(mid, target)

    def propose(
        self, worker: Worker, relay: PendingVerify, seq_ids: list[str], k: list[int], sampling: list[SamplingParams],
        *, mode: str, level: int, sync: list[SeqSync], stop_below: float,
    ) -> tuple[DraftProposal, bool]:
        assert isinstance(worker, ActorWorker) and isinstance(relay, RelayedVerify)
        return worker.propose_relayed(relay, seq_ids, k, sampling, mode=mode, level=level, sync=sync,
                                      stop_below=stop_below)

    def verify_later(
        self, target: Worker, seq_ids: list[str], sampling: list[SamplingParams], method: VerifyMethod, *,
        level: int, sync: list[SeqSync], fill: list[int], forward: Worker | None = None,
    ) -> RelayedVerify:
        assert isinstance(target, ActorWorker) and (forward is None or isinstance(forward, ActorWorker))
        return target.verify_later(seq_ids, sampling, method, level, sync, fill, forward)

    def draft(self, mid: Worker, low: Worker | None, call: NestedDraft,
              relay: PendingVerify | None = None) -> NestedOutcome:
        assert isinstance(mid, ActorWorker) and (low is None or isinstance(low, ActorWorker))
        assert relay is None or isinstance(relay, RelayedVerify)
        return mid.nested(call, low, relay)


def _direct(worker: Worker | None) -> bool:
    return isinstance(worker, ActorWorker) and worker.transport == "direct"
