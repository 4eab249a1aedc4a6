"""vLLM's plain loop (2 threads) with the idle app stopped vs running beside it, interleaved; then specray's
`none` and served rows through the app, same prompts. Tokens/s per contender."""

import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_serve import Peer, ask  # noqa: E402
from prompts import SETS  # noqa: E402
from served_app import paused, serve_run  # noqa: E402

N = int(os.environ.get("NTOK", "32"))
extra = json.loads(os.environ.get("APPENV", "{}"))
os.environ.update(extra)
texts = SETS["code"][:2] + SETS["chat"][:2]
cfg = Path(os.environ.get("CFG", str(ROOT / "serve_config.yaml")))
acc = {}
with serve_run(cfg, 900) as app, httpx.Client(base_url=app.url, timeout=600) as client:
    ask(client, app.model, "Say hi.", 8, plain=False)
    pol = os.environ.get("POLICY", "none")
    if pol != "none":
        from served_app import descendants, processes

        procs = processes()
        keep = set()
        for p in descendants(app.pid, procs):
            try:
                cmd = open(f"/proc/{p}/cmdline").read()  # noqa: SIM115
            except OSError:
                continue
            if "LevelActor" in cmd or procs.get(p, (0,))[0] in keep:
                keep.add(p)
        n = 0
        for p in descendants(app.pid, procs):
            if p in keep:
                continue
            if pol == "keepcoord":
                try:
                    cmd = open(f"/proc/{p}/cmdline").read()  # noqa: SIM115
                except OSError:
                    continue
                if "ServeReplica" in cmd or "ProxyActor" in cmd:
                    continue
            for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
                try:
                    if pol == "nice19":
                        os.setpriority(os.PRIO_PROCESS, int(tid), 19)
                    else:
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                    n += 1
                except OSError:
                    pass
        print("policy", pol, "threads", n, "kept", len(keep), flush=True)
    with paused(app.pid):
        peer = Peer("qwen2.5-coder-1.5b-instruct", "plain", 2, 0.0)
        peer.ask(0, "Say hi.", 8)
    for rep in range(int(os.environ.get("REPS", "2"))):
        for i, t in enumerate(texts):
            order = ["alone", "beside", "none"] if (i + rep) % 2 == 0 else ["none", "beside", "alone"]
            for who in order:
                if who == "alone":
                    with paused(app.pid):
                        n, dt = peer.ask(i, t, N)
                elif who == "beside":
                    from served_app import descendants, processes

                    pa = processes()
                    t0 = time.monotonic()
                    n, dt = peer.ask(i, t, N)
                    pb = processes()
                    el = time.monotonic() - t0
                    use = []
                    for p in descendants(app.pid, pb):
                        if p in pa:
                            d = (pb[p][1] - pa[p][1]) / el
                            if d > 0.01:
                                try:
                                    c = open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:40]  # noqa: SIM115
                                except OSError:
                                    c = "?"
                                use.append((round(d, 3), c))
                    print("   app cores", round(sum(u[0] for u in use), 2), sorted(use, reverse=True)[:6], flush=True)
                else:
                    n, dt, _ = ask(client, app.model, t, N, plain=True)
                c = acc.setdefault(who, [0, 0.0])
                c[0] += n
                c[1] += dt
                print(f"{rep} {i} {who:7s} {n / dt:.2f} tok/s", flush=True)
    peer.engine.close()
print({k: round(v[0] / v[1], 2) for k, v in acc.items()}, "env", extra, "policy", os.environ.get("POLICY"))
