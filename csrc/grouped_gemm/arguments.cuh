// The argument kernel of the grouped GEMM and the WGRAD zero fill: the device-side half of the
// plan that never leaves the GPU. Free of CUTLASS (the argument arrays, which know CUTLASS's
// problem-shape and stride types, come in as the template parameter `Arrays`), so that
// tests/grouped_gemm_emulated.rs can run it as host C++ under the CPU emulation.
//
// `Arrays` provides: the element types ElementA, ElementB, ElementD (A/B/D as CUTLASS sees
// them: for WGRAD, A = dY or X and B = X or dY), a device array `int64_t* row_offsets` of
// E + 1 entries, and `__device__ void store(int64_t e, const Group&) const`, which writes group
// e's problem size, pointers and strides.
#pragma once

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "capturable_moe/grouped_gemm.h"
#include "common/dependent_kernel.cuh"
#include "common/device_primitives.cuh"
#include "common/launch.cuh"

namespace capmoe::gg {

// Sections of a variant's workspace start on 256-byte boundaries.
constexpr uint64_t kSectionAlign = 256;

inline uint64_t align_up(uint64_t bytes) { return (bytes + kSectionAlign - 1) / kSectionAlign * kSectionAlign; }

constexpr int kArgumentThreads = 1024;
constexpr int kZeroThreads = 256;
constexpr int64_t kMaxZeroBlocksPerExpert = 64;

// One expert's GEMM as CUTLASS runs it: D (m x n) = A (m x k) * B^T, with B stored n x k.
struct Group {
  int m, n, k;
  const void* a;
  const void* b;
  void* d;
};

template <class Arrays>
struct ArgumentParams {
  Arrays arrays;
  const void* m_splits;
  bool splits_are_i64;
  int32_t op;
  bool weights_as_pointers;
  bool weights_transposed;  // CAPMOE_WEIGHT_EKN
  int64_t experts, n, k, capacity;
  const void* a;
  const void* b;
  void* d;
  int32_t* overflow_flags;
};

__device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The per-expert matrix `e` of the weight-shaped operand (W for FPROP/DGRAD, dW for WGRAD),
// whose elements are `element_bytes` wide (dW may be fp32 while W is 16-bit). A null or
// misaligned per-expert pointer sets its overflow bit in `bits`.
template <class Arrays>
__device__ const void* expert_matrix(const ArgumentParams<Arrays>& p, const void* base, int64_t e,
                                     int64_t element_bytes, int32_t& bits) {
  if (!p.weights_as_pointers) return static_cast<const char*>(base) + e * p.n * p.k * element_bytes;
  const void* ptr = static_cast<const void* const*>(base)[e];
  if (ptr == nullptr) bits |= CAPMOE_OVERFLOW_NULL_POINTER;
  else if (!aligned16(ptr)) bits |= CAPMOE_OVERFLOW_MISALIGNED;
  return ptr;
}

// Group e of the op for `rows` rows starting at row `start`; returns the overflow bits.
template <class Arrays>
__device__ int32_t write_group(const ArgumentParams<Arrays>& p, int64_t e, int64_t start, int64_t rows) {
  using EA = typename Arrays::ElementA;
  using EB = typename Arrays::ElementB;
  using ED = typename Arrays::ElementD;
  const int n = static_cast<int>(p.n), k = static_cast<int>(p.k), m = static_cast<int>(rows);
  int32_t bits = 0;
  Group g{};
  if (p.op == CAPMOE_GEMM_FPROP || p.op == CAPMOE_GEMM_DGRAD) {
    const bool fprop = p.op == CAPMOE_GEMM_FPROP;
    const int in_cols = fprop ? k : n, out_cols = fprop ? n : k;
    g = Group{m, out_cols, in_cols, static_cast<const EA*>(p.a) + start * in_cols,
              expert_matrix(p, p.b, e, sizeof(EB), bits), static_cast<ED*>(p.d) + start * out_cols};
  } else {
    // dW_e = dY_e^T X_e; stored [N, K] (ENK) or, transposed, [K, N] = X_e^T dY_e (EKN).
    const void* dy = static_cast<const EA*>(p.a) + start * n;
    const void* x = static_cast<const EB*>(p.b) + start * k;
    void* dw = const_cast<void*>(expert_matrix(p, p.d, e, sizeof(ED), bits));
    g = p.weights_transposed ? Group{k, n, m, x, dy, dw} : Group{n, k, m, dy, x, dw};
    if (m == 0) g.m = g.n = 0;  // no tiles: never run a mainloop of length zero
  }
  if (bits) g.m = g.n = g.k = 0;  // a null / misaligned expert is skipped, never read through TMA
  p.arrays.store(e, g);
  return bits;
}

// One block: each thread owns a contiguous run of experts; a block-wide exclusive scan of the
// per-thread row sums gives every expert its 64-bit start row.
template <class Arrays>
__global__ void __launch_bounds__(kArgumentThreads) write_arguments(ArgumentParams<Arrays> p) {
  using Scan = cub::BlockScan<int64_t, kArgumentThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  // Launched as a programmatic dependent of the routing kernel before it, and the GEMM that
  // reads these arguments as one of this kernel (it waits for it to finish): let the GEMM
  // become resident now.
  begin_dependent_kernel();

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
// `blocks_per_expert` consecutive blocks share expert blockIdx.x / blocks_per_expert.
template <class ElementD>
__global__ void __launch_bounds__(kZeroThreads)
    zero_empty_experts(const int64_t* row_offsets, void* d, bool d_is_pointer_array, int64_t elements_per_expert,
                       int blocks_per_expert) {
  const int64_t e = blockIdx.x / blocks_per_expert;
  if (row_offsets[e + 1] != row_offsets[e]) return;
  ElementD* out = d_is_pointer_array ? static_cast<ElementD* const*>(d)[e]
                                     : static_cast<ElementD*>(d) + e * elements_per_expert;
  if (out == nullptr || !aligned16(out)) return;  // flagged by write_arguments
  constexpr int kVec = 16 / sizeof(ElementD);
  const int64_t vectors = elements_per_expert / kVec;  // N*K is a multiple of 8 (host-checked)
  const int64_t stride = int64_t(blocks_per_expert) * blockDim.x;
  for (int64_t i = (blockIdx.x % blocks_per_expert) * int64_t(blockDim.x) + threadIdx.x; i < vectors; i += stride) {
    reinterpret_cast<uint4*>(out)[i] = make_uint4(0, 0, 0, 0);
  }
}

template <class Arrays>
capmoe_status_t launch_write_arguments(const ArgumentParams<Arrays>& params, cudaStream_t stream) {
  return launch_dependent(write_arguments<Arrays>, 1, kArgumentThreads, 0, stream, params);
}

// The WGRAD zero fill after the GEMM; `row_offsets` as write_arguments left them.
template <class ElementD>
capmoe_status_t launch_zero_empty_experts(const int64_t* row_offsets, void* d, bool d_is_pointer_array,
                                          int64_t experts, int64_t elements_per_expert, cudaStream_t stream) {
  const int64_t vectors = elements_per_expert / (16 / sizeof(ElementD));
  const int64_t per_expert = std::min<int64_t>((vectors + kZeroThreads - 1) / kZeroThreads, kMaxZeroBlocksPerExpert);
  const int blocks_per_expert = static_cast<int>(std::max<int64_t>(per_expert, 1));
  // experts <= 65535 (host-checked), so the grid stays below 2^22 blocks.
  return launch(zero_empty_experts<ElementD>, static_cast<unsigned>(experts * blocks_per_expert), kZeroThreads, 0,
                stream, row_offsets, d, d_is_pointer_array, elements_per_expert, blocks_per_expert);
}

}  // namespace capmoe::gg
