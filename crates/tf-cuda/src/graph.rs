//! CUDA graphs: capture as a guard, instantiate, upload, launch, update.
//!
//! [`Stream::begin_capture`] opens a copy-source capture scope and starts the driver's capture;
//! the returned [`Capture`] guard must be ended with [`Capture::end`]. Dropping it un-ended ends
//! the driver capture, discards the graph and closes the scope, so a failed capture can never
//! leave the stream (or every synchronous upload in the process) refused.
//!
//! Async uploads made on the capturing stream become copy nodes that read private staging; the
//! graph and every executable built from it keep that staging alive.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use tf_copysource::{CaptureScope, CapturedSources};
use tf_sys::{CUgraph, CUgraphExec, CUgraphNode, CaptureMode};

use crate::context::ContextInner;
use crate::copy::{self, DriverBackend};
use crate::error::Error;
use crate::launch::{Args, LaunchConfig};
use crate::module::Function;
use crate::stream::Stream;
use crate::usage;

/// Which other threads' driver calls a capture refuses (`CUstreamCaptureMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Only this thread's unsafe calls are refused; other threads stay out (the default).
    #[default]
    ThreadLocal,
    /// Unsafe calls from any thread are refused while the capture is open.
    Global,
    /// Nothing is refused.
    Relaxed,
}

impl Mode {
    fn raw(self) -> i32 {
        match self {
            Mode::ThreadLocal => CaptureMode::ThreadLocal as i32,
            Mode::Global => CaptureMode::Global as i32,
            Mode::Relaxed => CaptureMode::Relaxed as i32,
        }
    }
}

/// An open stream capture. End it with [`Capture::end`]; dropping it discards the capture.
pub struct Capture<'s> {
    stream: &'s Stream,
    scope: Option<CaptureScope<DriverBackend>>,
    /// When the capture began (its wall time is counted in [`crate::usage::driver_costs`]).
    started: Instant,
}

impl fmt::Debug for Capture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capture")
            .field("stream", &self.stream.raw())
            .finish()
    }
}

impl Stream {
    /// Starts capturing this stream: work enqueued on it is recorded, not run, until
    /// [`Capture::end`].
    pub fn begin_capture(&self, mode: Mode) -> Result<Capture<'_>, Error> {
        self.ctx.ensure_healthy("cuStreamBeginCapture_v2")?;
        let started = Instant::now();
        let scope = copy::hub().begin_capture(self.ctx.copy_id, self.key())?;
        let s = self.raw();
        // On failure `scope` drops here and closes itself.
        self.ctx.call("cuStreamBeginCapture_v2", |api| {
            // SAFETY: the stream is live; the mode is a valid CUstreamCaptureMode.
            unsafe { (api.cuStreamBeginCapture_v2)(s, mode.raw()) }
        })?;
        Ok(Capture {
            stream: self,
            scope: Some(scope),
            started,
        })
    }

    /// True while the stream is being captured.
    pub fn is_capturing(&self) -> Result<bool, Error> {
        let mut status = 0;
        let s = self.raw();
        self.ctx.call("cuStreamIsCapturing", |api| {
            // SAFETY: out-pointer to a local; the stream is live.
            unsafe { (api.cuStreamIsCapturing)(s, &mut status) }
        })?;
        Ok(status != tf_sys::capture_status::NONE)
    }
}

