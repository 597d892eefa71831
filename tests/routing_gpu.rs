//! GPU tests of the routing kernels against the CPU reference: bitwise for counts, offsets,
//! maps, permute and unpermute (fwd/bwd), within tolerance for SwiGLU; every output buffer is
//! poisoned first and carries a poisoned guard tail, so an unwritten element or a write past
//! the end fails. Ends with a CUDA-graph test replaying new routing (and a new device-side T)
//! 120 times, every replay checked.
mod common;

use std::sync::{Arc, MutexGuard};

use bytemuck::Pod;
use capturable_moe::routing::reference::{self as r, Scalar};
use capturable_moe::routing::{flags, DType, Element, RouteMaps, RoutingConfig, RoutingPlan, Tokens};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::routing::{dyadic, small_int, topk_ids};

/// Elements of poisoned guard tail after every output buffer.
const GUARD: usize = 64;
const POISON_I32: i32 = 0x5a5a_5a5a;
const POISON_I64: i64 = 0x5a5a_5a5a_5a5a_5a5a;

/// GPU tests of this binary run one at a time: the graph test captures in global mode, which
/// forbids allocations on other threads while it is open.
fn serial() -> MutexGuard<'static, ()> {
    common::capture_lock()
}

fn poison<T: Scalar>() -> T {
    // A NaN pattern for the float types, never produced by the kernels from finite inputs.
    T::from_f32(f32::from_bits(0x7fa5_a5a5))
}

fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Bitwise equality, reporting the first differing element.
fn assert_bitwise<T: Pod + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if bytes_of(got) != bytes_of(want) {
        let i = (0..got.len()).find(|&i| bytes_of(&got[i..i + 1]) != bytes_of(&want[i..i + 1])).unwrap();
        panic!("{what}: element {i} of {}: got {:?}, expected {:?}", got.len(), got[i], want[i]);
    }
}

fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    if v.is_empty() {
        return s.null().unwrap();
    }
    s.clone_htod(v).unwrap()
}

fn download<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Vec<T> {
    let v = s.clone_dtoh(d).unwrap();
    s.synchronize().unwrap();
    v
}

/// Route maps with poisoned contents and poisoned guard tails.
fn poisoned_maps(s: &Arc<CudaStream>, plan: &RoutingPlan) -> RouteMaps {
    let e = plan.num_experts();
    RouteMaps {
        m_splits_i32: upload(s, &vec![POISON_I32; e + GUARD]),
        m_splits_i64: upload(s, &vec![POISON_I64; e + GUARD]),
        offsets: upload(s, &vec![POISON_I64; e + 1 + GUARD]),
        row_of_route: upload(s, &vec![POISON_I32; plan.routes_len() + GUARD]),
        token_of_row: upload(s, &vec![POISON_I32; plan.capacity() + GUARD]),
        expert_counts: upload(s, &vec![POISON_I32; e + GUARD]),
        flags: upload(s, &[0i32]),
        workspace: upload(s, &vec![0xa5u8; plan.workspace_bytes()]),
    }
}

fn with_guard<T: Clone>(mut v: Vec<T>, fill: T) -> Vec<T> {
    v.extend(std::iter::repeat_n(fill, GUARD));
    v
}

fn check_maps(s: &Arc<CudaStream>, plan: &RoutingPlan, maps: &RouteMaps, want: &r::RouteMaps) {
    let e = plan.num_experts();
    let m32: Vec<i32> = want.m_splits.iter().map(|&m| m as i32).collect();
    assert_bitwise("m_splits_i64", &download(s, &maps.m_splits_i64), &with_guard(want.m_splits.clone(), POISON_I64));
    assert_bitwise("m_splits_i32", &download(s, &maps.m_splits_i32), &with_guard(m32, POISON_I32));
    assert_bitwise("offsets", &download(s, &maps.offsets), &with_guard(want.offsets.clone(), POISON_I64));
    assert_bitwise(
        "row_of_route",
        &download(s, &maps.row_of_route),
        &with_guard(want.row_of_route.clone(), POISON_I32),
    );
    assert_bitwise(
        "token_of_row",
        &download(s, &maps.token_of_row),
        &with_guard(want.token_of_row.clone(), POISON_I32),
    );
    assert_bitwise(
        "expert_counts",
        &download(s, &maps.expert_counts),
        &with_guard(want.expert_counts.clone(), POISON_I32),
    );
    assert_eq!(download(s, &maps.flags)[0], want.flags, "flags (E = {e})");
}

/// How a case passes its token count.
#[derive(Clone, Copy, Debug)]
enum TokenMode {
    Host(usize),
    /// A device int32 holding this value (may be out of range on purpose).
    Device(i32),
}

struct Case {
    name: &'static str,
    e: usize,
    k: usize,
    h: usize,
    f: usize,
    t_max: usize,
    tokens: TokenMode,
    capacity: Option<usize>,
    expert_capacity: Option<usize>,
}

