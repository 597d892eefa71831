//! The report: the table, the JSON file and the torch anchor rows.

use std::collections::BTreeMap;

use capturable_moe::device::DeviceInfo;

use crate::gemm::SHAPES;
use crate::measure::Row;

/// Rows of the torch anchor JSON that match the benchmarked shapes (by E, rows, K, N).
pub fn anchor_rows(path: &str) -> Result<Vec<Row>, String> {
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
        // As in gemm.rs: X and Y of every row plus the weights touched, bf16: the experts with
        // rows for the grouped and loop calls (the script records how many had none), one
        // [K, N] matrix for torch.mm.
        let active = shape.experts.saturating_sub(dims("zero_experts"));
        let bytes =
            |weights: usize| ((shape.rows * shape.k + weights * shape.k * shape.n + shape.rows * shape.n) * 2) as f64;
        // graph_ms: torch._grouped_mm replayed from a CUDA graph, the like-for-like partner of
        // the crate's graph rows; the others are timed eagerly with a sync after each run.
        let keys = [
            ("grouped_ms", "torch-grouped-mm"),
            ("graph_ms", "torch-grouped-mm-graph"),
            ("loop1_ms", "torch-loop1"),
            ("loop4_ms", "torch-loop4"),
            ("dense_ms", "torch-dense"),
        ];
        for (key, imp) in keys {
            let bytes = bytes(if key == "dense_ms" { 1 } else { active });
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
    // The torch expert path (CUDA-graph replays of the forward and of forward + backward),
    // matched by (E, T, k, H, F).
    for r in json["path"].as_array().into_iter().flatten() {
        let dim = |k: &str| r[k].as_u64().unwrap_or(0) as usize;
        let shape = (dim("E"), dim("T"), dim("topk"), dim("H"), dim("F"));
        let (e, t, k, h, f) = shape;
        for (key, op) in [("gpu_only_ms_graph", "expert_fwd"), ("gpu_only_ms_graph_fwd_bwd", "expert_fwd_bwd")] {
            let Some(ms) = r[key].as_f64() else { continue };
            let us = ms * 1e3;
            rows.push(Row {
                shape: crate::path::path_name(e, t, k, h, f),
                routing: "uniform".into(),
                op: op.into(),
                imp: "torch-graph".into(),
                us,
                tflops: crate::path::op_flops(shape, op) / us * 1e-6,
                gbps: f64::NAN,
                host_us: None,
                note: Some("torch_anchor.py, same call".into()),
            });
        }
    }
    Ok(rows)
}

/// The times a row is compared with: those of its (shape, routing, op) group's
/// cublas-multistream, cublas-dense and roofline rows, and torch's: `torch-grouped-mm` (eager,
/// synced after each call: the partner of `capmoe-synced`, as issue 13's target reads it) in a
/// GEMM group, `torch-graph` (the torch expert path replayed from a graph) in an expert-path
/// group. NaN where the group has none.
#[derive(Clone, Copy)]
pub struct References {
    pub multistream_us: f64,
    pub dense_us: f64,
    pub roofline_us: f64,
    pub torch_us: f64,
}

pub fn references(rows: &[Row]) -> impl Fn(&Row) -> References {
    let key = |r: &Row| (r.shape.clone(), r.routing.clone(), r.op.clone());
    let none = References { multistream_us: f64::NAN, dense_us: f64::NAN, roofline_us: f64::NAN, torch_us: f64::NAN };
    let mut by_group: BTreeMap<(String, String, String), References> = BTreeMap::new();
    for r in rows {
        let entry = by_group.entry(key(r)).or_insert(none);
        match r.imp.as_str() {
            "cublas-multistream" => entry.multistream_us = r.us,
            "cublas-dense" => entry.dense_us = r.us,
            "roofline" => entry.roofline_us = r.us,
            "torch-grouped-mm" | "torch-graph" => entry.torch_us = r.us,
            _ => {}
        }
    }
    move |r: &Row| by_group.get(&key(r)).copied().unwrap_or(none)
}

/// The table of `rows` as the report prints it, one line per row (a note instead of the
/// figures where a row has no time).
pub fn table(rows: &[Row]) -> String {
    use std::fmt::Write;
    let reference = references(rows);
    let mut out = String::new();
    // Writing into a String cannot fail: the results are ignored.
    let _ = writeln!(
        out,
        "{:<14} | {:<8} | {:<6} | {:<22} | {:>9} | {:>8} | {:>7} | {:>14} | {:>7} | {:>10} | {:>7}",
        "shape", "routing", "op", "impl", "us", "TFLOP/s", "GB/s", "x multi-stream", "x dense", "x roofline", "x torch"
    );
    for r in rows {
        let References { multistream_us: multi, dense_us: dense, roofline_us: roofline, torch_us: torch } =
            reference(r);
        if r.us.is_nan() {
            let _ = writeln!(
                out,
                "{:<14} | {:<8} | {:<6} | {:<22} | {}",
                r.shape,
                r.routing,
                r.op,
                r.imp,
                r.note.clone().unwrap_or_default()
            );
            continue;
        }
        // The memcpy-floor row does no FLOPs: "-" rather than NaN.
        let tflops = if r.tflops.is_finite() { format!("{:.1}", r.tflops) } else { "-".into() };
        // x roofline is this row's time over the roofline's (>= 1 for a real kernel); the
        // other ratios are the reference's time over this row's (> 1 = faster).
        let _ = writeln!(
            out,
            "{:<14} | {:<8} | {:<6} | {:<22} | {:>9.1} | {:>8} | {:>7.0} | {:>14.2} | {:>7.2} | {:>10.2} | {:>7.2}",
            r.shape,
            r.routing,
            r.op,
            r.imp,
            r.us,
            tflops,
            r.gbps,
            multi / r.us,
            dense / r.us,
            r.us / roofline,
            torch / r.us
        );
    }
    out
}

/// Writes `text` to `path` through a temporary file and a rename, so that a run killed while
/// writing (a `timeout`) leaves the previous complete file, never a truncated one.
pub fn write_atomically(path: &str, text: &str) -> std::io::Result<()> {
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = format!("{path}.partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)
}

pub fn write_json(path: &str, device: &DeviceInfo, max_clocks_khz: (i32, i32), rows: &[Row]) -> std::io::Result<()> {
    let reference = references(rows);
    let finite = |v: f64| if v.is_finite() { v.into() } else { serde_json::Value::Null };
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "x_roofline": finite(r.us / reference(r).roofline_us),
                "x_torch": finite(reference(r).torch_us / r.us),
                "shape": r.shape, "routing": r.routing, "op": r.op, "impl": r.imp,
                "us": if r.us.is_nan() { serde_json::Value::Null } else { r.us.into() },
                "tflops": if r.tflops.is_finite() { r.tflops.into() } else { serde_json::Value::Null },
                "gbps": if r.us.is_nan() { serde_json::Value::Null } else { r.gbps.into() },
                "host_us": r.host_us, "note": r.note,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "gpu": device.name,
        "sm_count": device.sm_count,
        // CU_DEVICE_ATTRIBUTE_CLOCK_RATE / MEMORY_CLOCK_RATE: the device's maximum (peak)
        // clocks, not the clocks during the run (this report does not sample those).
        "max_sm_clock_mhz": max_clocks_khz.0 / 1000,
        "max_memory_clock_mhz": max_clocks_khz.1 / 1000,
        "commit": std::env::var("CAPMOE_COMMIT").unwrap_or_else(|_| "unknown".into()),
        "date_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "rows": rows,
    });
    write_atomically(path, &serde_json::to_string_pretty(&doc).unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_path_rows_take_forward_and_forward_backward() {
        let dir = std::env::temp_dir().join(format!("capmoe-anchor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("anchor.json");
        let json = r#"{"gemm": [], "path": [
            {"E": 128, "T": 4096, "topk": 8, "H": 2048, "F": 768,
             "gpu_only_ms_graph": 2.0, "gpu_only_ms_graph_fwd_bwd": 6.0},
            {"E": 64, "T": 128, "topk": 8, "H": 2048, "F": 1408, "gpu_only_ms_graph": 0.5,
             "fwd_bwd_error": "RuntimeError('no backward')"},
            {"cfg": [1, 2, 3], "error": "OOM"}]}"#;
        std::fs::write(&file, json).unwrap();
        let rows = anchor_rows(file.to_str().unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).ok();

        let ops: Vec<(&str, &str, f64)> = rows.iter().map(|r| (r.shape.as_str(), r.op.as_str(), r.us)).collect();
        assert_eq!(
            ops,
            [
                ("expert_E128_T4096_k8_H2048_F768", "expert_fwd", 2000.0),
                ("expert_E128_T4096_k8_H2048_F768", "expert_fwd_bwd", 6000.0),
                ("expert_E64_T128_k8_H2048_F1408", "expert_fwd", 500.0),
            ]
        );
        let fwd_bwd = &rows[1];
        let flops = 3.0 * 6.0 * (4096.0 * 8.0 * 2048.0 * 768.0);
        assert!((fwd_bwd.tflops - flops / 6000.0 * 1e-6).abs() < 1e-9);
    }

    fn timed(shape: &str, op: &str, imp: &str, us: f64) -> Row {
        Row {
            shape: shape.into(),
            routing: "uniform".into(),
            op: op.into(),
            imp: imp.into(),
            us,
            tflops: f64::NAN,
            gbps: 0.0,
            host_us: None,
            note: None,
        }
    }

    /// x torch: torch._grouped_mm's eager time in a GEMM group, the torch graph path's in an
    /// expert-path group, over the row's own; NaN in a group without either.
    #[test]
    fn x_torch_takes_the_groups_torch_row() {
        let rows = [
            timed("qwen3moe_fc1", "fprop", "torch-grouped-mm", 500.0),
            timed("qwen3moe_fc1", "fprop", "torch-grouped-mm-graph", 300.0),
            timed("qwen3moe_fc1", "fprop", "capmoe-synced", 400.0),
            timed("expert_E128", "expert_fwd", "torch-graph", 2000.0),
            timed("expert_E128", "expert_fwd", "capmoe-graph", 800.0),
            timed("decode_fc1", "fprop", "capmoe-synced", 250.0),
        ];
        let reference = references(&rows);
        let x_torch = |r: &Row| reference(r).torch_us / r.us;
        assert_eq!(x_torch(&rows[2]), 1.25);
        assert_eq!(x_torch(&rows[4]), 2.5);
        assert!(x_torch(&rows[5]).is_nan());
        let line = table(&rows).lines().nth(3).unwrap().to_string();
        assert!(line.ends_with("|    1.25"), "{line}");
    }

    /// Every timed torch GEMM form becomes a row of the bench shape with the same dims (the
    /// graph-replayed grouped_mm included); unknown dims and missing keys give none.
    #[test]
    fn torch_gemm_rows_take_every_timed_form() {
        let dir = std::env::temp_dir().join(format!("capmoe-anchor-gemm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("anchor.json");
        let json = r#"{"gemm": [
            {"name": "qwen3moe_fc1", "E": 128, "M": 32768, "K": 2048, "N": 1536, "skew": "zipf",
             "grouped_ms": 0.5, "graph_ms": 0.4, "loop1_ms": 2.0, "loop4_ms": 1.5, "dense_ms": 0.3},
            {"name": "unknown", "E": 3, "M": 5, "K": 7, "N": 9, "skew": "uniform", "grouped_ms": 1.0}],
            "path": []}"#;
        std::fs::write(&file, json).unwrap();
        let rows = anchor_rows(file.to_str().unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).ok();

        let got: Vec<(&str, &str, &str, f64)> =
            rows.iter().map(|r| (r.shape.as_str(), r.routing.as_str(), r.imp.as_str(), r.us)).collect();
        assert_eq!(
            got,
            [
                ("qwen3moe_fc1", "zipf", "torch-grouped-mm", 500.0),
                ("qwen3moe_fc1", "zipf", "torch-grouped-mm-graph", 400.0),
                ("qwen3moe_fc1", "zipf", "torch-loop1", 2000.0),
                ("qwen3moe_fc1", "zipf", "torch-loop4", 1500.0),
                ("qwen3moe_fc1", "zipf", "torch-dense", 300.0),
            ]
        );
    }
}
