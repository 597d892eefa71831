/* Grouped GEMM over experts whose row counts (m_splits) live in device memory.
 *
 * Layout contract. Rows of each expert are contiguous, experts in order, in activation
 * tensors of `capacity` rows. With the layer's weight W_e of shape [N, K] (nn.Linear layout,
 * one tensor [E, N, K] or per-expert pointers):
 *   FPROP  a = X  [rows, K]   b = W                 d = Y  [rows, N]    Y_e  = X_e  W_e^T
 *   DGRAD  a = dY [rows, N]   b = W                 d = dX [rows, K]    dX_e = dY_e W_e
 *   WGRAD  a = dY [rows, N]   b = X  [rows, K]      d = dW [E, N, K]    dW_e = dY_e^T X_e
 * With CAPMOE_WEIGHT_EKN the weights are stored transposed, [E, K, N].
 * With weights_as_pointers, `b` (FPROP/DGRAD) or `d` (WGRAD) is a device array of E pointers,
 * one per expert, each to a packed [N, K] (or [K, N]) matrix.
 *
 * m_splits: E int32 or int64 counts on the device, never read on the host. Experts are laid
 * out at the exclusive prefix sum of m_splits. Rows past the device-side total are not
 * touched. When the total exceeds `capacity`, each expert is clamped to the rows that fit
 * (nothing is read or written past `capacity` rows) and bit CAPMOE_OVERFLOW_CAPACITY is OR-ed
 * into *overflow_flags; a negative count is treated as 0 and sets CAPMOE_OVERFLOW_NEGATIVE;
 * a misaligned or null per-expert pointer skips that expert and sets CAPMOE_OVERFLOW_MISALIGNED
 * or CAPMOE_OVERFLOW_NULL_POINTER.
 * The flags are sticky: the caller clears them.
 *
 * WGRAD: an expert with zero rows gets dW_e = 0, or, with accumulate, is left unchanged.
 * accumulate: dW_e += dY_e^T X_e into an fp32 buffer (out_dtype must be F32).
 *
 * Workspace: caller-owned device memory of capmoe_grouped_gemm_workspace_size bytes, 256-byte
 * aligned; it holds the problem sizes, pointer and stride arrays the argument kernel writes,
 * plus CUTLASS's own workspace. One workspace per concurrently running plan.
 *
 * Limits (CAPMOE_ERR_INVALID_ARGUMENT otherwise): 1 <= E <= 65535; 8 <= N, K <= INT32_MAX;
 * 0 <= capacity < INT32_MAX; every operand's size in bytes (4 per element counted) fits in
 * int64. N and K multiples of 8 (TMA moves 16-byte rows); a, b, d 16-byte aligned, workspace
 * 256-byte, m_splits and overflow_flags at their element's size (CAPMOE_ERR_MISALIGNED).
 * Whatever the host can check is checked before anything is launched.
 *
 * capmoe_grouped_gemm_run allocates nothing and never synchronises with the host. It enqueues
 * the argument kernel and, right behind it, the GEMM as its programmatic dependent launch (the
 * GEMM's blocks wait for it before reading anything). The argument kernel is in turn a
 * programmatic dependent of the kernel before it on the stream and waits for that kernel to
 * finish before its first read, so stream order holds as usual. CAPMOE_GEMM_PDL=0 in the
 * environment (read once) makes the GEMM an ordinary launch, CAPMOE_ROUTING_PDL=0 the argument
 * kernel, for diagnosis; CAPMOE_COUNTER_WGRAD=cooperative / split (read once) forces the form
 * of CAPMOE_CONFIG_SM90_COUNTER's wgrad that otherwise follows the rows per expert (same
 * contract; bench/README.md). A failure the host can see is returned before anything is enqueued,
 * except a refused launch of the GEMM itself (CAPMOE_ERR_CUDA / CAPMOE_ERR_CUTLASS): the
 * argument kernel is then already enqueued and may still set bits in *overflow_flags. */
#ifndef CAPTURABLE_MOE_GROUPED_GEMM_H
#define CAPTURABLE_MOE_GROUPED_GEMM_H

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t capmoe_gemm_op_t;
enum { CAPMOE_GEMM_FPROP = 0, CAPMOE_GEMM_DGRAD = 1, CAPMOE_GEMM_WGRAD = 2 };

typedef int32_t capmoe_weight_layout_t;
enum {
  CAPMOE_WEIGHT_ENK = 0, /* [E, N, K]: nn.Linear weight per expert */
  CAPMOE_WEIGHT_EKN = 1  /* [E, K, N]: transposed */
};

