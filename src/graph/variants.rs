//! One executable graph switched between captures of the same work on other buffers (the
//! layers of a model, double-buffered inputs) by setting the arguments of only the nodes that
//! differ between them.
//!
//! [`GraphTemplate::apply_to`] hands the driver a whole graph to compare and update
//! (`cuGraphExecUpdate`): its cost grows with every node of the expert path, also the many
//! that are the same in every layer (routing kernels, argument kernels reading plan-owned
//! scratch). [`GraphVariants`] makes that comparison once ([`GraphVariants::prepare`]): per node, the
//! kernel's argument bytes (sized by the driver's own parameter table, `cuFuncGetParamInfo`,
//! so no argument layout is assumed — CUTLASS's by-value `Params` included), memset and copy
//! parameters; switching to a variant then sets only the nodes where some variant differs
//! (`cuGraphExecKernelNodeSetParams` and the memset / copy equivalents).
//!
//! Correctness does not rest on that bookkeeping alone: every variant is first applied
//! through `cuGraphExecUpdate`, so the driver itself checks that topology and kernels match
//! ([`Error::GraphUpdate`] otherwise), and nodes are paired in the order the driver lists
//! them, with each pair's type and kernel checked. A graph holding a node whose parameters
//! cannot be compared here (host, child-graph, event or allocation nodes) is switched by
//! whole-graph update instead, with the same result.
//!
//! What it saves is bounded by the driver's cost per node set: on the H200's host (2026-11-28,
//! `capmoe-bench --only graphs`) a select of the expert path (14 or 20 of its 23 nodes) took
//! 0.6-0.9x of the whole-graph update, not the 1/10 of capture + instantiate issue 16 asks.

use std::collections::HashMap;

use cudarc::driver::sys::{self, CUgraphNodeType};
use cudarc::driver::CudaGraph;

use super::ensure_not_capturing;
use super::update::GraphTemplate;
use crate::{Error, Result};

/// The parameters of one node that switching may have to set.
#[derive(Clone, Copy)]
enum NodeParams {
    Kernel(sys::CUDA_KERNEL_NODE_PARAMS),
    Memset(sys::CUDA_MEMSET_NODE_PARAMS),
    Memcpy(sys::CUDA_MEMCPY3D),
}

/// A node as far as a switch is concerned: what to compare, and what to set.
enum NodeView {
    /// Kernel launch: its parameters, and their bytes (argument values, grid, block, shared
    /// memory) for comparison.
    Kernel {
        params: sys::CUDA_KERNEL_NODE_PARAMS,
        bytes: Vec<u8>,
    },
    Memset(sys::CUDA_MEMSET_NODE_PARAMS),
    Memcpy(sys::CUDA_MEMCPY3D),
    /// No parameters (an empty node).
    Empty,
    /// A node type whose parameters are not compared here.
    Opaque,
}

impl NodeView {
    fn params(&self) -> Option<NodeParams> {
        match self {
            NodeView::Kernel { params, .. } => Some(NodeParams::Kernel(*params)),
            NodeView::Memset(p) => Some(NodeParams::Memset(*p)),
            NodeView::Memcpy(p) => Some(NodeParams::Memcpy(*p)),
            NodeView::Empty | NodeView::Opaque => None,
        }
    }

    fn same_as(&self, other: &NodeView) -> bool {
        match (self, other) {
            (NodeView::Kernel { bytes: a, .. }, NodeView::Kernel { bytes: b, .. }) => a == b,
            (NodeView::Memset(a), NodeView::Memset(b)) => a == b,
            (NodeView::Memcpy(a), NodeView::Memcpy(b)) => a == b,
            (NodeView::Empty, NodeView::Empty) => true,
            _ => false,
        }
    }
}

/// One node to set when switching to a variant: the node of the executable's own graph and the
/// variant's parameters for it (their argument storage is owned by the variant's template).
struct NodePatch {
    node: sys::CUgraphNode,
    params: NodeParams,
}

/// How a switch re-points the graph, once [`GraphVariants::prepare`] has compared the variants.
enum Switching {
    /// Not compared yet.
    Unprepared,
    /// Per variant, the nodes to set (the same nodes for every variant).
    Patches(Vec<Vec<NodePatch>>),
    /// The graph has a node this module cannot compare: a switch updates the whole graph.
    WholeGraph,
}

