//! Rows for the whole expert path (`expert_fwd`, `expert_bwd`) and the Echo planner
//! (`echo_plan`), all as CUDA-graph replays.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use crate::echo_timing::{time_plan_reroute, Form};
use capturable_moe::dtype::DType;
use capturable_moe::echo::{Algorithm, EchoConfig};
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::moe::{FusedKernel, MoeConfig, MoeExperts, MoeOptions};
use capturable_moe::routing::{RoutingConfig, RoutingPlan, Tokens};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::measure::{median, random_bf16, time, Row};
use crate::runner::Runner;

/// An expert-path configuration: (E, T, k, H, F).
pub type PathShape = (usize, usize, usize, usize, usize);

/// Expert-path configurations of the torch anchors and issue 14's targets (the EP and graph
/// rows use them too).
pub const PATHS: &[PathShape] = &[(128, 4096, 8, 2048, 768), (64, 128, 8, 2048, 1408)];

/// A published H100 figure for a whole expert path, compared with in the report (never
/// measured here). Every source counts 6·T·k·H·F FLOPs forward and twice that backward, as the
/// rows here do, so TFLOP/s compare directly.
pub struct Published {
    pub shape: PathShape,
    /// Short name, the row's `published-<name>` implementation.
    pub name: &'static str,
    pub source: &'static str,
    /// (op, TFLOP/s) with op one of `expert_fwd`, `expert_bwd`, `expert_fwd_bwd`.
    pub figures: &'static [(&'static str, f64)],
}

/// The published fused-MoE figures of issue 14 (H100).
pub const PUBLISHED: &[Published] = &[
    Published {
        shape: (128, 24576, 8, 1536, 256),
        name: "sonicmoe-7b",
        source: "SonicMoE (arXiv 2512.14080) fig. 14, \"7B\"",
        figures: &[("expert_fwd", 364.0), ("expert_bwd", 405.0)],
    },
    Published {
        shape: (128, 32768, 8, 4096, 512),
        name: "sonicmoe-30b",
        source: "SonicMoE (arXiv 2512.14080) fig. 14, \"30B\"",
        figures: &[("expert_fwd", 501.0), ("expert_bwd", 510.0)],
    },
    Published {
        shape: (128, 32768, 8, 2048, 768),
        name: "liger",
        source: "Liger fused MoE (Triton)",
        figures: &[("expert_fwd", 501.0), ("expert_fwd_bwd", 413.0)],
    },
];

/// FLOPs of one forward of the expert path: fc1 (2F outputs) and fc2, 2 per multiply-add.
pub fn forward_flops((_, t, k, h, f): PathShape) -> f64 {
    6.0 * (t * k * h * f) as f64
}

/// FLOPs of `op` (`expert_fwd`, `expert_bwd` = 2x forward, `expert_fwd_bwd` = 3x).
pub fn op_flops(shape: PathShape, op: &str) -> f64 {
    let times = match op {
        "expert_bwd" => 2.0,
        "expert_fwd_bwd" => 3.0,
        _ => 1.0,
    };
    times * forward_flops(shape)
}

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

