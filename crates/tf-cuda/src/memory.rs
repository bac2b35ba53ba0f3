//! Device memory and pinned host memory, each owned by one value; borrowed views; copies and
//! fills, blocking or on a stream.
//!
//! - [`DeviceBuffer`] owns device memory: `cuMemAlloc_v2` (256-byte aligned) or the installed
//!   allocation hook; zero bytes allocate nothing and hold address 0.
//! - [`DeviceView`] / [`DeviceViewMut`] borrow a range of a buffer. They carry a lifetime, have
//!   no `Drop` and no free: a view can never release memory it does not own.
//! - [`HostBuffer`] owns pinned, device-mapped host memory (`cuMemHostAlloc` with DEVICEMAP).
//! - Host-to-device copies go through the copy source: synchronous uploads copy privately and
//!   return once the bytes landed; async uploads copy into private pinned staging, so the
//!   caller's slice may be reused as soon as the call returns.
//! - Device-to-host copies above one staging chunk (8 MiB) are pipelined through the copy
//!   source's pinned staging pool (DMA into pinned blocks, host threads copy them out); smaller
//!   ones are a single driver copy.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{size_of, MaybeUninit};
use std::sync::Arc;

use tf_copysource::classes::PIPELINE_CHUNK_BYTES;

use crate::context::{Context, ContextInner};
use crate::error::Error;
use crate::launch::Pod;
use crate::stream::Stream;
use crate::usage::{self, allocation_hook, DEVICE, HOST};

/// Where a buffer's memory came from (and so where it goes back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// Zero bytes: nothing was allocated.
    Empty,
    Driver,
    Hook,
}

/// Device memory owned by this value, freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<ContextInner>,
    addr: u64,
    len: usize,
    origin: Origin,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("origin", &self.origin)
            .finish()
    }
}

fn checked_range(len: usize, offset: usize, n: usize, what: &str) -> Result<(), Error> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::invalid(format!(
            "{what}: range {offset}..{offset}+{n} is outside the {len}-byte buffer"
        ))),
    }
}

fn elems_bytes<T>(n: usize, what: &str) -> Result<usize, Error> {
    n.checked_mul(size_of::<T>())
        .ok_or_else(|| Error::invalid(format!("{what}: {n} elements overflow the address space")))
}

fn as_bytes<T: Pod>(values: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), so its bytes are initialized; the length is exact.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

impl DeviceBuffer {
    /// `len` bytes of device memory, 256-byte aligned. Zero bytes allocate nothing (address 0,
    /// no driver call).
    pub fn alloc(ctx: &Context, len: usize) -> Result<DeviceBuffer, Error> {
        let inner = Arc::clone(&ctx.inner);
        if len == 0 {
            return Ok(DeviceBuffer {
                ctx: inner,
                addr: 0,
                len: 0,
                origin: Origin::Empty,
            });
        }
        inner.ensure_healthy("cuMemAlloc_v2")?;
        let bytes = len as u64;
        let limit = usage::device_limit();
        if !DEVICE.try_hold(bytes, limit) {
            return Err(Error::OutOfMemory {
                call: "DeviceBuffer::alloc",
                bytes,
                why: format!(
                    "the process allocation limit of {} B would be passed; {} B are held",
                    limit.unwrap_or(u64::MAX),
                    usage::usage().device
                ),
            });
        }
        if let Some(hook) = allocation_hook() {
            if let Some(addr) = hook.alloc(len) {
                if addr.is_multiple_of(256) && addr != 0 {
                    return Ok(DeviceBuffer {
                        ctx: inner,
                        addr,
                        len,
                        origin: Origin::Hook,
                    });
                }
                // A misaligned answer breaks the 256-byte promise: hand it back, use the driver.
                hook.free(addr, len);
            }
        }
        let mut addr = 0u64;
        let started = std::time::Instant::now();
        let result = inner.call("cuMemAlloc_v2", |api| {
            // SAFETY: out-pointer to a local; len > 0.
            unsafe { (api.cuMemAlloc_v2)(&mut addr, len) }
        });
        usage::ALLOC_CALLS.record(started);
        match result {
            Ok(()) => Ok(DeviceBuffer {
                ctx: inner,
                addr,
                len,
                origin: Origin::Driver,
            }),
            Err(e) => {
                DEVICE.cancel(bytes);
                Err(match e {
                    tf_sys::Error::OutOfMemory { call } => Error::OutOfMemory {
                        call,
                        bytes,
                        why: "the device has no room".into(),
                    },
                    e => e.into(),
                })
            }
        }
    }

