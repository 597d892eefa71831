//! Rows of the EP layer itself ([`EpMoe`]) at R = every GPU present (one process, a thread per
//! rank, as `tests/ep_gpu.rs` runs it), and the drop table:
//! - `ep_dispatch_combine`: the layer's dispatch + combine alone (layout, gather, the grouped
//!   exchange of rows / ids / probs, the exchange back and the reduce; no expert GEMMs), plain,
//!   uniform routing, at the capacity and bytes of the `nccl-alltoall` rows (capacity factor
//!   1.0), so the two compare directly (target: bus bandwidth >= 80 % of NCCL's own
//!   all-to-all); with `ep_dispatch` and `ep_combine` apart. Each eager (`capmoe-ep`, beside
//!   `nccl-alltoall`) and replayed from a graph each rank captured (`capmoe-ep-graph`, beside
//!   `nccl-alltoall-graph`): at decode sizes the eager rows time the host's launches as much
//!   as the GPU;
//! - `ep_step`: forward + backward of the whole layer, plain and with Echo, under uniform and
//!   zipf routing, capacity factor 1.25 (every one: a case of its own, apart from the
//!   dispatch + combine one at 1.0);
//! - `ep_drops`: dropped routes at capacity factors 1.0 / 1.25 / 1.5, plain and with Echo,
//!   worked out by `ep::simulate` (the CPU reference planner) for groups of 8 and 64 ranks.

use std::rc::Rc;
use std::sync::Arc;

use capturable_moe::dtype::DType;
use capturable_moe::echo::{Algorithm, EchoConfig};
use capturable_moe::ep::simulate::{count_drops, zipf_routing};
use capturable_moe::ep::{balanced_capacity, EpEcho, EpGroup, EpMoe, EpMoeConfig};
use capturable_moe::graph::capture_with;
use capturable_moe::routing::Tokens;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::ep::{rank_streams, thread_local_capture, RankGate};
use crate::measure::{time, Row};
use crate::path::PATHS;
use crate::runner::Runner;

fn row(shape: &str, routing: &str, op: &str, imp: &str, us: f64, gbps: f64, note: String) -> Row {
    Row {
        shape: shape.into(),
        routing: routing.into(),
        op: op.into(),
        imp: imp.into(),
        us,
        tflops: f64::NAN,
        gbps,
        host_us: None,
        note: Some(note),
    }
}

/// The layer's rows, a runner unit per case (`ep/layer <shape> <routing> ...`): a failing case
/// gives one "unavailable" row and the next case runs, unless its ranks' groups are lost with
/// it (a rank panicked), which ends the layer's rows.
pub fn ep_layer_rows(runner: &mut Runner, stream: &Arc<CudaStream>, reps: usize) {
    let mut groups = None;
    runner.run("ep/layer setup", |rows| match rank_streams(stream).and_then(|s| EpGroup::single_process(&s)) {
        Ok(g) => groups = Some(g),
        Err(e) => rows.push(row("ep_layer", "uniform", "ep_step", "capmoe-ep", f64::NAN, f64::NAN, unavailable(&e))),
    });
    let Some(ranks) = groups.as_ref().map(Vec::len) else { return };
    for &(e, t, k, h, f) in PATHS.iter().filter(|p| p.0 % ranks == 0) {
        let shape = format!("ep_E{e}_T{t}_k{k}_H{h}_F{f}_R{ranks}");
        for (routing, exponent) in [("uniform", 0.0), ("zipf", 1.0)] {
            let ids = zipf_routing(ranks, t, e, k, exponent, 11);
            for (echo, factor, timed, graph) in cases(routing) {
                let config = EpMoeConfig {
                    num_experts: e,
                    hidden: h,
                    ffn: f,
                    topk: k,
                    max_tokens: t,
                    capacity: balanced_capacity(t, k, ranks, factor),
                    echo: echo.then_some(EpEcho {
                        spare_per_rank: if ranks > 1 { 2 } else { 1 },
                        algorithm: Algorithm::Greedy,
                        threshold_multiplier: 0.0,
                    }),
                    dtype: DType::Bf16,
                };
                let label = format!("ep/layer {shape} {routing} echo={echo} graph={graph} {}", timed.op());
                eprintln!("[{label}]");
                let imp = match (echo, graph) {
                    (false, false) => "capmoe-ep",
                    (false, true) => "capmoe-ep-graph",
                    (true, _) => "capmoe-ep-echo",
                };
                let capacity = config.capacity;
                let cap_note =
                    format!("capacity factor {factor}: {capacity} rows per peer block, R = {ranks} in one process");
                let row_shape = match timed {
                    Timed::Step => shape.clone(),
                    _ => format!("ep_E{e}_T{t}_k{k}_H{h}_R{ranks}"),
                };
                runner.run(&label, |rows| {
                    let Some(taken) = groups.take() else { return };
                    let case = Case { config, ids: &ids, timed, graph };
                    let (us, gbps, note) = match time_case(taken, &case, reps) {
                        Ok((back, Ok(us))) => {
                            groups = Some(back);
                            let (gbps, what) = match timed {
                                Timed::Step => (f64::NAN, "forward + backward".into()),
                                _ => exchange_gbps(timed, ranks, capacity, h, us),
                            };
                            (us, gbps, format!("{what}; {cap_note}"))
                        }
                        Ok((back, Err(e))) => {
                            groups = Some(back);
                            (f64::NAN, f64::NAN, unavailable(&e))
                        }
                        Err(e) => {
                            (f64::NAN, f64::NAN, format!("{}; the later EP layer cases are skipped", unavailable(&e)))
                        }
                    };
                    rows.push(row(&row_shape, routing, timed.op(), imp, us, gbps, note));
                });
                if groups.is_none() {
                    return;
                }
            }
        }
    }
}

