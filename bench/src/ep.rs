//! Expert-parallel rows: NCCL's own all-to-all (grouped send / recv of equal blocks, as
//! nccl-tests' alltoall) over the bytes of the EP step's dispatch and combine for the expert
//! path shapes ([`crate::path::PATHS`]), at R = every GPU present, one process. These are the
//! yardstick the EP layer's dispatch + combine rows are measured against (target >= 80 %).
//!
//! Bytes per rank and direction (docs/ep.md), with `capacity` = ceil(T k / R) rows per peer
//! block (capacity factor 1.0, uniform routing): dispatch R capacity (2H + 8) (bf16 rows, an
//! i32 id and an f32 prob per row), combine R capacity 2H.
//!
//! Each is timed twice: eager (`nccl-alltoall`: one thread enqueues every rank's transfers in
//! one NCCL group) and replayed from a CUDA graph (`nccl-alltoall-graph`: a thread per rank
//! captures its own transfers, as the layer's graph rows do), the form the EP step runs in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use capturable_moe::device::open;
use capturable_moe::ep::{nccl_group, EpGroup};
use capturable_moe::graph::{capture_with, CaptureMode, CaptureOptions};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::measure::{time, Row};
use crate::path::PATHS;

fn row(shape: &str, op: &str, imp: &str, us: f64, gbps: f64, note: String) -> Row {
    Row {
        shape: shape.into(),
        routing: "uniform".into(),
        op: op.into(),
        imp: imp.into(),
        us,
        tflops: f64::NAN,
        gbps,
        host_us: None,
        note: Some(note),
    }
}

/// One stream per GPU present, rank i on GPU i (`stream` is rank 0's).
pub fn rank_streams(stream: &Arc<CudaStream>) -> capturable_moe::Result<Vec<Arc<CudaStream>>> {
    let gpus = CudaContext::device_count()?.max(1) as usize;
    let mut streams = vec![stream.clone()];
    for ordinal in 1..gpus {
        streams.push(open(ordinal)?.new_stream()?);
    }
    Ok(streams)
}

pub fn ep_rows(stream: &Arc<CudaStream>, reps: usize) -> Vec<Row> {
    match ep_cases(stream, reps) {
        Ok(rows) => rows,
        Err(e) => {
            vec![row("ep_alltoall", "ep_dispatch", "nccl-alltoall", f64::NAN, f64::NAN, format!("unavailable: {e}"))]
        }
    }
}

fn ep_cases(stream: &Arc<CudaStream>, reps: usize) -> capturable_moe::Result<Vec<Row>> {
    let streams = rank_streams(stream)?;
    let mut groups = EpGroup::single_process(&streams)?;
    let ranks = groups.len();
    let mut rows = Vec::new();
    for &(e, t, k, h, _f) in PATHS {
        let capacity = (t * k).div_ceil(ranks);
        let shape = format!("ep_E{e}_T{t}_k{k}_H{h}_R{ranks}");
        for (op, row_bytes) in [("ep_dispatch", 2 * h + 8), ("ep_combine", 2 * h)] {
            eprintln!("[ep] {shape} {op}");
            let block = capacity * row_bytes;
            let us = time_alltoall(&groups, block, reps)?;
            rows.push(alltoall_row(&shape, op, "nccl-alltoall", ranks, block, us));
            let (back, us) = time_alltoall_graph(groups, block, reps);
            groups = back.ok_or_else(|| panicked("the NCCL all-to-all graph rows"))?;
            rows.push(alltoall_row(&shape, op, "nccl-alltoall-graph", ranks, block, us?));
        }
    }
    Ok(rows)
}

fn panicked(what: &str) -> capturable_moe::Error {
    capturable_moe::Error::InvalidArgument { op: "ep bench", why: format!("a rank's thread panicked in {what}") }
}

/// Capture options for a process with a thread per GPU (see `capturable_moe::graph::CaptureMode`).
pub fn thread_local_capture() -> CaptureOptions {
    CaptureOptions { mode: CaptureMode::ThreadLocal, ..Default::default() }
}

