"""The SLA experiment: throughput at a P90 latency ceiling, with and without speculation, against a running server.

    specray bench sla --url http://127.0.0.1:8001/v1 --rates 0.2 0.5 1 2 --workload extraction
    python -m specray.bench.sla --url ...      # the same without the specray command

Requests arrive as a Poisson process (exponential inter-arrival times, seeded) at each request rate, open loop:
a request is sent at its arrival time whether or not earlier ones have finished, so queueing shows in latency.
Each rate runs two phases on the same server, one with the server's speculation and one with
`"speculation": {"method": "none"}` per request (plain decoding through the same actors), with the same arrival
times and prompts (common random numbers), in alternating order from rate to rate. Every request is streamed
(SSE) and timed from its send: time to first token (TTFT), end-to-end latency, output tokens (the stream's usage
chunk), and the time per output token over the decode window, TPOT = (e2e - TTFT) / (tokens - 1).

Why not the gaps between chunks: speculation emits the tokens a round accepted together, in one chunk, so the
gaps between chunks are per-round times, not per-token times; averaging them overstates the time per token by
the tokens per chunk (reported as `tokens_per_chunk`). The decode window counts every token once.

Rates run lowest first; a mode that misses the ceiling at one rate skips the higher ones (`--all-rates` runs them),
and requests still running `--drain-s` after a phase's last arrival are cancelled and count as errors, so an
overloaded server cannot stretch the experiment without bound.

Per rate and mode: achieved throughput (output tokens/s and requests/s), P50/P90/P99 end-to-end latency, P90
TTFT, mean TPOT. The headline is the highest throughput whose P90 end-to-end latency is at most the ceiling
(`--p90-ceiling-s`; by default twice the P90 of plain decoding at the lowest rate), with and without
speculation, and their ratio. docs/bench.md ("SLA experiment") lists the JSON fields.

No Ray here: only the HTTP API (the official openai client's async API parses the SSE stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specray.bench.runner import row_max_tokens
from specray.bench.sla_stats import (
    CEILING_FACTOR,
    MODES,
    RequestRecord,
    default_ceiling,
    headline,
    meets,
    phase_rng,
    poisson_arrivals,
    summarize,
)

__all__ = ["SlaConfig", "add_sla_arguments", "main", "openai_base", "plot_latency", "run_experiment", "run_sla"]

PLAIN = {"method": "none"}  # the plain phase's per-request speculation


# ----------------------------------------------------------------------------------------------------- running


@dataclass
class SlaConfig:
    """What one experiment sends; `rows` are workload lines (`prompt` or `messages`, optional `max_tokens`)."""

    url: str
    rows: list[dict[str, Any]]
    rates: list[float]
    duration_s: float = 60.0
    warmup_s: float = 10.0
    modes: list[str] = field(default_factory=lambda: list(MODES))
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    speculation: dict[str, Any] | None = None
    seed: int = 0
    p90_ceiling_s: float | None = None
    timeout_s: float = 600.0
    drain_s: float | None = 300.0
    all_rates: bool = False
    api_key: str = "unused"
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates: need one or more request rates > 0, got {self.rates}")
        self.rates = sorted(set(self.rates))  # lowest first: the default ceiling comes from the lowest rate
        if self.drain_s is not None and self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0 (or None: wait for every request), got {self.drain_s}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s={self.duration_s}), got {self.warmup_s}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes: choose from {', '.join(MODES)}, got {self.modes}")
        if not self.rows:
            raise ValueError("rows: no prompts")

    def schedule(self, rate: float) -> tuple[list[float], list[int]]:
        """(arrival times, prompt index per arrival) of `rate`: seeded, identical for every mode."""
        times = poisson_arrivals(rate, self.duration_s, phase_rng(self.seed, rate, "arrivals"))
        prng = phase_rng(self.seed, rate, "prompts")
        return times, [prng.randrange(len(self.rows)) for _ in times]


def openai_base(url: str) -> str:
    """The OpenAI base URL (ending in /v1) of a server given with or without /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def _send(client: Any, cfg: SlaConfig, model: str, row: dict[str, Any], mode: str, rec: RequestRecord,
                t0: float) -> None:
    """Stream one request and fill `rec` (a failure is recorded, never raised)."""
    extra: dict[str, Any] = {}
    if mode == "plain":
        extra["speculation"] = PLAIN
    elif cfg.speculation:
        extra["speculation"] = cfg.speculation
    if cfg.ignore_eos:
        extra["ignore_eos"] = True
    kw = dict(model=model, max_tokens=row_max_tokens(row, cfg.max_tokens), temperature=cfg.temperature, stream=True,
              stream_options={"include_usage": True}, extra_body=extra or None)
    start = time.perf_counter()
    rec.sent_s = start - t0
    usage_tokens = None
    try:
        if "messages" in row:
            stream = await client.chat.completions.create(messages=row["messages"], **kw)
        else:
            stream = await client.completions.create(prompt=row["prompt"], **kw)
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None and not chunk.choices:
                    usage_tokens = chunk.usage.completion_tokens
                    spec = (chunk.usage.model_extra or {}).get("speculation") or {}
                    if spec:  # per level, smallest first: the last one is the target
                        target = list(spec.values())[-1]
                        rec.draft_tokens, rec.accepted_tokens = target["draft_tokens"], target["accepted_tokens"]
                for choice in chunk.choices:
                    text = choice.delta.content if "messages" in row else choice.text
                    if text:
                        rec.chunks += 1
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - start
        rec.e2e_s = time.perf_counter() - start
        if usage_tokens is None:
            raise RuntimeError("the stream sent no usage chunk (stream_options.include_usage)")
        rec.output_tokens = usage_tokens
    except Exception as exc:  # recorded per request: one failure must not end the experiment
        rec.e2e_s = None
        rec.error = f"{type(exc).__name__}: {exc}"[:500]


