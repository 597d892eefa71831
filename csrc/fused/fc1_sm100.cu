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
//    loads the W1 tile by TMA. No TMA_ROWS form here: its per-row 128-byte boxes are unproven
//    on Hopper already, and on Blackwell nothing could test them (fc1.cu refuses it on 10.0);
//  - warps 4-11, the epilogue: a warp may read only TMEM lanes [32 (w % 4), 32 (w % 4) + 32)
//    (a warp's tcgen05.ld reaches the lane quarter of its rank in its warpgroup), so warp w
//    takes tile rows 32 (w % 4) + lane and act columns [64 (w / 4 - 1), 64 (w / 4 - 1) + 64);
//  - warp 12, the MMA warp: allocates TMEM, and one elected thread issues every tcgen05.mma
//    and tcgen05.commit.
// Pipelines: the shared-memory stage ring (fused/pipeline.cuh; a stage goes back to the
// producer through tcgen05.commit, when the UMMAs that read it have completed), and a ring of
// two TMEM accumulators (2 x 256 fp32 columns = all 512), so the epilogue of one tile overlaps
// the mainloop of the next: acc_full completes by tcgen05.commit after a tile's last UMMA;
// acc_empty after every epilogue thread has finished its tcgen05.ld of that buffer.
//
// Ordering rules this file relies on (PTX ISA, tcgen05 memory consistency):
//  - cp.async writes the A rows through the generic proxy and tcgen05.mma reads shared memory
//    through the async proxy: the MMA warp runs fence.proxy.async after the stage's full
//    barrier completes (which it does once every copy has landed) and before its UMMAs, as the
//    Hopper consumers do before wgmma (mma_k_blocks<true>);
//  - TMEM handed between threads through an mbarrier: tcgen05.fence::before_thread_sync before
//    the arrive, tcgen05.fence::after_thread_sync after the wait (both ways: epilogue -> MMA
//    for a free buffer, MMA -> epilogue is the commit's own arrive, then after_thread_sync);
//  - tcgen05.wait::ld before any register of a tcgen05.ld is read or the buffer released;
//  - no thread exits while a tcgen05.commit arrival on one of its barriers is still due: the
//    producer waits for every stage's release before leaving, the epilogue for every
//    accumulator's;
//  - one warp allocates (all 512 columns; the launch's 206,848 B of shared memory keeps one CTA
//    per SM), relinquishes the allocation permit at once, and frees after the final CTA
//    barrier, which every epilogue thread reaches after its last tcgen05.wait::ld.
//    A kernel running concurrently on the same SM that holds TMEM would make tcgen05.alloc
//    wait until it frees it.
#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm100_umma.hpp>
#include <cute/arch/tmem_allocator_sm100.hpp>
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <type_traits>

#include "common/launch.cuh"
#include "common/swiglu_math.cuh"
#include "fused/epilogue.cuh"
#include "fused/fc1_launch.h"
#include "fused/fc1_sm100_layout.h"
#include "fused/gather_rows.cuh"
#include "fused/pipeline.cuh"
#include "fused/tile_list.cuh"

// The device pass must have the tcgen05 instructions: without them cute compiles its UMMA and
// TMEM wrappers to traps, and the kernel would build and then fail at run time.
#if defined(__CUDA_ARCH__) && \
    !(defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED) && defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED))
#error "fc1_sm100.cu needs sm_100a (tcgen05 MMA and TMEM); compile it for compute_100a only"
#endif

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kFc1Sm100TileM;
constexpr int kTileN = kFc1Sm100TileN;  // act columns per tile (B holds 2x)
constexpr int kTileK = kFc1Sm100TileK;  // 64 16-bit elements = one 128-byte row
constexpr int kStages = kFc1Sm100Stages;
constexpr int kAccStages = 2;                // TMEM accumulator buffers
constexpr int kAccColumns = 2 * kTileN;      // fp32 TMEM columns of one accumulator: gate | up
constexpr int kTmemColumns = kAccStages * kAccColumns;
constexpr int kProducerThreads = 128;  // warps 0-3 (produce_gathered_a indexes by threadIdx.x)
constexpr int kEpilogueWarps = 8;
constexpr int kEpilogueThreads = 32 * kEpilogueWarps;
constexpr int kFirstEpilogueWarp = kProducerThreads / 32;
constexpr int kMmaWarp = kFirstEpilogueWarp + kEpilogueWarps;
constexpr int kThreads = 32 * (kMmaWarp + 1);
constexpr int kColumnsPerLoad = 32;  // one tcgen05.ld 32x32b.x32: 32 fp32 columns of a lane
constexpr int kEpilogueColumns = kTileN / (kEpilogueWarps / 4);  // act columns per thread
constexpr uint64_t kEvictNormal = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);

