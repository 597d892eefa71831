//! Grouped GEMM rows: the crate (eager and graph) against the cuBLAS baselines.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::baseline::{cublas_version, read_splits, CublasGroupedBatched, CublasLoop, DenseGemm, Operands};
use capturable_moe::dtype::DType;
use capturable_moe::graph::capture;
use capturable_moe::grouped_gemm::{GemmConfig, GemmOp, GroupedGemm, GroupedGemmSpec, WeightLayout};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::measure::{median, random_bf16, time, time_synced, Row, Sample};
use crate::Args;

/// A named grouped GEMM shape: E experts, `rows` routed rows, layer K -> N.
pub struct Shape {
    pub name: &'static str,
    pub experts: usize,
    pub rows: usize,
    pub k: usize,
    pub n: usize,
}

pub const SHAPES: &[Shape] = &[
    Shape { name: "mixtral_fc1", experts: 8, rows: 8192, k: 4096, n: 28672 },
    Shape { name: "dsv3_ep8_fc1", experts: 32, rows: 8192, k: 7168, n: 4096 },
    Shape { name: "dsv3_ep8_fc2", experts: 32, rows: 8192, k: 2048, n: 7168 },
    Shape { name: "qwen3moe_fc1", experts: 128, rows: 32768, k: 2048, n: 1536 },
    Shape { name: "qwen3moe_fc2", experts: 128, rows: 32768, k: 768, n: 2048 },
    Shape { name: "decode_fc1", experts: 64, rows: 1024, k: 2048, n: 2816 },
];

/// Shapes a report leaves out and `--shapes` takes (for sweeps): the grouped GEMMs of the
/// expert-path rows at the published shapes (E128 T32768 k8: 2048 rows per expert), which the
/// named shapes above (256 rows per expert at E >= 32) do not stand for.
pub const EXTRA_SHAPES: &[Shape] = &[
    Shape { name: "liger_fc1", experts: 128, rows: 262144, k: 2048, n: 1536 },
    Shape { name: "liger_fc2", experts: 128, rows: 262144, k: 768, n: 2048 },
    Shape { name: "sonic30b_fc1", experts: 128, rows: 262144, k: 4096, n: 1024 },
    Shape { name: "sonic30b_fc2", experts: 128, rows: 262144, k: 512, n: 4096 },
];

/// A named shape of either list.
pub fn find_shape(name: &str) -> Option<&'static Shape> {
    SHAPES.iter().chain(EXTRA_SHAPES).find(|s| s.name == name)
}

/// The routings [`routing`] draws (`--routing`).
pub const ROUTINGS: &[&str] = &["uniform", "zipf", "onehot", "balanced"];
/// The routings a report runs unless `--routing` names others.
pub const DEFAULT_ROUTINGS: &[&str] = &["uniform", "zipf", "onehot"];

/// m_splits as the torch anchor script draws them: uniform or zipf (weight 1/(e+1)) sampling
/// of every row's expert, or every row on one expert. `balanced` (not the script's) gives every
/// expert rows/E rows (the first rows % E one more): uniform's mean without its spread, so the
/// two rows show what the experts' partial last tiles cost.
pub fn routing(kind: &str, experts: usize, rows: usize, seed: u64) -> Result<Vec<i64>, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut splits = vec![0i64; experts];
    match kind {
        "uniform" => (0..rows).for_each(|_| splits[rng.random_range(0..experts)] += 1),
        "zipf" => {
            let weights: Vec<f64> = (0..experts).map(|e| 1.0 / (e + 1) as f64).collect();
            let total: f64 = weights.iter().sum();
            for _ in 0..rows {
                let mut x = rng.random_range(0.0..total);
                let e = weights.iter().position(|w| {
                    x -= w;
                    x < 0.0
                });
                splits[e.unwrap_or(experts - 1)] += 1;
            }
        }
        "onehot" => splits[0] = rows as i64,
        "balanced" => splits
            .iter_mut()
            .enumerate()
            .for_each(|(e, s)| *s = (rows / experts + usize::from(e < rows % experts)) as i64),
        other => return Err(format!("unknown routing {other}")),
    }
    Ok(splits)
}

pub fn op_name(op: GemmOp) -> &'static str {
    match op {
        GemmOp::Fprop => "fprop",
        GemmOp::Dgrad => "dgrad",
        GemmOp::Wgrad => "wgrad",
    }
}

