// capmoe-archs: 100a
// Fused fc1 of the expert path on Blackwell (sm_100a): act = SwiGLU(gather(x) @ W1_e^T), the
// contract and the bits of the Hopper kernel (fc1_sm90.cu, capturable_moe/fused.h) with the MMA
// moved to tcgen05 (UMMA) and the accumulators to tensor memory (TMEM).
// COMPILED ONLY, NEVER RUN: no Blackwell GPU was available when it was written (docs/fused.md).
//
// Tiles, tile list and epilogue math are the Hopper kernel's: 128 routing rows of one expert x
// 128 act columns; the B tile stacks W1_e's gate rows [n0, n0 + 128) over its up rows
// [F + n0, F + n0 + 128), so one 128x256x16 UMMA per k16 step leaves gate column c of tile row
// m in TMEM lane m, column c, and up column c in lane m, column 128 + c: SwiGLU stays
// elementwise per thread once the epilogue has loaded its lane.
//
// Roles (416 threads = 13 warps):
//  - warps 0-3, the producer: the Hopper kernel's CP_ASYNC gather loop (produce_gathered_a in
//    fused/gather_rows.cuh: 16-byte chunks at fc1_smem_offset, four whole rows per warp-wide
//    copy, invalid tokens zero-filled, rows past the expert's end not loaded); thread 0 also
//    loads the W1 tile by TMA; the tiles come in the static order (StridedTiles,
//    fused/tile_source.cuh), which the tail below counts on;
//  - warps 4-11, the epilogue: a warp may read only TMEM lanes [32 (w % 4), 32 (w % 4) + 32)
//    (a warp's tcgen05.ld reaches the lane quarter of its rank in its warpgroup), so warp w
//    takes tile rows 32 (w % 4) + lane and act columns [64 (w / 4 - 1), 64 (w / 4 - 1) + 64);
//  - warp 12, the MMA warp: allocates TMEM, and one elected thread issues every tcgen05.mma
//    and tcgen05.commit.
// Pipelines, TMEM hand-offs and the ordering rules they keep: fused/sm100_pipeline.cuh (shared
// with the dgrad's sm_100a kernel). Two TMEM accumulators of 256 fp32 columns fill all 512; the
// launch's 206,848 B of shared memory keeps one CTA per SM, so tcgen05.alloc never waits on a
// second CTA of this kernel.
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
#include "fused/epilogue.cuh"
#include "fused/fc1_launch.h"
#include "fused/fc1_sm100_layout.h"
#include "fused/gather_rows.cuh"
#include "fused/pipeline.cuh"
#include "fused/sm100_pipeline.cuh"
#include "fused/tile_list.cuh"
#include "fused/tma_loads.cuh"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kFc1Sm100TileM;
constexpr int kTileN = kFc1Sm100TileN;  // act columns per tile (B holds 2x)
constexpr int kTileK = kFc1Sm100TileK;  // 64 16-bit elements = one 128-byte row
constexpr int kStages = kFc1Sm100Stages;
using namespace sm100_roles;  // kThreads, the role warps, kAccStages, kColumnsPerLoad
constexpr int kAccColumns = 2 * kTileN;  // fp32 TMEM columns of one accumulator: gate | up
constexpr int kTmemColumns = kAccStages * kAccColumns;
constexpr int kEpilogueColumns = kTileN / (kEpilogueWarps / 4);  // act columns per thread

static_assert(GatherRows<kTileM>::kThreads == kProducerThreads, "the gather's thread -> (row, chunk) map covers the tile");
static_assert(kTmemColumns == 512, "two accumulators fill TMEM (tcgen05.alloc: a power of 2, 32 ..= 512)");
static_assert(kEpilogueColumns % kColumnsPerLoad == 0, "whole tcgen05.ld loads per thread");

template <class T>
struct Kernel {
  // One 128x256x16 UMMA per k16 step, A and B K-major in shared memory, fp32 accumulators.
  using TiledMma = typename Fc1Sm100Layout<T>::TiledMma;
  using MmaShapeA = typename Fc1Sm100Layout<T>::MmaShapeA;
  using MmaShapeB = typename Fc1Sm100Layout<T>::MmaShapeB;
  using SmemLayoutA = typename Fc1Sm100Layout<T>::SmemA;
  using SmemLayoutB = typename Fc1Sm100Layout<T>::SmemB;
  using AccShape = typename Fc1Sm100Layout<T>::AccShape;

  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = 2 * kTileN * kTileK;
  static constexpr uint32_t kBytesB = kStageElemsB * sizeof(T);

