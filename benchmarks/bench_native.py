"""specray over a vLLM target vs vLLM's own speculation (ngram, draft_model) vs plain vLLM, and hf vs vllm steps.

    .venv/bin/python benchmarks/bench_native.py --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --batch 1 4 16 --max-tokens 32 --kv-mib 512 \
        --out benchmarks/results/native-qwen.json

Phases run one after another, each in its own child process (its engines are freed when it exits, so peak
memory is two engines); inside a phase every setup runs each
workload side by side (interleaved), so the ratios to the phase's own plain vLLM are comparable on a noisy
machine. Greedy throughout; `same` says whether a setup's tokens equal plain vLLM's.

- phase ngram: two engines. A plain one runs vLLM's own loop (`LLM.generate`: requests live in the
  scheduler), the true plain baseline, and specray's plain decoding over the vllm backend ("vllm plain": one
  step of a live request per round). A speculative one (vLLM n-gram K, lookup 1..4) runs vLLM's own n-gram
  loop, the native baseline, and specray's rounds with engine verification: specray's n-gram K (its drafts
  verified in vLLM's step) and the planner over {plain, n-gram K' <= K} on it. Plus specray's n-gram over the
  plain engine verified by prompt scoring. `vs_own_plain` is the ratio to vLLM's own plain loop.
- phase draft (with --draft), two stages in one process (a plain engine, a draft_model engine and an hf
  draft do not fit beside each other in 24 GB at fp32; stage 1's engine is freed before stage 2 loads):
  stage 1: vLLM's draft_model engine (K_d) alone, by vLLM's own loop and as specray's native level;
  stage 2: a plain engine that verifies specray's drafts in its step (engine_verify 8) with vLLM's own loop on
  it (its own n-gram proposer only fires on 16-token matches: plain decoding but for those) | specray plain |
  specray n-gram | specray draft > vllm and cascade ngram > draft > vllm, with the draft on the hf backend
  and on the vllm backend (a second engine) | specray auto {ngram, vllm draft}.
  Ratios across the two stages are of runs minutes apart (compare stage 1 with stage 2's own loop).
- phase step: one plain decoding round of the hf backend vs the vllm backend at each batch size (median of timed
  rounds after warm-up), in --dtype: float32 hf with prepacked linears; bfloat16 hf with its linears as they are
  and prepacked (`cpu_prepack`), each beside vLLM in the same dtype and threads.

Workloads: at batch 1 each prompt set (code editing, extraction; benchmarks/prompts.py, chat template) runs
one prompt at a time; at batch B > 1 the batch is B prompts cycled from those sets. Without --model a tiny fp32
target whose greedy text repeats itself is built under /tmp: mechanics only, not real-model speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TINY_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci_iter(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
]


def tiny_target() -> str:
    from specray.testing.tiny import repetitive_target

    return str(repetitive_target("/tmp/specray-bench-native"))


def workloads(tok, sets: list[str], batches: list[int], real: bool) -> list[tuple[str, int, list[list[int]]]]:
    """(name, batch, prompt ids): batch 1 per set (one prompt at a time), batch B>1 cycled over all sets."""
    from prompts import SETS

    def enc(text: str) -> list[int]:
        if real and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        return list(tok.encode(text))

    texts = {s: (SETS[s] if real else TINY_PROMPTS) for s in sets}
    out = []
    for b in batches:
        if b == 1:
            out += [(s, 1, [enc(t) for t in texts[s]]) for s in sets]
        else:
            pool = [t for s in sets for t in texts[s]]
            out.append(("mixed", b, [enc(pool[i % len(pool)]) for i in range(b)]))
    return out


def own_loop(worker, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generation by vLLM's own engine loop on a worker's engine: requests stay alive in the
    scheduler (no per-round resubmission), which is the fair "plain vLLM" baseline."""
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = worker.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _new_acc() -> dict:
    return {"tokens": 0, "seconds": 0.0, "rounds": 0, "out": [], "drafts": 0, "accepted": 0}


