// capmoe-archs: 90a
// Fused fc2 dgrad + SwiGLU backward of the expert path on Hopper: dact = A @ W2_e per expert,
// and in the epilogue dh = SwiGLU'(h) * dact, one persistent warp-specialized kernel (contract:
// capturable_moe/fused.h). The [capacity, F] dact never goes through memory. Two forms of A:
//  - drows (capmoe_fused_swiglu_dgrad): the gradient of fc2's output rows, in routing order;
//  - gathered (capmoe_fused_swiglu_dgrad_gathered): dy[token_of_row[r]], for a forward whose
//    fc1 epilogue applied the route probability p (act' = p * SwiGLU). There the epilogue
//    also makes dprob's per-slice partials, sum_f dact[f] * SwiGLU(g, u)[f], and scales dact
//    by p before the SwiGLU backward.
//
// Tiles: 128 rows (routing rows of one expert) x 128 columns of F, K = H in blocks of 64.
//  - A = drows [capacity, H] (K-major): one 64 x 128 TMA box per stage at (k0, row0). The rows
//    of the tile are the expert's own, so no gather; rows past the expert's end are loaded
//    (another expert's rows, or zero fill past capacity: the map's row extent is capacity)
//    but their accumulators are never stored.
//  - A = dy rows (gathered form): fc1's CP_ASYNC gather (fused/gather_rows.cuh), the producer
//    warpgroup copying four whole rows per warp-wide copy; a row whose token is outside
//    [0, max_tokens) is zero-filled, rows past the expert's end are not loaded (never stored).
//  - B = W2_e [H, F] is MN-major here (F contiguous): a 3D map over dims (F, H, E), two
//    64-column x 64-row boxes per stage. The shared layout tiles GMMA's MN-major 128B-swizzle
//    atom (64 columns x 8 rows) along K first, as CUTLASS's sm90 collective does for MN-major
//    operands, so each 64-column chunk's 64 K rows are one contiguous 8 KB block: exactly what
//    one box writes.
//  Columns past H are zero-filled by TMA in both operands (H need not be a multiple of 64).
//
// Roles (384 threads): warpgroup 0 is the producer (one thread issues the TMAs, and the others
// exit after giving back registers; gathered: all 128 threads copy A rows, thread 0 also issues
// the W2 TMAs); warpgroups 1 and 2 are the consumers, 64 tile rows each,
// one 64x128x16 wgmma per k16 step. Tile list: fused/tile_list.cuh (M tiles of one expert's
// column slice consecutive); each CTA's producer takes its next tile from the device counter
// in the caller's `schedule` words as it frees up and publishes it in the tile's first stage
// (fused/tile_source.cuh's CountedTiles, as fc1), so the CTAs running one weight slice's M
// tiles stay in step and the second reads the slice from L2.
//
// Epilogue, per pair of adjacent accumulator columns of a stored row: dact rounded to T, then
// capmoe_routing_swiglu_backward's fp32 math on (rounded dact, g = h[r, f], u = h[r, F + f])
// with 16-byte loads of h (issued before the tile's mainloop, so they land behind it; the
// quad's lanes exchange them into the accumulators' layout after it) and 16-byte stores of dh
// (and of dact when requested): fused/quad_store.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
#include "fused/pipeline.cuh"
#include "common/swiglu_math.cuh"
#include "fused/accumulator_layout.cuh"
#include "fused/gather_rows.cuh"
#include "fused/pair.cuh"
#include "fused/quad_store.cuh"
#include "fused/swiglu_dgrad_launch.h"
#include "fused/swiglu_dgrad_layout.h"
#include "fused/tile_list.cuh"
#include "fused/tile_source.cuh"
#include "fused/tma_loads.cuh"

