/* Device-side MoE routing: counts, offsets, permutation maps, permute / unpermute and SwiGLU,
 * all with the routing and (optionally) the token count T living on the GPU.
 *
 * Shapes (one plan, fixed at plan time; T may change every launch):
 *   x, y, dx       [T_max, H]           BF16 or F16 (desc.dtype), row-major, contiguous
 *   expert_ids     [T_max, k]  int32    route (t, j) goes to expert expert_ids[t*k + j]
 *   probs, dprobs  [T_max, k]           F32, BF16 or F16 (desc.prob_dtype)
 *   routing_map    [T_max, E]  uint8    Megatron form (nonzero = routed), with probs [T_max, E]
 *   rows, drows    [capacity, H]        permuted (expert-contiguous) activations
 *   h, dh          [capacity, 2F]       fc1 output: columns [0, F) are the gate, [F, 2F) the up
 *   act, dact      [capacity, F]        silu(gate) * up
 *   m_splits       [E]         int32 and/or int64: rows kept per expert (what the GEMMs read)
 *   offsets        [E + 1]     int64: exclusive prefix sum of m_splits; offsets[E] = total rows
 *   row_of_route   [T_max, k]  int32: row of route (t, j) in `rows`, or -1 (dropped / no route);
 *                              as build writes it, no row belongs to two routes (a map that
 *                              breaks this makes permute race; the launchers trust it)
 *   token_of_row   [capacity]  int32: token of each row, -1 for rows at or past offsets[E]
 *   expert_counts  [E]         int32: routes per expert before any dropping (load statistics)
 *
 * Row order: experts in ascending order; within an expert, routes in ascending (t, j) order,
 * i.e. ascending token, then ascending slot. It does not depend on thread scheduling, so every
 * output below is bitwise deterministic.
 *
 * Routes and dropping (evaluated on the device, nothing is read back to the host):
 *  - expert id -1 is an empty slot: no route, no flag (the map conversion pads with it);
 *  - any other id outside [0, E) is dropped and sets CAPMOE_ROUTING_BAD_EXPERT;
 *  - a duplicate id within one token is two independent routes: two rows, each weighted by
 *    its own prob (y gets (p_a + p_b) * f_e(x)); nothing is flagged;
 *  - expert_capacity > 0: an expert keeps its first expert_capacity routes in row order;
 *  - then the experts are laid out in order and every row at or past `capacity` is dropped,
 *    so a later expert loses rows first (the same clamp the grouped GEMM applies);
 *  - any dropping by either rule sets CAPMOE_ROUTING_CAPACITY.
 * A dropped route has row_of_route = -1, contributes nothing to y and gets dprobs = 0.
 *
 * Token count: every launch takes `num_tokens` (host) and `num_tokens_device` (const int32*,
 * may be NULL). When the device pointer is given its value is used, read on the GPU, clamped
 * into [0, T_max] (a value outside sets CAPMOE_ROUTING_BAD_TOKENS); otherwise the host value is
 * used (0 <= num_tokens <= T_max, checked on the host). Token rows t >= T of y / dx / dprobs /
 * expert_ids are not written; row_of_route is written for every t < T_max (-1 for t >= T).
 *
 * Rows at or past offsets[E] of rows / drows / act / dh are never read nor written; nothing is
 * ever accessed past `capacity` rows.
 *
 * Flags: a device int32, OR-ed with the bits below (sticky: the caller clears it). Bit 1 is
 * the same bit as CAPMOE_OVERFLOW_CAPACITY of the grouped GEMM, so both can share one word.
 * flags may be NULL where noted.
 *
 * Alignment: every activation pointer 16-byte aligned; H and F multiples of 8; every other
 * array naturally aligned (int32 / fp32 to 4 bytes, int64 offsets / m_splits to 8, 16-bit probs
 * to 2). A violation is CAPMOE_ERR_MISALIGNED before anything is launched.
 * Every launcher allocates nothing, never synchronises and never reads device data on the
 * host, so all of them can be captured in a CUDA graph. Each kernel is launched as a
 * programmatic dependent of the kernel before it on the stream and waits for that kernel to
 * finish before its first memory access (stream order holds as usual; only the launch overlaps
 * the kernel before). CAPMOE_ROUTING_PDL=0 in the environment (read once) makes them ordinary
 * launches. */
