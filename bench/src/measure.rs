//! Timing, test data and row bookkeeping shared by every benchmarked operation.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError};
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

/// Elements [`Sample`] compares: 1024 blocks of 4096 contiguous elements (4M, the old strided
/// sample's size), evenly spaced over `[0, valid)` from its start to its end, or every element
/// when there are no more than that. Blocks, not single strided elements, so that a sample is
/// 1024 small copies instead of a copy of the whole buffer (up to 1.9 GB for a wgrad dW); the
/// spacing (valid / 1024) is shorter than one expert's slice of an [E, N, K] gradient for
/// E <= 1024, so every expert is sampled.
pub fn sample_ranges(valid: usize) -> Vec<Range<usize>> {
    const BLOCKS: usize = 1024;
    const BLOCK: usize = 4096;
    if valid <= BLOCKS * BLOCK {
        return std::iter::once(0..valid).collect();
    }
    // Start i * (valid - BLOCK) / (BLOCKS - 1): the first at 0, the last ending at `valid`,
    // spaced at least BLOCK apart since valid > BLOCKS * BLOCK.
    (0..BLOCKS)
        .map(|i| {
            let start = i * (valid - BLOCK) / (BLOCKS - 1);
            start..start + BLOCK
        })
        .collect()
}

/// The sampled elements ([`sample_ranges`]) of one device buffer, copied to the host once, to
/// compare other outputs with.
pub struct Sample {
    ranges: Vec<Range<usize>>,
    values: Vec<bf16>,
}

impl Sample {
    /// Copies the sampled elements of the first `valid` elements of `buf`.
    pub fn of(stream: &Arc<CudaStream>, buf: &CudaSlice<bf16>, valid: usize) -> Result<Sample, DriverError> {
        let ranges = sample_ranges(valid);
        let values = copy_ranges(stream, buf, &ranges)?;
        Ok(Sample { ranges, values })
    }

    /// Normwise relative error of `got` against this sample, over the same elements.
    pub fn relerr_of(&self, stream: &Arc<CudaStream>, got: &CudaSlice<bf16>) -> Result<f64, DriverError> {
        Ok(relerr(&copy_ranges(stream, got, &self.ranges)?, &self.values))
    }

    /// [`relerr_of`](Self::relerr_of) for an fp32 output (the wgrad's fp32 main-grad mode),
    /// rounded to bf16 first as the reference was.
    pub fn relerr_of_f32(&self, stream: &Arc<CudaStream>, got: &CudaSlice<f32>) -> Result<f64, DriverError> {
        let got: Vec<bf16> = copy_ranges(stream, got, &self.ranges)?.into_iter().map(bf16::from_f32).collect();
        Ok(relerr(&got, &self.values))
    }
}

fn copy_ranges<T: DeviceRepr + Default + Clone>(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    ranges: &[Range<usize>],
) -> Result<Vec<T>, DriverError> {
    let mut host = vec![T::default(); ranges.iter().map(|r| r.len()).sum()];
    let mut at = 0;
    for r in ranges {
        stream.memcpy_dtoh(&buf.slice(r.clone()), &mut host[at..at + r.len()])?;
        at += r.len();
    }
    // NOTE: a copy to pageable memory returns once done (as `clone_dtoh` relies on); the sync
    // makes the host read below not depend on that driver rule.
    stream.synchronize()?;
    Ok(host)
}

/// sqrt(sum (got - want)^2 / sum want^2); NaN when `got` holds a NaN.
pub fn relerr(got: &[bf16], want: &[bf16]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let (a, b) = (g.to_f64(), w.to_f64());
        if a.is_nan() {
            return f64::NAN;
        }
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    (diff / norm.max(1e-30)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_are_compared_whole() {
        for valid in [0, 1, 4096 * 1024] {
            let ranges = sample_ranges(valid);
            assert_eq!(ranges.len(), 1);
            assert_eq!(ranges[0], 0..valid);
        }
    }

    #[test]
    fn large_buffers_are_sampled_in_spread_blocks() {
        // A dsv3_ep8_fc1 wgrad dW: 32 * 4096 * 7168 elements.
        let valid = 32 * 4096 * 7168;
        let ranges = sample_ranges(valid);
        assert_eq!(ranges.len(), 1024);
        assert!(ranges.iter().all(|r| r.len() == 4096));
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges[1023].end, valid);
        assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
        // Every expert's [N, K] slice holds a sampled block.
        let per_expert = valid / 32;
        assert!((0..32).all(|e| ranges.iter().any(|r| r.start / per_expert == e)));
        // Just above the threshold the blocks still do not overlap.
        let ranges = sample_ranges(4096 * 1024 + 1);
        assert!(ranges.windows(2).all(|w| w[0].end <= w[1].start));
        assert_eq!(ranges[1023].end, 4096 * 1024 + 1);
    }

    #[test]
    fn relerr_is_normwise_and_nan_never_passes() {
        let want: Vec<bf16> = [3.0f32, 4.0].iter().map(|&v| bf16::from_f32(v)).collect();
        let got: Vec<bf16> = [3.0f32, 4.5].iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(relerr(&want, &want), 0.0);
        assert!((relerr(&got, &want) - 0.1).abs() < 1e-12);
        let nan = vec![bf16::NAN, bf16::from_f32(4.0)];
        assert!(relerr(&nan, &want).is_nan());
    }
}
