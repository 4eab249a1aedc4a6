"""Each prompt streamed to the app of serve_config.yaml on :8000: time to first token and ms per chunk.

    .venv/bin/python served_streamed.py code,extraction,chat none,auto 1   # sets, methods, 1: reset the prefix cache
"""

import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from prompts import SETS

sets, methods, reset = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3] == "1"
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
for name in sets:
    for i, text in enumerate(SETS[name]):
        for method in methods:
            if reset:
                httpx.post("http://127.0.0.1:8000/reset_prefix_cache", timeout=60).raise_for_status()
            t0, stamps = time.perf_counter(), []
            stream = client.chat.completions.create(
                model="qwen2.5-coder-1.5b-instruct", messages=[{"role": "user", "content": text}], max_tokens=96,
                temperature=0, stream=True, extra_body={"speculation": {"method": method}})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter() - t0)
            per = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
            print(f"{name} #{i} {method:5s} ttft {stamps[0]:6.2f}s  chunks {len(stamps)}  {per * 1000:6.1f} ms/chunk  "
                  f"total {stamps[-1]:6.2f}s", flush=True)