/// Median replay time of a graph holding one all-to-all of `block` bytes per peer, a thread per
/// rank (each captures its own transfers; rank 0's events). Gives the groups back (`None` when
/// a rank's thread panicked) with the time.
fn time_alltoall_graph(
    groups: Vec<EpGroup>,
    block: usize,
    reps: usize,
) -> (Option<Vec<EpGroup>>, capturable_moe::Result<f64>) {
    let ranks = groups.len();
    let gate = RankGate::new(ranks);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let gate = &gate;
                scope.spawn(move || {
                    let timing = replay_alltoall(&g, block, reps, gate);
                    (g, timing)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut back = Vec::with_capacity(ranks);
    let mut timing = None;
    for result in results {
        let Ok((g, t)) = result else { return (None, Err(panicked("the NCCL all-to-all graph rows"))) };
        back.push(g);
        timing.get_or_insert(t);
    }
    (Some(back), timing.expect("rank 0"))
}

/// One rank of [`time_alltoall_graph`]: no rank replays unless every rank set up its graph.
fn replay_alltoall(g: &EpGroup, block: usize, reps: usize, gate: &RankGate) -> capturable_moe::Result<f64> {
    let stream = g.stream();
    let ranks = g.ranks();
    let setup = (|| -> capturable_moe::Result<_> {
        let send = stream.alloc_zeros::<u8>(ranks * block)?;
        let mut recv = stream.alloc_zeros::<u8>(ranks * block)?;
        g.exchange(stream, &send, &mut recv, block)?; // NCCL connects peers on first use
        let graph = capture_with(stream, thread_local_capture(), || g.exchange(stream, &send, &mut recv, block))?;
        stream.synchronize()?;
        Ok((send, recv, graph))
    })();
    let (_send, _recv, graph) = gate.pass(setup)?;
    let mut failure = None;
    let (us, _) = time(stream, reps, |_| {
        if let Err(e) = graph.launch() {
            failure.get_or_insert(e);
        }
    });
    stream.synchronize()?;
    failure.map_or(Ok(us), |e| Err(e.into()))
}

/// Median time of one all-to-all of `block` bytes per peer on every rank (CUDA events on rank
/// 0's stream; every rank's transfers are enqueued together in one NCCL group).
fn time_alltoall(groups: &[EpGroup], block: usize, reps: usize) -> capturable_moe::Result<f64> {
    let ranks = groups.len();
    let mut buffers: Vec<(CudaSlice<u8>, CudaSlice<u8>)> = groups
        .iter()
        .map(|g| Ok((g.stream().alloc_zeros::<u8>(ranks * block)?, g.stream().alloc_zeros::<u8>(ranks * block)?)))
        .collect::<capturable_moe::Result<_>>()?;
    let mut failure = None;
    let (us, _host_us) = time(groups[0].stream(), reps, |_| {
        let enqueued = nccl_group(|| {
            for (g, (send, recv)) in groups.iter().zip(buffers.iter_mut()) {
                g.exchange(g.stream(), send, recv, block)?;
            }
            Ok(())
        });
        if let Err(e) = enqueued {
            failure.get_or_insert(e);
        }
    });
    // Every rank's stream done before the buffers are freed.
    for g in groups {
        g.stream().synchronize()?;
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(us),
    }
}

/// nccl-tests' figures for alltoall: algbw = bytes sent per rank / time, busbw = algbw (R-1)/R
/// (the share that crosses a link). R = 1 crosses none: busbw is 0 there, so the row shows
/// algbw and says the time is NCCL's self-copy path only.
fn alltoall_row(shape: &str, op: &str, imp: &str, ranks: usize, block: usize, us: f64) -> Row {
    let bytes = (ranks * block) as f64;
    let algbw = bytes / us * 1e-3;
    if ranks == 1 {
        let note = format!(
            "R = 1 measures NCCL's self-copy path only (no link crossed, busbw 0); GB/s = algbw, {:.1} MB per rank",
            bytes / 1e6
        );
        return row(shape, op, imp, us, algbw, note);
    }
    let busbw = algbw * (ranks - 1) as f64 / ranks as f64;
    let note = format!(
        "GB/s = busbw (algbw {algbw:.0} x (R-1)/R), {:.1} MB per rank, R = {ranks} in one process",
        bytes / 1e6
    );
    row(shape, op, imp, us, busbw, note)
}

/// Where the rank threads agree that every rank's setup worked, before their first collective.
pub struct RankGate {
    barrier: Barrier,
    failed: AtomicBool,
}

impl RankGate {
    pub fn new(ranks: usize) -> RankGate {
        RankGate { barrier: Barrier::new(ranks), failed: AtomicBool::new(false) }
    }

    /// `Ok` when every rank reached the gate with its setup done; a rank whose setup failed
    /// still comes here, so that no rank waits at the barrier or in a collective for it.
    pub fn pass<T>(&self, setup: capturable_moe::Result<T>) -> capturable_moe::Result<T> {
        if setup.is_err() {
            self.failed.store(true, Ordering::SeqCst);
        }
        self.barrier.wait();
        let value = setup?;
        if self.failed.load(Ordering::SeqCst) {
            return Err(capturable_moe::Error::InvalidArgument {
                op: "ep bench",
                why: "another rank's setup failed".into(),
            });
        }
        Ok(value)
    }
}
