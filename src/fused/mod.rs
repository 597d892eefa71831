//! Fused expert-path kernels (C side: `csrc/fused/`, contract in
//! `csrc/include/capturable_moe/fused.h`).
//!
//! [`FusedFc1`]: fc1 with its A rows gathered straight from `x` through the routing build's
//! `token_of_row` (no permuted copy of x is written or read) and SwiGLU in its epilogue:
//! `act [capacity, F]` (and, on request, the pre-activation `h [capacity, 2F]` the unfused
//! SwiGLU backward reads) in one persistent sm_90a kernel, or its sm_100a (Blackwell, tcgen05)
//! variant on a compute capability 10.0 device (compiled only: no Blackwell GPU has run it).
//! `act` and `h` are in routing row order, exactly where the unfused permute -> fc1 -> SwiGLU
//! path puts them, and equal to it (gate and up are rounded to the activation type before
//! SwiGLU, as the unfused path does).
//!
//! [`FusedSwigluDgrad`]: the backward's fc2 dgrad with the SwiGLU backward in its epilogue:
//! `dh [capacity, 2F]` from `drows [capacity, H]`, the fc2 weight and the forward's `h`, in one
//! persistent sm_90a kernel, or its sm_100a variant on a compute capability 10.0 device (both
//! forms; compiled only: no Blackwell GPU has run it); the `[capacity, F]` dact never goes
//! through memory (written only on request). Same fp32 math as the unfused SwiGLU backward on
//! the rounded dact; bitwise equal to the unfused path only where both GEMMs sum in the same
//! order (not guaranteed: its tests hold it to the fp64 reference and report the bitwise
//! comparison). [`FusedSwigluDgrad::run_gathered`] is its second form, for a forward whose fc1
//! epilogue weighted act by the route probability (an unweighted combine): A rows gathered from
//! `dy` through `token_of_row`, `dh` of `prob · dact`, and dprob's per-slice partials from the
//! epilogue (no `drows` buffer).
//!
//! [`GatherWgrad`]: a grouped weight gradient that reads an operand's rows through
//! `token_of_row` (fc1's `dW1` straight from `x`, no permuted copy), in one persistent sm_90a
//! kernel or its sm_100a variant (compiled only: no Blackwell GPU has run it); its own contract
//! is on the type. Design, tests and limits of all three: `docs/fused.md`.
//!
//! Invariants of every launch of the first two: rows at or past the device-side total
//! `offsets[E]` (clamped to `capacity`) are never written, and read only by
//! [`FusedSwigluDgrad`] (an expert's last tile loads whole 128-row blocks of `drows`, never past
//! `capacity`, and discards the rows beyond the expert's end; its gathered form reads `dy` only
//! through `token_of_row` of stored rows); no allocation, no host sync, no host read of device
//! data, so a launch can be captured in a CUDA graph and replayed with new routing.
//!
//! Where they apply (`new` says why not otherwise, before any launch): an sm_90a build on a
//! compute capability 9.0 device (all three also: an sm_100a build on 10.0, compiled only; fc1
//! there with the cp.async gather only), weights as one
//! tensor (`[E, 2F, H]` / `[E, H, F]`), `F` a multiple of [`FC1_TILE_N`] /
//! [`SWIGLU_DGRAD_TILE_N`], `E <=` [`MAX_EXPERTS`], a 16-bit activation type. Elsewhere use the
//! unfused path.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::device::{ensure_aligned16, ensure_bound_stream, ensure_buffer, Arch, DeviceInfo};
use crate::dtype::DType;
use crate::error::check;
use crate::routing::{Element, RoutingConfig, RoutingPlan};
use crate::{sys, Error, Result};

// The gathered grouped wgrad (fc1's weight gradient without a permuted x).
mod wgrad;
pub use wgrad::{GatherWgrad, GatherWgradConfig, RowSource, WgradOutput, WGRAD_TILE_M, WGRAD_TILE_N};

/// An optional output's address and write guard once its length is checked (`need` elements),
/// or 0 and no guard when absent.
fn optional_output<'a, T, B: DevicePtrMut<T>>(
    op: &'static str,
    what: &'static str,
    stream: &'a CudaStream,
    buffer: Option<&'a mut B>,
    need: usize,
) -> Result<(CUdeviceptr, Option<cudarc::driver::SyncOnDrop<'a>>)> {
    match buffer {
        Some(b) => {
            ensure_buffer(op, what, stream, b, need)?;
            let (p, g) = b.device_ptr_mut(stream);
            Ok((p, Some(g)))
        }
        None => Ok((0, None)),
    }
}

