//! capmoe-bench: the crate's benchmark report. On the GPU it times the grouped GEMM (eager and
//! CUDA-graph replay) against the cuBLAS baselines on named MoE shapes and routings, prints
//! `shape | routing | op | impl | us | TFLOP/s | GB/s | x multi-stream | x dense`, and writes
//! `bench/results/<gpu>.json` and `<gpu>.png`. Without a GPU it says why and exits with status 2.
//!
//!   capmoe-bench [--shapes a,b] [--routing uniform,zipf,onehot] [--ops fprop,dgrad,wgrad]
//!                [--streams 4] [--reps 30] [--anchors torch_anchor.json] [--out DIR] [--quick]
//!                [--no-paths]   (skip the expert-path, graph-module, EP and Echo planner rows)
//!                [--configs sm90-coop,sm90-pingpong128,...]  (also time these kernel configs)
//!                [--weight-layout enk|ekn]  (weights [E, N, K], the default, or [E, K, N])
//!                [--only echo|graphs]  (the Echo planner rows, or the graph-module rows, alone)
//!                [--sweep]  (a config sweep: graph rows, dense cuBLAS, floor and roofline only;
//!                            no eager rows, no cuBLAS loops)

mod baseline;
mod data;
mod echo_timing;
mod ep;
mod ep_layer;
mod gemm;
mod graphs;
mod measure;
mod path;
mod plot;
mod report;

use capturable_moe::device::{open, DeviceInfo};
use capturable_moe::grouped_gemm::{GemmConfig, GemmOp, WeightLayout};
use cudarc::driver::sys::CUdevice_attribute;

use gemm::{bench_case, op_name, Shape, SHAPES};

struct Args {
    pub shapes: Vec<String>,
    pub routings: Vec<String>,
    pub ops: Vec<GemmOp>,
    pub streams: usize,
    pub reps: usize,
    pub anchors: Option<String>,
    pub out: String,
    /// Also time the whole expert path and the Echo planner.
    pub paths: bool,
    /// Explicit kernel configurations timed beside `Auto` (`--configs`).
    pub configs: Vec<GemmConfig>,
    /// Weight layout of every GEMM row (`--weight-layout enk|ekn`).
    pub weight_layout: WeightLayout,
    /// Only one family of rows (`--only`).
    pub only: Option<Only>,
    /// A config sweep: skip the eager rows and the cuBLAS loop baselines (`--sweep`).
    pub sweep: bool,
}

/// The row families `--only` selects.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Only {
    /// The Echo planner rows.
    Echo,
    /// The graph-module rows (pool, one graph for every T, update, first replay).
    Graphs,
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
        paths: true,
        configs: Vec::new(),
        weight_layout: WeightLayout::Enk,
        only: None,
        sweep: false,
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
            "--no-paths" => args.paths = false,
            "--weight-layout" => {
                args.weight_layout = match it.next().as_deref() {
                    Some("enk") => WeightLayout::Enk,
                    Some("ekn") => WeightLayout::Ekn,
                    _ => return Err("--weight-layout enk|ekn".into()),
                }
            }
            "--configs" => {
                args.configs = list(it.next())?
                    .iter()
                    .map(|name| GemmConfig::from_name(name).ok_or(format!("unknown config {name}")))
                    .collect::<Result<_, _>>()?
            }
            "--only" => match it.next().as_deref() {
                Some("echo") => args.only = Some(Only::Echo),
                Some("graphs") => args.only = Some(Only::Graphs),
                other => return Err(format!("--only takes `echo` or `graphs`, got {other:?}")),
            },
            "--sweep" => {
                args.sweep = true;
                args.paths = false;
            }
            "--quick" => {
                args.reps = 10;
                args.routings = vec!["uniform".into()];
            }
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("main.rs").lines().take_while(|l| l.starts_with("//!")).collect::<Vec<_>>().join("\n")
                );
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
            eprintln!(
                "capmoe-bench: run it on a machine with an H100 (or other SM90/SM100 GPU) and the NVIDIA driver."
            );
            std::process::exit(2);
        }
    };
    let stream = ctx.new_stream().expect("stream");
    let device = DeviceInfo::of_stream(&stream).expect("device info");
    // The maximum (peak) SM and memory clocks in kHz, as the driver reports them: not the
    // clocks the GPU actually ran at during the measurements (nothing here samples those).
    let max_clocks_khz = (
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).unwrap_or(0),
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0),
    );
    eprintln!(
        "capmoe-bench on {} ({} SMs, max SM clock {} MHz, max memory clock {} MHz)",
        device.name,
        device.sm_count,
        max_clocks_khz.0 / 1000,
        max_clocks_khz.1 / 1000
    );

    let mut rows = Vec::new();
    let shapes: Vec<&Shape> = SHAPES.iter().filter(|s| args.shapes.iter().any(|n| n == s.name)).collect();
    let total = shapes.len() * args.routings.len() * args.ops.len();
    let mut done = 0;
    let everything = args.only.is_none();
    for shape in shapes.iter().filter(|_| everything) {
        for routing_kind in &args.routings {
            for &op in &args.ops {
                done += 1;
                eprintln!("[{done}/{total}] {} {routing_kind} {}", shape.name, op_name(op));
                rows.extend(bench_case(&stream, &args, shape, routing_kind, op));
            }
        }
    }
    if args.paths && everything {
        rows.extend(path::expert_rows(&stream, args.reps));
    }
    if (args.paths && everything) || args.only == Some(Only::Graphs) {
        rows.extend(graphs::graph_rows(&stream, args.reps));
    }
    if args.paths && everything {
        rows.extend(ep::ep_rows(&stream, args.reps));
        rows.extend(ep_layer::ep_layer_rows(&stream, args.reps));
    }
    if (args.paths && everything) || args.only == Some(Only::Echo) {
        rows.extend(path::echo_rows(&stream, args.reps));
    }
    if let Some(path) = &args.anchors {
        match report::anchor_rows(path) {
            Ok(anchor) => rows.extend(anchor),
            Err(e) => eprintln!("capmoe-bench: anchors not merged: {e}"),
        }
    }
    rows.sort_by(|a, b| (&a.shape, &a.routing, &a.op).cmp(&(&b.shape, &b.routing, &b.op)));
    let file: String = device.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let path = format!("{}/{file}.json", args.out);
    match report::write_json(&path, &device, max_clocks_khz, &rows) {
        Ok(()) => eprintln!("wrote {path}"),
        Err(e) => eprintln!("capmoe-bench: could not write {path}: {e}"),
    }
    let png = format!("{}/{file}.png", args.out);
    plot::write_png(&png, &device.name, &rows)
        .map_or_else(|e| eprintln!("capmoe-bench: no plot {png}: {e}"), |()| eprintln!("wrote {png}"));
    report::print_table(&rows);
}
