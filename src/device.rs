//! Device discovery: is there a usable GPU, which architecture it is, how many SMs it has.
//! Nothing here runs at crate load; callers ask when they need it.

use std::sync::Arc;

use cudarc::driver::{sys::CUdevice_attribute, CudaContext, CudaStream, DeviceSlice};

use crate::{Error, Result};

/// The GPU architectures this crate builds kernels for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper (compute capability 9.0, built as sm_90a).
    Sm90,
    /// Blackwell datacenter (compute capability 10.0, built as sm_100a).
    Sm100,
}

impl Arch {
    /// The arch of a compute capability, or `UnsupportedArch`.
    pub fn from_compute_capability(major: i32, minor: i32) -> Result<Arch> {
        match (major, minor) {
            (9, 0) => Ok(Arch::Sm90),
            (10, 0) => Ok(Arch::Sm100),
            _ => {
                Err(Error::UnsupportedArch { need: "9.0 (sm_90a) or 10.0 (sm_100a)", got: format!("{major}.{minor}") })
            }
        }
    }

    /// Whether kernels for this arch were compiled into this binary (CAPMOE_CUDA_ARCHS).
    pub fn is_built(self) -> bool {
        match self {
            Arch::Sm90 => cfg!(has_sm90),
            Arch::Sm100 => cfg!(has_sm100),
        }
    }

    pub(crate) fn abi_code(self) -> i32 {
        match self {
            Arch::Sm90 => 90,
            Arch::Sm100 => 100,
        }
    }
}

/// Static facts of one device, read once when a plan is made.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: Arch,
    pub sm_count: i32,
}

impl DeviceInfo {
    /// Reads the facts of the device that owns `stream`, checking its arch was built.
    pub fn of_stream(stream: &CudaStream) -> Result<DeviceInfo> {
        let ctx = stream.context();
        let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let arch = Arch::from_compute_capability(major, minor)?;
        if !arch.is_built() {
            return Err(Error::NotBuilt { kernel: "kernels for this GPU's arch" });
        }
        Ok(DeviceInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name()?,
            arch,
            sm_count: ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        })
    }
}

/// Whether the dynamic loader finds libcuda. Asked of the loader itself, not of cudarc:
/// cudarc's own probe exists only in its `dynamic-loading` mode, and the application picks the
/// mode (with `dynamic-linking` the process could not have started without the library).
fn driver_library_present() -> bool {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlclose(handle: *mut c_void) -> c_int;
    }
    const RTLD_LAZY: c_int = 1;
    [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: a NUL-terminated name; the handle is closed right away (the library stays
        // loaded if cudarc or the process already holds it).
        let handle = unsafe { dlopen(name.as_ptr(), RTLD_LAZY) };
        !handle.is_null() && unsafe { dlclose(handle) } == 0
    })
}

/// Opens device `ordinal`, or says in words why there is no usable GPU (no driver library,
/// no device, unsupported arch). Never panics, so binaries can print the reason and exit.
pub fn open(ordinal: usize) -> Result<Arc<CudaContext>> {
    // NOTE: cudarc panics when libcuda cannot be loaded, so probe for it first.
    if !driver_library_present() {
        return Err(Error::NoGpu("the CUDA driver library (libcuda.so) is not installed".into()));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| Error::NoGpu(format!("{e}")))?;
    let major = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let arch = Arch::from_compute_capability(major, minor)?;
    if !arch.is_built() {
        return Err(Error::NoGpu(format!("{arch:?} kernels were not built (CAPMOE_CUDA_ARCHS)")));
    }
    Ok(ctx)
}

/// `Ok` when `got` is `bound`, the stream a plan owning reused buffers was made on (compared by
/// driver handle and context), else [`Error::WrongStream`].
pub fn ensure_bound_stream(op: &'static str, bound: &CudaStream, got: &CudaStream) -> Result<()> {
    if got != bound {
        return Err(Error::WrongStream { op, bound: bound.cu_stream() as u64, got: got.cu_stream() as u64 });
    }
    Ok(())
}

