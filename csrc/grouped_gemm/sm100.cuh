// SM100 (Blackwell datacenter) kernel types for the grouped GEMM: CUTLASS pointer-array
// tcgen05 kernels, 1-SM and 2-SM (an SM pair shares one 256-row MMA), with a runtime cluster
// shape and a fallback, launched (like SM90's) as a programmatic dependent launch of the argument
// kernel. Compiled for sm_100a. NOTE: no Blackwell GPU was available to this
// project; these kernels are compiled in CI but have never been run.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "grouped_gemm/dependent_launch.cuh"
#include "grouped_gemm/grouped_gemm.cuh"

namespace capmoe::gg::sm100 {

struct OneSm {
  using MmaTile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  static constexpr dim3 kCluster{2, 1, 1};
  static constexpr dim3 kClusterFallback{1, 1, 1};
};

struct TwoSm {
  using MmaTile = cute::Shape<cute::_256, cute::_256, cute::_64>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm;
  static constexpr dim3 kCluster{4, 1, 1};
  static constexpr dim3 kClusterFallback{2, 1, 1};
};

template <class ElementIn, class LayoutA, class LayoutB, class ElementC, class ElementD, class Config>
struct Traits {
  using LayoutD = cutlass::layout::RowMajor;
  using Cluster = cute::Shape<int32_t, int32_t, cute::_1>;  // chosen at run time
  static constexpr int kAlignIn = 16 / sizeof(ElementIn);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, typename Config::MmaTile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD,
      LayoutD*, kAlignD, typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*,
      kAlignIn, float, typename Config::MmaTile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static cutlass::KernelHardwareInfo hardware_info(int sm_count) {
    cutlass::KernelHardwareInfo info;
    info.sm_count = sm_count;
    info.cluster_shape = Config::kCluster;
    info.cluster_shape_fallback = Config::kClusterFallback;
    return info;
  }

  // The prepared kernel (prepare_dependent_launch) as a programmatic dependent launch of the
  // argument kernel (grouped_gemm/dependent_launch.cuh) through CUTLASS's own cluster launcher:
  // the preferred cluster shape, with the fallback where the GPU cannot place it.
  static capmoe_status_t launch(const typename Gemm::GemmKernel::Params& params, cudaStream_t stream) {
    using Kernel = typename Gemm::GemmKernel;
    void* kernel_params[] = {const_cast<typename Kernel::Params*>(&params)};
    const cutlass::Status status = cutlass::ClusterLauncher::launch_with_fallback_cluster(
        Kernel::get_grid_shape(params), Config::kCluster, Config::kClusterFallback, Kernel::get_block_shape(),
        Kernel::SharedStorageSize, stream, reinterpret_cast<const void*>(&dependent_gemm_kernel<Kernel>),
        kernel_params, /*launch_with_pdl=*/gemm_pdl_enabled());
    return status == cutlass::Status::kSuccess ? CAPMOE_OK : CAPMOE_ERR_CUTLASS;
  }
};

}  // namespace capmoe::gg::sm100

#define CAPMOE_GG_SM100_VARIANT(name, ElementIn, LayoutA, LayoutB, ElementC, ElementD, Config)                 \
  namespace capmoe::gg {                                                                                       \
  capmoe_status_t variant_##name(const Launch& launch, uint64_t* workspace_bytes) {                            \
    using T = sm100::Traits<ElementIn, cutlass::layout::LayoutA, cutlass::layout::LayoutB, ElementC, ElementD, \
                            sm100::Config>;                                                                    \
    return Runner<T>::run(launch, workspace_bytes);                                                            \
  }                                                                                                            \
  }
