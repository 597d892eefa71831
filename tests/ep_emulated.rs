//! The EP kernels without a GPU: `csrc/ep/{dispatch,weights}.cu` compiled as host C++ against
//! the CPU emulation of `tests/emulation/` and run through their C ABI by
//! `tests/emulation/ep_driver.cpp`, every output compared bit for bit with
//! `capturable_moe::ep::reference` (status, flags word, every byte of every buffer: outputs
//! start poisoned and every buffer carries a poisoned guard tail, so a row never written, one
//! written that should not be, a write past the end or into an input all show). Every batch
//! runs with the threads of a block resumed first-to-last and last-to-first, which must agree.
//!
//! - `dispatch_kernels_match_the_reference`: random cases over R = 1, 2, 4, 8, Echo off / on
//!   (S_per 0..3), capacity 0 / tight (drops) / ample, T < T_max with junk routes past T, the
//!   token count on the host and on the device (in and out of range), bad dest and bad expert
//!   ids, slot maps with out-of-range entries; count_routes (flags given and NULL),
//!   dispatch_layout, gather_rows, reduce_rows (bf16, fp16) and gather_route_values.
//! - `reduce_rows_sums_in_fp32_in_ascending_j`, `dispatch_layout_keeps_the_first_routes_in_order`:
//!   hand-made cases that fail if the order, dropping or fp32 accumulation change.
//! - `spare_weight_kernels_match_the_reference`: pack / select / fold over R = 1..8, S_per 1..3,
//!   empty and bad slot experts, many slots on one expert (fold order), > 256 slots (chunks).
//! - `entry_points_reject_bad_arguments`: every status the host checks return, nothing written.
//! - `whole_step_matches_the_single_device_reference`: forward and backward of the EP step for
//!   R = 2 and 4 with and without Echo weights (see its doc).
//!
//! Needs a C++17 compiler (`CXX`, default `c++`). `CAPMOE_EMULATION_CXXFLAGS` adds compiler
//! flags (sanitizers), as for `echo_emulated`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use bytemuck::Pod;
use capturable_moe::dtype::DType;
use capturable_moe::ep::{flags, reference as r, EpConfig};
use capturable_moe::routing::reference::Scalar;
use capturable_moe::sys;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Poisoned elements after every buffer.
const GUARD: usize = 16;
const OK: i32 = sys::CAPMOE_OK as i32;
const INVALID: i32 = sys::CAPMOE_ERR_INVALID_ARGUMENT as i32;
const MISALIGNED: i32 = sys::CAPMOE_ERR_MISALIGNED as i32;
const UNSUPPORTED: i32 = sys::CAPMOE_ERR_UNSUPPORTED as i32;
/// A bit no EP flag uses, set in the flags word before every call: it must survive.
const FLAGS_BEFORE: i32 = 0x100;

// ------------------------------------------------------------------ driver plumbing

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Count = 0,
    Layout = 1,
    Gather = 2,
    Reduce = 3,
    Values = 4,
    Pack = 5,
    Select = 6,
    Fold = 7,
    CheckDesc = 8,
}

/// The token count of a call.
#[derive(Clone, Copy, Debug)]
enum Tok {
    Host(usize),
    /// On the device (may be out of range on purpose); the host value passed beside it is junk.
    Device(i32),
}

impl Tok {
    /// T and the flags resolving it sets.
    fn resolve(self, t_max: usize) -> (usize, i32) {
        match self {
            Tok::Host(t) => (t, 0),
            Tok::Device(v) => r::resolve_tokens(v, t_max),
        }
    }
}

/// One buffer argument: its bytes (guard included), its offset from a 16-byte boundary, or NULL.
#[derive(Clone, Debug)]
struct Buf {
    bytes: Vec<u8>,
    offset: usize,
    null: bool,
}

/// The poison of an element of `size` bytes: a NaN in bf16, fp16 and f32.
fn poison_bytes(size: usize) -> Vec<u8> {
    match size {
        2 => 0x7fa5u16.to_le_bytes().to_vec(),
        4 => 0x7fa5_a5a5u32.to_le_bytes().to_vec(),
        _ => 0x7fa5_a5a5_a5a5_a5a5u64.to_le_bytes().to_vec(),
    }
}

fn poison<T: Pod>() -> T {
    bytemuck::pod_read_unaligned(&poison_bytes(std::mem::size_of::<T>()))
}

/// `v` followed by the poisoned guard.
fn guarded<T: Pod>(v: &[T]) -> Vec<T> {
    let mut out = v.to_vec();
    out.extend(std::iter::repeat_n(poison::<T>(), GUARD));
    out
}

fn poisoned<T: Pod>(n: usize) -> Vec<T> {
    vec![poison::<T>(); n + GUARD]
}

fn buf<T: Pod>(v: &[T]) -> Buf {
    Buf { bytes: bytemuck::cast_slice(v).to_vec(), offset: 0, null: false }
}

#[derive(Clone, Debug)]
struct Call {
    name: String,
    op: Op,
    desc: [i64; 9],
    tokens: Tok,
    size: i64,
    flags: Option<i32>,
    bufs: Vec<Buf>,
}

#[derive(Clone, Debug, PartialEq)]
struct Outcome {
    status: i32,
    flags: i32,
    bufs: Vec<Vec<u8>>,
}

fn abi_dtype(d: DType) -> i64 {
    match d {
        DType::Bf16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
    }
}

fn desc_of(c: &EpConfig) -> [i64; 9] {
    let d = [c.ranks, c.rank, c.num_experts, c.spare_per_rank, c.hidden, c.topk, c.max_tokens, c.capacity];
    let mut out = [0i64; 9];
    d.iter().enumerate().for_each(|(i, &v)| out[i] = v as i64);
    out[8] = abi_dtype(c.dtype);
    out
}

impl Call {
    fn new(name: String, op: Op, c: &EpConfig, tokens: Tok, bufs: Vec<Buf>) -> Call {
        Call { name, op, desc: desc_of(c), tokens, size: 0, flags: Some(FLAGS_BEFORE), bufs }
    }

    fn put(&self, out: &mut Vec<u8>) {
        let (host, device, use_device) = match self.tokens {
            Tok::Host(t) => (t as i64, 0, 0),
            Tok::Device(v) => (-7, v as i64, 1),
        };
        let mut h = vec![self.op as i64];
        h.extend(self.desc);
        h.extend([host, device, use_device, self.size]);
        h.extend([self.flags.is_some() as i64, self.flags.unwrap_or(0) as i64, self.bufs.len() as i64]);
        out.extend_from_slice(bytemuck::cast_slice(&h));
        for b in &self.bufs {
            let len = if b.null { -1 } else { b.bytes.len() as i64 };
            out.extend_from_slice(bytemuck::cast_slice(&[len, b.offset as i64]));
            if !b.null {
                out.extend_from_slice(&b.bytes);
            }
        }
    }

    /// What a call that is rejected (or a no-op) returns: `status`, nothing written.
    fn unchanged(&self, status: i32) -> Outcome {
        Outcome {
            status,
            flags: self.flags.unwrap_or(0),
            bufs: self.bufs.iter().map(|b| if b.null { Vec::new() } else { b.bytes.clone() }).collect(),
        }
    }
}

