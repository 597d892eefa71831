// capmoe-archs: 90a
// The hand-written grouped GEMM of config SM90_COUNTER (fprop and dgrad, 16-bit in and out,
// tensor weights, at most CAPMOE_FUSED_MAX_EXPERTS experts): D_e = A_e op(W_e), every expert's
// rows a slice of A and D, as the CUTLASS variants compute it (grouped_gemm.h's contract).
//
// Why a second kernel: the fused fc1 (fused/fc1_sm90.cu) runs the same 128 x 256 x 64 mainloop
// as CUTLASS's cooperative kernel but takes its tiles from a device counter, weight slice by
// weight slice, claimed a few K blocks ahead, and a consumer warpgroup whose 64 rows all lie
// past its expert's end skips its MMAs; on the H200 it finished ahead of CUTLASS's kernel on the
// same data. This is that mainloop with A by TMA (the rows are contiguous here) and a plain
// epilogue. Measured (H200, 2026-11-29, bench/README "That kernel"): first 2-8 % ahead of the
// CUTLASS kernels where the output is at least as wide as the reduction and at decode; since
// its tiles take tails (below) ahead on every E >= 32 fprop / dgrad swept but dsv3's fc2 dgrad;
// AUTO (dispatch.cu) takes it where it leads.
//
// The launch sequence is the CUTLASS variants' (grouped_gemm.cuh): the one-block argument kernel
// (arguments.cuh) turns m_splits into clamped row offsets, sets the overflow flags and zeroes
// the tile counter; this kernel is its programmatic dependent and waits for it before reading
// either. Per CTA (persistent, 384 threads):
//  - warp 0 builds the tile list from the row offsets in shared memory (fused/tile_list.cuh:
//    per expert ceil(rows / 128) M tiles, or one fewer holding up to 128 + kTailRows rows each
//    with the rows spread evenly over them; the M tiles of one 256-column slice consecutive);
//  - thread 0 is the producer: per tile (fused/tile_source.cuh's CountedTiles, claimed
//    ClaimAhead's lead early) and K block of 64, a box of A at (k0, row0), 128 rows or fewer
//    for an expert's last tile (a_box_for; rows past the expert's end are another expert's or
//    zero fill past capacity, never stored) and for a tile with a tail a 16-row box at row0 +
//    128 into a buffer of its own, and the 256 x 64 B tile: one 64 x 256 box of W_e
//    when the reduction is W's contiguous dim (RC), or four 64 x 64 boxes, MN-major, when the
//    output columns are (RR);
//  - warpgroups 1 and 2 consume, 64 rows each, one 64x256x16 wgmma per k16 step, and store
//    their rows < the tile's row count straight from the accumulators, 16 bytes a lane
//    (fused/quad_store.cuh), columns < N; a tile with rows past 128 (a tail, below) adds one
//    swapped 64x16x16 wgmma per warpgroup and k16 step, over half the tile's columns each,
//    whose rows are stored element by element.
// TMA zero-fills reads past K and past N, so neither needs to be a multiple of the tile.
// First: CUTLASS includes <cudaTypedefs.h> inside its namespace (cuda_host_adapter.hpp), which
// would leave the driver typedefs this header needs out of the global one.
#include "common/tma_encode.h"

#include <cuda_runtime.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "common/device_primitives.cuh"
#include "fused/accumulator_layout.cuh"
#include "fused/pair.cuh"
#include "fused/pipeline.cuh"
#include "fused/quad_store.cuh"
#include "fused/tile_list.cuh"
#include "fused/tile_source.cuh"
#include "grouped_gemm/arguments.cuh"
#include "grouped_gemm/counter.h"
#include "grouped_gemm/counter_launch.cuh"
#include "grouped_gemm/dependent_launch.cuh"
#include "grouped_gemm/launch.h"