fn unavailable(e: &capturable_moe::Error) -> String {
    format!("unavailable: {e}")
}

/// What one case times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Timed {
    /// `EpMoe::dispatch` + `EpMoe::combine` (op `ep_dispatch_combine`).
    DispatchCombine,
    /// `EpMoe::dispatch` alone (op `ep_dispatch`, beside the `nccl-alltoall` row of its bytes).
    Dispatch,
    /// `EpMoe::combine` alone, after one dispatch (op `ep_combine`, likewise).
    Combine,
    /// Forward + backward of the whole layer (op `ep_step`).
    Step,
}

impl Timed {
    fn op(self) -> &'static str {
        match self {
            Timed::DispatchCombine => "ep_dispatch_combine",
            Timed::Dispatch => "ep_dispatch",
            Timed::Combine => "ep_combine",
            Timed::Step => "ep_step",
        }
    }
}

/// The cases of one routing: (Echo, capacity factor, what is timed, replayed from a graph).
/// Dispatch + combine runs plain under uniform routing at factor 1.0, the capacity and bytes of
/// the `nccl-alltoall` rows, eager and from a graph; every step eagerly at 1.25, plain and with
/// Echo.
fn cases(routing: &str) -> Vec<(bool, f64, Timed, bool)> {
    let mut cases = Vec::new();
    if routing == "uniform" {
        for graph in [false, true] {
            cases.extend([
                (false, 1.0, Timed::DispatchCombine, graph),
                (false, 1.0, Timed::Dispatch, graph),
                (false, 1.0, Timed::Combine, graph),
            ]);
        }
    }
    cases.extend([(false, 1.25, Timed::Step, false), (true, 1.25, Timed::Step, false)]);
    cases
}

/// GB/s of the exchange(s) `timed` names taking `us`, and what they are: busbw for R > 1,
/// algbw at R = 1 (no link is crossed). The bytes are those of the `nccl-alltoall` rows:
/// dispatch `R · capacity · (2H + 8)` (rows, ids, probs), combine `R · capacity · 2H`.
fn exchange_gbps(timed: Timed, ranks: usize, capacity: usize, h: usize, us: f64) -> (f64, String) {
    let per_row = match timed {
        Timed::Dispatch => 2 * h + 8,
        Timed::Combine => 2 * h,
        _ => 4 * h + 8,
    };
    let bytes = (ranks * capacity * per_row) as f64;
    let algbw = bytes / us * 1e-3;
    let (gbps, what) = if ranks > 1 {
        (algbw * (ranks - 1) as f64 / ranks as f64, "busbw")
    } else {
        (algbw, "algbw (R = 1: NCCL's self-copy path only)")
    };
    (gbps, format!("GB/s = {what} over {} bytes ({:.1} MB per rank)", timed.op(), bytes / 1e6))
}

