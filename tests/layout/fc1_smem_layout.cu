// Host-only check (run by tests/fused_host.rs, no GPU): the fused fc1's cp.async producer
// writes chunk c of tile row r at fc1_smem_offset(r, c); the consumers' wgmma descriptors are
// built by cute from tile_to_shape(GMMA::Layout_K_SW128_Atom<T>, (128, 64, stages)). Both must
// name the same bytes: this walks every (row, k, stage) of the A tile through cute's swizzled
// shared-memory tensor and compares; then checks that the coalesced gather's thread -> (row,
// chunk) assignment (fc1_layout.h) covers the tile exactly once, four whole rows per warp-wide
// copy. Exit 0 when all hold.
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

#include <cstdio>

#include "fused/fc1_layout.h"

using namespace cute;
using T = cutlass::bfloat16_t;

int main() {
  constexpr int kRows = 128, kK = 64, kStages = 4;
  using Layout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<kRows>, Int<kK>, Int<kStages>>{}));
  alignas(1024) static T buffer[kRows * kK * kStages];
  Tensor s = make_tensor(make_smem_ptr(buffer), Layout{});
  const long stage_bytes = long(kRows) * kK * sizeof(T);
  int bad = 0;
  for (int stage = 0; stage < kStages; ++stage)
    for (int r = 0; r < kRows; ++r)
      for (int k = 0; k < kK; ++k) {
        const long got = long(reinterpret_cast<char*>(&s(r, k, stage)) - reinterpret_cast<char*>(buffer));
        const long want = stage * stage_bytes + capmoe::fused::fc1_smem_offset(r, k / 8) + (k % 8) * sizeof(T);
        if (got != want && ++bad <= 5)
          std::printf("(row %d, k %d, stage %d): cute %ld, fc1_smem_offset %ld\n", r, k, stage, got, want);
      }
  // The coalesced gather's assignment covers every (row, chunk) of a tile exactly once, and the
  // 32 lanes of each warp-wide copy take 4 whole rows (8 chunks each).
  constexpr int kThreads = 128, kChunks = 8;
  int covered[kRows][kChunks] = {};
  for (int thread = 0; thread < kThreads; ++thread)
    for (int i = 0; i < kRows / 16; ++i) ++covered[capmoe::fused::gather_row(thread, i)][capmoe::fused::gather_chunk(thread)];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c)
      if (covered[r][c] != 1 && ++bad <= 10) std::printf("gather: (row %d, chunk %d) copied %d times\n", r, c, covered[r][c]);
  for (int warp = 0; warp < kThreads / 32; ++warp)
    for (int i = 0; i < kRows / 16; ++i) {
      int per_row[kRows] = {};
      for (int lane = 0; lane < 32; ++lane) ++per_row[capmoe::fused::gather_row(warp * 32 + lane, i)];
      int whole = 0;
      for (int r = 0; r < kRows; ++r) whole += per_row[r] == kChunks;
      if (whole != 4 && ++bad <= 10) std::printf("gather: warp %d pass %d reads %d whole rows, not 4\n", warp, i, whole);
    }
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
