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
// Shared-memory layout of the planner block.
struct PlanSmem {
  int64_t *n, *spill, *sps, *ce, *load, *cap, *be, *hval, *rm, *scan, *red;
  int32_t *ps, *pc, *hexp, *se, *first, *next;
  float* head;
  uint16_t* queue;  // [8][E + EP]
  int32_t *qhead, *qtail;
  int32_t* flags;  // [0] error bits, [1] keep_all
  int64_t* total;

  __host__ __device__ static size_t bytes(int ne, int ep, int s) {
    size_t b = 0;
    b += sizeof(int64_t) * (4 * (size_t)ne + 3 * (size_t)ep + 2 * (size_t)s + 32 + 1 + kPlanThreads);
    b += sizeof(int32_t) * (2 * (size_t)ne + (size_t)ep + 3 * (size_t)s + 16 + 2);
    b += sizeof(float) * (size_t)ep;
    b += sizeof(uint16_t) * 8 * ((size_t)ne + (size_t)ep);
    return b + 16;
  }

  __device__ void carve(unsigned char* base, int ne, int ep, int s) {
    int64_t* p64 = reinterpret_cast<int64_t*>(base);
    n = p64; p64 += ne;
    spill = p64; p64 += ne;
    sps = p64; p64 += ne;
    ce = p64; p64 += ne;
    load = p64; p64 += ep;
    cap = p64; p64 += ep;
    be = p64; p64 += ep;
    hval = p64; p64 += s;
    rm = p64; p64 += s;
    scan = p64; p64 += 32;
    total = p64; p64 += 1;
    red = p64; p64 += kPlanThreads;
    int32_t* p32 = reinterpret_cast<int32_t*>(p64);
    ps = p32; p32 += ne;
    first = p32; p32 += ne;
    pc = p32; p32 += ep;
    hexp = p32; p32 += s;
    se = p32; p32 += s;
    next = p32; p32 += s;
    qhead = p32; p32 += 8;
    qtail = p32; p32 += 8;
    flags = p32; p32 += 2;
    head = reinterpret_cast<float*>(p32);
    queue = reinterpret_cast<uint16_t*>(head + ep);
  }
};

// Inclusive scan of one int64 per thread over the whole (1024-thread) block.
__device__ int64_t block_inclusive_scan(int64_t v, int64_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int64_t y = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int64_t y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += scratch[warp - 1];
  __syncthreads();  // scratch may be reused right after
  return v;
}

