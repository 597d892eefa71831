#!/usr/bin/env bash
# One device call (from the repo root on the GPU machine, after scripts/gpu-bundle.sh here): the
# grouped GEMM config sweep behind AUTO — every SM90 config on every bench shape, fprop / dgrad /
# wgrad, uniform and zipf routing, both weight layouts — then an ncu summary of chosen kernels.
# Results come back as $OUT/sweep.tgz (logs, JSON, ncu reports; refreshed after every step),
# $OUT/sweep_tables.txt (x roofline per config, the winner) and $OUT/gpu.txt: a device call
# returns at most 8 files. The tables are printed last; the exit status is 1 when a sweep failed.
# The steps share BUDGET seconds (default 540, inside the device call's 600): each sweep and
# each ncu case is capped by its own timeout and by what the budget has left (sweeps keep a
# reserve for the ncu cases); the tables are made from whatever the sweeps wrote.
#   CONFIGS=a,b NCU=0 SHAPES=... bash scripts/gpu-sweep.sh
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the logs}}; BUNDLE=${BUNDLE:-gpu-bundle}
source scripts/device-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
W=/tmp/sweep-out  # everything this call writes; nothing of an earlier call on a warm machine
rm -rf $W /tmp/sweep /tmp/ncu && mkdir -p "$R" $W "$BUNDLE/run" /tmp/sweep
save() { save_tarball $W "$R/sweep.tgz"; }
bash scripts/unpack-bundle.sh "$BUNDLE" || exit 2
B=$BUNDLE/run/bin/capmoe-bench
ncu_reserve=0; [[ "${NCU:-1}" == 1 ]] && ncu_reserve=160
CONFIGS=${CONFIGS:-sm90-coop,sm90-coop-nocluster,sm90-pingpong-wide,sm90-counter}
SHAPES=${SHAPES:-mixtral_fc1,dsv3_ep8_fc1,dsv3_ep8_fc2,qwen3moe_fc1,qwen3moe_fc2,decode_fc1}
gpu_facts | tee $W/gpu.txt; cp $W/gpu.txt "$R/gpu.txt"
failed=0  # 1 when a sweep exited non-zero (the call's exit status says so)
for layout in ${SWEEP_LAYOUTS:-enk ekn}; do
  timeout -k 10 "$(limit ${SWEEP_TIMEOUT:-200} $ncu_reserve)" $B --sweep --shapes $SHAPES --routing ${SWEEP_ROUTING:-uniform,zipf} --ops fprop,dgrad,wgrad \
    --weight-layout $layout --configs $CONFIGS --reps ${REPS:-8} --out /tmp/sweep/$layout > $W/sweep_$layout.log 2>&1
  rc=$?; (( rc != 0 )) && failed=1
  echo "sweep $layout rc=$rc" | tee -a $W/sweep_$layout.log
  cp /tmp/sweep/$layout/*.json $W/sweep_$layout.json 2>/dev/null; save
done
if [[ "${NCU:-1}" == 1 ]]; then
  # The config's first launch (-s 5 skips AUTO's four timed runs and its reference run). Per kernel: DRAM and tensor-pipe throughput, L2 hit rate, top warp stall reasons.
  # The counter kernel has a name of its own: matched alone, one launch skipped (a --reps 1 sweep
  # may launch it fewer than six times when AUTO picks another kernel, and -s 5 then skips them all).
  NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for spec in ${NCU_CASES:-dsv3_ep8_fc1:fprop:sm90-counter qwen3moe_fc1:fprop:sm90-counter qwen3moe_fc2:fprop:sm90-counter qwen3moe_fc1:wgrad:sm90-coop}; do
    IFS=: read -r shape op cfg <<<"$spec"
    kernels=(-k regex:'device_kernel|dependent_gemm' -s 5)
    [[ $cfg == sm90-counter ]] && kernels=(-k regex:counter_gemm -s 1)
    timeout -k 10 "$(limit 120 0)" $NCU_BIN --clock-control none "${kernels[@]}" -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      $B --sweep --shapes $shape --routing uniform --ops $op --configs $cfg --reps 1 --out /tmp/ncu > $W/ncu_${shape}_${op}_${cfg}.txt 2>&1
    echo "ncu $spec rc=$?"; save
  done
fi
: > $W/sweep_tables.txt
for layout in ${SWEEP_LAYOUTS:-enk ekn}; do
  { echo "== sweep table, weights $layout"
    if [[ -f $W/sweep_$layout.json ]]; then python3 bench/tools/sweep_table.py $W/sweep_$layout.json 2>&1
    else echo "no table: the sweep wrote no JSON (sweep_$layout.log in sweep.tgz says why)"; fi
  } >> $W/sweep_tables.txt
done
# Which configs win anywhere, over both layouts (a config kept for one layout is kept).
jsons=(); for layout in ${SWEEP_LAYOUTS:-enk ekn}; do [[ -f $W/sweep_$layout.json ]] && jsons+=($W/sweep_$layout.json); done
if (( ${#jsons[@]} > 1 )); then
  { echo "== every layout together"; python3 bench/tools/sweep_table.py "${jsons[@]}" 2>&1 | sed -n '/^Auto more/,$p'; } >> $W/sweep_tables.txt
fi
cp $W/sweep_tables.txt "$R/sweep_tables.txt"; save
cat $W/sweep_tables.txt
exit $failed
