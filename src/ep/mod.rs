//! Expert parallel (EP) over an EP group of R ranks, one GPU each: `EpGroup` moves
//! fixed-size blocks between the ranks over NCCL, [`EpKernels`] fill and read those blocks on
//! the device (C side: `csrc/ep/`, contract in `csrc/include/capturable_moe/ep.h`), and
//! `EpMoe` runs one MoE layer's whole step with them (`EpGroup` and `EpMoe` need the feature
//! `nccl`). The step, the buffers, dropping and the tests are described in `docs/ep.md`.
//!
//! Invariants of every launch: every size is fixed at plan time ([`EpConfig`]); a peer block
//! keeps its first `capacity` routes in ascending `(t, j)` order; nothing depends on thread
//! scheduling and no floating-point atomics are used (bitwise deterministic); no launch
//! allocates, synchronises or reads device data on the host.

#[cfg(feature = "nccl")]
mod group;
mod kernels;
#[cfg(feature = "nccl")]
mod layer;
pub mod reference;
pub mod simulate;

#[cfg(feature = "nccl")]
pub use group::*;
pub use kernels::*;
#[cfg(feature = "nccl")]
pub use layer::{EpEcho, EpMoe, EpMoeConfig, EpMoeDesc};
