// capmoe-archs: 90a 100a
//
// Expert-parallel dispatch / combine, the device side (contract: capturable_moe/ep.h):
//   count_routes         counts[e] = routes of this rank to home expert e (zero, then integer
//                        atomics: the sum is exact whatever the order)
//   dispatch_layout      two launches over chunks of CAPMOE_EP_LAYOUT_CHUNK routes (the second
//                        alone when one chunk holds them all): the first
//                        counts each chunk's routes per peer (chunk_counts); the second, one
//                        block per (chunk, peer p), numbers the chunk's routes to p with a
//                        block-wide scan after the earlier chunks' counts, so every route gets
//                        its position in ascending (t, j) order among the routes to p: the first
//                        `capacity` get rows of p's block, the rest drop. The peer-0 blocks also
//                        write -1 for the routes that go nowhere (no / bad dest, t >= T); the
//                        last chunk's block of each peer writes its totals and unused rows.
//                        Each output element has one writer and no position comes from an
//                        atomic, so the layout is deterministic. (Until 2026-11-28 one block
//                        per peer scanned every route: 83 us at T*k = 32768 on an H200, the
//                        largest part of the dispatch's time beyond NCCL's.)
//   gather_rows          rows[slot(t, j)] = x[t]              (one block per token)
//   reduce_rows          y[t] = sum_j rows[slot(t, j)]        (fp32, ascending j, one rounding)
//   gather_route_values  out[t, j] = values[slot(t, j)] or 0
// slot(t, j) = slot_of_route[t * k + j]; a value outside [0, R * capacity) is no route, so a
// corrupt map never causes an out-of-bounds access. Token rows t >= T are not touched.
#include <cub/block/block_scan.cuh>

#include "ep/common.cuh"

namespace capmoe {
namespace ep {
namespace {

constexpr int kCountThreads = 256;
constexpr int kCountBlocks = 1024;
constexpr int kSmemBins = 48 * 1024 / 4;  // per-block histogram fits the default smem
constexpr int kLayoutThreads = 256;
constexpr int kLayoutItems = CAPMOE_EP_LAYOUT_CHUNK / kLayoutThreads;  // consecutive routes per thread
static_assert(kLayoutItems * kLayoutThreads == CAPMOE_EP_LAYOUT_CHUNK, "a chunk is one pass of the block");
constexpr int kValueThreads = 256;

// ---------------------------------------------------------------- count_routes

// NOTE: every strided loop index of this file is int64: its last step (`+= stride`,
// `+= kChunk`, `+= blockDim.x`) may pass INT32_MAX when the bound (E, T_max * k, capacity,
// H / 8) is near it, and a wrapped int32 index would be negative, still below the bound.
__global__ void __launch_bounds__(kCountThreads) zero_counts_kernel(int64_t* counts, int experts) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < experts; e += stride)
    counts[e] = 0;
}

// Routes per expert; with `shared_bins`, a block first counts into a shared histogram and adds
// each nonzero bin to global memory once.
__global__ void __launch_bounds__(kCountThreads)
    count_routes_kernel(const int32_t* __restrict__ expert_ids, int64_t host_tokens,
                        const int32_t* __restrict__ device_tokens, int t_max, int k, int experts,
                        bool shared_bins, int64_t* __restrict__ counts, int32_t* flags) {
  CAPMOE_DYNAMIC_SMEM(smem);
  unsigned* bins = reinterpret_cast<unsigned*>(smem);
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  const int routes = resolve_tokens(host_tokens, device_tokens, t_max, flags, reporter) * k;
  if (shared_bins) {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) bins[e] = 0;
    __syncthreads();
  }
  int bits = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < routes; i += stride) {
    const int e = __ldg(expert_ids + i);
    if (e < 0 || e >= experts) {
      if (e != -1) bits |= CAPMOE_EP_BAD_EXPERT;
      continue;
    }
    if (shared_bins)
      atomicAdd(bins + e, 1u);
    else
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + e), 1ull);
  }
  raise_flags(flags, bits);
  if (shared_bins) {
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
      if (bins[e] != 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(counts + e),
                  static_cast<unsigned long long>(bins[e]));
  }
}

// ---------------------------------------------------------------- dispatch_layout

