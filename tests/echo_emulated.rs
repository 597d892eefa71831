//! The Echo kernels without a GPU: `csrc/echo/echo_plan.cu` compiled as host C++ against the
//! CPU emulation of `tests/emulation/` (one OS thread per CUDA thread, real barriers for
//! `__syncthreads` and the warp intrinsics) and run on the golden vectors, random cases, the
//! issue's E256 EP64 shape and an approx plan of more than 32 queued chunks (the popping warp's
//! rescan; checked to fail when that rescan reads a wrong spill).
//! Every stage of the plan and both reroute forms must equal the Rust CPU reference bit for
//! bit, with the token count on the host, from device memory under a larger bound (junk routes
//! past T neither read nor overwritten), and out of range (flagged), once with the threads of a
//! block resumed first-to-last and once last-to-first (a missing barrier shows in one). This is
//! CI's check of the kernels' logic; `echo_gpu` checks the same on the device. The spare-slot
//! weight kernels (`csrc/echo/echo_weights.cu`) have their own: `echo_weights_emulated`.
//!
//! Needs a C++17 compiler (`CXX`, default `c++`); ~60 s. `CAPMOE_EMULATION_CASES=all` adds
//! larger random shapes (E up to 1024, EP up to 256) and a k = E = 256 case of 7M routes
//! (minutes). `CAPMOE_EMULATION_CXXFLAGS` adds compiler flags, e.g. `-fsanitize=undefined
//! -fno-sanitize-recover=undefined` (~30 s) or `-fsanitize=address` (minutes; ASan warns that
//! it only partly follows makecontext).

mod common;
mod echo_support;

use std::path::Path;

use capturable_moe::echo::{reference, synthetic::synthetic_inputs, Algorithm, EchoConfig};
use echo_support::{golden_files, load, Ep64Zipf, RandomCase};

fn put_i64(out: &mut Vec<u8>, v: &[i64]) {
    v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
}

/// Appends one case in the driver's format: header, inputs, then the reference's stages and
/// outputs (see `Case::read` in tests/emulation/echo_driver.cpp).
fn put_case(
    out: &mut Vec<u8>,
    cfg: &EchoConfig,
    counts: &[i64],
    ids: &[i32],
    probs: &[f32],
    t: usize,
    plan_only: bool,
    block_capacity: Option<usize>,
) {
    let st = reference::plan(cfg, counts).unwrap();
    let approx = (cfg.algorithm == Algorithm::Approx) as i64;
    let header = [cfg.ep, cfg.num_experts, cfg.spare_per_rank, cfg.ep_rank, cfg.topk].map(|v| v as i64);
    put_i64(out, &header);
    put_i64(out, &[approx, cfg.threshold_multiplier.to_bits() as i64, t as i64, plan_only as i64]);
    put_i64(out, &[block_capacity.map_or(-1, |c| c as i64)]);
    put_i64(out, counts);
    ids.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
    probs.iter().for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes()));
    for stage in [&st.tokens_per_expert, &st.load_per_rank, &vec![st.avg], &st.spill, &st.spare_capacity] {
        put_i64(out, stage);
    }
    for stage in
        [&st.assignment_pre_reclaim, &st.assignment, &st.slot_expert, &st.first_pass, &st.first_pass_home_offload]
    {
        put_i64(out, stage);
    }
    for stage in [&st.remaining_capacity, &st.second_pass, &st.tokens_to_slot, &st.home_offload, &st.load_after] {
        put_i64(out, stage);
    }
    if plan_only || t == 0 {
        return;
    }
    if let Some(capacity) = block_capacity {
        // The capped top-k form alone: the balanced row of Ftot, then the destinations.
        let balanced = reference::balance_blocks(cfg, &st, counts, capacity).unwrap();
        let s = cfg.num_spare();
        put_i64(out, &balanced.tokens_to_slot[cfg.ep_rank * s..(cfg.ep_rank + 1) * s]);
        let dest = reference::reroute_topk(cfg, &balanced, counts, ids, t).unwrap();
        dest.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        return;
    }
    let dest = reference::reroute_topk(cfg, &st, counts, ids, t).unwrap();
    dest.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
    let (e, k) = (cfg.num_experts, cfg.topk);
    let mut routed = vec![false; t * e];
    let mut dense_probs = vec![0f32; t * e];
    for i in 0..t * k {
        routed[(i / k) * e + ids[i] as usize] = true;
        dense_probs[(i / k) * e + ids[i] as usize] = probs[i];
    }
    let (map, map_probs) = reference::reroute_dense(cfg, &st, counts, &routed, &dense_probs, t).unwrap();
    map.iter().for_each(|&m| out.push(m as u8));
    map_probs.iter().for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes()));
}

