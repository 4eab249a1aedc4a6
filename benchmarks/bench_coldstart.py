"""The live planner's cold start at batch 1 against fixed plans, in process, on the served config's levels.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python benchmarks/bench_coldstart.py serve_config.yaml \
        --workloads code extraction chat --limit 3 --max-tokens 80 --repeats 2

The levels of the config (n-gram -> 0.5B -> 1.5B; the target on vLLM with engine verification where vLLM is
installed) are loaded once. Modes: `adaptive` (the config's policy, a fresh planner at the start of every workload
pass: what a server that has just started sees; `adaptive-old`: the planner as it was before the cold-start fix,
deaf to the feed's shadow lookups and extrapolating its step-cost slopes, with an engine of its own;
`adaptive-unaged`: verifications priced against the plain step now, not the one measured then;
`adaptive-calibrated`: the goodput model's prices corrected by what each plan family's rounds delivered;
`adaptive-prior-start`: warm-up on the plan the priors rank best, which the first ranking replaces at once;
`adaptive-no-replay`: shadow lookups once per round at its end, not replayed over the round's tokens),
`none` (plain
decoding), `ngram`, `draft`, `cascade` (fixed plans at the levels' configured K). Batch 1, greedy: per workload,
prompt by prompt, every mode runs the same prompt before the next prompt starts (order rotated per prompt), each
after the prefix caches are emptied, so load that comes and goes hits every mode alike. With --warm-request each
planner first serves an 8-token request on a short chat prompt, as bench_serve's server does. The adaptive planners
keep what they learned across the prompts of a pass.

`--peers vllm_plain vllm_ngram`: vLLM's own loop on the target's model, dtype and threads (plain, and its n-gram
as its docs set it), each engine in a process of its own kept up through the run, asked each prompt in the same
rotation as the modes, its prefix cache emptied first too. Each peer takes its model, runtime and
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache (2 by default): on a 24 GiB box set it to 1 for two peers.

Prints tokens/s per workload and mode, and adaptive / the best fixed plan (and / each peer); writes the per-prompt
numbers, the planner's per-round log (the plan answered, why, and the top of its ranking; the events it was fed) and
the same events for the fixed modes (`fixed_log`: each call's seconds, each round's own time) to
benchmarks/results/coldstart-*.json, and prints where each mode's time went (`time_split`: each level's calls, the
rounds' own time, the rest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncio

from specray.bench.cli import _load_levels, load_config
from specray.bench.runner import _METHOD
from specray.bench.workloads import load_workloads, prompt_ids
from specray.coordinator.cascade import CascadeEngine
from specray.coordinator.scheduler import Request, Scheduler, Speculation
from specray.policy.planner import Planner
from specray.spec.params import SamplingParams

FIXED = ("none", "ngram", "draft", "cascade")
PEERS = ("vllm_plain", "vllm_ngram")
ADAPTIVE = ("adaptive", "adaptive-old", "adaptive-unaged", "adaptive-calibrated", "adaptive-prior-start",
            "adaptive-no-replay")


class Recorder:
    """The engine feed's events as log records (`call`, `verify`, `native`, `host`): the fixed modes' engine has one,
    and each `LoggedPlanner` records through one, so a fixed plan's rounds can be set beside the planner's: what each
    call cost, and the round's own time."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []

    def on_call(self, level, kind, batch, tokens, seconds):
        self.log.append({"ev": "call", "level": level, "kind": kind, "batch": batch, "tokens": tokens,
                         "s": round(seconds, 4)})

    def on_verify(self, level, lower, draft_lens, accepted, asked=None):
        self.log.append({"ev": "verify", "level": level, "lower": lower, "lens": list(draft_lens),
                         "acc": list(accepted), **({"asked": asked} if asked is not None else {})})

    def on_native(self, level, draft_lens, accepted):
        self.log.append({"ev": "native", "level": level, "lens": list(draft_lens), "acc": list(accepted)})

    def on_host(self, drafting, batch, seconds):
        self.log.append({"ev": "host", "drafting": list(drafting), "s": round(seconds, 5)})


