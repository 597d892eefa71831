// capmoe-archs: 90a
// The hand-written grouped WGRAD of config SM90_COUNTER (16-bit in and out, one dW tensor, at
// most CAPMOE_FUSED_MAX_EXPERTS experts): dW_e = dY_e^T X_e ([E, N, K]) or X_e^T dY_e
// ([E, K, N]), the reduction running over expert e's rows, a count known only on the device
// (grouped_gemm.h's contract; an expert without rows gets dW_e = 0).
//
// Why a kernel of its own: CUTLASS's pointer-array wgrad ran at 1.8-2.3x its roofline on the
// H200 (bench/README "What wgrad's cycles go to"). With ~256 rows per expert a 128 x 256 tile
// is four K blocks of 64 rows, and its output (64 KB in bf16; dW is 0.8-1.9 GB at the bench
// shapes) takes about as long to reach HBM as its MMAs take, and CUTLASS switches per-expert
// tensor maps at nearly every tile. Here:
//  - one TMA map per operand over all `capacity` rows, the expert's rows a coordinate range
//    (the argument kernel's clamped row offsets), and one 3-D map over dW;
//  - the tile's output goes to shared memory and leaves by TMA store, which runs on while the
//    consumers start the next tile's MMAs (H200: without any dW store the kernel is ~20 %
//    faster at the E >= 32 shapes, so the overlap is partial; bench/README says what else was
//    tried);
//  - within an expert the tiles of dW's shorter side run first, so that a wave of CTAs shares
//    one slice of the longer operand (mixtral's 58 MB dY_e, more than L2, is then read once);
//  - tiles handed out by the device counter (fused/tile_source.cuh's CountedTiles), so experts
//    of unequal row counts balance over the CTAs.
//
// A second form of the kernel, the column-split one (namespace split below), overlaps one
// consumer's epilogue with the other's MMAs. It runs where experts have few rows on average
// (the epilogue is then a large share of a tile), the cooperative one where they have many
// (choose_form below; bench/README.md "The column-split counter wgrad" has the A/B).
//
// MMA view: the GEMM's M is dW's row (128 a tile), N its column (256), K the expert's rows.
// Both operands are MN-major (a row of dY or X is contiguous in the columns that become dW's
// rows or columns): each TMA box is 64 columns x 64 rows, 128-byte swizzled, which is one
// K-block of GMMA's MN-major SW128 layout (K atoms first, as wgrad_gather_sm90.cu lays them).
// Per CTA (persistent, 384 threads): warp 0 copies the row offsets into shared memory; thread
// 0 produces (per tile, per 64-row K block: 2 boxes of A and 4 of B; an expert without rows
// gets one stage with no loads, which only tells the consumers the tile); warpgroups 1 and 2
// consume, 64 dW rows each, one 64x256x16 wgmma per 16 rows.
//
// The expert's last K block: TMA loads 64 rows from the block's first, so rows past the
// expert's end are the next expert's (or, past offsets[E], whatever the buffer holds, NaN
// included; past `capacity`, TMA's zero fill). The consumers skip the wgmmas of 16-row steps
// wholly past the end and zero the rows of the last step that lie past it, in both operands
// (0 x NaN is NaN), then fence them for the async proxy before any wgmma reads the stage.
#include "common/tma_encode.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <optional>
#include <string>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include "common/device_primitives.cuh"
#include "fused/accumulator_layout.cuh"
#include "fused/pair.cuh"
#include "fused/pipeline.cuh"
#include "fused/tile_source.cuh"
#include "fused/wgrad_tiles.cuh"
#include "grouped_gemm/counter.h"
#include "grouped_gemm/counter_launch.cuh"
#include "grouped_gemm/counter_wgrad_gather.h"
#include "grouped_gemm/launch.h"

