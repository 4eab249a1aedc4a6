"""The coordinator's own Python per round of the in-process cascade (1B -> 8B -> 70B SimWorkers, batch 1, greedy),
with every worker call lasting `base` seconds, sleeping or spinning through it:

    .venv/bin/python benchmarks/results/overhead-20261201-follow/coldtest.py sleep 0.015
    .venv/bin/python benchmarks/results/overhead-20261201-follow/coldtest.py spin 0.015

Prints the overhead per round (wall less the workers' busy time). base 0: the same code with warm caches.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_overhead as bo  # noqa: E402

import specray.testing.sim as sim  # noqa: E402
from specray.coordinator.cascade import CascadeEngine, Level  # noqa: E402
from specray.coordinator.generate import generate  # noqa: E402
from specray.testing.sim import SimWorker, StepCostModel  # noqa: E402


class _SpinClock:
    """`time` for the SimWorkers, whose sleep spins instead (the thread never idles)."""

    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def sleep(dt: float) -> None:
        end = time.monotonic() + dt
        while time.monotonic() < end:
            pass


def main() -> None:
    mode, base = sys.argv[1], float(sys.argv[2])
    if mode == "spin":
        sim.time = _SpinClock()
    specs = bo.PRESET_LEVELS["gpu"]
    workers = [SimWorker(s.name, StepCostModel(base, 0.0, "flat"), **s.worker_kwargs()) for s in specs]
    engine = CascadeEngine([Level(w.name, worker=w, k=4, method="greedy") for w in workers])
    prompts = bo.make_prompts(1)
    generate(engine, prompts, max_tokens=8, ignore_eos=True)
    for w in workers:
        w.clear_trace()
    t0 = time.monotonic()
    out = generate(engine, prompts, max_tokens=300, ignore_eos=True)
    t1 = time.monotonic()
    recs = [r for w in workers for r in w.trace]
    rounds = max(r.rounds for r in out.results)
    busy = bo.union_length([(r["start"], r["end"]) for r in recs if r["kind"] in bo.MODEL_KINDS], t0, t1)
    print(f"{mode} base {base * 1000:.1f} ms: overhead/round {1000 * (t1 - t0 - busy) / rounds:.3f} ms")


if __name__ == "__main__":
    main()
