//! The fused fc2 dgrad + SwiGLU backward (one kernel: dact = A · W2_e, then the SwiGLU backward
//! in the epilogue; the sm_90a kernel on a 9.0 device, the sm_100a one on 10.0, the same checks
//! for both) in both its forms, against an fp64 CPU reference element by element; eager against
//! CUDA-graph replay with fresh routing. bf16 and f16. One case table and one harness serve both
//! forms ([`Form`]), one `#[test]` per case and form, so that a failure of one form cannot hide
//! the other's results:
//! * `run`, the drows form: A = drows, the rows as the routing placed them;
//! * `run_gathered`, the gathered form (`fused_dgrad_gathered_*`): A = dy[token_of_row[r]] (a
//!   zero row for a token outside [0, T_max)), dh of prob · dact, and dprob partials.
//!
//! What is asserted, per launch, on every stored row (the fp64 GEMM references, marked *, on a
//! sample of rows at model shapes):
//! * the routing build's offsets and token_of_row equal the CPU reference's;
//! * the drows form's outputs (in a gathered case on dy permuted on the host, the rows the
//!   gather must read): dact* within 1 ulp of the fp64 GEMM rounded, plus a bound on fp32
//!   accumulation error (`4 K 2^-24 Σ|terms|`); dh within 1 ulp of the fp64 SwiGLU backward of
//!   (the kernel's own dact, g, u), plus a bound on the fp32 math's error (cancellation in
//!   `1 + g (1 - s)`); dh* normwise within 1e-2 of the all-fp64 pipeline;
//! * drows cases: dh without the dact output equals dh with it, bit for bit; dact within 2 ulps
//!   (plus 1e-3 of the row's rms) of the unfused path's (fc2 dgrad grouped GEMM);
//! * gathered cases: dh and the dprob partials against an fp64 reference* of their own (fp64
//!   GEMM rounded to T; the bound covers a 1-ulp difference of the kernel's fp32-accumulated
//!   dact) and against the drows form's dact (the same dact bits, so tight bounds); asserted
//!   bit for bit: with every prob 1 the gathered dh equals the drows form's (the two forms
//!   differ only in how A reaches shared memory: same MMA sequence, same sums), the partials do
//!   not depend on prob, and a second launch repeats the first;
//! * every output: rows at or past offsets[E], and guard rows past capacity, still hold the
//!   poison bit for bit; rows before it all written and finite.
//!
//! Bit equality of the drows form with the unfused path it replaces (fc2 dgrad grouped GEMM ->
//! SwiGLU backward) is REPORTED, not asserted: both round the same fp32 dact and run the same
//! fp32 SwiGLU backward, and both run the k16 MMA steps in ascending K, but at different tile
//! shapes. fused_gpu asserts those bits for fc1, on the assumption (module docs there) that the
//! hardware's sum order inside a k16 step does not depend on the MMA's N; a bitwise-only
//! difference here with the fp64 checks passing points at that per-N sum order, not at the
//! kernel. A line `bitwise vs unfused: ...` says how many elements differ and by how many ulps
//! at most (0 of N: the same bits).

mod common;

use std::sync::Arc;
use std::time::Instant;

use capturable_moe::dtype::DType;
use capturable_moe::fused::FusedSwigluDgrad;
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use capturable_moe::moe::MoeElement;
use capturable_moe::routing::{self, RouteMaps, RoutingPlan, Tokens};
use capturable_moe::Error;
use common::fused::{replay_tokens, sample_rows, Routes, Shape};
use common::moe::{assert_bits, assert_close, ulp16};
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

macro_rules! impl_act {
    ($t:ty, $poison:expr, $mantissa:expr) => {
        impl Act for $t {
            const NAME: &'static str = stringify!($t);
            const POISON: u16 = $poison;
            const MANTISSA: i32 = $mantissa;
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn bits(self) -> u16 {
                self.to_bits()
            }
            fn from_bits(b: u16) -> Self {
                <$t>::from_bits(b)
            }
        }
    };
}

impl_act!(bf16, 0x7FC0, 7);
impl_act!(f16, 0x7E01, 10);

/// One ulp of `T` at `v` (the subnormal spacing for tiny values).
fn ulp<T: Act>(v: f64) -> f64 {
    ulp16(v, T::MANTISSA)
}

/// Distance in ulps between two finite 16-bit floats of one format (signs handled).
fn ulps_apart(a: u16, b: u16) -> u32 {
    let ordered = |x: u16| if x & 0x8000 != 0 { -((x & 0x7FFF) as i32) } else { x as i32 };
    ordered(a).abs_diff(ordered(b))
}

fn bits<T: Act>(v: &[T]) -> Vec<u16> {
    v.iter().map(|b| b.bits()).collect()
}

fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|b| b.to_bits()).collect()
}

/// Rows of poison past capacity in every fused output (nothing may land there).
const GUARD_ROWS: usize = 3;
/// A quiet NaN no kernel computes, for the fp32 partials.
const POISON_F32: u32 = 0x7FC0_1234;

/// Which entry point of the kernel a test drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// `run`: A = drows `[capacity, H]`, with the optional dact output.
    Drows,
    /// `run_gathered`: A = dy rows through token_of_row, dh of prob · dact, dprob partials.
    Gathered,
}

// ---- the case table ----

#[derive(Clone, Copy, Debug)]
struct Launch {
    t: usize,
    routes: Routes,
    /// Gathered form: tokens outside [0, T_max) written over the first, middle and last stored
    /// rows of token_of_row (those rows must behave as zero A rows). The drows form reads no
    /// token_of_row.
    invalid_tokens: bool,
}

const fn launch(t: usize, routes: Routes, invalid_tokens: bool) -> Launch {
    Launch { t, routes, invalid_tokens }
}

/// One test's shape and launches, run eagerly under either form.
struct Case {
    name: &'static str,
    shape: Shape,
    /// Seeds the weights; `seed + 1` the launches' inputs.
    seed: u64,
    launches: &'static [Launch],
    /// Every launch overflows the capacity: offsets[E] must be the capacity.
    overflows: bool,
}

/// H = 200: the last K block is partial (TMA zero-fills drows' and W2's columns past H,
/// cp.async dy's chunks).
const MESSY: Case = Case {
    name: "messy routing",
    shape: Shape { e: 8, h: 200, f: 256, k: 3, t_max: 300, capacity: None },
    seed: 1,
    launches: &[
        launch(300, Routes::MessyEvenExperts, true),
        launch(0, Routes::MessyEvenExperts, false),
        launch(1, Routes::MessyEvenExperts, true),
        launch(137, Routes::MessyEvenExperts, false),
        launch(299, Routes::MessyEvenExperts, true),
    ],
    overflows: false,
};

