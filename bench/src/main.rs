//! capmoe-bench: the crate's benchmark report. On the GPU it times the grouped GEMM (eager and
//! CUDA-graph replay) against the cuBLAS baselines on named MoE shapes and routings, then the
//! graph-module, EP, Echo planner and expert-path rows; prints
//! `shape | routing | op | impl | us | TFLOP/s | GB/s | x multi-stream | x dense | x roofline | x torch`,
//! and writes `<out>/<gpu>.json`, `<gpu>.txt` (that table) and `<gpu>.png`. Without a GPU it
//! says why and exits with status 2.
//!
//!   capmoe-bench [--shapes a,b] [--routing uniform,zipf,onehot,balanced] [--ops fprop,dgrad,wgrad]
//!                (shapes: gemm.rs's SHAPES, the default, and EXTRA_SHAPES, by name only)
//!                [--streams 4] [--reps 30] [--anchors torch_anchor.json] [--out DIR]
//!                [--quick]      (10 reps and uniform routing, where --reps / --routing are not given)
//!                [--only gemm,graphs,ep,echo,paths]  (these row families alone; default all)
//!                [--no-paths]   (the GEMM rows alone: no graph, EP, Echo or expert-path rows)
//!                [--no-fused]   (expert-path rows of the default plan alone: no unfused or forced fused variants)
//!                [--path-shapes E64_T128,...]  (the expert-path shapes whose name holds one of these; default all)
//!                [--configs sm90-coop,sm90-pingpong-wide,...]  (also time these kernel configs)
//!                [--weight-layout enk|ekn]  (weights [E, N, K], the default, or [E, K, N])
//!                [--sweep]  (a config sweep: graph rows, dense cuBLAS, floor and roofline only;
//!                            no eager rows, no cuBLAS loops; GEMM rows alone)
//!
//! Families run in the order gemm, graphs, ep, echo, paths (the expert path last: its fused
//! kernels are the likeliest to fault or hang; within it the unfused variant of every shape
//! runs before any fused one). Each family, and each case of gemm, paths and the EP layer, is
//! one unit: its rows are printed to stderr when it ends and the JSON and the table file are
//! rewritten, so a later panic, hang or kill keeps them. A unit that panics prints
//! `capmoe-bench: <family>/<case> failed: <message>` and the run goes on; if the CUDA context
//! no longer works after it, the later units are skipped. The sorted table goes to stdout at
//! the end. Exit status: 0; 1 when a unit failed; 3 when the run stopped early (context
//! unusable); 2 without a GPU; 64 on a bad argument.

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
mod runner;

use capturable_moe::device::{open, DeviceInfo};
use capturable_moe::grouped_gemm::{GemmConfig, GemmOp, WeightLayout};
use cudarc::driver::sys::CUdevice_attribute;

use gemm::{bench_case, find_shape, op_name, Shape, DEFAULT_ROUTINGS, ROUTINGS, SHAPES};
use runner::{Outputs, Runner};

struct Args {
    pub shapes: Vec<String>,
    pub routings: Vec<String>,
    pub ops: Vec<GemmOp>,
    pub streams: usize,
    pub reps: usize,
    pub anchors: Option<String>,
    pub out: String,
    /// Every family but the GEMM rows too (`--no-paths` clears it).
    pub paths: bool,
    /// The expert path's variants beside the default plan (`--no-fused` clears it).
    pub fused: bool,
    /// Only the expert-path shapes whose name contains one of these (`--path-shapes`; empty:
    /// every one).
    pub path_shapes: Vec<String>,
    /// Explicit kernel configurations timed beside `Auto` (`--configs`).
    pub configs: Vec<GemmConfig>,
    /// Weight layout of every GEMM row (`--weight-layout enk|ekn`).
    pub weight_layout: WeightLayout,
    /// Only these families (`--only`).
    pub only: Option<Vec<Family>>,
    /// A config sweep: skip the eager rows and the cuBLAS loop baselines (`--sweep`).
    pub sweep: bool,
}

