//! The C ABI's host-side checks, called directly (as another engine would) with fake device
//! addresses: every call here must return its status before touching the GPU, so these run
//! without one. They pin the codes the headers document for inputs the Rust wrappers never
//! produce (a NULL workspace, a misaligned flag word, a configuration no kernel exists for).

use std::ptr::null_mut;

use capturable_moe::device::Arch;
use capturable_moe::sys;

const OK: i32 = sys::CAPMOE_OK as i32;
const INVALID: i32 = sys::CAPMOE_ERR_INVALID_ARGUMENT as i32;
const MISALIGNED: i32 = sys::CAPMOE_ERR_MISALIGNED as i32;
const UNSUPPORTED: i32 = sys::CAPMOE_ERR_UNSUPPORTED as i32;

/// A 256-byte aligned address that is never dereferenced (the calls fail before any launch).
fn fake(offset: usize) -> *mut std::ffi::c_void {
    (0x7f00_0000_0000usize + offset) as *mut std::ffi::c_void
}

fn gemm_desc(arch: i32, config: sys::capmoe_gemm_config_t) -> sys::capmoe_grouped_gemm_desc_t {
    sys::capmoe_grouped_gemm_desc_t {
        op: sys::CAPMOE_GEMM_FPROP as i32,
        arch,
        dtype: sys::CAPMOE_DTYPE_BF16 as i32,
        out_dtype: sys::CAPMOE_DTYPE_BF16 as i32,
        split_dtype: sys::CAPMOE_DTYPE_I32 as i32,
        weight_layout: sys::CAPMOE_WEIGHT_ENK as i32,
        weights_as_pointers: 0,
        accumulate: 0,
        config,
        sm_count: 132,
        num_experts: 8,
        n: 256,
        k: 128,
        capacity: 1024,
    }
}

/// The GEMM checks need a built SM90 kernel to get past `find_variant`.
fn sm90_built_or_skip() -> bool {
    let built = Arch::Sm90.is_built();
    if !built {
        println!("skipping: SM90 kernels not built (CAPMOE_CUDA_ARCHS)");
    }
    built
}

fn resolve(desc: &sys::capmoe_grouped_gemm_desc_t) -> (i32, sys::capmoe_gemm_config_t) {
    let mut config = -1;
    let status = unsafe { sys::capmoe_grouped_gemm_resolve_config(desc, &mut config) };
    (status as i32, config)
}

#[test]
fn resolve_config_refuses_configurations_without_a_kernel() {
    if !sm90_built_or_skip() {
        return;
    }
    // 128 rows per expert, an output of 256 over a reduction of 128: AUTO's first choice, the
    // counter kernel (built for bf16 and fp16); with a pointer array of weights, which that
    // kernel does not take, the 64x256 pingpong; wgrad: the counter kernel too, and the
    // cooperative one for an fp32 dW.
    let auto = gemm_desc(90, sys::CAPMOE_CONFIG_AUTO as i32);
    assert_eq!(resolve(&auto), (OK, sys::CAPMOE_CONFIG_SM90_COUNTER as i32));
    let auto_pointers = sys::capmoe_grouped_gemm_desc_t { weights_as_pointers: 1, ..auto };
    assert_eq!(resolve(&auto_pointers), (OK, sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE as i32));
    let auto_f16 = sys::capmoe_grouped_gemm_desc_t {
        dtype: sys::CAPMOE_DTYPE_F16 as i32,
        out_dtype: sys::CAPMOE_DTYPE_F16 as i32,
        ..auto
    };
    assert_eq!(resolve(&auto_f16), (OK, sys::CAPMOE_CONFIG_SM90_COUNTER as i32));
    let auto_wgrad = sys::capmoe_grouped_gemm_desc_t { op: sys::CAPMOE_GEMM_WGRAD as i32, ..auto };
    assert_eq!(resolve(&auto_wgrad), (OK, sys::CAPMOE_CONFIG_SM90_COUNTER as i32));
    let auto_wgrad_f32 = sys::capmoe_grouped_gemm_desc_t { out_dtype: sys::CAPMOE_DTYPE_F32 as i32, ..auto_wgrad };
    assert_eq!(resolve(&auto_wgrad_f32), (OK, sys::CAPMOE_CONFIG_SM90_COOPERATIVE as i32));
    for (what, desc) in [
        ("an unknown config value", gemm_desc(90, 42)),
        ("an SM100 config on SM90", gemm_desc(90, sys::CAPMOE_CONFIG_SM100_2SM as i32)),
        ("an unknown arch", gemm_desc(7, sys::CAPMOE_CONFIG_AUTO as i32)),
        (
            "fp16 wgrad with a bf16-only candidate tile",
            sys::capmoe_grouped_gemm_desc_t {
                op: sys::CAPMOE_GEMM_WGRAD as i32,
                dtype: sys::CAPMOE_DTYPE_F16 as i32,
                out_dtype: sys::CAPMOE_DTYPE_F16 as i32,
                ..gemm_desc(90, sys::CAPMOE_CONFIG_SM90_COOPERATIVE_NOCLUSTER as i32)
            },
        ),
        ("a deleted config code (the 128x128 pingpong)", gemm_desc(90, 7)),
        (
            "a pingpong tile for wgrad",
            sys::capmoe_grouped_gemm_desc_t {
                op: sys::CAPMOE_GEMM_WGRAD as i32,
                ..gemm_desc(90, sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE as i32)
            },
        ),
    ] {
        assert_eq!(resolve(&desc).0, UNSUPPORTED, "{what}");
    }
    assert_eq!(
        resolve(&gemm_desc(90, sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE as i32)),
        (OK, sys::CAPMOE_CONFIG_SM90_PINGPONG_WIDE as i32)
    );
}

