//! tf-copysource's backend over the driver, and the process's one copy source.
//!
//! The copy source is process-wide (its context table holds at most 64 contexts) so that an
//! open capture scope anywhere refuses synchronous uploads everywhere, as the spec requires.
//! Backend handles carry the id of the context they belong to; the backend finds that
//! context's call path in a registry, so every backend call goes through the same health
//! check as the rest of the runtime: a lost context is never called into, and staging blocks
//! it may still read are leaked rather than freed.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;
use tf_copysource::classes::PIPELINE_CHUNK_BYTES;
use tf_copysource::{Backend, CopySource, DeviceAddress, MarkerState};
use tf_sys::{CUevent, CUstream};

use crate::context::{ContextCore, ContextInner};
use crate::error::Error;
use crate::stream::Stream;

/// A context as the copy source names it: the runtime's context id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtxKey(pub u64);

/// A stream as the copy source names it: the raw handle and its context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey {
    pub(crate) raw: usize,
    pub(crate) ctx: u64,
}

impl StreamKey {
    pub(crate) fn new(raw: CUstream, ctx: u64) -> Self {
        StreamKey {
            raw: raw as usize,
            ctx,
        }
    }

    fn handle(self) -> CUstream {
        self.raw as CUstream
    }
}

/// A completion marker: an event without timing, recorded after a copy.
#[derive(Debug)]
pub struct Marker {
    raw: usize,
    ctx: u64,
}

/// A pinned host staging block (`cuMemHostAlloc`, PORTABLE). Dropping it without
/// `free_staging` leaks it, which is what a lost context needs.
#[derive(Debug)]
pub struct Staging {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the block is plain pinned host memory owned by this value; the copy source
// serializes writes to it and never writes while a copy reads it.
unsafe impl Send for Staging {}
// SAFETY: shared references never write.
unsafe impl Sync for Staging {}

/// The driver backend: routes each call to its context's checked call path.
#[derive(Default)]
pub struct DriverBackend {
    cores: RwLock<HashMap<u64, Arc<ContextCore>>>,
}

impl DriverBackend {
    fn alloc_staging_here(&self, context: CtxKey, len: usize) -> Result<Staging, tf_sys::Error> {
        let core = self.core(context.0, "cuMemHostAlloc")?;

        let mut ptr: *mut c_void = std::ptr::null_mut();
        core.call("cuMemHostAlloc", |api| {
            // SAFETY: out-pointer to a local; len > 0 (the copy source never asks for 0).
            unsafe { (api.cuMemHostAlloc)(&mut ptr, len, tf_sys::flags::HOST_ALLOC_PORTABLE) }
        })?;
        match NonNull::new(ptr.cast::<u8>()) {
            Some(ptr) => Ok(Staging { ptr, len }),
            None => Err(tf_sys::Error::OutOfMemory {
                call: "cuMemHostAlloc",
            }),
        }
    }

    fn core(&self, ctx: u64, call: &'static str) -> Result<Arc<ContextCore>, tf_sys::Error> {
        // A call for a context already torn down is refused before the driver.
        self.cores
            .read()
            .get(&ctx)
            .cloned()
            .ok_or_else(|| tf_sys::Error::Invalid {
                what: format!("{call}: the context was already released"),
            })
    }
}

impl Backend for DriverBackend {
    type Context = CtxKey;
    type Stream = StreamKey;
    type Marker = Marker;
    type Staging = Staging;
    type Error = tf_sys::Error;

    fn alloc_staging(&self, context: CtxKey, len: usize) -> Result<Staging, tf_sys::Error> {
        if CAPTURING_HERE.with(|c| c.get()) {
            // The driver refuses allocations on a thread that is capturing (thread-local or
            // global mode); under thread-local capture another thread may still allocate.
            return std::thread::scope(|scope| {
                match scope.spawn(|| self.alloc_staging_here(context, len)).join() {
                    Ok(result) => result,
                    Err(_) => Err(tf_sys::Error::Invalid {
                        what: "the staging allocation thread panicked".to_string(),
                    }),
                }
            });
        }
        self.alloc_staging_here(context, len)
    }

    fn staging_len(&self, block: &Staging) -> usize {
        block.len
    }

    fn write_staging(&self, block: &mut Staging, bytes: &[u8]) {
        let n = bytes.len().min(block.len);
        // SAFETY: the block holds `len` bytes; `n` is within it; the copy source guarantees no
        // copy reads the block now.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), block.ptr.as_ptr(), n) };
    }

    fn free_staging(&self, context: CtxKey, block: Staging) -> Result<(), tf_sys::Error> {
        let core = self.core(context.0, "cuMemFreeHost")?;
        core.call("cuMemFreeHost", |api| {
            // SAFETY: the block came from cuMemHostAlloc and no pending copy reads it.
            unsafe { (api.cuMemFreeHost)(block.ptr.as_ptr().cast::<c_void>()) }
        })
    }

