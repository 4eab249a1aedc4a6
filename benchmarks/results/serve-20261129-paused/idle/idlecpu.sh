#!/bin/bash
# idlecpu.sh LABEL CMD...: start a server, wait for /health, settle 30 s, sum CPU of all processes but kernel/process_api over 30 s
label=$1; shift
cd /work/main
(RAY_AUTH_MODE=disabled nohup "$@" > /work/scratch/s42/idle-$label.log 2>&1 &)
for i in $(seq 90); do sleep 4; curl -sf http://127.0.0.1:8000/health >/dev/null && break; done
sleep 30
bash /work/scratch/s41/raycpu2.sh 30 | grep -v -E "kdamond|process_api" | awk -v l=$label '{s+=$1; print} END {printf "%s: total %.3f cores\n", l, s/3000}' > /work/scratch/s42/idle-$label.cpu
tail -1 /work/scratch/s42/idle-$label.cpu
pkill -9 -f "serve run"; pkill -9 -f "bin/specray serve"; .venv/bin/ray stop --force >/dev/null 2>&1; sleep 3
