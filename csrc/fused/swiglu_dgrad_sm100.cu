// capmoe-archs: 100a
// Fused fc2 dgrad + SwiGLU backward of the expert path on Blackwell (sm_100a): dact = A @ W2_e
// per expert, and in the epilogue dh = SwiGLU'(h) * dact; the contract and the per-element bits
// of the Hopper kernel (swiglu_dgrad_sm90.cu, capturable_moe/fused.h), both forms, with the MMA
// moved to tcgen05 (UMMA) and the accumulators to tensor memory (TMEM).
// COMPILED ONLY, NEVER RUN: no Blackwell GPU was available when it was written (docs/fused.md).
//
// Tiles and tile list are the Hopper kernel's: 128 routing rows of one expert x 128 columns of
// F, K = H in blocks of 64, one 128x128x16 UMMA per k16 step (A K-major, B MN-major).
//  - A = drows [capacity, H] by one 64 x 128 TMA box per stage (drows form), or dy rows
//    gathered through token_of_row by cp.async (gathered form: produce_gathered_a in
//    fused/gather_rows.cuh, as fc1's); both land at fc1_smem_offset.
//  - B = W2_e [H, F] (F contiguous): the Hopper entry's 3D map over (F, H, E), two 64-column
//    x 64-row boxes per stage, into UMMA's MN-major 128B-swizzle atom tiled along K first
//    (fused/swiglu_dgrad_sm100_layout.h; checked against cute on the host by
//    tests/layout/dgrad_sm100_layout.cu).
//
// Roles (416 threads = 13 warps), as the sm_100a fc1 (fc1_sm100.cu):
//  - warps 0-3, the producer: drows form, thread 0 issues the TMAs; gathered form, all 128
//    threads copy A rows and thread 0 also issues the W2 boxes. Then the producer tail;
//  - warps 4-11, the epilogue: warp w reads TMEM lane quarter w % 4, so it takes tile rows
//    32 (w % 4) + lane and the 64 columns [64 (w / 4 - 1), + 64) of them: a thread holds 64
//    consecutive columns of one row, loaded 32 at a time;
//  - warp 12, the MMA warp: allocates TMEM (two 128-column accumulators), issues the UMMAs.
// Pipelines, TMEM hand-offs and their ordering rules: fused/sm100_pipeline.cuh.
//
// Epilogue, per pair of adjacent columns of a stored row (< t.rows; other rows are never
// written), the Hopper kernel's fp32 math: d = dact rounded to T (Pair<T>), then
// capmoe_routing_swiglu_backward's math on (d, g = h[r, f], u = h[r, F + f]). The h pairs come
// by 16-byte loads (the first 32 columns' before the accumulator wait, so they land behind the
// mainloop), dh and dact go out by 16-byte stores. Gathered form: dh of p * d, and dprob's
// partial of the row over the slice's 128 columns in a fixed order: each thread sums
// d * SwiGLU(g, u) over its 64 columns in ascending order, the upper-half thread puts its sum in
// shared memory, and after a barrier of the epilogue warps the lower-half thread writes
// lower + upper: one writer per (row, slice). The order differs from the Hopper kernel's
// (per-quad butterfly), so the two archs' partials may differ in the last bits; each is
// deterministic.
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <type_traits>

#include "common/launch.cuh"
#include "fused/launch_large_smem.cuh"
#include "common/swiglu_math.cuh"
#include "fused/gather_rows.cuh"
#include "fused/pair.cuh"
#include "fused/pipeline.cuh"
#include "fused/sm100_pipeline.cuh"
#include "fused/swiglu_dgrad_launch.h"
#include "fused/swiglu_dgrad_sm100_layout.h"
#include "fused/tile_list.cuh"
#include "fused/tma_loads.cuh"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kDgradSm100TileM;
constexpr int kTileN = kDgradSm100TileN;
constexpr int kTileK = kDgradSm100TileK;
constexpr int kBoxN = kDgradSm100BoxN;
constexpr int kStages = kDgradSm100Stages;
using namespace sm100_roles;  // kThreads, the role warps, kAccStages, kColumnsPerLoad
constexpr int kAccColumns = kTileN;  // fp32 TMEM columns of one accumulator
constexpr int kTmemColumns = kAccStages * kAccColumns;
constexpr int kEpilogueColumns = kTileN / (kEpilogueWarps / 4);  // columns per thread
constexpr int kLoads = kEpilogueColumns / kColumnsPerLoad;
constexpr int kPairsPerLoad = kColumnsPerLoad / 2;
// The named barrier of the epilogue warps (0 is __syncthreads's).
constexpr uint32_t kEpilogueBarrier = 1;

