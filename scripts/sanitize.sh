#!/usr/bin/env bash
# compute-sanitizer over the GPU test binaries of the bundle that scripts/gpu-bundle.sh made:
# memcheck, racecheck, synccheck and initcheck, one process per (tool, binary), each under its
# own timeout, the whole inside one time budget (one 600 s device call). Run on the GPU
# machine from the repo root (gpu-bundle/ carried along). Logs: $OUT/sanitize-logs.tgz
# (refreshed after every run) and $OUT/sanitize-summary.txt; the summary table is printed last.
#
#   OUT=<dir> bash scripts/sanitize.sh
#
# Knobs (environment):
#   TOOLS    tools to run, in order (default "memcheck synccheck initcheck racecheck").
#   FILTER   extended regex on the binary name (default: every *_gpu), e.g. '^moe_gpu$'.
#   TESTS    arguments passed to each test binary after the harness flags: a test-name
#            filter, --skip patterns, --exact (default none).
#   TIMEOUT  seconds per (tool, binary) run; default per tool (memcheck 120, synccheck 90,
#            initcheck 120, racecheck 200 per test process), always cut to what the budget
#            has left.
#   BUDGET   seconds for the whole script (default 560); a run that would start with less
#            than 20 s left is reported "not run (budget)" and the script exits 3 (incomplete)
#            unless a run failed (exit 1).
#
# One call does not hold the whole matrix (4 tools x every *_gpu binary, minutes each): split
# it by TOOLS and FILTER into calls (README's Reliability section gives the plan) and read the
# INCOMPLETE line of each summary.
#   RACECHECK_PER_TEST=0  racecheck runs one process per binary instead of one per test.
#   TEST_FILTER           with one process per test (racecheck): an extended regex on the
#                         test names, only matching tests run (to split one binary's tests
#                         over the lanes of scripts/sanitize-gpus.sh).
#   INITCHECK_SKIP        tests --skip'ped under initcheck (default
#                         "pooled_bucket_graphs_equal_graphs_captured_alone": see below).
#   RACECHECK_SKIP        tests --skip'ped under racecheck (default
#                         "target_shape_matches_reference": see below).
#   SANITIZER             the compute-sanitizer binary (default /usr/local/cuda/bin/...).
#   BUNDLE                the bundle folder (default gpu-bundle).
#   SANITIZE_LOGS         the working log folder (default /tmp/sanitize-logs; one per instance
#                         when several run at once, as scripts/sanitize-gpus.sh does).
#
# What the tests do under a tool: every run sets CAPMOE_SANITIZER=1, which the timing-only
# and soak tests honour by printing "skipping: under a sanitizer" (they are #[ignore]d as
# well, and this script never passes --ignored), and it lowers the replay counts of the long
# functional tests (CAPMOE_ECHO_MOE_REPLAYS=2, CAPMOE_GRAPH_STEPS=20, moe_gpu's 1000 replays
# -> 20 under CAPMOE_SANITIZER); every replay that runs is still checked in full.
#
# RACECHECK. Every kernel is race-checked, the CUTLASS grouped GEMM included (0 hazards on the
# H100, 2026-11-28). Two findings of that day shape how:
#  - excluding the GEMM (--kernel-name-exclude kns=dependent_gemm_kernel, this script's default
#    until then) made compute-sanitizer 2025.3 die at the first GEMM launch of every binary
#    ("Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception", then
#    cudaErrorIllegalAddress), with or without the GEMM's programmatic dependent launch; with
#    the GEMM instrumented the same tests pass. That was issue 19's moe_gpu "death";
#  - racecheck's host memory grows with the launches it tracks: moe_gpu, graph_gpu and
#    fused_moe_gpu each reached the machine's 128 GiB as one process and were SIGKILLed
#    (rc 9). So racecheck runs every test in a process of its own (RACECHECK_PER_TEST).
# INITCHECK. graph_gpu's pooled-bucket test is skipped: initcheck reported 4656 reads of
# uninitialised memory there (H200, 2026-11-28) and nowhere else in any binary, every one in
# a kernel reading a buffer whose only writer is a CUTLASS GEMM's TMA-store epilogue (swiglu
# reading h, swiglu backward reading dact, the combine and its backward reading fc2's output
# rows), in pool memory (graph::MemoryPool) that nothing memsets. Every other buffer of the
# crate is zeroed when allocated, which the tool does see. The reading: the tool does not
# count bulk-async (TMA) stores as initialising; the test's replays are bit-equal to graphs
# captured alone, which a read of rows the GEMM left unwritten would break.
# echo_gpu's target_shape_matches_reference (T = 8192, 256 experts, EP = 64) is skipped
# under racecheck: it ran past 150 s there, and its kernels and code paths are the ones
# random_inputs_match_the_cpu_reference race-checks at up to 256 experts and T = 5000.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/device-common.sh  # save_tarball
out="${OUT:?set OUT to a folder for the logs}"
bundle="${BUNDLE:-gpu-bundle}"
tools="${TOOLS:-memcheck synccheck initcheck racecheck}"
filter="${FILTER:-}"
budget="${BUDGET:-560}"
racecheck_skip="${RACECHECK_SKIP-target_shape_matches_reference}"
initcheck_skip="${INITCHECK_SKIP-pooled_bucket_graphs_equal_graphs_captured_alone}"
read -r -a test_args <<<"${TESTS:-}"
cs="${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}"
[[ -x "$cs" ]] || cs="$(command -v compute-sanitizer || true)"
[[ -n "$cs" ]] || { echo "no compute-sanitizer (set SANITIZER)" >&2; exit 2; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export CAPMOE_REQUIRE_GPU=1 CAPMOE_SANITIZER=1 CAPMOE_ECHO_GOLDEN_DIR="$root/tests/data/echo"
# libnccl for the EP tests (a PyTorch venv's, linked where cudarc looks).
source scripts/nccl-env.sh
export CAPMOE_ECHO_MOE_REPLAYS="${CAPMOE_ECHO_MOE_REPLAYS:-2}" CAPMOE_GRAPH_STEPS="${CAPMOE_GRAPH_STEPS:-20}"

start_all=$(date +%s)
logs="${SANITIZE_LOGS:-/tmp/sanitize-logs}"
rm -rf "$logs" && mkdir -p "$logs" "$out" "$bundle/run"
bash scripts/unpack-bundle.sh "$bundle" || exit 2
save() { save_tarball "$logs" "$out/sanitize-logs.tgz"; }
{ "$cs" --version | tail -n 1; timeout -k 5 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
  >"$logs/versions.txt" 2>&1

default_timeout() {
  case "$1" in
    memcheck | initcheck) echo 120 ;;
    synccheck) echo 90 ;;
    *) echo 200 ;;
  esac
}