/// act columns per tile: `F` must be a multiple of it.
pub const FC1_TILE_N: usize = sys::CAPMOE_FUSED_FC1_TILE_N as usize;
/// dh columns per tile of [`FusedSwigluDgrad`] (per half): `F` must be a multiple of it.
pub const SWIGLU_DGRAD_TILE_N: usize = sys::CAPMOE_FUSED_SWIGLU_DGRAD_TILE_N as usize;
/// Largest `E` the fused kernels take.
pub const MAX_EXPERTS: usize = sys::CAPMOE_FUSED_MAX_EXPERTS as usize;

/// How the fused fc1 gathers a tile's x rows into shared memory. One form is left: a second
/// one, a TMA box per row, ran about 4x slower on the H200 and was removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Gather {
    /// `CpAsync`.
    #[default]
    Auto,
    /// 16-byte `cp.async` copies by a producer warpgroup, 8 lanes per row, so a warp-wide copy
    /// reads four whole 128-byte rows (`csrc/fused/gather_rows.cuh`).
    CpAsync,
}

/// The device of `stream` when a kernel exists for its arch, or why not: `builds` lists the
/// archs that have one, each with the kernel's name for [`Error::NotBuilt`] when this binary
/// was built without that arch; another arch is [`Error::UnsupportedArch`] (`need`: the archs,
/// for the message).
fn kernel_device(stream: &CudaStream, builds: &[(Arch, &'static str)], need: &'static str) -> Result<DeviceInfo> {
    let device = DeviceInfo::of_stream(stream)?;
    kernel_for_arch(device.arch, builds, need)?;
    Ok(device)
}

/// [`kernel_device`]'s decision for a device of `arch`.
fn kernel_for_arch(arch: Arch, builds: &[(Arch, &'static str)], need: &'static str) -> Result<()> {
    let Some(&(_, kernel)) = builds.iter().find(|(built, _)| *built == arch) else {
        return Err(Error::UnsupportedArch { need, got: format!("{arch:?}") });
    };
    if !arch.is_built() {
        return Err(Error::NotBuilt { kernel });
    }
    Ok(())
}

/// The archs with a fused fc1 kernel, each with its name for [`Error::NotBuilt`].
const FC1_BUILDS: [(Arch, &str); 2] = [(Arch::Sm90, "fused fc1 (sm_90a)"), (Arch::Sm100, "fused fc1 (sm_100a)")];

/// The archs with a fused fc2 dgrad + SwiGLU backward kernel (both forms), each with its name
/// for [`Error::NotBuilt`].
const DGRAD_BUILDS: [(Arch, &str); 2] = [
    (Arch::Sm90, "fused fc2 dgrad + SwiGLU backward (sm_90a)"),
    (Arch::Sm100, "fused fc2 dgrad + SwiGLU backward (sm_100a)"),
];

/// The archs with a gathered wgrad kernel, each with its name for [`Error::NotBuilt`].
const WGRAD_BUILDS: [(Arch, &str); 2] =
    [(Arch::Sm90, "gathered wgrad (sm_90a)"), (Arch::Sm100, "gathered wgrad (sm_100a)")];

/// The plan-time shape rules the fused kernels share: `F` a multiple of their column tile,
/// `E <=` [`MAX_EXPERTS`], a 16-bit activation type.
fn check_shapes(op: &'static str, c: &RoutingConfig, tile_n: usize) -> Result<()> {
    if !c.ffn.is_multiple_of(tile_n) {
        return Err(Error::Unsupported { op, why: format!("F = {} is not a multiple of {tile_n}", c.ffn) });
    }
    if c.num_experts > MAX_EXPERTS {
        return Err(Error::Unsupported { op, why: format!("E = {} exceeds {MAX_EXPERTS}", c.num_experts) });
    }
    if !matches!(c.dtype, DType::Bf16 | DType::F16) {
        return Err(Error::Unsupported { op, why: format!("activation dtype {:?}; need Bf16 or F16", c.dtype) });
    }
    // The weights are read through TMA, whose global strides must stay below 2^40 bytes: one
    // expert's W1 ([2F, H], 16-bit) is the largest. (It also keeps E * 2F * H, with E <= 1024,
    // far from wrapping the buffer-length checks.)
    if 2 * c.ffn as u128 * c.hidden as u128 * 2 >= 1 << 40 {
        return Err(Error::Unsupported {
            op,
            why: format!(
                "one expert's weights, 2F x H = {} x {}, reach the TMA limit of 2^40 bytes",
                2 * c.ffn,
                c.hidden
            ),
        });
    }
    Ok(())
}

/// The element type of a launch's buffers is the plan's.
fn ensure_dtype<T: Element>(op: &'static str, plan: DType) -> Result<()> {
    if T::DTYPE != plan {
        return Err(Error::Unsupported { op, why: format!("element type {:?} but the plan says {plan:?}", T::DTYPE) });
    }
    Ok(())
}

impl Gather {
    fn abi(self) -> sys::capmoe_fused_gather_t {
        (match self {
            Gather::Auto => sys::CAPMOE_FUSED_GATHER_AUTO,
            Gather::CpAsync => sys::CAPMOE_FUSED_GATHER_CP_ASYNC,
        }) as sys::capmoe_fused_gather_t
    }
}

/// The device words of a persistent sm_90a kernel's tile schedule (`csrc/fused/tile_schedule.cuh`:
/// a tile counter and a finished-CTA count, zero before a launch and set back to zero by its
/// last CTA), owned by a plan together with the stream whose launches share them: launches that
/// may overlap (other streams) must not, so any other stream is [`Error::WrongStream`].
#[derive(Debug)]
struct ScheduleWords {
    words: CudaSlice<i32>,
    stream: Arc<CudaStream>,
}

impl ScheduleWords {
    fn new(stream: &Arc<CudaStream>, count: u32) -> Result<ScheduleWords> {
        Ok(ScheduleWords { words: stream.alloc_zeros::<i32>(count as usize)?, stream: stream.clone() })
    }

    /// `Ok` on the stream the words belong to.
    fn ensure_stream(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        ensure_bound_stream(op, &self.stream, stream)
    }

    /// The words' address for a launch on `stream` (checked as [`ScheduleWords::ensure_stream`]),
    /// with the guard to hold until the launch is enqueued. The kernel writes the words and
    /// leaves them zero; a read guard is enough because only launches on this one stream use
    /// them, so no other stream's order depends on it.
    fn for_launch<'a>(&'a self, op: &'static str, stream: &'a CudaStream) -> Result<(*mut i32, impl Drop + 'a)> {
        self.ensure_stream(op, stream)?;
        let (words, guard) = self.words.device_ptr(stream);
        Ok((words as usize as *mut i32, guard))
    }
}

/// A validated fused fc1 + SwiGLU launch plan for one routing plan's shapes on one device,
/// bound to the stream it was made on: it owns the device words of the kernel's tile schedule
/// (`CAPMOE_FUSED_FC1_SCHEDULE_WORDS`, which launches ordered on one stream share), so a launch
/// on another stream is [`Error::WrongStream`].
#[derive(Debug)]
pub struct FusedFc1 {
    desc: sys::capmoe_fused_fc1_desc_t,
    experts: usize,
    hidden: usize,
    ffn: usize,
    max_tokens: usize,
    capacity: usize,
    dtype: DType,
    schedule: ScheduleWords,
}

impl FusedFc1 {
    /// Checks on the host that the fused kernel exists for `routing`'s shapes on the device of
    /// `stream`; an [`Error::Unsupported`] / [`Error::UnsupportedArch`] / [`Error::NotBuilt`]
    /// means: use the unfused path. No launch.
    pub fn new(routing: &RoutingPlan, stream: &Arc<CudaStream>) -> Result<FusedFc1> {
        Self::with_gather(routing, stream, Gather::Auto)
    }

    /// [`FusedFc1::new`] with a forced gather form.
    pub fn with_gather(routing: &RoutingPlan, stream: &Arc<CudaStream>, gather: Gather) -> Result<FusedFc1> {
        Self::plan(routing, stream, gather, false)
    }

    /// [`FusedFc1::new`] for a plan whose launches also write the gathered x rows, the
    /// permuted copy the unfused path's fc1 wgrad reads ([`FusedFc1::run_writing_rows`]): a
    /// training step then needs no permute pass. The sm_90a kernel only (its consumers copy the
    /// rows out of the shared-memory stages they gathered); [`Error::Unsupported`] on a 10.0
    /// device.
    pub fn writing_rows(routing: &RoutingPlan, stream: &Arc<CudaStream>) -> Result<FusedFc1> {
        Self::plan(routing, stream, Gather::Auto, true)
    }

    fn plan(routing: &RoutingPlan, stream: &Arc<CudaStream>, gather: Gather, write_rows: bool) -> Result<FusedFc1> {
        const OP: &str = "FusedFc1::new";
        // Plan time: never while capturing (the capture guards of module `graph`).
        crate::graph::ensure_not_capturing(stream, OP)?;
        let c = routing.config();
        Self::check_shapes(c)?;
        let device = kernel_device(stream, &FC1_BUILDS, "9.0 (sm_90a) or 10.0 (sm_100a) for the fused fc1")?;
        let desc = sys::capmoe_fused_fc1_desc_t {
            num_experts: c.num_experts as i64,
            hidden: c.hidden as i64,
            ffn: c.ffn as i64,
            max_tokens: c.max_tokens as i64,
            capacity: routing.capacity() as i64,
            sm_count: device.sm_count,
            dtype: c.dtype.abi(),
            gather: gather.abi(),
            write_rows: i32::from(write_rows),
        };
        stream.context().bind_to_thread()?;
        check(unsafe { sys::capmoe_fused_fc1_supported(&desc) }, OP)?;
        let schedule = ScheduleWords::new(stream, sys::CAPMOE_FUSED_FC1_SCHEDULE_WORDS)?;
        Ok(FusedFc1 {
            desc,
            experts: c.num_experts,
            hidden: c.hidden,
            ffn: c.ffn,
            max_tokens: c.max_tokens,
            capacity: routing.capacity(),
            dtype: c.dtype,
            schedule,
        })
    }

    /// The shape checks of [`FusedFc1::new`] that need no GPU: `F` a multiple of
    /// [`FC1_TILE_N`], `E <=` [`MAX_EXPERTS`], a 16-bit activation type. An `Err` means the
    /// fused kernel does not take this layer (use the unfused path).
    pub fn check_shapes(c: &RoutingConfig) -> Result<()> {
        check_shapes("FusedFc1::new", c, FC1_TILE_N)
    }

    /// The C ABI descriptor.
    pub fn desc(&self) -> &sys::capmoe_fused_fc1_desc_t {
        &self.desc
    }

    /// Whether the launches write the gathered rows ([`FusedFc1::writing_rows`]).
    pub fn writes_rows(&self) -> bool {
        self.desc.write_rows != 0
    }

    /// `act = SwiGLU(x[token_of_row[r]] · W1_eᵀ)` for every row `r < offsets[E]` of expert `e`,
    /// and `h = [gate | up]` when given (`None::<&mut CudaSlice<T>>` otherwise). `x [T_max, H]`,
    /// `w1 [E, 2F, H]`, `offsets [E + 1]` and `token_of_row [capacity]` as the routing build
    /// wrote them, `act [capacity, F]`, `h [capacity, 2F]`.
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: Element, H: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        w1: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        act: &mut impl DevicePtrMut<T>,
        h: Option<&mut H>,
    ) -> Result<()> {
        self.run_checked(stream, x, w1, offsets, token_of_row, 0, act, h, None::<&mut CudaSlice<T>>)
    }

    /// [`FusedFc1::run`] with each row's `act` weighted by its route's probability:
    /// `act[r] = p[r] · SwiGLU(...)`, `prob_of_row [capacity]` as
    /// [`RoutingPlan::row_probs`] wrote it (`h` is unchanged). fc2's output rows then come out
    /// weighted, and the combine is the unweighted gather-sum
    /// ([`RoutingPlan::permute_backward`]).
    #[allow(clippy::too_many_arguments)]
    pub fn run_weighted<T: Element, H: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        w1: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        prob_of_row: &impl DevicePtr<f32>,
        act: &mut impl DevicePtrMut<T>,
        h: Option<&mut H>,
    ) -> Result<()> {
        ensure_buffer("fused fc1", "prob_of_row [capacity]", stream, prob_of_row, self.capacity)?;
        let (pp, _guard) = prob_of_row.device_ptr(stream);
        self.run_checked(stream, x, w1, offsets, token_of_row, pp, act, h, None::<&mut CudaSlice<T>>)
    }

    /// [`FusedFc1::run`] (or, with `prob_of_row`, [`FusedFc1::run_weighted`]) of a
    /// [`FusedFc1::writing_rows`] plan, which also writes `rows [capacity, H]`:
    /// `rows[r] = x[token_of_row[r]]` for every row `r < offsets[E]`, the bits
    /// [`RoutingPlan::permute`] writes there; rows past `offsets[E]` are left as they are.
    #[allow(clippy::too_many_arguments)]
    pub fn run_writing_rows<T: Element, P: DevicePtr<f32>, H: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        w1: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        prob_of_row: Option<&P>,
        act: &mut impl DevicePtrMut<T>,
        h: Option<&mut H>,
        rows: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let (pp, _guard) = match prob_of_row {
            Some(p) => {
                ensure_buffer("fused fc1", "prob_of_row [capacity]", stream, p, self.capacity)?;
                let (pp, g) = p.device_ptr(stream);
                (pp, Some(g))
            }
            None => (0, None),
        };
        self.run_checked(stream, x, w1, offsets, token_of_row, pp, act, h, Some(rows))
    }

    /// The checks and the launch of every form; `prob_of_row` 0 for the unweighted one, `rows`
    /// given exactly when the plan writes them.
    #[allow(clippy::too_many_arguments)]
    fn run_checked<T: Element, H: DevicePtrMut<T>, R: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        w1: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        prob_of_row: CUdeviceptr,
        act: &mut impl DevicePtrMut<T>,
        h: Option<&mut H>,
        rows: Option<&mut R>,
    ) -> Result<()> {
        const OP: &str = "fused fc1";
        ensure_dtype::<T>(OP, self.dtype)?;
        self.ensure_rows_form(OP, rows.is_some())?;
        self.schedule.ensure_stream(OP, stream)?;
        let (e, hd, f, cap) = (self.experts, self.hidden, self.ffn, self.capacity);
        ensure_buffer(OP, "x [T_max, H]", stream, x, self.max_tokens * hd)?;
        ensure_buffer(OP, "w1 [E, 2F, H]", stream, w1, e * 2 * f * hd)?;
        ensure_buffer(OP, "offsets [E + 1]", stream, offsets, e + 1)?;
        ensure_buffer(OP, "token_of_row [capacity]", stream, token_of_row, cap)?;
        ensure_buffer(OP, "act [capacity, F]", stream, act, cap * f)?;
        stream.context().bind_to_thread()?;
        let (xp, _g0) = x.device_ptr(stream);
        let (wp, _g1) = w1.device_ptr(stream);
        let (op, _g2) = offsets.device_ptr(stream);
        let (tp, _g3) = token_of_row.device_ptr(stream);
        let (ap, _g4) = act.device_ptr_mut(stream);
        let (hp, _g5) = optional_output(OP, "h [capacity, 2F]", stream, h, cap * 2 * f)?;
        let (rp, _g6) = optional_output(OP, "rows [capacity, H]", stream, rows, cap * hd)?;
        ensure_aligned16(OP, [("x", xp), ("w1", wp), ("act", ap), ("h", hp), ("rows", rp)])?;
        unsafe { self.run_raw(stream, xp, wp, op, tp, prob_of_row, ap, hp, rp) }
    }

    /// [`Error::InvalidArgument`] unless the call gives `rows` exactly when the plan writes them.
    fn ensure_rows_form(&self, op: &'static str, rows_given: bool) -> Result<()> {
        match (self.writes_rows(), rows_given) {
            (true, false) => Err(Error::InvalidArgument {
                op,
                why: "this plan writes the gathered rows (FusedFc1::writing_rows): call run_writing_rows".into(),
            }),
            (false, true) => Err(Error::InvalidArgument {
                op,
                why: "rows given to a plan that does not write them (make it with FusedFc1::writing_rows)".into(),
            }),
            _ => Ok(()),
        }
    }

    /// Raw [`FusedFc1::run`] / [`FusedFc1::run_weighted`], in the crate's raw-pointer
    /// convention (docs/CONVENTIONS.md): the stream first, then device pointers as
    /// `CUdeviceptr` in the order of the safe forms, 0 for an absent `prob_of_row` (unweighted)
    /// or `h`, and `rows` 0 exactly when the plan does not write them
    /// ([`FusedFc1::writing_rows`]; else [`Error::InvalidArgument`]).
    ///
    /// [`Error::WrongStream`] on another stream than the plan's (its schedule words are
    /// shared by the launches ordered on that stream).
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes: `x` `T_max * H`,
    /// `w1` `E * 2F * H`, `act` `capacity * F`, (unless 0) `h` `capacity * 2F` and `rows`
    /// `capacity * H` elements of the plan's dtype, 16-byte aligned; `offsets` `E + 1` int64
    /// and `token_of_row` `capacity` int32 as the routing build wrote them; `prob_of_row`
    /// (unless 0) `capacity` f32. `act`, `h` and `rows` may not overlap each other or the
    /// inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        x: CUdeviceptr,
        w1: CUdeviceptr,
        offsets: CUdeviceptr,
        token_of_row: CUdeviceptr,
        prob_of_row: CUdeviceptr,
        act: CUdeviceptr,
        h: CUdeviceptr,
        rows: CUdeviceptr,
    ) -> Result<()> {
        self.ensure_rows_form("fused fc1", rows != 0)?;
        stream.context().bind_to_thread()?;
        let (schedule, _guard) = self.schedule.for_launch("fused fc1", stream)?;
        let s = stream.cu_stream() as *mut c_void;
        let ptr = |p: CUdeviceptr| p as usize as *mut c_void;
        check(
            sys::capmoe_fused_fc1(
                &self.desc,
                ptr(x),
                ptr(w1),
                offsets as usize as *const i64,
                token_of_row as usize as *const i32,
                prob_of_row as usize as *const f32,
                ptr(act),
                ptr(h),
                ptr(rows),
                schedule,
                s,
            ),
            "fused fc1",
        )
    }
}

