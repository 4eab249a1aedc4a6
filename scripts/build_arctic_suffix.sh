#!/usr/bin/env bash
# Build Arctic Inference's suffix-tree extension (what vLLM's `suffix` method runs) into a folder outside the
# virtualenv, for the peer check in tests/unit/test_suffix.py:
#
#   bash scripts/build_arctic_suffix.sh [OUT]     (OUT default: .arctic; needs cmake >= 3.18, a C++20 compiler)
#   PYTHONPATH=.:.arctic .venv/bin/python -m pytest tests/unit/test_suffix.py -k arctic
#
# `pip install arctic-inference` builds the whole package (gRPC code, torch ops) with build requirements that
# include torch and a pinned protobuf, and its PyPI cmake may not find a pyenv interpreter's headers; this
# builds only the suffix-tree module, with the system cmake and nanobind, and touches nothing in .venv.
set -euo pipefail

VERSION=0.3.0
NANOBIND=2.9.2
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/.arctic}" && cd "${1:-$ROOT/.arctic}" && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PY" -m pip download --no-deps -q -d "$WORK" "arctic-inference==$VERSION"
tar -xzf "$WORK/arctic_inference-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"
"$PY" -m pip install -q --target "$WORK/nb" "nanobind==$NANOBIND"
PYTHONPATH="$WORK/nb" cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -DPython_EXECUTABLE="$PY" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$WORK/build" -j "${JOBS:-1}" >/dev/null
PKG="$OUT/arctic_inference/suffix_decoding"
mkdir -p "$PKG"
cp "$SRC/arctic_inference/__init__.py" "$OUT/arctic_inference/"
cp "$SRC/arctic_inference/suffix_decoding/"*.py "$WORK/build/"_C*.so "$PKG/"
PYTHONPATH="$OUT" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(8, 4)"
echo "built $PKG"
