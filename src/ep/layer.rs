//! One expert-parallel MoE layer step on one rank: counts all-gather, (Echo plan + reroute),
//! dispatch, the receive-side expert path, combine, and the backward, all enqueued on the
//! group's stream with fixed sizes (docs/ep.md, "The step").

use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};

use super::group::ensure_outside_nccl_group;
use super::{DispatchLayout, EpConfig, EpGroup, EpKernels};
use crate::device::ensure_same_context;
use crate::dtype::DType;
use crate::echo::{Algorithm, EchoConfig, EchoPlan};
use crate::error::ensure_len;
use crate::graph::{ensure_not_capturing, FlagReport, FlagWords};
use crate::moe::{FusedKernel, MoeConfig, MoeElement, MoeExperts, MoeOptions, WeightForm};
use crate::routing::Tokens;
use crate::{Error, Result};

/// Echo's settings for an EP layer (the planner's [`EchoConfig`] less what the layer knows).
#[derive(Clone, Debug, PartialEq)]
pub struct EpEcho {
    /// Spare slots per rank, `S_per >= 1`.
    pub spare_per_rank: usize,
    pub algorithm: Algorithm,
    /// Reclaim threshold multiplier (spec P3; `Greedy` only, when `> 0`).
    pub threshold_multiplier: f32,
}

/// Shapes of one EP layer, identical on every rank of the group.
#[derive(Clone, Debug, PartialEq)]
pub struct EpMoeConfig {
    /// E home experts over the whole group, a multiple of the group's size.
    pub num_experts: usize,
    /// H, the model width.
    pub hidden: usize,
    /// F, each expert's FFN width (fc1 has 2F outputs).
    pub ffn: usize,
    /// k, routes per token.
    pub topk: usize,
    /// T_max, tokens per rank.
    pub max_tokens: usize,
    /// Rows of one (source rank, destination rank) block, `>= 1`: routes from this rank to
    /// one peer beyond it are dropped and counted (see [`super::balanced_capacity`]).
    pub capacity: usize,
    /// Echo's spare slots; `None` = plain EP.
    pub echo: Option<EpEcho>,
    /// Activations and weights: `Bf16` or `F16`.
    pub dtype: DType,
}

/// What an [`EpMoe`] was built for.
#[derive(Clone, Debug)]
pub struct EpMoeDesc {
    pub config: EpMoeConfig,
    pub ranks: usize,
    pub rank: usize,
    /// The receive side's expert path (`L + S_per` weight slots over `R · capacity` rows).
    pub experts: crate::moe::MoeDesc,
}

/// The caller's weight and main-gradient buffers, as their device addresses, and the pointer
/// tables of the receive side built from them. The tables are allocated once, by the first
/// [`EpMoe::bind_weights`]: a captured graph holds their addresses.
struct BoundWeights {
    /// `None` after a re-bind that failed halfway (the tables may mix old and new addresses).
    addresses: Option<[u64; 4]>,
    w1_ptrs: CudaSlice<u64>,
    w2_ptrs: CudaSlice<u64>,
    dw1_ptrs: CudaSlice<u64>,
    dw2_ptrs: CudaSlice<u64>,
}

/// Echo's per-layer state: the plan, its rerouted routes, and the spare slots' weights and
/// gradients with their fixed-size exchange buffers.
struct EchoState<T> {
    plan: EchoPlan,
    state: CudaSlice<i64>,
    workspace: CudaSlice<i32>,
    dest: CudaSlice<i32>,
    dest_probs: CudaSlice<f32>,
    /// `[S_per, 2F·H]` / `[S_per, H·F]`: this rank's copies of the slots' home experts.
    spare_w1: CudaSlice<T>,
    spare_w2: CudaSlice<T>,
    /// `[R, S_per, per_expert]` home-side send and slot-side receive blocks.
    send_w1: CudaSlice<T>,
    recv_w1: CudaSlice<T>,
    send_w2: CudaSlice<T>,
    recv_w2: CudaSlice<T>,
    /// `[S_per, per_expert]` fp32 gradients of the spare slots, and `[R, S_per, per_expert]`
    /// as received from every peer.
    dw_spare1: CudaSlice<f32>,
    dw_spare2: CudaSlice<f32>,
    recv_dw1: CudaSlice<f32>,
    recv_dw2: CudaSlice<f32>,
}

