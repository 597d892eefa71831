// capmoe-archs: 90a 100a
//
// Echo's spare-slot weights and gradients across an EP group (contract: capturable_moe/ep.h):
//   pack_spare_weights    send[q, s] = home[e - rank * L] for every global slot q * S_per + s
//                         whose expert e is a home expert of this rank (16-byte copies)
//   select_spare_weights  spare[s] = recv[e / L, s] for this rank's slots s with an expert
//   fold_spare_grads      dw_home[e - rank * L] += recv[q, s] over the global slots of e, in
//                         ascending slot order (fp32; one block column per home expert, so each
//                         element has one writer: bitwise deterministic)
// grid.y walks the slots (or home experts), grid.x the 16-byte vectors / elements of one
// expert. Empty slots (-1) are skipped; other experts outside [0, E) are skipped and flagged.
#include <cub/block/block_scan.cuh>

#include "ep/common.cuh"

namespace capmoe {
namespace ep {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksX = 1024;
constexpr int64_t kMaxBlocksY = 65535;

struct SlotParams {
  const int64_t* slot_expert;
  int64_t experts, local, rank, spare;  // E, L, this rank, S_per
  int32_t* flags;
};

// Whether slot expert `e` names a home expert; flags a bad one (once per slot, by the first
// block column).
__device__ __forceinline__ bool usable(const SlotParams& p, int64_t e) {
  if (e == -1) return false;
  if (e < -1 || e >= p.experts) {
    if (blockIdx.x == 0 && threadIdx.x == 0) raise_flags(p.flags, CAPMOE_EP_BAD_SLOT_EXPERT);
    return false;
  }
  return true;
}

__device__ __forceinline__ void copy_vectors(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                             int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride)
    dst[v] = __ldg(src + v);
}

__global__ void __launch_bounds__(kThreads)
    pack_kernel(SlotParams p, const uint4* __restrict__ home, uint4* __restrict__ send, int64_t vectors) {
  const int64_t slots = p.spare * (p.experts / p.local);  // R * S_per
  for (int64_t j = blockIdx.y; j < slots; j += gridDim.y) {
    const int64_t e = p.slot_expert[j];
    if (!usable(p, e) || e / p.local != p.rank) continue;
    copy_vectors(home + (e - p.rank * p.local) * vectors, send + j * vectors, vectors);
  }
}

__global__ void __launch_bounds__(kThreads)
    select_kernel(SlotParams p, const uint4* __restrict__ recv, uint4* __restrict__ spare, int64_t vectors) {
  for (int64_t s = blockIdx.y; s < p.spare; s += gridDim.y) {
    const int64_t e = p.slot_expert[p.rank * p.spare + s];
    if (!usable(p, e)) continue;
    copy_vectors(recv + ((e / p.local) * p.spare + s) * vectors, spare + s * vectors, vectors);
  }
}

// For each home expert of this rank (grid.y), chunk by chunk over the global slots: a block
// scan lists the chunk's slots of that expert in ascending order, then every thread adds them
// onto its elements. Adding chunk after chunk through dw_home is the same fp32 sum as one pass.
__global__ void __launch_bounds__(kThreads)
    fold_kernel(SlotParams p, const float* __restrict__ recv, float* __restrict__ dw_home, int64_t elems) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int list[kThreads];
  const int64_t slots = p.spare * (p.experts / p.local);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t local = blockIdx.y; local < p.local; local += gridDim.y) {
    const int64_t e = p.rank * p.local + local;
    for (int64_t chunk = 0; chunk < slots; chunk += kThreads) {
      const int64_t j = chunk + threadIdx.x;
      const int64_t slot_e = j < slots ? p.slot_expert[j] : -1;
      // Each bad slot is flagged by one block.
      if (blockIdx.x == 0 && local == 0 && slot_e != -1 && (slot_e < -1 || slot_e >= p.experts))
        raise_flags(p.flags, CAPMOE_EP_BAD_SLOT_EXPERT);
      const int match = slot_e == e;
      int position = 0, matches = 0;
      Scan(scan_storage).ExclusiveSum(match, position, matches);
      if (match) list[position] = static_cast<int>(threadIdx.x);
      __syncthreads();
      if (matches > 0) {
        float* dst = dw_home + local * elems;
        for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < elems; v += stride) {
          float acc = dst[v];
          for (int m = 0; m < matches; ++m) acc += __ldg(recv + (chunk + list[m]) * elems + v);
          dst[v] = acc;
        }
      }
      __syncthreads();  // list and scan_storage are reused by the next chunk
    }
  }
}