/// Runs every kernel of one case and compares all outputs with the reference.
fn run_case<T: Element + Pod, P: Element + Pod>(s: &Arc<CudaStream>, c: &Case, ids: Vec<i32>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: c.e,
        hidden: c.h,
        ffn: c.f,
        topk: c.k,
        max_tokens: c.t_max,
        capacity: c.capacity,
        expert_capacity: c.expert_capacity,
        dtype: T::DTYPE,
        prob_dtype: P::DTYPE,
    })
    .unwrap();
    let (k, h, f, cap) = (c.k, c.h, c.f, plan.capacity());
    assert_eq!(ids.len(), c.t_max * k, "{}: ids length", c.name);
    let t_dev = upload(
        s,
        &[match c.tokens {
            TokenMode::Host(t) => t as i32,
            TokenMode::Device(v) => v,
        }],
    );
    let (t, token_flag) = match c.tokens {
        TokenMode::Host(t) => (t, 0),
        TokenMode::Device(v) => r::resolve_tokens(v, c.t_max),
    };
    let tokens = match c.tokens {
        TokenMode::Host(t) => Tokens::Host(t),
        TokenMode::Device(_) => Tokens::Device(&t_dev),
    };

    // Counts, offsets, maps.
    let mut want = r::build(&ids, t, c.t_max, c.e, k, cap, c.expert_capacity.unwrap_or(0));
    want.flags |= token_flag;
    let ids_d = upload(s, &ids);
    let mut maps = poisoned_maps(s, &plan);
    plan.build(s, &ids_d, tokens, &mut maps).unwrap();
    check_maps(s, &plan, &maps, &want);
    let total = want.offsets[c.e] as usize;

    // permute
    let x: Vec<T> = (0..c.t_max * h).map(|_| small_int(&mut rng)).collect();
    let x_d = upload(s, &x);
    let mut rows_want = vec![poison::<T>(); cap * h + GUARD];
    let mut rows_d = upload(s, &rows_want);
    plan.permute(s, &x_d, &maps.row_of_route, tokens, &mut rows_d).unwrap();
    r::permute(&x, &want.row_of_route, t, h, k, cap, &mut rows_want);
    assert_bitwise(&format!("{}: permute rows", c.name), &download(s, &rows_d), &rows_want);

    // unpermute (expert outputs: every capacity row finite, small integers)
    let probs: Vec<P> = (0..c.t_max * k).map(|_| dyadic(&mut rng)).collect();
    let probs_d = upload(s, &probs);
    let mut out: Vec<T> = (0..cap * h).map(|_| small_int(&mut rng)).collect();
    out.extend(std::iter::repeat_n(poison::<T>(), GUARD));
    let out_d = upload(s, &out);
    let mut y_want = vec![poison::<T>(); c.t_max * h + GUARD];
    let mut y_d = upload(s, &y_want);
    plan.unpermute(s, &out_d, &maps.row_of_route, &probs_d, tokens, &mut y_d).unwrap();
    r::gather_sum(&out, &want.row_of_route, Some(&probs), t, h, k, cap, &mut y_want);
    assert_bitwise(&format!("{}: unpermute y", c.name), &download(s, &y_d), &y_want);

    // permute backward: dx[t] = sum of the token's rows.
    let mut dx_want = vec![poison::<T>(); c.t_max * h + GUARD];
    let mut dx_d = upload(s, &dx_want);
    plan.permute_backward(s, &out_d, &maps.row_of_route, tokens, &mut dx_d).unwrap();
    r::gather_sum::<T, P>(&out, &want.row_of_route, None, t, h, k, cap, &mut dx_want);
    assert_bitwise(&format!("{}: permute_backward dx", c.name), &download(s, &dx_d), &dx_want);

    // unpermute backward
    let dy: Vec<T> = (0..c.t_max * h).map(|_| small_int(&mut rng)).collect();
    let dy_d = upload(s, &dy);
    let mut drows_want = vec![poison::<T>(); cap * h + GUARD];
    let mut dprobs_want = vec![poison::<P>(); c.t_max * k + GUARD];
    let mut drows_d = upload(s, &drows_want);
    let mut dprobs_d = upload(s, &dprobs_want);
    plan.unpermute_backward(s, &dy_d, &out_d, &maps.row_of_route, &probs_d, tokens, &mut drows_d, &mut dprobs_d)
        .unwrap();
    r::unpermute_backward(&dy, &out, &want.row_of_route, &probs, t, h, k, cap, &mut drows_want, &mut dprobs_want);
    assert_bitwise(&format!("{}: unpermute_backward drows", c.name), &download(s, &drows_d), &drows_want);
    assert_bitwise(&format!("{}: unpermute_backward dprobs", c.name), &download(s, &dprobs_d), &dprobs_want);

    // The weighted-fc1 path's glue: probs in row order, and per-row dprob partials (three
    // column slices, either sign) summed back per route.
    let mut prob_rows_want = vec![f32::from_bits(0x5a5a_5a5a); cap + GUARD];
    let mut prob_rows_d = upload(s, &prob_rows_want);
    plan.row_probs(s, &maps.row_of_route, &probs_d, tokens, &mut prob_rows_d).unwrap();
    r::row_probs(&want.row_of_route, &probs, t, k, cap, &mut prob_rows_want);
    assert_bitwise(&format!("{}: row_probs", c.name), &download(s, &prob_rows_d), &prob_rows_want);
    const SLICES: usize = 3;
    let partials: Vec<f32> = (0..cap * SLICES).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let partials_d = upload(s, &partials);
    let mut route_dprobs_want = vec![poison::<P>(); c.t_max * k + GUARD];
    let mut route_dprobs_d = upload(s, &route_dprobs_want);
    plan.route_dprobs(s, &maps.row_of_route, &partials_d, SLICES, tokens, &mut route_dprobs_d).unwrap();
    r::route_dprobs(&want.row_of_route, &partials, SLICES, t, k, cap, &mut route_dprobs_want);
    assert_bitwise(&format!("{}: route_dprobs", c.name), &download(s, &route_dprobs_d), &route_dprobs_want);

    // SwiGLU forward / backward on the fc1 output [gate | up], rows < offsets[E] only.
    let mut hbuf: Vec<T> = (0..cap * 2 * f).map(|_| T::from_f32(rng.random_range(-4.0f32..4.0))).collect();
    hbuf.extend(std::iter::repeat_n(poison::<T>(), GUARD));
    let h_d = upload(s, &hbuf);
    let mut act_want = vec![poison::<T>(); cap * f + GUARD];
    let mut act_d = upload(s, &act_want);
    plan.swiglu(s, &h_d, &maps.offsets, &mut act_d).unwrap();
    r::swiglu(&hbuf, total, f, &mut act_want);
    let act_error = swiglu_fp32_error(&act_want);
    assert_close(&format!("{}: swiglu act", c.name), &download(s, &act_d), &act_want, total * f, act_error);

    let mut dact: Vec<T> = (0..cap * f).map(|_| T::from_f32(rng.random_range(-2.0f32..2.0))).collect();
    dact.extend(std::iter::repeat_n(poison::<T>(), GUARD));
    let dact_d = upload(s, &dact);
    let mut dh_want = vec![poison::<T>(); cap * 2 * f + GUARD];
    let mut dh_d = upload(s, &dh_want);
    plan.swiglu_backward(s, &dact_d, &h_d, &maps.offsets, &mut dh_d).unwrap();
    r::swiglu_backward(&dact, &hbuf, total, f, &mut dh_want);
    let dh_error = swiglu_backward_fp32_error(&hbuf, &dact, f);
    assert_close(&format!("{}: swiglu dh", c.name), &download(s, &dh_d), &dh_want, total * 2 * f, dh_error);
}