struct LayoutParams {
  const int32_t* dest;
  const float* probs;
  int64_t host_tokens;
  const int32_t* device_tokens;
  int t_max, k, cols_per_rank, num_cols, capacity, ranks, chunks;
  int32_t* chunk_counts;  // [chunks, ranks]
  int32_t* slot_of_route;
  int32_t* send_ids;
  float* send_probs;
  int32_t* send_counts;
  int32_t* dropped;
  int32_t* flags;
};

// The peer a route's final column lives on, -1 for none; `bad` for a column outside
// [-1, num_cols).
__device__ __forceinline__ int peer_of(int col, int cols_per_rank, int num_cols, bool& bad) {
  if (col >= 0 && col < num_cols) return col / cols_per_rank;
  bad = bad || col != -1;
  return -1;
}

// First launch, one block per chunk: chunk_counts[chunk][p] = routes r < T * k of the chunk
// whose final column lives on peer p (every p written).
__global__ void __launch_bounds__(kLayoutThreads) layout_count_kernel(LayoutParams p) {
  __shared__ int hist[CAPMOE_EP_MAX_RANKS];
  const int chunk = blockIdx.x;
  const int routes = resolve_tokens(p.host_tokens, p.device_tokens, p.t_max, nullptr, false) * p.k;
  for (int q = threadIdx.x; q < p.ranks; q += blockDim.x) hist[q] = 0;
  __syncthreads();
  const int64_t first = static_cast<int64_t>(chunk) * CAPMOE_EP_LAYOUT_CHUNK;
  bool bad = false;
  for (int i = threadIdx.x; i < CAPMOE_EP_LAYOUT_CHUNK; i += blockDim.x) {
    const int64_t r = first + i;
    if (r >= routes) break;
    const int to = peer_of(__ldg(p.dest + r), p.cols_per_rank, p.num_cols, bad);
    if (to >= 0) atomicAdd(&hist[to], 1);
  }
  __syncthreads();
  int32_t* row = p.chunk_counts + static_cast<int64_t>(chunk) * p.ranks;
  for (int q = threadIdx.x; q < p.ranks; q += blockDim.x) row[q] = hist[q];
}

