/* Expert parallel (EP): the device side of dispatch / combine and of Echo's spare-slot weight
 * exchange over an EP group of R ranks. These kernels only fill and read fixed-size buffers;
 * the transport between ranks is NCCL (grouped send / recv of the fixed sizes, Rust module
 * `ep`). Every size below is fixed at plan time, so a whole step can be captured in one graph.
 *
 * Column space. Each route ends at a final column c in [0, R * cols_per_rank): rank
 * p = c / cols_per_rank holds it, as its local column c % cols_per_rank. With Echo
 * (spare_per_rank = S_per >= 1) cols_per_rank = L + S_per, L = E / R, and the columns are the
 * ones Echo's top-k reroute writes (out_dest, spec P9: a rank's L home experts, then its S_per
 * spare slots). Without Echo (spare_per_rank = 0) cols_per_rank = L and c is the expert id.
 *
 * Buffers (row-major, contiguous; "capacity" is the rows of one peer block):
 *   expert_ids    [T_max, k]            int32  route (t, j) -> global home expert; -1 = no route
 *   dest          [T_max, k]            int32  route (t, j) -> final column; -1 = no route
 *   probs         [T_max, k]            f32    the route's weight
 *   counts        [E]                   int64  routes per home expert (this rank's row of C)
 *   slot_of_route [T_max, k]            int32  p * capacity + position in peer p's block, or
 *                                              -1 (no route, dropped, or t >= T)
 *   send_ids      [R, capacity]         int32  local column of each row sent to peer p; -1 for
 *                                              rows at or past send_counts[p]
 *   send_probs    [R, capacity]         f32    that row's prob; 0 for unused rows
 *   send_counts   [R]                   int32  rows used in peer p's block (<= capacity)
 *   dropped       [R]                   int32  routes to peer p that did not fit its block
 *   chunk_counts  [chunks, R]           int32  dispatch_layout's workspace (chunks =
 *                                              capmoe_ep_layout_chunks(desc))
 *   rows          [R, capacity, H]      BF16 / F16 (desc.dtype), activations sent or received
 *   slot_expert   [R * S_per]           int64  Echo's slot -> home expert table (-1 empty),
 *                                              identical on every rank (the plan state's
 *                                              section, echo.h)
 *
 * Order and determinism: within peer p's block, routes are laid out in ascending (t, j)
 * order; the first `capacity` routes to p are kept, later ones are dropped (slot_of_route -1,
 * counted in dropped[p], flag CAPMOE_EP_OVERFLOW). Nothing depends on thread scheduling and no
 * floating-point atomics are used, so every output is bitwise deterministic.
 *
 * Token count: launches that read routes take `num_tokens` (host) and `num_tokens_device`
 * (const int32*, may be NULL); a device value is read on the GPU and clamped into [0, T_max]
 * (outside sets CAPMOE_EP_BAD_TOKENS). Rows t >= T of outputs indexed by token are not
 * written, except slot_of_route, written (-1) for every t < T_max.
 *
 * Flags: a device int32, OR-ed with the bits below (sticky: the caller clears it). It is a
 * word of its own (the bit values overlap those of routing.h's word).
 *
 * Limits: T_max * k, R * capacity and E + R * S_per are at most INT32_MAX (they are int32
 * values: slots, columns, counts); the kernels run their loops over them with int64 indices,
 * so every size up to those limits is valid, the largest included.
 *
 * Alignment: rows / x / y and weight buffers 16-byte aligned, H a multiple of 8, bytes per
 * expert matrix a multiple of 16; other arrays naturally aligned. A violation is
 * CAPMOE_ERR_MISALIGNED before anything is launched. Every entry point allocates nothing,
 * never synchronises and never reads device data on the host. */
#ifndef CAPTURABLE_MOE_EP_H
#define CAPTURABLE_MOE_EP_H

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* EP flag bits (device int32, sticky). */
enum {
  CAPMOE_EP_OVERFLOW = 1,        /* a peer block was full: routes dropped (counted in dropped) */
  CAPMOE_EP_BAD_DEST = 2,        /* a dest outside [-1, R * cols_per_rank): route dropped */
  CAPMOE_EP_BAD_TOKENS = 4,      /* the device token count was outside [0, T_max] (clamped) */
  CAPMOE_EP_BAD_EXPERT = 8,      /* count_routes: an id outside [-1, E) was not counted */
  CAPMOE_EP_BAD_SLOT_EXPERT = 16 /* weight kernels: slot_expert outside [-1, E): slot skipped */
};

/* Plan limits. CAPMOE_EP_LAYOUT_CHUNK: routes per chunk of dispatch_layout (its workspace). */
enum { CAPMOE_EP_MAX_RANKS = 1024, CAPMOE_EP_MAX_TOPK = 32, CAPMOE_EP_LAYOUT_CHUNK = 1024 };

typedef struct capmoe_ep_desc {
  int64_t ranks;          /* R, 1 ..= CAPMOE_EP_MAX_RANKS */
  int64_t rank;           /* this rank, < R */
  int64_t num_experts;    /* E home experts, a positive multiple of R */
  int64_t spare_per_rank; /* Echo's S_per; 0 = no Echo */
  int64_t hidden;         /* H, a positive multiple of 8 */
  int64_t topk;           /* k, 1 ..= CAPMOE_EP_MAX_TOPK */
  int64_t max_tokens;     /* T_max >= 0, T_max * k < 2^31 */
  int64_t capacity;       /* rows of one peer block, >= 0, R * capacity < 2^31 */
  capmoe_dtype_t dtype;   /* rows: BF16 or F16 */
} capmoe_ep_desc_t;

