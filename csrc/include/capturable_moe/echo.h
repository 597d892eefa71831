/* Echo rerouting: the Megatron offloading planner (spec echo-planner.md, stages P1-P9) and the
 * spare-slot weight kernels, all capturable (no host sync, no allocation, no host read).
 *
 * Notation: EP ranks, E home experts (L = E / EP per rank), S_per spare slots per rank,
 * S = EP * S_per slots in total, slot j on rank j / S_per. T tokens on this rank, k routes each.
 *
 * Device buffers:
 *   counts       [EP, E]      int64  C[r][e], tokens of source rank r routed to expert e
 *   state        [state_len]  int64  the plan (P1-P7), layout in capmoe_echo_layout_t; every
 *                                    section is written by every launch sequence (F and D: the
 *                                    rows of non-empty slots; the offload map by the reroute
 *                                    launch when T > 0, else by the plan launch); 16-byte
                                    aligned
 *   workspace    [workspace_len] int32  per-token-tile expert counts (reroute launches only)
 *   routing_map  [T, E]       uint8  Megatron form (nonzero = routed), probs [T, E] float32
 *   out_map      [T, E+S]     uint8  0/1, columns interleaved per rank (spec P9):
 *                                    home e -> (e/L)*(L+S_per) + e%L, slot j -> (j/S_per)*(L+S_per)+L+j%S_per
 *   out_probs    [T, E+S]     float32, bit-exact copy of the routed probability, 0 elsewhere
 *   expert_ids   [T, k]       int32  top-k form; ids distinct within a token, in [0, E)
 *   out_dest     [T, k]       int32  final interleaved column of every route (-1: bad id)
 *   out_probs_k  [T, k]       float32 (optional) the route's probability, copied bit-exact
 *
 * Token count of the reroute launches: `num_tokens` (host) and `num_tokens_device` (const
 * int32*, may be NULL). Without the device pointer T = num_tokens. With it, T is its value read
 * on the GPU and clamped into [0, num_tokens] (a value outside sets CAPMOE_ECHO_ERR_BAD_TOKENS,
 * also when num_tokens is 0),
 * so one captured graph serves every T up to that bound: the launches are sized for
 * num_tokens, and token rows t >= T of the outputs are not written. num_tokens <= the t_max the
 * workspace was sized for.
 *
 * Cost of a reroute launch: one block per tile of 32*W tokens (W <= 32 bitmask words per
 * expert, fewer for large E or k; about 128 tiles up to ~128k tokens, more beyond). Each block
 * sums the per-expert counts of every earlier tile, so that part grows as tiles^2 * E: ~8
 * MB of L2 reads in all at 128 tiles, ~0.5 GB at 1024 tiles (E = 256, T ~ 1M). Arithmetic, not a
 * measurement.
 *
 * Alignment: state 16 bytes; every other array its element's size (int64 8, int32 / float 4,
 * uint8 1). A misaligned pointer is CAPMOE_ERR_MISALIGNED before anything is launched.
 *
 * Device-side errors never cause an out-of-bounds access; they set bits in state[off_error]
 * (see CAPMOE_ECHO_ERR_*). Each plan launch overwrites the word; reroute launches OR into it.
 * Every kernel is deterministic (bitwise identical outputs for identical inputs). */
#ifndef CAPTURABLE_MOE_ECHO_H
#define CAPTURABLE_MOE_ECHO_H

#include <stdint.h>

#include "capturable_moe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CAPMOE_ECHO_GREEDY = 0, CAPMOE_ECHO_APPROX = 1 };

/* Bits of the device error word. */
enum {
  CAPMOE_ECHO_ERR_NEGATIVE_COUNT = 1,     /* some C[r][e] < 0: the plan was zeroed (nothing moves) */
  CAPMOE_ECHO_ERR_COUNT_TOO_LARGE = 2,    /* some n[e] >= 2^24: the plan was zeroed */
  CAPMOE_ECHO_ERR_ROUTING_MISMATCH = 4,   /* column sums of the routing != C[ep_rank] */
  CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE = 8,/* an expert id outside [0, E): that route gets -1 */
  CAPMOE_ECHO_ERR_DUPLICATE_ROUTE = 16,   /* a token lists one expert twice (top-k form) */
  CAPMOE_ECHO_ERR_INTERNAL = 32,          /* a spec invariant failed (sum F + D != H) */
  CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT = 64,   /* weight kernels: slot_expert outside [-1, E) */
  CAPMOE_ECHO_ERR_BAD_TOKENS = 128        /* the device token count was outside [0, num_tokens] */
};

