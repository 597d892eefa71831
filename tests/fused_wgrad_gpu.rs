//! The gathered wgrad (`fused::GatherWgrad`: sm_90a, or its sm_100a variant on a compute
//! capability 10.0 device, where every test below runs too) against an fp64 CPU reference and
//! against the grouped GEMM's WGRAD on an explicitly permuted x; eager against CUDA-graph
//! replays.
//!
//! The reference cases use small-integer data: every product and partial sum is an integer far
//! below 2^24, so the fp32 accumulation is exact whatever its order and each output is one
//! rounding of the exact sum. Those checks are bit for bit on every element of dW, which also
//! proves every element was written (the outputs start poisoned with a NaN no kernel computes).
//! Rows at or past the total offsets[E] hold NaN in every operand that has them (and
//! token_of_row points them at real tokens): one read of them would show as a NaN.

mod common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use capturable_moe::device::Arch;
use capturable_moe::dtype::DType;
use capturable_moe::fused::{GatherWgrad, GatherWgradConfig, RowSource, WgradOutput};
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::routing::{Element, RoutingConfig, RoutingPlan, Tokens};
use capturable_moe::Error;
use common::moe::{assert_close, ulp16, POISON_F32};
use common::routing::topk_ids;
use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A 16-bit operand type on the host.
trait Operand: Element + capturable_moe::grouped_gemm::GemmOperand + cudarc::driver::ValidAsZeroBits {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn bits(self) -> u16;
    fn from_bits(bits: u16) -> Self;
    /// A quiet NaN no kernel computes (CUDA's canonical NaNs differ).
    const POISON: u16;
    /// Significand bits below the leading one (7: bf16, 10: f16).
    const MANTISSA: i32;
}

impl Operand for bf16 {
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
    const POISON: u16 = 0x7FC0;
    const MANTISSA: i32 = 7;
}

impl Operand for f16 {
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
    const POISON: u16 = 0x7E55;
    const MANTISSA: i32 = 10;
}

/// One problem on the host: routing maps and operands, with the exact fp64 reference.
#[derive(Clone)]
struct Case {
    e: usize,
    m: usize,
    n: usize,
    capacity: usize,
    max_tokens: usize,
    a_rows: RowSource,
    b_rows: RowSource,
    /// `[E + 1]`, as given to the kernel (may run past capacity: the kernel clamps).
    offsets: Vec<i64>,
    /// `[capacity]`.
    token_of_row: Vec<i32>,
    a: Vec<f64>,
    b: Vec<f64>,
}

fn clamp(v: i64, capacity: usize) -> usize {
    v.clamp(0, capacity as i64) as usize
}

