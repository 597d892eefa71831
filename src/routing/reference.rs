//! CPU reference of every routing kernel, written for clarity, following the same layout
//! contract and the same floating-point recipe (fp32 `mul_add` in ascending slot order, one
//! rounding to the output type), so the GPU results can be compared bitwise where the math
//! is exact and within tolerance where it is not (SwiGLU's exponential).

use half::{bf16, f16};

use super::flags;

/// A scalar the kernels read and write: converts to fp32 and back with round-to-nearest-even.
pub trait Scalar: Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Scalar for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Scalar for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Scalar for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// The routing maps of one `build`, as the device writes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteMaps {
    /// Rows kept per expert, `[E]`.
    pub m_splits: Vec<i64>,
    /// Exclusive prefix sum of `m_splits`, `[E + 1]`.
    pub offsets: Vec<i64>,
    /// Row of route `t * k + j`, or -1, `[T_max * k]`.
    pub row_of_route: Vec<i32>,
    /// Token of each row, -1 past `offsets[E]`, `[capacity]`.
    pub token_of_row: Vec<i32>,
    /// Routes per expert before dropping, `[E]`.
    pub expert_counts: Vec<i32>,
    /// Flag bits the launch ORs in.
    pub flags: i32,
}

/// The token count a launch uses: a device value is clamped into `[0, t_max]` (flagging
/// `BAD_TOKENS` when it had to be).
pub fn resolve_tokens(device_value: i32, t_max: usize) -> (usize, i32) {
    if device_value < 0 {
        (0, flags::BAD_TOKENS)
    } else if device_value as usize > t_max {
        (t_max, flags::BAD_TOKENS)
    } else {
        (device_value as usize, 0)
    }
}

/// Counts, offsets and maps: rows are expert-contiguous, experts ascending, routes within an
/// expert in ascending `t * k + j`; `-1` ids are empty slots; other ids outside `[0, E)` are
/// dropped with `BAD_EXPERT`; an expert keeps at most `expert_capacity` routes (0: no limit),
/// then rows at or past `capacity` are dropped; either drop sets `CAPACITY`.
pub fn build(
    expert_ids: &[i32],
    tokens: usize,
    t_max: usize,
    num_experts: usize,
    k: usize,
    capacity: usize,
    expert_capacity: usize,
) -> RouteMaps {
    assert!(tokens <= t_max && expert_ids.len() >= t_max * k);
    let e_count = num_experts;
    let mut fl = 0;
    let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); e_count];
    for (r, &e) in expert_ids.iter().enumerate().take(tokens * k) {
        if e == -1 {
            continue;
        }
        if e < 0 || e as usize >= e_count {
            fl |= flags::BAD_EXPERT;
            continue;
        }
        per_expert[e as usize].push(r);
    }
    let mut row_of_route = vec![-1i32; t_max * k];
    let mut token_of_row = vec![-1i32; capacity];
    let mut m_splits = vec![0i64; e_count];
    let mut offsets = vec![0i64; e_count + 1];
    let mut expert_counts = vec![0i32; e_count];
    let mut next = 0usize;
    for (e, routes) in per_expert.iter().enumerate() {
        expert_counts[e] = routes.len() as i32;
        offsets[e] = next as i64;
        for (rank, &r) in routes.iter().enumerate() {
            if (expert_capacity > 0 && rank >= expert_capacity) || next >= capacity {
                fl |= flags::CAPACITY;
                continue;
            }
            row_of_route[r] = next as i32;
            token_of_row[next] = (r / k) as i32;
            next += 1;
        }
        m_splits[e] = next as i64 - offsets[e];
    }
    offsets[e_count] = next as i64;
    RouteMaps { m_splits, offsets, row_of_route, token_of_row, expert_counts, flags: fl }
}

/// Megatron `[T, E]` map -> `[T, k]` ids and probs (ascending expert; extra routes dropped with
/// `TOO_MANY`; empty slots id -1, prob 0). Writes only tokens `t < tokens`; returns the flags.
pub fn from_map<P: Scalar>(
    map: &[u8],
    map_probs: &[P],
    tokens: usize,
    num_experts: usize,
    k: usize,
    expert_ids: &mut [i32],
    probs: &mut [P],
) -> i32 {
    let mut fl = 0;
    for t in 0..tokens {
        let hits: Vec<usize> = (0..num_experts).filter(|&e| map[t * num_experts + e] != 0).collect();
        if hits.len() > k {
            fl |= flags::TOO_MANY;
        }
        for j in 0..k {
            match hits.get(j) {
                Some(&e) => {
                    expert_ids[t * k + j] = e as i32;
                    probs[t * k + j] = map_probs[t * num_experts + e];
                }
                None => {
                    expert_ids[t * k + j] = -1;
                    probs[t * k + j] = P::from_f32(0.0);
                }
            }
        }
    }
    fl
}

fn kept_row(row_of_route: &[i32], r: usize, capacity: usize) -> Option<usize> {
    let row = row_of_route[r];
    (row >= 0 && (row as usize) < capacity).then_some(row as usize)
}

