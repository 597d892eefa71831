// capmoe-archs: 90a 100a
// Fused SwiGLU on the grouped GEMM's fc1 output, elementwise over 16-byte vectors.
// Layout contract: h [capacity, 2F] row-major, columns [0, F) the gate g, [F, 2F) the up u;
// act / dact [capacity, F]. Only rows r < offsets[E] (the device-side total) are read or
// written; rows past it and past `capacity` are never touched.
//   forward   act = silu(g) * u                        silu(g) = g * sigmoid(g)
//   backward  dg = dact * u * s * (1 + g * (1 - s)),  du = dact * silu(g),  s = sigmoid(g)
// Math in fp32 (common/swiglu_math.cuh, shared with the fused kernels), each output rounded
// once.
#include "common/swiglu_math.cuh"
#include "routing/common.cuh"

namespace capmoe {
namespace routing {
namespace {

constexpr int kThreads = 256;

// Rows of this launch: offsets[E] clamped into [0, capacity].
__device__ __forceinline__ unsigned active_vectors(const int64_t* offsets, int E, int capacity,
                                                  int f_vec) {
  long long total = offsets[E];
  total = total < 0 ? 0 : (total > capacity ? capacity : total);
  return static_cast<unsigned>(total) * static_cast<unsigned>(f_vec);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const uint4* __restrict__ h, const int64_t* __restrict__ offsets, int E,
                  int capacity, int f_vec, uint4* __restrict__ act) {
  begin_dependent_kernel();
  const unsigned i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= active_vectors(offsets, E, capacity, f_vec)) return;
  const unsigned row = i / f_vec, col = i - row * f_vec;
  const uint4* h_row = h + static_cast<int64_t>(row) * 2 * f_vec;
  float g[kVec], u[kVec];
  Vec8<T>::load(__ldg(h_row + col), g);
  Vec8<T>::load(__ldg(h_row + f_vec + col), u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) g[j] = swiglu_forward(g[j], u[j]);
  act[i] = Vec8<T>::store(g);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const uint4* __restrict__ dact, const uint4* __restrict__ h,
                           const int64_t* __restrict__ offsets, int E, int capacity, int f_vec,
                           uint4* __restrict__ dh) {
  begin_dependent_kernel();
  const unsigned i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= active_vectors(offsets, E, capacity, f_vec)) return;
  const unsigned row = i / f_vec, col = i - row * f_vec;
  const int64_t h_off = static_cast<int64_t>(row) * 2 * f_vec + col;
  float g[kVec], u[kVec], d[kVec];
  Vec8<T>::load(__ldg(h + h_off), g);
  Vec8<T>::load(__ldg(h + h_off + f_vec), u);
  Vec8<T>::load(__ldg(dact + i), d);
#pragma unroll
  for (int j = 0; j < kVec; ++j) swiglu_backward(d[j], g[j], u[j], g[j], u[j]);  // g <- dg, u <- du
  dh[h_off] = Vec8<T>::store(g);
  dh[h_off + f_vec] = Vec8<T>::store(u);
}

struct Swiglu {
  const capmoe_routing_desc_t* d;
  const void* dact;  // nullptr: forward
  const void* h;
  const int64_t* offsets;
  void* out;
  cudaStream_t stream;
  template <class T, class P>
  capmoe_status_t run() const {
    const int f_vec = static_cast<int>(d->ffn / kVec);
    const int64_t vectors = d->capacity * f_vec;
    if (vectors == 0) return CAPMOE_OK;
    const unsigned blocks = static_cast<unsigned>((vectors + kThreads - 1) / kThreads);
    const int E = static_cast<int>(d->num_experts), cap = static_cast<int>(d->capacity);
    if (dact == nullptr)
      return launch_dependent(swiglu_kernel<T>, blocks, kThreads, 0, stream, static_cast<const uint4*>(h),
                              offsets, E, cap, f_vec, static_cast<uint4*>(out));
    return launch_dependent(swiglu_backward_kernel<T>, blocks, kThreads, 0, stream,
                            static_cast<const uint4*>(dact), static_cast<const uint4*>(h), offsets, E, cap,
                            f_vec, static_cast<uint4*>(out));
  }
};

capmoe_status_t check(const capmoe_routing_desc_t* d, const int64_t* offsets,
                      std::initializer_list<const void*> acts) {
  CAPMOE_TRY(check_desc(d));
  if (offsets == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
  CAPMOE_TRY(check_aligned(8, {offsets}));
  if (d->capacity == 0) return CAPMOE_OK;
  for (const void* p : acts) {
    if (p == nullptr) return CAPMOE_ERR_INVALID_ARGUMENT;
    if (!aligned16(p)) return CAPMOE_ERR_MISALIGNED;
  }
  return CAPMOE_OK;
}

}  // namespace
}  // namespace routing
}  // namespace capmoe

using namespace capmoe::routing;

extern "C" capmoe_status_t capmoe_routing_swiglu(const capmoe_routing_desc_t* desc, const void* h,
                                                 const int64_t* offsets, void* act, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check(desc, offsets, {h, act}));
    return dispatch(desc, Swiglu{desc, nullptr, h, offsets, act, static_cast<cudaStream_t>(stream)});
  });
}

extern "C" capmoe_status_t capmoe_routing_swiglu_backward(const capmoe_routing_desc_t* desc,
                                                          const void* dact, const void* h,
                                                          const int64_t* offsets, void* dh,
                                                          void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check(desc, offsets, {dact, h, dh}));
    return dispatch(desc, Swiglu{desc, dact, h, offsets, dh, static_cast<cudaStream_t>(stream)});
  });
}
