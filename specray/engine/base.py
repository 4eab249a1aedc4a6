"""Backend-independent half of a logits-producing worker: sequence state, sync, propose and verify.

A backend supplies one thing, a ragged batched forward (`_forward`), plus where its KV length lives.
The HF backend and the test fake both derive from this, so the protocol logic is written (and tested)
once.

Invariant per sequence: `tokens` is the worker's copy of the text; KV is valid for `tokens[:kv_len]`,
and at least one token is pending (the last one), because its logits predict the next position.

Token trees (a backend with `tree_verify`): `score_tree` feeds each row's pending tokens and a draft tree in
one forward and keeps the tree's KV behind the text; `accept_paths` keeps one root-to-leaf path of it, so the
row is exactly as if that path had been fed as a chain. Between the two the row holds no pending token; any
other call drops the scored tree first.

A drafter with `tree_propose` drafts a token tree per row (`propose_tree`) the same way: it leaves the nodes of
its last tree forward in KV behind the text, and when the next call's sync appends tokens that follow a path of
that tree (the path the verifier accepted), that path's KV is kept (`_keep_paths`, as `accept_paths` does)
instead of being recomputed; the rest is dropped.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, WorkerCaps, WorkerStats
from specray.engine.threads import pinned
from specray.spec.params import PLACEHOLDER_TOKEN_ID, SamplingParams, TokenLogprob, VerifyMethod
from specray.spec.sampling import (
    SamplingBatch,
    TokenHistory,
    apply_penalties,
    on_device,
    processed_probs,
    raw_logprobs,
    sample_tokens,
)
from specray.spec.tree import ROOT, DraftTree, draft_children, pad_trees
from specray.spec.tree_verify import tree_penalized_logits, verify_tree
from specray.spec.verify import verify as verify_batch


@dataclass
class SeqState:
    slot: int
    tokens: list[int]
    kv_len: int = 0
    #: (prompt length, [V] bool: the tokens of the prompt), kept for the penalties (the prompt never changes)
    prompt_seen: tuple[int, torch.Tensor] | None = None
    #: (token_ids, parents) of the tree `score_tree` fed last, whose KV follows `tokens[:kv_len]`
    tree: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class TreeLike(Protocol):
    """A draft tree below a row's last token, nodes in topological order: `parents[i]` is -1 (a child of the
    root, the last token) or the index of an earlier node. A chain t0..t(k-1) has parents (-1, 0, ..., k-2)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def parents(self) -> Sequence[int]: ...


class TokenTree(NamedTuple):
    """The plainest `TreeLike`."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    @staticmethod
    def chain(token_ids: Sequence[int]) -> TokenTree:
        return TokenTree(tuple(int(t) for t in token_ids), tuple(range(-1, len(token_ids) - 1)))


def _check_tree(worker: str, b: int, tree: TreeLike | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if tree is None:
        return (), ()
    ids, parents = tuple(int(t) for t in tree.token_ids), tuple(int(p) for p in tree.parents)
    if len(ids) != len(parents):
        raise ValueError(f"{worker}: trees[{b}] has {len(ids)} token_ids but {len(parents)} parents")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"{worker}: trees[{b}].parents[{i}] = {p}; a parent must be -1 (the root) or an "
                             f"earlier node (topological order)")
    return ids, parents


def tree_window(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestor-or-self matrices of a batch of forests.

    parents: [B, q] long, parents[b, j] in [-1, j) (-1: a root). Returns (depth [B, q] long, window [B, q, q]
    bool with window[b, j, i] = i is j or an ancestor of j). A chain (parents j - 1) gives depth j and the
    lower triangle. Vectorised: log2(q) boolean matrix squarings, no loop over tokens."""
    b, q = parents.shape
    step = torch.zeros(b, q, q + 1, dtype=torch.bool)  # column q collects the roots' "parent"
    step.scatter_(2, torch.where(parents >= 0, parents, q)[..., None], True)
    window = step[..., :q] | torch.eye(q, dtype=torch.bool)
    reach = 1
    while reach < q - 1:  # window holds the ancestors within `reach` steps
        f = window.to(torch.float32)
        window = torch.bmm(f, f) > 0
        reach *= 2
    return window.sum(-1) - 1, window


def token_confidence(
    logits: torch.Tensor,  # [N, V] raw logits
    p: torch.Tensor,  # [N, V] the processed distributions the tokens were drawn from (one-hot for greedy rows)
    tokens: torch.Tensor,  # [N] long
    sb: SamplingBatch,  # N rows
) -> torch.Tensor:  # [N] float32
    """How sure a level was of each token: its probability under the row's sampling distribution, or for a
    greedy row (whose distribution is a one-hot) under the softmax of the raw logits."""
    idx = tokens.view(-1, 1)
    raw = torch.exp(logits.float().gather(1, idx)[:, 0] - torch.logsumexp(logits.float(), dim=-1))
    drawn = p.gather(1, idx)[:, 0]
    return torch.where(on_device(sb.temperature, raw.device) == 0, raw, drawn)


