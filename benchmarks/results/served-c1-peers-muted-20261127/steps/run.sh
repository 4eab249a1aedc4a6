# Alternating processes, twice: vLLM's peer loop, then specray's engine (LD_PRELOAD as the peer has it), at 1 and
# 2 threads. Run from the repository root on an otherwise idle box (~6 min).
D=benchmarks/results/served-c1-peers-muted-20261127/steps
for rep in 1 2; do for th in 1 2; do
.venv/bin/python $D/peer_step.py $th 2>/dev/null | grep RESULT
LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python $D/engine_step.py $th 2>/dev/null | grep RESULT
done; done
