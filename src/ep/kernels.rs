//! The EP plan ([`EpKernels`]) and its safe launchers over `capmoe_ep_*`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::ensure_buffer;
use crate::dtype::DType;
use crate::error::check;
use crate::moe::MoeElement;
use crate::routing::{Element, Tokens};
use crate::{sys, Error, Result};

/// Flag bits ORed into the EP device flags word (sticky; the caller clears it). A word of its
/// own: the values overlap those of [`crate::routing::flags`].
pub mod flags {
    use crate::sys;
    /// A peer block was full: routes were dropped (counted in `dropped`).
    pub const OVERFLOW: i32 = sys::CAPMOE_EP_OVERFLOW as i32;
    /// A dest outside `[-1, R * cols_per_rank)`: the route was dropped.
    pub const BAD_DEST: i32 = sys::CAPMOE_EP_BAD_DEST as i32;
    /// The device token count was outside `[0, T_max]` and was clamped.
    pub const BAD_TOKENS: i32 = sys::CAPMOE_EP_BAD_TOKENS as i32;
    /// `count_routes`: an expert id outside `[-1, E)` was not counted.
    pub const BAD_EXPERT: i32 = sys::CAPMOE_EP_BAD_EXPERT as i32;
    /// Weight kernels: a `slot_expert` entry outside `[-1, E)`; the slot was skipped.
    pub const BAD_SLOT_EXPERT: i32 = sys::CAPMOE_EP_BAD_SLOT_EXPERT as i32;
}

/// Largest EP group a plan accepts.
pub const MAX_RANKS: usize = sys::CAPMOE_EP_MAX_RANKS as usize;
/// Largest `k` a plan accepts.
pub const MAX_TOPK: usize = sys::CAPMOE_EP_MAX_TOPK as usize;

/// `ceil(factor · T_max · k / R)` rows, at least 1: the peer block a perfectly balanced routing
/// needs, times a capacity factor (1.0, 1.25, 1.5 in the benchmark).
pub fn balanced_capacity(max_tokens: usize, topk: usize, ranks: usize, factor: f64) -> usize {
    ((max_tokens * topk) as f64 * factor / ranks as f64).ceil().max(1.0) as usize
}

/// The facts an EP plan is made from (one rank's view of the group).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpConfig {
    /// R, ranks of the EP group.
    pub ranks: usize,
    /// This rank, `< ranks`.
    pub rank: usize,
    /// E home experts, a multiple of R (L = E / R per rank).
    pub num_experts: usize,
    /// Echo's spare slots per rank; 0 = no Echo.
    pub spare_per_rank: usize,
    /// H, a multiple of 8.
    pub hidden: usize,
    /// k, routes per token.
    pub topk: usize,
    /// T_max, tokens per rank and step.
    pub max_tokens: usize,
    /// Rows of one (source, destination) peer block.
    pub capacity: usize,
    /// Activations: `Bf16` or `F16`.
    pub dtype: DType,
}

fn invalid(op: &'static str, why: String) -> Error {
    Error::InvalidArgument { op, why }
}

/// `count * per_expert` elements, or [`Error::InvalidArgument`] where that overflows (a wrapped
/// product would let a short buffer pass the size check).
fn elements(op: &'static str, count: usize, per_expert: usize) -> Result<usize> {
    count.checked_mul(per_expert).ok_or_else(|| invalid(op, format!("{count} x {per_expert} elements overflow usize")))
}

impl EpConfig {
    /// The C ABI descriptor of this configuration, fields as given (not validated: the C
    /// check, `capmoe_ep_check_desc`, judges it on its own).
    pub fn abi_desc(&self) -> sys::capmoe_ep_desc_t {
        sys::capmoe_ep_desc_t {
            ranks: self.ranks as i64,
            rank: self.rank as i64,
            num_experts: self.num_experts as i64,
            spare_per_rank: self.spare_per_rank as i64,
            hidden: self.hidden as i64,
            topk: self.topk as i64,
            max_tokens: self.max_tokens as i64,
            capacity: self.capacity as i64,
            dtype: self.dtype.abi(),
        }
    }