/// The expert-path plans timed on every shape: the crate's default (`MoeOptions::default()`,
/// every choice `Auto`: what `MoeExperts` picks) and the unfused path, each also as a
/// forward-only plan (`*-inference-graph`: an `expert_fwd` row alone), the fused fc1 alone (in
/// training on sm_90a it writes the permuted rows fc1's unfused wgrad reads), the fused fc1 with
/// fc1's wgrad gathering x (no permuted copy of x anywhere; the rest unfused), the fused kernels with
/// the probability applied in the combine, every fused kernel with the probability in fc1's
/// epilogue (no drows, dy gathered by the fc2 dgrad), and the same but with fc1's wgrad over the
/// permuted rows the fused fc1 writes (`*-prob-in-fc1-rows-graph`: the plain wgrad instead of
/// the gathered one on fc1's side). A plan the fused kernels do not cover becomes an
/// "unavailable" row.
fn variants() -> [(&'static str, MoeOptions); 9] {
    let every = |kernel: FusedKernel| MoeOptions {
        fc1: kernel,
        swiglu_dgrad: kernel,
        fc1_wgrad: kernel,
        prob_in_fc1: FusedKernel::Unfused,
        ..MoeOptions::default()
    };
    let (fused, unfused) = (every(FusedKernel::Fused), every(FusedKernel::Unfused));
    let prob_in_fc1 = MoeOptions { prob_in_fc1: FusedKernel::Fused, ..fused };
    let prob_in_fc1_rows = MoeOptions { fc1_wgrad: FusedKernel::Unfused, ..prob_in_fc1 };
    let fc1_alone = MoeOptions { fc1: FusedKernel::Fused, ..unfused };
    let fc1_side = MoeOptions { fc1_wgrad: FusedKernel::Fused, ..fc1_alone };
    let inference = |options: MoeOptions| MoeOptions { forward_only: true, ..options };
    [
        ("capmoe-graph", MoeOptions::default()),
        ("capmoe-inference-graph", inference(MoeOptions::default())),
        ("capmoe-unfused-graph", unfused),
        ("capmoe-unfused-inference-graph", inference(unfused)),
        ("capmoe-fused-fc1-alone-graph", fc1_alone),
        ("capmoe-fused-fc1-graph", fc1_side),
        ("capmoe-fused-graph", fused),
        ("capmoe-fused-prob-in-fc1-graph", prob_in_fc1),
        ("capmoe-prob-in-fc1-rows-graph", prob_in_fc1_rows),
    ]
}

/// Every expert-path shape: the anchors' ([`PATHS`]) and the published ones ([`PUBLISHED`]).
fn all_path_shapes() -> impl Iterator<Item = PathShape> {
    PATHS.iter().copied().chain(PUBLISHED.iter().map(|p| p.shape))
}

/// The shapes of [`all_path_shapes`] whose name contains one of `filter` (all when empty).
fn path_shapes(filter: &[String]) -> Vec<PathShape> {
    let wanted = |s: &PathShape| filter.is_empty() || filter.iter().any(|f| shape_name(*s).contains(f.as_str()));
    all_path_shapes().filter(wanted).collect()
}

/// Every expert-path shape (of `filter`, see [`path_shapes`]) and variant, a runner unit each (`paths/<shape>/<variant>`): first
/// the default plan of every shape, with its grouped GEMMs alone, routing stages and published
/// figures; then, when `fused`, the unfused path and the forced fused variants (whose kernels
/// are the likeliest to fault or hang: that loses no default row).
pub fn expert_rows(runner: &mut Runner, stream: &Arc<CudaStream>, reps: usize, fused: bool, filter: &[String]) {
    let [default, other_variants @ ..] = variants();
    let shapes = path_shapes(filter);
    // (forward, backward) GEMMs-alone times of each shape, for the fused rows' notes.
    let mut gemm_us: Vec<(PathShape, (f64, f64))> = Vec::new();
    for &shape in &shapes {
        let name = shape_name(shape);
        eprintln!("[expert path] {name} {}", default.0);
        runner.run(&format!("paths/{name}/{}", default.0), |rows| {
            variant_rows(stream, reps, shape, default, rows);
            let measured = rows.len();
            match gemms_and_stages(stream, reps, &name, shape, rows) {
                Ok(us) => {
                    note_gemm_ratio(&mut rows[..measured], us);
                    gemm_us.push((shape, us));
                }
                Err(err) => rows.push(unavailable(&name, "expert_fwd", "capmoe-gemms-graph", &err)),
            }
            rows.extend(published_rows(shape, &name));
        });
    }
    for &shape in shapes.iter().filter(|_| fused) {
        let name = shape_name(shape);
        for variant in other_variants {
            eprintln!("[expert path] {name} {}", variant.0);
            runner.run(&format!("paths/{name}/{}", variant.0), |rows| {
                variant_rows(stream, reps, shape, variant, rows);
                if let Some(&(_, us)) = gemm_us.iter().find(|(s, _)| *s == shape) {
                    note_gemm_ratio(rows, us);
                }
            });
        }
    }
}

fn shape_name((e, t, k, h, f): PathShape) -> String {
    path_name(e, t, k, h, f)
}

/// The forward, backward and forward + backward rows of one variant on one shape, each with
/// its TFLOP/s over any published figure in its note; or one "unavailable" row, under the op
/// whose setup, capture or replay failed.
fn variant_rows(
    stream: &Arc<CudaStream>,
    reps: usize,
    shape: PathShape,
    (imp, options): (&str, MoeOptions),
    rows: &mut Vec<Row>,
) {
    let name = shape_name(shape);
    match expert_case(stream, reps, &name, shape, options, imp) {
        Ok(mut measured) => {
            note_published_ratio(shape, &mut measured);
            rows.extend(measured);
        }
        Err((op, err)) => rows.push(unavailable(&name, op, imp, &err)),
    }
}

fn unavailable(name: &str, op: &str, imp: &str, err: &capturable_moe::Error) -> Row {
    row(name, op, imp, f64::NAN, 0.0, None, Some(format!("unavailable: {err}")))
}

/// Adds to the note of each timed forward / backward row its time over the grouped GEMMs'
/// alone (`gemm_us`: forward, backward).
fn note_gemm_ratio(rows: &mut [Row], (fwd_gemm_us, bwd_gemm_us): (f64, f64)) {
    for r in rows.iter_mut().filter(|r| r.us.is_finite()) {
        let (gemms_us, what) = match r.op.as_str() {
            "expert_fwd" => (fwd_gemm_us, "its two grouped GEMMs"),
            "expert_bwd" => (bwd_gemm_us, "its four grouped GEMMs"),
            _ => continue,
        };
        r.note = Some(format!("{:.2}x {what}; {}", r.us / gemms_us, r.note.take().unwrap_or_default()));
    }
}

/// Adds to the note of each measured expert-path row its TFLOP/s over each published figure
/// of `shape` for the same op.
fn note_published_ratio(shape: PathShape, rows: &mut [Row]) {
    for published in PUBLISHED.iter().filter(|p| p.shape == shape) {
        for &(op, tflops) in published.figures {
            let measured = |r: &Row| r.op == op && variants().iter().any(|(imp, _)| *imp == r.imp);
            for r in rows.iter_mut().filter(|r| measured(r) && r.us.is_finite()) {
                let ratio = r.tflops / tflops;
                let note = format!("{ratio:.2}x {} published TFLOP/s", published.name);
                r.note = Some(match r.note.take() {
                    Some(old) => format!("{old}; {note}"),
                    None => note,
                });
            }
        }
    }
}

/// A `published-<name>` row per published figure of `shape`: its time at that TFLOP/s.
fn published_rows(shape: PathShape, name: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for published in PUBLISHED.iter().filter(|p| p.shape == shape) {
        for &(op, tflops) in published.figures {
            let flops = op_flops(shape, op);
            let us = flops / (tflops * 1e6);
            let note = format!("published figure, not measured here: {}", published.source);
            rows.push(row(name, op, &format!("published-{}", published.name), us, flops, None, Some(note)));
        }
    }
    rows
}

/// The synthetic inputs of one expert-path case, on the device.
struct PathInputs {
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    tokens: CudaSlice<i32>,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
}

impl PathInputs {
    fn new(stream: &Arc<CudaStream>, (e, t, k, h, f): PathShape) -> capturable_moe::Result<PathInputs> {
        let (ids_h, probs_h) = topk_routing(e, t, k, 11);
        Ok(PathInputs {
            ids: stream.clone_htod(&ids_h)?,
            probs: stream.clone_htod(&probs_h)?,
            tokens: stream.clone_htod(&[t as i32])?,
            x: random_bf16(stream, t * h, 1),
            dy: random_bf16(stream, t * h, 2),
            w1: random_bf16(stream, e * 2 * f * h, 3),
            w2: random_bf16(stream, e * h * f, 4),
        })
    }
}

fn path_config((e, t, k, h, f): PathShape) -> MoeConfig {
    MoeConfig {
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
    }
}

/// Forward, backward and forward + backward of one plan, each captured once and replayed; on
/// failure, the op whose part failed (setup counts as `expert_fwd`) and the error.
fn expert_case(
    stream: &Arc<CudaStream>,
    reps: usize,
    name: &str,
    shape: PathShape,
    options: MoeOptions,
    imp: &str,
) -> Result<Vec<Row>, (&'static str, capturable_moe::Error)> {
    let stage = Cell::new("expert_fwd");
    timed_expert_case(stream, reps, name, shape, options, imp, &stage).map_err(|e| (stage.get(), e))
}

/// [`expert_case`]'s body; `stage` follows the op being set up, captured or replayed.
fn timed_expert_case(
    stream: &Arc<CudaStream>,
    reps: usize,
    name: &str,
    shape: PathShape,
    options: MoeOptions,
    imp: &str,
    stage: &Cell<&'static str>,
) -> capturable_moe::Result<Vec<Row>> {
    let (e, t, k, h, f) = shape;
    let mut moe = MoeExperts::<bf16>::with_options(path_config(shape), options, stream)?;
    let PathInputs { ids, probs, tokens, x, dy, w1, w2 } = PathInputs::new(stream, shape)?;
    let mut y = stream.alloc_zeros::<bf16>(t * h)?;
    let mut dx = stream.alloc_zeros::<bf16>(t * h)?;
    let mut dprobs = stream.alloc_zeros::<f32>(t * k)?;
    let mut dw1 = stream.alloc_zeros::<bf16>(e * 2 * f * h)?;
    let mut dw2 = stream.alloc_zeros::<bf16>(e * h * f)?;
    let tok = Tokens::Device(&tokens);

    moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y)?;
    let fwd = capture(stream, || moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y))?;
    let kernels = plan_kernels(&moe);
    if options.forward_only {
        let (fwd_us, _) = time(stream, reps, |_| fwd.launch().unwrap());
        let note = format!("{kernels}; forward graph of a forward-only plan");
        return Ok(vec![row(name, "expert_fwd", imp, fwd_us, op_flops(shape, "expert_fwd"), None, Some(note))]);
    }
    stage.set("expert_bwd");
    let bwd = capture(stream, || {
        moe.backward(stream, &x, &dy, &probs, tok, &w1, &w2, &mut dx, &mut dprobs, &mut dw1, &mut dw2)
    })?;
    stage.set("expert_fwd_bwd");
    let both = capture(stream, || {
        moe.forward(stream, &x, &ids, &probs, tok, &w1, &w2, &mut y)?;
        moe.backward(stream, &x, &dy, &probs, tok, &w1, &w2, &mut dx, &mut dprobs, &mut dw1, &mut dw2)
    })?;
    stage.set("expert_fwd");
    let (fwd_us, _) = time(stream, reps, |_| fwd.launch().unwrap());
    stage.set("expert_bwd");
    let (bwd_us, _) = time(stream, reps, |_| bwd.launch().unwrap());
    stage.set("expert_fwd_bwd");
    let (both_us, both_host) = time(stream, reps, |_| both.launch().unwrap());

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
    let timed = |op: &str, us: f64, host_us: Option<f64>, note: String| {
        row(name, op, imp, us, op_flops(shape, op), host_us, Some(format!("{kernels}; {note}")))
    };
    Ok(vec![
        timed("expert_fwd", fwd_us, None, "forward graph".into()),
        timed("expert_bwd", bwd_us, None, "backward graph".into()),
        timed(
            "expert_fwd_bwd",
            both_us,
            Some(both_host),
            format!("host time of one replay {replay_host:.1} us (launch only)"),
        ),
    ])
}