  // What the producers write must be what the UMMA descriptors read. The cp.async chunks land
  // at fc1_smem_offset and the W1 boxes at row * 128 B of a 1024-byte aligned stage, both in
  // the K-major 128B-swizzle atom that GMMA (Hopper) and UMMA share; the full (row, k, stage)
  // maps, and the accumulator's TMEM layout, are compared with cute's on the host by
  // tests/layout/fc1_sm100_layout.cu.
  static_assert(std::is_same_v<UMMA::Layout_K_SW128_Atom<T>, GMMA::Layout_K_SW128_Atom<T>>,
                "UMMA's K-major SW128 atom is GMMA's: fc1_smem_offset holds for both");
  static_assert(kTileK * sizeof(T) == 128, "one K block is one 128-byte swizzle row");
  static_assert(cosize_v<SmemLayoutA> == kStageElemsA * kStages, "A stages are dense, one after another");
  static_assert(cosize_v<SmemLayoutB> == kStageElemsB * kStages, "B stages are dense, one after another");
  static_assert(size<2>(MmaShapeA{}) == kTileK / 16 && size<2>(MmaShapeB{}) == kTileK / 16,
                "four k16 UMMAs per K block");
  static_assert(size<1>(MmaShapeA{}) == 1 && size<1>(MmaShapeB{}) == 1, "one UMMA covers the whole tile");

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t acc_full[kAccStages];
    uint64_t acc_empty[kAccStages];
    uint32_t tmem_base;                                 // tcgen05.alloc writes it
    int32_t tile_prefix[CAPMOE_FUSED_MAX_EXPERTS + 1];  // M tiles of the experts before e
    int32_t row_start[CAPMOE_FUSED_MAX_EXPERTS + 1];    // first row of expert e (clamped)
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_100a allows 227 KB of dynamic shared memory per CTA");
  // The whole TMEM is taken: a second CTA on the SM would wait in tcgen05.alloc.
  static_assert(2 * kSmemBytes > 228 * 1024, "one CTA per SM");
};

__device__ __forceinline__ Tile locate_tile(int tile, int slices, const int32_t* tile_prefix, const int32_t* row_start,
                                            int experts) {
  return locate<kTileM, kTileN>(tile, slices, tile_prefix, row_start, experts);
}

// The B tile of a stage: gate rows [n0, n0 + 128) over up rows [F + n0, ...) of W1_e.
template <class T>
__device__ __forceinline__ void load_weights(const Fc1Params& p, typename Kernel<T>::Shared& s, int stage, const Tile& t,
                                             int k0) {
  load_w1_tile<kTileN, kTileK>(p, &s.full[stage], s.b + stage * Kernel<T>::kStageElemsB, t, k0);
}

// The producer warpgroup (threads 0-127): the Hopper kernel's gathered producer loop, then a
// wait until the UMMAs have released every stage: no thread may exit with a tcgen05.commit
// arrival still due on this CTA's barriers (a stage never filled passes at once).
template <class T>
__device__ void produce(const Fc1Params& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  produce_gathered_a<kTileM, kTileK, kStages>(
      p.x, p.hidden, p.max_tokens, p.token_of_row, s.full, s.empty, s.a, Kernel<T>::kBytesB, total_tiles,
      StridedTiles{}, [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      [&](int stage, const Tile& t, int k0) { load_weights<T>(p, s, stage, t, k0); });
  // Where the loop left the ring: one fill per (tile of this CTA, K block).
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  drain_stage_ring<kStages>(s.empty, int64_t(cta_tiles(total_tiles)) * k_blocks, "sm100 fc1 producer tail, empty");
}

// The MMA warp (fused/sm100_pipeline.cuh's loop): four k16 UMMAs per K block; the A rows came
// through the generic proxy (cp.async), so each stage is fenced before its UMMAs read it.
template <class T>
__device__ void issue_mmas(const Fc1Params& p, typename Kernel<T>::Shared& s, int total_tiles) {
  using K = Kernel<T>;
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});  // ((128,16),1,4,stage)
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});  // ((256,16),1,4,stage)
  auto thr = mma.get_slice(0);
  Tensor tCrA = thr.make_fragment_A(sA);  // UMMA shared-memory descriptors
  Tensor tCrB = thr.make_fragment_B(sB);
  Tensor acc = K::TiledMma::make_fragment_C(typename K::AccShape{});  // ((128,256),1,1) in TMEM
  issue_umma_tiles<kStages, kAccStages, kAccColumns, true>(mma, tCrA, tCrB, acc, s.full, s.empty, s.acc_full,
                                                            s.acc_empty, s.tmem_base, total_tiles, k_blocks);
}

