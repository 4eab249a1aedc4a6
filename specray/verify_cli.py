"""`specray verify`: a user's own prompts through speculation and through plain decoding on the same models, and
whether the outputs are the same, token for token.

    specray verify prompts.jsonl --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --ngram
    specray verify prompts.jsonl --config serve_config.yaml --json-out report.json
    specray verify prompts.jsonl --config serve_config.yaml --temperature 0.8 --seed 7   # coupled, same seed

Each line of the JSONL file is an object with `prompt` (text) or `messages` (chat), and optionally `max_tokens`
and `workload` (a label carried into the report). Greedy (the default): speculation must give plain decoding's
tokens exactly; for each prompt that differs the report gives the first position where they diverge and both
texts. In bf16 a batched verification of K tokens can round a near-tie the other way (the math is exact, the
arithmetic is not), so a divergence there is not a bug: `--rerun-fp32` reruns the differing prompts in float32,
where the outputs must agree. At temperature > 0 with a seed, verification is the coupled method, whose output
for a seed does not depend on the drafter: speculation and plain decoding must again agree token for token.

Exit code: 0 when every prompt agrees (after the fp32 rerun, if asked), 1 when one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specray.bench.workloads import load_prompts, prompt_ids
from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import Level
from specray.spec.params import SamplingParams, VerifyMethod

__all__ = ["Divergence", "VerifyReport", "add_verify_arguments", "compare_outputs", "load_prompts", "run_verify"]

#: builds the cascade's levels from its config (the CLI's: real workers; tests inject fakes)
LevelBuilder = Callable[[CascadeConfig], list[Level]]


@dataclass
class Divergence:
    """One prompt whose speculative output differs from plain decoding's."""

    index: int
    workload: str | None
    position: int  # first output position where the tokens differ (or where one output ended)
    speculative_text: str
    plain_text: str
    speculative_tokens: int
    plain_tokens: int
    fp32_identical: bool | None = None  # after --rerun-fp32 (None: not rerun)


@dataclass
class VerifyReport:
    """What `specray verify` found; `ok` decides the exit code."""

    prompts: int
    identical: int
    temperature: float
    seed: int | None
    dtype: str
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.fp32_identical for d in self.divergences)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def compare_outputs(
    levels: Sequence[Level], rows: Sequence[dict[str, Any]], *, max_tokens: int, sampling: SamplingParams,
) -> tuple[int, list[Divergence]]:
    """Generate every prompt with the cascade and plainly (same workers, one batch each way); (identical count,
    divergences)."""
    from specray.coordinator.generate import generate

    tok = levels[-1].worker.tokenizer
    prompts = [prompt_ids(tok, r) for r in rows]
    identical, out = 0, []
    for i, (row, ids) in enumerate(zip(rows, prompts)):
        n = int(row.get("max_tokens", max_tokens))
        spec = generate(levels, [ids], max_tokens=n, sampling=sampling).results[0]
        plain = generate(levels, [ids], max_tokens=n, sampling=sampling, plain=True).results[0]
        if spec.token_ids == plain.token_ids:
            identical += 1
            continue
        pos = next((j for j, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b),
                   min(len(spec.token_ids), len(plain.token_ids)))
        out.append(Divergence(i, row.get("workload"), pos, spec.text, plain.text, len(spec.token_ids),
                              len(plain.token_ids)))
    return identical, out


def run_verify(args: argparse.Namespace, build: LevelBuilder | None = None) -> tuple[VerifyReport, int]:
    """The command: (report, exit code). `build` makes the levels from a CascadeConfig (default: real workers)."""
    from specray.coordinator.generate import build_levels

    build = build or build_levels
    rows = load_prompts(Path(args.prompts))
    cfg = cascade_config(args)
    seeded = args.temperature > 0
    if seeded and args.seed is None:
        raise ValueError("--temperature > 0 needs --seed: only a seed's output can be compared token for token")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if seeded:  # the coupled method: a seed's output does not depend on the drafter
        cfg = CascadeConfig(levels=[lc.model_copy(update={"verify_method": VerifyMethod.COUPLED}) for lc in cfg.levels])
    dtype = _dtype(cfg)
    identical, divs = compare_outputs(build(cfg), rows, max_tokens=args.max_tokens, sampling=sampling)
    report = VerifyReport(len(rows), identical, args.temperature, args.seed, dtype, divs)
    if divs and args.rerun_fp32 and dtype != "float32":
        fp32 = CascadeConfig(levels=[lc.model_copy(update={"dtype": "float32"}) if lc.kind != "ngram" else lc
                                     for lc in cfg.levels])
        levels = build(fp32)
        for d in divs:
            _, again = compare_outputs(levels, [rows[d.index]], max_tokens=args.max_tokens, sampling=sampling)
            d.fp32_identical = not again
    return report, 0 if report.ok else 1


