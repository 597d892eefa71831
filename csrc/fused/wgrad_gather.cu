// capmoe-archs: 90a 100a
// The gathered wgrad's C ABI (capturable_moe/wgrad_gather.h): host checks and the dispatch to
// the sm_90a kernel (csrc/fused/wgrad_gather_sm90.cu) on compute capability 9.0 or the sm_100a
// one (csrc/fused/wgrad_gather_sm100.cu; the same parameters) on 10.0. Built for every arch so
// the entry points always exist; a device or binary without the kernel gets
// CAPMOE_ERR_UNSUPPORTED. Only kernels of archs compiled into this binary are referenced
// (CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100).
#include <cstdint>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "fused/entry.h"
#include "fused/fc1_layout.h"
#include "fused/tile_schedule.cuh"
#include "fused/wgrad_gather_launch.h"

static_assert(CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS == capmoe::fused::TileSchedule::kWords,
              "the C ABI's schedule words are the kernel's");

namespace capmoe::fused {
namespace {

int64_t tiles_of(int64_t extent, int64_t tile) { return (extent + tile - 1) / tile; }

bool is_rows(capmoe_wgrad_rows_t r) { return r == CAPMOE_WGRAD_ROWS_PLAIN || r == CAPMOE_WGRAD_ROWS_GATHERED; }

// Every output tile of every expert; the kernel indexes them with int32. The product is taken
// in 128 bits and saturated: E (up to INT32_MAX) times both tile counts can pass int64.
int64_t total_tiles(const capmoe_wgrad_gather_desc_t& d) {
  const unsigned __int128 tiles = (unsigned __int128)d.num_experts * tiles_of(d.m, CAPMOE_WGRAD_GATHER_TILE_M) *
                                  tiles_of(d.n, CAPMOE_WGRAD_GATHER_TILE_N);
  return tiles > INT64_MAX ? INT64_MAX : int64_t(tiles);
}

capmoe_status_t check_desc(const capmoe_wgrad_gather_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->m < 8 || d->m > INT32_MAX || d->n < 8 || d->n > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > kMaxSteppedExtent) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->max_tokens < 0 || d->max_tokens > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->sm_count < 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->accumulate != 0 && d->accumulate != 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (!is_rows(d->a_rows) || !is_rows(d->b_rows)) return CAPMOE_ERR_INVALID_ARGUMENT;
  // 16-byte chunks: every row of a, b and dW starts on one.
  if (d->m % 8 != 0 || d->n % 8 != 0) return CAPMOE_ERR_MISALIGNED;
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  if (d->out_dtype != d->dtype && d->out_dtype != CAPMOE_DTYPE_F32) return CAPMOE_ERR_UNSUPPORTED;
  if (d->accumulate && d->out_dtype != CAPMOE_DTYPE_F32) return CAPMOE_ERR_UNSUPPORTED;
  if (!persistent_loop_fits_int(total_tiles(*d), d->sm_count)) return CAPMOE_ERR_UNSUPPORTED;
  // The producer addresses a gathered operand's 16-byte chunks in 32 bits (64 GB of it).
  if (d->a_rows == CAPMOE_WGRAD_ROWS_GATHERED && !gather_source_fits(d->max_tokens, d->m)) return CAPMOE_ERR_UNSUPPORTED;
  if (d->b_rows == CAPMOE_WGRAD_ROWS_GATHERED && !gather_source_fits(d->max_tokens, d->n)) return CAPMOE_ERR_UNSUPPORTED;
  return CAPMOE_OK;
}

using WgradKernel = FusedArch;

// The kernel of the current device (built_device_arch, fused/entry.h).
capmoe_status_t check_device(WgradKernel* kernel) {
  return built_device_arch(CAPMOE_HAS_SM90, CAPMOE_HAS_SM100, kernel);
}

// The pointer checks of a launch, before any CUDA call.
capmoe_status_t check_pointers(const capmoe_wgrad_gather_desc_t& d, const void* a, const void* b,
                               const int64_t* offsets, const int32_t* token_of_row, const void* dw,
                               const int32_t* schedule) {
  if (offsets == nullptr || dw == nullptr || schedule == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  const bool gathers = d.a_rows == CAPMOE_WGRAD_ROWS_GATHERED || d.b_rows == CAPMOE_WGRAD_ROWS_GATHERED;
  // With capacity 0 no row exists, so nothing of a, b or token_of_row is read.
  if (d.capacity > 0 && (a == nullptr || b == nullptr || (gathers && token_of_row == nullptr)))
    return CAPMOE_ERR_INVALID_ARGUMENT;
  CAPMOE_TRY(capmoe::check_aligned(16, {a, b, dw}));
  CAPMOE_TRY(capmoe::check_aligned(8, {offsets}));
  CAPMOE_TRY(capmoe::check_aligned(4, {token_of_row, schedule}));
  return CAPMOE_OK;
}

}  // namespace
}  // namespace capmoe::fused

using namespace capmoe::fused;

extern "C" capmoe_status_t capmoe_wgrad_gather_supported(const capmoe_wgrad_gather_desc_t* desc) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    WgradKernel kernel{};
    return check_device(&kernel);
  });
}

extern "C" capmoe_status_t capmoe_wgrad_gather(const capmoe_wgrad_gather_desc_t* desc, const void* a, const void* b,
                                               const int64_t* offsets, const int32_t* token_of_row, void* dw,
                                               int32_t* schedule, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    const capmoe_wgrad_gather_desc_t& d = *desc;
    CAPMOE_TRY(check_pointers(d, a, b, offsets, token_of_row, dw, schedule));
    WgradKernel kernel{};
    CAPMOE_TRY(check_device(&kernel));
#if CAPMOE_FUSED_HAS_KERNEL
    // Accumulating with no row anywhere leaves dW as it is.
    if (d.accumulate && d.capacity == 0) return CAPMOE_OK;
    WgradGatherParams p{};
    p.a = a;
    p.b = b;
    p.offsets = offsets;
    p.token_of_row = token_of_row;
    p.dw = dw;
    p.experts = int32_t(d.num_experts);
    p.m = int32_t(d.m);
    p.n = int32_t(d.n);
    p.capacity = int32_t(d.capacity);
    p.max_tokens = int32_t(d.max_tokens);
    p.a_gathered = d.a_rows == CAPMOE_WGRAD_ROWS_GATHERED;
    p.b_gathered = d.b_rows == CAPMOE_WGRAD_ROWS_GATHERED;
    p.accumulate = d.accumulate;
    p.m_tiles = int32_t(tiles_of(d.m, CAPMOE_WGRAD_GATHER_TILE_M));
    p.n_tiles = int32_t(tiles_of(d.n, CAPMOE_WGRAD_GATHER_TILE_N));
    p.schedule = schedule;
    const int grid = persistent_grid(total_tiles(d), d.sm_count);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CAPMOE_HAS_SM100
    if (kernel == WgradKernel::Sm100) return launch_wgrad_gather_sm100(p, d.dtype, d.out_dtype, grid, s);
#endif
#if CAPMOE_HAS_SM90
    if (kernel == WgradKernel::Sm90) return launch_wgrad_gather_sm90(p, d.dtype, d.out_dtype, grid, s);
#endif
    return CAPMOE_ERR_UNSUPPORTED;
#else
    return CAPMOE_ERR_UNSUPPORTED;
#endif
  });
}
