// The internal interface between the C ABI dispatcher (dispatch.cu) and the kernel variants
// (one instantiation TU each under inst/). Kept free of CUTLASS so the dispatcher compiles fast,
// and free of the variant list (variants.h) so adding a variant recompiles no other TU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "capturable_moe/grouped_gemm.h"

namespace capmoe::gg {

// Everything one launch needs, as received at the C ABI.
struct Launch {
  const capmoe_grouped_gemm_desc_t* desc;
  const void* a;
  const void* b;
  void* d;
  const void* m_splits;
  int32_t* overflow_flags;
  void* workspace;
  uint64_t workspace_bytes;
  cudaStream_t stream;
};

// A compiled variant: reports its workspace size when `workspace_bytes` is non-null,
// otherwise runs.
using VariantFn = capmoe_status_t (*)(const Launch& launch, uint64_t* workspace_bytes);

}  // namespace capmoe::gg
