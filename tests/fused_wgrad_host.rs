//! Host-only checks of the gathered wgrad (no GPU needed): the plan's shape rules, the C ABI's
//! refusals before any launch, and the shared-memory layout its producer writes against the
//! ones cute builds the wgmma (sm_90a) and UMMA (sm_100a) descriptors from.

mod common;

use capturable_moe::dtype::DType;
use capturable_moe::fused::{GatherWgrad, GatherWgradConfig, RowSource, WgradOutput};
use capturable_moe::Error;

fn config() -> GatherWgradConfig {
    GatherWgradConfig {
        num_experts: 128,
        m: 1536,
        n: 2048,
        capacity: 32768,
        max_tokens: 4096,
        dtype: DType::Bf16,
        output: WgradOutput::Same,
        a_rows: RowSource::Plain,
        b_rows: RowSource::Gathered,
    }
}

#[test]
fn fused_wgrad_takes_model_shapes() {
    for (m, n) in [(1536, 2048), (2816, 2048), (2048, 768), (8, 8), (136, 264)] {
        for output in [WgradOutput::Same, WgradOutput::F32, WgradOutput::F32Accumulate] {
            let c = GatherWgradConfig { m, n, output, ..config() };
            GatherWgrad::check_shapes(&c).unwrap_or_else(|e| panic!("M {m} N {n} {output:?}: {e}"));
        }
    }
}

#[test]
fn fused_wgrad_refuses_bad_shapes() {
    let cases: [(&str, GatherWgradConfig); 7] = [
        ("E = 0", GatherWgradConfig { num_experts: 0, ..config() }),
        ("M = 0", GatherWgradConfig { m: 0, ..config() }),
        ("M = 1540", GatherWgradConfig { m: 1540, ..config() }),
        ("N = 2044", GatherWgradConfig { n: 2044, ..config() }),
        ("fp32 operands", GatherWgradConfig { dtype: DType::F32, ..config() }),
        ("capacity past i32", GatherWgradConfig { capacity: 1 << 31, ..config() }),
        ("too many tiles", GatherWgradConfig { num_experts: 1 << 20, m: 1 << 16, ..config() }),
    ];
    for (what, c) in cases {
        let r = GatherWgrad::check_shapes(&c);
        let right = match what {
            "M = 1540" | "N = 2044" => matches!(r, Err(Error::Alignment { multiple: 8, .. })),
            "fp32 operands" | "too many tiles" => matches!(r, Err(Error::Unsupported { .. })),
            _ => matches!(r, Err(Error::InvalidArgument { .. })),
        };
        assert!(right, "{what}: {r:?}");
    }
}

#[test]
fn fused_wgrad_fc1_config_reads_the_routing_plan() {
    use capturable_moe::routing::{RoutingConfig, RoutingPlan};
    let routing = RoutingPlan::new(RoutingConfig {
        num_experts: 64,
        hidden: 2048,
        ffn: 1408,
        topk: 8,
        max_tokens: 512,
        capacity: None,
        expert_capacity: None,
        dtype: DType::F16,
        prob_dtype: DType::F32,
    })
    .unwrap();
    let c = GatherWgradConfig::fc1(&routing, WgradOutput::F32Accumulate);
    assert_eq!((c.num_experts, c.m, c.n, c.max_tokens), (64, 2 * 1408, 2048, 512));
    assert_eq!(c.capacity, routing.capacity());
    assert_eq!(
        (c.a_rows, c.b_rows, c.dtype, c.out_dtype()),
        (RowSource::Plain, RowSource::Gathered, DType::F16, DType::F32)
    );
    let cap = routing.capacity();
    assert_eq!(c.operand_lens(), (cap * 2 * 1408, 512 * 2048, 64 * 2 * 1408 * 2048));
}

// ---- the C ABI's host-side checks, called with fake device addresses (never dereferenced:
// every call below returns before any CUDA call) ----

mod abi {
    use std::ffi::c_void;
    use std::ptr::{null, null_mut};

    use capturable_moe::sys;

    const INVALID: i32 = sys::CAPMOE_ERR_INVALID_ARGUMENT as i32;
    const MISALIGNED: i32 = sys::CAPMOE_ERR_MISALIGNED as i32;
    const UNSUPPORTED: i32 = sys::CAPMOE_ERR_UNSUPPORTED as i32;

    type EditDesc = fn(&mut sys::capmoe_wgrad_gather_desc_t);

