#!/usr/bin/env bash
# A/B of two bundles in one device call: the same `capmoe-bench --sweep` on bundle A (e.g. the
# committed kernels) and bundle B (an experiment), alternated ROUNDS times so that drift of the
# machine shows up in both, then one table: every (shape, routing, op) with the roofline and
# each run's time (x roofline). The machine changes between calls (up to ~10 % on the same
# kernel), so only timings from one call compare. Run from the repo root on the GPU machine:
#   run(carry=["gpu-bundle", "gpu-bundle-a"], command="A=gpu-bundle-a B=gpu-bundle OUT=$OUT bash scripts/gpu-ab.sh")
# after building each bundle here (`scripts/gpu-bundle.sh`, then copy or rename the folder).
#   A, B      bundle folders (default gpu-bundle-a, gpu-bundle)
#   SHAPES    --shapes (default the five E >= 32 and decode shapes plus mixtral_fc1)
#   OPS       --ops (default wgrad); CONFIGS --configs (default sm90-counter); ROUTING (uniform,zipf)
#   LAYOUT    --weight-layout (enk); REPS (10); ROUNDS (2)
#   TESTS=1   first runs B's grouped_gemm_gpu (an experiment is timed only if it is right)
#   ENVS      instead of A against B: bundle B under each of these environments (separated by
#             ';', "-" for none), e.g. ENVS="-;CAPMOE_X=1;CAPMOE_X=2": an A/B/... of one
#             build's runtime switch (TESTS=1 then runs the tests under every one but "-")
# Results: $OUT/ab_<bundle>_<round>.json, $OUT/ab_table.txt (also printed last).
set -uo pipefail
source scripts/device-common.sh
A=${A:-gpu-bundle-a}; B=${B:-gpu-bundle}
SHAPES=${SHAPES:-dsv3_ep8_fc1,dsv3_ep8_fc2,qwen3moe_fc1,qwen3moe_fc2,mixtral_fc1,decode_fc1}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} CAPMOE_REQUIRE_GPU=1
ab_sides "$A" "$B"
for bundle in "${bundles[@]}"; do bash scripts/unpack-bundle.sh "$bundle" > /dev/null || exit 2; done
gpu_facts
if [[ "${TESTS:-0}" == 1 ]]; then
  for side in "${sides[@]}"; do
    [[ -n "${ENVS:-}" && ${side#*|} == - ]] && continue
    [[ -z "${ENVS:-}" && ${side%%|*} != "$B" ]] && continue
    read -ra assign <<< "$(side_env "$side")"
    env "${assign[@]}" timeout -k 10 "$(limit 240 120)" "${side%%|*}/run/tests/grouped_gemm_gpu" --test-threads=1 \
      > /tmp/ab_tests.txt 2>&1
    echo "grouped_gemm_gpu ($side) rc=$?: $(grep 'test result' /tmp/ab_tests.txt)"
    cat /tmp/ab_tests.txt >> "$OUT/ab_tests.txt"
  done
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!sides[@]}"; do
    side=${sides[$i]}; bundle=${side%%|*}
    read -ra assign <<< "$(side_env "$side")"
    if out_of_budget 60 10; then echo "$side round $round: not run (budget)"; continue; fi
    name=${i}_$(basename "$bundle")_$round
    env "${assign[@]}" timeout -k 10 "$(limit 240 10)" "$bundle/run/bin/capmoe-bench" --sweep --shapes "$SHAPES" \
      --routing "${ROUTING:-uniform,zipf}" --ops "${OPS:-wgrad}" --configs "${CONFIGS:-sm90-counter}" \
      --weight-layout "${LAYOUT:-enk}" --reps "${REPS:-10}" --out "/tmp/ab_$name" > "/tmp/ab_$name.log" 2>&1
    echo "$side round $round rc=$? (ab_$name)"
    cp /tmp/ab_"$name"/*.json "$OUT/ab_$name.json" 2> /dev/null
  done
done
# Each run's config rows (capmoe-graph[<config>]) per case, read by sweep_table.py's loader.
python3 - "$OUT" > "$OUT/ab_table.txt" << 'PY'
import glob, sys
sys.path.insert(0, "bench/tools")
from sweep_table import PREFIX, config_name, load
out = sys.argv[1]
runs = {path[len(out) + 4:-5]: load([path]) for path in sorted(glob.glob(out + "/ab_*.json"))}
cases = sorted({key for groups in runs.values() for key in groups})
impls = sorted({i for groups in runs.values() for g in groups.values() for i in g if i.startswith(PREFIX)})
cols = [(run, impl) for impl in impls for run in runs]
print("case".ljust(34), "roofline".rjust(8), *[f"{run} {config_name(impl)}".rjust(24) for run, impl in cols])
for key in cases:
    roof = next((g[key]["roofline"] for g in runs.values() if g.get(key, {}).get("roofline")), None)
    times = [runs[run].get(key, {}).get(impl) for run, impl in cols]
    cells = [f"{us:8.1f} ({us / roof:4.2f})" if us and roof else "-" for us in times]
    print(" ".join(key).ljust(34), f"{roof or 0:8.1f}", *[x.rjust(24) for x in cells])
PY
cat "$OUT/ab_table.txt"
