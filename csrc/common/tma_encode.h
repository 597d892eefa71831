// Host-side TMA descriptor encoding, shared by the fused kernels' entries (fused/entry.h) and
// the hand-written grouped GEMM (grouped_gemm/sm90_counter.cu).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "capturable_moe/status.h"

namespace capmoe {

// cuTensorMapEncodeTiled through the runtime's driver entry point (the crate does not link
// libcuda; cudarc loads it at run time). Null when the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result) !=
            cudaSuccess ||
        result != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A 128B-swizzled map over a row-major 16-bit tensor of `rank` dims (dims[0] contiguous) whose
// box is 64 elements (128 bytes) wide. Elements outside the dims are zero-filled on load.
inline capmoe_status_t tma_encode(CUtensorMap* map, capmoe_dtype_t dtype, const void* base, cuuint32_t rank,
                                  const cuuint64_t* dims, const cuuint64_t* strides_bytes, const cuuint32_t* box) {
  const auto fn = tma_encode_fn();
  if (fn == nullptr) return CAPMOE_ERR_UNSUPPORTED;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      dtype == CAPMOE_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = fn(map, type, rank, const_cast<void*>(base), dims, strides_bytes, box, element_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? CAPMOE_OK : CAPMOE_ERR_INVALID_ARGUMENT;
}

}  // namespace capmoe
