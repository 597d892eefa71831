//! Soak (issue 19): two captured graphs replayed `CAPMOE_SOAK_REPLAYS` times each (default
//! 10 000) with fresh routing, token counts and activations written between replays, and
//! adversarial replays mixed in (T = 0, one hot expert, out-of-range expert ids, capacity
//! overflow, a device T past T_max):
//! * the expert path (routing + grouped GEMMs, forward + backward, device T, a row capacity
//!   below T_max * k);
//! * Echo plan + top-k reroute + spare-slot weight fill + the expert path over the E + S
//!   slots (pointer weights, fp32 gradients) + the fold of the spare gradients.
//!
//! Every replay's flag words must be exactly what its inputs raise (the CPU routing
//! reference's flags, BAD_TOKENS for a T past T_max, Echo's EXPERT_OUT_OF_RANGE for bad
//! ids, nothing else); every 50th replay and every adversarial one is also run eagerly on a
//! second, identical set of buffers and compared bit for bit (outputs, gradients, reroute,
//! rows past T still the poison). Wall time per 1000 replays and free device memory
//! (cuMemGetInfo) are printed and must stay flat.
//!
//! Ignored by default (minutes at 10 000 replays): `cargo test --release --test soak_gpu --
//! --ignored --nocapture` (in the bundle: `gpu-bundle/run/tests/soak_gpu --ignored
//! --nocapture --test-threads=1`). Skipped under compute-sanitizer (CAPMOE_SANITIZER=1).

mod common;

use std::sync::Arc;
use std::time::Instant;

use capturable_moe::dtype::DType;
use capturable_moe::echo::{self as echo, Algorithm, DeviceErrors, EchoConfig, EchoPlan};
use capturable_moe::graph::capture;
use capturable_moe::moe::{echo_slot_pointers, MoeConfig, MoeExperts, MoeOptions, WeightForm};
use capturable_moe::routing::{self, flags, Tokens};
use common::moe::{assert_bits, bf, poison_bf16, poison_f32};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn replays() -> usize {
    match std::env::var("CAPMOE_SOAK_REPLAYS") {
        Err(_) => 10_000,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 1000 => n,
            _ => panic!("CAPMOE_SOAK_REPLAYS={v:?}: need a whole number >= 1000 (one timing block)"),
        },
    }
}

/// What one replay feeds the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Random,
    Empty,
    HotExpert,
    BadIds,
    Overflow,
    TokensPastMax,
}

/// Replay `i`'s kind: one adversarial replay in five, the kinds in turn.
fn kind_of(i: usize) -> Kind {
    match i % 25 {
        0 => Kind::Empty,
        5 => Kind::HotExpert,
        10 => Kind::BadIds,
        15 => Kind::Overflow,
        20 => Kind::TokensPastMax,
        _ => Kind::Random,
    }
}

/// Compared with eager: every 50th replay and every adversarial one.
fn sampled(i: usize) -> bool {
    i.is_multiple_of(50) || kind_of(i) != Kind::Random
}

/// One replay's routing: the device token count (may be past `t_max`), the count the
/// kernels use (clamped), and `ids [t_max, k]` (-1 past T), `probs [t_max, k]`.
struct Routes {
    device_t: i32,
    t: usize,
    ids: Vec<i32>,
    probs: Vec<f32>,
}

fn routes(rng: &mut StdRng, kind: Kind, e: usize, k: usize, t_max: usize) -> Routes {
    let (device_t, t) = match kind {
        Kind::Empty => (0, 0),
        Kind::Overflow => (t_max as i32, t_max),
        Kind::TokensPastMax => (t_max as i32 + 3, t_max),
        _ => {
            let t = rng.random_range(1..=t_max);
            (t as i32, t)
        }
    };
    let mut ids = vec![-1i32; t_max * k];
    let mut probs = vec![0f32; t_max * k];
    for tok in 0..t {
        let first = rng.random_range(0..e);
        for j in 0..k {
            // k distinct experts per token (j-th after the first, cyclically), so the Echo
            // counts and the plain routes agree.
            let expert = if kind == Kind::HotExpert && j == 0 { 3 } else { (first + j) % e };
            let expert = if kind == Kind::HotExpert && j > 0 && expert == 3 { (first + k) % e } else { expert };
            ids[tok * k + j] = expert as i32;
            probs[tok * k + j] = rng.random_range(0.05f32..1.0);
        }
    }
    if kind == Kind::BadIds && t > 0 {
        ids[0] = e as i32 + 2;
        ids[(t - 1) * k + k - 1] = -5;
    }
    Routes { device_t, t, ids, probs }
}

