//! Host-only: plan-time validation of grouped GEMM specs and the offset arithmetic.

use capturable_moe::device::{Arch, DeviceInfo};
use capturable_moe::dtype::DType;
use capturable_moe::grouped_gemm::{row_offsets, GemmConfig, GemmOp, GroupedGemm, GroupedGemmSpec, WeightLayout};
use capturable_moe::Error;

fn spec(op: GemmOp) -> GroupedGemmSpec {
    GroupedGemmSpec::new(op, 8, 4096, 1024, 8192)
}

#[test]
fn valid_specs_pass() {
    for op in [GemmOp::Fprop, GemmOp::Dgrad, GemmOp::Wgrad] {
        spec(op).validate().unwrap();
        spec(op).with_dtype(DType::F16).validate().unwrap();
    }
    let mut s = spec(GemmOp::Wgrad);
    s.out_dtype = DType::F32;
    s.accumulate = true;
    s.validate().unwrap();
}

#[test]
fn tma_alignment_is_enforced() {
    let mut s = spec(GemmOp::Fprop);
    s.k = 1000 + 4;
    assert!(matches!(s.validate(), Err(Error::Alignment { what: "k", multiple: 8, .. })));
    let mut s = spec(GemmOp::Dgrad);
    s.n = 4095;
    let err = s.validate().unwrap_err();
    assert!(matches!(err, Error::Alignment { what: "n", .. }));
    assert!(err.to_string().contains("multiple of 8"), "{err}");
}

#[test]
fn bad_shapes_and_types_are_typed_errors() {
    let mut s = spec(GemmOp::Fprop);
    s.num_experts = 0;
    assert!(matches!(s.validate(), Err(Error::InvalidArgument { .. })));
    let mut s = spec(GemmOp::Fprop);
    s.num_experts = 70_000;
    assert!(matches!(s.validate(), Err(Error::InvalidArgument { .. })));
    let mut s = spec(GemmOp::Fprop);
    s.capacity = i32::MAX as usize;
    assert!(matches!(s.validate(), Err(Error::InvalidArgument { .. })));
    let s = spec(GemmOp::Fprop).with_dtype(DType::F32);
    assert!(matches!(s.validate(), Err(Error::Unsupported { .. })));
    let mut s = spec(GemmOp::Fprop);
    s.out_dtype = DType::F32;
    assert!(matches!(s.validate(), Err(Error::Unsupported { .. })), "fp32 output is wgrad-only");
    let mut s = spec(GemmOp::Wgrad);
    s.accumulate = true; // bf16 output cannot accumulate
    assert!(matches!(s.validate(), Err(Error::Unsupported { .. })));
    let mut s = spec(GemmOp::Fprop);
    s.split_dtype = DType::Bf16;
    assert!(matches!(s.validate(), Err(Error::InvalidArgument { .. })));
    // Byte sizes past i64 (E * N * K = 16 * 2^30 * 2^30 elements would wrap a usize product).
    let mut s = spec(GemmOp::Fprop);
    (s.num_experts, s.n, s.k, s.capacity) = (16, 1 << 30, 1 << 30, 1);
    let err = s.validate().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("64-bit"), "{err}");
    let mut s = spec(GemmOp::Wgrad);
    (s.n, s.k, s.capacity) = (i32::MAX as usize & !7, 8, i32::MAX as usize - 1);
    assert!(matches!(s.validate(), Err(Error::InvalidArgument { .. })), "capacity * N rows too large");
}

#[test]
fn arch_specific_config_must_match_the_device() {
    let hopper = DeviceInfo { ordinal: 0, name: "test".into(), arch: Arch::Sm90, sm_count: 132 };
    let mut s = spec(GemmOp::Fprop);
    s.config = GemmConfig::Sm100TwoSm;
    assert!(matches!(GroupedGemm::for_device(s, &hopper), Err(Error::UnsupportedArch { .. })));
}

