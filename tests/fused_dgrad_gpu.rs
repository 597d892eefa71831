//! The fused fc2 dgrad + SwiGLU backward (one kernel: dact = drows · W2_e, then
//! dh = SwiGLU'(h) · dact in the epilogue; the sm_90a kernel on a 9.0 device, the sm_100a one
//! on 10.0, the same checks for both) against an fp64 CPU reference, element by element,
//! and against the unfused path it replaces (fc2 dgrad grouped GEMM -> SwiGLU backward); eager
//! against CUDA-graph replay with fresh routing. bf16 and f16.
//!
//! What is asserted, per element of every stored row:
//! * dact (the kernel's optional output) within 1 ulp of the fp64 GEMM rounded, plus a bound
//!   on fp32 accumulation error (`4 K 2^-24 Σ|terms|`);
//! * dh within 1 ulp of the fp64 SwiGLU backward of (the kernel's own dact, g, u), plus a
//!   bound on the fp32 math's error (cancellation in `1 + g (1 - s)`);
//! * dh normwise within 1e-2 of the all-fp64 pipeline;
//! * rows at or past offsets[E] still hold the poison, bit for bit; rows before it all written;
//! * dh without the dact output equals dh with it, bit for bit.
//!
//! Equality with the unfused path is REPORTED, not asserted: both round the same fp32 dact and
//! run the same fp32 SwiGLU backward, but the fused kernel's k16 MMA sum order need not be
//! CUTLASS's, so a dact may differ by an ulp. A line `bitwise vs unfused: ...` says how many
//! elements differ and by how many ulps at most (0 of N: the same bits).
//!
//! The gathered form (`fused_dgrad_gathered_*`: A = dy rows through token_of_row, dh of
//! prob · dact, dprob partials) has its own list of checks above its section below.

mod common;

use std::sync::Arc;
use std::time::Instant;

use capturable_moe::dtype::DType;
use capturable_moe::fused::FusedSwigluDgrad;
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::moe::MoeElement;
use capturable_moe::routing::{self, RouteMaps, RoutingConfig, RoutingPlan, Tokens};
use capturable_moe::Error;
use common::moe::assert_close;
use common::routing::topk_ids;
use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The 16-bit activation types, as the test sees them.
trait Act: MoeElement + Copy + std::fmt::Debug {
    const NAME: &'static str;
    /// A quiet NaN no kernel computes (CUDA's own NaNs are 0x7FFF).
    const POISON: u16;
    /// Significand bits below the leading one (ulp = 2^(exponent - MANTISSA)).
    const MANTISSA: i32;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn bits(self) -> u16;
    fn from_bits(b: u16) -> Self;
}

impl Act for bf16 {
    const NAME: &'static str = "bf16";
    const POISON: u16 = 0x7FC0;
    const MANTISSA: i32 = 7;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(b: u16) -> Self {
        bf16::from_bits(b)
    }
}

impl Act for f16 {
    const NAME: &'static str = "f16";
    const POISON: u16 = 0x7E01;
    const MANTISSA: i32 = 10;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(b: u16) -> Self {
        f16::from_bits(b)
    }
}

/// One ulp of `T` at `v` (the subnormal spacing for tiny values).
fn ulp<T: Act>(v: f64) -> f64 {
    let min_exp = if T::MANTISSA == 7 { -126 } else { -14 };
    let exp = if v == 0.0 { min_exp } else { (v.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(exp - T::MANTISSA)
}

/// Distance in ulps between two finite 16-bit floats of one format (signs handled).
fn ulps_apart(a: u16, b: u16) -> u32 {
    let ordered = |x: u16| if x & 0x8000 != 0 { -((x & 0x7FFF) as i32) } else { x as i32 };
    ordered(a).abs_diff(ordered(b))
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    e: usize,
    h: usize,
    f: usize,
    k: usize,
    t_max: usize,
    capacity: Option<usize>,
}

impl Shape {
    fn routing(&self, dtype: DType) -> RoutingConfig {
        RoutingConfig {
            num_experts: self.e,
            hidden: self.h,
            ffn: self.f,
            topk: self.k,
            max_tokens: self.t_max,
            capacity: self.capacity,
            expert_capacity: None,
            dtype,
            prob_dtype: DType::F32,
        }
    }
}

/// One launch's inputs on the host: routes, T, and drows / h of every row (rows at or past
/// offsets[E] hold NaN: a kernel that mixed them into a stored row would show it).
struct Inputs<T> {
    t: usize,
    ids: Vec<i32>,
    drows: Vec<T>,
    h: Vec<T>,
    maps: routing::reference::RouteMaps,
}

/// Both paths of one shape, with every buffer allocated once.
struct Runner<T: Act> {
    shape: Shape,
    plan: RoutingPlan,
    fused: FusedSwigluDgrad,
    fc2_dgrad: GroupedGemm,
    maps: RouteMaps,
    gemm_flags: CudaSlice<i32>,
    workspace: CudaSlice<u8>,
    w2: CudaSlice<T>,
    ids: CudaSlice<i32>,
    tokens: CudaSlice<i32>,
    drows: CudaSlice<T>,
    h: CudaSlice<T>,
    dact_fused: CudaSlice<T>,
    dh_fused: CudaSlice<T>,
    dh_fused_no_dact: CudaSlice<T>,
    dact_unfused: CudaSlice<T>,
    dh_unfused: CudaSlice<T>,
}

/// Outputs of both paths, downloaded.
struct Outputs<T> {
    dact_fused: Vec<T>,
    dh_fused: Vec<T>,
    dh_fused_no_dact: Vec<T>,
    dact_unfused: Vec<T>,
    dh_unfused: Vec<T>,
    offsets: Vec<i64>,
}

impl<T: Act> Runner<T> {
    fn new(stream: &Arc<CudaStream>, shape: Shape, w2: &[T]) -> Runner<T> {
        let plan = RoutingPlan::new(shape.routing(<T as routing::Element>::DTYPE)).unwrap();
        let cap = plan.capacity();
        let fused = FusedSwigluDgrad::new(&plan, stream).unwrap();
        let spec = GroupedGemmSpec::new(GemmOp::Dgrad, shape.e, shape.h, shape.f, cap)
            .with_dtype(<T as routing::Element>::DTYPE);
        let fc2_dgrad = GroupedGemm::new(spec, stream).unwrap();
        let zeros = |n: usize| stream.alloc_zeros::<T>(n.max(1)).unwrap();
        Runner {
            maps: plan.alloc_maps(stream).unwrap(),
            gemm_flags: stream.alloc_zeros(1).unwrap(),
            workspace: stream.alloc_zeros(fc2_dgrad.workspace_bytes().max(1)).unwrap(),
            w2: stream.clone_htod(w2).unwrap(),
            ids: stream.alloc_zeros(shape.t_max * shape.k).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            drows: zeros(cap * shape.h),
            h: zeros(cap * 2 * shape.f),
            dact_fused: zeros(cap * shape.f),
            dh_fused: zeros(cap * 2 * shape.f),
            dh_fused_no_dact: zeros(cap * 2 * shape.f),
            dact_unfused: zeros(cap * shape.f),
            dh_unfused: zeros(cap * 2 * shape.f),
            shape,
            plan,
            fused,
            fc2_dgrad,
        }
    }

    fn capacity(&self) -> usize {
        self.plan.capacity()
    }

    fn load(&mut self, stream: &Arc<CudaStream>, inputs: &Inputs<T>) {
        stream.memcpy_htod(&inputs.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&[inputs.t as i32], &mut self.tokens).unwrap();
        stream.memcpy_htod(&inputs.drows, &mut self.drows).unwrap();
        stream.memcpy_htod(&inputs.h, &mut self.h).unwrap();
    }

    /// Poisons every output.
    fn poison(&mut self, stream: &Arc<CudaStream>) {
        for buf in [
            &mut self.dact_fused,
            &mut self.dh_fused,
            &mut self.dh_fused_no_dact,
            &mut self.dact_unfused,
            &mut self.dh_unfused,
        ] {
            let poison = vec![T::from_bits(T::POISON); buf.len()];
            stream.memcpy_htod(&poison, buf).unwrap();
        }
    }

    /// Routing build with the device token count, then the fused kernel writing dh and dact.
    fn fused(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.plan.build(stream, &self.ids, Tokens::Device(&self.tokens), &mut self.maps)?;
        let offsets = &self.maps.offsets;
        self.fused.run(stream, &self.drows, &self.w2, &self.h, offsets, &mut self.dh_fused, Some(&mut self.dact_fused))
    }

    /// The fused kernel again on the same maps, without the dact output.
    fn fused_no_dact(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let offsets = &self.maps.offsets;
        self.fused.run(
            stream,
            &self.drows,
            &self.w2,
            &self.h,
            offsets,
            &mut self.dh_fused_no_dact,
            None::<&mut CudaSlice<T>>,
        )
    }

    /// fc2 dgrad grouped GEMM -> SwiGLU backward, on the maps of the last build.
    fn unfused(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let m = &self.maps;
        self.fc2_dgrad.run(
            stream,
            &self.drows,
            &self.w2,
            &mut self.dact_unfused,
            &m.m_splits_i32,
            Some(&mut self.gemm_flags),
            &mut self.workspace,
        )?;
        self.plan.swiglu_backward(stream, &self.dact_unfused, &self.h, &m.offsets, &mut self.dh_unfused)
    }

    fn read(&self, stream: &Arc<CudaStream>) -> Outputs<T> {
        Outputs {
            dact_fused: stream.clone_dtoh(&self.dact_fused).unwrap(),
            dh_fused: stream.clone_dtoh(&self.dh_fused).unwrap(),
            dh_fused_no_dact: stream.clone_dtoh(&self.dh_fused_no_dact).unwrap(),
            dact_unfused: stream.clone_dtoh(&self.dact_unfused).unwrap(),
            dh_unfused: stream.clone_dtoh(&self.dh_unfused).unwrap(),
            offsets: stream.clone_dtoh(&self.maps.offsets).unwrap(),
        }
    }
}

fn random<T: Act>(rng: &mut StdRng, n: usize, scale: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.random_range(-1.0..1.0) * scale)).collect()
}

