// 16-byte epilogue stores from wgmma accumulators (the sm_90a fused kernels' epilogues).
//
// In a wgmma accumulator fragment the four lanes of a quad (lane / 4 equal) hold the same two
// rows, and lane q holds columns [8g + 2q, 8g + 2q + 2) of every 8-column group g: one 32-bit
// pair of 16-bit values per row and group. Stored as they are, a warp-wide store writes 8 rows
// x 16 bytes, half of each 32-byte sector it touches. QuadTranspose exchanges four groups' pairs
// inside the quad (two butterfly stages of warp shuffles) so that lane q holds all of group
// 4a + q: one 16-byte store per lane, and a warp-wide store writes 8 rows x 64 bytes, whole
// sectors. The loads of the dgrad's h pairs use the same exchange backwards (it is its own
// inverse).
#pragma once

#include <cstdint>

namespace capmoe::fused {

// words[j]: this lane's pair of group 4a + j (j < 4) in; out: the pairs 0..3 of group 4a + q,
// q = this lane's index in its quad, in column order. Every lane of the warp must call it
// (warp shuffles): lanes whose row is not stored still exchange.
__device__ __forceinline__ void quad_transpose(uint32_t (&words)[4]) {
  const unsigned lane = threadIdx.x & 31;
  // Stage 1 swaps bit 0 of (lane, index), stage 2 bit 1: element (lane q, index j) ends at
  // (lane j, index q).
#pragma unroll
  for (int stage = 0; stage < 2; ++stage) {
    const int bit = 1 << stage;
    const bool high = (lane & bit) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j & bit) continue;  // j: the pair (j, j + bit) with that bit clear
      const uint32_t send = high ? words[j] : words[j + bit];
      const uint32_t got = __shfl_xor_sync(0xffffffffu, send, bit);
      if (high) words[j] = got;
      else words[j + bit] = got;
    }
  }
}

// 16 bytes from four 32-bit words, in order.
__device__ __forceinline__ void store16(void* to, const uint32_t (&words)[4]) {
  *reinterpret_cast<uint4*>(to) = make_uint4(words[0], words[1], words[2], words[3]);
}

// 16 bytes into four 32-bit words, through the read-only data path (the kernel never writes
// what it reads here).
__device__ __forceinline__ void load16_readonly(const void* from, uint32_t (&words)[4]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(from));
  words[0] = v.x;
  words[1] = v.y;
  words[2] = v.z;
  words[3] = v.w;
}

}  // namespace capmoe::fused
