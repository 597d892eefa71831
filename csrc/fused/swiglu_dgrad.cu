// capmoe-archs: 90a 100a
// The fused fc2 dgrad + SwiGLU backward C ABI (capturable_moe/fused.h), both forms (drows, and
// dy gathered through token_of_row): host checks, TMA descriptor encoding and the dispatch to
// the sm_90a kernel (csrc/fused/swiglu_dgrad_sm90.cu) on compute capability 9.0 or the sm_100a
// one (csrc/fused/swiglu_dgrad_sm100.cu, both forms; the same maps and parameters) on 10.0.
// Built for every arch so the entry points always exist; a device or binary without the kernel
// gets CAPMOE_ERR_UNSUPPORTED. Only kernels of archs compiled into this binary are referenced
// (CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100).
#include <cstdint>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "fused/entry.h"
#include "fused/fc1_layout.h"
#include "fused/swiglu_dgrad_launch.h"
#include "fused/tile_list.cuh"
#include "fused/tile_schedule.cuh"

static_assert(CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS == capmoe::fused::TileSchedule::kWords,
              "the C ABI's schedule words are the kernel's");

namespace capmoe::fused {
namespace {

int64_t dgrad_max_tiles(int64_t experts, int64_t capacity, int64_t ffn) {
  return max_tiles(experts, capacity, ffn, kSwigluDgradTileM, CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N);
}

capmoe_status_t check_desc(const capmoe_fused_swiglu_dgrad_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > CAPMOE_FUSED_MAX_EXPERTS) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden < 8 || d->hidden > kMaxSteppedExtent || d->ffn < 8 || d->ffn > INT32_MAX / 2)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->sm_count < 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  // The TMA row stride of drows (H * 2 bytes) must be a multiple of 16 bytes.
  if (d->hidden % 8 != 0) return CAPMOE_ERR_MISALIGNED;
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  if (d->ffn % CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N != 0) return CAPMOE_ERR_UNSUPPORTED;
  // The kernel indexes tiles with int32.
  if (!persistent_loop_fits_int(dgrad_max_tiles(d->num_experts, d->capacity, d->ffn), d->sm_count))
    return CAPMOE_ERR_UNSUPPORTED;
  return CAPMOE_OK;
}

using DgradKernel = FusedArch;

// The kernel of the current device (built_device_arch, fused/entry.h).
capmoe_status_t check_device(DgradKernel* kernel) {
  return built_device_arch(CAPMOE_HAS_SM90, CAPMOE_HAS_SM100, kernel);
}

#if CAPMOE_FUSED_HAS_KERNEL
// The W2 map and the pointers and sizes both forms share.
capmoe_status_t make_common_params(const capmoe_fused_swiglu_dgrad_desc_t& d, const void* w2, const void* h,
                                   const int64_t* offsets, void* dh, SwigluDgradParams* p) {
  const cuuint64_t elem = 2;
  const cuuint64_t hidden = cuuint64_t(d.hidden), ffn = cuuint64_t(d.ffn);
  // w2 [E, H, F] read as (F, H, E): F contiguous, the MN-major B operand of this GEMM.
  const cuuint64_t b_dims[3] = {ffn, hidden, cuuint64_t(d.num_experts)};
  const cuuint64_t b_strides[2] = {ffn * elem, hidden * ffn * elem};
  const cuuint32_t b_box[3] = {64, 64, 1};
  CAPMOE_TRY(tma_encode(&p->w2_map, d.dtype, w2, 3, b_dims, b_strides, b_box));
  p->offsets = offsets;
  p->h = h;
  p->dh = dh;
  p->experts = int32_t(d.num_experts);
  p->hidden = int32_t(d.hidden);
  p->ffn = int32_t(d.ffn);
  p->capacity = int32_t(d.capacity);
  return CAPMOE_OK;
}

// The drows form's parameters: the common ones plus the drows map and dact.
capmoe_status_t make_params(const capmoe_fused_swiglu_dgrad_desc_t& d, const void* drows, const void* w2,
                            const void* h, const int64_t* offsets, void* dh, void* dact, SwigluDgradParams* p) {
  CAPMOE_TRY(make_common_params(d, w2, h, offsets, dh, p));
  // drows: the row extent is capacity, so rows of a last tile past it are zero-filled.
  const cuuint64_t hidden = cuuint64_t(d.hidden);
  const cuuint64_t a_dims[2] = {hidden, cuuint64_t(d.capacity)};
  const cuuint64_t a_strides[1] = {hidden * 2};
  const cuuint32_t a_box[2] = {64, cuuint32_t(kSwigluDgradTileM)};
  CAPMOE_TRY(tma_encode(&p->drows_map, d.dtype, drows, 2, a_dims, a_strides, a_box));
  p->dact = dact;
  return CAPMOE_OK;
}

