// Short kernels as programmatic dependent launches (PDL) of the kernel before them on the
// stream: the routing kernels and the GEMM's argument kernel. Each starts with
// begin_dependent_kernel(), so a chain of them overlaps every launch with the kernel before it
// (a few microseconds a boundary, most of a decode-sized kernel's time).
#pragma once

#include <utility>

#include "common/device_primitives.cuh"
#include "common/launch.cuh"

namespace capmoe {

// The first statement of every kernel that launch_dependent launches: waits until the grid
// before it has finished and its writes are visible (nothing, not even the device token count,
// is read earlier), then lets the launch after it start its blocks, which wait the same way.
__device__ inline void begin_dependent_kernel() {
  grid_dependency_wait();
  launch_dependents();
}

// Whether launch_dependent launches programmatic dependents at all. CAPMOE_ROUTING_PDL=0 in
// the environment (read once per process) makes them ordinary launches, whose
// begin_dependent_kernel is then a no-op: a diagnostic switch, and an A/B of one build.
inline bool routing_pdl_enabled() {
  static const bool enabled = env_switch_on("CAPMOE_ROUTING_PDL");
  return enabled;
}

// launch() (launch.cuh) as a programmatic dependent of the kernel before it: its blocks may
// start while that kernel still runs. Only for kernels whose first statement is
// begin_dependent_kernel(): a global access before it could race with the kernel before
// (tests/source_rules.rs reads every kernel passed here and checks that).
template <class... Params, class... Args>
capmoe_status_t launch_dependent(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem_bytes,
                                 cudaStream_t stream, Args&&... args) {
  return launch_programmatic(routing_pdl_enabled(), kernel, grid, threads, smem_bytes, stream,
                             std::forward<Args>(args)...);
}

}  // namespace capmoe
