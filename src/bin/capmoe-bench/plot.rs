//! The PNG plot beside the JSON: grouped bars of TFLOP/s per shape (x) and impl (colour), for
//! routing=uniform, one panel per op (fprop, dgrad, wgrad, those that were run).
//!
//! Text is drawn by plotters' `ab_glyph` backend from a font compiled into the binary
//! (`epaint_default_fonts`), so neither the build nor the GPU machine needs fontconfig,
//! freetype or any system font.

use std::collections::BTreeSet;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::gemm::SHAPES;
use crate::measure::Row;

const ROUTING: &str = "uniform";
const OPS: [&str; 3] = ["fprop", "dgrad", "wgrad"];

/// Writes the plot to `path`. Never panics: a failure (or a panic inside plotters) is returned.
pub fn write_png(path: &str, gpu: &str, rows: &[Row]) -> Result<(), String> {
    match std::panic::catch_unwind(|| draw(path, gpu, rows)) {
        Ok(result) => result,
        Err(panic) => Err(format!(
            "plotting panicked: {}",
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        )),
    }
}

fn draw(path: &str, gpu: &str, rows: &[Row]) -> Result<(), String> {
    for family in ["sans-serif", "serif", "monospace"] {
        register_font(family, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
            .map_err(|_| "the embedded font could not be parsed".to_string())?;
    }
    let plotted = |r: &&Row| r.routing == ROUTING && r.tflops.is_finite() && r.tflops > 0.0;
    let rows: Vec<&Row> = rows.iter().filter(plotted).collect();
    let ops: Vec<&str> = OPS.iter().copied().filter(|op| rows.iter().any(|r| r.op == *op)).collect();
    if ops.is_empty() {
        return Err(format!("no timed routing={ROUTING} rows to plot"));
    }
    // Shapes in the report's order; impls in first-seen order, one colour each in every panel.
    let shapes: Vec<&str> = SHAPES.iter().map(|s| s.name).filter(|s| rows.iter().any(|r| r.shape == *s)).collect();
    let mut impls: Vec<&str> = Vec::new();
    for r in &rows {
        if !impls.contains(&r.imp.as_str()) {
            impls.push(&r.imp);
        }
    }
    let colour = |imp: &str| Palette99::pick(impls.iter().position(|i| *i == imp).unwrap_or(0)).to_rgba();

    let (width, panel_height) = (160 * shapes.len().max(4) as u32 + 360, 420u32);
    let root = BitMapBackend::new(path, (width, panel_height * ops.len() as u32 + 40)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (title, body) = root.split_vertically(40);
    title
        .draw_text(
            &format!("capmoe-bench on {gpu}: grouped GEMM TFLOP/s, routing={ROUTING} (bf16, higher is better)"),
            &("sans-serif", 22).into_font().color(&BLACK),
            (12, 10),
        )
        .map_err(|e| err(&e))?;
    let panels = body.split_evenly((ops.len(), 1));
    let slot = 0.8 / impls.len() as f64; // a shape's bars fill 80% of its unit of x
    for (panel, op) in panels.iter().zip(&ops) {
        let bars: Vec<&&Row> = rows.iter().filter(|r| r.op == *op).collect();
        let top = bars.iter().map(|r| r.tflops).fold(0.0f64, f64::max) * 1.25;
        let centres: Vec<f64> = (0..shapes.len()).map(|i| i as f64 + 0.5).collect();
        let mut chart = ChartBuilder::on(panel)
            .caption(*op, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d((0.0..shapes.len() as f64).with_key_points(centres), 0.0..top.max(1.0))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|x| shapes.get(x.floor() as usize).map(|s| s.to_string()).unwrap_or_default())
            .y_desc("TFLOP/s")
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        let present: BTreeSet<&str> = bars.iter().map(|r| r.imp.as_str()).collect();
        for (j, imp) in impls.iter().enumerate().filter(|(_, i)| present.contains(*i)) {
            let c = colour(imp);
            let x0 = |shape: &str| shapes.iter().position(|s| *s == shape).map(|i| i as f64 + 0.1 + j as f64 * slot);
            let series = bars.iter().filter(|r| r.imp == *imp).filter_map(|r| {
                x0(&r.shape).map(|x| Rectangle::new([(x, 0.0), (x + slot * 0.9, r.tflops)], c.filled()))
            });
            chart
                .draw_series(series)
                .map_err(|e| err(&e))?
                .label(*imp)
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 12, y + 6)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| format!("{path}: {e}"))
}
