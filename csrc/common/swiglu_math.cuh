// The SwiGLU formulas, in one place for every kernel that applies them: the routing SwiGLU
// pass (csrc/routing/swiglu.cu) and the fused kernels' epilogues (csrc/fused/). With
// g = gate, u = up, s = sigmoid(g):
//   forward   act = g * s * u
//   backward  dg = dact * u * s * (1 + g * (1 - s)),  du = dact * g * s
// Every fp32 operation is rounded on its own (the _rn intrinsics are never contracted into
// FMAs), so the fused and the unfused paths give the same bits from the same inputs whatever
// code the compiler inlines them into.
#pragma once

#include <cuda_runtime.h>

namespace capmoe {

__device__ __forceinline__ float swiglu_sigmoid(float g) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, __expf(-g))); }

__device__ __forceinline__ float swiglu_forward(float g, float u) {
  return __fmul_rn(__fmul_rn(g, swiglu_sigmoid(g)), u);
}

// (dg, du) for one element.
__device__ __forceinline__ void swiglu_backward(float dact, float g, float u, float& dg, float& du) {
  const float s = swiglu_sigmoid(g);
  const float slope = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s)));
  dg = __fmul_rn(__fmul_rn(__fmul_rn(dact, u), s), slope);
  du = __fmul_rn(__fmul_rn(dact, g), s);
}

}  // namespace capmoe