fn random_bf16(rng: &mut StdRng, n: usize, scale: f32) -> Vec<bf16> {
    bf(&(0..n).map(|_| rng.random_range(-scale..scale)).collect::<Vec<_>>())
}

fn bits16(stream: &Arc<CudaStream>, v: &CudaSlice<bf16>) -> Vec<u16> {
    stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect()
}

fn bits32(stream: &Arc<CudaStream>, v: &CudaSlice<f32>) -> Vec<u32> {
    stream.clone_dtoh(v).unwrap().iter().map(|b| b.to_bits()).collect()
}

fn word(stream: &Arc<CudaStream>, v: &CudaSlice<i32>) -> i32 {
    stream.clone_dtoh(v).unwrap()[0]
}

fn free_device_bytes(stream: &Arc<CudaStream>) -> usize {
    stream.context().bind_to_thread().unwrap();
    cudarc::driver::result::mem_get_info().unwrap().0
}

/// Wall time per block of 1000 replays and free device memory at each block's end: no block
/// slower than twice the median block, free memory never below the first reading by more
/// than 16 MiB.
struct Stability {
    name: &'static str,
    block_start: Instant,
    block_ms: Vec<f64>,
    free_mb: Vec<f64>,
}

impl Stability {
    fn new(name: &'static str, stream: &Arc<CudaStream>) -> Stability {
        let free = free_device_bytes(stream) as f64 / (1 << 20) as f64;
        Stability { name, block_start: Instant::now(), block_ms: Vec::new(), free_mb: vec![free] }
    }

    fn after_replay(&mut self, stream: &Arc<CudaStream>, i: usize) {
        if (i + 1).is_multiple_of(1000) {
            stream.synchronize().unwrap();
            self.block_ms.push(self.block_start.elapsed().as_secs_f64() * 1e3);
            self.free_mb.push(free_device_bytes(stream) as f64 / (1 << 20) as f64);
            self.block_start = Instant::now();
        }
    }

    fn check(&self) {
        println!("{}: ms per 1000 replays {:.0?}; free device MiB {:.1?}", self.name, self.block_ms, self.free_mb);
        let mut sorted = self.block_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let slowest = sorted[sorted.len() - 1];
        assert!(
            slowest <= 2.0 * median,
            "{}: a block of 1000 replays took {slowest:.0} ms, the median {median:.0} ms",
            self.name
        );
        let lowest = self.free_mb.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(
            self.free_mb[0] - lowest <= 16.0,
            "{}: free device memory fell from {:.1} to {lowest:.1} MiB",
            self.name,
            self.free_mb[0]
        );
    }
}

// ---------------------------------------------------------------- the expert path

const E: usize = 8;
const H: usize = 64;
const F: usize = 32;
const K: usize = 2;
const T_MAX: usize = 48;
/// Rows kept: below T_max * k, so a full batch overflows.
const CAP: usize = 72;

fn expert_config() -> MoeConfig {
    MoeConfig {
        num_experts: E,
        hidden: H,
        ffn: F,
        topk: K,
        max_tokens: T_MAX,
        capacity: Some(CAP),
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    }
}

/// Buffers of one expert-path instance; the graph keeps their addresses.
struct ExpertIo {
    moe: MoeExperts<bf16>,
    tokens: CudaSlice<i32>,
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    dy: CudaSlice<bf16>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
    dw1: CudaSlice<bf16>,
    dw2: CudaSlice<bf16>,
}

