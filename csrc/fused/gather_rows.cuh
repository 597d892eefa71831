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
  static constexpr int kPastTile = -2;                      // token of a row past the tile's rows
  static_assert(kTileM % kRowStep == 0, "whole passes of 16 rows");

  int first_row, chunk;
  // Per row of this thread: a source row (>= 0), -1 (an invalid token: zero-filled), or
  // kPastTile (not copied; its accumulators are never stored).
  int token[kRowsPerThread];

  __device__ __forceinline__ explicit GatherRows(int producer_thread)
      : first_row(gather_row(producer_thread, 0)), chunk(gather_chunk(producer_thread)) {}

  __device__ __forceinline__ int row(int i) const { return first_row + kRowStep * i; }
  static_assert(gather_row(0, 1) == kRowStep, "fc1_layout.h's gather_row steps by kRowStep");

  // The tokens of a tile's rows: token_of_row[r] for r < rows, any value outside
  // [0, max_tokens) making a zero row.
  __device__ __forceinline__ void set_tile(const int32_t* token_of_row, int rows, int max_tokens) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = row(i);
      const int t = r < rows ? __ldg(token_of_row + r) : 0;
      token[i] = r >= rows ? kPastTile : (t >= 0 && t < max_tokens ? t : -1);
    }
  }

  // This thread's chunk of K block [k0, k0 + 64) of each of its rows into the stage at
  // `stage_a` (src: the [max_tokens, hidden] source). Chunks at or past `hidden` are zero-filled
  // (H is a multiple of 8: a chunk is all in or all out).
  template <class T>
  __device__ __forceinline__ void copy(const T* src, int hidden, int k0, uint8_t* stage_a) const {
    using Copy16 = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
    static_assert(8 * 16 == 64 * sizeof(T), "8 chunks of 16 bytes are one 64-element K block");
    const int col = k0 + chunk * 8;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (token[i] == kPastTile) continue;
      const bool load = token[i] >= 0 && col < hidden;
      const T* from = src + (load ? int64_t(token[i]) * hidden + col : 0);
      Copy16::copy(*reinterpret_cast<const cute::uint128_t*>(from),
                   *reinterpret_cast<cute::uint128_t*>(stage_a + fc1_smem_offset(row(i), chunk)), load);
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
// index to its Tile. The scalars come by reference to the kernel's parameters, so they are read
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
  for (;;) {
    const int tile = tiles.take();
    if (tile >= total_tiles) break;
    const Tile t = locate(tile);
    gather.set_tile(token_of_row + t.row0, t.rows, max_tokens);
    for (int kb = 0; kb < k_blocks; ++kb) {
      wait_barrier(&empty[ring.stage], ring.phase ^ 1, "gathering producer, empty");
      const int stage = ring.stage;
      const int k0 = kb * kTileK;
      if (threadIdx.x == 0) {
        if (kb == 0) tiles.publish(stage, tile);
        Barrier::arrive_and_expect_tx(&full[stage], bytes_b);
        load_b(stage, t, k0);
      }
      gather.copy(static_cast<const T*>(src), hidden, k0, reinterpret_cast<uint8_t*>(a_stages + stage * kTileM * kTileK));
      cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
      ring.advance();
    }
  }
  if (tiles.stop(full, empty, ring, threadIdx.x == 0, "gathering producer, empty (end)")) {
    cutlass::arch::cpasync_barrier_arrive_noinc(&full[ring.stage]);  // the stop stage's other 128 arrivals
  }
  cute::cp_async_wait<0>();  // no thread exits with copies in flight
}

}  // namespace capmoe::fused
