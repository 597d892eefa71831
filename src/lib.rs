//! capturable-moe: the Mixture-of-Experts expert path with every routing count kept on the GPU,
//! so forward and backward can be captured once in a CUDA graph and replayed with new routing.
//!
//! Layers, as in cudarc: [`sys`] (bindgen output of the C ABI) -> [`Error`] mapping -> the safe
//! capability modules. Every launcher allocates nothing, never synchronises with the host and
//! never reads device data on the host.

pub mod baseline;
pub mod device;
pub mod dtype;
pub mod echo;
mod error;
pub mod fused;
pub mod graph;
pub mod grouped_gemm;
pub mod moe;
pub mod routing;
pub mod sys;

pub use error::{Error, Result};
