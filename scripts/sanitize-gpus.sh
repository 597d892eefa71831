#!/usr/bin/env bash
# The sanitizer matrix spread over the GPUs of one machine: one scripts/sanitize.sh instance
# per lane, each lane on a GPU of its own (CUDA_VISIBLE_DEVICES, so the multi-GPU EP tests
# skip there: scripts/ep-ranks.sh covers those), run at once inside one device call. Lanes are
# "TOOLS:FILTER[:TEST_FILTER]" arguments (sanitize.sh's knobs of those names); a lane's own
# runs are sequential as in sanitize.sh, and every lane gets the whole BUDGET. Run on the GPU
# machine from the repo root (gpu-bundle/ carried along):
#
#   OUT=<dir> bash scripts/sanitize-gpus.sh 'memcheck:^fused_' 'memcheck:^[a-e]' 'synccheck:' 'initcheck:'
#   OUT=<dir> bash scripts/sanitize-gpus.sh 'racecheck:^moe_gpu$:replayed' 'racecheck:^moe_gpu$:megatron|pointer'
#
# Lane i writes $OUT/lane<i>/sanitize-{logs.tgz,summary.txt} (a device call returns at most 8
# files: 4 lanes). Exit status: the worst of the lanes' (1 a run failed, 3 incomplete).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:?set OUT to a folder for the logs}"
mkdir -p "$out"
(( $# > 0 )) || { echo "usage: OUT=<dir> $0 'TOOLS:FILTER' ..." >&2; exit 64; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
(( gpus >= $# )) || { echo "sanitize-gpus: $# lanes but $gpus GPU(s)" >&2; exit 2; }
# Unpacked once here: the lanes would otherwise unpack the same archive at the same time.
bash scripts/unpack-bundle.sh "${BUNDLE:-gpu-bundle}" || exit 2
pids=()
lane=0
for spec in "$@"; do
  IFS=: read -r tools filter test_filter <<<"$spec"
  CUDA_VISIBLE_DEVICES=$lane OUT="$out/lane$lane" SANITIZE_LOGS="/tmp/sanitize-logs-$lane" \
    TOOLS="$tools" FILTER="$filter" TEST_FILTER="$test_filter" bash scripts/sanitize.sh >"$out/lane$lane.log" 2>&1 &
  pids+=($!)
  lane=$((lane + 1))
done
worst=0  # 1 when a lane had a failed run, else the first other nonzero status (3: incomplete)
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  echo "== lane $i rc=$rc"
  (( rc == 1 || (rc != 0 && worst == 0) )) && worst=$rc
done
for i in "${!pids[@]}"; do
  echo "== lane $i: $(sed -n "$((i + 1))p" <(printf '%s\n' "$@"))"
  cat "$out/lane$i/sanitize-summary.txt" 2>/dev/null || tail -n 20 "$out/lane$i.log"
  rm -f "$out/lane$i.log"
done
exit "$worst"