static_assert(kTileN == 128 && kTileM == kSwigluDgradTileM, "the entry's tiles (swiglu_dgrad.cu, fused.h)");
static_assert(GatherRows<kTileM>::kThreads == kProducerThreads, "the gather's thread -> (row, chunk) map covers the tile");
static_assert(kEpilogueWarps == 8 && kFirstEpilogueWarp % 4 == 0,
              "two epilogue warpgroups, each covering all 128 TMEM lanes, a quarter per warp, and half the "
              "columns: the dprob partial combines exactly two halves");
static_assert(kEpilogueColumns % kColumnsPerLoad == 0, "whole tcgen05.ld loads per thread");

// Where the A tiles come from (the two forms of the file's top).
enum class ASource { Tma, Gathered };

template <class T>
struct Kernel {
  using Layout = SwigluDgradSm100Layout<T>;
  using TiledMma = typename Layout::TiledMma;
  using SmemLayoutA = typename Layout::SmemA;
  using SmemLayoutB = typename Layout::SmemB;
  using AccShape = typename Layout::AccShape;

  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kTileN * kTileK;
  static constexpr int kBoxElemsB = kBoxN * kTileK;
  static constexpr uint32_t kBytesA = kStageElemsA * sizeof(T);
  static constexpr uint32_t kBytesB = kStageElemsB * sizeof(T);

  // What the producers write must be what the UMMA descriptors read: A at fc1_smem_offset (the
  // K-major 128B-swizzle atom GMMA and UMMA share), B box c (columns [64 c, 64 c + 64)) at
  // c * 64 * 64 elements of its stage, K row k at 128-byte row k of the box. Checked here before
  // the swizzle (a function of the address, as TMA's is), and in full against cute on the host
  // by tests/layout/dgrad_sm100_layout.cu.
  static_assert(std::is_same_v<UMMA::Layout_K_SW128_Atom<T>, GMMA::Layout_K_SW128_Atom<T>>,
                "UMMA's K-major SW128 atom is GMMA's: fc1_smem_offset holds for both");
  static_assert(kTileK * sizeof(T) == 128 && kBoxN * sizeof(T) == 128, "128-byte swizzle rows");
  using PlainB = decltype(get_nonswizzle_portion(SmemLayoutB{}));  // ((n, k16), 1, k16 step, stage)
  static_assert(PlainB{}(make_coord(make_coord(_1{}, _0{}), _0{}, _0{}, _0{})) == 1, "F contiguous");
  static_assert(PlainB{}(make_coord(make_coord(_0{}, _1{}), _0{}, _0{}, _0{})) == kBoxN, "K row = 64 elements");
  static_assert(PlainB{}(make_coord(make_coord(_0{}, _0{}), _0{}, _1{}, _0{})) == 16 * kBoxN, "k16 steps");
  static_assert(PlainB{}(make_coord(make_coord(Int<kBoxN>{}, _0{}), _0{}, _0{}, _0{})) == kBoxElemsB,
                "the second box right after the first's 64 K rows");
  static_assert(PlainB{}(make_coord(make_coord(_0{}, _0{}), _0{}, _0{}, _1{})) == kStageElemsB, "dense stages");
  static_assert(cosize_v<SmemLayoutA> == kStageElemsA * kStages, "A stages are dense, one after another");
  static_assert(cosize_v<SmemLayoutB> == kStageElemsB * kStages, "B stages are dense, one after another");

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t acc_full[kAccStages];
    uint64_t acc_empty[kAccStages];
    uint32_t tmem_base;                                 // tcgen05.alloc writes it
    float dprob_upper[kAccStages][kTileM];              // gathered: upper-half row sums
    int32_t tile_prefix[CAPMOE_FUSED_MAX_EXPERTS + 1];  // M tiles of the experts before e
    int32_t row_start[CAPMOE_FUSED_MAX_EXPERTS + 1];    // first row of expert e (clamped)
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_100a allows 227 KB of dynamic shared memory per CTA");
  // One CTA per SM: tcgen05.alloc of a second one would not wait on this one's columns.
  static_assert(2 * kSmemBytes > 228 * 1024, "one CTA per SM");
};

__device__ __forceinline__ Tile locate_tile(int tile, int slices, const int32_t* tile_prefix, const int32_t* row_start,
                                            int experts) {
  return locate<kTileM, kTileN>(tile, slices, tile_prefix, row_start, experts);
}

