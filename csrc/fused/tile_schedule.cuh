// The dynamic tile order of the persistent sm_90a fused fc1 and fc2 dgrad (through
// tile_source.cuh's CountedTiles): each CTA's producer takes
// its next linear tile (tile_list.cuh's numbering) from a device counter shortly before it
// starts on it (the gathered producers claim it a few K blocks ahead, tile_source.cuh),
// and tells its consumers which tile a stage begins through shared memory.
//
// Why not the static stride (CTA b runs tiles b, b + grid, ...): the M tiles that share one
// weight slice are neighbours in the tile list, so they start together on the first lap, but
// tiles take unequal times (partial tiles, gathered rows) and the CTAs drift apart; then each
// reads the slice from HBM on its own, because L2 keeps a line only a few µs at this traffic.
// Handed out in order as CTAs free up, neighbouring tiles start within a tile-fetch of each
// other on every lap. Measured on an H200 (2026-11-28, E128 T4096 k8 H2048 F768, ncu of one
// launch): fc1's HBM reads 1.50 -> 0.91 GB (it needs 0.82), 476 -> 451 us; the fc2 dgrad's
// 758 -> 638 MB (it needs 637), 294-309 -> 290 us.
#pragma once

#include <cstdint>

// Runs under the CPU emulation too (tests/fused_tiles_emulated.rs): no inline PTX here.

namespace capmoe::fused {

// words[0]: the next tile to hand out; words[1]: the CTAs done taking tiles. Both are zero when
// a launch starts (the plan zeroes them once) and zero again when it ends: the last CTA to
// finish taking tiles resets them (every CTA has taken its last tile by then). So launches
// ordered on one stream share the words; launches that may overlap need their own.
struct TileSchedule {
  // CAPMOE_FUSED_FC1_SCHEDULE_WORDS and CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS (the C ABI).
  static constexpr int kWords = 2;
  int32_t* words;

  // The next tile, for the one thread that fetches for its CTA.
  __device__ __forceinline__ int take() const { return atomicAdd(&words[0], 1); }

  // Called once per CTA, by the fetching thread, after the take that ran past the last tile.
  __device__ __forceinline__ void finish() const {
    __threadfence();
    if (atomicAdd(&words[1], 1) == int32_t(gridDim.x) - 1) {
      atomicExch(&words[0], 0);
      atomicExch(&words[1], 0);
    }
  }
};

// The tile a stage holds the first K block of, written by the producer before it arrives on the
// stage's full barrier (whose completion orders it before the consumers' read), or kNoMoreTiles
// in the stage after the last tile.
constexpr int32_t kNoMoreTiles = -1;

__device__ __forceinline__ void publish_stage_tile(int32_t* stage_tile, int stage, int32_t tile) {
  *reinterpret_cast<volatile int32_t*>(&stage_tile[stage]) = tile;
}

__device__ __forceinline__ int32_t read_stage_tile(const int32_t* stage_tile, int stage) {
  return *reinterpret_cast<const volatile int32_t*>(&stage_tile[stage]);
}

}  // namespace capmoe::fused
