// capmoe-archs: 90a 100a
//
// Echo offloading planner (spec echo-planner.md, P1-P7) and the reroute of this rank's tokens
// (P8-P9), as two capturable launches:
//
//   1. plan_kernel<<<1 + num_tiles, 1024>>>: block 0 runs P1-P7 for the whole [EP, E] count
//      matrix in shared memory (one block: E, S <= 1024) and writes the plan into `state`;
//      blocks 1.. count this rank's routes per expert for one token tile each (`tile_counts`).
//      Every block lets the dependent reroute launch start at once (griddepcontrol).
//   2. reroute_kernel<<<num_tiles, 512>>>, a programmatic dependent launch: each block first
//      reads its tile of 32*W tokens while the plan still runs (a per-expert bitmask of its
//      routed tokens; the dense form also stages the tile's probs in shared memory and zeroes
//      its output rows, the top-k form copies its probs), then waits for the plan
//      (griddepcontrol.wait), gets the rank of every routed token within its expert's
//      (ascending) token list from the tile prefix + popcounts, and writes each route's final
//      column (top-k: every output element; dense: the one nonzero entry of each route, after
//      the zeroing, ordered by the block barrier). Every element has one writer per phase, so
//      there are no write races and the result is deterministic.
//
// Planner phases (block 0, one __syncthreads between phases):
//   A  load C [EP, E] (int32 copy in shared memory, transposed) and column partial sums
//   B  n[e]                      C  load, cap, spill (P1)
//   D  compact the experts with spill > 0 and the ranks with cap > 0
//   E  rank them by packed key (value desc, index asc) with their interval ends (G.1-G.3)
//   F  assignment: greedy, one thread per bucket over at most S_per + 2 candidate chunks;
//      approx, one warp: the queue entries' keys in registers, a pop is a warp minimum
//   G  P3 reclaim (greedy, thr > 0), P4 slot_expert, and the state P4 settles
//   H  P5-P7, one warp per supplying expert, two source ranks per lane (no barrier after it)
//   I  without tokens, the offload map
//
// Layout contract (all row-major, contiguous; see capturable_moe/echo.h):
//   counts [EP, E] int64; state [layout.state_len] int64 with int32 sections;
//   tile_counts [num_tiles, E] int32; routing_map [T, E] uint8 + probs [T, E] f32 -> out_map /
//   out_probs [T, E+S] (interleaved columns, spec P9); or expert_ids [T, k] int32 + probs [T, k]
//   -> out_dest [T, k] int32.
//
// NOTE: the float32 stages (P3 reclaim, P5 first pass) use __fadd_rn/__fmul_rn/__fdiv_rn so the
// compiler can neither contract them into FMAs nor use approximate division: the spec's
// results depend on the exact float32 rounding (golden case s12).
#include <stdint.h>


#include "capturable_moe/echo.h"
#include "common/alignment.h"
#include "common/boundary.cuh"
#include "common/device_primitives.cuh"
#include "common/launch.cuh"