# compute-sanitizer flags of one tool. The exit code 86 marks "the tool found errors", apart
# from the test harness's own failure (101) and a kill (124 timeout, 137 SIGKILL).
tool_flags() {
  local flags=(--error-exitcode 86 --print-limit 50)
  case "$1" in
    memcheck) flags+=(--tool memcheck --leak-check no) ;;
    synccheck) flags+=(--tool synccheck) ;;
    initcheck) flags+=(--tool initcheck) ;;
    racecheck) flags+=(--tool racecheck --racecheck-report all) ;;
    *) echo "unknown tool '$1' (memcheck, synccheck, initcheck, racecheck)" >&2; return 1 ;;
  esac
  printf '%s\n' "${flags[@]}"
}

# "errors hazards" read from a log: ERROR SUMMARY (memcheck, synccheck, initcheck) and
# RACECHECK SUMMARY ("N hazards displayed (E errors, W warnings)"); "-" where the tool
# printed no summary (it died or was killed first).
counts_of() {
  local log=$1 errors hazards
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ error' "$log" | tail -n 1 | grep -oE '[0-9]+')
  hazards=$(grep -oE 'RACECHECK SUMMARY: [0-9]+ hazard' "$log" | tail -n 1 | grep -oE '[0-9]+')
  if [[ -z "$errors" ]]; then
    errors=$(grep -oE 'RACECHECK SUMMARY: .*\(([0-9]+) error' "$log" | tail -n 1 | grep -oE '\([0-9]+' | tr -d '(')
  fi
  echo "${errors:--} ${hazards:--}"
}

