// Where the fused fc1's cp.async producer puts a 16-byte chunk of a gathered x row in shared
// memory (csrc/fused/fc1_sm90.cu, CP_ASYNC form). Host and device, so the host check
// tests/layout/fc1_smem_layout.cu can compare it with cute's own addressing of the layout the
// wgmma descriptors are built from.
#pragma once

#include <cstdint>

namespace capmoe::fused {

// Byte offset, inside one pipeline stage of the K-major A tile (128 rows x 64 K values, one
// 128-byte line per row), of the 16-byte chunk holding K values [8c, 8c + 8) of tile row r:
// the 128B swizzle XORs the chunk index with the row's index inside its 8-row, 1024-byte atom.
// The stage base is 1024-byte aligned, so this is also where a 128B-swizzled TMA box of the
// same rows would put the chunk.
__host__ __device__ constexpr uint32_t fc1_smem_offset(int r, int c) {
  return uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
}

}  // namespace capmoe::fused