/// Random configurations: (EP, E, k) shapes x spare slots per rank x algorithm x reclaim x T.
fn random_cases(out: &mut Vec<u8>, thorough: bool) -> usize {
    let mut shapes = vec![(1, 8, 2), (2, 8, 2), (4, 16, 4), (8, 64, 6), (3, 12, 3), (5, 15, 2), (16, 64, 8)];
    if thorough {
        shapes.extend([(64, 256, 8), (32, 32, 4), (8, 1024, 8), (256, 256, 4)]);
    }
    let token_counts: &[usize] = if thorough { &[0, 1, 63, 64, 65, 700] } else { &[0, 1, 65, 300] };
    let mut n = 0;
    for (i, &(ep, e, k)) in shapes.iter().enumerate() {
        for sp in [1usize, 2, 3] {
            for (alg, thr) in [(Algorithm::Greedy, 0.0f32), (Algorithm::Greedy, 0.1), (Algorithm::Approx, 0.0)] {
                if ep * sp > 1024 || sp > e || (alg == Algorithm::Approx && sp != 1) {
                    continue;
                }
                for &t in token_counts {
                    let cfg = EchoConfig {
                        ep,
                        num_experts: e,
                        spare_per_rank: sp,
                        ep_rank: (t + i) % ep,
                        topk: k,
                        algorithm: alg,
                        threshold_multiplier: thr,
                    };
                    let rc = RandomCase::new(cfg.clone(), t, 177 + n as u64);
                    put_case(out, &cfg, &rc.counts, &rc.routes, &rc.probs, t, false, None);
                    n += 1;
                }
            }
        }
    }
    n
}

/// Every token routed to every expert (k = E = 256), 28672 tokens, two hot experts on the other
/// ranks: without the cap on words per tile (`kIdsBudget` in echo_plan.cu) the top-k reroute's
/// staged ids would pass the GPU's 227 KB shared-memory limit, which the emulation enforces.
fn every_expert_case(out: &mut Vec<u8>) {
    let (ep, e, t) = (8, 256, 28672);
    let cfg = EchoConfig {
        ep,
        num_experts: e,
        spare_per_rank: 2,
        ep_rank: 3,
        topk: e,
        algorithm: Algorithm::Greedy,
        threshold_multiplier: 0.0,
    };
    let ids: Vec<i32> = (0..t * e).map(|i| (i % e) as i32).collect();
    let probs: Vec<f32> = (0..t * e).map(|i| (i % 97 + 1) as f32 / 98.0).collect();
    let other_rank = |x: usize| if x < 2 { 3 * t } else { (x * 7919) % t };
    let counts: Vec<i64> =
        (0..ep * e).map(|i| if i / e == cfg.ep_rank { t } else { other_rank(i % e) } as i64).collect();
    put_case(out, &cfg, &counts, &ids, &probs, t, false, None);
}

/// The approx planner with more than 32 queued chunks and more than 32 ranks to fill (EP = 64:
/// 34 chunks, 47 ranks with capacity): lanes 0 and 1 of the popping warp then hold two entries,
/// and when a lane's first entry leaves (popped whole, or its rest queued behind the second) it
/// rescans for its second, a path the smaller shapes never take; the second entries are popped
/// later, so a wrong rescan shows in the plan. No tokens on this rank: the plan alone is compared.
fn approx_many_chunks_case(out: &mut Vec<u8>) {
    let (ep, e) = (64, 256);
    let cfg = EchoConfig {
        ep,
        num_experts: e,
        spare_per_rank: 1,
        ep_rank: 0,
        topk: 8,
        algorithm: Algorithm::Approx,
        threshold_multiplier: 0.0,
    };
    // Source rank 1 sends every token; rank 0 (this one, T = 0) none. Home rank q = x / 4:
    // ranks 0-16 hold 4 x 150 (average 385: two experts spill, 65 and 150), the others 4 x 77
    // (capacity 77 each).
    let mut counts = vec![0i64; ep * e];
    for x in 0..e {
        counts[e + x] = if x / 4 < 17 { 150 } else { 77 };
    }
    put_case(out, &cfg, &counts, &[], &[], 0, false, None);
}

/// Routes of `dest` (final columns) past `capacity` in any peer block (`per_rank` columns a peer).
fn overflow(dest: &[i32], per_rank: usize, ranks: usize, capacity: usize) -> usize {
    let mut load = vec![0usize; ranks];
    dest.iter().for_each(|&c| load[c as usize / per_rank] += 1);
    load.iter().map(|&n| n.saturating_sub(capacity)).sum()
}