/// A validated fused fc2 dgrad + SwiGLU backward launch plan for one routing plan's shapes on
/// one device, bound to the stream it was made on as [`FusedFc1`] is: it owns the device words
/// of the kernel's tile schedule (`CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS`, shared by the
/// launches of both forms ordered on that stream), so a launch on another stream is
/// [`Error::WrongStream`].
#[derive(Debug)]
pub struct FusedSwigluDgrad {
    desc: sys::capmoe_fused_swiglu_dgrad_desc_t,
    experts: usize,
    hidden: usize,
    ffn: usize,
    max_tokens: usize,
    capacity: usize,
    dtype: DType,
    schedule: ScheduleWords,
}

impl FusedSwigluDgrad {
    /// Checks on the host that the fused kernel exists for `routing`'s shapes on the device of
    /// `stream`; an [`Error::Unsupported`] / [`Error::UnsupportedArch`] / [`Error::NotBuilt`]
    /// means: use the unfused path. No launch.
    pub fn new(routing: &RoutingPlan, stream: &Arc<CudaStream>) -> Result<FusedSwigluDgrad> {
        const OP: &str = "FusedSwigluDgrad::new";
        // Plan time: never while capturing (the capture guards of module `graph`).
        crate::graph::ensure_not_capturing(stream, OP)?;
        let c = routing.config();
        Self::check_shapes(c)?;
        let device = kernel_device(stream, &DGRAD_BUILDS, "9.0 (sm_90a) or 10.0 (sm_100a) for the fused fc2 dgrad")?;
        let desc = sys::capmoe_fused_swiglu_dgrad_desc_t {
            num_experts: c.num_experts as i64,
            hidden: c.hidden as i64,
            ffn: c.ffn as i64,
            capacity: routing.capacity() as i64,
            max_tokens: c.max_tokens as i64,
            sm_count: device.sm_count,
            dtype: c.dtype.abi(),
        };
        stream.context().bind_to_thread()?;
        check(unsafe { sys::capmoe_fused_swiglu_dgrad_supported(&desc) }, OP)?;
        let schedule = ScheduleWords::new(stream, sys::CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS)?;
        Ok(FusedSwigluDgrad {
            desc,
            experts: c.num_experts,
            hidden: c.hidden,
            ffn: c.ffn,
            max_tokens: c.max_tokens,
            capacity: routing.capacity(),
            dtype: c.dtype,
            schedule,
        })
    }

