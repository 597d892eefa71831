//! Rows of the `graph` module (issue 16) on the expert-path shapes ([`crate::path::PATHS`]),
//! every graph holding one forward + backward of the layer:
//! - `graph_pool` (E128 shape): eight graphs for the token buckets 128 … 16384, each plan in
//!   its own range of one [`MemoryPool`]: the pool's physical bytes against the largest
//!   bucket's pooled buffers alone and the sum of all eight (target: physical <= 1.05x the
//!   largest alone);
//! - `expert_fwd_bwd`, `capmoe-graph-tmax` / `capmoe-graph-bucket` (E128 shape): one graph
//!   captured at T_max = 16384 reading T on the device, replayed at every bucket's T, beside
//!   that bucket's graph captured for exactly T (target: within 1.10x for T >= T_max/8);
//! - `graph_update` (every path shape): re-pointing one layer's graph at another layer's
//!   buffers ([`GraphTemplate::apply_to`], [`update`] = re-capture + apply, and
//!   [`GraphVariants::select`], which sets only the nodes that differ, and
//!   [`LayerTables::select`], which sets no node: a pointer-form plan's weight tables are
//!   rewritten by one copy) against capture + instantiate, host wall times (target: <= 1/10);
//! - `graph_first_replay` (every path shape): launch-to-completion wall time of the first
//!   replay of a graph instantiated without and with upload, and of a steady replay.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use capturable_moe::dtype::DType;
use capturable_moe::graph::{
    capture, capture_with, update, ActiveTables, CaptureOptions, FlagReport, GraphTemplate, GraphVariants, LayerTables,
    LayerWeights as TableWeights, MemoryPool,
};
use capturable_moe::moe::{MoeConfig, MoeExperts, MoeOptions, WeightForm};
use capturable_moe::routing::Tokens;
use capturable_moe::Result;
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use half::bf16;

use crate::data::try_random_bf16;
use crate::measure::{median, time, Row};
use crate::path::{path_name, topk_routing, PATHS};

/// Token buckets of the pool and of the one-graph-for-every-T rows; the last is T_max.
const BUCKETS: [usize; 8] = [128, 256, 512, 1024, 2048, 4096, 8192, 16384];
/// Virtual bytes of each pool range: more than the largest bucket's activations (3.2 GiB at
/// E128 k8 H2048 F768, T 16384); costs no physical memory.
const RANGE_BYTES: usize = 8 << 30;
/// Layers whose buffers one graph is re-pointed at in turn.
const LAYERS: u64 = 3;

/// One expert-path shape without its token count.
#[derive(Clone, Copy)]
struct Dims {
    e: usize,
    k: usize,
    h: usize,
    f: usize,
}

impl Dims {
    fn name(&self, t: usize) -> String {
        path_name(self.e, t, self.k, self.h, self.f)
    }

    fn config(&self, max_tokens: usize) -> MoeConfig {
        MoeConfig {
            num_experts: self.e,
            hidden: self.h,
            ffn: self.f,
            topk: self.k,
            max_tokens,
            capacity: None,
            expert_capacity: None,
            dtype: DType::Bf16,
            prob_dtype: DType::F32,
            wgrad_accumulate: false,
        }
    }

    /// Forward + backward FLOPs at `t` tokens (forward 6 T k H F, backward twice that).
    fn fwd_bwd_flops(&self, t: usize) -> f64 {
        18.0 * (t * self.k * self.h * self.f) as f64
    }
}

fn row(shape: &str, op: &str, imp: &str, us: f64, flops: f64, note: String) -> Row {
    Row {
        shape: shape.into(),
        routing: "uniform".into(),
        op: op.into(),
        imp: imp.into(),
        us,
        tflops: flops / us * 1e-6,
        gbps: f64::NAN,
        host_us: None,
        note: Some(note),
    }
}