impl Case {
    /// Routing of `counts` rows per expert (prefix sums, clamped by the kernel at `capacity`),
    /// tokens of the first `tokens` of `max_tokens`. Values from `value` (small integers or
    /// random 16-bit values); NaN in every row no row below the total refers to.
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut StdRng,
        (m, n): (usize, usize),
        counts: &[usize],
        capacity: usize,
        (tokens, max_tokens): (usize, usize),
        (a_rows, b_rows): (RowSource, RowSource),
        value: &mut dyn FnMut(&mut StdRng) -> f64,
    ) -> Case {
        let e = counts.len();
        let mut offsets = vec![0i64];
        for c in counts {
            offsets.push(offsets.last().unwrap() + *c as i64);
        }
        let total = clamp(offsets[e], capacity);
        // Rows below the total: real tokens, now and then an invalid one (contributes nothing).
        // Rows past it: real tokens too, so only the row bound keeps them out.
        let token_of_row = (0..capacity)
            .map(|r| match rng.random_range(0..40) {
                0 if r < total => -1,
                1 if r < total => (max_tokens + rng.random_range(0..3)) as i32,
                _ => rng.random_range(0..tokens.max(1)) as i32,
            })
            .collect::<Vec<i32>>();
        let mut case =
            Case { e, m, n, capacity, max_tokens, a_rows, b_rows, offsets, token_of_row, a: vec![], b: vec![] };
        case.a = case.operand(rng, a_rows, m, tokens, total, value);
        case.b = case.operand(rng, b_rows, n, tokens, total, value);
        case
    }

    fn operand(
        &self,
        rng: &mut StdRng,
        rows: RowSource,
        cols: usize,
        tokens: usize,
        total: usize,
        value: &mut dyn FnMut(&mut StdRng) -> f64,
    ) -> Vec<f64> {
        let (count, live) = match rows {
            RowSource::Plain => (self.capacity, total),
            RowSource::Gathered => (self.max_tokens, tokens),
        };
        let mut v: Vec<f64> = (0..count * cols).map(|_| value(rng)).collect();
        for x in &mut v[live * cols..] {
            *x = f64::NAN;
        }
        v
    }

    fn rows(&self, e: usize) -> Range<usize> {
        let begin = clamp(self.offsets[e], self.capacity);
        begin..clamp(self.offsets[e + 1], self.capacity).max(begin)
    }

    /// The operand row routing row `r` reads, `None` when its token is invalid.
    fn source_row(&self, rows: RowSource, r: usize) -> Option<usize> {
        match rows {
            RowSource::Plain => Some(r),
            RowSource::Gathered => {
                let t = self.token_of_row[r];
                (t >= 0 && (t as usize) < self.max_tokens).then_some(t as usize)
            }
        }
    }

    /// Rows of expert `e` that contribute, as (row of a, row of b).
    fn pairs(&self, e: usize) -> Vec<(usize, usize)> {
        self.rows(e)
            .filter_map(|r| Some((self.source_row(self.a_rows, r)?, self.source_row(self.b_rows, r)?)))
            .collect()
    }

    /// Exact `dW [E, M, N]` in fp64.
    fn reference(&self) -> Vec<f64> {
        let (m, n) = (self.m, self.n);
        let mut out = vec![0.0; self.e * m * n];
        for e in 0..self.e {
            let dw = &mut out[e * m * n..(e + 1) * m * n];
            for (ra, rb) in self.pairs(e) {
                let (a, b) = (&self.a[ra * m..(ra + 1) * m], &self.b[rb * n..(rb + 1) * n]);
                for (i, &av) in a.iter().enumerate() {
                    for (o, &bv) in dw[i * n..(i + 1) * n].iter_mut().zip(b) {
                        *o += av * bv;
                    }
                }
            }
        }
        out
    }

    /// One element of the reference.
    fn reference_at(&self, e: usize, i: usize, j: usize) -> f64 {
        self.pairs(e).iter().map(|&(ra, rb)| self.a[ra * self.m + i] * self.b[rb * self.n + j]).sum()
    }

    fn has_rows(&self, e: usize) -> bool {
        !self.rows(e).is_empty()
    }

    fn config(&self, dtype: DType, output: WgradOutput) -> GatherWgradConfig {
        GatherWgradConfig {
            num_experts: self.e,
            m: self.m,
            n: self.n,
            capacity: self.capacity,
            max_tokens: self.max_tokens,
            dtype,
            output,
            a_rows: self.a_rows,
            b_rows: self.b_rows,
        }
    }
}

fn small_int(rng: &mut StdRng) -> f64 {
    rng.random_range(-3i32..=3) as f64
}

/// The inputs of a case on the device.
struct DeviceCase<T> {
    a: CudaSlice<T>,
    b: CudaSlice<T>,
    offsets: CudaSlice<i64>,
    token_of_row: CudaSlice<i32>,
}

/// A device copy of `v`, one element longer when empty (no zero-size allocations).
fn upload<T: cudarc::driver::DeviceRepr + Copy>(stream: &Arc<CudaStream>, v: &[T], pad: T) -> CudaSlice<T> {
    if v.is_empty() {
        return stream.clone_htod(&[pad]).unwrap();
    }
    stream.clone_htod(v).unwrap()
}

fn upload_values<T: Operand>(stream: &Arc<CudaStream>, v: &[f64]) -> CudaSlice<T> {
    let host: Vec<T> = v.iter().map(|&x| T::from_f64(x)).collect();
    upload(stream, &host, T::from_f64(0.0))
}

impl<T: Operand> DeviceCase<T> {
    fn upload(stream: &Arc<CudaStream>, c: &Case) -> DeviceCase<T> {
        DeviceCase {
            a: upload_values(stream, &c.a),
            b: upload_values(stream, &c.b),
            offsets: stream.clone_htod(&c.offsets).unwrap(),
            token_of_row: upload(stream, &c.token_of_row, -1),
        }
    }

    /// Overwrites the buffers in place (same lengths), as a graph replay needs.
    fn load(&mut self, stream: &Arc<CudaStream>, c: &Case) {
        let a: Vec<T> = c.a.iter().map(|&x| T::from_f64(x)).collect();
        let b: Vec<T> = c.b.iter().map(|&x| T::from_f64(x)).collect();
        stream.memcpy_htod(&a, &mut self.a).unwrap();
        stream.memcpy_htod(&b, &mut self.b).unwrap();
        stream.memcpy_htod(&c.offsets, &mut self.offsets).unwrap();
        stream.memcpy_htod(&c.token_of_row, &mut self.token_of_row).unwrap();
    }

    fn run<O: Element>(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatherWgrad,
        dw: &mut CudaSlice<O>,
    ) -> capturable_moe::Result<()> {
        plan.run(stream, &self.a, &self.b, &self.offsets, &self.token_of_row, dw)
    }
}

