//! [`GatherWgrad`]: the grouped weight gradient that reads an operand's rows through the
//! routing build's `token_of_row` (C side: `csrc/fused/wgrad_gather*.cu`, contract in
//! `csrc/include/capturable_moe/wgrad_gather.h`), so the backward needs no permuted copy of x
//! and a training forward with the fused fc1 writes none.
//!
//! For every expert `e` with rows `[offsets[e], offsets[e+1])` (each clamped into
//! `[0, capacity]`):
//!
//! ```text
//! dW[e, m, n] = Σ_r A(r)[m] · B(r)[n]        dW [E, M, N] row-major
//! A(r) = a[r]                (RowSource::Plain,    a [capacity, M])
//!      = a[token_of_row[r]]  (RowSource::Gathered, a [T_max, M]);   B(r) likewise with N
//! ```
//!
//! fc1's wgrad ([`GatherWgradConfig::fc1`]): `A = dH` plain (`M = 2F`), `B = x` gathered
//! (`N = H`). fc2's would be `A = dy` gathered (`M = H`), `B = act` plain (`N = F`).
//!
//! Invariants of every launch: each sum is accumulated in fp32 and rounded once to the output
//! type, or, with [`WgradOutput::F32Accumulate`], added to what `dW` holds (the crate's
//! `wgrad_accumulate` main-grad mode); an expert without rows gets `dW_e = 0`, or is left
//! unchanged when accumulating (the grouped GEMM's WGRAD contract); rows at or past the
//! device-side `offsets[E]` are never read, whatever they hold; a row whose token lies outside
//! `[0, T_max)` contributes nothing. No allocation, no host sync, no host read of device data:
//! a launch can be captured in a CUDA graph and replayed with new routing.
//!
//! Kernels on sm_90a: a 16-bit `dW` with one gathered operand (both uses in the expert path)
//! runs the grouped GEMM's counter wgrad with that operand copied by cp.async and the other by
//! TMA, its tiles handed out by a device counter whose words the plan owns (so a plan is bound
//! to the stream it was made on); fp32 outputs and the other row-source pairs run the older
//! strided kernel (`csrc/fused/wgrad_gather_sm90.cu`), which `CAPMOE_GATHER_WGRAD=strided`
//! forces everywhere (for A/B).
//!
//! Where it applies ([`GatherWgrad::new`] says why not otherwise, before any launch): an
//! sm_90a build on a compute capability 9.0 device, or an sm_100a build on 10.0 (its Blackwell
//! kernel, tcgen05 with TMEM accumulators, is compiled only: no Blackwell GPU has run it), `M`
//! and `N` multiples of 8, 16-bit operands. Elsewhere permute and use the grouped GEMM's WGRAD.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::{ensure_dtype, kernel_device, ScheduleWords, WGRAD_BUILDS};
use crate::device::{ensure_aligned16, ensure_buffer};
use crate::dtype::DType;
use crate::error::check;
use crate::routing::{Element, RoutingPlan};
use crate::{sys, Error, Result};

/// Output rows (`m`) of one tile of the kernel.
pub const WGRAD_TILE_M: usize = sys::CAPMOE_WGRAD_GATHER_TILE_M as usize;
/// Output columns (`n`) of one tile of the kernel.
pub const WGRAD_TILE_N: usize = sys::CAPMOE_WGRAD_GATHER_TILE_N as usize;

/// Where an operand's row `r` (a routing row of some expert) comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowSource {
    /// Row `r` of a `[capacity, cols]` matrix in routing order (dH, act).
    Plain,
    /// Row `token_of_row[r]` of a `[T_max, cols]` matrix in token order (x, dy).
    Gathered,
}

impl RowSource {
    fn abi(self) -> sys::capmoe_wgrad_rows_t {
        (match self {
            RowSource::Plain => sys::CAPMOE_WGRAD_ROWS_PLAIN,
            RowSource::Gathered => sys::CAPMOE_WGRAD_ROWS_GATHERED,
        }) as sys::capmoe_wgrad_rows_t
    }
}

/// What `dW` holds after a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WgradOutput {
    /// The sums rounded to the operands' type.
    Same,
    /// The fp32 sums.
    F32,
    /// `dW += ` the fp32 sums (fp32 `dW`).
    F32Accumulate,
}

/// Everything that fixes a [`GatherWgrad`] at plan time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatherWgradConfig {
    pub num_experts: usize,
    /// Columns of `a`, rows of each `dW_e`.
    pub m: usize,
    /// Columns of `b` and of each `dW_e`.
    pub n: usize,
    /// Routing rows: the length of `token_of_row` and the rows of a [`RowSource::Plain`] operand.
    pub capacity: usize,
    /// `T_max`: the rows of a [`RowSource::Gathered`] operand.
    pub max_tokens: usize,
    /// `a` and `b`: `Bf16` or `F16`.
    pub dtype: DType,
    pub output: WgradOutput,
    pub a_rows: RowSource,
    pub b_rows: RowSource,
}

