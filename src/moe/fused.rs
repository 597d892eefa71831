//! The expert path's choice between the fused fc1 ([`crate::fused::FusedFc1`]: x rows gathered
//! in the GEMM's operand load, SwiGLU in its epilogue) and the unfused permute -> fc1 -> SwiGLU.
//!
//! The fused kernel writes the same `act` and `h` bits as the unfused path (its tests assert
//! it), so the rest of the forward and the whole backward are unchanged. What the backward
//! still needs from the forward: `h` (SwiGLU backward) and the permuted rows (fc1 wgrad reads
//! them; the backward takes no `x` to gather from), so a training forward still permutes x
//! into the rows, and only [`super::MoeOptions::forward_only`] plans skip both.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{MoeOptions, WeightForm};
use crate::fused::FusedFc1;
use crate::grouped_gemm::GemmOperand;
use crate::routing::{self, RouteMaps, RoutingPlan};
use crate::{Error, Result};

/// Which fc1 the expert path's forward runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Fc1Kernel {
    /// The unfused path for now. NOTE: the fused kernel has not run on a GPU yet (no device
    /// was available when it was written); once `tests/fused_gpu.rs` and
    /// `tests/fused_moe_gpu.rs` pass on an H100, Auto takes it where it applies (sm_90a device
    /// and build, [`WeightForm::Tensor`], `F` a multiple of [`crate::fused::FC1_TILE_N`]).
    #[default]
    Auto,
    /// The fused kernel; a plan where it does not apply is an error.
    Fused,
    /// permute -> grouped GEMM -> SwiGLU.
    Unfused,
}

/// The fused fc1 this plan runs, if any.
pub(super) fn plan(options: &MoeOptions, routing: &RoutingPlan, stream: &CudaStream) -> Result<Option<FusedFc1>> {
    const OP: &str = "MoeExperts::new (fused fc1)";
    if options.fc1 != Fc1Kernel::Fused {
        return Ok(None);
    }
    let planned = if options.weights != WeightForm::Tensor {
        Err(Error::Unsupported {
            op: OP,
            why: "the fused fc1 takes weights as one [E, 2F, H] tensor (WeightForm::Tensor)".into(),
        })
    } else {
        FusedFc1::new(routing, stream)
    };
    planned.map(Some)
}

/// `act` (and `h` when given) for the rows the routing build just mapped, from `x` and the
/// fc1 weight tensor. `fc1_weight` is the plan's `W`, which the fused plan only exists for in
/// the tensor form (`W = T`); its length was checked by the caller.
pub(super) fn fc1<T: routing::Element, W: GemmOperand>(
    fused: &FusedFc1,
    stream: &CudaStream,
    x: &impl DevicePtr<T>,
    fc1_weight: &impl DevicePtr<W>,
    maps: &RouteMaps,
    act: &mut impl DevicePtrMut<T>,
    h: Option<&mut impl DevicePtrMut<T>>,
) -> Result<()> {
    if W::DTYPE != Some(T::DTYPE) {
        return Err(Error::Unsupported {
            op: "fused fc1",
            why: "the fused fc1 takes the fc1 weight as a tensor of the activation type".into(),
        });
    }
    let (xp, _g0) = x.device_ptr(stream);
    let (wp, _g1) = fc1_weight.device_ptr(stream);
    let (op, _g2) = maps.offsets.device_ptr(stream);
    let (tp, _g3) = maps.token_of_row.device_ptr(stream);
    let (ap, _g4) = act.device_ptr_mut(stream);
    let (hp, _g5) = match h {
        Some(h) => {
            let (p, g) = h.device_ptr_mut(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    // SAFETY: x [T_max, H] and the fc1 weight [E, 2F, H] of element type T were length-checked
    // by MoeExperts::check_forward; offsets, token_of_row, act [cap, F] and h [cap, 2F] are the
    // plan's own buffers, sized at plan time; the C ABI checks the alignments.
    unsafe { fused.run_raw(stream, xp, wp, op, tp, ap, hp) }
}
