//! A deterministic mock [`Backend`]: a fake GPU over host memory that executes queued work lazily.
//!
//! Streams are FIFO queues of copies and markers; nothing runs until the test says so
//! ([`MockBackend::advance`], [`MockBackend::run_all`]) or a synchronize / marker wait forces it. Each executed
//! copy is recorded with the bytes it read and whether its source was still intact (not freed, not rewritten).
//! Every free or rewrite of a staging block that a queued copy or a live captured graph still reads is
//! recorded as a violation, so a test can prove the bookkeeping never releases a source too early.
//! Downloads into staging ([`Backend::enqueue_download`]) read device bytes placed with
//! [`MockBackend::set_device_bytes`] (or uploaded) when they run; reading, rewriting or freeing a block that a
//! queued download still writes is a violation too.
//! Captures are simulated too ([`MockBackend::begin_capture`], [`MockBackend::end_capture`],
//! [`MockBackend::launch`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{Backend, DeviceAddress, MarkerState};

/// A mock context handle.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct MockContext(pub u32);

/// A mock stream handle. Any id names a stream; streams need no creation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct MockStream(pub u32);

/// A mock completion marker.
#[derive(Debug)]
pub struct MockMarker {
    id: u64,
    stream: MockStream,
}

/// A mock pinned staging block (host memory watched by the mock).
#[derive(Debug)]
pub struct MockStaging {
    block: Arc<BlockMemory>,
}

#[derive(Debug)]
struct BlockMemory {
    id: u64,
    data: Mutex<Vec<u8>>,
    /// Bumped on every write and on free: a copy that saw another generation read changed bytes.
    generation: AtomicU64,
    freed: AtomicBool,
    /// Queued (not yet executed) copies reading this block.
    in_flight: AtomicUsize,
    /// Captures and live graphs whose copy nodes read this block.
    in_graphs: AtomicUsize,
}

/// Errors the mock reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MockError {
    /// A failure injected by the test.
    #[error("injected failure of {call}")]
    Injected {
        /// The failing call.
        call: &'static str,
    },
    /// An operation the driver refuses on a capturing stream.
    #[error("{call} is not permitted on capturing stream {stream}")]
    Capturing {
        /// The refused call.
        call: &'static str,
        /// The stream id.
        stream: u32,
    },
    /// A download from device memory the mock holds no bytes for.
    #[error("download of {len} bytes from {address:#x}: no device bytes there")]
    NotOnDevice {
        /// Source address.
        address: u64,
        /// Requested length.
        len: usize,
    },
    /// A copy larger than its staging block.
    #[error("copy of {len} bytes from a {capacity}-byte staging block")]
    TooLong {
        /// Requested length.
        len: usize,
        /// Block size.
        capacity: usize,
    },
}

/// One executed copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyRecord {
    /// Stream it ran on (`None` for synchronous copies).
    pub stream: Option<MockStream>,
    /// Destination.
    pub destination: DeviceAddress,
    /// The bytes it read.
    pub bytes: Vec<u8>,
    /// Whether the source was still allocated and unmodified since the copy was enqueued (or captured).
    pub source_intact: bool,
    /// Whether it ran as a node of a launched graph.
    pub from_graph: bool,
}

#[derive(Debug)]
struct QueuedCopy {
    block: Arc<BlockMemory>,
    generation: u64,
    len: usize,
    destination: DeviceAddress,
    from_graph: bool,
}

#[derive(Debug)]
struct QueuedDownload {
    block: Arc<BlockMemory>,
    bytes: Vec<u8>,
}

#[derive(Debug)]
enum Op {
    Copy(QueuedCopy),
    Download(QueuedDownload),
    Marker(u64),
}

#[derive(Debug, Default)]
struct MockState {
    queues: HashMap<MockStream, VecDeque<Op>>,
    capturing: HashMap<MockStream, Vec<GraphNode>>,
    executed_markers: HashSet<u64>,
    live_markers: HashSet<u64>,
    next_marker: u64,
    next_block: u64,
    live_blocks: usize,
    live_staging_bytes: usize,
    allocations: u64,
    copies: Vec<CopyRecord>,
    device: HashMap<DeviceAddress, Vec<u8>>,
    violations: Vec<String>,
    fail_next: HashMap<&'static str, u32>,
    fail_at: HashMap<&'static str, u32>,
    staging_limit: Option<usize>,
    faulted: bool,
    downloads: u64,
}