async def _phase(client: Any, cfg: SlaConfig, model: str, rate: float, mode: str, bar: Any) -> list[RequestRecord]:
    """Send the rate's arrivals open loop (each at its time, not waiting for earlier ones), then wait for them:
    at most `drain_s` after the last arrival; requests still running then are cancelled and recorded as errors."""
    times, picks = cfg.schedule(rate)
    records = [RequestRecord(rate=rate, mode=mode, index=i, arrival_s=t, warmup=t < cfg.warmup_s)
               for i, t in enumerate(times)]
    if bar is not None:
        bar.set_postfix_str(f"{rate:g} req/s {mode}")
    tasks = []
    t0 = time.perf_counter()

    async def one(rec: RequestRecord, row: dict[str, Any]) -> None:
        await _send(client, cfg, model, row, mode, rec, t0)
        if bar is not None:
            bar.update(1)

    for rec, pick in zip(records, picks):
        delay = t0 + rec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(rec, cfg.rows[pick])))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=cfg.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task, rec in zip(tasks, records):
            if task.cancelled():
                rec.e2e_s = None
                rec.error = f"cancelled: still running {cfg.drain_s:g} s after the last arrival (drain_s)"
                if bar is not None:
                    bar.update(1)
    return records


async def run_experiment(cfg: SlaConfig) -> dict[str, Any]:
    """Every rate, both modes (alternating which goes first), then the summary points and the headline."""
    import openai
    from tqdm.auto import tqdm

    client = openai.AsyncOpenAI(base_url=openai_base(cfg.url), api_key=cfg.api_key, max_retries=0,
                                timeout=cfg.timeout_s)
    try:
        try:
            model = cfg.model or (await client.models.list()).data[0].id
        except openai.APIError as exc:
            raise RuntimeError(f"{openai_base(cfg.url)}/models: {type(exc).__name__}: {exc}") from None
        for mode in cfg.modes:  # one short request each first: nothing measured pays for a cold start
            warm = RequestRecord(rate=0.0, mode=mode, index=-1, arrival_s=0.0)
            await _send(client, replace(cfg, max_tokens=4), model, cfg.rows[0], mode, warm, time.perf_counter())
            if warm.error:
                raise RuntimeError(f"the warm-up request ({mode}) failed: {warm.error}")
        total = sum(len(cfg.schedule(r)[0]) for r in cfg.rates) * len(cfg.modes)
        records: list[RequestRecord] = []
        points: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        failed: dict[str, float] = {}  # mode -> the rate where it first missed the ceiling
        ceiling = cfg.p90_ceiling_s
        with tqdm(total=total, desc="sla", unit="req", disable=not cfg.progress, file=sys.stderr) as bar:
            for i, rate in enumerate(cfg.rates):
                for mode in cfg.modes if i % 2 == 0 else cfg.modes[::-1]:
                    if mode in failed:  # a higher rate only queues more: skip it
                        skipped.append({"rate": rate, "mode": mode, "reason": f"missed the ceiling at "
                                        f"{failed[mode]:g} req/s (--all-rates runs it anyway)"})
                        bar.update(len(cfg.schedule(rate)[0]))
                        continue
                    recs = await _phase(client, cfg, model, rate, mode, bar)
                    records += recs
                    points.append(summarize(recs, rate, mode, cfg.duration_s - cfg.warmup_s))
                if ceiling is None:  # known after the lowest rate
                    ceiling = default_ceiling(points)
                if not cfg.all_rates and ceiling is not None:
                    for p in points:
                        if p["rate"] == rate and not meets(p, ceiling):
                            failed.setdefault(p["mode"], rate)
    finally:
        await client.close()
    points.sort(key=lambda p: (p["rate"], MODES.index(p["mode"])))
    rule = ("given (--p90-ceiling-s)" if cfg.p90_ceiling_s is not None
            else f"{CEILING_FACTOR:g} x the P90 e2e latency of plain decoding at the lowest rate")
    return {
        "config": {"url": cfg.url, "model": model, "rates": cfg.rates, "modes": cfg.modes,
                   "duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s, "max_tokens": cfg.max_tokens,
                   "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "speculation": cfg.speculation,
                   "seed": cfg.seed, "drain_s": cfg.drain_s, "all_rates": cfg.all_rates, "prompts": len(cfg.rows),
                   "workloads": sorted({r.get("workload", "") for r in cfg.rows} - {""})},
        "ceiling": {"p90_e2e_s": ceiling, "rule": rule},
        "points": points,
        "skipped": skipped,
        "headline": headline(points, ceiling),
        "requests": [r.as_dict() for r in records],
    }


