//! The copy source: staging pool, per-stream pending lists, capture scopes, context table.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::backend::{Backend, DeviceAddress, MarkerState};
use crate::classes::{
    self, CLASS_COUNT, MAX_CLASS_BYTES, PIPELINE_CHUNK_BYTES, PIPELINE_DEPTH, PIPELINE_LANES,
    PIPELINE_RING_BYTES,
};
use crate::error::Error;

/// How many contexts a process can register at once.
pub const MAX_CONTEXTS: usize = 64;

/// The result type of this crate for backend `B`.
pub type Result<T, B> = std::result::Result<T, Error<<B as Backend>::Error>>;

/// Tuning of a [`CopySource`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Spare (finished, pooled) staging bytes a context keeps for reuse; blocks beyond it are freed.
    pub max_spare_bytes_per_context: usize,
    /// Optional cap on all staging bytes held (pending, captured, spare). `None`: only the backend limits it.
    pub staging_limit_bytes: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            // Two uploads' rings: large uploads reuse pooled blocks instead of pinning anew.
            max_spare_bytes_per_context: 256 << 20,
            staging_limit_bytes: None,
        }
    }
}

const _: () = assert!(256 << 20 >= 2 * PIPELINE_RING_BYTES);

/// A registered context: a slot in the fixed table and the generation that slot had when registered.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContextId {
    slot: usize,
    generation: u64,
}

impl ContextId {
    /// The slot in the context table (`0..MAX_CONTEXTS`).
    pub fn slot(self) -> usize {
        self.slot
    }
}

/// A counter snapshot, for tests, benchmarks and diagnostics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Registered contexts.
    pub contexts: usize,
    /// Pending entries (uploads and graph launches not yet proven done), retired streams included.
    pub pending_entries: usize,
    /// Staging blocks owned by pending upload entries.
    pub pending_blocks: usize,
    /// Pooled spare blocks.
    pub spare_blocks: usize,
    /// Open capture scopes.
    pub open_captures: usize,
    /// Staging bytes held: pending, captured and spare.
    pub staging_bytes: usize,
    /// Blocks deliberately leaked because they could not be proven unread (e.g. after a fault).
    pub leaked_blocks: usize,
}

/// What [`CopySource::unregister_context`] did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TeardownReport {
    /// Pending blocks released after their stream was proven past them.
    pub released_blocks: usize,
    /// Spare blocks freed.
    pub spares_freed: usize,
    /// Blocks leaked because the backend could not prove the GPU was done with them.
    pub leaked_blocks: usize,
}

/// A range of host memory kept alive by a capture (see [`CaptureScope::adopt`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HostRange {
    /// Address of the first byte.
    pub address: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Host bytes that can be moved into a capture and read by its copy nodes for as long as it lives.
/// The bytes must not move when the value moves (heap-backed), which holds for every implementation here.
pub trait HostSource: Send + Sync + 'static {
    /// The bytes a copy node reads.
    fn host_bytes(&self) -> &[u8];
}

impl HostSource for Vec<u8> {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl HostSource for Box<[u8]> {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl HostSource for Arc<[u8]> {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl HostSource for Arc<Vec<u8>> {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}
impl HostSource for &'static [u8] {
    fn host_bytes(&self) -> &[u8] {
        self
    }
}

struct Block<B: Backend> {
    staging: B::Staging,
    /// The context whose pool it returns to.
    context: ContextId,
    class: usize,
    bytes: usize,
}

/// A batch of one upload's ring: its blocks and the marker recorded after their copies.
type InFlight<B> = (Vec<Block<B>>, Option<<B as Backend>::Marker>);

/// A batch of one staged download in flight: its blocks (one per piece, in order, for the pieces
/// whose copy was enqueued), the pieces of the caller's buffer they land in, and the marker
/// recorded after their copies.
struct Landing<'o, B: Backend> {
    blocks: Vec<Block<B>>,
    pieces: Vec<&'o mut [MaybeUninit<u8>]>,
    marker: Option<B::Marker>,
}

enum Payload<B: Backend> {
    Blocks(Vec<Block<B>>),
    Captured(Arc<CapturedInner<B>>),
}

struct PendingEntry<B: Backend> {
    seq: u64,
    context: ContextId,
    stream: B::Stream,
    marker: Option<B::Marker>,
    payload: Payload<B>,
}

struct ContextSlot<B: Backend> {
    handle: B::Context,
    generation: u64,
    spares: Vec<Vec<B::Staging>>,
    spare_bytes: usize,
}

struct OpenCapture<B: Backend> {
    scope_id: u64,
    context: ContextId,
    blocks: Vec<Block<B>>,
    adopted: Vec<Box<dyn Any + Send + Sync>>,
}

struct State<B: Backend> {
    contexts: Vec<Option<ContextSlot<B>>>,
    next_generation: u64,
    streams: HashMap<B::Stream, VecDeque<PendingEntry<B>>>,
    /// Entries of retired (destroyed) streams: released once their marker says done.
    orphans: Vec<PendingEntry<B>>,
    captures: HashMap<B::Stream, OpenCapture<B>>,
    next_seq: u64,
    next_scope_id: u64,
    staging_bytes: usize,
    leaked_blocks: usize,
}

impl<B: Backend> State<B> {
    fn context(&self, id: ContextId) -> Result<&ContextSlot<B>, B> {
        match self.contexts.get(id.slot).and_then(Option::as_ref) {
            Some(slot) if slot.generation == id.generation => Ok(slot),
            _ => Err(Error::UnknownContext {
                slot: id.slot,
                generation: id.generation,
            }),
        }
    }

    fn context_mut(&mut self, id: ContextId) -> Option<&mut ContextSlot<B>> {
        match self.contexts.get_mut(id.slot).and_then(Option::as_mut) {
            Some(slot) if slot.generation == id.generation => Some(slot),
            _ => None,
        }
    }

    fn any_open_capture(&self) -> Option<B::Stream> {
        self.captures.keys().next().copied()
    }

