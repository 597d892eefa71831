// For the host layout checks of the sm_100a kernels (tests/layout/*_sm100_layout.cu): the UMMA
// accumulator of a 1-SM tile must hold element (m, n) at TMEM lane m, column n (cute's address
// lane << 16 | column), which the epilogues' tcgen05.ld (a lane quarter per warp, 32 columns a
// load) assume. Prints cute's layout and up to 20 mismatches; returns how many there are.
#pragma once

#include <cute/tensor.hpp>

#include <cstdio>

template <class TiledMma, class AccShape>
int tmem_accumulator_mismatches(const char* type, int rows, int columns) {
  auto acc = TiledMma::make_fragment_C(AccShape{});
  std::printf("%s: accumulator ", type);
  cute::print(acc.layout());
  std::printf("\n");
  int bad = 0;
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < columns; ++n) {
      const long got = long(acc.layout()(cute::make_coord(cute::make_coord(m, n), 0, 0)));
      const long want = (long(m) << 16) + n;
      if (got != want && ++bad <= 20)
        std::printf("%s accumulator (%d, %d): cute %ld, lane << 16 | column %ld\n", type, m, n, got, want);
    }
  return bad;
}