/// `Ok` when `buffer` was allocated in the CUDA context `stream` runs in, else
/// [`Error::WrongContext`] naming `what`.
///
/// Contexts are compared by their driver handle (`CUcontext`), not by `Arc` identity: two
/// `CudaContext::new(0)` calls (or this crate's [`open`] and another engine's, e.g. candle's)
/// retain the same primary context and share its memory, so their buffers are accepted; a
/// buffer of another device or of a separately created context is not. Every safe launcher of
/// the crate checks each buffer it is given this way before anything is launched.
///
/// Inside a capture there is one more rule. cudarc makes a launch wait on a buffer's last write
/// event when the buffer's `CudaContext` object tracks events (it has streams of its own and
/// tracking on), and a wait on an event recorded outside the capture breaks it.
/// [`crate::graph::capture`] turns tracking off on the capturing stream's own object only, so a
/// buffer of another object that tracks events (candle's device, a second [`open`]) is refused
/// with [`Error::TrackedBufferInCapture`] while the stream captures. Outside a capture such
/// buffers are accepted, and cudarc's wait orders them as usual. (A capture begun without
/// [`crate::graph::capture`] must turn tracking off on the stream's own object itself, as the
/// graph module says; that case is not checked here.)
pub fn ensure_same_context<T, B: DeviceSlice<T> + ?Sized>(
    op: &'static str,
    what: &'static str,
    stream: &CudaStream,
    buffer: &B,
) -> Result<()> {
    let (want, got) = (stream.context(), buffer.stream().context());
    if want.cu_ctx() != got.cu_ctx() {
        return Err(Error::WrongContext { op, what, stream_device: want.ordinal(), buffer_device: got.ordinal() });
    }
    // The capture query is a driver call: made only for buffers of another object that cudarc
    // would wait on (the stream's own object has tracking off inside graph::capture).
    if !Arc::ptr_eq(want, got) && got.is_managing_stream_synchronization() && stream_is_capturing(stream)? {
        return Err(Error::TrackedBufferInCapture { op, what });
    }
    Ok(())
}

/// Whether `stream` is capturing (an invalidated capture counts until it is ended; the legacy
/// stream reports capturing while another stream captures in global mode).
fn stream_is_capturing(stream: &CudaStream) -> Result<bool> {
    match crate::graph::ensure_not_capturing(stream, "capture query") {
        Ok(()) => Ok(false),
        Err(Error::Capturing { .. }) => Ok(true),
        Err(e) => Err(e),
    }
}

/// A launcher's check of one buffer it is given: in `stream`'s context
/// ([`ensure_same_context`]) and holding at least `need` elements ([`Error::Shape`] otherwise).
pub(crate) fn ensure_buffer<T>(
    op: &'static str,
    what: &'static str,
    stream: &CudaStream,
    buffer: &impl DeviceSlice<T>,
    need: usize,
) -> Result<()> {
    ensure_same_context(op, what, stream, buffer)?;
    crate::error::ensure_len(op, what, buffer.len(), need, "")
}

/// [`Error::InvalidArgument`] naming the first of `ptrs` that is not 16-byte aligned (0, an
/// absent buffer, passes): what TMA and the 16-byte vector accesses need, checked before a
/// launch so that a misaligned view fails with its own name.
pub(crate) fn ensure_aligned16<const N: usize>(op: &'static str, ptrs: [(&str, u64); N]) -> Result<()> {
    ensure_aligned(op, 16, ptrs)
}

/// [`ensure_aligned16`] for another alignment.
pub(crate) fn ensure_aligned<const N: usize>(op: &'static str, align: u64, ptrs: [(&str, u64); N]) -> Result<()> {
    for (what, ptr) in ptrs {
        if !ptr.is_multiple_of(align) {
            return Err(Error::InvalidArgument { op, why: format!("{what} at {ptr:#x} is not {align}-byte aligned") });
        }
    }
    Ok(())
}
