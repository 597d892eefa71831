// capmoe-archs: 90a 100a
// Token <-> expert-row data movement, one thread block per token, 16-byte vectors:
//   permute            rows[row(t, j)] = x[t]                       (x read once per token)
//   permute_backward   dx[t] = sum_j drows[row(t, j)]
//   unpermute          y[t]  = sum_j probs[t, j] * rows[row(t, j)]
//   unpermute_backward drows[row(t, j)] = probs[t, j] * dy[t],  dprobs[t, j] = <dy[t], rows[row(t, j)]>
// row(t, j) = row_of_route[t*k + j]; a value outside [0, capacity) is a dropped route (it is
// neither read nor written, so a corrupt map can never cause an out-of-bounds access).
// Every output element has exactly one writer and every sum runs in a fixed order (ascending
// j; for dot products a fixed per-thread order then a fixed butterfly and warp order), so the
// results are bitwise deterministic without atomics. Tokens t >= T are not touched.
#include "routing/common.cuh"

namespace capmoe {
namespace routing {
namespace {

constexpr int kMaxThreads = 256;
// Routes of a token whose rows a thread loads before it uses any (at decode sizes these kernels
// wait on memory latency, not bandwidth: one round of loads per group instead of one per route).
constexpr int kRoutesInFlight = 8;

// Stages token t's kept routes, in ascending j, in shared memory: rows_s[0, n) and their probs
// (weight 1 when probs == nullptr). Returns n. Needs blockDim.x >= 32 (k <= 32).
template <class P>
__device__ __forceinline__ int stage_routes(const int32_t* __restrict__ row_of_route,
                                            const P* __restrict__ probs, int t, int k,
                                            int capacity, int* rows_s, float* probs_s) {
  __shared__ int n_s;
  if (threadIdx.x < 32) {
    const int j = threadIdx.x;
    const int64_t i = static_cast<int64_t>(t) * k + j;
    const int r = j < k ? __ldg(row_of_route + i) : -1;
    const bool kept = r >= 0 && r < capacity;
    const unsigned ballot = __ballot_sync(kFull, kept);
    if (kept) {
      const int slot = __popc(ballot & lanemask_lt());
      rows_s[slot] = r;
      probs_s[slot] = probs != nullptr ? prob_to_float(probs[i]) : 1.0f;
    }
    if (j == 0) n_s = __popc(ballot);
  }
  __syncthreads();
  return n_s;
}

__global__ void __launch_bounds__(kMaxThreads)
    permute_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ row_of_route,
                   int64_t host_tokens, const int32_t* __restrict__ device_tokens, int t_max,
                   int k, int capacity, int h_vec, uint4* __restrict__ rows) {
  begin_dependent_kernel();
  __shared__ int rows_s[CAPMOE_ROUTING_MAX_TOPK];
  __shared__ float unused[CAPMOE_ROUTING_MAX_TOPK];
  const int t = blockIdx.x;
  if (t >= resolve_tokens(host_tokens, device_tokens, t_max, nullptr)) return;
  const int n = stage_routes<float>(row_of_route, nullptr, t, k, capacity, rows_s, unused);
  const uint4* src = x + static_cast<int64_t>(t) * h_vec;
  for (int v = threadIdx.x; v < h_vec; v += blockDim.x) {
    const uint4 q = __ldg(src + v);
    for (int j = 0; j < n; ++j) rows[static_cast<int64_t>(rows_s[j]) * h_vec + v] = q;
  }
}

// Gather-sum over the token's kept rows, optionally weighted by its probs (probs == nullptr:
// weight 1, which is the backward of permute).
template <class T, class P>
__global__ void __launch_bounds__(kMaxThreads)
    gather_sum_kernel(const uint4* __restrict__ rows, const int32_t* __restrict__ row_of_route,
                      const P* __restrict__ probs, int64_t host_tokens,
                      const int32_t* __restrict__ device_tokens, int t_max, int k, int capacity,
                      int h_vec, uint4* __restrict__ out) {
  begin_dependent_kernel();
  __shared__ int rows_s[CAPMOE_ROUTING_MAX_TOPK];
  __shared__ float probs_s[CAPMOE_ROUTING_MAX_TOPK];
  const int t = blockIdx.x;
  if (t >= resolve_tokens(host_tokens, device_tokens, t_max, nullptr)) return;
  const int n = stage_routes<P>(row_of_route, probs, t, k, capacity, rows_s, probs_s);
  for (int v = threadIdx.x; v < h_vec; v += blockDim.x) {
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += kRoutesInFlight) {
      uint4 q[kRoutesInFlight];
#pragma unroll
      for (int u = 0; u < kRoutesInFlight; ++u)
        if (j0 + u < n) q[u] = __ldg(rows + static_cast<int64_t>(rows_s[j0 + u]) * h_vec + v);
      // Summed in ascending j, as one route at a time would.
#pragma unroll
      for (int u = 0; u < kRoutesInFlight; ++u) {
        if (j0 + u >= n) break;
        const float p = probs_s[j0 + u];
        float f[kVec];
        Vec8<T>::load(q[u], f);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = fmaf(p, f[i], acc[i]);
      }
    }
    out[static_cast<int64_t>(t) * h_vec + v] = Vec8<T>::store(acc);
  }
}

template <class T, class P>
__global__ void __launch_bounds__(kMaxThreads)
    unpermute_backward_kernel(const uint4* __restrict__ dy, const uint4* __restrict__ rows,
                              const int32_t* __restrict__ row_of_route,
                              const P* __restrict__ probs, int64_t host_tokens,
                              const int32_t* __restrict__ device_tokens, int t_max, int k,
                              int capacity, int h_vec, uint4* __restrict__ drows,
                              P* __restrict__ dprobs) {
  begin_dependent_kernel();
  __shared__ int rows_s[CAPMOE_ROUTING_MAX_TOPK];
  __shared__ float probs_s[CAPMOE_ROUTING_MAX_TOPK];
  __shared__ float partial[CAPMOE_ROUTING_MAX_TOPK][kMaxThreads / 32];
  const int t = blockIdx.x;
  if (t >= resolve_tokens(host_tokens, device_tokens, t_max, nullptr)) return;
  if (threadIdx.x < k) {
    const int64_t i = static_cast<int64_t>(t) * k + threadIdx.x;
    const int r = __ldg(row_of_route + i);
    rows_s[threadIdx.x] = (r >= 0 && r < capacity) ? r : -1;
    probs_s[threadIdx.x] = prob_to_float(probs[i]);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint4* dy_t = dy + static_cast<int64_t>(t) * h_vec;
  // Routes in groups of kRoutesInFlight, each group's rows loaded before any is used; per route
  // the same products in the same order as one route at a time (v ascending, then the
  // butterfly), so dprobs and drows keep their bits. rows_s[j] is uniform over the block.
  for (int j0 = 0; j0 < k; j0 += kRoutesInFlight) {
    float dot[kRoutesInFlight];
#pragma unroll
    for (int u = 0; u < kRoutesInFlight; ++u) dot[u] = 0.0f;
    for (int v = threadIdx.x; v < h_vec; v += blockDim.x) {
      uint4 q[kRoutesInFlight];
#pragma unroll
      for (int u = 0; u < kRoutesInFlight; ++u)
        if (j0 + u < k && rows_s[j0 + u] >= 0) q[u] = __ldg(rows + static_cast<int64_t>(rows_s[j0 + u]) * h_vec + v);
      float g[kVec];
      Vec8<T>::load(__ldg(dy_t + v), g);
#pragma unroll
      for (int u = 0; u < kRoutesInFlight; ++u) {
        if (j0 + u >= k || rows_s[j0 + u] < 0) continue;
        const float p = probs_s[j0 + u];
        float a[kVec], weighted[kVec];
        Vec8<T>::load(q[u], a);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          dot[u] = fmaf(g[i], a[i], dot[u]);
          weighted[i] = g[i] * p;
        }
        drows[static_cast<int64_t>(rows_s[j0 + u]) * h_vec + v] = Vec8<T>::store(weighted);
      }
    }
#pragma unroll
    for (int u = 0; u < kRoutesInFlight; ++u) {
      if (j0 + u >= k || rows_s[j0 + u] < 0) continue;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot[u] += __shfl_xor_sync(kFull, dot[u], o);
      if (lane == 0) partial[j0 + u][warp] = dot[u];
    }
  }
  __syncthreads();
  if (threadIdx.x < k) {
    const int j = threadIdx.x;
    float s = 0.0f;
    if (rows_s[j] >= 0)
      for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += partial[j][w];
    dprobs[static_cast<int64_t>(t) * k + j] = prob_from_float<P>(s);
  }
}

struct Launch {
  const capmoe_routing_desc_t* d;
  int64_t num_tokens;
  const int32_t* device_tokens;
  cudaStream_t stream;
  int blocks() const { return static_cast<int>(d->max_tokens); }
  int threads() const { return token_block_threads(d->hidden / kVec); }
  int h_vec() const { return static_cast<int>(d->hidden / kVec); }
  int t_max() const { return static_cast<int>(d->max_tokens); }
  int k() const { return static_cast<int>(d->topk); }
  int capacity() const { return static_cast<int>(d->capacity); }
};

struct GatherSum {
  Launch l;
  const void* rows;
  const int32_t* row_of_route;
  const void* probs;  // nullptr: unweighted
  void* out;
  template <class T, class P>
  capmoe_status_t run() const {
    if (l.blocks() == 0) return CAPMOE_OK;
    return launch_dependent(gather_sum_kernel<T, P>, l.blocks(), l.threads(), 0, l.stream,
                            static_cast<const uint4*>(rows), row_of_route, static_cast<const P*>(probs),
                            l.num_tokens, l.device_tokens, l.t_max(), l.k(), l.capacity(), l.h_vec(),
                            static_cast<uint4*>(out));
  }
};

struct UnpermuteBackward {
  Launch l;
  const void* dy;
  const void* rows;
  const int32_t* row_of_route;
  const void* probs;
  void* drows;
  void* dprobs;
  template <class T, class P>
  capmoe_status_t run() const {
    if (l.blocks() == 0) return CAPMOE_OK;
    return launch_dependent(unpermute_backward_kernel<T, P>, l.blocks(), l.threads(), 0, l.stream,
                            static_cast<const uint4*>(dy), static_cast<const uint4*>(rows), row_of_route,
                            static_cast<const P*>(probs), l.num_tokens, l.device_tokens, l.t_max(), l.k(),
                            l.capacity(), l.h_vec(), static_cast<uint4*>(drows), static_cast<P*>(dprobs));
  }
};

// Activation pointers: non-null and 16-byte aligned whenever the plan has tokens.
capmoe_status_t check_act(const capmoe_routing_desc_t* d, const void* p) {
  if (d->max_tokens == 0) return CAPMOE_OK;
  if (p == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  return aligned16(p) ? CAPMOE_OK : CAPMOE_ERR_MISALIGNED;
}

}  // namespace
}  // namespace routing
}  // namespace capmoe