namespace capmoe {
namespace echo {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kPlanWarps = kPlanThreads / 32;
// Phase E: threads [0, kChunkThreads) rank the chunks, the rest the buckets.
constexpr int kChunkThreads = 768;
constexpr int kRerouteThreads = 512;
// Independent 16-byte loads a thread issues before using any (loops over count rows).
constexpr int kLoadBatch = 8;
constexpr int64_t kMaxExperts = 1024;
constexpr int64_t kMaxSpare = 1024;
// Words of the per-tile bitmask per expert: E * W <= kMaskBudget keeps shared memory <= ~120 KB.
constexpr int64_t kMaskBudget = 12288;
// The top-k reroute stages its tile's ids (32 W k int32) in shared memory: W is capped so that
// they take at most this much (W >= 1 regardless; k <= 1024 keeps that under 128 KB).
constexpr int64_t kIdsBudget = 64 * 1024;
constexpr unsigned kFull = 0xffffffffu;
// Shared memory a block may take (H100/B200 allow 227 KB).
constexpr size_t kSmemBudget = 220 * 1024;
// The reroute stages its tile of dense probs in shared memory up to this size.
constexpr size_t kProbStageBudget = 96 * 1024;
// The dense reroute lists up to this many of its tile's routes in shared memory (more: it
// walks the mask words instead).
constexpr int kRouteList = 2048;
constexpr int64_t kCountLimit = int64_t(1) << 24;
static_assert(kMaxExperts <= kPlanThreads && kMaxSpare <= kPlanThreads,
              "the planner block has a thread for every expert, rank and slot");

// ---------------------------------------------------------------------------------------------
// Shared memory of the planner block: X(type, name, element count) for each array, in carve
// order (ne, ep, s: E, EP, S; approx, stage_c, stage_f as in Params; balance: block_capacity >= 0).
// NOTE: the host computes the offsets once (plan_smem_offsets) and passes them in the launch
// parameters, so every array's address is the shared base plus a constant-bank operand. Carved
// on the device, the compiler (64 registers a thread) recomputed an array's address from the
// whole carve, a chain of 20-40 dependent operations, at nearly every use (SASS, 2026-11-29).
#define CAPMOE_ECHO_PLAN_ARRAYS(X)                                   \
  X(int64_t, red, 2 * kPlanThreads)                                  \
  X(int64_t, wsum, kPlanWarps)                                       \
  X(int64_t, n, ne)                                                  \
  X(int64_t, load, ep)                                               \
  X(int64_t, cap, ep)                                                \
  X(int64_t, ce, ne)                                                 \
  X(int64_t, be, ep)                                                 \
  X(uint64_t, ckey, ne)                                              \
  X(uint64_t, qkey, ep)                                              \
  X(unsigned long long, outq, ep)                                    \
  X(unsigned long long, inq, ep)                                     \
  /* approx queue entries by chunk position (approx_pops) */         \
  X(uint64_t, queue, approx ? ne : 0)                                \
  X(int32_t, spill, ne)                                              \
  X(int32_t, ps, ne)                                                 \
  X(int32_t, sps, ne)                                                \
  X(int32_t, pc, ep)                                                 \
  X(int32_t, cps, ep)                                                \
  X(int32_t, hexp, s)                                                \
  X(int32_t, hval, s)                                                \
  X(int32_t, se, s)                                                  \
  X(int32_t, nxt, s)                                                 \
  X(int32_t, rm, s)                                                  \
  X(int32_t, filled, s)                                              \
  X(int32_t, soff, s)                                                \
  X(int32_t, send, s)                                                \
  X(int32_t, first, ne)                                              \
  /* [1] keep-all (reclaim) */                                       \
  X(int32_t, flags, 4)                                               \
  X(uint32_t, pmask, kPlanWarps)                                     \
  X(uint32_t, qmask, kPlanWarps)                                     \
  X(float, head, ep)                                                 \
  /* [E, EP + 1] C transposed (row stride EP + 1 against bank conflicts) */ \
  X(int32_t, ct, stage_c ? (size_t)ne * (ep + 1) : 0)                \
  /* [S, EP] F transposed */                                         \
  X(int32_t, fs, stage_f ? (size_t)s * ep : 0)                       \
  /* block balancing (capped top-k form): rho's routes per peer and per final column */ \
  X(int32_t, bload, balance ? ep : 0)                                \
  X(int32_t, amount, balance ? ne + s : 0)

// Byte offsets of the planner's arrays in its dynamic shared memory, and the bytes it takes.
struct PlanSmemOffsets {
#define CAPMOE_X(T, name, count) uint32_t name;
  CAPMOE_ECHO_PLAN_ARRAYS(CAPMOE_X)
#undef CAPMOE_X
  uint32_t bytes;
};

// 16-byte aligned arrays one after another.
inline PlanSmemOffsets plan_smem_offsets(int ne, int ep, int s, bool approx, bool stage_c, bool stage_f,
                                         bool balance) {
  PlanSmemOffsets o;
  size_t off = 0;
#define CAPMOE_X(T, name, count)          \
  off = (off + 15) & ~size_t(15);         \
  o.name = (uint32_t)off;                 \
  off += (size_t)(count) * sizeof(T);
  CAPMOE_ECHO_PLAN_ARRAYS(CAPMOE_X)
#undef CAPMOE_X
  // The largest layout (E = EP = S = 1024, C and F staged) is about 4.3 MB: no overflow; the
  // launch refuses any layout past kSmemBudget.
  o.bytes = (uint32_t)(off + 16);
  return o;
}

// The planner's arrays in the block's shared memory.
struct PlanSmem {
#define CAPMOE_X(T, name, count) T* name;
  CAPMOE_ECHO_PLAN_ARRAYS(CAPMOE_X)
#undef CAPMOE_X
  __device__ PlanSmem(unsigned char* base, const PlanSmemOffsets& o) {
#define CAPMOE_X(T, name, count) name = reinterpret_cast<T*>(base + o.name);
    CAPMOE_ECHO_PLAN_ARRAYS(CAPMOE_X)
#undef CAPMOE_X
  }
};

enum Form { kFormNone = 0, kFormDense = 1, kFormTopk = 2 };

struct Dims {
  int ep, ne, sp, l, s, rho, topk, algorithm;
  float thr;
};

struct Params {
  const int64_t* counts;
  int64_t* state;
  capmoe_echo_layout_t lay;
  Dims d;
  int form;
  bool stage_c;      // planner: C staged in shared memory (else read from global)
  bool stage_f;      // planner: F staged in shared memory (else read back from the state)
  PlanSmemOffsets plan_smem;  // the planner block's arrays
  // Capped top-k form: the most routes of this rank one peer may receive (block balancing
  // after P7, see balance_blocks); -1 = the spec's plan as it is.
  int block_capacity;
  bool stage_probs;  // reroute (dense): the tile's probs staged in shared memory
  const uint8_t* map;
  const uint32_t* probs_bits;  // probs as raw bits: copied, never computed
  const int32_t* ids;
  // Tokens: the host count, or with tokens_device the bound its device value is clamped to.
  // The tiles (words, num_tiles) are sized for this host value either way.
  int64_t num_tokens;
  const int32_t* tokens_device;
  int words;  // W: bitmask words per expert per tile; a tile is 32 * W tokens
  int num_tiles;
  int32_t* tile_counts;
  uint8_t* out_map;
  uint32_t* out_probs_bits;
  int32_t* out_dest;
  uint32_t* out_probs_k_bits;
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// This launch's token count T: the device value clamped into [0, num_tokens] when given.
__device__ inline int64_t resolve_tokens(const Params& p) {
  if (p.tokens_device == nullptr) return p.num_tokens;
  const int64_t t = __ldg(p.tokens_device);
  return t < 0 ? 0 : (t > p.num_tokens ? p.num_tokens : t);
}

__device__ inline bool tokens_out_of_range(const Params& p) {
  if (p.tokens_device == nullptr) return false;
  const int64_t t = __ldg(p.tokens_device);
  return t < 0 || t > p.num_tokens;
}

// Rows of `tile` that hold tokens (0 for tiles past T when T lives on the device).
__device__ inline int tile_rows(const Params& p, int tile) {
  const int64_t tile_tokens = 32 * (int64_t)p.words;
  const int64_t left = resolve_tokens(p) - tile * tile_tokens;
  return (int)(left < 0 ? 0 : (left > tile_tokens ? tile_tokens : left));
}

// Bump allocator over a shared-memory block; on the host (base unused) it only measures.
// NOTE: the device pointers stay plain pointer arithmetic on the extern __shared__ array, so
// the compiler keeps shared-memory instructions (a round trip through an integer would turn
// every access into a generic one).
struct Carver {
  unsigned char* base;
  size_t off;
  template <class T>
  __host__ __device__ T* take(size_t n) {
    off = (off + 15) & ~size_t(15);
#if defined(__CUDA_ARCH__) || defined(CAPMOE_CPU_EMULATION)
    T* p = reinterpret_cast<T*>(base + off);
#else
    T* p = nullptr;
#endif
    off += n * sizeof(T);
    return p;
  }
};

// Profiling build only (bench/tools/echo_phases.cu): the plan block's phase boundaries in SM
// clocks (ECHO_PROF), and a timeline of both launches in global-timer nanoseconds, the earliest
// (ECHO_NS_FIRST) or latest (ECHO_NS_LAST) block to pass a point, by each block's thread 0.
#ifdef CAPMOE_ECHO_PROF
}  // namespace
__device__ long long g_echo_prof[32];
__device__ unsigned long long g_echo_ns[16];
namespace {
__device__ inline unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define ECHO_PROF(i) \
  do { if (threadIdx.x == 0) g_echo_prof[i] = clock64(); } while (0)
#define ECHO_NS_FIRST(i) \
  do { if (threadIdx.x == 0) atomicMin(&g_echo_ns[i], global_ns()); } while (0)
#define ECHO_NS_LAST(i) \
  do { if (threadIdx.x == 0) atomicMax(&g_echo_ns[i], global_ns()); } while (0)
#else
#define ECHO_PROF(i) do { } while (0)
#define ECHO_NS_FIRST(i) do { } while (0)
#define ECHO_NS_LAST(i) do { } while (0)
#endif

__device__ inline int64_t warp_sum64(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Position of each of `count` items with unique packed keys (value << 11 | (2047 - index),
// larger first) and the inclusive running sum of the values in that order, computed by the
// whole warps of threads [t0, t0 + nthr): G = 2^g threads per item each compare a strided share
// of the keys, combined with shuffles. put(item, position, running_sum).
template <class Put>
__device__ void rank_keys(const uint64_t* keys, int count, int t0, int nthr, Put put) {
  const int i0 = (int)threadIdx.x - t0;
  if (i0 < 0 || i0 >= nthr) return;  // whole warps
  int lg = 0;
  while (lg < 5 && (2 << lg) * count <= nthr) ++lg;
  const int G = 1 << lg;
  for (int base = 0; base < count * G; base += nthr) {
    const int i = base + i0;
    const bool valid = i < count * G;
    const int x = i >> lg, g = i & (G - 1);
    int cnt = 0;
    int64_t sum = 0;
    uint64_t mine = 0;
    if (valid) {
      mine = keys[x];
#pragma unroll 4
      for (int y = g; y < count; y += G) {
        const uint64_t k = keys[y];
        if (k > mine) {
          ++cnt;
          sum += (int64_t)(k >> 11);
        }
      }
    }
    for (int o = 1; o < G; o <<= 1) {
      cnt += __shfl_xor_sync(kFull, cnt, o);
      sum += __shfl_xor_sync(kFull, sum, o);
    }
    if (valid && g == 0) put(x, cnt, sum + (int64_t)(mine >> 11));
  }
}

// A.2 / A.3: the bucket of a remaining spill v > 0, division-free: for 0 < v < m and iv > 0,
// min(7, (m - v) / iv + 1) == 1 + #{k in 1..6 : v <= m - k * iv}; v < 2^24, so clamping the
// bounds changes nothing.
struct ApproxBuckets {
  int top;       // m (clamped); 0 when iv == 0, which puts every spill in bucket 0 (sec. 7)
  int bound[6];  // m - (k + 1) * iv, clamped to [-1, 2^25]

  __device__ explicit ApproxBuckets(int64_t avg) {
    const int64_t m = avg, iv = avg / 7, lim = int64_t(1) << 25;
    top = iv == 0 ? 0 : (int)(m < lim ? m : lim);
#pragma unroll
    for (int k = 0; k < 6; ++k) {
      const int64_t t = m - (k + 1) * iv;
      bound[k] = (int)(t < 0 ? -1 : (t > lim ? lim : t));
      // NOTE: opaque to the compiler, which would otherwise recompute the 64-bit bounds inside
      // the serial pops rather than keep six registers.
      keep_in_register(bound[k]);
    }
  }

  // 7 less the bounds below v; each term is -1 where v > bound[k] (no overflow: both are in
  // [-1, 2^25]), summed as a tree so the serial pops wait on a short chain.
  __device__ int operator()(int v) const {
    auto below = [&](int k) { return (bound[k] - v) >> 31; };
    const int b = 7 + ((below(0) + below(1) + below(2)) + (below(3) + below(4) + below(5)));
    return v >= top ? 0 : b;
  }
};

// The approx FIFOs as one priority order. A.5 pops the front of the lowest non-empty FIFO
// (every FIFO below `cur` is empty, and a remainder re-queues at or past it), so a pop takes the
// entry with the least (bucket, arrival). Arrival: a chunk's position for the entries A.4
// queues (in position order), P + b for the remainder of pop b. Key = bucket << 21 |
// arrival << 10 | position: unique, and the position rides along (P <= 1024, P + Q <= 2048).
constexpr uint32_t kNoEntry = 0xffffffffu;

__device__ __forceinline__ uint32_t queue_key(int bucket, int arrival, int a) {
  return (uint32_t)bucket << 21 | (uint32_t)arrival << 10 | (uint32_t)a;
}

// Minimum over the warp (the CPU emulation has no __reduce_min_sync).
__device__ __forceinline__ uint32_t warp_min_u32(uint32_t v) {
#ifdef CAPMOE_CPU_EMULATION
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t w = __shfl_xor_sync(kFull, v, o);
    v = w < v ? w : v;
  }
  return v;
#else
  return __reduce_min_sync(kFull, v);
#endif
}

// Index of the n-th (from 0) set bit of m, n < popc(m): a binary search by popcounts.
__device__ __forceinline__ int nth_set_bit(unsigned m, int n) {
  int pos = 0;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) {
    const unsigned lo = m & ((1u << w) - 1u);
    const int c = __popc(lo);
    if (n >= c) {
      n -= c;
      m >>= w;
      pos += w;
    } else {
      m = lo;
    }
  }
  return pos;
}

// Shared-memory stores under a predicate, as predicated instructions (the compiler made a
// divergent branch of an `if` around them, on the serial chain of the pops).
__device__ __forceinline__ void st_shared_if(bool c, int32_t* dst, int v) {
#ifdef CAPMOE_CPU_EMULATION
  if (c) *dst = v;
#else
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p st.shared.u32 [%1], %2;\n\t}"
               :: "r"((unsigned)c), "r"((unsigned)__cvta_generic_to_shared(dst)), "r"(v) : "memory");
#endif
}
__device__ __forceinline__ void st_shared_if(bool c, uint64_t* dst, uint64_t v) {
#ifdef CAPMOE_CPU_EMULATION
  if (c) *dst = v;
#else
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p st.shared.u64 [%1], %2;\n\t}"
               :: "r"((unsigned)c), "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(v) : "memory");
#endif
}

// Least key among this lane's entries other than position `skip`: lane l holds the positions
// a = l (mod 32) below A, each as queue[a] = key << 32 | remaining spill.
__device__ inline uint32_t lane_min_except(const uint64_t* queue, int A, int lane, int skip) {
  uint32_t m = kNoEntry;
  for (int a = lane; a < A; a += 32) {
    const uint32_t k = (uint32_t)(queue[a] >> 32);
    if (a != skip && k < m) m = k;
  }
  return m;
}

