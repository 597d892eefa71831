//! Where the build finds nvcc and CUTLASS. Shared by build.rs and the host-only tests
//! (tests/toolchain_lookup.rs), so the lookup order is tested without a toolkit installed.
//! Pure std, no network: it only looks at paths.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub const FIX_COMMAND: &str = "bash scripts/bootstrap.sh";

/// A usable CUDA compiler and the folder with `libcudart_static.a`.
#[derive(Debug, PartialEq)]
pub struct Toolkit {
    pub nvcc: PathBuf,
    pub lib_dir: PathBuf,
    /// Which candidate won: "NVCC", "CUDA_HOME", "CUDA_PATH", "project toolchain", "/usr/local/cuda".
    pub origin: String,
}

/// NVCC -> CUDA_HOME -> CUDA_PATH -> `<root>/.toolchain` (scripts/bootstrap.sh) -> `system`
/// (normally /usr/local/cuda). The error lists what was tried and the one command that fixes it.
pub fn find_toolkit(env: &dyn Fn(&str) -> Option<String>, root: &Path, system: &Path) -> Result<Toolkit, String> {
    let mut candidates: Vec<(String, PathBuf)> = Vec::new();
    if let Some(nvcc) = env("NVCC") {
        candidates.push(("NVCC".into(), PathBuf::from(nvcc)));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = env(var) {
            candidates.push((var.into(), Path::new(&dir).join("bin/nvcc")));
        }
    }
    candidates.push(("project toolchain".into(), root.join(".toolchain/nvidia/cu13/bin/nvcc")));
    candidates.push((system.display().to_string(), system.join("bin/nvcc")));

    let mut tried = String::new();
    for (origin, nvcc) in candidates {
        if !nvcc.is_file() {
            let _ = writeln!(tried, "  {origin}: {} (not found)", nvcc.display());
            continue;
        }
        let prefix = nvcc.parent().and_then(Path::parent).unwrap_or(Path::new("/")).to_path_buf();
        // NOTE: the PyPI wheels ship lib/, a toolkit install lib64/.
        match ["lib64", "lib"].iter().map(|d| prefix.join(d)).find(|d| d.join("libcudart_static.a").is_file()) {
            Some(lib_dir) => return Ok(Toolkit { nvcc, lib_dir, origin }),
            None => {
                let _ = writeln!(tried, "  {origin}: {} (no lib64/ or lib/ with libcudart_static.a)", nvcc.display());
            }
        }
    }
    Err(format!(
        "no CUDA compiler found. Tried, in order:\n{tried}Fix: run `{FIX_COMMAND}` (installs the pinned \
         nvcc 13.0 and CUTLASS 4.2 wheels into .toolchain/), or set NVCC / CUDA_HOME."
    ))
}

/// CUTLASS_DIR -> `<root>/third_party/cutlass` if the submodule is populated -> the wheel in
/// `<root>/.toolchain`. Returns the include folders (include/, tools/util/include/).
pub fn find_cutlass(env: &dyn Fn(&str) -> Option<String>, root: &Path) -> Result<Vec<PathBuf>, String> {
    let mut candidates: Vec<(&str, PathBuf)> = Vec::new();
    if let Some(dir) = env("CUTLASS_DIR") {
        candidates.push(("CUTLASS_DIR", PathBuf::from(dir)));
    }
    candidates.push(("submodule", root.join("third_party/cutlass")));
    candidates.push(("project toolchain", root.join(".toolchain/cutlass_library/source")));
    let mut tried = String::new();
    for (origin, dir) in candidates {
        if dir.join("include/cutlass/cutlass.h").is_file() {
            return Ok(vec![dir.join("include"), dir.join("tools/util/include")]);
        }
        let _ = writeln!(tried, "  {origin}: {} (no include/cutlass/cutlass.h)", dir.display());
    }
    Err(format!(
        "CUTLASS headers not found. Tried, in order:\n{tried}Fix: run `{FIX_COMMAND}`, \
         `git submodule update --init third_party/cutlass`, or set CUTLASS_DIR."
    ))
}
