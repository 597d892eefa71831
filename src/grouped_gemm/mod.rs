//! Grouped GEMM over experts whose row counts (`m_splits`) stay on the GPU.
//!
//! For each expert `e` with weight `W_e` of shape `[N, K]` (nn.Linear layout):
//! - fprop: `Y_e = X_e · W_eᵀ`  (`a` = X `[rows, K]`, `b` = W, `d` = Y `[rows, N]`)
//! - dgrad: `dX_e = dY_e · W_e` (`a` = dY `[rows, N]`, `b` = W, `d` = dX `[rows, K]`)
//! - wgrad: `dW_e = dY_eᵀ · X_e` (`a` = dY `[rows, N]`, `b` = X `[rows, K]`, `d` = dW)
//!
//! Rows of each expert are contiguous, experts in order, at the exclusive prefix sum of
//! `m_splits`, in activation buffers of `capacity` rows. A small kernel turns the device-side
//! `m_splits` into CUTLASS's per-group sizes, pointers and strides in a caller-owned workspace,
//! then the CUTLASS pointer-array grouped GEMM runs. [`GroupedGemm::run`] allocates nothing,
//! never synchronises and never reads `m_splits` on the host, so it can be captured in a CUDA
//! graph and replayed with new counts.
//!
//! Invariants: rows past the device-side total are never touched; a total above `capacity`
//! is clamped (nothing past `capacity` rows is read or written) and raises
//! [`OVERFLOW_CAPACITY`] in the optional device flag word; negative counts count as 0 and
//! raise [`OVERFLOW_NEGATIVE`]; a misaligned or null per-expert pointer skips that expert and
//! raises [`OVERFLOW_MISALIGNED_POINTER`] or [`OVERFLOW_NULL_POINTER`] (other bad addresses
//! cannot be detected: pointer-array entries are trusted). The flags are sticky: the caller
//! clears them.

use std::ffi::c_void;

use cudarc::driver::{sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use crate::device::{ensure_aligned, ensure_aligned16, ensure_same_context, Arch, DeviceInfo};
use crate::dtype::DType;
use crate::error::{check, ensure_len};
use crate::{sys, Error, Result};

/// Device flag bit: the m_splits total exceeded the plan's capacity.
pub const OVERFLOW_CAPACITY: i32 = sys::CAPMOE_OVERFLOW_CAPACITY as i32;
/// Device flag bit: an m_splits entry was negative.
pub const OVERFLOW_NEGATIVE: i32 = sys::CAPMOE_OVERFLOW_NEGATIVE as i32;
/// Device flag bit: a per-expert pointer was not 16-byte aligned (that expert was skipped).
pub const OVERFLOW_MISALIGNED_POINTER: i32 = sys::CAPMOE_OVERFLOW_MISALIGNED as i32;
/// Device flag bit: a per-expert pointer was null (that expert was skipped).
pub const OVERFLOW_NULL_POINTER: i32 = sys::CAPMOE_OVERFLOW_NULL_POINTER as i32;

/// Which product of a linear layer's training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmOp {
    Fprop,
    Dgrad,
    Wgrad,
}

/// How each expert's weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `[E, N, K]`: the nn.Linear weight of each expert.
    Enk,
    /// `[E, K, N]`: transposed.
    Ekn,
}

/// Kernel configuration; `Auto` applies the documented heuristic on host-known facts.
///
/// `Sm90CooperativeNoCluster` and `Sm90PingpongWide` (AUTO's CUTLASS choices for fprop /
/// dgrad) are built for bf16 and fp16 fprop / dgrad; `Sm90Counter` for those and for wgrad into
/// a 16-bit dW. Any other combination with them (wgrad elsewhere, fp32 out, fp32 accumulate) is
/// [`Error::Unsupported`] when the plan is made, as is `Sm90Counter` with a pointer array of
/// weights (or of dW) or more than 1024 experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmConfig {
    Auto,
    /// SM90, 128x256x64 tile, 2x1 cluster: the wgrad kernel for an fp32 dW, accumulate and
    /// pointer arrays (its fprop / dgrad forms won no swept case and were deleted; forced
    /// there, it is [`Error::Unsupported`]).
    Sm90Cooperative,
    /// SM90, 128x256x64 tile, no cluster: fprop / dgrad with many rows per expert.
    Sm90CooperativeNoCluster,
    /// SM90, 64x256x64 tile per warpgroup, the two warpgroups alternating.
    Sm90PingpongWide,
    /// SM90, the crate's own 128x256x64 kernels (not CUTLASS), tiles handed out from a device
    /// counter: fprop / dgrad weight slice by weight slice, up to 16 rows past a tile's 128
    /// computed beside them; wgrad with each tile's dW stored by TMA while the next one's MMAs
    /// run. One weight / dW tensor (no pointer array), at most 1024 experts, 16-bit out (wgrad:
    /// no accumulate); [`Error::Unsupported`] otherwise.
    Sm90Counter,
    /// SM100, 128x256 tile per SM (compiled, never run here: no Blackwell GPU).
    Sm100OneSm,
    /// SM100, 256x256 tile across an SM pair (compiled, never run here).
    Sm100TwoSm,
}

