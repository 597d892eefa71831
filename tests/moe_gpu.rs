//! The whole expert path (routing + grouped GEMMs), forward and backward, against an fp64 CPU
//! reference; eager against CUDA-graph replay, bit for bit, over 1000 replays with fresh
//! routing each time.

mod common;

use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::GemmConfig;
use capturable_moe::moe::{MoeConfig, MoeExperts, MoeOptions, WeightForm};
use capturable_moe::routing::{self, flags, Tokens};
use capturable_moe::Error;
use common::expert_io::{layer_config, ExpertIo as Io, Step};
use common::moe::{
    assert_bits, assert_close, assert_written_bf16, assert_written_f32, bf, f64s, poison_bf16, poison_f32, reference,
    Dims, Reference,
};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

const E: usize = 8;
const H: usize = 64;
const F: usize = 32;
const K: usize = 2;
const T_MAX: usize = 48;
const DIMS: Dims = Dims { e: E, h: H, f: F, k: K };

fn config() -> MoeConfig {
    layer_config(DIMS, T_MAX)
}

/// Routing patterns the replays cycle through.
fn step(rng: &mut StdRng, i: usize) -> Step {
    let t = match i % 10 {
        0 => 0,
        1 => T_MAX,
        _ => rng.random_range(1..=T_MAX),
    };
    let mut ids = vec![-1i32; T_MAX * K];
    let mut probs = vec![0f32; T_MAX * K];
    for tok in 0..t {
        for j in 0..K {
            ids[tok * K + j] = match i % 10 {
                2 => 5,                             // every token on one expert (twice)
                3 => [1, 6][j],                     // only two experts busy
                4 => rng.random_range(0..E as i32), // duplicates possible
                _ => {
                    let first = rng.random_range(0..E as i32);
                    if j == 0 {
                        first
                    } else {
                        (first + rng.random_range(1..E as i32)) % E as i32
                    }
                }
            };
            probs[tok * K + j] = rng.random_range(0.05f32..1.0);
        }
    }
    let x = bf(&(0..T_MAX * H).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>());
    let dy = bf(&(0..T_MAX * H).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>());
    Step { t, ids, probs, x, dy }
}

struct Weights {
    w1: Vec<bf16>, // [E, 2F, H]
    w2: Vec<bf16>, // [E, H, F]
}

fn weights(seed: u64) -> Weights {
    let mut rng = StdRng::seed_from_u64(seed);
    let s1 = 1.0 / (H as f32).sqrt();
    let s2 = 1.0 / (F as f32).sqrt();
    Weights {
        w1: bf(&(0..E * 2 * F * H).map(|_| rng.random_range(-s1..s1)).collect::<Vec<_>>()),
        w2: bf(&(0..E * H * F).map(|_| rng.random_range(-s2..s2)).collect::<Vec<_>>()),
    }
}

/// The caller-owned buffers of one layer of [`DIMS`], holding the weights `w`.
fn layer_io(stream: &Arc<CudaStream>, w: &Weights) -> Io {
    Io::new(stream, DIMS, T_MAX, &w.w1, &w.w2)
}

/// A layer's outputs, copied to the host.
fn read(io: &Io, stream: &Arc<CudaStream>) -> Got {
    Got {
        y: stream.clone_dtoh(&io.y).unwrap(),
        dx: stream.clone_dtoh(&io.dx).unwrap(),
        dprobs: stream.clone_dtoh(&io.dprobs).unwrap(),
        dw1: stream.clone_dtoh(&io.dw1).unwrap(),
        dw2: stream.clone_dtoh(&io.dw2).unwrap(),
    }
}

/// y, dx `[T_max, H]` and dprobs `[T_max, k]` poisoned (rows past T must keep it).
fn poison_outputs(
    stream: &Arc<CudaStream>,
    y: &mut CudaSlice<bf16>,
    dx: &mut CudaSlice<bf16>,
    dprobs: &mut CudaSlice<f32>,
) {
    stream.memcpy_htod(&poison_bf16(T_MAX * H), y).unwrap();
    stream.memcpy_htod(&poison_bf16(T_MAX * H), dx).unwrap();
    stream.memcpy_htod(&poison_f32(T_MAX * K), dprobs).unwrap();
}

/// One step's outputs, copied to the host.
struct Got {
    y: Vec<bf16>,
    dx: Vec<bf16>,
    dprobs: Vec<f32>,
    dw1: Vec<bf16>,
    dw2: Vec<bf16>,
}

