//! The expert-parallel layer with real NCCL on one GPU (R = 1): forward and backward against
//! the fp64 reference of the expert path, dropping past a full peer block, Echo switched on,
//! and one captured graph (forward + backward) replayed with fresh routing, bit-equal to
//! eager. R > 1 runs on the multi-GPU kinds (issue 18) with the same code: the ranks as threads
//! of one process, and (`scripts/ep-ranks.sh`) as one process per GPU.

mod common;

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard};

use capturable_moe::dtype::DType;
use capturable_moe::echo::Algorithm;
use capturable_moe::ep::{flags, nccl_group, EpEcho, EpGroup, EpMoe, EpMoeConfig};
use capturable_moe::graph::{capture, capture_with, CaptureMode, CaptureOptions, FlagReport, FlagSource};
use capturable_moe::routing::Tokens;
use common::moe::{assert_bits, assert_close, bf, f64s, poison_bf16, poison_f32, reference, Dims};
use common::routing::topk_ids;
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const D: Dims = Dims { e: 8, h: 128, f: 64, k: 2 };
const T_MAX: usize = 64;

/// The tests of this binary run one at a time (also under a plain `cargo test`): the graph
/// tests capture in global mode, which forbids allocations and syncs on other threads while
/// a capture is open.
fn serial() -> MutexGuard<'static, ()> {
    common::CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank thread captures at a time in the multi-GPU graph test (the test's own lock: the
/// test thread holds [`serial`]'s).
static RANK_CAPTURE: Mutex<()> = Mutex::new(());

/// Graph replays per test (`CAPMOE_EP_REPLAYS`, default 1000; 5 under a sanitizer).
fn replays() -> usize {
    if common::under_sanitizer() {
        5
    } else {
        std::env::var("CAPMOE_EP_REPLAYS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
    }
}

/// One rank's group on the test stream, or `None` (printing why) where NCCL cannot load.
fn group_or_skip(stream: &Arc<CudaStream>) -> Option<Rc<EpGroup>> {
    if !common::nccl::nccl_present() {
        return None;
    }
    let mut groups = EpGroup::single_process(std::slice::from_ref(stream)).expect("a one-rank NCCL group");
    Some(Rc::new(groups.remove(0)))
}

fn config(capacity: usize, echo: bool) -> EpMoeConfig {
    EpMoeConfig {
        num_experts: D.e,
        hidden: D.h,
        ffn: D.f,
        topk: D.k,
        max_tokens: T_MAX,
        capacity,
        echo: echo.then_some(EpEcho { spare_per_rank: 1, algorithm: Algorithm::Greedy, threshold_multiplier: 0.0 }),
        dtype: DType::Bf16,
    }
}

/// Inputs of one step, on the host.
struct Step {
    x: Vec<bf16>,
    dy: Vec<bf16>,
    ids: Vec<i32>,
    probs: Vec<f32>,
}

/// Random inputs; `empty_routes` puts a few -1 ids (no route) among the real ones, which plain
/// EP skips silently and Echo flags (`CAPMOE_ECHO_ERR_EXPERT_OUT_OF_RANGE`): Echo's top-k form
/// expects k real routes per token, as Megatron's router gives.
fn random_step(rng: &mut StdRng, empty_routes: bool) -> Step {
    let small = |rng: &mut StdRng, n: usize| bf(&(0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>());
    let mut ids = topk_ids(rng, T_MAX, D.e, D.k);
    for id in ids.iter_mut() {
        if empty_routes && rng.random_range(0..16) == 0 {
            *id = -1;
        }
    }
    Step {
        x: small(rng, T_MAX * D.h),
        dy: small(rng, T_MAX * D.h),
        probs: (0..T_MAX * D.k).map(|_| rng.random_range(0.05f32..1.0)).collect(),
        ids,
    }
}

/// The caller's buffers of one layer: inputs, weights, outputs, main grads.
struct Buffers {
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
    dw1: CudaSlice<f32>,
    dw2: CudaSlice<f32>,
}

struct Weights {
    w1: Vec<bf16>,
    w2: Vec<bf16>,
}

fn random_weights(rng: &mut StdRng) -> Weights {
    let mut w = |n: usize, scale: f32| bf(&(0..n).map(|_| rng.random_range(-scale..scale)).collect::<Vec<_>>());
    Weights { w1: w(D.e * 2 * D.f * D.h, 0.1), w2: w(D.e * D.h * D.f, 0.1) }
}

impl Buffers {
    fn new(stream: &Arc<CudaStream>, w: &Weights) -> Buffers {
        Buffers {
            x: stream.alloc_zeros(T_MAX * D.h).unwrap(),
            dy: stream.alloc_zeros(T_MAX * D.h).unwrap(),
            ids: stream.alloc_zeros(T_MAX * D.k).unwrap(),
            probs: stream.alloc_zeros(T_MAX * D.k).unwrap(),
            w1: stream.clone_htod(&w.w1).unwrap(),
            w2: stream.clone_htod(&w.w2).unwrap(),
            y: stream.alloc_zeros(T_MAX * D.h).unwrap(),
            dx: stream.alloc_zeros(T_MAX * D.h).unwrap(),
            dprobs: stream.alloc_zeros(T_MAX * D.k).unwrap(),
            dw1: stream.alloc_zeros(D.e * 2 * D.f * D.h).unwrap(),
            dw2: stream.alloc_zeros(D.e * D.h * D.f).unwrap(),
        }
    }

    fn load(&mut self, stream: &Arc<CudaStream>, s: &Step) {
        stream.memcpy_htod(&s.x, &mut self.x).unwrap();
        stream.memcpy_htod(&s.dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&s.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&s.probs, &mut self.probs).unwrap();
    }

    /// NaN in every output and main grad before a run (the step zeroes the grads itself), so
    /// that no element a run failed to write can match a reference or another run's bits.
    fn poison_outputs(&mut self, stream: &Arc<CudaStream>) {
        stream.memcpy_htod(&poison_bf16(self.y.len()), &mut self.y).unwrap();
        stream.memcpy_htod(&poison_bf16(self.dx.len()), &mut self.dx).unwrap();
        stream.memcpy_htod(&poison_f32(self.dprobs.len()), &mut self.dprobs).unwrap();
        stream.memcpy_htod(&poison_f32(self.dw1.len()), &mut self.dw1).unwrap();
        stream.memcpy_htod(&poison_f32(self.dw2.len()), &mut self.dw2).unwrap();
    }
}

/// Forward then backward of one step, main grads zeroed first (what the graph holds too).
fn step(layer: &mut EpMoe<bf16>, b: &mut Buffers, tokens: Tokens<'_>) -> capturable_moe::Result<()> {
    let stream = layer.group().stream().clone();
    stream.memset_zeros(&mut b.dw1)?;
    stream.memset_zeros(&mut b.dw2)?;
    layer.forward(&b.x, &b.ids, &b.probs, tokens, &b.w1, &b.w2, &mut b.y)?;
    layer.backward(&b.dy, tokens, &b.w1, &b.w2, &mut b.dx, &mut b.dprobs, &mut b.dw1, &mut b.dw2)
}

/// Every output of a step, as bits.
#[derive(PartialEq, Debug)]
struct Outputs {
    y: Vec<u16>,
    dx: Vec<u16>,
    dprobs: Vec<u32>,
    dw1: Vec<u32>,
    dw2: Vec<u32>,
}

fn outputs(stream: &Arc<CudaStream>, b: &Buffers) -> Outputs {
    let bits16 = |v: Vec<bf16>| v.into_iter().map(|x| x.to_bits()).collect();
    let bits32 = |v: Vec<f32>| v.into_iter().map(|x| x.to_bits()).collect();
    Outputs {
        y: bits16(stream.clone_dtoh(&b.y).unwrap()),
        dx: bits16(stream.clone_dtoh(&b.dx).unwrap()),
        dprobs: bits32(stream.clone_dtoh(&b.dprobs).unwrap()),
        dw1: bits32(stream.clone_dtoh(&b.dw1).unwrap()),
        dw2: bits32(stream.clone_dtoh(&b.dw2).unwrap()),
    }
}

/// What a run leaves in the layer besides the outputs: the EP flag word of this run alone
/// (cleared before it), the dispatch layout with its drop counts, and every flag word of the
/// layer (sticky: the receive side's and Echo's words are not the test's to clear).
#[derive(PartialEq, Debug)]
struct RunState {
    ep_word: i32,
    slot_of_route: Vec<i32>,
    send_counts: Vec<i32>,
    dropped: Vec<i32>,
    report: FlagReport,
}

fn run_state(stream: &Arc<CudaStream>, layer: &EpMoe<bf16>) -> RunState {
    let layout = layer.dispatch_layout();
    RunState {
        ep_word: stream.clone_dtoh(&layer.flags).unwrap()[0],
        slot_of_route: stream.clone_dtoh(&layout.slot_of_route).unwrap(),
        send_counts: stream.clone_dtoh(&layout.send_counts).unwrap(),
        dropped: layer.read_dropped().unwrap(),
        report: layer.read_flags().unwrap(),
    }
}

/// One run, graph or eager, on the inputs already loaded: the EP flag word cleared and every
/// output poisoned first; its outputs and state after.
fn run(
    stream: &Arc<CudaStream>,
    layer: &mut EpMoe<bf16>,
    b: &mut Buffers,
    body: impl FnOnce(&mut EpMoe<bf16>, &mut Buffers) -> capturable_moe::Result<()>,
) -> (Outputs, RunState) {
    stream.memset_zeros(&mut layer.flags).unwrap();
    b.poison_outputs(stream);
    body(layer, b).unwrap();
    (outputs(stream, b), run_state(stream, layer))
}

/// Every output and the state of a replay bit-equal to the eager step's, naming the first
/// output that differs.
fn assert_replay_is_eager(what: &str, replayed: &(Outputs, RunState), eager: &(Outputs, RunState)) {
    let ((r, r_state), (e, e_state)) = (replayed, eager);
    if r != e {
        assert_bits(&format!("{what}: y"), &r.y, &e.y);
        assert_bits(&format!("{what}: dx"), &r.dx, &e.dx);
        assert_bits(&format!("{what}: dprobs"), &r.dprobs, &e.dprobs);
        assert_bits(&format!("{what}: dw1"), &r.dw1, &e.dw1);
        assert_bits(&format!("{what}: dw2"), &r.dw2, &e.dw2);
    }
    assert_eq!(r_state, e_state, "{what}: flag words, layout and drops of the replay vs eager");
}

/// One step of a replay check on `s` with `t` tokens: the graph runs first, while the layer's
/// internal buffers (layout, received rows, Echo state) still hold the previous step's data,
/// then the eager step on the same inputs; every output is poisoned before each run. A graph
/// that lost nodes, or did nothing, leaves stale or poisoned bits that the eager run does not.
#[allow(clippy::too_many_arguments)]
fn replay_then_eager(
    stream: &Arc<CudaStream>,
    layer: &mut EpMoe<bf16>,
    b: &mut Buffers,
    graph: &CudaGraph,
    t_dev: &mut CudaSlice<i32>,
    s: &Step,
    t: usize,
) -> ((Outputs, RunState), (Outputs, RunState)) {
    stream.memcpy_htod(&[t as i32], t_dev).unwrap();
    b.load(stream, s);
    let replayed = run(stream, layer, b, |_, _| Ok(graph.launch()?));
    let t_dev = &*t_dev;
    let eager = run(stream, layer, b, |layer, b| step(layer, b, Tokens::Device(t_dev)));
    (replayed, eager)
}

/// The routes the layer keeps with one block of `capacity` rows: the first `capacity` real
/// routes in (t, j) order; the rest become -1. Returns the kept ids and the drop count.
fn kept_routes(ids: &[i32], t: usize, capacity: usize) -> (Vec<i32>, i32) {
    let mut kept = vec![-1; ids.len()];
    let (mut used, mut dropped) = (0, 0);
    for (r, &id) in ids.iter().enumerate().take(t * D.k) {
        if id < 0 {
            continue;
        }
        if used < capacity {
            kept[r] = id;
            used += 1;
        } else {
            dropped += 1;
        }
    }
    (kept, dropped)
}

/// One run's outputs (poisoned before it) against the fp64 reference of the kept routes.
fn check_against_reference(what: &str, got: &Outputs, w: &Weights, s: &Step, t: usize, capacity: usize) {
    let (kept, _) = kept_routes(&s.ids, t, capacity);
    let want = reference(D, t, &kept, &s.probs, &s.x, &s.dy, &w.w1, &w.w2);
    let from16 = |v: &[u16]| v.iter().map(|&x| f64::from(bf16::from_bits(x))).collect::<Vec<_>>();
    let from32 = |v: &[u32]| v.iter().map(|&x| f64::from(f32::from_bits(x))).collect::<Vec<_>>();
    let (y, dx) = (from16(&got.y), from16(&got.dx));
    let (dprobs, dw1, dw2) = (from32(&got.dprobs), from32(&got.dw1), from32(&got.dw2));
    let rows = t * D.h;
    let assert_close =
        |name: &str, got: &[f64], want: &[f64], tol| assert_close(&format!("{what}: {name}"), got, want, tol);
    assert_close("y", &y[..rows], &want.y[..rows], 2e-2);
    assert_close("dx", &dx[..rows], &want.dx[..rows], 2e-2);
    assert_close("dprobs", &dprobs[..t * D.k], &want.dprobs[..t * D.k], 2e-2);
    for (r, &id) in kept.iter().enumerate().take(t * D.k) {
        if id < 0 {
            assert_eq!(dprobs[r], 0.0, "{what}: dprobs of dropped / empty route {r}");
        }
    }
    assert_close("dw1", &dw1, &want.dw1, 2e-2);
    assert_close("dw2", &dw2, &want.dw2, 2e-2);
}

fn run_against_reference(echo: bool, capacity: usize, t: usize) {
    let _serial = serial();
    let stream = gpu_or_skip!();
    let Some(group) = group_or_skip(&stream) else { return };
    let mut rng = StdRng::seed_from_u64(17 + capacity as u64 + echo as u64);
    let w = random_weights(&mut rng);
    let mut b = Buffers::new(&stream, &w);
    let mut layer = EpMoe::<bf16>::new(group, config(capacity, echo)).unwrap();
    layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
    let s = random_step(&mut rng, !echo);
    b.load(&stream, &s);
    b.poison_outputs(&stream);
    step(&mut layer, &mut b, Tokens::Host(t)).unwrap();
    check_against_reference("eager", &outputs(&stream, &b), &w, &s, t, capacity);
    let (_, dropped) = kept_routes(&s.ids, t, capacity);
    assert_eq!(layer.read_dropped().unwrap(), vec![dropped], "dropped routes");
    let flag_word = stream.clone_dtoh(&layer.flags).unwrap()[0];
    assert_eq!(flag_word & flags::OVERFLOW != 0, dropped > 0, "OVERFLOW flag (word {flag_word:#x})");
    let report = layer.read_flags().unwrap();
    assert_eq!(report.has(FlagSource::Ep, "CAPMOE_EP_OVERFLOW"), dropped > 0, "{report}");
    assert_eq!(report.flags().len(), usize::from(dropped > 0), "no other flag: {report}");
}

#[test]
fn r1_matches_the_reference_with_ample_capacity() {
    run_against_reference(false, T_MAX * D.k, 50);
}

#[test]
fn r1_with_echo_matches_the_reference() {
    // One rank never offloads to itself: Echo must leave every route at its home column.
    run_against_reference(true, T_MAX * D.k, T_MAX);
}

#[test]
fn r1_drops_routes_past_a_full_block() {
    run_against_reference(false, 40, T_MAX);
}

#[test]
fn one_graph_replays_with_fresh_routing_bit_equal_to_eager() {
    let _serial = serial();
    let stream = gpu_or_skip!();
    let Some(group) = group_or_skip(&stream) else { return };
    let mut rng = StdRng::seed_from_u64(99);
    let w = random_weights(&mut rng);
    let mut b = Buffers::new(&stream, &w);
    let mut layer = EpMoe::<bf16>::new(group, config(96, true)).unwrap();
    layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
    let t_dev: CudaSlice<i32> = stream.clone_htod(&[T_MAX as i32]).unwrap();
    b.load(&stream, &random_step(&mut rng, false));
    // NCCL connects peers on a collective's first use, which cannot happen inside a capture.
    step(&mut layer, &mut b, Tokens::Device(&t_dev)).unwrap();
    let graph = capture(&stream, || step(&mut layer, &mut b, Tokens::Device(&t_dev))).unwrap();
    let mut t_dev = t_dev;
    for i in 0..replays() {
        let s = random_step(&mut rng, false);
        // T = T_MAX first: the reference check sees the fullest step.
        let t = if i == 0 { T_MAX } else { rng.random_range(0..=T_MAX) };
        let (replayed, eager) = replay_then_eager(&stream, &mut layer, &mut b, &graph, &mut t_dev, &s, t);
        if i == 0 {
            check_against_reference("replay 0", &replayed.0, &w, &s, t, 96);
        }
        let (_, dropped) = kept_routes(&s.ids, t, 96);
        assert_eq!(replayed.1.dropped, vec![dropped], "replay {i}: dropped routes");
        assert_eq!(replayed.1.ep_word, if dropped > 0 { flags::OVERFLOW } else { 0 }, "replay {i}: EP flag word");
        assert_replay_is_eager(&format!("replay {i}"), &replayed, &eager);
    }
}

/// A graph captured before a second `bind_weights` runs on the second weights and grads (the
/// pointer tables are rewritten in place, not reallocated): each replay against the fp64
/// reference with the second weights and bit-equal to the eager step on them. Plain EP: with
/// Echo the spare-weight pack and fold keep the buffers of the capture (bind_weights' doc).
#[test]
fn rebinding_weights_moves_a_captured_graph_to_the_new_weights() {
    let _serial = serial();
    let stream = gpu_or_skip!();
    let Some(group) = group_or_skip(&stream) else { return };
    let capacity = T_MAX * D.k;
    let mut rng = StdRng::seed_from_u64(404);
    let first = random_weights(&mut rng);
    let mut b = Buffers::new(&stream, &first);
    let mut layer = EpMoe::<bf16>::new(group, config(capacity, false)).unwrap();
    layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
    let mut t_dev: CudaSlice<i32> = stream.clone_htod(&[T_MAX as i32]).unwrap();
    b.load(&stream, &random_step(&mut rng, true));
    step(&mut layer, &mut b, Tokens::Device(&t_dev)).unwrap();
    let graph = capture(&stream, || step(&mut layer, &mut b, Tokens::Device(&t_dev))).unwrap();
    let s = random_step(&mut rng, true);
    let (replayed, eager) = replay_then_eager(&stream, &mut layer, &mut b, &graph, &mut t_dev, &s, T_MAX);
    check_against_reference("first weights, replay", &replayed.0, &first, &s, T_MAX, capacity);
    assert_replay_is_eager("first weights", &replayed, &eager);

    // The second weights in buffers of their own; the first stay alive (the graph's memsets
    // of the first grads, captured by `step`, still run on every replay).
    let second = random_weights(&mut rng);
    let mut w1 = stream.clone_htod(&second.w1).unwrap();
    let mut w2 = stream.clone_htod(&second.w2).unwrap();
    let mut dw1: CudaSlice<f32> = stream.alloc_zeros(b.dw1.len()).unwrap();
    let mut dw2: CudaSlice<f32> = stream.alloc_zeros(b.dw2.len()).unwrap();
    layer.bind_weights(&w1, &w2, &dw1, &dw2).unwrap();
    let err = layer.forward(&b.x, &b.ids, &b.probs, Tokens::Host(1), &b.w1, &b.w2, &mut b.y).unwrap_err();
    assert!(err.to_string().contains("not the buffer bound"), "the first weights are no longer bound: {err}");
    for i in 0..3 {
        let s = random_step(&mut rng, true);
        stream.memcpy_htod(&[T_MAX as i32], &mut t_dev).unwrap();
        b.load(&stream, &s);
        // The graph zeroes the first grads, not these: the GEMMs accumulate into them.
        let replayed = run(&stream, &mut layer, &mut b, |_, _| {
            stream.memset_zeros(&mut dw1)?;
            stream.memset_zeros(&mut dw2)?;
            Ok(graph.launch()?)
        });
        let mut got = replayed.0;
        assert!(
            got.dw1.iter().chain(&got.dw2).all(|&x| x == 0),
            "second weights, replay {i}: the first grads got a gradient"
        );
        got.dw1 = stream.clone_dtoh(&dw1).unwrap().into_iter().map(f32::to_bits).collect();
        got.dw2 = stream.clone_dtoh(&dw2).unwrap().into_iter().map(f32::to_bits).collect();
        check_against_reference(&format!("second weights, replay {i}"), &got, &second, &s, T_MAX, capacity);
        // Eager on the second buffers: swapped into `b` for the step, swapped back after.
        std::mem::swap(&mut b.w1, &mut w1);
        std::mem::swap(&mut b.w2, &mut w2);
        std::mem::swap(&mut b.dw1, &mut dw1);
        std::mem::swap(&mut b.dw2, &mut dw2);
        let eager = run(&stream, &mut layer, &mut b, |layer, b| step(layer, b, Tokens::Device(&t_dev)));
        std::mem::swap(&mut b.w1, &mut w1);
        std::mem::swap(&mut b.w2, &mut w2);
        std::mem::swap(&mut b.dw1, &mut dw1);
        std::mem::swap(&mut b.dw2, &mut dw2);
        assert_replay_is_eager(&format!("second weights, replay {i}"), &(got, replayed.1), &eager);
    }
}

#[test]
fn bad_configurations_are_typed_errors() {
    let _serial = serial();
    let stream = gpu_or_skip!();
    let Some(group) = group_or_skip(&stream) else { return };
    let mut c = config(0, false);
    assert!(EpMoe::<bf16>::new(group.clone(), c.clone()).is_err(), "capacity 0");
    c.capacity = 8;
    c.dtype = DType::F16;
    assert!(EpMoe::<bf16>::new(group.clone(), c.clone()).is_err(), "dtype differs from the element type");
    c.dtype = DType::Bf16;
    c.num_experts = 7;
    let _ = EpMoe::<bf16>::new(group.clone(), c).map(|_| ()); // E % R: R = 1 accepts any E
    let mut layer = EpMoe::<bf16>::new(group, config(8, false)).unwrap();
    let w = random_weights(&mut StdRng::seed_from_u64(1));
    let mut b = Buffers::new(&stream, &w);
    let err = layer.forward(&b.x, &b.ids, &b.probs, Tokens::Host(1), &b.w1, &b.w2, &mut b.y).unwrap_err();
    assert!(err.to_string().contains("bind_weights"), "{err}");
    layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
    let other: CudaSlice<bf16> = stream.alloc_zeros(b.w1.len()).unwrap();
    let err = layer.forward(&b.x, &b.ids, &b.probs, Tokens::Host(1), &other, &b.w2, &mut b.y).unwrap_err();
    assert!(err.to_string().contains("not the buffer bound"), "{err}");
    // Inside nccl_group the collectives would only be recorded while the kernels between them
    // run at once: every stage with a collective refuses before enqueueing anything.
    let inside = |what: &str, r: capturable_moe::Result<()>| {
        let err = r.unwrap_err();
        assert!(err.to_string().contains("nccl_group"), "{what} inside nccl_group: {err}");
    };
    inside("forward", nccl_group(|| layer.forward(&b.x, &b.ids, &b.probs, Tokens::Host(1), &b.w1, &b.w2, &mut b.y)));
    inside("combine", nccl_group(|| layer.combine(Tokens::Host(1), &mut b.y)));
    inside(
        "backward",
        nccl_group(|| {
            layer.backward(&b.dy, Tokens::Host(1), &b.w1, &b.w2, &mut b.dx, &mut b.dprobs, &mut b.dw1, &mut b.dw2)
        }),
    );
    // And the same layer runs a step outside it.
    step(&mut layer, &mut b, Tokens::Host(1)).unwrap();
}

/// One group over every visible GPU (a stream each), or `None` after printing why: no GPU,
/// fewer than two, or no libnccl.
fn groups_over_every_gpu() -> Option<Vec<EpGroup>> {
    common::gpu_stream()?;
    let gpus = common::gpus_at_least(2, "the multi-rank case")?;
    let streams: Vec<Arc<CudaStream>> =
        (0..gpus).map(|g| capturable_moe::device::open(g).unwrap().new_stream().unwrap()).collect();
    if !common::nccl::nccl_present() {
        return None;
    }
    Some(EpGroup::single_process(&streams).expect("an NCCL group over every GPU"))
}

/// A rank thread's first failure (a panic payload), kept while the thread goes on.
///
/// NOTE: a rank thread that panicked between two NCCL calls would leave its peers waiting in
/// the next collective forever (a hang instead of the failure): every rank runs every step,
/// notes its first failure, and reports it after its last collective.
#[derive(Default)]
struct FirstFailure(Option<Box<dyn Any + Send>>);

impl FirstFailure {
    /// `body`'s value, or `None` after noting its panic.
    fn attempt<T>(&mut self, body: impl FnOnce() -> T) -> Option<T> {
        match catch_unwind(AssertUnwindSafe(body)) {
            Ok(value) => Some(value),
            Err(panic) => {
                self.0.get_or_insert(panic);
                None
            }
        }
    }

    fn report(self) {
        if let Some(panic) = self.0 {
            resume_unwind(panic);
        }
    }
}

/// Where the rank threads agree before their collectives: a rank whose setup failed still
/// reaches the barrier, and then every rank stops (none enqueues a collective its peers never
/// match).
struct RankGate {
    barrier: Barrier,
    failed: AtomicBool,
}

impl RankGate {
    fn new(ranks: usize) -> RankGate {
        RankGate { barrier: Barrier::new(ranks), failed: AtomicBool::new(false) }
    }

    /// `true` when every rank got here without a failure (this rank's: `ok`).
    fn all_ok(&self, ok: bool) -> bool {
        if !ok {
            self.failed.store(true, Ordering::SeqCst);
        }
        self.barrier.wait();
        !self.failed.load(Ordering::SeqCst)
    }
}

/// One rank's y, dx, dprobs, dw1, dw2 as f64.
type RankOutputs = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// The multi-rank reference case: 4 experts per rank, global weights, and every rank's step
/// with skewed routing (half the routes of every rank go to the first two experts, so Echo
/// offloads rank 0's experts). Drawn from a fixed seed, so every process of a group makes the
/// same case.
struct RankCase {
    d: Dims,
    ranks: usize,
    global_w1: Vec<bf16>,
    global_w2: Vec<bf16>,
    steps: Vec<Step>,
}

impl RankCase {
    fn new(ranks: usize) -> RankCase {
        let d = Dims { e: 4 * ranks, ..D };
        let mut rng = StdRng::seed_from_u64(2024);
        let global_w1: Vec<bf16> =
            bf(&(0..d.e * 2 * d.f * d.h).map(|_| rng.random_range(-0.1f32..0.1)).collect::<Vec<_>>());
        let global_w2: Vec<bf16> =
            bf(&(0..d.e * d.h * d.f).map(|_| rng.random_range(-0.1f32..0.1)).collect::<Vec<_>>());
        let steps = (0..ranks)
            .map(|_| {
                let mut s = random_step(&mut rng, false);
                s.ids = (0..T_MAX)
                    .flat_map(|t| {
                        let hot = (t % 2) as i32;
                        let other = 2 + rng.random_range(0..(d.e - 2) as i32);
                        [hot, other]
                    })
                    .collect();
                s
            })
            .collect();
        RankCase { d, ranks, global_w1, global_w2, steps }
    }

    fn local_experts(&self) -> usize {
        self.d.e / self.ranks
    }

    /// Elements of one expert's W1 and W2.
    fn expert_len(&self) -> (usize, usize) {
        (2 * self.d.f * self.d.h, self.d.h * self.d.f)
    }

    /// Rank r's layer over its home experts, its step loaded and its outputs poisoned.
    fn setup(&self, group: EpGroup) -> (EpMoe<bf16>, Buffers) {
        let (r, local, (p1, p2)) = (group.rank(), self.local_experts(), self.expert_len());
        let stream = group.stream().clone();
        let mut cfg = config(T_MAX * D.k, true);
        cfg.num_experts = self.d.e;
        let mut layer = EpMoe::<bf16>::new(Rc::new(group), cfg).unwrap();
        let w = Weights {
            w1: self.global_w1[r * local * p1..(r + 1) * local * p1].to_vec(),
            w2: self.global_w2[r * local * p2..(r + 1) * local * p2].to_vec(),
        };
        let mut b = Buffers::new(&stream, &w);
        // Buffers::new sized the grads for D.e experts; this layer has `local`.
        b.dw1 = stream.alloc_zeros(local * p1).unwrap();
        b.dw2 = stream.alloc_zeros(local * p2).unwrap();
        layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
        b.load(&stream, &self.steps[r]);
        b.poison_outputs(&stream);
        (layer, b)
    }

    /// One eager step of rank r (its collectives), then its flag words and outputs.
    fn step_and_read(layer: &mut EpMoe<bf16>, b: &mut Buffers, r: usize) -> RankOutputs {
        let stream = layer.group().stream().clone();
        step(layer, b, Tokens::Host(T_MAX)).unwrap_or_else(|e| panic!("rank {r}: step: {e}"));
        let report = layer.read_flags().unwrap();
        assert!(report.is_clean(), "rank {r}: {report}");
        let to64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
        (
            f64s(&stream.clone_dtoh(&b.y).unwrap()),
            f64s(&stream.clone_dtoh(&b.dx).unwrap()),
            to64(stream.clone_dtoh(&b.dprobs).unwrap()),
            to64(stream.clone_dtoh(&b.dw1).unwrap()),
            to64(stream.clone_dtoh(&b.dw2).unwrap()),
        )
    }

    /// Rank r's outputs against the fp64 reference: y, dx, dprobs of its own tokens, and the
    /// main grads of its home experts summed over every rank's tokens (spare-slot grads folded
    /// in).
    fn check(&self, r: usize, got: &RankOutputs) {
        let (local, (p1, p2)) = (self.local_experts(), self.expert_len());
        let (mut dw1, mut dw2) = (vec![0.0; self.d.e * p1], vec![0.0; self.d.e * p2]);
        for (q, s) in self.steps.iter().enumerate() {
            let want = reference(self.d, T_MAX, &s.ids, &s.probs, &s.x, &s.dy, &self.global_w1, &self.global_w2);
            if q == r {
                assert_close(&format!("rank {r}: y"), &got.0, &want.y, 2e-2);
                assert_close(&format!("rank {r}: dx"), &got.1, &want.dx, 2e-2);
                assert_close(&format!("rank {r}: dprobs"), &got.2, &want.dprobs, 2e-2);
            }
            dw1.iter_mut().zip(&want.dw1).for_each(|(a, b)| *a += b);
            dw2.iter_mut().zip(&want.dw2).for_each(|(a, b)| *a += b);
        }
        let what = format!("rank {r}: dw1 (home experts, spare-slot grads folded in)");
        assert_close(&what, &got.3, &dw1[r * local * p1..(r + 1) * local * p1], 2e-2);
        assert_close(&format!("rank {r}: dw2"), &got.4, &dw2[r * local * p2..(r + 1) * local * p2], 2e-2);
    }
}

/// R > 1 in one process, one thread and one GPU per rank (`EpGroup::single_process`): every
/// rank's y, dx, dprobs and main grads against the fp64 reference over the whole group's
/// experts, with Echo moving tokens between ranks. Skips with fewer than two GPUs (the lent
/// H100 has one; the multi-GPU kinds run it, issue 18).
#[test]
fn every_rank_matches_the_reference_across_gpus() {
    let _serial = serial();
    let Some(groups) = groups_over_every_gpu() else { return };
    let case = RankCase::new(groups.len());
    let gate = RankGate::new(case.ranks);
    let results: Vec<RankOutputs> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, group)| {
                let (case, gate) = (&case, &gate);
                scope.spawn(move || {
                    let mut failure = FirstFailure::default();
                    let setup = failure.attempt(|| case.setup(group));
                    if !gate.all_ok(setup.is_some()) {
                        failure.report();
                        panic!("rank {r}: another rank's setup failed");
                    }
                    let (mut layer, mut b) = setup.expect("checked by the gate");
                    // The step's collectives; the checks come after the last of them.
                    RankCase::step_and_read(&mut layer, &mut b, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, got) in results.iter().enumerate() {
        case.check(r, got);
    }
}

/// The same case with one process per GPU, the product's deployment form: each process is one
/// rank of a group joined through the id file (`EpGroup::from_env`: `CAPMOE_EP_RANK`,
/// `CAPMOE_EP_SIZE`, `CAPMOE_EP_ID_FILE`), launched by `scripts/ep-ranks.sh` (also under
/// compute-sanitizer, one tool process per rank). Checks this rank's outputs. Skips when the
/// variables are not set, as in the plain suite.
#[test]
fn this_process_rank_matches_the_reference_gpu() {
    let _serial = serial();
    if std::env::var_os(capturable_moe::ep::EpEnv::RANK).is_none() {
        println!("skipping: not launched as one rank of a group ({} unset)", capturable_moe::ep::EpEnv::RANK);
        return;
    }
    let Some(stream) = common::gpu_stream() else { return };
    if !common::nccl::nccl_present() {
        return;
    }
    let group = EpGroup::from_env(&stream).expect("a group from CAPMOE_EP_RANK / _SIZE / _ID_FILE");
    let (r, case) = (group.rank(), RankCase::new(group.ranks()));
    let (mut layer, mut b) = case.setup(group);
    let got = RankCase::step_and_read(&mut layer, &mut b, r);
    case.check(r, &got);
}

/// Issue 18's capture check on every rank: R = every visible GPU, a thread per rank, each
/// rank's forward + backward captured once (one rank at a time: NCCL only records during a
/// capture, so the ranks need not capture together) and replayed with fresh routing and T
/// every step (`CAPMOE_EP_REPLAYS`, default 1000): every replay runs while the layer holds
/// the previous step's data, with poisoned outputs, and is bit-equal (outputs, flag words,
/// layout, drops) to the eager step on the same inputs that follows it. Skips with fewer than
/// two GPUs.
#[test]
fn every_rank_replays_its_graph_bit_equal_to_eager_across_gpus() {
    let _serial = serial();
    let Some(groups) = groups_over_every_gpu() else { return };
    let ranks = groups.len();
    let d = Dims { e: 4 * ranks, ..D };
    let local = d.e / ranks;
    let replays = replays();
    let gate = RankGate::new(ranks);
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, group)| {
                let gate = &gate;
                scope.spawn(move || {
                    let stream = group.stream().clone();
                    // Same seed on every rank for the step sequence's T, its own for the data.
                    let mut shared = StdRng::seed_from_u64(7);
                    let mut rng = StdRng::seed_from_u64(100 + r as u64);
                    let fresh = |rng: &mut StdRng| {
                        let mut s = random_step(rng, false);
                        s.ids = topk_ids(rng, T_MAX, d.e, D.k);
                        s
                    };
                    let mut failure = FirstFailure::default();
                    let setup = failure.attempt(|| {
                        let mut cfg = config(48, true);
                        cfg.num_experts = d.e;
                        let layer = EpMoe::<bf16>::new(Rc::new(group), cfg).unwrap();
                        let mut w = random_weights(&mut rng);
                        w.w1.truncate(local * 2 * d.f * d.h);
                        w.w2.truncate(local * d.h * d.f);
                        let mut b = Buffers::new(&stream, &w);
                        b.dw1 = stream.alloc_zeros(w.w1.len()).unwrap();
                        b.dw2 = stream.alloc_zeros(w.w2.len()).unwrap();
                        let t_dev: CudaSlice<i32> = stream.clone_htod(&[T_MAX as i32]).unwrap();
                        (layer, b, t_dev)
                    });
                    if !gate.all_ok(setup.is_some()) {
                        failure.report();
                        panic!("rank {r}: another rank's setup failed");
                    }
                    let (mut layer, mut b, mut t_dev) = setup.expect("checked by the gate");
                    let warmed_up = failure.attempt(|| {
                        layer.bind_weights(&b.w1, &b.w2, &b.dw1, &b.dw2).unwrap();
                        b.load(&stream, &fresh(&mut rng));
                        // The warm-up step connects the peers (collectives, all ranks).
                        step(&mut layer, &mut b, Tokens::Device(&t_dev)).unwrap();
                    });
                    // NOTE: a thread per GPU captures in thread-local mode (NCCL's rule for
                    // that layout); besides, no rank captures while another still makes host
                    // calls of its setup or warm-up, and the ranks capture one at a time and
                    // wait for each other before the first replay.
                    if !gate.all_ok(warmed_up.is_some()) {
                        failure.report();
                        panic!("rank {r}: another rank's warm-up failed");
                    }
                    let captured = failure.attempt(|| {
                        let _one_at_a_time = RANK_CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
                        let thread_local = CaptureOptions { mode: CaptureMode::ThreadLocal, ..Default::default() };
                        capture_with(&stream, thread_local, || step(&mut layer, &mut b, Tokens::Device(&t_dev)))
                            .unwrap()
                    });
                    if !gate.all_ok(captured.is_some()) {
                        failure.report();
                        panic!("rank {r}: another rank's capture failed");
                    }
                    let graph = captured.expect("checked by the gate");
                    for i in 0..replays {
                        let s = fresh(&mut rng);
                        let t = shared.random_range(0..=T_MAX);
                        // Three attempts, so that a failure in one still lets the next run
                        // its collectives (the replay, then the eager step, as
                        // replay_then_eager orders them).
                        failure.attempt(|| {
                            stream.memcpy_htod(&[t as i32], &mut t_dev).unwrap();
                            b.load(&stream, &s);
                        });
                        let replayed = failure.attempt(|| run(&stream, &mut layer, &mut b, |_, _| Ok(graph.launch()?)));
                        let eager = failure.attempt(|| {
                            run(&stream, &mut layer, &mut b, |layer, b| step(layer, b, Tokens::Device(&t_dev)))
                        });
                        if let (Some(replayed), Some(eager)) = (replayed, eager) {
                            let what = format!("rank {r}, replay {i}");
                            failure.attempt(|| {
                                assert_replay_is_eager(&what, &replayed, &eager);
                                let report = replayed.1.report;
                                assert!(!report.has(FlagSource::Ep, "CAPMOE_EP_BAD_DEST"), "{what}: {report}");
                            });
                        }
                    }
                    drop(graph);
                    failure.report();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}
