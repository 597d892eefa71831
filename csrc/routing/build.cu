// capmoe-archs: 90a 100a
// Routing maps on the device: per-expert counts, m_splits / offsets, row_of_route and
// token_of_row from expert_ids [T, k], plus the Megatron routing-map -> [T, k] conversion.
//
// Layout contract (see capturable_moe/routing.h): rows are expert-contiguous, experts in
// ascending order, and within an expert routes appear in ascending route index r = t*k + j.
//
// Three kernels, deterministic by construction (no result depends on atomic ordering):
//   1. histogram: block b counts the experts of routes [b*kChunk, (b+1)*kChunk) into
//      workspace[b][e] (per-warp counts via __match_any_sync, summed in warp order);
//   2. scan (one block): turns workspace[b][e] into the exclusive prefix over blocks (the rank
//      base of block b within expert e), applies expert_capacity and capacity, and writes
//      m_splits, offsets, expert_counts;
//   3. scatter: recomputes the per-warp counts of its chunk, adds the block base and the
//      earlier warps' counts, then walks its routes in order giving each its rank within the
//      expert: rank < m_splits[e] -> row offsets[e] + rank, else dropped (-1).
// When T_max * k routes fit one chunk (decode sizes: 128 tokens x top-8), one block of
// kScanThreads does all three (build_one_chunk_kernel): the same steps, the same results, one
// launch instead of three, whose latencies were most of a decode step's routing time.
#include "routing/common.cuh"

