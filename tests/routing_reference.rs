//! Host-only tests of the routing capability: plan validation (typed errors) and the
//! properties of the CPU reference the GPU tests compare against.

mod common;

use capturable_moe::routing::reference::{self as r, Scalar};
use capturable_moe::routing::{flags, DType, RoutingConfig, RoutingPlan};
use capturable_moe::Error;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::routing::topk_ids;

fn config(e: usize, k: usize, t_max: usize) -> RoutingConfig {
    RoutingConfig {
        num_experts: e,
        hidden: 64,
        ffn: 32,
        topk: k,
        max_tokens: t_max,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    }
}

#[test]
fn plan_sizes_follow_the_config() {
    let mut c = config(128, 8, 4096);
    c.hidden = 2048;
    c.ffn = 768;
    let p = RoutingPlan::new(c).unwrap();
    assert_eq!(p.capacity(), 4096 * 8);
    assert_eq!(p.rows_len(), 4096 * 8 * 2048);
    assert_eq!(p.fc1_len(), 4096 * 8 * 1536);
    assert_eq!(p.act_len(), 4096 * 8 * 768);
    assert_eq!(p.routes_len(), 4096 * 8);
    assert_eq!(p.tokens_len(), 4096 * 2048);
    assert!(p.workspace_bytes() >= 32 * 128 * 4, "one int32 per (1024-route chunk, expert)");
    assert_eq!(p.workspace_bytes() % 256, 0);

    let mut c = config(8, 2, 0);
    c.capacity = Some(0);
    let p = RoutingPlan::new(c).expect("an empty plan (T_max = 0) is valid");
    assert_eq!(p.rows_len(), 0);
}

#[test]
fn plan_rejects_what_the_host_can_check() {
    let bad = |c: RoutingConfig| RoutingPlan::new(c).expect_err("must be rejected");
    assert!(matches!(bad(config(0, 1, 16)), Error::InvalidArgument { .. }));
    assert!(matches!(bad(config(1025, 1, 16)), Error::InvalidArgument { .. }));
    assert!(matches!(bad(config(8, 0, 16)), Error::InvalidArgument { .. }));
    assert!(matches!(bad(config(64, 33, 16)), Error::InvalidArgument { .. }));
    let mut c = config(8, 2, 16);
    c.hidden = 12;
    assert!(matches!(bad(c), Error::Alignment { what: "hidden", multiple: 8, .. }));
    let mut c = config(8, 2, 16);
    c.ffn = 0;
    assert!(matches!(bad(c), Error::Alignment { what: "ffn", .. }));
    let mut c = config(8, 2, 16);
    c.capacity = Some(33);
    let e = bad(c);
    assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("32"), "{e}");
    let mut c = config(8, 2, 16);
    c.expert_capacity = Some(0);
    assert!(matches!(bad(c), Error::InvalidArgument { .. }));
    let mut c = config(8, 2, 16);
    c.dtype = DType::F32;
    assert!(matches!(bad(c), Error::Unsupported { .. }));
    assert!(matches!(bad(config(8, 32, 1 << 26)), Error::InvalidArgument { .. }));
}

/// The layout contract, checked from first principles on any reference output.
fn check_contract(ids: &[i32], tokens: usize, e: usize, k: usize, capacity: usize, m: &r::RouteMaps) {
    let total = m.offsets[e] as usize;
    assert!(total <= capacity);
    assert_eq!(m.offsets[0], 0);
    for x in 0..e {
        assert_eq!(m.offsets[x + 1] - m.offsets[x], m.m_splits[x]);
        assert!(m.m_splits[x] <= m.expert_counts[x] as i64);
    }
    let mut seen = vec![false; total];
    for t in 0..tokens {
        for j in 0..k {
            let row = m.row_of_route[t * k + j];
            if row < 0 {
                continue;
            }
            let row = row as usize;
            assert!(row < total && !seen[row], "row {row} reused or out of range");
            seen[row] = true;
            assert_eq!(m.token_of_row[row], t as i32);
            let x = ids[t * k + j] as usize;
            assert!((m.offsets[x] as usize..m.offsets[x + 1] as usize).contains(&row), "row outside its expert");
        }
    }
    assert!(seen.iter().all(|&s| s), "every row below the total has one route");
    assert!(m.token_of_row[total..].iter().all(|&t| t == -1));
    // Within an expert, ascending (token, slot).
    for x in 0..e {
        let routes: Vec<usize> = (m.offsets[x]..m.offsets[x + 1])
            .map(|row| (0..tokens * k).find(|&q| m.row_of_route[q] == row as i32).unwrap())
            .collect();
        assert!(routes.windows(2).all(|w| w[0] < w[1]), "expert {x} rows not in route order");
    }
}