/// Every implementation on one (shape, routing, op), each row pushed onto `rows` as soon as it
/// is measured (so a later panic keeps it).
pub fn bench_case(
    stream: &Arc<CudaStream>,
    args: &Args,
    shape: &Shape,
    routing_kind: &str,
    op: GemmOp,
    rows: &mut Vec<Row>,
) {
    let splits = routing(routing_kind, shape.experts, shape.rows, 7).unwrap();
    let mut spec = GroupedGemmSpec::new(op, shape.experts, shape.n, shape.k, shape.rows);
    spec.weight_layout = args.weight_layout;
    // Rows with transposed weights are told apart by the shape name.
    let shape_name = match args.weight_layout {
        WeightLayout::Enk => shape.name.to_string(),
        WeightLayout::Ekn => format!("{}@ekn", shape.name),
    };
    let plan = GroupedGemm::new(spec.clone(), stream).expect("plan");
    let (a_len, b_len, d_len) = spec.operand_lens();
    // Activation-shaped operands rotate over `sets` copies so that a timed call reads them from
    // HBM, not from the L2 the previous call left warm (the weights exceed L2 on every shape).
    let wgrad = op == GemmOp::Wgrad;
    let l2 =
        stream.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).unwrap_or(50 << 20) as usize;
    let rotated_bytes = 2 * if wgrad { a_len + b_len } else { a_len + d_len };
    let sets = (2 * l2).div_ceil(rotated_bytes.max(1)).clamp(1, 8);
    let copies = |rotated: bool| if rotated { sets } else { 1 };
    let a: Vec<_> = (0..sets).map(|i| random_bf16(stream, a_len, 1 + 10 * i as u64)).collect();
    let b: Vec<_> = (0..copies(wgrad)).map(|i| random_bf16(stream, b_len, 2 + 10 * i as u64)).collect();
    let mut d: Vec<_> = (0..copies(!wgrad)).map(|_| unsafe { stream.alloc::<bf16>(d_len) }.unwrap()).collect();
    let mut check = unsafe { stream.alloc::<bf16>(d_len) }.unwrap();
    // The crate's output on operand set 0, which every other implementation is checked against;
    // a buffer of its own, so that timed runs rotating over `d` never overwrite it.
    let mut reference = unsafe { stream.alloc::<bf16>(d_len) }.unwrap();
    let splits32: Vec<i32> = splits.iter().map(|&s| s as i32).collect();
    let m_splits = stream.clone_htod(&splits32).unwrap();
    let mut workspace = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    let flops = spec.flops(shape.rows);
    // HBM bytes each implementation must move (see `traffic_bytes`); GB/s = bytes / time.
    let capmoe_bytes = traffic_bytes(&spec, &splits, Traffic::Capmoe);
    let loop_bytes = traffic_bytes(&spec, &splits, Traffic::SkipsEmpty);
    let dense_bytes = traffic_bytes(&spec, &splits, Traffic::Dense);
    // Operands of set `i`, writing into `out`.
    let ops_at = |i: usize, out: &CudaSlice<bf16>| Operands {
        a: a[i % a.len()].device_ptr(stream).0,
        b: b[i % b.len()].device_ptr(stream).0,
        d: out.device_ptr(stream).0,
    };
    let mut push = |imp: &str, us: f64, host: Option<f64>, note: Option<String>| {
        let bytes = match imp {
            "cublas-dense" => dense_bytes,
            _ if imp.starts_with("capmoe") => capmoe_bytes,
            _ => loop_bytes,
        };
        rows.push(Row {
            shape: shape_name.clone(),
            routing: routing_kind.into(),
            op: op_name(op).into(),
            imp: imp.into(),
            us,
            tflops: flops / us * 1e-6,
            gbps: bytes / us * 1e-3,
            host_us: host,
            note,
        })
    };

    // The crate, eager: every launch writes its arguments from the device-side m_splits.
    let mut run_capmoe = |i: usize, d: &mut [CudaSlice<bf16>]| {
        let n = d.len();
        plan.run(stream, &a[i % a.len()], &b[i % b.len()], &mut d[i % n], &m_splits, None, &mut workspace)
            .expect("capmoe run");
    };
    if !args.sweep {
        let (us, host) = time(stream, args.reps, |i| run_capmoe(i, &mut d));
        push("capmoe", us, Some(host), Some(format!("{sets} rotated operand set(s)")));
        // The same calls timed one by one with a wait after each, as the torch anchor times
        // torch: the row to set beside torch-grouped-mm / torch-loop4 (both include their host
        // time).
        let us = time_synced(stream, args.reps, |i| run_capmoe(i, &mut d));
        push("capmoe-synced", us, None, Some("timed as torch_anchor.py: one call per event pair, synced".into()));
    }

    // The crate, captured once per operand set in a CUDA graph and replayed.
    let graphs: Vec<CudaGraph> = (0..sets)
        .map(|i| {
            capture(stream, || {
                run_capmoe(i, &mut d);
                Ok(())
            })
            .expect("capture")
        })
        .collect();
    graphs.iter().for_each(|g| g.upload().unwrap());
    let (us, host) = time(stream, args.reps, |i| graphs[i % sets].launch().unwrap());
    push("capmoe-graph", us, Some(host), None);
    drop(graphs);
    // The reference output for the other configs and the baselines: operand set 0.
    run_capmoe(0, std::slice::from_mut(&mut reference));
    // Its sampled elements, copied to the host once for every check below.
    let reference = Sample::of(stream, &reference, d_len).expect("copying the reference sample");

    // Other kernel configurations asked for with --configs, each checked against Auto's output.
    for &config in &args.configs {
        let (us, note) =
            match time_config(stream, args, &spec, config, &a, &b, &m_splits, &mut d, &mut check, &reference) {
                // Different tiles sum in a different order: agreement within bf16 rounding.
                Ok((us, err)) if err <= 1e-2 => (us, format!("relerr vs auto {err:.1e}")),
                Ok((_, err)) => {
                    (f64::NAN, format!("output disagrees with auto (relerr {err:.2e} > 1e-2), time not reported"))
                }
                Err(e) => (f64::NAN, format!("unavailable: {e}")),
            };
        push(&format!("capmoe-graph[{}]", config.name()), us, None, Some(note));
    }

    // Every cuBLAS baseline writes into `check` (zeroed first, so a baseline that writes
    // nothing fails) and must agree with the crate's `reference` before it is timed.
    let mut verify = |launch: &mut dyn FnMut(Operands) -> Result<(), String>| {
        stream.memset_zeros(&mut check).map_err(|e| format!("zeroing the check buffer: {e}"))?;
        launch(ops_at(0, &check))?;
        let err = reference.relerr_of(stream, &check).map_err(|e| format!("reading the output sample: {e}"))?;
        if err <= 1e-2 {
            Ok(())
        } else {
            Err(format!("output disagrees with capmoe (normwise relerr {err:.2e} > 1e-2), not timed"))
        }
    };

    // cuBLAS loops: the host reads m_splits back first (the sync TransformerEngine needs).
    let loops: &[(&str, usize)] =
        if args.sweep { &[] } else { &[("cublas-multistream", args.streams), ("cublas-single", 1)] };
    for &(imp, streams) in loops {
        let timed = CublasLoop::new(spec.clone(), stream, streams).map_err(|e| e.to_string()).and_then(|baseline| {
            time_with_readback(
                stream,
                args.reps,
                &m_splits,
                &mut verify,
                |i| ops_at(i, &d[i % d.len()]),
                |ops, splits| baseline.launch(stream, ops, splits),
            )
        });
        match timed {
            Ok((us, host, sync)) => push(imp, us, Some(host), Some(format!("m_splits readback {sync:.1} us"))),
            Err(e) => push(imp, f64::NAN, None, Some(format!("unavailable: {e}"))),
        }
    }

    // One cublasGemmGroupedBatchedEx call: also needs m_splits on the host (its sizes are host
    // arrays); the device pointer arrays are rebuilt and uploaded on every call.
    let imp = "cublas-grouped-batched";
    let timed = if args.sweep {
        Err("skipped (--sweep)".to_string())
    } else {
        CublasGroupedBatched::new(spec.clone(), stream).map_err(|e| e.to_string()).and_then(|mut baseline| {
            time_with_readback(
                stream,
                args.reps,
                &m_splits,
                &mut verify,
                |i| ops_at(i, &d[i % d.len()]),
                |ops, splits| baseline.launch(ops, splits),
            )
        })
    };
    match timed {
        Ok((us, host, sync)) => {
            push(imp, us, Some(host), Some(format!("m_splits readback {sync:.1} us; pointer arrays uploaded per call")))
        }
        Err(_) if args.sweep => {}
        Err(e) => push(imp, f64::NAN, None, Some(format!("unavailable: {e}"))),
    }

    // Dense cuBLAS over all rows at the same FLOPs: the ceiling (wgrad: one K = rows GEMM).
    let mut dense_us = f64::NAN;
    match DenseGemm::new(spec.clone(), stream) {
        Ok(dense) => {
            let mut failed = None;
            let (us, host) = time(stream, args.reps, |i| {
                if let Err(e) = dense.launch(ops_at(i, &d[i % d.len()]), shape.rows) {
                    failed.get_or_insert(e.to_string());
                }
            });
            match failed {
                None => {
                    dense_us = us;
                    push("cublas-dense", us, Some(host), None)
                }
                Some(e) => push("cublas-dense", f64::NAN, None, Some(format!("unavailable: {e}"))),
            }
        }
        Err(e) => push("cublas-dense", f64::NAN, None, Some(format!("unavailable: {e}"))),
    }

    if !args.sweep {
        push("cublaslt-grouped", f64::NAN, None, Some(format!("unavailable: {}", cublaslt_grouped_status(stream))));
    }

    // The HBM floor: every expert weight read once, at the bandwidth of a device-to-device copy.
    let mut copy_bytes_per_us = f64::NAN;
    match memcpy_floor(stream, args, shape) {
        Ok((floor_us, copy_us, host)) => {
            let weight_bytes = weight_bytes_of(shape);
            copy_bytes_per_us = weight_bytes / floor_us;
            rows.push(Row {
                shape: shape_name.clone(),
                routing: routing_kind.into(),
                op: op_name(op).into(),
                imp: "memcpy-floor".into(),
                us: floor_us,
                tflops: f64::NAN,
                gbps: weight_bytes / floor_us * 1e-3,
                host_us: Some(host),
                note: Some(format!(
                    "HBM floor: us = half of one D2D copy of all expert weights (E*N*K*2 = {:.0} MB \
                     read + written, copy {copy_us:.1} us), i.e. every weight moved once at copy \
                     bandwidth; GB/s = (read+write bytes)/copy time; >= 90% of floor means <= {:.1} us",
                    weight_bytes * 1e-6,
                    floor_us / 0.9
                )),
            });
            rows.push(roofline_row(&spec, &splits, copy_bytes_per_us, dense_us, rows.last().unwrap()));
        }
        Err(e) => push("memcpy-floor", f64::NAN, None, Some(format!("unavailable: {e}"))),
    }

    // Megatron's main-grad mode: the same wgrad accumulated into an fp32 dW.
    if wgrad && !args.sweep {
        let base = f32acc_row(&shape_name, routing_kind, op);
        let row = match time_wgrad_f32_accumulate(stream, args, &spec, &a, &b, &m_splits, &reference) {
            Ok((us, err)) if err <= 1e-2 => {
                let acc_spec = f32_accumulate(&spec);
                let bytes = traffic_bytes(&acc_spec, &splits, Traffic::Capmoe);
                let floor_us = bytes / copy_bytes_per_us;
                Row {
                    us,
                    tflops: flops / us * 1e-6,
                    gbps: bytes / us * 1e-3,
                    note: Some(format!(
                        "dW_e += dY_e^T X_e into fp32 (read and written): {:.0} MB at copy bandwidth = \
                         {floor_us:.1} us, {:.2}x that; relerr vs auto {err:.1e}",
                        bytes * 1e-6,
                        us / floor_us
                    )),
                    ..base
                }
            }
            Ok((_, err)) => Row {
                note: Some(format!("output disagrees with auto (relerr {err:.2e} > 1e-2), time not reported")),
                ..base
            },
            Err(e) => Row { note: Some(format!("unavailable: {e}")), ..base },
        };
        rows.push(row);
    }
}

