"""The served application, end to end: `serve run CONFIG.yaml`, then batch-1 chat requests over HTTP.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_serve.py serve_config.yaml --sets code extraction chat

For each config file (one after another, each in its own `serve run` process and Ray), every prompt of the chosen
sets is sent twice, one request at a time to /v1/chat/completions (greedy, --max-tokens): once with the served plan
and once with `"speculation": {"method": "none"}` (plain decoding through the same actors), in alternating order,
each after `POST /reset_prefix_cache` (so neither finds its prompt prefilled by the other). Reported per set:
tokens/s of both, their ratio, and the target's acceptance from the responses' `usage.speculation`. This is what a
user of the deployment sees, Ray actors and HTTP included, unlike bench_core (one process, no Serve). `--peers` then
measures the engine a user would otherwise run on the same prompts: vLLM's own loop, plain and with its own n-gram
speculation (`peers.py`, 2 threads: the cores the served levels use together). With `--peers-beside` the peers are
measured once per config, right after its requests and while its app is still up and idle (the app's models in
memory, no requests), so that each config is compared with peers measured in the same few minutes: the box's speed
drifts over a run (other tenants), and an idle app does not slow the peer down (benchmarks/README.md section 0).
Writes benchmarks/results/serve-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS
from served_app import serve_run

ROOT = Path(__file__).resolve().parent.parent


def ask(client: httpx.Client, model: str, text: str, max_tokens: int, plain: bool,
        temperature: float = 0.0) -> tuple[int, float, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": temperature}  # no seed: sampled rows are verified inside a vLLM target's step
    if plain:
        body["speculation"] = {"method": "none"}
    # every request prefills its prompt whole, as vLLM's peers (a fresh engine each) do: each prompt is asked twice
    r = client.post("/reset_prefix_cache")  # (served and plain), and the second would find it cached
    r.raise_for_status()
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["completion_tokens"], dt, usage.get("speculation") or {}


def bench_config(config: Path, sets: list[str], max_tokens: int, startup_s: float, temperature: float = 0.0,
                 beside: Callable[[], dict] | None = None) -> tuple[dict, dict]:
    """Per set: served and plain tokens/s; and `beside()`'s result, called while the app is still up (else {})."""
    print(f"== {config}: starting `serve run` (models load in the level actors) ...", flush=True)
    out: dict = {}
    peers: dict = {}
    t0 = time.monotonic()
    with serve_run(config, startup_s) as (url, model):
        print(f"   ready in {time.monotonic() - t0:.0f}s", flush=True)
        with httpx.Client(base_url=url, timeout=600) as client:
            ask(client, model, "Say hi.", 8, plain=False)  # warm-up
            for name in sets:
                acc = {"plain": [0, 0.0], "served": [0, 0.0]}
                drafted = accepted = 0
                for i, text in enumerate(SETS[name]):
                    order = (True, False) if i % 2 == 0 else (False, True)
                    for plain in order:
                        n, dt, spec = ask(client, model, text, max_tokens, plain, temperature)
                        key = "plain" if plain else "served"
                        acc[key][0] += n
                        acc[key][1] += dt
                        if not plain and spec:  # per level, small to large: the last is the target
                            target = list(spec.values())[-1]
                            drafted += target.get("draft_tokens", 0)
                            accepted += target.get("accepted_tokens", 0)
                        print(f"   {name} #{i} {key:6s} {n:3d} tok {dt:6.1f}s {n / dt:5.2f} tok/s", flush=True)
                res = {k: {"tokens": v[0], "seconds": v[1], "tok_s": v[0] / v[1]} for k, v in acc.items()}
                res["speedup"] = res["served"]["tok_s"] / res["plain"]["tok_s"]
                res["target_acceptance"] = accepted / drafted if drafted else None
                out[name] = res
                print(f"   {name}: served {res['served']['tok_s']:.2f} tok/s, plain {res['plain']['tok_s']:.2f} "
                      f"tok/s, {res['speedup']:.2f}x", flush=True)
        if beside is not None:
            print("   vLLM's own loop beside it (the app idle) ...", flush=True)
            peers = beside()
    return out, peers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path, help="Serve config files, benchmarked one after another")
    ap.add_argument("--sets", nargs="+", default=["code", "extraction", "chat"], choices=list(SETS))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--startup-s", type=float, default=900, help="wait this long for the app (first start converts)")
    ap.add_argument("--peers", nargs="*", default=None, choices=["plain", "ngram"],
                    help="after the configs, also measure vLLM's own loop on the same prompts (peers.py): these "
                         "modes (no value: plain and ngram), with --peer-threads threads")
    ap.add_argument("--peers-beside", action="store_true",
                    help="measure the peers once per config while its app is up and idle, instead of once after "
                         "all configs; each config's ratios use its own peers")
    ap.add_argument("--peer-threads", type=int, default=2, help="threads of vLLM's engine (default: the 2 cores "
                                                                "the served levels use together)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: sampled (no seed), vLLM's peers with one seed per prompt")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.peers_beside and args.peers is None:
        ap.error("--peers-beside needs --peers")

    def run_peers() -> dict:
        from peers import measure

        target = yaml.safe_load(args.configs[0].read_text())["applications"][0]["args"]["config"]["cascade"]
        model = target["levels"][-1]["model"]
        return measure(model, args.peers or ["plain", "ngram"], args.peer_threads, args.sets, args.max_tokens,
                       temperature=args.temperature)

    results, beside = {}, {}
    for c in args.configs:
        results[str(c)], beside[str(c)] = bench_config(c, args.sets, args.max_tokens, args.startup_s,
                                                       args.temperature, run_peers if args.peers_beside else None)
    peers = run_peers() if args.peers is not None and not args.peers_beside else {}
    print("\ntokens/s (ratio to vLLM's own n-gram where measured)".ljust(40))
    print("config".ljust(39) + "".join(f"{s:>24s}" for s in args.sets))

    def cell(res: dict, s: str, ngram: dict) -> str:
        served = res[s]["served"]["tok_s"]
        ratio = f" ({served / ngram[s]['tok_s']:4.2f}x)" if s in ngram else " " * 8
        return f"{served:7.2f}{ratio} plain {res[s]['plain']['tok_s']:5.2f}"

    def peer_rows(found: dict, where: str = "") -> None:
        for mode, res in found.items():
            print(f"  vLLM own {mode} ({res['threads']} threads){where}".ljust(39)
                  + "".join(f"{res['sets'][s]['tok_s']:24.2f}" for s in args.sets))

    for c, res in results.items():
        mine = beside[c] or peers
        print(c[-39:].ljust(39) + "".join(f"{cell(res, s, mine.get('ngram', {}).get('sets', {})):>24s}"
                                           for s in args.sets))
        peer_rows(beside[c], " beside")
    peer_rows(peers)
    out = args.out or ROOT / "benchmarks" / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                               "peers": peers, "peers_beside": {c: p for c, p in beside.items() if p}}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
