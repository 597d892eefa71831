#!/usr/bin/env bash
# Builds examples/c/grouped_gemm.c into target/release/capmoe-c-example, linked statically
# against what the crate's build script produces: libcapmoe_kernels.a (every C ABI entry point
# and kernel) and the toolkit's cudart_static, plus the C++ runtime. The program then needs only
# the driver (libcuda.so.1) at run time, so it can be built here and run on a GPU machine.
#   bash examples/c/build.sh [--run [ARGS]]     e.g. --run --no-gpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${CARGO_TARGET_DIR:-$root/target}/release/capmoe-c-example"

# The library's build script reports where it left the archive and which toolkit it linked:
# read both from cargo's JSON messages instead of guessing the OUT_DIR hash.
read -r archive_dir toolkit_lib < <(
  cargo build --release -p capturable-moe --message-format=json-render-diagnostics |
    python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    pid = msg.get("package_id", "")
    if msg.get("reason") == "build-script-executed" and ("#capturable-moe@" in pid or pid.startswith("capturable-moe ")):
        native = [p.split("=", 1)[1] for p in msg["linked_paths"] if p.startswith("native=")]
        toolkit = next(p for p in native if p != msg["out_dir"])
        print(msg["out_dir"], toolkit)
')
[[ -f "$archive_dir/libcapmoe_kernels.a" ]] || { echo "build.sh: no libcapmoe_kernels.a in '$archive_dir'" >&2; exit 1; }
include="$(dirname "$toolkit_lib")/include"   # the same toolkit's cuda_runtime_api.h

${CC:-cc} -std=c99 -O2 -Wall -Wextra -Werror -pedantic \
  -I"$root/csrc/include" -isystem "$include" \
  examples/c/grouped_gemm.c \
  "$archive_dir/libcapmoe_kernels.a" -L"$toolkit_lib" -lcudart_static \
  -lstdc++ -lm -ldl -lpthread -lrt \
  -o "$out"
echo "built $out"
if [[ "${1:-}" == "--run" ]]; then
  shift
  exec "$out" "$@"
fi