impl ExpertIo {
    fn new(stream: &Arc<CudaStream>, w1: &[bf16], w2: &[bf16]) -> ExpertIo {
        ExpertIo {
            moe: MoeExperts::<bf16>::new(expert_config(), stream).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            x: stream.alloc_zeros(T_MAX * H).unwrap(),
            ids: stream.alloc_zeros(T_MAX * K).unwrap(),
            probs: stream.alloc_zeros(T_MAX * K).unwrap(),
            dy: stream.alloc_zeros(T_MAX * H).unwrap(),
            w1: stream.clone_htod(w1).unwrap(),
            w2: stream.clone_htod(w2).unwrap(),
            y: stream.alloc_zeros(T_MAX * H).unwrap(),
            dx: stream.alloc_zeros(T_MAX * H).unwrap(),
            dprobs: stream.alloc_zeros(T_MAX * K).unwrap(),
            dw1: stream.alloc_zeros(E * 2 * F * H).unwrap(),
            dw2: stream.alloc_zeros(E * H * F).unwrap(),
        }
    }

    /// Inputs, poisoned token outputs (rows past T must keep the poison) and cleared flags.
    fn load(&mut self, stream: &Arc<CudaStream>, r: &Routes, x: &[bf16], dy: &[bf16]) {
        stream.memcpy_htod(&[r.device_t], &mut self.tokens).unwrap();
        stream.memcpy_htod(&r.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&r.probs, &mut self.probs).unwrap();
        stream.memcpy_htod(x, &mut self.x).unwrap();
        stream.memcpy_htod(dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&poison_bf16(T_MAX * H), &mut self.y).unwrap();
        stream.memcpy_htod(&poison_bf16(T_MAX * H), &mut self.dx).unwrap();
        stream.memcpy_htod(&poison_f32(T_MAX * K), &mut self.dprobs).unwrap();
        stream.memset_zeros(&mut self.moe.maps.flags).unwrap();
        stream.memset_zeros(&mut self.moe.gemm_flags).unwrap();
    }

    fn run(&mut self, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let tokens = Tokens::Device(&self.tokens);
        self.moe.forward(stream, &self.x, &self.ids, &self.probs, tokens, &self.w1, &self.w2, &mut self.y)?;
        self.moe.backward(
            stream,
            &self.dy,
            &self.probs,
            tokens,
            &self.w1,
            &self.w2,
            &mut self.dx,
            &mut self.dprobs,
            &mut self.dw1,
            &mut self.dw2,
        )
    }

    /// y, dx, dprobs, dw1, dw2 as raw bits.
    fn bits(&self, stream: &Arc<CudaStream>) -> Vec<u32> {
        let mut v: Vec<u32> = Vec::new();
        for b in [&self.y, &self.dx, &self.dw1, &self.dw2] {
            v.extend(bits16(stream, b).into_iter().map(u32::from));
        }
        v.extend(bits32(stream, &self.dprobs));
        v
    }
}