impl GatherWgradConfig {
    /// fc1's weight gradient for `routing`'s shapes: `dW1 [E, 2F, H] = dHᵀ · x[token_of_row]`,
    /// `a = dH [capacity, 2F]` plain, `b = x [T_max, H]` gathered.
    pub fn fc1(routing: &RoutingPlan, output: WgradOutput) -> GatherWgradConfig {
        let c = routing.config();
        GatherWgradConfig {
            num_experts: c.num_experts,
            m: 2 * c.ffn,
            n: c.hidden,
            capacity: routing.capacity(),
            max_tokens: c.max_tokens,
            dtype: c.dtype,
            output,
            a_rows: RowSource::Plain,
            b_rows: RowSource::Gathered,
        }
    }

    /// fc2's weight gradient for `routing`'s shapes when the route probability is applied in
    /// fc1's epilogue (`act = p · SwiGLU`): fc2's output rows then get plain `dy[token]` as
    /// their gradient, so `dW2 [E, H, F] = dy[token_of_row]ᵀ · act`, `a = dy [T_max, H]`
    /// gathered, `b = act [capacity, F]` plain.
    pub fn fc2_from_dy(routing: &RoutingPlan, output: WgradOutput) -> GatherWgradConfig {
        let c = routing.config();
        GatherWgradConfig {
            num_experts: c.num_experts,
            m: c.hidden,
            n: c.ffn,
            capacity: routing.capacity(),
            max_tokens: c.max_tokens,
            dtype: c.dtype,
            output,
            a_rows: RowSource::Gathered,
            b_rows: RowSource::Plain,
        }
    }

    /// The element type of `dW`.
    pub fn out_dtype(&self) -> DType {
        match self.output {
            WgradOutput::Same => self.dtype,
            WgradOutput::F32 | WgradOutput::F32Accumulate => DType::F32,
        }
    }

    /// Rows of an operand read from `source`.
    fn rows_of(&self, source: RowSource) -> usize {
        match source {
            RowSource::Plain => self.capacity,
            RowSource::Gathered => self.max_tokens,
        }
    }

    /// Element counts `(a, b, dw)` a launch reads or writes.
    pub fn operand_lens(&self) -> (usize, usize, usize) {
        let a = self.rows_of(self.a_rows) * self.m;
        let b = self.rows_of(self.b_rows) * self.n;
        (a, b, self.num_experts * self.m * self.n)
    }

    fn gathers(&self) -> bool {
        self.a_rows == RowSource::Gathered || self.b_rows == RowSource::Gathered
    }
}

/// A validated gathered-wgrad launch plan for one shape on one device, bound to the stream it
/// was made on: it owns the device words of the kernel's tile schedule
/// (`CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS`, which launches ordered on one stream share), so a
/// launch on another stream is [`Error::WrongStream`](crate::Error::WrongStream).
#[derive(Debug)]
pub struct GatherWgrad {
    config: GatherWgradConfig,
    desc: sys::capmoe_wgrad_gather_desc_t,
    schedule: ScheduleWords,
}

impl GatherWgrad {
    /// Checks on the host that the kernel exists for `config` on the device of `stream`; an
    /// [`Error::Unsupported`] / [`Error::UnsupportedArch`] / [`Error::NotBuilt`] means: permute
    /// and use the grouped GEMM's WGRAD. No launch.
    pub fn new(config: GatherWgradConfig, stream: &Arc<CudaStream>) -> Result<GatherWgrad> {
        const OP: &str = "GatherWgrad::new";
        // Plan time: never while capturing (the capture guards of module `graph`).
        crate::graph::ensure_not_capturing(stream, OP)?;
        Self::check_shapes(&config)?;
        let device = kernel_device(stream, &WGRAD_BUILDS, "9.0 (sm_90a) or 10.0 (sm_100a) for the gathered wgrad")?;
        let desc = Self::abi_desc(&config, device.sm_count);
        stream.context().bind_to_thread()?;
        check(unsafe { sys::capmoe_wgrad_gather_supported(&desc) }, OP)?;
        let schedule = ScheduleWords::new(stream, sys::CAPMOE_WGRAD_GATHER_SCHEDULE_WORDS)?;
        Ok(GatherWgrad { config, desc, schedule })
    }

