"""Overlap ("draft ahead"): a `DraftSource` whose levels below the target draft the next round while the target
verifies this one.

While the target verifies this round's draft d, the levels below it already draft K + 1 tokens beyond
base + d, as if all of d were accepted, on a second thread (or, with Ray, on their own actors and devices).
When the target accepts all of d and its bonus token equals the first token of that look-ahead, the rest of it
is the next round's draft and that round skips drafting; otherwise it is dropped (the workers' mirrors roll
back on their next sync). A round then costs max(draft, verify) instead of their sum where the guess holds.
Exactness is untouched: the target verifies every draft as usual, and a look-ahead is only used as the draft
of exactly the prefix it was made from. Not with rejection verification (its drafts carry probabilities tied
to their sampling; a batch of greedy rows is verified greedily whatever the configured method,
`CascadeEngine.step`), and not when only the n-gram drafts (it costs nothing to overlap). Hybrid plans
(`Plan.hybrid`: the lookup's match per row, else the model's draft) always run immediate: which rows the model
drafts for is only known once the lookup has looked at the committed text, and a look-ahead made for the other
kind of row would be wasted (the planner prices them unoverlapped too).

Bounded look-ahead (`bounded`, on by default): the look-ahead stops at the drafter's next step boundary once
the target has its verdict, with the tokens it has (K + 1 at most), and the round goes on without waiting for it; a
row whose look-ahead missed drafts one step before the target verifies (not K tokens with the target idle), and the
look-ahead beside that verification makes the rest. Where the drafter is fast (an n-gram feeding the middle level
on copied text) it still reaches K + 1; where it is slow (the small model drafting alone) the next round's draft is
what it made in the target's time, so a round costs the target's verification and the draft length follows the
speed of the two levels instead of a fixed K. Only for rows whose output for a seed cannot depend on a draft's
length: greedy rows, coupled verification, and rows nobody can replay (`SamplingParams.reproducible` False: the
request gave no seed); with deterministic verification of a seeded row at T > 0 a shorter draft draws other tokens
(same law), so those rows draft K + 1 as before and seeded outputs stay reproducible. The law is the
target's either way: when a look-ahead stops depends on timing, never on the verification's random draws.

A new sequence's first round is the same idea with an empty draft: the target prefills the prompt and emits
one token while the drafters prefill it on the other thread and draft K + 1 tokens beyond it, instead of
prefilling first and the target after them.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from specray.coordinator.drafting import Drafter, Drafts, RoundState, Until
from specray.coordinator.failover import Failover, LevelCallError
from specray.coordinator.state import Plan, Seq
from specray.spec.params import VerifyMethod

if TYPE_CHECKING:
    from specray.engine.protocol import VerifyResult

__all__ = ["LookAhead"]


class LookAhead:
    """The overlapping draft source (module docstring). `enabled` is the engine's `overlap` setting."""

    def __init__(self, drafter: Drafter, failover: Failover, enabled: bool) -> None:
        self.drafter = drafter
        self.failover = failover
        self.enabled = enabled
        #: stop a look-ahead once the target has verified (module docstring)
        self.bounded = True
        #: rows drafted ahead, and rows whose next round used that draft
        self.ahead_rows = 0
        self.ahead_hits = 0
        self.pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def overlaps(self, plan: Plan, override: VerifyMethod | None) -> bool:
        """Whether a round of this plan drafts ahead."""
        if not self.enabled or len(plan.levels) < 2 or plan.k[-1] == 0 or plan.hybrid:
            return False
        if all(self.drafter.levels[i].is_ngram for i in plan.levels[:-1]):
            return False
        return self.drafter.calls.method(plan.levels[-1], plan.levels[-2], override) is not VerifyMethod.REJECTION

    def prepare(self, r: RoundState) -> None:
        """Rows no model level below the target holds yet get no draft this round: the drafters prefill them and
        draft beside the target's first step. Only where that cannot change the output for a seed: greedy rows,
        rows without a seed of the request's, or coupled verification (its tokens do not depend on the drafts);
        deterministic verification at T > 0 draws differently for a draft than for a plain step (same law,
        other tokens)."""
        models = [i for i in r.chain[:-1] if not self.drafter.levels[i].is_ngram]
        coupled = self._coupled(r)
        epoch = self.failover.epoch
        r.cold = {b for b, s in enumerate(r.rows)
                  if r.want[b] > 0 and (coupled or _replay_free(s))
                  and all(s.mirror.get(i) is None or s.epoch.get(i) != epoch[i] for i in models)}
        for b in r.cold:
            r.want[b] = 0
        r.until = self.until(r)

    def until(self, r: RoundState) -> Until | None:
        """The stop signal of this round's look-ahead: rows whose output for a seed does not depend on their
        draft's length stop when the target has verified (greedy rows, coupled verification)."""
        if not self.bounded:
            return None
        coupled = self._coupled(r)
        return Until([coupled or _replay_free(s) for s in r.rows])

    def _coupled(self, r: RoundState) -> bool:
        return self.drafter.calls.method(r.top, r.lower, r.override) is VerifyMethod.COUPLED

    # ----- DraftSource ----------------------------------------------------------------------------
    def drafts(self, r: RoundState) -> Drafts:
        """Drafted ahead last round where that still holds, else made now for the rows that need it. With a
        bounded look-ahead a row without one drafts a single step now (one inner round of a middle level: on
        copied text the n-gram's whole proposal; one call of `Drafter.chunk` steps of a first model level), not
        K tokens with the target idle: the look-ahead beside the target's verification makes the rest."""
        drafts: list[list[int] | None] = [None] * len(r.rows)
        for b, s in enumerate(r.rows):
            if s.ahead is not None and s.ahead[0] == r.plan and s.ahead[1] == len(s.tokens) and r.want[b] > 0:
                drafts[b] = s.ahead[2][: r.want[b]]
                self.ahead_hits += 1
            s.ahead = None
        missing = [b for b, d in enumerate(drafts) if d is None and r.want[b] > 0]
        if missing:
            short = Until([r.until.rows[b] for b in missing]) if r.until is not None else None
            if short is not None:
                short.set()  # already set: one step, then the look-ahead beside the target makes the rest
            made = self.drafter.produce(r, len(r.chain) - 2, [r.rows[b] for b in missing],
                                        [[] for _ in missing], [r.want[b] for b in missing], short)
            for b, d in zip(missing, made.token_ids):
                drafts[b] = d
        return Drafts([d or [] for d in drafts])

    def start_ahead(self, r: RoundState, drafts: Drafts) -> Future | None:
        """The levels below the target draft K + 1 tokens beyond context + d for every row with a draft d, and
        for the cold rows (no draft: the target decodes one token) beyond the context, on the look-ahead thread."""
        # after this round a row has remaining - len(d) - 1 tokens to go; a look-ahead of 1 token is only the bonus
        # (a draft may be shorter than asked where its drafter grew unsure: still a prefix to look beyond)
        idx = [b for b, s in enumerate(r.rows)
               if (b in r.cold or drafts.token_ids[b]) and s.remaining - len(drafts.token_ids[b]) - 1 >= 2]
        if not idx:
            return None
        return self._pool().submit(self._draft_ahead, r, idx, drafts)

    def _draft_ahead(self, r: RoundState, idx: list[int], drafts: Drafts) -> dict[int, list[int]] | None:
        k = r.plan.k[-1]
        want = [min(k + 1, r.rows[b].remaining - len(drafts.token_ids[b]) - 1) for b in idx]
        try:
            made = self.drafter.produce(r, len(r.chain) - 2, [r.rows[b] for b in idx],
                                        [list(drafts.token_ids[b]) for b in idx], want,
                                        r.until.select(idx) if r.until is not None else None)
        except LevelCallError as exc:  # only levels below the target are called here: drop it as in a round
            self.failover.mark_down(exc.level, exc)
            return None
        self.ahead_rows += len(idx)
        return dict(zip(idx, made.token_ids))

    def settle(self, r: RoundState, ahead: Future | None) -> dict[int, list[int]]:
        if r.until is not None:
            r.until.set()  # bounded rows of the look-ahead stop at their next step
        if ahead is None:
            return {}
        return ahead.result() or {}  # never leave it running past the round

    def keep(self, r: RoundState, b: int, s: Seq, look: list[int] | None, draft_len: int, res: VerifyResult,
             committed: list[int]) -> None:
        """Keep the look-ahead as the next draft if it continues exactly the committed text (the target took the
        whole draft, and its bonus token is the look-ahead's first)."""
        s.ahead = None
        toks, accepted = res.token_ids[b], res.num_accepted[b]
        if (look and len(look) > 1 and not s.finished and accepted == draft_len
                and len(committed) == len(toks) == accepted + 1 and toks[-1] == look[0]):
            s.ahead = (r.plan, len(s.tokens), look[1:])

    def _pool(self) -> ThreadPoolExecutor:
        """One thread for drafting ahead; it runs torch ops with this thread's intra-op thread count."""
        with self._lock:  # pipelined groups may run rounds from two threads
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, "specray-ahead", initializer=torch.set_num_threads,
                                               initargs=(torch.get_num_threads(),))
                weakref.finalize(self, self.pool.shutdown, wait=False)
            return self.pool


def _replay_free(s: Seq) -> bool:
    """A row whose output for its seed nobody can ask for again with another plan: greedy, or no seed given."""
    return s.sampling.greedy or not s.sampling.reproducible