/// The section's rows, or one row saying why it has none (an error, or a panic in a helper
/// that unwraps, such as [`time`]).
fn section(shape: &str, op: &str, imp: &str, body: impl FnOnce() -> Result<Vec<Row>>) -> Vec<Row> {
    let why = match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(rows)) => return rows,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => format!("panicked: {}", crate::runner::panic_message(&*panic)),
    };
    vec![row(shape, op, imp, f64::NAN, f64::NAN, format!("unavailable: {why}"))]
}

pub fn graph_rows(stream: &Arc<CudaStream>, reps: usize) -> Vec<Row> {
    let mut rows = Vec::new();
    let (e, _, k, h, f) = PATHS[0];
    let big = Dims { e, k, h, f };
    let t_max = BUCKETS[BUCKETS.len() - 1];
    eprintln!("[graphs] pool and one graph for every T, {}", big.name(t_max));
    rows.extend(section(&pool_shape(big), "graph_pool", "capmoe-pool", || pool_and_every_t_rows(stream, reps, big)));
    for &(e, t, k, h, f) in PATHS {
        let dims = Dims { e, k, h, f };
        let name = dims.name(t);
        eprintln!("[graphs] update and first replay, {name}");
        rows.extend(section(&name, "graph_update", "exec-update", || update_rows(stream, reps, dims, t)));
        rows.extend(section(&name, "graph_first_replay", "uploaded", || first_replay_rows(stream, reps, dims, t)));
    }
    rows
}

fn pool_shape(d: Dims) -> String {
    format!("graph_pool_E{}_k{}_H{}_F{}_T{}-{}", d.e, d.k, d.h, d.f, BUCKETS[0], BUCKETS[BUCKETS.len() - 1])
}

/// A layer's caller-owned buffers, sized for `t_max` tokens: the addresses a graph keeps.
struct Layer {
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    /// The device token count (`Tokens::Device`).
    tokens: CudaSlice<i32>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
    dw1: CudaSlice<bf16>,
    dw2: CudaSlice<bf16>,
}

impl Layer {
    /// Random inputs and weights (uniform top-k routing of all `t_max` tokens), T = t_max on
    /// the device, zeroed outputs.
    fn new(stream: &Arc<CudaStream>, d: Dims, t_max: usize, seed: u64) -> Result<Layer> {
        let (ids, probs) = topk_routing(d.e, t_max, d.k, seed);
        let random = |len: usize, salt: u64| try_random_bf16(stream, len, seed * 16 + salt);
        Ok(Layer {
            x: random(t_max * d.h, 1)?,
            ids: stream.clone_htod(&ids)?,
            probs: stream.clone_htod(&probs)?,
            tokens: stream.clone_htod(&[t_max as i32])?,
            w1: random(d.e * 2 * d.f * d.h, 2)?,
            w2: random(d.e * d.h * d.f, 3)?,
            y: stream.alloc_zeros(t_max * d.h)?,
            dy: random(t_max * d.h, 4)?,
            dx: stream.alloc_zeros(t_max * d.h)?,
            dprobs: stream.alloc_zeros(t_max * d.k)?,
            dw1: stream.alloc_zeros(d.e * 2 * d.f * d.h)?,
            dw2: stream.alloc_zeros(d.e * d.h * d.f)?,
        })
    }

    /// Forward + backward of `moe` on these buffers, T given on the host (`Some`) or read
    /// from the device word `tokens` (`None`).
    fn run(&mut self, moe: &mut MoeExperts<bf16>, stream: &Arc<CudaStream>, host_t: Option<usize>) -> Result<()> {
        let Layer { x, ids, probs, tokens, w1, w2, y, dy, dx, dprobs, dw1, dw2 } = self;
        let tokens = host_t.map_or(Tokens::Device(&*tokens), Tokens::Host);
        moe.forward(stream, &*x, &*ids, &*probs, tokens, &*w1, &*w2, y)?;
        moe.backward(stream, &*x, &*dy, &*probs, tokens, &*w1, &*w2, dx, dprobs, dw1, dw2)
    }
}

/// One layer's weights and weight gradients, for layers that share their activation buffers.
struct LayerWeights {
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    dw1: CudaSlice<bf16>,
    dw2: CudaSlice<bf16>,
}