def plain_greedy(sampling: Sequence[SamplingParams], logprobs: bool = True) -> bool:
    """Whether every row is greedy without penalties (and, where they would be reported, without logprobs): its
    token is then the argmax of the raw logits (first index on ties, as `processed_probs` makes it), which the
    workers' fast paths compute alone."""
    return all(sp.greedy and not sp.penalized and (sp.logprobs is None or not logprobs) for sp in sampling)


def pad_rows(
    flat: torch.Tensor,  # [sum(keep), V] rows of each batch row, concatenated
    keep: Sequence[int],
) -> torch.Tensor:  # [B, max(keep), V], zeros past a row's own keep[b]
    """The rows of a ragged forward's logits padded to one slot count: a reshape when every row has the same
    count, else one scatter (not a copy per row)."""
    n = max(keep, default=0)
    if all(k == n for k in keep):
        return flat.reshape(len(keep), n, flat.shape[-1])
    out = flat.new_zeros(len(keep), n, flat.shape[-1])
    dest = [b * n + j for b, k in enumerate(keep) for j in range(k)]
    out.view(-1, flat.shape[-1])[torch.tensor(dest, dtype=torch.long, device=flat.device)] = flat
    return out


class LogitsWorker(abc.ABC):
    """Implements the worker protocol on top of `_forward`; see `specray.engine.protocol.Worker`."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    #: declared abilities (`WorkerCaps`); a backend or test double that has them sets these
    native_k: int = 0
    live_decode: bool = False
    engine_verify: int = 0
    #: the backend feeds token trees (`score_tree` / `accept_paths`); set by backends whose `_forward` takes
    #: `parents`
    tree_verify: bool = False
    #: the backend drafts token trees (`propose_tree`); needs a `_forward` that takes `parents`
    tree_propose: bool = False
    #: pending spans longer than this are prefilled alone, so a batched decode step stays short
    prefill_threshold: int = 8
    prefill_chunk: int = 512
    #: torch threads of every call (`specray.engine.threads`); None: the calling thread's count
    num_threads: int | None = None

    def __init__(self) -> None:
        self._seqs: dict[str, SeqState] = {}

    # ----- backend hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def _forward(
        self,
        seqs: Sequence[SeqState],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
        parents: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Feed inputs[b] at storage indices kv_len.. of each row; return logits [sum(keep), V] of the last
        keep[b] inputs of each row, rows concatenated. Must not change kv_len (the caller decides what is valid).

        parents (only asked of a backend with `tree_verify`): per row and input, the index of the input it
        follows (-1: the row's first input, which follows the KV prefix); an input then sits at position
        kv_len + its depth and sees the prefix, its ancestors and itself. None: each input follows the one
        before it (a chain)."""

    def _move_kv(self, slots: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy KV entry src[m] of slot slots[m] to index dst[m] (a backend with a KV cache)."""
        return None

    def _allocate(self, prompt: Sequence[int]) -> tuple[int, int]:
        """A KV slot for a new sequence with this prompt, and how many of the prompt's first positions the slot
        already holds valid KV for (a backend with prefix caching; 0 otherwise)."""
        return -1, 0

    def _release(self, slot: int, tokens: Sequence[int]) -> None:
        """Free `slot`, whose first positions hold valid KV of `tokens`."""
        return None

    def _cache_bytes(self) -> int:
        return 0

    def capabilities(self) -> WorkerCaps:
        return WorkerCaps(self.name, int(self.vocab_size), self.max_context, tuple(int(t) for t in self.eos_token_ids),
                          native_k=int(self.native_k), live_decode=bool(self.live_decode),
                          engine_verify=int(self.engine_verify), draft_confidence=True, penalties=True,
                          logprobs=True, tree_verify=bool(self.tree_verify),
                          tree_propose=bool(self.tree_propose))

    # ----- sequence state -----------------------------------------------------------------------
    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has an empty prompt")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"{self.name}: prompt of {len(prompt_ids)} tokens exceeds the context {self.max_context}")
        slot, cached = self._allocate(prompt_ids)
        self._seqs[seq_id] = SeqState(slot, list(prompt_ids), kv_len=cached)

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._release(seq.slot, seq.tokens[: seq.kv_len])

    def rollback(self, seq_id: str, length: int) -> None:
        self._apply_sync(self._get(seq_id), SeqSync(length))

    def tokens(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).tokens)

    def reset_prefix_cache(self) -> None:
        """No prefix cache here (a backend with one forgets it)."""
        return None

    def stats(self) -> WorkerStats:
        return WorkerStats(
            live_sequences=len(self._seqs),
            cached_tokens=sum(s.kv_len for s in self._seqs.values()),
            cache_bytes=self._cache_bytes(),
        )

    def _get(self, seq_id: str) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq_id!r}") from None

    def _apply_sync(self, seq: SeqState, sync: SeqSync | None) -> None:
        if sync is None:
            return
        if not 0 < sync.keep <= len(seq.tokens):
            raise ValueError(f"{self.name}: cannot keep {sync.keep} of {len(seq.tokens)} tokens")
        seq.tree = None
        del seq.tokens[sync.keep :]
        if seq.prompt_seen is not None and sync.keep < seq.prompt_seen[0]:
            seq.prompt_seen = None  # the prompt itself changed (never from the coordinator): recount it
        seq.tokens.extend(sync.append)
        seq.kv_len = min(seq.kv_len, sync.keep)  # rollback: a length, no copy

    def _prepare(self, seq_ids: Sequence[str], sync: Sequence[SeqSync | None] | None) -> list[SeqState]:
        if sync is not None:
            if len(sync) != len(seq_ids):
                raise ValueError("sync must be aligned with seq_ids")
            for sid, sy in zip(seq_ids, sync):
                if sy is not None and sy.keep == 0:  # (re)start the sequence with this prompt
                    self.free(sid)
                    self.add(sid, sy.append)
        seqs = [self._get(s) for s in seq_ids]
        if sync is not None:
            sync = self._adopt_tree_paths(seqs, sync)
            for seq, sy in zip(seqs, sync):
                if sy is not None and sy.keep > 0:
                    self._apply_sync(seq, sy)
        for seq in seqs:
            seq.tree = None  # a tree scored and not accepted is dropped (its KV lies past kv_len)
            seq.kv_len = min(seq.kv_len, len(seq.tokens) - 1)  # keep one pending token
            while len(seq.tokens) - seq.kv_len > self.prefill_threshold:
                start = seq.kv_len
                chunk = seq.tokens[start : min(len(seq.tokens) - 1, start + self.prefill_chunk)]
                self._forward([seq], [chunk], [1])
                seq.kv_len = start + len(chunk)
        return seqs

    # ----- protocol: propose / verify -----------------------------------------------------------
    @pinned
    def propose(
        self,
        seq_ids: Sequence[str],
        k: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        """Draft k[b] tokens per sequence, one batched forward per step; keep them as tentative tokens (a row
        stops early after a token it gave less than `stop_below`)."""
        seqs = self._prepare(seq_ids, sync)
        kmax = max(k, default=0)
        out: list[list[int]] = [[] for _ in seqs]
        if mode != DraftMode.RANDOM and stop_below <= 0 and plain_greedy(sampling, logprobs=False):
            # every row's token is the argmax of its logits (what every mode draws from a one-hot): one op and one
            # read per step
            for t in range(kmax):
                rows = [b for b in range(len(seqs)) if k[b] > t]
                batch = [seqs[b] for b in rows]
                logits = self._forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))  # [B_t, V]
                for b, s, tok in zip(rows, batch, logits.argmax(dim=-1).tolist()):
                    s.kv_len = len(s.tokens)
                    s.tokens.append(tok)
                    out[b].append(tok)
            return DraftProposal(out, None)
        stopped = [False] * len(seqs)
        probs = None
        if mode == DraftMode.RANDOM and kmax > 0:
            probs = torch.zeros(len(seqs), kmax, self.vocab_size, dtype=torch.float32)
        sb_all: SamplingBatch | None = None  # on the logits' device, once the first step shows which
        history = self._history(seqs, sampling) if kmax > 0 else None
        for t in range(kmax):
            rows = [b for b in range(len(seqs)) if k[b] > t and not stopped[b]]
            if not rows:
                break
            batch = [seqs[b] for b in rows]
            logits = self._forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))  # [B_t, V]
            dev = logits.device
            if sb_all is None:
                sb_all = SamplingBatch.from_params(sampling, device=dev)
            sb = sb_all if len(rows) == len(seqs) else sb_all.select(rows)
            hist = history.select(rows) if history is not None else None
            p = processed_probs(apply_penalties(logits[:, None, :], sb, hist), sb)[:, 0]  # [B_t, V]
            positions = torch.tensor([len(s.tokens) for s in batch], dtype=torch.long, device=dev)
            sampled = sample_tokens(p, sb, positions, mode, level)  # [B_t]
            if history is not None:
                history.add(rows, sampled)
            conf = token_confidence(logits, p, sampled, sb).tolist() if stop_below > 0 else None
            toks = sampled.tolist()
            if probs is not None:
                probs[rows, t] = on_device(p, probs.device)
            for i, (b, s) in enumerate(zip(rows, batch)):
                s.kv_len = len(s.tokens)
                s.tokens.append(int(toks[i]))
                out[b].append(int(toks[i]))
                if conf is not None and conf[i] < stop_below:
                    stopped[b] = True
        return DraftProposal(out, probs)

    @pinned
    def propose_tree(
        self,
        seq_ids: Sequence[str],
        depth: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        width: int = 2,
        max_nodes: Sequence[int] | None = None,
    ) -> DraftProposal:
        """`Worker.propose_tree`: a draft tree of depth[b] levels and at most max_nodes[b] nodes per row
        (`specray.spec.tree.TreeShape`). Level d: the best `width` distinct nodes of level d - 1 (by path
        score; the root at d = 0) get their children from `draft_children`, the best parents first while the
        budget lasts. One batched forward per level feeds the nodes on the paths to the parents with a tree mask
        (the drafter's nodes are few, so recomputing them beats bookkeeping their KV); the last one's KV stays
        behind the text for the next call to keep the accepted path of (`_adopt_tree_paths`).

        Returns each row's `DraftTree` (`trees`, nodes level by level), its nodes flat (`token_ids`) and, in random
        mode, q per slot: probs [B, N_max + 1, V] (slot 0: at the root, slot i + 1: at node i; zeros where a node
        got no children), what rejection verification of the tree reads."""
        if not self.tree_propose:
            raise NotImplementedError(f"{self.name}: this worker drafts chains only (WorkerCaps.tree_propose is False)")
        if len(depth) != len(seq_ids) or len(sampling) != len(seq_ids):
            raise ValueError(f"{self.name}: depth and sampling must be aligned with seq_ids")
        if width < 1:
            raise ValueError(f"{self.name}: tree width={width} must be >= 1")
        budget = [width * d for d in depth] if max_nodes is None else [int(n) for n in max_nodes]
        seqs = self._prepare(seq_ids, sync)
        bsz = len(seqs)
        # rows all greedy without penalties: a parent's children are its top `width` raw logits in every mode but
        # random (which returns q), scored by their log-softmax (what `draft_children` gives such rows)
        fast = mode != DraftMode.RANDOM and plain_greedy(sampling, logprobs=False)
        sb_all = None if fast else SamplingBatch.from_params(sampling)
        history = None if fast else self._history(seqs, sampling)
        toks: list[list[int]] = [[] for _ in seqs]
        pars: list[list[int]] = [[] for _ in seqs]
        score: list[list[float]] = [[] for _ in seqs]
        frontier: list[list[int]] = [[ROOT] for _ in seqs]  # parents to expand at this level, best first
        fed: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = [None] * bsz
        q_at: list[tuple[int, int, torch.Tensor]] = []  # (row, slot, q [V]) in random mode
        for d in range(max(depth, default=0)):
            rows = [b for b in range(bsz) if depth[b] > d and frontier[b] and len(toks[b]) < budget[b]]
            if not rows:
                break
            batch = [seqs[b] for b in rows]
            if d == 0:  # the pending tokens: the root's logits
                logits = self._forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))
                for s in batch:
                    s.kv_len = len(s.tokens)
                order = [[ROOT] for _ in rows]
            else:  # every node on a path to a parent, parents last (they are the deepest)
                inputs, parents, order = [], [], []
                for b in rows:
                    sub: set[int] = set()
                    for n in frontier[b]:
                        while n != ROOT and n not in sub:
                            sub.add(n)
                            n = pars[b][n]
                    nodes = sorted(sub)
                    local = {n: j for j, n in enumerate(nodes)}
                    inputs.append([toks[b][n] for n in nodes])
                    parents.append([ROOT if pars[b][n] == ROOT else local[pars[b][n]] for n in nodes])
                    order.append(sorted(frontier[b]))
                    fed[b] = (tuple(inputs[-1]), tuple(parents[-1]))
                logits = self._forward(batch, inputs, [len(o) for o in order], parents=parents)
            owner = [b for b, o in zip(rows, order) for _ in o]  # [M] row of each expanded parent
            nodes_m = [n for o in order for n in o]
            if fast:
                top = torch.topk(logits, min(width, logits.shape[-1]), dim=-1).indices  # [M, W]
                kids = top.tolist()
                kscore = torch.log_softmax(logits.double(), dim=-1).gather(1, top).tolist()
                usable = [[j == 0 or sc > float("-inf") for j, sc in enumerate(row)] for row in kscore]
            else:
                sb = sb_all.select(owner)
                hist = None
                if history is not None:
                    hist = history.select(owner)
                    paths = [_path(pars[b], n) for b, n in zip(owner, nodes_m)]
                    for j in range(d):
                        hist.add(list(range(len(owner))),
                                 torch.tensor([toks[b][p[j]] for b, p in zip(owner, paths)]))
                pen = apply_penalties(logits[:, None, :], sb, hist)[:, 0]  # [M, V]
                p = processed_probs(pen[:, None, :], sb)[:, 0]  # [M, V]
                positions = torch.tensor([len(seqs[b].tokens) + d for b in owner], dtype=torch.long)
                kids, kscore, usable = draft_children(pen, p, sb, positions, width, mode, level)
                kids, kscore, usable = kids.tolist(), kscore.tolist(), usable.tolist()
            where = {(b, n): m for m, (b, n) in enumerate(zip(owner, nodes_m))}
            for b in rows:
                new: list[int] = []
                for n in frontier[b]:  # best parent first
                    m = where[(b, n)]
                    base = 0.0 if n == ROOT else score[b][n]
                    took = 0
                    for t, sc, ok in zip(kids[m], kscore[m], usable[m]):
                        if not ok or len(toks[b]) >= budget[b]:
                            break
                        new.append(len(toks[b]))
                        toks[b].append(int(t))
                        pars[b].append(n)
                        score[b].append(base + sc)
                        took += 1
                    if took and mode == DraftMode.RANDOM:
                        q_at.append((b, n + 1, p[m]))
                seen: set[tuple[int, int]] = set()
                best: list[int] = []
                for n in sorted(new, key=lambda i: -score[b][i]):  # distinct (parent, token): a repeat is never
                    key = (pars[b][n], toks[b][n])  # accepted after its twin was rejected
                    if key not in seen:
                        seen.add(key)
                        best.append(n)
                frontier[b] = best[:width]
        for s, f in zip(seqs, fed):
            s.tree = f
        trees = [DraftTree(tuple(t), tuple(p)) for t, p in zip(toks, pars)]
        probs = None
        if mode == DraftMode.RANDOM:
            probs = torch.zeros(bsz, max((len(t) for t in toks), default=0) + 1, self.vocab_size)
            for b, slot, q in q_at:
                probs[b, slot] = q
        return DraftProposal([list(t) for t in toks], probs, trees=trees)

    @pinned
    def verify(
        self,
        seq_ids: Sequence[str],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """Score every draft in one forward, accept a prefix, append it and one correction/bonus token."""
        method = VerifyMethod(method)
        seqs = self._prepare(seq_ids, sync)
        kmax = max((len(d) for d in draft_ids), default=0)
        if method == VerifyMethod.REJECTION and draft_probs is None and kmax > 0:
            raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
        drafts = [[int(t) for t in d] for d in draft_ids]
        inputs = [s.tokens[s.kv_len :] + d for s, d in zip(seqs, drafts)]
        keep = [len(d) + 1 for d in drafts]
        flat = self._forward(seqs, inputs, keep)  # [sum(keep), V]
        if not return_probs and not confidence and plain_greedy(sampling):
            return self._verify_greedy(seqs, drafts, flat)
        dev = flat.device
        logits = pad_rows(flat, keep)  # [B, K+1, V]
        draft = torch.tensor([d + [PLACEHOLDER_TOKEN_ID] * (kmax - len(d)) for d in drafts], dtype=torch.long,
                             device=dev).view(len(seqs), kmax)  # [B, K]
        sb = SamplingBatch.from_params(sampling, device=dev)
        p = processed_probs(apply_penalties(logits, sb, self._history(seqs, sampling), draft), sb)  # [B, K+1, V]
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)
        q = None
        if method == VerifyMethod.REJECTION:
            q = p.new_zeros(len(seqs), 0, p.shape[-1]) if kmax == 0 else draft_probs[:, :kmax].to(dev, torch.float32)
        res = verify_batch(method, p, draft, q, sb, positions, level)
        out_ids, n_acc = res.output_ids.tolist(), [int(n) for n in res.num_accepted.tolist()]
        emitted: list[list[int]] = []
        for b, s in enumerate(seqs):
            toks = [int(t) for t in out_ids[b][: n_acc[b] + 1]]
            s.kv_len = len(s.tokens) + n_acc[b]  # prefix and accepted drafts have valid KV
            s.tokens.extend(toks)
            emitted.append(toks)
        out_probs = p[:, : max(len(e) for e in emitted)].clone() if return_probs else None
        conf = None
        if confidence:
            n = max(len(e) for e in emitted)
            ids = torch.tensor([e + [e[-1]] * (n - len(e)) for e in emitted], dtype=torch.long, device=dev)  # [B, n]
            c = token_confidence(logits[:, :n].reshape(-1, logits.shape[-1]), p[:, :n].reshape(-1, p.shape[-1]),
                                 ids.reshape(-1), sb.select([b for b in range(len(seqs)) for _ in range(n)]))
            c = c.view(len(seqs), n).tolist()
            conf = [row[: len(e)] for row, e in zip(c, emitted)]
        return VerifyResult(emitted, n_acc, out_probs, confidence=conf,
                            logprobs=_logprobs(logits, emitted, sampling))

    def _verify_greedy(self, seqs: Sequence[SeqState], drafts: Sequence[Sequence[int]],
                       flat: torch.Tensor,  # [sum(len(d) + 1), V] raw logits, rows concatenated
                       ) -> VerifyResult:
        """`verify` of rows that are all greedy without penalties, logprobs, confidence or returned distributions:
        every method then accepts while the draft equals the argmax of the raw logits (first index on ties, as
        `processed_probs` makes the one-hot) and emits the argmax at the stop. One argmax and one read."""
        y = flat.argmax(dim=-1).tolist()
        emitted: list[list[int]] = []
        n_acc: list[int] = []
        o = 0
        for s, d in zip(seqs, drafts):
            n = 0
            while n < len(d) and d[n] == y[o + n]:
                n += 1
            toks = y[o : o + n + 1]
            o += len(d) + 1
            s.kv_len = len(s.tokens) + n  # prefix and accepted drafts have valid KV
            s.tokens.extend(toks)
            emitted.append(toks)
            n_acc.append(n)
        return VerifyResult(emitted, n_acc, None)

    # ----- token trees --------------------------------------------------------------------------
    @pinned
    def score_tree(
        self,
        seq_ids: Sequence[str],
        trees: Sequence[TreeLike | None],
        sync: Sequence[SeqSync | None] | None = None,
    ) -> torch.Tensor:  # [B, N_max + 1, V] raw logits
        """Feed each row's pending tokens and its draft tree (None or empty: no draft) in one forward.

        Returns the verifier slots' raw logits: slot 0 after the root (the row's last token), slot i + 1 after
        node i; rows padded with zeros past their own N + 1. Node i's KV is kept at index kv_len + i behind the
        row's text until `accept_paths` keeps one path of it (or any other call drops it)."""
        if not self.tree_verify:
            raise NotImplementedError(f"{self.name}: this worker verifies chains only (WorkerCaps.tree_verify is "
                                      "False); send each row's draft as a chain")
        if len(trees) != len(seq_ids):
            raise ValueError("trees must be aligned with seq_ids")
        checked = [_check_tree(self.name, b, t) for b, t in enumerate(trees)]
        seqs = self._prepare(seq_ids, sync)
        inputs, keep, parents = [], [], []
        for s, (ids, par) in zip(seqs, checked):
            pending = s.tokens[s.kv_len :]
            p = len(pending)
            inputs.append(pending + list(ids))
            keep.append(len(ids) + 1)
            parents.append(list(range(-1, p - 1)) + [p - 1 if a < 0 else p + a for a in par])
        flat = self._forward(seqs, inputs, keep, parents=parents)  # [sum(keep), V]
        out = pad_rows(flat, keep)  # [B, N_max + 1, V]
        for s, tree in zip(seqs, checked):
            s.kv_len = len(s.tokens)
            s.tree = tree
        return out

    def accept_paths(
        self,
        seq_ids: Sequence[str],
        paths: Sequence[Sequence[int]],
        bonus: Sequence[int | None] | None = None,
    ) -> list[list[int]]:
        """Keep one root-to-leaf path (node indices, may be empty) of each row's scored tree, then append the
        row's bonus/correction token (if given): returns the tokens appended per row.

        The path's KV moves to contiguous indices right after the text (only the entries not already in place,
        all rows in one copy), so the row is exactly as if `verify` had accepted the path as a chain."""
        if len(paths) != len(seq_ids) or (bonus is not None and len(bonus) != len(seq_ids)):
            raise ValueError("paths (and bonus) must be aligned with seq_ids")
        seqs = [self._get(s) for s in seq_ids]
        for sid, s, path in zip(seq_ids, seqs, paths):
            if s.tree is None:
                raise ValueError(f"{self.name}: sequence {sid!r} has no scored tree; call score_tree first")
            parents = s.tree[1]
            for d, i in enumerate(path):
                if not 0 <= i < len(parents) or parents[i] != (path[d - 1] if d else -1):
                    raise ValueError(f"{self.name}: path {list(path)} of sequence {sid!r} is not a root-to-leaf "
                                     f"path of its tree (parents {list(parents)})")
        return self._keep_paths(seqs, paths, bonus)

    def _keep_paths(self, seqs: Sequence[SeqState], paths: Sequence[Sequence[int]],
                    bonus: Sequence[int | None] | None = None) -> list[list[int]]:
        """`accept_paths` on checked paths: append each path's tokens (and bonus) and move its KV in one copy."""
        slots: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        out: list[list[int]] = []
        for b, (s, path) in enumerate(zip(seqs, paths)):
            ids = s.tree[0]
            base = s.kv_len
            for d, i in enumerate(path):
                if i != d:
                    slots.append(s.slot)
                    src.append(base + i)
                    dst.append(base + d)
            toks = [ids[i] for i in path]
            if bonus is not None and bonus[b] is not None:
                toks.append(int(bonus[b]))
            s.tokens.extend(toks)
            s.kv_len = base + len(path)
            s.tree = None
            out.append(toks)
        self._move_kv(slots, src, dst)
        return out

    def _adopt_tree_paths(self, seqs: Sequence[SeqState], sync: Sequence[SeqSync | None]) -> list[SeqSync | None]:
        """Rows holding a tree's KV whose sync appends tokens along a path of it (a drafted tree after the
        verifier accepted that path): keep the path (`_keep_paths`) and return the sync of what is left."""
        out = list(sync)
        rows: list[SeqState] = []
        paths: list[list[int]] = []
        for b, (s, sy) in enumerate(zip(seqs, sync)):
            if s.tree is None or sy is None or sy.keep != len(s.tokens) or s.kv_len != len(s.tokens):
                continue
            ids, parents = s.tree
            path: list[int] = []
            at = ROOT
            for t in sy.append:
                nxt = next((i for i in range(len(ids)) if parents[i] == at and ids[i] == t), None)
                if nxt is None:
                    break
                path.append(nxt)
                at = nxt
            if path:
                rows.append(s)
                paths.append(path)
                out[b] = SeqSync(sy.keep + len(path), tuple(sy.append[len(path):]))
        if rows:
            self._keep_paths(rows, paths)
        return out

    @pinned
    def verify_tree(
        self,
        seq_ids: Sequence[str],
        trees: Sequence[TreeLike | None],
        draft_probs: torch.Tensor | None,  # [B, N_max + 1, V] or [B, N_max, V] (rejection only)
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """`Worker.verify_tree`: `score_tree` -> `tree_verify.verify_tree` on the processed distributions (the rows'
        penalties counted along each slot's path) -> `accept_paths`. The row then holds the accepted path and the
        final token, exactly as `verify` holds its emitted tokens; the noise is keyed by `level` as in `verify`,
        so a chain tree emits what `verify` would. `return_probs` / `confidence` as in `verify`: the
        distributions (and this level's probability) of the emitted tokens, read at the slots along the path
        (a middle level verifying a tree drafts for the level above with them)."""
        method = VerifyMethod(method)
        if len(trees) != len(seq_ids) or len(sampling) != len(seq_ids):
            raise ValueError(f"{self.name}: trees and sampling must be aligned with seq_ids")
        dtrees = [DraftTree(*_check_tree(self.name, b, t)) for b, t in enumerate(trees)]
        logits = self.score_tree(seq_ids, dtrees, sync)  # [B, N_max + 1, V]
        if method == VerifyMethod.REJECTION and logits.shape[1] > 1 and draft_probs is None:
            raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
        if not return_probs and not confidence and plain_greedy(sampling) and all(_plain_tree(t) for t in dtrees):
            return self._verify_tree_greedy(seq_ids, dtrees, logits)
        seqs = [self._get(s) for s in seq_ids]
        dev = logits.device
        sb = SamplingBatch.from_params(sampling, device=dev)
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)  # the root's children
        q = None
        if method == VerifyMethod.REJECTION and logits.shape[1] > 1:
            q = on_device(draft_probs, dev, torch.float32)
        batch = pad_trees(dtrees, max_nodes=logits.shape[1] - 1, device=logits.device)
        p = processed_probs(tree_penalized_logits(logits, sb, self._history(seqs, sampling), batch), sb)
        out = verify_tree(method, p, batch, q, sb, positions, level)  # as `verify_tree_logits`, keeping p [B, N+1, V]
        paths = out.path_lists()
        emitted = self.accept_paths(seq_ids, paths, [int(t) for t in out.final_token.tolist()])
        n = max((len(e) for e in emitted), default=0)
        # slot j of a row's emitted tokens: after the root (j = 0), else after the path's (j - 1)-th node
        slots = torch.tensor([[0] + [i + 1 for i in path] + [0] * (n - 1 - len(path)) for path in paths],
                             dtype=torch.long, device=dev).view(len(seqs), n)  # [B, n]

        def along(x: torch.Tensor) -> torch.Tensor:  # [B, N + 1, V] -> [B, n, V]
            return x.gather(1, slots.unsqueeze(-1).expand(-1, -1, x.shape[-1]))

        logprobs = _logprobs(along(logits), emitted, sampling) if any(
            sp.logprobs is not None for sp in sampling) else None
        out_probs = along(p).float() if return_probs else None
        conf = None
        if confidence and n:
            ids = torch.tensor([e + [e[-1]] * (n - len(e)) for e in emitted], dtype=torch.long, device=dev)  # [B, n]
            c = token_confidence(along(logits).reshape(-1, logits.shape[-1]), along(p).reshape(-1, p.shape[-1]),
                                 ids.reshape(-1), sb.select([b for b in range(len(seqs)) for _ in range(n)]))
            conf = [row[: len(e)] for row, e in zip(c.view(len(seqs), n).tolist(), emitted)]
        return VerifyResult(emitted, [len(x) for x in paths], out_probs, confidence=conf, logprobs=logprobs,
                            tree_nodes=[t.num_nodes for t in dtrees])

    def _verify_tree_greedy(self, seq_ids: Sequence[str], trees: Sequence[DraftTree],
                            logits: torch.Tensor,  # [B, N_max + 1, V] raw logits per slot
                            ) -> VerifyResult:
        """`verify_tree` of rows that are all greedy without penalties, logprobs, confidence or returned
        distributions, on trees of non-negative tokens with distinct siblings: every method then follows the child
        whose token is the slot's argmax (first index on ties) and emits the argmax where none is. One argmax and
        one read; the walk runs on the host."""
        y = logits.argmax(dim=-1).tolist()  # [B][N_max + 1]
        paths: list[list[int]] = []
        final: list[int] = []
        for yb, t in zip(y, trees):
            child = {(p, tok): i for i, (tok, p) in enumerate(zip(t.token_ids, t.parents))}
            path: list[int] = []
            slot = 0
            while (nxt := child.get((path[-1] if path else ROOT, yb[slot]))) is not None:
                path.append(nxt)
                slot = nxt + 1
            paths.append(path)
            final.append(yb[slot])
        emitted = self.accept_paths(seq_ids, paths, final)
        return VerifyResult(emitted, [len(p) for p in paths], None, tree_nodes=[t.num_nodes for t in trees])

    def accept_path(self, seq_id: str, path: Sequence[int], bonus: int | None = None) -> list[int]:
        """`accept_paths` for one row."""
        return self.accept_paths([seq_id], [path], [bonus])[0]

    def _history(self, seqs: Sequence[SeqState], sampling: Sequence[SamplingParams]) -> TokenHistory | None:
        """The tokens each row's penalties count (None when no row is penalized): a sequence's tokens past its
        prompt are output, whether committed or drafted by this level in this call."""
        if not any(sp.penalized for sp in sampling):
            return None
        masks = []
        for s, sp in zip(seqs, sampling):
            n = min(sp.prompt_len, len(s.tokens))
            if s.prompt_seen is None or s.prompt_seen[0] != n:
                s.prompt_seen = (n, TokenHistory.seen_mask([s.tokens[:n]], self.vocab_size)[0])
            masks.append(s.prompt_seen[1])
        return TokenHistory.from_parts(torch.stack(masks), [s.tokens[s.prompt_seen[0] :] for s in seqs])


def _plain_tree(tree: DraftTree) -> bool:
    """Non-negative tokens and distinct siblings: the trees a greedy walk takes as they are (others go through
    `TreeBatch`, which rejects or handles them)."""
    pairs = set(zip(tree.parents, tree.token_ids))
    return len(pairs) == len(tree.token_ids) and all(t >= 0 for t in tree.token_ids)


def _path(parents: Sequence[int], n: int) -> list[int]:
    """Nodes from the root's child down to node n (ROOT: none)."""
    out: list[int] = []
    while n != ROOT:
        out.append(n)
        n = parents[n]
    return out[::-1]


def _logprobs(
    logits: torch.Tensor,  # [B, K+1, V] raw logits; slot j predicts a row's j-th emitted token
    emitted: list[list[int]],
    sampling: Sequence[SamplingParams],
) -> list[list[TokenLogprob]] | None:
    """Raw log-probabilities of the emitted tokens (and the asked-for alternatives) of the rows that ask."""
    rows = [b for b, sp in enumerate(sampling) if sp.logprobs is not None]
    if not rows:
        return None
    top = max(sampling[b].logprobs or 0 for b in rows)
    flat = torch.cat([logits[b, : len(emitted[b])] for b in rows])  # [N, V]
    toks = torch.tensor([t for b in rows for t in emitted[b]], dtype=torch.long)
    chosen, ids, vals = raw_logprobs(flat, toks, top)
    chosen, ids, vals = chosen.tolist(), ids.tolist(), vals.tolist()
    out: list[list[TokenLogprob]] = [[] for _ in sampling]
    i = 0
    for b in rows:
        n = sampling[b].logprobs or 0
        for _ in emitted[b]:
            out[b].append(TokenLogprob(chosen[i], tuple(zip(ids[i][:n], vals[i][:n]))))
            i += 1
    return out
