#!/bin/bash
# Batch 1 in process, before (commit ce8bddc) and after (the measured per-batch slope stands; ranking cost = CPU),
# one right after the other, each with vLLM's loops: BEFORE and AFTER are checkouts of the two commits.
# Usage: BEFORE=/path/a AFTER=/path/b bash run.sh OUTDIR
set -e
out=${1:?OUTDIR}
here=$(cd "$(dirname "$0")/../../.." && pwd)
for side in before after; do
  dir=$([ $side = before ] && echo "$BEFORE" || echo "$AFTER")
  (cd "$dir" && PYTHONPATH="$dir" LD_PRELOAD=$here/.venv/lib/libiomp5.so $here/.venv/bin/specray bench \
     --config $here/serve_config.yaml --workload code extraction --max-tokens 96 --modes none ngram adaptive \
     --peers vllm_plain vllm_ngram --out "$out/$side")
done