/// What dW should hold: bits of each element, and a readable form for messages.
struct Expected {
    bits: Vec<u32>,
    values: Vec<f64>,
}

/// `dW` before an accumulating launch: small integers, except poison in experts without rows
/// (a write of `poison + 0` would turn it into CUDA's canonical NaN and show).
fn accumulate_init(c: &Case, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let block = c.m * c.n;
    (0..c.e * block)
        .map(|i| if c.has_rows(i / block) { rng.random_range(-6i32..=6) as f32 } else { f32::from_bits(POISON_F32) })
        .collect()
}

fn expected<T: Operand>(c: &Case, output: WgradOutput, sums: &[f64], init: &[f32]) -> Expected {
    let block = c.m * c.n;
    let (bits, values) = match output {
        WgradOutput::Same => sums.iter().map(|&s| (T::from_f64(s).bits() as u32, T::from_f64(s).to_f64())).unzip(),
        WgradOutput::F32 => sums.iter().map(|&s| ((s as f32).to_bits(), s as f32 as f64)).unzip(),
        WgradOutput::F32Accumulate => sums
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let v = if c.has_rows(i / block) { init[i] + s as f32 } else { init[i] };
                (v.to_bits(), v as f64)
            })
            .unzip(),
    };
    Expected { bits, values }
}

/// Bit equality of every element; with `sign_bit` (the format's sign bit, 0 for none) -0 and
/// +0 count as equal: a sum whose every product is a zero (a row's zero-filled partner times a
/// negative value) has a sign the tensor cores' internal order decides.
fn assert_bits_equal(what: &str, c: &Case, got: &[u32], want: &Expected, sign_bit: u32, as_f64: impl Fn(u32) -> f64) {
    assert_eq!(got.len(), want.bits.len(), "{what}: length");
    let canon = |b: u32| if b == sign_bit { 0 } else { b };
    let wrong: Vec<usize> = (0..got.len()).filter(|&i| canon(got[i]) != canon(want.bits[i])).collect();
    if let Some(&i) = wrong.first() {
        let (e, mn) = (i / (c.m * c.n), i % (c.m * c.n));
        panic!(
            "{what}: {} of {} elements differ; first dW[{e}, {}, {}]: got {} ({:#x}), expected {} ({:#x})",
            wrong.len(),
            got.len(),
            mn / c.n,
            mn % c.n,
            as_f64(got[i]),
            got[i],
            want.values[i],
            want.bits[i]
        );
    }
}

const OUTPUTS: [WgradOutput; 3] = [WgradOutput::Same, WgradOutput::F32, WgradOutput::F32Accumulate];

/// Runs `c` through the kernel for every output form and checks every element bit for bit.
fn check_exact<T: Operand>(stream: &Arc<CudaStream>, what: &str, c: &Case) {
    let sums = c.reference();
    let dev = DeviceCase::<T>::upload(stream, c);
    for output in OUTPUTS {
        let what = format!("{what} ({:?}, {output:?})", <T as Element>::DTYPE);
        let plan = GatherWgrad::new(c.config(<T as Element>::DTYPE, output), stream).unwrap();
        let len = c.e * c.m * c.n;
        match output {
            WgradOutput::Same => {
                let mut dw: CudaSlice<T> = stream.clone_htod(&vec![T::from_bits(T::POISON); len]).unwrap();
                dev.run(stream, &plan, &mut dw).unwrap();
                let got: Vec<u32> = stream.clone_dtoh(&dw).unwrap().iter().map(|v| v.bits() as u32).collect();
                let want = expected::<T>(c, output, &sums, &[]);
                assert_bits_equal(&what, c, &got, &want, 0x8000, |b| T::from_bits(b as u16).to_f64());
            }
            WgradOutput::F32 | WgradOutput::F32Accumulate => {
                let init = if output == WgradOutput::F32 {
                    vec![f32::from_bits(POISON_F32); len]
                } else {
                    accumulate_init(c, 99)
                };
                let mut dw = stream.clone_htod(&init).unwrap();
                dev.run(stream, &plan, &mut dw).unwrap();
                let got: Vec<u32> = stream.clone_dtoh(&dw).unwrap().iter().map(|v| v.to_bits()).collect();
                let want = expected::<T>(c, output, &sums, &init);
                assert_bits_equal(&what, c, &got, &want, 0x8000_0000, |b| f32::from_bits(b) as f64);
            }
        }
    }
}

const FC1: (RowSource, RowSource) = (RowSource::Plain, RowSource::Gathered);
const FC2: (RowSource, RowSource) = (RowSource::Gathered, RowSource::Plain);

