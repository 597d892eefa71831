//! A Qwen3-MoE-style sparse MoE block in candle 0.11 whose experts run on capturable-moe.
//!
//! The router (linear, softmax, top-k, renormalised top-k weights) is candle. The experts
//! (permute, fc1, SwiGLU, fc2, prob-weighted combine) are one `MoeExperts::forward`, run on
//! candle's own CUDA buffers and stream (no copy between the two libraries), captured once in a
//! CUDA graph and replayed for every new batch. The result is checked against candle's own
//! per-expert loop (host read-back of the routing, then index_select / matmul / index_add per
//! expert, as candle-transformers' Qwen3-MoE does) on the same weights, and both are timed.
//!
//!   candle_moe [--experts 128] [--tokens 4096] [--topk 8] [--hidden 2048] [--ffn 768]
//!              [--reps 20] [--steps 3]
//!
//! Where the CUDA libraries are installed but no GPU is usable it prints "skipping: ..." and
//! exits 0 (1 with CAPMOE_REQUIRE_GPU=1); without the libraries (libcuda, libcublas, libcurand)
//! the loader refuses to start it. It exits 1 when an output is outside bf16 tolerance or a
//! routing / GEMM flag is raised.

mod candle_buffer;

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use capturable_moe::graph::capture;
use capturable_moe::moe::{MoeConfig, MoeExperts};
use capturable_moe::routing::Tokens;
use half::bf16;

use candle_buffer::CandleBuffer;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug)]
struct Shape {
    experts: usize,
    tokens: usize,
    topk: usize,
    hidden: usize,
    ffn: usize,
}

/// The block's weights, as a Qwen3-MoE checkpoint would hold them once loaded into candle:
/// router `[E, H]`, fc1 `[E, 2F, H]` (gate rows, then up rows), fc2 `[E, H, F]`, all bf16.
struct SparseMoeWeights {
    router: Tensor,
    fc1: Tensor,
    fc2: Tensor,
}

impl SparseMoeWeights {
    fn random(shape: Shape, device: &Device) -> candle_core::Result<Self> {
        let (e, h, f) = (shape.experts, shape.hidden, shape.ffn);
        // Unit-variance activations in and out of each GEMM.
        let normal = |dims: &[usize], fan_in: usize| {
            Tensor::randn(0f32, 1.0 / (fan_in as f32).sqrt(), dims, device)?.to_dtype(DType::BF16)
        };
        Ok(SparseMoeWeights {
            router: normal(&[e, h], h)?,
            fc1: normal(&[e, 2 * f, h], h)?,
            fc2: normal(&[e, h, f], f)?,
        })
    }
}

/// Router in candle: top-k expert ids `[T, k]` (u32) and their softmax weights renormalised
/// over the k (Qwen3-MoE's `norm_topk_prob`), `[T, k]` f32.
fn route(x: &Tensor, router: &Tensor, topk: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let logits = x.matmul(&router.t()?)?.to_dtype(DType::F32)?;
    let exp = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?.exp()?;
    let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
    let ids = probs.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, topk)?.contiguous()?;
    let top = probs.gather(&ids, D::Minus1)?;
    let top = top.broadcast_div(&top.sum_keepdim(D::Minus1)?)?.contiguous()?;
    Ok((ids, top))
}

/// candle's own expert loop (the baseline): reads the routing back to the host, then per
/// expert gathers its tokens, runs fc1 / SwiGLU / fc2 and adds the weighted rows into y,
/// summed in `accumulate`: f32 for the reference (rounded to bf16 once), bf16 for the timed
/// baseline.
fn experts_candle_loop(
    x: &Tensor,
    ids: &Tensor,
    probs: &Tensor,
    w: &SparseMoeWeights,
    shape: Shape,
    accumulate: DType,
) -> candle_core::Result<Tensor> {
    let device = x.device();
    let ids_host: Vec<Vec<u32>> = ids.to_vec2()?;
    let probs_host: Vec<Vec<f32>> = probs.to_vec2()?;
    let mut tokens_of = vec![Vec::<u32>::new(); shape.experts];
    let mut weights_of = vec![Vec::<f32>::new(); shape.experts];
    for (token, (row_ids, row_probs)) in ids_host.iter().zip(&probs_host).enumerate() {
        for (&expert, &p) in row_ids.iter().zip(row_probs) {
            tokens_of[expert as usize].push(token as u32);
            weights_of[expert as usize].push(p);
        }
    }
    let f = shape.ffn;
    let mut y = Tensor::zeros((shape.tokens, shape.hidden), accumulate, device)?;
    for expert in 0..shape.experts {
        let rows = tokens_of[expert].len();
        if rows == 0 {
            continue;
        }
        let index = Tensor::new(tokens_of[expert].as_slice(), device)?;
        let h = x.index_select(&index, 0)?.matmul(&w.fc1.get(expert)?.t()?)?;
        let act = (h.narrow(1, 0, f)?.silu()? * h.narrow(1, f, f)?)?;
        let out = act.matmul(&w.fc2.get(expert)?.t()?)?.to_dtype(accumulate)?;
        let p = Tensor::new(weights_of[expert].as_slice(), device)?.reshape((rows, 1))?.to_dtype(accumulate)?;
        y = y.index_add(&index, &out.broadcast_mul(&p)?, 0)?;
    }
    y.to_dtype(DType::BF16)
}

