/* Grouped weight gradient whose rows are read through the routing build's token_of_row, so the
 * expert path's backward needs no permuted copy of x (and the training forward writes none).
 *
 *   dW[e, m, n] = sum over rows r of expert e of  A(r)[m] * B(r)[n]
 *
 * Rows of expert e: [offsets[e], offsets[e+1]), each offset clamped into [0, capacity]; an
 * expert whose clamped end is not past its start has no rows. Each operand reads its row r
 * either in routing order or gathered (capmoe_wgrad_rows_t):
 *   PLAIN     A(r) = a[r]                 a [capacity, M] row-major (e.g. dH of fc1)
 *   GATHERED  A(r) = a[token_of_row[r]]   a [max_tokens, M] row-major (e.g. x)
 * (the same for B with N columns). fc1's wgrad is A = dH PLAIN (M = 2F), B = x GATHERED
 * (N = H): dW1_e = dH_e^T . x[token_of_row[rows of e]]. fc2's is A = dY GATHERED (M = H),
 * B = act PLAIN (N = F).
 * A row whose token lies outside [0, max_tokens) contributes nothing (never the case for a map
 * capmoe_routing_build wrote). Rows at or past offsets[E] (clamped) are never read, whatever
 * they hold (NaN included).
 *
 * Output dW [E, M, N] row-major, in out_dtype: the operand type (each sum rounded once from
 * fp32) or F32. With accumulate (F32 only) dW += the fp32 sum (the crate's wgrad_accumulate
 * main-grad mode). An expert with no rows gets dW_e = 0, or, with accumulate, is left
 * unchanged: the contract of the grouped GEMM's WGRAD (capturable_moe/grouped_gemm.h).
 *
 * Limits (else CAPMOE_ERR_INVALID_ARGUMENT): E >= 1; 8 <= M, N <= INT32_MAX; 0 <= capacity
 * <= INT32_MAX - 128; 0 <= max_tokens <= INT32_MAX; sm_count >= 1; tiles = E * ceil(M / TILE_M) * ceil(N / TILE_N)
 * with tiles - 1 + min(tiles, sm_count) <= INT32_MAX (else UNSUPPORTED). M and N multiples of 8 (else MISALIGNED). dtype BF16 or F16, out_dtype
 * dtype or F32, accumulate only with F32 (else UNSUPPORTED). A GATHERED operand of at most
 * 64 GB: max_tokens * M / 8 (a) or max_tokens * N / 8 (b) < 2^32 (else UNSUPPORTED).
 * Alignment: a, b, dw 16 bytes; offsets 8; token_of_row, schedule 4 (else MISALIGNED). a, b
 * and token_of_row (needed only when an operand is GATHERED) may be NULL only when capacity
 * is 0; offsets, dw and schedule never (else INVALID_ARGUMENT).
 * Kernels: sm_90a on a compute capability 9.0 device, sm_100a (tcgen05; compiled, never run)
 * on 10.0, each only in a binary built with that arch; elsewhere the launch returns
 * CAPMOE_ERR_UNSUPPORTED before anything is launched. On sm_90a a dW in the operand type with
 * one GATHERED operand and at most CAPMOE_FUSED_MAX_EXPERTS experts runs a kernel that hands
 * its tiles out from a device counter in `schedule`; the other launches ignore those words.
 * No workspace, no allocation, no synchronisation, no host read of device data: capturable. */
#ifndef CAPTURABLE_MOE_WGRAD_GATHER_H
#define CAPTURABLE_MOE_WGRAD_GATHER_H

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Output tile of one CTA: TILE_M rows (m) x TILE_N columns (n) of one expert's dW. */
enum { CAPMOE_WGRAD_GATHER_TILE_M = 128, CAPMOE_WGRAD_GATHER_TILE_N = 256 };

/* Device words a launch uses for its tile schedule (capmoe_wgrad_gather's `schedule`): zeroed
 * once by the caller before the first launch; each launch leaves them zero again. Launches
 * that may run at the same time need words of their own. */
enum { CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS = 2 };

/* Where an operand's row r comes from (see above). */
typedef int32_t capmoe_wgrad_rows_t;
enum { CAPMOE_WGRAD_ROWS_PLAIN = 0, CAPMOE_WGRAD_ROWS_GATHERED = 1 };

typedef struct capmoe_wgrad_gather_desc {
  int64_t num_experts; /* E >= 1 */
  int64_t m;           /* M: columns of a, rows of each dW_e; a multiple of 8 */
  int64_t n;           /* N: columns of b and of each dW_e; a multiple of 8 */
  int64_t capacity;    /* routing rows: length of token_of_row, rows of a PLAIN operand */
  int64_t max_tokens;  /* T_max: rows of a GATHERED operand */
  int32_t sm_count;    /* SMs of the device (the persistent grid), >= 1 */
  capmoe_dtype_t dtype;     /* a and b: BF16 or F16 */
  capmoe_dtype_t out_dtype; /* dw: dtype or F32 */
  int32_t accumulate;       /* 1: dw += result (out_dtype F32); 0: dw = result */
  capmoe_wgrad_rows_t a_rows;
  capmoe_wgrad_rows_t b_rows;
} capmoe_wgrad_gather_desc_t;

/* CAPMOE_OK when a kernel exists for this descriptor on the current device (shapes, dtypes,
 * the device's compute capability, the archs built into the binary); otherwise the status the
 * launch would return. No CUDA work beyond device attribute queries. */
capmoe_status_t capmoe_wgrad_gather_supported(const capmoe_wgrad_gather_desc_t* desc);

/* dw as described above, on `stream` (a cudaStream_t). token_of_row may be NULL when neither
 * operand is GATHERED. schedule: CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS int32 of device memory
 * (see above). */
capmoe_status_t capmoe_wgrad_gather(const capmoe_wgrad_gather_desc_t* desc, const void* a,
                                    const void* b, const int64_t* offsets,
                                    const int32_t* token_of_row, void* dw, int32_t* schedule,
                                    void* stream);

#ifdef __cplusplus
}
#endif

#endif