impl Got {
    /// y, dx, dw1, dw2, dprobs as raw bits (poison included), for bitwise comparisons.
    fn bits(&self) -> Vec<u32> {
        let mut bits: Vec<u32> = Vec::new();
        for v in [&self.y, &self.dx, &self.dw1, &self.dw2] {
            bits.extend(v.iter().map(|b| b.to_bits() as u32));
        }
        bits.extend(self.dprobs.iter().map(|f| f.to_bits()));
        bits
    }
}

/// The token outputs against the fp64 reference: rows t < T of y, dx and routes t < T of
/// dprobs all written (every one, dropped or absent routes give 0) and within tolerance; rows
/// t >= T not written (still the poison: "token rows t >= T of the outputs are not written").
fn check_token_outputs(what: &str, got: &Got, t: usize, r: &Reference) {
    check_token_outputs_written(what, got, t);
    assert_close(&format!("{what} y"), &f64s(&got.y[..t * H]), &r.y[..t * H], 2e-2);
    assert_close(&format!("{what} dx"), &f64s(&got.dx[..t * H]), &r.dx[..t * H], 2e-2);
    let dp: Vec<f64> = got.dprobs[..t * K].iter().map(|&f| f as f64).collect();
    assert_close(&format!("{what} dprobs"), &dp, &r.dprobs[..t * K], 2e-2);
}

/// Rows t < T of y, dx and dprobs written (finite), rows t >= T still the poison.
fn check_token_outputs_written(what: &str, got: &Got, t: usize) {
    assert_written_bf16(&format!("{what} y"), &got.y, t * H);
    assert_written_bf16(&format!("{what} dx"), &got.dx, t * H);
    assert_written_f32(&format!("{what} dprobs"), &got.dprobs, t * K);
}

/// [`check_token_outputs_written`], and the bf16 weight gradients written in full.
fn check_written(what: &str, got: &Got, t: usize) {
    check_token_outputs_written(what, got, t);
    assert_written_bf16(&format!("{what} dw1"), &got.dw1, got.dw1.len());
    assert_written_bf16(&format!("{what} dw2"), &got.dw2, got.dw2.len());
}

/// Every output against the fp64 reference of step `s` (whose ids are the routes the GPU
/// keeps): [`check_token_outputs`], and the bf16 weight gradients written in full (an expert
/// with no rows gets zeros) and within tolerance.
fn check_against_reference(what: &str, got: &Got, s: &Step, w: &Weights) {
    let r = reference(DIMS, s.t, &s.ids, &s.probs, &s.x, &s.dy, &w.w1, &w.w2);
    check_token_outputs(what, got, s.t, &r);
    assert_written_bf16(&format!("{what} dw1"), &got.dw1, got.dw1.len());
    assert_written_bf16(&format!("{what} dw2"), &got.dw2, got.dw2.len());
    assert_close(&format!("{what} dw1"), &f64s(&got.dw1), &r.dw1, 2e-2);
    assert_close(&format!("{what} dw2"), &f64s(&got.dw2), &r.dw2, 2e-2);
}

#[test]
fn forward_and_backward_match_the_fp64_reference() {
    let stream = gpu_or_skip!();
    let w = weights(1);
    let mut moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut io = layer_io(&stream, &w);
    let mut rng = StdRng::seed_from_u64(2);
    for i in 0..10 {
        let s = step(&mut rng, i);
        io.load(&stream, &s);
        io.step(&mut moe, &stream).unwrap();
        check_against_reference(&format!("step {i} (T={})", s.t), &read(&io, &stream), &s, &w);
    }
    assert_eq!(stream.clone_dtoh(&moe.maps.flags).unwrap()[0], 0);
    assert_eq!(stream.clone_dtoh(&moe.gemm_flags).unwrap()[0], 0);
}

