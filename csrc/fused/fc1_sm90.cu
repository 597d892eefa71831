// capmoe-archs: 90a
// Fused fc1 of the expert path on Hopper: act = SwiGLU(gather(x) @ W1_e^T), one persistent,
// warp-specialized kernel (contract: capturable_moe/fused.h).
//
// Tiles: 128 rows (routing rows of one expert) x 128 output columns of act. The B tile holds
// the gate rows [n0, n0 + 128) and the up rows [F + n0, F + n0 + 128) of W1_e, stacked as one
// 256-row operand, so one 64x256 wgmma per consumer warpgroup leaves every thread holding gate
// column c and up column c + 128 of the same row: SwiGLU is elementwise in registers.
//
// Roles (384 threads): warpgroup 0 is the producer; warpgroups 1 and 2 are the consumers, 64
// tile rows each. The A operand is gathered by cp.async: the producer warpgroup copies the K
// block's 16-byte chunks, each warp-wide copy four whole rows (fused/gather_rows.cuh,
// GatherRows), chunk c of a row to chunk (c XOR row % 8) (the 128B swizzle, by hand; columns
// past H and rows of an invalid token are zero-filled); each thread's copies arrive on the
// stage's barrier when they land (cp.async.mbarrier.arrive.noinc), and consumers fence the
// generic proxy against the async one before wgmma reads them. W1 comes by TMA. (A second form
// that loaded each A row with its own 1 x 64 TMA box ran about 4x slower on the H200 and was
// deleted.)
// Rows past the expert's count are not loaded (their accumulators are never stored).
// With `rows` given (a training step), the tiles of the first column slice also write their
// gathered A rows to it, the permuted copy the backward's fc1 wgrad reads
// (fused/stage_rows_out.cuh): each consumer warpgroup copies its rows out of a stage while that
// stage's wgmmas run.
//
// Scheduling: the tile list comes from the device-side offsets (fused/tile_list.cuh): the M
// tiles of one expert's column slice are consecutive, so the CTAs running together read the
// same weight slice (once from HBM, then from L2). Each CTA's producer takes its next tile from
// a device counter as it frees up (fused/tile_source.cuh's CountedTiles over the caller's
// `schedule` words) and writes its index into the stage holding the tile's first K block, where
// the consumers read it.
//
// The epilogue rounds gate and up to the output type first and computes SwiGLU in fp32 on the
// rounded values, exactly as capmoe_routing_swiglu does on h, so act equals the unfused path's.
// Weighted form (prob_of_row given): act = round(p * SwiGLU), p the probability of the row's
// route, so fc2's output rows come out weighted and the combine is an unweighted gather-sum.
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
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
#include "common/swiglu_math.cuh"
#include "fused/fc1_launch.h"
#include "fused/accumulator_layout.cuh"
#include "fused/gather_rows.cuh"
#include "fused/quad_store.cuh"
#include "fused/stage_rows_out.cuh"
#include "fused/tile_list.cuh"
#include "fused/tile_source.cuh"
#include "fused/tma_loads.cuh"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = 128;
constexpr int kTileN = CAPMOE_FUSED_FC1_TILE_N;  // act columns per tile (B holds 2x)
constexpr int kTileK = 64;                       // 64 16-bit elements = one 128-byte row
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kProducerThreads = 128;

template <class T>
struct MmaAtom;
template <>
struct MmaAtom<cutlass::bfloat16_t> {
  using type = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct MmaAtom<cutlass::half_t> {
  using type = SM90_64x256x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};

template <class T>
struct Kernel {
  using TiledMma = decltype(make_tiled_mma(typename MmaAtom<T>::type{}, Layout<Shape<_2, _1, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<2 * kTileN>, Int<kTileK>, Int<kStages>>{}));
  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = 2 * kTileN * kTileK;
  static constexpr uint32_t kRowBytes = kTileK * sizeof(T);
  static constexpr uint32_t kBytesB = kStageElemsB * sizeof(T);

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    int32_t tile_prefix[CAPMOE_FUSED_MAX_EXPERTS + 1];  // M tiles of the experts before e
    int32_t row_start[CAPMOE_FUSED_MAX_EXPERTS + 1];    // first row of expert e (clamped)
    int32_t stage_tile[kStages];  // the tile whose first K block a stage holds (tile_schedule.cuh)
    int32_t next_tile;            // the producer warpgroup's fetched tile (CountedTiles' handoff)
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_90a allows 227 KB of dynamic shared memory per CTA");

