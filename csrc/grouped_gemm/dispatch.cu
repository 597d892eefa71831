// capmoe-archs: 90a 100a
// The grouped GEMM C ABI: validates a descriptor on the host, resolves AUTO to a concrete
// configuration from host-known facts only (never from m_splits), and calls the variant.
// Only variants of archs compiled into this binary are referenced (CAPMOE_HAS_SM90/SM100).
#include <cstdint>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "grouped_gemm/variants.h"

#if !defined(CAPMOE_HAS_SM90) || !defined(CAPMOE_HAS_SM100)
#error "dispatch.cu is built by build.rs, which defines CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100"
#endif

namespace capmoe::gg {
namespace {

struct Variant {
  int32_t arch;
  capmoe_gemm_config_t config;
  Majorness majorness;
  capmoe_dtype_t in;
  capmoe_dtype_t out;
  bool reads_c;
  VariantFn fn;
  bool (*takes)(const capmoe_grouped_gemm_desc_t&);  // null: every descriptor of its kind
};

#define CAPMOE_GG_ENTRY(name, arch, config, majorness, in, out, reads_c) \
  {arch, config, Majorness::majorness, CAPMOE_DTYPE_##in, CAPMOE_DTYPE_##out, reads_c != 0, &variant_##name, nullptr},
#define CAPMOE_GG_HAND_ENTRY(name, arch, config, majorness, in, out, reads_c, takes) \
  {arch, config, Majorness::majorness, CAPMOE_DTYPE_##in, CAPMOE_DTYPE_##out, reads_c != 0, &variant_##name, &takes},

constexpr Variant kVariants[] = {
#if CAPMOE_HAS_SM90
    CAPMOE_GG_SM90_VARIANTS(CAPMOE_GG_ENTRY)
    CAPMOE_GG_SM90_HAND_VARIANTS(CAPMOE_GG_HAND_ENTRY)
#endif
#if CAPMOE_HAS_SM100
        CAPMOE_GG_SM100_VARIANTS(CAPMOE_GG_ENTRY)
#endif
            {0, CAPMOE_CONFIG_AUTO, Majorness::RC, -1, -1, false, nullptr, nullptr}};  // sentinel
#undef CAPMOE_GG_ENTRY
#undef CAPMOE_GG_HAND_ENTRY

Majorness majorness_of(const capmoe_grouped_gemm_desc_t& d) {
  const bool transposed = d.weight_layout == CAPMOE_WEIGHT_EKN;
  switch (d.op) {
    case CAPMOE_GEMM_FPROP: return transposed ? Majorness::RR : Majorness::RC;
    case CAPMOE_GEMM_DGRAD: return transposed ? Majorness::RC : Majorness::RR;
    default: return Majorness::CR;  // WGRAD swaps its operands for [E,K,N] instead
  }
}

bool is_16bit_float(capmoe_dtype_t t) { return t == CAPMOE_DTYPE_BF16 || t == CAPMOE_DTYPE_F16; }

// Everything about the descriptor the host can check; see grouped_gemm.h for the contract.
capmoe_status_t validate(const capmoe_grouped_gemm_desc_t* d) {
  if (!d) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->op < CAPMOE_GEMM_FPROP || d->op > CAPMOE_GEMM_WGRAD) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > 65535) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->n < 8 || d->k < 8 || d->n > INT32_MAX || d->k > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity >= INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->sm_count < 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->weight_layout != CAPMOE_WEIGHT_ENK && d->weight_layout != CAPMOE_WEIGHT_EKN) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->split_dtype != CAPMOE_DTYPE_I32 && d->split_dtype != CAPMOE_DTYPE_I64) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (!is_16bit_float(d->dtype)) return CAPMOE_ERR_UNSUPPORTED;
  const bool wgrad = d->op == CAPMOE_GEMM_WGRAD;
  if (d->out_dtype != d->dtype && !(wgrad && d->out_dtype == CAPMOE_DTYPE_F32)) return CAPMOE_ERR_UNSUPPORTED;
  if (d->accumulate && !(wgrad && d->out_dtype == CAPMOE_DTYPE_F32)) return CAPMOE_ERR_UNSUPPORTED;
  // TMA moves 16-byte rows: every leading dimension must be a multiple of 8 elements.
  if (d->n % 8 != 0 || d->k % 8 != 0) return CAPMOE_ERR_MISALIGNED;
  // Every operand's size in bytes (at most 4 per element) must fit in int64, the type of the
  // device's offsets. n, k <= 2^31 and E <= 2^16 keep these products within unsigned 128 bits.
  const unsigned __int128 weight_bytes = (unsigned __int128)d->num_experts * d->n * d->k * 4;
  const unsigned __int128 rows_bytes = (unsigned __int128)(d->capacity + 1) * (d->n > d->k ? d->n : d->k) * 4;
  if (weight_bytes > INT64_MAX || rows_bytes > INT64_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  return CAPMOE_OK;
}

bool has_variant(const capmoe_grouped_gemm_desc_t& d, capmoe_gemm_config_t config, VariantFn* fn = nullptr) {
  const Majorness majorness = majorness_of(d);
  for (const Variant& v : kVariants) {
    if (v.fn && v.arch == d.arch && v.config == config && v.majorness == majorness && v.in == d.dtype &&
        v.out == d.out_dtype && v.reads_c == (d.accumulate != 0) && (v.takes == nullptr || v.takes(d))) {
      if (fn) *fn = v.fn;
      return true;
    }
  }
  return false;
}

// The AUTO heuristic, from host facts only (E, N, K, capacity, op, dtypes, weight form; never
// m_splits): an ordered list of configurations, of which the first one this build has a kernel
// for (that takes the descriptor) wins.
// SM90 (bench/README.md has the sweeps behind it; H100, 2026-11-23 and 2026-11-28; H200,
// 2026-11-29 for SM90_COUNTER):
//  - FPROP/DGRAD at most 64 rows per expert on average (decode), or with an output at least a
//    third as wide as the reduction: the crate's own counter-scheduled kernel
//    (grouped_gemm/counter.h, where it takes the descriptor: one weight tensor, <= 1024
//    experts). Since its tiles take up to 16 rows past 128 (2026-11-29, second sweep) it is
//    level with the CUTLASS kernels or up to 8 % ahead under uniform and zipf routing on every
//    E >= 32 shape but dsv3's fc2 dgrad (output 2048, reduction 7168: level uniform, 3-6 %
//    behind zipf), which keeps:
//  - FPROP/DGRAD with at most 64 rows per expert on average (decode), or a short reduction
//    (K <= 1024: the expert's fc2 in fprop): the 64x256 pingpong, whose alternating
//    warpgroups hide each tile's epilogue behind the other's mainloop. (A 64x128 pingpong
//    was AUTO's decode kernel until the H200 sweep of 2026-11-28 found the two within 3 % at
//    decode, the wider one ahead in 3 of 4 cases; it was deleted for CI time.)
//  - otherwise 128x256 cooperative without a cluster: the 2x1 cluster lost on every E >= 32
//    shape by 10-15 %, and on mixtral's dense-sized experts (fprop 1.11x, dgrad 1.03-1.16x);
//  - WGRAD (its reduction is the expert's row count) with a 16-bit dW: the counter kernel's
//    wgrad (grouped_gemm/sm90_counter_wgrad.cu). H200, 2026-11-29, two calls (bench/results/
//    gemm_counter_wgrad_NVIDIA_H200.txt): 4-28 % faster than the clustered cooperative on
//    every E >= 32 shape, 36 % at decode, level on mixtral's 1024-row experts;
//  - WGRAD with an fp32 dW (or where the counter kernel does not go): 128x256 cooperative with
//    the 2x1 cluster. The clustered kernel's fprop / dgrad forms and the no-cluster wgrad won
//    no swept case on the H100 or the H200 and were deleted (they cost CI time), so
//    SM90_COOPERATIVE is a wgrad config and SM90_COOPERATIVE_NOCLUSTER a fprop / dgrad one; a
//    forced config without a kernel is UNSUPPORTED.
// SM100: the 2-SM kernel needs 256-row tiles to pay off, so it is used from 256 rows per
// expert; WGRAD always 1-SM. (No Blackwell GPU has run these.)
int auto_candidates(const capmoe_grouped_gemm_desc_t& d, capmoe_gemm_config_t out[4]) {
  const int64_t rows_per_expert = d.capacity / d.num_experts;
  const bool wgrad = d.op == CAPMOE_GEMM_WGRAD;
  const int64_t reduction = d.op == CAPMOE_GEMM_FPROP ? d.k : d.n;
  int n = 0;
  if (d.arch == 100) {
    if (!wgrad && rows_per_expert >= 256) out[n++] = CAPMOE_CONFIG_SM100_2SM;
    out[n++] = CAPMOE_CONFIG_SM100_1SM;
    return n;
  }
  if (!wgrad) {
    const int64_t output = d.op == CAPMOE_GEMM_FPROP ? d.n : d.k;
    if (rows_per_expert <= 64 || 3 * output >= reduction) out[n++] = CAPMOE_CONFIG_SM90_COUNTER;
    if (rows_per_expert <= 64 || reduction <= 1024) out[n++] = CAPMOE_CONFIG_SM90_PINGPONG_WIDE;
    out[n++] = CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER;
  } else {
    out[n++] = CAPMOE_CONFIG_SM90_COUNTER;  // 16-bit dW (counter.h); fp32 dW: the cooperative
  }
  out[n++] = CAPMOE_CONFIG_SM90_COOPERATIVE;
  return n;
}

// The configuration `d` runs with: its own, or AUTO's first built candidate. UNSUPPORTED when
// this build has no kernel for it.
capmoe_status_t resolve(const capmoe_grouped_gemm_desc_t& d, capmoe_gemm_config_t* config, VariantFn* fn) {
  if (d.config != CAPMOE_CONFIG_AUTO) {
    *config = d.config;
    return has_variant(d, d.config, fn) ? CAPMOE_OK : CAPMOE_ERR_UNSUPPORTED;
  }
  capmoe_gemm_config_t candidates[4];
  const int count = auto_candidates(d, candidates);
  for (int i = 0; i < count; ++i) {
    if (has_variant(d, candidates[i], fn)) {
      *config = candidates[i];
      return CAPMOE_OK;
    }
  }
  return CAPMOE_ERR_UNSUPPORTED;
}

capmoe_status_t find_variant(const capmoe_grouped_gemm_desc_t& d, VariantFn* fn) {
  CAPMOE_TRY(validate(&d));
  capmoe_gemm_config_t config;
  return resolve(d, &config, fn);
}

}  // namespace
}  // namespace capmoe::gg

