// Runs the fused kernels' tile list (csrc/fused/tile_list.cuh: build_tile_prefix by warp 0,
// then locate for every tile, as fc1_sm90.cu and swiglu_dgrad_sm90.cu call them) under the CPU
// emulation on the cases tests/fused_tiles_emulated.rs writes, and writes back what it built.
//
// Case (little-endian int64): experts E, capacity, slices S, blocks (the persistent grid),
// threads per block, tail rows (0: the fused kernels' list; kCounterTailRows: SM90_COUNTER's,
// whose tiles may hold that many rows past 128); then offsets [E + 1].
// Output per case (int64): the host bound max_tiles(E, capacity, 128 S, 128, 128), the total
// tiles tile_prefix[E] * S, tile_prefix [E + 1], row_start [E + 1], then per tile (expert,
// row0, rows, n0) in tile order (each written by the block and thread that would run it; a
// tile no one visits stays -7777, one visited twice makes the driver fail).
// Usage: tile_list_driver CASES_FILE OUTPUT_FILE.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "common/launch.cuh"
#include "driver_main.h"
#include "fused/tile_list.cuh"
#include "grouped_gemm/counter.h"

namespace {

constexpr int kTile = 128;
constexpr int32_t kUnset = -7777;

struct Params {
  const int64_t* offsets;
  int experts, capacity, slices;
  int32_t* prefix_out;     // [E + 1], block 0
  int32_t* row_start_out;  // [E + 1], block 0
  int32_t* tiles_out;      // [tiles, 4]
  int32_t* visits;         // [tiles]
  int max_tiles;
};

// The kernels' pattern: warp 0 builds the list in shared memory, a barrier, then the CTAs
// stride over the tiles (here every thread of a block takes one tile of the block's stride).
template <int kTailRows>
__global__ void tile_list_kernel(Params p) {
  CAPMOE_DYNAMIC_SMEM(raw);
  auto* tile_prefix = reinterpret_cast<int32_t*>(raw);
  int32_t* row_start = tile_prefix + p.experts + 1;
  if (threadIdx.x / 32 == 0)
    capmoe::fused::build_tile_prefix<kTile, kTailRows>(p.offsets, p.experts, p.capacity, tile_prefix, row_start);
  __syncthreads();
  const int total = tile_prefix[p.experts] * p.slices;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int e = 0; e <= p.experts; ++e) p.prefix_out[e] = tile_prefix[e], p.row_start_out[e] = row_start[e];
  }
  for (int tile = blockIdx.x; tile < total && tile < p.max_tiles; tile += gridDim.x) {
    if (threadIdx.x != (unsigned)(tile / gridDim.x) % blockDim.x) continue;
    const capmoe::fused::Tile t =
        capmoe::fused::locate<kTile, kTile, kTailRows>(tile, p.slices, tile_prefix, row_start, p.experts);
    int32_t* o = p.tiles_out + 4 * (int64_t)tile;
    o[0] = t.expert, o[1] = t.row0, o[2] = t.rows, o[3] = t.n0;
    ++p.visits[tile];
  }
}

void put(FILE* out, int64_t v) { std::fwrite(&v, sizeof v, 1, out); }

int run_case(FILE* in, FILE* out) {
  int64_t h[6];
  const size_t got = std::fread(h, sizeof(int64_t), 6, in);
  if (got != 6) return got == 0 ? 0 : -1;
  const int experts = (int)h[0], capacity = (int)h[1], slices = (int)h[2], blocks = (int)h[3], threads = (int)h[4];
  const int tail_rows = (int)h[5];
  constexpr int kCounterTail = capmoe::gg::counter::kCounterTailRows;
  if (tail_rows != 0 && tail_rows != kCounterTail) return -1;
  std::vector<int64_t> offsets(experts + 1);
  if (std::fread(offsets.data(), sizeof(int64_t), offsets.size(), in) != offsets.size()) return -1;

  const int64_t bound = capmoe::fused::max_tiles(experts, capacity, (int64_t)kTile * slices, kTile, kTile);
  std::vector<int32_t> prefix(experts + 1, kUnset), row_start(experts + 1, kUnset);
  std::vector<int32_t> tiles(4 * bound, kUnset), visits(bound, 0);
  Params p{offsets.data(), experts, capacity, slices, prefix.data(), row_start.data(), tiles.data(), visits.data(),
           (int)bound};
  const size_t smem = 2 * (experts + 1) * sizeof(int32_t);
  auto* kernel = tail_rows == 0 ? tile_list_kernel<0> : tile_list_kernel<kCounterTail>;
  if (capmoe::launch(kernel, dim3(blocks), threads, smem, nullptr, p) != CAPMOE_OK) {
    std::fprintf(stderr, "launch failed\n");
    std::exit(1);
  }
  const int64_t total = (int64_t)prefix[experts] * slices;
  if (total > bound) {
    std::fprintf(stderr, "%lld tiles exceed the host bound %lld\n", (long long)total, (long long)bound);
    std::exit(1);
  }
  for (int64_t i = 0; i < total; ++i) {
    if (visits[i] > 1) {
      std::fprintf(stderr, "tile %lld visited %d times\n", (long long)i, visits[i]);
      std::exit(1);
    }
  }
  put(out, bound);
  put(out, total);
  for (int32_t v : prefix) put(out, v);
  for (int32_t v : row_start) put(out, v);
  for (int64_t i = 0; i < 4 * total; ++i) put(out, tiles[i]);
  return 1;
}

}  // namespace

int main(int argc, char** argv) { return run_cases_main(argc, argv, run_case); }
