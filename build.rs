//! Compiles every CUDA translation unit under `csrc/` with nvcc, caches the objects by content
//! hash, archives them, links cudart statically and generates the `sys` bindings with bindgen.
//!
//! Offline by design: it only looks for a toolkit (env vars -> the project-local `.toolchain/`
//! that `scripts/bootstrap.sh` installs -> /usr/local/cuda) and never downloads anything.
//!
//! Each `.cu` file declares the archs it supports on a line `// capmoe-archs: 90a 100a`; the
//! build compiles the intersection with `CAPMOE_CUDA_ARCHS` (default "90a 100a") and emits the
//! `has_sm90` / `has_sm100` cfgs for what was built, so Rust never calls a symbol that is absent.

use std::collections::{BTreeSet, HashSet};
use std::env;
use std::fs::{self, File};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[path = "build/toolchain.rs"]
mod toolchain;

use toolchain::{find_cutlass, find_toolkit, Toolkit, FIX_COMMAND};

/// Archs this crate knows how to build, with the cfg each one turns on.
const KNOWN_ARCHS: &[(&str, &str)] = &[("90a", "has_sm90"), ("100a", "has_sm100")];
const DEFAULT_ARCHS: &str = "90a 100a";
/// One CUTLASS TU takes ~3.2 GB and a core for a minute: never run more than this at once,
/// across every cargo process that shares the object cache.
const MAX_NVCC_JOBS: usize = 2;
const ARCH_MARKER: &str = "// capmoe-archs:";

