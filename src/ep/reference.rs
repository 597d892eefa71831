//! CPU reference of every EP kernel (`capturable_moe/ep.h`), written for clarity: the same
//! layout contract and floating-point recipe (fp32 sums in ascending order, one rounding), so
//! the device results must equal it bit for bit. `tokens` is the resolved token count T
//! ([`resolve_tokens`] for a device count).

use crate::routing::{self, reference::Scalar};

use super::{flags, EpConfig};

/// The token count a launch uses: a device value is clamped into `[0, t_max]`, flagging
/// [`flags::BAD_TOKENS`] when it had to be.
/// The same clamp as the routing kernels' (the EP kernels share their device code), with the
/// EP word's bit.
pub fn resolve_tokens(device_value: i32, t_max: usize) -> (usize, i32) {
    let (tokens, routing_bits) = routing::reference::resolve_tokens(device_value, t_max);
    (tokens, if routing_bits != 0 { flags::BAD_TOKENS } else { 0 })
}

/// `counts [E]`: routes `t < tokens` per home expert; `-1` is no route, other ids outside
/// `[0, E)` are skipped with [`flags::BAD_EXPERT`]. Returns the counts and the flags.
pub fn count_routes(c: &EpConfig, expert_ids: &[i32], tokens: usize) -> (Vec<i64>, i32) {
    let mut counts = vec![0i64; c.num_experts];
    let mut bits = 0;
    for &e in &expert_ids[..tokens * c.topk] {
        match usize::try_from(e) {
            Ok(e) if e < c.num_experts => counts[e] += 1,
            _ if e == -1 => {}
            _ => bits |= flags::BAD_EXPERT,
        }
    }
    (counts, bits)
}

/// What [`dispatch_layout`] writes, as the device writes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    /// `[T_max * k]`.
    pub slot_of_route: Vec<i32>,
    /// `[R * capacity]`.
    pub send_ids: Vec<i32>,
    /// `[R * capacity]`.
    pub send_probs: Vec<f32>,
    /// `[R]`.
    pub send_counts: Vec<i32>,
    /// `[R]`.
    pub dropped: Vec<i32>,
    /// Flag bits the launch ORs in (not including [`flags::BAD_TOKENS`], which
    /// [`resolve_tokens`] gives).
    pub flags: i32,
}

/// The dispatch layout: routes `t < tokens` in ascending `(t, j)` order go to the peer of their
/// final column `dest / cols_per_rank`; a peer block keeps its first `capacity` routes, the
/// rest are dropped ([`flags::OVERFLOW`]); a dest outside `[-1, R * cols_per_rank)` is dropped
/// with [`flags::BAD_DEST`].
pub fn dispatch_layout(c: &EpConfig, dest: &[i32], probs: &[f32], tokens: usize) -> Layout {
    let (r, cap, cols) = (c.ranks, c.capacity, c.cols_per_rank());
    let mut out = Layout {
        slot_of_route: vec![-1; c.routes_len()],
        send_ids: vec![-1; r * cap],
        send_probs: vec![0.0; r * cap],
        send_counts: vec![0; r],
        dropped: vec![0; r],
        flags: 0,
    };
    let mut routed = vec![0usize; r];
    for i in 0..tokens * c.topk {
        let col = dest[i];
        if col == -1 {
            continue;
        }
        if col < -1 || col as usize >= r * cols {
            out.flags |= flags::BAD_DEST;
            continue;
        }
        let (peer, local) = (col as usize / cols, col as usize % cols);
        let position = routed[peer];
        routed[peer] += 1;
        if position < cap {
            let row = peer * cap + position;
            out.slot_of_route[i] = row as i32;
            out.send_ids[row] = local as i32;
            out.send_probs[row] = probs[i];
        }
    }
    for p in 0..r {
        out.send_counts[p] = routed[p].min(cap) as i32;
        out.dropped[p] = routed[p].saturating_sub(cap) as i32;
        if routed[p] > cap {
            out.flags |= flags::OVERFLOW;
        }
    }
    out
}

/// The kept block row of route `i`, if any.
fn slot(c: &EpConfig, slot_of_route: &[i32], i: usize) -> Option<usize> {
    usize::try_from(slot_of_route[i]).ok().filter(|&s| s < c.block_rows())
}