/// All expert weights of `shape` in bf16 (what the memcpy-floor row copies).
fn weight_bytes_of(shape: &Shape) -> f64 {
    (shape.experts * shape.n * shape.k * 2) as f64
}

/// `spec` in the fp32 main-grad mode: fp32 dW, accumulated.
fn f32_accumulate(spec: &GroupedGemmSpec) -> GroupedGemmSpec {
    GroupedGemmSpec { out_dtype: DType::F32, accumulate: true, ..spec.clone() }
}

/// The `capmoe-graph-f32acc` row of one case, not yet measured.
fn f32acc_row(shape: &str, routing: &str, op: GemmOp) -> Row {
    Row {
        shape: shape.into(),
        routing: routing.into(),
        op: op_name(op).into(),
        imp: "capmoe-graph-f32acc".into(),
        us: f64::NAN,
        tflops: f64::NAN,
        gbps: f64::NAN,
        host_us: None,
        note: None,
    }
}

/// Graph-replay time of the wgrad accumulating into an fp32 dW (Auto's config), over the rotated
/// operand sets, and the normwise error of one accumulation of set 0 into a zeroed dW against
/// `reference` (the plain wgrad's bf16 output of set 0).
#[allow(clippy::too_many_arguments)]
fn time_wgrad_f32_accumulate(
    stream: &Arc<CudaStream>,
    args: &Args,
    spec: &GroupedGemmSpec,
    a: &[CudaSlice<bf16>],
    b: &[CudaSlice<bf16>],
    m_splits: &CudaSlice<i32>,
    reference: &Sample,
) -> Result<(f64, f64), String> {
    let spec = f32_accumulate(spec);
    let plan = GroupedGemm::new(spec.clone(), stream).map_err(|e| e.to_string())?;
    let mut workspace = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1)).map_err(|e| e.to_string())?;
    let mut dw = stream.alloc_zeros::<f32>(spec.operand_lens().2).map_err(|e| e.to_string())?;
    let sets = a.len().max(b.len());
    let graphs = (0..sets)
        .map(|i| {
            capture(stream, || {
                plan.run(stream, &a[i % a.len()], &b[i % b.len()], &mut dw, m_splits, None, &mut workspace)
            })
        })
        .collect::<capturable_moe::Result<Vec<CudaGraph>>>()
        .map_err(|e| e.to_string())?;
    graphs.iter().for_each(|g| g.upload().unwrap());
    let (us, _host) = time(stream, args.reps, |i| graphs[i % sets].launch().unwrap());
    drop(graphs);
    stream.memset_zeros(&mut dw).map_err(|e| e.to_string())?;
    plan.run(stream, &a[0], &b[0], &mut dw, m_splits, None, &mut workspace).map_err(|e| e.to_string())?;
    Ok((us, reference.relerr_of_f32(stream, &dw).map_err(|e| e.to_string())?))
}

