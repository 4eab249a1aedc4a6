"""Batch-1 speed of specray plans vs plain decoding and vs HF transformers' own speculation, one process.

    .venv/bin/python benchmarks/bench_core.py --sets code extraction chat --max-tokens 96 --threads 1

Every configuration runs on the same loaded models (Qwen2.5-Coder 0.5B draft, 1.5B target, bf16 by
default), same prompts (chat template), same max tokens, greedy, side by side in one run, so the ratios are
comparable even on a noisy machine. Writes benchmarks/results/core-*.json and prints a markdown table.

Configurations (--configs): plain, ngram[:K], suffix[:K] (suffix decoding over this and the earlier prompts' text;
one drafter per K for the whole run), draft[:K], cascade[:K0:K1] (n-gram -> 0.5B -> 1.5B), adaptive[:KMAX]
(the live planner over those three levels), hf_plain, hf_assisted, hf_lookup[:K]; suffixes: @earliest (the
n-gram drafts from the earliest occurrence, as vLLM), +overlap (draft ahead on a second thread), ~C (the 0.5B
ends a draft after a token it gives less than C), e.g. cascade:6:8@earliest+overlap~0.6. Besides end-to-end
tokens/s the table gives the first-token time and the decode phase's tokens/s (tokens after the first one
over the time after it).

Theoretical bound: the speedup if drafting cost nothing and verifying K+1 tokens cost one step, i.e. the
expected accepted length E[L] = 1 + sum_i prod_{j<=i} alpha_j from the measured per-position acceptance at
the target (the goodput model of specray/policy/pricing.py). "of bound" = achieved speedup / E[L].

A documented special case beside `specray bench` (docs/bench.md): it measures plan variants the command does not
expose (suffix decoding, @earliest, +overlap, ~C, per-configuration K); the measuring parts are shared with it
(per-position acceptance from specray.bench.report, prompt encoding from specray.bench.workloads, the HF
transformers peers from specray.bench.peers).
"""

from __future__ import annotations

import argparse
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

from specray.bench.peers import HFPeers
from specray.bench.report import alphas
from specray.bench.workloads import prompt_ids
from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.coordinator.stats import LevelStats
from specray.engine.hf import HFWorker
from specray.engine.tokenizer_check import check_tokenizers
from specray.spec.bound import expected_accepted_length
from specray.spec.ngram import NgramConfig
from specray.spec.params import VerifyMethod
from specray.spec.suffix import SuffixConfig, SuffixDrafter


def chat_ids(tok, text: str) -> list[int]:
    return prompt_ids(tok, {"messages": [{"role": "user", "content": text}]})


def run_specray(levels, prompts_ids, max_tokens, plan=None):
    """(tokens, seconds, stats, seconds to the first token summed over prompts)."""
    t0 = time.perf_counter()
    batch = None
    toks, ttft = 0, 0.0
    stats: dict[str, LevelStats] = {}
    for ids in prompts_ids:  # batch 1: one prompt at a time
        batch = generate(levels, [ids], max_tokens=max_tokens, plan=plan)
        toks += len(batch.results[0].token_ids)
        ttft += batch.results[0].ttft_s or 0.0
        for k, v in batch.stats.items():
            stats.setdefault(k, LevelStats()).merge(v)
    dt = time.perf_counter() - t0
    return toks, dt, stats, ttft