/// `rows[slot_of_route[t, j]] = x[t]` for every kept route of `t < tokens`; other rows keep
/// their contents.
pub fn gather_rows<T: Copy>(c: &EpConfig, x: &[T], slot_of_route: &[i32], tokens: usize, rows: &mut [T]) {
    let h = c.hidden;
    for t in 0..tokens {
        for j in 0..c.topk {
            if let Some(s) = slot(c, slot_of_route, t * c.topk + j) {
                rows[s * h..(s + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
            }
        }
    }
}

/// `y[t] = sum_j rows[slot_of_route[t, j]]` over kept routes, fp32 from 0 in ascending j,
/// rounded once, for `t < tokens`; rows `t >= tokens` of y keep their contents.
pub fn reduce_rows<T: Scalar>(c: &EpConfig, rows: &[T], slot_of_route: &[i32], tokens: usize, y: &mut [T]) {
    let h = c.hidden;
    for t in 0..tokens {
        let mut acc = vec![0.0f32; h];
        for j in 0..c.topk {
            if let Some(s) = slot(c, slot_of_route, t * c.topk + j) {
                acc.iter_mut().zip(&rows[s * h..(s + 1) * h]).for_each(|(a, v)| *a += v.to_f32());
            }
        }
        y[t * h..(t + 1) * h].iter_mut().zip(&acc).for_each(|(o, a)| *o = T::from_f32(*a));
    }
}

/// `out[t, j] = values[slot_of_route[t, j]]` for kept routes, 0 otherwise, `t < tokens`.
pub fn gather_route_values(c: &EpConfig, values: &[f32], slot_of_route: &[i32], tokens: usize, out: &mut [f32]) {
    for i in 0..tokens * c.topk {
        out[i] = slot(c, slot_of_route, i).map_or(0.0, |s| values[s]);
    }
}

/// A slot's home expert: `Ok(None)` for -1, `Err(())` outside `[-1, E)`.
fn slot_home(c: &EpConfig, e: i64) -> Result<Option<usize>, ()> {
    match e {
        -1 => Ok(None),
        e if e >= 0 && (e as usize) < c.num_experts => Ok(Some(e as usize)),
        _ => Err(()),
    }
}

/// `send[q, s] = home[e - rank * L]` for the global slots whose expert is a home expert of
/// this rank (`per_expert` elements each); returns [`flags::BAD_SLOT_EXPERT`] if any global
/// slot names an expert outside `[-1, E)`.
pub fn pack_spare_weights<T: Copy>(
    c: &EpConfig,
    slot_expert: &[i64],
    home: &[T],
    per_expert: usize,
    send: &mut [T],
) -> i32 {
    let (l, n) = (c.local_experts(), per_expert);
    let mut bits = 0;
    for j in 0..c.global_slots() {
        match slot_home(c, slot_expert[j]) {
            Ok(Some(e)) if e / l == c.rank => {
                let local = e - c.rank * l;
                send[j * n..(j + 1) * n].copy_from_slice(&home[local * n..(local + 1) * n]);
            }
            Ok(_) => {}
            Err(()) => bits |= flags::BAD_SLOT_EXPERT,
        }
    }
    bits
}

/// `spare[s] = recv[e / L, s]` for this rank's slots s with an expert; returns
/// [`flags::BAD_SLOT_EXPERT`] if one of this rank's slots names an expert outside `[-1, E)`.
pub fn select_spare_weights<T: Copy>(
    c: &EpConfig,
    slot_expert: &[i64],
    recv: &[T],
    per_expert: usize,
    spare: &mut [T],
) -> i32 {
    let (l, s_per, n) = (c.local_experts(), c.spare_per_rank, per_expert);
    let mut bits = 0;
    for s in 0..s_per {
        match slot_home(c, slot_expert[c.rank * s_per + s]) {
            Ok(Some(e)) => {
                let from = (e / l) * s_per + s;
                spare[s * n..(s + 1) * n].copy_from_slice(&recv[from * n..(from + 1) * n]);
            }
            Ok(None) => {}
            Err(()) => bits |= flags::BAD_SLOT_EXPERT,
        }
    }
    bits
}

/// `dw_home[e - rank * L] += recv[j]` for every global slot j (ascending) whose expert e is a
/// home expert of this rank, in fp32; returns [`flags::BAD_SLOT_EXPERT`] if any global slot
/// names an expert outside `[-1, E)`.
pub fn fold_spare_grads(
    c: &EpConfig,
    slot_expert: &[i64],
    recv: &[f32],
    per_expert: usize,
    dw_home: &mut [f32],
) -> i32 {
    let (l, n) = (c.local_experts(), per_expert);
    let mut bits = 0;
    for j in 0..c.global_slots() {
        match slot_home(c, slot_expert[j]) {
            Ok(Some(e)) if e / l == c.rank => {
                let local = e - c.rank * l;
                dw_home[local * n..(local + 1) * n]
                    .iter_mut()
                    .zip(&recv[j * n..(j + 1) * n])
                    .for_each(|(d, g)| *d += g);
            }
            Ok(_) => {}
            Err(()) => bits |= flags::BAD_SLOT_EXPERT,
        }
    }
    bits
}