/* Kernel configurations. AUTO applies the documented heuristic on host-known facts only. */
typedef int32_t capmoe_gemm_config_t;
enum {
  CAPMOE_CONFIG_AUTO = 0,
  CAPMOE_CONFIG_SM90_COOPERATIVE = 1, /* 128x256x64 tile, 2x1 cluster: WGRAD only (its fprop /
                                       * dgrad forms won no swept case and were deleted) */
  CAPMOE_CONFIG_SM100_1SM = 3,        /* 128x256x64 per SM */
  CAPMOE_CONFIG_SM100_2SM = 4,        /* 256x256x64 across an SM pair */
  CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER = 5, /* 128x256x64 tile, 1x1 cluster: FPROP / DGRAD */
  /* 2 was the 64x128 pingpong (deleted after the H200 sweep of 2026-11-28: within 3 % of the
   * 64x256 one at decode, behind it in 3 of 4 cases), 6 and 7 the 256x128 cooperative and
   * 128x128 pingpong tiles (deleted after the 2026-11-28 sweep on the H100: best nowhere); the
   * codes stay unused. */
  CAPMOE_CONFIG_SM90_PINGPONG_WIDE = 8,         /* 64x256x64 tile per warpgroup, 1x1 cluster */
  CAPMOE_CONFIG_SM90_COUNTER = 9 /* hand-written 128x256x64 kernels, tiles from a device
                                  * counter: FPROP / DGRAD with 16-bit out, and WGRAD with a
                                  * 16-bit dW, no accumulate; one weight / dW tensor (no pointer
                                  * array), at most CAPMOE_FUSED_MAX_EXPERTS experts:
                                  * UNSUPPORTED otherwise */
};

/* Overflow flag bits (device int32, sticky). MISALIGNED / NULL_POINTER: a per-expert pointer of
 * a pointer-array operand was not 16-byte aligned / was null; that expert was skipped (nothing
 * read or written through it). Other bad addresses cannot be detected: pointer-array entries
 * are trusted. The values do not collide with the routing flags (capturable_moe/routing.h), so
 * one word can hold both; bit 1 means capacity overflow in both. */
enum {
  CAPMOE_OVERFLOW_CAPACITY = 1,
  CAPMOE_OVERFLOW_NEGATIVE = 2,
  CAPMOE_OVERFLOW_MISALIGNED = 32,
  CAPMOE_OVERFLOW_NULL_POINTER = 64
};

typedef struct capmoe_grouped_gemm_desc {
  capmoe_gemm_op_t op;
  int32_t arch;               /* 90 or 100 */
  capmoe_dtype_t dtype;       /* a and b: BF16 or F16 */
  capmoe_dtype_t out_dtype;   /* d: same as dtype, or F32 (WGRAD) */
  capmoe_dtype_t split_dtype; /* m_splits: I32 or I64 */
  capmoe_weight_layout_t weight_layout;
  int32_t weights_as_pointers; /* 0: one strided tensor; 1: device array of E pointers */
  int32_t accumulate;          /* WGRAD only: d += result (F32 out) */
  capmoe_gemm_config_t config; /* AUTO or a concrete configuration */
  int32_t sm_count;            /* SMs the persistent scheduler may use (read from the device) */
  int64_t num_experts;
  int64_t n;
  int64_t k;
  int64_t capacity; /* rows in the activation tensors */
} capmoe_grouped_gemm_desc_t;

/* The configuration AUTO resolves to for this descriptor (host facts only); the descriptor is
 * checked as capmoe_grouped_gemm_workspace_size does, so a configuration this build has no
 * kernel for (another arch's, an unknown value, a dtype a candidate tile lacks) is
 * CAPMOE_ERR_UNSUPPORTED here already. */
capmoe_status_t capmoe_grouped_gemm_resolve_config(const capmoe_grouped_gemm_desc_t* desc,
                                                   capmoe_gemm_config_t* config);

/* Checks the descriptor (shapes, alignment, a built kernel) and reports the workspace size. */
capmoe_status_t capmoe_grouped_gemm_workspace_size(const capmoe_grouped_gemm_desc_t* desc,
                                                   uint64_t* bytes);

/* Writes the per-expert arguments on the device from m_splits and launches the grouped GEMM.
 * overflow_flags may be NULL. */
capmoe_status_t capmoe_grouped_gemm_run(const capmoe_grouped_gemm_desc_t* desc, const void* a,
                                        const void* b, void* d, const void* m_splits,
                                        int32_t* overflow_flags, void* workspace,
                                        uint64_t workspace_bytes, void* stream);

#ifdef __cplusplus
}
#endif

#endif
