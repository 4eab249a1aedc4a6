"""The engine a user would otherwise run, measured on the same prompts: vLLM's own loop, plain and with its own
n-gram speculation (`LLM.generate`, batch 1, greedy, the model's chat template).

    .venv/bin/python benchmarks/peers.py --model qwen2.5-coder-1.5b-instruct --threads 2 --sets code extraction chat

A thin wrapper over `specray.bench.peers` (what `specray bench --peers vllm_plain vllm_ngram` runs): each mode in a
fresh process after an untimed warm-up request. (`bench_serve.py --peers` keeps such engines up beside the app
instead, `specray.bench.peers.VllmPeer`, and asks them each prompt right beside the app's requests.) Prints a JSON
object, per mode
`{"mode", "threads", "dtype", "sets": {set: {"tokens", "seconds", "tok_s"}}}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS

from specray.bench.peers import VLLM_NGRAM, run_vllm
from specray.bench.workloads import prompt_ids

__all__ = ["VLLM_NGRAM", "measure"]


def measure(model: str, modes: list[str], threads: int, sets: list[str], max_tokens: int,
            dtype: str = "bfloat16", temperature: float = 0.0) -> dict[str, dict]:
    """Each mode ("plain" or "ngram") in its own process; {mode: result}. At temperature > 0 one seed per prompt
    (its index)."""
    from specray.engine.models import load_tokenizer, resolve_model

    tok = load_tokenizer(str(resolve_model(model)))
    rows, where = [], []
    for name in sets:
        for text in SETS[name]:
            rows.append((len(rows), prompt_ids(tok, {"messages": [{"role": "user", "content": text}]}), max_tokens))
            where.append(name)
    results = {}
    for mode in modes:
        print(f"== vLLM's own loop, {mode}, {threads} threads ...", file=sys.stderr, flush=True)
        chunk = run_vllm(f"vllm_{mode}", model, rows, threads=threads, dtype=dtype, temperature=temperature)
        out: dict = {"mode": mode, "threads": threads, "dtype": dtype, "temperature": temperature, "sets": {}}
        for name in sets:
            reqs = [r for r in chunk.requests if where[r.index] == name]
            n, secs = sum(r.tokens for r in reqs), sum(r.seconds for r in reqs)
            out["sets"][name] = {"tokens": n, "seconds": secs, "tok_s": n / secs if secs else 0.0}
        results[mode] = out
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="known name, folder or hub id")
    ap.add_argument("--modes", nargs="+", default=["plain", "ngram"], choices=["plain", "ngram"])
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of the engine")
    ap.add_argument("--sets", nargs="+", default=["code", "extraction", "chat"], choices=list(SETS))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled, one seed per prompt")
    args = ap.parse_args()
    print(json.dumps(measure(args.model, args.modes, args.threads, args.sets, args.max_tokens, args.dtype,
                             args.temperature), indent=1))


if __name__ == "__main__":
    main()
