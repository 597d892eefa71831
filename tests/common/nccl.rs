//! NCCL's presence for the EP GPU tests.

/// Whether NCCL can be used; prints `skipping: libnccl not found (...)` when not, and panics
/// under `CAPMOE_REQUIRE_NCCL=1` (scripts/gpu-run.sh sets it where it finds libnccl).
pub fn nccl_present() -> bool {
    match capturable_moe::ep::nccl_version() {
        Ok(_) => true,
        Err(reason) => {
            if std::env::var("CAPMOE_REQUIRE_NCCL").as_deref() == Ok("1") {
                panic!("CAPMOE_REQUIRE_NCCL=1 but NCCL is unusable: {reason}");
            }
            println!("skipping: libnccl not found ({reason})");
            false
        }
    }
}
