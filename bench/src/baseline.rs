//! The cuBLAS baselines the grouped GEMM is compared with, on the same layouts and ops.
//!
//! - [`CublasLoop`] with several streams is what TransformerEngine does: copy `m_splits` to the
//!   host (a GPU->CPU sync, which forbids graph capture), then one cuBLAS GEMM per non-empty
//!   expert, round-robin over N streams forked from and joined back to the caller's stream.
//!   With one stream it is the plain per-expert loop.
//! - [`CublasGroupedBatched`]: `cublasGemmGroupedBatchedEx` (cuBLAS 12.5+), one group of
//!   size 1 per non-empty expert. Its problem sizes are host arrays, so it needs the same
//!   `m_splits` read-back as the loops; the A/B/C pointer arrays are built on the host and
//!   uploaded on every launch.
//! - [`DenseGemm`]: one GEMM over all rows at the same FLOPs, the ceiling for grouped work.
//!
//! Row-major operands are handed to column-major cuBLAS as their transposes.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys as cublas;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use capturable_moe::dtype::DType;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemmSpec, WeightLayout};
use capturable_moe::{Error, Result};

/// Why cuBLAS cannot be used here, if it cannot.
pub fn cublas_unavailable() -> Option<String> {
    if unsafe { cublas::is_culib_present() } {
        None
    } else {
        Some("libcublas.so was not found by the dynamic loader (add the CUDA lib64 folder to LD_LIBRARY_PATH)".into())
    }
}

fn check(status: cublas::cublasStatus_t, what: &'static str) -> Result<()> {
    if status == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::InvalidArgument { op: "cublas baseline", why: format!("{what} returned {status:?}") })
    }
}

fn cuda_type(dtype: DType) -> cublas::cudaDataType {
    match dtype {
        DType::Bf16 => cublas::cudaDataType::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType::CUDA_R_16F,
        _ => cublas::cudaDataType::CUDA_R_32F,
    }
}

/// One cuBLAS handle bound to one stream.
struct Handle {
    raw: cublas::cublasHandle_t,
    stream: Arc<CudaStream>,
}

impl Handle {
    fn new(stream: Arc<CudaStream>) -> Result<Handle> {
        stream.context().bind_to_thread()?;
        let mut raw = std::ptr::null_mut();
        check(unsafe { cublas::cublasCreate_v2(&mut raw) }, "cublasCreate")?;
        check(unsafe { cublas::cublasSetStream_v2(raw, stream.cu_stream() as _) }, "cublasSetStream")?;
        Ok(Handle { raw, stream })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        unsafe { cublas::cublasDestroy_v2(self.raw) };
    }
}

/// Device addresses of one grouped GEMM's operands, in the crate's layout contract.
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    pub a: u64,
    pub b: u64,
    pub d: u64,
}

/// One column-major cuBLAS GEMM: `C[m, n] = op(A)[m, k] * op(B)[k, n]`, device addresses.
#[derive(Clone, Copy, Debug)]
struct GemmArgs {
    ta: cublas::cublasOperation_t,
    tb: cublas::cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    a: u64,
    lda: usize,
    b: u64,
    ldb: usize,
    c: u64,
    ldc: usize,
}

