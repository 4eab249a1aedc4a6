"""Replay the events a planner was fed (a `bench_coldstart.py` log: `coldstart-code-peek.json`) into a fresh planner
over serve_config.yaml's levels, stop at a request and round, and print what it prices there: the lookup's
acceptance (all rows, hot, cold), how far its capped drafts run, the target's step-cost table, and per K of
`ngram -> target` the drafted length, E[L], round time and goodput.

    .venv/bin/python benchmarks/results/threads-20261128-xeon/replay_planner.py \
        benchmarks/results/threads-20261128-xeon/coldstart-code-peek.json 0:10     # request 0, after 10 rounds
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specray.config import PolicyConfig
from specray.coordinator.state import Level, Plan
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.testing.fake import FakeWorker

log = json.loads(Path(sys.argv[1]).read_text())["planner_logs"][0]["log"]
want_prompt, want_rounds = (sys.argv[2].split(":") + ["0"])[:2]
levels = [Level("ngram", ngram=NgramConfig(8, 1, 4, "earliest", 2.0), k=8),
          Level("0.5b", worker=FakeWorker("d", vocab=8), k=16, confidence=0.6),
          Level("1.5b", worker=FakeWorker("t", vocab=8), engine_verify=16, live_decode=True)]
p = Planner(levels, k_max=16, **PolicyConfig(k_max=16).planner_kwargs())
prompt, rounds = None, 0
for e in log:
    ev = e["ev"]
    if ev == "request":
        prompt, rounds = str(e.get("prompt")), 0
    elif ev == "call":
        p.on_call(e["level"], e["kind"], e["batch"], e["tokens"], e["s"])
    elif ev == "verify":
        if isinstance(e.get("asked"), list):
            p.on_drafted(e["level"], e["lower"], e["lens"], e["acc"], e["asked"])
        else:
            p.on_verify(e["level"], e["lower"], e["lens"], e["acc"], e.get("asked"))
    elif ev == "shadow":
        p.on_shadow(e["level"], e["lower"], e["lens"], e["acc"], 8)
    elif ev == "native":
        p.on_native(e["level"], e["lens"], e["acc"])
    elif ev == "plan":
        rounds += 1
    if prompt == want_prompt and rounds >= int(want_rounds):
        break
m, pr, pair = p.measurements, p.pricing, (2, 0)
print("plain round", round(pr.round_time(p.plain, 1), 4), "s; match rate", round(pr.match_rate(), 3))
print("acceptance", [round(a, 2) for a in pr.alphas(*pair, 10)])
print("hot", [round(a, 2) for a in m.hot[pair].alphas(10)], "cold", [round(a, 2) for a in m.cold[pair].alphas(10)],
      "hot share", m.hot_share(pair))
print("capped drafts go on past each position", [round(a, 2) for a in m.stops[0].alphas(10)])
print("target step by tokens fed", [round(m.native_cost.predict(1, q), 4) for q in range(1, 11)])
for k in (1, 2, 3, 4, 5, 6, 8, 12, 16):
    plan = Plan((0, 2), (k,))
    print(f"K {k:2d}: drafted {pr.drafted(0, 1, k):.2f}  E[L] {pr.expected_length(plan, 1):.2f}  "
          f"round {pr.round_time(plan, 1) * 1000:.0f} ms  goodput {pr.goodput(plan, 1):.2f} tok/s")
