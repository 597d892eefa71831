// Grouped GEMM over experts with device-side m_splits: the arch-independent half.
//
// Computes, for every expert e, the op named in capmoe_grouped_gemm_desc_t (see
// capturable_moe/grouped_gemm.h for the layout contract). The host never sees m_splits:
//   1. write_arguments (one block) turns m_splits into clamped 64-bit row offsets and writes
//      CUTLASS's per-group problem sizes, A/B/C/D pointers and strides into the workspace;
//   2. the CUTLASS pointer-array grouped GEMM runs with host problem shapes = nullptr, so its
//      persistent tile scheduler reads the sizes on the device. It is a programmatic dependent
//      launch of step 1 on both archs (grouped_gemm/dependent_launch.cuh): its CTAs become
//      resident while the argument kernel runs and wait for it before reading anything, so the
//      few microseconds of that serial one-block kernel overlap the GEMM's launch instead of
//      preceding it;
//   3. (WGRAD, plain mode only) zero_empty_experts writes dW_e = 0 for experts with no rows.
// Every step is an asynchronous launch on the caller's stream: no allocation, no host sync.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/boundary.cuh"
#include "grouped_gemm/arguments.cuh"
#include "grouped_gemm/dependent_launch.cuh"
#include "grouped_gemm/launch.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace capmoe::gg {


// The argument arrays CUTLASS reads, as typed pointers into the workspace.
template <class Gemm>
struct ArgumentArrays {
  using Kernel = typename Gemm::GemmKernel;
  using ProblemShape = typename Kernel::ProblemShape::UnderlyingProblemShape;
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementC = typename Gemm::ElementC;
  using ElementD = typename Gemm::ElementD;
  using CPtr = std::conditional_t<std::is_void_v<ElementC>, const void*, const ElementC*>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  ProblemShape* problems;
  const ElementA** a;
  const ElementB** b;
  CPtr* c;
  ElementD** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  int64_t* row_offsets;  // E + 1 clamped starts; row_offsets[E] = min(total, capacity)
  void* cutlass_workspace;

  // Carves the arrays out of `base` (nullptr: only measures). Returns the bytes used.
  uint64_t carve(void* base, int64_t experts) {
    uint64_t used = 0;
    auto take = [&](auto*& field, uint64_t count) {
      using T = std::remove_reference_t<decltype(*field)>;
      field = base ? reinterpret_cast<T*>(static_cast<char*>(base) + used) : nullptr;
      used += align_up(count * sizeof(T));
    };
    take(problems, experts);
    take(a, experts);
    take(b, experts);
    take(c, experts);
    take(d, experts);
    take(stride_a, experts);
    take(stride_b, experts);
    take(stride_c, experts);
    take(stride_d, experts);
    take(row_offsets, experts + 1);
    cutlass_workspace = base ? static_cast<char*>(base) + used : nullptr;
    return used;
  }

  // Group e's problem size, pointers and packed strides (write_group in arguments.cuh).
  __device__ void store(int64_t e, const Group& g) const {
    problems[e] = ProblemShape(g.m, g.n, g.k);
    a[e] = static_cast<const ElementA*>(g.a);
    b[e] = static_cast<const ElementB*>(g.b);
    d[e] = static_cast<ElementD*>(g.d);
    // A float C (the WGRAD fp32 kernels) always points at D; beta (0 or 1) decides if it is read.
    if constexpr (std::is_void_v<ElementC>) {
      c[e] = nullptr;
    } else {
      c[e] = static_cast<CPtr>(g.d);
    }
    stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, {g.m, g.k, 1});
    stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, {g.n, g.k, 1});
    stride_c[e] = cutlass::make_cute_packed_stride(StrideC{}, {g.m, g.n, 1});
    stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, {g.m, g.n, 1});
  }
};

// The shared launch sequence; `Traits` supplies the CUTLASS Gemm type and its hardware info.
template <class Traits>
struct Runner {
  using Gemm = typename Traits::Gemm;
  using Arrays = ArgumentArrays<Gemm>;

  static typename Gemm::Arguments cutlass_arguments(const Launch& launch, Arrays& arr) {
    const auto& desc = *launch.desc;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(desc.num_experts), arr.problems, nullptr};
    args.mainloop.ptr_A = arr.a;
    args.mainloop.dA = arr.stride_a;
    args.mainloop.ptr_B = arr.b;
    args.mainloop.dB = arr.stride_b;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = desc.accumulate ? 1.0f : 0.0f;
    args.epilogue.ptr_C = arr.c;
    args.epilogue.dC = arr.stride_c;
    args.epilogue.ptr_D = arr.d;
    args.epilogue.dD = arr.stride_d;
    args.hw_info = Traits::hardware_info(desc.sm_count);
    return args;
  }

  static capmoe_status_t run(const Launch& launch, uint64_t* workspace_bytes) {
    const auto& desc = *launch.desc;
    Arrays arr{};
    const uint64_t own = arr.carve(nullptr, desc.num_experts);
    auto args = cutlass_arguments(launch, arr);
    const uint64_t need = own + align_up(Gemm::get_workspace_size(args));
    if (workspace_bytes) {
      *workspace_bytes = need;
      return CAPMOE_OK;
    }
    if (launch.workspace_bytes < need) return CAPMOE_ERR_WORKSPACE_TOO_SMALL;

    // Start from a clean error state so launch_status() reports only this launch's errors.
    (void)cudaGetLastError();
    arr.carve(launch.workspace, desc.num_experts);
    args = cutlass_arguments(launch, arr);
    // Host-side checks and preparation (problem sizes live on the device), all before anything
    // is launched: a failure here must not leave the argument kernel alone on the stream (or in
    // a graph being captured) without its GEMM. (Only a refused launch of the GEMM itself, next,
    // still can: no launch can be taken back.)
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return CAPMOE_ERR_CUTLASS;
    typename Gemm::GemmKernel::Params kernel_params;
    CAPMOE_TRY(prepare_dependent_launch<Gemm>(args, arr.cutlass_workspace, launch.stream, &kernel_params));
    ArgumentParams<Arrays> params{arr,
                                  launch.m_splits,
                                  desc.split_dtype == CAPMOE_DTYPE_I64,
                                  desc.op,
                                  desc.weights_as_pointers != 0,
                                  desc.weight_layout == CAPMOE_WEIGHT_EKN,
                                  desc.num_experts,
                                  desc.n,
                                  desc.k,
                                  desc.capacity,
                                  launch.a,
                                  launch.b,
                                  launch.d,
                                  launch.overflow_flags};
    CAPMOE_TRY(launch_write_arguments(params, launch.stream));

    // The kernel, right behind the argument kernel it depends on (each arch's own way). The
    // launch's CUDA error is read (and so cleared) whatever the outcome: SM100's cluster
    // launcher reports only a CUTLASS status, and a refused launch must not stay pending for
    // the caller's next cudaGetLastError.
    const capmoe_status_t launched = Traits::launch(kernel_params, launch.stream);
    const capmoe_status_t pending = launch_status();
    CAPMOE_TRY(pending != CAPMOE_OK ? pending : launched);

    if (desc.op == CAPMOE_GEMM_WGRAD && !desc.accumulate) {
      CAPMOE_TRY(launch_zero_empty_experts<typename Arrays::ElementD>(
          arr.row_offsets, launch.d, desc.weights_as_pointers != 0, desc.num_experts, desc.n * desc.k, launch.stream));
    }
    return CAPMOE_OK;
  }
};

}  // namespace capmoe::gg
