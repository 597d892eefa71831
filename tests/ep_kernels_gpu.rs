//! GPU tests of the EP kernels (`ep::EpKernels`) against `ep::reference`, bit for bit: every
//! launcher on a few configurations (R = 1, 4, 8, Echo off / on, capacity ample / tight /
//! 0, the token count on the host and on the device in and out of range, bad ids, a large case
//! with many chunks and blocks, E past the shared-histogram limit), every output poisoned first
//! and followed by a poisoned guard tail. Then a CUDA graph of count -> layout -> gather ->
//! reduce -> route values with T on the device, replayed with new routing 50 times, each
//! replay checked. `ep_emulated` checks the same kernels' logic without a GPU.
mod common;

use std::sync::{Arc, MutexGuard};

use bytemuck::Pod;
use capturable_moe::dtype::DType;
use capturable_moe::ep::{flags, reference as r, DispatchLayout, EpConfig, EpKernels};
use capturable_moe::moe::MoeElement;
use capturable_moe::routing::Tokens;
use capturable_moe::Error;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const GUARD: usize = 32;

/// The tests of this binary run one at a time: the graph test captures in global mode, which
/// forbids allocations on other threads while it is open.
fn serial() -> MutexGuard<'static, ()> {
    common::CAPTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A NaN in bf16, fp16 and f32; a recognisable pattern in the integer types.
fn poison<T: Pod>() -> T {
    let bytes: Vec<u8> = match std::mem::size_of::<T>() {
        2 => 0x7fa5u16.to_le_bytes().to_vec(),
        4 => 0x7fa5_a5a5u32.to_le_bytes().to_vec(),
        _ => 0x7fa5_a5a5_a5a5_a5a5u64.to_le_bytes().to_vec(),
    };
    bytemuck::pod_read_unaligned(&bytes)
}

fn guarded<T: Pod>(v: &[T]) -> Vec<T> {
    let mut out = v.to_vec();
    out.extend(std::iter::repeat_n(poison::<T>(), GUARD));
    out
}

fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).unwrap()
}

fn poisoned<T: DeviceRepr + Pod>(s: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    upload(s, &vec![poison::<T>(); n + GUARD])
}

/// Fills an existing buffer (same address, e.g. one a graph was captured with) with the poison.
fn repoison<T: DeviceRepr + Pod>(s: &Arc<CudaStream>, d: &mut CudaSlice<T>) {
    let len = d.len();
    s.memcpy_htod(&vec![poison::<T>(); len], d).unwrap();
}

fn download<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, d: &CudaSlice<T>) -> Vec<T> {
    let v = s.clone_dtoh(d).unwrap();
    s.synchronize().unwrap();
    v
}

fn assert_bits<T: Pod + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let b = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    if b(got) != b(want) {
        let i = (0..got.len()).find(|&i| b(&got[i..i + 1]) != b(&want[i..i + 1])).unwrap();
        panic!("{what}: element {i} of {}: got {:?}, expected {:?}", got.len(), got[i], want[i]);
    }
}

/// A value with a magnitude spread over 2^-10 .. 2^10: the order and precision of sums show.
fn spread(rng: &mut StdRng) -> f32 {
    rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-10..10))
}