/// The inputs a captured graph reads: fixed tensors that each step overwrites in place.
struct GraphInputs {
    x: Tensor,
    ids: Tensor,
    probs: Tensor,
}

impl GraphInputs {
    fn write(&self, x: &Tensor, ids: &Tensor, probs: &Tensor) -> candle_core::Result<()> {
        self.x.slice_set(x, 0, 0)?;
        self.ids.slice_set(ids, 0, 0)?;
        self.probs.slice_set(probs, 0, 0)
    }
}

/// Elementwise |got - want| <= |want| / 64 + rms(want) / 32. The two paths round to bf16 at
/// different points: candle rounds SiLU(gate) before multiplying by up, capturable-moe rounds the
/// product once; that difference (about 0.2% of an activation, random) sums over F terms into
/// about 0.2% of the output's rms, whose maximum over millions of elements is about 1%. A
/// wrong expert, weight or route is off by the output's own scale.
fn compare(got: &Tensor, want: &Tensor) -> candle_core::Result<(usize, f32, f32)> {
    let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let rms = (want.iter().map(|v| v * v).sum::<f32>() / want.len() as f32).sqrt();
    let mut bad = 0;
    let mut max_err = 0f32;
    for (g, w) in got.iter().zip(&want) {
        let err = (g - w).abs();
        max_err = if err.is_nan() { f32::INFINITY } else { max_err.max(err) };
        bad += usize::from(err.is_nan() || err > w.abs() / 64.0 + rms / 32.0);
    }
    Ok((bad, max_err, rms))
}

