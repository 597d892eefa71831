/* Fused expert-path kernels:
 *  - fc1 that gathers its A rows straight from x and applies SwiGLU in its epilogue (no
 *    permuted copy of x is written or read, no separate SwiGLU pass);
 *  - fc2 dgrad that applies the SwiGLU backward in its epilogue (no dact round trip), below
 *    capmoe_fused_swiglu_dgrad; and its gathered form, capmoe_fused_swiglu_dgrad_gathered, for
 *    a forward that weights act by the route probability (the dy rows are gathered, dprob's
 *    partials come from the epilogue).
 *
 * fc1 shapes (fixed at plan time; routing lives on the device and changes every launch):
 *   x             [T_max, H]      BF16 or F16 (desc.dtype), row-major, contiguous
 *   w1            [E, 2F, H]      same dtype; rows [0, F) of each expert are the gate, [F, 2F)
 *                                 the up projection (the unfused path's layout)
 *   offsets       [E + 1]  int64  routing build's row offsets: expert e owns rows
 *                                 [offsets[e], offsets[e+1]) (each clamped into [0, capacity])
 *   token_of_row  [capacity] int32 routing build's token of each row
 *   act           [capacity, F]   silu(gate) * up, rows in routing order
 *   h (optional)  [capacity, 2F]  the pre-activation [gate | up] for the backward; NULL: not
 *                                 written
 *   rows          [capacity, H]   with desc.write_rows only: the gathered x rows,
 *                                 rows[r] = x[token_of_row[r]], the permuted copy the unfused
 *                                 path's fc1 and its fc1 wgrad read (capmoe_routing_permute's
 *                                 bits), written from the shared-memory stages the kernel
 *                                 gathered anyway, so a training step needs no permute pass
 * For every row r < offsets[E] (clamped to capacity) of expert e:
 *   g = round(x[token_of_row[r]] . w1[e, f]),  u = round(x[token_of_row[r]] . w1[e, F + f])
 *   act[r, f] = round(silu(g) * u)          (fp32 accumulate, fp32 SwiGLU as
 *                                            capmoe_routing_swiglu computes it from h)
 * so act and h equal the unfused permute -> fc1 -> SwiGLU path's. Rows at or past offsets[E],
 * and past capacity, are neither read nor written. A row whose token lies outside [0, T_max)
 * (never the case for a map capmoe_routing_build wrote) is not loaded; its outputs are
 * unspecified.
 *
 * Limits: F a multiple of CAPMOE_FUSED_FC1_TILE_N, H a multiple of 8, E <=
 * CAPMOE_FUSED_MAX_EXPERTS; other shapes are CAPMOE_ERR_UNSUPPORTED (use the unfused path).
 * 8 <= H <= INT32_MAX - 128 (else CAPMOE_ERR_INVALID_ARGUMENT).
 * Kernels: sm_90a on a compute capability 9.0 device, sm_100a (tcgen05 UMMA, accumulators in
 * tensor memory; compiled, never run: no Blackwell GPU has been available) on 10.0, each only
 * in a binary built for its arch; elsewhere the launch returns CAPMOE_ERR_UNSUPPORTED before
 * anything is launched. Same contract and epilogue math on both.
 * Alignment: x, w1, act, h, rows 16-byte aligned; offsets 8; token_of_row 4 (else MISALIGNED).
 * No workspace, no allocation, no synchronisation, no host read of device data: capturable.
 * The TMA descriptors of x and w1 are encoded on the host at every call (pure host work), so
 * a captured graph keeps the addresses it was captured with. */
#ifndef CAPTURABLE_MOE_FUSED_H
#define CAPTURABLE_MOE_FUSED_H

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CAPMOE_FUSED_FC1_TILE_N = 128, CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N = 128, CAPMOE_FUSED_MAX_EXPERTS = 1024 };

