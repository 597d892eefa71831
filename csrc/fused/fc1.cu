// capmoe-archs: 90a 100a
// The fused fc1 C ABI (capturable_moe/fused.h): host checks, TMA descriptor encoding and the
// dispatch to the sm_90a kernel (csrc/fused/fc1_sm90.cu) on compute capability 9.0 or the
// sm_100a one (csrc/fused/fc1_sm100.cu) on 10.0. Built for every arch so
// the entry points always exist; a device or binary without the kernel gets
// CAPMOE_ERR_UNSUPPORTED. Only kernels of archs compiled into this binary are referenced
// (CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100).
#include <cstdint>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "fused/entry.h"
#include "fused/fc1_launch.h"
#include "fused/fc1_layout.h"
#include "fused/tile_list.cuh"
#include "fused/tile_schedule.cuh"

static_assert(CAPMOE_FUSED_FC1_SCHEDULE_WORDS == capmoe::fused::TileSchedule::kWords,
              "the C ABI's schedule words are the kernel's");

namespace capmoe::fused {
namespace {

// Tiles of 128 rows x TILE_N columns (both kernels); a bound on the persistent grid.
int64_t fc1_max_tiles(int64_t experts, int64_t capacity, int64_t ffn) {
  return max_tiles(experts, capacity, ffn, 128, CAPMOE_FUSED_FC1_TILE_N);
}

capmoe_status_t check_desc(const capmoe_fused_fc1_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > CAPMOE_FUSED_MAX_EXPERTS) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden < 8 || d->hidden > kMaxSteppedExtent || d->ffn < 8 || d->ffn > INT32_MAX / 2)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->max_tokens < 0 || d->max_tokens > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->sm_count < 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden % 8 != 0) return CAPMOE_ERR_MISALIGNED;
  if (!gather_source_fits(d->max_tokens, d->hidden)) return CAPMOE_ERR_UNSUPPORTED;  // x past 64 GB
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  if (d->ffn % CAPMOE_FUSED_FC1_TILE_N != 0) return CAPMOE_ERR_UNSUPPORTED;
  // The kernel indexes tiles with int32.
  if (!persistent_loop_fits_int(fc1_max_tiles(d->num_experts, d->capacity, d->ffn), d->sm_count))
    return CAPMOE_ERR_UNSUPPORTED;
  if (d->gather < CAPMOE_FUSED_GATHER_AUTO || d->gather > CAPMOE_FUSED_GATHER_CP_ASYNC) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->write_rows != 0 && d->write_rows != 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  return CAPMOE_OK;
}

using Fc1Kernel = FusedArch;

// The kernel of the current device (built_device_arch, fused/entry.h).
capmoe_status_t device_kernel(Fc1Kernel* kernel) {
  return built_device_arch(CAPMOE_HAS_SM90, CAPMOE_HAS_SM100, kernel);
}

// The kernel of a launch of `d` on the current device. The one gather form is CP_ASYNC (AUTO
// names it too); value 1, the removed TMA-rows form, is unsupported everywhere. Only the sm_90a
// kernel writes the gathered rows (its consumers copy them out of the stages; the sm_100a
// kernel has no such step).
capmoe_status_t check_device(const capmoe_fused_fc1_desc_t& d, Fc1Kernel* kernel) {
  if (d.gather != CAPMOE_FUSED_GATHER_AUTO && d.gather != CAPMOE_FUSED_GATHER_CP_ASYNC) return CAPMOE_ERR_UNSUPPORTED;
  CAPMOE_TRY(device_kernel(kernel));
  if (d.write_rows != 0 && *kernel != Fc1Kernel::Sm90) return CAPMOE_ERR_UNSUPPORTED;
  return CAPMOE_OK;
}

}  // namespace
}  // namespace capmoe::fused

using namespace capmoe::fused;

extern "C" capmoe_status_t capmoe_fused_fc1_supported(const capmoe_fused_fc1_desc_t* desc) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    Fc1Kernel kernel{};
    CAPMOE_TRY(check_device(*desc, &kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    // Resolve the driver's encoder now (plan time), not inside a first launch under capture.
    if (tma_encode_fn() == nullptr) return CAPMOE_ERR_UNSUPPORTED;
#endif
    return CAPMOE_OK;
  });
}

extern "C" capmoe_status_t capmoe_fused_fc1(const capmoe_fused_fc1_desc_t* desc, const void* x, const void* w1,
                                            const int64_t* offsets, const int32_t* token_of_row,
                                            const float* prob_of_row, void* act, void* h, void* rows,
                                            int32_t* schedule, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    const capmoe_fused_fc1_desc_t& d = *desc;
    if (offsets == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {offsets}));
    if (d.capacity == 0) return CAPMOE_OK;  // no row can be written
    if (x == nullptr || w1 == nullptr || token_of_row == nullptr || act == nullptr || schedule == nullptr)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    if ((rows != nullptr) != (d.write_rows != 0)) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(16, {x, w1, act, h, rows}));
    CAPMOE_TRY(capmoe::check_aligned(4, {token_of_row, prob_of_row, schedule}));
    Fc1Kernel kernel{};
    CAPMOE_TRY(check_device(d, &kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    if (d.max_tokens == 0) return CAPMOE_OK;  // capacity > 0 but no token: build maps nothing
    Fc1Params p{};
    const cuuint64_t elem = 2;
    const cuuint64_t w_dims[3] = {cuuint64_t(d.hidden), cuuint64_t(2 * d.ffn), cuuint64_t(d.num_experts)};
    const cuuint64_t w_strides[2] = {cuuint64_t(d.hidden) * elem, cuuint64_t(2 * d.ffn * d.hidden) * elem};
    const cuuint32_t w_box[3] = {64, CAPMOE_FUSED_FC1_TILE_N, 1};
    CAPMOE_TRY(tma_encode(&p.w1_map, d.dtype, w1, 3, w_dims, w_strides, w_box));
    p.x = x;
    p.offsets = offsets;
    p.token_of_row = token_of_row;
    p.prob_of_row = prob_of_row;
    p.act = act;
    p.h = h;
    p.rows = rows;
    p.schedule = schedule;
    p.experts = int32_t(d.num_experts);
    p.hidden = int32_t(d.hidden);
    p.ffn = int32_t(d.ffn);
    p.max_tokens = int32_t(d.max_tokens);
    p.capacity = int32_t(d.capacity);
    const int grid = persistent_grid(fc1_max_tiles(d.num_experts, d.capacity, d.ffn), d.sm_count);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CAPMOE_HAS_SM100
    if (kernel == Fc1Kernel::Sm100) return launch_fc1_sm100(p, d.dtype, grid, s);
#endif
#if CAPMOE_HAS_SM90
    if (kernel == Fc1Kernel::Sm90) return launch_fc1_sm90(p, d.dtype, grid, s);
#endif
    return CAPMOE_ERR_UNSUPPORTED;
#else
    return CAPMOE_ERR_UNSUPPORTED;
#endif
  });
}
