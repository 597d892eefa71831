// capmoe-archs: 90a 100a
// The route probabilities in routing-row order, and the reduction of per-row dprob partials
// back to routes: the glue of the path that weights each route in fc1's epilogue
// (capturable_moe/routing.h, capmoe_routing_row_probs / capmoe_routing_route_dprobs).
//   row_probs     prob_of_row[row(t, j)] = probs[t, j]                       (as fp32)
//   route_dprobs  dprobs[t, j] = sum_s partials[row(t, j), s]  (0 for a dropped route)
// One thread per route (t, j) of t < T; row(t, j) = row_of_route[t*k + j], and a value outside
// [0, capacity) is a dropped route, never read or written through. Each output element has one
// writer and every sum runs in ascending s, so the results are deterministic without atomics.
#include "routing/common.cuh"

namespace capmoe {
namespace routing {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int kept_row(const int32_t* __restrict__ row_of_route, int64_t route, int capacity) {
  const int r = __ldg(row_of_route + route);
  return r >= 0 && r < capacity ? r : -1;
}

template <class P>
__global__ void __launch_bounds__(kThreads)
    row_probs_kernel(const int32_t* __restrict__ row_of_route, const P* __restrict__ probs, int64_t host_tokens,
                     const int32_t* __restrict__ device_tokens, int t_max, int k, int capacity,
                     float* __restrict__ prob_of_row) {
  begin_dependent_kernel();
  const int64_t route = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (route >= int64_t(resolve_tokens(host_tokens, device_tokens, t_max, nullptr)) * k) return;
  const int r = kept_row(row_of_route, route, capacity);
  if (r >= 0) prob_of_row[r] = prob_to_float(probs[route]);
}

template <class P>
__global__ void __launch_bounds__(kThreads)
    route_dprobs_kernel(const int32_t* __restrict__ row_of_route, const float* __restrict__ partials, int slices,
                        int64_t host_tokens, const int32_t* __restrict__ device_tokens, int t_max, int k,
                        int capacity, P* __restrict__ dprobs) {
  begin_dependent_kernel();
  const int64_t route = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (route >= int64_t(resolve_tokens(host_tokens, device_tokens, t_max, nullptr)) * k) return;
  const int r = kept_row(row_of_route, route, capacity);
  float sum = 0.0f;
  if (r >= 0)
    for (int s = 0; s < slices; ++s) sum = __fadd_rn(sum, __ldg(partials + int64_t(r) * slices + s));
  dprobs[route] = prob_from_float<P>(sum);
}

int route_blocks(const capmoe_routing_desc_t* d) { return int((d->max_tokens * d->topk + kThreads - 1) / kThreads); }

// Calls f.template run<Prob>() for the plan's prob dtype.
template <class F>
capmoe_status_t dispatch_prob(const capmoe_routing_desc_t* d, F&& f) {
  switch (d->prob_dtype) {
    case CAPMOE_DTYPE_F32:
      return f.template run<float>();
    case CAPMOE_DTYPE_BF16:
      return f.template run<__nv_bfloat16>();
    case CAPMOE_DTYPE_F16:
      return f.template run<__half>();
    default:
      return CAPMOE_ERR_UNSUPPORTED;
  }
}

struct RowProbs {
  const capmoe_routing_desc_t* d;
  const int32_t* row_of_route;
  const void* probs;
  int64_t num_tokens;
  const int32_t* device_tokens;
  float* prob_of_row;
  cudaStream_t stream;
  template <class P>
  capmoe_status_t run() const {
    return launch_dependent(row_probs_kernel<P>, route_blocks(d), kThreads, 0, stream, row_of_route,
                            static_cast<const P*>(probs), num_tokens, device_tokens, int(d->max_tokens), int(d->topk),
                            int(d->capacity), prob_of_row);
  }
};

struct RouteDprobs {
  const capmoe_routing_desc_t* d;
  const int32_t* row_of_route;
  const float* partials;
  int slices;
  int64_t num_tokens;
  const int32_t* device_tokens;
  void* dprobs;
  cudaStream_t stream;
  template <class P>
  capmoe_status_t run() const {
    return launch_dependent(route_dprobs_kernel<P>, route_blocks(d), kThreads, 0, stream, row_of_route, partials,
                            slices, num_tokens, device_tokens, int(d->max_tokens), int(d->topk),
                            int(d->capacity), static_cast<P*>(dprobs));
  }
};

}  // namespace
}  // namespace routing
}  // namespace capmoe

using namespace capmoe::routing;

extern "C" capmoe_status_t capmoe_routing_row_probs(const capmoe_routing_desc_t* desc, const int32_t* row_of_route,
                                                    const void* probs, int64_t num_tokens,
                                                    const int32_t* num_tokens_device, float* prob_of_row,
                                                    void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    if (desc->max_tokens == 0) return CAPMOE_OK;
    if (probs == nullptr || (desc->capacity > 0 && prob_of_row == nullptr)) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(prob_bytes(desc), {probs}));
    CAPMOE_TRY(check_aligned(4, {prob_of_row}));
    return dispatch_prob(desc, RowProbs{desc, row_of_route, probs, num_tokens, num_tokens_device, prob_of_row,
                                        static_cast<cudaStream_t>(stream)});
  });
}

extern "C" capmoe_status_t capmoe_routing_route_dprobs(const capmoe_routing_desc_t* desc,
                                                       const int32_t* row_of_route, const float* partials,
                                                       int64_t slices, int64_t num_tokens,
                                                       const int32_t* num_tokens_device, void* dprobs,
                                                       void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_routes(desc, num_tokens, num_tokens_device, row_of_route));
    // partials is [capacity, slices]: its element count must fit the int64 row * slices index.
    if (slices < 1 || slices > INT32_MAX || (desc->capacity > 0 && slices > INT64_MAX / desc->capacity))
      return CAPMOE_ERR_INVALID_ARGUMENT;
    if (desc->max_tokens == 0) return CAPMOE_OK;
    if (dprobs == nullptr || (desc->capacity > 0 && partials == nullptr)) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_aligned(prob_bytes(desc), {dprobs}));
    CAPMOE_TRY(check_aligned(4, {partials}));
    return dispatch_prob(desc, RouteDprobs{desc, row_of_route, partials, int(slices), num_tokens, num_tokens_device,
                                           dprobs, static_cast<cudaStream_t>(stream)});
  });
}
