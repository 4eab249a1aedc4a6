"""Backend-independent half of a logits-producing worker: sequence state, sync, propose and verify.

A backend supplies one thing, a ragged batched forward (`_forward`), plus where its KV length lives.
The HF backend and the test fake both derive from this, so the protocol logic is written (and tested)
once.

Invariant per sequence: `tokens` is the worker's copy of the text; KV is valid for `tokens[:kv_len]`,
and at least one token is pending (the last one), because its logits predict the next position.

The worker composes plain functions over its rows: `specray.engine.rows` (the row state and what is read off
the logits besides the tokens), `specray.engine.greedy` (the fast paths of calls whose rows are all plain
greedy) and `specray.engine.tree_rows` (token trees: scoring, keeping a path's KV, drafting).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from specray.engine.greedy import accept_greedy, plain_greedy, plain_tree, propose_greedy, walk_tree_greedy
from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, WorkerCaps, WorkerStats
from specray.engine.rows import (
    SeqState,
    commit,
    emitted_confidence,
    emitted_logprobs,
    pad_rows,
    penalty_history,
    token_confidence,
)
from specray.engine.threads import pinned
from specray.engine.tree_rows import (
    TreeLike,
    adopt_paths,
    check_paths,
    check_tree,
    draft_tree,
    keep_paths,
    score_trees,
)
from specray.spec.noise import sample_tokens
from specray.spec.params import PLACEHOLDER_TOKEN_ID, SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, apply_penalties, on_device, processed_probs
from specray.spec.tree import DraftTree, pad_trees
from specray.spec.tree_verify import tree_penalized_logits, verify_tree
from specray.spec.verify import verify as verify_batch


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
            sync = adopt_paths(seqs, sync, self._move_kv)
            for seq, sy in zip(seqs, sync):
                if sy is not None and sy.keep > 0:
                    self._apply_sync(seq, sy)
        for seq in seqs:
            seq.tree = None  # a tree scored and not accepted is dropped (its KV lies past kv_len)
            seq.kv_len = min(seq.kv_len, len(seq.tokens) - 1)  # keep one pending token
            while len(seq.tokens) - seq.kv_len > self.prefill_threshold:
                start = seq.kv_len
                chunk = seq.tokens[start : min(len(seq.tokens) - 1, start + self.prefill_chunk)]
                self._prefill(seq, chunk)
                seq.kv_len = start + len(chunk)
        return seqs

    def _prefill(self, seq: SeqState, chunk: Sequence[int]) -> None:
        """Feed one chunk of a row's text it has not seen (a prompt, a catch-up) into its KV cache."""
        self._forward([seq], [chunk], [1])

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
        if mode != DraftMode.RANDOM and stop_below <= 0 and plain_greedy(sampling, logprobs=False):
            return DraftProposal(propose_greedy(self._forward, seqs, k), None)
        kmax = max(k, default=0)
        out: list[list[int]] = [[] for _ in seqs]
        stopped = [False] * len(seqs)
        probs = None
        if mode == DraftMode.RANDOM and kmax > 0:
            probs = torch.zeros(len(seqs), kmax, self.vocab_size, dtype=torch.float32)
        sb_all: SamplingBatch | None = None  # on the logits' device, once the first step shows which
        history = penalty_history(seqs, sampling, self.vocab_size) if kmax > 0 else None
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
            emitted, n_acc = accept_greedy(drafts, flat)
            commit(seqs, emitted, n_acc)
            return VerifyResult(emitted, n_acc, None)
        dev = flat.device
        logits = pad_rows(flat, keep)  # [B, K+1, V]
        draft = torch.tensor([d + [PLACEHOLDER_TOKEN_ID] * (kmax - len(d)) for d in drafts], dtype=torch.long,
                             device=dev).view(len(seqs), kmax)  # [B, K]
        sb = SamplingBatch.from_params(sampling, device=dev)
        history = penalty_history(seqs, sampling, self.vocab_size)
        p = processed_probs(apply_penalties(logits, sb, history, draft), sb)  # [B, K+1, V]
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)
        q = None
        if method == VerifyMethod.REJECTION:
            q = p.new_zeros(len(seqs), 0, p.shape[-1]) if kmax == 0 else draft_probs[:, :kmax].to(dev, torch.float32)
        res = verify_batch(method, p, draft, q, sb, positions, level)
        out_ids, n_acc = res.output_ids.tolist(), [int(n) for n in res.num_accepted.tolist()]
        emitted = [[int(t) for t in out_ids[b][: n_acc[b] + 1]] for b in range(len(seqs))]
        commit(seqs, emitted, n_acc)
        n = max(len(e) for e in emitted)
        out_probs = p[:, :n].clone() if return_probs else None
        conf = emitted_confidence(logits[:, :n], p[:, :n], emitted, sb) if confidence else None
        return VerifyResult(emitted, n_acc, out_probs, confidence=conf,
                            logprobs=emitted_logprobs(logits, emitted, sampling))

    # ----- token trees (`specray.engine.tree_rows`) ---------------------------------------------
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
        checked = [check_tree(self.name, b, t) for b, t in enumerate(trees)]
        return score_trees(self._forward, self._prepare(seq_ids, sync), checked)

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
        check_paths(self.name, seq_ids, seqs, paths)
        return keep_paths(seqs, paths, self._move_kv, bonus)

    def accept_path(self, seq_id: str, path: Sequence[int], bonus: int | None = None) -> list[int]:
        """`accept_paths` for one row."""
        return self.accept_paths([seq_id], [path], [bonus])[0]

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
        behind the text for the next call to keep the accepted path of (`tree_rows.adopt_paths`).

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
        return draft_tree(self._forward, seqs, depth, sampling, mode, level, width, budget, self.vocab_size)

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
        dtrees = [DraftTree(*check_tree(self.name, b, t)) for b, t in enumerate(trees)]
        logits = self.score_tree(seq_ids, dtrees, sync)  # [B, N_max + 1, V]
        if method == VerifyMethod.REJECTION and logits.shape[1] > 1 and draft_probs is None:
            raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
        nodes = [t.num_nodes for t in dtrees]
        if not return_probs and not confidence and plain_greedy(sampling) and all(plain_tree(t) for t in dtrees):
            paths, final = walk_tree_greedy(dtrees, logits)
            return VerifyResult(self.accept_paths(seq_ids, paths, final), [len(x) for x in paths], None,
                                tree_nodes=nodes)
        seqs = [self._get(s) for s in seq_ids]
        dev = logits.device
        sb = SamplingBatch.from_params(sampling, device=dev)
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)  # the root's children
        q = None
        if method == VerifyMethod.REJECTION and logits.shape[1] > 1:
            q = on_device(draft_probs, dev, torch.float32)
        batch = pad_trees(dtrees, max_nodes=logits.shape[1] - 1, device=logits.device)
        history = penalty_history(seqs, sampling, self.vocab_size)
        p = processed_probs(tree_penalized_logits(logits, sb, history, batch), sb)
        out = verify_tree(method, p, batch, q, sb, positions, level)  # as `verify_tree_logits`, keeping p [B, N+1, V]
        paths = out.path_lists()
        emitted = self.accept_paths(seq_ids, paths, [int(t) for t in out.final_token.tolist()])
        n = max((len(e) for e in emitted), default=0)
        # slot j of a row's emitted tokens: after the root (j = 0), else after the path's (j - 1)-th node
        slots = torch.tensor([[0] + [i + 1 for i in path] + [0] * (n - 1 - len(path)) for path in paths],
                             dtype=torch.long, device=dev).view(len(seqs), n)  # [B, n]

        def along(x: torch.Tensor) -> torch.Tensor:  # [B, N + 1, V] -> [B, n, V]
            return x.gather(1, slots.unsqueeze(-1).expand(-1, -1, x.shape[-1]))

        logprobs = emitted_logprobs(along(logits), emitted, sampling) if any(
            sp.logprobs is not None for sp in sampling) else None
        out_probs = along(p).float() if return_probs else None
        conf = emitted_confidence(along(logits), along(p), emitted, sb) if confidence and n else None
        return VerifyResult(emitted, [len(x) for x in paths], out_probs, confidence=conf, logprobs=logprobs,
                            tree_nodes=nodes)
