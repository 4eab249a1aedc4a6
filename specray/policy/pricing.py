"""The planner's price of a plan: expected committed tokens per sequence and seconds per round, from live
measurements (`Pricing`, a part of `specray.policy.planner.Planner` that reads its `Measurements`).

Goodput of a plan at batch B is E[L] * B / T_round, extended to cascades:

- plain decoding [target]: E[L] = 1, T_round = T_t(B, 1).
- [d(K), target]: E[L] = 1 + sum_{i<=K} prod_{j<=i} alpha_j(target | d), T_round = P_d(K) + T_t(B, K+1), where
  P_d(K), the cost for d to produce K tokens, is K * T_d(B, 1) for a model and ~0 for the n-gram. An n-gram
  drafts nothing for a row without a match, so its T_t(B, K+1) becomes (1 - u) T_t(B, K+1) + u T_t(B, 1), u =
  (1 - m)^B the chance that no row matched at match rate m (`match_rate`, prior 1).
- N levels l_0 < ... < l_m (target l_m), K_i proposed by l_i to l_{i+1}: a middle level l_i (i >= 1)
  produces K_i tokens in ceil(K_i / E_i) inner rounds with E_i = E[L](alpha(l_i | l_{i-1}), K_{i-1}), each
  costing P_{l_{i-1}}(K_{i-1}) + T_{l_i}(B, K_{i-1}+1); so recursively
  P_{l_i}(K_i) = ceil(K_i / E_i) * (P_{l_{i-1}}(K_{i-1}) + T_{l_i}(B, K_{i-1}+1)), and
  T_round = P_{l_{m-1}}(K_{m-1}) + T_t(B, K_{m-1}+1) + H, E[L] = E[L](alpha(t | l_{m-1}), K_{m-1}).
- H (`host`), in every T_round: the coordinator's own seconds per round outside the workers' calls (lookups,
  drafts, syncs, the verdict, the feed), measured per kind of round (the plan's drafting levels; plain decoding
  is one kind) and batch bucket (`specray.policy.host`), plus the configured `overhead`. Negligible on a CPU step,
  a share of a GPU step, and larger for a speculative round than a plain one.

Native target (a vLLM engine with its own speculative_config, `specray.engine.vllm_native`): its plain plan
is vLLM speculating by itself, so E[L] = E[L](alpha(t | t), K_native) with alpha measured from the engine's
own per-step acceptance (`on_native`; a request's first step, a prefill that cannot draft, is left out), and
T_round = N_t(B, q_native): N_t is a separate `StepCost` fitted on calls made only of native steps (the
engine's own decode path costs far less than specray's verification through prompt scoring on the same
engine), q_native the decayed mean of the tokens fed per row (1 + the longest native draft of the step).
It competes with specray's drafters like any other plan; its regime is still 'none' (the target alone).
A target with a live decode path but no speculation of its own (a `vllm` worker serving plain rows from
requests kept alive in its scheduler) gets the same separate curve: T_round(plain) = N_t(B, 1), E[L] = 1.
A target that verifies drafts inside its engine (`engine_verify` = E tokens per step) prices the verification
of K drafted tokens on that curve too: ceil(K / E) * N_t(B, min(K, E) + 1).

Hybrid [lookup(K_l) | d(K_d), target] (`Plan.hybrid`): a row takes the lookup's match when it has one (rate m,
learned as a decayed share of the rows a lookup looked at), else d's draft. E[L] = m * E[L | match](K_l) +
(1 - m) * E[L](alpha(t | d), K_d), with E[L | match] from the acceptance of matched rows only; T_round =
P_lookup + (1 - m^B) * K_d * T_d(ceil((1 - m) B), 1) + T_t(B, K + 1), K = K_l when every row matched (probability
m^B), else max(K_l, K_d). Never overlapped (the engine runs hybrid plans immediate).

Token trees (`Plan.tree`): a suffix level 0 drafting trees of width w (at most w children per node, K nodes) for a
level v that verifies them (the target, or a middle model in its inner rounds), or a model level with a tree shape
(`Level.tree`: width w, depth D = the shape's or K, at most N nodes) drafting first, directly for a target that
verifies trees, is priced like its chain with two measurements of its own per (v, drafter, w): E[L] = 1 +
sum_{i<=D} prod_{j<=i} beta_j (D = K for a suffix tree), beta_j the decayed chance that at depth j some child of the
walk's node is accepted (given depths 1..j-1 were; a walk that ends at a leaf before the node budget, or for a model
tree before its depth, counts a failure after it), and v's forward costs T_v(B, n + 1), n the decayed mean of the
largest tree a call fed (the node budget until measured) instead of K + 1. A suffix level's chain of such a pair is
priced at the decayed mean of its longest draft per call the same way (a suffix level often drafts fewer than K); a
model level fills its K. A model tree's proposal is D forwards of the drafter, depth d feeding the nodes on the
paths to the frontier it expands (`specray.spec.params.tree_feeds`: 1 at the root, then min(w d, N) per row):
P_d(tree) = sum_d T_d(B, q_d), on the drafter's curve, which timed tree proposals feed at those sizes
(`Planner.on_propose_tree`). A tree round also measures the chain along the first children (what a chain
verification accepts of it), so the chain of the same level stays priced while trees run; the planner ranks both
(widths {1, configured}) and picks by goodput. Tree rounds draft before the verification (never overlapped), and
their plans are priced on the scalar path (`_tree_priced`), not by `specray.policy.chains`.

Confidence-stopped drafts (a model level with `Level.confidence` > 0 ends a row's draft after a token it is unsure
of): asked for K, it drafts D(B, K) = E[longest draft of the call] tokens (`Pricing.draft_lengths`, from the
measured chance that a draft goes on past each position, `Measurements.stops`), so its proposal costs D steps (a
middle level: ceil(D / E_i) inner rounds), and the target's verification is priced at its expected time over the
longest draft of the call, E[V(D)] = V(0) + sum_{i<=K} P(D >= i) (V(i) - V(i - 1)) with V(j) the target verifying j
draft tokens per row (`verify_times`): a CPU engine's step does not grow linearly with the tokens it verifies (its
matrix kernels take rows in blocks), and priced at V(round(E[D])), one K more or less flipped the price by a block.
Its acceptance counts a draft that stopped short and was accepted whole as a failure after it (the round ended
there), so E[L](K) is what such rounds emit. Priced at K instead, a level that drafts two or three tokens of a K of
16 looked several times dearer than it is, and its long K were never chosen. (Overlapped rounds are priced as
before.) An n-gram level that caps a draft by its match's length (`NgramConfig.max_spec_factor`) is measured and
priced the same way, a row drafting only where it matched (P(D >= i) = 1 - (1 - m S_i)^B at match rate m, S_i the
chance a matched row's draft reaches i; V(0): a plain step), and a capped draft accepted whole ended its round.

Overlap (an engine drafting the next round while the target verifies, `specray.coordinator.lookahead`): a
bounded look-ahead is priced as a hit/miss renewal chain (`Pricing._bounded`): a miss drafts one drafter step
before the verification, a hit verifies what the drafter made during the previous verification; unbounded:
T_round = (1 - hit) * P(K) + max(T_t(B, K+1), P(K+1)), hit = prod alpha_1..K+1.

Catch-up (`catch_up_time`): a model drafter that sat out rounds, or never saw a row, first brings its cache up to
date on that row's text, a prefill-sized forward no step prices. Its rate per token is measured on such calls
(`Measurements.on_catch_up`; before that, the target's prefill rate scaled by their decode steps). The planner
weighs it against the rows' remaining tokens R (`Planner.plan` with a `Backlog`): a plan of goodput g that must
first catch up for C seconds finishes R tokens at R / (R / g + C).

T_level(B, q) comes from `StepCost` (live fit per level), alpha from `Acceptance` (live, per pair). Plain
decoding is always a candidate, so speculation is only chosen where it is predicted to win; regimes
(cascade at small B, one drafter at medium, none at large) fall out of the measurements.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from specray.coordinator.state import Plan
from specray.spec.params import tree_feeds

if TYPE_CHECKING:
    from specray.policy.measurements import Measurements

__all__ = ["Pricing"]


def _effective(plan: Plan) -> list[int]:
    """Indices into plan.levels that actually run: below a level with K = 0 nothing is asked to draft."""
    eff = [len(plan.levels) - 1]
    for i in range(len(plan.levels) - 2, -1, -1):
        if plan.k[i] == 0:
            break
        eff.append(i)
    return eff[::-1]


class Pricing:
    """The goodput model over `measured` (the planner's live measurements: step-cost fits, acceptances, trees, the
    native target; `measured.memo` holds the predictions, cleared by every measurement), with the round's fixed
    costs (`overhead`, added to the measured host time: `host`; `ngram_cost`) and the engine's overlap settings
    (`overlap`, `bounded`, `ahead_chunk`: set by `Planner.attach`)."""

    def __init__(self, measured: Measurements, *, overhead: float, ngram_cost: float, rejection_top: bool) -> None:
        self.measured = measured
        self.overhead, self.ngram_cost = overhead, ngram_cost
        #: the target verifies by rejection sampling: the engine does not overlap its rounds (lookahead.py)
        self.rejection_top = rejection_top
        #: the engine drafts the next round while the target verifies (round_time prices it), its look-ahead stops
        #: once the target has verified (`bounded`), a first model level stopping every `ahead_chunk` steps
        #: (CascadeEngine.ahead_bounded / ahead_chunk)
        self.overlap = False
        self.bounded = False
        self.ahead_chunk = 2

    def pairs(self, plan: Plan) -> list[tuple[int, int]]:
        """The (verifier, drafter) pairs a round of `plan` measures (a hybrid plan: both drafters, for the target)."""
        if plan.hybrid:
            return [(plan.levels[-1], plan.levels[0]), (plan.levels[-1], plan.levels[1])]
        eff = _effective(plan)
        return [(plan.levels[eff[j + 1]], plan.levels[eff[j]]) for j in range(len(eff) - 1)]

    def drafters(self, plan: Plan) -> frozenset[int]:
        """The model levels below the target that a round of `plan` runs (a lookup level keeps no state)."""
        return frozenset(lo for _up, lo in self.pairs(plan) if not self.measured.is_ngram[lo])

    def items(self, plan: Plan) -> list[tuple[int, ...]]:
        """What a round of `plan` measures: its pairs, and (verifier, 0, width) where its first level drafts trees
        (a tree round measures its chain pair too: `Measurements.on_tree`)."""
        items: list[tuple[int, ...]] = list(self.pairs(plan))
        width = self.width(plan, 0)
        if width > 1:
            items.append((plan.levels[1], plan.levels[0], width))
        return items

    def step_time(self, level: int, batch: int, tokens: int) -> float:
        """Predicted seconds of one forward of `level` (memoised until the next measurement)."""
        m = self.measured
        if m.is_ngram[level]:
            return self.ngram_cost
        key = ("t", level, batch, tokens)
        t = m.memo.get(key)
        if t is None:
            t = m.memo[key] = m.costs[level].predict(batch, tokens)
        return t

    def _elen(self, level: int, lower: int, k: int, width: int = 1) -> float:
        """E[L] of `level` verifying k drafted tokens from `lower` (width > 1: a tree of k nodes at most from a suffix
        level, of `_tree_depth` levels from a model level)."""
        m = self.measured
        key = ("e", level, lower, k, width)
        e = m.memo.get(key)
        if e is None:
            if width > 1:
                e = m.tree_acceptance[(level, lower, width)].expected_length(self._tree_depth(lower, k))
            else:
                e = m.expected_lengths((level, lower), k)[-1] if k > 0 else 1.0
            m.memo[key] = e
        return e

    def width(self, plan: Plan, i: int) -> int:
        """Children per node of what plan.levels[i] drafts: > 1 only for a first level that drafts token trees (a
        suffix level 0, or a model level with a tree shape) for the level above it, which verifies them
        (`Plan.tree`, 0: the level's configured width)."""
        m = self.measured
        if i != 0 or plan.hybrid or len(plan.levels) < 2:
            return 1
        first = plan.levels[0]
        configured = m.tree_widths.get(first, 1)
        if configured <= 1:
            return 1
        width = plan.tree or configured
        return width if width > 1 and (plan.levels[1], first, width) in m.tree_acceptance else 1

    def _tree_depth(self, lower: int, k: int) -> int:
        """Levels of a tree `lower` drafts in a plan giving it K = k: its shape's depth (else k) for a model level;
        a suffix level's trees are bounded by their k nodes only."""
        m = self.measured
        shape = m.tree_shapes.get(lower)
        return k if shape is None else shape.depth_for(k)

    def _tree_budget(self, lower: int, k: int, width: int) -> int:
        """Node budget of a tree of width `width` that `lower` drafts with K = k (`Drafter.tree_shape`)."""
        m = self.measured
        shape = m.tree_shapes.get(lower)
        if shape is None:
            return k
        depth = shape.depth_for(k)
        return shape.nodes_for(depth) if width == shape.width else width * depth

    def _tree_priced(self, plan: Plan) -> bool:
        """Whether a plan's price reads token-tree measurements (a suffix level 0 that drafts trees, anywhere in the
        plan; a model level's trees): priced on the scalar path, not by `specray.policy.chains`."""
        m = self.measured
        return (m.suffix_trees and plan.levels[0] == 0) or self.width(plan, 0) > 1

    def _fed(self, level: int, lower: int, k: int, width: int) -> int:
        """Tokens per row of `level`'s forward verifying a k-token draft of `lower`: k + 1 for a chain; for a tree
        its nodes + 1, the nodes being the decayed mean of the largest tree per call (the node budget until
        measured). A suffix level's chain of a pair that also drafts trees is priced the same way (what its chain
        rounds fed), so that the two compare at what each feeds."""
        m = self.measured
        if width <= 1 and not m.chain_fed(level, lower):
            return k + 1
        cap = self._tree_budget(lower, k, width) if width > 1 else k
        nodes = m.tree_nodes.get((level, lower, max(width, 1)))
        return (cap if nodes is None else max(1, min(cap, round(nodes)))) + 1

    def _propose_tree(self, level: int, batch: int, k: int, width: int) -> float:
        """Seconds for model level `level` to draft a tree of width `width` with K = k: a forward per depth, each
        feeding the paths to the nodes it expands (`tree_feeds`)."""
        m = self.measured
        key = ("pt", level, batch, k, width)
        t = m.memo.get(key)
        if t is None:
            feeds = tree_feeds(self._tree_depth(level, k), width, self._tree_budget(level, k, width))
            t = m.memo[key] = sum(self.step_time(level, batch, q) for q in feeds)
        return t

    def alphas(self, level: int, lower: int, k: int) -> list[float]:
        """Current per-position acceptance estimates of `lower`'s drafts by `level` (memoised like the rest: many
        candidate plans share a pair and K; callers must not modify the list)."""
        m = self.measured
        key = ("a", level, lower, k)
        a = m.memo.get(key)
        if a is None:
            a = m.memo[key] = m.acceptance[(level, lower)].alphas(k)
        return a

    def draft_lengths(self, level: int, batch: int, k_max: int) -> list[float]:
        """Expected longest draft of a call over `batch` rows when model `level` is asked for K tokens, at index
        K = 0..k_max: K, unless the level stops at a token it is unsure of (`Measurements.stops`), then
        sum_{i<=K} 1 - (1 - S_i)^B, S_i = prod_{j<i} c_j the measured chance that a draft reaches position i. Its
        proposal runs that many steps (a middle level: that many tokens of inner rounds); the target's verification
        is priced over the same reach probabilities (`verify_times`). Memoised; callers must not modify the list."""
        if not self.stops(level):
            return [float(k) for k in range(k_max + 1)]
        key = ("dl", level, batch, k_max)
        out = self.measured.memo.get(key)
        if out is None:
            out, reach, total = [0.0], 1.0, 0.0
            for c in self.measured.stops[level].alphas(k_max):
                total += 1.0 - (1.0 - reach) ** batch
                out.append(total)
                reach *= c
            self.measured.memo[key] = out
        return out

    def drafted(self, level: int, batch: int, k: int) -> float:
        """`draft_lengths(level, batch, k)[k]`: the expected longest draft when asked for k tokens (k itself for a
        level that fills its K, without building the list)."""
        if not self.stops(level):
            return float(k)
        return self.draft_lengths(level, batch, k)[k]

    def stops(self, level: int) -> bool:
        """Whether `level`'s drafts are measured to stop short of their K (`Measurements.stops`)."""
        stops = self.measured.stops.get(level)
        return stops is not None and bool(stops.n_obs)

    def verify_times(self, level: int, batch: int, k_max: int) -> list[float]:
        """For a level that stops short (`stops`): the target's expected seconds verifying its drafts when it is
        asked for K = 0..k_max tokens, over the longest draft D of the call: V(0) + sum_{i<=K} P(D >= i) (V(i) -
        V(i - 1)), P(D >= i) = 1 - (1 - m S_i)^B (m: the lookup's match rate, 1 for a model level; S_i the measured
        chance that a draft reaches position i), V(j) `_verify_time` and V(0) a plain step (module docstring).
        Memoised; callers must not modify the list."""
        m = self.measured
        match = min(max(self.match_rate(prior=1.0), 0.0), 1.0) if m.is_ngram[level] else 1.0
        key = ("vt", level, batch, k_max, match)
        out = m.memo.get(key)
        if out is None:
            total = before = self.plain_verify_time(batch)
            out, reach = [total], 1.0
            for i, c in enumerate(m.stops[level].alphas(k_max), start=1):
                v = self._verify_time(batch, i)
                total += (1.0 - (1.0 - match * reach) ** batch) * (v - before)
                out.append(total)
                before, reach = v, reach * c
            m.memo[key] = out
        return out

    def stopping_verify_times(self, level: int, batch: int, k_max: int) -> list[float]:
        """`verify_times` over at least the K the planner considers: one list per level and batch, which the scalar
        and the vectorised ranking (`specray.policy.chains`) both read."""
        return self.verify_times(level, batch, max(k_max, max(self.measured.k_choices)))

    def _stopping_verify_time(self, level: int, batch: int, k: int) -> float:
        return self.stopping_verify_times(level, batch, k)[k]

    def _produce(self, plan: Plan, i: int, batch: int, want: int) -> float:
        """Expected seconds for plan.levels[i] to produce `want` tokens for the level above it."""
        m = self.measured
        if want <= 0:
            return 0.0
        lvl = plan.levels[i]
        if i == 0:
            if m.is_ngram[lvl]:
                return self.ngram_cost
            width = self.width(plan, 0)
            if width > 1:
                return self._propose_tree(lvl, batch, want, width)
            return self.drafted(lvl, batch, want) * self.step_time(lvl, batch, 1)
        k_low, low, width = plan.k[i - 1], plan.levels[i - 1], self.width(plan, i - 1)
        e = self._elen(lvl, low, k_low, width)
        inner = math.ceil(self.drafted(lvl, batch, want) / e - 1e-9)
        return inner * (self._produce(plan, i - 1, batch, k_low) +
                        self.step_time(lvl, batch, self._fed(lvl, low, k_low, width)))

    def match_rate(self, prior: float | None = None) -> float:
        """The share of rows on which the lookup level (level 0) finds a match: decayed counts over the rounds
        in which it drafted, with `prior` (default `prior_match`) as two pseudo-rows. An n-gram chain's
        verification is priced with prior 1 (every row feeding K + 1 until measured), so an unmeasured lookup
        is not priced as free."""
        m = self.measured
        hits, rows = m.match
        return (hits + 2.0 * (m.prior_match if prior is None else prior)) / (rows + 2.0)

    def plain_verify_time(self, batch: int) -> float:
        """The target's step when no row has a draft: on the engine's decode path where it has one."""
        m = self.measured
        if m.native_cost is None or not m.engine_verify:
            return self.step_time(m.top, batch, 1)
        key = ("v0", batch)
        t = m.memo.get(key)
        if t is None:
            t = m.memo[key] = m.native_cost.predict(batch, 1)
        return t

    def catch_up_rate(self, level: int) -> float:
        """Seconds per token for model `level` to catch up on text it lacks (`Measurements.on_catch_up`); until it
        has caught up on a row, the target's rate scaled by the ratio of their decode steps; until the target has
        either, the level's fitted cost per token."""
        m = self.measured
        rec = m.catch_up.get(level)
        if rec is not None and rec[0] >= 1.0:
            return rec[1] / rec[0]
        top = m.catch_up.get(m.top)
        if level != m.top and top is not None and top[0] >= 1.0:
            plain = self.plain_verify_time(1)
            return top[1] / top[0] * (self.step_time(level, 1, 1) / plain if plain > 0 else 1.0)
        return m.costs[level].coefficients[1]

    def catch_up_time(self, drafters: Iterable[int], uncovered: Mapping[int, int]) -> float:
        """Seconds a plan's first round spends bringing its model `drafters` up to date on the `uncovered` tokens
        (`specray.coordinator.state.Backlog`) before its own work (the target is in step under every plan)."""
        return sum(uncovered.get(i, 0) * self.catch_up_rate(i) for i in drafters
                   if uncovered.get(i, 0) > 0 and not self.measured.is_ngram[i])

    def _lookup_verify_time(self, batch: int, k: int) -> float:
        """The target verifying an n-gram level's K-token drafts: a row without a match drafts nothing, so a call
        in which no row matched (probability (1 - m)^B at match rate m) is a plain step, not a K + 1 one. Priced
        at K + 1 regardless, a lookup that matches half the time looked dearer the longer its K, and on a CPU
        target, whose step grows with the tokens fed, the planner held K short into copies. A level that caps its
        drafts by their match's length (`Level.stops_drafts`) is priced over the lengths its drafts run to
        (`verify_times`)."""
        if self.stops(0):
            return self._stopping_verify_time(0, batch, k)
        none = (1.0 - self.match_rate(prior=1.0)) ** batch
        return (1.0 - none) * self._verify_time(batch, k) + none * self.plain_verify_time(batch)

    def _hybrid(self, plan: Plan, batch: int) -> tuple[float, float]:
        """(E[L], T) of a round of a hybrid plan (module docstring)."""
        memo = self.measured.memo
        key = ("h", plan, batch)
        got = memo.get(key)
        if got is not None:
            return got
        (look, model, top), (k_l, k_d) = plan.levels, plan.k
        m = min(max(self.match_rate(), 0.0), 1.0)
        e_match = memo.get(("em", top, look, k_l))
        if e_match is None:
            acc = self.measured.matched.get((top, look))
            e_match = memo[("em", top, look, k_l)] = acc.expected_length(k_l) if acc is not None else 1.0
        elen = m * e_match + (1.0 - m) * self._elen(top, model, k_d)
        all_matched = m**batch
        unmatched = max(1, math.ceil((1.0 - m) * batch - 1e-9))
        propose = self.drafted(model, unmatched, k_d) * self.step_time(model, unmatched, 1)
        verify = all_matched * self._verify_time(batch, k_l) + (1.0 - all_matched) * self._verify_time(
            batch, max(k_l, k_d))
        got = memo[key] = (elen, self.ngram_cost + (1.0 - all_matched) * propose + verify + self.host(plan, batch))
        return got

    def host(self, plan: Plan, batch: int) -> float:
        """Seconds a round of `plan` spends outside the workers' calls: the configured `overhead` plus the
        coordinator's own work measured for rounds drafted by the same levels at this batch size
        (`specray.policy.host`)."""
        return self.host_of(plan.drafting, batch)

    def host_of(self, drafting: tuple[int, ...], batch: int) -> float:
        """`host` for a round drafted by `drafting` (() plain decoding)."""
        return self.overhead + self.measured.host_time(drafting, batch)

    def round_time(self, plan: Plan, batch: int) -> float:
        """Expected seconds of one round of `plan` over `batch` sequences (module docstring)."""
        m = self.measured
        if plan.hybrid:
            return self._hybrid(plan, batch)[1]
        if len(plan.levels) == 1 or plan.k[-1] == 0:
            if m.native_cost is not None:
                q = max(1, round(m.native_q))
                key = ("n", batch, q)
                t = m.memo.get(key)
                if t is None:
                    t = m.memo[key] = m.native_cost.predict(batch, q)
                return t + self.host(plan, batch)
            return self.step_time(m.top, batch, 1) + self.host(plan, batch)
        k = plan.k[-1]
        if self._overlapped(plan):
            if self.bounded:
                return self._bounded(plan, batch)[1] + self.host(plan, batch)
            # unbounded overlap: the levels below draft K + 1 ahead while the target verifies; the next
            # round skips drafting when all K and the bonus token match (probability ~ prod alpha_1..K+1)
            produce = self._produce(plan, len(plan.levels) - 2, batch, k)
            verify = self._verify_time(batch, k)
            ahead = self._produce(plan, len(plan.levels) - 2, batch, k + 1)
            hit = math.prod(self.alphas(m.top, plan.levels[-2], k + 1))
            return (1.0 - hit) * produce + max(verify, ahead) + self.host(plan, batch)
        width, lower = self.width(plan, len(plan.levels) - 2), plan.levels[-2]
        if width > 1 or m.chain_fed(m.top, lower):  # priced at what it feeds
            verify = self.step_time(m.top, batch, self._fed(m.top, lower, k, width))
        elif m.is_ngram[lower]:
            verify = self._lookup_verify_time(batch, k)
        elif self.stops(lower):
            verify = self._stopping_verify_time(lower, batch, k)
        else:
            verify = self._verify_time(batch, k)
        return self._produce(plan, len(plan.levels) - 2, batch, k) + verify + self.host(plan, batch)

    def _overlapped(self, plan: Plan) -> bool:
        """Whether the engine drafts this plan's next round while the target verifies (lookahead.py)."""
        m = self.measured
        eff = _effective(plan)
        return (self.overlap and not self.rejection_top and len(eff) > 1 and not plan.hybrid
                and any(not m.is_ngram[plan.levels[j]] for j in eff[:-1])
                and self.width(plan, len(plan.levels) - 2) <= 1)  # a target's tree round drafts first

    def _bounded(self, plan: Plan, batch: int) -> tuple[float, float]:
        """(E[L], T) per round of an overlapped plan whose look-ahead stops once the target has verified.

        The drafter d (the level below the target) works in steps: a first model level in calls of
        `ahead_chunk` proposals, a middle level in inner rounds (its drafter's K_low tokens, then its check,
        yielding E_in = E[L](alpha(d | low), K_low)). A round whose look-ahead missed drafts one step (D_M tokens)
        before the target verifies; a round after a hit drafts nothing and uses the look-ahead made beside the
        previous verification: the steps d started within that verification's time V(D), at most K + 1 tokens,
        so D' = min(K, made - 1). Each round's look-ahead runs beside the target and is waited for only to
        the end of its step in progress. A hit (probability prod alpha_1..D+1: all D drafts and the bonus
        token match) moves the row to D', a miss back to D_M: a renewal chain D_M -> f(D_M) -> f(f(D_M)) ...
        (f converges in a few rounds), whose stationary law gives E[L] and T. At batch B the one-step draft is
        paid when any row missed: 1 - P(hit)^B (verification padding is not priced). Rows whose draft length
        changes their output for a seed (deterministic verification at T > 0) are not bounded by the engine;
        they are priced as bounded too (the planner does not see sampling per row)."""
        m = self.measured
        key = ("b", plan, batch)
        got = m.memo.get(key)
        if got is not None:
            return got
        k, top = plan.k[-1], m.top
        i = len(plan.levels) - 2
        d = plan.levels[i]
        if i == 0:  # the first model level: a step is one call of ahead_chunk proposals
            step_tokens = float(self.ahead_chunk)
            step_time = self.ahead_chunk * self.step_time(d, batch, 1)
        else:
            k_low, low, width = plan.k[i - 1], plan.levels[i - 1], self.width(plan, i - 1)
            step_tokens = self._elen(d, low, k_low, width)
            step_time = self._produce(plan, i - 1, batch, k_low) + self.step_time(
                d, batch, self._fed(d, low, k_low, width))
        alphas = self.alphas(top, d, k + 1)
        prefix = list(itertools.accumulate(alphas, lambda a, b: a * b))  # prod alpha_1..j, j = 1..K+1
        full_steps = math.ceil((k + 1) / step_tokens - 1e-9)

        def state(n: int, drafted: bool) -> tuple[float, float, int]:
            """(E[L], seconds, next draft length on a hit) of a round verifying an n-token draft."""
            verify = self._verify_time(batch, n)
            steps = min(full_steps, max(1, math.ceil(verify / step_time - 1e-9))) if step_time > 0 else full_steps
            made = min(k + 1, int(steps * step_tokens + 1e-9))
            wait = max(verify, steps * step_time)  # its step in progress ends; a full look-ahead may end sooner
            elen = 1.0 + sum(prefix[:n])
            return elen, (step_time if drafted else 0.0) + wait, min(k, made - 1)

        n = min(k, max(1, round(step_tokens)))  # a miss: one step's tokens
        reach, rounds, tokens, seconds, hits = 1.0, 0.0, 0.0, 0.0, 0.0
        drafted = True
        for _ in range(64):
            elen, t, nxt = state(n, drafted)
            h = min(prefix[n], 0.999) if nxt >= 1 else 0.0
            if not drafted and nxt == n:  # the chain's fixed point: the rest of the cycle is geometric
                reach /= 1.0 - h
            rounds += reach
            tokens += reach * elen
            seconds += reach * (t - (step_time if drafted else 0.0))
            hits += reach * h
            if not drafted and nxt == n:
                break
            reach *= h
            n, drafted = nxt, False
        p_hit = hits / rounds
        got = (tokens / rounds, seconds / rounds + step_time * (1.0 - p_hit**batch))
        m.memo[key] = got
        return got

    def _verify_time(self, batch: int, k: int) -> float:
        """The target verifying k drafted tokens per sequence: a forward pass, or engine steps (each verifying
        up to `engine_verify` tokens) on the engine's decode path."""
        m = self.measured
        if m.native_cost is None or not m.engine_verify:
            return self.step_time(m.top, batch, k + 1)
        key = ("v", batch, k)
        t = m.memo.get(key)
        if t is None:
            steps = math.ceil(k / m.engine_verify)
            t = m.memo[key] = steps * m.native_cost.predict(batch, min(k, m.engine_verify) + 1)
        return t

    def expected_length(self, plan: Plan, batch: int = 1) -> float:
        """Expected tokens committed per sequence per round (a bounded look-ahead's draft length, hence this,
        depends on the batch through the levels' speeds)."""
        m = self.measured
        if plan.hybrid:
            return self._hybrid(plan, max(1, batch))[0]
        if len(plan.levels) == 1 or plan.k[-1] == 0:
            return self._elen(m.top, m.top, m.native_k) if m.native_k else 1.0
        if self.bounded and self._overlapped(plan):
            return self._bounded(plan, max(1, batch))[0]
        return self._elen(m.top, plan.levels[-2], plan.k[-1], self.width(plan, len(plan.levels) - 2))

    def verify_goodput(self, plan: Plan, batch: int) -> float:
        """`goodput` with the plan's drafting free: what the target's verification of its K tokens allows, the
        bound no drafter's cost can raise (the planner's warm-up weighs the configured plan by it while its
        drafters' costs are priors)."""
        if len(plan.levels) == 1 or plan.k[-1] == 0 or plan.hybrid:
            return self.goodput(plan, batch)
        t = self._verify_time(batch, plan.k[-1]) + self.host(plan, batch)
        return self.expected_length(plan, batch) * batch / t if t > 0 else math.inf

    def goodput(self, plan: Plan, batch: int) -> float:
        """Expected committed tokens per second: E[L] * B / T_round."""
        t = self.round_time(plan, batch)
        return self.expected_length(plan, batch) * batch / t if t > 0 else math.inf