/* How the kernel gathers the x rows of a tile into shared memory (desc.gather).
 *  CP_ASYNC: 16-byte cp.async copies by a producer warpgroup, 8 lanes per row (each warp-wide
 *            copy reads four whole rows), swizzled by hand; the only form;
 *  AUTO:     CP_ASYNC.
 * Value 1 named a form that loaded each row with its own TMA box; it ran about 4x slower on the
 * H200 and was removed: CAPMOE_ERR_UNSUPPORTED on every device. */
typedef int32_t capmoe_fused_gather_t;
enum { CAPMOE_FUSED_GATHER_AUTO = 0, CAPMOE_FUSED_GATHER_CP_ASYNC = 2 };

/* Device words a fused fc1 launch uses for its tile schedule (capmoe_fused_fc1's `schedule`). */
#define CAPMOE_FUSED_FC1_SCHEDULE_WORDS 2

typedef struct capmoe_fused_fc1_desc {
  int64_t num_experts; /* E, 1 ..= CAPMOE_FUSED_MAX_EXPERTS */
  int64_t hidden;      /* H, a positive multiple of 8 */
  int64_t ffn;         /* F, a positive multiple of CAPMOE_FUSED_FC1_TILE_N */
  int64_t max_tokens;  /* T_max, rows of x, < 2^31; x of at most 64 GB (T_max * H / 8 < 2^32) */
  int64_t capacity;    /* rows of act / h, 0 ..= 2^31 - 1 */
  int32_t sm_count;    /* SMs of the device (the persistent grid), >= 1 */
  capmoe_dtype_t dtype; /* BF16 or F16 */
  capmoe_fused_gather_t gather;
  int32_t write_rows;  /* 1: every launch also writes `rows` (sm_90a kernel only: elsewhere
                          CAPMOE_ERR_UNSUPPORTED); 0: it does not, and `rows` must be NULL */
} capmoe_fused_fc1_desc_t;

/* CAPMOE_OK when a fused fc1 kernel exists for this descriptor on the current device (checks
 * shapes, dtype, the device's compute capability and the archs built into the binary);
 * otherwise the status the launch would return. No CUDA work beyond device attribute queries. */
capmoe_status_t capmoe_fused_fc1_supported(const capmoe_fused_fc1_desc_t* desc);

/* act (and h when not NULL) as described above, on `stream` (a cudaStream_t).
 * schedule (required, CAPMOE_FUSED_FC1_SCHEDULE_WORDS int32 of device memory, 4-byte aligned,
 * zero before its first launch): the sm_90a kernel's CTAs take their tiles from a counter there
 * as they free up (the M tiles sharing a weight slice then start together and read it once from
 * HBM), and the launch's last CTA sets the words back to zero. Launches that may run at the same
 * time (other streams) need words of their own; launches ordered on one stream can share them.
 * The sm_100a kernel keeps a static order and leaves them untouched.
 * prob_of_row (optional, [capacity] fp32, 4-byte aligned; capmoe_routing_row_probs writes it):
 * when given, each row's act is weighted by its route's probability p in the epilogue,
 *   act[r, f] = round(p[r] * silu(g) * u)   (the fp32 SwiGLU value times p, rounded once),
 * so fc2's output rows come out weighted and the combine over k is an unweighted gather-sum
 * (capmoe_routing_permute_backward's). h is unchanged. NULL: act as above.
 * rows (required with desc.write_rows, NULL otherwise, 16-byte aligned): the gathered x rows
 * above, for every row r < offsets[E]; rows past offsets[E] are not written. */
capmoe_status_t capmoe_fused_fc1(const capmoe_fused_fc1_desc_t* desc, const void* x,
                                 const void* w1, const int64_t* offsets,
                                 const int32_t* token_of_row, const float* prob_of_row, void* act,
                                 void* h, void* rows, int32_t* schedule, void* stream);