#[test]
#[ignore = "soak: 10 000 replays of two graphs (minutes); run with --ignored"]
fn soak_expert_path_graph_gpu() {
    if common::skip_under_sanitizer() {
        return;
    }
    let stream = gpu_or_skip!();
    let _lock = common::CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = StdRng::seed_from_u64(19);
    let w1 = random_bf16(&mut rng, E * 2 * F * H, 1.0 / (H as f32).sqrt());
    let w2 = random_bf16(&mut rng, E * H * F, 1.0 / (F as f32).sqrt());
    let mut graph_io = ExpertIo::new(&stream, &w1, &w2);
    let mut eager_io = ExpertIo::new(&stream, &w1, &w2);
    let first = routes(&mut rng, Kind::Random, E, K, T_MAX);
    let (x, dy) = (random_bf16(&mut rng, T_MAX * H, 1.0), random_bf16(&mut rng, T_MAX * H, 1.0));
    graph_io.load(&stream, &first, &x, &dy);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.run(&stream)).unwrap();

    let mut stable = Stability::new("expert path", &stream);
    let (mut compared, mut overflowed) = (0, 0);
    for i in 0..replays() {
        let kind = kind_of(i);
        let r = routes(&mut rng, kind, E, K, T_MAX);
        let (x, dy) = (random_bf16(&mut rng, T_MAX * H, 1.0), random_bf16(&mut rng, T_MAX * H, 1.0));
        graph_io.load(&stream, &r, &x, &dy);
        graph.launch().unwrap();

        let what = format!("expert path replay {i} ({kind:?}, T = {})", r.device_t);
        let mut want = routing::reference::build(&r.ids, r.t, T_MAX, E, K, CAP, 0).flags;
        if kind == Kind::TokensPastMax {
            want |= flags::BAD_TOKENS;
        }
        assert_eq!(word(&stream, &graph_io.moe.maps.flags), want, "{what}: routing flag word");
        assert_eq!(word(&stream, &graph_io.moe.gemm_flags), 0, "{what}: GEMM flag word (kept rows fit)");
        overflowed += (want & flags::CAPACITY != 0) as usize;
        if sampled(i) {
            eager_io.load(&stream, &r, &x, &dy);
            eager_io.run(&stream).unwrap();
            assert_eq!(word(&stream, &eager_io.moe.maps.flags), want, "{what}: eager routing flag word");
            assert_bits(&format!("{what}: graph vs eager"), &graph_io.bits(&stream), &eager_io.bits(&stream));
            let y = stream.clone_dtoh(&graph_io.y).unwrap();
            assert!(y[..r.t * H].iter().all(|v| v.is_finite()), "{what}: y rows < T not all written");
            assert!(y[r.t * H..].iter().all(|v| v.to_bits() == 0xFFFF), "{what}: y written past T");
            compared += 1;
        }
        stable.after_replay(&stream, i);
    }
    println!("expert path: {} replays, {compared} compared with eager, {overflowed} over capacity", replays());
    assert!(overflowed >= replays() / 25, "too few replays overflowed the capacity");
    stable.check();
}

// ---------------------------------------------------------------- Echo + the expert path

const EE: usize = 16; // experts
const EP: usize = 4;
const EH: usize = 128;
const EF: usize = 64;
const EK: usize = 4;
const ET_MAX: usize = 128;
const W1: usize = 2 * EF * EH;
const W2: usize = EH * EF;

/// Buffers of one Echo + expert path instance (as tests/echo_moe_gpu.rs, smaller).
struct EchoIo {
    plan: EchoPlan,
    moe: MoeExperts<bf16>,
    tokens: CudaSlice<i32>,
    counts: CudaSlice<i64>,
    ids: CudaSlice<i32>,
    probs: CudaSlice<f32>,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    w1: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    state: CudaSlice<i64>,
    ws: CudaSlice<i32>,
    dest: CudaSlice<i32>,
    dest_probs: CudaSlice<f32>,
    w1_spare: CudaSlice<bf16>,
    w2_spare: CudaSlice<bf16>,
    dw1: CudaSlice<f32>,
    dw2: CudaSlice<f32>,
    dw1_spare: CudaSlice<f32>,
    dw2_spare: CudaSlice<f32>,
    w1_ptrs: CudaSlice<u64>,
    w2_ptrs: CudaSlice<u64>,
    dw1_ptrs: CudaSlice<u64>,
    dw2_ptrs: CudaSlice<u64>,
    slot_errors: CudaSlice<i64>,
    y: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    dprobs: CudaSlice<f32>,
}

fn echo_config() -> EchoConfig {
    EchoConfig {
        ep: EP,
        num_experts: EE,
        spare_per_rank: 2,
        ep_rank: 1,
        topk: EK,
        algorithm: Algorithm::Greedy,
        threshold_multiplier: 0.0,
    }
}