typedef struct capmoe_echo_config_t {
  int64_t ep;
  int64_t num_experts;
  int64_t spare_per_rank;
  int64_t ep_rank;
  int64_t topk;
  int32_t algorithm; /* CAPMOE_ECHO_GREEDY or CAPMOE_ECHO_APPROX (needs spare_per_rank == 1) */
  float threshold_multiplier; /* P3 reclaim, greedy only, off when <= 0; finite */
} capmoe_echo_config_t;

/* Offsets (in int64 elements) of every section of the plan state. Sections marked int64 hold
 * one int64 per entry; sections marked int32 hold packed int32 from that int64 element on
 * (16-byte aligned). Matrices are row-major.
 *
 * F and D are stored transposed, one row per slot ([S, EP]); only the rows of slots with a
 * home expert (slot_expert[j] >= 0) are written, the rows of empty slots are left as they were
 * (F and D are 0 there by definition). Ftot = F + D and the [EP, E] home-offload matrices of
 * the spec (P5's C - C1, P7's C - C2) are sums of these rows over each expert's slots and are
 * not stored. */
typedef struct capmoe_echo_layout_t {
  int64_t state_len;                 /* int64 elements */
  int64_t off_error;                 /* int64 [1]  CAPMOE_ECHO_ERR_* bits */
  int64_t off_avg;                   /* int64 [1]  P1 avg */
  int64_t off_tokens_per_expert;     /* int64 [E]  P1 n */
  int64_t off_load_per_rank;         /* int64 [EP] P1 load */
  int64_t off_spill;                 /* int64 [E]  P1 spill */
  int64_t off_spare_capacity;        /* int64 [EP] P1 cap */
  int64_t off_pre_reclaim_expert;    /* int64 [S]  P2 supplier of slot j before reclaim (-1 none) */
  int64_t off_pre_reclaim_tokens;    /* int64 [S]  P2 H[expert][j] before reclaim */
  int64_t off_slot_tokens;           /* int64 [S]  P3 H[slot_expert[j]][j] (0 for empty slots) */
  int64_t off_slot_expert;           /* int64 [S]  P4 home expert of slot j, -1 = empty */
  int64_t off_remaining_capacity;    /* int64 [S]  P5 Rm[slot_expert[j]][j] (0 for empty slots) */
  int64_t off_load_after;            /* int64 [EP] load of each rank after rerouting */
  int64_t off_first_pass;            /* int32 [S, EP] P5 F transposed: F[r][j] at j * EP + r */
  int64_t off_second_pass;           /* int32 [S, EP] P6 D transposed: D[r][j] at j * EP + r */
  int64_t off_slot_route;            /* int32 [S, 4] per slot j: slot_expert[j], next higher slot
                                        fed by the same expert (-1 none), start and end of slot j's
                                        range in that expert's token list on rank ep_rank
                                        (end - start = Ftot[ep_rank][j]; the balanced count in
                                        the capped form); -1, -1, 0, 0 if empty */
  int64_t off_expert_route;          /* int32 [E, 2] per expert e: lowest slot fed by e (-1 none),
                                        home_offload[ep_rank][e] (tokens of ep_rank moved off e) */
  int64_t off_offload_map;           /* E*S bytes: M[e][j] = 1 iff slot_expert[j] == e */
} capmoe_echo_layout_t;

/* Validates the configuration (E % EP == 0, 1 <= S_per <= E, approx => S_per == 1,
 * 0 <= ep_rank < EP, E <= 1024, S <= 1024, topk in [1, E]) and fills the layout; also the int32
 * workspace length the reroute launches need for up to t_max tokens. Host only. */
capmoe_status_t capmoe_echo_layout(const capmoe_echo_config_t* cfg, int64_t t_max,
                                   capmoe_echo_layout_t* layout, int64_t* workspace_len);

/* P1-P7 from counts into state (one launch, one block). No host sync, no allocation. */
capmoe_status_t capmoe_echo_plan(const capmoe_echo_config_t* cfg, const int64_t* counts,
                                 int64_t* state, void* stream);

/* P1-P9, Megatron form: plan + reroute of this rank's [T, E] routing map (two launches, the
 * second a programmatic dependent launch that loads its token tile while the plan runs). T as
 * described above. No host sync, no allocation. */
