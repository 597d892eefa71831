#!/usr/bin/env bash
# One device call (from the repo root on the GPU machine, after scripts/gpu-bundle.sh here): the
# benchmark report with its competitor measured in the same call, as bench/README.md asks:
#   1. bench/anchors/torch_anchor.py (torch._grouped_mm, cuBLAS loops, the torch expert path);
#   2. capmoe-bench --anchors <that JSON>: every row of the report, the torch rows merged;
#   3. (PDL_COMPARE=1, default) the GEMM rows again with CAPMOE_GEMM_PDL=0, uniform routing,
#      graph replay: what the GEMM's programmatic dependent launch on the argument kernel saves.
# Results come back as $OUT/report.tgz (JSON, PNG, logs) plus $OUT/report.txt (the table);
# the tail of each step is printed last. capmoe-bench rewrites its JSON and table after every
# unit (gemm, graphs, ep, echo, then the expert paths, the fused ones last), so a step cut by
# its timeout keeps what it measured. The steps share BUDGET seconds (default 540, inside the
# device call's 600), each capped by its own *_TIMEOUT. The exit status is capmoe-bench's.
#   OUT=<dir> [REPS=20] [REPORT_ARGS="--no-fused"] [PDL_COMPARE=0] bash scripts/gpu-report.sh
set -uo pipefail
R=${R:-${OUT:?set OUT to a folder for the results}}; BUNDLE=${BUNDLE:-gpu-bundle}
source scripts/device-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
source scripts/nccl-env.sh  # libnccl for the EP rows (skipped, saying so, without it)
# A fresh folder: an earlier call's anchor JSON on a warm machine must not be merged as this one's.
rm -rf /tmp/report && mkdir -p "$R" /tmp/report/pdl_off
bash scripts/unpack-bundle.sh "$BUNDLE" || exit 2
B=$BUNDLE/run/bin/capmoe-bench
export CAPMOE_COMMIT="$(cat "$BUNDLE/run/COMMIT" 2>/dev/null || echo unknown)"
save() { save_tarball /tmp/report "$R/report.tgz"; }
gpu_facts > /tmp/report/gpu.txt

PYTHONUNBUFFERED=1 OUT=/tmp/report timeout -k 10 "$(limit "${ANCHOR_TIMEOUT:-150}" 300)" python3 bench/anchors/torch_anchor.py \
  > /tmp/report/torch_anchor.log 2>&1
echo "torch anchor rc=$?" >> /tmp/report/torch_anchor.log; save
anchors=()
[[ -f /tmp/report/torch_anchor.json ]] && anchors=(--anchors /tmp/report/torch_anchor.json)
read -r -a extra <<<"${REPORT_ARGS:-}"
timeout -k 10 "$(limit "${REPORT_TIMEOUT:-360}" 60)" "$B" --reps "${REPS:-20}" "${anchors[@]}" "${extra[@]}" --out /tmp/report \
  > /tmp/report/report.txt 2> /tmp/report/report.log
bench_rc=$?
echo "capmoe-bench rc=$bench_rc" >> /tmp/report/report.log; save
if [[ "${PDL_COMPARE:-1}" == 1 ]]; then
  CAPMOE_GEMM_PDL=0 timeout -k 10 "$(limit "${PDL_TIMEOUT:-90}" 0)" "$B" --only gemm --routing uniform --reps "${REPS:-20}" \
    --out /tmp/report/pdl_off > /tmp/report/pdl_off/report.txt 2> /tmp/report/pdl_off/report.log
  echo "capmoe-bench CAPMOE_GEMM_PDL=0 rc=$?" >> /tmp/report/pdl_off/report.log; save
fi
# The final table on stdout; after a timeout, the table capmoe-bench last wrote.
if [[ ! -s /tmp/report/report.txt ]]; then
  for f in /tmp/report/*.txt; do [[ $f == */gpu.txt || $f == */report.txt ]] || cat "$f"; done > /tmp/partial-report.txt
  mv /tmp/partial-report.txt /tmp/report/report.txt
fi
cp /tmp/report/report.txt "$R/report.txt"
cat /tmp/report/gpu.txt; echo "bundle commit: $CAPMOE_COMMIT"
tail -n 5 /tmp/report/torch_anchor.log /tmp/report/report.log /tmp/report/pdl_off/report.log 2>/dev/null
echo "== report (also \$OUT/report.txt) =="; cat /tmp/report/report.txt
exit $bench_rc  # the report's own status (the anchor and the PDL-off rows are extras)
