"""Does a served app come back from `served_app.paused`? Start it, pause its process tree 40 s and 100 s, ask after
each (run from the repository root: RAY_AUTH_MODE=disabled .venv/bin/python <this file>)."""

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, "benchmarks")
from served_app import paused, processes, serve_run, tree

with serve_run(Path("serve_config.yaml"), 900) as (url, model, pid):
    procs = processes()
    names = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in tree(pid, procs)}
    print(len(names), "processes:", sorted(set(names.values())))
    c = httpx.Client(base_url=url, timeout=600)
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
    print(c.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"])
    for secs in (40, 100):
        with paused(pid) as stopped:
            time.sleep(secs)
        print("paused", len(stopped), "processes for", secs, "s")
        t0 = time.time()
        r = c.post("/v1/chat/completions", json=body)
        print(r.status_code, r.json()["usage"]["completion_tokens"], f"{time.time() - t0:.1f}s")
    time.sleep(15)
    print("health", c.get("/health").status_code)
