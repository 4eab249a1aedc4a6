"""Live cost and acceptance models for the planner (pure Python + numpy).

`StepCost` predicts one level's forward time from few, noisy measurements; `Acceptance` tracks how often a
verifier accepts a drafter's tokens, per draft position. Both forget old data exponentially, because the
load (batch size, context length) and the text being generated drift while a server runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specray.spec.bound import expected_accepted_length

__all__ = ["Acceptance", "StepCost", "linear_cost"]

Coefs = tuple[float, float, float]


#: the fit's active sets (the coefficients left free), each as indices padded to 3 with a mask: the 7 reduced systems
#: are solved as one stack of 3x3 systems, each padded with an identity block (zeros elsewhere), which leaves the
#: LU arithmetic on the reduced block as it is
_SETS = [list(c) for r in range(1, 4) for c in itertools.combinations(range(3), r)]
_SET_IDX = np.array([[*c, *[0] * (3 - len(c))] for c in _SETS], dtype=np.intp)  # (7, 3)
_SET_MASK = np.array([[j < len(c) for j in range(3)] for c in _SETS])  # (7, 3)
_SET_MASK2 = _SET_MASK[:, :, None] & _SET_MASK[:, None, :]  # (7, 3, 3)
_SET_PAD = np.where(~_SET_MASK[:, :, None] & np.eye(3, dtype=bool), 1.0, 0.0)  # (7, 3, 3)


def _features(batch: int, tokens: int) -> list[float]:
    return [1.0, float(batch * tokens), float(batch)]


def linear_cost(a: float, b: float, c: float = 0.0) -> Callable[[int, int], float]:
    """A synthetic step-time curve t(B, q) = a + b*B*q + c*B (tests and simulations)."""
    return lambda batch, tokens: a + b * batch * tokens + c * batch


@dataclass(slots=True)
class ExtraTokens:
    """One batch size's calls of several tokens per row, decayed per such call (`StepCost._batch_slope`): their
    weight, seconds and extra tokens fed (weighted sums), the most tokens per row, the batch's clock at the latest;
    and over the calls made once its plain step was measured, their weight and that plain step's mean then."""

    w: float = 0.0
    wt: float = 0.0
    wq: float = 0.0
    q_top: int = 0
    stamp: int = 0
    w_then: float = 0.0
    plain_then: float = 0.0