// A.4 / A.5 by one warp. Only positions a < A = min(P, Q) can ever be popped (the queued entries
// leave in position order, one a pop), so only they are queued. Each lane keeps its least entry
// (key lk, spill lv) and its second least key (om) in registers; a pop is a warp minimum of lk,
// and every lane works out beforehand what it would do if its entry were the one popped, so the
// serial chain per pop is the minimum and a select. Only the popping lane touches shared memory
// (its own entries), so the lanes need no synchronisation.
__device__ void approx_pops(const PlanSmem& sm, int P, int Q, const ApproxBuckets& bucket, int lane) {
  const int A = P < Q ? P : Q;
  for (int a = lane; a < A; a += 32) {
    const int v = sm.sps[a];
    sm.queue[a] = (uint64_t)queue_key(bucket(v), a, a) << 32 | (uint32_t)v;
  }
  uint32_t lk = lane < A ? queue_key(bucket(sm.sps[lane]), lane, lane) : kNoEntry;
  int lv = lane < A ? sm.sps[lane] : 0;
  uint32_t om = lane_min_except(sm.queue, A, lane, lane);
  ECHO_PROF(10);
  int q_next = Q > 0 ? sm.pc[0] : 0, cp_next = Q > 0 ? sm.cps[0] : 0;
#ifdef CAPMOE_ECHO_PROF
  int pops = 0;
#endif
  for (int b = 0; b < Q; ++b) {
    const int q = q_next, cp = cp_next;  // rank b in capacity order, cp > 0
    if (b + 1 < Q) {
      q_next = sm.pc[b + 1];
      cp_next = sm.cps[b + 1];
    }
    const uint32_t m = warp_min_u32(lk);
    // This lane's outcome should its least entry be the one popped, worked out while the
    // minimum is in flight (branch-free, so the compiler keeps the minimum first).
    const int x = lv < cp ? lv : cp, left = lv - x, a = (int)(lk & 1023);
    const uint32_t nk = queue_key(bucket(left), P + b, a) | (left > 0 ? 0u : kNoEntry);
    if (m == kNoEntry) break;
    // NOTE: branch-free but for the rare rescan (a lane's second queued entry, only when
    // A > 32): as nested branches the pop took ~290 cycles in the profile (2026-11-29), the
    // minimum's latency plus the divergent region's branches and reconvergence.
    const bool me = lk == m, take_nk = nk < om;
    st_shared_if(me, sm.hexp + q, a);  // chunk position; S_per == 1: slot index == rank index
    st_shared_if(me, sm.hval + q, x);
    st_shared_if(me, sm.queue + a, (uint64_t)nk << 32 | (uint32_t)left);
    const uint32_t om0 = om;
    int lv2 = lv;
    if (me && !take_nk && om0 != kNoEntry) {
      const int a2 = (int)(om0 & 1023);
      lv2 = (int)(uint32_t)sm.queue[a2];
      om = lane_min_except(sm.queue, A, lane, a2);
    }
    lv = me ? (take_nk ? left : lv2) : lv;
    lk = me ? (take_nk ? nk : om0) : lk;
#ifdef CAPMOE_ECHO_PROF
    pops = b + 1;
    if (lane == 0 && b < 16) g_echo_prof[16 + b] = clock64();
#endif
  }
#ifdef CAPMOE_ECHO_PROF
  if (lane == 0) g_echo_prof[11] = pops;
#endif
}

// A lane's two consecutive source ranks (ra, ra + 1) of one [S, EP] row of F or D: one 8-byte
// store when EP is even (the row, ra and the sections are then 8-byte aligned, and va implies
// vb), else one store each.
// NOTE: whatever phase follows P5-P7 took thousands of cycles in the profile, seemingly waiting
// for their stores to drain, so they are made as few and as full-sector as possible.
__device__ __forceinline__ void store_rank_pair(int32_t* row, int ra, bool va, bool vb, int a, int b,
                                                bool pairs) {
  if (pairs) {
    if (va) *reinterpret_cast<int2*>(row + ra) = make_int2(a, b);
  } else {
    if (va) row[ra] = a;
    if (vb) row[ra + 1] = b;
  }
}

__device__ void balance_blocks(const Params& p, const PlanSmem& sm);  // (after plan_block)

