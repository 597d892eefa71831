//! Shared helpers of the tests.
#![allow(dead_code)]

pub mod echo_moe;
pub mod emulation;
pub mod expert_io;
pub mod fused;
pub mod gemm;
pub mod layout;
pub mod moe;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod routing;

use std::sync::Arc;

use cudarc::driver::CudaStream;

/// A fresh stream on GPU 0, or `None` after printing `skipping: <reason>` where there is no
/// usable GPU. With `CAPMOE_REQUIRE_GPU=1` a missing GPU fails the test instead, so a skip is
/// never mistaken for a pass on the GPU machine.
pub fn gpu_stream() -> Option<Arc<CudaStream>> {
    match capturable_moe::device::open(0) {
        Ok(ctx) => Some(ctx.new_stream().expect("creating a CUDA stream")),
        Err(reason) => {
            skip_unless_gpu_required(&reason);
            None
        }
    }
}

/// Prints `skipping: <reason>` for a GPU that cannot be used, or panics with `CAPMOE_REQUIRE_GPU=1`.
fn skip_unless_gpu_required(reason: &dyn std::fmt::Display) {
    if std::env::var("CAPMOE_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("CAPMOE_REQUIRE_GPU=1 but no usable GPU: {reason}");
    }
    println!("skipping: {reason}");
}

/// The number of visible GPUs when it is at least `n`; otherwise `None` after printing
/// `skipping: <what> needs ...`. One GPU is not a broken GPU, so `CAPMOE_REQUIRE_GPU=1` does
/// not fail it; `CAPMOE_REQUIRE_MULTI_GPU=1` (the multi-GPU run, docs/ep.md) does, so that a
/// machine with too few GPUs cannot pass the multi-rank tests there.
pub fn gpus_at_least(n: usize, what: &str) -> Option<usize> {
    let gpus = cudarc::driver::CudaContext::device_count().map_or(0, |count| count as usize);
    if gpus >= n {
        return Some(gpus);
    }
    let reason = format!("{what} needs {n} or more GPUs, this machine has {gpus}");
    if std::env::var("CAPMOE_REQUIRE_MULTI_GPU").as_deref() == Ok("1") {
        panic!("CAPMOE_REQUIRE_MULTI_GPU=1 but {reason}");
    }
    println!("skipping: {reason}");
    None
}

/// Takes the GPU stream or returns from the calling test after printing why.
#[macro_export]
macro_rules! gpu_or_skip {
    () => {
        match common::gpu_stream() {
            Some(stream) => stream,
            None => return,
        }
    };
}

/// Takes the GPU stream when its device is one of the given archs (those a kernel under test
/// has a variant for), or returns from the calling test after printing why. A device of another
/// arch is not a missing GPU: the test has nothing to check there, so `CAPMOE_REQUIRE_GPU`
/// does not fail it. `gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90)`.
#[macro_export]
macro_rules! gpu_of_arch_or_skip {
    ($what:expr, $($arch:expr),+) => {{
        let stream = gpu_or_skip!();
        if !common::device_is(&stream, &[$($arch),+], $what) {
            return;
        }
        stream
    }};
}

/// Whether the device of `stream` is one of `archs` (and built into this binary); prints
/// `skipping: ...` otherwise. A device whose properties cannot be read is an unusable GPU:
/// that fails the test under `CAPMOE_REQUIRE_GPU=1`, as in [`gpu_stream`].
pub fn device_is(stream: &CudaStream, archs: &[capturable_moe::device::Arch], what: &str) -> bool {
    match capturable_moe::device::DeviceInfo::of_stream(stream) {
        Ok(info) if archs.contains(&info.arch) => true,
        Ok(info) => {
            println!("skipping: {what} has kernels for {archs:?} only; this device ({}) is {:?}", info.name, info.arch);
            false
        }
        Err(reason) => {
            skip_unless_gpu_required(&format!("{what}: {reason}"));
            false
        }
    }
}

/// Whether the tests run under compute-sanitizer: `CAPMOE_SANITIZER=1`, which
/// `scripts/sanitize.sh` sets. Long functional tests then run fewer replays (each still checked
/// in full).
pub fn under_sanitizer() -> bool {
    std::env::var("CAPMOE_SANITIZER").as_deref() == Ok("1")
}

/// `n` steps, or at most `cap` under a sanitizer: racecheck's host memory grows with every
/// launch it tracks (a fused expert-path test of 2 x 12 forward + backward steps passed the GPU
/// machine's 128 GiB alone), so step loops whose first `cap` steps already cover every kind of
/// step they make run only those there.
pub fn steps_under_sanitizer(n: usize, cap: usize) -> usize {
    if under_sanitizer() {
        n.min(cap)
    } else {
        n
    }
}

/// For timing-only and soak tests, whose figures mean nothing under a tool that slows every
/// kernel 10-100x: prints `skipping: under a sanitizer` and returns true there.
pub fn skip_under_sanitizer() -> bool {
    let skip = under_sanitizer();
    if skip {
        println!("skipping: under a sanitizer (CAPMOE_SANITIZER=1)");
    }
    skip
}

/// The median of `values` (the upper one of an even count); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Mean GPU time of one `run`, in microseconds: `warmup` untimed calls, then `reps` calls back
/// to back between two timing events on `stream` (the timing hooks' measure).
pub fn mean_gpu_us(stream: &Arc<CudaStream>, warmup: usize, reps: usize, mut run: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        run();
    }
    let ctx = stream.context();
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (ctx.new_event(timing).unwrap(), ctx.new_event(timing).unwrap());
    start.record(stream).unwrap();
    for _ in 0..reps {
        run();
    }
    end.record(stream).unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64 * 1e3 / reps as f64
}

/// Graph-capture tests serialise on this lock: capture in global mode forbids unrelated
/// CUDA work from other threads of the process while it is open. It does not cover everything:
/// [`gpu_stream`] opens a new context object, whose first stream makes cudarc synchronise the
/// context, and most tests open their stream before taking the lock. So on a GPU the test
/// binaries run with `--test-threads=1` (scripts/test.sh and scripts/gpu-run.sh pass it).
pub static CAPTURE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The device's free memory in bytes (`cuMemGetInfo`) as the driver sees it now.
pub fn free_device_bytes(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> usize {
    stream.synchronize().unwrap();
    stream.context().bind_to_thread().unwrap();
    cudarc::driver::result::mem_get_info().unwrap().0
}

/// Takes [`CAPTURE_LOCK`], also after a test that held it panicked: that test's failure is
/// reported once, instead of as a `PoisonError` in every later capture test.
pub fn capture_lock() -> std::sync::MutexGuard<'static, ()> {
    CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