    unsafe fn enqueue_copy(
        &self,
        stream: StreamKey,
        destination: DeviceAddress,
        source: &Staging,
        len: usize,
    ) -> Result<(), tf_sys::Error> {
        let core = self.core(stream.ctx, "cuMemcpyHtoDAsync_v2")?;
        let n = len.min(source.len);
        core.call("cuMemcpyHtoDAsync_v2", |api| {
            // SAFETY: the caller keeps `source` alive until the stream passes the copy; the
            // destination range was bounds-checked by the runtime.
            unsafe {
                (api.cuMemcpyHtoDAsync_v2)(
                    destination.0,
                    source.ptr.as_ptr().cast::<c_void>(),
                    n,
                    stream.handle(),
                )
            }
        })
    }

    unsafe fn enqueue_download(
        &self,
        stream: StreamKey,
        source: DeviceAddress,
        destination: &mut Staging,
        len: usize,
    ) -> Result<(), tf_sys::Error> {
        let core = self.core(stream.ctx, "cuMemcpyDtoHAsync_v2")?;
        let n = len.min(destination.len);
        let to = destination.ptr.as_ptr().cast::<c_void>();
        core.call("cuMemcpyDtoHAsync_v2", |api| {
            // SAFETY: the block holds at least `n` bytes and the caller leaves it untouched until
            // the stream passes the copy; the source range was bounds-checked by the runtime.
            unsafe { (api.cuMemcpyDtoHAsync_v2)(to, source.0, n, stream.handle()) }
        })
    }

    fn read_staging(&self, block: &Staging, out: &mut [MaybeUninit<u8>]) {
        let n = out.len().min(block.len);
        let (head, tail) = out.split_at_mut(n);
        // SAFETY: the block holds `len >= n` bytes and no download writes it now (the copy
        // source's guarantee); `head` is `n` writable bytes of the caller's buffer, which does not
        // overlap the pinned block.
        unsafe {
            std::ptr::copy_nonoverlapping(block.ptr.as_ptr(), head.as_mut_ptr().cast::<u8>(), n)
        };
        // Never reached (the copy source reads at most a block's length); keeps `out` initialized.
        for slot in tail {
            slot.write(0);
        }
    }

    fn record_marker(&self, stream: StreamKey) -> Result<Marker, tf_sys::Error> {
        let core = self.core(stream.ctx, "cuEventCreate")?;
        let mut event: CUevent = std::ptr::null_mut();
        core.call("cuEventCreate", |api| {
            // SAFETY: out-pointer to a local.
            unsafe { (api.cuEventCreate)(&mut event, tf_sys::flags::EVENT_DISABLE_TIMING) }
        })?;
        let marker = Marker {
            raw: event as usize,
            ctx: stream.ctx,
        };
        if let Err(e) = core.call("cuEventRecord", |api| {
            // SAFETY: both handles are live.
            unsafe { (api.cuEventRecord)(event, stream.handle()) }
        }) {
            self.destroy_marker(marker);
            return Err(e);
        }
        Ok(marker)
    }

    fn query_marker(&self, marker: &Marker) -> Result<MarkerState, tf_sys::Error> {
        let core = self.core(marker.ctx, "cuEventQuery")?;
        let r = core.call_raw("cuEventQuery", |api| {
            // SAFETY: the event is live until destroy_marker.
            unsafe { (api.cuEventQuery)(marker.raw as CUevent) }
        })?;
        if r == tf_sys::code::NOT_READY {
            return Ok(MarkerState::Pending);
        }
        core.map("cuEventQuery", r)?;
        Ok(MarkerState::Done)
    }

    fn wait_marker(&self, marker: &Marker) -> Result<(), tf_sys::Error> {
        let core = self.core(marker.ctx, "cuEventSynchronize")?;
        core.call("cuEventSynchronize", |api| {
            // SAFETY: the event is live until destroy_marker.
            unsafe { (api.cuEventSynchronize)(marker.raw as CUevent) }
        })
    }

    fn destroy_marker(&self, marker: Marker) {
        if let Ok(core) = self.core(marker.ctx, "cuEventDestroy_v2") {
            core.release_call("cuEventDestroy_v2", |api| {
                // SAFETY: destroyed once; the event came from cuEventCreate.
                unsafe { (api.cuEventDestroy_v2)(marker.raw as CUevent) }
            });
        }
    }

    fn synchronize_stream(&self, stream: StreamKey) -> Result<(), tf_sys::Error> {
        let core = self.core(stream.ctx, "cuStreamSynchronize")?;
        core.call("cuStreamSynchronize", |api| {
            // SAFETY: the stream handle is live (or null, the legacy default stream).
            unsafe { (api.cuStreamSynchronize)(stream.handle()) }
        })
    }

    fn query_stream(&self, stream: StreamKey) -> Result<MarkerState, tf_sys::Error> {
        let core = self.core(stream.ctx, "cuStreamQuery")?;
        let r = core.call_raw("cuStreamQuery", |api| {
            // SAFETY: the stream handle is live.
            unsafe { (api.cuStreamQuery)(stream.handle()) }
        })?;
        if r == tf_sys::code::NOT_READY {
            return Ok(MarkerState::Pending);
        }
        core.map("cuStreamQuery", r)?;
        Ok(MarkerState::Done)
    }

