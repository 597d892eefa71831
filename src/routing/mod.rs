//! Device-side MoE routing (C side: `csrc/routing/`, contract in
//! `csrc/include/capturable_moe/routing.h`): per-expert counts and offsets, the permutation maps,
//! permute / unpermute (prob weighting fused) and SwiGLU, forward and backward.
//!
//! Invariants of every launch:
//! - Rows are expert-contiguous, experts ascending, routes within an expert in ascending
//!   `t * k + j`: bitwise deterministic, independent of scheduling, no atomics in any sum.
//! - Expert id `-1` is an empty slot; other ids outside `[0, E)` are dropped (flag
//!   [`flags::BAD_EXPERT`]); a duplicate id in one token is two independent routes.
//! - Dropping: an expert keeps at most `expert_capacity` routes (first in row order), then
//!   rows at or past `capacity` are dropped (later experts first), flag [`flags::CAPACITY`].
//! - The token count may live on the device ([`Tokens::Device`]), clamped into `[0, T_max]`.
//! - Nothing is read or written past `capacity` rows or past the device-side total
//!   `offsets[E]`; token rows `t >= T` of the outputs are not written.
//! - No launch allocates, synchronises or reads device data on the host: all are capturable.

pub mod reference;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::{ensure_buffer, ensure_same_context};
use crate::error::check;
use crate::{sys, Error, Result};

pub use crate::dtype::DType;

/// A Rust type the routing kernels read and write, with its [`DType`].
pub trait Element: DeviceRepr + reference::Scalar {
    const DTYPE: DType;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

/// Flag bits ORed into the device flags word (sticky; the caller clears it). `CAPACITY` is the
/// same bit as the grouped GEMM's capacity overflow bit, so both can share one word.
pub mod flags {
    use crate::sys;
    /// Routes were dropped by `capacity` or `expert_capacity`.
    pub const CAPACITY: i32 = sys::CAPMOE_ROUTING_CAPACITY as i32;
    /// An expert id outside `[0, E)` (other than -1) was dropped.
    pub const BAD_EXPERT: i32 = sys::CAPMOE_ROUTING_BAD_EXPERT as i32;
    /// Map conversion: a token had more than `k` routes (its lowest `k` experts were kept).
    pub const TOO_MANY: i32 = sys::CAPMOE_ROUTING_TOO_MANY as i32;
    /// The device-side token count was outside `[0, T_max]` and was clamped.
    pub const BAD_TOKENS: i32 = sys::CAPMOE_ROUTING_BAD_TOKENS as i32;
}

/// Largest `E` a plan accepts.
pub const MAX_EXPERTS: usize = sys::CAPMOE_ROUTING_MAX_EXPERTS as usize;
/// Largest `k` a plan accepts.
pub const MAX_TOPK: usize = sys::CAPMOE_ROUTING_MAX_TOPK as usize;

/// The facts a plan is made from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingConfig {
    /// E.
    pub num_experts: usize,
    /// H, the model width (multiple of 8).
    pub hidden: usize,
    /// F, the expert FFN width; fc1 has 2F outputs `[gate F | up F]` (multiple of 8).
    pub ffn: usize,
    /// k, routes per token.
    pub topk: usize,
    /// T_max: the buffers are sized for it; each launch may use any T <= T_max.
    pub max_tokens: usize,
    /// Rows of the permuted buffers; `None` = `T_max * k` (nothing can be dropped).
    pub capacity: Option<usize>,
    /// Rows one expert may keep; `None` = no per-expert limit.
    pub expert_capacity: Option<usize>,
    /// Activations (x, rows, y): `Bf16` or `F16`.
    pub dtype: DType,
    /// probs / dprobs: `F32`, `Bf16` or `F16`.
    pub prob_dtype: DType,
}

/// The token count of a launch: known on the host, or an `int32` on the device (read on the
/// GPU, so a captured graph replays with a new T).
#[derive(Clone, Copy)]
pub enum Tokens<'a> {
    Host(usize),
    Device(&'a CudaSlice<i32>),
}

