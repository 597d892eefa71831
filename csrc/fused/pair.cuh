// Two 16-bit values packed in 32 bits <-> two floats, with the conversions the routing
// kernels' SwiGLU backward uses (so the same inputs give the same bits): the fused dgrad's
// epilogues (swiglu_dgrad_sm90.cu, swiglu_dgrad_sm100.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

namespace capmoe::fused {

template <class T>
struct Pair;
template <>
struct Pair<cutlass::bfloat16_t> {
  __device__ __forceinline__ static float2 unpack(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};
template <>
struct Pair<cutlass::half_t> {
  __device__ __forceinline__ static float2 unpack(uint32_t v) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

}  // namespace capmoe::fused
