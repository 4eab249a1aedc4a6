"""What a round's request to a level actor looks like on the wire (`specray.serve.actors`): one `LevelRequest`
per call, whatever the transport (`NestedCall`: the direct transport only).

A row's sync is a (keep, append) tuple, and its sampling parameters travel once per sequence (they never
change): the actor keeps them until the sequence is freed. Dataclasses per row would cost more to pickle than a
GPU step's share of the round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from specray.coordinator.inner import LookupHolder, NestedDraft, NestedOutcome, run_nested
from specray.engine.protocol import DraftProposal, SeqSync, VerifyResult, Worker
from specray.engine.tree_rows import TokenTree
from specray.spec.params import SamplingParams, VerifyMethod

__all__ = ["Frees", "LevelRequest", "NestedCall", "Peers", "ProposeCall", "RelayedDrafts", "RelayedVerifyCall",
           "Samplings", "TreeProposeCall", "TreeVerifyCall", "Verdict", "VerifyCall", "WireSampling", "WireSync",
           "WireTree", "syncs", "wire_syncs", "wire_trees"]

WireSync = tuple[int, tuple[int, ...]] | None
#: a draft tree as (token_ids, parents) (`specray.spec.tree.DraftTree`'s layout); None: no draft
WireTree = tuple[tuple[int, ...], tuple[int, ...]] | None
WireSampling = SamplingParams | None  # None: the actor has it
#: (address, token) of a level actor's direct transport
Endpoint = tuple[tuple[str, int], str]

log = logging.getLogger(__name__)


class Peers(Protocol):
    """How a level actor reaches other level actors over their direct transport (nested drafting, relays)."""

    def call(self, at: Endpoint, request: LevelRequest, poll: bool = False) -> Any:
        """Send a `LevelRequest`, polling for the reply or not (`specray.serve.direct`); its result or exception."""

    def post(self, at: Endpoint, request: Any) -> None:
        """Send a one-way request (no reply)."""


class Samplings:
    """The actor's copy of each sequence's sampling parameters, and the n-gram text it holds for nested drafting
    with an n-gram level below it (`LookupHolder`)."""

    def __init__(self) -> None:
        self.by_seq: dict[str, SamplingParams] = {}
        self.lookups = LookupHolder()

    def forget(self, seq_id: str) -> None:
        """The sequence was freed at this level."""
        self.by_seq.pop(seq_id, None)
        self.lookups.free(seq_id)

    def resolve(self, seq_ids: list[str], sampling: list[WireSampling]) -> list[SamplingParams]:
        out = []
        for sid, sp in zip(seq_ids, sampling):
            if sp is None:
                try:
                    sp = self.by_seq[sid]
                except KeyError:
                    raise KeyError(f"unknown sequence {sid!r} (no sampling parameters)") from None
            else:
                self.by_seq[sid] = sp
            out.append(sp)
        return out


def syncs(sync: list[WireSync] | None) -> list[SeqSync | None] | None:
    return None if sync is None else [None if x is None else SeqSync(x[0], x[1]) for x in sync]


@dataclass(frozen=True)
class ProposeCall:
    """`Worker.propose` with its arguments, in wire form."""

    seq_ids: list[str]
    k: list[int]
    sampling: list[WireSampling]
    mode: str
    level: int
    sync: list[WireSync] | None
    stop_below: float
    #: also send the drafts to the target's actor at this endpoint, for the relayed verification with this key
    #: (specray.serve.relay); the reply is then (drafts, whether they were sent)
    relay: tuple[Endpoint, str] | None = None

    def run(self, worker: Worker, samplings: Samplings,
            peer: Peers | None = None) -> DraftProposal | tuple[DraftProposal, bool]:
        prop = worker.propose(self.seq_ids, self.k, samplings.resolve(self.seq_ids, self.sampling), mode=self.mode,
                              level=self.level, sync=syncs(self.sync), stop_below=self.stop_below)
        if self.relay is None:
            return prop
        return prop, _post_drafts(peer, self.relay, prop)

    def shape(self) -> tuple[int, int]:
        return len(self.seq_ids), max(self.k, default=0)


@dataclass(frozen=True)
class TreeProposeCall:
    """`Worker.propose_tree` with its arguments, in wire form; the trees come back as token ids and parents
    (`DraftProposal.trees` rebuilt on the caller's side), with q [B, N + 1, V] when sampled."""

    seq_ids: list[str]
    depth: list[int]
    sampling: list[WireSampling]
    mode: str
    level: int
    sync: list[WireSync] | None
    width: int
    max_nodes: list[int] | None

    def run(self, worker: Worker, samplings: Samplings, peer: Peers | None = None) -> DraftProposal:
        prop = worker.propose_tree(self.seq_ids, self.depth, samplings.resolve(self.seq_ids, self.sampling),
                                   mode=self.mode, level=self.level, sync=syncs(self.sync), width=self.width,
                                   max_nodes=self.max_nodes)
        return replace(prop, trees=None if prop.trees is None else wire_trees(prop.trees))

    def shape(self) -> tuple[int, int]:
        return len(self.seq_ids), max(self.depth, default=0) * self.width


@dataclass(frozen=True)
class VerifyCall:
    """`Worker.verify` with its arguments, in wire form."""

    seq_ids: list[str]
    draft_ids: list[list[int]]
    draft_probs: torch.Tensor | None  # [B, K, V] (rejection only)
    sampling: list[WireSampling]
    method: VerifyMethod
    level: int
    sync: list[WireSync] | None
    return_probs: bool
    confidence: bool

    def run(self, worker: Worker, samplings: Samplings, peer: Peers | None = None) -> VerifyResult:
        return worker.verify(self.seq_ids, self.draft_ids, self.draft_probs,
                             samplings.resolve(self.seq_ids, self.sampling), self.method, level=self.level,
                             sync=syncs(self.sync), return_probs=self.return_probs, confidence=self.confidence)

    def shape(self) -> tuple[int, int]:
        return len(self.seq_ids), max(map(len, self.draft_ids), default=0)


@dataclass(frozen=True)
class TreeVerifyCall:
    """`Worker.verify_tree` with its arguments, in wire form: each tree as token ids and parents only."""

    seq_ids: list[str]
    trees: list[WireTree]
    draft_probs: torch.Tensor | None  # [B, N + 1, V] (rejection only)
    sampling: list[WireSampling]
    method: VerifyMethod
    level: int
    sync: list[WireSync] | None
    return_probs: bool = False
    confidence: bool = False

    def run(self, worker: Worker, samplings: Samplings, peer: Peers | None = None) -> VerifyResult:
        trees = [None if t is None else TokenTree(*t) for t in self.trees]
        return worker.verify_tree(self.seq_ids, trees, self.draft_probs,
                                  samplings.resolve(self.seq_ids, self.sampling), self.method, level=self.level,
                                  sync=syncs(self.sync), return_probs=self.return_probs,
                                  confidence=self.confidence)

    def shape(self) -> tuple[int, int]:
        return len(self.seq_ids), max((len(t[0]) for t in self.trees if t is not None), default=0)


@dataclass(frozen=True)
class NestedCall:
    """A middle level runs its inner rounds itself (`specray.coordinator.inner.run_nested`), calling the level
    below at `low_at` directly, or (`low_at` None) drafting with the n-gram lookup `draft.lookup` it holds beside
    its model. Sampling parameters in wire form for each level (`draft.sampling` is empty); `low_frees`: sequences
    the coordinator finished, freed at the level below with the first call to it."""

    draft: NestedDraft
    mid_sampling: list[WireSampling]
    low_sampling: list[WireSampling]
    low_at: Endpoint | None
    low_frees: tuple[str, ...]
    poll: bool = False  # the connection to the level below polls for replies (the coordinator's own choice)
    #: send the drafts to the target's actor at this endpoint, for the relayed verification with this key
    #: (`RelayedVerifyCall`; specray.serve.relay)
    relay: tuple[Endpoint, str] | None = None

    def run(self, worker: Worker, samplings: Samplings, peer: Peers | None = None,
            cancel: Callable[[], bool] | None = None) -> NestedOutcome:
        draft = replace(self.draft, sampling=samplings.resolve(self.draft.seq_ids, self.mid_sampling))
        if self.low_at is None:
            if draft.lookup is None:
                raise ValueError("a nested draft without a level below to call needs an n-gram lookup")
            return self.relay_outcome(run_nested(draft, worker, samplings.lookups.proposer(draft.lookup), cancel),
                                      peer)
        if peer is None:
            raise ValueError("a nested draft needs the direct transport to reach the level below")
        first = [True]

        def propose_low(seq_ids: list[str], k: list[int], sampling: list, *, mode: str, level: int,
                        sync: list[SeqSync], stop_below: float) -> DraftProposal:
            frees, wire_sp = (), [None] * len(seq_ids)  # the level below holds the parameters after the first
            if first[0]:  # the first inner round calls it with every row (`run_nested`)
                first[0] = False
                frees, wire_sp = self.low_frees, self.low_sampling
            call = ProposeCall(seq_ids, k, wire_sp, mode, level, wire_syncs(sync), stop_below)
            return peer.call(self.low_at, LevelRequest(frees, call), self.poll)

        return self.relay_outcome(run_nested(draft, worker, propose_low, cancel), peer)

    def relay_outcome(self, out: NestedOutcome, peer: Peers | None) -> NestedOutcome:
        """Send the drafts on to the target (`relay`), unless the level below failed (the coordinator then aborts
        the verification)."""
        if self.relay is not None and out.low_error is None:
            out.relayed = _post_drafts(peer, self.relay, out.drafts)
        return out

    def shape(self) -> tuple[int, int]:
        return len(self.draft.seq_ids), max(self.draft.want, default=0)


def _post_drafts(peer: Peers | None, relay: tuple[Endpoint, str], drafts: DraftProposal) -> bool:
    """Send a relayed verification its drafts; False if that failed (reported, not raised: the coordinator then
    sends them itself, and sees the target's failure if there is one)."""
    at, key = relay
    if peer is None:
        return False
    try:
        peer.post(at, RelayedDrafts(key, drafts.token_ids, drafts.probs))
        return True
    except Exception as exc:
        log.debug("relay to %s failed: %s", at, exc)
        return False


@dataclass(frozen=True)
class RelayedVerifyCall:
    """`Worker.verify` without its drafts, which another level sends to the same actor (`RelayedDrafts` with the
    same `key`; specray.serve.relay): the coordinator's half of a relayed verification. `fill`: the rows the
    relayed drafts are for, in their order (the other rows get none). Direct transport only."""

    key: str
    seq_ids: list[str]
    sampling: list[WireSampling]
    method: VerifyMethod
    level: int
    sync: list[WireSync] | None
    fill: list[int]
    return_probs: bool = False
    confidence: bool = False
    #: also send the verdict on the `fill` rows to the middle level's actor at this endpoint (`Verdict`): it drafts
    #: the next round on it (`NestedDraft.follow`, specray.serve.follow)
    forward: Endpoint | None = None

    def with_drafts(self, d: RelayedDrafts) -> VerifyCall:
        """The whole `VerifyCall`, once the drafts are here."""
        n = len(self.seq_ids)
        ids: list[list[int]] = [[] for _ in range(n)]
        for j, b in enumerate(self.fill):
            ids[b] = list(d.draft_ids[j])
        probs = None
        if d.draft_probs is not None and self.method is VerifyMethod.REJECTION:
            probs = d.draft_probs.new_zeros(n, *d.draft_probs.shape[1:])  # [B, K, V]
            probs[self.fill] = d.draft_probs
        return VerifyCall(self.seq_ids, ids, probs, self.sampling, self.method, self.level, self.sync,
                          self.return_probs, self.confidence)

    def run(self, worker: Worker, samplings: Samplings, peer: Peers | None = None) -> VerifyResult:
        raise ValueError("a relayed verification needs the direct transport (its drafts meet it in the actor)")

    def shape(self) -> tuple[int, int]:
        return len(self.seq_ids), 0


@dataclass(frozen=True)
class RelayedDrafts:
    """The drafts of a relayed verification (`RelayedVerifyCall` with the same `key`), one-way to the target's
    actor: from the middle level that made them, or from the coordinator when the middle level could not send
    them. `abort`: they will never come (why), and the verification is dropped unrun."""

    key: str
    draft_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None  # [len(fill), K, V] (rejection only)
    abort: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A relayed verification's verdict (`RelayedVerifyCall.forward`), one-way from the target to the middle level
    that drafted it: the tokens the target emitted on each row the middle level drafted (its request's rows, in
    order), so that it drafts the next round now (specray.serve.follow)."""

    key: str
    token_ids: list[list[int]]


@dataclass(frozen=True)
class Frees:
    """Sequences to free, one-way from a middle level to the level below: the frees a request carried for that
    level while the request took a follow-on (specray.serve.follow), where no call below follows to carry them."""

    seq_ids: tuple[str, ...]


@dataclass(frozen=True)
class LevelRequest:
    """One message to a level actor: sequences the coordinator finished (freed first), then the call."""

    frees: tuple[str, ...]
    call: ProposeCall | TreeProposeCall | VerifyCall | TreeVerifyCall | NestedCall | RelayedVerifyCall

    def shape(self) -> tuple[str, int, int]:
        """What the call's duration depends on: its kind, its rows (to the next power of two) and its tokens per
        row (`specray.serve.direct.FrameClock`)."""
        rows, tokens = self.call.shape()
        return type(self.call).__name__, 1 << max(0, rows - 1).bit_length(), tokens


def wire_syncs(sync: Sequence[SeqSync | None] | None) -> list[WireSync] | None:
    return None if sync is None else [None if x is None else (x.keep, tuple(x.append)) for x in sync]


def wire_trees(trees: Sequence[Any]) -> list[WireTree]:
    """Trees (anything with `token_ids` and `parents`) as plain tuples."""
    return [None if t is None else (tuple(int(x) for x in t.token_ids), tuple(int(p) for p in t.parents))
            for t in trees]