fn time_ms(
    reps: usize,
    stream_sync: &dyn Fn() -> AnyResult<()>,
    mut body: impl FnMut() -> AnyResult<()>,
) -> AnyResult<f64> {
    body()?; // warm-up
    stream_sync()?;
    let start = Instant::now();
    for _ in 0..reps {
        body()?;
    }
    stream_sync()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

fn parse_args() -> AnyResult<(Shape, usize, usize)> {
    let mut shape = Shape { experts: 128, tokens: 4096, topk: 8, hidden: 2048, ffn: 768 };
    let (mut reps, mut steps) = (20, 3);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value: usize = args.next().ok_or(format!("{flag} needs a value"))?.parse()?;
        match flag.as_str() {
            "--experts" => shape.experts = value,
            "--tokens" => shape.tokens = value,
            "--topk" => shape.topk = value,
            "--hidden" => shape.hidden = value,
            "--ffn" => shape.ffn = value,
            "--reps" => reps = value.max(1),
            "--steps" => steps = value.max(1),
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    Ok((shape, reps, steps))
}

fn main() -> AnyResult<()> {
    let (shape, reps, steps) = parse_args()?;
    // A stream of its own (candle's default is the per-thread default stream): everything
    // below, candle's ops and capturable-moe's launches, runs on it in order.
    let device = match Device::new_cuda_with_stream(0) {
        Ok(device) => device,
        Err(e) if std::env::var("CAPMOE_REQUIRE_GPU").as_deref() != Ok("1") => {
            println!("skipping: no usable GPU ({e})");
            return Ok(());
        }
        Err(e) => return Err(format!("CAPMOE_REQUIRE_GPU=1 but no usable GPU: {e}").into()),
    };
    let stream = device.as_cuda_device()?.cuda_stream();
    let sync = || -> AnyResult<()> { Ok(stream.synchronize()?) };
    println!("{shape:?}, bf16, fp32 router probs");

    let weights = SparseMoeWeights::random(shape, &device)?;
    let config = MoeConfig {
        num_experts: shape.experts,
        hidden: shape.hidden,
        ffn: shape.ffn,
        topk: shape.topk,
        max_tokens: shape.tokens,
        capacity: None,
        expert_capacity: None,
        dtype: capturable_moe::dtype::DType::Bf16,
        prob_dtype: capturable_moe::dtype::DType::F32,
        wgrad_accumulate: false,
    };
    // The plan lives on candle's stream, so it shares candle's CUDA context.
    let mut moe = MoeExperts::<bf16>::new(config, &stream)?;

    let new_batch = || -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let x = Tensor::randn(0f32, 1.0, (shape.tokens, shape.hidden), &device)?.to_dtype(DType::BF16)?;
        let (ids, probs) = route(&x, &weights.router, shape.topk)?;
        Ok((x, ids, probs))
    };
    let (x, ids, probs) = new_batch()?;
    let inputs = GraphInputs { x: x.copy()?, ids: ids.copy()?, probs: probs.copy()? };
    let y = Tensor::zeros((shape.tokens, shape.hidden), DType::BF16, &device)?;

    // capturable-moe views of candle's memory (u32 expert ids read as i32: the same bits).
    let x_buf = CandleBuffer::<bf16>::of(&inputs.x)?;
    let ids_buf = CandleBuffer::<i32>::of(&inputs.ids)?;
    let probs_buf = CandleBuffer::<f32>::of(&inputs.probs)?;
    let fc1_buf = CandleBuffer::<bf16>::of(&weights.fc1)?;
    let fc2_buf = CandleBuffer::<bf16>::of(&weights.fc2)?;
    let mut y_buf = CandleBuffer::<bf16>::of(&y)?;
    let mut forward = || {
        moe.forward(&stream, &x_buf, &ids_buf, &probs_buf, Tokens::Host(shape.tokens), &fc1_buf, &fc2_buf, &mut y_buf)
    };
    forward()?; // eager once: module loads and kernel attributes happen outside the capture
    sync()?;
    let graph = capture(&stream, &mut forward)?;

    let mut failed = false;
    for step in 0..steps {
        let (x, ids, probs) = if step == 0 { (x.clone(), ids.clone(), probs.clone()) } else { new_batch()? };
        inputs.write(&x, &ids, &probs)?;
        // NaN in y first: a replay that wrote nothing (or only some rows) cannot pass.
        y.slice_set(&Tensor::full(f32::NAN, (shape.tokens, shape.hidden), &device)?.to_dtype(DType::BF16)?, 0, 0)?;
        graph.launch()?;
        let want = experts_candle_loop(&x, &ids, &probs, &weights, shape, DType::F32)?;
        sync()?;
        let (bad, max_err, rms) = compare(&y, &want)?;
        let flags = (stream.clone_dtoh(&moe.maps.flags)?[0], stream.clone_dtoh(&moe.gemm_flags)?[0]);
        let ok = bad == 0 && flags == (0, 0);
        failed |= !ok;
        println!(
            "step {step}: graph replay vs candle loop: {} ({bad} of {} elements outside tolerance, max |err| {max_err:.4}, rms {rms:.4}, routing/GEMM flags {flags:?})",
            if ok { "ok" } else { "FAIL" },
            shape.tokens * shape.hidden
        );
    }

    let capmoe_ms = time_ms(reps, &sync, || Ok(graph.launch()?))?;
    // The timed loop sums in bf16, as candle-transformers' MoE blocks do; the f32 sum (the
    // reference above) moves twice the bytes through index_add and is shown beside it.
    let time_candle = |accumulate: DType| {
        time_ms(reps, &sync, || {
            experts_candle_loop(&inputs.x, &inputs.ids, &inputs.probs, &weights, shape, accumulate)?;
            Ok(())
        })
    };
    let candle_ms = time_candle(DType::BF16)?;
    let candle_f32_ms = time_candle(DType::F32)?;
    println!("experts of one layer (router excluded, same inputs), mean of {reps}:");
    println!("  candle per-expert loop, bf16 sum:  {candle_ms:9.3} ms");
    println!("  candle per-expert loop, f32 sum:   {candle_f32_ms:9.3} ms");
    println!("  capturable-moe, CUDA graph replay: {capmoe_ms:9.3} ms");
    println!(
        "  speed-up over the bf16-sum loop: {:.2}x (target >= 3x at E=128 T=4096 k=8 H=2048 F=768)",
        candle_ms / capmoe_ms
    );
    if failed {
        return Err("outputs differ from candle's loop beyond bf16 tolerance, or a flag was raised".into());
    }
    Ok(())
}
