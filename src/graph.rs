//! Capturing launches into a CUDA graph.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::{Error, Result};

/// Captures everything `body` enqueues on `stream` (global capture mode: any forbidden call
/// from any thread, such as a host sync or an allocation, fails the capture) and instantiates
/// it. cudarc's per-buffer event tracking cannot be captured, so it is switched off for the
/// context during the capture and restored afterwards; the caller must not use the context's
/// buffers from other streams meanwhile. The capture is always ended, also when `body` fails.
pub fn capture(stream: &Arc<CudaStream>, body: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let ctx = stream.context().clone();
    let tracking = ctx.is_event_tracking();
    // SAFETY: tracking is only off while this function runs on this thread.
    unsafe { ctx.disable_event_tracking() };
    let result = (|| {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
        let body_result = body();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        body_result?;
        graph?.ok_or(Error::InvalidArgument { op: "graph capture", why: "nothing was captured".into() })
    })();
    if tracking {
        unsafe { ctx.enable_event_tracking() };
    }
    result
}
