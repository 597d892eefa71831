//! capmoe-bench: the crate's benchmark report. On the GPU it times the grouped GEMM (eager and
//! CUDA-graph replay) against the cuBLAS baselines on named MoE shapes and routings, prints
//! `shape | routing | op | impl | us | TFLOP/s | GB/s | x multi-stream | x dense`, and writes
//! `bench/results/<gpu>.json`. Without a GPU it says why and exits with status 2.
//!
//!   capmoe-bench [--shapes a,b] [--routing uniform,zipf,onehot] [--ops fprop,dgrad,wgrad]
//!                [--streams 4] [--reps 30] [--anchors torch_anchor.json] [--out DIR] [--quick]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use capturable_moe::baseline::{read_splits, CublasLoop, DenseGemm, Operands};
use capturable_moe::device::{open, DeviceInfo};
use capturable_moe::grouped_gemm::{GemmOp, GroupedGemm, GroupedGemmSpec};
use cudarc::driver::sys::{CUdevice_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A named grouped GEMM shape: E experts, `rows` routed rows, layer K -> N.
struct Shape {
    name: &'static str,
    experts: usize,
    rows: usize,
    k: usize,
    n: usize,
}

const SHAPES: &[Shape] = &[
    Shape { name: "mixtral_fc1", experts: 8, rows: 8192, k: 4096, n: 28672 },
    Shape { name: "dsv3_ep8_fc1", experts: 32, rows: 8192, k: 7168, n: 4096 },
    Shape { name: "dsv3_ep8_fc2", experts: 32, rows: 8192, k: 2048, n: 7168 },
    Shape { name: "qwen3moe_fc1", experts: 128, rows: 32768, k: 2048, n: 1536 },
    Shape { name: "qwen3moe_fc2", experts: 128, rows: 32768, k: 768, n: 2048 },
    Shape { name: "decode_fc1", experts: 64, rows: 1024, k: 2048, n: 2816 },
];

struct Args {
    shapes: Vec<String>,
    routings: Vec<String>,
    ops: Vec<GemmOp>,
    streams: usize,
    reps: usize,
    anchors: Option<String>,
    out: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        shapes: SHAPES.iter().map(|s| s.name.to_string()).collect(),
        routings: vec!["uniform".into(), "zipf".into(), "onehot".into()],
        ops: vec![GemmOp::Fprop, GemmOp::Dgrad, GemmOp::Wgrad],
        streams: 4,
        reps: 30,
        anchors: None,
        out: "bench/results".into(),
    };
    let mut it = std::env::args().skip(1);
    let list = |v: Option<String>| -> Result<Vec<String>, String> {
        Ok(v.ok_or("missing value")?.split(',').map(str::to_string).collect())
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--shapes" => args.shapes = list(it.next())?,
            "--routing" => args.routings = list(it.next())?,
            "--ops" => {
                args.ops = list(it.next())?
                    .iter()
                    .map(|o| match o.as_str() {
                        "fprop" => Ok(GemmOp::Fprop),
                        "dgrad" => Ok(GemmOp::Dgrad),
                        "wgrad" => Ok(GemmOp::Wgrad),
                        other => Err(format!("unknown op {other}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--streams" => args.streams = it.next().and_then(|v| v.parse().ok()).ok_or("--streams N")?,
            "--reps" => args.reps = it.next().and_then(|v| v.parse().ok()).ok_or("--reps N")?,
            "--anchors" => args.anchors = Some(it.next().ok_or("--anchors FILE")?),
            "--out" => args.out = it.next().ok_or("--out DIR")?,
            "--quick" => {
                args.reps = 10;
                args.routings = vec!["uniform".into()];
            }
            "-h" | "--help" => {
                println!("{}", include_str!("capmoe-bench.rs").lines().take(8).collect::<Vec<_>>().join("\n"));
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other} (try --help)")),
        }
    }
    for s in &args.shapes {
        if !SHAPES.iter().any(|shape| shape.name == s) {
            return Err(format!("unknown shape {s}"));
        }
    }
    Ok(args)
}

/// m_splits as the torch anchor script draws them: uniform or zipf (weight 1/(e+1)) sampling
/// of every row's expert, or every row on one expert.
fn routing(kind: &str, experts: usize, rows: usize, seed: u64) -> Result<Vec<i64>, String> {
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
        other => return Err(format!("unknown routing {other}")),
    }
    Ok(splits)
}

/// A device buffer of random non-zero bf16, filled by tiling one random host block.
fn random_bf16(stream: &Arc<CudaStream>, len: usize, seed: u64) -> CudaSlice<bf16> {
    const BLOCK: usize = 1 << 22;
    let mut rng = StdRng::seed_from_u64(seed);
    let block: Vec<bf16> = (0..BLOCK.min(len))
        .map(|_| {
            let x: f32 = rng.random_range(0.05..1.0);
            bf16::from_f32(if rng.random_bool(0.5) { x } else { -x })
        })
        .collect();
    let mut buf = unsafe { stream.alloc::<bf16>(len) }.expect("alloc");
    let mut at = 0;
    while at < len {
        let n = block.len().min(len - at);
        let mut view = buf.slice_mut(at..at + n);
        stream.memcpy_htod(&block[..n], &mut view).expect("upload");
        at += n;
    }
    buf
}

/// Median GPU time (CUDA events around each call) and median host enqueue time, in us.
fn time(stream: &Arc<CudaStream>, reps: usize, mut enqueue: impl FnMut(usize)) -> (f64, f64) {
    let ctx = stream.context();
    for i in 0..3 {
        enqueue(i);
    }
    stream.synchronize().unwrap();
    let mut gpu = Vec::with_capacity(reps);
    let mut host = Vec::with_capacity(reps);
    for i in 0..reps {
        let start = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
        let end = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
        start.record(stream).unwrap();
        let t = Instant::now();
        enqueue(i);
        host.push(t.elapsed().as_secs_f64() * 1e6);
        end.record(stream).unwrap();
        end.synchronize().unwrap();
        gpu.push(start.elapsed_ms(&end).unwrap() as f64 * 1e3);
    }
    (median(&mut gpu), median(&mut host))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[derive(Clone)]
struct Row {
    shape: String,
    routing: String,
    op: String,
    imp: String,
    us: f64,
    tflops: f64,
    gbps: f64,
    host_us: Option<f64>,
    note: Option<String>,
}

/// Normwise relative error of `got` against `want` over a deterministic sample of elements.
fn sampled_relerr(stream: &Arc<CudaStream>, got: &CudaSlice<bf16>, want: &CudaSlice<bf16>, valid: usize) -> f64 {
    let g = stream.clone_dtoh(got).unwrap();
    let w = stream.clone_dtoh(want).unwrap();
    let step = (valid / 4_000_000).max(1);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for i in (0..valid).step_by(step) {
        let (a, b) = (g[i].to_f64(), w[i].to_f64());
        if a.is_nan() {
            return f64::NAN;
        }
        diff += (a - b) * (a - b);
        norm += b * b;
    }
    (diff / norm.max(1e-30)).sqrt()
}

fn op_name(op: GemmOp) -> &'static str {
    match op {
        GemmOp::Fprop => "fprop",
        GemmOp::Dgrad => "dgrad",
        GemmOp::Wgrad => "wgrad",
    }
}

/// Every implementation on one (shape, routing, op).
fn bench_case(stream: &Arc<CudaStream>, args: &Args, shape: &Shape, routing_kind: &str, op: GemmOp) -> Vec<Row> {
    let splits = routing(routing_kind, shape.experts, shape.rows, 7).unwrap();
    let spec = GroupedGemmSpec::new(op, shape.experts, shape.n, shape.k, shape.rows);
    let plan = GroupedGemm::new(spec.clone(), stream).expect("plan");
    let (a_len, b_len, d_len) = spec.operand_lens();
    let a = random_bf16(stream, a_len, 1);
    let b = random_bf16(stream, b_len, 2);
    let mut d = unsafe { stream.alloc::<bf16>(d_len) }.unwrap();
    let check = unsafe { stream.alloc::<bf16>(d_len) }.unwrap();
    let splits32: Vec<i32> = splits.iter().map(|&s| s as i32).collect();
    let m_splits = stream.clone_htod(&splits32).unwrap();
    let mut workspace = stream.alloc_zeros::<u8>(plan.workspace_bytes()).unwrap();
    let flops = spec.flops(shape.rows);
    let bytes = ((a_len + b_len + d_len) * 2) as f64;
    let ops_of = |d: &CudaSlice<bf16>| Operands {
        a: a.device_ptr(stream).0,
        b: b.device_ptr(stream).0,
        d: d.device_ptr(stream).0,
    };
    let mut rows = Vec::new();
    let mut push = |imp: &str, us: f64, host: Option<f64>, note: Option<String>| {
        rows.push(Row {
            shape: shape.name.into(),
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
    let mut run_capmoe = |d: &mut CudaSlice<bf16>| {
        plan.run(stream, &a, &b, d, &m_splits, None, &mut workspace).expect("capmoe run");
    };
    run_capmoe(&mut d);
    let (us, host) = time(stream, args.reps, |_| run_capmoe(&mut d));
    push("capmoe", us, Some(host), None);

    // The crate, captured once in a CUDA graph and replayed.
    let ctx = stream.context().clone();
    unsafe { ctx.disable_event_tracking() };
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    run_capmoe(&mut d);
    let graph: CudaGraph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().unwrap();
    unsafe { ctx.enable_event_tracking() };
    graph.upload().unwrap();
    let (us, host) = time(stream, args.reps, |_| graph.launch().unwrap());
    push("capmoe-graph", us, Some(host), None);
    drop(graph);

    // cuBLAS loops: the host reads m_splits back first (the sync TransformerEngine needs).
    for (imp, streams) in [("cublas-multistream", args.streams), ("cublas-single", 1)] {
        match CublasLoop::new(spec.clone(), stream, streams) {
            Ok(baseline) => {
                let ops = ops_of(&check);
                let host_splits = read_splits(stream, &m_splits).unwrap();
                baseline.launch(stream, ops, &host_splits).unwrap();
                let err = sampled_relerr(stream, &check, &d, d_len);
                assert!(err <= 1e-2, "{imp} disagrees with capmoe on {} {op:?}: relerr {err:.2e}", shape.name);
                let mut sync_us = Vec::new();
                let (us, host) = time(stream, args.reps, |_| {
                    let t = Instant::now();
                    let host_splits = read_splits(stream, &m_splits).unwrap();
                    sync_us.push(t.elapsed().as_secs_f64() * 1e6);
                    baseline.launch(stream, ops, &host_splits).unwrap();
                });
                push(imp, us, Some(host), Some(format!("m_splits readback {:.1} us", median(&mut sync_us))));
            }
            Err(e) => push(imp, f64::NAN, None, Some(format!("unavailable: {e}"))),
        }
    }

    // Dense cuBLAS over all rows at the same FLOPs: the ceiling (wgrad: one K = rows GEMM).
    match DenseGemm::new(spec.clone(), stream) {
        Ok(dense) => {
            let ops = ops_of(&check);
            let (us, host) = time(stream, args.reps, |_| dense.launch(ops, shape.rows).unwrap());
            push("cublas-dense", us, Some(host), None);
        }
        Err(e) => push("cublas-dense", f64::NAN, None, Some(format!("unavailable: {e}"))),
    }
    for imp in ["cublas-grouped-batched", "cublaslt-grouped"] {
        push(imp, f64::NAN, None, Some("unavailable: not implemented in this version of the report".into()));
    }
    rows
}

/// Rows of the torch anchor JSON that match the benchmarked shapes (by E, rows, K, N).
fn anchor_rows(path: &str) -> Result<Vec<Row>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let mut rows = Vec::new();
    for r in json["gemm"].as_array().into_iter().flatten() {
        let dims = |k: &str| r[k].as_u64().unwrap_or(0) as usize;
        let Some(shape) = SHAPES
            .iter()
            .find(|s| s.experts == dims("E") && s.rows == dims("M") && s.k == dims("K") && s.n == dims("N"))
        else {
            continue;
        };
        let flops = 2.0 * (shape.rows * shape.k * shape.n) as f64;
        let bytes = ((shape.rows * shape.k + shape.experts * shape.k * shape.n + shape.rows * shape.n) * 2) as f64;
        for (key, imp) in [("grouped_ms", "torch-grouped-mm"), ("loop4_ms", "torch-loop4"), ("dense_ms", "torch-dense")] {
            if let Some(ms) = r[key].as_f64() {
                let us = ms * 1e3;
                rows.push(Row {
                    shape: shape.name.into(),
                    routing: r["skew"].as_str().unwrap_or("?").into(),
                    op: "fprop".into(),
                    imp: imp.into(),
                    us,
                    tflops: flops / us * 1e-6,
                    gbps: bytes / us * 1e-3,
                    host_us: None,
                    note: Some("torch_anchor.py, same call".into()),
                });
            }
        }
    }
    Ok(rows)
}

fn print_table(rows: &[Row]) {
    let key = |r: &Row| (r.shape.clone(), r.routing.clone(), r.op.clone());
    let mut reference: BTreeMap<(String, String, String), (f64, f64)> = BTreeMap::new();
    for r in rows {
        let entry = reference.entry(key(r)).or_insert((f64::NAN, f64::NAN));
        match r.imp.as_str() {
            "cublas-multistream" => entry.0 = r.us,
            "cublas-dense" => entry.1 = r.us,
            _ => {}
        }
    }
    println!(
        "{:<14} | {:<8} | {:<6} | {:<22} | {:>9} | {:>8} | {:>7} | {:>14} | {:>7}",
        "shape", "routing", "op", "impl", "us", "TFLOP/s", "GB/s", "x multi-stream", "x dense"
    );
    for r in rows {
        let (multi, dense) = reference.get(&key(r)).copied().unwrap_or((f64::NAN, f64::NAN));
        if r.us.is_nan() {
            println!("{:<14} | {:<8} | {:<6} | {:<22} | {}", r.shape, r.routing, r.op, r.imp, r.note.clone().unwrap_or_default());
            continue;
        }
        println!(
            "{:<14} | {:<8} | {:<6} | {:<22} | {:>9.1} | {:>8.1} | {:>7.0} | {:>14.2} | {:>7.2}",
            r.shape, r.routing, r.op, r.imp, r.us, r.tflops, r.gbps, multi / r.us, dense / r.us
        );
    }
}

fn write_json(path: &str, device: &DeviceInfo, clocks: (i32, i32), rows: &[Row]) -> std::io::Result<()> {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "shape": r.shape, "routing": r.routing, "op": r.op, "impl": r.imp,
                "us": if r.us.is_nan() { serde_json::Value::Null } else { r.us.into() },
                "tflops": if r.us.is_nan() { serde_json::Value::Null } else { r.tflops.into() },
                "gbps": if r.us.is_nan() { serde_json::Value::Null } else { r.gbps.into() },
                "host_us": r.host_us, "note": r.note,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "gpu": device.name,
        "sm_count": device.sm_count,
        "sm_clock_mhz": clocks.0 / 1000,
        "memory_clock_mhz": clocks.1 / 1000,
        "commit": std::env::var("CAPMOE_COMMIT").unwrap_or_else(|_| "unknown".into()),
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "rows": rows,
    });
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap())
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("capmoe-bench: {e}");
            std::process::exit(64);
        }
    };
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(reason) => {
            eprintln!("capmoe-bench: no GPU to benchmark on: {reason}");
            eprintln!("capmoe-bench: run it on a machine with an H100 (or other SM90/SM100 GPU) and the NVIDIA driver.");
            std::process::exit(2);
        }
    };
    let stream = ctx.new_stream().expect("stream");
    let device = DeviceInfo::of_stream(&stream).expect("device info");
    let clocks = (
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).unwrap_or(0),
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0),
    );
    eprintln!("capmoe-bench on {} ({} SMs)", device.name, device.sm_count);

    let mut rows = Vec::new();
    let shapes: Vec<&Shape> = SHAPES.iter().filter(|s| args.shapes.iter().any(|n| n == s.name)).collect();
    let total = shapes.len() * args.routings.len() * args.ops.len();
    let mut done = 0;
    for shape in &shapes {
        for routing_kind in &args.routings {
            for &op in &args.ops {
                done += 1;
                eprintln!("[{done}/{total}] {} {routing_kind} {}", shape.name, op_name(op));
                rows.extend(bench_case(&stream, &args, shape, routing_kind, op));
            }
        }
    }
    if let Some(path) = &args.anchors {
        match anchor_rows(path) {
            Ok(anchor) => rows.extend(anchor),
            Err(e) => eprintln!("capmoe-bench: anchors not merged: {e}"),
        }
    }
    rows.sort_by(|a, b| (&a.shape, &a.routing, &a.op).cmp(&(&b.shape, &b.routing, &b.op)));
    let file: String = device.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let path = format!("{}/{file}.json", args.out);
    match write_json(&path, &device, clocks, &rows) {
        Ok(()) => eprintln!("wrote {path}"),
        Err(e) => eprintln!("capmoe-bench: could not write {path}: {e}"),
    }
    print_table(&rows);
}
