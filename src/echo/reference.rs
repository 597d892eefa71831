//! CPU reference of the Echo planner (spec `echo-planner.md`, stages P1–P9), written for
//! clarity, not speed. Every intermediate the golden data records is kept, dense.
//!
//! Ties follow the spec's deterministic rule: order by key, then by index ascending.
//! Float32 stages (P3, P5) use the exact operation order of the spec; Rust never fuses
//! `a * b + c`, so these match the GPU's `__fmul_rn` / `__fadd_rn` / `__fdiv_rn`.

use super::{Algorithm, EchoConfig};
use crate::{Error, Result};

/// Every stage of one plan, dense, in the spec's numbering (`H[e][j]` is `assignment[e * S + j]`).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanStages {
    /// P1: `n[e]`, tokens per expert over all source ranks.
    pub tokens_per_expert: Vec<i64>,
    /// P1: `load[q]`.
    pub load_per_rank: Vec<i64>,
    /// P1: `floor(sum load / EP)`.
    pub avg: i64,
    /// P1: `spill[e]`.
    pub spill: Vec<i64>,
    /// P1: `cap[q]`.
    pub spare_capacity: Vec<i64>,
    /// P2: `H` before reclaim, `[E, S]`.
    pub assignment_pre_reclaim: Vec<i64>,
    /// P2/P3: `H`, `[E, S]`.
    pub assignment: Vec<i64>,
    /// P4: home expert of each slot, -1 = empty.
    pub slot_expert: Vec<i64>,
    /// P5: `F`, `[EP, S]`.
    pub first_pass: Vec<i64>,
    /// P5: `C - C1`, `[EP, E]`.
    pub first_pass_home_offload: Vec<i64>,
    /// P5: `Rm`, `[E, S]`.
    pub remaining_capacity: Vec<i64>,
    /// P6: `D`, `[EP, S]`.
    pub second_pass: Vec<i64>,
    /// P7: `Ftot = F + D`, `[EP, S]`.
    pub tokens_to_slot: Vec<i64>,
    /// P7: `C - C2`, `[EP, E]`.
    pub home_offload: Vec<i64>,
    /// Load of every rank once every rank has rerouted, `[EP]`.
    pub load_after: Vec<i64>,
}

impl PlanStages {
    /// `M[e][j]` of the offload map, `[E, S]`.
    pub fn offload_map(&self, cfg: &EchoConfig) -> Vec<bool> {
        let s = cfg.num_spare();
        let mut m = vec![false; cfg.num_experts * s];
        for (j, &e) in self.slot_expert.iter().enumerate() {
            if e >= 0 {
                m[e as usize * s + j] = true;
            }
        }
        m
    }
}

/// Checks the count matrix (`[EP, E]`, non-negative, every expert total below 2^24).
pub fn check_counts(cfg: &EchoConfig, counts: &[i64]) -> Result<()> {
    const OP: &str = "echo plan (reference)";
    let (ep, e) = (cfg.ep, cfg.num_experts);
    if counts.len() != ep * e {
        return Err(Error::Shape {
            op: OP,
            what: "counts [EP, E]",
            expected: format!("{} elements ([{ep}, {e}])", ep * e),
            got: counts.len().to_string(),
        });
    }
    if let Some(i) = counts.iter().position(|&c| c < 0) {
        return Err(Error::InvalidArgument {
            op: OP,
            why: format!("counts[{}][{}] = {} is negative", i / e, i % e, counts[i]),
        });
    }
    for x in 0..e {
        let n: i64 = (0..ep).map(|r| counts[r * e + x]).sum();
        if n >= 1 << 24 {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("expert {x} has {n} tokens; the float32 first pass needs < 2^24"),
            });
        }
    }
    Ok(())
}

