//! The routing kernels without a GPU: `csrc/routing/{build,permute,swiglu,row_probs}.cu` compiled as host
//! C++ against the CPU emulation of `tests/emulation/` (each block's CUDA threads are
//! coroutines; `__syncthreads` and the warp intrinsics are real barriers) and run through their
//! C ABI by `tests/emulation/routing_driver.cpp` on the shapes of `routing_gpu`: build (both
//! m_splits, offsets, both maps, expert counts, flags: capacity and per-expert dropping, bad
//! ids, out-of-range device T), then with every optional output left out, permute, unpermute,
//! permute_backward, unpermute_backward, SwiGLU forward / backward, row_probs and route_dprobs
//! (the weighted-fc1 path's glue), and the Megatron-map
//! conversion from_map (ids, probs, flags: TOO_MANY at k + 1 routes, out-of-range device T, OR-ed
//! into a word with another bit set; again with flags NULL; on every case's own [T_max, E] map
//! plus `routing_gpu`'s map shapes feeding build), for bf16 and fp16 activations with f32, bf16
//! and fp16 probs, the token count on the host and on the device. Every output starts poisoned
//! and carries a poisoned guard tail, and must equal the Rust CPU reference bit for bit, except
//! SwiGLU (within `routing_gpu`'s tolerance, see `assert_close`), once with the threads of a
//! block resumed first-to-last and once last-to-first. This is CI's check of the kernels' logic;
//! `routing_gpu` checks the same on the device.
//!
//! Needs a C++17 compiler (`CXX`, default `c++`); ~12 s. `CAPMOE_EMULATION_CXXFLAGS` adds
//! compiler flags (sanitizers), as for `echo_emulated`.

mod common;

use bytemuck::Pod;
use capturable_moe::routing::reference::{self as r, Scalar};
use capturable_moe::routing::DType;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::routing::{dyadic, small_int, topk_ids};

/// Poisoned elements after every output buffer (`kGuard` of the driver).
const GUARD: usize = 64;

/// The driver's poison for an element of `size` bytes (`Buf` in routing_driver.cpp).
fn poison_bytes(size: usize) -> Vec<u8> {
    match size {
        2 => 0x7fa5u16.to_le_bytes().to_vec(),
        _ => vec![0x5a; size],
    }
}

fn poisoned<T: Pod>(n: usize) -> Vec<T> {
    let one = poison_bytes(std::mem::size_of::<T>());
    (0..n + GUARD).map(|_| bytemuck::pod_read_unaligned(&one)).collect()
}

/// `v` followed by the poisoned guard.
fn guarded<T: Pod>(mut v: Vec<T>) -> Vec<T> {
    v.extend(poisoned::<T>(0));
    v
}

fn put<T: Pod>(out: &mut Vec<u8>, v: &[T]) {
    out.extend_from_slice(bytemuck::cast_slice(v));
}

#[derive(Clone, Copy, Debug)]
enum Tokens {
    Host(usize),
    /// The count in "device" memory (may be out of range on purpose); the host value passed
    /// beside it is junk, which must be ignored.
    Device(i32),
}

struct Case {
    name: String,
    e: usize,
    k: usize,
    h: usize,
    f: usize,
    t_max: usize,
    tokens: Tokens,
    capacity: Option<usize>,
    expert_capacity: usize,
    /// The chance of each [token, expert] entry of from_map's routing map being set; `None`:
    /// k / E (capped at 1), so about half the tokens have more than k routes.
    map_density: Option<f64>,
    /// At most this many routes per token in that map (the lowest experts kept).
    map_routes_cap: Option<usize>,
}

fn case(name: &str, e: usize, k: usize, h: usize, f: usize, t_max: usize, tokens: Tokens) -> Case {
    Case {
        name: name.into(),
        e,
        k,
        h,
        f,
        t_max,
        tokens,
        capacity: None,
        expert_capacity: 0,
        map_density: None,
        map_routes_cap: None,
    }
}

/// What from_map's flags word holds before the call (`kFromMapFlagsBefore` of the driver): a
/// bit no routing flag uses, which must survive.
const FROM_MAP_FLAGS_BEFORE: i32 = 0x100;

