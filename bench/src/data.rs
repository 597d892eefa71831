//! Benchmark input data, shared with the criterion bench (`benches/grouped_gemm.rs` includes
//! this file by path: a bench cannot depend on a binary crate).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A device buffer of random non-zero bf16, filled by tiling one random host block.
pub fn random_bf16(stream: &Arc<CudaStream>, len: usize, seed: u64) -> CudaSlice<bf16> {
    const BLOCK: usize = 1 << 22;
    let mut rng = StdRng::seed_from_u64(seed);
    let block: Vec<bf16> = (0..BLOCK.min(len))
        .map(|_| {
            let x: f32 = rng.random_range(0.05..1.0);
            bf16::from_f32(if rng.random_bool(0.5) { x } else { -x })
        })
        .collect();
    let mut buf = unsafe { stream.alloc::<bf16>(len) }.expect("alloc");
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        let mut view = buf.slice_mut(at..at + n);
        stream.memcpy_htod(&block[..n], &mut view).expect("upload");
        at += n;
    }
    buf
}
