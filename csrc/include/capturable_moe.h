/* capturable-moe C ABI: the only header bindgen reads.
 *
 * Conventions shared by every entry point:
 *  - Every function returns a capmoe_status_t; no C++ exception and no exit() crosses it.
 *  - Device pointers are void* (or typed const pointers); streams are void* holding a
 *    cudaStream_t / CUstream. No entry point allocates memory or synchronises with the host,
 *    so every launch can be captured in a CUDA graph.
 *  - Sizes are int64_t; counts that live on the device (m_splits and friends) are never read
 *    on the host.
 * The per-capability declarations live in capturable_moe/<capability>.h. */
#ifndef CAPTURABLE_MOE_H
#define CAPTURABLE_MOE_H

#include "capturable_moe/status.h"
#include "capturable_moe/grouped_gemm.h"
#include "capturable_moe/routing.h"
#include "capturable_moe/echo.h"
#include "capturable_moe/ep.h"
#include "capturable_moe/fused.h"
#include "capturable_moe/wgrad_gather.h"

#endif
