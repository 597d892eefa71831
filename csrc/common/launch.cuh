// One way to launch a kernel from a C ABI entry point: through cudaLaunchKernelEx, which the CPU
// emulation of tests/emulation/ can run (it has no <<<>>>), returning a capmoe_status_t.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/boundary.cuh"

namespace capmoe {

// kernel<<<grid, threads, smem_bytes, stream>>>(args...); blocks are one-dimensional.
template <class... Params, class... Args>
capmoe_status_t launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem_bytes,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = dim3(threads);
  c.dynamicSmemBytes = smem_bytes;
  c.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&c, kernel, std::forward<Args>(args)...));
}

}  // namespace capmoe
