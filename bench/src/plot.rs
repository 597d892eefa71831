//! The PNG plot beside the JSON: grouped bars of TFLOP/s per shape (x) and impl (colour), for
//! routing=uniform, one panel per op (fprop, dgrad, wgrad, those that were run).
//!
//! Text is drawn by plotters' `ab_glyph` backend from a font compiled into the binary
//! (`epaint_default_fonts`), so neither the build nor the GPU machine needs fontconfig,
//! freetype or any system font.

use std::collections::BTreeSet;

use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
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
        Err(panic) => Err(format!("plotting panicked: {}", crate::runner::panic_message(&*panic))),
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

    let (width, panel_height) = (170 * shapes.len().max(6) as u32 + 100, 400u32);
    let text = |size: u32| ("sans-serif", size).into_font().color(&BLACK);
    let err = |e: &dyn std::fmt::Display| e.to_string();
    // One legend for every panel, under the title: a swatch and the impl's name, in rows.
    let mut legend = Vec::new();
    let (mut x, mut y) = (12i32, 44i32);
    for imp in &impls {
        let (w, _) = text(15).font.box_size(imp).map_err(|e| err(&e))?;
        let step = 20 + w as i32 + 24;
        if x > 12 && x + step > width as i32 {
            (x, y) = (12, y + 24);
        }
        legend.push((*imp, x, y));
        x += step;
    }
    let head = y as u32 + 30;
    let root = BitMapBackend::new(path, (width, panel_height * ops.len() as u32 + head)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (head, body) = root.split_vertically(head);
    head.draw_text(
        &format!("capmoe-bench on {gpu}: grouped GEMM TFLOP/s, routing={ROUTING} (bf16, higher is better)"),
        &text(22),
        (12, 8),
    )
    .map_err(|e| err(&e))?;
    for (imp, x, y) in legend {
        head.draw(&Rectangle::new([(x, y + 2), (x + 14, y + 16)], colour(imp).filled())).map_err(|e| err(&e))?;
        head.draw_text(imp, &text(15), (x + 20, y + 1)).map_err(|e| err(&e))?;
    }
    let panels = body.split_evenly((ops.len(), 1));
    let slot = 0.8 / impls.len() as f64; // a shape's bars fill 80% of its unit of x
    for (panel, op) in panels.iter().zip(&ops) {
        let bars: Vec<&&Row> = rows.iter().filter(|r| r.op == *op).collect();
        let top = bars.iter().map(|r| r.tflops).fold(0.0f64, f64::max) * 1.25;
        let mut chart = ChartBuilder::on(panel)
            .caption(*op, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(ShapeAxis(shapes.len()), 0.0..top.max(1.0))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|x| shapes.get(x.floor() as usize).map(|s| s.to_string()).unwrap_or_default())
            .y_desc("TFLOP/s")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .light_line_style(WHITE.mix(0.0))
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
            chart.draw_series(series).map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| format!("{path}: {e}"))
}

/// x axis: shape `i` spans `[i, i + 1)`; one tick (and label) at each shape's centre.
struct ShapeAxis(usize);

impl Ranged for ShapeAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = self.0.max(1) as f64;
        limit.0 + ((limit.1 - limit.0) as f64 * value / span).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.0).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> Range<f64> {
        0.0..self.0.max(1) as f64
    }
}
