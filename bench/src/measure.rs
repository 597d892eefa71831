//! Timing, test data and row bookkeeping shared by every benchmarked operation.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

pub use crate::data::random_bf16;

/// Median GPU time (CUDA events around each call) and median host enqueue time, in us.
///
/// The reps are enqueued back to back and synchronised once at the end, so each start event
/// fires when the previous rep's work ends: a rep's time is GPU time when the GPU is the
/// bottleneck and keeps the host's gaps when the host is (rep 0, on an idle stream, is an outlier
/// the median drops).
pub fn time(stream: &Arc<CudaStream>, reps: usize, mut enqueue: impl FnMut(usize)) -> (f64, f64) {
    let ctx = stream.context();
    for i in 0..3 {
        enqueue(i);
    }
    stream.synchronize().unwrap();
    let reps = reps.max(1);
    // Timing needs CU_EVENT_DEFAULT: cudarc's default flags disable it.
    let event = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let events: Vec<_> = (0..reps).map(|_| (event(), event())).collect();
    // Tens of reps of a few launches each never fill the launch queue, so an enqueue does not
    // block on it and `host` stays the enqueue cost alone (thousands of launches could block).
    let mut host = Vec::with_capacity(reps);
    for (i, (start, end)) in events.iter().enumerate() {
        start.record(stream).unwrap();
        let t = Instant::now();
        enqueue(i);
        host.push(t.elapsed().as_secs_f64() * 1e6);
        end.record(stream).unwrap();
    }
    stream.synchronize().unwrap();
    let mut gpu: Vec<f64> = events.iter().map(|(start, end)| start.elapsed_ms(end).unwrap() as f64 * 1e3).collect();
    (median(&mut gpu), median(&mut host))
}

/// Median time of each call on its own, as `bench/anchors/torch_anchor.py` times torch: start
/// event, enqueue, end event, wait, so the host enqueue of each call (on an idle stream) is in
/// its time. Only for the rows compared with the torch anchor's eager figures.
pub fn time_synced(stream: &Arc<CudaStream>, reps: usize, mut enqueue: impl FnMut(usize)) -> f64 {
    let ctx = stream.context();
    for i in 0..3 {
        enqueue(i);
    }
    stream.synchronize().unwrap();
    let event = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let mut gpu: Vec<f64> = (0..reps.max(1))
        .map(|i| {
            let (start, end) = (event(), event());
            start.record(stream).unwrap();
            enqueue(i);
            end.record(stream).unwrap();
            end.synchronize().unwrap();
            start.elapsed_ms(&end).unwrap() as f64 * 1e3
        })
        .collect();
    median(&mut gpu)
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[derive(Clone)]
pub struct Row {
    pub shape: String,
    pub routing: String,
    pub op: String,
    pub imp: String,
    pub us: f64,
    pub tflops: f64,
    pub gbps: f64,
    pub host_us: Option<f64>,
    pub note: Option<String>,
}

/// Normwise relative error of `got` against `want` over a deterministic sample of elements.
pub fn sampled_relerr(stream: &Arc<CudaStream>, got: &CudaSlice<bf16>, want: &CudaSlice<bf16>, valid: usize) -> f64 {
    let g = stream.clone_dtoh(got).unwrap();
    let w = stream.clone_dtoh(want).unwrap();
    let step = (valid / 4_000_000).max(1);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for i in (0..valid).step_by(step) {
        let (a, b) = (g[i].to_f64(), w[i].to_f64());
        if a.is_nan() {
            return f64::NAN;
        }
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    (diff / norm.max(1e-30)).sqrt()
}