capmoe_status_t capmoe_echo_plan_reroute_dense(const capmoe_echo_config_t* cfg,
                                               const int64_t* counts, const uint8_t* routing_map,
                                               const float* probs, int64_t num_tokens,
                                               const int32_t* num_tokens_device,
                                               int64_t* state, int32_t* workspace,
                                               int64_t workspace_len, uint8_t* out_map,
                                               float* out_probs, void* stream);

/* P1-P9, top-k form: plan + rewrite of [T, k] expert ids to final columns (two launches, as the
 * dense form). out_probs may be NULL. No host sync, no allocation. */
capmoe_status_t capmoe_echo_plan_reroute_topk(const capmoe_echo_config_t* cfg,
                                              const int64_t* counts, const int32_t* expert_ids,
                                              const float* probs, int64_t num_tokens,
                                              const int32_t* num_tokens_device,
                                              int64_t* state, int32_t* workspace,
                                              int64_t workspace_len, int32_t* out_dest,
                                              float* out_probs, void* stream);

/* The top-k form with block balancing, for expert parallelism (an extension beyond the spec):
 * after P7 this rank's routes are moved among the columns of each expert that has a spare
 * slot, so that no peer (rank q: final columns [q (L + S_per), (q + 1) (L + S_per))) receives
 * more than block_capacity of them wherever another column of the expert has room. For every
 * peer over the capacity in ascending order, for its columns in ascending order: up to the
 * excess moves, repeatedly, to the expert's column on another peer with the most room
 * (block_capacity minus its routes; ties: the lowest column), at most that room at a time; a
 * move never fills a peer past the capacity. The reroute then follows the new counts with the
 * spec's range rule (each slot the next part of the expert's token list in slot order, the
 * home column the rest). Only this rank's sections change: slot_route's ranges and
 * expert_route's home_offload hold the balanced counts; F, D, load_after are the plan's. A
 * plan zeroed for invalid counts (or failing an invariant) is left as it is. Deterministic;
 * the CPU twin is echo::reference::balance_blocks. block_capacity in [0, INT32_MAX]. */
capmoe_status_t capmoe_echo_plan_reroute_topk_capped(const capmoe_echo_config_t* cfg,
                                                     int64_t block_capacity,
                                                     const int64_t* counts,
                                                     const int32_t* expert_ids,
                                                     const float* probs, int64_t num_tokens,
                                                     const int32_t* num_tokens_device,
                                                     int64_t* state, int32_t* workspace,
                                                     int64_t workspace_len, int32_t* out_dest,
                                                     float* out_probs, void* stream);

/* The most slots one call of the two spare-slot weight functions below handles (num_slots;
 * more is CAPMOE_ERR_INVALID_ARGUMENT). */
enum { CAPMOE_ECHO_MAX_WEIGHT_SLOTS = 8192 };

/* Spare-slot weights: for every local slot i in [0, num_slots) with e = slot_expert[slot_begin + i]
 * >= 0, copies bytes_per_expert bytes from home + e * bytes_per_expert to spare + i *
 * bytes_per_expert. Slots with -1 are left untouched. error_flags (nullable) gets
 * CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT for an id outside [-1, E) (that slot is skipped). */
capmoe_status_t capmoe_echo_fill_spare_weights(const int64_t* slot_expert, int64_t num_experts,
                                               int64_t slot_begin, int64_t num_slots,
                                               const void* home, void* spare,
                                               int64_t bytes_per_expert, int64_t* error_flags,
                                               void* stream);

/* Backward fold: dw_home[e][i] += dw_slot[j][i] for every slot j in [0, num_slots) with
 * slot_expert[j] == e, fp32, summed in ascending j onto the existing value (deterministic).
 *
 * Both functions: E * and num_slots * the bytes per expert must fit in int64, slot_begin +
 * num_slots too (else CAPMOE_ERR_INVALID_ARGUMENT); slot_expert and error_flags 8-byte,
 * dw_slot and dw_home 4-byte aligned (else CAPMOE_ERR_MISALIGNED); home / spare any alignment
 * (16-byte aligned with bytes_per_expert % 16 == 0 takes the vector path). */
capmoe_status_t capmoe_echo_fold_spare_grads(const int64_t* slot_expert, int64_t num_experts,
                                             int64_t num_slots, const float* dw_slot,
                                             float* dw_home, int64_t elems_per_expert,
                                             int64_t* error_flags, void* stream);

#ifdef __cplusplus
}
#endif

#endif
