#!/usr/bin/env bash
# GPU speed in one call on a CUDA machine (issue 45): benchmarks/gpu_perf.py's baselines (SDPA's
# default kernel, named by the profiler, and FlashAttention-2 forced), every registered encoding
# through auto, triton and flex at N 4096 and 16384 (B 4, 16 heads, head_dim 64 and 128, bf16,
# causal; forward and forward+backward), and the ablations (matmul precision, tile sizes, rotary
# pre-rotated vs in-kernel, CUDA graphs around the rotary path), each time over its FLOP/byte floor.
# Fits 8 minutes of one H100, compilation included: no case starts past --budget-s (450 s: 7.5 min),
# and a hard limit of 480 s stops the process; results are rewritten after every case, so a cut run
# keeps what it timed. Writes benchmarks/results/gpu-<device>-<date>-perf.md and .json.
#
#   benchmarks/gpu_perf.sh [--dry-run [--json PLAN.json]] [--out-dir DIR] [--budget-s S]
#
# --dry-run needs no GPU: every case built at tiny sizes on the CPU and run once where it can
# (Triton cases under TRITON_INTERPRET=1 only), the plan printed with an estimated device time
# (--json also writes it as JSON).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python || command -v python3)}
ARGS=()
DRY=0
BUDGET=450
LIMIT=480
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out-dir) ARGS+=(--out-dir "${2:?--out-dir needs a directory}"); shift ;;
    --budget-s) BUDGET=${2:?--budget-s needs seconds}; shift ;;
    --json) ARGS+=(--json "${2:?--json needs a path}"); shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_perf.sh: unknown argument '$1' (use --dry-run, --json PATH, --out-dir DIR, --budget-s S)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$DRY" = 1 ]; then
  echo "would run: timeout -k 10 $LIMIT $PY benchmarks/gpu_perf.py --budget-s $BUDGET ${ARGS[*]}"
  exec "$PY" benchmarks/gpu_perf.py --dry-run --budget-s "$BUDGET" "${ARGS[@]}"
fi

# the kernels compile for the device: never the interpreter here
env -u TRITON_INTERPRET timeout -k 10 "$LIMIT" "$PY" benchmarks/gpu_perf.py --budget-s "$BUDGET" "${ARGS[@]}"
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "gpu_perf.sh: stopped at the ${LIMIT} s limit; the results files hold every case timed before it" >&2
fi
exit $rc