/// k duplicates of one expert per token: 800 rows, 7 M tiles, the last one partial; the last
/// expert's last tile reads drows rows past capacity (zero-filled by TMA).
const ONE_EXPERT: Case = Case {
    name: "one expert takes every route",
    shape: Shape { e: 16, h: 256, f: 128, k: 4, t_max: 200, capacity: None },
    seed: 3,
    launches: &[launch(200, Routes::AllTo(0), true), launch(200, Routes::AllTo(15), true)],
    overflows: false,
};

const CAPACITY_LAUNCHES: &[Launch] =
    &[launch(256, Routes::TopK, false), launch(256, Routes::TopK, true), launch(256, Routes::TopK, false)];

/// 512 routes into capacity 300: the offsets are clamped, the last kept expert ends at row 300
/// mid-tile, its tile's drows rows past 300 are outside the TMA map, and the guard rows past
/// capacity must stay poisoned. F = 128 (one N tile) and F = 384 (three dprob slices).
const CAPACITY: [Case; 2] = [
    Case {
        name: "capacity 300 of 512 routes, F 128",
        shape: Shape { e: 4, h: 136, f: 128, k: 2, t_max: 256, capacity: Some(300) },
        seed: 5,
        launches: CAPACITY_LAUNCHES,
        overflows: true,
    },
    Case {
        name: "capacity 300 of 512 routes, F 384",
        shape: Shape { e: 4, h: 136, f: 384, k: 2, t_max: 256, capacity: Some(300) },
        seed: 25,
        launches: CAPACITY_LAUNCHES,
        overflows: true,
    },
];

/// E128 H2048 F768 k8 (the benchmark's training shape, all tokens and T below T_max) and
/// decode E64 H2048 F1408 k8; the fp64 references on a sample of rows.
const MODEL_SHAPES: [Case; 3] = [
    Case {
        name: "E128 H2048 F768 k8 T4096",
        shape: Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None },
        seed: 7,
        launches: &[launch(4096, Routes::TopK, true)],
        overflows: false,
    },
    Case {
        name: "E128 H2048 F768 k8 T4000 of 4096",
        shape: Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None },
        seed: 7,
        launches: &[launch(4000, Routes::TopK, true)],
        overflows: false,
    },
    Case {
        name: "E64 H2048 F1408 k8 T128",
        shape: Shape { e: 64, h: 2048, f: 1408, k: 8, t_max: 128, capacity: None },
        seed: 7,
        launches: &[launch(128, Routes::TopK, true)],
        overflows: false,
    },
];
/// Reference rows per launch at model shapes.
const MODEL_SAMPLE: usize = 48;

// ---- inputs ----

/// One launch's inputs on the host: routes, T, h and the drows form's A of every row (rows at
/// or past offsets[E] hold NaN: a kernel that mixed them into a stored row would show it).
struct Inputs<T> {
    t: usize,
    ids: Vec<i32>,
    maps: routing::reference::RouteMaps,
    /// `[capacity, 2F]` (g in [-4, 4]: both sigmoid tails).
    h: Vec<T>,
    /// `[capacity, H]`: random, or in a gathered case dy[token] per stored row (a zero row for
    /// an invalid token), what the gather must read.
    drows: Vec<T>,
    gathered: Option<GatheredInputs<T>>,
}

struct GatheredInputs<T> {
    /// `[T_max, H]`; rows at or past T are NaN (no valid route reads them).
    dy: Vec<T>,
    /// `[capacity]` in [0.05, 1]; rows at or past offsets[E] NaN.
    prob: Vec<f32>,
    /// What the kernel reads: the routing build's, with [`Launch::invalid_tokens`] applied.
    token_of_row: Vec<i32>,
}

fn random<T: Act>(rng: &mut StdRng, n: usize, scale: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.random_range(-1.0..1.0) * scale)).collect()
}

fn weights<T: Act>(shape: Shape, seed: u64) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    random(&mut rng, shape.e * shape.h * shape.f, 1.0 / (shape.h as f64).sqrt())
}

/// Inputs of `launch` under `form`; the CPU routing reference gives offsets[E].
fn inputs<T: Act>(form: Form, shape: Shape, capacity: usize, rng: &mut StdRng, launch: Launch) -> Inputs<T> {
    let (t, hd) = (launch.t, shape.h);
    let ids = launch.routes.ids(rng, shape);
    let maps = routing::reference::build(&ids, t, shape.t_max, shape.e, shape.k, capacity, 0);
    let total = maps.offsets[shape.e] as usize;
    let nan = T::from_f64(f64::NAN);
    let a_rows = if form == Form::Gathered { shape.t_max } else { capacity };
    let mut a: Vec<T> = random(rng, a_rows * hd, 1.0);
    let mut h: Vec<T> = random(rng, capacity * 2 * shape.f, 4.0);
    h[total * 2 * shape.f..].fill(nan);
    if form == Form::Drows {
        a[total * hd..].fill(nan);
        return Inputs { t, ids, maps, h, drows: a, gathered: None };
    }
    a[t * hd..].fill(nan);
    let prob: Vec<f32> =
        (0..capacity).map(|r| if r < total { rng.random_range(0.05f32..=1.0) } else { f32::NAN }).collect();
    let mut token_of_row = maps.token_of_row.clone();
    if launch.invalid_tokens && total > 0 {
        for (row, token) in [(0, -1), (total / 2, shape.t_max as i32), (total - 1, i32::MIN)] {
            token_of_row[row] = token;
        }
    }
    let mut drows = vec![nan; capacity * hd];
    for (r, &token) in token_of_row[..total].iter().enumerate() {
        let row = &mut drows[r * hd..(r + 1) * hd];
        match usize::try_from(token) {
            Ok(token) if token < shape.t_max => row.copy_from_slice(&a[token * hd..(token + 1) * hd]),
            _ => row.fill(T::from_f64(0.0)),
        }
    }
    Inputs { t, ids, maps, h, drows, gathered: Some(GatheredInputs { dy: a, prob, token_of_row }) }
}

// ---- the runner ----

/// One form of one shape, every buffer allocated once. Every case runs the drows form with the
/// dact output (in a gathered case, the cross-check on the host-permuted rows); each form adds
/// its own launches.
struct Runner<T: Act> {
    form: Form,
    shape: Shape,
    plan: RoutingPlan,
    fused: FusedSwigluDgrad,
    maps: RouteMaps,
    w2: CudaSlice<T>,
    ids: CudaSlice<i32>,
    tokens: CudaSlice<i32>,
    h: CudaSlice<T>,
    drows: CudaSlice<T>,
    dh_drows: CudaSlice<T>,
    dact_drows: CudaSlice<T>,
    drows_form: Option<DrowsForm<T>>,
    gathered: Option<GatheredForm<T>>,
}