    fn copy_sync(
        &self,
        context: CtxKey,
        destination: DeviceAddress,
        source: &[u8],
    ) -> Result<(), tf_sys::Error> {
        let core = self.core(context.0, "cuMemcpyHtoD_v2")?;
        core.call("cuMemcpyHtoD_v2", |api| {
            // SAFETY: `source` is a live slice for the duration of the (synchronous) call; the
            // destination range was bounds-checked by the runtime.
            unsafe {
                (api.cuMemcpyHtoD_v2)(
                    destination.0,
                    source.as_ptr().cast::<c_void>(),
                    source.len(),
                )
            }
        })
    }
}

thread_local! {
    /// Set while this thread enqueues an upload on a stream it is capturing.
    static CAPTURING_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

static HUB: OnceLock<CopySource<DriverBackend>> = OnceLock::new();

/// The process's copy source.
pub(crate) fn hub() -> &'static CopySource<DriverBackend> {
    HUB.get_or_init(|| CopySource::new(DriverBackend::default()))
}

/// Counters of the process's copy source (pending uploads, staging bytes, open captures).
pub fn stats() -> tf_copysource::Stats {
    hub().stats()
}

pub(crate) fn register_core(core: &Arc<ContextCore>) {
    hub()
        .backend()
        .cores
        .write()
        .insert(core.id(), Arc::clone(core));
}

pub(crate) fn unregister_core(id: u64) {
    hub().backend().cores.write().remove(&id);
}

/// Synchronous upload: landed on return. Refused while any capture scope is open.
pub(crate) fn upload_sync(ctx: &ContextInner, dst: u64, bytes: &[u8]) -> Result<(), Error> {
    ctx.ensure_healthy("upload")?;
    // The legacy default stream: a synchronous copy from pageable memory may return before
    // the DMA lands, and synchronizing it waits for that copy.
    let null_stream = StreamKey::new(std::ptr::null_mut(), ctx.id());
    hub().upload_sync(ctx.copy_id, null_stream, DeviceAddress(dst), bytes)?;
    Ok(())
}

/// Synchronous download of more than one staging chunk: landed in `out` (every byte written)
/// when this returns `Ok`. Refused while any capture scope is open.
///
/// Ordered as `cuMemcpyDtoH_v2` is, after the work of the legacy default stream and of blocking
/// streams: the first chunk is that very call, straight into `out`; the rest is pipelined through
/// pinned staging ([`CopySource::download_staged`]) on the legacy default stream, behind it.
pub(crate) fn download_sync(
    ctx: &ContextInner,
    src: u64,
    out: &mut [MaybeUninit<u8>],
) -> Result<(), Error> {
    const OPERATION: &str = "synchronous download";
    ctx.ensure_healthy("download")?;
    hub().check_no_capture(OPERATION)?;
    let (first, rest) = out.split_at_mut(out.len().min(PIPELINE_CHUNK_BYTES));
    let (to, n) = (first.as_mut_ptr().cast::<c_void>(), first.len());
    ctx.call("cuMemcpyDtoH_v2", |api| {
        // SAFETY: `first` is `n` writable bytes of the caller's exclusive buffer; the source
        // range was bounds-checked by the caller against its view.
        unsafe { (api.cuMemcpyDtoH_v2)(to, src, n) }
    })?;
    if rest.is_empty() {
        return Ok(());
    }
    let null_stream = StreamKey::new(std::ptr::null_mut(), ctx.id());
    hub().download_staged(
        ctx.copy_id,
        null_stream,
        DeviceAddress(src + n as u64),
        rest,
        OPERATION,
    )?;
    Ok(())
}

/// Download through pinned staging on `stream` (ordered after its work), landed in `out` when
/// this returns `Ok`. Refused while any capture scope is open.
pub(crate) fn download_on_stream(
    ctx: &ContextInner,
    stream: &Stream,
    src: u64,
    out: &mut [MaybeUninit<u8>],
) -> Result<(), Error> {
    ctx.ensure_healthy("download_async")?;
    hub().download_staged(
        ctx.copy_id,
        stream.key(),
        DeviceAddress(src),
        out,
        "download_async",
    )?;
    Ok(())
}

/// True while a capture scope is open anywhere in the process.
pub(crate) fn capture_open() -> bool {
    hub().capture_open()
}

/// Asynchronous upload through private pinned staging.
pub(crate) fn upload_async(
    ctx: &ContextInner,
    stream: &Stream,
    dst: u64,
    bytes: &[u8],
) -> Result<(), Error> {
    ctx.ensure_healthy("upload_async")?;
    let capturing = stream.is_capturing()?;
    CAPTURING_HERE.with(|c| c.set(capturing));
    let result = hub().upload_async(ctx.copy_id, stream.key(), DeviceAddress(dst), bytes);
    CAPTURING_HERE.with(|c| c.set(false));
    result?;
    Ok(())
}
