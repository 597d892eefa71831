//! CUDA graphs of the expert path: capture, a memory pool shared by graphs of different
//! shapes ([`MemoryPool`]), re-pointing a graph at other buffers without re-instantiating it
//! ([`update`](fn@update), [`GraphTemplate`]), the guard every host-side call of the crate runs first
//! ([`ensure_not_capturing`]) and the device flag words read back into one report
//! ([`FlagReport`]). One graph for every layer: [`LayerTables`] switches a pointer-form plan's
//! weight tables with one copy, no graph update.
//!
//! One graph for every token count: the launchers read T on the device
//! ([`crate::routing::Tokens::Device`]), so a graph captured at T_max serves any T up to it;
//! per-bucket graphs in a [`MemoryPool`] are the alternative when the small buckets must be
//! faster than the T_max graph runs them.
//!
//! ## Event tracking during capture
//!
//! cudarc records an event on each buffer use when a context has several streams ("event
//! tracking"), so that a buffer written on one stream is waited for on another. Those event
//! records and waits cannot be captured, so [`capture`] switches tracking off while it
//! captures. The switch is one flag of the whole context object (cudarc's
//! `CudaContext::disable_event_tracking`; each `CudaContext::new` call makes its own object,
//! with its own flag, for the same driver context), not of a thread or a stream, so the
//! contract is:
//!
//! - While any [`capture`] on a context object is running, its event tracking is off,
//!   for every thread and stream. Concurrent or nested captures on one context are counted:
//!   tracking is turned off by the first and restored by the last to finish (also when a body
//!   fails or panics), to the state it had before the first began.
//! - Meanwhile cudarc orders nothing across streams of that context: the caller must not use a
//!   buffer of the context on another stream (another thread included) unless it orders that
//!   use itself (events, or a synchronise), and must not free a buffer another stream may
//!   still be using.
//! - Buffers allocated while tracking is off never get tracking events, also after it is
//!   restored: allocate the buffers a graph uses before capturing it (the plans of this crate
//!   allocate everything when they are made).

mod flags;
mod layers;
mod pool;
mod update;
mod variants;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{cudaError_enum, CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream, DriverError};

pub use flags::{Flag, FlagReport, FlagSource, FlagWords};
pub use layers::{ActiveTables, LayerTables, LayerWeights};
pub use pool::{
    round_up, BumpCursor, DeviceBuffer, MemoryPool, PhysicalLayout, PoolRange, PoolSlice, PoolStats, Scratch,
    POOL_ALIGNMENT,
};
pub use update::{update, update_failure, GraphTemplate};
pub use variants::GraphVariants;

use crate::{Error, Result};

/// `Ok` when `stream` is not capturing a graph, else [`Error::Capturing`] naming `op`.
///
/// Every public call of the crate that needs the host (plan creation, allocation, reading
/// device words back, a synchronisation) runs this first: inside a capture such a call would
/// either fail with an obscure CUDA status and invalidate the capture, or be recorded as
/// nothing and silently not happen on replay. A stream whose capture was invalidated counts as
/// capturing until the capture is ended. The legacy default stream reports capturing while
/// another stream captures in global mode (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`).
///
/// NOTE: a capture in global mode on one thread also forbids such calls on other streams and
/// threads; this check sees only the given stream.
pub fn ensure_not_capturing(stream: &CudaStream, op: &'static str) -> Result<()> {
    capture_state_to_result(stream.capture_status(), op)
}

/// The decision of [`ensure_not_capturing`] from what `cuStreamIsCapturing` returned.
pub(crate) fn capture_state_to_result(
    status: std::result::Result<CUstreamCaptureStatus, DriverError>,
    op: &'static str,
) -> Result<()> {
    match status {
        Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => Ok(()),
        Ok(_) => Err(Error::Capturing { op }),
        Err(DriverError(cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)) => Err(Error::Capturing { op }),
        Err(e) => Err(e.into()),
    }
}

/// Which threads a capture constrains (CUDA's stream capture mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureMode {
    /// While the capture is open, a potentially unsafe call (a host sync, an allocation, a
    /// legacy-stream use) from *any* thread fails and invalidates it. The safe choice when
    /// one thread drives the device.
    #[default]
    Global,
    /// Only the capturing thread is constrained. Use it when other threads keep running CUDA
    /// work while one captures, such as one thread per GPU of an expert-parallel group: NCCL
    /// requires this mode for a process with a thread per GPU.
    ThreadLocal,
}

impl CaptureMode {
    fn to_cuda(self) -> CUstreamCaptureMode {
        match self {
            CaptureMode::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        }
    }
}

