// The seam between the fused fc2 dgrad + SwiGLU backward C ABI entry (csrc/fused/swiglu_dgrad.cu,
// built for every arch) and its kernel TUs (csrc/fused/swiglu_dgrad_sm90.cu, sm_90a, and
// csrc/fused/swiglu_dgrad_sm100.cu, sm_100a): the kernel parameters, with the TMA descriptors
// already encoded on the host (both kernels read the same maps).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "capturable_moe/fused.h"

namespace capmoe::fused {

// Tile rows of the kernel (its columns: CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N).
constexpr int kSwigluDgradTileM = 128;

// Both forms' parameters: the drows form reads drows_map and may write dact; the gathered
// form reads dy / token_of_row / prob_of_row and writes dprob_partials (drows_map left zero).
struct SwigluDgradParams {
  CUtensorMap drows_map;  // drows [capacity, H]: box 64 columns x 128 rows, 128B swizzle
  CUtensorMap w2_map;     // w2 [E, H, F] as dims (F, H, E): box 64 x 64 x 1, 128B swizzle
  const int64_t* offsets;
  const void* h;  // [capacity, 2F]
  void* dh;       // [capacity, 2F]
  void* dact;     // [capacity, F], may be null (drows form only)
  int32_t experts, hidden, ffn, capacity;
  // [CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS], both forms: the tile counter of the sm_90a kernel
  // (fused/tile_schedule.cuh; zero at launch, zero again after it). The sm_100a kernel does not
  // use it.
  int32_t* schedule;
  // The gathered form only (last, so the drows form's parameter offsets are as before):
  int32_t max_tokens;
  const void* dy;               // [max_tokens, H], token order
  const int32_t* token_of_row;  // [capacity]
  const float* prob_of_row;     // [capacity]
  float* dprob_partials;        // [capacity, F / CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N]
};

// Launches the sm_90a kernel on `grid` persistent CTAs (swiglu_dgrad_sm90.cu): A = drows by
// TMA, or (gathered) A = dy rows through token_of_row by cp.async, prob-weighted.
capmoe_status_t launch_swiglu_dgrad_sm90(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                         cudaStream_t stream);
capmoe_status_t launch_swiglu_dgrad_gathered_sm90(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                                  cudaStream_t stream);

// The same two forms on the sm_100a kernel (swiglu_dgrad_sm100.cu, compiled only: never run).
capmoe_status_t launch_swiglu_dgrad_sm100(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                          cudaStream_t stream);
capmoe_status_t launch_swiglu_dgrad_gathered_sm100(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                                   cudaStream_t stream);

}  // namespace capmoe::fused
