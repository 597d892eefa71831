//! The expert path's choices between fused kernels ([`crate::fused`]) and the unfused chains
//! they replace ([`MoeOptions::fc1`], [`MoeOptions::swiglu_dgrad`], [`MoeOptions::fc1_wgrad`],
//! [`MoeOptions::prob_in_fc1`]).
//!
//! Forward, [`crate::fused::FusedFc1`] (x rows gathered in the GEMM's operand load, SwiGLU in
//! its epilogue) for permute -> fc1 -> SwiGLU. It writes the same `act` and `h` bits as the
//! unfused path (its tests assert it), so the rest of the forward is unchanged. What the
//! backward still needs from the forward: `h` (SwiGLU backward). fc1's wgrad reads the permuted
//! rows unless it gathers from `x` itself ([`crate::fused::GatherWgrad`]); the sm_90a fused fc1
//! then writes those rows from the stages it gathered ([`FusedFc1::writing_rows`],
//! [`PermutePass::InFc1`]), so no permute pass runs; on sm_100a (whose kernel has no such step)
//! the backward permutes x right before that wgrad ([`PermutePass::Backward`]).
//!
//! Backward, [`crate::fused::FusedSwigluDgrad`] (SwiGLU backward in the fc2 dgrad's epilogue)
//! for fc2 dgrad -> SwiGLU backward: `dh` straight from `drows`, no `dact` round trip. fc2
//! wgrad still reads `drows` and `act`, everything else in the backward is unchanged.
//!
//! Backward, [`crate::fused::GatherWgrad`] for fc1's wgrad over the permuted rows:
//! `dW1 = dhᵀ · x[token_of_row]`, the rows read through the routing map.
//!
//! Both, [`MoeOptions::prob_in_fc1`] (SonicMoE's form of the fc2 side): the fused fc1 weights
//! each row's act by its route's probability, `act = p · SwiGLU(h)`, so fc2's output rows come
//! out weighted and the combine is an unweighted gather-sum. The gradient of fc2's output row
//! `r` is then plain `dy[token_of_row[r]]`: the backward writes no `drows`, and keeps no fc2
//! output rows for dprobs. [`FusedSwigluDgrad::run_gathered`] reads dy through the routing map,
//! and its epilogue applies p and writes per-row dprob partials (`Σ_f dact · SwiGLU(h)` per
//! column slice) that [`RoutingPlan::route_dprobs`] sums per route; fc2's wgrad is the gathered
//! wgrad with `a = dy` gathered and `b = act`.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{MoeConfig, MoeOptions, WeightForm};
use crate::device::{Arch, DeviceInfo};
use crate::fused::{FusedFc1, FusedSwigluDgrad, GatherWgrad, GatherWgradConfig, WgradOutput};
use crate::grouped_gemm::GemmOperand;
use crate::routing::{self, RouteMaps, RoutingPlan};
use crate::{Error, Result};

/// Whether a step of the expert path runs its fused kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FusedKernel {
    /// The fused kernel where it was measured faster than the chain it replaces, else the
    /// unfused chain. Today that is fc1 ([`MoeOptions::fc1`]) on a 9.0 device with an sm_90a
    /// build, [`WeightForm::Tensor`], more than 64 rows per expert on average (at decode sizes
    /// the unfused chain is faster since the grouped GEMM runs its counter kernel there) and
    /// shapes the kernel takes (`F` a multiple of 128, `E` at most
    /// [`crate::fused::MAX_EXPERTS`], a 16-bit dtype): in a [`MoeOptions::forward_only`] plan it
    /// skips the permuted copy of x and `h` altogether; in a training plan it writes `h` and the
    /// permuted rows fc1's wgrad reads from the stages it gathered
    /// ([`crate::fused::FusedFc1::writing_rows`]), so the step runs no permute pass: level with
    /// the unfused chain to 2 % faster forward + backward (H100, 2026-12-07, E128 T4096 and the
    /// published shapes). Training plans whose fc1 wgrad is gathered ([`MoeOptions::fc1_wgrad`]
    /// `= Fused`), or under `CAPMOE_FUSED_FC1_ROWS=backward` (the form that leaves the permute
    /// to the backward, which a forced `Fused` fc1 gets on a 10.0 device: level with the chain
    /// to 5 % slower), keep the unfused fc1. `bench/README.md` ("Fused expert path") has the
    /// measurements. The other options' fused kernels are slower than their chains, so Auto
    /// leaves them unfused, and no sm_100a kernel has run (no Blackwell GPU here), so Auto
    /// takes none there. A forced `Fused` takes the sm_100a kernels on a 10.0 device (all four
    /// options; compiled only, never run).
    #[default]
    Auto,
    /// The fused kernel; a plan where it does not apply is an error.
    Fused,
    /// The unfused chain of kernels.
    Unfused,
}