def _dtype(cfg: CascadeConfig) -> str:
    kinds = {lc.dtype for lc in cfg.levels if lc.kind != "ngram"}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def cascade_config(args: argparse.Namespace) -> CascadeConfig:
    """The cascade to check: from --config (a specray config or a Serve config file), or from the model flags."""
    if args.config:
        import yaml

        raw = yaml.safe_load(Path(args.config).read_text())
        if "applications" in raw:  # a Serve config: the first application's specray config
            raw = raw["applications"][0]["args"]["config"]
        return CascadeConfig.model_validate(raw["cascade"])
    if not args.model:
        raise ValueError("give --config FILE or --model (the target) with --draft / --ngram")
    if not args.draft and not args.ngram:
        raise ValueError("nothing drafts: add --draft MODEL and/or --ngram")
    n_prop = len(args.draft) + (1 if args.ngram else 0)
    ks = args.k or [4]
    ks = ks * n_prop if len(ks) == 1 else ks
    if len(ks) != n_prop:
        raise ValueError(f"give one --k for all or one per proposing level ({n_prop})")
    common = dict(dtype=args.dtype, num_threads=args.threads)
    levels = [LevelConfig(kind="ngram", num_speculative_tokens=ks[0])] if args.ngram else []
    levels += [LevelConfig(kind="hf", model=d, num_speculative_tokens=k, **common)
               for d, k in zip(args.draft, ks[len(levels):])]
    return CascadeConfig(levels=[*levels, LevelConfig(kind="hf", model=args.model, **common)])


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", help="JSONL file: one object per line with `prompt` or `messages`, optionally "
                                   "`max_tokens` and `workload`")
    p.add_argument("--config", default=None, help="the cascade from a specray config or a Serve config file "
                                                  "(e.g. serve_config.yaml) instead of the model flags")
    p.add_argument("--model", default=None, help="target model: known name, folder or hub id")
    p.add_argument("--draft", action="append", default=[], help="a draft model, smallest first (repeatable)")
    p.add_argument("--ngram", action="store_true", help="an n-gram (prompt lookup) proposer as the first level")
    p.add_argument("--k", type=int, action="append", default=None,
                   help="draft tokens per proposing level: one for all, or one per level (none: 4)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="weights of the model levels given by flags")
    p.add_argument("--threads", type=int, default=None, help="torch threads per model level (none: torch's choice)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (a line's max_tokens wins)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 needs --seed (coupled check)")
    p.add_argument("--top-k", type=int, default=0, help="top-k at temperature > 0 (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p at temperature > 0 (1: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of every prompt (temperature > 0)")
    p.add_argument("--rerun-fp32", action="store_true",
                   help="rerun the prompts that differ with every model level in float32 (bf16 near-ties)")
    p.add_argument("--json-out", default=None, help="write the report as JSON to this file")


def print_report(report: VerifyReport, file=None) -> None:
    file = file or sys.stdout
    print(f"{report.identical}/{report.prompts} prompts token-identical to plain decoding "
          f"(dtype {report.dtype}, temperature {report.temperature:g}"
          + (f", seed {report.seed}, coupled" if report.temperature > 0 else ", greedy") + ")", file=file)
    for d in report.divergences:
        tag = f" [{d.workload}]" if d.workload else ""
        again = {None: "", True: "; identical in float32", False: "; STILL DIFFERENT in float32"}[d.fp32_identical]
        print(f"  prompt {d.index}{tag}: first divergence at output token {d.position} "
              f"({d.speculative_tokens} vs {d.plain_tokens} tokens){again}", file=file)
        print(f"    speculative: {d.speculative_text[:200]!r}", file=file)
        print(f"    plain:       {d.plain_text[:200]!r}", file=file)
    if report.divergences and report.dtype != "float32" and all(d.fp32_identical is None for d in report.divergences):
        print("  In bf16/fp16 a batched verification of K tokens can round a near-tie the other way: the method is "
              "exact, the arithmetic is not. Rerun with --rerun-fp32 (float32 must agree).", file=file)
    print("OK" if report.ok else "MISMATCH", file=file)


def main(args: argparse.Namespace) -> int:
    try:
        report, code = run_verify(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report.to_json(), indent=1))
    return code