/// The time the op needs at least: max(the bytes it must move at copy bandwidth, dense cuBLAS
/// at the same FLOPs). The bytes are every touched weight read once for fprop / dgrad (the
/// `memcpy-floor` row), and dY + X + dW (all E, the zero-filled empty experts included) for
/// wgrad. `bytes_per_us` is the copy bandwidth the memcpy-floor row measured; `floor` is that
/// row, whose labels the roofline row takes.
fn roofline_row(spec: &GroupedGemmSpec, splits: &[i64], bytes_per_us: f64, dense_us: f64, floor: &Row) -> Row {
    let active = splits.iter().filter(|&&s| s > 0).count();
    let weight_read = (active * spec.n * spec.k * spec.dtype.size_bytes()) as f64;
    let compulsory = traffic_bytes(spec, splits, Traffic::Capmoe);
    let traffic_us = if spec.op == GemmOp::Wgrad { compulsory } else { weight_read } / bytes_per_us;
    let (us, bound) = if dense_us > traffic_us { (dense_us, "dense cuBLAS") } else { (traffic_us, "copy bandwidth") };
    Row {
        imp: "roofline".into(),
        us,
        tflops: spec.flops(splits.iter().map(|&s| s.max(0) as usize).sum()) / us * 1e-6,
        gbps: f64::NAN,
        host_us: None,
        note: Some(format!(
            "max(dense cuBLAS {dense_us:.1} us, {} at copy bandwidth {traffic_us:.1} us): bound by {bound}; \
             every operand once (X/dY, W, Y) at copy bandwidth would be {:.1} us",
            if spec.op == GemmOp::Wgrad { "dY + X + dW" } else { "the touched weights" },
            compulsory / bytes_per_us
        )),
        ..floor.clone()
    }
}