# The tests of binary NAME that a plain run runs, one per line (libtest's --list less its
# --list --ignored), less those skipped under racecheck.
tests_of() {
  local bin="$bundle/run/tests/$1" ignored
  ignored="$("$bin" --list --ignored 2>/dev/null | sed -n 's/: test$//p')"
  "$bin" --list 2>/dev/null | sed -n 's/: test$//p' | while read -r t; do
    grep -qxF -- "$t" <<<"$ignored" && continue
    [[ -n "${TEST_FILTER:-}" && ! "$t" =~ $TEST_FILTER ]] && continue
    for s in $racecheck_skip; do [[ "$t" == *"$s"* ]] && continue 2; done
    echo "$t"
  done
}

# Runs the tool (flags), the binary (name) and ARGS once, appending to LOG; adds to the globals
# errors, hazards (numbers, or "-" once a run printed no summary), ms; rss = the largest peak;
# rc = the last nonzero exit status.
#   run_process LOG ARGS...
run_process() {
  local log=$1; shift
  local t0 part="$log.part" code e h r
  echo "\$ ${cs} ${flags[*]} $name $*   (timeout ${limit}s)" >"$part"
  t0=$(date +%s%N)
  # timeout -k: SIGTERM first (the tool then still prints what it has), SIGKILL 10 s later.
  # /usr/bin/time -f %M: the peak host RSS of the tool + test, which tells an OOM kill apart.
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -f 'maxrss_kb %M' -o "$part.rss" timeout -k 10 "$limit" \
      "$cs" "${flags[@]}" "$bundle/run/tests/$name" "$@" >>"$part" 2>&1
  else
    timeout -k 10 "$limit" "$cs" "${flags[@]}" "$bundle/run/tests/$name" "$@" >>"$part" 2>&1
  fi
  code=$?
  local no_cuda_call=0
  # A test that made no CUDA call (one that skips, e.g. ep_gpu's per-process rank test without
  # CAPMOE_EP_RANK) and passed: the tool exits 255 ("terminated before first instrumented API
  # call"); nothing was checked, and nothing failed.
  if ((code == 255)) && grep -q 'terminated before first instrumented API call' "$part" &&
    grep -q '^test result: ok' "$part"; then
    code=0 no_cuda_call=1
    no_cuda=$((no_cuda + 1))
  fi
  ms=$((ms + ($(date +%s%N) - t0) / 1000000))
  r=$(awk '/maxrss_kb/ {printf "%d", $2 / 1024}' "$part.rss" 2>/dev/null)
  [[ -n "$r" ]] && ((r > ${rss:-0})) && rss=$r
  cat "$part.rss" >>"$part" 2>/dev/null && rm -f "$part.rss"
  if ((no_cuda_call == 0)); then
    read -r e h < <(counts_of "$part")
    if [[ "$e" == - || "$errors" == - ]]; then errors=-; else errors=$((errors + e)); fi
    if [[ "$h" == - || "$hazards" == - ]]; then hazards=-; else hazards=$((hazards + h)); fi
  fi
  ((code != 0)) && rc=$code
  cat "$part" >>"$log" && rm -f "$part"
}

