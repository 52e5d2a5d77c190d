#!/usr/bin/env bash
# Follow-up diagnostics after a device check (bench/device_check.sh): builds the CUDA extension
# the same way, then (1) where a KogError thrown by _C segfaults (the first device check,
# 2026-12-04: every error raised from C++ crashed the CUDA build on the device image while the
# same code passes on the CPU build and on a CUDA build imported here), with the libraries
# loaded and a native backtrace from cuda-gdb; (2) the full output of the GPU runner tests whose
# generations differed from the CPU's. Everything goes to $OUT/diag.log (and junit xml).
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
so=$(ls "$stage"/kog/_C*.so)
echo "== ldd"; ldd "$so" | grep -E "stdc|gcc_s|libc\.|cuda|python" ; which g++; g++ --version | head -1
echo "== libstdc++ the process maps (torch first)"
"$PY" -c "import torch; from kog import _C; import re; print(sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search('stdc|gcc_s', l)}))"
raise_case() {  # $1: python prelude
  timeout 60 "$PY" -X faulthandler -c "$1
from kog import _C
try:
    _C.set_cpu_num_threads(0)
except Exception as e:
    print('raised', type(e).__name__, e)"; echo "exit $?"
}
echo "== raise without torch"; raise_case "pass"
echo "== raise with torch imported first"; raise_case "import torch"
echo "== raise with torch.cuda initialised"; raise_case "import torch; torch.zeros(1, device='cuda')"
gdb=$(command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
if [[ -n $gdb ]]; then
  echo "== native backtrace (cuda-gdb)"
  timeout 90 "$gdb" -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" -c \
    "import torch; torch.zeros(1, device='cuda'); from kog import _C; _C.set_cpu_num_threads(0)" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | head -120
fi
echo "== GPU runner tests, full diff"
timeout 120 "$PY" -m pytest -x -vv -p no:cacheprovider tests/gpu/test_runner_gpu.py --junitxml="$OUT/runner.xml" 2>&1 | tail -150
echo "== diag done in ${SECONDS}s"
