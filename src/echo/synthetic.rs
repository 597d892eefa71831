//! Deterministic Echo inputs for tests and benchmarks: a skewed top-k routing on this rank
//! with a consistent `counts[ep_rank]` row, and skewed counts on the other ranks. Kept in the
//! library (not the benchmark crate) because the library's own tests and `capmoe-bench` share it,
//! and a user benchmarking the planner needs the same inputs.

use super::EchoConfig;

/// A xorshift64 stream from `seed` (never zero): the deterministic generator of the synthetic
/// inputs here and of `ep::simulate`'s routings.
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// Deterministic inputs: skewed top-k routing on this rank, consistent `counts[ep_rank]`,
/// skewed random counts on the other ranks.
///
/// Panics when `topk > num_experts` (a token's k experts are distinct).
pub fn synthetic_inputs(cfg: &EchoConfig, t: usize, seed: u64) -> (Vec<i64>, Vec<i32>, Vec<f32>) {
    let mut next = xorshift(seed);
    let (ne, k) = (cfg.num_experts, cfg.topk);
    assert!(k <= ne, "synthetic_inputs: topk {k} > num_experts {ne}: no k distinct experts per token");
    // Popularity: a few hot experts.
    let weights: Vec<u64> = (0..ne).map(|_| 1 + (next() % 8).pow(3)).collect();
    let total: u64 = weights.iter().sum();
    let mut counts = vec![0i64; cfg.ep * ne];
    let mut ids = Vec::with_capacity(t * k);
    let mut probs = Vec::with_capacity(t * k);
    for i in 0..t {
        let mut row: Vec<i32> = Vec::with_capacity(k);
        while row.len() < k {
            let mut u = next() % total;
            let mut x = 0;
            while u >= weights[x] {
                u -= weights[x];
                x += 1;
            }
            if !row.contains(&(x as i32)) {
                row.push(x as i32);
            }
        }
        row.sort();
        for &x in &row {
            counts[cfg.ep_rank * ne + x as usize] += 1;
        }
        ids.extend(&row);
        probs.extend((0..k).map(|j| ((i * k + j) % 97 + 1) as f32 / 98.0));
    }
    for r in (0..cfg.ep).filter(|&r| r != cfg.ep_rank) {
        for x in 0..ne {
            counts[r * ne + x] = ((next() % (2 * t as u64 * k as u64 / ne as u64 + 1)) * weights[x] / 8) as i64;
        }
    }
    (counts, ids, probs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::echo::Algorithm;

    fn config(num_experts: usize, topk: usize) -> EchoConfig {
        EchoConfig {
            ep: 2,
            num_experts,
            spare_per_rank: 1,
            ep_rank: 0,
            topk,
            algorithm: Algorithm::Greedy,
            threshold_multiplier: 1.0,
        }
    }

    #[test]
    fn every_token_gets_topk_distinct_experts_host() {
        let (_, ids, _) = synthetic_inputs(&config(8, 8), 5, 1);
        for row in ids.chunks(8) {
            assert_eq!(row, (0..8).collect::<Vec<i32>>().as_slice());
        }
    }

    #[test]
    #[should_panic(expected = "topk 9 > num_experts 8")]
    fn more_routes_than_experts_panics_instead_of_looping_host() {
        synthetic_inputs(&config(8, 9), 1, 1);
    }
}
