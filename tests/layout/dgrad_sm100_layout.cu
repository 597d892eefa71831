// Host-only check (run by tests/fused_host.rs, no GPU): the layouts of the sm_100a fused fc2
// dgrad (csrc/fused/swiglu_dgrad_sm100.cu, types in fused/swiglu_dgrad_sm100_layout.h), walked
// through cute on the host.
//  - A (K-major): the drows TMA box (64 K x 128 rows, 128B swizzle) and the cp.async gather
//    both put chunk c of tile row r at fc1_smem_offset(r, c) of a 1024-byte aligned stage; the
//    UMMA descriptors come from UMMA::tile_to_mma_shape(Layout_K_SW128_Atom, ((128,16),1,4,
//    stages)). Every (row, k, stage) must name the same byte in both.
//  - B (MN-major, W2_e [H, F] with F contiguous): the two W2 boxes of a stage (64 columns x
//    64 K rows, 128B swizzle, as the entry encodes the (F, H, E) map) land at element
//    c * 64 * 64 of the stage for box c: column n, K row k at byte 128 k + 16 ((n % 64 / 8) ^
//    (k % 8)) + 2 (n % 8) of its box (TMA's 128B swizzle: the 16-byte chunk index XOR the
//    row's index in its 1024-byte block). Against tile_to_mma_shape(Layout_MN_SW128_Atom,
//    ((128,16),1,4,stages), K first), for every (column, k, stage).
//  - B's UMMA descriptor as the hardware reads it: cute's make_umma_desc<MN> of a k16 step gives
//    the layout type and the two byte offsets; the PTX ISA's canonical MN-major SW128 form
//    (umma_mn_sw128.h; cute's make_umma_desc states the same form) must put every (column, k)
//    of the step where the W2 boxes put it. (The start address is not computed on the host:
//    cute's shared-pointer conversion exists on the device only, and prints "ERROR:
//    cast_smem_ptr_to_uint not supported" once per descriptor here, harmlessly; the k16 steps'
//    bases come from the layout above.)
//  - The accumulator: element (m, n) of the 128 x 128 tile at TMEM lane m, column n (the
//    address lane << 16 | column), which the epilogue's tcgen05.ld addresses are computed from.
// Exit 0 with "0 mismatches" when all hold, for bf16 and f16.
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdio>

#include "fused/fc1_layout.h"
#include "fused/swiglu_dgrad_sm100_layout.h"
#include "tmem_accumulator.h"
#include "umma_stages.h"
#include "umma_mn_sw128.h"

using namespace cute;

namespace {

int bad = 0;
constexpr int kK = 64;

// Where TMA's 128B-swizzled W2 boxes put column n (of the tile's 128), K row k, of a stage.
template <class T>
long w2_box_offset(int n, int k, int box_n) {
  const int box = n / box_n, col = n % box_n;
  return long(box) * box_n * kK * sizeof(T) + k * 128 + (((col * long(sizeof(T))) / 16) ^ (k % 8)) * 16 +
         (col * long(sizeof(T))) % 16;
}

template <class T>
void check_b_descriptor(const char* type) {
  using L = capmoe::fused::SwigluDgradSm100Layout<T>;
  alignas(1024) static T buffer[128 * kK * 8];
  Tensor s = make_tensor(make_smem_ptr(buffer), typename L::SmemB{});
  for (int step = 0; step < kK / 16; ++step) {
    // The step's (N, K16) block as the rank-2 tensor a descriptor is made from.
    Tensor block = s(_, 0, step, 0);
    const UMMA::SmemDescriptor desc =
        UMMA::make_umma_desc<UMMA::Major::MN>(make_tensor(block.data(), layout<0>(block.layout())));
    const long lbo = desc.leading_byte_offset_, sbo = desc.stride_byte_offset_;
    if (step == 0)
      std::printf("%s: B descriptor layout type %d, LBO %ld B, SBO %ld B\n", type, int(desc.layout_type_), lbo * 16,
                  sbo * 16);
    if (desc.layout_type_ != uint8_t(UMMA::LayoutType::SWIZZLE_128B) && ++bad)
      std::printf("%s: B descriptor layout type %d, want SWIZZLE_128B\n", type, int(desc.layout_type_));
    // The step's base: where cute puts its element (0, 0); the descriptor reads relative to it.
    const long base = long(reinterpret_cast<char*>(&s(make_coord(0, 0), 0, step, 0)) - reinterpret_cast<char*>(buffer));
    for (int n = 0; n < L::kTileN; ++n)
      for (int k = 0; k < 16; ++k) {
        const long got = base + mn_sw128_descriptor_offset(n, k, lbo, sbo, int(sizeof(T)));
        const long want = w2_box_offset<T>(n, 16 * step + k, L::kBoxN);
        if (got != want && ++bad <= 10)
          std::printf("%s B descriptor (column %d, k %d): reads %ld, box wrote %ld\n", type, n, 16 * step + k, got,
                      want);
      }
  }
}

template <class T>
void check(const char* type) {
  using L = capmoe::fused::SwigluDgradSm100Layout<T>;
  std::printf("%s: B stages ", type);
  print(typename L::SmemB{});
  std::printf("\n");
  bad += umma_stage_mismatches<T, typename L::SmemA>("A", L::kTileM, L::kStages, [](int r, int k) {
    return long(capmoe::fused::fc1_smem_offset(r, k / 8)) + (k % 8) * long(sizeof(T));
  });
  bad += umma_stage_mismatches<T, typename L::SmemB>("B", L::kTileN, L::kStages,
                                                     [](int n, int k) { return w2_box_offset<T>(n, k, L::kBoxN); });
  check_b_descriptor<T>(type);
  bad += tmem_accumulator_mismatches<typename L::TiledMma, typename L::AccShape>(type, L::kTileM, L::kTileN);
}

}  // namespace

int main() {
  check<cutlass::bfloat16_t>("bf16");
  check<cutlass::half_t>("f16");
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