fn weights<T: Act>(shape: Shape, seed: u64) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    random(&mut rng, shape.e * shape.h * shape.f, 1.0 / (shape.h as f64).sqrt())
}

/// Inputs for `ids` at T = `t`: the CPU routing reference gives offsets[E]; rows below it get
/// random drows and h (g in [-4, 4]: both sigmoid tails), rows at or past it NaN.
fn inputs<T: Act>(shape: Shape, capacity: usize, rng: &mut StdRng, t: usize, ids: Vec<i32>) -> Inputs<T> {
    let maps = routing::reference::build(&ids, t, shape.t_max, shape.e, shape.k, capacity, 0);
    let total = maps.offsets[shape.e] as usize;
    let nan = T::from_f64(f64::NAN);
    let mut drows: Vec<T> = random(rng, capacity * shape.h, 1.0);
    let mut h: Vec<T> = random(rng, capacity * 2 * shape.f, 4.0);
    drows[total * shape.h..].fill(nan);
    h[total * 2 * shape.f..].fill(nan);
    Inputs { t, ids, drows, h, maps }
}

/// Routes with everything the routing allows: duplicates within a token, empty slots (-1),
/// out-of-range ids (dropped), a heavy expert, and experts that get nothing.
fn messy_ids(rng: &mut StdRng, shape: Shape) -> Vec<i32> {
    (0..shape.t_max * shape.k)
        .map(|_| match rng.random_range(0..20) {
            0 => -1,
            1 => shape.e as i32 + rng.random_range(0..3),
            2 => -7,
            3..=6 => 0, // a heavy expert
            // Only even experts otherwise: the odd ones stay empty.
            _ => 2 * rng.random_range(0..shape.e as i32 / 2),
        })
        .collect()
}

/// What the fp64 reference reads: the clamped offsets, drows, h and w2.
struct RefInputs<'a, T> {
    offsets: &'a [i64],
    drows: &'a [T],
    h: &'a [T],
    w2: &'a [T],
}

/// Elementwise and normwise checks of rows `rows` of the fused outputs `dact`, `dh` against
/// fp64.
fn check_reference<T: Act>(
    what: &str,
    shape: Shape,
    inp: &RefInputs<'_, T>,
    dact_out: &[T],
    dh_out: &[T],
    rows: &[usize],
) {
    let (hd, f) = (shape.h, shape.f);
    let w2 = inp.w2;
    let accumulation_bound = 4.0 * hd as f64 * 2f64.powi(-24);
    let (mut dh_got, mut dh_want) = (Vec::new(), Vec::new());
    for &r in rows {
        let e = (0..shape.e).rfind(|&e| inp.offsets[e] as usize <= r).unwrap();
        let drow: Vec<f64> = inp.drows[r * hd..(r + 1) * hd].iter().map(|v| v.to_f64()).collect();
        for c in 0..f {
            let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
            for (j, d) in drow.iter().enumerate() {
                let term = d * w2[(e * hd + j) * f + c].to_f64();
                sum += term;
                magnitude += term.abs();
            }
            let dact = dact_out[r * f + c].to_f64();
            let allowed = ulp::<T>(sum) + accumulation_bound * magnitude;
            assert!(
                (dact - sum).abs() <= allowed,
                "{what}: dact[{r}, {c}] (expert {e}) = {dact}, fp64 {sum} (allowed error {allowed:.3e})"
            );
            let g = inp.h[r * 2 * f + c].to_f64();
            let u = inp.h[r * 2 * f + f + c].to_f64();
            let s = 1.0 / (1.0 + (-g).exp());
            // fp64 SwiGLU backward of the kernel's own (rounded) dact, and of the fp64 one.
            let backward = |d: f64| (d * u * s * (1.0 + g * (1.0 - s)), d * g * s);
            let (dg, du) = backward(dact);
            let fp32_error = 1e-5 * dact.abs() * (u.abs() * (1.0 + g.abs()) + g.abs());
            for (col, want) in [(c, dg), (f + c, du)] {
                let got = dh_out[r * 2 * f + col].to_f64();
                let allowed = ulp::<T>(want) + fp32_error;
                assert!(
                    (got - want).abs() <= allowed,
                    "{what}: dh[{r}, {col}] = {got}, fp64 from the kernel's dact {dact}: {want} (g {g}, u {u})"
                );
            }
            let (dg64, du64) = backward(T::from_f64(sum).to_f64());
            dh_want.extend([dg64, du64]);
            dh_got.extend([dh_out[r * 2 * f + c].to_f64(), dh_out[r * 2 * f + f + c].to_f64()]);
        }
    }
    assert_close(&format!("{what}: dh vs the all-fp64 pipeline"), &dh_got, &dh_want, 1e-2);
}

/// Rows `[0, total)` written (no poison, no NaN), rows past it still the poison bit for bit.
fn assert_rows_written<T: Act>(what: &str, got: &[T], width: usize, total: usize) {
    let written = total * width;
    if let Some(i) = (0..written).find(|&i| !got[i].to_f64().is_finite()) {
        panic!("{what}: element {i} (row {}) of the {total} stored rows is {:?}", i / width, got[i]);
    }
    if let Some(i) = (written..got.len()).find(|&i| got[i].bits() != T::POISON) {
        panic!("{what}: element {i} (row {}) at or past offsets[E] = {total} was written", i / width);
    }
}