    /// The shape checks of [`FusedSwigluDgrad::new`] that need no GPU: `F` a multiple of
    /// [`SWIGLU_DGRAD_TILE_N`], `E <=` [`MAX_EXPERTS`], a 16-bit activation type. An `Err`
    /// means the fused kernel does not take this layer (use the unfused path).
    pub fn check_shapes(c: &RoutingConfig) -> Result<()> {
        check_shapes("FusedSwigluDgrad::new", c, SWIGLU_DGRAD_TILE_N)
    }

    /// The C ABI descriptor.
    pub fn desc(&self) -> &sys::capmoe_fused_swiglu_dgrad_desc_t {
        &self.desc
    }

    /// Column slices of `F` ([`SWIGLU_DGRAD_TILE_N`] columns each): the width of
    /// [`FusedSwigluDgrad::run_gathered`]'s `dprob_partials [capacity, slices]`.
    pub fn dprob_slices(&self) -> usize {
        self.ffn / SWIGLU_DGRAD_TILE_N
    }

    /// For every row `r < offsets[E]` of expert `e`: `dact = round(drows[r] · W2_e)` and
    /// `dh[r] = [dgate | dup]`, the SwiGLU backward of `h[r] = [g | u]` at `dact`; `dact` itself
    /// is written when given (`None::<&mut CudaSlice<T>>` otherwise). `drows [capacity, H]`,
    /// `w2 [E, H, F]`, `h [capacity, 2F]` (the forward's), `offsets [E + 1]` as the routing
    /// build wrote them, `dh [capacity, 2F]`, `dact [capacity, F]`.
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: Element, D: DevicePtrMut<T>>(
        &self,
        stream: &CudaStream,
        drows: &impl DevicePtr<T>,
        w2: &impl DevicePtr<T>,
        h: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        dh: &mut impl DevicePtrMut<T>,
        dact: Option<&mut D>,
    ) -> Result<()> {
        const OP: &str = "fused fc2 dgrad + SwiGLU backward";
        ensure_dtype::<T>(OP, self.dtype)?;
        self.schedule.ensure_stream(OP, stream)?;
        let (e, hd, f, cap) = (self.experts, self.hidden, self.ffn, self.capacity);
        ensure_buffer(OP, "drows [capacity, H]", stream, drows, cap * hd)?;
        ensure_buffer(OP, "w2 [E, H, F]", stream, w2, e * hd * f)?;
        ensure_buffer(OP, "h [capacity, 2F]", stream, h, cap * 2 * f)?;
        ensure_buffer(OP, "offsets [E + 1]", stream, offsets, e + 1)?;
        ensure_buffer(OP, "dh [capacity, 2F]", stream, dh, cap * 2 * f)?;
        stream.context().bind_to_thread()?;
        let (rp, _g0) = drows.device_ptr(stream);
        let (wp, _g1) = w2.device_ptr(stream);
        let (hp, _g2) = h.device_ptr(stream);
        let (op, _g3) = offsets.device_ptr(stream);
        let (dhp, _g4) = dh.device_ptr_mut(stream);
        let (dap, _g5) = optional_output(OP, "dact [capacity, F]", stream, dact, cap * f)?;
        ensure_aligned16(OP, [("drows", rp), ("w2", wp), ("h", hp), ("dh", dhp), ("dact", dap)])?;
        unsafe { self.run_raw(stream, rp, wp, hp, op, dhp, dap) }
    }

