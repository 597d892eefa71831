// capmoe-archs: 100a
// Grouped weight gradient with gathered rows on Blackwell (sm_100a), the contract and results of
// the Hopper kernel (wgrad_gather_sm90.cu, capturable_moe/wgrad_gather.h):
//   dW[e, m, n] = sum over rows r of expert e of A(r)[m] * B(r)[n],
// A(r) = a[r] or a[token_of_row[r]] and B(r) likewise, with the MMA moved to tcgen05 (UMMA)
// and the accumulators to tensor memory (TMEM).
// COMPILED ONLY, NEVER RUN: no Blackwell GPU was available when it was written (docs/fused.md).
// Its layouts are checked on the host (tests/layout/wgrad_sm100_layout.cu); nothing else is.
//
// What is the Hopper kernel's, unchanged (fused/wgrad_tiles.cuh, shared by both):
//  - the tile list: 128 (m) x 256 (n) tiles of one expert, every expert the same
//    m_tiles * n_tiles tiles, CTAs striding over them; K = the expert's rows, in blocks of 64;
//  - the producer: 128 threads copy both operands' K blocks by 16-byte cp.async into
//    128B-swizzled stages at wgrad_smem_offset, zero-filling rows past the expert's end, rows
//    whose token is invalid and columns past M / N, on BOTH operands (a row past offsets[E] may
//    hold NaN, and 0 * NaN is NaN), and arrive on the stage's full barrier when they land;
//  - empty experts: plain output writes dW_e = 0, accumulate leaves it untouched;
//  - the epilogue's arithmetic: each fp32 sum rounded once to Out, or added to dW (F32,
//    accumulate) as acc + old.
//
// What differs, and why:
//  - MMA: one 128x256x16 UMMA (cute's SM100_MMA_F16BF16_SS, cta_group::1, kind::f16) per k16
//    step, both operands MN-major (A(m, k) = a[row k, m], m contiguous; B likewise with n),
//    which kind::f16 allows (the instruction descriptor's transpose bits). The stage layouts
//    are UMMA::tile_to_mma_shape of the MN-major SW128 atom, K first (CUTLASS's sm100
//    collectives tile MN-major operands so): GMMA's atom and the Hopper stage bytes, so the
//    shared producer needs no change (fused/wgrad_gather_sm100_layout.h).
//  - Roles (416 threads = 13 warps), as the sm_100a fc1 and dgrad: warps 0-3 the producer;
//    warps 4-11 the epilogue (warp w reads TMEM lane quarter w % 4: tile rows 32 (w % 4) +
//    lane, and the 128 columns [128 (w / 4 - 1), + 128) of them, four 32-column tcgen05.ld);
//    warp 12 the MMA warp (allocates TMEM; one elected thread issues every UMMA and commit).
//    UMMA needs no registers for accumulators, so the Hopper kernel's two consumer warpgroups
//    (128 fp32 accumulators per thread, the epilogue in the mainloop's warps) become separate
//    roles.
//  - Two TMEM accumulators of 256 fp32 columns (all 512): the epilogue of one tile overlaps the
//    UMMAs of the next, which the Hopper kernel could not do (its consumers store from the
//    registers they accumulate in). acc_full completes by tcgen05.commit, acc_empty after all
//    256 epilogue threads have finished their loads (fused/sm100_pipeline.cuh).
//  - A tile without rows takes no accumulator: the first UMMA of a tile overwrites its
//    accumulator, so a tile with no UMMA would hand over stale TMEM. The MMA warp skips it; the
//    epilogue stores zeros straight from registers (plain) or skips it (accumulate). All three
//    roles decide it from the same locate(), so their rings stay in step.
//  - The producer counts its stage fills and waits, before exiting, until the UMMAs have
//    released every stage (drain_stage_ring): no tcgen05.commit arrival may be due on a barrier
//    of an exited CTA.
//  - Stores: a thread holds 32 consecutive columns of one dW row per load, so they go out as
//    16-byte stores (4 per load for 16-bit dW, 8 for fp32), each of 8 or 4 columns, all in or
//    all out of N (a multiple of 8).
// Ordering rules (fused/sm100_pipeline.cuh, docs/fused.md): fence.proxy.async by the MMA warp
// after each full barrier (the stages came through the generic proxy), tcgen05 fences around
// every mbarrier hand-off of TMEM, tcgen05.wait::ld before loaded registers are used or the
// buffer released, TMEM freed after the CTA's final barrier.
// Shared memory: 4 stages x 48 KB (A 16 KB + B 32 KB) + barriers, 198,656 B with the alignment
// slack; one CTA per SM, so tcgen05.alloc of all 512 columns never waits on a second CTA of
// this kernel. ptxas (nvcc 13.0): 72 registers (16-bit dW) / 74 (fp32 dW), 0 spills, 0 stack.
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <type_traits>