namespace capmoe::gg::counter {
namespace {

using namespace cute;
using fused::StageRing;

constexpr int kTileM = kCounterWgradTileM;  // dW rows
constexpr int kTileN = kCounterWgradTileN;  // dW columns
constexpr int kTileK = 64;                  // expert rows per K block
constexpr int kBox = 64;                    // columns per TMA box: one 128-byte line of 16-bit values
constexpr int kStepRows = 16;               // rows per wgmma
constexpr int kStages = 3;                  // 3 x 48 KB + the 64 KB output tile fit in 227 KB
constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kWarpgroupRows = kTileM / 2;  // dW rows of one consumer warpgroup
constexpr int kABoxes = kTileM / kBox, kBBoxes = kTileN / kBox;

// Named barriers (0 is __syncthreads): one per consumer warpgroup for its output tile, one for
// both around the zeroing of a stage they both read.
constexpr int kOutputBarrier = 2;  // + the warpgroup's index
constexpr int kZeroBarrier = 4;

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

struct Params {
  CUtensorMap a_map;  // A: [capacity, M] (dY for [E, N, K], X for [E, K, N]), box 64 x 64
  CUtensorMap b_map;  // B: [capacity, N'] (the other one), box 64 x 64
  CUtensorMap d_map;  // dW: [E, M, N'], box 64 x 64 x 1 (stores)
  const int64_t* row_offsets;  // E + 1 row starts: the argument kernel's (clamped), or the
                               // routing build's offsets (gathered form, clamped here)
  int32_t* schedule;           // the tile counter's words (fused/tile_schedule.cuh)
  int32_t experts, m_tiles, n_tiles;
  // The gathered form only (capmoe_wgrad_gather, one operand GATHERED): that operand's rows
  // come by cp.async from `gathered` ([max_tokens, gathered_cols]) through token_of_row; its
  // TMA map is unused.
  const void* gathered;
  const int32_t* token_of_row;
  int32_t gathered_cols, max_tokens, capacity;
};

// Which operand, if any, the kernel reads through token_of_row instead of by TMA.
enum class Gather { None, A, B };

template <class T>
using MmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kTileN>, _16>, GMMA::Major::MN,
                                            GMMA::Major::MN>());
static_assert(std::is_same_v<MmaOp<cutlass::bfloat16_t>,
                             SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>>);

template <class T>
struct Kernel {
  using TiledMma = decltype(make_tiled_mma(MmaOp<T>{}, Layout<Shape<_2, _1, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kTileN * kTileK;
  static constexpr int kBoxElems = kBox * kTileK;

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    alignas(1024) T out[2][kWarpgroupRows * kTileN];  // per consumer warpgroup: 4 boxes of 64 x 64
    uint64_t full[kStages];
    uint64_t empty[kStages];
    int32_t row_start[kCounterMaxExperts + 1];  // first row of expert e (clamped)
    int32_t stage_tile[kStages];                // the tile whose first K block a stage holds
    int32_t handoff;                            // the gathered producers' fetched tile (CountedTiles<128>)
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "sm_90a allows 227 KB of dynamic shared memory per CTA");

  // Where TMA writes a box (before the swizzle, a function of the address as TMA's is): the
  // box of columns [64c, 64c + 64) is the block at c * 64 * 64, its row r the 128-byte line r.
  using PlainA = decltype(get_nonswizzle_portion(SmemLayoutA{}));
  using PlainB = decltype(get_nonswizzle_portion(SmemLayoutB{}));
  static_assert(kBox * sizeof(T) == 128, "one box row is one 128-byte swizzle line");
  static_assert(PlainA{}(_1{}, _0{}, _0{}) == 1 && PlainA{}(_0{}, _1{}, _0{}) == kBox &&
                PlainA{}(Int<kBox>{}, _0{}, _0{}) == kBoxElems && PlainA{}(_0{}, _0{}, _1{}) == kStageElemsA);
  static_assert(PlainB{}(_1{}, _0{}, _0{}) == 1 && PlainB{}(_0{}, _1{}, _0{}) == kBox &&
                PlainB{}(Int<kBox>{}, _0{}, _0{}) == kBoxElems && PlainB{}(_0{}, _0{}, _1{}) == kStageElemsB);
  static_assert(cosize_v<SmemLayoutA> == kStages * kStageElemsA && cosize_v<SmemLayoutB> == kStages * kStageElemsB);
};

// One output tile: expert, dW corner, and the expert's rows (the reduction).
struct WgradTile {
  int expert, m0, n0, row0, rows;
  __device__ __forceinline__ int k_blocks() const { return (rows + kTileK - 1) / kTileK; }
};

// Tile `tile` of the list: every expert owns m_tiles x n_tiles tiles (dW's shape is fixed); the
// side with fewer tiles runs fastest (the header says why). Its rows are the caller's (the split
// form's consumers read them from the stage the tile was published in).
__device__ __forceinline__ WgradTile locate_corner(const Params& p, int tile, int row0, int rows) {
  const int per_expert = p.m_tiles * p.n_tiles;
  const int e = tile / per_expert, r = tile - e * per_expert;
  const bool m_fastest = p.m_tiles <= p.n_tiles;
  const int m = m_fastest ? r % p.m_tiles : r / p.n_tiles, n = m_fastest ? r / p.m_tiles : r % p.n_tiles;
  return {e, m * kTileM, n * kTileN, row0, rows};
}

// The same, its rows from every expert's row start. NOTE: not written over locate_corner, which
// changes the cooperative kernel's generated code (same results), unmeasured while no GPU ran it.
__device__ __forceinline__ WgradTile locate(const Params& p, int tile, const int32_t* row_start) {
  const int per_expert = p.m_tiles * p.n_tiles;
  const int e = tile / per_expert, r = tile - e * per_expert;
  const int row0 = row_start[e];
  const bool m_fastest = p.m_tiles <= p.n_tiles;
  const int m = m_fastest ? r % p.m_tiles : r / p.n_tiles, n = m_fastest ? r / p.m_tiles : r % p.n_tiles;
  return {e, m * kTileM, n * kTileN, row0, row_start[e + 1] - row0};
}

// locate() of either form: the gathered form's row starts are the caller's offsets clamped one
// by one, which need not ascend, and an expert whose end is not past its start has no rows
// (capturable_moe/wgrad_gather.h). The argument kernel's ascend.
template <Gather G>
__device__ __forceinline__ WgradTile locate_rows(const Params& p, int tile, const int32_t* row_start) {
  WgradTile t = locate(p, tile, row_start);
  if constexpr (G != Gather::None) t.rows = max(t.rows, 0);
  return t;
}

// One stage's TMA boxes of rows [row0, row0 + 64): A's columns [m0, m0 + 128) and B's
// [n0, n0 + 256), but not those of the operand G names (the gathered form copies it itself).
template <class T, Gather G>
__device__ __forceinline__ void load_tma_boxes(const Params& p, uint64_t* full, T* a_stage, T* b_stage,
                                               const WgradTile& t, int row0) {
  constexpr uint64_t hint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
  constexpr int kBoxElems = Kernel<T>::kBoxElems;
  if constexpr (G != Gather::A) {
#pragma unroll
    for (int c = 0; c < kABoxes; ++c)
      SM90_TMA_LOAD_2D::copy(&p.a_map, full, hint, a_stage + c * kBoxElems, t.m0 + c * kBox, row0);
  }
  if constexpr (G != Gather::B) {
#pragma unroll
    for (int c = 0; c < kBBoxes; ++c)
      SM90_TMA_LOAD_2D::copy(&p.b_map, full, hint, b_stage + c * kBoxElems, t.n0 + c * kBox, row0);
  }
}

// The bytes load_tma_boxes<T, G> brings into a stage (TMA counts zero-filled ones too).
template <class T, Gather G>
constexpr uint32_t kTmaStageBytes =
    ((G != Gather::A ? Kernel<T>::kStageElemsA : 0) + (G != Gather::B ? Kernel<T>::kStageElemsB : 0)) * sizeof(T);

// The producer: every K block of every tile the counter hands this CTA (one stage without
// loads for an expert without rows), then the stop stage.
//  - Gather::None (the grouped GEMM's WGRAD): thread 0 alone, both operands by TMA.
//  - Gather::A / B: the 128 threads of the producer warpgroup. Thread 0 arms each stage with
//    the plain operand's bytes and loads its boxes by TMA; every thread copies its 16-byte
//    chunks of the gathered operand's rows (fused/wgrad_tiles.cuh: the chunks land where TMA's
//    128-byte swizzle would put them, zero-filled past the expert's rows and for invalid
//    tokens) and arrives when they land, so the full barriers take 1 + 128 arrivals, the stop
//    stage's too. A block's row tokens are loaded right after the block before it is sent and
//    read only once the next stage is free: the load's round trip runs beside that wait instead
//    of before the arrival. (H100, 2026-12-07: checking each token as it was loaded put that
//    round trip between every block's copies and its arrival; fetching two blocks ahead
//    instead was 3-6 % slower, and 32-row blocks, two per stage with barriers of their own so
//    that six were in flight, 26-36 % slower: bench/results/gemm_gathered_counter_wgrad_*.)
// The next tile is claimed as soon as the current one is known: tiles are a few K blocks long,
// and the counter's atomic then runs beside this tile's loads.
template <class T, Gather G>
__device__ void produce(const Params& p, typename Kernel<T>::Shared& s, int total_tiles) {
  using K = Kernel<T>;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr bool kGathered = G != Gather::None;
  constexpr bool kGatherA = G == Gather::A;
  constexpr int kGatheredCols = kGatherA ? kTileM : kTileN;  // of the gathered operand, per tile
  using Sources = fused::BlockSources<kGatheredCols>;
  const bool arms = !kGathered || threadIdx.x == 0;  // publishes tiles, arms stages, issues TMA
  const T* gathered = static_cast<const T*>(p.gathered);
  fused::CountedTiles<kGathered ? 128 : 1> tiles{fused::TileSchedule{p.schedule}, s.stage_tile,
                                                 kGathered ? &s.handoff : nullptr};
  StageRing<kStages> ring;
  int claimed = 0;
  tiles.claim(claimed);
  for (;;) {
    const int tile = tiles.hand_over(claimed);
    if (tile >= total_tiles) break;
    tiles.claim(claimed);
    const WgradTile t = locate_rows<G>(p, tile, s.row_start);
    const int k_blocks = t.k_blocks();
    const int row_end = t.row0 + t.rows;
    int32_t token = Sources::load_token(kGathered, p.token_of_row, t.row0, row_end);
    for (int kb = 0; kb < max(k_blocks, 1); ++kb) {
      fused::wait_barrier(&s.empty[ring.stage], ring.phase ^ 1, "counter wgrad producer, empty");
      const int stage = ring.stage;
      const int row = t.row0 + kb * kTileK;
      T* a_stage = s.a + stage * K::kStageElemsA;
      T* b_stage = s.b + stage * K::kStageElemsB;
      if (arms) {
        if (kb == 0) tiles.publish(stage, tile);
        if (k_blocks == 0) {
          Barrier::arrive(&s.full[stage]);
        } else {
          Barrier::arrive_and_expect_tx(&s.full[stage], kTmaStageBytes<T, G>);
          load_tma_boxes<T, G>(p, &s.full[stage], a_stage, b_stage, t, row);
        }
      }
      if constexpr (kGathered) {
        if (k_blocks > 0) {
          const uint32_t source = Sources::source_of(token, p.max_tokens, p.gathered_cols);
          fused::copy_wgrad_block<T, kGatheredCols>(gathered, p.gathered_cols, p.gathered_cols, true, source, row,
                                                    row_end, kGatherA ? t.m0 : t.n0,
                                                    reinterpret_cast<uint8_t*>(kGatherA ? a_stage : b_stage));
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
        token = Sources::load_token(true, p.token_of_row, row + kTileK, row_end);
      }
      ring.advance();
    }
  }
  if (tiles.stop(s.full, s.empty, ring, arms, "counter wgrad producer, empty (end)") && kGathered) {
    cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);  // the stop stage's other 128 arrivals
  }
  if constexpr (kGathered) cute::cp_async_wait<0>();  // no thread exits with copies in flight
}

// Rows [first, end) of one stage's boxes, in the operands TMA loaded (both, or the plain one of
// the gathered form: cp.async zero-filled the gathered one's rows past the end, and a second
// writer of those bytes would only race the producer's next fill in racecheck's view), set to
// zero by the 256 consumer threads; the caller fences and syncs them before any wgmma reads the
// stage. A box row is one 128-byte line whatever the swizzle (which permutes 16-byte chunks
// within a line).
template <class T, Gather G>
__device__ __forceinline__ void zero_stage_rows(T* a_stage, T* b_stage, int first, int end, int consumer_thread) {
  constexpr int kChunks = kBox * sizeof(T) / 16;  // 16-byte chunks per line
  constexpr int kBoxElems = Kernel<T>::kBoxElems;
  // Boxes [kFirstBox, kFirstBox + kBoxes) of A's kABoxes followed by B's kBBoxes.
  constexpr int kFirstBox = G == Gather::A ? kABoxes : 0;
  constexpr int kBoxes = G == Gather::None ? kABoxes + kBBoxes : G == Gather::A ? kBBoxes : kABoxes;
  const int rows = end - first;
  const int items = rows * kBoxes * kChunks;
  for (int i = consumer_thread; i < items; i += kConsumerThreads) {
    const int chunk = i % kChunks, line = i / kChunks;
    const int row = first + line % rows, box = kFirstBox + line / rows;
    T* base = box < kABoxes ? a_stage + box * kBoxElems : b_stage + (box - kABoxes) * kBoxElems;
    reinterpret_cast<uint4*>(base + row * kBox)[chunk] = make_uint4(0, 0, 0, 0);
  }
}

// One batch of wgmmas over the first kSteps 16-row steps of a stage (A's and B's: the split
// form keeps them in separate rings).
template <int kSteps, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void issue_steps(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc, int stage_a,
                                            int stage_b) {
  warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    cute::gemm(mma, tCrA(_, _, k, stage_a), tCrB(_, _, k, stage_b), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// A consumer warpgroup's mainloop over one tile of k_blocks >= 1 blocks (fused/pipeline.cuh's
// wgmma_k_blocks, with the expert's last block cut at its last row): acc = the tile's A x B.
// The whole blocks run with one batch in flight; the last block, whose 16-row step count is a
// branch, comes after them: ptxas completes every wgmma batch issued under a branch before the
// branch ends (WARPGROUP.DEPBAR 0), which inside the loop would serialize every block.
// G != Gather::None: the gathered form, whose stages cp.async wrote in part (the generic proxy,
// which wgmma may read only after a proxy fence).
template <class T, Gather G, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void mma_tile(StageRing<kStages>& ring, typename Kernel<T>::Shared& s, const WgradTile& t,
                                         bool warp_leader, int consumer_thread, Mma& mma, FragA& tCrA, FragB& tCrB,
                                         Acc& acc) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using K = Kernel<T>;
  constexpr int kSteps = kTileK / kStepRows;
  const int last = t.k_blocks() - 1;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  int previous = -1;
  auto wait_full = [&](int stage) {
    fused::wait_barrier(&s.full[stage], ring.phase, "counter wgrad consumer, full");
    __syncwarp();  // wgmma's .sync.aligned instructions need the warp converged
    if constexpr (G != Gather::None) cutlass::arch::fence_view_async_shared();
  };
  for (int kb = 0; kb < last; ++kb) {
    const int stage = ring.stage;
    wait_full(stage);
    warpgroup_fence_operand(acc);
    issue_steps<kSteps>(mma, tCrA, tCrB, acc, stage, stage);
    // Keep one batch in flight: the previous stage's wgmmas are done once this returns.
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    if (previous >= 0 && warp_leader) Barrier::arrive(&s.empty[previous]);
    previous = stage;
    ring.advance();
  }
  const int stage = ring.stage;
  wait_full(stage);
  const int rows = t.rows - last * kTileK;  // 1..64
  const int steps = (rows + kStepRows - 1) / kStepRows;
  if (rows % kStepRows != 0) {
    zero_stage_rows<T, G>(s.a + stage * K::kStageElemsA, s.b + stage * K::kStageElemsB, rows, steps * kStepRows,
                       consumer_thread);
    cutlass::arch::fence_view_async_shared();  // the zeros, generic proxy -> wgmma's reads
    named_barrier(kZeroBarrier, kConsumerThreads);
  }
  warpgroup_fence_operand(acc);
  // Each branch a whole batch (arrive, wgmmas, commit): wgmmas under a condition inside one
  // batch are serialized by ptxas (C7520).
  switch (steps) {
    case 1: issue_steps<1>(mma, tCrA, tCrB, acc, stage, stage); break;
    case 2: issue_steps<2>(mma, tCrA, tCrB, acc, stage, stage); break;
    case 3: issue_steps<3>(mma, tCrA, tCrB, acc, stage, stage); break;
    default: issue_steps<kSteps>(mma, tCrA, tCrB, acc, stage, stage); break;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (warp_leader) {
    if (previous >= 0) Barrier::arrive(&s.empty[previous]);
    Barrier::arrive(&s.empty[stage]);
  }
  ring.advance();
}

// The warpgroup's 64 rows of the tile, rounded to T, into its output boxes in shared memory and
// out by TMA store (which clips at dW's edges). The boxes are free once the warpgroup's previous
// stores have read them; those were issued a whole tile ago. `row` is this thread's first row
// in the warpgroup's 64 (the accumulator layout is check_quad_accumulator_layout's).
template <class T, class Accum>
__device__ __forceinline__ void store_tile(const Params& p, T* out, const WgradTile& t, const Accum& acc, int row,
                                           int warpgroup, bool storing_thread) {
  constexpr int kGroups = kTileN / 8;  // 8-column groups: 16-byte chunks
  constexpr int kBoxElems = Kernel<T>::kBoxElems;
  static_assert(decltype(size(acc))::value == 4 * kGroups, "two rows x two columns per group");
  if (storing_thread) tma_store_wait<0>();
  named_barrier(kOutputBarrier + warpgroup, 128);
  // Column group g of row m goes to box g / 8, line m, 16-byte chunk (g % 8) XOR (m % 8) (the
  // 128-byte swizzle), this lane's word of it at quad_lane: one pointer per g % 8, shared by
  // both rows (m % 8 is the same) and every box (a fixed offset). The 8 rows of a warp's store
  // hit 8 different chunks, so its 32 words take 32 different banks.
  uint32_t* chunk_word[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    chunk_word[j] = reinterpret_cast<uint32_t*>(out + row * kBox + ((j ^ (row % 8)) * 8)) + (threadIdx.x & 3);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = 4 * g + 2 * r;
      chunk_word[g % 8][((g / 8) * kBoxElems + 8 * r * kBox) / 2] = fused::Pair<T>::pack(acc(i), acc(i + 1));
    }
  }
  cutlass::arch::fence_view_async_shared();  // the tile, generic proxy -> TMA's reads
  named_barrier(kOutputBarrier + warpgroup, 128);
  if (storing_thread) {
    const int m0 = t.m0 + warpgroup * kWarpgroupRows;
#pragma unroll
    for (int c = 0; c < kBBoxes; ++c)
      SM90_TMA_STORE_3D::copy(&p.d_map, out + c * kBoxElems, t.n0 + c * kBox, m0, t.expert);
    tma_store_arrive();
  }
}

template <class T, Gather G>
__device__ void consume(const Params& p, typename Kernel<T>::Shared& s) {
  using K = Kernel<T>;
  const int consumer_thread = threadIdx.x - 128;
  const int warpgroup = consumer_thread / 128;
  const bool warp_leader = (threadIdx.x & 31) == 0;
  const bool storing_thread = consumer_thread % 128 == 0;

  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename K::SmemLayoutB{});
  auto thr = mma.get_thread_slice(consumer_thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kTileN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  const int row = fused::check_quad_accumulator_layout(coords) - warpgroup * kWarpgroupRows;

  StageRing<kStages> ring;
  for (;;) {
    const int tile = fused::next_published_tile(ring, s.full, s.stage_tile);
    if (tile == fused::kNoMoreTiles) break;
    const WgradTile t = locate_rows<G>(p, tile, s.row_start);
    if (t.rows == 0) {
      // An expert without rows: its stage carried only the tile; dW_e = 0.
      fused::pass_k_blocks(ring, s.full, s.empty, 1, warp_leader);
#pragma unroll
      for (int i = 0; i < size(acc); ++i) acc(i) = 0.0f;
    } else {
      mma_tile<T, G>(ring, s, t, warp_leader, consumer_thread, mma, tCrA, tCrB, acc);
    }
    store_tile<T>(p, s.out[warpgroup], t, acc, row, warpgroup, storing_thread);
  }
  // The stores must have read the output boxes before the CTA's shared memory goes, and be
  // complete before the grid is.
  if (storing_thread) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// G: Gather::None is the grouped GEMM's WGRAD (the argument kernel's clamped offsets, both
// operands by TMA); A or B the gathered form (capmoe_wgrad_gather through
// launch_gathered_wgrad: that operand by cp.async from the producer warpgroup).
template <class T, Gather G>
__global__ void __launch_bounds__(kThreads, 1) counter_wgrad_kernel(const __grid_constant__ Params p) {
  using K = Kernel<T>;
  constexpr bool kGathered = G != Gather::None;
  extern __shared__ uint8_t raw[];
  auto& s = fused::aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;

  // Nothing the kernel before this one writes is read before this point's wait.
  if (threadIdx.x == 32) {
    const uint32_t full_arrivals = kGathered ? 1 + fused::kWgradProducerThreads : 1;
    fused::init_stage_barriers<kStages>(s.full, s.empty, full_arrivals, kConsumerWarps);
  }
  if (threadIdx.x == 64) {
    if constexpr (G != Gather::A) cute::prefetch_tma_descriptor(&p.a_map);
    if constexpr (G != Gather::B) cute::prefetch_tma_descriptor(&p.b_map);
    cute::prefetch_tma_descriptor(&p.d_map);
  }
  grid_dependency_wait();
  if (warp == 0) {
    for (int e = threadIdx.x; e <= p.experts; e += 32) {
      if constexpr (kGathered) {
        s.row_start[e] = fused::clamp_wgrad_row(p.row_offsets[e], p.capacity);
      } else {
        s.row_start[e] = int32_t(p.row_offsets[e]);
      }
    }
  }
  __syncthreads();

  const int total_tiles = p.experts * p.m_tiles * p.n_tiles;  // <= INT32_MAX - grid (counter_wgrad_takes)
  if (warp < 4) {
    // The producer needs few registers: 40 + 2 x 232 = 504 = 3 x 168, what the launch holds.
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (kGathered || threadIdx.x == 0) produce<T, G>(p, s, total_tiles);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    consume<T, G>(p, s);
  }
}

// ---------------------------------------------------------------------------------------------
// The column-split form: the same tiles, maps and tile order, but consumer warpgroup c owns
// columns [n0 + 128c, n0 + 128c + 128) of the tile (all 128 rows: two 64x128x16 wgmmas per
// 16-row step) and runs at its own pace, so that one's epilogue runs while the other's MMAs
// keep the tensor cores busy. A (the 128 columns
// that become dW's rows) is shared, in a ring of kStagesA stages; each warpgroup's B half has
// a ring of kStagesB of its own, so the second warpgroup can lag the first without holding the
// first's B loads back. Warpgroup 1 writes a tile's output only after warpgroup 0 has written
// its own (out_written[0], which the storer waits on too), which keeps them an epilogue apart:
// left alone they fall into step and both epilogues stop the tensor cores at once. Each warpgroup has
// its output tile (32 KB); a storer thread sends them out by TMA store, so the consumers never
// wait for a store's progress. Roles (384 threads): thread 0 claims tiles and loads A and B
// half 0; thread 32 follows the tiles thread 0 publishes and loads half 1; thread 64 stores;
// warpgroups 1 and 2 consume.
namespace split {

constexpr int kHalfN = kTileN / 2;  // columns of one consumer warpgroup
constexpr int kHalfBoxes = kHalfN / kBox;
constexpr int kRowBoxes = kTileM / kBox;  // 64-row boxes of an output tile
constexpr int kConsumerBarrier = 2;       // + c: consumer warpgroup c's 128 threads

template <class T>
using MmaOp = decltype(GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kHalfN>, _16>, GMMA::Major::MN,
                                            GMMA::Major::MN>());

// 4 A stages and 3 of each B half (224 KB with the two output tiles): of the three splits
// measured (4/3, 5/2, 6/2) the fastest on every bench shape (bench/README).
template <class T>
struct Kernel {
  static constexpr int kStagesA = 4, kStagesB = 3;
  using TiledMma = decltype(make_tiled_mma(MmaOp<T>{}, Layout<Shape<_1, _1, _1>>{}));
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStagesA>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kHalfN>, Int<kTileK>, Int<kStagesB>>{}, Step<_2, _1, _3>{}));
  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kHalfN * kTileK;
  static constexpr int kBoxElems = kBox * kTileK;
  static constexpr uint32_t kStageBytesA = kStageElemsA * sizeof(T);
  static constexpr uint32_t kStageBytesB = kStageElemsB * sizeof(T);

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[2][cosize_v<SmemLayoutB>];
    alignas(1024) T out[2][kTileM * kHalfN];  // per consumer: box 2h + c holds rows 64h.., columns 64c..
    uint64_t full_a[kStagesA], empty_a[kStagesA], masked_a[kStagesA];
    uint64_t full_b[2][kStagesB], empty_b[2][kStagesB];
    uint64_t out_written[2], out_free[2];
    int32_t stage_tile[kStagesA], stage_row0[kStagesA], stage_rows[kStagesA];  // per tile's first A stage
    int32_t out_expert[2], out_m0[2], out_n0[2];  // the tile in out[c] (out_expert < 0: no more)
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "sm_90a allows 227 KB of dynamic shared memory per CTA");

  using PlainA = decltype(get_nonswizzle_portion(SmemLayoutA{}));
  using PlainB = decltype(get_nonswizzle_portion(SmemLayoutB{}));
  static_assert(PlainA{}(_1{}, _0{}, _0{}) == 1 && PlainA{}(_0{}, _1{}, _0{}) == kBox &&
                PlainA{}(Int<kBox>{}, _0{}, _0{}) == kBoxElems && PlainA{}(_0{}, _0{}, _1{}) == kStageElemsA);
  static_assert(PlainB{}(_1{}, _0{}, _0{}) == 1 && PlainB{}(_0{}, _1{}, _0{}) == kBox &&
                PlainB{}(Int<kBox>{}, _0{}, _0{}) == kBoxElems && PlainB{}(_0{}, _0{}, _1{}) == kStageElemsB);
  static_assert(cosize_v<SmemLayoutA> == kStagesA * kStageElemsA && cosize_v<SmemLayoutB> == kStagesB * kStageElemsB);
};

template <class K, class T>
__device__ __forceinline__ void load_boxes(const CUtensorMap* map, uint64_t* full, T* stage, int boxes, int col0,
                                           int row0) {
  constexpr uint64_t hint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
  for (int c = 0; c < boxes; ++c)
    SM90_TMA_LOAD_2D::copy(map, full, hint, stage + c * K::kBoxElems, col0 + c * kBox, row0);
}

// Thread 0: claims tiles, publishes each in the A stage of its first K block (with its rows,
// read from the argument kernel's offsets), loads A and B half 0; then the stop stage.
template <class K, class T>
__device__ void produce_a(const Params& p, typename K::Shared& s, int total_tiles) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  const fused::TileSchedule schedule{p.schedule};
  StageRing<K::kStagesA> ring_a;
  StageRing<K::kStagesB> ring_b;
  const int per_expert = p.m_tiles * p.n_tiles;
  int claimed = schedule.take();
  for (;;) {
    const int tile = claimed;
    if (tile >= total_tiles) break;
    claimed = schedule.take();  // in flight while this tile loads
    const int e = tile / per_expert;
    const int row0 = int(p.row_offsets[e]), rows = int(p.row_offsets[e + 1]) - row0;
    const WgradTile t = locate_corner(p, tile, row0, rows);
    const int k_blocks = t.k_blocks();
    for (int kb = 0; kb < max(k_blocks, 1); ++kb) {
      const int sa = ring_a.stage;
      fused::wait_barrier(&s.empty_a[sa], ring_a.phase ^ 1, "split wgrad producer, empty A");
      if (kb == 0) {
        s.stage_row0[sa] = row0;
        s.stage_rows[sa] = rows;
        fused::publish_stage_tile(s.stage_tile, sa, tile);
      }
      if (k_blocks == 0) {
        Barrier::arrive(&s.full_a[sa]);
      } else {
        const int block_row = row0 + kb * kTileK;
        Barrier::arrive_and_expect_tx(&s.full_a[sa], K::kStageBytesA);
        load_boxes<K>(&p.a_map, &s.full_a[sa], s.a + sa * K::kStageElemsA, kABoxes, t.m0, block_row);
        const int sb = ring_b.stage;
        fused::wait_barrier(&s.empty_b[0][sb], ring_b.phase ^ 1, "split wgrad producer, empty B0");
        Barrier::arrive_and_expect_tx(&s.full_b[0][sb], K::kStageBytesB);
        load_boxes<K>(&p.b_map, &s.full_b[0][sb], s.b[0] + sb * K::kStageElemsB, kHalfBoxes, t.n0, block_row);
        ring_b.advance();
      }
      ring_a.advance();
    }
  }
  fused::wait_barrier(&s.empty_a[ring_a.stage], ring_a.phase ^ 1, "split wgrad producer, empty A (end)");
  fused::publish_stage_tile(s.stage_tile, ring_a.stage, fused::kNoMoreTiles);
  Barrier::arrive(&s.full_a[ring_a.stage]);
  schedule.finish();
}

// Thread 32: B half 1 of every K block, following the tiles thread 0 publishes. It arrives on
// every A stage's empty barrier too, so that a stage's published tile is not overwritten
// before it has read it (the consumers of an expert without rows release the stage at once).
template <class K, class T>
__device__ void produce_b1(const Params& p, typename K::Shared& s) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  StageRing<K::kStagesA> ring_a;
  StageRing<K::kStagesB> ring_b;
  for (;;) {
    fused::wait_barrier(&s.full_a[ring_a.stage], ring_a.phase, "split wgrad B1 producer, tile");
    const int tile = fused::read_stage_tile(s.stage_tile, ring_a.stage);
    if (tile == fused::kNoMoreTiles) break;
    const WgradTile t = locate_corner(p, tile, s.stage_row0[ring_a.stage], s.stage_rows[ring_a.stage]);
    const int k_blocks = t.k_blocks();
    for (int kb = 0; kb < max(k_blocks, 1); ++kb) {
      if (k_blocks > 0) {
        const int sb = ring_b.stage;
        fused::wait_barrier(&s.empty_b[1][sb], ring_b.phase ^ 1, "split wgrad B1 producer, empty");
        Barrier::arrive_and_expect_tx(&s.full_b[1][sb], K::kStageBytesB);
        load_boxes<K>(&p.b_map, &s.full_b[1][sb], s.b[1] + sb * K::kStageElemsB, kHalfBoxes, t.n0 + kHalfN,
                      t.row0 + kb * kTileK);
        ring_b.advance();
      }
      // Only once the stage holds this block does the arrival count for this block's lap
      // (consumer 1 may run ahead of consumer 0 within a tile, and this thread with it).
      if (kb > 0) fused::wait_barrier(&s.full_a[ring_a.stage], ring_a.phase, "split wgrad B1 producer, A");
      Barrier::arrive(&s.empty_a[ring_a.stage]);
      ring_a.advance();
    }
  }
}

