//! Host-only checks of the fused kernels' plan-time shape rules and C ABI validation (no GPU
//! needed): the shapes the fused fc1 and the fused fc2 dgrad + SwiGLU backward refuse are the
//! ones whose callers must take the unfused path.

mod common;

use capturable_moe::dtype::DType;
use capturable_moe::fused::{FusedFc1, FusedSwigluDgrad, FC1_TILE_N, SWIGLU_DGRAD_TILE_N};
use capturable_moe::routing::RoutingConfig;
use capturable_moe::Error;

fn config(ffn: usize) -> RoutingConfig {
    RoutingConfig {
        num_experts: 128,
        hidden: 2048,
        ffn,
        topk: 8,
        max_tokens: 4096,
        capacity: None,
        expert_capacity: None,
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    }
}

#[test]
fn fused_fc1_takes_ffn_multiples_of_its_tile() {
    for f in [128, 256, 512, 768, 1408] {
        FusedFc1::check_shapes(&config(f)).unwrap_or_else(|e| panic!("F = {f}: {e}"));
    }
    for f in [8, 96, 200, 1400, FC1_TILE_N + 8] {
        let r = FusedFc1::check_shapes(&config(f));
        assert!(matches!(r, Err(Error::Unsupported { .. })), "F = {f}: {r:?}");
    }
}

/// One expert's W1 must stay below TMA's 2^40-byte stride limit (review-api-errors 5: with
/// E = 1024, H = 2^30, F = 2^29 the launch's w1 length E * 2F * H wrapped usize to 0).
#[test]
fn fused_kernels_refuse_weights_past_the_tma_limit() {
    let huge = RoutingConfig { num_experts: 1024, hidden: 1 << 30, ..config(1 << 29) };
    let r = FusedFc1::check_shapes(&huge);
    assert!(matches!(&r, Err(Error::Unsupported { why, .. }) if why.contains("2^40")), "{r:?}");
    let r = FusedSwigluDgrad::check_shapes(&huge);
    assert!(matches!(&r, Err(Error::Unsupported { why, .. }) if why.contains("2^40")), "{r:?}");
    // 2F x H x 2 bytes just below 2^40 passes; exactly 2^40 does not.
    FusedFc1::check_shapes(&RoutingConfig { hidden: 1 << 20, ..config((1 << 18) - 128) }).unwrap();
    let r = FusedFc1::check_shapes(&RoutingConfig { hidden: 1 << 20, ..config(1 << 18) });
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
}

#[test]
fn fused_fc1_refuses_fp32_activations() {
    let c = RoutingConfig { dtype: DType::F32, ..config(768) };
    assert!(matches!(FusedFc1::check_shapes(&c), Err(Error::Unsupported { .. })));
}

#[test]
fn fused_swiglu_dgrad_takes_ffn_multiples_of_its_tile() {
    for f in [128, 256, 512, 768, 1408] {
        FusedSwigluDgrad::check_shapes(&config(f)).unwrap_or_else(|e| panic!("F = {f}: {e}"));
    }
    for f in [8, 96, 200, 1400, SWIGLU_DGRAD_TILE_N + 64] {
        let r = FusedSwigluDgrad::check_shapes(&config(f));
        assert!(matches!(r, Err(Error::Unsupported { .. })), "F = {f}: {r:?}");
    }
    let many = RoutingConfig { num_experts: 1025, ..config(768) };
    assert!(matches!(FusedSwigluDgrad::check_shapes(&many), Err(Error::Unsupported { .. })), "E = 1025");
    let fp32 = RoutingConfig { dtype: DType::F32, ..config(768) };
    assert!(matches!(FusedSwigluDgrad::check_shapes(&fp32), Err(Error::Unsupported { .. })), "fp32");
}

// ---- the C ABI's host-side checks, called with fake device addresses (never dereferenced:
// every call below returns before any CUDA call) ----

mod abi {
    use std::ffi::c_void;
    use std::ptr::{null, null_mut};

    use capturable_moe::sys;

    pub(super) const OK: i32 = sys::CAPMOE_OK as i32;
    pub(super) const INVALID: i32 = sys::CAPMOE_ERR_INVALID_ARGUMENT as i32;
    pub(super) const MISALIGNED: i32 = sys::CAPMOE_ERR_MISALIGNED as i32;
    pub(super) const UNSUPPORTED: i32 = sys::CAPMOE_ERR_UNSUPPORTED as i32;