impl EchoIo {
    fn new(stream: &Arc<CudaStream>, w1: &[bf16], w2: &[bf16]) -> EchoIo {
        let cfg = echo_config();
        let s = cfg.num_spare();
        let plan = EchoPlan::new(cfg.clone(), ET_MAX).unwrap();
        let moe_cfg = MoeConfig {
            num_experts: cfg.num_columns(),
            hidden: EH,
            ffn: EF,
            topk: EK,
            max_tokens: ET_MAX,
            capacity: None,
            expert_capacity: None,
            dtype: DType::Bf16,
            prob_dtype: DType::F32,
            wgrad_accumulate: true,
        };
        let opts = MoeOptions { weights: WeightForm::Pointers, ..MoeOptions::default() };
        let moe = MoeExperts::<bf16>::with_options(moe_cfg, opts, stream).unwrap();
        let w1 = stream.clone_htod(w1).unwrap();
        let w2 = stream.clone_htod(w2).unwrap();
        let w1_spare = stream.alloc_zeros::<bf16>(s * W1).unwrap();
        let w2_spare = stream.alloc_zeros::<bf16>(s * W2).unwrap();
        let dw1 = stream.alloc_zeros::<f32>(EE * W1).unwrap();
        let dw2 = stream.alloc_zeros::<f32>(EE * W2).unwrap();
        let dw1_spare = stream.alloc_zeros::<f32>(s * W1).unwrap();
        let dw2_spare = stream.alloc_zeros::<f32>(s * W2).unwrap();
        let ptrs16 = |home: &CudaSlice<bf16>, spare: &CudaSlice<bf16>, per: usize| {
            stream.clone_htod(&echo_slot_pointers(stream, &cfg, home, spare, per).unwrap()).unwrap()
        };
        let ptrs32 = |home: &CudaSlice<f32>, spare: &CudaSlice<f32>, per: usize| {
            stream.clone_htod(&echo_slot_pointers(stream, &cfg, home, spare, per).unwrap()).unwrap()
        };
        EchoIo {
            tokens: stream.alloc_zeros(1).unwrap(),
            counts: stream.alloc_zeros(EP * EE).unwrap(),
            ids: stream.alloc_zeros(ET_MAX * EK).unwrap(),
            probs: stream.alloc_zeros(ET_MAX * EK).unwrap(),
            x: stream.alloc_zeros(ET_MAX * EH).unwrap(),
            dy: stream.alloc_zeros(ET_MAX * EH).unwrap(),
            state: stream.alloc_zeros(plan.state_len()).unwrap(),
            ws: stream.alloc_zeros(plan.workspace_len().max(1)).unwrap(),
            dest: stream.alloc_zeros(ET_MAX * EK).unwrap(),
            dest_probs: stream.alloc_zeros(ET_MAX * EK).unwrap(),
            w1_ptrs: ptrs16(&w1, &w1_spare, W1),
            w2_ptrs: ptrs16(&w2, &w2_spare, W2),
            dw1_ptrs: ptrs32(&dw1, &dw1_spare, W1),
            dw2_ptrs: ptrs32(&dw2, &dw2_spare, W2),
            slot_errors: stream.alloc_zeros(1).unwrap(),
            y: stream.alloc_zeros(ET_MAX * EH).unwrap(),
            dx: stream.alloc_zeros(ET_MAX * EH).unwrap(),
            dprobs: stream.alloc_zeros(ET_MAX * EK).unwrap(),
            plan,
            moe,
            w1,
            w2,
            w1_spare,
            w2_spare,
            dw1,
            dw2,
            dw1_spare,
            dw2_spare,
        }
    }

    /// Inputs, poisoned outputs, zeroed gradients and cleared flag words.
    fn load(&mut self, stream: &Arc<CudaStream>, r: &Routes, counts: &[i64], x: &[bf16], dy: &[bf16]) {
        stream.memcpy_htod(&[r.device_t], &mut self.tokens).unwrap();
        stream.memcpy_htod(counts, &mut self.counts).unwrap();
        stream.memcpy_htod(&r.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&r.probs, &mut self.probs).unwrap();
        stream.memcpy_htod(x, &mut self.x).unwrap();
        stream.memcpy_htod(dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&poison_bf16(ET_MAX * EH), &mut self.y).unwrap();
        stream.memcpy_htod(&poison_bf16(ET_MAX * EH), &mut self.dx).unwrap();
        stream.memcpy_htod(&poison_f32(ET_MAX * EK), &mut self.dprobs).unwrap();
        stream.memcpy_htod(&vec![-7777i32; ET_MAX * EK], &mut self.dest).unwrap();
        stream.memset_zeros(&mut self.dw1).unwrap();
        stream.memset_zeros(&mut self.dw2).unwrap();
        stream.memset_zeros(&mut self.moe.maps.flags).unwrap();
        stream.memset_zeros(&mut self.moe.gemm_flags).unwrap();
        stream.memset_zeros(&mut self.slot_errors).unwrap();
    }