rows=()
row() { rows+=("$(printf '%-16s %-15s %7s %8s %5s %7s %9s  %s' "$@")"); }
row binary tool errors hazards rc seconds maxrss_MB note
for tool in $tools; do tool_flags "$tool" >/dev/null || exit 2; done
failed=0
not_run=0
binaries=()
for test in "$bundle"/run/tests/*_gpu; do
  name="$(basename "$test")"
  [[ -n "$filter" && ! "$name" =~ $filter ]] && continue
  binaries+=("$name")
done
[[ ${#binaries[@]} -gt 0 ]] || { echo "no *_gpu binary in $bundle/run/tests matched '$filter'" >&2; exit 2; }

for tool in $tools; do
  for name in "${binaries[@]}"; do
    left=$((budget - ($(date +%s) - start_all)))
    if ((left < 20)); then
      row "$name" "$tool" - - - - - "not run (budget)"
      not_run=$((not_run + 1))
      continue
    fi
    limit=${TIMEOUT:-$(default_timeout "$tool")}
    ((limit > left - 10)) && limit=$((left - 10))
    args=(--test-threads=1 "${test_args[@]}")
    case "$tool" in
      racecheck*) skips=$racecheck_skip ;;
      initcheck) skips=$initcheck_skip ;;
      *) skips= ;;
    esac
    for s in $skips; do args+=(--skip "$s"); done
    mapfile -t flags < <(tool_flags "$tool"; sanitizer_flags_for "$name")
    log="$logs/${tool}__${name}.log"
    : >"$log"
    if [[ "$tool" == racecheck && "${RACECHECK_PER_TEST:-1}" == 1 ]]; then
      # One process per test: racecheck's host memory grows with every launch it tracks, and
      # moe_gpu, graph_gpu and fused_moe_gpu as one process each passed the machine's 128 GiB
      # and were SIGKILLed (rc 9, 2026-11-28) in their longest tests.
      mapfile -t tests < <(tests_of "$name")
    else
      tests=("")
    fi
    rc=0 errors=0 hazards=0 ms=0 rss="" ran=0 no_cuda=0
    for test in "${tests[@]}"; do
      left=$((budget - ($(date +%s) - start_all)))
      ((left < 20)) && { not_run=$((not_run + 1)); echo "== not run (budget): $test" >>"$log"; continue; }
      ((limit > left - 10)) && limit=$((left - 10))
      run_args=("${args[@]}")
      [[ -n "$test" ]] && run_args+=(--exact "$test")
      run_process "$log" "${run_args[@]}"
      ran=$((ran + 1))
    done
    result=$(grep -E '^test result:' "$log" | grep -oE '[0-9]+ passed; [0-9]+ failed' |
      awk '{p += $1; f += $3} END {if (NR) printf "%d passed; %d failed", p, f}')
    ((${#tests[@]} > 1)) && result="$result ($ran processes, one per test)"
    # The test a process was in when the tool reported its death (one process per test: the
    # log's last test line is the last process's test, not necessarily the one that died).
    died=$(grep -oE "^test [^ ]+ \.\.\. =+ Error: process didn't terminate" "$log" | cut -d' ' -f2 | paste -sd, -)
    last_test=$(grep -oE '^test [^ ]+ \.\.\.' "$log" | tail -n 1 | cut -d' ' -f2)
    in_test=${died:-$last_test}
    case $rc in
      0) note="${result:-ok}" ;;
      86) note="tool reported errors; ${result}" ;;
      101) note="a test failed: $(grep -m1 -oE '^---- [^ ]+' "$log" | cut -c6-)" ;;
      124) note="timeout ${limit}s in $last_test" ;;
      137) note="SIGKILL (OOM or timeout -k) in $in_test" ;;
      *) note="rc $rc in $in_test" ;;
    esac
    grep -q "didn't terminate successfully" "$log" && note="$note; target died"
    ((no_cuda > 0)) && note="$note; $no_cuda made no CUDA call (nothing checked)"
    grep -q 'skipping: under a sanitizer' "$log" && note="$note; $(grep -c 'skipping: under a sanitizer' "$log") skipped"
    [[ $rc -ne 0 || "$errors" != 0 && "$errors" != - || "$hazards" != 0 && "$hazards" != - ]] && failed=1
    row "$name" "$tool" "$errors" "$hazards" "$rc" "$((ms / 1000)).$(((ms % 1000) / 100))" "${rss:--}" "$note"
    printf '%s\n' "${rows[@]}" >"$logs/summary.txt"
    save
  done
done

{
  echo "== compute-sanitizer on $(tail -n 1 "$logs/versions.txt"), $(head -n 1 "$logs/versions.txt")"
  echo "== tools: $tools; filter: ${filter:-all *_gpu}; tests: ${TESTS:-all}; racecheck skips: ${racecheck_skip:-none}; initcheck skips: ${initcheck_skip:-none}; \
racecheck: $([[ "${RACECHECK_PER_TEST:-1}" == 1 ]] && echo one process per test || echo one process per binary)"
  ((not_run > 0)) && echo "== INCOMPLETE: $not_run (tool, binary) runs not run for lack of budget (exit 3 unless a run failed)"
  printf '%s\n' "${rows[@]}"
} | tee "$logs/summary.txt" >"$out/sanitize-summary.txt"
save
cat "$out/sanitize-summary.txt"
# 1: a run failed or a tool reported errors; 3: every run that ran was clean, but some did not run.
((failed)) && exit 1
((not_run > 0)) && exit 3
exit 0