impl<T> EchoState<T> {
    fn slot_expert(&self) -> CudaView<'_, i64> {
        let begin = self.plan.layout().slot_expert;
        self.state.slice(begin..begin + self.plan.config().num_spare())
    }
}

/// Rows and route tables of one step (all `R · capacity` rows, fixed).
struct StepBuffers<T> {
    counts_local: CudaSlice<i64>,
    counts: CudaSlice<i64>,
    layout: DispatchLayout,
    send_rows: CudaSlice<T>,
    recv_rows: CudaSlice<T>,
    recv_ids: CudaSlice<i32>,
    recv_probs: CudaSlice<f32>,
    out_rows: CudaSlice<T>,
    back_rows: CudaSlice<T>,
    dprobs_rows: CudaSlice<f32>,
    back_dprobs: CudaSlice<f32>,
}

/// One rank's expert-parallel MoE layer. The layers of one model share the rank's group
/// through an `Rc`: an NCCL communicator is driven from one thread, so neither the group nor a
/// layer crosses threads. Every launch runs on the group's stream; nothing
/// allocates or synchronises after [`EpMoe::new`] and [`EpMoe::bind_weights`], so forward
/// and backward can be captured in one graph and replayed with new routing (every rank
/// captures and replays its own graph; NCCL pairs them up).
pub struct EpMoe<T> {
    group: Rc<EpGroup>,
    config: EpMoeConfig,
    kernels: EpKernels,
    experts: MoeExperts<T>,
    echo: Option<EchoState<T>>,
    bufs: StepBuffers<T>,
    bound: Option<BoundWeights>,
    /// The EP flag word (`ep::flags`; sticky: clear it with `memset_zeros` between steps).
    pub flags: CudaSlice<i32>,
}