    /// Checks every field on the host (the limits of `capmoe_ep_check_desc`). No CUDA work.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "EpConfig::validate";
        let c = self;
        if c.ranks == 0 || c.ranks > MAX_RANKS {
            return Err(invalid(OP, format!("ranks = {} must be in 1..={MAX_RANKS}", c.ranks)));
        }
        if c.rank >= c.ranks {
            return Err(invalid(OP, format!("rank = {} must be below ranks = {}", c.rank, c.ranks)));
        }
        if c.num_experts == 0 || !c.num_experts.is_multiple_of(c.ranks) {
            return Err(invalid(
                OP,
                format!("num_experts = {} must be a positive multiple of ranks = {}", c.num_experts, c.ranks),
            ));
        }
        let columns = c.spare_per_rank.checked_mul(c.ranks).and_then(|s| s.checked_add(c.num_experts));
        if columns.is_none_or(|n| n > i32::MAX as usize) {
            return Err(invalid(
                OP,
                format!(
                    "num_experts + ranks * spare_per_rank = {} + {} * {} columns must fit in int32",
                    c.num_experts, c.ranks, c.spare_per_rank
                ),
            ));
        }
        if c.hidden == 0 || c.hidden / 8 > i32::MAX as usize {
            return Err(invalid(OP, format!("hidden = {} must be in 8..=8 * (2^31 - 1)", c.hidden)));
        }
        if !c.hidden.is_multiple_of(8) {
            return Err(Error::Alignment { op: OP, what: "hidden", value: c.hidden as i64, multiple: 8 });
        }
        if c.topk == 0 || c.topk > MAX_TOPK {
            return Err(invalid(OP, format!("topk = {} must be in 1..={MAX_TOPK}", c.topk)));
        }
        if c.max_tokens.checked_mul(c.topk).is_none_or(|r| r > i32::MAX as usize) {
            return Err(invalid(OP, format!("max_tokens * topk = {} * {} must fit in int32", c.max_tokens, c.topk)));
        }
        if c.capacity.checked_mul(c.ranks).is_none_or(|r| r > i32::MAX as usize) {
            return Err(invalid(
                OP,
                format!("ranks * capacity = {} * {} block rows must fit in int32", c.ranks, c.capacity),
            ));
        }
        // The activation buffers' sizes (tokens_len, rows_len) in bytes must fit in int64, the
        // kernels' row-element offsets: a wrapped size would let a short buffer pass the checks.
        let rows = c.max_tokens.max(c.ranks * c.capacity) as u128;
        if rows * c.hidden as u128 * 2 > i64::MAX as u128 {
            return Err(invalid(
                OP,
                format!(
                    "max(max_tokens, ranks * capacity) * hidden = {rows} * {} bf16/f16 elements: the bytes must fit \
                     in int64",
                    c.hidden
                ),
            ));
        }
        if !matches!(c.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported {
                op: OP,
                why: format!("activation dtype {:?}; need Bf16 or F16", c.dtype),
            });
        }
        Ok(())
    }

    /// L = E / R home experts per rank.
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.ranks
    }
    /// Local columns per rank: L + S_per (with Echo), L (without).
    pub fn cols_per_rank(&self) -> usize {
        self.local_experts() + self.spare_per_rank
    }
    /// Rows of all peer blocks together: `ranks * capacity`.
    pub fn block_rows(&self) -> usize {
        self.ranks * self.capacity
    }
    /// Elements of a `[T_max, k]` route array.
    pub fn routes_len(&self) -> usize {
        self.max_tokens * self.topk
    }
    /// Elements of x / y / dx / dy: `T_max * H`.
    pub fn tokens_len(&self) -> usize {
        self.max_tokens * self.hidden
    }
    /// Elements of a `[R, capacity, H]` rows buffer.
    pub fn rows_len(&self) -> usize {
        self.block_rows() * self.hidden
    }
    /// Global Echo slots: `R * S_per` (the length of `slot_expert`).
    pub fn global_slots(&self) -> usize {
        self.ranks * self.spare_per_rank
    }
}