/// One expert's (or the dense problem's) GEMM, in the crate's row-major terms, as cuBLAS sees it.
fn gemm_args(spec: &GroupedGemmSpec, ops: Operands, expert: usize, row0: usize, rows: usize) -> GemmArgs {
    let (n, k) = (spec.n, spec.k);
    let el = spec.dtype.size_bytes() as u64;
    let out_el = spec.out_dtype.size_bytes() as u64;
    let weight = ops.b + (expert * n * k) as u64 * el;
    use cublas::cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
    // Column-major view: a row-major [r, c] matrix is a column-major [c, r] one.
    let transposed = spec.weight_layout == WeightLayout::Ekn;
    let (ta, tb, m, nn, kk, pa, lda, pb, ldb, pc, ldc) = match spec.op {
        // Y^T [N, rows] = W [N, K] (col-major K x N, transposed) * X^T [K, rows]
        GemmOp::Fprop => {
            let (ta, lda) = if transposed { (N, n) } else { (T, k) };
            (ta, N, n, rows, k, weight, lda, ops.a + (row0 * k) as u64 * el, k, ops.d + (row0 * n) as u64 * out_el, n)
        }
        // dX^T [K, rows] = W^T [K, N] * dY^T [N, rows]
        GemmOp::Dgrad => {
            let (ta, lda) = if transposed { (T, n) } else { (N, k) };
            (ta, N, k, rows, n, weight, lda, ops.a + (row0 * n) as u64 * el, n, ops.d + (row0 * k) as u64 * out_el, k)
        }
        // dW^T [K, N] = X^T [K, rows] * dY [rows, N]   ([E,N,K] storage), or
        // dW   [N, K] = dY^T [N, rows] * X [rows, K]   ([E,K,N] storage)
        GemmOp::Wgrad => {
            let dy = ops.a + (row0 * n) as u64 * el;
            let x = ops.b + (row0 * k) as u64 * el;
            let dw = ops.d + (expert * n * k) as u64 * out_el;
            if transposed {
                (N, T, n, k, rows, dy, n, x, k, dw, n)
            } else {
                (N, T, k, n, rows, x, k, dy, n, dw, k)
            }
        }
    };
    GemmArgs { ta, tb, m, n: nn, k: kk, a: pa, lda, b: pb, ldb, c: pc, ldc }
}

fn alpha_beta(spec: &GroupedGemmSpec) -> (f32, f32) {
    (1.0, if spec.accumulate { 1.0 } else { 0.0 })
}

