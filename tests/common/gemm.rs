//! Grouped GEMM test harness: builds operands on the host, runs the crate's kernel, and
//! computes an fp64 reference from the same (dtype-rounded) inputs.
#![allow(dead_code)]

use std::sync::Arc;

use capturable_moe::dtype::DType;
use capturable_moe::grouped_gemm::{row_offsets, GemmOp, GroupedGemm, GroupedGemmSpec, WeightLayout};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::{bf16, f16};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub const POISON: f32 = -1024.0; // exactly representable in bf16, f16 and f32

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Data {
    /// Integers in [-2, 2]: every product and sum is exact in fp32 (for K <= 64 the results
    /// stay below 256, exact in bf16 too), so GPU and reference must agree bit for bit.
    SmallInt,
    /// Uniform in [-1, 1), rounded to the input dtype.
    Random,
}

/// One grouped GEMM case and everything it produced.
pub struct Outcome {
    /// Output rows/elements as f64, in the layout of `d` (pointer-array experts concatenated).
    pub got: Vec<f64>,
    pub expected: Vec<f64>,
    /// Output elements that must hold POISON (rows past the clamped total), as indices.
    pub untouched: Vec<usize>,
    pub flags: i32,
    /// The raw bits of `got`, for bit-equality between runs.
    pub bits: Vec<u64>,
}

fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::Bf16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

fn values(rng: &mut StdRng, len: usize, data: Data, dtype: DType) -> Vec<f32> {
    (0..len)
        .map(|_| match data {
            Data::SmallInt => rng.random_range(-2i32..=2) as f32,
            Data::Random => round(dtype, rng.random_range(-1.0f32..1.0)),
        })
        .collect()
}

/// A device buffer of `dtype` elements holding `host` (already rounded to dtype).
pub enum Buf {
    Bf16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
    F32(CudaSlice<f32>),
}

impl Buf {
    pub fn upload(stream: &Arc<CudaStream>, dtype: DType, host: &[f32]) -> Buf {
        match dtype {
            DType::Bf16 => {
                Buf::Bf16(stream.clone_htod(&host.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap())
            }
            DType::F16 => {
                Buf::F16(stream.clone_htod(&host.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()).unwrap())
            }
            DType::F32 => Buf::F32(stream.clone_htod(host).unwrap()),
            other => panic!("no float buffer of {other:?}"),
        }
    }

    pub fn download(&self, stream: &Arc<CudaStream>) -> (Vec<f64>, Vec<u64>) {
        match self {
            Buf::Bf16(s) => {
                let v = stream.clone_dtoh(s).unwrap();
                (v.iter().map(|x| x.to_f64()).collect(), v.iter().map(|x| x.to_bits() as u64).collect())
            }
            Buf::F16(s) => {
                let v = stream.clone_dtoh(s).unwrap();
                (v.iter().map(|x| x.to_f64()).collect(), v.iter().map(|x| x.to_bits() as u64).collect())
            }
            Buf::F32(s) => {
                let v = stream.clone_dtoh(s).unwrap();
                (v.iter().map(|&x| x as f64).collect(), v.iter().map(|x| x.to_bits() as u64).collect())
            }
        }
    }

    /// Overwrites the buffer in place (same address) with `host`, converted to its dtype.
    pub fn write(&mut self, stream: &Arc<CudaStream>, host: &[f32]) {
        match self {
            Buf::Bf16(s) => stream.memcpy_htod(&host.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), s),
            Buf::F16(s) => stream.memcpy_htod(&host.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), s),
            Buf::F32(s) => stream.memcpy_htod(host, s),
        }
        .unwrap();
    }

    pub fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            Buf::Bf16(s) => s.device_ptr(stream).0,
            Buf::F16(s) => s.device_ptr(stream).0,
            Buf::F32(s) => s.device_ptr(stream).0,
        }
    }
}

/// The weight-shaped operand: one strided tensor, or one buffer per expert plus the device
/// array of their pointers.
pub struct WeightBuf {
    pub parts: Vec<Buf>,
    pub pointers: Option<CudaSlice<u64>>,
}

impl WeightBuf {
    fn upload(stream: &Arc<CudaStream>, dtype: DType, host: &[f32], experts: usize, as_pointers: bool) -> WeightBuf {
        if !as_pointers {
            return WeightBuf { parts: vec![Buf::upload(stream, dtype, host)], pointers: None };
        }
        let per = host.len() / experts;
        let parts: Vec<Buf> = host.chunks(per).map(|c| Buf::upload(stream, dtype, c)).collect();
        let ptrs: Vec<u64> = parts.iter().map(|p| p.ptr(stream)).collect();
        WeightBuf { parts, pointers: Some(stream.clone_htod(&ptrs).unwrap()) }
    }

    fn ptr(&self, stream: &CudaStream) -> u64 {
        match &self.pointers {
            Some(p) => p.device_ptr(stream).0,
            None => self.parts[0].ptr(stream),
        }
    }

