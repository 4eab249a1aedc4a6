"""Overlap ("draft ahead") for `CascadeEngine`: the levels below the target draft the next round while the
target verifies this one.

While the target verifies this round's draft d, the levels below it already draft K + 1 tokens beyond
base + d, as if all of d were accepted, on a second thread (or, with Ray, on their own actors and devices).
When the target accepts all of d and its bonus token equals the first token of that look-ahead, the rest of it
is the next round's draft and that round skips drafting; otherwise it is dropped (the workers' mirrors roll
back on their next sync). A round then costs max(draft, verify) instead of their sum where the guess holds.
Exactness is untouched: the target verifies every draft as usual, and a look-ahead is only used as the draft
of exactly the prefix it was made from. Not with rejection verification (its drafts carry probabilities tied
to their sampling; a batch of greedy rows is verified greedily whatever the configured method,
`CascadeEngine.step`), and not when only the n-gram drafts (it costs nothing to overlap).

Bounded look-ahead (`ahead_bounded`, on by default): the look-ahead stops at the drafter's next step boundary once
the target has its verdict, with the tokens it has (K + 1 at most), and the round goes on without waiting for it; a
row whose look-ahead missed drafts one step before the target verifies (not K tokens with the target idle), and the
look-ahead beside that verification makes the rest. Where the drafter is fast (an n-gram feeding the middle level
on copied text) it still reaches K + 1; where it is slow (the small model drafting alone) the next round's draft is
what it made in the target's time, so a round costs the target's verification and the draft length follows the
speed of the two levels instead of a fixed K. Only for rows whose output for a seed cannot depend on a draft's
length: greedy rows, and coupled verification; with deterministic verification at T > 0 a shorter draft draws other
tokens (same law), so those rows draft K + 1 as before and seeded outputs stay reproducible. The law is the
target's either way: when a look-ahead stops depends on timing, never on the verification's random draws.

A new sequence's first round is the same idea with an empty draft: the target prefills the prompt and emits
one token while the drafters prefill it on the other thread and draft K + 1 tokens beyond it, instead of
prefilling first and the target after them (a 0.5B draft's prefill of a 300-token prompt is about half the
1.5B target's: serial, it added ~15% to a 96-token code edit at batch 1).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from specray.spec.params import VerifyMethod

if TYPE_CHECKING:
    from specray.coordinator.cascade import Plan, Sequence_

__all__ = ["LookAhead", "Until"]


class Until:
    """Set when the target has verified this round: the rows marked in `rows` stop drafting ahead then."""

    def __init__(self, rows: Sequence[bool], event: threading.Event | None = None) -> None:
        self.rows = list(rows)
        self._event = event or threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def select(self, idx: Sequence[int]) -> Until:
        """The same signal over a subset of the rows."""
        return Until([self.rows[b] for b in idx], self._event)


class LookAhead:
    """Mixin of `CascadeEngine` (uses its levels, `_produce`, `_propose`, `_method`, `_mark_down` and `_lock`)."""

    def _init_lookahead(self, overlap: bool) -> None:
        #: draft the next round while the target verifies this one (module docstring)
        self.overlap = overlap
        #: rows drafted ahead, and rows whose next round used that draft
        self.ahead_rows = 0
        self.ahead_hits = 0
        #: stop a look-ahead once the target has verified (module docstring); steps per drafter call when the
        #: first model level drafts ahead alone (its calls are the boundaries where it can stop)
        self.ahead_bounded = True
        self.ahead_chunk = 2
        self._ahead_pool: ThreadPoolExecutor | None = None

    def _pool(self) -> ThreadPoolExecutor:
        """One thread for drafting ahead; it runs torch ops with this thread's intra-op thread count."""
        with self._lock:  # pipelined groups may call step() from two threads
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(1, "specray-ahead", initializer=torch.set_num_threads,
                                                      initargs=(torch.get_num_threads(),))
                weakref.finalize(self, self._ahead_pool.shutdown, wait=False)
            return self._ahead_pool

    def _overlaps(self, chain: list[int], method: VerifyMethod | None) -> bool:
        """Whether a speculative round of this level chain drafts ahead."""
        return (self.overlap and not all(self.levels[i].is_ngram for i in chain[:-1])
                and self._method(chain[-1], chain[-2], method) != VerifyMethod.REJECTION)

    def _drafts(
        self, chain: list[int], active: list[Sequence_], bases: list[list[int]], want: list[int],
        ks: dict[int, int], method: VerifyMethod | None, plan: Plan | None, until: Until | None = None,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """This round's drafts for the target: drafted ahead last round where that still holds (`plan` given:
        overlap), else produced now by the levels below (only for the rows that need it). With a bounded
        look-ahead (`until`), a row without one drafts a single step now (one inner round of a middle level:
        on copied text the n-gram's whole proposal; one call of `ahead_chunk` steps of a first model level),
        not K tokens with the target idle: the look-ahead beside the target's verification makes the rest."""
        if plan is None:
            return self._produce(chain, len(chain) - 2, active, bases, want, ks, method)
        drafts: list[list[int] | None] = [None] * len(active)
        for b, s in enumerate(active):
            if s.ahead is not None and s.ahead[0] == plan and s.ahead[1] == len(s.tokens) and want[b] > 0:
                drafts[b] = s.ahead[2][: want[b]]
                self.ahead_hits += 1
            s.ahead = None
        missing = [b for b, d in enumerate(drafts) if d is None and want[b] > 0]
        if missing:
            short = Until([until.rows[b] for b in missing]) if until is not None else None
            if short is not None:
                short.set()  # already set: one step, then the look-ahead beside the target makes the rest
            made, _ = self._produce(chain, len(chain) - 2, [active[b] for b in missing],
                                    [bases[b] for b in missing], [want[b] for b in missing], ks, method, short)
            for b, d in zip(missing, made):
                drafts[b] = d
        return [d or [] for d in drafts], None

    def _propose_bounded(
        self, chain: list[int], seqs: list[Sequence_], bases: list[list[int]], want: list[int],
        override: VerifyMethod | None, until: Until,
    ) -> list[list[int]]:
        """`_propose` in calls of `ahead_chunk` steps, so that the rows `until` marks can stop between calls
        once it is set (the other rows draft the rest of want[b] in one more call); the first call always runs.
        A row that got fewer tokens than it asked for stopped by itself (`confidence`). Drafts are keyed by
        position: chunking does not change them."""
        outs: list[list[int]] = [[] for _ in seqs]
        done = [w <= 0 for w in want]
        first = True
        while True:
            late, first = until.is_set() and not first, False
            rows = [b for b in range(len(seqs)) if not done[b] and not (late and until.rows[b])]
            if not rows:
                return outs
            ask = [want[b] - len(outs[b]) if late or not until.rows[b] else
                   min(self.ahead_chunk, want[b] - len(outs[b])) for b in rows]
            prop = self._propose(chain, [seqs[b] for b in rows], [bases[b] + outs[b] for b in rows], ask, override)
            for b, a, toks in zip(rows, ask, prop.token_ids):
                outs[b].extend(toks)
                done[b] = len(toks) < a or len(outs[b]) >= want[b]

    def _until(self, chain: list[int], active: list[Sequence_], method: VerifyMethod | None) -> Until | None:
        """The stop signal of this round's look-ahead: rows whose output for a seed does not depend on their
        draft's length stop when the target has verified (greedy rows, coupled verification)."""
        if not self.ahead_bounded:
            return None
        coupled = self._method(chain[-1], chain[-2], method) == VerifyMethod.COUPLED
        return Until([coupled or s.sampling.greedy for s in active])

    def _cold_rows(
        self, chain: list[int], active: list[Sequence_], want: list[int], method: VerifyMethod | None,
    ) -> set[int]:
        """Rows that no model level below the target holds yet (a prefill there): they get no draft this round,
        and their first draft is made beside the target's prefill. Only where that cannot change the output for
        a seed: greedy rows, or coupled verification (its tokens do not depend on the drafts); deterministic
        verification at T > 0 draws differently for a draft than for a plain step (same law, other tokens)."""
        models = [i for i in chain[:-1] if not self.levels[i].is_ngram]
        if not models:
            return set()
        coupled = self._method(chain[-1], chain[-2], method) == VerifyMethod.COUPLED
        return {b for b, s in enumerate(active)
                if want[b] > 0 and (coupled or s.sampling.greedy)
                and all(s.mirror.get(i) is None or s.epoch.get(i) != self.epoch[i] for i in models)}

    def _draft_ahead(
        self, chain: list[int], active: list[Sequence_], bases: list[list[int]], drafts: list[list[int]],
        want: list[int], ks: dict[int, int], method: VerifyMethod | None, cold: set[int] = frozenset(),
        until: Until | None = None,
    ) -> dict[int, list[int]] | None:
        """The levels below the target draft K + 1 tokens beyond base + d for every row with a full draft d,
        and for the `cold` rows (no draft: the target decodes one token) beyond the base (runs beside the
        target's verification; a level failing here is dropped as in a round). Rows `until` marks stop early
        once it is set."""
        from specray.coordinator.cascade import LevelCallError

        k = ks[chain[-2]]
        # after this round a row has remaining - want - 1 tokens to go; a look-ahead of 1 token is only the bonus
        # (a draft may be shorter than asked where its drafter grew unsure: still a prefix to look beyond)
        rows = [b for b, s in enumerate(active)
                if (b in cold or drafts[b]) and s.remaining - len(drafts[b]) - 1 >= 2]
        if not rows:
            return None
        ahead_want = [min(k + 1, active[b].remaining - len(drafts[b]) - 1) for b in rows]
        try:
            made, _ = self._produce(chain, len(chain) - 2, [active[b] for b in rows],
                                    [bases[b] + drafts[b] for b in rows], ahead_want, ks, method,
                                    until.select(rows) if until is not None else None)
        except LevelCallError as exc:  # only levels below the target are called here
            self._mark_down(exc.level, exc)
            return None
        self.ahead_rows += len(rows)
        return dict(zip(rows, made))

    @staticmethod
    def _keep_lookahead(
        s: Sequence_, plan: Plan, look: list[int] | None, draft_len: int, accepted: int, toks: list[int],
        committed: list[int],
    ) -> None:
        """After the target's verdict on a row: keep its look-ahead as the next draft if it continues exactly
        the committed text (the target took the whole draft, and its bonus token is the look-ahead's first)."""
        s.ahead = None
        if (look and len(look) > 1 and not s.finished and accepted == draft_len
                and len(committed) == len(toks) == accepted + 1 and toks[-1] == look[0]):
            s.ahead = (plan, len(s.tokens), look[1:])