/// The first `n` elements within one ulp of T of the fp32 reference plus `fp32_error(i)`, a
/// bound on how far the two fp32 computations may drift apart before rounding (the kernels'
/// `__expf` against the reference's `exp`; NaN never passes); the rest bitwise (the untouched
/// poison).
fn assert_close<T: Scalar + Pod>(what: &str, got: &[T], want: &[T], n: usize, fp32_error: impl Fn(usize) -> f64) {
    let mantissa = if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f16>() { 10 } else { 7 };
    for i in 0..n {
        let (g, w) = (got[i].to_f32() as f64, want[i].to_f32() as f64);
        let allowed = common::moe::ulp16(w, mantissa) + fp32_error(i);
        assert!(
            g.is_finite() && (g - w).abs() <= allowed,
            "{what}: element {i}: got {g}, expected {w} (allowed {allowed:.3e})"
        );
    }
    assert_bitwise(&format!("{what} (untouched tail)"), &got[n..], &want[n..]);
}

/// The fp32 error bound of SwiGLU's forward `g · s · u` at `want`: a few fp32 ulps of `s`
/// (`__expf` is within ~2 + 1.2·|g| ulps for the |g| <= 8 used here), far below 1e-5 relative.
fn swiglu_fp32_error<T: Scalar>(want: &[T]) -> impl Fn(usize) -> f64 + '_ {
    move |i| 1e-5 * want[i].to_f32().abs() as f64
}

/// The fp32 error bound of SwiGLU's backward at element `i` of dh `[rows, 2F]`
/// ([`common::moe::swiglu_backward_fp32_error`] of that element's dact, g and u).
fn swiglu_backward_fp32_error<'a, T: Scalar>(h: &'a [T], dact: &'a [T], f: usize) -> impl Fn(usize) -> f64 + 'a {
    move |i| {
        let (r, c) = (i / (2 * f), i % f);
        let value = |v: T| v.to_f32() as f64;
        common::moe::swiglu_backward_fp32_error(
            value(dact[r * f + c]),
            value(h[r * 2 * f + c]),
            value(h[r * 2 * f + f + c]),
        )
    }
}

fn case(name: &'static str, e: usize, k: usize, h: usize, f: usize, t_max: usize, tokens: TokenMode) -> Case {
    Case { name, e, k, h, f, t_max, tokens, capacity: None, expert_capacity: None }
}

#[test]
fn model_shapes_match_reference() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(10);
    // Qwen3-30B-A3B: E = 128, top-8, H = 2048, F = 768; T = T_max.
    let c = case("qwen3-30b-a3b", 128, 8, 2048, 768, 512, TokenMode::Host(512));
    run_case::<bf16, f32>(&s, &c, topk_ids(&mut rng, 512, 128, 8), 11);
    // DeepSeek-V3: E = 256, top-8, H = 7168, F = 2048; T on the device.
    let c = case("deepseek-v3", 256, 8, 7168, 2048, 192, TokenMode::Device(150));
    run_case::<bf16, bf16>(&s, &c, topk_ids(&mut rng, 192, 256, 8), 12);
    // Mixtral 8x7B: E = 8, top-2, H = 4096, F = 14336; fp16 activations and probs.
    let c = case("mixtral-8x7b", 8, 2, 4096, 14336, 64, TokenMode::Host(61));
    run_case::<f16, f16>(&s, &c, topk_ids(&mut rng, 64, 8, 2), 13);
    let c = case("mixtral fp16/f32", 8, 2, 1024, 512, 100, TokenMode::Host(100));
    run_case::<f16, f32>(&s, &c, topk_ids(&mut rng, 100, 8, 2), 14);
}

