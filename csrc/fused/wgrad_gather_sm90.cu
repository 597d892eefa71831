// capmoe-archs: 90a
// Grouped weight gradient with gathered rows on Hopper (contract: capturable_moe/wgrad_gather.h):
//   dW[e, m, n] = sum over rows r of expert e of A(r)[m] * B(r)[n],
// A(r) = a[r] or a[token_of_row[r]] and B(r) likewise, one persistent warp-specialized kernel.
//
// MMA view: the GEMM's M is dW's m (A(m, k) = a[row k, m], contiguous in m: MN-major), N is
// dW's n (B(n, k) = b[row k, n], MN-major too) and K runs over the expert's rows, a count known
// only on the device. wgmma reads 16-bit MN-major operands from 128B-swizzled shared memory
// (GMMA::Layout_MN_SW128_Atom); each K block is 64 rows, one 128-byte line of 64 m (or n)
// values per row and 64-column group.
//
// Tiles: 128 (m) x 256 (n) of one expert; 2 consumer warpgroups of 64 x 256 each (128 fp32
// accumulators per thread). Every expert owns the same m_tiles * n_tiles tiles (M and N are
// fixed), so the tile list needs no prefix sums: tile t is expert t / (m_tiles * n_tiles), the
// m tiles of one n column consecutive. CTAs stride over the list; the CTAs running together
// work on one or two experts, whose a and b rows stay in L2 across their tiles.
// Plain output: an expert with no rows still runs its tiles (zero K blocks) to write zeros.
// Accumulate: such tiles are skipped by producer and consumers alike. The tile list and the
// producer below are shared with the sm_100a kernel (fused/wgrad_tiles.cuh).
//
// Loads: all of a K block comes by 16-byte cp.async from a producer warpgroup (128 threads),
// for both operands, zero-filled for rows past the expert's end, rows whose token is invalid
// and columns past M / N. Zero-filling BOTH operands matters: a row past offsets[E] may hold
// NaN, and 0 * NaN is NaN. Per-row TMA (fc1's other gather form) could bring the gathered rows
// instead, but TMA cannot zero a row it is not told to load, and a plain operand's tail rows
// need masking as well; one cp.async path keeps both operands' masking identical.
// The chunks go where a 128B-swizzled TMA box would put them (16-byte chunk c of 128-byte line
// L lands at chunk c XOR (L % 8)); wgrad_smem_offset() (fused/wgrad_gather_layout.h) is that
// layout, checked against cute's addressing of the SmemLayout below by tests/fused_wgrad_host.rs
// (tests/layout/wgrad_smem_layout.cu).
// Each producer thread's copies arrive on the stage's barrier when they land
// (cp.async.mbarrier.arrive.noinc); consumers fence the generic proxy against the async one
// before wgmma reads.
//
// Overlap: the producer runs ahead by up to kStages K blocks, so the next tile's first loads
// (for ~256 rows per expert: the whole next tile) are in flight while the consumers run the
// epilogue. What it does not overlap is the tensor cores with the epilogue: both consumer
// warpgroups store the same tile (stores straight from registers). A ping-pong schedule (one
// warpgroup per tile, 64 x 256) or a TMA-store epilogue through shared memory would hide it;
// the smem budget (4 x 48 KB stages) leaves no room for an fp32 staging tile as it stands.
// The other limit is L2 -> SM traffic: with K this short every tile brings 192 KB of operands
// for 4 MFLOP per 64 rows, and each x row is re-read by all M / 128 m tiles (E128 F768 H2048:
// ~2.4 GB in all, about what the tensor cores take to do the math); TMA multicast across a
// cluster (as CUTLASS's 2x1 cooperative WGRAD does for one operand) would halve one of the
// two, but a gathered row cannot be multicast by cp.async.
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include "common/launch.cuh"
#include "fused/launch_large_smem.cuh"
#include "fused/epilogue.cuh"
#include "fused/pipeline.cuh"
#include "fused/wgrad_gather_launch.h"
#include "fused/wgrad_tiles.cuh"
#include "grouped_gemm/counter_wgrad_gather.h"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kWgradTileM;
constexpr int kTileN = kWgradTileN;
constexpr int kTileK = kWgradTileK;  // routing rows per K block
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kProducerThreads = kWgradProducerThreads;
constexpr int kConsumerWarps = 8;

