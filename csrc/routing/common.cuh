// Shared pieces of the routing TUs: descriptor checks, the device-side token count, and the
// 16-byte vector <-> 8 x fp32 conversions of the 2-byte activation types.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <initializer_list>
#include <utility>

#include "capturable_moe/routing.h"
#include "common/alignment.h"
#include "common/boundary.cuh"
#include "common/device_primitives.cuh"
#include "common/dependent_kernel.cuh"
#include "common/launch.cuh"

namespace capmoe {
namespace routing {

constexpr int kVec = 8;  // 2-byte elements per 16-byte vector
constexpr unsigned kFull = 0xffffffffu;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Scalar arrays must be naturally aligned (capmoe::check_aligned, common/alignment.h).
using capmoe::check_aligned;

inline size_t prob_bytes(const capmoe_routing_desc_t* d) {
  return d->prob_dtype == CAPMOE_DTYPE_F32 ? 4 : 2;
}

// Host-checkable facts of a plan. NOTE: the index math of the kernels uses int32 for route
// and row numbers and uint32 for 16-byte vector indices; these limits keep both exact.
inline capmoe_status_t check_desc(const capmoe_routing_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > CAPMOE_ROUTING_MAX_EXPERTS)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->topk < 1 || d->topk > CAPMOE_ROUTING_MAX_TOPK) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden < kVec || d->hidden % kVec != 0) return CAPMOE_ERR_MISALIGNED;
  if (d->ffn < kVec || d->ffn % kVec != 0) return CAPMOE_ERR_MISALIGNED;
  // Bounds first, so the products below cannot overflow.
  if (d->hidden > int64_t(kVec) * INT32_MAX || d->ffn > int64_t(kVec) * INT32_MAX)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->max_tokens < 0 || d->max_tokens > INT32_MAX / d->topk) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > d->max_tokens * d->topk) return CAPMOE_ERR_INVALID_ARGUMENT;
  const int64_t widest = d->hidden > 2 * d->ffn ? d->hidden : 2 * d->ffn;
  const int64_t rows = d->capacity > d->max_tokens ? d->capacity : d->max_tokens;
  if (rows > 0 && widest / kVec > INT32_MAX / rows) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  if (d->prob_dtype != CAPMOE_DTYPE_F32 && d->prob_dtype != CAPMOE_DTYPE_BF16 &&
      d->prob_dtype != CAPMOE_DTYPE_F16)
    return CAPMOE_ERR_UNSUPPORTED;
  return CAPMOE_OK;
}

inline capmoe_status_t check_tokens(const capmoe_routing_desc_t* d, int64_t num_tokens,
                                    const int32_t* num_tokens_device) {
  if (num_tokens_device == nullptr && (num_tokens < 0 || num_tokens > d->max_tokens))
    return CAPMOE_ERR_INVALID_ARGUMENT;
  return check_aligned(4, {num_tokens_device});
}

// The checks of every entry that walks the routes: descriptor, token count, and the map
// (non-null when the plan has tokens, 4-byte aligned).
inline capmoe_status_t check_routes(const capmoe_routing_desc_t* d, int64_t num_tokens,
                                    const int32_t* num_tokens_device, const int32_t* row_of_route) {
  CAPMOE_TRY(check_desc(d));
  CAPMOE_TRY(check_tokens(d, num_tokens, num_tokens_device));
  if (d->max_tokens > 0 && row_of_route == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  return check_aligned(4, {row_of_route});
}

// The token count of this launch: the device value clamped into [0, t_max] when given,
// else the (host-checked) host value. `flags` gets CAPMOE_ROUTING_BAD_TOKENS when the device
// value was out of range; pass nullptr from all but one thread.
__device__ __forceinline__ int resolve_tokens(int64_t host, const int32_t* device, int t_max,
                                              int32_t* flags) {
  if (device == nullptr) return static_cast<int>(host);
  int t = __ldg(device);
  if (t < 0 || t > t_max) {
    if (flags != nullptr) atomicOr(flags, CAPMOE_ROUTING_BAD_TOKENS);
    t = t < 0 ? 0 : t_max;
  }
  return t;
}

// 2-byte activation types: 8 elements per uint4.
template <class T>
struct Vec8;

template <>
struct Vec8<__nv_bfloat16> {
  __device__ __forceinline__ static void load(const uint4& q, float (&f)[kVec]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ __forceinline__ static uint4 store(const float (&f)[kVec]) {
    uint4 q;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return q;
  }
};

template <>
struct Vec8<__half> {
  __device__ __forceinline__ static void load(const uint4& q, float (&f)[kVec]) {
    const __half2* h = reinterpret_cast<const __half2*>(&q);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      float2 v = __half22float2(h[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ __forceinline__ static uint4 store(const float (&f)[kVec]) {
    uint4 q;
    __half2* h = reinterpret_cast<__half2*>(&q);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return q;
  }
};

// Probability types: one element to / from fp32.
__device__ __forceinline__ float prob_to_float(float p) { return p; }
__device__ __forceinline__ float prob_to_float(__nv_bfloat16 p) { return __bfloat162float(p); }
__device__ __forceinline__ float prob_to_float(__half p) { return __half2float(p); }

template <class P>
__device__ __forceinline__ P prob_from_float(float v);
template <>
__device__ __forceinline__ float prob_from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 prob_from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half prob_from_float<__half>(float v) { return __float2half_rn(v); }

// Calls f.template run<Elem, Prob>() for the plan's dtypes.
template <class F>
capmoe_status_t dispatch(const capmoe_routing_desc_t* d, F&& f) {
  const bool bf16 = d->dtype == CAPMOE_DTYPE_BF16;
  switch (d->prob_dtype) {
    case CAPMOE_DTYPE_F32:
      return bf16 ? f.template run<__nv_bfloat16, float>()
                  : f.template run<__half, float>();
    case CAPMOE_DTYPE_BF16:
      return bf16 ? f.template run<__nv_bfloat16, __nv_bfloat16>()
                  : f.template run<__half, __nv_bfloat16>();
    case CAPMOE_DTYPE_F16:
      return bf16 ? f.template run<__nv_bfloat16, __half>()
                  : f.template run<__half, __half>();
    default:
      return CAPMOE_ERR_UNSUPPORTED;
  }
}

// The routing entry points call these as routing::launch / launch_dependent (they use namespace
// capmoe::routing); every routing kernel begins with begin_dependent_kernel().
using capmoe::begin_dependent_kernel;
using capmoe::launch;
using capmoe::launch_dependent;

// Threads of a per-token block: one 16-byte vector each, a multiple of 32, at most 256.
inline int token_block_threads(int64_t vectors) {
  int64_t t = (vectors + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 256 ? 256 : t));
}

}  // namespace routing
}  // namespace capmoe