/// Stages P1–P7 from the count matrix `counts[r * E + e]`.
pub fn plan(cfg: &EchoConfig, counts: &[i64]) -> Result<PlanStages> {
    cfg.validate()?;
    check_counts(cfg, counts)?;
    let (ep, ne, sp) = (cfg.ep, cfg.num_experts, cfg.spare_per_rank);
    let l = ne / ep;
    let s = ep * sp;
    let c = |r: usize, x: usize| counts[r * ne + x];

    // P1
    let n: Vec<i64> = (0..ne).map(|x| (0..ep).map(|r| c(r, x)).sum()).collect();
    let load: Vec<i64> = (0..ep).map(|q| n[q * l..(q + 1) * l].iter().sum()).collect();
    let avg = load.iter().sum::<i64>() / ep as i64;
    let cap: Vec<i64> = load.iter().map(|&x| (avg - x).max(0)).collect();
    let mut spill = vec![0i64; ne];
    for q in 0..ep {
        let mut order: Vec<usize> = (q * l..(q + 1) * l).collect();
        order.sort_by_key(|&x| (n[x], x));
        let mut run = 0i64;
        for x in order {
            let before = (run - avg).max(0);
            run += n[x];
            spill[x] = (run - avg).max(0) - before;
        }
    }

    // P2
    let mut h = vec![0i64; ne * s];
    let mut ps: Vec<usize> = (0..ne).collect();
    ps.sort_by_key(|&x| (std::cmp::Reverse(spill[x]), x));
    let mut pc: Vec<usize> = (0..ep).collect();
    pc.sort_by_key(|&q| (std::cmp::Reverse(cap[q]), q));
    match cfg.algorithm {
        Algorithm::Greedy => {
            let mut ce = Vec::with_capacity(ne);
            let mut acc = 0;
            for &x in &ps {
                acc += spill[x];
                ce.push(acc);
            }
            let mut be = Vec::with_capacity(ep);
            acc = 0;
            for &q in &pc {
                acc += cap[q];
                be.push(acc);
            }
            for (b, &q) in pc.iter().enumerate() {
                let bs = be[b] - cap[q];
                let ov = |a: usize| {
                    let cs = ce[a] - spill[ps[a]];
                    (ce[a].min(be[b]) - cs.max(bs)).max(0)
                };
                let mut picks: Vec<usize> = (0..ne).collect();
                picks.sort_by_key(|&a| (std::cmp::Reverse(ov(a)), a));
                for (slot, &a) in picks.iter().take(sp).enumerate() {
                    let v = ov(a);
                    if v > 0 {
                        h[ps[a] * s + q * sp + slot] = v;
                    }
                }
            }
        }
        Algorithm::Approx => {
            let mut rest: Vec<i64> = ps.iter().map(|&x| spill[x]).collect();
            let m = avg;
            let iv = m / 7;
            let bucket = |v: i64| -> usize {
                if v >= m || iv == 0 {
                    0
                } else {
                    (((m - v) / iv + 1) as usize).min(7)
                }
            };
            let mut queues: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); 8];
            for (a, &v) in rest.iter().enumerate() {
                if v > 0 {
                    queues[bucket(v)].push_back(a);
                }
            }
            let mut cur = 0usize;
            for (b, &q) in pc.iter().enumerate() {
                let cp = cap[q];
                if cp <= 0 {
                    break;
                }
                let mut pick = None;
                while cur < 8 {
                    if let Some(a) = queues[cur].pop_front() {
                        pick = Some(a);
                        break;
                    }
                    cur += 1;
                }
                let Some(a) = pick else { break };
                let x = rest[a].min(cp);
                rest[a] -= x;
                // S_per == 1: slot index == rank index.
                h[ps[a] * s + pc[b]] = x;
                if rest[a] > 0 {
                    queues[bucket(rest[a])].push_back(a);
                }
            }
        }
    }
    let assignment_pre_reclaim = h.clone();

    // P3
    if cfg.algorithm == Algorithm::Greedy && cfg.threshold_multiplier > 0.0 {
        let avgf = avg as f32;
        let maxload = avgf + cfg.threshold_multiplier * avgf;
        let mut keep = vec![false; s];
        #[allow(clippy::needless_range_loop)] // q also names the rank's expert range
        for q in 0..ep {
            let mut v = vec![0i64; s];
            for x in q * l..(q + 1) * l {
                for j in 0..s {
                    v[j] += h[x * s + j];
                }
            }
            let after = load[q] - v.iter().sum::<i64>();
            let head = maxload - after as f32;
            let mut ord: Vec<usize> = (0..s).collect();
            ord.sort_by_key(|&j| (v[j], j));
            let mut cum = 0i64;
            let mut k0 = 0;
            for &j in &ord {
                cum += v[j];
                if cum as f32 <= head {
                    k0 += 1;
                }
            }
            for &j in &ord[k0..] {
                keep[j] = true;
            }
        }
        for x in 0..ne {
            for j in 0..s {
                if !keep[j] {
                    h[x * s + j] = 0;
                }
            }
        }
    }

    let passes = passes_from_assignment(cfg, counts, &h)?;
    let PassStages {
        slot_expert,
        first_pass: f,
        first_pass_home_offload: fpho,
        remaining_capacity: rm,
        second_pass: d,
        tokens_to_slot: ftot,
        home_offload,
    } = passes;
    let mut load_after = load.clone();
    for j in 0..s {
        if let Ok(x) = usize::try_from(slot_expert[j]) {
            let v = h[x * s + j];
            load_after[x / l] -= v;
            load_after[j / sp] += v;
        }
    }

    Ok(PlanStages {
        tokens_per_expert: n,
        load_per_rank: load,
        avg,
        spill,
        spare_capacity: cap,
        assignment_pre_reclaim,
        assignment: h,
        slot_expert,
        first_pass: f,
        first_pass_home_offload: fpho,
        remaining_capacity: rm,
        second_pass: d,
        tokens_to_slot: ftot,
        home_offload,
        load_after,
    })
}