/// The awkward routings, each for bf16 and f16 and every output form.
fn exact_cases(rng: &mut StdRng) -> Vec<(&'static str, Case)> {
    let mut v = small_int;
    vec![
        // Partial M and N tiles; experts of 0, 1, 63, 64, 65 rows (partial last K blocks next
        // to a neighbour's real rows) and one of 600 (10 K blocks: the 4-stage ring wraps).
        (
            "messy: M 264 N 520, counts 0 1 63 64 65 600",
            Case::new(rng, (264, 520), &[0, 1, 63, 64, 65, 600], 1000, (250, 300), FC1, &mut v),
        ),
        // offsets run past capacity: expert 2 is cut at 700, experts 3 and 4 have no rows.
        ("capacity-clamped offsets", Case::new(rng, (128, 256), &[100, 300, 500, 200, 7], 700, (90, 128), FC1, &mut v)),
        ("one expert takes every row", Case::new(rng, (128, 256), &[0, 0, 777, 0], 777, (200, 200), FC1, &mut v)),
        // Offsets that do not ascend (the header's contract: an expert whose end is not past its
        // start has no rows, and experts may share rows): [-50, 400, 100, 600, 700] gives
        // experts 0 and 2 the overlapping rows [0, 400) and [100, 600), expert 1 none.
        ("offsets that do not ascend", {
            let mut c = Case::new(rng, (128, 256), &[100, 300, 200, 100], 800, (150, 160), FC1, &mut v);
            c.offsets = vec![-50, 400, 100, 600, 700];
            c
        }),
        (
            "fc2 orientation (A gathered, B plain)",
            Case::new(rng, (136, 264), &[130, 0, 70], 300, (60, 64), FC2, &mut v),
        ),
        (
            "both plain",
            Case::new(rng, (64, 16), &[10, 90, 0, 33], 200, (8, 8), (RowSource::Plain, RowSource::Plain), &mut v),
        ),
        ("no rows at all", Case::new(rng, (256, 512), &[0, 0, 0], 64, (32, 32), FC1, &mut v)),
        ("capacity 0", Case::new(rng, (128, 256), &[5, 3], 0, (16, 16), FC1, &mut v)),
    ]
}

#[test]
fn fused_wgrad_matches_exact_reference_bf16() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let mut rng = StdRng::seed_from_u64(1);
    for (what, case) in exact_cases(&mut rng) {
        check_exact::<bf16>(&stream, what, &case);
    }
}

#[test]
fn fused_wgrad_matches_exact_reference_f16() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let mut rng = StdRng::seed_from_u64(2);
    for (what, case) in exact_cases(&mut rng) {
        check_exact::<f16>(&stream, what, &case);
    }
}