#ifndef CAPTURABLE_MOE_ROUTING_H
#define CAPTURABLE_MOE_ROUTING_H

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Routing flag bits (device int32, sticky). */
enum {
  CAPMOE_ROUTING_CAPACITY = 1,   /* routes were dropped by capacity / expert_capacity */
  CAPMOE_ROUTING_BAD_EXPERT = 4, /* an expert id outside [0, E) other than -1 was dropped */
  CAPMOE_ROUTING_TOO_MANY = 8,   /* map conversion: a token had more than k routes */
  CAPMOE_ROUTING_BAD_TOKENS = 16 /* the device token count was outside [0, T_max] */
};

/* Plan limits. */
enum { CAPMOE_ROUTING_MAX_EXPERTS = 1024, CAPMOE_ROUTING_MAX_TOPK = 32 };

typedef struct capmoe_routing_desc {
  int64_t num_experts;     /* E, 1 ..= CAPMOE_ROUTING_MAX_EXPERTS */
  int64_t hidden;          /* H, a positive multiple of 8 (else CAPMOE_ERR_MISALIGNED) */
  int64_t ffn;             /* F (fc1 has 2F outputs), likewise; also
                              max(T_max, capacity) * max(H, 2F) / 8 <= INT32_MAX */
  int64_t topk;            /* k, 1 ..= CAPMOE_ROUTING_MAX_TOPK */
  int64_t max_tokens;      /* T_max >= 0, T_max * k < 2^31 */
  int64_t capacity;        /* rows of the permuted buffers, 0 ..= T_max * k */
  int64_t expert_capacity; /* rows one expert may keep; <= 0: no per-expert limit */
  capmoe_dtype_t dtype;      /* activations: BF16 or F16 */
  capmoe_dtype_t prob_dtype; /* probs / dprobs: F32, BF16 or F16 */
} capmoe_routing_desc_t;

/* Checks the descriptor and reports the bytes of workspace capmoe_routing_build needs
 * (device memory owned by the caller, 4-byte aligned; cudaMalloc gives 256). */
capmoe_status_t capmoe_routing_workspace_size(const capmoe_routing_desc_t* desc,
                                              uint64_t* bytes);

/* Megatron form -> [T, k] form. For each token t < T the experts e with routing_map[t, e] != 0
 * are taken in ascending e; the first k fill expert_ids[t, :] / probs[t, :] (probs copied from
 * map_probs[t, e], same dtype); the remaining slots get id -1 and prob 0. A token with more than
 * k routes keeps its k lowest experts and sets CAPMOE_ROUTING_TOO_MANY. flags may be NULL. */
capmoe_status_t capmoe_routing_from_map(const capmoe_routing_desc_t* desc,
                                        const uint8_t* routing_map, const void* map_probs,
                                        int64_t num_tokens, const int32_t* num_tokens_device,
                                        int32_t* expert_ids, void* probs, int32_t* flags,
                                        void* stream);

/* Counts, offsets and maps from expert_ids. m_splits_i32, m_splits_i64, token_of_row and
 * expert_counts may be NULL; offsets, row_of_route and workspace may not. flags may be NULL. */
capmoe_status_t capmoe_routing_build(const capmoe_routing_desc_t* desc, const int32_t* expert_ids,
                                     int64_t num_tokens, const int32_t* num_tokens_device,
                                     int32_t* m_splits_i32, int64_t* m_splits_i64,
                                     int64_t* offsets, int32_t* row_of_route,
                                     int32_t* token_of_row, int32_t* expert_counts,
                                     int32_t* flags, void* workspace, uint64_t workspace_bytes,
                                     void* stream);

