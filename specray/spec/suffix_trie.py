"""The suffix tries `specray.spec.suffix.SuffixDrafter` drafts from: counts of every window of a set of growing
sequences, matched against a context's suffix and walked (a chain) or grown (a tree) by frequency; the drafter's
module docstring gives the rules and a worked example."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["SuffixDraft", "SuffixTreeDraft", "SuffixTrie"]


@dataclass
class SuffixDraft:
    """One draft: its tokens, each token's estimated path probability, their sum (`score`), the length of the
    context match it continues, and which trie made it. `unique` is False when a tie rule decided it (equal
    child counts on a walked path, or equal scores), i.e. another implementation may draft differently."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""
    unique: bool = True


@dataclass
class SuffixTreeDraft:
    """A draft tree in the layout of `specray.spec.tree.DraftTree` (flat, topological: `parents[i]` is -1 or an
    earlier node), each node's estimated path probability, their sum (`score`), the match length it continues
    and which trie made it."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""


class _Node:
    """A trie node: windows through it (`count`), the latest-started of them (`stamp`), children by token.

    A node only one window passes through may be a tail: `seq` is then that window's sequence, and the chain
    below the node is seq[pos : min(lim, len(seq))] (implicit nodes of count 1; it grows with the sequence).
    """

    __slots__ = ("children", "count", "lim", "pos", "seq", "stamp")

    def __init__(self, count: int = 0, stamp: int = 0, seq: list[int] | None = None, pos: int = 0,
                 lim: int = 0) -> None:
        self.count = count
        self.stamp = stamp
        self.children: dict[int, _Node] | None = None
        self.seq = seq
        self.pos = pos
        self.lim = lim


class SuffixTrie:
    """Counts of every window seq[s : s + depth] of a set of growing sequences (keyed), with removal by key.

    Paths only one window takes are kept as tails (a reference into its sequence) and made explicit one node at a
    time when a second window arrives, so memory is a few nodes per token held, not depth nodes; `node_count`
    counts them (tails as one).
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth = depth
        self.root = _Node()
        self.node_count = 1
        self._seqs: dict[Hashable, list[int]] = {}
        #: per sequence, its windows shorter than depth, oldest first: [node, depth of node, start, window id]
        self._open: dict[Hashable, deque[list]] = {}
        self._windows = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def tokens(self, key: Hashable) -> list[int]:
        return self._seqs[key]

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to sequence `key` (created if new): each extends the open windows and opens one.

        Per token: (1) each open window finds where it ends now (a node made explicit under it since its last
        step moves it down its own path); (2) the token is appended, which extends every window inside its own
        tail for free; (3) the windows that end at an explicit node step into the token's child (created as a
        tail, counted, or a tail split there). Steps see the token already appended, so a split reproduces
        the owner's path including it."""
        seq = self._seqs.setdefault(key, [])
        wins = self._open.setdefault(key, deque())
        depth, root = self.depth, self.root
        for t in tokens:
            t = int(t)
            n = len(seq)
            for w in wins:  # (1)
                node, d, s = w[0], w[1], w[2]
                while node.seq is None and d < n - s:
                    node = node.children[seq[s + d]]  # type: ignore[index]
                    d += 1
                w[0], w[1] = node, d
            seq.append(t)  # (2)
            self._windows += 1
            wins.append([root, 0, n, self._windows])
            root.count += 1
            for w in wins:  # (3)
                node = w[0]
                if node.seq is not None:
                    continue
                kids = node.children
                if kids is None:
                    kids = node.children = {}
                child = kids.get(t)
                if child is None:
                    kids[t] = child = _Node(1, w[3], seq, n + 1, w[2] + depth)
                    self.node_count += 1
                else:
                    if child.seq is not None:
                        self._split(child)
                    child.count += 1
                    child.stamp = max(child.stamp, w[3])
                w[0], w[1] = child, w[1] + 1
            while wins and wins[0][2] + depth <= n + 1:
                wins.popleft()

    def _split(self, tail: _Node) -> None:
        """Make a tail explicit: its first implicit node becomes its one child (a tail itself)."""
        seq, pos, lim = tail.seq, tail.pos, tail.lim
        tail.seq = None
        tail.children = {}
        if pos < min(lim, len(seq)):  # type: ignore[arg-type]
            tail.children[seq[pos]] = _Node(1, tail.stamp, seq, pos + 1, lim)  # type: ignore[index]
            self.node_count += 1

    def remove(self, key: Hashable) -> None:
        """Take every window of sequence `key` out of the counts; nodes no window passes through are freed."""
        seq = self._seqs.pop(key)
        del self._open[key]
        n = len(seq)
        for s in range(n):
            self.root.count -= 1
            node = self.root
            for d in range(s, min(n, s + self.depth)):
                kids = node.children
                child = kids[seq[d]]  # type: ignore[index]
                child.count -= 1
                if child.count == 0:  # this window's alone from here: a chain of count-1 nodes, maybe a tail
                    del kids[seq[d]]  # type: ignore[union-attr]
                    while child is not None:
                        self.node_count -= 1
                        child = next(iter(child.children.values())) if child.children else None
                    break
                node = child

    def match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Where `pattern` ends in the trie: a node and how far into its tail (0: at the node), or None."""
        node = self.root
        it = iter(pattern)
        for t in it:
            kids = node.children
            node = kids.get(t) if kids else None
            if node is None:
                return None
            if node.seq is not None:  # a tail: the rest of the pattern must follow its window's text
                seq, i = node.seq, node.pos
                end = min(node.lim, len(seq))
                for u in it:
                    if i >= end or seq[i] != u:
                        return None
                    i += 1
                return node, i - node.pos
        return node, 0

    def walk(self, at: tuple[_Node, int], max_tokens: int, min_token_prob: float
             ) -> tuple[list[int], list[float], bool]:
        """The most frequent path below `at`: tokens, their path probabilities, and whether no tie decided it."""
        node, off = at
        out: list[int] = []
        probs: list[float] = []
        prob, unique = 1.0, True
        while len(out) < max_tokens:
            if node.seq is not None:  # inside a tail: one window, probability unchanged
                i = node.pos + off
                if i >= node.lim or i >= len(node.seq):
                    break
                out.append(node.seq[i])
                probs.append(prob)
                off += 1
                continue
            if not node.children:
                break
            top = max(c.count for c in node.children.values())
            tied = [(c.stamp, t, c) for t, c in node.children.items() if c.count == top]
            if len(tied) > 1:
                unique = False
            _, token, child = max(tied, key=lambda x: x[0])  # the latest-started window's
            p = prob * top / node.count
            if p < min_token_prob:
                break
            out.append(token)
            probs.append(p)
            prob, node, off = p, child, 0
        return out, probs, unique

    @staticmethod
    def _branches(at: tuple[_Node, int], prob: float, width: int) -> list[tuple[float, int, tuple[_Node, int]]]:
        """The `width` most frequent continuations below `at` (ties: the latest-started window's first), as
        (path probability, token, where it ends); `walk` takes the first of them."""
        node, off = at
        if node.seq is not None:  # inside a tail: one window, probability unchanged
            i = node.pos + off
            if i >= node.lim or i >= len(node.seq):
                return []
            return [(prob, node.seq[i], (node, off + 1))]
        if not node.children:
            return []
        kids = sorted(node.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp), reverse=True)
        return [(prob * c.count / node.count, t, (c, 0)) for t, c in kids[:width]]

    def grow(self, at: tuple[_Node, int], max_nodes: int, min_token_prob: float, width: int
             ) -> tuple[list[int], list[int], list[float]]:
        """The most likely continuations below `at` as a tree: best-first by path probability (SuffixDecoding's
        tree speculation), at most `width` children per node, every node's probability >= min_token_prob.
        Returns (tokens, parents, probabilities), nodes in the order taken (a parent before its children).
        With width 1 it is `walk`'s path."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        order = itertools.count()
        heap = [(-p, next(order), t, -1, nxt) for p, t, nxt in self._branches(at, 1.0, width)]
        heapq.heapify(heap)
        while heap and len(tokens) < max_nodes:
            neg_p, _, token, parent, nxt = heapq.heappop(heap)
            if -neg_p < min_token_prob:
                break  # the heap's best: every other candidate is as unlikely
            tokens.append(token)
            parents.append(parent)
            probs.append(-neg_p)
            here = len(tokens) - 1
            for p, t, below in self._branches(nxt, -neg_p, width):
                heapq.heappush(heap, (-p, next(order), t, here, below))
        return tokens, parents, probs

    def speculate_tree(self, context: Sequence[int], max_nodes: int, max_spec_factor: float,
                       min_token_prob: float, width: int) -> SuffixTreeDraft:
        """`speculate` with trees: per match length m, `grow` with a budget of max_spec_factor * m nodes; the
        tree with the highest score wins (ties: the longer match)."""
        best = SuffixTreeDraft()
        n = len(context)
        for m in range(1, min(n, self.depth - 1) + 1):
            at = self.match(context[n - m :])
            if at is None:
                break
            limit = max(0, min(max_nodes, int(m * max_spec_factor + 1e-6)))
            toks, parents, probs = self.grow(at, limit, min_token_prob, width)
            score = sum(probs)
            if score >= best.score:
                best = SuffixTreeDraft(toks, parents, probs, score, m)
        return best

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> SuffixDraft:
        """Best draft over all match lengths 1 .. depth - 1 of the context's suffix (see `specray.spec.suffix`)."""
        best = SuffixDraft()
        top = min(len(context), self.depth - 1)
        n = len(context)
        for m in range(1, top + 1):
            at = self.match(context[n - m :])
            if at is None:
                break
            limit = max(0, min(max_tokens, int(m * max_spec_factor + 1e-6)))
            toks, probs, unique = self.walk(at, limit, min_token_prob)
            score = sum(probs)
            if toks and abs(score - best.score) < 1e-6:
                unique = False  # equal up to rounding: the order of comparison decides
            if score >= best.score:
                best = SuffixDraft(toks, probs, score, m, unique=unique and best.unique)
            elif not unique:
                best.unique = False  # a different tie choice could have scored higher
        return best