#[test]
fn awkward_routings_match_reference() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(20);
    // Most experts empty.
    let c = case("empty experts", 64, 2, 64, 32, 16, TokenMode::Host(5));
    run_case::<bf16, f32>(&s, &c, topk_ids(&mut rng, 16, 64, 2), 21);
    // All tokens on one expert, across several 1024-route chunks.
    let c = case("all to one expert", 16, 1, 64, 32, 3000, TokenMode::Host(3000));
    run_case::<bf16, f32>(&s, &c, vec![7; 3000], 22);
    // One expert, odd T.
    let c = case("one expert", 1, 1, 64, 32, 77, TokenMode::Host(77));
    run_case::<bf16, f32>(&s, &c, vec![0; 77], 23);
    // Duplicates within a token (two routes each), empty slots (-1, no flag), bad ids (flag).
    let ids: Vec<i32> = (0..200 * 4).map(|_| rng.random_range(-2..10)).collect();
    let c = case("duplicates and bad ids", 8, 4, 64, 32, 200, TokenMode::Host(190));
    run_case::<bf16, f32>(&s, &c, ids, 24);
    // Every route to the same expert twice: k = 2, duplicate ids.
    let c = case("duplicate pair", 4, 2, 64, 32, 50, TokenMode::Host(50));
    run_case::<bf16, f32>(&s, &c, vec![3; 100], 25);
}

#[test]
fn token_count_edges() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(30);
    let ids = topk_ids(&mut rng, 100, 16, 4);
    for (name, tokens) in [
        ("T = 0 host", TokenMode::Host(0)),
        ("T = 0 device", TokenMode::Device(0)),
        ("T = T_max host", TokenMode::Host(100)),
        ("T = T_max device", TokenMode::Device(100)),
        ("device T above T_max (clamped, flagged)", TokenMode::Device(1000)),
        ("device T negative (clamped, flagged)", TokenMode::Device(-3)),
    ] {
        run_case::<bf16, f32>(&s, &case(name, 16, 4, 64, 32, 100, tokens), ids.clone(), 31);
    }
    // An empty plan: T_max = 0.
    run_case::<bf16, f32>(&s, &case("T_max = 0", 4, 2, 64, 32, 0, TokenMode::Host(0)), vec![], 32);
}

#[test]
fn capacity_overflow_drops_and_flags_without_oob() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(40);
    let ids = topk_ids(&mut rng, 300, 32, 4);
    let mut c = case("capacity 500 < 1200 routes", 32, 4, 64, 32, 300, TokenMode::Host(300));
    c.capacity = Some(500);
    run_case::<bf16, f32>(&s, &c, ids.clone(), 41);
    c.name = "expert capacity 30";
    c.capacity = None;
    c.expert_capacity = Some(30);
    run_case::<bf16, f32>(&s, &c, ids.clone(), 42);
    c.name = "both limits, device T";
    c.capacity = Some(333);
    c.tokens = TokenMode::Device(250);
    run_case::<bf16, f32>(&s, &c, ids.clone(), 43);
    c.name = "capacity 0";
    c.capacity = Some(0);
    c.expert_capacity = None;
    run_case::<bf16, f32>(&s, &c, ids, 44);
}

#[test]
fn large_route_counts_and_many_experts() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(50);
    // 65536 routes (64 chunks), E = 512.
    let c = case("E=512 T=8192 top-8", 512, 8, 64, 32, 8192, TokenMode::Device(8000));
    run_case::<bf16, f32>(&s, &c, topk_ids(&mut rng, 8192, 512, 8), 51);
    // E = 1024 (the limit), top-1; skewed routing.
    let ids: Vec<i32> = (0..5000).map(|_| (rng.random_range(0..1024u32).pow(2) / 1024) as i32).collect();
    let c = case("E=1024 skewed", 1024, 1, 64, 32, 5000, TokenMode::Host(5000));
    run_case::<bf16, f32>(&s, &c, ids, 52);
}

#[test]
fn random_floats_are_bitwise_deterministic() {
    // Random (non-integer) data: two launches agree bitwise and match the reference recipe
    // (fp32 fma in ascending slot order, one rounding).
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(60);
    let (e, k, h, t) = (64, 8, 1024, 256);
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: 64,
        topk: k,
        max_tokens: t,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let ids = topk_ids(&mut rng, t, e, k);
    let want = r::build(&ids, t, t, e, k, t * k, 0);
    let mut maps = plan.alloc_maps(&s).unwrap();
    plan.build(&s, &upload(&s, &ids), Tokens::Host(t), &mut maps).unwrap();
    let rows: Vec<bf16> = (0..t * k * h).map(|_| bf16::from_f32(rng.random_range(-3.0f32..3.0))).collect();
    let probs: Vec<f32> = (0..t * k).map(|_| rng.random_range(0.0f32..1.0)).collect();
    let (rows_d, probs_d) = (upload(&s, &rows), upload(&s, &probs));
    let mut y1 = s.alloc_zeros::<bf16>(t * h).unwrap();
    let mut y2 = s.alloc_zeros::<bf16>(t * h).unwrap();
    plan.unpermute(&s, &rows_d, &maps.row_of_route, &probs_d, Tokens::Host(t), &mut y1).unwrap();
    plan.unpermute(&s, &rows_d, &maps.row_of_route, &probs_d, Tokens::Host(t), &mut y2).unwrap();
    let mut y_want = vec![bf16::from_f32(0.0); t * h];
    r::gather_sum(&rows, &want.row_of_route, Some(&probs), t, h, k, t * k, &mut y_want);
    let (g1, g2) = (download(&s, &y1), download(&s, &y2));
    assert_bitwise("two launches", &g1, &g2);
    assert_bitwise("unpermute vs reference", &g1, &y_want);
}

