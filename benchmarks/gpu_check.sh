#!/usr/bin/env bash
# One-command validation on a CUDA machine (issue 28; docs/guides/gpu.md):
#   1. the suite's GPU mode (python -m pytest -m gpu tests, in 12 shards side by side:
#      benchmarks/gpu_suite.py), the Triton interpreter off;
#   2. benchmarks/bench_triton.py: the fused kernels vs SDPA at N = 4k and 16k;
#   3. benchmarks/gpu_overhead.py: every encoding vs flash SDPA and nope, N = 1k..16k, bf16.
# Each step has a time limit (together under 8 minutes). Writes benchmarks/results/gpu-<device>-<date>.md
# and, beside it, the suite's JUnit report (the input of benchmarks/gpu_proven.py); prints a
# summary; exits 1 when any step failed or ran out of time, 2 without a CUDA device.
#
#   benchmarks/gpu_check.sh [--dry-run] [--out-dir DIR]
#
# --dry-run prints the steps, their limits and the files it would write, and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python || command -v python3)}
OUT_DIR=benchmarks/results
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out-dir) OUT_DIR=${2:?--out-dir needs a directory}; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --dry-run, --out-dir DIR)" >&2; exit 2 ;;
  esac
  shift
done

DEVICE=$(env -u TRITON_INTERPRET "$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
SLUG=$(printf '%s' "${DEVICE:-no-cuda}" | tr '[:upper:]' '[:lower:]' | sed -e 's/nvidia//' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
STAMP=$(date -u +%Y%m%d-%H%M)
BASE="$OUT_DIR/gpu-$SLUG-$STAMP"
REPORT="$BASE.md"
JUNIT="$BASE.junit.xml"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

# name | limit (s) | command
STEPS=(
  "suite|295|$PY benchmarks/gpu_suite.py --shards 12 --deadline-s 270 --junit $JUNIT"
  "bench_triton|50|$PY benchmarks/bench_triton.py --lengths 4096 16384 --reps 5 --out $WORK/bench_triton.md"
  "overhead|120|$PY benchmarks/gpu_overhead.py --lengths 1024 2048 4096 8192 16384 --budget-s 90 --out $WORK/overhead.md"
)

if [ "$DRY" = 1 ]; then
  echo "device: ${DEVICE:-none (a run needs CUDA)}"
  echo "would write: $REPORT"
  echo "would write: $JUNIT"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$s"
    echo "step $name (limit ${limit}s): $cmd"
  done
  rmdir "$WORK"
  exit 0
fi

if [ -z "$DEVICE" ]; then
  echo "gpu_check.sh: no CUDA device here (torch.cuda.is_available() is False); see --dry-run" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"

STATUS=()
FAILED=0
T0=$(date +%s)
for s in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<< "$s"
  echo "== $name (limit ${limit}s): $cmd"
  t=$(date +%s)
  timeout -k 15 "$limit" bash -c "$cmd" > >(tee "$WORK/$name.log") 2>&1
  rc=$?
  dt=$(( $(date +%s) - t ))
  if [ $rc -eq 0 ]; then verdict=pass; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="timed out"; else verdict="failed (exit $rc)"; fi
  [ $rc -eq 0 ] || FAILED=1
  STATUS+=("| $name | $verdict | ${dt} s | \`$cmd\` |")
done
TOTAL=$(( $(date +%s) - T0 ))

{
  echo "# GPU check: $DEVICE ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  echo "- command: \`benchmarks/gpu_check.sh\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "- versions: $("$PY" -c 'import torch, triton, sys; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")' 2>&1)"
  echo "- total: ${TOTAL} s; the suite's JUnit report: \`$(basename "$JUNIT")\` (\`python benchmarks/gpu_proven.py\` reads it)"
  echo
  echo "| step | result | time | command |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STATUS[@]}"
  echo
  echo "## GPU suite (python -m pytest -m gpu tests)"
  echo
  echo '```'
  grep -E '^(FAILED|ERROR|-- )|passed|failed|skipped|error' "$WORK/suite.log" | tail -n 100
  echo '```'
  echo
  echo "## Fused Triton kernels vs SDPA (benchmarks/bench_triton.py)"
  echo
  if [ -s "$WORK/bench_triton.md" ]; then cat "$WORK/bench_triton.md"; else echo "no table: see the step's result above"; tail -n 20 "$WORK/bench_triton.log" | sed 's/^/    /'; fi
  echo
  if [ -s "$WORK/overhead.md" ]; then cat "$WORK/overhead.md"; else echo "## Encodings vs flash SDPA (benchmarks/gpu_overhead.py)"; echo; echo "no table: see the step's result above"; tail -n 20 "$WORK/overhead.log" | sed 's/^/    /'; fi
} > "$REPORT"

echo
echo "== summary ($DEVICE, ${TOTAL} s)"
printf '%s\n' "${STATUS[@]}" | cut -d'|' -f2-4
grep -E '^-- GPU suite' "$WORK/suite.log" | tail -n 1
grep -E '^\| (4096|16384) \|' "$WORK/overhead.md" 2>/dev/null | grep -E '\| (yes|no) \|$' || true
echo "wrote $REPORT"
rm -rf "$WORK"
exit $FAILED