/// Stages P4–P7 of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PassStages {
    pub slot_expert: Vec<i64>,
    pub first_pass: Vec<i64>,
    pub first_pass_home_offload: Vec<i64>,
    pub remaining_capacity: Vec<i64>,
    pub second_pass: Vec<i64>,
    pub tokens_to_slot: Vec<i64>,
    pub home_offload: Vec<i64>,
}

/// Stages P4–P7 from the count matrix and a given assignment `H [E, S]` (the golden data's
/// stage-level check: these stages have no ties).
pub fn passes_from_assignment(cfg: &EchoConfig, counts: &[i64], h: &[i64]) -> Result<PassStages> {
    cfg.validate()?;
    check_counts(cfg, counts)?;
    let (ep, ne) = (cfg.ep, cfg.num_experts);
    let s = cfg.num_spare();
    if h.len() != ne * s {
        return Err(Error::Shape {
            op: "echo passes (reference)",
            what: "assignment [E, S]",
            expected: (ne * s).to_string(),
            got: h.len().to_string(),
        });
    }
    let c = |r: usize, x: usize| counts[r * ne + x];
    let n: Vec<i64> = (0..ne).map(|x| (0..ep).map(|r| c(r, x)).sum()).collect();
    // P4
    let slot_expert: Vec<i64> = (0..s).map(|j| (0..ne).find(|&x| h[x * s + j] > 0).map_or(-1, |x| x as i64)).collect();

    // P5
    let mut f = vec![0i64; ep * s];
    let mut rm = vec![0i64; ne * s];
    for j in 0..s {
        let Ok(x) = usize::try_from(slot_expert[j]) else { continue };
        let cj = h[x * s + j];
        let den = n[x] as f32;
        let mut sum = 0;
        for r in 0..ep {
            let share = c(r, x) as f32 / den;
            let v = (share * cj as f32).floor() as i64;
            f[r * s + j] = v;
            sum += v;
        }
        rm[x * s + j] = cj - sum;
    }
    let se = &slot_expert;
    let slots_of = |x: usize| (0..s).filter(move |&j| se[j] == x as i64);
    let mut fpho = vec![0i64; ep * ne];
    for r in 0..ep {
        for x in 0..ne {
            fpho[r * ne + x] = slots_of(x).map(|j| f[r * s + j]).sum();
        }
    }

    // P6
    let mut d = vec![0i64; ep * s];
    for x in 0..ne {
        let mut bj = 0i64;
        for j in slots_of(x) {
            let rmj = rm[x * s + j];
            let mut a = 0i64;
            for r in 0..ep {
                let c1 = c(r, x) - fpho[r * ne + x];
                d[r * s + j] = ((a + c1).min(bj + rmj) - a.max(bj)).max(0);
                a += c1;
            }
            bj += rmj;
        }
    }

    // P7
    let ftot: Vec<i64> = f.iter().zip(&d).map(|(a, b)| a + b).collect();
    let mut home_offload = vec![0i64; ep * ne];
    for r in 0..ep {
        for x in 0..ne {
            home_offload[r * ne + x] = slots_of(x).map(|j| ftot[r * s + j]).sum();
        }
    }

    Ok(PassStages {
        slot_expert,
        first_pass: f,
        first_pass_home_offload: fpho,
        remaining_capacity: rm,
        second_pass: d,
        tokens_to_slot: ftot,
        home_offload,
    })
}

