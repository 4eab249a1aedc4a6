"""benchmarks/bench_trip.py runs end to end on a real local Ray (a few calls; the numbers are not checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_bench_trip_splits_each_call_and_compares_polling(tmp_path):
    out = tmp_path / "trip.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trip.py"), "--calls", "30", "--phases", "2",
                           "--idle-ms", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [p["poll"] for p in doc["phases"]] == [True, False]
    for kind in ("on", "off"):
        parts = doc["summary"][kind]
        # every part of the call outside the step was measured (medians per phase: no exact sum)
        split = sum(parts[p] for p in ("client_pre", "to_handler", "handler_pre", "handler_post", "back"))
        assert parts["overhead"] > 0 and split > 0
    assert doc["floor_ms"] > 0
