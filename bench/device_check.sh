#!/usr/bin/env bash
# One shot on a machine with a GPU: installs
# the carried wheels (.whl/*.whl, for packages the device image lacks), builds Kog for the GPU
# (CUDA if nvcc is found, else ROCm via hipcc; sm_90a on Hopper), then, each step in its own
# process under its own timeout inside one overall budget:
#   gpu_ops (op tests) -> gpu_decode (persistent-kernel, FP8 and runner tests) -> greedy_1b (a
#   1B-shaped fp32 model's 32 greedy tokens equal the CPU executor's) -> decode_latency (kog
#   one-step / kernel-only / loop32, 1/8/16 layers, torch eager and CUDA-graph baselines, % of a
#   device copy) -> prefill_attention -> cpu_tests (a short CPU subset on the GPU build) ->
#   memcheck / racecheck (compute-sanitizer, CUDA only) last.
# A failed step is recorded and the next one still runs. After every step $OUT holds exactly
# three files, rewritten: summary.md (status per step, first failure lines, the bench tables),
# results.json, logs.tgz (every log and junit xml). The build and logs live in build/device.
#
# Usage: [OUT=dir] [KOG_DEVICE_BUDGET_S=330] [KOG_GPU_ARCHS=90a] bench/device_check.sh [--dry-run]
#   --dry-run: no GPU needed. Stages the existing python/kog/_C*.so instead of building, runs the
#   GPU test steps without KOG_REQUIRE_GPU (they skip), skips the GPU-only benches and sanitizers,
#   and still writes the three files: a check of this script's logic on a CPU machine.
set -u
cd "$(dirname "$0")/.."
dry=0
[[ ${1:-} == --dry-run ]] && dry=1
WORK=$PWD/build/device
LOGS=$WORK/logs
OUT=${OUT:-$WORK/out}
rm -rf "$LOGS" && mkdir -p "$LOGS" "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${KOG_DEVICE_BUDGET_S:-330}
RESERVE=8  # seconds kept for the last report
PY=${PYTHON:-python3}
SECONDS=0
: >"$LOGS/steps.tsv"
overall=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

report() {
  "$PY" bench/device_report.py --logs "$LOGS" --out "$OUT" --budget "$BUDGET" --elapsed "$SECONDS" \
    --backend "${backend:-?}" --archs "${archs:-?}" --dry-run "$dry" >"$LOGS/report.log" 2>&1 ||
    { echo "# Kog device check: report failed"; tail -20 "$LOGS/report.log"; cat "$LOGS/steps.tsv"; } >"$OUT/summary.md"
  tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
}

# step NAME MAX_SECONDS CMD...: runs CMD with stdout+stderr to $LOGS/NAME.log under
# min(MAX_SECONDS, what is left of the budget); records status, exit code and time; rewrites the
# report. Never exits.
step() {
  local name=$1 max=$2; shift 2
  local left=$((BUDGET - RESERVE - SECONDS)) status t=$SECONDS rc
  local limit=$((max < left ? max : left))
  if ((limit < 10)); then
    printf '%s\tskipped (budget spent)\t0\t-\t%s\n' "$name" "$max" >>"$LOGS/steps.tsv"
    overall=1
    report
    return
  fi
  echo "== $name (limit ${limit}s, ${SECONDS}s elapsed)"
  # bash -c: CMD may be one of the exported functions below. timeout signals the whole group.
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  [[ $rc == 0 ]] || { overall=1; tail -8 "$LOGS/$name.log"; }
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t))" "$rc" "$limit" >>"$LOGS/steps.tsv"
  echo "   $status in $((SECONDS - t))s"
  report
}

# note NAME STATUS: a step that did not run, and why.
note() {
  printf '%s\t%s\t0\t-\t0\n' "$1" "$2" >>"$LOGS/steps.tsv"
  report
}

# ---- what is here ----------------------------------------------------------------------------
backend=none
if ((dry)); then
  backend=dry-run
