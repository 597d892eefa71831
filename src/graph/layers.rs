//! One captured graph of the expert path for every layer of a model, switched by rewriting the
//! plan's weight pointer tables instead of updating the graph.
//!
//! A plan with [`WeightForm::Pointers`](crate::moe::WeightForm::Pointers) reads its four
//! per-expert pointer arrays (fc1, fc2, dW1, dW2) on the device at every launch, so a graph
//! captured once over arrays that stay put runs whichever layer those arrays point at.
//! [`LayerTables`] holds those four arrays (the "active" tables the graph reads) and, built
//! once, every layer's own addresses; [`LayerTables::select`] is then one device-to-device copy
//! of `4 · E` addresses on the replay stream, ordered before the next replay like any other
//! work. No node of the graph changes, so the cost does not grow with the graph
//! ([`GraphTemplate::apply_to`] and [`GraphVariants::select`] set nodes: 14-20 of the expert
//! path's 23 per switch). On the H200's host a select took 4.9-5.5 µs, 0.05-0.06x of the
//! graph's capture + instantiate (bench/README.md, issue 16).
//!
//! What it covers: the weights and weight gradients. Activations the layers do not share
//! (inputs, outputs, the backward's dy) stay what the graph was captured with: an engine copies
//! each layer's inputs into them, or switches those with [`GraphVariants`]. The copy is an
//! ordinary stream operation, so a capture records it as a copy node (untested here).
//!
//! [`GraphTemplate::apply_to`]: super::GraphTemplate::apply_to
//! [`GraphVariants`]: super::GraphVariants
//! [`GraphVariants::select`]: super::GraphVariants::select

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr};

use super::ensure_not_capturing;
use crate::error::ensure_len;
use crate::moe::{expert_matrix_bytes, MoeConfig};
use crate::{Error, Result};

/// One layer's weight tensors and gradient tensors (`[E, 2F, H]`, `[E, H, F]`, and the same
/// shapes for the gradients, which are fp32 for a `wgrad_accumulate` plan).
pub struct LayerWeights<'a, W, G> {
    pub fc1: &'a CudaSlice<W>,
    pub fc2: &'a CudaSlice<W>,
    pub dw1: &'a CudaSlice<G>,
    pub dw2: &'a CudaSlice<G>,
}

/// The four pointer arrays a pointer-form plan reads (the "active" tables, `[4, E]`: fc1, fc2,
/// dW1, dW2) and every layer's (`[L, 4, E]`). The addresses are plain numbers: the layers'
/// tensors, and these tables, must stay allocated and unmoved while a graph reading them is
/// replayed. `W` and `G` set each matrix's stride, so they must be the types the plan reads and
/// writes (the activation dtype; `f32` gradients for a `wgrad_accumulate` plan): the plan sees
/// only addresses and cannot check them.
pub struct LayerTables {
    active: CudaSlice<u64>,
    /// Every layer's tables: owned here, read only through `addresses` (raw copies).
    _layers: CudaSlice<u64>,
    /// The device addresses of `active` and of the layers' tables.
    addresses: [sys::CUdeviceptr; 2],
    context: Arc<CudaContext>,
    experts: usize,
    count: usize,
}

