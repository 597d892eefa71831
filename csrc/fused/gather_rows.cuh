// The cp.async gather of the fused kernels' K-major A stages (fc1_sm90.cu's CP_ASYNC form,
// swiglu_dgrad_sm90.cu's gathered form, fc1_sm100.cu): the producer warpgroup copies the
// tile's source rows, 16 bytes at a time, into a 128B-swizzled stage at fc1_smem_offset (the
// stage layout is the K-major 128B-swizzle atom tiled 128 rows x 64 K values in every kernel,
// so the offset is the same). The copies are asynchronous: each thread arrives on the stage's
// barrier with cpasync_barrier_arrive_noinc, and the MMA side fences the generic proxy before
// the tensor cores read the stage.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/numeric/int.hpp>
#include <cutlass/arch/barrier.h>

#include "fused/fc1_layout.h"
#include "fused/pipeline.cuh"
#include "fused/tile_list.cuh"
#include "fused/tile_source.cuh"

namespace capmoe::fused {

// The coalesced form of the gather, which fc1's CP_ASYNC producer and the dgrad's gathered
// producer use: lane l of producer warp w copies 16-byte chunk l % 8 of tile rows
// w * 4 + l / 8 + 16 * i (i < kTileM / 16). A warp-wide copy then reads four whole 128-byte
// rows, every L2 sector it touches in full (one row per thread would read halves of 32 rows'
// sectors per copy and fetch each sector twice). The 128 threads cover the tile's 128 rows x 8
// chunks of a K block, and each thread still arrives once per stage.
template <int kTileM>
struct GatherRows {
  static constexpr int kThreads = 128;
  static constexpr int kRowStep = kThreads / 8;             // between one thread's rows
  static constexpr int kRowsPerThread = kTileM / kRowStep;  // 8 for a 128-row tile
  static_assert(kTileM % kRowStep == 0, "whole passes of 16 rows");
  static_assert(kRowsPerThread <= 32, "one bit a row");

  int first_row, chunk;
  // Per row of this thread, set once per tile so that a K block costs an add and a copy per
  // row (2026-11-29, H200: recomputing token * hidden + col and its predicates for every K
  // block made the producer issue ~130 dependent instructions a stage, ~750 of a stage's ~1000
  // cycles, and the consumers waited on it): the source's 16-byte chunk holding the row's K
  // block 0 chunk, token * hidden / 8 + chunk (16-byte units: 32 bits address 64 GB of source,
  // which gather_source_fits checks at plan time); 0 where the row is not read.
  uint32_t source_chunk[kRowsPerThread];
  uint32_t in_tile = 0;  // bit i: row(i) is a row of the tile (copied: data or zeros)
  uint32_t valid = 0;    // bit i: row(i)'s token is in [0, max_tokens) (its bytes are read)

  __device__ __forceinline__ explicit GatherRows(int producer_thread)
      : first_row(gather_row(producer_thread, 0)), chunk(gather_chunk(producer_thread)) {}

  __device__ __forceinline__ int row(int i) const { return first_row + kRowStep * i; }
  static_assert(gather_row(0, 1) == kRowStep, "fc1_layout.h's gather_row steps by kRowStep");

  // The tokens of a tile's rows: token_of_row[r] for r < rows, any value outside
  // [0, max_tokens) making a zero row. Rows past `rows` are not copied (their accumulators are
  // never stored).
  __device__ __forceinline__ void set_tile(const int32_t* token_of_row, int rows, int max_tokens, int hidden) {
    in_tile = 0;
    valid = 0;
    const uint32_t chunks_per_row = uint32_t(hidden) / 8;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = row(i);
      const int t = r < rows ? __ldg(token_of_row + r) : -1;
      const bool readable = t >= 0 && t < max_tokens;
      in_tile |= uint32_t(r < rows) << i;
      valid |= uint32_t(readable) << i;
      source_chunk[i] = readable ? uint32_t(t) * chunks_per_row + uint32_t(chunk) : 0u;
    }
  }