/// How the fused outputs compare with the unfused path's, bit for bit (reported only).
fn report_bitwise<T: Act>(what: &str, name: &str, got: &[T], want: &[T], n: usize) -> usize {
    let diffs: Vec<usize> = (0..n).filter(|&i| got[i].bits() != want[i].bits()).collect();
    let worst = diffs.iter().map(|&i| ulps_apart(got[i].bits(), want[i].bits())).max().unwrap_or(0);
    println!("{what}: bitwise vs unfused: {name}: {} of {n} elements differ (largest {worst} ulps)", diffs.len());
    diffs.len()
}

/// Runs both paths and checks one case (module docs); `sample` rows for the fp64 reference
/// (every row when `None`). Returns the count of dh elements that differ from the unfused path.
fn check_case<T: Act>(
    what: &str,
    stream: &Arc<CudaStream>,
    runner: &mut Runner<T>,
    inputs: &Inputs<T>,
    w2: &[T],
    sample: Option<usize>,
) -> usize {
    let s = runner.shape;
    runner.load(stream, inputs);
    runner.poison(stream);
    runner.fused(stream).unwrap();
    runner.fused_no_dact(stream).unwrap();
    runner.unfused(stream).unwrap();
    let out = runner.read(stream);
    assert_eq!(out.offsets, inputs.maps.offsets, "{what}: offsets");
    let total = inputs.maps.offsets[s.e] as usize;

    assert_rows_written(&format!("{what}: fused dh"), &out.dh_fused, 2 * s.f, total);
    assert_rows_written(&format!("{what}: fused dact"), &out.dact_fused, s.f, total);
    assert_rows_written(&format!("{what}: unfused dh"), &out.dh_unfused, 2 * s.f, total);
    let same = out.dh_fused.iter().zip(&out.dh_fused_no_dact).all(|(a, b)| a.bits() == b.bits());
    assert!(same, "{what}: dh without the dact output differs from dh with it");

    let rows: Vec<usize> = match sample {
        None => (0..total).collect(),
        // Rows spread over the whole range plus both ends and the first tile boundary.
        Some(n) => {
            let last = total.saturating_sub(1);
            let mut r: Vec<usize> = (0..n).map(|i| i * total / n.max(1)).collect();
            r.extend([last, 127.min(last), 128.min(last)]);
            r.retain(|&v| v < total);
            r.sort_unstable();
            r.dedup();
            r
        }
    };
    if !rows.is_empty() {
        let r = RefInputs { offsets: &inputs.maps.offsets, drows: &inputs.drows, h: &inputs.h, w2 };
        check_reference(what, s, &r, &out.dact_fused, &out.dh_fused, &rows);
    }
    report_bitwise(what, "dact", &out.dact_fused, &out.dact_unfused, total * s.f);
    report_bitwise(what, "dh", &out.dh_fused, &out.dh_unfused, total * 2 * s.f)
}

fn messy_routing<T: Act>() {
    let stream = gpu_or_skip!();
    // H = 200: the last K block is partial (TMA zero-fills columns past H in drows and W2).
    let shape = Shape { e: 8, h: 200, f: 256, k: 3, t_max: 300, capacity: None };
    let w2 = weights::<T>(shape, 1);
    let mut runner = Runner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(2);
    for (i, t) in [300usize, 0, 1, 137, 299].into_iter().enumerate() {
        let ids = messy_ids(&mut rng, shape);
        let inp = inputs(shape, runner.capacity(), &mut rng, t, ids);
        check_case(&format!("{}: messy case {i} (T={t})", T::NAME), &stream, &mut runner, &inp, &w2, None);
    }
}

#[test]
fn fused_dgrad_messy_routing_bf16() {
    messy_routing::<bf16>();
}

#[test]
fn fused_dgrad_messy_routing_f16() {
    messy_routing::<f16>();
}

fn one_expert_takes_every_route<T: Act>() {
    let stream = gpu_or_skip!();
    let shape = Shape { e: 16, h: 256, f: 128, k: 4, t_max: 200, capacity: None };
    let w2 = weights::<T>(shape, 3);
    let mut runner = Runner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(4);
    for expert in [0i32, 15] {
        // k duplicates of one expert per token: 800 rows, 7 M tiles, the last one partial; the
        // last expert's last tile reads drows rows past capacity (zero-filled by TMA).
        let inp = inputs(shape, runner.capacity(), &mut rng, 200, vec![expert; 200 * 4]);
        let what = format!("{}: all routes to expert {expert}", T::NAME);
        check_case(&what, &stream, &mut runner, &inp, &w2, None);
    }
}

#[test]
fn fused_dgrad_one_expert_takes_every_route_bf16() {
    one_expert_takes_every_route::<bf16>();
}

#[test]
fn fused_dgrad_one_expert_takes_every_route_f16() {
    one_expert_takes_every_route::<f16>();
}

fn capacity_clamps_the_offsets<T: Act>() {
    let stream = gpu_or_skip!();
    // 512 routes into capacity 300: the offsets are clamped, the last kept expert ends at row
    // 300 mid-tile, and its tile's drows rows past 300 are outside the TMA map.
    let shape = Shape { e: 4, h: 136, f: 128, k: 2, t_max: 256, capacity: Some(300) };
    let w2 = weights::<T>(shape, 5);
    let mut runner = Runner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(6);
    for i in 0..3 {
        let ids = topk_ids(&mut rng, 256, 4, 2);
        let inp = inputs(shape, runner.capacity(), &mut rng, 256, ids);
        assert_eq!(inp.maps.offsets[4], 300, "the case must overflow capacity");
        check_case(
            &format!("{}: capacity 300 of 512 routes, case {i}", T::NAME),
            &stream,
            &mut runner,
            &inp,
            &w2,
            None,
        );
    }
}

#[test]
fn fused_dgrad_capacity_clamps_the_offsets_bf16() {
    capacity_clamps_the_offsets::<bf16>();
}

#[test]
fn fused_dgrad_capacity_clamps_the_offsets_f16() {
    capacity_clamps_the_offsets::<f16>();
}

fn clamps_offsets_past_capacity<T: Act>() {
    let stream = gpu_or_skip!();
    // Offsets written by hand, not by a routing build: a negative start, an empty expert, and
    // an end far past capacity 300. The kernel clamps each into [0, 300]: experts own
    // [0, 0), [0, 120), [120, 250), [250, 300). dh and dact are 40 rows longer than capacity
    // and poisoned: nothing may be written past row 300.
    let shape = Shape { e: 4, h: 128, f: 256, k: 2, t_max: 150, capacity: Some(300) };
    let plan = RoutingPlan::new(shape.routing(<T as routing::Element>::DTYPE)).unwrap();
    let cap = plan.capacity();
    assert_eq!(cap, 300);
    let fused = FusedSwigluDgrad::new(&plan, &stream).unwrap();
    let w2 = weights::<T>(shape, 13);
    let mut rng = StdRng::seed_from_u64(14);
    let drows: Vec<T> = random(&mut rng, cap * shape.h, 1.0);
    let h: Vec<T> = random(&mut rng, cap * 2 * shape.f, 4.0);
    let raw_offsets = [-5i64, 0, 120, 250, 10_000];
    let clamped: Vec<i64> = raw_offsets.iter().map(|&o| o.clamp(0, cap as i64)).collect();
    let extra = 40;
    let poison = |n: usize| vec![T::from_bits(T::POISON); n];
    let mut dh = stream.clone_htod(&poison((cap + extra) * 2 * shape.f)).unwrap();
    let mut dact = stream.clone_htod(&poison((cap + extra) * shape.f)).unwrap();
    let (w2_d, drows_d, h_d) =
        (stream.clone_htod(&w2).unwrap(), stream.clone_htod(&drows).unwrap(), stream.clone_htod(&h).unwrap());
    let offsets_d = stream.clone_htod(&raw_offsets).unwrap();
    fused.run(&stream, &drows_d, &w2_d, &h_d, &offsets_d, &mut dh, Some(&mut dact)).unwrap();
    let (dh, dact) = (stream.clone_dtoh(&dh).unwrap(), stream.clone_dtoh(&dact).unwrap());
    let what = format!("{}: offsets {raw_offsets:?} clamped to capacity {cap}", T::NAME);
    assert_rows_written(&format!("{what}: dh"), &dh, 2 * shape.f, cap);
    assert_rows_written(&format!("{what}: dact"), &dact, shape.f, cap);
    let rows: Vec<usize> = (0..cap).collect();
    let r = RefInputs { offsets: &clamped, drows: &drows, h: &h, w2: &w2 };
    check_reference(&what, shape, &r, &dact, &dh, &rows);
}