/// Maps straight from `alloc_maps` say "no row" for every route, so permute and the
/// unpermute backward on them write nothing (rather than race on row 0).
#[test]
fn maps_never_built_are_no_ops() {
    let s = gpu_or_skip!();
    let _g = serial();
    let (e, k, h, t) = (8, 2, 64, 40);
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: 32,
        topk: k,
        max_tokens: t,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let maps = plan.alloc_maps(&s).unwrap();
    assert!(download(&s, &maps.row_of_route).iter().all(|&r| r == -1), "row_of_route starts unmapped");
    assert!(download(&s, &maps.token_of_row).iter().all(|&r| r == -1), "token_of_row starts unmapped");
    let x: Vec<bf16> = (0..t * h).map(|i| bf16::from_f32((i % 7) as f32)).collect();
    let poison = vec![bf16::from_bits(0x7fa5); t * k * h];
    let mut rows = upload(&s, &poison);
    plan.permute(&s, &upload(&s, &x), &maps.row_of_route, Tokens::Host(t), &mut rows).unwrap();
    assert_bitwise("permute on unbuilt maps", &download(&s, &rows), &poison);

    // The unpermute backward: no route has a row, so drows stays poisoned and every dprob is the
    // reference's (an empty dot product: 0), written over its poison.
    let dy: Vec<bf16> = (0..t * h).map(|i| bf16::from_f32((i % 5) as f32 - 2.0)).collect();
    let kept: Vec<bf16> = (0..t * k * h).map(|i| bf16::from_f32((i % 3) as f32)).collect();
    let probs: Vec<f32> = (0..t * k).map(|i| 0.25 + (i % 4) as f32 * 0.125).collect();
    let dprobs_poison = vec![f32::from_bits(0x7fc0_0001); t * k];
    let mut drows = upload(&s, &poison);
    let mut dprobs = upload(&s, &dprobs_poison);
    let row_of_route = download(&s, &maps.row_of_route);
    plan.unpermute_backward(
        &s,
        &upload(&s, &dy),
        &upload(&s, &kept),
        &maps.row_of_route,
        &upload(&s, &probs),
        Tokens::Host(t),
        &mut drows,
        &mut dprobs,
    )
    .unwrap();
    let (mut drows_want, mut dprobs_want) = (poison.clone(), dprobs_poison);
    r::unpermute_backward(&dy, &kept, &row_of_route, &probs, t, h, k, t * k, &mut drows_want, &mut dprobs_want);
    assert_bitwise("unpermute backward's drows on unbuilt maps", &download(&s, &drows), &drows_want);
    assert_bitwise("unpermute backward's dprobs on unbuilt maps", &download(&s, &dprobs), &dprobs_want);
    assert!(dprobs_want.iter().all(|&p| p == 0.0), "the reference writes 0 for a route without a row");
}

#[test]
fn megatron_map_conversion_matches_reference() {
    let s = gpu_or_skip!();
    let _g = serial();
    let mut rng = StdRng::seed_from_u64(70);
    for &(e, k, t_max, t, p_hit) in
        &[(64usize, 8usize, 300usize, 300usize, 0.1f64), (200, 4, 100, 90, 0.03), (8, 2, 40, 40, 0.5)]
    {
        let plan = RoutingPlan::new(RoutingConfig {
            num_experts: e,
            hidden: 64,
            ffn: 32,
            topk: k,
            max_tokens: t_max,
            capacity: None,
            expert_capacity: None,
            dtype: DType::Bf16,
            prob_dtype: DType::F32,
        })
        .unwrap();
        let map: Vec<u8> =
            (0..t_max * e).map(|_| if rng.random_bool(p_hit) { rng.random_range(1..=255) } else { 0 }).collect();
        let map_probs: Vec<f32> = (0..t_max * e).map(|_| rng.random_range(0.0f32..1.0)).collect();
        let mut ids_want = vec![POISON_I32; t_max * k + GUARD];
        let mut probs_want = vec![f32::from_bits(0x7fa5_a5a5); t_max * k + GUARD];
        let fl = r::from_map(&map, &map_probs, t, e, k, &mut ids_want, &mut probs_want);
        let mut ids_d = upload(&s, &ids_want_poison(t_max * k));
        let mut probs_d = upload(&s, &vec![f32::from_bits(0x7fa5_a5a5); t_max * k + GUARD]);
        let mut flags_d = upload(&s, &[0i32]);
        let t_dev = upload(&s, &[t as i32]);
        plan.from_map(
            &s,
            &upload(&s, &map),
            &upload(&s, &map_probs),
            Tokens::Device(&t_dev),
            &mut ids_d,
            &mut probs_d,
            &mut flags_d,
        )
        .unwrap();
        assert_bitwise("from_map ids", &download(&s, &ids_d), &ids_want);
        assert_bitwise("from_map probs", &download(&s, &probs_d), &probs_want);
        assert_eq!(download(&s, &flags_d)[0], fl, "from_map flags (E = {e}, k = {k})");
        if p_hit == 0.5 {
            assert_eq!(fl, flags::TOO_MANY, "the dense case must overflow k = 2");
        }
    }
}