    /// Room for `n` values of `T`.
    pub fn alloc_elems<T: Pod>(ctx: &Context, n: usize) -> Result<DeviceBuffer, Error> {
        DeviceBuffer::alloc(ctx, elems_bytes::<T>(n, "DeviceBuffer::alloc_elems")?)
    }

    /// A buffer holding a copy of `bytes` (synchronous upload: landed on return).
    pub fn from_bytes(ctx: &Context, bytes: &[u8]) -> Result<DeviceBuffer, Error> {
        let mut b = DeviceBuffer::alloc(ctx, bytes.len())?;
        b.upload(0, bytes)?;
        Ok(b)
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: Pod>(ctx: &Context, values: &[T]) -> Result<DeviceBuffer, Error> {
        DeviceBuffer::from_bytes(ctx, as_bytes(values))
    }

    /// The device address (0 for an empty buffer).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whole `T` values that fit.
    pub fn len_elems<T>(&self) -> usize {
        self.len / size_of::<T>().max(1)
    }

    /// True when the allocation hook (not the driver) owns the memory.
    pub fn from_hook(&self) -> bool {
        self.origin == Origin::Hook
    }

    /// A read-only view of the whole buffer.
    pub fn view(&self) -> DeviceView<'_> {
        DeviceView {
            ctx: &self.ctx,
            addr: self.addr,
            len: self.len,
            _owner: PhantomData,
        }
    }

    /// A writable view of the whole buffer.
    pub fn view_mut(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ctx: &self.ctx,
            addr: self.addr,
            len: self.len,
            _owner: PhantomData,
        }
    }

    /// A read-only view of `len` bytes from `offset`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView<'_>, Error> {
        self.view().slice(offset, len)
    }

    /// A writable view of `len` bytes from `offset`.
    pub fn slice_mut(&mut self, offset: usize, len: usize) -> Result<DeviceViewMut<'_>, Error> {
        self.view_mut().into_slice(offset, len)
    }

    /// The device address `offset` bytes in (`offset == len` allowed, as an end address).
    pub fn at(&self, offset: usize) -> Result<u64, Error> {
        self.view().at(offset)
    }

    /// Synchronous upload: returns once the bytes are on the device.
    pub fn upload(&mut self, offset: usize, bytes: &[u8]) -> Result<(), Error> {
        self.view_mut().upload(offset, bytes)
    }

    /// Synchronous upload of `values` at element index `index`.
    pub fn upload_elems<T: Pod>(&mut self, index: usize, values: &[T]) -> Result<(), Error> {
        let offset = elems_bytes::<T>(index, "DeviceBuffer::upload_elems")?;
        self.view_mut().upload(offset, as_bytes(values))
    }

    /// Asynchronous upload on `stream` through private pinned staging: `bytes` may be changed
    /// or dropped as soon as this returns.
    pub fn upload_async(
        &mut self,
        offset: usize,
        bytes: &[u8],
        stream: &Stream,
    ) -> Result<(), Error> {
        self.view_mut().upload_async(offset, bytes, stream)
    }

    /// Synchronous download into `out` (see [`DeviceView::download`]).
    pub fn download(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        self.view().download(offset, out)
    }

    /// The whole buffer as `T` values.
    pub fn to_vec<T: Pod>(&self) -> Result<Vec<T>, Error> {
        self.view().to_vec()
    }

    /// Device-to-device copy of `src` to `offset`, on `stream` or blocking.
    pub fn copy_from(
        &mut self,
        offset: usize,
        src: DeviceView<'_>,
        stream: Option<&Stream>,
    ) -> Result<(), Error> {
        self.view_mut().copy_from(offset, src, stream)
    }

    /// Sets every byte to `value`.
    pub fn fill_u8(&mut self, value: u8, stream: Option<&Stream>) -> Result<(), Error> {
        self.view_mut().fill_u8(value, stream)
    }

    /// Sets every 32-bit word to `value` (length must be a multiple of 4).
    pub fn fill_u32(&mut self, value: u32, stream: Option<&Stream>) -> Result<(), Error> {
        self.view_mut().fill_u32(value, stream)
    }
}

