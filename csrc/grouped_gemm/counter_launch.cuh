// What the two hand-written SM90_COUNTER kernels (sm90_counter.cu: fprop / dgrad,
// sm90_counter_wgrad.cu: wgrad) share on the host side: the argument arrays the argument kernel
// fills for them, their workspace, and their launch as its programmatic dependent.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/boundary.cuh"
#include "fused/tile_schedule.cuh"
#include "grouped_gemm/arguments.cuh"
#include "grouped_gemm/dependent_launch.cuh"
#include "grouped_gemm/launch.h"

namespace capmoe::gg::counter {

// The argument arrays of these variants: the row offsets and the tile counter; no per-expert
// problem sizes or pointers (the kernels derive them from the offsets).
template <class T>
struct CounterArrays {
  using ElementA = T;
  using ElementB = T;
  using ElementD = T;
  int64_t* row_offsets;
  int32_t* schedule;
  // Called once per expert by the thread that owns it; the owner of expert 0 also zeroes the
  // tile counter, so that every launch starts from tile 0 whatever the workspace held.
  __device__ void store(int64_t e, const Group&) const {
    if (e == 0) {
      for (int i = 0; i < fused::TileSchedule::kWords; ++i) schedule[i] = 0;
    }
  }
};

// The workspace: the E + 1 row offsets, then the counter's words.
struct Workspace {
  int64_t* row_offsets;
  int32_t* schedule;
  static uint64_t offsets_bytes(int64_t experts) { return align_up(uint64_t(experts + 1) * sizeof(int64_t)); }
  static uint64_t bytes(int64_t experts) {
    return offsets_bytes(experts) + align_up(fused::TileSchedule::kWords * sizeof(int32_t));
  }
  static Workspace carve(void* base, int64_t experts) {
    char* p = static_cast<char*>(base);
    return {reinterpret_cast<int64_t*>(p), reinterpret_cast<int32_t*>(p + offsets_bytes(experts))};
  }
};

// The argument kernel of a counter variant over `ws`, for the descriptor and operands of `launch`.
template <class T>
capmoe_status_t launch_counter_arguments(const Launch& launch, const Workspace& ws) {
  const capmoe_grouped_gemm_desc_t& d = *launch.desc;
  ArgumentParams<CounterArrays<T>> args{CounterArrays<T>{ws.row_offsets, ws.schedule},
                                        launch.m_splits,
                                        d.split_dtype == CAPMOE_DTYPE_I64,
                                        d.op,
                                        false,
                                        d.weight_layout == CAPMOE_WEIGHT_EKN,
                                        d.num_experts,
                                        d.n,
                                        d.k,
                                        d.capacity,
                                        launch.a,
                                        launch.b,
                                        launch.d,
                                        launch.overflow_flags};
  return launch_write_arguments(args, launch.stream);
}

// A counter kernel of `threads` threads and `smem_bytes` of dynamic shared memory, launched as
// the programmatic dependent of the argument kernel before it (unless CAPMOE_GEMM_PDL=0).
template <class Params>
capmoe_status_t launch_counter_kernel(void (*kernel)(Params), const Params& params, int grid, int threads,
                                      size_t smem_bytes, cudaStream_t stream) {
  CAPMOE_TRY(cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes))));
  return launch_programmatic(gemm_pdl_enabled(), kernel, grid, threads, smem_bytes, stream, params);
}

}  // namespace capmoe::gg::counter