/// The report's row families, in the order they run.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    /// Grouped GEMM against the cuBLAS baselines, a unit per (shape, routing, op).
    Gemm,
    /// The graph-module rows (pool, one graph for every T, update, first replay).
    Graphs,
    /// NCCL's all-to-all, the EP layer (a unit per case) and the simulated drop table.
    Ep,
    /// The Echo planner rows.
    Echo,
    /// The whole expert path, unfused and fused, a unit per (shape, variant).
    Paths,
}

const FAMILIES: [(Family, &str); 5] = [
    (Family::Gemm, "gemm"),
    (Family::Graphs, "graphs"),
    (Family::Ep, "ep"),
    (Family::Echo, "echo"),
    (Family::Paths, "paths"),
];

impl Args {
    /// The families this run measures, in [`FAMILIES`] order.
    fn families(&self) -> Vec<Family> {
        FAMILIES
            .iter()
            .map(|&(family, _)| family)
            .filter(|f| self.only.as_ref().is_none_or(|only| only.contains(f)))
            .filter(|&f| self.paths || f == Family::Gemm)
            .collect()
    }
}

/// The arguments after the program's name.
fn parse_args(command_line: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        shapes: SHAPES.iter().map(|s| s.name.to_string()).collect(),
        routings: DEFAULT_ROUTINGS.iter().map(|r| r.to_string()).collect(),
        ops: vec![GemmOp::Fprop, GemmOp::Dgrad, GemmOp::Wgrad],
        streams: 4,
        reps: 30,
        anchors: None,
        out: "bench/results".into(),
        paths: true,
        fused: true,
        path_shapes: Vec::new(),
        configs: Vec::new(),
        weight_layout: WeightLayout::Enk,
        only: None,
        sweep: false,
    };
    // --quick's defaults, applied after the loop so that an explicit --reps or --routing wins
    // wherever it stands on the command line.
    let (mut quick, mut reps_given, mut routing_given) = (false, false, false);
    let mut it = command_line.into_iter();
    let list = |v: Option<String>| -> Result<Vec<String>, String> {
        Ok(v.ok_or("missing value")?.split(',').map(str::to_string).collect())
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--shapes" => args.shapes = list(it.next())?,
            "--routing" => {
                args.routings = list(it.next())?;
                routing_given = true;
            }
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
            "--reps" => {
                args.reps = it.next().and_then(|v| v.parse().ok()).ok_or("--reps N")?;
                reps_given = true;
            }
            "--anchors" => args.anchors = Some(it.next().ok_or("--anchors FILE")?),
            "--out" => args.out = it.next().ok_or("--out DIR")?,
            "--no-paths" => args.paths = false,
            "--no-fused" => args.fused = false,
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
            "--only" => {
                let names: Vec<&str> = FAMILIES.iter().map(|f| f.1).collect();
                args.only = Some(
                    list(it.next())?
                        .iter()
                        .map(|name| {
                            FAMILIES
                                .iter()
                                .find(|f| f.1 == name)
                                .map(|f| f.0)
                                .ok_or(format!("--only takes a list of {}, got {name:?}", names.join(", ")))
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
            "--sweep" => {
                args.sweep = true;
                args.paths = false;
            }
            "--path-shapes" => args.path_shapes = list(it.next())?,
            "--quick" => quick = true,
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
    if quick && !reps_given {
        args.reps = 10;
    }
    if quick && !routing_given {
        args.routings = vec!["uniform".into()];
    }
    for s in &args.shapes {
        if find_shape(s).is_none() {
            return Err(format!("unknown shape {s}"));
        }
    }
    for r in &args.routings {
        if !ROUTINGS.contains(&r.as_str()) {
            return Err(format!("unknown routing {r} (one of {})", ROUTINGS.join(", ")));
        }
    }
    Ok(args)
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
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

    let mut runner = Runner::new(stream.clone(), Outputs::new(&args.out, device, max_clocks_khz));
    // The anchors first, so that every file written along the way holds them.
    if let Some(path) = &args.anchors {
        match report::anchor_rows(path) {
            Ok(anchor) => runner.add(anchor),
            Err(e) => eprintln!("capmoe-bench: anchors not merged: {e}"),
        }
    }
    let reps = args.reps;
    for family in args.families() {
        match family {
            Family::Gemm => gemm_rows(&mut runner, &stream, &args),
            Family::Graphs => runner.run("graphs", |rows| rows.extend(graphs::graph_rows(&stream, reps))),
            Family::Ep => {
                runner.run("ep/nccl-alltoall", |rows| rows.extend(ep::ep_rows(&stream, reps)));
                ep_layer::ep_layer_rows(&mut runner, &stream, reps);
                runner.run("ep/drops", |rows| rows.extend(ep_layer::drop_rows()));
            }
            Family::Echo => runner.run("echo", |rows| path::echo_rows(&stream, reps, rows)),
            Family::Paths => path::expert_rows(&mut runner, &stream, reps, args.fused, &args.path_shapes),
        }
    }
    std::process::exit(runner.finish());
}

/// The GEMM rows, a unit per (shape, routing, op).
fn gemm_rows(runner: &mut Runner, stream: &std::sync::Arc<cudarc::driver::CudaStream>, args: &Args) {
    let shapes: Vec<&Shape> = args.shapes.iter().filter_map(|n| find_shape(n)).collect();
    let total = shapes.len() * args.routings.len() * args.ops.len();
    let mut done = 0;
    for shape in shapes {
        for routing_kind in &args.routings {
            for &op in &args.ops {
                done += 1;
                let case = format!("{} {routing_kind} {}", shape.name, op_name(op));
                eprintln!("[{done}/{total}] {case}");
                runner.run(&format!("gemm/{case}"), |rows| bench_case(stream, args, shape, routing_kind, op, rows));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn families(command_line: &str) -> Result<Vec<Family>, String> {
        parse_args(command_line.split_whitespace().map(str::to_string)).map(|args| args.families())
    }

    #[test]
    fn families_run_in_their_fixed_order() {
        use Family::*;
        assert_eq!(families("").unwrap(), [Gemm, Graphs, Ep, Echo, Paths]);
        assert_eq!(families("--only paths,gemm").unwrap(), [Gemm, Paths]);
        assert_eq!(families("--only ep").unwrap(), [Ep]);
        assert_eq!(families("--no-paths").unwrap(), [Gemm]);
        assert_eq!(families("--sweep").unwrap(), [Gemm]);
        assert!(families("--only gemms").unwrap_err().contains("gemm, graphs, ep, echo, paths"));
    }

    #[test]
    fn no_fused_keeps_the_expert_path() {
        let args = parse_args(["--no-fused".to_string()]).unwrap();
        assert!(!args.fused);
        assert!(args.families().contains(&Family::Paths));
        assert!(parse_args([]).unwrap().fused);
    }

    /// --quick's 10 reps and uniform routing give way to an explicit --reps / --routing, on
    /// either side of it.
    #[test]
    fn quick_keeps_explicit_reps_and_routing() {
        let parse = |line: &str| parse_args(line.split_whitespace().map(str::to_string)).unwrap();
        let quick = parse("--quick");
        assert_eq!((quick.reps, quick.routings.clone()), (10, vec!["uniform".to_string()]));
        for line in ["--reps 20 --quick --routing zipf", "--quick --reps 20 --routing zipf"] {
            let args = parse(line);
            assert_eq!((args.reps, args.routings), (20, vec!["zipf".to_string()]), "{line}");
        }
    }

    #[test]
    fn unknown_routings_and_shapes_are_refused() {
        assert!(families("--routing zipf,onehot").is_ok());
        assert!(families("--routing Zipf").unwrap_err().contains("unknown routing Zipf"));
        assert!(families("--shapes nope").unwrap_err().contains("unknown shape"));
    }
}