#[test]
fn auto_config_heuristic_uses_host_facts_only() {
    let hopper = DeviceInfo { ordinal: 0, name: "test".into(), arch: Arch::Sm90, sm_count: 132 };
    let blackwell = DeviceInfo { arch: Arch::Sm100, sm_count: 148, ..hopper.clone() };
    let decode = GroupedGemmSpec::new(GemmOp::Fprop, 64, 2816, 2048, 1024); // 16 rows per expert
    let prefill = GroupedGemmSpec::new(GemmOp::Fprop, 8, 28672, 4096, 8192);
    let wgrad = GroupedGemmSpec::new(GemmOp::Wgrad, 64, 2816, 2048, 1024);
    if Arch::Sm90.is_built() {
        let auto = |s: &GroupedGemmSpec| GroupedGemm::for_device(s.clone(), &hopper).unwrap().config();
        // The counter kernel at decode and where the output is at least a third as wide as the
        // reduction (the sweeps of 2026-11-29), bf16 and fp16 alike; CUTLASS's kernels elsewhere.
        assert_eq!(auto(&decode), GemmConfig::Sm90Counter);
        assert_eq!(auto(&prefill), GemmConfig::Sm90Counter); // mixtral fc1: N 28672 >= K 4096
                                                             // wgrad into a 16-bit dW: the counter kernel; an fp32 dW (main-grad accumulate), a
                                                             // pointer array of dW or more than 1024 experts: the clustered cooperative.
        assert_eq!(auto(&wgrad), GemmConfig::Sm90Counter);
        let wgrad_f32 = GroupedGemmSpec { out_dtype: DType::F32, accumulate: true, ..wgrad.clone() };
        assert_eq!(auto(&wgrad_f32), GemmConfig::Sm90Cooperative);
        let wgrad_pointers = GroupedGemmSpec { weights_as_pointers: true, ..wgrad.clone() };
        assert_eq!(auto(&wgrad_pointers), GemmConfig::Sm90Cooperative);
        let wgrad_many = GroupedGemmSpec::new(GemmOp::Wgrad, 2048, 2048, 768, 2048 * 256);
        assert_eq!(auto(&wgrad_many), GemmConfig::Sm90Cooperative);
        let dsv3_fc1 = GroupedGemmSpec::new(GemmOp::Fprop, 32, 4096, 7168, 8192);
        let dsv3_fc1_dgrad = GroupedGemmSpec { op: GemmOp::Dgrad, ..dsv3_fc1.clone() };
        let qwen3_fc2 = GroupedGemmSpec::new(GemmOp::Fprop, 128, 2048, 768, 32768);
        let qwen3_fc2_f16 = GroupedGemmSpec { dtype: DType::F16, out_dtype: DType::F16, ..qwen3_fc2.clone() };
        let qwen3_fc2_dgrad = GroupedGemmSpec { op: GemmOp::Dgrad, ..qwen3_fc2.clone() };
        assert_eq!(auto(&dsv3_fc1), GemmConfig::Sm90Counter); // 3 x 4096 >= 7168
        assert_eq!(auto(&dsv3_fc1_dgrad), GemmConfig::Sm90Counter); // output 7168 >= 4096
        assert_eq!(auto(&qwen3_fc2), GemmConfig::Sm90Counter);
        assert_eq!(auto(&qwen3_fc2_f16), GemmConfig::Sm90Counter);
        // qwen3moe's fc2 dgrad: 3 x 768 >= 2048.
        assert_eq!(auto(&qwen3_fc2_dgrad), GemmConfig::Sm90Counter);
        // Output 2048 under a third of the reduction 7168 (dsv3's fc2 dgrad), which is > 1024:
        // the cooperative kernel.
        let dsv3_fc2_dgrad = GroupedGemmSpec::new(GemmOp::Dgrad, 32, 7168, 2048, 8192);
        assert_eq!(auto(&dsv3_fc2_dgrad), GemmConfig::Sm90CooperativeNoCluster);
        // An output under a third of a short reduction (dgrad: N = 1024 -> K = 256): the pingpong.
        let short_dgrad = GroupedGemmSpec::new(GemmOp::Dgrad, 128, 1024, 256, 32768);
        assert_eq!(auto(&short_dgrad), GemmConfig::Sm90PingpongWide);
        // Where the counter kernel does not go, the next candidate: a pointer array of
        // weights, more than 1024 experts.
        let decode_pointers = GroupedGemmSpec { weights_as_pointers: true, ..decode.clone() };
        assert_eq!(auto(&decode_pointers), GemmConfig::Sm90PingpongWide);
        let many = GroupedGemmSpec::new(GemmOp::Fprop, 2048, 2048, 768, 2048 * 256);
        assert_eq!(auto(&many), GemmConfig::Sm90PingpongWide);
        let plan = GroupedGemm::for_device(prefill.clone(), &hopper).unwrap();
        assert!(plan.workspace_bytes() > 0);
    }
    if Arch::Sm100.is_built() {
        assert_eq!(GroupedGemm::for_device(decode, &blackwell).unwrap().config(), GemmConfig::Sm100OneSm);
        assert_eq!(GroupedGemm::for_device(prefill, &blackwell).unwrap().config(), GemmConfig::Sm100TwoSm);
        assert_eq!(GroupedGemm::for_device(wgrad, &blackwell).unwrap().config(), GemmConfig::Sm100OneSm);
    }
}