impl GemmConfig {
    /// The C ABI's code of this configuration (`CAPMOE_CONFIG_*`).
    pub fn abi_code(self) -> sys::capmoe_gemm_config_t {
        (match self {
            GemmConfig::Auto => sys::CAPMOE_CONFIG_AUTO,
            GemmConfig::Sm90Cooperative => sys::CAPMOE_CONFIG_SM90_COOPERATIVE,
            GemmConfig::Sm90CooperativeNoCluster => sys::CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER,
            GemmConfig::Sm90PingpongWide => sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE,
            GemmConfig::Sm90Counter => sys::CAPMOE_CONFIG_SM90_COUNTER,
            GemmConfig::Sm100OneSm => sys::CAPMOE_CONFIG_SM100_1SM,
            GemmConfig::Sm100TwoSm => sys::CAPMOE_CONFIG_SM100_2SM,
        }) as sys::capmoe_gemm_config_t
    }

    /// The configuration of a C ABI code, `None` for a code this crate does not know (a
    /// newer or corrupted library must not silently become `Auto`).
    pub fn from_abi_code(code: sys::capmoe_gemm_config_t) -> Option<GemmConfig> {
        let config = match u32::try_from(code).ok()? {
            sys::CAPMOE_CONFIG_AUTO => GemmConfig::Auto,
            sys::CAPMOE_CONFIG_SM90_COOPERATIVE => GemmConfig::Sm90Cooperative,
            sys::CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER => GemmConfig::Sm90CooperativeNoCluster,
            sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE => GemmConfig::Sm90PingpongWide,
            sys::CAPMOE_CONFIG_SM90_COUNTER => GemmConfig::Sm90Counter,
            sys::CAPMOE_CONFIG_SM100_1SM => GemmConfig::Sm100OneSm,
            sys::CAPMOE_CONFIG_SM100_2SM => GemmConfig::Sm100TwoSm,
            _ => return None,
        };
        Some(config)
    }

    /// Every configuration, `Auto` first.
    pub const ALL: [GemmConfig; 7] = [
        GemmConfig::Auto,
        GemmConfig::Sm90Cooperative,
        GemmConfig::Sm90CooperativeNoCluster,
        GemmConfig::Sm90PingpongWide,
        GemmConfig::Sm90Counter,
        GemmConfig::Sm100OneSm,
        GemmConfig::Sm100TwoSm,
    ];

    /// A short name for reports and command lines.
    pub fn name(self) -> &'static str {
        match self {
            GemmConfig::Auto => "auto",
            GemmConfig::Sm90Cooperative => "sm90-coop",
            GemmConfig::Sm90CooperativeNoCluster => "sm90-coop-nocluster",
            GemmConfig::Sm90PingpongWide => "sm90-pingpong-wide",
            GemmConfig::Sm90Counter => "sm90-counter",
            GemmConfig::Sm100OneSm => "sm100-1sm",
            GemmConfig::Sm100TwoSm => "sm100-2sm",
        }
    }

    /// The configuration called `name` (see [`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<GemmConfig> {
        GemmConfig::ALL.into_iter().find(|c| c.name() == name)
    }

    fn arch(self) -> Option<Arch> {
        match self {
            GemmConfig::Auto => None,
            GemmConfig::Sm90Cooperative
            | GemmConfig::Sm90CooperativeNoCluster
            | GemmConfig::Sm90PingpongWide
            | GemmConfig::Sm90Counter => Some(Arch::Sm90),
            GemmConfig::Sm100OneSm | GemmConfig::Sm100TwoSm => Some(Arch::Sm100),
        }
    }
}

