//! Routing test data shared by the GPU, reference and emulation tests.

use capturable_moe::routing::reference::Scalar;
use rand::rngs::StdRng;
use rand::Rng;

/// A small integer in [-8, 8]: exact in bf16 / fp16, so sums of a few are exact too.
pub fn small_int<T: Scalar>(rng: &mut StdRng) -> T {
    T::from_f32(rng.random_range(-8i32..=8) as f32)
}

/// A dyadic probability (exact in every prob dtype).
pub fn dyadic<P: Scalar>(rng: &mut StdRng) -> P {
    const V: [f32; 8] = [0.25, 0.5, 0.75, 1.0, 1.5, -0.5, 2.0, 0.125];
    P::from_f32(V[rng.random_range(0..V.len())])
}

/// Random top-k routing with k distinct experts per token (k <= E), else arbitrary ids.
pub fn topk_ids(rng: &mut StdRng, t: usize, e: usize, k: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < k {
            let x = rng.random_range(0..e as i32);
            if k > e || !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        ids.extend(chosen);
    }
    ids
}