// The B tile of a stage (fused/tma_loads.cuh): W2_e rows [k0, k0 + 64), columns [n0, n0 + 128).
template <class T>
__device__ __forceinline__ void load_weights(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int stage,
                                             const Tile& t, int k0) {
  load_w2_tile<kTileN, kBoxN, kTileK>(p, &s.full[stage], s.b + stage * Kernel<T>::kStageElemsB, t, k0);
}

// The drows form's producer, one thread: the Hopper kernel's loop (fused/tma_loads.cuh), then
// the tail.
template <class T>
__device__ void produce_tma(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  using K = Kernel<T>;
  static_assert(K::kBytesA + K::kBytesB == (kTileM + kTileN) * kTileK * sizeof(T), "produce_drows arms the whole stage");
  produce_drows<kTileM, kTileN, kBoxN, kTileK, kStages>(
      p, s.full, s.empty, s.a, s.b, total_tiles, StridedTiles{},
      [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      "sm100 dgrad TMA producer, empty");
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  drain_stage_ring<kStages>(s.empty, int64_t(cta_tiles(total_tiles)) * k_blocks, "sm100 dgrad producer tail, empty");
}

// The gathered form's producer warpgroup: the Hopper kernel's gathered loop (dy rows through
// token_of_row, zeros for a token outside [0, max_tokens); 1 + 128 arrivals per stage), then
// the tail.
template <class T>
__device__ void produce_gathered(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles,
                                 int slices) {
  produce_gathered_a<kTileM, kTileK, kStages>(
      p.dy, p.hidden, p.max_tokens, p.token_of_row, s.full, s.empty, s.a, Kernel<T>::kBytesB, total_tiles,
      StridedTiles{}, [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      [&](int stage, const Tile& t, int k0) { load_weights<T>(p, s, stage, t, k0); });
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  drain_stage_ring<kStages>(s.empty, int64_t(cta_tiles(total_tiles)) * k_blocks, "sm100 dgrad producer tail, empty");
}

// The MMA warp (fused/sm100_pipeline.cuh's loop): four k16 UMMAs per K block. Gathered stages
// came through the generic proxy (cp.async) and are fenced before the UMMAs read them.
template <class T, ASource kA>
__device__ void issue_mmas(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  using K = Kernel<T>;
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});  // ((128,16),1,4,stage)
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});  // ((128,16),1,4,stage)
  auto thr = mma.get_slice(0);
  Tensor tCrA = thr.make_fragment_A(sA);  // UMMA shared-memory descriptors
  Tensor tCrB = thr.make_fragment_B(sB);
  Tensor acc = K::TiledMma::make_fragment_C(typename K::AccShape{});  // ((128,128),1,1) in TMEM
  static_assert(size<2>(decltype(tCrA){}) == kTileK / 16 && size<2>(decltype(tCrB){}) == kTileK / 16,
                "four k16 UMMAs per K block");
  issue_umma_tiles<kStages, kAccStages, kAccColumns, kA == ASource::Gathered>(
      mma, tCrA, tCrB, acc, s.full, s.empty, s.acc_full, s.acc_empty, s.tmem_base, total_tiles, k_blocks);
}

// The h pairs of 32 columns [col, col + 32) of `row`: gate[i] = h[row, col + 2i ..], up[i] the
// same columns of the up half; four 16-byte loads each (col is a multiple of 32, F of 128).
__device__ __forceinline__ void load_gate_up(const SwigluDgradParams& p, int64_t row, int64_t col,
                                             uint32_t (&gate)[kPairsPerLoad], uint32_t (&up)[kPairsPerLoad]) {
  const auto* h = static_cast<const uint16_t*>(p.h) + row * 2 * p.ffn + col;
  const uint4* g = reinterpret_cast<const uint4*>(h);
  const uint4* u = reinterpret_cast<const uint4*>(h + p.ffn);
#pragma unroll
  for (int i = 0; i < kPairsPerLoad / 4; ++i) {
    const uint4 gv = __ldg(g + i), uv = __ldg(u + i);
    gate[4 * i] = gv.x, gate[4 * i + 1] = gv.y, gate[4 * i + 2] = gv.z, gate[4 * i + 3] = gv.w;
    up[4 * i] = uv.x, up[4 * i + 1] = uv.y, up[4 * i + 2] = uv.z, up[4 * i + 3] = uv.w;
  }
}

