#!/usr/bin/env bash
# One device call (run from the repo root on the GPU machine, after scripts/gpu-bundle.sh here):
#   1. the whole GPU suite (gpu-run.sh), with most of the call;
#   2. the C and candle examples;
#   3. the ignored timing hooks (fused fc1, fused fc2 dgrad in both forms, gathered wgrad,
#      graphs) if built;
#   4. a uniform-routing config sweep with ncu off (scripts/gpu-sweep.sh does the full one);
#   5. a memcheck of the Echo + expert path graph test, the fused kernels' tests and the EP
#      tests (R = 1); scripts/sanitize.sh is the full sanitizer matrix.
# The steps share BUDGET seconds (default 560, inside the call's 600): a step that would start
# with too little left is recorded "not run (budget)" in steps.txt, and the summary below is
# always printed. A binary that hung in the suite is not started again by the later steps.
# Logs come back as $OUT/logs.tgz (refreshed after each step); the summary is printed last.
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the logs}}; BUNDLE=${BUNDLE:-gpu-bundle}
export BUDGET=${BUDGET:-560}
source scripts/device-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
source scripts/nccl-env.sh  # libnccl for the EP tests and rows
L=/tmp/logs
rm -rf $L && mkdir -p $L "$R"  # nothing of an earlier call on a warm machine is reported
save() { save_tarball $L "$R/logs.tgz"; }
# Records a step's outcome (one line of steps.txt).
step() { echo "$1" >> $L/steps.txt; save; }
gpu_facts > $L/gpu.txt; save
T=$BUNDLE/run/tests
# A binary whose suite run was killed by its timeout (a hang): the later steps skip it.
hung() { grep -qE "^$1(\.[a-z_]+)? +rc=(124|137) " $L/summary.txt 2>/dev/null; }

# 1. The suite: at most 360 s, keeping 60 s for the examples. gpu-run.sh stops starting binaries
# at its own deadline and caps each one to it (an outer kill would miss the running test, whose
# `timeout` has a process group of its own); the outer timeout is only a safety net.
suite_budget=$(limit "${SUITE_TIMEOUT:-360}" 60)
LOGS=$L SUITE_BUDGET=$suite_budget timeout -k 10 $((suite_budget + 30)) bash scripts/gpu-run.sh > $L/suite.txt 2>&1
step "suite rc=$? (budget ${suite_budget}s)"
{ echo "== GPU processes after the suite (none expected)"; gpu_processes; } >> $L/gpu.txt

# 2. The examples: the C ABI from C (a checked grouped GEMM), candle's MoE block on the crate
# (checked against candle's per-expert loop, and timed against it). candle_moe links
# libcublas / libcurand: the toolkit's, else a torch venv's cu13 wheels (ldd is logged).
# Both run the GEMM (candle also the expert path): after a hang there, they would hang too.
if hung grouped_gemm_gpu; then step "c example: not run (grouped_gemm_gpu hung)"
elif out_of_budget 20 10; then step "c example: not run (budget)"; else
  timeout -k 5 "$(limit 60 10)" $BUNDLE/run/bin/capmoe-c-example --gpu > $L/c_example.txt 2>&1
  echo "c example rc=$?" >> $L/c_example.txt; step "$(tail -n 1 $L/c_example.txt)"
fi
candle_ld=$LD_LIBRARY_PATH
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib; do
  [[ -e $d/libcublas.so.13 ]] && candle_ld="$candle_ld:$d"  # after the toolkit's own