namespace capmoe::gg::counter {
namespace {

using namespace cute;
using fused::StageRing;
using fused::Tile;

constexpr int kTileM = kCounterTileM;
constexpr int kTileN = kCounterTileN;
constexpr int kTileK = 64;  // 64 16-bit elements = one 128-byte swizzle row
constexpr int kBoxN = 64;   // MN-major B: output columns per TMA box
constexpr int kStages = 4;
constexpr int kThreads = 384;
// A tile may hold up to kTailRows rows past its 128 (tile_list.cuh's m_tiles_of and locate say
// which): those are computed swapped (D^T = W^T A^T: the weight tile's 256 columns as the
// wgmma's M, the tail rows as its N), from the weight tile the stage already holds and a small
// box of the tail's A rows, instead of as a tile of their own that streams the whole weight
// tile through L2 again for a few rows. (Tails of up to 16 and of up to 32 rows a tile measured
// the same, H200, bench/results/gemm_counter_tails_NVIDIA_H200.txt; 16 is the narrower wgmma.)
constexpr int kTailRows = kCounterTailRows;
constexpr int kConsumerWarps = 8;

// A's row boxes, tallest first: a tile takes the shortest box that holds its rows, so an
// expert's last tile does not stream up to 127 rows of the next expert's A through L2 into
// rows it never stores. (TMA's box is fixed per map; CUTLASS's per-expert maps end at the
// expert's last row, so it reads none of them. H200, 2026-11-29, against one 128-row box:
// dsv3_ep8_fc1 fprop 1.40x -> 1.34x of the roofline, dgrad 1.35x -> 1.31x.) Rows of the stage
// below the box keep an older stage's data: their accumulator rows are never stored, and rows
// of an MMA do not mix.
constexpr int kABoxes = 4;

// Box i holds 128 >> i rows: 128, 64, 32, 16.
__host__ __device__ constexpr int a_box_rows(int box) { return kTileM >> box; }

// The shortest box that holds `rows` rows.
__host__ __device__ constexpr int a_box_for(int rows) {
  int box = 0;
  while (box + 1 < kABoxes && a_box_rows(box + 1) >= rows) ++box;
  return box;
}
static_assert(a_box_for(128) == 0 && a_box_for(65) == 0 && a_box_for(64) == 1 && a_box_for(17) == 2 &&
              a_box_for(16) == 3 && a_box_for(1) == 3);

struct Params {
  CUtensorMap a_maps[kABoxes];  // A [capacity, K_in]: box 64 x a_box_rows(i) rows
  CUtensorMap b_map;  // RC: W [E, N, K_in] box 64 x 256 x 1; RR: W [E, K_in, N] box 64 x 64 x 1
  void* d;            // D [capacity, N]
  const int64_t* row_offsets;  // E + 1 clamped row starts (the argument kernel's)
  int32_t* schedule;           // the tile counter's words (fused/tile_schedule.cuh)
  int32_t experts, k_in, n_out, capacity;
};

// One consumer warpgroup's wgmma: 64 x 256 x 16, fp32 accumulators, A K-major, B K-major or
// (kBMnMajor) MN-major, both from shared memory.
template <class T, bool kBMnMajor>
using MmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kTileN>, _16>, GMMA::Major::K,
                                            kBMnMajor ? GMMA::Major::MN : GMMA::Major::K>());
static_assert(std::is_same_v<MmaOp<cutlass::bfloat16_t, true>,
                             SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>> &&
              std::is_same_v<MmaOp<cutlass::half_t, false>,
                             SM90_64x256x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>>);

// The tail's wgmma: the weight tile as A (M = 64 of its columns), the tail rows as B (N =
// kTailRows), both K-major but for an MN-major weight tile.
template <class T, bool kBMnMajor>
using TailMmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kTailRows>, _16>,
                                                kBMnMajor ? GMMA::Major::MN : GMMA::Major::K, GMMA::Major::K>());
static_assert(std::is_same_v<TailMmaOp<cutlass::bfloat16_t, true>,
                             SM90_64x16x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::K>>);

template <bool kBMnMajor, class T>
struct SmemLayoutB;
template <class T>
struct SmemLayoutB<false, T> {
  using type = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                      Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}));
};
template <class T>
struct SmemLayoutB<true, T> {
  // K first: each 64-column chunk's 64 K rows are one contiguous 8 KB block, what one box writes
  // (as the fused fc2 dgrad's W2 tile, fused/swiglu_dgrad_sm90.cu).
  using type = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                      Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}, Step<_2, _1, _3>{}));
};

