// Where a persistent fused kernel's producer gets its tiles, and how its consumers learn them.
// The producers (gather_rows.cuh's produce_gathered_a, tma_loads.cuh's produce_drows) are
// written once over a tile source:
//  - StridedTiles: CTA b runs tiles b, b + grid, ...; the consumers walk the same sequence on
//    their own, nothing is published. The sm_100a kernels use it (their producer tails count
//    the fills of that sequence).
//  - CountedTiles: tiles handed out by a device counter as CTAs free up (tile_schedule.cuh says
//    why); the producer writes each tile's index into the stage of its first K block and, after
//    the last tile, arms one more stage holding kNoMoreTiles, which stops the consumers
//    (next_published_tile). The sm_90a fc1 and fc2 dgrad use it.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "fused/pipeline.cuh"
#include "fused/tile_schedule.cuh"

namespace capmoe::fused {

struct StridedTiles {
  int next_tile;
  __device__ __forceinline__ StridedTiles() : next_tile(blockIdx.x) {}

  // The next tile of the sequence, the same on every producer thread (nothing to hand over).
  __device__ __forceinline__ void claim(int& claimed) {
    claimed = next_tile;
    next_tile += gridDim.x;
  }
  __device__ __forceinline__ int hand_over(int claimed) const { return claimed; }
  __device__ __forceinline__ void publish(int, int32_t) const {}
  // No stop stage: returns false.
  template <int kStages>
  __device__ __forceinline__ bool stop(uint64_t*, uint64_t*, const StageRing<kStages>&, bool, const char*) const {
    return false;
  }
};

// kFetchers: the producer threads that call claim() / hand_over() together, 1 (a single-thread
// producer) or 128 (the producer warpgroup, threads 0-127, which syncs on named barrier 1;
// thread 0 fetches and hands the tile over through `handoff`).
template <int kFetchers>
struct CountedTiles {
  static_assert(kFetchers == 1 || kFetchers == 128, "one thread or the producer warpgroup");
  TileSchedule schedule;
  int32_t* stage_tile;  // shared, [kStages]
  int32_t* handoff;     // shared word; unused with one fetcher

  // A tile is taken in two steps, so that a producer can fetch its next tile while it still
  // loads the current one and the counter's round trip (an L2 atomic, ~1-2 us at the traffic of these
  // kernels) is off its critical path: claim() sends the fetch (thread 0 of the warpgroup
  // holds the answer), hand_over() gives it to every fetcher when it is needed.
  __device__ __forceinline__ void claim(int& claimed) const {
    if (kFetchers == 1 || threadIdx.x == 0) claimed = schedule.take();
  }
  __device__ __forceinline__ int hand_over(int claimed) const {
    if constexpr (kFetchers == 1) {
      return claimed;
    } else {
      if (threadIdx.x == 0) *handoff = claimed;
      asm volatile("bar.sync 1, 128;" ::: "memory");
      const int tile = *reinterpret_cast<volatile int32_t*>(handoff);
      asm volatile("bar.sync 1, 128;" ::: "memory");  // read by all before thread 0 hands over the next one
      return tile;
    }
  }

  // By the thread that arms the stage, before its arrival on the full barrier.
  __device__ __forceinline__ void publish(int stage, int32_t tile) const { publish_stage_tile(stage_tile, stage, tile); }

  // After the last tile, by every producer thread: waits for the next stage to be free; `arms`
  // (one thread) publishes kNoMoreTiles there, arrives once on its full barrier and finishes the
  // CTA's part of the schedule. A producer whose full barriers take more arrivals (the
  // gathered ones) adds the rest. Returns true: the stop stage is ring.stage.
  template <int kStages>
  __device__ __forceinline__ bool stop(uint64_t* full, uint64_t* empty, const StageRing<kStages>& ring, bool arms,
                                       const char* role) const {
    wait_barrier(&empty[ring.stage], ring.phase ^ 1, role);
    if (arms) {
      publish_stage_tile(stage_tile, ring.stage, kNoMoreTiles);
      cutlass::arch::ClusterBarrier::arrive(&full[ring.stage]);
      schedule.finish();
    }
    return true;
  }
};

// A producer's walk over its tiles (either source) with each next tile claimed kClaimLead K
// blocks before the current one's last is loaded, so the schedule's atomic is in flight while
// stages are still being filled (2026-11-29, H200: with the per-tile source chunks of
// gather_rows.cuh, the fused fc1 461 -> 410 us). next() is the tile to load (>= the tile count
// after the last); at_block(kb) before each K block kb of it.
template <class Tiles>
struct ClaimAhead {
  static constexpr int kClaimLead = 4;
  Tiles tiles;
  int claim_kb;
  int claimed = 0;
  __device__ __forceinline__ ClaimAhead(Tiles source, int k_blocks)
      : tiles(source), claim_kb(k_blocks > kClaimLead ? k_blocks - kClaimLead : 0) {
    tiles.claim(claimed);
  }
  __device__ __forceinline__ int next() { return tiles.hand_over(claimed); }
  __device__ __forceinline__ void at_block(int kb) {
    if (kb == claim_kb) tiles.claim(claimed);
  }
};

// The consumers' side of CountedTiles: waits for the ring's next stage and returns the tile
// whose first K block it holds, or kNoMoreTiles. (The tile's mainloop waits for the same
// phase again, which has completed.) Called by whole consumer warps. Lane 0 alone reads the
// word and shuffles it to the others: lane 0 is the lane that later arrives on the stage's
// empty barrier (the producer rewrites the word only after that barrier completes), so the
// read is ordered before the rewrite by program order and the barrier alone, not also by a
// __syncwarp between 31 lanes' reads and lane 0's arrival, an ordering compute-sanitizer's
// racecheck did not follow (2026-11-28: "potential WAR" reports on this word, lane 31's
// read against the producer's next publish, in the fc2 dgrad).
template <int kStages>
__device__ __forceinline__ int32_t next_published_tile(const StageRing<kStages>& ring, uint64_t* full,
                                                       const int32_t* stage_tile) {
  wait_barrier(&full[ring.stage], ring.phase, "consumer, next tile");
  int32_t tile = 0;
  if ((threadIdx.x & 31) == 0) tile = read_stage_tile(stage_tile, ring.stage);
  return __shfl_sync(0xffffffffu, tile, 0);
}

}  // namespace capmoe::fused
