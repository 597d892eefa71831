//! Finding libnccl before cudarc does (cudarc panics when it cannot load it), and turning NCCL
//! statuses into [`Error::Nccl`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::nccl::{result::NcclError, sys};

use crate::{Error, Result};

/// The NCCL version found, as `ncclGetVersion` encodes it (e.g. 22703 for 2.27.3); only set
/// once the library was found, so later calls skip the probe.
static VERSION: OnceLock<i32> = OnceLock::new();

/// The name cudarc 0.19 opens first (its candidates are `libnccl.so`, then names with a CUDA
/// major version suffix that NCCL never ships): the development symlink, which pip's
/// `nvidia-nccl-cu*` wheels do not install.
const CUDARC_NAME: &CStr = c"libnccl.so";
/// The name NCCL's runtime packages and wheels install.
const RUNTIME_NAME: &CStr = c"libnccl.so.2";

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlclose(handle: *mut c_void) -> c_int;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_LAZY: c_int = 1;
/// glibc's RTLD_DEFAULT: the global scope of the process.
const RTLD_DEFAULT: *mut c_void = std::ptr::null_mut();

fn loader_opens(name: &CStr) -> bool {
    // SAFETY: a NUL-terminated name; the handle is closed right away (the library stays loaded
    // while cudarc or the process holds it).
    let handle = unsafe { dlopen(name.as_ptr(), RTLD_LAZY) };
    !handle.is_null() && unsafe { dlclose(handle) } == 0
}

/// NCCL already in the process's global scope: linked in (cudarc's `dynamic-linking`, which a
/// candle application picks) rather than opened at run time.
fn linked_in() -> bool {
    // SAFETY: a lookup by NUL-terminated name in the global scope; nothing is called.
    !unsafe { dlsym(RTLD_DEFAULT, c"ncclGetUniqueId".as_ptr()) }.is_null()
}

/// Why NCCL cannot be used in this process, or `Ok` with its version. Never panics: every
/// constructor runs this before cudarc's first NCCL call, which would.
pub fn nccl_version() -> Result<i32> {
    const OP: &str = "ep: loading libnccl";
    if let Some(&version) = VERSION.get() {
        return Ok(version);
    }
    if !linked_in() && !loader_opens(CUDARC_NAME) {
        let why = if loader_opens(RUNTIME_NAME) {
            "libnccl.so.2 is on the loader path but cudarc 0.19 opens libnccl.so: make a symlink \
             libnccl.so -> libnccl.so.2 in a folder on LD_LIBRARY_PATH (scripts/nccl-env.sh does \
             this for a PyTorch venv's nvidia/nccl/lib)"
        } else {
            "libnccl not found: cudarc opens libnccl.so through the dynamic loader; install NCCL \
             (or a PyTorch venv's nvidia-nccl wheel) and put its lib folder, with a libnccl.so \
             symlink to libnccl.so.2, on LD_LIBRARY_PATH"
        };
        return Err(Error::Nccl { op: OP, why: why.into() });
    }
    let mut version: c_int = 0;
    // SAFETY: the library was found above, so cudarc's lazy loader succeeds; one out int.
    let status = unsafe { sys::ncclGetVersion(&mut version) };
    status.result().map_err(|e| nccl_error(OP, e, None))?;
    Ok(*VERSION.get_or_init(|| version))
}

/// `ncclResult_t` names by value (their Rust enum differs between cudarc's NCCL versions).
fn status_name(code: u32) -> &'static str {
    match code {
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an unknown ncclResult_t",
    }
}

/// [`Error::Nccl`] for a failed NCCL call: the status's name, NCCL's text for it and, where the
/// library has it (2.13+), NCCL's last error message, which says what was wrong.
pub(crate) fn nccl_error(op: &'static str, error: NcclError, comm: Option<sys::ncclComm_t>) -> Error {
    let code = error.0 as u32;
    // SAFETY: only reached after an NCCL call returned, so the library is loaded; both
    // functions return static or library-owned NUL-terminated strings (or null).
    let text = |ptr: *const c_char| {
        if ptr.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
        }
    };
    let generic = text(unsafe { sys::ncclGetErrorString(error.0) });
    let last = match VERSION.get() {
        Some(&v) if v >= 21300 => text(unsafe { sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut())) }),
        _ => String::new(),
    };
    let mut why = format!("{} ({code}): {generic}", status_name(code));
    if !last.is_empty() {
        why.push_str(&format!("; NCCL says: {last}"));
    }
    Error::Nccl { op, why }
}
