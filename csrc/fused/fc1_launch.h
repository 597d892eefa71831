// The seam between the fused fc1 C ABI entry (csrc/fused/fc1.cu, built for every arch) and its
// kernel TUs (csrc/fused/fc1_sm90.cu, fc1_sm100.cu): the kernel parameters, with the TMA
// descriptors already encoded on the host.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "capturable_moe/fused.h"

namespace capmoe::fused {

struct Fc1Params {
  CUtensorMap w1_map;  // w1 [E, 2F, H]: box 64 x TILE_N rows x 1 expert, 128B swizzle
  const void* x;       // x [T_max, H] for the cp.async gather
  const int64_t* offsets;
  const int32_t* token_of_row;
  const float* prob_of_row;  // [capacity], may be null: act unweighted
  void* act;
  void* h;     // may be null
  void* rows;  // [capacity, H], may be null: the gathered x rows (sm_90a kernel only)
  // [CAPMOE_FUSED_FC1_SCHEDULE_WORDS]: the next tile to hand out, and the CTAs done taking tiles
  // (the last one zeroes both); zero at launch. The sm_100a kernel does not use it.
  int32_t* schedule;
  int32_t experts, hidden, ffn, max_tokens, capacity;
};

// Launches the sm_90a kernel on `grid` persistent CTAs (fc1_sm90.cu).
capmoe_status_t launch_fc1_sm90(const Fc1Params& params, capmoe_dtype_t dtype, int grid, cudaStream_t stream);

// Launches the sm_100a kernel on `grid` persistent CTAs (fc1_sm100.cu).
capmoe_status_t launch_fc1_sm100(const Fc1Params& params, capmoe_dtype_t dtype, int grid, cudaStream_t stream);

}  // namespace capmoe::fused
