#!/usr/bin/env bash
# A/B of the expert path in one device call (as scripts/gpu-ab.sh does for the GEMM sweep):
# B's routing / expert-path GPU tests first (an experiment is timed only if it is right), then
# `capmoe-bench --only paths --path-shapes $SHAPES` on each side, the sides alternated ROUNDS
# times, and one table of the forward / backward rows (graph replay, us).
# Run from the repo root on the GPU machine after building each bundle here
# (`scripts/gpu-bundle.sh`, then rename the first folder):
#   run(carry=["gpu-bundle", "gpu-bundle-old"], command="OUT=$OUT bash scripts/gpu-paths-ab.sh")
#   A, B       bundle folders (default gpu-bundle-old, gpu-bundle)
#   ENVS       instead of A against B: bundle B under each of these environments (separated by
#              ';', "-" for none), e.g. ENVS="-;CAPMOE_FUSED_FC1_ROWS=backward": an A/B of one
#              build's runtime switch (the tests then run under every one but "-")
#   VARIANTS=1 every plan variant of the report (the unfused and forced fused plans beside the
#              default; bench/src/path.rs `variants`), not `--no-fused`'s default plan alone
#   SHAPES     --path-shapes (default E64_T128,E128_T4096); REPS (30); ROUNDS (2)
#   TESTS      B's test binaries run first (default routing_gpu moe_gpu fused_moe_gpu graph_gpu;
#              "none" for none)
#   SOAK=1     also B's soak
# Results: $OUT/paths_<side>_<bundle>_<round>.txt and the table (printed last, also in
# $OUT/paths_table.txt). Session 28 ran this script twice (the combine's grouped loads, kept;
# two more trims, level); session 38 did the ENVS form by hand (the Auto training-fc1 A/B).
set -uo pipefail
source scripts/device-common.sh
A=${A:-gpu-bundle-old}; B=${B:-gpu-bundle}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} CAPMOE_REQUIRE_GPU=1 CAPMOE_ECHO_GOLDEN_DIR=$PWD/tests/data/echo
ab_sides "$A" "$B"
for bundle in "${bundles[@]}"; do bash scripts/unpack-bundle.sh "$bundle" > /dev/null || exit 2; done
gpu_facts; for bundle in "${bundles[@]}"; do cat "$bundle/run/COMMIT"; done
# B's tests: once without ENVS, under every environment but "-" with it (the switch's own code).
test_sides=("$B|-")
if [[ -n "${ENVS:-}" ]]; then
  test_sides=(); for side in "${sides[@]}"; do [[ ${side#*|} != - ]] && test_sides+=("$side"); done
fi
tests=${TESTS:-routing_gpu moe_gpu fused_moe_gpu graph_gpu}
[[ $tests == none ]] && tests=""
for side in "${test_sides[@]}"; do
  read -ra assign <<< "$(side_env "$side")"
  for t in $tests; do
    env "${assign[@]}" timeout -k 10 "$(limit 150 200)" "$B/run/tests/$t" --test-threads=1 > "/tmp/test_$t.txt" 2>&1
    echo "$t ($side) rc=$?: $(grep 'test result' "/tmp/test_$t.txt")"
    cat "/tmp/test_$t.txt" >> "$OUT/paths_tests.txt"
  done
done
if [[ "${SOAK:-0}" == 1 ]]; then
  timeout -k 10 "$(limit 120 150)" "$B/run/tests/soak_gpu" --ignored --nocapture --test-threads=1 > /tmp/soak.txt 2>&1
  echo "soak rc=$?: $(grep 'test result' /tmp/soak.txt)"
fi
variant_flags=(--no-fused); [[ "${VARIANTS:-0}" == 1 ]] && variant_flags=()
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!sides[@]}"; do
    side=${sides[$i]}; bundle=${side%%|*}
    read -ra assign <<< "$(side_env "$side")"
    if out_of_budget 40 5; then echo "$side round $round: not run (budget)"; continue; fi
    name=${i}_$(basename "$bundle")_$round
    env "${assign[@]}" timeout -k 10 "$(limit 240 5)" "$bundle/run/bin/capmoe-bench" --only paths "${variant_flags[@]}" \
      --path-shapes "${SHAPES:-E64_T128,E128_T4096}" --reps "${REPS:-30}" --out "/tmp/p_$name" > "/tmp/p_$name.log" 2>&1
    echo "$side round $round rc=$? (paths_$name)"
    grep -hE "expert_(fwd|bwd)" /tmp/p_$name/*.txt | grep -E "capmoe-[a-z0-9-]*graph " \
      | cut -d'|' -f1-5 > "$OUT/paths_$name.txt"
  done
done
python3 - "$OUT" > "$OUT/paths_table.txt" <<'PY'
import glob, sys, collections
t = collections.defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/paths_*_*_*.txt")):
    run = f.split("/")[-1][len("paths_"):-len(".txt")]
    for line in open(f):
        c = [x.strip() for x in line.split("|")]
        try:
            t[(c[0], c[2], c[3])][run] = float(c[4])
        except (IndexError, ValueError):
            pass  # an "unavailable" row
runs = sorted({r for v in t.values() for r in v})
print("shape op imp".ljust(80), *[r.rjust(22) for r in runs])
for k in sorted(t):
    print(" ".join(k).ljust(80), *[f"{t[k].get(r, float('nan')):22.1f}" for r in runs])
PY
cat "$OUT/paths_table.txt"
