//! Shapes, routes and reference rows shared by the fused kernels' GPU tests (fused_gpu,
//! fused_dgrad_gpu).
#![allow(dead_code)]

use capturable_moe::dtype::DType;
use capturable_moe::routing::RoutingConfig;
use rand::{rngs::StdRng, Rng};

use super::routing::topk_ids;

/// One routing shape: E experts, model width H, FFN width F, k routes per token, up to T_max
/// tokens, an optional row capacity.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub e: usize,
    pub h: usize,
    pub f: usize,
    pub k: usize,
    pub t_max: usize,
    pub capacity: Option<usize>,
}

impl Shape {
    pub fn routing(&self, dtype: DType) -> RoutingConfig {
        RoutingConfig {
            num_experts: self.e,
            hidden: self.h,
            ffn: self.f,
            topk: self.k,
            max_tokens: self.t_max,
            capacity: self.capacity,
            expert_capacity: None,
            dtype,
            prob_dtype: DType::F32,
        }
    }
}

/// What one launch routes (`T_max * k` ids; the routing reads the first `T * k`).
#[derive(Clone, Copy, Debug)]
pub enum Routes {
    /// [`messy_ids`] over every expert.
    Messy,
    /// [`messy_ids`] with the spread routes on even experts only: the odd ones stay empty.
    MessyEvenExperts,
    /// All k routes of every token to this expert.
    AllTo(i32),
    /// k distinct experts per token, uniformly at random.
    TopK,
}

impl Routes {
    pub fn ids(self, rng: &mut StdRng, shape: Shape) -> Vec<i32> {
        match self {
            Routes::Messy => messy_ids(rng, shape, false),
            Routes::MessyEvenExperts => messy_ids(rng, shape, true),
            Routes::AllTo(expert) => vec![expert; shape.t_max * shape.k],
            Routes::TopK => topk_ids(rng, shape.t_max, shape.e, shape.k),
        }
    }

    /// The routes of graph replay `i`: every seventh all to expert 5, `messy` otherwise.
    pub fn of_replay(i: usize, messy: Routes) -> Routes {
        if i % 7 == 3 {
            Routes::AllTo(5)
        } else {
            messy
        }
    }
}

/// Routes with everything the routing allows: duplicates within a token, empty slots (-1),
/// out-of-range ids (dropped), a heavy expert 0, and the rest spread over the experts (the even
/// ones only with `even_experts`, so that the odd ones get nothing).
pub fn messy_ids(rng: &mut StdRng, shape: Shape, even_experts: bool) -> Vec<i32> {
    (0..shape.t_max * shape.k)
        .map(|_| match rng.random_range(0..20) {
            0 => -1,
            1 => shape.e as i32 + rng.random_range(0..3),
            2 => -7,
            3..=6 => 0,
            _ if even_experts => 2 * rng.random_range(0..shape.e as i32 / 2),
            _ => rng.random_range(0..shape.e as i32),
        })
        .collect()
}

/// T of graph replay `i`: 0, T_max, then random in [1, T_max], in turn.
pub fn replay_tokens(rng: &mut StdRng, i: usize, t_max: usize) -> usize {
    match i % 5 {
        0 => 0,
        1 => t_max,
        _ => rng.random_range(1..=t_max),
    }
}

/// The rows an fp64 reference checks: every row of `[0, total)`, or `n` spread over it plus
/// both ends, the first M tile boundary (127, 128) and the middle.
pub fn sample_rows(total: usize, sample: Option<usize>) -> Vec<usize> {
    let Some(n) = sample else {
        return (0..total).collect();
    };
    let last = total.saturating_sub(1);
    let mut rows: Vec<usize> = (0..n).map(|i| i * total / n.max(1)).collect();
    rows.extend([last, 127.min(last), 128.min(last), total / 2]);
    rows.retain(|&r| r < total);
    rows.sort_unstable();
    rows.dedup();
    rows
}
