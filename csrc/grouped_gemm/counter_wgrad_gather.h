// The gathered form of the counter wgrad (grouped_gemm/sm90_counter_wgrad.cu): the sm_90a
// kernel capmoe_wgrad_gather (fused/wgrad_gather_sm90.cu) launches for a 16-bit dW with one
// operand read through token_of_row. The plain operand and dW go by TMA as in the grouped GEMM's
// WGRAD, the gathered one by cp.async from the producer warpgroup, and the tiles come from the
// caller's schedule words instead of the argument kernel's workspace.
#pragma once

#include <cuda_runtime.h>

#include "capturable_moe/status.h"
#include "fused/wgrad_gather_launch.h"

namespace capmoe::gg::counter {

// Whether the gathered counter wgrad takes a launch the entry has checked (host facts only):
// dW in the operand type without accumulating, exactly one operand gathered, at most
// kCounterMaxExperts experts and each expert's dW under TMA's 2^40-byte stride limit.
// CAPMOE_GATHER_WGRAD=strided (read once) declines every launch, so that the older strided
// kernel (fused/wgrad_gather_sm90.cu) runs instead: for A/B and for its tests.
bool gathered_wgrad_takes(const fused::WgradGatherParams& params, capmoe_dtype_t dtype, capmoe_dtype_t out_dtype);

// dW as capturable_moe/wgrad_gather.h describes it, on `grid` persistent CTAs; dtype BF16 or F16.
capmoe_status_t launch_gathered_wgrad(const fused::WgradGatherParams& params, capmoe_dtype_t dtype, int grid,
                                      cudaStream_t stream);

}  // namespace capmoe::gg::counter
