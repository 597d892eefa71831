//! Fused expert-path kernels (C side: `csrc/fused/`, contract in
//! `csrc/include/capturable_moe/fused.h`).
//!
//! [`FusedFc1`]: fc1 with its A rows gathered straight from `x` through the routing build's
//! `token_of_row` (no permuted copy of x is written or read) and SwiGLU in its epilogue:
//! `act [capacity, F]` (and, on request, the pre-activation `h [capacity, 2F]` the unfused
//! SwiGLU backward reads) in one persistent sm_90a kernel. `act` and `h` are in routing row
//! order, exactly where the unfused permute -> fc1 -> SwiGLU path puts them, and equal to it
//! (gate and up are rounded to the activation type before SwiGLU, as the unfused path does).
//!
//! Invariants of every launch: rows at or past the device-side total `offsets[E]` (clamped to
//! `capacity`) are neither read nor written; no allocation, no host sync, no host read of
//! device data, so a launch can be captured in a CUDA graph and replayed with new routing.
//!
//! Where it applies ([`FusedFc1::new`] says why not otherwise, before any launch): an sm_90a
//! build on a compute capability 9.0 device, weights as one `[E, 2F, H]` tensor, `F` a
//! multiple of [`FC1_TILE_N`], `E <=` [`MAX_EXPERTS`]. Elsewhere use the unfused path.

use std::ffi::c_void;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use crate::device::{ensure_buffer, Arch, DeviceInfo};
use crate::dtype::DType;
use crate::error::check;
use crate::routing::{Element, RoutingConfig, RoutingPlan};
use crate::{sys, Error, Result};

// The gathered grouped wgrad (fc1's weight gradient without a permuted x).
mod wgrad;
pub use wgrad::{GatherWgrad, GatherWgradConfig, RowSource, WgradOutput, WGRAD_TILE_M, WGRAD_TILE_N};

/// act columns per tile: `F` must be a multiple of it.
pub const FC1_TILE_N: usize = sys::CAPMOE_FUSED_FC1_TILE_N as usize;
/// Largest `E` the fused kernels take.
pub const MAX_EXPERTS: usize = sys::CAPMOE_FUSED_MAX_EXPERTS as usize;

/// How the fused fc1 gathers a tile's x rows into shared memory (both give the same bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Gather {
    /// The faster of the two on the H100.
    #[default]
    Auto,
    /// One TMA per row (a `1 x 64` box of x), issued by one producer warp.
    TmaRows,
    /// 16-byte `cp.async` copies by a producer warpgroup, one row per thread.
    CpAsync,
}

impl Gather {
    fn abi(self) -> sys::capmoe_fused_gather_t {
        (match self {
            Gather::Auto => sys::CAPMOE_FUSED_GATHER_AUTO,
            Gather::TmaRows => sys::CAPMOE_FUSED_GATHER_TMA_ROWS,
            Gather::CpAsync => sys::CAPMOE_FUSED_GATHER_CP_ASYNC,
        }) as sys::capmoe_fused_gather_t
    }
}

/// A validated fused fc1 + SwiGLU launch plan for one routing plan's shapes on one device.
#[derive(Clone, Debug)]
pub struct FusedFc1 {
    desc: sys::capmoe_fused_fc1_desc_t,
    experts: usize,
    hidden: usize,
    ffn: usize,
    max_tokens: usize,
    capacity: usize,
    dtype: DType,
}

impl FusedFc1 {
    /// Checks on the host that the fused kernel exists for `routing`'s shapes on the device of
    /// `stream`; an [`Error::Unsupported`] / [`Error::UnsupportedArch`] / [`Error::NotBuilt`]
    /// means: use the unfused path. No launch.
    pub fn new(routing: &RoutingPlan, stream: &CudaStream) -> Result<FusedFc1> {
        Self::with_gather(routing, stream, Gather::Auto)
    }