/// Device buffers a [`RoutingPlan::build`] writes, sized by [`RoutingPlan::alloc_maps`].
pub struct RouteMaps {
    /// `[E]` rows kept per expert (int32 form of m_splits).
    pub m_splits_i32: CudaSlice<i32>,
    /// `[E]` rows kept per expert (int64 form of m_splits).
    pub m_splits_i64: CudaSlice<i64>,
    /// `[E + 1]` exclusive prefix sum of m_splits; `offsets[E]` is the row total.
    pub offsets: CudaSlice<i64>,
    /// `[T_max * k]` row of each route, -1 when dropped or absent.
    pub row_of_route: CudaSlice<i32>,
    /// `[capacity]` token of each row, -1 past the total.
    pub token_of_row: CudaSlice<i32>,
    /// `[E]` routes per expert before dropping.
    pub expert_counts: CudaSlice<i32>,
    /// `[1]` sticky flag bits ([`flags`]).
    pub flags: CudaSlice<i32>,
    /// Scratch of [`RoutingPlan::workspace_bytes`] bytes.
    pub workspace: CudaSlice<u8>,
}

/// What a [`RoutingPlan`] was built for ([`RoutingPlan::desc`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingDesc {
    /// The configuration as given.
    pub config: RoutingConfig,
    /// Rows of the permuted buffers (`config.capacity`, or `T_max * k` for `None`).
    pub capacity: usize,
    /// Bytes of workspace [`RoutingPlan::build`] needs.
    pub workspace_bytes: usize,
}

/// A validated routing configuration: shapes fixed at plan time, T and routing free per launch.
#[derive(Clone, Debug)]
pub struct RoutingPlan {
    config: RoutingConfig,
    desc: sys::capmoe_routing_desc_t,
    workspace_bytes: usize,
}

fn invalid(op: &'static str, why: String) -> Error {
    Error::InvalidArgument { op, why }
}