namespace capmoe {
namespace routing {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItersPerWarp = 4;
constexpr int kRoutesPerWarp = 32 * kItersPerWarp;
constexpr int kChunk = kWarps * kRoutesPerWarp;  // routes per block
constexpr int kScanThreads = 1024;               // >= CAPMOE_ROUTING_MAX_EXPERTS

int64_t num_chunks(const capmoe_routing_desc_t* d) {
  const int64_t routes = d->max_tokens * d->topk;
  const int64_t b = (routes + kChunk - 1) / kChunk;
  return b < 1 ? 1 : b;
}

// Per-warp expert counts of this block's routes into hist[warp * E + e] (zeroed by the
// caller). Keeps each lane's expert (or -1 when it is no valid route) and its match mask.
// Returns whether this lane saw an id outside [0, E) other than -1.
__device__ __forceinline__ bool count_chunk(const int32_t* __restrict__ ids, int n_routes, int E,
                                           int* hist, int (&expert)[kItersPerWarp],
                                           unsigned (&match)[kItersPerWarp]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kChunk + warp * kRoutesPerWarp;
  bool bad = false;
  int loaded[kItersPerWarp];  // all loads in flight before the first match
#pragma unroll
  for (int it = 0; it < kItersPerWarp; ++it) {
    const int r = first + it * 32 + lane;
    loaded[it] = r < n_routes ? __ldg(ids + r) : -1;
  }
#pragma unroll
  for (int it = 0; it < kItersPerWarp; ++it) {
    const int e = loaded[it];
    const bool good = e >= 0 && e < E;
    bad |= !good && e != -1;
    const int key = good ? e : -1;
    const unsigned mask = __match_any_sync(kFull, key);
    expert[it] = key;
    match[it] = mask;
    // NOTE: one leader per distinct expert, so no two lanes update the same counter.
    if (good && lane == __ffs(mask) - 1) hist[warp * E + e] += __popc(mask);
    __syncwarp();
  }
  return bad;
}

__global__ void __launch_bounds__(kThreads)
    histogram_kernel(const int32_t* __restrict__ ids, int64_t host_tokens,
                     const int32_t* __restrict__ device_tokens, int t_max, int k, int E,
                     int32_t* flags, int32_t* __restrict__ block_counts) {
  begin_dependent_kernel();
  CAPMOE_DYNAMIC_SMEM(smem);
  int* hist = reinterpret_cast<int*>(smem);  // [kWarps][E]
  for (int i = threadIdx.x; i < kWarps * E; i += kThreads) hist[i] = 0;
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  const int T = resolve_tokens(host_tokens, device_tokens, t_max, reporter ? flags : nullptr);
  __syncthreads();

  int expert[kItersPerWarp];
  unsigned match[kItersPerWarp];
  const bool bad = count_chunk(ids, T * k, E, hist, expert, match);
  if (__syncthreads_or(bad) && threadIdx.x == 0 && flags != nullptr)
    atomicOr(flags, CAPMOE_ROUTING_BAD_EXPERT);

  for (int e = threadIdx.x; e < E; e += kThreads) {
    int sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += hist[w * E + e];
    block_counts[static_cast<int64_t>(blockIdx.x) * E + e] = sum;
  }
}

// Inclusive block-wide sum scan (blockDim.x == kScanThreads).
__device__ __forceinline__ long long block_inclusive_scan(long long v) {
  __shared__ long long warp_sums[kScanThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long o = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += o;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long s = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long o = __shfl_up_sync(kFull, s, d);
      if (lane >= d) s += o;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  return warp > 0 ? v + warp_sums[warp - 1] : v;
}

// The rows [begin, end) of one expert.
struct ExpertRows {
  long long begin, end;
};

// Expert e's rows (thread e of a kScanThreads block; every thread calls it): its `total` routes,
// clipped to expert_capacity, laid out after the experts before it and clipped at capacity;
// writes m_splits, offsets, expert_counts, raises CAPACITY where a route is dropped.
__device__ __forceinline__ ExpertRows place_experts(int e, int E, long long total, long long capacity,
                                                    long long expert_capacity, int32_t* flags,
                                                    int32_t* __restrict__ m_splits_i32,
                                                    int64_t* __restrict__ m_splits_i64,
                                                    int64_t* __restrict__ offsets,
                                                    int32_t* __restrict__ expert_counts) {
  long long kept = total;
  if (expert_capacity > 0 && kept > expert_capacity) kept = expert_capacity;
  bool dropped = kept < total;
  const long long incl = block_inclusive_scan(kept);
  const long long excl = incl - kept;
  const long long begin = excl < capacity ? excl : capacity;
  const long long end = incl < capacity ? incl : capacity;
  if (e < E) {
    if (m_splits_i32 != nullptr) m_splits_i32[e] = static_cast<int32_t>(end - begin);
    if (m_splits_i64 != nullptr) m_splits_i64[e] = end - begin;
    if (expert_counts != nullptr) expert_counts[e] = static_cast<int32_t>(total);
    offsets[e] = begin;
    if (e == E - 1) {
      offsets[E] = end;
      dropped |= incl > capacity;
    }
  }
  if (__syncthreads_or(dropped) && threadIdx.x == 0 && flags != nullptr)
    atomicOr(flags, CAPMOE_ROUTING_CAPACITY);
  return ExpertRows{begin, end};
}

__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int32_t* __restrict__ block_counts, int num_blocks, int E, long long capacity,
                long long expert_capacity, int32_t* flags, int32_t* __restrict__ m_splits_i32,
                int64_t* __restrict__ m_splits_i64, int64_t* __restrict__ offsets,
                int32_t* __restrict__ expert_counts) {
  begin_dependent_kernel();
  const int e = threadIdx.x;
  long long total = 0;
  if (e < E) {
    // NOTE: loads batched ahead of the in-place stores; one load-store pair per block would
    // serialise num_blocks L2 round trips.
    constexpr int kBatch = 16;
    for (int b0 = 0; b0 < num_blocks; b0 += kBatch) {
      int c[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i)
        c[i] = b0 + i < num_blocks ? block_counts[static_cast<int64_t>(b0 + i) * E + e] : 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (b0 + i < num_blocks) block_counts[static_cast<int64_t>(b0 + i) * E + e] = static_cast<int32_t>(total);
        total += c[i];
      }
    }
  }
  place_experts(e, E, total, capacity, expert_capacity, flags, m_splits_i32, m_splits_i64, offsets,
                expert_counts);
}

// hist[w][e] <- the rank within expert e of warp w's first route to it: block_base[e] (the
// routes of earlier chunks; nullptr: none) plus the counts of the warps before w. Threads
// stride over the experts.
__device__ __forceinline__ void first_ranks(int* hist, int E, const int32_t* __restrict__ block_base) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = block_base != nullptr ? block_base[e] : 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = hist[w * E + e];
      hist[w * E + e] = run;
      run += c;
    }
  }
}

