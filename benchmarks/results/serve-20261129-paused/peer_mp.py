"""vLLM's own plain loop (2 threads, greedy, 64 tokens): its default multiprocess engine against its in-process one
(VLLM_ENABLE_V1_MULTIPROCESSING=0), both engines up, asked each prompt in turn, the order swapped per prompt.
Run from the repository root: .venv/bin/python <this file>."""

import os
import sys

sys.path.insert(0, "benchmarks")
from prompts import SETS

from specray.bench.peers import VllmPeer
from specray.bench.workloads import prompt_ids
from specray.engine.models import load_tokenizer, resolve_model

model = "qwen2.5-coder-1.5b-instruct"
tok = load_tokenizer(str(resolve_model(model)))
mp = VllmPeer("vllm_plain_mp", model, threads=2, temperature=0.0)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the child process inherits it
ip = VllmPeer("vllm_plain_inproc", model, threads=2, temperature=0.0)
del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
tot = {"mp": [0, 0.0], "ip": [0, 0.0]}
i = 0
for name in ("code", "chat"):
    for text in SETS[name]:
        ids = prompt_ids(tok, {"messages": [{"role": "user", "content": text}]})
        pair = [("mp", mp), ("ip", ip)] if i % 2 == 0 else [("ip", ip), ("mp", mp)]
        for who, eng in pair:
            (r,) = eng.run([(i, ids, 64)]).requests
            tot[who][0] += r.tokens
            tot[who][1] += r.seconds
            print(f"{name} #{i} {who} {r.tokens} tok {r.seconds:.1f}s {r.tokens / r.seconds:.2f} tok/s", flush=True)
        i += 1
for who, (n, s) in tot.items():
    print(f"{who}: {n / s:.2f} tok/s")
mp.close()
ip.close()
