//! The expert path with the fused fc1 (`MoeOptions::fc1 = FusedKernel::Fused`) against the same
//! path unfused: forward and backward bit for bit (the fused kernel writes the unfused act and
//! h bits, and nothing downstream changes), against the fp64 reference, and one captured graph
//! replayed with fresh routing against eager unfused runs.
//!
//! With the fused fc2 dgrad + SwiGLU backward (`MoeOptions::swiglu_dgrad`): the forward is
//! unchanged (y bit for bit); dx, dprobs, dw1, dw2 within tolerance of the unfused backward and
//! of the fp64 reference, their bitwise agreement reported (not asserted: the fused GEMM's sum
//! order need not be CUTLASS's); a captured graph replayed with fresh routing bit-equal to eager
//! runs of the same plan.
//!
//! With the route probability in fc1's epilogue (`MoeOptions::prob_in_fc1`, every fused kernel,
//! no drows, dy gathered by the fc2 dgrad, dprobs from its epilogue): every output within
//! tolerance of the unfused plan and the fp64 reference, forward-only y equal to the training
//! plan's, 200 graph replays bit-equal to eager, the plan's refusals of incomplete choices, and
//! the same against the unfused plan with fp32 gradients added into, bf16 probabilities and a host T.

mod common;

use std::sync::Arc;

use capturable_moe::device::{Arch, DeviceInfo};
use capturable_moe::dtype::DType;
use capturable_moe::graph::capture;
use capturable_moe::moe::{FusedKernel, MoeConfig, MoeExperts, MoeOptions, WeightForm};
use capturable_moe::routing::Tokens;
use capturable_moe::Error;
use common::expert_io::{bits16, bits32, layer_config, ExpertIo as Io, Step};
use common::moe::{
    assert_bits, assert_close, assert_written_bf16, assert_written_f16, assert_written_f32, bf, f64s, poison_bf16,
    poison_f16, poison_f32, reference, reference_f16, Dims, Reference,
};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

const E: usize = 8;
const H: usize = 192;
const F: usize = 256;
const K: usize = 2;
const T_MAX: usize = 160;
const DIMS: Dims = Dims { e: E, h: H, f: F, k: K };

fn config(capacity: Option<usize>) -> MoeConfig {
    MoeConfig { capacity, ..layer_config(DIMS, T_MAX) }
}

fn plan(stream: &Arc<CudaStream>, capacity: Option<usize>, fc1: FusedKernel, forward_only: bool) -> MoeExperts<bf16> {
    let opts = MoeOptions { fc1, forward_only, ..MoeOptions::default() };
    let moe = MoeExperts::<bf16>::with_options(config(capacity), opts, stream).unwrap();
    assert_eq!(moe.fc1_is_fused(), fc1 == FusedKernel::Fused, "{fc1:?}");
    moe
}

fn step(rng: &mut StdRng, i: usize) -> Step {
    let t = match i % 6 {
        0 => 0,
        1 => T_MAX,
        _ => rng.random_range(1..=T_MAX),
    };
    let mut ids = vec![-1i32; T_MAX * K];
    let mut probs = vec![0f32; T_MAX * K];
    for tok in 0..t {
        for j in 0..K {
            ids[tok * K + j] = match i % 5 {
                2 => 3,                                             // one expert takes every route
                3 => [-1, E as i32 + 2, 1][rng.random_range(0..3)], // empty, dropped, one expert
                _ => rng.random_range(0..E as i32),                 // duplicates possible
            };
            probs[tok * K + j] = rng.random_range(0.05f32..1.0);
        }
    }
    let x = bf(&(0..T_MAX * H).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>());
    let dy = bf(&(0..T_MAX * H).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>());
    Step { t, ids, probs, x, dy }
}

/// The caller-owned buffers of one layer of [`DIMS`], holding the weights `w1`, `w2`.
fn layer_io(stream: &Arc<CudaStream>, w1: &[bf16], w2: &[bf16]) -> Io {
    Io::new(stream, DIMS, T_MAX, w1, w2)
}

fn weights(seed: u64) -> (Vec<bf16>, Vec<bf16>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (s1, s2) = (1.0 / (H as f32).sqrt(), 1.0 / (F as f32).sqrt());
    (
        bf(&(0..E * 2 * F * H).map(|_| rng.random_range(-s1..s1)).collect::<Vec<_>>()),
        bf(&(0..E * H * F).map(|_| rng.random_range(-s2..s2)).collect::<Vec<_>>()),
    )
}

/// The fp64 reference of step `s`: ids out of range are dropped by the GPU and ignored by
/// the reference alike.
fn reference_of(s: &Step, w1: &[bf16], w2: &[bf16]) -> Reference {
    reference(DIMS, s.t, &ids_in_range(s), &s.probs, &s.x, &s.dy, w1, w2)
}

/// The step's expert ids with those out of range (dropped by the GPU) as -1 (no route).
fn ids_in_range(s: &Step) -> Vec<i32> {
    s.ids.iter().map(|&e| if (0..E as i32).contains(&e) { e } else { -1 }).collect()
}