// The drows form, 32 columns of a stored row: dact rounded to T, then the SwiGLU backward of
// (dact, g, u); dh (and dact when requested) by 16-byte stores.
template <class T>
__device__ __forceinline__ void store_columns(const SwigluDgradParams& p, int64_t row, int64_t col,
                                              const uint32_t (&acc)[32], const uint32_t (&gate)[kPairsPerLoad],
                                              const uint32_t (&up)[kPairsPerLoad]) {
  uint32_t dg_pairs[kPairsPerLoad], du_pairs[kPairsPerLoad], dact_pairs[kPairsPerLoad];
#pragma unroll
  for (int i = 0; i < kPairsPerLoad; ++i) {
    const DgradPairs out =
        swiglu_dgrad_pairs<T>(__uint_as_float(acc[2 * i]), __uint_as_float(acc[2 * i + 1]), gate[i], up[i]);
    dact_pairs[i] = out.dact;
    dg_pairs[i] = out.dg;
    du_pairs[i] = out.du;
  }
  auto* dh = static_cast<uint16_t*>(p.dh) + row * 2 * p.ffn + col;
  store_16_pairs(dh, dg_pairs);
  store_16_pairs(dh + p.ffn, du_pairs);
  if (p.dact != nullptr) store_16_pairs(static_cast<uint16_t*>(p.dact) + row * p.ffn + col, dact_pairs);
}

// The gathered form, 32 columns of a stored row: d = dact rounded to T; dprob's term
// d * SwiGLU(g, u) added to `partial` in ascending column order (every product and sum rounded
// on its own); dh = SwiGLU backward of (p * d, g, u), by 16-byte stores.
template <class T>
__device__ __forceinline__ void store_columns_gathered(const SwigluDgradParams& p, int64_t row, int64_t col,
                                                       const uint32_t (&acc)[32],
                                                       const uint32_t (&gate)[kPairsPerLoad],
                                                       const uint32_t (&up)[kPairsPerLoad], float prob,
                                                       float& partial) {
  uint32_t dg_pairs[kPairsPerLoad], du_pairs[kPairsPerLoad];
#pragma unroll
  for (int i = 0; i < kPairsPerLoad; ++i) {
    const float2 d = Pair<T>::unpack(Pair<T>::pack(__uint_as_float(acc[2 * i]), __uint_as_float(acc[2 * i + 1])));
    const float2 g = Pair<T>::unpack(gate[i]);
    const float2 u = Pair<T>::unpack(up[i]);
    partial = __fadd_rn(partial, __fmul_rn(d.x, swiglu_forward(g.x, u.x)));
    partial = __fadd_rn(partial, __fmul_rn(d.y, swiglu_forward(g.y, u.y)));
    float dg0, du0, dg1, du1;
    swiglu_backward(__fmul_rn(prob, d.x), g.x, u.x, dg0, du0);
    swiglu_backward(__fmul_rn(prob, d.y), g.y, u.y, dg1, du1);
    dg_pairs[i] = Pair<T>::pack(dg0, dg1);
    du_pairs[i] = Pair<T>::pack(du0, du1);
  }
  auto* dh = static_cast<uint16_t*>(p.dh) + row * 2 * p.ffn + col;
  store_16_pairs(dh, dg_pairs);
  store_16_pairs(dh + p.ffn, du_pairs);
}

// bar.sync of the epilogue warps only (the producer and MMA warps never reach it).
__device__ __forceinline__ void sync_epilogue_warps() {
  asm volatile("bar.sync %0, %1;" ::"r"(kEpilogueBarrier), "r"(kEpilogueThreads) : "memory");
}

