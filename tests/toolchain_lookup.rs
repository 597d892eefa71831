//! Host-only: the order in which build.rs looks for nvcc and CUTLASS, and its error message.

#[path = "../build/toolchain.rs"]
mod toolchain;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use toolchain::{find_cutlass, find_toolkit};

/// A throwaway folder with fake toolkits laid out like the real ones.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("capmoe-lookup-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn touch(&self, rel: &str) -> PathBuf {
        let path = self.0.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, b"").unwrap();
        path
    }

    /// A toolkit prefix with bin/nvcc and `lib_dir`/libcudart_static.a.
    fn toolkit(&self, prefix: &str, lib_dir: &str) -> PathBuf {
        self.touch(&format!("{prefix}/bin/nvcc"));
        self.touch(&format!("{prefix}/{lib_dir}/libcudart_static.a"));
        self.0.join(prefix)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn env_of(vars: &[(&str, &Path)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.display().to_string())).collect();
    move |k: &str| map.get(k).cloned()
}

#[test]
fn nvcc_variable_wins_over_everything() {
    let s = Scratch::new("nvcc");
    let explicit = s.toolkit("explicit", "lib64");
    let home = s.toolkit("home", "lib64");
    s.toolkit("root/.toolchain/nvidia/cu13", "lib");
    let env = env_of(&[("NVCC", &explicit.join("bin/nvcc")), ("CUDA_HOME", &home)]);
    let found = find_toolkit(&env, &s.0.join("root"), &s.0.join("system")).unwrap();
    assert_eq!(found.origin, "NVCC");
    assert_eq!(found.lib_dir, explicit.join("lib64"));
}

#[test]
fn cuda_home_then_cuda_path_then_project_then_system() {
    let s = Scratch::new("order");
    let home = s.toolkit("home", "lib64");
    let path = s.toolkit("path", "lib64");
    let project = s.toolkit("root/.toolchain/nvidia/cu13", "lib");
    let system = s.toolkit("system", "lib64");
    let root = s.0.join("root");

    let env = env_of(&[("CUDA_HOME", &home), ("CUDA_PATH", &path)]);
    assert_eq!(find_toolkit(&env, &root, &system).unwrap().origin, "CUDA_HOME");
    let env = env_of(&[("CUDA_PATH", &path)]);
    assert_eq!(find_toolkit(&env, &root, &system).unwrap().origin, "CUDA_PATH");
    let env = env_of(&[]);
    let found = find_toolkit(&env, &root, &system).unwrap();
    assert_eq!(found.origin, "project toolchain");
    assert_eq!(found.lib_dir, project.join("lib"), "the wheel layout has lib/, not lib64/");
    fs::remove_dir_all(root.join(".toolchain")).unwrap();
    assert_eq!(find_toolkit(&env, &root, &system).unwrap().nvcc, system.join("bin/nvcc"));
}

#[test]
fn a_candidate_without_cudart_is_skipped() {
    let s = Scratch::new("nocudart");
    s.touch("broken/bin/nvcc");
    let good = s.toolkit("good", "lib64");
    let env = env_of(&[("CUDA_HOME", &s.0.join("broken")), ("CUDA_PATH", &good)]);
    assert_eq!(find_toolkit(&env, &s.0.join("root"), &s.0.join("system")).unwrap().origin, "CUDA_PATH");
}

#[test]
fn nothing_found_lists_every_candidate_and_the_fix() {
    let s = Scratch::new("none");
    let env = env_of(&[("CUDA_HOME", &s.0.join("nowhere"))]);
    let err = find_toolkit(&env, &s.0.join("root"), &s.0.join("system")).unwrap_err();
    for needle in ["CUDA_HOME", "project toolchain", "system", "bash scripts/bootstrap.sh"] {
        assert!(err.contains(needle), "message lacks {needle:?}:\n{err}");
    }
    let err = find_cutlass(&env, &s.0.join("root")).unwrap_err();
    for needle in ["submodule", "project toolchain", "bash scripts/bootstrap.sh", "CUTLASS_DIR"] {
        assert!(err.contains(needle), "message lacks {needle:?}:\n{err}");
    }
}

#[test]
fn cutlass_dir_then_submodule_then_wheel() {
    let s = Scratch::new("cutlass");
    let root = s.0.join("root");
    s.touch("root/.toolchain/cutlass_library/source/include/cutlass/cutlass.h");
    let env = env_of(&[]);
    assert_eq!(find_cutlass(&env, &root).unwrap()[0], root.join(".toolchain/cutlass_library/source/include"));
    // An empty (uninitialised) submodule folder is skipped; a populated one wins.
    fs::create_dir_all(root.join("third_party/cutlass")).unwrap();
    assert_eq!(find_cutlass(&env, &root).unwrap()[0], root.join(".toolchain/cutlass_library/source/include"));
    s.touch("root/third_party/cutlass/include/cutlass/cutlass.h");
    assert_eq!(find_cutlass(&env, &root).unwrap()[0], root.join("third_party/cutlass/include"));
    s.touch("mine/include/cutlass/cutlass.h");
    let env = env_of(&[("CUTLASS_DIR", &s.0.join("mine"))]);
    assert_eq!(find_cutlass(&env, &root).unwrap(), vec![s.0.join("mine/include"), s.0.join("mine/tools/util/include")]);
}