fn parse(output: &[u8], calls: &[Call]) -> Vec<Outcome> {
    let mut at = 0;
    let mut take = |n: usize| {
        let s = output[at..at + n].to_vec();
        at += n;
        s
    };
    let outcomes = calls
        .iter()
        .map(|c| {
            let status = i32::from_le_bytes(take(4).try_into().unwrap());
            let flags = i32::from_le_bytes(take(4).try_into().unwrap());
            let bufs = c.bufs.iter().map(|b| take(if b.null { 0 } else { b.bytes.len() })).collect();
            Outcome { status, flags, bufs }
        })
        .collect();
    assert_eq!(at, output.len(), "the driver wrote more than the calls asked for");
    outcomes
}

fn driver() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        common::emulation::build(
            "ep_emulator",
            &["csrc/ep/dispatch.cu", "csrc/ep/weights.cu"],
            "tests/emulation/ep_driver.cpp",
        )
    })
}

/// Runs `calls` under the emulation in both thread orders; they must agree bit for bit.
fn run(calls: &[Call]) -> Vec<Outcome> {
    static BATCH: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let id = BATCH.fetch_add(1, Ordering::Relaxed);
    let input = dir.join(format!("ep_{}_{id}_cases.bin", std::process::id()));
    let mut bytes = Vec::new();
    calls.iter().for_each(|c| c.put(&mut bytes));
    std::fs::write(&input, bytes).unwrap();
    let mut results: Vec<Vec<Outcome>> = Vec::new();
    for order in common::emulation::THREAD_ORDERS {
        let output = dir.join(format!("ep_{}_{id}_{order}.bin", std::process::id()));
        let report = common::emulation::run(driver(), &[&input, &output], order);
        assert_eq!(report.trim(), format!("{} cases", calls.len()), "the driver did not read every call ({order})");
        results.push(parse(&std::fs::read(&output).unwrap(), calls));
    }
    for (i, c) in calls.iter().enumerate() {
        assert!(results[0][i] == results[1][i], "{}: forward and reverse thread orders disagree", c.name);
    }
    results.swap_remove(0)
}

/// Names of the buffers of each op, for messages.
fn buffer_names(op: Op) -> &'static [&'static str] {
    match op {
        Op::Count => &["expert_ids", "counts"],
        Op::Layout => {
            &["dest", "probs", "slot_of_route", "send_ids", "send_probs", "send_counts", "dropped", "chunk_counts"]
        }
        Op::Gather => &["x", "slot_of_route", "rows"],
        Op::Reduce => &["rows", "slot_of_route", "y"],
        Op::Values => &["values", "slot_of_route", "out"],
        Op::Pack => &["slot_expert", "home", "send"],
        Op::Select => &["slot_expert", "recv", "spare"],
        Op::Fold => &["slot_expert", "recv", "dw_home"],
        Op::CheckDesc => &[],
    }
}

/// Element size of each buffer of an op (for messages); 2 for activations.
fn element_size(op: Op, i: usize) -> usize {
    match (op, i) {
        (Op::Count, 1) => 8,
        (Op::Gather, 0 | 2) | (Op::Reduce, 0 | 2) => 2,
        (Op::Pack | Op::Select | Op::Fold, 0) => 8,
        (Op::Pack | Op::Select, _) => 2,
        _ => 4,
    }
}

fn check(call: &Call, got: &Outcome, want: &Outcome) {
    let what = &call.name;
    assert_eq!(got.status, want.status, "{what}: status");
    assert_eq!(got.flags, want.flags, "{what}: flags word {:#x}, expected {:#x}", got.flags, want.flags);
    for (i, (g, w)) in got.bufs.iter().zip(&want.bufs).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: buffer {i} length");
        if let Some(at) = (0..g.len()).find(|&b| g[b] != w[b]) {
            let size = element_size(call.op, i);
            let e = at / size;
            let element = |v: &[u8]| format!("{:02x?}", &v[e * size..(e * size + size).min(v.len())]);
            panic!(
                "{what}: {} element {e} (of {} with the guard): got {}, expected {}",
                buffer_names(call.op).get(i).unwrap_or(&"buffer"),
                g.len() / size,
                element(g),
                element(w)
            );
        }
    }
}

fn run_and_check(cases: Vec<(Call, Outcome)>) -> usize {
    let calls: Vec<Call> = cases.iter().map(|(c, _)| c.clone()).collect();
    let got = run(&calls);
    for ((call, want), got) in cases.iter().zip(&got) {
        check(call, got, want);
    }
    cases.len()
}

fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

// ------------------------------------------------------------------ random dispatch cases

/// One rank's routing for the dispatch kernels.
struct Routing {
    name: String,
    cfg: EpConfig,
    tokens: Tok,
    expert_ids: Vec<i32>,
    dest: Vec<i32>,
    probs: Vec<f32>,
}

/// A value of fp32 with a magnitude spread over 2^-10 .. 2^10, so the order and precision of a
/// sum show in the result.
fn spread(rng: &mut StdRng) -> f32 {
    rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-10..10))
}

/// `large`: more routes than one chunk of dispatch_layout's scan (several chunks of 1024).
fn random_config(rng: &mut StdRng, ranks: usize, echo: bool, dtype: DType, large: bool) -> EpConfig {
    let local = rng.random_range(1..=4);
    let topk = if large {
        16
    } else if rng.random_bool(0.1) {
        32
    } else {
        rng.random_range(1..=6)
    };
    EpConfig {
        ranks,
        rank: rng.random_range(0..ranks),
        num_experts: ranks * local,
        spare_per_rank: if echo { rng.random_range(1..=3) } else { 0 },
        hidden: 8 * rng.random_range(1..=5),
        topk,
        max_tokens: if large { rng.random_range(400..=700) } else { rng.random_range(0..=24) },
        capacity: 0,
        dtype,
    }
}

fn random_routing(rng: &mut StdRng, n: usize, ranks: usize, echo: bool, dtype: DType) -> Routing {
    let mut cfg = random_config(rng, ranks, echo, dtype, n % 12 == 10);
    if n % 16 == 5 {
        cfg.max_tokens = 0; // nothing to route: every output still written in full
    }
    let routes = cfg.routes_len();
    let t =
        if cfg.max_tokens == 0 || rng.random_bool(0.3) { cfg.max_tokens } else { rng.random_range(0..cfg.max_tokens) };
    // capacity 0, tight (drops likely), ample (no drop)
    let per_peer = (routes / ranks).max(1);
    cfg.capacity = match n % 3 {
        0 if n.is_multiple_of(6) => 0,
        0 | 1 => rng.random_range(1..=per_peer.div_ceil(2)),
        _ => routes,
    };
    let tokens = match n % 4 {
        0 | 1 => Tok::Host(t),
        2 => Tok::Device(t as i32),
        _ => Tok::Device(*[-3, cfg.max_tokens as i32 + 5, i32::MIN, i32::MAX].get(n / 4 % 4).unwrap()),
    };
    let cols = (ranks * cfg.cols_per_rank()) as i32;
    let e = cfg.num_experts as i32;
    let bad = n.is_multiple_of(5);
    let pick = |rng: &mut StdRng, limit: i32| -> i32 {
        let x: f64 = rng.random();
        if x < 0.1 {
            -1
        } else if bad && x < 0.2 {
            *[limit, limit + 7, -2, i32::MIN, i32::MAX].get(rng.random_range(0..5)).unwrap()
        } else {
            rng.random_range(0..limit)
        }
    };
    let expert_ids = (0..routes).map(|_| pick(rng, e)).collect();
    let dest = (0..routes).map(|_| pick(rng, cols)).collect();
    let probs = (0..routes).map(|_| spread(rng)).collect();
    let name = format!("case {n} ({cfg:?}, {tokens:?})");
    Routing { name, cfg, tokens, expert_ids, dest, probs }
}