elif command -v nvcc >/dev/null; then
  backend=cuda
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  # Hopper gets its arch-specific target (wgmma/TMA); others their plain compute capability.
  # CMake turns CUDA_ARCHITECTURES 90a into -gencode arch=compute_90a,code=[sm_90a,compute_90a].
  default_arch=$([[ $cap == 90 ]] && echo 90a || echo "${cap:-90a}")
elif command -v hipcc >/dev/null; then
  backend=rocm
  default_arch=$(rocminfo 2>/dev/null | grep -o -m1 'gfx[0-9a-f]*' || echo gfx942)
  export HIP_PLATFORM=amd
fi
archs=${KOG_GPU_ARCHS:-${default_arch:-}}
stage=$WORK/pkg   # python/kog plus the freshly built _C: what every later step imports
site=$WORK/site   # the carried wheels, installed
export PY backend archs stage site LOGS WORK dry
export PYTHONPATH="$stage:$site"

env_info() {
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $(nproc)  backend: $backend  archs: $archs"
  nvidia-smi 2>/dev/null || rocm-smi 2>/dev/null || echo "no nvidia-smi / rocm-smi"
  nvcc --version 2>/dev/null | tail -2
  hipcc --version 2>/dev/null | head -3
  cmake --version 2>/dev/null | head -1
  echo "compute-sanitizer: $(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo none)"
  df -h "$WORK" | tail -1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'hip', torch.version.hip, 'available', torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
}

wheels() {
  rm -rf "$site" && mkdir -p "$site"
  if ! compgen -G ".whl/*.whl" >/dev/null; then echo "no .whl/*.whl carried"; return 0; fi
  ls -l .whl
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl &&
    ls "$site"
}

build() {
  if ((dry)); then  # no compiler run: stage the _C already built in the tree
    compgen -G "python/kog/_C*.so" >/dev/null || { echo "dry run: no python/kog/_C*.so (tools/dev_build.sh)"; return 1; }
  else
    local gen=() pybind
    command -v ninja >/dev/null && gen=(-G Ninja)
    pybind=$("$PY" -m pybind11 --cmakedir) || { echo "pybind11 is not installed for $PY"; return 1; }
    cmake -S . -B "$WORK/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKOG_BACKEND="$backend" \
      -DKOG_GPU_ARCHS="$archs" -Dpybind11_DIR="$pybind" -DPython_EXECUTABLE="$(command -v "$PY")" &&
      cmake --build "$WORK/build" --parallel "$(nproc)" || return 1
  fi
  rm -rf "$stage" && mkdir -p "$stage" && cp -r python/kog "$stage/" && rm -f "$stage"/kog/_C*.so || return 1
  if ((dry)); then cp python/kog/_C*.so "$stage/kog/"; else cp "$WORK"/build/_C*.so "$stage/kog/"; fi || return 1
  if command -v cuobjdump >/dev/null && [[ $backend == cuda ]]; then
    echo "GPU code in _C (cubins per target, then PTX):"
    cuobjdump --list-elf "$stage"/kog/_C*.so | grep -o 'sm_[0-9]*[a-z]*' | sort | uniq -c
    cuobjdump --list-ptx "$stage"/kog/_C*.so | grep -o 'sm_[0-9]*[a-z]*' | sort | uniq -c | sed 's/$/ (ptx)/'
  fi
  "$PY" -c "import kog, gguf; print('kog from', kog.__file__, '| gguf', gguf.__file__)" && "$PY" -m kog info
}

# pytest_step NAME ARGS...: pytest with junit xml into the logs, a 40 s per-test timeout where
# pytest-timeout is installed (a hung kernel then ends the step early, its test named in the log).
pytest_step() {
  local name=$1; shift
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra=(--timeout=40 --timeout-method=thread)  # its plugin loads itself
  "$PY" -m pytest -v -rfEs -p no:cacheprovider "${extra[@]}" --junitxml="$LOGS/$name.xml" "$@"
}
export -f env_info wheels build pytest_step