/// fc1's wgrad at a model shape, routing from the crate's routing build: the gathered kernel
/// against permute(x) -> grouped GEMM WGRAD (same dH). Asserted: every element of the gathered
/// dW written (poisoned before, for the `T` output) and finite; both against fp64 on sampled
/// elements; gathered against the grouped WGRAD on every element
/// ([`assert_near_grouped_wgrad`]). The count of bit-equal elements and the normwise difference
/// are printed (equal sum order would make them all equal).
fn check_against_grouped_wgrad<T: Operand>(
    stream: &Arc<CudaStream>,
    name: &str,
    e: usize,
    h: usize,
    f: usize,
    k: usize,
    t: usize,
    t_max: usize,
) {
    let routing = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: f,
        topk: k,
        max_tokens: t_max,
        capacity: None,
        expert_capacity: None,
        dtype: <T as Element>::DTYPE,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let cap = routing.capacity();
    let mut rng = StdRng::seed_from_u64(3);
    let ids = topk_ids(&mut rng, t_max, e, k);
    let mut maps = routing.alloc_maps(stream).unwrap();
    let ids_dev = stream.clone_htod(&ids).unwrap();
    routing.build(stream, &ids_dev, Tokens::Host(t), &mut maps).unwrap();
    let offsets: Vec<i64> = stream.clone_dtoh(&maps.offsets).unwrap();
    let token_of_row: Vec<i32> = stream.clone_dtoh(&maps.token_of_row).unwrap();
    let total = offsets[e] as usize;

    let mut random = |rng: &mut StdRng| T::from_f64(rng.random_range(-1.0..1.0)).to_f64();
    let mut case = Case {
        e,
        m: 2 * f,
        n: h,
        capacity: cap,
        max_tokens: t_max,
        a_rows: RowSource::Plain,
        b_rows: RowSource::Gathered,
        offsets,
        token_of_row,
        a: vec![],
        b: vec![],
    };
    case.a = case.operand(&mut rng, RowSource::Plain, 2 * f, t, total, &mut random);
    case.b = case.operand(&mut rng, RowSource::Gathered, h, t, total, &mut random);
    let dev = DeviceCase::<T> {
        a: upload_values(stream, &case.a),
        b: upload_values(stream, &case.b),
        offsets: maps.offsets.clone(),
        token_of_row: maps.token_of_row.clone(),
    };
    let mut x_perm = stream.alloc_zeros::<T>(cap * h).unwrap();
    routing.permute(stream, &dev.b, &maps.row_of_route, Tokens::Host(t), &mut x_perm).unwrap();

    // Sampled fp64 reference: 6 experts x 12 rows of dW_e, every column.
    let samples: Vec<(usize, usize)> =
        (0..6).flat_map(|i| (0..12).map(move |j| ((i * 37 + 5) % e, (j * 131 + i) % (2 * f)))).collect();
    let reference: Vec<f64> =
        samples.iter().flat_map(|&(ex, i)| (0..h).map(|j| case.reference_at(ex, i, j)).collect::<Vec<_>>()).collect();

    for output in [WgradOutput::Same, WgradOutput::F32Accumulate] {
        let what = format!("{name} ({:?}, {output:?})", <T as Element>::DTYPE);
        let gathered = GatherWgrad::new(GatherWgradConfig::fc1(&routing, output), stream).unwrap();
        let mut spec = GroupedGemmSpec::new(GemmOp::Wgrad, e, 2 * f, h, cap).with_dtype(<T as Element>::DTYPE);
        if output == WgradOutput::F32Accumulate {
            spec.out_dtype = DType::F32;
            spec.accumulate = true;
        }
        let grouped = GroupedGemm::new(spec, stream).unwrap();
        let mut workspace = stream.alloc_zeros::<u8>(grouped.workspace_bytes().max(1)).unwrap();
        let len = e * 2 * f * h;
        // Outputs as f32 (exact for every output type); `init` is what dW held before (zeros
        // for the T output, random values for the accumulating one).
        let (got, want, init): (Vec<f32>, Vec<f32>, Vec<f32>) = if output == WgradOutput::Same {
            let mut dw_g = stream.clone_htod(&vec![T::from_bits(T::POISON); len]).unwrap();
            let mut dw_c = stream.alloc_zeros::<T>(len).unwrap();
            dev.run(stream, &gathered, &mut dw_g).unwrap();
            grouped.run(stream, &dev.a, &x_perm, &mut dw_c, &maps.m_splits_i32, None, &mut workspace).unwrap();
            let dw_g = stream.clone_dtoh(&dw_g).unwrap();
            if let Some(i) = dw_g.iter().position(|v| v.bits() == T::POISON) {
                let n = dw_g.iter().filter(|v| v.bits() == T::POISON).count();
                panic!("{what}: {n} elements of dW not written (still the poison); first at {i}");
            }
            let f32s = |d: &[T]| d.iter().map(|v| v.to_f64() as f32).collect::<Vec<_>>();
            (f32s(&dw_g), f32s(&stream.clone_dtoh(&dw_c).unwrap()), vec![0.0; len])
        } else {
            // Not poisoned: the kernel adds to dW. An unwritten element shows as an increment
            // of 0, which the element-by-element comparison below rejects.
            let init: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut dw_g = stream.clone_htod(&init).unwrap();
            let mut dw_c = stream.clone_htod(&init).unwrap();
            dev.run(stream, &gathered, &mut dw_g).unwrap();
            grouped.run(stream, &dev.a, &x_perm, &mut dw_c, &maps.m_splits_i32, None, &mut workspace).unwrap();
            (stream.clone_dtoh(&dw_g).unwrap(), stream.clone_dtoh(&dw_c).unwrap(), init)
        };
        if let Some(i) = got.iter().position(|v| !v.is_finite()) {
            panic!("{what}: gathered dW[{i}] = {} is not finite", got[i]);
        }
        // What each launch added, sampled, against fp64.
        let added = |v: &[f32]| -> Vec<f64> {
            samples
                .iter()
                .flat_map(|&(ex, i)| (0..h).map(move |j| (ex * 2 * f + i) * h + j))
                .map(|at| v[at] as f64 - init[at] as f64)
                .collect()
        };
        assert_close(&format!("{what}: gathered vs fp64"), &added(&got), &reference, 1e-2);
        assert_close(&format!("{what}: grouped WGRAD vs fp64"), &added(&want), &reference, 1e-2);
        let within: &dyn Fn(f64, f64) -> f64 = match output {
            WgradOutput::Same => &|g, c| 2.0 * ulp16(g.abs().max(c.abs()), T::MANTISSA),
            _ => &|_, c| 1e-4 * c.abs(),
        };
        assert_near_grouped_wgrad(&what, (&got, &want, &init), (2 * f, h), within);
        let equal = got.iter().zip(&want).filter(|(g, w)| g.to_bits() == w.to_bits()).count();
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for ((&g, &w), &i0) in got.iter().zip(&want).zip(&init) {
            diff += (g as f64 - w as f64).powi(2);
            norm += (w as f64 - i0 as f64).powi(2);
        }
        let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
        println!(
            "{what}: {equal} of {len} elements bit-equal to the grouped WGRAD on permuted x (normwise diff {rel:.2e})"
        );
    }
}

