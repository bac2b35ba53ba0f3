//! The device a pipeline runs on: one context and one blocking stream, opened once by the pipeline and
//! borrowed by every GPU component it loads (text encoder, DiT, decoders).
//!
//! The stream is blocking (ordered with the legacy default stream), so a synchronous copy on the host waits for
//! the kernels queued before it and the kernels queued after it wait for the copy; the components never create
//! a stream of their own, so one request's work runs in one order from the prompt to the decoded pixels. A
//! component loaded on its own (`load_on(ctx, ..)`, the tools and tests) makes a [`GpuDevice`] of its own
//! through [`GpuDevice::on`], a pipeline of one.
//!
//! ```no_run
//! # fn demo() -> Result<(), tf_cuda::Error> {
//! use tf_engines::nn::gpu::GpuDevice;
//! let device = GpuDevice::open()?;
//! let same = device.clone(); // a second component borrows the same context and stream
//! assert!(std::sync::Arc::ptr_eq(device.stream(), same.stream()));
//! # Ok(()) }
//! ```

use std::sync::Arc;

use tf_cuda::{Context, Error, Stream};

/// A context and the blocking stream every component on it runs on. Cloning shares both.
#[derive(Clone)]
pub struct GpuDevice {
    ctx: Context,
    stream: Arc<Stream>,
}

impl GpuDevice {
    /// Opens the driver (as [`tf_cuda::open_driver`] finds it), a context on device 0 and its blocking stream.
    pub fn open() -> Result<GpuDevice, Error> {
        let driver = tf_cuda::open_driver()?;
        let ctx = Context::new(driver, 0)?;
        GpuDevice::on(&ctx)
    }

    /// A new blocking stream on `ctx`.
    pub fn on(ctx: &Context) -> Result<GpuDevice, Error> {
        let stream = Stream::new(ctx, true)?;
        Ok(GpuDevice {
            ctx: ctx.clone(),
            stream: Arc::new(stream),
        })
    }

    /// The device of an existing stream (a multi-GPU rank's communicator stream, so that its collectives and
    /// every component's kernels run in one order).
    pub fn with_stream(stream: Arc<Stream>) -> GpuDevice {
        GpuDevice {
            ctx: stream.context(),
            stream,
        }
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The stream every component runs on.
    pub fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// Waits until everything queued on the device's context has finished: a component's uploads, so that its
    /// load time is the whole load.
    pub fn wait_for_uploads(&self) -> Result<(), Error> {
        self.ctx.synchronize()
    }
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}
