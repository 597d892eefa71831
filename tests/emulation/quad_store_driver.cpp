// Runs the fused epilogues' quad exchange (csrc/fused/quad_store.cuh) under the CPU emulation:
// two warps, each lane holding the 32-bit pairs of a wgmma accumulator row the way the sm_90a
// epilogues do (lane q of a quad: columns 8g + 2q, 8g + 2q + 1 of groups g < 16 of the quad's
// row), exchanged four groups at a time and stored 16 bytes a lane at group 4a + q, as
// store_tile does. Every stored word must then be the pair its columns name, and every pair
// must be stored once; the exchange run twice must give back the input (it is its own inverse,
// which the dgrad's h loads rely on). Prints "N mismatches"; exit 0 when N is 0.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "common/launch.cuh"
#include "fused/quad_store.cuh"

namespace {

constexpr int kGroups = 16;            // 8-column groups of a row (128 columns)
constexpr int kRows = 16;              // 2 warps x 8 quads
constexpr int kPairsPerRow = 4 * kGroups;

// The pair of columns (2c, 2c + 1) of a row, as a code no other pair has.
constexpr uint32_t code(int row, int pair) { return 0x10000u * uint32_t(row + 1) + uint32_t(pair); }

struct Params {
  uint32_t* stored;     // [kRows, kPairsPerRow]
  uint32_t* roundtrip;  // [64 threads, kGroups]: each lane's words after two exchanges
};

__global__ void quad_store_kernel(Params p) {
  const int lane = threadIdx.x & 31, quad_lane = lane & 3;
  const int row = threadIdx.x / 4;
  for (int a = 0; a < kGroups / 4; ++a) {
    uint32_t words[4], twice[4];
    for (int j = 0; j < 4; ++j) words[j] = twice[j] = code(row, 4 * (4 * a + j) + quad_lane);
    capmoe::fused::quad_transpose(words);
    capmoe::fused::store16(p.stored + row * kPairsPerRow + 4 * (4 * a + quad_lane), words);
    capmoe::fused::quad_transpose(twice);
    capmoe::fused::quad_transpose(twice);
    for (int j = 0; j < 4; ++j) p.roundtrip[(threadIdx.x * (kGroups / 4) + a) * 4 + j] = twice[j];
  }
}

}  // namespace

int main() {
  std::vector<uint32_t> stored(kRows * kPairsPerRow, 0), roundtrip(kRows * 4 * kGroups, 0);
  Params p{stored.data(), roundtrip.data()};
  if (capmoe::launch(quad_store_kernel, dim3(1), 64, 0, nullptr, p) != CAPMOE_OK) {
    std::fprintf(stderr, "launch failed\n");
    return 1;
  }
  int bad = 0;
  for (int row = 0; row < kRows; ++row) {
    for (int pair = 0; pair < kPairsPerRow; ++pair) {
      if (stored[row * kPairsPerRow + pair] != code(row, pair) && ++bad <= 10)
        std::printf("row %d, columns %d..%d: got %#x\n", row, 2 * pair, 2 * pair + 1, stored[row * kPairsPerRow + pair]);
    }
  }
  for (int thread = 0; thread < 64; ++thread) {
    for (int a = 0; a < kGroups / 4; ++a) {
      for (int j = 0; j < 4; ++j) {
        const uint32_t want = code(thread / 4, 4 * (4 * a + j) + (thread & 3));
        if (roundtrip[(thread * (kGroups / 4) + a) * 4 + j] != want && ++bad <= 10)
          std::printf("thread %d, group %d: two exchanges did not give back the input\n", thread, 4 * a + j);
      }
    }
  }
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
