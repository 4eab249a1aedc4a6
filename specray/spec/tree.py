"""Token trees: several candidate continuations of a row, verified in one forward (SpecInfer, EAGLE-2, Sequoia).

Layout
------
A draft tree hangs below the row's last committed token (the *root*) and is stored flat, nodes in topological
order: `token_ids[i]` is node i's token and `parents[i]` its parent (-1: a child of the root, else an earlier
node). A chain t0..t(k-1) is the tree parents = (-1, 0, ..., k-2). depth(i) = 0 for the root's children, else
depth(parent) + 1; node i predicts the token at absolute position `positions + depth(i)`, where `positions` is
the position of the root's children (as in `verify.py`: the position of slot 0's token).

The verifier reads N + 1 distributions per row ("slots"): slot 0 = after the root (predicts the root's
children), slot i + 1 = after node i (predicts node i's children). A batch is ragged: [B, N_max + 1, V].

Result per row: `path`, the accepted nodes root -> leaf (each the child of the previous one, maybe none), then
one correction/bonus token drawn from the slot of the last accepted node (slot 0 if none). The emitted tokens are
the path's tokens plus that one: `num_accepted + 1` tokens, as for a chain.

Verification (greedy, coupled, deterministic and rejection walks, their proof of exactness, the noise they
use): `specray.spec.tree_verify`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.spec.noise import coupled_argmax, gumbel_noise, inverse_cdf_sample, keyed_uniform, residual_stream
from specray.spec.params import PLACEHOLDER_TOKEN_ID, TreeShape
from specray.spec.sampling import SamplingBatch
from specray.spec.verify import count_drafts

__all__ = [
    "ROOT",
    "DraftTree",
    "TreeShape",
    "TreeBatch",
    "draft_children",
    "pad_trees",
    "sample_siblings",
    "tree_from_topk",
]

#: The parent index of the root's children.
ROOT = -1


# --------------------------------------------------------------------------------------------------
# One tree
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftTree:
    """A row's draft tree: node i has token `token_ids[i]` and parent `parents[i]` (ROOT or an earlier node)."""

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.token_ids)
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "token_ids", tokens)
        object.__setattr__(self, "parents", parents)
        if len(tokens) != len(parents):
            raise ValueError(f"DraftTree: token_ids has {len(tokens)} nodes but parents has {len(parents)}")
        for i, (t, p) in enumerate(zip(tokens, parents)):
            if t < 0:
                raise ValueError(f"DraftTree: token_ids[{i}]={t} must be a token id >= 0")
            if not ROOT <= p < i:
                raise ValueError(
                    f"DraftTree: parents[{i}]={p} must be in [-1, {i}): -1 for a child of the root, else an "
                    "earlier node (nodes are in topological order)"
                )

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """The chain t0 -> t1 -> ... (what a chain drafter proposes)."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> DraftTree:
        """The trie of token sequences (shared prefixes merged; siblings distinct), nodes in first-seen order."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            at = ROOT
            for t in path:
                key = (at, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(at)
                at = index[key]
        return cls(tuple(tokens), tuple(parents))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """depth of each node: 0 for the root's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p == ROOT else out[p] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        """Number of levels (the longest path's length); 0 for an empty tree."""
        return max(self.depths, default=-1) + 1

    @functools.cached_property
    def _children(self) -> dict[int, tuple[int, ...]]:
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        return {p: tuple(c) for p, c in kids.items()}

    def children(self, i: int) -> tuple[int, ...]:
        """Children of node i (ROOT: of the root), in index order (the order verification tries them)."""
        if not ROOT <= i < self.num_nodes:
            raise IndexError(f"node {i} is not in a tree of {self.num_nodes} nodes (ROOT = -1 is the root)")
        return self._children.get(i, ())

    def path_to(self, i: int) -> tuple[int, ...]:
        """Nodes from the root's child down to node i (i included)."""
        out: list[int] = []
        while i != ROOT:
            out.append(i)
            i = self.parents[i]
        return tuple(reversed(out))

    def paths(self) -> list[tuple[int, ...]]:
        """Every root -> leaf path (node indices), leaves in index order."""
        return [self.path_to(i) for i in range(self.num_nodes) if not self._children.get(i)]

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    @functools.cached_property
    def distinct_siblings(self) -> bool:
        """Whether siblings carry distinct tokens (required for every method but REJECTION)."""
        seen = {(p, t) for p, t in zip(self.parents, self.token_ids)}
        return len(seen) == self.num_nodes


def tree_from_topk(
    topk_ids: Sequence[Sequence[int]],
    topk_probs: Sequence[Sequence[float]] | None = None,
    max_nodes: int | None = None,
    tree_width: int | None = None,
    min_prob: float = 0.0,
) -> DraftTree:
    """The tree a chain drafter's top-k candidates make: `topk_ids[d]` are its best tokens at depth d (most
    likely first), computed after the chain of first choices topk_ids[0][0], ..., topk_ids[d-1][0].

    The first choices form the spine; the other candidates of depth d are leaf siblings of the spine's depth-d
    node (no distribution after them was computed). With `topk_probs` (the drafter's probabilities of the
    candidates) the nodes kept are the `max_nodes` most likely by path probability (the product of the spine's
    probabilities down to the node), and only those with a path probability >= min_prob; without them the
    shallowest first. At most `tree_width` candidates per depth. The tokens are deterministic drafts: verify the
    tree with GREEDY, DETERMINISTIC or COUPLED.
    """
    if topk_probs is not None and len(topk_probs) != len(topk_ids):
        raise ValueError(f"topk_probs has {len(topk_probs)} depths but topk_ids has {len(topk_ids)}")
    if tree_width is not None and tree_width < 1:
        raise ValueError(f"tree_width={tree_width} must be >= 1")
    if max_nodes is not None and max_nodes < 0:
        raise ValueError(f"max_nodes={max_nodes} must be >= 0")
    cands: list[tuple[float, int, int, int]] = []  # (-path prob, depth, rank, token)
    spine = 1.0
    for d, ids in enumerate(topk_ids):
        ids = [int(t) for t in ids][: tree_width or None]
        if len(set(ids)) != len(ids):
            raise ValueError(f"topk_ids[{d}]={ids} repeats a token: siblings must be distinct")
        if not ids:
            break  # nothing at this depth: the spine ends
        probs = [1.0] * len(ids) if topk_probs is None else [float(p) for p in topk_probs[d]][: len(ids)]
        if len(probs) != len(ids) or not all(0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"topk_probs[{d}] must give a probability in [0, 1] for each of topk_ids[{d}]")
        cands += [(-spine * p, d, r, t) for r, (t, p) in enumerate(zip(ids, probs))]
        spine *= probs[0]
    # Both orders put a node's spine ancestors before it (their path probability is >= its, and they are
    # shallower), so a prefix of either order (max_nodes) or a probability cut (min_prob) is a tree.
    kept = sorted(c for c in cands if -c[0] >= min_prob)
    if topk_probs is None:
        kept.sort(key=lambda c: (c[1], c[2]))
    kept = kept[: max_nodes if max_nodes is not None else len(kept)]
    kept.sort(key=lambda c: (c[1], c[2]))  # topological: by depth, spine first
    index = {(d, r): i for i, (_, d, r, _) in enumerate(kept)}
    return DraftTree(
        tuple(t for *_, t in kept), tuple(ROOT if d == 0 else index[(d - 1, 0)] for _, d, _, _ in kept)
    )


def sample_siblings(
    probs: torch.Tensor,  # [B, V] the drafter's processed probs at the parent
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B] int64 absolute position of the children
    width: int,
    salt: int,
) -> torch.Tensor:  # [B, width] int64
    """`width` i.i.d. draws from probs per row (the children REJECTION trees expect), with the drafter level's
    keyed noise: draw j uses index j of (seed, position, residual_stream(salt)), so draw 0 is exactly
    `sample_tokens(..., "random", salt)`: a width-1 tree drafts the chain a chain drafter would."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    u = keyed_uniform(sb.seed.to(probs.device), positions.to(probs.device, torch.int64), residual_stream(salt), width)
    weights = probs.double().repeat_interleave(width, dim=0)  # [B * width, V]
    return inverse_cdf_sample(weights, u.reshape(-1)).view(-1, width)


def draft_children(
    logits: torch.Tensor,  # [M, V] the drafter's (penalized) raw logits at M parents
    probs: torch.Tensor,  # [M, V] its processed probs there (q)
    sb: SamplingBatch,  # M rows
    positions: torch.Tensor,  # [M] int64 absolute position of the children
    width: int,
    mode: str,
    salt: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [M, W], log score [M, W], usable [M, W] bool
    """`width` children for each parent, made so that every verification method stays exact.

    greedy (GREEDY / DETERMINISTIC verification): the `width` most likely tokens under q (distinct; chosen
    without the verifier's noise), the first being `sample_tokens`' greedy draft. coupled: the `width` best
    tokens of log q + the request's shared Gumbel noise at that position, the first being the coupled chain
    draft (any tree is exact: the verifier follows its own coupled token). random (REJECTION): `width` i.i.d.
    draws from q (`sample_siblings`, may repeat), the first being the random chain draft; a caller keeps any
    prefix of them. Rows at temperature 0 take the top `width` raw logits in every mode (their p is one-hot,
    so every method verifies them greedily, whatever the tree).

    The score is the token's log-probability under q (temperature 0: under the softmax of the logits), what a
    caller ranks nodes by; `usable` is False for children with no probability under q (greedy/coupled rows
    whose q has fewer than `width` tokens), never for the first.
    """
    if logits.dim() != 2 or probs.shape != logits.shape:
        raise ValueError(f"logits and probs must both be [M, V], got {tuple(logits.shape)}, {tuple(probs.shape)}")
    m, vocab = probs.shape
    w = min(width, vocab)
    greedy = sb.greedy.to(probs.device)
    logp = torch.log(probs.double())  # [M, V]
    raw = torch.log_softmax(logits.double(), dim=-1)
    if mode == "random":
        toks = sample_siblings(probs, sb, positions, w, salt)
    elif mode == "coupled":
        seed, pos = sb.seed.to(probs.device), positions.to(probs.device, torch.int64)
        first = coupled_argmax(probs, seed, pos)  # exactly the chain's coupled draft
        scores = (logp + gumbel_noise(seed, pos, vocab).double()).scatter(1, first[:, None], float("inf"))
        toks = torch.topk(scores, w, dim=-1).indices
    elif mode == "greedy":
        toks = torch.topk(probs, w, dim=-1).indices
    else:
        raise ValueError(f"unknown draft mode {mode!r}; expected greedy, random or coupled")
    if bool(greedy.any()):
        toks = torch.where(greedy[:, None], torch.topk(logits, w, dim=-1).indices, toks)
    score = torch.where(greedy[:, None], raw.gather(1, toks), logp.gather(1, toks))
    usable = score > float("-inf")
    usable[:, 0] = True
    return toks, score, usable


# --------------------------------------------------------------------------------------------------
# A batch of trees as tensors
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeBatch:
    """Trees of a batch padded to N = N_max nodes: what batched verification and a tree forward read.

    Padding nodes (index >= num_nodes[b]) have token PLACEHOLDER_TOKEN_ID, parent -1 and depth 0, and are
    nobody's child. `children[b, s, r]` is the r-th child of slot s (s = 0: the root; s = i + 1: node i), -1 past
    the last one.
    """

    token_ids: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64
    depths: torch.Tensor  # [B, N] int64
    num_nodes: torch.Tensor  # [B] int64
    children: torch.Tensor  # [B, N + 1, W] int64, W = the widest node's child count
    repeated_siblings: torch.Tensor  # [B] bool: some node has two children with the same token

    @classmethod
    def from_tensors(
        cls,
        token_ids: torch.Tensor,  # [B, N] int64, PLACEHOLDER_TOKEN_ID-padded at the end
        parents: torch.Tensor,  # [B, N] int64 (padding entries are ignored)
    ) -> TreeBatch:
        """Validate and index trees given as tensors (row b's nodes are its leading non-placeholder tokens)."""
        if token_ids.dim() != 2 or parents.shape != token_ids.shape:
            raise ValueError(
                f"token_ids and parents must both be [B, N], got {tuple(token_ids.shape)}, {tuple(parents.shape)}"
            )
        dev = token_ids.device
        token_ids = token_ids.to(torch.int64)
        parents = parents.to(dev, torch.int64)
        bsz, n = token_ids.shape
        num_nodes = count_drafts(token_ids)
        node = torch.arange(n, device=dev)
        valid = node < num_nodes.unsqueeze(-1)
        if bool((~valid & (token_ids != PLACEHOLDER_TOKEN_ID)).any()):
            b, i = (~valid & (token_ids != PLACEHOLDER_TOKEN_ID)).nonzero()[0].tolist()
            raise ValueError(f"token_ids[{b}, {i}]={int(token_ids[b, i])}: placeholders only at the end of a row")
        bad = valid & ((token_ids < 0) | (parents < ROOT) | (parents >= node))
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(
                f"tree row {b}, node {i}: token {int(token_ids[b, i])} must be >= 0 and parent "
                f"{int(parents[b, i])} in [-1, {i}) (-1: a child of the root; nodes in topological order)"
            )
        parents = torch.where(valid, parents, ROOT)
        depths = torch.zeros_like(parents)
        rank = torch.zeros_like(parents)
        per_slot = torch.zeros(bsz, n + 1, dtype=torch.int64, device=dev)  # children counted so far
        for i in range(n):  # topological order: a parent's depth is known before its children's
            par = parents[:, i]
            up = depths.gather(1, par.clamp(min=0).unsqueeze(-1)).squeeze(-1) + 1
            depths[:, i] = torch.where(par >= 0, up, 0)
            slot = (par + 1).unsqueeze(-1)
            rank[:, i] = per_slot.gather(1, slot).squeeze(-1)
            per_slot.scatter_add_(1, slot, valid[:, i : i + 1].to(torch.int64))
        width = int(per_slot.max()) if per_slot.numel() else 0
        children = torch.full((bsz, n + 1, width), -1, dtype=torch.int64, device=dev)
        b_idx, i_idx = valid.nonzero(as_tuple=True)
        children[b_idx, parents[b_idx, i_idx] + 1, rank[b_idx, i_idx]] = i_idx
        kid_tok = token_ids.gather(1, children.clamp(min=0).view(bsz, -1)).view(bsz, n + 1, width)
        kid_tok = torch.where(children >= 0, kid_tok, PLACEHOLDER_TOKEN_ID)
        same = (kid_tok.unsqueeze(-1) == kid_tok.unsqueeze(-2)) & (children >= 0).unsqueeze(-1)
        same &= torch.ones(width, width, dtype=torch.bool, device=dev).triu(1)
        repeated = same.flatten(1).any(dim=-1)
        depths = torch.where(valid, depths, 0)
        return cls(token_ids, parents, depths, num_nodes, children, repeated)

    @property
    def max_nodes(self) -> int:
        return int(self.token_ids.shape[1])

    @property
    def width(self) -> int:
        return int(self.children.shape[2])

    @property
    def max_depth(self) -> int:
        """Levels of the deepest tree (the longest path)."""
        return int((self.depths + 1).masked_fill(~self.valid, 0).max()) if self.token_ids.numel() else 0

    @property
    def valid(self) -> torch.Tensor:  # [B, N] bool
        return torch.arange(self.max_nodes, device=self.token_ids.device) < self.num_nodes.unsqueeze(-1)

    def ancestors(self) -> torch.Tensor:  # [B, N, N] bool
        """ancestors()[b, i, j]: node j is on the path to node i (i included); padding nodes have none."""
        bsz, n = self.token_ids.shape
        anc = torch.zeros(bsz, n, n, dtype=torch.bool, device=self.token_ids.device)
        valid = self.valid
        for i in range(n):  # topological order: the parent's row is complete
            par = self.parents[:, i]
            up = anc[torch.arange(bsz, device=anc.device), par.clamp(min=0)] & (par >= 0).unsqueeze(-1)
            anc[:, i] = up
            anc[:, i, i] = valid[:, i]
        return anc

    def slot_depths(self) -> torch.Tensor:  # [B, N + 1] int64
        """Depth of the token each slot predicts: 0 for slot 0, depth(i) + 1 for slot i + 1."""
        return torch.cat([self.depths.new_zeros(len(self), 1), self.depths + 1], dim=1)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


def pad_trees(
    trees: Sequence[DraftTree], max_nodes: int | None = None, device: torch.device | str | None = None
) -> TreeBatch:
    """Pad a list of trees to [B, max_nodes] tensors (default: the largest tree's size)."""
    n = max((t.num_nodes for t in trees), default=0) if max_nodes is None else max_nodes
    for b, t in enumerate(trees):
        if t.num_nodes > n:
            raise ValueError(f"trees[{b}] has {t.num_nodes} nodes, more than the {n} slots available")
    tokens = torch.full((len(trees), n), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    parents = torch.full((len(trees), n), ROOT, dtype=torch.int64)
    for b, t in enumerate(trees):
        tokens[b, : t.num_nodes] = torch.tensor(t.token_ids, dtype=torch.int64)
        parents[b, : t.num_nodes] = torch.tensor(t.parents, dtype=torch.int64)
    return TreeBatch.from_tensors(tokens.to(device), parents.to(device))


# --------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------