// P1-P7, one block of kPlanThreads threads.
__device__ void plan_block(const Params& p, unsigned char* smem_raw) {
  const Dims d = p.d;
  const int ne = d.ne, ep = d.ep, sp = d.sp, L = d.l, S = d.s;
  // NOTE: the block size as a constant, so a strided loop's trip count needs no division.
  constexpr int nt = kPlanThreads, nwarps = kPlanWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool approx = d.algorithm == CAPMOE_ECHO_APPROX;
  const int64_t* C = p.counts;
  int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  int32_t* Fg = reinterpret_cast<int32_t*>(st + lay.off_first_pass);
  int32_t* Dg = reinterpret_cast<int32_t*>(st + lay.off_second_pass);
  int4* slot_route = reinterpret_cast<int4*>(st + lay.off_slot_route);
  int2* expert_route = reinterpret_cast<int2*>(st + lay.off_expert_route);
  const PlanSmem sm(smem_raw, p.plan_smem);
  const int cst = ep + 1;  // row stride of the transposed C
  ECHO_PROF(0);

  // A: C with 16-byte loads where possible; G groups of threads split the source ranks.
  bool negative = false;
  int64_t tsum = 0;
  int groups;
  if ((ne & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & 15) == 0) {
    const int np = ne >> 1;
    groups = np <= nt ? nt / np : 1;
    for (int i = tid; i < np * groups; i += nt) {
      const int pr = i % np, g = i / np;
      int64_t a0 = 0, a1 = 0;
      // NOTE: a batch's loads are all issued before any is used. As one loop (unroll 8) the
      // compiler kept the exit test between the loads, so one load was in flight a thread: 8
      // memory round trips one after another (SASS, 2026-11-29).
      for (int r0 = g; r0 < ep; r0 += kLoadBatch * groups) {
        longlong2 c[kLoadBatch];
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int r = r0 + u * groups;
          c[u].x = c[u].y = 0;
          if (r < ep) c[u] = __ldg(reinterpret_cast<const longlong2*>(C + (int64_t)r * ne) + pr);
        }
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int r = r0 + u * groups;
          negative |= (c[u].x | c[u].y) < 0;
          a0 += c[u].x;
          a1 += c[u].y;
          if (p.stage_c && r < ep) {
            sm.ct[(2 * pr) * cst + r] = (int32_t)c[u].x;
            sm.ct[(2 * pr + 1) * cst + r] = (int32_t)c[u].y;
          }
        }
      }
      sm.red[g * ne + 2 * pr] = a0;
      sm.red[g * ne + 2 * pr + 1] = a1;
      tsum += a0 + a1;
    }
  } else {
    groups = ne <= nt ? nt / ne : 1;
    for (int i = tid; i < ne * groups; i += nt) {
      const int x = i % ne, g = i / ne;
      int64_t acc = 0;
      for (int r0 = g; r0 < ep; r0 += kLoadBatch * groups) {  // batches as above
        int64_t c[kLoadBatch];
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int r = r0 + u * groups;
          c[u] = r < ep ? __ldg(&C[(int64_t)r * ne + x]) : 0;
        }
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int r = r0 + u * groups;
          negative |= c[u] < 0;
          acc += c[u];
          if (p.stage_c && r < ep) sm.ct[x * cst + r] = (int32_t)c[u];
        }
      }
      sm.red[g * ne + x] = acc;
      tsum += acc;
    }
  }
  tsum = warp_sum64(tsum);
  if (lane == 0) sm.wsum[warp] = tsum;
  if (tid == 0) {
    sm.flags[1] = 0;
  }
  const bool neg_any = __syncthreads_or(negative);
  ECHO_PROF(1);

  // B: n[e]; slot and expert tables initialised.
  bool large = false;
  if (const int x = tid; x < ne) {
    int64_t acc = 0;
    for (int g = 0; g < groups; ++g) acc += sm.red[g * ne + x];
    sm.n[x] = acc;
    st[lay.off_tokens_per_expert + x] = acc;
    large |= acc >= kCountLimit;
    sm.first[x] = 0x7fffffff;
  }
  if (const int j = tid; j < S) {
    sm.hexp[j] = -1;
    sm.hval[j] = 0;
    sm.nxt[j] = -1;
    sm.rm[j] = 0;
    sm.filled[j] = 0;
  }
  if (const int q = tid; q < ep) {
    sm.outq[q] = 0;
    sm.inq[q] = 0;
  }
  const bool large_any = __syncthreads_or(large);
  const bool counts_ok = !neg_any && !large_any;
  ECHO_PROF(2);

  // C: total and avg from the warp totals; P1.2 load, P1.4 cap, P1.5 spill (the running sum
  // before e in its rank's (n asc, e asc) order); ballots of the positive ones.
  int64_t total = warp_sum64(lane < nwarps ? sm.wsum[lane] : 0);
  const int64_t avg = total / ep;
  {
    const int q = tid;
    int64_t cq = 0;
    if (q < ep) {
      int64_t l = 0;
      for (int i = 0; i < L; ++i) l += sm.n[q * L + i];
      const int64_t c = avg - l;
      cq = counts_ok && c > 0 ? c : 0;
      sm.load[q] = l;
      sm.cap[q] = cq;
      st[lay.off_load_per_rank + q] = l;
      st[lay.off_spare_capacity + q] = cq;
    }
    const unsigned qm = __ballot_sync(kFull, q < ep && cq > 0);
    if (lane == 0) sm.qmask[warp] = qm;
    const int x = tid;
    int64_t sx = 0;
    if (x < ne) {
      const int q0 = (x / L) * L;
      const int64_t nx = sm.n[x];
      int64_t before = 0;
      for (int i = q0; i < q0 + L; ++i) {
        const int64_t ni = sm.n[i];
        if (ni < nx || (ni == nx && i < x)) before += ni;
      }
      const int64_t a = before - avg, b = before + nx - avg;
      sx = counts_ok ? (b > 0 ? b : 0) - (a > 0 ? a : 0) : 0;
      sm.spill[x] = (int32_t)sx;
      st[lay.off_spill + x] = sx;
    }
    const unsigned pm = __ballot_sync(kFull, x < ne && sx > 0);
    if (lane == 0) sm.pmask[warp] = pm;
  }
  __syncthreads();
  ECHO_PROF(3);

  // D: compacted packed keys of the positive spills (chunks) and capacities (buckets).
  int P, Q;
  {
    const int cp = lane < nwarps ? __popc(sm.pmask[lane]) : 0;
    const int cq = lane < nwarps ? __popc(sm.qmask[lane]) : 0;
    P = __reduce_add_sync(kFull, cp);
    Q = __reduce_add_sync(kFull, cq);
    const int pbefore = __reduce_add_sync(kFull, lane < warp ? cp : 0);
    const int qbefore = __reduce_add_sync(kFull, lane < warp ? cq : 0);
    const unsigned lt = lanemask_lt();
    if (tid < ne && sm.spill[tid] > 0) {
      const int pos = pbefore + __popc(sm.pmask[warp] & lt);
      sm.ckey[pos] = ((uint64_t)sm.spill[tid] << 11) | (uint64_t)(2047 - tid);
    }
    if (tid < ep && sm.cap[tid] > 0) {
      const int pos = qbefore + __popc(sm.qmask[warp] & lt);
      sm.qkey[pos] = ((uint64_t)sm.cap[tid] << 11) | (uint64_t)(2047 - tid);
    }
  }
  __syncthreads();
  ECHO_PROF(4);

  // E: G.1 / G.2 / A.1 chunk order (spill desc, e asc) and bucket order (cap desc, q asc) with
  // G.3's interval ends.
  rank_keys(sm.ckey, P, 0, kChunkThreads, [&](int i, int pos, int64_t end) {
    const uint64_t k = sm.ckey[i];
    sm.ps[pos] = 2047 - (int)(k & 2047);
    sm.sps[pos] = (int32_t)(k >> 11);
    sm.ce[pos] = end;
  });
  rank_keys(sm.qkey, Q, kChunkThreads, nt - kChunkThreads, [&](int i, int pos, int64_t end) {
    const uint64_t k = sm.qkey[i];
    const int64_t c = (int64_t)(k >> 11);
    sm.pc[pos] = 2047 - (int)(k & 2047);
    sm.cps[pos] = (int32_t)(c < kCountLimit ? c : kCountLimit);
    sm.be[pos] = end;
  });
  __syncthreads();
  ECHO_PROF(5);

  if (!approx) {
    // G.4 / G.5 per bucket b: the chunks with a positive overlap form a run [a_lo, a_hi];
    // interior chunks overlap whole (non-increasing), so the top S_per by (ov desc, position
    // asc) are among a_lo, a_hi and the first S_per interior chunks.
    for (int b = tid; b < Q; b += nt) {
      const int q = sm.pc[b];
      const int64_t bend = sm.be[b], bs = bend - sm.cap[q];
      int lo = 0, hi = P;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (sm.ce[mid] > bs) hi = mid; else lo = mid + 1;
      }
      const int a_lo = lo;
      hi = P;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (sm.ce[mid] >= bend) hi = mid; else lo = mid + 1;
      }
      const int a_hi = lo < P ? lo : P - 1;
      if (a_lo >= P || a_hi < a_lo) continue;
      auto ov = [&](int a) -> int64_t {
        const int64_t e_ = sm.ce[a], s_ = e_ - sm.sps[a];
        const int64_t v = (e_ < bend ? e_ : bend) - (s_ > bs ? s_ : bs);
        return v > 0 ? v : 0;
      };
      auto put = [&](int rank, int a, int64_t v) {
        if (rank < sp && v > 0) {
          sm.hexp[q * sp + rank] = sm.ps[a];
          sm.hval[q * sp + rank] = (int32_t)v;
        }
      };
      const int64_t ov_lo = ov(a_lo);
      const bool has_hi = a_hi != a_lo;
      const int64_t ov_hi = has_hi ? ov(a_hi) : 0;
      const int n_int = a_hi - a_lo - 1 > 0 ? a_hi - a_lo - 1 : 0;
      const int n_try = n_int < sp ? n_int : sp;
      int r_lo = has_hi && ov_hi > ov_lo ? 1 : 0;
      int r_hi = ov_lo >= ov_hi ? 1 : 0;
      for (int i = 0; i < n_try; ++i) {
        const int a = a_lo + 1 + i;
        const int64_t v = sm.sps[a];
        r_lo += v > ov_lo ? 1 : 0;
        r_hi += v >= ov_hi ? 1 : 0;
        put(i + (ov_lo >= v ? 1 : 0) + (has_hi && ov_hi > v ? 1 : 0), a, v);
      }
      put(r_lo, a_lo, ov_lo);
      if (has_hi) put(r_hi, a_hi, ov_hi);
    }
  } else if (warp == 0) {
    // A.2-A.5 by warp 0.
    const ApproxBuckets bucket(avg);
    approx_pops(sm, P, Q, bucket, lane);
#ifdef CAPMOE_ECHO_PROF
    if (lane == 0) {
      g_echo_prof[12] = Q;
      g_echo_prof[13] = P;
    }
#endif
  }
  __syncthreads();
  ECHO_PROF(6);

  // G: H before reclaim; P3 reclaim (greedy, thr > 0); P4 slot_expert, each expert's lowest
  // slot, planned tokens out of / into every rank.
  const bool reclaim = !approx && d.thr > 0.0f;
  if (const int j = tid; j < S) {
    const int v = sm.hval[j];
    int e = sm.hexp[j];
    if (approx && v > 0) e = sm.ps[e];
    sm.hexp[j] = v > 0 ? e : -1;
    st[lay.off_pre_reclaim_expert + j] = v > 0 ? e : -1;
    st[lay.off_pre_reclaim_tokens + j] = v > 0 ? v : 0;
  }
  if (reclaim) {
    __syncthreads();
    const float avgf = __ll2float_rn(avg);
    const float maxload = __fadd_rn(avgf, __fmul_rn(d.thr, avgf));
    if (const int q = tid; q < ep) {
      int64_t out = 0;
      for (int j = 0; j < S; ++j)
        if (sm.hval[j] > 0 && sm.hexp[j] / L == q) out += sm.hval[j];
      const float head = __fsub_rn(maxload, __ll2float_rn(sm.load[q] - out));
      sm.head[q] = head;
      if (head < 0.0f) atomicOr(&sm.flags[1], 1);
    }
    __syncthreads();
    bool keep = true;
    if (tid < S) {
      const int j = tid;
      const int64_t v = sm.hval[j];
      keep = sm.flags[1] != 0;
      if (!keep && v > 0) {
        const int owner = sm.hexp[j] / L;
        int64_t cum = 0;
        for (int i = 0; i < S; ++i) {
          const int64_t w = sm.hval[i];
          if (w > 0 && sm.hexp[i] / L == owner && (w < v || (w == v && i <= j))) cum += w;
        }
        keep = __ll2float_rn(cum) > sm.head[owner];
      }
    }
    __syncthreads();
    if (tid < S && !keep) {
      sm.hval[tid] = 0;
      sm.hexp[tid] = -1;
    }
  }
  if (const int j = tid; j < S) {
    const int v = sm.hval[j];
    const int e = v > 0 ? sm.hexp[j] : -1;
    sm.se[j] = e;
    st[lay.off_slot_expert + j] = e;
    st[lay.off_slot_tokens + j] = e >= 0 ? v : 0;
    if (e < 0) {
      sm.hval[j] = 0;
      st[lay.off_remaining_capacity + j] = 0;
      slot_route[j] = make_int4(-1, -1, 0, 0);
    } else {
      atomicMin(&sm.first[e], j);
      atomicAdd(&sm.outq[e / L], (unsigned long long)v);
      atomicAdd(&sm.inq[j / sp], (unsigned long long)v);
    }
  }
  // The error word before the barrier: P5-P7 below OR their flags into it.
  if (tid == 0) {
    st[lay.off_avg] = avg;
    st[lay.off_error] = (neg_any ? CAPMOE_ECHO_ERR_NEGATIVE_COUNT : 0) |
                        (large_any ? CAPMOE_ECHO_ERR_COUNT_TOO_LARGE : 0) |
                        (tokens_out_of_range(p) ? CAPMOE_ECHO_ERR_BAD_TOKENS : 0);
  }
  __syncthreads();
  ECHO_PROF(7);

  // The rest of the state that P4 settles (no barrier follows: the block ends with P5-P7).
  if (const int x = tid; x < ne)
    if (sm.first[x] >= S) expert_route[x] = make_int2(-1, 0);
  if (const int q = tid; q < ep)
    st[lay.off_load_after + q] = sm.load[q] - (int64_t)sm.outq[q] + (int64_t)sm.inq[q];

  // H: P5-P7 fused, one warp per supplying expert (found at its lowest slot), two consecutive
  // source ranks per lane so one warp scan covers 64 ranks. Float32 stages use
  // __fdiv_rn/__fmul_rn exactly as the spec. Every value here is below 2^24 (valid counts).
  // An inconsistent plan (never for valid counts): OR-ed into the error word written before P4's
  // barrier.
  auto flag_internal_error = [&] {
    atomicOr(reinterpret_cast<unsigned long long*>(st + lay.off_error), (unsigned long long)CAPMOE_ECHO_ERR_INTERNAL);
  };
  auto getC = [&](int r, int e) -> int {
    if (p.stage_c) return sm.ct[e * cst + r];
    return (int)__ldg(&C[(int64_t)r * ne + e]);
  };
  // F as read back: the staged copy or the state (one uniform branch, so each stays a
  // shared-memory or a global access rather than a generic one).
  auto getF = [&](int j, int r) -> int {
    if (p.stage_f) return sm.fs[j * ep + r];
    return Fg[(int64_t)j * ep + r];
  };
  const bool pairs = (ep & 1) == 0;
  // One supplying expert e, found at its lowest slot j0, by the whole warp.
  auto supply = [&](int j0, int e) {
    // The expert's slots in ascending order, as a list in nxt[].
    {
      int prev = j0;
      for (int b = j0 & ~31; b < S; b += 32) {
        unsigned m = __ballot_sync(kFull, b + lane < S && b + lane > j0 && sm.se[b + lane] == e);
        while (m) {
          const int i = b + __ffs(m) - 1;
          m &= m - 1;
          if (lane == 0) sm.nxt[prev] = i;
          prev = i;
        }
      }
      __syncwarp();
    }
    const float den = __int2float_rn((int)sm.n[e]);
    // P5: F, and per slot the sum over ranks (-> Rm, settled by lane 0 on the last pass).
    // NOTE: no separate lane-0 pass over the slots afterwards: each walk of the slot list is a
    // chain of dependent shared-memory loads, and H is the slowest warp's chains. With one pass
    // (ep <= 64) the lane's F sums over the slots stay in registers for P6 (fsa, fsb).
    int fsa = 0, fsb = 0;
    for (int r0 = 0; r0 < ep; r0 += 64) {
      const int ra = r0 + 2 * lane, rb = ra + 1;
      const bool va = ra < ep, vb = rb < ep, last = r0 + 64 >= ep;
      const float sa = __fdiv_rn(__int2float_rn(va ? getC(ra, e) : 0), den);
      const float sb = __fdiv_rn(__int2float_rn(vb ? getC(rb, e) : 0), den);
      for (int j = j0; j >= 0;) {
        const int jn = sm.nxt[j], hv = sm.hval[j];
        const float cj = __int2float_rn(hv);
        const int fa = va ? (int)floorf(__fmul_rn(sa, cj)) : 0;
        const int fb = vb ? (int)floorf(__fmul_rn(sb, cj)) : 0;
        store_rank_pair(Fg + (int64_t)j * ep, ra, va, vb, fa, fb, pairs);
        if (p.stage_f) store_rank_pair(sm.fs + j * ep, ra, va, vb, fa, fb, pairs);
        fsa += fa;
        fsb += fb;
        const int tot = __reduce_add_sync(kFull, fa + fb);
        if (lane == 0) {
          const int acc = sm.rm[j] + tot;
          if (last) {
            const int rmj = hv - acc;
            sm.rm[j] = rmj;
            st[lay.off_remaining_capacity + j] = rmj;
            if (rmj < 0) flag_internal_error();
          } else {
            sm.rm[j] = acc;
          }
        }
        j = jn;
      }
    }
    __syncwarp();
    // P6 / P7: the source line (C1 by rank, warp scan) against the slot line (Rm in slot
    // order); Ftot[rho] gives each slot's range in the expert's token list on rank rho.
    int carry = 0, off = 0;
    for (int r0 = 0; r0 < ep; r0 += 64) {
      const int ra = r0 + 2 * lane, rb = ra + 1;
      const bool va = ra < ep, vb = rb < ep;
      int c1a = va ? getC(ra, e) : 0, c1b = vb ? getC(rb, e) : 0;
      if (ep <= 64) {
        c1a -= fsa;  // (0 where !va / !vb)
        c1b -= fsb;
      } else {
        for (int j = j0; j >= 0; j = sm.nxt[j]) {
          if (va) c1a -= getF(j, ra);
          if (vb) c1b -= getF(j, rb);
        }
      }
      const int pair = c1a + c1b;
      int incl = pair;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += y;
      }
      const int aa = carry + incl - pair, ab = aa + c1a;
      carry += __shfl_sync(kFull, incl, 31);
      const bool has_rho = d.rho >= r0 && d.rho < r0 + 64;
      const int rho_lane = (d.rho - r0) >> 1;
      int bj = 0;
      const bool last = r0 + 64 >= ep;
      for (int j = j0; j >= 0;) {
        const int jn = sm.nxt[j];
        const int rmj = sm.rm[j];
        const int da = va ? max(0, min(aa + c1a, bj + rmj) - max(aa, bj)) : 0;
        const int db = vb ? max(0, min(ab + c1b, bj + rmj) - max(ab, bj)) : 0;
        store_rank_pair(Dg + (int64_t)j * ep, ra, va, vb, da, db, pairs);
        const int fta = va ? getF(j, ra) + da : 0, ftb = vb ? getF(j, rb) + db : 0;
        const int tot = __reduce_add_sync(kFull, fta + ftb);
        if (has_rho) {
          const int f_rho = __shfl_sync(kFull, (d.rho & 1) ? ftb : fta, rho_lane);
          if (lane == 0) {
            sm.soff[j] = off;
            sm.send[j] = off + f_rho;
          }
          off += f_rho;
        }
        if (lane == 0) {
          const int fl = sm.filled[j] + tot;
          if (last) {
            // (soff / send: written above by this lane, in this pass or an earlier one)
            if (fl != sm.hval[j]) flag_internal_error();
            slot_route[j] = make_int4(e, jn, sm.soff[j], sm.send[j]);
          } else {
            sm.filled[j] = fl;
          }
        }
        bj += rmj;
        j = jn;
      }
    }
    if (lane == 0) expert_route[e] = make_int2(j0, off);
    __syncwarp();
  };
  // The k-th supplying expert (in order of lowest slot) goes to warp k % nwarps: every warp
  // finds them all (a ballot per 32 slots, no barrier), so the work spreads evenly however the
  // lowest slots fall (by slot index, one warp could get S / nwarps experts and another none).
  // NOTE: a warp goes straight to its own leads (the n-th set bit) rather than stepping
  // through every lead of the block: all 32 warps issue this, so it was ~8x its length per
  // scheduler.
  for (int b = 0, seen = 0, k = warp; b < S; b += 32) {
    const int j = b + lane;
    const int ej = j < S ? sm.se[j] : -1;
    const unsigned leads = __ballot_sync(kFull, ej >= 0 && sm.first[ej] == j);
    const int cnt = __popc(leads);
    for (; k < seen + cnt; k += nwarps) {
      const int j0 = b + nth_set_bit(leads, k - seen);
      supply(j0, sm.se[j0]);
    }
    seen += cnt;
  }