/// One case of the layer: shape, Echo or not, block capacity; the routing of every rank; what
/// is timed.
struct Case<'a> {
    config: EpMoeConfig,
    ids: &'a [Vec<i32>],
    timed: Timed,
    /// Captured once (thread-local mode) and replayed, rather than enqueued eagerly each rep.
    graph: bool,
}

/// Runs one case on every rank (a thread each) and gives the groups back with rank 0's median
/// microseconds. A rank's panic ends the EP layer rows (its group is gone with it).
#[allow(clippy::type_complexity)]
fn time_case(
    groups: Vec<EpGroup>,
    case: &Case<'_>,
    reps: usize,
) -> capturable_moe::Result<(Vec<EpGroup>, capturable_moe::Result<f64>)> {
    // A gate for each point where the ranks agree (one gate passed twice could mix them up).
    let gates = [RankGate::new(groups.len()), RankGate::new(groups.len())];
    let results: Vec<std::thread::Result<(EpGroup, capturable_moe::Result<f64>)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let gates = &gates;
                scope.spawn(move || {
                    let group = Rc::new(group);
                    let timing = time_rank(&group, case, rank, reps, gates);
                    let Ok(group) = Rc::try_unwrap(group) else {
                        unreachable!("the layer holding the group is dropped")
                    };
                    (group, timing)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut groups = Vec::with_capacity(results.len());
    let mut timing = None;
    for result in results {
        let Ok((group, t)) = result else {
            return Err(capturable_moe::Error::InvalidArgument {
                op: "ep layer bench",
                why: "a rank's thread panicked".into(),
            });
        };
        groups.push(group);
        timing.get_or_insert(t);
    }
    Ok((groups, timing.expect("rank 0")))
}

/// Buffers of one rank: its tokens, its home experts' weights and main grads.
struct RankBuffers {
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    dw1: CudaSlice<f32>,
    dw2: CudaSlice<f32>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
}

fn rank_buffers(
    stream: &Arc<CudaStream>,
    c: &EpMoeConfig,
    ranks: usize,
    ids: &[i32],
) -> capturable_moe::Result<RankBuffers> {
    let local = c.num_experts / ranks;
    let (p1, p2) = (2 * c.ffn * c.hidden, c.hidden * c.ffn);
    let (t, h, k) = (c.max_tokens, c.hidden, c.topk);
    let small = |n: usize, seed: usize| -> Vec<bf16> {
        (0..n).map(|i| bf16::from_f32((((i * 7 + seed) % 17) as f32 - 8.0) / 256.0)).collect()
    };
    let probs: Vec<f32> = (0..t * k).map(|i| ((i % 7) + 1) as f32 / 8.0).collect();
    Ok(RankBuffers {
        x: stream.clone_htod(&small(t * h, 1))?,
        ids: stream.clone_htod(ids)?,
        probs: stream.clone_htod(&probs)?,
        w1: stream.clone_htod(&small(local * p1, 2))?,
        w2: stream.clone_htod(&small(local * p2, 3))?,
        dw1: stream.alloc_zeros(local * p1)?,
        dw2: stream.alloc_zeros(local * p2)?,
        y: stream.alloc_zeros(t * h)?,
        dx: stream.alloc_zeros(t * h)?,
        dprobs: stream.alloc_zeros(t * k)?,
    })
}

/// The first error of a run, kept while the run goes on.
///
/// NOTE: a rank that stopped (or panicked) between two collectives would leave its peers
/// waiting in the next one forever; every rank enqueues every rep, then reports.
fn keep_first(first: &mut Option<capturable_moe::Error>, result: capturable_moe::Result<()>) {
    if let Err(e) = result {
        first.get_or_insert(e);
    }
}

fn time_rank(
    group: &Rc<EpGroup>,
    case: &Case<'_>,
    rank: usize,
    reps: usize,
    [setup_gate, capture_gate]: &[RankGate; 2],
) -> capturable_moe::Result<f64> {
    let stream = group.stream().clone();
    let c = &case.config;
    let setup = (|| {
        let layer = EpMoe::<bf16>::new(group.clone(), c.clone())?;
        let b = rank_buffers(&stream, c, group.ranks(), &case.ids[rank])?;
        Ok((layer, b))
    })()
    .and_then(|(mut layer, b)| layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).map(|()| (layer, b)));
    let (mut layer, mut b) = setup_gate.pass(setup)?;
    let tokens = Tokens::Host(c.max_tokens);
    let mut first_error = None;
    if case.timed == Timed::Combine {
        // What the combine sends back.
        keep_first(&mut first_error, layer.dispatch(&b.x, &b.ids, &b.probs, tokens, &b.w1, &b.w2));
    }
    // Both halves of a two-part case run even when the first fails (see keep_first).
    let enqueue = |layer: &mut EpMoe<bf16>, b: &mut RankBuffers| -> capturable_moe::Result<()> {
        match case.timed {
            Timed::DispatchCombine => {
                let dispatched = layer.dispatch(&b.x, &b.ids, &b.probs, tokens, &b.w1, &b.w2);
                dispatched.and(layer.combine(tokens, &mut b.y))
            }
            Timed::Dispatch => layer.dispatch(&b.x, &b.ids, &b.probs, tokens, &b.w1, &b.w2),
            Timed::Combine => layer.combine(tokens, &mut b.y),
            Timed::Step => {
                let forward = layer.forward(&b.x, &b.ids, &b.probs, tokens, &b.w1, &b.w2, &mut b.y);
                forward.and(layer.backward(
                    &b.x,
                    tokens,
                    &b.w1,
                    &b.w2,
                    &mut b.dx,
                    &mut b.dprobs,
                    &mut b.dw1,
                    &mut b.dw2,
                ))
            }
        }
    };
    let us = if case.graph {
        // Eager once first: NCCL connects its peers on first use, which a capture cannot hold.
        keep_first(&mut first_error, enqueue(&mut layer, &mut b));
        let captured = capture_with(&stream, thread_local_capture(), || enqueue(&mut layer, &mut b));
        let graph = capture_gate.pass(captured)?; // no rank replays unless every rank captured
        time(&stream, reps, |_| keep_first(&mut first_error, graph.launch().map_err(Into::into))).0
    } else {
        time(&stream, reps, |_| keep_first(&mut first_error, enqueue(&mut layer, &mut b))).0
    };
    stream.synchronize()?;
    first_error.map_or(Ok(us), Err)
}

/// The drop table (docs/ep.md, every group of it): routing arithmetic of the CPU reference
/// planner, no GPU involved.
pub fn drop_rows() -> Vec<Row> {
    let mut rows = Vec::new();
    let groups = [(8usize, 64usize, 2usize, 4096usize), (8, 128, 2, 4096), (16, 256, 2, 2048), (64, 256, 2, 1024)];
    for (ep, experts, spare, tokens) in groups {
        let cfg = EchoConfig {
            ep,
            num_experts: experts,
            spare_per_rank: spare,
            ep_rank: 0,
            topk: 8,
            algorithm: Algorithm::Greedy,
            threshold_multiplier: 0.0,
        };
        for (routing, exponent) in [("uniform", 0.0), ("zipf", 1.0), ("zipf1.2", 1.2)] {
            let ids = zipf_routing(ep, tokens, experts, 8, exponent, 7);
            for factor in [1.0, 1.25, 1.5] {
                let capacity = balanced_capacity(tokens, 8, ep, factor);
                let shape = format!("ep_drops_E{experts}_T{tokens}_k8_EP{ep}_S{spare}");
                let note = match count_drops(&cfg, &ids, capacity) {
                    Ok(d) => format!(
                        "simulated (CPU reference planner): capacity factor {factor} ({capacity} rows), {} routes; dropped plain {} ({:.2} %), Echo as planned {} ({:.2} %), Echo balanced (EpMoe) {} ({:.2} %); fullest block {} / {} / {}",
                        d.routes,
                        d.dropped_plain,
                        100.0 * d.dropped_plain as f64 / d.routes as f64,
                        d.dropped_echo,
                        100.0 * d.dropped_echo as f64 / d.routes as f64,
                        d.dropped_balanced,
                        100.0 * d.dropped_balanced as f64 / d.routes as f64,
                        d.max_block_plain,
                        d.max_block_echo,
                        d.max_block_balanced
                    ),
                    Err(e) => format!("unavailable: {e}"),
                };
                rows.push(row(
                    &shape,
                    routing,
                    &format!("ep_drops_f{factor:.2}"),
                    "simulated",
                    f64::NAN,
                    f64::NAN,
                    note,
                ));
            }
        }
    }
    rows
}