using namespace capmoe::routing;

extern "C" capmoe_status_t capmoe_routing_permute(const capmoe_routing_desc_t* desc, const void* x,
                                                  const int32_t* row_of_route, int64_t num_tokens,
                                                  const int32_t* num_tokens_device, void* rows,
                                                  void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    CAPMOE_TRY(check_act(desc, x));
    if (desc->capacity > 0) CAPMOE_TRY(check_act(desc, rows));
    Launch l{desc, num_tokens, num_tokens_device, static_cast<cudaStream_t>(stream)};
    if (l.blocks() == 0) return CAPMOE_OK;
    return launch_dependent(permute_kernel, l.blocks(), l.threads(), 0, l.stream,
                            static_cast<const uint4*>(x), row_of_route, num_tokens, num_tokens_device,
                            l.t_max(), l.k(), l.capacity(), l.h_vec(), static_cast<uint4*>(rows));
  });
}

extern "C" capmoe_status_t capmoe_routing_permute_backward(const capmoe_routing_desc_t* desc,
                                                           const void* drows,
                                                           const int32_t* row_of_route,
                                                           int64_t num_tokens,
                                                           const int32_t* num_tokens_device,
                                                           void* dx, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    CAPMOE_TRY(check_act(desc, dx));
    if (desc->capacity > 0) CAPMOE_TRY(check_act(desc, drows));
    Launch l{desc, num_tokens, num_tokens_device, static_cast<cudaStream_t>(stream)};
    return dispatch(desc, GatherSum{l, drows, row_of_route, nullptr, dx});
  });
}

