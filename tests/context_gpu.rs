//! Contexts, streams and captures across modules: buffers are checked by CUDA context (driver
//! handle), not by `Arc` identity; a buffer of another context is `Error::WrongContext` before
//! anything is launched, in every module; inside a capture, a buffer of another context object
//! that tracks events is refused; the Echo planner opts into large shared memory in
//! each context; `MoeExperts` is bound to its stream; overlapping captures keep event tracking
//! off until the last one ends.
//!
//! Every test holds `common::CAPTURE_LOCK`, as every capturing test of the crate does: a
//! capture (global mode elsewhere) fails when another test thread makes an unsafe CUDA call.

mod common;

use std::sync::{Arc, Barrier};

use capturable_moe::dtype::DType;
use capturable_moe::echo::{Algorithm, EchoConfig, EchoPlan};
use capturable_moe::graph::{capture_with, CaptureMode, CaptureOptions};
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::moe::{MoeConfig, MoeExperts};
use capturable_moe::routing::{RoutingConfig, RoutingPlan, Tokens};
use capturable_moe::Error;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;

const E: usize = 4;
const N: usize = 16;
const K: usize = 32;
const CAPACITY: usize = 24;

fn lock() -> std::sync::MutexGuard<'static, ()> {
    common::capture_lock()
}

fn small_ints(len: usize, seed: usize) -> Vec<bf16> {
    (0..len).map(|i| bf16::from_f32((((i * 7 + seed * 13) % 5) as f32) - 2.0)).collect()
}

/// The fprop of `small_ints` inputs on the host (exact: integer products and sums < 256).
fn fprop_reference(x: &[bf16], w: &[bf16], splits: &[i32]) -> Vec<f32> {
    let mut y = vec![f32::NAN; CAPACITY * N];
    let mut row = 0;
    for (e, &m) in splits.iter().enumerate() {
        for r in row..row + m as usize {
            for n in 0..N {
                y[r * N + n] = (0..K).map(|k| x[r * K + k].to_f32() * w[(e * N + n) * K + k].to_f32()).sum();
            }
        }
        row += m as usize;
    }
    y
}

/// Buffers allocated through a second `CudaContext::new(0)` (another `Arc`, the same primary
/// context, as another engine such as candle would hold) are accepted by the grouped GEMM and
/// give the exact result; rows past the total keep their poison.
#[test]
fn grouped_gemm_accepts_buffers_of_a_second_handle_on_the_primary_context_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let other_ctx = CudaContext::new(0).unwrap();
    assert!(!Arc::ptr_eq(stream.context(), &other_ctx), "the test needs two CudaContext objects");
    assert_eq!(stream.context().cu_ctx(), other_ctx.cu_ctx(), "both are the primary context");
    let other = other_ctx.default_stream();

    let plan = GroupedGemm::new(GroupedGemmSpec::new(GemmOp::Fprop, E, N, K, CAPACITY), &stream).unwrap();
    let splits_h = [5i32, 0, 11, 3];
    let (x_h, w_h) = (small_ints(CAPACITY * K, 1), small_ints(E * N * K, 2));
    let x = other.clone_htod(&x_h).unwrap();
    let w = other.clone_htod(&w_h).unwrap();
    let mut y = other.clone_htod(&vec![bf16::NAN; CAPACITY * N]).unwrap();
    let splits = other.clone_htod(&splits_h).unwrap();
    let mut flags = other.alloc_zeros::<i32>(1).unwrap();
    let mut ws = other.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    other.synchronize().unwrap();
    plan.run(&stream, &x, &w, &mut y, &splits, Some(&mut flags), &mut ws).unwrap();
    let got = stream.clone_dtoh(&y).unwrap();
    let want = fprop_reference(&x_h, &w_h, &splits_h);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g.to_f32() == *w || (g.is_nan() && w.is_nan()), "y[{i}]: got {g}, want {w}");
    }
    assert_eq!(stream.clone_dtoh(&flags).unwrap()[0], 0);
}