fn ids_want_poison(n: usize) -> Vec<i32> {
    vec![POISON_I32; n + GUARD]
}

#[test]
fn launchers_reject_bad_buffers_before_launching() {
    let s = gpu_or_skip!();
    let _g = serial();
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: 8,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 10,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let ids = upload(&s, &[0i32; 19]);
    let mut maps = plan.alloc_maps(&s).unwrap();
    let e = plan.build(&s, &ids, Tokens::Host(10), &mut maps).unwrap_err();
    assert!(matches!(e, capturable_moe::Error::Shape { what: "expert_ids", .. }), "{e}");
    let ids = upload(&s, &[0i32; 20]);
    let e = plan.build(&s, &ids, Tokens::Host(11), &mut maps).unwrap_err();
    assert!(matches!(e, capturable_moe::Error::InvalidArgument { .. }), "{e}");
    let x = upload(&s, &vec![f16::from_f32(1.0); 640]);
    let mut rows = upload(&s, &vec![f16::from_f32(0.0); 20 * 64]);
    let e = plan.permute(&s, &x, &maps.row_of_route, Tokens::Host(10), &mut rows).unwrap_err();
    assert!(matches!(e, capturable_moe::Error::Unsupported { .. }), "fp16 into a bf16 plan: {e}");
    let x = upload(&s, &vec![bf16::from_f32(1.0); 641]);
    let mut rows = upload(&s, &vec![bf16::from_f32(0.0); 20 * 64]);
    let x_view = x.slice(1..);
    let e = plan.permute(&s, &x_view, &maps.row_of_route, Tokens::Host(10), &mut rows).unwrap_err();
    assert!(matches!(e, capturable_moe::Error::InvalidArgument { .. }), "misaligned view: {e}");
    // Raw entry points: scalar arrays off their natural alignment are refused before any launch
    // (on the device they would fault and poison the context).
    let rows = upload(&s, &vec![bf16::from_f32(0.0); 20 * 64]);
    let probs = upload(&s, &[0.5f32; 21]);
    let mut y = upload(&s, &vec![bf16::from_f32(0.0); 640]);
    let (rows_p, ror_p, probs_p, y_p) =
        (rows.device_ptr(&s).0, maps.row_of_route.device_ptr(&s).0, probs.device_ptr(&s).0, y.device_ptr_mut(&s).0);
    for (what, ror, pr) in [("row_of_route + 2 bytes", ror_p + 2, probs_p), ("probs + 2 bytes", ror_p, probs_p + 2)] {
        // SAFETY: the pointers are checked and refused before anything is launched.
        let e = unsafe { plan.unpermute_raw(&s, rows_p, ror, pr, 10, 0, y_p) }.unwrap_err();
        assert!(
            matches!(e, capturable_moe::Error::InvalidArgument { .. }) && e.to_string().contains("aligned"),
            "{what}: {e}"
        );
    }
}