/// Everything that fixes a grouped GEMM at plan time. Start from [`GroupedGemmSpec::new`]
/// (bf16 in and out, int32 m_splits, `[E, N, K]` weights as one tensor) and adjust fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupedGemmSpec {
    pub op: GemmOp,
    pub num_experts: usize,
    /// Output features of the layer (rows of each `W_e`).
    pub n: usize,
    /// Input features of the layer (columns of each `W_e`).
    pub k: usize,
    /// Rows of the activation buffers: the most rows all experts together may hold.
    pub capacity: usize,
    /// Input element type: `Bf16` or `F16`.
    pub dtype: DType,
    /// Output element type: `dtype`, or `F32` for wgrad.
    pub out_dtype: DType,
    /// `I32` or `I64` m_splits.
    pub split_dtype: DType,
    pub weight_layout: WeightLayout,
    /// The weight-shaped operand (W for fprop/dgrad, dW for wgrad) is a device array of
    /// `num_experts` pointers instead of one `[E, ...]` tensor.
    pub weights_as_pointers: bool,
    /// wgrad only: `dW_e += dY_eᵀ X_e` into an fp32 buffer (gradient accumulation fusion).
    pub accumulate: bool,
    pub config: GemmConfig,
}

impl GroupedGemmSpec {
    pub fn new(op: GemmOp, num_experts: usize, n: usize, k: usize, capacity: usize) -> Self {
        GroupedGemmSpec {
            op,
            num_experts,
            n,
            k,
            capacity,
            dtype: DType::Bf16,
            out_dtype: DType::Bf16,
            split_dtype: DType::I32,
            weight_layout: WeightLayout::Enk,
            weights_as_pointers: false,
            accumulate: false,
            config: GemmConfig::Auto,
        }
    }

    /// Sets the input dtype, and the output dtype to match.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self.out_dtype = dtype;
        self
    }

    /// Everything checkable without a GPU; the C ABI checks the same again.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "grouped_gemm";
        let invalid = |why: String| Err(Error::InvalidArgument { op: OP, why });
        if !(1..=65535).contains(&self.num_experts) {
            return invalid(format!("num_experts = {} must be in 1..=65535", self.num_experts));
        }
        for (what, value) in [("n", self.n), ("k", self.k)] {
            if value == 0 || value > i32::MAX as usize {
                return invalid(format!("{what} = {value} must be in 1..=i32::MAX"));
            }
            if value % 8 != 0 {
                return Err(Error::Alignment { op: OP, what, value: value as i64, multiple: 8 });
            }
        }
        if self.capacity >= i32::MAX as usize {
            return invalid(format!("capacity = {} must be below i32::MAX rows", self.capacity));
        }
        if !matches!(self.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::Unsupported { op: OP, why: format!("input dtype {:?} (need Bf16 or F16)", self.dtype) });
        }
        if !matches!(self.split_dtype, DType::I32 | DType::I64) {
            return invalid(format!("m_splits dtype {:?} (need I32 or I64)", self.split_dtype));
        }
        let wgrad = self.op == GemmOp::Wgrad;
        let out_ok = self.out_dtype == self.dtype || (wgrad && self.out_dtype == DType::F32);
        if !out_ok {
            return Err(Error::Unsupported {
                op: OP,
                why: format!(
                    "{:?} output {:?} from {:?} input (fp32 output is wgrad-only)",
                    self.op, self.out_dtype, self.dtype
                ),
            });
        }
        if self.accumulate && !(wgrad && self.out_dtype == DType::F32) {
            return Err(Error::Unsupported { op: OP, why: "accumulate needs op Wgrad and out_dtype F32".into() });
        }
        // Every operand's size in bytes (at most 4 per element) must fit in i64, the type of the
        // device's offsets; this also keeps `operand_lens` free of overflow.
        let (e, n, k, cap) = (self.num_experts as u128, self.n as u128, self.k as u128, self.capacity as u128);
        if e * n * k * 4 > i64::MAX as u128 || (cap + 1) * n.max(k) * 4 > i64::MAX as u128 {
            return invalid(format!(
                "E * N * K = {e} * {n} * {k} or capacity * max(N, K) is too large for 64-bit byte offsets"
            ));
        }
        Ok(())
    }

    fn abi(&self, arch: Arch, sm_count: i32) -> sys::capmoe_grouped_gemm_desc_t {
        sys::capmoe_grouped_gemm_desc_t {
            op: (match self.op {
                GemmOp::Fprop => sys::CAPMOE_GEMM_FPROP,
                GemmOp::Dgrad => sys::CAPMOE_GEMM_DGRAD,
                GemmOp::Wgrad => sys::CAPMOE_GEMM_WGRAD,
            }) as i32,
            arch: arch.abi_code(),
            dtype: self.dtype.abi(),
            out_dtype: self.out_dtype.abi(),
            split_dtype: self.split_dtype.abi(),
            weight_layout: (match self.weight_layout {
                WeightLayout::Enk => sys::CAPMOE_WEIGHT_ENK,
                WeightLayout::Ekn => sys::CAPMOE_WEIGHT_EKN,
            }) as i32,
            weights_as_pointers: self.weights_as_pointers as i32,
            accumulate: self.accumulate as i32,
            config: self.config.abi_code(),
            sm_count,
            num_experts: self.num_experts as i64,
            n: self.n as i64,
            k: self.k as i64,
            capacity: self.capacity as i64,
        }
    }

    /// Element counts the three operands must hold: (a, b, d). A pointer-array operand holds
    /// `num_experts` device pointers instead.
    pub fn operand_lens(&self) -> (usize, usize, usize) {
        let (e, n, k, cap) = (self.num_experts, self.n, self.k, self.capacity);
        match self.op {
            GemmOp::Fprop => (cap * k, e * n * k, cap * n),
            GemmOp::Dgrad => (cap * n, e * n * k, cap * k),
            GemmOp::Wgrad => (cap * n, cap * k, e * n * k),
        }
    }

    /// FLOPs of one run when `rows` rows are routed in total.
    pub fn flops(&self, rows: usize) -> f64 {
        2.0 * rows as f64 * self.n as f64 * self.k as f64
    }
}