    /// Plan + reroute, spare weights, expert path over E + S slots, fold.
    fn run(&mut self, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let s = self.plan.config().num_spare();
        let tok = Tokens::Device(&self.tokens);
        self.plan.plan_reroute_topk(
            stream,
            &self.counts,
            &self.ids,
            &self.probs,
            tok,
            &mut self.state,
            &mut self.ws,
            &mut self.dest,
            &mut self.dest_probs,
        )?;
        let off = self.plan.layout().slot_expert;
        let slot_expert = self.state.slice(off..off + s);
        echo::fill_spare_weights(
            stream,
            &slot_expert,
            EE,
            0,
            s,
            &self.w1,
            &mut self.w1_spare,
            W1,
            &mut self.slot_errors,
        )?;
        echo::fill_spare_weights(
            stream,
            &slot_expert,
            EE,
            0,
            s,
            &self.w2,
            &mut self.w2_spare,
            W2,
            &mut self.slot_errors,
        )?;
        stream.memset_zeros(&mut self.dw1_spare)?;
        stream.memset_zeros(&mut self.dw2_spare)?;
        self.moe.forward(
            stream,
            &self.x,
            &self.dest,
            &self.dest_probs,
            tok,
            &self.w1_ptrs,
            &self.w2_ptrs,
            &mut self.y,
        )?;
        self.moe.backward(
            stream,
            &self.dy,
            &self.dest_probs,
            tok,
            &self.w1_ptrs,
            &self.w2_ptrs,
            &mut self.dx,
            &mut self.dprobs,
            &mut self.dw1_ptrs,
            &mut self.dw2_ptrs,
        )?;
        echo::fold_spare_grads(stream, &slot_expert, EE, s, &self.dw1_spare, &mut self.dw1, W1, &mut self.slot_errors)?;
        echo::fold_spare_grads(stream, &slot_expert, EE, s, &self.dw2_spare, &mut self.dw2, W2, &mut self.slot_errors)
    }

    /// Reroute, outputs and folded gradients as raw bits.
    fn bits(&self, stream: &Arc<CudaStream>) -> Vec<u32> {
        let mut v: Vec<u32> = stream.clone_dtoh(&self.dest).unwrap().iter().map(|&c| c as u32).collect();
        v.extend(bits32(stream, &self.dest_probs));
        for b in [&self.y, &self.dx] {
            v.extend(bits16(stream, b).into_iter().map(u32::from));
        }
        for b in [&self.dprobs, &self.dw1, &self.dw2] {
            v.extend(bits32(stream, b));
        }
        v
    }
}

/// The EP group's count matrix `[EP, E]`: this rank's row counts its valid routes; the other
/// ranks draw theirs (all on expert 3 for the hot-expert replays).
fn echo_counts(rng: &mut StdRng, r: &Routes, kind: Kind) -> Vec<i64> {
    let rank = echo_config().ep_rank;
    let mut counts = vec![0i64; EP * EE];
    for q in 0..EP {
        if q == rank {
            for &id in &r.ids[..r.t * EK] {
                if (0..EE as i32).contains(&id) {
                    counts[q * EE + id as usize] += 1;
                }
            }
        } else if kind == Kind::HotExpert {
            counts[q * EE + 3] = rng.random_range(0..=ET_MAX as i64);
        } else {
            for e in 0..EE {
                counts[q * EE + e] = rng.random_range(0..=(ET_MAX * EK / EE * 2) as i64);
            }
        }
    }
    counts
}

