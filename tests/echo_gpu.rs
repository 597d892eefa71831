//! GPU tests of the Echo planner and reroute kernels: golden vectors (every stage, both
//! reroute forms), bitwise agreement with the CPU reference on random inputs, device error
//! flags, the spare-slot weight kernels, and CUDA graph captures replayed with new data (one of
//! them with the token count in device memory, a new T every replay).

mod common;
mod echo_support;

use std::sync::Arc;

use capturable_moe::echo::reference::{self, PlanStages};
use capturable_moe::echo::{self as echo, Algorithm, DeviceErrors, EchoConfig, EchoPlan};
use capturable_moe::routing::Tokens;
use capturable_moe::Error;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use echo_support::{check_plan_invariants, check_stages, golden_files, load, same, Ep64Zipf, RandomCase};

const POISON_I32: i32 = -7777;
const POISON_U8: u8 = 0xA5;
const POISON_F32: f32 = -1.0e30;

/// Device buffers of one plan + reroute, outputs poisoned.
struct Bufs {
    counts: CudaSlice<i64>,
    ids: CudaSlice<i32>,
    probs_k: CudaSlice<f32>,
    map: CudaSlice<u8>,
    probs: CudaSlice<f32>,
    state: CudaSlice<i64>,
    ws: CudaSlice<i32>,
    out_dest: CudaSlice<i32>,
    out_pk: CudaSlice<f32>,
    out_map: CudaSlice<u8>,
    out_probs: CudaSlice<f32>,
}

fn dense(cfg: &EchoConfig, t: usize, ids: &[i32], probs: &[f32]) -> (Vec<u8>, Vec<f32>, Vec<bool>) {
    let (e, k) = (cfg.num_experts, cfg.topk);
    let mut map = vec![0u8; t * e];
    let mut p = vec![0f32; t * e];
    for i in 0..t * k {
        map[(i / k) * e + ids[i] as usize] = 1;
        p[(i / k) * e + ids[i] as usize] = probs[i];
    }
    let b = map.iter().map(|&m| m != 0).collect();
    (map, p, b)
}

impl Bufs {
    fn new(stream: &Arc<CudaStream>, plan: &EchoPlan, counts: &[i64], ids: &[i32], probs: &[f32], t: usize) -> Bufs {
        let cfg = plan.config();
        let (k, w) = (cfg.topk, cfg.num_columns());
        let (map, p, _) = dense(cfg, t, ids, probs);
        let one = |n: usize| n.max(1);
        let pad = |v: &[i32]| if v.is_empty() { vec![0] } else { v.to_vec() };
        let padf = |v: &[f32]| if v.is_empty() { vec![0.0] } else { v.to_vec() };
        Bufs {
            counts: stream.clone_htod(counts).unwrap(),
            ids: stream.clone_htod(&pad(ids)).unwrap(),
            probs_k: stream.clone_htod(&padf(probs)).unwrap(),
            map: stream.clone_htod(&if map.is_empty() { vec![0u8] } else { map }).unwrap(),
            probs: stream.clone_htod(&padf(&p)).unwrap(),
            state: stream.clone_htod(&vec![-99i64; plan.state_len()]).unwrap(),
            ws: stream.clone_htod(&vec![POISON_I32; one(plan.workspace_len())]).unwrap(),
            out_dest: stream.clone_htod(&vec![POISON_I32; one(t * k)]).unwrap(),
            out_pk: stream.clone_htod(&vec![POISON_F32; one(t * k)]).unwrap(),
            out_map: stream.clone_htod(&vec![POISON_U8; one(t * w)]).unwrap(),
            out_probs: stream.clone_htod(&vec![POISON_F32; one(t * w)]).unwrap(),
        }
    }

    fn topk(&mut self, s: &Arc<CudaStream>, plan: &EchoPlan, t: usize) -> capturable_moe::Result<()> {
        self.topk_tokens(s, plan, Tokens::Host(t))
    }

    fn topk_tokens(&mut self, s: &Arc<CudaStream>, plan: &EchoPlan, t: Tokens<'_>) -> capturable_moe::Result<()> {
        plan.plan_reroute_topk(
            s,
            &self.counts,
            &self.ids,
            &self.probs_k,
            t,
            &mut self.state,
            &mut self.ws,
            &mut self.out_dest,
            &mut self.out_pk,
        )
    }

    fn dense(&mut self, s: &Arc<CudaStream>, plan: &EchoPlan, t: usize) -> capturable_moe::Result<()> {
        self.dense_tokens(s, plan, Tokens::Host(t))
    }