// Warps 0 .. kWarps-1 walk their routes of this block's chunk in order (expert and match as
// count_chunk left them; hist as first_ranks left it), giving each its rank within its expert:
// rank < kept[e] -> row row_begin[e] + rank, else dropped (-1).
__device__ __forceinline__ void scatter_chunk(const int (&expert)[kItersPerWarp], const unsigned (&match)[kItersPerWarp],
                                              int* hist, const long long* row_begin, const int* kept, int t_max,
                                              int k, int E, int32_t* __restrict__ row_of_route,
                                              int32_t* __restrict__ token_of_row) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = blockIdx.x * kChunk + warp * kRoutesPerWarp;
  const int all_routes = t_max * k;
#pragma unroll
  for (int it = 0; it < kItersPerWarp; ++it) {
    const int r = first + it * 32 + lane;
    const int e = expert[it];
    const unsigned mask = match[it];
    int rank = 0;
    if (e >= 0) rank = hist[warp * E + e] + __popc(mask & lanemask_lt());
    __syncwarp();
    if (e >= 0 && lane == __ffs(mask) - 1) hist[warp * E + e] += __popc(mask);
    __syncwarp();
    int row = -1;
    if (e >= 0 && rank < kept[e]) row = static_cast<int>(row_begin[e] + rank);
    if (r < all_routes) row_of_route[r] = row;
    if (row >= 0 && token_of_row != nullptr) token_of_row[row] = r / k;
  }
}

// token_of_row = -1 for the rows [total, capacity) no route fills, the grid's threads striding.
__device__ __forceinline__ void clear_unused_rows(long long total, long long capacity, int32_t* __restrict__ token_of_row) {
  if (token_of_row == nullptr) return;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = total + blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < capacity; i += stride)
    token_of_row[i] = -1;
}

__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const int32_t* __restrict__ ids, int64_t host_tokens,
                   const int32_t* __restrict__ device_tokens, int t_max, int k, int E,
                   const int32_t* __restrict__ block_base, const int64_t* __restrict__ offsets,
                   int capacity, int32_t* __restrict__ row_of_route,
                   int32_t* __restrict__ token_of_row) {
  begin_dependent_kernel();
  CAPMOE_DYNAMIC_SMEM(smem);
  long long* row_begin = reinterpret_cast<long long*>(smem);    // [E]
  int* kept = reinterpret_cast<int*>(row_begin + E);            // [E]
  int* hist = kept + E;                                         // [kWarps][E]
  for (int i = threadIdx.x; i < kWarps * E; i += kThreads) hist[i] = 0;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    row_begin[e] = offsets[e];
    kept[e] = static_cast<int>(offsets[e + 1] - offsets[e]);
  }
  const int T = resolve_tokens(host_tokens, device_tokens, t_max, nullptr);
  __syncthreads();

  int expert[kItersPerWarp];
  unsigned match[kItersPerWarp];
  count_chunk(ids, T * k, E, hist, expert, match);
  __syncthreads();
  first_ranks(hist, E, block_base + static_cast<int64_t>(blockIdx.x) * E);
  __syncthreads();
  scatter_chunk(expert, match, hist, row_begin, kept, t_max, k, E, row_of_route, token_of_row);
  clear_unused_rows(offsets[E], capacity, token_of_row);
}