impl LayerWeights {
    fn new(stream: &Arc<CudaStream>, d: Dims, seed: u64) -> Result<LayerWeights> {
        Ok(LayerWeights {
            w1: try_random_bf16(stream, d.e * 2 * d.f * d.h, seed * 16 + 2)?,
            w2: try_random_bf16(stream, d.e * d.h * d.f, seed * 16 + 3)?,
            dw1: stream.alloc_zeros(d.e * 2 * d.f * d.h)?,
            dw2: stream.alloc_zeros(d.e * d.h * d.f)?,
        })
    }
}

impl Layer {
    /// Forward + backward on this layer's activation buffers with `weights` (T on the device).
    fn run_with(
        &mut self,
        weights: &mut LayerWeights,
        moe: &mut MoeExperts<bf16>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let Layer { x, ids, probs, tokens, y, dy, dx, dprobs, .. } = self;
        let LayerWeights { w1, w2, dw1, dw2 } = weights;
        let tokens = Tokens::Device(&*tokens);
        moe.forward(stream, &*x, &*ids, &*probs, tokens, &*w1, &*w2, y)?;
        moe.backward(stream, &*x, &*dy, &*probs, tokens, &*w1, &*w2, dx, dprobs, dw1, dw2)
    }
}

/// Median GPU time of one replay ([`time`]: back-to-back replays, CUDA events).
fn replay_us(stream: &Arc<CudaStream>, graph: &CudaGraph, reps: usize) -> Result<f64> {
    let mut failure = None;
    let (us, _) = time(stream, reps, |_| {
        if let Err(e) = graph.launch() {
            failure.get_or_insert(e);
        }
    });
    failure.map_or(Ok(us), |e| Err(e.into()))
}