/// An element type a grouped GEMM operand may have: a float matrix, or (`u64`) an array of
/// per-expert device pointers.
pub trait GemmOperand: DeviceRepr {
    /// `None` for the pointer array.
    const DTYPE: Option<DType>;
}
impl GemmOperand for half::bf16 {
    const DTYPE: Option<DType> = Some(DType::Bf16);
}
impl GemmOperand for half::f16 {
    const DTYPE: Option<DType> = Some(DType::F16);
}
impl GemmOperand for f32 {
    const DTYPE: Option<DType> = Some(DType::F32);
}
impl GemmOperand for u64 {
    const DTYPE: Option<DType> = None;
}

/// An m_splits element type.
pub trait SplitElement: DeviceRepr {
    const DTYPE: DType;
}
impl SplitElement for i32 {
    const DTYPE: DType = DType::I32;
}
impl SplitElement for i64 {
    const DTYPE: DType = DType::I64;
}

/// What a [`GroupedGemm`] was built for ([`GroupedGemm::desc`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupedGemmDesc {
    /// The spec as given (its `config` may be `Auto`).
    pub spec: GroupedGemmSpec,
    /// The kernel the plan runs (never `Auto`).
    pub config: GemmConfig,
    /// The device's architecture and SM count the plan was made for.
    pub arch: Arch,
    pub sm_count: i32,
    /// Bytes of workspace [`GroupedGemm::run`] needs.
    pub workspace_bytes: usize,
}

/// A validated grouped GEMM for one device: the kernel is chosen and the workspace size known.
#[derive(Clone, Debug)]
pub struct GroupedGemm {
    desc: GroupedGemmDesc,
    abi: sys::capmoe_grouped_gemm_desc_t,
}

impl GroupedGemm {
    /// Plans `spec` for the device of `stream` (reads its arch and SM count once).
    pub fn new(spec: GroupedGemmSpec, stream: &CudaStream) -> Result<GroupedGemm> {
        crate::graph::ensure_not_capturing(stream, "GroupedGemm::new")?;
        Self::for_device(spec, &DeviceInfo::of_stream(stream)?)
    }

