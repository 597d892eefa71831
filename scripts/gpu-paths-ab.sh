#!/usr/bin/env bash
# A/B of the expert path on two bundles in one device call (as scripts/gpu-ab.sh does for the
# GEMM sweep): B's routing / expert-path GPU tests first (an experiment is timed only if it is
# right), then `capmoe-bench --only paths --no-fused --path-shapes $SHAPES` on A and B
# alternated ROUNDS times, and one table of the forward / backward rows (graph replay, us).
# Run from the repo root on the GPU machine after building each bundle here
# (`scripts/gpu-bundle.sh`, then rename the first folder):
#   run(carry=["gpu-bundle", "gpu-bundle-old"], command="OUT=$OUT bash scripts/gpu-paths-ab.sh")
#   A, B     bundle folders (default gpu-bundle-old, gpu-bundle)
#   SHAPES   --path-shapes (default E64_T128,E128_T4096); REPS (30); ROUNDS (2)
#   TESTS    B's test binaries run first (default routing_gpu moe_gpu fused_moe_gpu graph_gpu)
#   SOAK=1   also B's soak
# Results: $OUT/paths_<bundle>_<round>.txt and the table (printed last). Session 28 ran this
# script twice (the combine's grouped loads, kept; two more trims, level).
set -uo pipefail
source scripts/device-common.sh
A=${A:-gpu-bundle-old}; B=${B:-gpu-bundle}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} CAPMOE_REQUIRE_GPU=1 CAPMOE_ECHO_GOLDEN_DIR=$PWD/tests/data/echo
for bundle in "$A" "$B"; do bash scripts/unpack-bundle.sh "$bundle" > /dev/null || exit 2; done
gpu_facts; cat "$A/run/COMMIT" "$B/run/COMMIT"
for t in ${TESTS:-routing_gpu moe_gpu fused_moe_gpu graph_gpu}; do
  timeout -k 10 "$(limit 150 200)" "$B/run/tests/$t" --test-threads=1 > "/tmp/test_$t.txt" 2>&1
  echo "$t rc=$?: $(grep 'test result' "/tmp/test_$t.txt")"
done
if [[ "${SOAK:-0}" == 1 ]]; then
  timeout -k 10 "$(limit 120 150)" "$B/run/tests/soak_gpu" --ignored --nocapture --test-threads=1 > /tmp/soak.txt 2>&1
  echo "soak rc=$?: $(grep 'test result' /tmp/soak.txt)"
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for bundle in "$A" "$B"; do
    if out_of_budget 40 5; then echo "$bundle round $round: not run (budget)"; continue; fi
    name=$(basename "$bundle")_$round
    timeout -k 10 "$(limit 120 5)" "$bundle/run/bin/capmoe-bench" --only paths --no-fused --path-shapes "${SHAPES:-E64_T128,E128_T4096}" \
      --reps "${REPS:-30}" --out "/tmp/p_$name" > "/tmp/p_$name.log" 2>&1
    echo "$bundle round $round rc=$?"
    grep -E "expert_(fwd|bwd)" /tmp/p_$name/*.txt | grep -E "capmoe-(graph|gemms-graph|routing-graph|inference-graph) " \
      | cut -d'|' -f1-5 > "$OUT/paths_$name.txt"
  done
done
python3 - "$OUT" <<'PY'
import glob, sys, collections
t = collections.defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/paths_*.txt")):
    run = f.split("/")[-1][6:-4]
    for line in open(f):
        c = [x.strip() for x in line.split("|")]
        t[(c[0], c[2], c[3])][run] = float(c[4])
runs = sorted({r for v in t.values() for r in v})
print("shape op imp".ljust(66), *[r.rjust(18) for r in runs])
for k in sorted(t):
    print(" ".join(k).ljust(66), *[f"{t[k].get(r, float('nan')):18.1f}" for r in runs])
PY