/// Freeing waits for the device first. Invariant: a `DeviceBuffer` is released only after every piece of work
/// queued in its context has finished (`cuCtxSynchronize`, then `cuMemFree_v2`, or the allocation hook's `free` for
/// memory the hook gave out), so a kernel, copy or GEMM that
/// was enqueued on any stream of the context while the memory was alive never touches freed or reallocated memory.
/// This is what lets launches over device addresses (`Stream::launch`, `CublasLt::matmul`) state their safety
/// contract as "alive when enqueued". A lost context calls nothing: the memory is leaked, never freed.
impl DeviceBuffer {
    /// Waits for every piece of work queued in the buffer's context (see the invariant on `Drop`); false when the
    /// context is lost (before or during the wait), in which case the memory must be leaked, never reused. A
    /// failed wait is not ours to report from `Drop`: a sticky fault marks the context lost.
    fn wait_before_release(&self) -> bool {
        if self.ctx.lost_code().is_some() {
            return false;
        }
        self.ctx.release_call("cuCtxSynchronize", |api| {
            // SAFETY: no arguments; `release_call` makes this buffer's context current first.
            unsafe { (api.cuCtxSynchronize)() }
        });
        self.ctx.lost_code().is_none()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        match self.origin {
            Origin::Empty => {}
            Origin::Hook => {
                // The hook may hand these bytes to the next allocation at once: queued work must be done first.
                // Leaked on a lost context (its bytes stay counted as held).
                if !self.wait_before_release() {
                    return;
                }
                if let Some(hook) = allocation_hook() {
                    hook.free(self.addr, self.len);
                }
                DEVICE.release(self.len as u64);
            }
            Origin::Driver => {
                let started = std::time::Instant::now();
                // Leaked on a lost context: it cannot free; the bytes stay counted as held.
                if !self.wait_before_release() {
                    return;
                }
                let addr = self.addr;
                self.ctx.release_call("cuMemFree_v2", |api| {
                    // SAFETY: the address came from cuMemAlloc_v2 in this context and is freed once.
                    unsafe { (api.cuMemFree_v2)(addr) }
                });
                usage::FREE_CALLS.record(started);
                DEVICE.release(self.len as u64);
            }
        }
    }
}

/// A read-only borrowed range of device memory. Never frees anything.
#[derive(Clone, Copy)]
pub struct DeviceView<'a> {
    ctx: &'a Arc<ContextInner>,
    addr: u64,
    len: usize,
    _owner: PhantomData<&'a DeviceBuffer>,
}

impl fmt::Debug for DeviceView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceView({:#x}, {} B)", self.addr, self.len)
    }
}