/// Captures build -> permute -> SwiGLU -> unpermute -> their backwards once, with T on the
/// device, then replays the graph with new routing, probs, inputs and T 120 times, checking
/// every output of every replay against the reference.
#[test]
fn graph_replays_with_new_routing() {
    let s = gpu_or_skip!();
    let _g = serial();
    let ctx = s.context().clone();
    unsafe { ctx.disable_event_tracking() };
    const DPROBS_SENTINEL: f32 = -12345.0;
    const POISON: bf16 = bf16::from_bits(0x7fa5);
    let (e, k, h, f, t_max, cap) = (16usize, 4usize, 64usize, 32usize, 256usize, 700usize);
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: f,
        topk: k,
        max_tokens: t_max,
        capacity: Some(cap),
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let mut rng = StdRng::seed_from_u64(80);
    let mut ids_d = s.alloc_zeros::<i32>(t_max * k).unwrap();
    let mut probs_d = s.alloc_zeros::<f32>(t_max * k).unwrap();
    let mut x_d = s.alloc_zeros::<bf16>(t_max * h).unwrap();
    let mut dy_d = s.alloc_zeros::<bf16>(t_max * h).unwrap();
    let mut t_d = s.alloc_zeros::<i32>(1).unwrap();
    let mut maps = plan.alloc_maps(&s).unwrap();
    let mut rows_d = s.alloc_zeros::<bf16>(cap * h).unwrap();
    let mut act_d = s.alloc_zeros::<bf16>(cap * f).unwrap();
    let mut y_d = s.alloc_zeros::<bf16>(t_max * h).unwrap();
    let mut drows_d = s.alloc_zeros::<bf16>(cap * h).unwrap();
    let mut dprobs_d = s.alloc_zeros::<f32>(t_max * k).unwrap();
    let mut dx_d = s.alloc_zeros::<bf16>(t_max * h).unwrap();
    // The "fc1 output" stands in for a GEMM: SwiGLU reads the permuted rows as [gate | up]
    // (h = 2F columns), so its input changes with every replay too.
    assert_eq!(h, 2 * f);
    s.synchronize().unwrap();

    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let tokens = Tokens::Device(&t_d);
    plan.build(&s, &ids_d, tokens, &mut maps).unwrap();
    plan.permute(&s, &x_d, &maps.row_of_route, tokens, &mut rows_d).unwrap();
    plan.swiglu(&s, &rows_d, &maps.offsets, &mut act_d).unwrap();
    plan.unpermute(&s, &rows_d, &maps.row_of_route, &probs_d, tokens, &mut y_d).unwrap();
    plan.unpermute_backward(&s, &dy_d, &rows_d, &maps.row_of_route, &probs_d, tokens, &mut drows_d, &mut dprobs_d)
        .unwrap();
    plan.permute_backward(&s, &drows_d, &maps.row_of_route, tokens, &mut dx_d).unwrap();
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");

    let mut overflowed = 0;
    for replay in 0..120 {
        let t = match replay % 10 {
            0 => 0,
            1 => t_max,
            _ => rng.random_range(1..=t_max),
        };
        let ids: Vec<i32> =
            if replay % 7 == 3 { vec![(replay % e) as i32; t_max * k] } else { topk_ids(&mut rng, t_max, e, k) };
        let probs: Vec<f32> = (0..t_max * k).map(|_| dyadic(&mut rng)).collect();
        let x: Vec<bf16> = (0..t_max * h).map(|_| small_int(&mut rng)).collect();
        let dy: Vec<bf16> = (0..t_max * h).map(|_| small_int(&mut rng)).collect();
        s.memcpy_htod(&ids, &mut ids_d).unwrap();
        s.memcpy_htod(&probs, &mut probs_d).unwrap();
        s.memcpy_htod(&x, &mut x_d).unwrap();
        s.memcpy_htod(&dy, &mut dy_d).unwrap();
        s.memcpy_htod(&[t as i32], &mut t_d).unwrap();
        s.memcpy_htod(&[0i32], &mut maps.flags).unwrap();
        // Poison the outputs so a stale value from the previous replay cannot pass, and every
        // element a kernel must not write (rows past the total, tokens t >= T) keeps the
        // poison; dprobs rows t >= T must likewise still hold the sentinel afterwards.
        for buf in [&mut rows_d, &mut act_d, &mut y_d, &mut drows_d, &mut dx_d] {
            let len = buf.len();
            s.memcpy_htod(&vec![POISON; len], buf).unwrap();
        }
        s.memcpy_htod(&vec![DPROBS_SENTINEL; t_max * k], &mut dprobs_d).unwrap();
        graph.launch().unwrap();
        s.synchronize().unwrap();

        let ctx_msg = format!("replay {replay} (T = {t})");
        let want = r::build(&ids, t, t_max, e, k, cap, 0);
        overflowed += (want.flags & flags::CAPACITY != 0) as usize;
        assert_eq!(download(&s, &maps.flags)[0], want.flags, "{ctx_msg}: flags");
        assert_eq!(download(&s, &maps.m_splits_i64), want.m_splits, "{ctx_msg}: m_splits");
        let m32: Vec<i32> = want.m_splits.iter().map(|&m| m as i32).collect();
        assert_eq!(download(&s, &maps.m_splits_i32), m32, "{ctx_msg}: m_splits_i32");
        assert_eq!(download(&s, &maps.expert_counts), want.expert_counts, "{ctx_msg}: expert_counts");
        assert_eq!(download(&s, &maps.offsets), want.offsets, "{ctx_msg}: offsets");
        assert_eq!(download(&s, &maps.row_of_route), want.row_of_route, "{ctx_msg}: row_of_route");
        assert_eq!(download(&s, &maps.token_of_row), want.token_of_row, "{ctx_msg}: token_of_row");
        let mut rows = vec![POISON; cap * h];
        r::permute(&x, &want.row_of_route, t, h, k, cap, &mut rows);
        assert_bitwise(&format!("{ctx_msg}: rows"), &download(&s, &rows_d), &rows);
        let total = want.offsets[e] as usize;
        // Rows past the total keep the poison (assert_close compares that tail bit for bit).
        let mut act_want = vec![POISON; cap * f];
        r::swiglu(&rows, total, f, &mut act_want);
        let act_error = swiglu_fp32_error(&act_want);
        assert_close(&format!("{ctx_msg}: act"), &download(&s, &act_d), &act_want, total * f, act_error);
        let mut y = vec![POISON; t_max * h];
        r::gather_sum(&rows, &want.row_of_route, Some(&probs), t, h, k, cap, &mut y);
        assert_bitwise(&format!("{ctx_msg}: y"), &download(&s, &y_d), &y);
        let mut drows = vec![POISON; cap * h];
        let mut dprobs = vec![DPROBS_SENTINEL; t_max * k];
        r::unpermute_backward(&dy, &rows, &want.row_of_route, &probs, t, h, k, cap, &mut drows, &mut dprobs);
        assert_bitwise(&format!("{ctx_msg}: drows"), &download(&s, &drows_d), &drows);
        assert_bitwise(&format!("{ctx_msg}: dprobs"), &download(&s, &dprobs_d), &dprobs);
        let mut dx = vec![POISON; t_max * h];
        r::gather_sum::<bf16, f32>(&drows, &want.row_of_route, None, t, h, k, cap, &mut dx);
        assert_bitwise(&format!("{ctx_msg}: dx"), &download(&s, &dx_d), &dx);
    }
    assert!(overflowed > 0 && overflowed < 120, "replays should both fit and overflow capacity ({overflowed})");
}

