// capmoe-archs: 90a 100a
// The fused fc1 C ABI (capturable_moe/fused.h): host checks, TMA descriptor encoding and the
// dispatch to the sm_90a kernel (csrc/fused/fc1_sm90.cu). Built for every arch so the entry
// points always exist; a device or binary without the kernel gets CAPMOE_ERR_UNSUPPORTED.
// Only kernels of archs compiled into this binary are referenced (CAPMOE_HAS_SM90).
#include <cudaTypedefs.h>

#include <cstdint>

#include "common/alignment.h"
#include "common/boundary.cuh"
#include "fused/fc1_launch.h"

namespace capmoe::fused {
namespace {

capmoe_status_t check_desc(const capmoe_fused_fc1_desc_t* d) {
  if (d == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->num_experts < 1 || d->num_experts > CAPMOE_FUSED_MAX_EXPERTS) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden < 8 || d->hidden > INT32_MAX || d->ffn < 8 || d->ffn > INT32_MAX / 2)
    return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->max_tokens < 0 || d->max_tokens > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->capacity < 0 || d->capacity > INT32_MAX) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->sm_count < 1) return CAPMOE_ERR_INVALID_ARGUMENT;
  if (d->hidden % 8 != 0) return CAPMOE_ERR_MISALIGNED;
  if (d->dtype != CAPMOE_DTYPE_BF16 && d->dtype != CAPMOE_DTYPE_F16) return CAPMOE_ERR_UNSUPPORTED;
  if (d->ffn % CAPMOE_FUSED_FC1_TILE_N != 0) return CAPMOE_ERR_UNSUPPORTED;
  // The kernel indexes tiles with int32.
  if (fc1_max_tiles(d->num_experts, d->capacity, d->ffn) > INT32_MAX) return CAPMOE_ERR_UNSUPPORTED;
  if (d->gather < CAPMOE_FUSED_GATHER_AUTO || d->gather > CAPMOE_FUSED_GATHER_CP_ASYNC) return CAPMOE_ERR_INVALID_ARGUMENT;
  return CAPMOE_OK;
}

// The kernel exists for the current device: an sm_90a build running on compute capability 9.0.
capmoe_status_t check_device() {
#if defined(CAPMOE_HAS_SM90)
  int device = 0, major = 0, minor = 0;
  CAPMOE_TRY(cuda_status(cudaGetDevice(&device)));
  CAPMOE_TRY(cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)));
  CAPMOE_TRY(cuda_status(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)));
  return major == 9 && minor == 0 ? CAPMOE_OK : CAPMOE_ERR_UNSUPPORTED;
#else
  return CAPMOE_ERR_UNSUPPORTED;
#endif
}

#if defined(CAPMOE_HAS_SM90)
// cuTensorMapEncodeTiled through the runtime's driver entry point (the crate does not link
// libcuda; cudarc loads it at run time).
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result) !=
            cudaSuccess ||
        result != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A 128B-swizzled map over a row-major tensor of `rank` dims (dims[0] contiguous) whose box is
// 64 elements (128 bytes) wide.
capmoe_status_t encode(CUtensorMap* map, capmoe_dtype_t dtype, const void* base, cuuint32_t rank,
                       const cuuint64_t* dims, const cuuint64_t* strides_bytes, const cuuint32_t* box) {
  const auto fn = encode_fn();
  if (fn == nullptr) return CAPMOE_ERR_UNSUPPORTED;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      dtype == CAPMOE_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = fn(map, type, rank, const_cast<void*>(base), dims, strides_bytes, box, element_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? CAPMOE_OK : CAPMOE_ERR_INVALID_ARGUMENT;
}
#endif

}  // namespace

int64_t fc1_max_tiles(int64_t experts, int64_t capacity, int64_t ffn) {
  // Every expert adds at most one partial M tile to the full ones.
  return ((capacity + 127) / 128 + experts) * (ffn / CAPMOE_FUSED_FC1_TILE_N);
}

}  // namespace capmoe::fused

using namespace capmoe::fused;

extern "C" capmoe_status_t capmoe_fused_fc1_supported(const capmoe_fused_fc1_desc_t* desc) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    CAPMOE_TRY(check_device());
#if defined(CAPMOE_HAS_SM90)
    // Resolve the driver's encoder now (plan time), not inside a first launch under capture.
    if (encode_fn() == nullptr) return CAPMOE_ERR_UNSUPPORTED;
#endif
    return CAPMOE_OK;
  });
}

extern "C" capmoe_status_t capmoe_fused_fc1(const capmoe_fused_fc1_desc_t* desc, const void* x, const void* w1,
                                            const int64_t* offsets, const int32_t* token_of_row, void* act,
                                            void* h, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_desc(desc));
    const capmoe_fused_fc1_desc_t& d = *desc;
    if (offsets == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(8, {offsets}));
    if (d.capacity == 0) return CAPMOE_OK;  // no row can be written
    if (x == nullptr || w1 == nullptr || token_of_row == nullptr || act == nullptr)
      return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(capmoe::check_aligned(16, {x, w1, act, h}));
    CAPMOE_TRY(capmoe::check_aligned(4, {token_of_row}));
    CAPMOE_TRY(check_device());
#if defined(CAPMOE_HAS_SM90)
    if (d.max_tokens == 0) return CAPMOE_OK;  // capacity > 0 but no token: build maps nothing
    Fc1Params p{};
    const cuuint64_t elem = 2;
    const cuuint64_t x_dims[2] = {cuuint64_t(d.hidden), cuuint64_t(d.max_tokens)};
    const cuuint64_t x_strides[1] = {cuuint64_t(d.hidden) * elem};
    const cuuint32_t x_box[2] = {64, 1};
    CAPMOE_TRY(encode(&p.x_map, d.dtype, x, 2, x_dims, x_strides, x_box));
    const cuuint64_t w_dims[3] = {cuuint64_t(d.hidden), cuuint64_t(2 * d.ffn), cuuint64_t(d.num_experts)};
    const cuuint64_t w_strides[2] = {cuuint64_t(d.hidden) * elem, cuuint64_t(2 * d.ffn * d.hidden) * elem};
    const cuuint32_t w_box[3] = {64, CAPMOE_FUSED_FC1_TILE_N, 1};
    CAPMOE_TRY(encode(&p.w1_map, d.dtype, w1, 3, w_dims, w_strides, w_box));
    p.x = x;
    p.offsets = offsets;
    p.token_of_row = token_of_row;
    p.act = act;
    p.h = h;
    p.experts = int32_t(d.num_experts);
    p.hidden = int32_t(d.hidden);
    p.ffn = int32_t(d.ffn);
    p.max_tokens = int32_t(d.max_tokens);
    p.capacity = int32_t(d.capacity);
    const int64_t tiles = fc1_max_tiles(d.num_experts, d.capacity, d.ffn);
    const int grid = int(tiles < d.sm_count ? tiles : d.sm_count);
    const capmoe_fused_gather_t gather = d.gather == CAPMOE_FUSED_GATHER_AUTO ? CAPMOE_FUSED_GATHER_TMA_ROWS : d.gather;
    return launch_fc1_sm90(p, d.dtype, gather, grid, static_cast<cudaStream_t>(stream));
#else
    return CAPMOE_ERR_UNSUPPORTED;
#endif
  });
}
