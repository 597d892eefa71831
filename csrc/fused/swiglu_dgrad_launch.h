// The seam between the fused fc2 dgrad + SwiGLU backward C ABI entry (csrc/fused/swiglu_dgrad.cu,
// built for every arch) and its sm_90a kernel TU (csrc/fused/swiglu_dgrad_sm90.cu): the kernel
// parameters, with the TMA descriptors already encoded on the host.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "capturable_moe/fused.h"

namespace capmoe::fused {

// Tile rows of the kernel (its columns: CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N).
constexpr int kSwigluDgradTileM = 128;

struct SwigluDgradParams {
  CUtensorMap drows_map;  // drows [capacity, H]: box 64 columns x 128 rows, 128B swizzle
  CUtensorMap w2_map;     // w2 [E, H, F] as dims (F, H, E): box 64 x 64 x 1, 128B swizzle
  const int64_t* offsets;
  const void* h;  // [capacity, 2F]
  void* dh;       // [capacity, 2F]
  void* dact;     // [capacity, F], may be null
  int32_t experts, hidden, ffn, capacity;
};

// Launches the sm_90a kernel on `grid` persistent CTAs (swiglu_dgrad_sm90.cu).
capmoe_status_t launch_swiglu_dgrad_sm90(const SwigluDgradParams& params, capmoe_dtype_t dtype, int grid,
                                         cudaStream_t stream);

}  // namespace capmoe::fused