/// How [`capture_with`] captures and finishes a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Upload the instantiated graph to the device on its stream (`cuGraphUpload`), so that
    /// the first launch costs what the later ones do instead of paying the upload itself.
    pub upload: bool,
    /// The capture mode (default [`CaptureMode::Global`]).
    pub mode: CaptureMode,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions { upload: true, mode: CaptureMode::Global }
    }
}

/// Captures everything `body` enqueues on `stream` (global capture mode: any forbidden call
/// from any thread, such as a host sync or an allocation, fails the capture), instantiates it
/// and uploads it ([`CaptureOptions::default`]). The capture is always ended, also when `body`
/// fails or panics (the panic is re-raised after the capture is ended). Event tracking of the
/// stream's context is off while it runs: see the module docs for what that asks of the
/// caller. [`Error::Capturing`] if `stream` is capturing already.
pub fn capture(stream: &Arc<CudaStream>, body: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    capture_with(stream, CaptureOptions::default(), body)
}

/// [`capture`] with explicit [`CaptureOptions`].
pub fn capture_with(
    stream: &Arc<CudaStream>,
    options: CaptureOptions,
    body: impl FnOnce() -> Result<()>,
) -> Result<CudaGraph> {
    ensure_not_capturing(stream, "graph::capture")?;
    let _tracking_off = TrackingOff::new(stream.context().clone());
    stream.begin_capture(options.mode.to_cuda())?;
    let body_result = run_capture_body(body);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    body_result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
    let graph = graph?.ok_or(Error::InvalidArgument { op: "graph capture", why: "nothing was captured".into() })?;
    if options.upload {
        graph.upload()?;
    }
    Ok(graph)
}

/// Runs a capture's `body`, catching a panic so that the caller can end the capture before
/// re-raising it ([`std::panic::resume_unwind`]): a capture left open would make every later
/// CUDA call on the stream (and, in global mode, in the process) fail, turning one failure into
/// many.
pub(crate) fn run_capture_body(body: impl FnOnce() -> Result<()>) -> std::thread::Result<Result<()>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
}

/// A context whose event tracking can be switched (cudarc's `CudaContext`; a stand-in in tests).
pub(crate) trait TrackingSwitch {
    /// The identity of what holds the flag.
    fn key(&self) -> usize;
    fn is_tracking(&self) -> bool;
    /// # Safety
    /// As cudarc's `enable_event_tracking` / `disable_event_tracking`.
    unsafe fn set_tracking(&self, on: bool);
}

impl TrackingSwitch for CudaContext {
    // NOTE: the flag lives in cudarc's `CudaContext` object (one per `CudaContext::new` call,
    // even for the same driver context), so the object, not the driver handle, is the key.
    fn key(&self) -> usize {
        self as *const CudaContext as usize
    }
    fn is_tracking(&self) -> bool {
        self.is_event_tracking()
    }
    unsafe fn set_tracking(&self, on: bool) {
        if on {
            self.enable_event_tracking()
        } else {
            self.disable_event_tracking()
        }
    }
}

/// Per context: captures running, and the tracking state before the first of them began.
static RUNNING: Mutex<Option<HashMap<usize, (usize, bool)>>> = Mutex::new(None);

/// Event tracking off for as long as any guard of the context lives (module docs).
pub(crate) struct TrackingOff<C: TrackingSwitch> {
    ctx: C,
}

impl<C: TrackingSwitch> TrackingOff<C> {
    pub(crate) fn new(ctx: C) -> Self {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        let entry = running.get_or_insert_with(HashMap::new).entry(ctx.key()).or_insert((0, ctx.is_tracking()));
        entry.0 += 1;
        // SAFETY: the module's contract (documented on `capture`) makes the caller responsible
        // for cross-stream ordering while a capture runs.
        unsafe { ctx.set_tracking(false) };
        TrackingOff { ctx }
    }
}

impl<C: TrackingSwitch> Drop for TrackingOff<C> {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        let map = running.get_or_insert_with(HashMap::new);
        let key = self.ctx.key();
        let Some(entry) = map.get_mut(&key) else { return };
        entry.0 -= 1;
        if entry.0 == 0 {
            let before = entry.1;
            map.remove(&key);
            // SAFETY: the last capture of this context has ended; restoring the state the
            // first one found is what the caller had before.
            unsafe { self.ctx.set_tracking(before) };
        }
    }
}

