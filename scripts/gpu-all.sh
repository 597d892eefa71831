#!/usr/bin/env bash
# One device call (run from the repo root on the GPU machine, after scripts/gpu-bundle.sh here):
# the whole GPU suite, the C and candle examples, the ignored timing hooks (fused fc1, fused
# fc2 dgrad in both forms, gathered wgrad, graphs) if built, a uniform-routing config sweep with ncu off
# (scripts/gpu-sweep.sh does the full one), and a memcheck of the Echo + expert path graph test,
# the fused kernels' tests and the EP tests (R = 1). Logs under $R (one tarball,
# refreshed after each step); a short summary is printed last.
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the logs}}; BUNDLE=${BUNDLE:-gpu-bundle}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
source scripts/nccl-env.sh  # libnccl for the EP tests and rows
mkdir -p /tmp/logs
save() { tar -C /tmp -czf $R/logs.tgz logs 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader > /tmp/logs/gpu.txt
# The suite first and with most of the call's 600 s: the steps after it are cut short first (the
# tarball keeps what each finished step wrote).
BUNDLE=$BUNDLE OUT=/tmp/logs timeout ${SUITE_TIMEOUT:-360} bash scripts/gpu-run.sh > /tmp/logs/suite.txt 2>&1; save
T=$BUNDLE/run/tests
# The examples: the C ABI from C (a checked grouped GEMM), candle's MoE block on the crate
# (checked against candle's per-expert loop, and timed against it).
timeout 60 $BUNDLE/run/bin/capmoe-c-example --gpu > /tmp/logs/c_example.txt 2>&1; echo "c example rc=$?" >> /tmp/logs/c_example.txt; save
CAPMOE_REQUIRE_GPU=1 timeout 150 $BUNDLE/run/bin/candle_moe > /tmp/logs/candle_moe.txt 2>&1; echo "candle_moe rc=$?" >> /tmp/logs/candle_moe.txt; save
for hook in fused_gpu:fused_fc1_timing fused_dgrad_gpu:timing fused_wgrad_gpu:fused_wgrad_timing graph_gpu:timing; do
  IFS=: read -r bin filter <<<"$hook"
  [[ -x $T/$bin ]] || continue
  CAPMOE_REQUIRE_GPU=1 timeout 60 $T/$bin --ignored --nocapture --test-threads=1 $filter > /tmp/logs/timing_$bin.txt 2>&1
  echo "timing $bin rc=$?" >> /tmp/logs/timing_$bin.txt; save
done
OUT=/tmp/logs/sweep BUNDLE=$BUNDLE NCU=0 SWEEP_ROUTING=uniform SWEEP_LAYOUTS=enk SWEEP_TIMEOUT=150 \
  bash scripts/gpu-sweep.sh > /tmp/logs/sweep.txt 2>&1; save
for m in echo_moe_gpu fused_gpu fused_dgrad_gpu fused_wgrad_gpu fused_moe_gpu ep_gpu ep_kernels_gpu; do
  [[ -x $T/$m ]] || continue
  CAPMOE_REQUIRE_GPU=1 CAPMOE_SANITIZER=1 CAPMOE_ECHO_MOE_REPLAYS=2 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    $T/$m --test-threads=1 > /tmp/logs/memcheck_$m.txt 2>&1
  echo "memcheck $m rc=$?" >> /tmp/logs/memcheck_$m.txt; save
done
cat /tmp/logs/gpu.txt; echo "bundle commit: $(cat $BUNDLE/run/COMMIT 2>/dev/null || echo unknown)"; cat /tmp/logs/suite.txt
# The per-binary lines, also when the suite step was cut short before its own table.
echo "== suite, binary by binary =="; cat /tmp/logs/summary.txt 2>/dev/null
tail -n 4 /tmp/logs/c_example.txt; tail -n 12 /tmp/logs/candle_moe.txt
tail -n 30 /tmp/logs/timing_*.txt 2>/dev/null
cat /tmp/logs/sweep/sweep_table_enk.txt 2>/dev/null
tail -n 3 /tmp/logs/memcheck_*.txt