template <class T, bool kBMnMajor>
struct Kernel {
  using TiledMma = decltype(make_tiled_mma(MmaOp<T, kBMnMajor>{}, Layout<Shape<_2, _1, _1>>{}));
  // Each warpgroup computes the tail's rows for half the weight tile's columns.
  using TailMma = decltype(make_tiled_mma(TailMmaOp<T, kBMnMajor>{}, Layout<Shape<_2, _1, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}));
  using SmemLayoutTail = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                                Shape<Int<kTailRows>, Int<kTileK>, Int<kStages>>{}));
  using LayoutB = typename SmemLayoutB<kBMnMajor, T>::type;
  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kTileN * kTileK;
  static constexpr int kStageElemsTail = kTailRows * kTileK;

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<LayoutB>];
    alignas(1024) T tail[cosize_v<SmemLayoutTail>];  // A rows [row0 + 128, row0 + 128 + kTailRows)
    uint64_t full[kStages];
    uint64_t empty[kStages];
    int32_t tile_prefix[kCounterMaxExperts + 1];  // M tiles of the experts before e
    int32_t row_start[kCounterMaxExperts + 1];    // first row of expert e (clamped)
    int32_t stage_tile[kStages];  // the tile whose first K block a stage holds
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_90a allows 227 KB of dynamic shared memory per CTA");

  // The layouts the boxes are written into (before the swizzle, a function of the address as
  // TMA's is): A rows and K-major B rows are consecutive 128-byte rows; an MN-major B chunk's K
  // row k is its 128-byte row k, chunk c starts at c * 64 * 64; stages are whole blocks.
  using PlainA = decltype(get_nonswizzle_portion(SmemLayoutA{}));
  using PlainB = decltype(get_nonswizzle_portion(LayoutB{}));
  using PlainTail = decltype(get_nonswizzle_portion(SmemLayoutTail{}));
  static_assert(kTileK * sizeof(T) == 128, "one K block is one 128-byte swizzle row");
  static_assert(PlainA{}(_1{}, _0{}, _0{}) == kTileK && PlainA{}(_0{}, _0{}, _1{}) == kStageElemsA);
  static_assert(kBMnMajor || PlainB{}(_1{}, _0{}, _0{}) == kTileK);
  static_assert(!kBMnMajor || (PlainB{}(_1{}, _0{}, _0{}) == 1 && PlainB{}(_0{}, _1{}, _0{}) == kBoxN &&
                               PlainB{}(Int<kBoxN>{}, _0{}, _0{}) == kBoxN * kTileK));
  static_assert(PlainB{}(_0{}, _0{}, _1{}) == kStageElemsB);
  static_assert(PlainTail{}(_1{}, _0{}, _0{}) == kTileK && PlainTail{}(_0{}, _0{}, _1{}) == kStageElemsTail);
  static_assert(cosize_v<SmemLayoutA> == kStages * kStageElemsA && cosize_v<LayoutB> == kStages * kStageElemsB &&
                cosize_v<SmemLayoutTail> == kStages * kStageElemsTail);
};

__device__ __forceinline__ Tile locate_tile(int tile, int slices, const int32_t* tile_prefix,
                                            const int32_t* row_start, int experts) {
  return fused::locate<kTileM, kTileN, kTailRows>(tile, slices, tile_prefix, row_start, experts);
}

// The A boxes of one tile: the tile's rows and, past 128, its tail's.
struct ABoxes {
  int rows_box, tail_box;  // tail_box < 0: no tail
  __device__ __forceinline__ explicit ABoxes(const Tile& t)
      : rows_box(a_box_for(min(t.rows, kTileM))), tail_box(t.rows > kTileM ? a_box_for(t.rows - kTileM) : -1) {
    static_assert(a_box_rows(a_box_for(kTailRows)) == kTailRows, "no tail box is taller than the tail's buffer");
  }
  __device__ __forceinline__ int rows_loaded() const {
    return a_box_rows(rows_box) + (tail_box >= 0 ? a_box_rows(tail_box) : 0);
  }
};

