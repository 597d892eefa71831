//! Expert parallel (EP) over an EP group of R ranks: the device side of dispatch / combine and
//! of Echo's spare-slot weight exchange (C side: `csrc/ep/`, contract in
//! `csrc/include/capturable_moe/ep.h`). The step, the buffers, dropping and the tests are
//! described in `docs/ep.md`.
//!
//! Invariants of every launch: every size is fixed at plan time ([`EpConfig`]); a peer block
//! keeps its first `capacity` routes in ascending `(t, j)` order; nothing depends on thread
//! scheduling and no floating-point atomics are used (bitwise deterministic); no launch
//! allocates, synchronises or reads device data on the host.

mod kernels;
pub mod reference;
pub mod simulate;

pub use kernels::*;
