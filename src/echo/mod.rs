//! Echo rerouting: the Megatron offloading planner (spec `echo-planner.md`, P1–P9) as
//! capturable CUDA kernels, a CPU reference of every stage, and the spare-slot weight kernels.
//!
//! Launchers allocate nothing, never synchronise and never read device data on the host, so
//! [`EchoPlan::plan_reroute_topk`] & co. can be captured once in a CUDA graph and replayed with
//! new count matrices and routings. Device-side precondition failures (negative counts, a
//! routing that disagrees with `counts[ep_rank]`, bad expert ids) never cause an out-of-bounds
//! access; they set bits in the state's error word, read with [`EchoPlan::read_errors`].
//!
//! Buffers (row-major, contiguous):
//! * `counts [EP, E]` i64, `state [state_len]` i64 (the plan, see [`Layout`]; 16-byte aligned,
//!   as every cudarc allocation is; a view starting off a 16-byte boundary is rejected), `workspace
//!   [workspace_len]` i32;
//! * Megatron form: `routing_map [T, E]` u8 (nonzero = routed) + `probs [T, E]` f32 ->
//!   `out_map [T, E+S]` u8 + `out_probs [T, E+S]` f32, columns interleaved per rank (spec P9);
//! * top-k form: `expert_ids [T, k]` i32 (distinct per token) + `probs [T, k]` f32 ->
//!   `out_dest [T, k]` i32 (final interleaved column of each route) + `out_probs [T, k]` f32.
//!
//! The token count `T` of a reroute is a [`Tokens`]: a host count, or a device `i32` read on
//! the GPU and clamped into `[0, t_max]` (out of range sets [`DeviceErrors::BAD_TOKENS`]), so
//! one captured graph serves a different `T` every replay. With a device count, the token
//! buffers must hold `t_max` rows; rows `t >= T` of the outputs are not written.

mod config;
pub mod reference;
pub mod synthetic;

use std::ffi::c_void;

use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

pub use config::{Algorithm, EchoConfig, MAX_EXPERTS, MAX_SPARE};
use reference::PlanStages;

use crate::device::ensure_same_context;
use crate::error::{check, ensure_len};
use crate::routing::Tokens;
use crate::{sys, Error, Result};

/// Offsets (in i64 elements) of every section of the plan state (see `capturable_moe/echo.h`).
/// Sections documented as i32 hold packed i32 from that i64 element on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub state_len: usize,
    pub error: usize,
    pub avg: usize,
    pub tokens_per_expert: usize,
    pub load_per_rank: usize,
    pub spill: usize,
    pub spare_capacity: usize,
    pub pre_reclaim_expert: usize,
    pub pre_reclaim_tokens: usize,
    pub slot_tokens: usize,
    /// `[S]` home expert of each slot, -1 = empty (the slot -> home expert table; i64, so
    /// [`fill_spare_weights`] takes a slice of the state as is).
    pub slot_expert: usize,
    pub remaining_capacity: usize,
    pub load_after: usize,
    /// i32 `[S, EP]`: `F[r][j]` at `j * EP + r`; only rows of non-empty slots are written.
    pub first_pass: usize,
    /// i32 `[S, EP]`: `D[r][j]` at `j * EP + r`; only rows of non-empty slots are written.
    pub second_pass: usize,
    /// i32 `[S, 4]`: slot expert, next slot of the same expert, start and end of the slot's
    /// range in that expert's token list on `ep_rank`.
    pub slot_route: usize,
    /// i32 `[E, 2]`: lowest slot fed by the expert (-1 none), tokens of `ep_rank` moved off it.
    pub expert_route: usize,
    /// `E * S` bytes of `M[e][j]` (0/1) from this i64 element on.
    pub offload_map: usize,
}

/// Device-side error bits (the state's error word).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceErrors(pub u32);

impl DeviceErrors {
    pub const NEGATIVE_COUNT: u32 = sys::CAPMOE_ECHO_ERR_NEGATIVE_COUNT;
    pub const COUNT_TOO_LARGE: u32 = sys::CAPMOE_ECHO_ERR_COUNT_TOO_LARGE;
    pub const ROUTING_MISMATCH: u32 = sys::CAPMOE_ECHO_ERR_ROUTING_MISMATCH;
    pub const EXPERT_OUT_OF_RANGE: u32 = sys::CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE;
    pub const DUPLICATE_ROUTE: u32 = sys::CAPMOE_ECHO_ERR_DUPLICATE_ROUTE;
    pub const INTERNAL: u32 = sys::CAPMOE_ECHO_ERR_INTERNAL;
    pub const BAD_SLOT_EXPERT: u32 = sys::CAPMOE_ECHO_ERR_BAD_SLOT_EXPERT;
    pub const BAD_TOKENS: u32 = sys::CAPMOE_ECHO_ERR_BAD_TOKENS;

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn contains(self, bit: u32) -> bool {
        self.0 & bit != 0
    }
}