/// Which kernels a plan runs, for the rows' notes.
fn plan_kernels(moe: &MoeExperts<bf16>) -> String {
    let fused_or_not = |fused: bool| if fused { "fused" } else { "unfused" };
    format!(
        "fc1 {}, fc2 dgrad + SwiGLU backward {}, fc1 wgrad {}, probability in {}",
        fused_or_not(moe.fc1_is_fused()),
        fused_or_not(moe.swiglu_dgrad_is_fused()),
        if moe.fc1_wgrad_is_gathered() { "gathered" } else { "over permuted rows" },
        if moe.prob_is_in_fc1() { "fc1's epilogue (dy gathered)" } else { "the combine" }
    )
}

/// The grouped GEMMs alone (on the routing of the shape's inputs, as graphs) and the
/// unfused forward's routing stages alone, pushed onto `rows`; returns the GEMMs' (forward,
/// backward) times.
fn gemms_and_stages(
    stream: &Arc<CudaStream>,
    reps: usize,
    name: &str,
    shape: PathShape,
    rows: &mut Vec<Row>,
) -> capturable_moe::Result<(f64, f64)> {
    let (e, t, _k, h, f) = shape;
    let config = path_config(shape);
    let inputs = PathInputs::new(stream, shape)?;
    let tok = Tokens::Device(&inputs.tokens);
    let plan = RoutingPlan::new(config.routing_config())?;
    let mut maps = plan.alloc_maps(stream)?;
    plan.build(stream, &inputs.ids, tok, &mut maps)?;
    let cap = plan.rows_len() / h;
    let splits = &maps.m_splits_i32;
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
    let mut dw1 = stream.alloc_zeros::<bf16>(e * 2 * f * h)?;
    let mut dw2 = stream.alloc_zeros::<bf16>(e * h * f)?;
    let (w1, w2) = (&inputs.w1, &inputs.w2);
    let fwd_gemms = capture(stream, || {
        plans[0].run(stream, &rows_h, w1, &mut big, splits, None, &mut ws)?;
        plans[1].run(stream, &mid, w2, &mut out, splits, None, &mut ws)
    })?;
    let bwd_gemms = capture(stream, || {
        plans[2].run(stream, &out, w2, &mut mid, splits, None, &mut ws)?;
        plans[3].run(stream, &out, &mid, &mut dw2, splits, None, &mut ws)?;
        plans[4].run(stream, &big, w1, &mut out, splits, None, &mut ws)?;
        plans[5].run(stream, &big, &rows_h, &mut dw1, splits, None, &mut ws)
    })?;
    let (fwd_gemm_us, _) = time(stream, reps, |_| fwd_gemms.launch().unwrap());
    let (bwd_gemm_us, _) = time(stream, reps, |_| bwd_gemms.launch().unwrap());
    drop((fwd_gemms, bwd_gemms, ws, rows_h, big, mid, out, dw1, dw2));

    let mut y = stream.alloc_zeros::<bf16>(t * h)?;
    let stages = forward_stage_times(
        stream,
        reps,
        &config.routing_config(),
        &inputs.ids,
        &inputs.probs,
        tok,
        &inputs.x,
        &mut y,
    )?;

    rows.push(row(
        name,
        "expert_fwd",
        "capmoe-gemms-graph",
        fwd_gemm_us,
        op_flops(shape, "expert_fwd"),
        None,
        Some("fc1 + fc2 grouped GEMMs alone".into()),
    ));
    rows.push(row(
        name,
        "expert_bwd",
        "capmoe-gemms-graph",
        bwd_gemm_us,
        op_flops(shape, "expert_bwd"),
        None,
        Some("dgrad + wgrad of fc2 and fc1 alone".into()),
    ));
    rows.push(row(
        name,
        "expert_fwd",
        "capmoe-routing-graph",
        stages.iter().map(|s| s.1).sum(),
        0.0,
        None,
        Some(stages_note(&stages)),
    ));
    Ok((fwd_gemm_us, bwd_gemm_us))
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

/// Echo plan + reroute at the target shape, both assignment algorithms and the three
/// forms (top-k, dense, top-k block-balanced): GPU time of a graph replay, and (`host_us`) the
/// host time of one eager enqueue.
pub fn echo_rows(stream: &Arc<CudaStream>, reps: usize, rows: &mut Vec<Row>) {
    for (spare, algorithm) in [(1usize, Algorithm::Approx), (2, Algorithm::Greedy)] {
        // EpMoe's form: the top-k reroute block-balanced at 1.25x the balanced block of 8192 x 8
        // routes over 64 peers (1280).
        let capped = Form::TopKCapped(capturable_moe::ep::balanced_capacity(8192, 8, 64, 1.25));
        for (form, form_name) in [(Form::TopK, "topk"), (Form::Dense, "dense"), (capped, "topk_capped")] {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measured(shape: PathShape, op: &str, imp: &str, us: f64) -> Row {
        let name = path_name(shape.0, shape.1, shape.2, shape.3, shape.4);
        row(&name, op, imp, us, op_flops(shape, op), None, None)
    }

    #[test]
    fn flop_counts_follow_the_papers() {
        let shape = (128, 32768, 8, 2048, 768);
        let fwd = 6.0 * 32768.0 * 8.0 * 2048.0 * 768.0;
        assert_eq!(op_flops(shape, "expert_fwd"), fwd);
        assert_eq!(op_flops(shape, "expert_bwd"), 2.0 * fwd);
        assert_eq!(op_flops(shape, "expert_fwd_bwd"), 3.0 * fwd);
    }

    #[test]
    fn published_rows_carry_the_figure_and_measured_rows_the_ratio() {
        let liger = PUBLISHED.iter().find(|p| p.name == "liger").unwrap();
        let shape = liger.shape;
        let name = path_name(shape.0, shape.1, shape.2, shape.3, shape.4);
        // A measured forward exactly twice as fast as Liger's 501 TFLOP/s.
        let fwd_us = op_flops(shape, "expert_fwd") / (2.0 * 501.0 * 1e6);
        let mut rows = vec![
            measured(shape, "expert_fwd", "capmoe-fused-graph", fwd_us),
            measured(shape, "expert_fwd", "capmoe-gemms-graph", fwd_us),
        ];
        note_published_ratio(shape, &mut rows);
        rows.extend(published_rows(shape, &name));

        let published: Vec<&Row> = rows.iter().filter(|r| r.imp == "published-liger").collect();
        assert_eq!(published.len(), liger.figures.len());
        let fwd = published.iter().find(|r| r.op == "expert_fwd").unwrap();
        assert!((fwd.tflops - 501.0).abs() < 1e-9, "{}", fwd.tflops);
        assert!(fwd.note.as_deref().unwrap().contains("not measured here"));
        assert_eq!(rows[0].note.as_deref(), Some("2.00x liger published TFLOP/s"));
        // Only the expert-path variants are compared, not the GEMMs-alone row.
        assert_eq!(rows[1].note, None);
    }

    #[test]
    fn path_shapes_filter_by_name() {
        assert_eq!(path_shapes(&[]).len(), PATHS.len() + PUBLISHED.len());
        let decode = path_shapes(&["E64_T128_".into()]);
        assert_eq!(decode.len(), 1);
        assert_eq!(shape_name(decode[0]), "expert_E64_T128_k8_H2048_F1408");
        assert!(path_shapes(&["no such shape".into()]).is_empty());
    }

    #[test]
    fn shapes_without_a_published_figure_get_no_rows() {
        let mut rows = vec![measured(PATHS[0], "expert_fwd", "capmoe-graph", 100.0)];
        note_published_ratio(PATHS[0], &mut rows);
        rows.extend(published_rows(PATHS[0], "x"));
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].note, None);
    }

    #[test]
    fn variants_are_distinct_plans_with_distinct_names() {
        let all = variants();
        for (i, (name, options)) in all.iter().enumerate() {
            assert!(name.starts_with("capmoe-") && name.ends_with("-graph"), "{name}");
            for (other_name, other) in &all[..i] {
                assert_ne!(name, other_name);
                assert_ne!(options, other, "{name} and {other_name} time the same plan");
            }
        }
        // The first is the default plan: the one the report's headline rows time.
        assert_eq!(all[0], ("capmoe-graph", MoeOptions::default()));
        // The rows form differs from the gathered one only in fc1's wgrad.
        let by_name = |n: &str| all.iter().find(|(name, _)| *name == n).unwrap().1;
        let (rows, gathered) = (by_name("capmoe-prob-in-fc1-rows-graph"), by_name("capmoe-fused-prob-in-fc1-graph"));
        assert_eq!((rows.fc1_wgrad, gathered.fc1_wgrad), (FusedKernel::Unfused, FusedKernel::Fused));
        assert_eq!(MoeOptions { fc1_wgrad: FusedKernel::Fused, ..rows }, gathered);
    }
}
