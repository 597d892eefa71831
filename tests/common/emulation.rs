//! Building and running kernels under the CPU emulation of `tests/emulation/`
//! (`cpu_emulation.h` says what it models).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The thread orders every emulated case runs in: a missing barrier between a shared-memory
/// write and read passes in at most one of them.
pub const THREAD_ORDERS: [&str; 2] = ["forward", "reverse"];

/// Compiles the kernel sources (paths from the crate root, `.cu` compiled as C++) and the
/// driver into `<test scratch>/<name>`, with a C++17 compiler (`CXX`, default `c++`) and the
/// extra flags of `CAPMOE_EMULATION_CXXFLAGS` (e.g. sanitizers).
pub fn build(name: &str, kernel_sources: &[&str], driver: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let extra = std::env::var("CAPMOE_EMULATION_CXXFLAGS").unwrap_or_default();
    let mut cmd = Command::new(&cxx);
    // -U_FORTIFY_SOURCE: the emulation switches stacks with _longjmp (cpu_emulation.h).
    // -fno-strict-aliasing: CUDA code reinterprets vectors (e.g. Vec8 in csrc/routing/
    // common.cuh reads a uint4 through __nv_bfloat162 pointers), which nvcc compiles as meant
    // but host C++ with strict aliasing may drop (the stores vanish at -O2).
    // -ffp-contract=off: no fused multiply-adds the device code does not ask for.
    cmd.args(["-std=c++17", "-O2", "-U_FORTIFY_SOURCE", "-fno-strict-aliasing", "-ffp-contract=off"])
        .arg("-DCAPMOE_CPU_EMULATION")
        .arg("-I")
        .arg(root.join("tests/emulation"))
        .arg("-I")
        .arg(root.join("csrc"))
        .arg("-I")
        .arg(root.join("csrc/include"))
        .arg("-x")
        .arg("c++");
    for source in kernel_sources.iter().chain(&["csrc/common/status.cu", driver]) {
        cmd.arg(root.join(source));
    }
    let out = cmd
        .arg("-o")
        .arg(&exe)
        .args(extra.split_whitespace())
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}` (set CXX): {e}"));
    assert!(out.status.success(), "building the emulated kernels failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Runs the emulated driver with `args` in one thread order; panics with its output unless it
/// exits 0, and returns its standard output.
pub fn run(exe: &Path, args: &[&Path], order: &str) -> String {
    let out: Output =
        Command::new(exe).args(args).env("CAPMOE_EMULATION_ORDER", order).output().expect("run the emulated kernels");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the emulated kernels failed ({order} thread order, {}):\n{report}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    report
}

/// Runs a driver of the case-file kind (`driver CASES_FILE OUTPUT_FILE`, tests/emulation/
/// driver_main.h) on `cases` in every thread order: writes the case file under the test's
/// scratch folder as `<name>_cases.bin`, checks that the driver read all `count` cases, and
/// hands each order's output to `check(output, order)`.
pub fn run_case_file(exe: &Path, name: &str, cases: &[u8], count: usize, check: impl Fn(&[u8], &str)) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let input = dir.join(format!("{name}_cases.bin"));
    std::fs::write(&input, cases).unwrap();
    for order in THREAD_ORDERS {
        let output = dir.join(format!("{name}_{order}.bin"));
        // The scratch folder outlives the run: a driver that stopped writing must not be
        // checked against an earlier run's file.
        let _ = std::fs::remove_file(&output);
        let report = run(exe, &[&input, &output], order);
        assert_eq!(report.trim(), format!("{count} cases"), "the driver did not read every case ({order} order)");
        check(&std::fs::read(&output).unwrap(), order);
        println!("{order} thread order: {count} cases match");
    }
}
