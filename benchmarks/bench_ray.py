"""Per-round overhead of the Ray path and pipelined vs sequential rounds, on the same models.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_ray.py --batches 1 8 --max-tokens 32

Three runs of the same plan (draft model K -> target, greedy, batch B of code prompts):
  in-process : both models in this process (1 thread each, one after the other), `generate()`
  ray        : one Ray actor per level (1 thread each), the continuous-batching scheduler, sequential rounds
  ray+pipe   : same actors, the batch split in two halves whose rounds overlap (draft of one half while
               the target verifies the other)
Overhead per round = (wall time - time inside model forwards) / rounds. Writes benchmarks/results/ray-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS


def prompts_for(tok, batch: int) -> list[list[int]]:
    texts = (SETS["code"] + SETS["extraction"] + SETS["chat"]) * 4
    out = []
    for t in texts[:batch]:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def level_cfgs(args):
    from specray.config import CascadeConfig, LevelConfig

    common = dict(kind="hf", dtype=args.dtype, num_threads=args.threads, num_cpus=args.threads)
    return CascadeConfig(levels=[
        LevelConfig(model=args.draft, name="draft", num_speculative_tokens=args.k, **common),
        LevelConfig(model=args.target, name="target", **common),
    ])


def run_in_process(args, batches):
    import torch

    from specray.coordinator.generate import build_levels, generate

    torch.set_num_threads(args.threads)
    levels = build_levels(level_cfgs(args))
    tok = levels[-1].worker.tokenizer
    generate(levels, [prompts_for(tok, 1)[0]], max_tokens=4)  # warm up
    out = {}
    for b in batches:
        fw0 = sum(lv.worker.forward_seconds for lv in levels)
        t0 = time.perf_counter()
        res = generate(levels, prompts_for(tok, b), max_tokens=args.max_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
        fw = sum(lv.worker.forward_seconds for lv in levels) - fw0
        rounds = max(r.rounds for r in res.results)
        toks = sum(len(r.token_ids) for r in res.results)
        out[b] = {"wall": wall, "forward": fw, "rounds": rounds, "tokens": toks, "tok_s": toks / wall,
                  "overhead_per_round_ms": 1000 * (wall - fw) / rounds}
        print(f"in-process B={b}: {out[b]}", file=sys.stderr)
    for lv in levels:
        del lv.worker
    return out


async def _drive(sched, prompts, max_tokens):
    from specray.coordinator.scheduler import Request
    from specray.spec.params import SamplingParams

    async def one(p):
        n = 0
        async for ev in sched.generate(Request(p, SamplingParams(), max_tokens, ignore_eos=True)):
            n += len(ev.token_ids)
        return n

    return await asyncio.gather(*[one(p) for p in prompts])


def run_ray(args, batches):
    import ray

    from specray.coordinator.cascade import CascadeEngine
    from specray.coordinator.scheduler import Scheduler
    from specray.serve.launch import launch_levels

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    launched = launch_levels(level_cfgs(args), name_prefix=None)
    try:
        engine = CascadeEngine(launched.levels)
        tok = launched.levels[-1].worker.tokenizer
        workers = [lv.worker for lv in launched.levels]

        def fwd() -> float:
            return sum(w.stats().extra.get("forward_seconds", 0.0) for w in workers)

        out = {}

        async def run_all(pipe: bool) -> None:
            sched = Scheduler(engine, None, max_batch_size=64, pipeline=pipe)
            key = "ray+pipe" if pipe else "ray"
            for b in batches:
                f0, r0 = fwd(), sched.stats.rounds
                t0 = time.perf_counter()
                toks = sum(await _drive(sched, prompts_for(tok, b), args.max_tokens))
                wall = time.perf_counter() - t0
                rounds, fw = sched.stats.rounds - r0, fwd() - f0
                out.setdefault(key, {})[b] = {
                    "wall": wall, "forward": fw, "rounds": rounds, "tokens": toks, "tok_s": toks / wall,
                    # with pipelining forwards overlap, so wall - forward is not an overhead
                    "overhead_per_round_ms": None if pipe else 1000 * (wall - fw) / max(rounds, 1),
                }
                print(f"{key} B={b}: {out[key][b]}", file=sys.stderr)
            await sched.close()

        asyncio.run(run_all(False))
        asyncio.run(run_all(True))
        return out
    finally:
        launched.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = {"args": vars(args), "in-process": run_in_process(args, args.batches)}
    results.update(run_ray(args, args.batches))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"ray-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}\n\n| run | batch | tok/s | rounds | overhead/round (ms) |\n|---|---|---|---|---|")
    for run in ("in-process", "ray", "ray+pipe"):
        for b, r in results[run].items():
            ov = f"{r['overhead_per_round_ms']:.1f}" if r.get("overhead_per_round_ms") is not None else "-"
            print(f"| {run} | {b} | {r['tok_s']:.2f} | {r['rounds']} | {ov} |")


if __name__ == "__main__":
    main()
