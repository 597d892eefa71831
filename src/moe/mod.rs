//! The whole MoE expert path on the GPU: everything between the router's output and the
//! combined hidden states, forward and backward, with no host sync and no allocation, so that
//! both can be captured once in a CUDA graph and replayed with new routing every step.
//!
//! Forward:  build maps -> permute x -> fc1 grouped GEMM -> SwiGLU -> fc2 grouped GEMM ->
//!           prob-weighted unpermute into y. Where it applies ([`MoeOptions::fc1`]), permute ->
//!           fc1 -> SwiGLU is one fused kernel reading x directly (same bits; a forward-only
//!           plan then writes no permuted copy of x, a training plan's fused fc1 writes it for
//!           fc1's wgrad and runs no permute pass).
//! Backward: unpermute backward (drows, dprobs) -> fc2 dgrad + wgrad -> SwiGLU backward ->
//!           fc1 dgrad + wgrad -> permute backward into dx. Where it applies
//!           ([`MoeOptions::swiglu_dgrad`]), fc2 dgrad -> SwiGLU backward is one fused kernel
//!           (dh straight from drows, within the fp64 reference's tolerance of the unfused
//!           path, not necessarily bit-equal to it), and ([`MoeOptions::fc1_wgrad`]) fc1's
//!           wgrad reads x's rows through the routing map instead of a permuted copy. With the
//!           fused fc1 and the grouped GEMM's fc1 wgrad, the fused fc1 writes the permuted
//!           rows that wgrad reads from the stages it gathered (sm_90a); where its kernel
//!           cannot (sm_100a), the backward permutes x right before that wgrad.
//! With the probability in fc1 ([`MoeOptions::prob_in_fc1`], on the fused kernels): the fused
//! fc1 writes `act = p · SwiGLU(h)`, and the combine is an unweighted gather-sum; the backward
//! starts at the fused fc2 dgrad gathering dy itself (its epilogue applies p and writes the
//! dprob partials, summed per route after it) and fc2's wgrad reads dy gathered: no drows, and
//! no fc2 output rows kept for dprobs.
//!
//! Layouts: `x, y, dx [T_max, H]`; `expert_ids, probs, dprobs [T_max, k]`; fc1 weight
//! `[E, 2F, H]` whose first F output rows are the gate and the next F the up projection
//! (nn.Linear layout: `h = rows · W1ᵀ`, `h[:, :F]` gate, `h[:, F:]` up); fc2 weight `[E, H, F]`.
//! Gradients have the weights' shapes: `dW1 [E, 2F, H]`, `dW2 [E, H, F]`, in the activation
//! dtype, or fp32 main grads (`wgrad_accumulate`: `dW += ...`).
//!
//! Weight forms ([`WeightForm`], fixed at plan time by [`MoeOptions`]):
//! * `Tensor` (the default): fc1, fc2, dW1, dW2 are each one `[E, ...]` tensor as above.
//! * `Pointers`: each of the four is a device array of `num_experts` u64 addresses; entry `e`
//!   points at expert `e`'s packed matrix (fc1 / dW1 `[2F, H]`, fc2 / dW2 `[H, F]`, of the
//!   activation dtype, dW1 / dW2 fp32 with `wgrad_accumulate`), 16-byte aligned (a misaligned
//!   or null entry skips that expert and raises
//!   [`crate::grouped_gemm::OVERFLOW_MISALIGNED_POINTER`] / `OVERFLOW_NULL_POINTER` in
//!   `gemm_flags`). `num_experts` then counts weight slots, e.g. Echo's `E + S` columns,
//!   whose spare slots hold copies of home experts and write their gradients into separate
//!   fp32 buffers that [`crate::echo::fold_spare_grads`] adds into the home experts (that
//!   fold takes fp32 gradients only, so an Echo plan needs `wgrad_accumulate`)
//!   ([`echo_slot_pointers`] builds such tables; README "Echo with the expert path").
//!   The arrays are read on the device at every launch, so their contents may change between
//!   graph replays; the matrices they point at must be live whenever a launch or replay runs.
//!
//! Routing forms: top-k (`expert_ids` + `probs`, [`MoeExperts::forward`]) and Megatron's
//! routing map `[T_max, E]` + probs `[T_max, E]` ([`MoeExperts::forward_from_map`], converted on
//! the GPU into the plan's own `[T_max, k]` buffers).
//!
//! Fixed pointers: the plan owns every intermediate buffer (allocated once in
//! [`MoeExperts::new`]); a captured graph also bakes in the addresses of the caller's x,
//! expert_ids / routing map, probs, weights (tensors or pointer arrays), y, dy, dx, dprobs and
//! gradients, so those must stay allocated and unmoved while the graph is replayed: write new
//! inputs into them between replays. T may change per replay when given as
//! [`Tokens::Device`].

mod fused;
mod slots;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, ValidAsZeroBits};

pub use fused::FusedKernel;
pub(crate) use slots::expert_matrix_bytes;
pub use slots::{echo_slot_pointers, echo_slot_table};

use crate::device::{ensure_aligned16, ensure_bound_stream, ensure_same_context};
use crate::dtype::DType;
use crate::error::ensure_len;
use crate::graph::{ensure_not_capturing, DeviceBuffer, PoolRange, Scratch};
use crate::grouped_gemm::{GemmConfig, GemmOp, GemmOperand, GroupedGemm, GroupedGemmSpec};
use crate::routing::{self, RouteMaps, RoutingConfig, RoutingPlan, Tokens};
use crate::{Error, Result};

/// Shapes and types of one MoE layer's experts, fixed at plan time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// E: experts, or weight slots with [`WeightForm::Pointers`] (e.g. Echo's `E + S`).
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
    /// Rows one expert may keep (its first routes in `t * k + j` order); `None` = no
    /// per-expert limit. Applied before `capacity`; drops raise the routing CAPACITY flag.
    pub expert_capacity: Option<usize>,
    /// Activations and weights: `Bf16` or `F16`.
    pub dtype: DType,
    /// probs / dprobs: `F32`, `Bf16` or `F16`.
    pub prob_dtype: DType,
    /// Weight gradients are added into fp32 main-grad buffers instead of written.
    pub wgrad_accumulate: bool,
}

