// Epilogue pieces the fused kernels share (fc1_sm90.cu, wgrad_gather_sm90.cu).
#pragma once

#include <cstdint>

namespace capmoe::fused {

// Two fp32 values rounded to the 16-bit type T (bf16 / f16), packed low first: one 32-bit
// store of two adjacent columns.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(T(lo).raw()) | (uint32_t(T(hi).raw()) << 16);
}

}  // namespace capmoe::fused
