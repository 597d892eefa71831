#!/usr/bin/env bash
# The README's test command: installs the toolchain if needed, then runs every test in release
# (CUDA objects are shared with `cargo build --release`). GPU tests skip without a GPU unless
# CAPMOE_REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cargo test --release "$@"