impl MoeConfig {
    /// The routing plan's configuration for this layer.
    pub fn routing_config(&self) -> RoutingConfig {
        RoutingConfig {
            num_experts: self.num_experts,
            hidden: self.hidden,
            ffn: self.ffn,
            topk: self.topk,
            max_tokens: self.max_tokens,
            capacity: self.capacity,
            expert_capacity: self.expert_capacity,
            dtype: self.dtype,
            prob_dtype: self.prob_dtype,
        }
    }
}

/// How fc1 / fc2 weights and their gradients dW1 / dW2 are handed to the expert path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightForm {
    /// One tensor each: `[E, 2F, H]` and `[E, H, F]`.
    #[default]
    Tensor,
    /// A device array of `num_experts` u64 matrix addresses each (module docs).
    Pointers,
}

/// Plan-time choices beyond the layer's shapes. `MoeOptions::default()` is what
/// [`MoeExperts::new`] uses: tensor weights, `GemmConfig::Auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeOptions {
    pub weights: WeightForm,
    /// Kernel of the four row-wise GEMMs (fc1 / fc2 fprop and dgrad). `Auto` applies the grouped
    /// GEMM heuristic, which looks at `capacity / num_experts`, so two plans with different
    /// `num_experts` may pick different kernels, and so may the two [`WeightForm`]s (the
    /// `Sm90Counter` kernel takes one weight tensor, not a pointer array); force one to make
    /// them run the same kernel (then each row's result is bitwise the same in both).
    pub gemm_config: GemmConfig,
    /// Kernel of the two wgrad GEMMs. `Auto`: on SM90 the counter kernel (`Sm90Counter`) for a
    /// 16-bit dW in one tensor, the clustered cooperative (`Sm90Cooperative`) for an fp32 dW
    /// (`wgrad_accumulate`) or a pointer array; force `Sm90Cooperative` to make the two
    /// [`WeightForm`]s run the same wgrad kernel.
    pub wgrad_config: GemmConfig,
    /// fc1 of the forward: fused (gather + GEMM + SwiGLU in one kernel) or not; see
    /// [`FusedKernel`]. Both give the same bits.
    pub fc1: FusedKernel,
    /// fc2 dgrad + SwiGLU backward of the backward: fused (the SwiGLU backward in the GEMM's
    /// epilogue) or not; see [`FusedKernel`]. Ignored by `forward_only` plans. Both agree
    /// within rounding (the same bits where the two GEMMs sum in the same order).
    pub swiglu_dgrad: FusedKernel,
    /// fc1's weight gradient of the backward: gathered (dW1 = dhᵀ · x[token of each row], one
    /// kernel reading x through the routing map) or the grouped GEMM's WGRAD over permuted rows
    /// (those the unfused fc1's forward kept, or, after the fused fc1, a permute of x the
    /// backward runs right before it). Gathered needs [`WeightForm::Tensor`]; together with a
    /// fused fc1 no permuted copy of x is written at all (and the plan allocates none).
    /// Ignored by `forward_only` plans. Within rounding of the unfused path.
    pub fc1_wgrad: FusedKernel,
    /// Where each route's probability is applied. `Fused`: in the fused fc1's epilogue,
    /// `act = p · SwiGLU(h)` (SonicMoE's form), so fc2's output rows come out weighted and the
    /// combine over k is an unweighted gather-sum. The backward then needs neither a `drows`
    /// buffer nor the fc2 output rows: the fused fc2 dgrad gathers `dy` itself and makes
    /// dprobs in its epilogue, and fc2's wgrad reads `dy` through the routing map. Needs the
    /// fused fc1 (`fc1 = Fused`, or `Auto` where Auto takes it: [`FusedKernel::Auto`] says
    /// where) and, unless `forward_only`, `swiglu_dgrad = Fused`
    /// (else [`Error::InvalidArgument`]). `Auto` / `Unfused`: the probability is applied in the
    /// combine. The two agree within rounding: act is rounded once after the product, and fc2
    /// sums weighted terms.
    pub prob_in_fc1: FusedKernel,
    /// The plan never runs backward: a fused fc1 then writes act alone, not the pre-activation h
    /// (the backward would need it), and `backward` is an error.
    pub forward_only: bool,
}