#[derive(Debug)]
struct GraphNode {
    block: Arc<BlockMemory>,
    generation: u64,
    len: usize,
    destination: DeviceAddress,
}

/// A captured mock graph: its copy nodes read their staging blocks at every launch.
#[derive(Debug)]
pub struct MockGraph {
    nodes: Vec<GraphNode>,
}

impl Drop for MockGraph {
    fn drop(&mut self) {
        for node in &self.nodes {
            node.block.in_graphs.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The mock backend. Cheap to clone; clones share one fake GPU.
#[derive(Clone, Debug, Default)]
pub struct MockBackend {
    state: Arc<Mutex<MockState>>,
}

impl MockBackend {
    /// A fresh fake GPU with nothing queued.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `count` calls of `call` (a trait method name, e.g. `"alloc_staging"`) fail.
    pub fn fail_next(&self, call: &'static str, count: u32) {
        self.state.lock().fail_next.insert(call, count);
    }

    /// Makes the `nth` call of `call` from now (1-based) fail once; the calls before it succeed.
    pub fn fail_nth(&self, call: &'static str, nth: u32) {
        self.state.lock().fail_at.insert(call, nth.max(1));
    }

    /// Caps the live staging bytes; allocations past it fail.
    pub fn set_staging_limit(&self, limit: Option<usize>) {
        self.state.lock().staging_limit = limit;
    }

    /// Simulates an execution fault: every marker query and wait fails from now on.
    pub fn set_faulted(&self, faulted: bool) {
        self.state.lock().faulted = faulted;
    }

    /// Executes up to `count` queued operations of `stream`; returns how many ran.
    pub fn advance(&self, stream: MockStream, count: usize) -> usize {
        let mut state = self.state.lock();
        let mut ran = 0;
        while ran < count && state.execute_one(stream) {
            ran += 1;
        }
        ran
    }

    /// Executes everything queued on every stream.
    pub fn run_all(&self) {
        let mut state = self.state.lock();
        let streams: Vec<MockStream> = state.queues.keys().copied().collect();
        for stream in streams {
            while state.execute_one(stream) {}
        }
    }

    /// Operations queued (not executed) on `stream`.
    pub fn queued(&self, stream: MockStream) -> usize {
        self.state
            .lock()
            .queues
            .get(&stream)
            .map_or(0, VecDeque::len)
    }

    /// Starts capturing `stream`: copies enqueued on it become graph nodes until [`MockBackend::end_capture`].
    pub fn begin_capture(&self, stream: MockStream) {
        self.state.lock().capturing.insert(stream, Vec::new());
    }

    /// Ends the capture of `stream`, returning its graph (`None` if it was not capturing).
    pub fn end_capture(&self, stream: MockStream) -> Option<MockGraph> {
        self.state
            .lock()
            .capturing
            .remove(&stream)
            .map(|nodes| MockGraph { nodes })
    }

    /// Abandons the capture of `stream` (as a failed end-capture does): its nodes are discarded.
    pub fn abort_capture(&self, stream: MockStream) {
        drop(self.end_capture(stream));
    }

    /// Queues every copy node of `graph` on `stream`.
    pub fn launch(&self, graph: &MockGraph, stream: MockStream) {
        let mut state = self.state.lock();
        for node in &graph.nodes {
            node.block.in_flight.fetch_add(1, Ordering::SeqCst);
            let copy = QueuedCopy {
                block: Arc::clone(&node.block),
                generation: node.generation,
                len: node.len,
                destination: node.destination,
                from_graph: true,
            };
            state
                .queues
                .entry(stream)
                .or_default()
                .push_back(Op::Copy(copy));
        }
    }

    /// Every executed copy, in execution order.
    pub fn copies(&self) -> Vec<CopyRecord> {
        self.state.lock().copies.clone()
    }

    /// The bytes last copied to `destination` (keyed by a copy's start address).
    pub fn device_bytes(&self, destination: DeviceAddress) -> Option<Vec<u8>> {
        self.state.lock().device.get(&destination).cloned()
    }

    /// Places `bytes` in device memory at `address` (read by downloads that lie inside them).
    pub fn set_device_bytes(&self, address: DeviceAddress, bytes: Vec<u8>) {
        self.state.lock().device.insert(address, bytes);
    }

    /// Downloads executed so far.
    pub fn downloads(&self) -> u64 {
        self.state.lock().downloads
    }

    /// Early releases seen: frees or rewrites of staging still read by queued copies or live graphs,
    /// double frees, and copies that read a changed source.
    pub fn violations(&self) -> Vec<String> {
        self.state.lock().violations.clone()
    }

    /// Staging blocks allocated and not freed.
    pub fn live_blocks(&self) -> usize {
        self.state.lock().live_blocks
    }

    /// Staging allocations made so far.
    pub fn allocations(&self) -> u64 {
        self.state.lock().allocations
    }

    /// Markers recorded and not destroyed.
    pub fn live_markers(&self) -> usize {
        self.state.lock().live_markers.len()
    }

    /// Operations queued on all streams.
    pub fn queued_total(&self) -> usize {
        self.state.lock().queues.values().map(VecDeque::len).sum()
    }
}

impl MockState {
    fn injected(&mut self, call: &'static str) -> Result<(), MockError> {
        if let Some(left) = self.fail_at.get_mut(call) {
            *left -= 1;
            if *left == 0 {
                self.fail_at.remove(call);
                return Err(MockError::Injected { call });
            }
        }
        match self.fail_next.get_mut(call) {
            Some(left) if *left > 0 => {
                *left -= 1;
                Err(MockError::Injected { call })
            }
            _ => Ok(()),
        }
    }

    fn execute_one(&mut self, stream: MockStream) -> bool {
        let Some(op) = self.queues.get_mut(&stream).and_then(VecDeque::pop_front) else {
            return false;
        };
        match op {
            Op::Marker(id) => {
                self.executed_markers.insert(id);
            }
            Op::Download(download) => {
                let mut data = download.block.data.lock();
                match data.get_mut(..download.bytes.len()) {
                    Some(target) => target.copy_from_slice(&download.bytes),
                    None => self.violations.push(format!(
                        "download of {} bytes into {}-byte staging block {}",
                        download.bytes.len(),
                        data.len(),
                        download.block.id
                    )),
                }
                drop(data);
                download.block.generation.fetch_add(1, Ordering::SeqCst);
                download.block.in_flight.fetch_sub(1, Ordering::SeqCst);
                self.downloads += 1;
            }
            Op::Copy(copy) => {
                let intact = !copy.block.freed.load(Ordering::SeqCst)
                    && copy.block.generation.load(Ordering::SeqCst) == copy.generation;
                let bytes = copy
                    .block
                    .data
                    .lock()
                    .get(..copy.len)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default();
                copy.block.in_flight.fetch_sub(1, Ordering::SeqCst);
                if !intact {
                    self.violations.push(format!(
                        "copy to {:#x} on {stream:?} read staging block {} after it was freed or rewritten",
                        copy.destination.0, copy.block.id
                    ));
                }
                self.device.insert(copy.destination, bytes.clone());
                self.copies.push(CopyRecord {
                    stream: Some(stream),
                    destination: copy.destination,
                    bytes,
                    source_intact: intact,
                    from_graph: copy.from_graph,
                });
            }
        }
        true
    }

    fn run_until_marker(&mut self, stream: MockStream, marker: u64) {
        while !self.executed_markers.contains(&marker) {
            if !self.execute_one(stream) {
                break;
            }
        }
    }

    fn check_unread(&mut self, block: &BlockMemory, what: &str) {
        let in_flight = block.in_flight.load(Ordering::SeqCst);
        let in_graphs = block.in_graphs.load(Ordering::SeqCst);
        if in_flight > 0 || in_graphs > 0 {
            self.violations.push(format!(
                "staging block {} {what} while {in_flight} queued copies and {in_graphs} graphs still read it",
                block.id
            ));
        }
    }
}

impl Backend for MockBackend {
    type Context = MockContext;
    type Stream = MockStream;
    type Marker = MockMarker;
    type Staging = MockStaging;
    type Error = MockError;

    fn alloc_staging(&self, _context: MockContext, len: usize) -> Result<MockStaging, MockError> {
        let mut state = self.state.lock();
        state.injected("alloc_staging")?;
        if let Some(limit) = state.staging_limit {
            if state.live_staging_bytes + len > limit {
                return Err(MockError::Injected {
                    call: "alloc_staging (staging limit)",
                });
            }
        }
        state.next_block += 1;
        state.live_blocks += 1;
        state.allocations += 1;
        state.live_staging_bytes += len;
        let block = BlockMemory {
            id: state.next_block,
            data: Mutex::new(vec![0xA5; len]),
            generation: AtomicU64::new(0),
            freed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            in_graphs: AtomicUsize::new(0),
        };
        Ok(MockStaging {
            block: Arc::new(block),
        })
    }

    fn staging_len(&self, block: &MockStaging) -> usize {
        block.block.data.lock().len()
    }

    fn write_staging(&self, block: &mut MockStaging, bytes: &[u8]) {
        let mut state = self.state.lock();
        state.check_unread(&block.block, "rewritten");
        if block.block.freed.load(Ordering::SeqCst) {
            state.violations.push(format!(
                "staging block {} written after free",
                block.block.id
            ));
        }
        block.block.generation.fetch_add(1, Ordering::SeqCst);
        let mut data = block.block.data.lock();
        match data.get_mut(..bytes.len()) {
            Some(target) => target.copy_from_slice(bytes),
            None => state.violations.push(format!(
                "write of {} bytes into {}-byte staging block {}",
                bytes.len(),
                data.len(),
                block.block.id
            )),
        }
    }

    fn free_staging(&self, _context: MockContext, block: MockStaging) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("free_staging")?;
        state.check_unread(&block.block, "freed");
        if block.block.freed.swap(true, Ordering::SeqCst) {
            state
                .violations
                .push(format!("staging block {} freed twice", block.block.id));
            return Ok(());
        }
        block.block.generation.fetch_add(1, Ordering::SeqCst);
        state.live_blocks = state.live_blocks.saturating_sub(1);
        let len = block.block.data.lock().len();
        state.live_staging_bytes = state.live_staging_bytes.saturating_sub(len);
        Ok(())
    }

    unsafe fn enqueue_copy(
        &self,
        stream: MockStream,
        destination: DeviceAddress,
        source: &MockStaging,
        len: usize,
    ) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("enqueue_copy")?;
        let capacity = source.block.data.lock().len();
        if len > capacity {
            return Err(MockError::TooLong { len, capacity });
        }
        let generation = source.block.generation.load(Ordering::SeqCst);
        if let Some(nodes) = state.capturing.get_mut(&stream) {
            source.block.in_graphs.fetch_add(1, Ordering::SeqCst);
            nodes.push(GraphNode {
                block: Arc::clone(&source.block),
                generation,
                len,
                destination,
            });
            return Ok(());
        }
        source.block.in_flight.fetch_add(1, Ordering::SeqCst);
        let copy = QueuedCopy {
            block: Arc::clone(&source.block),
            generation,
            len,
            destination,
            from_graph: false,
        };
        state
            .queues
            .entry(stream)
            .or_default()
            .push_back(Op::Copy(copy));
        Ok(())
    }

    unsafe fn enqueue_download(
        &self,
        stream: MockStream,
        source: DeviceAddress,
        destination: &mut MockStaging,
        len: usize,
    ) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("enqueue_download")?;
        let capacity = destination.block.data.lock().len();
        if len > capacity {
            return Err(MockError::TooLong { len, capacity });
        }
        if state.capturing.contains_key(&stream) {
            return Err(MockError::Capturing {
                call: "enqueue_download",
                stream: stream.0,
            });
        }
        state.check_unread(&destination.block, "written by a download");
        // The bytes are taken now; the block is written when the download runs.
        let bytes = state
            .device
            .iter()
            .find_map(|(start, held)| {
                let skip = usize::try_from(source.0.checked_sub(start.0)?).ok()?;
                held.get(skip..skip.checked_add(len)?)
            })
            .map(<[u8]>::to_vec)
            .ok_or(MockError::NotOnDevice {
                address: source.0,
                len,
            })?;
        destination.block.in_flight.fetch_add(1, Ordering::SeqCst);
        let download = QueuedDownload {
            block: Arc::clone(&destination.block),
            bytes,
        };
        state
            .queues
            .entry(stream)
            .or_default()
            .push_back(Op::Download(download));
        Ok(())
    }