/// The drows form's own cross-checks: dh without the dact output, and the unfused path.
struct DrowsForm<T> {
    dh_no_dact: CudaSlice<T>,
    fc2_dgrad: GroupedGemm,
    gemm_flags: CudaSlice<i32>,
    workspace: CudaSlice<u8>,
    dact_unfused: CudaSlice<T>,
    dh_unfused: CudaSlice<T>,
}

/// The gathered launches of one case.
#[derive(Clone, Copy)]
enum GatheredLaunch {
    /// With prob, into dh / partials.
    First,
    /// The same again, into dh_again / partials_again.
    Again,
    /// With every prob 1, into dh_unit / partials_unit.
    UnitProb,
}

/// The gathered form's inputs and outputs: its launch with prob, again, and with prob 1.
struct GatheredForm<T> {
    dy: CudaSlice<T>,
    prob: CudaSlice<f32>,
    ones: CudaSlice<f32>,
    dh: CudaSlice<T>,
    partials: CudaSlice<f32>,
    dh_again: CudaSlice<T>,
    partials_again: CudaSlice<f32>,
    dh_unit: CudaSlice<T>,
    partials_unit: CudaSlice<f32>,
}

impl<T: Act> Runner<T> {
    fn new(stream: &Arc<CudaStream>, form: Form, shape: Shape, w2: &[T]) -> Runner<T> {
        let plan = RoutingPlan::new(shape.routing(<T as routing::Element>::DTYPE)).unwrap();
        let cap = plan.capacity();
        let fused = FusedSwigluDgrad::new(&plan, stream).unwrap();
        let slices = fused.dprob_slices();
        assert_eq!(slices, shape.f / 128, "dprob_slices");
        let zeros = |n: usize| stream.alloc_zeros::<T>(n.max(1)).unwrap();
        let zeros_f32 = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).unwrap();
        let out_rows = cap + GUARD_ROWS;
        let drows_form = (form == Form::Drows).then(|| {
            let spec = GroupedGemmSpec::new(GemmOp::Dgrad, shape.e, shape.h, shape.f, cap)
                .with_dtype(<T as routing::Element>::DTYPE);
            let fc2_dgrad = GroupedGemm::new(spec, stream).unwrap();
            DrowsForm {
                dh_no_dact: zeros(out_rows * 2 * shape.f),
                gemm_flags: stream.alloc_zeros(1).unwrap(),
                workspace: stream.alloc_zeros(fc2_dgrad.workspace_bytes().max(1)).unwrap(),
                fc2_dgrad,
                dact_unfused: zeros(cap * shape.f),
                dh_unfused: zeros(cap * 2 * shape.f),
            }
        });
        let gathered = (form == Form::Gathered).then(|| GatheredForm {
            dy: zeros(shape.t_max * shape.h),
            prob: zeros_f32(cap),
            ones: stream.clone_htod(&vec![1.0f32; cap.max(1)]).unwrap(),
            dh: zeros(out_rows * 2 * shape.f),
            partials: zeros_f32(out_rows * slices),
            dh_again: zeros(out_rows * 2 * shape.f),
            partials_again: zeros_f32(out_rows * slices),
            dh_unit: zeros(out_rows * 2 * shape.f),
            partials_unit: zeros_f32(out_rows * slices),
        });
        Runner {
            form,
            maps: plan.alloc_maps(stream).unwrap(),
            w2: stream.clone_htod(w2).unwrap(),
            ids: stream.alloc_zeros(shape.t_max * shape.k).unwrap(),
            tokens: stream.alloc_zeros(1).unwrap(),
            h: zeros(cap * 2 * shape.f),
            drows: zeros(cap * shape.h),
            dh_drows: zeros(out_rows * 2 * shape.f),
            dact_drows: zeros(out_rows * shape.f),
            drows_form,
            gathered,
            shape,
            plan,
            fused,
        }
    }

    fn capacity(&self) -> usize {
        self.plan.capacity()
    }

    /// Inputs of the routing build and of the kernels (token_of_row comes from the build).
    fn load(&mut self, stream: &Arc<CudaStream>, inp: &Inputs<T>) {
        stream.memcpy_htod(&inp.ids, &mut self.ids).unwrap();
        stream.memcpy_htod(&[inp.t as i32], &mut self.tokens).unwrap();
        stream.memcpy_htod(&inp.h, &mut self.h).unwrap();
        stream.memcpy_htod(&inp.drows, &mut self.drows).unwrap();
        if let (Some(g), Some(gi)) = (self.gathered.as_mut(), inp.gathered.as_ref()) {
            stream.memcpy_htod(&gi.dy, &mut g.dy).unwrap();
            stream.memcpy_htod(&gi.prob, &mut g.prob).unwrap();
        }
    }

    /// Poisons every output.
    fn poison(&mut self, stream: &Arc<CudaStream>) {
        let mut outputs = vec![&mut self.dh_drows, &mut self.dact_drows];
        let mut outputs_f32 = Vec::new();
        if let Some(d) = self.drows_form.as_mut() {
            outputs.extend([&mut d.dh_no_dact, &mut d.dact_unfused, &mut d.dh_unfused]);
        }
        if let Some(g) = self.gathered.as_mut() {
            outputs.extend([&mut g.dh, &mut g.dh_again, &mut g.dh_unit]);
            outputs_f32.extend([&mut g.partials, &mut g.partials_again, &mut g.partials_unit]);
        }
        for buf in outputs {
            stream.memcpy_htod(&vec![T::from_bits(T::POISON); buf.len()], buf).unwrap();
        }
        for buf in outputs_f32 {
            stream.memcpy_htod(&vec![f32::from_bits(POISON_F32); buf.len()], buf).unwrap();
        }
    }

    /// Routing build with the device token count.
    fn build(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.plan.build(stream, &self.ids, Tokens::Device(&self.tokens), &mut self.maps)
    }

    /// The drows form on the maps of the last build, into dh_drows (and dact_drows).
    fn drows_launch(&mut self, stream: &CudaStream, with_dact: bool) -> capturable_moe::Result<()> {
        let dact = with_dact.then_some(&mut self.dact_drows);
        self.fused.run(stream, &self.drows, &self.w2, &self.h, &self.maps.offsets, &mut self.dh_drows, dact)
    }

    /// The gathered form on the maps of the last build, into the outputs `which` names.
    fn gathered_launch(&mut self, stream: &CudaStream, which: GatheredLaunch) -> capturable_moe::Result<()> {
        let g = self.gathered.as_mut().expect("a gathered runner");
        let (prob, dh, partials) = match which {
            GatheredLaunch::First => (&g.prob, &mut g.dh, &mut g.partials),
            GatheredLaunch::Again => (&g.prob, &mut g.dh_again, &mut g.partials_again),
            GatheredLaunch::UnitProb => (&g.ones, &mut g.dh_unit, &mut g.partials_unit),
        };
        let m = &self.maps;
        self.fused.run_gathered(stream, &g.dy, &self.w2, &self.h, &m.offsets, &m.token_of_row, prob, dh, partials)
    }

    /// The form's own launch on the maps of the last build (drows: with dact; gathered: with
    /// prob): what a backward runs after the build.
    fn launch(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        match self.form {
            Form::Drows => self.drows_launch(stream, true),
            Form::Gathered => self.gathered_launch(stream, GatheredLaunch::First),
        }
    }

    /// Build, then the form's launch: what the graph tests capture.
    fn build_and_launch(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.build(stream)?;
        self.launch(stream)
    }

    /// The form's cross-checks on the same maps. Drows: the launch without dact, then fc2
    /// dgrad grouped GEMM -> SwiGLU backward. Gathered: a second launch, the prob = 1 launch,
    /// and the drows form (with dact) on the host-permuted rows.
    fn cross_checks(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let Some(d) = self.drows_form.as_mut() else {
            self.gathered_launch(stream, GatheredLaunch::Again)?;
            self.gathered_launch(stream, GatheredLaunch::UnitProb)?;
            return self.drows_launch(stream, true);
        };
        let none = None::<&mut CudaSlice<T>>;
        self.fused.run(stream, &self.drows, &self.w2, &self.h, &self.maps.offsets, &mut d.dh_no_dact, none)?;
        self.unfused(stream)
    }

    /// The drows form's unfused twin: fc2 dgrad grouped GEMM -> SwiGLU backward.
    fn unfused(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        self.unfused_gemm(stream)?;
        let d = self.drows_form.as_mut().expect("a drows runner");
        self.plan.swiglu_backward(stream, &d.dact_unfused, &self.h, &self.maps.offsets, &mut d.dh_unfused)
    }

    /// The fc2 dgrad grouped GEMM alone, into dact_unfused.
    fn unfused_gemm(&mut self, stream: &CudaStream) -> capturable_moe::Result<()> {
        let d = self.drows_form.as_mut().expect("a drows runner");
        let (splits, flags) = (&self.maps.m_splits_i32, &mut d.gemm_flags);
        d.fc2_dgrad.run(stream, &self.drows, &self.w2, &mut d.dact_unfused, splits, Some(flags), &mut d.workspace)
    }

    /// The outputs of [`Runner::launch`], as bits: what a graph replay must reproduce.
    fn launch_outputs(&self, stream: &Arc<CudaStream>) -> Vec<(&'static str, Vec<u32>)> {
        let widen = |v: Vec<u16>| v.into_iter().map(u32::from).collect::<Vec<u32>>();
        match self.gathered.as_ref() {
            None => vec![
                ("dh", widen(bits(&stream.clone_dtoh(&self.dh_drows).unwrap()))),
                ("dact", widen(bits(&stream.clone_dtoh(&self.dact_drows).unwrap()))),
            ],
            Some(g) => vec![
                ("dh", widen(bits(&stream.clone_dtoh(&g.dh).unwrap()))),
                ("dprob partials", bits_f32(&stream.clone_dtoh(&g.partials).unwrap())),
            ],
        }
    }
}