#[test]
fn fused_dgrad_clamps_offsets_past_capacity_bf16() {
    clamps_offsets_past_capacity::<bf16>();
}

#[test]
fn fused_dgrad_clamps_offsets_past_capacity_f16() {
    clamps_offsets_past_capacity::<f16>();
}

#[test]
fn fused_dgrad_model_shapes() {
    let stream = gpu_or_skip!();
    // E128 H2048 F768 k8 (the benchmark's training shape) and decode E64 H2048 F1408 k8.
    let mut differing = 0;
    // Under a sanitizer (10-100x slower) only the decode shape runs.
    let skip_large = common::under_sanitizer();
    for (name, shape, t) in [
        ("E128 H2048 F768 k8 T4096", Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None }, 4096),
        (
            "E128 H2048 F768 k8 T4000 of 4096",
            Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None },
            4000,
        ),
        ("E64 H2048 F1408 k8 T128", Shape { e: 64, h: 2048, f: 1408, k: 8, t_max: 128, capacity: None }, 128),
    ] {
        if skip_large && shape.t_max > 128 {
            println!("bf16: {name}: skipped under the sanitizer");
            continue;
        }
        let start = Instant::now();
        let w2 = weights::<bf16>(shape, 7);
        let mut runner = Runner::new(&stream, shape, &w2);
        let mut rng = StdRng::seed_from_u64(8);
        let ids = topk_ids(&mut rng, shape.t_max, shape.e, shape.k);
        let inp = inputs(shape, runner.capacity(), &mut rng, t, ids);
        differing += check_case(&format!("bf16: {name}"), &stream, &mut runner, &inp, &w2, Some(48));
        println!("bf16: {name}: checked in {:.1} s", start.elapsed().as_secs_f64());
    }
    println!("fused_dgrad_model_shapes: {differing} dh elements differ from the unfused path in all");
}

/// Capture routing build + fused kernel once; replay with fresh routing, drows, h and T
/// written between replays. Every replay equals an eager run bit for bit (the eager runner
/// is checked against fp64 by check_case).
#[test]
fn fused_dgrad_graph_replays_match_eager() {
    let stream = gpu_or_skip!();
    let _lock = common::CAPTURE_LOCK.lock().unwrap();
    let shape = Shape { e: 8, h: 192, f: 256, k: 2, t_max: 160, capacity: None };
    let w2 = weights::<bf16>(shape, 9);
    let mut graph_runner = Runner::new(&stream, shape, &w2);
    let mut eager = Runner::new(&stream, shape, &w2);
    let cap = eager.capacity();
    let mut rng = StdRng::seed_from_u64(10);
    let first_ids = messy_ids(&mut rng, shape);
    let first = inputs::<bf16>(shape, cap, &mut rng, 100, first_ids);
    graph_runner.load(&stream, &first);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_runner.fused(&stream)).unwrap();
    let replays = if common::under_sanitizer() { 8 } else { 40 };
    for i in 0..replays {
        let t = match i % 5 {
            0 => 0,
            1 => shape.t_max,
            _ => rng.random_range(1..=shape.t_max),
        };
        let ids = if i % 7 == 3 { vec![5; shape.t_max * shape.k] } else { messy_ids(&mut rng, shape) };
        let inp = inputs::<bf16>(shape, cap, &mut rng, t, ids);
        graph_runner.load(&stream, &inp);
        graph_runner.poison(&stream);
        graph.launch().unwrap();
        let what = format!("replay {i} (T={t})");
        check_case(&what, &stream, &mut eager, &inp, &w2, Some(8));
        let g = graph_runner.read(&stream);
        let e = eager.read(&stream);
        assert_eq!(g.offsets, e.offsets, "{what}: offsets");
        let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        common::moe::assert_bits(&format!("{what}: graph dh vs eager"), &bits(&g.dh_fused), &bits(&e.dh_fused));
        common::moe::assert_bits(&format!("{what}: graph dact vs eager"), &bits(&g.dact_fused), &bits(&e.dact_fused));
    }
}

#[test]
fn fused_dgrad_refuses_what_it_does_not_take() {
    let stream = gpu_or_skip!();
    let shape = Shape { e: 4, h: 128, f: 96, k: 2, t_max: 16, capacity: None };
    let plan = RoutingPlan::new(shape.routing(DType::Bf16)).unwrap();
    let r = FusedSwigluDgrad::new(&plan, &stream);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "F = 96 is not a multiple of 128: {r:?}");
    // Wrong lengths and element types are errors before any launch.
    let shape = Shape { e: 4, h: 128, f: 128, k: 2, t_max: 16, capacity: None };
    let plan = RoutingPlan::new(shape.routing(DType::Bf16)).unwrap();
    let fused = FusedSwigluDgrad::new(&plan, &stream).unwrap();
    let maps = plan.alloc_maps(&stream).unwrap();
    let cap = plan.capacity();
    let drows = stream.alloc_zeros::<bf16>(cap * 128).unwrap();
    let h = stream.alloc_zeros::<bf16>(cap * 256).unwrap();
    let short_w2 = stream.alloc_zeros::<bf16>(4 * 128 * 128 - 1).unwrap();
    let mut dh = stream.alloc_zeros::<bf16>(cap * 256).unwrap();
    let none = None::<&mut CudaSlice<bf16>>;
    let r = fused.run(&stream, &drows, &short_w2, &h, &maps.offsets, &mut dh, none);
    assert!(matches!(r, Err(Error::Shape { .. })), "short w2: {r:?}");
    let w2_f16 = stream.alloc_zeros::<f16>(4 * 128 * 128).unwrap();
    let (drows_f16, h_f16) =
        (stream.alloc_zeros::<f16>(cap * 128).unwrap(), stream.alloc_zeros::<f16>(cap * 256).unwrap());
    let mut dh_f16 = stream.alloc_zeros::<f16>(cap * 256).unwrap();
    let r = fused.run(&stream, &drows_f16, &w2_f16, &h_f16, &maps.offsets, &mut dh_f16, None::<&mut CudaSlice<f16>>);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "f16 buffers on a bf16 plan: {r:?}");
}

/// Timing hook (ignored by default): us per launch, graph replay, at E128 T4096 k8 H2048 F768,
/// fused fc2 dgrad + SwiGLU backward against fc2 dgrad grouped GEMM + SwiGLU backward (the
/// routing build is outside both). Run: `cargo test --release --test fused_dgrad_gpu
/// fused_dgrad_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn fused_dgrad_timing() {
    let stream = gpu_or_skip!();
    if common::skip_under_sanitizer() {
        return;
    }
    let _lock = common::CAPTURE_LOCK.lock().unwrap();
    let shape = Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None };
    let w2 = weights::<bf16>(shape, 11);
    let mut r = Runner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(12);
    let ids = topk_ids(&mut rng, shape.t_max, shape.e, shape.k);
    let inp = inputs::<bf16>(shape, r.capacity(), &mut rng, shape.t_max, ids);
    r.load(&stream, &inp);
    r.fused(&stream).unwrap(); // maps built once; the graphs below skip the build
    let fused_graph = capture(&stream, || r.fused_no_dact(&stream)).unwrap();
    let unfused_graph = capture(&stream, || r.unfused(&stream)).unwrap();
    let gemm_graph = capture(&stream, || {
        let m = &r.maps;
        r.fc2_dgrad.run(
            &stream,
            &r.drows,
            &r.w2,
            &mut r.dact_unfused,
            &m.m_splits_i32,
            Some(&mut r.gemm_flags),
            &mut r.workspace,
        )
    })
    .unwrap();
    let time = |graph: &cudarc::driver::CudaGraph| common::mean_gpu_us(&stream, 5, 50, || graph.launch().unwrap());
    let flops = 2.0 * (shape.t_max * shape.k) as f64 * (shape.f * shape.h) as f64;
    for (name, graph) in [
        ("fused fc2 dgrad + SwiGLU backward (dh only)", &fused_graph),
        ("fc2 dgrad grouped GEMM + SwiGLU backward", &unfused_graph),
        ("fc2 dgrad grouped GEMM alone", &gemm_graph),
    ] {
        let us = time(graph);
        println!(
            "fused_dgrad_timing E128 T4096 k8 H2048 F768: {name}: {us:.1} us ({:.0} TFLOP/s of fc2 dgrad)",
            flops / us * 1e-6
        );
    }
}