def _measure(args, tok, real: bool, engines: dict, own: dict, acc: dict) -> None:
    """Time every setup on every workload, interleaved chunk by chunk; add into acc[workload][setup]."""
    from specray.coordinator.generate import generate

    for wname, batch, prompts in workloads(tok, args.sets, args.batch, real):
        wacc = acc.setdefault((wname, batch), {})
        for name in [*own, *engines]:
            wacc.setdefault(name, _new_acc())
        chunks = [[p] for p in prompts] if batch == 1 else [prompts]
        for chunk in chunks:  # interleaved: every setup runs this chunk before the next chunk starts
            # untimed warm-up on the chunk (2 tokens): every engine's prefix cache holds the prompts and the
            # kernels have seen the batch shape, so no setup pays the chunk's prefill for the ones after it
            for w in own.values():
                own_loop(w, chunk, 2)
            for engine, planner in engines.values():
                generate(engine, chunk, max_tokens=2, ignore_eos=True, plan=planner)
            for name, w in own.items():
                t1 = time.perf_counter()
                toks = own_loop(w, chunk, args.max_tokens)
                dt = time.perf_counter() - t1
                a = wacc[name]
                a["seconds"] += dt
                a["tokens"] += sum(map(len, toks))
                a["out"] += toks
                print(f"[{args.phase} {wname} b={batch}] {name:40s} {dt:7.1f}s "
                      f"{sum(map(len, toks)) / dt:6.2f} tok/s", file=sys.stderr, flush=True)
            for name, (engine, planner) in engines.items():
                t1 = time.perf_counter()
                out = generate(engine, chunk, max_tokens=args.max_tokens, ignore_eos=True, plan=planner)
                dt = time.perf_counter() - t1
                a = wacc[name]
                a["seconds"] += dt
                a["tokens"] += sum(len(r.token_ids) for r in out.results)
                a["rounds"] += out.rounds
                a["out"] += [r.token_ids for r in out.results]
                st = out.stats.get("target")
                if st is not None:
                    a["drafts"] += st.draft_tokens
                    a["accepted"] += st.accepted_tokens
                print(f"[{args.phase} {wname} b={batch}] {name:40s} {dt:7.1f}s "
                      f"{sum(len(r.token_ids) for r in out.results) / dt:6.2f} tok/s", file=sys.stderr, flush=True)


def _engines(setups: dict, tok, k_max_of) -> dict:
    """CascadeEngine (+ planner when auto) per setup, each warmed up on a short prompt."""
    from specray.coordinator.cascade import CascadeEngine
    from specray.coordinator.generate import generate
    from specray.policy.planner import Planner

    engines = {}
    for name, (levels, auto) in setups.items():
        engine = CascadeEngine(levels)
        planner = Planner(engine.levels, k_max=k_max_of(levels)).attach(engine) if auto else None
        engines[name] = (engine, planner)
        generate(engine, [list(tok.encode("Hello, hello"))], max_tokens=4, ignore_eos=True, plan=planner)  # warm
    return engines