/// The gathered dW against the grouped WGRAD's on every element of what each launch added
/// (`init`: what dW held before), expert by expert (`[m, n]` each):
/// `|Δg - Δc| <= within(Δg, Δc) + 1e-3 rms(Δc of the expert)`.
///
/// Why that holds for a correct kernel: each element on both sides is one fp32 sum of the same
/// products (one per row of the expert, a few hundred), in a different order (other tiles and
/// MMA shapes). With random signs, the order moves the sum by about sqrt(K) 2^-24 Σ|terms|,
/// under 1e-5 of the expert's rms. `within` adds what follows the sum: for a 16-bit output,
/// one rounding to T on each side, so 2 ulps of T at the larger value (1 for the rounding, 1 of
/// room); for the fp32 accumulate, init + Σ rounded to fp32 on each side (a few 2^-24 of
/// |init| + |Σ|, init in [-1, 1]), so 1e-4 |Δc|. The 1e-3 rms floor serves the sums that
/// cancel to near 0, whose ulps shrink while the order's error does not. A wrong, missing or
/// unwritten element is off by about the rms and fails.
fn assert_near_grouped_wgrad(
    what: &str,
    (got, want, init): (&[f32], &[f32], &[f32]),
    (m, n): (usize, usize),
    within: &dyn Fn(f64, f64) -> f64,
) {
    let per_expert = m * n;
    let (mut failures, mut first) = (0usize, None);
    for (e, ((g, c), i0)) in
        got.chunks(per_expert).zip(want.chunks(per_expert)).zip(init.chunks(per_expert)).enumerate()
    {
        let added = |v: f32, i: f32| v as f64 - i as f64;
        let rms = (c.iter().zip(i0).map(|(&c, &i)| added(c, i).powi(2)).sum::<f64>() / per_expert as f64).sqrt();
        for (at, ((&g, &c), &i)) in g.iter().zip(c).zip(i0).enumerate() {
            let (dg, dc) = (added(g, i), added(c, i));
            let floor = 1e-3 * rms;
            // `within` (a log2 for the ulp) only where the floor alone does not cover it.
            if (dg - dc).abs() > floor && (dg - dc).abs() > within(dg, dc) + floor {
                failures += 1;
                first.get_or_insert((e, at / n, at % n, dg, dc, within(dg, dc) + floor));
            }
        }
    }
    if let Some((e, i, j, dg, dc, allowed)) = first {
        panic!(
            "{what}: gathered vs grouped WGRAD: {failures} of {} elements out of bounds; first dW[{e}, {i}, {j}]: \
             gathered added {dg}, grouped WGRAD {dc} (allowed {allowed:.3e})",
            got.len()
        );
    }
}

#[test]
fn fused_wgrad_matches_grouped_wgrad_on_permuted_x() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    // Small enough for quick runs, with partial tiles: E 8, 2F = 272, H = 200, 300 tokens of 320.
    check_against_grouped_wgrad::<bf16>(&stream, "E8 H200 F136 k3 T300", 8, 200, 136, 3, 300, 320);
    check_against_grouped_wgrad::<f16>(&stream, "E8 H200 F136 k3 T300", 8, 200, 136, 3, 300, 320);
}

#[test]
fn fused_wgrad_model_shape_against_grouped_wgrad() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    // Under a sanitizer (10-100x slower) the 400M-element dW and its host passes do not fit the
    // memcheck run's time; fused_wgrad_matches_grouped_wgrad_on_permuted_x covers the same checks.
    if common::under_sanitizer() {
        println!("skipping: E128 model shape under a sanitizer (CAPMOE_SANITIZER=1)");
        return;
    }
    let start = Instant::now();
    // The benchmark's training shape, T short of T_max so rows past the total exist.
    check_against_grouped_wgrad::<bf16>(&stream, "E128 H2048 F768 k8 T4000", 128, 2048, 768, 8, 4000, 4096);
    println!("checked in {:.1} s", start.elapsed().as_secs_f64());
}