    fn fake(offset: usize) -> *mut c_void {
        (0x7f00_0000_0000usize + offset) as *mut c_void
    }

    fn desc() -> sys::capmoe_wgrad_gather_desc_t {
        sys::capmoe_wgrad_gather_desc_t {
            num_experts: 8,
            m: 256,
            n: 512,
            capacity: 128,
            max_tokens: 64,
            sm_count: 132,
            dtype: sys::CAPMOE_DTYPE_BF16 as i32,
            out_dtype: sys::CAPMOE_DTYPE_BF16 as i32,
            accumulate: 0,
            a_rows: sys::CAPMOE_WGRAD_ROWS_PLAIN as i32,
            b_rows: sys::CAPMOE_WGRAD_ROWS_GATHERED as i32,
        }
    }

    /// The launch with pointers (a, b, offsets, token_of_row, dw) and good schedule words.
    fn call(
        d: &sys::capmoe_wgrad_gather_desc_t,
        a: *const c_void,
        b: *const c_void,
        offsets: *const c_void,
        tokens: *const c_void,
        dw: *mut c_void,
    ) -> i32 {
        call_with_schedule(d, [a, b, offsets, tokens], dw, fake(0x5000))
    }

    fn call_with_schedule(
        d: &sys::capmoe_wgrad_gather_desc_t,
        [a, b, offsets, tokens]: [*const c_void; 4],
        dw: *mut c_void,
        schedule: *mut c_void,
    ) -> i32 {
        unsafe {
            sys::capmoe_wgrad_gather(
                d,
                a,
                b,
                offsets as *const i64,
                tokens as *const i32,
                dw,
                schedule as *mut i32,
                null_mut(),
            )
        }
    }

    fn good(d: &sys::capmoe_wgrad_gather_desc_t) -> i32 {
        call(d, fake(0), fake(0x1000), fake(0x2000), fake(0x3000), fake(0x4000))
    }

    #[test]
    fn fused_wgrad_c_abi_refuses_bad_descriptors() {
        assert_eq!(
            unsafe {
                sys::capmoe_wgrad_gather(null(), fake(0), fake(0), null(), null(), fake(0), null_mut(), null_mut())
            },
            INVALID
        );
        assert_eq!(unsafe { sys::capmoe_wgrad_gather_supported(null()) }, INVALID);
        let f32 = sys::CAPMOE_DTYPE_F32 as i32;
        let cases: [(&str, EditDesc, i32); 19] = [
            ("E = 0", |d| d.num_experts = 0, INVALID),
            ("M = 0", |d| d.m = 0, INVALID),
            ("N past i32", |d| d.n = 1 << 31, INVALID),
            ("negative capacity", |d| d.capacity = -1, INVALID),
            // The producer's row steps past the last expert's end would wrap in int32 (a hang).
            ("capacity 2^31 - 120", |d| d.capacity = (1 << 31) - 120, INVALID),
            ("negative max_tokens", |d| d.max_tokens = -1, INVALID),
            // The producer addresses a gathered operand's 16-byte chunks in 32 bits: 2^30 * 2^15 / 8.
            (
                "gathered b past 64 GB",
                |d| (d.b_rows, d.max_tokens, d.n) = (sys::CAPMOE_WGRAD_ROWS_GATHERED as i32, 1 << 30, 1 << 15),
                UNSUPPORTED,
            ),
            ("sm_count 0", |d| d.sm_count = 0, INVALID),
            ("accumulate 2", |d| d.accumulate = 2, INVALID),
            ("a_rows 2", |d| d.a_rows = 2, INVALID),
            ("b_rows -1", |d| d.b_rows = -1, INVALID),
            ("M = 260", |d| d.m = 260, MISALIGNED),
            ("N = 20", |d| d.n = 20, MISALIGNED),
            ("fp32 operands", |d| d.dtype = sys::CAPMOE_DTYPE_F32 as i32, UNSUPPORTED),
            ("f16 output of bf16", |d| d.out_dtype = sys::CAPMOE_DTYPE_F16 as i32, UNSUPPORTED),
            ("accumulate into bf16", |d| d.accumulate = 1, UNSUPPORTED),
            ("too many tiles", |d| (d.num_experts, d.m, d.n) = (1 << 24, 1 << 16, 8), UNSUPPORTED),
            // i32::MAX tiles fit an int, but the persistent loop's last step (tile + grid) does not.
            ("loop index past i32", |d| (d.num_experts, d.m, d.n) = (i32::MAX as i64, 8, 8), UNSUPPORTED),
            // E * M tiles * N tiles = (2^31 - 1) * 2^24 * 2^23: past i64 (it wrapped negative and
            // passed the tile check before the count was taken in 128 bits).
            (
                "tile count past i64",
                |d| (d.num_experts, d.m, d.n) = (i32::MAX as i64, (1 << 31) - 8, (1 << 31) - 8),
                UNSUPPORTED,
            ),
        ];
        for (what, edit, want) in cases {
            let mut d = desc();
            edit(&mut d);
            assert_eq!(good(&d), want, "{what}");
            assert_eq!(unsafe { sys::capmoe_wgrad_gather_supported(&d) }, want, "{what} (supported)");
        }
        // Accumulating into fp32 is a valid descriptor: refused only by what the device check
        // says (asked through _supported: a launch with fake addresses must never reach a GPU).
        let mut d = desc();
        (d.out_dtype, d.accumulate) = (f32, 1);
        assert!(![INVALID, MISALIGNED].contains(&unsafe { sys::capmoe_wgrad_gather_supported(&d) }), "fp32 accumulate");
    }

