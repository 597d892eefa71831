// capmoe-archs: 90a 100a
//
// Echo offloading planner (spec echo-planner.md, P1-P7) and the reroute of this rank's tokens
// (P8-P9), as two capturable launches:
//
//   1. plan_kernel<<<1 + num_tiles, 1024>>>: block 0 runs P1-P7 for the whole [EP, E] count
//      matrix in shared memory (one block: E, S <= 1024) and writes every stage into `state`;
//      blocks 1.. count this rank's routes per expert for one token tile each (`tile_counts`).
//   2. reroute_kernel<<<num_tiles, 512>>>: each block takes one tile of 32*W tokens, builds a
//      per-expert bitmask of its routed tokens, gets the rank of every routed token within its
//      expert's (ascending) token list from the tile prefix + popcounts, and writes the outputs
//      in gather form: each output element is computed independently from the plan, so there
//      are no write races and the result is deterministic.
//
// Layout contract (all row-major, contiguous; see capturable_moe/echo.h):
//   counts [EP, E] int64; state [layout.state_len] int64; tile_counts [num_tiles, E] int32;
//   routing_map [T, E] uint8 + probs [T, E] f32 -> out_map / out_probs [T, E+S] (interleaved
//   columns, spec P9); or expert_ids [T, k] int32 + probs [T, k] -> out_dest [T, k] int32.
//
// NOTE: the float32 stages (P3 reclaim, P5 first pass) use __fadd_rn/__fmul_rn/__fdiv_rn so the
// compiler can neither contract them into FMAs nor use approximate division: the spec's
// results depend on the exact float32 rounding (golden case s12).
#include <cuda_runtime.h>
#include <stdint.h>

#include "capturable_moe/echo.h"
#include "common/boundary.cuh"

namespace capmoe {
namespace echo {
namespace {

constexpr int kPlanThreads = 1024;
constexpr int kRerouteThreads = 512;
constexpr int64_t kMaxExperts = 1024;
constexpr int64_t kMaxSpare = 1024;
// Words of the per-tile bitmask per expert: E * W <= kMaskBudget keeps shared memory <= ~120 KB.
constexpr int64_t kMaskBudget = 12288;
constexpr unsigned kFull = 0xffffffffu;
// Shared memory of the planner block with C, F and D staged (H100/B200 allow 227 KB).
constexpr size_t kStageSmemBudget = 200 * 1024;

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
  const uint8_t* map;
  const uint32_t* probs_bits;  // probs as raw bits: copied, never computed
  const int32_t* ids;
  int64_t num_tokens;
  int words;  // W: bitmask words per expert per tile; a tile is 32 * W tokens
  int num_tiles;
  int32_t* tile_counts;
  uint8_t* out_map;
  uint32_t* out_probs_bits;
  int32_t* out_dest;
  uint32_t* out_probs_k_bits;
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Shared-memory layout of the planner block. With `stage` (the host checks it fits), C is kept
// in shared memory as int32 (valid counts are < 2^24) and F, D are staged there as int32 so the
// [EP, S] / [EP, E] state matrices are written coalesced at the end; otherwise C is read from
// global memory and F, D go straight to the state.
struct PlanSmem {
  int64_t *n, *spill, *sps, *ce, *load, *cap, *be, *hval, *rm, *red, *total, *outq, *inq, *filled;
  int32_t *ps, *pc, *hexp, *se, *first, *next, *c32, *f32, *d32;
  float* head;
  uint16_t* queue;  // [8][E + EP]
  int32_t* flags;   // [0] error bits, [1] keep_all

  __host__ __device__ static size_t bytes(int ne, int ep, int s, bool stage) {
    size_t b = 0;
    b += sizeof(int64_t) * (4 * (size_t)ne + 5 * (size_t)ep + 3 * (size_t)s + 1 + kPlanThreads);
    b += sizeof(int32_t) * (2 * (size_t)ne + (size_t)ep + 3 * (size_t)s + 2);
    if (stage) b += sizeof(int32_t) * ((size_t)ep * ne + 2 * (size_t)ep * s);
    b += sizeof(float) * (size_t)ep;
    b += sizeof(uint16_t) * 8 * ((size_t)ne + (size_t)ep);
    return b + 32;
  }