/* Fused fc2 dgrad + SwiGLU backward: the expert path's backward from drows (the gradient of
 * fc2's output rows) to dh (the gradient of fc1's output h), in one persistent kernel.
 *
 * Shapes (fixed at plan time; routing lives on the device and changes every launch):
 *   drows    [capacity, H]   BF16 or F16 (desc.dtype), row-major, routing row order
 *   w2       [E, H, F]       same dtype, row-major (the fc2 weight: out_rows = act . w2[e]^T)
 *   h        [capacity, 2F]  the forward's fc1 output [gate | up], as fc1 wrote it
 *   offsets  [E + 1] int64   routing build's row offsets: expert e owns rows
 *                            [offsets[e], offsets[e+1]) (each clamped into [0, capacity])
 *   dh       [capacity, 2F]  output [dgate | dup]
 *   dact (optional) [capacity, F]  output, the rounded fc2 dgrad; NULL: not written
 * For every row r < offsets[E] (clamped to capacity) of expert e and every f < F:
 *   d = round(sum_h drows[r, h] * w2[e, h, f])        (fp32 accumulate)
 *   g = h[r, f], u = h[r, F + f], s = sigmoid(g)      (fp32)
 *   dh[r, f]     = round(d * u * s * (1 + g * (1 - s)))
 *   dh[r, F + f] = round(d * g * s)
 *   dact[r, f]   = d
 * i.e. the unfused fc2 dgrad grouped GEMM followed by capmoe_routing_swiglu_backward, with the
 * same fp32 math in the epilogue. The bits equal the unfused path's only if both GEMMs sum in
 * the same order (not guaranteed). Rows at or past offsets[E], and past capacity, are never
 * written; drows rows of the last tiles may be read up to capacity (never past it).
 *
 * Limits: F a multiple of CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N, H a multiple of 8, E <=
 * CAPMOE_FUSED_MAX_EXPERTS; other shapes are CAPMOE_ERR_UNSUPPORTED (use the unfused path).
 * 8 <= H <= INT32_MAX - 128 (else CAPMOE_ERR_INVALID_ARGUMENT).
 * Kernels (both forms): sm_90a on a compute capability 9.0 device, sm_100a (tcgen05 UMMA,
 * accumulators in tensor memory; compiled, never run: no Blackwell GPU has been available) on
 * 10.0, each only in a binary built for its arch; elsewhere the launch returns
 * CAPMOE_ERR_UNSUPPORTED before anything is launched. Same contract and epilogue math on both.
 * Alignment: drows, w2, h, dh, dact 16-byte aligned; offsets 8; schedule 4 (else MISALIGNED).
 * No allocation, no synchronisation, no host read of device data: capturable (the TMA
 * descriptors of drows and w2 are encoded on the host at every call; the only workspace is the
 * caller's schedule words, below). */
typedef struct capmoe_fused_swiglu_dgrad_desc {
  int64_t num_experts;  /* E, 1 ..= CAPMOE_FUSED_MAX_EXPERTS */
  int64_t hidden;       /* H, a positive multiple of 8 */
  int64_t ffn;          /* F, a positive multiple of CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N */
  int64_t capacity;     /* rows of drows / h / dh, 0 ..= 2^31 - 1 */
  int64_t max_tokens;   /* T_max, rows of dy, 0 ..= 2^31 - 1; read only by the gathered form */
  int32_t sm_count;     /* SMs of the device (the persistent grid), >= 1 */
  capmoe_dtype_t dtype; /* BF16 or F16 */
} capmoe_fused_swiglu_dgrad_desc_t;

/* CAPMOE_OK when the fused fc2 dgrad + SwiGLU backward exists for this descriptor on the
 * current device, in both forms; otherwise the status the launch would return. max_tokens is
 * read only when positive: a dy past 64 GB (T_max * H / 8 >= 2^32) is CAPMOE_ERR_UNSUPPORTED
 * (the gathered launch checks the rest). No CUDA work beyond device attribute queries. */
capmoe_status_t capmoe_fused_swiglu_dgrad_supported(const capmoe_fused_swiglu_dgrad_desc_t* desc);

/* Device words a fused fc2 dgrad launch (either form) uses for its tile schedule. */
#define CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS 2