namespace capmoe::fused {
namespace {

using namespace cute;

constexpr int kTileM = kSwigluDgradTileM;
constexpr int kTileN = CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N;
constexpr int kTileK = 64;  // 64 16-bit elements = one 128-byte row
constexpr int kBoxN = 64;   // W2 columns per TMA box (128 bytes, the swizzle's width)
constexpr int kStages = 6;
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kProducerThreads = 128;

// Where the A tiles come from (the two forms of the file's top).
enum class ASource { Tma, Gathered };

template <class T>
struct Kernel {
  using TiledMma = SwigluDgradTiledMma<T>;
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                             Shape<Int<kTileM>, Int<kTileK>, Int<kStages>>{}));
  // K first (Step<_2, _1, _3>): a 64-column chunk's K rows are contiguous (see the file's top).
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{},
                                             Shape<Int<kTileN>, Int<kTileK>, Int<kStages>>{},
                                             Step<_2, _1, _3>{}));
  static constexpr int kStageElemsA = kTileM * kTileK;
  static constexpr int kStageElemsB = kTileN * kTileK;
  static constexpr int kBoxElemsB = kBoxN * kTileK;
  static constexpr uint32_t kStageBytes = (kStageElemsA + kStageElemsB) * sizeof(T);
  static constexpr uint32_t kBytesB = kStageElemsB * sizeof(T);

  struct Shared {
    alignas(1024) T a[cosize_v<SmemLayoutA>];
    alignas(1024) T b[cosize_v<SmemLayoutB>];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    int32_t tile_prefix[CAPMOE_FUSED_MAX_EXPERTS + 1];  // M tiles of the experts before e
    int32_t row_start[CAPMOE_FUSED_MAX_EXPERTS + 1];    // first row of expert e (clamped)
    int32_t stage_tile[kStages];  // the tile whose first K block a stage holds (tile_source.cuh)
    int32_t next_tile;            // the gathered producer warpgroup's fetched tile
  };
  static constexpr size_t kSmemBytes = sizeof(Shared) + 1024;  // + room to align the base

  // The layouts the TMA boxes are written into, checked at compile time (before the swizzle,
  // which is a function of the address, as TMA's is): A rows are consecutive 128-byte rows;
  // in B, K row k of a 64-column chunk is the chunk's 128-byte row k, and chunk c starts at
  // c * 64 * 64 elements; stages are whole blocks.
  using PlainA = decltype(get_nonswizzle_portion(SmemLayoutA{}));
  using PlainB = decltype(get_nonswizzle_portion(SmemLayoutB{}));
  static_assert(PlainA{}(_1{}, _0{}, _0{}) == kTileK && PlainA{}(_0{}, _0{}, _1{}) == kStageElemsA);
  static_assert(PlainB{}(_1{}, _0{}, _0{}) == 1 && PlainB{}(_0{}, _1{}, _0{}) == kBoxN);
  static_assert(PlainB{}(_0{}, Int<kTileK - 1>{}, _0{}) == (kTileK - 1) * kBoxN);
  static_assert(PlainB{}(Int<kBoxN>{}, _0{}, _0{}) == kBoxElemsB && PlainB{}(_0{}, _0{}, _1{}) == kStageElemsB);
  static_assert(cosize_v<SmemLayoutA> == kStages * kStageElemsA);
  static_assert(cosize_v<SmemLayoutB> == kStages * kStageElemsB);
  static_assert(kTileN % kBoxN == 0);
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

// One thread: the drows form's producer loop (fused/tma_loads.cuh).
template <class T>
__device__ void produce(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles, int slices) {
  static_assert(Kernel<T>::kStageBytes == (kTileM + kTileN) * kTileK * sizeof(T), "produce_drows arms the whole stage");
  const CountedTiles<1> tiles{TileSchedule{p.schedule}, s.stage_tile, nullptr};
  produce_drows<kTileM, kTileN, kBoxN, kTileK, kStages>(
      p, s.full, s.empty, s.a, s.b, total_tiles, tiles,
      [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      "dgrad TMA producer, empty");
}

// The gathered form's producer warpgroup: the 128 threads copy the tile's rows
// dy[token_of_row[row0 + r]] (zeros for a token outside [0, max_tokens)) into each stage, four
// whole rows per warp-wide copy (fused/gather_rows.cuh, as fc1's CP_ASYNC form), and arrive on
// the stage's barrier when their copies land; thread 0 also issues the W2 boxes (the only bytes
// the barrier's transaction count expects). The barrier takes 1 + 128 arrivals.
template <class T>
__device__ void produce_gathered(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int total_tiles,
                                 int slices) {
  const CountedTiles<kProducerThreads> tiles{TileSchedule{p.schedule}, s.stage_tile, &s.next_tile};
  produce_gathered_a<kTileM, kTileK, kStages>(
      p.dy, p.hidden, p.max_tokens, p.token_of_row, s.full, s.empty, s.a, Kernel<T>::kBytesB,
      total_tiles, tiles, [&](int tile) { return locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts); },
      [&](int stage, const Tile& t, int k0) { load_weights<T>(p, s, stage, t, k0); });
}

// Pair index of row half r, group 4a + j: pair j = (2j, 2j + 1) of the accumulators, laid out
// as check_quad_accumulator_layout says (value i = 4g + 2r + c, so pair 2g + r).
__device__ __forceinline__ constexpr int pair_of(int r, int a, int j) { return 2 * (4 * a + j) + r; }