// Thread 64: the consumers' output tiles in their order (0, 1, 0, 1, ...), out by TMA store.
// A tile's store group is waited on (its shared memory read) only once the next tile's stores
// are issued; then that tile's consumer may write its output tile again.
template <class K, class T>
__device__ void store_tiles(const Params& p, typename K::Shared& s) {
  using Barrier = cutlass::arch::ClusterBarrier;
  for (uint32_t k = 0;; ++k) {
    const int c = k & 1;
    fused::wait_barrier(&s.out_written[c], (k >> 1) & 1, "split wgrad storer");
    const int expert = *reinterpret_cast<volatile int32_t*>(&s.out_expert[c]);
    if (expert < 0) break;
    const int m0 = *reinterpret_cast<volatile int32_t*>(&s.out_m0[c]);
    const int n0 = *reinterpret_cast<volatile int32_t*>(&s.out_n0[c]);
#pragma unroll
    for (int h = 0; h < kRowBoxes; ++h)
#pragma unroll
      for (int b = 0; b < kHalfBoxes; ++b)
        SM90_TMA_STORE_3D::copy(&p.d_map, s.out[c] + (h * kHalfBoxes + b) * K::kBoxElems, n0 + b * kBox,
                                m0 + h * kBox, expert);
    tma_store_arrive();
    if (k > 0) {
      tma_store_wait<1>();  // the other consumer's last tile has been read
      Barrier::arrive(&s.out_free[c ^ 1]);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // complete before the grid is
}

// Value i = 64h + 4g + 2r + c of a consumer's accumulators holds row m0 + 64h + 8r, column
// 8g + 2 (lane % 4) + c of its 128 x 128 half tile. Traps otherwise; returns m0.
template <class Coords>
__device__ int check_split_accumulator_layout(const Coords& coords) {
  const int m0 = get<0>(coords(0));
  const int quad_lane = threadIdx.x & 3;
#pragma unroll
  for (int i = 0; i < decltype(size(coords))::value; ++i) {
    const int h = i / 64, g = (i % 64) / 4, r = (i / 2) % 2, c = i % 2;
    if (get<0>(coords(i)) != m0 + 64 * h + 8 * r || get<1>(coords(i)) != 8 * g + 2 * quad_lane + c) __trap();
  }
  return m0;
}

// Rows [first, end) of `boxes` 64-column boxes from `base`, zeroed by the warpgroup's 128 threads.
template <class K, class T>
__device__ __forceinline__ void zero_rows(T* base, int boxes, int first, int end, int thread) {
  constexpr int kChunks = kBox * sizeof(T) / 16;
  const int rows = end - first;
  const int items = rows * boxes * kChunks;
  for (int i = thread; i < items; i += 128) {
    const int chunk = i % kChunks, line = i / kChunks;
    const int row = first + line % rows, box = line / rows;
    reinterpret_cast<uint4*>(base + box * K::kBoxElems + row * kBox)[chunk] = make_uint4(0, 0, 0, 0);
  }
}

// Consumer c's place in its two rings and its barrier bookkeeping.
template <class K>
struct ConsumerState {
  StageRing<K::kStagesA> ring_a;
  StageRing<K::kStagesB> ring_b;
  uint32_t masked_phase = 0;  // bit s: the parity of masked_a[s]'s next phase
  int tiles_done = 0;
};

// Consumer c's mainloop over one tile of k_blocks >= 1 blocks (as mma_tile above, over two
// rings). In the last block the rows past the expert's end are zeroed: each warpgroup its B
// half, warpgroup 0 the shared A, which warpgroup 1 reads only after masked_a says so.
template <class K, class T, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void mma_split_tile(ConsumerState<K>& cs, typename K::Shared& s, const WgradTile& t, int c,
                                               bool warp_leader, int thread, Mma& mma, FragA& tCrA, FragB& tCrB,
                                               Acc& acc) {
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kSteps = kTileK / kStepRows;
  const int last = t.k_blocks() - 1;
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  int prev_a = -1, prev_b = -1;
  auto wait_full = [&] {
    fused::wait_barrier(&s.full_a[cs.ring_a.stage], cs.ring_a.phase, "split wgrad consumer, full A");
    fused::wait_barrier(&s.full_b[c][cs.ring_b.stage], cs.ring_b.phase, "split wgrad consumer, full B");
    __syncwarp();
  };
  auto release = [&](int sa, int sb) {
    if (warp_leader) {
      Barrier::arrive(&s.empty_a[sa]);
      Barrier::arrive(&s.empty_b[c][sb]);
    }
  };
  for (int kb = 0; kb < last; ++kb) {
    wait_full();
    warpgroup_fence_operand(acc);
    issue_steps<kSteps>(mma, tCrA, tCrB, acc, cs.ring_a.stage, cs.ring_b.stage);
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    if (prev_a >= 0) release(prev_a, prev_b);
    prev_a = cs.ring_a.stage;
    prev_b = cs.ring_b.stage;
    cs.ring_a.advance();
    cs.ring_b.advance();
  }
  wait_full();
  const int sa = cs.ring_a.stage, sb = cs.ring_b.stage;
  const int rows = t.rows - last * kTileK;  // 1..64
  const int steps = (rows + kStepRows - 1) / kStepRows;
  if (rows % kStepRows != 0) {
    zero_rows<K>(s.b[c] + sb * K::kStageElemsB, kHalfBoxes, rows, steps * kStepRows, thread);
    if (c == 0) zero_rows<K>(s.a + sa * K::kStageElemsA, kABoxes, rows, steps * kStepRows, thread);
    cutlass::arch::fence_view_async_shared();
    named_barrier(kConsumerBarrier + c, 128);
    if (c == 0) {
      if (thread == 0) Barrier::arrive(&s.masked_a[sa]);
    } else {
      fused::wait_barrier(&s.masked_a[sa], (cs.masked_phase >> sa) & 1, "split wgrad consumer 1, masked A");
      __syncwarp();
    }
    cs.masked_phase ^= 1u << sa;  // both consumers count every masked use of the stage
  }
  warpgroup_fence_operand(acc);
  switch (steps) {
    case 1: issue_steps<1>(mma, tCrA, tCrB, acc, sa, sb); break;
    case 2: issue_steps<2>(mma, tCrA, tCrB, acc, sa, sb); break;
    case 3: issue_steps<3>(mma, tCrA, tCrB, acc, sa, sb); break;
    default: issue_steps<kSteps>(mma, tCrA, tCrB, acc, sa, sb); break;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (prev_a >= 0) release(prev_a, prev_b);
  release(sa, sb);
  cs.ring_a.advance();
  cs.ring_b.advance();
}

// Waits until out[c] may take consumer c's next tile (the storer has read its previous one)
// and, for consumer 1, until consumer 0 has written the same tile (the header says why).
template <class Shared>
__device__ __forceinline__ void wait_out_turn(Shared& s, int c, int tiles_done) {
  if (tiles_done > 0) fused::wait_barrier(&s.out_free[c], uint32_t(tiles_done - 1) & 1, "split wgrad consumer, out");
  // Consumer 0 cannot have written a tile past this one (its next turn needs this tile of
  // consumer 1's stored), so the parity names one phase.
  if (c == 1) fused::wait_barrier(&s.out_written[0], uint32_t(tiles_done) & 1, "split wgrad consumer 1, order");
}

// Consumer c's half tile, rounded to T, into out[c], handed to the storer.
template <class K, class T, class Accum>
__device__ __forceinline__ void write_out(typename K::Shared& s, const WgradTile& t, const Accum& acc, int row, int c,
                                          int thread) {
  constexpr int kGroups = kHalfN / 8;
  static_assert(decltype(size(acc))::value == 2 * 4 * kGroups, "two row halves x two rows x two columns per group");
  T* out = s.out[c];
  // As store_tile above: 16-byte chunk (g % 8) XOR (m % 8) of line m, this lane's word of it.
  uint32_t* chunk_word[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
    chunk_word[j] = reinterpret_cast<uint32_t*>(out + row * kBox + ((j ^ (row % 8)) * 8)) + (threadIdx.x & 3);
#pragma unroll
  for (int h = 0; h < kRowBoxes; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const int i = 64 * h + 4 * g + 2 * r;
        chunk_word[g % 8][((h * kHalfBoxes + g / 8) * K::kBoxElems + 8 * r * kBox) / 2] =
            fused::Pair<T>::pack(acc(i), acc(i + 1));
      }
    }
  }
  cutlass::arch::fence_view_async_shared();  // the tile, generic proxy -> TMA's reads
  named_barrier(kConsumerBarrier + c, 128);
  if (thread == 0) {
    s.out_expert[c] = t.expert;
    s.out_m0[c] = t.m0;
    s.out_n0[c] = t.n0 + c * kHalfN;
    cutlass::arch::ClusterBarrier::arrive(&s.out_written[c]);
  }
}

template <class K, class T>
__device__ void consume(const Params& p, typename K::Shared& s) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const int c = (threadIdx.x - 128) / 128;
  const int thread = threadIdx.x % 128;
  const bool warp_leader = (threadIdx.x & 31) == 0;

  typename K::TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename K::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b[c]), typename K::SmemLayoutB{});
  auto thr = mma.get_thread_slice(thread);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kHalfN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kHalfN>>{}));
  const int row = check_split_accumulator_layout(coords);

  ConsumerState<K> cs;
  for (;;) {
    const int sa = cs.ring_a.stage;
    const int tile = fused::next_published_tile(cs.ring_a, s.full_a, s.stage_tile);
    if (tile == fused::kNoMoreTiles) break;
    // Lane 0 reads, as next_published_tile does: it is the lane that releases the stage.
    int row0 = 0, rows = 0;
    if ((threadIdx.x & 31) == 0) {
      row0 = s.stage_row0[sa];
      rows = s.stage_rows[sa];
    }
    row0 = __shfl_sync(0xffffffffu, row0, 0);
    rows = __shfl_sync(0xffffffffu, rows, 0);
    const WgradTile t = locate_corner(p, tile, row0, rows);
    if (t.rows == 0) {
      if (warp_leader) Barrier::arrive(&s.empty_a[sa]);
      cs.ring_a.advance();
#pragma unroll
      for (int i = 0; i < size(acc); ++i) acc(i) = 0.0f;
    } else {
      mma_split_tile<K, T>(cs, s, t, c, warp_leader, thread, mma, tCrA, tCrB, acc);
    }
    wait_out_turn(s, c, cs.tiles_done);
    write_out<K, T>(s, t, acc, row, c, thread);
    ++cs.tiles_done;
  }
  // Consumer 0's output tile is the storer's next: it tells the storer there are no more.
  if (c == 0) {
    wait_out_turn(s, 0, cs.tiles_done);
    if (thread == 0) {
      s.out_expert[0] = -1;
      Barrier::arrive(&s.out_written[0]);
    }
  }
}