class LoggedPlanner(Planner):
    """A planner that records each answer (its `trace` record: plan, reason, the best-ranked candidates, the round's
    seconds) and the events it is fed (through a `Recorder`, plus shadow lookups and catch-ups)."""

    log: list[dict[str, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.record = Recorder()
        self.log = self.record.log
        super().__init__(*args, trace=lambda rec: self.log.append({"ev": "plan", **rec}), **kwargs)

    def on_call(self, level, kind, batch, tokens, seconds):
        self.record.on_call(level, kind, batch, tokens, seconds)
        super().on_call(level, kind, batch, tokens, seconds)

    def on_verify(self, level, lower, draft_lens, accepted, asked=None):
        self.record.on_verify(level, lower, draft_lens, accepted, asked)
        super().on_verify(level, lower, draft_lens, accepted, asked)

    def on_drafted(self, level, lower, draft_lens, accepted, asked):
        self.record.on_verify(level, lower, draft_lens, accepted, list(asked))
        super().on_drafted(level, lower, draft_lens, accepted, asked)

    def on_shadow(self, level, lower, draft_lens, accepted, asked, latest=None):
        self.log.append({"ev": "shadow", "level": level, "lower": lower, "lens": list(draft_lens),
                         "acc": list(accepted)})
        super().on_shadow(level, lower, draft_lens, accepted, asked, latest)

    def on_native(self, level, draft_lens, accepted):
        self.record.on_native(level, draft_lens, accepted)
        super().on_native(level, draft_lens, accepted)

    def on_host(self, drafting, batch, seconds):
        self.record.on_host(drafting, batch, seconds)
        super().on_host(drafting, batch, seconds)

    def on_catch_up(self, level, kind, batch, tokens, caught, seconds):
        super().on_catch_up(level, kind, batch, tokens, caught, seconds)
        self.log.append({"ev": "catch_up", "level": level, "kind": kind, "batch": batch, "tokens": tokens,
                         "caught": caught, "s": round(seconds, 4),
                         "rate": round(self.pricing.catch_up_rate(level), 5)})  # s per token priced from now on


class BeforeColdStartFix(LoggedPlanner):
    """The planner as it was before shadow lookups and optimistic step sizes (`adaptive-old`): it ignores the
    former, and its step-cost fits never know the sizes measured, so they extrapolate their fitted slope."""

    def on_shadow(self, level, lower, draft_lens, accepted, asked, latest=None):
        pass

    def on_call(self, level, kind, batch, tokens, seconds):
        super().on_call(level, kind, batch, tokens, seconds)
        for cost in (*self.costs.values(), self.native_cost):
            if cost is not None:
                cost.q_seen = 0


class UnagedSlopes(LoggedPlanner):
    """The planner before a batch's verifications were priced against the plain step measured when they ran
    (`adaptive-unaged`): against the plain step priced now, however long ago they ran (`StepCost`'s docstring)."""

    def on_call(self, level, kind, batch, tokens, seconds):
        super().on_call(level, kind, batch, tokens, seconds)
        for cost in (*self.costs.values(), self.native_cost):
            for rec in (cost._extra.values() if cost is not None else ()):
                rec.w_then = rec.plain_then = 0.0  # no call measured beside a plain step: none is aged


def time_split(results: list[dict[str, Any]], streams: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Where each workload's and mode's wall time went, from the feed events logged per request: seconds in each
    level's calls by kind, the rounds' own (host) time, and the rest (the prefills, which reach the feed as catch-ups,
    and the scheduler); the calls' mean tokens fed. Keyed "workload mode"."""
    walls = {(r["repeat"], r["workload"], r["prompt"], r["mode"]): r for r in results}
    out: dict[str, dict[str, Any]] = {}
    for log in streams:
        key = None
        for ev in log:
            if ev["ev"] == "request":
                key = (ev.get("repeat"), ev.get("workload"), ev["prompt"], ev.get("mode"))
                row = walls.get(key)
                if row is None:  # the warm-up request
                    key = None
                    continue
                t = out.setdefault(f"{row['workload']} {row['mode']}", {"wall": 0.0, "tokens": 0, "rounds": 0,
                                                                         "host": 0.0, "calls": {}})
                t["wall"] += row["seconds"]
                t["tokens"] += row["tokens"]
            elif key is not None and ev["ev"] == "host":
                t["rounds"] += 1
                t["host"] += ev["s"]
            elif key is not None and ev["ev"] == "call":
                c = t["calls"].setdefault(f"L{ev['level']} {ev['kind']}", {"s": 0.0, "n": 0, "tokens": 0})
                c["s"] += ev["s"]
                c["n"] += 1
                c["tokens"] += ev["tokens"]
    for t in out.values():
        t["rest"] = t["wall"] - t["host"] - sum(c["s"] for c in t["calls"].values())
    return out


class Calibrated(LoggedPlanner):
    """The planner with its calibration on, whatever the config says (`adaptive-calibrated`): each plan family's
    price corrected by what its rounds delivered (`specray.policy.calibration`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "calibrate": True})


class PriorStart(LoggedPlanner):
    """The planner before its warm-up ran the configured plan (`adaptive-prior-start`): the configured plan only if
    its price at the priors beats plain decoding, else the priors' best plan; and the first ranking replaces the
    warm-up's plan at once, whatever it was."""

    def _start(self, batch: int, best):
        return self.default_plan if self._score(self.default_plan, batch) >= self._score(self.plain, batch) else best

    @property
    def _configured_start(self) -> bool:
        return False

    @_configured_start.setter
    def _configured_start(self, value: bool) -> None:
        pass


_PLANNERS = {"adaptive": LoggedPlanner, "adaptive-old": BeforeColdStartFix, "adaptive-unaged": UnagedSlopes,
             "adaptive-calibrated": Calibrated, "adaptive-prior-start": PriorStart, "adaptive-no-replay": LoggedPlanner}
#: modes whose engine's feed replays no shadow lookups over a round's tokens (`PlannerFeed.replay`)
_NO_REPLAY = ("adaptive-no-replay",)


async def _generate(engine, planner, tok, stop_ids, ids: list[int], max_tokens: int, spec) -> tuple[int, float]:
    """One request alone through the scheduler (batch 1): (tokens, seconds)."""
    sched = Scheduler(engine, tok, max_batch_size=1, planner=planner, stop_token_ids=stop_ids)
    t0 = time.perf_counter()
    n = 0
    try:
        async for ev in sched.generate(Request(ids, SamplingParams(0.0), max_tokens, speculation=spec)):
            if ev.error is not None:
                raise RuntimeError(ev.error)
            n += len(ev.token_ids)
    finally:
        await sched.close()
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a Serve config (its first application) or an AppConfig")
    ap.add_argument("--workloads", nargs="+", default=["code", "extraction", "chat"])
    ap.add_argument("--limit", type=int, default=3, help="the first N prompts of each workload")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--modes", nargs="+", default=["adaptive", *FIXED], choices=[*ADAPTIVE, *FIXED],
                    help="adaptive-old: the planner before the cold-start fix (no shadow lookups, fitted slopes "
                         "extrapolated); adaptive-unaged: verifications priced against the plain step priced now; "
                         "adaptive-calibrated: priced by the plans' own rounds too (policy.calibrate); "
                         "adaptive-prior-start: warm-up on the priors' best plan, left at the first ranking; "
                         "adaptive-no-replay: shadow lookups once per round, not replayed over its tokens")
    ap.add_argument("--repeats", type=int, default=1, help="passes over every workload (a fresh planner each)")
    ap.add_argument("--prompts", choices=["bench", "served"], default="bench",
                    help="bench: `specray bench`'s sample sets; served: benchmarks/prompts.py (bench_serve's)")
    ap.add_argument("--shared", nargs="*", default=[], choices=FIXED,
                    help="fixed modes whose requests go through the adaptive planner's engine as per-request "
                         "overrides, which the planner measures too (bench_serve through one server: none)")
    ap.add_argument("--warm-request", action="store_true",
                    help="the adaptive planner first serves an 8-token request on a short chat prompt (bench_serve's "
                         "warm-up)")
    ap.add_argument("--peers", nargs="*", default=[], choices=PEERS,
                    help="vLLM's own loop beside the modes, prompt by prompt (the target's model, dtype, threads)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    app = load_config(args.config)
    cfg, pol = app.cascade, app.policy
    levels = _load_levels(cfg, False)
    kwargs = pol.planner_kwargs()
    overlap = bool(app.server.overlap)
    tok = levels[-1].worker.tokenizer
    stop_ids = tuple(getattr(levels[-1].worker, "eos_token_ids", ()) or ())
    if args.prompts == "served":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from prompts import SETS

        rows = [{"workload": w, "messages": [{"role": "user", "content": t}]} for w in args.workloads for t in SETS[w]]
    else:
        rows = load_workloads(args.workloads)
    by_w: dict[str, list[list[int]]] = {}
    for r in rows:
        if len(by_w.setdefault(r["workload"], [])) < args.limit:
            by_w[r["workload"]].append(prompt_ids(tok, r))

    fixed_engine = CascadeEngine(levels, overlap=overlap)
    recorder = Recorder()
    warm_ids = prompt_ids(tok, {"prompt": "Say hi."})

    def run(engine, planner, ids, mode):
        spec = None if mode in ADAPTIVE else Speculation(_METHOD[mode])
        return asyncio.run(_generate(engine, planner, tok, stop_ids, ids, args.max_tokens, spec))

    for m in args.modes:  # untimed: the engines' first steps (compilation, allocation); no planner learns from it
        if m not in ADAPTIVE:
            asyncio.run(_generate(fixed_engine, None, tok, stop_ids, warm_ids, 8, Speculation(_METHOD[m])))
    fixed_engine.observers.append(recorder)  # after the warm-up, as the planners' logs start after theirs

    peers: dict[str, Any] = {}
    if args.peers:
        from specray.bench.peers import VllmPeer

        top = cfg.levels[-1]
        for p in args.peers:
            print(f"starting {p} ({top.model}, {top.num_threads or 1} threads) ...", flush=True)
            peers[p] = VllmPeer(p, top.model, threads=top.num_threads or 1, dtype=top.dtype)
    modes = [*args.modes, *args.peers]

    def run_peer(mode: str, i: int, ids: list[int]) -> tuple[int, float]:
        (res,) = peers[mode].run([(i, ids, args.max_tokens)], reset_cache=True).requests
        return res.tokens, res.seconds

    out = Path(args.out or Path(__file__).parent / "results" / f"coldstart-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    logs: list[dict[str, Any]] = []
    turn = 0
    for rep in range(args.repeats):
        for w, prompts in by_w.items():
            live: dict[str, tuple[CascadeEngine, LoggedPlanner]] = {}
            for m in args.modes:  # a fresh planner per pass: the cold start is what is measured
                if m in ADAPTIVE:
                    engine = CascadeEngine(levels, overlap=overlap)
                    if m in _NO_REPLAY:
                        engine.feed.replay = 0
                    planner = _PLANNERS[m](levels, k_max=pol.k_max, **kwargs)
                    live[m] = (engine, planner.attach(engine))
                    if args.warm_request:
                        planner.log.append({"ev": "request", "prompt": "warm-up"})
                        asyncio.run(_generate(engine, planner, tok, stop_ids, warm_ids, 8, None))
            shared = live.get("adaptive")
            for i, ids in enumerate(prompts):
                order = modes[turn % len(modes):] + modes[:turn % len(modes)]
                turn += 1
                for m in order:
                    if m in peers:
                        n, sec = run_peer(m, i, ids)
                        results.append({"repeat": rep, "workload": w, "prompt": i, "mode": m, "tokens": n,
                                        "seconds": sec})
                        print(f"rep {rep} {w} #{i} {m:12s} {n:3d} tok {n / sec:6.2f} tok/s", flush=True)
                        continue
                    for lv in levels:
                        if lv.worker is not None:
                            lv.worker.reset_prefix_cache()
                    engine, planner = live.get(m) or (shared if shared and m in args.shared else (fixed_engine, None))
                    (planner or recorder).log.append({"ev": "request", "repeat": rep, "workload": w, "prompt": i,
                                                      "mode": m, "t0": time.perf_counter()})
                    n, sec = run(engine, planner, ids, m)
                    results.append({"repeat": rep, "workload": w, "prompt": i, "mode": m, "tokens": n,
                                    "seconds": sec})
                    print(f"rep {rep} {w} #{i} {m:12s} {n:3d} tok {n / sec:6.2f} tok/s", flush=True)
            for m, (_, planner) in live.items():
                logs.append({"repeat": rep, "workload": w, "mode": m, "log": planner.log})
            out.write_text(json.dumps({"config": args.config, "settings": vars(args), "results": results,
                                       "planner_logs": logs, "fixed_log": recorder.log},
                                      separators=(",", ":")))  # a run cut short keeps these

    for engine in peers.values():
        engine.close()
    print("\n| tokens/s | " + " | ".join(modes) + " | adaptive / best fixed |" + "".join(f" / {p} |" for p in peers))
    print("|---|" + "---|" * (len(modes) + 1 + len(peers)))
    summary = {}
    for w in by_w:
        tps = {}
        for m in modes:
            sel = [r for r in results if r["workload"] == w and r["mode"] == m]
            tps[m] = sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel)
        fixed = {m: v for m, v in tps.items() if m in FIXED}
        best = max(fixed, key=fixed.get) if fixed else None
        ratios = {m: tps[m] / fixed[best] for m in ADAPTIVE if m in tps and best}
        over_peers = {p: {m: tps[m] / tps[p] for m in ADAPTIVE if m in tps} for p in peers}
        summary[w] = {"tok_s": tps, "best_fixed": best, "over_best_fixed": ratios, "over_peers": over_peers}
        print(f"| {w} | " + " | ".join(f"{tps[m]:.2f}" for m in modes) + " | "
              + ", ".join(f"{m} {r:.3f}" for m, r in ratios.items()) + f" ({best}) |"
              + "".join(" " + ", ".join(f"{m} {r:.3f}" for m, r in over_peers[p].items()) + " |" for p in peers))
    split = time_split(results, [*(lg["log"] for lg in logs), recorder.log])
    print("\n| workload, mode | tok/s | rounds | calls: seconds (calls, tokens fed per call) | host s | rest s |")
    print("|---|---|---|---|---|---|")
    for name, t in split.items():
        calls = "; ".join(f"{k} {c['s']:.1f} ({c['n']}, {c['tokens'] / c['n']:.1f})" for k, c in t["calls"].items())
        print(f"| {name} | {t['tokens'] / t['wall']:.2f} | {t['rounds']} | {calls} | {t['host']:.2f} | "
              f"{t['rest']:.1f} |")
    out.write_text(json.dumps({"config": args.config, "settings": vars(args), "summary": summary, "time_split": split,
                               "results": results, "planner_logs": logs, "fixed_log": recorder.log},
                              separators=(",", ":")))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
