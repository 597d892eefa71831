// The grouped GEMM as a programmatic dependent launch (PDL) of the argument kernel, on both
// archs: its CTAs become resident (and get their shared memory) while the one-block argument
// kernel still runs, so that kernel's few microseconds overlap the GEMM's launch.
#pragma once

#include <cuda_runtime.h>

#include "common/boundary.cuh"
#include "common/device_primitives.cuh"
#include "common/launch.cuh"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"  // CUTLASS_GRID_CONSTANT

namespace capmoe::gg {

// CUTLASS's pointer-array kernels cannot be launched as dependents as they are: the SM90 ones
// never wait on a programmatic dependency, and the SM100 one (4.2) reads its first work tile
// and that group's problem shape before its wait, which are exactly what the argument kernel
// writes. This entry waits first, then runs the kernel unchanged, so nothing (problem sizes,
// pointers, operands) is read before the argument kernel has finished and its writes are
// visible. (sanitize.sh and gpu-sweep.sh find it by the name `dependent_gemm_kernel`.)
template <class Kernel>
__global__ void __launch_bounds__(Kernel::MaxThreadsPerBlock, Kernel::MinBlocksPerMultiprocessor)
    dependent_gemm_kernel(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
  extern __shared__ char smem[];
  capmoe::grid_dependency_wait();
  Kernel op;
  op(params, smem);
}

// Whether the GEMM is launched as a dependent at all. CAPMOE_GEMM_PDL=0 in the environment
// (read once per process) makes it an ordinary launch, which waits for the argument kernel to
// finish as any stream order does, and the entry's wait a no-op: a diagnostic switch, so that
// one GPU run can tell a fault of the programmatic launch from one of the kernel.
inline bool gemm_pdl_enabled() {
  static const bool enabled = env_switch_on("CAPMOE_GEMM_PDL");
  return enabled;
}

// CUTLASS's GemmUniversalAdapter::initialize (4.2, no CUDA host adapter) is exactly
// Kernel::initialize_workspace + Kernel::to_underlying_arguments + the dynamic shared-memory
// attribute of CUTLASS's own entry `device_kernel<Kernel>`. That entry is never launched here,
// so the first two are called directly and the attribute is set on dependent_gemm_kernel
// instead (`device_kernel<Kernel>` is then not compiled at all). The attribute is set on every
// launch (a cheap host call, legal during capture) rather than cached, so a new context or a
// device reset never finds it missing.
template <class Gemm>
capmoe_status_t prepare_dependent_launch(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream,
                                         typename Gemm::GemmKernel::Params* params) {
  using Kernel = typename Gemm::GemmKernel;
  if (Kernel::initialize_workspace(args, workspace, stream, nullptr) != cutlass::Status::kSuccess) {
    return CAPMOE_ERR_CUTLASS;
  }
  *params = Kernel::to_underlying_arguments(args, workspace);
  return cuda_status(cudaFuncSetAttribute(&dependent_gemm_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          Kernel::SharedStorageSize));
}

}  // namespace capmoe::gg