// The three steps in one block of kScanThreads, for T_max * k <= kChunk routes: warps
// 0 .. kWarps-1 count the chunk as histogram_kernel's block 0 would, every thread e places
// expert e as scan_kernel does (one chunk: its counts are the totals and every block base is
// 0), and the counting warps give the routes their rows as scatter_kernel does.
__global__ void __launch_bounds__(kScanThreads)
    build_one_chunk_kernel(const int32_t* __restrict__ ids, int64_t host_tokens,
                           const int32_t* __restrict__ device_tokens, int t_max, int k, int E,
                           long long capacity, long long expert_capacity, int32_t* flags,
                           int32_t* __restrict__ m_splits_i32, int64_t* __restrict__ m_splits_i64,
                           int64_t* __restrict__ offsets, int32_t* __restrict__ row_of_route,
                           int32_t* __restrict__ token_of_row, int32_t* __restrict__ expert_counts) {
  begin_dependent_kernel();
  CAPMOE_DYNAMIC_SMEM(smem);
  long long* row_begin = reinterpret_cast<long long*>(smem);  // [E]
  int* kept = reinterpret_cast<int*>(row_begin + E);          // [E]
  int* hist = kept + E;                                       // [kWarps][E]
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) hist[i] = 0;
  const int T = resolve_tokens(host_tokens, device_tokens, t_max, threadIdx.x == 0 ? flags : nullptr);
  __syncthreads();

  const bool counts = threadIdx.x < kThreads;  // warps 0 .. kWarps-1, as one histogram block
  int expert[kItersPerWarp];
  unsigned match[kItersPerWarp];
  const bool bad = counts && count_chunk(ids, T * k, E, hist, expert, match);
  if (__syncthreads_or(bad) && threadIdx.x == 0 && flags != nullptr) atomicOr(flags, CAPMOE_ROUTING_BAD_EXPERT);

  const int e = threadIdx.x;
  long long total = 0;
  if (e < E) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += hist[w * E + e];
  }
  const ExpertRows rows =
      place_experts(e, E, total, capacity, expert_capacity, flags, m_splits_i32, m_splits_i64, offsets, expert_counts);
  if (e < E) {
    row_begin[e] = rows.begin;
    kept[e] = static_cast<int>(rows.end - rows.begin);
  }
  first_ranks(hist, E, nullptr);
  __syncthreads();  // (also orders place_experts's offsets[E], by thread E - 1, before every read)
  if (counts) scatter_chunk(expert, match, hist, row_begin, kept, t_max, k, E, row_of_route, token_of_row);
  clear_unused_rows(offsets[E], capacity, token_of_row);
}

// One warp per token: the experts with a nonzero map entry, in ascending order.
template <class P>
__global__ void __launch_bounds__(kThreads)
    from_map_kernel(const uint8_t* __restrict__ map, const P* __restrict__ map_probs,
                    int64_t host_tokens, const int32_t* __restrict__ device_tokens, int t_max,
                    int k, int E, int32_t* __restrict__ ids, P* __restrict__ probs,
                    int32_t* flags) {
  begin_dependent_kernel();
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  const int T = resolve_tokens(host_tokens, device_tokens, t_max, reporter ? flags : nullptr);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= T) return;
  const uint8_t* row = map + static_cast<int64_t>(t) * E;
  const P* prow = map_probs + static_cast<int64_t>(t) * E;
  int count = 0;
  for (int base = 0; base < E; base += 32) {
    const int e = base + lane;
    const bool hit = e < E && row[e] != 0;
    const unsigned ballot = __ballot_sync(kFull, hit);
    if (hit) {
      const int slot = count + __popc(ballot & lanemask_lt());
      if (slot < k) {
        ids[static_cast<int64_t>(t) * k + slot] = e;
        probs[static_cast<int64_t>(t) * k + slot] = prow[e];
      }
    }
    count += __popc(ballot);
  }
  for (int slot = count + lane; slot < k; slot += 32) {
    ids[static_cast<int64_t>(t) * k + slot] = -1;
    probs[static_cast<int64_t>(t) * k + slot] = prob_from_float<P>(0.0f);
  }
  if (count > k && lane == 0 && flags != nullptr) atomicOr(flags, CAPMOE_ROUTING_TOO_MANY);
}

struct FromMap {
  const capmoe_routing_desc_t* d;
  const uint8_t* map;
  const void* map_probs;
  int64_t num_tokens;
  const int32_t* device_tokens;
  int32_t* ids;
  void* probs;
  int32_t* flags;
  cudaStream_t stream;
  template <class Elem, class P>
  capmoe_status_t run() const {
    // NOTE: one block even for T_max = 0: it reads the device T and flags one out of range.
    const int64_t blocks = d->max_tokens > 0 ? (d->max_tokens + kWarps - 1) / kWarps : 1;
    return launch_dependent(from_map_kernel<P>, static_cast<unsigned>(blocks), kThreads, 0, stream,
                            map, static_cast<const P*>(map_probs), num_tokens, device_tokens,
                            static_cast<int>(d->max_tokens), static_cast<int>(d->topk),
                            static_cast<int>(d->num_experts), ids, static_cast<P*>(probs), flags);
  }
};

}  // namespace
}  // namespace routing
}  // namespace capmoe

using namespace capmoe::routing;

