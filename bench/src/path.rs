//! Rows for the whole expert path (`expert_fwd`, `expert_bwd`) and the Echo planner
//! (`echo_plan`), all as CUDA-graph replays.

use std::sync::Arc;
use std::time::Instant;

use crate::echo_timing::{time_plan_reroute, Form};
use capturable_moe::dtype::DType;
use capturable_moe::echo::{Algorithm, EchoConfig};
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::moe::{MoeConfig, MoeExperts};
use capturable_moe::routing::{RoutingConfig, RoutingPlan, Tokens};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::measure::{median, random_bf16, time, Row};

/// Expert-path configurations of the torch anchors: (E, T, k, H, F).
pub const PATHS: &[(usize, usize, usize, usize, usize)] = &[(128, 4096, 8, 2048, 768), (64, 128, 8, 2048, 1408)];

/// The shape name of an expert-path row (also used to match the torch anchor rows).
pub fn path_name(e: usize, t: usize, k: usize, h: usize, f: usize) -> String {
    format!("expert_E{e}_T{t}_k{k}_H{h}_F{f}")
}

fn row(shape: &str, op: &str, imp: &str, us: f64, flops: f64, host_us: Option<f64>, note: Option<String>) -> Row {
    Row {
        shape: shape.into(),
        routing: "uniform".into(),
        op: op.into(),
        imp: imp.into(),
        us,
        tflops: flops / us * 1e-6,
        gbps: f64::NAN,
        host_us,
        note,
    }
}

/// Uniform top-k routing with k distinct experts per token, and softmax-like probabilities.
pub fn topk_routing(e: usize, t: usize, k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids = Vec::with_capacity(t * k);
    let mut probs = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::with_capacity(k);
        while chosen.len() < k {
            let id = rng.random_range(0..e as i32);
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        ids.extend(chosen);
        probs.extend((0..k).map(|_| rng.random_range(0.01f32..1.0) / k as f32));
    }
    (ids, probs)
}

pub fn expert_rows(stream: &Arc<CudaStream>, reps: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    for &(e, t, k, h, f) in PATHS {
        let name = &path_name(e, t, k, h, f);
        eprintln!("[expert path] {name}");
        match expert_case(stream, reps, name, e, t, k, h, f) {
            Ok(r) => rows.extend(r),
            Err(err) => rows.push(row(
                name,
                "expert_fwd",
                "capmoe-graph",
                f64::NAN,
                0.0,
                None,
                Some(format!("unavailable: {err}")),
            )),
        }
    }
    rows
}