  // This thread's chunk of K block [k0, k0 + 64) of each of its rows into the stage at
  // `stage_a` (src: the [max_tokens, hidden] source). Chunks at or past `hidden` are zero-filled
  // (H is a multiple of 8: a chunk is all in or all out).
  template <class T>
  __device__ __forceinline__ void copy(const T* src, int hidden, int k0, uint8_t* stage_a) const {
    using Copy16 = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
    static_assert(8 * 16 == 64 * sizeof(T), "8 chunks of 16 bytes are one 64-element K block");
    const auto* source = reinterpret_cast<const cute::uint128_t*>(src);
    const uint32_t k_chunks = uint32_t(k0) / 8;
    const bool in_row = k0 + chunk * 8 < hidden;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (!((in_tile >> i) & 1u)) continue;
      const bool load = in_row && ((valid >> i) & 1u);
      // A zero-filled chunk reads nothing; its address is the source's first chunk.
      const cute::uint128_t* from = source + (load ? source_chunk[i] + k_chunks : 0u);
      Copy16::copy(*from, *reinterpret_cast<cute::uint128_t*>(stage_a + fc1_smem_offset(row(i), chunk)), load);
    }
  }
};

// The gathered producers' loop (fc1's, the dgrad's gathered form), run by the 128 threads of
// the producer warpgroup over the tiles of `tiles` (tile_source.cuh). Per tile and K block: wait
// for a free stage; thread 0 publishes the tile in its first stage, arms the stage's full
// barrier with the B tile's bytes (the only ones TMA counts) and issues B's TMAs,
// load_b(stage, tile, k0); every thread copies its chunks of the tile's gathered A rows
// (src [max_tokens, hidden] of T through token_of_row) and arrives when they land. The full
// barriers therefore take 1 + 128 arrivals (the stop stage too). locate(tile) maps a linear tile
// index to its Tile; the next tile is claimed a few K blocks early (tile_source.cuh's
// ClaimAhead). The scalars come by reference to the kernel's parameters, so they are read
// from parameter space where needed instead of held in the producer's few registers (it runs
// under setmaxnreg).
template <int kTileM, int kTileK, int kStages, class T, class Tiles, class Locate, class LoadB>
__device__ __forceinline__ void produce_gathered_a(const void* const& src, const int& hidden, const int& max_tokens,
                                                   const int32_t* const& token_of_row, uint64_t* full,
                                                   uint64_t* empty, T* a_stages, uint32_t bytes_b, int total_tiles,
                                                   Tiles tiles, Locate locate, LoadB load_b) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const int k_blocks = (hidden + kTileK - 1) / kTileK;
  GatherRows<kTileM> gather(threadIdx.x);
  StageRing<kStages> ring;
  ClaimAhead<Tiles> walk(tiles, k_blocks);
  for (;;) {
    const int tile = walk.next();
    if (tile >= total_tiles) break;
    const Tile t = locate(tile);
    gather.set_tile(token_of_row + t.row0, t.rows, max_tokens, hidden);
    for (int kb = 0; kb < k_blocks; ++kb) {
      walk.at_block(kb);
      wait_barrier(&empty[ring.stage], ring.phase ^ 1, "gathering producer, empty");
      const int stage = ring.stage;
      const int k0 = kb * kTileK;
      if (threadIdx.x == 0) {
        if (kb == 0) walk.tiles.publish(stage, tile);
        Barrier::arrive_and_expect_tx(&full[stage], bytes_b);
        load_b(stage, t, k0);
      }
      gather.copy(static_cast<const T*>(src), hidden, k0, reinterpret_cast<uint8_t*>(a_stages + stage * kTileM * kTileK));
      cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
      ring.advance();
    }
  }
  if (walk.tiles.stop(full, empty, ring, threadIdx.x == 0, "gathering producer, empty (end)")) {
    cutlass::arch::cpasync_barrier_arrive_noinc(&full[ring.stage]);  // the stop stage's other 128 arrivals
  }
  cute::cp_async_wait<0>();  // no thread exits with copies in flight
}

}  // namespace capmoe::fused