    fn read_staging(&self, block: &MockStaging, out: &mut [MaybeUninit<u8>]) {
        let mut state = self.state.lock();
        state.check_unread(&block.block, "read by the host");
        if block.block.freed.load(Ordering::SeqCst) {
            state
                .violations
                .push(format!("staging block {} read after free", block.block.id));
        }
        let data = block.block.data.lock();
        if out.len() > data.len() {
            state.violations.push(format!(
                "read of {} bytes from {}-byte staging block {}",
                out.len(),
                data.len(),
                block.block.id
            ));
        }
        let held = data.iter().copied().chain(std::iter::repeat(0));
        for (slot, byte) in out.iter_mut().zip(held) {
            slot.write(byte);
        }
    }

    fn record_marker(&self, stream: MockStream) -> Result<MockMarker, MockError> {
        let mut state = self.state.lock();
        state.injected("record_marker")?;
        if state.capturing.contains_key(&stream) {
            return Err(MockError::Capturing {
                call: "record_marker",
                stream: stream.0,
            });
        }
        state.next_marker += 1;
        let id = state.next_marker;
        state.live_markers.insert(id);
        state
            .queues
            .entry(stream)
            .or_default()
            .push_back(Op::Marker(id));
        Ok(MockMarker { id, stream })
    }

