// SM90 (Hopper) kernel types for the grouped GEMM: CUTLASS pointer-array, TMA +
// warp-specialized wgmma kernels with a persistent group tile scheduler. Compiled for sm_90a
// only (wgmma needs the arch-specific target).
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm/dependent_launch.cuh"
#include "grouped_gemm/grouped_gemm.cuh"

namespace capmoe::gg::sm90 {

// A kernel configuration: CTA tile (K step 64), cluster along M, and the warp-specialized
// schedule. Cooperative: both consumer warpgroups share one tile. Pingpong: each consumer
// warpgroup owns a whole tile and the two alternate, so one's epilogue overlaps the other's
// mainloop.
template <int TileM, int TileN, int ClusterM, bool PingpongSchedule>
struct TileConfig {
  static constexpr int kClusterM = ClusterM;
  using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  using KernelSchedule = std::conditional_t<PingpongSchedule, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<PingpongSchedule, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

// The wgrad kernel: a 128x256 tile, 2-CTA cluster along M so the B tile is multicast.
using Cooperative = TileConfig<128, 256, 2, false>;
// AUTO's choices for fprop / dgrad (the sweeps in bench/README.md): 64-row tiles for few rows
// per expert or a short reduction, 128-row tiles otherwise.
using CooperativeNoCluster = TileConfig<128, 256, 1, false>;
using PingpongWide = TileConfig<64, 256, 1, true>;

// ElementC = void: no source operand (plain output); float: D = C + AB (accumulate).
template <class ElementIn, class LayoutA, class LayoutB, class ElementC, class ElementD, class Config>
struct Traits {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignIn = 16 / sizeof(ElementIn);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD,
      LayoutD*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*,
      kAlignIn, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static cutlass::KernelHardwareInfo hardware_info(int sm_count) {
    cutlass::KernelHardwareInfo info;
    info.sm_count = sm_count;
    return info;
  }

  static capmoe_status_t launch(const typename Gemm::GemmKernel::Params& params, cudaStream_t stream);
};

// Launches the prepared kernel (prepare_dependent_launch) as a programmatic dependent launch of
// the previous kernel on `stream` (the argument kernel; see grouped_gemm/dependent_launch.cuh),
// with the config's static cluster shape.
template <class ElementIn, class LayoutA, class LayoutB, class ElementC, class ElementD, class Config>
capmoe_status_t Traits<ElementIn, LayoutA, LayoutB, ElementC, ElementD, Config>::launch(
    const typename Gemm::GemmKernel::Params& params, cudaStream_t stream) {
  using Kernel = typename Gemm::GemmKernel;
  cudaLaunchAttribute attrs[2] = {};
  unsigned count = 0;
  // A cluster only where the config has one: the 1x1x1 kernels launch without the attribute,
  // as CUTLASS's own adapter launches them.
  if (Config::kClusterM > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = Config::kClusterM;
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  if (gemm_pdl_enabled()) attrs[count++] = programmatic_serialization();
  cudaLaunchConfig_t config = {};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  return cuda_status(cudaLaunchKernelEx(&config, &dependent_gemm_kernel<Kernel>, params));
}

}  // namespace capmoe::gg::sm90

// Defines the VariantFn `capmoe::gg::variant_<name>` for one SM90 instantiation.
#define CAPMOE_GG_SM90_VARIANT(name, ElementIn, LayoutA, LayoutB, ElementC, ElementD, Config)                 \
  namespace capmoe::gg {                                                                                      \
  capmoe_status_t variant_##name(const Launch& launch, uint64_t* workspace_bytes) {                           \
    using T = sm90::Traits<ElementIn, cutlass::layout::LayoutA, cutlass::layout::LayoutB, ElementC, ElementD, \
                           sm90::Config>;                                                                     \
    return Runner<T>::run(launch, workspace_bytes);                                                           \
  }                                                                                                           \
  }