#[test]
fn fused_moe_equals_unfused_bitwise_and_the_fp64_reference() {
    let stream = gpu_of_arch_or_skip!("the fused fc1", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(1);
    for capacity in [None, Some(150)] {
        let mut fused = plan(&stream, capacity, FusedKernel::Fused, false);
        let mut unfused = plan(&stream, capacity, FusedKernel::Unfused, false);
        let (mut fio, mut uio) = (layer_io(&stream, &w1, &w2), layer_io(&stream, &w1, &w2));
        let mut rng = StdRng::seed_from_u64(2);
        // Steps 0-3 make T = 0, T = T_max, one expert for every route and dropped routes.
        for i in 0..common::steps_under_sanitizer(12, 4) {
            let s = step(&mut rng, i);
            let what = format!("capacity {capacity:?}, step {i} (T={})", s.t);
            fio.load(&stream, &s);
            uio.load(&stream, &s);
            fio.step(&mut fused, &stream).unwrap();
            uio.step(&mut unfused, &stream).unwrap();
            assert_bits(
                &format!("{what}: y, dx, dw1, dw2, dprobs fused vs unfused"),
                &fio.bits(&stream),
                &uio.bits(&stream),
            );
            let y = stream.clone_dtoh(&fio.y).unwrap();
            assert_written_bf16(&format!("{what}: y"), &y, s.t * H);
            assert_written_f32(&format!("{what}: dprobs"), &stream.clone_dtoh(&fio.dprobs).unwrap(), s.t * K);
            if capacity.is_none() {
                let r = reference_of(&s, &w1, &w2);
                assert_close(&format!("{what}: y vs fp64"), &f64s(&y[..s.t * H]), &r.y[..s.t * H], 2e-2);
                let dx = stream.clone_dtoh(&fio.dx).unwrap();
                assert_close(&format!("{what}: dx vs fp64"), &f64s(&dx[..s.t * H]), &r.dx[..s.t * H], 2e-2);
                let dw1 = stream.clone_dtoh(&fio.dw1).unwrap();
                assert_close(&format!("{what}: dw1 vs fp64"), &f64s(&dw1), &r.dw1, 2e-2);
                let dw2 = stream.clone_dtoh(&fio.dw2).unwrap();
                assert_close(&format!("{what}: dw2 vs fp64"), &f64s(&dw2), &r.dw2, 2e-2);
                let dprobs: Vec<f64> =
                    stream.clone_dtoh(&fio.dprobs).unwrap()[..s.t * K].iter().map(|&p| p as f64).collect();
                assert_close(&format!("{what}: dprobs vs fp64"), &dprobs, &r.dprobs[..s.t * K], 2e-2);
            }
        }
    }
}

/// One captured forward + backward of the fused plan, replayed 200 times with fresh routing,
/// x, dy and T; every replay bit-equal to an eager unfused run.
#[test]
fn fused_moe_graph_replays_equal_eager_unfused() {
    let stream = gpu_of_arch_or_skip!("the fused fc1", Arch::Sm90, Arch::Sm100);
    let _lock = common::capture_lock();
    let (w1, w2) = weights(3);
    let mut graph_moe = plan(&stream, None, FusedKernel::Fused, false);
    let mut eager_moe = plan(&stream, None, FusedKernel::Unfused, false);
    let (mut gio, mut eio) = (layer_io(&stream, &w1, &w2), layer_io(&stream, &w1, &w2));
    let mut rng = StdRng::seed_from_u64(4);
    gio.load(&stream, &step(&mut rng, 4));
    stream.synchronize().unwrap();
    let graph = capture(&stream, || gio.step(&mut graph_moe, &stream)).unwrap();
    for i in 0..common::steps_under_sanitizer(200, 10) {
        let s = step(&mut rng, i);
        gio.load(&stream, &s);
        eio.load(&stream, &s);
        graph.launch().unwrap();
        eio.step(&mut eager_moe, &stream).unwrap();
        assert_bits(&format!("replay {i} (T={})", s.t), &gio.bits(&stream), &eio.bits(&stream));
    }
}

/// A forward-only fused plan: y equal to an unfused training plan's, bit for bit, over 6 steps,
/// and backward refused. That it skips the saves (no permuted rows, no h kept) is not checked:
/// the plan's buffers are private and `desc()` carries no lengths.
#[test]
fn fused_moe_forward_only_y_equals_unfused_and_backward_is_refused() {
    let stream = gpu_of_arch_or_skip!("the fused fc1", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(5);
    let mut fwd = plan(&stream, None, FusedKernel::Fused, true);
    let mut unfused = plan(&stream, None, FusedKernel::Unfused, false);
    let (mut fio, mut uio) = (layer_io(&stream, &w1, &w2), layer_io(&stream, &w1, &w2));
    let mut rng = StdRng::seed_from_u64(6);
    for i in 0..6 {
        let s = step(&mut rng, i);
        fio.load(&stream, &s);
        uio.load(&stream, &s);
        fio.forward(&mut fwd, &stream).unwrap();
        uio.forward(&mut unfused, &stream).unwrap();
        // As bits: rows past T hold the poison NaN on both sides, and NaN != NaN as a float.
        assert_bits(&format!("step {i} (T={}): y", s.t), &bits16(&stream, &fio.y), &bits16(&stream, &uio.y));
    }
    assert!(matches!(fio.backward(&mut fwd, &stream), Err(Error::InvalidArgument { .. })));
}

/// The plan-time A/B switch `CAPMOE_FUSED_FC1_ROWS=backward`: a fused fc1 of a training plan
/// leaves the permute to the backward, and Auto keeps the unfused fc1 in training.
fn backward_permute_forced() -> bool {
    std::env::var("CAPMOE_FUSED_FC1_ROWS").is_ok_and(|v| v == "backward")
}

#[test]
fn fused_moe_plan_choices() {
    let stream = gpu_of_arch_or_skip!("the fused fc1", Arch::Sm90, Arch::Sm100);
    // Auto takes the fused fc1 with more than 64 rows per expert on a 9.0 device: in
    // forward-only plans, and in training plans whose fc1 wgrad reads the permuted rows (it
    // writes them; not under the A/B switch CAPMOE_FUSED_FC1_ROWS=backward); never at decode
    // sizes, nor on 10.0 (the sm_100a kernel has not run). A forced Fused plan takes it on
    // either for tensor weights and F % 128 == 0.
    let arch = DeviceInfo::of_stream(&stream).unwrap().arch;
    let backward_permute = backward_permute_forced();
    let inference = MoeOptions { forward_only: true, ..MoeOptions::default() };
    // T_MAX * K / E = 40 rows per expert: decode-sized; 300 tokens: 75 rows per expert.
    let prefill = MoeConfig { max_tokens: 300, ..config(None) };
    let auto = MoeExperts::<bf16>::new(prefill.clone(), &stream).unwrap();
    let training_fused = arch == Arch::Sm90 && !backward_permute;
    assert_eq!(auto.fc1_is_fused(), training_fused, "Auto's training fc1 on {arch:?}");
    assert_eq!(auto.fc1_writes_rows(), training_fused, "Auto's training fc1 writes the rows");
    let gathered = MoeOptions { fc1_wgrad: FusedKernel::Fused, ..MoeOptions::default() };
    let auto = MoeExperts::<bf16>::with_options(prefill.clone(), gathered, &stream).unwrap();
    assert!(!auto.fc1_is_fused(), "Auto keeps the unfused fc1 in training with the gathered fc1 wgrad");
    let decode_training = MoeExperts::<bf16>::new(config(None), &stream).unwrap();
    assert!(!decode_training.fc1_is_fused(), "Auto keeps the unfused fc1 at decode sizes in training too");
    let auto = MoeExperts::<bf16>::with_options(prefill.clone(), inference, &stream).unwrap();
    assert_eq!(auto.fc1_is_fused(), arch == Arch::Sm90, "Auto's forward-only fc1 on {arch:?}");
    let decode = config(None);
    let auto = MoeExperts::<bf16>::with_options(decode, inference, &stream).unwrap();
    assert!(!auto.fc1_is_fused(), "Auto keeps the unfused fc1 at <= 64 rows per expert");
    // The boundary reads capacity / E rounded down, as the grouped GEMM's AUTO does: 516 rows
    // over 8 experts (64.5) are decode-sized, 520 (65) are not.
    for (tokens, fused) in [(258, false), (260, arch == Arch::Sm90)] {
        let at_edge = MoeConfig { max_tokens: tokens, ..config(None) };
        let auto = MoeExperts::<bf16>::with_options(at_edge, inference, &stream).unwrap();
        assert_eq!(auto.fc1_is_fused(), fused, "Auto's forward-only fc1 at {} rows", tokens * K);
    }
    // A shape the kernel does not take (F not a multiple of 128): Auto falls back, no error.
    let odd_ffn = MoeConfig { ffn: 120, ..prefill.clone() };
    assert!(!MoeExperts::<bf16>::with_options(odd_ffn, inference, &stream).unwrap().fc1_is_fused());
    let ptrs = MoeOptions { weights: WeightForm::Pointers, ..inference };
    assert!(!MoeExperts::<bf16>::with_options(prefill, ptrs, &stream).unwrap().fc1_is_fused());
    let fused = MoeOptions { fc1: FusedKernel::Fused, ..MoeOptions::default() };
    let forced = MoeExperts::<bf16>::with_options(config(None), fused, &stream).unwrap();
    assert!(forced.fc1_is_fused());
    // In training it writes the rows fc1's wgrad reads (sm_90a only; unless the A/B switch
    // keeps the backward's permute); a forward-only plan or a gathered wgrad needs none.
    assert_eq!(forced.fc1_writes_rows(), arch == Arch::Sm90 && !backward_permute, "forced fused fc1, training");
    let fwd_only = MoeOptions { forward_only: true, ..fused };
    assert!(!MoeExperts::<bf16>::with_options(config(None), fwd_only, &stream).unwrap().fc1_writes_rows());
    let gathered = MoeOptions { fc1_wgrad: FusedKernel::Fused, ..fused };
    assert!(!MoeExperts::<bf16>::with_options(config(None), gathered, &stream).unwrap().fc1_writes_rows());
    // Pointer weights: Auto falls back, a forced Fused is an error.
    let ptrs = MoeOptions { weights: WeightForm::Pointers, ..MoeOptions::default() };
    assert!(!MoeExperts::<bf16>::with_options(config(None), ptrs, &stream).unwrap().fc1_is_fused());
    let forced = MoeOptions { fc1: FusedKernel::Fused, ..ptrs };
    assert!(matches!(MoeExperts::<bf16>::with_options(config(None), forced, &stream), Err(Error::Unsupported { .. })));
    // F = 96: not a multiple of the fused tile.
    let odd = MoeConfig { ffn: 96, ..config(None) };
    assert!(!MoeExperts::<bf16>::new(odd.clone(), &stream).unwrap().fc1_is_fused());
    let forced = MoeOptions { fc1: FusedKernel::Fused, ..MoeOptions::default() };
    assert!(matches!(MoeExperts::<bf16>::with_options(odd, forced, &stream), Err(Error::Unsupported { .. })));
}

/// The f16 kernels: forward and backward of a fused f16 plan equal the unfused f16 plan bit
/// for bit (y poisoned first: rows past T stay the poison in both).
#[test]
fn fused_moe_f16_equals_unfused() {
    let opts = MoeOptions { fc1: FusedKernel::Fused, ..MoeOptions::default() };
    f16_matches_unfused(opts, Match::Bits, Match::Bits, &[Arch::Sm90, Arch::Sm100], 7);
}

// ---- the fused fc2 dgrad + SwiGLU backward ----

fn plan_with(
    stream: &Arc<CudaStream>,
    capacity: Option<usize>,
    fc1: FusedKernel,
    dgrad: FusedKernel,
) -> MoeExperts<bf16> {
    let opts = MoeOptions { fc1, swiglu_dgrad: dgrad, ..MoeOptions::default() };
    let moe = MoeExperts::<bf16>::with_options(config(capacity), opts, stream).unwrap();
    assert_eq!(moe.fc1_is_fused(), fc1 == FusedKernel::Fused, "fc1 {fc1:?}");
    assert_eq!(moe.swiglu_dgrad_is_fused(), dgrad == FusedKernel::Fused, "swiglu_dgrad {dgrad:?}");
    moe
}

/// Counts the differing bits of two outputs and prints it (the bitwise claim is reported).
fn report_bits(what: &str, got: &[u32], want: &[u32]) {
    let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
    println!("{what}: bitwise vs unfused: {n} of {} elements differ", got.len());
}

/// The backward outputs of one step as f64, rows < T of dx and dprobs (the rest must hold the
/// poison, checked here) and all of dw1, dw2 (written in full, checked here).
fn backward_outputs(what: &str, stream: &Arc<CudaStream>, io: &Io, t: usize) -> [Vec<f64>; 4] {
    let dx = stream.clone_dtoh(&io.dx).unwrap();
    let dprobs = stream.clone_dtoh(&io.dprobs).unwrap();
    let dw1 = stream.clone_dtoh(&io.dw1).unwrap();
    let dw2 = stream.clone_dtoh(&io.dw2).unwrap();
    assert_written_bf16(&format!("{what}: dx"), &dx, t * H);
    assert_written_f32(&format!("{what}: dprobs"), &dprobs, t * K);
    assert_written_bf16(&format!("{what}: dw1"), &dw1, dw1.len());
    assert_written_bf16(&format!("{what}: dw2"), &dw2, dw2.len());
    [f64s(&dx[..t * H]), dprobs[..t * K].iter().map(|&v| v as f64).collect(), f64s(&dw1), f64s(&dw2)]
}

/// `plan` against an unfused plan of the same capacity over 12 steps of fresh routing (seeded
/// by `seed`): y written on its T rows (the poison past them), bit for bit or within tolerance
/// of the unfused y as `y` says; dx, dprobs, dW1 and dW2 written and within tolerance of the
/// unfused backward, their bitwise agreement reported; without a capacity, y, dx, dprobs, dW1
/// and dW2 against the fp64 reference.
fn assert_matches_unfused_and_fp64(
    stream: &Arc<CudaStream>,
    label: &str,
    plan: &mut MoeExperts<bf16>,
    capacity: Option<usize>,
    y: Match,
    (w1, w2): (&[bf16], &[bf16]),
    seed: u64,
) {
    let mut unfused = plan_with(stream, capacity, FusedKernel::Unfused, FusedKernel::Unfused);
    let (mut pio, mut uio) = (layer_io(stream, w1, w2), layer_io(stream, w1, w2));
    let mut rng = StdRng::seed_from_u64(seed);
    for i in 0..common::steps_under_sanitizer(12, 4) {
        let s = step(&mut rng, i);
        let what = format!("{label}, step {i} (T={})", s.t);
        pio.load(stream, &s);
        uio.load(stream, &s);
        pio.step(plan, stream).unwrap();
        uio.step(&mut unfused, stream).unwrap();
        let (py, uy) = (stream.clone_dtoh(&pio.y).unwrap(), stream.clone_dtoh(&uio.y).unwrap());
        assert_written_bf16(&format!("{what}: y"), &py, s.t * H);
        match y {
            Match::Bits => {
                let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
                assert_bits(&format!("{what}: y vs the unfused plan"), &bits(&py), &bits(&uy));
            }
            Match::Close => {
                let (py, uy) = (f64s(&py[..s.t * H]), f64s(&uy[..s.t * H]));
                assert_close(&format!("{what}: y vs the unfused plan"), &py, &uy, 1e-2);
            }
        }
        let got = backward_outputs(&format!("{what}: {label}"), stream, &pio, s.t);
        let want = backward_outputs(&format!("{what}: unfused"), stream, &uio, s.t);
        for (j, name) in ["dx", "dprobs", "dw1", "dw2"].into_iter().enumerate() {
            assert_close(&format!("{what}: {name} vs the unfused plan"), &got[j], &want[j], 1e-2);
        }
        report_bits(&what, &pio.bits(stream), &uio.bits(stream));
        if capacity.is_none() {
            let r = reference_of(&s, w1, w2);
            assert_close(&format!("{what}: y vs fp64"), &f64s(&py[..s.t * H]), &r.y[..s.t * H], 2e-2);
            let fp64 = [&r.dx[..s.t * H], &r.dprobs[..s.t * K], &r.dw1, &r.dw2];
            for (j, name) in ["dx", "dprobs", "dw1", "dw2"].into_iter().enumerate() {
                assert_close(&format!("{what}: {name} vs fp64"), &got[j], fp64[j], 2e-2);
            }
        }
    }
}

#[test]
fn fused_moe_swiglu_dgrad_matches_unfused_and_the_fp64_reference() {
    let stream = gpu_of_arch_or_skip!("the fused fc1 and fc2 dgrad", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(11);
    for (fc1, capacity) in [
        (FusedKernel::Unfused, None),
        (FusedKernel::Unfused, Some(150)),
        (FusedKernel::Fused, None),
        (FusedKernel::Fused, Some(150)),
    ] {
        // The forward does not change: y bit for bit.
        let mut fused = plan_with(&stream, capacity, fc1, FusedKernel::Fused);
        let label = format!("fc1 {fc1:?}, capacity {capacity:?}");
        assert_matches_unfused_and_fp64(&stream, &label, &mut fused, capacity, Match::Bits, (&w1, &w2), 12);
    }
}

/// Captures one forward + backward of a plan with `opts`, replays it 200 times with fresh
/// routing, x, dy and T, and asserts every replay bit-equal to an eager run of an identical plan
/// (dx written on its T rows, the poison past them).
fn assert_replays_equal_eager(stream: &Arc<CudaStream>, opts: MoeOptions, seed: u64) {
    let _lock = common::capture_lock();
    let (w1, w2) = weights(seed);
    let mut graph_moe = MoeExperts::<bf16>::with_options(config(None), opts, stream).unwrap();
    let mut eager_moe = MoeExperts::<bf16>::with_options(config(None), opts, stream).unwrap();
    let (mut gio, mut eio) = (layer_io(stream, &w1, &w2), layer_io(stream, &w1, &w2));
    let mut rng = StdRng::seed_from_u64(seed + 1);
    gio.load(stream, &step(&mut rng, 4));
    stream.synchronize().unwrap();
    let graph = capture(stream, || gio.step(&mut graph_moe, stream)).unwrap();
    let replays = common::steps_under_sanitizer(200, 10);
    for i in 0..replays {
        let s = step(&mut rng, i);
        gio.load(stream, &s);
        eio.load(stream, &s);
        graph.launch().unwrap();
        eio.step(&mut eager_moe, stream).unwrap();
        assert_bits(&format!("{opts:?}: replay {i} (T={})", s.t), &gio.bits(stream), &eio.bits(stream));
        let dx = stream.clone_dtoh(&gio.dx).unwrap();
        assert_written_bf16(&format!("{opts:?}: replay {i}: dx"), &dx, s.t * H);
    }
}

/// The fused fc1 and fc2 dgrad + SwiGLU backward, captured once and replayed.
#[test]
fn fused_moe_swiglu_dgrad_graph_replays_equal_eager() {
    let stream = gpu_of_arch_or_skip!("the fused fc1 and fc2 dgrad", Arch::Sm90, Arch::Sm100);
    let opts = MoeOptions { fc1: FusedKernel::Fused, swiglu_dgrad: FusedKernel::Fused, ..MoeOptions::default() };
    assert_replays_equal_eager(&stream, opts, 13);
}

#[test]
fn fused_moe_swiglu_dgrad_plan_choices() {
    let stream = gpu_of_arch_or_skip!("the fused fc1 and fc2 dgrad", Arch::Sm90, Arch::Sm100);
    // Auto keeps the unfused fc2 dgrad + SwiGLU backward (the fused one measured slower).
    let auto = MoeExperts::<bf16>::new(config(None), &stream).unwrap();
    assert!(!auto.swiglu_dgrad_is_fused(), "Auto must keep the unfused backward");
    // Pointer weights: a forced Fused is an error; forward-only plans plan no backward.
    let forced =
        MoeOptions { weights: WeightForm::Pointers, swiglu_dgrad: FusedKernel::Fused, ..MoeOptions::default() };
    assert!(matches!(MoeExperts::<bf16>::with_options(config(None), forced, &stream), Err(Error::Unsupported { .. })));
    let fwd_only = MoeOptions { swiglu_dgrad: FusedKernel::Fused, forward_only: true, ..MoeOptions::default() };
    assert!(!MoeExperts::<bf16>::with_options(config(None), fwd_only, &stream).unwrap().swiglu_dgrad_is_fused());
    // F = 96: not a multiple of the fused tile.
    let odd = MoeConfig { ffn: 96, ..config(None) };
    let forced = MoeOptions { swiglu_dgrad: FusedKernel::Fused, ..MoeOptions::default() };
    assert!(matches!(MoeExperts::<bf16>::with_options(odd, forced, &stream), Err(Error::Unsupported { .. })));
}

/// The f16 kernel inside the expert path: a plan with the fused backward against the unfused
/// f16 plan, within tolerance (y bit for bit; rows past T keep their poison).
#[test]
fn fused_moe_swiglu_dgrad_f16_matches_unfused() {
    let opts = MoeOptions { swiglu_dgrad: FusedKernel::Fused, ..MoeOptions::default() };
    f16_matches_unfused(opts, Match::Bits, Match::Close, &[Arch::Sm90, Arch::Sm100], 15);
}

/// How an output of a fused plan compares with the unfused plan's.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Match {
    /// Bit for bit, every element.
    Bits,
    /// Normwise within tolerance on the written elements (the fused kernels' sum order or
    /// rounding differs).
    Close,
}

/// A plan with `opts` against the unfused plan in f16, forward and backward over 6 steps: y
/// and the backward outputs (dx, dprobs, dW1, dW2) bit for bit or within tolerance as `y` and
/// `backward` say. Every output starts poisoned; in both plans y, dx and dprobs written and
/// finite on their T rows, the poison past them, dW1 and dW2 written and finite everywhere.
fn f16_matches_unfused(opts: MoeOptions, y: Match, backward: Match, archs: &[Arch], seed: u64) {
    use half::f16;
    let stream = gpu_or_skip!();
    if !common::device_is(&stream, archs, "the plan's fused kernels") {
        return;
    }
    let cfg = MoeConfig { dtype: DType::F16, ..config(None) };
    let mut fused = MoeExperts::<f16>::with_options(cfg.clone(), opts, &stream).unwrap();
    assert!(opts.fc1 != FusedKernel::Fused || fused.fc1_is_fused(), "{opts:?}: fc1");
    assert!(opts.swiglu_dgrad != FusedKernel::Fused || fused.swiglu_dgrad_is_fused(), "{opts:?}: swiglu_dgrad");
    let unfused_opts = MoeOptions {
        fc1: FusedKernel::Unfused,
        swiglu_dgrad: FusedKernel::Unfused,
        gemm_config: opts.gemm_config,
        ..MoeOptions::default()
    };
    let mut unfused = MoeExperts::<f16>::with_options(cfg, unfused_opts, &stream).unwrap();
    assert!(!unfused.swiglu_dgrad_is_fused() && !unfused.fc1_is_fused());
    let mut rng = StdRng::seed_from_u64(seed);
    let h16 = |n: usize, s: f32, rng: &mut StdRng| -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(rng.random_range(-s..s))).collect()
    };
    let w1_h = h16(E * 2 * F * H, 1.0 / (H as f32).sqrt(), &mut rng);
    let w2_h = h16(E * H * F, 1.0 / (F as f32).sqrt(), &mut rng);
    let (w1, w2) = (stream.clone_htod(&w1_h).unwrap(), stream.clone_htod(&w2_h).unwrap());
    let to_f64 = |v: &[f16]| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
    let bits = |v: &[f16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    for i in 0..6 {
        let s = step(&mut rng, i);
        let (x_h, dy_h) = (h16(T_MAX * H, 1.0, &mut rng), h16(T_MAX * H, 1.0, &mut rng));
        let (x, dy) = (stream.clone_htod(&x_h).unwrap(), stream.clone_htod(&dy_h).unwrap());
        let ids = stream.clone_htod(&s.ids).unwrap();
        let probs = stream.clone_htod(&s.probs).unwrap();
        let tokens = Tokens::Host(s.t);
        let what = format!("f16 {opts:?} step {i} (T={})", s.t);
        let mut outs = Vec::new();
        for (plan, moe) in [("fused", &mut fused), ("unfused", &mut unfused)] {
            let mut y = stream.clone_htod(&poison_f16(T_MAX * H)).unwrap();
            let mut dx = stream.clone_htod(&poison_f16(T_MAX * H)).unwrap();
            let mut dprobs = stream.clone_htod(&poison_f32(T_MAX * K)).unwrap();
            let mut dw1 = stream.clone_htod(&poison_f16(E * 2 * F * H)).unwrap();
            let mut dw2 = stream.clone_htod(&poison_f16(E * H * F)).unwrap();
            moe.forward(&stream, &x, &ids, &probs, tokens, &w1, &w2, &mut y).unwrap();
            moe.backward(&stream, &x, &dy, &probs, tokens, &w1, &w2, &mut dx, &mut dprobs, &mut dw1, &mut dw2).unwrap();
            let (y, dx) = (stream.clone_dtoh(&y).unwrap(), stream.clone_dtoh(&dx).unwrap());
            let (dw1, dw2) = (stream.clone_dtoh(&dw1).unwrap(), stream.clone_dtoh(&dw2).unwrap());
            let dprobs = stream.clone_dtoh(&dprobs).unwrap();
            assert_written_f16(&format!("{what}: {plan} y"), &y, s.t * H);
            assert_written_f16(&format!("{what}: {plan} dx"), &dx, s.t * H);
            assert_written_f32(&format!("{what}: {plan} dprobs"), &dprobs, s.t * K);
            assert_written_f16(&format!("{what}: {plan} dw1"), &dw1, dw1.len());
            assert_written_f16(&format!("{what}: {plan} dw2"), &dw2, dw2.len());
            outs.push((y, dx, dprobs, dw1, dw2));
        }
        let ((fy, fdx, fdp, fdw1, fdw2), (uy, udx, udp, udw1, udw2)) = (&outs[0], &outs[1]);
        let n = s.t * H;
        // The unfused f16 plan against fp64 with f16 roundings: the comparisons below share
        // everything but the fused kernels, so a fault of the f16 plan itself shows only here.
        let r = reference_f16(DIMS, s.t, &ids_in_range(&s), &s.probs, &x_h, &dy_h, &w1_h, &w2_h);
        let udp64: Vec<f64> = udp[..s.t * K].iter().map(|&v| v as f64).collect();
        for (name, got, want) in [
            ("y", to_f64(&uy[..n]), &r.y[..n]),
            ("dx", to_f64(&udx[..n]), &r.dx[..n]),
            ("dprobs", udp64, &r.dprobs[..s.t * K]),
            ("dw1", to_f64(udw1), &r.dw1[..]),
            ("dw2", to_f64(udw2), &r.dw2[..]),
        ] {
            assert_close(&format!("{what}: unfused {name} vs fp64"), &got, want, 2e-2);
        }
        match y {
            Match::Bits => assert_bits(&format!("{what}: y"), &bits(fy), &bits(uy)),
            Match::Close => {
                assert_close(&format!("{what}: y vs the unfused forward"), &to_f64(&fy[..n]), &to_f64(&uy[..n]), 1e-2)
            }
        }
        match backward {
            Match::Bits => {
                for (name, f, u) in [("dx", fdx, udx), ("dw1", fdw1, udw1), ("dw2", fdw2, udw2)] {
                    assert_bits(&format!("{what}: {name}"), &bits(f), &bits(u));
                }
                let fbits = |v: &[f32]| v.iter().map(|b| b.to_bits()).collect::<Vec<u32>>();
                assert_bits(&format!("{what}: dprobs"), &fbits(fdp), &fbits(udp));
            }
            Match::Close => {
                let dprobs = |v: &[f32]| v[..s.t * K].iter().map(|&v| v as f64).collect::<Vec<f64>>();
                for (name, f, u) in [
                    ("dx", to_f64(&fdx[..n]), to_f64(&udx[..n])),
                    ("dprobs", dprobs(fdp), dprobs(udp)),
                    ("dw1", to_f64(fdw1), to_f64(udw1)),
                    ("dw2", to_f64(fdw2), to_f64(udw2)),
                ] {
                    assert_close(&format!("{what}: {name} vs the unfused backward"), &f, &u, 1e-2);
                }
            }
        }
    }
}

// ---- fc1's wgrad gathered from x ----

fn plan_gathered(stream: &Arc<CudaStream>, capacity: Option<usize>, fc1: FusedKernel) -> MoeExperts<bf16> {
    let opts = MoeOptions { fc1, fc1_wgrad: FusedKernel::Fused, ..MoeOptions::default() };
    let moe = MoeExperts::<bf16>::with_options(config(capacity), opts, stream).unwrap();
    assert!(moe.fc1_wgrad_is_gathered());
    assert_eq!(moe.fc1_is_fused(), fc1 == FusedKernel::Fused, "fc1 {fc1:?}");
    moe
}

/// Only dW1 comes from another kernel: y, dx, dprobs and dW2 must keep the unfused plan's bits
/// (with the fused fc1 too, which then writes no permuted copy of x at all); dW1 is compared
/// with the unfused plan's and with the fp64 reference.
#[test]
fn fused_moe_gathered_fc1_wgrad_matches_unfused_and_the_fp64_reference() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(15);
    for (fc1, capacity) in [(FusedKernel::Unfused, None), (FusedKernel::Fused, None), (FusedKernel::Fused, Some(150))] {
        let mut gathered = plan_gathered(&stream, capacity, fc1);
        let mut unfused = plan_with(&stream, capacity, FusedKernel::Unfused, FusedKernel::Unfused);
        let (mut gio, mut uio) = (layer_io(&stream, &w1, &w2), layer_io(&stream, &w1, &w2));
        let mut rng = StdRng::seed_from_u64(16);
        for i in 0..common::steps_under_sanitizer(12, 4) {
            let s = step(&mut rng, i);
            let what = format!("fc1 {fc1:?}, capacity {capacity:?}, step {i} (T={})", s.t);
            gio.load(&stream, &s);
            uio.load(&stream, &s);
            gio.step(&mut gathered, &stream).unwrap();
            uio.step(&mut unfused, &stream).unwrap();
            assert_bits(&format!("{what}: y"), &bits16(&stream, &gio.y), &bits16(&stream, &uio.y));
            assert_bits(&format!("{what}: dx"), &bits16(&stream, &gio.dx), &bits16(&stream, &uio.dx));
            assert_bits(&format!("{what}: dprobs"), &bits32(&stream, &gio.dprobs), &bits32(&stream, &uio.dprobs));
            assert_bits(&format!("{what}: dw2"), &bits16(&stream, &gio.dw2), &bits16(&stream, &uio.dw2));
            let got = backward_outputs(&format!("{what}: gathered"), &stream, &gio, s.t);
            let want = backward_outputs(&format!("{what}: unfused"), &stream, &uio, s.t);
            assert_close(&format!("{what}: dw1 vs the unfused backward"), &got[2], &want[2], 1e-2);
            let dw1_bits = (bits16(&stream, &gio.dw1), bits16(&stream, &uio.dw1));
            let differ = dw1_bits.0.iter().zip(&dw1_bits.1).filter(|(a, b)| a != b).count();
            println!(
                "{what}: dw1 bitwise vs the grouped GEMM's WGRAD: {differ} of {} elements differ",
                dw1_bits.0.len()
            );
            if capacity.is_none() {
                let r = reference_of(&s, &w1, &w2);
                assert_close(&format!("{what}: dw1 vs fp64"), &got[2], &r.dw1, 2e-2);
            }
        }
    }
}

