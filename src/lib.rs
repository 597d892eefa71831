//! capturable-moe: the Mixture-of-Experts expert path with every routing count kept on the GPU,
//! so forward and backward can be captured once in a CUDA graph and replayed with new routing.
//!
//! Layers, as in cudarc: [`sys`] (bindgen output of the C ABI) -> [`Error`] mapping -> the safe
//! capability modules. Every launcher allocates nothing, never synchronises with the host and
//! never reads device data on the host.
//!
//! Conventions shared by [`grouped_gemm`], [`routing`], [`echo`], [`ep`] and [`moe`]:
//! - Safe launchers take the launch stream (`&CudaStream`) first and cudarc buffers
//!   (`CudaSlice` or views) after it; each buffer must belong to the stream's CUDA context,
//!   compared by driver handle ([`device::ensure_same_context`]), else
//!   [`Error::WrongContext`] before anything is launched. (`ep::EpMoe`'s stages take no
//!   stream: they run on their group's stream.)
//! - Raw-pointer entry points (`*_raw`, `unsafe`) take `&CudaStream` first, then device
//!   pointers as `CUdeviceptr` (u64, what cudarc's `DevicePtr::device_ptr` returns) in the
//!   order of the safe form, 0 for an absent optional buffer, sizes and token counts as
//!   `usize`; a device token count is a `CUdeviceptr` to one `i32` (0 = use the host count).
//!   Each has a `# Safety` section with what the caller guarantees.
//! - Every plan has `desc()`: what it was built for.
//! - A plan that owns buffers reused across launches ([`moe::MoeExperts`]) is bound to the
//!   stream it was made on ([`Error::WrongStream`] for another).

pub mod device;
pub mod dtype;
pub mod echo;
pub mod ep;
mod error;
pub mod fused;
pub mod graph;
pub mod grouped_gemm;
pub mod moe;
pub mod routing;
pub mod sys;

pub use error::{Error, Result};

// The README's Rust examples, compiled (not run: they need a GPU) as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_examples {}