class StepCost:
    """Predicted time of one forward of a level over `batch` sequences of `tokens` new tokens each.

    Model: t = a + b*(B*q) + c*B with a, b, c >= 0. `a` is the fixed per-call cost (launch, RPC, weight
    reads: dominant on a GPU at small B*q, which makes the curve flat), `b` the compute per token
    (dominant on a CPU, where 9 tokens cost ~3-4x one), `c` the per-sequence cost (KV reads, sampling).
    The fit is an exponentially weighted least squares solved exactly under the sign constraints, with a
    weak ridge towards the prior's *shape* rescaled to the measured level, so a single measured (B, q)
    already gives a sensible curve and directions the data do not pin down stay at the prior. Where a
    (B, q) was measured recently, its decayed mean is blended in (1 pseudo-observation of the fit), which
    covers curves that are not linear (a GPU that is flat up to a knee; a CPU engine whose cost per token fed
    doubles from batch 1 to 4). "Recently" counts calls at that batch size only: a server that spends minutes at
    batch 1 keeps what it measured at batch 4, which one curve over every batch size prices worse.

    `prior` is (a, b, c) or a callable returning it (e.g. a fraction of the target's live fit), used
    as-is before any measurement.

    Beyond the most tokens per row measured (`q_seen`), the curve grows from its value there by the smaller of the
    fitted per-token cost and the prior shape's at the measured level: optimistic until measured. A slope fitted
    from calls of 1 and 2 tokens is extrapolated to 9 or 17, and such calls are often slowed by something else
    than their tokens (a drafter running beside them on the same cores, a request's first decode steps); priced
    high there, the plans that would measure the larger sizes never run, while priced low they run once and are
    measured. Never lower, though, than `slope_floor`: a per-token cost measured on the level's large calls (its
    prefills, `Measurements.on_catch_up`), which no contention inflates. Calls of one token per row say nothing
    about the cost per token, and the prior's shape alone (flat, as on a GPU) prices a 17-token verification on a
    CPU at a plain step's cost, a round that costs three at batch 4.

    One slope for every batch size is wrong on a CPU engine: there a 5-token verification costs about a plain step at
    batch 1 and twice one at batch 4. So each batch size where calls of several tokens per row were measured keeps
    its own cost per extra token fed (a decayed ratio of the seconds beyond that batch's plain step to the extra
    tokens, aged only by such calls), and the curve at that batch is its plain step plus that slope, even below
    `slope_floor` up to the most tokens per row measured there (a prompt's cost per token includes a new row's setup,
    which a verification does not pay: floored, a 2-token verification on a small CPU model was priced 1.2x a plain
    step that it cost 1.05x of, and lookup rounds lost to plain decoding they beat). Between two
    measured batch sizes the slope is interpolated; above the largest it is at least the largest's (the cost per
    token grows with the batch on both a CPU and a GPU); below the smallest the fit prices it, optimistic until
    measured. "Beyond that batch's plain step": the one priced now while those calls are fresh (noise in the plain
    price then moves the whole curve, not the price of the verifications measured beside it), and the plain step's
    measured mean when they ran as the batch's later calls of one token per row age them. A held plain plan makes no
    new such call, and a cold start's slow first steps fade from the plain step but not from verifications measured
    then: against the plain step priced now, those grew dearer as plain steps got faster, and held plain decoding.
    """

    def __init__(
        self,
        prior: Coefs | Callable[[], Coefs] = (1.0, 0.02, 0.0),
        decay: float = 0.97,
        table_decay: float = 0.9,
        ridge: float = 1e-3,
    ) -> None:
        if not (0.0 < decay <= 1.0 and 0.0 < table_decay <= 1.0):
            raise ValueError("decays must be in (0, 1]")
        self._prior = prior
        self.decay, self.table_decay, self.ridge = decay, table_decay, ridge
        # the sums are plain floats, updated element by element (the arithmetic numpy would do, without its per-call
        # cost: an update per timed call), and made arrays only for the solve
        self._A = [[0.0] * 3 for _ in range(3)]  # sum w x x^T
        self._v = [0.0] * 3  # sum w x t
        self._w = 0.0  # sum w
        self._wt = 0.0  # sum w t
        self._wx = [0.0] * 3  # sum w x (to rescale the prior)
        self._table: dict[tuple[int, int], list[float]] = {}  # (B, q) -> [weight, weighted sum, stamp]
        self._clocks: dict[int, int] = {}  # batch size -> calls measured at it (the table's clock)
        #: batch size -> its calls of q > 1 tokens per row: the batch's own cost per extra token fed (`_batch_slope`)
        self._extra: dict[int, ExtraTokens] = {}
        #: `_batch_slope`'s measured slopes and the fit they were taken against, until the next measurement
        self._slopes: tuple[Coefs, dict[int, float]] | None = None
        self.n_obs = 0
        self.q_seen = 0  # the most tokens per row of any call measured
        self.slope_floor = 0.0  # seconds per token fed, the least the curve grows by beyond q_seen (class docstring)
        self._cache: tuple[Coefs, Coefs, float] | None = None  # (prior used, fitted, the prior shape's slope)

    @property
    def prior(self) -> Coefs:
        p = self._prior() if callable(self._prior) else self._prior
        return (float(p[0]), float(p[1]), float(p[2]))

    def observe(self, batch: int, tokens: int, seconds: float, weight: float = 1.0) -> None:
        """One measured forward (a propose of k steps is k forwards of (B, 1): pass seconds / k, weight k)."""
        if batch <= 0 or tokens <= 0 or weight <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        x = _features(batch, tokens)
        d = self.decay
        ws = weight * seconds
        self._A = [[a * d + weight * (xi * xj) for a, xj in zip(row, x)] for row, xi in zip(self._A, x)]
        self._v = [v * d + ws * xi for v, xi in zip(self._v, x)]
        self._wx = [v * d + weight * xi for v, xi in zip(self._wx, x)]
        self._w = self._w * d + weight
        self._wt = self._wt * d + weight * seconds
        clock = self._clocks[batch] = self._clocks.get(batch, 0) + 1
        if tokens > 1:
            self._observe_extra(batch, tokens, seconds, weight, clock)
        self.q_seen = max(self.q_seen, tokens)
        entry = self._table.get((batch, tokens))
        if entry is None:
            self._table[(batch, tokens)] = [weight, weight * seconds, float(clock)]
        else:
            f = self.table_decay ** (clock - entry[2])
            entry[0] = entry[0] * f + weight
            entry[1] = entry[1] * f + weight * seconds
            entry[2] = float(clock)
        self.n_obs += 1
        self._cache = self._slopes = None

    def _observe_extra(self, batch: int, tokens: int, seconds: float, weight: float, clock: int) -> None:
        """A call of several tokens per row into its batch's record, beside the plain step measured then
        (`_batch_slope`)."""
        rec = self._extra.get(batch)
        if rec is None:
            rec = self._extra[batch] = ExtraTokens()
        plain = self._mean(batch, 1)
        f = self.table_decay
        rec.w = rec.w * f + weight
        rec.wt = rec.wt * f + weight * seconds
        rec.wq = rec.wq * f + weight * (tokens - 1)
        rec.q_top = max(rec.q_top, tokens)
        rec.stamp = clock
        rec.w_then *= f
        rec.plain_then *= f
        if plain is not None:
            rec.w_then += weight
            rec.plain_then += weight * plain

    @property
    def coefficients(self) -> Coefs:
        """The fitted (a, b, c); the prior before any measurement."""
        return self._fitted()[0]

    def _fitted(self) -> tuple[Coefs, float]:
        """(the fit, the per-token cost b of the prior's shape rescaled to the measurements)."""
        prior = self.prior
        if self._w <= 0:
            return prior, prior[1]
        if self._cache is not None and self._cache[0] == prior:
            return self._cache[1], self._cache[2]
        fit, ref_b = self._solve(prior)
        self._cache = (prior, fit, ref_b)
        return fit, ref_b

    def _solve(self, prior: Coefs) -> tuple[Coefs, float]:
        denom = float(np.array(self._wx) @ np.array(prior))
        ref = [x * (self._wt / denom) for x in prior] if denom > 0 else prior
        # ridge in units of each feature's mean square, so it is scale-free and only breaks ties (element by element
        # on floats: A + lam diag(m), v + lam m ref)
        A, w = self._A, self._w
        m = [max(A[i][i] / w, 1e-12) for i in range(3)]
        lam = self.ridge * w
        H = np.array([[a + lam * m[i] if i == j else a for j, a in enumerate(row)] for i, row in enumerate(A)])
        g = np.array([vi + lam * mi * ri for vi, mi, ri in zip(self._v, m, ref)])
        best, best_val = np.zeros(3), 0.0  # theta = 0 is feasible with objective 0
        # each active set's equality-constrained optimum (all 7 in one stacked solve; one by one where one of them
        # is singular, skipping it); the best feasible one wins
        try:
            stack = np.linalg.solve(np.where(_SET_MASK2, H[_SET_IDX[:, :, None], _SET_IDX[:, None, :]], _SET_PAD),
                                    np.where(_SET_MASK, g[_SET_IDX], 0.0)[..., None])[..., 0]
            sols: list[list[float] | None] = [row[:len(idx)] for row, idx in zip(stack.tolist(), _SETS)]
        except np.linalg.LinAlgError:
            sols = [self._solve_one(H, g, idx) for idx in _SETS]
        for idx, sol in zip(_SETS, sols):
            if sol is None or any(x < -1e-15 for x in sol):
                continue
            theta = np.zeros(3)
            theta[idx] = np.maximum(sol, 0.0)
            val = float(theta @ H @ theta - 2.0 * theta @ g)
            if val < best_val:
                best, best_val = theta, val
        return (float(best[0]), float(best[1]), float(best[2])), float(ref[1])

    @staticmethod
    def _solve_one(H: np.ndarray, g: np.ndarray, idx: list[int]) -> list[float] | None:
        try:
            return np.linalg.solve(H[np.ix_(idx, idx)], g[idx]).tolist()
        except np.linalg.LinAlgError:
            return None

    def predict(self, batch: int, tokens: int) -> float:
        """Expected seconds for one forward of (batch, tokens)."""
        coefs, ref_b = self._fitted()
        own = self._batch_slope(batch, coefs) if tokens > 1 else None
        if own is not None:  # the batch's own slope from its plain step (class docstring)
            slope, q_top = own
            return self._blend(batch, tokens, self._line(coefs, ref_b, batch, slope, q_top, tokens))
        if 0 < self.q_seen < tokens:  # beyond the sizes measured: optimistic (class docstring)
            slope = max(min(coefs[1], ref_b), self.slope_floor)
            return self._predict(coefs, batch, self.q_seen) + slope * batch * (tokens - self.q_seen)
        return self._predict(coefs, batch, tokens)

    def predict_many(self, batch: int, tokens: np.ndarray) -> np.ndarray:
        """[predict(batch, q) for q in tokens] (tokens: (n,) ints) as an (n,) array: the same operations on arrays."""
        coefs, _ = self._fitted()
        a, b, c = coefs
        own = self._batch_slope(batch, coefs)
        if own is not None:
            out = self._predict(coefs, batch, 1) + own[0] * batch * (tokens - 1)
            top = own[1]
        else:
            out = a + b * batch * tokens + c * batch
            top = self.q_seen if self.q_seen > 0 else None
        for j, q in enumerate(tokens.tolist()):
            if (batch, q) in self._table or (own is not None and q <= 1) or (top is not None and q > top):
                out[j] = self.predict(batch, q)  # measured recently (the blend with its decayed mean), a plain step
        return out                           # beside the batch's own slope, or beyond the sizes measured: as predict

    def _line(self, coefs: Coefs, ref_b: float, batch: int, slope: float, q_top: int, tokens: int) -> float:
        """The batch's plain step plus `slope` per extra token fed up to `q_top` tokens per row, and beyond that as
        optimistic as the fit's extrapolation (class docstring)."""
        out = self._predict(coefs, batch, 1) + slope * batch * (min(tokens, q_top) - 1)
        if tokens > q_top:
            out += max(min(slope, coefs[1], ref_b), self.slope_floor) * batch * (tokens - q_top)
        return out

    def _batch_slope(self, batch: int, coefs: Coefs) -> tuple[float, int] | None:
        """(the cost per extra token fed at `batch`, the most tokens per row it holds for) from the batch sizes where
        calls of several tokens were measured (class docstring); None where the fit prices it."""
        if self._slopes is not None and self._slopes[0] == coefs:
            measured = self._slopes[1]
        else:  # once per measurement (or refit prior), not per prediction: a ranking asks for many
            measured = {}
            self._slopes = (coefs, measured)
            for bb, rec in self._extra.items():
                if rec.w >= 0.5 and rec.wq > 0:  # at least half a decayed call
                    excess = rec.wt - self._predict(coefs, bb, 1) * rec.w
                    now = self._mean(bb, 1)
                    if now is not None and rec.w_then > 0:  # the plain step's drift since, as the calls age
                        # (docstring): squared, so a plain probe between verifications barely counts (its noise is no
                        # drift) and twenty plain rounds nearly all the way
                        aged = (1.0 - self.table_decay ** (self._clocks[bb] - rec.stamp)) ** 2
                        excess -= aged * (rec.plain_then - now * rec.w_then)
                    measured[bb] = max(0.0, excess / (bb * rec.wq))
        if not measured:
            return None
        if batch in measured:
            return measured[batch], self._extra[batch].q_top
        below = [bb for bb in measured if bb < batch]
        above = [bb for bb in measured if bb > batch]
        if below and above:
            lo, hi = max(below), min(above)
            return measured[lo] + (measured[hi] - measured[lo]) * (batch - lo) / (hi - lo), self.q_seen
        if below:
            return max(measured[max(below)], coefs[1]), self.q_seen
        return None

    def _mean(self, batch: int, tokens: int) -> float | None:
        """The decayed mean of the calls measured at (batch, tokens); None before the first."""
        entry = self._table.get((batch, tokens))
        return entry[1] / entry[0] if entry is not None and entry[0] > 0 else None

    def _predict(self, coefs: Coefs, batch: int, tokens: int) -> float:
        a, b, c = coefs
        return self._blend(batch, tokens, a + b * batch * tokens + c * batch)

    def _blend(self, batch: int, tokens: int, model: float) -> float:
        """`model` with the decayed mean measured at (batch, tokens) blended in (1 pseudo-observation of the model)."""
        entry = self._table.get((batch, tokens))  # one lookup: a ranking prices many (B, q)
        if entry is None or entry[0] <= 0:
            return model
        w = entry[0] * self.table_decay ** (self._clocks.get(batch, 0) - entry[2])
        return (entry[1] / entry[0] * w + model) / (w + 1.0)