// ---- checks ----

/// Rows `[0, total)` written (no poison, no NaN), every row past it (guard rows included)
/// still the poison bit for bit.
fn assert_rows_written<T: Act>(what: &str, got: &[T], width: usize, total: usize) {
    let written = total * width;
    if let Some(i) = (0..written).find(|&i| !got[i].to_f64().is_finite()) {
        panic!("{what}: element {i} (row {}) of the {total} stored rows is {:?}", i / width, got[i]);
    }
    if let Some(i) = (written..got.len()).find(|&i| got[i].bits() != T::POISON) {
        panic!("{what}: element {i} (row {}) at or past offsets[E] = {total} was written", i / width);
    }
}

/// [`assert_rows_written`] for the fp32 dprob partials.
fn assert_partials_written(what: &str, got: &[f32], slices: usize, total: usize) {
    let written = total * slices;
    if let Some(i) = (0..written).find(|&i| !got[i].is_finite()) {
        panic!("{what}: partial {i} (row {}) of the {total} stored rows is {}", i / slices, got[i]);
    }
    if let Some(i) = (written..got.len()).find(|&i| got[i].to_bits() != POISON_F32) {
        panic!("{what}: partial {i} (row {}) at or past offsets[E] = {total} was written", i / slices);
    }
}

/// How the fused outputs compare with the unfused path's, bit for bit (reported only).
fn report_bitwise<T: Act>(what: &str, name: &str, got: &[T], want: &[T], n: usize) -> usize {
    let diffs: Vec<usize> = (0..n).filter(|&i| got[i].bits() != want[i].bits()).collect();
    let worst = diffs.iter().map(|&i| ulps_apart(got[i].bits(), want[i].bits())).max().unwrap_or(0);
    println!("{what}: bitwise vs unfused: {name}: {} of {n} elements differ (largest {worst} ulps)", diffs.len());
    diffs.len()
}

/// What the fp64 references read: the clamped offsets, the drows form's A, h and w2.
struct RefInputs<'a, T> {
    offsets: &'a [i64],
    drows: &'a [T],
    h: &'a [T],
    w2: &'a [T],
}

fn expert_of_row(offsets: &[i64], experts: usize, r: usize) -> usize {
    (0..experts).rfind(|&e| offsets[e] as usize <= r).unwrap()
}

