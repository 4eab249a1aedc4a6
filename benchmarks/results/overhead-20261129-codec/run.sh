#!/bin/bash
# Before/after of the direct transport's message codec in bench_overhead's actor path, interleaved ABAB
# (each side medians of REPEAT runs). BEFORE and AFTER are checkouts (before: 7fc1238), both run with this
# repository's .venv; OUT is where the JSON and logs go.
#   BEFORE=/path/to/checkout-7fc1238 AFTER=$PWD bash benchmarks/results/overhead-20261129-codec/run.sh OUT
#   PLANS="cascade ngram-cascade" BATCHES=1 REPEAT=5 ...   (ab2)
set -eu
OUT=$1; mkdir -p "$OUT"
PY=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python
for i in 1 2; do
  for side in A B; do
    dir=$BEFORE; [ $side = B ] && dir=$AFTER
    (cd "$dir" && RAY_AUTH_MODE=disabled PYTHONPATH="$dir" "$PY" benchmarks/bench_overhead.py --paths actors \
       --transports direct --plans ${PLANS:-plain draft cascade ngram-cascade} --batches ${BATCHES:-1 64} \
       --overlap off --repeat ${REPEAT:-3} --out "$OUT/$side$i.json" > "$OUT/$side$i.log" 2>&1)
    echo "== $side$i"; grep -E "^actors " "$OUT/$side$i.log" | awk '{print $2, $3, $8, $9, $10}'
  done
done