/// `rows[row(t, j)] = x[t]`; other rows are left as they are.
pub fn permute<T: Copy>(
    x: &[T],
    row_of_route: &[i32],
    tokens: usize,
    hidden: usize,
    k: usize,
    capacity: usize,
    rows: &mut [T],
) {
    for t in 0..tokens {
        for j in 0..k {
            if let Some(row) = kept_row(row_of_route, t * k + j, capacity) {
                rows[row * hidden..(row + 1) * hidden].copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
            }
        }
    }
}

/// `out[t] = sum_j w_j * rows[row(t, j)]` with `w_j = probs[t, j]` (or 1 without probs), fp32
/// `mul_add` in ascending j, rounded once: unpermute, and (without probs) permute's backward.
pub fn gather_sum<T: Scalar, P: Scalar>(
    rows: &[T],
    row_of_route: &[i32],
    probs: Option<&[P]>,
    tokens: usize,
    hidden: usize,
    k: usize,
    capacity: usize,
    out: &mut [T],
) {
    for t in 0..tokens {
        for c in 0..hidden {
            let mut acc = 0.0f32;
            for j in 0..k {
                if let Some(row) = kept_row(row_of_route, t * k + j, capacity) {
                    let w = probs.map_or(1.0, |p| p[t * k + j].to_f32());
                    acc = w.mul_add(rows[row * hidden + c].to_f32(), acc);
                }
            }
            out[t * hidden + c] = T::from_f32(acc);
        }
    }
}

/// `prob_of_row[row(t, j)] = probs[t, j]` as f32 for every kept route; other rows are left as
/// they are (capmoe_routing_row_probs).
pub fn row_probs<P: Scalar>(
    row_of_route: &[i32],
    probs: &[P],
    tokens: usize,
    k: usize,
    capacity: usize,
    prob_of_row: &mut [f32],
) {
    for route in 0..tokens * k {
        if let Some(row) = kept_row(row_of_route, route, capacity) {
            prob_of_row[row] = probs[route].to_f32();
        }
    }
}

/// `dprobs[t, j] = Σ_s partials[row(t, j) * slices + s]` (f32 adds in ascending s, rounded
/// once), 0 for a dropped route (capmoe_routing_route_dprobs).
pub fn route_dprobs<P: Scalar>(
    row_of_route: &[i32],
    partials: &[f32],
    slices: usize,
    tokens: usize,
    k: usize,
    capacity: usize,
    dprobs: &mut [P],
) {
    for route in 0..tokens * k {
        let sum = kept_row(row_of_route, route, capacity)
            .map_or(0.0f32, |row| partials[row * slices..(row + 1) * slices].iter().fold(0.0f32, |acc, &v| acc + v));
        dprobs[route] = P::from_f32(sum);
    }
}

/// Unpermute's backward: `drows[row(t, j)] = probs[t, j] * dy[t]` (fp32 product, rounded once)
/// and `dprobs[t, j] = <dy[t], rows[row(t, j)]>` (summed in f64 and rounded once: equal to the
/// device's fp32 sum whenever every partial sum is exact, e.g. small integers), 0 if dropped.
#[allow(clippy::too_many_arguments)]
pub fn unpermute_backward<T: Scalar, P: Scalar>(
    dy: &[T],
    rows: &[T],
    row_of_route: &[i32],
    probs: &[P],
    tokens: usize,
    hidden: usize,
    k: usize,
    capacity: usize,
    drows: &mut [T],
    dprobs: &mut [P],
) {
    for t in 0..tokens {
        for j in 0..k {
            let p = probs[t * k + j].to_f32();
            let mut dot = 0.0f64;
            if let Some(row) = kept_row(row_of_route, t * k + j, capacity) {
                for c in 0..hidden {
                    let g = dy[t * hidden + c].to_f32();
                    dot += g as f64 * rows[row * hidden + c].to_f32() as f64;
                    drows[row * hidden + c] = T::from_f32(g * p);
                }
            }
            dprobs[t * k + j] = P::from_f32(dot as f32);
        }
    }
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `act[r, f] = silu(h[r, f]) * h[r, F + f]` for `r < total_rows`.
pub fn swiglu<T: Scalar>(h: &[T], total_rows: usize, ffn: usize, act: &mut [T]) {
    for r in 0..total_rows {
        for f in 0..ffn {
            let g = h[r * 2 * ffn + f].to_f32();
            let u = h[r * 2 * ffn + ffn + f].to_f32();
            act[r * ffn + f] = T::from_f32(g * sigmoid(g) * u);
        }
    }
}

/// SwiGLU's backward for `r < total_rows`: `dg = dact * u * s * (1 + g (1 - s))`,
/// `du = dact * g * s`, `s = sigmoid(g)`.
pub fn swiglu_backward<T: Scalar>(dact: &[T], h: &[T], total_rows: usize, ffn: usize, dh: &mut [T]) {
    for r in 0..total_rows {
        for f in 0..ffn {
            let g = h[r * 2 * ffn + f].to_f32();
            let u = h[r * 2 * ffn + ffn + f].to_f32();
            let d = dact[r * ffn + f].to_f32();
            let s = sigmoid(g);
            dh[r * 2 * ffn + f] = T::from_f32(d * u * s * (1.0 + g * (1.0 - s)));
            dh[r * 2 * ffn + ffn + f] = T::from_f32(d * g * s);
        }
    }
}