#[test]
fn reference_build_satisfies_the_layout_contract() {
    let mut rng = StdRng::seed_from_u64(1);
    for &(e, k, t) in &[(8usize, 2usize, 37usize), (64, 8, 100), (1, 1, 5), (256, 8, 64)] {
        let ids = topk_ids(&mut rng, t, e, k);
        let m = r::build(&ids, t, t, e, k, t * k, 0);
        assert_eq!(m.flags, 0);
        assert_eq!(m.offsets[e] as usize, t * k);
        check_contract(&ids, t, e, k, t * k, &m);
    }
}

#[test]
fn reference_empty_slots_bad_ids_and_duplicates() {
    // token 0: expert 2 twice (two routes); token 1: an empty slot and an id out of range;
    // token 2: a negative id other than -1.
    let ids = [2, 2, -1, 7, -5, 0, 1, 1];
    let m = r::build(&ids, 3, 4, 4, 2, 8, 0);
    assert_eq!(m.flags, flags::BAD_EXPERT);
    assert_eq!(m.m_splits, vec![1, 0, 2, 0]);
    assert_eq!(m.row_of_route, vec![1, 2, -1, -1, -1, 0, -1, -1], "token 3 (t >= T) is -1 too");
    assert_eq!(m.token_of_row, vec![2, 0, 0, -1, -1, -1, -1, -1]);
    check_contract(&ids, 3, 4, 2, 8, &m);
    // Only -1 slots: no flag.
    let m = r::build(&[-1, -1], 1, 1, 4, 2, 2, 0);
    assert_eq!((m.flags, m.offsets[4]), (0, 0));
}

#[test]
fn reference_capacity_drops_later_experts_and_flags() {
    let mut rng = StdRng::seed_from_u64(2);
    let (e, k, t) = (16, 4, 50);
    let ids = topk_ids(&mut rng, t, e, k);
    let full = r::build(&ids, t, t, e, k, t * k, 0);
    let cap = 77;
    let m = r::build(&ids, t, t, e, k, cap, 0);
    assert_eq!(m.flags, flags::CAPACITY);
    assert_eq!(m.offsets[e], cap as i64);
    check_contract(&ids, t, e, k, cap, &m);
    for x in 0..e {
        let expect = (full.offsets[x + 1].min(cap as i64) - full.offsets[x].min(cap as i64)).max(0);
        assert_eq!(m.m_splits[x], expect, "expert {x}");
    }
    // Per-expert capacity keeps the first routes of each expert in row order.
    let m = r::build(&ids, t, t, e, k, t * k, 3);
    check_contract(&ids, t, e, k, t * k, &m);
    for x in 0..e {
        assert_eq!(m.m_splits[x], (full.m_splits[x]).min(3));
    }
    assert_eq!(m.flags, flags::CAPACITY);
}

#[test]
fn reference_all_tokens_to_one_expert_and_t0() {
    let ids = vec![5i32; 40];
    let m = r::build(&ids, 40, 40, 8, 1, 40, 0);
    assert_eq!(m.m_splits[5], 40);
    assert_eq!(m.offsets, vec![0, 0, 0, 0, 0, 0, 40, 40, 40]);
    let m = r::build(&ids, 0, 40, 8, 1, 40, 0);
    assert_eq!(m.offsets, vec![0; 9]);
    assert!(m.row_of_route.iter().all(|&x| x == -1) && m.token_of_row.iter().all(|&x| x == -1));
}

#[test]
fn reference_from_map_keeps_lowest_experts() {
    let (e, k) = (6, 2);
    let map = [0u8, 1, 0, 1, 0, 0, /**/ 1, 1, 1, 0, 0, 0, /**/ 0, 0, 0, 0, 0, 1];
    let probs: Vec<f32> = (0..18).map(|i| i as f32).collect();
    let mut ids = vec![99; 6];
    let mut out = vec![99.0f32; 6];
    let fl = r::from_map(&map, &probs, 3, e, k, &mut ids, &mut out);
    assert_eq!(fl, flags::TOO_MANY);
    assert_eq!(ids, vec![1, 3, 0, 1, 5, -1]);
    assert_eq!(out, vec![1.0, 3.0, 6.0, 7.0, 17.0, 0.0]);
}