# -------------------------------------------------------------------------------------------------- reporting


def plot_latency(result: dict[str, Any], path: Path) -> bool:
    """P90 e2e and P90 TTFT against request rate per mode, the ceiling drawn, and achieved throughput beside;
    False (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"speculation": "tab:blue", "plain": "tab:orange"}
    for mode in result["config"]["modes"]:
        pts = [p for p in result["points"] if p["mode"] == mode]
        rates = [p["rate"] for p in pts]
        lat.plot(rates, [p["e2e_p90_s"] for p in pts], "o-", color=colors[mode], label=f"{mode}: P90 e2e")
        lat.plot(rates, [p["ttft_p90_s"] for p in pts], "s--", color=colors[mode], label=f"{mode}: P90 TTFT")
        thr.plot(rates, [p["throughput_tok_s"] for p in pts], "o-", color=colors[mode], label=mode)
    ceiling = result["ceiling"]["p90_e2e_s"]
    if ceiling is not None:
        lat.axhline(ceiling, color="tab:red", linestyle=":", label=f"ceiling {ceiling:.2f} s")
    lat.set(xlabel="request rate (req/s)", ylabel="latency (s)", title="P90 latency against request rate")
    thr.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="achieved throughput")
    rates = result["config"]["rates"]
    for ax in (lat, thr):
        if max(rates) >= 10 * min(rates):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(result: dict[str, Any]) -> str:
    """A text table of the points and the headline."""
    lines = [f"{'rate':>6} {'mode':<12} {'req':>4} {'err':>4} {'tok/s':>8} {'req/s':>6} {'p50 e2e':>8} "
             f"{'p90 e2e':>8} {'p99 e2e':>8} {'p90 ttft':>8} {'tpot ms':>8}"]
    for p in result["points"]:
        lines.append(f"{p['rate']:>6g} {p['mode']:<12} {p['requests']:>4} {p['errors']:>4} "
                     f"{_fmt(p['throughput_tok_s']):>8} {_fmt(p['throughput_req_s']):>6} {_fmt(p['e2e_p50_s']):>8} "
                     f"{_fmt(p['e2e_p90_s']):>8} {_fmt(p['e2e_p99_s']):>8} {_fmt(p['ttft_p90_s']):>8} "
                     f"{_fmt(p['tpot_mean_s'] and p['tpot_mean_s'] * 1000, '.1f'):>8}")
    h = result["headline"]
    lines.append(f"P90 e2e ceiling {_fmt(h['p90_ceiling_s'])} s ({result['ceiling']['rule']})")
    for mode in MODES:
        best = h[mode]
        lines.append(f"  {mode:<12} " + ("no rate meets the ceiling" if best is None else
                                         f"{best['throughput_tok_s']:.2f} tok/s at {best['rate']:g} req/s "
                                         f"(P90 e2e {best['e2e_p90_s']:.2f} s)"))
    if h["throughput_ratio"] is not None:
        lines.append(f"  throughput at the ceiling, speculation / plain: {h['throughput_ratio']:.2f}x")
    for sk in result["skipped"]:
        lines.append(f"  skipped {sk['mode']} at {sk['rate']:g} req/s: {sk['reason']}")
    if any(h[m] and h[m]["at_highest_rate"] for m in MODES):
        lines.append("  note: a mode meets the ceiling at the highest rate tried, so its limit was not reached: "
                     "add higher --rates")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------- CLI


def add_sla_arguments(p: argparse.ArgumentParser, url: bool = True) -> None:
    """The SLA experiment's options (`specray bench sla`, `python -m specray.bench.sla`, benchmarks/bench_sla.py);
    `url=False` leaves out --url for a caller that starts the server itself and sets `args.url`."""
    if url:
        p.add_argument("--url", required=True,
                       help="a running server's OpenAI base URL, e.g. http://127.0.0.1:8001/v1 (/v1 may be left out)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.5, 1.0, 2.0],
                   help="request rates (requests/s) of the Poisson arrivals, one phase per rate and mode")
    p.add_argument("--workload", nargs="+", default=None,
                   help="shipped workload sets by name (default: extraction)")
    p.add_argument("--workload-file", nargs="+", default=[], help="your own JSONL workload files")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrivals per phase last this long")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="requests arriving in the first seconds of a phase are sent but not measured")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="speculation: the server's plan; plain: `speculation: {method: none}` per request")
    p.add_argument("--speculation", type=json.loads, default=None,
                   help='JSON `speculation` field of the speculative phase, e.g. \'{"method": "ngram"}\' '
                        "(default: the server's plan)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default: each line's max_tokens, else 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of both phases (0: greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens whatever is sampled")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival times and the prompt order")
    p.add_argument("--p90-ceiling-s", type=float, default=None,
                   help=f"P90 end-to-end latency ceiling in seconds (default: {CEILING_FACTOR:g} x the P90 of plain "
                        "decoding at the lowest rate)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    p.add_argument("--drain-s", type=float, default=300.0,
                   help="after a phase's last arrival, wait this long for the requests in flight, then cancel them "
                        "(recorded as errors: the rate misses the ceiling)")
    p.add_argument("--all-rates", action="store_true",
                   help="run every rate; by default a mode skips the rates above one where it missed the ceiling")
    p.add_argument("--api-key", default="unused", help="bearer token of the server")
    p.add_argument("--out", type=Path, default=None, help="JSON result file (default: sla-<time>.json here)")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default: the JSON file's name, .png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from specray.bench.workloads import load_workloads

    names = args.workload if args.workload is not None else ([] if args.workload_file else ["extraction"])
    return load_workloads(names, args.workload_file)


def run_sla(args: argparse.Namespace) -> int:
    """Run the experiment of parsed `add_sla_arguments` options; writes the JSON (and the plot), prints a table.
    Exit code 0; 2 (with the message) on bad input; 1 when the server cannot be reached or refuses the warm-up."""
    try:
        cfg = SlaConfig(url=args.url, rows=_rows(args), rates=args.rates, duration_s=args.duration_s,
                        warmup_s=args.warmup_s, modes=args.modes, model=args.model, max_tokens=args.max_tokens,
                        temperature=args.temperature, ignore_eos=args.ignore_eos, speculation=args.speculation,
                        seed=args.seed, p90_ceiling_s=args.p90_ceiling_s, timeout_s=args.timeout_s,
                        drain_s=args.drain_s, all_rates=args.all_rates, api_key=args.api_key,
                        progress=not args.quiet)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_experiment(cfg))
    except RuntimeError as exc:  # the server cannot be reached, or its warm-up request failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = args.out or Path(f"sla-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"wrote {out}")
    if not args.no_plot:
        png = args.plot or out.with_suffix(".png")
        if plot_latency(result, png):
            print(f"wrote {png}")
    return 0


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specray.bench.sla", description=__doc__, formatter_class=_Help)
    add_sla_arguments(p)
    return run_sla(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