template <class K, class T>
__global__ void __launch_bounds__(kThreads, 1) split_wgrad_kernel(const __grid_constant__ Params p) {
  using Barrier = cutlass::arch::ClusterBarrier;
  extern __shared__ uint8_t raw[];
  auto& s = fused::aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;

  if (threadIdx.x == 32) {
    for (int i = 0; i < K::kStagesA; ++i) {
      Barrier::init(&s.full_a[i], 1);
      Barrier::init(&s.empty_a[i], kConsumerWarps + 1);  // + the B1 producer
      Barrier::init(&s.masked_a[i], 1);
    }
    for (int c = 0; c < 2; ++c) {
      for (int i = 0; i < K::kStagesB; ++i) {
        Barrier::init(&s.full_b[c][i], 1);
        Barrier::init(&s.empty_b[c][i], kConsumerWarps / 2);
      }
      Barrier::init(&s.out_written[c], 1);
      Barrier::init(&s.out_free[c], 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == 64) {
    cute::prefetch_tma_descriptor(&p.a_map);
    cute::prefetch_tma_descriptor(&p.b_map);
    cute::prefetch_tma_descriptor(&p.d_map);
  }
  grid_dependency_wait();  // nothing the argument kernel writes is read before this
  __syncthreads();

  const int total_tiles = p.experts * p.m_tiles * p.n_tiles;
  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) produce_a<K, T>(p, s, total_tiles);
    if (threadIdx.x == 32) produce_b1<K, T>(p, s);
    if (threadIdx.x == 64) store_tiles<K, T>(p, s);
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    consume<K, T>(p, s);
  }
}

