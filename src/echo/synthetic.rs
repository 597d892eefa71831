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
pub fn synthetic_inputs(cfg: &EchoConfig, t: usize, seed: u64) -> (Vec<i64>, Vec<i32>, Vec<f32>) {
    let mut next = xorshift(seed);
    let (ne, k) = (cfg.num_experts, cfg.topk);
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
