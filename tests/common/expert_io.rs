//! The caller-owned buffers of one expert-path layer (bf16 tensor weights), shared by the
//! expert-path GPU tests: a captured graph keeps their addresses, so each test writes new
//! inputs into them between replays and poisons the outputs.
#![allow(dead_code)]

use std::sync::Arc;

use capturable_moe::dtype::DType;
use capturable_moe::moe::{MoeConfig, MoeExperts};
use capturable_moe::routing::Tokens;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use super::moe::{poison_bf16, poison_f32, Dims};

/// A bf16 layer of `dims` for up to `max_tokens` tokens: fp32 probs, no capacity limit, bf16
/// weight gradients written (not added into). Tests vary it with struct update syntax.
pub fn layer_config(dims: Dims, max_tokens: usize) -> MoeConfig {
    MoeConfig {
        num_experts: dims.e,
        hidden: dims.h,
        ffn: dims.f,
        topk: dims.k,
        max_tokens,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    }
}

/// One step's inputs (host), already rounded to their device types: T tokens, ids and probs
/// `[T_max, k]` (id -1 = no route), x and dy `[T_max, H]`.
#[derive(Clone)]
pub struct Step {
    pub t: usize,
    pub ids: Vec<i32>,
    pub probs: Vec<f32>,
    pub x: Vec<bf16>,
    pub dy: Vec<bf16>,
}

/// Inputs `x, dy [T_max, H]`, `ids, probs [T_max, k]`, the device token count `tokens [1]`,
/// weights `w1 [E, 2F, H]`, `w2 [E, H, F]`, outputs `y, dx [T_max, H]`, `dprobs [T_max, k]` and
/// bf16 weight gradients `dw1, dw2` (written, not added into).
pub struct ExpertIo {
    pub dims: Dims,
    pub t_max: usize,
    pub x: CudaSlice<bf16>,
    pub ids: CudaSlice<i32>,
    pub probs: CudaSlice<f32>,
    pub tokens: CudaSlice<i32>,
    pub w1: CudaSlice<bf16>,
    pub w2: CudaSlice<bf16>,
    pub y: CudaSlice<bf16>,
    pub dy: CudaSlice<bf16>,
    pub dx: CudaSlice<bf16>,
    pub dprobs: CudaSlice<f32>,
    pub dw1: CudaSlice<bf16>,
    pub dw2: CudaSlice<bf16>,
}

impl ExpertIo {
    /// Zeroed buffers (token count 0) and the given weights.
    pub fn new(stream: &Arc<CudaStream>, dims: Dims, t_max: usize, w1: &[bf16], w2: &[bf16]) -> ExpertIo {
        let Dims { e, h, f, k } = dims;
        assert_eq!((w1.len(), w2.len()), (e * 2 * f * h, e * h * f), "weights [E, 2F, H] and [E, H, F]");
        let zeros_bf16 = |n: usize| stream.alloc_zeros::<bf16>(n).unwrap();
        ExpertIo {
            dims,
            t_max,
            x: zeros_bf16(t_max * h),
            ids: stream.alloc_zeros(t_max * k).unwrap(),
            probs: stream.alloc_zeros(t_max * k).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            w1: stream.clone_htod(w1).unwrap(),
            w2: stream.clone_htod(w2).unwrap(),
            y: zeros_bf16(t_max * h),
            dy: zeros_bf16(t_max * h),
            dx: zeros_bf16(t_max * h),
            dprobs: stream.alloc_zeros(t_max * k).unwrap(),
            dw1: zeros_bf16(e * 2 * f * h),
            dw2: zeros_bf16(e * h * f),
        }
    }

    /// Writes a step's inputs and poisons every output (NaN, `common::moe::POISON_*`), so an
    /// element the step should write but does not shows as a NaN, and one it must not write
    /// (rows at or past T) must still hold the poison afterwards. The bf16 weight gradients are
    /// written, not added into, so they are poisoned too.
    pub fn load(&mut self, stream: &Arc<CudaStream>, s: &Step) {
        self.load_inputs(stream, s.t as i32, &s.ids, &s.probs, &s.x, &s.dy);
        self.poison_outputs(stream);
    }

