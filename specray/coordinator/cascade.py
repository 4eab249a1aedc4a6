"""`CascadeEngine`: runs rounds (`specray.coordinator.round`) over a batch of sequences on a cascade of levels.

Levels are ordered small -> large; the last is the target. The engine owns the canonical tokens of every
sequence and a mirror of what each worker holds (`specray.coordinator.calls` sends each worker a `SeqSync` with
every call: one batched call per level per (inner) round, and rollback is just a shorter `keep`). It talks to
workers only through the protocol, so a fake worker, an in-process `HFWorker` or a Ray actor proxy all fit.
A draft level that fails is dropped and the round retried without it (`specray.coordinator.failover`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specray.coordinator.calls import LevelCalls
from specray.coordinator.drafting import Drafter, Immediate
from specray.coordinator.failover import Failover, LevelCallError
from specray.coordinator.feed import Observer, PlannerFeed
from specray.coordinator.inner import Nesting
from specray.coordinator.lookahead import LookAhead
from specray.coordinator.round import new_round, run_round
from specray.coordinator.state import Backlog, Level, Plan, Planning, Seq, check_plan, plan_name
from specray.coordinator.stats import LevelStats
from specray.spec.params import SamplingParams, TokenLogprob, TreeShape, VerifyMethod

__all__ = ["CascadeEngine", "GenerationResult", "Level", "LevelCallError", "LevelStats", "Plan", "Seq",
           "round_plans", "run_to_completion"]


class CascadeEngine:
    """Runs rounds over a batch of sequences. One engine per coordinator loop; `step` may run from two threads
    at once for disjoint sequences (pipelining) when the workers are thread-safe (Ray actor proxies).

    overlap: the levels below the target draft the next round while it verifies this one (`LookAhead`).
    nesting: lets a middle level run its inner rounds beside its model (`specray.coordinator.inner`; the Ray
    levels' direct transport provides one); None: the coordinator makes every inner round's calls.
    """

    def __init__(self, levels: Sequence[Level], max_context: int | None = None, *, overlap: bool = False,
                 nesting: Nesting | None = None) -> None:
        if not levels:
            raise ValueError("a cascade needs at least one level (the target)")
        levels = list(levels)
        for i, lvl in enumerate(levels):
            if lvl.is_ngram and i != 0:
                raise ValueError(f"level {lvl.name!r}: an n-gram proposer can only be the first (smallest) level")
        if levels[-1].is_ngram:
            raise ValueError("the last level (the target) must be a model")
        self.levels = levels
        self.top = len(levels) - 1
        limits = [lvl.caps.max_context for lvl in levels if lvl.caps is not None and lvl.caps.max_context]
        self.max_context = min([*limits, *([max_context] if max_context else [])], default=None)
        self.default_plan = Plan(tuple(range(len(levels))), tuple(lvl.k for lvl in levels[:-1]))
        self._ids = itertools.count()
        self.failover = Failover(levels)
        self.feed = PlannerFeed(levels)
        self.calls = LevelCalls(levels, self.failover, self.feed)
        self.drafter = Drafter(self.calls, nesting)
        self.immediate = Immediate(self.drafter)
        self.lookahead = LookAhead(self.drafter, self.failover, overlap)
        self._lock = threading.Lock()

    # ----- settings and views (the parts own them) -------------------------------------------------
    @property
    def observers(self) -> list[Observer]:
        """Live measurements for the planner (`specray.coordinator.feed`)."""
        return self.feed.observers

    @property
    def overlap(self) -> bool:
        return self.lookahead.enabled

    @property
    def ahead_bounded(self) -> bool:
        return self.lookahead.bounded

    @ahead_bounded.setter
    def ahead_bounded(self, value: bool) -> None:
        self.lookahead.bounded = bool(value)

    @property
    def ahead_chunk(self) -> int:
        return self.drafter.chunk

    @property
    def ahead_rows(self) -> int:
        return self.lookahead.ahead_rows

    @property
    def ahead_hits(self) -> int:
        return self.lookahead.ahead_hits

    @property
    def retry_after_s(self) -> float:
        return self.failover.retry_after_s

    @retry_after_s.setter
    def retry_after_s(self, value: float) -> None:
        self.failover.retry_after_s = value

    def level_status(self) -> dict[str, str]:
        return self.failover.status()

    def plan_name(self, plan: Plan) -> str:
        """A short label, e.g. 'ngram:4>draft:4>target', 'target' (plain decoding) or 'ngram:4|draft:4>target'
        (a hybrid plan: the n-gram's match, else the draft model's draft)."""
        return plan_name(plan, [lvl.name for lvl in self.levels])

    # ----- sequence lifecycle --------------------------------------------------------------------
    def new_sequence(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int,
        stop_ids: Sequence[int] = (), seq_id: str | None = None,
    ) -> Seq:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.max_context is not None:
            if len(prompt_ids) >= self.max_context:
                raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context {self.max_context}")
            max_tokens = min(max_tokens, self.max_context - len(prompt_ids))
        caps = self.levels[-1].caps
        if sampling.penalized and not (caps is not None and caps.penalties):
            raise ValueError(f"the target {self.levels[-1].name!r} does not apply penalties (its backend lacks them)")
        if sampling.logprobs is not None and not (caps is not None and caps.logprobs):
            raise ValueError(f"logprobs: the target {self.levels[-1].name!r} does not report log-probabilities")
        sid = seq_id if seq_id is not None else f"seq-{next(self._ids)}"
        sampling = sampling.with_seed().for_prompt(len(prompt_ids))
        return Seq(sid, len(prompt_ids), list(prompt_ids), sampling, max_tokens, frozenset(stop_ids))

    def release(self, seq: Seq) -> None:
        """Free the sequence on every level that has seen it (idempotent)."""
        self.calls.release(seq)

    def backlog(self, seqs: Sequence[Seq]) -> Backlog:
        """What each model drafter lacks of these sequences' text, and their remaining tokens: a planner's price
        of starting a drafter on them (`specray.coordinator.state.Backlog`)."""
        live = [s for s in seqs if not s.finished]
        uncovered = {i: n for i in range(self.top) if not self.levels[i].is_ngram
                     and (n := self.calls.uncovered(i, live)) > 0}
        return Backlog(uncovered, sum(max(0, s.remaining) for s in live))

    # ----- one round -----------------------------------------------------------------------------
    def step(
        self, seqs: Sequence[Seq], plan: Plan | None = None, method: VerifyMethod | None = None,
        tree: TreeShape | None = None,
    ) -> list[list[int]]:
        """One round for the active sequences: returns the tokens newly committed to each.

        `method` overrides every level's verification method for this round (a per-request choice), `tree` the
        token-tree shape of the level drafting for the target (`Drafter.tree_shape`; width 1: chains). A draft
        level that fails is marked down and the round runs again without it (exact: drafts are only proposals).
        """
        plan = plan or self.default_plan
        check_plan(plan, self.levels)
        active = [s for s in seqs if not s.finished]
        if not active:
            return [[] for _ in seqs]
        override = VerifyMethod(method) if method is not None else None
        if override is None and all(s.sampling.greedy for s in active):
            # at temperature 0 every method verifies greedily (same tokens); saying so lets a greedy batch draft
            # ahead (overlap) and skip draft probabilities under a configured rejection method
            override = VerifyMethod.GREEDY
        failed: set[int] = set()  # levels that failed in this round: its retries run without them
        t0, busy = time.perf_counter(), self.calls.busy()
        for _ in range(len(self.levels)):
            r = new_round(active, self.failover.available(plan, failed), override, self.immediate, self.lookahead,
                          tree)
            try:
                committed = run_round(r, self.calls)
                if not failed and not isinstance(r.source, LookAhead):
                    # the coordinator's own time this round (a look-ahead's calls run in another thread beside it)
                    own = time.perf_counter() - t0 - (self.calls.busy() - busy)
                    self.calls.feed.hosted(r.plan, len(active), own)
                break
            except LevelCallError as exc:
                if exc.level == self.top:
                    raise
                failed.add(exc.level)
                self.failover.mark_down(exc.level, exc)
        else:  # pragma: no cover - every draft level failed in turn; the target alone cannot fail over
            raise RuntimeError("no plan could run")
        return [committed.get(s.seq_id, []) for s in seqs]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    rounds: int
    stats: dict[str, LevelStats]
    #: seconds from the start of the call to this sequence's first token (its prefill and first round)
    ttft_s: float | None = None
    #: the target's log-probabilities of token_ids (`SamplingParams.logprobs` set; else None)
    logprobs: list[TokenLogprob] | None = None


def round_plans(
    engine: CascadeEngine, plan: Plan | Callable[[int], Plan] | None,
) -> Callable[[Sequence[Seq], int], Plan | None]:
    """(rows, active rows) -> the round's plan: `plan` itself, or a planner's for the batch size (a `Planning` one
    with the rows' `Backlog` too: its first group's plan runs the round). What the planner takes is checked once
    here: a protocol check costs a round's work."""
    if isinstance(plan, Planning):
        return lambda seqs, n: plan.plan_groups(n, engine.backlog(seqs))[0][0]
    if callable(plan):
        return lambda seqs, n: plan(n)
    return lambda seqs, n: plan


def run_to_completion(
    engine: CascadeEngine, seqs: list[Seq], plan: Plan | Callable[[int], Plan] | None = None,
    on_tokens: Callable[[Seq, list[int]], None] | None = None,
) -> None:
    """Step until every sequence finishes, then free them on every level.

    `plan` may be a callable (a planner): it is asked for the plan of every round with the batch size (a `Planning`
    one with the rows' `Backlog` too: its first group's plan runs the round).
    """
    plan_of = round_plans(engine, plan)
    try:
        while any(not s.finished for s in seqs):
            new = engine.step(seqs, plan_of(seqs, sum(not s.finished for s in seqs)))
            if on_tokens is not None:
                for s, toks in zip(seqs, new):
                    if toks:
                        on_tokens(s, toks)
    finally:
        for s in seqs:
            engine.release(s)
