"""One round, top to bottom: the plan's levels draft, the target verifies every row in one batched call, the
rows commit what it emitted, and the statistics are recorded.

    r = new_round(rows, plan, override, sources)     # the round's state, built once
    drafts = r.source.drafts(r)                      # made now (a middle level runs inner rounds), or drafted
                                                     #   during the previous round's verification (overlap)
    ahead = r.source.start_ahead(r, drafts)          # overlap: the next round's drafts beside the verification
    result = calls.verify(target, rows, drafts)      # accept a prefix + one correction/bonus token per row
                                                     #   (relayed: the level below sent the target its drafts
                                                     #   itself, and the round only waits for the verdict)
    looks = r.source.settle(r, ahead)                # the look-ahead stops at its next step
    commit, record, keep the look-ahead that continues the committed text
    calls.feed.shadowed(rows, plan)                  # an n-gram level the target did not verify: its shadow drafts

A suffix level with `tree_width` > 1, or a model level with a `tree` shape (`Drafter.tree_shape`; the request's
`tree` overrides it), under a target that scores token trees drafts a tree per row instead, and the target
verifies them (`LevelCalls.verify_tree`: the accepted path plus one token, committed like a chain's emitted
tokens); under a middle model that scores trees, a suffix level's trees are verified in its inner rounds. Target
tree rounds always run immediate (`new_round`), so the look-ahead of chain plans is untouched.

A target that verifies inside its engine step (`Level.engine_verify`: a vLLM level) prefills a new sequence in a
step that verifies no draft, so the sequence's first round there goes without one (`_unprefilled`).

A hybrid plan drafts per row (the lookup's match, else the model's draft: `Drafter.hybrid`), still with one
verification; statistics are recorded under each row's own drafter.

Level i's accepted stream is an exact sample from level i, so the target's stream is an exact sample from the
target (lossless); plain decoding is the same round with the target alone. Who talks to the workers and how:
`specray.coordinator.calls`; the drafting levels: `specray.coordinator.drafting`; overlap:
`specray.coordinator.lookahead`; a level failing: `specray.coordinator.failover` (the engine retries the round
without it).
"""

from __future__ import annotations

from collections.abc import Sequence

from specray.coordinator.calls import LevelCalls
from specray.coordinator.drafting import Immediate, RoundState
from specray.coordinator.feed import fed_lengths
from specray.coordinator.lookahead import LookAhead
from specray.coordinator.state import Plan, Seq
from specray.coordinator.stats import drafter_of, stats_for
from specray.spec.params import TreeShape, VerifyMethod

__all__ = ["new_round", "run_round"]


def new_round(
    rows: Sequence[Seq], plan: Plan, override: VerifyMethod | None, immediate: Immediate, lookahead: LookAhead,
    tree: TreeShape | None = None,
) -> RoundState:
    """The state of one round over the active `rows`: the draft length each row gets (its K, never past its
    length limit) and where the drafts come from (`tree`: the request's token-tree shape, None: the levels')."""
    k = (max(plan.k) if plan.hybrid else plan.k[-1]) if len(plan.levels) > 1 else 0
    want = [max(0, min(k, s.remaining - 1)) for s in rows]
    r = RoundState(list(rows), plan, override, immediate, want, tree=tree)
    unfilled = _unprefilled(r, immediate.drafter.calls) if r.speculative else set()
    shape = immediate.drafter.tree_shape(r, len(plan.levels) - 2) if r.speculative else None
    if shape is None and lookahead.overlaps(plan, override):
        r = RoundState(list(rows), plan, override, lookahead, want, tree=tree)
        lookahead.prepare(r)  # cold rows and the look-ahead's stop signal
    elif shape is not None:
        r.tree_width = shape.width  # a tree round: drafted now (the look-ahead drafts chains)
    for b in unfilled:
        r.want[b] = 0
    return r


def _unprefilled(r: RoundState, calls: LevelCalls) -> set[int]:
    """Rows whose first step at a target that verifies drafts inside its engine step (`Level.engine_verify`) is
    this round's: that step prefills the prompt and can verify no draft, so a draft would only hold the first
    token back by one more step (vLLM's own loop drafts from the second step on too). Those rows go without a
    draft; the next round drafts from the longer text, in as many engine steps. Only rows whose output for a
    seed cannot depend on a draft (greedy, or no seed given) and that the target serves in its step (not coupled
    verification, which it scores)."""
    top = calls.levels[r.top]
    if top.engine_verify <= 0:
        return set()
    coupled = calls.method(r.top, r.lower, r.override) is VerifyMethod.COUPLED
    return {b for b, s in enumerate(r.rows)
            if r.want[b] > 0 and not calls.holds(r.top, s)
            and (s.sampling.greedy or (not s.sampling.reproducible and not coupled))}


def run_round(r: RoundState, calls: LevelCalls) -> dict[str, list[int]]:
    """Draft -> verify at the target -> commit -> record; returns the tokens newly committed to each row."""
    drafts = r.source.drafts(r)
    ahead = r.source.start_ahead(r, drafts)
    # what each row was asked for, for the planner: a look-ahead's drafts are also cut by its own stop
    asked = None if isinstance(r.source, LookAhead) else r.want
    try:
        if r.relayed is not None:  # the middle level sent its drafts to the target itself (`Drafter._nested`)
            res = calls.finish_relayed(r.top, r.lower, r.rows, r.relayed, drafts.token_ids, asked=asked)
        elif drafts.trees is not None:  # token trees (`Drafter.tree_shape`)
            res = calls.verify_tree(r.top, r.lower, r.rows, drafts.trees, drafts.probs, r.override,
                                    width=r.tree_width)
        else:
            res = calls.verify(r.top, r.verify_lower, r.rows, [[] for _ in r.rows], drafts.token_ids, drafts.probs,
                               r.override, drafters=r.drafters, asked=asked)
    finally:
        looks = r.source.settle(r, ahead)  # never leave a look-ahead running past the round
    fed = fed_lengths(res, drafts.token_ids)  # a native target's own drafts count on rows it got none
    committed: dict[str, list[int]] = {}
    for b, s in enumerate(r.rows):
        toks = res.token_ids[b]
        new = committed[s.seq_id] = s.commit(toks)
        if res.logprobs is not None and res.logprobs[b]:
            s.logprobs.extend(res.logprobs[b][: len(new)])
        s.rounds += 1
        lower = r.drafters[b] if r.drafters is not None else r.lower  # a hybrid round: each row's own drafter
        who = drafter_of(lower, bool(drafts.token_ids[b]), res.native_drafts is not None)
        tree = drafts.trees[b] if drafts.trees is not None else None
        stats_for(s.stats, (r.top, who)).record(
            fed[b], res.num_accepted[b], len(toks), tree.max_depth if tree is not None else None)
        r.source.keep(r, b, s, looks.get(b), len(drafts.token_ids[b]), res, new)
    calls.feed.shadowed(r.rows, r.plan)  # the n-gram's acceptance where this round did not ask it (feed.py)
    return committed
