//! Expert parallel over NCCL (docs/ep.md).
pub mod simulate;
