#!/bin/bash
# served concurrency: adaptive vs none on the same server, 32 tokens, --repeat 2
cd /work/main
OUT=${1:-/work/scratch/s37/served-conc}
export RAY_AUTH_MODE=disabled
.venv/bin/serve run serve_config.yaml > $OUT.serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 5; done
echo "up after $((i*5)) s"
.venv/bin/specray bench --url http://127.0.0.1:8000/v1 --concurrency 1 4 16 --modes none adaptive \
    --workload code extraction chat --max-tokens 32 --repeat 2 --out $OUT > $OUT.bench.log 2>&1
echo "bench rc $?"
curl -s http://127.0.0.1:8000/metrics > $OUT.metrics.txt
kill -INT $SP; sleep 20; kill -9 $SP 2>/dev/null; .venv/bin/ray stop --force > /dev/null 2>&1
echo done