/// Which operands an implementation touches, for [`traffic_bytes`].
#[derive(Clone, Copy)]
enum Traffic {
    /// The crate: like `SkipsEmpty`, but plain (non-accumulating) wgrad also writes a zero
    /// gradient for every empty expert (the contract), so all E of dW are written.
    Capmoe,
    /// The cuBLAS loops and grouped-batched call: one GEMM per non-empty expert only.
    SkipsEmpty,
    /// One GEMM over all valid rows with one [N, K] weight (cublas-dense).
    Dense,
}

/// The bytes an implementation must move to and from HBM at least (each operand element once):
/// with `rows` the valid rows (sum of m_splits) and `w` the weight matrices touched (experts
/// with rows; 1 for dense),
///   fprop  rows*K (X)  + w*N*K (W)       + rows*N (Y, written)
///   dgrad  rows*N (dY) + w*N*K (W)       + rows*K (dX, written)
///   wgrad  rows*N (dY) + rows*K (X)      + w'*N*K (dW, written; also read when accumulating)
/// in each operand's element size, where w' = E for the crate's plain wgrad (zero fill of empty
/// experts) and w otherwise. So one-hot routing counts one expert's weights, not all E.
fn traffic_bytes(spec: &GroupedGemmSpec, splits: &[i64], traffic: Traffic) -> f64 {
    let rows = splits.iter().map(|&s| s.max(0) as usize).sum::<usize>();
    let active = splits.iter().filter(|&&s| s > 0).count();
    let weights = match traffic {
        Traffic::Dense => 1,
        Traffic::Capmoe | Traffic::SkipsEmpty => active,
    };
    let (n, k) = (spec.n, spec.k);
    let (el, out_el) = (spec.dtype.size_bytes(), spec.out_dtype.size_bytes());
    let bytes = match spec.op {
        GemmOp::Fprop => rows * k * el + weights * n * k * el + rows * n * out_el,
        GemmOp::Dgrad => rows * n * el + weights * n * k * el + rows * k * out_el,
        GemmOp::Wgrad => {
            let written = match traffic {
                Traffic::Capmoe if !spec.accumulate => spec.num_experts,
                _ => weights,
            };
            let read_back = if spec.accumulate { weights } else { 0 };
            rows * (n + k) * el + (written + read_back) * n * k * out_el
        }
    };
    bytes as f64
}