step env 30 env_info
step wheels 30 wheels
if [[ $backend == none ]]; then
  note build "failed (neither nvcc nor hipcc found)"
  overall=1
else
  step build 150 build
fi
built=0
grep -q $'^build\tok' "$LOGS/steps.tsv" && compgen -G "$stage/kog/_C*.so" >/dev/null && built=1

# ---- tests and benches -------------------------------------------------------------------------
decode_tests=(tests/gpu/test_persistent_decode_gpu.py tests/gpu/test_runner_gpu.py tests/gpu/test_decode_loop_gpu.py
  tests/gpu/test_fp8_gpu.py tests/gpu/test_int4_gpu.py tests/gpu/test_ranks_one_gpu.py tests/gpu/test_ranks_two_gpus.py
  tests/gpu/test_tp_llm_gpus.py)
if ((built)); then
  ((dry)) || export KOG_REQUIRE_GPU=1  # tests/gpu errors out instead of skipping when it cannot run
  step gpu_ops 75 pytest_step gpu_ops tests/gpu --ignore=tests/gpu/test_greedy_1b_gpu.py \
    "${decode_tests[@]/#/--ignore=}"
  step gpu_decode 60 pytest_step gpu_decode "${decode_tests[@]}"
  step greedy_1b 60 pytest_step greedy_1b tests/gpu/test_greedy_1b_gpu.py
  if ((dry)); then
    note decode_latency "skipped (dry run: needs a GPU)"
    note prefill_attention "skipped (dry run: needs a GPU)"
  else
    # llama-1b first: its rows matter most; each row reaches the log and jsonl as it is measured.
    step decode_latency 75 "$PY" bench/decode_latency.py --out "$LOGS" --iters 30 \
      --models llama-1b,llama-1b:1,llama-1b:8,llama-2.3b --ctx 1024,4096
    step prefill_attention 25 "$PY" bench/gpu_prefill_attention.py --iters 10
  fi
  step cpu_tests 45 pytest_step cpu_tests -x -m "not slow" tests/cpu/test_info.py tests/cpu/test_gpu_program.py \
    tests/cpu/test_fp8.py tests/cpu/test_int4.py tests/cpu/test_decode_executor.py tests/cpu/test_ops.py tests/cpu/test_kvcache.py
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [[ $backend == cuda && -n $sanitizer ]]; then
    # Subsets that touch every kernel on its vector and scalar paths (each launch is slow under
    # the sanitizer); only kog's kernels are checked (torch's own are filtered out). The
    # persistent kernel gets its own step: a hang there must not cost the op kernels' check.
    ops="strided or extremes or small_positions or stream"
    ops+=" or (reference and (7-4-2-128-128 or 3-7 or 5-129)) or prefill_other_head_dims"
    # The kernel's dependency waits are bounded (2 s by default): far longer under the sanitizer.
    san=(env KOG_GPU_WAIT_TIMEOUT_MS=120000 "$sanitizer" --error-exitcode 99 --kernel-name kns=kog)
    ign=(--ignore=tests/gpu/test_greedy_1b_gpu.py "${decode_tests[@]/#/--ignore=}")
    step memcheck_ops 60 "${san[@]}" --tool memcheck "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu \
      "${ign[@]}" -k "$ops"
    step memcheck_decode 45 "${san[@]}" --tool memcheck "$PY" -m pytest -q -p no:cacheprovider -x \
      tests/gpu/test_persistent_decode_gpu.py -k "(one_step and lens0 and llama and dtype0) or loop_mode"
    races="rmsnorm_in_place or rope_small or out_aliases_q or (one_step and lens0 and llama and dtype0)"
    step racecheck 40 "${san[@]}" --tool racecheck "$PY" -m pytest -q -p no:cacheprovider -x tests/gpu \
      --ignore=tests/gpu/test_greedy_1b_gpu.py -k "$races"
  else
    note sanitizers "not run (no compute-sanitizer for backend $backend)"
  fi
else
  note tests "not run (no build)"
fi

report
cat "$OUT/summary.md"
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $overall