// ---- the gathered form: A = dy[token_of_row[r]] (zero rows for invalid tokens), dh of
// prob · dact, dprob partials from the epilogue ----
//
// Per case, every stored row (a sample at model shapes) of:
// * dh and the dprob partials against an fp64 reference of their own (fp64 GEMM, rounded to T;
//   the bound covers a 1-ulp difference of the kernel's fp32-accumulated dact);
// * both against the drows form run on the same rows permuted on the host (its dact checked
//   against fp64 by check_reference): the same dact bits, so tight bounds;
// * asserted bit for bit: the gathered form with every prob 1 equals the drows form's dh (the
//   two forms differ only in how A reaches shared memory: same MMA sequence, same sums), the
//   partials do not depend on prob, and a second launch repeats the first;
// * rows at or past offsets[E], and guard rows past capacity, still hold the poison.

/// Rows of poison past capacity in the gathered outputs (nothing may land there).
const GUARD_ROWS: usize = 3;
/// A quiet NaN no kernel computes, for the fp32 partials.
const POISON_F32: u32 = 0x7FC0_1234;

/// One gathered launch's inputs on the host.
struct GatheredInputs<T> {
    t: usize,
    ids: Vec<i32>,
    /// `[T_max, H]`; rows at or past T are NaN (no valid route reads them).
    dy: Vec<T>,
    /// `[capacity, 2F]`; rows at or past offsets[E] NaN.
    h: Vec<T>,
    /// `[capacity]` in (0, 1]; rows at or past offsets[E] NaN.
    prob: Vec<f32>,
    /// What the kernel reads: the routing build's token_of_row, with the invalid tokens of
    /// `invalid_tokens` written over some rows below offsets[E].
    token_of_row: Vec<i32>,
    maps: routing::reference::RouteMaps,
}

/// Gathered inputs for `ids` at T = `t`. With `invalid_tokens`, the first, middle and last
/// stored rows get tokens outside [0, T_max) (-1, T_max, i32::MIN): those rows must behave as
/// zero A rows.
fn gathered_inputs<T: Act>(
    shape: Shape,
    capacity: usize,
    rng: &mut StdRng,
    t: usize,
    ids: Vec<i32>,
    invalid_tokens: bool,
) -> GatheredInputs<T> {
    let maps = routing::reference::build(&ids, t, shape.t_max, shape.e, shape.k, capacity, 0);
    let total = maps.offsets[shape.e] as usize;
    let nan = T::from_f64(f64::NAN);
    let mut dy: Vec<T> = random(rng, shape.t_max * shape.h, 1.0);
    dy[t * shape.h..].fill(nan);
    let mut h: Vec<T> = random(rng, capacity * 2 * shape.f, 4.0);
    h[total * 2 * shape.f..].fill(nan);
    let prob: Vec<f32> =
        (0..capacity).map(|r| if r < total { rng.random_range(0.05f32..=1.0) } else { f32::NAN }).collect();
    let mut token_of_row = maps.token_of_row.clone();
    if invalid_tokens && total > 0 {
        for (row, token) in [(0, -1), (total / 2, shape.t_max as i32), (total - 1, i32::MIN)] {
            token_of_row[row] = token;
        }
    }
    GatheredInputs { t, ids, dy, h, prob, token_of_row, maps }
}

/// The drows form's input for the same rows: dy[token] per stored row, a zero row for an
/// invalid token, NaN rows past offsets[E].
fn permuted_dy<T: Act>(shape: Shape, capacity: usize, inp: &GatheredInputs<T>) -> Vec<T> {
    let total = inp.maps.offsets[shape.e] as usize;
    let hd = shape.h;
    let mut drows = vec![T::from_f64(f64::NAN); capacity * hd];
    for r in 0..total {
        let token = inp.token_of_row[r];
        let row = &mut drows[r * hd..(r + 1) * hd];
        if token >= 0 && (token as usize) < shape.t_max {
            row.copy_from_slice(&inp.dy[token as usize * hd..(token as usize + 1) * hd]);
        } else {
            row.fill(T::from_f64(0.0));
        }
    }
    drows
}

/// The gathered form and, for the cross-checks, the drows form on the same plan.
struct GatheredRunner<T: Act> {
    shape: Shape,
    plan: RoutingPlan,
    fused: FusedSwigluDgrad,
    maps: RouteMaps,
    w2: CudaSlice<T>,
    ids: CudaSlice<i32>,
    tokens: CudaSlice<i32>,
    dy: CudaSlice<T>,
    h: CudaSlice<T>,
    prob: CudaSlice<f32>,
    ones: CudaSlice<f32>,
    drows: CudaSlice<T>,
    dh: CudaSlice<T>,
    partials: CudaSlice<f32>,
    dh_again: CudaSlice<T>,
    partials_again: CudaSlice<f32>,
    dh_unit: CudaSlice<T>,
    partials_unit: CudaSlice<f32>,
    dh_drows: CudaSlice<T>,
    dact_drows: CudaSlice<T>,
}

/// The gathered runner's outputs, downloaded.
struct GatheredOutputs<T> {
    dh: Vec<T>,
    partials: Vec<f32>,
    dh_again: Vec<T>,
    partials_again: Vec<f32>,
    dh_unit: Vec<T>,
    partials_unit: Vec<f32>,
    dh_drows: Vec<T>,
    dact_drows: Vec<T>,
}

