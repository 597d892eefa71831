// The gathered A rows written back out of the shared-memory stages (fc1_sm90.cu's `rows`): the
// fused fc1 gathers x[token_of_row[r]] into its K-major 128B-swizzled A stages anyway, so in a
// training step its consumers copy them to the permuted rows buffer the backward's fc1 wgrad
// reads, and the step needs no permute pass. Only the tiles of the first column slice copy
// (every M tile of an expert appears once there), and each consumer warpgroup copies its own 64
// tile rows while the tensor cores read the same stage (the mainloop's `beside` step,
// pipeline.cuh).
#pragma once

#include <cstdint>

#include "fused/fc1_layout.h"

namespace capmoe::fused {

// A consumer warpgroup's copy of one stage's rows [first_row, first_row + 64) to
// out[(row0 + r) * hidden + k0 ...]: thread t of the warpgroup takes 16-byte chunk t % 8 of
// rows first_row + t / 8 + 16 i, so the 8 lanes of one row write its 128 bytes whole (each
// warp-wide store four whole rows); a row's 8 swizzled chunks fill its 128-byte line, so the
// shared-memory reads are conflict-free.
// Rows at or past `rows` and chunks at or past `hidden` are not written.
struct StageRowsOut {
  static constexpr int kRowsPerPass = 128 / 8;
  static constexpr int kPasses = 64 / kRowsPerPass;

  int first_row;  // this thread's first tile row
  int chunk;

  __device__ __forceinline__ StageRowsOut(int warpgroup_first_row, int warpgroup_thread)
      : first_row(warpgroup_first_row + warpgroup_thread / 8), chunk(warpgroup_thread % 8) {}

  // stage_a: the stage's A tile (128 rows x 64 16-bit K values, fc1_smem_offset's layout);
  // out_tile: out + row0 * hidden, the tile's first row in the [capacity, hidden] output.
  template <class T>
  __device__ __forceinline__ void copy(const uint8_t* stage_a, T* out_tile, int rows, int hidden, int k0) const {
    static_assert(sizeof(T) == 2, "a 128-byte stage row holds 64 16-bit values");
    const int col = k0 + 8 * chunk;
    if (col >= hidden) return;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = first_row + kRowsPerPass * i;
      if (r >= rows) break;  // rows grow with i
      const uint4 v = *reinterpret_cast<const uint4*>(stage_a + fc1_smem_offset(r, chunk));
      // Evict-first: the backward reads these rows much later; the weights and x stay in L2.
      __stcs(reinterpret_cast<uint4*>(out_tile + int64_t(r) * hidden + col), v);
    }
  }
};

}  // namespace capmoe::fused
