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

// The coalesced cp.async gather's assignment (fused/gather_rows.cuh, GatherRows): producer
// thread `thread` (0..127) copies 16-byte chunk gather_chunk(thread) of tile rows
// gather_row(thread, i), i < tile rows / 16. The 8 lanes with the same thread / 8 take the 8
// chunks of one row, so each warp-wide copy reads four whole 128-byte rows.
__host__ __device__ constexpr int gather_chunk(int thread) { return thread % 8; }
__host__ __device__ constexpr int gather_row(int thread, int i) { return (thread / 32) * 4 + (thread % 32) / 8 + 16 * i; }

// Whether GatherRows can address every 16-byte chunk of a [max_tokens, hidden] source of 16-bit
// elements in 32 bits (64 GB of source).
__host__ __device__ constexpr bool gather_source_fits(int64_t max_tokens, int64_t hidden) {
  return max_tokens >= 0 && hidden >= 0 && max_tokens * (hidden / 8) <= int64_t(UINT32_MAX);
}

}  // namespace capmoe::fused