// Checks shared by the three entry points: the descriptor, S_per >= 1, the pointers, the size
// (bytes a multiple of 16, every byte offset within int64).
capmoe_status_t check_slots(const capmoe_ep_desc_t* d, const int64_t* slot_expert, int64_t bytes,
                            std::initializer_list<const void*> buffers, const int32_t* flags) {
  CAPMOE_TRY(check_desc(d));
  if (d->spare_per_rank < 1 || bytes < 0) return CAPMOE_ERR_INVALID_ARGUMENT;
  CAPMOE_TRY(check_buffer(true, slot_expert, 8));
  CAPMOE_TRY(check_buffer(true, flags, 4));
  for (const void* b : buffers) CAPMOE_TRY(check_buffer(bytes > 0, b, 16));
  if (bytes % 16 != 0) return CAPMOE_ERR_MISALIGNED;
  const int64_t rows = d->ranks * d->spare_per_rank > local_experts(d) ? d->ranks * d->spare_per_rank
                                                                       : local_experts(d);
  if (bytes > 0 && rows > INT64_MAX / bytes) return CAPMOE_ERR_INVALID_ARGUMENT;
  return CAPMOE_OK;
}

SlotParams slot_params(const capmoe_ep_desc_t* d, const int64_t* slot_expert, int32_t* flags) {
  return SlotParams{slot_expert, d->num_experts, local_experts(d), d->rank, d->spare_per_rank, flags};
}

dim3 grid(int64_t work, int64_t rows) {
  return dim3(stride_blocks(work, kThreads, kMaxBlocksX),
              static_cast<unsigned>(rows < kMaxBlocksY ? rows : kMaxBlocksY));
}

}  // namespace
}  // namespace ep
}  // namespace capmoe

using namespace capmoe::ep;

extern "C" capmoe_status_t capmoe_ep_pack_spare_weights(const capmoe_ep_desc_t* desc,
                                                        const int64_t* slot_expert, const void* home,
                                                        int64_t bytes_per_expert, void* send,
                                                        int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_slots(desc, slot_expert, bytes_per_expert, {home, send}, flags));
    if (bytes_per_expert == 0) return CAPMOE_OK;
    const int64_t vectors = bytes_per_expert / 16;
    return capmoe::launch(pack_kernel, grid(vectors, desc->ranks * desc->spare_per_rank), kThreads, 0,
                          static_cast<cudaStream_t>(stream), slot_params(desc, slot_expert, flags),
                          static_cast<const uint4*>(home), static_cast<uint4*>(send), vectors);
  });
}

extern "C" capmoe_status_t capmoe_ep_select_spare_weights(const capmoe_ep_desc_t* desc,
                                                          const int64_t* slot_expert,
                                                          const void* recv, int64_t bytes_per_expert,
                                                          void* spare, int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    CAPMOE_TRY(check_slots(desc, slot_expert, bytes_per_expert, {recv, spare}, flags));
    if (bytes_per_expert == 0) return CAPMOE_OK;
    const int64_t vectors = bytes_per_expert / 16;
    return capmoe::launch(select_kernel, grid(vectors, desc->spare_per_rank), kThreads, 0,
                          static_cast<cudaStream_t>(stream), slot_params(desc, slot_expert, flags),
                          static_cast<const uint4*>(recv), static_cast<uint4*>(spare), vectors);
  });
}

extern "C" capmoe_status_t capmoe_ep_fold_spare_grads(const capmoe_ep_desc_t* desc,
                                                      const int64_t* slot_expert, const float* recv,
                                                      int64_t per_expert, float* dw_home,
                                                      int32_t* flags, void* stream) {
  return capmoe::guarded([&]() -> capmoe_status_t {
    if (per_expert < 0 || per_expert > INT64_MAX / 4) return CAPMOE_ERR_INVALID_ARGUMENT;
    CAPMOE_TRY(check_slots(desc, slot_expert, per_expert * 4, {recv, dw_home}, flags));
    if (per_expert == 0) return CAPMOE_OK;
    return capmoe::launch(fold_kernel, grid(per_expert, local_experts(desc)), kThreads, 0,
                          static_cast<cudaStream_t>(stream), slot_params(desc, slot_expert, flags),
                          recv, dw_home, per_expert);
  });
}
