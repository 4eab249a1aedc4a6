"""The native vLLM level as a baseline: vLLM's own speculation vs plain vLLM vs specray plans, one process.

    .venv/bin/python benchmarks/bench_native.py --model <folder or known name> --batch 1 4 --max-tokens 64

Every configuration runs greedy on the same two engines (a plain `VLLMWorker` and a `NativeVLLMWorker` with
n-gram speculation over the same weights), the same prompts and max tokens; outputs are checked equal. Without
--model, a tiny fp32 target whose greedy text repeats itself is built under /tmp (tied embeddings, residual
scale 8), which shows the mechanics, not real-model speed. Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate
from specray.spec.ngram import NgramConfig

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci_iter(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
    "Hello, world! Hello, world! Hello,",
]


def tiny_target() -> str:
    from specray.testing.tiny import repetitive_target

    return str(repetitive_target("/tmp/specray-bench-native"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="K of vLLM's n-gram speculation and of specray's n-gram")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs per setup, interleaved; the fastest is reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from specray.engine.vllm import VLLMWorker
    from specray.engine.vllm_native import NativeVLLMWorker
    from specray.policy.planner import Planner

    model = args.model or tiny_target()
    common = dict(name="target", dtype=args.dtype, kv_cache_bytes=256 << 20, max_context=1024, max_num_seqs=64)
    plain = VLLMWorker(model, **common)
    native = NativeVLLMWorker(model, native_speculation={"method": "ngram", "num_speculative_tokens": args.k,
                                                         "prompt_lookup_max": 4, "prompt_lookup_min": 1}, **common)
    ng = lambda: Level("ngram", ngram=NgramConfig(args.k, 1, 4))
    setups = {
        "vllm plain": ([Level("target", worker=plain)], None),
        "vllm native ngram (baseline)": ([Level("target", worker=native)], None),
        "specray ngram > vllm": ([ng(), Level("target", worker=plain)], None),
        "planner over {ngram, native}": ([ng(), Level("target", worker=native)], "auto"),
    }
    rows = []
    for batch in args.batch:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        ref = None
        runs: dict[str, list] = {name: [] for name in setups}
        for _ in range(args.repeat):
            for name, (levels, plan) in setups.items():
                engine = CascadeEngine(levels)
                planner = Planner(engine.levels, k_choices=[args.k]).attach(engine) if plan == "auto" else None
                generate(engine, prompts[:1], max_tokens=4, ignore_eos=True, plan=planner)  # warm-up
                t0 = time.perf_counter()
                out = generate(engine, prompts, max_tokens=args.max_tokens, ignore_eos=True, plan=planner)
                runs[name].append((time.perf_counter() - t0, out, planner))
        for name, results in runs.items():
            dt, out, planner = min(results, key=lambda r: r[0])
            toks = [r.token_ids for r in out.results]
            ref = ref or toks
            st = out.stats["target"]
            row = {"batch": batch, "setup": name, "seconds": round(dt, 3),
                   "tokens_per_s": round(sum(map(len, toks)) / dt, 1), "rounds": out.rounds,
                   "tokens_per_round": round(sum(map(len, toks)) / max(1, out.rounds), 2),
                   "acceptance_rate": round(st.acceptance_rate, 3),
                   "same_as_plain": all([r.token_ids for r in o.results] == ref for _, o, _ in results)}
            if planner is not None:
                row["plan_at_end"] = planner.plan_name(planner.current)
                row["native_E[L]"] = round(planner.expected_length(Plan((1,), ())), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| batch | setup | tok/s | tokens/round | acceptance | same as plain |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['setup']} | {r['tokens_per_s']} | {r['tokens_per_round']} | "
              f"{r['acceptance_rate']} | {r['same_as_plain']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    native.close()
    plain.close()


if __name__ == "__main__":
    main()