__device__ inline int approx_bucket(int64_t v, int64_t m, int64_t iv) {
  if (v >= m || iv == 0) return 0;
  int64_t b = (m - v) / iv + 1;
  return b < 7 ? (int)b : 7;
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

// P1-P7, one block of kPlanThreads threads.
__device__ void plan_block(const Params& p, unsigned char* smem_raw) {
  const Dims d = p.d;
  const int ne = d.ne, ep = d.ep, sp = d.sp, L = d.l, S = d.s;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t* C = p.counts;
  int64_t* st = p.state;
  const capmoe_echo_layout_t& lay = p.lay;
  PlanSmem sm;
  sm.carve(smem_raw, ne, ep, S);

  if (tid == 0) {
    sm.flags[0] = 0;
    sm.flags[1] = 0;
  }
  __syncthreads();

  // P1.1 n[e], with the count checks: G = nt / E threads per expert split the source ranks
  // (more loads in flight), partial sums combined in a fixed order.
  {
    const int groups = ne <= nt ? nt / ne : 1;
    for (int i = tid; i < ne * groups; i += nt) {
      const int x = i % ne, g = i / ne;
      int64_t acc = 0;
      bool negative = false;
#pragma unroll 8
      for (int r = g; r < ep; r += groups) {
        const int64_t c = C[(int64_t)r * ne + x];
        negative |= c < 0;
        acc += c;
      }
      sm.red[i] = acc;
      if (negative) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_NEGATIVE_COUNT);
    }
    __syncthreads();
    for (int x = tid; x < ne; x += nt) {
      int64_t acc = 0;
      for (int g = 0; g < groups; ++g) acc += sm.red[g * ne + x];
      sm.n[x] = acc;
      if (acc >= (int64_t(1) << 24)) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_COUNT_TOO_LARGE);
    }
  }
  __syncthreads();
  // P1.2 load[q]; P1.3 total via a block scan.
  int64_t my_load = 0;
  if (tid < ep) {
    for (int i = 0; i < L; ++i) my_load += sm.n[tid * L + i];
    sm.load[tid] = my_load;
  }
  int64_t incl = block_inclusive_scan(tid < ep ? my_load : 0, sm.scan);
  if (tid == nt - 1) sm.total[0] = incl;
  __syncthreads();
  const bool counts_ok = sm.flags[0] == 0;
  const int64_t avg = sm.total[0] / ep;
  // P1.4 cap, P1.5 spill: the running sum before e in its rank's (n asc, e asc) order.
  for (int q = tid; q < ep; q += nt) {
    int64_t c = avg - sm.load[q];
    sm.cap[q] = counts_ok && c > 0 ? c : 0;
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
    sm.spill[x] = counts_ok ? (b > 0 ? b : 0) - (a > 0 ? a : 0) : 0;
  }
  __syncthreads();

  // G.1 / G.2 / A.1: chunk order (spill desc, e asc), bucket order (cap desc, q asc).
  for (int x = tid; x < ne; x += nt) {
    const int64_t v = sm.spill[x];
    int pos = 0;
    for (int i = 0; i < ne; ++i) {
      int64_t w = sm.spill[i];
      pos += (w > v || (w == v && i < x)) ? 1 : 0;
    }
    sm.ps[pos] = x;
    sm.sps[pos] = v;
  }
  for (int q = tid; q < ep; q += nt) {
    const int64_t v = sm.cap[q];
    int pos = 0;
    for (int i = 0; i < ep; ++i) {
      int64_t w = sm.cap[i];
      pos += (w > v || (w == v && i < q)) ? 1 : 0;
    }
    sm.pc[pos] = q;
  }
  for (int j = tid; j < S; j += nt) {
    sm.hexp[j] = -1;
    sm.hval[j] = 0;
  }
  __syncthreads();

  if (d.algorithm == CAPMOE_ECHO_GREEDY) {
    // G.3: chunk and bucket intervals as prefix sums (ne, ep <= blockDim.x).
    int64_t c_end = block_inclusive_scan(tid < ne ? sm.sps[tid] : 0, sm.scan);
    if (tid < ne) sm.ce[tid] = c_end;
    int64_t b_end = block_inclusive_scan(tid < ep ? sm.cap[sm.pc[tid]] : 0, sm.scan);
    if (tid < ep) sm.be[tid] = b_end;
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
  } else {
    // A.2-A.4: bucket every positive spill; one warp fills the FIFOs in position order.
    const int64_t m = avg, iv = avg / 7;
    const int qcap = ne + ep;
    int64_t* rest = sm.ce;  // approx does not use chunk intervals
    for (int a = tid; a < ne; a += nt) rest[a] = sm.sps[a];
    if (tid < 32) {
      const int lane = tid;
      int cnt[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) cnt[k] = 0;
      for (int base = 0; base < ne; base += 32) {
        const int a = base + lane;
        const int64_t v = a < ne ? sm.sps[a] : 0;
        const int k = v > 0 ? approx_bucket(v, m, iv) : -1;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          unsigned ballot = __ballot_sync(kFull, k == kk);
          if (k == kk) sm.queue[kk * qcap + cnt[kk] + __popc(ballot & ((1u << lane) - 1u))] = (uint16_t)a;
          cnt[kk] += __popc(ballot);
        }
      }
      if (lane < 8) {
        int c = 0;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) if (kk == lane) c = cnt[kk];
        sm.qhead[lane] = 0;
        sm.qtail[lane] = c;
      }
    }
    __syncthreads();
    // A.5: one thread walks the ranks in capacity order.
    if (tid == 0) {
      int cur = 0;
      for (int b = 0; b < ep; ++b) {
        const int q = sm.pc[b];
        const int64_t cp = sm.cap[q];
        if (cp <= 0) break;
        int a = -1;
        for (int k = cur; k < 8; ++k) {
          if (sm.qhead[k] < sm.qtail[k]) {
            a = sm.queue[k * qcap + sm.qhead[k]++];
            cur = k;
            break;
          }
          cur = k + 1;
        }
        if (a < 0) break;
        const int64_t x = min(rest[a], cp);
        rest[a] -= x;
        sm.hexp[q] = sm.ps[a];  // S_per == 1: slot index == rank index
        sm.hval[q] = x;
        if (rest[a] > 0) {
          const int k = approx_bucket(rest[a], m, iv);
          if (sm.qtail[k] < qcap) sm.queue[k * qcap + sm.qtail[k]++] = (uint16_t)a;
          else sm.flags[0] |= CAPMOE_ECHO_ERR_INTERNAL;
        }
      }
    }
  }
  __syncthreads();

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

  // P4 slot_expert; per-expert slot lists (ascending j).
  for (int j = tid; j < S; j += nt) {
    const int e = sm.hval[j] > 0 ? sm.hexp[j] : -1;
    sm.se[j] = e;
    if (e < 0) sm.hval[j] = 0;
  }
  for (int x = tid; x < ne; x += nt) sm.first[x] = -1;
  __syncthreads();
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    int nxt = -1;
    bool first = e >= 0;
    if (e >= 0) {
      for (int i = j + 1; i < S; ++i)
        if (sm.se[i] == e) { nxt = i; break; }
      for (int i = 0; i < j; ++i)
        if (sm.se[i] == e) { first = false; break; }
    }
    sm.next[j] = nxt;
    if (first) sm.first[e] = j;
    st[lay.off_slot_expert + j] = e;
    st[lay.off_slot_tokens + j] = sm.hval[j];
    st[lay.off_next_slot + j] = nxt;
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
  __syncthreads();
  for (int x = tid; x < ne; x += nt) st[lay.off_first_slot + x] = sm.first[x];

  // P5 first pass, one thread per slot. NOTE: loads are batched kB at a time: the stores to
  // the state could alias them, so an unbatched loop would serialise on every L2 round trip.
  constexpr int kB = 8;
  int64_t* F = st + lay.off_first_pass;
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    int64_t sum = 0;
    if (e >= 0) {
      const float den = __ll2float_rn(sm.n[e]);
      const float cj = __ll2float_rn(sm.hval[j]);
      for (int r0 = 0; r0 < ep; r0 += kB) {
        int64_t cv[kB];
#pragma unroll
        for (int u = 0; u < kB; ++u)
          cv[u] = r0 + u < ep ? __ldg(&C[(int64_t)(r0 + u) * ne + e]) : 0;
#pragma unroll
        for (int u = 0; u < kB; ++u) {
          if (r0 + u < ep) {
            const float share = __fdiv_rn(__ll2float_rn(cv[u]), den);
            const int64_t f = (int64_t)floorf(__fmul_rn(share, cj));
            F[(int64_t)(r0 + u) * S + j] = f;
            sum += f;
          }
        }
      }
    } else {
      for (int r = 0; r < ep; ++r) F[(int64_t)r * S + j] = 0;
    }
    const int64_t rmj = sm.hval[j] - sum;
    sm.rm[j] = rmj;
    st[lay.off_remaining_capacity + j] = rmj;
    if (rmj < 0) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
  }
  __syncthreads();
  // C - C1 per (r, e): zeros for experts without slots; the thread of an expert's first slot
  // sums the expert's slot list.
  int64_t* fpho = st + lay.off_first_pass_home_offload;
  for (int i = tid; i < ep * ne; i += nt)
    if (sm.first[i % ne] < 0) fpho[i] = 0;
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    if (e < 0 || sm.first[e] != j) continue;
    for (int r0 = 0; r0 < ep; r0 += kB) {
      int64_t acc[kB];
#pragma unroll
      for (int u = 0; u < kB; ++u) acc[u] = 0;
      for (int i = j; i >= 0; i = sm.next[i]) {
#pragma unroll
        for (int u = 0; u < kB; ++u)
          if (r0 + u < ep) acc[u] += F[(int64_t)(r0 + u) * S + i];
      }
#pragma unroll
      for (int u = 0; u < kB; ++u)
        if (r0 + u < ep) fpho[(int64_t)(r0 + u) * ne + e] = acc[u];
    }
  }
  __syncthreads();

  // P6 second pass, one thread per slot: merge of the source line (C1 by rank) with the slot
  // line (Rm of the expert's slots in ascending j).
  int64_t* D = st + lay.off_second_pass;
  int64_t* Ft = st + lay.off_tokens_to_slot;
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    if (e < 0) {
      for (int r = 0; r < ep; ++r) {
        D[(int64_t)r * S + j] = 0;
        Ft[(int64_t)r * S + j] = 0;
      }
      st[lay.off_slot_offset + j] = 0;
      continue;
    }
    int64_t bj = 0;
    for (int i = sm.first[e]; i >= 0 && i != j; i = sm.next[i]) bj += sm.rm[i];
    const int64_t bend = bj + sm.rm[j];
    int64_t a = 0, filled = 0;
    for (int r0 = 0; r0 < ep; r0 += kB) {
      int64_t c1[kB], fv[kB];
#pragma unroll
      for (int u = 0; u < kB; ++u) {
        c1[u] = 0;
        fv[u] = 0;
        if (r0 + u < ep) {
          const int64_t r = r0 + u;
          c1[u] = __ldg(&C[r * ne + e]) - fpho[r * ne + e];
          fv[u] = F[r * S + j];
        }
      }
#pragma unroll
      for (int u = 0; u < kB; ++u) {
        if (r0 + u < ep) {
          const int64_t dv = max(int64_t(0), min(a + c1[u], bend) - max(a, bj));
          a += c1[u];
          D[(int64_t)(r0 + u) * S + j] = dv;
          const int64_t ft = fv[u] + dv;
          Ft[(int64_t)(r0 + u) * S + j] = ft;
          filled += ft;
        }
      }
    }
    if (filled != sm.hval[j]) atomicOr(&sm.flags[0], CAPMOE_ECHO_ERR_INTERNAL);
  }
  __syncthreads();

  // P7 home offload (as C - C1 above); this rank's slot offsets; loads after rerouting.
  int64_t* ho = st + lay.off_home_offload;
  for (int i = tid; i < ep * ne; i += nt)
    if (sm.first[i % ne] < 0) ho[i] = 0;
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    if (e < 0 || sm.first[e] != j) continue;
    for (int r0 = 0; r0 < ep; r0 += kB) {
      int64_t acc[kB];
#pragma unroll
      for (int u = 0; u < kB; ++u) acc[u] = 0;
      for (int i = j; i >= 0; i = sm.next[i]) {
#pragma unroll
        for (int u = 0; u < kB; ++u)
          if (r0 + u < ep) acc[u] += Ft[(int64_t)(r0 + u) * S + i];
      }
#pragma unroll
      for (int u = 0; u < kB; ++u)
        if (r0 + u < ep) ho[(int64_t)(r0 + u) * ne + e] = acc[u];
    }
  }
  for (int j = tid; j < S; j += nt) {
    const int e = sm.se[j];
    if (e < 0) continue;
    int64_t off = 0;
    for (int i = sm.first[e]; i >= 0 && i != j; i = sm.next[i]) off += Ft[(int64_t)d.rho * S + i];
    st[lay.off_slot_offset + j] = off;
  }
  for (int q = tid; q < ep; q += nt) {
    int64_t after = sm.load[q];
    for (int j = 0; j < S; ++j) {
      const int e = sm.se[j];
      if (e < 0) continue;
      if (e / L == q) after -= sm.hval[j];
      if (j / sp == q) after += sm.hval[j];
    }
    st[lay.off_load_after + q] = after;
    st[lay.off_load_per_rank + q] = sm.load[q];
    st[lay.off_spare_capacity + q] = sm.cap[q];
  }
  for (int x = tid; x < ne; x += nt) {
    st[lay.off_tokens_per_expert + x] = sm.n[x];
    st[lay.off_spill + x] = sm.spill[x];
  }
  __syncthreads();
  if (tid == 0) {
    st[lay.off_avg] = avg;
    st[lay.off_error] = sm.flags[0];
  }
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

