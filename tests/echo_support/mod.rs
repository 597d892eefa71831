//! Golden-vector loading and random-input generation shared by the echo tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use capturable_moe::echo::reference::PlanStages;
use capturable_moe::echo::{Algorithm, EchoConfig};
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// One golden case with the spec's deterministic overlay already applied.
pub struct Golden {
    pub name: String,
    pub raw: Value,
    /// `None` where the configuration must be rejected (`expected.error`).
    pub cfg: EchoConfig,
    pub count_only: bool,
    pub counts: Vec<i64>,
    pub t: usize,
    pub routes: Vec<i32>,
    pub probs: Vec<f32>,
    /// `expected` with `deterministic` laid over it.
    pub expected: serde_json::Map<String, Value>,
}

/// The golden folder: `CAPMOE_ECHO_GOLDEN_DIR`, else the crate's `tests/data/echo`, else
/// `tests/data/echo` under the working directory (a test binary run from another checkout).
pub fn golden_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("CAPMOE_ECHO_GOLDEN_DIR") {
        return PathBuf::from(dir);
    }
    let baked = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/echo");
    if baked.is_dir() {
        baked
    } else {
        PathBuf::from("tests/data/echo")
    }
}

pub fn golden_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("tests/data/echo exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 32, "expected the 32 golden cases, found {}", files.len());
    files
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

pub fn load(path: &Path) -> Golden {
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(raw["schema"], "echo-golden-v1");
    let c = &raw["config"];
    let u = |k: &str| c[k].as_u64().unwrap() as usize;
    let cfg = EchoConfig {
        ep: u("ep"),
        num_experts: u("num_experts"),
        spare_per_rank: u("spare_per_rank"),
        ep_rank: u("ep_rank"),
        topk: u("topk"),
        algorithm: Algorithm::from_name(c["algorithm"].as_str().unwrap()).unwrap(),
        threshold_multiplier: c["threshold_multiplier"].as_f64().unwrap() as f32,
    };
    assert_eq!(u("num_spare"), cfg.num_spare());
    assert_eq!(u("local_experts"), cfg.num_experts / cfg.ep);
    let count_only = c["count_only"].as_bool().unwrap_or(false);
    let inputs = &raw["inputs"];
    let counts: Vec<i64> = inputs["counts"].as_array().unwrap().iter().flat_map(ints).collect();
    let (mut t, mut routes, mut probs) = (0, Vec::new(), Vec::new());
    if !count_only {
        t = inputs["T"].as_u64().unwrap() as usize;
        for row in inputs["routes"].as_array().unwrap() {
            let row = ints(row);
            assert_eq!(row.len(), cfg.topk);
            routes.extend(row.iter().map(|&x| x as i32));
        }
        for row in inputs["probs"].as_array().unwrap() {
            probs.extend(row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32));
        }
        assert_eq!(routes.len(), t * cfg.topk);
        assert_eq!(probs.len(), t * cfg.topk);
    }
    let mut expected = raw["expected"].as_object().unwrap().clone();
    if let Some(det) = raw.get("deterministic").and_then(Value::as_object) {
        for (k, v) in det {
            expected.insert(k.clone(), v.clone());
        }
    }
    Golden {
        name: raw["name"].as_str().unwrap().to_string(),
        raw: raw.clone(),
        cfg,
        count_only,
        counts,
        t,
        routes,
        probs,
        expected,
    }
}

impl Golden {
    pub fn rejected(&self) -> bool {
        self.expected.contains_key("error")
    }

    pub fn vec(&self, key: &str) -> Vec<i64> {
        ints(&self.expected[key])
    }

    pub fn has(&self, key: &str) -> bool {
        self.expected.contains_key(key)
    }

    /// A sparse `[row, col, value]` list as a dense `rows x cols` matrix.
    pub fn dense(&self, key: &str, rows: usize, cols: usize) -> Vec<i64> {
        let mut m = vec![0i64; rows * cols];
        for tr in self.expected[key].as_array().unwrap() {
            let tr = ints(tr);
            let (r, c) = (tr[0] as usize, tr[1] as usize);
            assert!(r < rows && c < cols, "{}: {key} triple {tr:?} outside [{rows}, {cols}]", self.name);
            m[r * cols + c] = tr[2];
        }
        m
    }

