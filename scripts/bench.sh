#!/usr/bin/env bash
# The main job: builds and runs the benchmark report (capmoe-bench) on GPU 0. Without a GPU it
# prints why and exits non-zero. Extra arguments go to capmoe-bench (try --help, or --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cargo build --release -p capmoe-bench
# cuBLAS (for the baselines) is loaded at run time; make a toolkit install findable.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d "$dir" ]] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
# libnccl for the EP rows (skipped, saying so, without it).
source scripts/nccl-env.sh
export CAPMOE_COMMIT="${CAPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
exec target/release/capmoe-bench "$@"