/// fp64 dact of row `r` of the drows form, per column: the exact sum, and how far a kernel's
/// fp32-accumulated dact rounded to T may be from it (1 ulp + `4 K 2^-24 Σ|terms|`).
fn dact_fp64<T: Act>(shape: Shape, inp: &RefInputs<'_, T>, r: usize) -> Vec<(f64, f64)> {
    let (hd, f) = (shape.h, shape.f);
    let e = expert_of_row(inp.offsets, shape.e, r);
    let (mut sum, mut magnitude) = (vec![0.0f64; f], vec![0.0f64; f]);
    for j in 0..hd {
        let d = inp.drows[r * hd + j].to_f64();
        for (c, w) in inp.w2[(e * hd + j) * f..(e * hd + j + 1) * f].iter().enumerate() {
            let term = d * w.to_f64();
            sum[c] += term;
            magnitude[c] += term.abs();
        }
    }
    let accumulation_bound = 4.0 * hd as f64 * 2f64.powi(-24);
    sum.iter().zip(&magnitude).map(|(&s, &m)| (s, ulp::<T>(s) + accumulation_bound * m)).collect()
}

/// g, u and sigmoid(g) of row `r`, column `c` of h `[rows, 2F]`.
fn gate_up<T: Act>(h: &[T], f: usize, r: usize, c: usize) -> (f64, f64, f64) {
    let (g, u) = (h[r * 2 * f + c].to_f64(), h[r * 2 * f + f + c].to_f64());
    (g, u, 1.0 / (1.0 + (-g).exp()))
}

/// dh[r, c] and dh[r, F + c] against the fp64 SwiGLU backward of (fp32(p · dact), g, u):
/// within 1 ulp of T, plus a bound on the fp32 math's error (cancellation in
/// `1 + g (1 - s)`), plus the reference dact's uncertainty `dact_error` times each output's
/// sensitivity to it.
fn check_dh_pair<T: Act>(
    what: &str,
    h: &[T],
    dh: &[T],
    f: usize,
    (r, c): (usize, usize),
    (dact, dact_error): (f64, f64),
    p: f32,
) {
    let (g, u, s) = gate_up(h, f, r, c);
    // The kernel scales the rounded dact by p in fp32 (exact for p = 1).
    let ds = (p * dact as f32) as f64;
    let slope = 1.0 + g * (1.0 - s);
    let fp32_error = common::moe::swiglu_backward_fp32_error(ds, g, u);
    let ds_error = p as f64 * dact_error;
    for (col, want, sensitivity) in [(c, ds * u * s * slope, (u * s * slope).abs()), (f + c, ds * g * s, (g * s).abs())]
    {
        let got = dh[r * 2 * f + col].to_f64();
        let allowed = ulp::<T>(want) + fp32_error + sensitivity * ds_error;
        assert!(
            (got - want).abs() <= allowed,
            "{what}: dh[{r}, {col}] = {got}, want {want} (allowed {allowed:.3e}; dact {dact}, p {p}, g {g}, u {u})"
        );
    }
}

/// The drows form's outputs `dact`, `dh` on rows `rows` against fp64: dact elementwise and dh
/// normwise against the all-fp64 pipeline (dh elementwise: [`check_dh_of_own_dact`]).
fn check_drows_reference<T: Act>(
    what: &str,
    shape: Shape,
    inp: &RefInputs<'_, T>,
    dact: &[T],
    dh: &[T],
    rows: &[usize],
) {
    let f = shape.f;
    let (mut dh_got, mut dh_want) = (Vec::new(), Vec::new());
    for &r in rows {
        for (c, (sum, allowed)) in dact_fp64(shape, inp, r).into_iter().enumerate() {
            let got = dact[r * f + c].to_f64();
            assert!(
                (got - sum).abs() <= allowed,
                "{what}: dact[{r}, {c}] (expert {}) = {got}, fp64 {sum} (allowed error {allowed:.3e})",
                expert_of_row(inp.offsets, shape.e, r)
            );
            let (g, u, s) = gate_up(inp.h, f, r, c);
            let d = T::from_f64(sum).to_f64();
            dh_want.extend([d * u * s * (1.0 + g * (1.0 - s)), d * g * s]);
            dh_got.extend([dh[r * 2 * f + c].to_f64(), dh[r * 2 * f + f + c].to_f64()]);
        }
    }
    assert_close(&format!("{what}: dh vs the all-fp64 pipeline"), &dh_got, &dh_want, 1e-2);
}

/// dh of every stored row `[0, total)` against the fp64 SwiGLU backward of the kernel's own
/// dact and h ([`check_dh_pair`] at prob 1): O(rows F), so every row, also at model shapes.
fn check_dh_of_own_dact<T: Act>(what: &str, h: &[T], dact: &[T], dh: &[T], f: usize, total: usize) {
    for r in 0..total {
        for c in 0..f {
            check_dh_pair(what, h, dh, f, (r, c), (dact[r * f + c].to_f64(), 0.0), 1.0);
        }
    }
}

/// The drows form's dact against the unfused path's (fc2 dgrad grouped GEMM) on every stored
/// row: within 2 ulps of T plus 1e-3 of the row's rms. Both are one fp32 sum of the same H
/// products rounded once to T; the k16 steps run in the same order, but the sum order inside
/// a step may differ with the tile shape (module docs). A different order moves an fp32 sum of
/// H random-signed products by about sqrt(H) 2^-24 Σ|terms|, under 1e-5 of the row's rms; after
/// the rounding the two are at most 1 ulp apart beyond that (1 more of room). The floor serves
/// columns that cancel to near 0, whose ulps shrink while the order's error does not. A wrong
/// expert, column or row is off by about the rms and fails.
fn assert_dact_near_unfused<T: Act>(what: &str, dact: &[T], unfused: &[T], f: usize, total: usize) {
    for r in 0..total {
        let (got, want) = (&dact[r * f..(r + 1) * f], &unfused[r * f..(r + 1) * f]);
        let rms = (want.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / f as f64).sqrt();
        for c in 0..f {
            let (g, u) = (got[c].to_f64(), want[c].to_f64());
            let allowed = 2.0 * ulp::<T>(g.abs().max(u.abs())) + 1e-3 * rms;
            assert!(
                (g - u).abs() <= allowed,
                "{what}: dact[{r}, {c}] = {g}, unfused {u} (allowed {allowed:.3e}, row rms {rms:.3e})"
            );
        }
    }
}

/// The reference dact of one row, per column: its value and how far the kernel's may be from it.
type DactOfRow<'a> = &'a dyn Fn(usize) -> Vec<(f64, f64)>;