impl Default for MoeOptions {
    fn default() -> Self {
        MoeOptions {
            weights: WeightForm::Tensor,
            gemm_config: GemmConfig::Auto,
            wgrad_config: GemmConfig::Auto,
            fc1: FusedKernel::Auto,
            swiglu_dgrad: FusedKernel::Auto,
            fc1_wgrad: FusedKernel::Auto,
            prob_in_fc1: FusedKernel::Auto,
            forward_only: false,
        }
    }
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
    fn new(config: &MoeConfig, options: &MoeOptions, capacity: usize, stream: &CudaStream) -> Result<Gemms> {
        let (e, h, f) = (config.num_experts, config.hidden, config.ffn);
        let plan = |op: GemmOp, n: usize, k: usize| {
            let mut spec = GroupedGemmSpec::new(op, e, n, k, capacity).with_dtype(config.dtype);
            spec.weights_as_pointers = options.weights == WeightForm::Pointers;
            if op == GemmOp::Wgrad {
                spec.config = options.wgrad_config;
                if config.wgrad_accumulate {
                    spec.out_dtype = DType::F32;
                    spec.accumulate = true;
                }
            } else {
                spec.config = options.gemm_config;
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
/// Every byte a launch reads of them was written earlier in the same forward + backward, so
/// they may live in a [`MemoryPool`](crate::graph::MemoryPool) range ([`MoeExperts::with_pool`]).
struct Buffers<T> {
    rows: DeviceBuffer<T>,     // [cap, H]  permuted x (empty when no kernel reads it; see PermutePass)
    h: DeviceBuffer<T>,        // [cap, 2F] fc1 output (gate | up)
    act: DeviceBuffer<T>,      // [cap, F]  SwiGLU output
    out_rows: DeviceBuffer<T>, // [cap, H]  fc2 output
    drows: DeviceBuffer<T>,    // [cap, H]  grad of out_rows, then of rows (one element with prob_in_fc1)
    dact: DeviceBuffer<T>,     // [cap, F]  (one element when the fused backward skips it)
    dh: DeviceBuffer<T>,       // [cap, 2F]
    prob_of_row: DeviceBuffer<f32>, // [cap]         with prob_in_fc1, else one element
    dprob_partials: DeviceBuffer<f32>, // [cap, F/128]  with prob_in_fc1, else one element
}

/// Which kernels a plan runs, as far as its buffer sizes depend on them.
#[derive(Clone, Copy, Debug)]
struct PathShape {
    forward_only: bool,
    fused_fc1: bool,
    /// Some kernel reads the permuted copy of x (the unfused fc1, or the unfused fc1 wgrad).
    permutes: bool,
    prob_in_fc1: bool,
    /// `Some(column slices)` when the fused fc2 dgrad + SwiGLU backward runs.
    fused_swiglu_dgrad: Option<usize>,
}

impl PathShape {
    fn of(fused: &fused::FusedPlans, forward_only: bool) -> PathShape {
        PathShape {
            forward_only,
            fused_fc1: fused.fc1.is_some(),
            permutes: fused.permute_pass(forward_only).is_some(),
            prob_in_fc1: fused.prob_in_fc1,
            fused_swiglu_dgrad: fused.swiglu_dgrad.as_ref().map(|d| d.dprob_slices()),
        }
    }
}

/// Element counts of [`Buffers`]; 0 where the plan never touches a buffer (the allocation
/// then holds one element).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BufferLens {
    rows: usize,
    h: usize,
    act: usize,
    out_rows: usize,
    drows: usize,
    dact: usize,
    dh: usize,
    prob_of_row: usize,
    dprob_partials: usize,
}

impl BufferLens {
    fn of(cap: usize, hidden: usize, ffn: usize, shape: &PathShape) -> BufferLens {
        let backward = !shape.forward_only;
        let only_if = |needed: bool, len: usize| if needed { len } else { 0 };
        // The fused fc1 of a forward-only plan writes act alone: h is kept only for backward.
        let h_needed = backward || !shape.fused_fc1;
        // fc1's dgrad writes the gradient of its input rows into a dead [cap, H] buffer: drows
        // (read last by fc2's dgrad and wgrad, which run before it) or, with the probability in
        // fc1, where the backward writes no drows, out_rows (read last by the forward's combine).
        let row_grads = backward && !shape.prob_in_fc1;
        let dprob_partials = match shape.fused_swiglu_dgrad {
            Some(slices) if shape.prob_in_fc1 && backward => cap * slices,
            _ => 0,
        };
        BufferLens {
            rows: only_if(shape.permutes, cap * hidden),
            h: only_if(h_needed, cap * 2 * ffn),
            act: cap * ffn,
            out_rows: cap * hidden,
            drows: only_if(row_grads, cap * hidden),
            // The fused fc2 dgrad + SwiGLU backward never writes dact.
            dact: only_if(backward && shape.fused_swiglu_dgrad.is_none(), cap * ffn),
            dh: only_if(backward, cap * 2 * ffn),
            prob_of_row: only_if(shape.prob_in_fc1, cap),
            dprob_partials,
        }
    }
}

/// The routing plan, GEMMs, intermediates and GEMM workspace: everything forward and backward
/// need besides the route maps and flag words (public fields of [`MoeExperts`]).
struct Path<T> {
    routing: RoutingPlan,
    /// The fused kernels the plan runs (module `fused`).
    fused: fused::FusedPlans,
    forward_only: bool,
    gemms: Gemms,
    buffers: Buffers<T>,
    /// One workspace shared by the six GEMMs: they run one after another on one stream.
    workspace: CudaSlice<u8>,
}

/// The `[T_max, k]` routes [`MoeExperts::forward_from_map`] converts the Megatron form into.
struct MapRoutes {
    ids: CudaSlice<i32>,
    /// `T_max · k` probs of the plan's prob dtype (at most 4 bytes each), as fp32-sized storage.
    probs: CudaSlice<f32>,
}

/// What a [`MoeExperts`] was built for ([`MoeExperts::desc`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeDesc {
    pub config: MoeConfig,
    pub options: MoeOptions,
    /// Rows of the permuted buffers (`config.capacity`, or `T_max · k`).
    pub capacity: usize,
    /// The GEMM kernels as resolved, as [`MoeExperts::gemm_configs`].
    pub gemm_configs: [GemmConfig; 6],
    /// The stream the plan is bound to, as its driver handle (`CUstream`, an address).
    pub stream: u64,
}

/// A MoE layer's expert path with every buffer allocated at plan time.
///
/// The plan is bound to the stream it was made on: its intermediates, maps, flag words and
/// the GEMM workspace are reused by every launch (backward reads what forward left), so a
/// launch on another stream could overlap one still running and race on them. Every launcher
/// therefore takes that stream again and returns [`Error::WrongStream`] for any other,
/// before anything is launched. Use one plan per stream.
pub struct MoeExperts<T> {
    config: MoeConfig,
    options: MoeOptions,
    /// The bound stream (see the type's docs).
    stream: Arc<CudaStream>,
    path: Path<T>,
    map_routes: MapRoutes,
    /// Route maps and the routing flag word (see [`crate::routing::flags`]).
    pub maps: RouteMaps,
    /// Grouped GEMM flag word (see [`crate::grouped_gemm::OVERFLOW_CAPACITY`]).
    pub gemm_flags: CudaSlice<i32>,
}

/// Element types the expert path runs on.
pub trait MoeElement: routing::Element + GemmOperand + ValidAsZeroBits {}
impl MoeElement for half::bf16 {}
impl MoeElement for half::f16 {}

fn ensure_tokens_context(op: &'static str, stream: &CudaStream, tokens: Tokens<'_>) -> Result<()> {
    match tokens {
        Tokens::Host(_) => Ok(()),
        Tokens::Device(count) => ensure_same_context(op, "num_tokens_device", stream, count),
    }
}

/// The contexts and 16-byte alignment of the buffers every forward form shares (its routing
/// inputs are checked by the caller), before its first launch.
fn ensure_forward_buffers<T, W>(
    op: &'static str,
    stream: &CudaStream,
    x: &impl DevicePtr<T>,
    tokens: Tokens<'_>,
    fc1_weight: &impl DevicePtr<W>,
    fc2_weight: &impl DevicePtr<W>,
    y: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    ensure_same_context(op, "x", stream, x)?;
    ensure_tokens_context(op, stream, tokens)?;
    ensure_same_context(op, "fc1_weight", stream, fc1_weight)?;
    ensure_same_context(op, "fc2_weight", stream, fc2_weight)?;
    ensure_same_context(op, "y", stream, y)?;
    let y_ptr = y.device_ptr_mut(stream).0;
    ensure_aligned16(op, [("x", x.device_ptr(stream).0), ("y", y_ptr)])?;
    ensure_aligned16(
        op,
        [("fc1_weight", fc1_weight.device_ptr(stream).0), ("fc2_weight", fc2_weight.device_ptr(stream).0)],
    )
}

/// The context of every caller buffer of a backward call, and the 16-byte alignment of its
/// activation, weight and gradient buffers, before its first launch.
#[allow(clippy::too_many_arguments)]
fn ensure_backward_buffers<T, P, W, G>(
    op: &'static str,
    stream: &CudaStream,
    dy: &impl DevicePtr<T>,
    tokens: Tokens<'_>,
    fc1_weight: &impl DevicePtr<W>,
    fc2_weight: &impl DevicePtr<W>,
    dx: &mut impl DevicePtrMut<T>,
    dprobs: &impl DevicePtrMut<P>,
    dw1: &mut impl DevicePtrMut<G>,
    dw2: &mut impl DevicePtrMut<G>,
) -> Result<()> {
    ensure_same_context(op, "dy", stream, dy)?;
    ensure_tokens_context(op, stream, tokens)?;
    ensure_same_context(op, "fc1_weight", stream, fc1_weight)?;
    ensure_same_context(op, "fc2_weight", stream, fc2_weight)?;
    ensure_same_context(op, "dx", stream, dx)?;
    ensure_same_context(op, "dprobs", stream, dprobs)?;
    ensure_same_context(op, "dw1", stream, dw1)?;
    ensure_same_context(op, "dw2", stream, dw2)?;
    let (dx_ptr, dw1_ptr, dw2_ptr) =
        (dx.device_ptr_mut(stream).0, dw1.device_ptr_mut(stream).0, dw2.device_ptr_mut(stream).0);
    ensure_aligned16(op, [("dy", dy.device_ptr(stream).0), ("dx", dx_ptr), ("dw1", dw1_ptr), ("dw2", dw2_ptr)])?;
    ensure_aligned16(
        op,
        [("fc1_weight", fc1_weight.device_ptr(stream).0), ("fc2_weight", fc2_weight.device_ptr(stream).0)],
    )
}

fn form_name(dtype: Option<DType>) -> String {
    dtype.map_or_else(
        || "a u64 pointer array (WeightForm::Pointers)".into(),
        |d| format!("a {d:?} tensor (WeightForm::Tensor)"),
    )
}

impl<T: MoeElement> MoeExperts<T> {
    /// Validates the configuration on the host, plans the routing and the six GEMMs for the
    /// device of `stream`, and allocates every intermediate buffer (the only allocation).
    /// Tensor weights, `GemmConfig::Auto`; see [`with_options`](Self::with_options).
    pub fn new(config: MoeConfig, stream: &Arc<CudaStream>) -> Result<MoeExperts<T>> {
        Self::with_options(config, MoeOptions::default(), stream)
    }

    /// [`new`](Self::new) with a weight form and a forced GEMM kernel.
    pub fn with_options(config: MoeConfig, options: MoeOptions, stream: &Arc<CudaStream>) -> Result<MoeExperts<T>> {
        Self::build("MoeExperts::new", config, options, stream, Scratch::Stream(stream))
    }

    /// [`with_options`](Self::with_options) with the intermediate activations (the
    /// `[capacity, ...]` buffers, nearly all of the plan's memory) taken from `range` of a
    /// [`MemoryPool`](crate::graph::MemoryPool), so that graphs of several shapes share them.
    /// Route maps, flag words, the map-form routes and the GEMM workspace stay the plan's own
    /// allocations: they are read after a replay or carry state between launches. `stream`
    /// must be the pool's stream ([`Error::WrongStream`]). Forward and backward of one step
    /// must run with no other graph of the pool between them (the pool's rule).
    pub fn with_pool(
        config: MoeConfig,
        options: MoeOptions,
        stream: &Arc<CudaStream>,
        range: &PoolRange,
    ) -> Result<MoeExperts<T>> {
        ensure_bound_stream("MoeExperts::with_pool", range.stream(), stream)?;
        Self::build("MoeExperts::with_pool", config, options, stream, Scratch::Pool(range))
    }

    fn build(
        op: &'static str,
        config: MoeConfig,
        options: MoeOptions,
        stream: &Arc<CudaStream>,
        scratch: Scratch<'_>,
    ) -> Result<MoeExperts<T>> {
        ensure_not_capturing(stream, op)?;
        if config.dtype != <T as routing::Element>::DTYPE {
            return Err(Error::Shape {
                op,
                what: "element type",
                expected: format!("{:?}", config.dtype),
                got: format!("{:?}", <T as routing::Element>::DTYPE),
            });
        }
        let routing = RoutingPlan::new(config.routing_config())?;
        let cap = routing.capacity();
        let gemms = Gemms::new(&config, &options, cap, stream)?;
        let fused = fused::FusedPlans::new(&options, &config, &routing, stream)?;
        let lens = BufferLens::of(cap, config.hidden, config.ffn, &PathShape::of(&fused, options.forward_only));
        let zeros = |len: usize| scratch.alloc::<T>(len);
        let buffers = Buffers {
            rows: zeros(lens.rows)?,
            h: zeros(lens.h)?,
            act: zeros(lens.act)?,
            out_rows: zeros(lens.out_rows)?,
            drows: zeros(lens.drows)?,
            dact: zeros(lens.dact)?,
            dh: zeros(lens.dh)?,
            prob_of_row: scratch.alloc::<f32>(lens.prob_of_row)?,
            dprob_partials: scratch.alloc::<f32>(lens.dprob_partials)?,
        };
        let workspace_bytes = gemms.all().iter().map(|g| g.workspace_bytes()).max().unwrap_or(0);
        let routes = routing.routes_len().max(1);
        Ok(MoeExperts {
            maps: routing.alloc_maps(stream)?,
            gemm_flags: stream.alloc_zeros(1)?,
            map_routes: MapRoutes { ids: stream.alloc_zeros(routes)?, probs: stream.alloc_zeros(routes)? },
            path: Path {
                workspace: stream.alloc_zeros(workspace_bytes.max(1))?,
                fused,
                forward_only: options.forward_only,
                routing,
                gemms,
                buffers,
            },
            config,
            options,
            stream: stream.clone(),
        })
    }

    /// What the plan was built for: configuration, options, capacity, resolved GEMM kernels and
    /// the bound stream.
    pub fn desc(&self) -> MoeDesc {
        MoeDesc {
            config: self.config.clone(),
            options: self.options,
            capacity: self.capacity(),
            gemm_configs: self.gemm_configs(),
            stream: self.stream.cu_stream() as u64,
        }
    }

    /// The stream the plan was made on and is bound to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `Ok` for the bound stream (compared by driver handle and context), else
    /// [`Error::WrongStream`].
    fn ensure_bound_stream(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        ensure_bound_stream(op, &self.stream, stream)
    }

    pub fn config(&self) -> &MoeConfig {
        &self.config
    }

    pub fn options(&self) -> &MoeOptions {
        &self.options
    }

    /// Rows of the permuted buffers.
    pub fn capacity(&self) -> usize {
        self.path.routing.capacity()
    }

    /// The GEMM kernels the plan runs, as resolved: (fc1 fprop, fc2 fprop, fc2 dgrad,
    /// fc2 wgrad, fc1 dgrad, fc1 wgrad).
    pub fn gemm_configs(&self) -> [GemmConfig; 6] {
        self.path.gemms.all().map(|g| g.config())
    }

    /// `y = Σ_j probs[t, j] · fc2(SwiGLU(fc1(x[t])))` over each token's routed experts.
    /// `fc1_weight` / `fc2_weight` are tensors of `T` or u64 pointer arrays, as the plan's
    /// [`WeightForm`] says (anything else is an [`Error::Shape`] before any launch).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<P: routing::Element, W: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "MoeExperts::forward";
        self.ensure_bound_stream(OP, stream)?;
        self.check_routes(OP, "expert_ids", expert_ids.len())?;
        self.check_forward::<P, W>(OP, x.len(), probs.len(), fc1_weight.len(), fc2_weight.len(), y.len())?;
        // Every context before the first launch (the launchers check again, too late to
        // leave nothing half-done).
        ensure_same_context(OP, "expert_ids", stream, expert_ids)?;
        ensure_same_context(OP, "probs", stream, probs)?;
        ensure_forward_buffers(OP, stream, x, tokens, fc1_weight, fc2_weight, y)?;
        self.path.forward(
            stream,
            &mut self.maps,
            &mut self.gemm_flags,
            x,
            expert_ids,
            probs,
            tokens,
            fc1_weight,
            fc2_weight,
            y,
        )
    }

    /// Gradients of [`forward`](Self::forward) (which must have run with the same inputs, `x`
    /// among them, unchanged since): `dx`, `dprobs`, and the weight gradients `dw1 [E, 2F, H]`,
    /// `dw2 [E, H, F]` (element type `T`, or `f32` with `wgrad_accumulate`, which adds into
    /// them), as tensors or u64 pointer arrays per the plan's [`WeightForm`], like the weights.
    /// `x` is read where fc1's wgrad gathers its rows from it ([`MoeOptions::fc1_wgrad`]) and
    /// where the forward ran the fused fc1 (the backward then permutes x for fc1's wgrad); the
    /// unfused fc1's plans read the permuted copy their forward kept, but take `x` all the same,
    /// so that a plan's options never change its call.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        dy: &impl DevicePtr<T>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        dx: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw1: &mut impl DevicePtrMut<G>,
        dw2: &mut impl DevicePtrMut<G>,
    ) -> Result<()> {
        const OP: &str = "MoeExperts::backward";
        self.ensure_bound_stream(OP, stream)?;
        self.check_not_forward_only(OP)?;
        self.check_routes(OP, "dprobs", dprobs.len())?;
        self.check_backward::<P, W, G>(
            OP,
            x.len(),
            dy.len(),
            probs.len(),
            fc1_weight.len(),
            fc2_weight.len(),
            dx.len(),
            dw1.len(),
            dw2.len(),
        )?;
        ensure_same_context(OP, "probs", stream, probs)?;
        ensure_same_context(OP, "x", stream, x)?;
        ensure_backward_buffers(OP, stream, dy, tokens, fc1_weight, fc2_weight, dx, dprobs, dw1, dw2)?;
        self.path.backward(
            stream,
            &self.maps,
            &mut self.gemm_flags,
            x,
            dy,
            probs,
            tokens,
            fc1_weight,
            fc2_weight,
            dx,
            dprobs,
            dw1,
            dw2,
        )
    }