/// Capture forward + backward once; replay 1000 times with fresh routing, T, inputs and
/// gradients written between replays. Every replay must equal an eager run bit for bit, and
/// the fp64 reference within bf16 tolerance.
#[test]
fn one_graph_replayed_1000_times_with_new_routing() {
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    let w = weights(3);
    let mut graph_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut eager_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut graph_io = layer_io(&stream, &w);
    let mut eager_io = layer_io(&stream, &w);
    let mut rng = StdRng::seed_from_u64(4);
    let first = step(&mut rng, 5);
    graph_io.load(&stream, &first);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.step(&mut graph_moe, &stream)).unwrap();
    // Under compute-sanitizer (CAPMOE_SANITIZER=1) 5 replays of the patterns of `step` that
    // differ most (T_max, one expert, two experts, T = 0, random T): racecheck holds host
    // memory for every launch, and 10 replays beside their eager runs took it past 128 GiB.
    let patterns: Vec<usize> = if common::under_sanitizer() { vec![1, 2, 3, 0, 4] } else { (0..1000).collect() };
    for i in patterns {
        let s = step(&mut rng, i);
        graph_io.load(&stream, &s);
        eager_io.load(&stream, &s);
        graph.launch().unwrap();
        eager_io.step(&mut eager_moe, &stream).unwrap();
        let got = read(&graph_io, &stream);
        assert!(got.bits() == read(&eager_io, &stream).bits(), "replay {i} (T={}): graph and eager differ", s.t);
        check_against_reference(&format!("replay {i} (T={})", s.t), &got, &s, &w);
    }
    assert_eq!(stream.clone_dtoh(&graph_moe.maps.flags).unwrap()[0], 0);
}

/// A capacity below `T * k` rows: the routes kept are exactly those of the CPU routing
/// reference (rows expert-contiguous, experts ascending, rows at or past the capacity dropped,
/// so later experts lose theirs first), CAPACITY is raised exactly when something was dropped,
/// and every output equals the fp64 reference over the kept routes alone (a dropped route adds
/// nothing to y or dx, its dprobs entry is 0 and it adds nothing to dW). Outputs are poisoned,
/// so an unwritten element or a write past T shows.
#[test]
fn smaller_capacity_drops_the_later_rows_and_matches_the_reference_on_the_kept_routes() {
    const CAP: usize = 20;
    let stream = gpu_or_skip!();
    let w = weights(5);
    let cfg = MoeConfig { capacity: Some(CAP), ..config() };
    let mut moe = MoeExperts::<bf16>::new(cfg, &stream).unwrap();
    assert_eq!(moe.capacity(), CAP);
    let mut io = layer_io(&stream, &w);
    let mut rng = StdRng::seed_from_u64(6);
    let mut dropping_steps = 0;
    // i % 10 picks the pattern of `step`: 1 = T_max (96 routes into 20 rows), 2 = all on one
    // expert, 3 = two experts, 0 = T = 0, others random T.
    for (n, i) in [1usize, 2, 3, 4, 5, 11, 0, 7].into_iter().enumerate() {
        let s = step(&mut rng, i);
        let want = routing::reference::build(&s.ids, s.t, T_MAX, E, K, CAP, 0);
        let what = format!("capacity {CAP}, step {n} (pattern {}, T={}, {} routes)", i % 10, s.t, s.t * K);
        // Every token < T has k valid routes, so rows are dropped exactly when T * k > CAP.
        assert_eq!(want.flags, if s.t * K > CAP { flags::CAPACITY } else { 0 }, "{what}: the reference's flags");
        dropping_steps += (s.t * K > CAP) as usize;
        stream.memset_zeros(&mut moe.maps.flags).unwrap();
        io.load(&stream, &s);
        io.step(&mut moe, &stream).unwrap();
        assert_eq!(stream.clone_dtoh(&moe.gemm_flags).unwrap()[0], 0, "{what}: GEMM flags (the kept rows fit)");
        check_kept_routes(&what, &stream, &moe, &io, &s, &want, &w);
    }
    assert!(dropping_steps >= 1, "no step dropped anything");
}

/// After a step that may drop routes: the routing flags, `row_of_route` and `m_splits` equal the
/// CPU routing reference's, and every output equals the fp64 reference over the kept routes
/// alone (a dropped route becomes an empty slot, -1).
fn check_kept_routes(
    what: &str,
    stream: &Arc<CudaStream>,
    moe: &MoeExperts<bf16>,
    io: &Io,
    s: &Step,
    want: &routing::reference::RouteMaps,
    w: &Weights,
) {
    assert_eq!(stream.clone_dtoh(&moe.maps.flags).unwrap()[0], want.flags, "{what}: routing flags");
    assert_bits(
        &format!("{what}: row_of_route"),
        &stream.clone_dtoh(&moe.maps.row_of_route).unwrap(),
        &want.row_of_route,
    );
    let splits: Vec<i32> = want.m_splits.iter().map(|&m| m as i32).collect();
    assert_bits(&format!("{what}: m_splits"), &stream.clone_dtoh(&moe.maps.m_splits_i32).unwrap(), &splits);
    let ids = s.ids.iter().zip(&want.row_of_route).map(|(&id, &row)| if row >= 0 { id } else { -1 }).collect();
    let kept = Step { ids, ..s.clone() };
    check_against_reference(what, &read(io, stream), &kept, w);
}

