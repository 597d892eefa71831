// Runs the fused fc1's tile schedule (csrc/fused/tile_schedule.cuh) under the CPU emulation, as
// fc1_sm90.cu's producers use it: one thread per block takes tiles until one runs past the
// last, then finishes. Launch after launch on the same two words (grids of 1, 3 and 132
// blocks; 0, 1, 7 and 1000 tiles), every tile must be handed out exactly once and the words
// must be zero again when the launch ends, ready for the next. The emulation runs blocks one
// after another, so this checks the bookkeeping (hand-out, stop, reset), not interleavings.
// Prints "N mismatches"; exit 0 when N is 0.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "capturable_moe/fused.h"
#include "common/launch.cuh"
#include "fused/tile_schedule.cuh"

namespace {

struct Params {
  int32_t* words;  // the schedule
  int32_t* taken;  // [total]: how many times each tile was handed out
  int32_t* stops;  // [1]: the blocks that took past the last tile
  int total;
};

__global__ void take_tiles_kernel(Params p) {
  if (threadIdx.x != 0) return;
  const capmoe::fused::TileSchedule schedule{p.words};
  for (;;) {
    const int tile = schedule.take();
    if (tile >= p.total) break;
    ++p.taken[tile];
  }
  ++p.stops[0];
  schedule.finish();
}

}  // namespace

int main() {
  int32_t words[CAPMOE_FUSED_FC1_SCHEDULE_WORDS] = {0, 0};
  static_assert(CAPMOE_FUSED_FC1_SCHEDULE_WORDS == capmoe::fused::TileSchedule::kWords);
  int bad = 0;
  for (int grid : {1, 3, 132}) {
    for (int total : {0, 1, 7, 1000}) {
      std::vector<int32_t> taken(total, 0);
      int32_t stops = 0;
      Params p{words, taken.data(), &stops, total};
      if (capmoe::launch(take_tiles_kernel, dim3(grid), 32, 0, nullptr, p) != CAPMOE_OK) {
        std::fprintf(stderr, "launch failed\n");
        return 1;
      }
      for (int t = 0; t < total; ++t) {
        if (taken[t] != 1 && ++bad <= 10) std::printf("grid %d, %d tiles: tile %d taken %d times\n", grid, total, t, taken[t]);
      }
      if (stops != grid && ++bad <= 10) std::printf("grid %d, %d tiles: %d blocks stopped\n", grid, total, stops);
      if ((words[0] != 0 || words[1] != 0) && ++bad <= 10)
        std::printf("grid %d, %d tiles: words %d %d after the launch\n", grid, total, words[0], words[1]);
    }
  }
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