/// From_map's inputs for case `c`: the Megatron routing map [T_max, E] (nonzero entries of any
/// value are routes) and its probs, from their own generator so that a case can derive its
/// expert ids from them before `put_case` writes them.
fn routing_map<P: Scalar>(c: &Case, seed: u64) -> (Vec<u8>, Vec<P>) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6d61_7073);
    let density = c.map_density.unwrap_or((c.k as f64 / c.e as f64).min(1.0));
    let n = c.t_max * c.e;
    let mut map: Vec<u8> =
        (0..n).map(|_| if rng.random_bool(density) { rng.random_range(1..=255) } else { 0 }).collect();
    if let Some(cap) = c.map_routes_cap {
        for row in map.chunks_mut(c.e.max(1)) {
            row.iter_mut().filter(|m| **m != 0).skip(cap).for_each(|m| *m = 0);
        }
    }
    let probs = (0..n).map(|_| P::from_f32(rng.random_range(0.0f32..1.0))).collect();
    (map, probs)
}

/// Whether from_map runs a second time with flags NULL: not on the largest maps, whose
/// conversion dominates the emulation's time.
fn from_map_without_flags(c: &Case) -> bool {
    c.t_max * c.e <= 1 << 16
}

/// The T of a case and the flags resolving it sets (as `r::resolve_tokens`).
fn tokens_of(c: &Case) -> (usize, i32) {
    match c.tokens {
        Tokens::Host(t) => (t, 0),
        Tokens::Device(v) => r::resolve_tokens(v, c.t_max),
    }
}

/// How one output buffer is compared.
enum Check {
    Bitwise,
    /// The first n elements within tolerance (SwiGLU), the rest bitwise.
    Close(usize, DType),
}

