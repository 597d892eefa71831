//! Runs the report one unit at a time (a row family, or one case of it), so that a fault loses
//! only its own rows:
//! - each unit's rows are printed to stderr as soon as it ends, and the JSON and the text
//!   table are rewritten after it (a later panic, hang or `timeout` kill keeps them);
//! - a panic in a unit prints `capmoe-bench: <label> failed: <message>` and the run goes on
//!   with the rows the unit pushed before it panicked;
//! - after a panic the CUDA context is probed: a failed CUDA call can leave a sticky error that
//!   every later call returns, and then the remaining units are skipped (each would only fail
//!   the same way) and the run ends with what was written.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use capturable_moe::device::DeviceInfo;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureStatus};
use cudarc::driver::{CudaStream, DriverError};

use crate::measure::Row;
use crate::{plot, report};

/// Where the report goes: `<out>/<gpu>.json`, `.txt` (the table) and `.png`.
pub struct Outputs {
    pub json: String,
    pub table: String,
    pub png: String,
    pub device: DeviceInfo,
    pub max_clocks_khz: (i32, i32),
}

impl Outputs {
    pub fn new(out_dir: &str, device: DeviceInfo, max_clocks_khz: (i32, i32)) -> Outputs {
        let file: String = device.name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        Outputs {
            json: format!("{out_dir}/{file}.json"),
            table: format!("{out_dir}/{file}.txt"),
            png: format!("{out_dir}/{file}.png"),
            device,
            max_clocks_khz,
        }
    }
}

pub struct Runner {
    /// Whether the CUDA context still takes work ([`context_works`]; a stand-in in tests).
    context_works: Box<dyn Fn() -> Result<(), String>>,
    out: Outputs,
    rows: Vec<Row>,
    /// Labels of the units that panicked.
    failed: Vec<String>,
    /// Set when the CUDA context stopped working: why; every later unit is skipped.
    stopped: Option<String>,
}

impl Runner {
    pub fn new(stream: Arc<CudaStream>, out: Outputs) -> Runner {
        Runner::with_probe(out, Box::new(move || context_works(&stream).map_err(|e| e.to_string())))
    }

    fn with_probe(out: Outputs, context_works: Box<dyn Fn() -> Result<(), String>>) -> Runner {
        Runner { context_works, out, rows: Vec::new(), failed: Vec::new(), stopped: None }
    }

    /// Rows measured elsewhere (the torch anchors), kept in every file written from now on.
    pub fn add(&mut self, rows: Vec<Row>) {
        self.rows.extend(rows);
    }

    /// Runs one unit, labelled `<family>` or `<family>/<case>`: `measure` pushes its rows as
    /// it measures them; they are kept even when it panics later. Skipped once the context has
    /// stopped working.
    pub fn run(&mut self, label: &str, measure: impl FnOnce(&mut Vec<Row>)) {
        if self.stopped.is_some() {
            eprintln!("capmoe-bench: {label} skipped (the CUDA context no longer works)");
            return;
        }
        let mut rows = Vec::new();
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| measure(&mut rows))) {
            eprintln!("capmoe-bench: {label} failed: {}", panic_message(&*panic));
            self.failed.push(label.to_string());
            if let Err(e) = (self.context_works)() {
                let why = format!("the CUDA context no longer works after {label} failed ({e})");
                eprintln!("capmoe-bench: {why}: skipping every later family, keeping the rows written");
                self.stopped = Some(why);
            }
        }
        if !rows.is_empty() {
            eprint!("{}", report::table(&rows));
        }
        self.rows.extend(rows);
        self.write_files();
    }

    /// Sorts the rows, writes the JSON, the table and the PNG, prints the table on stdout, and
    /// returns the exit status: 0, 1 when a unit failed, 3 when the run stopped early.
    pub fn finish(mut self) -> i32 {
        self.rows.sort_by(|a, b| (&a.shape, &a.routing, &a.op).cmp(&(&b.shape, &b.routing, &b.op)));
        self.write_files();
        eprintln!("wrote {} and {}", self.out.json, self.out.table);
        plot::write_png(&self.out.png, &self.out.device.name, &self.rows).map_or_else(
            |e| eprintln!("capmoe-bench: no plot {}: {e}", self.out.png),
            |()| eprintln!("wrote {}", self.out.png),
        );
        print!("{}", report::table(&self.rows));
        if !self.failed.is_empty() {
            eprintln!("capmoe-bench: failed (their rows lost from the failure on): {}", self.failed.join(", "));
        }
        match &self.stopped {
            Some(why) => {
                eprintln!("capmoe-bench: stopped early: {why}");
                3
            }
            None if !self.failed.is_empty() => 1,
            None => 0,
        }
    }

    /// The JSON and the text table of every row so far (rewritten whole: a few hundred rows).
    fn write_files(&self) {
        let Outputs { json, table, device, max_clocks_khz, .. } = &self.out;
        if let Err(e) = report::write_json(json, device, *max_clocks_khz, &self.rows) {
            eprintln!("capmoe-bench: could not write {json}: {e}");
        }
        if let Err(e) = report::write_atomically(table, &report::table(&self.rows)) {
            eprintln!("capmoe-bench: could not write {table}: {e}");
        }
    }
}