// Routes to `peer` in the chunks before `chunk` (the first launch's counts), by the whole
// block; the same value on every thread.
__device__ int routes_before(const LayoutParams& p, int chunk, int peer) {
  __shared__ int warp_sums[kLayoutThreads / 32];
  if (chunk == 0) return 0;  // (uniform over the block) the single-chunk layout has no first launch
  int sum = 0;
  for (int c = threadIdx.x; c < chunk; c += blockDim.x) sum += p.chunk_counts[static_cast<int64_t>(c) * p.ranks + peer];
  sum = __reduce_add_sync(kFull, sum);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kLayoutThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// Second launch, block (chunk, peer): the chunk's routes to the peer get positions after the
// earlier chunks' (see the top of this file).
__global__ void __launch_bounds__(kLayoutThreads) layout_write_kernel(LayoutParams p) {
  using Scan = cub::BlockScan<int, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int chunk = blockIdx.x, peer = blockIdx.y;
  const bool owns_no_peer = peer == 0;  // also writes the routes that go to no peer
  const int routes = resolve_tokens(p.host_tokens, p.device_tokens, p.t_max, p.flags,
                                    owns_no_peer && chunk == 0 && threadIdx.x == 0) * p.k;
  const int scanned = owns_no_peer ? p.t_max * p.k : routes;  // -1 past T too
  int32_t* block_ids = p.send_ids + static_cast<int64_t>(peer) * p.capacity;
  float* block_probs = p.send_probs + static_cast<int64_t>(peer) * p.capacity;
  const int before = routes_before(p, chunk, peer);
  const int64_t first = static_cast<int64_t>(chunk) * CAPMOE_EP_LAYOUT_CHUNK + threadIdx.x * kLayoutItems;
  bool bad = false;
  int col[kLayoutItems];
  bool mine[kLayoutItems];
  int count = 0;
#pragma unroll
  for (int i = 0; i < kLayoutItems; ++i) {
    const int64_t r = first + i;
    col[i] = r < routes ? __ldg(p.dest + r) : -1;
    const int to = peer_of(col[i], p.cols_per_rank, p.num_cols, bad);
    mine[i] = to == peer && r < routes;
    count += mine[i];
    if (owns_no_peer && to < 0 && r < scanned) p.slot_of_route[r] = -1;
  }
  int position = 0, chunk_total = 0;
  Scan(scan_storage).ExclusiveSum(count, position, chunk_total);
  position += before;
#pragma unroll
  for (int i = 0; i < kLayoutItems; ++i) {
    if (!mine[i]) continue;
    const int64_t r = first + i;
    if (position < p.capacity) {
      p.slot_of_route[r] = peer * p.capacity + position;
      block_ids[position] = col[i] - peer * p.cols_per_rank;
      block_probs[position] = __ldg(p.probs + r);
    } else {
      p.slot_of_route[r] = -1;  // dropped: the block is full
    }
    ++position;
  }
  int bits = owns_no_peer && bad ? CAPMOE_EP_BAD_DEST : 0;
  if (chunk == p.chunks - 1) {
    // The peer's totals, and its block's rows past the last route: unused.
    const int total = before + chunk_total;
    const int used = total < p.capacity ? total : p.capacity;
    for (int64_t row = used + threadIdx.x; row < p.capacity; row += blockDim.x) {
      block_ids[row] = -1;
      block_probs[row] = 0.0f;
    }
    if (threadIdx.x == 0) {
      p.send_counts[peer] = used;
      p.dropped[peer] = total - used;
      if (total > used) bits |= CAPMOE_EP_OVERFLOW;
    }
  }
  raise_flags(p.flags, bits);
}

// ---------------------------------------------------------------- rows

// Stages token t's kept slots, in ascending j, in slots_s[0, n); returns n. Needs
// blockDim.x >= 32 (k <= 32).
__device__ __forceinline__ int stage_slots(const int32_t* __restrict__ slot_of_route, int t, int k,
                                           int num_slots, int* slots_s) {
  __shared__ int n_s;
  if (threadIdx.x < 32) {
    const int j = threadIdx.x;
    const int s = j < k ? __ldg(slot_of_route + static_cast<int64_t>(t) * k + j) : -1;
    const bool kept = s >= 0 && s < num_slots;
    const unsigned ballot = __ballot_sync(kFull, kept);
    if (kept) slots_s[__popc(ballot & lanemask_lt())] = s;
    if (j == 0) n_s = __popc(ballot);
  }
  __syncthreads();
  return n_s;
}

struct RowParams {
  const int32_t* slot_of_route;
  int64_t host_tokens;
  const int32_t* device_tokens;
  int t_max, k, num_slots, h_vec;
};

__global__ void __launch_bounds__(256)
    gather_rows_kernel(RowParams p, const uint4* __restrict__ x, uint4* __restrict__ rows) {
  __shared__ int slots_s[CAPMOE_EP_MAX_TOPK];
  const int t = blockIdx.x;
  if (t >= resolve_tokens(p.host_tokens, p.device_tokens, p.t_max, nullptr, false)) return;
  const int n = stage_slots(p.slot_of_route, t, p.k, p.num_slots, slots_s);
  const uint4* src = x + static_cast<int64_t>(t) * p.h_vec;
  for (int64_t v = threadIdx.x; v < p.h_vec; v += blockDim.x) {
    const uint4 q = __ldg(src + v);
    for (int j = 0; j < n; ++j) rows[static_cast<int64_t>(slots_s[j]) * p.h_vec + v] = q;
  }
}

template <class T>
__global__ void __launch_bounds__(256)
    reduce_rows_kernel(RowParams p, const uint4* __restrict__ rows, uint4* __restrict__ y) {
  __shared__ int slots_s[CAPMOE_EP_MAX_TOPK];
  const int t = blockIdx.x;
  if (t >= resolve_tokens(p.host_tokens, p.device_tokens, p.t_max, nullptr, false)) return;
  const int n = stage_slots(p.slot_of_route, t, p.k, p.num_slots, slots_s);
  for (int64_t v = threadIdx.x; v < p.h_vec; v += blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int j = 0; j < n; ++j) {
      float f[kVec];
      Vec8<T>::load(__ldg(rows + static_cast<int64_t>(slots_s[j]) * p.h_vec + v), f);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += f[i];
    }
    y[static_cast<int64_t>(t) * p.h_vec + v] = Vec8<T>::store(acc);
  }
}

__global__ void __launch_bounds__(kValueThreads)
    gather_route_values_kernel(RowParams p, const float* __restrict__ values, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int t = resolve_tokens(p.host_tokens, p.device_tokens, p.t_max, nullptr, false);
  if (i >= static_cast<int64_t>(t) * p.k) return;
  const int s = __ldg(p.slot_of_route + i);
  out[i] = s >= 0 && s < p.num_slots ? __ldg(values + s) : 0.0f;
}