/// Capture one launch; replay with new routing and operands written into the captured
/// buffers; every replay equals an eager launch bit for bit, and the exact reference.
#[test]
fn fused_wgrad_graph_replays_match_eager() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let _lock = common::capture_lock();
    let (m, n, capacity, max_tokens) = (256, 264, 600, 200);
    let case = |rng: &mut StdRng, i: usize| -> Case {
        let e = 8;
        let counts: Vec<usize> = match i % 4 {
            0 => vec![0; e],
            1 => (0..e).map(|x| if x == 5 { 650 } else { 0 }).collect(), // past capacity
            _ => (0..e).map(|_| if rng.random_range(0..3) == 0 { 0 } else { rng.random_range(1..130) }).collect(),
        };
        let tokens = rng.random_range(1..=max_tokens);
        Case::new(rng, (m, n), &counts, capacity, (tokens, max_tokens), FC1, &mut small_int)
    };
    let mut rng = StdRng::seed_from_u64(4);
    for output in [WgradOutput::Same, WgradOutput::F32Accumulate] {
        let first = case(&mut rng, 2);
        let plan = GatherWgrad::new(first.config(DType::Bf16, output), &stream).unwrap();
        let mut graph_in = DeviceCase::<bf16>::upload(&stream, &first);
        let mut eager_in = DeviceCase::<bf16>::upload(&stream, &first);
        let len = first.e * m * n;
        let mut dw16 = stream.alloc_zeros::<bf16>(len).unwrap();
        let mut dw32 = stream.alloc_zeros::<f32>(len).unwrap();
        let mut eager16 = stream.alloc_zeros::<bf16>(len).unwrap();
        let mut eager32 = stream.alloc_zeros::<f32>(len).unwrap();
        stream.synchronize().unwrap();
        let graph = capture(&stream, || match output {
            WgradOutput::Same => graph_in.run(&stream, &plan, &mut dw16),
            _ => graph_in.run(&stream, &plan, &mut dw32),
        })
        .unwrap();
        for i in 0..24 {
            let c = case(&mut rng, i);
            let what = format!("{output:?}: replay {i}");
            graph_in.load(&stream, &c);
            eager_in.load(&stream, &c);
            let sums = c.reference();
            let got_graph: Vec<u32>;
            let got_eager: Vec<u32>;
            let want;
            if output == WgradOutput::Same {
                let poison = vec![bf16::from_bits(<bf16 as Operand>::POISON); len];
                stream.memcpy_htod(&poison, &mut dw16).unwrap();
                stream.memcpy_htod(&poison, &mut eager16).unwrap();
                graph.launch().unwrap();
                eager_in.run(&stream, &plan, &mut eager16).unwrap();
                got_graph = stream.clone_dtoh(&dw16).unwrap().iter().map(|v| v.to_bits() as u32).collect();
                got_eager = stream.clone_dtoh(&eager16).unwrap().iter().map(|v| v.to_bits() as u32).collect();
                want = expected::<bf16>(&c, output, &sums, &[]);
            } else {
                let init = accumulate_init(&c, i as u64);
                stream.memcpy_htod(&init, &mut dw32).unwrap();
                stream.memcpy_htod(&init, &mut eager32).unwrap();
                graph.launch().unwrap();
                eager_in.run(&stream, &plan, &mut eager32).unwrap();
                got_graph = stream.clone_dtoh(&dw32).unwrap().iter().map(|v| v.to_bits()).collect();
                got_eager = stream.clone_dtoh(&eager32).unwrap().iter().map(|v| v.to_bits()).collect();
                want = expected::<bf16>(&c, output, &sums, &init);
            }
            let eager_bits =
                Expected { bits: got_eager.clone(), values: got_eager.iter().map(|&b| b as f64).collect() };
            let sign_bit = if output == WgradOutput::Same { 0x8000 } else { 0x8000_0000 };
            assert_bits_equal(&format!("{what}: graph vs eager"), &c, &got_graph, &eager_bits, 0, |b| b as f64);
            assert_bits_equal(&format!("{what}: eager vs reference"), &c, &got_eager, &want, sign_bit, |b| b as f64);
        }
    }
}

#[test]
fn fused_wgrad_checks_buffers_before_launch() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    let mut rng = StdRng::seed_from_u64(5);
    let c = Case::new(&mut rng, (128, 256), &[10, 20], 64, (16, 16), FC1, &mut small_int);
    let dev = DeviceCase::<bf16>::upload(&stream, &c);
    let plan = GatherWgrad::new(c.config(DType::Bf16, WgradOutput::Same), &stream).unwrap();
    let mut short = stream.alloc_zeros::<bf16>(2 * 128 * 256 - 1).unwrap();
    let r = dev.run(&stream, &plan, &mut short);
    assert!(matches!(r, Err(Error::Shape { .. })), "short dw: {r:?}");
    let mut wrong_type = stream.alloc_zeros::<f32>(2 * 128 * 256).unwrap();
    let r = dev.run(&stream, &plan, &mut wrong_type);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "f32 dw for a bf16-output plan: {r:?}");
    let short_b = stream.alloc_zeros::<bf16>(16 * 256 - 8).unwrap();
    let mut dw = stream.alloc_zeros::<bf16>(2 * 128 * 256).unwrap();
    let r = plan.run(&stream, &dev.a, &short_b, &dev.offsets, &dev.token_of_row, &mut dw);
    assert!(matches!(r, Err(Error::Shape { .. })), "short b: {r:?}");
}

