//! Host-only checks of the fused kernels' plan-time shape rules (no GPU needed): the shapes the
//! fused fc1 refuses are the ones whose callers must take the unfused path.

use capturable_moe::dtype::DType;
use capturable_moe::fused::{FusedFc1, FC1_TILE_N};
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

#[test]
fn fused_fc1_refuses_fp32_activations() {
    let c = RoutingConfig { dtype: DType::F32, ..config(768) };
    assert!(matches!(FusedFc1::check_shapes(&c), Err(Error::Unsupported { .. })));
}