/// The fused kernels one plan runs.
#[derive(Debug, Default)]
pub(super) struct FusedPlans {
    pub(super) fc1: Option<FusedFc1>,
    pub(super) swiglu_dgrad: Option<FusedSwigluDgrad>,
    pub(super) fc1_wgrad: Option<GatherWgrad>,
    /// fc2's wgrad from dy gathered, when the probability is applied in fc1's epilogue.
    pub(super) fc2_wgrad: Option<GatherWgrad>,
    /// The probability is applied in fc1's epilogue ([`MoeOptions::prob_in_fc1`]).
    pub(super) prob_in_fc1: bool,
}

impl FusedPlans {
    pub(super) fn new(
        options: &MoeOptions,
        config: &MoeConfig,
        routing: &RoutingPlan,
        stream: &Arc<CudaStream>,
    ) -> Result<FusedPlans> {
        // In training the permuted rows are needed by fc1's wgrad unless it gathers them itself.
        let rows_for_wgrad = !options.forward_only && options.fc1_wgrad != FusedKernel::Fused;
        let fc1 = match options.fc1 {
            FusedKernel::Fused => {
                ensure_tensor_weights(options, "MoeExperts::new (fused fc1)", "fc1 [E, 2F, H]")?;
                Some(fused_fc1(routing, stream, rows_for_wgrad)?)
            }
            FusedKernel::Auto => auto_fc1(options, routing, stream, rows_for_wgrad)?,
            FusedKernel::Unfused => None,
        };
        // A forward-only plan never runs the backward: nothing to plan (or refuse) for it.
        let swiglu_dgrad = match options.swiglu_dgrad {
            FusedKernel::Fused if !options.forward_only => {
                ensure_tensor_weights(options, "MoeExperts::new (fused fc2 dgrad)", "fc2 [E, H, F]")?;
                Some(FusedSwigluDgrad::new(routing, stream)?)
            }
            _ => None,
        };
        let output = if config.wgrad_accumulate { WgradOutput::F32Accumulate } else { WgradOutput::Same };
        let fc1_wgrad = match options.fc1_wgrad {
            FusedKernel::Fused if !options.forward_only => {
                ensure_tensor_weights(options, "MoeExperts::new (gathered fc1 wgrad)", "dW1 [E, 2F, H]")?;
                Some(GatherWgrad::new(GatherWgradConfig::fc1(routing, output), stream)?)
            }
            _ => None,
        };
        let prob_in_fc1 = options.prob_in_fc1 == FusedKernel::Fused;
        if prob_in_fc1 {
            ensure_prob_in_fc1_kernels(options, fc1.is_some(), swiglu_dgrad.is_some())?;
        }
        let fc2_wgrad = match prob_in_fc1 && !options.forward_only {
            true => Some(GatherWgrad::new(GatherWgradConfig::fc2_from_dy(routing, output), stream)?),
            false => None,
        };
        Ok(FusedPlans { fc1, swiglu_dgrad, fc1_wgrad, fc2_wgrad, prob_in_fc1 })
    }

    /// Which pass writes the permuted rows, if any ([`permute_pass`]).
    pub(super) fn permute_pass(&self, forward_only: bool) -> Option<PermutePass> {
        let fc1 = match &self.fc1 {
            None => Fc1Step::Unfused,
            Some(f) if f.writes_rows() => Fc1Step::FusedWritingRows,
            Some(_) => Fc1Step::Fused,
        };
        permute_pass(fc1, self.fc1_wgrad.is_some(), forward_only)
    }
}

/// The fused fc1's plan; with `rows_for_wgrad` (a training plan whose fc1 wgrad reads the
/// permuted rows) the form that writes those rows from its gathered stages
/// ([`FusedFc1::writing_rows`]) where the device's kernel has it (sm_90a), else the plain one
/// (the backward then permutes x itself, [`PermutePass::Backward`]), or where
/// [`backward_permute_forced`].
fn fused_fc1(routing: &RoutingPlan, stream: &Arc<CudaStream>, rows_for_wgrad: bool) -> Result<FusedFc1> {
    if !rows_for_wgrad || backward_permute_forced() {
        return FusedFc1::new(routing, stream);
    }
    match FusedFc1::writing_rows(routing, stream) {
        Err(Error::Unsupported { .. }) => FusedFc1::new(routing, stream),
        other => other,
    }
}

