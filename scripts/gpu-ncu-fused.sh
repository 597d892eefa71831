#!/usr/bin/env bash
# ncu of the fused expert-path kernels beside the CUTLASS grouped GEMM each one replaces, on the
# GPU machine from the bundle (scripts/gpu-bundle.sh), from the repo root. Each fused test
# binary's ignored timing hook launches both at E128 T4096 k8 H2048 F768; ncu profiles the first
# launch of each (fused: -k its kernel; CUTLASS: -k dependent_gemm), so the two reports of a row
# come from the same process, data and shapes. Per kernel: SM / DRAM / L2 throughput, tensor
# pipe, L2 hit rate, DRAM bytes read and written (2026-11-28: the fused fc1 and fc2 dgrad moved
# ~1.8x the bytes they need; the memory tables say through which unit), warp stall reasons,
# issue slots.
#   OUT=<dir> [BUDGET=<s>] [SPECS="bin:filter:kernel ..."] [SOURCE=1] [PARTNER=<regex>]
#     [NAME_BASE=mangled] bash scripts/gpu-ncu-fused.sh
# SOURCE=1 adds warp-state sampling per SASS instruction: <report>_sass.csv (ncu's source page)
# and <report>_hot.txt, the 40 instructions with the most stall samples (where the warps wait).
# PARTNER: the kernel profiled beside each spec's (default dependent_gemm, the CUTLASS GEMM).
# NAME_BASE=mangled matches the regexes against mangled names, which hold template arguments:
# e.g. the gathered counter wgrad against the plain one in its cooperative form (AUTO runs the
# column-split form at <= 512 rows per expert; the environment reaches the test binary):
#   CAPMOE_COUNTER_WGRAD=cooperative NAME_BASE=mangled SOURCE=1 PARTNER='counter_wgrad_kernel.*6GatherE0E' \
#     SPECS='fused_wgrad_gpu:fused_wgrad_timing:counter_wgrad_kernel.*6GatherE2E' OUT=... bash scripts/gpu-ncu-fused.sh
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

# The report's SASS with per-instruction samples, and its hottest instructions by stall samples.
hot_instructions() {
  timeout -k 5 60 $NCU_BIN --import "$1.ncu-rep" --page source --csv --print-source sass > "$1_sass.csv" 2>&1
  python3 - "$1_sass.csv" > "$1_hot.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head = next((i for i, r in enumerate(rows) if "Source" in r), None)
if head is None:
    sys.exit("no source table in " + sys.argv[1])
names = rows[head]
col = lambda *keys: next((i for i, n in enumerate(names) if all(k in n for k in keys)), None)
src, samp = col("Source"), col("Warp Stall Sampling (All")
if samp is None:
    samp = col("Sampling")
body = [r for r in rows[head + 1:] if len(r) == len(names)]
num = lambda v: float(v.replace(",", "") or 0)
total = sum(num(r[samp]) for r in body) or 1
print("samples", total, "columns:", [n for n in names if "stall" in n.lower()][:12])
for r in sorted(body, key=lambda r: -num(r[samp]))[:40]:
    print(f"{100 * num(r[samp]) / total:5.1f}%  {r[src][:110]}")
PY
  rm -f "$1.ncu-rep"  # tens of MB: the CSV keeps what it says
}

# binary : test filter : fused kernel (ncu -k regex); SPECS=... profiles some of them only.
SPECS=${SPECS:-fused_gpu:fused_fc1_timing:fc1_swiglu_kernel fused_dgrad_gpu:fused_dgrad_timing:swiglu_dgrad_kernel \
  fused_wgrad_gpu:fused_wgrad_timing:wgrad_gather_kernel}
for spec in $SPECS; do
  IFS=: read -r bin filter fused <<<"$spec"
  for kernel in $fused ${PARTNER:-dependent_gemm}; do
    if out_of_budget 30 0; then echo "ncu $bin $kernel: not run (budget)"; continue; fi
    report=$W/${bin}_${filter}_${kernel//[^A-Za-z0-9_]/_}
    CAPMOE_REQUIRE_GPU=1 timeout -k 10 "$(limit 90 0)" $NCU_BIN --clock-control none \
      ${NAME_BASE:+--kernel-name-base $NAME_BASE} -k "regex:$kernel" -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis --metrics $METRICS \
      ${SOURCE:+--section SourceCounters --export $report} \
      $T/$bin --ignored --nocapture --test-threads=1 --exact $filter > $report.txt 2>&1
    echo "ncu $bin $kernel rc=$?"
    if [[ -n "${SOURCE:-}" ]]; then
      # An exported report prints nothing: its sections come from the file, before it is deleted.
      timeout -k 5 60 $NCU_BIN --import "$report.ncu-rep" --page details >> $report.txt 2>&1
      hot_instructions $report
    fi
    save_tarball $W "$R/ncu-fused.tgz"
  done
done
# The figures that say what limits each kernel, one block per report.
for f in $W/*.txt; do
  echo "== $(basename "$f" .txt)"
  grep -E 'gpu__time_duration.sum|dram__bytes_(read|write).sum|Compute \(SM\) Throughput|DRAM Throughput|L2 Cache Throughput|Tensor|lts__t_sector_hit_rate|Issue Slots Busy|No Eligible|Registers Per Thread|Stall|Warp Cycles Per Issued' "$f" | head -n 24
done
