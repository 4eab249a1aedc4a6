#!/bin/bash
# served, batch 1, T0: each config through serve run + HTTP, with vLLM's own loops in the same bench run
cd /work/main
export RAY_AUTH_MODE=disabled
TEMP=${TEMP:-0}
for c in "$@"; do
  n=$(basename $c .yaml)
  echo "=== $n $(date +%T)"
  nohup .venv/bin/serve run $c > /work/scratch/s32/serve-$n.log 2>&1 &
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 5; done
  echo "healthy $(date +%T)"
  .venv/bin/specray bench --url http://127.0.0.1:8000/v1 --model qwen2.5-coder-1.5b-instruct \
    --peers vllm_plain vllm_ngram --modes none adaptive --workload code extraction chat --max-tokens 96 \
    --temperature $TEMP --out /work/scratch/s32/served-$n-t$TEMP 2>&1 | grep -v "WARNING\|INFO" | tail -16
  pkill -f "serve run" ; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1; sleep 5
done
echo DONE $(date +%T)
