// Host-only check (run by tests/fused_wgrad_host.rs, no GPU): the layouts of the sm_100a
// gathered wgrad (csrc/fused/wgrad_gather_sm100.cu, types in fused/wgrad_gather_sm100_layout.h),
// walked through cute on the host.
//  - A (dW's m, 128 values) and B (dW's n, 256 values), both MN-major: the shared cp.async
//    producer (fused/wgrad_tiles.cuh) puts 16-byte chunk c of K row k at wgrad_smem_offset(k, c)
//    of a 1024-byte aligned stage; the UMMA descriptors come from
//    UMMA::tile_to_mma_shape(Layout_MN_SW128_Atom, ((MN,16),1,4,stages), K first). Every
//    (mn, k, stage) must name the same byte in both.
//  - Both operands' UMMA descriptors as the hardware reads them: cute's make_umma_desc<MN> of
//    each k16 step gives the layout type and the two byte offsets; the PTX ISA's canonical
//    MN-major SW128 form (umma_mn_sw128.h) must put every (mn, k) of the step where the
//    producer put it. (The start address is not computed on the host: cute's shared-pointer
//    conversion exists on the device only and prints "ERROR: cast_smem_ptr_to_uint not
//    supported" once per descriptor here, harmlessly; each step's base comes from the layout.)
//  - The instruction descriptor cute builds for the atom, against the PTX ISA's bit table
//    written out here: F32 accumulator, A / B format (F16 0, BF16 1), both transposed
//    (MN-major), N >> 3, M >> 4.
//  - The accumulator: element (m, n) of the 128 x 256 tile at TMEM lane m, column n (the
//    address lane << 16 | column), which the epilogue's tcgen05.ld addresses are computed from.
// Exit 0 with "0 mismatches" when all hold, for bf16 and f16.
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "fused/wgrad_gather_layout.h"
#include "fused/wgrad_gather_sm100_layout.h"
#include "tmem_accumulator.h"
#include "umma_stages.h"
#include "umma_mn_sw128.h"

using namespace cute;

namespace {

int bad = 0;

template <class T>
using Layouts = capmoe::fused::WgradSm100Layout<T>;

// Where the producer puts value mn (of the tile's MN extent), K row k, of a stage.
template <class T>
long producer_offset(int mn, int k) {
  return long(capmoe::fused::wgrad_smem_offset(k, mn / 8)) + (mn % 8) * long(sizeof(T));
}

// Each k16 step's descriptor (cute's make_umma_desc<MN>) read through the canonical form.
template <class T, class L>
void check_descriptor(const char* what, int extent) {
  constexpr int kK = Layouts<T>::kTileK;
  alignas(1024) static T buffer[256 * kK * Layouts<T>::kStages];
  Tensor s = make_tensor(make_smem_ptr(buffer), L{});
  for (int step = 0; step < kK / 16; ++step) {
    Tensor block = s(_, 0, step, 0);  // the step's (MN, K16) block, rank 2
    const UMMA::SmemDescriptor desc =
        UMMA::make_umma_desc<UMMA::Major::MN>(make_tensor(block.data(), layout<0>(block.layout())));
    const long lbo = desc.leading_byte_offset_, sbo = desc.stride_byte_offset_;
    if (step == 0)
      std::printf("%s descriptor: layout type %d, LBO %ld B, SBO %ld B\n", what, int(desc.layout_type_), lbo * 16,
                  sbo * 16);
    if (desc.layout_type_ != uint8_t(UMMA::LayoutType::SWIZZLE_128B) && ++bad)
      std::printf("%s descriptor: layout type %d, want SWIZZLE_128B\n", what, int(desc.layout_type_));
    const long base = long(reinterpret_cast<char*>(&s(make_coord(0, 0), 0, step, 0)) - reinterpret_cast<char*>(buffer));
    for (int mn = 0; mn < extent; ++mn)
      for (int k = 0; k < 16; ++k) {
        const long got = base + mn_sw128_descriptor_offset(mn, k, lbo, sbo, int(sizeof(T)));
        const long want = producer_offset<T>(mn, 16 * step + k);
        if (got != want && ++bad <= 10)
          std::printf("%s descriptor (mn %d, k %d): reads %ld, producer wrote %ld\n", what, mn, 16 * step + k, got,
                      want);
      }
  }
}

// The instruction descriptor's bits, from the PTX ISA's table for kind::f16.
template <class T>
void check_instruction_descriptor(const char* type) {
  using L = Layouts<T>;
  const uint32_t format = std::is_same_v<T, cutlass::bfloat16_t> ? 1u : 0u;
  const uint32_t want = (1u << 4)                          // D format: F32
                        | (format << 7) | (format << 10)   // A, B format
                        | (1u << 15) | (1u << 16)          // A, B transposed: MN-major
                        | (uint32_t(L::kTileN >> 3) << 17)  // N >> 3
                        | (uint32_t(L::kTileM >> 4) << 24);  // M >> 4
  const uint32_t got = MMA_Traits<typename L::Mma>{}.idesc_.desc_;
  std::printf("%s: instruction descriptor %#010x\n", type, got);
  if (got != want && ++bad) std::printf("%s: instruction descriptor %#010x, want %#010x\n", type, got, want);
}

template <class T>
void check(const char* type) {
  using L = Layouts<T>;
  std::printf("%s: A stages ", type);
  print(typename L::SmemA{});
  std::printf("\n%s: B stages ", type);
  print(typename L::SmemB{});
  std::printf("\n");
  bad += umma_stage_mismatches<T, typename L::SmemA>("A", L::kTileM, L::kStages, producer_offset<T>);
  bad += umma_stage_mismatches<T, typename L::SmemB>("B", L::kTileN, L::kStages, producer_offset<T>);
  check_descriptor<T, typename L::SmemA>("A", L::kTileM);
  check_descriptor<T, typename L::SmemB>("B", L::kTileN);
  check_instruction_descriptor<T>(type);
  bad += tmem_accumulator_mismatches<typename L::TiledMma, typename L::AccShape>(type, L::kTileM, L::kTileN);
}

}  // namespace

int main() {
  check<cutlass::bfloat16_t>("bf16");
  check<cutlass::half_t>("f16");
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
