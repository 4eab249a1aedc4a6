"""The report of `specray bench`: per (workload, batch, mode or peer) speed, acceptance and the fraction of the
Leviathan bound reached; a versioned JSON document (schema: specray/bench/schema.json, `validate`) and PNG plots.

Definitions (docs/bench.md):
- tokens_per_s: generated tokens over the wall time of the chunks (end to end, prefill included).
- ttft_s: mean time from a request's submission to its first token (each request's in per_request).
- decode_tokens_per_s: per request, the tokens after the first over the time after it, summed over requests
  (the inverse of the time per output token; equals the end-to-end rate's decode phase at batch 1).
- speedup: tokens_per_s over mode `none`'s on the same workload and batch (same chunks, same target).
- alphas: per position j, P(draft token j accepted | tokens 1..j-1 accepted), from the verifier's counters.
- bound: E[L] = 1 + sum_i prod_{j<=i} alpha_j at the target, the speedup if drafting cost nothing and verifying
  K + 1 tokens cost one step (`specray.spec.bound.speedup_bound` with cost ratio 0, Leviathan et al. 2023);
  from totals alone (over HTTP) the same number is 1 + accepted_tokens / num_drafts.
- fraction_of_bound: speedup / bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from specray.coordinator.stats import LevelStats
from specray.spec.bound import speedup_bound

__all__ = ["SCHEMA_VERSION", "Cell", "alphas", "build_report", "load_schema", "plot_report", "validate"]

#: bump on any change of the report's shape (the schema's `schema` const follows it)
SCHEMA_VERSION = "specray.bench/5"


def alphas(st: LevelStats) -> list[float]:
    """Conditional per-position acceptance alpha_j = P(accept j | accepted 1..j-1) from the counters."""
    out, prev = [], st.num_drafts
    for c in st.accepted_per_pos:
        if prev <= 0:
            break
        out.append(c / prev)
        prev = c
    return out


def bound_of(st: LevelStats, per_position: bool) -> float:
    """E[L] at a verifier: from per-position counts when there are some, else from the totals (equal)."""
    if not st.num_drafts:
        return 1.0
    if per_position:
        a = alphas(st)
        return speedup_bound(a, 0.0)
    return 1.0 + st.accepted_tokens / st.num_drafts


@dataclass
class Cell:
    """What one mode (or peer) did on one workload at one batch size, accumulated over its chunks."""

    workload: str
    batch: int
    name: str
    kind: str  # "mode" or "peer"
    per_position: bool = True
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft_sum: float = 0.0
    ttft_n: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    stats: dict[str, LevelStats] = field(default_factory=dict)
    #: the verifying level whose acceptance bounds the speedup: the last one a request reports (levels come
    #: smallest first and every plan ends with the target)
    target: str | None = None
    outputs: dict[int, list[int] | str] = field(default_factory=dict)
    #: each request in the order run: its line in the workload, tokens, seconds and time to first token
    per_request: list[dict[str, Any]] = field(default_factory=list)

    def add(self, seconds: float, requests: Iterable[Any]) -> None:
        """A chunk: its wall time and its `RequestResult`s."""
        self.seconds += seconds
        for r in requests:
            self.requests += 1
            self.tokens += r.tokens
            if r.ttft_s is not None:
                self.ttft_sum += r.ttft_s
                self.ttft_n += 1
                if r.tokens > 1 and r.seconds > r.ttft_s:
                    self.decode_tokens += r.tokens - 1
                    self.decode_seconds += r.seconds - r.ttft_s
            for name, st in r.stats.items():
                self.stats.setdefault(name, LevelStats()).merge(st)
            if r.stats:
                self.target = list(r.stats)[-1]
            self.outputs.setdefault(r.index, r.output)
            self.per_request.append({"index": r.index, "tokens": r.tokens, "seconds": r.seconds,
                                     "ttft_s": r.ttft_s})

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        order = [n for n in self.stats if n != self.target] + ([self.target] if self.target else [])
        levels = {name: _level_json(self.stats[name], self.per_position) for name in order}
        target = self.stats.get(self.target) if self.target else None
        bound = None
        if self.kind == "mode":
            bound = bound_of(target, self.per_position) if target is not None else 1.0
        elif target is not None:  # a speculating peer that reports its own counts (vLLM's)
            bound = bound_of(target, self.per_position)
        return {
            "workload": self.workload, "batch": self.batch, "name": self.name, "kind": self.kind,
            "requests": self.requests, "tokens": self.tokens, "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "ttft_s": self.ttft_sum / self.ttft_n if self.ttft_n else None,
            "decode_tokens_per_s": self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else None,
            "speedup": None, "speedup_vs_own_plain": None,
            "levels": levels, "bound": bound, "fraction_of_bound": None,
            "per_request": list(self.per_request),
        }


def _level_json(st: LevelStats, per_position: bool) -> dict[str, Any]:
    out = {"num_drafts": st.num_drafts, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
           "acceptance_rate": st.acceptance_rate,
           "accepted_per_pos": list(st.accepted_per_pos) if per_position else None,
           "alphas": alphas(st) if per_position else None,
           "bound": bound_of(st, per_position), "tree_drafts": st.tree_drafts, "tree_nodes": st.tree_nodes}
    if st.pairs:
        out["pairs"] = {name: _level_json(p, per_position) for name, p in st.pairs.items()}
    return out


#: the plain run each peer's `speedup_vs_own_plain` is measured against
_OWN_PLAIN = {"hf_plain": "hf_plain", "hf_assisted": "hf_plain", "hf_lookup": "hf_plain",
              "vllm_plain": "vllm_plain", "vllm_ngram": "vllm_plain", "vllm_draft": "vllm_plain"}


def own_plain(name: str) -> str:
    """The plain run a peer's speedup is measured against: vllm_ngram -> vllm_plain, vllm_ngram@1t -> vllm_plain@1t
    (the same engine on the same threads); '' for a mode."""
    base, at, threads = name.partition("@")
    own = _OWN_PLAIN.get(base, "")
    return f"{own}@{threads}" if own and at else own


def build_report(cells: Sequence[Cell], *, target: dict[str, Any], settings: dict[str, Any],
                 skipped: Sequence[dict[str, str]], check_outputs: bool, versions: dict[str, str | None],
                 created: str) -> dict[str, Any]:
    """The JSON report: every cell with its speedups, plus the output check across modes."""
    rows = [c.to_json() for c in cells]
    by_key = {(r["workload"], r["batch"], r["name"]): r for r in rows}
    for r in rows:
        plain = by_key.get((r["workload"], r["batch"], "none"))
        if plain and plain["tokens_per_s"] > 0:
            r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
        own = by_key.get((r["workload"], r["batch"], own_plain(r["name"])))
        if r["kind"] == "peer" and own and own["tokens_per_s"] > 0:
            r["speedup_vs_own_plain"] = r["tokens_per_s"] / own["tokens_per_s"]
        ratio = r["speedup_vs_own_plain"] if r["kind"] == "peer" else r["speedup"]  # a peer: against its own plain
        if ratio is not None and r["bound"]:
            r["fraction_of_bound"] = ratio / r["bound"]
    identical, mismatches, compared = None, [], 0
    if check_outputs:
        identical = True
        modes = [c for c in cells if c.kind == "mode"]
        ref_name = "none" if any(c.name == "none" for c in modes) else (modes[0].name if modes else "")
        refs = {(c.workload, c.batch): c for c in modes if c.name == ref_name}
        for c in modes:
            ref = refs.get((c.workload, c.batch))
            if ref is None or ref is c:
                continue
            for i, out in sorted(c.outputs.items()):
                if i not in ref.outputs:
                    continue
                compared += 1
                if out != ref.outputs[i]:
                    identical = False
                    mismatches.append({"workload": c.workload, "batch": c.batch, "index": i, "name": c.name,
                                       "reference": ref.name, "position": _first_difference(out, ref.outputs[i])})
    return {
        "schema": SCHEMA_VERSION, "created": created, "versions": versions, "target": target,
        "settings": settings, "skipped": list(skipped), "results": rows,
        "outputs_identical": identical, "outputs_compared": compared, "mismatches": mismatches,
    }


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """First index where two outputs (token ids or texts) differ, or where the shorter one ends."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_schema() -> dict[str, Any]:
    return json.loads((resources.files("specray.bench") / "schema.json").read_text())