// One stage's boxes: A rows [row0, row0 + box rows) x K [k0, k0 + 64) (and the tail's rows from
// row0 + 128), and W_e's 256 x 64 B tile.
template <class T, bool kBMnMajor>
__device__ __forceinline__ void load_stage(const Params& p, uint64_t* full, T* a_stage, T* tail_stage, T* b_stage,
                                           const Tile& t, const ABoxes& boxes, int k0) {
  constexpr uint64_t kEvictNormal = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
  SM90_TMA_LOAD_2D::copy(&p.a_maps[boxes.rows_box], full, kEvictNormal, a_stage, k0, t.row0);
  if (boxes.tail_box >= 0)
    SM90_TMA_LOAD_2D::copy(&p.a_maps[boxes.tail_box], full, kEvictNormal, tail_stage, k0, t.row0 + kTileM);
  if constexpr (kBMnMajor) {
#pragma unroll
    for (int c = 0; c < kTileN / kBoxN; ++c)
      SM90_TMA_LOAD_3D::copy(&p.b_map, full, kEvictNormal, b_stage + c * kBoxN * kTileK, t.n0 + c * kBoxN, k0,
                             t.expert);
  } else {
    SM90_TMA_LOAD_3D::copy(&p.b_map, full, kEvictNormal, b_stage, k0, t.n0, t.expert);
  }
}

// Thread 0: every K block of every tile the counter hands this CTA, then the stop stage.
template <class T, bool kBMnMajor>
__device__ void produce(const Params& p, typename Kernel<T, kBMnMajor>::Shared& s, int total_tiles, int slices) {
  using K = Kernel<T, kBMnMajor>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  using Tiles = fused::CountedTiles<1>;
  const int k_blocks = (p.k_in + kTileK - 1) / kTileK;
  StageRing<kStages> ring;
  fused::ClaimAhead<Tiles> walk(Tiles{fused::TileSchedule{p.schedule}, s.stage_tile, nullptr}, k_blocks);
  for (;;) {
    const int tile = walk.next();
    if (tile >= total_tiles) break;
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    const ABoxes boxes(t);
    // TMA counts every byte of a box, zero-filled ones included.
    const uint32_t stage_bytes = (boxes.rows_loaded() + kTileN) * kTileK * sizeof(T);
    for (int kb = 0; kb < k_blocks; ++kb) {
      walk.at_block(kb);
      fused::wait_barrier(&s.empty[ring.stage], ring.phase ^ 1, "counter producer, empty");
      const int stage = ring.stage;
      if (kb == 0) walk.tiles.publish(stage, tile);
      Barrier::arrive_and_expect_tx(&s.full[stage], stage_bytes);
      load_stage<T, kBMnMajor>(p, &s.full[stage], s.a + stage * K::kStageElemsA, s.tail + stage * K::kStageElemsTail,
                               s.b + stage * K::kStageElemsB, t, boxes, kb * kTileK);
      ring.advance();
    }
  }
  walk.tiles.stop(s.full, s.empty, ring, true, "counter producer, empty (end)");
}

// Rows m0 and m0 + 8 of the tile (this thread's), rounded to T, columns < N; the accumulator
// layout is check_quad_accumulator_layout's.
template <class T, class Accum>
__device__ __forceinline__ void store_tile(const Params& p, const Tile& t, const Accum& acc, int m0) {
  constexpr int kGroups = kTileN / 8;  // 8-column groups per row
  static_assert(decltype(size(acc))::value == 4 * kGroups, "two rows x two columns per group");
  const int quad_lane = threadIdx.x & 3;
  T* d = static_cast<T*>(p.d);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 8 * r;
    const bool stored = m < t.rows;
    const int64_t row = int64_t(t.row0) + m;
#pragma unroll
    for (int a = 0; a < kGroups / 4; ++a) {
      uint32_t words[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = 4 * (4 * a + j) + 2 * r;
        words[j] = fused::Pair<T>::pack(acc(i), acc(i + 1));
      }
      fused::quad_transpose(words);  // every lane: warp shuffles
      const int col = t.n0 + 8 * (4 * a + quad_lane);
      if (stored && col < p.n_out) fused::store16(d + row * p.n_out + col, words);
    }
  }
}

// The tail's rows (row0 + 128 + r, r < rows - 128) from the swapped accumulators, whose (M, N)
// coordinates are (column, tail row): one element a store, columns < N.
template <class T, class Accum, class Coords>
__device__ __forceinline__ void store_tail(const Params& p, const Tile& t, const Accum& acc, const Coords& coords) {
  const int tail_rows = t.rows - kTileM;
  T* d = static_cast<T*>(p.d);
#pragma unroll
  for (int i = 0; i < decltype(size(acc))::value; ++i) {
    const int col = t.n0 + get<0>(coords(i)), r = get<1>(coords(i));
    if (r < tail_rows && col < p.n_out) d[(int64_t(t.row0) + kTileM + r) * p.n_out + col] = T(acc(i));
  }
}

