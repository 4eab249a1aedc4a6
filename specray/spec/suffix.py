"""Suffix drafter (SuffixDecoding): drafts by frequency from suffix tries over this request and over the outputs
of recent requests, so a continuation seen before is proposed even when this request never wrote it.

The n-gram proposer (`specray.spec.ngram`) copies only from the same request and always drafts K tokens. This
drafter keeps, as SuffixDecoding does (vLLM's `suffix` method, which runs Arctic Inference's implementation):

- a per-request trie over the prompt and the output so far (`start`, `extend`; dropped at `finish`);
- a global trie over the outputs of the `max_cached_requests` most recently started requests (the output enters
  it as it is generated, so concurrent requests share it; the oldest request's output is evicted whole when a
  new request would exceed the bound; 0 disables it, -1 means no bound).

Each trie holds every window `seq[s : s + max_tree_depth]` of its sequences; a node counts the windows that pass
through it, so `count(child) / count(node)` estimates how often the text continued with the child's token.
`propose` matches the context's last m tokens (m = 1 .. max_tree_depth - 1, until no occurrence is left) in
each trie; from each match it walks the most frequent child while the path's probability (the product of the
count ratios) stays >= `min_token_prob`, and drafts at most `max_spec_factor * m` tokens (and max_k). The
draft with the highest score (the sum of its tokens' path probabilities) wins; equal scores go to the longer
match, and to the request's own trie over the global one. Equal child counts go to the child whose latest window
started last (the text's latest habit), which keeps drafts deterministic for a given history.

`propose_tree` drafts a token tree (`specray.spec.tree.DraftTree`) instead, as SuffixDecoding's tree speculation
does: from each match it takes continuations best-first by path probability, branching at nodes where the text
continued in several ways (at most `tree_width` children per node, `max_spec_factor * m` nodes, each node's
path probability >= `min_token_prob`), and keeps the tree with the highest score. With tree_width 1 it is the
chain `propose` drafts.

Paths only one window takes are stored as references into its text, so memory is a few Python objects per
token held (`SuffixTrie`). Knob names and defaults are vLLM's `suffix_decoding_*` (without the prefix),
except `max_cached_requests`: 1000 instead of vLLM's 10000 (Python objects cost more than its C++ nodes).

Worked example (max_tree_depth 4, max_spec_factor 1, min_token_prob 0.1). Request "a" has prompt
[1, 2, 3, 4, 1, 2, 3, 5]; drafting after the context [..., 9, 1, 2]: the suffix [2] occurs twice in the prompt
and [1, 2] twice, each time followed by 3 (count 2 of 2: p = 1), and 3 is followed by 4 once and by 5 once
(p = 1/2; 5 wins the tie, seen last). Match m = 1 drafts 1 token ([3], score 1); m = 2 drafts [3, 5] (score
1.5); [9, 1, 2] does not occur, so the longest useful match is m = 2 -> draft [3, 5].
When "a" has written [7, 8, 9] and finished, request "b" (prompt [6, 7]) drafts 8 from the global trie (one
token: its match [7] is one token long), then, once 8 is its own, 9 after the match [7, 8].

>>> d = SuffixDrafter(SuffixConfig(max_tree_depth=4, max_spec_factor=1.0, min_token_prob=0.1))
>>> d.start("a", [1, 2, 3, 4, 1, 2, 3, 5])
>>> d.propose("a", [1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2], max_k=8)
[3, 5]
>>> d.extend("a", [7, 8, 9]); d.finish("a")
>>> d.start("b", [6, 7])
>>> d.propose("b", [6, 7], max_k=8)
[8]
>>> d.extend("b", [8]); d.propose("b", [6, 7, 8], max_k=8)
[9]

The draft length adapts to the match: in [1, 2, 3, 4, 5, 6, 1, 2] the suffix [1, 2] (m = 2) occurred once
before, followed by 3 4 5 6 (path probability 1/2: [1, 2] also ends the text); factor 1 drafts 2 tokens, factor
2 drafts 4.

>>> for factor in (1.0, 2.0):
...     d = SuffixDrafter(SuffixConfig(max_tree_depth=8, max_spec_factor=factor))
...     d.start("c", [1, 2, 3, 4, 5, 6, 1, 2])
...     print(d.propose("c", [1, 2, 3, 4, 5, 6, 1, 2], max_k=8))
[3, 4]
[3, 4, 5, 6]
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specray.spec.tree import DraftTree

__all__ = ["SuffixConfig", "SuffixDraft", "SuffixDrafter", "SuffixTreeDraft", "SuffixTrie"]


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix decoding settings; names follow vLLM's `speculative_config` keys `suffix_decoding_<name>`."""

    #: most tokens drafted per round (a level's K; the match length usually limits it first)
    num_speculative_tokens: int = 24
    #: depth of every trie: a match plus its draft spans at most this many tokens
    max_tree_depth: int = 24
    #: outputs of this many most recently started requests feed the global trie (0: none, -1: no bound)
    max_cached_requests: int = 1000
    #: a match of m tokens drafts at most max_spec_factor * m tokens
    max_spec_factor: float = 1.0
    #: stop the draft before a token whose estimated path probability is below this
    min_token_prob: float = 0.1
    #: most children per node of a draft tree (`propose_tree`); chains (`propose`) ignore it
    tree_width: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth={self.max_tree_depth} must be >= 1")
        if self.max_cached_requests < -1:
            raise ValueError(f"max_cached_requests={self.max_cached_requests} must be >= -1 (-1: no bound)")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor={self.max_spec_factor} must be >= 0")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob={self.min_token_prob} must be in [0, 1]")
        if self.tree_width < 1:
            raise ValueError(f"tree_width={self.tree_width} must be >= 1")


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
        """Best draft over all match lengths 1 .. depth - 1 of the context's suffix (see the module docstring)."""
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


