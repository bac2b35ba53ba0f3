//! Streams (ordered queues of GPU work) and events (points in a stream).
//!
//! Stream synchronize, query and destroy go through the copy source, so staging of finished
//! async uploads is released as soon as the stream is proven past it.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::sync::Arc;

use tf_copysource::MarkerState;
use tf_sys::{CUevent, CUstream};

use crate::context::{Context, ContextInner};
use crate::copy::{self, StreamKey};
use crate::error::Error;
use crate::launch::{describe, Args, LaunchConfig};
use crate::module::Function;

/// Scheduling priority of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Priority {
    /// Priority 0.
    #[default]
    Default,
    /// The most urgent priority the context allows.
    Highest,
    /// The least urgent priority the context allows.
    Lowest,
    /// A raw priority (lower numbers run first; the driver clamps it to the context's range).
    Raw(i32),
}

/// An ordered queue of GPU work in one context.
pub struct Stream {
    pub(crate) ctx: Arc<ContextInner>,
    handle: CUstream,
    priority: i32,
}

// SAFETY: a CUstream may be used from any thread; calls bind the context first.
unsafe impl Send for Stream {}
// SAFETY: every method either only reads the handle or goes through the driver, which
// serializes work submitted to one stream.
unsafe impl Sync for Stream {}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("handle", &self.handle)
            .field("priority", &self.priority)
            .finish()
    }
}

impl Stream {
    /// A stream at default priority. `blocking: true` orders it with the legacy default stream
    /// (and so with synchronous copies), which is what engines use; `false` makes it
    /// non-blocking.
    pub fn new(ctx: &Context, blocking: bool) -> Result<Stream, Error> {
        Stream::with_priority(ctx, blocking, Priority::Default)
    }

    /// A stream at `priority`.
    pub fn with_priority(
        ctx: &Context,
        blocking: bool,
        priority: Priority,
    ) -> Result<Stream, Error> {
        let inner = Arc::clone(&ctx.inner);
        let flags: c_uint = if blocking {
            tf_sys::flags::STREAM_DEFAULT
        } else {
            tf_sys::flags::STREAM_NON_BLOCKING
        };
        let value: c_int = match priority {
            Priority::Default => 0,
            Priority::Raw(p) => p,
            Priority::Highest => ctx.stream_priority_range()?.1,
            Priority::Lowest => ctx.stream_priority_range()?.0,
        };
        let mut handle: CUstream = std::ptr::null_mut();
        if value == 0 {
            inner.call("cuStreamCreate", |api| {
                // SAFETY: out-pointer to a local.
                unsafe { (api.cuStreamCreate)(&mut handle, flags) }
            })?;
        } else {
            inner.call("cuStreamCreateWithPriority", |api| {
                // SAFETY: out-pointer to a local.
                unsafe { (api.cuStreamCreateWithPriority)(&mut handle, flags, value) }
            })?;
        }
        Ok(Stream {
            ctx: inner,
            handle,
            priority: value,
        })
    }

    /// The raw `CUstream` (for libraries such as cuBLASLt that take it).
    pub fn raw(&self) -> CUstream {
        self.handle
    }

    /// The priority the stream was created with (as requested; the driver may clamp it).
    pub fn priority(&self) -> i32 {
        self.priority
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.ctx),
        }
    }

    pub(crate) fn key(&self) -> StreamKey {
        StreamKey::new(self.handle, self.ctx.id())
    }

    pub(crate) fn same_context(&self, ctx: &ContextInner, what: &str) -> Result<(), Error> {
        if self.ctx.id() != ctx.id() {
            return Err(Error::invalid(format!(
                "{what}: the stream belongs to another context than the buffer"
            )));
        }
        Ok(())
    }

    /// Waits for everything enqueued so far, then releases the staging of finished uploads.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.ctx.ensure_healthy("cuStreamSynchronize")?;
        copy::hub().synchronize(self.key())?;
        Ok(())
    }

    /// True when everything enqueued so far has finished (never blocks).
    pub fn query(&self) -> Result<bool, Error> {
        self.ctx.ensure_healthy("cuStreamQuery")?;
        Ok(copy::hub().query(self.key())? == MarkerState::Done)
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<(), Error> {
        let (s, e) = (self.handle, event.handle);
        self.ctx.call("cuStreamWaitEvent", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuStreamWaitEvent)(s, e, 0) }
        })?;
        Ok(())
    }

    /// Launches `function` with `cfg` and `args` on this stream.
    ///
    /// The geometry and argument size are validated first; a driver failure names the kernel,
    /// grid, block and shared bytes.
    ///
    /// # Safety
    ///
    /// The kernel dereferences the raw device addresses in `args` asynchronously, which nothing here can
    /// check. The caller guarantees that every address the kernel reads or writes (each pushed address
    /// and whatever extent the kernel derives from it and the other arguments) lies inside allocations
    /// of this stream's context that are alive now, when the work is enqueued. They must stay allocated
    /// until the stream has passed this work; a [`crate::DeviceBuffer`] guarantees that part itself,
    /// because its `Drop` synchronizes the context before it frees. Memory not owned by a
    /// `DeviceBuffer` (a VMM arena mapping, memory of another library) must be kept alive by the
    /// caller until the stream is synchronized past the launch.
    pub unsafe fn launch(
        &self,
        function: &Function,
        cfg: &LaunchConfig,
        args: &Args,
    ) -> Result<(), Error> {
        cfg.validate(function.dynamic_shared_limit())?;
        args.validate()?;
        if function.context_id() != self.ctx.id() {
            return Err(Error::invalid(format!(
                "{}: the kernel was loaded in another context than the stream",
                describe(function.name(), cfg)
            )));
        }
        let mut pointers = args.pointers();
        let params = if pointers.is_empty() {
            std::ptr::null_mut()
        } else {
            pointers.as_mut_ptr()
        };
        let (f, s) = (function.raw(), self.handle);
        let started = std::time::Instant::now();
        let result = self.ctx.call("cuLaunchKernel", |api| {
            // SAFETY: `params` points at one pointer per argument into `args`, which outlives
            // the call (the driver copies argument values before returning); the geometry was
            // validated; the function and stream are live handles of this context.
            unsafe {
                (api.cuLaunchKernel)(
                    f,
                    cfg.grid.x,
                    cfg.grid.y,
                    cfg.grid.z,
                    cfg.block.x,
                    cfg.block.y,
                    cfg.block.z,
                    cfg.shared_bytes,
                    s,
                    params,
                    std::ptr::null_mut(),
                )
            }
        });
        crate::usage::note_slow_call(started, || format!("kernel {}", function.name()));
        match result {
            Ok(()) => Ok(()),
            Err(e @ tf_sys::Error::ContextLost { .. }) => Err(e.into()),
            Err(source) => Err(Error::LaunchFailed {
                kernel: function.driver_name(),
                grid: cfg.grid,
                block: cfg.block,
                shared_bytes: cfg.shared_bytes,
                source: Box::new(source),
            }),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Pending staging of this stream stays (with its markers) until proven done.
        copy::hub().retire_stream(self.key());
        let s = self.handle;
        self.ctx.release_call("cuStreamDestroy_v2", |api| {
            // SAFETY: destroyed once; the handle came from cuStreamCreate*.
            unsafe { (api.cuStreamDestroy_v2)(s) }
        });
    }
}