/* Checks the descriptor (CAPMOE_ERR_INVALID_ARGUMENT / MISALIGNED / UNSUPPORTED), launches
 * nothing. */
capmoe_status_t capmoe_ep_check_desc(const capmoe_ep_desc_t* desc);

/* counts[e] = routes (t < T, j < k) with expert_ids[t, j] == e, for every e < E (the whole of
 * counts is written). -1 is no route; other ids outside [0, E) are not counted and set
 * CAPMOE_EP_BAD_EXPERT. flags may be NULL. */
capmoe_status_t capmoe_ep_count_routes(const capmoe_ep_desc_t* desc, const int32_t* expert_ids,
                                       int64_t num_tokens, const int32_t* num_tokens_device,
                                       int64_t* counts, int32_t* flags, void* stream);

/* Chunks of CAPMOE_EP_LAYOUT_CHUNK routes that dispatch_layout splits T_max * k into (at
 * least 1; 0 for a NULL desc): its workspace chunk_counts holds chunks * R int32. */
int64_t capmoe_ep_layout_chunks(const capmoe_ep_desc_t* desc);

/* The dispatch layout from the final columns: slot_of_route, send_ids, send_probs,
 * send_counts and dropped (all written in full; see the buffer table), through the
 * workspace chunk_counts [capmoe_ep_layout_chunks(desc), R] (int32, contents on entry
 * ignored). Two launches, fixed grids. flags may not be NULL. */
capmoe_status_t capmoe_ep_dispatch_layout(const capmoe_ep_desc_t* desc, const int32_t* dest,
                                          const float* probs, int64_t num_tokens,
                                          const int32_t* num_tokens_device,
                                          int32_t* slot_of_route, int32_t* send_ids,
                                          float* send_probs, int32_t* send_counts,
                                          int32_t* dropped, int32_t* chunk_counts,
                                          int32_t* flags, void* stream);

/* rows[slot_of_route[t, j]] = x[t] for every kept route of every t < T (x [T_max, H]). Rows of
 * `rows` no route points at are not written. Forward: x; backward: dy. */
capmoe_status_t capmoe_ep_gather_rows(const capmoe_ep_desc_t* desc, const void* x,
                                      const int32_t* slot_of_route, int64_t num_tokens,
                                      const int32_t* num_tokens_device, void* rows, void* stream);

/* y[t] = sum over kept routes j of rows[slot_of_route[t, j]] (fp32 sum in ascending j, rounded
 * once); 0 for a token with no kept route; t < T. Forward: the experts' prob-weighted outputs
 * coming back; backward: dx. */
capmoe_status_t capmoe_ep_reduce_rows(const capmoe_ep_desc_t* desc, const void* rows,
                                      const int32_t* slot_of_route, int64_t num_tokens,
                                      const int32_t* num_tokens_device, void* y, void* stream);

/* out[t, j] = values[slot_of_route[t, j]] for kept routes, 0 otherwise; t < T (values
 * [R, capacity] f32; backward: the dprobs coming back). */
capmoe_status_t capmoe_ep_gather_route_values(const capmoe_ep_desc_t* desc, const float* values,
                                              const int32_t* slot_of_route, int64_t num_tokens,
                                              const int32_t* num_tokens_device, float* out,
                                              void* stream);

/* Echo weights, home side: for every peer q and its local slot s, with e = slot_expert[q * S_per
 * + s] a home expert of this rank (e / L == rank), copies home[e - rank * L] (bytes_per_expert
 * bytes; home [L, bytes_per_expert]) to send[q, s] (send [R, S_per, bytes_per_expert]). Other
 * entries are not written. Requires S_per >= 1. flags may not be NULL. */
capmoe_status_t capmoe_ep_pack_spare_weights(const capmoe_ep_desc_t* desc,
                                             const int64_t* slot_expert, const void* home,
                                             int64_t bytes_per_expert, void* send,
                                             int32_t* flags, void* stream);

/* Echo weights, slot side: for every local slot s with e = slot_expert[rank * S_per + s] >= 0,
 * spare[s] = recv[e / L, s] (recv [R, S_per, bytes_per_expert] as received from every peer,
 * spare [S_per, bytes_per_expert]). Empty slots are not written. flags may not be NULL. */
capmoe_status_t capmoe_ep_select_spare_weights(const capmoe_ep_desc_t* desc,
                                               const int64_t* slot_expert, const void* recv,
                                               int64_t bytes_per_expert, void* spare,
                                               int32_t* flags, void* stream);

/* Echo gradients, home side: for every global slot j = q * S_per + s in ascending order whose
 * expert e = slot_expert[j] is a home expert of this rank, dw_home[e - rank * L] += recv[q, s]
 * (fp32, per_expert elements each; recv [R, S_per, per_expert] as received from every peer,
 * each peer having sent its own [S_per, per_expert] spare-slot gradients; dw_home
 * [L, per_expert]). Bitwise deterministic. flags may not be NULL. */
capmoe_status_t capmoe_ep_fold_spare_grads(const capmoe_ep_desc_t* desc,
                                           const int64_t* slot_expert, const float* recv,
                                           int64_t per_expert, float* dw_home, int32_t* flags,
                                           void* stream);

#ifdef __cplusplus
}
#endif

#endif
