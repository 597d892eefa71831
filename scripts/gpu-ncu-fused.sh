#!/usr/bin/env bash
# ncu of the fused expert-path kernels beside the CUTLASS grouped GEMM each one replaces, on the
# GPU machine from the bundle (scripts/gpu-bundle.sh), from the repo root. Each fused test
# binary's ignored timing hook launches both at E128 T4096 k8 H2048 F768; ncu profiles the first
# launch of each (fused: -k its kernel; CUTLASS: -k dependent_gemm), so the two reports of a row
# come from the same process, data and shapes. Per kernel: SM / DRAM / L2 throughput, tensor
# pipe, L2 hit rate, DRAM bytes read and written (2026-11-28: the fused fc1 and fc2 dgrad moved
# ~1.8x the bytes they need; the memory tables say through which unit), warp stall reasons,
# issue slots.
#   OUT=<dir> [BUDGET=<s>] [SPECS="bin:filter:kernel ..."] bash scripts/gpu-ncu-fused.sh
# Results: $OUT/ncu-fused.tgz (one text report per spec and kernel, <binary>_<test>_<kernel>.txt) and a short table on stdout.
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the reports}}; BUNDLE=${BUNDLE:-gpu-bundle}
source scripts/device-common.sh
bash scripts/unpack-bundle.sh "$BUNDLE" || exit 2
W=/tmp/ncu-fused
rm -rf $W && mkdir -p $W "$R"
T=$BUNDLE/run/tests
NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
METRICS=lts__t_sector_hit_rate.pct,gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum

# binary : test filter : fused kernel (ncu -k regex); SPECS=... profiles some of them only.
SPECS=${SPECS:-fused_gpu:fused_fc1_timing:fc1_swiglu_kernel fused_dgrad_gpu:fused_dgrad_timing:swiglu_dgrad_kernel \
  fused_wgrad_gpu:fused_wgrad_timing:wgrad_gather_kernel}
for spec in $SPECS; do
  IFS=: read -r bin filter fused <<<"$spec"
  for kernel in $fused dependent_gemm; do
    if out_of_budget 30 0; then echo "ncu $bin $kernel: not run (budget)"; continue; fi
    CAPMOE_REQUIRE_GPU=1 timeout -k 10 "$(limit 90 0)" $NCU_BIN --clock-control none \
      -k regex:$kernel -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis --metrics $METRICS \
      $T/$bin --ignored --nocapture --test-threads=1 --exact $filter > $W/${bin}_${filter}_$kernel.txt 2>&1
    echo "ncu $bin $kernel rc=$?"
    save_tarball $W "$R/ncu-fused.tgz"
  done
done
# The figures that say what limits each kernel, one block per report.
for f in $W/*.txt; do
  echo "== $(basename "$f" .txt)"
  grep -E 'gpu__time_duration.sum|dram__bytes_(read|write).sum|Compute \(SM\) Throughput|DRAM Throughput|L2 Cache Throughput|Tensor|lts__t_sector_hit_rate|Issue Slots Busy|No Eligible|Registers Per Thread|Stall|Warp Cycles Per Issued' "$f" | head -n 24
done