    /// The checks of [`GatherWgrad::new`] that need no GPU (the C ABI makes them again).
    pub fn check_shapes(c: &GatherWgradConfig) -> Result<()> {
        const OP: &str = "GatherWgrad::new";
        let invalid = |why: String| Err(Error::InvalidArgument { op: OP, why });
        if c.num_experts == 0 || c.num_experts > i32::MAX as usize {
            return invalid(format!("num_experts = {} must be in 1..=i32::MAX", c.num_experts));
        }
        for (what, value) in [("M", c.m), ("N", c.n)] {
            if !(8..=i32::MAX as usize).contains(&value) {
                return invalid(format!("{what} = {value} must be in 8..=i32::MAX"));
            }
            if !value.is_multiple_of(8) {
                return Err(Error::Alignment { op: OP, what, value: value as i64, multiple: 8 });
            }
        }
        // The kernel steps through rows in int32 blocks of 64: the C ABI's capacity bound.
        const MAX_CAPACITY: usize = i32::MAX as usize - 128;
        for (what, value, max) in
            [("capacity", c.capacity, MAX_CAPACITY), ("max_tokens", c.max_tokens, i32::MAX as usize)]
        {
            if value > max {
                return invalid(format!("{what} = {value} must be at most {max}"));
            }
        }
        if !matches!(c.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported { op: OP, why: format!("operand dtype {:?}; need Bf16 or F16", c.dtype) });
        }
        let tiles = c.num_experts as u128 * c.m.div_ceil(WGRAD_TILE_M) as u128 * c.n.div_ceil(WGRAD_TILE_N) as u128;
        if tiles > i32::MAX as u128 {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("{tiles} output tiles exceed the kernel's int32 index"),
            });
        }
        Ok(())
    }

    fn abi_desc(c: &GatherWgradConfig, sm_count: i32) -> sys::capmoe_wgrad_gather_desc_t {
        sys::capmoe_wgrad_gather_desc_t {
            num_experts: c.num_experts as i64,
            m: c.m as i64,
            n: c.n as i64,
            capacity: c.capacity as i64,
            max_tokens: c.max_tokens as i64,
            sm_count,
            dtype: c.dtype.abi(),
            out_dtype: c.out_dtype().abi(),
            accumulate: (c.output == WgradOutput::F32Accumulate) as i32,
            a_rows: c.a_rows.abi(),
            b_rows: c.b_rows.abi(),
        }
    }

    /// What the plan was built for.
    pub fn config(&self) -> &GatherWgradConfig {
        &self.config
    }

    /// The C ABI descriptor (the configuration plus the device's SM count).
    pub fn desc(&self) -> &sys::capmoe_wgrad_gather_desc_t {
        &self.desc
    }

    /// `dW` as the module describes, on `stream`. `T` is the operands' type, `O` `dW`'s (`T`,
    /// or `f32` for the fp32 outputs). `offsets [E + 1]` and `token_of_row [capacity]` as the
    /// routing build wrote them (`token_of_row` is not read when no operand is gathered).
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: Element, O: Element>(
        &self,
        stream: &CudaStream,
        a: &impl DevicePtr<T>,
        b: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        token_of_row: &impl DevicePtr<i32>,
        dw: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        const OP: &str = "gathered wgrad";
        let c = &self.config;
        ensure_dtype::<T>(OP, c.dtype)?;
        ensure_dtype::<O>(OP, c.out_dtype())?;
        let (a_len, b_len, dw_len) = c.operand_lens();
        ensure_buffer(OP, "a", stream, a, a_len)?;
        ensure_buffer(OP, "b", stream, b, b_len)?;
        ensure_buffer(OP, "offsets [E + 1]", stream, offsets, c.num_experts + 1)?;
        ensure_buffer(OP, "token_of_row [capacity]", stream, token_of_row, if c.gathers() { c.capacity } else { 0 })?;
        ensure_buffer(OP, "dw [E, M, N]", stream, dw, dw_len)?;
        stream.context().bind_to_thread()?;
        let (ap, _g0) = a.device_ptr(stream);
        let (bp, _g1) = b.device_ptr(stream);
        let (op, _g2) = offsets.device_ptr(stream);
        let (tp, _g3) = token_of_row.device_ptr(stream);
        let (dp, _g4) = dw.device_ptr_mut(stream);
        ensure_aligned16(OP, [("a", ap), ("b", bp), ("dw", dp)])?;
        unsafe { self.run_raw(stream, ap, bp, op, tp, dp) }
    }

    /// Raw [`GatherWgrad::run`], in the crate's raw-pointer convention (docs/CONVENTIONS.md):
    /// the stream first, then device pointers as `CUdeviceptr` in the order of the safe form
    /// (`token_of_row` may be 0 when no operand is gathered). `stream` must be the plan's
    /// ([`Error::WrongStream`](crate::Error::WrongStream) otherwise: its schedule words).
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes, 16-byte aligned
    /// where it holds operands: `a`, `b` and `dw` of [`GatherWgradConfig::operand_lens`]
    /// elements of the plan's types; `offsets` `E + 1` int64 and `token_of_row` `capacity`
    /// int32 as the routing build wrote them. `dw` may not overlap the inputs.
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        a: CUdeviceptr,
        b: CUdeviceptr,
        offsets: CUdeviceptr,
        token_of_row: CUdeviceptr,
        dw: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "gathered wgrad";
        let (schedule, _guard) = self.schedule.for_launch(OP, stream)?;
        stream.context().bind_to_thread()?;
        let s = stream.cu_stream() as *mut c_void;
        check(
            sys::capmoe_wgrad_gather(
                &self.desc,
                a as usize as *const c_void,
                b as usize as *const c_void,
                offsets as usize as *const i64,
                token_of_row as usize as *const i32,
                dw as usize as *mut c_void,
                schedule,
                s,
            ),
            OP,
        )
    }
}