#ifdef CAPMOE_ECHO_PROF
  __syncthreads();  // (profiling only: the stamps below then mark the block's end)
#endif
  ECHO_PROF(8);
  if (p.block_capacity >= 0) balance_blocks(p, sm);

  // I: without tokens, the offload map (it reads only slot_expert, settled by P4).
  if (p.num_tiles == 0) {
    // Offload map M[e][j] as bytes, written 8 at a time (the reroute launch writes it when
    // there are tokens).
    uint64_t* mwords = reinterpret_cast<uint64_t*>(st + lay.off_offload_map);
    const int nbytes = ne * S, nw = (nbytes + 7) / 8;
    for (int w = tid; w < nw; w += nt) {
      uint64_t word = 0;
      int i = w * 8, x = i / S, jj = i % S;
      for (int b = 0; b < 8 && i < nbytes; ++b, ++i) {
        if (sm.se[jj] == x) word |= uint64_t(1) << (8 * b);
        if (++jj == S) {
          jj = 0;
          ++x;
        }
      }
      mwords[w] = word;
    }
  }
  ECHO_PROF(9);
}

// Block balancing (capped top-k form, an EP extension beyond the spec; the rule and its CPU
// twin: echo::reference::balance_blocks). After P7 this rank's routes per final column are
// known (a home column keeps C[rho][e] minus the expert's slot ranges, a slot takes its
// range); for every peer over block_capacity, warp 0 moves routes of its replicated experts to
// the expert's column with the most room on another peer (ties: the lowest column), never
// filling a peer past the capacity; then each replicated expert's slot ranges are rewritten
// (consecutive in slot order, the home column keeps the rest), which is all the reroute reads.
// One warp runs the moves: each is a warp-wide search over the expert's slots, and a source
// rank has few over-full blocks after P7 (none when the plan already fits).
__device__ void balance_blocks(const Params& p, const PlanSmem& sm) {
  const Dims d = p.d;
  const int ne = d.ne, ep = d.ep, sp = d.sp, L = d.l, S = d.s, B = L + sp, cap = p.block_capacity;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int nt = kPlanThreads;
  int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  int4* slot_route = reinterpret_cast<int4*>(st + lay.off_slot_route);
  int2* expert_route = reinterpret_cast<int2*>(st + lay.off_expert_route);
  __syncthreads();  // P5-P7's ranges (soff / send) and error bits are settled
  // (uniform) A plan zeroed for invalid counts, or one that failed an invariant, stays as it is.
  constexpr int kInvalidPlan =
      CAPMOE_ECHO_ERR_NEGATIVE_COUNT | CAPMOE_ECHO_ERR_COUNT_TOO_LARGE | CAPMOE_ECHO_ERR_INTERNAL;
  if (st[lay.off_error] & kInvalidPlan) return;
  const int cols = ep * B;
  for (int q = tid; q < ep; q += nt) sm.bload[q] = 0;
  __syncthreads();
  for (int c = tid; c < cols; c += nt) {
    const int q = c / B, i = c % B;
    int a = 0;
    if (i < L) {
      const int e = q * L + i;
      a = (int)p.counts[(int64_t)d.rho * ne + e];
      for (int j = sm.first[e]; j >= 0 && j < S; j = sm.nxt[j]) a -= sm.send[j] - sm.soff[j];
    } else if (const int j = q * sp + i - L; sm.se[j] >= 0) {
      a = sm.send[j] - sm.soff[j];
    }
    sm.amount[c] = a;
    if (a != 0) atomicAdd(&sm.bload[q], a);
  }
  __syncthreads();
  if (warp == 0) {
    // The expert's column on a peer other than `from` with the most room (ties: the lowest
    // column), as room * 2^32 + ~column; lanes split the slots, the home column on lane 0.
    auto best_column = [&](int e, int from) -> int64_t {
      int64_t best = INT64_MIN;
      auto offer = [&](int col) {
        const int q = col / B;
        if (q == from) return;
        const int64_t key = (int64_t)(cap - sm.bload[q]) * (int64_t(1) << 32) + (uint32_t)~col;
        best = key > best ? key : best;
      };
      if (lane == 0) offer((e / L) * B + e % L);
      for (int j = (sm.first[e] & ~31) + lane; j < S; j += 32)
        if (sm.se[j] == e) offer((j / sp) * B + L + j % sp);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const int64_t other = __shfl_xor_sync(kFull, best, o);
        best = other > best ? other : best;
      }
      return best;
    };
    for (int q0 = 0; q0 < ep; q0 += 32) {
      // Peers over the capacity stay over until their turn: a move only fills a peer's room.
      unsigned over_full = __ballot_sync(kFull, q0 + lane < ep && sm.bload[q0 + lane] > cap);
      for (; over_full != 0; over_full &= over_full - 1) {
        const int from = q0 + __ffs(over_full) - 1;
        for (int c = from * B; c < (from + 1) * B; ++c) {
          const int i = c - from * B;
          const int e = i < L ? from * L + i : sm.se[from * sp + i - L];
          if (e < 0 || sm.first[e] >= S) continue;  // no other column: its routes stay
          int todo = min(sm.amount[c], sm.bload[from] - cap);
          while (todo > 0) {
            const int64_t best = best_column(e, from);
            const int room = (int)(best >> 32);
            if (best == INT64_MIN || room <= 0) break;
            const int to = (int)~(uint32_t)best, m = min(todo, room);
            __syncwarp();  // every lane has read the loads before lane 0 changes them
            if (lane == 0) {
              sm.amount[c] -= m;
              sm.amount[to] += m;
              sm.bload[from] -= m;
              sm.bload[to / B] += m;
            }
            __syncwarp();
            todo -= m;
          }
        }
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < ne; e += nt) {
    const int j0 = sm.first[e];
    if (j0 < 0 || j0 >= S) continue;
    int off = 0;
    for (int j = j0; j >= 0; j = sm.nxt[j]) {
      const int take = sm.amount[(j / sp) * B + L + j % sp];
      slot_route[j] = make_int4(e, sm.nxt[j], off, off + take);
      off += take;
    }
    expert_route[e] = make_int2(j0, off);
  }
}

// Routes per expert of one token tile (blocks 1.. of the plan launch).
__device__ void count_tile(const Params& p, int tile, int32_t* s_cnt) {
  const int ne = p.d.ne, tid = threadIdx.x, nt = blockDim.x;
  const int64_t tile_tokens = 32 * (int64_t)p.words;
  const int64_t t0 = tile * tile_tokens;
  const int64_t rows = tile_rows(p, tile);
  for (int x = tid; x < ne; x += nt) s_cnt[x] = 0;
  __syncthreads();
  if (p.form == kFormDense) {
    const uint8_t* m = p.map + t0 * ne;
    const int64_t n = rows * ne;
    if ((ne & 3) == 0 && (reinterpret_cast<uintptr_t>(p.map) & 3) == 0) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(m);
      for (int i = tid; i < (int)(n / 4); i += nt) {
        const uint32_t v = w[i];
        if (v == 0) continue;
        const int x0 = (i * 4) % ne;
        for (int b = 0; b < 4; ++b)
          if ((v >> (8 * b)) & 0xffu) atomicAdd(&s_cnt[x0 + b], 1);
      }
    } else {
      for (int i = tid; i < (int)n; i += nt)
        if (m[i]) atomicAdd(&s_cnt[i % ne], 1);
    }
  } else {
    const int k = p.d.topk;
    const int32_t* ids = p.ids + t0 * k;
    for (int64_t i = tid; i < rows * k; i += nt) {
      const int32_t x = ids[i];
      if (x >= 0 && x < ne) atomicAdd(&s_cnt[x], 1);
    }
  }
  __syncthreads();
  for (int x = tid; x < ne; x += nt) p.tile_counts[(int64_t)tile * ne + x] = s_cnt[x];
}