    fn download(&self, stream: &Arc<CudaStream>) -> (Vec<f64>, Vec<u64>) {
        let mut all = (Vec::new(), Vec::new());
        for part in &self.parts {
            let (v, b) = part.download(stream);
            all.0.extend(v);
            all.1.extend(b);
        }
        all
    }
}

/// Host-side operands of one case, before upload.
pub struct HostCase {
    pub spec: GroupedGemmSpec,
    pub splits: Vec<i64>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    /// Initial contents of d (POISON, or the fp32 main grad in accumulate mode).
    pub d0: Vec<f32>,
    /// Extra rows of d past `capacity`, checked to stay POISON (out-of-bounds detector).
    pub guard_rows: usize,
}

impl HostCase {
    pub fn new(spec: GroupedGemmSpec, splits: Vec<i64>, data: Data, seed: u64) -> HostCase {
        let mut rng = StdRng::seed_from_u64(seed);
        let (a_len, b_len, d_len) = spec.operand_lens();
        let a = values(&mut rng, a_len, data, spec.dtype);
        let b = values(&mut rng, b_len, data, spec.dtype);
        let guard_rows = 3;
        let d_cols = d_len / spec.capacity.max(1);
        let d0 = if spec.accumulate {
            values(&mut rng, d_len, data, DType::F32)
        } else if spec.op == GemmOp::Wgrad {
            vec![POISON; d_len]
        } else {
            vec![POISON; d_len + guard_rows * d_cols]
        };
        let guard_rows = if spec.op == GemmOp::Wgrad { 0 } else { guard_rows };
        HostCase { spec, splits, a, b, d0, guard_rows }
    }

    /// fp64 reference of d, and the indices of d that must stay untouched.
    pub fn reference(&self) -> (Vec<f64>, Vec<usize>) {
        let s = &self.spec;
        let (n, k) = (s.n, s.k);
        let offsets = row_offsets(&self.splits, s.capacity);
        let mut d: Vec<f64> = self.d0.iter().map(|&x| x as f64).collect();
        let mut untouched = Vec::new();
        let w_at = |e: usize, row: usize, col: usize| -> f64 {
            // element W_e[row (of N), col (of K)]
            let idx = match s.weight_layout {
                WeightLayout::Enk => e * n * k + row * k + col,
                WeightLayout::Ekn => e * n * k + col * n + row,
            };
            self.b[idx] as f64
        };
        for e in 0..s.num_experts {
            let (r0, r1) = (offsets[e], offsets[e + 1]);
            match s.op {
                GemmOp::Fprop => {
                    for r in r0..r1 {
                        for j in 0..n {
                            d[r * n + j] = (0..k).map(|c| self.a[r * k + c] as f64 * w_at(e, j, c)).sum();
                        }
                    }
                }
                GemmOp::Dgrad => {
                    for r in r0..r1 {
                        for c in 0..k {
                            d[r * k + c] = (0..n).map(|j| self.a[r * n + j] as f64 * w_at(e, j, c)).sum();
                        }
                    }
                }
                GemmOp::Wgrad => {
                    for j in 0..n {
                        for c in 0..k {
                            let sum: f64 = (r0..r1).map(|r| self.a[r * n + j] as f64 * self.b[r * k + c] as f64).sum();
                            let idx = match s.weight_layout {
                                WeightLayout::Enk => e * n * k + j * k + c,
                                WeightLayout::Ekn => e * n * k + c * n + j,
                            };
                            d[idx] = if s.accumulate { d[idx] + sum } else { sum };
                        }
                    }
                }
            }
        }
        if s.op != GemmOp::Wgrad {
            let cols = if s.op == GemmOp::Fprop { n } else { k };
            untouched.extend(offsets[s.num_experts] * cols..d.len());
        }
        // The kernel accumulates in fp32 and rounds once to the output type; with small-integer
        // data the fp32 sum is exact, so the rounded reference must match bit for bit.
        for x in d.iter_mut() {
            *x = round(s.out_dtype, *x as f32) as f64;
        }
        (d, untouched)
    }

    /// Uploads, runs once on `stream`, downloads.
    pub fn run(&self, stream: &Arc<CudaStream>) -> Outcome {
        let mut dev = DeviceCase::upload(self, stream);
        dev.launch(stream).expect("grouped GEMM launch");
        dev.outcome(self, stream)
    }
}

/// A case's device buffers, kept alive so that graphs can replay over them.
pub struct DeviceCase {
    pub plan: GroupedGemm,
    pub a: Buf,
    pub b: WeightBuf,
    pub d: WeightBuf,
    pub splits: CudaSlice<i64>,
    pub splits32: CudaSlice<i32>,
    pub flags: CudaSlice<i32>,
    pub workspace: CudaSlice<u8>,
}

