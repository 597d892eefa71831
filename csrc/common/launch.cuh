// One way to launch a kernel from a C ABI entry point: through cudaLaunchKernelEx, which the CPU
// emulation of tests/emulation/ can run (it has no <<<>>>), returning a capmoe_status_t; as an
// ordinary launch or as a programmatic dependent of the kernel before it on the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

#include "common/boundary.cuh"

namespace capmoe {

// An on-by-default diagnostic switch of the environment: on unless `name` is set to a value
// starting with '0' (read when called; callers keep the answer for the process).
inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || value[0] != '0';
}

// The launch attribute that makes a launch a programmatic dependent (PDL) of the kernel before it.
inline cudaLaunchAttribute programmatic_serialization() {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

// kernel<<<grid, threads, smem_bytes, stream>>>(args...) (blocks are one-dimensional), or, when
// `programmatic`, a programmatic dependent launch: its blocks may start while the kernel before
// still runs. Only for kernels that wait (griddepcontrol.wait) before their first access to
// anything the kernel before writes.
template <class... Params, class... Args>
capmoe_status_t launch_programmatic(bool programmatic, void (*kernel)(Params...), dim3 grid, unsigned threads,
                                    size_t smem_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr = programmatic_serialization();
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = dim3(threads);
  c.dynamicSmemBytes = smem_bytes;
  c.stream = stream;
  c.attrs = &attr;
  c.numAttrs = programmatic ? 1 : 0;
  return cuda_status(cudaLaunchKernelEx(&c, kernel, std::forward<Args>(args)...));
}

// An ordinary launch: stream order as <<<>>> gives it.
template <class... Params, class... Args>
capmoe_status_t launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem_bytes,
                       cudaStream_t stream, Args&&... args) {
  return launch_programmatic(false, kernel, grid, threads, smem_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace capmoe
