"""What a round works on: the plan, the levels and the per-sequence state. Free of torch and Ray, so the planner
(`specray.policy`) imports it cheaply and tests build it without a model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specray.coordinator.stats import LevelStats, StatsKey
from specray.engine.caps import WorkerCaps
from specray.spec.ngram import NgramConfig, TokenText
from specray.spec.params import SamplingParams, TokenLogprob, TreeShape, VerifyMethod
from specray.spec.suffix import SuffixDrafter

if TYPE_CHECKING:
    from specray.engine.protocol import Worker

__all__ = ["Backlog", "Level", "Plan", "Planning", "Seq", "check_plan", "plan_name"]


@dataclass
class Level:
    """One level of a cascade: a lookup proposer (level 0 only: n-gram or suffix) or a model worker.

    k: tokens this level proposes to the level above per round (unused for the target).
    method: how this level verifies the level below (unused for level 0).
    native_k, live_decode, engine_verify: the worker's `WorkerCaps` unless given here (an override for tests and
    benchmarks).
    confidence: a model level below the target ends a row's draft after a token it gave a probability below
    this (0: off; HF's assisted generation uses 0.4): the target rejects such tokens often, and tokens drafted
    after them are mostly wasted work. Exact at any value: the draft's length depends only on the drafter.
    tree_width: a suffix level drafts a token tree (at most this many children per node, K nodes in all) instead
    of a chain when > 1, only for a verifier with `WorkerCaps.tree_verify` directly above it (the target of a
    `suffix -> target` plan); otherwise it drafts chains (logged once). 1: chains.
    inner_min_share: a middle level of a cascade stops its inner rounds once fewer than this share of the round's
    rows still need draft tokens (after the first inner round; `specray.coordinator.inner.inner_rounds`). 0: every
    row gets its whole draft. Exact at any value: only draft lengths change.
    tree: a model level drafts a token tree of this shape (`TreeShape`) instead of a chain, under the same rule:
    only as the first level of a plan, directly below a target with `WorkerCaps.tree_verify`, and only if its own
    worker declares `WorkerCaps.tree_propose`. None (or width 1): chains.
    """

    name: str
    worker: Worker | None = None
    ngram: NgramConfig | None = None
    #: a suffix drafter (SuffixDecoding): a lookup level like the n-gram, over this and earlier requests' text
    suffix: SuffixDrafter | None = None
    k: int = 4
    method: VerifyMethod = VerifyMethod.DETERMINISTIC
    native_k: int | None = None
    live_decode: bool | None = None
    engine_verify: int | None = None
    confidence: float = 0.0
    tree_width: int = 1
    tree: TreeShape | None = None
    inner_min_share: float = 0.0
    #: the worker's declared capabilities (None for an n-gram level), read once here
    caps: WorkerCaps | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"level {self.name!r}: confidence must be in [0, 1)")
        if not 0.0 <= self.inner_min_share <= 1.0:
            raise ValueError(f"level {self.name!r}: inner_min_share must be in [0, 1]")
        if sum(x is not None for x in (self.worker, self.ngram, self.suffix)) != 1:
            raise ValueError(f"level {self.name!r}: give exactly one of worker, ngram or suffix")
        if self.tree_width < 1 or (self.tree_width > 1 and self.suffix is None):
            raise ValueError(f"level {self.name!r}: tree_width={self.tree_width} must be >= 1, and > 1 only for a "
                             "suffix level (it drafts token trees)")
        if self.tree is not None and self.worker is None:
            raise ValueError(f"level {self.name!r}: tree is for model levels (a suffix level takes tree_width)")
        if self.worker is not None and self.caps is None:
            self.caps = self.worker.capabilities()
        caps = self.caps or WorkerCaps(self.name, 0)
        self.native_k = int(self.native_k or caps.native_k)
        self.live_decode = bool(self.live_decode or caps.live_decode)
        self.engine_verify = int(self.engine_verify or caps.engine_verify)
        if self.ngram is not None and self.k == 4:
            self.k = self.ngram.num_speculative_tokens
        if self.suffix is not None and self.k == 4:
            self.k = self.suffix.config.num_speculative_tokens
        self.method = VerifyMethod(self.method)

    @property
    def stops_drafts(self) -> bool:
        """A level that ends a row's draft short of what was asked by a rule of its own, so its drafts are often
        shorter than asked: a model level after a token it is unsure of (`confidence`), an n-gram level at its
        match-length cap (`NgramConfig.max_spec_factor`). The planner measures and prices how far they go."""
        if self.ngram is not None:
            return self.ngram.max_spec_factor > 0
        return self.worker is not None and self.confidence > 0

    @property
    def is_ngram(self) -> bool:
        """A lookup level (n-gram or suffix): drafts inside the coordinator at ~no cost, deterministically (so
        rejection over it is the deterministic method), and only as level 0."""
        return self.ngram is not None or self.suffix is not None

    def forget_cached(self) -> bool:
        """Forget what this level kept from finished requests: a model worker's cached prompt prefixes, a suffix
        level's store of earlier outputs (an n-gram level keeps nothing). True if there was such a cache. Only
        between requests: a benchmark's next pass, a server's `POST /reset_prefix_cache`."""
        if self.suffix is not None:
            self.suffix.clear()
        elif self.worker is not None:
            self.worker.reset_prefix_cache()
        else:
            return False
        return True


@dataclass(frozen=True)
class Plan:
    """Which levels run this round (indices, ascending, always ending with the target) and K for each
    non-target active level. `Plan((top,), ())` is plain decoding.

    hybrid: `Plan((lookup, model, target), (k_lookup, k_model), hybrid=True)` drafts per row: a row whose lookup
    level (n-gram or suffix) finds a match sends that match (up to k_lookup tokens) straight to the target, the
    other rows get the model's draft (k_model tokens), and the target verifies all rows in one call. The model
    does not verify the lookup's drafts (no inner rounds). That the first level is a lookup level and the second
    a model is checked against the levels where the plan meets them (`check_plan`).

    tree: children per node of the token trees the first level drafts where the level above it verifies trees: a
    suffix level (`Level.tree_width`; K of that level is then the tree's node budget) or a model level
    (`Level.tree`, directly below the target; K is then the tree's depth unless its shape sets one). 0 takes the
    level's own width, 1 drafts chains, w > 1 trees of width w (the planner prices both and picks).
    """

    levels: tuple[int, ...]
    k: tuple[int, ...]
    hybrid: bool = False
    tree: int = 0

    def __post_init__(self) -> None:
        if len(self.k) != len(self.levels) - 1:
            raise ValueError("a plan needs one K per non-target level")
        if any(x < 0 for x in self.k) or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"invalid plan {self}")
        if self.tree < 0:
            raise ValueError(f"a plan's tree width must be >= 0 (0: the first level's own width): {self}")
        if self.hybrid and (len(self.levels) != 3 or min(self.k) < 1):
            raise ValueError(f"a hybrid plan is (lookup, model, target) with K >= 1 for both drafters: {self}")

    @property
    def speculative(self) -> bool:
        return len(self.levels) > 1 and any(self.k)

    @property
    def drafting(self) -> tuple[int, ...]:
        """The levels that draft for the target in a round of this plan; () for plain decoding (K 0 at the target)."""
        return tuple(self.levels[:-1]) if len(self.levels) > 1 and self.k[-1] > 0 else ()


def plan_name(plan: Plan, names: Sequence[str]) -> str:
    """A plan's label: 'ngram:4>draft:4>target', 'target' (plain decoding), 'ngram:4|draft:4>target' (hybrid);
    a plan with a tree width names it after its first level's K: 'suffix:8/w3>target' (`Plan.tree`)."""
    parts = [f"{names[i]}:{k}" for i, k in zip(plan.levels, plan.k)]
    if plan.tree and parts:
        parts[0] += f"/w{plan.tree}"
    if plan.hybrid:
        return f"{parts[0]}|{parts[1]}>{names[plan.levels[-1]]}"
    return ">".join([*parts, names[plan.levels[-1]]])


def check_plan(plan: Plan, levels: Sequence[Level]) -> None:
    """A plan fits these levels: it ends with the target, and a hybrid plan's first level is a lookup level
    (n-gram or suffix) and its second a model."""
    if plan.levels[-1] != len(levels) - 1 or max(plan.levels) >= len(levels):
        raise ValueError("a plan must end with the target level")
    if plan.tree > 1 and (len(plan.levels) < 2 or levels[plan.levels[0]].ngram is not None):
        raise ValueError(f"plan tree={plan.tree}: only a suffix or model first level drafts token trees")
    if plan.hybrid:
        first, second = (levels[i] for i in plan.levels[:2])
        if not first.is_ngram:
            raise ValueError(f"hybrid plan: its first level {first.name!r} must be a lookup level (n-gram or suffix)")
        if second.is_ngram:
            raise ValueError(f"hybrid plan: its second level {second.name!r} must be a model")


@dataclass(frozen=True)
class Backlog:
    """What a plan must do for a group of rows before its first round's own work, and how long it has to pay that
    back (`CascadeEngine.backlog`): a model level that sat out rounds, or never saw a row, first catches up on that
    row's text in a prefill-sized forward, which no step measurement prices (at batch 16 on long prompts, seconds).

    uncovered: model level -> tokens of committed text its cache lacks, summed over the rows that lack more than a
    step's worth (`specray.coordinator.calls.UNTIMED_CATCH_UP`); remaining: the tokens those rows may still
    produce (their `max_tokens` left), the horizon over which a faster plan earns its catch-up back."""

    uncovered: Mapping[int, int]
    remaining: int


@runtime_checkable
class Planning(Protocol):
    """A planner that weighs each round's `Backlog` (the `specray.policy.planner.Planner`): the scheduler and
    `run_to_completion` ask it through `plan_groups` instead of calling it with the batch size alone."""

    def plan_groups(self, batch_size: int, backlog: Backlog | None = None) -> list[tuple[Plan, int]]: ...


@dataclass
class Seq:
    """One sequence in the batch: its canonical tokens (the coordinator owns them) and per-level bookkeeping."""

    seq_id: str
    prompt_len: int
    tokens: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    finished: bool = False
    finish_reason: str | None = None
    #: keyed by (verifier, drafter) level indices (`specray.coordinator.stats.named_stats` names them)
    stats: dict[StatsKey, LevelStats] = field(default_factory=dict)
    rounds: int = 0
    #: per level: mirror of the worker's tokens, a length known to agree with `tokens`, and the level's failover
    #: epoch when the mirror was made (a newer epoch: the level may have lost the sequence, re-add it); key -1 - i:
    #: the n-gram text held beside middle level i (`LevelCalls.lookup_sync`)
    mirror: dict[int, list[int]] = field(default_factory=dict)
    agreed: dict[int, int] = field(default_factory=dict)
    epoch: dict[int, int] = field(default_factory=dict)
    #: overlap: (plan it was drafted for, len(tokens) it continues, draft tokens) for the next round
    ahead: tuple[Plan, int, list[int]] | None = None
    #: the target's log-probabilities of the output tokens, one per token (`SamplingParams.logprobs` set)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: a draft of the n-gram level 0 that no round verified (len(tokens) it continues, its tokens), checked against
    #: the text committed after it (`specray.coordinator.feed.PlannerFeed.shadowed`); no tokens: the lookup is due
    #: where the text reaches that length (its next round starts after a token not yet committed)
    shadow: tuple[int, list[int]] | None = None
    #: `tokens` in the n-gram search's form, caught up when looked up (`lookup_text`)
    _text: TokenText = field(default_factory=TokenText, repr=False)

    def lookup_text(self) -> TokenText:
        """The committed tokens as the n-gram level searches them (converted once per token: `tokens` only grows)."""
        return self._text.catch_up(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        return self.max_tokens - (len(self.tokens) - self.prompt_len)

    def commit(self, toks: list[int]) -> list[int]:
        """Append a verifier's tokens up to a stop token or the length limit; returns those appended."""
        out = []
        for t in toks:
            if self.remaining <= 0:
                break
            self.tokens.append(t)
            out.append(t)
            if t in self.stop_ids:
                self.finished, self.finish_reason = True, "stop"
                break
        if not self.finished and self.remaining <= 0:
            self.finished, self.finish_reason = True, "length"
        return out
