// Grouped GEMM over experts with device-side m_splits: the arch-independent half.
//
// Computes, for every expert e, the op named in capmoe_grouped_gemm_desc_t (see
// capturable_moe/grouped_gemm.h for the layout contract). The host never sees m_splits:
//   1. write_arguments (one block) turns m_splits into clamped 64-bit row offsets and writes
//      CUTLASS's per-group problem sizes, A/B/C/D pointers and strides into the workspace;
//   2. the CUTLASS pointer-array grouped GEMM runs with host problem shapes = nullptr, so its
//      persistent tile scheduler reads the sizes on the device;
//   3. (WGRAD, plain mode only) zero_empty_experts writes dW_e = 0 for experts with no rows.
// Every step is an asynchronous launch on the caller's stream: no allocation, no host sync.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/boundary.cuh"
#include "grouped_gemm/launch.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace capmoe::gg {

constexpr int kArgumentThreads = 1024;
constexpr uint64_t kSectionAlign = 256;

inline uint64_t align_up(uint64_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

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
};

template <class Arrays>
struct ArgumentParams {
  Arrays arrays;
  const void* m_splits;
  bool splits_are_i64;
  int32_t op;
  bool weights_as_pointers;
  bool weights_transposed;  // CAPMOE_WEIGHT_EKN
  bool accumulate;
  int64_t experts, n, k, capacity;
  const void* a;
  const void* b;
  void* d;
  int32_t* overflow_flags;
};

__device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Writes group e's problem, pointers and strides for `rows` rows starting at row `start`.
template <class Arrays>
__device__ int32_t write_group(const ArgumentParams<Arrays>& p, int64_t e, int64_t start, int64_t rows) {
  using EA = typename Arrays::ElementA;
  using EB = typename Arrays::ElementB;
  using ED = typename Arrays::ElementD;
  Arrays arr = p.arrays;
  const int n = static_cast<int>(p.n), k = static_cast<int>(p.k), m = static_cast<int>(rows);
  const int64_t matrix = p.n * p.k;
  int32_t bits = 0;

  // The per-expert matrix of the weight-shaped operand (W for FPROP/DGRAD, dW for WGRAD),
  // whose elements are `element_bytes` wide (dW may be fp32 while W is 16-bit).
  auto expert_matrix = [&](const void* base, int64_t element_bytes) -> const void* {
    if (p.weights_as_pointers) {
      const void* ptr = static_cast<const void* const*>(base)[e];
      if (ptr == nullptr) bits |= CAPMOE_OVERFLOW_NULL_POINTER;
      else if (!aligned16(ptr)) bits |= CAPMOE_OVERFLOW_MISALIGNED;
      return ptr;
    }
    return static_cast<const char*>(base) + e * matrix * element_bytes;
  };

  int gm = 0, gn = 0, gk = 0;
  const void *ptr_a = nullptr, *ptr_b = nullptr;
  void* ptr_d = nullptr;
  if (p.op == CAPMOE_GEMM_FPROP || p.op == CAPMOE_GEMM_DGRAD) {
    const bool fprop = p.op == CAPMOE_GEMM_FPROP;
    const int in_cols = fprop ? k : n, out_cols = fprop ? n : k;
    gm = m, gn = out_cols, gk = in_cols;
    ptr_a = static_cast<const EA*>(p.a) + start * in_cols;
    ptr_b = expert_matrix(p.b, sizeof(EB));
    ptr_d = static_cast<ED*>(p.d) + start * out_cols;
  } else {
    // dW_e = dY_e^T X_e; stored [N, K] (ENK) or, transposed, [K, N] = X_e^T dY_e (EKN).
    const void* dy = static_cast<const EA*>(p.a) + start * n;
    const void* x = static_cast<const EB*>(p.b) + start * k;
    ptr_d = const_cast<void*>(expert_matrix(p.d, sizeof(ED)));
    if (p.weights_transposed) {
      gm = k, gn = n, ptr_a = x, ptr_b = dy;
    } else {
      gm = n, gn = k, ptr_a = dy, ptr_b = x;
    }
    gk = m;
    if (m == 0) gm = gn = 0;  // no tiles: never run a mainloop of length zero
  }
  if (bits) gm = gn = gk = 0;  // a null / misaligned expert is skipped, never read through TMA

  arr.problems[e] = typename Arrays::ProblemShape(gm, gn, gk);
  arr.a[e] = static_cast<const EA*>(ptr_a);
  arr.b[e] = static_cast<const EB*>(ptr_b);
  arr.d[e] = static_cast<ED*>(ptr_d);
  // A float C (the WGRAD fp32 kernels) always points at D; beta (0 or 1) decides if it is read.
  if constexpr (std::is_void_v<typename Arrays::ElementC>) {
    arr.c[e] = nullptr;
  } else {
    arr.c[e] = static_cast<typename Arrays::CPtr>(ptr_d);
  }
  arr.stride_a[e] = cutlass::make_cute_packed_stride(typename Arrays::StrideA{}, {gm, gk, 1});
  arr.stride_b[e] = cutlass::make_cute_packed_stride(typename Arrays::StrideB{}, {gn, gk, 1});
  arr.stride_c[e] = cutlass::make_cute_packed_stride(typename Arrays::StrideC{}, {gm, gn, 1});
  arr.stride_d[e] = cutlass::make_cute_packed_stride(typename Arrays::StrideD{}, {gm, gn, 1});
  return bits;
}