#include "common/launch.cuh"
#include "fused/epilogue.cuh"
#include "fused/launch_large_smem.cuh"
#include "fused/pipeline.cuh"
#include "fused/sm100_pipeline.cuh"
#include "fused/wgrad_gather_launch.h"
#include "fused/wgrad_gather_sm100_layout.h"
#include "fused/wgrad_tiles.cuh"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kWgradSm100TileM;
constexpr int kTileN = kWgradSm100TileN;
constexpr int kTileK = kWgradSm100TileK;
constexpr int kStages = kWgradSm100Stages;
using namespace sm100_roles;  // kThreads, the role warps, kAccStages, kColumnsPerLoad
constexpr int kAccColumns = kTileN;  // fp32 TMEM columns of one accumulator
constexpr int kTmemColumns = kAccStages * kAccColumns;
constexpr int kEpilogueColumns = kTileN / (kEpilogueWarps / 4);  // columns per thread
constexpr int kLoads = kEpilogueColumns / kColumnsPerLoad;

static_assert(kWgradProducerThreads == kProducerThreads, "the shared producer (fused/wgrad_tiles.cuh) is warps 0-3");
static_assert(kTileM == kWgradTileM && kTileN == kWgradTileN && kTileK == kWgradTileK,
              "the shared tile list and producer's tile (fused/wgrad_tiles.cuh)");
static_assert(kTmemColumns == 512, "two accumulators fill TMEM (tcgen05.alloc: a power of 2, 32 ..= 512)");
static_assert(kEpilogueColumns % kColumnsPerLoad == 0, "whole tcgen05.ld loads per thread");

template <class T>
struct Kernel {
  using Layout = WgradSm100Layout<T>;
  using TiledMma = typename Layout::TiledMma;
  using SmemLayoutA = typename Layout::SmemA;
  using SmemLayoutB = typename Layout::SmemB;
  using AccShape = typename Layout::AccShape;

  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kTileN * kTileK;

  // What the producer writes must be what the UMMA descriptors read: wgrad_smem_offset is the
  // MN-major 128B-swizzle atom (64 values x 8 K rows, GMMA's and UMMA's alike) tiled K first,
  // 64-value column chunks 8 KB apart. Checked here before the swizzle (a function of the
  // address), and in full against cute on the host by tests/layout/wgrad_sm100_layout.cu.
  static_assert(std::is_same_v<UMMA::Layout_MN_SW128_Atom<T>, GMMA::Layout_MN_SW128_Atom<T>>,
                "UMMA's MN-major SW128 atom is GMMA's: wgrad_smem_offset holds for both");
  static_assert(kTileK * sizeof(T) == 128, "one 64-value column chunk is one 128-byte swizzle row");
  template <class L, int kStageElems>
  static constexpr bool kStagePlain =
      L{}(make_coord(make_coord(_1{}, _0{}), _0{}, _0{}, _0{})) == 1 &&              // m (n) contiguous
      L{}(make_coord(make_coord(_0{}, _1{}), _0{}, _0{}, _0{})) == 64 &&             // K row = 64 values
      L{}(make_coord(make_coord(_0{}, _0{}), _0{}, _1{}, _0{})) == 16 * 64 &&        // k16 steps
      L{}(make_coord(make_coord(Int<64>{}, _0{}), _0{}, _0{}, _0{})) == 64 * 64 &&   // next chunk after 64 K rows
      L{}(make_coord(make_coord(_0{}, _0{}), _0{}, _0{}, _1{})) == kStageElems;      // dense stages
  static_assert(kStagePlain<decltype(get_nonswizzle_portion(SmemLayoutA{})), kStageElemsA>, "A stage layout");
  static_assert(kStagePlain<decltype(get_nonswizzle_portion(SmemLayoutB{})), kStageElemsB>, "B stage layout");
  static_assert(cosize_v<SmemLayoutA> == kStageElemsA * kStages, "A stages are dense, one after another");
  static_assert(cosize_v<SmemLayoutB> == kStageElemsB * kStages, "B stages are dense, one after another");

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    uint64_t acc_full[kAccStages];
    uint64_t acc_empty[kAccStages];
    uint32_t tmem_base;  // tcgen05.alloc writes it
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_100a allows 227 KB of dynamic shared memory per CTA");
  // The whole TMEM is taken: a second CTA on the SM would wait in tcgen05.alloc.
  static_assert(2 * kSmemBytes > 228 * 1024, "one CTA per SM");
};