/// Every fused kernel: fc1, fc2 dgrad + SwiGLU backward, gathered fc1 wgrad.
fn every_fused_kernel() -> MoeOptions {
    MoeOptions {
        fc1: FusedKernel::Fused,
        swiglu_dgrad: FusedKernel::Fused,
        fc1_wgrad: FusedKernel::Fused,
        ..MoeOptions::default()
    }
}

/// Every fused kernel at once (fc1, fc2 dgrad + SwiGLU backward, gathered fc1 wgrad), captured
/// once and replayed.
#[test]
fn fused_moe_every_fused_kernel_graph_replays_equal_eager() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    assert_replays_equal_eager(&stream, every_fused_kernel(), 17);
}

#[test]
fn fused_moe_gathered_fc1_wgrad_plan_choices() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    // Auto keeps the grouped GEMM's WGRAD (the gathered one measured slower).
    assert!(!MoeExperts::<bf16>::new(config(None), &stream).unwrap().fc1_wgrad_is_gathered());
    // Pointer weights (dW1 a pointer table): a forced gather is an error before anything runs.
    let forced = MoeOptions { weights: WeightForm::Pointers, fc1_wgrad: FusedKernel::Fused, ..MoeOptions::default() };
    assert!(matches!(MoeExperts::<bf16>::with_options(config(None), forced, &stream), Err(Error::Unsupported { .. })));
    // A forward-only plan has no backward to plan.
    let fwd_only = MoeOptions { fc1_wgrad: FusedKernel::Fused, forward_only: true, ..MoeOptions::default() };
    assert!(!MoeExperts::<bf16>::with_options(config(None), fwd_only, &stream).unwrap().fc1_wgrad_is_gathered());
    // A short x is refused before any launch, by the gathered plan as by the plain one (the
    // check is common to every plan, ahead of any fused code: a regression guard, which does
    // not tell the gathered wgrad apart).
    let (w1, w2) = weights(19);
    let mut io = layer_io(&stream, &w1, &w2);
    let short_x: CudaSlice<bf16> = stream.alloc_zeros(T_MAX * H - 1).unwrap();
    for (gathered, mut moe) in [
        (true, plan_gathered(&stream, None, FusedKernel::Fused)),
        (false, plan(&stream, None, FusedKernel::Fused, false)),
    ] {
        assert_eq!(moe.fc1_wgrad_is_gathered(), gathered);
        let r = moe.backward(
            &stream,
            &short_x,
            &io.dy,
            &io.probs,
            Tokens::Host(4),
            &io.w1,
            &io.w2,
            &mut io.dx,
            &mut io.dprobs,
            &mut io.dw1,
            &mut io.dw2,
        );
        assert!(matches!(r, Err(Error::Shape { .. })), "gathered wgrad {gathered}: short x: {r:?}");
    }
}

