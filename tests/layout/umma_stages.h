// For the host layout checks of the sm_100a kernels (tests/layout/*_sm100_layout.cu): cute's
// UMMA stage layout L over an (extent x 64 K x stages) operand, ((mn, k16), block, k16 step,
// stage), against where a producer puts element (i, k) of a stage, want(i, k) in bytes. Every
// (i, k, stage) must name the same byte in both, and the stages must be dense. Prints the first
// 10 mismatches; returns how many there are.
#pragma once

#include <cute/tensor.hpp>

#include <cstdio>

template <class T, class L, class Want>
int umma_stage_mismatches(const char* what, int extent, int stages, Want want) {
  constexpr int kK = 64;
  alignas(1024) static T buffer[cute::cosize_v<L>];
  auto s = cute::make_tensor(cute::make_smem_ptr(buffer), L{});
  int bad = 0;
  if (long(cute::cosize(L{})) != long(extent) * kK * stages && ++bad)
    std::printf("%s: cosize %ld, want %ld\n", what, long(cute::cosize(L{})), long(extent) * kK * stages);
  const long stage_bytes = long(extent) * kK * sizeof(T);
  for (int stage = 0; stage < stages; ++stage)
    for (int i = 0; i < extent; ++i)
      for (int k = 0; k < kK; ++k) {
        const long got = long(reinterpret_cast<char*>(&s(cute::make_coord(i, k % 16), 0, k / 16, stage)) -
                              reinterpret_cast<char*>(buffer));
        const long expected = stage * stage_bytes + want(i, k);
        if (got != expected && ++bad <= 10)
          std::printf("%s (%d, k %d, stage %d): cute %ld, producer %ld\n", what, i, k, stage, got, expected);
      }
  return bad;
}