// One block: each thread owns a contiguous run of experts; a block-wide exclusive scan of the
// per-thread row sums gives every expert its 64-bit start row.
template <class Arrays>
__global__ void __launch_bounds__(kArgumentThreads) write_arguments(ArgumentParams<Arrays> p) {
  using Scan = cub::BlockScan<int64_t, kArgumentThreads>;
  __shared__ typename Scan::TempStorage scan_storage;

  const int64_t per_thread = (p.experts + kArgumentThreads - 1) / kArgumentThreads;
  const int64_t first = threadIdx.x * per_thread;
  const int64_t last = min(p.experts, first + per_thread);
  int32_t bits = 0;

  // Counts are clamped to [0, capacity + 1]: anything larger overflows anyway, and the clamp
  // keeps every prefix sum far from int64 overflow.
  auto count = [&](int64_t e) -> int64_t {
    const int64_t raw = p.splits_are_i64 ? static_cast<const int64_t*>(p.m_splits)[e]
                                         : static_cast<const int32_t*>(p.m_splits)[e];
    if (raw < 0) bits |= CAPMOE_OVERFLOW_NEGATIVE;
    return min(max(raw, int64_t{0}), p.capacity + 1);
  };

  int64_t local = 0;
  for (int64_t e = first; e < last; ++e) local += count(e);
  int64_t offset = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(local, offset, total);

  for (int64_t e = first; e < last; ++e) {
    const int64_t rows = count(e);
    const int64_t start = min(offset, p.capacity);
    const int64_t end = min(offset + rows, p.capacity);
    if (offset + rows > p.capacity) bits |= CAPMOE_OVERFLOW_CAPACITY;
    p.arrays.row_offsets[e] = start;
    bits |= write_group(p, e, start, end - start);
    offset += rows;
  }
  if (threadIdx.x == 0) p.arrays.row_offsets[p.experts] = min(total, p.capacity);
  if (bits && p.overflow_flags) atomicOr(p.overflow_flags, bits);
}

// WGRAD plain mode: dW_e = 0 for every expert that received no rows (the GEMM skips them).
template <class ElementD>
__global__ void zero_empty_experts(const int64_t* row_offsets, void* d, bool d_is_pointer_array,
                                   int64_t elements_per_expert) {
  const int64_t e = blockIdx.y;
  if (row_offsets[e + 1] != row_offsets[e]) return;
  ElementD* out = d_is_pointer_array ? static_cast<ElementD* const*>(d)[e]
                                     : static_cast<ElementD*>(d) + e * elements_per_expert;
  if (out == nullptr || !aligned16(out)) return;  // flagged by write_arguments
  constexpr int kVec = 16 / sizeof(ElementD);
  const int64_t vectors = elements_per_expert / kVec;  // N*K is a multiple of 8 (host-checked)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += int64_t(gridDim.x) * blockDim.x) {
    reinterpret_cast<uint4*>(out)[i] = make_uint4(0, 0, 0, 0);
  }
}

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
    ArgumentParams<Arrays> params{arr,
                                  launch.m_splits,
                                  desc.split_dtype == CAPMOE_DTYPE_I64,
                                  desc.op,
                                  desc.weights_as_pointers != 0,
                                  desc.weight_layout == CAPMOE_WEIGHT_EKN,
                                  desc.accumulate != 0,
                                  desc.num_experts,
                                  desc.n,
                                  desc.k,
                                  desc.capacity,
                                  launch.a,
                                  launch.b,
                                  launch.d,
                                  launch.overflow_flags};
    write_arguments<Arrays><<<1, kArgumentThreads, 0, launch.stream>>>(params);
    CAPMOE_TRY(launch_status());

    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return CAPMOE_ERR_CUTLASS;
    if (gemm.initialize(args, arr.cutlass_workspace, launch.stream) != cutlass::Status::kSuccess) {
      return CAPMOE_ERR_CUTLASS;
    }
    if (gemm.run(launch.stream) != cutlass::Status::kSuccess) return CAPMOE_ERR_CUTLASS;
    CAPMOE_TRY(launch_status());

    if (desc.op == CAPMOE_GEMM_WGRAD && !desc.accumulate) {
      const int64_t elements = desc.n * desc.k;
      const int64_t vectors = elements / (16 / sizeof(typename Arrays::ElementD));
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>((vectors + 255) / 256, 64)),
                      static_cast<unsigned>(desc.num_experts));
      zero_empty_experts<typename Arrays::ElementD>
          <<<grid, 256, 0, launch.stream>>>(arr.row_offsets, launch.d, desc.weights_as_pointers != 0, elements);
      CAPMOE_TRY(launch_status());
    }
    return CAPMOE_OK;
  }
};

}  // namespace capmoe::gg