// The h pairs of a thread's rows (0 past t.rows), as 16-byte loads: gate[pair_of(r, a, j)] is
// word j of h[row m0 + 8r, columns 8 * (4a + lane % 4) ..] (the quad-exchanged layout;
// exchange_gate_up puts each pair where the accumulators need it). Issued before the tile's
// mainloop, so their latency hides behind it.
template <int kPairs>
__device__ __forceinline__ void load_gate_up(const SwigluDgradParams& p, const Tile& t, int m0,
                                             uint32_t (&gate)[kPairs], uint32_t (&up)[kPairs]) {
  const auto* __restrict__ h = static_cast<const uint16_t*>(p.h);
  const int64_t ffn = p.ffn;
  const int quad_lane = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 8 * r;
    const int64_t row_at = (int64_t(t.row0) + m) * 2 * ffn + t.n0 + 8 * quad_lane;
#pragma unroll
    for (int a = 0; a < kPairs / 8; ++a) {
      uint32_t g[4] = {0, 0, 0, 0}, u[4] = {0, 0, 0, 0};
      if (m < t.rows) {
        load16_readonly(h + row_at + 32 * a, g);
        load16_readonly(h + row_at + 32 * a + ffn, u);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        gate[pair_of(r, a, j)] = g[j];
        up[pair_of(r, a, j)] = u[j];
      }
    }
  }
}

// After the mainloop: gate[j] / up[j] become the h pairs of accumulator pair j.
template <int kPairs>
__device__ __forceinline__ void exchange_gate_up(uint32_t (&gate)[kPairs], uint32_t (&up)[kPairs]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int a = 0; a < kPairs / 8; ++a) {
      uint32_t g[4], u[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        g[j] = gate[pair_of(r, a, j)];
        u[j] = up[pair_of(r, a, j)];
      }
      quad_transpose(g);
      quad_transpose(u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        gate[pair_of(r, a, j)] = g[j];
        up[pair_of(r, a, j)] = u[j];
      }
    }
  }
}

// dh of the tile's stored rows (< t.rows) from the fp32 accumulators of dact and the h pairs
// (exchange_gate_up's layout), 16 bytes a lane (fused/quad_store.cuh).
template <class T, int kPairs, class Accum>
__device__ void store_tile(const SwigluDgradParams& p, const Tile& t, const Accum& acc, int m0,
                           const uint32_t (&gate)[kPairs], const uint32_t (&up)[kPairs]) {
  auto* __restrict__ dh = static_cast<uint16_t*>(p.dh);
  auto* __restrict__ dact = static_cast<uint16_t*>(p.dact);
  const int64_t ffn = p.ffn;
  const int quad_lane = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 8 * r;
    const bool stored = m < t.rows;
    const int64_t row = int64_t(t.row0) + m;
#pragma unroll
    for (int a = 0; a < kPairs / 8; ++a) {
      uint32_t dg_words[4], du_words[4], dact_words[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int pair = pair_of(r, a, j);
        const DgradPairs out = swiglu_dgrad_pairs<T>(acc(2 * pair), acc(2 * pair + 1), gate[pair], up[pair]);
        dact_words[j] = out.dact;
        dg_words[j] = out.dg;
        du_words[j] = out.du;
      }
      // This lane's 8 columns after the exchange: group 4a + (lane % 4).
      const int64_t col = t.n0 + 8 * (4 * a + quad_lane);
      quad_transpose(dg_words);
      quad_transpose(du_words);
      if (stored) {
        store16(dh + row * 2 * ffn + col, dg_words);
        store16(dh + row * 2 * ffn + ffn + col, du_words);
      }
      if (dact != nullptr) {
        quad_transpose(dact_words);
        if (stored) store16(dact + row * ffn + col, dact_words);
      }
    }
  }
}

// The gathered epilogue's row sums rely on this accumulator layout: every pair of a thread
// holds columns of one of two rows, row_a or row_a + 8 (slot 0 or 1), half of its pairs each,
// and the 4 lanes of a quad (lane ^ 1, lane ^ 2) hold the same two rows. The identity
// coordinates are a bijection onto the tile, so these 4 lanes' kTileN / 4 columns per row are
// then all of the row's columns. Traps otherwise (a build of the wrong atom); checked once per
// thread (and for every thread on the host by tests/layout/dgrad_quad_rows.cu). Returns row_a.
template <int kPairs, class Coords>
__device__ int check_quad_rows(const Coords& coords) {
  static_assert(kPairs * 2 * 4 == 2 * kTileN, "a quad holds two whole rows of the tile");
  const int row_a = get<0>(coords(0));
  int in_slot0 = 0;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int m = get<0>(coords(2 * j));
    if (m != row_a && m != row_a + 8) __trap();
    in_slot0 += m == row_a;
  }
  const bool quad_shares_rows = __shfl_xor_sync(0xffffffffu, row_a, 1) == row_a &&
                                __shfl_xor_sync(0xffffffffu, row_a, 2) == row_a;
  if (in_slot0 != kPairs / 2 || !quad_shares_rows) __trap();
  return row_a;
}