    /// [`forward`](Self::forward) from Megatron's routing form: `routing_map [T_max, E]` (u8,
    /// nonzero = routed) and `map_probs [T_max, E]` (the plan's prob dtype). One extra launch
    /// converts them into the plan's own `[T_max, k]` buffers ([`RoutingPlan::from_map`]:
    /// each token's routes in ascending expert order; fewer than k routes leave id -1, more
    /// keep the k lowest experts and raise [`routing::flags::TOO_MANY`] in `maps.flags`).
    /// Those buffers are fixed too, so a graph may hold this call.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_from_map<P: routing::Element, W: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        routing_map: &impl DevicePtr<u8>,
        map_probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const OP: &str = "MoeExperts::forward_from_map";
        self.ensure_bound_stream(OP, stream)?;
        let map_len = self.config.max_tokens * self.config.num_experts;
        ensure_len(OP, "routing_map [T_max, E]", routing_map.len(), map_len, "")?;
        ensure_len(OP, "map_probs [T_max, E]", map_probs.len(), map_len, "")?;
        let routes = self.path.routing.routes_len();
        self.check_forward::<P, W>(OP, x.len(), routes, fc1_weight.len(), fc2_weight.len(), y.len())?;
        ensure_same_context(OP, "routing_map", stream, routing_map)?;
        ensure_same_context(OP, "map_probs", stream, map_probs)?;
        ensure_forward_buffers(OP, stream, x, tokens, fc1_weight, fc2_weight, y)?;
        let mr = &mut self.map_routes;
        {
            // SAFETY: every prob dtype (bf16, f16, f32) is at most 4 bytes and valid as any
            // bits, and the fp32-sized storage holds `routes` of them.
            let mut probs = unsafe { mr.probs.transmute_mut::<P>(routes) }.expect("map probs storage holds T_max * k");
            self.path.routing.from_map(
                stream,
                routing_map,
                map_probs,
                tokens,
                &mut mr.ids,
                &mut probs,
                &mut self.maps.flags,
            )?;
        }
        // SAFETY: as above.
        let probs = unsafe { mr.probs.transmute::<P>(routes) }.expect("map probs storage holds T_max * k");
        self.path.forward(
            stream,
            &mut self.maps,
            &mut self.gemm_flags,
            x,
            &mr.ids,
            &probs,
            tokens,
            fc1_weight,
            fc2_weight,
            y,
        )
    }

    /// [`backward`](Self::backward) after [`forward_from_map`](Self::forward_from_map), with
    /// the probs it converted. `dprobs` is `[T_max, k]` in the converted route order (route j
    /// of token t is expert [`map_expert_ids`](Self::map_expert_ids)`[t, j]`, -1 = none).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_map<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        dy: &impl DevicePtr<T>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        dx: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw1: &mut impl DevicePtrMut<G>,
        dw2: &mut impl DevicePtrMut<G>,
    ) -> Result<()> {
        const OP: &str = "MoeExperts::backward_from_map";
        self.ensure_bound_stream(OP, stream)?;
        self.check_not_forward_only(OP)?;
        let routes = self.path.routing.routes_len();
        self.check_routes(OP, "dprobs", dprobs.len())?;
        self.check_backward::<P, W, G>(
            OP,
            x.len(),
            dy.len(),
            routes,
            fc1_weight.len(),
            fc2_weight.len(),
            dx.len(),
            dw1.len(),
            dw2.len(),
        )?;
        ensure_same_context(OP, "x", stream, x)?;
        ensure_backward_buffers(OP, stream, dy, tokens, fc1_weight, fc2_weight, dx, dprobs, dw1, dw2)?;
        // SAFETY: as in forward_from_map (any bits are a valid prob of at most 4 bytes).
        let probs = unsafe { self.map_routes.probs.transmute::<P>(routes) }.expect("map probs storage holds T_max * k");
        self.path.backward(
            stream,
            &self.maps,
            &mut self.gemm_flags,
            x,
            dy,
            &probs,
            tokens,
            fc1_weight,
            fc2_weight,
            dx,
            dprobs,
            dw1,
            dw2,
        )
    }

    /// `[T_max, k]` expert ids the last [`forward_from_map`](Self::forward_from_map) converted.
    pub fn map_expert_ids(&self) -> &CudaSlice<i32> {
        &self.map_routes.ids
    }

    // ---- host checks, all before the first launch ----

    fn check_not_forward_only(&self, op: &'static str) -> Result<()> {
        if self.options.forward_only {
            return Err(Error::InvalidArgument { op, why: "the plan was made with MoeOptions::forward_only".into() });
        }
        Ok(())
    }

    /// Whether the forward runs the fused fc1 ([`MoeOptions::fc1`]).
    pub fn fc1_is_fused(&self) -> bool {
        self.path.fused.fc1.is_some()
    }

    /// Whether the fused fc1 also writes x's permuted rows for the backward's fc1 wgrad, so the
    /// training step runs no permute pass ([`crate::fused::FusedFc1::writing_rows`]: a training
    /// plan with the fused fc1 and the unfused fc1 wgrad, on a 9.0 device).
    pub fn fc1_writes_rows(&self) -> bool {
        self.path.fused.fc1.as_ref().is_some_and(|f| f.writes_rows())
    }

    /// Whether the backward runs the fused fc2 dgrad + SwiGLU backward
    /// ([`MoeOptions::swiglu_dgrad`]).
    pub fn swiglu_dgrad_is_fused(&self) -> bool {
        self.path.fused.swiglu_dgrad.is_some()
    }

    /// Whether each route's probability is applied in fc1's epilogue
    /// ([`MoeOptions::prob_in_fc1`]).
    pub fn prob_is_in_fc1(&self) -> bool {
        self.path.fused.prob_in_fc1
    }

    /// Whether the backward's fc1 wgrad gathers its rows from `x` ([`MoeOptions::fc1_wgrad`]).
    pub fn fc1_wgrad_is_gathered(&self) -> bool {
        self.path.fused.fc1_wgrad.is_some()
    }

    fn check_routes(&self, op: &'static str, what: &'static str, len: usize) -> Result<()> {
        ensure_len(op, what, len, self.path.routing.routes_len(), " (T_max * k)")
    }

    fn check_tokens(&self, op: &'static str, what: &'static str, len: usize) -> Result<()> {
        ensure_len(op, what, len, self.path.routing.tokens_len(), " (T_max * H)")
    }

    fn check_probs<P: routing::Element>(&self, op: &'static str, len: usize) -> Result<()> {
        if P::DTYPE != self.config.prob_dtype {
            return Err(Error::Shape {
                op,
                what: "probs element type",
                expected: format!("{:?}", self.config.prob_dtype),
                got: format!("{:?}", P::DTYPE),
            });
        }
        self.check_routes(op, "probs", len)
    }

    /// A weight-shaped operand: a tensor of `dtype` holding `E` matrices of `matrix` elements,
    /// or a u64 array of `E` pointers, per the plan's [`WeightForm`].
    fn check_weight<W: GemmOperand>(
        &self,
        op: &'static str,
        what: &'static str,
        len: usize,
        dtype: DType,
        matrix: usize,
    ) -> Result<()> {
        let e = self.config.num_experts;
        let (want, need) = match self.options.weights {
            WeightForm::Tensor => (Some(dtype), e * matrix),
            WeightForm::Pointers => (None, e),
        };
        if W::DTYPE != want {
            return Err(Error::Shape { op, what, expected: form_name(want), got: form_name(W::DTYPE) });
        }
        ensure_len(op, what, len, need, &format!(" ({})", form_name(want)))
    }

    fn check_weights<W: GemmOperand>(&self, op: &'static str, fc1: usize, fc2: usize) -> Result<()> {
        let (h, f, dtype) = (self.config.hidden, self.config.ffn, self.config.dtype);
        self.check_weight::<W>(op, "fc1_weight [E, 2F, H]", fc1, dtype, 2 * f * h)?;
        self.check_weight::<W>(op, "fc2_weight [E, H, F]", fc2, dtype, h * f)
    }

    fn check_forward<P: routing::Element, W: GemmOperand>(
        &self,
        op: &'static str,
        x: usize,
        probs: usize,
        fc1: usize,
        fc2: usize,
        y: usize,
    ) -> Result<()> {
        self.check_tokens(op, "x", x)?;
        self.check_tokens(op, "y", y)?;
        self.check_probs::<P>(op, probs)?;
        self.check_weights::<W>(op, fc1, fc2)
    }

    #[allow(clippy::too_many_arguments)]
    fn check_backward<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &self,
        op: &'static str,
        x: usize,
        dy: usize,
        probs: usize,
        fc1: usize,
        fc2: usize,
        dx: usize,
        dw1: usize,
        dw2: usize,
    ) -> Result<()> {
        self.check_tokens(op, "x", x)?;
        self.check_tokens(op, "dy", dy)?;
        self.check_tokens(op, "dx", dx)?;
        self.check_probs::<P>(op, probs)?;
        self.check_weights::<W>(op, fc1, fc2)?;
        let (h, f) = (self.config.hidden, self.config.ffn);
        let gdt = if self.config.wgrad_accumulate { DType::F32 } else { self.config.dtype };
        self.check_weight::<G>(op, "dw1 [E, 2F, H]", dw1, gdt, 2 * f * h)?;
        self.check_weight::<G>(op, "dw2 [E, H, F]", dw2, gdt, h * f)
    }
}