impl<'a> DeviceView<'a> {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range of this view.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView<'a>, Error> {
        checked_range(self.len, offset, len, "DeviceView::slice")?;
        Ok(DeviceView {
            ctx: self.ctx,
            addr: self.addr + offset as u64,
            len,
            _owner: PhantomData,
        })
    }

    /// The address `offset` bytes in (`offset == len` allowed).
    pub fn at(&self, offset: usize) -> Result<u64, Error> {
        checked_range(self.len, offset, 0, "DeviceView::at")?;
        Ok(self.addr + offset as u64)
    }

    /// Blocking download of `out.len()` bytes from `offset`. Ordered after work on the legacy
    /// default stream and blocking streams; synchronize a non-blocking stream first.
    ///
    /// Up to one staging chunk (8 MiB) this is one `cuMemcpyDtoH_v2`. Larger downloads copy their
    /// first chunk that way (which orders them) and pipeline the rest through the copy source's
    /// pinned staging on the legacy default stream (the DMA of later chunks overlaps the host copy
    /// of earlier ones into `out`, see `CopySource::download_staged`); they are refused while a
    /// capture scope is open. On an error the contents of `out` are unspecified.
    pub fn download(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        // SAFETY: `out` is a live exclusive host slice of exactly `out.len()` bytes, and only
        // initialized bytes are written into it.
        unsafe { self.download_raw(offset, out.as_mut_ptr(), out.len()) }
    }

    /// Blocking download of `len` bytes from `offset` into raw host memory, which need not be
    /// initialized (only initialized bytes are written; all `len` of them on `Ok`).
    ///
    /// # Safety
    /// `out` must be valid for writes of `len` bytes and not accessed by anything else until
    /// this returns.
    unsafe fn download_raw(&self, offset: usize, out: *mut u8, len: usize) -> Result<(), Error> {
        checked_range(self.len, offset, len, "download")?;
        if len == 0 {
            return Ok(());
        }
        let src = self.addr + offset as u64;
        if len > PIPELINE_CHUNK_BYTES {
            // SAFETY: the caller's contract: `out` is valid for writes of `len` bytes and exclusively
            // ours until this returns; `MaybeUninit<u8>` makes no claim about the bytes already there.
            let out = unsafe { std::slice::from_raw_parts_mut(out.cast::<MaybeUninit<u8>>(), len) };
            return crate::copy::download_sync(self.ctx, src, out);
        }
        self.ctx.call("cuMemcpyDtoH_v2", |api| {
            // SAFETY: the caller's contract covers `out`; the source range was bounds-checked
            // against this view.
            unsafe { (api.cuMemcpyDtoH_v2)(out.cast::<c_void>(), src, len) }
        })?;
        Ok(())
    }

    /// Download on `stream`, ordered after the work already enqueued there.
    ///
    /// Up to one staging chunk (8 MiB), or while a capture scope is open or `stream` is being
    /// captured, this is one `cuMemcpyDtoHAsync_v2` straight into `out`. Larger downloads go
    /// through the copy source's pipelined pinned staging on `stream` and have landed in `out`
    /// when this returns: the driver's own copy into pageable memory also returns only once
    /// complete, and the pinned pipeline is faster. The contract below holds either way.
    /// For a copy that returns at once and overlaps host work, download into pinned memory with
    /// [`DeviceView::download_async_pinned`].
    ///
    /// # Safety
    /// The GPU may write `out` after this returns: `out` must stay alive and untouched until the
    /// stream is synchronized (or an event recorded after this copy has completed).
    pub unsafe fn download_async(
        &self,
        offset: usize,
        out: &mut [u8],
        stream: &Stream,
    ) -> Result<(), Error> {
        checked_range(self.len, offset, out.len(), "download_async")?;
        if out.is_empty() {
            return Ok(());
        }
        // A stream of another context would read an address of the wrong context.
        stream.same_context(self.ctx, "download_async")?;
        let src = self.addr + offset as u64;
        if out.len() > PIPELINE_CHUNK_BYTES
            && !crate::copy::capture_open()
            && !stream.is_capturing()?
        {
            // SAFETY: `out` is a live exclusive slice; viewing it as `MaybeUninit<u8>` is sound
            // because only initialized bytes are written through it.
            let staged = unsafe {
                std::slice::from_raw_parts_mut(
                    out.as_mut_ptr().cast::<MaybeUninit<u8>>(),
                    out.len(),
                )
            };
            return crate::copy::download_on_stream(self.ctx, stream, src, staged);
        }
        let s = stream.raw();
        self.ctx.call("cuMemcpyDtoHAsync_v2", |api| {
            // SAFETY: bounds checked; the caller keeps `out` alive until the stream passes the copy.
            unsafe {
                (api.cuMemcpyDtoHAsync_v2)(out.as_mut_ptr().cast::<c_void>(), src, out.len(), s)
            }
        })?;
        Ok(())
    }

    /// Asynchronous download straight into pinned memory (`len` bytes from `offset` to
    /// `dst_offset` of `dst`), with no staging: returns once the copy is enqueued.
    ///
    /// # Safety
    /// The GPU writes `dst` after this returns: `dst` must stay alive and untouched (not read,
    /// written or freed) until the stream passes the copy. Inside a capture the graph writes it
    /// at every replay.
    pub unsafe fn download_async_pinned(
        &self,
        offset: usize,
        dst: &mut HostBuffer,
        dst_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<(), Error> {
        checked_range(self.len, offset, len, "download_async_pinned (source)")?;
        checked_range(
            dst.len(),
            dst_offset,
            len,
            "download_async_pinned (destination)",
        )?;
        if len == 0 {
            return Ok(());
        }
        stream.same_context(self.ctx, "download_async_pinned")?;
        let src = self.addr + offset as u64;
        // SAFETY: in bounds of the pinned block (checked above).
        let to = unsafe { dst.ptr.add(dst_offset) };
        let s = stream.raw();
        self.ctx.call("cuMemcpyDtoHAsync_v2", |api| {
            // SAFETY: ranges checked; the caller keeps `dst` alive and untouched until the stream
            // passes the copy.
            unsafe { (api.cuMemcpyDtoHAsync_v2)(to.cast::<c_void>(), src, len, s) }
        })?;
        Ok(())
    }

    /// The whole view as `T` values (trailing bytes that do not fill a `T` are ignored).
    pub fn to_vec<T: Pod>(&self) -> Result<Vec<T>, Error> {
        let n = self.len / size_of::<T>().max(1);
        let bytes = elems_bytes::<T>(n, "DeviceView::to_vec")?;
        let mut out: Vec<T> = Vec::with_capacity(n);
        // The spare capacity stays `MaybeUninit`: no `&mut [u8]` is ever made over it; the driver
        // writes through a raw pointer.
        let spare = out.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        // SAFETY: the spare capacity holds n values of T = `bytes` bytes, exclusively ours.
        unsafe { self.download_raw(0, spare, bytes)? };
        // SAFETY: the download wrote every byte of the first n values; T is Pod, so any bytes
        // are a valid T.
        unsafe { out.set_len(n) };
        Ok(out)
    }
}