/// A buffer of another `CudaContext` object that tracks events (it has a stream of its own, as
/// candle's device has) is accepted outside a capture, and refused with
/// `Error::TrackedBufferInCapture` inside one: cudarc would make the capturing stream wait on
/// the buffer's write event, recorded before the capture began, which breaks the capture.
#[test]
fn a_tracked_buffer_of_another_handle_is_refused_inside_a_capture_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let other_ctx = CudaContext::new(0).unwrap();
    let other = other_ctx.new_stream().unwrap();
    assert!(other_ctx.is_managing_stream_synchronization(), "the other handle must track events");

    let plan = GroupedGemm::new(GroupedGemmSpec::new(GemmOp::Fprop, E, N, K, CAPACITY), &stream).unwrap();
    let x = other.clone_htod(&small_ints(CAPACITY * K, 1)).unwrap();
    let w = stream.clone_htod(&small_ints(E * N * K, 2)).unwrap();
    let mut y = stream.alloc_zeros::<bf16>(CAPACITY * N).unwrap();
    let splits = stream.clone_htod(&[5i32, 0, 11, 3]).unwrap();
    let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    plan.run(&stream, &x, &w, &mut y, &splits, None, &mut ws).expect("outside a capture the buffer is accepted");
    stream.synchronize().unwrap();

    let captured =
        capturable_moe::graph::capture(&stream, || plan.run(&stream, &x, &w, &mut y, &splits, None, &mut ws));
    match captured {
        Err(Error::TrackedBufferInCapture { what: "a", .. }) => {}
        other => panic!("expected TrackedBufferInCapture for a (x), got {:?}", other.map(|_| "a graph")),
    }
    // The refused launch enqueued nothing: the stream is usable and not capturing.
    plan.run(&stream, &x, &w, &mut y, &splits, None, &mut ws).unwrap();
    stream.synchronize().unwrap();
}

/// The overflow flag word may be a view: one word of a larger buffer gets the capacity bit,
/// its neighbours stay untouched.
#[test]
fn grouped_gemm_overflow_flag_word_may_be_a_view_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let plan = GroupedGemm::new(GroupedGemmSpec::new(GemmOp::Fprop, E, N, K, CAPACITY), &stream).unwrap();
    let x = stream.clone_htod(&small_ints(CAPACITY * K, 1)).unwrap();
    let w = stream.clone_htod(&small_ints(E * N * K, 2)).unwrap();
    let mut y = stream.alloc_zeros::<bf16>(CAPACITY * N).unwrap();
    let splits = stream.clone_htod(&[20i32, 10, 0, 1]).unwrap(); // 31 rows > CAPACITY = 24
    let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    let mut words = stream.clone_htod(&[7i32, 0, 0, 9]).unwrap();
    let mut word = words.slice_mut(1..2);
    plan.run(&stream, &x, &w, &mut y, &splits, Some(&mut word), &mut ws).unwrap();
    let got = stream.clone_dtoh(&words).unwrap();
    assert_eq!(got, [7, capturable_moe::grouped_gemm::OVERFLOW_CAPACITY, 0, 9]);
}