template <class T, bool kBMnMajor>
__device__ void consume(const Params& p, typename Kernel<T, kBMnMajor>::Shared& s, int slices) {
  using K = Kernel<T, kBMnMajor>;
  const int consumer_thread = threadIdx.x - 128;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const int k_blocks = (p.k_in + kTileK - 1) / kTileK;

  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::LayoutB{});
  auto thr = mma.get_thread_slice(consumer_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kTileN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  const int m0 = fused::check_quad_accumulator_layout(coords);

  typename K::TailMma tail_mma;
  Tensor sTail = make_tensor(make_smem_ptr(s.tail), typename K::SmemLayoutTail{});
  auto tail_thr = tail_mma.get_thread_slice(consumer_thread);
  Tensor tTrW = tail_thr.make_fragment_A(tail_thr.partition_A(sB));  // the weight tile as A
  Tensor tTrX = tail_thr.make_fragment_B(tail_thr.partition_B(sTail));
  Tensor tail_acc = partition_fragment_C(tail_mma, Shape<Int<kTileN>, Int<kTailRows>>{});
  Tensor tail_coords = tail_thr.partition_C(make_identity_tensor(Shape<Int<kTileN>, Int<kTailRows>>{}));

  const int first_row = (consumer_thread / 128) * (kTileM / 2);  // this warpgroup's rows
  StageRing<kStages> ring;
  for (;;) {
    const int tile = fused::next_published_tile(ring, s.full, s.stage_tile);
    if (tile == fused::kNoMoreTiles) break;
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    if (t.rows <= first_row) {
      // An expert's last tile with at most 64 rows: this warpgroup has none and leaves the
      // tensor cores to the other one (the fused fc1 measured the skip as a gain; both
      // warpgroups on half the columns each measured the same as this, bench/README).
      fused::pass_k_blocks(ring, s.full, s.empty, k_blocks, warp_leader);
      continue;
    }
    if (t.rows <= kTileM) {
      fused::mma_k_blocks<false>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc);
      store_tile<T>(p, t, acc, m0);
      continue;
    }
    // 128 rows and a tail: both MMAs on every stage.
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    tail_mma.accumulate_ = GMMA::ScaleOut::Zero;
    fused::wgmma_k_blocks<false>(
        ring, s.full, s.empty, k_blocks, warp_leader,
        [&](int stage) {
          fused::wgmma_stage(mma, tCrA, tCrB, acc, stage);
          fused::wgmma_stage(tail_mma, tTrW, tTrX, tail_acc, stage);
        },
        [&] {
          warpgroup_fence_operand(acc);
          warpgroup_fence_operand(tail_acc);
        });
    store_tile<T>(p, t, acc, m0);
    store_tail<T>(p, t, tail_acc, tail_coords);
  }
}

template <class T, bool kBMnMajor>
__global__ void __launch_bounds__(kThreads, 1) counter_gemm_kernel(const __grid_constant__ Params p) {
  using K = Kernel<T, kBMnMajor>;
  extern __shared__ uint8_t raw[];
  auto& s = fused::aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;

  // Nothing the argument kernel writes is read before this point's wait.
  if (threadIdx.x == 32) fused::init_stage_barriers<kStages>(s.full, s.empty, 1, kConsumerWarps);
  if (threadIdx.x == 64) {
    for (int i = 0; i < kABoxes; ++i) cute::prefetch_tma_descriptor(&p.a_maps[i]);
    cute::prefetch_tma_descriptor(&p.b_map);
  }
  grid_dependency_wait();
  if (warp == 0) {
    fused::build_tile_prefix<kTileM, kTailRows>(p.row_offsets, p.experts, p.capacity, s.tile_prefix, s.row_start);
  }
  __syncthreads();

  const int slices = (p.n_out + kTileN - 1) / kTileN;
  const int total_tiles = s.tile_prefix[p.experts] * slices;
  if (warp < 4) {
    // The producer needs few registers: 40 + 2 x 232 = 504 = 3 x 168, what the launch holds.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) produce<T, kBMnMajor>(p, s, total_tiles, slices);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    consume<T, kBMnMajor>(p, s, slices);
  }
}