/// Route ids below `limit`, some -1, with `bad` some out of range.
fn ids(rng: &mut StdRng, n: usize, limit: i32, bad: bool) -> Vec<i32> {
    (0..n)
        .map(|_| {
            let x: f64 = rng.random();
            if x < 0.1 {
                -1
            } else if bad && x < 0.15 {
                [limit, -5, i32::MAX][rng.random_range(0..3)]
            } else {
                rng.random_range(0..limit)
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Count {
    Host(usize),
    Device(i32),
}

struct Case {
    name: &'static str,
    cfg: EpConfig,
    tokens: Count,
    bad_ids: bool,
}

fn config(
    ranks: usize,
    local: usize,
    spare: usize,
    hidden: usize,
    topk: usize,
    t_max: usize,
    capacity: usize,
) -> EpConfig {
    EpConfig {
        ranks,
        rank: ranks - 1,
        num_experts: ranks * local,
        spare_per_rank: spare,
        hidden,
        topk,
        max_tokens: t_max,
        capacity,
        dtype: DType::Bf16,
    }
}

/// Runs every dispatch launcher of `case` and checks it against the reference.
fn run_dispatch<T: MoeElement + Pod>(s: &Arc<CudaStream>, case: &Case, seed: u64) {
    let c = &case.cfg;
    let plan = EpKernels::new(c.clone()).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let name = case.name;
    let routes = c.routes_len();
    let (t, tok_flag, t_dev) = match case.tokens {
        Count::Host(t) => (t, 0, None),
        Count::Device(v) => {
            let (t, f) = r::resolve_tokens(v, c.max_tokens);
            (t, f, Some(upload(s, &[v])))
        }
    };
    let tokens = t_dev.as_ref().map_or(Tokens::Host(t), Tokens::Device);
    let expert_ids = ids(&mut rng, routes, c.num_experts as i32, case.bad_ids);
    let dest = ids(&mut rng, routes, (c.ranks * c.cols_per_rank()) as i32, case.bad_ids);
    let probs: Vec<f32> = (0..routes).map(|_| spread(&mut rng)).collect();
    let ids_d = upload(s, &guarded(&expert_ids));
    let dest_d = upload(s, &guarded(&dest));
    let probs_d = upload(s, &guarded(&probs));

    // count_routes
    let mut counts_d = poisoned::<i64>(s, c.num_experts);
    let mut flags_d = upload(s, &[0i32]);
    plan.count_routes(s, &ids_d, tokens, &mut counts_d, &mut flags_d).unwrap();
    let (counts, bits) = r::count_routes(c, &expert_ids, t);
    assert_bits(&format!("{name}: counts"), &download(s, &counts_d), &guarded(&counts));
    assert_eq!(download(s, &flags_d)[0], bits | tok_flag, "{name}: count_routes flags");

    // dispatch_layout
    let rows = c.block_rows();
    let mut layout = DispatchLayout {
        slot_of_route: poisoned(s, routes),
        send_ids: poisoned(s, rows),
        send_probs: poisoned(s, rows),
        send_counts: poisoned(s, c.ranks),
        dropped: poisoned(s, c.ranks),
        chunk_counts: poisoned(s, plan.layout_chunks() * c.ranks),
    };
    let mut flags_d = upload(s, &[0x100i32]);
    plan.dispatch_layout(s, &dest_d, &probs_d, tokens, &mut layout, &mut flags_d).unwrap();
    let want = r::dispatch_layout(c, &dest, &probs, t);
    assert_bits(&format!("{name}: slot_of_route"), &download(s, &layout.slot_of_route), &guarded(&want.slot_of_route));
    assert_bits(&format!("{name}: send_ids"), &download(s, &layout.send_ids), &guarded(&want.send_ids));
    assert_bits(&format!("{name}: send_probs"), &download(s, &layout.send_probs), &guarded(&want.send_probs));
    assert_bits(&format!("{name}: send_counts"), &download(s, &layout.send_counts), &guarded(&want.send_counts));
    assert_bits(&format!("{name}: dropped"), &download(s, &layout.dropped), &guarded(&want.dropped));
    assert_eq!(download(s, &flags_d)[0], 0x100 | want.flags | tok_flag, "{name}: dispatch_layout flags");

    // The row kernels read the layout's map (device copy), junk slots past T included.
    let mut map = want.slot_of_route.clone();
    for s_ in map.iter_mut().skip(t * c.topk) {
        if rows > 0 {
            *s_ = rng.random_range(0..rows as i32);
        }
    }
    let map_d = upload(s, &guarded(&map));
    let h = c.hidden;
    let x: Vec<T> = (0..c.tokens_len()).map(|_| T::from_f32(spread(&mut rng))).collect();
    let mut rows_d = poisoned::<T>(s, rows * h);
    plan.gather_rows(s, &upload(s, &guarded(&x)), &map_d, tokens, &mut rows_d).unwrap();
    let mut rows_want = vec![poison::<T>(); rows * h + GUARD];
    r::gather_rows(c, &x, &map, t, &mut rows_want);
    assert_bits(&format!("{name}: gather_rows"), &download(s, &rows_d), &rows_want);

    let block: Vec<T> = (0..rows * h).map(|_| T::from_f32(spread(&mut rng))).collect();
    let mut y_d = poisoned::<T>(s, c.tokens_len());
    plan.reduce_rows(s, &upload(s, &guarded(&block)), &map_d, tokens, &mut y_d).unwrap();
    let mut y_want = vec![poison::<T>(); c.tokens_len() + GUARD];
    r::reduce_rows(c, &block, &map, t, &mut y_want);
    assert_bits(&format!("{name}: reduce_rows"), &download(s, &y_d), &y_want);

    let values: Vec<f32> = (0..rows).map(|_| spread(&mut rng)).collect();
    let mut out_d = poisoned::<f32>(s, routes);
    plan.gather_route_values(s, &upload(s, &guarded(&values)), &map_d, tokens, &mut out_d).unwrap();
    let mut out_want = vec![poison::<f32>(); routes + GUARD];
    r::gather_route_values(c, &values, &map, t, &mut out_want);
    assert_bits(&format!("{name}: gather_route_values"), &download(s, &out_d), &out_want);
}

fn dispatch_cases() -> Vec<Case> {
    let tight = |c: EpConfig| {
        let cap = (c.routes_len() / c.ranks / 2).max(1);
        EpConfig { capacity: cap, ..c }
    };
    vec![
        Case {
            name: "R = 1, no Echo, ample",
            cfg: config(1, 8, 0, 64, 2, 100, 200),
            tokens: Count::Host(77),
            bad_ids: false,
        },
        Case {
            name: "R = 4, Echo 2, tight",
            cfg: tight(config(4, 4, 2, 128, 4, 300, 0)),
            tokens: Count::Host(300),
            bad_ids: true,
        },
        Case {
            name: "R = 8, Echo 1, capacity 0",
            cfg: config(8, 2, 1, 64, 2, 50, 0),
            tokens: Count::Device(40),
            bad_ids: false,
        },
        Case {
            name: "R = 2, device T past T_max",
            cfg: config(2, 3, 0, 64, 3, 64, 96),
            tokens: Count::Device(1000),
            bad_ids: true,
        },
        Case {
            name: "R = 4, device T negative",
            cfg: config(4, 2, 1, 64, 2, 64, 64),
            tokens: Count::Device(-1),
            bad_ids: false,
        },
        Case {
            name: "R = 8, large, tight",
            cfg: tight(config(8, 8, 2, 1024, 8, 4096, 0)),
            tokens: Count::Host(4000),
            bad_ids: true,
        },
        Case {
            name: "R = 2, E = 16384 (global histogram)",
            cfg: config(2, 8192, 0, 64, 8, 512, 4096),
            tokens: Count::Host(500),
            bad_ids: true,
        },
        Case { name: "R = 4, k = 32", cfg: config(4, 16, 0, 64, 32, 64, 512), tokens: Count::Host(60), bad_ids: false },
        Case { name: "R = 2, T_max = 0", cfg: config(2, 2, 1, 64, 2, 0, 4), tokens: Count::Host(0), bad_ids: false },
    ]
}

#[test]
fn dispatch_launchers_match_the_reference() {
    let _g = serial(); // before the stream: opening one syncs, which must not land in a capture
    let s = gpu_or_skip!();
    for (i, case) in dispatch_cases().iter().enumerate() {
        run_dispatch::<bf16>(&s, case, 100 + i as u64);
    }
    let mut f16_case = dispatch_cases().swap_remove(1);
    f16_case.cfg.dtype = DType::F16;
    f16_case.name = "R = 4, Echo 2, tight, fp16";
    run_dispatch::<f16>(&s, &f16_case, 7);
}

fn slot_table(rng: &mut StdRng, c: &EpConfig, bad: bool) -> Vec<i64> {
    (0..c.global_slots())
        .map(|_| {
            let x: f64 = rng.random();
            if x < 0.2 {
                -1
            } else if bad && x < 0.3 {
                [c.num_experts as i64, -2, i64::MAX][rng.random_range(0..3)]
            } else {
                rng.random_range(0..c.num_experts as i64)
            }
        })
        .collect()
}

#[test]
fn spare_weight_launchers_match_the_reference() {
    let _g = serial(); // before the stream: opening one syncs, which must not land in a capture
    let s = gpu_or_skip!();
    let mut rng = StdRng::seed_from_u64(9);
    let cases = [
        (config(1, 4, 2, 64, 2, 8, 8), 64usize, false),
        (config(4, 4, 3, 64, 2, 8, 8), 4096, true),
        (config(8, 2, 40, 64, 2, 8, 8), 520, true), // 320 global slots: the fold's chunks
        (config(2, 1, 1, 64, 2, 8, 8), 8 * (262_144 + 8), false), // grid-stride over elements
    ];
    for (c, per, bad) in cases {
        let plan = EpKernels::new(c.clone()).unwrap();
        let name = format!("R = {}, S_per = {}, {per} per expert", c.ranks, c.spare_per_rank);
        let (l, g, sp) = (c.local_experts(), c.global_slots(), c.spare_per_rank);
        let slots = slot_table(&mut rng, &c, bad);
        let slots_d = upload(&s, &guarded(&slots));
        let w = |rng: &mut StdRng, n: usize| -> Vec<bf16> { (0..n).map(|_| bf16::from_f32(spread(rng))).collect() };

        let home = w(&mut rng, l * per);
        let mut send_d = poisoned::<bf16>(&s, g * per);
        let mut flags_d = upload(&s, &[0i32]);
        plan.pack_spare_weights(&s, &slots_d, &upload(&s, &guarded(&home)), per, &mut send_d, &mut flags_d).unwrap();
        let mut send = vec![poison::<bf16>(); g * per + GUARD];
        let bits = r::pack_spare_weights(&c, &slots, &home, per, &mut send);
        assert_bits(&format!("{name}: pack"), &download(&s, &send_d), &send);
        assert_eq!(download(&s, &flags_d)[0], bits, "{name}: pack flags");

        let recv = w(&mut rng, g * per);
        let mut spare_d = poisoned::<bf16>(&s, sp * per);
        let mut flags_d = upload(&s, &[0i32]);
        plan.select_spare_weights(&s, &slots_d, &upload(&s, &guarded(&recv)), per, &mut spare_d, &mut flags_d).unwrap();
        let mut spare = vec![poison::<bf16>(); sp * per + GUARD];
        let bits = r::select_spare_weights(&c, &slots, &recv, per, &mut spare);
        assert_bits(&format!("{name}: select"), &download(&s, &spare_d), &spare);
        assert_eq!(download(&s, &flags_d)[0], bits, "{name}: select flags");

        let per4 = per / 2;
        let grads: Vec<f32> = (0..g * per4).map(|_| spread(&mut rng)).collect();
        let dw: Vec<f32> = guarded(&(0..l * per4).map(|_| spread(&mut rng)).collect::<Vec<_>>());
        let mut dw_d = upload(&s, &dw);
        let mut flags_d = upload(&s, &[0i32]);
        plan.fold_spare_grads(&s, &slots_d, &upload(&s, &guarded(&grads)), per4, &mut dw_d, &mut flags_d).unwrap();
        let mut dw_want = dw.clone();
        let bits = r::fold_spare_grads(&c, &slots, &grads, per4, &mut dw_want);
        assert_bits(&format!("{name}: fold"), &download(&s, &dw_d), &dw_want);
        assert_eq!(download(&s, &flags_d)[0], bits, "{name}: fold flags");
    }
}

/// The host checks fire before anything is launched: wrong dtype, short buffers, host T past
/// T_max, Echo launchers without Echo, a size that is not a multiple of 16 bytes.
#[test]
fn launchers_reject_bad_buffers_before_launching() {
    let _g = serial(); // before the stream: opening one syncs, which must not land in a capture
    let s = gpu_or_skip!();
    let c = config(2, 2, 0, 64, 2, 16, 8);
    let plan = EpKernels::new(c.clone()).unwrap();
    let routes = upload(&s, &vec![0i32; c.routes_len()]);
    let short = upload(&s, &vec![0i32; c.routes_len() - 1]);
    let mut flags_d = upload(&s, &[0i32]);
    let mut counts = upload(&s, &vec![0i64; c.num_experts]);
    let err = plan.count_routes(&s, &short, Tokens::Host(1), &mut counts, &mut flags_d).unwrap_err();
    assert!(matches!(err, Error::Shape { what: "expert_ids", .. }), "{err}");
    let err = plan.count_routes(&s, &routes, Tokens::Host(17), &mut counts, &mut flags_d).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let x = upload(&s, &vec![f16::ZERO; c.tokens_len()]);
    let mut rows = upload(&s, &vec![f16::ZERO; c.rows_len()]);
    let err = plan.gather_rows(&s, &x, &routes, Tokens::Host(1), &mut rows).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let slots = upload(&s, &[0i64; 2]);
    let w = upload(&s, &[bf16::ZERO; 64]);
    let mut out = upload(&s, &[bf16::ZERO; 64]);
    let err = plan.pack_spare_weights(&s, &slots, &w, 8, &mut out, &mut flags_d).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "no Echo: {err}");
    let echo = EpKernels::new(EpConfig { spare_per_rank: 1, ..c }).unwrap();
    let err = echo.pack_spare_weights(&s, &slots, &w, 4, &mut out, &mut flags_d).unwrap_err();
    assert!(matches!(err, Error::Alignment { .. }), "8 bytes per expert: {err}");
    // 16 matrices of 2^60 elements: the buffer sizes (16 x 2^60) wrap usize to 0, which a
    // short buffer would pass; the host refuses them as an overflow (per-expert bytes fit int64).
    let wide = config(2, 16, 8, 64, 2, 16, 8);
    let wide_plan = EpKernels::new(wide.clone()).unwrap();
    let slots16 = upload(&s, &vec![0i64; wide.global_slots()]);
    let huge = 1usize << 60;
    let overflow = |what: &str, err: Error| {
        assert!(matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("overflow"), "{what}: {err}")
    };
    overflow("pack", wide_plan.pack_spare_weights(&s, &slots16, &w, huge, &mut out, &mut flags_d).unwrap_err());
    overflow("select", wide_plan.select_spare_weights(&s, &slots16, &w, huge, &mut out, &mut flags_d).unwrap_err());
    let grads = upload(&s, &[0f32; 64]);
    let mut dw = upload(&s, &[0f32; 64]);
    overflow("fold", wide_plan.fold_spare_grads(&s, &slots16, &grads, huge, &mut dw, &mut flags_d).unwrap_err());
}

/// count -> layout -> gather -> reduce -> route values captured once with T on the device, then
/// replayed with new ids, dest, probs, inputs and T; every replay checked.
#[test]
fn graph_replays_with_new_routing() {
    let _g = serial(); // before the stream: opening one syncs, which must not land in a capture
    let s = gpu_or_skip!();
    unsafe { s.context().disable_event_tracking() };
    let c = config(4, 4, 2, 256, 4, 512, 300);
    let plan = EpKernels::new(c.clone()).unwrap();
    let (routes, rows) = (c.routes_len(), c.block_rows());
    let mut rng = StdRng::seed_from_u64(55);
    let mut ids_d = s.alloc_zeros::<i32>(routes).unwrap();
    let mut dest_d = s.alloc_zeros::<i32>(routes).unwrap();
    let mut probs_d = s.alloc_zeros::<f32>(routes).unwrap();
    let mut t_d = s.alloc_zeros::<i32>(1).unwrap();
    let mut x_d = s.alloc_zeros::<bf16>(c.tokens_len()).unwrap();
    let mut back_d = s.alloc_zeros::<bf16>(c.rows_len()).unwrap();
    let mut values_d = s.alloc_zeros::<f32>(rows).unwrap();
    let mut counts_d = s.alloc_zeros::<i64>(c.num_experts).unwrap();
    let mut flags_d = s.alloc_zeros::<i32>(1).unwrap();
    let mut layout = plan.alloc_layout(&s).unwrap();
    let mut rows_d = s.alloc_zeros::<bf16>(c.rows_len()).unwrap();
    let mut y_d = s.alloc_zeros::<bf16>(c.tokens_len()).unwrap();
    let mut out_d = s.alloc_zeros::<f32>(routes).unwrap();
    s.synchronize().unwrap();

    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let tokens = Tokens::Device(&t_d);
    plan.count_routes(&s, &ids_d, tokens, &mut counts_d, &mut flags_d).unwrap();
    plan.dispatch_layout(&s, &dest_d, &probs_d, tokens, &mut layout, &mut flags_d).unwrap();
    plan.gather_rows(&s, &x_d, &layout.slot_of_route, tokens, &mut rows_d).unwrap();
    plan.reduce_rows(&s, &back_d, &layout.slot_of_route, tokens, &mut y_d).unwrap();
    plan.gather_route_values(&s, &values_d, &layout.slot_of_route, tokens, &mut out_d).unwrap();
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");

    let mut overflowed = 0;
    for replay in 0..50 {
        let t = match replay % 10 {
            0 => 0,
            1 => c.max_tokens,
            _ => rng.random_range(1..=c.max_tokens),
        };
        let expert_ids = ids(&mut rng, routes, c.num_experts as i32, false);
        let dest = ids(&mut rng, routes, (c.ranks * c.cols_per_rank()) as i32, replay % 5 == 2);
        let probs: Vec<f32> = (0..routes).map(|_| spread(&mut rng)).collect();
        let x: Vec<bf16> = (0..c.tokens_len()).map(|_| bf16::from_f32(spread(&mut rng))).collect();
        let back: Vec<bf16> = (0..c.rows_len()).map(|_| bf16::from_f32(spread(&mut rng))).collect();
        let values: Vec<f32> = (0..rows).map(|_| spread(&mut rng)).collect();
        s.memcpy_htod(&expert_ids, &mut ids_d).unwrap();
        s.memcpy_htod(&dest, &mut dest_d).unwrap();
        s.memcpy_htod(&probs, &mut probs_d).unwrap();
        s.memcpy_htod(&x, &mut x_d).unwrap();
        s.memcpy_htod(&back, &mut back_d).unwrap();
        s.memcpy_htod(&values, &mut values_d).unwrap();
        s.memcpy_htod(&[t as i32], &mut t_d).unwrap();
        s.memcpy_htod(&[0i32], &mut flags_d).unwrap();
        // Poison every output: the counts and the layout are written in full (the eager test
        // checks that on poisoned buffers), so a replay that stopped writing them fails; rows,
        // y and route values keep the poison where the reference leaves them alone.
        repoison(&s, &mut counts_d);
        repoison(&s, &mut layout.slot_of_route);
        repoison(&s, &mut layout.send_ids);
        repoison(&s, &mut layout.send_probs);
        repoison(&s, &mut layout.send_counts);
        repoison(&s, &mut layout.dropped);
        repoison(&s, &mut rows_d);
        repoison(&s, &mut y_d);
        repoison(&s, &mut out_d);
        graph.launch().unwrap();
        s.synchronize().unwrap();

        let what = format!("replay {replay} (T = {t})");
        let (counts, count_bits) = r::count_routes(&c, &expert_ids, t);
        let want = r::dispatch_layout(&c, &dest, &probs, t);
        overflowed += (want.flags & flags::OVERFLOW != 0) as usize;
        assert_eq!(download(&s, &counts_d), counts, "{what}: counts");
        assert_eq!(download(&s, &flags_d)[0], count_bits | want.flags, "{what}: flags");
        assert_eq!(download(&s, &layout.slot_of_route), want.slot_of_route, "{what}: slot_of_route");
        assert_eq!(download(&s, &layout.send_ids), want.send_ids, "{what}: send_ids");
        assert_bits(&format!("{what}: send_probs"), &download(&s, &layout.send_probs), &want.send_probs);
        assert_eq!(download(&s, &layout.send_counts), want.send_counts, "{what}: send_counts");
        assert_eq!(download(&s, &layout.dropped), want.dropped, "{what}: dropped");
        let mut rows_want = vec![poison::<bf16>(); c.rows_len()];
        r::gather_rows(&c, &x, &want.slot_of_route, t, &mut rows_want);
        assert_bits(&format!("{what}: rows"), &download(&s, &rows_d), &rows_want);
        let mut y_want = vec![poison::<bf16>(); c.tokens_len()];
        r::reduce_rows(&c, &back, &want.slot_of_route, t, &mut y_want);
        assert_bits(&format!("{what}: y"), &download(&s, &y_d), &y_want);
        let mut out_want = vec![poison::<f32>(); routes];
        r::gather_route_values(&c, &values, &want.slot_of_route, t, &mut out_want);
        assert_bits(&format!("{what}: route values"), &download(&s, &out_d), &out_want);
    }
    assert!(overflowed > 0, "no replay dropped a route: the capacity is not tight enough to test dropping");
}