/// Which slot (if any) each of this rank's routed tokens of expert `e` moves to: the routed
/// tokens in ascending order, position `p` goes to the slot `j` of `e` whose range
/// `[off_j, off_j + Ftot[rho][j])` holds `p` (slots of `e` in ascending `j`).
fn slot_ranges(cfg: &EchoConfig, stages: &PlanStages) -> Vec<Vec<(usize, i64, i64)>> {
    let s = cfg.num_spare();
    let mut ranges = vec![Vec::new(); cfg.num_experts];
    for j in 0..s {
        if let Ok(x) = usize::try_from(stages.slot_expert[j]) {
            let take = stages.tokens_to_slot[cfg.ep_rank * s + j];
            let off = ranges[x].last().map_or(0, |&(_, o, k): &(usize, i64, i64)| o + k);
            ranges[x].push((j, off, take));
        }
    }
    ranges
}

fn checked_tokens(op: &'static str, what: &'static str, len: usize, want: usize) -> Result<()> {
    if len != want {
        return Err(Error::Shape { op, what, expected: want.to_string(), got: len.to_string() });
    }
    Ok(())
}

/// P8 + P9, Megatron form: `routing [T, E]` and `probs [T, E]` to the interleaved `[T, E+S]`
/// map and probabilities. Fails if `C[rho]` is not the column sums of `routing`.
pub fn reroute_dense(
    cfg: &EchoConfig,
    stages: &PlanStages,
    counts: &[i64],
    routing: &[bool],
    probs: &[f32],
    t: usize,
) -> Result<(Vec<bool>, Vec<f32>)> {
    const OP: &str = "echo reroute (reference)";
    let ne = cfg.num_experts;
    let width = cfg.num_columns();
    checked_tokens(OP, "routing [T, E] elements", routing.len(), t * ne)?;
    checked_tokens(OP, "probs [T, E] elements", probs.len(), t * ne)?;
    for x in 0..ne {
        let got = (0..t).filter(|&i| routing[i * ne + x]).count() as i64;
        let want = counts[cfg.ep_rank * ne + x];
        if got != want {
            return Err(Error::InvalidArgument {
                op: OP,
                why: format!("expert {x}: routing has {got} tokens but counts[ep_rank] says {want}"),
            });
        }
    }
    let ranges = slot_ranges(cfg, stages);
    let mut out_map = vec![false; t * width];
    let mut out_probs = vec![0f32; t * width];
    for x in 0..ne {
        let mut pos = 0i64;
        for i in 0..t {
            if !routing[i * ne + x] {
                continue;
            }
            let col = ranges[x]
                .iter()
                .find(|&&(_, off, take)| pos >= off && pos < off + take)
                .map_or(cfg.expert_column(x), |&(j, _, _)| cfg.slot_column(j));
            out_map[i * width + col] = true;
            out_probs[i * width + col] = probs[i * ne + x];
            pos += 1;
        }
    }
    Ok((out_map, out_probs))
}

/// P8 + P9, top-k form: `expert_ids [T, k]` (distinct per token) to the final interleaved
/// column of every route (the golden `route_dest`). Probabilities stay aligned with the route.
pub fn reroute_topk(
    cfg: &EchoConfig,
    stages: &PlanStages,
    counts: &[i64],
    expert_ids: &[i32],
    t: usize,
) -> Result<Vec<i32>> {
    const OP: &str = "echo reroute top-k (reference)";
    let (ne, k) = (cfg.num_experts, cfg.topk);
    checked_tokens(OP, "expert_ids [T, k] elements", expert_ids.len(), t * k)?;
    let mut routing = vec![false; t * ne];
    for i in 0..t {
        for &x in &expert_ids[i * k..(i + 1) * k] {
            let Some(x) = usize::try_from(x).ok().filter(|&x| x < ne) else {
                return Err(Error::InvalidArgument {
                    op: OP,
                    why: format!("token {i}: expert id {x} outside [0, {ne})"),
                });
            };
            if std::mem::replace(&mut routing[i * ne + x], true) {
                return Err(Error::InvalidArgument { op: OP, why: format!("token {i} lists expert {x} twice") });
            }
        }
    }
    let probs = vec![1f32; t * ne];
    let (map, _) = reroute_dense(cfg, stages, counts, &routing, &probs, t)?;
    let width = cfg.num_columns();
    let ranges = slot_ranges(cfg, stages);
    let mut dest = vec![0i32; t * k];
    for i in 0..t {
        for (slot, &x) in expert_ids[i * k..(i + 1) * k].iter().enumerate() {
            let x = x as usize;
            let home = cfg.expert_column(x);
            let col = if map[i * width + home] {
                home
            } else {
                // Moved: exactly one slot of x holds this token.
                ranges[x]
                    .iter()
                    .map(|&(j, _, _)| cfg.slot_column(j))
                    .find(|&c| map[i * width + c])
                    .expect("a moved route lands in one slot of its expert")
            };
            dest[i * k + slot] = col as i32;
        }
    }
    Ok(dest)
}