impl<T: MoeElement> Path<T> {
    #[allow(clippy::too_many_arguments)]
    fn forward<P: routing::Element, W: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        maps: &mut RouteMaps,
        flags: &mut CudaSlice<i32>,
        x: &impl DevicePtr<T>,
        expert_ids: &impl DevicePtr<i32>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let (r, g, b, ws) = (&self.routing, &self.gemms, &mut self.buffers, &mut self.workspace);
        r.build(stream, expert_ids, tokens, maps)?;
        let splits = &maps.m_splits_i32;
        let weighted = self.fused.prob_in_fc1;
        if weighted {
            r.row_probs(stream, &maps.row_of_route, probs, tokens, &mut b.prob_of_row)?;
        }
        if let Some(f) = &self.fused.fc1 {
            let keep_h = !self.forward_only;
            let prob_of_row = weighted.then_some(&b.prob_of_row);
            let rows = f.writes_rows().then_some(&mut b.rows); // kept for fc1's wgrad
            fused::fc1(f, stream, x, fc1_weight, maps, prob_of_row, &mut b.act, keep_h.then_some(&mut b.h), rows)?;
        } else {
            r.permute(stream, x, &maps.row_of_route, tokens, &mut b.rows)?;
            g.fc1_fprop.run(stream, &b.rows, fc1_weight, &mut b.h, splits, Some(&mut *flags), ws)?;
            r.swiglu(stream, &b.h, &maps.offsets, &mut b.act)?;
        }
        g.fc2_fprop.run(stream, &b.act, fc2_weight, &mut b.out_rows, splits, Some(&mut *flags), ws)?;
        if weighted {
            // The rows are weighted already: the combine is the plain gather-sum.
            r.permute_backward(stream, &b.out_rows, &maps.row_of_route, tokens, y)
        } else {
            r.unpermute(stream, &b.out_rows, &maps.row_of_route, probs, tokens, y)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn backward<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        maps: &RouteMaps,
        flags: &mut CudaSlice<i32>,
        x: &impl DevicePtr<T>,
        dy: &impl DevicePtr<T>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc1_weight: &impl DevicePtr<W>,
        fc2_weight: &impl DevicePtr<W>,
        dx: &mut impl DevicePtrMut<T>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw1: &mut impl DevicePtrMut<G>,
        dw2: &mut impl DevicePtrMut<G>,
    ) -> Result<()> {
        if self.fused.prob_in_fc1 {
            self.fc2_backward_from_dy(stream, maps, dy, tokens, fc2_weight, dprobs, dw2)?;
        } else {
            self.fc2_backward(stream, maps, flags, dy, probs, tokens, fc2_weight, dprobs, dw2)?;
        }
        let (r, g, b, ws) = (&self.routing, &self.gemms, &mut self.buffers, &mut self.workspace);
        let splits = &maps.m_splits_i32;
        // The gradient of fc1's input rows goes into a buffer dead by now (BufferLens::of says
        // which). Not out_rows on the unfused path: the combine's backward reads it for dprobs,
        // so a second backward after one forward would see it overwritten.
        let drows_in = if self.fused.prob_in_fc1 { &mut b.out_rows } else { &mut b.drows };
        g.fc1_dgrad.run(stream, &b.dh, fc1_weight, drows_in, splits, Some(&mut *flags), ws)?;
        if self.fused.permute_pass(false) == Some(fused::PermutePass::Backward) {
            r.permute(stream, x, &maps.row_of_route, tokens, &mut b.rows)?; // the rows fc1's wgrad reads
        }
        match &self.fused.fc1_wgrad {
            Some(f) => fused::wgrad(f, stream, &b.dh, x, maps, dw1)?,
            None => g.fc1_wgrad.run(stream, &b.dh, &b.rows, dw1, splits, Some(&mut *flags), ws)?,
        }
        r.permute_backward(stream, drows_in, &maps.row_of_route, tokens, dx)
    }