template <class T>
capmoe_status_t launch_split(const Params& p, int grid, cudaStream_t stream) {
  using K = Kernel<T>;
  return launch_counter_kernel(&split_wgrad_kernel<K, T>, p, grid, kThreads, K::kSmemBytes, stream);
}

}  // namespace split

// The operands as the kernel sees them: A's columns are dW's rows, B's its columns.
struct WgradOperands {
  const void* a;
  const void* b;
  int64_t m, n;
};

WgradOperands operands_of(const capmoe_grouped_gemm_desc_t& d, const Launch& launch) {
  // dW_e = dY_e^T X_e: [N, K]; stored transposed ([E, K, N]) it is X_e^T dY_e.
  const CounterWgradExtent dw = counter_wgrad_extent(d);
  const bool transposed = d.weight_layout == CAPMOE_WEIGHT_EKN;
  return {transposed ? launch.b : launch.a, transposed ? launch.a : launch.b, dw.rows, dw.cols};
}

capmoe_status_t encode_maps(const capmoe_grouped_gemm_desc_t& d, const WgradOperands& op, void* dw, Params* p) {
  const cuuint64_t elem = 2;
  // A map needs at least one row; with capacity 0 no expert has rows and nothing is loaded.
  const cuuint64_t rows = cuuint64_t(d.capacity > 0 ? d.capacity : 1);
  const cuuint32_t box[3] = {kBox, kTileK, 1};
  const cuuint64_t a_dims[2] = {cuuint64_t(op.m), rows};
  const cuuint64_t a_strides[1] = {cuuint64_t(op.m) * elem};
  CAPMOE_TRY(tma_encode(&p->a_map, d.dtype, op.a, 2, a_dims, a_strides, box));
  const cuuint64_t b_dims[2] = {cuuint64_t(op.n), rows};
  const cuuint64_t b_strides[1] = {cuuint64_t(op.n) * elem};
  CAPMOE_TRY(tma_encode(&p->b_map, d.dtype, op.b, 2, b_dims, b_strides, box));
  const cuuint64_t d_dims[3] = {cuuint64_t(op.n), cuuint64_t(op.m), cuuint64_t(d.num_experts)};
  const cuuint64_t d_strides[2] = {cuuint64_t(op.n) * elem, cuuint64_t(op.m * op.n) * elem};
  return tma_encode(&p->d_map, d.dtype, dw, 3, d_dims, d_strides, box);
}