#[allow(clippy::too_many_arguments)]
fn expert_case(
    stream: &Arc<CudaStream>,
    reps: usize,
    name: &str,
    e: usize,
    t: usize,
    k: usize,
    h: usize,
    f: usize,
) -> capturable_moe::Result<Vec<Row>> {
    let config = MoeConfig {
        num_experts: e,
        hidden: h,
        ffn: f,
        topk: k,
        max_tokens: t,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    };
    let mut moe = MoeExperts::<bf16>::new(config, stream)?;
    let (ids_h, probs_h) = topk_routing(e, t, k, 11);
    let ids = stream.clone_htod(&ids_h)?;
    let probs = stream.clone_htod(&probs_h)?;
    let tokens: CudaSlice<i32> = stream.clone_htod(&[t as i32])?;
    let x = random_bf16(stream, t * h, 1);
    let dy = random_bf16(stream, t * h, 2);
    let w1 = random_bf16(stream, e * 2 * f * h, 3);
    let w2 = random_bf16(stream, e * h * f, 4);
    let mut y = stream.alloc_zeros::<bf16>(t * h)?;
    let mut dx = stream.alloc_zeros::<bf16>(t * h)?;
    let mut dprobs = stream.alloc_zeros::<f32>(t * k)?;
    let mut dw1 = stream.alloc_zeros::<bf16>(e * 2 * f * h)?;
    let mut dw2 = stream.alloc_zeros::<bf16>(e * h * f)?;
    let fwd_flops = 6.0 * (t * k * h * f) as f64;
    let tok = Tokens::Device(&tokens);

    moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y)?;
    let fwd = capture(stream, || moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y))?;
    let bwd =
        capture(stream, || moe.backward(stream, &dy, &probs, tok, &w1, &w2, &mut dx, &mut dprobs, &mut dw1, &mut dw2))?;
    let both = capture(stream, || {
        moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y)?;
        moe.backward(stream, &dy, &probs, tok, &w1, &w2, &mut dx, &mut dprobs, &mut dw1, &mut dw2)
    })?;
    let (fwd_us, _) = time(stream, reps, |_| fwd.launch().unwrap());
    let (bwd_us, _) = time(stream, reps, |_| bwd.launch().unwrap());
    let (both_us, both_host) = time(stream, reps, |_| both.launch().unwrap());

    // The grouped GEMMs alone, on the routing the forward produced, also as graphs.
    let cap = moe.capacity();
    let splits = &moe.maps.m_splits_i32;
    let gemm = |op: GemmOp, n: usize, kk: usize| GroupedGemm::new(GroupedGemmSpec::new(op, e, n, kk, cap), stream);
    let plans = [
        gemm(GemmOp::Fprop, 2 * f, h)?,
        gemm(GemmOp::Fprop, h, f)?,
        gemm(GemmOp::Dgrad, h, f)?,
        gemm(GemmOp::Wgrad, h, f)?,
        gemm(GemmOp::Dgrad, 2 * f, h)?,
        gemm(GemmOp::Wgrad, 2 * f, h)?,
    ];
    let ws_len = plans.iter().map(|p| p.workspace_bytes()).max().unwrap_or(1);
    let mut ws = stream.alloc_zeros::<u8>(ws_len)?;
    let rows_h = random_bf16(stream, cap * h, 5);
    let mut big = random_bf16(stream, cap * 2 * f, 6);
    let mut mid = random_bf16(stream, cap * f, 7);
    let mut out = random_bf16(stream, cap * h, 8);
    let fwd_gemms = capture(stream, || {
        plans[0].run(stream, &rows_h, &w1, &mut big, splits, None, &mut ws)?;
        plans[1].run(stream, &mid, &w2, &mut out, splits, None, &mut ws)
    })?;
    let bwd_gemms = capture(stream, || {
        plans[2].run(stream, &out, &w2, &mut mid, splits, None, &mut ws)?;
        plans[3].run(stream, &out, &mid, &mut dw2, splits, None, &mut ws)?;
        plans[4].run(stream, &big, &w1, &mut out, splits, None, &mut ws)?;
        plans[5].run(stream, &big, &rows_h, &mut dw1, splits, None, &mut ws)
    })?;
    let (fwd_gemm_us, _) = time(stream, reps, |_| fwd_gemms.launch().unwrap());
    let (bwd_gemm_us, _) = time(stream, reps, |_| bwd_gemms.launch().unwrap());

    let stages = forward_stage_times(stream, reps, &moe.config().routing_config(), &ids, &probs, tok, &x, &mut y)?;

    // Host cost of one replay of forward + backward, without waiting for the GPU.
    stream.synchronize()?;
    let mut host = Vec::new();
    for _ in 0..50 {
        let start = Instant::now();
        both.launch()?;
        host.push(start.elapsed().as_secs_f64() * 1e6);
        stream.synchronize()?;
    }
    let replay_host = median(&mut host);

    Ok(vec![
        row(
            name,
            "expert_fwd",
            "capmoe-graph",
            fwd_us,
            fwd_flops,
            None,
            Some(format!("{:.2}x its two grouped GEMMs", fwd_us / fwd_gemm_us)),
        ),
        row(
            name,
            "expert_fwd",
            "capmoe-gemms-graph",
            fwd_gemm_us,
            fwd_flops,
            None,
            Some("fc1 + fc2 grouped GEMMs alone".into()),
        ),
        row(
            name,
            "expert_fwd",
            "capmoe-routing-graph",
            stages.iter().map(|s| s.1).sum(),
            0.0,
            None,
            Some(stages_note(&stages)),
        ),
        row(
            name,
            "expert_bwd",
            "capmoe-graph",
            bwd_us,
            2.0 * fwd_flops,
            None,
            Some(format!("{:.2}x its four grouped GEMMs", bwd_us / bwd_gemm_us)),
        ),
        row(
            name,
            "expert_bwd",
            "capmoe-gemms-graph",
            bwd_gemm_us,
            2.0 * fwd_flops,
            None,
            Some("dgrad + wgrad of fc2 and fc1 alone".into()),
        ),
        row(
            name,
            "expert_fwd_bwd",
            "capmoe-graph",
            both_us,
            3.0 * fwd_flops,
            Some(both_host),
            Some(format!("host time of one replay {replay_host:.1} us (launch only)")),
        ),
    ])
}