extern "C" capmoe_status_t capmoe_grouped_gemm_resolve_config(const capmoe_grouped_gemm_desc_t* desc,
                                                              capmoe_gemm_config_t* config) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(capmoe::gg::validate(desc));
    if (!config) return CAPMOE_ERR_INVALID_ARGUMENT;
    capmoe::gg::VariantFn fn = nullptr;
    return capmoe::gg::resolve(*desc, config, &fn);
  });
}

extern "C" capmoe_status_t capmoe_grouped_gemm_workspace_size(const capmoe_grouped_gemm_desc_t* desc,
                                                              uint64_t* bytes) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (!desc || !bytes) return CAPMOE_ERR_INVALID_ARGUMENT;
    capmoe::gg::VariantFn fn = nullptr;
    CAPMOE_TRY(capmoe::gg::find_variant(*desc, &fn));
    capmoe::gg::Launch launch{desc, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr};
    return fn(launch, bytes);
  });
}

extern "C" capmoe_status_t capmoe_grouped_gemm_run(const capmoe_grouped_gemm_desc_t* desc, const void* a,
                                                   const void* b, void* d, const void* m_splits,
                                                   int32_t* overflow_flags, void* workspace,
                                                   uint64_t workspace_bytes, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (!desc || !a || !b || !d || !m_splits || !workspace) return CAPMOE_ERR_INVALID_ARGUMENT;
    capmoe::gg::VariantFn fn = nullptr;
    CAPMOE_TRY(capmoe::gg::find_variant(*desc, &fn));
    using capmoe::check_aligned;
    CAPMOE_TRY(check_aligned(16, {a, b, d}));
    CAPMOE_TRY(check_aligned(256, {workspace}));
    CAPMOE_TRY(check_aligned(desc->split_dtype == CAPMOE_DTYPE_I64 ? 8 : 4, {m_splits}));
    CAPMOE_TRY(check_aligned(4, {overflow_flags}));  // atomicOr'ed on the device
    capmoe::gg::Launch launch{desc,           a,         b, d, m_splits, overflow_flags, workspace, workspace_bytes,
                              static_cast<cudaStream_t>(stream)};
    return fn(launch, nullptr);
  });
}