enum class WgradForm { Cooperative, ColumnSplit };

// Measured on the H100 (bench/README "The column-split counter wgrad"): at 256 rows per expert
// (dsv3, qwen3moe) the column split is 3-8 % faster, at 1024 (mixtral) the cooperative kernel
// 0.5-2.6 %, at 16 (decode, bound by dW's write) they are level. The boundary between the
// measured points is a guess at their geometric middle.
constexpr int64_t kColumnSplitMaxRowsPerExpert = 512;

// CAPMOE_COUNTER_WGRAD=cooperative / split (read once) forces a form, for diagnosis and A/B;
// anything else leaves the choice to the average rows per expert (host facts only).
WgradForm choose_form(const capmoe_grouped_gemm_desc_t& d) {
  static const std::optional<WgradForm> forced = []() -> std::optional<WgradForm> {
    const char* v = std::getenv("CAPMOE_COUNTER_WGRAD");
    const std::string s = v ? v : "";
    if (s == "cooperative") return WgradForm::Cooperative;
    if (s == "split") return WgradForm::ColumnSplit;
    return std::nullopt;
  }();
  if (forced) return *forced;
  const int64_t rows_per_expert = d.num_experts > 0 ? d.capacity / d.num_experts : 0;
  return rows_per_expert < kColumnSplitMaxRowsPerExpert ? WgradForm::ColumnSplit : WgradForm::Cooperative;
}