/// The gathered form's dh and partials on rows `rows` against fp64 built on `dact_of`: dh as
/// [`check_dh_pair`] at the row's prob, partial j = Σ dact · SwiGLU(g, u) over the 128 columns
/// of slice j.
fn check_gathered_rows<T: Act>(
    what: &str,
    shape: Shape,
    inp: &Inputs<T>,
    rows: &[usize],
    dh: &[T],
    partials: &[f32],
    dact_of: DactOfRow<'_>,
) {
    let (f, slices) = (shape.f, shape.f / 128);
    let gathered = inp.gathered.as_ref().expect("gathered inputs");
    for &r in rows {
        let (p, dact) = (gathered.prob[r], dact_of(r));
        let what = format!("{what} (token {})", gathered.token_of_row[r]);
        for j in 0..slices {
            let (mut want, mut magnitude, mut uncertainty) = (0.0f64, 0.0f64, 0.0f64);
            for c in j * 128..(j + 1) * 128 {
                let (g, u, s) = gate_up(&inp.h, f, r, c);
                let act = g * s * u;
                want += dact[c].0 * act;
                magnitude += (dact[c].0 * act).abs();
                uncertainty += dact[c].1 * act.abs();
                check_dh_pair(&what, &inp.h, dh, f, (r, c), dact[c], p);
            }
            // fp32 sums of 128 products in a fixed order (sm_90a: each thread's 32, then the
            // quad's butterfly; sm_100a: each half's 64, then lower + upper) and the fp32 SwiGLU:
            // well within 2e-5 of the magnitude.
            let got = partials[r * slices + j] as f64;
            let allowed = 2e-5 * magnitude + uncertainty + f64::from(f32::MIN_POSITIVE);
            assert!(
                (got - want).abs() <= allowed,
                "{what}: dprob_partials[{r}, {j}] = {got}, want {want} (allowed {allowed:.3e})"
            );
        }
    }
}

/// Runs one launch and its cross-checks under the runner's form and checks everything the
/// module docs list; the fp64 references on `sample` rows (every row when `None`). Returns the
/// count of the drows form's dh elements that differ from the unfused path (0 for a gathered
/// case, which has no unfused twin here).
fn check_case<T: Act>(
    what: &str,
    stream: &Arc<CudaStream>,
    runner: &mut Runner<T>,
    inp: &Inputs<T>,
    w2: &[T],
    sample: Option<usize>,
) -> usize {
    let s = runner.shape;
    runner.load(stream, inp);
    runner.poison(stream);
    runner.build(stream).unwrap();
    assert_eq!(stream.clone_dtoh(&runner.maps.offsets).unwrap(), inp.maps.offsets, "{what}: offsets");
    let built = stream.clone_dtoh(&runner.maps.token_of_row).unwrap();
    assert_eq!(built, inp.maps.token_of_row, "{what}: token_of_row");
    if let Some(gathered) = inp.gathered.as_ref() {
        // The case's invalid tokens, written over the build's.
        stream.memcpy_htod(&gathered.token_of_row, &mut runner.maps.token_of_row).unwrap();
    }
    runner.launch(stream).unwrap();
    runner.cross_checks(stream).unwrap();
    let total = inp.maps.offsets[s.e] as usize;
    let dh = stream.clone_dtoh(&runner.dh_drows).unwrap();
    let dact = stream.clone_dtoh(&runner.dact_drows).unwrap();
    assert_rows_written(&format!("{what}: drows form dh"), &dh, 2 * s.f, total);
    assert_rows_written(&format!("{what}: drows form dact"), &dact, s.f, total);
    check_dh_of_own_dact(&format!("{what}: drows form"), &inp.h, &dact, &dh, s.f, total);
    let rows = sample_rows(total, sample);
    if !rows.is_empty() {
        let r = RefInputs { offsets: &inp.maps.offsets, drows: &inp.drows, h: &inp.h, w2 };
        check_drows_reference(&format!("{what}: drows form"), s, &r, &dact, &dh, &rows);
    }
    match runner.form {
        Form::Drows => check_drows_form(what, stream, runner, (&dh, &dact), total),
        Form::Gathered => {
            check_gathered_form(what, stream, runner, inp, w2, &dh, &rows);
            0
        }
    }
}

/// The drows form's own checks: dh without the dact output equals dh with it, the unfused
/// path wrote its rows, dact near the unfused dact on every row; the bitwise agreement
/// reported. Returns the count of dh elements that differ from the unfused path.
fn check_drows_form<T: Act>(
    what: &str,
    stream: &Arc<CudaStream>,
    runner: &Runner<T>,
    (dh, dact): (&[T], &[T]),
    total: usize,
) -> usize {
    let (d, f) = (runner.drows_form.as_ref().expect("a drows runner"), runner.shape.f);
    let dh_no_dact = stream.clone_dtoh(&d.dh_no_dact).unwrap();
    assert_bits(&format!("{what}: dh without the dact output vs with it"), &bits(&dh_no_dact), &bits(dh));
    let dact_unfused = stream.clone_dtoh(&d.dact_unfused).unwrap();
    let dh_unfused = stream.clone_dtoh(&d.dh_unfused).unwrap();
    assert_rows_written(&format!("{what}: unfused dh"), &dh_unfused, 2 * f, total);
    report_bitwise(what, "dact", dact, &dact_unfused, total * f);
    let differing = report_bitwise(what, "dh", dh, &dh_unfused, total * 2 * f);
    assert_dact_near_unfused(&format!("{what}: vs unfused"), dact, &dact_unfused, f, total);
    differing
}