    /// One change to a valid descriptor, for a table of refused descriptors.
    type EditDesc = fn(&mut sys::capmoe_fused_fc1_desc_t);

    /// A fake device address, 16-byte aligned for a 16-aligned `offset` (never dereferenced).
    pub(super) fn fake(offset: usize) -> *mut c_void {
        (0x7f00_0000_0000usize + offset) as *mut c_void
    }

    fn desc() -> sys::capmoe_fused_fc1_desc_t {
        sys::capmoe_fused_fc1_desc_t {
            num_experts: 8,
            hidden: 256,
            ffn: 256,
            max_tokens: 64,
            capacity: 128,
            sm_count: 132,
            dtype: sys::CAPMOE_DTYPE_BF16 as i32,
            gather: sys::CAPMOE_FUSED_GATHER_AUTO as i32,
            write_rows: 0,
        }
    }

    /// `capmoe_fused_fc1` with the given descriptor and pointers (act = fake(0x4000), no
    /// prob_of_row: unweighted).
    fn call(d: &sys::capmoe_fused_fc1_desc_t, x: *const c_void, offsets: *const i64, h: *mut c_void) -> i32 {
        call_weighted(d, x, offsets, null(), h)
    }

    fn call_weighted(
        d: &sys::capmoe_fused_fc1_desc_t,
        x: *const c_void,
        offsets: *const i64,
        prob_of_row: *const f32,
        h: *mut c_void,
    ) -> i32 {
        call_with_schedule(d, x, offsets, prob_of_row, h, fake(0x7000) as *mut i32)
    }

    fn call_with_schedule(
        d: &sys::capmoe_fused_fc1_desc_t,
        x: *const c_void,
        offsets: *const i64,
        prob_of_row: *const f32,
        h: *mut c_void,
        schedule: *mut i32,
    ) -> i32 {
        call_with_rows(d, x, offsets, prob_of_row, h, null_mut(), schedule)
    }

    fn call_with_rows(
        d: &sys::capmoe_fused_fc1_desc_t,
        x: *const c_void,
        offsets: *const i64,
        prob_of_row: *const f32,
        h: *mut c_void,
        rows: *mut c_void,
        schedule: *mut i32,
    ) -> i32 {
        let tokens = fake(0x3000) as *const i32;
        unsafe {
            sys::capmoe_fused_fc1(
                d,
                x,
                fake(0x2000),
                offsets,
                tokens,
                prob_of_row,
                fake(0x4000),
                h,
                rows,
                schedule,
                null_mut(),
            )
        }
    }

    #[test]
    fn fused_fc1_c_abi_refuses_bad_descriptors() {
        let offsets = fake(0x1000) as *const i64;
        assert_eq!(
            unsafe {
                sys::capmoe_fused_fc1(
                    null(),
                    fake(0),
                    fake(0),
                    offsets,
                    null(),
                    null(),
                    fake(0),
                    null_mut(),
                    null_mut(),
                    null_mut(),
                    null_mut(),
                )
            },
            INVALID
        );
        let cases: [(&str, EditDesc, i32); 12] = [
            ("E = 0", |d| d.num_experts = 0, INVALID),
            // The gather addresses x's 16-byte chunks in 32 bits: T_max * H / 8 = 2^42.
            ("x past 64 GB", |d| (d.max_tokens, d.hidden) = (1 << 30, 1 << 15), UNSUPPORTED),
            ("E = 1025", |d| d.num_experts = 1025, INVALID),
            ("H = 260 (not a multiple of 8)", |d| d.hidden = 260, MISALIGNED),
            // K-block indices past H would wrap in int32.
            ("H = 2^31 - 120", |d| d.hidden = (1 << 31) - 120, INVALID),
            ("F = 200 (not a multiple of 128)", |d| d.ffn = 200, UNSUPPORTED),
            ("fp32 activations", |d| d.dtype = sys::CAPMOE_DTYPE_F32 as i32, UNSUPPORTED),
            ("gather 7", |d| d.gather = 7, INVALID),
            ("gather 1 (the removed TMA-rows form)", |d| d.gather = 1, UNSUPPORTED),
            ("sm_count 0", |d| d.sm_count = 0, INVALID),
            ("negative capacity", |d| d.capacity = -1, INVALID),
            ("write_rows 2", |d| d.write_rows = 2, INVALID),
        ];
        for (what, edit, want) in cases {
            let mut d = desc();
            edit(&mut d);
            assert_eq!(call(&d, fake(0), offsets, null_mut()), want, "{what}");
            assert_eq!(unsafe { sys::capmoe_fused_fc1_supported(&d) }, want, "{what} (supported)");
        }
    }