    #[test]
    fn fused_wgrad_c_abi_checks_pointers_before_any_launch() {
        let d = desc();
        let (a, b, o, t, dw) = (fake(0), fake(0x1000), fake(0x2000), fake(0x3000), fake(0x4000));
        assert_eq!(call(&d, a, b, null(), t, dw), INVALID, "NULL offsets");
        assert_eq!(call(&d, a, b, o, t, null_mut()), INVALID, "NULL dw");
        assert_eq!(call(&d, null(), b, o, t, dw), INVALID, "NULL a");
        assert_eq!(call(&d, a, null(), o, t, dw), INVALID, "NULL b");
        assert_eq!(call(&d, a, b, o, null(), dw), INVALID, "NULL token_of_row with a gathered operand");
        assert_eq!(call(&d, fake(8), b, o, t, dw), MISALIGNED, "a not 16-aligned");
        assert_eq!(call(&d, a, fake(0x1008), o, t, dw), MISALIGNED, "b not 16-aligned");
        assert_eq!(call(&d, a, b, o, t, fake(0x4004)), MISALIGNED, "dw not 16-aligned");
        assert_eq!(call(&d, a, b, fake(0x2004), t, dw), MISALIGNED, "offsets not 8-aligned");
        assert_eq!(call(&d, a, b, o, fake(0x3002), dw), MISALIGNED, "token_of_row not 4-aligned");
        assert_eq!(call_with_schedule(&d, [a, b, o, t], dw, null_mut()), INVALID, "NULL schedule");
        assert_eq!(call_with_schedule(&d, [a, b, o, t], dw, fake(0x5002)), MISALIGNED, "schedule not 4-aligned");
        // Capacity 0 and accumulate: no row exists, so a, b and token_of_row may be NULL, and
        // nothing is launched (dW stays as it is); only the device check can refuse it.
        let f32 = sys::CAPMOE_DTYPE_F32 as i32;
        let empty = sys::capmoe_wgrad_gather_desc_t { capacity: 0, out_dtype: f32, accumulate: 1, ..d };
        assert!(![INVALID, MISALIGNED].contains(&call(&empty, null(), null(), o, null(), dw)), "capacity 0");
    }
}

/// The producer's hand-swizzled chunk offsets (csrc/fused/wgrad_gather_layout.h) against
/// cute's addressing of the layout the kernel builds its wgmma descriptors from: compiles and
/// runs tests/layout/wgrad_smem_layout.cu on the host with the project's nvcc and CUTLASS.
#[test]
fn fused_wgrad_smem_layout_matches_cute() {
    common::layout::run_check("wgrad_smem_layout.cu");
}

/// The sm_100a kernel (csrc/fused/wgrad_gather_sm100.cu, compiled only): the shared producer's
/// chunk offsets against cute's addressing of the MN-major UMMA stage layouts, both operands'
/// shared-memory descriptors read through the PTX ISA's canonical form, the instruction
/// descriptor's bits, and the accumulator's TMEM layout (lane = tile row m, column = n):
/// compiles and runs tests/layout/wgrad_sm100_layout.cu on the host (no Blackwell GPU needed).
#[test]
fn fused_wgrad_sm100_layouts_match_cute() {
    common::layout::run_check("wgrad_sm100_layout.cu");
}
