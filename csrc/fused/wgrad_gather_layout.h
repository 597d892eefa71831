// Where the gathered wgrad's producer puts a 16-byte chunk of an MN-major operand in shared
// memory (csrc/fused/wgrad_gather_sm90.cu). Host and device, so the host test
// tests/layout/wgrad_smem_layout.cu can check it against cute's own addressing of the layout
// the wgmma descriptors are built from.
#pragma once

#include <cstdint>

namespace capmoe::fused {

// Byte offset, inside one pipeline stage of an operand tile (a multiple of 64 values along M or
// N by 64 K rows), of the 16-byte chunk holding values [8c, 8c + 8) of K row k. The tile is
// made of 1024-byte atoms of 8 K rows x 64 values (one 128-byte line per K row), K atoms first
// (8 per 64 rows), then the next 64 values; the 128B swizzle XORs the chunk index with the line
// index inside the atom. The stage base is 1024-byte aligned, so this equals the hardware's
// address-based swizzle (the same bits a 128B-swizzled TMA box would land on).
__host__ __device__ constexpr uint32_t wgrad_smem_offset(int k, int c) {
  const int line = k & 7;
  const int atom = (k >> 3) + 8 * (c >> 3);
  return uint32_t(atom * 1024 + line * 128 + (((c & 7) ^ line) << 4));
}

}  // namespace capmoe::fused
