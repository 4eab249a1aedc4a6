#!/bin/bash
# ABAB: tax.py with Ray's default intervals vs slower Serve/Ray housekeeping intervals. From the repo root.
export RAY_AUTH_MODE=disabled
OUT=${1:-/tmp/intervals}; mkdir -p $OUT
SLOW='{"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_raylet_report_resources_period_milliseconds": "1000", "RAY_health_check_period_ms": "10000"}'
for r in 1 2; do
  APPENV='{}' REPS=2 .venv/bin/python benchmarks/results/serve-20261129-wakeups/tax.py > $OUT/default-$r.log 2>&1
  .venv/bin/ray stop --force >/dev/null 2>&1; sleep 3
  APPENV="$SLOW" REPS=2 .venv/bin/python benchmarks/results/serve-20261129-wakeups/tax.py > $OUT/slow-$r.log 2>&1
  .venv/bin/ray stop --force >/dev/null 2>&1; sleep 3
done
