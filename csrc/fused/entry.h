// The host half shared by the fused kernels' C ABI entries (fc1.cu, swiglu_dgrad.cu,
// wgrad_gather.cu): the device check and the TMA descriptor encoding.
// NOTE: build.rs defines CAPMOE_HAS_SM90 and CAPMOE_HAS_SM100 (1: this binary carries that
// arch's kernels, 0: it does not) only for TUs whose own text names them; every entry TU does,
// in its device check, so that other TUs' cached objects stay the same whatever the arch list.
#pragma once

#if !defined(CAPMOE_HAS_SM90) || !defined(CAPMOE_HAS_SM100)
#error "fused entry TUs are built by build.rs, which defines CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100"
#endif
// Whether this binary has a fused kernel for any arch (the launch code exists only then).
#define CAPMOE_FUSED_HAS_KERNEL (CAPMOE_HAS_SM90 || CAPMOE_HAS_SM100)

#include <cuda.h>
#include <cstdint>
#include <cuda_runtime.h>

#include "capturable_moe/status.h"
#include "common/boundary.cuh"
#include "common/tma_encode.h"

namespace capmoe::fused {

using capmoe::tma_encode;
using capmoe::tma_encode_fn;

// The compute capability of the current device.
inline capmoe_status_t device_compute_capability(int* major, int* minor) {
  int device = 0;
  CAPMOE_TRY(cuda_status(cudaGetDevice(&device)));
  CAPMOE_TRY(cuda_status(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device)));
  return cuda_status(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device));
}

// The archs a fused kernel can have a variant for.
enum class FusedArch { Sm90, Sm100 };

// The variant for the current device: sm_90a on compute capability 9.0, sm_100a on 10.0, each
// only when the binary has it built (the caller passes CAPMOE_HAS_SM90 / _SM100); UNSUPPORTED
// otherwise.
inline capmoe_status_t built_device_arch(bool has_sm90, bool has_sm100, FusedArch* arch) {
  int major = 0, minor = 0;
  CAPMOE_TRY(device_compute_capability(&major, &minor));
  if (has_sm90 && major == 9 && minor == 0) {
    *arch = FusedArch::Sm90;
    return CAPMOE_OK;
  }
  if (has_sm100 && major == 10 && minor == 0) {
    *arch = FusedArch::Sm100;
    return CAPMOE_OK;
  }
  return CAPMOE_ERR_UNSUPPORTED;
}

// The persistent grid for `tiles` tiles: one CTA per SM, fewer when there are fewer tiles.
inline int persistent_grid(int64_t tiles, int32_t sm_count) { return int(tiles < sm_count ? tiles : sm_count); }

// The largest extent (H for fc1 and the fc2 dgrad, capacity for the gathered wgrad) the kernels
// walk in int32 steps of at most 128 (a K block or a row block): up to here, the index one step
// past the end, and `extent + 63` in a ceiling division, still fit in int32. Past it they would
// wrap, which in the wgrad's producer means a hang.
constexpr int64_t kMaxSteppedExtent = INT32_MAX - 128;

// Whether the kernels' persistent loop (`tile = blockIdx.x; tile < tiles; tile += gridDim.x`)
// keeps in int every index it computes, the last being up to tiles - 1 + grid.
inline bool persistent_loop_fits_int(int64_t tiles, int32_t sm_count) {
  return tiles <= INT32_MAX && tiles - 1 + persistent_grid(tiles, sm_count) <= INT32_MAX;
}

}  // namespace capmoe::fused