/// Timings of every kernel at the target shape (E = 128, T = 4096, top-8, H = 2048,
/// F = 768), bf16 / fp32 probs, with the effective bandwidth. Run with `--ignored`.
#[test]
#[ignore = "performance report, run explicitly"]
fn perf_report_target_shape() {
    if common::skip_under_sanitizer() {
        return;
    }
    let s = gpu_or_skip!();
    let _g = serial();
    unsafe { s.context().disable_event_tracking() };
    let (e, k, h, f, t) = (128usize, 8usize, 2048usize, 768usize, 4096usize);
    let plan = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: f,
        topk: k,
        max_tokens: t,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let cap = plan.capacity();
    let mut rng = StdRng::seed_from_u64(90);
    let ids = upload(&s, &topk_ids(&mut rng, t, e, k));
    let probs = upload(&s, &(0..t * k).map(|_| rng.random_range(0.0f32..1.0)).collect::<Vec<_>>());
    let rand_bf16 =
        |n: usize, rng: &mut StdRng| (0..n).map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0))).collect::<Vec<_>>();
    let x = upload(&s, &rand_bf16(t * h, &mut rng));
    let dy = upload(&s, &rand_bf16(t * h, &mut rng));
    let hbuf = upload(&s, &rand_bf16(cap * 2 * f, &mut rng));
    let dact = upload(&s, &rand_bf16(cap * f, &mut rng));
    let mut maps = plan.alloc_maps(&s).unwrap();
    let mut rows = s.alloc_zeros::<bf16>(cap * h).unwrap();
    let mut drows = s.alloc_zeros::<bf16>(cap * h).unwrap();
    let mut act = s.alloc_zeros::<bf16>(cap * f).unwrap();
    let mut dh = s.alloc_zeros::<bf16>(cap * 2 * f).unwrap();
    let mut y = s.alloc_zeros::<bf16>(t * h).unwrap();
    let mut dx = s.alloc_zeros::<bf16>(t * h).unwrap();
    let mut dprobs = s.alloc_zeros::<f32>(t * k).unwrap();
    let mut copy_dst = s.alloc_zeros::<bf16>(cap * h).unwrap();
    plan.build(&s, &ids, Tokens::Host(t), &mut maps).unwrap();
    s.synchronize().unwrap();
    let capture = |body: &mut dyn FnMut()| {
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
        body();
        s.end_capture(CUgraphInstantiate_flags(0)).unwrap().unwrap()
    };
    let g_build = capture(&mut || plan.build(&s, &ids, Tokens::Host(t), &mut maps).unwrap());
    // The routing share of a forward: everything but the two grouped GEMMs (SwiGLU reads a
    // stand-in fc1 output).
    let g_fwd = capture(&mut || {
        plan.build(&s, &ids, Tokens::Host(t), &mut maps).unwrap();
        plan.permute(&s, &x, &maps.row_of_route, Tokens::Host(t), &mut rows).unwrap();
        plan.swiglu(&s, &hbuf, &maps.offsets, &mut act).unwrap();
        plan.unpermute(&s, &rows, &maps.row_of_route, &probs, Tokens::Host(t), &mut y).unwrap();
    });
    let ctx = s.context().clone();
    let time = |name: &str, bytes: f64, f: &mut dyn FnMut()| {
        let us = common::mean_gpu_us(&s, 5, 50, f);
        println!("{name:<22} {us:9.1} us  {:8.0} GB/s", bytes / us * 1e-3);
    };
    let row_bytes = (cap * h * 2) as f64;
    let tok_bytes = (t * h * 2) as f64;
    println!("routing kernels, E={e} T={t} k={k} H={h} F={f}, bf16, {}", ctx.name().unwrap());
    time("d2d copy rows (ref)", 2.0 * row_bytes, &mut || s.memcpy_dtod(&rows, &mut copy_dst).unwrap());
    time("build (graph)", (t * k * 4 * 4) as f64, &mut || g_build.launch().unwrap());
    time("forward routing (graph)", 4.0 * row_bytes, &mut || g_fwd.launch().unwrap());
    time("build", (t * k * 4 * 4) as f64, &mut || plan.build(&s, &ids, Tokens::Host(t), &mut maps).unwrap());
    time("permute", tok_bytes + row_bytes, &mut || {
        plan.permute(&s, &x, &maps.row_of_route, Tokens::Host(t), &mut rows).unwrap()
    });
    time("swiglu", (cap * f * 2 * 3) as f64, &mut || plan.swiglu(&s, &hbuf, &maps.offsets, &mut act).unwrap());
    time("unpermute", row_bytes + tok_bytes, &mut || {
        plan.unpermute(&s, &rows, &maps.row_of_route, &probs, Tokens::Host(t), &mut y).unwrap()
    });
    time("unpermute_backward", tok_bytes + 2.0 * row_bytes, &mut || {
        plan.unpermute_backward(&s, &dy, &rows, &maps.row_of_route, &probs, Tokens::Host(t), &mut drows, &mut dprobs)
            .unwrap()
    });
    time("swiglu_backward", (cap * f * 2 * 5) as f64, &mut || {
        plan.swiglu_backward(&s, &dact, &hbuf, &maps.offsets, &mut dh).unwrap()
    });
    time("permute_backward", row_bytes + tok_bytes, &mut || {
        plan.permute_backward(&s, &drows, &maps.row_of_route, Tokens::Host(t), &mut dx).unwrap()
    });
}
