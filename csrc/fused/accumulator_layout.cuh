// The wgmma accumulator layout the sm_90a fused epilogues rely on (fc1_sm90.cu,
// swiglu_dgrad_sm90.cu): their 16-byte stores (quad_store.cuh) need the 4 lanes of a quad to
// hold the same two rows, 2 columns of every 8-column group each.
#pragma once

#include <cute/tensor.hpp>

namespace capmoe::fused {

// Value i = 4g + 2r + c of a thread's accumulators holds row m0 + 8r, column
// 8g + 2 * (lane % 4) + c of the tile `coords` partitions (g: the 8-column group, r: which of
// the thread's two rows, c: the column within the pair). Traps otherwise (a build of the wrong
// atom); call it once per thread, outside the tile loop. Returns m0, the thread's first row.
template <class Coords>
__device__ int check_quad_accumulator_layout(const Coords& coords) {
  using cute::get;
  const int m0 = get<0>(coords(0));
  const int quad_lane = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < decltype(cute::size(coords))::value; ++i) {
    const int g = i / 4, r = (i / 2) % 2, c = i % 2;
    if (get<0>(coords(i)) != m0 + 8 * r || get<1>(coords(i)) != 8 * g + 2 * quad_lane + c) __trap();
  }
  return m0;
}

}  // namespace capmoe::fused
