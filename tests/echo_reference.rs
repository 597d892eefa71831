//! Host-only tests of the Echo planner's CPU reference: every golden case, every stage,
//! bitwise; the planner's invariants (`docs/echo.md`) on golden and random inputs; typed errors.

mod echo_support;

use capturable_moe::echo::reference;
use capturable_moe::echo::{Algorithm, EchoConfig};
use capturable_moe::Error;
use echo_support::{
    check_plan_invariants, check_reroute_invariants, check_stages, golden_files, load, same, RandomCase,
};

#[test]
fn golden_every_stage() {
    let mut checked = 0;
    for path in golden_files() {
        let g = load(&path);
        if g.rejected() {
            let err = reference::plan(&g.cfg, &g.counts).expect_err(&g.name);
            assert!(matches!(err, Error::InvalidArgument { .. }), "{}: {err}", g.name);
            continue;
        }
        let st = reference::plan(&g.cfg, &g.counts).unwrap_or_else(|e| panic!("{}: {e}", g.name));
        check_stages(&g, &st);
        check_plan_invariants(&g.name, &g.cfg, &g.counts, &st);
        assert_eq!(
            st.offload_map(&g.cfg).iter().filter(|&&m| m).count(),
            st.slot_expert.iter().filter(|&&x| x >= 0).count()
        );
        if !g.count_only {
            let dest = reference::reroute_topk(&g.cfg, &st, &g.counts, &g.routes, g.t).unwrap();
            assert_eq!(dest, g.route_dest(), "{}: route_dest", g.name);
            check_reroute_invariants(&g.name, &g.cfg, &st, &g.routes, g.t, &dest);
            let (map, probs) = g.dense_inputs();
            let (out_map, out_probs) = reference::reroute_dense(&g.cfg, &st, &g.counts, &map, &probs, g.t).unwrap();
            let (want_map, want_probs) = g.expected_dense_outputs();
            assert_eq!(out_map, want_map, "{}: dense map", g.name);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out_probs), bits(&want_probs), "{}: dense probs", g.name);
            assert_eq!(out_map.len(), g.t * g.cfg.num_columns());
        }
        checked += 1;
    }
    assert_eq!(checked, 31);
}

#[test]
fn golden_p5_to_p7_from_the_original_assignment() {
    // The README's stage-level check: from the original's own H (raw `expected`, without the
    // deterministic overlay), P5–P7 must equal the original's values, ties or not.
    let mut checked = 0;
    for path in golden_files() {
        let g = load(&path);
        if g.rejected() {
            continue;
        }
        let raw = g.raw["expected"].as_object().unwrap();
        let (ep, e, s) = (g.cfg.ep, g.cfg.num_experts, g.cfg.num_spare());
        let dense = |key: &str, rows: usize, cols: usize| {
            let mut m = vec![0i64; rows * cols];
            for tr in raw[key].as_array().unwrap() {
                let v: Vec<i64> = tr.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
                m[v[0] as usize * cols + v[1] as usize] = v[2];
            }
            m
        };
        let ints =
            |key: &str| -> Vec<i64> { raw[key].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect() };
        let p = reference::passes_from_assignment(&g.cfg, &g.counts, &dense("assignment", e, s)).unwrap();
        let n = &g.name;
        same(n, "slot_expert", &p.slot_expert, &ints("slot_expert"));
        same(n, "first_pass", &p.first_pass, &dense("first_pass", ep, s));
        same(n, "first_pass_home_offload", &p.first_pass_home_offload, &dense("first_pass_home_offload", ep, e));
        same(n, "remaining_capacity", &p.remaining_capacity, &dense("remaining_capacity", e, s));
        same(n, "second_pass", &p.second_pass, &dense("second_pass", ep, s));
        same(n, "tokens_to_slot", &p.tokens_to_slot, &dense("tokens_to_slot", ep, s));
        same(n, "home_offload", &p.home_offload, &dense("home_offload", ep, e));
        checked += 1;
    }
    assert_eq!(checked, 31);
}

