// Host-only check (run by tests/fused_host.rs, no GPU): the layouts of the sm_100a fused fc1
// (csrc/fused/fc1_sm100.cu, types in fused/fc1_sm100_layout.h), walked through cute on the host.
//  - A: the cp.async gather writes chunk c of tile row r at fc1_smem_offset(r, c) of a stage;
//    the UMMA descriptors come from UMMA::tile_to_mma_shape(Layout_K_SW128_Atom, ((128,16),1,4,
//    stages)). Every (row, k, stage) must name the same byte in both.
//  - B: the two W1 TMA boxes (64 K x 128 rows, 128B swizzle) land at rows [0, 128) (gate) and
//    [128, 256) (up) of a 1024-byte aligned stage: row n's chunk c at fc1_smem_offset(n, c),
//    against tile_to_mma_shape over ((256,16),1,4,stages).
//  - The accumulator: element (m, n) of the 128 x 256 tile at TMEM lane m, column n (the
//    address lane << 16 | column), which the epilogue's tcgen05.ld addresses are computed from.
// Exit 0 with "0 mismatches" when all hold, for bf16 and f16.
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdio>

#include "fused/fc1_layout.h"
#include "fused/fc1_sm100_layout.h"
#include "tmem_accumulator.h"
#include "umma_stages.h"

using namespace cute;

namespace {

int bad = 0;

// Where the gather (A) and the W1 boxes (B) put row r, K element k, of a stage.
template <class T>
long fc1_offset(int r, int k) {
  return long(capmoe::fused::fc1_smem_offset(r, k / 8)) + (k % 8) * long(sizeof(T));
}

template <class T>
void check(const char* type) {
  using L = capmoe::fused::Fc1Sm100Layout<T>;
  std::printf("%s: A stages ", type);
  print(typename L::SmemA{});
  std::printf("\n");
  bad += umma_stage_mismatches<T, typename L::SmemA>("A", L::kTileM, L::kStages, fc1_offset<T>);
  bad += umma_stage_mismatches<T, typename L::SmemB>("B", 2 * L::kTileN, L::kStages, fc1_offset<T>);
  bad += tmem_accumulator_mismatches<typename L::TiledMma, typename L::AccShape>(type, L::kTileM, 2 * L::kTileN);
}

}  // namespace

int main() {
  check<cutlass::bfloat16_t>("bf16");
  check<cutlass::half_t>("f16");
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