    fn dense_tokens(&mut self, s: &Arc<CudaStream>, plan: &EchoPlan, t: Tokens<'_>) -> capturable_moe::Result<()> {
        plan.plan_reroute_dense(
            s,
            &self.counts,
            &self.map,
            &self.probs,
            t,
            &mut self.state,
            &mut self.ws,
            &mut self.out_map,
            &mut self.out_probs,
        )
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A written dense-map region as booleans: every byte must be 0 or 1 (the poison 0xA5 or any
/// other value means unwritten or wrong, and must not read as `false`).
fn map_bits(name: &str, written: &[u8]) -> Vec<bool> {
    if let Some(i) = written.iter().position(|&v| v > 1) {
        panic!("{name}: out_map byte {} at {i} not written or not 0/1", written[i]);
    }
    written.iter().map(|&v| v == 1).collect()
}

fn stages_equal(name: &str, got: &PlanStages, want: &PlanStages) {
    same(name, "n", &got.tokens_per_expert, &want.tokens_per_expert);
    same(name, "load", &got.load_per_rank, &want.load_per_rank);
    assert_eq!(got.avg, want.avg, "{name}: avg");
    same(name, "spill", &got.spill, &want.spill);
    same(name, "cap", &got.spare_capacity, &want.spare_capacity);
    same(name, "H pre-reclaim", &got.assignment_pre_reclaim, &want.assignment_pre_reclaim);
    same(name, "H", &got.assignment, &want.assignment);
    same(name, "slot_expert", &got.slot_expert, &want.slot_expert);
    same(name, "F", &got.first_pass, &want.first_pass);
    same(name, "C - C1", &got.first_pass_home_offload, &want.first_pass_home_offload);
    same(name, "Rm", &got.remaining_capacity, &want.remaining_capacity);
    same(name, "D", &got.second_pass, &want.second_pass);
    same(name, "Ftot", &got.tokens_to_slot, &want.tokens_to_slot);
    same(name, "home_offload", &got.home_offload, &want.home_offload);
    same(name, "load_after", &got.load_after, &want.load_after);
}

/// The kernel's reroute tables against the reference plan: per slot its expert, the next slot
/// of that expert and its range in the expert's token list on `ep_rank`; per expert its lowest
/// slot and the tokens moved off it.
fn route_tables_equal(
    name: &str,
    stream: &Arc<CudaStream>,
    plan: &EchoPlan,
    state: &CudaSlice<i64>,
    want: &PlanStages,
) {
    let cfg = plan.config();
    let (ne, s, rho) = (cfg.num_experts, cfg.num_spare(), cfg.ep_rank);
    let (slots, experts) = plan.read_route_tables(stream, state).unwrap();
    let mut moved = vec![0i64; ne];
    let mut first = vec![-1i32; ne];
    let mut last: Vec<Option<usize>> = vec![None; ne];
    let mut want_slots = vec![[-1, -1, 0, 0]; s];
    for j in 0..s {
        let Ok(e) = usize::try_from(want.slot_expert[j]) else { continue };
        let take = want.tokens_to_slot[rho * s + j];
        want_slots[j] = [e as i32, -1, moved[e] as i32, (moved[e] + take) as i32];
        match last[e] {
            Some(p) => want_slots[p][1] = j as i32,
            None => first[e] = j as i32,
        }
        last[e] = Some(j);
        moved[e] += take;
    }
    let want_experts: Vec<[i32; 2]> = (0..ne).map(|e| [first[e], moved[e] as i32]).collect();
    assert_eq!(slots, want_slots, "{name}: slot route table");
    assert_eq!(experts, want_experts, "{name}: expert route table");
}

/// Runs both forms on the GPU and checks them against the CPU reference, bitwise.
fn check_against_reference(
    stream: &Arc<CudaStream>,
    name: &str,
    cfg: &EchoConfig,
    counts: &[i64],
    ids: &[i32],
    probs: &[f32],
    t: usize,
) -> PlanStages {
    let plan = EchoPlan::new(cfg.clone(), t.max(1)).unwrap();
    let want = reference::plan(cfg, counts).unwrap();
    let want_dest = reference::reroute_topk(cfg, &want, counts, ids, t).unwrap();
    let (_, p, b) = dense(cfg, t, ids, probs);
    let (want_map, want_probs) = reference::reroute_dense(cfg, &want, counts, &b, &p, t).unwrap();
    let mut bufs = Bufs::new(stream, &plan, counts, ids, probs, t);

    bufs.topk(stream, &plan, t).unwrap();
    let got = plan.read_stages(stream, &bufs.state).unwrap();
    stages_equal(name, &got, &want);
    let m = plan.read_offload_map(stream, &bufs.state).unwrap();
    assert_eq!(m, want.offload_map(cfg), "{name}: offload map");
    assert_eq!(plan.read_errors(stream, &bufs.state).unwrap(), DeviceErrors(0), "{name}: error word");
    route_tables_equal(name, stream, &plan, &bufs.state, &want);
    let (k, w) = (cfg.topk, cfg.num_columns());
    if t > 0 {
        let dest = stream.clone_dtoh(&bufs.out_dest).unwrap();
        assert_eq!(&dest[..t * k], &want_dest[..], "{name}: top-k destinations");
        let pk = stream.clone_dtoh(&bufs.out_pk).unwrap();
        assert_eq!(bits(&pk[..t * k]), bits(probs), "{name}: top-k probs");
    }

    bufs.state = stream.clone_htod(&vec![-99i64; plan.state_len()]).unwrap();
    bufs.dense(stream, &plan, t).unwrap();
    let got2 = plan.read_stages(stream, &bufs.state).unwrap();
    stages_equal(name, &got2, &want);
    assert_eq!(
        plan.read_offload_map(stream, &bufs.state).unwrap(),
        want.offload_map(cfg),
        "{name}: offload map (dense)"
    );
    assert_eq!(plan.read_errors(stream, &bufs.state).unwrap(), DeviceErrors(0), "{name}: error word (dense)");
    if t > 0 {
        let om = stream.clone_dtoh(&bufs.out_map).unwrap();
        let op = stream.clone_dtoh(&bufs.out_probs).unwrap();
        assert_eq!(map_bits(name, &om[..t * w]), want_map, "{name}: dense map");
        assert_eq!(bits(&op[..t * w]), bits(&want_probs), "{name}: dense probs");
    }
    got
}

#[test]
fn golden_vectors_on_gpu() {
    let stream = gpu_or_skip!();
    for path in golden_files() {
        let g = load(&path);
        if g.rejected() {
            assert!(matches!(EchoPlan::new(g.cfg.clone(), 16), Err(Error::InvalidArgument { .. })), "{}", g.name);
            continue;
        }
        if g.count_only {
            let plan = EchoPlan::new(g.cfg.clone(), 1).unwrap();
            let counts = stream.clone_htod(&g.counts).unwrap();
            let mut state = stream.clone_htod(&vec![-99i64; plan.state_len()]).unwrap();
            plan.plan(&stream, &counts, &mut state).unwrap();
            let st = plan.read_stages(&stream, &state).unwrap();
            check_stages(&g, &st);
            assert!(plan.read_errors(&stream, &state).unwrap().is_empty());
            continue;
        }
        let st = check_against_reference(&stream, &g.name, &g.cfg, &g.counts, &g.routes, &g.probs, g.t);
        check_stages(&g, &st);
        // route_dest straight from the golden file too.
        let plan = EchoPlan::new(g.cfg.clone(), g.t.max(1)).unwrap();
        let mut bufs = Bufs::new(&stream, &plan, &g.counts, &g.routes, &g.probs, g.t);
        bufs.topk(&stream, &plan, g.t).unwrap();
        if g.t > 0 {
            let dest = stream.clone_dtoh(&bufs.out_dest).unwrap();
            assert_eq!(&dest[..g.t * g.cfg.topk], &g.route_dest()[..], "{}: route_dest", g.name);
        }
    }
}

fn random_configs() -> Vec<(EchoConfig, usize)> {
    let mut v = Vec::new();
    let shapes = [
        (1, 8, 2),
        (2, 8, 2),
        (4, 16, 4),
        (8, 64, 6),
        (16, 64, 8),
        (64, 256, 8),
        (32, 32, 4),
        (8, 1024, 8),
        (256, 256, 4),
    ];
    for (i, &(ep, e, k)) in shapes.iter().enumerate() {
        for sp in [1usize, 2, 4] {
            if ep * sp > 1024 {
                continue;
            }
            for alg in [Algorithm::Greedy, Algorithm::Approx] {
                if alg == Algorithm::Approx && sp != 1 {
                    continue;
                }
                let thr = if alg == Algorithm::Greedy && i % 2 == 0 { 0.1 } else { 0.0 };
                for t in [0usize, 1, 63, 64, 65, 1000, 5000] {
                    v.push((
                        EchoConfig {
                            ep,
                            num_experts: e,
                            spare_per_rank: sp,
                            ep_rank: (t + i) % ep,
                            topk: k,
                            algorithm: alg,
                            threshold_multiplier: thr,
                        },
                        t,
                    ));
                }
            }
        }
    }
    v
}

#[test]
fn random_inputs_match_the_cpu_reference() {
    let stream = gpu_or_skip!();
    for (i, (cfg, t)) in random_configs().into_iter().enumerate() {
        let rc = RandomCase::new(cfg.clone(), t, 77 + i as u64);
        let name = format!("random#{i} {cfg:?} T={t}");
        let st = check_against_reference(&stream, &name, &cfg, &rc.counts, &rc.routes, &rc.probs, t);
        check_plan_invariants(&name, &cfg, &rc.counts, &st);
    }
}

// Its plan + reroute time is measured by `capmoe-bench --only echo` (bench/ crate).
#[test]
fn target_shape_matches_reference() {
    let stream = gpu_or_skip!();
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
        let t = 8192;
        let (counts, ids, probs) = echo::synthetic::synthetic_inputs(&cfg, t, 3);
        check_against_reference(&stream, &format!("target S_per={sp}"), &cfg, &counts, &ids, &probs, t);
    }
}

/// The capped top-k form (block balancing for EP) on the device against
/// `reference::balance_blocks` + the reference reroute, bitwise: EP64 E256 T1024 zipf routing
/// at 1.0x and 1.25x the balanced block (the drops of docs/ep.md) and random skewed cases at
/// 0.6x / 1x; the plan's other stages stay the spec's.
#[test]
fn capped_reroute_matches_the_balanced_reference() {
    let stream = gpu_or_skip!();
    let check = |name: &str, cfg: &EchoConfig, counts: &[i64], ids: &[i32], probs: &[f32], t: usize, cap: usize| {
        let plan = EchoPlan::new(cfg.clone(), t).unwrap().with_block_capacity(cap).unwrap();
        let want = reference::plan(cfg, counts).unwrap();
        let balanced = reference::balance_blocks(cfg, &want, counts, cap).unwrap();
        let want_dest = reference::reroute_topk(cfg, &balanced, counts, ids, t).unwrap();
        let mut bufs = Bufs::new(&stream, &plan, counts, ids, probs, t);
        bufs.topk(&stream, &plan, t).unwrap();
        stages_equal(name, &plan.read_stages(&stream, &bufs.state).unwrap(), &want);
        assert_eq!(plan.read_errors(&stream, &bufs.state).unwrap(), DeviceErrors(0), "{name}: error word");
        route_tables_equal(name, &stream, &plan, &bufs.state, &balanced);
        let dest = stream.clone_dtoh(&bufs.out_dest).unwrap();
        assert_eq!(&dest[..t * cfg.topk], &want_dest[..], "{name}: top-k destinations");
        want_dest != reference::reroute_topk(cfg, &want, counts, ids, t).unwrap()
    };
    let z = Ep64Zipf::new();
    for rank in [0usize, 37] {
        let cfg = Ep64Zipf::config(rank);
        for factor in [1.0, 1.25] {
            let (ids, cap) = (&z.ids_per_rank[rank], Ep64Zipf::capacity(factor));
            let name = format!("EP64 zipf rank {rank} capacity {cap}");
            assert!(check(&name, &cfg, &z.counts, ids, &z.probs, Ep64Zipf::TOKENS, cap), "{name}: nothing moved");
        }
    }
    for (i, (cfg, t)) in random_configs().into_iter().enumerate().filter(|(_, (c, t))| c.ep > 1 && *t > 0) {
        let rc = RandomCase::new(cfg.clone(), t, 177 + i as u64);
        let balanced_load = (t * cfg.topk).div_ceil(cfg.ep);
        for cap in [balanced_load * 3 / 5, balanced_load] {
            check(&format!("random#{i} {cfg:?} T={t} capacity {cap}"), &cfg, &rc.counts, &rc.routes, &rc.probs, t, cap);
        }
    }
}

#[test]
fn graph_capture_replays_with_new_data() {
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    let ctx = stream.context();
    // SAFETY: every buffer of this test lives on `stream` only.
    unsafe { ctx.disable_event_tracking() };
    for (sp, alg, thr) in
        [(2usize, Algorithm::Greedy, 0.0f32), (1, Algorithm::Approx, 0.0), (2, Algorithm::Greedy, 0.1)]
    {
        let cfg = EchoConfig {
            ep: 8,
            num_experts: 64,
            spare_per_rank: sp,
            ep_rank: 3,
            topk: 6,
            algorithm: alg,
            threshold_multiplier: thr,
        };
        let t = 700;
        let first = RandomCase::new(cfg.clone(), t, 1);
        let plan = EchoPlan::new(cfg.clone(), t).unwrap();
        let mut bufs = Bufs::new(&stream, &plan, &first.counts, &first.routes, &first.probs, t);
        stream.synchronize().unwrap();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
        let r1 = bufs.topk(&stream, &plan, t);
        let r2 = bufs.dense(&stream, &plan, t);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        r1.unwrap();
        r2.unwrap();
        let graph = graph.expect("captured graph");
        for seed in 2..8u64 {
            let rc = RandomCase::new(cfg.clone(), t, seed * 31);
            let (map, p, b) = dense(&cfg, t, &rc.routes, &rc.probs);
            stream.memcpy_htod(&rc.counts, &mut bufs.counts).unwrap();
            stream.memcpy_htod(&rc.routes, &mut bufs.ids).unwrap();
            stream.memcpy_htod(&rc.probs, &mut bufs.probs_k).unwrap();
            stream.memcpy_htod(&map, &mut bufs.map).unwrap();
            stream.memcpy_htod(&p, &mut bufs.probs).unwrap();
            // Every output and the plan state start poisoned, so nothing of the last replay passes.
            stream.memcpy_htod(&vec![POISON_I32; t * cfg.topk], &mut bufs.out_dest).unwrap();
            stream.memcpy_htod(&vec![POISON_F32; t * cfg.topk], &mut bufs.out_pk).unwrap();
            stream.memcpy_htod(&vec![POISON_U8; t * cfg.num_columns()], &mut bufs.out_map).unwrap();
            stream.memcpy_htod(&vec![POISON_F32; t * cfg.num_columns()], &mut bufs.out_probs).unwrap();
            stream.memcpy_htod(&vec![-99i64; plan.state_len()], &mut bufs.state).unwrap();
            graph.launch().unwrap();
            let want = reference::plan(&cfg, &rc.counts).unwrap();
            let name = format!("replay seed {seed} {cfg:?}");
            stages_equal(&name, &plan.read_stages(&stream, &bufs.state).unwrap(), &want);
            let dest = stream.clone_dtoh(&bufs.out_dest).unwrap();
            assert_eq!(dest, reference::reroute_topk(&cfg, &want, &rc.counts, &rc.routes, t).unwrap(), "{name}");
            let pk = stream.clone_dtoh(&bufs.out_pk).unwrap();
            assert_eq!(bits(&pk), bits(&rc.probs), "{name}: top-k probs");
            let (wm, wp) = reference::reroute_dense(&cfg, &want, &rc.counts, &b, &p, t).unwrap();
            let om = map_bits(&name, &stream.clone_dtoh(&bufs.out_map).unwrap());
            assert_eq!(om, wm, "{name}: dense map");
            assert_eq!(bits(&stream.clone_dtoh(&bufs.out_probs).unwrap()), bits(&wp), "{name}: dense probs");
            assert!(plan.read_errors(&stream, &bufs.state).unwrap().is_empty(), "{name}");
        }
    }
}

/// One graph captured with the token count in device memory, replayed for T = t_max, 0 and
/// counts in between. Rows past T keep the routes of other replays, which must be ignored, and
/// no output row past T is written. A count outside `[0, t_max]` sets `BAD_TOKENS`.
#[test]
fn graph_replays_with_a_device_token_count() {
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    // SAFETY: every buffer of this test lives on `stream` only.
    unsafe { stream.context().disable_event_tracking() };
    let cfg = EchoConfig {
        ep: 8,
        num_experts: 64,
        spare_per_rank: 2,
        ep_rank: 3,
        topk: 6,
        algorithm: Algorithm::Greedy,
        threshold_multiplier: 0.0,
    };
    let (t_max, e, k, w) = (700usize, cfg.num_experts, cfg.topk, cfg.num_columns());
    let first = RandomCase::new(cfg.clone(), t_max, 1);
    let plan = EchoPlan::new(cfg.clone(), t_max).unwrap();
    let mut bufs = Bufs::new(&stream, &plan, &first.counts, &first.routes, &first.probs, t_max);
    let mut tokens = stream.clone_htod(&[t_max as i32]).unwrap();
    stream.synchronize().unwrap();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let r1 = bufs.topk_tokens(&stream, &plan, Tokens::Device(&tokens));
    let r2 = bufs.dense_tokens(&stream, &plan, Tokens::Device(&tokens));
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
    r1.unwrap();
    r2.unwrap();
    let graph = graph.expect("captured graph");
    for (i, t) in [700usize, 0, 1, 333, 64, 699, 65].into_iter().enumerate() {
        let rc = RandomCase::new(cfg.clone(), t, 40 + i as u64);
        let (map, p, b) = dense(&cfg, t, &rc.routes, &rc.probs);
        stream.memcpy_htod(&rc.counts, &mut bufs.counts).unwrap();
        if t > 0 {
            stream.memcpy_htod(&rc.routes, &mut bufs.ids.slice_mut(..t * k)).unwrap();
            stream.memcpy_htod(&rc.probs, &mut bufs.probs_k.slice_mut(..t * k)).unwrap();
            stream.memcpy_htod(&map, &mut bufs.map.slice_mut(..t * e)).unwrap();
            stream.memcpy_htod(&p, &mut bufs.probs.slice_mut(..t * e)).unwrap();
        }
        stream.memcpy_htod(&vec![POISON_I32; t_max * k], &mut bufs.out_dest).unwrap();
        stream.memcpy_htod(&vec![POISON_F32; t_max * k], &mut bufs.out_pk).unwrap();
        stream.memcpy_htod(&vec![POISON_U8; t_max * w], &mut bufs.out_map).unwrap();
        stream.memcpy_htod(&vec![POISON_F32; t_max * w], &mut bufs.out_probs).unwrap();
        stream.memcpy_htod(&[t as i32], &mut tokens).unwrap();
        graph.launch().unwrap();

        let name = format!("device T = {t} (t_max {t_max})");
        let want = reference::plan(&cfg, &rc.counts).unwrap();
        stages_equal(&name, &plan.read_stages(&stream, &bufs.state).unwrap(), &want);
        assert!(plan.read_errors(&stream, &bufs.state).unwrap().is_empty(), "{name}: error word");
        let dest = stream.clone_dtoh(&bufs.out_dest).unwrap();
        assert_eq!(
            &dest[..t * k],
            &reference::reroute_topk(&cfg, &want, &rc.counts, &rc.routes, t).unwrap()[..],
            "{name}: destinations"
        );
        assert!(dest[t * k..].iter().all(|&c| c == POISON_I32), "{name}: a destination past T was written");
        let pk = bits(&stream.clone_dtoh(&bufs.out_pk).unwrap());
        assert_eq!(&pk[..t * k], &bits(&rc.probs)[..], "{name}: top-k probs");
        assert!(pk[t * k..].iter().all(|&v| v == POISON_F32.to_bits()), "{name}: a top-k prob past T was written");
        let (wm, wp) = reference::reroute_dense(&cfg, &want, &rc.counts, &b, &p, t).unwrap();
        let om = stream.clone_dtoh(&bufs.out_map).unwrap();
        let op = bits(&stream.clone_dtoh(&bufs.out_probs).unwrap());
        assert_eq!(map_bits(&name, &om[..t * w]), wm, "{name}: dense map");
        assert_eq!(&op[..t * w], &bits(&wp)[..], "{name}: dense probs");
        assert!(om[t * w..].iter().all(|&v| v == POISON_U8), "{name}: a dense map row past T was written");
        assert!(op[t * w..].iter().all(|&v| v == POISON_F32.to_bits()), "{name}: a dense prob row past T was written");
    }
    for bad in [-1i32, t_max as i32 + 1] {
        stream.memcpy_htod(&[bad], &mut tokens).unwrap();
        graph.launch().unwrap();
        let errs = plan.read_errors(&stream, &bufs.state).unwrap();
        assert!(errs.contains(DeviceErrors::BAD_TOKENS), "device T = {bad}: {errs:?}");
    }
}

#[test]
fn device_error_flags() {
    let stream = gpu_or_skip!();
    let cfg = EchoConfig {
        ep: 4,
        num_experts: 16,
        spare_per_rank: 1,
        ep_rank: 1,
        topk: 2,
        algorithm: Algorithm::Approx,
        threshold_multiplier: 0.0,
    };
    let t = 40;
    let rc = RandomCase::new(cfg.clone(), t, 9);
    let plan = EchoPlan::new(cfg.clone(), t).unwrap();
    // counts[ep_rank] disagrees with the routing.
    let mut counts = rc.counts.clone();
    counts[cfg.ep_rank * 16 + 3] += 1;
    let mut b = Bufs::new(&stream, &plan, &counts, &rc.routes, &rc.probs, t);
    b.topk(&stream, &plan, t).unwrap();
    assert!(plan.read_errors(&stream, &b.state).unwrap().contains(DeviceErrors::ROUTING_MISMATCH));
    // Expert id out of range: that route gets -1, nothing else is touched.
    let mut ids = rc.routes.clone();
    ids[5] = 16;
    let mut b = Bufs::new(&stream, &plan, &rc.counts, &ids, &rc.probs, t);
    b.topk(&stream, &plan, t).unwrap();
    assert!(plan.read_errors(&stream, &b.state).unwrap().contains(DeviceErrors::EXPERT_OUT_OF_RANGE));
    assert_eq!(stream.clone_dtoh(&b.out_dest).unwrap()[5], -1);
    // Duplicate route within a token.
    let mut ids = rc.routes.clone();
    ids[1] = ids[0];
    let mut b = Bufs::new(&stream, &plan, &rc.counts, &ids, &rc.probs, t);
    b.topk(&stream, &plan, t).unwrap();
    assert!(plan.read_errors(&stream, &b.state).unwrap().contains(DeviceErrors::DUPLICATE_ROUTE));
    // Negative count: the plan is zeroed, so nothing moves.
    let mut counts = rc.counts.clone();
    counts[2] = -5;
    let mut b = Bufs::new(&stream, &plan, &counts, &rc.routes, &rc.probs, t);
    b.topk(&stream, &plan, t).unwrap();
    let errs = plan.read_errors(&stream, &b.state).unwrap();
    assert!(errs.contains(DeviceErrors::NEGATIVE_COUNT), "{errs:?}");
    let st = plan.read_stages(&stream, &b.state).unwrap();
    assert!(st.slot_expert.iter().all(|&x| x == -1));
    // A good run afterwards clears the word (each plan launch overwrites it): on the state of
    // the errored run above, with good counts loaded into its buffers.
    stream.memcpy_htod(&rc.counts, &mut b.counts).unwrap();
    b.topk(&stream, &plan, t).unwrap();
    assert!(plan.read_errors(&stream, &b.state).unwrap().is_empty());
}

#[test]
fn host_checks_reject_bad_buffers() {
    let stream = gpu_or_skip!();
    let cfg = EchoConfig {
        ep: 4,
        num_experts: 16,
        spare_per_rank: 2,
        ep_rank: 0,
        topk: 2,
        algorithm: Algorithm::Greedy,
        threshold_multiplier: 0.0,
    };
    let t = 32;
    let rc = RandomCase::new(cfg.clone(), t, 4);
    let plan = EchoPlan::new(cfg.clone(), t).unwrap();
    let mut b = Bufs::new(&stream, &plan, &rc.counts, &rc.routes, &rc.probs, t);
    assert!(matches!(b.topk(&stream, &plan, t + 1), Err(Error::InvalidArgument { .. })));
    let mut small_ws = stream.alloc_zeros::<i32>(plan.workspace_len() - 1).unwrap();
    let r = plan.plan_reroute_topk(
        &stream,
        &b.counts,
        &b.ids,
        &b.probs_k,
        Tokens::Host(t),
        &mut b.state,
        &mut small_ws,
        &mut b.out_dest,
        &mut b.out_pk,
    );
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    let short = stream.alloc_zeros::<i64>(10).unwrap();
    assert!(matches!(plan.plan(&stream, &short, &mut b.state), Err(Error::Shape { .. })));
    let mut short_out = stream.alloc_zeros::<u8>(t * cfg.num_columns() - 1).unwrap();
    let r = plan.plan_reroute_dense(
        &stream,
        &b.counts,
        &b.map,
        &b.probs,
        Tokens::Host(t),
        &mut b.state,
        &mut b.ws,
        &mut short_out,
        &mut b.out_probs,
    );
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    // A state view one i64 off a 16-byte boundary is refused before anything runs.
    let mut wide_state = stream.alloc_zeros::<i64>(plan.state_len() + 1).unwrap();
    let mut off_state = wide_state.slice_mut(1..plan.state_len() + 1);
    let r = plan.plan(&stream, &b.counts, &mut off_state);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let bad = EchoConfig { spare_per_rank: 2, algorithm: Algorithm::Approx, ..cfg };
    assert!(matches!(EchoPlan::new(bad, 8), Err(Error::InvalidArgument { .. })));
}

#[test]
fn spare_weights_fill_and_grad_fold() {
    let stream = gpu_or_skip!();
    let (ne, s) = (16usize, 12usize);
    let slot_expert: Vec<i64> = vec![-1, 3, 3, 7, -1, 0, 15, 3, -1, 7, 2, -1];
    for per in [1usize, 5, 64, 1000] {
        // bf16-sized elements as u16; odd sizes take the byte path.
        let home: Vec<u16> = (0..ne * per).map(|i| (i * 7 + 1) as u16).collect();
        let spare0: Vec<u16> = vec![0xBEEF; s * per];
        let se = stream.clone_htod(&slot_expert).unwrap();
        let home_d = stream.clone_htod(&home).unwrap();
        let mut spare_d = stream.clone_htod(&spare0).unwrap();
        let mut err = stream.alloc_zeros::<i64>(1).unwrap();
        echo::fill_spare_weights(&stream, &se, ne, 0, s, &home_d, &mut spare_d, per, &mut err).unwrap();
        let got = stream.clone_dtoh(&spare_d).unwrap();
        for j in 0..s {
            for i in 0..per {
                let want = if slot_expert[j] < 0 { 0xBEEF } else { home[slot_expert[j] as usize * per + i] };
                assert_eq!(got[j * per + i], want, "fill per={per} slot {j} elem {i}");
            }
        }
        // Local range of slots: rank 1 of 3 (slots 4..8).
        let mut local = stream.clone_htod(&vec![0xBEEFu16; 4 * per]).unwrap();
        echo::fill_spare_weights(&stream, &se, ne, 4, 4, &home_d, &mut local, per, &mut err).unwrap();
        let got = stream.clone_dtoh(&local).unwrap();
        for j in 0..4 {
            let e = slot_expert[4 + j];
            for i in 0..per {
                let want = if e < 0 { 0xBEEF } else { home[e as usize * per + i] };
                assert_eq!(got[j * per + i], want, "local fill per={per} slot {} elem {i}", 4 + j);
            }
        }
        assert_eq!(stream.clone_dtoh(&err).unwrap()[0], 0, "fill per={per}: error word");

        let dw_home: Vec<f32> = (0..ne * per).map(|i| (i as f32 * 0.37).sin()).collect();
        let dw_slot: Vec<f32> = (0..s * per).map(|i| (i as f32 * 1.31).cos() * 1e-3).collect();
        let mut h_d = stream.clone_htod(&dw_home).unwrap();
        let s_d = stream.clone_htod(&dw_slot).unwrap();
        echo::fold_spare_grads(&stream, &se, ne, s, &s_d, &mut h_d, per, &mut err).unwrap();
        let got = stream.clone_dtoh(&h_d).unwrap();
        let mut want = dw_home.clone();
        for j in 0..s {
            if slot_expert[j] >= 0 {
                let e = slot_expert[j] as usize;
                for i in 0..per {
                    want[e * per + i] += dw_slot[j * per + i];
                }
            }
        }
        assert_eq!(bits(&got), bits(&want), "fold per={per}");
        assert_eq!(stream.clone_dtoh(&err).unwrap()[0], 0, "fold per={per}: error word");
    }
    // Out-of-range slot expert: flagged, skipped.
    let se = stream.clone_htod(&vec![16i64, 0]).unwrap();
    let home_d = stream.clone_htod(&vec![1u8; 16 * 4]).unwrap();
    let mut spare_d = stream.clone_htod(&vec![9u8; 2 * 4]).unwrap();
    let mut err = stream.alloc_zeros::<i64>(1).unwrap();
    echo::fill_spare_weights(&stream, &se, 16, 0, 2, &home_d, &mut spare_d, 4, &mut err).unwrap();
    assert_eq!(stream.clone_dtoh(&spare_d).unwrap(), vec![9, 9, 9, 9, 1, 1, 1, 1]);
    assert_eq!(stream.clone_dtoh(&err).unwrap()[0] as u32, DeviceErrors::BAD_SLOT_EXPERT);

    // More slots than one call handles: a typed error before anything is launched.
    let too_many = echo::MAX_WEIGHT_SLOTS + 1;
    let se = stream.alloc_zeros::<i64>(too_many).unwrap();
    let mut spare_d = stream.alloc_zeros::<u8>(too_many * 4).unwrap();
    let r = echo::fill_spare_weights(&stream, &se, 16, 0, too_many, &home_d, &mut spare_d, 4, &mut err);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let dw_slot = stream.alloc_zeros::<f32>(too_many).unwrap();
    let mut dw_home = stream.alloc_zeros::<f32>(16).unwrap();
    let r = echo::fold_spare_grads(&stream, &se, 16, too_many, &dw_slot, &mut dw_home, 1, &mut err);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}
