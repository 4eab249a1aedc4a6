"""vLLM's own loop as `specray bench` runs its peer (a process of its own, OpenMP bound): plain decode ms per token.

    python peer_step.py THREADS [WORKLOAD]
"""

import statistics
import sys

from specray.bench.peers import run_vllm
from specray.bench.workloads import load_shipped, prompt_ids
from specray.engine.models import load_tokenizer, resolve_model

threads = int(sys.argv[1])
tok = load_tokenizer(resolve_model("qwen2.5-coder-1.5b-instruct"))
ids = prompt_ids(tok, load_shipped(sys.argv[2] if len(sys.argv) > 2 else "code")[0])
with open("/dev/null", "w") as quiet:
    res = run_vllm("vllm_plain", "qwen2.5-coder-1.5b-instruct", [(i, ids, 25) for i in range(4)], threads=threads,
                   log=quiet)
ms = [(r.seconds - r.ttft_s) / (r.tokens - 1) * 1000 for r in res.requests]
print(f"RESULT peer threads={threads} decode_ms {statistics.median(ms):.1f} ({' '.join(f'{x:.0f}' for x in ms)})")
