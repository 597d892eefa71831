//! Shared helpers of the tests.
#![allow(dead_code)]

pub mod emulation;
pub mod gemm;
pub mod moe;
pub mod routing;

use std::sync::Arc;

use cudarc::driver::CudaStream;

/// A fresh stream on GPU 0, or `None` after printing `skipping: <reason>` where there is no
/// usable GPU. With `CAPMOE_REQUIRE_GPU=1` a missing GPU fails the test instead, so a skip is
/// never mistaken for a pass on the GPU machine.
pub fn gpu_stream() -> Option<Arc<CudaStream>> {
    match capturable_moe::device::open(0) {
        Ok(ctx) => Some(ctx.new_stream().expect("creating a CUDA stream")),
        Err(reason) => {
            if std::env::var("CAPMOE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("CAPMOE_REQUIRE_GPU=1 but no usable GPU: {reason}");
            }
            println!("skipping: {reason}");
            None
        }
    }
}

/// Takes the GPU stream or returns from the calling test after printing why.
#[macro_export]
macro_rules! gpu_or_skip {
    () => {
        match common::gpu_stream() {
            Some(stream) => stream,
            None => return,
        }
    };
}

/// Graph-capture tests serialise on this lock: capture in global mode forbids unrelated
/// CUDA work from other threads of the process while it is open.
pub static CAPTURE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
