//! One rank's Echo + expert path on one GPU, shared by `echo_moe_gpu.rs` and `soak_gpu.rs`:
//! every device buffer of the sequence plan + top-k reroute -> spare-slot weight fill (fc1,
//! fc2) -> expert path forward + backward over the `E + S` final columns (per-slot weight and
//! fp32 gradient pointers) -> fold of the spare slots' gradients into their home experts.
//! A captured graph keeps all their addresses.
#![allow(dead_code)]

use std::sync::Arc;

use capturable_moe::echo::{self as echo, EchoConfig, EchoPlan};
use capturable_moe::grouped_gemm::GemmConfig;
use capturable_moe::moe::{echo_slot_pointers, MoeConfig, MoeExperts, MoeOptions, WeightForm};
use capturable_moe::routing::Tokens;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use super::expert_io::layer_config;
use super::moe::Dims;

/// The expert path's plan for `num_experts` columns of `dims` (bf16, fp32 probs, fp32
/// gradients added into, no capacity limit).
pub fn moe_config(dims: Dims, num_experts: usize, max_tokens: usize) -> MoeConfig {
    MoeConfig { num_experts, wgrad_accumulate: true, ..layer_config(dims, max_tokens) }
}

/// Every device buffer of one Echo + expert path instance. `dims.e` is the number of home
/// experts (`cfg.num_experts`), S = `cfg.num_spare()`; `W1 = 2F * H`, `W2 = H * F` elements
/// per matrix.
pub struct EchoExpertPath {
    pub dims: Dims,
    pub plan: EchoPlan,
    pub moe: MoeExperts<bf16>,
    // inputs, written between replays
    /// `[1]` i32 token count T of the captured sequence.
    pub tokens: CudaSlice<i32>,
    /// `[EP, E]` the EP group's count matrix.
    pub counts: CudaSlice<i64>,
    pub ids: CudaSlice<i32>,
    pub probs: CudaSlice<f32>,
    pub x: CudaSlice<bf16>,
    pub dy: CudaSlice<bf16>,
    pub w1: CudaSlice<bf16>, // [E, 2F, H] home experts
    pub w2: CudaSlice<bf16>, // [E, H, F]
    // Echo
    pub state: CudaSlice<i64>,
    pub ws: CudaSlice<i32>,
    pub dest: CudaSlice<i32>,
    pub dest_probs: CudaSlice<f32>,
    pub w1_spare: CudaSlice<bf16>, // [S, 2F, H]
    pub w2_spare: CudaSlice<bf16>, // [S, H, F]
    pub dw1: CudaSlice<f32>,       // [E, 2F, H] fp32 main grads of the home experts
    pub dw2: CudaSlice<f32>,
    pub dw1_spare: CudaSlice<f32>, // [S, 2F, H]
    pub dw2_spare: CudaSlice<f32>,
    pub w1_ptrs: CudaSlice<u64>, // [E + S] per final column
    pub w2_ptrs: CudaSlice<u64>,
    pub dw1_ptrs: CudaSlice<u64>,
    pub dw2_ptrs: CudaSlice<u64>,
    pub slot_errors: CudaSlice<i64>,
    // outputs
    pub y: CudaSlice<bf16>,
    pub dx: CudaSlice<bf16>,
    pub dprobs: CudaSlice<f32>,
}

