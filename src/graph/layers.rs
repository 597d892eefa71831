//! One captured graph of the expert path for every layer of a model, switched by rewriting the
//! plan's weight pointer tables instead of updating the graph.
//!
//! A plan with [`WeightForm::Pointers`](crate::moe::WeightForm::Pointers) reads its four
//! per-expert pointer arrays (fc1, fc2, dW1, dW2) on the device at every launch, so a graph
//! captured once over arrays that stay put runs whichever layer those arrays point at.
//! [`LayerTables`] holds those four arrays (the "active" tables the graph reads) and, built once,
//! every layer's own addresses; [`LayerTables::select`] is then two device-to-device copies of
//! `2 · E` addresses on the replay stream, ordered before the next replay like any other work. No node
//! of the graph changes, so the cost does not grow with the graph ([`GraphTemplate::apply_to`]
//! and [`GraphVariants::select`] set nodes: 14-20 of the expert path's 23 per switch).
//!
//! What it covers: the weights and weight gradients. Activations the layers do not share
//! (inputs, outputs, the backward's dy) stay what the graph was captured with: an engine copies
//! each layer's inputs into them, or switches those with [`GraphVariants`]. The copy is an
//! ordinary stream operation, so a graph may capture it too (e.g. one graph stepping through
//! several layers, a `select` before each).
//!
//! [`GraphTemplate::apply_to`]: super::GraphTemplate::apply_to
//! [`GraphVariants`]: super::GraphVariants
//! [`GraphVariants::select`]: super::GraphVariants::select

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr};

use super::ensure_not_capturing;
use crate::error::ensure_len;
use crate::moe::MoeConfig;
use crate::{Error, Result};

/// One layer's weight tensors and gradient tensors (`[E, 2F, H]`, `[E, H, F]`, and the same
/// shapes for the gradients, which are fp32 for a `wgrad_accumulate` plan).
pub struct LayerWeights<'a, W, G> {
    pub fc1: &'a CudaSlice<W>,
    pub fc2: &'a CudaSlice<W>,
    pub dw1: &'a CudaSlice<G>,
    pub dw2: &'a CudaSlice<G>,
}

/// The four pointer arrays a pointer-form plan reads (the "active" tables: fc1 and fc2 in one
/// buffer, dW1 and dW2 in another, `[2, E]` each) and every layer's addresses (`[L, 2, E]` for
/// the weights, the same for the gradients). The addresses are plain numbers: the layers'
/// tensors must stay allocated and unmoved while a graph reading them is replayed.
pub struct LayerTables {
    weights: CudaSlice<u64>,
    grads: CudaSlice<u64>,
    /// Every layer's tables, `[L, 2, E]` each: owned here, read only through `addresses`.
    _layer_weights: CudaSlice<u64>,
    _layer_grads: CudaSlice<u64>,
    /// The four buffers' device addresses (active weights, active gradients, every layer's
    /// weights, every layer's gradients), for the raw copies of `select`.
    addresses: [sys::CUdeviceptr; 4],
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
        let (mut weights, mut grads) =
            (Vec::with_capacity(layers.len() * 2 * e), Vec::with_capacity(layers.len() * 2 * e));
        for layer in layers {
            weights.extend(expert_addresses(stream, OP, "fc1 [E, 2F, H]", layer.fc1, e, fc1_matrix)?);
            weights.extend(expert_addresses(stream, OP, "fc2 [E, H, F]", layer.fc2, e, fc2_matrix)?);
            grads.extend(expert_addresses(stream, OP, "dW1 [E, 2F, H]", layer.dw1, e, fc1_matrix)?);
            grads.extend(expert_addresses(stream, OP, "dW2 [E, H, F]", layer.dw2, e, fc2_matrix)?);
        }
        let buffers = [&weights[..2 * e], &grads[..2 * e], &weights[..], &grads[..]].map(|t| stream.clone_htod(t));
        let [active_weights, active_grads, layer_weights, layer_grads] = buffers;
        let (weights, grads) = (active_weights?, active_grads?);
        let (layer_weights, layer_grads) = (layer_weights?, layer_grads?);
        let addresses = [&weights, &grads, &layer_weights, &layer_grads].map(|b| b.device_ptr(stream).0);
        stream.synchronize()?;
        Ok(LayerTables {
            weights,
            grads,
            _layer_weights: layer_weights,
            _layer_grads: layer_grads,
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

    /// Points the active tables at layer `layer`: two device-to-device copies (weights,
    /// gradients; `2 · E` addresses each) enqueued on `stream`, which must be the stream the
    /// graph is replayed on (or the one being captured): the copies are raw driver calls,
    /// without cudarc's per-buffer events (several driver calls per copy, 10-19 µs for the two
    /// on the H200's host), so nothing orders them against another stream. Allocates nothing
    /// and does not wait.
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
        let bytes = 2 * self.experts * std::mem::size_of::<u64>();
        let [weights, grads, layer_weights, layer_grads] = self.addresses;
        let from = (layer * bytes) as u64;
        self.context.bind_to_thread()?;
        // SAFETY: both sources are `bytes` long at `from` (layer < count) and both destinations
        // `bytes` long, all owned by `self` and alive; the copies are ordered on `stream`.
        unsafe {
            result::memcpy_dtod_async(weights, layer_weights + from, bytes, stream.cu_stream())?;
            result::memcpy_dtod_async(grads, layer_grads + from, bytes, stream.cu_stream())?;
        }
        Ok(())
    }

    /// The active tables, in the order `MoeExperts::forward` / `backward` take them:
    /// fc1, fc2 (read) and dW1, dW2 (the gradients written through them).
    pub fn active(&mut self) -> ActiveTables<'_> {
        let e = self.experts;
        let (dw1, dw2) = self.grads.split_at_mut(e);
        ActiveTables { fc1: self.weights.slice(..e), fc2: self.weights.slice(e..), dw1, dw2 }
    }
}

/// Views of the active pointer tables ([`LayerTables::active`]).
pub struct ActiveTables<'a> {
    pub fc1: CudaView<'a, u64>,
    pub fc2: CudaView<'a, u64>,
    pub dw1: CudaViewMut<'a, u64>,
    pub dw2: CudaViewMut<'a, u64>,
}

/// The `experts` matrix addresses of `tensor` (`[experts, matrix]` elements), each checked to
/// be 16-byte aligned.
fn expert_addresses<T: DeviceRepr>(
    stream: &CudaStream,
    op: &'static str,
    what: &'static str,
    tensor: &CudaSlice<T>,
    experts: usize,
    matrix: usize,
) -> Result<Vec<u64>> {
    ensure_len(op, what, tensor.len(), experts * matrix, "")?;
    let bytes = (matrix * std::mem::size_of::<T>()) as u64;
    let (base, _guard) = tensor.device_ptr(stream);
    if !base.is_multiple_of(16) || !bytes.is_multiple_of(16) {
        return Err(Error::Alignment { op, what, value: base as i64, multiple: 16 });
    }
    Ok((0..experts as u64).map(|e| base + e * bytes).collect())
}