__global__ void __launch_bounds__(kPlanThreads, 1) plan_kernel(const Params p) {
  CAPMOE_DYNAMIC_SMEM(smem);
  // NOTE: the reroute launch may start now; it reads nothing of ours before its
  // griddepcontrol.wait, which waits for this whole grid to finish and flush.
  launch_dependents();
  ECHO_NS_FIRST(0);
  if (blockIdx.x == 0) {
    ECHO_NS_LAST(1);
    plan_block(p, smem);
    ECHO_NS_LAST(2);
  } else {
    count_tile(p, blockIdx.x - 1, reinterpret_cast<int32_t*>(smem));
    ECHO_NS_LAST(3);
  }
}

// ---------------------------------------------------------------------------------------------
// Reroute: one block per token tile.

// Zeroes n bytes at dst with the block's threads: 16-byte stores over the aligned middle.
__device__ inline void zero_bytes(uint8_t* dst, int64_t n, int tid, int nt) {
  int64_t head = (16 - (int64_t)(reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  const int64_t vectors = (n - head) / 16;
  for (int64_t i = tid; i < head; i += nt) dst[i] = 0;
  uint4* middle = reinterpret_cast<uint4*>(dst + head);
  for (int64_t i = tid; i < vectors; i += nt) middle[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + 16 * vectors + tid; i < n; i += nt) dst[i] = 0;
}

struct RerouteSmem {
  uint32_t* mask;    // [E][W]
  int32_t* wbase;    // [E][W]: rank of the first token of word w in the expert's token list
  int4* slot;        // [S] the state's slot_route
  int2* expr;        // [E] the state's expert_route
  int32_t* part;     // [kPartLen] partial tile prefixes (>= groups * E in both prefix paths)
  int32_t* ids;      // [32 W k] top-k form: the tile's expert ids
  uint32_t* probs;   // [32 W E] dense form with stage_probs: the tile's probs
  int32_t* routes;   // [kRouteList] dense form: the tile's routes, mask word * 32 + bit
  int32_t* flags;    // [2]: error flags, the dense form's route count

  static constexpr int kPartLen = 4 * kRerouteThreads > kMaxExperts ? 4 * kRerouteThreads : kMaxExperts;

  __host__ __device__ size_t carve(unsigned char* base, int ne, int s, int words, int form, int topk,
                                   bool stage_probs) {
    Carver c{base, 0};
    mask = c.take<uint32_t>((size_t)ne * words);
    wbase = c.take<int32_t>((size_t)ne * words);
    slot = c.take<int4>(s);
    expr = c.take<int2>(ne);
    part = c.take<int32_t>(kPartLen);
    ids = c.take<int32_t>(form == kFormTopk ? (size_t)32 * words * topk : 0);
    probs = c.take<uint32_t>(stage_probs ? (size_t)32 * words * ne : 0);
    routes = c.take<int32_t>(form == kFormDense ? kRouteList : 0);
    flags = c.take<int32_t>(2);
    return c.off + 16;
  }
};

// Dense form, before the wait: lists the tile's routes (mask word * 32 + bit, in no particular
// order) for the route writes after it, and counts them in flags[1]; past kRouteList the count
// still grows (the writes then walk the mask words). Why: one thread a mask word left a hot
// expert's word (up to 32 routes, each a dependent chain of shared loads) to one thread after
// the wait, while one route a thread keeps every thread's chain one route long.
__device__ inline void list_routes(const RerouteSmem& sm, int nwords, int tid, int nt) {
  for (int i = tid; i < nwords; i += nt) {
    uint32_t word = sm.mask[i];
    if (word == 0) continue;
    int at = atomicAdd(&sm.flags[1], __popc(word));
    for (; word != 0 && at < kRouteList; word &= word - 1, ++at) sm.routes[at] = 32 * i + __ffs(word) - 1;
  }
}

// The output column of the route at `pos` in expert x's (ascending) token list: its home
// column past the routes moved off the expert, else the slot whose range of the list holds it;
// -1 when no slot does (only an inconsistent plan).
__device__ inline int route_column(const RerouteSmem& sm, int x, int pos, int L, int sp) {
  const int B = L + sp;
  const int2 ex = sm.expr[x];
  if (pos >= ex.y) return (x / L) * B + x % L;
  int j = ex.x;
  int4 sl = j >= 0 ? sm.slot[j] : make_int4(-1, -1, 0, 0);
  while (j >= 0 && pos >= sl.w) {
    j = sl.y;
    if (j >= 0) sl = sm.slot[j];
  }
  return j >= 0 && pos >= sl.z ? (j / sp) * B + L + j % sp : -1;
}

// NOTE: one block an SM at least (not two), so ptxas may take the registers the prefix loop's
// batch of loads needs in flight (at the default bound it kept two or three).
__global__ void __launch_bounds__(kRerouteThreads, 1) reroute_kernel(const Params p) {
  CAPMOE_DYNAMIC_SMEM(smem);
  const Dims d = p.d;
  const int ne = d.ne, S = d.s, W = p.words, tid = threadIdx.x, nt = blockDim.x;
  const int tile = blockIdx.x;
  const int64_t tile_tokens = 32 * (int64_t)W;
  const int64_t t0 = tile * tile_tokens;
  const int rows = tile_rows(p, tile);
  const int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  RerouteSmem sm;
  sm.carve(smem, ne, S, W, p.form, d.topk, p.stage_probs);
  const int L = d.l, sp = d.sp, B = L + sp;
  ECHO_NS_FIRST(4);

  // Before the plan is known: the tile's routes (and probs).
  if (tid == 0) {
    sm.flags[0] = 0;  // (an out-of-range device T is flagged by the plan block)
    sm.flags[1] = 0;
  }
  for (int i = tid; i < ne * W; i += nt) sm.mask[i] = 0;
  if (p.form == kFormDense) {
    if (p.stage_probs) {
      const char* src = reinterpret_cast<const char*>(p.probs_bits + t0 * ne);
      char* dst = reinterpret_cast<char*>(sm.probs);
      const int chunks = rows * ne / 4;  // 16-byte pieces (host: E % 4 == 0, 16-byte aligned)
      for (int i = tid; i < chunks; i += nt) cp_async16(dst + 16 * (size_t)i, src + 16 * (size_t)i);
    }
    // The tile's output rows start all zero (the plan is not needed for that): after the
    // wait only its routes are written.
    const int64_t width = ne + S;
    zero_bytes(p.out_map + t0 * width, rows * width, tid, nt);
    zero_bytes(reinterpret_cast<uint8_t*>(p.out_probs_bits + t0 * width), rows * width * 4, tid, nt);
  } else {
    const int k = d.topk;
    const int32_t* ids = p.ids + t0 * k;
    for (int i = tid; i < rows * k; i += nt) sm.ids[i] = ids[i];
    if (p.out_probs_k_bits)
      for (int i = tid; i < rows * k; i += nt) p.out_probs_k_bits[t0 * k + i] = p.probs_bits[t0 * k + i];
  }
  __syncthreads();
  if (p.form == kFormDense) {
    const uint8_t* m = p.map + t0 * ne;
    const int64_t n = (int64_t)rows * ne;
    if ((ne & 3) == 0 && (reinterpret_cast<uintptr_t>(p.map) & 3) == 0) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(m);
      for (int i = tid; i < (int)(n / 4); i += nt) {
        const uint32_t v = w[i];
        if (v == 0) continue;
        const int t = (i * 4) / ne, x0 = (i * 4) % ne;
        for (int b = 0; b < 4; ++b)
          if ((v >> (8 * b)) & 0xffu) atomicOr(&sm.mask[(x0 + b) * W + (t >> 5)], 1u << (t & 31));
      }
    } else {
      for (int i = tid; i < (int)n; i += nt) {
        if (!m[i]) continue;
        const int t = i / ne, x = i % ne;
        atomicOr(&sm.mask[x * W + (t >> 5)], 1u << (t & 31));
      }
    }
  } else {
    const int k = d.topk;
    for (int i = tid; i < rows * k; i += nt) {
      const int32_t x = sm.ids[i];
      const int t = i / k;
      if (x >= 0 && x < ne) atomicOr(&sm.mask[x * W + (t >> 5)], 1u << (t & 31));
      else atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE);
    }
  }

  if (p.form == kFormDense) {
    __syncthreads();  // (the mask is complete)
    list_routes(sm, ne * W, tid, nt);
  }

  // The plan (and every tile's counts) from here on.
  ECHO_NS_LAST(5);
  grid_dependency_wait();
  ECHO_NS_FIRST(6);
  ECHO_NS_LAST(9);
  // Every global load of this section is issued before any of them is used, so the block
  // waits about one memory latency for all of them. (The section still takes the last tile
  // about 3 us on an H200, most of it summing 127 earlier tiles' counts; counting the earlier
  // tiles' ids before the wait instead took over 20 us of shared-memory atomics.) Per
  // thread: its (up to kPerThread) slots and experts of the plan, its experts' count in this
  // tile and (last tile) on this rank, and its share of the earlier tiles' counts.
  constexpr int kPerThread = (kMaxExperts + kRerouteThreads - 1) / kRerouteThreads;
  static_assert(kMaxSpare <= kPerThread * kRerouteThreads, "one pass of the block covers every slot");
  const bool last_tile = tile == p.num_tiles - 1;
  int4 slot_v[kPerThread];
  int2 expr_v[kPerThread];
  int own_v[kPerThread];
  int64_t rank_total_v[kPerThread];
  {
    const int4* sr = reinterpret_cast<const int4*>(st + lay.off_slot_route);
    const int2* er = reinterpret_cast<const int2*>(st + lay.off_expert_route);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int j = tid + i * nt, x = tid + i * nt;
      if (j < S) slot_v[i] = sr[j];
      if (x < ne) {
        expr_v[i] = er[x];
        own_v[i] = p.tile_counts[(int64_t)tile * ne + x];
        rank_total_v[i] = last_tile ? p.counts[(int64_t)d.rho * ne + x] : 0;
      }
    }
  }
  // Rank of each mask word's first token in its expert's list: earlier tiles + earlier words.
  // Threads of one expert split the earlier tiles; partial sums combined in a fixed order.
  int groups;
  if ((ne & 3) == 0 && (reinterpret_cast<uintptr_t>(p.tile_counts) & 15) == 0) {
    // 16-byte loads of 4 experts' counts; nt / (E/4) groups of threads split the earlier tiles.
    const int nq = ne >> 2;
    groups = nq <= nt ? nt / nq : 1;
    for (int i = tid; i < nq * groups; i += nt) {
      const int xq = i % nq, g = i / nq;
      int4 acc = make_int4(0, 0, 0, 0);
      // NOTE: a batch's loads are all issued before any is used, unpredicated (a row past the
      // end is clamped to the last one and not added): as one unrolled loop the compiler kept
      // two loads in flight a thread, and predicated loads run out of predicate registers.
      for (int tl0 = g; tl0 < tile; tl0 += kLoadBatch * groups) {
        int4 v[kLoadBatch];
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int tl = min(tl0 + u * groups, tile - 1);
          v[u] = *(reinterpret_cast<const int4*>(p.tile_counts + (int64_t)tl * ne) + xq);
        }
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          if (tl0 + u * groups >= tile) continue;
          acc.x += v[u].x;
          acc.y += v[u].y;
          acc.z += v[u].z;
          acc.w += v[u].w;
        }
      }
      reinterpret_cast<int4*>(sm.part + g * ne)[xq] = acc;
    }
  } else {
    groups = ne <= nt ? nt / ne : 1;
    for (int i = tid; i < ne * groups; i += nt) {
      const int x = i % ne, g = i / ne;
      int acc = 0;
#pragma unroll 8
      for (int tl = g; tl < tile; tl += groups) acc += p.tile_counts[(int64_t)tl * ne + x];
      sm.part[i] = acc;
    }
  }
  ECHO_NS_LAST(10);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int j = tid + i * nt, x = tid + i * nt;
    if (j < S) sm.slot[j] = slot_v[i];
    if (x < ne) sm.expr[x] = expr_v[i];
  }
  __syncthreads();
  ECHO_NS_LAST(11);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int x = tid + i * nt;
    if (x >= ne) continue;
    int64_t base = 0;
    for (int g = 0; g < groups; ++g) base += sm.part[g * ne + x];
    int64_t in_tile = 0;
    for (int w = 0; w < W; ++w) {
      sm.wbase[x * W + w] = (int32_t)(base + in_tile);
      in_tile += __popc(sm.mask[x * W + w]);
    }
    if (in_tile != own_v[i]) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_DUPLICATE_ROUTE);
    if (last_tile && base + in_tile != rank_total_v[i])
      atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_ROUTING_MISMATCH);
  }
  if (p.stage_probs) cp_async_wait_all();
  __syncthreads();
  ECHO_NS_LAST(7);

  const int width = ne + S;
  if (p.form == kFormDense) {
    // Every route of the tile, one listed route per thread at a time (one mask word when the
    // list overflowed), at route_column's column; the rest of the rows was zeroed before the
    // wait. A route no column takes (only an inconsistent plan) is not written.
    uint8_t* om = p.out_map + t0 * width;
    uint32_t* op = p.out_probs_bits + t0 * width;
    const uint32_t* prg = p.probs_bits + t0 * ne;
    auto put = [&](int i, int b) {  // route: bit b of mask word i
      const int x = i / W, t = 32 * (i % W) + b;
      const int col = route_column(sm, x, sm.wbase[i] + __popc(sm.mask[i] & ((1u << b) - 1u)), L, sp);
      if (col < 0) return;
      om[(int64_t)t * width + col] = 1;
      op[(int64_t)t * width + col] = p.stage_probs ? sm.probs[t * ne + x] : prg[(int64_t)t * ne + x];
    };
    const int listed = sm.flags[1];
    if (listed <= kRouteList) {
      for (int r = tid; r < listed; r += nt) put(sm.routes[r] >> 5, sm.routes[r] & 31);
    } else {
      for (int i = tid; i < ne * W; i += nt)
        for (uint32_t word = sm.mask[i]; word != 0; word &= word - 1) put(i, __ffs(word) - 1);
    }
  } else {
    const int k = d.topk;
    int32_t* od = p.out_dest + t0 * k;
    for (int i = tid; i < rows * k; i += nt) {
      const int32_t x = sm.ids[i];
      const int t = i / k;
      int32_t col = -1;
      if (x >= 0 && x < ne) {
        const uint32_t word = sm.mask[x * W + (t >> 5)];
        const uint32_t bit = 1u << (t & 31);
        const int pos = sm.wbase[x * W + (t >> 5)] + __popc(word & (bit - 1u));
        col = route_column(sm, x, pos, L, sp);
        // A route no slot takes (only an inconsistent plan): flagged, and kept at its home column.
        if (col < 0) {
          atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
          col = (x / L) * B + x % L;
        }
      }
      od[i] = col;
    }
  }
  {
    // This block's share of the offload map M[e][j] (bytes, 8 at a time).
    uint64_t* mwords = reinterpret_cast<uint64_t*>(p.state + lay.off_offload_map);
    const int nbytes = ne * S, nw = (nbytes + 7) / 8;
    const int per = (nw + p.num_tiles - 1) / p.num_tiles;
    const int w_end = min(nw, (tile + 1) * per);
    for (int w = tile * per + tid; w < w_end; w += nt) {
      uint64_t word = 0;
      int i = w * 8, x = i / S, jj = i % S;
      for (int b = 0; b < 8 && i < nbytes; ++b, ++i) {
        if (sm.slot[jj].x == x) word |= uint64_t(1) << (8 * b);
        if (++jj == S) {
          jj = 0;
          ++x;
        }
      }
      mwords[w] = word;
    }
  }
  __syncthreads();
  if (tid == 0 && sm.flags[0] != 0)
    atomicOr(reinterpret_cast<unsigned long long*>(p.state + lay.off_error),
             (unsigned long long)sm.flags[0]);
  ECHO_NS_LAST(8);
}