fn main() {
    if let Err(message) = run() {
        eprintln!("\nerror: capturable-moe build failed\n{message}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUTLASS_DIR",
        "CAPMOE_CUDA_ARCHS",
        "CAPMOE_NVCC_JOBS",
        "CAPMOE_OBJ_CACHE",
        "CAPMOE_NVCC_VERBOSE",
        "CAPMOE_NVCC_DEFINES",
        "LIBCLANG_PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build/toolchain.rs");

    let archs = requested_archs()?;
    let env = |var: &str| env::var(var).ok().filter(|v| !v.is_empty());
    let toolkit = find_toolkit(&env, &manifest, Path::new("/usr/local/cuda"))?;
    let cutlass = find_cutlass(&env, &manifest)?;
    let csrc = manifest.join("csrc");

    let sources = list_files(&csrc, &|p| p.extension().is_some_and(|e| e == "cu"));
    for file in list_files(&csrc, &|_| true) {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let mut units = Vec::new();
    for source in &sources {
        let declared = declared_archs(source)?;
        let build: Vec<String> = archs.iter().filter(|a| declared.contains(*a)).cloned().collect();
        if !build.is_empty() {
            units.push(Unit { source: source.clone(), archs: build });
        }
    }

    let common_flags = nvcc_flags(&csrc, &cutlass);
    let cache = ObjectCache::new(&out_dir)?;
    let identity = compiler_identity(&toolkit, &cutlass)?;
    let objects = compile_all(&toolkit, &units, &archs, &common_flags, &identity, &cache)?;

    let mut archive = cc::Build::new();
    archive.cargo_warnings(false);
    for object in &objects {
        archive.object(object);
    }
    archive.try_compile("capmoe_kernels").map_err(|e| format!("archiving objects: {e}"))?;

    println!("cargo:rustc-link-search=native={}", toolkit.lib_dir.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }

    for (arch, cfg) in KNOWN_ARCHS {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if archs.iter().any(|a| a == arch) {
            println!("cargo:rustc-cfg={cfg}");
        }
    }

    generate_bindings(&csrc.join("include"), &out_dir)
}

struct Unit {
    source: PathBuf,
    archs: Vec<String>,
}

fn requested_archs() -> Result<Vec<String>, String> {
    let list = env::var("CAPMOE_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let mut archs = Vec::new();
    for arch in list.split([' ', ',', ';']).filter(|s| !s.is_empty()) {
        let arch = arch.trim_start_matches("sm_").to_string();
        if !KNOWN_ARCHS.iter().any(|(known, _)| *known == arch) {
            let known: Vec<_> = KNOWN_ARCHS.iter().map(|(a, _)| *a).collect();
            return Err(format!("CAPMOE_CUDA_ARCHS names '{arch}'; known archs: {}", known.join(" ")));
        }
        archs.push(arch);
    }
    if archs.is_empty() {
        return Err("CAPMOE_CUDA_ARCHS is empty; set it to e.g. \"90a 100a\"".into());
    }
    Ok(archs)
}

/// The archs a TU declares on its `// capmoe-archs:` line.
fn declared_archs(source: &Path) -> Result<HashSet<String>, String> {
    let text = read(source)?;
    let line = text.lines().find(|l| l.trim_start().starts_with(ARCH_MARKER)).ok_or_else(|| {
        format!("{} has no '{ARCH_MARKER} ...' line declaring the archs it supports", source.display())
    })?;
    Ok(line.trim_start()[ARCH_MARKER.len()..].split_whitespace().map(str::to_string).collect())
}

fn nvcc_flags(csrc: &Path, cutlass: &[PathBuf]) -> Vec<String> {
    let mut flags: Vec<String> = [
        "-O3",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-DNDEBUG",
        "-Xcompiler=-fPIC",
        "-Xcudafe=--display_error_number",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.push(format!("-I{}", csrc.join("include").display()));
    flags.push(format!("-I{}", csrc.display()));
    for dir in cutlass {
        flags.push(format!("-I{}", dir.display()));
    }
    flags
}

/// `CAPMOE_NVCC_DEFINES`: whitespace-separated `NAME` or `NAME=VALUE` macros for debug builds
/// (e.g. `CAPMOE_FUSED_HANG_TRAP`, csrc/fused/pipeline.cuh), as the flags of `source`. A
/// `CAPMOE_FUSED_*` macro goes to the TUs under csrc/fused alone, so that a debug build of the
/// fused kernels recompiles those few TUs, not the CUTLASS GEMMs; any other macro goes to every
/// TU. They are part of the flags, so the object cache keeps such builds apart from plain ones.
fn debug_defines(source: &Path) -> Vec<String> {
    // The fused TUs are the files directly in csrc/fused (not any path with a `fused` folder
    // above the checkout).
    let fused_unit = source.parent().and_then(Path::file_name).is_some_and(|dir| dir == "fused");
    env::var("CAPMOE_NVCC_DEFINES")
        .unwrap_or_default()
        .split_whitespace()
        .filter(|d| fused_unit || !d.starts_with("CAPMOE_FUSED_"))
        .map(|d| format!("-D{d}"))
        .collect()
}

fn built_arch_defines(archs: &[String]) -> Vec<String> {
    KNOWN_ARCHS
        .iter()
        .map(|(arch, cfg)| {
            let built = archs.iter().any(|a| a == arch);
            format!("-DCAPMOE_{}={}", cfg.to_uppercase(), u8::from(built))
        })
        .collect()
}

fn gencode(arch: &str) -> String {
    format!("-gencode=arch=compute_{arch},code=sm_{arch}")
}

/// What identifies the compiler and third-party headers in the cache key.
fn compiler_identity(toolkit: &Toolkit, cutlass: &[PathBuf]) -> Result<String, String> {
    let version = Command::new(&toolkit.nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("running {} --version: {e}", toolkit.nvcc.display()))?;
    let cutlass_version = read(&cutlass[0].join("cutlass/version.h")).unwrap_or_default();
    Ok(format!("{}\n{}\n{}", String::from_utf8_lossy(&version.stdout), cutlass[0].display(), cutlass_version))
}

/// Object files live outside OUT_DIR (which differs per profile) so `cargo test` after
/// `cargo build --release` recompiles nothing.
struct ObjectCache {
    dir: PathBuf,
}

impl ObjectCache {
    fn new(out_dir: &Path) -> Result<ObjectCache, String> {
        let dir = match env::var("CAPMOE_OBJ_CACHE") {
            Ok(dir) => PathBuf::from(dir),
            // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
            Err(_) => out_dir.ancestors().nth(4).unwrap_or(out_dir).join("capmoe-nvcc-cache"),
        };
        fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(ObjectCache { dir })
    }

    /// Holds one of the MAX_NVCC_JOBS machine-wide compile slots until dropped.
    fn take_slot(&self) -> Result<File, String> {
        loop {
            for slot in 0..MAX_NVCC_JOBS {
                let path = self.dir.join(format!("nvcc-slot-{slot}.lock"));
                let file = File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                if file.try_lock().is_ok() {
                    return Ok(file);
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

fn compile_all(
    toolkit: &Toolkit,
    units: &[Unit],
    all_archs: &[String],
    common_flags: &[String],
    identity: &str,
    cache: &ObjectCache,
) -> Result<Vec<PathBuf>, String> {
    let jobs =
        env::var("CAPMOE_NVCC_JOBS").ok().and_then(|j| j.parse().ok()).unwrap_or(MAX_NVCC_JOBS).clamp(1, MAX_NVCC_JOBS);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, Result<PathBuf, String>)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::SeqCst);
                let Some(unit) = units.get(index) else { break };
                let result = compile_cached(toolkit, unit, all_archs, common_flags, identity, cache);
                results.lock().unwrap().push((index, result));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(index, _)| *index);
    let mut errors = String::new();
    let mut objects = Vec::new();
    for (_, result) in results {
        match result {
            Ok(object) => objects.push(object),
            Err(e) => errors.push_str(&e),
        }
    }
    if errors.is_empty() {
        Ok(objects)
    } else {
        Err(errors)
    }
}

fn compile_cached(
    toolkit: &Toolkit,
    unit: &Unit,
    all_archs: &[String],
    common_flags: &[String],
    identity: &str,
    cache: &ObjectCache,
) -> Result<PathBuf, String> {
    let mut flags = common_flags.to_vec();
    flags.extend(debug_defines(&unit.source));
    flags.extend(unit.archs.iter().map(|a| gencode(a)));
    // A TU that asks which archs the binary carries (the dispatcher, which must reference only
    // built variants) is told with CAPMOE_HAS_SM90 / CAPMOE_HAS_SM100 (1 or 0); other TUs'
    // flags (and so their cached objects) stay the same whatever the arch list.
    if read(&unit.source)?.contains("CAPMOE_HAS_") {
        flags.extend(built_arch_defines(all_archs));
    }

    // Keys are independent of where the checkout lives, so worktrees share one cache.
    let root = env::var("CARGO_MANIFEST_DIR").unwrap();
    let portable = |s: &str| s.replace(&root, "<root>");
    let mut hasher = DefaultHasher::new();
    portable(identity).hash(&mut hasher);
    for flag in &flags {
        portable(flag).hash(&mut hasher);
    }
    for file in source_closure(&unit.source, common_flags)? {
        read(&file)?.hash(&mut hasher);
    }
    let stem = unit.source.file_stem().unwrap().to_string_lossy();
    let object = cache.dir.join(format!("{stem}-{:016x}.o", hasher.finish()));
    if object.is_file() {
        return Ok(object);
    }

    // One compile per object machine-wide: whoever holds the object's lock compiles it, the
    // others wait and then find it in the cache.
    let lock_path = object.with_extension("lock");
    let object_lock = File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    object_lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    if object.is_file() {
        return Ok(object);
    }
    let _slot = cache.take_slot()?;
    let partial = object.with_extension(format!("o.{}.partial", std::process::id()));
    let started = std::time::Instant::now();
    let output = Command::new(&toolkit.nvcc)
        .args(&flags)
        .arg("-c")
        .arg(&unit.source)
        .arg("-o")
        .arg(&partial)
        .output()
        .map_err(|e| format!("running {}: {e}", toolkit.nvcc.display()))?;
    if !output.status.success() {
        let _ = fs::remove_file(&partial);
        return Err(format!(
            "nvcc failed on {} (archs {}):\n{}{}\n",
            unit.source.display(),
            unit.archs.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    if env::var("CAPMOE_NVCC_VERBOSE").is_ok() {
        println!("cargo:warning=nvcc {} [{}] {:.0?}", unit.source.display(), unit.archs.join(" "), started.elapsed());
    }
    fs::rename(&partial, &object).map_err(|e| format!("caching {}: {e}", object.display()))?;
    Ok(object)
}

/// The TU and every project header it includes, transitively (`#include "..."` resolved
/// against the including file's folder and the -I folders inside the project). CUTLASS and
/// CUDA headers are covered by `compiler_identity`.
fn source_closure(source: &Path, flags: &[String]) -> Result<BTreeSet<PathBuf>, String> {
    let search: Vec<PathBuf> = flags
        .iter()
        .filter_map(|f| f.strip_prefix("-I"))
        .map(PathBuf::from)
        .filter(|d| d.ends_with("csrc") || d.ends_with("csrc/include"))
        .collect();
    let mut seen = BTreeSet::new();
    let mut stack = vec![source.to_path_buf()];
    while let Some(file) = stack.pop() {
        if !seen.insert(file.clone()) {
            continue;
        }
        for line in read(&file)?.lines() {
            let Some(rest) = line.trim_start().strip_prefix("#include \"") else { continue };
            let Some(name) = rest.split('"').next() else { continue };
            let dirs = std::iter::once(file.parent().unwrap().to_path_buf()).chain(search.iter().cloned());
            if let Some(found) = dirs.map(|d| d.join(name)).find(|p| p.is_file()) {
                stack.push(found);
            }
        }
    }
    Ok(seen)
}

fn generate_bindings(include: &Path, out_dir: &Path) -> Result<(), String> {
    let header = include.join("capturable_moe.h");
    // NOTE: bindgen panics (instead of returning an error) when libclang cannot be loaded.
    let generated = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header(header.to_string_lossy())
            .clang_arg(format!("-I{}", include.display()))
            .allowlist_function("capmoe_.*")
            .allowlist_type("capmoe_.*")
            .allowlist_var("CAPMOE_.*")
            .default_enum_style(bindgen::EnumVariation::Consts)
            .derive_default(true)
            .layout_tests(false)
            .generate()
    });
    let bindings = match generated {
        Ok(Ok(bindings)) => bindings,
        Ok(Err(e)) => return Err(format!("bindgen failed on {}: {e}", header.display())),
        Err(_) => {
            return Err(format!("bindgen could not load libclang. Fix: run `{FIX_COMMAND}` or set LIBCLANG_PATH."))
        }
    };
    bindings.write_to_file(out_dir.join("capturable_moe_sys.rs")).map_err(|e| format!("writing bindings: {e}"))
}

fn list_files(dir: &Path, keep: &dyn Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if keep(&path) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn read(path: &Path) -> Result<String, String> {
    fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))
}