/// What an [`EchoPlan`] was built for ([`EchoPlan::desc`]).
#[derive(Clone, Debug, PartialEq)]
pub struct EchoPlanDesc {
    pub config: EchoConfig,
    /// The most tokens one reroute may carry on this rank.
    pub t_max: usize,
    /// i64 elements of the plan state, i32 elements of the reroute workspace.
    pub state_len: usize,
    pub workspace_len: usize,
}

/// One planner instance: the validated configuration, its state layout and workspace size.
#[derive(Clone, Debug)]
pub struct EchoPlan {
    cfg: EchoConfig,
    t_max: usize,
    layout: Layout,
    workspace_len: usize,
    abi: sys::capmoe_echo_config_t,
    block_capacity: Option<usize>,
}

/// The device pointer of a device token count (0 for a host count), with its guard.
fn device_count<'a>(stream: &'a CudaStream, tokens: Tokens<'a>) -> (CUdeviceptr, Option<SyncOnDrop<'a>>) {
    match tokens {
        Tokens::Host(_) => (0, None),
        Tokens::Device(count) => {
            let (p, guard) = count.device_ptr(stream);
            (p, Some(guard))
        }
    }
}

fn exact(op: &'static str, what: &'static str, want: usize, got: usize) -> Result<()> {
    if got != want {
        return Err(Error::Shape { op, what, expected: format!("{want} elements"), got: got.to_string() });
    }
    Ok(())
}

impl EchoPlan {
    /// Validates the configuration (spec section 3 and the GPU limits `E <= 1024`,
    /// `EP * S_per <= 1024`) for up to `t_max` tokens on this rank. Host only: no GPU needed.
    pub fn new(cfg: EchoConfig, t_max: usize) -> Result<EchoPlan> {
        cfg.validate_gpu()?;
        if t_max > i32::MAX as usize {
            return Err(Error::InvalidArgument { op: "echo plan", why: format!("t_max = {t_max} must be < 2^31") });
        }
        let abi = sys::capmoe_echo_config_t {
            ep: cfg.ep as i64,
            num_experts: cfg.num_experts as i64,
            spare_per_rank: cfg.spare_per_rank as i64,
            ep_rank: cfg.ep_rank as i64,
            topk: cfg.topk as i64,
            algorithm: cfg.algorithm.abi_code(),
            threshold_multiplier: cfg.threshold_multiplier,
        };
        let mut raw: sys::capmoe_echo_layout_t = unsafe { std::mem::zeroed() };
        let mut ws: i64 = 0;
        check(unsafe { sys::capmoe_echo_layout(&abi, t_max as i64, &mut raw, &mut ws) }, "echo layout")?;
        let u = |v: i64| v as usize;
        let layout = Layout {
            state_len: u(raw.state_len),
            error: u(raw.off_error),
            avg: u(raw.off_avg),
            tokens_per_expert: u(raw.off_tokens_per_expert),
            load_per_rank: u(raw.off_load_per_rank),
            spill: u(raw.off_spill),
            spare_capacity: u(raw.off_spare_capacity),
            pre_reclaim_expert: u(raw.off_pre_reclaim_expert),
            pre_reclaim_tokens: u(raw.off_pre_reclaim_tokens),
            slot_tokens: u(raw.off_slot_tokens),
            slot_expert: u(raw.off_slot_expert),
            remaining_capacity: u(raw.off_remaining_capacity),
            load_after: u(raw.off_load_after),
            first_pass: u(raw.off_first_pass),
            second_pass: u(raw.off_second_pass),
            slot_route: u(raw.off_slot_route),
            expert_route: u(raw.off_expert_route),
            offload_map: u(raw.off_offload_map),
        };
        Ok(EchoPlan { cfg, t_max, layout, workspace_len: u(ws), abi, block_capacity: None })
    }