#[test]
fn s30_approx_with_two_slots_is_rejected() {
    let g = load(&echo_support::golden_dir().join("s30_approx_s2_rejected.json"));
    assert!(g.rejected());
    match g.cfg.validate() {
        Err(Error::InvalidArgument { why, .. }) => assert!(why.contains("spare_per_rank == 1"), "{why}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

fn cfg(ep: usize, e: usize, sp: usize, alg: Algorithm) -> EchoConfig {
    EchoConfig {
        ep,
        num_experts: e,
        spare_per_rank: sp,
        ep_rank: 0,
        topk: 2.min(e),
        algorithm: alg,
        threshold_multiplier: 0.0,
    }
}

#[test]
fn typed_errors_for_bad_configs_and_counts() {
    let ok = cfg(4, 16, 1, Algorithm::Approx);
    assert!(ok.validate().is_ok());
    let bad = [
        EchoConfig { ep: 0, ..ok.clone() },
        EchoConfig { num_experts: 18, ..ok.clone() },
        EchoConfig { spare_per_rank: 0, ..ok.clone() },
        EchoConfig { spare_per_rank: 17, algorithm: Algorithm::Greedy, ..ok.clone() },
        EchoConfig { spare_per_rank: 2, ..ok.clone() },
        EchoConfig { ep_rank: 4, ..ok.clone() },
        EchoConfig { topk: 0, ..ok.clone() },
        EchoConfig { threshold_multiplier: f32::NAN, ..ok.clone() },
    ];
    for c in bad {
        assert!(matches!(c.validate(), Err(Error::InvalidArgument { .. })), "{c:?} accepted");
    }
    let big = EchoConfig { ep: 2, num_experts: 2048, ..ok.clone() };
    assert!(big.validate().is_ok());
    assert!(matches!(big.validate_gpu(), Err(Error::Unsupported { .. })));

    let mut counts = vec![1i64; 4 * 16];
    assert!(reference::plan(&ok, &counts).is_ok());
    assert!(matches!(reference::plan(&ok, &counts[1..]), Err(Error::Shape { .. })));
    counts[5] = -1;
    assert!(matches!(reference::plan(&ok, &counts), Err(Error::InvalidArgument { .. })));
    counts[5] = 1 << 24;
    assert!(matches!(reference::plan(&ok, &counts), Err(Error::InvalidArgument { .. })));

    // C[rho] must equal the routing's column sums.
    counts[5] = 1;
    let st = reference::plan(&ok, &counts).unwrap();
    let routes = vec![0i32, 1, 2, 3];
    assert!(matches!(reference::reroute_topk(&ok, &st, &counts, &routes, 2), Err(Error::InvalidArgument { .. })));
    let dup = vec![0i32, 0];
    assert!(reference::reroute_topk(&ok, &st, &counts, &dup, 1).is_err());
    let out = vec![0i32, 16];
    assert!(reference::reroute_topk(&ok, &st, &counts, &out, 1).is_err());
}

#[test]
fn worked_example_a_from_the_spec() {
    let c = vec![5, 2, 3, 1, 1, 0, 0, 0, 4, 2, 2, 1, 0, 1, 0, 0, 3, 1, 2, 1, 1, 0, 0, 0, 2, 1, 1, 1, 0, 0, 1, 0];
    let a = cfg(4, 8, 1, Algorithm::Approx);
    let st = reference::plan(&a, &c).unwrap();
    assert_eq!(st.spill, vec![11, 0, 3, 0, 0, 0, 0, 0]);
    assert_eq!(st.slot_expert, vec![-1, -1, 2, 0]);
    assert_eq!(st.tokens_to_slot, vec![0, 0, 3, 4, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1]);
    assert_eq!(st.load_after, vec![12, 9, 6, 9]);
    let g = EchoConfig { algorithm: Algorithm::Greedy, ..a };
    let st = reference::plan(&g, &c).unwrap();
    assert_eq!(st.slot_expert, vec![-1, -1, 0, 0]);
    assert_eq!(st.load_after, vec![9, 12, 6, 9]);
}

#[test]
fn worked_example_b_reclaim() {
    let c = vec![5, 2, 3, 1, 0, 0, 1, 0, 4, 2, 2, 1, 0, 0, 1, 0, 3, 2, 3, 2, 0, 0, 0, 0, 3, 1, 1, 1, 0, 1, 0, 1];
    let mut b = cfg(4, 8, 2, Algorithm::Greedy);
    let st = reference::plan(&b, &c).unwrap();
    assert_eq!(st.slot_expert, vec![-1, -1, -1, -1, 0, -1, 2, 0]);
    assert_eq!(st.load_after, vec![10, 10, 10, 10]);
    b.threshold_multiplier = 0.4;
    let st = reference::plan(&b, &c).unwrap();
    assert_eq!(st.slot_expert, vec![-1, -1, -1, -1, 0, -1, -1, -1]);
    assert_eq!((0..4).map(|r| st.tokens_to_slot[r * 8 + 4]).collect::<Vec<_>>(), vec![5, 2, 1, 1]);
    assert_eq!(st.load_after, vec![13, 14, 10, 3]);
}

fn random_configs() -> Vec<(EchoConfig, usize)> {
    let mut v = Vec::new();
    for &(ep, e, k) in &[(1, 8, 2), (2, 8, 2), (4, 16, 4), (8, 64, 6), (16, 64, 8), (64, 256, 8), (32, 32, 4)] {
        for sp in [1usize, 2, 3] {
            for alg in [Algorithm::Greedy, Algorithm::Approx] {
                if alg == Algorithm::Approx && sp != 1 {
                    continue;
                }
                for thr in [0.0f32, 0.05, 0.3] {
                    if alg == Algorithm::Approx && thr != 0.0 {
                        continue;
                    }
                    for &t in &[0usize, 1, 37, 300] {
                        let c = EchoConfig {
                            ep,
                            num_experts: e,
                            spare_per_rank: sp,
                            ep_rank: (t * 7 + sp) % ep,
                            topk: k,
                            algorithm: alg,
                            threshold_multiplier: thr,
                        };
                        v.push((c, t));
                    }
                }
            }
        }
    }
    v
}

#[test]
fn invariants_on_random_inputs() {
    for (i, (c, t)) in random_configs().into_iter().enumerate() {
        for seed in 0..3u64 {
            let rc = RandomCase::new(c.clone(), t, seed * 1000 + i as u64);
            let name = format!("random#{i}/{seed} {c:?} T={t}");
            let st = reference::plan(&c, &rc.counts).unwrap();
            check_plan_invariants(&name, &c, &rc.counts, &st);
            let dest = reference::reroute_topk(&c, &st, &rc.counts, &rc.routes, t).unwrap();
            check_reroute_invariants(&name, &c, &st, &rc.routes, t, &dest);
            // Dense form: every token keeps its k routes with bit-identical probs.
            let (map, probs) = rc.dense_inputs();
            let (om, op) = reference::reroute_dense(&c, &st, &rc.counts, &map, &probs, t).unwrap();
            let w = c.num_columns();
            for tok in 0..t {
                assert_eq!(om[tok * w..(tok + 1) * w].iter().filter(|&&b| b).count(), c.topk, "{name}");
                for r in 0..c.topk {
                    let col = dest[tok * c.topk + r] as usize;
                    assert!(om[tok * w + col]);
                    assert_eq!(op[tok * w + col].to_bits(), rc.probs[tok * c.topk + r].to_bits());
                }
                for col in 0..w {
                    assert_eq!(om[tok * w + col], op[tok * w + col] != 0.0, "{name}");
                }
            }
        }
    }
}

#[test]
fn edge_cases_from_the_spec() {
    // No spill: perfectly balanced.
    let c = cfg(4, 16, 2, Algorithm::Greedy);
    let st = reference::plan(&c, &vec![3i64; 64]).unwrap();
    assert!(st.assignment.iter().all(|&h| h == 0) && st.slot_expert.iter().all(|&x| x == -1));
    // All zero, T = 0.
    let st = reference::plan(&c, &vec![0i64; 64]).unwrap();
    assert_eq!(st.avg, 0);
    assert!(reference::reroute_topk(&c, &st, &vec![0i64; 64], &[], 0).unwrap().is_empty());
    // EP = 1: nothing moves, S_per false columns.
    for (sp, alg) in [(1, Algorithm::Approx), (2, Algorithm::Greedy)] {
        let c = EchoConfig {
            ep: 1,
            num_experts: 8,
            spare_per_rank: sp,
            ep_rank: 0,
            topk: 2,
            algorithm: alg,
            threshold_multiplier: 0.0,
        };
        let rc = RandomCase::new(c.clone(), 20, 5);
        let st = reference::plan(&c, &rc.counts).unwrap();
        assert!(st.slot_expert.iter().all(|&x| x == -1));
        let dest = reference::reroute_topk(&c, &st, &rc.counts, &rc.routes, 20).unwrap();
        assert_eq!(dest, rc.routes);
    }
    // All tokens on one source rank: F row equals H, D = 0.
    let c = cfg(4, 16, 1, Algorithm::Approx);
    let mut counts = vec![0i64; 64];
    for x in 0..16 {
        counts[x] = [40, 1, 2, 3][x / 4] + x as i64 % 3;
    }
    let st = reference::plan(&c, &counts).unwrap();
    assert!(st.second_pass.iter().all(|&d| d == 0));
    for j in 0..4 {
        if let Ok(x) = usize::try_from(st.slot_expert[j]) {
            assert_eq!(st.first_pass[j], st.assignment[x * 4 + j]);
        }
    }
}