/// An executable graph and the templates it can be switched between ([`GraphVariants::select`]).
pub struct GraphVariants {
    exec: CudaGraph,
    variants: Vec<GraphTemplate>,
    switching: Switching,
    selected: Option<usize>,
}

// SAFETY: the raw handles are owned by `exec` and the templates, which may move between threads;
// `&mut self` serialises their use.
unsafe impl Send for GraphVariants {}

impl GraphVariants {
    /// Takes `exec` and the templates of its variants, each a capture of the same launches as
    /// `exec` on other buffers. Makes no CUDA call (the comparison is
    /// [`GraphVariants::prepare`]'s, run by the first select if not before), so nothing it
    /// owns is destroyed inside a capture when a later call is refused.
    pub fn new(exec: CudaGraph, variants: Vec<GraphTemplate>) -> Result<GraphVariants> {
        if variants.is_empty() {
            return Err(Error::InvalidArgument { op: "GraphVariants::new", why: "no variant given".into() });
        }
        Ok(GraphVariants { exec, variants, switching: Switching::Unprepared, selected: None })
    }

    /// Compares the variants once: each template is applied through `cuGraphExecUpdate` (the
    /// driver's topology and kernel check; [`Error::GraphUpdate`] on a mismatch), then the
    /// nodes that differ are found. Afterwards the graph runs the last variant until a select.
    /// Call it at set-up time to keep its cost out of the first switch.
    pub fn prepare(&mut self) -> Result<()> {
        ensure_not_capturing(self.variants[0].stream(), "GraphVariants::prepare")?;
        if !matches!(self.switching, Switching::Unprepared) {
            return Ok(());
        }
        for template in &self.variants {
            template.apply_to(&mut self.exec)?;
        }
        self.switching = compare(&self.exec, &self.variants)?;
        Ok(())
    }

    /// Points the graph at variant `index`'s buffers: its next launch runs on them. Launches
    /// already enqueued are not affected. A switch that fails part-way may leave some nodes
    /// set: the graph then counts as having no variant selected ([`GraphVariants::launch`]
    /// refuses) until a select succeeds.
    pub fn select(&mut self, index: usize) -> Result<()> {
        let stream = self.variants[0].stream().clone();
        ensure_not_capturing(&stream, "GraphVariants::select")?;
        if index >= self.variants.len() {
            return Err(Error::InvalidArgument {
                op: "GraphVariants::select",
                why: format!("variant {index} of {}", self.variants.len()),
            });
        }
        self.prepare()?;
        self.selected = None;
        match &self.switching {
            Switching::Unprepared => unreachable!("prepared above"),
            Switching::WholeGraph => self.variants[index].apply_to(&mut self.exec)?,
            Switching::Patches(per_variant) => {
                let ctx = stream.context();
                ctx.bind_to_thread()?;
                set_nodes(self.exec.cu_graph_exec(), ctx.cu_ctx(), &per_variant[index])?;
            }
        }
        self.selected = Some(index);
        Ok(())
    }

    /// The variant the last [`GraphVariants::select`] chose (`None` before the first).
    pub fn selected(&self) -> Option<usize> {
        self.selected
    }

    /// How many nodes a switch sets, once prepared; `None` before, or when a switch updates
    /// the whole graph.
    pub fn nodes_per_switch(&self) -> Option<usize> {
        match &self.switching {
            Switching::Patches(p) => Some(p[0].len()),
            Switching::Unprepared | Switching::WholeGraph => None,
        }
    }

    /// Launches the graph on its stream (the variant last selected).
    pub fn launch(&self) -> Result<()> {
        if self.selected.is_none() {
            return Err(Error::InvalidArgument { op: "GraphVariants::launch", why: "no variant selected yet".into() });
        }
        Ok(self.exec.launch()?)
    }

    /// The executable graph (to launch it in a larger sequence, or upload it).
    pub fn graph(&self) -> &CudaGraph {
        &self.exec
    }

    /// How many variants there are.
    pub fn len(&self) -> usize {
        self.variants.len()
    }

    /// Never true: [`GraphVariants::new`] refuses an empty list.
    pub fn is_empty(&self) -> bool {
        self.variants.is_empty()
    }
}