/// The text of a panic's payload (`panic!` gives a `String` or a `&str`).
pub fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// Whether the context still takes work: ends a capture the panic left open on the stream
/// (every call on a capturing stream fails, though the context is fine), then synchronises
/// and runs one allocation and memset, the first calls the next unit would make.
fn context_works(stream: &Arc<CudaStream>) -> Result<(), DriverError> {
    if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        // The captured graph is discarded; an invalidated capture returns an error here,
        // which is not a context failure.
        let _ = stream.end_capture(CUgraphInstantiate_flags(0));
    }
    stream.synchronize()?;
    let probe = stream.alloc_zeros::<u8>(1)?;
    stream.synchronize()?;
    drop(probe);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use capturable_moe::device::Arch;
    use std::cell::Cell;
    use std::rc::Rc;

    fn a_row(imp: &str) -> Row {
        Row {
            shape: "s".into(),
            routing: "uniform".into(),
            op: "fprop".into(),
            imp: imp.into(),
            us: 10.0,
            tflops: 1.0,
            gbps: 1.0,
            host_us: None,
            note: None,
        }
    }

    /// A runner writing into a fresh temporary folder, with `probe` as the context check.
    fn runner(test: &str, probe: impl Fn() -> Result<(), String> + 'static) -> Runner {
        let dir = std::env::temp_dir().join(format!("capmoe-runner-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let device = DeviceInfo { ordinal: 0, name: "Test GPU".into(), arch: Arch::Sm90, sm_count: 132 };
        Runner::with_probe(Outputs::new(dir.to_str().unwrap(), device, (0, 0)), Box::new(probe))
    }

    fn json_impls(runner: &Runner) -> Vec<String> {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&runner.out.json).unwrap()).unwrap();
        json["rows"].as_array().unwrap().iter().map(|r| r["impl"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn a_panic_keeps_the_rows_pushed_before_it_and_the_run_goes_on() {
        let mut runner = runner("panic", || Ok(()));
        runner.run("gemm/a", |rows| rows.push(a_row("first")));
        runner.run("gemm/b", |rows| {
            rows.push(a_row("before-the-panic"));
            panic!("launch failed");
        });
        // Written after every unit, the failed one included.
        assert_eq!(json_impls(&runner), ["first", "before-the-panic"]);
        let table = std::fs::read_to_string(&runner.out.table).unwrap();
        assert!(table.contains("before-the-panic"), "{table}");
        runner.run("echo", |rows| rows.push(a_row("after")));
        assert_eq!(json_impls(&runner), ["first", "before-the-panic", "after"]);
        assert_eq!(runner.failed, ["gemm/b"]);
        assert_eq!(runner.finish(), 1);
    }

    #[test]
    fn a_dead_context_after_a_panic_skips_every_later_unit() {
        let mut runner = runner("dead", || Err("CUDA_ERROR_ILLEGAL_ADDRESS".into()));
        runner.run("paths/a", |_| panic!("illegal address"));
        let ran = Rc::new(Cell::new(false));
        let flag = ran.clone();
        runner.run("paths/b", move |rows| {
            flag.set(true);
            rows.push(a_row("never"));
        });
        assert!(!ran.get());
        assert!(runner.stopped.as_deref().unwrap().contains("after paths/a failed"));
        assert!(json_impls(&runner).is_empty());
        assert_eq!(runner.finish(), 3);
    }

    #[test]
    fn the_context_is_only_probed_after_a_panic() {
        let probed = Rc::new(Cell::new(0));
        let count = probed.clone();
        let mut runner = runner("clean", move || {
            count.set(count.get() + 1);
            Err("never asked".into())
        });
        runner.run("graphs", |rows| rows.push(a_row("graph")));
        runner.run("echo", |rows| rows.push(a_row("echo")));
        assert_eq!(probed.get(), 0);
        assert_eq!(json_impls(&runner), ["graph", "echo"]);
        assert_eq!(runner.finish(), 0);
    }

    #[test]
    fn panic_messages_are_read_from_both_payload_types() {
        let owned = std::panic::catch_unwind(|| panic!("{} failed", "launch")).unwrap_err();
        assert_eq!(panic_message(&*owned), "launch failed");
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*literal), "plain");
    }
}
