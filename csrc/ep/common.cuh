// Shared pieces of the EP TUs (csrc/ep/dispatch.cu, weights.cu): the descriptor and token-count
// checks of capturable_moe/ep.h, the device token count with the EP flag bit, the flag word.
// NOTE: the 16-byte row conversions (Vec8) and the token clamp come from routing/common.cuh,
// so an edit of routing.h recompiles these TUs too; cheaper than a second copy of Vec8.
#pragma once

#include <stdint.h>

#include "capturable_moe/ep.h"
#include "routing/common.cuh"

namespace capmoe {
namespace ep {

using routing::kFull;
using routing::kVec;
using routing::Vec8;

// Every host-checkable fact of ep.h's descriptor. The kernels index routes, columns and block
// rows with int32 and row elements with int64; these limits keep both exact.
inline capmoe_status_t check_desc(const capmoe_ep_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->ranks < 1 || d->ranks > CAPMOE_EP_MAX_RANKS) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->rank < 0 || d->rank >= d->ranks) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts % d->ranks != 0) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->spare_per_rank < 0 || d->spare_per_rank > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  // Columns (R * (L + S_per) = E + R * S_per) are int32.
  if (d->num_experts > INT32_MAX - d->ranks * d->spare_per_rank) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden < 1 || d->hidden > int64_t(kVec) * INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden % kVec != 0) return CAPMOE_ERR_MISALIGNED;
  if (d->topk < 1 || d->topk > CAPMOE_EP_MAX_TOPK) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->max_tokens < 0 || d->max_tokens > INT32_MAX / d->topk) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > INT32_MAX / d->ranks) return CAPMOE_ERR_INVALID_ARGUMENT;
  // Activation buffers ([T_max, H], [R * capacity, H]) of 16-bit elements: their bytes in int64.
  const int64_t rows = d->max_tokens > d->ranks * d->capacity ? d->max_tokens : d->ranks * d->capacity;
  if (rows > 0 && d->hidden > INT64_MAX / 2 / rows) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  return CAPMOE_OK;
}

inline capmoe_status_t check_tokens(const capmoe_ep_desc_t* d, int64_t num_tokens,
                                    const int32_t* num_tokens_device) {
  if (num_tokens_device == nullptr && (num_tokens < 0 || num_tokens > d->max_tokens))
    return CAPMOE_ERR_INVALID_ARGUMENT;
  return check_aligned(4, {num_tokens_device});
}

// A buffer the launch needs whenever `needed`: non-null and aligned to `bytes`.
inline capmoe_status_t check_buffer(bool needed, const void* p, size_t bytes) {
  if (needed && p == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  return check_aligned(bytes, {p});
}

inline int ranks(const capmoe_ep_desc_t* d) { return static_cast<int>(d->ranks); }
inline int local_experts(const capmoe_ep_desc_t* d) {
  return static_cast<int>(d->num_experts / d->ranks);
}
inline int cols_per_rank(const capmoe_ep_desc_t* d) {
  return local_experts(d) + static_cast<int>(d->spare_per_rank);
}
inline int block_rows(const capmoe_ep_desc_t* d) {
  return static_cast<int>(d->ranks * d->capacity);
}
inline int route_count(const capmoe_ep_desc_t* d) {
  return static_cast<int>(d->max_tokens * d->topk);
}

__device__ __forceinline__ void raise_flags(int32_t* flags, int bits) {
  if (bits != 0 && flags != nullptr) atomicOr(flags, bits);
}

// The launch's token count (routing::resolve_tokens); `report` (one thread of the grid) ORs
// CAPMOE_EP_BAD_TOKENS into flags when the device value had to be clamped.
__device__ __forceinline__ int resolve_tokens(int64_t host, const int32_t* device, int t_max,
                                              int32_t* flags, bool report) {
  const int t = routing::resolve_tokens(host, device, t_max, nullptr);
  if (report && device != nullptr) {
    const int raw = __ldg(device);
    if (raw < 0 || raw > t_max) raise_flags(flags, CAPMOE_EP_BAD_TOKENS);
  }
  return t;
}

// Grid x of a grid-stride loop over `work` items with `threads` per block.
inline unsigned stride_blocks(int64_t work, int threads, int64_t cap) {
  int64_t b = (work + threads - 1) / threads;
  if (b > cap) b = cap;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

}  // namespace ep
}  // namespace capmoe
