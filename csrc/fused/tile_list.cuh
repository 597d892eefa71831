// The persistent fused kernels' tile list, built on the device from the routing build's
// offsets (shared by fc1_sm90.cu and swiglu_dgrad_sm90.cu).
//
// Every CTA computes, per expert, m_tiles(e) = ceil(rows(e) / kTileM) and its prefix in shared
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
// kTileM), first output column.
struct Tile {
  int expert, row0, rows, n0;
};

__device__ __forceinline__ int64_t clamp_row(int64_t r, int capacity) {
  return r < 0 ? 0 : (r > capacity ? capacity : r);
}

// One warp writes tile_prefix[0..E] (M tiles of the experts before e) and row_start[0..E]
// (first row of expert e, clamped); the caller syncs before reading them.
template <int kTileM>
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
    local += (rows + kTileM - 1) / kTileM;
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
    running += rows > 0 ? (rows + kTileM - 1) / kTileM : 0;
  }
  if (lane == 31) {
    tile_prefix[experts] = inclusive;
    row_start[experts] = int(clamp_row(offsets[experts], capacity));
  }
}

template <int kTileM, int kTileN>
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
  const int row0 = row_start[e] + m_tile * kTileM;
  return Tile{e, row0, min(kTileM, row_end - row0), slice * kTileN};
}

// Host side: the most tiles a launch can have over `columns` output columns (every expert adds
// at most one partial M tile to the full ones; a partial last column slice counts whole), which
// bounds the persistent grid.
inline int64_t max_tiles(int64_t experts, int64_t capacity, int64_t columns, int tile_m, int tile_n) {
  return ((capacity + tile_m - 1) / tile_m + experts) * ((columns + tile_n - 1) / tile_n);
}

}  // namespace capmoe::fused