/// A writable borrowed range of device memory. Never frees anything.
pub struct DeviceViewMut<'a> {
    ctx: &'a Arc<ContextInner>,
    addr: u64,
    len: usize,
    _owner: PhantomData<&'a mut DeviceBuffer>,
}

impl fmt::Debug for DeviceViewMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceViewMut({:#x}, {} B)", self.addr, self.len)
    }
}

impl<'a> DeviceViewMut<'a> {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty view.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A read-only view of the same range.
    pub fn as_view(&self) -> DeviceView<'_> {
        DeviceView {
            ctx: self.ctx,
            addr: self.addr,
            len: self.len,
            _owner: PhantomData,
        }
    }

    /// A shorter borrow of the same range (to pass the view on and use it again).
    pub fn reborrow(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ctx: self.ctx,
            addr: self.addr,
            len: self.len,
            _owner: PhantomData,
        }
    }

    /// Two writable views, `..mid` and `mid..`, consuming this one (disjoint, so both may be held at once:
    /// e.g. the per-item receive ranges of one grouped collective).
    pub fn split_at(self, mid: usize) -> Result<(DeviceViewMut<'a>, DeviceViewMut<'a>), Error> {
        checked_range(self.len, 0, mid, "DeviceViewMut::split_at")?;
        let head = DeviceViewMut {
            ctx: self.ctx,
            addr: self.addr,
            len: mid,
            _owner: PhantomData,
        };
        let tail = DeviceViewMut {
            ctx: self.ctx,
            addr: self.addr + mid as u64,
            len: self.len - mid,
            _owner: PhantomData,
        };
        Ok((head, tail))
    }

    /// A sub-range, consuming this view.
    pub fn into_slice(self, offset: usize, len: usize) -> Result<DeviceViewMut<'a>, Error> {
        checked_range(self.len, offset, len, "DeviceViewMut::slice")?;
        Ok(DeviceViewMut {
            ctx: self.ctx,
            addr: self.addr + offset as u64,
            len,
            _owner: PhantomData,
        })
    }

    /// Synchronous upload through the copy source: returns once the bytes landed.
    pub fn upload(&mut self, offset: usize, bytes: &[u8]) -> Result<(), Error> {
        checked_range(self.len, offset, bytes.len(), "upload")?;
        if bytes.is_empty() {
            return Ok(());
        }
        crate::copy::upload_sync(self.ctx, self.addr + offset as u64, bytes)
    }

    /// Asynchronous upload on `stream` through private pinned staging.
    pub fn upload_async(
        &mut self,
        offset: usize,
        bytes: &[u8],
        stream: &Stream,
    ) -> Result<(), Error> {
        checked_range(self.len, offset, bytes.len(), "upload_async")?;
        if bytes.is_empty() {
            return Ok(());
        }
        stream.same_context(self.ctx, "upload_async")?;
        crate::copy::upload_async(self.ctx, stream, self.addr + offset as u64, bytes)
    }

    /// Asynchronous upload straight from pinned memory, with no private copy.
    ///
    /// # Safety
    /// The GPU reads `src` after this returns: `src` must stay alive and unmodified until the
    /// stream passes the copy. Not for use inside a capture (the graph would read it at replay).
    pub unsafe fn upload_async_pinned(
        &mut self,
        offset: usize,
        src: &HostBuffer,
        src_offset: usize,
        len: usize,
        stream: &Stream,
    ) -> Result<(), Error> {
        checked_range(self.len, offset, len, "upload_async_pinned (destination)")?;
        checked_range(src.len(), src_offset, len, "upload_async_pinned (source)")?;
        if len == 0 {
            return Ok(());
        }
        // A stream of another context would copy into an address of the wrong context.
        stream.same_context(self.ctx, "upload_async_pinned")?;
        let dst = self.addr + offset as u64;
        // SAFETY: in bounds of the pinned block (checked above).
        let from = unsafe { src.as_ptr().add(src_offset) };
        let s = stream.raw();
        self.ctx.call("cuMemcpyHtoDAsync_v2", |api| {
            // SAFETY: ranges checked; the caller keeps `src` alive until the stream passes the copy.
            unsafe { (api.cuMemcpyHtoDAsync_v2)(dst, from.cast::<c_void>(), len, s) }
        })?;
        Ok(())
    }

    /// Device-to-device copy of `src` to `offset`, on `stream` or blocking.
    pub fn copy_from(
        &mut self,
        offset: usize,
        src: DeviceView<'_>,
        stream: Option<&Stream>,
    ) -> Result<(), Error> {
        checked_range(self.len, offset, src.len, "copy_from")?;
        if src.len == 0 {
            return Ok(());
        }
        let dst = self.addr + offset as u64;
        let (from, n) = (src.addr, src.len);
        match stream {
            Some(s) => {
                let raw = s.raw();
                self.ctx.call("cuMemcpyDtoDAsync_v2", |api| {
                    // SAFETY: both ranges lie in live buffers (bounds and borrows checked).
                    unsafe { (api.cuMemcpyDtoDAsync_v2)(dst, from, n, raw) }
                })?
            }
            None => self.ctx.call("cuMemcpyDtoD_v2", |api| {
                // SAFETY: as above.
                unsafe { (api.cuMemcpyDtoD_v2)(dst, from, n) }
            })?,
        }
        Ok(())
    }

    /// Sets every byte to `value`.
    pub fn fill_u8(&mut self, value: u8, stream: Option<&Stream>) -> Result<(), Error> {
        if self.len == 0 {
            return Ok(());
        }
        let (dst, n) = (self.addr, self.len);
        match stream {
            Some(s) => {
                let raw = s.raw();
                self.ctx.call("cuMemsetD8Async", |api| {
                    // SAFETY: the range is this live view.
                    unsafe { (api.cuMemsetD8Async)(dst, value, n, raw) }
                })?
            }
            None => self.ctx.call("cuMemsetD8_v2", |api| {
                // SAFETY: as above.
                unsafe { (api.cuMemsetD8_v2)(dst, value, n) }
            })?,
        }
        Ok(())
    }

    /// Sets every 32-bit word to `value`; the length must be a multiple of 4 and the address
    /// 4-byte aligned.
    pub fn fill_u32(&mut self, value: u32, stream: Option<&Stream>) -> Result<(), Error> {
        if !self.len.is_multiple_of(4) || !self.addr.is_multiple_of(4) {
            return Err(Error::invalid(format!(
                "fill_u32 needs a 4-byte aligned range of whole words; got {:#x} + {} B",
                self.addr, self.len
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        let (dst, n) = (self.addr, self.len / 4);
        match stream {
            Some(s) => {
                let raw = s.raw();
                self.ctx.call("cuMemsetD32Async", |api| {
                    // SAFETY: the range is this live view.
                    unsafe { (api.cuMemsetD32Async)(dst, value, n, raw) }
                })?
            }
            None => self.ctx.call("cuMemsetD32_v2", |api| {
                // SAFETY: as above.
                unsafe { (api.cuMemsetD32_v2)(dst, value, n) }
            })?,
        }
        Ok(())
    }
}

/// A 2-D region of device memory: `height` rows of `width_bytes`, `pitch` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pitched {
    pub pitch: usize,
    pub width_bytes: usize,
    pub height: usize,
}

impl Pitched {
    /// Bytes from the first row's start to the last row's end.
    pub fn span(&self) -> Option<usize> {
        if self.height == 0 || self.width_bytes == 0 {
            return Some(0);
        }
        if self.width_bytes > self.pitch {
            return None;
        }
        (self.height - 1)
            .checked_mul(self.pitch)?
            .checked_add(self.width_bytes)
    }
}

/// Device-to-device 2-D copy on `stream` (`cuMemcpy2DAsync_v2`): `height` rows of
/// `width_bytes` from `src` (rows `src_pitch` apart) to `dst` (rows `dst_pitch` apart).
pub fn copy_2d(
    dst: &mut DeviceViewMut<'_>,
    dst_pitch: usize,
    src: DeviceView<'_>,
    src_pitch: usize,
    width_bytes: usize,
    height: usize,
    stream: &Stream,
) -> Result<(), Error> {
    let span = |pitch: usize, len: usize, side: &str| -> Result<(), Error> {
        match (Pitched {
            pitch,
            width_bytes,
            height,
        })
        .span()
        {
            Some(s) if s <= len => Ok(()),
            _ => Err(Error::invalid(format!(
                "copy_2d {side}: {height} rows of {width_bytes} B at pitch {pitch} do not fit in {len} B \
                 (the pitch must be at least the width)"
            ))),
        }
    };
    span(dst_pitch, dst.len, "destination")?;
    span(src_pitch, src.len, "source")?;
    if width_bytes == 0 || height == 0 {
        return Ok(());
    }
    let mut desc = tf_sys::Memcpy2D::zeroed();
    desc.src_memory_type = tf_sys::flags::MEMORYTYPE_DEVICE;
    desc.src_device = src.addr;
    desc.src_pitch = src_pitch;
    desc.dst_memory_type = tf_sys::flags::MEMORYTYPE_DEVICE;
    desc.dst_device = dst.addr;
    desc.dst_pitch = dst_pitch;
    desc.width_in_bytes = width_bytes;
    desc.height = height;
    let raw = stream.raw();
    dst.ctx.call("cuMemcpy2DAsync_v2", |api| {
        // SAFETY: the descriptor lives across the call; both regions were checked to lie in
        // live buffers.
        unsafe { (api.cuMemcpy2DAsync_v2)(&desc, raw) }
    })?;
    Ok(())
}

/// Pinned, device-mapped host memory owned by this value (`cuMemHostAlloc`, PORTABLE |
/// DEVICEMAP). Kernels can read and write it through [`HostBuffer::device_addr`].
pub struct HostBuffer {
    ctx: Arc<ContextInner>,
    ptr: *mut u8,
    len: usize,
    device_addr: u64,
}

// SAFETY: the buffer exclusively owns its pinned block; access follows Rust borrows.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for HostBuffer {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("device_addr", &format_args!("{:#x}", self.device_addr))
            .finish()
    }
}