  // The layouts the producers write into, checked at compile time (before the swizzle, which is
  // a function of the address, as TMA's is): A and B rows are consecutive 128-byte rows, so the
  // up rows' box lands kTileN rows after the gate rows' (tma_loads.cuh, load_w1_tile), and
  // stages are whole blocks. The cp.async chunk offsets are checked on the host
  // (tests/layout/fc1_smem_layout.cu).
  using PlainA = decltype(get_nonswizzle_portion(SmemLayoutA{}));
  using PlainB = decltype(get_nonswizzle_portion(SmemLayoutB{}));
  static_assert(kRowBytes == 128, "one K block is one 128-byte swizzle row");
  static_assert(PlainA{}(_1{}, _0{}, _0{}) == kTileK && PlainA{}(_0{}, _0{}, _1{}) == kStageElemsA);
  static_assert(PlainB{}(_1{}, _0{}, _0{}) == kTileK && PlainB{}(Int<kTileN>{}, _0{}, _0{}) == kTileN * kTileK);
  static_assert(PlainB{}(_0{}, _0{}, _1{}) == kStageElemsB);
  static_assert(cosize_v<SmemLayoutA> == kStages * kStageElemsA, "A stages are dense, one after another");
  static_assert(cosize_v<SmemLayoutB> == kStages * kStageElemsB, "B stages are dense, one after another");
};

static_assert(GatherRows<kTileM>::kThreads == kProducerThreads, "the gather's thread -> (row, chunk) map covers the tile");

__device__ __forceinline__ Tile locate_tile(int tile, int slices, const int32_t* tile_prefix, const int32_t* row_start,
                                            int experts) {
  return locate<kTileM, kTileN>(tile, slices, tile_prefix, row_start, experts);
}

// The B tile of a stage: gate rows [n0, n0 + 128) and up rows [F + n0, ...) of W1_e.
template <class T>
__device__ __forceinline__ void load_weights(const Fc1Params& p, typename Kernel<T>::Shared& s, int stage, const Tile& t,
                                             int k0) {
  load_w1_tile<kTileN, kTileK>(p, &s.full[stage], s.b + stage * Kernel<T>::kStageElemsB, t, k0);
}

// The producer warpgroup: gathered x rows and W1 tiles (fused/gather_rows.cuh), over the tiles
// the schedule hands out.
template <class T>
__device__ void produce(const Fc1Params& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  const CountedTiles<kProducerThreads> tiles{TileSchedule{p.schedule}, s.stage_tile, &s.next_tile};
  produce_gathered_a<kTileM, kTileK, kStages>(
      p.x, p.hidden, p.max_tokens, p.token_of_row, s.full, s.empty, s.a, Kernel<T>::kBytesB, total_tiles, tiles,
      [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      [&](int stage, const Tile& t, int k0) { load_weights<T>(p, s, stage, t, k0); });
}

// Rounds the accumulators to T, then act = silu(g) * u in fp32 (capmoe_routing_swiglu's math),
// times the row's route probability when p.prob_of_row is given, and h = [g | u] when
// requested. Only rows < t.rows are stored, 16 bytes a lane (fused/quad_store.cuh).
//
// m0: the thread's first tile row. The accumulator layout is check_quad_accumulator_layout's over
// the 128 x 256 [gate | up] tile, so gate column n and up column n + kTileN sit kHalf apart.
template <class T, class Accum>
__device__ void store_tile(const Fc1Params& p, const Tile& t, const Accum& acc, int m0) {
  constexpr int kGroups = kTileN / 8;  // 8-column groups of act per row
  constexpr int kHalf = 4 * kGroups;   // accumulators of the gate half
  static_assert(decltype(size(acc))::value == 2 * kHalf, "two rows x two columns per group, gate and up");
  const int quad_lane = threadIdx.x & 3;
  T* act = static_cast<T*>(p.act);
  T* h = static_cast<T*>(p.h);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 8 * r;
    const bool stored = m < t.rows;
    const int64_t row = int64_t(t.row0) + m;
    const float prob = p.prob_of_row != nullptr && stored ? __ldg(p.prob_of_row + row) : 1.0f;
#pragma unroll
    for (int a = 0; a < kGroups / 4; ++a) {
      uint32_t act_words[4], gate_words[4], up_words[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = 4 * (4 * a + j) + 2 * r;
        const Fc1Pairs out =
            fc1_pairs<T>(acc(i), acc(i + 1), acc(i + kHalf), acc(i + kHalf + 1), p.prob_of_row != nullptr, prob);
        act_words[j] = out.act;
        gate_words[j] = out.gate;
        up_words[j] = out.up;
      }
      // This lane's 8 columns after the exchange: group 4a + (lane % 4).
      const int64_t col = t.n0 + 8 * (4 * a + quad_lane);
      quad_transpose(act_words);
      if (stored) store16(act + row * p.ffn + col, act_words);
      if (h != nullptr) {
        quad_transpose(gate_words);
        quad_transpose(up_words);
        if (stored) {
          store16(h + row * 2 * p.ffn + col, gate_words);
          store16(h + row * 2 * p.ffn + p.ffn + col, up_words);
        }
      }
    }
  }
}

template <class T>
__device__ void consume(const Fc1Params& p, typename Kernel<T>::Shared& s, int slices) {
  using K = Kernel<T>;
  const int consumer_thread = threadIdx.x - 128;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const int k_blocks = (p.hidden + kTileK - 1) / kTileK;

  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});
  auto thr = mma.get_thread_slice(consumer_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<2 * kTileN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<2 * kTileN>>{}));

  const int m0 = check_quad_accumulator_layout(coords);

  // This warpgroup's rows of a tile: [first_row, first_row + 64).
  const int first_row = (consumer_thread / 128) * (kTileM / 2);
  const StageRowsOut rows_out(first_row, consumer_thread % 128);
  StageRing<kStages> ring;
  for (;;) {
    const int tile = next_published_tile(ring, s.full, s.stage_tile);
    if (tile == kNoMoreTiles) break;
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    if (t.rows <= first_row) {
      // An expert's last tile with at most 64 rows: this warpgroup has none, so it leaves the
      // tensor cores to the other one (which then runs up to twice as fast). Unlike the fc2
      // dgrad, fc1 keeps this skip: running such tiles whole took its DRAM reads from 1.50 to
      // 1.38 GB at E128 T4096 but made the expert forward slower (H200, 2026-11-28: 740 ->
      // 820 us at E128 T4096, 323 -> 375 us at decode, where most tiles are partial).
      pass_k_blocks(ring, s.full, s.empty, k_blocks, warp_leader);
      continue;
    }
    // The A rows came through the generic proxy (cp.async).
    if (p.rows != nullptr && t.n0 == 0) {
      // The first column slice's tiles also write their gathered rows out (stage_rows_out.cuh).
      T* rows_tile = static_cast<T*>(p.rows) + int64_t(t.row0) * p.hidden;
      const auto* a_stages = reinterpret_cast<const uint8_t*>(s.a);
      mma_k_blocks<true>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc, [&](int stage, int kb) {
        rows_out.copy(a_stages + stage * K::kStageElemsA * sizeof(T), rows_tile, t.rows, p.hidden, kb * kTileK);
      });
    } else {
      mma_k_blocks<true>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc);
    }
    store_tile<T>(p, t, acc, m0);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) fc1_swiglu_kernel(const __grid_constant__ Fc1Params p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;

  if (warp == 0) build_tile_prefix<kTileM>(p.offsets, p.experts, p.capacity, s.tile_prefix, s.row_start);
  if (threadIdx.x == 32) {
    // The producer's expect_tx arrival plus one per copying thread.
    init_stage_barriers<kStages>(s.full, s.empty, 1 + kProducerThreads, kConsumerWarps);
  }
  if (threadIdx.x == 64) cute::prefetch_tma_descriptor(&p.w1_map);
  __syncthreads();

  const int slices = p.ffn / kTileN;
  const int total_tiles = s.tile_prefix[p.experts] * slices;
  if (warp < 4) {
    // setmaxnreg moves registers between warpgroups: 56 + 2 x 224 = 3 x 168, what the launch
    // holds. The cp.async producer keeps 8 row tokens live (GatherRows) and spilled under 40.
    cutlass::arch::warpgroup_reg_dealloc<56>();
    produce<T>(p, s, total_tiles, slices);
  } else {
    cutlass::arch::warpgroup_reg_alloc<224>();
    consume<T>(p, s, slices);
  }
}

template <class T>
capmoe_status_t launch_typed(const Fc1Params& params, int grid, cudaStream_t stream) {
  return launch_large_smem(fc1_swiglu_kernel<T>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream, params);
}

}  // namespace

capmoe_status_t launch_fc1_sm90(const Fc1Params& params, capmoe_dtype_t dtype, int grid, cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::fused
