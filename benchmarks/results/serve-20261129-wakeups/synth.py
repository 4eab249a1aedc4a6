"""vLLM's plain loop alone vs beside a synthetic background: N processes waking every P ms for W ms of work."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_serve import Peer  # noqa: E402
from prompts import SETS  # noqa: E402

BG = "import time,os\nwhile True:\n    t=time.perf_counter()\n    while time.perf_counter()-t<%f: pass\n    time.sleep(%f)\n"  # noqa: E501


def start_bg(n, work_ms, period_ms, pol):
    ps = []
    for _ in range(n):
        p = subprocess.Popen([sys.executable, "-c", BG % (work_ms / 1e3, (period_ms - work_ms) / 1e3)])
        if pol == "idle":
            os.sched_setscheduler(p.pid, os.SCHED_IDLE, os.sched_param(0))
        if pol == "nice19":
            os.setpriority(os.PRIO_PROCESS, p.pid, 19)
        ps.append(p)
    return ps


texts = SETS["code"][:2] + SETS["chat"][:2]
peer = Peer("qwen2.5-coder-1.5b-instruct", "plain", 2, 0.0)
peer.ask(0, "Say hi.", 8)
acc = {}
modes = os.environ.get("MODES", "alone,normal,idle,nice19").split(",")
nproc, work, period = int(os.environ.get("NP", "6")), float(os.environ.get("W", "1")), float(os.environ.get("P", "40"))
for rep in range(2):
    for i, t in enumerate(texts):
        for m in modes if (i + rep) % 2 == 0 else modes[::-1]:
            ps = [] if m == "alone" else start_bg(nproc, work, period, m)
            time.sleep(0.5)
            n, dt = peer.ask(i, t, 32)
            for p in ps:
                p.kill()
            for p in ps:
                p.wait()
            c = acc.setdefault(m, [0, 0.0])
            c[0] += n
            c[1] += dt
            print(rep, i, m, round(n / dt, 2), flush=True)
peer.engine.close()
print(
    {k: round(v[0] / v[1], 2) for k, v in acc.items()},
    f"bg {nproc} x {work}ms/{period}ms = {nproc * work / period:.2f} cores",
)