// ---------------------------------------------------------------- host side

// Checks shared by the launches that read routes.
capmoe_status_t check_routes(const capmoe_ep_desc_t* d, int64_t num_tokens,
                             const int32_t* num_tokens_device, const void* route_array) {
  CAPMOE_TRY(check_desc(d));
  CAPMOE_TRY(check_tokens(d, num_tokens, num_tokens_device));
  return check_buffer(route_count(d) > 0, route_array, 4);
}

RowParams row_params(const capmoe_ep_desc_t* d, const int32_t* slot_of_route, int64_t num_tokens,
                     const int32_t* num_tokens_device) {
  return RowParams{slot_of_route, num_tokens, num_tokens_device, static_cast<int>(d->max_tokens),
                   static_cast<int>(d->topk), block_rows(d), static_cast<int>(d->hidden / kVec)};
}

}  // namespace
}  // namespace ep
}  // namespace capmoe

using namespace capmoe::ep;

extern "C" capmoe_status_t capmoe_ep_check_desc(const capmoe_ep_desc_t* desc) {
  return capmoe::guarded([&]() -> capmoe_status_t { return check_desc(desc); });
}

extern "C" capmoe_status_t capmoe_ep_count_routes(const capmoe_ep_desc_t* desc,
                                                  const int32_t* expert_ids, int64_t num_tokens,
                                                  const int32_t* num_tokens_device,
                                                  int64_t* counts, int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, expert_ids));
    CAPMOE_TRY(check_buffer(true, counts, 8));
    CAPMOE_TRY(check_buffer(false, flags, 4));
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int experts = static_cast<int>(desc->num_experts);
    CAPMOE_TRY(capmoe::launch(zero_counts_kernel, stride_blocks(experts, kCountThreads, kCountBlocks),
                              kCountThreads, 0, s, counts, experts));
    const bool shared_bins = experts <= kSmemBins;
    const size_t smem = shared_bins ? sizeof(unsigned) * static_cast<size_t>(experts) : 0;
    // One block at least, so that a device token count out of range is always reported.
    return capmoe::launch(count_routes_kernel,
                          stride_blocks(route_count(desc), kCountThreads, kCountBlocks),
                          kCountThreads, smem, s, expert_ids, num_tokens, num_tokens_device,
                          static_cast<int>(desc->max_tokens), static_cast<int>(desc->topk), experts,
                          shared_bins, counts, flags);
  });
}

extern "C" capmoe_status_t capmoe_ep_dispatch_layout(const capmoe_ep_desc_t* desc,
                                                     const int32_t* dest, const float* probs,
                                                     int64_t num_tokens,
                                                     const int32_t* num_tokens_device,
                                                     int32_t* slot_of_route, int32_t* send_ids,
                                                     float* send_probs, int32_t* send_counts,
                                                     int32_t* dropped, int32_t* chunk_counts,
                                                     int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, dest));
    const bool routes = route_count(desc) > 0, rows = block_rows(desc) > 0;
    CAPMOE_TRY(check_buffer(routes, probs, 4));
    CAPMOE_TRY(check_buffer(routes, slot_of_route, 4));
    CAPMOE_TRY(check_buffer(rows, send_ids, 4));
    CAPMOE_TRY(check_buffer(rows, send_probs, 4));
    CAPMOE_TRY(check_buffer(true, send_counts, 4));
    CAPMOE_TRY(check_buffer(true, dropped, 4));
    CAPMOE_TRY(check_buffer(true, chunk_counts, 4));
    CAPMOE_TRY(check_buffer(true, flags, 4));
    const int chunks = static_cast<int>(capmoe_ep_layout_chunks(desc));
    const LayoutParams p{dest,
                         probs,
                         num_tokens,
                         num_tokens_device,
                         static_cast<int>(desc->max_tokens),
                         static_cast<int>(desc->topk),
                         cols_per_rank(desc),
                         ranks(desc) * cols_per_rank(desc),
                         static_cast<int>(desc->capacity),
                         ranks(desc),
                         chunks,
                         chunk_counts,
                         slot_of_route,
                         send_ids,
                         send_probs,
                         send_counts,
                         dropped,
                         flags};
    const auto s = static_cast<cudaStream_t>(stream);
    // One chunk (T_max * k <= CAPMOE_EP_LAYOUT_CHUNK, decode): no earlier chunk to count, one
    // launch fewer.
    if (chunks > 1)
      CAPMOE_TRY(capmoe::launch(layout_count_kernel, dim3(static_cast<unsigned>(chunks)), kLayoutThreads, 0, s, p));
    return capmoe::launch(layout_write_kernel, dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(ranks(desc))),
                          kLayoutThreads, 0, s, p);
  });
}

