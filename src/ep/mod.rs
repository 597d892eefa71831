//! Expert parallel (EP): an EP group of R ranks, one GPU each, that moves fixed-size blocks
//! between the ranks over NCCL ([`EpGroup`], feature `nccl`), and the device kernels that fill
//! and read those blocks (`csrc/include/capturable_moe/ep.h`). The design: `docs/ep.md`.

#[cfg(feature = "nccl")]
mod group;
#[cfg(feature = "nccl")]
pub use group::*;
