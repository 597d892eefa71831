// The fused fc2 dgrad's MMA (csrc/fused/swiglu_dgrad_sm90.cu): one 64x128x16 wgmma per consumer
// warpgroup, two warpgroups along M. Its own header so that the host check
// tests/layout/dgrad_quad_rows.cu can walk the same accumulator layout the gathered epilogue's
// row sums rely on.
#pragma once

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

namespace capmoe::fused {

// A = drows / dy rows (K-major), B = W2_e (MN-major: F contiguous).
template <class T>
struct SwigluDgradMmaAtom;
template <>
struct SwigluDgradMmaAtom<cutlass::bfloat16_t> {
  using type = cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>;
};
template <>
struct SwigluDgradMmaAtom<cutlass::half_t> {
  using type = cute::SM90_64x128x16_F32F16F16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>;
};

template <class T>
using SwigluDgradTiledMma = decltype(cute::make_tiled_mma(typename SwigluDgradMmaAtom<T>::type{},
                                                          cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

}  // namespace capmoe::fused