extern "C" capmoe_status_t capmoe_routing_unpermute(const capmoe_routing_desc_t* desc,
                                                    const void* rows, const int32_t* row_of_route,
                                                    const void* probs, int64_t num_tokens,
                                                    const int32_t* num_tokens_device, void* y,
                                                    void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    CAPMOE_TRY(check_act(desc, y));
    if (desc->capacity > 0) CAPMOE_TRY(check_act(desc, rows));
    if (desc->max_tokens > 0 && probs == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(prob_bytes(desc), {probs}));
    Launch l{desc, num_tokens, num_tokens_device, static_cast<cudaStream_t>(stream)};
    return dispatch(desc, GatherSum{l, rows, row_of_route, probs, y});
  });
}

extern "C" capmoe_status_t capmoe_routing_unpermute_backward(
    const capmoe_routing_desc_t* desc, const void* dy, const void* rows,
    const int32_t* row_of_route, const void* probs, int64_t num_tokens,
    const int32_t* num_tokens_device, void* drows, void* dprobs, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    CAPMOE_TRY(check_act(desc, dy));
    if (desc->capacity > 0) {
      CAPMOE_TRY(check_act(desc, rows));
      CAPMOE_TRY(check_act(desc, drows));
    }
    if (desc->max_tokens > 0 && (probs == nullptr || dprobs == nullptr))
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(prob_bytes(desc), {probs, dprobs}));
    Launch l{desc, num_tokens, num_tokens_device, static_cast<cudaStream_t>(stream)};
    return dispatch(desc, UnpermuteBackward{l, dy, rows, row_of_route, probs, drows, dprobs});
  });
}