fn count_case(rt: &Routing, with_flags: bool) -> (Call, Outcome) {
    let c = &rt.cfg;
    let (t, tok_flag) = rt.tokens.resolve(c.max_tokens);
    let (counts, bits) = r::count_routes(c, &rt.expert_ids, t);
    let mut call = Call::new(
        format!("count_routes {}{}", rt.name, if with_flags { "" } else { ", flags NULL" }),
        Op::Count,
        c,
        rt.tokens,
        vec![buf(&guarded(&rt.expert_ids)), buf(&poisoned::<i64>(c.num_experts))],
    );
    if !with_flags {
        call.flags = None;
    }
    let flags = if with_flags { FLAGS_BEFORE | tok_flag | bits } else { 0 };
    let want = Outcome { status: OK, flags, bufs: vec![call.bufs[0].bytes.clone(), bytes(&guarded(&counts))] };
    (call, want)
}

/// Chunks of the dispatch layout's scan for `c` (the C ABI's capmoe_ep_layout_chunks).
fn layout_chunks(c: &EpConfig) -> usize {
    c.routes_len().div_ceil(sys::CAPMOE_EP_LAYOUT_CHUNK as usize).max(1)
}

/// The layout's workspace after it ran: routes of each chunk (t < T) per peer of their final
/// column (dest outside the column space counts nowhere); left as it was (poisoned here) when
/// one chunk holds every route, since the layout then skips its counting launch.
fn chunk_counts(c: &EpConfig, dest: &[i32], t: usize) -> Vec<i32> {
    if layout_chunks(c) == 1 {
        return vec![poison::<i32>(); c.ranks];
    }
    let chunk = sys::CAPMOE_EP_LAYOUT_CHUNK as usize;
    let cols = (c.ranks * c.cols_per_rank()) as i32;
    let mut counts = vec![0i32; layout_chunks(c) * c.ranks];
    for (r, &col) in dest.iter().enumerate().take(t * c.topk) {
        if (0..cols).contains(&col) {
            counts[(r / chunk) * c.ranks + col as usize / c.cols_per_rank()] += 1;
        }
    }
    counts
}

fn layout_case(rt: &Routing) -> (Call, Outcome, Vec<i32>) {
    let c = &rt.cfg;
    let (t, tok_flag) = rt.tokens.resolve(c.max_tokens);
    let l = r::dispatch_layout(c, &rt.dest, &rt.probs, t);
    let rows = c.block_rows();
    let call = Call::new(
        format!("dispatch_layout {}", rt.name),
        Op::Layout,
        c,
        rt.tokens,
        vec![
            buf(&guarded(&rt.dest)),
            buf(&guarded(&rt.probs)),
            buf(&poisoned::<i32>(c.routes_len())),
            buf(&poisoned::<i32>(rows)),
            buf(&poisoned::<f32>(rows)),
            buf(&poisoned::<i32>(c.ranks)),
            buf(&poisoned::<i32>(c.ranks)),
            buf(&poisoned::<i32>(layout_chunks(c) * c.ranks)),
        ],
    );
    let want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE | tok_flag | l.flags,
        bufs: vec![
            call.bufs[0].bytes.clone(),
            call.bufs[1].bytes.clone(),
            bytes(&guarded(&l.slot_of_route)),
            bytes(&guarded(&l.send_ids)),
            bytes(&guarded(&l.send_probs)),
            bytes(&guarded(&l.send_counts)),
            bytes(&guarded(&l.dropped)),
            bytes(&guarded(&chunk_counts(c, &rt.dest, t))),
        ],
    };
    (call, want, l.slot_of_route)
}

/// A slot map for the row kernels: the layout's, with junk in-range slots on routes past T
/// (must be ignored) and, in some cases, out-of-range entries (must be skipped).
fn row_map(rng: &mut StdRng, rt: &Routing, layout_map: &[i32], corrupt: bool) -> Vec<i32> {
    let c = &rt.cfg;
    let (t, _) = rt.tokens.resolve(c.max_tokens);
    let rows = c.block_rows() as i32;
    let mut map = layout_map.to_vec();
    for (i, s) in map.iter_mut().enumerate() {
        if i >= t * c.topk && rows > 0 {
            *s = rng.random_range(0..rows);
        } else if corrupt && *s == -1 && rng.random_bool(0.5) {
            *s = *[rows, rows + 3, -2, i32::MIN, i32::MAX].get(rng.random_range(0..5)).unwrap();
        }
    }
    map
}

fn row_cases<T: Scalar + Pod>(rng: &mut StdRng, rt: &Routing, map: &[i32]) -> Vec<(Call, Outcome)> {
    let c = &rt.cfg;
    let (t, _) = rt.tokens.resolve(c.max_tokens);
    let (h, rows) = (c.hidden, c.block_rows());
    let x: Vec<T> = (0..c.tokens_len()).map(|_| T::from_f32(spread(rng))).collect();
    let block: Vec<T> = (0..rows * h).map(|_| T::from_f32(spread(rng))).collect();
    let values: Vec<f32> = (0..rows).map(|_| spread(rng)).collect();

    let gather = Call::new(
        format!("gather_rows {}", rt.name),
        Op::Gather,
        c,
        rt.tokens,
        vec![buf(&guarded(&x)), buf(&guarded(map)), buf(&poisoned::<T>(rows * h))],
    );
    let mut rows_out = poisoned::<T>(rows * h);
    r::gather_rows(c, &x, map, t, &mut rows_out);
    let gather_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE,
        bufs: vec![gather.bufs[0].bytes.clone(), gather.bufs[1].bytes.clone(), bytes(&rows_out)],
    };

    let reduce = Call::new(
        format!("reduce_rows {}", rt.name),
        Op::Reduce,
        c,
        rt.tokens,
        vec![buf(&guarded(&block)), buf(&guarded(map)), buf(&poisoned::<T>(c.tokens_len()))],
    );
    let mut y = poisoned::<T>(c.tokens_len());
    r::reduce_rows(c, &block, map, t, &mut y);
    let reduce_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE,
        bufs: vec![reduce.bufs[0].bytes.clone(), reduce.bufs[1].bytes.clone(), bytes(&y)],
    };

    let gv = Call::new(
        format!("gather_route_values {}", rt.name),
        Op::Values,
        c,
        rt.tokens,
        vec![buf(&guarded(&values)), buf(&guarded(map)), buf(&poisoned::<f32>(c.routes_len()))],
    );
    let mut out = poisoned::<f32>(c.routes_len());
    r::gather_route_values(c, &values, map, t, &mut out);
    let gv_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE,
        bufs: vec![gv.bufs[0].bytes.clone(), gv.bufs[1].bytes.clone(), bytes(&out)],
    };
    vec![(gather, gather_want), (reduce, reduce_want), (gv, gv_want)]
}