    /// Plans `spec` for a device described by `device`.
    pub fn for_device(spec: GroupedGemmSpec, device: &DeviceInfo) -> Result<GroupedGemm> {
        spec.validate()?;
        if let Some(need) = spec.config.arch() {
            if need != device.arch {
                return Err(Error::UnsupportedArch {
                    need: if need == Arch::Sm90 { "9.0 for an Sm90 config" } else { "10.0 for an Sm100 config" },
                    got: format!("{:?}", device.arch),
                });
            }
        }
        const OP: &str = "grouped_gemm plan";
        let mut abi = spec.abi(device.arch, device.sm_count);
        let mut resolved: sys::capmoe_gemm_config_t = 0;
        check(unsafe { sys::capmoe_grouped_gemm_resolve_config(&abi, &mut resolved) }, OP)?;
        let config = GemmConfig::from_abi_code(resolved).ok_or_else(|| Error::Unsupported {
            op: OP,
            why: format!("the C library resolved the kernel to config code {resolved}, which this crate does not know"),
        })?;
        abi.config = resolved;
        let mut bytes = 0u64;
        check(unsafe { sys::capmoe_grouped_gemm_workspace_size(&abi, &mut bytes) }, OP)?;
        let desc = GroupedGemmDesc {
            spec,
            config,
            arch: device.arch,
            sm_count: device.sm_count,
            workspace_bytes: bytes as usize,
        };
        Ok(GroupedGemm { desc, abi })
    }

    /// What the plan was built for: the spec, the resolved kernel, the device, the workspace.
    pub fn desc(&self) -> &GroupedGemmDesc {
        &self.desc
    }

    pub fn spec(&self) -> &GroupedGemmSpec {
        &self.desc.spec
    }

    /// The configuration the plan runs (never `Auto`).
    pub fn config(&self) -> GemmConfig {
        self.desc.config
    }

    /// Bytes of device workspace [`run`](Self::run) needs.
    pub fn workspace_bytes(&self) -> usize {
        self.desc.workspace_bytes
    }

    /// Runs the grouped GEMM on `stream`. `a`, `b`, `d` follow the module's layout contract;
    /// `m_splits` holds `num_experts` counts; `overflow_flags`, if given, is one sticky flag
    /// word (a `CudaSlice<i32>` or a view of one, e.g. one word of a larger flag buffer).
    /// Every buffer must belong to `stream`'s CUDA context ([`Error::WrongContext`]). No
    /// allocation, no host synchronisation, no host read of device data.
    #[allow(clippy::too_many_arguments)]
    pub fn run<TA, TB, TD, TS>(
        &self,
        stream: &CudaStream,
        a: &impl DevicePtr<TA>,
        b: &impl DevicePtr<TB>,
        d: &mut impl DevicePtrMut<TD>,
        m_splits: &impl DevicePtr<TS>,
        overflow_flags: Option<&mut dyn DevicePtrMut<i32>>,
        workspace: &mut impl DevicePtrMut<u8>,
    ) -> Result<()>
    where
        TA: GemmOperand,
        TB: GemmOperand,
        TD: GemmOperand,
        TS: SplitElement,
    {
        const OP: &str = "grouped_gemm";
        self.check_operands::<TA, TB, TD, TS>(a.len(), b.len(), d.len(), m_splits.len())?;
        ensure_same_context(OP, "a", stream, a)?;
        ensure_same_context(OP, "b", stream, b)?;
        ensure_same_context(OP, "d", stream, d)?;
        ensure_same_context(OP, "m_splits", stream, m_splits)?;
        ensure_same_context(OP, "workspace", stream, workspace)?;
        if let Some(flags) = overflow_flags.as_deref() {
            ensure_len(OP, "overflow_flags", flags.len(), 1, "")?;
            ensure_same_context(OP, "overflow_flags", stream, flags)?;
        }
        let (a_ptr, _a) = a.device_ptr(stream);
        let (b_ptr, _b) = b.device_ptr(stream);
        let (d_ptr, _d) = d.device_ptr_mut(stream);
        let (s_ptr, _s) = m_splits.device_ptr(stream);
        let workspace_len = workspace.len();
        let (w_ptr, _w) = workspace.device_ptr_mut(stream);
        let (f_ptr, _f) = match overflow_flags {
            Some(flags) => {
                let (ptr, guard) = flags.device_ptr_mut(stream);
                (ptr, Some(guard))
            }
            None => (0, None),
        };
        // SAFETY: every pointer comes from a live buffer of this context whose length and
        // element type were checked above against the plan; the guards outlive the launch.
        unsafe { self.run_raw(stream, a_ptr, b_ptr, d_ptr, s_ptr, f_ptr, w_ptr, workspace_len) }
    }

