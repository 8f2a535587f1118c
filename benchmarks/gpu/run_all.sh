#!/usr/bin/env bash
# One GPU verification run of hybrid, in under 8 minutes on one H200 from a bare machine:
#
#     bash benchmarks/gpu/run_all.sh                 # on the GPU machine
#     bash benchmarks/gpu/run_all.sh --dry-run-cpu   # the same orchestration on the CPU (tiny sizes, gloo): CI
#
# Every part writes $OUT/partN_<name>.json (a temporary folder, printed, when $OUT is unset); the summary
# table (also $OUT/summary.txt) is printed last. $OUT holds those 8 files and nothing else (results.py's
# MAX_OUT_FILES: what the device tool brings back); the kernel build logs go beside the kernel cache.
# Each part runs under its own `timeout`, so a part that fails or overruns still lets the others report;
# exit status 0 only when every part is ok.
#
# part  what it checks                                       compared against
# ----  ---------------------------------------------------  ------------------------------------------------
# 0     torch: the CUDA torch present, else installed        - (install time printed)
# 1     environment: GPU, driver, CUDA, torch, NCCL; copy    the GPU's spec-sheet dense bf16 peak (989.4
#       bandwidth and bf16 matmul TFLOP/s measured           TFLOP/s on H200/H100 SXM; spec_peak_bf16_tflops)
# 2     kernels (check_kernels.py): fused Adam, LayerNorm,   torch.optim.AdamW/Adam; float64 norm references
#       RMSNorm, int8/int4/1-bit quantization, outputs       and torch's kernels; the quantization torch path
#       poisoned with NaN; bandwidth as a fraction of copy   bit for bit; timings against the torch natives
# 3     engine at world 1 (one-rank NCCL group): gpt2-medium plain torch.optim.AdamW, same model, bf16 with
#       20 steps bf16, ZeRO 1, 2, 3 and 2 + CPU offload      fp32 masters: loss (k+1)*2^-8 at step k,
#       (offload: host twins poisoned between steps)         parameters 20*2^-8 (derived in engine_parity.py)
# 4     memory truth for part 3's runs                       the planner: components within 5%, peak of
#                                                            torch.cuda.max_memory_allocated within 10%
# 5     MFU: gpt2-xl, gpt2-large, seq 1024, micro 4/8/16 x   spec peak and part 1's measured matmul peak;
#       recompute none/selective x fused/torch-native        goal 55% (Megatron: ~41% at 1.7B on H100);
#       kernels; flash SDPA forced, the kernel that ran      settings beyond the budget listed as skipped
#       recorded
# 6     trainer: torchrun -m hybrid.train, world 1, the CPU  exit 0, TensorBoard events, the checkpoint of
#       demo's data (made locally), 30 iterations            the last iteration with verified checksums
#
# Time budget on one H200 (seconds; a part's soft budget makes it skip its optional sizes, its hard limit
# = soft + GRACE is the `timeout` that stops it: its SIGTERM ends the part, which still writes the rows it has,
# and KILL_AFTER seconds later a SIGKILL ends whatever has not):
#
#   step                soft  hard
#   0 torch install       -    60   only when no CUDA torch is importable (pip's configured index,
#                                   torch==2.13.0); when CUDA torch is present, its 60 s go to parts 5 and 6
#   1 environment        15    25
#   2 kernels           140   150   the CUDA ops (and cpu_adam) start building in the background before part 1
#   3 engine parity      55    65
#   4 memory truth       30    40
#   5 MFU                70    80
#   6 trainer            25    35
#   total of hard limits      455   + 6 x 2 s KILL_AFTER + ~10 s of summary and start-up: within the
#                                   480 s (8 min) limit
#
# The torch wheel: the lent H200 machine has no network and ships a CUDA build of torch (2.11.0+cu130 when
# last seen), which this script uses as it is (install time 0). Where no CUDA torch is importable it runs
#   pip install torch==2.13.0
# from pip's configured index (PyPI's Linux x86_64 wheel is the CUDA build, its CUDA libraries as nvidia-*
# wheels, some GB: on a slow or absent network the 60 s run out, and part 0 says so; part 1 prints
# torch.version.cuda), and prints how long that took.
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY=0
case "${1:-}" in
  --dry-run-cpu) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu/run_all.sh [--dry-run-cpu]" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3}"
GRACE=10
KILL_AFTER=2  # a part writes its JSON within milliseconds of its SIGTERM
TOTAL_LIMIT=480
INSTALL_LIMIT=60
if [ "$DRY" = 1 ]; then
  # tiny sizes on the CPU: generous limits, since CI machines are shared and slow. Part 5 gets no budget:
  # it measures its first size, then records every other size and setting as skipped, so CI sees the
  # skipping work (and spends its time on the other parts).
  B_ENV=20; B_KERNELS=60; B_ENGINE=60; B_MEMORY=60; B_MFU=0; B_TRAINER=60; GRACE=60
  DRY_FLAG="--dry-run-cpu"
  # one intra-op thread: on a shared CPU, idle OpenMP threads spinning for cores cost several times the work
  export OMP_NUM_THREADS=1
else
  B_ENV=15; B_KERNELS=140; B_ENGINE=55; B_MEMORY=30; B_MFU=70; B_TRAINER=25
  DRY_FLAG=""