// The VariantFn body: T the element type.
template <class T>
capmoe_status_t run(const Launch& launch, uint64_t* workspace_bytes) {
  const capmoe_grouped_gemm_desc_t& d = *launch.desc;
  if (!counter_wgrad_takes(d)) return CAPMOE_ERR_UNSUPPORTED;
  if (workspace_bytes) {
    *workspace_bytes = Workspace::bytes(d.num_experts);
    return CAPMOE_OK;
  }
  if (launch.workspace_bytes < Workspace::bytes(d.num_experts)) return CAPMOE_ERR_WORKSPACE_TOO_SMALL;
  const Workspace ws = Workspace::carve(launch.workspace, d.num_experts);
  const WgradOperands op = operands_of(d, launch);

  // Everything that can fail on the host comes before the first launch, so a failure never
  // leaves the argument kernel on the stream without its GEMM.
  Params p{};
  CAPMOE_TRY(encode_maps(d, op, launch.d, &p));
  p.row_offsets = ws.row_offsets;
  p.schedule = ws.schedule;
  p.experts = int32_t(d.num_experts);
  p.m_tiles = int32_t((op.m + kTileM - 1) / kTileM);
  p.n_tiles = int32_t((op.n + kTileN - 1) / kTileN);

  (void)cudaGetLastError();
  CAPMOE_TRY(launch_counter_arguments<T>(launch, ws));
  // Every expert's tiles run, those without rows to write zeros: the grid is never empty.
  const int64_t tiles = counter_wgrad_tiles(d);
  const int grid = int(tiles < d.sm_count ? tiles : d.sm_count);
  if (choose_form(d) == WgradForm::ColumnSplit) return split::launch_split<T>(p, grid, launch.stream);
  return launch_counter_kernel(&counter_wgrad_kernel<T, Gather::None>, p, grid, kThreads, Kernel<T>::kSmemBytes,
                               launch.stream);
}