/// The gathered form's own checks (module docs): rows written, the bitwise claims, dh and the
/// partials against the drows form's dact (tight, O(rows F): every stored row) and, on `rows`,
/// against fp64.
fn check_gathered_form<T: Act>(
    what: &str,
    stream: &Arc<CudaStream>,
    runner: &Runner<T>,
    inp: &Inputs<T>,
    w2: &[T],
    dh_drows: &[T],
    rows: &[usize],
) {
    let (s, g) = (runner.shape, runner.gathered.as_ref().expect("a gathered runner"));
    let read = |b: &CudaSlice<T>| stream.clone_dtoh(b).unwrap();
    let read_f32 = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap();
    let (dh, partials) = (read(&g.dh), read_f32(&g.partials));
    let total = inp.maps.offsets[s.e] as usize;
    assert_rows_written(&format!("{what}: gathered dh"), &dh, 2 * s.f, total);
    assert_partials_written(&format!("{what}: gathered dprob partials"), &partials, s.f / 128, total);
    assert_bits(&format!("{what}: second launch dh"), &bits(&read(&g.dh_again)), &bits(&dh));
    let partials_bits = bits_f32(&partials);
    assert_bits(&format!("{what}: second launch partials"), &bits_f32(&read_f32(&g.partials_again)), &partials_bits);
    let unit_partials = bits_f32(&read_f32(&g.partials_unit));
    assert_bits(&format!("{what}: partials with prob 1 vs with prob"), &unit_partials, &partials_bits);
    // Same dact bits in both forms (the same MMA sums of the same rows): with p = 1 the
    // gathered dh is the drows form's.
    let unit_dh = bits(&read(&g.dh_unit));
    assert_bits(&format!("{what}: gathered dh with prob 1 vs the drows form"), &unit_dh, &bits(dh_drows));
    // Against the drows form's dact (checked against fp64 by check_case): tight.
    let dact_drows = read(&runner.dact_drows);
    let from_drows = |r: usize| (0..s.f).map(|c| (dact_drows[r * s.f + c].to_f64(), 0.0)).collect();
    let vs_drows = format!("{what}: vs the drows form's dact");
    let every_row: Vec<usize> = (0..total).collect();
    check_gathered_rows(&vs_drows, s, inp, &every_row, &dh, &partials, &from_drows);
    if rows.is_empty() {
        return;
    }
    // And against fp64 on its own: dact = round(Σ A · w2) with A = dy[token] or zeros; the
    // kernel's fp32 sum may round to a neighbour.
    let r = RefInputs { offsets: &inp.maps.offsets, drows: &inp.drows, h: &inp.h, w2 };
    let from_fp64 = |row: usize| {
        let exact = dact_fp64(s, &r, row);
        exact.into_iter().map(|(sum, allowed)| (T::from_f64(sum).to_f64(), 2.0 * allowed)).collect()
    };
    check_gathered_rows(&format!("{what}: vs fp64"), s, inp, rows, &dh, &partials, &from_fp64);
}

// ---- the cases, one test per case list, form and type ----

/// Every launch of `case` under `form`, each checked by check_case (the fp64 references on
/// `sample` rows). Returns the drows form's dh elements that differ from the unfused path.
fn check_launches<T: Act>(stream: &Arc<CudaStream>, form: Form, case: &Case, sample: Option<usize>) -> usize {
    let shape = case.shape;
    let w2 = weights::<T>(shape, case.seed);
    let mut runner = Runner::new(stream, form, shape, &w2);
    let mut rng = StdRng::seed_from_u64(case.seed + 1);
    let mut differing = 0;
    for (i, &launch) in case.launches.iter().enumerate() {
        let inp = inputs(form, shape, runner.capacity(), &mut rng, launch);
        if case.overflows {
            assert_eq!(inp.maps.offsets[shape.e] as usize, runner.capacity(), "the case must overflow capacity");
        }
        let invalid = form == Form::Gathered && launch.invalid_tokens;
        let what = format!("{} {form:?}: {} case {i} (T={}, invalid tokens: {invalid})", T::NAME, case.name, launch.t);
        differing += check_case(&what, stream, &mut runner, &inp, &w2, sample);
    }
    differing
}

fn check_cases<T: Act>(form: Form, cases: &[Case]) {
    let stream = gpu_or_skip!();
    for case in cases {
        check_launches::<T>(&stream, form, case, None);
    }
}

/// One `#[test]` per case list, form and type: a failure of one cannot hide another's result.
macro_rules! case_tests {
    ($($name:ident: $form:ident, $t:ty, $cases:expr;)*) => {$(
        #[test]
        fn $name() {
            check_cases::<$t>(Form::$form, $cases);
        }
    )*};
}

case_tests! {
    fused_dgrad_messy_routing_bf16: Drows, bf16, &[MESSY];
    fused_dgrad_messy_routing_f16: Drows, f16, &[MESSY];
    fused_dgrad_gathered_messy_routing_bf16: Gathered, bf16, &[MESSY];
    fused_dgrad_gathered_messy_routing_f16: Gathered, f16, &[MESSY];
    fused_dgrad_one_expert_takes_every_route_bf16: Drows, bf16, &[ONE_EXPERT];
    fused_dgrad_one_expert_takes_every_route_f16: Drows, f16, &[ONE_EXPERT];
    fused_dgrad_gathered_one_expert_takes_every_route_bf16: Gathered, bf16, &[ONE_EXPERT];
    fused_dgrad_gathered_one_expert_takes_every_route_f16: Gathered, f16, &[ONE_EXPERT];
    fused_dgrad_capacity_clamps_the_offsets_bf16: Drows, bf16, &CAPACITY;
    fused_dgrad_capacity_clamps_the_offsets_f16: Drows, f16, &CAPACITY;
    fused_dgrad_gathered_capacity_clamps_the_offsets_bf16: Gathered, bf16, &CAPACITY;
    fused_dgrad_gathered_capacity_clamps_the_offsets_f16: Gathered, f16, &CAPACITY;
}

fn model_shapes(form: Form) {
    let stream = gpu_or_skip!();
    let mut differing = 0;
    for case in &MODEL_SHAPES {
        // Under a sanitizer (10-100x slower) only the decode shape runs.
        if common::under_sanitizer() && case.shape.t_max > 128 {
            println!("skipping: bf16 {form:?}: {} under a sanitizer (CAPMOE_SANITIZER=1)", case.name);
            continue;
        }
        let start = Instant::now();
        differing += check_launches::<bf16>(&stream, form, case, Some(MODEL_SAMPLE));
        println!("bf16 {form:?}: {}: checked in {:.1} s", case.name, start.elapsed().as_secs_f64());
    }
    if form == Form::Drows {
        println!("fused_dgrad_model_shapes: {differing} dh elements differ from the unfused path in all");
    }
}

#[test]
fn fused_dgrad_model_shapes() {
    model_shapes(Form::Drows);
}

#[test]
fn fused_dgrad_gathered_model_shapes() {
    model_shapes(Form::Gathered);
}