#[test]
fn dispatch_kernels_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(17);
    let mut cases = Vec::new();
    let mut n = 0;
    let (mut dropping, mut bad_dest, mut bad_tokens, mut chunks) = (0, 0, 0, 0);
    for ranks in [1, 2, 4, 8] {
        for echo in [false, true] {
            for _ in 0..6 {
                let dtype = if n % 2 == 0 { DType::Bf16 } else { DType::F16 };
                let rt = random_routing(&mut rng, n, ranks, echo, dtype);
                cases.push(count_case(&rt, true));
                cases.push(count_case(&rt, false));
                let (call, want, map) = layout_case(&rt);
                dropping += (want.flags & flags::OVERFLOW != 0) as usize;
                bad_dest += (want.flags & flags::BAD_DEST != 0) as usize;
                bad_tokens += (want.flags & flags::BAD_TOKENS != 0) as usize;
                chunks += (rt.cfg.routes_len() > 2 * 4096 && want.flags & flags::OVERFLOW != 0) as usize;
                cases.push((call, want));
                let map = row_map(&mut rng, &rt, &map, n % 3 == 0);
                if dtype == DType::Bf16 {
                    cases.extend(row_cases::<bf16>(&mut rng, &rt, &map));
                } else {
                    cases.extend(row_cases::<f16>(&mut rng, &rt, &map));
                }
                n += 1;
            }
        }
    }
    // E past the shared-memory histogram of count_routes (global atomics).
    let mut rt = random_routing(&mut rng, 1, 2, false, DType::Bf16);
    rt.cfg.num_experts = 2 * 8192;
    rt.expert_ids = rt.expert_ids.iter().map(|&e| if e >= 0 { rng.random_range(0..16384) } else { e }).collect();
    rt.name = format!("E = 16384 {}", rt.name);
    cases.push(count_case(&rt, true));
    // The generator must reach what the test claims to cover.
    assert!(
        dropping >= 5 && bad_dest >= 3 && bad_tokens >= 3 && chunks >= 2,
        "coverage: {dropping} {bad_dest} {bad_tokens} {chunks}"
    );
    let count = run_and_check(cases);
    println!("{count} calls match the reference in both thread orders");
}

/// A token whose routes' rows hold 0.5, 3, -2^24, 3, 2^24: the fp32 sum in ascending j is 7;
/// in reverse j it is 7.5, in slot order 8, rounding to bf16 between adds gives 0.
#[test]
fn reduce_rows_sums_in_fp32_in_ascending_j() {
    let cfg = EpConfig {
        ranks: 2,
        rank: 0,
        num_experts: 2,
        spare_per_rank: 0,
        hidden: 8,
        topk: 5,
        max_tokens: 1,
        capacity: 3,
        dtype: DType::Bf16,
    };
    let row_values = [0.5, 3.0, -(2f32.powi(24)), 3.0, 2f32.powi(24)];
    // Route j's row: spread over both peer blocks, not in j order.
    let map = [4i32, 0, 3, 2, 5];
    let mut block = vec![bf16::ZERO; cfg.rows_len()];
    for (j, &s) in map.iter().enumerate() {
        block[s as usize * 8..(s as usize + 1) * 8].fill(bf16::from_f32(row_values[j]));
    }
    let mut y = poisoned::<bf16>(8);
    r::reduce_rows(&cfg, &block, &map, 1, &mut y);
    assert_eq!(y[0].to_f32(), 7.0, "the reference itself");
    let call = Call::new(
        "reduce_rows order / precision".into(),
        Op::Reduce,
        &cfg,
        Tok::Host(1),
        vec![buf(&guarded(&block)), buf(&guarded(&map)), buf(&poisoned::<bf16>(8))],
    );
    let want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE,
        bufs: vec![call.bufs[0].bytes.clone(), call.bufs[1].bytes.clone(), bytes(&y)],
    };
    run_and_check(vec![(call, want)]);
}

/// 3 ranks' worth of routes to peer 1 with capacity 2: the first two in (t, j) order are kept,
/// in that order, the rest dropped; a hand-written expectation, independent of the reference.
#[test]
fn dispatch_layout_keeps_the_first_routes_in_order() {
    let cfg = EpConfig {
        ranks: 2,
        rank: 1,
        num_experts: 4,
        spare_per_rank: 1,
        hidden: 8,
        topk: 2,
        max_tokens: 3,
        capacity: 2,
        dtype: DType::Bf16,
    };
    // cols_per_rank 3: columns 0..3 on peer 0, 3..6 on peer 1.
    let dest = [5, 0, 3, 4, -1, 4];
    let probs = [0.5, 0.25, 0.75, 1.0, 2.0, 4.0];
    let rt = Routing {
        name: "order".into(),
        cfg: cfg.clone(),
        tokens: Tok::Host(3),
        expert_ids: vec![0; 6],
        dest: dest.to_vec(),
        probs: probs.to_vec(),
    };
    let (call, want, _) = layout_case(&rt);
    let expect = |v: &[i32]| bytes(&guarded(v));
    assert_eq!(want.bufs[2], expect(&[2, 0, 3, -1, -1, -1]), "slot_of_route");
    assert_eq!(want.bufs[3], expect(&[0, -1, 2, 0]), "send_ids");
    assert_eq!(want.bufs[4], bytes(&guarded(&[0.25f32, 0.0, 0.5, 0.75])), "send_probs");
    assert_eq!(want.bufs[5], expect(&[1, 2]), "send_counts");
    assert_eq!(want.bufs[6], expect(&[0, 2]), "dropped");
    assert_eq!(want.flags, FLAGS_BEFORE | flags::OVERFLOW);
    run_and_check(vec![(call, want)]);
}

// ------------------------------------------------------------------ spare weights

fn weight_config(rng: &mut StdRng, ranks: usize, spare: usize) -> EpConfig {
    let local = rng.random_range(1..=3);
    EpConfig {
        ranks,
        rank: rng.random_range(0..ranks),
        num_experts: ranks * local,
        spare_per_rank: spare,
        hidden: 8,
        topk: 1,
        max_tokens: 1,
        capacity: 1,
        dtype: DType::Bf16,
    }
}

fn slot_table(rng: &mut StdRng, c: &EpConfig, bad: bool) -> Vec<i64> {
    (0..c.global_slots())
        .map(|_| {
            let x: f64 = rng.random();
            if x < 0.2 {
                -1
            } else if bad && x < 0.3 {
                *[c.num_experts as i64, -2, i64::MIN, i64::MAX, 1 << 40].get(rng.random_range(0..5)).unwrap()
            } else {
                rng.random_range(0..c.num_experts as i64)
            }
        })
        .collect()
}

fn weight_cases(rng: &mut StdRng, c: &EpConfig, slots: &[i64], per: usize) -> Vec<(Call, Outcome)> {
    let name = |op: &str| format!("{op} ({c:?}, slots {slots:?}, {per} per expert)");
    let (l, g, s) = (c.local_experts(), c.global_slots(), c.spare_per_rank);
    let w = |rng: &mut StdRng, n: usize| -> Vec<bf16> { (0..n).map(|_| bf16::from_f32(spread(rng))).collect() };

    let home = w(rng, l * per);
    let mut send = poisoned::<bf16>(g * per);
    let pack_bits = r::pack_spare_weights(c, slots, &home, per, &mut send);
    let mut pack = Call::new(
        name("pack"),
        Op::Pack,
        c,
        Tok::Host(0),
        vec![buf(&guarded(slots)), buf(&guarded(&home)), buf(&poisoned::<bf16>(g * per))],
    );
    pack.size = (per * 2) as i64;
    let pack_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE | pack_bits,
        bufs: vec![pack.bufs[0].bytes.clone(), pack.bufs[1].bytes.clone(), bytes(&send)],
    };

    let recv = w(rng, g * per);
    let mut spare = poisoned::<bf16>(s * per);
    let select_bits = r::select_spare_weights(c, slots, &recv, per, &mut spare);
    let mut select = Call::new(
        name("select"),
        Op::Select,
        c,
        Tok::Host(0),
        vec![buf(&guarded(slots)), buf(&guarded(&recv)), buf(&poisoned::<bf16>(s * per))],
    );
    select.size = (per * 2) as i64;
    let select_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE | select_bits,
        bufs: vec![select.bufs[0].bytes.clone(), select.bufs[1].bytes.clone(), bytes(&spare)],
    };

    let per4 = per / 2; // f32 elements: the same bytes per expert
    let grads: Vec<f32> = (0..g * per4).map(|_| spread(rng)).collect();
    let dw: Vec<f32> = (0..l * per4).map(|_| spread(rng)).collect();
    let mut dw_want = guarded(&dw);
    let fold_bits = r::fold_spare_grads(c, slots, &grads, per4, &mut dw_want);
    let mut fold = Call::new(
        name("fold"),
        Op::Fold,
        c,
        Tok::Host(0),
        vec![buf(&guarded(slots)), buf(&guarded(&grads)), buf(&guarded(&dw))],
    );
    fold.size = per4 as i64;
    let fold_want = Outcome {
        status: OK,
        flags: FLAGS_BEFORE | fold_bits,
        bufs: vec![fold.bufs[0].bytes.clone(), fold.bufs[1].bytes.clone(), bytes(&dw_want)],
    };
    vec![(pack, pack_want), (select, select_want), (fold, fold_want)]
}

