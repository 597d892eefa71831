//! Re-pointing an instantiated graph at other buffers without instantiating again.
//!
//! A [`GraphTemplate`] is a captured, not instantiated, graph. [`GraphTemplate::apply_to`]
//! updates an executable graph to it (`cuGraphExecUpdate`): same topology, same kernels,
//! new kernel arguments (pointers of another layer's weights, double-buffered inputs), so one
//! executable can serve every layer of a model.
//!
//! NOTE: why whole-graph update of a re-captured graph rather than patching kernel-node
//! arguments one by one (`cuGraphExecKernelNodeSetParams`): the expert path's nodes include
//! CUTLASS kernels whose one argument is a large by-value `Params` struct (pointers buried at
//! offsets only CUTLASS knows, next to values derived from them), memset and copy nodes, and
//! launches whose arguments change with the build; patching would have to know every layout
//! and break silently when one changes. Re-capturing runs only the host side of each launch
//! (no instantiation; one upload of the updated graph), and the driver checks that the topology and kernels match
//! (an [`Error::GraphUpdate`] otherwise), so a wrong update cannot pass unnoticed.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUgraphExecUpdateResult, CUgraphExecUpdateResultInfo};
use cudarc::driver::{CudaGraph, CudaStream};

use super::{ensure_not_capturing, CaptureMode, TrackingOff};
use crate::{Error, Result};

/// A captured graph, not instantiated; destroyed on drop.
pub struct GraphTemplate {
    graph: sys::CUgraph,
    stream: Arc<CudaStream>,
}

// SAFETY: a CUgraph may move between threads; `&mut self` / ownership serialise its use.
unsafe impl Send for GraphTemplate {}

impl Drop for GraphTemplate {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: owned by this template, destroyed once.
        unsafe { sys::cuGraphDestroy(self.graph) };
    }
}

impl GraphTemplate {
    /// Captures what `body` enqueues on `stream`, like [`super::capture`] (global mode, event
    /// tracking off while it runs), without instantiating it.
    pub fn capture(stream: &Arc<CudaStream>, body: impl FnOnce() -> Result<()>) -> Result<GraphTemplate> {
        GraphTemplate::capture_in(stream, CaptureMode::Global, body)
    }

    /// [`GraphTemplate::capture`] in the given mode: [`CaptureMode::ThreadLocal`] where other
    /// threads keep making CUDA calls meanwhile (a thread per GPU, as NCCL's expert-parallel
    /// ranks run).
    pub fn capture_in(
        stream: &Arc<CudaStream>,
        mode: CaptureMode,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<GraphTemplate> {
        ensure_not_capturing(stream, "GraphTemplate::capture")?;
        let _tracking_off = TrackingOff::new(stream.context().clone());
        stream.begin_capture(mode.to_cuda())?;
        let body_result = super::run_capture_body(body);
        // The capture is ended whatever happens (a panic too): one left open would fail every
        // later call.
        let _ = stream.context().bind_to_thread();
        // SAFETY: the capture was begun on this stream above.
        let graph = unsafe { cudarc::driver::result::stream::end_capture(stream.cu_stream()) };
        let template = graph.map(|graph| GraphTemplate { graph, stream: stream.clone() });
        body_result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        let template = template?;
        if template.graph.is_null() {
            std::mem::forget(template);
            return Err(Error::InvalidArgument { op: "GraphTemplate::capture", why: "nothing was captured".into() });
        }
        Ok(template)
    }

    /// Updates `exec` to this template's kernel arguments (and memset / copy parameters): its
    /// next launch runs on the buffers this template was captured with. The topology and the
    /// kernels must be those `exec` was instantiated from, else [`Error::GraphUpdate`] and
    /// `exec` is unchanged. Launches of `exec` already enqueued are not affected. The updated
    /// graph is then uploaded on `exec`'s stream (`cuGraphUpload`, as [`super::capture`]
    /// does after instantiating), so its next launch does not pay for that.
    pub fn apply_to(&self, exec: &mut CudaGraph) -> Result<()> {
        ensure_not_capturing(&self.stream, "GraphTemplate::apply_to")?;
        self.stream.context().bind_to_thread()?;
        // SAFETY: a plain C struct the driver fills.
        let mut info: CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both handles are live; `exec` is borrowed mutably, so no other thread uses it.
        let status = unsafe { sys::cuGraphExecUpdate_v2(exec.cu_graph_exec(), self.graph, &mut info) };
        if info.result != CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS {
            return Err(Error::GraphUpdate { why: update_failure(info.result) });
        }
        status.result()?;
        exec.upload()?;
        Ok(())
    }

    /// The captured graph (owned by the template).
    pub(super) fn raw(&self) -> sys::CUgraph {
        self.graph
    }

    /// The stream the template was captured on.
    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Every node of the template (kernel, memset, copy, and any empty, event or wait node).
    pub fn node_count(&self) -> Result<usize> {
        let mut count = 0usize;
        // SAFETY: a null node array asks for the count only.
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut count).result()? };
        Ok(count)
    }
}

/// Captures `body` on `stream` and updates `exec` to it ([`GraphTemplate`]): the way to
/// re-point a graph at other buffers without instantiating it again.
pub fn update(exec: &mut CudaGraph, stream: &Arc<CudaStream>, body: impl FnOnce() -> Result<()>) -> Result<()> {
    GraphTemplate::capture(stream, body)?.apply_to(exec)
}

/// Why the driver refused an update, in words.
pub fn update_failure(result: CUgraphExecUpdateResult) -> String {
    use CUgraphExecUpdateResult as R;
    let why = match result {
        R::CU_GRAPH_EXEC_UPDATE_SUCCESS => "no failure",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => "the graph's topology changed (other launches or order)",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => "a node's type changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED | R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "a kernel node runs another kernel (e.g. another GEMM configuration)"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => "a parameter that cannot be updated changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => "a node's attributes changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => "the graph holds a node that cannot be updated",
        R::CU_GRAPH_EXEC_UPDATE_ERROR => "the update was refused",
    };
    format!("{why} ({result:?}); capture the same sequence of launches with the same plans")
}