// 32 columns of one row, the Hopper epilogue's math (store_tile in fc1_sm90.cu): gate and up
// rounded to T, act = silu(g) * u in fp32 (capmoe_routing_swiglu's), times the route
// probability when weighted, rounded once; h = [g | u] when requested. 64-byte runs per
// output row (16-byte stores): col is a multiple of 32 and F of 128.
template <class T>
__device__ __forceinline__ void store_columns(const Fc1Params& p, int64_t row, int64_t col, const uint32_t (&gate)[32],
                                              const uint32_t (&up)[32], float prob) {
  uint32_t act_pairs[16], gate_pairs[16], up_pairs[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const Fc1Pairs out = fc1_pairs<T>(__uint_as_float(gate[2 * i]), __uint_as_float(gate[2 * i + 1]),
                                      __uint_as_float(up[2 * i]), __uint_as_float(up[2 * i + 1]),
                                      p.prob_of_row != nullptr, prob);
    act_pairs[i] = out.act;
    gate_pairs[i] = out.gate;
    up_pairs[i] = out.up;
  }
  T* act = static_cast<T*>(p.act);
  T* h = static_cast<T*>(p.h);
  store_16_pairs(act + row * p.ffn + col, act_pairs);
  if (h != nullptr) {
    store_16_pairs(h + row * 2 * p.ffn + col, gate_pairs);
    store_16_pairs(h + row * 2 * p.ffn + p.ffn + col, up_pairs);
  }
}

// The epilogue warps (4-11): tile row m = 32 (warp % 4) + lane (TMEM lane m), act columns
// [first_column, first_column + 64). Every thread runs every tcgen05.ld (they are warp-wide,
// .sync.aligned); only rows < t.rows are stored.
template <class T>
__device__ void drain_accumulators(const Fc1Params& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  const int warp = threadIdx.x / 32;
  const int quarter = warp % 4;  // the TMEM lane quarter this warp may access
  const int m = 32 * quarter + (threadIdx.x & 31);
  const int first_column = ((warp - kFirstEpilogueWarp) / 4) * kEpilogueColumns;
  constexpr int kLoads = kEpilogueColumns / kColumnsPerLoad;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    const bool stored = m < t.rows;
    const int64_t row = int64_t(t.row0) + m;
    const float prob = stored && p.prob_of_row != nullptr ? __ldg(p.prob_of_row + row) : 1.0f;
    wait_accumulator(s.acc_full, acc_ring, "sm100 fc1 epilogue, accumulator full");
    const uint32_t lane_base = tmem_lane_quarter(s.tmem_base, quarter, acc_ring.stage * kAccColumns);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int column = first_column + l * kColumnsPerLoad;
      uint32_t gate[32], up[32];
      tmem_load_32(lane_base + column, gate);
      tmem_load_32(lane_base + kTileN + column, up);
      tmem_wait_loads(gate, up);
      // This thread is done with the buffer: the MMA warp may overwrite it.
      if (l == kLoads - 1) release_accumulator(s.acc_empty, acc_ring.stage);
      if (stored) store_columns<T>(p, row, t.n0 + column, gate, up, prob);
    }
    acc_ring.advance();
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) fc1_swiglu_sm100_kernel(const __grid_constant__ Fc1Params p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;
  cute::TMEM::Allocator1Sm tmem;

  if (warp == 0) build_tile_prefix<kTileM>(p.offsets, p.experts, p.capacity, s.tile_prefix, s.row_start);
  if (threadIdx.x == 32) {
    // full: the W1 expect_tx arrival plus one per copying thread; empty: one tcgen05.commit.
    init_stage_barriers<kStages>(s.full, s.empty, 1 + kProducerThreads, 1);
    // acc_full: one tcgen05.commit; acc_empty: every epilogue thread after its last load.
    init_stage_barriers<kAccStages>(s.acc_full, s.acc_empty, 1, kEpilogueThreads);
  }
  if (threadIdx.x == 64) cute::prefetch_tma_descriptor(&p.w1_map);
  if (warp == kMmaWarp) allocate_tmem<kTmemColumns>(tmem, &s.tmem_base);
  __syncthreads();
  tmem_fence_after_thread_sync();

  const int slices = p.ffn / kTileN;
  const int total_tiles = s.tile_prefix[p.experts] * slices;
  if (warp < kFirstEpilogueWarp) {
    produce<T>(p, s, total_tiles, slices);
  } else if (warp < kMmaWarp) {
    drain_accumulators<T>(p, s, total_tiles, slices);
    tmem_fence_before_thread_sync();
  } else {
    issue_mmas<T>(p, s, total_tiles);
  }
  // Every tcgen05.ld has completed (each epilogue thread waited on its own) and every UMMA
  // has (the epilogue waited on each accumulator's commit): TMEM can be freed.
  __syncthreads();
  if (warp == kMmaWarp) free_tmem<kTmemColumns>(tmem, s.tmem_base);
}

template <class T>
capmoe_status_t launch_typed(const Fc1Params& params, int grid, cudaStream_t stream) {
  return launch_large_smem(fc1_swiglu_sm100_kernel<T>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream, params);
}

}  // namespace

capmoe_status_t launch_fc1_sm100(const Fc1Params& params, capmoe_dtype_t dtype, int grid, cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::fused
