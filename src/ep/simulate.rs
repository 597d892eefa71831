//! Dropped routes of a whole EP group, worked out on the host with the CPU reference planner:
//! how many routes a static block capacity drops with and without Echo, for R simulated ranks
//! each with its own routing. The benchmark's drop table and the tests use it: the drop count
//! is routing arithmetic, the same on any number of GPUs, so it needs none.

use crate::echo::synthetic::xorshift;
use crate::echo::{reference, EchoConfig};
use crate::{Error, Result};

/// Drops of one group step at one block capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCount {
    /// Real routes of all ranks.
    pub routes: usize,
    /// Routes past a full (source, destination) block, plain EP.
    pub dropped_plain: usize,
    /// The same with Echo's reroute as the spec plans it.
    pub dropped_echo: usize,
    /// The same with Echo and block balancing (what `ep::EpMoe`, feature `nccl`, runs: each rank's
    /// routes moved among an expert's columns so that no block passes the capacity where
    /// another column has room; [`reference::balance_blocks`]).
    pub dropped_balanced: usize,
    /// The fullest block's routes, plain EP, Echo and Echo balanced.
    pub max_block_plain: usize,
    pub max_block_echo: usize,
    pub max_block_balanced: usize,
}

/// Zipf-skewed top-k routing for `ranks` ranks of `tokens` tokens each: expert `e` is drawn
/// with weight `1 / (1 + perm(e))^exponent` (a fixed random permutation `perm`, so the hot
/// experts spread over ranks), k distinct experts per token. `exponent = 0` is uniform.
/// Deterministic in `seed`.
pub fn zipf_routing(
    ranks: usize,
    tokens: usize,
    experts: usize,
    topk: usize,
    exponent: f64,
    seed: u64,
) -> Vec<Vec<i32>> {
    let mut next = xorshift(seed);
    let mut perm: Vec<usize> = (0..experts).collect();
    for i in (1..experts).rev() {
        perm.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let weight: Vec<f64> = perm.iter().map(|&p| (1.0 + p as f64).powf(-exponent)).collect();
    let total: f64 = weight.iter().sum();
    let draw = |u: u64| {
        let mut x = (u >> 11) as f64 / (1u64 << 53) as f64 * total;
        for (e, &w) in weight.iter().enumerate() {
            if x < w {
                return e as i32;
            }
            x -= w;
        }
        experts as i32 - 1
    };
    (0..ranks)
        .map(|_| {
            let mut ids = Vec::with_capacity(tokens * topk);
            for _ in 0..tokens {
                let mut row: Vec<i32> = Vec::with_capacity(topk);
                while row.len() < topk {
                    let e = draw(next());
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            ids
        })
        .collect()
}

/// Routes per (source, destination) block for the final columns of every rank
/// (`cols_per_rank` columns a rank).
fn block_loads(dest_per_rank: &[Vec<i32>], cols_per_rank: usize) -> Vec<Vec<usize>> {
    let ranks = dest_per_rank.len();
    dest_per_rank
        .iter()
        .map(|dest| {
            let mut load = vec![0usize; ranks];
            for &c in dest.iter().filter(|&&c| c >= 0) {
                load[c as usize / cols_per_rank] += 1;
            }
            load
        })
        .collect()
}

fn drops(loads: &[Vec<usize>], capacity: usize) -> (usize, usize) {
    let dropped = loads.iter().flatten().map(|&n| n.saturating_sub(capacity)).sum();
    let fullest = loads.iter().flatten().copied().max().unwrap_or(0);
    (dropped, fullest)
}

/// Drops at `capacity` rows per block for the routing `ids_per_rank` (one `[T, k]` routing per
/// rank, `cfg.ep` of them; `cfg.ep_rank` is ignored), plain and with Echo planned by the CPU
/// reference from the all-gathered counts, as every rank of the group would.
pub fn count_drops(cfg: &EchoConfig, ids_per_rank: &[Vec<i32>], capacity: usize) -> Result<DropCount> {
    cfg.validate()?;
    let (ranks, ne, k) = (cfg.ep, cfg.num_experts, cfg.topk);
    if ids_per_rank.len() != ranks || ids_per_rank.iter().any(|ids| ids.len() % k != 0) {
        return Err(Error::InvalidArgument {
            op: "ep::simulate::count_drops",
            why: format!("need {ranks} routings of [T, {k}] expert ids"),
        });
    }
    let mut counts = vec![0i64; ranks * ne];
    for (r, ids) in ids_per_rank.iter().enumerate() {
        for &e in ids.iter().filter(|&&e| e >= 0) {
            counts[r * ne + e as usize] += 1;
        }
    }
    let stages = reference::plan(cfg, &counts)?;
    let (mut echo_dest, mut balanced_dest) = (Vec::with_capacity(ranks), Vec::with_capacity(ranks));
    for (r, ids) in ids_per_rank.iter().enumerate() {
        let rank_cfg = EchoConfig { ep_rank: r, ..cfg.clone() };
        let t = ids.len() / k;
        echo_dest.push(reference::reroute_topk(&rank_cfg, &stages, &counts, ids, t)?);
        let balanced = reference::balance_blocks(&rank_cfg, &stages, &counts, capacity)?;
        balanced_dest.push(reference::reroute_topk(&rank_cfg, &balanced, &counts, ids, t)?);
    }
    let per_rank = cfg.local_experts() + cfg.spare_per_rank;
    let (dropped_plain, max_block_plain) = drops(&block_loads(ids_per_rank, cfg.local_experts()), capacity);
    let (dropped_echo, max_block_echo) = drops(&block_loads(&echo_dest, per_rank), capacity);
    let (dropped_balanced, max_block_balanced) = drops(&block_loads(&balanced_dest, per_rank), capacity);
    Ok(DropCount {
        routes: ids_per_rank.iter().flatten().filter(|&&e| e >= 0).count(),
        dropped_plain,
        dropped_echo,
        dropped_balanced,
        max_block_plain,
        max_block_echo,
        max_block_balanced,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::echo::Algorithm;

    fn cfg(ep: usize, experts: usize, spare: usize) -> EchoConfig {
        EchoConfig {
            ep,
            num_experts: experts,
            spare_per_rank: spare,
            ep_rank: 0,
            topk: 4,
            algorithm: Algorithm::default_for(spare),
            threshold_multiplier: 0.0,
        }
    }

    #[test]
    fn zipf_routing_is_deterministic_distinct_and_skewed() {
        let a = zipf_routing(2, 256, 16, 4, 1.2, 5);
        assert_eq!(a, zipf_routing(2, 256, 16, 4, 1.2, 5));
        for row in a[0].chunks(4) {
            let mut r = row.to_vec();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), 4, "distinct experts per token");
        }
        let mut hits = [0usize; 16];
        a.iter().flatten().for_each(|&e| hits[e as usize] += 1);
        let (lo, hi) = (hits.iter().min().unwrap(), hits.iter().max().unwrap());
        // Every expert gets routes, and the hottest more than 3x the coldest (a cold expert
        // with no route would make the ratio hold for any routing).
        assert!(*lo > 0 && *hi > 3 * lo, "zipf 1.2 should be skewed over every expert: {hits:?}");
    }

    #[test]
    fn ample_capacity_drops_nothing_and_block_maxima_agree() {
        let c = cfg(4, 16, 1);
        let ids = zipf_routing(4, 128, 16, 4, 1.0, 1);
        let d = count_drops(&c, &ids, 128 * 4).unwrap();
        assert_eq!((d.dropped_plain, d.dropped_echo), (0, 0));
        assert_eq!(d.routes, 4 * 128 * 4);
        let tight = count_drops(&c, &ids, d.max_block_plain - 1).unwrap();
        assert!(tight.dropped_plain > 0, "one row less than the fullest block drops");
    }
}
