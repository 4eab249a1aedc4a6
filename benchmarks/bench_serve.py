"""The served application, end to end: `serve run CONFIG.yaml`, then batch-1 chat requests over HTTP, beside the
engine a user would otherwise run.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_serve.py serve_config.yaml --peers

For each config file (one after another, each in its own `serve run` process and Ray), every prompt of the chosen
sets is sent one request at a time to /v1/chat/completions (greedy, --max-tokens): once with the served plan and
once with `"speculation": {"method": "none"}` (plain decoding through the same actors), each after `POST
/reset_prefix_cache` (so neither finds its prompt prefilled by the other). `--peers` also runs vLLM's own loop on
the same prompts (plain and with its own n-gram speculation, 2 threads: the cores the served levels use together):
one pass over the prompts per peer, its engine kept up in a fresh process beside the app
(`specray.bench.peers.VllmPeer`) and asked every prompt right beside the app's two requests for it, the order
rotating from prompt to prompt. While a peer answers, the app's processes, Ray's included, are stopped: an idle Ray
app keeps about a third of the 2 cores busy, which a user running vLLM alone would not share (`--app-beside-peers`
keeps them running). The box's speed drifts by tens of percent within minutes (other tenants), so only contenders
measured in the same minute compare. Reported per set: tokens/s of each contender (the served and plain rows pooled
over the passes), the served plan's ratio to plain and to each peer (against the served rows of that peer's pass),
and the target's acceptance from the responses' `usage.speculation`. This is what a user of the deployment sees, Ray
actors and HTTP included, unlike bench_core (one process, no Serve). Writes benchmarks/results/serve-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompts import SETS
from served_app import paused, processes, serve_run, tree

from specray.bench.workloads import prompt_ids

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


class Peer:
    """vLLM's own loop in one mode ("plain" or "ngram"), its engine kept up in a process of its own, asked one
    prompt at a time (the chat template applied here, as the app applies it)."""

    def __init__(self, model: str, mode: str, threads: int, temperature: float) -> None:
        from specray.bench.peers import VllmPeer
        from specray.engine.models import load_tokenizer, resolve_model

        self.name = f"vllm_{mode}"
        self._tok = load_tokenizer(str(resolve_model(model)))
        print(f"   starting vLLM's own loop, {mode}, {threads} threads ...", flush=True)
        self.engine = VllmPeer(self.name, model, threads=threads, temperature=temperature)

    def pids(self, procs: dict[int, tuple[int, float]]) -> set[int]:
        """The engine's processes (its child, vLLM's engine core and worker)."""
        return tree(self.engine.pid, procs)

    def ask(self, index: int, text: str, max_tokens: int) -> tuple[int, float]:
        """(tokens, seconds) of one greedy (or, at a temperature, seeded by `index`) request."""
        ids = prompt_ids(self._tok, {"messages": [{"role": "user", "content": text}]})
        (res,) = self.engine.run([(index, ids, max_tokens)]).requests
        return res.tokens, res.seconds


def bench_config(config: Path, sets: list[str], max_tokens: int, startup_s: float, temperature: float = 0.0,
                 peers: list[Callable[[], Peer]] | None = None, pause_app: bool = True) -> dict:
    """Per set: tokens/s of the served plan and of plain decoding through the same app, and the served plan's
    ratio to each peer. One pass over the prompts per peer, that peer's engine up beside the app (one at a time:
    two more engines of the target's size do not fit beside the app in 24 GiB), the contenders' order rotating
    from prompt to prompt; the served and plain rows of every pass are pooled, and each peer is compared with the
    served rows of its own pass. `pause_app`: the app's processes (Ray's too) are stopped while a peer answers, so
    the peer has the box to itself, as without the app (`served_app.paused`)."""
    print(f"== {config}: starting `serve run` (models load in the level actors) ...", flush=True)
    t0 = time.monotonic()
    passes: list[Callable[[], Peer] | None] = list(peers) if peers else [None]
    acc: dict[str, dict[str, list[float]]] = {name: {} for name in sets}  # set -> contender -> [tokens, seconds]
    acceptance = {name: [0, 0] for name in sets}  # the target's drafted and accepted tokens, served rows

    def add(name: str, who: str, n: int, dt: float) -> None:
        cell = acc[name].setdefault(who, [0, 0.0])
        cell[0] += n
        cell[1] += dt

    with serve_run(config, startup_s) as (url, model, app), httpx.Client(base_url=url, timeout=600) as client:
        print(f"   ready in {time.monotonic() - t0:.0f}s", flush=True)
        ask(client, model, "Say hi.", 8, plain=False)  # warm-up
        for start in passes:
            peer = start() if start is not None else None
            try:
                contenders = ["served", "plain"] + ([peer.name] if peer else [])
                index = 0
                for name in sets:
                    for i, text in enumerate(SETS[name]):
                        turn = index % len(contenders)  # each contender first, second, ... in turn
                        for who in contenders[turn:] + contenders[:turn]:
                            before = processes()
                            if peer is not None and who == peer.name:
                                with paused(app) if pause_app else nullcontext():
                                    n, dt = peer.ask(index, text, max_tokens)
                            else:
                                n, dt, spec = ask(client, model, text, max_tokens, who == "plain", temperature)
                                if who == "served" and spec:  # per level, small to large: the last is the target
                                    target = list(spec.values())[-1]
                                    acceptance[name][0] += target.get("draft_tokens", 0)
                                    acceptance[name][1] += target.get("accepted_tokens", 0)
                            add(name, who, n, dt)
                            if peer is not None:  # CPU others used meanwhile: beside the peer, all but it; beside
                                after = processes()  # the app's requests, the idle peer
                                mine = peer.pids(after)
                                spent = sum(c - before.get(pid, (0, 0.0))[1] for pid, (_, c) in after.items()
                                            if (pid in mine) != (who == peer.name))
                                add(name, f"{who}:others_cpu", 0, spent)
                                if who == "served":
                                    add(name, f"served_beside_{peer.name}:others_cpu", 0, spent)
                            if peer is not None and who == "served":  # beside this pass's peer
                                add(name, f"served_beside_{peer.name}", n, dt)
                            print(f"   {name} #{i} {who:10s} {n:3d} tok {dt:6.1f}s {n / dt:5.2f} tok/s", flush=True)
                        index += 1
            finally:
                if peer is not None:
                    peer.engine.close()
    out: dict = {}
    for name in sets:
        res: dict = {c: {"tokens": v[0], "seconds": v[1], "tok_s": v[0] / v[1]} for c, v in acc[name].items()
                     if not c.endswith(":others_cpu")}
        for c in list(res):  # cores the other processes kept busy during c's requests (measured with a peer up)
            if f"{c}:others_cpu" in acc[name]:
                res[c]["others_cores"] = acc[name][f"{c}:others_cpu"][1] / res[c]["seconds"]
        res["speedup"] = res["served"]["tok_s"] / res["plain"]["tok_s"]
        for c in [c for c in res if c.startswith("vllm_")]:
            res[f"vs_{c}"] = res[f"served_beside_{c}"]["tok_s"] / res[c]["tok_s"]
        drafted, accepted = acceptance[name]
        res["target_acceptance"] = accepted / drafted if drafted else None
        out[name] = res
        print(f"   {name}: served {res['served']['tok_s']:.2f} tok/s, plain {res['plain']['tok_s']:.2f} tok/s, "
              f"{res['speedup']:.2f}x" + "".join(f"; {c} {res[c]['tok_s']:.2f} tok/s (others busy "
                                                 f"{res[c]['others_cores']:.2f} cores beside it), served beside it "
                                                 f"{res[f'served_beside_{c}']['tok_s']:.2f} ({res[f'vs_{c}']:.2f}x)"
                                                 for c in res if c.startswith("vllm_")), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path, help="Serve config files, benchmarked one after another")
    ap.add_argument("--sets", nargs="+", default=["code", "extraction", "chat"], choices=list(SETS))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--startup-s", type=float, default=900, help="wait this long for the app (first start converts)")
    ap.add_argument("--peers", nargs="*", default=None, choices=["plain", "ngram"],
                    help="also measure vLLM's own loop on the same prompts, interleaved with the app's requests: "
                         "these modes (no value: plain and ngram), with --peer-threads threads")
    ap.add_argument("--peer-threads", type=int, default=2, help="threads of vLLM's engine (default: the 2 cores "
                                                                "the served levels use together)")
    ap.add_argument("--app-beside-peers", action="store_true",
                    help="keep the app's processes running while a peer answers (default: stopped meanwhile, so "
                         "the peer has the box to itself; an idle Ray app keeps about a third of 2 cores busy)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: sampled (no seed), vLLM's peers with one seed per prompt")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    modes = None if args.peers is None else (args.peers or ["plain", "ngram"])

    def peers_for(config: Path) -> list[Callable[[], Peer]] | None:
        if modes is None:
            return None
        target = yaml.safe_load(config.read_text())["applications"][0]["args"]["config"]["cascade"]
        model = target["levels"][-1]["model"]
        return [lambda m=m: Peer(model, m, args.peer_threads, args.temperature) for m in modes]

    results = {str(c): bench_config(c, args.sets, args.max_tokens, args.startup_s, args.temperature, peers_for(c),
                                    pause_app=not args.app_beside_peers) for c in args.configs}
    print("\ntokens/s; (served / vLLM's own n-gram, the served rows of its pass), where measured")
    print("config".ljust(39) + "".join(f"{s:>24s}" for s in args.sets))
    for c, res in results.items():
        cells = []
        for s in args.sets:
            ratio = f" ({res[s]['vs_vllm_ngram']:4.2f}x)" if "vs_vllm_ngram" in res[s] else " " * 8
            cells.append(f"{res[s]['served']['tok_s']:7.2f}{ratio} plain {res[s]['plain']['tok_s']:5.2f}")
        print(c[-39:].ljust(39) + "".join(f"{cell:>24s}" for cell in cells))
        for peer in [k for k in res[args.sets[0]] if k.startswith("vllm_")]:
            print(f"  {peer} ({args.peer_threads} threads)".ljust(39)
                  + "".join(f"{res[s][peer]['tok_s']:7.2f} (served {res[s][f'served_beside_{peer}']['tok_s']:5.2f})"
                            .rjust(24) for s in args.sets))
    out = args.out or ROOT / "benchmarks" / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "interleaved": True,
                               "app_paused_beside_peers": modes is not None and not args.app_beside_peers,
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
