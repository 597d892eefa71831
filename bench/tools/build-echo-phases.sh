#!/usr/bin/env bash
# Builds bench/tools/echo_phases.cu (the Echo planner's phase profile, a diagnostic) for sm_90a
# with the pinned nvcc into ${DEST:-gpu-bundle/extra}/echo_phases; run it on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-gpu-bundle/extra}
mkdir -p "$DEST"
NVCC=${NVCC:-.toolchain/nvidia/cu13/bin/nvcc}
"$NVCC" -O3 -lineinfo -std=c++17 --expt-relaxed-constexpr -DNDEBUG -Icsrc/include -Icsrc \
  -gencode arch=compute_90a,code=sm_90a bench/tools/echo_phases.cu csrc/common/status.cu \
  -L"$(dirname "$NVCC")/../lib" -o "$DEST/echo_phases"
echo "built $DEST/echo_phases"