#[test]
fn spare_weight_kernels_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(1717);
    let mut cases = Vec::new();
    for ranks in [1, 2, 4, 8] {
        for spare in 1..=3 {
            for (i, per) in [8usize, 24, 136].into_iter().enumerate() {
                let c = weight_config(&mut rng, ranks, spare);
                let slots = slot_table(&mut rng, &c, i == 1);
                cases.extend(weight_cases(&mut rng, &c, &slots, per));
            }
        }
    }
    // Every slot on one home expert of this rank (fold order over 24 slots), and > 256 slots
    // (the fold's chunks), with a home expert's slots in several chunks.
    let mut c = weight_config(&mut rng, 8, 3);
    c.rank = 2;
    let e = (2 * c.local_experts()) as i64;
    cases.extend(weight_cases(&mut rng, &c, &[e; 24], 8));
    let c = EpConfig { ranks: 8, rank: 5, num_experts: 16, spare_per_rank: 40, ..weight_config(&mut rng, 8, 1) };
    let slots: Vec<i64> = (0..320).map(|j| if j % 7 == 0 { 10 } else { rng.random_range(-1..16) }).collect();
    cases.extend(weight_cases(&mut rng, &c, &slots, 16));
    // Grid-stride over the elements: more than 1024 blocks of 256 threads per expert.
    let c = EpConfig { ranks: 2, rank: 1, num_experts: 2, spare_per_rank: 1, ..weight_config(&mut rng, 2, 1) };
    cases.extend(weight_cases(&mut rng, &c, &[1, 1], 8 * (262_144 + 8)));
    let count = run_and_check(cases);
    println!("{count} calls match the reference in both thread orders");
}

// ------------------------------------------------------------------ rejected arguments

/// `valid` changed by `change`: returns `status` and writes nothing.
fn rejected(valid: &Call, what: &str, status: i32, change: impl FnOnce(&mut Call)) -> (Call, Outcome) {
    let mut c = valid.clone();
    c.name = format!("{} {:?}: {what}", c.name.split(' ').next().unwrap(), c.op);
    change(&mut c);
    let want = c.unchanged(status);
    (c, want)
}

fn valid_calls() -> Vec<Call> {
    let mut rng = StdRng::seed_from_u64(4);
    let cfg = EpConfig {
        ranks: 2,
        rank: 1,
        num_experts: 4,
        spare_per_rank: 1,
        hidden: 16,
        topk: 2,
        max_tokens: 5,
        capacity: 4,
        dtype: DType::Bf16,
    };
    let ids: Vec<i32> = (0..10).map(|i| i % 4).collect();
    let dest: Vec<i32> = (0..10).map(|i| i % 6).collect();
    let rt = Routing {
        name: "valid".into(),
        cfg: cfg.clone(),
        tokens: Tok::Host(4),
        expert_ids: ids,
        dest,
        probs: vec![0.5; 10],
    };
    let mut calls = vec![count_case(&rt, true).0];
    let (layout, _, map) = layout_case(&rt);
    calls.push(layout);
    calls.extend(row_cases::<bf16>(&mut rng, &rt, &map).into_iter().map(|(c, _)| c));
    calls.extend(weight_cases(&mut rng, &cfg, &[0, 3], 8).into_iter().map(|(c, _)| c));
    calls
}

#[test]
fn entry_points_reject_bad_arguments() {
    let valid = valid_calls();
    let mut cases = Vec::new();
    // The descriptor, through capmoe_ep_check_desc.
    let check_desc = Call { name: "check_desc".into(), op: Op::CheckDesc, bufs: vec![], ..valid[0].clone() };
    cases.push((check_desc.clone(), check_desc.unchanged(OK)));
    let desc_cases: [(&str, usize, i64, i32); 18] = [
        ("ranks 0", 0, 0, INVALID),
        ("ranks 1025", 0, 1025, INVALID),
        ("rank = ranks", 1, 2, INVALID),
        ("rank -1", 1, -1, INVALID),
        ("no experts", 2, 0, INVALID),
        ("E not a multiple of R", 2, 5, INVALID),
        ("S_per -1", 3, -1, INVALID),
        ("columns past int32", 3, 1 << 30, INVALID),
        ("hidden 0", 4, 0, INVALID),
        ("hidden 12", 4, 12, MISALIGNED),
        ("topk 0", 5, 0, INVALID),
        ("topk 33", 5, 33, INVALID),
        ("T_max -1", 6, -1, INVALID),
        ("T_max * k past int32", 6, 1 << 30, INVALID),
        ("capacity -1", 7, -1, INVALID),
        ("R * capacity past int32", 7, 1 << 30, INVALID),
        ("dtype F32", 8, 2, UNSUPPORTED),
        ("dtype 9", 8, 9, UNSUPPORTED),
    ];
    for (what, field, value, status) in desc_cases {
        cases.push(rejected(&check_desc, what, status, |c| c.desc[field] = value));
    }
    // Every entry point checks the descriptor.
    for v in &valid {
        cases.push(rejected(v, "bad descriptor", INVALID, |c| c.desc[2] = 3));
        cases.push(rejected(v, "dtype F32", UNSUPPORTED, |c| c.desc[8] = 2));
    }
    let [count, layout, gather, reduce, values, pack, select, fold] = &valid[..] else {
        panic!("{} calls", valid.len())
    };
    for v in [count, layout, gather, reduce, values] {
        cases.push(rejected(v, "host T > T_max", INVALID, |c| c.tokens = Tok::Host(6)));
        cases.push(rejected(v, "NULL route array", INVALID, |c| {
            c.bufs[if v.op == Op::Layout { 0 } else { 1 - (v.op == Op::Count) as usize }].null = true
        }));
    }
    let null = |i: usize| move |c: &mut Call| c.bufs[i].null = true;
    let shift = |i: usize, by: usize| move |c: &mut Call| c.bufs[i].offset = by;
    cases.push(rejected(count, "NULL counts", INVALID, null(1)));
    cases.push(rejected(count, "counts off 8-byte alignment", MISALIGNED, shift(1, 4)));
    cases.push(rejected(count, "expert_ids off 4-byte alignment", MISALIGNED, shift(0, 2)));
    for (i, name) in [
        (1, "probs"),
        (2, "slot_of_route"),
        (3, "send_ids"),
        (4, "send_probs"),
        (5, "send_counts"),
        (6, "dropped"),
        (7, "chunk_counts"),
    ] {
        cases.push(rejected(layout, &format!("NULL {name}"), INVALID, null(i)));
        cases.push(rejected(layout, &format!("{name} misaligned"), MISALIGNED, shift(i, 2)));
    }
    cases.push(rejected(layout, "NULL flags", INVALID, |c| c.flags = None));
    for v in [gather, reduce] {
        cases.push(rejected(v, "NULL rows", INVALID, null(if v.op == Op::Gather { 2 } else { 0 })));
        cases.push(rejected(v, "NULL tokens buffer", INVALID, null(if v.op == Op::Gather { 0 } else { 2 })));
        for i in [0, 2] {
            cases.push(rejected(v, &format!("buffer {i} off 16-byte alignment"), MISALIGNED, shift(i, 8)));
        }
    }
    cases.push(rejected(values, "NULL values", INVALID, null(0)));
    cases.push(rejected(values, "NULL out", INVALID, null(2)));
    cases.push(rejected(values, "out misaligned", MISALIGNED, shift(2, 2)));
    for v in [pack, select, fold] {
        let elem = if v.op == Op::Fold { 4 } else { 1 };
        cases.push(rejected(v, "no Echo (S_per 0)", INVALID, |c| c.desc[3] = 0));
        cases.push(rejected(v, "size not a multiple of 16 bytes", MISALIGNED, |c| c.size = 8 / elem));
        cases.push(rejected(v, "negative size", INVALID, |c| c.size = -16 / elem));
        cases.push(rejected(v, "size 0 (a no-op)", OK, |c| c.size = 0));
        cases.push(rejected(v, "2 experts of 2^62 bytes: past int64", INVALID, |c| c.size = (1i64 << 62) / elem));
        if v.op == Op::Fold {
            cases.push(rejected(v, "per_expert * 4 past int64", INVALID, |c| c.size = i64::MAX / 2));
        }
        cases.push(rejected(v, "NULL flags", INVALID, |c| c.flags = None));
        for i in 0..3 {
            cases.push(rejected(v, &format!("NULL buffer {i}"), INVALID, null(i)));
            cases.push(rejected(v, &format!("buffer {i} misaligned"), MISALIGNED, shift(i, 4)));
        }
    }
    let count = run_and_check(cases);
    println!("{count} rejected calls return their status and write nothing");
}