    /// From dy to dh, dprobs and dW2 when the combine applied the probabilities: unpermute
    /// backward (drows, dprobs), then fc2's dgrad (fused with the SwiGLU backward where
    /// planned) and wgrad over drows.
    #[allow(clippy::too_many_arguments)]
    fn fc2_backward<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        maps: &RouteMaps,
        flags: &mut CudaSlice<i32>,
        dy: &impl DevicePtr<T>,
        probs: &impl DevicePtr<P>,
        tokens: Tokens<'_>,
        fc2_weight: &impl DevicePtr<W>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw2: &mut impl DevicePtrMut<G>,
    ) -> Result<()> {
        let (r, g, b, ws) = (&self.routing, &self.gemms, &mut self.buffers, &mut self.workspace);
        let splits = &maps.m_splits_i32;
        r.unpermute_backward(stream, dy, &b.out_rows, &maps.row_of_route, probs, tokens, &mut b.drows, dprobs)?;
        if let Some(f) = &self.fused.swiglu_dgrad {
            fused::swiglu_dgrad(f, stream, &b.drows, fc2_weight, &b.h, maps, &mut b.dh)?;
            g.fc2_wgrad.run(stream, &b.drows, &b.act, dw2, splits, Some(&mut *flags), ws)
        } else {
            g.fc2_dgrad.run(stream, &b.drows, fc2_weight, &mut b.dact, splits, Some(&mut *flags), ws)?;
            g.fc2_wgrad.run(stream, &b.drows, &b.act, dw2, splits, Some(&mut *flags), ws)?;
            r.swiglu_backward(stream, &b.dact, &b.h, &maps.offsets, &mut b.dh)
        }
    }

    /// From dy to dh, dprobs and dW2 when fc1 applied the probabilities: fc2's output rows got
    /// plain `dy[token]` as their gradient, so the fused fc2 dgrad gathers dy (its epilogue
    /// applies p and writes the dprob partials, summed per route after it), and fc2's wgrad
    /// reads dy gathered against act.
    #[allow(clippy::too_many_arguments)]
    fn fc2_backward_from_dy<P: routing::Element, W: GemmOperand, G: GemmOperand>(
        &mut self,
        stream: &CudaStream,
        maps: &RouteMaps,
        dy: &impl DevicePtr<T>,
        tokens: Tokens<'_>,
        fc2_weight: &impl DevicePtr<W>,
        dprobs: &mut impl DevicePtrMut<P>,
        dw2: &mut impl DevicePtrMut<G>,
    ) -> Result<()> {
        let (r, b) = (&self.routing, &mut self.buffers);
        let (Some(dgrad), Some(wgrad)) = (&self.fused.swiglu_dgrad, &self.fused.fc2_wgrad) else {
            unreachable!("FusedPlans::new plans both kernels with prob_in_fc1 (non-forward-only plans)");
        };
        let partials = &mut b.dprob_partials;
        fused::swiglu_dgrad_gathered(dgrad, stream, dy, fc2_weight, &b.h, maps, &b.prob_of_row, &mut b.dh, partials)?;
        r.route_dprobs(stream, &maps.row_of_route, &b.dprob_partials, dgrad.dprob_slices(), tokens, dprobs)?;
        fused::wgrad(wgrad, stream, dy, &b.act, maps, dw2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: usize = 64;
    const HIDDEN: usize = 256;
    const FFN: usize = 384;
    const SLICES: usize = FFN / 128;

    fn shape(forward_only: bool, fused_fc1: bool, prob_in_fc1: bool, fused_dgrad: bool) -> PathShape {
        // No gathered fc1 wgrad in this table.
        let fc1 = if fused_fc1 { fused::Fc1Step::Fused } else { fused::Fc1Step::Unfused };
        let permutes = fused::permute_pass(fc1, false, forward_only).is_some();
        PathShape { forward_only, fused_fc1, permutes, prob_in_fc1, fused_swiglu_dgrad: fused_dgrad.then_some(SLICES) }
    }

    fn lens(shape: PathShape) -> BufferLens {
        BufferLens::of(CAP, HIDDEN, FFN, &shape)
    }

    #[test]
    fn unfused_training_plan_sizes_every_buffer_host() {
        let got = lens(shape(false, false, false, false));
        let (rows, h2, f) = (CAP * HIDDEN, CAP * 2 * FFN, CAP * FFN);
        let expected = BufferLens {
            rows,
            h: h2,
            act: f,
            out_rows: rows,
            drows: rows,
            dact: f,
            dh: h2,
            prob_of_row: 0,
            dprob_partials: 0,
        };
        assert_eq!(got, expected);
    }

    #[test]
    fn forward_only_plans_allocate_no_backward_buffer_host() {
        for fused_fc1 in [false, true] {
            for prob_in_fc1 in [false, true] {
                let got = lens(shape(true, fused_fc1, prob_in_fc1, false));
                let backward = [got.drows, got.dact, got.dh, got.dprob_partials];
                assert_eq!(backward, [0; 4], "fused fc1 {fused_fc1}, prob in fc1 {prob_in_fc1}: {got:?}");
                assert_eq!(got.act, CAP * FFN);
                assert_eq!(got.out_rows, CAP * HIDDEN);
                // The fused fc1 writes act alone and gathers x itself: no h, no permuted x.
                let (h, rows) = if fused_fc1 { (0, 0) } else { (CAP * 2 * FFN, CAP * HIDDEN) };
                assert_eq!((got.h, got.rows), (h, rows), "fused fc1 {fused_fc1}");
                assert_eq!(got.prob_of_row, if prob_in_fc1 { CAP } else { 0 });
            }
        }
    }

    #[test]
    fn probability_in_fc1_trades_row_gradients_for_partials_host() {
        let got = lens(shape(false, true, true, true));
        assert_eq!((got.drows, got.dact), (0, 0), "{got:?}");
        assert_eq!(got.dh, CAP * 2 * FFN);
        assert_eq!(got.h, CAP * 2 * FFN, "backward reads h");
        assert_eq!(got.prob_of_row, CAP);
        assert_eq!(got.dprob_partials, CAP * SLICES);
    }

    #[test]
    fn the_permute_runs_in_the_pass_whose_kernel_reads_the_rows_host() {
        use fused::{permute_pass, Fc1Step, PermutePass};
        // (fc1, gathered fc1 wgrad, forward only) -> pass
        let cases = [
            ((Fc1Step::Unfused, false, false), Some(PermutePass::Forward)),
            ((Fc1Step::Unfused, true, false), Some(PermutePass::Forward)),
            ((Fc1Step::Unfused, false, true), Some(PermutePass::Forward)),
            ((Fc1Step::Fused, false, false), Some(PermutePass::Backward)),
            ((Fc1Step::FusedWritingRows, false, false), Some(PermutePass::InFc1)),
            ((Fc1Step::Fused, true, false), None),
            ((Fc1Step::Fused, false, true), None),
            ((Fc1Step::FusedWritingRows, true, false), None),
            ((Fc1Step::FusedWritingRows, false, true), None),
        ];
        for ((fc1, gathered, forward_only), pass) in cases {
            assert_eq!(permute_pass(fc1, gathered, forward_only), pass, "{fc1:?} {gathered} {forward_only}");
        }
        // The training plan of the fused fc1 still allocates the rows: its backward (or its
        // fc1, writing them) fills them.
        assert_eq!(lens(shape(false, true, false, false)).rows, CAP * HIDDEN);
    }

    #[test]
    fn fused_dgrad_without_probability_in_fc1_drops_only_dact_host() {
        let got = lens(shape(false, true, false, true));
        assert_eq!(got.dact, 0);
        assert_eq!(got.drows, CAP * HIDDEN);
        assert_eq!(got.dprob_partials, 0);
    }
}
