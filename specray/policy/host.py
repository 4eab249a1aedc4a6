"""The coordinator's own time per round: what a round spends outside the workers' calls, measured per kind of round.

A round's wall time is its workers' calls (the step costs the planner fits) plus the coordinator's own work: the
n-gram lookups of every row, building drafts and syncs, reading the verdict, committing, the planner feed. On a CPU
step of hundreds of milliseconds that work is noise; on a GPU step of 3-15 ms it is not, and it differs by plan: a
speculative round does per-row work a plain round does not (`CascadeEngine.step` measures it: the round's wall time
less the time its thread spent inside worker calls, `LevelCalls.busy`). The planner adds it to every plan's round
time (`Pricing.host`), so a draft that gains fewer tokens than its lookups and bookkeeping cost is not chosen.

Kept per kind (the drafting levels of the plan: () for plain decoding) and batch bucket, as the median of the latest
rounds: one that starts rows or meets a garbage collection is an outlier, not a trend. A median needs rounds of the
kind's steady state, though: the engine does not report a round of a kind that the few rounds before it did not
run (`specray.coordinator.feed`), nor the planner its warm-up's rounds (the process's first, on cold code paths). Such
rounds cost a multiple of a steady one, and a kind probed now and then while another is held is only ever measured
on them.
"""

from __future__ import annotations

from collections import deque
from statistics import median

__all__ = ["HostTimes"]

#: rounds per (kind, bucket) whose median is the estimate
WINDOW = 15


class HostTimes:
    """Seconds of the coordinator's own work per round, by (drafting levels, batch bucket: `batch_bucket`)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._seen: dict[tuple[tuple[int, ...], int], deque[float]] = {}
        self._median: dict[tuple[tuple[int, ...], int], float] = {}

    def observe(self, drafting: tuple[int, ...], bucket: int, seconds: float) -> None:
        key = (tuple(drafting), bucket)
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self.window)
        seen.append(max(0.0, float(seconds)))
        self._median[key] = median(seen)

    def seconds(self, drafting: tuple[int, ...], bucket: int) -> float:
        """The estimate for a round drafted by `drafting` (() plain) at a batch in `bucket`: this kind's median
        there, else at the nearest bucket measured for it; a kind never measured takes plain decoding's (every
        round does at least a plain round's work); 0 when nothing is measured."""
        for kind in (tuple(drafting), ()):
            got = self._nearest(kind, bucket)
            if got is not None:
                return got
        return 0.0

    def _nearest(self, kind: tuple[int, ...], bucket: int) -> float | None:
        exact = self._median.get((kind, bucket))
        if exact is not None:
            return exact
        buckets = [b for k, b in self._median if k == kind]
        if not buckets:
            return None
        near = min(buckets, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return self._median[(kind, near)]