#[test]
fn grouped_gemm_run_checks_every_pointer_before_launching() {
    if !sm90_built_or_skip() {
        return;
    }
    let desc = gemm_desc(90, sys::CAPMOE_CONFIG_AUTO as i32);
    let run = |flags: usize, splits: usize, workspace: usize| unsafe {
        sys::capmoe_grouped_gemm_run(
            &desc,
            fake(0),
            fake(0),
            fake(0),
            fake(splits),
            fake(flags) as *mut i32,
            fake(workspace),
            1 << 20,
            null_mut(),
        ) as i32
    };
    assert_eq!(run(2, 0, 0), MISALIGNED, "overflow_flags off 4-byte alignment");
    assert_eq!(run(0, 2, 0), MISALIGNED, "int32 m_splits off 4-byte alignment");
    assert_eq!(run(0, 0, 16), MISALIGNED, "workspace off 256-byte alignment");
    let null_splits = unsafe {
        sys::capmoe_grouped_gemm_run(
            &desc,
            fake(0),
            fake(0),
            fake(0),
            null_mut(),
            null_mut(),
            fake(0),
            1 << 20,
            null_mut(),
        )
    };
    assert_eq!(null_splits as i32, INVALID, "NULL m_splits");
}

#[test]
fn routing_build_refuses_a_null_workspace() {
    let desc = sys::capmoe_routing_desc_t {
        num_experts: 8,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 16,
        capacity: 32,
        expert_capacity: 0,
        dtype: sys::CAPMOE_DTYPE_BF16 as i32,
        prob_dtype: sys::CAPMOE_DTYPE_F32 as i32,
    };
    let p = |o: usize| fake(o);
    let build = |workspace: *mut std::ffi::c_void, bytes: u64| unsafe {
        sys::capmoe_routing_build(
            &desc,
            p(0) as *const i32,
            16,
            std::ptr::null(),
            p(0) as *mut i32,
            p(0) as *mut i64,
            p(0) as *mut i64,
            p(0) as *mut i32,
            p(0) as *mut i32,
            p(0) as *mut i32,
            p(0) as *mut i32,
            workspace,
            bytes,
            null_mut(),
        ) as i32
    };
    assert_eq!(build(null_mut(), 1 << 20), INVALID, "NULL workspace");
    assert_eq!(build(p(0), 0), sys::CAPMOE_ERR_WORKSPACE_TOO_SMALL as i32, "workspace of 0 bytes");
}

/// The status codes the header declares, `(name, value)`, read from the header itself so that
/// a code added there without a name in `capmoe_status_string` fails the test below. The text
/// is compiled in: the test binary also runs from a bundle, away from this source tree.
fn declared_status_codes() -> Vec<(String, i32)> {
    let header = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/csrc/include/capturable_moe/status.h"));
    let mut codes = Vec::new();
    for line in header.lines().map(str::trim) {
        let Some((name, rest)) = line.split_once('=') else { continue };
        let name = name.trim();
        if name == "CAPMOE_OK" || name.starts_with("CAPMOE_ERR_") {
            let value = rest.trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap();
            codes.push((name.to_string(), value.parse().unwrap_or_else(|_| panic!("{name}: value in `{line}`"))));
        }
    }
    codes
}

fn status_string(status: i32) -> String {
    let text = unsafe { sys::capmoe_status_string(status) };
    assert!(!text.is_null(), "capmoe_status_string({status}) returned NULL");
    unsafe { std::ffi::CStr::from_ptr(text) }.to_str().expect("ASCII status string").to_owned()
}

/// Every declared status code maps to its own name as the header spells it (so all are
/// distinct and non-empty); any other value, to "unknown status", never NULL.
#[test]
fn every_status_code_has_its_own_name() {
    let codes = declared_status_codes();
    assert!(codes.len() >= 8, "found only {codes:?} in status.h");
    assert!(codes.contains(&("CAPMOE_ERR_CUTLASS".to_string(), sys::CAPMOE_ERR_CUTLASS as i32)));
    let mut seen = std::collections::HashSet::new();
    for (name, value) in &codes {
        let text = status_string(*value);
        assert_eq!(&text, name, "capmoe_status_string({value})");
        assert!(seen.insert(text), "{name}: the same string as another code");
    }
    let largest = codes.iter().map(|c| c.1).max().unwrap();
    for unknown in [-1, largest + 1, 1000, i32::MIN, i32::MAX] {
        assert_eq!(status_string(unknown), "unknown status", "capmoe_status_string({unknown})");
    }
}
