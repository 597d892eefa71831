// Host-only check (run by tests/fused_wgrad_host.rs, no GPU): the gathered wgrad's producer
// writes each 16-byte chunk at wgrad_smem_offset(k, c); the consumers' wgmma descriptors are
// built by cute from tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>, (MN, 64, stages),
// Step<_2, _1, _3>). Both must name the same bytes: this walks every (mn, k, stage) of both
// operand tiles through cute's swizzled shared-memory tensor and compares. Exit 0 when equal.
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

#include <cstdio>

#include "fused/wgrad_gather_layout.h"

using namespace cute;
using T = cutlass::bfloat16_t;

template <int kMN>
int mismatches() {
  constexpr int kK = 64, kStages = 4;
  using Layout = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<kMN>, Int<kK>, Int<kStages>>{},
                                        Step<_2, _1, _3>{}));
  alignas(1024) static T buffer[kMN * kK * kStages];
  Tensor s = make_tensor(make_smem_ptr(buffer), Layout{});
  const long stage_bytes = long(kMN) * kK * sizeof(T);
  int bad = 0;
  for (int stage = 0; stage < kStages; ++stage)
    for (int k = 0; k < kK; ++k)
      for (int mn = 0; mn < kMN; ++mn) {
        const long got = long(reinterpret_cast<char*>(&s(mn, k, stage)) - reinterpret_cast<char*>(buffer));
        const long want = stage * stage_bytes + capmoe::fused::wgrad_smem_offset(k, mn / 8) + (mn % 8) * sizeof(T);
        if (got != want && ++bad <= 5)
          std::printf("MN %d: (mn %d, k %d, stage %d) cute %ld, wgrad_smem_offset %ld\n", kMN, mn, k, stage, got, want);
      }
  return bad;
}

int main() {
  const int bad = mismatches<128>() + mismatches<256>();
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