/// The capped top-k form (block balancing, `capmoe_echo_plan_reroute_topk_capped`): random
/// skewed cases at block capacities below and above the balanced load (and 0: nothing can
/// move), and EP64 E256 T1024 zipf routing at 1.0x and 1.25x, where the spec's plan leaves
/// blocks over the capacity and balancing empties them. Returns (cases, cases in which the
/// balancing changed a destination); the second must be a third of them at least, or the cases would not
/// test the moves (the EP64 ones must each move routes).
fn capped_cases(out: &mut Vec<u8>) -> (usize, usize) {
    let (mut n, mut moved) = (0, 0);
    let mut put = |out: &mut Vec<u8>, cfg: &EchoConfig, counts: &[i64], ids: &[i32], probs: &[f32], t: usize, cap| {
        put_case(out, cfg, counts, ids, probs, t, false, Some(cap));
        let st = reference::plan(cfg, counts).unwrap();
        let plain = reference::reroute_topk(cfg, &st, counts, ids, t).unwrap();
        let balanced = reference::balance_blocks(cfg, &st, counts, cap).unwrap();
        let dest = reference::reroute_topk(cfg, &balanced, counts, ids, t).unwrap();
        let per_rank = cfg.local_experts() + cfg.spare_per_rank;
        assert!(overflow(&dest, per_rank, cfg.ep, cap) <= overflow(&plain, per_rank, cfg.ep, cap));
        n += 1;
        moved += usize::from(dest != plain);
        dest != plain
    };
    for (i, &(ep, e, k)) in [(2, 8, 2), (4, 16, 4), (8, 64, 6), (5, 15, 2), (16, 64, 8)].iter().enumerate() {
        for sp in [1usize, 2] {
            for t in [65usize, 300] {
                let cfg = EchoConfig {
                    ep,
                    num_experts: e,
                    spare_per_rank: sp,
                    ep_rank: (t + i) % ep,
                    topk: k,
                    algorithm: Algorithm::Greedy,
                    threshold_multiplier: 0.0,
                };
                let rc = RandomCase::new(cfg.clone(), t, 911 + (i * 4 + sp * 2 + t) as u64);
                let balanced_load = (t * k).div_ceil(ep);
                for cap in [balanced_load * 3 / 5, balanced_load] {
                    put(out, &cfg, &rc.counts, &rc.routes, &rc.probs, t, cap);
                }
                if i == 2 {
                    put(out, &cfg, &rc.counts, &rc.routes, &rc.probs, t, 0);
                }
            }
        }
    }
    let z = Ep64Zipf::new();
    for rank in [0usize, 37] {
        let cfg = Ep64Zipf::config(rank);
        for factor in [1.0, 1.25] {
            let (ids, cap) = (&z.ids_per_rank[rank], Ep64Zipf::capacity(factor));
            assert!(
                put(out, &cfg, &z.counts, ids, &z.probs, Ep64Zipf::TOKENS, cap),
                "rank {rank} at {factor}x: nothing moved"
            );
        }
    }
    (n, moved)
}

#[test]
fn echo_kernels_match_the_reference_under_cpu_emulation() {
    let thorough = std::env::var("CAPMOE_EMULATION_CASES").is_ok_and(|v| v == "all");
    let mut cases = Vec::new();
    let mut n = 0;
    for path in golden_files() {
        let g = load(&path);
        if !g.rejected() {
            put_case(&mut cases, &g.cfg, &g.counts, &g.routes, &g.probs, g.t, g.count_only, None);
            n += 1;
        }
    }
    n += random_cases(&mut cases, thorough);
    approx_many_chunks_case(&mut cases);
    n += 1;
    if thorough {
        every_expert_case(&mut cases);
        n += 1;
    }
    for sp in [1usize, 2] {
        let cfg = EchoConfig {
            ep: 64,
            num_experts: 256,
            spare_per_rank: sp,
            ep_rank: 5,
            topk: 8,
            algorithm: Algorithm::default_for(sp),
            threshold_multiplier: 0.0,
        };
        for t in [300, 8192] {
            let (counts, ids, probs) = synthetic_inputs(&cfg, t, 3);
            put_case(&mut cases, &cfg, &counts, &ids, &probs, t, false, None);
            n += 1;
        }
    }
    let (capped, moved) = capped_cases(&mut cases);
    assert!(moved * 3 >= capped, "balancing changed the destinations in only {moved} of {capped} capped cases");
    n += capped;
    let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("echo_emulated_cases.bin");
    std::fs::write(&file, &cases).unwrap();

    let exe = common::emulation::build("echo_emulator", &["csrc/echo/echo_plan.cu"], "tests/emulation/echo_driver.cpp");
    for order in common::emulation::THREAD_ORDERS {
        let report = common::emulation::run(&exe, &[&file], order);
        println!("{order} thread order: {report}");
        assert!(report.contains(&format!("{n} cases, 0 failures")), "the driver did not read every case:\n{report}");
        // Each run starts in a fresh emulated context: some launches must have needed the
        // shared-memory opt-in, or the per-context opt-in is not exercised.
        let opted_in: usize = report
            .lines()
            .find_map(|l| l.strip_suffix(" launches past 48 KB of shared memory"))
            .and_then(|n| n.trim().parse().ok())
            .expect("the driver reports its opted-in launches");
        assert!(opted_in > 0, "no launch needed more than 48 KB of shared memory:\n{report}");
    }
}