int grid_of(const capmoe_fused_swiglu_dgrad_desc_t& d) {
  return persistent_grid(dgrad_max_tiles(d.num_experts, d.capacity, d.ffn), d.sm_count);
}
#endif

}  // namespace
}  // namespace capmoe::fused

using namespace capmoe::fused;

extern "C" capmoe_status_t capmoe_fused_swiglu_dgrad_supported(const capmoe_fused_swiglu_dgrad_desc_t* desc) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    // The gathered form's dy past 64 GB (a drows-only caller may leave max_tokens 0).
    if (desc->max_tokens > 0 && !gather_source_fits(desc->max_tokens, desc->hidden)) return CAPMOE_ERR_UNSUPPORTED;
    DgradKernel kernel{};
    CAPMOE_TRY(check_device(&kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    // Resolve the driver's encoder now (plan time), not inside a first launch under capture.
    if (tma_encode_fn() == nullptr) return CAPMOE_ERR_UNSUPPORTED;
#endif
    return CAPMOE_OK;
  });
}

extern "C" capmoe_status_t capmoe_fused_swiglu_dgrad(const capmoe_fused_swiglu_dgrad_desc_t* desc,
                                                     const void* drows, const void* w2, const void* h,
                                                     const int64_t* offsets, void* dh, void* dact,
                                                     int32_t* schedule, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    const capmoe_fused_swiglu_dgrad_desc_t& d = *desc;
    if (offsets == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {offsets}));
    if (d.capacity == 0) return CAPMOE_OK;  // no row can be written
    if (drows == nullptr || w2 == nullptr || h == nullptr || dh == nullptr || schedule == nullptr)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(16, {drows, w2, h, dh, dact}));
    CAPMOE_TRY(capmoe::check_aligned(4, {schedule}));
    DgradKernel kernel{};
    CAPMOE_TRY(check_device(&kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    SwigluDgradParams p{};
    CAPMOE_TRY(make_params(d, drows, w2, h, offsets, dh, dact, &p));
    p.schedule = schedule;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CAPMOE_HAS_SM100
    if (kernel == DgradKernel::Sm100) return launch_swiglu_dgrad_sm100(p, d.dtype, grid_of(d), s);
#endif
#if CAPMOE_HAS_SM90
    if (kernel == DgradKernel::Sm90) return launch_swiglu_dgrad_sm90(p, d.dtype, grid_of(d), s);
#endif
    return CAPMOE_ERR_UNSUPPORTED;
#else
    return CAPMOE_ERR_UNSUPPORTED;
#endif
  });
}

extern "C" capmoe_status_t capmoe_fused_swiglu_dgrad_gathered(const capmoe_fused_swiglu_dgrad_desc_t* desc,
                                                              const void* dy, const void* w2, const void* h,
                                                              const int64_t* offsets, const int32_t* token_of_row,
                                                              const float* prob_of_row, void* dh,
                                                              float* dprob_partials, int32_t* schedule,
                                                              void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    const capmoe_fused_swiglu_dgrad_desc_t& d = *desc;
    // Tokens are compared with max_tokens in int32 on the device.
    if (d.max_tokens < 0 || d.max_tokens > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (!gather_source_fits(d.max_tokens, d.hidden)) return CAPMOE_ERR_UNSUPPORTED;  // dy past 64 GB
    if (offsets == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {offsets}));
    if (d.capacity == 0) return CAPMOE_OK;  // no row can be written
    if (dy == nullptr || w2 == nullptr || h == nullptr || token_of_row == nullptr || prob_of_row == nullptr ||
        dh == nullptr || dprob_partials == nullptr || schedule == nullptr)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    // 16 bytes: the cp.async chunks of dy, w2's TMA, h's and dh's pair accesses (32-bit on
    // sm_90a, 16-byte on sm_100a).
    CAPMOE_TRY(capmoe::check_aligned(16, {dy, w2, h, dh}));
    CAPMOE_TRY(capmoe::check_aligned(4, {token_of_row, prob_of_row, dprob_partials, schedule}));
    DgradKernel kernel{};
    CAPMOE_TRY(check_device(&kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    SwigluDgradParams p{};
    CAPMOE_TRY(make_common_params(d, w2, h, offsets, dh, &p));
    p.dy = dy;
    p.token_of_row = token_of_row;
    p.prob_of_row = prob_of_row;
    p.dprob_partials = dprob_partials;
    p.schedule = schedule;
    p.max_tokens = int32_t(d.max_tokens);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CAPMOE_HAS_SM100
    if (kernel == DgradKernel::Sm100) return launch_swiglu_dgrad_gathered_sm100(p, d.dtype, grid_of(d), s);
#endif
#if CAPMOE_HAS_SM90
    if (kernel == DgradKernel::Sm90) return launch_swiglu_dgrad_gathered_sm90(p, d.dtype, grid_of(d), s);
#endif
    return CAPMOE_ERR_UNSUPPORTED;
#else
    return CAPMOE_ERR_UNSUPPORTED;
#endif
  });
}