// ---- the route probability in fc1's epilogue (the fc2 side without drows) ----

/// Every fused kernel with the probability applied in fc1's epilogue; fc1's wgrad gathered
/// or not.
fn plan_prob_in_fc1(stream: &Arc<CudaStream>, capacity: Option<usize>, fc1_wgrad: FusedKernel) -> MoeExperts<bf16> {
    let opts = MoeOptions { fc1_wgrad, prob_in_fc1: FusedKernel::Fused, ..every_fused_kernel() };
    let moe = MoeExperts::<bf16>::with_options(config(capacity), opts, stream).unwrap();
    assert!(moe.prob_is_in_fc1());
    moe
}

/// The probability moves from the combine into fc1's epilogue, which changes the rounding of
/// every output: y, dx, dprobs, dW1 and dW2 within tolerance of the unfused plan and of the
/// fp64 reference (every written element; the poisoned rest of y, dx and dprobs untouched).
#[test]
fn fused_moe_prob_in_fc1_matches_unfused_and_the_fp64_reference() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(21);
    for (fc1_wgrad, capacity) in
        [(FusedKernel::Unfused, None), (FusedKernel::Fused, None), (FusedKernel::Fused, Some(150))]
    {
        let mut weighted = plan_prob_in_fc1(&stream, capacity, fc1_wgrad);
        let label = format!("fc1_wgrad {fc1_wgrad:?}, capacity {capacity:?}");
        assert_matches_unfused_and_fp64(&stream, &label, &mut weighted, capacity, Match::Close, (&w1, &w2), 22);
    }
}

