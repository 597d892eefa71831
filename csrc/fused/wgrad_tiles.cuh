// What the gathered wgrad's two kernels (wgrad_gather_sm90.cu, wgrad_gather_sm100.cu) share:
// the tile list and the cp.async producer of the MN-major operand stages. Both kernels lay a
// stage out the same way (wgrad_smem_offset, fused/wgrad_gather_layout.h; checked against
// cute's GMMA layout by tests/layout/wgrad_smem_layout.cu and against UMMA's by
// tests/layout/wgrad_sm100_layout.cu), so one producer serves both.
//
// Tile list: every expert owns the same m_tiles * n_tiles output tiles (M and N are fixed), so
// tile t is expert t / (m_tiles * n_tiles), the m tiles of one n column consecutive; CTAs
// stride over the list. K runs over the expert's rows in blocks of 64.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/numeric/int.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include "fused/pipeline.cuh"
#include "fused/wgrad_gather_launch.h"
#include "fused/wgrad_gather_layout.h"

namespace capmoe::fused {

constexpr int kWgradTileM = CAPMOE_WGRAD_GATHER_TILE_M;
constexpr int kWgradTileN = CAPMOE_WGRAD_GATHER_TILE_N;
constexpr int kWgradTileK = 64;  // routing rows per K block: one 128-byte line per 64 m (n) values
constexpr int kWgradProducerThreads = 128;

// Calls launch(T{}, Out{}) with the element types of a launch: T the 16-bit input type, Out
// the dW type (T, or float for fp32 and fp32-accumulate output), as the entry checked them.
template <class Launch>
capmoe_status_t dispatch_wgrad_types(capmoe_dtype_t dtype, capmoe_dtype_t out_dtype, Launch&& launch) {
  const bool f32 = out_dtype == CAPMOE_DTYPE_F32;
  if (dtype == CAPMOE_DTYPE_BF16)
    return f32 ? launch(cutlass::bfloat16_t{}, float{}) : launch(cutlass::bfloat16_t{}, cutlass::bfloat16_t{});
  if (dtype == CAPMOE_DTYPE_F16)
    return f32 ? launch(cutlass::half_t{}, float{}) : launch(cutlass::half_t{}, cutlass::half_t{});
  return CAPMOE_ERR_UNSUPPORTED;
}

__device__ __forceinline__ int clamp_wgrad_row(int64_t r, int capacity) {
  return int(r < 0 ? 0 : (r > capacity ? capacity : r));
}

// One tile of the list: expert, its clamped rows [row_begin, row_end), output corner.
struct WgradTile {
  int expert, row_begin, row_end, m0, n0;
  __device__ int k_blocks() const { return (row_end - row_begin + kWgradTileK - 1) / kWgradTileK; }
};

__device__ __forceinline__ WgradTile locate(const WgradGatherParams& p, int tile) {
  const int per_expert = p.m_tiles * p.n_tiles;
  const int e = tile / per_expert;
  const int local = tile - e * per_expert;
  const int n_tile = local / p.m_tiles;
  const int m_tile = local - n_tile * p.m_tiles;
  const int begin = clamp_wgrad_row(__ldg(p.offsets + e), p.capacity);
  const int end = max(begin, clamp_wgrad_row(__ldg(p.offsets + e + 1), p.capacity));
  return WgradTile{e, begin, end, m_tile * kWgradTileM, n_tile * kWgradTileN};
}

// Accumulate mode leaves an expert without rows untouched: no loads, no MMA, no store.
__device__ __forceinline__ bool skipped(const WgradGatherParams& p, const WgradTile& t) {
  return p.accumulate && t.row_end == t.row_begin;
}

// Where a gathered operand's K block comes from: lanes 0-15 of each producer warp hold the
// sources of the 16 rows that warp copies (row_of_lane), loaded one block ahead
// (produce_wgrad_stages), and the copies take them by shuffle. A source is the row's first
// 16-byte chunk in the operand, token * ld / 8 (32 bits: wgrad_gather.cu checks that
// max_tokens * ld / 8 fits at plan time), or kNoRow. (Each copy used to load its own row's
// token and form a 64-bit address from it: a dependent L2 round trip every few rows and ~10
// instructions a copy, so the producer took longer to issue a stage than the tensor cores took
// to use one: 4x CUTLASS's time at DRAM 14 % on an H100, 2026-11-28.)
template <int kRowsMN>
struct BlockSources {
  static constexpr int kChunksPerRow = kRowsMN / 8;
  static constexpr int kRowsPerPass = kWgradProducerThreads / kChunksPerRow;
  static constexpr int kWarpRowsPerPass = 32 / kChunksPerRow;
  static constexpr uint32_t kNoRow = 0xffffffffu;  // past the expert's rows, or an invalid token
  static_assert(32 % kChunksPerRow == 0, "a warp copies whole rows");
  static_assert(kWarpRowsPerPass * (kWgradTileK / kRowsPerPass) == 16, "a warp copies 16 rows of a K block");