    /// [`FusedFc1::new`] with a forced gather form.
    pub fn with_gather(routing: &RoutingPlan, stream: &CudaStream, gather: Gather) -> Result<FusedFc1> {
        const OP: &str = "FusedFc1::new";
        let c = routing.config();
        Self::check_shapes(c)?;
        let device = DeviceInfo::of_stream(stream)?;
        if device.arch != Arch::Sm90 {
            return Err(Error::UnsupportedArch {
                need: "9.0 (sm_90a) for the fused fc1",
                got: format!("{:?}", device.arch),
            });
        }
        if !cfg!(has_sm90) {
            return Err(Error::NotBuilt { kernel: "fused fc1 (sm_90a)" });
        }
        let desc = sys::capmoe_fused_fc1_desc_t {
            num_experts: c.num_experts as i64,
            hidden: c.hidden as i64,
            ffn: c.ffn as i64,
            max_tokens: c.max_tokens as i64,
            capacity: routing.capacity() as i64,
            sm_count: device.sm_count,
            dtype: c.dtype.abi(),
            gather: gather.abi(),
        };
        stream.context().bind_to_thread()?;
        check(unsafe { sys::capmoe_fused_fc1_supported(&desc) }, OP)?;
        Ok(FusedFc1 {
            desc,
            experts: c.num_experts,
            hidden: c.hidden,
            ffn: c.ffn,
            max_tokens: c.max_tokens,
            capacity: routing.capacity(),
            dtype: c.dtype,
        })
    }

    /// The shape checks of [`FusedFc1::new`] that need no GPU: `F` a multiple of
    /// [`FC1_TILE_N`], `E <=` [`MAX_EXPERTS`], a 16-bit activation type. An `Err` means the
    /// fused kernel does not take this layer (use the unfused path).
    pub fn check_shapes(c: &RoutingConfig) -> Result<()> {
        const OP: &str = "FusedFc1::new";
        if !c.ffn.is_multiple_of(FC1_TILE_N) {
            return Err(Error::Unsupported { op: OP, why: format!("F = {} is not a multiple of {FC1_TILE_N}", c.ffn) });
        }
        if c.num_experts > MAX_EXPERTS {
            return Err(Error::Unsupported { op: OP, why: format!("E = {} exceeds {MAX_EXPERTS}", c.num_experts) });
        }
        if !matches!(c.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("activation dtype {:?}; need Bf16 or F16", c.dtype),
            });
        }
        Ok(())
    }

    /// The C ABI descriptor.
    pub fn desc(&self) -> &sys::capmoe_fused_fc1_desc_t {
        &self.desc
    }

    /// `act = SwiGLU(x[token_of_row[r]] · W1_eᵀ)` for every row `r < offsets[E]` of expert `e`,
    /// and `h = [gate | up]` when given (`None::<&mut CudaSlice<T>>` otherwise). `x [T_max, H]`, `w1 [E, 2F, H]`, `offsets [E + 1]` and
    /// `token_of_row [capacity]` as the routing build wrote them, `act [capacity, F]`,
    /// `h [capacity, 2F]`.
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
        const OP: &str = "fused fc1";
        if T::DTYPE != self.dtype {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("element type {:?} but the plan says {:?}", T::DTYPE, self.dtype),
            });
        }
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
        let (hp, _g5) = match h {
            Some(h) => {
                ensure_buffer(OP, "h [capacity, 2F]", stream, h, cap * 2 * f)?;
                let (p, g) = h.device_ptr_mut(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        for (what, p) in [("x", xp), ("w1", wp), ("act", ap), ("h", hp)] {
            if !p.is_multiple_of(16) {
                return Err(Error::InvalidArgument { op: OP, why: format!("{what} at {p:#x} is not 16-byte aligned") });
            }
        }
        unsafe { self.run_raw(stream, xp, wp, op, tp, ap, hp) }
    }

    /// Raw [`FusedFc1::run`], in the crate's raw-pointer convention (docs/CONVENTIONS.md):
    /// the stream first, then device pointers as `CUdeviceptr` in the order of the safe form,
    /// 0 for an absent `h`.
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes: `x` `T_max * H`,
    /// `w1` `E * 2F * H`, `act` `capacity * F` and (unless 0) `h` `capacity * 2F` elements
    /// of the plan's dtype, 16-byte aligned; `offsets` `E + 1` int64 and `token_of_row`
    /// `capacity` int32 as the routing build wrote them. `act` and `h` may not overlap each
    /// other or the inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        x: CUdeviceptr,
        w1: CUdeviceptr,
        offsets: CUdeviceptr,
        token_of_row: CUdeviceptr,
        act: CUdeviceptr,
        h: CUdeviceptr,
    ) -> Result<()> {
        stream.context().bind_to_thread()?;
        let s = stream.cu_stream() as *mut c_void;
        let ptr = |p: CUdeviceptr| p as usize as *mut c_void;
        check(
            sys::capmoe_fused_fc1(
                &self.desc,
                ptr(x),
                ptr(w1),
                offsets as usize as *const i64,
                token_of_row as usize as *const i32,
                ptr(act),
                ptr(h),
                s,
            ),
            "fused fc1",
        )
    }
}