    /// `route_dest` flattened to `[T * k]`.
    pub fn route_dest(&self) -> Vec<i32> {
        let mut v = Vec::new();
        for row in self.expected["route_dest"].as_array().unwrap() {
            v.extend(ints(row).iter().map(|&x| x as i32));
        }
        v
    }

    /// Dense `[T, E]` routing map and probabilities of this rank.
    pub fn dense_inputs(&self) -> (Vec<bool>, Vec<f32>) {
        dense_inputs(self.cfg.num_experts, self.cfg.topk, self.t, &self.routes, &self.probs)
    }

    /// The expected dense `[T, E+S]` outputs rebuilt from `route_dest`.
    pub fn expected_dense_outputs(&self) -> (Vec<bool>, Vec<f32>) {
        let (w, k) = (self.cfg.num_columns(), self.cfg.topk);
        let dest = self.route_dest();
        let mut map = vec![false; self.t * w];
        let mut probs = vec![0f32; self.t * w];
        for i in 0..self.t {
            for s in 0..k {
                let c = dest[i * k + s] as usize;
                map[i * w + c] = true;
                probs[i * w + c] = self.probs[i * k + s];
            }
        }
        (map, probs)
    }
}

/// A random but consistent problem: `counts[ep_rank]` equals the column sums of the routes.
pub struct RandomCase {
    pub cfg: EchoConfig,
    pub counts: Vec<i64>,
    pub t: usize,
    pub routes: Vec<i32>,
    pub probs: Vec<f32>,
}

impl RandomCase {
    /// Skewed routing: expert popularity drawn from a heavy-tailed weight per expert.
    pub fn new(cfg: EchoConfig, t: usize, seed: u64) -> RandomCase {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (ne, k, ep) = (cfg.num_experts, cfg.topk, cfg.ep);
        let skew: f64 = rng.random_range(0.0..3.0);
        let weights: Vec<f64> = (0..ne).map(|_| (rng.random::<f64>() * skew).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut routes = Vec::with_capacity(t * k);
        let mut probs = Vec::with_capacity(t * k);
        let mut counts = vec![0i64; ep * ne];
        for r in 0..ep {
            let tokens = if r == cfg.ep_rank { t } else { rng.random_range(0..=t.max(1) * 2) };
            for _ in 0..tokens {
                let mut picked: Vec<i32> = Vec::with_capacity(k);
                while picked.len() < k {
                    let mut u = rng.random::<f64>() * total;
                    let mut x = ne - 1;
                    for (i, w) in weights.iter().enumerate() {
                        if u < *w {
                            x = i;
                            break;
                        }
                        u -= w;
                    }
                    if !picked.contains(&(x as i32)) {
                        picked.push(x as i32);
                    }
                }
                picked.sort();
                for &x in &picked {
                    counts[r * ne + x as usize] += 1;
                }
                if r == cfg.ep_rank {
                    routes.extend(&picked);
                    probs.extend((0..k).map(|_| rng.random::<f32>() + 1e-3));
                }
            }
        }
        RandomCase { cfg, counts, t, routes, probs }
    }

    pub fn dense_inputs(&self) -> (Vec<bool>, Vec<f32>) {
        dense_inputs(self.cfg.num_experts, self.cfg.topk, self.t, &self.routes, &self.probs)
    }
}

/// Compares one stage, reporting the first differing index.
pub fn same(case: &str, stage: &str, got: &[i64], want: &[i64]) {
    assert_eq!(got.len(), want.len(), "{case}: {stage}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{case}: {stage}[{i}]: got {}, expected {} (len {})", got[i], want[i], got.len());
    }
}

