//! The whole MoE expert path on the GPU: everything between the router's output and the
//! combined hidden states, forward and backward, with no host sync and no allocation, so that
//! both can be captured once in a CUDA graph and replayed with new routing every step.
//!
//! Forward:  build maps -> permute x -> fc1 grouped GEMM -> SwiGLU -> fc2 grouped GEMM ->
//!           prob-weighted unpermute into y.
//! Backward: unpermute backward (drows, dprobs) -> fc2 dgrad + wgrad -> SwiGLU backward ->
//!           fc1 dgrad + wgrad -> permute backward into dx.
//!
//! Layouts: `x, y, dx [T_max, H]`; `expert_ids, probs [T_max, k]`; fc1 weight `[E, 2F, H]`
//! whose first F output rows are the gate and the next F the up projection (nn.Linear layout:
//! `h = rows · W1ᵀ`, `h[:, :F]` gate, `h[:, F:]` up); fc2 weight `[E, H, F]`. Gradients have the
//! weights' shapes: `dW1 [E, 2F, H]`, `dW2 [E, H, F]`, in the activation dtype, or fp32 main
//! grads (`wgrad_accumulate`: `dW += ...`).
//!
//! Fixed pointers: the plan owns every intermediate buffer (allocated once in
//! [`MoeExperts::new`]); a captured graph also bakes in the addresses of the caller's x,
//! expert_ids, probs, weights, y, dy, dx, dprobs and gradients, so those must stay allocated
//! and unmoved while the graph is replayed: write new inputs into them between replays.
//! T may change per replay when given as [`Tokens::Device`].

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, ValidAsZeroBits};

use crate::dtype::DType;
use crate::grouped_gemm::{GemmOperand, GemmOp, GroupedGemm, GroupedGemmSpec};
use crate::routing::{self, RouteMaps, RoutingConfig, RoutingPlan, Tokens};
use crate::{Error, Result};

/// Shapes and types of one MoE layer's experts, fixed at plan time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// H, the model width.
    pub hidden: usize,
    /// F, each expert's FFN width (fc1 has 2F outputs).
    pub ffn: usize,
    /// k, routes per token.
    pub topk: usize,
    /// T_max: buffers are sized for `T_max · k` routed rows.
    pub max_tokens: usize,
    /// Rows kept in total; `None` = `T_max · k` (nothing is ever dropped). A smaller value
    /// drops deterministically (later experts first) and raises the routing CAPACITY flag.
    pub capacity: Option<usize>,
    /// Activations and weights: `Bf16` or `F16`.
    pub dtype: DType,
    /// probs / dprobs: `F32`, `Bf16` or `F16`.
    pub prob_dtype: DType,
    /// Weight gradients are added into fp32 main-grad buffers instead of written.
    pub wgrad_accumulate: bool,
}

/// The six grouped GEMMs of one layer.
struct Gemms {
    fc1_fprop: GroupedGemm,
    fc2_fprop: GroupedGemm,
    fc2_dgrad: GroupedGemm,
    fc2_wgrad: GroupedGemm,
    fc1_dgrad: GroupedGemm,
    fc1_wgrad: GroupedGemm,
}

impl Gemms {
    fn new(config: &MoeConfig, capacity: usize, stream: &CudaStream) -> Result<Gemms> {
        let (e, h, f) = (config.num_experts, config.hidden, config.ffn);
        let plan = |op: GemmOp, n: usize, k: usize| {
            let mut spec = GroupedGemmSpec::new(op, e, n, k, capacity).with_dtype(config.dtype);
            if op == GemmOp::Wgrad && config.wgrad_accumulate {
                spec.out_dtype = DType::F32;
                spec.accumulate = true;
            }
            GroupedGemm::new(spec, stream)
        };
        Ok(Gemms {
            fc1_fprop: plan(GemmOp::Fprop, 2 * f, h)?,
            fc2_fprop: plan(GemmOp::Fprop, h, f)?,
            fc2_dgrad: plan(GemmOp::Dgrad, h, f)?,
            fc2_wgrad: plan(GemmOp::Wgrad, h, f)?,
            fc1_dgrad: plan(GemmOp::Dgrad, 2 * f, h)?,
            fc1_wgrad: plan(GemmOp::Wgrad, 2 * f, h)?,
        })
    }

    fn all(&self) -> [&GroupedGemm; 6] {
        [&self.fc1_fprop, &self.fc2_fprop, &self.fc2_dgrad, &self.fc2_wgrad, &self.fc1_dgrad, &self.fc1_wgrad]
    }
}

/// Intermediate activations, kept from forward for backward, and backward scratch.
struct Buffers<T> {
    rows: CudaSlice<T>,     // [cap, H]  permuted x
    h: CudaSlice<T>,        // [cap, 2F] fc1 output (gate | up)
    act: CudaSlice<T>,      // [cap, F]  SwiGLU output
    out_rows: CudaSlice<T>, // [cap, H]  fc2 output
    drows: CudaSlice<T>,    // [cap, H]  grad of out_rows
    dact: CudaSlice<T>,     // [cap, F]
    dh: CudaSlice<T>,       // [cap, 2F]
    drows_in: CudaSlice<T>, // [cap, H]  grad of rows
}