/// What the driver must write for one case: its statuses (all CAPMOE_OK) and every output.
struct Expected {
    name: String,
    buffers: Vec<(&'static str, Vec<u8>, Check)>,
}

trait Element: Scalar + Pod {
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}

fn abi_dtype(d: DType) -> i64 {
    match d {
        DType::Bf16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
        other => panic!("no routing dtype {other:?}"),
    }
}

/// Appends case `c` (inputs as `routing_gpu::run_case` makes them) in the driver's format and
/// returns what the reference says the driver must write back.
fn put_case<T: Element, P: Element>(out: &mut Vec<u8>, c: &Case, ids: &[i32], seed: u64) -> Expected {
    let mut rng = StdRng::seed_from_u64(seed);
    let (e, k, h, f, t_max) = (c.e, c.k, c.h, c.f, c.t_max);
    let cap = c.capacity.unwrap_or(t_max * k);
    assert_eq!(ids.len(), t_max * k, "{}: ids length", c.name);
    let (t, token_flag) = tokens_of(c);
    let (host_t, device_t, use_device) = match c.tokens {
        Tokens::Host(t) => (t as i64, 0, 0),
        Tokens::Device(v) => (-7, v as i64, 1),
    };
    let header = [e, h, f, k, t_max, cap, c.expert_capacity].map(|v| v as i64);
    put(out, &header);
    put(out, &[abi_dtype(T::DTYPE), abi_dtype(P::DTYPE), host_t, device_t, use_device]);
    put(out, &[from_map_without_flags(c) as i64, DPROB_SLICES as i64]);

    let x: Vec<T> = (0..t_max * h).map(|_| small_int(&mut rng)).collect();
    let probs: Vec<P> = (0..t_max * k).map(|_| dyadic(&mut rng)).collect();
    let expert_out: Vec<T> = (0..cap * h).map(|_| small_int(&mut rng)).collect();
    let dy: Vec<T> = (0..t_max * h).map(|_| small_int(&mut rng)).collect();
    let hbuf: Vec<T> = (0..cap * 2 * f).map(|_| T::from_f32(rng.random_range(-4.0f32..4.0))).collect();
    let dact: Vec<T> = (0..cap * f).map(|_| T::from_f32(rng.random_range(-2.0f32..2.0))).collect();
    put(out, ids);
    put(out, &x);
    put(out, &probs);
    put(out, &expert_out);
    put(out, &dy);
    put(out, &hbuf);
    put(out, &dact);
    let (routing, routing_probs) = routing_map::<P>(c, seed);
    put(out, &routing);
    put(out, &routing_probs);
    // Partials of either sign, so a wrong order or a dropped term changes the sum's bits.
    let partials: Vec<f32> = (0..cap * DPROB_SLICES).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    put(out, &partials);

    let mut maps = r::build(ids, t, t_max, e, k, cap, c.expert_capacity);
    maps.flags |= token_flag;
    let total = maps.offsets[e] as usize;
    let m32: Vec<i32> = maps.m_splits.iter().map(|&m| m as i32).collect();
    let map = &maps.row_of_route;

    let mut rows = poisoned::<T>(cap * h);
    r::permute(&x, map, t, h, k, cap, &mut rows);
    let mut y = poisoned::<T>(t_max * h);
    r::gather_sum(&expert_out, map, Some(&probs), t, h, k, cap, &mut y);
    let mut dx = poisoned::<T>(t_max * h);
    r::gather_sum::<T, P>(&expert_out, map, None, t, h, k, cap, &mut dx);
    let (mut drows, mut dprobs) = (poisoned::<T>(cap * h), poisoned::<P>(t_max * k));
    r::unpermute_backward(&dy, &expert_out, map, &probs, t, h, k, cap, &mut drows, &mut dprobs);
    let mut act = poisoned::<T>(cap * f);
    r::swiglu(&hbuf, total, f, &mut act);
    let mut dh = poisoned::<T>(cap * 2 * f);
    r::swiglu_backward(&dact, &hbuf, total, f, &mut dh);
    let (mut map_ids, mut map_k_probs) = (poisoned::<i32>(t_max * k), poisoned::<P>(t_max * k));
    let map_flags = r::from_map(&routing, &routing_probs, t, e, k, &mut map_ids, &mut map_k_probs) | token_flag;
    let mut prob_of_row = poisoned::<f32>(cap);
    r::row_probs(map, &probs, t, k, cap, &mut prob_of_row);
    let mut route_dprobs = poisoned::<P>(t_max * k);
    r::route_dprobs(map, &partials, DPROB_SLICES, t, k, cap, &mut route_dprobs);

    let b = |v: Vec<u8>| (v, Check::Bitwise);
    let bytes = |v: &[u8]| v.to_vec();
    let mut buffers = vec![
        ("m_splits_i32", b(bytes(bytemuck::cast_slice(&guarded(m32))))),
        ("m_splits_i64", b(bytes(bytemuck::cast_slice(&guarded(maps.m_splits.clone()))))),
        ("offsets", b(bytes(bytemuck::cast_slice(&guarded(maps.offsets.clone()))))),
        ("row_of_route", b(bytes(bytemuck::cast_slice(&guarded(maps.row_of_route.clone()))))),
        ("token_of_row", b(bytes(bytemuck::cast_slice(&guarded(maps.token_of_row.clone()))))),
        ("expert_counts", b(bytes(bytemuck::cast_slice(&guarded(maps.expert_counts.clone()))))),
        ("flags", b(bytes(bytemuck::cast_slice(&guarded(vec![maps.flags]))))),
        ("offsets (optional outputs left out)", b(bytes(bytemuck::cast_slice(&guarded(maps.offsets.clone()))))),
        (
            "row_of_route (optional outputs left out)",
            b(bytes(bytemuck::cast_slice(&guarded(maps.row_of_route.clone())))),
        ),
        ("permute rows", b(bytes(bytemuck::cast_slice(&rows)))),
        ("unpermute y", b(bytes(bytemuck::cast_slice(&y)))),
        ("permute_backward dx", b(bytes(bytemuck::cast_slice(&dx)))),
        ("unpermute_backward drows", b(bytes(bytemuck::cast_slice(&drows)))),
        ("unpermute_backward dprobs", b(bytes(bytemuck::cast_slice(&dprobs)))),
        ("swiglu act", (bytes(bytemuck::cast_slice(&act)), Check::Close(total * f, T::DTYPE))),
        ("swiglu dh", (bytes(bytemuck::cast_slice(&dh)), Check::Close(total * 2 * f, T::DTYPE))),
        ("from_map expert_ids", b(bytes(bytemuck::cast_slice(&map_ids)))),
        ("from_map probs", b(bytes(bytemuck::cast_slice(&map_k_probs)))),
        ("from_map flags", b(bytes(bytemuck::cast_slice(&guarded(vec![FROM_MAP_FLAGS_BEFORE | map_flags]))))),
        ("row_probs prob_of_row", b(bytes(bytemuck::cast_slice(&prob_of_row)))),
        ("route_dprobs dprobs", b(bytes(bytemuck::cast_slice(&route_dprobs)))),
    ];
    if from_map_without_flags(c) {
        buffers.push(("from_map expert_ids (flags NULL)", b(bytes(bytemuck::cast_slice(&map_ids)))));
        buffers.push(("from_map probs (flags NULL)", b(bytes(bytemuck::cast_slice(&map_k_probs)))));
    }
    let name = format!(
        "{} ({:?} / {:?} probs, E={e} k={k} H={h} F={f} T_max={t_max} {:?} capacity={cap} expert_capacity={})",
        c.name,
        T::DTYPE,
        P::DTYPE,
        c.tokens,
        c.expert_capacity
    );
    Expected { name, buffers: buffers.into_iter().map(|(n, (v, c))| (n, v, c)).collect() }
}

fn to_f32(bytes: &[u8], d: DType) -> f32 {
    let bits = u16::from_le_bytes([bytes[0], bytes[1]]);
    match d {
        DType::Bf16 => bf16::from_bits(bits).to_f32(),
        _ => f16::from_bits(bits).to_f32(),
    }
}

/// SwiGLU goes through `__expf`, an approximation on the GPU (ex2.approx) and the host's expf
/// here, and nvcc may contract its products into fmas, so it is checked within `routing_gpu`'s
/// tolerance rather than bitwise (NaN never passes).
fn assert_close(what: &str, got: &[u8], want: &[u8], n: usize, d: DType) {
    for i in 0..n {
        let (g, w) = (to_f32(&got[2 * i..], d), to_f32(&want[2 * i..], d));
        let ok = g.is_finite() && (g - w).abs() <= 1.6e-2 * (1.0 + w.abs());
        assert!(ok, "{what}: element {i}: got {g}, expected {w}");
    }
    assert!(got[2 * n..] == want[2 * n..], "{what}: the untouched tail (rows past offsets[E]) changed");
}

/// The statuses the driver writes per case: workspace_size, build twice, permute, unpermute,
/// their backwards, SwiGLU forward and backward, from_map twice (the second 0 where it is not
/// run, see `from_map_without_flags`), row_probs and route_dprobs.
const STATUSES: usize = 13;

/// Column slices of the dprob partials the cases hand route_dprobs (the fused fc2 dgrad writes
/// F / 128 of them; 3 keeps the emulation quick and the sum order visible).
const DPROB_SLICES: usize = 3;

/// Compares the driver's output file with the expectations, in order.
fn check_output(output: &[u8], expected: &[Expected], order: &str) {
    let mut at = 0;
    for exp in expected {
        let status: &[i32] = bytemuck::cast_slice(&output[at..at + 4 * STATUSES]);
        at += 4 * STATUSES;
        assert!(status.iter().all(|&s| s == 0), "{} ({order}): statuses {status:?}", exp.name);
        for (what, want, check) in &exp.buffers {
            let got = &output[at..at + want.len()];
            at += want.len();
            let what = format!("{}: {what} ({order} thread order)", exp.name);
            match check {
                Check::Bitwise => {
                    if got != &want[..] {
                        let i = (0..got.len()).find(|&i| got[i] != want[i]).unwrap();
                        panic!("{what}: byte {i} of {}: got {:#04x}, expected {:#04x}", got.len(), got[i], want[i]);
                    }
                }
                Check::Close(n, d) => assert_close(&what, got, want, *n, *d),
            }
        }
    }
    assert_eq!(at, output.len(), "the driver wrote more than the cases asked for");
}

/// The cases of `routing_gpu`, with smaller H / F where the emulation would be slow.
fn cases(out: &mut Vec<u8>) -> Vec<Expected> {
    let mut x = Vec::new();
    let mut rng = StdRng::seed_from_u64(10);
    // Model-like shapes: Qwen3-30B-A3B (E = 128, top-8), DeepSeek-V3 (E = 256, top-8, T on the
    // device), Mixtral (E = 8, top-2, H = 4096: more vectors than threads per block).
    let c = case("qwen3-like", 128, 8, 256, 96, 200, Tokens::Host(200));
    x.push(put_case::<bf16, f32>(out, &c, &topk_ids(&mut rng, 200, 128, 8), 11));
    let c = case("deepseek-like", 256, 8, 512, 128, 96, Tokens::Device(80));
    x.push(put_case::<bf16, bf16>(out, &c, &topk_ids(&mut rng, 96, 256, 8), 12));
    let c = case("mixtral-like", 8, 2, 4096, 512, 24, Tokens::Host(21));
    x.push(put_case::<f16, f16>(out, &c, &topk_ids(&mut rng, 24, 8, 2), 13));
    let c = case("fp16 / f32", 8, 2, 128, 64, 100, Tokens::Host(100));
    x.push(put_case::<f16, f32>(out, &c, &topk_ids(&mut rng, 100, 8, 2), 14));
    let c = case("fp16 / bf16 probs", 16, 4, 64, 32, 50, Tokens::Device(47));
    x.push(put_case::<f16, bf16>(out, &c, &topk_ids(&mut rng, 50, 16, 4), 15));
    let c = case("bf16 / fp16 probs", 16, 4, 64, 32, 50, Tokens::Host(50));
    x.push(put_case::<bf16, f16>(out, &c, &topk_ids(&mut rng, 50, 16, 4), 16));

    // Awkward routings.
    let c = case("empty experts", 64, 2, 64, 32, 16, Tokens::Host(5));
    x.push(put_case::<bf16, f32>(out, &c, &topk_ids(&mut rng, 16, 64, 2), 21));
    let c = case("all to one expert, 3 chunks", 16, 1, 64, 32, 3000, Tokens::Host(3000));
    x.push(put_case::<bf16, f32>(out, &c, &vec![7; 3000], 22));
    let c = case("one expert", 1, 1, 64, 32, 77, Tokens::Host(77));
    x.push(put_case::<f16, f32>(out, &c, &vec![0; 77], 23));
    let ids: Vec<i32> = (0..200 * 4).map(|_| rng.random_range(-2..10)).collect();
    let c = case("duplicates, empty slots, bad ids", 8, 4, 64, 32, 200, Tokens::Host(190));
    x.push(put_case::<bf16, f32>(out, &c, &ids, 24));
    let c = case("duplicate pair", 4, 2, 64, 32, 50, Tokens::Host(50));
    x.push(put_case::<bf16, bf16>(out, &c, &vec![3; 100], 25));
    let c = case("top-32 (the limit), k > E", 16, 32, 64, 32, 40, Tokens::Host(37));
    x.push(put_case::<f16, f32>(out, &c, &topk_ids(&mut rng, 40, 16, 32), 26));

    // Token count edges.
    let ids = topk_ids(&mut rng, 100, 16, 4);
    for (name, tokens) in [
        ("T = 0 host", Tokens::Host(0)),
        ("T = 0 device", Tokens::Device(0)),
        ("T = T_max host", Tokens::Host(100)),
        ("T = T_max device", Tokens::Device(100)),
        ("device T above T_max (clamped, flagged)", Tokens::Device(1000)),
        ("device T negative (clamped, flagged)", Tokens::Device(-3)),
    ] {
        x.push(put_case::<bf16, f32>(out, &case(name, 16, 4, 64, 32, 100, tokens), &ids, 31));
        x.push(put_case::<f16, bf16>(out, &case(name, 16, 4, 64, 32, 100, tokens), &ids, 31));
    }
    x.push(put_case::<bf16, f32>(out, &case("T_max = 0", 4, 2, 64, 32, 0, Tokens::Host(0)), &[], 32));

    // Dropping by capacity and by expert capacity.
    let ids = topk_ids(&mut rng, 300, 32, 4);
    let mut c = case("capacity 500 < 1200 routes", 32, 4, 64, 32, 300, Tokens::Host(300));
    c.capacity = Some(500);
    x.push(put_case::<bf16, f32>(out, &c, &ids, 41));
    c.name = "expert capacity 30".into();
    c.capacity = None;
    c.expert_capacity = 30;
    x.push(put_case::<f16, f32>(out, &c, &ids, 42));
    c.name = "both limits, device T".into();
    c.capacity = Some(333);
    c.tokens = Tokens::Device(250);
    x.push(put_case::<bf16, bf16>(out, &c, &ids, 43));
    c.name = "capacity 0".into();
    c.capacity = Some(0);
    c.expert_capacity = 0;
    x.push(put_case::<bf16, f32>(out, &c, &ids, 44));

    // Many routes and many experts: 16 chunks with E = 512; E = 1024 (the limit), skewed.
    let c = case("E=512 T=2048 top-8", 512, 8, 64, 32, 2048, Tokens::Device(2000));
    x.push(put_case::<bf16, f32>(out, &c, &topk_ids(&mut rng, 2048, 512, 8), 51));
    let ids: Vec<i32> = (0..5000).map(|_| (rng.random_range(0..1024u32).pow(2) / 1024) as i32).collect();
    let c = case("E=1024 skewed", 1024, 1, 64, 32, 5000, Tokens::Host(5000));
    x.push(put_case::<bf16, f32>(out, &c, &ids, 52));
    x.extend(megatron_cases(out, &mut rng));
    x
}

/// From_map's own cases: `routing_gpu`'s Megatron-map shapes (T on the device, E = 200 not a
/// multiple of a warp, the dense one overflowing k), each building from the ids the map
/// converts to, as a Megatron layer would; then maps with no routes, with every entry set,
/// with exactly k and with k + 1 routes per token (TOO_MANY's edge), with routes crossing k
/// inside a warp's 32 experts, and a T_max = 0 plan given device T in and out of range (out of
/// range must still be flagged).
fn megatron_cases(out: &mut Vec<u8>, rng: &mut StdRng) -> Vec<Expected> {
    let mut x = Vec::new();
    for (i, &(e, k, t_max, t, density)) in
        [(64, 8, 300, 300, 0.1), (200, 4, 100, 90, 0.03), (8, 2, 40, 40, 0.5)].iter().enumerate()
    {
        let mut c = case("Megatron map -> ids -> build", e, k, 64, 32, t_max, Tokens::Device(t));
        c.map_density = Some(density);
        let seed = 61 + i as u64;
        let ids = ids_from_map::<f32>(&c, seed, rng);
        x.push(put_case::<bf16, f32>(out, &c, &ids, seed));
    }
    let ids = topk_ids(rng, 64, 40, 4);
    for (name, density) in [("map with no routes", 0.0), ("map with every entry set", 1.0)] {
        let mut c = case(name, 40, 4, 64, 32, 64, Tokens::Host(60));
        c.map_density = Some(density);
        x.push(put_case::<f16, bf16>(out, &c, &ids, 64));
    }
    // TOO_MANY's edge: exactly k routes per token is no overflow, k + 1 is.
    for (name, cap) in [("map with exactly k routes per token", 6), ("map with at most k + 1 routes per token", 7)] {
        let mut c = case(name, 48, 6, 64, 32, 30, Tokens::Host(30));
        (c.map_density, c.map_routes_cap) = (Some(0.5), Some(cap));
        x.push(put_case::<bf16, f32>(out, &c, &topk_ids(rng, 30, 48, 6), 67));
    }
    let mut c = case("map: ~40 of 256 experts per token, k = 32", 256, 32, 64, 32, 48, Tokens::Device(45));
    c.map_density = Some(40.0 / 256.0);
    x.push(put_case::<bf16, f16>(out, &c, &topk_ids(rng, 48, 256, 32), 65));
    for v in [0, 5] {
        let c = case(&format!("T_max = 0, device T = {v}"), 4, 2, 64, 32, 0, Tokens::Device(v));
        x.push(put_case::<bf16, f32>(out, &c, &[], 66));
    }
    x
}

/// Expert ids as a Megatron layer gets them: from_map of the case's routing map for the first
/// T tokens, junk (which build must not read) after.
fn ids_from_map<P: Scalar>(c: &Case, seed: u64, rng: &mut StdRng) -> Vec<i32> {
    let (map, probs) = routing_map::<P>(c, seed);
    let mut ids: Vec<i32> = (0..c.t_max * c.k).map(|_| rng.random_range(-3..c.e as i32 + 3)).collect();
    let mut ignored = vec![P::default(); c.t_max * c.k];
    r::from_map(&map, &probs, tokens_of(c).0, c.e, c.k, &mut ids, &mut ignored);
    ids
}

#[test]
fn routing_kernels_match_the_reference_under_cpu_emulation() {
    let mut input = Vec::new();
    let expected = cases(&mut input);
    let exe = common::emulation::build(
        "routing_emulator",
        &["csrc/routing/build.cu", "csrc/routing/permute.cu", "csrc/routing/swiglu.cu", "csrc/routing/row_probs.cu"],
        "tests/emulation/routing_driver.cpp",
    );
    common::emulation::run_case_file(&exe, "routing_emulated", &input, expected.len(), |output, order| {
        check_output(output, &expected, order)
    });
}