// p of the thread's two rows (slots 0 and 1 of check_quad_rows), 0 past t.rows; loaded before
// the tile's mainloop like the h pairs.
__device__ __forceinline__ void load_probs(const SwigluDgradParams& p, const Tile& t, int row_a, float (&prob)[2]) {
#pragma unroll
  for (int slot = 0; slot < 2; ++slot) {
    const int m = row_a + 8 * slot;
    prob[slot] = m < t.rows ? __ldg(p.prob_of_row + t.row0 + m) : 0.0f;
  }
}

// The gathered form's epilogue, per pair of adjacent columns of a row: d = dact rounded to T;
// dprob's term d * SwiGLU(g, u) added to the row's partial in a fixed order (ascending pairs,
// low column first, every product and sum rounded on its own); for a stored row (< t.rows)
// dh = SwiGLU backward of (p * d, g, u), 16 bytes a lane. Then the quad's four partials of
// each row are summed by a fixed butterfly (xor 1, then xor 2: every lane ends with the same
// bits), and lane 0 of the quad writes the row's partial of this column slice:
// dprob_partials[row, n0 / kTileN].
template <class T, int kPairs, class Accum>
__device__ void store_tile_gathered(const SwigluDgradParams& p, const Tile& t, const Accum& acc,
                                    const uint32_t (&gate)[kPairs], const uint32_t (&up)[kPairs], int m0,
                                    const float (&prob)[2]) {
  auto* __restrict__ dh = static_cast<uint16_t*>(p.dh);
  const int64_t ffn = p.ffn;
  const int quad_lane = threadIdx.x & 3;
  float partial[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + 8 * r;
    const int64_t row = int64_t(t.row0) + m;
#pragma unroll
    for (int a = 0; a < kPairs / 8; ++a) {
      uint32_t dg_words[4], du_words[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int pair = pair_of(r, a, j);
        const float2 d = Pair<T>::unpack(Pair<T>::pack(acc(2 * pair), acc(2 * pair + 1)));
        const float2 g = Pair<T>::unpack(gate[pair]);
        const float2 u = Pair<T>::unpack(up[pair]);
        partial[r] = __fadd_rn(partial[r], __fmul_rn(d.x, swiglu_forward(g.x, u.x)));
        partial[r] = __fadd_rn(partial[r], __fmul_rn(d.y, swiglu_forward(g.y, u.y)));
        float dg0, du0, dg1, du1;
        swiglu_backward(__fmul_rn(prob[r], d.x), g.x, u.x, dg0, du0);
        swiglu_backward(__fmul_rn(prob[r], d.y), g.y, u.y, dg1, du1);
        dg_words[j] = Pair<T>::pack(dg0, dg1);
        du_words[j] = Pair<T>::pack(du0, du1);
      }
      const int64_t col = t.n0 + 8 * (4 * a + quad_lane);
      quad_transpose(dg_words);
      quad_transpose(du_words);
      if (m < t.rows) {
        store16(dh + row * 2 * ffn + col, dg_words);
        store16(dh + row * 2 * ffn + ffn + col, du_words);
      }
    }
  }
  const int slices = p.ffn / kTileN;
  const bool quad_leader = quad_lane == 0;
#pragma unroll
  for (int slot = 0; slot < 2; ++slot) {
    // Every lane shuffles (rows past t.rows included): the masks name the whole warp.
    float v = partial[slot];
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
    const int m = m0 + 8 * slot;
    if (quad_leader && m < t.rows) p.dprob_partials[(int64_t(t.row0) + m) * slices + t.n0 / kTileN] = v;
  }
}

