// The shared-memory pipeline of the fused kernels (fc1_sm90.cu, swiglu_dgrad_sm90.cu,
// wgrad_gather_sm90.cu): kStages stages, each with a `full` barrier (the producer's data has
// landed) and an `empty` barrier (every consumer warp is done reading it). The producer and the
// consumers walk the same ring of stages in the same order; here is the consumers' side, the
// same in all three kernels.
#pragma once

#include <cstdint>
#include <cstdio>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace capmoe::fused {

// Where a role is in the ring: the stage, and the phase its barriers are in on this lap.
template <int kStages>
struct StageRing {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Waits until `barrier` has completed the phase of parity `phase`. Every wait of the fused
// kernels goes through here, so that a debug build can turn a deadlock into a message: built
// with CAPMOE_NVCC_DEFINES=CAPMOE_FUSED_HANG_TRAP (build.rs), a wait still unfinished after
// kHangTrapNs of the GPU's global timer (a time, not a spin count: how long one try_wait
// suspends is unspecified) prints, once per stuck warp, who waited (`role`),
// on which barrier and parity, then traps. Off by default (the plain wait spins forever).
#if defined(CAPMOE_FUSED_HANG_TRAP)
// Well inside gpu-run.sh's per-binary cap (150 s), well beyond any legitimate wait.
constexpr uint64_t kHangTrapNs = 10ull * 1000 * 1000 * 1000;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}
#endif

__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t phase, const char* role) {
#if defined(CAPMOE_FUSED_HANG_TRAP)
  const uint64_t start = global_timer_ns();
  while (!cutlass::arch::ClusterBarrier::try_wait(barrier, phase)) {
    if (global_timer_ns() - start > kHangTrapNs) {
      // One line per stuck warp: its lowest lane among those waiting here (a producer's wait
      // may run on one elected lane).
      if ((threadIdx.x & 31) == __ffs(__activemask()) - 1) {
        printf("capmoe fused kernel stuck: %s, block %d warp %d, barrier %p, parity %u\n", role, blockIdx.x,
               threadIdx.x / 32, static_cast<void*>(barrier), phase);
      }
      __trap();
    }
  }
#else
  (void)role;
  cutlass::arch::ClusterBarrier::wait(barrier, phase);
#endif
}

// The kernel's shared storage at the first 1024-byte boundary of the dynamic shared memory
// (the 128B swizzle repeats every 1024 bytes; the launch asks for 1024 bytes more than it needs).
template <class Shared>
__device__ __forceinline__ Shared& aligned_shared(uint8_t* raw) {
  return *reinterpret_cast<Shared*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
}

// One thread sets up every stage's barriers: `full` completes a phase after `full_arrivals`
// arrivals (and, with a transaction count, the bytes it expects), `empty` after one arrival per
// consumer warp. The caller syncs the CTA before any role uses them.
template <int kStages>
__device__ __forceinline__ void init_stage_barriers(uint64_t* full, uint64_t* empty, uint32_t full_arrivals,
                                                    uint32_t consumer_warps) {
  for (int i = 0; i < kStages; ++i) {
    cutlass::arch::ClusterBarrier::init(&full[i], full_arrivals);
    cutlass::arch::ClusterBarrier::init(&empty[i], consumer_warps);
  }
  cutlass::arch::fence_barrier_init();
}

// A consumer warpgroup with no rows in the tile: takes each of the tile's k_blocks stages and
// gives it straight back, so the pipeline's arrival count stays whole.
template <int kStages>
__device__ __forceinline__ void pass_k_blocks(StageRing<kStages>& ring, uint64_t* full, uint64_t* empty,
                                              int k_blocks, bool warp_leader) {
  using Barrier = cutlass::arch::ClusterBarrier;
  for (int kb = 0; kb < k_blocks; ++kb) {
    wait_barrier(&full[ring.stage], ring.phase, "consumer without rows, full");
    if (warp_leader) Barrier::arrive(&empty[ring.stage]);
    ring.advance();
  }
}

// No work beside a stage's wgmmas (wgmma_k_blocks' default `beside`).
struct NothingBeside {
  __device__ __forceinline__ void operator()(int /*stage*/, int /*kb*/) const {}
};

// A consumer warpgroup's mainloop over one tile: for each of the tile's k_blocks stages, waits
// for it, fences the accumulators (`fence()`) and issues the stage's wgmmas (`issue(stage)`),
// keeping one batch in flight: a stage goes back to the producer once the next stage's batch is
// issued and its own has completed. `beside(stage, kb)` runs right after a batch is committed,
// while the tensor cores work on it (it may read the stage, never the accumulators).
// kAfterCpAsync: the stage was written through the generic proxy (cp.async), which wgmma (the
// async proxy) may read only after a proxy fence.
template <bool kAfterCpAsync, int kStages, class Issue, class Fence, class Beside = NothingBeside>
__device__ __forceinline__ void wgmma_k_blocks(StageRing<kStages>& ring, uint64_t* full, uint64_t* empty,
                                               int k_blocks, bool warp_leader, Issue&& issue, Fence&& fence,
                                               Beside&& beside = Beside{}) {
  using namespace cute;
  using Barrier = cutlass::arch::ClusterBarrier;
  int previous = -1;
  for (int kb = 0; kb < k_blocks; ++kb) {
    wait_barrier(&full[ring.stage], ring.phase, "consumer, full");
    // The lanes may leave the wait's spin on different iterations; wgmma's .sync.aligned
    // instructions need the warp converged (as the sm_100a MMA warp does after its waits).
    __syncwarp();
    if constexpr (kAfterCpAsync) cutlass::arch::fence_view_async_shared();
    fence();
    warpgroup_arrive();
    issue(ring.stage);
    warpgroup_commit_batch();
    beside(ring.stage, kb);
    // Keep one batch in flight: the previous stage's wgmmas are done once this returns.
    warpgroup_wait<1>();
    fence();
    if (previous >= 0 && warp_leader) Barrier::arrive(&empty[previous]);
    previous = ring.stage;
    ring.advance();
  }
  warpgroup_wait<0>();
  fence();
  if (previous >= 0 && warp_leader) Barrier::arrive(&empty[previous]);
}

// Issues one stage's wgmmas of `mma` into acc over every k16 step of the stage; the first
// call of a tile (mma.accumulate_ == Zero) overwrites acc.
template <class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void wgmma_stage(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc, int stage) {
  using namespace cute;
#pragma unroll
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

// wgmma_k_blocks for one MMA: acc = the tile's A x B over its k_blocks stages, `beside` as
// there.
template <bool kAfterCpAsync, int kStages, class Mma, class FragA, class FragB, class Acc,
          class Beside = NothingBeside>
__device__ __forceinline__ void mma_k_blocks(StageRing<kStages>& ring, uint64_t* full, uint64_t* empty, int k_blocks,
                                             bool warp_leader, Mma& mma, FragA& tCrA, FragB& tCrB, Acc& acc,
                                             Beside&& beside = Beside{}) {
  mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  wgmma_k_blocks<kAfterCpAsync>(
      ring, full, empty, k_blocks, warp_leader, [&](int stage) { wgmma_stage(mma, tCrA, tCrB, acc, stage); },
      [&] { cute::warpgroup_fence_operand(acc); }, beside);
}

}  // namespace capmoe::fused
