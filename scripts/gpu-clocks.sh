#!/usr/bin/env bash
# On the GPU machine, from the repo root (after scripts/gpu-bundle.sh here): the SM clock and
# board power while grouped GEMMs and dense cuBLAS run, one long rep loop per row, so the
# power cap's effect on each kernel shows (bench/README, "The power cap"). Per spec
# shape:routing:op:reps[:config] one `capmoe-bench --sweep` process (its rows in order: AUTO's
# graph, the config if given, cublas-dense, the copy floor) under an nvidia-smi trace at 20 ms;
# bench/tools/clock_table.py prints each row's median clock, power and share of power-capped
# samples. Results: $OUT/clocks.txt (the table and the bench rows), $OUT/clocks.tgz (trace, logs).
#   OUT=<dir> [SPECS="dsv3_ep8_fc1:uniform:fprop:3000 ..."] [BUNDLE=gpu-bundle] bash scripts/gpu-clocks.sh
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the results}}; BUNDLE=${BUNDLE:-gpu-bundle}
source scripts/device-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
W=/tmp/clocks-out
rm -rf $W && mkdir -p $W "$R"
bash scripts/unpack-bundle.sh "$BUNDLE" || exit 2
B=$BUNDLE/run/bin/capmoe-bench
SPECS=${SPECS:-dsv3_ep8_fc1:balanced:fprop:3000 dsv3_ep8_fc1:uniform:fprop:3000 qwen3moe_fc1:uniform:fprop:6000 qwen3moe_fc2:uniform:fprop:10000}
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader -lms 20 \
  > $W/smi.csv 2> $W/smi.err &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
sleep 1
for spec in $SPECS; do
  IFS=: read -r shape routing op reps config <<<"$spec"
  configs=(); labels=auto
  [[ -n ${config:-} ]] && { configs=(--configs "$config"); labels=auto,$config; }
  echo "MARK labels $spec $labels,dense" >> $W/marks.txt
  echo "MARK start $spec $(date +%H:%M:%S.%3N)" >> $W/marks.txt
  timeout -k 5 "$(limit 120 20)" $B --sweep --shapes "$shape" --routing "$routing" --ops "$op" "${configs[@]}" \
    --reps "$reps" --out $W/bench > "$W/bench_${spec//:/_}.log" 2>&1
  echo "MARK end $spec $(date +%H:%M:%S.%3N)" >> $W/marks.txt
  sleep 0.5  # the power falls back between processes, which separates their segments
done
kill $smi 2>/dev/null
{ python3 bench/tools/clock_table.py $W/smi.csv $W/marks.txt
  echo
  grep -h -E '\| (capmoe-graph|cublas-dense|roofline) ' $W/bench_*.log | awk '!seen[$0]++' | cut -c1-125
} > "$R/clocks.txt"
save_tarball $W "$R/clocks.tgz"
cat "$R/clocks.txt"