impl<C: TrackingSwitch> TrackingSwitch for Arc<C> {
    fn key(&self) -> usize {
        (**self).key()
    }
    fn is_tracking(&self) -> bool {
        (**self).is_tracking()
    }
    unsafe fn set_tracking(&self, on: bool) {
        (**self).set_tracking(on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUstreamCaptureStatus as S;

    /// A body's result comes back as it is; a panic is caught (for the caller to end the
    /// capture) and handed back to be re-raised, its message intact.
    #[test]
    fn capture_body_results_and_panics_come_back_to_the_caller() {
        assert!(matches!(run_capture_body(|| Ok(())), Ok(Ok(()))));
        let failed = run_capture_body(|| Err(Error::Capturing { op: "inner" }));
        assert!(matches!(failed, Ok(Err(Error::Capturing { op: "inner" }))));
        let panic = run_capture_body(|| panic!("inside the body")).expect_err("the panic is caught");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"inside the body"));
    }

    /// Active and invalidated captures and the implicit-capture error of the legacy stream are
    /// `Capturing`; no capture is `Ok`; other driver errors pass through as driver errors.
    #[test]
    fn capture_states_map_to_the_capturing_error_host() {
        assert!(capture_state_to_result(Ok(S::CU_STREAM_CAPTURE_STATUS_NONE), "op").is_ok());
        for status in [S::CU_STREAM_CAPTURE_STATUS_ACTIVE, S::CU_STREAM_CAPTURE_STATUS_INVALIDATED] {
            assert!(matches!(capture_state_to_result(Ok(status), "op"), Err(Error::Capturing { op: "op" })));
        }
        let implicit = Err(DriverError(cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT));
        assert!(matches!(capture_state_to_result(implicit, "x"), Err(Error::Capturing { op: "x" })));
        let other = Err(DriverError(cudaError_enum::CUDA_ERROR_INVALID_HANDLE));
        assert!(matches!(capture_state_to_result(other, "x"), Err(Error::Driver(_))));
    }

    /// Global by default (as `capture` always was); each mode is the CUDA mode of its name.
    #[test]
    fn capture_modes_map_to_cuda_modes_host() {
        assert_eq!(CaptureOptions::default().mode, CaptureMode::Global);
        assert_eq!(CaptureMode::Global.to_cuda(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
        assert_eq!(CaptureMode::ThreadLocal.to_cuda(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    }
}

#[cfg(test)]
mod tracking_tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A context stand-in: a key and a tracking flag.
    struct FakeContext {
        key: usize,
        tracking: AtomicBool,
    }

    impl TrackingSwitch for FakeContext {
        fn key(&self) -> usize {
            self.key
        }
        fn is_tracking(&self) -> bool {
            self.tracking.load(Ordering::SeqCst)
        }
        unsafe fn set_tracking(&self, on: bool) {
            self.tracking.store(on, Ordering::SeqCst)
        }
    }

    fn fake(key: usize, tracking: bool) -> Arc<FakeContext> {
        Arc::new(FakeContext { key, tracking: AtomicBool::new(tracking) })
    }

    /// Two overlapping captures on one context (as from two threads): tracking stays off until
    /// the second ends, then returns to what it was before the first (a guard that restored
    /// its own "before" would turn tracking back on in the middle of the second capture).
    #[test]
    fn overlapping_captures_keep_tracking_off_until_the_last_ends_host() {
        let ctx = fake(0x1001, true);
        let first = TrackingOff::new(ctx.clone());
        assert!(!ctx.is_tracking());
        let second = TrackingOff::new(ctx.clone());
        drop(first);
        assert!(!ctx.is_tracking(), "tracking came back on while a capture was still running");
        drop(second);
        assert!(ctx.is_tracking(), "tracking not restored after the last capture");
    }

    /// A context whose tracking was already off stays off; contexts are counted separately.
    #[test]
    fn tracking_is_restored_per_context_to_its_prior_state_host() {
        let (off, on) = (fake(0x2001, false), fake(0x2002, true));
        let a = TrackingOff::new(off.clone());
        let b = TrackingOff::new(on.clone());
        drop(b);
        assert!(on.is_tracking());
        assert!(!off.is_tracking());
        drop(a);
        assert!(!off.is_tracking(), "a context that had tracking off must keep it off");
    }

    /// A body that panics still restores tracking (the guard's Drop runs while unwinding).
    #[test]
    fn a_panicking_capture_body_restores_tracking_host() {
        let ctx = fake(0x3001, true);
        let c = ctx.clone();
        let result = std::panic::catch_unwind(move || {
            let _guard = TrackingOff::new(c);
            panic!("body failed");
        });
        assert!(result.is_err());
        assert!(ctx.is_tracking());
    }
}