// ------------------------------------------------------------------ the whole step

/// Element `i` of a buffer of `n` elements of T as the driver returned it (guard dropped).
fn typed<T: Pod>(bytes: &[u8], n: usize) -> Vec<T> {
    bytemuck::pod_collect_to_vec(&bytes[..n * std::mem::size_of::<T>()])
}

/// Runs one stage: every call must succeed; returns the outcomes.
fn stage(calls: Vec<Call>) -> Vec<Outcome> {
    let outcomes = run(&calls);
    for (c, o) in calls.iter().zip(&outcomes) {
        assert_eq!(o.status, OK, "{}: status", c.name);
    }
    outcomes
}

/// One rank of the simulated EP group.
struct Rank {
    cfg: EpConfig,
    tokens: Tok,
    t: usize,
    x: Vec<f16>,
    ids: Vec<i32>,
    probs: Vec<f32>,
    dest: Vec<i32>,
    dy: Vec<f16>,
}

/// A small integer in [-lim, lim] (as f16): every product and sum of the step is exact.
fn small(rng: &mut StdRng, lim: i32) -> f16 {
    f16::from_f32(rng.random_range(-lim..=lim) as f32)
}

/// `p * (W x)` of an [H, H] matrix, exact in f32 for the small integers used, rounded to f16.
fn expert_forward(w: &[f16], x: &[f16], p: f32) -> Vec<f16> {
    let h = x.len();
    (0..h).map(|o| f16::from_f32(p * (0..h).map(|i| w[o * h + i].to_f32() * x[i].to_f32()).sum::<f32>())).collect()
}

/// `W x` in f32.
fn matvec(w: &[f16], x: &[f16]) -> Vec<f32> {
    let h = x.len();
    (0..h).map(|o| (0..h).map(|i| w[o * h + i].to_f32() * x[i].to_f32()).sum()).collect()
}

/// The backward of `p * (W x)`: `dx = p W^T dy` (f16), `dp = <dy, W x>`, `dW += p dy x^T`.
fn expert_backward(w: &[f16], x: &[f16], dy: &[f16], p: f32, dw: &mut [f32]) -> (Vec<f16>, f32) {
    let h = x.len();
    let dx = (0..h)
        .map(|i| f16::from_f32(p * (0..h).map(|o| w[o * h + i].to_f32() * dy[o].to_f32()).sum::<f32>()))
        .collect();
    let dp = matvec(w, x).iter().zip(dy).map(|(a, g)| a * g.to_f32()).sum();
    for o in 0..h {
        for i in 0..h {
            dw[o * h + i] += p * dy[o].to_f32() * x[i].to_f32();
        }
    }
    (dx, dp)
}

/// Block q of every rank's `[R, block]` send buffer goes to rank q as its block p (the
/// test double of the NCCL exchange: plain copies between the ranks' buffers).
fn exchange<T: Clone>(send: &[Vec<T>], block: usize) -> Vec<Vec<T>> {
    let ranks = send.len();
    (0..ranks).map(|q| (0..ranks).flat_map(|p| send[p][q * block..(q + 1) * block].to_vec()).collect()).collect()
}

/// Which routes of a rank are kept: the first `capacity` to each peer in ascending (t, j).
/// Written from the contract, independently of `reference::dispatch_layout`.
fn kept_routes(c: &EpConfig, dest: &[i32], t: usize) -> Vec<bool> {
    let mut used = vec![0usize; c.ranks];
    (0..c.routes_len())
        .map(|i| {
            if i >= t * c.topk || dest[i] < 0 {
                return false;
            }
            let peer = dest[i] as usize / c.cols_per_rank();
            used[peer] += 1;
            used[peer] <= c.capacity
        })
        .collect()
}

