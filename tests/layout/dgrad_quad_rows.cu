// Host-only check (run by tests/fused_host.rs, no GPU): the gathered fc2 dgrad's epilogue
// (csrc/fused/swiglu_dgrad_sm90.cu, store_tile_gathered) sums a row's 128 columns as: each
// thread its own pairs of that row in order, then a butterfly over the 4 lanes of its quad. It
// relies on this accumulator layout, which its check_quad_rows traps on at run time; here every
// consumer thread's partition of the 128 x 128 tile is walked through cute on the host:
//  - pair j = values (2j, 2j + 1) holds adjacent columns (n, n + 1) of one row;
//  - a thread's pairs hold two rows, row_a and row_a + 8, half of its pairs each, with the
//    columns of each row ascending in j (the documented fixed order);
//  - the 4 lanes of a quad (lane ^ 1, lane ^ 2) have the same row_a, and together hold each of
//    their two rows' 128 columns exactly once;
//  - every element of the tile belongs to exactly one thread.
// Exit 0 with "0 mismatches" when all hold, for bf16 and f16.
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdio>
#include <vector>

#include "fused/swiglu_dgrad_layout.h"

using namespace cute;

namespace {

constexpr int kTile = 128, kConsumers = 256;
int bad = 0;

void mismatch(const char* what, int thread, int j) {
  if (++bad <= 10) std::printf("%s: consumer thread %d, pair %d\n", what, thread, j);
}

template <class T>
void check(const char* name) {
  capmoe::fused::SwigluDgradTiledMma<T> mma;
  std::vector<int> owners(kTile * kTile, 0);
  std::vector<int> row_a_of(kConsumers);
  // Per quad and slot: how often each column is held.
  std::vector<int> quad_cols(kConsumers / 4 * 2 * kTile, 0);
  for (int t = 0; t < kConsumers; ++t) {
    auto thr = mma.get_thread_slice(t);
    Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTile>, Int<kTile>>{}));
    const int pairs = int(size(coords)) / 2;
    const int row_a = get<0>(coords(0));
    row_a_of[t] = row_a;
    int in_slot0 = 0, last_col[2] = {-1, -1};
    for (int j = 0; j < pairs; ++j) {
      const int m = get<0>(coords(2 * j)), n = get<1>(coords(2 * j));
      if (get<0>(coords(2 * j + 1)) != m || get<1>(coords(2 * j + 1)) != n + 1) mismatch("pair not adjacent", t, j);
      if (m != row_a && m != row_a + 8) {
        mismatch("a third row", t, j);
        continue;
      }
      const int slot = (m - row_a) >> 3;
      in_slot0 += slot == 0;
      if (n <= last_col[slot]) mismatch("columns not ascending", t, j);
      last_col[slot] = n + 1;
      for (int c = n; c < n + 2; ++c) {
        ++owners[m * kTile + c];
        ++quad_cols[((t / 4) * 2 + slot) * kTile + c];
      }
    }
    if (in_slot0 * 2 != pairs) mismatch("rows not half and half", t, -1);
  }
  for (int t = 0; t < kConsumers; ++t)
    if (row_a_of[t ^ 1] != row_a_of[t] || row_a_of[t ^ 2] != row_a_of[t]) mismatch("quad rows differ", t, -1);
  for (int i = 0; i < kTile * kTile; ++i)
    if (owners[i] != 1) mismatch("tile element not owned once", i / kTile, i % kTile);
  for (size_t i = 0; i < quad_cols.size(); ++i)
    if (quad_cols[i] != 1) mismatch("quad row column not held once", int(i / kTile), int(i % kTile));
  std::printf("%s: checked\n", name);
}

}  // namespace

int main() {
  check<cutlass::bfloat16_t>("bf16");
  check<cutlass::half_t>("f16");
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