/// GPU time of each non-GEMM stage of the forward, each captured alone in a graph and
/// replayed (build, permute, SwiGLU, unpermute), with buffers of its own.
#[allow(clippy::too_many_arguments)]
fn forward_stage_times(
    stream: &Arc<CudaStream>,
    reps: usize,
    config: &RoutingConfig,
    ids: &CudaSlice<i32>,
    probs: &CudaSlice<f32>,
    tokens: Tokens<'_>,
    x: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
) -> capturable_moe::Result<Vec<(&'static str, f64)>> {
    let plan = RoutingPlan::new(config.clone())?;
    let mut maps = plan.alloc_maps(stream)?;
    let mut rows = stream.alloc_zeros::<bf16>(plan.rows_len())?;
    let h = random_bf16(stream, plan.fc1_len(), 9);
    let mut act = stream.alloc_zeros::<bf16>(plan.act_len())?;
    plan.build(stream, ids, tokens, &mut maps)?;
    let timed = |name: &'static str, f: &mut dyn FnMut() -> capturable_moe::Result<()>| {
        let graph = capture(stream, &mut *f)?;
        let (us, _) = time(stream, reps, |_| graph.launch().unwrap());
        Ok::<_, capturable_moe::Error>((name, us))
    };
    let build = timed("build", &mut || plan.build(stream, ids, tokens, &mut maps))?;
    let permute = timed("permute", &mut || plan.permute(stream, x, &maps.row_of_route, tokens, &mut rows))?;
    let swiglu = timed("swiglu", &mut || plan.swiglu(stream, &h, &maps.offsets, &mut act))?;
    let unpermute = timed("unpermute", &mut || plan.unpermute(stream, &rows, &maps.row_of_route, probs, tokens, y))?;
    Ok(vec![build, permute, swiglu, unpermute])
}

fn stages_note(stages: &[(&'static str, f64)]) -> String {
    let parts: Vec<String> = stages.iter().map(|(n, us)| format!("{n} {us:.1}")).collect();
    format!("routing stages alone, us: {}", parts.join(", "))
}

/// Echo plan + reroute at the target shape, both assignment algorithms and forms: GPU
/// time of a graph replay, and (`host_us`) the host time of one eager enqueue.
pub fn echo_rows(stream: &Arc<CudaStream>, reps: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    for (spare, algorithm) in [(1usize, Algorithm::Approx), (2, Algorithm::Greedy)] {
        for (form, form_name) in [(Form::TopK, "topk"), (Form::Dense, "dense")] {
            let cfg = EchoConfig {
                ep: 64,
                num_experts: 256,
                spare_per_rank: spare,
                ep_rank: 0,
                topk: 8,
                algorithm,
                threshold_multiplier: 0.0,
            };
            let shape = format!("echo_E256_EP64_S{spare}_T8192_k8_{form_name}");
            eprintln!("[echo] {shape}");
            let r = match time_plan_reroute(stream, cfg, 8192, form, reps.max(50)) {
                Ok(t) => {
                    // The table prints neither host_us nor notes: say it here too.
                    eprintln!(
                        "[echo] {shape}: graph replay median {:.2} us (min {:.2}), eager host enqueue median {:.2} us",
                        t.median_us, t.min_us, t.host_median_us
                    );
                    let note = format!(
                        "{algorithm:?}; graph replay min {:.1} us over {} replays; host_us: eager enqueue of plan+reroute (median of {} calls, no sync)",
                        t.min_us, t.replays, t.host_calls
                    );
                    row(&shape, "echo_plan", "capmoe-graph", t.median_us, 0.0, Some(t.host_median_us), Some(note))
                }
                Err(e) => {
                    row(&shape, "echo_plan", "capmoe-graph", f64::NAN, 0.0, None, Some(format!("unavailable: {e}")))
                }
            };
            rows.push(r);
        }
    }
    rows
}