capmoe_status_t encode_maps(const capmoe_grouped_gemm_desc_t& d, bool b_mn_major, int64_t k_in, int64_t n_out,
                            const void* a, const void* b, Params* p) {
  const cuuint64_t elem = 2;
  const cuuint64_t a_dims[2] = {cuuint64_t(k_in), cuuint64_t(d.capacity)};
  const cuuint64_t a_strides[1] = {cuuint64_t(k_in) * elem};
  for (int i = 0; i < kABoxes; ++i) {
    const cuuint32_t a_box[2] = {kTileK, cuuint32_t(a_box_rows(i))};
    CAPMOE_TRY(tma_encode(&p->a_maps[i], d.dtype, a, 2, a_dims, a_strides, a_box));
  }
  const cuuint64_t matrix_bytes = cuuint64_t(k_in * n_out) * elem;
  if (b_mn_major) {
    const cuuint64_t b_dims[3] = {cuuint64_t(n_out), cuuint64_t(k_in), cuuint64_t(d.num_experts)};
    const cuuint64_t b_strides[2] = {cuuint64_t(n_out) * elem, matrix_bytes};
    const cuuint32_t b_box[3] = {kBoxN, kTileK, 1};
    return tma_encode(&p->b_map, d.dtype, b, 3, b_dims, b_strides, b_box);
  }
  const cuuint64_t b_dims[3] = {cuuint64_t(k_in), cuuint64_t(n_out), cuuint64_t(d.num_experts)};
  const cuuint64_t b_strides[2] = {cuuint64_t(k_in) * elem, matrix_bytes};
  const cuuint32_t b_box[3] = {kTileK, kTileN, 1};
  return tma_encode(&p->b_map, d.dtype, b, 3, b_dims, b_strides, b_box);
}

// The VariantFn body: T the element type, kBMnMajor the RR majorness (W's output columns
// contiguous).
template <class T, bool kBMnMajor>
capmoe_status_t run(const Launch& launch, uint64_t* workspace_bytes) {
  const capmoe_grouped_gemm_desc_t& d = *launch.desc;
  if (!counter_takes(d)) return CAPMOE_ERR_UNSUPPORTED;
  if (workspace_bytes) {
    *workspace_bytes = Workspace::bytes(d.num_experts);
    return CAPMOE_OK;
  }
  if (launch.workspace_bytes < Workspace::bytes(d.num_experts)) return CAPMOE_ERR_WORKSPACE_TOO_SMALL;
  const bool fprop = d.op == CAPMOE_GEMM_FPROP;
  const int64_t k_in = fprop ? d.k : d.n, n_out = fprop ? d.n : d.k;
  const Workspace ws = Workspace::carve(launch.workspace, d.num_experts);

  // Everything that can fail on the host comes before the first launch, so a failure never
  // leaves the argument kernel on the stream without its GEMM.
  Params p{};
  const bool gemm = d.capacity > 0;  // no row to compute: the argument kernel alone (flags)
  if (gemm) CAPMOE_TRY(encode_maps(d, kBMnMajor, k_in, n_out, launch.a, launch.b, &p));
  p.d = launch.d;
  p.row_offsets = ws.row_offsets;
  p.schedule = ws.schedule;
  p.experts = int32_t(d.num_experts);
  p.k_in = int32_t(k_in);
  p.n_out = int32_t(n_out);
  p.capacity = int32_t(d.capacity);

  (void)cudaGetLastError();
  CAPMOE_TRY(launch_counter_arguments<T>(launch, ws));
  if (!gemm) return CAPMOE_OK;
  const int64_t tiles = counter_max_tiles(d);
  const int grid = int(tiles < d.sm_count ? tiles : d.sm_count);
  return launch_counter_kernel(&counter_gemm_kernel<T, kBMnMajor>, p, grid, kThreads, Kernel<T, kBMnMajor>::kSmemBytes,
                               launch.stream);
}

}  // namespace
}  // namespace capmoe::gg::counter

namespace capmoe::gg {

capmoe_status_t variant_sm90_rc_bf16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::bfloat16_t, false>(launch, workspace_bytes);
}
capmoe_status_t variant_sm90_rr_bf16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::bfloat16_t, true>(launch, workspace_bytes);
}
capmoe_status_t variant_sm90_rc_f16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::half_t, false>(launch, workspace_bytes);
}
capmoe_status_t variant_sm90_rr_f16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::half_t, true>(launch, workspace_bytes);
}

}  // namespace capmoe::gg
