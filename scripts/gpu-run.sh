#!/usr/bin/env bash
# Runs the whole GPU suite from the bundle that scripts/gpu-bundle.sh made, from the repo root,
# with CAPMOE_REQUIRE_GPU=1 so that a missing GPU fails instead of skipping. A summary table is
# printed last. Full logs go to $LOGS when a caller names it (gpu-all.sh does); otherwise to
# /tmp/gpu-run-logs, returned as $OUT/suite-logs.tgz plus $OUT/summary.txt when OUT is set (a
# device call returns at most 8 files, and the suite writes one log per binary).
#   bash scripts/gpu-run.sh [name-filter]      an extended regex on the binary's name, e.g.
#                                              grouped_gemm or '^(graph_gpu|moe_gpu)$'
# BUNDLE=<folder> picks another bundle folder (default gpu-bundle), e.g. one per worktree.
# SUITE_BUDGET=<s>: no binary starts after that many seconds, and each one's cap is cut to what
# is left (a caller's outer timeout cannot reach the running test: `timeout` puts it in a
# process group of its own).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source "$root/scripts/device-common.sh"
filter="${1:-}"
bundle="${BUNDLE:-gpu-bundle}"
deadline=$(( $(date +%s) + ${SUITE_BUDGET:-1000000000} ))
logs="${LOGS:-/tmp/gpu-run-logs}"
# Standalone: a fresh folder, returned as one tarball.
[[ -z "${LOGS:-}" ]] && rm -rf "$logs"
mkdir -p "$logs" "$bundle/run"
return_logs() {
  [[ -z "${LOGS:-}" && -n "${OUT:-}" ]] || return 0
  save_tarball "$logs" "$OUT/suite-logs.tgz"
  cp "$logs/summary.txt" "$OUT/summary.txt"
}
bash "$root/scripts/unpack-bundle.sh" "$bundle" || exit 2
export CAPMOE_REQUIRE_GPU=1 CAPMOE_ECHO_GOLDEN_DIR="$root/tests/data/echo"
# libnccl for the EP tests (a PyTorch venv's, linked where cudarc looks; see the script).
source "$root/scripts/nccl-env.sh"
summary=()
reruns=()  # run:binary of every failure, for the PDL-off pass
failed=0
incomplete=0
# The binaries whose kernels have never run on a GPU (the fused ones) go last, so that a hang or
# fault there cannot cost the established suites their results when the caller's time runs
# out. Each result line also goes to $logs/summary.txt as soon as it is known, for a caller
# that has to cut this script short.
: >"$logs/summary.txt"
binaries=()
for test in "$bundle"/run/tests/*; do [[ "$(basename "$test")" != fused_* ]] && binaries+=("$test"); done
for test in "$bundle"/run/tests/fused_*; do [[ -e "$test" ]] && binaries+=("$test"); done
# Runs one test binary as row `$1` of the summary, the rest of the command after it; sets rc.
run_one() {
  local run="$1"; shift
  local start ms secs result skipped
  start=$(date +%s%N)
  "$@" >"$logs/$run.log" 2>&1
  rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "TIMEOUT after ${limit}s (a hang?)" | tee -a "$logs/$run.log"
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  secs="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  result="$(grep -E '^test result:' "$logs/$run.log" | tail -n 1)"
  # A test that skips counts as passed in libtest's line; --show-output keeps its "skipping:"
  # line in the log, so the row shows that some passes were (partly) skips, e.g. the
  # multi-GPU tests on one GPU.
  skipped=$(grep -c 'skipping: ' "$logs/$run.log")
  (( skipped > 0 )) && result="$result [$skipped 'skipping:' lines]"
  [[ $rc -ne 0 ]] && failed=1 && grep -E '^(---- |thread .* panicked|  left|  right|.*assert)' "$logs/$run.log" | head -n 20
  summary+=("$(printf '%-28s rc=%-3s %6ss  %s' "$run" "$rc" "$secs" "$result")")
  echo "${summary[-1]}" >>"$logs/summary.txt"
  return_logs
}
# Sets `limit` to binary $1's cap. Every wait of the persistent kernels spins unbounded, so a
# protocol bug hangs instead of failing: the cap keeps one hang from taking the later binaries'
# results with it. (The fused binaries get the common cap unless FUSED_TEST_TIMEOUT says
# otherwise: their case tables run every case in both forms.)
set_cap() {
  limit="${TEST_TIMEOUT:-150}"
  [[ "$1" == fused_* ]] && limit="${FUSED_TEST_TIMEOUT:-$limit}"
  return 0
}
# Cuts `limit` to the deadline; false (and a summary row) when fewer
# than 15 s are left.
fits_deadline() {
  local left=$(( deadline - $(date +%s) ))
  if (( left < 15 )); then
    summary+=("$(printf '%-28s not run (budget)' "$1")")
    echo "${summary[-1]}" >>"$logs/summary.txt"
    incomplete=1
    return 1
  fi
  (( limit > left - 5 )) && limit=$(( left - 5 ))
  return 0
}
for test in "${binaries[@]}"; do
  name="$(basename "$test")"
  [[ -n "$filter" && ! "$name" =~ $filter ]] && continue
  # CPU-only (echo_emulated, routing_emulated): they build the kernels from the source tree
  # with a host compiler, which the GPU machine's copy of the tree is not set up for.
  [[ "$name" == *_emulated ]] && continue
  set_cap "$name"
  fits_deadline "$name" || continue
  run_one "$name" timeout -k 5 "$limit" "$test" --test-threads=1 --show-output
  # A failure (not a hang) runs again later with every launch an ordinary one.
  [[ $rc -ne 0 && $rc -ne 124 && $rc -ne 137 ]] && reruns+=("$name:$test")
done
# The failures again with CAPMOE_GEMM_PDL=0 and CAPMOE_ROUTING_PDL=0 (grouped_gemm/
# dependent_launch.cuh, common/dependent_kernel.cuh), so the same call tells a fault of the
# programmatic launches from one of the kernels. After the first pass,
# so that a rerun never costs a later binary its first run.
for entry in "${reruns[@]}"; do
  IFS=: read -r run test <<<"$entry"
  set_cap "$(basename "$test")"
  fits_deadline "$run.no_pdl" || continue
  run_one "$run.no_pdl" env CAPMOE_GEMM_PDL=0 CAPMOE_ROUTING_PDL=0 timeout -k 5 "$limit" "$test" --test-threads=1 --show-output
done
echo "== GPU suite on $(gpu_facts | head -n 1) =="
if [[ ${#summary[@]} -eq 0 ]]; then
  echo "no test binary in $bundle/run/tests matched '${filter}': nothing ran" >&2
  exit 1
fi
printf '%s\n' "${summary[@]}"
return_logs
# 1: a binary failed; 3: none failed, but the budget left some unrun.
(( failed )) && exit 1
(( incomplete )) && exit 3
exit 0