/// Block balancing, an EP extension beyond the spec (`capmoe_echo_plan_reroute_topk_capped`):
/// this rank's (`cfg.ep_rank`, rho) routes moved among the columns of each replicated expert
/// (its home column and its spare slots) so that no block of routes from rho to one peer holds
/// more than `capacity`, wherever another column of the same expert has room. Returns the
/// plan with row rho of `tokens_to_slot` and `home_offload` rewritten; every other field is
/// the plan's. The reroute (P8) then follows the new row as it follows the plan's.
///
/// The rule, in the order the device follows it:
/// 1. `amount[c]`: rho's routes at final column c under the plan (a home column keeps
///    `C[rho][e] - home_offload[rho][e]`, a slot takes `Ftot[rho][j]`); `load[q]`: their sum
///    over peer q's columns.
/// 2. For every peer d in ascending order with `load[d] > capacity`, for its columns c in
///    ascending order while d is over: if c's expert has a spare slot, move up to
///    `min(amount[c], load[d] - capacity)` routes, repeatedly, to the expert's column on
///    another peer with the most room (`capacity - load`; ties: the lowest column), at most
///    that room each time, until the excess is gone or no column of the expert has room.
///    A move never fills a peer past `capacity`, so no peer passes it that was not over.
/// 3. Each slot of an expert takes the next `amount` of the expert's tokens in slot order (the
///    spec's range rule), the home column the rest.
pub fn balance_blocks(cfg: &EchoConfig, stages: &PlanStages, counts: &[i64], capacity: usize) -> Result<PlanStages> {
    check_counts(cfg, counts)?;
    let (ne, s, l, sp, ep, rho) =
        (cfg.num_experts, cfg.num_spare(), cfg.local_experts(), cfg.spare_per_rank, cfg.ep, cfg.ep_rank);
    let per_rank = l + sp;
    let cap = capacity as i64;
    let expert_of = |c: usize| -> Option<usize> {
        let (q, i) = (c / per_rank, c % per_rank);
        if i < l {
            Some(q * l + i)
        } else {
            usize::try_from(stages.slot_expert[q * sp + i - l]).ok()
        }
    };
    // Every column of each expert, ascending (the home column, then its slots' columns).
    let mut columns: Vec<Vec<usize>> = (0..ne).map(|x| vec![cfg.expert_column(x)]).collect();
    for (j, &x) in stages.slot_expert.iter().enumerate() {
        if let Ok(x) = usize::try_from(x) {
            columns[x].push(cfg.slot_column(j));
        }
    }
    for c in &mut columns {
        c.sort_unstable();
    }
    let mut amount = vec![0i64; ep * per_rank];
    for x in 0..ne {
        amount[cfg.expert_column(x)] = counts[rho * ne + x] - stages.home_offload[rho * ne + x];
    }
    for j in 0..s {
        amount[cfg.slot_column(j)] = stages.tokens_to_slot[rho * s + j];
    }
    let mut load: Vec<i64> = amount.chunks(per_rank).map(|c| c.iter().sum()).collect();
    for d in 0..ep {
        for c in d * per_rank..(d + 1) * per_rank {
            let Some(x) = expert_of(c).filter(|&x| columns[x].len() > 1) else { continue };
            let mut todo = amount[c].min(load[d] - cap);
            while todo > 0 {
                let room = |c2: usize| cap - load[c2 / per_rank];
                let Some(best) = columns[x]
                    .iter()
                    .copied()
                    .filter(|&c2| c2 / per_rank != d)
                    .max_by_key(|&c2| (room(c2), std::cmp::Reverse(c2)))
                    .filter(|&c2| room(c2) > 0)
                else {
                    break;
                };
                let m = todo.min(room(best));
                amount[c] -= m;
                amount[best] += m;
                load[d] -= m;
                load[best / per_rank] += m;
                todo -= m;
            }
        }
    }
    let mut out = stages.clone();
    for j in 0..s {
        out.tokens_to_slot[rho * s + j] = if stages.slot_expert[j] >= 0 { amount[cfg.slot_column(j)] } else { 0 };
    }
    for x in 0..ne {
        out.home_offload[rho * ne + x] = counts[rho * ne + x] - amount[cfg.expert_column(x)];
    }
    Ok(out)
}