/// Sets each patched node of `exec` to its variant's parameters.
fn set_nodes(exec: sys::CUgraphExec, ctx: sys::CUcontext, patches: &[NodePatch]) -> Result<()> {
    for patch in patches {
        // SAFETY: `exec` was instantiated from the graph `patch.node` belongs to; the
        // parameters (and the argument storage they point to) are a template's, alive as long
        // as the GraphVariants that holds both.
        unsafe {
            match &patch.params {
                NodeParams::Kernel(p) => sys::cuGraphExecKernelNodeSetParams_v2(exec, patch.node, p),
                NodeParams::Memset(p) => sys::cuGraphExecMemsetNodeSetParams(exec, patch.node, p, ctx),
                NodeParams::Memcpy(p) => sys::cuGraphExecMemcpyNodeSetParams(exec, patch.node, p, ctx),
            }
            .result()?;
        }
    }
    Ok(())
}

/// Pairs the nodes of `exec`'s graph with each template's and finds those that differ.
fn compare(exec: &CudaGraph, variants: &[GraphTemplate]) -> Result<Switching> {
    let exec_nodes = graph_nodes(exec.cu_graph())?;
    let mut param_sizes = ParamSizes::default();
    let exec_views = describe(&exec_nodes, &mut param_sizes)?;
    let mut variant_views = Vec::with_capacity(variants.len());
    for template in variants {
        let nodes = graph_nodes(template.raw())?;
        if nodes.len() != exec_nodes.len() {
            return Err(mismatch(format!("{} nodes against the graph's {}", nodes.len(), exec_nodes.len())));
        }
        let views = describe(&nodes, &mut param_sizes)?;
        check_pairing(&exec_views, &views)?;
        variant_views.push(views);
    }
    Ok(plan_patches(&exec_nodes, &exec_views, &variant_views))
}

fn mismatch(why: String) -> Error {
    Error::GraphUpdate { why: format!("variants do not pair node for node: {why}") }
}