__global__ void __launch_bounds__(kPlanThreads, 1) plan_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  if (blockIdx.x == 0) {
    plan_block(p, smem);
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
  int64_t* part;    // [max(kRerouteThreads, E)] partial tile prefixes

  __host__ __device__ static size_t bytes(int ne, int s, int words) {
    return sizeof(int64_t) * (2 * (size_t)s + ne + kMaxExperts) + sizeof(uint32_t) * (size_t)ne * words * 2 +
           sizeof(int32_t) * (2 * (size_t)s + ne + 1) + 16;
  }
  __device__ void carve(unsigned char* base, int ne, int s, int words) {
    int64_t* p64 = reinterpret_cast<int64_t*>(base);
    soff = p64; p64 += s;
    send = p64; p64 += s;
    moved = p64; p64 += ne;
    part = p64; p64 += kMaxExperts;  // >= ne * groups
    mask = reinterpret_cast<uint32_t*>(p64);
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
  const int groups = ne <= nt ? nt / ne : 1;
  for (int i = tid; i < ne * groups; i += nt) {
    const int x = i % ne, g = i / ne;
    int64_t acc = 0;
#pragma unroll 8
    for (int tl = g; tl < tile; tl += groups) acc += __ldg(&p.tile_counts[(int64_t)tl * ne + x]);
    sm.part[i] = acc;
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
  if (p.form == kFormDense) {
    const int width = ne + S;
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
  size_t plan_smem = PlanSmem::bytes(d.ne, d.ep, d.s);
  const size_t count_smem = sizeof(int32_t) * (size_t)d.ne + 16;
  if (count_smem > plan_smem) plan_smem = count_smem;
  CAPMOE_TRY(set_smem(reinterpret_cast<const void*>(plan_kernel), plan_smem));
  plan_kernel<<<1 + p.num_tiles, kPlanThreads, plan_smem, s>>>(p);
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
