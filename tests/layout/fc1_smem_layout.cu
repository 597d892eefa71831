// Host-only check (run by tests/fused_host.rs, no GPU): the fused fc1's cp.async producer
// writes chunk c of tile row r at fc1_smem_offset(r, c); the consumers' wgmma descriptors are
// built by cute from tile_to_shape(GMMA::Layout_K_SW128_Atom<T>, (128, 64, stages)). Both must
// name the same bytes: this walks every (row, k, stage) of the A tile through cute's swizzled
// shared-memory tensor and compares. Exit 0 when equal.
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
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