    #[test]
    fn fused_fc1_c_abi_checks_pointers_before_any_launch() {
        let d = desc();
        let offsets = fake(0x1000) as *const i64;
        assert_eq!(call(&d, fake(0), null(), null_mut()), INVALID, "NULL offsets");
        assert_eq!(call(&d, fake(0), fake(0x1004) as *const i64, null_mut()), MISALIGNED, "offsets not 8-aligned");
        assert_eq!(call(&d, null(), offsets, null_mut()), INVALID, "NULL x");
        assert_eq!(call(&d, fake(8), offsets, null_mut()), MISALIGNED, "x not 16-aligned");
        assert_eq!(call(&d, fake(0), offsets, fake(0x5008)), MISALIGNED, "h not 16-aligned");
        let prob_of_row = fake(0x6002) as *const f32;
        assert_eq!(
            call_weighted(&d, fake(0), offsets, prob_of_row, null_mut()),
            MISALIGNED,
            "prob_of_row not 4-aligned"
        );
        let no_schedule = call_with_schedule(&d, fake(0), offsets, null(), null_mut(), null_mut());
        assert_eq!(no_schedule, INVALID, "NULL schedule");
        let odd_schedule = call_with_schedule(&d, fake(0), offsets, null(), null_mut(), fake(0x7002) as *mut i32);
        assert_eq!(odd_schedule, MISALIGNED, "schedule not 4-aligned");
        // rows exactly when the descriptor writes them, 16-byte aligned.
        let schedule = fake(0x7000) as *mut i32;
        let rows_given = call_with_rows(&d, fake(0), offsets, null(), null_mut(), fake(0x8000), schedule);
        assert_eq!(rows_given, INVALID, "rows without write_rows");
        let writes = sys::capmoe_fused_fc1_desc_t { write_rows: 1, ..d };
        let no_rows = call_with_rows(&writes, fake(0), offsets, null(), null_mut(), null_mut(), schedule);
        assert_eq!(no_rows, INVALID, "write_rows without rows");
        let odd_rows = call_with_rows(&writes, fake(0), offsets, null(), null_mut(), fake(0x8008), schedule);
        assert_eq!(odd_rows, MISALIGNED, "rows not 16-aligned");
        // Capacity 0: no row can be written; OK without a launch (and without other pointers).
        let empty = sys::capmoe_fused_fc1_desc_t { capacity: 0, ..d };
        assert_eq!(call(&empty, null(), offsets, null_mut()), OK, "capacity 0");
    }
}

// ---- the fused fc2 dgrad + SwiGLU backward's C ABI checks, both forms (drows, and dy rows
// gathered through token_of_row with prob and dprob partials) from one table each where they
// share a rule: fake device addresses as above, never dereferenced ----

mod dgrad_abi {
    use std::ffi::c_void;
    use std::ptr::{null, null_mut};

    use super::abi::{fake, INVALID, MISALIGNED, OK, UNSUPPORTED};
    use capturable_moe::sys;

    /// Not a status: a case the pointer checks must let through (to the device check).
    const PAST_POINTER_CHECKS: i32 = i32::MIN;

    type Desc = sys::capmoe_fused_swiglu_dgrad_desc_t;
    type EditDesc = fn(&mut Desc);
    type EditPtrs = fn(&mut Ptrs);

