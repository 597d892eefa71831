//! The crate's one error type, and the mapping from C ABI status codes to it.

use cudarc::driver::DriverError;

use crate::sys;

/// Everything that can go wrong, with what was wrong and what would be right.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: {what}: expected {expected}, got {got}")]
    Shape { op: &'static str, what: &'static str, expected: String, got: String },
    #[error("{op}: {what} = {value} must be a multiple of {multiple} (16-byte TMA alignment)")]
    Alignment { op: &'static str, what: &'static str, value: i64, multiple: i64 },
    #[error("{op}: invalid argument: {why}")]
    InvalidArgument { op: &'static str, why: String },
    #[error("{op}: workspace of {got} bytes is too small, need {need}")]
    WorkspaceTooSmall { op: &'static str, need: usize, got: usize },
    #[error("device has compute capability {got}, this kernel needs {need}")]
    UnsupportedArch { need: &'static str, got: String },
    #[error("{kernel} was not built into this binary (set CAPMOE_CUDA_ARCHS to include its arch and rebuild)")]
    NotBuilt { kernel: &'static str },
    #[error("{op}: no kernel for this combination: {why}")]
    Unsupported { op: &'static str, why: String },
    /// A buffer was allocated in another CUDA context than the launch stream's (contexts are
    /// compared by driver handle: see [`crate::device::ensure_same_context`]).
    #[error("{op}: {what} belongs to another CUDA context (device {buffer_device}) than the launch stream's (device {stream_device}); allocate it in the stream's context")]
    WrongContext { op: &'static str, what: &'static str, stream_device: usize, buffer_device: usize },
    /// A buffer whose `CudaContext` object tracks events was given to a launch on a capturing
    /// stream: cudarc would make the stream wait on the buffer's last write event, recorded
    /// outside the capture, which breaks the capture ([`crate::device::ensure_same_context`]).
    #[error("{op}: {what} comes from a CudaContext object with event tracking on, and the launch stream is capturing a graph: cudarc would wait on an event recorded outside the capture. Inside a capture pass buffers of the capturing stream's own CudaContext object (graph::capture turns its tracking off), or turn tracking off on the buffer's object")]
    TrackedBufferInCapture { op: &'static str, what: &'static str },
    /// A plan bound to one stream (its buffers are reused by every launch) was given another.
    #[error("{op}: the plan was made for stream {bound:#x} and owns buffers used on it; got stream {got:#x} (make one plan per stream)")]
    WrongStream { op: &'static str, bound: u64, got: u64 },
    /// A call that needs the host (plan creation, allocation, a read-back, a sync) was made
    /// while its stream was capturing a CUDA graph ([`crate::graph::ensure_not_capturing`]).
    #[error("{op} needs the host (allocation, plan creation, a read-back or a sync) and cannot run while its stream is capturing a CUDA graph: call it before begin_capture or after end_capture")]
    Capturing { op: &'static str },
    /// A range of a [`crate::graph::MemoryPool`] has no room for a buffer.
    #[error("{op}: {need} more bytes do not fit in a pool range of {reserve} bytes ({used} used); make the pool with a larger range_bytes")]
    PoolExhausted { op: &'static str, need: usize, used: usize, reserve: usize },
    /// The driver refused to update an executable graph ([`crate::graph::GraphTemplate::apply_to`]).
    #[error("graph update refused: {why}")]
    GraphUpdate { why: String },
    /// The NCCL transport of an EP group ([`crate::ep`]): libnccl missing, an NCCL status
    /// (named, with NCCL's own message), or the group's setup (id file, timeout).
    #[error("{op}: NCCL: {why}")]
    Nccl { op: &'static str, why: String },
    #[error("{op}: CUTLASS rejected the problem (can_implement / initialize / run)")]
    Cutlass { op: &'static str },
    #[error("{op}: CUDA runtime error {code} ({name})")]
    Cuda { op: &'static str, code: i32, name: &'static str },
    #[error("{op}: internal error (a C++ exception was caught at the C ABI boundary)")]
    Internal { op: &'static str },
    #[error("no usable GPU: {0}")]
    NoGpu(String),
    #[error(transparent)]
    Driver(#[from] DriverError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Error::Shape` when a buffer of `len` elements is shorter than the `need` an op reads or
/// writes; `unit` (may be empty) says what `need` counts, e.g. `" (T_max * k)"`.
pub(crate) fn ensure_len(op: &'static str, what: &'static str, len: usize, need: usize, unit: &str) -> Result<()> {
    if len < need {
        return Err(Error::Shape { op, what, expected: format!(">= {need} elements{unit}"), got: len.to_string() });
    }
    Ok(())
}

/// Turns a status returned by the C ABI into a `Result`, naming the operation.
pub(crate) fn check(status: sys::capmoe_status_t, op: &'static str) -> Result<()> {
    let status = status as u32;
    match status {
        sys::CAPMOE_OK => Ok(()),
        sys::CAPMOE_ERR_CUDA => {
            let code = unsafe { sys::capmoe_last_cuda_error() };
            Err(Error::Cuda { op, code, name: cuda_error_name(code) })
        }
        sys::CAPMOE_ERR_CUTLASS => Err(Error::Cutlass { op }),
        sys::CAPMOE_ERR_INTERNAL => Err(Error::Internal { op }),
        sys::CAPMOE_ERR_INVALID_ARGUMENT => Err(Error::InvalidArgument {
            op,
            why: "rejected by the C ABI's checks (for the fused kernels, possibly by the driver's TMA \
                      descriptor encoding)"
                .into(),
        }),
        sys::CAPMOE_ERR_MISALIGNED => Err(Error::InvalidArgument {
            op,
            why: "a pointer is not aligned as the C ABI requires (16 bytes for activations, GEMM \
                  operands and the Echo plan state, 256 for the grouped GEMM workspace, natural alignment \
                  for index and prob arrays) \
                  or a leading dimension is not a multiple of 8 elements"
                .into(),
        }),
        sys::CAPMOE_ERR_UNSUPPORTED => Err(Error::Unsupported {
            op,
            why: "this binary has none for the device's arch, or the call is outside the limits its C header states"
                .into(),
        }),
        // The sizes are not known here: the Rust plans check them before the call, with both.
        sys::CAPMOE_ERR_WORKSPACE_TOO_SMALL => Err(Error::InvalidArgument {
            op,
            why: "the workspace is smaller than the plan's workspace size (capmoe_*_workspace_size)".into(),
        }),
        other => Err(Error::InvalidArgument { op, why: format!("unknown status {other}") }),
    }
}

/// The names of the CUDA runtime errors a launch path can realistically hit.
fn cuda_error_name(code: i32) -> &'static str {
    match code {
        1 => "cudaErrorInvalidValue",
        2 => "cudaErrorMemoryAllocation",
        98 => "cudaErrorInvalidDeviceFunction",
        200 => "cudaErrorInvalidKernelImage",
        209 => "cudaErrorNoKernelImageForDevice",
        400 => "cudaErrorInvalidResourceHandle",
        700 => "cudaErrorIllegalAddress",
        701 => "cudaErrorLaunchOutOfResources",
        719 => "cudaErrorLaunchFailure",
        900 => "cudaErrorStreamCaptureUnsupported",
        901 => "cudaErrorStreamCaptureInvalidated",
        _ => "see cuda_runtime_api.h",
    }
}