def _add_prefix_counts(values: np.ndarray, ends: list[int]) -> np.ndarray:
    """`values` with 1.0 added to values[:m] once per count ends[m], as repeated additions of 1.0."""
    out = values.tolist()
    rows = 0
    for j in range(len(ends) - 1, 0, -1):  # rows whose prefix covers position j - 1
        rows += ends[j]
        if rows and j - 1 < len(out):
            x = out[j - 1]
            for _ in range(rows):
                x += 1.0
            out[j - 1] = x
    return np.array(out)


class Acceptance:
    """Decayed per-position conditional acceptance of one (verifier, drafter) pair.

    alpha_j = P(draft token j accepted | tokens 1..j-1 accepted). Estimates shrink in two steps, so K can
    be chosen beyond the positions measured so far: a pooled rate over all positions with a Beta prior
    (`prior_mean`, `prior_strength` pseudo-trials), then each measured position towards the pooled rate with
    `pos_strength` pseudo-trials. A position not measured (less than one decayed trial) takes the estimate
    of the deepest measured position before it, not the pooled rate: n-gram drafts' conditional acceptance
    rises with j (a copy that has started tends to go on), and with the low pooled rate a planner that ran
    K = 3 would never find out that K = 8 pays.
    A draft of length n with a accepted is a trial at positions 1..min(a+1, n) and a success at 1..a.
    """

    def __init__(
        self, prior_mean: float = 0.5, prior_strength: float = 2.0, pos_strength: float = 4.0,
        decay: float = 0.9, k_max: int = 32,
    ) -> None:
        if not 0.0 <= prior_mean <= 1.0:
            raise ValueError("prior_mean must be in [0, 1]")
        self.prior_mean, self.prior_strength, self.pos_strength = prior_mean, prior_strength, pos_strength
        self.decay = decay
        self.trials = np.zeros(k_max)
        self.successes = np.zeros(k_max)
        self.n_obs = 0

    def observe(
        self, draft_lens: Sequence[int], accepted: Sequence[int], gap: float = 1.0, proposed: int | None = None
    ) -> None:
        """One verify call (one entry per sequence). `gap`: how many rounds since the last call, so data
        from before a long pause (the pair was switched off) is forgotten faster than in steady use.
        `proposed`: tokens each row was asked for; a row that drafted fewer (an n-gram with no match) and
        had all of them accepted counts a failure at the next position, since the round ends there too."""
        f = self.decay ** min(max(gap, 0.0), 500.0)
        self.trials *= f
        self.successes *= f
        size = len(self.trials)
        # each row adds 1.0 to a prefix of trials and of successes: count the rows per prefix length, then add the
        # 1.0s position by position (one by one, as the rows would: the sums stay exactly those of a row loop)
        t_ends, s_ends = [0] * (size + 2), [0] * (size + 2)
        for n, a in zip(draft_lens, accepted):
            n = min(int(n), size)
            a = max(0, min(int(a), n))
            if proposed is not None and a == n < min(proposed, size):
                t_ends[n + 1] += 1
                s_ends[n] += 1
            elif n > 0:
                t_ends[min(a + 1, n)] += 1
                s_ends[a] += 1
        self.trials = _add_prefix_counts(self.trials, t_ends)
        self.successes = _add_prefix_counts(self.successes, s_ends)
        self.n_obs += 1

    @property
    def pooled(self) -> float:
        """The acceptance rate over all positions, shrunk to the prior."""
        s, t = float(self.successes.sum()), float(self.trials.sum())
        return (s + self.prior_mean * self.prior_strength) / (t + self.prior_strength)

    @property
    def weight(self) -> float:
        """Decayed number of position-1 trials (how much the estimate rests on data)."""
        return float(self.trials[0])

    def alphas(self, k: int) -> list[float]:
        """alpha_1..alpha_k."""
        pooled, ps = self.pooled, self.pos_strength
        trials, successes = self.trials.tolist(), self.successes.tolist()
        out: list[float] = []
        last = pooled
        for j in range(k):
            t = trials[j] if j < len(trials) else 0.0
            if j == 0 or t >= 1.0:  # measured (at least one decayed trial): shrunk to the pooled rate
                last = float((successes[j] + ps * pooled) / (t + ps))
            out.append(last)  # never (or long ago) measured: the deepest measured position's estimate
        return out

    def expected_length(self, k: int) -> float:
        """E[L] = 1 + sum_{i<=k} prod_{j<=i} alpha_j: tokens emitted per verify of a k-token draft."""
        return expected_accepted_length(self.alphas(k))

    def expected_lengths(self, k_max: int) -> list[float]:
        """[expected_length(1), ..., expected_length(k_max)] in one pass (alphas(k) is a prefix of alphas(k_max);
        the same running sums as `expected_accepted_length`, so each entry is exactly expected_length(k))."""
        out: list[float] = []
        total, survive = 1.0, 1.0
        for a in self.alphas(k_max):
            if not 0.0 <= a <= 1.0:  # NaN fails too
                expected_accepted_length([a])  # its error names the rate
            survive *= a
            total += survive
            out.append(total)
        return out