done
if [[ ! -x $BUNDLE/run/bin/candle_moe ]]; then step "candle_moe: not run (not in the bundle: NO_CANDLE=1)"
elif hung grouped_gemm_gpu || hung moe_gpu; then step "candle_moe: not run (grouped_gemm_gpu or moe_gpu hung)"
elif out_of_budget 40 10; then step "candle_moe: not run (budget)"; else
  { echo "== ldd (CUDA libraries)"; LD_LIBRARY_PATH=$candle_ld ldd $BUNDLE/run/bin/candle_moe | grep -E 'cuda|cublas|curand|not found'; } > $L/candle_moe.txt 2>&1
  LD_LIBRARY_PATH=$candle_ld CAPMOE_REQUIRE_GPU=1 timeout -k 5 "$(limit 150 10)" $BUNDLE/run/bin/candle_moe >> $L/candle_moe.txt 2>&1
  echo "candle_moe rc=$?" >> $L/candle_moe.txt; step "$(tail -n 1 $L/candle_moe.txt)"
fi

# 3. The timing hooks.
for hook in fused_gpu:fused_fc1_timing fused_dgrad_gpu:timing fused_wgrad_gpu:fused_wgrad_timing graph_gpu:timing; do
  IFS=: read -r bin filter <<<"$hook"
  [[ -x $T/$bin ]] || continue
  if hung $bin; then step "timing $bin: not run (hung in the suite)"; continue; fi
  if out_of_budget 20 10; then step "timing $bin: not run (budget)"; continue; fi
  CAPMOE_REQUIRE_GPU=1 timeout -k 5 "$(limit 60 10)" $T/$bin --ignored --nocapture --test-threads=1 $filter > $L/timing_$bin.txt 2>&1
  echo "timing $bin rc=$?" >> $L/timing_$bin.txt; step "$(tail -n 1 $L/timing_$bin.txt)"
done

# 4. A reduced sweep (its own budget is this call's, through CAPMOE_CALL_START).
if out_of_budget 60 10; then step "sweep: not run (budget)"; else
  R=$L/sweep BUNDLE=$BUNDLE NCU=0 SWEEP_ROUTING=uniform SWEEP_LAYOUTS=enk SWEEP_TIMEOUT=150 BUDGET=$((BUDGET - 10)) \
    bash scripts/gpu-sweep.sh > $L/sweep.txt 2>&1
  step "sweep rc=$?"
fi

# 5. memcheck (exit 86: the tool found errors; 124/137: cut by its timeout).
for m in echo_moe_gpu fused_gpu fused_dgrad_gpu fused_wgrad_gpu fused_moe_gpu ep_gpu ep_kernels_gpu; do
  run=$m
  [[ -x $T/$m ]] || continue
  if hung $run; then step "memcheck $run: not run (hung in the suite)"; continue; fi
  if out_of_budget 30 10; then step "memcheck $run: not run (budget)"; continue; fi
  CAPMOE_REQUIRE_GPU=1 CAPMOE_SANITIZER=1 CAPMOE_ECHO_MOE_REPLAYS=2 timeout -k 5 "$(limit 60 10)" \
    /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 86 $(sanitizer_flags_for $m) \
    $T/$m --test-threads=1 > $L/memcheck_$run.txt 2>&1
  echo "memcheck $run rc=$?" >> $L/memcheck_$run.txt; step "$(tail -n 1 $L/memcheck_$run.txt)"
done

# What comes back is the last 12,000 characters of this output: the details first, the short
# tables last, so that a long output never cuts the tables.
tail -n 3 $L/memcheck_*.txt 2>/dev/null
tail -n 30 $L/timing_*.txt 2>/dev/null
cat $L/sweep/sweep_tables.txt 2>/dev/null
tail -n 4 $L/c_example.txt 2>/dev/null; tail -n 12 $L/candle_moe.txt 2>/dev/null
echo "== the suite's failure lines"; grep -E '^(---- |thread .* panicked|  left|  right|.*assert)' $L/suite.txt | head -n 30
cat $L/gpu.txt; echo "bundle commit: $(cat $BUNDLE/run/COMMIT 2>/dev/null || echo unknown)"
echo "== steps ($(capmoe_elapsed) s of the call)"; cat $L/steps.txt
# The per-binary lines, also when the suite step was cut short before its own table.
echo "== suite, binary by binary =="; cat $L/summary.txt 2>/dev/null