impl Capture<'_> {
    /// The captured stream.
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Ends the capture and returns the recorded graph. On failure (an invalidated capture)
    /// nothing is kept and the scope is closed.
    pub fn end(mut self) -> Result<Graph, Error> {
        let ctx = Arc::clone(&self.stream.ctx);
        let mut graph: CUgraph = std::ptr::null_mut();
        let s = self.stream.raw();
        let result = ctx.call("cuStreamEndCapture", |api| {
            // SAFETY: out-pointer to a local; the stream is live and capturing.
            unsafe { (api.cuStreamEndCapture)(s, &mut graph) }
        });
        let scope = self.scope.take();
        usage::CAPTURE_CALLS.record(self.started);
        match result {
            Ok(()) if !graph.is_null() => {
                let sources = scope.map(CaptureScope::end);
                Ok(Graph {
                    ctx,
                    handle: graph,
                    sources,
                })
            }
            Ok(()) => {
                drop(scope);
                Err(Error::invalid(
                    "cuStreamEndCapture returned no graph: the capture was invalidated",
                ))
            }
            Err(e) => {
                if !graph.is_null() {
                    destroy_graph(&ctx, graph);
                }
                drop(scope);
                Err(e.into())
            }
        }
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        let Some(scope) = self.scope.take() else {
            return;
        };
        let ctx = &self.stream.ctx;
        let mut graph: CUgraph = std::ptr::null_mut();
        let s = self.stream.raw();
        ctx.release_call("cuStreamEndCapture", |api| {
            // SAFETY: out-pointer to a local; the stream is live.
            unsafe { (api.cuStreamEndCapture)(s, &mut graph) }
        });
        if !graph.is_null() {
            destroy_graph(ctx, graph);
        }
        // Discards the staging the capture owned: no graph replays it.
        drop(scope);
    }
}

fn destroy_graph(ctx: &ContextInner, graph: CUgraph) {
    ctx.release_call("cuGraphDestroy", |api| {
        // SAFETY: destroyed once; the handle came from end-capture or cuGraphCreate.
        unsafe { (api.cuGraphDestroy)(graph) }
    });
}

/// A recorded graph (a template): instantiate it to run it.
pub struct Graph {
    ctx: Arc<ContextInner>,
    handle: CUgraph,
    sources: Option<CapturedSources<DriverBackend>>,
}

// SAFETY: graph handles may be used from any thread; calls bind the context first; the driver
// serializes calls on one graph.
unsafe impl Send for Graph {}
// SAFETY: `&self` methods only read node lists and parameters.
unsafe impl Sync for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("handle", &self.handle)
            .field("sources", &self.sources)
            .finish()
    }
}

/// A node of a [`Graph`], valid while the graph lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphNode<'g> {
    handle: CUgraphNode,
    _graph: std::marker::PhantomData<&'g Graph>,
}

impl GraphNode<'_> {
    /// The raw `CUgraphNode`.
    pub fn raw(&self) -> CUgraphNode {
        self.handle
    }
}

/// Parameters of a kernel node as the driver reports them.
#[derive(Clone, Copy, Debug)]
pub struct KernelNode {
    pub function: tf_sys::CUfunction,
    pub config: LaunchConfig,
}

impl Graph {
    /// The raw `CUgraph`.
    pub fn raw(&self) -> CUgraph {
        self.handle
    }

    /// Staging blocks of captured uploads this graph keeps alive.
    pub fn owned_sources(&self) -> usize {
        self.sources.as_ref().map_or(0, |s| s.block_count())
    }