impl<T: Act> GatheredRunner<T> {
    fn new(stream: &Arc<CudaStream>, shape: Shape, w2: &[T]) -> GatheredRunner<T> {
        let plan = RoutingPlan::new(shape.routing(<T as routing::Element>::DTYPE)).unwrap();
        let cap = plan.capacity();
        let fused = FusedSwigluDgrad::new(&plan, stream).unwrap();
        let slices = fused.dprob_slices();
        assert_eq!(slices, shape.f / 128, "dprob_slices");
        let zeros = |n: usize| stream.alloc_zeros::<T>(n.max(1)).unwrap();
        let zeros_f32 = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).unwrap();
        let dh_len = (cap + GUARD_ROWS) * 2 * shape.f;
        let partials_len = (cap + GUARD_ROWS) * slices;
        GatheredRunner {
            maps: plan.alloc_maps(stream).unwrap(),
            w2: stream.clone_htod(w2).unwrap(),
            ids: stream.alloc_zeros(shape.t_max * shape.k).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            dy: zeros(shape.t_max * shape.h),
            h: zeros(cap * 2 * shape.f),
            prob: zeros_f32(cap),
            ones: stream.clone_htod(&vec![1.0f32; cap.max(1)]).unwrap(),
            drows: zeros(cap * shape.h),
            dh: zeros(dh_len),
            partials: zeros_f32(partials_len),
            dh_again: zeros(dh_len),
            partials_again: zeros_f32(partials_len),
            dh_unit: zeros(dh_len),
            partials_unit: zeros_f32(partials_len),
            dh_drows: zeros(cap * 2 * shape.f),
            dact_drows: zeros(cap * shape.f),
            shape,
            plan,
            fused,
        }
    }

    fn capacity(&self) -> usize {
        self.plan.capacity()
    }

    /// Inputs of the routing build and of the kernels (token_of_row comes from the build).
    fn load(&mut self, stream: &Arc<CudaStream>, inp: &GatheredInputs<T>) {
        stream.memcpy_htod(&inp.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&[inp.t as i32], &mut self.tokens).unwrap();
        stream.memcpy_htod(&inp.dy, &mut self.dy).unwrap();
        stream.memcpy_htod(&inp.h, &mut self.h).unwrap();
        stream.memcpy_htod(&inp.prob, &mut self.prob).unwrap();
        let drows = permuted_dy(self.shape, self.capacity(), inp);
        stream.memcpy_htod(&drows, &mut self.drows).unwrap();
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) {
        for buf in [&mut self.dh, &mut self.dh_again, &mut self.dh_unit, &mut self.dh_drows, &mut self.dact_drows] {
            stream.memcpy_htod(&vec![T::from_bits(T::POISON); buf.len()], buf).unwrap();
        }
        for buf in [&mut self.partials, &mut self.partials_again, &mut self.partials_unit] {
            stream.memcpy_htod(&vec![f32::from_bits(POISON_F32); buf.len()], buf).unwrap();
        }
    }

    fn build(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.plan.build(stream, &self.ids, Tokens::Device(&self.tokens), &mut self.maps)
    }

    /// The gathered form on the maps of the last build, into dh / partials.
    fn gathered(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let m = &self.maps;
        self.fused.run_gathered(
            stream,
            &self.dy,
            &self.w2,
            &self.h,
            &m.offsets,
            &m.token_of_row,
            &self.prob,
            &mut self.dh,
            &mut self.partials,
        )
    }

    /// Build + gathered form: what a backward captures.
    fn build_and_gathered(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.build(stream)?;
        self.gathered(stream)
    }

    /// The second launch, the prob = 1 launch and the drows form, on the same maps.
    fn cross_checks(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let m = &self.maps;
        let (dy, w2, h) = (&self.dy, &self.w2, &self.h);
        self.fused.run_gathered(
            stream,
            dy,
            w2,
            h,
            &m.offsets,
            &m.token_of_row,
            &self.prob,
            &mut self.dh_again,
            &mut self.partials_again,
        )?;
        self.fused.run_gathered(
            stream,
            dy,
            w2,
            h,
            &m.offsets,
            &m.token_of_row,
            &self.ones,
            &mut self.dh_unit,
            &mut self.partials_unit,
        )?;
        self.fused.run(stream, &self.drows, w2, h, &m.offsets, &mut self.dh_drows, Some(&mut self.dact_drows))
    }

    fn read(&self, stream: &Arc<CudaStream>) -> GatheredOutputs<T> {
        GatheredOutputs {
            dh: stream.clone_dtoh(&self.dh).unwrap(),
            partials: stream.clone_dtoh(&self.partials).unwrap(),
            dh_again: stream.clone_dtoh(&self.dh_again).unwrap(),
            partials_again: stream.clone_dtoh(&self.partials_again).unwrap(),
            dh_unit: stream.clone_dtoh(&self.dh_unit).unwrap(),
            partials_unit: stream.clone_dtoh(&self.partials_unit).unwrap(),
            dh_drows: stream.clone_dtoh(&self.dh_drows).unwrap(),
            dact_drows: stream.clone_dtoh(&self.dact_drows).unwrap(),
        }
    }
}

/// Partials of rows `[0, total)` written (finite), every element past them (guard rows
/// included) still the poison bit for bit.
fn assert_partials_written(what: &str, got: &[f32], slices: usize, total: usize) {
    let written = total * slices;
    if let Some(i) = (0..written).find(|&i| !got[i].is_finite()) {
        panic!("{what}: partial {i} (row {}) of the {total} stored rows is {}", i / slices, got[i]);
    }
    if let Some(i) = (written..got.len()).find(|&i| got[i].to_bits() != POISON_F32) {
        panic!("{what}: partial {i} (row {}) at or past offsets[E] = {total} was written", i / slices);
    }
}

/// The dact a reference uses for row `r`, column `c`: its value and how far the kernel's may
/// be from it.
type DactOf<'a> = &'a dyn Fn(usize, usize) -> (f64, f64);

/// dh and the partials of rows `rows` against fp64 built on `dact_of`: dh = the SwiGLU
/// backward of (fp32(p · dact), g, u), partial = Σ dact · SwiGLU(g, u) per 128-column slice.
/// Bounds: 1 ulp of T and the fp32 math's error, plus the reference dact's uncertainty times
/// the output's sensitivity to it.
#[allow(clippy::too_many_arguments)]
fn check_gathered_rows<T: Act>(
    what: &str,
    shape: Shape,
    inp: &GatheredInputs<T>,
    rows: &[usize],
    dh_out: &[T],
    partials_out: &[f32],
    dact_of: DactOf<'_>,
) {
    let f = shape.f;
    let slices = f / 128;
    for &r in rows {
        let p = inp.prob[r];
        for j in 0..slices {
            let (mut want, mut magnitude, mut uncertainty) = (0.0f64, 0.0f64, 0.0f64);
            for c in j * 128..(j + 1) * 128 {
                let (dact, dact_error) = dact_of(r, c);
                let g = inp.h[r * 2 * f + c].to_f64();
                let u = inp.h[r * 2 * f + f + c].to_f64();
                let s = 1.0 / (1.0 + (-g).exp());
                let act = g * s * u;
                want += dact * act;
                magnitude += (dact * act).abs();
                uncertainty += dact_error * act.abs();
                // The kernel scales the rounded dact by p in fp32.
                let ds = (p * dact as f32) as f64;
                let slope = 1.0 + g * (1.0 - s);
                let fp32_error = 1e-5 * ds.abs() * (u.abs() * (1.0 + g.abs()) + g.abs());
                let ds_error = p as f64 * dact_error;
                for (col, want, sensitivity) in
                    [(c, ds * u * s * slope, (u * s * slope).abs()), (f + c, ds * g * s, (g * s).abs())]
                {
                    let got = dh_out[r * 2 * f + col].to_f64();
                    let allowed = ulp::<T>(want) + fp32_error + sensitivity * ds_error;
                    assert!(
                        (got - want).abs() <= allowed,
                        "{what}: dh[{r}, {col}] = {got}, want {want} (allowed {allowed:.3e}; dact {dact}, p {p}, \
                         g {g}, u {u}, token {})",
                        inp.token_of_row[r]
                    );
                }
            }
            // fp32 sums of 128 products in a fixed order (sm_90a: each thread's 32, then the
            // quad's butterfly; sm_100a: each half's 64, then lower + upper) and the fp32 SwiGLU:
            // well within 2e-5 of the magnitude.
            let got = partials_out[r * slices + j] as f64;
            let allowed = 2e-5 * magnitude + uncertainty + f64::from(f32::MIN_POSITIVE);
            assert!(
                (got - want).abs() <= allowed,
                "{what}: dprob_partials[{r}, {j}] = {got}, want {want} (allowed {allowed:.3e}, token {})",
                inp.token_of_row[r]
            );
        }
    }
}

