// The C ABI boundary: translates CUDA errors and C++ exceptions into capmoe_status_t.
// Every extern "C" entry point wraps its body in capmoe::guarded(...) so that nothing
// thrown inside (CUTLASS, std::) ever crosses into Rust. Give the lambda an explicit
// `-> capmoe_status_t` return type (enum constants and statuses deduce differently).
#pragma once

#include <cuda_runtime.h>

#include <exception>

#include "capturable_moe/status.h"

namespace capmoe {

// Remembers the cudaError_t behind the last CAPMOE_ERR_CUDA of this thread
// (read back through capmoe_last_cuda_error). Defined in common/status.cu.
void record_cuda_error(cudaError_t err);

inline capmoe_status_t cuda_status(cudaError_t err) {
  if (err == cudaSuccess) return CAPMOE_OK;
  record_cuda_error(err);
  return CAPMOE_ERR_CUDA;
}

// Status of the most recent kernel launch on this thread (configuration errors only:
// it never synchronises).
inline capmoe_status_t launch_status() { return cuda_status(cudaGetLastError()); }

template <class Body>
capmoe_status_t guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    return CAPMOE_ERR_INTERNAL;
  }
}

}  // namespace capmoe

#define CAPMOE_TRY(expr)                         \
  do {                                           \
    capmoe_status_t capmoe_status_ = (expr);     \
    if (capmoe_status_ != CAPMOE_OK) return capmoe_status_; \
  } while (0)
