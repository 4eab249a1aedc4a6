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

import itertools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specray.spec.suffix_trie import SuffixDraft, SuffixTreeDraft, SuffixTrie

if TYPE_CHECKING:
    from specray.spec.tree import DraftTree

__all__ = ["SuffixConfig", "SuffixDrafter"]


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

    def clear(self) -> None:
        """Forget every request and every cached output (a benchmark's next pass starts cold). A request still
        running restarts from its whole text at its next `propose_seq`. Thread-safe."""
        with self._lock:
            self._local.clear()
            self._global = SuffixTrie(self.config.max_tree_depth)
            self._cached.clear()
            self._slot.clear()

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