    /// Block balancing for expert parallelism (beyond the spec): the top-k reroute then moves
    /// this rank's routes among each replicated expert's columns so that no peer receives more
    /// than `capacity` of them wherever another column of the expert has room
    /// ([`reference::balance_blocks`] is the rule; `capmoe_echo_plan_reroute_topk_capped` in
    /// `echo.h`). `ep::EpMoe` (feature `nccl`) sets it to its block capacity. The dense form and
    /// [`plan`](Self::plan) are not affected.
    pub fn with_block_capacity(mut self, capacity: usize) -> Result<EchoPlan> {
        if capacity > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                op: "echo plan",
                why: format!("block capacity {capacity} must be < 2^31"),
            });
        }
        self.block_capacity = Some(capacity);
        Ok(self)
    }

    /// The block capacity of [`with_block_capacity`](Self::with_block_capacity), if set.
    pub fn block_capacity(&self) -> Option<usize> {
        self.block_capacity
    }

    /// What the plan was built for: the configuration, `t_max`, the state and workspace sizes.
    pub fn desc(&self) -> EchoPlanDesc {
        EchoPlanDesc {
            config: self.cfg.clone(),
            t_max: self.t_max,
            state_len: self.state_len(),
            workspace_len: self.workspace_len,
        }
    }
    pub fn config(&self) -> &EchoConfig {
        &self.cfg
    }
    pub fn t_max(&self) -> usize {
        self.t_max
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// Length of the i64 plan state buffer.
    pub fn state_len(&self) -> usize {
        self.layout.state_len
    }
    /// Length of the i32 workspace the reroute launches need for up to `t_max` tokens.
    pub fn workspace_len(&self) -> usize {
        self.workspace_len
    }

    fn same_context_tokens(&self, op: &'static str, stream: &CudaStream, tokens: Tokens<'_>) -> Result<()> {
        match tokens {
            Tokens::Host(_) => Ok(()),
            Tokens::Device(count) => ensure_same_context(op, "num_tokens_device", stream, count),
        }
    }

    fn check_tokens(&self, op: &'static str, t: usize) -> Result<()> {
        if t > self.t_max {
            return Err(Error::InvalidArgument { op, why: format!("num_tokens = {t} exceeds t_max = {}", self.t_max) });
        }
        Ok(())
    }

    /// The rows the token buffers must hold: the host count, or `t_max` for a device count
    /// (which may be anything up to it).
    fn token_rows(&self, op: &'static str, tokens: Tokens<'_>) -> Result<usize> {
        match tokens {
            Tokens::Host(t) => self.check_tokens(op, t).map(|_| t),
            Tokens::Device(count) => ensure_len(op, "num_tokens_device", count.len(), 1, "").map(|_| self.t_max),
        }
    }

    /// P1–P7 from `counts [EP, E]` into `state`. One launch; no host sync, no allocation.
    pub fn plan(
        &self,
        stream: &CudaStream,
        counts: &impl DevicePtr<i64>,
        state: &mut impl DevicePtrMut<i64>,
    ) -> Result<()> {
        const OP: &str = "echo plan";
        exact(OP, "counts [EP, E]", self.cfg.ep * self.cfg.num_experts, counts.len())?;
        ensure_len(OP, "state", state.len(), self.state_len(), "")?;
        ensure_same_context(OP, "counts", stream, counts)?;
        ensure_same_context(OP, "state", stream, state)?;
        let (c, _gc) = counts.device_ptr(stream);
        let (s, _gs) = state.device_ptr_mut(stream);
        // SAFETY: lengths and context checked above; the guards keep the buffers alive past
        // the launch.
        unsafe { self.plan_raw(stream, c, s) }
    }

    /// P1–P9, Megatron form. Two launches (the second a programmatic dependent launch that
    /// reads its token tile while the plan runs); no host sync, no allocation.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_reroute_dense(
        &self,
        stream: &CudaStream,
        counts: &impl DevicePtr<i64>,
        routing_map: &impl DevicePtr<u8>,
        probs: &impl DevicePtr<f32>,
        tokens: Tokens<'_>,
        state: &mut impl DevicePtrMut<i64>,
        workspace: &mut impl DevicePtrMut<i32>,
        out_map: &mut impl DevicePtrMut<u8>,
        out_probs: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "echo plan+reroute (dense)";
        let (e, w) = (self.cfg.num_experts, self.cfg.num_columns());
        let num_tokens = self.token_rows(OP, tokens)?;
        exact(OP, "counts [EP, E]", self.cfg.ep * e, counts.len())?;
        ensure_len(OP, "routing_map [T, E]", routing_map.len(), num_tokens * e, "")?;
        ensure_len(OP, "probs [T, E]", probs.len(), num_tokens * e, "")?;
        ensure_len(OP, "state", state.len(), self.state_len(), "")?;
        ensure_len(OP, "workspace", workspace.len(), self.workspace_len, "")?;
        ensure_len(OP, "out_map [T, E+S]", out_map.len(), num_tokens * w, "")?;
        ensure_len(OP, "out_probs [T, E+S]", out_probs.len(), num_tokens * w, "")?;
        ensure_same_context(OP, "counts", stream, counts)?;
        ensure_same_context(OP, "routing_map", stream, routing_map)?;
        ensure_same_context(OP, "probs", stream, probs)?;
        ensure_same_context(OP, "state", stream, state)?;
        ensure_same_context(OP, "workspace", stream, workspace)?;
        ensure_same_context(OP, "out_map", stream, out_map)?;
        ensure_same_context(OP, "out_probs", stream, out_probs)?;
        self.same_context_tokens(OP, stream, tokens)?;
        let ws_len = workspace.len();
        let (c, _g1) = counts.device_ptr(stream);
        let (m, _g2) = routing_map.device_ptr(stream);
        let (p, _g3) = probs.device_ptr(stream);
        let (s, _g4) = state.device_ptr_mut(stream);
        let (ws, _g5) = workspace.device_ptr_mut(stream);
        let (om, _g6) = out_map.device_ptr_mut(stream);
        let (op, _g7) = out_probs.device_ptr_mut(stream);
        let (t_dev, _g8) = device_count(stream, tokens);
        // SAFETY: every length checked above; guards alive until the end of the call.
        unsafe { self.plan_reroute_dense_raw(stream, c, m, p, num_tokens, t_dev, s, ws, ws_len, om, op) }
    }

    /// P1–P9, top-k form: rewrites `expert_ids [T, k]` to final columns (block-balanced after
    /// P7 with [`with_block_capacity`](Self::with_block_capacity)). Two launches; no host
    /// sync, no allocation.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_reroute_topk(
        &self,
        stream: &CudaStream,
        counts: &impl DevicePtr<i64>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<f32>,
        tokens: Tokens<'_>,
        state: &mut impl DevicePtrMut<i64>,
        workspace: &mut impl DevicePtrMut<i32>,
        out_dest: &mut impl DevicePtrMut<i32>,
        out_probs: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "echo plan+reroute (top-k)";
        let (e, k) = (self.cfg.num_experts, self.cfg.topk);
        let num_tokens = self.token_rows(OP, tokens)?;
        exact(OP, "counts [EP, E]", self.cfg.ep * e, counts.len())?;
        ensure_len(OP, "expert_ids [T, k]", expert_ids.len(), num_tokens * k, "")?;
        ensure_len(OP, "probs [T, k]", probs.len(), num_tokens * k, "")?;
        ensure_len(OP, "state", state.len(), self.state_len(), "")?;
        ensure_len(OP, "workspace", workspace.len(), self.workspace_len, "")?;
        ensure_len(OP, "out_dest [T, k]", out_dest.len(), num_tokens * k, "")?;
        ensure_len(OP, "out_probs [T, k]", out_probs.len(), num_tokens * k, "")?;
        ensure_same_context(OP, "counts", stream, counts)?;
        ensure_same_context(OP, "expert_ids", stream, expert_ids)?;
        ensure_same_context(OP, "probs", stream, probs)?;
        ensure_same_context(OP, "state", stream, state)?;
        ensure_same_context(OP, "workspace", stream, workspace)?;
        ensure_same_context(OP, "out_dest", stream, out_dest)?;
        ensure_same_context(OP, "out_probs", stream, out_probs)?;
        self.same_context_tokens(OP, stream, tokens)?;
        let ws_len = workspace.len();
        let (c, _g1) = counts.device_ptr(stream);
        let (ids, _g2) = expert_ids.device_ptr(stream);
        let (p, _g3) = probs.device_ptr(stream);
        let (s, _g4) = state.device_ptr_mut(stream);
        let (ws, _g5) = workspace.device_ptr_mut(stream);
        let (od, _g6) = out_dest.device_ptr_mut(stream);
        let (op, _g7) = out_probs.device_ptr_mut(stream);
        let (t_dev, _g8) = device_count(stream, tokens);
        // SAFETY: every length checked above; guards alive until the end of the call.
        unsafe { self.plan_reroute_topk_raw(stream, c, ids, p, num_tokens, t_dev, s, ws, ws_len, od, op) }
    }

    /// Raw form of [`plan`](Self::plan) for other engines (crate convention: `&CudaStream`
    /// first, then `CUdeviceptr`s in the order of the safe form, 0 for an absent optional
    /// buffer, sizes as `usize`).
    ///
    /// # Safety
    /// `counts` points to `EP * E` i64 and `state` to [`state_len`](Self::state_len) i64 of
    /// device memory of `stream`'s context that stay valid until the launch has run. `state`
    /// must be 16-byte aligned (the plan reads and writes it in 16-byte pieces; anything else
    /// is rejected before a launch).
    pub unsafe fn plan_raw(&self, stream: &CudaStream, counts: CUdeviceptr, state: CUdeviceptr) -> Result<()> {
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_echo_plan(&self.abi, counts as *const i64, state as *mut i64, raw_stream(stream)),
            "echo plan",
        )
    }

    /// Raw form of [`plan_reroute_dense`](Self::plan_reroute_dense).
    ///
    /// # Safety
    /// As [`plan_raw`](Self::plan_raw), plus: `routing_map` / `probs` hold `T * E` u8 / f32,
    /// `workspace` `workspace_len` i32, `out_map` / `out_probs` `T * (E + S)` u8 / f32, all
    /// device memory valid until the launches have run; `num_tokens <= t_max`. With
    /// `num_tokens_device` (0 = none: T = `num_tokens`) T is that i32 read on the GPU, clamped
    /// into `[0, num_tokens]`, and the buffers hold `num_tokens` rows.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn plan_reroute_dense_raw(
        &self,
        stream: &CudaStream,
        counts: CUdeviceptr,
        routing_map: CUdeviceptr,
        probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        state: CUdeviceptr,
        workspace: CUdeviceptr,
        workspace_len: usize,
        out_map: CUdeviceptr,
        out_probs: CUdeviceptr,
    ) -> Result<()> {
        self.check_tokens("echo plan+reroute (dense)", num_tokens)?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_echo_plan_reroute_dense(
                &self.abi,
                counts as *const i64,
                routing_map as *const u8,
                probs as *const f32,
                num_tokens as i64,
                num_tokens_device as *const i32,
                state as *mut i64,
                workspace as *mut i32,
                workspace_len as i64,
                out_map as *mut u8,
                out_probs as *mut f32,
                raw_stream(stream),
            ),
            "echo plan+reroute (dense)",
        )
    }

    /// Raw form of [`plan_reroute_topk`](Self::plan_reroute_topk); `out_probs` may be 0.
    ///
    /// # Safety
    /// As [`plan_raw`](Self::plan_raw), plus: `expert_ids` / `probs` / `out_dest` /
    /// `out_probs` hold `T * k` elements, `workspace` `workspace_len` i32, all device memory
    /// valid until the launches have run; `num_tokens <= t_max`. `num_tokens_device` as in
    /// [`plan_reroute_dense_raw`](Self::plan_reroute_dense_raw).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn plan_reroute_topk_raw(
        &self,
        stream: &CudaStream,
        counts: CUdeviceptr,
        expert_ids: CUdeviceptr,
        probs: CUdeviceptr,
        num_tokens: usize,
        num_tokens_device: CUdeviceptr,
        state: CUdeviceptr,
        workspace: CUdeviceptr,
        workspace_len: usize,
        out_dest: CUdeviceptr,
        out_probs: CUdeviceptr,
    ) -> Result<()> {
        self.check_tokens("echo plan+reroute (top-k)", num_tokens)?;
        stream.context().bind_to_thread()?;
        let (c, ids, p) = (counts as *const i64, expert_ids as *const i32, probs as *const f32);
        let (t_dev, st, ws) = (num_tokens_device as *const i32, state as *mut i64, workspace as *mut i32);
        let (od, op, s) = (out_dest as *mut i32, out_probs as *mut f32, raw_stream(stream));
        let (t, ws_len) = (num_tokens as i64, workspace_len as i64);
        let status = match self.block_capacity {
            None => sys::capmoe_echo_plan_reroute_topk(&self.abi, c, ids, p, t, t_dev, st, ws, ws_len, od, op, s),
            Some(cap) => sys::capmoe_echo_plan_reroute_topk_capped(
                &self.abi, cap as i64, c, ids, p, t, t_dev, st, ws, ws_len, od, op, s,
            ),
        };
        check(status, "echo plan+reroute (top-k)")
    }

    /// Reads the device error word. Synchronises the stream: diagnostics and tests only.
    pub fn read_errors(&self, stream: &std::sync::Arc<CudaStream>, state: &CudaSlice<i64>) -> Result<DeviceErrors> {
        crate::graph::ensure_not_capturing(stream, "EchoPlan::read_errors")?;
        let v = stream.clone_dtoh(&state.slice(self.layout.error..self.layout.error + 1))?;
        Ok(DeviceErrors(v[0] as u32))
    }

    /// Downloads every stage of the plan into the CPU reference's dense form. The offload map
    /// is rebuilt from `slot_expert` ([`read_offload_map`](Self::read_offload_map) reads the
    /// kernel's); `Ftot = F + D` and the `[EP, E]` home-offload matrices (`C - C1`, `C - C2`)
    /// are summed here from the kernel's `F` and `D` rows over each expert's slots, as spec P7
    /// defines them (the state does not hold them). Synchronises the stream: diagnostics and
    /// tests only.
    pub fn read_stages(&self, stream: &std::sync::Arc<CudaStream>, state: &CudaSlice<i64>) -> Result<PlanStages> {
        crate::graph::ensure_not_capturing(stream, "EchoPlan::read_stages")?;
        let st = stream.clone_dtoh(&state.slice(0..self.state_len()))?;
        let (ep, ne, s) = (self.cfg.ep, self.cfg.num_experts, self.cfg.num_spare());
        let l = &self.layout;
        let sec = |off: usize, len: usize| st[off..off + len].to_vec();
        // Packed i32 sections: element i of the section at i64 offset `off`.
        let i32_at = |off: usize, i: usize| -> i64 {
            let w = st[off + i / 2] as u64;
            (if i.is_multiple_of(2) { w as u32 } else { (w >> 32) as u32 }) as i32 as i64
        };
        let slot_expert = sec(l.slot_expert, s);
        let mut pre = vec![0i64; ne * s];
        let mut h = vec![0i64; ne * s];
        let mut rm = vec![0i64; ne * s];
        let (mut f, mut d) = (vec![0i64; ep * s], vec![0i64; ep * s]);
        let (mut ftot, mut fpho, mut ho) = (vec![0i64; ep * s], vec![0i64; ep * ne], vec![0i64; ep * ne]);
        for j in 0..s {
            let pe = st[l.pre_reclaim_expert + j];
            if pe >= 0 && (pe as usize) < ne {
                pre[pe as usize * s + j] = st[l.pre_reclaim_tokens + j];
            }
            let e = slot_expert[j];
            if e >= 0 && (e as usize) < ne {
                let e = e as usize;
                h[e * s + j] = st[l.slot_tokens + j];
                rm[e * s + j] = st[l.remaining_capacity + j];
                for r in 0..ep {
                    let (fv, dv) = (i32_at(l.first_pass, j * ep + r), i32_at(l.second_pass, j * ep + r));
                    f[r * s + j] = fv;
                    d[r * s + j] = dv;
                    ftot[r * s + j] = fv + dv;
                    fpho[r * ne + e] += fv;
                    ho[r * ne + e] += fv + dv;
                }
            }
        }
        Ok(PlanStages {
            tokens_per_expert: sec(l.tokens_per_expert, ne),
            load_per_rank: sec(l.load_per_rank, ep),
            avg: st[l.avg],
            spill: sec(l.spill, ne),
            spare_capacity: sec(l.spare_capacity, ep),
            assignment_pre_reclaim: pre,
            assignment: h,
            slot_expert,
            first_pass: f,
            first_pass_home_offload: fpho,
            remaining_capacity: rm,
            second_pass: d,
            tokens_to_slot: ftot,
            home_offload: ho,
            load_after: sec(l.load_after, ep),
        })
    }

    /// The kernel's reroute tables for `ep_rank`: per slot `(slot expert, next slot of the same
    /// expert, start, end)` of its range in the expert's token list, per expert `(lowest slot,
    /// tokens moved off)`. Synchronises: diagnostics and tests only.
    #[allow(clippy::type_complexity)]
    pub fn read_route_tables(
        &self,
        stream: &std::sync::Arc<CudaStream>,
        state: &CudaSlice<i64>,
    ) -> Result<(Vec<[i32; 4]>, Vec<[i32; 2]>)> {
        crate::graph::ensure_not_capturing(stream, "EchoPlan::read_route_tables")?;
        let (ne, s) = (self.cfg.num_experts, self.cfg.num_spare());
        let l = &self.layout;
        let words = |off: usize, n: usize| -> Result<Vec<i32>> {
            let w = stream.clone_dtoh(&state.slice(off..off + n.div_ceil(2)))?;
            Ok(w.iter().flat_map(|&x| [x as u64 as u32 as i32, (x as u64 >> 32) as u32 as i32]).take(n).collect())
        };
        let sr = words(l.slot_route, 4 * s)?;
        let er = words(l.expert_route, 2 * ne)?;
        Ok((sr.chunks(4).map(|c| [c[0], c[1], c[2], c[3]]).collect(), er.chunks(2).map(|c| [c[0], c[1]]).collect()))
    }

    /// The kernel-written offload map `M [E, S]`. Synchronises: diagnostics and tests only.
    pub fn read_offload_map(&self, stream: &std::sync::Arc<CudaStream>, state: &CudaSlice<i64>) -> Result<Vec<bool>> {
        crate::graph::ensure_not_capturing(stream, "EchoPlan::read_offload_map")?;
        let (ne, s) = (self.cfg.num_experts, self.cfg.num_spare());
        let words = (ne * s).div_ceil(8);
        let st = stream.clone_dtoh(&state.slice(self.layout.offload_map..self.layout.offload_map + words))?;
        let bytes: Vec<u8> = st.iter().flat_map(|w| w.to_le_bytes()).collect();
        Ok(bytes[..ne * s].iter().map(|&b| b != 0).collect())
    }
}

