"""Idle app: CPU and context switches (wakeups) per process over 30 s, per env variant (JSON in argv)."""

import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from served_app import descendants, processes, serve_run  # noqa: E402


def switches(pid):
    tot = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                for line in open(f"/proc/{pid}/task/{tid}/status"):  # noqa: SIM115
                    if "ctxt_switches" in line:
                        tot += int(line.split()[1])
            except OSError:
                pass
    except OSError:
        pass
    return tot


base = dict(os.environ)
for spec in sys.argv[1:]:
    env = json.loads(spec)
    os.environ.clear()
    os.environ.update(base)
    os.environ.update(env)
    with serve_run(ROOT / "serve_config.yaml", 900) as app:
        httpx.post(
            app.url + "/v1/chat/completions",
            json={"model": app.model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
            timeout=300,
        )
        time.sleep(15)
        pids = descendants(app.pid)
        a = processes()
        sa = {p: switches(p) for p in pids}
        t = time.monotonic()
        time.sleep(30)
        b = processes()
        sb = {p: switches(p) for p in pids}
        dt = time.monotonic() - t
        rows = []
        for p in pids:
            if p in a and p in b:
                try:
                    c = open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:50].strip()  # noqa: SIM115
                except OSError:
                    c = "?"
                if "raylet" in c:
                    c = "raylet"
                if "gcs_server" in c:
                    c = "gcs_server"
                rows.append(((b[p][1] - a[p][1]) / dt, (sb[p] - sa[p]) / dt, c))
        print(f"== {env}: {sum(r[0] for r in rows):.2f} cores, {sum(r[1] for r in rows):.0f} switches/s", flush=True)
        for cpu, w, c in sorted(rows, key=lambda r: -r[1])[:12]:
            print(f"   {cpu:.3f} cores {w:7.0f}/s  {c}", flush=True)