/// Runs the gathered form and its cross-checks on one case and checks everything listed above
/// (`sample` rows for the references; every row when `None`).
fn check_gathered_case<T: Act>(
    what: &str,
    stream: &Arc<CudaStream>,
    runner: &mut GatheredRunner<T>,
    inp: &GatheredInputs<T>,
    w2: &[T],
    sample: Option<usize>,
) {
    let s = runner.shape;
    let cap = runner.capacity();
    let slices = s.f / 128;
    runner.load(stream, inp);
    runner.poison(stream);
    runner.build(stream).unwrap();
    assert_eq!(stream.clone_dtoh(&runner.maps.offsets).unwrap(), inp.maps.offsets, "{what}: offsets");
    let built = stream.clone_dtoh(&runner.maps.token_of_row).unwrap();
    assert_eq!(built, inp.maps.token_of_row, "{what}: token_of_row");
    // The case's invalid tokens, written over the build's.
    stream.memcpy_htod(&inp.token_of_row, &mut runner.maps.token_of_row).unwrap();
    runner.gathered(stream).unwrap();
    runner.cross_checks(stream).unwrap();
    let out = runner.read(stream);
    let total = inp.maps.offsets[s.e] as usize;

    assert_rows_written(&format!("{what}: gathered dh"), &out.dh, 2 * s.f, total);
    assert_partials_written(&format!("{what}: gathered dprob partials"), &out.partials, slices, total);
    let bits = |v: &[T]| v.iter().map(|b| b.bits()).collect::<Vec<_>>();
    let fbits = |v: &[f32]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    common::moe::assert_bits(&format!("{what}: second launch dh"), &bits(&out.dh_again), &bits(&out.dh));
    common::moe::assert_bits(
        &format!("{what}: second launch partials"),
        &fbits(&out.partials_again),
        &fbits(&out.partials),
    );
    common::moe::assert_bits(
        &format!("{what}: partials with prob 1 vs with prob"),
        &fbits(&out.partials_unit),
        &fbits(&out.partials),
    );
    // Same dact bits in both forms (the same MMA sums of the same rows): with p = 1 the
    // gathered dh is the drows form's.
    let n = cap * 2 * s.f;
    common::moe::assert_bits(
        &format!("{what}: gathered dh with prob 1 vs the drows form"),
        &bits(&out.dh_unit[..n]),
        &bits(&out.dh_drows),
    );

    let rows: Vec<usize> = match sample {
        None => (0..total).collect(),
        Some(n) => {
            let last = total.saturating_sub(1);
            let mut r: Vec<usize> = (0..n).map(|i| i * total / n.max(1)).collect();
            r.extend([last, 127.min(last), 128.min(last), total / 2]);
            r.retain(|&v| v < total);
            r.sort_unstable();
            r.dedup();
            r
        }
    };
    if rows.is_empty() {
        return;
    }
    // The drows form's dact against fp64 (check_reference), then the gathered outputs against
    // that dact: tight.
    let drows = permuted_dy(s, cap, inp);
    let r = RefInputs { offsets: &inp.maps.offsets, drows: &drows, h: &inp.h, w2 };
    check_reference(&format!("{what}: drows form"), s, &r, &out.dact_drows, &out.dh_drows, &rows);
    let dact = &out.dact_drows;
    let from_dact = |r: usize, c: usize| (dact[r * s.f + c].to_f64(), 0.0);
    check_gathered_rows(
        &format!("{what}: vs the drows form's dact"),
        s,
        inp,
        &rows,
        &out.dh,
        &out.partials,
        &from_dact,
    );
    // And against fp64 on its own: dact = round(Σ A · w2) with A = dy[token] or zeros; the
    // kernel's fp32 sum may round to a neighbour.
    let hd = s.h;
    let accumulation_bound = 4.0 * hd as f64 * 2f64.powi(-24);
    let offsets = &inp.maps.offsets;
    let from_fp64 = |r: usize, c: usize| {
        let e = (0..s.e).rfind(|&e| offsets[e] as usize <= r).unwrap();
        let (mut sum, mut magnitude) = (0.0f64, 0.0f64);
        for k in 0..hd {
            let term = drows[r * hd + k].to_f64() * w2[(e * hd + k) * s.f + c].to_f64();
            sum += term;
            magnitude += term.abs();
        }
        (T::from_f64(sum).to_f64(), 2.0 * (ulp::<T>(sum) + accumulation_bound * magnitude))
    };
    check_gathered_rows(&format!("{what}: vs fp64"), s, inp, &rows, &out.dh, &out.partials, &from_fp64);
}

fn gathered_messy_routing<T: Act>() {
    let stream = gpu_or_skip!();
    // H = 200: the last K block is partial (cp.async zero-fills dy's chunks past H, TMA W2's).
    let shape = Shape { e: 8, h: 200, f: 256, k: 3, t_max: 300, capacity: None };
    let w2 = weights::<T>(shape, 21);
    let mut runner = GatheredRunner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(22);
    for (i, t) in [300usize, 0, 1, 137, 299].into_iter().enumerate() {
        let ids = messy_ids(&mut rng, shape);
        let invalid = i % 2 == 0;
        let inp = gathered_inputs(shape, runner.capacity(), &mut rng, t, ids, invalid);
        let what = format!("{}: gathered messy case {i} (T={t}, invalid tokens: {invalid})", T::NAME);
        check_gathered_case(&what, &stream, &mut runner, &inp, &w2, None);
    }
}

#[test]
fn fused_dgrad_gathered_messy_routing_bf16() {
    gathered_messy_routing::<bf16>();
}

#[test]
fn fused_dgrad_gathered_messy_routing_f16() {
    gathered_messy_routing::<f16>();
}

fn gathered_one_expert_takes_every_route<T: Act>() {
    let stream = gpu_or_skip!();
    let shape = Shape { e: 16, h: 256, f: 128, k: 4, t_max: 200, capacity: None };
    let w2 = weights::<T>(shape, 23);
    let mut runner = GatheredRunner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(24);
    for expert in [0i32, 15] {
        // k duplicates of one expert per token: 800 rows, 7 M tiles, the last one partial.
        let inp = gathered_inputs(shape, runner.capacity(), &mut rng, 200, vec![expert; 200 * 4], true);
        let what = format!("{}: gathered, all routes to expert {expert}", T::NAME);
        check_gathered_case(&what, &stream, &mut runner, &inp, &w2, None);
    }
}

#[test]
fn fused_dgrad_gathered_one_expert_takes_every_route_bf16() {
    gathered_one_expert_takes_every_route::<bf16>();
}

#[test]
fn fused_dgrad_gathered_one_expert_takes_every_route_f16() {
    gathered_one_expert_takes_every_route::<f16>();
}

fn gathered_capacity_clamps_the_offsets<T: Act>() {
    let stream = gpu_or_skip!();
    // 512 routes into capacity 300: the last kept expert ends at row 300 mid-tile; the guard
    // rows past capacity must stay poisoned.
    let shape = Shape { e: 4, h: 136, f: 384, k: 2, t_max: 256, capacity: Some(300) };
    let w2 = weights::<T>(shape, 25);
    let mut runner = GatheredRunner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(26);
    for i in 0..2 {
        let ids = topk_ids(&mut rng, 256, 4, 2);
        let inp = gathered_inputs(shape, runner.capacity(), &mut rng, 256, ids, i == 1);
        assert_eq!(inp.maps.offsets[4], 300, "the case must overflow capacity");
        let what = format!("{}: gathered, capacity 300 of 512 routes, case {i}", T::NAME);
        check_gathered_case(&what, &stream, &mut runner, &inp, &w2, None);
    }
}

#[test]
fn fused_dgrad_gathered_capacity_clamps_the_offsets_bf16() {
    gathered_capacity_clamps_the_offsets::<bf16>();
}

#[test]
fn fused_dgrad_gathered_capacity_clamps_the_offsets_f16() {
    gathered_capacity_clamps_the_offsets::<f16>();
}

