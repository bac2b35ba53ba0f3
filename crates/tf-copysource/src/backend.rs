//! The backend trait: the few driver operations the bookkeeping needs.
//!
//! tf-cuda implements [`Backend`] over the CUDA driver (pinned host allocations, `cuMemcpyHtoDAsync`,
//! `cuMemcpyDtoHAsync` into staging, events, stream synchronize/query, `cuMemcpyHtoD`);
//! [`crate::mock::MockBackend`] implements it over host memory with a lazily executing fake GPU. This crate
//! never calls a driver itself.
//!
//! Contract shared by every method: a backend never calls back into a [`crate::CopySource`] (the copy
//! source may hold its state lock while it calls the non-blocking methods, see the crate doc's lock order).

use std::fmt::Debug;
use std::hash::Hash;
use std::mem::MaybeUninit;

/// A device address (a `CUdeviceptr`): where a host-to-device copy writes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceAddress(pub u64);

impl DeviceAddress {
    /// The address `bytes` further on, or `None` when it would wrap around.
    pub fn offset(self, bytes: usize) -> Option<DeviceAddress> {
        let bytes = u64::try_from(bytes).ok()?;
        self.0.checked_add(bytes).map(DeviceAddress)
    }
}

/// What a completion marker says about the work recorded before it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MarkerState {
    /// Every operation enqueued on the stream before the marker has finished: the GPU has read the sources.
    Done,
    /// Not yet (`CUDA_ERROR_NOT_READY`).
    Pending,
}

/// The driver operations the copy-source bookkeeping needs. Small and stable on purpose.
///
/// Handles are opaque to this crate: it only stores, compares and hands them back.
/// Every method takes `&self`; implementations are shared across threads.
pub trait Backend: Send + Sync + 'static {
    /// A context (e.g. a `CUcontext` wrapped in a `Copy` newtype). Staging memory belongs to one.
    type Context: Copy + Eq + Hash + Debug + Send + Sync + 'static;
    /// A stream (e.g. a `CUstream` wrapped in a `Copy` newtype). Copies and markers are ordered on it.
    type Stream: Copy + Eq + Hash + Debug + Send + Sync + 'static;
    /// A completion marker recorded on a stream (e.g. a `CUevent`). Owned: released with
    /// [`Backend::destroy_marker`].
    type Marker: Debug + Send + Sync + 'static;
    /// A pinned (page-locked) host staging block. Owned: released with [`Backend::free_staging`].
    /// Dropping one without `free_staging` must be harmless (it leaks); the copy source only does that when
    /// the memory may still be read by the GPU and cannot be proven otherwise (e.g. a lost context).
    type Staging: Send + Sync + 'static;
    /// The backend's error (e.g. `tf_sys::Error`).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Allocates a pinned host block of at least `len` bytes (`len > 0`) in `context`.
    fn alloc_staging(
        &self,
        context: Self::Context,
        len: usize,
    ) -> Result<Self::Staging, Self::Error>;

    /// The usable size of `block` in bytes (at least the `len` it was allocated with).
    fn staging_len(&self, block: &Self::Staging) -> usize;

    /// Copies `bytes` into the start of `block` on the host. The copy source guarantees
    /// `bytes.len() <= self.staging_len(block)` and that no enqueued copy still reads `block`.
    fn write_staging(&self, block: &mut Self::Staging, bytes: &[u8]);

    /// Frees a block. The copy source guarantees no copy that read it is still pending on the GPU.
    fn free_staging(&self, context: Self::Context, block: Self::Staging)
        -> Result<(), Self::Error>;

    /// Enqueues an asynchronous copy of the first `len` bytes of `source` to `destination` on `stream`
    /// (`cuMemcpyHtoDAsync_v2`). While the stream is being captured this records a copy node instead.
    ///
    /// # Safety
    /// The GPU reads `source` after this returns. The caller must keep `source` alive and unmodified until
    /// `stream` is proven past this copy (a marker recorded after it reports [`MarkerState::Done`], or the
    /// stream was synchronized or queried idle), or, for a captured copy, until every graph executable built
    /// from the capture is destroyed and its launches are proven done. `len <= staging_len(source)`.
    /// On `Err` nothing was enqueued.
    unsafe fn enqueue_copy(
        &self,
        stream: Self::Stream,
        destination: DeviceAddress,
        source: &Self::Staging,
        len: usize,
    ) -> Result<(), Self::Error>;

    /// Enqueues an asynchronous copy of `len` bytes from `source` (device memory) into the start of
    /// `destination` on `stream` (`cuMemcpyDtoHAsync_v2`). The copy source calls it only for staged
    /// downloads, never while a capture scope is open.
    ///
    /// # Safety
    /// The GPU writes `destination` after this returns. The caller must not read, write or free
    /// `destination` until `stream` is proven past this copy (a marker recorded after it reports
    /// [`MarkerState::Done`] or was waited for, or the stream was synchronized). `len <= staging_len(destination)`.
    /// On `Err` nothing was enqueued.
    unsafe fn enqueue_download(
        &self,
        stream: Self::Stream,
        source: DeviceAddress,
        destination: &mut Self::Staging,
        len: usize,
    ) -> Result<(), Self::Error>;

    /// Copies the first `out.len()` bytes of `block` into `out` on the host, initializing all of
    /// `out`. The copy source guarantees `out.len() <= self.staging_len(block)` and that no enqueued
    /// download still writes `block`.
    fn read_staging(&self, block: &Self::Staging, out: &mut [MaybeUninit<u8>]);

    /// Records a completion marker on `stream` after everything enqueued so far (`cuEventRecord`).
    fn record_marker(&self, stream: Self::Stream) -> Result<Self::Marker, Self::Error>;

    /// Non-blocking: has the stream passed `marker` (`cuEventQuery`)? An execution fault is an `Err`.
    fn query_marker(&self, marker: &Self::Marker) -> Result<MarkerState, Self::Error>;

    /// Blocks until the stream passes `marker` (`cuEventSynchronize`). Works after the stream was destroyed.
    fn wait_marker(&self, marker: &Self::Marker) -> Result<(), Self::Error>;

    /// Releases a marker (`cuEventDestroy`). Errors are not actionable here and are ignored.
    fn destroy_marker(&self, marker: Self::Marker);

    /// Blocks until everything enqueued on `stream` has finished (`cuStreamSynchronize`).
    fn synchronize_stream(&self, stream: Self::Stream) -> Result<(), Self::Error>;

    /// Non-blocking: has everything enqueued on `stream` finished (`cuStreamQuery`)?
    fn query_stream(&self, stream: Self::Stream) -> Result<MarkerState, Self::Error>;

    /// Copies `source` to `destination` in `context`, returning once `source` has been read
    /// (`cuMemcpyHtoD_v2`). The copy source uses it for synchronous uploads of one chunk and follows it
    /// with [`Backend::synchronize_stream`].
    fn copy_sync(
        &self,
        context: Self::Context,
        destination: DeviceAddress,
        source: &[u8],
    ) -> Result<(), Self::Error>;
}