/// Checks every planner stage recorded in a golden case.
pub fn check_stages(g: &Golden, st: &PlanStages) {
    let (ep, e, s) = (g.cfg.ep, g.cfg.num_experts, g.cfg.num_spare());
    let n = &g.name;
    same(n, "tokens_per_expert", &st.tokens_per_expert, &g.vec("tokens_per_expert"));
    same(n, "load_per_rank", &st.load_per_rank, &g.vec("load_per_rank"));
    assert_eq!(st.avg, g.expected["avg"].as_i64().unwrap(), "{n}: avg");
    same(n, "spill", &st.spill, &g.vec("spill"));
    same(n, "spare_capacity", &st.spare_capacity, &g.vec("spare_capacity"));
    if g.has("assignment_pre_reclaim") {
        same(n, "assignment_pre_reclaim", &st.assignment_pre_reclaim, &g.dense("assignment_pre_reclaim", e, s));
    }
    same(n, "assignment", &st.assignment, &g.dense("assignment", e, s));
    same(n, "slot_expert", &st.slot_expert, &g.vec("slot_expert"));
    same(n, "first_pass", &st.first_pass, &g.dense("first_pass", ep, s));
    same(n, "first_pass_home_offload", &st.first_pass_home_offload, &g.dense("first_pass_home_offload", ep, e));
    same(n, "remaining_capacity", &st.remaining_capacity, &g.dense("remaining_capacity", e, s));
    same(n, "second_pass", &st.second_pass, &g.dense("second_pass", ep, s));
    same(n, "tokens_to_slot", &st.tokens_to_slot, &g.dense("tokens_to_slot", ep, s));
    same(n, "home_offload", &st.home_offload, &g.dense("home_offload", ep, e));
    same(n, "load_after", &st.load_after, &g.vec("load_after"));
}

/// The planner's invariants 1–5 (`docs/echo.md`, "Invariants").
pub fn check_plan_invariants(name: &str, cfg: &EchoConfig, counts: &[i64], st: &PlanStages) {
    let (ep, ne, sp) = (cfg.ep, cfg.num_experts, cfg.spare_per_rank);
    let (l, s) = (ne / ep, ep * sp);
    let avg = st.avg;
    for q in 0..ep {
        let spills: i64 = st.spill[q * l..(q + 1) * l].iter().sum();
        assert_eq!(spills, (st.load_per_rank[q] - avg).max(0), "{name}: spills of rank {q}");
        assert_eq!(st.spare_capacity[q], (avg - st.load_per_rank[q]).max(0), "{name}: cap {q}");
    }
    for x in 0..ne {
        assert!(st.spill[x] >= 0 && st.spill[x] <= st.tokens_per_expert[x], "{name}: spill {x}");
        let placed: i64 = (0..s).map(|j| st.assignment[x * s + j]).sum();
        assert!(placed <= st.spill[x], "{name}: expert {x} places {placed} > spill");
    }
    for j in 0..s {
        let nz: Vec<usize> = (0..ne).filter(|&x| st.assignment[x * s + j] != 0).collect();
        assert!(nz.len() <= 1, "{name}: slot {j} has {} suppliers", nz.len());
        for &x in &nz {
            assert!(st.assignment[x * s + j] > 0, "{name}: H < 0");
            assert_ne!(x / l, j / sp, "{name}: expert {x} offloaded onto its own rank (slot {j})");
        }
        let want_se = nz.first().map_or(-1, |&x| x as i64);
        assert_eq!(st.slot_expert[j], want_se, "{name}: slot_expert[{j}]");
        let hsum: i64 = nz.first().map_or(0, |&x| st.assignment[x * s + j]);
        let got: i64 = (0..ep).map(|r| st.tokens_to_slot[r * s + j]).sum();
        assert_eq!(got, hsum, "{name}: slot {j} filled with {got} of {hsum}");
        for r in 0..ep {
            assert!(st.first_pass[r * s + j] >= 0 && st.second_pass[r * s + j] >= 0, "{name}: F, D >= 0");
        }
        for x in 0..ne {
            assert!(st.remaining_capacity[x * s + j] >= 0, "{name}: Rm >= 0");
        }
    }
    for q in 0..ep {
        let into: i64 = (q * sp..(q + 1) * sp).map(|j| (0..ne).map(|x| st.assignment[x * s + j]).sum::<i64>()).sum();
        assert!(into <= st.spare_capacity[q], "{name}: rank {q} receives {into} > cap");
    }
    for r in 0..ep {
        for x in 0..ne {
            let sum: i64 =
                (0..s).filter(|&j| st.slot_expert[j] == x as i64).map(|j| st.tokens_to_slot[r * s + j]).sum();
            assert_eq!(st.home_offload[r * ne + x], sum, "{name}: home_offload[{r}][{x}]");
            assert!(sum <= counts[r * ne + x], "{name}: home_offload[{r}][{x}] > C");
        }
    }
    let total: i64 = st.load_per_rank.iter().sum();
    assert_eq!(st.load_after.iter().sum::<i64>(), total, "{name}: load conserved");
    for q in 0..ep {
        let (lo, hi) = (st.load_per_rank[q].min(avg), st.load_per_rank[q].max(avg));
        assert!(
            st.load_after[q] >= lo && st.load_after[q] <= hi,
            "{name}: after[{q}] = {} outside [{lo}, {hi}]",
            st.load_after[q]
        );
    }
    let max_before = st.load_per_rank.iter().max().unwrap();
    assert!(st.load_after.iter().max().unwrap() <= max_before, "{name}: max load grew");
}

