"""Token trees on a `LogitsWorker`'s rows: the tree types a worker takes, the tree mask a backend feeds them
with, and the row bookkeeping of scoring, keeping and drafting trees.

Scoring (`score_trees`, a backend with `tree_verify`) feeds each row's pending tokens and a draft tree in one
forward and keeps the tree's KV behind the text; `keep_paths` keeps one root-to-leaf path of it, so the row is
exactly as if that path had been fed as a chain. Between the two the row holds no pending token; any other call
drops the scored tree first.

Drafting (`draft_tree`, a backend with `tree_propose`) builds a token tree per row the same way: it leaves the
nodes of its last tree forward in KV behind the text, and when the next call's sync appends tokens that follow a
path of that tree (the path the verifier accepted), `adopt_paths` keeps that path's KV (as `keep_paths` does)
instead of it being recomputed; the rest is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from specray.engine.greedy import greedy_children, plain_greedy
from specray.engine.protocol import DraftMode, DraftProposal, SeqSync
from specray.engine.rows import Forward, SeqState, pad_rows, penalty_history
from specray.spec.params import SamplingParams
from specray.spec.sampling import SamplingBatch, apply_penalties, processed_probs
from specray.spec.tree import ROOT, DraftTree, draft_children

#: `LogitsWorker._move_kv`: copy KV entry src[m] of slot slots[m] to index dst[m]
MoveKV = Callable[[Sequence[int], Sequence[int], Sequence[int]], None]


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


def check_tree(worker: str, b: int, tree: TreeLike | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row b's tree as (token_ids, parents) of ints, after checking its shape (None: no draft, empty)."""
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


def score_trees(
    forward: Forward,
    seqs: Sequence[SeqState],
    trees: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],  # checked (token_ids, parents) per row
) -> torch.Tensor:  # [B, N_max + 1, V] raw logits
    """`LogitsWorker.score_tree` on prepared rows: feed each row's pending tokens and its tree in one forward;
    node i's KV stays at index kv_len + i behind the row's text (`SeqState.tree`)."""
    inputs, keep, parents = [], [], []
    for s, (ids, par) in zip(seqs, trees):
        pending = s.tokens[s.kv_len :]
        p = len(pending)
        inputs.append(pending + list(ids))
        keep.append(len(ids) + 1)
        parents.append(list(range(-1, p - 1)) + [p - 1 if a < 0 else p + a for a in par])
    flat = forward(seqs, inputs, keep, parents=parents)  # [sum(keep), V]
    out = pad_rows(flat, keep)  # [B, N_max + 1, V]
    for s, tree in zip(seqs, trees):
        s.kv_len = len(s.tokens)
        s.tree = tree
    return out


def check_paths(worker: str, seq_ids: Sequence[str], seqs: Sequence[SeqState], paths: Sequence[Sequence[int]]) -> None:
    """Each path must be a root-to-leaf path (node indices, may be empty) of its row's scored tree."""
    for sid, s, path in zip(seq_ids, seqs, paths):
        if s.tree is None:
            raise ValueError(f"{worker}: sequence {sid!r} has no scored tree; call score_tree first")
        parents = s.tree[1]
        for d, i in enumerate(path):
            if not 0 <= i < len(parents) or parents[i] != (path[d - 1] if d else -1):
                raise ValueError(f"{worker}: path {list(path)} of sequence {sid!r} is not a root-to-leaf "
                                 f"path of its tree (parents {list(parents)})")


def keep_paths(seqs: Sequence[SeqState], paths: Sequence[Sequence[int]], move_kv: MoveKV,
               bonus: Sequence[int | None] | None = None) -> list[list[int]]:
    """Append each row's checked path's tokens (and bonus) and move the path's KV to contiguous indices right
    after the text: only the entries not already in place, all rows in one copy. Returns the appended tokens."""
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
    move_kv(slots, src, dst)
    return out


def adopt_paths(seqs: Sequence[SeqState], sync: Sequence[SeqSync | None], move_kv: MoveKV) -> list[SeqSync | None]:
    """Rows holding a tree's KV whose sync appends tokens along a path of it (a drafted tree after the
    verifier accepted that path): keep the path (`keep_paths`) and return the sync of what is left."""
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
        keep_paths(rows, paths, move_kv)
    return out


def draft_tree(
    forward: Forward,
    seqs: Sequence[SeqState],
    depth: Sequence[int],
    sampling: Sequence[SamplingParams],
    mode: str,
    level: int,
    width: int,
    budget: Sequence[int],
    vocab_size: int,
) -> DraftProposal:
    """`LogitsWorker.propose_tree` on prepared rows (see there): level by level, the best `width` distinct nodes
    of the level before get their children, the best parents first while row b's budget[b] nodes last."""
    bsz = len(seqs)
    # rows all greedy without penalties: a parent's children are its top `width` raw logits in every mode but
    # random (which returns q), scored by their log-softmax (what `draft_children` gives such rows)
    fast = mode != DraftMode.RANDOM and plain_greedy(sampling, logprobs=False)
    sb_all = None if fast else SamplingBatch.from_params(sampling)
    history = None if fast else penalty_history(seqs, sampling, vocab_size)
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
            logits = forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))
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
            logits = forward(batch, inputs, [len(o) for o in order], parents=parents)
        owner = [b for b, o in zip(rows, order) for _ in o]  # [M] row of each expanded parent
        nodes_m = [n for o in order for n in o]
        if fast:
            kids, kscore, usable = greedy_children(logits, width)
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
        probs = torch.zeros(bsz, max((len(t) for t in toks), default=0) + 1, vocab_size)
        for b, slot, q in q_at:
            probs[b, slot] = q
    return DraftProposal([list(t) for t in toks], probs, trees=trees)


def _path(parents: Sequence[int], n: int) -> list[int]:
    """Nodes from the root's child down to node n (ROOT: none)."""
    out: list[int] = []
    while n != ROOT:
        out.append(n)
        n = parents[n]
    return out[::-1]