/// One expert's (or the dense problem's) GEMM, in the crate's row-major terms.
fn gemm(handle: &Handle, spec: &GroupedGemmSpec, ops: Operands, expert: usize, row0: usize, rows: usize) -> Result<()> {
    let g = gemm_args(spec, ops, expert, row0, rows);
    let (alpha, beta) = alpha_beta(spec);
    let status = unsafe {
        cublas::cublasGemmEx(
            handle.raw,
            g.ta,
            g.tb,
            g.m as i32,
            g.n as i32,
            g.k as i32,
            &alpha as *const f32 as *const c_void,
            g.a as *const c_void,
            cuda_type(spec.dtype),
            g.lda as i32,
            g.b as *const c_void,
            cuda_type(spec.dtype),
            g.ldb as i32,
            &beta as *const f32 as *const c_void,
            g.c as *mut c_void,
            cuda_type(spec.out_dtype),
            g.ldc as i32,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    check(status, "cublasGemmEx")
}

/// Per-expert cuBLAS GEMMs over `streams` side streams (TransformerEngine style when > 1).
pub struct CublasLoop {
    spec: GroupedGemmSpec,
    handles: Vec<Handle>,
    fork: CudaEvent,
    joins: Vec<CudaEvent>,
}

impl CublasLoop {
    /// Side streams (and their cuBLAS handles and events) are created once, here.
    pub fn new(spec: GroupedGemmSpec, main: &Arc<CudaStream>, streams: usize) -> Result<CublasLoop> {
        if let Some(why) = cublas_unavailable() {
            return Err(Error::Unsupported { op: "cublas baseline", why });
        }
        if spec.weights_as_pointers {
            return Err(Error::Unsupported { op: "cublas baseline", why: "weights as pointer arrays".into() });
        }
        let ctx = main.context();
        let handles = (0..streams.max(1)).map(|_| Handle::new(ctx.new_stream()?)).collect::<Result<Vec<_>>>()?;
        let joins = (0..handles.len()).map(|_| ctx.new_event(None)).collect::<Result<Vec<_>, _>>()?;
        Ok(CublasLoop { spec, handles, fork: ctx.new_event(None)?, joins })
    }

    /// Launches every expert's GEMM for host-side `m_splits` (already read back by the caller,
    /// see [`read_splits`]). Work is forked from and joined back to `main`.
    pub fn launch(&self, main: &CudaStream, ops: Operands, m_splits: &[i64]) -> Result<()> {
        self.fork.record(main)?;
        for h in &self.handles {
            h.stream.wait(&self.fork)?;
        }
        let mut row0 = 0usize;
        let mut next = 0usize;
        for (expert, &rows) in m_splits.iter().enumerate() {
            let rows = rows.max(0) as usize;
            if rows == 0 {
                continue; // wgrad of an empty expert: accumulate leaves it, plain mode is not cleared
            }
            gemm(&self.handles[next % self.handles.len()], &self.spec, ops, expert, row0, rows)?;
            next += 1;
            row0 += rows;
        }
        for (h, join) in self.handles.iter().zip(&self.joins) {
            join.record(&h.stream)?;
            main.wait(join)?;
        }
        Ok(())
    }
}

/// The host round trip the loop baselines need: copies `m_splits` to the host and waits.
pub fn read_splits(main: &Arc<CudaStream>, m_splits: &cudarc::driver::CudaSlice<i32>) -> Result<Vec<i64>> {
    Ok(main.clone_dtoh(m_splits)?.into_iter().map(i64::from).collect())
}

/// The loaded cuBLAS's version as (major, minor, patch), from `cublasGetProperty`.
pub fn cublas_version() -> Result<(i32, i32, i32)> {
    if let Some(why) = cublas_unavailable() {
        return Err(Error::Unsupported { op: "cublas version", why });
    }
    let get = |what: cublas::libraryPropertyType, name: &'static str| -> Result<i32> {
        let mut v = 0;
        check(unsafe { cublas::cublasGetProperty(what, &mut v) }, name)?;
        Ok(v)
    };
    Ok((
        get(cublas::libraryPropertyType::MAJOR_VERSION, "cublasGetProperty(MAJOR_VERSION)")?,
        get(cublas::libraryPropertyType::MINOR_VERSION, "cublasGetProperty(MINOR_VERSION)")?,
        get(cublas::libraryPropertyType::PATCH_LEVEL, "cublasGetProperty(PATCH_LEVEL)")?,
    ))
}

/// `cublasGemmGroupedBatchedEx` with one group (of batch size 1) per non-empty expert.
///
/// Shapes, leading dimensions, transposes and scalars are host arrays (cuBLAS reads them at
/// the call), so the caller reads `m_splits` back first, as for [`CublasLoop`]. The A/B/C
/// pointer arrays must be in device memory: each launch fills them on the host and copies them
/// into buffers allocated here, on the caller's stream, before the GEMM.
pub struct CublasGroupedBatched {
    spec: GroupedGemmSpec,
    handle: Handle,
    /// `[A pointers | B pointers | C pointers]`, `spec.num_experts` each.
    ptrs: CudaSlice<u64>,
}

impl CublasGroupedBatched {
    pub fn new(spec: GroupedGemmSpec, main: &Arc<CudaStream>) -> Result<CublasGroupedBatched> {
        const OP: &str = "cublas grouped batched";
        if let Some(why) = cublas_unavailable() {
            return Err(Error::Unsupported { op: OP, why });
        }
        if spec.weights_as_pointers {
            return Err(Error::Unsupported { op: OP, why: "weights as pointer arrays".into() });
        }
        // cudarc's dynamic loader panics on a missing symbol: look it up first (cuBLAS < 12.5).
        if unsafe { cublas::culib().get::<unsafe extern "C" fn()>(b"cublasGemmGroupedBatchedEx\0") }.is_err() {
            let version = cublas_version().map(|(a, b, c)| format!("{a}.{b}.{c}")).unwrap_or_else(|_| "?".into());
            return Err(Error::Unsupported {
                op: OP,
                why: format!("cuBLAS {version} has no cublasGemmGroupedBatchedEx (needs 12.5+)"),
            });
        }
        let ptrs = main.alloc_zeros::<u64>(3 * spec.num_experts.max(1))?;
        Ok(CublasGroupedBatched { spec, handle: Handle::new(main.clone())?, ptrs })
    }

    /// Uploads the pointer arrays and launches one grouped GEMM on the stream this was made
    /// with, for host-side `m_splits` (see [`read_splits`]). Empty experts are left out, as in
    /// [`CublasLoop`] (wgrad leaves their gradient untouched).
    pub fn launch(&mut self, ops: Operands, m_splits: &[i64]) -> Result<()> {
        const OP: &str = "cublas grouped batched";
        let e = self.spec.num_experts;
        if m_splits.len() != e {
            return Err(Error::InvalidArgument { op: OP, why: format!("{} m_splits for {e} experts", m_splits.len()) });
        }
        let mut groups = Vec::with_capacity(e);
        let mut row0 = 0usize;
        for (expert, &rows) in m_splits.iter().enumerate() {
            let rows = rows.max(0) as usize;
            if rows > 0 {
                groups.push(gemm_args(&self.spec, ops, expert, row0, rows));
            }
            row0 += rows;
        }
        let count = groups.len();
        if count == 0 {
            return Ok(());
        }
        let mut host = vec![0u64; 3 * e];
        for (i, g) in groups.iter().enumerate() {
            host[i] = g.a;
            host[e + i] = g.b;
            host[2 * e + i] = g.c;
        }
        self.handle.stream.memcpy_htod(&host, &mut self.ptrs)?;
        let (alpha, beta) = alpha_beta(&self.spec);
        let int = |f: fn(&GemmArgs) -> usize| -> Vec<i32> { groups.iter().map(|g| f(g) as i32).collect() };
        let (m, n, k) = (int(|g| g.m), int(|g| g.n), int(|g| g.k));
        let (lda, ldb, ldc) = (int(|g| g.lda), int(|g| g.ldb), int(|g| g.ldc));
        let ta: Vec<_> = groups.iter().map(|g| g.ta).collect();
        let tb: Vec<_> = groups.iter().map(|g| g.tb).collect();
        let (alphas, betas, sizes) = (vec![alpha; count], vec![beta; count], vec![1i32; count]);
        let (dev, _guard) = self.ptrs.device_ptr(&self.handle.stream);
        let table = |i: u64| dev + i * e as u64 * std::mem::size_of::<u64>() as u64;
        let status = unsafe {
            cublas::cublasGemmGroupedBatchedEx(
                self.handle.raw,
                ta.as_ptr(),
                tb.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alphas.as_ptr() as *const c_void,
                table(0) as *const *const c_void,
                cuda_type(self.spec.dtype),
                lda.as_ptr(),
                table(1) as *const *const c_void,
                cuda_type(self.spec.dtype),
                ldb.as_ptr(),
                betas.as_ptr() as *const c_void,
                table(2) as *const *mut c_void,
                cuda_type(self.spec.out_dtype),
                ldc.as_ptr(),
                count as i32,
                sizes.as_ptr(),
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        check(status, "cublasGemmGroupedBatchedEx")
    }
}

/// One dense GEMM over `rows` rows with the spec's N and K (expert 0's weight): the ceiling.
pub struct DenseGemm {
    spec: GroupedGemmSpec,
    handle: Handle,
}

impl DenseGemm {
    pub fn new(spec: GroupedGemmSpec, main: &Arc<CudaStream>) -> Result<DenseGemm> {
        if let Some(why) = cublas_unavailable() {
            return Err(Error::Unsupported { op: "cublas dense", why });
        }
        Ok(DenseGemm { spec, handle: Handle::new(main.clone())? })
    }

    pub fn launch(&self, ops: Operands, rows: usize) -> Result<()> {
        gemm(&self.handle, &self.spec, ops, 0, 0, rows)
    }
}
