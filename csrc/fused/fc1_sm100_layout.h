// The sm_100a fused fc1's MMA and shared-memory layouts (csrc/fused/fc1_sm100.cu): one
// 128x256x16 UMMA (tcgen05.mma, cta_group::1, kind::f16) per k16 step, A and B K-major in
// 128B-swizzled stages, fp32 accumulators in TMEM. Its own header so that the host check
// tests/layout/fc1_sm100_layout.cu can walk the same layouts: what the producers write
// (fc1_smem_offset, row * 128 B W1 boxes), what the UMMA descriptors read, and where the
// accumulator of tile element (m, n) lies in TMEM (lane m, column n), which the epilogue's
// hand-computed tcgen05.ld addresses assume.
#pragma once

#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>

#include "capturable_moe/fused.h"

namespace capmoe::fused {

constexpr int kFc1Sm100TileM = 128;
constexpr int kFc1Sm100TileN = CAPMOE_FUSED_FC1_TILE_N;  // act columns per tile; B holds 2x
constexpr int kFc1Sm100TileK = 64;                       // 64 16-bit elements = one 128-byte row
constexpr int kFc1Sm100Stages = 4;

template <class T>
struct Fc1Sm100Layout {
  static constexpr int kTileM = kFc1Sm100TileM, kTileN = kFc1Sm100TileN, kTileK = kFc1Sm100TileK;
  static constexpr int kStages = kFc1Sm100Stages;
  using Mma = cute::SM100_MMA_F16BF16_SS<T, T, float, kTileM, 2 * kTileN, cute::UMMA::Major::K, cute::UMMA::Major::K>;
  using TiledMma = decltype(cute::make_tiled_mma(Mma{}));
  using MmaShapeA =
      decltype(cute::partition_shape_A(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>>{}));
  using MmaShapeB =
      decltype(cute::partition_shape_B(TiledMma{}, cute::Shape<cute::Int<2 * kTileN>, cute::Int<kTileK>>{}));
  // ((128,16),1,4,stage) and ((256,16),1,4,stage): the UMMA's (M|N, K16) block, one block along
  // M|N, 4 k16 steps per K block, stages.
  using SmemA = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<T>{},
                                                        cute::append(MmaShapeA{}, cute::Int<kStages>{})));
  using SmemB = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<T>{},
                                                        cute::append(MmaShapeB{}, cute::Int<kStages>{})));
  // ((128,256),1,1): one accumulator, gate in columns [0, 128), up in [128, 256).
  using AccShape =
      decltype(cute::partition_shape_C(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<2 * kTileN>>{}));
};

}  // namespace capmoe::fused