    /// Which entry point a case calls.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Form {
        /// `capmoe_fused_swiglu_dgrad`.
        Drows,
        /// `capmoe_fused_swiglu_dgrad_gathered`.
        Gathered,
    }

    fn desc() -> Desc {
        Desc {
            num_experts: 8,
            hidden: 256,
            ffn: 256,
            capacity: 128,
            max_tokens: 64,
            sm_count: 132,
            dtype: sys::CAPMOE_DTYPE_BF16 as i32,
        }
    }

    /// The pointers of a call of either form, all valid (aligned fakes) unless edited. `rows`
    /// is drows or dy; the drows form also reads `dact` (optional: NULL here), the gathered
    /// form `token_of_row`, `prob_of_row` and `dprob_partials`.
    struct Ptrs {
        rows: *const c_void,
        w2: *const c_void,
        h: *const c_void,
        offsets: *const i64,
        dh: *mut c_void,
        dact: *mut c_void,
        token_of_row: *const i32,
        prob_of_row: *const f32,
        dprob_partials: *mut f32,
        /// The tile-schedule words (CAPMOE_FUSED_SWIGLU_DGRAD_SCHEDULE_WORDS int32).
        schedule: *mut i32,
    }

    fn ptrs() -> Ptrs {
        Ptrs {
            rows: fake(0x1_0000),
            w2: fake(0x2_0000),
            h: fake(0x3_0000),
            offsets: fake(0x4_0000) as *const i64,
            dh: fake(0x5_0000),
            dact: null_mut(),
            token_of_row: fake(0x6_0000) as *const i32,
            prob_of_row: fake(0x7_0000) as *const f32,
            dprob_partials: fake(0x8_0000) as *mut f32,
            schedule: fake(0x9_0000) as *mut i32,
        }
    }

    /// Only the offsets: what a capacity-0 call needs.
    fn bare() -> Ptrs {
        Ptrs {
            rows: null(),
            w2: null(),
            h: null(),
            dh: null_mut(),
            dact: null_mut(),
            token_of_row: null(),
            prob_of_row: null(),
            dprob_partials: null_mut(),
            schedule: null_mut(),
            ..ptrs()
        }
    }

    fn call(form: Form, d: *const Desc, p: &Ptrs) -> i32 {
        unsafe {
            match form {
                Form::Drows => sys::capmoe_fused_swiglu_dgrad(
                    d,
                    p.rows,
                    p.w2,
                    p.h,
                    p.offsets,
                    p.dh,
                    p.dact,
                    p.schedule,
                    null_mut(),
                ),
                Form::Gathered => sys::capmoe_fused_swiglu_dgrad_gathered(
                    d,
                    p.rows,
                    p.w2,
                    p.h,
                    p.offsets,
                    p.token_of_row,
                    p.prob_of_row,
                    p.dh,
                    p.dprob_partials,
                    p.schedule,
                    null_mut(),
                ),
            }
        }
    }

    /// The descriptor rules of both forms, and of `capmoe_fused_swiglu_dgrad_supported`.
    const SHARED_DESC_CASES: [(&str, EditDesc, i32); 11] = [
        ("E = 0", |d| d.num_experts = 0, INVALID),
        ("E = 1025", |d| d.num_experts = 1025, INVALID),
        ("H = 0", |d| d.hidden = 0, INVALID),
        ("H = 260 (not a multiple of 8)", |d| d.hidden = 260, MISALIGNED),
        ("H = 2^31 - 120", |d| d.hidden = (1 << 31) - 120, INVALID),
        ("F = 200 (not a multiple of 128)", |d| d.ffn = 200, UNSUPPORTED),
        ("F = 192 (a multiple of 64, not of 128)", |d| d.ffn = 192, UNSUPPORTED),
        ("fp32 activations", |d| d.dtype = sys::CAPMOE_DTYPE_F32 as i32, UNSUPPORTED),
        ("sm_count 0", |d| d.sm_count = 0, INVALID),
        ("negative capacity", |d| d.capacity = -1, INVALID),
        ("capacity 2^31", |d| d.capacity = 1 << 31, INVALID),
    ];

    /// A NULL descriptor, then [`SHARED_DESC_CASES`] (each through `supported` too) and the
    /// form's own `cases`, all refused by `form`'s entry.
    fn assert_refuses_descriptors(form: Form, cases: &[(&str, EditDesc, i32)]) {
        assert_eq!(call(form, null(), &ptrs()), INVALID, "{form:?}: NULL descriptor");
        assert_eq!(unsafe { sys::capmoe_fused_swiglu_dgrad_supported(null()) }, INVALID, "NULL descriptor (supported)");
        for (i, &(what, edit, want)) in SHARED_DESC_CASES.iter().chain(cases).enumerate() {
            let mut d = desc();
            edit(&mut d);
            assert_eq!(call(form, &d, &ptrs()), want, "{form:?}: {what}");
            if i < SHARED_DESC_CASES.len() {
                assert_eq!(unsafe { sys::capmoe_fused_swiglu_dgrad_supported(&d) }, want, "{what} (supported)");
            }
        }
    }

    /// The pointer rules of both forms (`rows` is drows or dy).
    const SHARED_POINTER_CASES: [(&str, EditPtrs, i32); 13] = [
        ("NULL offsets", |p| p.offsets = null(), INVALID),
        ("offsets not 8-aligned", |p| p.offsets = fake(0x4_0004) as *const i64, MISALIGNED),
        ("NULL drows / dy", |p| p.rows = null(), INVALID),
        ("NULL w2", |p| p.w2 = null(), INVALID),
        ("NULL h", |p| p.h = null(), INVALID),
        ("NULL dh", |p| p.dh = null_mut(), INVALID),
        ("drows / dy not 16-aligned", |p| p.rows = fake(0x1_0008), MISALIGNED),
        ("w2 not 16-aligned", |p| p.w2 = fake(0x2_0002), MISALIGNED),
        ("h not 16-aligned", |p| p.h = fake(0x3_0004), MISALIGNED),
        ("dh not 16-aligned", |p| p.dh = fake(0x5_0008), MISALIGNED),
        ("NULL schedule", |p| p.schedule = null_mut(), INVALID),
        ("schedule not 4-aligned", |p| p.schedule = fake(0x9_0002) as *mut i32, MISALIGNED),
        ("all valid", |_| {}, PAST_POINTER_CHECKS),
    ];

    /// [`SHARED_POINTER_CASES`] and the form's own `cases` through `form`'s entry, then the
    /// capacity-0 shortcut: OK without a launch (and without other pointers, without a
    /// device), but the offsets are still checked.
    fn assert_checks_pointers(form: Form, cases: &[(&str, EditPtrs, i32)]) {
        let d = desc();
        // Past the pointer checks the entry asks for the device. Without a GPU the answer is
        // UNSUPPORTED or a CUDA error, never a pointer refusal; with one, the call would launch
        // on fake addresses, so those cases are only made where no GPU opens.
        let no_gpu = capturable_moe::device::open(0).is_err();
        for &(what, edit, want) in SHARED_POINTER_CASES.iter().chain(cases) {
            let mut p = ptrs();
            edit(&mut p);
            if want != PAST_POINTER_CHECKS {
                assert_eq!(call(form, &d, &p), want, "{form:?}: {what}");
            } else if no_gpu {
                let got = call(form, &d, &p);
                assert!(got != OK && got != INVALID && got != MISALIGNED, "{form:?}: {what}: {got}");
            }
        }
        let empty = Desc { capacity: 0, ..d };
        assert_eq!(call(form, &empty, &bare()), OK, "{form:?}: capacity 0");
        let no_offsets = Ptrs { offsets: null(), ..bare() };
        assert_eq!(call(form, &empty, &no_offsets), INVALID, "{form:?}: capacity 0, NULL offsets");
    }

    #[test]
    fn fused_swiglu_dgrad_c_abi_refuses_bad_descriptors() {
        assert_refuses_descriptors(Form::Drows, &[]);
    }

    #[test]
    fn fused_swiglu_dgrad_c_abi_checks_pointers_before_any_launch() {
        assert_checks_pointers(Form::Drows, &[("dact not 16-aligned", |p| p.dact = fake(0x6_0008), MISALIGNED)]);
    }

    #[test]
    fn fused_swiglu_dgrad_gathered_c_abi_refuses_bad_descriptors() {
        assert_refuses_descriptors(
            Form::Gathered,
            &[
                ("negative max_tokens", |d| d.max_tokens = -1, INVALID),
                ("max_tokens 2^31", |d| d.max_tokens = 1 << 31, INVALID),
                (
                    "dy past 64 GB (T_max * H / 8 = 2^42)",
                    |d| (d.max_tokens, d.hidden) = (1 << 30, 1 << 15),
                    UNSUPPORTED,
                ),
            ],
        );
        let d = Desc { max_tokens: 1 << 30, hidden: 1 << 15, ..desc() };
        assert_eq!(unsafe { sys::capmoe_fused_swiglu_dgrad_supported(&d) }, UNSUPPORTED, "dy past 64 GB (supported)");
        // max_tokens is the gathered launch's alone: the drows form and `supported` ignore it.
        let d = Desc { max_tokens: -1, capacity: 0, ..desc() };
        assert_eq!(call(Form::Drows, &d, &ptrs()), OK, "drows form, capacity 0, max_tokens -1");
        // max_tokens is checked before the capacity-0 shortcut.
        assert_eq!(call(Form::Gathered, &d, &ptrs()), INVALID, "gathered, capacity 0, max_tokens -1");
    }

    #[test]
    fn fused_swiglu_dgrad_gathered_c_abi_checks_pointers_before_any_launch() {
        assert_checks_pointers(
            Form::Gathered,
            &[
                ("NULL token_of_row", |p| p.token_of_row = null(), INVALID),
                ("NULL prob_of_row", |p| p.prob_of_row = null(), INVALID),
                ("NULL dprob_partials", |p| p.dprob_partials = null_mut(), INVALID),
                ("token_of_row not 4-aligned", |p| p.token_of_row = fake(0x6_0002) as *const i32, MISALIGNED),
                ("prob_of_row not 4-aligned", |p| p.prob_of_row = fake(0x7_0001) as *const f32, MISALIGNED),
                ("dprob_partials not 4-aligned", |p| p.dprob_partials = fake(0x8_0002) as *mut f32, MISALIGNED),
                // 4-byte alignment is enough for the fp32 and int32 buffers (the checks above
                // are not 16-byte checks in disguise): these get past the pointer checks.
                (
                    "token_of_row, prob_of_row, dprob_partials only 4-aligned",
                    |p| {
                        p.token_of_row = fake(0x6_0004) as *const i32;
                        p.prob_of_row = fake(0x7_0004) as *const f32;
                        p.dprob_partials = fake(0x8_0004) as *mut f32;
                    },
                    PAST_POINTER_CHECKS,
                ),
            ],
        );
    }
}