def _free(workers: list) -> None:
    """Close engines and hand their memory back before the next stage loads its own."""
    import ctypes
    import gc

    for w in workers:
        w.close()
    workers.clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def run_phase(args) -> list[dict]:
    import torch

    from specray.coordinator.cascade import Level
    from specray.engine.models import load_tokenizer
    from specray.engine.vllm import VLLMWorker
    from specray.engine.vllm_native import NativeVLLMWorker
    from specray.spec.ngram import NgramConfig

    torch.set_num_threads(args.threads)
    real = args.model is not None
    model = args.model or tiny_target()
    common = dict(name="target", dtype=args.dtype, num_threads=args.threads, kv_cache_bytes=args.kv_mib << 20,
                  max_context=args.max_context, max_num_seqs=max(args.batch))
    tok = load_tokenizer(model)
    ng = lambda k=args.k: Level("ngram", ngram=NgramConfig(k, 1, 4, args.ngram_occurrence), k=k)
    acc: dict = {}
    closers: list = []
    own: dict[str, object] = {}
    t0 = time.perf_counter()
    if args.phase == "draft":
        # stage 1, alone in memory (a plain engine, a draft_model engine and an hf draft do not fit beside
        # each other in 24 GB at fp32): vLLM's draft_model engine, by its own loop and as specray's native level
        native = NativeVLLMWorker(model, native_speculation={"method": "draft_model", "model": args.draft,
                                                             "num_speculative_tokens": args.k_draft}, **common)
        closers.append(native)
        print(f"[draft] draft_model engine loaded in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
        own_native = {f"vLLM own loop, native draft_model K={args.k_draft}": native}
        stage1 = {f"specray native draft_model K={args.k_draft} level": ([Level("target", worker=native)], False)}
        if args.only:
            stage1 = {n: v for n, v in stage1.items() if any(o in n for o in args.only)}
        _measure(args, tok, real, _engines(stage1, tok, lambda levels: args.k_max), own_native, acc)
        _free(closers)
        t0 = time.perf_counter()
    # the draft phase's plain engine verifies specray's drafts in its step (engine_verify 8; its own n-gram
    # proposer only fires on 16-token matches, so its own loop is plain decoding but for those)
    plain = VLLMWorker(model, **common, engine_verify=8 if args.phase == "draft" else 0)
    setups: dict[str, tuple[list, bool]] = {"vllm plain": ([Level("target", worker=plain)], False)}
    closers.append(plain)
    own["vLLM own loop, plain"] = plain  # vLLM's own scheduling loop (LLM.generate), not specray's rounds
    if args.phase == "ngram":
        # one speculative engine serves vLLM's own n-gram loop (LLM.generate) and specray's rounds, whose
        # drafts (or none: a plain step) it verifies in its own step (engine_verify)
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        native = VLLMWorker(model, **common, engine_verify=args.k,
                            engine_kwargs={"speculative_config": spec, "async_scheduling": False})
        closers.append(native)
        own[f"vLLM own loop, native ngram K={args.k}"] = native  # its proposer drafts (nothing injected)
        setups[f"specray ngram K={args.k} > vllm (engine verify)"] = ([ng(), Level("target", worker=native)], False)
        setups["specray auto {ngram, vllm engine verify}"] = ([ng(), Level("target", worker=native)], True)
        setups[f"specray ngram K={args.k} > vllm (prompt scoring)"] = ([ng(), Level("target", worker=plain)], False)
    elif args.phase == "draft":
        from specray.engine.hf import HFWorker

        draft = HFWorker(args.draft, name="draft", dtype="float32", cpu_prepack=True)
        # the same draft model on the vllm backend (a mixed cascade's other half): proposals by generation
        vdraft = VLLMWorker(args.draft, **{**common, "name": "draft", "kv_cache_bytes": args.kv_mib << 19})
        closers.append(vdraft)
        kd = args.k_draft
        setups[f"specray ngram K={args.k} > vllm (engine verify)"] = ([ng(), Level("target", worker=plain)], False)
        for tag, w in (("hf", draft), ("vllm", vdraft)):
            setups[f"specray {tag} draft K={kd} > vllm"] = (
                [Level("draft", worker=w, k=kd), Level("target", worker=plain)], False)
            setups[f"specray cascade ngram > {tag} draft > vllm"] = (
                [ng(6), Level("draft", worker=w, k=kd + 3), Level("target", worker=plain)], False)
        setups["specray auto {ngram, vllm draft}"] = (
            [ng(), Level("draft", worker=vdraft, k=kd), Level("target", worker=plain)], True)
    if args.only:
        setups = {n: v for n, v in setups.items() if n == "vllm plain" or any(o in n for o in args.only)}
    print(f"[{args.phase}] engines loaded in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    def k_max_of(levels: list) -> int:
        # on the n-gram engine the engine verifies at most its own K per step
        return min(args.k_max, args.k) if args.phase == "ngram" and levels[-1].worker is not plain else args.k_max

    engines = _engines(setups, tok, k_max_of)
    _measure(args, tok, real, engines, own, acc)
    _free(closers)

    rows = []
    for (wname, batch), wacc in acc.items():
        base = wacc["vllm plain"]
        own_base = wacc.get("vLLM own loop, plain")
        rate = lambda a: a["tokens"] / a["seconds"]
        for name, a in wacc.items():
            engine, planner = engines.get(name, (None, None))
            row = {"phase": args.phase, "workload": wname, "batch": batch, "setup": name,
                   "tokens_per_s": round(rate(a), 3),
                   "vs_vllm_plain": round(rate(a) / rate(base), 3),
                   "vs_own_plain": round(rate(a) / rate(own_base), 3) if own_base else None,
                   "tokens_per_round": round(a["tokens"] / a["rounds"], 2) if a["rounds"] else None,
                   "target_acceptance": round(a["accepted"] / a["drafts"], 3) if a["drafts"] else None,
                   "same": a["out"] == base["out"]}
            if planner is not None:
                row["plan_at_end"] = planner.plan_name(planner.current)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


class _Timer:
    """Cascade observer collecting the seconds of each worker call."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def on_call(self, level, kind, batch, tokens, seconds) -> None:
        self.calls.append(seconds)


def run_steps(args) -> list[dict]:
    """hf vs vllm: seconds of one plain decoding round at each batch size (module docstring)."""
    import torch

    from specray.coordinator.cascade import CascadeEngine, Level
    from specray.coordinator.generate import generate
    from specray.engine.hf import HFWorker
    from specray.engine.vllm import VLLMWorker

    torch.set_num_threads(args.threads)
    model = args.model or tiny_target()
    dt = "fp32" if args.dtype in ("float32", "fp32") else "bf16" if args.dtype in ("bfloat16", "bf16") else None
    if dt is None:
        raise SystemExit(f"phase step: --dtype float32 or bfloat16, not {args.dtype}")
    workers = {f"hf {dt} prepack": HFWorker(model, name="target", dtype=args.dtype, cpu_prepack=True,
                                            num_threads=args.threads)}
    if dt == "bf16":
        workers["hf bf16"] = HFWorker(model, name="target", dtype=args.dtype, cpu_prepack=False,
                                      num_threads=args.threads)
    workers[f"vllm {dt}"] = VLLMWorker(model, name="target", dtype=args.dtype, num_threads=args.threads,
                                       kv_cache_bytes=args.kv_mib << 20, max_context=args.max_context,
                                       max_num_seqs=max(args.batch))
    tok = workers[f"vllm {dt}"].tokenizer
    prompt = list(tok.encode("def moving_average(items, window):\n    result = []\n"))
    rows = []
    for batch in args.batch:
        times: dict[str, list[float]] = {n: [] for n in workers}
        for _ in range(3):  # interleaved repeats
            for name, w in workers.items():
                timer = _Timer()
                engine = CascadeEngine([Level("target", worker=w)])
                engine.observers.append(timer)
                generate(engine, [prompt] * batch, max_tokens=9, ignore_eos=True)
                times[name] += timer.calls[1:]  # the first call is the prefill
        for name, ts in times.items():
            row = {"phase": "step", "batch": batch, "setup": name, "step_ms": round(1000 * statistics.median(ts), 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for w in workers.values():
        if hasattr(w, "close"):
            w.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target: known name or folder (default: tiny, mechanics only)")
    ap.add_argument("--draft", default=None, help="draft model for the draft phase (vLLM draft_model and hf)")
    ap.add_argument("--dtype", default="float32", help="vLLM dtype (bf16 is slow on CPUs without bf16 units)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="K of vLLM's n-gram speculation and of specray's n-gram")
    ap.add_argument("--ngram-occurrence", default="earliest", choices=["recent", "earliest"],
                    help="specray's n-gram: which occurrence drafts (earliest = vLLM's proposer: the same drafts)")
    ap.add_argument("--k-draft", type=int, default=3, help="K of vLLM's draft_model and of specray's hf draft")
    ap.add_argument("--k-max", type=int, default=8, help="largest K the specray planner considers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--sets", nargs="+", default=["code", "extraction"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--kv-mib", type=int, default=1024, help="vLLM KV cache per engine (MiB)")
    ap.add_argument("--phases", nargs="+", default=["ngram", "draft", "step"])
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase in this process
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only the setups whose name contains one of these (vllm plain and the own loops stay)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.phase:
        rows = run_steps(args) if args.phase == "step" else run_phase(args)
        Path(args.out).write_text(json.dumps(rows))
        return
    rows: list[dict] = []
    for phase in args.phases:
        if phase == "draft" and not args.draft:
            if args.model:
                print("[draft] skipped: no --draft", file=sys.stderr)
                continue
            args.draft = tiny_target()  # mechanics only: the tiny target drafts for itself
        part = Path(f"/tmp/bench-native-{os.getpid()}-{phase}.json")
        cmd = [sys.executable, __file__, "--phase", phase, "--out", str(part)]
        for key in ("model", "draft", "dtype", "threads", "k", "ngram_occurrence", "k_draft", "k_max", "max_tokens",
                    "max_context", "kv_mib"):
            val = getattr(args, key)
            if val is not None:
                cmd += [f"--{key.replace('_', '-')}", str(val)]
        cmd += ["--batch", *map(str, args.batch), "--sets", *args.sets]
        if args.only:
            cmd += ["--only", *args.only]
        subprocess.run(cmd, check=True)
        rows += json.loads(part.read_text())
        part.unlink()
    print("\n| phase | workload | batch | setup | tok/s | vs vllm plain | tokens/round | acceptance | same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["phase"] != "step":
            acc = "-" if r["target_acceptance"] is None else r["target_acceptance"]
            print(f"| {r['phase']} | {r['workload']} | {r['batch']} | {r['setup']} | {r['tokens_per_s']} | "
                  f"{r['vs_vllm_plain']}x | {r['tokens_per_round'] or '-'} | {acc} | {r['same']} |")
    steps = [r for r in rows if r["phase"] == "step"]
    if steps:
        print("\n| batch | backend | plain round (ms) |\n|---|---|---|")
        for r in steps:
            print(f"| {r['batch']} | {r['setup']} | {r['step_ms']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