impl RoutingPlan {
    /// Checks the configuration on the host. No CUDA work.
    pub fn new(config: RoutingConfig) -> Result<RoutingPlan> {
        const OP: &str = "RoutingPlan::new";
        let c = &config;
        if c.num_experts == 0 || c.num_experts > MAX_EXPERTS {
            return Err(invalid(OP, format!("num_experts = {} must be in 1..={MAX_EXPERTS}", c.num_experts)));
        }
        if c.topk == 0 || c.topk > MAX_TOPK {
            return Err(invalid(OP, format!("topk = {} must be in 1..={MAX_TOPK}", c.topk)));
        }
        for (what, v) in [("hidden", c.hidden), ("ffn", c.ffn)] {
            if v == 0 || v % 8 != 0 {
                return Err(Error::Alignment { op: OP, what, value: v as i64, multiple: 8 });
            }
        }
        let routes = c.max_tokens.checked_mul(c.topk).filter(|&r| r <= i32::MAX as usize).ok_or_else(|| {
            invalid(OP, format!("max_tokens * topk = {} * {} must fit in int32", c.max_tokens, c.topk))
        })?;
        let capacity = c.capacity.unwrap_or(routes);
        if capacity > routes {
            return Err(invalid(OP, format!("capacity = {capacity} must be at most max_tokens * topk = {routes}")));
        }
        if c.expert_capacity == Some(0) {
            return Err(invalid(OP, "expert_capacity = Some(0) would drop every route; use None for no limit".into()));
        }
        let widest = c.hidden.max(2 * c.ffn) / 8;
        if capacity.max(c.max_tokens) as u128 * widest as u128 > i32::MAX as u128 {
            return Err(invalid(
                OP,
                format!(
                    "a [{}, {}] buffer has too many 16-byte vectors for int32 indexing",
                    capacity.max(c.max_tokens),
                    widest * 8
                ),
            ));
        }
        if !matches!(c.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("activation dtype {:?}; need Bf16 or F16", c.dtype),
            });
        }
        if !matches!(c.prob_dtype, DType::F32 | DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("prob dtype {:?}; need F32, Bf16 or F16", c.prob_dtype),
            });
        }
        let desc = sys::capmoe_routing_desc_t {
            num_experts: c.num_experts as i64,
            hidden: c.hidden as i64,
            ffn: c.ffn as i64,
            topk: c.topk as i64,
            max_tokens: c.max_tokens as i64,
            capacity: capacity as i64,
            expert_capacity: c.expert_capacity.map_or(0, |e| e.min(i64::MAX as usize) as i64),
            dtype: c.dtype.abi(),
            prob_dtype: c.prob_dtype.abi(),
        };
        let mut bytes = 0u64;
        check(unsafe { sys::capmoe_routing_workspace_size(&desc, &mut bytes) }, OP)?;
        Ok(RoutingPlan { config, desc, workspace_bytes: bytes as usize })
    }

    pub fn config(&self) -> &RoutingConfig {
        &self.config
    }
    /// What the plan was built for: the configuration, the resolved capacity, the workspace.
    pub fn desc(&self) -> RoutingDesc {
        RoutingDesc { config: self.config.clone(), capacity: self.capacity(), workspace_bytes: self.workspace_bytes }
    }
    /// The C ABI descriptor the plan passes to `capmoe_routing_*` (for callers of the C ABI).
    pub fn abi_desc(&self) -> &sys::capmoe_routing_desc_t {
        &self.desc
    }
    pub fn num_experts(&self) -> usize {
        self.config.num_experts
    }
    pub fn hidden(&self) -> usize {
        self.config.hidden
    }
    pub fn ffn(&self) -> usize {
        self.config.ffn
    }
    pub fn topk(&self) -> usize {
        self.config.topk
    }
    pub fn max_tokens(&self) -> usize {
        self.config.max_tokens
    }
    /// Rows of the permuted buffers.
    pub fn capacity(&self) -> usize {
        self.desc.capacity as usize
    }
    /// Bytes of workspace `build` needs.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }
    /// Elements of x / y / dx / dy: `T_max * H`.
    pub fn tokens_len(&self) -> usize {
        self.config.max_tokens * self.config.hidden
    }
    /// Elements of expert_ids / probs / dprobs / row_of_route: `T_max * k`.
    pub fn routes_len(&self) -> usize {
        self.config.max_tokens * self.config.topk
    }
    /// Elements of rows / drows: `capacity * H`.
    pub fn rows_len(&self) -> usize {
        self.capacity() * self.config.hidden
    }
    /// Elements of the fc1 output h / dh: `capacity * 2F`.
    pub fn fc1_len(&self) -> usize {
        self.capacity() * 2 * self.config.ffn
    }
    /// Elements of act / dact: `capacity * F`.
    pub fn act_len(&self) -> usize {
        self.capacity() * self.config.ffn
    }

    /// Allocates the buffers of [`RoutingPlan::build`] (flags zeroed, row and token maps -1:
    /// unmapped). Allocation happens here, never in a launch.
    pub fn alloc_maps(&self, stream: &Arc<CudaStream>) -> Result<RouteMaps> {
        crate::graph::ensure_not_capturing(stream, "RoutingPlan::alloc_maps")?;
        let e = self.num_experts();
        // -1 = no row / no token: maps that were never built make permute & co. no-ops (zeros
        // would send every route to row 0, a write race).
        let unmapped = |n: usize| stream.clone_htod(&vec![-1i32; n.max(1)]);
        Ok(RouteMaps {
            m_splits_i32: stream.alloc_zeros(e)?,
            m_splits_i64: stream.alloc_zeros(e)?,
            offsets: stream.alloc_zeros(e + 1)?,
            row_of_route: unmapped(self.routes_len())?,
            token_of_row: unmapped(self.capacity())?,
            expert_counts: stream.alloc_zeros(e)?,
            flags: stream.alloc_zeros(1)?,
            workspace: stream.alloc_zeros(self.workspace_bytes.max(1))?,
        })
    }

    // ---- host checks shared by the launchers ----

    fn dtype_is(&self, op: &'static str, what: &'static str, got: DType, want: DType) -> Result<()> {
        if got != want {
            return Err(Error::Unsupported { op, why: format!("{what} is {got:?} but the plan says {want:?}") });
        }
        Ok(())
    }

    fn aligned(op: &'static str, what: &'static str, ptr: u64) -> Result<()> {
        if !ptr.is_multiple_of(16) {
            return Err(invalid(op, format!("{what} at {ptr:#x} is not 16-byte aligned")));
        }
        Ok(())
    }

    fn check_tokens(&self, op: &'static str, stream: &CudaStream, tokens: Tokens<'_>) -> Result<()> {
        match tokens {
            Tokens::Host(t) if t > self.max_tokens() => {
                Err(invalid(op, format!("num_tokens = {t} exceeds max_tokens = {}", self.max_tokens())))
            }
            Tokens::Host(_) => Ok(()),
            Tokens::Device(s) => ensure_buffer(op, "num_tokens_device", stream, s, 1),
        }
    }

    // ---- safe launchers ----

    /// Megatron form -> `[T, k]`: `routing_map [T_max, E]` (nonzero = routed) and
    /// `map_probs [T_max, E]` into `expert_ids [T_max, k]` and `probs [T_max, k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_map<P: Element>(
        &self,
        stream: &CudaStream,
        routing_map: &impl DevicePtr<u8>,
        map_probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        expert_ids: &mut impl DevicePtrMut<i32>,
        probs: &mut impl DevicePtrMut<P>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        const OP: &str = "routing from_map";
        let map_len = self.max_tokens() * self.num_experts();
        self.dtype_is(OP, "probs", P::DTYPE, self.config.prob_dtype)?;
        ensure_buffer(OP, "routing_map", stream, routing_map, map_len)?;
        ensure_buffer(OP, "map_probs", stream, map_probs, map_len)?;
        ensure_buffer(OP, "expert_ids", stream, expert_ids, self.routes_len())?;
        ensure_buffer(OP, "probs", stream, probs, self.routes_len())?;
        ensure_buffer(OP, "flags", stream, flags, 1)?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (m, _g0) = routing_map.device_ptr(stream);
        let (mp, _g1) = map_probs.device_ptr(stream);
        let (ids, _g2) = expert_ids.device_ptr_mut(stream);
        let (p, _g3) = probs.device_ptr_mut(stream);
        let (f, _g4) = flags.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| unsafe { self.from_map_raw(stream, m, mp, t, td, ids, p, f) })
    }

    /// Counts, offsets and maps from `expert_ids [T_max, k]` into `maps` (see [`RouteMaps`]).
    pub fn build(
        &self,
        stream: &CudaStream,
        expert_ids: &impl DevicePtr<i32>,
        tokens: Tokens<'_>,
        maps: &mut RouteMaps,
    ) -> Result<()> {
        const OP: &str = "routing build";
        let e = self.num_experts();
        ensure_buffer(OP, "expert_ids", stream, expert_ids, self.routes_len())?;
        ensure_buffer(OP, "m_splits_i32", stream, &maps.m_splits_i32, e)?;
        ensure_buffer(OP, "m_splits_i64", stream, &maps.m_splits_i64, e)?;
        ensure_buffer(OP, "offsets", stream, &maps.offsets, e + 1)?;
        ensure_buffer(OP, "row_of_route", stream, &maps.row_of_route, self.routes_len())?;
        ensure_buffer(OP, "token_of_row", stream, &maps.token_of_row, self.capacity())?;
        ensure_buffer(OP, "expert_counts", stream, &maps.expert_counts, e)?;
        ensure_buffer(OP, "flags", stream, &maps.flags, 1)?;
        ensure_same_context(OP, "workspace", stream, &maps.workspace)?;
        if maps.workspace.len() < self.workspace_bytes {
            return Err(Error::WorkspaceTooSmall { op: OP, need: self.workspace_bytes, got: maps.workspace.len() });
        }
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (ids, _g0) = expert_ids.device_ptr(stream);
        let (m32, _g1) = maps.m_splits_i32.device_ptr_mut(stream);
        let (m64, _g2) = maps.m_splits_i64.device_ptr_mut(stream);
        let (off, _g3) = maps.offsets.device_ptr_mut(stream);
        let (ror, _g4) = maps.row_of_route.device_ptr_mut(stream);
        let (tor, _g5) = maps.token_of_row.device_ptr_mut(stream);
        let (cnt, _g6) = maps.expert_counts.device_ptr_mut(stream);
        let (fl, _g7) = maps.flags.device_ptr_mut(stream);
        let ws_len = maps.workspace.len();
        let (ws, _g8) = maps.workspace.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| unsafe {
            self.build_raw(stream, ids, t, td, m32, m64, off, ror, tor, cnt, fl, ws, ws_len)
        })
    }

    /// `rows[row_of_route[t, j]] = x[t]`.
    pub fn permute<T: Element>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        row_of_route: &impl DevicePtr<i32>,
        tokens: Tokens<'_>,
        rows: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "routing permute";
        self.dtype_is(OP, "x", T::DTYPE, self.config.dtype)?;
        ensure_buffer(OP, "x", stream, x, self.tokens_len())?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "rows", stream, rows, self.rows_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (xp, _g0) = x.device_ptr(stream);
        let (rr, _g1) = row_of_route.device_ptr(stream);
        let (rp, _g2) = rows.device_ptr_mut(stream);
        Self::aligned(OP, "x", xp)?;
        Self::aligned(OP, "rows", rp)?;
        with_tokens(stream, tokens, |t, td| unsafe { self.permute_raw(stream, xp, rr, t, td, rp) })
    }

    /// `dx[t] = sum_j drows[row_of_route[t, j]]` (the backward of permute).
    pub fn permute_backward<T: Element>(
        &self,
        stream: &CudaStream,
        drows: &impl DevicePtr<T>,
        row_of_route: &impl DevicePtr<i32>,
        tokens: Tokens<'_>,
        dx: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "routing permute_backward";
        self.dtype_is(OP, "drows", T::DTYPE, self.config.dtype)?;
        ensure_buffer(OP, "drows", stream, drows, self.rows_len())?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "dx", stream, dx, self.tokens_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (dr, _g0) = drows.device_ptr(stream);
        let (rr, _g1) = row_of_route.device_ptr(stream);
        let (dxp, _g2) = dx.device_ptr_mut(stream);
        Self::aligned(OP, "drows", dr)?;
        Self::aligned(OP, "dx", dxp)?;
        with_tokens(stream, tokens, |t, td| unsafe { self.permute_backward_raw(stream, dr, rr, t, td, dxp) })
    }

    /// `y[t] = sum_j probs[t, j] * rows[row_of_route[t, j]]`.
    pub fn unpermute<T: Element, P: Element>(
        &self,
        stream: &CudaStream,
        rows: &impl DevicePtr<T>,
        row_of_route: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "routing unpermute";
        self.dtype_is(OP, "rows", T::DTYPE, self.config.dtype)?;
        self.dtype_is(OP, "probs", P::DTYPE, self.config.prob_dtype)?;
        ensure_buffer(OP, "rows", stream, rows, self.rows_len())?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "probs", stream, probs, self.routes_len())?;
        ensure_buffer(OP, "y", stream, y, self.tokens_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (rp, _g0) = rows.device_ptr(stream);
        let (rr, _g1) = row_of_route.device_ptr(stream);
        let (pp, _g2) = probs.device_ptr(stream);
        let (yp, _g3) = y.device_ptr_mut(stream);
        Self::aligned(OP, "rows", rp)?;
        Self::aligned(OP, "y", yp)?;
        with_tokens(stream, tokens, |t, td| unsafe { self.unpermute_raw(stream, rp, rr, pp, t, td, yp) })
    }

    /// `drows[row(t, j)] = probs[t, j] * dy[t]`, `dprobs[t, j] = <dy[t], rows[row(t, j)]>`.
    #[allow(clippy::too_many_arguments)]
    pub fn unpermute_backward<T: Element, P: Element>(
        &self,
        stream: &CudaStream,
        dy: &impl DevicePtr<T>,
        rows: &impl DevicePtr<T>,
        row_of_route: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        drows: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<P>,
    ) -> Result<()> {
        const OP: &str = "routing unpermute_backward";
        self.dtype_is(OP, "dy", T::DTYPE, self.config.dtype)?;
        self.dtype_is(OP, "probs", P::DTYPE, self.config.prob_dtype)?;
        ensure_buffer(OP, "dy", stream, dy, self.tokens_len())?;
        ensure_buffer(OP, "rows", stream, rows, self.rows_len())?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "probs", stream, probs, self.routes_len())?;
        ensure_buffer(OP, "drows", stream, drows, self.rows_len())?;
        ensure_buffer(OP, "dprobs", stream, dprobs, self.routes_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (dyp, _g0) = dy.device_ptr(stream);
        let (rp, _g1) = rows.device_ptr(stream);
        let (rr, _g2) = row_of_route.device_ptr(stream);
        let (pp, _g3) = probs.device_ptr(stream);
        let (drp, _g4) = drows.device_ptr_mut(stream);
        let (dpp, _g5) = dprobs.device_ptr_mut(stream);
        Self::aligned(OP, "dy", dyp)?;
        Self::aligned(OP, "rows", rp)?;
        Self::aligned(OP, "drows", drp)?;
        with_tokens(stream, tokens, |t, td| unsafe {
            self.unpermute_backward_raw(stream, dyp, rp, rr, pp, t, td, drp, dpp)
        })
    }

    /// `prob_of_row[row_of_route[t, j]] = probs[t, j]` as f32 for every kept route: the
    /// probability each routing row carries, for fc1's weighted epilogue
    /// ([`crate::fused::FusedFc1::run_weighted`]). `prob_of_row` holds `capacity` floats; rows
    /// past the build's total are not written.
    pub fn row_probs<P: Element>(
        &self,
        stream: &CudaStream,
        row_of_route: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        prob_of_row: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "routing row_probs";
        self.dtype_is(OP, "probs", P::DTYPE, self.config.prob_dtype)?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "probs", stream, probs, self.routes_len())?;
        ensure_buffer(OP, "prob_of_row", stream, prob_of_row, self.capacity())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (rr, _g0) = row_of_route.device_ptr(stream);
        let (pp, _g1) = probs.device_ptr(stream);
        let (pr, _g2) = prob_of_row.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| unsafe { self.row_probs_raw(stream, rr, pp, t, td, pr) })
    }

    /// `dprobs[t, j] = Σ_s partials[row_of_route[t, j], s]` (0 for a dropped route): the per-row
    /// partial dot products of the gathered fc2 dgrad
    /// ([`crate::fused::FusedSwigluDgrad::run_gathered`]) summed per route, in a fixed order.
    /// `partials` is `[capacity, slices]`.
    pub fn route_dprobs<P: Element>(
        &self,
        stream: &CudaStream,
        row_of_route: &impl DevicePtr<i32>,
        partials: &impl DevicePtr<f32>,
        slices: usize,
        tokens: Tokens<'_>,
        dprobs: &mut impl DevicePtrMut<P>,
    ) -> Result<()> {
        const OP: &str = "routing route_dprobs";
        self.dtype_is(OP, "dprobs", P::DTYPE, self.config.prob_dtype)?;
        if slices == 0 {
            return Err(invalid(OP, "slices must be at least 1".into()));
        }
        let partials_len =
            self.capacity().checked_mul(slices).ok_or_else(|| invalid(OP, "capacity * slices overflows".into()))?;
        ensure_buffer(OP, "row_of_route", stream, row_of_route, self.routes_len())?;
        ensure_buffer(OP, "partials", stream, partials, partials_len)?;
        ensure_buffer(OP, "dprobs", stream, dprobs, self.routes_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (rr, _g0) = row_of_route.device_ptr(stream);
        let (pp, _g1) = partials.device_ptr(stream);
        let (dp, _g2) = dprobs.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| unsafe { self.route_dprobs_raw(stream, rr, pp, slices, t, td, dp) })
    }

    /// `act = silu(h[:, :F]) * h[:, F:]` on rows `r < offsets[E]`.
    pub fn swiglu<T: Element>(
        &self,
        stream: &CudaStream,
        h: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        act: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "routing swiglu";
        self.dtype_is(OP, "h", T::DTYPE, self.config.dtype)?;
        ensure_buffer(OP, "h", stream, h, self.fc1_len())?;
        ensure_buffer(OP, "offsets", stream, offsets, self.num_experts() + 1)?;
        ensure_buffer(OP, "act", stream, act, self.act_len())?;
        stream.context().bind_to_thread()?;
        let (hp, _g0) = h.device_ptr(stream);
        let (op, _g1) = offsets.device_ptr(stream);
        let (ap, _g2) = act.device_ptr_mut(stream);
        Self::aligned(OP, "h", hp)?;
        Self::aligned(OP, "act", ap)?;
        unsafe { self.swiglu_raw(stream, hp, op, ap) }
    }

    /// SwiGLU backward: `dh = [dgate | dup]` from `dact` and the fc1 output `h`.
    pub fn swiglu_backward<T: Element>(
        &self,
        stream: &CudaStream,
        dact: &impl DevicePtr<T>,
        h: &impl DevicePtr<T>,
        offsets: &impl DevicePtr<i64>,
        dh: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "routing swiglu_backward";
        self.dtype_is(OP, "h", T::DTYPE, self.config.dtype)?;
        ensure_buffer(OP, "dact", stream, dact, self.act_len())?;
        ensure_buffer(OP, "h", stream, h, self.fc1_len())?;
        ensure_buffer(OP, "offsets", stream, offsets, self.num_experts() + 1)?;
        ensure_buffer(OP, "dh", stream, dh, self.fc1_len())?;
        stream.context().bind_to_thread()?;
        let (dp, _g0) = dact.device_ptr(stream);
        let (hp, _g1) = h.device_ptr(stream);
        let (op, _g2) = offsets.device_ptr(stream);
        let (dhp, _g3) = dh.device_ptr_mut(stream);
        Self::aligned(OP, "dact", dp)?;
        Self::aligned(OP, "h", hp)?;
        Self::aligned(OP, "dh", dhp)?;
        unsafe { self.swiglu_backward_raw(stream, dp, hp, op, dhp) }
    }

    // ---- raw entry points ----
    //
    // Crate convention (docs/CONVENTIONS.md): `&CudaStream` first, then `CUdeviceptr`s in the
    // order of the safe form (0 = an absent optional buffer), sizes as `usize`. The token
    // count is (num_tokens, num_tokens_device): with a non-zero device pointer the device
    // `i32` is used, else num_tokens (<= max_tokens, checked here).

    /// Raw [`RoutingPlan::from_map`].
    ///
    /// # Safety
    /// Every pointer is device memory of `stream`'s context, live until the launch completes:
    /// `routing_map` and `map_probs` hold `T_max * E` elements (u8, probs of the plan's prob
    /// dtype), `expert_ids` (i32) and `probs` `T_max * k`; `num_tokens_device` and `flags` are
    /// 0 or one int32. The outputs do not overlap the inputs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn from_map_raw(
        &self,
        stream: &CudaStream,
        routing_map: CUdeviceptr,
        map_probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        expert_ids: CUdeviceptr,
        probs: CUdeviceptr,
        flags: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing from_map";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_from_map(
                &self.desc,
                routing_map as *const u8,
                map_probs as *const c_void,
                t,
                num_tokens_device as *const i32,
                expert_ids as *mut i32,
                probs as *mut c_void,
                flags as *mut i32,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::build`].
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes, not overlapping:
    /// `expert_ids` `T_max * k` int32; `offsets` `E + 1` int64; `row_of_route` `T_max * k`
    /// int32; `m_splits_i32` / `m_splits_i64` / `expert_counts` 0 or `E` (i32 / i64 / i32);
    /// `token_of_row` 0 or `capacity` int32; `flags` / `num_tokens_device` 0 or one int32;
    /// `workspace` at least `workspace_bytes` bytes (checked against the given
    /// `workspace_bytes`), not used by any concurrently running launch.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn build_raw(
        &self,
        stream: &CudaStream,
        expert_ids: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        m_splits_i32: CUdeviceptr,
        m_splits_i64: CUdeviceptr,
        offsets: CUdeviceptr,
        row_of_route: CUdeviceptr,
        token_of_row: CUdeviceptr,
        expert_counts: CUdeviceptr,
        flags: CUdeviceptr,
        workspace: CUdeviceptr,
        workspace_bytes: usize,
    ) -> Result<()> {
        const OP: &str = "routing build";
        if workspace_bytes < self.workspace_bytes {
            return Err(Error::WorkspaceTooSmall { op: OP, need: self.workspace_bytes, got: workspace_bytes });
        }
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_build(
                &self.desc,
                expert_ids as *const i32,
                t,
                num_tokens_device as *const i32,
                m_splits_i32 as *mut i32,
                m_splits_i64 as *mut i64,
                offsets as *mut i64,
                row_of_route as *mut i32,
                token_of_row as *mut i32,
                expert_counts as *mut i32,
                flags as *mut i32,
                workspace as *mut c_void,
                workspace_bytes as u64,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::permute`].
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes, 16-byte aligned
    /// where it holds activations: `x` `T_max * H` and `rows` `capacity * H` elements of the
    /// plan's dtype, `row_of_route` `T_max * k` int32 (values outside `[0, capacity)` are
    /// skipped, so any content is safe); `num_tokens_device` 0 or one int32; `rows` does not
    /// overlap `x`.
    pub unsafe fn permute_raw(
        &self,
        stream: &CudaStream,
        x: CUdeviceptr,
        row_of_route: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        rows: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing permute";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_permute(
                &self.desc,
                x as *const c_void,
                row_of_route as *const i32,
                t,
                num_tokens_device as *const i32,
                rows as *mut c_void,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::permute_backward`].
    ///
    /// # Safety
    /// As [`RoutingPlan::permute_raw`] with `drows` (`capacity * H`) read and `dx` (`T_max * H`)
    /// written.
    pub unsafe fn permute_backward_raw(
        &self,
        stream: &CudaStream,
        drows: CUdeviceptr,
        row_of_route: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        dx: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing permute_backward";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_permute_backward(
                &self.desc,
                drows as *const c_void,
                row_of_route as *const i32,
                t,
                num_tokens_device as *const i32,
                dx as *mut c_void,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::unpermute`].
    ///
    /// # Safety
    /// As [`RoutingPlan::permute_raw`] with `rows` read, `y` (`T_max * H`) written and `probs`
    /// `T_max * k` elements of the plan's prob dtype.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn unpermute_raw(
        &self,
        stream: &CudaStream,
        rows: CUdeviceptr,
        row_of_route: CUdeviceptr,
        probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        y: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing unpermute";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_unpermute(
                &self.desc,
                rows as *const c_void,
                row_of_route as *const i32,
                probs as *const c_void,
                t,
                num_tokens_device as *const i32,
                y as *mut c_void,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::unpermute_backward`].
    ///
    /// # Safety
    /// As [`RoutingPlan::unpermute_raw`], plus `dy` (`T_max * H`) read, `drows` (`capacity * H`)
    /// and `dprobs` (`T_max * k`, prob dtype) written; `drows` overlaps neither `rows` nor `dy`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn unpermute_backward_raw(
        &self,
        stream: &CudaStream,
        dy: CUdeviceptr,
        rows: CUdeviceptr,
        row_of_route: CUdeviceptr,
        probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        drows: CUdeviceptr,
        dprobs: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing unpermute_backward";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_unpermute_backward(
                &self.desc,
                dy as *const c_void,
                rows as *const c_void,
                row_of_route as *const i32,
                probs as *const c_void,
                t,
                num_tokens_device as *const i32,
                drows as *mut c_void,
                dprobs as *mut c_void,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::row_probs`].
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes: `row_of_route`
    /// `T_max * k` int32 (values outside `[0, capacity)` are skipped), `probs` `T_max * k`
    /// elements of the plan's prob dtype, `prob_of_row` `capacity` f32 written;
    /// `num_tokens_device` 0 or one int32.
    pub unsafe fn row_probs_raw(
        &self,
        stream: &CudaStream,
        row_of_route: CUdeviceptr,
        probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        prob_of_row: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing row_probs";
        let t = self.raw_tokens(OP, num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_row_probs(
                &self.desc,
                row_of_route as *const i32,
                probs as *const c_void,
                t,
                num_tokens_device as *const i32,
                prob_of_row as *mut f32,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::route_dprobs`].
    ///
    /// # Safety
    /// As [`RoutingPlan::row_probs_raw`], with `partials` (`capacity * slices` f32) read and
    /// `dprobs` (`T_max * k`, prob dtype) written.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn route_dprobs_raw(
        &self,
        stream: &CudaStream,
        row_of_route: CUdeviceptr,
        partials: CUdeviceptr,
        slices: usize,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        dprobs: CUdeviceptr,
    ) -> Result<()> {
        const OP: &str = "routing route_dprobs";
        let t = self.raw_tokens(OP, num_tokens)?;
        let slices = i64::try_from(slices).map_err(|_| invalid(OP, format!("slices = {slices} too large")))?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_route_dprobs(
                &self.desc,
                row_of_route as *const i32,
                partials as *const f32,
                slices,
                t,
                num_tokens_device as *const i32,
                dprobs as *mut c_void,
                raw_stream(stream),
            ),
            OP,
        )
    }

    /// Raw [`RoutingPlan::swiglu`].
    ///
    /// # Safety
    /// Device memory of `stream`'s context, live until the launch completes, 16-byte aligned:
    /// `h` `capacity * 2F`, `act` `capacity * F` elements of the plan's dtype, `offsets` `E + 1`
    /// int64 (only `offsets[E]` is read, clamped into `[0, capacity]`).
    pub unsafe fn swiglu_raw(
        &self,
        stream: &CudaStream,
        h: CUdeviceptr,
        offsets: CUdeviceptr,
        act: CUdeviceptr,
    ) -> Result<()> {
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_swiglu(
                &self.desc,
                h as *const c_void,
                offsets as *const i64,
                act as *mut c_void,
                raw_stream(stream),
            ),
            "routing swiglu",
        )
    }

    /// Raw [`RoutingPlan::swiglu_backward`].
    ///
    /// # Safety
    /// As [`RoutingPlan::swiglu_raw`], with `dact` (`capacity * F`) read and `dh`
    /// (`capacity * 2F`) written; `dh` may not overlap `h` or `dact`.
    pub unsafe fn swiglu_backward_raw(
        &self,
        stream: &CudaStream,
        dact: CUdeviceptr,
        h: CUdeviceptr,
        offsets: CUdeviceptr,
        dh: CUdeviceptr,
    ) -> Result<()> {
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_routing_swiglu_backward(
                &self.desc,
                dact as *const c_void,
                h as *const c_void,
                offsets as *const i64,
                dh as *mut c_void,
                raw_stream(stream),
            ),
            "routing swiglu_backward",
        )
    }

    /// A raw entry point's host token count, checked against `max_tokens` (the C ABI checks
    /// it again; here it becomes a typed error).
    fn raw_tokens(&self, op: &'static str, num_tokens: usize) -> Result<i64> {
        if num_tokens > self.max_tokens() {
            return Err(invalid(op, format!("num_tokens = {num_tokens} exceeds max_tokens = {}", self.max_tokens())));
        }
        Ok(num_tokens as i64)
    }
}

fn raw_stream(stream: &CudaStream) -> *mut c_void {
    stream.cu_stream() as *mut c_void
}

/// Runs `f(num_tokens, num_tokens_device)` with the device pointer's guard alive across it.
fn with_tokens(
    stream: &CudaStream,
    tokens: Tokens<'_>,
    f: impl FnOnce(usize, CUdeviceptr) -> Result<()>,
) -> Result<()> {
    match tokens {
        Tokens::Host(t) => f(t, 0),
        Tokens::Device(s) => {
            let (p, _guard) = s.device_ptr(stream);
            f(0, p)
        }
    }
}
