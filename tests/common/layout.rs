//! Host-only checks of the fused kernels' shared-memory layouts (`tests/layout/*.cu`): each
//! compares a producer's hand-computed offsets with cute's addressing of the layout the wgmma
//! descriptors are built from, compiled with the project's nvcc and CUTLASS and run on the
//! host (no GPU).

#[path = "../../build/toolchain.rs"]
#[allow(dead_code)]
mod toolchain;

use std::path::Path;
use std::process::Command;

/// Compiles and runs `tests/layout/<name>`; returns its output, whose last line must be exactly
/// "0 mismatches" (else the test fails with it), or `None` after printing `skipping: <reason>`
/// where there is no nvcc / CUTLASS, or no checkout (a test binary carried to the GPU machine).
pub fn run_check(name: &str) -> Option<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = root.join("tests/layout").join(name);
    if !source.is_file() {
        println!("skipping: {} is not here", source.display());
        return None;
    }
    let env = |k: &str| std::env::var(k).ok();
    let (toolkit, cutlass) = match (
        toolchain::find_toolkit(&env, root, Path::new("/usr/local/cuda")),
        toolchain::find_cutlass(&env, root),
    ) {
        (Ok(t), Ok(c)) => (t, c),
        (t, c) => {
            println!("skipping: no nvcc / CUTLASS to build the host layout check ({:?} / {:?})", t.err(), c.err());
            return None;
        }
    };
    let stem = name.trim_end_matches(".cu");
    let exe = std::env::temp_dir().join(format!("capmoe-{stem}-{}", std::process::id()));
    let mut nvcc = Command::new(&toolkit.nvcc);
    nvcc.args(["-std=c++17", "--expt-relaxed-constexpr", "-O1"])
        .arg(format!("-I{}", root.join("csrc").display()))
        .arg(format!("-I{}", root.join("csrc/include").display()))
        .arg(format!("-L{}", toolkit.lib_dir.display()));
    for dir in &cutlass {
        nvcc.arg(format!("-I{}", dir.display()));
    }
    let built = nvcc.arg(&source).arg("-o").arg(&exe).output().unwrap();
    assert!(built.status.success(), "nvcc failed on {name}:\n{}", String::from_utf8_lossy(&built.stderr));
    let ran = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_file(&exe);
    let out = String::from_utf8_lossy(&ran.stdout).into_owned();
    // The exact last line: "10 mismatches" must not pass for "0 mismatches".
    let verdict = out.lines().last().map(str::trim);
    assert!(ran.status.success() && verdict == Some("0 mismatches"), "{name}: layout mismatch:\n{out}");
    Some(out)
}
