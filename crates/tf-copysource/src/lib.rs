//! tf-copysource: who owns the host bytes a host-to-device copy reads.
//!
//! An asynchronous host-to-device copy reads its source after the call returns, and a copy captured into a
//! graph reads it again at every replay. This crate makes the runtime, not the caller, own those bytes for
//! as long as the GPU may read them. It is driver-independent: everything goes through the small
//! [`Backend`] trait (pinned staging, async copy, completion markers, stream synchronize/query, synchronous
//! copy), implemented by tf-cuda over the driver and by [`mock::MockBackend`] for tests.
//!
//! # Invariants
//!
//! - **A source is released only after its stream is proven past it.** An async upload copies the caller's
//!   bytes into a private pinned staging block, enqueues the copy and records a marker; the block stays in
//!   the stream's pending list until its marker reports done, the stream is synchronized or queried idle
//!   through this crate (only entries pending before that call are released), or, for a retired
//!   (destroyed) stream, its marker reports done. Released blocks go to a per-context pool (size classes of
//!   powers of two from 4 KiB to 64 MiB) or are freed.
//! - **The caller's buffer is free once a call returns**: async uploads copy it into staging first; synchronous
//!   uploads copy it too, up to 8 MiB (one chunk) into a private host copy for the backend's synchronous copy,
//!   above that into pinned staging as async uploads do (no private copy of the whole buffer), and synchronize
//!   the stream before returning.
//! - **Large uploads are pipelined and bounded**: staging is filled in 8 MiB chunks, several at once on host
//!   threads, and each batch's DMA overlaps the host copy of the next. Outside a capture one upload keeps at
//!   most three batches in flight (96 MiB); the next batch waits for the oldest one's marker and reuses its
//!   blocks (proven read, so rewriting them is safe), so an upload larger than that returns once all but its
//!   last 96 MiB have been read by the GPU. The default spare pool (256 MiB a context) holds two such rings.
//! - **Large downloads are staged the same way** ([`CopySource::download_staged`]): the DMA of 8 MiB chunks goes
//!   into pinned blocks from the same pool, at most three batches in flight, each batch copied into the caller's
//!   buffer on host threads once its marker was waited for, while the later batches' DMA runs. A block is reused
//!   or returned only after its DMA is proven done, on error paths too (a batch nothing proves landed is leaked);
//!   the call returns with nothing pending. Refused while a capture scope is open (`CaptureOpen`).
//! - **While any capture scope is open, synchronous uploads are refused** (`UnownedCaptureSource`), and so
//!   is every copy from host memory the runtime does not own ([`CopySource::check_unowned_copy`]).
//!   Uploads on a capturing stream move their staging into the capture; [`CaptureScope::adopt`] moves a
//!   caller's `Vec<u8>`/`Arc<[u8]>` in. [`CaptureScope::end`] (after the driver's end-capture succeeded)
//!   hands them over as [`CapturedSources`], which the graph and its executables keep; each launch is
//!   reported with [`CopySource::graph_launched`] so the sources outlive in-flight launches too.
//!   A scope dropped without `end` is closed (discarded): a failed end-capture cannot leave it open.
//! - **A source whose release cannot be proven is leaked, never freed** (an execution fault, a retired stream
//!   with no marker, a context torn down under a live capture): freeing memory the GPU may still read is the
//!   one thing this crate never does.
//! - Contexts live in a fixed table of [`MAX_CONTEXTS`] (64) a process; registering more fails with
//!   `ContextTableFull`. Unregistering frees the context's spares and waits for its pending copies first.
//!
//! A process keeps one `CopySource` (tf-cuda holds it); the capture rule covers the scopes of that instance.
//! As with the driver's own capture rules, beginning or ending a capture on a stream must not race with
//! uploads to that same stream from another thread.
//!
//! # Wiring into a runtime
//!
//! Context init: [`CopySource::register_context`]; teardown: [`CopySource::unregister_context`] before the
//! driver context goes. Stream synchronize / query go through [`CopySource::synchronize`] /
//! [`CopySource::query`]; call [`CopySource::retire_stream`] before destroying a stream. Capture:
//! [`CopySource::begin_capture`] then the driver's begin-capture; after a successful end-capture,
//! [`CaptureScope::end`] and keep the [`CapturedSources`] with the graph executable (declared after the
//! driver handles so it drops last); after each launch, [`CopySource::graph_launched`]. Before any copy from
//! host memory the runtime does not own, [`CopySource::check_unowned_copy`].
//!
//! # Lock order
//!
//! One `parking_lot` mutex guards all bookkeeping; backends have their own locks. Order: copy-source state,
//! then the backend's locks; a backend never calls back into the copy source. The state lock is held only
//! across the non-blocking [`Backend::query_marker`]; allocation, writes, frees, enqueues, marker records,
//! waits, synchronizes and synchronous copies run with it released, and released sources (captured sources,
//! adopted buffers) are dropped only after it is released.
//!
//! # Example
//!
//! ```
//! use tf_copysource::mock::{MockBackend, MockContext, MockStream};
//! use tf_copysource::{CopySource, DeviceAddress, Error};
//!
//! let gpu = MockBackend::new();
//! let source = CopySource::new(gpu.clone());
//! let context = source.register_context(MockContext(0))?;
//! let stream = MockStream(1);
//!
//! let mut bytes = vec![7u8; 4096];
//! source.upload_async(context, stream, DeviceAddress(0x1000), &bytes)?;
//! bytes.fill(0); // the caller's buffer is free at once
//!
//! assert_eq!(source.stats().pending_blocks, 1); // held until the GPU has read it
//! source.synchronize(stream)?;
//! assert_eq!(source.stats().pending_blocks, 0);
//! assert_eq!(gpu.device_bytes(DeviceAddress(0x1000)), Some(vec![7u8; 4096]));
//!
//! // While a capture scope is open, synchronous uploads are refused.
//! let scope = source.begin_capture(context, MockStream(2))?;
//! let refused = source.upload_sync(context, stream, DeviceAddress(0x2000), &[1, 2, 3]);
//! assert!(matches!(refused, Err(Error::UnownedCaptureSource { .. })));
//! drop(scope); // closes the scope
//! source.upload_sync(context, stream, DeviceAddress(0x2000), &[1, 2, 3])?;
//!
//! source.unregister_context(context)?;
//! assert_eq!(gpu.live_blocks(), 0);
//! # Ok::<(), Error<tf_copysource::mock::MockError>>(())
//! ```

pub mod backend;
pub mod classes;
mod error;
pub mod mock;
mod source;

pub use backend::{Backend, DeviceAddress, MarkerState};
pub use error::Error;
pub use source::{
    CaptureScope, CapturedSources, Config, ContextId, CopySource, HostRange, HostSource, Result,
    Stats, TeardownReport, MAX_CONTEXTS,
};

#[cfg(test)]
mod tests;