#[test]
#[ignore = "soak: 10 000 replays of two graphs (minutes); run with --ignored"]
fn soak_echo_plan_reroute_and_expert_path_graph_gpu() {
    if common::skip_under_sanitizer() {
        return;
    }
    let stream = gpu_or_skip!();
    let _lock = common::CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let mut rng = StdRng::seed_from_u64(1919);
    let w1 = random_bf16(&mut rng, EE * W1, 1.0 / (EH as f32).sqrt());
    let w2 = random_bf16(&mut rng, EE * W2, 1.0 / (EF as f32).sqrt());
    let mut graph_io = EchoIo::new(&stream, &w1, &w2);
    let mut eager_io = EchoIo::new(&stream, &w1, &w2);
    let first = routes(&mut rng, Kind::Random, EE, EK, ET_MAX);
    let counts = echo_counts(&mut rng, &first, Kind::Random);
    let (x, dy) = (random_bf16(&mut rng, ET_MAX * EH, 1.0), random_bf16(&mut rng, ET_MAX * EH, 1.0));
    graph_io.load(&stream, &first, &counts, &x, &dy);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.run(&stream)).unwrap();

    let mut stable = Stability::new("echo + expert path", &stream);
    let (mut compared, mut moved) = (0, 0);
    let s = echo_config().num_spare();
    for i in 0..replays() {
        // Overflow does not apply (capacity = T_max * k): it runs as a full batch.
        let kind = kind_of(i);
        let r = routes(&mut rng, kind, EE, EK, ET_MAX);
        let counts = echo_counts(&mut rng, &r, kind);
        let (x, dy) = (random_bf16(&mut rng, ET_MAX * EH, 1.0), random_bf16(&mut rng, ET_MAX * EH, 1.0));
        graph_io.load(&stream, &r, &counts, &x, &dy);
        graph.launch().unwrap();

        let what = format!("echo replay {i} ({kind:?}, T = {})", r.device_t);
        let mut want_echo = 0;
        if kind == Kind::BadIds {
            want_echo |= DeviceErrors::EXPERT_OUT_OF_RANGE; // those routes become -1
        }
        if kind == Kind::TokensPastMax {
            want_echo |= DeviceErrors::BAD_TOKENS;
        }
        let want_routing = if kind == Kind::TokensPastMax { flags::BAD_TOKENS } else { 0 };
        assert_eq!(
            graph_io.plan.read_errors(&stream, &graph_io.state).unwrap().0,
            want_echo,
            "{what}: Echo error word"
        );
        assert_eq!(word(&stream, &graph_io.moe.maps.flags), want_routing, "{what}: routing flag word");
        assert_eq!(word(&stream, &graph_io.moe.gemm_flags), 0, "{what}: GEMM flag word");
        assert_eq!(stream.clone_dtoh(&graph_io.slot_errors).unwrap()[0], 0, "{what}: fill / fold error word");
        if sampled(i) {
            eager_io.load(&stream, &r, &counts, &x, &dy);
            eager_io.run(&stream).unwrap();
            assert_eq!(
                eager_io.plan.read_errors(&stream, &eager_io.state).unwrap().0,
                want_echo,
                "{what}: eager Echo error word"
            );
            let got = graph_io.bits(&stream);
            assert_bits(&format!("{what}: graph vs eager"), &got, &eager_io.bits(&stream));
            let dest = &got[..ET_MAX * EK];
            assert!(dest[r.t * EK..].iter().all(|&c| c as i32 == -7777), "{what}: reroute wrote past T");
            let slot_cols: Vec<u32> = (0..s).map(|j| echo_config().slot_column(j) as u32).collect();
            moved += dest[..r.t * EK].iter().any(|c| slot_cols.contains(c)) as usize;
            compared += 1;
        }
        stable.after_replay(&stream, i);
    }
    println!(
        "echo + expert path: {} replays, {compared} compared with eager, {moved} of those moved routes to spare slots",
        replays()
    );
    assert!(moved >= compared / 10, "too few compared replays exercised the spare slots");
    stable.check();
}