/* dh (and dact when not NULL) as described above, on `stream` (a cudaStream_t).
 * schedule (required, CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS int32 of device memory, 4-byte
 * aligned, zero before its first launch): as capmoe_fused_fc1's, the sm_90a kernel's tile
 * counter, set back to zero by each launch's last CTA; launches that may run at the same time
 * need words of their own, launches ordered on one stream (either form) can share them. The
 * sm_100a kernel keeps a static order and leaves them untouched. */
capmoe_status_t capmoe_fused_swiglu_dgrad(const capmoe_fused_swiglu_dgrad_desc_t* desc,
                                          const void* drows, const void* w2, const void* h,
                                          const int64_t* offsets, void* dh, void* dact,
                                          int32_t* schedule, void* stream);

/* Gathered form of the fused fc2 dgrad + SwiGLU backward, for a forward whose fc1 epilogue
 * weighted act by the route probability (act' = p * SwiGLU(g, u)) and whose combine is an
 * unweighted gather-sum: the gradient of fc2's output row r is dy[token_of_row[r]] itself, so
 * no drows buffer exists; dprob comes from this epilogue as per-slice partials.
 *
 * Shapes (as above, plus):
 *   dy              [max_tokens, H]  dtype, token order (the combine's output gradient)
 *   token_of_row    [capacity] int32 routing build's token of each row
 *   prob_of_row     [capacity] fp32  the probability of the route each row holds
 *   dprob_partials  [capacity, S] fp32 output, S = F / CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N
 * For every row r < offsets[E] (clamped to capacity) of expert e, t = token_of_row[r],
 * A = dy[t] when 0 <= t < max_tokens, else a zero row (never read out of bounds), p =
 * prob_of_row[r], and every f < F:
 *   d = round(sum_h A[h] * w2[e, h, f])               (fp32 accumulate, rounded to dtype)
 *   g = h[r, f], u = h[r, F + f], s = g * sigmoid(g) * u   (fp32, as fc1's SwiGLU)
 *   dprob_partials[r, j] = sum over f in [128 j, 128 j + 128) of d * s, in fp32 in a fixed
 *                          order (sm_90a: each of a quad's 4 threads sums its 32 columns in
 *                          order, then a butterfly over the quad; sm_100a: each of two threads
 *                          sums its 64 columns in order, then lower half + upper half): the
 *                          same bits at every launch of one arch (the two archs' orders
 *                          differ), no atomics, one writer per element; dprob[r] = sum_j of them
 *   ds = p * d (fp32), then dh[r, f], dh[r, F + f] = the SwiGLU backward of (ds, g, u) as in
 *                          capmoe_fused_swiglu_dgrad, rounded to dtype.
 * Rows at or past offsets[E], and past capacity, are not written (neither dh nor partials);
 * dy rows are read only through token_of_row.
 *
 * Limits as capmoe_fused_swiglu_dgrad; desc.max_tokens outside [0, 2^31) is
 * CAPMOE_ERR_INVALID_ARGUMENT, a dy past 64 GB CAPMOE_ERR_UNSUPPORTED. capacity 0: OK, nothing launched (only offsets is checked).
 * schedule (required) as capmoe_fused_swiglu_dgrad's.
 * Alignment: dy, w2, h, dh 16-byte aligned; offsets 8; token_of_row, prob_of_row,
 * dprob_partials, schedule 4 (else MISALIGNED). Capturable, as above (only w2's TMA descriptor is
 * encoded on the host). */
capmoe_status_t capmoe_fused_swiglu_dgrad_gathered(const capmoe_fused_swiglu_dgrad_desc_t* desc,
                                                   const void* dy, const void* w2, const void* h,
                                                   const int64_t* offsets,
                                                   const int32_t* token_of_row,
                                                   const float* prob_of_row, void* dh,
                                                   float* dprob_partials, int32_t* schedule,
                                                   void* stream);

#ifdef __cplusplus
}
#endif

#endif
