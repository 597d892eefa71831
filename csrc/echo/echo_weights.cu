// capmoe-archs: 90a 100a
//
// Spare-slot weights on one GPU (Echo, spec echo-planner.md section 4 "Consumers of M"):
//   fill_kernel: spare[i] = home[slot_expert[slot_begin + i]] for every local slot i with a home
//     expert (byte copy of bytes_per_expert per slot; slots with -1 untouched).
//   fold_kernel: dw_home[e] += sum of dw_slot[j] over the slots j with slot_expert[j] == e,
//     fp32, accumulated onto the existing value in ascending j (bitwise deterministic).
//
// Layout contract: home [E, bytes_per_expert] bytes, spare [num_slots, bytes_per_expert] bytes;
// dw_home [E, elems_per_expert] f32, dw_slot [num_slots, elems_per_expert] f32; slot_expert
// int64 (the plan state's slot_expert section works as is). grid.y = slot; grid.x strides
// over the bytes / elements of one expert.
#include <cuda_runtime.h>
#include <stdint.h>

#include "capturable_moe/echo.h"
#include "common/alignment.h"
#include "common/boundary.cuh"
#include "common/device_primitives.cuh"
#include "common/launch.cuh"

namespace capmoe {
namespace echo {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSlots = CAPMOE_ECHO_MAX_WEIGHT_SLOTS;  // the fold lists <= 32 KB of slots in smem

__device__ inline void flag(int64_t* error_flags, int bits) {
  if (error_flags)
    atomicOr(reinterpret_cast<unsigned long long*>(error_flags), (unsigned long long)bits);
}

__global__ void __launch_bounds__(kThreads) fill_kernel(const int64_t* slot_expert, int64_t ne,
                                                        int64_t slot_begin, const uint8_t* home,
                                                        uint8_t* spare, int64_t bytes,
                                                        bool vec16, int64_t* error_flags) {
  const int64_t i = blockIdx.y;
  const int64_t e = slot_expert[slot_begin + i];
  if (e == -1) return;
  if (e < -1 || e >= ne) {
    if (blockIdx.x == 0 && threadIdx.x == 0) flag(error_flags, CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT);
    return;
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t start = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec16) {
    const uint4* src = reinterpret_cast<const uint4*>(home + e * bytes);
    uint4* dst = reinterpret_cast<uint4*>(spare + i * bytes);
    for (int64_t v = start; v < bytes / 16; v += stride) dst[v] = src[v];
  } else {
    const uint8_t* src = home + e * bytes;
    uint8_t* dst = spare + i * bytes;
    for (int64_t v = start; v < bytes; v += stride) dst[v] = src[v];
  }
}

__global__ void __launch_bounds__(kThreads) fold_kernel(const int64_t* slot_expert, int64_t ne,
                                                        int64_t num_slots, const float* dw_slot,
                                                        float* dw_home, int64_t elems,
                                                        int64_t* error_flags) {
  CAPMOE_DYNAMIC_SMEM(smem);
  int32_t* s_list = reinterpret_cast<int32_t*>(smem);  // [num_slots]: this expert's slots, ascending
  __shared__ int s_count;
  const int64_t j = blockIdx.y;
  const int64_t e = slot_expert[j];
  if (e == -1) return;
  if (e < -1 || e >= ne) {
    if (blockIdx.x == 0 && threadIdx.x == 0) flag(error_flags, CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT);
    return;
  }
  // Only the block column of e's lowest slot folds e, so each dw_home element has one writer.
  if (threadIdx.x == 0) {
    int c = 0;
    for (int64_t i = 0; i < j && c >= 0; ++i)
      if (slot_expert[i] == e) c = -1;
    if (c == 0)
      for (int64_t i = j; i < num_slots; ++i)
        if (slot_expert[i] == e) s_list[c++] = (int32_t)i;
    s_count = c;
  }
  __syncthreads();
  const int count = s_count;
  if (count <= 0) return;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  float* dst = dw_home + e * elems;
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < elems; v += stride) {
    float acc = dst[v];
    for (int c = 0; c < count; ++c) acc = __fadd_rn(acc, dw_slot[(int64_t)s_list[c] * elems + v]);
    dst[v] = acc;
  }
}

unsigned grid_x(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > 1024) blocks = 1024;
  return (unsigned)(blocks < 1 ? 1 : blocks);
}

// count * bytes_each fits in int64 (every byte offset the kernels form stays below it).
bool fits(int64_t count, int64_t bytes_each) { return bytes_each == 0 || count <= INT64_MAX / bytes_each; }

}  // namespace
}  // namespace echo
}  // namespace capmoe

using namespace capmoe::echo;

extern "C" capmoe_status_t capmoe_echo_fill_spare_weights(const int64_t* slot_expert,
                                                          int64_t num_experts, int64_t slot_begin,
                                                          int64_t num_slots, const void* home,
                                                          void* spare, int64_t bytes_per_expert,
                                                          int64_t* error_flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (num_experts < 1 || slot_begin < 0 || num_slots < 0 || num_slots > kMaxSlots ||
        bytes_per_expert < 0)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    if (num_slots == 0 || bytes_per_expert == 0) return CAPMOE_OK;
    if (!slot_expert || !home || !spare) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (!fits(num_experts, bytes_per_expert) || !fits(num_slots, bytes_per_expert) ||
        slot_begin > INT64_MAX - num_slots)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {slot_expert, error_flags}));
    const bool vec16 = bytes_per_expert % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(home) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(spare) & 15) == 0;
    const int64_t work = vec16 ? bytes_per_expert / 16 : bytes_per_expert;
    return capmoe::launch(fill_kernel, dim3(grid_x(work), (unsigned)num_slots), kThreads, 0,
                          static_cast<cudaStream_t>(stream), slot_expert, num_experts, slot_begin,
                          static_cast<const uint8_t*>(home), static_cast<uint8_t*>(spare),
                          bytes_per_expert, vec16, error_flags);
  });
}

extern "C" capmoe_status_t capmoe_echo_fold_spare_grads(const int64_t* slot_expert,
                                                        int64_t num_experts, int64_t num_slots,
                                                        const float* dw_slot, float* dw_home,
                                                        int64_t elems_per_expert,
                                                        int64_t* error_flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (num_experts < 1 || num_slots < 0 || num_slots > kMaxSlots || elems_per_expert < 0)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    if (num_slots == 0 || elems_per_expert == 0) return CAPMOE_OK;
    if (!slot_expert || !dw_slot || !dw_home) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (elems_per_expert > INT64_MAX / 4 || !fits(num_experts, 4 * elems_per_expert) ||
        !fits(num_slots, 4 * elems_per_expert))
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {slot_expert, error_flags}));
    CAPMOE_TRY(capmoe::check_aligned(4, {dw_slot, dw_home}));
    const size_t smem = sizeof(int32_t) * (size_t)num_slots;  // <= 32 KB: no opt-in needed
    return capmoe::launch(fold_kernel, dim3(grid_x(elems_per_expert), (unsigned)num_slots),
                          kThreads, smem, static_cast<cudaStream_t>(stream), slot_expert,
                          num_experts, num_slots, dw_slot, dw_home, elems_per_expert, error_flags);
  });
}