/// `CAPMOE_FUSED_FC1_ROWS=backward` in the environment (read at plan time): a forced fused fc1
/// of a training plan does not write the rows and the backward permutes x, and Auto keeps the
/// unfused fc1 in training; the A/B switch of the benchmark.
fn backward_permute_forced() -> bool {
    std::env::var("CAPMOE_FUSED_FC1_ROWS").is_ok_and(|v| v == "backward")
}

/// [`FusedKernel::Auto`]'s fc1: the fused kernel on a 9.0 device with more than 64 rows per
/// expert on average (`capacity / E`, rounded down, as the grouped GEMM's AUTO reads it: the two
/// agree on which plans are decode-sized), where it takes the plan, in a forward-only plan and
/// in a training plan whose fc1 wgrad reads the permuted rows (the form that writes them,
/// [`FusedFc1::writing_rows`]); `None` (the unfused chain) otherwise; any other error is the
/// caller's. At decode sizes the unfused chain won once the grouped GEMM's AUTO took the counter
/// kernel there (H200, 2026-11-29, report of b9ad269: E64 T128 k8 H2048 F1408 forward-only
/// 352.3 us fused, 306.7 us unfused; at E128 T4096 670.5 against 714.6 us). In training the
/// writing form measured level with the unfused chain to 2 % faster forward + backward (H100,
/// `bench/README.md`, session 37); the other training forms were slower (the backward's permute,
/// `CAPMOE_FUSED_FC1_ROWS=backward`; the gathered fc1 wgrad), so Auto keeps the chain for them.
fn auto_fc1(
    options: &MoeOptions,
    routing: &RoutingPlan,
    stream: &Arc<CudaStream>,
    rows_for_wgrad: bool,
) -> Result<Option<FusedFc1>> {
    const DECODE_ROWS_PER_EXPERT: usize = 64;
    let decode = routing.capacity() / routing.num_experts() <= DECODE_ROWS_PER_EXPERT;
    let writing_form = rows_for_wgrad && !backward_permute_forced();
    let takes = options.weights == WeightForm::Tensor && !decode && (options.forward_only || writing_form);
    if !takes || FusedFc1::check_shapes(routing.config()).is_err() {
        return Ok(None);
    }
    if DeviceInfo::of_stream(stream)?.arch != Arch::Sm90 {
        return Ok(None);
    }
    // The sm_90a kernel has the writing form, so fused_fc1 takes it wherever the rows are needed.
    match fused_fc1(routing, stream, rows_for_wgrad) {
        Ok(plan) => Ok(Some(plan)),
        Err(Error::Unsupported { .. } | Error::UnsupportedArch { .. } | Error::NotBuilt { .. }) => Ok(None),
        Err(other) => Err(other),
    }
}

/// The forward's fc1 step, as [`permute_pass`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fc1Step {
    /// permute -> grouped GEMM fc1 -> SwiGLU.
    Unfused,
    /// The fused fc1, gathering x itself.
    Fused,
    /// The fused fc1 that also writes the rows it gathered ([`FusedFc1::writing_rows`]).
    FusedWritingRows,
}

/// The pass of the expert path that writes x's permuted copy into the `[capacity, H]` rows
/// buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PermutePass {
    /// The unfused fc1 reads the rows; the backward's fc1 wgrad (unless gathered) reads the
    /// same rows later, so they are kept from forward to backward.
    Forward,
    /// The fused fc1 writes them from the stages it gathered, in the forward, and they are
    /// kept for the backward's fc1 wgrad as after [`PermutePass::Forward`]: no permute pass.
    InFc1,
    /// The fused fc1 gathers x itself and only the backward's unfused fc1 wgrad reads the rows:
    /// the backward permutes x right before it. Nothing is kept between the passes, and the
    /// permute's time moves from the forward into the backward.
    Backward,
}

/// Which pass writes x's permuted rows, if any: the unfused fc1 reads them in the forward; with
/// the fused fc1 only the backward's fc1 wgrad reads them, unless it gathers from x (and a
/// forward-only plan has no backward), and the fused fc1 writes them itself where it can.
pub(super) fn permute_pass(fc1: Fc1Step, gathered_fc1_wgrad: bool, forward_only: bool) -> Option<PermutePass> {
    match (fc1, forward_only || gathered_fc1_wgrad) {
        (Fc1Step::Unfused, _) => Some(PermutePass::Forward),
        (_, true) => None,
        (Fc1Step::FusedWritingRows, false) => Some(PermutePass::InFc1),
        (Fc1Step::Fused, false) => Some(PermutePass::Backward),
    }
}