impl LayerTables {
    /// The tables of `layers` for plans of `config` (its `num_experts`, `hidden`, `ffn`), the
    /// active tables pointing at layer 0. Checks every tensor's length and that every expert
    /// matrix is 16-byte aligned (the GEMM's requirement). Uploads and waits for the upload:
    /// call it before capturing.
    pub fn new<W: DeviceRepr, G: DeviceRepr>(
        stream: &Arc<CudaStream>,
        config: &MoeConfig,
        layers: &[LayerWeights<'_, W, G>],
    ) -> Result<LayerTables> {
        const OP: &str = "LayerTables::new";
        ensure_not_capturing(stream, OP)?;
        if layers.is_empty() {
            return Err(Error::InvalidArgument { op: OP, why: "no layers".into() });
        }
        let (e, fc1_matrix, fc2_matrix) =
            (config.num_experts, 2 * config.ffn * config.hidden, config.hidden * config.ffn);
        let mut table = Vec::with_capacity(layers.len() * 4 * e);
        for layer in layers {
            table.extend(expert_addresses(stream, OP, "fc1 [E, 2F, H]", layer.fc1, e, fc1_matrix)?);
            table.extend(expert_addresses(stream, OP, "fc2 [E, H, F]", layer.fc2, e, fc2_matrix)?);
            table.extend(expert_addresses(stream, OP, "dW1 [E, 2F, H]", layer.dw1, e, fc1_matrix)?);
            table.extend(expert_addresses(stream, OP, "dW2 [E, H, F]", layer.dw2, e, fc2_matrix)?);
        }
        let (active, all) = (stream.clone_htod(&table[..4 * e])?, stream.clone_htod(&table)?);
        let addresses = [active.device_ptr(stream).0, all.device_ptr(stream).0];
        stream.synchronize()?;
        Ok(LayerTables {
            active,
            _layers: all,
            addresses,
            context: stream.context().clone(),
            experts: e,
            count: layers.len(),
        })
    }

    /// Layers held.
    pub fn layer_count(&self) -> usize {
        self.count
    }

    /// Points the active tables at layer `layer`: one device-to-device copy of `4 · E`
    /// addresses enqueued on `stream`, which must be the stream the graph is replayed on (or
    /// the one being captured): it is a raw driver call, without cudarc's per-buffer events
    /// (several driver calls per copy: two safe copies took 12-19 µs on the H200's host), so
    /// nothing orders it against another stream. Allocates nothing and does not wait.
    pub fn select(&mut self, stream: &Arc<CudaStream>, layer: usize) -> Result<()> {
        const OP: &str = "LayerTables::select";
        if layer >= self.count {
            return Err(Error::InvalidArgument { op: OP, why: format!("layer {layer} of {}", self.count) });
        }
        if stream.context().cu_ctx() != self.context.cu_ctx() {
            return Err(Error::InvalidArgument {
                op: OP,
                why: "a stream of another CUDA context than the tables'".into(),
            });
        }
        let bytes = 4 * self.experts * std::mem::size_of::<u64>();
        let [active, layers] = self.addresses;
        self.context.bind_to_thread()?;
        // SAFETY: the source is `bytes` long at that offset (layer < count) and the destination
        // `bytes` long, both owned by `self` and alive; the copy is ordered on `stream`.
        unsafe { result::memcpy_dtod_async(active, layers + (layer * bytes) as u64, bytes, stream.cu_stream())? };
        Ok(())
    }

    /// Runs `body` with views of the active tables, in the order `MoeExperts::forward` /
    /// `backward` take them: fc1, fc2 (read) and dW1, dW2 (the gradients written through
    /// them). A closure because the four views are cut from one buffer.
    pub fn with_active<R>(&mut self, body: impl FnOnce(ActiveTables<'_>) -> R) -> R {
        let e = self.experts;
        let (weights, mut grads) = self.active.split_at_mut(2 * e);
        let (dw1, dw2) = grads.split_at_mut(e);
        body(ActiveTables { fc1: weights.slice(..e), fc2: weights.slice(e..), dw1, dw2 })
    }
}

/// Views of the active pointer tables ([`LayerTables::with_active`]).
pub struct ActiveTables<'a> {
    pub fc1: CudaView<'a, u64>,
    pub fc2: CudaView<'a, u64>,
    pub dw1: CudaViewMut<'a, u64>,
    pub dw2: CudaViewMut<'a, u64>,
}

/// The `experts` matrix addresses of `tensor` (`[experts, matrix]` elements).
fn expert_addresses<T: DeviceRepr>(
    stream: &CudaStream,
    op: &'static str,
    what: &'static str,
    tensor: &CudaSlice<T>,
    experts: usize,
    matrix: usize,
) -> Result<Vec<u64>> {
    ensure_len(op, what, tensor.len(), experts * matrix, "")?;
    let bytes = expert_matrix_bytes::<T>(op, matrix)?;
    let (base, _guard) = tensor.device_ptr(stream);
    matrix_addresses(op, what, base, experts, bytes)
}

/// `experts` consecutive matrices of `matrix_bytes` (a multiple of 16) from `base`, which must
/// be 16-byte aligned (the GEMM's TMA rows need it): `what` names the tensor in the error.
fn matrix_addresses(
    op: &'static str,
    what: &'static str,
    base: u64,
    experts: usize,
    matrix_bytes: usize,
) -> Result<Vec<u64>> {
    if !base.is_multiple_of(16) {
        return Err(Error::Alignment { op, what, value: base as i64, multiple: 16 });
    }
    Ok((0..experts as u64).map(|e| base + e * matrix_bytes as u64).collect())
}

#[cfg(test)]
mod tests {
    use super::matrix_addresses;
    use crate::moe::expert_matrix_bytes;
    use crate::Error;

    #[test]
    fn matrix_addresses_step_by_the_matrix_and_refuse_misalignment() {
        assert_eq!(matrix_addresses("op", "fc1", 0x1000, 3, 32).unwrap(), [0x1000, 0x1020, 0x1040]);
        assert!(matrix_addresses("op", "fc1", 0x1000, 0, 32).unwrap().is_empty());
        let misaligned = matrix_addresses("op", "fc1", 0x1008, 3, 32);
        assert!(matches!(misaligned, Err(Error::Alignment { what: "fc1", value: 0x1008, .. })), "{misaligned:?}");
        let odd_stride = expert_matrix_bytes::<u8>("op", 24);
        assert!(matches!(odd_stride, Err(Error::Alignment { what: "bytes per expert matrix", value: 24, .. })));
    }
}