/// A forward-only plan with the probability in fc1 gives the training plan's y bit for bit.
#[test]
fn fused_moe_prob_in_fc1_forward_only_equals_training_forward() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad (the training plan)", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(23);
    let opts = MoeOptions {
        fc1: FusedKernel::Fused,
        prob_in_fc1: FusedKernel::Fused,
        forward_only: true,
        ..MoeOptions::default()
    };
    let mut fwd = MoeExperts::<bf16>::with_options(config(None), opts, &stream).unwrap();
    assert!(fwd.prob_is_in_fc1());
    let mut train = plan_prob_in_fc1(&stream, None, FusedKernel::Fused);
    let (mut fio, mut tio) = (layer_io(&stream, &w1, &w2), layer_io(&stream, &w1, &w2));
    let mut rng = StdRng::seed_from_u64(24);
    for i in 0..6 {
        let s = step(&mut rng, i);
        fio.load(&stream, &s);
        tio.load(&stream, &s);
        fio.forward(&mut fwd, &stream).unwrap();
        tio.forward(&mut train, &stream).unwrap();
        assert_bits(
            &format!("step {i} (T={}): y forward-only vs training", s.t),
            &bits16(&stream, &fio.y),
            &bits16(&stream, &tio.y),
        );
    }
}

/// Every fused kernel with the probability in fc1, captured once and replayed.
#[test]
fn fused_moe_prob_in_fc1_graph_replays_equal_eager() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let opts = MoeOptions { prob_in_fc1: FusedKernel::Fused, ..every_fused_kernel() };
    assert_replays_equal_eager(&stream, opts, 25);
}