    /// Raw-pointer form of [`run`](Self::run) for engines that manage their own memory
    /// (crate convention: `&CudaStream` first, then `CUdeviceptr`s in the order of the safe
    /// form, 0 for an absent optional buffer, sizes as `usize`).
    ///
    /// # Safety
    /// `a`, `b`, `d` must point to device buffers of this stream's context holding at least
    /// [`GroupedGemmSpec::operand_lens`] elements of the plan's dtypes (or `num_experts`
    /// 16-byte aligned device pointers for a pointer-array operand), 16-byte aligned;
    /// `m_splits` to `num_experts` counts of `split_dtype`; `overflow_flags` to one `i32` or 0;
    /// `workspace` to `workspace_bytes >= self.workspace_bytes()` bytes, 256-byte aligned. The
    /// buffers must stay alive and unmoved until the launch (or a graph replaying it) finishes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_raw(
        &self,
        stream: &CudaStream,
        a: CUdeviceptr,
        b: CUdeviceptr,
        d: CUdeviceptr,
        m_splits: CUdeviceptr,
        overflow_flags: CUdeviceptr,
        workspace: CUdeviceptr,
        workspace_bytes: usize,
    ) -> Result<()> {
        self.check_workspace(workspace_bytes)?;
        ensure_aligned16("grouped_gemm", [("a", a), ("b", b), ("d", d)])?;
        ensure_aligned("grouped_gemm", 256, [("workspace", workspace)])?;
        stream.context().bind_to_thread()?;
        check(
            sys::capmoe_grouped_gemm_run(
                &self.abi,
                a as *const c_void,
                b as *const c_void,
                d as *mut c_void,
                m_splits as *const c_void,
                overflow_flags as *mut i32,
                workspace as *mut c_void,
                workspace_bytes as u64,
                stream.cu_stream() as *mut c_void,
            ),
            "grouped_gemm run",
        )
    }

    fn check_workspace(&self, bytes: usize) -> Result<()> {
        if bytes < self.workspace_bytes() {
            return Err(Error::WorkspaceTooSmall { op: "grouped_gemm", need: self.workspace_bytes(), got: bytes });
        }
        Ok(())
    }

    fn check_operands<TA: GemmOperand, TB: GemmOperand, TD: GemmOperand, TS: SplitElement>(
        &self,
        a_len: usize,
        b_len: usize,
        d_len: usize,
        splits_len: usize,
    ) -> Result<()> {
        let spec = &self.desc.spec;
        let (a_need, b_need, d_need) = spec.operand_lens();
        let weight_is_b = spec.op != GemmOp::Wgrad;
        let expect = |what: &'static str, got: Option<DType>, len: usize, dtype: DType, need: usize, pointers: bool| {
            let (want_type, want_len) = if pointers { (None, spec.num_experts) } else { (Some(dtype), need) };
            if got != want_type {
                return Err(Error::Shape {
                    op: "grouped_gemm",
                    what,
                    expected: format!("element type {}", type_name(want_type)),
                    got: type_name(got),
                });
            }
            ensure_len("grouped_gemm", what, len, want_len, "")
        };
        let ptrs = spec.weights_as_pointers;
        expect("a", TA::DTYPE, a_len, spec.dtype, a_need, false)?;
        expect("b", TB::DTYPE, b_len, spec.dtype, b_need, ptrs && weight_is_b)?;
        expect("d", TD::DTYPE, d_len, spec.out_dtype, d_need, ptrs && !weight_is_b)?;
        if TS::DTYPE != spec.split_dtype || splits_len < spec.num_experts {
            return Err(Error::Shape {
                op: "grouped_gemm",
                what: "m_splits",
                expected: format!("{} x {:?}", spec.num_experts, spec.split_dtype),
                got: format!("{splits_len} x {:?}", TS::DTYPE),
            });
        }
        Ok(())
    }
}

fn type_name(dtype: Option<DType>) -> String {
    dtype.map_or_else(|| "u64 (device pointers)".to_string(), |d| format!("{d:?}"))
}

/// Exclusive prefix sums of `m_splits`, clamped to `capacity`, as the argument kernel computes
/// them: `offsets[e]` is expert e's first row, `offsets[E]` the clamped total. The reference
/// for tests and for engines that need the layout on the host.
pub fn row_offsets(m_splits: &[i64], capacity: usize) -> Vec<usize> {
    let cap = capacity as i64;
    let mut offsets = Vec::with_capacity(m_splits.len() + 1);
    let mut running = 0i64;
    for &m in m_splits {
        offsets.push(running.min(cap) as usize);
        running += m.clamp(0, cap + 1);
    }
    offsets.push(running.min(cap) as usize);
    offsets
}
