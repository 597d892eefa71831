// Host-side pointer alignment checks of the C ABI entry points: a misaligned access faults on
// the device and loses the CUDA context, so the entry points refuse it up front.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "capturable_moe/status.h"

namespace capmoe {

// CAPMOE_ERR_MISALIGNED unless every pointer is a multiple of `bytes` (NULL passes).
inline capmoe_status_t check_aligned(size_t bytes, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0) return CAPMOE_ERR_MISALIGNED;
  return CAPMOE_OK;
}

}  // namespace capmoe