/// A per-expert capacity (`MoeConfig::expert_capacity`): each expert keeps at most `ECAP` of
/// its routes (the first in `t * k + j` order), exactly as the CPU routing reference, CAPACITY
/// is raised exactly when something was dropped, and every output equals the fp64 reference
/// over the kept routes alone. Without the field reaching the routing plan nothing is dropped
/// and m_splits exceed ECAP.
#[test]
fn expert_capacity_drops_each_experts_later_routes_and_matches_the_reference_gpu() {
    const ECAP: usize = 5;
    let stream = gpu_or_skip!();
    let w = weights(7);
    let cfg = MoeConfig { expert_capacity: Some(ECAP), ..config() };
    let mut moe = MoeExperts::<bf16>::new(cfg.clone(), &stream).unwrap();
    assert_eq!(moe.desc().config, cfg);
    let mut io = layer_io(&stream, &w);
    let mut rng = StdRng::seed_from_u64(8);
    let mut dropping_steps = 0;
    for (n, i) in [1usize, 2, 3, 4, 5, 11, 0, 7].into_iter().enumerate() {
        let s = step(&mut rng, i);
        let want = routing::reference::build(&s.ids, s.t, T_MAX, E, K, T_MAX * K, ECAP);
        let what = format!("expert capacity {ECAP}, step {n} (pattern {}, T={})", i % 10, s.t);
        assert!(want.m_splits.iter().all(|&m| m as usize <= ECAP), "{what}: the reference keeps at most ECAP rows");
        dropping_steps += (want.flags & flags::CAPACITY != 0) as usize;
        stream.memset_zeros(&mut moe.maps.flags).unwrap();
        io.load(&stream, &s);
        io.step(&mut moe, &stream).unwrap();
        check_kept_routes(&what, &stream, &moe, &io, &s, &want, &w);
    }
    assert!(dropping_steps >= 2, "only {dropping_steps} steps dropped anything");
}

/// Megatron's routing form for one step: `map [T_MAX, E]` and `map_probs [T_MAX, E]` (junk at
/// unrouted entries, which must be ignored), and the top-k form the conversion must produce:
/// each token's experts ascending, at most k of them (the lowest), -1 / 0 after.
struct MapStep {
    t: usize,
    map: Vec<u8>,
    map_probs: Vec<f32>,
    ids: Vec<i32>,
    probs: Vec<f32>,
    too_many: bool,
}

fn map_step(rng: &mut StdRng, i: usize, allow_too_many: bool) -> MapStep {
    let t = match i % 10 {
        0 => 0,
        1 => T_MAX,
        _ => rng.random_range(1..=T_MAX),
    };
    let mut map = vec![0u8; T_MAX * E];
    let mut map_probs: Vec<f32> = (0..T_MAX * E).map(|_| rng.random_range(-9.0f32..9.0)).collect();
    let mut ids = vec![-1i32; T_MAX * K];
    let mut probs = vec![0f32; T_MAX * K];
    let mut too_many = false;
    for tok in 0..t {
        let routes = match rng.random_range(0..8) {
            _ if allow_too_many && tok == 0 => K + 1,
            0 => 0,
            1 => K - 1,
            2 if allow_too_many => K + 1,
            _ => K,
        };
        let mut experts: Vec<usize> = match i % 10 {
            2 => (0..routes).collect(), // everything on the lowest experts
            _ => {
                let mut all: Vec<usize> = (0..E).collect();
                for a in 0..E {
                    all.swap(a, rng.random_range(a..E));
                }
                all.truncate(routes);
                all
            }
        };
        experts.sort();
        too_many |= routes > K;
        for &e in &experts {
            map[tok * E + e] = rng.random_range(1..=255);
            map_probs[tok * E + e] = rng.random_range(0.05f32..1.0);
        }
        for (j, &e) in experts.iter().take(K).enumerate() {
            ids[tok * K + j] = e as i32;
            probs[tok * K + j] = map_probs[tok * E + e];
        }
    }
    MapStep { t, map, map_probs, ids, probs, too_many }
}