/// The most slots one call of [`fill_spare_weights`] or [`fold_spare_grads`] handles.
pub const MAX_WEIGHT_SLOTS: usize = sys::CAPMOE_ECHO_MAX_WEIGHT_SLOTS as usize;

fn ensure_weight_slots(op: &'static str, num_slots: usize) -> Result<()> {
    if num_slots > MAX_WEIGHT_SLOTS {
        return Err(Error::InvalidArgument {
            op,
            why: format!("num_slots = {num_slots} > {MAX_WEIGHT_SLOTS} per call"),
        });
    }
    Ok(())
}

/// Fills spare slots from their home experts on one GPU: for each local slot `i <
/// num_slots` with `e = slot_expert[slot_begin + i] >= 0`, copies `home[e * per_expert ..]` to
/// `spare[i * per_expert ..]` (`per_expert` elements of any type); slots with -1 are left
/// untouched. `error_flags[0]` gets [`DeviceErrors::BAD_SLOT_EXPERT`] for an id outside
/// `[-1, E)`. At most [`MAX_WEIGHT_SLOTS`] slots per call. One launch; no host sync, no
/// allocation.
#[allow(clippy::too_many_arguments)]
pub fn fill_spare_weights<T: DeviceRepr>(
    stream: &CudaStream,
    slot_expert: &impl DevicePtr<i64>,
    num_experts: usize,
    slot_begin: usize,
    num_slots: usize,
    home: &impl DevicePtr<T>,
    spare: &mut impl DevicePtrMut<T>,
    per_expert: usize,
    error_flags: &mut impl DevicePtrMut<i64>,
) -> Result<()> {
    const OP: &str = "echo fill spare weights";
    ensure_weight_slots(OP, num_slots)?;
    let slots_end = slot_begin
        .checked_add(num_slots)
        .filter(|&end| end <= i64::MAX as usize)
        .ok_or_else(|| invalid_sizes(OP, format!("slot_begin + num_slots = {slot_begin} + {num_slots}")))?;
    let size = std::mem::size_of::<T>();
    ensure_len(OP, "slot_expert", slot_expert.len(), slots_end, "")?;
    ensure_len(OP, "home [E, per_expert]", home.len(), weight_elements(OP, num_experts, per_expert, size)?, "")?;
    ensure_len(
        OP,
        "spare [num_slots, per_expert]",
        spare.len(),
        weight_elements(OP, num_slots, per_expert, size)?,
        "",
    )?;
    ensure_len(OP, "error_flags", error_flags.len(), 1, "")?;
    ensure_same_context(OP, "slot_expert", stream, slot_expert)?;
    ensure_same_context(OP, "home", stream, home)?;
    ensure_same_context(OP, "spare", stream, spare)?;
    ensure_same_context(OP, "error_flags", stream, error_flags)?;
    stream.context().bind_to_thread()?;
    let (se, _g1) = slot_expert.device_ptr(stream);
    let (h, _g2) = home.device_ptr(stream);
    let (sp, _g3) = spare.device_ptr_mut(stream);
    let (ef, _g4) = error_flags.device_ptr_mut(stream);
    let status = unsafe {
        sys::capmoe_echo_fill_spare_weights(
            se as *const i64,
            num_experts as i64,
            slot_begin as i64,
            num_slots as i64,
            h as *const c_void,
            sp as *mut c_void,
            (per_expert * size) as i64,
            ef as *mut i64,
            raw_stream(stream),
        )
    };
    check(status, OP)
}

