#!/bin/bash
# The served default under a closed loop: `serve run` on serve_config.yaml (with the planner's trace on), then
# `specray bench --url` at concurrency C (default 16) with --requests N (default 64), none vs adaptive, --repeat 2.
# Run from the repository root: bash benchmarks/results/served-closed-loop-xeon-20261129-s38/run.sh OUTDIR
# (REQS= empty gives the default waves of C requests; WL picks the workloads.)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/tmp/served-closed-loop}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled
sed "s#planner-trace.jsonl#$OUT/planner-trace.jsonl#" "$HERE/serve_trace.yaml" > "$OUT/serve.yaml"
.venv/bin/serve run "$OUT/serve.yaml" > "$OUT/serve.log" 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 5; done
REQS=${REQS-64}
.venv/bin/specray bench --url http://127.0.0.1:8000/v1 --concurrency ${CONC:-16} ${REQS:+--requests $REQS} --modes none adaptive --workload ${WL:-code extraction chat} --max-tokens 32 --repeat 2 ${PEERS:+--peers $PEERS --model qwen2.5-coder-1.5b-instruct} \
    --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc $?"
curl -s http://127.0.0.1:8000/metrics > "$OUT/metrics.txt"
kill -INT $SP; sleep 20; kill -9 $SP 2>/dev/null; .venv/bin/ray stop --force > /dev/null 2>&1
