//! Benchmark input data, shared with the criterion bench (`benches/grouped_gemm.rs` includes
//! this file by path: a bench cannot depend on a binary crate).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A device buffer of random non-zero bf16, filled by tiling one random host block.
pub fn random_bf16(stream: &Arc<CudaStream>, len: usize, seed: u64) -> CudaSlice<bf16> {
    try_random_bf16(stream, len, seed).expect("random bf16 upload")
}

/// [`random_bf16`], returning the driver's error (out of memory, say) instead of panicking.
pub fn try_random_bf16(stream: &Arc<CudaStream>, len: usize, seed: u64) -> Result<CudaSlice<bf16>, DriverError> {
    const BLOCK: usize = 1 << 22;
    let mut rng = StdRng::seed_from_u64(seed);
    let block: Vec<bf16> = (0..BLOCK.min(len))
        .map(|_| {
            let x: f32 = rng.random_range(0.05..1.0);
            bf16::from_f32(if rng.random_bool(0.5) { x } else { -x })
        })
        .collect();
    let mut buf = unsafe { stream.alloc::<bf16>(len) }?;
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        let mut view = buf.slice_mut(at..at + n);
        stream.memcpy_htod(&block[..n], &mut view)?;
        at += n;
    }
    Ok(buf)
}