static_assert(kThreads == 416 && kMmaWarp == 12, "roles: 8 epilogue warps, 4 producer warps, 1 MMA warp");
static_assert(GatherRows<kTileM>::kThreads == kProducerThreads, "the gather's thread -> (row, chunk) map covers the tile");
static_assert(kEpilogueWarps % 4 == 0 && kFirstEpilogueWarp % 4 == 0,
              "the epilogue is whole warpgroups, each covering all 128 TMEM lanes, a quarter per warp");
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

__device__ __forceinline__ void tmem_fence_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tmem_fence_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

__device__ __forceinline__ Tile locate_tile(int tile, int slices, const int32_t* tile_prefix, const int32_t* row_start,
                                            int experts) {
  return locate<kTileM, kTileN>(tile, slices, tile_prefix, row_start, experts);
}

// The B tile of a stage: gate rows [n0, n0 + 128) over up rows [F + n0, ...) of W1_e.
template <class T>
__device__ __forceinline__ void load_weights(const Fc1Params& p, typename Kernel<T>::Shared& s, int stage, const Tile& t,
                                             int k0) {
  using K = Kernel<T>;
  T* b = s.b + stage * K::kStageElemsB;
  SM90_TMA_LOAD_3D::copy(&p.w1_map, &s.full[stage], kEvictNormal, b, k0, t.n0, t.expert);
  SM90_TMA_LOAD_3D::copy(&p.w1_map, &s.full[stage], kEvictNormal, b + kTileN * kTileK, k0, p.ffn + t.n0, t.expert);
}

// The producer warpgroup (threads 0-127): the Hopper kernel's gathered producer loop, then a
// wait until the UMMAs have released every stage: no thread may exit with a tcgen05.commit
// arrival still due on this CTA's barriers (a stage never filled passes at once).
template <class T>
__device__ void produce(const Fc1Params& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  produce_gathered_a<kTileM, kTileK, kStages>(
      p.x, p.hidden, p.max_tokens, p.token_of_row, s.full, s.empty, s.a, Kernel<T>::kBytesB, total_tiles,
      [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      [&](int stage, const Tile& t, int k0) { load_weights<T>(p, s, stage, t, k0); });
  // Where the loop left the ring: one fill per (tile of this CTA, K block).
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;
  const int tiles = int(blockIdx.x) < total_tiles ? (total_tiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
  const int64_t fills = int64_t(tiles) * k_blocks;
  StageRing<kStages> ring;
  ring.stage = int(fills % kStages);
  ring.phase = uint32_t(fills / kStages) & 1u;
  for (int i = 0; i < kStages; ++i) {
    wait_barrier(&s.empty[ring.stage], ring.phase ^ 1, "sm100 fc1 producer tail, empty");
    ring.advance();
  }
}

// The MMA warp: per tile, waits for a free accumulator, then per K block for the stage, and
// issues its four k16 UMMAs from one elected thread (cute's SM100 atom elects inside; the
// commits below elect the same lane, so they track that thread's UMMAs).
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
  StageRing<kStages> ring;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    wait_barrier(&s.acc_empty[acc_ring.stage], acc_ring.phase ^ 1, "sm100 fc1 MMA warp, accumulator empty");
    tmem_fence_after_thread_sync();
    acc.data() = s.tmem_base + uint32_t(acc_ring.stage * kAccColumns);
    mma.accumulate_ = UMMA::ScaleOut::Zero;
    for (int kb = 0; kb < k_blocks; ++kb) {
      wait_barrier(&s.full[ring.stage], ring.phase, "sm100 fc1 MMA warp, full");
      // The A rows came through the generic proxy (cp.async); the UMMAs read the async one.
      cutlass::arch::fence_view_async_shared();
#pragma unroll
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(mma, tCrA(_, _, k, ring.stage), tCrB(_, _, k, ring.stage), acc);
        mma.accumulate_ = UMMA::ScaleOut::One;
      }
      // The stage goes back to the producer once these UMMAs have read it.
      cutlass::arch::umma_arrive(&s.empty[ring.stage]);
      ring.advance();
    }
    // The accumulator is complete once every UMMA issued so far has.
    cutlass::arch::umma_arrive(&s.acc_full[acc_ring.stage]);
    acc_ring.advance();
  }
}

