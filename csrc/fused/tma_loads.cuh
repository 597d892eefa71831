// The fused kernels' TMA loads, shared by their sm_90a and sm_100a variants (each variant's
// stage layouts are checked against what these boxes write: static_asserts in the kernels,
// tests/layout/*.cu on the host): the W1 tile of fc1, the W2 tile of the fc2 dgrad, and the
// dgrad's drows-form producer loop.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "fused/fc1_launch.h"
#include "fused/pipeline.cuh"
#include "fused/swiglu_dgrad_launch.h"
#include "fused/tile_list.cuh"
#include "fused/tile_source.cuh"

namespace capmoe::fused {

constexpr uint64_t kTmaEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// fc1's B tile of a stage (b_stage: its first element): W1_e's gate rows [n0, n0 + kTileN)
// over its up rows [F + n0, F + n0 + kTileN), K columns [k0, k0 + kTileK).
template <int kTileN, int kTileK, class T>
__device__ __forceinline__ void load_w1_tile(const Fc1Params& p, uint64_t* full, T* b_stage, const Tile& t, int k0) {
  cute::SM90_TMA_LOAD_3D::copy(&p.w1_map, full, kTmaEvictNormal, b_stage, k0, t.n0, t.expert);
  cute::SM90_TMA_LOAD_3D::copy(&p.w1_map, full, kTmaEvictNormal, b_stage + kTileN * kTileK, k0, p.ffn + t.n0,
                               t.expert);
}

// The dgrad's B tile of a stage: W2_e rows [k0, k0 + kTileK) (K), columns [n0, n0 + kTileN)
// (N, contiguous: MN-major), as kBoxN-column boxes one after another.
template <int kTileN, int kBoxN, int kTileK, class T>
__device__ __forceinline__ void load_w2_tile(const SwigluDgradParams& p, uint64_t* full, T* b_stage, const Tile& t,
                                             int k0) {
#pragma unroll
  for (int c = 0; c < kTileN / kBoxN; ++c)
    cute::SM90_TMA_LOAD_3D::copy(&p.w2_map, full, kTmaEvictNormal, b_stage + c * kBoxN * kTileK, t.n0 + c * kBoxN,
                                 k0, t.expert);
}

// The dgrad's drows-form producer, one thread, over the tiles of `tiles` (tile_source.cuh): per
// tile and K block, wait for a free stage, publish the tile in its first stage, arm the stage's
// full barrier with the whole stage's bytes (TMA counts every byte of a box, zero-filled ones
// included, so the stage is always full), then the drows box at (k0, row0) and the W2 boxes.
// locate(tile) maps a linear tile index to its Tile; the next tile is claimed a few K blocks
// early (tile_source.cuh's ClaimAhead).
template <int kTileM, int kTileN, int kBoxN, int kTileK, int kStages, class T, class Tiles, class Locate>
__device__ __forceinline__ void produce_drows(const SwigluDgradParams& p, uint64_t* full, uint64_t* empty, T* a_stages,
                                              T* b_stages, int total_tiles, Tiles tiles, Locate locate,
                                              const char* role) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr uint32_t kStageBytes = (kTileM + kTileN) * kTileK * sizeof(T);
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  StageRing<kStages> ring;
  ClaimAhead<Tiles> walk(tiles, k_blocks);
  for (;;) {
    const int tile = walk.next();
    if (tile >= total_tiles) break;
    const Tile t = locate(tile);
    for (int kb = 0; kb < k_blocks; ++kb) {
      walk.at_block(kb);
      wait_barrier(&empty[ring.stage], ring.phase ^ 1, role);
      const int stage = ring.stage;
      if (kb == 0) walk.tiles.publish(stage, tile);
      Barrier::arrive_and_expect_tx(&full[stage], kStageBytes);
      const int k0 = kb * kTileK;
      cute::SM90_TMA_LOAD_2D::copy(&p.drows_map, &full[stage], kTmaEvictNormal, a_stages + stage * kTileM * kTileK, k0,
                                   t.row0);
      load_w2_tile<kTileN, kBoxN, kTileK>(p, &full[stage], b_stages + stage * kTileN * kTileK, t, k0);
      ring.advance();
    }
  }
  walk.tiles.stop(full, empty, ring, true, role);
}

}  // namespace capmoe::fused
