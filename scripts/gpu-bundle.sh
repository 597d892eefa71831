#!/usr/bin/env bash
# Builds every test and binary target of the workspace and the examples in release and gathers
# them, with a runner, into the git-ignored folder gpu-bundle/ (xz-compressed, to fit the GPU
# machine's transfer limit; scripts/unpack-bundle.sh unpacks it).
# On the GPU machine, from the repo root:  bash scripts/gpu-run.sh   (needs no Rust toolchain).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
rm -rf gpu-bundle && mkdir -p gpu-bundle/stage/tests gpu-bundle/stage/bin

collect() { # reads cargo's JSON messages; copies executables of the wanted kind
  python3 -c '
import json, shutil, sys
dest, want_test = sys.argv[1], sys.argv[2] == "test"
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
        continue
    if msg["profile"]["test"] != want_test:
        continue
    name = msg["target"]["name"]
    shutil.copy(msg["executable"], dest + "/" + name)
' "$@"
}

cargo test --release --workspace --no-run --message-format=json-render-diagnostics | collect gpu-bundle/stage/tests test
cargo build --release --workspace --bins --message-format=json-render-diagnostics | collect gpu-bundle/stage/bin bin
# The examples: the candle MoE block (a workspace of its own; the shared target folder keeps
# candle's CUDA kernels built once) and the C program. NO_CANDLE=1 leaves candle out: its own
# kernels take over half an hour on a fresh 2-core machine (gpu-all.sh then reports the example
# as not run).
if [[ "${NO_CANDLE:-0}" != 1 ]]; then
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}" cargo build --release --manifest-path examples/candle_moe/Cargo.toml \
    --bins --message-format=json-render-diagnostics | collect gpu-bundle/stage/bin bin
fi
bash examples/c/build.sh
cp "${CARGO_TARGET_DIR:-$root/target}/release/capmoe-c-example" gpu-bundle/stage/bin/
strip gpu-bundle/stage/tests/* gpu-bundle/stage/bin/* 2>/dev/null || true
# The commit the binaries were built from (reports and logs name it; "-dirty": uncommitted edits).
git describe --always --dirty --abbrev=7 > gpu-bundle/stage/COMMIT 2>/dev/null || echo unknown > gpu-bundle/stage/COMMIT
# xz with a 64 MiB dictionary: every binary carries the same kernel archive, so the
# compressor finds one in the next (~280 MB of binaries pack into ~11 MB; gzip gave 71 MB,
# past the device tool's 64 MiB transfer limit).
tar -C gpu-bundle/stage -cf - . | xz -9 -T2 > gpu-bundle/bundle.tar.xz
rm -rf gpu-bundle/stage
du -h gpu-bundle/bundle.tar.xz