// ---------------------------------------------------------------------------------------------
// Host side.

capmoe_status_t make_dims(const capmoe_echo_config_t* cfg, Dims* d) {
  if (!cfg) return CAPMOE_ERR_INVALID_ARGUMENT;
  const int64_t ep = cfg->ep, ne = cfg->num_experts, sp = cfg->spare_per_rank;
  if (ep < 1 || ne < 1 || ne % ep != 0 || ne > kMaxExperts) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (sp < 1 || sp > ne || ep * sp > kMaxSpare) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (cfg->algorithm != CAPMOE_ECHO_GREEDY && cfg->algorithm != CAPMOE_ECHO_APPROX)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (cfg->algorithm == CAPMOE_ECHO_APPROX && sp != 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (cfg->ep_rank < 0 || cfg->ep_rank >= ep) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (cfg->topk < 1 || cfg->topk > ne) return CAPMOE_ERR_INVALID_ARGUMENT;
  const float thr = cfg->threshold_multiplier;
  if (!(thr == thr) || thr > 3.0e38f || thr < -3.0e38f) return CAPMOE_ERR_INVALID_ARGUMENT;
  d->ep = (int)ep;
  d->ne = (int)ne;
  d->sp = (int)sp;
  d->l = (int)(ne / ep);
  d->s = (int)(ep * sp);
  d->rho = (int)cfg->ep_rank;
  d->topk = (int)cfg->topk;
  d->algorithm = cfg->algorithm;
  d->thr = thr;
  return CAPMOE_OK;
}

void make_layout(const Dims& d, capmoe_echo_layout_t* L) {
  int64_t o = 0;
  auto take = [&o](int64_t n) {
    int64_t at = o;
    o += n;
    return at;
  };
  // int32 sections: 16-byte aligned, n int32 rounded up to whole int64 elements.
  auto take32 = [&o](int64_t n) {
    o = (o + 1) & ~int64_t(1);
    int64_t at = o;
    o += (n + 1) / 2;
    return at;
  };
  const int64_t ne = d.ne, ep = d.ep, s = d.s;
  L->off_error = take(1);
  L->off_avg = take(1);
  L->off_tokens_per_expert = take(ne);
  L->off_load_per_rank = take(ep);
  L->off_spill = take(ne);
  L->off_spare_capacity = take(ep);
  L->off_pre_reclaim_expert = take(s);
  L->off_pre_reclaim_tokens = take(s);
  L->off_slot_tokens = take(s);
  L->off_slot_expert = take(s);
  L->off_remaining_capacity = take(s);
  L->off_load_after = take(ep);
  L->off_first_pass = take32(s * ep);
  L->off_second_pass = take32(s * ep);
  L->off_slot_route = take32(4 * s);
  L->off_expert_route = take32(2 * ne);
  L->off_offload_map = take(ceil_div(ne * s, 8));
  L->state_len = o;
}

// The most bitmask words per expert a reroute tile may have (its shared memory: the mask, and
// the ids of the top-k form; the layout does not know the form, so both forms use this bound).
int64_t max_words(const Dims& d) {
  int64_t w = kMaskBudget / d.ne;
  const int64_t ids_words = kIdsBudget / (int64_t(32 * sizeof(int32_t)) * d.topk);
  if (w > ids_words) w = ids_words;
  return w < 1 ? 1 : (w > 32 ? 32 : w);
}

int64_t min_words(const Dims& d) { return max_words(d) < 2 ? max_words(d) : 2; }

// Bitmask words per expert for T tokens: ~128 tiles, at least 64 tokens per tile (32 when the
// shared-memory bound allows one word only).
int words_for(const Dims& d, int64_t t) {
  int64_t w = ceil_div(t, 128 * 32);
  if (w < min_words(d)) w = min_words(d);
  const int64_t wmax = max_words(d);
  return (int)(w > wmax ? wmax : w);
}

int64_t tiles_for(const Dims& d, int64_t t) { return ceil_div(t, 32 * (int64_t)words_for(d, t)); }

// Upper bound of tiles_for(d, t) over 0 <= t <= t_max.
int64_t tiles_bound(const Dims& d, int64_t t_max) {
  int64_t b = ceil_div(t_max, 32 * max_words(d));
  if (b < 128) b = 128;
  const int64_t cap = ceil_div(t_max, 32 * min_words(d));
  if (b > cap) b = cap;
  return b < 1 ? 1 : b;
}

// Raises a kernel's dynamic shared-memory limit before each launch that needs more than 48 KB.
// NOTE: the attribute belongs to the kernel in the current context, so a cache keyed by
// device would skip it in a second context or after a device reset; it is a host call (no
// stream work, legal during graph capture, and every grouped GEMM run makes the same call for
// its kernel), so it is simply made every time.
capmoe_status_t ensure_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return CAPMOE_OK;
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

capmoe_status_t launch(const capmoe_echo_config_t* cfg, const int64_t* counts, int form,
                       const uint8_t* map, const float* probs, const int32_t* ids,
                       int64_t num_tokens, const int32_t* num_tokens_device, int64_t* state,
                       int32_t* workspace, int64_t workspace_len, uint8_t* out_map,
                       float* out_probs, int32_t* out_dest, float* out_probs_k,
                       int64_t block_capacity, void* stream) {
  Dims d;
  CAPMOE_TRY(make_dims(cfg, &d));
  if (block_capacity < -1 || block_capacity > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (!counts || !state) return CAPMOE_ERR_INVALID_ARGUMENT;
  // Natural alignment of every array (a misaligned access faults and loses the context); the
  // state's int32 sections are read and written as int4 / int2, so it needs 16 bytes.
  CAPMOE_TRY(check_aligned(16, {state}));
  CAPMOE_TRY(check_aligned(8, {counts}));
  CAPMOE_TRY(check_aligned(4, {num_tokens_device, probs, ids, workspace, out_probs, out_dest, out_probs_k}));
  if (num_tokens < 0 || num_tokens > (int64_t(1) << 31) - 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  Params p{};
  p.block_capacity = (int)block_capacity;
  p.counts = counts;
  p.state = state;
  make_layout(d, &p.lay);
  p.d = d;
  p.form = form;
  p.num_tokens = form == kFormNone ? 0 : num_tokens;
  p.tokens_device = form == kFormNone ? nullptr : num_tokens_device;
  p.words = words_for(d, p.num_tokens);
  p.num_tiles = (int)tiles_for(d, p.num_tokens);
  if (p.num_tokens > 0) {
    if (!probs || !workspace) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (form == kFormDense && (!map || !out_map || !out_probs)) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (form == kFormTopk && (!ids || !out_dest)) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (workspace_len < (int64_t)p.num_tiles * d.ne) return CAPMOE_ERR_WORKSPACE_TOO_SMALL;
    p.map = map;
    p.ids = ids;
    p.probs_bits = reinterpret_cast<const uint32_t*>(probs);
    p.tile_counts = workspace;
    p.out_map = out_map;
    p.out_probs_bits = reinterpret_cast<uint32_t*>(out_probs);
    p.out_dest = out_dest;
    p.out_probs_k_bits = reinterpret_cast<uint32_t*>(out_probs_k);
  } else {
    p.num_tiles = 0;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Stage C and F in shared memory when they fit (C first: it is read most).
  const bool approx = d.algorithm == CAPMOE_ECHO_APPROX;
  auto plan_bytes = [&](bool stage_c, bool stage_f) -> size_t {
    return plan_smem_offsets(d.ne, d.ep, d.s, approx, stage_c, stage_f, p.block_capacity >= 0).bytes;
  };
  p.stage_c = true;
  p.stage_f = true;
  if (plan_bytes(true, true) > kSmemBudget) p.stage_f = false;
  if (plan_bytes(true, p.stage_f) > kSmemBudget) p.stage_c = false;
  if (!p.stage_c && plan_bytes(false, true) <= kSmemBudget) p.stage_f = true;
  p.plan_smem = plan_smem_offsets(d.ne, d.ep, d.s, approx, p.stage_c, p.stage_f, p.block_capacity >= 0);
  size_t plan_smem = p.plan_smem.bytes;
  const size_t count_smem = sizeof(int32_t) * (size_t)d.ne + 16;
  if (count_smem > plan_smem) plan_smem = count_smem;
  if (plan_smem > kSmemBudget) return CAPMOE_ERR_INVALID_ARGUMENT;
  // The reroute's shared memory is settled before anything is enqueued, so a launch that
  // cannot run leaves nothing half-done on the stream (or in a graph being captured).
  size_t rr_smem = 0;
  if (p.num_tiles > 0) {
    const size_t tile_probs = sizeof(uint32_t) * 32 * (size_t)p.words * d.ne;
    p.stage_probs = form == kFormDense && (d.ne & 3) == 0 &&
                    (reinterpret_cast<uintptr_t>(probs) & 15) == 0 && tile_probs <= kProbStageBudget;
    RerouteSmem rs;
    rr_smem = rs.carve(nullptr, d.ne, d.s, p.words, form, d.topk, p.stage_probs);
    if (rr_smem > kSmemBudget) return CAPMOE_ERR_INVALID_ARGUMENT;  // not reached: max_words bounds it
    CAPMOE_TRY(ensure_smem(reinterpret_cast<const void*>(reroute_kernel), rr_smem));
  }
  CAPMOE_TRY(ensure_smem(reinterpret_cast<const void*>(plan_kernel), plan_smem));
  CAPMOE_TRY(capmoe::launch(plan_kernel, dim3(unsigned(1 + p.num_tiles)), kPlanThreads, plan_smem, s, p));
  // The reroute waits for the plan (griddepcontrol.wait) before it reads what the plan writes.
  if (p.num_tiles > 0) {
    CAPMOE_TRY(
        launch_programmatic(true, reroute_kernel, dim3(unsigned(p.num_tiles)), kRerouteThreads, rr_smem, s, p));
  }
  return CAPMOE_OK;
}

}  // namespace
}  // namespace echo
}  // namespace capmoe

using namespace capmoe::echo;

extern "C" capmoe_status_t capmoe_echo_layout(const capmoe_echo_config_t* cfg, int64_t t_max,
                                              capmoe_echo_layout_t* layout,
                                              int64_t* workspace_len) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    Dims d;
    CAPMOE_TRY(make_dims(cfg, &d));
    if (!layout || t_max < 0 || t_max > (int64_t(1) << 31) - 1) return CAPMOE_ERR_INVALID_ARGUMENT;
    make_layout(d, layout);
    if (workspace_len) *workspace_len = t_max == 0 ? 0 : tiles_bound(d, t_max) * d.ne;
    return CAPMOE_OK;
  });
}