#[test]
fn fused_dgrad_gathered_model_shapes() {
    let stream = gpu_or_skip!();
    let skip_large = common::under_sanitizer();
    for (name, shape, t) in [
        ("E128 H2048 F768 k8 T4096", Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None }, 4096),
        ("E64 H2048 F1408 k8 T128", Shape { e: 64, h: 2048, f: 1408, k: 8, t_max: 128, capacity: None }, 128),
    ] {
        if skip_large && shape.t_max > 128 {
            println!("bf16: gathered {name}: skipped under the sanitizer");
            continue;
        }
        let start = Instant::now();
        let w2 = weights::<bf16>(shape, 27);
        let mut runner = GatheredRunner::new(&stream, shape, &w2);
        let mut rng = StdRng::seed_from_u64(28);
        let ids = topk_ids(&mut rng, shape.t_max, shape.e, shape.k);
        let inp = gathered_inputs(shape, runner.capacity(), &mut rng, t, ids, true);
        check_gathered_case(&format!("bf16: gathered {name}"), &stream, &mut runner, &inp, &w2, Some(48));
        println!("bf16: gathered {name}: checked in {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Capture routing build + gathered kernel once; replay with fresh routing, dy, h, probs and T
/// written between replays. Every replay equals an eager run bit for bit (dh and partials; the
/// eager runner is checked against the references by check_gathered_case).
#[test]
fn fused_dgrad_gathered_graph_replays_match_eager() {
    let stream = gpu_or_skip!();
    let _lock = common::CAPTURE_LOCK.lock().unwrap();
    let shape = Shape { e: 8, h: 200, f: 256, k: 2, t_max: 160, capacity: None };
    let w2 = weights::<bf16>(shape, 29);
    let mut graph_runner = GatheredRunner::new(&stream, shape, &w2);
    let mut eager = GatheredRunner::new(&stream, shape, &w2);
    let cap = eager.capacity();
    let mut rng = StdRng::seed_from_u64(30);
    let first_ids = messy_ids(&mut rng, shape);
    let first = gathered_inputs::<bf16>(shape, cap, &mut rng, 100, first_ids, false);
    graph_runner.load(&stream, &first);
    stream.synchronize().unwrap();
    let graph = capture(&stream, || graph_runner.build_and_gathered(&stream)).unwrap();
    let replays = if common::under_sanitizer() { 8 } else { 40 };
    for i in 0..replays {
        let t = match i % 5 {
            0 => 0,
            1 => shape.t_max,
            _ => rng.random_range(1..=shape.t_max),
        };
        let ids = if i % 7 == 3 { vec![5; shape.t_max * shape.k] } else { messy_ids(&mut rng, shape) };
        // No invalid tokens here: the graph's token_of_row comes from its own build.
        let inp = gathered_inputs::<bf16>(shape, cap, &mut rng, t, ids, false);
        graph_runner.load(&stream, &inp);
        graph_runner.poison(&stream);
        graph.launch().unwrap();
        let what = format!("gathered replay {i} (T={t})");
        check_gathered_case(&what, &stream, &mut eager, &inp, &w2, Some(8));
        let g = graph_runner.read(&stream);
        let e = eager.read(&stream);
        let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        let fbits = |v: &[f32]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        common::moe::assert_bits(&format!("{what}: graph dh vs eager"), &bits(&g.dh), &bits(&e.dh));
        common::moe::assert_bits(&format!("{what}: graph partials vs eager"), &fbits(&g.partials), &fbits(&e.partials));
    }
}

#[test]
fn fused_dgrad_gathered_refuses_wrong_buffers() {
    let stream = gpu_or_skip!();
    let shape = Shape { e: 4, h: 128, f: 256, k: 2, t_max: 16, capacity: None };
    let plan = RoutingPlan::new(shape.routing(DType::Bf16)).unwrap();
    let fused = FusedSwigluDgrad::new(&plan, &stream).unwrap();
    assert_eq!(fused.dprob_slices(), 2);
    let maps = plan.alloc_maps(&stream).unwrap();
    let cap = plan.capacity();
    let w2 = stream.alloc_zeros::<bf16>(4 * 128 * 256).unwrap();
    let h = stream.alloc_zeros::<bf16>(cap * 512).unwrap();
    let prob = stream.alloc_zeros::<f32>(cap).unwrap();
    let mut dh = stream.alloc_zeros::<bf16>(cap * 512).unwrap();
    let mut partials = stream.alloc_zeros::<f32>(cap * 2).unwrap();
    let short_dy = stream.alloc_zeros::<bf16>(16 * 128 - 1).unwrap();
    let (offsets, tokens) = (&maps.offsets, &maps.token_of_row);
    let r = fused.run_gathered(&stream, &short_dy, &w2, &h, offsets, tokens, &prob, &mut dh, &mut partials);
    assert!(matches!(r, Err(Error::Shape { .. })), "short dy: {r:?}");
    let dy = stream.alloc_zeros::<bf16>(16 * 128).unwrap();
    let mut short_partials = stream.alloc_zeros::<f32>(cap * 2 - 1).unwrap();
    let r = fused.run_gathered(&stream, &dy, &w2, &h, offsets, tokens, &prob, &mut dh, &mut short_partials);
    assert!(matches!(r, Err(Error::Shape { .. })), "short dprob partials: {r:?}");
    let short_prob = stream.alloc_zeros::<f32>(cap - 1).unwrap();
    let r = fused.run_gathered(&stream, &dy, &w2, &h, offsets, tokens, &short_prob, &mut dh, &mut partials);
    assert!(matches!(r, Err(Error::Shape { .. })), "short prob_of_row: {r:?}");
    let (dy16, w216, h16) = (
        stream.alloc_zeros::<f16>(16 * 128).unwrap(),
        stream.alloc_zeros::<f16>(4 * 128 * 256).unwrap(),
        stream.alloc_zeros::<f16>(cap * 512).unwrap(),
    );
    let mut dh16 = stream.alloc_zeros::<f16>(cap * 512).unwrap();
    let r = fused.run_gathered(&stream, &dy16, &w216, &h16, offsets, tokens, &prob, &mut dh16, &mut partials);
    assert!(matches!(r, Err(Error::Unsupported { .. })), "f16 buffers on a bf16 plan: {r:?}");
}

/// Timing hook (ignored by default): us per launch, graph replay, at E128 T4096 k8 H2048 F768:
/// the gathered form (dh + dprob partials) against the drows form (dh only; the drows buffer
/// it reads is not counted). Run: `cargo test --release --test fused_dgrad_gpu
/// fused_dgrad_gathered_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn fused_dgrad_gathered_timing() {
    let stream = gpu_or_skip!();
    if common::skip_under_sanitizer() {
        return;
    }
    let _lock = common::CAPTURE_LOCK.lock().unwrap();
    let shape = Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None };
    let w2 = weights::<bf16>(shape, 31);
    let mut r = GatheredRunner::new(&stream, shape, &w2);
    let mut rng = StdRng::seed_from_u64(32);
    let ids = topk_ids(&mut rng, shape.t_max, shape.e, shape.k);
    let inp = gathered_inputs::<bf16>(shape, r.capacity(), &mut rng, shape.t_max, ids, false);
    r.load(&stream, &inp);
    r.build(&stream).unwrap(); // maps built once; the graphs below skip the build
    let gathered_graph = capture(&stream, || r.gathered(&stream)).unwrap();
    let drows_graph = capture(&stream, || {
        let m = &r.maps;
        r.fused.run(&stream, &r.drows, &r.w2, &r.h, &m.offsets, &mut r.dh_drows, None::<&mut CudaSlice<bf16>>)
    })
    .unwrap();
    let flops = 2.0 * (shape.t_max * shape.k) as f64 * (shape.f * shape.h) as f64;
    for (name, graph) in [
        ("gathered fused dgrad (dy gather, dh + dprob partials)", &gathered_graph),
        ("drows fused dgrad (dh only)", &drows_graph),
    ] {
        let us = common::mean_gpu_us(&stream, 5, 50, || graph.launch().unwrap());
        println!(
            "fused_dgrad_gathered_timing E128 T4096 k8 H2048 F768: {name}: {us:.1} us ({:.0} TFLOP/s of fc2 dgrad)",
            flops / us * 1e-6
        );
    }
}