    /// Raw [`FusedSwigluDgrad::run`], in the crate's raw-pointer convention
    /// (docs/CONVENTIONS.md): the stream first, then device pointers as `CUdeviceptr` in the
    /// order of the safe form, 0 for an absent `dact`. [`Error::WrongStream`] on another stream
    /// than the plan's.
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes: `drows`
    /// `capacity * H`, `w2` `E * H * F`, `h` and `dh` `capacity * 2F`, and (unless 0) `dact`
    /// `capacity * F` elements of the plan's dtype, 16-byte aligned; `offsets` `E + 1` int64 as
    /// the routing build wrote them. `dh` and `dact` may not overlap each other or the inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        drows: CUdeviceptr,
        w2: CUdeviceptr,
        h: CUdeviceptr,
        offsets: CUdeviceptr,
        dh: CUdeviceptr,
        dact: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "fused fc2 dgrad + SwiGLU backward";
        stream.context().bind_to_thread()?;
        let (schedule, _guard) = self.schedule.for_launch(OP, stream)?;
        let s = stream.cu_stream() as *mut c_void;
        let ptr = |p: CUdeviceptr| p as usize as *mut c_void;
        check(
            sys::capmoe_fused_swiglu_dgrad(
                &self.desc,
                ptr(drows),
                ptr(w2),
                ptr(h),
                offsets as usize as *const i64,
                ptr(dh),
                ptr(dact),
                schedule,
                s,
            ),
            OP,
        )
    }

    /// The gathered form, for a forward that weighted act by the route probability (fc1's
    /// epilogue) and combined fc2's rows unweighted: for every row `r < offsets[E]` of expert
    /// `e`, with `t = token_of_row[r]`, `dact = round(dy[t] · W2_e)` (a zero row when `t` is
    /// outside `[0, T_max)`), `dh[r]` the SwiGLU backward of `h[r] = [g | u]` at
    /// `prob_of_row[r] · dact`, and `dprob_partials[r, j] = Σ dact · SwiGLU(g, u)` over the
    /// columns of slice `j` (fp32, a fixed order: the same bits every launch). dprob of the
    /// row's route is the sum over `j <` [`FusedSwigluDgrad::dprob_slices`]. `dy [T_max, H]`,
    /// `w2 [E, H, F]`, `h [capacity, 2F]`, `offsets [E + 1]`, `token_of_row [capacity]`,
    /// `prob_of_row [capacity]`, `dh [capacity, 2F]`, `dprob_partials [capacity, slices]`.
    /// Rows at or past `offsets[E]` are not written.
    #[allow(clippy::too_many_arguments)]
    pub fn run_gathered<T: Element>(
        &self,
        stream: &CudaStream,
        dy: &impl DevicePtr<T>,
        w2: &impl DevicePtr<T>,
        h: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        prob_of_row: &impl DevicePtr<f32>,
        dh: &mut impl DevicePtrMut<T>,
        dprob_partials: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "fused fc2 dgrad + SwiGLU backward (gathered)";
        ensure_dtype::<T>(OP, self.dtype)?;
        self.schedule.ensure_stream(OP, stream)?;
        let (e, hd, f, cap) = (self.experts, self.hidden, self.ffn, self.capacity);
        ensure_buffer(OP, "dy [T_max, H]", stream, dy, self.max_tokens * hd)?;
        ensure_buffer(OP, "w2 [E, H, F]", stream, w2, e * hd * f)?;
        ensure_buffer(OP, "h [capacity, 2F]", stream, h, cap * 2 * f)?;
        ensure_buffer(OP, "offsets [E + 1]", stream, offsets, e + 1)?;
        ensure_buffer(OP, "token_of_row [capacity]", stream, token_of_row, cap)?;
        ensure_buffer(OP, "prob_of_row [capacity]", stream, prob_of_row, cap)?;
        ensure_buffer(OP, "dh [capacity, 2F]", stream, dh, cap * 2 * f)?;
        ensure_buffer(OP, "dprob_partials [capacity, F / 128]", stream, dprob_partials, cap * self.dprob_slices())?;
        stream.context().bind_to_thread()?;
        let (yp, _g0) = dy.device_ptr(stream);
        let (wp, _g1) = w2.device_ptr(stream);
        let (hp, _g2) = h.device_ptr(stream);
        let (op, _g3) = offsets.device_ptr(stream);
        let (tp, _g4) = token_of_row.device_ptr(stream);
        let (pp, _g5) = prob_of_row.device_ptr(stream);
        let (dhp, _g6) = dh.device_ptr_mut(stream);
        let (dpp, _g7) = dprob_partials.device_ptr_mut(stream);
        ensure_aligned16(OP, [("dy", yp), ("w2", wp), ("h", hp), ("dh", dhp)])?;
        unsafe { self.run_gathered_raw(stream, yp, wp, hp, op, tp, pp, dhp, dpp) }
    }

    /// Raw [`FusedSwigluDgrad::run_gathered`], in the crate's raw-pointer convention
    /// (docs/CONVENTIONS.md): the stream first, then device pointers as `CUdeviceptr` in the
    /// order of the safe form. [`Error::WrongStream`] on another stream than the plan's.
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes: `dy`
    /// `T_max * H`, `w2` `E * H * F`, `h` and `dh` `capacity * 2F` elements of the plan's
    /// dtype, 16-byte aligned; `offsets` `E + 1` int64 and `token_of_row` `capacity` int32 as
    /// the routing build wrote them; `prob_of_row` `capacity` and `dprob_partials`
    /// `capacity * dprob_slices()` f32. `dh` and `dprob_partials` may not overlap each other or
    /// the inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_gathered_raw(
        &self,
        stream: &CudaStream,
        dy: CUdeviceptr,
        w2: CUdeviceptr,
        h: CUdeviceptr,
        offsets: CUdeviceptr,
        token_of_row: CUdeviceptr,
        prob_of_row: CUdeviceptr,
        dh: CUdeviceptr,
        dprob_partials: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "fused fc2 dgrad + SwiGLU backward (gathered)";
        stream.context().bind_to_thread()?;
        let (schedule, _guard) = self.schedule.for_launch(OP, stream)?;
        let s = stream.cu_stream() as *mut c_void;
        let ptr = |p: CUdeviceptr| p as usize as *mut c_void;
        check(
            sys::capmoe_fused_swiglu_dgrad_gathered(
                &self.desc,
                ptr(dy),
                ptr(w2),
                ptr(h),
                offsets as usize as *const i64,
                token_of_row as usize as *const i32,
                prob_of_row as usize as *const f32,
                ptr(dh),
                dprob_partials as usize as *mut f32,
                schedule,
                s,
            ),
            OP,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fc1, the dgrad (both forms) and the gathered wgrad have a kernel on 9.0 and 10.0, each
    /// usable only when its arch is built.
    #[test]
    fn fused_kernels_by_arch_host() {
        for (name, builds) in [("fc1", &FC1_BUILDS), ("dgrad", &DGRAD_BUILDS), ("wgrad", &WGRAD_BUILDS)] {
            for arch in [Arch::Sm90, Arch::Sm100] {
                let got = kernel_for_arch(arch, builds, "9.0 or 10.0");
                if arch.is_built() {
                    assert!(got.is_ok(), "{name} on a built {arch:?}: {got:?}");
                } else {
                    assert!(matches!(got, Err(Error::NotBuilt { .. })), "{name} on an unbuilt {arch:?}: {got:?}");
                }
            }
        }
    }
}