/// The planner's invariant 6 (`docs/echo.md`, "Invariants"), on the top-k form's destinations.
pub fn check_reroute_invariants(name: &str, cfg: &EchoConfig, st: &PlanStages, routes: &[i32], t: usize, dest: &[i32]) {
    let (k, s) = (cfg.topk, cfg.num_spare());
    assert_eq!(dest.len(), t * k, "{name}: dest length");
    let mut per_slot = vec![0i64; s];
    for i in 0..t {
        let mut seen = std::collections::HashSet::new();
        for r in 0..k {
            let x = routes[i * k + r] as usize;
            let c = dest[i * k + r] as usize;
            assert!(c < cfg.num_columns(), "{name}: column {c} out of range");
            assert!(seen.insert(c), "{name}: token {i} has two routes in column {c}");
            if c != cfg.expert_column(x) {
                let j = (0..s)
                    .find(|&j| cfg.slot_column(j) == c)
                    .unwrap_or_else(|| panic!("{name}: token {i} route {x} ends in home column {c} of another expert"));
                assert_eq!(st.slot_expert[j], x as i64, "{name}: token {i}: slot {j} not fed by {x}");
                per_slot[j] += 1;
            }
        }
    }
    for j in 0..s {
        assert_eq!(per_slot[j], st.tokens_to_slot[cfg.ep_rank * s + j], "{name}: tokens into slot {j}");
    }
}

/// Dense `[T, E]` routing map and probabilities from top-k routes and their probabilities.
fn dense_inputs(e: usize, k: usize, t: usize, routes: &[i32], route_probs: &[f32]) -> (Vec<bool>, Vec<f32>) {
    let mut map = vec![false; t * e];
    let mut probs = vec![0f32; t * e];
    for i in 0..t {
        for s in 0..k {
            let x = routes[i * k + s] as usize;
            map[i * e + x] = true;
            probs[i * e + x] = route_probs[i * k + s];
        }
    }
    (map, probs)
}

/// The block-balancing case of docs/ep.md's drop table: EP64 E256, 1024 tokens a rank, k = 8,
/// zipf 1.0 routing (seed 7) on every rank: the all-gathered counts, every rank's routes, and
/// probs for one rank's routes; `config(rank)` plans as that rank (greedy, two spare slots a
/// rank).
pub struct Ep64Zipf {
    pub counts: Vec<i64>,
    pub ids_per_rank: Vec<Vec<i32>>,
    pub probs: Vec<f32>,
}

impl Ep64Zipf {
    pub const EP: usize = 64;
    pub const EXPERTS: usize = 256;
    pub const TOKENS: usize = 1024;
    pub const TOPK: usize = 8;

    pub fn new() -> Ep64Zipf {
        let (ep, e, t, k) = (Self::EP, Self::EXPERTS, Self::TOKENS, Self::TOPK);
        let ids_per_rank = capturable_moe::ep::simulate::zipf_routing(ep, t, e, k, 1.0, 7);
        let mut counts = vec![0i64; ep * e];
        for (r, ids) in ids_per_rank.iter().enumerate() {
            ids.iter().for_each(|&x| counts[r * e + x as usize] += 1);
        }
        let probs = (0..t * k).map(|i| (i % 97 + 1) as f32 / 98.0).collect();
        Ep64Zipf { counts, ids_per_rank, probs }
    }

    pub fn config(rank: usize) -> EchoConfig {
        EchoConfig {
            ep: Self::EP,
            num_experts: Self::EXPERTS,
            spare_per_rank: 2,
            ep_rank: rank,
            topk: Self::TOPK,
            algorithm: Algorithm::Greedy,
            threshold_multiplier: 0.0,
        }
    }

    /// The block capacity at `factor` times the balanced load.
    pub fn capacity(factor: f64) -> usize {
        capturable_moe::ep::balanced_capacity(Self::TOKENS, Self::TOPK, Self::EP, factor)
    }
}
