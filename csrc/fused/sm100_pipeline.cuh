// The Blackwell (sm_100a) scaffolding the fused kernels share (fc1_sm100.cu,
// swiglu_dgrad_sm100.cu, wgrad_gather_sm100.cu): tensor memory (TMEM) allocation, the MMA
// warp's loop that feeds the shared-memory stage ring to tcgen05.mma and hands finished
// accumulators to the epilogue, the epilogue's side of that hand-off and its TMEM loads, and
// the producers' tail.
//
// The pipelines: the stage ring of fused/pipeline.cuh, whose stages go back to the producer
// through tcgen05.commit (once the UMMAs that read a stage have completed), and a ring of
// kAccStages TMEM accumulators, so that the epilogue of one tile overlaps the mainloop of the
// next: acc_full completes by tcgen05.commit after a tile's last UMMA, acc_empty after every
// epilogue thread has finished its tcgen05.ld of that buffer.
//
// Ordering rules (PTX ISA, tcgen05 memory consistency) the pieces below keep:
//  - TMEM handed between threads through an mbarrier: tcgen05.fence::before_thread_sync before
//    the arrive, tcgen05.fence::after_thread_sync after the wait (both ways: epilogue -> MMA
//    for a free buffer; MMA -> epilogue is the commit's own arrive, then after_thread_sync);
//  - a stage written through the generic proxy (cp.async) is read by the UMMAs (async proxy)
//    only after fence.proxy.async, which the MMA warp runs once the stage's full barrier has
//    completed (as the Hopper consumers do before wgmma);
//  - tcgen05.wait::ld before any register of a tcgen05.ld is read or the buffer released;
//  - no thread exits while a tcgen05.commit arrival on one of the CTA's barriers is still due:
//    the producer waits for every stage's release (drain_stage_ring), the epilogue for every
//    accumulator's commit;
//  - one warp allocates TMEM, relinquishes the allocation permit at once, and frees after the
//    final CTA barrier, which every epilogue thread reaches after its last tcgen05.wait::ld.
//    A kernel running concurrently on the same SM that holds TMEM makes tcgen05.alloc wait.
#pragma once

#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/mma_sm100_umma.hpp>
#include <cute/arch/tmem_allocator_sm100.hpp>
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "fused/pipeline.cuh"

// The device pass must have the tcgen05 instructions: without them cute compiles its UMMA and
// TMEM wrappers to traps, and a kernel would build and then fail at run time.
#if defined(__CUDA_ARCH__) && \
    !(defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED) && defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED))
#error "the sm_100a fused kernels need tcgen05 MMA and TMEM; compile them for compute_100a only"
#endif