/// The probability in fc1's epilogue runs on the fused kernels only: the fused fc1 applies it,
/// and the backward's fused fc2 dgrad gathers dy and makes dprobs.
fn ensure_prob_in_fc1_kernels(options: &MoeOptions, fc1: bool, swiglu_dgrad: bool) -> Result<()> {
    const OP: &str = "MoeExperts::new (probability in fc1)";
    // Pointer weights first: with them no fused kernel exists, whatever fc1 / swiglu_dgrad say.
    ensure_tensor_weights(options, OP, "fc1 and fc2")?;
    let invalid = |why: &str| Err(Error::InvalidArgument { op: OP, why: why.into() });
    if !fc1 {
        return invalid("MoeOptions::prob_in_fc1 = Fused needs MoeOptions::fc1 = Fused (its epilogue applies it)");
    }
    if !options.forward_only && !swiglu_dgrad {
        return invalid(
            "MoeOptions::prob_in_fc1 = Fused needs MoeOptions::swiglu_dgrad = Fused (the backward gathers dy into it)",
        );
    }
    Ok(())
}

fn ensure_tensor_weights(options: &MoeOptions, op: &'static str, weight: &str) -> Result<()> {
    if options.weights != WeightForm::Tensor {
        return Err(Error::Unsupported {
            op,
            why: format!("the fused kernel takes the {weight} weight as one tensor (WeightForm::Tensor)"),
        });
    }
    Ok(())
}

/// The fused kernels take the weights as tensors of the activation type; the plan's `W` is that
/// type whenever a fused plan exists (`WeightForm::Tensor`), which this checks again.
fn ensure_weight_type<T: routing::Element, W: GemmOperand>(op: &'static str) -> Result<()> {
    if W::DTYPE != Some(T::DTYPE) {
        return Err(Error::Unsupported {
            op,
            why: "the fused kernel takes the weight as a tensor of the activation type".into(),
        });
    }
    Ok(())
}

/// `act` (and `h` when given) for the rows the routing build just mapped, from `x` and the
/// fc1 weight tensor, whose length was checked by the caller; weighted by `prob_of_row` when
/// given.
#[allow(clippy::too_many_arguments)]
pub(super) fn fc1<T: routing::Element, W: GemmOperand>(
    fused: &FusedFc1,
    stream: &CudaStream,
    x: &impl DevicePtr<T>,
    fc1_weight: &impl DevicePtr<W>,
    maps: &RouteMaps,
    prob_of_row: Option<&impl DevicePtr<f32>>,
    act: &mut impl DevicePtrMut<T>,
    h: Option<&mut impl DevicePtrMut<T>>,
    rows: Option<&mut impl DevicePtrMut<T>>,
) -> Result<()> {
    ensure_weight_type::<T, W>("fused fc1")?;
    let (xp, _g0) = x.device_ptr(stream);
    let (wp, _g1) = fc1_weight.device_ptr(stream);
    let (op, _g2) = maps.offsets.device_ptr(stream);
    let (tp, _g3) = maps.token_of_row.device_ptr(stream);
    let (pp, _g4) = optional_ptr(stream, prob_of_row);
    let (ap, _g5) = act.device_ptr_mut(stream);
    let (hp, _g6) = optional_ptr_mut(stream, h);
    let (rp, _g7) = optional_ptr_mut(stream, rows);
    // SAFETY: x [T_max, H] and the fc1 weight [E, 2F, H] of element type T were length-checked
    // by MoeExperts::check_forward; offsets, token_of_row, prob_of_row [cap], act [cap, F],
    // h [cap, 2F] and rows [cap, H] are the plan's own buffers, sized at plan time; the C ABI
    // checks the alignments.
    unsafe { fused.run_raw(stream, xp, wp, op, tp, pp, ap, hp, rp) }
}