    /// The graph's nodes in capture order.
    pub fn nodes(&self) -> Result<Vec<GraphNode<'_>>, Error> {
        let mut count = 0usize;
        let g = self.handle;
        self.ctx.call("cuGraphGetNodes", |api| {
            // SAFETY: a null array asks for the count only.
            unsafe { (api.cuGraphGetNodes)(g, std::ptr::null_mut(), &mut count) }
        })?;
        let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); count];
        if count > 0 {
            self.ctx.call("cuGraphGetNodes", |api| {
                // SAFETY: the array holds `count` entries.
                unsafe { (api.cuGraphGetNodes)(g, nodes.as_mut_ptr(), &mut count) }
            })?;
            nodes.truncate(count);
        }
        Ok(nodes
            .into_iter()
            .map(|handle| GraphNode {
                handle,
                _graph: std::marker::PhantomData,
            })
            .collect())
    }

    /// The parameters of kernel node `node`.
    pub fn kernel_node(&self, node: GraphNode<'_>) -> Result<KernelNode, Error> {
        let mut p = zeroed_params();
        let node = node.handle;
        self.ctx.call("cuGraphKernelNodeGetParams_v2", |api| {
            // SAFETY: out-pointer to a local; the node belongs to this graph.
            unsafe { (api.cuGraphKernelNodeGetParams_v2)(node, &mut p) }
        })?;
        Ok(KernelNode {
            function: p.func,
            config: LaunchConfig {
                grid: (p.grid_x, p.grid_y, p.grid_z).into(),
                block: (p.block_x, p.block_y, p.block_z).into(),
                shared_bytes: p.shared_bytes,
            },
        })
    }

    /// Replaces kernel node `node`'s function, geometry and arguments in this template.
    pub fn set_kernel_node(
        &self,
        node: GraphNode<'_>,
        function: &Function,
        cfg: &LaunchConfig,
        args: &Args,
    ) -> Result<(), Error> {
        cfg.validate(function.dynamic_shared_limit())?;
        args.validate()?;
        let mut pointers = args.pointers();
        let p = node_params(function, cfg, &mut pointers);
        let node = node.handle;
        self.ctx.call("cuGraphKernelNodeSetParams_v2", |api| {
            // SAFETY: `p` points at argument pointers that outlive the call (the driver copies
            // the values); the node belongs to this graph.
            unsafe { (api.cuGraphKernelNodeSetParams_v2)(node, &p) }
        })?;
        Ok(())
    }

    /// Instantiates an executable graph. A graph the driver does not permit (code 800) gives
    /// `GraphNotPermitted`.
    pub fn instantiate(&self) -> Result<GraphExec, Error> {
        let mut exec: CUgraphExec = std::ptr::null_mut();
        let g = self.handle;
        let started = Instant::now();
        let r = self.ctx.call_raw("cuGraphInstantiateWithFlags", |api| {
            // SAFETY: out-pointer to a local; the graph is live.
            unsafe { (api.cuGraphInstantiateWithFlags)(&mut exec, g, 0) }
        });
        usage::INSTANTIATE_CALLS.record(started);
        let r = r?;
        if r == tf_sys::code::NOT_PERMITTED {
            return Err(Error::GraphNotPermitted {
                call: "cuGraphInstantiateWithFlags",
            });
        }
        self.ctx.map("cuGraphInstantiateWithFlags", r)?;
        Ok(GraphExec {
            ctx: Arc::clone(&self.ctx),
            handle: exec,
            sources: self.sources.clone(),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        destroy_graph(&self.ctx, self.handle);
    }
}

fn zeroed_params() -> tf_sys::KernelNodeParams {
    tf_sys::KernelNodeParams {
        func: std::ptr::null_mut(),
        grid_x: 0,
        grid_y: 0,
        grid_z: 0,
        block_x: 0,
        block_y: 0,
        block_z: 0,
        shared_bytes: 0,
        params: std::ptr::null_mut(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

fn node_params(
    function: &Function,
    cfg: &LaunchConfig,
    pointers: &mut [*mut std::ffi::c_void],
) -> tf_sys::KernelNodeParams {
    let mut p = zeroed_params();
    p.func = function.raw();
    p.grid_x = cfg.grid.x;
    p.grid_y = cfg.grid.y;
    p.grid_z = cfg.grid.z;
    p.block_x = cfg.block.x;
    p.block_y = cfg.block.y;
    p.block_z = cfg.block.z;
    p.shared_bytes = cfg.shared_bytes;
    p.params = if pointers.is_empty() {
        std::ptr::null_mut()
    } else {
        pointers.as_mut_ptr()
    };
    p
}

/// What [`GraphExec::update`] decided (`CUgraphExecUpdateResult`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateResult {
    /// The executable now runs the new graph's parameters.
    Success,
    /// The driver refused; the executable is unchanged. The raw code says why
    /// (`tf_sys::exec_update_result`).
    Refused(u32),
}

/// An executable graph. Keeps the staging its captured uploads read alive.
pub struct GraphExec {
    ctx: Arc<ContextInner>,
    handle: CUgraphExec,
    sources: Option<CapturedSources<DriverBackend>>,
}

// SAFETY: executable handles may be used from any thread; calls bind the context first.
unsafe impl Send for GraphExec {}
// SAFETY: launching from several threads is serialized by the driver per stream.
unsafe impl Sync for GraphExec {}

impl fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphExec")
            .field("handle", &self.handle)
            .finish()
    }
}

impl GraphExec {
    /// The raw `CUgraphExec`.
    pub fn raw(&self) -> CUgraphExec {
        self.handle
    }

    /// Uploads the executable to the device so the first launch pays no setup.
    pub fn upload(&self, stream: &Stream) -> Result<(), Error> {
        let (e, s) = (self.handle, stream.raw());
        self.ctx.call("cuGraphUpload", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuGraphUpload)(e, s) }
        })?;
        Ok(())
    }

    /// Launches the executable on `stream`.
    pub fn launch(&self, stream: &Stream) -> Result<(), Error> {
        let (e, s) = (self.handle, stream.raw());
        let started = Instant::now();
        let launched = self.ctx.call("cuGraphLaunch", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuGraphLaunch)(e, s) }
        });
        usage::note_slow_call(started, || "graph launch".to_string());
        launched?;
        if let Some(sources) = &self.sources {
            // The captured staging must outlive this launch even if the executable is dropped.
            copy::hub().graph_launched(sources, stream.key())?;
        }
        Ok(())
    }

    /// Replaces kernel node `node`'s function, geometry and arguments in this executable.
    pub fn set_kernel_node(
        &mut self,
        node: GraphNode<'_>,
        function: &Function,
        cfg: &LaunchConfig,
        args: &Args,
    ) -> Result<(), Error> {
        cfg.validate(function.dynamic_shared_limit())?;
        args.validate()?;
        let mut pointers = args.pointers();
        let p = node_params(function, cfg, &mut pointers);
        let (e, node) = (self.handle, node.handle);
        self.ctx.call("cuGraphExecKernelNodeSetParams_v2", |api| {
            // SAFETY: `p` points at argument pointers that outlive the call; the node is one of
            // the graph this executable was instantiated from.
            unsafe { (api.cuGraphExecKernelNodeSetParams_v2)(e, node, &p) }
        })?;
        Ok(())
    }

    /// Updates the executable to `graph`'s parameters when the topology matches. A refusal is
    /// a verdict, not an error: the executable is unchanged.
    pub fn update(&mut self, graph: &Graph) -> Result<UpdateResult, Error> {
        let mut info = tf_sys::ExecUpdateResultInfo {
            result: 0,
            error_node: std::ptr::null_mut(),
            error_from_node: std::ptr::null_mut(),
        };
        let (e, g) = (self.handle, graph.handle);
        let r = self.ctx.call_raw("cuGraphExecUpdate_v2", |api| {
            // SAFETY: out-pointer to a local; both handles are live.
            unsafe { (api.cuGraphExecUpdate_v2)(e, g, &mut info) }
        })?;
        if r == tf_sys::code::SUCCESS && info.result == tf_sys::exec_update_result::SUCCESS {
            // The new graph's captured staging is now what the executable reads.
            if graph.sources.is_some() {
                self.sources = graph.sources.clone();
            }
            return Ok(UpdateResult::Success);
        }
        if info.result != tf_sys::exec_update_result::SUCCESS {
            return Ok(UpdateResult::Refused(info.result));
        }
        self.ctx.map("cuGraphExecUpdate_v2", r)?;
        Ok(UpdateResult::Refused(tf_sys::exec_update_result::ERROR))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let e = self.handle;
        self.ctx.release_call("cuGraphExecDestroy", |api| {
            // SAFETY: destroyed once; the handle came from instantiate.
            unsafe { (api.cuGraphExecDestroy)(e) }
        });
    }
}