/// A MoE layer's expert path with every buffer allocated at plan time.
pub struct MoeExperts<T> {
    config: MoeConfig,
    routing: RoutingPlan,
    gemms: Gemms,
    /// Route maps and the routing flag word (see [`crate::routing::flags`]).
    pub maps: RouteMaps,
    buffers: Buffers<T>,
    /// Grouped GEMM flag word (see [`crate::grouped_gemm::OVERFLOW_CAPACITY`]).
    pub gemm_flags: CudaSlice<i32>,
    /// One workspace shared by the six GEMMs: they run one after another on one stream.
    workspace: CudaSlice<u8>,
}

/// Element types the expert path runs on.
pub trait MoeElement: routing::Element + GemmOperand + ValidAsZeroBits {}
impl MoeElement for half::bf16 {}
impl MoeElement for half::f16 {}

impl<T: MoeElement> MoeExperts<T> {
    /// Validates the configuration on the host, plans the routing and the six GEMMs for the
    /// device of `stream`, and allocates every intermediate buffer (the only allocation).
    pub fn new(config: MoeConfig, stream: &Arc<CudaStream>) -> Result<MoeExperts<T>> {
        if config.dtype != <T as routing::Element>::DTYPE {
            return Err(Error::Shape {
                op: "MoeExperts::new",
                what: "element type",
                expected: format!("{:?}", config.dtype),
                got: format!("{:?}", <T as routing::Element>::DTYPE),
            });
        }
        let routing = RoutingPlan::new(RoutingConfig {
            num_experts: config.num_experts,
            hidden: config.hidden,
            ffn: config.ffn,
            topk: config.topk,
            max_tokens: config.max_tokens,
            capacity: config.capacity,
            expert_capacity: None,
            dtype: config.dtype,
            prob_dtype: config.prob_dtype,
        })?;
        let cap = routing.capacity();
        let gemms = Gemms::new(&config, cap, stream)?;
        let (h, f) = (config.hidden, config.ffn);
        let zeros = |len: usize| stream.alloc_zeros::<T>(len.max(1));
        let buffers = Buffers {
            rows: zeros(cap * h)?,
            h: zeros(cap * 2 * f)?,
            act: zeros(cap * f)?,
            out_rows: zeros(cap * h)?,
            drows: zeros(cap * h)?,
            dact: zeros(cap * f)?,
            dh: zeros(cap * 2 * f)?,
            drows_in: zeros(cap * h)?,
        };
        let workspace_bytes = gemms.all().iter().map(|g| g.workspace_bytes()).max().unwrap_or(0);
        Ok(MoeExperts {
            maps: routing.alloc_maps(stream)?,
            gemm_flags: stream.alloc_zeros(1)?,
            workspace: stream.alloc_zeros(workspace_bytes.max(1))?,
            config,
            routing,
            gemms,
            buffers,
        })
    }

    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    /// Rows of the permuted buffers.
    pub fn capacity(&self) -> usize {
        self.routing.capacity()
    }

    /// `y = Σ_j probs[t, j] · fc2(SwiGLU(fc1(x[t])))` over each token's routed experts.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<P: routing::Element>(
        &mut self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<T>,
        fc2_weight: &impl DevicePtr<T>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let (r, g, b) = (&self.routing, &self.gemms, &mut self.buffers);
        let maps = &mut self.maps;
        r.build(stream, expert_ids, tokens, maps)?;
        r.permute(stream, x, &maps.row_of_route, tokens, &mut b.rows)?;
        let splits = &maps.m_splits_i32;
        let flags = &mut self.gemm_flags;
        let ws = &mut self.workspace;
        g.fc1_fprop.run(stream, &b.rows, fc1_weight, &mut b.h, splits, Some(&mut *flags), ws)?;
        r.swiglu(stream, &b.h, &maps.offsets, &mut b.act)?;
        g.fc2_fprop.run(stream, &b.act, fc2_weight, &mut b.out_rows, splits, Some(&mut *flags), ws)?;
        r.unpermute(stream, &b.out_rows, &maps.row_of_route, probs, tokens, y)
    }

    /// Gradients of [`forward`](Self::forward) (which must have run with the same inputs):
    /// `dx`, `dprobs`, and the weight gradients `dw1 [E, 2F, H]`, `dw2 [E, H, F]` (element
    /// type `T`, or `f32` with `wgrad_accumulate`, which adds into them).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<P: routing::Element, W: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        dy: &impl DevicePtr<T>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<T>,
        fc2_weight: &impl DevicePtr<T>,
        dx: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw1: &mut impl DevicePtrMut<W>,
        dw2: &mut impl DevicePtrMut<W>,
    ) -> Result<()> {
        let (r, g, b) = (&self.routing, &self.gemms, &mut self.buffers);
        let maps = &self.maps;
        let splits = &maps.m_splits_i32;
        let flags = &mut self.gemm_flags;
        let ws = &mut self.workspace;
        r.unpermute_backward(stream, dy, &b.out_rows, &maps.row_of_route, probs, tokens, &mut b.drows, dprobs)?;
        g.fc2_dgrad.run(stream, &b.drows, fc2_weight, &mut b.dact, splits, Some(&mut *flags), ws)?;
        g.fc2_wgrad.run(stream, &b.drows, &b.act, dw2, splits, Some(&mut *flags), ws)?;
        r.swiglu_backward(stream, &b.dact, &b.h, &maps.offsets, &mut b.dh)?;
        g.fc1_dgrad.run(stream, &b.dh, fc1_weight, &mut b.drows_in, splits, Some(&mut *flags), ws)?;
        g.fc1_wgrad.run(stream, &b.dh, &b.rows, dw1, splits, Some(&mut *flags), ws)?;
        r.permute_backward(stream, &b.drows_in, &maps.row_of_route, tokens, dx)
    }
}