impl DeviceCase {
    pub fn upload(case: &HostCase, stream: &Arc<CudaStream>) -> DeviceCase {
        let s = &case.spec;
        let plan = GroupedGemm::new(s.clone(), stream).expect("plan");
        let weight_is_b = s.op != GemmOp::Wgrad;
        let a = Buf::upload(stream, s.dtype, &case.a);
        let b = WeightBuf::upload(stream, s.dtype, &case.b, s.num_experts, s.weights_as_pointers && weight_is_b);
        let d = WeightBuf::upload(stream, s.out_dtype, &case.d0, s.num_experts, s.weights_as_pointers && !weight_is_b);
        let splits = stream.clone_htod(&case.splits).unwrap();
        let splits32 = stream.clone_htod(&case.splits.iter().map(|&x| x as i32).collect::<Vec<_>>()).unwrap();
        let flags = stream.alloc_zeros::<i32>(1).unwrap();
        let workspace = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1)).unwrap();
        DeviceCase { plan, a, b, d, splits, splits32, flags, workspace }
    }

    /// One launch through the raw entry point (the safe one is exercised by its own tests).
    pub fn launch(&mut self, stream: &Arc<CudaStream>) -> capturable_moe::Result<()> {
        let splits = if self.plan.spec().split_dtype == DType::I64 {
            self.splits.device_ptr(stream).0
        } else {
            self.splits32.device_ptr(stream).0
        };
        let flags = self.flags.device_ptr(stream).0;
        let ws = self.workspace.device_ptr(stream).0;
        // SAFETY: buffers were sized from the plan's spec in `upload` and outlive the launch.
        unsafe {
            self.plan.run_raw(
                stream,
                self.a.ptr(stream),
                self.b.ptr(stream),
                self.d.ptr(stream),
                splits,
                flags,
                ws,
                self.workspace.len(),
            )
        }
    }

    /// Puts the case's initial output (`d0`: POISON, or the accumulate mode's start values) back
    /// into d in place and clears the flag word, so that the next launch must write everything
    /// the reference expects.
    pub fn reset_output(&mut self, case: &HostCase, stream: &Arc<CudaStream>) {
        let per_part = case.d0.len() / self.d.parts.len();
        for (part, host) in self.d.parts.iter_mut().zip(case.d0.chunks(per_part)) {
            part.write(stream, host);
        }
        stream.memset_zeros(&mut self.flags).unwrap();
    }

    pub fn set_splits(&mut self, stream: &Arc<CudaStream>, splits: &[i64]) {
        stream.memcpy_htod(splits, &mut self.splits).unwrap();
        let s32: Vec<i32> = splits.iter().map(|&x| x as i32).collect();
        stream.memcpy_htod(&s32, &mut self.splits32).unwrap();
    }

    pub fn outcome(&self, case: &HostCase, stream: &Arc<CudaStream>) -> Outcome {
        let (got, bits) = self.d.download(stream);
        let flags = stream.clone_dtoh(&self.flags).unwrap()[0];
        let (expected, untouched) = case.reference();
        Outcome { got, expected, untouched, flags, bits }
    }
}

impl Outcome {
    /// Bitwise equality with the reference (small-integer data).
    pub fn assert_exact(&self, what: &str) {
        assert_eq!(self.got.len(), self.expected.len(), "{what}: output length");
        for (i, (g, e)) in self.got.iter().zip(&self.expected).enumerate() {
            assert!(g == e, "{what}: element {i}: got {g}, expected {e}");
        }
    }

    /// Normwise relative error over the written elements <= tol; NaN never passes; untouched
    /// elements must still hold POISON exactly.
    pub fn assert_close(&self, what: &str, tol: f64) {
        assert_eq!(self.got.len(), self.expected.len(), "{what}: output length");
        let untouched: std::collections::HashSet<usize> = self.untouched.iter().copied().collect();
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (i, (g, e)) in self.got.iter().zip(&self.expected).enumerate() {
            assert!(!g.is_nan(), "{what}: NaN at element {i}");
            if untouched.contains(&i) {
                assert!(*g == POISON as f64, "{what}: element {i} past the total was written: {g}");
                continue;
            }
            assert!(*g != POISON as f64 || *e == POISON as f64, "{what}: element {i} was never written");
            diff += (g - e) * (g - e);
            norm += e * e;
        }
        let rel = (diff / norm.max(1e-30)).sqrt();
        assert!(rel <= tol, "{what}: normwise relative error {rel:.3e} > {tol:.0e}");
    }
}

/// m_splits that put `total` rows over `experts` experts, uneven and with empty experts.
pub fn skewed_splits(experts: usize, total: usize, seed: u64) -> Vec<i64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let weights: Vec<f64> =
        (0..experts).map(|_| if rng.random_bool(0.2) { 0.0 } else { rng.random_range(0.1f64..3.0).powi(3) }).collect();
    let sum: f64 = weights.iter().sum::<f64>().max(1e-9);
    let mut splits: Vec<i64> = weights.iter().map(|w| (w / sum * total as f64).floor() as i64).collect();
    let assigned: i64 = splits.iter().sum();
    let last = splits.iter().rposition(|&s| s > 0).unwrap_or(experts - 1);
    splits[last] += total as i64 - assigned;
    splits
}