/// Graph-replay time of one explicit configuration over the rotated operand sets, its output
/// rotated over `outs` exactly as the `Auto` rows do, and the normwise error of its set-0 output
/// (computed into `check`) against `reference` (the sample of set 0 under `Auto`).
#[allow(clippy::too_many_arguments)]
fn time_config(
    stream: &Arc<CudaStream>,
    args: &Args,
    spec: &GroupedGemmSpec,
    config: GemmConfig,
    a: &[CudaSlice<bf16>],
    b: &[CudaSlice<bf16>],
    m_splits: &CudaSlice<i32>,
    outs: &mut [CudaSlice<bf16>],
    check: &mut CudaSlice<bf16>,
    reference: &Sample,
) -> Result<(f64, f64), String> {
    let plan = GroupedGemm::new(GroupedGemmSpec { config, ..spec.clone() }, stream).map_err(|e| e.to_string())?;
    let mut workspace = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1)).map_err(|e| e.to_string())?;
    let sets = a.len().max(b.len());
    let n_out = outs.len();
    let graphs = (0..sets)
        .map(|i| {
            let out = &mut outs[i % n_out];
            capture(stream, || plan.run(stream, &a[i % a.len()], &b[i % b.len()], out, m_splits, None, &mut workspace))
        })
        .collect::<capturable_moe::Result<Vec<CudaGraph>>>()
        .map_err(|e| e.to_string())?;
    graphs.iter().for_each(|g| g.upload().unwrap());
    let (us, _host) = time(stream, args.reps, |i| graphs[i % sets].launch().unwrap());
    drop(graphs);
    stream.memset_zeros(check).map_err(|e| e.to_string())?;
    plan.run(stream, &a[0], &b[0], check, m_splits, None, &mut workspace).map_err(|e| e.to_string())?;
    Ok((us, reference.relerr_of(stream, check).map_err(|e| e.to_string())?))
}