/// The nodes of `graph` in the order the driver lists them.
fn graph_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut count = 0usize;
    // SAFETY: a null array asks for the count only.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count).result()? };
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` entries.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count).result()? };
    nodes.truncate(count);
    Ok(nodes)
}

/// Sizes of each kernel's parameters, from the driver's table, cached per function.
#[derive(Default)]
struct ParamSizes(HashMap<usize, Option<Vec<(usize, usize)>>>);

impl ParamSizes {
    /// (offset, size) of every parameter of the node's kernel; `None` when the driver cannot
    /// say.
    fn of(&mut self, params: &sys::CUDA_KERNEL_NODE_PARAMS) -> Option<&[(usize, usize)]> {
        let key = if params.func.is_null() { params.kern as usize } else { params.func as usize };
        self.0.entry(key).or_insert_with(|| param_table(params)).as_deref()
    }
}

/// The driver's (offset, size) of each parameter of the node's function (or, for a node that
/// names a library kernel only, of that kernel). `None` when the driver refuses the query for
/// another reason than "no such parameter" (a driver without it): such a node's arguments
/// cannot be compared, and comparing none would miss a difference.
fn param_table(params: &sys::CUDA_KERNEL_NODE_PARAMS) -> Option<Vec<(usize, usize)>> {
    let mut table = Vec::new();
    loop {
        let (mut offset, mut size) = (0usize, 0usize);
        let index = table.len();
        // SAFETY: a live function or kernel handle from the node; past the last parameter the
        // driver answers CUDA_ERROR_INVALID_VALUE.
        let status = unsafe {
            if params.func.is_null() {
                sys::cuKernelGetParamInfo(params.kern, index, &mut offset, &mut size)
            } else {
                sys::cuFuncGetParamInfo(params.func, index, &mut offset, &mut size)
            }
        };
        match status {
            sys::cudaError_enum::CUDA_SUCCESS => {}
            sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE => return Some(table),
            _ => return None,
        }
        table.push((offset, size));
    }
}

/// What each node is, with what a comparison needs.
fn describe(nodes: &[sys::CUgraphNode], sizes: &mut ParamSizes) -> Result<Vec<NodeView>> {
    nodes.iter().map(|&node| describe_node(node, sizes)).collect()
}

fn describe_node(node: sys::CUgraphNode, sizes: &mut ParamSizes) -> Result<NodeView> {
    let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a live node of a live graph; the out-structs are plain C data the driver fills.
    unsafe {
        sys::cuGraphNodeGetType(node, &mut kind).result()?;
        Ok(match kind {
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => {
                let mut params: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
                sys::cuGraphKernelNodeGetParams_v2(node, &mut params).result()?;
                match sizes.of(&params) {
                    // Arguments packed in `extra`, or a kernel the driver cannot size: not
                    // compared, the graph is switched whole.
                    Some(table) if params.extra.is_null() && !params.kernelParams.is_null() => {
                        let bytes = kernel_bytes(&params, table);
                        NodeView::Kernel { params, bytes }
                    }
                    _ => NodeView::Opaque,
                }
            }
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => {
                let mut params: sys::CUDA_MEMSET_NODE_PARAMS = std::mem::zeroed();
                sys::cuGraphMemsetNodeGetParams(node, &mut params).result()?;
                NodeView::Memset(params)
            }
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => {
                let mut params: sys::CUDA_MEMCPY3D = std::mem::zeroed();
                sys::cuGraphMemcpyNodeGetParams(node, &mut params).result()?;
                NodeView::Memcpy(params)
            }
            CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY => NodeView::Empty,
            _ => NodeView::Opaque,
        })
    }
}

/// The bytes that identify a launch: kernel, grid, block, shared memory, every argument.
///
/// SAFETY (of the reads): `params.kernelParams` holds one pointer per entry of `table`, each to
/// that many bytes, as the driver's table for this kernel says.
fn kernel_bytes(params: &sys::CUDA_KERNEL_NODE_PARAMS, table: &[(usize, usize)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    let header = [
        params.func as usize as u64,
        params.kern as usize as u64,
        u64::from(params.gridDimX),
        u64::from(params.gridDimY),
        u64::from(params.gridDimZ),
        u64::from(params.blockDimX),
        u64::from(params.blockDimY),
        u64::from(params.blockDimZ),
        u64::from(params.sharedMemBytes),
    ];
    for word in header {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    for (index, &(_, size)) in table.iter().enumerate() {
        // SAFETY: see above.
        let arg = unsafe { std::slice::from_raw_parts(*params.kernelParams.add(index) as *const u8, size) };
        bytes.extend_from_slice(arg);
    }
    bytes
}

/// Each node of a variant must be the same kind of node as the graph's at that position, and
/// a kernel node must launch the same kernel.
fn check_pairing(graph: &[NodeView], variant: &[NodeView]) -> Result<()> {
    for (i, (a, b)) in graph.iter().zip(variant).enumerate() {
        let paired = match (a, b) {
            (NodeView::Kernel { params: p, .. }, NodeView::Kernel { params: q, .. }) => {
                p.func == q.func && p.kern == q.kern
            }
            (NodeView::Memset(_), NodeView::Memset(_))
            | (NodeView::Memcpy(_), NodeView::Memcpy(_))
            | (NodeView::Empty, NodeView::Empty)
            | (NodeView::Opaque, NodeView::Opaque) => true,
            _ => false,
        };
        if !paired {
            return Err(mismatch(format!("node {i} is another kind of node or launches another kernel")));
        }
    }
    Ok(())
}

/// The nodes where any variant differs from the graph or from another variant, and each
/// variant's parameters for them; whole-graph switching when an opaque node exists.
fn plan_patches(exec_nodes: &[sys::CUgraphNode], graph: &[NodeView], variants: &[Vec<NodeView>]) -> Switching {
    if graph.iter().any(|v| matches!(v, NodeView::Opaque)) {
        return Switching::WholeGraph;
    }
    let varying: Vec<usize> = (0..graph.len())
        .filter(|&i| variants.iter().any(|v| !v[i].same_as(&graph[i]) || !v[i].same_as(&variants[0][i])))
        .collect();
    let per_variant = variants
        .iter()
        .map(|views| {
            varying
                .iter()
                .filter_map(|&i| views[i].params().map(|params| NodePatch { node: exec_nodes[i], params }))
                .collect()
        })
        .collect();
    Switching::Patches(per_variant)
}