fi
HARD_TOTAL=$((INSTALL_LIMIT + B_ENV + B_KERNELS + B_ENGINE + B_MEMORY + B_MFU + B_TRAINER + 6 * (GRACE + KILL_AFTER)))
if [ "$DRY" = 0 ] && [ "$HARD_TOTAL" -gt "$((TOTAL_LIMIT - 10))" ]; then
  echo "run_all.sh: the parts' hard limits add up to ${HARD_TOTAL} s, over the ${TOTAL_LIMIT} s budget" >&2
  exit 2
fi

if [ -z "${OUT:-}" ]; then
  HYBRID_GPU_RUN_OUT="$(mktemp -d /tmp/hybrid-gpu-run-XXXXXX)"
  export HYBRID_GPU_RUN_OUT
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUTDIR="$("$PY" benchmarks/gpu/results.py out-dir)"
echo "hybrid GPU verification run$([ "$DRY" = 1 ] && echo ' (dry run on the CPU)'): results in $OUTDIR"
echo "hard limits add up to ${HARD_TOTAL} s (limit ${TOTAL_LIMIT} s on the GPU)"
START=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# ---- part 0: torch ----------------------------------------------------------------------------------
T0=$(date +%s.%N)
if [ "$DRY" = 1 ]; then
  version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
  "$PY" benchmarks/gpu/results.py note 0 install ok 0 0 "dry run: the installed torch $version, nothing installed"
elif "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  version="$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
  "$PY" benchmarks/gpu/results.py note 0 install ok 0 "$INSTALL_LIMIT" \
    "CUDA torch already present: $version; install skipped (0 s; its ${INSTALL_LIMIT} s go to parts 5 and 6)"
  # the install's unused limit: the two parts whose optional sizes and iterations can use it
  B_MFU=$((B_MFU + INSTALL_LIMIT * 2 / 3)); B_TRAINER=$((B_TRAINER + INSTALL_LIMIT / 3))
else
  echo "== part 0: pip install torch==2.13.0 from pip's configured index (limit ${INSTALL_LIMIT} s)"
  timeout "$INSTALL_LIMIT" "$PY" -m pip install --quiet torch==2.13.0
  rc=$?
  took=$(elapsed "$T0")
  if [ "$rc" = 0 ]; then
    "$PY" benchmarks/gpu/results.py note 0 install ok "$took" "$INSTALL_LIMIT" \
      "pip install torch==2.13.0 (pip's configured index): ${took} s"
  else
    "$PY" benchmarks/gpu/results.py note 0 install "$([ "$rc" = 124 ] && echo timeout || echo crashed)" \
      "$took" "$INSTALL_LIMIT" "pip install torch==2.13.0 failed (exit $rc) after ${took} s"
  fi
fi
echo "part 0 torch: $(elapsed "$T0") s"

# The compiled ops all parts share: one cache, one architecture list, so part 2's builds serve parts 3-6.
export HYBRID_KERNELS_CACHE="${HYBRID_KERNELS_CACHE:-/tmp/hybrid-kernels-gpu-check}"
if [ "$DRY" = 0 ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null)"
  export TORCH_CUDA_ARCH_LIST MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  # Compile the ops while part 1 runs (CPU work; the parts that use them wait through the build lock):
  # the three CUDA ops of part 2, and the CPU Adam that steps part 3's offloaded optimizer. Their logs stay
  # out of $OUT (its file count is limited); a failed build's error is also in part 2's JSON.
  BUILD_LOGS="$HYBRID_KERNELS_CACHE/build-logs"
  mkdir -p "$BUILD_LOGS"
  echo "kernel build logs in $BUILD_LOGS"
  for op in cuda_adam cuda_norm cuda_quantize cpu_adam; do
    HYBRID_KERNELS=require timeout $((B_ENV + B_KERNELS)) "$PY" -m hybrid.kernels build --op "$op" \
      >"$BUILD_LOGS/build_$op.log" 2>&1 &
  done
fi

# ---- parts 1-6 --------------------------------------------------------------------------------------
run_part() {  # run_part N NAME SOFT_BUDGET COMMAND...
  local n="$1" name="$2" budget="$3"
  shift 3
  echo
  echo "== part $n: $name (budget ${budget} s, stopped at $((budget + GRACE)) s)"
  local t
  t=$(date +%s.%N)
  timeout --kill-after="$KILL_AFTER" "$((budget + GRACE))" "$@" --budget "$budget" --grace "$GRACE" $DRY_FLAG
  local rc=$?
  "$PY" benchmarks/gpu/results.py missing "$n" "$name" "$rc" "$budget"
  echo "part $n $name: exit $rc after $(elapsed "$t") s"
}

run_part 1 env "$B_ENV" "$PY" benchmarks/gpu/env_check.py
run_part 2 kernels "$B_KERNELS" "$PY" benchmarks/gpu/check_kernels.py --json "$OUTDIR/part2_kernels.json"
run_part 3 engine "$B_ENGINE" "$PY" benchmarks/gpu/engine_parity.py
run_part 4 memory "$B_MEMORY" "$PY" benchmarks/gpu/memory_truth.py
run_part 5 mfu "$B_MFU" "$PY" benchmarks/gpu/mfu.py
run_part 6 trainer "$B_TRAINER" "$PY" benchmarks/gpu/trainer_run.py
wait  # background builds, if any are still running (each has its own timeout)

echo
echo "total $(elapsed "$START") s"
"$PY" benchmarks/gpu/results.py summary
