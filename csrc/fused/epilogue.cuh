// Epilogue pieces the fused kernels share (fc1_sm90.cu, fc1_sm100.cu, wgrad_gather_sm90.cu).
#pragma once

#include <cstdint>

#include "common/swiglu_math.cuh"

namespace capmoe::fused {

// Two fp32 values rounded to the 16-bit type T (bf16 / f16), packed low first: one 32-bit
// store of two adjacent columns.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(T(lo).raw()) | (uint32_t(T(hi).raw()) << 16);
}

// fc1's epilogue for two adjacent columns of one row (the sm_90a and sm_100a kernels): gate and
// up rounded to T, act = silu(g) * u in fp32 on the rounded values (capmoe_routing_swiglu's
// math, so act equals the unfused path's), times the route probability when `weighted`; the
// packed pairs of act, gate and up (h = [gate | up]).
struct Fc1Pairs {
  uint32_t act, gate, up;
};
template <class T>
__device__ __forceinline__ Fc1Pairs fc1_pairs(float gate0, float gate1, float up0, float up1, bool weighted,
                                              float prob) {
  const float g0 = float(T(gate0)), g1 = float(T(gate1));
  const float u0 = float(T(up0)), u1 = float(T(up1));
  float a0 = swiglu_forward(g0, u0), a1 = swiglu_forward(g1, u1);
  if (weighted) {
    a0 = __fmul_rn(prob, a0);
    a1 = __fmul_rn(prob, a1);
  }
  return {pack2<T>(a0, a1), pack2<T>(g0, g1), pack2<T>(u0, u1)};
}

}  // namespace capmoe::fused
