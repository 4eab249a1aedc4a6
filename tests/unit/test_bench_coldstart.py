"""benchmarks/bench_coldstart.py: the feed's events logged alike for the planners and the fixed modes, and
`time_split`'s account of where a request's wall time went."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.scheduler import Speculation
from specray.spec.ngram import NgramConfig
from specray.testing.fake import FakeWorker

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_coldstart.py"
_spec = importlib.util.spec_from_file_location("bench_coldstart", _PATH)
cold = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cold)

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]


def _levels() -> list[Level]:
    return [Level("ngram", ngram=NgramConfig(4, 1, 3), k=4), Level("target", worker=FakeWorker("target", vocab=16))]


def _serve(engine, planner, log, mode: str, spec) -> dict:
    log.append({"ev": "request", "repeat": 0, "workload": "w", "prompt": 0, "mode": mode})
    n, sec = asyncio.run(cold._generate(engine, planner, None, (), PROMPT, 12, spec))
    return {"repeat": 0, "workload": "w", "prompt": 0, "mode": mode, "tokens": n, "seconds": sec}


def test_planner_and_fixed_mode_logs_split_their_wall_time():
    levels = _levels()
    planner = cold.LoggedPlanner(levels, k_max=4)
    engine = CascadeEngine(levels)
    adaptive = _serve(engine, planner.attach(engine), planner.log, "adaptive", None)
    fixed_engine, recorder = CascadeEngine(levels), cold.Recorder()
    fixed_engine.observers.append(recorder)
    fixed = _serve(fixed_engine, None, recorder.log, "ngram", Speculation("ngram"))
    assert {ev["ev"] for ev in recorder.log} >= {"call", "host"}
    assert {ev["ev"] for ev in planner.log} >= {"plan", "host"}
    split = cold.time_split([adaptive, fixed], [planner.log, recorder.log])
    for name, row in (("w adaptive", adaptive), ("w ngram", fixed)):
        t = split[name]
        assert t["tokens"] == row["tokens"] == 12 and t["wall"] == row["seconds"] > 0
        calls = sum(c["s"] for c in t["calls"].values())
        assert abs(t["wall"] - (t["host"] + calls + t["rest"])) < 1e-9 and t["rest"] >= -1e-3
    assert split["w ngram"]["rounds"] == sum(1 for ev in recorder.log if ev["ev"] == "host") > 0