/// A read-only buffer's address and guard, or 0 when absent.
fn optional_ptr<'a, T>(
    stream: &'a CudaStream,
    buffer: Option<&'a impl DevicePtr<T>>,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match buffer {
        Some(b) => {
            let (p, g) = b.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// A written buffer's address and guard, or 0 when absent.
fn optional_ptr_mut<'a, T>(
    stream: &'a CudaStream,
    buffer: Option<&'a mut impl DevicePtrMut<T>>,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match buffer {
        Some(b) => {
            let (p, g) = b.device_ptr_mut(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

/// `dh` of the backward from `drows`, the fc2 weight tensor (length checked by the caller) and
/// the forward's `h`.
pub(super) fn swiglu_dgrad<T: routing::Element, W: GemmOperand>(
    fused: &FusedSwigluDgrad,
    stream: &CudaStream,
    drows: &impl DevicePtr<T>,
    fc2_weight: &impl DevicePtr<W>,
    h: &impl DevicePtr<T>,
    maps: &RouteMaps,
    dh: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    ensure_weight_type::<T, W>("fused fc2 dgrad + SwiGLU backward")?;
    let (rp, _g0) = drows.device_ptr(stream);
    let (wp, _g1) = fc2_weight.device_ptr(stream);
    let (hp, _g2) = h.device_ptr(stream);
    let (op, _g3) = maps.offsets.device_ptr(stream);
    let (dhp, _g4) = dh.device_ptr_mut(stream);
    // SAFETY: the fc2 weight [E, H, F] of element type T was length-checked by
    // MoeExperts::check_backward; drows [cap, H], h and dh [cap, 2F] and offsets are the plan's
    // own buffers, sized at plan time; the C ABI checks the alignments.
    unsafe { fused.run_raw(stream, rp, wp, hp, op, dhp, 0) }
}

/// `dh` of the backward from `dy` gathered through the routing map, when the probability was
/// applied in fc1's epilogue: the fc2 dgrad applies `prob_of_row` in its epilogue and writes
/// the per-row dprob `partials` ([`FusedSwigluDgrad::dprob_slices`] per row).
#[allow(clippy::too_many_arguments)]
pub(super) fn swiglu_dgrad_gathered<T: routing::Element, W: GemmOperand>(
    fused: &FusedSwigluDgrad,
    stream: &CudaStream,
    dy: &impl DevicePtr<T>,
    fc2_weight: &impl DevicePtr<W>,
    h: &impl DevicePtr<T>,
    maps: &RouteMaps,
    prob_of_row: &impl DevicePtr<f32>,
    dh: &mut impl DevicePtrMut<T>,
    partials: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    ensure_weight_type::<T, W>("gathered fc2 dgrad + SwiGLU backward")?;
    let (dyp, _g0) = dy.device_ptr(stream);
    let (wp, _g1) = fc2_weight.device_ptr(stream);
    let (hp, _g2) = h.device_ptr(stream);
    let (op, _g3) = maps.offsets.device_ptr(stream);
    let (tp, _g4) = maps.token_of_row.device_ptr(stream);
    let (pp, _g5) = prob_of_row.device_ptr(stream);
    let (dhp, _g6) = dh.device_ptr_mut(stream);
    let (sp, _g7) = partials.device_ptr_mut(stream);
    // SAFETY: dy [T_max, H] and the fc2 weight [E, H, F] of element type T were length-checked
    // by MoeExperts::check_backward; h and dh [cap, 2F], offsets, token_of_row, prob_of_row
    // [cap] and the partials [cap, F / 128] are the plan's own buffers, sized at plan time;
    // the C ABI checks the alignments.
    unsafe { fused.run_gathered_raw(stream, dyp, wp, hp, op, tp, pp, dhp, sp) }
}

/// A weight gradient by the gathered wgrad: `dw = Σ_r a(r)ᵀ b(r)` per expert, either operand
/// read through the routing map as `wgrad`'s configuration says (fc1: `a = dh`, `b = x`
/// gathered; fc2 with the probability in fc1: `a = dy` gathered, `b = act`). `dw` is the
/// plan's `G`: a tensor of `T`, or of f32 with `wgrad_accumulate`, whenever this plan exists,
/// which the gathered wgrad's own checks confirm.
pub(super) fn wgrad<T: routing::Element, G: GemmOperand>(
    wgrad: &GatherWgrad,
    stream: &CudaStream,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    maps: &RouteMaps,
    dw: &mut impl DevicePtrMut<G>,
) -> Result<()> {
    const OP: &str = "gathered wgrad of the expert path";
    if G::DTYPE != Some(wgrad.config().out_dtype()) {
        return Err(Error::Unsupported {
            op: OP,
            why: format!("the weight gradient must be a {:?} tensor for this plan", wgrad.config().out_dtype()),
        });
    }
    let (ap, _g0) = a.device_ptr(stream);
    let (bp, _g1) = b.device_ptr(stream);
    let (op, _g2) = maps.offsets.device_ptr(stream);
    let (tp, _g3) = maps.token_of_row.device_ptr(stream);
    let (dp, _g4) = dw.device_ptr_mut(stream);
    // SAFETY: the gathered operand ([T_max, cols]) and dw ([E, m, n], of the checked element
    // type) were length-checked by MoeExperts::check_backward; the plain operand
    // ([cap, cols]), offsets and token_of_row are the plan's own buffers, sized at plan time;
    // the C ABI checks the alignments.
    unsafe { wgrad.run_raw(stream, ap, bp, op, tp, dp) }
}
