// The sm_100a gathered wgrad's MMA and shared-memory layouts (csrc/fused/wgrad_gather_sm100.cu):
// one 128x256x16 UMMA (tcgen05.mma, cta_group::1, kind::f16) per k16 step, A (dW's m) and B
// (dW's n) both MN-major in 128B-swizzled stages, fp32 accumulators in TMEM. Its own header so
// that the host check tests/layout/wgrad_sm100_layout.cu can walk the same layouts: what the
// producer writes (wgrad_smem_offset, fused/wgrad_gather_layout.h, the sm_90a kernel's bytes),
// what the UMMA descriptors read, and where the accumulator of tile element (m, n) lies in
// TMEM (lane m, column n).
#pragma once

#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>

#include "capturable_moe/wgrad_gather.h"

namespace capmoe::fused {

constexpr int kWgradSm100TileM = CAPMOE_WGRAD_GATHER_TILE_M;
constexpr int kWgradSm100TileN = CAPMOE_WGRAD_GATHER_TILE_N;
constexpr int kWgradSm100TileK = 64;  // routing rows per K block
constexpr int kWgradSm100Stages = 4;  // 48 KB each: four fit in 227 KB, five do not

template <class T>
struct WgradSm100Layout {
  static constexpr int kTileM = kWgradSm100TileM, kTileN = kWgradSm100TileN, kTileK = kWgradSm100TileK;
  static constexpr int kStages = kWgradSm100Stages;
  using Mma = cute::SM100_MMA_F16BF16_SS<T, T, float, kTileM, kTileN, cute::UMMA::Major::MN, cute::UMMA::Major::MN>;
  using TiledMma = decltype(cute::make_tiled_mma(Mma{}));
  using MmaShapeA =
      decltype(cute::partition_shape_A(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>>{}));
  using MmaShapeB =
      decltype(cute::partition_shape_B(TiledMma{}, cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>>{}));
  // ((128,16),1,4,stage) and ((256,16),1,4,stage). The MN-major atom is 64 values x 8 K rows;
  // tiled along K first (Step<_2, _1, _3>, as CUTLASS's sm100 collectives do for an MN-major
  // operand), so a 64-value column chunk's 64 K rows are one contiguous 8 KB block: the
  // sm_90a kernel's stage layout (GMMA's MN-major atom is the same), which the shared producer
  // writes.
  using SmemA = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_MN_SW128_Atom<T>{},
                                                        cute::append(MmaShapeA{}, cute::Int<kStages>{}),
                                                        cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemB = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_MN_SW128_Atom<T>{},
                                                        cute::append(MmaShapeB{}, cute::Int<kStages>{}),
                                                        cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // ((128,256),1,1): one accumulator.
  using AccShape =
      decltype(cute::partition_shape_C(TiledMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>>{}));
};

}  // namespace capmoe::fused