    /// The inputs alone; `device_t` is the device token count (a test may pass one past T_max).
    pub fn load_inputs(
        &mut self,
        stream: &Arc<CudaStream>,
        device_t: i32,
        ids: &[i32],
        probs: &[f32],
        x: &[bf16],
        dy: &[bf16],
    ) {
        stream.memcpy_htod(x, &mut self.x).unwrap();
        stream.memcpy_htod(ids, &mut self.ids).unwrap();
        stream.memcpy_htod(probs, &mut self.probs).unwrap();
        stream.memcpy_htod(dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&[device_t], &mut self.tokens).unwrap();
    }

    /// Every output poisoned: [`ExpertIo::poison_token_outputs`] and
    /// [`ExpertIo::poison_weight_grads`].
    pub fn poison_outputs(&mut self, stream: &Arc<CudaStream>) {
        self.poison_token_outputs(stream);
        self.poison_weight_grads(stream);
    }

    /// y, dx and dprobs poisoned (rows past T must keep it).
    pub fn poison_token_outputs(&mut self, stream: &Arc<CudaStream>) {
        let (h, k) = (self.dims.h, self.dims.k);
        stream.memcpy_htod(&poison_bf16(self.t_max * h), &mut self.y).unwrap();
        stream.memcpy_htod(&poison_bf16(self.t_max * h), &mut self.dx).unwrap();
        stream.memcpy_htod(&poison_f32(self.t_max * k), &mut self.dprobs).unwrap();
    }

    /// dw1 and dw2 poisoned (a backward writes them in full).
    pub fn poison_weight_grads(&mut self, stream: &Arc<CudaStream>) {
        let Dims { e, h, f, .. } = self.dims;
        stream.memcpy_htod(&poison_bf16(e * 2 * f * h), &mut self.dw1).unwrap();
        stream.memcpy_htod(&poison_bf16(e * h * f), &mut self.dw2).unwrap();
    }

    /// Forward with the device token count.
    pub fn forward(&mut self, moe: &mut MoeExperts<bf16>, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let tokens = Tokens::Device(&self.tokens);
        moe.forward(stream, &self.x, &self.ids, &self.probs, tokens, &self.w1, &self.w2, &mut self.y)
    }

    /// Backward with the device token count.
    pub fn backward(&mut self, moe: &mut MoeExperts<bf16>, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let tokens = Tokens::Device(&self.tokens);
        moe.backward(
            stream,
            &self.x,
            &self.dy,
            &self.probs,
            tokens,
            &self.w1,
            &self.w2,
            &mut self.dx,
            &mut self.dprobs,
            &mut self.dw1,
            &mut self.dw2,
        )
    }

    /// Forward + backward with the device token count.
    pub fn step(&mut self, moe: &mut MoeExperts<bf16>, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        self.run_with(moe, stream, None)
    }

    /// Forward + backward with a host token count (`Some`) or the device one.
    pub fn run_with(
        &mut self,
        moe: &mut MoeExperts<bf16>,
        stream: &Arc<CudaStream>,
        host_t: Option<usize>,
    ) -> capturable_moe::Result<()> {
        let ExpertIo { x, ids, probs, tokens, w1, w2, y, dy, dx, dprobs, dw1, dw2, .. } = self;
        let tokens = host_t.map_or(Tokens::Device(&*tokens), Tokens::Host);
        moe.forward(stream, &*x, &*ids, &*probs, tokens, &*w1, &*w2, y)?;
        moe.backward(stream, &*x, &*dy, &*probs, tokens, &*w1, &*w2, dx, dprobs, dw1, dw2)
    }

    /// y, dx, dw1, dw2 and dprobs as raw bits (poison included), in that order.
    pub fn bits(&self, stream: &Arc<CudaStream>) -> Vec<u32> {
        let mut bits: Vec<u32> = Vec::new();
        for v in [&self.y, &self.dx, &self.dw1, &self.dw2] {
            bits.extend(bits16(stream, v).into_iter().map(u32::from));
        }
        bits.extend(bits32(stream, &self.dprobs));
        bits
    }
}

/// A bf16 buffer's bits, copied to the host.
pub fn bits16(stream: &Arc<CudaStream>, v: &CudaSlice<bf16>) -> Vec<u16> {
    stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect()
}

/// An fp32 buffer's bits, copied to the host.
pub fn bits32(stream: &Arc<CudaStream>, v: &CudaSlice<f32>) -> Vec<u32> {
    stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect()
}