extern "C" capmoe_status_t capmoe_routing_workspace_size(const capmoe_routing_desc_t* desc,
                                                         uint64_t* bytes) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    if (bytes == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    const uint64_t raw = static_cast<uint64_t>(num_chunks(desc)) *
                         static_cast<uint64_t>(desc->num_experts) * sizeof(int32_t);
    *bytes = (raw + 255) / 256 * 256;
    return CAPMOE_OK;
  });
}

extern "C" capmoe_status_t capmoe_routing_from_map(const capmoe_routing_desc_t* desc,
                                                   const uint8_t* routing_map,
                                                   const void* map_probs, int64_t num_tokens,
                                                   const int32_t* num_tokens_device,
                                                   int32_t* expert_ids, void* probs,
                                                   int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    CAPMOE_TRY(check_tokens(desc, num_tokens, num_tokens_device));
    if (desc->max_tokens > 0 &&
        (routing_map == nullptr || map_probs == nullptr || expert_ids == nullptr ||
         probs == nullptr))
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(prob_bytes(desc), {map_probs, probs}));
    CAPMOE_TRY(check_aligned(4, {expert_ids, flags}));
    FromMap f{desc,       routing_map, map_probs, num_tokens,
              num_tokens_device, expert_ids, probs, flags,
              static_cast<cudaStream_t>(stream)};
    return dispatch(desc, f);
  });
}

extern "C" capmoe_status_t capmoe_routing_build(
    const capmoe_routing_desc_t* desc, const int32_t* expert_ids, int64_t num_tokens,
    const int32_t* num_tokens_device, int32_t* m_splits_i32, int64_t* m_splits_i64,
    int64_t* offsets, int32_t* row_of_route, int32_t* token_of_row, int32_t* expert_counts,
    int32_t* flags, void* workspace, uint64_t workspace_bytes, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    CAPMOE_TRY(check_tokens(desc, num_tokens, num_tokens_device));
    uint64_t need = 0;
    CAPMOE_TRY(capmoe_routing_workspace_size(desc, &need));
    if (workspace == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (workspace_bytes < need) return CAPMOE_ERR_WORKSPACE_TOO_SMALL;
    if (offsets == nullptr || (desc->max_tokens > 0 && (expert_ids == nullptr ||
                                                        row_of_route == nullptr)))
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(4, {expert_ids, m_splits_i32, row_of_route, token_of_row,
                                 expert_counts, flags, workspace}));
    CAPMOE_TRY(check_aligned(8, {m_splits_i64, offsets}));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int E = static_cast<int>(desc->num_experts);
    const int k = static_cast<int>(desc->topk);
    const int t_max = static_cast<int>(desc->max_tokens);
    const int blocks = static_cast<int>(num_chunks(desc));
    int32_t* block_counts = static_cast<int32_t*>(workspace);

    const size_t hist_bytes = sizeof(int) * kWarps * E;
    const long long expert_capacity = desc->expert_capacity > 0 ? desc->expert_capacity : 0;
    const size_t scatter_bytes = (sizeof(long long) + sizeof(int)) * E + hist_bytes;
    if (blocks == 1) {
      return launch_dependent(build_one_chunk_kernel, 1, kScanThreads, scatter_bytes, s, expert_ids, num_tokens,
                              num_tokens_device, t_max, k, E, static_cast<long long>(desc->capacity),
                              expert_capacity, flags, m_splits_i32, m_splits_i64, offsets, row_of_route,
                              token_of_row, expert_counts);
    }
    CAPMOE_TRY(launch_dependent(histogram_kernel, blocks, kThreads, hist_bytes, s, expert_ids, num_tokens,
                                num_tokens_device, t_max, k, E, flags, block_counts));
    CAPMOE_TRY(launch_dependent(scan_kernel, 1, kScanThreads, 0, s, block_counts, blocks, E,
                                desc->capacity, expert_capacity, flags, m_splits_i32, m_splits_i64, offsets,
                                expert_counts));
    return launch_dependent(scatter_kernel, blocks, kThreads, scatter_bytes, s, expert_ids, num_tokens,
                            num_tokens_device, t_max, k, E, block_counts, offsets,
                            static_cast<int>(desc->capacity), row_of_route, token_of_row);
  });
}
