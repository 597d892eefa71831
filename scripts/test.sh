#!/usr/bin/env bash
# The README's test command: installs the toolchain if needed, then runs every test of the
# workspace (the library, capmoe-bench, the C-ABI example; not examples/candle_moe, a workspace
# of its own that .ci/run builds) in release
# (CUDA objects are shared with `cargo build --release`). GPU tests print "skipping: <reason>"
# without a GPU unless CAPMOE_REQUIRE_GPU=1 (output is not captured, so those lines show).
# Ends with one summary line over all test binaries, where a GPU test that skipped counts as
# skipped, not passed. Extra arguments go to `cargo test` before its `--`.
# With a GPU the tests run one at a time (--test-threads=1), as scripts/gpu-run.sh runs them: a
# test that opens its stream makes cudarc synchronise the context, and a capture in global mode
# on another test thread fails on that (the capturing tests share a lock, but opening a stream
# comes before it). Without a GPU every GPU test skips, so the CPU tests keep their threads.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
harness=(--nocapture)
if timeout 20 nvidia-smi -L >/dev/null 2>&1; then harness+=(--test-threads=1); fi
status=0
cargo test --release --workspace "$@" -- "${harness[@]}" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     { s += gsub(/skipping: /, "&") }  # anywhere: one test thread prints it after "test NAME ... "
     END { printf "tests: %d passed, %d failed, %d skipped\n", p - s, f, s }' "$log"
exit "$status"