/// Why the cuBLASLt grouped matmul with device-side sizes is not in the report.
fn cublaslt_grouped_status(stream: &Arc<CudaStream>) -> String {
    let ctx = stream.context();
    let hopper = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).ok() == Some(9);
    let (need, on) = if hopper { ((13, 4), " on Hopper") } else { ((13, 3), "") };
    match cublas_version() {
        Ok((major, minor, patch)) if (major, minor) < need => format!(
            "cuBLAS {major}.{minor}.{patch} found, grouped matmul with device-side sizes needs {}.{}+{on}",
            need.0, need.1
        ),
        Ok((major, minor, patch)) => {
            format!("cuBLAS {major}.{minor}.{patch} supports it but this report does not implement it yet")
        }
        Err(e) => format!(
            "cuBLAS version unknown ({e}); grouped matmul with device-side sizes needs {}.{}+{on}",
            need.0, need.1
        ),
    }
}

/// (floor us, copy us, host us) of one shape, or why it could not be measured.
type Floor = Result<(f64, f64, f64), String>;

/// One shape's floor, measured once and reused by its other (routing, op) cases.
fn memcpy_floor(stream: &Arc<CudaStream>, args: &Args, shape: &Shape) -> Floor {
    static FLOORS: Mutex<BTreeMap<&'static str, Floor>> = Mutex::new(BTreeMap::new());
    let mut floors = FLOORS.lock().unwrap_or_else(|e| e.into_inner());
    floors
        .entry(shape.name)
        .or_insert_with(|| {
            let len = shape.experts * shape.n * shape.k;
            let src = random_bf16(stream, len, 3);
            let mut dst = unsafe { stream.alloc::<bf16>(len) }.map_err(|e| format!("alloc {len} bf16: {e}"))?;
            let mut failed = None;
            let (copy_us, host) = time(stream, args.reps, |_| {
                if let Err(e) = stream.memcpy_dtod(&src, &mut dst) {
                    failed.get_or_insert(e.to_string());
                }
            });
            failed.map_or(Ok((copy_us / 2.0, copy_us, host)), Err)
        })
        .clone()
}

/// Checks, then times, a baseline that needs m_splits on the host: every call reads them back
/// (the GPU->CPU sync) and then launches. Returns (GPU us, host us, median readback us).
fn time_with_readback(
    stream: &Arc<CudaStream>,
    reps: usize,
    m_splits: &CudaSlice<i32>,
    verify: &mut impl FnMut(&mut dyn FnMut(Operands) -> Result<(), String>) -> Result<(), String>,
    ops_at: impl Fn(usize) -> Operands,
    mut launch: impl FnMut(Operands, &[i64]) -> capturable_moe::Result<()>,
) -> Result<(f64, f64, f64), String> {
    verify(&mut |ops| {
        let host_splits = read_splits(stream, m_splits).map_err(|e| e.to_string())?;
        launch(ops, &host_splits).map_err(|e| e.to_string())
    })?;
    let mut readback_us = Vec::new();
    let mut failed = None;
    let (us, host) = time(stream, reps, |i| {
        let t = Instant::now();
        let launched = read_splits(stream, m_splits).and_then(|host_splits| {
            readback_us.push(t.elapsed().as_secs_f64() * 1e6);
            launch(ops_at(i), &host_splits)
        });
        if let Err(e) = launched {
            failed.get_or_insert(e.to_string());
        }
    });
    match failed {
        Some(e) => Err(e),
        None => Ok((us, host, median(&mut readback_us))),
    }
}

#[cfg(test)]
mod tests {
    use super::routing;

    #[test]
    fn balanced_routing_spreads_rows_evenly() {
        assert_eq!(routing("balanced", 4, 10, 0).unwrap(), [3, 3, 2, 2]);
        let uniform = routing("uniform", 32, 8192, 7).unwrap();
        assert_eq!(uniform.iter().sum::<i64>(), 8192);
        assert!(uniform.iter().any(|&s| s != 256), "uniform routing draws, so its counts spread");
    }
}
