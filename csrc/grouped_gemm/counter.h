// What the hand-written SM90_COUNTER grouped GEMM (grouped_gemm/sm90_counter.cu) takes, as host
// facts: the dispatcher (dispatch.cu) offers the variant only where this holds, so AUTO and a
// forced config both see it. Free of CUDA and CUTLASS headers (tile_list.cuh includes neither).
#pragma once

#include <cstdint>

#include "capturable_moe/fused.h"
#include "capturable_moe/grouped_gemm.h"
#include "fused/tile_list.cuh"

namespace capmoe::gg::counter {

constexpr int kCounterTileM = 128;
constexpr int kCounterTileN = 256;
// Rows a tile may hold past its 128 (sm90_counter.cu computes them with a swapped 64 x 16 x 16
// wgmma; fused/tile_list.cuh's m_tiles_of says which experts' tiles take them).
constexpr int kCounterTailRows = 16;
// The per-expert tile list lives in shared memory, as the fused kernels' does.
constexpr int kCounterMaxExperts = CAPMOE_FUSED_MAX_EXPERTS;

// The most tiles a launch can have: every expert adds at most one partial M tile.
inline int64_t counter_max_tiles(const capmoe_grouped_gemm_desc_t& d) {
  const int64_t n_out = d.op == CAPMOE_GEMM_FPROP ? d.n : d.k;
  return fused::max_tiles(d.num_experts, d.capacity, n_out, kCounterTileM, kCounterTileN);
}

// FPROP / DGRAD with one weight tensor (no pointer array), 16-bit out, at most
// kCounterMaxExperts experts, and extents the kernel's int32 indices and TMA's strides hold
// (rows and the reduction walked in steps of at most 128, tile indices up to tiles + grid, an
// expert's matrix under TMA's 2^40-byte stride limit). Assumes a descriptor that passed
// dispatch.cu's validate().
inline bool counter_takes(const capmoe_grouped_gemm_desc_t& d) {
  if (d.op != CAPMOE_GEMM_FPROP && d.op != CAPMOE_GEMM_DGRAD) return false;
  if (d.weights_as_pointers || d.accumulate || d.out_dtype != d.dtype) return false;
  if (d.num_experts > kCounterMaxExperts) return false;
  constexpr int64_t kMaxStepped = INT32_MAX - 2 * kCounterTileM;
  if (d.capacity > kMaxStepped || d.n > kMaxStepped || d.k > kMaxStepped) return false;
  if (d.n * d.k * 2 >= (int64_t(1) << 40)) return false;
  return counter_max_tiles(d) + d.sm_count <= INT32_MAX;
}

// The WGRAD kernel (grouped_gemm/sm90_counter_wgrad.cu): 128 rows x 256 columns of dW a tile,
// every expert the same m_tiles x n_tiles tiles (those of an expert without rows write zeros).
constexpr int kCounterWgradTileM = 128;
constexpr int kCounterWgradTileN = 256;

// dW's rows and columns per expert: [N, K], or [K, N] with CAPMOE_WEIGHT_EKN.
struct CounterWgradExtent {
  int64_t rows, cols;
};
inline CounterWgradExtent counter_wgrad_extent(const capmoe_grouped_gemm_desc_t& d) {
  if (d.weight_layout == CAPMOE_WEIGHT_EKN) return {d.k, d.n};
  return {d.n, d.k};
}

inline int64_t counter_wgrad_tiles(const capmoe_grouped_gemm_desc_t& d) {
  const CounterWgradExtent dw = counter_wgrad_extent(d);
  return d.num_experts * ((dw.rows + kCounterWgradTileM - 1) / kCounterWgradTileM) *
         ((dw.cols + kCounterWgradTileN - 1) / kCounterWgradTileN);
}

// WGRAD with one dW tensor (no pointer array), 16-bit out without accumulate (fp32 dW stays
// with the CUTLASS kernel), at most kCounterMaxExperts experts, every expert's dW under TMA's
// 2^40-byte stride limit, and tile indices up to tiles + grid in int32. Assumes a descriptor
// that passed dispatch.cu's validate() (N, K < 2^31, capacity < INT32_MAX).
inline bool counter_wgrad_takes(const capmoe_grouped_gemm_desc_t& d) {
  if (d.op != CAPMOE_GEMM_WGRAD) return false;
  if (d.weights_as_pointers || d.accumulate || d.out_dtype != d.dtype) return false;
  if (d.num_experts > kCounterMaxExperts) return false;
  if (d.n * d.k * 2 >= (int64_t(1) << 40)) return false;
  return counter_wgrad_tiles(d) + d.sm_count <= INT32_MAX;
}

}  // namespace capmoe::gg::counter