  __device__ void carve(unsigned char* base, int ne, int ep, int s, bool stage) {
    int64_t* p64 = reinterpret_cast<int64_t*>(base);
    n = p64; p64 += ne;
    spill = p64; p64 += ne;
    sps = p64; p64 += ne;
    ce = p64; p64 += ne;
    load = p64; p64 += ep;
    cap = p64; p64 += ep;
    be = p64; p64 += ep;
    outq = p64; p64 += ep;
    inq = p64; p64 += ep;
    hval = p64; p64 += s;
    rm = p64; p64 += s;
    filled = p64; p64 += s;
    total = p64; p64 += 1;
    red = p64; p64 += kPlanThreads;
    int32_t* p32 = reinterpret_cast<int32_t*>(p64);
    ps = p32; p32 += ne;
    first = p32; p32 += ne;
    pc = p32; p32 += ep;
    hexp = p32; p32 += s;
    se = p32; p32 += s;
    next = p32; p32 += s;
    flags = p32; p32 += 2;
    if (stage) {
      c32 = p32; p32 += (size_t)ep * ne;
      f32 = p32; p32 += (size_t)ep * s;
      d32 = p32; p32 += (size_t)ep * s;
    } else {
      c32 = f32 = d32 = nullptr;
    }
    head = reinterpret_cast<float*>(p32);
    queue = reinterpret_cast<uint16_t*>(head + ep);
  }
};

#ifdef CAPMOE_ECHO_PROF
}  // namespace
__device__ long long g_echo_prof[32];
namespace {
#define ECHO_PROF(i) \
  do { if (threadIdx.x == 0) g_echo_prof[i] = clock64(); } while (0)
#else
#define ECHO_PROF(i) do { } while (0)
#endif

// A.3 without a 64-bit division: for 0 < v < m and iv > 0,
// min(7, (m - v) / iv + 1) == 1 + #{k in 1..6 : k * iv <= m - v}.
__device__ inline int approx_bucket(int64_t v, int64_t m, int64_t iv) {
  if (v >= m || iv == 0) return 0;
  const int64_t a = m - v;
  int b = 1;
#pragma unroll
  for (int k = 1; k <= 6; ++k) b += a >= k * iv ? 1 : 0;
  return b;
}

// Overlap of chunk position a with bucket [bs, bend).
__device__ inline int64_t overlap(const PlanSmem& sm, int a, int64_t bs, int64_t bend) {
  int64_t ce = sm.ce[a], cs = ce - sm.sps[a];
  int64_t v = min(ce, bend) - max(cs, bs);
  return v > 0 ? v : 0;
}

// Smallest index in [lo, hi) with sps[idx] <= v (strict = false) or < v (strict = true);
// sps is non-increasing.
__device__ inline int first_below(const int64_t* sps, int lo, int hi, int64_t v, bool strict) {
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    bool below = strict ? sps[mid] < v : sps[mid] <= v;
    if (below) hi = mid; else lo = mid + 1;
  }
  return lo;
}

__device__ inline int64_t warp_sum64(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// One warp: out[i] = in(0) + ... + in(i) for i < n (chunks of 32 with a carry).
template <class In>
__device__ void warp_scan_store(In in, int64_t* out, int n) {
  const int lane = threadIdx.x & 31;
  int64_t carry = 0;
  for (int b = 0; b < n; b += 32) {
    int64_t v = b + lane < n ? in(b + lane) : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int64_t y = __shfl_up_sync(kFull, v, o);
      if (lane >= o) v += y;
    }
    if (b + lane < n) out[b + lane] = carry + v;
    carry += __shfl_sync(kFull, v, 31);
  }
}

// Position of every item in (key desc) order, keys unique: G = 2^g threads per item count the
// larger keys over a strided share of the items, reduced with shuffles. Every thread of the
// block must call it (uniform loop bounds, full-warp shuffles).
template <class Key, class Put>
__device__ void rank_desc(int count, Key key, Put put) {
  const int nt = blockDim.x;
  int G = 1;
  while (G < 32 && G * 2 * count <= nt) G *= 2;
  for (int base = 0; base < count * G; base += nt) {
    const int i = base + (int)threadIdx.x;
    const bool valid = i < count * G;
    const int x = i / G, g = i & (G - 1);
    int cnt = 0;
    if (valid) {
      const uint64_t mine = key(x);
#pragma unroll 4
      for (int y = g; y < count; y += G) cnt += key(y) > mine ? 1 : 0;
    }
    for (int o = 1; o < G; o <<= 1) cnt += __shfl_xor_sync(kFull, cnt, o);
    if (valid && g == 0) put(x, cnt);
  }
}

// P1-P7, one block of kPlanThreads threads.
template <bool kStage>
__device__ void plan_block(const Params& p, unsigned char* smem_raw) {
  const Dims d = p.d;
  const int ne = d.ne, ep = d.ep, sp = d.sp, L = d.l, S = d.s;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nt >> 5;
  const int64_t* C = p.counts;
  int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  PlanSmem sm;
  sm.carve(smem_raw, ne, ep, S, kStage);
  ECHO_PROF(0);

  // P1.1 n[e], with the count checks: G = nt / E threads per expert split the source ranks
  // (more loads in flight), partial sums combined in a fixed order. The staged copy of C is
  // written on the way.
  if (tid == 0) {
    sm.flags[0] = 0;
    sm.flags[1] = 0;
    sm.total[0] = 0;
  }
  bool negative = false;
  const int groups = ne <= nt ? nt / ne : 1;
  for (int i = tid; i < ne * groups; i += nt) {
    const int x = i % ne, g = i / ne;
    int64_t acc = 0;
#pragma unroll 8
    for (int r = g; r < ep; r += groups) {
      const int64_t c = C[(int64_t)r * ne + x];
      negative |= c < 0;
      acc += c;
      if (kStage) sm.c32[r * ne + x] = (int32_t)c;
    }
    sm.red[i] = acc;
  }
  const bool neg_any = __syncthreads_or(negative);
  bool large = false;
  int64_t tsum = 0;
  for (int x = tid; x < ne; x += nt) {
    int64_t acc = 0;
    for (int g = 0; g < groups; ++g) acc += sm.red[g * ne + x];
    sm.n[x] = acc;
    st[lay.off_tokens_per_expert + x] = acc;
    large |= acc >= (int64_t(1) << 24);
    tsum += acc;
  }
  tsum = warp_sum64(tsum);
  if (lane == 0 && tsum != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(sm.total), (unsigned long long)tsum);
  const bool large_any = __syncthreads_or(large);
  const bool counts_ok = !neg_any && !large_any;
  if (tid == 0)
    sm.flags[0] = (neg_any ? CAPMOE_ECHO_ERR_NEGATIVE_COUNT : 0) |
                  (large_any ? CAPMOE_ECHO_ERR_COUNT_TOO_LARGE : 0);
  const int64_t avg = sm.total[0] / ep;
  ECHO_PROF(1);

  // P1.2 load, P1.4 cap, P1.5 spill: the running sum before e in its rank's (n asc, e asc) order.
  for (int q = tid; q < ep; q += nt) {
    int64_t l = 0;
    for (int i = 0; i < L; ++i) l += sm.n[q * L + i];
    sm.load[q] = l;
    const int64_t c = avg - l;
    const int64_t cq = counts_ok && c > 0 ? c : 0;
    sm.cap[q] = cq;
    sm.be[q] = ((uint64_t)cq << 10) | (uint64_t)(1023 - q);  // bucket-order key (ranking only)
    sm.outq[q] = 0;
    sm.inq[q] = 0;
    st[lay.off_load_per_rank + q] = l;
    st[lay.off_spare_capacity + q] = cq;
  }
  for (int x = tid; x < ne; x += nt) {
    const int q0 = (x / L) * L;
    const int64_t nx = sm.n[x];
    int64_t before = 0;
    for (int i = q0; i < q0 + L; ++i) {
      int64_t ni = sm.n[i];
      if (ni < nx || (ni == nx && i < x)) before += ni;
    }
    int64_t a = before - avg, b = before + nx - avg;
    const int64_t sx = counts_ok ? (b > 0 ? b : 0) - (a > 0 ? a : 0) : 0;
    sm.spill[x] = sx;
    sm.ce[x] = ((uint64_t)sx << 10) | (uint64_t)(1023 - x);  // chunk-order key (ranking only)
    st[lay.off_spill + x] = sx;
    sm.first[x] = 0x7fffffff;
  }
  for (int j = tid; j < S; j += nt) {
    sm.hexp[j] = -1;
    sm.hval[j] = 0;
    sm.filled[j] = 0;
    sm.next[j] = -1;
  }
  __syncthreads();
  ECHO_PROF(2);

  // G.1 / G.2 / A.1: chunk order (spill desc, e asc), bucket order (cap desc, q asc), as the
  // count of larger packed keys (spill < 2^24 and cap < 2^44 when the counts are valid).
  rank_desc(
      ne, [&](int x) { return (uint64_t)sm.ce[x]; },
      [&](int x, int pos) {
        sm.ps[pos] = x;
        sm.sps[pos] = sm.spill[x];
      });
  rank_desc(
      ep, [&](int q) { return (uint64_t)sm.be[q]; },
      [&](int q, int pos) { sm.pc[pos] = q; });
  __syncthreads();
  ECHO_PROF(3);

  if (d.algorithm == CAPMOE_ECHO_GREEDY) {
    // G.3: chunk and bucket intervals as prefix sums, one warp each.
    if (warp == 0) warp_scan_store([&](int a) { return sm.sps[a]; }, sm.ce, ne);
    if (warp == 1 % nwarps) warp_scan_store([&](int b) { return sm.cap[sm.pc[b]]; }, sm.be, ep);
    __syncthreads();
    // G.4 / G.5: per bucket, the chunks with a positive overlap form a contiguous run
    // [lo, hi]; interior overlaps are whole chunks (non-increasing), so each chunk's rank in
    // (ov desc, position asc) order follows from two comparisons and a binary search.
    for (int b = tid; b < ep; b += nt) {
      const int q = sm.pc[b];
      const int64_t c = sm.cap[q];
      if (c <= 0) continue;
      const int64_t bend = sm.be[b], bs = bend - c;
      // lo: first chunk ending after bs; hi: last chunk starting before bend.
      int lo = 0, hi = ne;
      while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (sm.ce[mid] > bs) hi = mid; else lo = mid + 1;
      }
      const int a_lo = lo;
      lo = a_lo;
      hi = ne;
      while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (sm.ce[mid] - sm.sps[mid] < bend) lo = mid + 1; else hi = mid;
      }
      const int a_hi = lo - 1;
      if (a_lo >= ne || a_hi < a_lo) continue;
      const int64_t ov_lo = overlap(sm, a_lo, bs, bend);
      const int64_t ov_hi = overlap(sm, a_hi, bs, bend);
      for (int a = a_lo; a <= a_hi; ++a) {
        const int64_t v = a == a_lo ? ov_lo : a == a_hi ? ov_hi : sm.sps[a];
        if (v <= 0) continue;
        int rank = 0;
        if (a != a_lo && (ov_lo > v || (ov_lo == v && a_lo < a))) ++rank;
        if (a_hi != a_lo && a != a_hi && (ov_hi > v || (ov_hi == v && a_hi < a))) ++rank;
        const int i_lo = a_lo + 1, i_hi = a_hi;  // interior [i_lo, i_hi)
        if (i_hi > i_lo) {
          if (a > a_lo && a < a_hi) {
            rank += a - i_lo;
          } else if (a == a_lo) {
            rank += first_below(sm.sps, i_lo, i_hi, v, false) - i_lo;
          } else {
            rank += first_below(sm.sps, i_lo, i_hi, v, true) - i_lo;
          }
        }
        if (rank < sp) {
          const int j = q * sp + rank;
          sm.hexp[j] = sm.ps[a];
          sm.hval[j] = v;
        }
      }
    }
  } else if (warp == 0) {
    // A.2-A.5 in one warp: lane k < 8 keeps FIFO k's head and tail in registers, the ranks'
    // capacities (in order) are prefetched 32 at a time, buckets need no division.
    const int64_t m = avg, iv = avg / 7;
    const int qcap = ne + ep;
    int64_t* rest = sm.ce;  // approx does not use chunk intervals; indexed by position
    int cnt[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) cnt[k] = 0;
    for (int base = 0; base < ne; base += 32) {
      const int a = base + lane;
      const int64_t v = a < ne ? sm.sps[a] : 0;
      const int k = v > 0 ? approx_bucket(v, m, iv) : -1;
      if (a < ne) rest[a] = v;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        unsigned ballot = __ballot_sync(kFull, k == kk);
        if (k == kk) sm.queue[kk * qcap + cnt[kk] + __popc(ballot & ((1u << lane) - 1u))] = (uint16_t)a;
        cnt[kk] += __popc(ballot);
      }
    }
    int qh = 0, qt = 0;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) if (kk == lane) qt = cnt[kk];
    // bucket(v) for 0 < v < m, iv > 0: 1 + #{k in 1..6 : k * iv <= m - v} (== min(7, (m-v)/iv + 1)).
    auto bucket = [&](int64_t v) -> int {
      if (v >= m || iv == 0) return 0;
      const int64_t a = m - v;
      int b = 1;
#pragma unroll
      for (int k = 1; k <= 6; ++k) b += a >= k * iv ? 1 : 0;
      return b;
    };
    __syncwarp();
    int cur = 0;
    bool stop = false;
    for (int b0 = 0; b0 < ep && !stop; b0 += 32) {
      const int bl = b0 + lane;
      const int ql = bl < ep ? sm.pc[bl] : 0;
      const int64_t cpl = bl < ep ? sm.cap[ql] : 0;
      const int nb = min(32, ep - b0);
      for (int u = 0; u < nb; ++u) {
        const int64_t cp = __shfl_sync(kFull, cpl, u);
        const int q = __shfl_sync(kFull, ql, u);
        if (cp <= 0) { stop = true; break; }
        const unsigned avail = __ballot_sync(kFull, lane < 8 && lane >= cur && qh < qt);
        if (avail == 0) { stop = true; break; }
        const int k = __ffs(avail) - 1;
        cur = k;
        const int h = __shfl_sync(kFull, qh, k);
        if (lane == k) ++qh;
        const int a = sm.queue[k * qcap + h];
        const int64_t rv = rest[a];
        const int64_t x = min(rv, cp);
        const int64_t left = rv - x;
        __syncwarp();
        if (lane == 0) {
          rest[a] = left;
          sm.hexp[q] = sm.ps[a];  // S_per == 1: slot index == rank index
          sm.hval[q] = x;
        }
        if (left > 0) {
          const int k2 = bucket(left);
          const int t = __shfl_sync(kFull, qt, k2);
          if (t < qcap) {
            if (lane == 0) sm.queue[k2 * qcap + t] = (uint16_t)a;
            if (lane == k2) ++qt;
          } else if (lane == 0) {
            sm.flags[0] |= CAPMOE_ECHO_ERR_INTERNAL;
          }
        }
        __syncwarp();
      }
    }
  }
  __syncthreads();
  ECHO_PROF(4);

  // H before reclaim.
  for (int j = tid; j < S; j += nt) {
    const bool on = sm.hval[j] > 0;
    st[lay.off_pre_reclaim_expert + j] = on ? sm.hexp[j] : -1;
    st[lay.off_pre_reclaim_tokens + j] = on ? sm.hval[j] : 0;
  }

  // P3 reclaim (greedy, thr > 0).
  if (d.algorithm == CAPMOE_ECHO_GREEDY && d.thr > 0.0f) {
    const float avgf = __ll2float_rn(avg);
    const float maxload = __fadd_rn(avgf, __fmul_rn(d.thr, avgf));
    for (int q = tid; q < ep; q += nt) {
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
    __syncthreads();
  }

  // P4 slot_expert; each expert's lowest slot; planned tokens out of / into every rank.
  for (int j = tid; j < S; j += nt) {
    const int e = sm.hval[j] > 0 ? sm.hexp[j] : -1;
    sm.se[j] = e;
    if (e < 0) {
      sm.hval[j] = 0;
    } else {
      atomicMin(&sm.first[e], j);
      atomicAdd(reinterpret_cast<unsigned long long*>(&sm.outq[e / L]), (unsigned long long)sm.hval[j]);
      atomicAdd(reinterpret_cast<unsigned long long*>(&sm.inq[j / sp]), (unsigned long long)sm.hval[j]);
    }
  }
  __syncthreads();
  ECHO_PROF(5);

  for (int j = tid; j < S; j += nt) {
    st[lay.off_slot_expert + j] = sm.se[j];
    st[lay.off_slot_tokens + j] = sm.hval[j];
  }
  for (int x = tid; x < ne; x += nt) {
    const int f = sm.first[x];
    st[lay.off_first_slot + x] = f < S ? f : -1;
  }
  {
    // Offload map M[e][j] as bytes, written 8 at a time.
    uint64_t* mwords = reinterpret_cast<uint64_t*>(st + lay.off_offload_map);
    const int nbytes = ne * S, nwords = (nbytes + 7) / 8;
    for (int w = tid; w < nwords; w += nt) {
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

  // P5-P7 fused, one warp per supplying expert (found at its lowest slot). Float32 stages use
  // __fdiv_rn/__fmul_rn exactly as the spec. Values per (r, e) are < 2^24, so the warp sums
  // of F + D fit in 32 bits.
  int64_t* Fg = st + lay.off_first_pass;
  int64_t* Dg = st + lay.off_second_pass;
  int64_t* Ftg = st + lay.off_tokens_to_slot;
  auto getC = [&](int r, int e) -> int64_t {
    if (kStage) return sm.c32[r * ne + e];
    return __ldg(&C[(int64_t)r * ne + e]);
  };
  for (int j0 = warp; j0 < S; j0 += nwarps) {
    const int e = sm.se[j0];
    if (e < 0 || sm.first[e] != j0) continue;
    // The expert's slots in ascending order, as a list in next[].
    {
      int prev = -1;
      for (int b = j0 & ~31; b < S; b += 32) {
        unsigned m = __ballot_sync(kFull, b + lane < S && sm.se[b + lane] == e);
        while (m) {
          const int i = b + __ffs(m) - 1;
          m &= m - 1;
          if (prev >= 0 && lane == 0) sm.next[prev] = i;
          prev = i;
        }
      }
      __syncwarp();
    }
    const float den = __ll2float_rn(sm.n[e]);
    // P5: F and Rm.
    for (int j = j0; j >= 0; j = sm.next[j]) {
      const float cj = __ll2float_rn(sm.hval[j]);
      unsigned acc = 0;
      for (int r = lane; r < ep; r += 32) {
        const float share = __fdiv_rn(__ll2float_rn(getC(r, e)), den);
        const int64_t f = (int64_t)floorf(__fmul_rn(share, cj));
        if (kStage) sm.f32[r * S + j] = (int32_t)f;
        else Fg[(int64_t)r * S + j] = f;
        acc += (unsigned)f;
      }
      acc = __reduce_add_sync(kFull, acc);
      const int64_t rmj = sm.hval[j] - (int64_t)acc;
      if (lane == 0) {
        sm.rm[j] = rmj;
        st[lay.off_remaining_capacity + j] = rmj;
        if (rmj < 0) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
      }
    }
    __syncwarp();
    // P6 / P7: source line (C1 by rank, warp scan) against the slot line (Rm in slot order).
    int carry = 0;
    int64_t off = 0;
    for (int r0 = 0; r0 < ep; r0 += 32) {
      const int r = r0 + lane;
      const bool valid = r < ep;
      int c1 = 0;
      if (valid) {
        int fs = 0;
        for (int j = j0; j >= 0; j = sm.next[j])
          fs += kStage ? sm.f32[r * S + j] : (int)Fg[(int64_t)r * S + j];
        c1 = (int)getC(r, e) - fs;
      }
      int incl = c1;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += y;
      }
      const int64_t a = (int64_t)carry + incl - c1;
      carry += __shfl_sync(kFull, incl, 31);
      int64_t bj = 0;
      for (int j = j0; j >= 0; j = sm.next[j]) {
        const int64_t rmj = sm.rm[j];
        int ft = 0;
        if (valid) {
          const int64_t dv = max(int64_t(0), min(a + c1, bj + rmj) - max(a, bj));
          const int f = kStage ? sm.f32[r * S + j] : (int)Fg[(int64_t)r * S + j];
          ft = f + (int)dv;
          if (kStage) {
            sm.d32[r * S + j] = (int32_t)dv;
          } else {
            Dg[(int64_t)r * S + j] = dv;
            Ftg[(int64_t)r * S + j] = ft;
          }
        }
        const unsigned tot = __reduce_add_sync(kFull, (unsigned)ft);
        if (d.rho >= r0 && d.rho < r0 + 32) {
          const int ft_rho = __shfl_sync(kFull, ft, d.rho - r0);
          if (lane == 0) st[lay.off_slot_offset + j] = off;
          off += ft_rho;
        }
        if (lane == 0) sm.filled[j] += tot;
        bj += rmj;
      }
    }
    __syncwarp();
    if (lane == 0)
      for (int j = j0; j >= 0; j = sm.next[j])
        if (sm.filled[j] != sm.hval[j]) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
  }
  __syncthreads();
  ECHO_PROF(6);

  // Dense [EP, S] and [EP, E] sections, coalesced; zeros for empty slots and experts without
  // slots.
  {
    const int sr = nt / S, sc = nt % S;
    for (int r = tid / S, j = tid % S; r < ep;) {
      const int64_t i = (int64_t)r * S + j;
      if (sm.se[j] < 0) {
        Fg[i] = 0;
        Dg[i] = 0;
        Ftg[i] = 0;
      } else if (kStage) {
        const int f = sm.f32[r * S + j], dv = sm.d32[r * S + j];
        Fg[i] = f;
        Dg[i] = dv;
        Ftg[i] = f + dv;
      }
      j += sc;
      r += sr;
      if (j >= S) {
        j -= S;
        ++r;
      }
    }
  }
  {
    int64_t* fpho = st + lay.off_first_pass_home_offload;
    int64_t* ho = st + lay.off_home_offload;
    const int sr = nt / ne, sc = nt % ne;
    for (int r = tid / ne, x = tid % ne; r < ep;) {
      const int64_t i = (int64_t)r * ne + x;
      int64_t fs = 0, ds = 0;
      for (int j = sm.first[x]; j >= 0 && j < S; j = sm.next[j]) {
        if (kStage) {
          fs += sm.f32[r * S + j];
          ds += sm.d32[r * S + j];
        } else {
          fs += Fg[(int64_t)r * S + j];
          ds += Dg[(int64_t)r * S + j];
        }
      }
      fpho[i] = fs;
      ho[i] = fs + ds;
      x += sc;
      r += sr;
      if (x >= ne) {
        x -= ne;
        ++r;
      }
    }
  }
  for (int j = tid; j < S; j += nt) {
    st[lay.off_next_slot + j] = sm.next[j];
    if (sm.se[j] < 0) {
      st[lay.off_slot_offset + j] = 0;
      st[lay.off_remaining_capacity + j] = 0;
    }
  }
  for (int q = tid; q < ep; q += nt) st[lay.off_load_after + q] = sm.load[q] - sm.outq[q] + sm.inq[q];
  if (tid == 0) {
    st[lay.off_avg] = avg;
    st[lay.off_error] = sm.flags[0];
  }
  ECHO_PROF(7);
}

// Routes per expert of one token tile (blocks 1.. of the plan launch).
__device__ void count_tile(const Params& p, int tile, int32_t* s_cnt) {
  const int ne = p.d.ne, tid = threadIdx.x, nt = blockDim.x;
  const int64_t tile_tokens = 32 * (int64_t)p.words;
  const int64_t t0 = tile * tile_tokens;
  const int64_t rows = min(tile_tokens, p.num_tokens - t0);
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

template <bool kStage>
__global__ void __launch_bounds__(kPlanThreads, 1) plan_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  if (blockIdx.x == 0) {
    plan_block<kStage>(p, smem);
  } else {
    count_tile(p, blockIdx.x - 1, reinterpret_cast<int32_t*>(smem));
  }
}

// ---------------------------------------------------------------------------------------------
// Reroute: one block per token tile.
struct RerouteSmem {
  uint32_t* mask;   // [E][W]
  int32_t* wbase;   // [E][W]: rank of the first token of word w in the expert's token list
  int64_t* soff;    // [S]
  int64_t* send;    // [S]  soff + Ftot[rho][j]
  int64_t* moved;   // [E]  home_offload[rho][e]
  int32_t* se;      // [S]
  int32_t* next;    // [S]
  int32_t* first;   // [E]
  int32_t* flags;   // [1]
  int32_t* part;    // [kPartLen] partial tile prefixes (>= groups * E in both prefix paths)
  int32_t* colx;    // [E + S] dense form: home expert of final column c, or -(slot + 1)

  static constexpr int kPartLen = 4 * kRerouteThreads > kMaxExperts ? 4 * kRerouteThreads : kMaxExperts;
  __host__ __device__ static size_t bytes(int ne, int s, int words) {
    return sizeof(int64_t) * (2 * (size_t)s + ne) + sizeof(int32_t) * (kPartLen + (size_t)ne + s) +
           sizeof(uint32_t) * (size_t)ne * words * 2 + sizeof(int32_t) * (2 * (size_t)s + ne + 1) + 16;
  }
  __device__ void carve(unsigned char* base, int ne, int s, int words) {
    int64_t* p64 = reinterpret_cast<int64_t*>(base);
    soff = p64; p64 += s;
    send = p64; p64 += s;
    moved = p64; p64 += ne;
    part = reinterpret_cast<int32_t*>(p64);
    colx = part + kPartLen;
    mask = reinterpret_cast<uint32_t*>(colx + ne + s);
    wbase = reinterpret_cast<int32_t*>(mask + (size_t)ne * words);
    se = wbase + (size_t)ne * words;
    next = se + s;
    first = next + s;
    flags = first + ne;
  }
};

__global__ void __launch_bounds__(kRerouteThreads) reroute_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Dims d = p.d;
  const int ne = d.ne, S = d.s, W = p.words, tid = threadIdx.x, nt = blockDim.x;
  const int tile = blockIdx.x;
  const int64_t tile_tokens = 32 * (int64_t)W;
  const int64_t t0 = tile * tile_tokens;
  const int rows = (int)min(tile_tokens, p.num_tokens - t0);
  const int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  RerouteSmem sm;
  sm.carve(smem, ne, S, W);

  if (tid == 0) sm.flags[0] = 0;
  for (int i = tid; i < ne * W; i += nt) sm.mask[i] = 0;
  for (int j = tid; j < S; j += nt) {
    const int e = (int)st[lay.off_slot_expert + j];
    sm.se[j] = e;
    sm.next[j] = (int)st[lay.off_next_slot + j];
    const int64_t off = st[lay.off_slot_offset + j];
    sm.soff[j] = off;
    sm.send[j] = off + st[lay.off_tokens_to_slot + (int64_t)d.rho * S + j];
  }
  for (int x = tid; x < ne; x += nt) {
    sm.first[x] = (int)st[lay.off_first_slot + x];
    sm.moved[x] = st[lay.off_home_offload + (int64_t)d.rho * ne + x];
  }
  if (p.form == kFormDense) {
    const int L = d.l, sp = d.sp, B = L + sp;
    for (int c = tid; c < ne + S; c += nt) {
      const int q = c / B, li = c % B;
      sm.colx[c] = li < L ? q * L + li : -(q * sp + (li - L) + 1);
    }
  }
  __syncthreads();

  // Bitmask of routed tokens per expert.
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
    const int32_t* ids = p.ids + t0 * k;
    for (int i = tid; i < rows * k; i += nt) {
      const int32_t x = ids[i];
      const int t = i / k;
      if (x >= 0 && x < ne) atomicOr(&sm.mask[x * W + (t >> 5)], 1u << (t & 31));
      else atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE);
    }
  }
  __syncthreads();

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
#pragma unroll 8
      for (int tl = g; tl < tile; tl += groups) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(p.tile_counts + (int64_t)tl * ne) + xq);
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      reinterpret_cast<int4*>(sm.part + g * ne)[xq] = acc;
    }
  } else {
    groups = ne <= nt ? nt / ne : 1;
    for (int i = tid; i < ne * groups; i += nt) {
      const int x = i % ne, g = i / ne;
      int acc = 0;
#pragma unroll 8
      for (int tl = g; tl < tile; tl += groups) acc += __ldg(&p.tile_counts[(int64_t)tl * ne + x]);
      sm.part[i] = acc;
    }
  }
  __syncthreads();
  for (int x = tid; x < ne; x += nt) {
    int64_t base = 0;
    for (int g = 0; g < groups; ++g) base += sm.part[g * ne + x];
    int64_t in_tile = 0;
    for (int w = 0; w < W; ++w) {
      sm.wbase[x * W + w] = (int32_t)(base + in_tile);
      in_tile += __popc(sm.mask[x * W + w]);
    }
    if (in_tile != p.tile_counts[(int64_t)tile * ne + x])
      atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_DUPLICATE_ROUTE);
    if (tile == p.num_tiles - 1 && base + in_tile != p.counts[(int64_t)d.rho * ne + x])
      atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_ROUTING_MISMATCH);
  }
  __syncthreads();

  const int L = d.l, sp = d.sp, B = L + sp;
  const int width = ne + S;
  if (p.form == kFormDense && (width & 3) == 0 && (reinterpret_cast<uintptr_t>(p.out_map) & 3) == 0 &&
      (reinterpret_cast<uintptr_t>(p.out_probs_bits) & 15) == 0) {
    // Four consecutive columns per thread: one 4-byte map store, one 16-byte probs store.
    const int wq = width >> 2;
    uchar4* om = reinterpret_cast<uchar4*>(p.out_map + t0 * width);
    uint4* op = reinterpret_cast<uint4*>(p.out_probs_bits + t0 * width);
    const uint32_t* pr = p.probs_bits + t0 * ne;
    const int step_t = nt / wq, step_c = nt % wq;
    for (int t = tid / wq, cq = tid % wq; t < rows;) {
      const uint32_t bit = 1u << (t & 31);
      const int tw = t >> 5;
      uint32_t mv[4], pv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int cx = sm.colx[cq * 4 + u];
        const int j = cx < 0 ? -cx - 1 : -1;
        const int x = cx < 0 ? sm.se[j] : cx;
        bool on = false;
        if (x >= 0) {
          const uint32_t word = sm.mask[x * W + tw];
          if (word & bit) {
            const int64_t pos = sm.wbase[x * W + tw] + __popc(word & (bit - 1u));
            on = j < 0 ? pos >= sm.moved[x] : (pos >= sm.soff[j] && pos < sm.send[j]);
          }
        }
        mv[u] = on ? 1u : 0u;
        pv[u] = on ? pr[(int64_t)t * ne + x] : 0u;
      }
      om[(int64_t)t * wq + cq] = make_uchar4(mv[0], mv[1], mv[2], mv[3]);
      op[(int64_t)t * wq + cq] = make_uint4(pv[0], pv[1], pv[2], pv[3]);
      cq += step_c;
      t += step_t;
      if (cq >= wq) {
        cq -= wq;
        ++t;
      }
    }
  } else if (p.form == kFormDense) {
    uint8_t* om = p.out_map + t0 * width;
    uint32_t* op = p.out_probs_bits + t0 * width;
    const uint32_t* pr = p.probs_bits + t0 * ne;
    // (t, c) advanced incrementally: no division per element.
    const int step_t = nt / width, step_c = nt % width;
    for (int t = tid / width, c = tid % width; t < rows;) {
      const int64_t i = (int64_t)t * width + c;
      const int q = c / B, li = c % B;
      int x, j = -1;
      if (li < L) {
        x = q * L + li;
      } else {
        j = q * sp + (li - L);
        x = sm.se[j];
      }
      bool on = false;
      if (x >= 0) {
        const uint32_t word = sm.mask[x * W + (t >> 5)];
        const uint32_t bit = 1u << (t & 31);
        if (word & bit) {
          const int64_t pos = sm.wbase[x * W + (t >> 5)] + __popc(word & (bit - 1u));
          on = j < 0 ? pos >= sm.moved[x] : (pos >= sm.soff[j] && pos < sm.send[j]);
        }
      }
      om[i] = on ? 1 : 0;
      op[i] = on ? pr[(int64_t)t * ne + x] : 0u;
      c += step_c;
      t += step_t;
      if (c >= width) {
        c -= width;
        ++t;
      }
    }
  } else {
    const int k = d.topk;
    const int32_t* ids = p.ids + t0 * k;
    int32_t* od = p.out_dest + t0 * k;
    for (int i = tid; i < rows * k; i += nt) {
      const int32_t x = ids[i];
      const int t = i / k;
      int32_t col = -1;
      if (x >= 0 && x < ne) {
        col = (x / L) * B + x % L;
        const uint32_t word = sm.mask[x * W + (t >> 5)];
        const uint32_t bit = 1u << (t & 31);
        const int64_t pos = sm.wbase[x * W + (t >> 5)] + __popc(word & (bit - 1u));
        if (pos < sm.moved[x]) {
          int j = sm.first[x];
          while (j >= 0 && pos >= sm.send[j]) j = sm.next[j];
          if (j >= 0 && pos >= sm.soff[j]) col = (j / sp) * B + L + j % sp;
          else atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
        }
      }
      od[i] = col;
      if (p.out_probs_k_bits) p.out_probs_k_bits[t0 * k + i] = p.probs_bits[t0 * k + i];
    }
  }
  __syncthreads();
  if (tid == 0 && sm.flags[0] != 0)
    atomicOr(reinterpret_cast<unsigned long long*>(p.state + lay.off_error),
             (unsigned long long)sm.flags[0]);
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
  L->off_first_pass = take(ep * s);
  L->off_first_pass_home_offload = take(ep * ne);
  L->off_remaining_capacity = take(s);
  L->off_second_pass = take(ep * s);
  L->off_tokens_to_slot = take(ep * s);
  L->off_home_offload = take(ep * ne);
  L->off_load_after = take(ep);
  L->off_slot_offset = take(s);
  L->off_first_slot = take(ne);
  L->off_next_slot = take(s);
  L->off_offload_map = take(ceil_div(ne * s, 8));
  L->state_len = o;
}