/// Capture routing build + the form's launch once; replay with fresh routing, inputs and T
/// written between replays. Every replay equals an eager run bit for bit (offsets and the
/// launch's outputs; the eager runner is checked against the references by check_case). H =
/// 192 (whole K blocks) and H = 200 (a partial last one).
fn graph_replays_match_eager(form: Form) {
    let stream = gpu_or_skip!();
    let _lock = common::capture_lock();
    for (h, seed) in [(192, 9), (200, 29)] {
        let shape = Shape { e: 8, h, f: 256, k: 2, t_max: 160, capacity: None };
        let w2 = weights::<bf16>(shape, seed);
        let mut graph_runner = Runner::new(&stream, form, shape, &w2);
        let mut eager = Runner::new(&stream, form, shape, &w2);
        let cap = eager.capacity();
        let mut rng = StdRng::seed_from_u64(seed + 1);
        let first = inputs::<bf16>(form, shape, cap, &mut rng, launch(100, Routes::MessyEvenExperts, false));
        graph_runner.load(&stream, &first);
        stream.synchronize().unwrap();
        let graph = capture(&stream, || graph_runner.build_and_launch(&stream)).unwrap();
        let replays = if common::under_sanitizer() { 8 } else { 40 };
        for i in 0..replays {
            let t = replay_tokens(&mut rng, i, shape.t_max);
            let routes = Routes::of_replay(i, Routes::MessyEvenExperts);
            // No invalid tokens here: the graph's token_of_row comes from its own build.
            let inp = inputs::<bf16>(form, shape, cap, &mut rng, launch(t, routes, false));
            graph_runner.load(&stream, &inp);
            graph_runner.poison(&stream);
            graph.launch().unwrap();
            let what = format!("{form:?} H {h}: replay {i} (T={t})");
            check_case(&what, &stream, &mut eager, &inp, &w2, Some(8));
            let offsets = |r: &Runner<bf16>| stream.clone_dtoh(&r.maps.offsets).unwrap();
            assert_eq!(offsets(&graph_runner), offsets(&eager), "{what}: offsets");
            let replayed = graph_runner.launch_outputs(&stream);
            for ((name, got), (_, want)) in replayed.iter().zip(eager.launch_outputs(&stream)) {
                assert_bits(&format!("{what}: graph {name} vs eager"), got, &want);
            }
        }
    }
}

#[test]
fn fused_dgrad_graph_replays_match_eager() {
    graph_replays_match_eager(Form::Drows);
}

#[test]
fn fused_dgrad_gathered_graph_replays_match_eager() {
    graph_replays_match_eager(Form::Gathered);
}

// ---- cases of one form ----

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
    check_drows_reference(&what, shape, &r, &dact, &dh, &rows);
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
    // The plan's tile-schedule words belong to its stream: another stream is refused, in both
    // forms (the buffers are right, so nothing else is wrong).
    let w2 = stream.alloc_zeros::<bf16>(4 * 128 * 128).unwrap();
    let other = stream.context().new_stream().unwrap();
    let r = fused.run(&other, &drows, &w2, &h, &maps.offsets, &mut dh, None::<&mut CudaSlice<bf16>>);
    assert!(matches!(r, Err(Error::WrongStream { .. })), "another stream: {r:?}");
    let dy = stream.alloc_zeros::<bf16>(16 * 128).unwrap();
    let prob = stream.alloc_zeros::<f32>(cap).unwrap();
    let mut partials = stream.alloc_zeros::<f32>(cap).unwrap();
    let (offsets, tokens) = (&maps.offsets, &maps.token_of_row);
    let r = fused.run_gathered(&other, &dy, &w2, &h, offsets, tokens, &prob, &mut dh, &mut partials);
    assert!(matches!(r, Err(Error::WrongStream { .. })), "gathered, another stream: {r:?}");
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

// ---- timing hooks (ignored by default) ----

/// The timing hooks' shape: E128 T4096 k8 H2048 F768.
const TIMING_SHAPE: Shape = Shape { e: 128, h: 2048, f: 768, k: 8, t_max: 4096, capacity: None };

/// A runner of `form` at [`TIMING_SHAPE`], loaded, with its maps built once (the graphs timed
/// skip the build).
fn timing_runner(stream: &Arc<CudaStream>, form: Form, seed: u64) -> Runner<bf16> {
    let w2 = weights::<bf16>(TIMING_SHAPE, seed);
    let mut runner = Runner::new(stream, form, TIMING_SHAPE, &w2);
    let mut rng = StdRng::seed_from_u64(seed + 1);
    let all_tokens = launch(TIMING_SHAPE.t_max, Routes::TopK, false);
    let inp = inputs::<bf16>(form, TIMING_SHAPE, runner.capacity(), &mut rng, all_tokens);
    runner.load(stream, &inp);
    runner.build(stream).unwrap();
    runner
}

/// us per graph replay of each graph, and TFLOP/s of the fc2 dgrad.
fn print_timings(test: &str, stream: &Arc<CudaStream>, graphs: &[(&str, &cudarc::driver::CudaGraph)]) {
    let s = TIMING_SHAPE;
    let flops = 2.0 * (s.t_max * s.k) as f64 * (s.f * s.h) as f64;
    for (name, graph) in graphs {
        let us = common::mean_gpu_us(stream, 5, 50, || graph.launch().unwrap());
        println!("{test} E128 T4096 k8 H2048 F768: {name}: {us:.1} us ({:.0} TFLOP/s of fc2 dgrad)", flops / us * 1e-6);
    }
}

/// us per launch, graph replay, fused fc2 dgrad + SwiGLU backward against fc2 dgrad grouped
/// GEMM + SwiGLU backward (the routing build is outside both). Run: `cargo test --release
/// --test fused_dgrad_gpu fused_dgrad_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn fused_dgrad_timing() {
    let stream = gpu_or_skip!();
    if common::skip_under_sanitizer() {
        return;
    }
    let _lock = common::capture_lock();
    let mut r = timing_runner(&stream, Form::Drows, 11);
    let fused_graph = capture(&stream, || r.drows_launch(&stream, false)).unwrap();
    let unfused_graph = capture(&stream, || r.unfused(&stream)).unwrap();
    let gemm_graph = capture(&stream, || r.unfused_gemm(&stream)).unwrap();
    print_timings(
        "fused_dgrad_timing",
        &stream,
        &[
            ("fused fc2 dgrad + SwiGLU backward (dh only)", &fused_graph),
            ("fc2 dgrad grouped GEMM + SwiGLU backward", &unfused_graph),
            ("fc2 dgrad grouped GEMM alone", &gemm_graph),
        ],
    );
}

/// us per launch, graph replay: the gathered form (dh + dprob partials) against the drows
/// form (dh only; the drows buffer it reads is not counted). Run: `cargo test --release --test
/// fused_dgrad_gpu fused_dgrad_gathered_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn fused_dgrad_gathered_timing() {
    let stream = gpu_or_skip!();
    if common::skip_under_sanitizer() {
        return;
    }
    let _lock = common::capture_lock();
    let mut r = timing_runner(&stream, Form::Gathered, 31);
    let gathered_graph = capture(&stream, || r.launch(&stream)).unwrap();
    let drows_graph = capture(&stream, || r.drows_launch(&stream, false)).unwrap();
    print_timings(
        "fused_dgrad_gathered_timing",
        &stream,
        &[
            ("gathered fused dgrad (dy gather, dh + dprob partials)", &gathered_graph),
            ("drows fused dgrad (dh only)", &drows_graph),
        ],
    );
}
