// capmoe-archs: 90a 100a
// Thread-local record of the last CUDA error seen at the C ABI boundary, and the names of the
// status codes. Plain C++ (no device code): the CPU emulation compiles this file too.
#include "common/boundary.cuh"

namespace capmoe {
namespace {
thread_local cudaError_t last_cuda_error = cudaSuccess;
}
void record_cuda_error(cudaError_t err) { last_cuda_error = err; }
}  // namespace capmoe

extern "C" int32_t capmoe_last_cuda_error(void) {
  return static_cast<int32_t>(capmoe::last_cuda_error);
}

extern "C" const char* capmoe_status_string(capmoe_status_t status) {
  switch (status) {
    case CAPMOE_OK: return "CAPMOE_OK";
    case CAPMOE_ERR_INVALID_ARGUMENT: return "CAPMOE_ERR_INVALID_ARGUMENT";
    case CAPMOE_ERR_MISALIGNED: return "CAPMOE_ERR_MISALIGNED";
    case CAPMOE_ERR_UNSUPPORTED: return "CAPMOE_ERR_UNSUPPORTED";
    case CAPMOE_ERR_WORKSPACE_TOO_SMALL: return "CAPMOE_ERR_WORKSPACE_TOO_SMALL";
    case CAPMOE_ERR_CUTLASS: return "CAPMOE_ERR_CUTLASS";
    case CAPMOE_ERR_CUDA: return "CAPMOE_ERR_CUDA";
    case CAPMOE_ERR_INTERNAL: return "CAPMOE_ERR_INTERNAL";
    default: return "unknown status";
  }
}