/// A buffer of a separately created context (not the primary one) is `WrongContext` in every
/// module, before anything is launched (the outputs keep their contents).
#[test]
fn a_buffer_of_another_context_is_wrong_context_in_every_module_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let foreign_ctx = CudaContext::new_non_primary(0, 0).unwrap();
    let foreign = foreign_ctx.default_stream();
    let is_wrong_context = |what: &str, r: capturable_moe::Result<()>| match r {
        Err(Error::WrongContext { .. }) => {}
        other => panic!("{what}: expected WrongContext, got {other:?}"),
    };

    // Grouped GEMM: the foreign buffer is the weight.
    let plan = GroupedGemm::new(GroupedGemmSpec::new(GemmOp::Fprop, E, N, K, CAPACITY), &stream).unwrap();
    let x = stream.clone_htod(&small_ints(CAPACITY * K, 1)).unwrap();
    let w_foreign = foreign.clone_htod(&small_ints(E * N * K, 2)).unwrap();
    let mut y = stream.clone_htod(&vec![bf16::from_f32(3.0); CAPACITY * N]).unwrap();
    let splits = stream.clone_htod(&[1i32, 1, 1, 1]).unwrap();
    let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    is_wrong_context("grouped_gemm", plan.run(&stream, &x, &w_foreign, &mut y, &splits, None, &mut ws));
    assert!(stream.clone_dtoh(&y).unwrap().iter().all(|v| v.to_f32() == 3.0), "grouped_gemm launched");

    // Routing: the foreign buffer is expert_ids.
    let routing = RoutingPlan::new(RoutingConfig {
        num_experts: E,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 8,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let mut maps = routing.alloc_maps(&stream).unwrap();
    let ids_foreign = foreign.clone_htod(&[0i32; 16]).unwrap();
    is_wrong_context("routing build", routing.build(&stream, &ids_foreign, Tokens::Host(8), &mut maps));
    let t_foreign = foreign.clone_htod(&[8i32]).unwrap();
    let ids = stream.clone_htod(&[0i32; 16]).unwrap();
    is_wrong_context("routing build (device T)", routing.build(&stream, &ids, Tokens::Device(&t_foreign), &mut maps));
    assert!(stream.clone_dtoh(&maps.row_of_route).unwrap().iter().all(|&r| r == -1), "routing launched");

    // Echo: the foreign buffer is the count matrix, then the device token count.
    let cfg = EchoConfig {
        ep: 2,
        num_experts: 4,
        spare_per_rank: 1,
        ep_rank: 0,
        topk: 2,
        algorithm: Algorithm::default_for(1),
        threshold_multiplier: 0.0,
    };
    let echo = EchoPlan::new(cfg, 8).unwrap();
    let counts_foreign = foreign.clone_htod(&[1i64; 8]).unwrap();
    let mut state = stream.clone_htod(&vec![-5i64; echo.state_len()]).unwrap();
    is_wrong_context("echo plan", echo.plan(&stream, &counts_foreign, &mut state));
    let counts = stream.clone_htod(&[1i64; 8]).unwrap();
    let probs = stream.clone_htod(&[0.5f32; 16]).unwrap();
    let mut ws_echo = stream.alloc_zeros::<i32>(echo.workspace_len()).unwrap();
    let mut dest = stream.alloc_zeros::<i32>(16).unwrap();
    let mut dest_probs = stream.alloc_zeros::<f32>(16).unwrap();
    is_wrong_context(
        "echo reroute (device T)",
        echo.plan_reroute_topk(
            &stream,
            &counts,
            &ids,
            &probs,
            Tokens::Device(&t_foreign),
            &mut state,
            &mut ws_echo,
            &mut dest,
            &mut dest_probs,
        ),
    );
    let slot_expert = stream.clone_htod(&[0i64, 1]).unwrap();
    let home = stream.alloc_zeros::<f32>(4 * 8).unwrap();
    let mut spare_foreign = foreign.alloc_zeros::<f32>(2 * 8).unwrap();
    let mut err = stream.alloc_zeros::<i64>(1).unwrap();
    is_wrong_context(
        "echo fill_spare_weights",
        capturable_moe::echo::fill_spare_weights(
            &stream,
            &slot_expert,
            4,
            0,
            2,
            &home,
            &mut spare_foreign,
            8,
            &mut err,
        ),
    );
    assert!(stream.clone_dtoh(&state).unwrap().iter().all(|&v| v == -5), "echo launched");

    // MoeExperts: the foreign buffer is x.
    let mut moe = MoeExperts::<bf16>::new(moe_config(), &stream).unwrap();
    let x_foreign = foreign.alloc_zeros::<bf16>(8 * 64).unwrap();
    let w1 = stream.alloc_zeros::<bf16>(E * 64 * 64).unwrap();
    let w2 = stream.alloc_zeros::<bf16>(E * 64 * 32).unwrap();
    let mut y = stream.clone_htod(&vec![bf16::from_f32(3.0); 8 * 64]).unwrap();
    is_wrong_context("moe forward", moe.forward(&stream, &x_foreign, &ids, &probs, Tokens::Host(8), &w1, &w2, &mut y));
    assert!(stream.clone_dtoh(&y).unwrap().iter().all(|v| v.to_f32() == 3.0), "moe launched");
}

fn moe_config() -> MoeConfig {
    MoeConfig {
        num_experts: E,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 8,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    }
}

/// `MoeExperts` is bound to the stream it was made on: another stream of the same context is
/// `WrongStream` before any launch; the bound one runs.
#[test]
fn moe_experts_is_bound_to_its_stream_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let mut moe = MoeExperts::<bf16>::new(moe_config(), &stream).unwrap();
    assert_eq!(moe.desc().stream, stream.cu_stream() as u64);
    let second = stream.context().new_stream().unwrap();
    let x = stream.clone_htod(&small_ints(8 * 64, 3)).unwrap();
    let ids = stream.clone_htod(&[0i32, 1, 2, 3, 1, 2, 3, 0, 0, 1, 2, 3, 1, 2, 3, 0]).unwrap();
    let probs = stream.clone_htod(&[0.5f32; 16]).unwrap();
    let w1 = stream.clone_htod(&small_ints(E * 64 * 64, 4)).unwrap();
    let w2 = stream.clone_htod(&small_ints(E * 64 * 32, 5)).unwrap();
    let mut y = stream.clone_htod(&vec![bf16::NAN; 8 * 64]).unwrap();
    match moe.forward(&second, &x, &ids, &probs, Tokens::Host(8), &w1, &w2, &mut y) {
        Err(Error::WrongStream { .. }) => {}
        other => panic!("expected WrongStream, got {other:?}"),
    }
    assert!(stream.clone_dtoh(&y).unwrap().iter().all(|v| v.is_nan()), "forward launched on the wrong stream");
    moe.forward(&stream, &x, &ids, &probs, Tokens::Host(8), &w1, &w2, &mut y).unwrap();
    assert!(stream.clone_dtoh(&y).unwrap().iter().all(|v| v.is_finite()), "forward did not write y");
}

