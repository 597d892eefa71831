//! Rules of the CUDA sources that no compiler checks, read from `csrc/` as text.
//!
//! A kernel launched by `launch_dependent` (csrc/common/dependent_kernel.cuh) may start while
//! the kernel before it on the stream still runs, so its first statement must be
//! `begin_dependent_kernel()`: a global read or write before it races with that kernel, and
//! only sometimes, so the GPU suites would not reliably catch a kernel that forgot it.

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.cu` / `.cuh` file under `dir`, with its text.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "cu" || e == "cuh") {
            let text = fs::read_to_string(&path).unwrap();
            out.push((path, text));
        }
    }
    out
}

/// The identifier at the start of `s` (letters, digits, `_`).
fn identifier(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The kernels passed to `launch_dependent(` anywhere (its own definition excluded).
fn dependent_kernels(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut names = Vec::new();
    for (_, text) in files {
        for (at, _) in text.match_indices("launch_dependent(") {
            let name = identifier(text[at + "launch_dependent(".len()..].trim_start());
            if !name.is_empty() && name != "void" && !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// The body of the `__global__` function `name` (from its opening brace), if some file defines it.
fn kernel_body<'a>(files: &'a [(PathBuf, String)], name: &str) -> Option<(&'a Path, &'a str)> {
    for (path, text) in files {
        for (at, _) in text.match_indices("__global__") {
            let Some(offset) = text[at..].find('{') else { continue };
            let head_end = at + offset;
            let head = &text[at..head_end];
            // The name followed by its parameter list, in the declaration before the body.
            let declares = head.match_indices(name).any(|(i, _)| {
                let before = head[..i].chars().next_back().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
                before && head[i + name.len()..].trim_start().starts_with('(')
            });
            if declares {
                return Some((path, &text[head_end + 1..]));
            }
        }
    }
    None
}

/// The body's first statement that is not a declaration without effect (a shared-memory array,
/// a type alias, a compile-time constant), comments removed, whitespace collapsed.
fn first_statement(body: &str) -> String {
    let code: String = body.lines().map(|l| l.split("//").next().unwrap()).collect::<Vec<_>>().join(" ");
    code.split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .find(|s| {
            !["using ", "__shared__", "CAPMOE_DYNAMIC_SMEM(", "constexpr ", "static_assert("]
                .iter()
                .any(|p| s.starts_with(p))
        })
        .unwrap_or_default()
}

#[test]
fn every_dependent_launch_begins_with_its_wait() {
    let files = sources(&Path::new(env!("CARGO_MANIFEST_DIR")).join("csrc"));
    let kernels = dependent_kernels(&files);
    // The routing kernels (map, permute, SwiGLU, combine and their backward) and the GEMM's
    // argument kernel: a scan that found none would pass vacuously.
    assert!(kernels.len() >= 13, "found only {kernels:?}");
    for name in &kernels {
        let (path, body) = kernel_body(&files, name).unwrap_or_else(|| panic!("no __global__ {name} in csrc/"));
        assert_eq!(
            first_statement(body),
            "begin_dependent_kernel()",
            "{name} ({}) is launched by launch_dependent, so its first statement must be begin_dependent_kernel()",
            path.display()
        );
    }
}

#[test]
fn the_rule_sees_a_kernel_that_reads_before_its_wait() {
    let ok =
        "__global__ void k(int* p) {\n  __shared__ int s[4];\n  // why\n  begin_dependent_kernel();\n  p[0] = 1;\n}";
    let bad = "__global__ void k(int* p) {\n  const int t = p[0];\n  begin_dependent_kernel();\n}";
    let files = |text: &str| vec![(PathBuf::from("x.cu"), format!("{text}\nlaunch_dependent(k, 1, 32, 0, s);"))];
    let (ok_files, bad_files) = (files(ok), files(bad));
    assert_eq!(dependent_kernels(&ok_files), ["k"]);
    assert_eq!(first_statement(kernel_body(&ok_files, "k").unwrap().1), "begin_dependent_kernel()");
    assert_eq!(first_statement(kernel_body(&bad_files, "k").unwrap().1), "const int t = p[0]");
}