/// The probability in fc1 on f16 plans, against the unfused plan.
#[test]
fn fused_moe_prob_in_fc1_f16_matches_unfused() {
    let opts = MoeOptions { prob_in_fc1: FusedKernel::Fused, ..every_fused_kernel() };
    f16_matches_unfused(opts, Match::Close, Match::Close, &[Arch::Sm90, Arch::Sm100], 27);
}

#[test]
fn fused_moe_prob_in_fc1_plan_choices() {
    let stream = gpu_of_arch_or_skip!("the fused fc1 and fc2 dgrad", Arch::Sm90, Arch::Sm100);
    // Auto applies the probability in the combine.
    assert!(!MoeExperts::<bf16>::new(config(None), &stream).unwrap().prob_is_in_fc1());
    let base = MoeOptions { prob_in_fc1: FusedKernel::Fused, ..MoeOptions::default() };
    // Without the fused fc1 (its epilogue applies it), or in training without the fused fc2
    // dgrad (it gathers dy), a forced Fused is an error before anything runs.
    let no_fc1 = MoeOptions { fc1: FusedKernel::Unfused, swiglu_dgrad: FusedKernel::Fused, ..base };
    let r = MoeExperts::<bf16>::with_options(config(None), no_fc1, &stream);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "no fused fc1: {:?}", r.err());
    let no_dgrad = MoeOptions { fc1: FusedKernel::Fused, ..base };
    let r = MoeExperts::<bf16>::with_options(config(None), no_dgrad, &stream);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "no fused fc2 dgrad: {:?}", r.err());
    // fc1 left at Auto: accepted where Auto's training fc1 is fused (a 9.0 device above 64 rows
    // per expert, not under CAPMOE_FUSED_FC1_ROWS=backward), and then it writes the rows fc1's
    // unfused wgrad reads; the same error as an unfused fc1 elsewhere (decode sizes, 10.0).
    let auto_fc1 = MoeOptions { swiglu_dgrad: FusedKernel::Fused, ..base };
    let prefill = MoeConfig { max_tokens: 300, ..config(None) };
    let backward_permute = backward_permute_forced();
    let arch = DeviceInfo::of_stream(&stream).unwrap().arch;
    match MoeExperts::<bf16>::with_options(prefill, auto_fc1, &stream) {
        Ok(moe) if arch == Arch::Sm90 && !backward_permute => {
            assert!(moe.prob_is_in_fc1() && moe.fc1_writes_rows(), "fc1 Auto, probability in fc1");
        }
        r => assert!(matches!(r, Err(Error::InvalidArgument { .. })), "fc1 Auto on {arch:?}: {:?}", r.err()),
    }
    let r = MoeExperts::<bf16>::with_options(config(None), auto_fc1, &stream);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "fc1 Auto at decode sizes: {:?}", r.err());
    // A forward-only plan has no backward: the fused fc1 is enough.
    let fwd_only = MoeOptions { fc1: FusedKernel::Fused, forward_only: true, ..base };
    assert!(MoeExperts::<bf16>::with_options(config(None), fwd_only, &stream).unwrap().prob_is_in_fc1());
    // Pointer weights have no fused kernel at all: Unsupported, named as such, before the
    // missing fc1 / fc2 dgrad choices are looked at.
    let pointers = MoeOptions { weights: WeightForm::Pointers, ..base };
    let r = MoeExperts::<bf16>::with_options(config(None), pointers, &stream);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "pointer weights: {:?}", r.err());
}