// The gathered form's maps: the plain operand over its `capacity` rows and dW (the gathered one
// has none). capacity > 0.
capmoe_status_t encode_gathered_maps(const fused::WgradGatherParams& g, capmoe_dtype_t dtype, Params* p) {
  const cuuint64_t elem = 2;
  const cuuint32_t box[3] = {kBox, kTileK, 1};
  const bool gather_a = g.a_gathered != 0;
  const cuuint64_t plain_cols = cuuint64_t(gather_a ? g.n : g.m);
  const cuuint64_t plain_dims[2] = {plain_cols, cuuint64_t(g.capacity)};
  const cuuint64_t plain_strides[1] = {plain_cols * elem};
  CUtensorMap* plain_map = gather_a ? &p->b_map : &p->a_map;
  CAPMOE_TRY(tma_encode(plain_map, dtype, gather_a ? g.b : g.a, 2, plain_dims, plain_strides, box));
  const cuuint64_t d_dims[3] = {cuuint64_t(g.n), cuuint64_t(g.m), cuuint64_t(g.experts)};
  const cuuint64_t d_strides[2] = {cuuint64_t(g.n) * elem, cuuint64_t(g.m) * cuuint64_t(g.n) * elem};
  return tma_encode(&p->d_map, dtype, g.dw, 3, d_dims, d_strides, box);
}

template <class T>
capmoe_status_t launch_gathered_typed(const fused::WgradGatherParams& g, int grid, cudaStream_t stream) {
  constexpr capmoe_dtype_t kDtype = std::is_same_v<T, cutlass::half_t> ? CAPMOE_DTYPE_F16 : CAPMOE_DTYPE_BF16;
  if (g.capacity == 0) {
    // No expert has rows (and a, b may be null): dW = 0.
    const size_t bytes = size_t(g.experts) * size_t(g.m) * size_t(g.n) * sizeof(T);
    return cuda_status(cudaMemsetAsync(g.dw, 0, bytes, stream));
  }
  Params p{};
  CAPMOE_TRY(encode_gathered_maps(g, kDtype, &p));
  const bool gather_a = g.a_gathered != 0;
  p.row_offsets = g.offsets;
  p.schedule = g.schedule;
  p.experts = g.experts;
  p.m_tiles = g.m_tiles;
  p.n_tiles = g.n_tiles;
  p.gathered = gather_a ? g.a : g.b;
  p.token_of_row = g.token_of_row;
  p.gathered_cols = gather_a ? g.m : g.n;
  p.max_tokens = g.max_tokens;
  p.capacity = g.capacity;
  (void)cudaGetLastError();
  const auto kernel = gather_a ? &counter_wgrad_kernel<T, Gather::A> : &counter_wgrad_kernel<T, Gather::B>;
  return launch_counter_kernel(kernel, p, grid, kThreads, Kernel<T>::kSmemBytes, stream);
}

}  // namespace

bool gathered_wgrad_takes(const fused::WgradGatherParams& g, capmoe_dtype_t dtype, capmoe_dtype_t out_dtype) {
  static const bool strided_only = [] {
    const char* v = std::getenv("CAPMOE_GATHER_WGRAD");
    return v != nullptr && std::string(v) == "strided";
  }();
  if (strided_only) return false;
  if (out_dtype != dtype || g.accumulate || (g.a_gathered != 0) == (g.b_gathered != 0)) return false;
  if (g.experts > kCounterMaxExperts) return false;
  return int64_t(g.m) * int64_t(g.n) * 2 < (int64_t(1) << 40);
}

capmoe_status_t launch_gathered_wgrad(const fused::WgradGatherParams& g, capmoe_dtype_t dtype, int grid,
                                      cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_gathered_typed<cutlass::bfloat16_t>(g, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_gathered_typed<cutlass::half_t>(g, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::gg::counter

namespace capmoe::gg {

capmoe_status_t variant_sm90_cr_bf16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::bfloat16_t>(launch, workspace_bytes);
}
capmoe_status_t variant_sm90_cr_f16_counter(const Launch& launch, uint64_t* workspace_bytes) {
  return counter::run<cutlass::half_t>(launch, workspace_bytes);
}

}  // namespace capmoe::gg