/// Timing hook (ignored by default): us per launch, graph replay, at E128 T4096 k8 H2048 F768
/// (`CAPMOE_WGRAD_TIMING_TOKENS` sets T), the gathered wgrad against permute(x) + grouped GEMM
/// WGRAD and against that WGRAD alone (the routing build outside all), bf16 output and fp32
/// accumulate. Run: `cargo test --release --test fused_wgrad_gpu fused_wgrad_timing --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn fused_wgrad_timing() {
    let stream = gpu_of_arch_or_skip!("the gathered wgrad", Arch::Sm90, Arch::Sm100);
    if common::skip_under_sanitizer() {
        return;
    }
    let _lock = common::capture_lock();
    let t = std::env::var("CAPMOE_WGRAD_TIMING_TOKENS").map_or(4096, |v| v.parse().expect("a token count"));
    let (e, h, f, k) = (128, 2048, 768, 8);
    let routing = RoutingPlan::new(RoutingConfig {
        num_experts: e,
        hidden: h,
        ffn: f,
        topk: k,
        max_tokens: t,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let cap = routing.capacity();
    let mut rng = StdRng::seed_from_u64(6);
    let ids = stream.clone_htod(&topk_ids(&mut rng, t, e, k)).unwrap();
    let mut maps = routing.alloc_maps(&stream).unwrap();
    routing.build(&stream, &ids, Tokens::Host(t), &mut maps).unwrap();
    let rand16 = |rng: &mut StdRng, n: usize| -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect()
    };
    let x = stream.clone_htod(&rand16(&mut rng, t * h)).unwrap();
    let dh = stream.clone_htod(&rand16(&mut rng, cap * 2 * f)).unwrap();
    let mut x_perm = stream.alloc_zeros::<bf16>(cap * h).unwrap();
    let time = |name: &str, body: &mut dyn FnMut() -> capturable_moe::Result<()>| {
        let graph = capture(&stream, body).unwrap();
        for _ in 0..5 {
            graph.launch().unwrap();
        }
        stream.synchronize().unwrap();
        let reps = 50;
        let start = Instant::now();
        for _ in 0..reps {
            graph.launch().unwrap();
        }
        stream.synchronize().unwrap();
        let us = start.elapsed().as_secs_f64() * 1e6 / reps as f64;
        let flops = 2.0 * (cap as f64) * (2 * f) as f64 * h as f64;
        println!("{name}: {us:.1} us per launch ({:.0} TFLOP/s at {cap} rows)", flops / us * 1e-6);
    };
    for output in [WgradOutput::Same, WgradOutput::F32Accumulate] {
        let gathered = GatherWgrad::new(GatherWgradConfig::fc1(&routing, output), &stream).unwrap();
        let mut spec = GroupedGemmSpec::new(GemmOp::Wgrad, e, 2 * f, h, cap);
        if output == WgradOutput::F32Accumulate {
            spec.out_dtype = DType::F32;
            spec.accumulate = true;
        }
        let grouped = GroupedGemm::new(spec, &stream).unwrap();
        let mut workspace = stream.alloc_zeros::<u8>(grouped.workspace_bytes().max(1)).unwrap();
        let m = &maps;
        if output == WgradOutput::Same {
            let mut dw = stream.alloc_zeros::<bf16>(e * 2 * f * h).unwrap();
            time("gathered wgrad, bf16 out", &mut || {
                gathered.run(&stream, &dh, &x, &m.offsets, &m.token_of_row, &mut dw)
            });
            time("permute + WGRAD (AUTO), bf16 out", &mut || {
                routing.permute(&stream, &x, &m.row_of_route, Tokens::Host(t), &mut x_perm)?;
                grouped.run(&stream, &dh, &x_perm, &mut dw, &m.m_splits_i32, None, &mut workspace)
            });
            time("WGRAD (AUTO) alone on the permuted rows, bf16 out", &mut || {
                grouped.run(&stream, &dh, &x_perm, &mut dw, &m.m_splits_i32, None, &mut workspace)
            });
        } else {
            let mut dw = stream.alloc_zeros::<f32>(e * 2 * f * h).unwrap();
            time("gathered wgrad, fp32 accumulate", &mut || {
                gathered.run(&stream, &dh, &x, &m.offsets, &m.token_of_row, &mut dw)
            });
            time("permute + WGRAD (AUTO), fp32 accumulate", &mut || {
                routing.permute(&stream, &x, &m.row_of_route, Tokens::Host(t), &mut x_perm)?;
                grouped.run(&stream, &dh, &x_perm, &mut dw, &m.m_splits_i32, None, &mut workspace)
            });
        }
    }
}