def run_hf(peers: HFPeers, peer: str, prompts_ids, max_tokens):
    """HF transformers' own generation (specray.bench.peers): (tokens, seconds, seconds to the first tokens)."""
    res = peers.run(peer, [(i, ids, max_tokens) for i, ids in enumerate(prompts_ids)])
    return (sum(r.tokens for r in res.requests), res.seconds, sum(r.ttft_s or 0.0 for r in res.requests))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prepack", action="store_true",
                    help="float32 + oneDNN-prepacked linears (both engines use the same model objects)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--configs", nargs="+",
                    default=["plain", "ngram", "draft", "cascade", "adaptive", "hf_plain", "hf_assisted", "hf_lookup"],
                    help="plain | ngram[:K] | suffix[:K] | draft[:K] | cascade[:K0:K1] | adaptive[:K_MAX] | hf_plain | "
                         "hf_assisted | hf_lookup[:K]; a suffix @earliest / @recent sets the n-gram occurrence of that "
                         "configuration (default: --ngram-occurrence), +overlap drafts the next round on a second "
                         "thread while the target verifies; e.g. ngram:16@earliest, cascade:6:8@earliest+overlap")
    ap.add_argument("--k-ngram", type=int, default=8, help="n-gram K (standalone n-gram plan)")
    ap.add_argument("--k-suffix", type=int, default=16,
                    help="suffix decoding's largest K (its match length usually limits a draft first)")
    ap.add_argument("--k-draft", type=int, default=4, help="draft-model K (standalone draft plan)")
    ap.add_argument("--ngram-occurrence", default="recent", choices=["recent", "earliest"],
                    help="which occurrence of the matched suffix drafts (earliest: vLLM's proposer)")
    ap.add_argument("--k-cascade", type=int, nargs=2, default=[6, 8], help="K of n-gram and 0.5B in the cascade")
    ap.add_argument("--hf-lookup-k", type=int, default=10, help="HF prompt_lookup_num_tokens (its default is 10)")
    ap.add_argument("--k-max", type=int, default=8, help="largest K the adaptive planner considers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.prepack:
        args.dtype = "float32"
    target = HFWorker(args.target, name="target", dtype=args.dtype, cpu_prepack=args.prepack)
    draft = HFWorker(args.draft, name="draft", dtype=args.dtype, cpu_prepack=args.prepack)
    check_tokenizers([("draft", draft.tokenizer), ("target", target.tokenizer)])
    print(f"loaded in {time.perf_counter() - t0:.1f}s; threads={torch.get_num_threads()} dtype={args.dtype}",
          file=sys.stderr)
    tok = target.tokenizer
    eos = list(target.eos_token_ids)
    M = VerifyMethod.GREEDY
    from specray.coordinator.cascade import CascadeEngine
    from specray.policy.planner import Planner

    suffix_drafters: dict[int, SuffixDrafter] = {}  # per K, kept across prompts: its global trie learns

    def levels_for(base: str, ks: list[int], occ: str, conf: float = 0.0) -> list[Level]:
        """plain | ngram[:K] | suffix[:K] | draft[:K] | cascade[:K0:K1], the n-gram drafting from occurrence
        `occ`, the 0.5B ending drafts after tokens it gives less than `conf`."""
        if base == "plain":
            return [Level("target", worker=target, method=M)]
        if base == "suffix":
            k = ks[0] if ks else args.k_suffix
            sx = suffix_drafters.setdefault(k, SuffixDrafter(SuffixConfig(num_speculative_tokens=k)))
            return [Level("suffix", suffix=sx), Level("target", worker=target, method=M)]
        if base == "ngram":
            return [Level("ngram", ngram=NgramConfig(ks[0] if ks else args.k_ngram, 1, 4, occ)),
                    Level("target", worker=target, method=M)]
        if base == "draft":
            return [Level("draft", worker=draft, k=ks[0] if ks else args.k_draft, confidence=conf),
                    Level("target", worker=target, method=M)]
        if base == "cascade":
            k0, k1 = ks if len(ks) == 2 else args.k_cascade
            return [Level("ngram", ngram=NgramConfig(k0, 1, 4, occ)),
                    Level("draft", worker=draft, k=k1, method=M, confidence=conf),
                    Level("target", worker=target, method=M)]
        raise SystemExit(f"unknown configuration {base!r}")

    adaptive: dict[tuple[int, str, bool, float], tuple[CascadeEngine, Planner]] = {}  # one live planner per variant
    chosen: dict[tuple[int, str, bool, float], Counter] = {}  # rounds per plan name, per variant

    def counting(key, planner: Planner):
        def plan(batch: int):
            p = planner(batch)
            chosen[key][planner.plan_name(p)] += 1
            return p
        return plan

    def parse(cfg: str) -> tuple[str, list[int], str, bool, float]:
        cfg, _, conf = cfg.partition("~")
        cfg, overlap = (cfg[: -len("+overlap")], True) if cfg.endswith("+overlap") else (cfg, False)
        name, _, occ = cfg.partition("@")
        base, *ks = name.split(":")
        return base, [int(k) for k in ks], occ or args.ngram_occurrence, overlap, float(conf or 0.0)

    # warm up both models and the code paths
    warm = chat_ids(tok, "Say hi.")
    generate(levels_for("cascade", [], args.ngram_occurrence), [warm], max_tokens=8)
    hf_peers: dict[int, HFPeers] = {}  # per prompt-lookup K

    def hf(k: int) -> HFPeers:
        return hf_peers.setdefault(k, HFPeers(target.model, draft.model, eos, lookup_k=k))

    run_hf(hf(args.hf_lookup_k), "hf_plain", [warm], 4)

    def run_one(cfg: str, ids: list[int]) -> tuple[int, float, dict[str, LevelStats] | None, float]:
        base, ks, occ, overlap, conf = parse(cfg)
        if base == "adaptive":  # the live goodput planner picks levels and K every round (cascade levels)
            key = (ks[0] if ks else args.k_max, occ, overlap, conf)
            if key not in adaptive:
                lv = levels_for("cascade", [], occ, conf)
                eng = CascadeEngine(lv, overlap=overlap)
                adaptive[key] = (eng, Planner(lv, k_max=key[0]).attach(eng))
                chosen[key] = Counter()
            return run_specray(adaptive[key][0], [ids], args.max_tokens, counting(key, adaptive[key][1]))
        if not base.startswith("hf_"):
            return run_specray(CascadeEngine(levels_for(base, ks, occ, conf), overlap=overlap), [ids],
                               args.max_tokens)
        n, dt, ttft = run_hf(hf(ks[0] if ks else args.hf_lookup_k), base, [ids], args.max_tokens)
        return n, dt, None, ttft

    results: dict = {"args": vars(args), "sets": {}}
    for set_name in args.sets:
        prompts_ids = [chat_ids(tok, p) for p in SETS[set_name]]
        acc: dict[str, dict] = {cfg: {"tokens": 0, "seconds": 0.0, "ttft": 0.0, "prompts": 0, "stats": None}
                                for cfg in args.configs}
        # Interleaved: every configuration runs each prompt before the next prompt starts, so load that comes
        # and goes on a shared machine hits all configurations alike and the ratios stay comparable.
        for i, ids in enumerate(prompts_ids):
            for cfg in args.configs:
                n, dt, stats, ttft = run_one(cfg, ids)
                a = acc[cfg]
                a["tokens"] += n
                a["seconds"] += dt
                a["ttft"] += ttft
                a["prompts"] += 1
                if stats is not None:
                    a["stats"] = a["stats"] or {}
                    for k, v in stats.items():
                        a["stats"].setdefault(k, LevelStats()).merge(v)
                print(f"[{set_name} #{i}] {cfg:12s} {n:4d} tok {dt:7.1f}s {n / dt:6.2f} tok/s  first token "
                      f"{ttft:5.2f}s, then {(n - 1) / max(dt - ttft, 1e-9):6.2f} tok/s", file=sys.stderr)
        for (kmax, occ, ov, conf), (_, pl) in adaptive.items():
            tag = f"k_max {kmax}, {occ}" + (", overlap" if ov else "") + (f", confidence {conf}" if conf else "")
            top = ", ".join(f"{name} {n}" for name, n in chosen[(kmax, occ, ov, conf)].most_common(6))
            print(f"  adaptive ({tag}) planner now holds {pl.plan_name(pl.current)}; rounds so far: {top}",
                  file=sys.stderr)
        rows = {}
        for cfg, a in acc.items():
            # decode phase: the tokens after each request's first one, over the time after it (TPOT's inverse)
            row = {"tokens": a["tokens"], "seconds": a["seconds"], "tok_s": a["tokens"] / a["seconds"],
                   "ttft_s": a["ttft"] / a["prompts"],
                   "decode_tok_s": (a["tokens"] - a["prompts"]) / (a["seconds"] - a["ttft"])}
            if a["stats"] is not None:
                top = a["stats"].get("target", LevelStats())
                row["stats"] = {k: v.as_dict() for k, v in a["stats"].items()}
                row["E_L"] = expected_accepted_length(alphas(top)) if top.num_drafts else 1.0
            rows[cfg] = row
        plain_row = next((r for c, r in rows.items() if c.split("@")[0] == "plain"), None)
        hf_row = rows.get("hf_plain")
        for cfg, row in rows.items():
            ref = hf_row if cfg.startswith("hf_") else plain_row
            if ref:
                row["speedup"] = row["tok_s"] / ref["tok_s"]
                row["decode_speedup"] = row["decode_tok_s"] / ref["decode_tok_s"]
            if "E_L" in row and "speedup" in row:
                row["fraction_of_bound"] = row["speedup"] / row["E_L"]
        results["sets"][set_name] = rows

    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"core-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}\n")
    print("| set | config | tok/s | speedup vs own plain | first token s | decode tok/s (speedup) | target accept rate "
          "| E[L] | of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for set_name, rows in results["sets"].items():
        for cfg, row in rows.items():
            st = row.get("stats", {}).get("target", {})
            acc = f"{st['acceptance_rate']:.2f}" if st.get("draft_tokens") else "-"
            el = f"{row['E_L']:.2f}" if "E_L" in row else "-"
            fb = f"{row['fraction_of_bound']:.2f}" if "fraction_of_bound" in row else "-"
            print(f"| {set_name} | {cfg} | {row['tok_s']:.2f} | {row.get('speedup', float('nan')):.2f}x | "
                  f"{row['ttft_s']:.2f} | {row['decode_tok_s']:.2f} ({row.get('decode_speedup', float('nan')):.2f}x) "
                  f"| {acc} | {el} | {fb} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
