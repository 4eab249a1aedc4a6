"""benchmarks/served_app.py's `paused`: what bench_serve stops while vLLM's own loop answers beside the app."""

from __future__ import annotations

import subprocess
import sys
import time

from tests._bench import load_bench


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _spin_tree() -> subprocess.Popen:
    """A parent that starts a busy child and a sleeping one, then waits."""
    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'while True: pass']),\n"
            "        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])]\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_paused_stops_a_process_tree_uses_no_cpu_meanwhile_and_continues_it():
    app = load_bench("served_app")
    proc = _spin_tree()
    try:
        pids = app.tree(proc.pid)
        assert len(pids) == 3  # the parent and both children
        with app.paused(proc.pid) as stopped:
            assert stopped == pids
            time.sleep(0.2)  # a stop signal lands asynchronously
            assert {_state(p) for p in pids} == {"T"}
            before = app.processes()
            time.sleep(0.5)
            after = app.processes()
            assert sum(after[p][1] - before[p][1] for p in pids) < 0.02  # the spinning child included
        time.sleep(0.2)
        assert "T" not in {_state(p) for p in pids}
        before, deadline = app.processes(), time.monotonic() + 10
        while sum(app.processes()[p][1] - before[p][1] for p in pids) == 0:  # the spinning child runs again
            assert time.monotonic() < deadline, "the tree used no CPU after the block"
            time.sleep(0.1)
    finally:
        for p in app.tree(proc.pid):
            subprocess.run(["kill", "-9", str(p)], check=False)
        proc.wait()


def test_paused_continues_the_tree_when_the_block_raises():
    app = load_bench("served_app")
    proc = _spin_tree()
    try:
        pids = app.tree(proc.pid)
        try:
            with app.paused(proc.pid):
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
        time.sleep(0.2)
        assert "T" not in {_state(p) for p in pids}
    finally:
        for p in app.tree(proc.pid):
            subprocess.run(["kill", "-9", str(p)], check=False)
        proc.wait()
