//! Timing of plan + reroute for the benchmark report (op `echo_plan`): the two launches are
//! captured once in a CUDA graph and the graph is replayed back to back (one sync at the end);
//! GPU time per replay from CUDA events. The host enqueue time of the eager sequence (the
//! launcher call itself, no sync) is timed too.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;

use capturable_moe::echo::synthetic::synthetic_inputs;
use capturable_moe::echo::{EchoConfig, EchoPlan};
use capturable_moe::routing::Tokens;
use capturable_moe::Result;

/// Which reroute form to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `[T, E]` map + probs -> `[T, E+S]`.
    Dense,
    /// `[T, k]` ids + probs -> `[T, k]` columns.
    TopK,
    /// The top-k form with block balancing at this block capacity (what `EpMoe` runs).
    TopKCapped(usize),
}

/// Median and minimum GPU time of one plan + reroute graph replay, and the median host time of
/// one eager `plan_reroute_*` call (enqueue only: the call returns before the GPU runs it).
#[derive(Clone, Debug)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    pub replays: usize,
    pub host_median_us: f64,
    pub host_calls: usize,
}

/// Captures plan + reroute for `t` tokens once and times `replays` graph replays.
pub fn time_plan_reroute(
    stream: &Arc<CudaStream>,
    cfg: EchoConfig,
    t: usize,
    form: Form,
    replays: usize,
) -> Result<Timing> {
    let plan = match form {
        Form::TopKCapped(capacity) => EchoPlan::new(cfg.clone(), t)?.with_block_capacity(capacity)?,
        _ => EchoPlan::new(cfg.clone(), t)?,
    };
    let (ne, k, w) = (cfg.num_experts, cfg.topk, cfg.num_columns());
    let (counts_h, ids_h, probs_h) = synthetic_inputs(&cfg, t, 7);
    let counts = stream.clone_htod(&counts_h)?;
    let mut state = stream.alloc_zeros::<i64>(plan.state_len())?;
    let mut ws = stream.alloc_zeros::<i32>(plan.workspace_len().max(1))?;
    let ids = stream.clone_htod(&ids_h)?;
    let probs_k = stream.clone_htod(&probs_h)?;
    let mut dense_map = vec![0u8; t * ne];
    let mut dense_probs = vec![0f32; t * ne];
    for i in 0..t * k {
        dense_map[(i / k) * ne + ids_h[i] as usize] = 1;
        dense_probs[(i / k) * ne + ids_h[i] as usize] = probs_h[i];
    }
    let map = stream.clone_htod(&dense_map)?;
    let probs = stream.clone_htod(&dense_probs)?;
    let mut out_map = stream.alloc_zeros::<u8>((t * w).max(1))?;
    let mut out_probs = stream.alloc_zeros::<f32>((t * w).max(1))?;
    let mut out_dest = stream.alloc_zeros::<i32>((t * k).max(1))?;
    let mut out_pk = stream.alloc_zeros::<f32>((t * k).max(1))?;
    let mut run = |s: &Arc<CudaStream>| -> Result<()> {
        match form {
            Form::Dense => plan.plan_reroute_dense(
                s,
                &counts,
                &map,
                &probs,
                Tokens::Host(t),
                &mut state,
                &mut ws,
                &mut out_map,
                &mut out_probs,
            ),
            Form::TopK | Form::TopKCapped(_) => plan.plan_reroute_topk(
                s,
                &counts,
                &ids,
                &probs_k,
                Tokens::Host(t),
                &mut state,
                &mut ws,
                &mut out_dest,
                &mut out_pk,
            ),
        }
    };
    run(stream)?; // warm-up outside the graph (module load, smem attributes)
    stream.synchronize()?;

    // Host enqueue of the eager sequence: wall time of the launcher call alone, median over
    // many calls after warm-up; the stream is drained every 16 calls, outside the timed region,
    // so the launch queue never fills up and blocks a call.
    for _ in 0..20 {
        run(stream)?;
    }
    stream.synchronize()?;
    let host_calls = (4 * replays).max(64);
    let mut host = Vec::with_capacity(host_calls);
    for i in 0..host_calls {
        let t0 = Instant::now();
        run(stream)?;
        host.push(t0.elapsed().as_secs_f64() * 1e6);
        if i % 16 == 15 {
            stream.synchronize()?;
        }
    }
    stream.synchronize()?;
    host.sort_by(|a, b| a.partial_cmp(b).unwrap());

    let ctx = stream.context();
    // `capture` turns cudarc's event tracking off for the capture only and restores it, so the
    // host figure of a later call (the next form or config) is taken in the same mode as this one.
    let graph = capturable_moe::graph::capture(stream, || run(stream))?;
    for _ in 0..10 {
        graph.launch()?;
    }
    // Replays back to back, one sync at the end: each start event fires when the previous
    // replay ends, so a replay's time is its GPU time (no host enqueue gap on an idle stream).
    let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
    let events = (0..replays.max(1)).map(|_| Ok((event()?, event()?))).collect::<Result<Vec<_>>>()?;
    for (start, stop) in &events {
        start.record(stream)?;
        graph.launch()?;
        stop.record(stream)?;
    }
    stream.synchronize()?;
    let mut us =
        events.iter().map(|(start, stop)| Ok(start.elapsed_ms(stop)? as f64 * 1e3)).collect::<Result<Vec<f64>>>()?;
    us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(Timing {
        median_us: us[us.len() / 2],
        min_us: us[0],
        replays: us.len(),
        host_median_us: host[host.len() / 2],
        host_calls,
    })
}
