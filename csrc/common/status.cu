// capmoe-archs: 90a 100a
// Thread-local record of the last CUDA error seen at the C ABI boundary.
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