namespace capmoe::fused {

// The roles of every sm_100a fused kernel (416 threads, 13 warps): warps 0-3 the producer (the
// shared producers index by threadIdx.x), warps 4-11 the epilogue (two warpgroups, each covering
// all 128 TMEM lanes, a quarter per warp), warp 12 the MMA warp. Two TMEM accumulators, so a
// tile's epilogue overlaps the next tile's UMMAs; the epilogue reads them 32 fp32 columns of a
// lane per tcgen05.ld (32x32b.x32).
namespace sm100_roles {
constexpr int kProducerThreads = 128;
constexpr int kEpilogueWarps = 8;
constexpr int kEpilogueThreads = 32 * kEpilogueWarps;
constexpr int kFirstEpilogueWarp = kProducerThreads / 32;
constexpr int kMmaWarp = kFirstEpilogueWarp + kEpilogueWarps;
constexpr int kThreads = 32 * (kMmaWarp + 1);
constexpr int kAccStages = 2;
constexpr int kColumnsPerLoad = 32;
static_assert(kThreads == 416 && kMmaWarp == 12, "roles: 4 producer warps, 8 epilogue warps, 1 MMA warp");
static_assert(kEpilogueWarps % 4 == 0 && kFirstEpilogueWarp % 4 == 0,
              "the epilogue is whole warpgroups, each covering all 128 TMEM lanes, a quarter per warp");
}  // namespace sm100_roles

__device__ __forceinline__ void tmem_fence_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tmem_fence_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// Run by the whole allocating warp before the CTA barrier that publishes `*base`.
template <int kColumns>
__device__ __forceinline__ void allocate_tmem(cute::TMEM::Allocator1Sm& tmem, uint32_t* base) {
  static_assert(kColumns >= 32 && kColumns <= 512 && (kColumns & (kColumns - 1)) == 0,
                "tcgen05.alloc takes a power of 2 in [32, 512] columns");
  tmem.allocate(kColumns, base);
  tmem.release_allocation_lock();  // this CTA allocates nothing more
  tmem_fence_before_thread_sync();
}

// Run by the allocating warp after the final CTA barrier (every tcgen05.ld and UMMA done).
template <int kColumns>
__device__ __forceinline__ void free_tmem(cute::TMEM::Allocator1Sm& tmem, uint32_t base) {
  tmem_fence_after_thread_sync();
  tmem.free(base, kColumns);
}

// Tiles of this CTA's persistent loop (blockIdx.x, + gridDim.x, ... below total_tiles).
__device__ __forceinline__ int cta_tiles(int total_tiles) {
  return int(blockIdx.x) < total_tiles ? (total_tiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
}

// The producers' tail: after the CTA's `fills` stage fills (one per tile and K block), waits
// until the UMMAs have released every stage, so that no tcgen05.commit arrival is still due
// when the CTA exits (a stage never filled passes at once).
template <int kStages>
__device__ __forceinline__ void drain_stage_ring(uint64_t* empty, int64_t fills, const char* role) {
  StageRing<kStages> ring;
  ring.stage = int(fills % kStages);
  ring.phase = uint32_t(fills / kStages) & 1u;
  for (int i = 0; i < kStages; ++i) {
    wait_barrier(&empty[ring.stage], ring.phase ^ 1, role);
    ring.advance();
  }
}

// The MMA warp's work on one tile: waits for a free accumulator (kAccColumns TMEM columns
// each, from tmem_base), then per K block for the stage, issues its k16 UMMAs from one elected
// thread (cute's SM100 atom elects inside; umma_arrive elects the same lane, so its
// tcgen05.commit tracks that thread's UMMAs) and gives the stage back by tcgen05.commit; after
// the tile's last K block (k_blocks >= 1: the first UMMA overwrites the accumulator, so a tile
// without one would hand over stale TMEM), commits the accumulator to acc_full. kAfterCpAsync:
// the stages were written through the generic proxy. tCrA / tCrB: UMMA descriptors (MMA,
// MMA_M|N, k16 steps, stage); acc: the accumulator fragment, whose address is set here.
template <int kStages, int kAccStages, int kAccColumns, bool kAfterCpAsync, class Mma, class FragA, class FragB,
          class Acc>
__device__ __forceinline__ void issue_umma_tile(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                uint64_t* full, uint64_t* empty, uint64_t* acc_full,
                                                uint64_t* acc_empty, uint32_t tmem_base, StageRing<kStages>& ring,
                                                StageRing<kAccStages>& acc_ring, int k_blocks) {
  using namespace cute;
  wait_barrier(&acc_empty[acc_ring.stage], acc_ring.phase ^ 1, "sm100 MMA warp, accumulator empty");
  tmem_fence_after_thread_sync();
  acc.data() = tmem_base + uint32_t(acc_ring.stage * kAccColumns);
  mma.accumulate_ = UMMA::ScaleOut::Zero;
  for (int kb = 0; kb < k_blocks; ++kb) {
    wait_barrier(&full[ring.stage], ring.phase, "sm100 MMA warp, full");
    // The UMMA atom's and umma_arrive's elect.sync need the warp converged after the per-lane
    // spin of the wait.
    __syncwarp();
    if constexpr (kAfterCpAsync) cutlass::arch::fence_view_async_shared();
#pragma unroll
    for (int k = 0; k < size<2>(tCrA); ++k) {
      cute::gemm(mma, tCrA(_, _, k, ring.stage), tCrB(_, _, k, ring.stage), acc);
      mma.accumulate_ = UMMA::ScaleOut::One;
    }
    // The stage goes back to the producer once these UMMAs have read it.
    cutlass::arch::umma_arrive(&empty[ring.stage]);
    ring.advance();
  }
  // The accumulator is complete once every UMMA issued so far has.
  cutlass::arch::umma_arrive(&acc_full[acc_ring.stage]);
  acc_ring.advance();
}

// The MMA warp's loop over this CTA's tiles, each of k_blocks K blocks (issue_umma_tile).
template <int kStages, int kAccStages, int kAccColumns, bool kAfterCpAsync, class Mma, class FragA, class FragB,
          class Acc>
__device__ __forceinline__ void issue_umma_tiles(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                 uint64_t* full, uint64_t* empty, uint64_t* acc_full,
                                                 uint64_t* acc_empty, uint32_t tmem_base, int total_tiles,
                                                 int k_blocks) {
  StageRing<kStages> ring;
  StageRing<kAccStages> acc_ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x)
    issue_umma_tile<kStages, kAccStages, kAccColumns, kAfterCpAsync>(mma, tCrA, tCrB, acc, full, empty, acc_full,
                                                                      acc_empty, tmem_base, ring, acc_ring, k_blocks);
}

// The epilogue's side of the accumulator ring: wait until the accumulator of `ring`'s stage
// is full, and give it back once this thread's tcgen05.ld of it have completed (after
// tcgen05.wait::ld). acc_empty takes one arrival per epilogue thread.
template <int kAccStages>
__device__ __forceinline__ void wait_accumulator(uint64_t* acc_full, const StageRing<kAccStages>& ring,
                                                 const char* role) {
  wait_barrier(&acc_full[ring.stage], ring.phase, role);
  tmem_fence_after_thread_sync();
}
__device__ __forceinline__ void release_accumulator(uint64_t* acc_empty, int stage) {
  tmem_fence_before_thread_sync();
  cutlass::arch::ClusterBarrier::arrive(&acc_empty[stage]);
}

// The TMEM address of column `column` of TMEM lane quarter `quarter` (lanes [32 q, 32 q + 32),
// the only ones a warp of rank q in its warpgroup may read): lane in bits [31:16], column in
// [15:0].
__device__ __forceinline__ uint32_t tmem_lane_quarter(uint32_t tmem_base, int quarter, int column) {
  return tmem_base + (uint32_t(32 * quarter) << 16) + uint32_t(column);
}

// Issues the load of 32 consecutive fp32 TMEM columns of this thread's lane; the registers
// are valid only after tmem_wait_loads. tcgen05.ld is .sync.aligned: the whole warp must issue
// it converged, and the per-row branches and per-lane barrier spins before it may have split
// the warp, so it reconverges here rather than relying on the compiler to.
__device__ __forceinline__ void tmem_load_32(uint32_t address, uint32_t (&v)[32]) {
  __syncwarp();
  cute::SM100_TMEM_LOAD_32dp32b32x::copy(address, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10],
                                         v[11], v[12], v[13], v[14], v[15], v[16], v[17], v[18], v[19], v[20], v[21],
                                         v[22], v[23], v[24], v[25], v[26], v[27], v[28], v[29], v[30], v[31]);
}

// Ties every register of a tcgen05.ld to the point after tcgen05.wait::ld: the load's asm
// does not say its outputs are valid only after the wait, so without this the compiler could
// schedule their uses between the two. Each empty asm is volatile (kept after the wait's, also
// volatile) and redefines its register.
__device__ __forceinline__ void after_tmem_wait(uint32_t (&v)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(v[i]));
}

// tcgen05.wait::ld, then every named load's registers valid.
template <class... Loads>
__device__ __forceinline__ void tmem_wait_loads(Loads&... loads) {
  cutlass::arch::fence_view_async_tmem_load();  // tcgen05.wait::ld
  (after_tmem_wait(loads), ...);
}

// 32 consecutive 16-bit values (16 packed pairs) to global memory as four 16-byte stores: the
// epilogue thread of a TMEM lane holds consecutive columns of one row (dst 16-byte aligned).
__device__ __forceinline__ void store_16_pairs(void* dst, const uint32_t (&pairs)[16]) {
  uint4* out = static_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = make_uint4(pairs[4 * i], pairs[4 * i + 1], pairs[4 * i + 2], pairs[4 * i + 3]);
}

}  // namespace capmoe::fused