impl<T: MoeElement> EpMoe<T> {
    /// Validates `config` against the group, plans the receive-side expert path and Echo, and
    /// allocates every buffer (the only allocation of the layer).
    pub fn new(group: Rc<EpGroup>, config: EpMoeConfig) -> Result<EpMoe<T>> {
        const OP: &str = "EpMoe::new";
        let stream = group.stream().clone();
        ensure_not_capturing(&stream, OP)?;
        let element = <T as crate::routing::Element>::DTYPE;
        if config.dtype != element {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("config.dtype is {:?} but the layer's element type is {element:?}", config.dtype),
            });
        }
        if config.capacity == 0 {
            return Err(Error::InvalidArgument { op: OP, why: "capacity must be >= 1 row per peer block".into() });
        }
        let (ranks, rank) = (group.ranks(), group.rank());
        let spare_per_rank = config.echo.as_ref().map_or(0, |e| e.spare_per_rank);
        let kernels = EpKernels::new(EpConfig {
            ranks,
            rank,
            num_experts: config.num_experts,
            spare_per_rank,
            hidden: config.hidden,
            topk: config.topk,
            max_tokens: config.max_tokens,
            capacity: config.capacity,
            dtype: config.dtype,
        })?;
        let ep = kernels.desc().clone();
        let block_rows = ep.block_rows();
        let experts = MoeExperts::with_options(
            MoeConfig {
                num_experts: ep.cols_per_rank(),
                hidden: config.hidden,
                ffn: config.ffn,
                topk: 1,
                max_tokens: block_rows,
                capacity: None,
                expert_capacity: None,
                dtype: config.dtype,
                prob_dtype: DType::F32,
                wgrad_accumulate: true,
            },
            // NOTE: the weights are pointer tables (home columns at the caller's buffers, spare
            // columns at the layer's copies), which only the unfused kernels take: fixed here,
            // so that a later `Auto` that picks fused kernels cannot make this fail.
            MoeOptions {
                weights: WeightForm::Pointers,
                fc1: FusedKernel::Unfused,
                swiglu_dgrad: FusedKernel::Unfused,
                fc1_wgrad: FusedKernel::Unfused,
                prob_in_fc1: FusedKernel::Unfused,
                ..MoeOptions::default()
            },
            &stream,
        )?;
        let echo = match &config.echo {
            None => None,
            Some(settings) => Some(Self::echo_state(&stream, &config, settings, ranks, rank)?),
        };
        let h = config.hidden;
        let routes = config.max_tokens * config.topk;
        let bufs = StepBuffers {
            counts_local: stream.alloc_zeros(config.num_experts)?,
            counts: stream.alloc_zeros(ranks * config.num_experts)?,
            layout: kernels.alloc_layout(&stream)?,
            send_rows: stream.alloc_zeros(block_rows * h)?,
            recv_rows: stream.alloc_zeros(block_rows * h)?,
            recv_ids: stream.alloc_zeros(block_rows)?,
            recv_probs: stream.alloc_zeros(block_rows)?,
            out_rows: stream.alloc_zeros(block_rows * h)?,
            back_rows: stream.alloc_zeros(block_rows * h)?,
            dprobs_rows: stream.alloc_zeros(block_rows)?,
            back_dprobs: stream.alloc_zeros(block_rows)?,
        };
        debug_assert!(routes == 0 || bufs.layout.slot_of_route.len() == routes);
        let flags = stream.alloc_zeros(1)?;
        Ok(EpMoe { group, config, kernels, experts, echo, bufs, bound: None, flags })
    }

    fn echo_state(
        stream: &Arc<CudaStream>,
        config: &EpMoeConfig,
        settings: &EpEcho,
        ranks: usize,
        rank: usize,
    ) -> Result<EchoState<T>> {
        let plan = EchoPlan::new(
            EchoConfig {
                ep: ranks,
                num_experts: config.num_experts,
                spare_per_rank: settings.spare_per_rank,
                ep_rank: rank,
                topk: config.topk,
                algorithm: settings.algorithm,
                threshold_multiplier: settings.threshold_multiplier,
            },
            config.max_tokens,
        )?
        // Each rank's routes kept within the peer blocks wherever a replica has room: the
        // drops the spec's per-rank balance leaves at small blocks (docs/ep.md, "Dropping").
        .with_block_capacity(config.capacity)?;
        let s = settings.spare_per_rank;
        let (w1, w2) = per_expert(config);
        let routes = config.max_tokens * config.topk;
        Ok(EchoState {
            state: stream.alloc_zeros(plan.state_len())?,
            workspace: stream.alloc_zeros(plan.workspace_len().max(1))?,
            dest: stream.alloc_zeros(routes.max(1))?,
            dest_probs: stream.alloc_zeros(routes.max(1))?,
            spare_w1: stream.alloc_zeros(s * w1)?,
            spare_w2: stream.alloc_zeros(s * w2)?,
            send_w1: stream.alloc_zeros(ranks * s * w1)?,
            recv_w1: stream.alloc_zeros(ranks * s * w1)?,
            send_w2: stream.alloc_zeros(ranks * s * w2)?,
            recv_w2: stream.alloc_zeros(ranks * s * w2)?,
            dw_spare1: stream.alloc_zeros(s * w1)?,
            dw_spare2: stream.alloc_zeros(s * w2)?,
            recv_dw1: stream.alloc_zeros(ranks * s * w1)?,
            recv_dw2: stream.alloc_zeros(ranks * s * w2)?,
            plan,
        })
    }

    pub fn desc(&self) -> EpMoeDesc {
        EpMoeDesc {
            config: self.config.clone(),
            ranks: self.group.ranks(),
            rank: self.group.rank(),
            experts: self.experts.desc(),
        }
    }

    pub fn group(&self) -> &Rc<EpGroup> {
        &self.group
    }

    /// The receive side's expert path (its route maps and GEMM flag words, for a
    /// [`crate::graph::FlagReport`]).
    pub fn experts(&self) -> &MoeExperts<T> {
        &self.experts
    }

    /// Binds this rank's home weights `w1 [L, 2F, H]`, `w2 [L, H, F]` and fp32 main grads
    /// `dw1`, `dw2` of the same shapes: writes the receive side's pointer tables (home
    /// columns at these buffers, spare columns at the layer's spare copies). Needs the host
    /// (not while capturing). Forward and backward then take the same buffers again and
    /// refuse others; the buffers must stay alive and unmoved while the layer or a graph of
    /// it runs.
    ///
    /// Binding again (other buffers) writes the new addresses into the same tables, in the
    /// order of the group's stream, and waits for it: work enqueued before the call (a graph
    /// launch included) has read the old addresses, later work reads the new ones. A graph
    /// captured before then runs its expert GEMMs on the new weights and grads without being
    /// captured again. Exception, Echo: its spare-weight pack reads `w1`, `w2` and its
    /// gradient fold writes `dw1`, `dw2` at the addresses given at capture, so with Echo a
    /// graph captured before a re-bind must be captured again (and is unsafe to launch once
    /// the old buffers are freed).
    pub fn bind_weights(
        &mut self,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
        dw1: &CudaSlice<f32>,
        dw2: &CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "EpMoe::bind_weights";
        let stream = self.group.stream().clone();
        ensure_not_capturing(&stream, OP)?;
        let l = self.kernels.desc().local_experts();
        let (p1, p2) = per_expert(&self.config);
        ensure_len(OP, "w1 [L, 2F, H]", w1.len(), l * p1, "")?;
        ensure_len(OP, "w2 [L, H, F]", w2.len(), l * p2, "")?;
        ensure_len(OP, "dw1 [L, 2F, H]", dw1.len(), l * p1, "")?;
        ensure_len(OP, "dw2 [L, H, F]", dw2.len(), l * p2, "")?;
        ensure_same_context(OP, "w1", &stream, w1)?;
        ensure_same_context(OP, "w2", &stream, w2)?;
        ensure_same_context(OP, "dw1", &stream, dw1)?;
        ensure_same_context(OP, "dw2", &stream, dw2)?;
        let addresses = [address(&stream, w1), address(&stream, w2), address(&stream, dw1), address(&stream, dw2)];
        let elem = std::mem::size_of::<T>();
        let (spare1, spare2, dspare1, dspare2) = match &self.echo {
            Some(e) => (
                address(&stream, &e.spare_w1),
                address(&stream, &e.spare_w2),
                address(&stream, &e.dw_spare1),
                address(&stream, &e.dw_spare2),
            ),
            None => (0, 0, 0, 0),
        };
        let spare = self.kernels.desc().spare_per_rank;
        let table = |home: u64, spare_base: u64, bytes: usize| slot_table(l, spare, home, spare_base, bytes);
        let tables = [
            table(addresses[0], spare1, p1 * elem),
            table(addresses[1], spare2, p2 * elem),
            table(addresses[2], dspare1, p1 * 4),
            table(addresses[3], dspare2, p2 * 4),
        ];
        let bound = match &mut self.bound {
            Some(bound) => bound,
            None => {
                let table = || stream.alloc_zeros::<u64>(l + spare);
                self.bound.insert(BoundWeights {
                    addresses: None,
                    w1_ptrs: table()?,
                    w2_ptrs: table()?,
                    dw1_ptrs: table()?,
                    dw2_ptrs: table()?,
                })
            }
        };
        // NOTE: never reallocated: a graph captured earlier reads these very tables (F4 of the
        // EP review). The copies are ordered on the group's stream after every launch made
        // so far; the sync lets the host tables go and makes the new binding final.
        bound.addresses = None;
        stream.memcpy_htod(&tables[0], &mut bound.w1_ptrs)?;
        stream.memcpy_htod(&tables[1], &mut bound.w2_ptrs)?;
        stream.memcpy_htod(&tables[2], &mut bound.dw1_ptrs)?;
        stream.memcpy_htod(&tables[3], &mut bound.dw2_ptrs)?;
        stream.synchronize()?;
        bound.addresses = Some(addresses);
        Ok(())
    }

    /// `w1`, `w2` (and the main grads, when given) must be the buffers bound by
    /// [`bind_weights`](Self::bind_weights): the receive side's pointer tables hold their
    /// addresses.
    fn ensure_bound(
        &self,
        op: &'static str,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
        grads: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
    ) -> Result<()> {
        let addresses = self.bound.as_ref().and_then(|b| b.addresses).ok_or_else(|| Error::InvalidArgument {
            op,
            why: "no weights bound (or the last EpMoe::bind_weights failed): call bind_weights first".into(),
        })?;
        let stream = self.group.stream();
        let mut given = vec![("w1", address(stream, w1)), ("w2", address(stream, w2))];
        if let Some((dw1, dw2)) = grads {
            given.extend([("dw1", address(stream, dw1)), ("dw2", address(stream, dw2))]);
        }
        for ((name, got), want) in given.into_iter().zip(addresses) {
            if got != want {
                return Err(Error::InvalidArgument {
                    op,
                    why: format!(
                        "{name} at {got:#x} is not the buffer bound by bind_weights ({want:#x}): pass the bound buffers, or bind the new ones first (see bind_weights on graphs captured before a re-bind)"
                    ),
                });
            }
        }
        Ok(())
    }

    /// `y[t] = Σ_j probs[t, j] · expert_{ids[t, j]}(x[t])` with the experts spread over the
    /// group: `x, y [T_max, H]`, `expert_ids [T_max, k]` (global home experts; -1 = no route
    /// in plain EP, while Echo's top-k planner expects k real routes per token and flags a -1
    /// as `CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE`, dropping that route), `probs [T_max, k]` f32,
    /// `w1`, `w2` the buffers given to [`bind_weights`](Self::bind_weights). Routes past a
    /// full peer block are dropped (counted in [`Self::dispatch_layout`]'s `dropped`, flag
    /// `OVERFLOW`). The three stages, [`dispatch`](Self::dispatch),
    /// [`run_experts`](Self::run_experts) and [`combine`](Self::combine), in one call.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        x: &impl DevicePtr<T>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<f32>,
        tokens: Tokens<'_>,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.dispatch(x, expert_ids, probs, tokens, w1, w2)?;
        self.run_experts(w1, w2)?;
        self.combine(tokens, y)
    }

    /// Forward stage 1: (Echo: counts all-gather, plan + reroute, spare weights fetched from
    /// their home ranks), the dispatch layout, and one grouped exchange of every peer block's
    /// rows, local columns and probs. Leaves the received blocks in the layer.
    pub fn dispatch(
        &mut self,
        x: &impl DevicePtr<T>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<f32>,
        tokens: Tokens<'_>,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
    ) -> Result<()> {
        const OP: &str = "EpMoe::dispatch";
        ensure_outside_nccl_group(OP)?;
        let stream = self.group.stream().clone();
        self.ensure_bound(OP, w1, w2, None)?;
        let routes = self.config.max_tokens * self.config.topk;
        ensure_len(OP, "x [T_max, H]", x.len(), self.config.max_tokens * self.config.hidden, "")?;
        ensure_len(OP, "expert_ids [T_max, k]", expert_ids.len(), routes, "")?;
        ensure_len(OP, "probs [T_max, k]", probs.len(), routes, "")?;
        ensure_same_context(OP, "x", &stream, x)?;
        ensure_same_context(OP, "expert_ids", &stream, expert_ids)?;
        ensure_same_context(OP, "probs", &stream, probs)?;

        let k = &self.kernels;
        let b = &mut self.bufs;
        match &mut self.echo {
            None => k.dispatch_layout(&stream, expert_ids, probs, tokens, &mut b.layout, &mut self.flags)?,
            Some(e) => {
                // Every rank plans from the same all-gathered counts (spec section 1).
                k.count_routes(&stream, expert_ids, tokens, &mut b.counts_local, &mut self.flags)?;
                self.group.all_gather(&stream, &b.counts_local, &mut b.counts, self.config.num_experts)?;
                e.plan.plan_reroute_topk(
                    &stream,
                    &b.counts,
                    expert_ids,
                    probs,
                    tokens,
                    &mut e.state,
                    &mut e.workspace,
                    &mut e.dest,
                    &mut e.dest_probs,
                )?;
                k.dispatch_layout(&stream, &e.dest, &e.dest_probs, tokens, &mut b.layout, &mut self.flags)?;
                Self::fetch_spare_weights(&self.group, k, e, w1, w2, &mut self.flags)?;
            }
        }
        k.gather_rows(&stream, x, &b.layout.slot_of_route, tokens, &mut b.send_rows)?;
        let (block, h) = (self.config.capacity, self.config.hidden);
        let g = &self.group;
        g.exchange_many(
            &stream,
            &[
                g.blocks(&b.send_rows, &mut b.recv_rows, block * h)?,
                g.blocks(&b.layout.send_ids, &mut b.recv_ids, block)?,
                g.blocks(&b.layout.send_probs, &mut b.recv_probs, block)?,
            ],
        )
    }

    /// Forward stage 2: the receive side's expert path over the `R · capacity` received rows
    /// (home columns on this rank's weights, spare columns on the fetched copies); its output
    /// rows are already prob-weighted, unused rows 0.
    pub fn run_experts(&mut self, w1: &CudaSlice<T>, w2: &CudaSlice<T>) -> Result<()> {
        const OP: &str = "EpMoe::run_experts";
        let stream = self.group.stream().clone();
        self.ensure_bound(OP, w1, w2, None)?;
        let bound = self.bound.as_ref().expect("checked above");
        let b = &mut self.bufs;
        self.experts.forward(
            &stream,
            &b.recv_rows,
            &b.recv_ids,
            &b.recv_probs,
            Tokens::Host(self.kernels.desc().block_rows()),
            &bound.w1_ptrs,
            &bound.w2_ptrs,
            &mut b.out_rows,
        )
    }

    /// Forward stage 3: the output rows go back to the ranks they came from, and
    /// `y[t] = Σ_j` of the token's returned rows (fp32, ascending j, one rounding).
    pub fn combine(&mut self, tokens: Tokens<'_>, y: &mut impl DevicePtrMut<T>) -> Result<()> {
        const OP: &str = "EpMoe::combine";
        ensure_outside_nccl_group(OP)?;
        let stream = self.group.stream().clone();
        ensure_len(OP, "y [T_max, H]", y.len(), self.config.max_tokens * self.config.hidden, "")?;
        ensure_same_context(OP, "y", &stream, y)?;
        let b = &mut self.bufs;
        self.group.exchange(&stream, &b.out_rows, &mut b.back_rows, self.config.capacity * self.config.hidden)?;
        self.kernels.reduce_rows(&stream, &b.back_rows, &b.layout.slot_of_route, tokens, y)
    }

    /// Echo: every home rank packs the experts its peers' slots copy, one fixed-size grouped
    /// exchange, and every rank keeps the blocks of its own slots.
    fn fetch_spare_weights(
        group: &EpGroup,
        k: &EpKernels,
        e: &mut EchoState<T>,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
        flags: &mut CudaSlice<i32>,
    ) -> Result<()> {
        let stream = group.stream();
        let s_per = e.plan.config().spare_per_rank;
        let (p1, p2) = (e.spare_w1.len() / s_per, e.spare_w2.len() / s_per);
        let (begin, slots) = (e.plan.layout().slot_expert, e.plan.config().num_spare());
        let slot_expert = e.state.slice(begin..begin + slots);
        k.pack_spare_weights(stream, &slot_expert, w1, p1, &mut e.send_w1, flags)?;
        k.pack_spare_weights(stream, &slot_expert, w2, p2, &mut e.send_w2, flags)?;
        group.exchange_many(
            stream,
            &[
                group.blocks(&e.send_w1, &mut e.recv_w1, s_per * p1)?,
                group.blocks(&e.send_w2, &mut e.recv_w2, s_per * p2)?,
            ],
        )?;
        k.select_spare_weights(stream, &slot_expert, &e.recv_w1, p1, &mut e.spare_w1, flags)?;
        k.select_spare_weights(stream, &slot_expert, &e.recv_w2, p2, &mut e.spare_w2, flags)
    }

    /// Gradients of the last [`forward`](Self::forward) (same inputs): `dx [T_max, H]`,
    /// `dprobs [T_max, k]` f32 (0 for dropped routes), and the home experts' weight gradients
    /// added into the fp32 main grads bound by [`bind_weights`](Self::bind_weights) (spare
    /// slots' gradients are returned to their home ranks and folded in, ascending slot order).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        dy: &impl DevicePtr<T>,
        tokens: Tokens<'_>,
        w1: &CudaSlice<T>,
        w2: &CudaSlice<T>,
        dx: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<f32>,
        dw1: &mut CudaSlice<f32>,
        dw2: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "EpMoe::backward";
        ensure_outside_nccl_group(OP)?;
        let stream = self.group.stream().clone();
        self.ensure_bound(OP, w1, w2, Some((dw1, dw2)))?;
        let (t, hd) = (self.config.max_tokens, self.config.hidden);
        ensure_len(OP, "dy [T_max, H]", dy.len(), t * hd, "")?;
        ensure_len(OP, "dx [T_max, H]", dx.len(), t * hd, "")?;
        ensure_len(OP, "dprobs [T_max, k]", dprobs.len(), t * self.config.topk, "")?;
        ensure_same_context(OP, "dy", &stream, dy)?;
        ensure_same_context(OP, "dx", &stream, dx)?;
        ensure_same_context(OP, "dprobs", &stream, dprobs)?;

        let k = &self.kernels;
        let b = &mut self.bufs;
        let block = self.config.capacity;
        k.gather_rows(&stream, dy, &b.layout.slot_of_route, tokens, &mut b.send_rows)?;
        // The received dy lands in back_rows (free until the dx rows come back below), so
        // recv_rows still holds the forward's received x, which the experts' backward takes.
        self.group.exchange(&stream, &b.send_rows, &mut b.back_rows, block * hd)?;
        if let Some(e) = &mut self.echo {
            stream.memset_zeros(&mut e.dw_spare1)?;
            stream.memset_zeros(&mut e.dw_spare2)?;
        }
        let bound = self.bound.as_mut().expect("checked above");
        let rows = Tokens::Host(k.desc().block_rows());
        // The receive side's dW tables point at dw1 / dw2 (home columns) and at the spare
        // slots' gradients (spare columns).
        self.experts.backward(
            &stream,
            &b.recv_rows,
            &b.back_rows,
            &b.recv_probs,
            rows,
            &bound.w1_ptrs,
            &bound.w2_ptrs,
            &mut b.out_rows,
            &mut b.dprobs_rows,
            &mut bound.dw1_ptrs,
            &mut bound.dw2_ptrs,
        )?;
        let g = &self.group;
        g.exchange_many(
            &stream,
            &[
                g.blocks(&b.out_rows, &mut b.back_rows, block * hd)?,
                g.blocks(&b.dprobs_rows, &mut b.back_dprobs, block)?,
            ],
        )?;
        k.reduce_rows(&stream, &b.back_rows, &b.layout.slot_of_route, tokens, dx)?;
        k.gather_route_values(&stream, &b.back_dprobs, &b.layout.slot_of_route, tokens, dprobs)?;
        if let Some(e) = &mut self.echo {
            let s_per = e.plan.config().spare_per_rank;
            let p1 = e.dw_spare1.len() / s_per;
            let p2 = e.dw_spare2.len() / s_per;
            self.group.broadcast_block(&stream, &e.dw_spare1, &mut e.recv_dw1, s_per * p1)?;
            self.group.broadcast_block(&stream, &e.dw_spare2, &mut e.recv_dw2, s_per * p2)?;
            let slot_expert = e.slot_expert();
            k.fold_spare_grads(&stream, &slot_expert, &e.recv_dw1, p1, dw1, &mut self.flags)?;
            k.fold_spare_grads(&stream, &slot_expert, &e.recv_dw2, p2, dw2, &mut self.flags)?;
        }
        Ok(())
    }

    /// The dispatch layout of the last forward (slot of every route, per-peer rows and drops).
    pub fn dispatch_layout(&self) -> &DispatchLayout {
        &self.bufs.layout
    }

    /// `counts [R, E]` as all-gathered by the last forward (Echo only: plain EP needs no counts).
    pub fn counts(&self) -> &CudaSlice<i64> {
        &self.bufs.counts
    }

    /// Every flag word of the layer after a step or a replay, named: the EP word, Echo's
    /// error word, and the receive side's routing and grouped GEMM words (a host read: a sync;
    /// the words are sticky, clear them to see one step's bits).
    pub fn read_flags(&self) -> Result<FlagReport> {
        let words = FlagWords {
            routing: Some(self.experts.maps.flags.as_view()),
            grouped_gemm: Some(self.experts.gemm_flags.as_view()),
            echo: self.echo.as_ref().map(|e| {
                let at = e.plan.layout().error;
                e.state.slice(at..at + 1)
            }),
            ep: Some(self.flags.as_view()),
        };
        FlagReport::read(self.group.stream(), words)
    }

    /// Routes dropped by the last forward, per destination rank (a host read: a sync).
    pub fn read_dropped(&self) -> Result<Vec<i32>> {
        let stream = self.group.stream();
        ensure_not_capturing(stream, "EpMoe::read_dropped")?;
        Ok(stream.clone_dtoh(&self.bufs.layout.dropped)?)
    }
}

/// Elements of one expert's fc1 (`2F·H`) and fc2 (`H·F`) matrix.
fn per_expert(config: &EpMoeConfig) -> (usize, usize) {
    (2 * config.ffn * config.hidden, config.hidden * config.ffn)
}

/// The receive side's `L + S_per` addresses: local column `c < L` at `home + c · bytes`, spare
/// column `L + s` at `spare + s · bytes`.
fn slot_table(local: usize, spare: usize, home: u64, spare_base: u64, bytes: usize) -> Vec<u64> {
    let bytes = bytes as u64;
    (0..local as u64).map(|c| home + c * bytes).chain((0..spare as u64).map(|s| spare_base + s * bytes)).collect()
}

fn address<T>(stream: &CudaStream, buffer: &impl DevicePtr<T>) -> u64 {
    let (ptr, _guard) = buffer.device_ptr(stream);
    ptr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_table_puts_home_columns_first() {
        let t = slot_table(3, 2, 1000, 5000, 16);
        assert_eq!(t, vec![1000, 1016, 1032, 5000, 5016]);
    }
}