class SuffixDrafter:
    """Per-request and global suffix tries with SuffixDecoding's adaptive draft length (module docstring).

    Lifecycle per request: `start` (its prompt), `extend` as its output grows, `finish` when it ends. `propose`
    drafts for any context (the request's committed tokens plus, e.g., tokens drafted above them).
    A round loop that holds each sequence's whole text uses `propose_seq` and `release` instead: they keep
    the tries in step with the text themselves and take a lock (look-ahead threads draft beside the loop).
    """

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._local: dict[Hashable, SuffixTrie] = {}
        self._global = SuffixTrie(self.config.max_tree_depth)
        #: outputs in the global trie, oldest start first: slot -> request id. Slots, not ids, key the trie, so a
        #: finished request's output stays when its id is used again
        self._cached: OrderedDict[int, Hashable] = OrderedDict()
        #: active requests' slots in the global trie
        self._slot: dict[Hashable, int] = {}
        self._slots = itertools.count()
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------------------
    @property
    def active(self) -> set[Hashable]:
        return set(self._local)

    @property
    def cached(self) -> list[Hashable]:
        """Requests whose output feeds the global trie, oldest first."""
        return list(self._cached.values())

    def start(self, request_id: Hashable, prompt: Sequence[int]) -> None:
        """Begin a request: its trie starts with the prompt; its output gets a slot in the global trie (evicting
        the oldest cached output beyond max_cached_requests)."""
        if request_id in self._local:
            raise ValueError(f"request {request_id!r} is already active")
        trie = SuffixTrie(self.config.max_tree_depth)
        trie.extend(0, prompt)
        self._local[request_id] = trie
        cap = self.config.max_cached_requests
        if cap == 0:
            return
        slot = self._slot[request_id] = next(self._slots)
        self._cached[slot] = request_id
        self._global.extend(slot, ())
        while cap > 0 and len(self._cached) > cap:
            old, _ = self._cached.popitem(last=False)
            self._global.remove(old)

    def extend(self, request_id: Hashable, new_tokens: Sequence[int]) -> None:
        """The request's output grew by these tokens (committed ones, not drafts)."""
        trie = self._local.get(request_id)
        if trie is None:
            raise ValueError(f"request {request_id!r} is not active")
        trie.extend(0, new_tokens)
        slot = self._slot.get(request_id)
        if slot is not None and slot in self._cached:
            self._global.extend(slot, new_tokens)

    def finish(self, request_id: Hashable) -> None:
        """End a request: its own trie is freed; its output stays in the global trie until evicted."""
        if self._local.pop(request_id, None) is None:
            raise ValueError(f"request {request_id!r} is not active")
        self._slot.pop(request_id, None)

    def observe(self, request_id: Hashable, tokens: Sequence[int], prompt_len: int) -> None:
        """Bring a request up to `tokens` (prompt + committed output so far), starting it if new; for callers
        that hold the whole text rather than its increments. Text that does not extend what the request holds
        (checked at its last token) restarts it."""
        trie = self._local.get(request_id)
        if trie is not None:
            held = trie.tokens(0)
            if len(tokens) < len(held) or (held and tokens[len(held) - 1] != held[-1]):
                self.finish(request_id)
                trie = None
        if trie is None:
            self.start(request_id, tokens[:prompt_len])
        held_n = len(self._local[request_id].tokens(0))
        if len(tokens) > held_n:
            self.extend(request_id, tokens[held_n:])

    def propose_seq(self, request_id: Hashable, tokens: Sequence[int], prompt_len: int,
                    context: Sequence[int], max_k: int) -> list[int]:
        """`observe(request_id, tokens, prompt_len)`, then draft up to max_k tokens after `context` (the
        committed `tokens`, possibly followed by drafted ones). Thread-safe."""
        with self._lock:
            self.observe(request_id, tokens, prompt_len)
            return self.propose(request_id, context, max_k)

    def release(self, request_id: Hashable, tokens: Sequence[int], prompt_len: int) -> None:
        """A sequence ended with this text (call once per sequence): its output, drafted for or not, joins the
        global trie and its own trie is freed. Thread-safe."""
        with self._lock:
            if request_id in self._local:
                self.observe(request_id, tokens, prompt_len)
            elif self.config.max_cached_requests != 0 and len(tokens) > prompt_len:
                self.start(request_id, ())  # never drafted for: only its output is kept
                self.extend(request_id, tokens[prompt_len:])
            else:
                return
            self.finish(request_id)

    # --- drafting ----------------------------------------------------------------------------------------
    def draft(self, request_id: Hashable, tokens: Sequence[int], max_k: int | None = None) -> SuffixDraft:
        """The best draft continuing `tokens` from the request's trie or the global one (global only when it
        scores strictly higher)."""
        trie = self._local.get(request_id)
        if trie is None:
            raise ValueError(f"request {request_id!r} is not active")
        return self._draft((trie,), tokens, max_k)

    def propose(self, request_id: Hashable, tokens: Sequence[int], max_k: int | None = None) -> list[int]:
        """Draft up to max_k (default num_speculative_tokens) tokens continuing `tokens` (possibly none)."""
        return self.draft(request_id, tokens, max_k).token_ids

    def draft_tree(self, request_id: Hashable, tokens: Sequence[int], max_nodes: int | None = None,
                   tree_width: int | None = None) -> SuffixTreeDraft:
        """The best draft tree continuing `tokens` (as `draft`, with branches): at most max_nodes nodes (default
        num_speculative_tokens) and tree_width children per node (default the config's)."""
        trie = self._local.get(request_id)
        if trie is None:
            raise ValueError(f"request {request_id!r} is not active")
        cfg = self.config
        k = cfg.num_speculative_tokens if max_nodes is None else max_nodes
        width = cfg.tree_width if tree_width is None else tree_width
        if width < 1:
            raise ValueError(f"tree_width={width} must be >= 1")
        if k <= 0:
            return SuffixTreeDraft()
        context = list(tokens[-cfg.max_tree_depth :])
        best = trie.speculate_tree(context, k, cfg.max_spec_factor, cfg.min_token_prob, width)
        best.source = "request"
        if len(self._global):
            g = self._global.speculate_tree(context, k, cfg.max_spec_factor, cfg.min_token_prob, width)
            if g.score > best.score:
                g.source, best = "global", g
        return best

    def propose_tree(self, request_id: Hashable, tokens: Sequence[int], max_nodes: int | None = None,
                     tree_width: int | None = None) -> DraftTree:
        """A `DraftTree` continuing `tokens` (see `draft_tree`); with tree_width 1 it is `propose`'s chain.
        Siblings carry distinct tokens: deterministic drafts (verify with deterministic, coupled or greedy)."""
        from specray.spec.tree import DraftTree  # imports torch, which the round state must not need

        d = self.draft_tree(request_id, tokens, max_nodes, tree_width)
        return DraftTree(tuple(d.token_ids), tuple(d.parents))

    def propose_tree_seq(self, request_id: Hashable, tokens: Sequence[int], prompt_len: int,
                         context: Sequence[int], max_nodes: int, tree_width: int | None = None) -> DraftTree:
        """`propose_seq` for trees: `observe`, then `propose_tree` after `context`. Thread-safe."""
        with self._lock:
            self.observe(request_id, tokens, prompt_len)
            return self.propose_tree(request_id, context, max_nodes, tree_width)

    def _draft(self, local: tuple[SuffixTrie, ...], tokens: Sequence[int], max_k: int | None) -> SuffixDraft:
        cfg = self.config
        k = cfg.num_speculative_tokens if max_k is None else max_k
        if k <= 0:
            return SuffixDraft()
        context = list(tokens[-cfg.max_tree_depth :])
        best = local[0].speculate(context, k, cfg.max_spec_factor, cfg.min_token_prob)
        best.source = "request"
        if len(self._global):
            g = self._global.speculate(context, k, cfg.max_spec_factor, cfg.min_token_prob)
            unique = g.unique and best.unique and not (g.token_ids and abs(g.score - best.score) < 1e-6)
            if g.score > best.score:
                g.source, best = "global", g
            best.unique = unique
        return best

    @property
    def node_count(self) -> int:
        """Trie nodes held (global plus every active request's): the drafter's memory, in nodes."""
        return self._global.node_count + sum(t.node_count for t in self._local.values())
