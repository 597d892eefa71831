#!/usr/bin/env bash
# One device call (run from the repo root on the GPU machine, after scripts/gpu-bundle.sh here):
# the whole GPU suite, the ignored timing hooks (fused fc1, graphs) if built, a uniform-routing
# config sweep with ncu off (scripts/gpu-sweep.sh does the full one), and a memcheck of the
# Echo + expert path graph test and of the fused fc1 tests. Logs under $R (one tarball,
# refreshed after each step); a short summary is printed last.
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the logs}}; BUNDLE=${BUNDLE:-gpu-bundle}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
mkdir -p /tmp/logs
save() { tar -C /tmp -czf $R/logs.tgz logs 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader > /tmp/logs/gpu.txt
BUNDLE=$BUNDLE OUT=/tmp/logs timeout ${SUITE_TIMEOUT:-270} bash scripts/gpu-run.sh > /tmp/logs/suite.txt 2>&1; save
T=$BUNDLE/run/tests
for hook in fused_gpu:fused_fc1_timing graph_gpu:timing; do
  IFS=: read -r bin filter <<<"$hook"
  [[ -x $T/$bin ]] || continue
  CAPMOE_REQUIRE_GPU=1 timeout 60 $T/$bin --ignored --nocapture --test-threads=1 $filter > /tmp/logs/timing_$bin.txt 2>&1
  echo "timing $bin rc=$?" >> /tmp/logs/timing_$bin.txt; save
done
OUT=/tmp/logs/sweep BUNDLE=$BUNDLE NCU=0 SWEEP_ROUTING=uniform SWEEP_LAYOUTS=enk SWEEP_TIMEOUT=150 \
  bash scripts/gpu-sweep.sh > /tmp/logs/sweep.txt 2>&1; save
for m in echo_moe_gpu fused_gpu; do
  [[ -x $T/$m ]] || continue
  CAPMOE_REQUIRE_GPU=1 CAPMOE_ECHO_MOE_REPLAYS=2 timeout 60 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    $T/$m --test-threads=1 > /tmp/logs/memcheck_$m.txt 2>&1
  echo "memcheck $m rc=$?" >> /tmp/logs/memcheck_$m.txt; save
done
cat /tmp/logs/gpu.txt /tmp/logs/suite.txt
tail -n 30 /tmp/logs/timing_*.txt 2>/dev/null
cat /tmp/logs/sweep/sweep_table_enk.txt 2>/dev/null
tail -n 3 /tmp/logs/memcheck_*.txt