#[test]
fn offsets_are_clamped_prefix_sums() {
    assert_eq!(row_offsets(&[3, 0, 5, 2], 100), vec![0, 3, 3, 8, 10]);
    // Over capacity: expert 2 is cut at 9, expert 3 starts (and ends) at capacity.
    assert_eq!(row_offsets(&[4, 3, 5, 2], 9), vec![0, 4, 7, 9, 9]);
    // Negative counts are empty.
    assert_eq!(row_offsets(&[4, -7, 5], 100), vec![0, 4, 4, 9]);
    // Huge counts never overflow the running sum.
    assert_eq!(row_offsets(&[i64::MAX, i64::MAX], 10), vec![0, 10, 10]);
    assert_eq!(row_offsets(&[], 10), vec![0]);
}

#[test]
fn operand_lengths_follow_the_layout_contract() {
    let s = GroupedGemmSpec::new(GemmOp::Fprop, 4, 16, 8, 100);
    assert_eq!(s.operand_lens(), (100 * 8, 4 * 16 * 8, 100 * 16));
    let s = GroupedGemmSpec { op: GemmOp::Dgrad, ..s };
    assert_eq!(s.operand_lens(), (100 * 16, 4 * 16 * 8, 100 * 8));
    let s = GroupedGemmSpec { op: GemmOp::Wgrad, ..s };
    assert_eq!(s.operand_lens(), (100 * 16, 100 * 8, 4 * 16 * 8));
}

#[test]
fn config_names_round_trip() {
    for config in GemmConfig::ALL {
        assert_eq!(GemmConfig::from_name(config.name()), Some(config), "{config:?}");
    }
    assert_eq!(GemmConfig::from_name("sm90-nonsense"), None);
}

/// The dtypes each candidate tile is built for (GemmConfig's docs): the cluster-free 128x256
/// cooperative and the 64x256 pingpong for bf16 and fp16 fprop / dgrad, neither for wgrad; the
/// counter kernels for both dtypes of every op; the clustered cooperative for wgrad only (its
/// fprop / dgrad kernels were deleted: won no case).
#[test]
fn candidate_sm90_configs_have_the_documented_dtypes() {
    let hopper = DeviceInfo { ordinal: 0, name: "test".into(), arch: Arch::Sm90, sm_count: 132 };
    if !Arch::Sm90.is_built() {
        println!("skipping: no sm_90a kernels in this build");
        return;
    }
    // (config, built for fp16, built for wgrad)
    let candidates = [
        (GemmConfig::Sm90CooperativeNoCluster, true, false),
        (GemmConfig::Sm90PingpongWide, true, false),
        (GemmConfig::Sm90Counter, true, true),
    ];
    for op in [GemmOp::Fprop, GemmOp::Dgrad, GemmOp::Wgrad] {
        for (config, has_f16, has_wgrad) in candidates {
            let mut s = spec(op);
            s.config = config;
            let bf16 = GroupedGemm::for_device(s.clone(), &hopper);
            if op == GemmOp::Wgrad && !has_wgrad {
                assert!(matches!(bf16, Err(Error::Unsupported { .. })), "{op:?} {config:?} bf16");
                continue;
            }
            assert_eq!(bf16.unwrap().config(), config);
            let f16 = GroupedGemmSpec { config, ..s.with_dtype(DType::F16) };
            let planned = GroupedGemm::for_device(f16, &hopper);
            if has_f16 {
                assert_eq!(planned.unwrap().config(), config, "{op:?} {config:?} fp16");
            } else {
                assert!(matches!(planned, Err(Error::Unsupported { .. })), "{op:?} {config:?} fp16");
            }
        }
        let clustered = GroupedGemmSpec { config: GemmConfig::Sm90Cooperative, ..spec(op) };
        let planned = GroupedGemm::for_device(clustered, &hopper);
        if op == GemmOp::Wgrad {
            assert_eq!(planned.unwrap().config(), GemmConfig::Sm90Cooperative, "wgrad, clustered");
        } else {
            assert!(matches!(planned, Err(Error::Unsupported { .. })), "{op:?}, clustered: {planned:?}");
        }
    }
}