/// Device buffers of one [`EpKernels::dispatch_layout`], sized by [`EpKernels::alloc_layout`].
pub struct DispatchLayout {
    /// `[T_max * k]` `p * capacity + position` of each kept route, else -1.
    pub slot_of_route: CudaSlice<i32>,
    /// `[R, capacity]` local column of each row sent to peer p; -1 for unused rows.
    pub send_ids: CudaSlice<i32>,
    /// `[R, capacity]` that row's prob; 0 for unused rows.
    pub send_probs: CudaSlice<f32>,
    /// `[R]` rows used in peer p's block.
    pub send_counts: CudaSlice<i32>,
    /// `[R]` routes to peer p that did not fit its block.
    pub dropped: CudaSlice<i32>,
    /// `[chunks, R]` workspace: each chunk's routes per peer (`capmoe_ep_layout_chunks`).
    pub chunk_counts: CudaSlice<i32>,
}

/// The EP plan: a validated [`EpConfig`] and its C descriptor. Launchers allocate nothing,
/// never synchronise and never read device data on the host (capturable).
#[derive(Clone, Debug)]
pub struct EpKernels {
    config: EpConfig,
    desc: sys::capmoe_ep_desc_t,
}

impl EpKernels {
    /// Checks the configuration on the host ([`EpConfig::validate`], then the C ABI's own
    /// check). No CUDA work.
    pub fn new(config: EpConfig) -> Result<EpKernels> {
        config.validate()?;
        let desc = config.abi_desc();
        check(unsafe { sys::capmoe_ep_check_desc(&desc) }, "EpKernels::new")?;
        Ok(EpKernels { config, desc })
    }

    /// What the plan was built for.
    pub fn desc(&self) -> &EpConfig {
        &self.config
    }
    /// The C ABI descriptor passed to `capmoe_ep_*` (for callers of the C ABI).
    pub fn abi_desc(&self) -> &sys::capmoe_ep_desc_t {
        &self.desc
    }
    /// Chunks of the dispatch layout's scan (rows of its `chunk_counts` workspace).
    pub fn layout_chunks(&self) -> usize {
        unsafe { sys::capmoe_ep_layout_chunks(&self.desc) as usize }
    }

    /// Allocates the buffers of [`EpKernels::dispatch_layout`] (slot_of_route and send_ids -1,
    /// the rest zero). Allocation happens here, never in a launch.
    pub fn alloc_layout(&self, stream: &Arc<CudaStream>) -> Result<DispatchLayout> {
        crate::graph::ensure_not_capturing(stream, "EpKernels::alloc_layout")?;
        let c = &self.config;
        let none = |n: usize| stream.clone_htod(&vec![-1i32; n.max(1)]);
        Ok(DispatchLayout {
            slot_of_route: none(c.routes_len())?,
            send_ids: none(c.block_rows())?,
            send_probs: stream.alloc_zeros(c.block_rows().max(1))?,
            send_counts: stream.alloc_zeros(c.ranks)?,
            dropped: stream.alloc_zeros(c.ranks)?,
            chunk_counts: stream.alloc_zeros(self.layout_chunks() * c.ranks)?,
        })
    }

    // ---- host checks shared by the launchers ----

    fn check_tokens(&self, op: &'static str, stream: &CudaStream, tokens: Tokens<'_>) -> Result<()> {
        match tokens {
            Tokens::Host(t) if t > self.config.max_tokens => {
                Err(invalid(op, format!("num_tokens = {t} exceeds max_tokens = {}", self.config.max_tokens)))
            }
            Tokens::Host(_) => Ok(()),
            Tokens::Device(s) => ensure_buffer(op, "num_tokens_device", stream, s, 1),
        }
    }

