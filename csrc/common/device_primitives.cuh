// The few device operations that need inline PTX (programmatic dependent launch control,
// lane masks, cp.async, dynamic shared memory), kept in one place so that a kernel's logic
// can also be compiled as host C++ against the CPU emulation in tests/emulation/
// (CAPMOE_CPU_EMULATION), which supplies its own versions of exactly these.
#pragma once

#ifdef CAPMOE_CPU_EMULATION
#include "cpu_emulation.h"
#else
#include <cuda_runtime.h>

namespace capmoe {

// Blocks until every grid this launch depends on (programmatic dependent launch) has
// finished and its writes are visible; a no-op for a launch without that attribute.
__device__ inline void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the dependent launch of this grid start before this grid finishes.
__device__ inline void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// Bits of the lanes below this one in its warp.
__device__ inline unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// 16-byte asynchronous global -> shared copy (L2 only); completed by cp_async_wait_all.
__device__ inline void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Makes `v` opaque to the optimizer, so it stays one register instead of being recomputed.
__device__ inline void keep_in_register(int& v) { asm volatile("mov.b32 %0, %0;" : "+r"(v)); }

}  // namespace capmoe

// Declares `name` as the block's dynamic shared memory (16-byte aligned bytes).
#define CAPMOE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif
