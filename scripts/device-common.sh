# Sourced by the scripts that run on the GPU machine (gpu-all, gpu-run, gpu-report, gpu-sweep):
# the time budget of one device call, atomic result tarballs, and commands that must not hang.
# A device call is killed at 600 s and returns only what lies under $OUT by then (at most 8
# files), so every step is capped by what the call has left and every result is refreshed as a
# whole file after each step.

# Seconds since the call began: the first script that sources this file starts the clock and
# exports it, so nested scripts (gpu-all runs gpu-run and gpu-sweep) share one budget.
export CAPMOE_CALL_START="${CAPMOE_CALL_START:-$(date +%s)}"
capmoe_elapsed() { echo $(( $(date +%s) - CAPMOE_CALL_START )); }

# min(CAP, what BUDGET has left less RESERVE seconds kept for the later steps), at least 10 s.
#   limit CAP RESERVE
limit() {
  local left=$(( ${BUDGET:-540} - $(capmoe_elapsed) - $2 ))
  ((left < 10)) && left=10
  ((left < $1)) && echo "$left" || echo "$1"
}

# True when BUDGET has fewer than NEED seconds left beyond RESERVE: the step is not started.
#   out_of_budget NEED RESERVE
out_of_budget() { (( ${BUDGET:-540} - $(capmoe_elapsed) - $2 < $1 )); }

# Tars folder DIR (its parent as root) into FILE through a temporary name, so a kill in the
# middle of a write leaves the previous complete tarball rather than a truncated one.
#   save_tarball DIR FILE
save_tarball() {
  tar -C "$(dirname "$1")" -czf "$2.tmp" "$(basename "$1")" 2>/dev/null && mv -f "$2.tmp" "$2"
}

# The GPU's name, max SM clock and memory, bounded: a wedged driver must not hang the call.
gpu_facts() {
  timeout -k 5 20 nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader \
    || echo "nvidia-smi failed or hung (rc=$?)"
}

# Processes still holding the GPU (a test a timeout did not reach, say): logged after the suite
# so a later step's figures can be read with that in mind.
gpu_processes() {
  timeout -k 5 20 nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader \
    || echo "nvidia-smi failed or hung (rc=$?)"
}

# compute-sanitizer flags test binary NAME needs beyond its tool's. NCCL's communicator setup
# (ncclCommInitAll) probes for kernel images its library has none of for this GPU:
# cudaFuncGetAttributes answers error 209 by design, and the tools count every such answer as
# an error (memcheck of ep_gpu: 48 on the H100, 2026-11-28, all inside libnccl). Those binaries
# run with API-error reports off; memory, race, sync and init errors are still reported.
# graph_gpu's CUDA calls that fail do so by design: GraphVariants reads each kernel node's
# parameter table from cuFuncGetParamInfo until it answers CUDA_ERROR_INVALID_VALUE (the driver
# has no parameter count), and two tests assert that cuGraphExecUpdate refuses another topology
# (memcheck of graph_gpu: 18 such reports, 14 and 4, and nothing else; H200, 2026-11-28).
#   sanitizer_flags_for NAME
sanitizer_flags_for() {
  case "$1" in
    ep_gpu | ep_group_gpu | graph_gpu) printf '%s\n' --report-api-errors no ;;
  esac
}

# The sides of an A/B (gpu-ab.sh, gpu-paths-ab.sh) as "bundle|environment" strings in the array
# `sides` (the environment "-" for none), and the bundles to unpack in `bundles`: bundle B under
# each of the ';'-separated environments in ENVS when that is set, else A and B as they are.
#   ab_sides A B
ab_sides() {
  if [[ -n "${ENVS:-}" ]]; then
    local envs e
    IFS=';' read -ra envs <<< "$ENVS"
    sides=(); for e in "${envs[@]}"; do sides+=("$2|$e"); done
    bundles=("$2")
  else
    sides=("$1|-" "$2|-"); bundles=("$1" "$2")
  fi
}

# The environment assignments of an A/B side ("" for "-"), for `read -ra` and `env`.
#   side_env SIDE
side_env() { [[ ${1#*|} == - ]] && echo "" || echo "${1#*|}"; }
