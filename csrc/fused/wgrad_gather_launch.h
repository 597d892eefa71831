// The seam between the gathered wgrad's C ABI entry (csrc/fused/wgrad_gather.cu, built for
// every arch) and its kernel TUs (csrc/fused/wgrad_gather_sm90.cu, sm_90a, and
// csrc/fused/wgrad_gather_sm100.cu, sm_100a): both take the same parameters.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "capturable_moe/wgrad_gather.h"

namespace capmoe::fused {

struct WgradGatherParams {
  const void* a;  // [capacity or max_tokens, M]
  const void* b;  // [capacity or max_tokens, N]
  const int64_t* offsets;
  const int32_t* token_of_row;  // may be null when neither operand is gathered
  void* dw;                     // [E, M, N]
  int32_t experts, m, n, capacity, max_tokens;
  int32_t a_gathered, b_gathered;  // 1: row r reads token_of_row[r]
  int32_t accumulate;              // F32 output only
  int32_t m_tiles, n_tiles;        // tiles of one expert's dW
  int32_t* schedule;               // CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS (the counter form's tile counter)
};

// Launches the sm_90a kernel on `grid` persistent CTAs (wgrad_gather_sm90.cu): the gathered
// counter wgrad (grouped_gemm/counter_wgrad_gather.h) where it applies, else the strided one.
capmoe_status_t launch_wgrad_gather_sm90(const WgradGatherParams& params, capmoe_dtype_t dtype,
                                         capmoe_dtype_t out_dtype, int grid, cudaStream_t stream);

// The same on the sm_100a kernel (wgrad_gather_sm100.cu, compiled only: never run).
capmoe_status_t launch_wgrad_gather_sm100(const WgradGatherParams& params, capmoe_dtype_t dtype,
                                          capmoe_dtype_t out_dtype, int grid, cudaStream_t stream);

}  // namespace capmoe::fused
