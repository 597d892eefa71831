// Two 16-bit values packed in 32 bits <-> two floats, with the conversions the routing
// kernels' SwiGLU backward uses (so the same inputs give the same bits), and the dgrad epilogue's
// per-pair math: the fused dgrad's epilogues (swiglu_dgrad_sm90.cu, swiglu_dgrad_sm100.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include "common/swiglu_math.cuh"

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

// The fc2 dgrad's epilogue for one pair of adjacent columns of a row (the sm_90a and sm_100a
// kernels' drows form): dact from the fp32 accumulators rounded to T, then
// capmoe_routing_swiglu_backward's formula (common/swiglu_math.cuh, the same bits) on
// (dact, g, u) from the h pairs; the packed pairs of dact, dg and du.
struct DgradPairs {
  uint32_t dact, dg, du;
};
template <class T>
__device__ __forceinline__ DgradPairs swiglu_dgrad_pairs(float acc0, float acc1, uint32_t gate, uint32_t up) {
  const uint32_t dact = Pair<T>::pack(acc0, acc1);
  const float2 d = Pair<T>::unpack(dact);
  const float2 g = Pair<T>::unpack(gate);
  const float2 u = Pair<T>::unpack(up);
  float dg0, du0, dg1, du1;
  swiglu_backward(d.x, g.x, u.x, dg0, du0);
  swiglu_backward(d.y, g.y, u.y, dg1, du1);
  return {dact, Pair<T>::pack(dg0, dg1), Pair<T>::pack(du0, du1)};
}

}  // namespace capmoe::fused