extern "C" capmoe_status_t capmoe_echo_plan(const capmoe_echo_config_t* cfg,
                                            const int64_t* counts, int64_t* state,
                                            void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    return launch(cfg, counts, kFormNone, nullptr, nullptr, nullptr, 0, nullptr, state, nullptr,
                  0, nullptr, nullptr, nullptr, nullptr, -1, stream);
  });
}

extern "C" capmoe_status_t capmoe_echo_plan_reroute_dense(
    const capmoe_echo_config_t* cfg, const int64_t* counts, const uint8_t* routing_map,
    const float* probs, int64_t num_tokens, const int32_t* num_tokens_device, int64_t* state,
    int32_t* workspace, int64_t workspace_len, uint8_t* out_map, float* out_probs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    return launch(cfg, counts, kFormDense, routing_map, probs, nullptr, num_tokens,
                  num_tokens_device, state, workspace, workspace_len, out_map, out_probs, nullptr,
                  nullptr, -1, stream);
  });
}

extern "C" capmoe_status_t capmoe_echo_plan_reroute_topk(
    const capmoe_echo_config_t* cfg, const int64_t* counts, const int32_t* expert_ids,
    const float* probs, int64_t num_tokens, const int32_t* num_tokens_device, int64_t* state,
    int32_t* workspace, int64_t workspace_len, int32_t* out_dest, float* out_probs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    return launch(cfg, counts, kFormTopk, nullptr, probs, expert_ids, num_tokens,
                  num_tokens_device, state, workspace, workspace_len, nullptr, nullptr, out_dest,
                  out_probs, -1, stream);
  });
}

extern "C" capmoe_status_t capmoe_echo_plan_reroute_topk_capped(
    const capmoe_echo_config_t* cfg, int64_t block_capacity, const int64_t* counts,
    const int32_t* expert_ids, const float* probs, int64_t num_tokens,
    const int32_t* num_tokens_device, int64_t* state, int32_t* workspace, int64_t workspace_len,
    int32_t* out_dest, float* out_probs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (block_capacity < 0) return CAPMOE_ERR_INVALID_ARGUMENT;
    return launch(cfg, counts, kFormTopk, nullptr, probs, expert_ids, num_tokens,
                  num_tokens_device, state, workspace, workspace_len, nullptr, nullptr, out_dest,
                  out_probs, block_capacity, stream);
  });
}
