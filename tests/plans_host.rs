//! Host-only: each plan's `desc()` says what it was built for (the configuration as given and
//! what the plan resolved from it).

use capturable_moe::dtype::DType;
use capturable_moe::echo::{Algorithm, EchoConfig, EchoPlan};
use capturable_moe::moe::MoeConfig;
use capturable_moe::routing::{RoutingConfig, RoutingPlan};

fn routing_config(capacity: Option<usize>) -> RoutingConfig {
    RoutingConfig {
        num_experts: 8,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 48,
        capacity,
        expert_capacity: Some(10),
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
    }
}

#[test]
fn routing_desc_resolves_the_capacity_host() {
    for (capacity, rows) in [(None, 96), (Some(20), 20)] {
        let plan = RoutingPlan::new(routing_config(capacity)).unwrap();
        let desc = plan.desc();
        assert_eq!(desc.config, routing_config(capacity));
        assert_eq!(desc.capacity, rows);
        assert_eq!(desc.workspace_bytes, plan.workspace_bytes());
    }
}

#[test]
fn echo_desc_holds_the_config_t_max_and_sizes_host() {
    let cfg = EchoConfig {
        ep: 4,
        num_experts: 16,
        spare_per_rank: 1,
        ep_rank: 2,
        topk: 4,
        algorithm: Algorithm::default_for(1),
        threshold_multiplier: 0.0,
    };
    let plan = EchoPlan::new(cfg.clone(), 300).unwrap();
    let desc = plan.desc();
    assert_eq!(desc.config, cfg);
    assert_eq!(desc.t_max, 300);
    assert_eq!((desc.state_len, desc.workspace_len), (plan.state_len(), plan.workspace_len()));
    assert!(desc.state_len > 0 && desc.workspace_len > 0);
}

/// Block balancing is off until asked for; a capacity past i32 is refused on the host.
#[test]
fn echo_block_capacity_is_opt_in_and_bounded_host() {
    let cfg = EchoConfig {
        ep: 4,
        num_experts: 16,
        spare_per_rank: 2,
        ep_rank: 0,
        topk: 4,
        algorithm: Algorithm::Greedy,
        threshold_multiplier: 0.0,
    };
    let plan = EchoPlan::new(cfg.clone(), 64).unwrap();
    assert_eq!(plan.block_capacity(), None);
    assert_eq!(plan.clone().with_block_capacity(40).unwrap().block_capacity(), Some(40));
    assert!(matches!(plan.with_block_capacity(1 << 31), Err(capturable_moe::Error::InvalidArgument { .. })));
}

/// The MoE layer's per-expert capacity reaches its routing plan (it used to be dropped).
#[test]
fn moe_config_passes_the_expert_capacity_to_routing_host() {
    let cfg = MoeConfig {
        num_experts: 8,
        hidden: 64,
        ffn: 32,
        topk: 2,
        max_tokens: 48,
        capacity: Some(40),
        expert_capacity: Some(7),
        dtype: DType::Bf16,
        prob_dtype: DType::F32,
        wgrad_accumulate: false,
    };
    let routing = cfg.routing_config();
    assert_eq!((routing.capacity, routing.expert_capacity), (Some(40), Some(7)));
    assert_eq!(RoutingPlan::new(routing).unwrap().abi_desc().expert_capacity, 7);
}