template <class T>
struct MmaAtom;
template <>
struct MmaAtom<cutlass::bfloat16_t> {
  using type = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <>
struct MmaAtom<cutlass::half_t> {
  using type = SM90_64x256x16_F32F16F16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};

template <class T>
struct Kernel {
  static_assert(sizeof(T) == 2, "16-bit operands: one 128-byte line holds 64 values");
  using TiledMma = decltype(make_tiled_mma(typename MmaAtom<T>::type{}, Layout<Shape<_2, _1, _1>>{}));
  // K-atoms first (Step<_2, _1, _3>), as CUTLASS's builders lay out MN-major operands.
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
};

// The producer warpgroup: the shared loop (fused/wgrad_tiles.cuh).
template <class T>
__device__ void produce(const WgradGatherParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  produce_wgrad_stages<T, kStages>(p, reinterpret_cast<uint8_t*>(s.a), reinterpret_cast<uint8_t*>(s.b), s.full,
                                   s.empty, total_tiles);
}

// Stores this thread's accumulators of tile t (only m < M, n < N): rounded to Out, or, for an
// fp32 output with accumulate, added to what dW holds.
template <class Out, class Accum, class Coords>
__device__ void store_tile(const WgradGatherParams& p, const WgradTile& t, const Accum& acc, const Coords& coords) {
  Out* dw = static_cast<Out*>(p.dw) + int64_t(t.expert) * p.m * p.n;
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    const int m = t.m0 + get<0>(coords(i)), n = t.n0 + get<1>(coords(i));
    // The accumulator layout pairs (i, i + 1) as adjacent columns of one row; a layout that
    // broke this would be a build of the wrong atom (folds away at compile time).
    if (get<1>(coords(i + 1)) != get<1>(coords(i)) + 1 || get<0>(coords(i + 1)) != get<0>(coords(i))) __trap();
    if (m >= p.m || n >= p.n) continue;  // N is a multiple of 8: n and n + 1 are both in or out
    Out* at = dw + int64_t(m) * p.n + n;
    if constexpr (std::is_same_v<Out, float>) {
      float2 v = make_float2(acc(i), acc(i + 1));
      if (p.accumulate) {
        const float2 old = *reinterpret_cast<const float2*>(at);
        v.x += old.x;
        v.y += old.y;
      }
      *reinterpret_cast<float2*>(at) = v;
    } else {
      *reinterpret_cast<uint32_t*>(at) = pack2<Out>(acc(i), acc(i + 1));
    }
  }
}

template <class T, class Out>
__device__ void consume(const WgradGatherParams& p, typename Kernel<T>::Shared& s, int total_tiles) {
  using K = Kernel<T>;
  const int consumer_thread = threadIdx.x - kProducerThreads;
  const bool warp_leader = (threadIdx.x & 31) == 0;

  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});
  auto thr = mma.get_thread_slice(consumer_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kTileN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));

  StageRing<kStages> ring;
  for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const WgradTile t = locate(p, tile);
    if (skipped(p, t)) continue;
    const int k_blocks = t.k_blocks();
    if (k_blocks == 0) {
      // Plain output of an expert without rows: dW_e = 0.
#pragma unroll
      for (int i = 0; i < size(acc); ++i) acc(i) = 0.0f;
    }
    // cp.async wrote both operands through the generic proxy.
    mma_k_blocks<true>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc);
    store_tile<Out>(p, t, acc, coords);
  }
}

template <class T, class Out>
__global__ void __launch_bounds__(kThreads, 1) wgrad_gather_kernel(const __grid_constant__ WgradGatherParams p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  // One noinc arrival per copying producer thread fills a stage.
  if (threadIdx.x == 0) init_stage_barriers<kStages>(s.full, s.empty, kProducerThreads, kConsumerWarps);
  __syncthreads();

  const int total_tiles = p.experts * p.m_tiles * p.n_tiles;  // <= INT32_MAX (host check)
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    produce<T>(p, s, total_tiles);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    consume<T, Out>(p, s, total_tiles);
  }
}

template <class T, class Out>
capmoe_status_t launch_typed(const WgradGatherParams& params, int grid, cudaStream_t stream) {
  return launch_large_smem(wgrad_gather_kernel<T, Out>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream, params);
}

}  // namespace

capmoe_status_t launch_wgrad_gather_sm90(const WgradGatherParams& params, capmoe_dtype_t dtype,
                                         capmoe_dtype_t out_dtype, int grid, cudaStream_t stream) {
  // A 16-bit dW with one gathered operand: the counter wgrad's TMA mainloop and epilogue with
  // that operand by cp.async (H100, bench/README "The gathered counter wgrad").
  if (gg::counter::gathered_wgrad_takes(params, dtype, out_dtype))
    return gg::counter::launch_gathered_wgrad(params, dtype, grid, stream);
  return dispatch_wgrad_types(dtype, out_dtype, [&](auto in, auto out) {
    return launch_typed<decltype(in), decltype(out)>(params, grid, stream);
  });
}

}  // namespace capmoe::fused