int64_t max_words(const Dims& d) {
  int64_t w = kMaskBudget / d.ne;
  return w < 1 ? 1 : (w > 32 ? 32 : w);
}

// Bitmask words per expert for T tokens: ~128 tiles, at least 64 tokens per tile.
int words_for(const Dims& d, int64_t t) {
  int64_t w = ceil_div(t, 128 * 32);
  if (w < 2) w = 2;
  const int64_t wmax = max_words(d);
  return (int)(w > wmax ? wmax : w);
}

int64_t tiles_for(const Dims& d, int64_t t) { return ceil_div(t, 32 * (int64_t)words_for(d, t)); }

// Upper bound of tiles_for(d, t) over 0 <= t <= t_max.
int64_t tiles_bound(const Dims& d, int64_t t_max) {
  int64_t b = ceil_div(t_max, 32 * max_words(d));
  if (b < 128) b = 128;
  const int64_t cap = ceil_div(t_max, 64);
  if (b > cap) b = cap;
  return b < 1 ? 1 : b;
}

capmoe_status_t set_smem(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return CAPMOE_OK;
  return cuda_status(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

capmoe_status_t launch(const capmoe_echo_config_t* cfg, const int64_t* counts, int form,
                       const uint8_t* map, const float* probs, const int32_t* ids,
                       int64_t num_tokens, int64_t* state, int32_t* workspace,
                       int64_t workspace_len, uint8_t* out_map, float* out_probs,
                       int32_t* out_dest, float* out_probs_k, void* stream) {
  Dims d;
  CAPMOE_TRY(make_dims(cfg, &d));
  if (!counts || !state) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (num_tokens < 0 || num_tokens > (int64_t(1) << 31) - 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  Params p{};
  p.counts = counts;
  p.state = state;
  make_layout(d, &p.lay);
  p.d = d;
  p.form = form;
  p.num_tokens = form == kFormNone ? 0 : num_tokens;
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
  // Stage C, F and D in shared memory when they fit.
  const bool stage = PlanSmem::bytes(d.ne, d.ep, d.s, true) <= kStageSmemBudget;
  size_t plan_smem = PlanSmem::bytes(d.ne, d.ep, d.s, stage);
  const size_t count_smem = sizeof(int32_t) * (size_t)d.ne + 16;
  if (count_smem > plan_smem) plan_smem = count_smem;
  if (stage) {
    CAPMOE_TRY(set_smem(reinterpret_cast<const void*>(plan_kernel<true>), plan_smem));
    plan_kernel<true><<<1 + p.num_tiles, kPlanThreads, plan_smem, s>>>(p);
  } else {
    CAPMOE_TRY(set_smem(reinterpret_cast<const void*>(plan_kernel<false>), plan_smem));
    plan_kernel<false><<<1 + p.num_tiles, kPlanThreads, plan_smem, s>>>(p);
  }
  CAPMOE_TRY(launch_status());
  if (p.num_tiles > 0) {
    const size_t rr_smem = RerouteSmem::bytes(d.ne, d.s, p.words);
    CAPMOE_TRY(set_smem(reinterpret_cast<const void*>(reroute_kernel), rr_smem));
    reroute_kernel<<<p.num_tiles, kRerouteThreads, rr_smem, s>>>(p);
    CAPMOE_TRY(launch_status());
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
    return launch(cfg, counts, kFormNone, nullptr, nullptr, nullptr, 0, state, nullptr, 0,
                  nullptr, nullptr, nullptr, nullptr, stream);
  });
}

extern "C" capmoe_status_t capmoe_echo_plan_reroute_dense(
    const capmoe_echo_config_t* cfg, const int64_t* counts, const uint8_t* routing_map,
    const float* probs, int64_t num_tokens, int64_t* state, int32_t* workspace,
    int64_t workspace_len, uint8_t* out_map, float* out_probs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    return launch(cfg, counts, kFormDense, routing_map, probs, nullptr, num_tokens, state,
                  workspace, workspace_len, out_map, out_probs, nullptr, nullptr, stream);
  });
}

extern "C" capmoe_status_t capmoe_echo_plan_reroute_topk(
    const capmoe_echo_config_t* cfg, const int64_t* counts, const int32_t* expert_ids,
    const float* probs, int64_t num_tokens, int64_t* state, int32_t* workspace,
    int64_t workspace_len, int32_t* out_dest, float* out_probs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    return launch(cfg, counts, kFormTopk, nullptr, probs, expert_ids, num_tokens, state,
                  workspace, workspace_len, nullptr, nullptr, out_dest, out_probs, stream);
  });
}
