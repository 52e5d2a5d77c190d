#!/usr/bin/env bash
# Incremental development build: compiles kog._C into python/kog/ so that
# `PYTHONPATH=python python -m pytest tests` runs against the working tree without a pip install.
# Usage: tools/dev_build.sh [BUILD_DIR] (default build/dev); KOG_BACKEND / KOG_GPU_ARCHS as for pip.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/dev}
cmake -S . -B "$build" -G Ninja -DKOG_INPLACE=ON -DCMAKE_BUILD_TYPE=Release \
  -DKOG_BACKEND="${KOG_BACKEND:-cpu}" -DKOG_GPU_ARCHS="${KOG_GPU_ARCHS:-}" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
cmake --build "$build"