impl HostBuffer {
    /// `len` bytes of pinned, mapped host memory, zero-filled. Zero bytes allocate nothing.
    pub fn alloc(ctx: &Context, len: usize) -> Result<HostBuffer, Error> {
        let inner = Arc::clone(&ctx.inner);
        if len == 0 {
            return Ok(HostBuffer {
                ctx: inner,
                ptr: std::ptr::null_mut(),
                len: 0,
                device_addr: 0,
            });
        }
        inner.ensure_healthy("cuMemHostAlloc")?;
        HOST.try_hold(len as u64, None);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let flags = tf_sys::flags::HOST_ALLOC_PORTABLE | tf_sys::flags::HOST_ALLOC_DEVICEMAP;
        if let Err(e) = inner.call("cuMemHostAlloc", |api| {
            // SAFETY: out-pointer to a local; len > 0.
            unsafe { (api.cuMemHostAlloc)(&mut ptr, len, flags) }
        }) {
            HOST.cancel(len as u64);
            return Err(match e {
                tf_sys::Error::OutOfMemory { call } => Error::OutOfMemory {
                    call,
                    bytes: len as u64,
                    why: "the driver could not pin that much host memory".into(),
                },
                e => e.into(),
            });
        }
        let mut buffer = HostBuffer {
            ctx: Arc::clone(&inner),
            ptr: ptr.cast::<u8>(),
            len,
            device_addr: 0,
        };
        let mut dev = 0u64;
        inner.call("cuMemHostGetDevicePointer_v2", |api| {
            // SAFETY: `ptr` is the block just allocated with DEVICEMAP; flags must be 0.
            unsafe { (api.cuMemHostGetDevicePointer_v2)(&mut dev, ptr, 0) }
        })?;
        buffer.device_addr = dev;
        // Fresh pinned memory is uninitialized: zero it through the raw pointer (no `&mut [u8]`
        // over uninitialized bytes), after which `as_slice` may hand it out.
        // SAFETY: `ptr` is the live block of `len` bytes just allocated, owned by `buffer`.
        unsafe { std::ptr::write_bytes(buffer.ptr, 0, len) };
        Ok(buffer)
    }

    /// A pinned copy of `bytes`.
    pub fn from_bytes(ctx: &Context, bytes: &[u8]) -> Result<HostBuffer, Error> {
        let mut b = HostBuffer::alloc(ctx, bytes.len())?;
        b.as_mut_slice().copy_from_slice(bytes);
        Ok(b)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address kernels use to reach this memory.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }

    /// The host address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is a live block of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` is a live block of `len` bytes exclusively borrowed through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len == 0 || self.ptr.is_null() {
            return;
        }
        if self.ctx.lost_code().is_some() {
            return;
        }
        let ptr = self.ptr.cast::<c_void>();
        self.ctx.release_call("cuMemFreeHost", |api| {
            // SAFETY: the block came from cuMemHostAlloc and is freed once.
            unsafe { (api.cuMemFreeHost)(ptr) }
        });
        HOST.release(self.len as u64);
    }
}
