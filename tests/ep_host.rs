//! Host-only: `EpConfig::validate` / `EpKernels::new` reject every bad field with a typed error
//! that names the field, accept the limits, and agree with the C ABI's own check
//! (`capmoe_ep_check_desc`) on every case; the derived sizes.

use capturable_moe::dtype::DType;
use capturable_moe::ep::{EpConfig, EpKernels, MAX_RANKS, MAX_TOPK};
use capturable_moe::{sys, Error};

fn valid() -> EpConfig {
    EpConfig {
        ranks: 4,
        rank: 3,
        num_experts: 16,
        spare_per_rank: 2,
        hidden: 64,
        topk: 4,
        max_tokens: 128,
        capacity: 96,
        dtype: DType::Bf16,
    }
}

fn with(change: impl FnOnce(&mut EpConfig)) -> EpConfig {
    let mut c = valid();
    change(&mut c);
    c
}

/// What the C ABI says of the configuration (the descriptor `EpKernels::new` passes).
fn c_status(c: &EpConfig) -> u32 {
    (unsafe { sys::capmoe_ep_check_desc(&c.abi_desc()) }) as u32
}

#[test]
fn every_bad_field_is_a_typed_error_naming_it_host() {
    let big = 1usize << 31;
    let cases: Vec<(&str, EpConfig)> = vec![
        ("ranks", with(|c| c.ranks = 0)),
        ("ranks", with(|c| (c.ranks, c.num_experts) = (MAX_RANKS + 1, MAX_RANKS + 1))),
        ("rank", with(|c| c.rank = 4)),
        ("num_experts", with(|c| c.num_experts = 0)),
        ("num_experts", with(|c| c.num_experts = 18)),
        ("spare_per_rank", with(|c| c.spare_per_rank = big / 4)),
        ("hidden", with(|c| c.hidden = 0)),
        ("hidden", with(|c| c.hidden = 8 * big)),
        ("topk", with(|c| c.topk = 0)),
        ("topk", with(|c| c.topk = MAX_TOPK + 1)),
        ("max_tokens", with(|c| c.max_tokens = big / 4)),
        ("capacity", with(|c| c.capacity = big / 4)),
        // (2^30 + 1) * (2^34 - 8) elements wrap usize: the activation bytes must fit in int64.
        (
            "hidden",
            with(|c| {
                (c.ranks, c.rank, c.num_experts, c.spare_per_rank, c.topk) = (1, 0, 1, 0, 1);
                (c.hidden, c.max_tokens, c.capacity) = ((1 << 34) - 8, (1 << 30) + 1, 1);
            }),
        ),
    ];
    for (field, cfg) in cases {
        let err = cfg.validate().expect_err(field);
        match &err {
            Error::InvalidArgument { op, why } => {
                assert_eq!(*op, "EpConfig::validate");
                assert!(why.contains(field), "{field}: the message names the field: {why}");
            }
            other => panic!("{field}: expected InvalidArgument, got {other:?}"),
        }
        assert!(matches!(EpKernels::new(cfg.clone()), Err(Error::InvalidArgument { .. })), "{field}: new");
        assert_eq!(c_status(&cfg), sys::CAPMOE_ERR_INVALID_ARGUMENT, "{field}: the C check agrees ({cfg:?})");
    }
    let cfg = with(|c| c.hidden = 20);
    match cfg.validate() {
        Err(Error::Alignment { what: "hidden", value: 20, multiple: 8, .. }) => {}
        other => panic!("hidden 20: {other:?}"),
    }
    assert_eq!(c_status(&cfg), sys::CAPMOE_ERR_MISALIGNED);
    for dtype in [DType::F32, DType::I32, DType::I64] {
        let cfg = with(|c| c.dtype = dtype);
        match cfg.validate() {
            Err(Error::Unsupported { why, .. }) => assert!(why.contains("dtype"), "{why}"),
            other => panic!("{dtype:?}: {other:?}"),
        }
        assert_eq!(c_status(&cfg), sys::CAPMOE_ERR_UNSUPPORTED);
    }
}