/// The Echo plan at the target shape (EP = 64, E = 256: C staged in more than 48 KB of shared
/// memory) runs in the primary context, then in a separately created context, where the
/// kernel's shared-memory opt-in must be made again (a per-device cache skipped it: the launch
/// failed). Both states must agree bit for bit and report no device error.
#[test]
fn echo_plan_opts_into_shared_memory_in_each_context_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let cfg = EchoConfig {
        ep: 64,
        num_experts: 256,
        spare_per_rank: 2,
        ep_rank: 5,
        topk: 8,
        algorithm: Algorithm::default_for(2),
        threshold_multiplier: 0.0,
    };
    let plan = EchoPlan::new(cfg, 4096).unwrap();
    let counts_h: Vec<i64> =
        (0..64 * 256).map(|i| ((i * 7919) % 97 + if i % 256 < 3 { 900 } else { 0 }) as i64).collect();
    let run = |s: &Arc<CudaStream>| -> Vec<i64> {
        let counts = s.clone_htod(&counts_h).unwrap();
        let mut state: CudaSlice<i64> = s.clone_htod(&vec![-7i64; plan.state_len()]).unwrap();
        plan.plan(s, &counts, &mut state).unwrap();
        assert!(plan.read_errors(s, &state).unwrap().is_empty());
        s.clone_dtoh(&state).unwrap()
    };
    let primary = run(&stream);
    let other_ctx = CudaContext::new_non_primary(0, 0).unwrap();
    let other = run(&other_ctx.default_stream());
    assert!(primary == other, "the plan differs between the two contexts");
}

/// Two captures on one context overlapping in time (two threads, two streams): event tracking
/// stays off until the second ends, then is back on (as before the first began).
#[test]
fn overlapping_captures_keep_event_tracking_off_until_the_last_ends_gpu() {
    let stream = gpu_or_skip!();
    let _lock = lock();
    let ctx = stream.context().clone();
    assert!(ctx.is_event_tracking());
    let second = ctx.new_stream().unwrap();
    let (mut a_buf, mut b_buf) = (stream.alloc_zeros::<i32>(64).unwrap(), second.alloc_zeros::<i32>(64).unwrap());
    stream.synchronize().unwrap();
    second.synchronize().unwrap();
    let (b_started, a_ended) = (Barrier::new(2), Barrier::new(2));
    // Thread-local mode: with global mode, the first thread's end of capture (instantiate,
    // destroy) could count as an unsafe call during the second thread's capture. The tracking
    // count under test does not depend on the mode.
    let options = CaptureOptions { upload: false, mode: CaptureMode::ThreadLocal };
    std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            let mut passed_started = false;
            let result = capture_with(&stream, options, || {
                stream.memset_zeros(&mut a_buf)?;
                b_started.wait();
                passed_started = true;
                Ok(())
            });
            if !passed_started {
                b_started.wait();
            }
            result.map(|_| ())
        });
        let other = scope.spawn(|| {
            let (mut passed_started, mut passed_ended) = (false, false);
            let result = capture_with(&second, options, || {
                second.memset_zeros(&mut b_buf)?;
                b_started.wait();
                passed_started = true;
                a_ended.wait();
                passed_ended = true;
                assert!(!ctx.is_event_tracking(), "tracking came back on while this capture was running");
                Ok(())
            });
            // A capture that failed before its barriers still releases the first thread and the
            // main thread, so that the failure is reported instead of hanging there.
            if !passed_started {
                b_started.wait();
            }
            if !passed_ended {
                a_ended.wait();
            }
            result.map(|_| ())
        });
        first.join().unwrap().unwrap();
        a_ended.wait();
        other.join().unwrap().unwrap();
    });
    assert!(ctx.is_event_tracking(), "tracking not restored after the last capture");
}