/// The cp.async producer's hand-swizzled chunk offsets (csrc/fused/fc1_layout.h, the fused fc1's
/// default gather form) against cute's addressing of the layout its wgmma descriptors come
/// from: compiles and runs tests/layout/fc1_smem_layout.cu on the host.
#[test]
fn fused_fc1_smem_layout_matches_cute() {
    common::layout::run_check("fc1_smem_layout.cu");
}

/// The sm_100a fused fc1 (csrc/fused/fc1_sm100.cu, compiled only): its producers' offsets
/// (fc1_smem_offset for the gathered A rows, row * 128 B for the W1 boxes) against cute's
/// addressing of the UMMA stage layouts, and the accumulator's TMEM layout (lane = tile row,
/// column = gate | up column) the epilogue's tcgen05.ld addresses assume: compiles and runs
/// tests/layout/fc1_sm100_layout.cu on the host (no Blackwell GPU needed).
#[test]
fn fused_fc1_sm100_layouts_match_cute() {
    common::layout::run_check("fc1_sm100_layout.cu");
}

/// The sm_100a fused fc2 dgrad (csrc/fused/swiglu_dgrad_sm100.cu, compiled only): where its
/// producers put A (fc1_smem_offset: the drows TMA box and the cp.async gather) and the MN-major
/// W2 boxes (64 columns x 64 K rows, 128B swizzle, box c at c * 8 KB of a stage) against cute's
/// addressing of the UMMA stage layouts, and the accumulator's TMEM layout (lane = tile row,
/// column = tile column): compiles and runs tests/layout/dgrad_sm100_layout.cu on the host.
#[test]
fn fused_dgrad_sm100_layouts_match_cute() {
    common::layout::run_check("dgrad_sm100_layout.cu");
}

/// The gathered fc2 dgrad's dprob row sums (csrc/fused/swiglu_dgrad_sm90.cu) assume each row's
/// 128 columns lie in one quad of lanes, half of each lane's pairs per row, in ascending order:
/// tests/layout/dgrad_quad_rows.cu walks every consumer thread's accumulators through cute on
/// the host (the kernel traps on the same property at run time).
#[test]
fn fused_dgrad_quad_rows_match_cute() {
    common::layout::run_check("dgrad_quad_rows.cu");
}
