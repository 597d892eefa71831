//! candle-core's cudarc links the CUDA libraries at build time (`dynamic-linking`: libcuda,
//! libnvrtc, libcurand, libcublas, libcublasLt) and candle-kernels links libcudart. A machine
//! with only nvcc (this project's CI, its `.toolchain/`) has none of them, so this script links
//! the missing ones against stub libraries made here: same file and soname as the real ones,
//! every function of cudarc's bindings defined as an empty symbol. The binary then loads the
//! real libraries by soname on the GPU machine (LD_LIBRARY_PATH=/usr/local/cuda/lib64), as with
//! the toolkit's own lib64/stubs/libcuda.so. Where the real libraries are found, nothing is done.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A library cudarc links: its link name, the cudarc module whose bindings list its functions,
/// and its soname for a CUDA major version.
struct CudarcLib {
    name: &'static str,
    module: &'static str,
    soname: fn(u32) -> String,
}

const CUDARC_LIBS: &[CudarcLib] = &[
    CudarcLib { name: "cuda", module: "driver", soname: |_| "libcuda.so.1".into() },
    CudarcLib { name: "nvrtc", module: "nvrtc", soname: |major| format!("libnvrtc.so.{major}") },
    CudarcLib { name: "curand", module: "curand", soname: |_| "libcurand.so.10".into() },
    CudarcLib { name: "cublas", module: "cublas", soname: |major| format!("libcublas.so.{major}") },
    CudarcLib { name: "cublasLt", module: "cublaslt", soname: |major| format!("libcublasLt.so.{major}") },
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "LIBRARY_PATH", "PATH", "NVCC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let dirs = library_dirs();
    let found = |name: &str| dirs.iter().any(|d| d.join(format!("lib{name}.so")).exists());
    let missing: Vec<&CudarcLib> = CUDARC_LIBS.iter().filter(|lib| !found(lib.name)).collect();
    let cudart_missing = !found("cudart");
    if missing.is_empty() && !cudart_missing {
        return;
    }
    if let Err(why) = link_stubs(&missing, cudart_missing) {
        println!("cargo:warning=CUDA libraries missing for the link and no stubs made: {why}");
    }
}

fn link_stubs(missing: &[&CudarcLib], cudart_missing: bool) -> Result<(), String> {
    let stubs = PathBuf::from(env::var("OUT_DIR").unwrap()).join("cuda-link-stubs");
    fs::create_dir_all(&stubs).map_err(|e| e.to_string())?;
    let nvcc = find_nvcc().ok_or("no nvcc on PATH, in NVCC or CUDA_HOME (candle-kernels needs it too)")?;
    let major = cuda_major(&nvcc)?;
    let bindings = cudarc_src()?;
    let mut made = Vec::new();
    for lib in missing {
        let functions = binding_functions(&bindings.join(lib.module).join("sys/mod.rs"))?;
        make_stub(&stubs, lib.name, &(lib.soname)(major), &functions)?;
        made.push(format!("lib{}.so ({} functions)", lib.name, functions.len()));
    }
    if cudart_missing {
        // The toolkit beside nvcc has the real one, only without the unversioned link name.
        let real = nvcc.parent().and_then(Path::parent).map(|t| t.join(format!("lib/libcudart.so.{major}")));
        let real = real.filter(|p| p.exists()).ok_or("no libcudart.so.N beside nvcc")?;
        let link = stubs.join("libcudart.so");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&real, &link).map_err(|e| e.to_string())?;
        made.push(format!("libcudart.so -> {}", real.display()));
    }
    println!("cargo:rustc-link-search=native={}", stubs.display());
    println!("cargo:warning=no CUDA {major} libraries to link against here; linked stubs: {}. Run with the real ones on LD_LIBRARY_PATH.", made.join(", "));
    Ok(())
}

/// Where the linker (and cudarc's build script) would look.
fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = env::var("LIBRARY_PATH").map(|p| env::split_paths(&p).collect()).unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "CUDA_TOOLKIT_ROOT_DIR"] {
        if let Ok(root) = env::var(var) {
            dirs.extend(["lib64", "lib", "lib64/stubs", "lib/stubs"].iter().map(|sub| Path::new(&root).join(sub)));
        }
    }
    dirs.extend(
        ["/usr/local/cuda/lib64", "/usr/local/cuda/lib64/stubs", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
            .map(PathBuf::from),
    );
    dirs
}

fn find_nvcc() -> Option<PathBuf> {
    let on_path = env::var_os("PATH").and_then(|p| env::split_paths(&p).map(|d| d.join("nvcc")).find(|n| n.exists()));
    env::var_os("NVCC")
        .map(PathBuf::from)
        .filter(|p| p.exists())
        .or(on_path)
        .or_else(|| env::var_os("CUDA_HOME").map(|h| Path::new(&h).join("bin/nvcc")).filter(|p| p.exists()))
}

fn cuda_major(nvcc: &Path) -> Result<u32, String> {
    let out = Command::new(nvcc).arg("--version").output().map_err(|e| format!("{}: {e}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "Cuda compilation tools, release 13.0, V13.0.88"
    let release = text.split("release ").nth(1).ok_or("unexpected `nvcc --version` output")?;
    release
        .split('.')
        .next()
        .and_then(|m| m.trim().parse().ok())
        .ok_or_else(|| "unexpected `nvcc --version` output".into())
}

/// cudarc's source in cargo's registry, at the version this workspace's lockfile pins.
fn cudarc_src() -> Result<PathBuf, String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let lock = manifest.ancestors().map(|d| d.join("Cargo.lock")).find(|p| p.exists()).ok_or("no Cargo.lock")?;
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = fs::read_to_string(&lock).map_err(|e| e.to_string())?;
    let version = text
        .split("[[package]]")
        .find(|p| p.contains("name = \"cudarc\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .map(|v| v.trim_end_matches('"').to_string())
        .ok_or("cudarc is not in Cargo.lock")?;
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    let registry = cargo_home.ok_or("no CARGO_HOME or HOME")?.join("registry/src");
    let entries = fs::read_dir(&registry).map_err(|e| format!("{}: {e}", registry.display()))?;
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(format!("cudarc-{version}/src")))
        .find(|p| p.exists())
        .ok_or_else(|| format!("cudarc-{version} not found under {}", registry.display()))
}

/// Every `pub unsafe fn NAME(` of a cudarc sys module: the C functions it links.
fn binding_functions(path: &Path) -> Result<Vec<String>, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("pub unsafe fn "))
        .filter_map(|rest| rest.split('(').next())
        .filter(|name| !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    if names.is_empty() {
        return Err(format!("no functions found in {}", path.display()));
    }
    Ok(names)
}

fn make_stub(dir: &Path, name: &str, soname: &str, functions: &[String]) -> Result<(), String> {
    let source = dir.join(format!("{name}_stub.c"));
    let body: String = functions.iter().map(|f| format!("void {f}(void) {{}}\n")).collect();
    fs::write(&source, format!("/* Link-time stub of {soname}; never loaded. */\n{body}"))
        .map_err(|e| e.to_string())?;
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join(format!("lib{name}.so")))
        .arg(format!("-Wl,-soname,{soname}"))
        .arg(&source)
        .status()
        .map_err(|e| format!("{cc}: {e}"))?;
    if !status.success() {
        return Err(format!("{cc} failed on {}", source.display()));
    }
    Ok(())
}