// 32 consecutive fp32 TMEM columns of this thread's lane (its warp's lane quarter).
__device__ __forceinline__ void tmem_load_32(uint32_t address, uint32_t (&v)[32]) {
  SM100_TMEM_LOAD_32dp32b32x::copy(address, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11],
                                   v[12], v[13], v[14], v[15], v[16], v[17], v[18], v[19], v[20], v[21], v[22], v[23],
                                   v[24], v[25], v[26], v[27], v[28], v[29], v[30], v[31]);
}

// Ties every register of a tcgen05.ld to the point after tcgen05.wait::ld: the load's asm
// does not say its outputs are valid only after the wait, so without this the compiler could
// schedule their uses between the two. Each empty asm is volatile (kept after the wait's, also
// volatile) and redefines its register.
__device__ __forceinline__ void after_tmem_wait(uint32_t (&v)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(v[i]));
}

__device__ __forceinline__ void store_16_pairs(void* dst, const uint32_t (&pairs)[16]) {
  uint4* out = static_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = make_uint4(pairs[4 * i], pairs[4 * i + 1], pairs[4 * i + 2], pairs[4 * i + 3]);
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
    const float g0 = float(T(__uint_as_float(gate[2 * i]))), g1 = float(T(__uint_as_float(gate[2 * i + 1])));
    const float u0 = float(T(__uint_as_float(up[2 * i]))), u1 = float(T(__uint_as_float(up[2 * i + 1])));
    float a0 = swiglu_forward(g0, u0), a1 = swiglu_forward(g1, u1);
    if (p.prob_of_row != nullptr) {
      a0 = __fmul_rn(prob, a0);
      a1 = __fmul_rn(prob, a1);
    }
    act_pairs[i] = pack2<T>(a0, a1);
    gate_pairs[i] = pack2<T>(g0, g1);
    up_pairs[i] = pack2<T>(u0, u1);
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
  using Barrier = cutlass::arch::ClusterBarrier;
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
    wait_barrier(&s.acc_full[acc_ring.stage], acc_ring.phase, "sm100 fc1 epilogue, accumulator full");
    tmem_fence_after_thread_sync();
    // TMEM address: lane in bits [31:16], column in [15:0].
    const uint32_t lane_base = s.tmem_base + (uint32_t(32 * quarter) << 16) + uint32_t(acc_ring.stage * kAccColumns);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int column = first_column + l * kColumnsPerLoad;
      uint32_t gate[32], up[32];
      tmem_load_32(lane_base + column, gate);
      tmem_load_32(lane_base + kTileN + column, up);
      cutlass::arch::fence_view_async_tmem_load();  // tcgen05.wait::ld
      after_tmem_wait(gate);
      after_tmem_wait(up);
      if (l == kLoads - 1) {
        // This thread is done with the buffer: the MMA warp may overwrite it.
        tmem_fence_before_thread_sync();
        Barrier::arrive(&s.acc_empty[acc_ring.stage]);
      }
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
  if (warp == kMmaWarp) {
    tmem.allocate(kTmemColumns, &s.tmem_base);
    tmem.release_allocation_lock();  // this CTA allocates nothing more
    tmem_fence_before_thread_sync();
  }
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
  if (warp == kMmaWarp) {
    tmem_fence_after_thread_sync();
    tmem.free(s.tmem_base, kTmemColumns);
  }
}

template <class T>
capmoe_status_t launch_typed(const Fc1Params& params, int grid, cudaStream_t stream) {
  auto kernel = fc1_swiglu_sm100_kernel<T>;
  constexpr size_t smem = Kernel<T>::kSmemBytes;
  CAPMOE_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem))));
  return launch(kernel, dim3(grid), kThreads, smem, stream, params);
}

}  // namespace

capmoe_status_t launch_fc1_sm100(const Fc1Params& params, capmoe_dtype_t dtype, int grid, cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::fused