/// `count * per_expert` elements of `elem_bytes` each, or [`Error::InvalidArgument`] where the
/// bytes pass `i64::MAX` (the C ABI's byte counts): a wrapped product would let a short buffer
/// pass the length checks, or make the copy silently empty.
fn weight_elements(op: &'static str, count: usize, per_expert: usize, elem_bytes: usize) -> Result<usize> {
    count
        .checked_mul(per_expert)
        .filter(|n| n.checked_mul(elem_bytes).is_some_and(|b| b <= i64::MAX as usize))
        .filter(|_| per_expert.checked_mul(elem_bytes).is_some_and(|b| b <= i64::MAX as usize))
        .ok_or_else(|| invalid_sizes(op, format!("{count} x {per_expert} elements of {elem_bytes} bytes")))
}

fn invalid_sizes(op: &'static str, what: String) -> Error {
    Error::InvalidArgument { op, why: format!("{what}: too large for the C ABI's 64-bit sizes") }
}

/// Backward fold of spare-slot weight gradients: `dw_home[e] += dw_slot[j]` for every slot
/// `j < num_slots` with `slot_expert[j] == e`, fp32, summed onto the existing value in
/// ascending `j` (bitwise deterministic). At most [`MAX_WEIGHT_SLOTS`] slots per call. One
/// launch; no host sync, no allocation.
#[allow(clippy::too_many_arguments)]
pub fn fold_spare_grads(
    stream: &CudaStream,
    slot_expert: &impl DevicePtr<i64>,
    num_experts: usize,
    num_slots: usize,
    dw_slot: &impl DevicePtr<f32>,
    dw_home: &mut impl DevicePtrMut<f32>,
    per_expert: usize,
    error_flags: &mut impl DevicePtrMut<i64>,
) -> Result<()> {
    const OP: &str = "echo fold spare grads";
    ensure_weight_slots(OP, num_slots)?;
    ensure_len(OP, "slot_expert", slot_expert.len(), num_slots, "")?;
    ensure_len(
        OP,
        "dw_slot [num_slots, per_expert]",
        dw_slot.len(),
        weight_elements(OP, num_slots, per_expert, 4)?,
        "",
    )?;
    ensure_len(OP, "dw_home [E, per_expert]", dw_home.len(), weight_elements(OP, num_experts, per_expert, 4)?, "")?;
    ensure_len(OP, "error_flags", error_flags.len(), 1, "")?;
    ensure_same_context(OP, "slot_expert", stream, slot_expert)?;
    ensure_same_context(OP, "dw_slot", stream, dw_slot)?;
    ensure_same_context(OP, "dw_home", stream, dw_home)?;
    ensure_same_context(OP, "error_flags", stream, error_flags)?;
    stream.context().bind_to_thread()?;
    let (se, _g1) = slot_expert.device_ptr(stream);
    let (s, _g2) = dw_slot.device_ptr(stream);
    let (h, _g3) = dw_home.device_ptr_mut(stream);
    let (ef, _g4) = error_flags.device_ptr_mut(stream);
    let status = unsafe {
        sys::capmoe_echo_fold_spare_grads(
            se as *const i64,
            num_experts as i64,
            num_slots as i64,
            s as *const f32,
            h as *mut f32,
            per_expert as i64,
            ef as *mut i64,
            raw_stream(stream),
        )
    };
    check(status, OP)
}

fn raw_stream(stream: &CudaStream) -> *mut c_void {
    stream.cu_stream() as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_sizes_that_wrap_are_errors() {
        assert_eq!(weight_elements("op", 4, 1 << 20, 2).unwrap(), 4 << 20);
        assert_eq!(weight_elements("op", 0, 1 << 20, 4).unwrap(), 0);
        // 4 x 2^62 wraps to 0 elements, and 2^62 f32 to 0 bytes: both must be refused.
        let wrapped = weight_elements("op", 4, 1 << 62, 4);
        assert!(matches!(&wrapped, Err(Error::InvalidArgument { why, .. }) if why.contains("64-bit")), "{wrapped:?}");
        // Elements that fit usize, bytes that pass i64::MAX.
        assert!(weight_elements("op", 1, 1 << 62, 2).is_err());
        // No slot copies, but the byte count handed to C must still be exact.
        assert!(weight_elements("op", 0, 1 << 62, 4).is_err());
    }
}