/* rows[row_of_route[t, j]] = x[t] for every kept route of every token t < T. */
capmoe_status_t capmoe_routing_permute(const capmoe_routing_desc_t* desc, const void* x,
                                       const int32_t* row_of_route, int64_t num_tokens,
                                       const int32_t* num_tokens_device, void* rows,
                                       void* stream);

/* dx[t] = sum_j drows[row_of_route[t, j]] over kept routes (fp32 sum in ascending j, then
 * rounded once); 0 for a token with no kept route. */
capmoe_status_t capmoe_routing_permute_backward(const capmoe_routing_desc_t* desc,
                                                const void* drows, const int32_t* row_of_route,
                                                int64_t num_tokens,
                                                const int32_t* num_tokens_device, void* dx,
                                                void* stream);

/* y[t] = sum_j probs[t, j] * rows[row_of_route[t, j]] over kept routes (fp32 fma in ascending
 * j, then rounded once); 0 for a token with no kept route. No atomics. */
capmoe_status_t capmoe_routing_unpermute(const capmoe_routing_desc_t* desc, const void* rows,
                                         const int32_t* row_of_route, const void* probs,
                                         int64_t num_tokens, const int32_t* num_tokens_device,
                                         void* y, void* stream);

/* drows[row_of_route[t, j]] = probs[t, j] * dy[t] (product in fp32, rounded once) and
 * dprobs[t, j] = <dy[t], rows[row_of_route[t, j]]> in fp32 (0 for a dropped route), for
 * t < T. The dot product's summation order is fixed, so it is deterministic. */
capmoe_status_t capmoe_routing_unpermute_backward(const capmoe_routing_desc_t* desc,
                                                  const void* dy, const void* rows,
                                                  const int32_t* row_of_route, const void* probs,
                                                  int64_t num_tokens,
                                                  const int32_t* num_tokens_device, void* drows,
                                                  void* dprobs, void* stream);

/* For the path that weights each route in fc1's epilogue (capturable_moe/fused.h):
 * prob_of_row[row_of_route[t, j]] = probs[t, j] as fp32, for every kept route of t < T. Rows no
 * kept route maps to (those at or past the build's total) are not written. prob_of_row holds
 * `capacity` floats, 4-byte aligned. */
capmoe_status_t capmoe_routing_row_probs(const capmoe_routing_desc_t* desc,
                                         const int32_t* row_of_route, const void* probs,
                                         int64_t num_tokens, const int32_t* num_tokens_device,
                                         float* prob_of_row, void* stream);

/* dprobs[t, j] = sum_{s < slices} partials[row_of_route[t, j] * slices + s] (fp32 adds in
 * ascending s, rounded once to the prob dtype; 0 for a dropped route), for t < T: the per-row
 * partial dot products a fused fc2 dgrad wrote (capmoe_fused_swiglu_dgrad_gathered), summed
 * per route without atomics. partials is [capacity, slices] fp32, 4-byte aligned; slices >= 1. */
capmoe_status_t capmoe_routing_route_dprobs(const capmoe_routing_desc_t* desc,
                                            const int32_t* row_of_route, const float* partials,
                                            int64_t slices, int64_t num_tokens,
                                            const int32_t* num_tokens_device, void* dprobs,
                                            void* stream);

/* act[r, f] = silu(h[r, f]) * h[r, F + f] for r < offsets[E] (fp32 math, rounded once). */
capmoe_status_t capmoe_routing_swiglu(const capmoe_routing_desc_t* desc, const void* h,
                                      const int64_t* offsets, void* act, void* stream);

/* With g = h[r, f], u = h[r, F + f], s = sigmoid(g), for r < offsets[E]:
 *   dh[r, f]     = dact[r, f] * u * s * (1 + g * (1 - s))
 *   dh[r, F + f] = dact[r, f] * g * s                      (fp32 math, rounded once). */
capmoe_status_t capmoe_routing_swiglu_backward(const capmoe_routing_desc_t* desc,
                                               const void* dact, const void* h,
                                               const int64_t* offsets, void* dh, void* stream);

#ifdef __cplusplus
}
#endif

#endif