// The epilogue warps (4-11): tile row m = 32 (warp % 4) + lane (TMEM lane m), columns
// [first_column, first_column + 64). Every thread runs every tcgen05.ld (they are warp-wide,
// .sync.aligned) and every barrier; only rows < t.rows are loaded from h and stored.
template <class T, ASource kA>
__device__ void drain_accumulators(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles,
                                   int slices) {
  const int warp = threadIdx.x / 32;
  const int quarter = warp % 4;  // the TMEM lane quarter this warp may access
  const int m = 32 * quarter + (threadIdx.x & 31);
  const int half = (warp - kFirstEpilogueWarp) / 4;  // 0: columns [0, 64), 1: [64, 128)
  const int first_column = half * kEpilogueColumns;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    const bool stored = m < t.rows;
    const int64_t row = int64_t(t.row0) + m;
    float prob = 0.0f, partial = 0.0f;
    if constexpr (kA == ASource::Gathered) prob = stored ? __ldg(p.prob_of_row + row) : 0.0f;
    // The first columns' h pairs before the wait: their latency hides behind the mainloop.
    uint32_t gate[kPairsPerLoad], up[kPairsPerLoad];
    if (stored) load_gate_up(p, row, t.n0 + first_column, gate, up);
    wait_accumulator(s.acc_full, acc_ring, "sm100 dgrad epilogue, accumulator full");
    const uint32_t lane_base = tmem_lane_quarter(s.tmem_base, quarter, acc_ring.stage * kAccColumns);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int column = first_column + l * kColumnsPerLoad;
      uint32_t acc[32];
      tmem_load_32(lane_base + column, acc);
      tmem_wait_loads(acc);
      // This thread is done with the buffer: the MMA warp may overwrite it.
      if (l == kLoads - 1) release_accumulator(s.acc_empty, acc_ring.stage);
      if (stored) {
        if constexpr (kA == ASource::Gathered)
          store_columns_gathered<T>(p, row, t.n0 + column, acc, gate, up, prob, partial);
        else
          store_columns<T>(p, row, t.n0 + column, acc, gate, up);
        if (l + 1 < kLoads) load_gate_up(p, row, t.n0 + column + kColumnsPerLoad, gate, up);
      }
    }
    if constexpr (kA == ASource::Gathered) {
      // The row's partial over the slice, lower half + upper half. The buffer alternates with
      // the tiles: its next write (two tiles on) comes after the next tile's barrier, which
      // the reader reaches only after reading this one.
      if (half == 1) s.dprob_upper[acc_ring.stage][m] = partial;
      sync_epilogue_warps();
      if (half == 0 && stored)
        p.dprob_partials[row * slices + t.n0 / kTileN] = __fadd_rn(partial, s.dprob_upper[acc_ring.stage][m]);
    }
    acc_ring.advance();
  }
}

template <class T, ASource kA>
__global__ void __launch_bounds__(kThreads, 1) swiglu_dgrad_sm100_kernel(const __grid_constant__ SwigluDgradParams p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;
  cute::TMEM::Allocator1Sm tmem;

  if (warp == 0) build_tile_prefix<kTileM>(p.offsets, p.experts, p.capacity, s.tile_prefix, s.row_start);
  if (threadIdx.x == 32) {
    // full: drows, the producer's expect_tx arrival; gathered, that plus one per copying
    // thread. empty: one tcgen05.commit.
    init_stage_barriers<kStages>(s.full, s.empty, kA == ASource::Gathered ? 1 + kProducerThreads : 1, 1);
    // acc_full: one tcgen05.commit; acc_empty: every epilogue thread after its last load.
    init_stage_barriers<kAccStages>(s.acc_full, s.acc_empty, 1, kEpilogueThreads);
  }
  if (threadIdx.x == 64) {
    if constexpr (kA == ASource::Tma) cute::prefetch_tma_descriptor(&p.drows_map);  // not encoded when gathered
    cute::prefetch_tma_descriptor(&p.w2_map);
  }
  if (warp == kMmaWarp) allocate_tmem<kTmemColumns>(tmem, &s.tmem_base);
  __syncthreads();
  tmem_fence_after_thread_sync();

  const int slices = p.ffn / kTileN;
  const int total_tiles = s.tile_prefix[p.experts] * slices;
  if (warp < kFirstEpilogueWarp) {
    if constexpr (kA == ASource::Gathered) {
      produce_gathered<T>(p, s, total_tiles, slices);
    } else {
      if (threadIdx.x == 0) produce_tma<T>(p, s, total_tiles, slices);
      __syncwarp();
    }
  } else if (warp < kMmaWarp) {
    drain_accumulators<T, kA>(p, s, total_tiles, slices);
    tmem_fence_before_thread_sync();
  } else {
    issue_mmas<T, kA>(p, s, total_tiles);
  }
  // Every tcgen05.ld has completed (each epilogue thread waited on its own) and every UMMA
  // has (the epilogue waited on each accumulator's commit): TMEM can be freed.
  __syncthreads();
  if (warp == kMmaWarp) free_tmem<kTmemColumns>(tmem, s.tmem_base);
}

template <class T, ASource kA>
capmoe_status_t launch_typed(const SwigluDgradParams& params, int grid, cudaStream_t stream) {
  return launch_large_smem(swiglu_dgrad_sm100_kernel<T, kA>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream,
                           params);
}

}  // namespace

capmoe_status_t launch_swiglu_dgrad_sm100(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                          cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t, ASource::Tma>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t, ASource::Tma>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

capmoe_status_t launch_swiglu_dgrad_gathered_sm100(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                                   cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t, ASource::Gathered>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t, ASource::Gathered>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::fused