    fn check_dtype<T: Element>(&self, op: &'static str, what: &'static str) -> Result<()> {
        if T::DTYPE != self.config.dtype {
            return Err(Error::Unsupported {
                op,
                why: format!("{what} is {:?} but the plan says {:?}", T::DTYPE, self.config.dtype),
            });
        }
        Ok(())
    }

    fn aligned16(op: &'static str, what: &'static str, ptr: CUdeviceptr) -> Result<()> {
        if !ptr.is_multiple_of(16) {
            return Err(invalid(op, format!("{what} at {ptr:#x} is not 16-byte aligned")));
        }
        Ok(())
    }

    /// The Echo weight launchers' checks: Echo on, `per_expert` elements of `elem_bytes` a
    /// multiple of 16 bytes.
    fn check_spare(&self, op: &'static str, per_expert: usize, elem_bytes: usize) -> Result<i64> {
        if self.config.spare_per_rank == 0 {
            return Err(invalid(op, "the plan has no Echo spare slots (spare_per_rank = 0)".into()));
        }
        let bytes = per_expert
            .checked_mul(elem_bytes)
            .filter(|&b| b <= i64::MAX as usize)
            .ok_or_else(|| invalid(op, format!("per_expert = {per_expert} elements overflow int64 bytes")))?;
        if !bytes.is_multiple_of(16) {
            return Err(Error::Alignment { op, what: "bytes per expert", value: bytes as i64, multiple: 16 });
        }
        Ok(bytes as i64)
    }

    // ---- launchers ----