extern "C" int64_t capmoe_ep_layout_chunks(const capmoe_ep_desc_t* desc) {
  if (!desc) return 0;
  const int64_t routes = desc->max_tokens * desc->topk;
  const int64_t chunks = (routes + CAPMOE_EP_LAYOUT_CHUNK - 1) / CAPMOE_EP_LAYOUT_CHUNK;
  return chunks > 0 ? chunks : 1;
}

namespace {

// Activation buffers: non-null and 16-byte aligned whenever the launch touches them.
capmoe_status_t check_rows(const capmoe_ep_desc_t* d, const void* token_rows, const void* block) {
  CAPMOE_TRY(check_buffer(d->max_tokens > 0, token_rows, 16));
  return check_buffer(block_rows(d) > 0, block, 16);
}

template <class T>
capmoe_status_t launch_reduce(const capmoe_ep_desc_t* d, RowParams p, const void* rows, void* y,
                              cudaStream_t s) {
  return capmoe::launch(reduce_rows_kernel<T>, dim3(static_cast<unsigned>(d->max_tokens)),
                        capmoe::routing::token_block_threads(d->hidden / kVec), 0, s,
                        p, static_cast<const uint4*>(rows), static_cast<uint4*>(y));
}

}  // namespace

extern "C" capmoe_status_t capmoe_ep_gather_rows(const capmoe_ep_desc_t* desc, const void* x,
                                                 const int32_t* slot_of_route, int64_t num_tokens,
                                                 const int32_t* num_tokens_device, void* rows,
                                                 void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, slot_of_route));
    CAPMOE_TRY(check_rows(desc, x, rows));
    if (desc->max_tokens == 0) return CAPMOE_OK;
    return capmoe::launch(gather_rows_kernel, dim3(static_cast<unsigned>(desc->max_tokens)),
                          capmoe::routing::token_block_threads(desc->hidden / kVec), 0,
                          static_cast<cudaStream_t>(stream),
                          row_params(desc, slot_of_route, num_tokens, num_tokens_device),
                          static_cast<const uint4*>(x), static_cast<uint4*>(rows));
  });
}

extern "C" capmoe_status_t capmoe_ep_reduce_rows(const capmoe_ep_desc_t* desc, const void* rows,
                                                 const int32_t* slot_of_route, int64_t num_tokens,
                                                 const int32_t* num_tokens_device, void* y,
                                                 void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, slot_of_route));
    CAPMOE_TRY(check_rows(desc, y, rows));
    if (desc->max_tokens == 0) return CAPMOE_OK;
    const RowParams p = row_params(desc, slot_of_route, num_tokens, num_tokens_device);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return desc->dtype == CAPMOE_DTYPE_BF16 ? launch_reduce<__nv_bfloat16>(desc, p, rows, y, s)
                                            : launch_reduce<__half>(desc, p, rows, y, s);
  });
}

extern "C" capmoe_status_t capmoe_ep_gather_route_values(const capmoe_ep_desc_t* desc,
                                                         const float* values,
                                                         const int32_t* slot_of_route,
                                                         int64_t num_tokens,
                                                         const int32_t* num_tokens_device,
                                                         float* out, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, slot_of_route));
    CAPMOE_TRY(check_buffer(route_count(desc) > 0, out, 4));
    CAPMOE_TRY(check_buffer(block_rows(desc) > 0, values, 4));
    const int64_t routes = route_count(desc);
    if (routes == 0) return CAPMOE_OK;
    return capmoe::launch(gather_route_values_kernel,
                          dim3(static_cast<unsigned>((routes + kValueThreads - 1) / kValueThreads)),
                          kValueThreads, 0, static_cast<cudaStream_t>(stream),
                          row_params(desc, slot_of_route, num_tokens, num_tokens_device), values,
                          out);
  });
}