#[test]
fn limits_are_accepted_and_sizes_derived_host() {
    let accepted = [
        valid(),
        with(|c| c.dtype = DType::F16),
        with(|c| (c.ranks, c.rank, c.num_experts) = (1, 0, 1)),
        with(|c| (c.ranks, c.rank, c.num_experts) = (MAX_RANKS, MAX_RANKS - 1, MAX_RANKS)),
        with(|c| c.spare_per_rank = 0),
        with(|c| (c.max_tokens, c.capacity) = (0, 0)),
        with(|c| c.topk = MAX_TOPK),
        with(|c| (c.topk, c.max_tokens) = (1, i32::MAX as usize)),
        with(|c| (c.ranks, c.rank, c.num_experts, c.capacity) = (1, 0, 1, i32::MAX as usize)),
        // E + R * S_per = 2^31 - 1 columns exactly.
        with(|c| (c.ranks, c.rank, c.num_experts, c.spare_per_rank) = (1, 0, 1, i32::MAX as usize - 1)),
        with(|c| c.hidden = 8),
    ];
    for cfg in accepted {
        cfg.validate().unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        assert_eq!(c_status(&cfg), sys::CAPMOE_OK, "{cfg:?}");
        let plan = EpKernels::new(cfg.clone()).unwrap();
        assert_eq!(plan.desc(), &cfg);
    }
    let c = valid();
    assert_eq!((c.local_experts(), c.cols_per_rank(), c.block_rows()), (4, 6, 384));
    assert_eq!((c.routes_len(), c.tokens_len(), c.rows_len(), c.global_slots()), (512, 128 * 64, 384 * 64, 8));
    let plan = EpKernels::new(c).unwrap();
    assert_eq!(plan.abi_desc().capacity, 96);
}

/// A 256-byte aligned address that is never dereferenced (the calls fail before any launch).
fn fake<T>(offset: usize) -> *mut T {
    (0x7f00_0000_0000usize + offset) as *mut T
}

/// The linked (nvcc-built) entry points return their documented status before touching the
/// GPU for arguments the Rust wrappers never pass; `ep_emulated` covers every check in depth.
#[test]
fn c_entry_points_reject_before_launching_host() {
    let plan = EpKernels::new(valid()).unwrap();
    let d = plan.abi_desc();
    let no_echo = EpKernels::new(with(|c| c.spare_per_rank = 0)).unwrap();
    let stream = std::ptr::null_mut::<std::ffi::c_void>();
    let (invalid, misaligned) = (sys::CAPMOE_ERR_INVALID_ARGUMENT as i32, sys::CAPMOE_ERR_MISALIGNED as i32);
    unsafe {
        // Host T past T_max; NULL counts; misaligned counts.
        let ids = fake::<i32>(0);
        assert_eq!(sys::capmoe_ep_count_routes(d, ids, 129, std::ptr::null(), fake(0), fake(0), stream), invalid);
        assert_eq!(
            sys::capmoe_ep_count_routes(d, ids, 1, std::ptr::null(), std::ptr::null_mut(), fake(0), stream),
            invalid
        );
        assert_eq!(sys::capmoe_ep_count_routes(d, ids, 1, std::ptr::null(), fake(4), fake(0), stream), misaligned);
        // dispatch_layout: flags may not be NULL.
        let (i, f) = (fake::<i32>(0), fake::<f32>(0));
        let status = sys::capmoe_ep_dispatch_layout(
            d,
            i,
            f,
            1,
            std::ptr::null(),
            i,
            i,
            f,
            i,
            i,
            i,
            std::ptr::null_mut(),
            stream,
        );
        assert_eq!(status, invalid);
        // Rows 16-byte aligned.
        assert_eq!(sys::capmoe_ep_gather_rows(d, fake(8), i, 1, std::ptr::null(), fake(0), stream), misaligned);
        assert_eq!(sys::capmoe_ep_reduce_rows(d, fake(0), i, 1, std::ptr::null(), fake(8), stream), misaligned);
        assert_eq!(sys::capmoe_ep_gather_route_values(d, f, i, 1, std::ptr::null(), f.byte_add(2), stream), misaligned);
        // Echo weights: S_per >= 1, bytes a multiple of 16.
        let slots = fake::<i64>(0);
        let (w, flags) = (fake::<std::ffi::c_void>(0), fake::<i32>(0));
        assert_eq!(sys::capmoe_ep_pack_spare_weights(no_echo.abi_desc(), slots, w, 16, w, flags, stream), invalid);
        assert_eq!(sys::capmoe_ep_pack_spare_weights(d, slots, w, 24, w, flags, stream), misaligned);
        assert_eq!(sys::capmoe_ep_select_spare_weights(d, slots, w, 16, w, std::ptr::null_mut(), stream), invalid);
        assert_eq!(sys::capmoe_ep_fold_spare_grads(d, slots, f, -4, f, flags, stream), invalid);
        assert_eq!(sys::capmoe_ep_fold_spare_grads(d, slots, f, 4, f.byte_add(4), flags, stream), misaligned);
    }
}