/// The hand-written counter kernels are offered only for what they handle
/// (grouped_gemm/counter.h): a pointer array of weights (or dW), more than 1024 experts, an fp32
/// output or wgrad's accumulate is a typed error when the plan is made, never a launch.
#[test]
fn counter_config_is_refused_at_plan_time_where_its_kernel_does_not_go() {
    let hopper = DeviceInfo { ordinal: 0, name: "test".into(), arch: Arch::Sm90, sm_count: 132 };
    if !Arch::Sm90.is_built() {
        println!("skipping: no sm_90a kernels in this build");
        return;
    }
    let counter = |s: GroupedGemmSpec| GroupedGemmSpec { config: GemmConfig::Sm90Counter, ..s };
    for op in [GemmOp::Fprop, GemmOp::Dgrad, GemmOp::Wgrad] {
        for layout in [WeightLayout::Enk, WeightLayout::Ekn] {
            let s = GroupedGemmSpec { weight_layout: layout, ..counter(spec(op)) };
            assert_eq!(GroupedGemm::for_device(s, &hopper).unwrap().config(), GemmConfig::Sm90Counter);
        }
        let max = counter(GroupedGemmSpec::new(op, 1024, 256, 256, 4096));
        assert_eq!(GroupedGemm::for_device(max.clone(), &hopper).unwrap().config(), GemmConfig::Sm90Counter);
        let refused = [
            ("pointer array", GroupedGemmSpec { weights_as_pointers: true, ..counter(spec(op)) }),
            ("1025 experts", GroupedGemmSpec { num_experts: 1025, ..max }),
        ];
        for (what, s) in refused {
            let planned = GroupedGemm::for_device(s, &hopper);
            assert!(matches!(planned, Err(Error::Unsupported { .. })), "{op:?} {what}: {planned:?}");
        }
    }
    let wgrad = counter(spec(GemmOp::Wgrad));
    let f32_out = GroupedGemmSpec { out_dtype: DType::F32, ..wgrad.clone() };
    let f32_accumulate = GroupedGemmSpec { accumulate: true, ..f32_out.clone() };
    for (what, s) in [("fp32 dW", f32_out), ("fp32 accumulate", f32_accumulate)] {
        let planned = GroupedGemm::for_device(s, &hopper);
        assert!(matches!(planned, Err(Error::Unsupported { .. })), "wgrad {what}: {planned:?}");
    }
}

/// Every configuration survives the trip through its C ABI code; a code the crate does not
/// know is `None` (it used to become `Auto`, hiding a library / binding mismatch).
#[test]
fn gemm_config_abi_codes_round_trip_and_unknown_codes_are_none_host() {
    for config in GemmConfig::ALL {
        assert_eq!(GemmConfig::from_abi_code(config.abi_code()), Some(config), "{config:?}");
    }
    let known: Vec<_> = GemmConfig::ALL.iter().map(|c| c.abi_code()).collect();
    // 2, 6, 7: deleted configs.
    for code in [-1, 2, 6, 7, 10, 99, 1000, i32::MAX, i32::MIN] {
        if !known.contains(&code) {
            assert_eq!(GemmConfig::from_abi_code(code), None, "code {code}");
        }
    }
}

/// `desc()` says what the plan was built for: the spec as given (`Auto` kept), the resolved
/// kernel, the device facts and the workspace size.
#[test]
fn grouped_gemm_desc_says_what_the_plan_was_built_for_host() {
    if !Arch::Sm90.is_built() {
        println!("skipping: no sm_90a kernels in this build");
        return;
    }
    let hopper = DeviceInfo { ordinal: 0, name: "test".into(), arch: Arch::Sm90, sm_count: 132 };
    let s = spec(GemmOp::Wgrad);
    let plan = GroupedGemm::for_device(s.clone(), &hopper).unwrap();
    let desc = plan.desc();
    assert_eq!(desc.spec, s);
    assert_eq!(desc.spec.config, GemmConfig::Auto);
    assert_eq!(desc.config, plan.config());
    assert_ne!(desc.config, GemmConfig::Auto);
    assert_eq!((desc.arch, desc.sm_count), (Arch::Sm90, 132));
    assert_eq!(desc.workspace_bytes, plan.workspace_bytes());
    assert!(desc.workspace_bytes > 0);
}