/// Forward and backward of the EP step for R ranks, all kernels emulated, the exchange a test
/// double, the experts `y = p * (W_e x)` on the CPU, against the single-device step
/// `y[t] = sum_j p * W_e x[t]` over the kept routes (and its backward: dx, dprobs, dW). With
/// Echo, a random slot table places copies of home experts in spare slots and each route picks
/// its home column or one of its expert's spare columns at random (the planner's choice does
/// not change the result; the planner itself is not in the loop): the spare weights travel
/// through pack -> exchange -> select, and their gradients back through exchange -> fold, so a
/// wrong copy or fold changes y or dW. Small integers and dyadic probs make every sum exact, so
/// the comparison is bitwise.
fn whole_step(ranks: usize, echo: bool, tight: bool, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (local, h, k, t_max) = (2usize, 16usize, 3usize, 12usize);
    let spare = if echo { 2 } else { 0 };
    let capacity = if tight { 4 } else { t_max * k };
    let base = EpConfig {
        ranks,
        rank: 0,
        num_experts: ranks * local,
        spare_per_rank: spare,
        hidden: h,
        topk: k,
        max_tokens: t_max,
        capacity,
        dtype: DType::F16,
    };
    let (e_total, cols, ww) = (base.num_experts, base.cols_per_rank(), h * h);
    let what = format!("step R = {ranks}, Echo {echo}, capacity {capacity}");
    let weights: Vec<Vec<f16>> = (0..e_total).map(|_| (0..ww).map(|_| small(&mut rng, 1)).collect()).collect();
    let slot_expert: Vec<i64> = (0..ranks * spare)
        .map(|_| if rng.random_bool(0.2) { -1 } else { rng.random_range(0..e_total as i64) })
        .collect();
    let mut group: Vec<Rank> = (0..ranks)
        .map(|rank| {
            let cfg = EpConfig { rank, ..base.clone() };
            let t = rng.random_range(t_max / 2..=t_max);
            let tokens = if rank % 2 == 0 { Tok::Host(t) } else { Tok::Device(t as i32) };
            let ids: Vec<i32> = (0..t_max)
                .flat_map(|_| {
                    let mut row: Vec<i32> = Vec::new();
                    while row.len() < k {
                        let e = rng.random_range(0..e_total as i32);
                        if !row.contains(&e) {
                            row.push(e);
                        }
                    }
                    if rng.random_bool(0.2) {
                        row[k - 1] = -1;
                    }
                    row
                })
                .collect();
            let dest = ids
                .iter()
                .map(|&e| {
                    if e < 0 {
                        return -1;
                    }
                    let home = (e as usize / local * cols + e as usize % local) as i32;
                    let spares: Vec<i32> = (0..slot_expert.len())
                        .filter(|&j| slot_expert[j] == e as i64)
                        .map(|j| ((j / spare) * cols + local + j % spare) as i32)
                        .collect();
                    if spares.is_empty() || rng.random_bool(0.4) {
                        home
                    } else {
                        spares[rng.random_range(0..spares.len())]
                    }
                })
                .collect();
            Rank {
                cfg,
                tokens,
                t,
                x: (0..t_max * h).map(|_| small(&mut rng, 2)).collect(),
                probs: (0..t_max * k).map(|_| [0.25f32, 0.5, 1.0, 2.0][rng.random_range(0..4)]).collect(),
                ids,
                dest,
                dy: (0..t_max * h).map(|_| small(&mut rng, 2)).collect(),
            }
        })
        .collect();
    // Junk past T, which no kernel may read.
    for r_ in group.iter_mut() {
        for i in r_.t * k..t_max * k {
            r_.dest[i] = 0;
            r_.ids[i] = 0;
        }
    }
    let rows = base.block_rows();

    // 1. counts, all-gathered.
    let outs = stage(
        group
            .iter()
            .map(|g| {
                Call::new(
                    format!("{what}: count rank {}", g.cfg.rank),
                    Op::Count,
                    &g.cfg,
                    g.tokens,
                    vec![buf(&guarded(&g.ids)), buf(&poisoned::<i64>(e_total))],
                )
            })
            .collect(),
    );
    let counts: Vec<i64> = outs.iter().flat_map(|o| typed::<i64>(&o.bufs[1], e_total)).collect();
    for (p, g) in group.iter().enumerate() {
        for e in 0..e_total {
            let want = g.ids[..g.t * k].iter().filter(|&&x| x == e as i32).count() as i64;
            assert_eq!(counts[p * e_total + e], want, "{what}: counts[{p}, {e}]");
        }
    }

    // 2. dispatch layout.
    let outs = stage(
        group
            .iter()
            .map(|g| {
                Call::new(
                    format!("{what}: layout rank {}", g.cfg.rank),
                    Op::Layout,
                    &g.cfg,
                    g.tokens,
                    vec![
                        buf(&guarded(&g.dest)),
                        buf(&guarded(&g.probs)),
                        buf(&poisoned::<i32>(t_max * k)),
                        buf(&poisoned::<i32>(rows)),
                        buf(&poisoned::<f32>(rows)),
                        buf(&poisoned::<i32>(ranks)),
                        buf(&poisoned::<i32>(ranks)),
                        buf(&poisoned::<i32>(layout_chunks(&g.cfg) * ranks)),
                    ],
                )
            })
            .collect(),
    );
    let slot_of_route: Vec<Vec<i32>> = outs.iter().map(|o| typed(&o.bufs[2], t_max * k)).collect();
    let send_ids: Vec<Vec<i32>> = outs.iter().map(|o| typed(&o.bufs[3], rows)).collect();
    let send_probs: Vec<Vec<f32>> = outs.iter().map(|o| typed(&o.bufs[4], rows)).collect();
    let kept: Vec<Vec<bool>> = group.iter().map(|g| kept_routes(&g.cfg, &g.dest, g.t)).collect();
    let dropped_any = kept.iter().zip(&group).any(|(kk, g)| (0..g.t * k).any(|i| g.dest[i] >= 0 && !kk[i]));
    assert_eq!(dropped_any, tight, "{what}: tight capacity drops routes, ample never does");
    for (p, o) in outs.iter().enumerate() {
        let overflow = (0..group[p].t * k).any(|i| group[p].dest[i] >= 0 && !kept[p][i]);
        assert_eq!(o.flags, FLAGS_BEFORE | if overflow { flags::OVERFLOW } else { 0 }, "{what}: rank {p} flags");
    }

    // 3. Echo: spare weights, home rank -> slot rank.
    let mut spares: Vec<Vec<f16>> = vec![Vec::new(); ranks];
    if echo {
        let outs = stage(
            group
                .iter()
                .map(|g| {
                    let home: Vec<f16> = weights[g.cfg.rank * local..(g.cfg.rank + 1) * local].concat();
                    let mut c = Call::new(
                        format!("{what}: pack rank {}", g.cfg.rank),
                        Op::Pack,
                        &g.cfg,
                        Tok::Host(0),
                        vec![
                            buf(&guarded(&slot_expert)),
                            buf(&guarded(&home)),
                            buf(&poisoned::<f16>(ranks * spare * ww)),
                        ],
                    );
                    c.size = (ww * 2) as i64;
                    c
                })
                .collect(),
        );
        let sent: Vec<Vec<f16>> = outs.iter().map(|o| typed(&o.bufs[2], ranks * spare * ww)).collect();
        let received = exchange(&sent, spare * ww);
        let outs = stage(
            group
                .iter()
                .map(|g| {
                    let mut c = Call::new(
                        format!("{what}: select rank {}", g.cfg.rank),
                        Op::Select,
                        &g.cfg,
                        Tok::Host(0),
                        vec![
                            buf(&guarded(&slot_expert)),
                            buf(&guarded(&received[g.cfg.rank])),
                            buf(&poisoned::<f16>(spare * ww)),
                        ],
                    );
                    c.size = (ww * 2) as i64;
                    c
                })
                .collect(),
        );
        spares = outs.iter().map(|o| typed(&o.bufs[2], spare * ww)).collect();
    }
    // The weights of local column `col` on rank q: a home expert or a spare copy.
    let column_weights = |q: usize, col: usize| -> &[f16] {
        if col < local {
            &weights[q * local + col]
        } else {
            &spares[q][(col - local) * ww..(col - local + 1) * ww]
        }
    };

    // 4. gather x, exchange rows / ids / probs.
    let gather = |inputs: Vec<&Vec<f16>>, name: &str| -> Vec<Vec<f16>> {
        let outs = stage(
            group
                .iter()
                .zip(&inputs)
                .map(|(g, input)| {
                    Call::new(
                        format!("{what}: gather {name} rank {}", g.cfg.rank),
                        Op::Gather,
                        &g.cfg,
                        g.tokens,
                        vec![
                            buf(&guarded(input)),
                            buf(&guarded(&slot_of_route[g.cfg.rank])),
                            buf(&vec![f16::ZERO; rows * h]),
                        ],
                    )
                })
                .collect(),
        );
        exchange(&outs.iter().map(|o| typed::<f16>(&o.bufs[2], rows * h)).collect::<Vec<_>>(), capacity * h)
    };
    let recv_x = gather(group.iter().map(|g| &g.x).collect(), "x");
    let recv_ids = exchange(&send_ids, capacity);
    let recv_probs = exchange(&send_probs, capacity);

    // 5. the experts on every rank (CPU), exchange back, reduce.
    let expert_out: Vec<Vec<f16>> = (0..ranks)
        .map(|q| {
            (0..rows)
                .flat_map(|i| match recv_ids[q][i] {
                    -1 => vec![f16::ZERO; h],
                    col => expert_forward(
                        column_weights(q, col as usize),
                        &recv_x[q][i * h..(i + 1) * h],
                        recv_probs[q][i],
                    ),
                })
                .collect()
        })
        .collect();
    let back = exchange(&expert_out, capacity * h);
    let reduce = |inputs: &[Vec<f16>], name: &str| -> Vec<Vec<f16>> {
        let outs = stage(
            group
                .iter()
                .map(|g| {
                    Call::new(
                        format!("{what}: reduce {name} rank {}", g.cfg.rank),
                        Op::Reduce,
                        &g.cfg,
                        g.tokens,
                        vec![
                            buf(&guarded(&inputs[g.cfg.rank])),
                            buf(&guarded(&slot_of_route[g.cfg.rank])),
                            buf(&poisoned::<f16>(t_max * h)),
                        ],
                    )
                })
                .collect(),
        );
        outs.iter().map(|o| typed(&o.bufs[2], t_max * h)).collect()
    };
    let y = reduce(&back, "y");

    // The single-device reference: every kept route of every token, through its home expert.
    for (p, g) in group.iter().enumerate() {
        for t in 0..t_max {
            let mut acc = vec![0f32; h];
            for j in 0..k {
                let i = t * k + j;
                if t < g.t && kept[p][i] {
                    let out = expert_forward(&weights[g.ids[i] as usize], &g.x[t * h..(t + 1) * h], g.probs[i]);
                    acc.iter_mut().zip(&out).for_each(|(a, o)| *a += o.to_f32());
                }
            }
            let want: Vec<f16> =
                if t < g.t { acc.iter().map(|&a| f16::from_f32(a)).collect() } else { vec![poison(); h] };
            assert_bits(&format!("{what}: y rank {p} token {t}"), &y[p][t * h..(t + 1) * h], &want);
        }
    }

    // Backward: gather dy, exchange, expert backward, exchange back dx and dprobs.
    let recv_dy = gather(group.iter().map(|g| &g.dy).collect(), "dy");
    let mut dw_home: Vec<Vec<f32>> = vec![vec![0.0; local * ww]; ranks];
    let mut dw_spare: Vec<Vec<f32>> = vec![vec![0.0; spare * ww]; ranks];
    let mut dx_rows: Vec<Vec<f16>> = vec![vec![f16::ZERO; rows * h]; ranks];
    let mut dp_rows: Vec<Vec<f32>> = vec![vec![0.0; rows]; ranks];
    for q in 0..ranks {
        for i in 0..rows {
            let col = recv_ids[q][i];
            if col < 0 {
                continue;
            }
            let col = col as usize;
            let grad = if col < local {
                &mut dw_home[q][col * ww..(col + 1) * ww]
            } else {
                &mut dw_spare[q][(col - local) * ww..(col - local + 1) * ww]
            };
            let x_i = &recv_x[q][i * h..(i + 1) * h];
            let (dx, dp) =
                expert_backward(column_weights(q, col), x_i, &recv_dy[q][i * h..(i + 1) * h], recv_probs[q][i], grad);
            dx_rows[q][i * h..(i + 1) * h].copy_from_slice(&dx);
            dp_rows[q][i] = dp;
        }
    }
    let dx = reduce(&exchange(&dx_rows, capacity * h), "dx");
    let dp_back = exchange(&dp_rows, capacity);
    let outs = stage(
        group
            .iter()
            .map(|g| {
                Call::new(
                    format!("{what}: dprobs rank {}", g.cfg.rank),
                    Op::Values,
                    &g.cfg,
                    g.tokens,
                    vec![
                        buf(&guarded(&dp_back[g.cfg.rank])),
                        buf(&guarded(&slot_of_route[g.cfg.rank])),
                        buf(&poisoned::<f32>(t_max * k)),
                    ],
                )
            })
            .collect(),
    );
    let dprobs: Vec<Vec<f32>> = outs.iter().map(|o| typed(&o.bufs[2], t_max * k)).collect();
    if echo {
        // Every rank sends its whole dw_spare to every peer; the home rank folds.
        let outs = stage(
            group
                .iter()
                .map(|g| {
                    let recv: Vec<f32> = dw_spare.concat();
                    let mut c = Call::new(
                        format!("{what}: fold rank {}", g.cfg.rank),
                        Op::Fold,
                        &g.cfg,
                        Tok::Host(0),
                        vec![buf(&guarded(&slot_expert)), buf(&guarded(&recv)), buf(&guarded(&dw_home[g.cfg.rank]))],
                    );
                    c.size = ww as i64;
                    c
                })
                .collect(),
        );
        dw_home = outs.iter().map(|o| typed(&o.bufs[2], local * ww)).collect();
    }

    // The single-device backward.
    let mut dw_want = vec![vec![0f32; ww]; e_total];
    for (p, g) in group.iter().enumerate() {
        for t in 0..t_max {
            let mut acc = vec![0f32; h];
            for j in 0..k {
                let i = t * k + j;
                let want_dp = if t < g.t && kept[p][i] {
                    let e = g.ids[i] as usize;
                    let (dx_ij, dp) = expert_backward(
                        &weights[e],
                        &g.x[t * h..(t + 1) * h],
                        &g.dy[t * h..(t + 1) * h],
                        g.probs[i],
                        &mut dw_want[e],
                    );
                    acc.iter_mut().zip(&dx_ij).for_each(|(a, d)| *a += d.to_f32());
                    dp
                } else if t < g.t {
                    0.0
                } else {
                    poison()
                };
                assert_bits(&format!("{what}: dprobs rank {p} route ({t}, {j})"), &dprobs[p][i..i + 1], &[want_dp]);
            }
            let want: Vec<f16> =
                if t < g.t { acc.iter().map(|&a| f16::from_f32(a)).collect() } else { vec![poison(); h] };
            assert_bits(&format!("{what}: dx rank {p} token {t}"), &dx[p][t * h..(t + 1) * h], &want);
        }
    }
    for q in 0..ranks {
        for l in 0..local {
            assert_bits(
                &format!("{what}: dW of expert {} on rank {q}", q * local + l),
                &dw_home[q][l * ww..(l + 1) * ww],
                &dw_want[q * local + l],
            );
        }
    }
    if echo {
        let spare_routes = (0..ranks).flat_map(|q| recv_ids[q].iter().filter(|&&c| c >= local as i32)).count();
        assert!(spare_routes > 0, "{what}: no route went to a spare slot");
    }
}

fn assert_bits<T: Pod + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    let b = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    if b(got) != b(want) {
        let i = (0..got.len()).find(|&i| b(&got[i..i + 1]) != b(&want[i..i + 1])).unwrap();
        panic!("{what}: element {i} of {}: got {:?}, expected {:?}", got.len(), got[i], want[i]);
    }
}

#[test]
fn whole_step_matches_the_single_device_reference() {
    let mut seed = 400;
    for ranks in [2, 4] {
        for echo in [false, true] {
            for tight in [false, true] {
                whole_step(ranks, echo, tight, seed);
                seed += 1;
            }
        }
    }
}