impl EchoExpertPath {
    /// Zeroed buffers (weights included), the token count set to `t_max`, the slot pointer
    /// tables filled, and an expert path over the `E + S` columns with pointer weights running
    /// `gemm_config`.
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: &EchoConfig,
        dims: Dims,
        t_max: usize,
        gemm_config: GemmConfig,
    ) -> EchoExpertPath {
        assert_eq!(dims.e, cfg.num_experts, "dims.e is the number of home experts");
        let Dims { e, h, f, k } = dims;
        let (w1_len, w2_len) = (2 * f * h, h * f);
        let s = cfg.num_spare();
        let plan = EchoPlan::new(cfg.clone(), t_max).unwrap();
        let z16 = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
        let z32 = |n: usize| stream.alloc_zeros::<f32>(n).unwrap();
        let w1 = z16(e * w1_len);
        let w2 = z16(e * w2_len);
        let w1_spare = z16(s * w1_len);
        let w2_spare = z16(s * w2_len);
        let dw1 = z32(e * w1_len);
        let dw2 = z32(e * w2_len);
        let dw1_spare = z32(s * w1_len);
        let dw2_spare = z32(s * w2_len);
        let table16 = |home: &CudaSlice<bf16>, spare: &CudaSlice<bf16>, per: usize| {
            stream.clone_htod(&echo_slot_pointers(stream, cfg, home, spare, per).unwrap()).unwrap()
        };
        let table32 = |home: &CudaSlice<f32>, spare: &CudaSlice<f32>, per: usize| {
            stream.clone_htod(&echo_slot_pointers(stream, cfg, home, spare, per).unwrap()).unwrap()
        };
        let opts = MoeOptions { weights: WeightForm::Pointers, gemm_config, ..MoeOptions::default() };
        let moe = MoeExperts::<bf16>::with_options(moe_config(dims, cfg.num_columns(), t_max), opts, stream).unwrap();
        EchoExpertPath {
            dims,
            tokens: stream.clone_htod(&[t_max as i32]).unwrap(),
            counts: stream.alloc_zeros(cfg.ep * e).unwrap(),
            ids: stream.alloc_zeros(t_max * k).unwrap(),
            probs: z32(t_max * k),
            x: z16(t_max * h),
            dy: z16(t_max * h),
            state: stream.alloc_zeros(plan.state_len()).unwrap(),
            ws: stream.alloc_zeros(plan.workspace_len().max(1)).unwrap(),
            dest: stream.alloc_zeros(t_max * k).unwrap(),
            dest_probs: z32(t_max * k),
            w1_ptrs: table16(&w1, &w1_spare, w1_len),
            w2_ptrs: table16(&w2, &w2_spare, w2_len),
            dw1_ptrs: table32(&dw1, &dw1_spare, w1_len),
            dw2_ptrs: table32(&dw2, &dw2_spare, w2_len),
            slot_errors: stream.alloc_zeros(1).unwrap(),
            y: z16(t_max * h),
            dx: z16(t_max * h),
            dprobs: z32(t_max * k),
            plan,
            moe,
            w1,
            w2,
            w1_spare,
            w2_spare,
            dw1,
            dw2,
            dw1_spare,
            dw2_spare,
        }
    }

    /// The captured sequence: plan + reroute, spare weights, expert path over E + S slots, fold.
    pub fn run(&mut self, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let e = self.dims.e;
        let (w1_len, w2_len) = (2 * self.dims.f * self.dims.h, self.dims.h * self.dims.f);
        let s = self.plan.config().num_spare();
        let tok = Tokens::Device(&self.tokens);
        self.plan.plan_reroute_topk(
            stream,
            &self.counts,
            &self.ids,
            &self.probs,
            tok,
            &mut self.state,
            &mut self.ws,
            &mut self.dest,
            &mut self.dest_probs,
        )?;
        let off = self.plan.layout().slot_expert;
        let slot_expert = self.state.slice(off..off + s);
        echo::fill_spare_weights(
            stream,
            &slot_expert,
            e,
            0,
            s,
            &self.w1,
            &mut self.w1_spare,
            w1_len,
            &mut self.slot_errors,
        )?;
        echo::fill_spare_weights(
            stream,
            &slot_expert,
            e,
            0,
            s,
            &self.w2,
            &mut self.w2_spare,
            w2_len,
            &mut self.slot_errors,
        )?;
        stream.memset_zeros(&mut self.dw1_spare)?;
        stream.memset_zeros(&mut self.dw2_spare)?;
        self.moe.forward(
            stream,
            &self.x,
            &self.dest,
            &self.dest_probs,
            tok,
            &self.w1_ptrs,
            &self.w2_ptrs,
            &mut self.y,
        )?;
        self.moe.backward(
            stream,
            &self.x,
            &self.dy,
            &self.dest_probs,
            tok,
            &self.w1_ptrs,
            &self.w2_ptrs,
            &mut self.dx,
            &mut self.dprobs,
            &mut self.dw1_ptrs,
            &mut self.dw2_ptrs,
        )?;
        echo::fold_spare_grads(
            stream,
            &slot_expert,
            e,
            s,
            &self.dw1_spare,
            &mut self.dw1,
            w1_len,
            &mut self.slot_errors,
        )?;
        echo::fold_spare_grads(
            stream,
            &slot_expert,
            e,
            s,
            &self.dw2_spare,
            &mut self.dw2,
            w2_len,
            &mut self.slot_errors,
        )
    }
}