    fn query_marker(&self, marker: &MockMarker) -> Result<MarkerState, MockError> {
        let mut state = self.state.lock();
        state.injected("query_marker")?;
        if state.faulted {
            return Err(MockError::Injected {
                call: "query_marker (execution fault)",
            });
        }
        Ok(if state.executed_markers.contains(&marker.id) {
            MarkerState::Done
        } else {
            MarkerState::Pending
        })
    }

    fn wait_marker(&self, marker: &MockMarker) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("wait_marker")?;
        if state.faulted {
            return Err(MockError::Injected {
                call: "wait_marker (execution fault)",
            });
        }
        state.run_until_marker(marker.stream, marker.id);
        Ok(())
    }

    fn destroy_marker(&self, marker: MockMarker) {
        let mut state = self.state.lock();
        state.live_markers.remove(&marker.id);
        state.executed_markers.remove(&marker.id);
    }

    fn synchronize_stream(&self, stream: MockStream) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("synchronize_stream")?;
        if state.capturing.contains_key(&stream) {
            return Err(MockError::Capturing {
                call: "synchronize_stream",
                stream: stream.0,
            });
        }
        while state.execute_one(stream) {}
        Ok(())
    }

    fn query_stream(&self, stream: MockStream) -> Result<MarkerState, MockError> {
        let mut state = self.state.lock();
        state.injected("query_stream")?;
        let idle = state.queues.get(&stream).is_none_or(VecDeque::is_empty);
        Ok(if idle {
            MarkerState::Done
        } else {
            MarkerState::Pending
        })
    }

    fn copy_sync(
        &self,
        _context: MockContext,
        destination: DeviceAddress,
        source: &[u8],
    ) -> Result<(), MockError> {
        let mut state = self.state.lock();
        state.injected("copy_sync")?;
        state.device.insert(destination, source.to_vec());
        state.copies.push(CopyRecord {
            stream: None,
            destination,
            bytes: source.to_vec(),
            source_intact: true,
            from_graph: false,
        });
        Ok(())
    }
}