    /// `counts [E]` = this rank's routes per home expert (the whole array is written);
    /// `expert_ids [T_max, k]`, -1 = no route; other ids outside `[0, E)` are not counted and
    /// set [`flags::BAD_EXPERT`].
    pub fn count_routes(
        &self,
        stream: &CudaStream,
        expert_ids: &impl DevicePtr<i32>,
        tokens: Tokens,
        counts: &mut impl DevicePtrMut<i64>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        const OP: &str = "ep count_routes";
        let c = &self.config;
        ensure_buffer(OP, "expert_ids", stream, expert_ids, c.routes_len())?;
        ensure_buffer(OP, "counts", stream, counts, c.num_experts)?;
        ensure_buffer(OP, "flags", stream, flags, 1)?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (ids, _g0) = expert_ids.device_ptr(stream);
        let (cnt, _g1) = counts.device_ptr_mut(stream);
        let (fl, _g2) = flags.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| {
            check(
                unsafe {
                    sys::capmoe_ep_count_routes(
                        &self.desc,
                        ids as *const i32,
                        t,
                        td as *const i32,
                        cnt as *mut i64,
                        fl as *mut i32,
                        raw_stream(stream),
                    )
                },
                OP,
            )
        })
    }

    /// The dispatch layout from the final columns `dest [T_max, k]` and `probs [T_max, k]`:
    /// every buffer of `layout` is written in full (see [`DispatchLayout`]).
    pub fn dispatch_layout(
        &self,
        stream: &CudaStream,
        dest: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<f32>,
        tokens: Tokens,
        layout: &mut DispatchLayout,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        const OP: &str = "ep dispatch_layout";
        let c = &self.config;
        ensure_buffer(OP, "dest", stream, dest, c.routes_len())?;
        ensure_buffer(OP, "probs", stream, probs, c.routes_len())?;
        ensure_buffer(OP, "slot_of_route", stream, &layout.slot_of_route, c.routes_len())?;
        ensure_buffer(OP, "send_ids", stream, &layout.send_ids, c.block_rows())?;
        ensure_buffer(OP, "send_probs", stream, &layout.send_probs, c.block_rows())?;
        ensure_buffer(OP, "send_counts", stream, &layout.send_counts, c.ranks)?;
        ensure_buffer(OP, "dropped", stream, &layout.dropped, c.ranks)?;
        ensure_buffer(OP, "chunk_counts", stream, &layout.chunk_counts, self.layout_chunks() * c.ranks)?;
        ensure_buffer(OP, "flags", stream, flags, 1)?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (d, _g0) = dest.device_ptr(stream);
        let (p, _g1) = probs.device_ptr(stream);
        let (sor, _g2) = layout.slot_of_route.device_ptr_mut(stream);
        let (ids, _g3) = layout.send_ids.device_ptr_mut(stream);
        let (sp, _g4) = layout.send_probs.device_ptr_mut(stream);
        let (sc, _g5) = layout.send_counts.device_ptr_mut(stream);
        let (dr, _g6) = layout.dropped.device_ptr_mut(stream);
        let (cc, _g8) = layout.chunk_counts.device_ptr_mut(stream);
        let (fl, _g7) = flags.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| {
            check(
                unsafe {
                    sys::capmoe_ep_dispatch_layout(
                        &self.desc,
                        d as *const i32,
                        p as *const f32,
                        t,
                        td as *const i32,
                        sor as *mut i32,
                        ids as *mut i32,
                        sp as *mut f32,
                        sc as *mut i32,
                        dr as *mut i32,
                        cc as *mut i32,
                        fl as *mut i32,
                        raw_stream(stream),
                    )
                },
                OP,
            )
        })
    }

    /// `rows [R, capacity, H][slot_of_route[t, j]] = x [T_max, H][t]` for every kept route of
    /// every `t < T`; other rows are not written. Forward: x; backward: dy.
    pub fn gather_rows<T: MoeElement>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        slot_of_route: &impl DevicePtr<i32>,
        tokens: Tokens,
        rows: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "ep gather_rows";
        let c = &self.config;
        self.check_dtype::<T>(OP, "x")?;
        ensure_buffer(OP, "x", stream, x, c.tokens_len())?;
        ensure_buffer(OP, "slot_of_route", stream, slot_of_route, c.routes_len())?;
        ensure_buffer(OP, "rows", stream, rows, c.rows_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (xp, _g0) = x.device_ptr(stream);
        let (sor, _g1) = slot_of_route.device_ptr(stream);
        let (rp, _g2) = rows.device_ptr_mut(stream);
        Self::aligned16(OP, "x", xp)?;
        Self::aligned16(OP, "rows", rp)?;
        with_tokens(stream, tokens, |t, td| {
            check(
                unsafe {
                    sys::capmoe_ep_gather_rows(
                        &self.desc,
                        xp as *const c_void,
                        sor as *const i32,
                        t,
                        td as *const i32,
                        rp as *mut c_void,
                        raw_stream(stream),
                    )
                },
                OP,
            )
        })
    }

    /// `y [T_max, H][t] = sum over kept routes j of rows[slot_of_route[t, j]]` (fp32 in
    /// ascending j, rounded once; 0 for a token with no kept route), `t < T`.
    pub fn reduce_rows<T: MoeElement>(
        &self,
        stream: &CudaStream,
        rows: &impl DevicePtr<T>,
        slot_of_route: &impl DevicePtr<i32>,
        tokens: Tokens,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "ep reduce_rows";
        let c = &self.config;
        self.check_dtype::<T>(OP, "rows")?;
        ensure_buffer(OP, "rows", stream, rows, c.rows_len())?;
        ensure_buffer(OP, "slot_of_route", stream, slot_of_route, c.routes_len())?;
        ensure_buffer(OP, "y", stream, y, c.tokens_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (rp, _g0) = rows.device_ptr(stream);
        let (sor, _g1) = slot_of_route.device_ptr(stream);
        let (yp, _g2) = y.device_ptr_mut(stream);
        Self::aligned16(OP, "rows", rp)?;
        Self::aligned16(OP, "y", yp)?;
        with_tokens(stream, tokens, |t, td| {
            check(
                unsafe {
                    sys::capmoe_ep_reduce_rows(
                        &self.desc,
                        rp as *const c_void,
                        sor as *const i32,
                        t,
                        td as *const i32,
                        yp as *mut c_void,
                        raw_stream(stream),
                    )
                },
                OP,
            )
        })
    }

    /// `out [T_max, k][t, j] = values [R, capacity][slot_of_route[t, j]]` for kept routes, 0
    /// otherwise, `t < T` (backward: the dprobs coming back).
    pub fn gather_route_values(
        &self,
        stream: &CudaStream,
        values: &impl DevicePtr<f32>,
        slot_of_route: &impl DevicePtr<i32>,
        tokens: Tokens,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "ep gather_route_values";
        let c = &self.config;
        ensure_buffer(OP, "values", stream, values, c.block_rows())?;
        ensure_buffer(OP, "slot_of_route", stream, slot_of_route, c.routes_len())?;
        ensure_buffer(OP, "out", stream, out, c.routes_len())?;
        self.check_tokens(OP, stream, tokens)?;
        stream.context().bind_to_thread()?;
        let (vp, _g0) = values.device_ptr(stream);
        let (sor, _g1) = slot_of_route.device_ptr(stream);
        let (op, _g2) = out.device_ptr_mut(stream);
        with_tokens(stream, tokens, |t, td| {
            check(
                unsafe {
                    sys::capmoe_ep_gather_route_values(
                        &self.desc,
                        vp as *const f32,
                        sor as *const i32,
                        t,
                        td as *const i32,
                        op as *mut f32,
                        raw_stream(stream),
                    )
                },
                OP,
            )
        })
    }

    /// Echo, home side: `send [R, S_per, per_expert][q, s] = home [L, per_expert][e - rank * L]`
    /// for every global slot `q * S_per + s` whose expert `e = slot_expert[q * S_per + s]` is a
    /// home expert of this rank; other entries are not written. `per_expert` elements of T
    /// must be a multiple of 16 bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn pack_spare_weights<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        slot_expert: &impl DevicePtr<i64>,
        home: &impl DevicePtr<T>,
        per_expert: usize,
        send: &mut impl DevicePtrMut<T>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let c = &self.config;
        let copy = WeightCopy {
            op: "ep pack_spare_weights",
            src: ("home [L, per_expert]", c.local_experts()),
            dst: ("send [R, S_per, per_expert]", c.global_slots()),
            entry: sys::capmoe_ep_pack_spare_weights,
        };
        self.copy_spare_weights(copy, stream, slot_expert, home, per_expert, send, flags)
    }

    /// Echo, slot side: `spare [S_per, per_expert][s] = recv [R, S_per, per_expert][e / L, s]`
    /// for this rank's slots s with `e = slot_expert[rank * S_per + s] >= 0`; empty slots are
    /// not written.
    #[allow(clippy::too_many_arguments)]
    pub fn select_spare_weights<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        slot_expert: &impl DevicePtr<i64>,
        recv: &impl DevicePtr<T>,
        per_expert: usize,
        spare: &mut impl DevicePtrMut<T>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let c = &self.config;
        let copy = WeightCopy {
            op: "ep select_spare_weights",
            src: ("recv [R, S_per, per_expert]", c.global_slots()),
            dst: ("spare [S_per, per_expert]", c.spare_per_rank),
            entry: sys::capmoe_ep_select_spare_weights,
        };
        self.copy_spare_weights(copy, stream, slot_expert, recv, per_expert, spare, flags)
    }

    /// The checks and the launch shared by the two Echo weight copies (one C signature).
    #[allow(clippy::too_many_arguments)]
    fn copy_spare_weights<T: DeviceRepr>(
        &self,
        copy: WeightCopy,
        stream: &CudaStream,
        slot_expert: &impl DevicePtr<i64>,
        src: &impl DevicePtr<T>,
        per_expert: usize,
        dst: &mut impl DevicePtrMut<T>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        let op = copy.op;
        let bytes = self.check_spare(op, per_expert, std::mem::size_of::<T>())?;
        ensure_buffer(op, "slot_expert", stream, slot_expert, self.config.global_slots())?;
        ensure_buffer(op, copy.src.0, stream, src, elements(op, copy.src.1, per_expert)?)?;
        ensure_buffer(op, copy.dst.0, stream, dst, elements(op, copy.dst.1, per_expert)?)?;
        ensure_buffer(op, "flags", stream, flags, 1)?;
        stream.context().bind_to_thread()?;
        let (se, _g0) = slot_expert.device_ptr(stream);
        let (sp, _g1) = src.device_ptr(stream);
        let (dp, _g2) = dst.device_ptr_mut(stream);
        let (fl, _g3) = flags.device_ptr_mut(stream);
        Self::aligned16(op, copy.src.0, sp)?;
        Self::aligned16(op, copy.dst.0, dp)?;
        // SAFETY: every buffer checked above against the sizes the entry point reads / writes.
        let status = unsafe {
            (copy.entry)(
                &self.desc,
                se as *const i64,
                sp as *const c_void,
                bytes,
                dp as *mut c_void,
                fl as *mut i32,
                raw_stream(stream),
            )
        };
        check(status, op)
    }

    /// Echo gradients, home side: `dw_home [L, per_expert][e - rank * L] += recv [R, S_per,
    /// per_expert][q, s]` over every global slot `q * S_per + s` (ascending) whose expert `e` is
    /// a home expert of this rank; fp32, bitwise deterministic. `per_expert` a multiple of 4.
    #[allow(clippy::too_many_arguments)]
    pub fn fold_spare_grads(
        &self,
        stream: &CudaStream,
        slot_expert: &impl DevicePtr<i64>,
        recv: &impl DevicePtr<f32>,
        per_expert: usize,
        dw_home: &mut impl DevicePtrMut<f32>,
        flags: &mut impl DevicePtrMut<i32>,
    ) -> Result<()> {
        const OP: &str = "ep fold_spare_grads";
        let c = &self.config;
        self.check_spare(OP, per_expert, 4)?;
        ensure_buffer(OP, "slot_expert", stream, slot_expert, c.global_slots())?;
        ensure_buffer(OP, "recv [R, S_per, per_expert]", stream, recv, elements(OP, c.global_slots(), per_expert)?)?;
        ensure_buffer(OP, "dw_home [L, per_expert]", stream, dw_home, elements(OP, c.local_experts(), per_expert)?)?;
        ensure_buffer(OP, "flags", stream, flags, 1)?;
        stream.context().bind_to_thread()?;
        let (se, _g0) = slot_expert.device_ptr(stream);
        let (rp, _g1) = recv.device_ptr(stream);
        let (dp, _g2) = dw_home.device_ptr_mut(stream);
        let (fl, _g3) = flags.device_ptr_mut(stream);
        Self::aligned16(OP, "recv", rp)?;
        Self::aligned16(OP, "dw_home", dp)?;
        let status = unsafe {
            sys::capmoe_ep_fold_spare_grads(
                &self.desc,
                se as *const i64,
                rp as *const f32,
                per_expert as i64,
                dp as *mut f32,
                fl as *mut i32,
                raw_stream(stream),
            )
        };
        check(status, OP)
    }
}

/// One of the two Echo weight copies: its name, its source and destination (what, matrices),
/// and its C entry point.
struct WeightCopy {
    op: &'static str,
    src: (&'static str, usize),
    dst: (&'static str, usize),
    entry: unsafe extern "C" fn(
        *const sys::capmoe_ep_desc_t,
        *const i64,
        *const c_void,
        i64,
        *mut c_void,
        *mut i32,
        *mut c_void,
    ) -> sys::capmoe_status_t,
}

fn raw_stream(stream: &CudaStream) -> *mut c_void {
    stream.cu_stream() as *mut c_void
}

/// Runs `f(num_tokens, num_tokens_device)` with the device count's guard alive across it.
fn with_tokens(stream: &CudaStream, tokens: Tokens<'_>, f: impl FnOnce(i64, CUdeviceptr) -> Result<()>) -> Result<()> {
    match tokens {
        Tokens::Host(t) => f(t as i64, 0),
        Tokens::Device(s) => {
            let (p, _guard) = s.device_ptr(stream);
            f(0, p)
        }
    }
}
