//! The whole expert path (routing + grouped GEMMs), forward and backward, against an fp64 CPU
//! reference; eager against CUDA-graph replay, bit for bit, over 1000 replays with fresh
//! routing each time.

mod common;

use capturable_moe::dtype::DType;
use capturable_moe::graph::capture;
use capturable_moe::moe::{MoeConfig, MoeExperts};
use capturable_moe::routing::Tokens;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

const E: usize = 8;
const H: usize = 64;
const F: usize = 32;
const K: usize = 2;
const T_MAX: usize = 48;

fn config() -> MoeConfig {
    MoeConfig {
        num_experts: E,
        hidden: H,
        ffn: F,
        topk: K,
        max_tokens: T_MAX,
        capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    }
}

fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn f64s(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// One step's inputs (host), already rounded to their device types.
#[derive(Clone)]
struct Step {
    t: usize,
    ids: Vec<i32>,
    probs: Vec<f32>,
    x: Vec<bf16>,
    dy: Vec<bf16>,
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
                2 => 5,                                  // every token on one expert (twice)
                3 => [1, 6][j],                          // only two experts busy
                4 => rng.random_range(0..E as i32),      // duplicates possible
                _ => {
                    let first = rng.random_range(0..E as i32);
                    if j == 0 { first } else { (first + rng.random_range(1..E as i32)) % E as i32 }
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

/// fp64 reference of forward and backward: (y, dx, dprobs, dw1, dw2). Intermediates the GPU
/// stores in bf16 (h, act, fc2 rows, their gradients) are rounded to bf16 here too, so the
/// comparison measures the kernels' arithmetic rather than bf16 storage.
#[allow(clippy::type_complexity)]
fn reference(s: &Step, w: &Weights) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (w1, w2, x, dy) = (f64s(&w.w1), f64s(&w.w2), f64s(&s.x), f64s(&s.dy));
    let mut y = vec![0.0; T_MAX * H];
    let mut dx = vec![0.0; T_MAX * H];
    let mut dprobs = vec![0.0; T_MAX * K];
    let mut dw1 = vec![0.0; E * 2 * F * H];
    let mut dw2 = vec![0.0; E * H * F];
    let sigmoid = |g: f64| 1.0 / (1.0 + (-g).exp());
    let r = |v: f64| bf16::from_f64(v).to_f64();
    for t in 0..s.t {
        for j in 0..K {
            let e = s.ids[t * K + j];
            if e < 0 {
                continue;
            }
            let e = e as usize;
            let p = s.probs[t * K + j] as f64;
            let xt = &x[t * H..(t + 1) * H];
            let h: Vec<f64> = (0..2 * F).map(|o| r((0..H).map(|c| w1[(e * 2 * F + o) * H + c] * xt[c]).sum())).collect();
            let act: Vec<f64> = (0..F).map(|f| r(h[f] * sigmoid(h[f]) * h[F + f])).collect();
            let out: Vec<f64> = (0..H).map(|o| r((0..F).map(|f| w2[(e * H + o) * F + f] * act[f]).sum())).collect();
            let dyt = &dy[t * H..(t + 1) * H];
            for o in 0..H {
                y[t * H + o] += p * out[o];
            }
            dprobs[t * K + j] = (0..H).map(|o| dyt[o] * out[o]).sum();
            let dout: Vec<f64> = dyt.iter().map(|d| r(p * d)).collect();
            let mut dact = vec![0.0; F];
            for o in 0..H {
                for f in 0..F {
                    dw2[(e * H + o) * F + f] += dout[o] * act[f];
                    dact[f] += w2[(e * H + o) * F + f] * dout[o];
                }
            }
            let dact: Vec<f64> = dact.into_iter().map(r).collect();
            let mut dh = vec![0.0; 2 * F];
            for f in 0..F {
                let (g, u, sg) = (h[f], h[F + f], sigmoid(h[f]));
                dh[f] = dact[f] * u * sg * (1.0 + g * (1.0 - sg));
                dh[F + f] = dact[f] * g * sg;
            }
            let dh: Vec<f64> = dh.into_iter().map(r).collect();
            let mut drow_in = vec![0.0; H];
            for o in 0..2 * F {
                for c in 0..H {
                    dw1[(e * 2 * F + o) * H + c] += dh[o] * xt[c];
                    drow_in[c] += w1[(e * 2 * F + o) * H + c] * dh[o];
                }
            }
            for c in 0..H {
                dx[t * H + c] += r(drow_in[c]);
            }
        }
    }
    (y, dx, dprobs, dw1, dw2)
}

/// Device buffers whose addresses a captured graph keeps.
struct Io {
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    tokens: CudaSlice<i32>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
    dw1: CudaSlice<bf16>,
    dw2: CudaSlice<bf16>,
}

impl Io {
    fn new(stream: &Arc<CudaStream>, w: &Weights) -> Io {
        Io {
            x: stream.alloc_zeros(T_MAX * H).unwrap(),
            ids: stream.alloc_zeros(T_MAX * K).unwrap(),
            probs: stream.alloc_zeros(T_MAX * K).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            w1: stream.clone_htod(&w.w1).unwrap(),
            w2: stream.clone_htod(&w.w2).unwrap(),
            y: stream.alloc_zeros(T_MAX * H).unwrap(),
            dy: stream.alloc_zeros(T_MAX * H).unwrap(),
            dx: stream.alloc_zeros(T_MAX * H).unwrap(),
            dprobs: stream.alloc_zeros(T_MAX * K).unwrap(),
            dw1: stream.alloc_zeros(E * 2 * F * H).unwrap(),
            dw2: stream.alloc_zeros(E * H * F).unwrap(),
        }
    }

    /// Writes a step's inputs; clears the outputs so stale rows cannot pass for results.
    fn load(&mut self, stream: &Arc<CudaStream>, s: &Step) {
        stream.memcpy_htod(&s.x, &mut self.x).unwrap();
        stream.memcpy_htod(&s.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&s.probs, &mut self.probs).unwrap();
        stream.memcpy_htod(&s.dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&[s.t as i32], &mut self.tokens).unwrap();
        stream.memset_zeros(&mut self.y).unwrap();
        stream.memset_zeros(&mut self.dx).unwrap();
        stream.memset_zeros(&mut self.dprobs).unwrap();
    }

    fn step(&mut self, moe: &mut MoeExperts<bf16>, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let tokens = Tokens::Device(&self.tokens);
        moe.forward(stream, &self.x, &self.ids, &self.probs, tokens, &self.w1, &self.w2, &mut self.y)?;
        moe.backward(
            stream, &self.dy, &self.probs, tokens, &self.w1, &self.w2, &mut self.dx, &mut self.dprobs, &mut self.dw1,
            &mut self.dw2,
        )
    }

    /// (y, dx, dprobs, dw1, dw2) as raw bits and as f64.
    fn read(&self, stream: &Arc<CudaStream>) -> (Vec<u32>, [Vec<f64>; 5]) {
        let y = stream.clone_dtoh(&self.y).unwrap();
        let dx = stream.clone_dtoh(&self.dx).unwrap();
        let dp = stream.clone_dtoh(&self.dprobs).unwrap();
        let dw1 = stream.clone_dtoh(&self.dw1).unwrap();
        let dw2 = stream.clone_dtoh(&self.dw2).unwrap();
        let mut bits: Vec<u32> = Vec::new();
        for v in [&y, &dx, &dw1, &dw2] {
            bits.extend(v.iter().map(|b| b.to_bits() as u32));
        }
        bits.extend(dp.iter().map(|f| f.to_bits()));
        (bits, [f64s(&y), f64s(&dx), dp.iter().map(|&f| f as f64).collect(), f64s(&dw1), f64s(&dw2)])
    }
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: non-finite at {i}");
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    if norm == 0.0 {
        assert!(diff == 0.0, "{what}: expected all zeros");
        return;
    }
    let rel = (diff / norm).sqrt();
    assert!(rel <= tol, "{what}: normwise relative error {rel:.3e} > {tol:.0e}");
}

fn check_against_reference(what: &str, got: &[Vec<f64>; 5], s: &Step, w: &Weights) {
    let (y, dx, dprobs, dw1, dw2) = reference(s, w);
    let names = ["y", "dx", "dprobs", "dw1", "dw2"];
    for (i, want) in [y, dx, dprobs, dw1, dw2].iter().enumerate() {
        assert_close(&format!("{what} {}", names[i]), &got[i], want, 2e-2);
    }
}

#[test]
fn forward_and_backward_match_the_fp64_reference() {
    let stream = gpu_or_skip!();
    let w = weights(1);
    let mut moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut io = Io::new(&stream, &w);
    let mut rng = StdRng::seed_from_u64(2);
    for i in 0..10 {
        let s = step(&mut rng, i);
        io.load(&stream, &s);
        io.step(&mut moe, &stream).unwrap();
        let (_, got) = io.read(&stream);
        check_against_reference(&format!("step {i} (T={})", s.t), &got, &s, &w);
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
    let _lock = common::CAPTURE_LOCK.lock().unwrap();
    let w = weights(3);
    let mut graph_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut eager_moe = MoeExperts::<bf16>::new(config(), &stream).unwrap();
    let mut graph_io = Io::new(&stream, &w);
    let mut eager_io = Io::new(&stream, &w);
    let mut rng = StdRng::seed_from_u64(4);
    let first = step(&mut rng, 5);
    graph_io.load(&stream, &first);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.step(&mut graph_moe, &stream)).unwrap();
    for i in 0..1000 {
        let s = step(&mut rng, i);
        graph_io.load(&stream, &s);
        eager_io.load(&stream, &s);
        graph.launch().unwrap();
        eager_io.step(&mut eager_moe, &stream).unwrap();
        let (graph_bits, got) = graph_io.read(&stream);
        let (eager_bits, _) = eager_io.read(&stream);
        assert!(graph_bits == eager_bits, "replay {i} (T={}): graph and eager differ", s.t);
        check_against_reference(&format!("replay {i} (T={})", s.t), &got, &s, &w);
    }
    assert_eq!(stream.clone_dtoh(&graph_moe.maps.flags).unwrap()[0], 0);
}

#[test]
fn smaller_capacity_drops_and_flags_without_going_out_of_bounds() {
    let stream = gpu_or_skip!();
    let w = weights(5);
    let cfg = MoeConfig { capacity: Some(20), ..config() };
    let mut moe = MoeExperts::<bf16>::new(cfg, &stream).unwrap();
    let mut io = Io::new(&stream, &w);
    let mut rng = StdRng::seed_from_u64(6);
    let s = step(&mut rng, 1); // T = T_max: 96 routes into 20 rows
    io.load(&stream, &s);
    io.step(&mut moe, &stream).unwrap();
    let flags = stream.clone_dtoh(&moe.maps.flags).unwrap()[0];
    assert_eq!(flags & capturable_moe::routing::flags::CAPACITY, capturable_moe::routing::flags::CAPACITY);
    let (_, got) = io.read(&stream);
    assert!(got.iter().all(|v| v.iter().all(|x| x.is_finite())));
}