/// The Megatron form (routing map + dense probs) through `forward_from_map` /
/// `backward_from_map`, captured once and replayed with new maps and T, equals the top-k form
/// run eagerly on the converted routes, bit for bit (same rows in the same order, same
/// kernels), including dprobs in the converted route order and the converted ids.
#[test]
fn megatron_map_form_matches_topk_form() {
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    let w = weights(7);
    let mut map_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut topk_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut map_io = layer_io(&stream, &w);
    let mut topk_io = layer_io(&stream, &w);
    let mut map_d: CudaSlice<u8> = stream.alloc_zeros(T_MAX * E).unwrap();
    let mut map_probs_d: CudaSlice<f32> = stream.alloc_zeros(T_MAX * E).unwrap();
    let mut rng = StdRng::seed_from_u64(8);

    let run_map = |moe: &mut MoeExperts<bf16>, io: &mut Io, map: &CudaSlice<u8>, mp: &CudaSlice<f32>| {
        let tokens = Tokens::Device(&io.tokens);
        moe.forward_from_map(&stream, &io.x, map, mp, tokens, &io.w1, &io.w2, &mut io.y)?;
        moe.backward_from_map(
            &stream,
            &io.x,
            &io.dy,
            tokens,
            &io.w1,
            &io.w2,
            &mut io.dx,
            &mut io.dprobs,
            &mut io.dw1,
            &mut io.dw2,
        )
    };
    let load = |io: &mut Io, map_d: &mut CudaSlice<u8>, map_probs_d: &mut CudaSlice<f32>, ms: &MapStep, base: &Step| {
        let s = Step { t: ms.t, ids: ms.ids.clone(), probs: ms.probs.clone(), x: base.x.clone(), dy: base.dy.clone() };
        io.load(&stream, &s);
        stream.memcpy_htod(&ms.map, map_d).unwrap();
        stream.memcpy_htod(&ms.map_probs, map_probs_d).unwrap();
        s
    };

    // Eager, with tokens that have more than k routes: TOO_MANY is raised, the lowest k kept.
    let ms = map_step(&mut rng, 1, true);
    assert!(ms.too_many);
    let base = step(&mut rng, 1);
    let s = load(&mut map_io, &mut map_d, &mut map_probs_d, &ms, &base);
    run_map(&mut map_moe, &mut map_io, &map_d, &map_probs_d).unwrap();
    topk_io.load(&stream, &s);
    topk_io.step(&mut topk_moe, &stream).unwrap();
    let map_flags = stream.clone_dtoh(&map_moe.maps.flags).unwrap()[0];
    assert_eq!(map_flags, flags::TOO_MANY, "TOO_MANY and nothing else");
    let got = read(&map_io, &stream);
    assert_bits("too-many step: outputs", &got.bits(), &read(&topk_io, &stream).bits());
    check_written("too-many step", &got, s.t);
    stream.memset_zeros(&mut map_moe.maps.flags).unwrap();

    let first = map_step(&mut rng, 5, false);
    let base = step(&mut rng, 5);
    load(&mut map_io, &mut map_d, &mut map_probs_d, &first, &base);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || run_map(&mut map_moe, &mut map_io, &map_d, &map_probs_d)).unwrap();
    // Under a sanitizer 4 replays, which still include the fp64 check of replay 3 (10 took
    // racecheck past 128 GiB of host memory).
    for i in 0..common::steps_under_sanitizer(60, 4) {
        let ms = map_step(&mut rng, i, false);
        let base = step(&mut rng, i);
        let s = load(&mut map_io, &mut map_d, &mut map_probs_d, &ms, &base);
        topk_io.load(&stream, &s);
        graph.launch().unwrap();
        topk_io.step(&mut topk_moe, &stream).unwrap();
        let what = format!("replay {i} (T={})", s.t);
        let ids = stream.clone_dtoh(map_moe.map_expert_ids()).unwrap();
        assert_bits(&format!("{what}: converted ids"), &ids[..s.t * K], &s.ids[..s.t * K]);
        let got = read(&map_io, &stream);
        assert_bits(&format!("{what}: y, dx, dw1, dw2, dprobs"), &got.bits(), &read(&topk_io, &stream).bits());
        check_written(&what, &got, s.t);
        if i % 20 == 3 {
            check_against_reference(&what, &got, &s, &w);
        }
    }
    assert_eq!(stream.clone_dtoh(&map_moe.maps.flags).unwrap()[0], 0);
    assert_eq!(stream.clone_dtoh(&map_moe.gemm_flags).unwrap()[0], 0);
}