// The producer warps (0-3): the shared loop, then the tail: wait until the UMMAs have released
// every stage it filled.
template <class T>
__device__ void produce(const WgradGatherParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  const int64_t fills = produce_wgrad_stages<T, kStages>(p, reinterpret_cast<uint8_t*>(s.a),
                                                         reinterpret_cast<uint8_t*>(s.b), s.full, s.empty, total_tiles);
  drain_stage_ring<kStages>(s.empty, fills, "sm100 wgrad producer tail, empty");
}

// The MMA warp (fused/sm100_pipeline.cuh's per-tile body): four k16 UMMAs per K block, each
// stage fenced first (cp.async wrote it through the generic proxy). Tiles without rows are
// the epilogue's alone.
template <class T>
__device__ void issue_mmas(const WgradGatherParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  using K = Kernel<T>;
  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});  // ((128,16),1,4,stage)
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});  // ((256,16),1,4,stage)
  auto thr = mma.get_slice(0);
  Tensor tCrA = thr.make_fragment_A(sA);  // UMMA shared-memory descriptors
  Tensor tCrB = thr.make_fragment_B(sB);
  Tensor acc = K::TiledMma::make_fragment_C(typename K::AccShape{});  // ((128,256),1,1) in TMEM
  static_assert(size<2>(decltype(tCrA){}) == kTileK / 16 && size<2>(decltype(tCrB){}) == kTileK / 16,
                "four k16 UMMAs per K block");
  static_assert(size<1>(decltype(tCrA){}) == 1 && size<1>(decltype(tCrB){}) == 1, "one UMMA covers the tile");
  StageRing<kStages> ring;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const int k_blocks = locate(p, tile).k_blocks();
    if (k_blocks == 0) continue;
    issue_umma_tile<kStages, kAccStages, kAccColumns, true>(mma, tCrA, tCrB, acc, s.full, s.empty, s.acc_full,
                                                            s.acc_empty, s.tmem_base, ring, acc_ring, k_blocks);
  }
}

// 32 consecutive columns [n, n + 32) of one dW row (row points at its column 0): rounded to
// Out, or for an fp32 dW with accumulate added to what it holds (acc + old, the Hopper
// kernel's order). 16-byte stores of 8 (16-bit) or 4 (fp32) columns, each all in or all out
// of N (a multiple of 8); dW rows start 16-byte aligned (N a multiple of 8).
template <class Out>
__device__ __forceinline__ void store_columns(const WgradGatherParams& p, Out* row, int n, const uint32_t (&v)[32]) {
  if constexpr (std::is_same_v<Out, float>) {
    float4* at = reinterpret_cast<float4*>(row + n);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (n + 4 * i >= p.n) break;
      float4 x = make_float4(__uint_as_float(v[4 * i]), __uint_as_float(v[4 * i + 1]), __uint_as_float(v[4 * i + 2]),
                             __uint_as_float(v[4 * i + 3]));
      if (p.accumulate) {
        const float4 old = at[i];
        x.x += old.x;
        x.y += old.y;
        x.z += old.z;
        x.w += old.w;
      }
      at[i] = x;
    }
  } else {
    uint4* at = reinterpret_cast<uint4*>(row + n);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (n + 8 * i >= p.n) break;
      const uint32_t* c = v + 8 * i;
      at[i] = make_uint4(pack2<Out>(__uint_as_float(c[0]), __uint_as_float(c[1])),
                         pack2<Out>(__uint_as_float(c[2]), __uint_as_float(c[3])),
                         pack2<Out>(__uint_as_float(c[4]), __uint_as_float(c[5])),
                         pack2<Out>(__uint_as_float(c[6]), __uint_as_float(c[7])));
    }
  }
}

