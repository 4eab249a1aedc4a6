"""The SLA experiment's numbers (`specray.bench.sla` runs it): Poisson arrivals, one request's record, a rate's
summary point (throughput, latency percentiles, TPOT), the latency ceiling and the headline under it.

Pure functions of the records, apart from the sending: the experiment's module docstring says what is measured and
why (TPOT over the decode window, throughput over the measured span, the default ceiling).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CEILING_FACTOR", "MODES", "RequestRecord", "best_under_ceiling", "default_ceiling", "headline", "meets",
           "percentile", "phase_rng", "poisson_arrivals", "summarize", "tpot"]

#: The two phases of each rate: the server's own speculation, and plain decoding (`speculation: none`).
MODES = ("speculation", "plain")
#: The default ceiling is this many times the P90 end-to-end latency of plain decoding at the lowest rate.
CEILING_FACTOR = 2.0


# ---------------------------------------------------------------------------------------------------- arrivals


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate` requests/s: cumulative sums of
    exponential inter-arrival times (mean 1/rate) drawn from `rng`."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def phase_rng(seed: int, rate: float, what: str) -> random.Random:
    """The generator of one rate's `what` ("arrivals", "prompts"): the same for both modes of that rate."""
    return random.Random(f"{seed}:{rate!r}:{what}")


# ----------------------------------------------------------------------------------------------------- metrics


def tpot(e2e_s: float | None, ttft_s: float | None, tokens: int) -> float | None:
    """Time per output token over the decode window: (e2e - TTFT) / (tokens - 1); None under 2 tokens."""
    if e2e_s is None or ttft_s is None or tokens < 2:
        return None
    return (e2e_s - ttft_s) / (tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default,
    "linear"); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class RequestRecord:
    """One request of a phase; times in seconds, `arrival_s` and `sent_s` from the phase's start."""

    rate: float
    mode: str
    index: int
    arrival_s: float
    sent_s: float = 0.0
    warmup: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    chunks: int = 0  # SSE chunks that carried text
    draft_tokens: int = 0  # the target's, from usage.speculation (0 when nothing was drafted: plain decoding)
    accepted_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def summarize(records: Sequence[RequestRecord], rate: float, mode: str, measured_s: float) -> dict[str, Any]:
    """One point of the curve: the measured (not warm-up) requests of one rate and mode.

    Throughput is the measured requests' output tokens (and count) over the span from the first measured send to
    the last measured completion, so requests still queued when arrivals stop are counted with the time they
    took: past saturation it stays at what the server delivers, not at the offered rate. `measured_s` is the
    length of the arrival window after warm-up (for the realized arrival rate)."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.error is None and r.e2e_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    span = max(r.sent_s + r.e2e_s for r in ok) - min(r.sent_s for r in ok) if ok else 0.0
    e2e = [r.e2e_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    chunks = sum(r.chunks for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    return {
        "rate": rate,
        "mode": mode,
        "requests": len(measured),
        "completed": len(ok),
        "errors": len(measured) - len(ok),
        "arrival_rps": len(measured) / measured_s if measured_s > 0 else None,
        "window_s": span,
        "throughput_tok_s": tokens / span if span > 0 else None,
        "throughput_req_s": len(ok) / span if span > 0 else None,
        "output_tokens": tokens,
        "mean_output_tokens": tokens / len(ok) if ok else None,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "e2e_p99_s": percentile(e2e, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_mean_s": _mean(tpots),
        "tpot_p90_s": percentile(tpots, 90),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "draft_tokens": drafted,
        "target_acceptance": sum(r.accepted_tokens for r in ok) / drafted if drafted else None,
    }


def default_ceiling(points: Sequence[dict[str, Any]], factor: float = CEILING_FACTOR) -> float | None:
    """`factor` x the P90 end-to-end latency of plain decoding at the lowest rate measured (of speculation when
    plain was not run); None when that point has no completed request."""
    for mode in ("plain", "speculation"):
        mine = [p for p in points if p["mode"] == mode and p["e2e_p90_s"] is not None]
        if mine:
            return factor * min(mine, key=lambda p: p["rate"])["e2e_p90_s"]
    return None


def meets(point: dict[str, Any], ceiling: float) -> bool:
    """A point meets the SLA when every measured request completed and its P90 e2e latency is <= ceiling."""
    return (point["completed"] > 0 and point["errors"] == 0 and point["e2e_p90_s"] is not None
            and point["e2e_p90_s"] <= ceiling)


def best_under_ceiling(points: Sequence[dict[str, Any]], mode: str, ceiling: float) -> dict[str, Any] | None:
    """The point of `mode` with the highest output tokens/s among those that meet the ceiling (`meets`)."""
    ok = [p for p in points if p["mode"] == mode and meets(p, ceiling) and p["throughput_tok_s"] is not None]
    return max(ok, key=lambda p: p["throughput_tok_s"]) if ok else None


def headline(points: Sequence[dict[str, Any]], ceiling: float | None) -> dict[str, Any]:
    """The best point of each mode under the ceiling and the ratio of their throughputs (speculation / plain)."""
    out: dict[str, Any] = {"p90_ceiling_s": ceiling}
    for mode in MODES:
        best = best_under_ceiling(points, mode, ceiling) if ceiling is not None else None
        out[mode] = None if best is None else {k: best[k] for k in (
            "rate", "throughput_tok_s", "throughput_req_s", "e2e_p90_s", "ttft_p90_s", "tpot_mean_s")}
        if best is not None:  # its limit lies above the rates tried
            out[mode]["at_highest_rate"] = best["rate"] == max(p["rate"] for p in points if p["mode"] == mode)
    spec, plain = out["speculation"], out["plain"]
    out["throughput_ratio"] = (spec["throughput_tok_s"] / plain["throughput_tok_s"]
                               if spec and plain and plain["throughput_tok_s"] else None)
    return out
