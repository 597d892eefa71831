// The list of compiled grouped GEMM variants, read by the dispatcher (dispatch.cu) and by
// scripts/gen-gemm-instances.sh, which writes the instantiation TUs into inst/ (one per arch and
// majorness, holding each of their variants).
#pragma once

#include "grouped_gemm/counter.h"
#include "grouped_gemm/launch.h"

namespace capmoe::gg {

// Operand majorness of a variant, in CUTLASS terms (A is M x K, B is K x N, D row-major):
//   RC: A row-major, B column-major  (FPROP with [E,N,K] weights, DGRAD with [E,K,N])
//   RR: A row-major, B row-major     (DGRAD with [E,N,K] weights, FPROP with [E,K,N])
//   CR: A column-major, B row-major  (WGRAD, either weight layout)
enum class Majorness { RC, RR, CR };

// Every variant: X(name, arch, config, majorness, in dtype, out dtype, reads C). Variants that
// read C (D = C + AB, the fp32 WGRAD accumulate mode) are separate from plain-output ones, which
// have no source operand at all. inst/<arch>_<majorness>.cu (e.g. inst/sm90_rc.cu) defines
// capmoe::gg::variant_<name> of every variant whose name starts so.
#define CAPMOE_GG_SM90_VARIANTS(X)                                                        \
  X(sm90_cr_bf16_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, BF16, BF16, 0)               \
  X(sm90_cr_bf16_f32_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, BF16, F32, 0)            \
  X(sm90_cr_bf16_f32acc_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, BF16, F32, 1)            \
  X(sm90_cr_f16_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, F16, F16, 0)                  \
  X(sm90_cr_f16_f32_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, F16, F32, 0) \
  X(sm90_cr_f16_f32acc_coop, 90, CAPMOE_CONFIG_SM90_COOPERATIVE, CR, F16, F32, 1) \
  X(sm90_rc_bf16_coopnc, 90, CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER, RC, BF16, BF16, 0) \
  X(sm90_rc_bf16_ppwide, 90, CAPMOE_CONFIG_SM90_PINGPONG_WIDE, RC, BF16, BF16, 0) \
  X(sm90_rr_bf16_coopnc, 90, CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER, RR, BF16, BF16, 0) \
  X(sm90_rr_bf16_ppwide, 90, CAPMOE_CONFIG_SM90_PINGPONG_WIDE, RR, BF16, BF16, 0) \
  X(sm90_rc_f16_coopnc, 90, CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER, RC, F16, F16, 0) \
  X(sm90_rr_f16_coopnc, 90, CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER, RR, F16, F16, 0) \
  X(sm90_rc_f16_ppwide, 90, CAPMOE_CONFIG_SM90_PINGPONG_WIDE, RC, F16, F16, 0) \
  X(sm90_rr_f16_ppwide, 90, CAPMOE_CONFIG_SM90_PINGPONG_WIDE, RR, F16, F16, 0)

#define CAPMOE_GG_SM100_VARIANTS(X)                                                       \
  X(sm100_rc_bf16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, RC, BF16, BF16, 0)                     \
  X(sm100_rc_bf16_2sm, 100, CAPMOE_CONFIG_SM100_2SM, RC, BF16, BF16, 0)                     \
  X(sm100_rr_bf16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, RR, BF16, BF16, 0)                     \
  X(sm100_rr_bf16_2sm, 100, CAPMOE_CONFIG_SM100_2SM, RR, BF16, BF16, 0)                     \
  X(sm100_cr_bf16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, BF16, BF16, 0)                     \
  X(sm100_cr_bf16_f32_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, BF16, F32, 0)                  \
  X(sm100_cr_bf16_f32acc_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, BF16, F32, 1)                  \
  X(sm100_rc_f16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, RC, F16, F16, 0)                        \
  X(sm100_rc_f16_2sm, 100, CAPMOE_CONFIG_SM100_2SM, RC, F16, F16, 0)                        \
  X(sm100_rr_f16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, RR, F16, F16, 0)                        \
  X(sm100_rr_f16_2sm, 100, CAPMOE_CONFIG_SM100_2SM, RR, F16, F16, 0)                        \
  X(sm100_cr_f16_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, F16, F16, 0)                        \
  X(sm100_cr_f16_f32_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, F16, F32, 0) \
  X(sm100_cr_f16_f32acc_1sm, 100, CAPMOE_CONFIG_SM100_1SM, CR, F16, F32, 1)

// Hand-written variants (not CUTLASS instantiations: gen-gemm-instances.sh reads only the X
// lines above), same fields; each defined in its own TU and offered by the dispatcher only where
// its `takes` check holds: H(name, arch, config, majorness, in, out, reads C, takes).
// sm90_counter.cu: the counter-scheduled 128x256 fprop / dgrad kernel, sm90_counter_wgrad.cu its
// wgrad (grouped_gemm/counter.h).
#define CAPMOE_GG_SM90_HAND_VARIANTS(H)                                                            \
  H(sm90_rc_bf16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, RC, BF16, BF16, 0, counter::counter_takes) \
  H(sm90_rr_bf16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, RR, BF16, BF16, 0, counter::counter_takes) \
  H(sm90_rc_f16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, RC, F16, F16, 0, counter::counter_takes)    \
  H(sm90_rr_f16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, RR, F16, F16, 0, counter::counter_takes)    \
  H(sm90_cr_bf16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, CR, BF16, BF16, 0, counter::counter_wgrad_takes) \
  H(sm90_cr_f16_counter, 90, CAPMOE_CONFIG_SM90_COUNTER, CR, F16, F16, 0, counter::counter_wgrad_takes)

#define CAPMOE_GG_DECLARE_VARIANT(name, ...) capmoe_status_t variant_##name(const Launch&, uint64_t*);
CAPMOE_GG_SM90_VARIANTS(CAPMOE_GG_DECLARE_VARIANT)
CAPMOE_GG_SM90_HAND_VARIANTS(CAPMOE_GG_DECLARE_VARIANT)
CAPMOE_GG_SM100_VARIANTS(CAPMOE_GG_DECLARE_VARIANT)
#undef CAPMOE_GG_DECLARE_VARIANT

}  // namespace capmoe::gg