  // The K block row (0..63) whose source lane `lane` (< 16) of this thread's warp holds.
  __device__ __forceinline__ static int row_of_lane(int lane) {
    return (threadIdx.x / 32) * kWarpRowsPerPass + lane % kWarpRowsPerPass + kRowsPerPass * (lane / kWarpRowsPerPass);
  }
  // The lane holding the source of this thread's row in copy pass `pass` (copy_wgrad_block's k).
  __device__ __forceinline__ static int lane_of(int pass) {
    return (threadIdx.x % 32) / kChunksPerRow + kWarpRowsPerPass * pass;
  }
  // This lane's token for the K block at `row` (the expert's rows end at row_end): -1 past
  // row_end, on lanes 16-31 and for a plain operand. Nothing reads it here, so a caller that
  // resolves it later does not wait for the load in between.
  __device__ __forceinline__ static int32_t load_token(bool gathered, const int32_t* token_of_row, int row,
                                                       int row_end) {
    const int lane = threadIdx.x % 32;
    const int r = row + row_of_lane(lane % 16);
    return gathered && lane < 16 && r < row_end ? __ldg(token_of_row + r) : -1;
  }
  // A token's source: kNoRow for a token outside [0, src_rows).
  __device__ __forceinline__ static uint32_t source_of(int32_t token, int src_rows, int ld) {
    return token >= 0 && token < src_rows ? uint32_t(token) * uint32_t(ld / 8) : kNoRow;
  }
  __device__ __forceinline__ static uint32_t fetch(bool gathered, const int32_t* token_of_row, int src_rows, int ld,
                                                   int row, int row_end) {
    return source_of(load_token(gathered, token_of_row, row, row_end), src_rows, ld);
  }
};

// One operand's K block: kRowsMN values (a tile's m or n extent) of each of 64 rows, copied by
// the 128 producer threads (threadIdx.x < 128), consecutive threads on consecutive 16-byte
// chunks of a row, so a warp's copy instruction reads whole rows (two 256-byte A rows, one
// 512-byte B row). A gathered operand's rows come from `lane_source` (BlockSources<kRowsMN>::
// fetch of this block), a plain one's are rows [row, row_end) of src. Zero-filled: rows past
// row_end, rows whose token is invalid, columns past `cols`. Zero-filling BOTH operands matters:
// a row past offsets[E] may hold NaN, and 0 * NaN is NaN.
template <class T, int kRowsMN>
__device__ __forceinline__ void copy_wgrad_block(const T* src, int ld, int cols, bool gathered, uint32_t lane_source,
                                                 int row, int row_end, int mn0, uint8_t* stage) {
  using Copy16 = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  using Sources = BlockSources<kRowsMN>;
  constexpr int kChunksPerRow = Sources::kChunksPerRow;
  constexpr int kRowsPerPass = Sources::kRowsPerPass;
  const auto* chunks = reinterpret_cast<const cute::uint128_t*>(src);
  const int c = threadIdx.x % kChunksPerRow;
  const int col = mn0 + c * 8;
  const bool col_inside = col < cols;  // M and N are multiples of 8: a chunk is all in or all out
  const uint32_t col_chunk = uint32_t(col) / 8;
  const int first_k = threadIdx.x / kChunksPerRow;
  // A plain operand's rows, one pass apart: row + k of src, ld elements each.
  const cute::uint128_t* plain = chunks + (int64_t(row + first_k) * ld + col) / 8;
  const int64_t plain_step = int64_t(kRowsPerPass) * ld / 8;
  // NOTE: unrolled by 4, not fully: the sm_90a producer runs under setmaxnreg 40.
#pragma unroll 4
  for (int pass = 0; pass < kWgradTileK / kRowsPerPass; ++pass) {
    const int k = first_k + pass * kRowsPerPass;
    const cute::uint128_t* from;
    bool inside;
    if (gathered) {
      const uint32_t source = __shfl_sync(0xffffffffu, lane_source, Sources::lane_of(pass));
      inside = col_inside && source != Sources::kNoRow;
      from = chunks + (inside ? source + col_chunk : 0u);
    } else {
      inside = col_inside && row + k < row_end;
      from = inside ? plain + pass * plain_step : chunks;
    }
    // A zero-size copy reads nothing; its address only has to be formed.
    Copy16::copy(*from, *reinterpret_cast<cute::uint128_t*>(stage + wgrad_smem_offset(k, c)), inside);
  }
}

// A K block the producer loads: rows [row, row + 64) of tile `tile` (clipped at row_end), or
// tile == total_tiles after the CTA's last.
struct WgradBlock {
  int tile, row, row_end, m0, n0;
};

// The first block of this CTA's first tile at or after `tile` that has rows (tiles without
// rows load nothing: plain output writes their zeros, accumulate skips them).
__device__ __forceinline__ WgradBlock first_wgrad_block(const WgradGatherParams& p, int tile, int total_tiles) {
  for (; tile < total_tiles; tile += gridDim.x) {
    const WgradTile t = locate(p, tile);
    if (t.row_end > t.row_begin) return WgradBlock{tile, t.row_begin, t.row_end, t.m0, t.n0};
  }
  return WgradBlock{total_tiles, 0, 0, 0, 0};
}

__device__ __forceinline__ WgradBlock next_wgrad_block(const WgradGatherParams& p, const WgradBlock& b,
                                                       int total_tiles) {
  if (b.row + kWgradTileK < b.row_end) return WgradBlock{b.tile, b.row + kWgradTileK, b.row_end, b.m0, b.n0};
  return first_wgrad_block(p, b.tile + gridDim.x, total_tiles);
}

// The producer's loop, run by the 128 producer threads over this CTA's K blocks (tiles strided
// over the grid, each tile's blocks in order): wait for a free stage, copy both operands'
// blocks, arrive on the stage's full barrier when the copies land
// (cp.async.mbarrier.arrive.noinc: the full barriers take 128 arrivals), then find the next
// block and send for its row sources, which land while this thread waits for the next free stage.
// Returns the stage fills it made (the sm_100a producer's tail needs them; drain_stage_ring).
template <class T, int kStages>
__device__ __forceinline__ int64_t produce_wgrad_stages(const WgradGatherParams& p, uint8_t* a_stages,
                                                        uint8_t* b_stages, uint64_t* full, uint64_t* empty,
                                                        int total_tiles) {
  constexpr int kStageBytesA = kWgradTileM * kWgradTileK * 2;
  constexpr int kStageBytesB = kWgradTileN * kWgradTileK * 2;
  static_assert(sizeof(T) == 2, "16-bit operands: one 128-byte line holds 64 values");
  using SourcesA = BlockSources<kWgradTileM>;
  using SourcesB = BlockSources<kWgradTileN>;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int a_rows = p.a_gathered ? p.max_tokens : p.capacity;
  const int b_rows = p.b_gathered ? p.max_tokens : p.capacity;
  StageRing<kStages> ring;
  int64_t fills = 0;
  WgradBlock block = first_wgrad_block(p, blockIdx.x, total_tiles);
  uint32_t a_source = SourcesA::fetch(p.a_gathered, p.token_of_row, a_rows, p.m, block.row, block.row_end);
  uint32_t b_source = SourcesB::fetch(p.b_gathered, p.token_of_row, b_rows, p.n, block.row, block.row_end);
  while (block.tile < total_tiles) {
    wait_barrier(&empty[ring.stage], ring.phase ^ 1, "wgrad producer, empty");
    const int stage = ring.stage;
    copy_wgrad_block<T, kWgradTileM>(a, p.m, p.m, p.a_gathered, a_source, block.row, block.row_end, block.m0,
                                     a_stages + stage * kStageBytesA);
    copy_wgrad_block<T, kWgradTileN>(b, p.n, p.n, p.b_gathered, b_source, block.row, block.row_end, block.n0,
                                     b_stages + stage * kStageBytesB);
    cutlass::arch::cpasync_barrier_arrive_noinc(&full[stage]);
    ring.advance();
    ++fills;
    block = next_wgrad_block(p, block, total_tiles);
    a_source = SourcesA::fetch(p.a_gathered, p.token_of_row, a_rows, p.m, block.row, block.row_end);
    b_source = SourcesB::fetch(p.b_gathered, p.token_of_row, b_rows, p.n, block.row, block.row_end);
  }
  cute::cp_async_wait<0>();  // no thread exits with copies in flight
  return fills;
}

}  // namespace capmoe::fused
