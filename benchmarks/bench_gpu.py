"""The round on a real GPU: the hf backend's step times and the in-process cascade's overhead per round.

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu-calibration.json          # on a CUDA machine
    python benchmarks/bench_gpu.py --sizes tiny --device cpu --out /tmp/gpu-smoke.json    # the same code, anywhere
    python benchmarks/bench_gpu.py --count-ops --sizes tiny-vocab --device cpu --out /tmp/ops.json  # host ops, no GPU

Nothing can be downloaded on the GPU machines these benchmarks run on, so the models are random-weight Llama
models of the real shapes (Llama 3.2 1B and Llama 3.1 8B: layers, widths, heads, vocabulary) built in place in
bf16. Their outputs are meaningless; their step times are not, and step times are what this measures:

1. calibration: every forward of every run below is timed with the device synchronised on both sides, then
   `seconds = base + per_token * tokens fed` is fitted per model over the decode and verification calls (prefill
   excluded): the form of `specray.testing.sim.StepCostModel`, so the fit can stand beside the published-number
   presets that `bench_overhead.py` simulates.
2. the round: plain 8B, 1B -> 8B and n-gram -> 1B -> 8B (K 4 per level) at batch 1, 16 and 64, in-process (the
   same `CascadeEngine` the served coordinator drives). Per run: overhead per round = (wall - time inside the
   timed forwards) / rounds, the fraction of ideal (forward time / wall) and calls per round per level.
3. with `--count-ops` (instead of 1 and 2): the top-level aten ops per round issued outside the models' forwards
   (the worker's and the coordinator's host work: on a GPU each costs a dispatch and often a launch, some a
   synchronisation) and inside them, for plain / draft / cascade at batch 1 and 16 (greedy; `--count-sampled`
   adds temperature 1, top_p 0.95), counted with torch.profiler. A count, not a time, so a CPU measures it:
   `--sizes tiny-vocab` are 1-2 layer models with the real vocabulary 128256.

Random weights give near-flat logits, so the draft's acceptance is close to nothing and the n-gram level matches
only where greedy decoding loops; the overhead per round does not depend on acceptance, only on the calls a
round makes. One JSON file; results and the command in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.coordinator.state import Plan
from specray.engine.hf import HFWorker
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams

#: Llama shapes (config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B); "tiny-*" keep the code path testable on a CPU
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny-small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "tiny-big": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False),
    # the real vocabulary on tiny bodies: the host's work per call (sampling, verification) sees real row widths
    "tiny-vocab-small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=128256, tie_word_embeddings=True),
    "tiny-vocab-big": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=128256, tie_word_embeddings=False),
}
SIZES = {"gpu": ("llama-1b", "llama-8b"), "tiny": ("tiny-small", "tiny-big"),
         "tiny-vocab": ("tiny-vocab-small", "tiny-vocab-big")}
#: batch sizes and tokens per row of `--count-ops`
COUNT_BATCHES = (1, 16)
COUNT_TOKENS = 16
PROMPT_LEN = 128
MAX_PREFILL_FED = 32  # calls feeding more tokens than this per row are prefill, left out of the fit


def build(shape: str, device: str, seed: int) -> torch.nn.Module:
    """A random-weight Llama of `shape`, built directly on `device` in bf16 (no CPU copy of an 8B model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedWorker(HFWorker):
    """HFWorker whose every forward is timed with the device synchronised before and after (CUDA launches are
    asynchronous: without it the time lands wherever the next host read of a tensor happens to wait).

    Times are `time.monotonic()`, one clock for every process of the box, so a worker in a Ray actor can hand its
    spans to the driver: with `trace_path` set, `stats()` appends the forwards since the last call to that file
    (JSON lines), never inside a timed call."""

    calls: list[tuple[int, int, int, float]]  # (rows, query length, tokens fed, seconds)
    fit_calls: list[tuple[int, int, int, float]]
    spans: list[tuple[float, float]]  # (start, end) of each call
    trace_path: str | None = None
    _saved = 0

    def _forward(self, seqs, inputs, keep, parents=None):  # type: ignore[override]
        sync(self.device)
        t0 = time.monotonic()
        out = super()._forward(seqs, inputs, keep, parents)
        sync(self.device)
        t1 = time.monotonic()
        self.calls.append((len(seqs), max(len(x) for x in inputs), sum(len(x) for x in inputs), t1 - t0))
        self.spans.append((t0, t1))
        return out

    def stats(self):  # type: ignore[override]
        if self.trace_path is not None:
            with open(self.trace_path, "a") as f:
                for (rows, q, fed, _s), (a, b) in zip(self.calls[self._saved:], self.spans[self._saved:]):
                    f.write(json.dumps({"rows": rows, "q": q, "fed": fed, "start": a, "end": b}) + "\n")
            self._saved = len(self.calls)
        return super().stats()


def worker(shape: str, device: str, seed: int, trace_path: str | None = None) -> TimedWorker:
    # no prefix caching: the warm-up runs the timed run's prompts, and every timed run should prefill them
    w = TimedWorker(build(shape, device, seed), name=shape, dtype="bfloat16", device=device, max_context=4096,
                    prefix_caching=False)
    w.calls, w.fit_calls, w.spans = [], [], []  # every forward; those of timed runs (no warm-up) for the fit
    w.trace_path = trace_path
    return w


def prompts(batch: int, vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """Random token ids, a different stream per row."""
    out = []
    for b in range(batch):
        g = torch.Generator().manual_seed(1000 + b)
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


def union(spans: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def raw_step(model: torch.nn.Module, device: torch.device, vocab: int, batch: int, q: int, reps: int = 20) -> float:
    """Median seconds of one bare transformers forward (q new tokens per row over a 128-token cache), without
    specray's worker around it: how much of the worker's step is the model call itself."""
    from transformers import DynamicCache

    ids = torch.randint(0, vocab, (batch, PROMPT_LEN), device=device)
    new = torch.randint(0, vocab, (batch, q), device=device)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 3):
            cache = DynamicCache()
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            sync(device)
            t0 = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=q)
            sync(device)
            times.append(time.perf_counter() - t0)
    return sorted(times[3:])[reps // 2]


def fit(calls: Sequence[tuple[int, int, int, float]]) -> dict[str, Any]:
    """Least squares `seconds = base + per_token * tokens fed` over decode/verify calls."""
    pts = [(fed, s) for rows, q, fed, s in calls if q <= MAX_PREFILL_FED]
    if len(pts) < 2:
        return {"calls": len(pts)}
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    a = torch.stack([torch.ones_like(x), x], dim=1)
    sol = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
    resid = (a @ sol - y).abs() / y
    by_shape: dict[str, list[float]] = {}
    for rows, q, _fed, s in calls:
        if q <= MAX_PREFILL_FED:
            by_shape.setdefault(f"b{rows}q{q}", []).append(s)
    return {"calls": len(pts), "base_s": float(sol[0]), "per_token_s": float(sol[1]),
            "median_rel_error": float(resid.median()),
            "median_s_by_shape": {k: sorted(v)[len(v) // 2] for k, v in sorted(by_shape.items())}}


#: one forward: (rows, query length, tokens fed, start, end)
Forward = tuple[int, int, int, float, float]


class LocalForwards:
    """The forwards of in-process workers, from their own lists."""

    def __init__(self, workers: Sequence[TimedWorker]) -> None:
        self.workers = {w.name: w for w in workers}
        self.fit: dict[str, list[tuple[int, int, int, float]]] = {n: w.fit_calls for n, w in self.workers.items()}
        self.marks: dict[str, int] = {}

    def mark(self) -> None:
        self.marks = {n: len(w.calls) for n, w in self.workers.items()}

    def since_mark(self) -> dict[str, list[Forward]]:
        return {n: [(*c[:3], a, b) for c, (a, b) in zip(w.calls[self.marks[n]:], w.spans[self.marks[n]:])]
                for n, w in self.workers.items()}


class RemoteForwards:
    """The forwards of workers in level actors, read from the trace files their `stats()` appends to."""

    def __init__(self, workers: dict[str, Any], paths: dict[str, str]) -> None:
        self.workers, self.paths = workers, paths
        self.fit: dict[str, list[tuple[int, int, int, float]]] = {n: [] for n in workers}
        self.offsets = {n: 0 for n in workers}

    def _read(self) -> dict[str, list[Forward]]:
        out = {}
        for n, w in self.workers.items():
            w.stats()  # the actor writes its forwards since the last call
            with open(self.paths[n]) as f:
                f.seek(self.offsets[n])
                text = f.read()
                self.offsets[n] = f.tell()
            recs = [json.loads(line) for line in text.splitlines() if line.strip()]
            out[n] = [(r["rows"], r["q"], r["fed"], r["start"], r["end"]) for r in recs]
        return out

    def mark(self) -> None:
        self._read()

    def since_mark(self) -> dict[str, list[Forward]]:
        return self._read()


def run(levels: Sequence[Level], forwards: LocalForwards | RemoteForwards, plan: Plan, batch: int,
        max_tokens: int, vocab: int, device: torch.device, overlap: bool = False, nesting: Any = None,
        ) -> dict[str, Any]:
    """One timed `generate` after an untimed warm-up; the names of `forwards` are the levels whose forwards count."""
    engine = CascadeEngine(list(levels), overlap=overlap, nesting=nesting)
    ps = prompts(batch, vocab)
    generate(engine, ps, max_tokens=4, ignore_eos=True, plan=plan)  # warm-up: allocator, kernels, cache slots
    forwards.mark()
    sync(device)
    t0 = time.monotonic()
    out = generate(engine, ps, max_tokens=max_tokens, ignore_eos=True, plan=plan)
    sync(device)
    wall = time.monotonic() - t0
    pool = getattr(engine, "_ahead_pool", None)
    if pool is not None:
        pool.shutdown(wait=True)
    rounds = max(r.rounds for r in out.results)
    names = {lv.name for lv in levels}
    per_level, spans = {}, []
    for name, new in forwards.since_mark().items():
        if name not in names:
            continue
        forwards.fit[name] += [(rows, q, fed, b - a) for rows, q, fed, a, b in new]
        spans += [(a, b) for *_, a, b in new]
        per_level[name] = {"calls": len(new), "calls_per_round": len(new) / rounds,
                           "forward_s": sum(b - a for *_, a, b in new),
                           "decode_calls": sum(q <= MAX_PREFILL_FED for _, q, *_ in new)}
    model_s = union(spans)  # with overlap, forwards of two levels may run at once
    tokens = sum(len(r.token_ids) for r in out.results)
    stats = {n: st.as_dict() for n, st in out.stats.items()}
    return {"batch": batch, "max_tokens": max_tokens, "overlap": overlap, "rounds": rounds, "tokens": tokens,
            "wall_s": wall, "model_s": model_s, "overhead_ms_per_round": 1000 * (wall - model_s) / rounds,
            "fraction_of_ideal": model_s / wall, "tokens_per_s": tokens / wall, "levels": per_level,
            "acceptance": {n: {"rate": st.get("acceptance_rate"), "mean_len": st.get("mean_acceptance_length")}
                           for n, st in stats.items()},
            "outputs": [r.token_ids for r in out.results]}


def profile(small: TimedWorker, big: TimedWorker, k: int, vocab: int, device: torch.device, path: str) -> None:
    """The ops behind the worker's steps (host time first: syncs and per-shape setup show there)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    big_lv, small_lv = Level(big.name, worker=big), Level(small.name, worker=small, k=k)
    with open(path, "w") as f:
        for name, levels, plan in (("plain b1", [big_lv], Plan((0,), ())),
                                   ("draft b1", [small_lv, big_lv], Plan((0, 1), (k,)))):
            engine = CascadeEngine(levels)
            ps = prompts(1, vocab)
            generate(engine, ps, max_tokens=4, ignore_eos=True, plan=plan)
            with torch_profile(activities=acts) as prof:
                generate(engine, ps, max_tokens=6, ignore_eos=True, plan=plan)
                sync(device)
            for key in ("self_cpu_time_total", "cpu_time_total"):
                f.write(f"==== {name}: 6 tokens after a 128-token prompt, by {key}\n")
                f.write(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")


def _mark_forwards(model: torch.nn.Module) -> None:
    """Run every forward of `model` inside a profiler scope named MODEL (what `count_ops` keeps apart)."""
    from torch.autograd.profiler import record_function

    open_scopes: list[record_function] = []

    def enter(_mod: torch.nn.Module, _args: Any) -> None:
        scope = record_function("MODEL")
        scope.__enter__()
        open_scopes.append(scope)

    def leave(_mod: torch.nn.Module, _args: Any, _out: Any) -> None:
        open_scopes.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def _inside_model(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "MODEL":
            return True
        parent = parent.cpu_parent
    return False


def count_ops(plans: Sequence[tuple[str, list[Level], Plan]], batches: Sequence[int], tokens: int, vocab: int,
              device: torch.device, log: Any = print, sampling: SamplingParams | None = None) -> list[dict[str, Any]]:
    """Top-level aten ops per round (ops called by no other aten op) of generation (greedy, or `sampling`), split
    into those issued inside the models' forwards (scoped by `_mark_forwards`) and outside them: the host's own work
    per round."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sp = sampling or SamplingParams()
    label = "greedy" if sp.greedy else f"t{sp.temperature:g}-p{sp.top_p:g}"
    out = []
    for b in batches:
        ps = prompts(b, vocab)
        for name, levels, plan in plans:
            engine = CascadeEngine(list(levels))
            generate(engine, ps, max_tokens=4, ignore_eos=True, plan=plan, sampling=sp)  # warm-up: slots, capacity
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                res = generate(engine, ps, max_tokens=tokens, ignore_eos=True, plan=plan, sampling=sp)
                sync(device)
            rounds = max(r.rounds for r in res.results)
            top = [e for e in prof.events() if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
            inside = [e for e in top if _inside_model(e)]
            outside = collections.Counter(e.name for e in top if not _inside_model(e))
            row = {"plan": name, "batch": b, "sampling": label, "tokens": tokens, "rounds": rounds,
                   "outside_per_round": sum(outside.values()) / rounds, "inside_per_round": len(inside) / rounds,
                   "outside_by_op_per_round": {k: v / rounds for k, v in outside.most_common()}}
            out.append(row)
            log(f"ops {name:8s} {label} b{b:<3d} rounds {rounds:3d}  outside the models "
                f"{row['outside_per_round']:7.1f}/round  inside {row['inside_per_round']:7.1f}/round  most: "
                + ", ".join(f"{k[6:]} {v / rounds:.1f}" for k, v in outside.most_common(6)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", choices=tuple(SIZES), default="gpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 32, 32],
                    help="tokens per row at each batch size (the last repeats)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--overlap", action="store_true", help="also run the cascade with overlap at batch 1")
    ap.add_argument("--profile", help="also write torch.profiler tables of the worker's decode and verify steps here")
    ap.add_argument("--count-ops", action="store_true",
                    help="instead of timing: count the aten ops per round issued outside (and inside) the models' "
                         f"forwards, greedy, batch {' and '.join(map(str, COUNT_BATCHES))} (a CPU can do it)")
    ap.add_argument("--count-sampled", action="store_true",
                    help="with --count-ops: also count at temperature 1, top_p 0.95 (the general sampling path)")
    ap.add_argument("--inner-min-share", type=float, nargs="+", default=None,
                    help="the n-gram cascade's middle level runs each of these tail cuts at batches > 1 "
                         "(`LevelConfig.inner_min_share`; default: the config's default on the device)")
    ap.add_argument("--paths", nargs="+", choices=("inproc", "actors"), default=["inproc"],
                    help="in-process levels, and/or one Ray actor per model level on this node sharing the device "
                         "(the served layout; needs Ray)")
    ap.add_argument("--flat", action="store_true",
                    help="with actors: also run the cascade without nested drafting (the coordinator makes the "
                         "middle level's inner-round calls, as before n-gram levels could nest)")
    ap.add_argument("--norelay", action="store_true",
                    help="with actors: also run the drafted plans without relays (the drafts back through the "
                         "coordinator instead of straight from the level below the target to it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    small, big = SIZES[args.sizes]
    report: dict[str, Any] = {
        "schema": "specray.bench_gpu/1", "argv": sys.argv[1:], "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "models": {s: SHAPES[s] for s in (small, big)}, "runs": [], "errors": []}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    import transformers

    report["transformers"] = transformers.__version__
    vocab = SHAPES[big]["vocab_size"]
    k = args.k
    plan_of = {"plain": Plan((0,), ()), "draft": Plan((0, 1), (k,)), "cascade": Plan((0, 1, 2), (k, k))}
    if "inproc" in args.paths or args.count_ops:
        t0 = time.perf_counter()
        w_small, w_big = worker(small, args.device, 1), worker(big, args.device, 2)
        log(f"built {small} and {big} on {report['device']} in {time.perf_counter() - t0:.1f}s")
        ng = Level("ngram", ngram=NgramConfig(k, 1, 3), k=k)
        l_small, l_big = Level(small, worker=w_small, k=k), Level(big, worker=w_big)
        local_sets = {"plain": [l_big], "draft": [l_small, l_big], "cascade": [ng, l_small, l_big]}
    shares = args.inner_min_share or [0.25 if dev.type == "cuda" else 0.0]  # the config's default on the device
    jobs: list[tuple[str, int, int, bool, float]] = []
    for i, b in enumerate(args.batches):
        n = args.tokens[min(i, len(args.tokens) - 1)]
        for name in plan_of:
            jobs += [(name, b, n, False, sh) for sh in (shares if name == "cascade" and b > 1 else shares[:1])]
        if args.overlap and b == 1:
            jobs.append(("cascade", b, n, True, shares[0]))

    def run_jobs(path: str, level_sets: dict[str, list[Level]], forwards: LocalForwards | RemoteForwards,
                 nesting: Any, only: str | None = None) -> None:
        for name, b, n, ov, share in jobs:
            if only is not None and name != only:
                continue
            levels = level_sets[name]
            if len(levels) > 2:  # the middle level's tail cut (`Level.inner_min_share`)
                levels = [levels[0], replace(levels[1], inner_min_share=share), *levels[2:]]
            try:
                r = run(levels, forwards, plan_of[name], b, n, vocab, dev, overlap=ov, nesting=nesting)
            except Exception as e:  # keep what the other runs measured
                report["errors"].append({"path": path, "plan": name, "batch": b, "error": repr(e),
                                         "trace": traceback.format_exc()})
                log(f"{path} {name} b{b}: FAILED {e!r}")
                save()
                continue
            r["plan"], r["path"], r["inner_min_share"] = name, path, share if len(levels) > 2 else None
            report["runs"].append(r)
            cut = f"/t{share:g}" if len(levels) > 2 else ""
            log(f"{path:7s} {name + cut:13s} b{b:<3d} overlap={ov!s:5s} {r['tokens_per_s']:8.1f} tok/s  rounds "
                f"{r['rounds']:4d}  overhead {r['overhead_ms_per_round']:6.2f} ms/round  "
                f"ideal {r['fraction_of_ideal']:.3f}  calls/round "
                + " ".join(f"{lv} {d['calls_per_round']:.2f}" for lv, d in r["levels"].items()))
            save()

    if args.count_ops:
        for w in (w_small, w_big):
            _mark_forwards(w.model)
        report["schema"] = "specray.bench_gpu.ops/1"
        counted = [(n, local_sets[n], plan_of[n]) for n in plan_of]
        report["op_counts"] = count_ops(counted, COUNT_BATCHES, COUNT_TOKENS, vocab, dev, log)
        if args.count_sampled:
            report["op_counts"] += count_ops(counted, COUNT_BATCHES, COUNT_TOKENS, vocab, dev, log,
                                             SamplingParams(temperature=1.0, top_p=0.95, seed=0))
        save()
        return 0
    if "inproc" in args.paths:
        report["raw_step_s"] = {}
        for w in (w_small, w_big):
            report["raw_step_s"][w.name] = {f"b{b}q{q}": raw_step(w.model, dev, vocab, b, q)
                                            for b in (1, 64) for q in (1, args.k + 1)}
            log(f"bare forward {w.name}: " + ", ".join(f"{key} {1000 * v:.2f} ms"
                                                       for key, v in report["raw_step_s"][w.name].items()))
        save()
        if args.profile:
            profile(w_small, w_big, args.k, vocab, dev, args.profile)
            log(f"profile tables in {args.profile}")
        local = LocalForwards([w_small, w_big])
        run_jobs("inproc", local_sets, local, None)
        report["fit"] = {name: fit(calls) for name, calls in local.fit.items()}
        for name, f in report["fit"].items():
            if "base_s" in f:
                log(f"fit {name}: base {1000 * f['base_s']:.2f} ms + {1000 * f['per_token_s']:.4f} ms/token "
                    f"(median error {100 * f['median_rel_error']:.0f}%)")
        save()
        del local_sets, l_small, l_big, w_small, w_big, local  # the actors need the device's memory
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if "actors" in args.paths:
        actors_path(args, small, big, dev, run_jobs, report, log)
        save()
    plain = {(r["path"], r["batch"]): r["outputs"] for r in report["runs"] if r["plan"] == "plain"}
    first = {}  # the first path's plain outputs per batch: every path and plan must give them (greedy)
    for (_path, b), outs in plain.items():
        first.setdefault(b, outs)
    for r in report["runs"]:
        r["greedy_equal_plain"] = r["outputs"] == plain.get((r["path"], r["batch"]))
        r["greedy_equal_first_path"] = r["outputs"] == first.get(r["batch"])
        del r["outputs"]
    save()
    return 1 if report["errors"] else 0


def actors_path(args: argparse.Namespace, small: str, big: str, dev: torch.device, run_jobs: Any,
                report: dict[str, Any], log: Any) -> None:
    """The same plans with each model level in its own Ray actor on this node (`launch_levels`, the served
    coordinator's way; direct transport), the n-gram level in this process; the GPU shared by both actors."""
    import os
    import tempfile

    import ray

    from specray.config import CascadeConfig, LevelConfig, PlacementConfig
    from specray.serve.actors import RemoteNesting
    from specray.serve.launch import launch_levels

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    gpus = 1 if dev.type == "cuda" else 0
    ray.init(address="local", num_cpus=8, num_gpus=gpus, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    launched = None
    try:
        trace_dir = tempfile.mkdtemp(prefix="bench-gpu-")
        paths = {shape: os.path.join(trace_dir, f"{shape}.jsonl") for shape in (small, big)}
        for p in paths.values():
            open(p, "w").close()
        k = args.k
        cfg = CascadeConfig(levels=[
            LevelConfig(kind="ngram", name="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                        prompt_lookup_max=3),
            *(LevelConfig(kind="hf", name=shape, model=f"random:{shape}", num_speculative_tokens=k,
                          verify_method="greedy", num_cpus=1, num_threads=1, num_gpus=0.5 * gpus, device=args.device)
              for shape in (small, big)),
        ], placement=PlacementConfig(strategy="PACK"))
        t0 = time.perf_counter()
        factories = [None] + [functools.partial(worker, shape, args.device, seed, paths[shape])
                              for seed, shape in ((1, small), (2, big))]
        launched = launch_levels(cfg, factories=factories, name_prefix="bench-gpu", start_timeout_s=600)
        log(f"launched {small} and {big} in Ray actors in {time.perf_counter() - t0:.1f}s")
        lv = {x.name: x for x in launched.levels}
        forwards = RemoteForwards({n: launched.workers[n] for n in (small, big)}, paths)
        sets = {"plain": [lv[big]], "draft": [lv[small], lv[big]], "cascade": [lv["ngram"], lv[small], lv[big]]}
        run_jobs("actors", sets, forwards, launched.nesting)
        if args.norelay:  # the drafted plans again, with the drafts back through the coordinator
            for name in ("draft", "cascade"):
                run_jobs("actors-norelay", sets, forwards, RemoteNesting(relay=False), only=name)
        if args.flat:  # the cascade again with the coordinator making every inner round's call
            run_jobs("actors-flat", sets, forwards, None, only="cascade")
        report["fit_actors"] = {name: fit(calls) for name, calls in forwards.fit.items()}
    except Exception as e:
        report["errors"].append({"path": "actors", "error": repr(e), "trace": traceback.format_exc()})
        log(f"actors: FAILED {e!r}")
    finally:
        if launched is not None:
            launched.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