/// A point in a stream: for ordering between streams and for timing.
pub struct Event {
    ctx: Arc<ContextInner>,
    handle: CUevent,
    timing: bool,
}

// SAFETY: a CUevent may be used from any thread; calls bind the context first.
unsafe impl Send for Event {}
// SAFETY: as for Stream.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("handle", &self.handle)
            .field("timing", &self.timing)
            .finish()
    }
}

impl Event {
    /// A new event; `timing: false` makes record/wait cheaper.
    pub fn new(ctx: &Context, timing: bool) -> Result<Event, Error> {
        let inner = Arc::clone(&ctx.inner);
        let flags = if timing {
            tf_sys::flags::EVENT_DEFAULT
        } else {
            tf_sys::flags::EVENT_DISABLE_TIMING
        };
        let mut handle: CUevent = std::ptr::null_mut();
        inner.call("cuEventCreate", |api| {
            // SAFETY: out-pointer to a local.
            unsafe { (api.cuEventCreate)(&mut handle, flags) }
        })?;
        Ok(Event {
            ctx: inner,
            handle,
            timing,
        })
    }

    /// The raw `CUevent`.
    pub fn raw(&self) -> CUevent {
        self.handle
    }

    /// Records the event after the work enqueued so far on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), Error> {
        let (e, s) = (self.handle, stream.handle);
        self.ctx.call("cuEventRecord", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuEventRecord)(e, s) }
        })?;
        Ok(())
    }

    /// Records with the external flag: inside a capture this becomes an event-record node, so a
    /// stream outside the graph that waits on the event waits for that point of each launch.
    /// Outside a capture this is a plain record (the driver refuses the flag there).
    pub fn record_external(&self, stream: &Stream) -> Result<(), Error> {
        if !stream.is_capturing()? {
            return self.record(stream);
        }
        let (e, s) = (self.handle, stream.handle);
        self.ctx.call("cuEventRecordWithFlags", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuEventRecordWithFlags)(e, s, tf_sys::flags::EVENT_RECORD_EXTERNAL) }
        })?;
        Ok(())
    }

    /// Blocks until the recorded work has finished.
    pub fn synchronize(&self) -> Result<(), Error> {
        let e = self.handle;
        self.ctx.call("cuEventSynchronize", |api| {
            // SAFETY: the handle is live.
            unsafe { (api.cuEventSynchronize)(e) }
        })?;
        Ok(())
    }

    /// True when the recorded work has finished (never blocks).
    pub fn query(&self) -> Result<bool, Error> {
        let e = self.handle;
        let r = self.ctx.call_raw("cuEventQuery", |api| {
            // SAFETY: the handle is live.
            unsafe { (api.cuEventQuery)(e) }
        })?;
        if r == tf_sys::code::NOT_READY {
            return Ok(false);
        }
        self.ctx.map("cuEventQuery", r)?;
        Ok(true)
    }

    /// Milliseconds between `start` and `end` (both recorded, both with timing; ~0.5 us
    /// resolution).
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32, Error> {
        if !start.timing || !end.timing {
            return Err(Error::invalid(
                "Event::elapsed_ms needs two events created with timing: true",
            ));
        }
        let mut ms = 0f32;
        let (a, b) = (start.handle, end.handle);
        start.ctx.call("cuEventElapsedTime", |api| {
            // SAFETY: out-pointer to a local; both handles are live.
            unsafe { (api.cuEventElapsedTime)(&mut ms, a, b) }
        })?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let e = self.handle;
        self.ctx.release_call("cuEventDestroy_v2", |api| {
            // SAFETY: destroyed once; the handle came from cuEventCreate.
            unsafe { (api.cuEventDestroy_v2)(e) }
        });
    }
}