/// Per-expert pointer arrays into the same tensors give the tensor form's results bit for bit,
/// with written (bf16) and accumulated (fp32) weight gradients, when both run the same kernels.
/// (Under `Auto` they need not: the counter kernels take one weight (or dW) tensor only, so
/// the two forms may resolve to different kernels. Both plans force them here.)
#[test]
fn pointer_weights_match_tensor_weights() {
    let stream = gpu_or_skip!();
    let (gemm_config, wgrad_config) = match capturable_moe::device::DeviceInfo::of_stream(&stream).unwrap().arch {
        capturable_moe::device::Arch::Sm90 => (GemmConfig::Sm90CooperativeNoCluster, GemmConfig::Sm90Cooperative),
        _ => (GemmConfig::Sm100OneSm, GemmConfig::Sm100OneSm),
    };
    let w = weights(9);
    let ptrs = |base: u64, elems: usize, bytes: usize| -> Vec<u64> {
        (0..E).map(|e| base + (e * elems * bytes) as u64).collect()
    };
    for accumulate in [false, true] {
        let cfg = MoeConfig { wgrad_accumulate: accumulate, ..config() };
        let tensor_opts = MoeOptions { gemm_config, wgrad_config, ..MoeOptions::default() };
        let mut tensor_moe = MoeExperts::<bf16>::with_options(cfg.clone(), tensor_opts, &stream).unwrap();
        let opts = MoeOptions { weights: WeightForm::Pointers, ..tensor_opts };
        let mut ptr_moe = MoeExperts::<bf16>::with_options(cfg, opts, &stream).unwrap();
        assert_eq!(tensor_moe.gemm_configs(), ptr_moe.gemm_configs());
        let mut io = layer_io(&stream, &w);
        let mut rng = StdRng::seed_from_u64(10);
        let init: Vec<f32> = (0..E * 2 * F * H).map(|_| rng.random_range(-0.5f32..0.5)).collect();
        let mut dw1_t = stream.clone_htod(&init).unwrap();
        let mut dw2_t = stream.clone_htod(&init[..E * H * F]).unwrap();
        let dw1_p = stream.clone_htod(&init).unwrap();
        let dw2_p = stream.clone_htod(&init[..E * H * F]).unwrap();
        let (mut dw1_bf_p, mut dw2_bf_p) = (io.dw1.clone(), io.dw2.clone());
        let w1p = stream.clone_htod(&ptrs(io.w1.device_ptr(&stream).0, 2 * F * H, 2)).unwrap();
        let w2p = stream.clone_htod(&ptrs(io.w2.device_ptr(&stream).0, H * F, 2)).unwrap();
        let (dw1pp, dw2pp) = if accumulate {
            (ptrs(dw1_p.device_ptr(&stream).0, 2 * F * H, 4), ptrs(dw2_p.device_ptr(&stream).0, H * F, 4))
        } else {
            (ptrs(dw1_bf_p.device_ptr(&stream).0, 2 * F * H, 2), ptrs(dw2_bf_p.device_ptr(&stream).0, H * F, 2))
        };
        let mut dw1pp = stream.clone_htod(&dw1pp).unwrap();
        let mut dw2pp = stream.clone_htod(&dw2pp).unwrap();
        let (mut y_p, mut dx_p, mut dprobs_p) = (io.y.clone(), io.dx.clone(), io.dprobs.clone());
        // Under a sanitizer 3 steps (T = 0, T = T_max and one more pattern): 6 took racecheck
        // past 128 GiB of host memory.
        for i in 0..common::steps_under_sanitizer(6, 3) {
            let s = step(&mut rng, i);
            io.load(&stream, &s);
            // The pointer form's outputs poisoned like `load` poisons io's (rows t >= T must
            // keep it in both; bf16 gradients are written in full). The fp32 gradients are
            // added into: they keep their values, and the check below takes the difference.
            poison_outputs(&stream, &mut y_p, &mut dx_p, &mut dprobs_p);
            stream.memcpy_htod(&poison_bf16(E * 2 * F * H), &mut dw1_bf_p).unwrap();
            stream.memcpy_htod(&poison_bf16(E * H * F), &mut dw2_bf_p).unwrap();
            let before1 = stream.clone_dtoh(&dw1_t).unwrap();
            let before2 = stream.clone_dtoh(&dw2_t).unwrap();
            let tok = Tokens::Host(s.t);
            tensor_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &io.w1, &io.w2, &mut io.y).unwrap();
            ptr_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &w1p, &w2p, &mut y_p).unwrap();
            if accumulate {
                tensor_moe
                    .backward(
                        &stream,
                        &io.x,
                        &io.dy,
                        &io.probs,
                        tok,
                        &io.w1,
                        &io.w2,
                        &mut io.dx,
                        &mut io.dprobs,
                        &mut dw1_t,
                        &mut dw2_t,
                    )
                    .unwrap();
            } else {
                tensor_moe
                    .backward(
                        &stream,
                        &io.x,
                        &io.dy,
                        &io.probs,
                        tok,
                        &io.w1,
                        &io.w2,
                        &mut io.dx,
                        &mut io.dprobs,
                        &mut io.dw1,
                        &mut io.dw2,
                    )
                    .unwrap();
            }
            ptr_moe
                .backward(
                    &stream,
                    &io.x,
                    &io.dy,
                    &io.probs,
                    tok,
                    &w1p,
                    &w2p,
                    &mut dx_p,
                    &mut dprobs_p,
                    &mut dw1pp,
                    &mut dw2pp,
                )
                .unwrap();
            let what = format!("accumulate={accumulate} step {i} (T={})", s.t);
            let bits16 =
                |v: &CudaSlice<bf16>| stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect::<Vec<_>>();
            let bits32 =
                |v: &CudaSlice<f32>| stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect::<Vec<_>>();
            assert_bits(&format!("{what}: y"), &bits16(&y_p), &bits16(&io.y));
            assert_bits(&format!("{what}: dx"), &bits16(&dx_p), &bits16(&io.dx));
            assert_bits(&format!("{what}: dprobs"), &bits32(&dprobs_p), &bits32(&io.dprobs));
            if accumulate {
                assert_bits(&format!("{what}: dw1"), &bits32(&dw1_p), &bits32(&dw1_t));
                assert_bits(&format!("{what}: dw2"), &bits32(&dw2_p), &bits32(&dw2_t));
            } else {
                assert_bits(&format!("{what}: dw1"), &bits16(&dw1_bf_p), &bits16(&io.dw1));
                assert_bits(&format!("{what}: dw2"), &bits16(&dw2_bf_p), &bits16(&io.dw2));
            }
            // The tensor form (equal to the pointer form, bit for bit) against the fp64
            // reference; with accumulation, what this step added into the fp32 gradients (an
            // expert with no rows is left unchanged, so T = 0 must add exactly nothing).
            let got = read(&io, &stream);
            if accumulate {
                let r = reference(DIMS, s.t, &s.ids, &s.probs, &s.x, &s.dy, &w.w1, &w.w2);
                check_token_outputs(&what, &got, s.t, &r);
                let added = |after: &[f32], before: &[f32]| {
                    after.iter().zip(before).map(|(a, b)| *a as f64 - *b as f64).collect::<Vec<_>>()
                };
                assert_close(
                    &format!("{what} dw1 added"),
                    &added(&stream.clone_dtoh(&dw1_t).unwrap(), &before1),
                    &r.dw1,
                    2e-2,
                );
                assert_close(
                    &format!("{what} dw2 added"),
                    &added(&stream.clone_dtoh(&dw2_t).unwrap(), &before2),
                    &r.dw2,
                    2e-2,
                );
            } else {
                check_against_reference(&what, &got, &s, &w);
            }
        }
        for moe in [&tensor_moe, &ptr_moe] {
            assert_eq!(stream.clone_dtoh(&moe.maps.flags).unwrap()[0], 0);
            assert_eq!(stream.clone_dtoh(&moe.gemm_flags).unwrap()[0], 0);
        }
    }
}

