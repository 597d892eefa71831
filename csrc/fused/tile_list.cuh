// The persistent kernels' tile list, built on the device from the routing build's offsets
// (shared by the fused kernels and grouped_gemm/sm90_counter.cu, which alone takes tails).
//
// Every CTA computes, per expert, m_tiles(e) (m_tiles_of, below) and its prefix in shared
// memory; linear tile i belongs to the expert whose [prefix(e) * S, prefix(e + 1) * S) holds it
// (S = column slices of kTileN), and within an expert the M tiles of one slice are consecutive,
// so the CTAs running together read the same weight slice (once from HBM, then from L2) — if
// they take neighbouring tiles at about the same time: fc1 hands the tiles out from a device
// counter (tile_schedule.cuh), the fc2 dgrad strides over them statically.
// An expert's rows are [offsets[e], offsets[e + 1]), each end clamped into [0, capacity].
// Runs under the CPU emulation too (tests/fused_tiles_emulated.rs): no inline PTX here.
#pragma once

#include <cstdint>

namespace capmoe::fused {

// Where a linear tile index lands: expert, first row, rows of the expert in the tile (at most
// kTileM + kTailRows), first output column.
struct Tile {
  int expert, row0, rows, n0;
};

// M tiles of an expert with `rows` rows: ceil(rows / kTileM), or with kTailRows > 0 one fewer
// where that many tiles hold the rows at up to kTileM + kTailRows each, for experts of at most
// kMostTilesAbsorbed tiles. SM90_COUNTER computes up to kTailRows (16) rows past a tile's 128
// beside them, against the weight tile it holds anyway, instead of a tile of its own streaming
// that weight tile again for a few rows; those rows cost a tile 1/8 more MMA work whatever their
// count (one 16-wide wgmma), so taking one tile away from q pays while (q - 1) 9/8 < q.
constexpr int kMostTilesAbsorbed = 8;

template <int kTileM, int kTailRows>
__host__ __device__ __forceinline__ int m_tiles_of(int rows) {
  static_assert(kTailRows >= 0 && kTailRows < kTileM, "a tail is shorter than a tile");
  if (rows <= 0) return 0;
  const int tiles = (rows + kTileM - 1) / kTileM;
  if constexpr (kTailRows == 0) return tiles;
  const bool absorbed = tiles > 1 && tiles <= kMostTilesAbsorbed && rows <= (tiles - 1) * (kTileM + kTailRows);
  return absorbed ? tiles - 1 : tiles;
}

__device__ __forceinline__ int64_t clamp_row(int64_t r, int capacity) {
  return r < 0 ? 0 : (r > capacity ? capacity : r);
}

// One warp writes tile_prefix[0..E] (M tiles of the experts before e) and row_start[0..E]
// (first row of expert e, clamped); the caller syncs before reading them.
template <int kTileM, int kTailRows = 0>
__device__ void build_tile_prefix(const int64_t* offsets, int experts, int capacity, int32_t* tile_prefix,
                                  int32_t* row_start) {
  const int lane = threadIdx.x & 31;
  const int per_lane = (experts + 31) / 32;
  const int first = lane * per_lane, last = min(experts, first + per_lane);
  int local = 0;
  for (int e = first; e < last; ++e) {
    const int64_t start = clamp_row(offsets[e], capacity);
    const int64_t end = clamp_row(offsets[e + 1], capacity);
    const int rows = end > start ? int(end - start) : 0;
    row_start[e] = int(start);
    local += m_tiles_of<kTileM, kTailRows>(rows);
  }
  int inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  int running = inclusive - local;
  for (int e = first; e < last; ++e) {
    tile_prefix[e] = running;
    const int rows = int(clamp_row(offsets[e + 1], capacity)) - row_start[e];
    running += m_tiles_of<kTileM, kTailRows>(rows);
  }
  if (lane == 31) {
    tile_prefix[experts] = inclusive;
    row_start[experts] = int(clamp_row(offsets[experts], capacity));
  }
}

template <int kTileM, int kTileN, int kTailRows = 0>
__device__ __forceinline__ Tile locate(int tile, int slices, const int32_t* tile_prefix, const int32_t* row_start,
                                       int experts) {
  // Largest e with tile_prefix[e] * slices <= tile; it owns at least one tile.
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_prefix[mid] * slices <= tile) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo;
  const int m_tiles = tile_prefix[e + 1] - tile_prefix[e];
  const int local = tile - tile_prefix[e] * slices;
  const int slice = local / m_tiles, m_tile = local - slice * m_tiles;
  const int row_end = max(row_start[e + 1], row_start[e]);
  const int rows = row_end - row_start[e];
  if (kTailRows == 0 || m_tiles * kTileM >= rows) {
    // Whole tiles, the last one holding the rest.
    const int row0 = row_start[e] + m_tile * kTileM;
    return Tile{e, row0, min(kTileM, row_end - row0), slice * kTileN};
  }
  // Tiles with tails: the rows spread evenly over them (the first rows % m_tiles one row more),
  // so the tiles that share a weight slice take the same time and stream it together (one tile
  // running behind the other reads the slice from HBM again once L2 has let it go). Only
  // here: spreading whole tiles would turn a cheap last tile of <= 64 rows (one warpgroup's
  // MMAs) into more tiles running both warpgroups' (bench/README, "Tails").
  const int base = rows / m_tiles, longer = rows % m_tiles;
  const int row0 = row_start[e] + m_tile * base + min(m_tile, longer);
  return Tile{e, row0, base + (m_tile < longer ? 1 : 0), slice * kTileN};
}

// Host side: the most tiles a launch can have over `columns` output columns (every expert adds
// at most one partial M tile to the full ones; a partial last column slice counts whole), which
// bounds the persistent grid.
inline int64_t max_tiles(int64_t experts, int64_t capacity, int64_t columns, int tile_m, int tile_n) {
  return ((capacity + tile_m - 1) / tile_m + experts) * ((columns + tile_n - 1) / tile_n);
}

}  // namespace capmoe::fused
