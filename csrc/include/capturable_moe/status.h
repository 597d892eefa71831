/* Status codes and dtype tags shared by every capability. */
#ifndef CAPTURABLE_MOE_STATUS_H
#define CAPTURABLE_MOE_STATUS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t capmoe_status_t;

enum {
  CAPMOE_OK = 0,
  CAPMOE_ERR_INVALID_ARGUMENT = 1, /* a shape, size or pointer the host can check is wrong */
  CAPMOE_ERR_MISALIGNED = 2,       /* a pointer or leading dimension breaks 16-byte TMA alignment */
  CAPMOE_ERR_UNSUPPORTED = 3,      /* dtype/layout combination with no built kernel */
  CAPMOE_ERR_WORKSPACE_TOO_SMALL = 4,
  CAPMOE_ERR_CUTLASS = 5,          /* CUTLASS can_implement/initialize/run refused */
  CAPMOE_ERR_CUDA = 6,             /* a CUDA runtime call failed; see capmoe_last_cuda_error */
  CAPMOE_ERR_INTERNAL = 7          /* a C++ exception was caught at the boundary */
};

/* Element types. Values are stable ABI. */
typedef int32_t capmoe_dtype_t;
enum {
  CAPMOE_DTYPE_BF16 = 0,
  CAPMOE_DTYPE_F16 = 1,
  CAPMOE_DTYPE_F32 = 2,
  CAPMOE_DTYPE_I32 = 3,
  CAPMOE_DTYPE_I64 = 4
};

/* The cudaError_t behind the most recent CAPMOE_ERR_CUDA on the calling thread (0 if none). */
int32_t capmoe_last_cuda_error(void);

/* The name of a status code as this header spells it ("CAPMOE_ERR_MISALIGNED"), or
 * "unknown status" for any other value. Never NULL: a static string the caller must not free.
 * Needs no GPU, any thread may call it. */
const char* capmoe_status_string(capmoe_status_t status);

#ifdef __cplusplus
}
#endif

#endif
