// The sm_100a fused fc2 dgrad's MMA and shared-memory layouts (csrc/fused/swiglu_dgrad_sm100.cu):
// one 128x128x16 UMMA (tcgen05.mma, cta_group::1, kind::f16) per k16 step; A (drows / dy rows)
// K-major, B = W2_e [H, F] MN-major (F contiguous), both in 128B-swizzled stages; fp32
// accumulators in TMEM. Its own header so that the host check
// tests/layout/dgrad_sm100_layout.cu can walk the same layouts: what the producers write (A:
// fc1_smem_offset, as TMA's 64 x 128 drows box or the cp.async gather puts it; B: two 64-column
// x 64-row W2 boxes per stage), what the UMMA descriptors read, and where the accumulator of
// tile element (m, n) lies in TMEM (lane m, column n).
#pragma once

#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>

#include "capturable_moe/fused.h"

namespace capmoe::fused {

constexpr int kDgradSm100TileM = 128;
constexpr int kDgradSm100TileN = CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N;  // columns of F per tile
constexpr int kDgradSm100TileK = 64;                                // 64 16-bit elements = 128 bytes
constexpr int kDgradSm100BoxN = 64;  // W2 columns per TMA box (128 bytes, the swizzle's width)
constexpr int kDgradSm100Stages = 6;

template <class T>
struct SwigluDgradSm100Layout {
  static constexpr int kTileM = kDgradSm100TileM, kTileN = kDgradSm100TileN, kTileK = kDgradSm100TileK;
  static constexpr int kBoxN = kDgradSm100BoxN, kStages = kDgradSm100Stages;
  using Mma = cute::SM100_MMA_F16BF16_SS<T, T, float, kTileM, kTileN, cute::UMMA::Major::K, cute::UMMA::Major::MN>;
  using TiledMma = decltype(cute::make_tiled_mma(Mma{}));
  using MmaShapeA =
      decltype(cute::partition_shape_A(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>>{}));
  using MmaShapeB =
      decltype(cute::partition_shape_B(TiledMma{}, cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>>{}));
  // ((128,16),1,4,stage) each: the UMMA's (M|N, K16) block, one block along M|N, 4 k16 steps
  // per K block, stages.
  using SmemA = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<T>{},
                                                        cute::append(MmaShapeA{}, cute::Int<kStages>{})));
  // The MN-major atom is 64 columns x 8 K rows; tiled along K first (Step<_2, _1, _3>, as
  // CUTLASS's sm100 collective does for an MN-major operand), so a 64-column chunk's 64 K rows
  // are one contiguous 8 KB block: exactly what one W2 TMA box writes.
  using SmemB = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_MN_SW128_Atom<T>{},
                                                        cute::append(MmaShapeB{}, cute::Int<kStages>{}),
                                                        cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // ((128,128),1,1): one accumulator.
  using AccShape =
      decltype(cute::partition_shape_C(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>>{}));
};

}  // namespace capmoe::fused
