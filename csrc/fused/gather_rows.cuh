// The per-row cp.async gather of the fused kernels' K-major A stages (fc1_sm90.cu's CP_ASYNC
// form, swiglu_dgrad_sm90.cu's gathered form): a producer thread copies one source row's K
// block into its tile row of a 128B-swizzled stage, 16 bytes at a time, at fc1_smem_offset
// (the stage layout is GMMA's K-major 128B-swizzle atom tiled 128 rows x 64 K values in both
// kernels, so the offset is the same). The copies are asynchronous: the caller arrives on the
// stage's barrier with cpasync_barrier_arrive_noinc, and consumers fence the generic proxy
// before wgmma reads the stage.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/numeric/int.hpp>

#include "fused/fc1_layout.h"

namespace capmoe::fused {

// K values [k0, k0 + kTileK) of `src_row` into tile row r of the stage at `stage_a`. Chunks at
// or past `hidden` are zero-filled (H is a multiple of 8, so a chunk is all in or all out), and
// so is every chunk when !load (nothing is read then; `src_row` need only be a valid address).
// `hidden` by reference: the kernel parameter is read where the loop needs it, as fc1's inline
// loop did (fc1's PTX is byte-identical to before this helper).
template <class T, int kTileK>
__device__ __forceinline__ void gather_row_chunks(const T* src_row, bool load, int k0, const int& hidden,
                                                  uint8_t* stage_a, int r) {
  using Copy16 = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  constexpr int kChunks = kTileK * sizeof(T) / 16;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = k0 + c * 8;
    const bool inside = load && col < hidden;
    const auto* src = reinterpret_cast<const cute::uint128_t*>(src_row + (inside ? col : 0));
    Copy16::copy(*src, *reinterpret_cast<cute::uint128_t*>(stage_a + fc1_smem_offset(r, c)), inside);
  }
}

}  // namespace capmoe::fused