    fn leak(&mut self, blocks: Vec<Block<B>>) {
        for block in blocks {
            self.staging_bytes = self.staging_bytes.saturating_sub(block.bytes);
            self.leaked_blocks += 1;
            // The GPU may still read it and nothing can prove otherwise: never free it.
            std::mem::forget(block.staging);
        }
    }
}

struct Shared<B: Backend> {
    backend: B,
    config: Config,
    state: Mutex<State<B>>,
}

/// Owns the host bytes of host-to-device copies until the GPU has read them. Cheap to clone (shared).
///
/// See the crate documentation for the invariants and the lock order.
pub struct CopySource<B: Backend> {
    shared: Arc<Shared<B>>,
}

impl<B: Backend> Clone for CopySource<B> {
    fn clone(&self) -> Self {
        CopySource {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<B: Backend> fmt::Debug for CopySource<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopySource")
            .field("config", &self.shared.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Entries and blocks taken out under the lock, released after it is dropped.
struct Released<B: Backend> {
    entries: Vec<PendingEntry<B>>,
}

impl<B: Backend> Default for Released<B> {
    fn default() -> Self {
        Released {
            entries: Vec::new(),
        }
    }
}

impl<B: Backend> CopySource<B> {
    /// A copy source over `backend` with the default [`Config`].
    pub fn new(backend: B) -> Self {
        Self::with_config(backend, Config::default())
    }

    /// A copy source over `backend` with `config`.
    pub fn with_config(backend: B, config: Config) -> Self {
        let state = State {
            contexts: (0..MAX_CONTEXTS).map(|_| None).collect(),
            next_generation: 1,
            streams: HashMap::new(),
            orphans: Vec::new(),
            captures: HashMap::new(),
            next_seq: 0,
            next_scope_id: 1,
            staging_bytes: 0,
            leaked_blocks: 0,
        };
        CopySource {
            shared: Arc::new(Shared {
                backend,
                config,
                state: Mutex::new(state),
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.shared.backend
    }

    /// The configuration.
    pub fn config(&self) -> Config {
        self.shared.config
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        let state = self.shared.state.lock();
        let pending = state
            .streams
            .values()
            .flat_map(|list| list.iter())
            .chain(state.orphans.iter());
        let (mut pending_entries, mut pending_blocks) = (0, 0);
        for entry in pending {
            pending_entries += 1;
            if let Payload::Blocks(blocks) = &entry.payload {
                pending_blocks += blocks.len();
            }
        }
        Stats {
            contexts: state.contexts.iter().filter(|slot| slot.is_some()).count(),
            pending_entries,
            pending_blocks,
            spare_blocks: state
                .contexts
                .iter()
                .flatten()
                .map(|c| c.spares.iter().map(Vec::len).sum::<usize>())
                .sum(),
            open_captures: state.captures.len(),
            staging_bytes: state.staging_bytes,
            leaked_blocks: state.leaked_blocks,
        }
    }

    // ----- contexts -----

    /// Registers a context (at context init). Fails with `ContextTableFull` when 64 are registered.
    pub fn register_context(&self, handle: B::Context) -> Result<ContextId, B> {
        let mut state = self.shared.state.lock();
        let generation = state.next_generation;
        let Some(slot) = state.contexts.iter().position(Option::is_none) else {
            return Err(Error::ContextTableFull {
                capacity: MAX_CONTEXTS,
            });
        };
        state.next_generation += 1;
        if let Some(entry) = state.contexts.get_mut(slot) {
            *entry = Some(ContextSlot {
                handle,
                generation,
                spares: (0..CLASS_COUNT).map(|_| Vec::new()).collect(),
                spare_bytes: 0,
            });
        }
        Ok(ContextId { slot, generation })
    }

    /// The backend handle of a registered context.
    pub fn context_handle(&self, id: ContextId) -> Result<B::Context, B> {
        Ok(self.shared.state.lock().context(id)?.handle)
    }

    /// Unregisters a context (at context teardown, before the context is destroyed): frees its spares and
    /// waits for its pending copies (by marker, or by synchronizing their live stream) before freeing their
    /// blocks. Blocks that cannot be proven read are leaked, never freed. Capture scopes still open for this
    /// context and captured sources still alive leak their blocks when they end (destroy graph executables
    /// before the context).
    pub fn unregister_context(&self, id: ContextId) -> Result<TeardownReport, B> {
        let (handle, spares, entries) = {
            let mut state = self.shared.state.lock();
            state.context(id)?;
            let slot = state.contexts.get_mut(id.slot).and_then(Option::take);
            let Some(slot) = slot else {
                return Err(Error::UnknownContext {
                    slot: id.slot,
                    generation: id.generation,
                });
            };
            // (entry, whether its stream is still live and may be synchronized)
            let mut entries = Vec::new();
            for list in state.streams.values_mut() {
                let (mine, rest): (VecDeque<_>, VecDeque<_>) =
                    list.drain(..).partition(|e| e.context == id);
                *list = rest;
                entries.extend(mine.into_iter().map(|e| (e, true)));
            }
            state.streams.retain(|_, list| !list.is_empty());
            let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut state.orphans)
                .into_iter()
                .partition(|e| e.context == id);
            state.orphans = rest;
            entries.extend(mine.into_iter().map(|e| (e, false)));
            let spares: Vec<B::Staging> = slot.spares.into_iter().flatten().collect();
            state.staging_bytes = state.staging_bytes.saturating_sub(slot.spare_bytes);
            (slot.handle, spares, entries)
        };
        let backend = &self.shared.backend;
        let mut report = TeardownReport::default();
        let mut first_error = None;
        for block in spares {
            report.spares_freed += 1;
            if let Err(e) = backend.free_staging(handle, block) {
                first_error.get_or_insert(Error::Backend {
                    call: "free_staging",
                    source: e,
                });
            }
        }
        // Streams already synchronized in this teardown (entries without a marker).
        let mut synchronized: Vec<B::Stream> = Vec::new();
        for (mut entry, live) in entries {
            let proven = match &entry.marker {
                Some(marker) => backend.wait_marker(marker).map_err(|e| {
                    Some(Error::Backend {
                        call: "wait_marker",
                        source: e,
                    })
                }),
                None if synchronized.contains(&entry.stream) => Ok(()),
                None if live => {
                    let result = backend.synchronize_stream(entry.stream).map_err(|e| {
                        Some(Error::Backend {
                            call: "synchronize_stream",
                            source: e,
                        })
                    });
                    if result.is_ok() {
                        synchronized.push(entry.stream);
                    }
                    result
                }
                // A destroyed stream without a marker: nothing can prove the copy finished.
                None => Err(None),
            };
            if let Some(marker) = entry.marker.take() {
                backend.destroy_marker(marker);
            }
            match (proven, entry.payload) {
                (Ok(()), Payload::Blocks(blocks)) => {
                    self.free_torn_down(id, handle, blocks, &mut report, &mut first_error);
                }
                (Ok(()), Payload::Captured(captured)) => match Arc::try_unwrap(captured) {
                    // The executable is gone and this was its last launch: free its blocks while the
                    // context still exists (its slot is already closed, so a plain release would leak).
                    Ok(mut inner) => {
                        let blocks = std::mem::take(&mut inner.blocks);
                        self.free_torn_down(id, handle, blocks, &mut report, &mut first_error);
                        drop(inner);
                    }
                    Err(captured) => drop(captured),
                },
                (Err(error), Payload::Blocks(blocks)) => {
                    report.leaked_blocks += blocks.len();
                    self.shared.state.lock().leak(blocks);
                    if let Some(e) = error {
                        first_error.get_or_insert(e);
                    }
                }
                (Err(error), Payload::Captured(captured)) => {
                    if let Some(e) = error {
                        first_error.get_or_insert(e);
                    }
                    drop(captured);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Frees blocks of a context being torn down (proven unread); blocks of other contexts go to their pools.
    fn free_torn_down(
        &self,
        id: ContextId,
        handle: B::Context,
        blocks: Vec<Block<B>>,
        report: &mut TeardownReport,
        first_error: &mut Option<Error<B::Error>>,
    ) {
        let (mine, others): (Vec<_>, Vec<_>) = blocks.into_iter().partition(|b| b.context == id);
        self.release_blocks(others);
        let bytes: usize = mine.iter().map(|b| b.bytes).sum();
        for block in mine {
            report.released_blocks += 1;
            if let Err(e) = self.shared.backend.free_staging(handle, block.staging) {
                first_error.get_or_insert(Error::Backend {
                    call: "free_staging",
                    source: e,
                });
            }
        }
        let mut state = self.shared.state.lock();
        state.staging_bytes = state.staging_bytes.saturating_sub(bytes);
    }

    // ----- uploads -----

    /// Asynchronous upload: copies `bytes` into private pinned staging and enqueues the copy to `destination`
    /// on `stream`. When this returns the caller may overwrite or drop `bytes`. The staging is released only
    /// once the stream is proven past the copy. On a stream with an open capture scope the staging is moved
    /// into the capture instead and lives as long as the graph built from it.
    pub fn upload_async(
        &self,
        context: ContextId,
        stream: B::Stream,
        destination: DeviceAddress,
        bytes: &[u8],
    ) -> Result<(), B> {
        if bytes.is_empty() {
            return Ok(());
        }
        check_range(destination, bytes.len())?;
        let capture_scope = {
            let state = self.shared.state.lock();
            state.context(context)?;
            state.captures.get(&stream).map(|open| open.scope_id)
        };
        if capture_scope.is_none() {
            self.reap_stream_front(stream);
        }
        self.upload_staged(context, stream, destination, bytes, capture_scope)
    }

    /// Copies `bytes` to `destination` through pinned staging, pipelined: chunks of
    /// [`PIPELINE_CHUNK_BYTES`] are copied on the host in batches of up to [`PIPELINE_LANES`]
    /// (one thread each), and each batch's copies are enqueued with a marker behind them. Outside
    /// a capture at most [`PIPELINE_DEPTH`] batches are in flight: the next batch waits for the
    /// oldest one's marker and reuses its blocks, so the host copy of a batch overlaps the DMA of
    /// the ones before it, and one upload holds at most [`PIPELINE_RING_BYTES`] of staging. The
    /// batches still in flight at the end go to the stream's pending list. Inside a capture every
    /// chunk keeps its own block (the graph reads them at each replay) and they go to the scope.
    fn upload_staged(
        &self,
        context: ContextId,
        stream: B::Stream,
        destination: DeviceAddress,
        bytes: &[u8],
        capture_scope: Option<u64>,
    ) -> Result<(), B> {
        let backend = &self.shared.backend;
        let recycle = capture_scope.is_none();
        let lanes = lane_count();
        let chunks: Vec<(usize, usize)> =
            classes::chunks(bytes.len(), PIPELINE_CHUNK_BYTES).collect();
        // Batches in flight, oldest first, each with the marker recorded after its copies.
        let mut ring: VecDeque<InFlight<B>> = VecDeque::new();
        let mut captured: Vec<Block<B>> = Vec::new();
        let mut failure = None;
        for batch in chunks.chunks(lanes) {
            let mut reusable = Vec::new();
            if recycle && ring.len() >= PIPELINE_DEPTH {
                if let Some(oldest) = ring.pop_front() {
                    match self.wait_batch(context, stream, oldest) {
                        Ok(blocks) => reusable = blocks,
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    }
                }
            }
            let mut blocks = Vec::with_capacity(batch.len());
            for &(_, len) in batch {
                let block = match reusable.iter().position(|b: &Block<B>| b.bytes >= len) {
                    Some(at) => Ok(reusable.swap_remove(at)),
                    None => self.acquire_block(context, len),
                };
                match block {
                    Ok(block) => blocks.push(block),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            // Proven read and not written again: back to the pool.
            self.release_blocks(reusable);
            if failure.is_some() {
                self.release_blocks(blocks);
                break;
            }
            self.fill_blocks(&mut blocks, batch, bytes);
            let mut enqueued = Vec::with_capacity(blocks.len());
            for (block, &(offset, len)) in blocks.into_iter().zip(batch) {
                if failure.is_some() {
                    self.release_blocks(vec![block]);
                    continue;
                }
                let target = DeviceAddress(destination.0.wrapping_add(offset as u64));
                // SAFETY: the block is kept until the stream is proven past this copy: it stays in
                // this call's ring until a marker recorded after it reports done (then it may be
                // written again), or goes into this stream's pending list with that marker, or into
                // the open capture, which lives as long as the graph executables built from it; it
                // is never written while a copy may read it.
                let enqueued_now =
                    unsafe { backend.enqueue_copy(stream, target, &block.staging, len) };
                match enqueued_now {
                    Ok(()) => enqueued.push(block),
                    Err(e) => {
                        // Nothing was enqueued from this block.
                        self.release_blocks(vec![block]);
                        failure = Some(Error::Backend {
                            call: "enqueue_copy",
                            source: e,
                        });
                    }
                }
            }
            if enqueued.is_empty() {
                break;
            }
            if !recycle {
                captured.extend(enqueued);
                if failure.is_some() {
                    break;
                }
                continue;
            }
            match backend.record_marker(stream) {
                Ok(marker) => ring.push_back((enqueued, Some(marker))),
                Err(e) => {
                    ring.push_back((enqueued, None));
                    failure.get_or_insert(Error::Backend {
                        call: "record_marker",
                        source: e,
                    });
                }
            }
            if failure.is_some() {
                break;
            }
        }
        if let Some(scope_id) = capture_scope {
            if captured.is_empty() {
                return failure.map_or(Ok(()), Err);
            }
            let mut state = self.shared.state.lock();
            match state.captures.get_mut(&stream) {
                Some(open) if open.scope_id == scope_id => open.blocks.extend(captured),
                // The scope ended while we enqueued (a capture must not be begun or ended concurrently with
                // copies on its stream): whether the graph reads these blocks cannot be known, so keep them.
                _ => state.leak(captured),
            }
            return failure.map_or(Ok(()), Err);
        }
        for (blocks, marker) in ring {
            self.push_pending(context, stream, marker, Payload::Blocks(blocks));
        }
        failure.map_or(Ok(()), Err)
    }

    /// Waits until the stream is past a batch of this call's ring and returns its blocks for
    /// reuse. A batch without a marker goes to the pending list instead (nothing to reuse); a
    /// failed wait leaks the blocks (nothing proves the GPU read them).
    fn wait_batch(
        &self,
        context: ContextId,
        stream: B::Stream,
        (blocks, marker): InFlight<B>,
    ) -> Result<Vec<Block<B>>, B> {
        let backend = &self.shared.backend;
        let Some(marker) = marker else {
            self.push_pending(context, stream, None, Payload::Blocks(blocks));
            return Ok(Vec::new());
        };
        let waited = backend.wait_marker(&marker);
        backend.destroy_marker(marker);
        match waited {
            Ok(()) => Ok(blocks),
            Err(e) => {
                self.shared.state.lock().leak(blocks);
                Err(Error::Backend {
                    call: "wait_marker",
                    source: e,
                })
            }
        }
    }

    /// Copies each chunk of `bytes` into its block on the host, one thread per block when there
    /// are several.
    fn fill_blocks(&self, blocks: &mut [Block<B>], chunks: &[(usize, usize)], bytes: &[u8]) {
        let backend = &self.shared.backend;
        let mut pairs: Vec<(&mut Block<B>, (usize, usize))> =
            blocks.iter_mut().zip(chunks.iter().copied()).collect();
        run_lanes(
            &mut pairs,
            "tf-copysource-fill",
            |(block, (offset, len))| {
                let chunk = bytes
                    .get(*offset..offset.saturating_add(*len))
                    .unwrap_or_default();
                backend.write_staging(&mut block.staging, chunk);
            },
        );
    }

    /// Synchronous upload: above [`PIPELINE_CHUNK_BYTES`], copies `bytes` through pinned staging on `stream`,
    /// pipelined as an async upload is (host copies of a batch overlap the DMA of the ones before it); up to
    /// that, through a private host copy with the backend's synchronous copy. Then synchronizes `stream`;
    /// returns with the bytes landed and any staging back in the pool. Refused with `UnownedCaptureSource` while any
    /// capture scope is open. Empty `bytes` copy nothing and do not synchronize.
    ///
    /// TensorFold's runtime at the pin describes its synchronous copy as "a private host copy, 64 MiB chunks,
    /// then a sync". This one differs: only an upload of one chunk makes a private host copy (it has nothing to
    /// overlap, and takes no pinned memory); a larger one makes no copy of the whole buffer but goes through
    /// staging in [`PIPELINE_CHUNK_BYTES`] (8 MiB) chunks, so that host copies overlap the DMA and the staging
    /// one upload holds stays within [`PIPELINE_RING_BYTES`]. 64 MiB is [`MAX_CLASS_BYTES`], the largest
    /// staging block, not a chunk size.
    pub fn upload_sync(
        &self,
        context: ContextId,
        stream: B::Stream,
        destination: DeviceAddress,
        bytes: &[u8],
    ) -> Result<(), B> {
        {
            let state = self.shared.state.lock();
            if let Some(open) = state.any_open_capture() {
                return Err(Error::UnownedCaptureSource {
                    operation: "synchronous upload",
                    stream: format!("{open:?}"),
                });
            }
            state.context(context)?;
        }
        if bytes.is_empty() {
            return Ok(());
        }
        check_range(destination, bytes.len())?;
        if bytes.len() <= PIPELINE_CHUNK_BYTES {
            // One chunk has nothing to overlap: a private pageable copy and the backend's
            // synchronous copy, with no pinned memory held afterwards.
            let copy = bytes.to_vec();
            let handle = self.context_handle(context)?;
            self.shared
                .backend
                .copy_sync(handle, destination, &copy)
                .map_err(Error::backend("copy_sync"))?;
            return self.synchronize(stream);
        }
        self.reap_stream_front(stream);
        self.upload_staged(context, stream, destination, bytes, None)?;
        self.synchronize(stream)
    }

    /// Refuses a copy from host memory the runtime does not own (e.g. a caller's pinned buffer) while any
    /// capture scope is open: a captured copy would read it at every replay. Call before such a copy.
    pub fn check_unowned_copy(&self, operation: &'static str) -> Result<(), B> {
        match self.shared.state.lock().any_open_capture() {
            Some(open) => Err(Error::UnownedCaptureSource {
                operation,
                stream: format!("{open:?}"),
            }),
            None => Ok(()),
        }
    }

    /// Refuses a synchronous copy with `CaptureOpen` while any capture scope is open. Call before a
    /// synchronous download that does not go through [`CopySource::download_staged`] (which checks
    /// this itself).
    pub fn check_no_capture(&self, operation: &'static str) -> Result<(), B> {
        match self.shared.state.lock().any_open_capture() {
            Some(open) => Err(Error::CaptureOpen {
                operation,
                stream: format!("{open:?}"),
            }),
            None => Ok(()),
        }
    }

    /// True while any capture scope is open (staged downloads are refused then).
    pub fn capture_open(&self) -> bool {
        self.shared.state.lock().any_open_capture().is_some()
    }

    // ----- downloads -----

    /// Staged download: copies `out.len()` bytes from `source` into `out` through pinned staging on
    /// `stream`, and returns once every byte of `out` is written. The copies are ordered after the
    /// work already enqueued on `stream`.
    ///
    /// Pipelined like an upload, in reverse: the DMA of [`PIPELINE_CHUNK_BYTES`] chunks into pinned
    /// blocks is enqueued in batches of up to [`PIPELINE_LANES`], with a marker behind each batch; at
    /// most [`PIPELINE_DEPTH`] batches are in flight. The oldest batch's marker is waited for, its
    /// blocks are copied into `out` on host threads (one per block) while the later batches' DMA
    /// runs, and then they take the next batch. Blocks come from (and go back to) the context's spare
    /// pool, so repeated downloads pin nothing new; one download holds at most
    /// [`PIPELINE_RING_BYTES`].
    ///
    /// Refused with `CaptureOpen` while any capture scope is open (it waits on the device). On an
    /// error every batch still in flight is waited for (its marker, else a synchronize of `stream`)
    /// before its blocks go back to the pool; blocks that nothing proves landed are leaked, never
    /// reused or freed. Nothing stays pending when this returns. After an error the contents of
    /// `out` are unspecified (parts may be written, the rest untouched).
    pub fn download_staged(
        &self,
        context: ContextId,
        stream: B::Stream,
        source: DeviceAddress,
        out: &mut [MaybeUninit<u8>],
        operation: &'static str,
    ) -> Result<(), B> {
        {
            let state = self.shared.state.lock();
            if let Some(open) = state.any_open_capture() {
                return Err(Error::CaptureOpen {
                    operation,
                    stream: format!("{open:?}"),
                });
            }
            state.context(context)?;
        }
        if out.is_empty() {
            return Ok(());
        }
        check_range(source, out.len())?;
        self.reap_stream_front(stream);
        let lanes = lane_count();
        let mut pieces = out.chunks_mut(PIPELINE_CHUNK_BYTES);
        let mut offset = 0usize;
        let mut ring: VecDeque<Landing<'_, B>> = VecDeque::new();
        // Blocks proven landed and drained (or never enqueued): reused by later batches.
        let mut spare: Vec<Block<B>> = Vec::new();
        let mut failure = None;
        loop {
            while failure.is_none() && ring.len() < PIPELINE_DEPTH {
                let batch: Vec<&mut [MaybeUninit<u8>]> = pieces.by_ref().take(lanes).collect();
                if batch.is_empty() {
                    break;
                }
                let first = offset;
                offset += batch.iter().map(|piece| piece.len()).sum::<usize>();
                let (landing, error) =
                    self.start_landing(context, stream, source, first, batch, &mut spare);
                if let Some(landing) = landing {
                    ring.push_back(landing);
                }
                failure = error;
            }
            if failure.is_some() {
                break;
            }
            let Some(mut landing) = ring.pop_front() else {
                break;
            };
            let (proven, error) = self.wait_landed(stream, landing.marker.take());
            if !proven {
                self.shared.state.lock().leak(landing.blocks);
                failure = error;
                break;
            }
            if let Some(e) = error {
                spare.extend(landing.blocks);
                failure = Some(e);
                break;
            }
            self.drain_landing(&mut landing);
            spare.extend(landing.blocks);
        }
        // Whatever is still in flight lands before its blocks are reused or freed.
        for mut landing in ring {
            let (proven, error) = self.wait_landed(stream, landing.marker.take());
            if proven {
                spare.extend(landing.blocks);
            } else {
                self.shared.state.lock().leak(landing.blocks);
            }
            if let Some(e) = error {
                failure.get_or_insert(e);
            }
        }
        self.release_blocks(spare);
        failure.map_or(Ok(()), Err)
    }

    /// Enqueues the DMA of one batch of a staged download (`pieces` start `first` bytes past
    /// `source`) into blocks from `spare` or the pool, and records a marker behind it. Returns the
    /// batch in flight (none when nothing was enqueued) and the first error; a block whose copy
    /// was not enqueued goes back to `spare`.
    fn start_landing<'o>(
        &self,
        context: ContextId,
        stream: B::Stream,
        source: DeviceAddress,
        first: usize,
        pieces: Vec<&'o mut [MaybeUninit<u8>]>,
        spare: &mut Vec<Block<B>>,
    ) -> (Option<Landing<'o, B>>, Option<Error<B::Error>>) {
        let backend = &self.shared.backend;
        let mut blocks = Vec::with_capacity(pieces.len());
        let mut failure = None;
        let mut offset = first;
        for piece in &pieces {
            let len = piece.len();
            let block = match spare.iter().position(|b| b.bytes >= len) {
                Some(at) => Ok(spare.swap_remove(at)),
                None => self.acquire_block(context, len),
            };
            let mut block = match block {
                Ok(block) => block,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            // In range: `source + out.len()` was checked not to wrap.
            let from = DeviceAddress(source.0.wrapping_add(offset as u64));
            // SAFETY: the block is not read, written or freed until the stream is proven past this
            // copy: it stays in this call's ring until the marker recorded after it was waited for (or
            // the stream was synchronized), and is leaked if neither succeeds. `len` fits the block
            // (chosen by size above).
            let enqueued =
                unsafe { backend.enqueue_download(stream, from, &mut block.staging, len) };
            match enqueued {
                Ok(()) => blocks.push(block),
                Err(e) => {
                    // Nothing was enqueued into this block.
                    spare.push(block);
                    failure = Some(Error::Backend {
                        call: "enqueue_download",
                        source: e,
                    });
                    break;
                }
            }
            offset += len;
        }
        if blocks.is_empty() {
            return (None, failure);
        }
        let marker = match backend.record_marker(stream) {
            Ok(marker) => Some(marker),
            Err(e) => {
                failure.get_or_insert(Error::Backend {
                    call: "record_marker",
                    source: e,
                });
                None
            }
        };
        let landing = Landing {
            blocks,
            pieces,
            marker,
        };
        (Some(landing), failure)
    }

    /// Waits until `stream` is past a batch of a staged download: its marker, else (no marker, or
    /// a failed wait) a synchronize of the stream. Returns whether the batch is proven landed and
    /// the first error seen.
    fn wait_landed(
        &self,
        stream: B::Stream,
        marker: Option<B::Marker>,
    ) -> (bool, Option<Error<B::Error>>) {
        let backend = &self.shared.backend;
        let waited = match marker {
            Some(marker) => {
                let waited = backend.wait_marker(&marker);
                backend.destroy_marker(marker);
                match waited {
                    Ok(()) => return (true, None),
                    Err(e) => Some(Error::Backend {
                        call: "wait_marker",
                        source: e,
                    }),
                }
            }
            None => None,
        };
        match self.synchronize(stream) {
            Ok(()) => (true, waited),
            Err(e) => (false, Some(waited.unwrap_or(e))),
        }
    }

    /// Copies a landed batch's blocks into its pieces of the caller's buffer, one host thread per
    /// block when there are several.
    fn drain_landing(&self, landing: &mut Landing<'_, B>) {
        let backend = &self.shared.backend;
        let mut pairs: Vec<(&Block<B>, &mut &mut [MaybeUninit<u8>])> = landing
            .blocks
            .iter()
            .zip(landing.pieces.iter_mut())
            .collect();
        run_lanes(&mut pairs, "tf-copysource-drain", |(block, piece)| {
            backend.read_staging(&block.staging, piece);
        });
    }

    // ----- streams -----

    /// Synchronizes `stream` through the backend, then releases everything pending on it before the call.
    pub fn synchronize(&self, stream: B::Stream) -> Result<(), B> {
        let snapshot = self.shared.state.lock().next_seq;
        self.shared
            .backend
            .synchronize_stream(stream)
            .map_err(Error::backend("synchronize_stream"))?;
        self.release_stream_before(stream, snapshot);
        Ok(())
    }

    /// Queries `stream` through the backend; when idle, releases everything pending on it before the call.
    pub fn query(&self, stream: B::Stream) -> Result<MarkerState, B> {
        let snapshot = self.shared.state.lock().next_seq;
        let state = self
            .shared
            .backend
            .query_stream(stream)
            .map_err(Error::backend("query_stream"))?;
        if state == MarkerState::Done {
            self.release_stream_before(stream, snapshot);
        }
        Ok(state)
    }

    /// Call before destroying `stream`: its pending entries are kept (with their markers, which outlive the
    /// stream) and released by [`CopySource::reap`] once proven done. Already finished ones are released now.
    pub fn retire_stream(&self, stream: B::Stream) {
        {
            let mut state = self.shared.state.lock();
            if let Some(list) = state.streams.remove(&stream) {
                state.orphans.extend(list);
            }
        }
        // Best effort: an error leaves the entries for a later reap.
        let _ = self.reap();
    }

    /// Releases (pools or frees) every pending block whose marker says the GPU is done with it. Returns the
    /// number of entries released. A marker that reports an execution fault leaks its blocks (nothing can prove
    /// the GPU is done with them) and the first such error is returned after the rest are processed.
    pub fn reap(&self) -> Result<usize, B> {
        let backend = &self.shared.backend;
        let mut released = Released::default();
        let mut faulted = Vec::new();
        let mut first_error = None;
        {
            let mut state = self.shared.state.lock();
            let state = &mut *state;
            let mut classify =
                |entry: PendingEntry<B>, keep: &mut dyn FnMut(PendingEntry<B>)| match &entry.marker
                {
                    Some(marker) => match backend.query_marker(marker) {
                        Ok(MarkerState::Done) => released.entries.push(entry),
                        Ok(MarkerState::Pending) => keep(entry),
                        Err(e) => {
                            first_error.get_or_insert(Error::Backend {
                                call: "query_marker",
                                source: e,
                            });
                            faulted.push(entry);
                        }
                    },
                    None => keep(entry),
                };
            for list in state.streams.values_mut() {
                let mut kept = VecDeque::with_capacity(list.len());
                for entry in list.drain(..) {
                    classify(entry, &mut |e| kept.push_back(e));
                }
                *list = kept;
            }
            let mut kept = Vec::new();
            for entry in std::mem::take(&mut state.orphans) {
                classify(entry, &mut |e| kept.push(e));
            }
            state.orphans = kept;
            state.streams.retain(|_, list| !list.is_empty());
        }
        let count = released.entries.len();
        self.finish_release(released);
        for mut entry in faulted {
            if let Some(marker) = entry.marker.take() {
                backend.destroy_marker(marker);
            }
            match entry.payload {
                Payload::Blocks(blocks) => self.shared.state.lock().leak(blocks),
                Payload::Captured(captured) => drop(captured),
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(count),
        }
    }

    /// Releases finished entries at the front of one stream's list (cheap; run before each upload).
    fn reap_stream_front(&self, stream: B::Stream) {
        let backend = &self.shared.backend;
        let mut released = Released::default();
        {
            let mut state = self.shared.state.lock();
            if let Some(list) = state.streams.get_mut(&stream) {
                while let Some(front) = list.front() {
                    let done = match &front.marker {
                        Some(marker) => {
                            matches!(backend.query_marker(marker), Ok(MarkerState::Done))
                        }
                        None => false,
                    };
                    if !done {
                        break;
                    }
                    if let Some(entry) = list.pop_front() {
                        released.entries.push(entry);
                    }
                }
            }
        }
        self.finish_release(released);
    }

    fn release_stream_before(&self, stream: B::Stream, snapshot: u64) {
        let mut released = Released::default();
        {
            let mut state = self.shared.state.lock();
            if let Some(list) = state.streams.get_mut(&stream) {
                let (done, rest): (VecDeque<_>, VecDeque<_>) =
                    list.drain(..).partition(|e| e.seq < snapshot);
                *list = rest;
                released.entries.extend(done);
                if list.is_empty() {
                    state.streams.remove(&stream);
                }
            }
        }
        self.finish_release(released);
    }

    fn push_pending(
        &self,
        context: ContextId,
        stream: B::Stream,
        marker: Option<B::Marker>,
        payload: Payload<B>,
    ) {
        let mut state = self.shared.state.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        state
            .streams
            .entry(stream)
            .or_default()
            .push_back(PendingEntry {
                seq,
                context,
                stream,
                marker,
                payload,
            });
    }

    /// Runs outside the state lock: destroys markers, pools or frees blocks, drops captured references.
    fn finish_release(&self, released: Released<B>) {
        for mut entry in released.entries {
            if let Some(marker) = entry.marker.take() {
                self.shared.backend.destroy_marker(marker);
            }
            match entry.payload {
                Payload::Blocks(blocks) => self.release_blocks(blocks),
                Payload::Captured(captured) => drop(captured),
            }
        }
    }

    // ----- staging pool -----

    fn acquire_block(&self, context: ContextId, len: usize) -> Result<Block<B>, B> {
        let Some((class, bytes)) = classes::class_for(len) else {
            return Err(Error::OutOfStaging {
                requested: len,
                in_use: 0,
                limit: MAX_CLASS_BYTES,
            });
        };
        let mut tried_to_make_room = false;
        let handle = loop {
            let mut state = self.shared.state.lock();
            let slot = state.context_mut(context).ok_or(Error::UnknownContext {
                slot: context.slot,
                generation: context.generation,
            })?;
            if let Some(staging) = slot.spares.get_mut(class).and_then(Vec::pop) {
                slot.spare_bytes = slot.spare_bytes.saturating_sub(bytes);
                return Ok(Block {
                    staging,
                    context,
                    class,
                    bytes,
                });
            }
            let handle = slot.handle;
            match self.shared.config.staging_limit_bytes {
                Some(limit) if state.staging_bytes + bytes > limit => {
                    if tried_to_make_room {
                        return Err(Error::OutOfStaging {
                            requested: bytes,
                            in_use: state.staging_bytes,
                            limit,
                        });
                    }
                    drop(state);
                    tried_to_make_room = true;
                    let _ = self.reap();
                    self.drop_all_spares();
                }
                _ => {
                    state.staging_bytes += bytes;
                    break handle;
                }
            }
        };
        let backend = &self.shared.backend;
        let staging = match backend.alloc_staging(handle, bytes) {
            Ok(staging) => Ok(staging),
            Err(_) => {
                // Give the memory of every spare back and try once more.
                self.drop_all_spares();
                backend.alloc_staging(handle, bytes)
            }
        };
        match staging {
            Ok(staging) => Ok(Block {
                staging,
                context,
                class,
                bytes,
            }),
            Err(e) => {
                let mut state = self.shared.state.lock();
                state.staging_bytes = state.staging_bytes.saturating_sub(bytes);
                Err(Error::Backend {
                    call: "alloc_staging",
                    source: e,
                })
            }
        }
    }

    /// Returns finished blocks to their contexts' pools, freeing what does not fit. Never under the lock.
    fn release_blocks(&self, blocks: Vec<Block<B>>) {
        let mut to_free = Vec::new();
        {
            let mut state = self.shared.state.lock();
            let cap = self.shared.config.max_spare_bytes_per_context;
            let mut gone = Vec::new();
            for block in blocks {
                let Some(slot) = state.context_mut(block.context) else {
                    // The context was torn down while a capture still held this block: its memory went
                    // with the context, and nothing proves the GPU is done with it.
                    gone.push(block);
                    continue;
                };
                match slot.spares.get_mut(block.class) {
                    Some(list) if slot.spare_bytes + block.bytes <= cap => {
                        slot.spare_bytes += block.bytes;
                        list.push(block.staging);
                    }
                    _ => to_free.push((slot.handle, block)),
                }
            }
            state.leak(gone);
            let freed: usize = to_free.iter().map(|(_, b)| b.bytes).sum();
            state.staging_bytes = state.staging_bytes.saturating_sub(freed);
        }
        for (handle, block) in to_free {
            // A failed free leaves the memory allocated; nothing reads it any more.
            let _ = self.shared.backend.free_staging(handle, block.staging);
        }
    }

    /// Frees every context's spare blocks (e.g. before retrying a failed allocation).
    pub fn drop_all_spares(&self) {
        let mut to_free = Vec::new();
        {
            let mut state = self.shared.state.lock();
            let mut freed = 0;
            for slot in state.contexts.iter_mut().flatten() {
                for list in slot.spares.iter_mut() {
                    to_free.extend(list.drain(..).map(|s| (slot.handle, s)));
                }
                freed += slot.spare_bytes;
                slot.spare_bytes = 0;
            }
            state.staging_bytes = state.staging_bytes.saturating_sub(freed);
        }
        for (handle, staging) in to_free {
            let _ = self.shared.backend.free_staging(handle, staging);
        }
    }

    // ----- capture -----

    /// Opens a capture scope on `stream` (call right before the driver's begin-capture). While any scope is
    /// open, synchronous uploads and copies from unowned host memory are refused. The returned guard closes
    /// the scope when dropped unless [`CaptureScope::end`] was called after a successful end-capture.
    pub fn begin_capture(
        &self,
        context: ContextId,
        stream: B::Stream,
    ) -> Result<CaptureScope<B>, B> {
        let mut state = self.shared.state.lock();
        state.context(context)?;
        if state.captures.contains_key(&stream) {
            return Err(Error::CaptureAlreadyOpen {
                stream: format!("{stream:?}"),
            });
        }
        let scope_id = state.next_scope_id;
        state.next_scope_id += 1;
        state.captures.insert(
            stream,
            OpenCapture {
                scope_id,
                context,
                blocks: Vec::new(),
                adopted: Vec::new(),
            },
        );
        Ok(CaptureScope {
            shared: Arc::clone(&self.shared),
            stream,
            scope_id,
            open: true,
        })
    }

    /// Call after each launch of a graph executable built with `sources` on `stream`: the sources stay alive
    /// at least until the stream is proven past this launch, even if the executable is dropped sooner.
    pub fn graph_launched(&self, sources: &CapturedSources<B>, stream: B::Stream) -> Result<(), B> {
        if sources.inner.blocks.is_empty() && sources.inner.adopted.is_empty() {
            return Ok(());
        }
        let marker = self.shared.backend.record_marker(stream);
        let (marker, error) = match marker {
            Ok(m) => (Some(m), None),
            Err(e) => (
                None,
                Some(Error::Backend {
                    call: "record_marker",
                    source: e,
                }),
            ),
        };
        self.push_pending(
            sources.inner.context,
            stream,
            marker,
            Payload::Captured(Arc::clone(&sources.inner)),
        );
        error.map_or(Ok(()), Err)
    }
}

/// Host threads one upload copies with: [`PIPELINE_LANES`], or fewer on a smaller machine.
fn lane_count() -> usize {
    static LANES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LANES.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, PIPELINE_LANES)
    })
}

/// Runs `work` on every item, one host thread each when there are several: the calling thread
/// takes the first, and an item whose thread cannot be started is done here afterwards.
fn run_lanes<T: Send>(items: &mut [T], name: &str, work: impl Fn(&mut T) + Sync) {
    if items.len() < 2 {
        items.iter_mut().for_each(&work);
        return;
    }
    let mut not_started = Vec::new();
    std::thread::scope(|scope| {
        let work = &work;
        let mut rest = items.iter_mut().enumerate();
        let mine = rest.next();
        for (at, item) in rest {
            let started = std::thread::Builder::new()
                .name(name.into())
                .spawn_scoped(scope, move || work(item));
            if started.is_err() {
                not_started.push(at);
            }
        }
        if let Some((_, item)) = mine {
            work(item);
        }
    });
    for at in not_started {
        if let Some(item) = items.get_mut(at) {
            work(item);
        }
    }
}

fn check_range<E: std::error::Error + 'static>(
    destination: DeviceAddress,
    len: usize,
) -> std::result::Result<(), Error<E>> {
    match destination.offset(len) {
        Some(_) => Ok(()),
        None => Err(Error::AddressOverflow {
            destination: destination.0,
            len,
        }),
    }
}

/// An open capture scope on one stream. Dropping it without [`CaptureScope::end`] closes (discards) the scope
/// and releases what it owned: drop it only after the driver capture was ended or abandoned and any graph
/// made from it destroyed.
pub struct CaptureScope<B: Backend> {
    shared: Arc<Shared<B>>,
    stream: B::Stream,
    scope_id: u64,
    open: bool,
}

impl<B: Backend> fmt::Debug for CaptureScope<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaptureScope")
            .field("stream", &self.stream)
            .field("scope_id", &self.scope_id)
            .finish()
    }
}

impl<B: Backend> CaptureScope<B> {
    /// The captured stream.
    pub fn stream(&self) -> B::Stream {
        self.stream
    }

    /// Moves `source` into the capture; its bytes stay valid (at the returned range) for as long as the
    /// graph executables built from this capture live. Use it for copy nodes reading caller-provided bytes.
    pub fn adopt<S: HostSource>(&self, source: S) -> HostRange {
        let bytes = source.host_bytes();
        let range = HostRange {
            address: bytes.as_ptr() as usize,
            len: bytes.len(),
        };
        let boxed: Box<dyn Any + Send + Sync> = Box::new(source);
        let mut state = self.shared.state.lock();
        match state.captures.get_mut(&self.stream) {
            Some(open) if open.scope_id == self.scope_id => open.adopted.push(boxed),
            _ => {
                drop(state);
                // Not open any more (cannot happen through this guard): keep the bytes alive for good.
                std::mem::forget(boxed);
            }
        }
        range
    }

    /// Closes the scope after the driver's end-capture succeeded, handing its sources to the caller, who keeps
    /// them with the graph and every executable instantiated from it.
    pub fn end(mut self) -> CapturedSources<B> {
        self.open = false;
        let open = {
            let mut state = self.shared.state.lock();
            match state.captures.get(&self.stream) {
                Some(open) if open.scope_id == self.scope_id => state.captures.remove(&self.stream),
                _ => None,
            }
        };
        let (context, blocks, adopted) = match open {
            Some(open) => (Some(open.context), open.blocks, open.adopted),
            None => (None, Vec::new(), Vec::new()),
        };
        let context = context.unwrap_or(ContextId {
            slot: usize::MAX,
            generation: 0,
        });
        CapturedSources {
            inner: Arc::new(CapturedInner {
                shared: Arc::downgrade(&self.shared),
                context,
                blocks,
                adopted,
            }),
        }
    }
}

impl<B: Backend> Drop for CaptureScope<B> {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let open = {
            let mut state = self.shared.state.lock();
            match state.captures.get(&self.stream) {
                Some(open) if open.scope_id == self.scope_id => state.captures.remove(&self.stream),
                _ => None,
            }
        };
        if let Some(open) = open {
            // The capture was discarded: no graph replays these copies.
            let source = CopySource {
                shared: Arc::clone(&self.shared),
            };
            source.release_blocks(open.blocks);
            drop(open.adopted);
        }
    }
}

struct CapturedInner<B: Backend> {
    shared: Weak<Shared<B>>,
    context: ContextId,
    blocks: Vec<Block<B>>,
    adopted: Vec<Box<dyn Any + Send + Sync>>,
}

impl<B: Backend> Drop for CapturedInner<B> {
    fn drop(&mut self) {
        let blocks = std::mem::take(&mut self.blocks);
        match self.shared.upgrade() {
            Some(shared) => CopySource { shared }.release_blocks(blocks),
            None => {
                // The copy source is gone; leaking is the only safe choice.
                for block in blocks {
                    std::mem::forget(block.staging);
                }
            }
        }
    }
}

/// The host memory a captured graph reads: staging blocks of uploads made during the capture and adopted
/// sources. Keep it with the graph and every executable built from it; report each launch with
/// [`CopySource::graph_launched`]. Drop it only after the driver graph and executables that read it are
/// destroyed (declare it after them in the owning struct); launches still in flight then keep it alive.
/// Cheap to clone.
pub struct CapturedSources<B: Backend> {
    inner: Arc<CapturedInner<B>>,
}

impl<B: Backend> Clone for CapturedSources<B> {
    fn clone(&self) -> Self {
        CapturedSources {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: Backend> fmt::Debug for CapturedSources<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CapturedSources")
            .field("blocks", &self.inner.blocks.len())
            .field("adopted", &self.inner.adopted.len())
            .finish()
    }
}

impl<B: Backend> CapturedSources<B> {
    /// Staging blocks owned (one per captured upload chunk).
    pub fn block_count(&self) -> usize {
        self.inner.blocks.len()
    }

    /// Adopted host sources owned.
    pub fn adopted_count(&self) -> usize {
        self.inner.adopted.len()
    }
}

impl<B: Backend> Drop for Shared<B> {
    fn drop(&mut self) {
        // Last handle gone: wait for what is pending, then free; leak what cannot be proven done.
        let state = self.state.get_mut();
        let entries: Vec<PendingEntry<B>> = state
            .streams
            .drain()
            .flat_map(|(_, list)| list)
            .chain(state.orphans.drain(..))
            .collect();
        let handles: Vec<Option<B::Context>> = state
            .contexts
            .iter()
            .map(|slot| slot.as_ref().map(|s| s.handle))
            .collect();
        for mut entry in entries {
            let proven = entry
                .marker
                .as_ref()
                .is_some_and(|m| self.backend.wait_marker(m).is_ok());
            if let Some(marker) = entry.marker.take() {
                self.backend.destroy_marker(marker);
            }
            if let Payload::Blocks(blocks) = entry.payload {
                for block in blocks {
                    match handles.get(block.context.slot).copied().flatten() {
                        Some(handle) if proven => {
                            let _ = self.backend.free_staging(handle, block.staging);
                        }
                        _ => std::mem::forget(block.staging),
                    }
                }
            }
        }
        for slot in state.contexts.iter_mut().flatten() {
            for staging in slot.spares.drain(..).flatten() {
                let _ = self.backend.free_staging(slot.handle, staging);
            }
        }
        for (_, open) in state.captures.drain() {
            for block in open.blocks {
                std::mem::forget(block.staging);
            }
        }
    }
}
