// The fused kernels' launch: each needs more than the default 48 KB of dynamic shared memory,
// which a kernel must opt into before its launch. The opt-in holds per function and device
// context, so it is made at every launch (host work only; a captured graph does not repeat it)
// rather than cached, which a second context or a device reset would invalidate.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/boundary.cuh"
#include "common/launch.cuh"

namespace capmoe::fused {

template <class... Params, class... Args>
capmoe_status_t launch_large_smem(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem_bytes,
                                  cudaStream_t stream, Args&&... args) {
  CAPMOE_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes))));
  return launch(kernel, grid, threads, smem_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace capmoe::fused