def validate(report: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` if `report` does not follow schema.json."""
    import jsonschema

    jsonschema.validate(report, load_schema())


# ------------------------------------------------------------------------------------------------- plots


def plot_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG plots of the report into `out_dir`; the files written. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = report["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    b0 = batches[0]
    unit = "concurrency" if report["settings"].get("batch_kind") == "concurrency" else "batch"
    written = []

    def figure(title: str):
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads) + 1, 4), squeeze=False)
        fig.suptitle(title)
        return fig, axes[0]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100, bbox_inches="tight")  # legends sit below the panels
        plt.close(fig)
        written.append(path)

    # 1. tokens/s per mode and peer (smallest batch), speedup over `none` above each bar
    fig, axes = figure(f"tokens/s end to end ({unit} {b0}); label: speedup over none")
    for ax, w in zip(axes, workloads):
        sel = [r for r in rows if r["workload"] == w and r["batch"] == b0]
        bars = ax.bar([r["name"] for r in sel], [r["tokens_per_s"] for r in sel],
                      color=["C0" if r["kind"] == "mode" else "C1" for r in sel])
        for bar, r in zip(bars, sel):
            if r["speedup"] is not None:
                ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_title(w)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=45)
    save(fig, "throughput.png")

    # 2. acceptance per position, one line per (mode, verifying level)
    fig, axes = figure(f"acceptance per position: P(accept j | 1..j-1 accepted) ({unit} {b0})")
    for ax, w in zip(axes, workloads):
        for r in rows:
            if r["workload"] != w or r["batch"] != b0:
                continue
            for level, st in r["levels"].items():
                label = f"{r['name']}: {Path(level).name or level}"
                if st["alphas"]:
                    ax.plot(range(1, len(st["alphas"]) + 1), st["alphas"], marker="o",
                            label=f"{label} ({st['acceptance_rate']:.0%})")
                elif st["num_drafts"]:  # totals only (over HTTP): the level's rate as one point
                    ax.plot([1], [st["acceptance_rate"]], marker="s", label=f"{label} (rate)")
        ax.set_title(w)
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    save(fig, "acceptance.png")

    # 3. fraction of the Leviathan bound reached
    fig, axes = figure(f"speedup / E[L] bound (free drafting) ({unit} {b0})")
    for ax, w in zip(axes, workloads):
        sel = [r for r in rows if r["workload"] == w and r["batch"] == b0 and r["fraction_of_bound"] is not None]
        ax.bar([r["name"] for r in sel], [r["fraction_of_bound"] for r in sel], color="C2")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(w)
        ax.tick_params(axis="x", rotation=45)
    save(fig, "bound.png")

    # 4. speedup against batch size
    fig, axes = figure(f"speedup over none against {unit}")
    for ax, w in zip(axes, workloads):
        names = list(dict.fromkeys(r["name"] for r in rows if r["workload"] == w and r["kind"] == "mode"))
        for name in names:
            pts = sorted((r["batch"], r["speedup"]) for r in rows
                         if r["workload"] == w and r["name"] == name and r["speedup"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel(unit)
        ax.set_title(w)
        if ax.lines:
            ax.legend(fontsize=7)
    save(fig, "batch.png")
    return written
