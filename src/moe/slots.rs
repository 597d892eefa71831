//! Per-slot weight pointer tables for running the expert path over Echo's `E + S` columns.
//!
//! Echo's top-k reroute ([`crate::echo::EchoPlan::plan_reroute_topk`]) writes each route's
//! final column (spec P9: rank q owns columns `q·(L+S_per) ..`, its L home experts first, then
//! its S_per spare slots). An expert path planned with `num_experts = E + S` and
//! [`super::WeightForm::Pointers`] consumes those ids directly when entry `c` of every weight
//! (and gradient) pointer array points at column `c`'s matrix: the home expert's own matrix for
//! a home column, the spare slot's copy (filled by [`crate::echo::fill_spare_weights`]) for a
//! spare column. The tables depend only on the configuration and the buffers' addresses, not
//! on the plan, so they are built once and stay valid across graph replays.

use cudarc::driver::{CudaStream, DevicePtr, DeviceRepr};

use crate::echo::EchoConfig;
use crate::error::ensure_len;
use crate::{Error, Result};

/// The `E + S` addresses, in Echo's final column order, of one weight-shaped operand whose
/// home experts are packed at `home` (`[E, bytes_per_expert]`) and spare slots at `spare`
/// (`[S, bytes_per_expert]`): entry `cfg.expert_column(e)` is `home + e · bytes_per_expert`,
/// entry `cfg.slot_column(j)` is `spare + j · bytes_per_expert`. Host arithmetic only.
pub fn echo_slot_table(cfg: &EchoConfig, home: u64, spare: u64, bytes_per_expert: usize) -> Vec<u64> {
    let bytes = bytes_per_expert as u64;
    let mut table = vec![0u64; cfg.num_columns()];
    for e in 0..cfg.num_experts {
        table[cfg.expert_column(e)] = home + e as u64 * bytes;
    }
    for j in 0..cfg.num_spare() {
        table[cfg.slot_column(j)] = spare + j as u64 * bytes;
    }
    table
}

/// Bytes of one expert matrix of `per_expert` elements of `T`, the stride of a pointer table:
/// a multiple of 16, or every matrix after the first would miss the GEMM's 16-byte alignment.
pub(crate) fn expert_matrix_bytes<T>(op: &'static str, per_expert: usize) -> Result<usize> {
    let bytes = per_expert * std::mem::size_of::<T>();
    if !bytes.is_multiple_of(16) {
        return Err(Error::Alignment { op, what: "bytes per expert matrix", value: bytes as i64, multiple: 16 });
    }
    Ok(bytes)
}

/// [`echo_slot_table`] for device buffers: checks that `home` holds `E · per_expert` and
/// `spare` `S · per_expert` elements and that every entry is 16-byte aligned, then returns the
/// table for the caller to upload (a `[E + S]` u64 device array) once. The entries are plain
/// addresses: they stay meaningful only while `home` and `spare` are alive and unmoved.
/// `T` sets the per-slot stride, so it must be the element type the plan reads or writes
/// through the table: the weight dtype for fc1 / fc2, `f32` for the dW tables of a
/// `wgrad_accumulate` plan (the plan itself only sees u64 addresses and cannot check it).
pub fn echo_slot_pointers<T: DeviceRepr>(
    stream: &CudaStream,
    cfg: &EchoConfig,
    home: &impl DevicePtr<T>,
    spare: &impl DevicePtr<T>,
    per_expert: usize,
) -> Result<Vec<u64>> {
    const OP: &str = "echo_slot_pointers";
    cfg.validate()?;
    for (what, len, need) in [
        ("home [E, per_expert]", home.len(), cfg.num_experts * per_expert),
        ("spare [S, per_expert]", spare.len(), cfg.num_spare() * per_expert),
    ] {
        ensure_len(OP, what, len, need, "")?;
    }
    let bytes = expert_matrix_bytes::<T>(OP, per_expert)?;
    let (h, _gh) = home.device_ptr(stream);
    let (s, _gs) = spare.device_ptr(stream);
    if !h.is_multiple_of(16) || !s.is_multiple_of(16) {
        return Err(Error::InvalidArgument {
            op: OP,
            why: format!("home at {h:#x} and spare at {s:#x} must be 16-byte aligned"),
        });
    }
    Ok(echo_slot_table(cfg, h, s, bytes))
}