/// A weight or gradient in the wrong form, too short, or of the wrong element type is an
/// `Error::Shape` naming the operand, raised on the host.
#[test]
fn mismatched_weight_forms_are_typed_errors() {
    let stream = gpu_or_skip!();
    let w = weights(11);
    let mut io = layer_io(&stream, &w);
    let ptrs: CudaSlice<u64> = stream.alloc_zeros(E).unwrap();
    let short_ptrs: CudaSlice<u64> = stream.alloc_zeros(E - 1).unwrap();
    let tok = Tokens::Host(4);
    let is_shape = |r: capturable_moe::Result<()>, want: &str| match r {
        Err(Error::Shape { what, .. }) if what.starts_with(want) => {}
        other => panic!("expected Error::Shape for {want}, got {other:?}"),
    };

    let mut tensor_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    is_shape(tensor_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &ptrs, &ptrs, &mut io.y), "fc1_weight");
    let short_w1: CudaSlice<bf16> = stream.alloc_zeros(E * 2 * F * H - 1).unwrap();
    is_shape(tensor_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &short_w1, &io.w2, &mut io.y), "fc1_weight");
    let probs16: CudaSlice<bf16> = stream.alloc_zeros(T_MAX * K).unwrap();
    is_shape(tensor_moe.forward(&stream, &io.x, &io.ids, &probs16, tok, &io.w1, &io.w2, &mut io.y), "probs");
    let mut short_y: CudaSlice<bf16> = stream.alloc_zeros(T_MAX * H - 1).unwrap();
    is_shape(tensor_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &io.w1, &io.w2, &mut short_y), "y");
    // A view 4 elements (8 bytes) in: long enough, misaligned; named before the first launch.
    let mut long_y: CudaSlice<bf16> = stream.alloc_zeros(T_MAX * H + 4).unwrap();
    let r = tensor_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &io.w1, &io.w2, &mut long_y.slice_mut(4..));
    assert!(matches!(&r, Err(Error::InvalidArgument { why, .. }) if why.starts_with("y at")), "misaligned y: {r:?}");

    let acc = MoeConfig { wgrad_accumulate: true, ..config() };
    let mut acc_moe = MoeExperts::<bf16>::new(acc.clone(), &stream).unwrap();
    let r = acc_moe.backward(
        &stream,
        &io.x,
        &io.dy,
        &io.probs,
        tok,
        &io.w1,
        &io.w2,
        &mut io.dx,
        &mut io.dprobs,
        &mut io.dw1,
        &mut io.dw2,
    );
    is_shape(r, "dw1"); // bf16 gradients into an fp32 main-grad plan

    let opts = MoeOptions { weights: WeightForm::Pointers, ..MoeOptions::default() };
    let mut ptr_moe = MoeExperts::<bf16>::with_options(acc, opts, &stream).unwrap();
    is_shape(ptr_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &io.w1, &io.w2, &mut io.y), "fc1_weight");
    is_shape(ptr_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &short_ptrs, &ptrs, &mut io.y), "fc1_weight");
    is_shape(ptr_moe.forward(&stream, &io.x, &io.ids, &io.probs, tok, &ptrs, &short_ptrs, &mut io.y), "fc2_weight");
    let mut dw_t: CudaSlice<f32> = stream.alloc_zeros(E * 2 * F * H).unwrap();
    let mut dw_t2: CudaSlice<f32> = stream.alloc_zeros(E * 2 * F * H).unwrap();
    let r = ptr_moe.backward(
        &stream,
        &io.x,
        &io.dy,
        &io.probs,
        tok,
        &ptrs,
        &ptrs,
        &mut io.dx,
        &mut io.dprobs,
        &mut dw_t,
        &mut dw_t2,
    );
    is_shape(r, "dw1");
    let short_map: CudaSlice<u8> = stream.alloc_zeros(T_MAX * E - 1).unwrap();
    let mp: CudaSlice<f32> = stream.alloc_zeros(T_MAX * E).unwrap();
    is_shape(
        tensor_moe.forward_from_map(&stream, &io.x, &short_map, &mp, tok, &io.w1, &io.w2, &mut io.y),
        "routing_map",
    );
    for moe in [&tensor_moe, &acc_moe, &ptr_moe] {
        assert_eq!(stream.clone_dtoh(&moe.maps.flags).unwrap()[0], 0);
        assert_eq!(stream.clone_dtoh(&moe.gemm_flags).unwrap()[0], 0);
    }
}