/// Free device memory (`cuMemGetInfo`) once `stream` is idle.
fn free_device_bytes(stream: &Arc<CudaStream>) -> Result<usize> {
    stream.synchronize()?;
    stream.context().bind_to_thread()?;
    Ok(cudarc::driver::result::mem_get_info()?.0)
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

/// " flags: ..." when a plan's device flag words are not clean after the replays (the rows
/// then timed something other than the intended routing), else "".
fn flags_note(moe: &MoeExperts<bf16>) -> Result<String> {
    let report = FlagReport::of_moe(moe)?;
    Ok(if report.is_clean() { String::new() } else { format!("; flags raised: {report}") })
}

/// One bucket: its plan for exactly T (activations in a pool range) and the bytes it took there.
struct Bucket {
    t: usize,
    moe: MoeExperts<bf16>,
    pooled_bytes: usize,
}

fn pool_and_every_t_rows(stream: &Arc<CudaStream>, reps: usize, d: Dims) -> Result<Vec<Row>> {
    let t_max = BUCKETS[BUCKETS.len() - 1];
    let mut layer = Layer::new(stream, d, t_max, 21)?;

    // Eight plans in one pool, a range each; the driver's free memory around them.
    let free_before = free_device_bytes(stream)?;
    let pool = MemoryPool::new(stream, RANGE_BYTES)?;
    let mut buckets = Vec::new();
    for t in BUCKETS {
        let range = pool.range()?;
        let moe = MoeExperts::<bf16>::with_pool(d.config(t), MoeOptions::default(), stream, &range)?;
        buckets.push(Bucket { t, moe, pooled_bytes: range.used_bytes() });
    }
    let taken = free_before.saturating_sub(free_device_bytes(stream)?);
    let graphs = buckets
        .iter_mut()
        .map(|b| capture(stream, || layer.run(&mut b.moe, stream, Some(b.t))))
        .collect::<Result<Vec<CudaGraph>>>()?;
    let stats = pool.stats();
    let largest = buckets.iter().map(|b| b.pooled_bytes).max().unwrap_or(0);
    let sum: usize = buckets.iter().map(|b| b.pooled_bytes).sum();
    let ratio = stats.physical_bytes as f64 / largest as f64;
    let pool_note = format!(
        "{} fwd+bwd graphs, T = {} … {}, a pool range each: physical {:.1} MiB = {ratio:.4}x the largest bucket's \
         pooled activations alone ({:.1} MiB; target <= 1.05x: {}); sum of all {} {:.1} MiB ({:.2}x physical); \
         granularity {} KiB; device memory the {} plans took (cuMemGetInfo: the pool plus each plan's own \
         allocations outside it: route maps, flag words, GEMM workspace) {:.1} MiB",
        graphs.len(),
        BUCKETS[0],
        t_max,
        mib(stats.physical_bytes),
        mib(largest),
        verdict(ratio <= 1.05),
        buckets.len(),
        mib(sum),
        sum as f64 / stats.physical_bytes as f64,
        stats.granularity >> 10,
        buckets.len(),
        mib(taken),
    );
    let mut rows = vec![row(&pool_shape(d), "graph_pool", "capmoe-pool", f64::NAN, f64::NAN, pool_note)];

    // One plan and graph for T_max, T read on the device, against each bucket's own graph.
    let mut one = MoeExperts::<bf16>::new(d.config(t_max), stream)?;
    let one_graph = capture(stream, || layer.run(&mut one, stream, None))?;
    for (b, graph) in buckets.iter().zip(&graphs) {
        stream.memcpy_htod(&[b.t as i32], &mut layer.tokens)?;
        let one_us = replay_us(stream, &one_graph, reps)?;
        let bucket_us = replay_us(stream, graph, reps)?;
        let ratio = one_us / bucket_us;
        let target = if b.t * 8 >= t_max {
            format!("target <= 1.10x: {}", verdict(ratio <= 1.10))
        } else {
            "no target below T_max/8".into()
        };
        let (shape, flops) = (d.name(b.t), d.fwd_bwd_flops(b.t));
        let one_note = format!(
            "one graph captured at T_max = {t_max} (T read on the device) replayed at T = {}: {ratio:.3}x the bucket \
             graph captured for exactly T ({target}){}",
            b.t,
            flags_note(&one)?
        );
        let bucket_note = format!(
            "graph captured for exactly T (plan T_max = T = {}, host T), activations in a pool range{}",
            b.t,
            flags_note(&b.moe)?
        );
        rows.push(row(&shape, "expert_fwd_bwd", "capmoe-graph-tmax", one_us, flops, one_note));
        rows.push(row(&shape, "expert_fwd_bwd", "capmoe-graph-bucket", bucket_us, flops, bucket_note));
    }
    Ok(rows)
}

fn elapsed_us(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

/// Host wall time of one replay of `graph`, launch to completion (launch + synchronize).
fn launch_to_completion_us(stream: &Arc<CudaStream>, graph: &CudaGraph) -> Result<f64> {
    let start = Instant::now();
    graph.launch()?;
    stream.synchronize()?;
    Ok(elapsed_us(start))
}

/// One graph of one layer re-pointed at the next layer's buffers, `reps` times, against a
/// fresh capture + instantiate of the same layer (host wall times; medians).
fn update_rows(stream: &Arc<CudaStream>, reps: usize, d: Dims, t: usize) -> Result<Vec<Row>> {
    let mut moe = MoeExperts::<bf16>::new(d.config(t), stream)?;
    let mut layers = (0..LAYERS).map(|i| Layer::new(stream, d, t, 30 + i)).collect::<Result<Vec<Layer>>>()?;
    stream.synchronize()?;
    let mut graph = capture(stream, || layers[0].run(&mut moe, stream, None))?;
    let nodes = GraphTemplate::capture(stream, || layers[0].run(&mut moe, stream, None))?.node_count()?;
    let reps = reps.max(5);
    let (mut fresh, mut apply, mut recapture_apply, mut update_call) = (vec![], vec![], vec![], vec![]);
    for i in 0..reps {
        // The graph points at layer 0 here; this step moves it to layer 1 or 2, then back to 0
        // through `update`, so every update changes the buffers.
        let layer = &mut layers[1 + i % (LAYERS as usize - 1)];
        let start = Instant::now();
        let fresh_graph = capture_with(stream, CaptureOptions { upload: false, ..Default::default() }, || {
            layer.run(&mut moe, stream, None)
        })?;
        fresh.push(elapsed_us(start));
        drop(fresh_graph);

        let start = Instant::now();
        let template = GraphTemplate::capture(stream, || layer.run(&mut moe, stream, None))?;
        let captured = Instant::now();
        template.apply_to(&mut graph)?;
        apply.push(elapsed_us(captured));
        recapture_apply.push(elapsed_us(start));
        // The updated graph runs (not timed), so a bad update fails here, not silently.
        graph.launch()?;
        stream.synchronize()?;

        // The same through the one-call form, back to layer 0's buffers.
        let start = Instant::now();
        update(&mut graph, stream, || layers[0].run(&mut moe, stream, None))?;
        update_call.push(elapsed_us(start));
        graph.launch()?;
        stream.synchronize()?;
    }
    let every_buffer =
        variant_switch_times(stream, &mut moe, layers.len(), reps, |moe, l| layers[l].run(moe, stream, None))?;
    // Layers sharing their activation buffers (an engine copies each layer's inputs into the
    // graph's static ones), each with its own weights and weight gradients.
    let mut weights = (0..LAYERS).map(|i| LayerWeights::new(stream, d, 50 + i)).collect::<Result<Vec<_>>>()?;
    let (shared, layer_weights) = (&mut layers[0], &mut weights);
    let weights_only = variant_switch_times(stream, &mut moe, layer_weights.len(), reps, |moe, l| {
        shared.run_with(&mut layer_weights[l], moe, stream)
    })?;
    let tables = layer_table_times(stream, d, t, &mut layers[0], &weights, reps)?;
    let (fresh, apply) = (median(&mut fresh), median(&mut apply));
    let (recapture_apply, update_call) = (median(&mut recapture_apply), median(&mut update_call));
    let name = d.name(t);
    let flags = flags_note(&moe)?;
    let of_fresh =
        |us: f64| format!("{:.3}x capture + instantiate (target <= 0.10: {})", us / fresh, verdict(us / fresh <= 0.10));
    Ok(vec![
        row(
            &name,
            "graph_update",
            "capture+instantiate",
            fresh,
            f64::NAN,
            format!(
                "host wall time of capturing forward + backward ({nodes} nodes) and cuGraphInstantiate, no upload; \
                 median of {reps}{flags}"
            ),
        ),
        row(
            &name,
            "graph_update",
            "exec-update",
            apply,
            f64::NAN,
            format!(
                "GraphTemplate::apply_to (cuGraphExecUpdate) of a template captured beforehand, onto another layer's \
                 weights, inputs and outputs: {}; host wall time, median of {reps}",
                of_fresh(apply)
            ),
        ),
        switch_row(&name, "variants-select", "every buffer of the layer (weights, inputs, outputs)", &every_buffer, nodes, reps, of_fresh(every_buffer.select_us)),
        switch_row(&name, "variants-select-weights", "weights and weight gradients; inputs and outputs shared", &weights_only, nodes, reps, of_fresh(weights_only.select_us)),
        tables_row(&name, &tables, reps),
        row(
            &name,
            "graph_update",
            "recapture+update",
            recapture_apply,
            f64::NAN,
            format!(
                "GraphTemplate::capture (host side only) + apply_to: {}; graph::update as one call {update_call:.1} us; \
                 host wall time, median of {reps}",
                of_fresh(recapture_apply)
            ),
        ),
    ])
}

/// What switching a pointer-form plan's graph between layers with [`LayerTables`] costs
/// (medians, µs), beside that graph's own capture + instantiate.
struct TableTimes {
    select_us: f64,
    capture_us: f64,
    first_replay_us: f64,
    steady_replay_us: f64,
}

/// A `WeightForm::Pointers` plan's forward + backward on `shared`'s activations, captured once
/// over the active tables of `weights`' layers, then switched to the next layer `reps` times
/// (each switch replayed twice, launch to completion, not part of the select).
fn layer_table_times(
    stream: &Arc<CudaStream>,
    d: Dims,
    t: usize,
    shared: &mut Layer,
    weights: &[LayerWeights],
    reps: usize,
) -> Result<TableTimes> {
    let options = MoeOptions { weights: WeightForm::Pointers, ..MoeOptions::default() };
    let mut moe = MoeExperts::<bf16>::with_options(d.config(t), options, stream)?;
    let layers: Vec<_> =
        weights.iter().map(|w| TableWeights { fc1: &w.w1, fc2: &w.w2, dw1: &w.dw1, dw2: &w.dw2 }).collect();
    let mut tables = LayerTables::new(stream, &d.config(t), &layers)?;
    let mut step = |moe: &mut MoeExperts<bf16>, tables: &mut LayerTables| -> Result<()> {
        tables.with_active(|ActiveTables { fc1, fc2, mut dw1, mut dw2 }| {
            let Layer { x, ids, probs, tokens, y, dy, dx, dprobs, .. } = &mut *shared;
            let tokens = Tokens::Device(&*tokens);
            moe.forward(stream, &*x, &*ids, &*probs, tokens, &fc1, &fc2, y)?;
            moe.backward(stream, &*x, &*dy, &*probs, tokens, &fc1, &fc2, dx, dprobs, &mut dw1, &mut dw2)
        })
    };
    let mut captures = vec![];
    for _ in 0..reps.min(10) {
        let start = Instant::now();
        let graph = capture_with(stream, CaptureOptions { upload: false, ..Default::default() }, || {
            step(&mut moe, &mut tables)
        })?;
        captures.push(elapsed_us(start));
        drop(graph);
    }
    let graph = capture(stream, || step(&mut moe, &mut tables))?;
    let (mut select, mut first, mut steady) = (vec![], vec![], vec![]);
    for i in 0..reps {
        let start = Instant::now();
        tables.select(stream, (i + 1) % tables.layer_count())?;
        select.push(elapsed_us(start));
        first.push(launch_to_completion_us(stream, &graph)?);
        steady.push(launch_to_completion_us(stream, &graph)?);
    }
    Ok(TableTimes {
        select_us: median(&mut select),
        capture_us: median(&mut captures),
        first_replay_us: median(&mut first),
        steady_replay_us: median(&mut steady),
    })
}

fn tables_row(name: &str, t: &TableTimes, reps: usize) -> Row {
    let ratio = t.select_us / t.capture_us;
    row(
        name,
        "graph_update",
        "layer-tables-select",
        t.select_us,
        f64::NAN,
        format!(
            "LayerTables::select between {LAYERS} layers of a WeightForm::Pointers plan (weights and weight \
             gradients differ; inputs and outputs shared): one device-to-device copy of the pointer tables, no \
             graph node set; {ratio:.3}x that graph's capture + instantiate ({:.1} us; target <= 0.10: {}); host \
             wall time, median of {reps}; launch to completion of the replay right after a select {:.1} us, of a \
             second replay {:.1} us",
            t.capture_us,
            verdict(ratio <= 0.10),
            t.first_replay_us,
            t.steady_replay_us
        ),
    )
}

/// The row of one `GraphVariants` switch: `differs` says what the layers do not share.
fn switch_row(name: &str, imp: &str, differs: &str, t: &SwitchTimes, nodes: usize, reps: usize, ratio: String) -> Row {
    let set = t.nodes.map_or("every node (whole-graph update)".to_string(), |n| format!("{n} of {nodes} nodes"));
    row(
        name,
        "graph_update",
        imp,
        t.select_us,
        f64::NAN,
        format!(
            "GraphVariants::select between {LAYERS} layers differing in {differs}: sets {set}; {ratio}; host wall \
             time, median of {reps}; launch to completion of the replay right after a select {:.1} us, of a second \
             replay {:.1} us",
            t.first_replay_us, t.steady_replay_us
        ),
    )
}

/// What switching one graph between layers with `GraphVariants` costs (medians, µs).
struct SwitchTimes {
    select_us: f64,
    first_replay_us: f64,
    steady_replay_us: f64,
    nodes: Option<usize>,
}

/// One graph and the templates of `count` layers in a `GraphVariants` (`step(moe, l)` enqueues
/// layer l's forward + backward), switched to the next layer `reps` times; each switch is
/// replayed twice (launch to completion, not part of the select).
fn variant_switch_times(
    stream: &Arc<CudaStream>,
    moe: &mut MoeExperts<bf16>,
    count: usize,
    reps: usize,
    mut step: impl FnMut(&mut MoeExperts<bf16>, usize) -> Result<()>,
) -> Result<SwitchTimes> {
    let graph = capture(stream, || step(moe, 0))?;
    let templates = (0..count).map(|l| GraphTemplate::capture(stream, || step(moe, l))).collect::<Result<Vec<_>>>()?;
    let mut variants = GraphVariants::new(graph, templates)?;
    variants.prepare()?;
    let (mut select, mut first, mut steady) = (vec![], vec![], vec![]);
    for i in 0..reps {
        let start = Instant::now();
        variants.select((i + 1) % count)?;
        select.push(elapsed_us(start));
        first.push(launch_to_completion_us(stream, variants.graph())?);
        steady.push(launch_to_completion_us(stream, variants.graph())?);
    }
    Ok(SwitchTimes {
        select_us: median(&mut select),
        first_replay_us: median(&mut first),
        steady_replay_us: median(&mut steady),
        nodes: variants.nodes_per_switch(),
    })
}

/// Launch-to-completion wall time of the first replay of a graph instantiated without upload
/// and of one uploaded at capture, and of the second replay (steady), medians.
fn first_replay_rows(stream: &Arc<CudaStream>, reps: usize, d: Dims, t: usize) -> Result<Vec<Row>> {
    let mut moe = MoeExperts::<bf16>::new(d.config(t), stream)?;
    let mut layer = Layer::new(stream, d, t, 40)?;
    stream.synchronize()?;
    let reps = reps.clamp(5, 20);
    let (mut cold, mut uploaded, mut steady) = (vec![], vec![], vec![]);
    for _ in 0..reps {
        let graph = capture_with(stream, CaptureOptions { upload: false, ..Default::default() }, || {
            layer.run(&mut moe, stream, None)
        })?;
        stream.synchronize()?;
        cold.push(launch_to_completion_us(stream, &graph)?);
        steady.push(launch_to_completion_us(stream, &graph)?);
        drop(graph);
        let graph = capture(stream, || layer.run(&mut moe, stream, None))?;
        // The upload (enqueued on the stream by `capture`) is done before the first launch.
        stream.synchronize()?;
        uploaded.push(launch_to_completion_us(stream, &graph)?);
    }
    let (cold, uploaded, steady) = (median(&mut cold), median(&mut uploaded), median(&mut steady));
    // Wall times including the sync: no TFLOP/s.
    let name = d.name(t);
    let flags = flags_note(&moe)?;
    let what = format!("host wall time of launch + synchronize of forward + backward, median of {reps}");
    Ok(vec![
        row(
            &name,
            "graph_first_replay",
            "not-uploaded",
            cold,
            f64::NAN,
            format!("first replay, graph instantiated without cuGraphUpload: {:.2}x steady; {what}", cold / steady),
        ),
        row(
            &name,
            "graph_first_replay",
            "uploaded",
            uploaded,
            f64::NAN,
            format!("first replay after graph::capture's upload: {:.2}x steady; {what}", uploaded / steady),
        ),
        row(
            &name,
            "graph_first_replay",
            "steady",
            steady,
            f64::NAN,
            format!("second replay of the not-uploaded graph; {what}{flags}"),
        ),
    ])
}
