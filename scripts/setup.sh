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
python -c "import specray, torch, transformers, ray; print('specray', specray.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
