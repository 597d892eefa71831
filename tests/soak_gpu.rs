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
//! ids, nothing else); every adversarial replay and one random replay in 50 is also run
//! eagerly on a second, identical set of buffers and compared bit for bit (outputs, gradients,
//! reroute, rows past T still the poison). Wall time per 1000 replays, free device memory
//! (cuMemGetInfo) and the process's resident host memory are printed and must stay flat after
//! the first block (CAPMOE_SOAK_REPLAYS >= 3000: a warm-up block and two to compare).
//!
//! Ignored by default (minutes at 10 000 replays): `cargo test --release --test soak_gpu --
//! --ignored --nocapture` (in the bundle: `gpu-bundle/run/tests/soak_gpu --ignored
//! --nocapture --test-threads=1`). Skipped under compute-sanitizer (CAPMOE_SANITIZER=1).

mod common;

use std::sync::Arc;
use std::time::Instant;

use capturable_moe::echo::{Algorithm, DeviceErrors, EchoConfig};
use capturable_moe::graph::capture;
use capturable_moe::moe::{MoeConfig, MoeExperts, MoeOptions};
use capturable_moe::routing::{self, flags};
use common::echo_moe::EchoExpertPath;
use common::expert_io::{bits16, bits32, layer_config, ExpertIo};
use common::moe::{assert_bits, poison_bf16, poison_f32, random_bf16, Dims, POISON_BF16, POISON_F32};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn replays() -> usize {
    match std::env::var("CAPMOE_SOAK_REPLAYS") {
        Err(_) => 10_000,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 3000 => n,
            _ => panic!("CAPMOE_SOAK_REPLAYS={v:?}: need a whole number >= 3000 (three timing blocks to compare)"),
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

/// Compared with eager: every adversarial replay, and one random replay in 50 (i = 1, 51, ...:
/// every multiple of 25 is already an adversarial one).
fn sampled(i: usize) -> bool {
    i % 50 == 1 || kind_of(i) != Kind::Random
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

fn word(stream: &Arc<CudaStream>, v: &CudaSlice<i32>) -> i32 {
    stream.clone_dtoh(v).unwrap()[0]
}

/// Wall time per block of 1000 replays, free device memory and the process's resident host
/// memory at each block's end. The first block warms the allocator and driver caches (and the
/// driver's first-execution allocations), so every bound is against the blocks after it:
/// - time: the median of the later half of the blocks at most 1.25x the median of the earlier
///   half, plus 50 ms (a trend, not one outlier: a block is only a few hundred ms, and one host
///   stall must not fail a correct run);
/// - free device memory never below its reading after the first block by more than 16 MiB;
/// - resident host memory never above its reading after the first block by more than 64 MiB
///   (a leak of 8 KB a replay would pass that).
struct Stability {
    name: &'static str,
    block_start: Instant,
    block_ms: Vec<f64>,
    free_mb: Vec<f64>,
    resident_mb: Vec<f64>,
}

/// The process's resident set (`/proc/self/statm`, in 4 KiB pages on x86-64 Linux), in MiB.
fn resident_host_mb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: f64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("statm's resident field");
    pages * 4096.0 / (1 << 20) as f64
}

impl Stability {
    fn new(name: &'static str) -> Stability {
        Stability {
            name,
            block_start: Instant::now(),
            block_ms: Vec::new(),
            free_mb: Vec::new(),
            resident_mb: Vec::new(),
        }
    }

    fn after_replay(&mut self, stream: &Arc<CudaStream>, i: usize) {
        if (i + 1).is_multiple_of(1000) {
            stream.synchronize().unwrap();
            self.block_ms.push(self.block_start.elapsed().as_secs_f64() * 1e3);
            self.free_mb.push(common::free_device_bytes(stream) as f64 / (1 << 20) as f64);
            self.resident_mb.push(resident_host_mb());
            self.block_start = Instant::now();
        }
    }

    fn check(&self) {
        println!(
            "{}: ms per 1000 replays {:.0?}; free device MiB {:.1?}; resident host MiB {:.1?}",
            self.name, self.block_ms, self.free_mb, self.resident_mb
        );
        let highest = self.resident_mb.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert!(
            highest - self.resident_mb[0] <= 64.0,
            "{}: resident host memory grew from {:.1} to {highest:.1} MiB",
            self.name,
            self.resident_mb[0]
        );
        let warm = &self.block_ms[1..];
        let (earlier, later) = warm.split_at(warm.len() / 2);
        let (earlier, later) = (common::median(earlier), common::median(later));
        assert!(
            later <= 1.25 * earlier + 50.0,
            "{}: blocks of 1000 replays slowed from a median of {earlier:.0} ms to {later:.0} ms",
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
const EXPERT_DIMS: Dims = Dims { e: E, h: H, f: F, k: K };

fn expert_config() -> MoeConfig {
    MoeConfig { capacity: Some(CAP), ..layer_config(EXPERT_DIMS, T_MAX) }
}

/// One expert-path instance: its plan and buffers; the graph keeps their addresses.
struct ExpertRun {
    moe: MoeExperts<bf16>,
    io: ExpertIo,
}

impl ExpertRun {
    fn new(stream: &Arc<CudaStream>, w1: &[bf16], w2: &[bf16]) -> ExpertRun {
        ExpertRun {
            moe: MoeExperts::<bf16>::new(expert_config(), stream).unwrap(),
            io: ExpertIo::new(stream, EXPERT_DIMS, T_MAX, w1, w2),
        }
    }

    /// Inputs, poisoned token outputs (rows past T must keep the poison) and cleared flags.
    fn load(&mut self, stream: &Arc<CudaStream>, r: &Routes, x: &[bf16], dy: &[bf16]) {
        self.io.load_inputs(stream, r.device_t, &r.ids, &r.probs, x, dy);
        self.io.poison_token_outputs(stream);
        stream.memset_zeros(&mut self.moe.maps.flags).unwrap();
        stream.memset_zeros(&mut self.moe.gemm_flags).unwrap();
    }

    fn run(&mut self, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        self.io.step(&mut self.moe, stream)
    }
}

#[test]
#[ignore = "soak: 10 000 replays of two graphs (minutes); run with --ignored"]
fn soak_expert_path_graph_gpu() {
    if common::skip_under_sanitizer() {
        return;
    }
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    let mut rng = StdRng::seed_from_u64(19);
    let w1 = random_bf16(&mut rng, E * 2 * F * H, 1.0 / (H as f32).sqrt());
    let w2 = random_bf16(&mut rng, E * H * F, 1.0 / (F as f32).sqrt());
    let mut graph_io = ExpertRun::new(&stream, &w1, &w2);
    let mut eager_io = ExpertRun::new(&stream, &w1, &w2);
    let first = routes(&mut rng, Kind::Random, E, K, T_MAX);
    let (x, dy) = (random_bf16(&mut rng, T_MAX * H, 1.0), random_bf16(&mut rng, T_MAX * H, 1.0));
    graph_io.load(&stream, &first, &x, &dy);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.run(&stream)).unwrap();

    let mut stable = Stability::new("expert path");
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
            assert_bits(&format!("{what}: graph vs eager"), &graph_io.io.bits(&stream), &eager_io.io.bits(&stream));
            let y = stream.clone_dtoh(&graph_io.io.y).unwrap();
            assert!(y[..r.t * H].iter().all(|v| v.is_finite()), "{what}: y rows < T not all written");
            assert!(y[r.t * H..].iter().all(|v| v.to_bits() == POISON_BF16), "{what}: y written past T");
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

const ECHO_DIMS: Dims = Dims { e: EE, h: EH, f: EF, k: EK };

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

/// One Echo + expert path instance (as tests/echo_moe_gpu.rs, smaller, the GEMM kernels
/// the plan picks) holding the home weights `w1`, `w2`.
fn echo_path(stream: &Arc<CudaStream>, w1: &[bf16], w2: &[bf16]) -> EchoExpertPath {
    let mut io = EchoExpertPath::new(stream, &echo_config(), ECHO_DIMS, ET_MAX, MoeOptions::default().gemm_config);
    stream.memcpy_htod(w1, &mut io.w1).unwrap();
    stream.memcpy_htod(w2, &mut io.w2).unwrap();
    io
}

/// Inputs, poisoned outputs, zeroed gradients and cleared flag words.
fn load_echo(io: &mut EchoExpertPath, stream: &Arc<CudaStream>, r: &Routes, counts: &[i64], x: &[bf16], dy: &[bf16]) {
    stream.memcpy_htod(&[r.device_t], &mut io.tokens).unwrap();
    stream.memcpy_htod(counts, &mut io.counts).unwrap();
    stream.memcpy_htod(&r.ids, &mut io.ids).unwrap();
    stream.memcpy_htod(&r.probs, &mut io.probs).unwrap();
    stream.memcpy_htod(x, &mut io.x).unwrap();
    stream.memcpy_htod(dy, &mut io.dy).unwrap();
    stream.memcpy_htod(&poison_bf16(ET_MAX * EH), &mut io.y).unwrap();
    stream.memcpy_htod(&poison_bf16(ET_MAX * EH), &mut io.dx).unwrap();
    stream.memcpy_htod(&poison_f32(ET_MAX * EK), &mut io.dprobs).unwrap();
    stream.memcpy_htod(&vec![-7777i32; ET_MAX * EK], &mut io.dest).unwrap();
    // The reroute leaves rows past T unwritten: poisoned here, they compare equal between the
    // graph and the eager instance (which run different numbers of steps).
    stream.memcpy_htod(&poison_f32(ET_MAX * EK), &mut io.dest_probs).unwrap();
    stream.memset_zeros(&mut io.dw1).unwrap();
    stream.memset_zeros(&mut io.dw2).unwrap();
    stream.memset_zeros(&mut io.moe.maps.flags).unwrap();
    stream.memset_zeros(&mut io.moe.gemm_flags).unwrap();
    stream.memset_zeros(&mut io.slot_errors).unwrap();
}

/// Reroute, outputs and folded gradients as raw bits.
fn echo_bits(io: &EchoExpertPath, stream: &Arc<CudaStream>) -> Vec<u32> {
    let mut v: Vec<u32> = stream.clone_dtoh(&io.dest).unwrap().iter().map(|&c| c as u32).collect();
    v.extend(bits32(stream, &io.dest_probs));
    for b in [&io.y, &io.dx] {
        v.extend(bits16(stream, b).into_iter().map(u32::from));
    }
    for b in [&io.dprobs, &io.dw1, &io.dw2] {
        v.extend(bits32(stream, b));
    }
    v
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
    let _lock = common::capture_lock();
    let mut rng = StdRng::seed_from_u64(1919);
    let w1 = random_bf16(&mut rng, EE * W1, 1.0 / (EH as f32).sqrt());
    let w2 = random_bf16(&mut rng, EE * W2, 1.0 / (EF as f32).sqrt());
    let mut graph_io = echo_path(&stream, &w1, &w2);
    let mut eager_io = echo_path(&stream, &w1, &w2);
    let first = routes(&mut rng, Kind::Random, EE, EK, ET_MAX);
    let counts = echo_counts(&mut rng, &first, Kind::Random);
    let (x, dy) = (random_bf16(&mut rng, ET_MAX * EH, 1.0), random_bf16(&mut rng, ET_MAX * EH, 1.0));
    load_echo(&mut graph_io, &stream, &first, &counts, &x, &dy);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_io.run(&stream)).unwrap();

    let mut stable = Stability::new("echo + expert path");
    let (mut compared, mut moved) = (0, 0);
    let s = echo_config().num_spare();
    for i in 0..replays() {
        // Overflow does not apply (capacity = T_max * k): it runs as a full batch.
        let kind = kind_of(i);
        let r = routes(&mut rng, kind, EE, EK, ET_MAX);
        let counts = echo_counts(&mut rng, &r, kind);
        let (x, dy) = (random_bf16(&mut rng, ET_MAX * EH, 1.0), random_bf16(&mut rng, ET_MAX * EH, 1.0));
        load_echo(&mut graph_io, &stream, &r, &counts, &x, &dy);
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
            load_echo(&mut eager_io, &stream, &r, &counts, &x, &dy);
            eager_io.run(&stream).unwrap();
            assert_eq!(
                eager_io.plan.read_errors(&stream, &eager_io.state).unwrap().0,
                want_echo,
                "{what}: eager Echo error word"
            );
            let got = echo_bits(&graph_io, &stream);
            assert_bits(&format!("{what}: graph vs eager"), &got, &echo_bits(&eager_io, &stream));
            let dest = &got[..ET_MAX * EK];
            assert!(dest[r.t * EK..].iter().all(|&c| c as i32 == -7777), "{what}: reroute wrote past T");
            let dest_probs = &got[ET_MAX * EK..2 * ET_MAX * EK];
            assert!(dest_probs[r.t * EK..].iter().all(|&p| p == POISON_F32), "{what}: reroute wrote a prob past T");
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
