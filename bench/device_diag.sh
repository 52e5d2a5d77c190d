#!/usr/bin/env bash
# Follow-up diagnostics after a device check (bench/device_check.sh): builds the CUDA extension
# the same way, then (1) bench/gpu_runner_diag.py: CPU vs GPU logits of ModelRunner case by case;
# (2) the full output of the GPU runner tests whose generations differed from the CPU's.
# (An earlier version found why every C++ exception crashed the first device build: git history.) Everything goes to $OUT/diag.log (and junit xml).
# Usage: OUT=dir bench/device_diag.sh   (on the device machine, .whl carried as for the check)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./device_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=build/device; PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/diag.log") 2>&1
site=$WORK/site; stage=$WORK/pkg
mkdir -p "$site" && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
cmake -S . -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKOG_BACKEND=cuda -DKOG_GPU_ARCHS=90a \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null &&
  cmake --build "$WORK/build" --parallel "$(nproc)" | tail -2 || exit 1
rm -rf "$stage" && mkdir -p "$stage" && cp -r python/kog "$stage/" && rm -f "$stage"/kog/_C*.so && cp "$WORK"/build/_C*.so "$stage/kog/"
export PYTHONPATH="$stage:$site"
echo "== where ModelRunner on the GPU parts from the CPU"
timeout 150 "$PY" bench/gpu_runner_diag.py 2>&1 | tail -40
echo "== GPU runner tests, full diff"
timeout 120 "$PY" -m pytest -vv -p no:cacheprovider tests/gpu/test_runner_gpu.py --junitxml="$OUT/runner.xml" 2>&1 | tail -150
echo "== diag done in ${SECONDS}s"
