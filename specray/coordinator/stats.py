"""Per-level speculation statistics of a request or a batch (what `generate` returns and metrics count).

A level's statistics are what it saw as a verifier. A level can verify drafts from more than one drafter (the
planner may skip a middle level: `ngram -> target` one round, `mid -> target` the next), and "mid: accepted 6%"
reads as the mid model failing when it is the n-gram's drafts that mid rejected. So every verification is also
recorded under its drafter -> verifier pair, named `"<drafter>-><verifier>"` (e.g. `ngram->qwen-0.5b`), in
`LevelStats.pairs`. A target that speculated by itself (a native vLLM level) is its own drafter, named
`native` (`native->target`). Rounds without a drafter (plain decoding) count only in the level's totals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["NATIVE", "NATIVE_NAME", "LevelStats", "StatsKey", "drafter_of", "named_stats", "pair_name", "stats_for"]

#: drafter index of a verification the verifier's own engine drafted for (a native vLLM level)
NATIVE = -1
#: that drafter's name in a pair
NATIVE_NAME = "native"
#: (verifier level, drafter level | NATIVE | None for plain decoding): how a sequence keys its statistics
StatsKey = tuple[int, int | None]


def pair_name(drafter: str, verifier: str) -> str:
    return f"{drafter}->{verifier}"


def stats_for(stats: dict[StatsKey, LevelStats], key: StatsKey) -> LevelStats:
    """The entry of `key`, made on first use (`setdefault` would build a `LevelStats` every call, a round's
    commit and every inner round)."""
    st = stats.get(key)
    if st is None:
        st = stats[key] = LevelStats()
    return st


def drafter_of(lower: int | None, had_draft: bool, native: bool) -> int | None:
    """Who drafted what a verifier scored for one row: the level below (`lower`) when it gave a draft; the
    verifier's own engine (NATIVE) when the row had no draft and the verifier speculates by itself; else `lower`
    (it drafted nothing this time) or None (plain decoding)."""
    if not had_draft and native:
        return NATIVE
    return lower


@dataclass
class LevelStats:
    """What one level saw as a verifier: drafts proposed to it and how many it accepted, per position; with
    the same counts split by drafter -> verifier pair in `pairs` (filled by `named_stats`).

    Token trees (`Worker.verify_tree`): a tree counts as one draft of `draft_tokens` = its nodes, with
    `accepted_tokens` = the accepted path's length and `accepted_per_pos` by depth; `tree_drafts` and
    `tree_nodes` count the tree rounds apart (their nodes are also in `draft_tokens`), so the acceptance rate of
    a tree round reads as accepted path tokens per node drafted."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    verify_calls: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    #: verifications of a draft tree (with at least one node) and the nodes those trees had
    tree_drafts: int = 0
    tree_nodes: int = 0
    #: the same statistics per "<drafter>-><verifier>" pair; the draft counts of the pairs sum to the level's
    pairs: dict[str, LevelStats] = field(default_factory=dict)

    def record(self, n_draft: int, n_acc: int, n_emitted: int, tree_depth: int | None = None) -> None:
        """One verification of n_draft draft tokens (a tree: nodes, of `tree_depth` levels) that accepted n_acc
        (a tree: the path's length) and emitted n_emitted tokens."""
        self.verify_calls += 1
        self.emitted_tokens += n_emitted
        if n_draft > 0:
            self.num_drafts += 1
            self.draft_tokens += n_draft
            self.accepted_tokens += n_acc
            if tree_depth is not None:
                self.tree_drafts += 1
                self.tree_nodes += n_draft
            span = n_draft if tree_depth is None else tree_depth
            if len(self.accepted_per_pos) < span:
                self.accepted_per_pos.extend([0] * (span - len(self.accepted_per_pos)))
            for j in range(n_acc):
                self.accepted_per_pos[j] += 1

    def merge(self, other: LevelStats) -> None:
        self.num_drafts += other.num_drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        self.verify_calls += other.verify_calls
        self.tree_drafts += other.tree_drafts
        self.tree_nodes += other.tree_nodes
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for j, c in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[j] += c
        for name, st in other.pairs.items():
            self.pairs.setdefault(name, LevelStats()).merge(st)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification call (accepted + 1), vLLM's 'mean acceptance length'."""
        return self.emitted_tokens / self.verify_calls if self.verify_calls else 0.0

    @property
    def pair(self) -> str | None:
        """The pair whose drafts this level verified ("ngram->mid"); with several drafters their names joined
        by "+" ("ngram+mid->target", split in `pairs`); None when nothing drafted for it."""
        if not self.pairs:
            return None
        drafters = [p.split("->", 1)[0] for p in self.pairs]
        return pair_name("+".join(drafters), next(iter(self.pairs)).split("->", 1)[1])

    def as_dict(self) -> dict:
        out = {
            "num_drafts": self.num_drafts, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
            "verify_calls": self.verify_calls, "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }
        if self.tree_drafts:
            out["tree_drafts"], out["tree_nodes"] = self.tree_drafts, self.tree_nodes
        if self.pairs:
            out["pair"] = self.pair
            out["pairs"] = {name: st.as_dict() for name, st in self.pairs.items()}
        return out


def named_stats(names: Sequence[str], stats: Mapping[StatsKey, LevelStats]) -> dict[str, LevelStats]:
    """A sequence's statistics (keyed by (verifier, drafter) level indices) as the API reports them: one entry
    per verifying level by name, smallest level first, each with its `pairs` by name (drafters in level order,
    the native drafter first)."""
    out: dict[str, LevelStats] = {}

    def order(key: StatsKey) -> tuple[int, int]:
        return key[0], -2 if key[1] is None else key[1]

    for key in sorted(stats, key=order):
        verifier, drafter = key
        st = stats[key]
        level = out.setdefault(names[verifier], LevelStats())
        level.merge(st)
        if drafter is not None:
            who = NATIVE_NAME if drafter == NATIVE else names[drafter]
            level.pairs.setdefault(pair_name(who, names[verifier]), LevelStats()).merge(st)
    return out