#[test]
fn reference_unpermute_inverts_permute() {
    let mut rng = StdRng::seed_from_u64(3);
    let (e, k, t, h) = (8, 4, 33, 16);
    let ids = topk_ids(&mut rng, t, e, k);
    let m = r::build(&ids, t, t, e, k, t * k, 0);
    let x: Vec<bf16> = (0..t * h).map(|_| bf16::from_f32(rng.random_range(-64i32..64) as f32)).collect();
    let mut rows = vec![bf16::from_f32(0.0); t * k * h];
    r::permute(&x, &m.row_of_route, t, h, k, t * k, &mut rows);
    let probs: Vec<f32> = (0..t).flat_map(|_| [0.5f32, 0.25, 0.125, 0.125]).collect();
    let mut y = vec![bf16::from_f32(0.0); t * h];
    r::gather_sum(&rows, &m.row_of_route, Some(&probs), t, h, k, t * k, &mut y);
    assert_eq!(y, x);
    // permute backward: the k copies summed.
    let mut dx = vec![bf16::from_f32(0.0); t * h];
    r::gather_sum::<bf16, f32>(&rows, &m.row_of_route, None, t, h, k, t * k, &mut dx);
    for i in 0..t * h {
        assert_eq!(dx[i].to_f32(), 4.0 * x[i].to_f32());
    }
}

#[test]
fn reference_unpermute_backward_matches_its_definition() {
    let (k, t, h) = (2, 3, 8);
    let row_of_route = vec![0, 3, 1, -1, 2, 4];
    let rows: Vec<f32> = (0..5 * h).map(|i| (i % 7) as f32 - 3.0).collect();
    let dy: Vec<f32> = (0..t * h).map(|i| (i % 5) as f32 - 2.0).collect();
    let probs = vec![0.5f32, 2.0, 1.0, 7.0, -1.0, 0.25];
    let mut drows = vec![f32::NAN; 5 * h];
    let mut dprobs = vec![f32::NAN; t * k];
    r::unpermute_backward(&dy, &rows, &row_of_route, &probs, t, h, k, 5, &mut drows, &mut dprobs);
    for (tok, j) in [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)] {
        let row = row_of_route[tok * k + j] as usize;
        let dot: f32 = (0..h).map(|c| dy[tok * h + c] * rows[row * h + c]).sum();
        assert_eq!(dprobs[tok * k + j], dot);
        for c in 0..h {
            assert_eq!(drows[row * h + c], probs[tok * k + j] * dy[tok * h + c]);
        }
    }
    assert_eq!(dprobs[3], 0.0, "a dropped route gets dprob 0");
}

#[test]
fn reference_swiglu_backward_matches_finite_differences() {
    let f = 8;
    let h: Vec<f32> = (0..2 * f).map(|i| (i as f32 - 7.5) * 0.4).collect();
    let mut act = vec![0.0f32; f];
    r::swiglu(&h, 1, f, &mut act);
    let dact = vec![1.0f32; f];
    let mut dh = vec![0.0f32; 2 * f];
    r::swiglu_backward(&dact, &h, 1, f, &mut dh);
    let eps = 1e-3f32;
    for i in 0..2 * f {
        let mut hp = h.clone();
        hp[i] += eps;
        let mut hm = h.clone();
        hm[i] -= eps;
        let (mut ap, mut am) = (vec![0.0f32; f], vec![0.0f32; f]);
        r::swiglu(&hp, 1, f, &mut ap);
        r::swiglu(&hm, 1, f, &mut am);
        let fd: f32 = (0..f).map(|c| (ap[c] - am[c]) / (2.0 * eps)).sum();
        assert!((fd - dh[i]).abs() < 2e-2 * (1.0 + dh[i].abs()), "column {i}: fd {fd} vs {}", dh[i]);
    }
    // silu(g) * u at a known point.
    assert!((act[0] - (h[0] / (1.0 + (-h[0]).exp()) * h[f])).abs() < 1e-6);
}

#[test]
fn resolve_tokens_clamps_and_flags() {
    assert_eq!(r::resolve_tokens(5, 10), (5, 0));
    assert_eq!(r::resolve_tokens(11, 10), (10, flags::BAD_TOKENS));
    assert_eq!(r::resolve_tokens(-1, 10), (0, flags::BAD_TOKENS));
    assert_eq!(bf16::from_f32(1.5).to_f32(), <bf16 as Scalar>::to_f32(bf16::from_f32(1.5)));
}