// The epilogue warps (4-11): dW row m0 + 32 (warp % 4) + lane (TMEM lane 32 (warp % 4) +
// lane), columns [n0 + first_column, + 128). Every thread runs every tcgen05.ld (warp-wide,
// .sync.aligned) and every barrier; only rows < M are stored.
template <class T, class Out>
__device__ void drain_accumulators(const WgradGatherParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  const int warp = threadIdx.x / 32;
  const int quarter = warp % 4;  // the TMEM lane quarter this warp may access
  const int tile_row = 32 * quarter + (threadIdx.x & 31);
  const int first_column = ((warp - kFirstEpilogueWarp) / 4) * kEpilogueColumns;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const WgradTile t = locate(p, tile);
    const int m = t.m0 + tile_row;
    const bool stored = m < p.m;
    Out* row = static_cast<Out*>(p.dw) + (int64_t(t.expert) * p.m + m) * p.n;
    if (t.k_blocks() == 0) {
      // No accumulator (the MMA warp skipped the tile): dW_e = 0, or untouched when accumulating.
      if (stored && !p.accumulate) {
        const uint32_t zeros[32] = {};
#pragma unroll
        for (int l = 0; l < kLoads; ++l) store_columns<Out>(p, row, t.n0 + first_column + l * kColumnsPerLoad, zeros);
      }
      continue;
    }
    wait_accumulator(s.acc_full, acc_ring, "sm100 wgrad epilogue, accumulator full");
    const uint32_t lane_base = tmem_lane_quarter(s.tmem_base, quarter, acc_ring.stage * kAccColumns);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int column = first_column + l * kColumnsPerLoad;
      uint32_t v[32];
      tmem_load_32(lane_base + column, v);
      tmem_wait_loads(v);
      // This thread is done with the buffer: the MMA warp may overwrite it.
      if (l == kLoads - 1) release_accumulator(s.acc_empty, acc_ring.stage);
      if (stored) store_columns<Out>(p, row, t.n0 + column, v);
    }
    acc_ring.advance();
  }
}

template <class T, class Out>
__global__ void __launch_bounds__(kThreads, 1) wgrad_gather_sm100_kernel(const __grid_constant__ WgradGatherParams p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;
  cute::TMEM::Allocator1Sm tmem;

  if (threadIdx.x == 32) {
    // full: one noinc arrival per producer thread; empty: one tcgen05.commit.
    init_stage_barriers<kStages>(s.full, s.empty, kProducerThreads, 1);
    // acc_full: one tcgen05.commit; acc_empty: every epilogue thread after its last load.
    init_stage_barriers<kAccStages>(s.acc_full, s.acc_empty, 1, kEpilogueThreads);
  }
  if (warp == kMmaWarp) allocate_tmem<kTmemColumns>(tmem, &s.tmem_base);
  __syncthreads();
  tmem_fence_after_thread_sync();

  const int total_tiles = p.experts * p.m_tiles * p.n_tiles;  // <= INT32_MAX (host check)
  if (warp < kFirstEpilogueWarp) {
    produce<T>(p, s, total_tiles);
  } else if (warp < kMmaWarp) {
    drain_accumulators<T, Out>(p, s, total_tiles);
    tmem_fence_before_thread_sync();
  } else {
    issue_mmas<T>(p, s, total_tiles);
  }
  // Every tcgen05.ld has completed (each epilogue thread waited on its own) and every UMMA
  // has (the epilogue waited on each accumulator's commit): TMEM can be freed.
  __syncthreads();
  if (warp == kMmaWarp) free_tmem<kTmemColumns>(tmem, s.tmem_base);
}

template <class T, class Out>
capmoe_status_t launch_typed(const WgradGatherParams& params, int grid, cudaStream_t stream) {
  return launch_large_smem(wgrad_gather_sm100_kernel<T, Out>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream,
                           params);
}

}  // namespace

capmoe_status_t launch_wgrad_gather_sm100(const WgradGatherParams& params, capmoe_dtype_t dtype,
                                          capmoe_dtype_t out_dtype, int grid, cudaStream_t stream) {
  return dispatch_wgrad_types(dtype, out_dtype, [&](auto in, auto out) {
    return launch_typed<decltype(in), decltype(out)>(params, grid, stream);
  });
}

}  // namespace capmoe::fused
