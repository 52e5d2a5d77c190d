#!/usr/bin/env bash
# One command for a machine with a GPU: builds Kog for it (CUDA if nvcc is found, else ROCm via
# hipcc), runs the GPU op tests, the CPU tests against that build, compute-sanitizer memcheck and
# racecheck over a subset of the GPU tests (CUDA only), bench/decode_latency.py if present and
# bench/gpu_prefill_attention.py.
# Every step runs under a timeout inside one overall budget; a failed step is recorded and the
# next one still runs. Results: $OUT/summary.md (a table) and one log per step.
# Usage: [OUT=dir] [KOG_DEVICE_BUDGET_S=420] [KOG_GPU_ARCHS=...] bench/device_check.sh
# The working tree is not modified: the build goes to build/device, the package is staged in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${KOG_DEVICE_BUDGET_S:-420}
PY=${PYTHON:-python3}
SECONDS=0
: >"$OUT/steps.tsv"
overall=0

# step NAME MAX_SECONDS CMD...: runs CMD with stdout+stderr to $OUT/NAME.log under
# min(MAX_SECONDS, what is left of the budget); records status and time. Never exits.
step() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET - SECONDS)) status t=$SECONDS rc
  local limit=$((max < left ? max : left))
  if ((limit < 10)); then
    printf '%s\tskipped (budget spent)\t0\n' "$name" >>"$OUT/steps.tsv"
    overall=1
    return
  fi
  echo "== $name (limit ${limit}s)"
  # bash -c: CMD may be one of the exported functions below.
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  [[ $rc == 0 ]] || { overall=1; tail -15 "$OUT/$name.log"; }
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t))" >>"$OUT/steps.tsv"
  echo "   $status in $((SECONDS - t))s"
}

note() { printf '%s\t%s\t0\n' "$1" "$2" >>"$OUT/steps.tsv"; }

# ---- what is here ----------------------------------------------------------------------------
if command -v nvcc >/dev/null; then
  backend=cuda
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  # Hopper gets its arch-specific target (wgmma/TMA later); others their plain compute capability.
  default_arch=$([[ $cap == 90 ]] && echo 90a || echo "${cap:-90a}")
elif command -v hipcc >/dev/null; then
  backend=rocm
  default_arch=$(rocminfo 2>/dev/null | grep -o -m1 'gfx[0-9a-f]*' || echo gfx942)
  export HIP_PLATFORM=amd
else
  backend=none
fi
archs=${KOG_GPU_ARCHS:-${default_arch:-}}
export OUT PY backend archs

env_info() {
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $(nproc)  backend: $backend  archs: $archs"
  nvidia-smi 2>/dev/null || rocm-smi 2>/dev/null || echo "no nvidia-smi / rocm-smi"
  nvcc --version 2>/dev/null | tail -2
  hipcc --version 2>/dev/null | head -3
  cmake --version 2>/dev/null | head -1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'available', torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
}
export -f env_info
step env 30 env_info

# ---- build -----------------------------------------------------------------------------------
stage="$OUT/pkg"  # python/kog plus the freshly built _C: what the tests import
build() {
  local gen=() pybind
  command -v ninja >/dev/null && gen=(-G Ninja)
  pybind=$("$PY" -m pybind11 --cmakedir) || { echo "pybind11 is not installed for $PY"; return 1; }
  cmake -S . -B build/device "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKOG_BACKEND="$backend" \
    -DKOG_GPU_ARCHS="$archs" -Dpybind11_DIR="$pybind" -DPython_EXECUTABLE="$(command -v "$PY")" &&
    cmake --build build/device --parallel "$(nproc)" || return 1
  rm -rf "$stage" && mkdir -p "$stage" && cp -r python/kog "$stage/" &&
    rm -f "$stage"/kog/_C*.so && cp build/device/_C*.so "$stage/kog/" || return 1
  PYTHONPATH="$stage" "$PY" -m kog info
}
export stage
export -f build
if [[ $backend == none ]]; then
  note build "failed (neither nvcc nor hipcc found)"
  overall=1
else
  step build 300 build
fi
built=0
grep -q $'^build\tok' "$OUT/steps.tsv" && compgen -G "$stage/kog/_C*.so" >/dev/null && built=1

# ---- tests -------------------------------------------------------------------------------------
pytest_run() { PYTHONPATH="$stage" "$PY" -m pytest -q -p no:cacheprovider "$@"; }
export -f pytest_run
if ((built)); then
  export KOG_REQUIRE_GPU=1  # tests/gpu errors out instead of skipping when it cannot run
  step gpu_tests 150 pytest_run tests/gpu -rs --junitxml="$OUT/gpu_tests.xml"
  step cpu_tests_on_gpu_build 90 pytest_run tests/cpu -x
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ $backend == cuda && -n $sanitizer ]]; then
    # A subset that touches every kernel on its vector and scalar paths: under the sanitizer
    # each launch is slow. Only kog's kernels are checked (torch's own are filtered out).
    subset="strided or extremes or small_positions or stream"
    subset+=" or (reference and (7-4-2-128-128 or 3-7 or 5-129))"
    subset+=" or (one_step and lens0 and llama) or loop_mode or prefill_other_head_dims"
    sanitize=(env PYTHONPATH="$stage" "$sanitizer" --error-exitcode 99 --kernel-name kns=kog)
    step memcheck 150 "${sanitize[@]}" --tool memcheck \
      "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu -k "$subset"
    step racecheck 90 "${sanitize[@]}" --tool racecheck \
      "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu -k "rmsnorm_in_place or rope_small or out_aliases_q"
  else
    note sanitizer "not run (no compute-sanitizer for backend $backend)"
  fi
  if [[ -f bench/decode_latency.py ]]; then
    step decode_latency 150 env PYTHONPATH="$stage" "$PY" bench/decode_latency.py --out "$OUT" --iters 30
  else
    note decode_latency "not run (bench/decode_latency.py does not exist yet)"
  fi
  step prefill_attention 60 env PYTHONPATH="$stage" "$PY" bench/gpu_prefill_attention.py --iters 10
else
  note tests "not run (no build)"
fi

# ---- summary -----------------------------------------------------------------------------------
{
  echo "# Kog device check: backend $backend, archs ${archs:-?}, ${SECONDS}s of ${BUDGET}s"
  echo
  echo "| step | status | seconds | log |"
  echo "|---|---|---|---|"
  while IFS=$'\t' read -r name status secs; do
    log="-"
    [[ -f $OUT/$name.log ]] && log="$name.log"
    echo "| $name | $status | $secs | $log |"
  done <"$OUT/steps.tsv"
  for f in gpu_tests cpu_tests_on_gpu_build memcheck racecheck; do
    [[ -f $OUT/$f.log ]] && echo && echo "$f: $(grep -E '(passed|failed|error|skipped|ERROR SUMMARY)' "$OUT/$f.log" | tail -2 | tr '\n' ' ')"
  done
} >"$OUT/summary.md"
cat "$OUT/summary.md"
exit $overall
