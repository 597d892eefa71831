#!/usr/bin/env bash
# Builds every test and binary target of the workspace in release and gathers them, with a runner, into
# the git-ignored folder gpu-bundle/ (compressed, to fit the GPU machine's transfer limit).
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
strip gpu-bundle/stage/tests/* gpu-bundle/stage/bin/* 2>/dev/null || true
tar -C gpu-bundle/stage -czf gpu-bundle/bundle.tar.gz .
rm -rf gpu-bundle/stage
du -h gpu-bundle/bundle.tar.gz
