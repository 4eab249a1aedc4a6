"""Sends the first N prompts of a shipped workload to a running server (greedy, 96 tokens) and prints each reply's
speculation usage and the planner's ranking from GET /health:  python probe.py code 3"""

import json
import sys
import time

import httpx

from specray.bench.workloads import load_shipped

URL = "http://127.0.0.1:8000"

rows = load_shipped(sys.argv[1])[: int(sys.argv[2])]
for row in rows:
    body = {"model": "qwen2.5-coder-1.5b-instruct", "max_tokens": 96, "temperature": 0}
    if "messages" in row:
        body["messages"] = row["messages"]
    else:
        body["messages"] = [{"role": "user", "content": row["prompt"]}]
    t = time.perf_counter()
    r = httpx.post(URL + "/v1/chat/completions", json=body, timeout=300).json()
    print(f"{time.perf_counter() - t:.1f}s", json.dumps(r["usage"].get("speculation"))[:400])
planner = httpx.get(URL + "/health").json()["planner"]
print(planner["current"])
for x in planner["ranked"]:
    print(x)