/// The probability in fc1 with the options the tests above leave at their defaults: fp32 weight
/// gradients added into (`wgrad_accumulate`: fc2's gathered wgrad then accumulates), bf16
/// probabilities (so `route_dprobs` writes bf16) and a host token count. Against an unfused plan
/// of the same config: y, dx, dprobs and the weight gradients' increments within tolerance, and
/// dprobs past T left alone.
#[test]
fn fused_moe_prob_in_fc1_accumulates_with_bf16_probs_and_host_tokens() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let (w1, w2) = weights(31);
    let cfg = MoeConfig { wgrad_accumulate: true, prob_dtype: DType::Bf16, ..config(None) };
    let fused_opts = MoeOptions { prob_in_fc1: FusedKernel::Fused, ..every_fused_kernel() };
    let unfused_opts = MoeOptions {
        fc1: FusedKernel::Unfused,
        swiglu_dgrad: FusedKernel::Unfused,
        fc1_wgrad: FusedKernel::Unfused,
        prob_in_fc1: FusedKernel::Unfused,
        ..MoeOptions::default()
    };
    let mut plans = [
        MoeExperts::<bf16>::with_options(cfg.clone(), fused_opts, &stream).unwrap(),
        MoeExperts::<bf16>::with_options(cfg, unfused_opts, &stream).unwrap(),
    ];
    assert!(plans[0].prob_is_in_fc1() && !plans[1].prob_is_in_fc1());
    let mut io = layer_io(&stream, &w1, &w2);
    let mut rng = StdRng::seed_from_u64(32);
    let init1: Vec<f32> = (0..E * 2 * F * H).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    let init2: Vec<f32> = (0..E * H * F).map(|_| rng.random_range(-0.5f32..0.5)).collect();
    for i in 0..6 {
        let s = step(&mut rng, i);
        let what = format!("step {i} (T={})", s.t);
        io.load(&stream, &s);
        let probs = stream.clone_htod(&bf(&s.probs)).unwrap();
        let tokens = Tokens::Host(s.t);
        // [y, dx, dprobs] as f64, and dW1, dW2 minus their initial values, of each plan.
        let mut outputs: Vec<[Vec<f64>; 5]> = Vec::new();
        for plan in plans.iter_mut() {
            let mut y = stream.clone_htod(&poison_bf16(T_MAX * H)).unwrap();
            let mut dx = stream.clone_htod(&poison_bf16(T_MAX * H)).unwrap();
            let mut dprobs = stream.clone_htod(&poison_bf16(T_MAX * K)).unwrap();
            let mut dw1 = stream.clone_htod(&init1).unwrap();
            let mut dw2 = stream.clone_htod(&init2).unwrap();
            plan.forward(&stream, &io.x, &io.ids, &probs, tokens, &io.w1, &io.w2, &mut y).unwrap();
            plan.backward(
                &stream,
                &io.x,
                &io.dy,
                &probs,
                tokens,
                &io.w1,
                &io.w2,
                &mut dx,
                &mut dprobs,
                &mut dw1,
                &mut dw2,
            )
            .unwrap();
            let (y, dx, dprobs) =
                (stream.clone_dtoh(&y).unwrap(), stream.clone_dtoh(&dx).unwrap(), stream.clone_dtoh(&dprobs).unwrap());
            assert_written_bf16(&format!("{what}: y"), &y, s.t * H);
            assert_written_bf16(&format!("{what}: dx"), &dx, s.t * H);
            assert_written_bf16(&format!("{what}: dprobs"), &dprobs, s.t * K);
            let increment = |after: Vec<f32>, before: &[f32]| -> Vec<f64> {
                after.iter().zip(before).map(|(&a, &b)| a as f64 - b as f64).collect()
            };
            outputs.push([
                f64s(&y[..s.t * H]),
                f64s(&dx[..s.t * H]),
                f64s(&dprobs[..s.t * K]),
                increment(stream.clone_dtoh(&dw1).unwrap(), &init1),
                increment(stream.clone_dtoh(&dw2).unwrap(), &init2),
            ]);
        }
        for (j, name) in ["y", "dx", "dprobs", "dW1 increment", "dW2 increment"].into_iter().enumerate() {
            assert_close(&format!("{what}: {name} vs the unfused plan"), &outputs[0][j], &outputs[1][j], 2e-2);
        }
    }
}