template <class T, ASource kA>
__device__ void consume(const SwigluDgradParams& p, typename Kernel<T>::Shared& s, int slices) {
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
  Tensor acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<kTileN>>{});
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  constexpr int kPairs = decltype(size(acc))::value / 2;
  static_assert(kPairs == 2 * (kTileN / 8), "two rows of kTileN / 8 column groups per thread");
  if constexpr (kA == ASource::Gathered) check_quad_rows<kPairs>(coords);
  const int m0 = check_quad_accumulator_layout(coords);

  // Both warpgroups run every tile's whole K loop, also a warpgroup whose 64 rows are all past
  // the expert's end (never stored): tiles then take the same time on every CTA, so the CTAs
  // running an expert's M tiles of one weight slice stay in step and the second one finds the
  // slice in L2. (Letting such a warpgroup skip made partial tiles faster and the CTAs drift
  // apart: on the H200, 2026-11-28, the fc2 dgrad then read 963 MB from DRAM for the 637 MB it
  // needs, 758 MB without the skip; fc1 1.50 GB, then 1.38 GB.)
  StageRing<kStages> ring;
  for (;;) {
    const int tile = next_published_tile(ring, s.full, s.stage_tile);
    if (tile == kNoMoreTiles) break;
    const Tile t = locate_tile(tile, slices, s.tile_prefix, s.row_start, p.experts);
    uint32_t gate[kPairs], up[kPairs];
    load_gate_up(p, t, m0, gate, up);
    if constexpr (kA == ASource::Gathered) {
      float prob[2];
      load_probs(p, t, m0, prob);
      // The gathered A rows come through the generic proxy (cp.async).
      mma_k_blocks<true>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc);
      exchange_gate_up(gate, up);
      store_tile_gathered<T>(p, t, acc, gate, up, m0, prob);
    } else {
      mma_k_blocks<false>(ring, s.full, s.empty, k_blocks, warp_leader, mma, tCrA, tCrB, acc);  // TMA-loaded stages
      exchange_gate_up(gate, up);
      store_tile<T>(p, t, acc, m0, gate, up);
    }
  }
}

template <class T, ASource kA>
__global__ void __launch_bounds__(kThreads, 1) swiglu_dgrad_kernel(const __grid_constant__ SwigluDgradParams p) {
  using K = Kernel<T>;
  extern __shared__ uint8_t raw[];
  auto& s = aligned_shared<typename K::Shared>(raw);
  const int warp = threadIdx.x / 32;

  if (warp == 0) build_tile_prefix<kTileM>(p.offsets, p.experts, p.capacity, s.tile_prefix, s.row_start);
  if (threadIdx.x == 32) {
    // TMA: the producer's expect_tx arrival; gathered: that plus one per copying thread.
    init_stage_barriers<kStages>(s.full, s.empty, kA == ASource::Gathered ? 1 + kProducerThreads : 1,
                                 kConsumerWarps);
  }
  if (threadIdx.x == 64) {
    if constexpr (kA == ASource::Tma) cute::prefetch_tma_descriptor(&p.drows_map);  // not encoded when gathered
    cute::prefetch_tma_descriptor(&p.w2_map);
  }
  __syncthreads();

  const int slices = p.ffn / kTileN;
  const int total_tiles = s.tile_prefix[p.experts] * slices;
  if (warp < 4) {
    // setmaxnreg moves registers between warpgroups: 56 + 2 x 224 = 3 x 168, what the launch
    // holds. The cp.async producer keeps 8 row tokens live (GatherRows) and spilled under 40.
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if constexpr (kA == ASource::Gathered) produce_gathered<T>(p, s, total_tiles, slices);
    else if (threadIdx.x == 0) produce<T>(p, s, total_tiles, slices);
  } else {
    cutlass::arch::warpgroup_reg_alloc<224>();
    consume<T, kA>(p, s, slices);
  }
}

template <class T, ASource kA>
capmoe_status_t launch_typed(const SwigluDgradParams& params, int grid, cudaStream_t stream) {
  return launch_large_smem(swiglu_dgrad_kernel<T, kA>, dim3(grid), kThreads, Kernel<T>::kSmemBytes, stream, params);
}

}  // namespace

capmoe_status_t launch_swiglu_dgrad_sm90(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                         cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t, ASource::Tma>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t, ASource::Tma>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

capmoe_status_t launch_swiglu_dgrad_gathered_sm90(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                                  cudaStream_t stream) {
  if (dtype == CAPMOE_DTYPE_BF16) return launch_typed<cutlass::bfloat16_t, ASource::Gathered>(params, grid, stream);
  if (dtype == CAPMOE_DTYPE_F16) return launch_typed<cutlass::half_t, ASource::Gathered>(params, grid, stream);
  return CAPMOE_ERR_UNSUPPORTED;
}

}  // namespace capmoe::fused
