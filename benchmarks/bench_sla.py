"""The SLA experiment on a served config: `serve run CONFIG.yaml`, then Poisson arrivals at several request rates,
with and without speculation, and the highest throughput under a P90 end-to-end latency ceiling
(specray/bench/sla.py; docs/bench.md "SLA experiment").

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_sla.py serve_config.yaml --rates 0.2 0.5 1 2
    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/bench_sla.py --tiny --rates 1 2 --duration-s 20 --warmup-s 5

`--tiny` serves the tests' tiny-model cascade (tests/ray/serve_config_tiny.yaml with models built here in
seconds, on a free port) instead of a config: a check that the whole path works, not a measurement. The default
workload is the shipped extraction set. Writes benchmarks/results/sla-*.json and the plot beside it (.png).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_app import serve_run

from specray.bench.sla import add_sla_arguments, run_sla

ROOT = Path(__file__).resolve().parent.parent


def tiny_config() -> Path:
    """tests/ray/serve_config_tiny.yaml with tiny models built (or reused) under SPECRAY_TINY_DIR or
    ~/.cache/specray/tiny, served on a free port; written to a temporary file. The models take 4096 positions
    (the tests' take 1024): the shipped extraction prompts are longer than that in the tiny tokenizer."""
    from specray.testing.tiny import tiny_family

    root = os.environ.get("SPECRAY_TINY_DIR") or Path.home() / ".cache" / "specray" / "tiny"
    tiny = tiny_family(root, max_positions=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = (ROOT / "tests" / "ray" / "serve_config_tiny.yaml").read_text()
    text = text.replace("${TINY_MID}", str(tiny.draft_dirs["mid"])).replace("${TINY_TARGET}", str(tiny.target_dir))
    text = text.replace("port: 8000", f"port: {port}")
    fd, path = tempfile.mkstemp(prefix="specray-sla-tiny-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path, nargs="?", default=None, help="a Serve config file (or --tiny)")
    ap.add_argument("--tiny", action="store_true", help="serve the tiny-model test cascade instead of a config")
    ap.add_argument("--startup-s", type=float, default=900, help="wait this long for the app (first start converts)")
    add_sla_arguments(ap, url=False)
    args = ap.parse_args()
    if (args.config is None) == (not args.tiny):
        ap.error("give a Serve config file or --tiny (one of them)")
    config = tiny_config() if args.tiny else args.config
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out = args.out or ROOT / "benchmarks" / "results" / f"sla-{'tiny-' if args.tiny else ''}{stamp}.json"
    print(f"== {config}: starting `serve run` ...", flush=True)
    try:
        with serve_run(config, args.startup_s) as (url, model, _):
            args.url, args.model = url, args.model or model
            return run_sla(args)
    finally:
        if args.tiny:
            config.unlink()


if __name__ == "__main__":
    sys.exit(main())
