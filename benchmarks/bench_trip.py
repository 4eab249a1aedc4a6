"""Where one call to a level actor goes, over the direct transport, with and without polling near a due frame.

One Ray actor serves a `SimWorker` of a GPU preset (its `verify` sleeps the model's step); the driver sends it
batch-1 verifications of a 4-token draft, idle `--idle-ms` before each (as a target is while the levels below draft),
and splits each call's time with timestamps taken on both sides (one monotonic clock per box):

  client_pre    the driver's `ActorWorker.verify` until the transport sends
  to_handler    pickling, the request's trip and the actor's thread waking, unpickling
  handler_pre   the actor's dispatch until the worker's busy interval starts
  handler_post  from the busy interval's end until the reply is handed to the transport
  back          pickling, the reply's trip and the driver's thread waking, unpickling
  overhead      the call less the busy interval (everything above)

Phases alternate polling on (both ends: `specray.serve.direct.FrameClock`) and off, on the same actor and
connection, so a slow spell of the box hits both; medians per phase, then the median over the phases of each kind.
A bare echo actor's round trip (`bench_overhead.transfer_floor_ms`) is printed for scale.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_trip.py --out benchmarks/results/trip-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from specray.serve.level_actor import LevelActor  # noqa: E402

PARTS = ("client_pre", "to_handler", "handler_pre", "handler_post", "back", "overhead")


class TimedLevel(LevelActor):
    """A `LevelActor` that notes when each request's handler starts and ends, and lets the driver turn its
    server's polling on and off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marks: list[tuple[float, float]] = []

    def run(self, request: Any) -> Any:
        t0 = time.monotonic()
        out = super().run(request)
        self.marks.append((t0, time.monotonic()))
        return out

    def set_poll(self, on: bool) -> None:
        self._server.poll = on

    def take(self) -> tuple[list[tuple[float, float]], list[dict[str, Any]]]:
        marks, self.marks = self.marks, []
        return marks, self.worker.trace[-len(marks):] if marks else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-8b", help="the level's cost preset (specray.testing.sim.PRESETS)")
    ap.add_argument("--calls", type=int, default=120, help="calls per phase (the first 20 are not counted)")
    ap.add_argument("--phases", type=int, default=6, help="phases, alternating polling on / off")
    ap.add_argument("--batch", type=int, default=1, help="rows per call (each verifying a 4-token draft)")
    ap.add_argument("--idle-ms", type=float, default=8.0, help="the driver's idle time before each call")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)

    import bench_overhead as bo
    import ray

    from specray.engine.protocol import SeqSync
    from specray.serve import direct
    from specray.serve.actors import ActorWorker
    from specray.spec.params import SamplingParams, VerifyMethod
    from specray.testing.sim import PRESETS, sim_factory

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}})
    try:
        floor = bo.transfer_floor_ms()
        actor = ray.remote(num_cpus=0)(TimedLevel).remote(sim_factory("level", PRESETS[args.preset], vocab=64), 1)
        worker = ActorWorker(actor, poll=True)  # the connection asks for polling; the phases switch it
        sent: list[tuple[float, float]] = []
        begin, result = direct.FrameClient.begin, direct.PendingReply.result

        def timed_begin(self: Any, request: Any, shape: Any = None) -> Any:
            t0 = time.monotonic()
            pending = begin(self, request, shape)
            pending.trip_t0 = t0
            return pending

        def timed_result(self: Any) -> Any:
            try:
                return result(self)
            finally:
                sent.append((self.trip_t0, time.monotonic()))

        # the driver's side of each call (sent, then its reply read), in this process only
        direct.FrameClient.begin, direct.PendingReply.result = timed_begin, timed_result
        sp, prompt, b = SamplingParams(), list(range(1, 17)), args.batch
        seqs = [f"s{i}" for i in range(b)]
        first = worker.verify(seqs, [[]] * b, None, [sp] * b, VerifyMethod.GREEDY, level=1,
                              sync=[SeqSync(0, tuple(prompt))] * b)
        held = [len(prompt) + len(t) for t in first.token_ids]
        ray.get(actor.take.remote())  # not the prefill
        phases: list[dict[str, Any]] = []
        for j in range(args.phases):
            poll = j % 2 == 0
            ray.get(actor.set_poll.remote(poll))
            worker._direct.poll = poll
            sent.clear()
            outer = []
            for _ in range(args.calls):
                time.sleep(args.idle_ms / 1000)
                t0 = time.monotonic()
                worker.verify(seqs, [[1, 2, 3, 4]] * b, None, [sp] * b, VerifyMethod.GREEDY, level=1,
                              sync=[SeqSync(h, ()) for h in held])
                outer.append((t0, time.monotonic()))
            marks, trace = ray.get(actor.take.remote())
            parts: dict[str, list[float]] = {p: [] for p in PARTS}
            for (o0, o1), (c0, c1), (h0, h1), tr in list(zip(outer, sent, marks, trace))[20:]:
                busy = tr["end"] - tr["start"]
                for name, v in zip(PARTS, (c0 - o0, h0 - c0, tr["start"] - h0, h1 - tr["end"], c1 - h1,
                                           o1 - o0 - busy)):
                    parts[name].append(1000 * v)
            phase = {"poll": poll, **{p: statistics.median(v) for p, v in parts.items()}}
            phases.append(phase)
            print(("poll on " if poll else "poll off") + "  " + "  ".join(f"{p} {phase[p]:.3f}" for p in PARTS),
                  flush=True)
        summary = {kind: {p: statistics.median(ph[p] for ph in phases if ph["poll"] == (kind == "on"))
                          for p in PARTS} for kind in ("on", "off")}
        print(f"transfer floor (bare echo) {floor:.3f} ms; medians over phases, ms:")
        for kind in ("off", "on"):
            print(f"  poll {kind:3s}  " + "  ".join(f"{p} {summary[kind][p]:.3f}" for p in PARTS))
        print(f"  the client caught {worker._direct.clock.caught} of {worker._direct.clock.polled} polled replies")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"args": vars(args), "floor_ms": floor, "phases": phases,
                                                  "summary": summary}, indent=1))
            print(f"wrote {args.out}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
