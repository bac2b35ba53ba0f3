//! The fake driver's process-wide state and the semantics of streams, events, captures and graphs.

use std::alloc::Layout;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_int, c_uint};
use std::sync::{Mutex, MutexGuard};

use tf_sys::result::is_sticky;
use tf_sys::types::{code, CUresult};

use crate::kernels::KERNELS;

pub(crate) type R = Result<(), CUresult>;

/// Device memory the fake reports by default: 16 GiB (nothing is reserved up front).
pub const DEFAULT_DEVICE_CAPACITY: u64 = 16 << 30;
/// Driver version reported by default (CUDA 13.0).
pub const DEFAULT_DRIVER_VERSION: c_int = 13000;
/// Byte written into fresh device allocations (up to [`FILL_LIMIT`] bytes; larger ones are zeroed),
/// so reads of never-written memory stand out.
pub const FRESH_DEVICE_BYTE: u8 = 0xA5;
/// Largest allocation filled with [`FRESH_DEVICE_BYTE`]: 64 MiB.
pub const FILL_LIMIT: usize = 64 << 20;
/// Device allocations are aligned like the real driver's.
const DEVICE_ALIGN: usize = 256;
const HOST_ALIGN: usize = 4096;
/// Virtual time one executed operation takes, in microseconds (events report it).
const OP_MICROSECONDS: f64 = 1.0;

thread_local! {
    /// The context current on this thread (a handle value; 0 = none), as in the real driver.
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

pub(crate) fn current_context() -> u64 {
    CURRENT.with(|c| c.get())
}

pub(crate) fn set_current_context(handle: u64) {
    CURRENT.with(|c| c.set(handle));
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Needs {
    /// Works before cuInit (version, error text).
    Nothing,
    /// Needs cuInit.
    Init,
    /// Needs cuInit and a current context.
    Context,
}

pub(crate) struct Block {
    pub size: usize,
    layout: Layout,
}

struct Fault {
    entry: &'static str,
    first: u64,
    times: u64,
    code: CUresult,
}

pub(crate) struct PrimaryContext {
    pub device: c_int,
    pub retained: u32,
}

#[derive(Default)]
pub(crate) struct Stream {
    pub flags: c_uint,
    pub queue: VecDeque<(u64, Op)>,
    pub not_ready_left: u32,
    pub capture: Option<Capture>,
}

#[derive(Clone, Copy)]
pub(crate) struct Capture {
    pub mode: c_int,
    pub graph: u64,
    pub invalidated: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum EventState {
    Never,
    Pending { stream: u64, seq: u64 },
    Done { time_us: f64 },
}

pub(crate) struct Event {
    pub flags: c_uint,
    pub state: EventState,
}

pub(crate) struct Module {
    pub functions: Vec<(usize, u64)>,
    pub globals: BTreeMap<String, (u64, usize)>,
}

pub(crate) struct Function {
    pub kernel: usize,
    pub max_dynamic_shared: c_int,
}

/// Packed kernel arguments: one buffer per parameter plus the pointer array the C API hands out.
pub(crate) struct ArgPack {
    bufs: Vec<Box<[u8]>>,
    ptrs: Vec<usize>,
}

impl ArgPack {
    pub fn new(bufs: Vec<Box<[u8]>>) -> ArgPack {
        let ptrs = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        ArgPack { bufs, ptrs }
    }
    /// The `void**` array pointing at each argument (valid while the pack lives).
    pub fn pointer_array(&self) -> *mut *mut std::ffi::c_void {
        self.ptrs.as_ptr() as *mut *mut std::ffi::c_void
    }
    pub fn u64_at(&self, index: usize) -> Option<u64> {
        let b = self.bufs.get(index)?;
        Some(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?))
    }
    pub fn u32_at(&self, index: usize) -> Option<u32> {
        let b = self.bufs.get(index)?;
        Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
    }
}

impl Clone for ArgPack {
    fn clone(&self) -> ArgPack {
        ArgPack::new(self.bufs.clone())
    }
}

#[derive(Clone)]
pub(crate) struct Launch {
    pub function: u64,
    pub kernel: usize,
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared: c_uint,
    pub args: ArgPack,
    pub fault: Option<CUresult>,
}

#[derive(Clone, Copy)]
pub(crate) struct Copy2D {
    pub src: u64,
    pub src_pitch: u64,
    pub src_dev: bool,
    pub dst: u64,
    pub dst_pitch: u64,
    pub dst_dev: bool,
    pub width: u64,
    pub height: u64,
}

/// One unit of stream work (also a graph node's operation).
#[derive(Clone)]
pub(crate) enum Op {
    Copy {
        dst: u64,
        src: u64,
        len: u64,
        dst_dev: bool,
        src_dev: bool,
    },
    Copy2D(Copy2D),
    Memset {
        dst: u64,
        value: u32,
        width: u8,
        count: u64,
    },
    Kernel(Launch),
    Mark {
        event: u64,
    },
    Wait {
        stream: u64,
        seq: u64,
    },
}

pub(crate) struct Node {
    pub graph: u64,
    pub op: Op,
}

pub(crate) struct Graph {
    pub nodes: Vec<u64>,
}

pub(crate) struct Exec {
    /// (source node, operation) in launch order.
    pub nodes: Vec<(u64, Op)>,
}

pub(crate) struct State {
    pub initialized: bool,
    pub init_fault: Option<CUresult>,
    pub sticky: Option<CUresult>,
    pub device_count: c_int,
    pub driver_version: c_int,
    pub capacity: u64,
    pub query_delay: u32,
    next_handle: u64,
    seq: u64,
    clock_us: f64,
    calls: HashMap<&'static str, u64>,
    faults: Vec<Fault>,
    /// (stream handle or 0 for any stream, code) for the next launch.
    launch_faults: Vec<(u64, CUresult)>,
    pub contexts: BTreeMap<u64, PrimaryContext>,
    pub ctx_flags: HashMap<c_int, c_uint>,
    pub device: BTreeMap<u64, Block>,
    pub device_bytes: u64,
    pub host: BTreeMap<u64, Block>,
    pub globals: BTreeMap<u64, Block>,
    pub registered: BTreeMap<u64, usize>,
    pub streams: HashMap<u64, Stream>,
    pub events: HashMap<u64, Event>,
    pub modules: HashMap<u64, Module>,
    pub functions: HashMap<u64, Function>,
    pub graphs: HashMap<u64, Graph>,
    pub nodes: HashMap<u64, Node>,
    pub execs: HashMap<u64, Exec>,
}

/// The legacy default stream's id (handles 0, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`).
pub(crate) const DEFAULT_STREAM: u64 = 0;

static STATE: Mutex<Option<State>> = Mutex::new(None);

pub(crate) fn lock() -> MutexGuard<'static, Option<State>> {
    STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs one entry point: counts the call, applies sticky faults, injected failures and the
/// init/context checks, then `body`. Never unwinds into C.
pub(crate) fn entry(
    name: &'static str,
    needs: Needs,
    body: impl FnOnce(&mut State) -> R,
) -> CUresult {
    let run = || {
        let mut guard = lock();
        let st = guard.get_or_insert_with(State::new);
        if let Err(c) = st.preamble(name, needs) {
            return c;
        }
        match body(st) {
            Ok(()) => code::SUCCESS,
            Err(c) => {
                if is_sticky(c) {
                    st.trip(c);
                }
                c
            }
        }
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or(code::UNKNOWN)
}

/// Runs a control function on the state (no counting, no faults).
pub(crate) fn control<T>(f: impl FnOnce(&mut State) -> T, on_panic: T) -> T {
    let run = || {
        let mut guard = lock();
        f(guard.get_or_insert_with(State::new))
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or(on_panic)
}

/// Writes an out-parameter; a null pointer is `CUDA_ERROR_INVALID_VALUE`.
pub(crate) fn put<T>(p: *mut T, value: T) -> R {
    if p.is_null() {
        return Err(code::INVALID_VALUE);
    }
    // SAFETY: the caller passes a valid out-pointer as the C API requires; null was rejected.
    unsafe { p.write_unaligned(value) };
    Ok(())
}

/// Reads an in-parameter struct; a null pointer is `CUDA_ERROR_INVALID_VALUE`.
pub(crate) fn get<T>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(code::INVALID_VALUE);
    }
    // SAFETY: the caller passes a valid pointer as the C API requires; null was rejected.
    Ok(unsafe { p.read_unaligned() })
}

fn find(map: &BTreeMap<u64, Block>, addr: u64, len: u64) -> bool {
    match map.range(..=addr).next_back() {
        Some((base, block)) => {
            let end = base.saturating_add(block.size as u64);
            addr.checked_add(len).is_some_and(|e| e <= end) && (addr < end || len == 0)
        }
        None => false,
    }
}

impl State {
    pub fn new() -> State {
        let mut streams = HashMap::new();
        streams.insert(DEFAULT_STREAM, Stream::default());
        State {
            initialized: false,
            init_fault: None,
            sticky: None,
            device_count: 1,
            driver_version: DEFAULT_DRIVER_VERSION,
            capacity: DEFAULT_DEVICE_CAPACITY,
            query_delay: 1,
            next_handle: 0x1_0000,
            seq: 0,
            clock_us: 0.0,
            calls: HashMap::new(),
            faults: Vec::new(),
            launch_faults: Vec::new(),
            contexts: BTreeMap::new(),
            ctx_flags: HashMap::new(),
            device: BTreeMap::new(),
            device_bytes: 0,
            host: BTreeMap::new(),
            globals: BTreeMap::new(),
            registered: BTreeMap::new(),
            streams,
            events: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            graphs: HashMap::new(),
            nodes: HashMap::new(),
            execs: HashMap::new(),
        }
    }

    /// Frees everything and returns to a fresh, uninitialised driver (handles are never reused).
    pub fn reset(&mut self) {
        let next_handle = self.next_handle;
        for map in [&mut self.device, &mut self.host, &mut self.globals] {
            for (base, block) in std::mem::take(map) {
                // SAFETY: every block was allocated by `allocate` with exactly this layout.
                unsafe { std::alloc::dealloc(base as *mut u8, block.layout) };
            }
        }
        *self = State::new();
        self.next_handle = next_handle;
    }

    fn preamble(&mut self, name: &'static str, needs: Needs) -> R {
        let count = {
            let c = self.calls.entry(name).or_insert(0);
            *c += 1;
            *c
        };
        let exempt = matches!(
            name,
            "cuGetErrorName" | "cuGetErrorString" | "cuDriverGetVersion"
        );
        if !exempt {
            if let Some(c) = self.sticky {
                return Err(c);
            }
        }
        let injected = self
            .faults
            .iter()
            .find(|f| {
                f.entry == name && count >= f.first && (f.times == 0 || count < f.first + f.times)
            })
            .map(|f| f.code);
        if let Some(c) = injected {
            if is_sticky(c) {
                self.trip(c);
            }
            return Err(c);
        }
        if needs != Needs::Nothing && !self.initialized {
            return Err(code::NOT_INITIALIZED);
        }
        if needs == Needs::Context {
            match self.contexts.get(&current_context()) {
                Some(ctx) if ctx.retained > 0 => {}
                _ => return Err(code::INVALID_CONTEXT),
            }
        }
        Ok(())
    }

    /// A sticky fault: every later call answers `c`; queued work is dropped.
    pub fn trip(&mut self, c: CUresult) {
        if self.sticky.is_none() {
            self.sticky = Some(c);
        }
        for s in self.streams.values_mut() {
            s.queue.clear();
        }
    }

    pub fn calls_of(&self, name: &str) -> u64 {
        self.calls.get(name).copied().unwrap_or(0)
    }

    /// Fails calls `nth ..= nth + times - 1` (counted from now, 1-based) of `entry` with `code`;
    /// `times == 0` fails every call from the nth on.
    pub fn add_fault(&mut self, entry: &'static str, nth: u64, code: CUresult, times: u64) {
        let first = self.calls_of(entry).saturating_add(nth.max(1));
        self.faults.push(Fault {
            entry,
            first,
            times,
            code,
        });
    }

    pub fn add_launch_fault(&mut self, stream: u64, code: CUresult) {
        self.launch_faults.push((stream, code));
    }

    pub fn take_launch_fault(&mut self, stream: u64) -> Option<CUresult> {
        let i = self
            .launch_faults
            .iter()
            .position(|(s, _)| *s == 0 || *s == stream)?;
        Some(self.launch_faults.remove(i).1)
    }

    pub fn handle(&mut self) -> u64 {
        self.next_handle += 16;
        self.next_handle
    }

    // ---- memory

    pub fn allocate(&mut self, size: usize, align: usize, fill: u8) -> Result<u64, CUresult> {
        let layout =
            Layout::from_size_align(size.max(1), align).map_err(|_| code::OUT_OF_MEMORY)?;
        if fill == 0 {
            // Zeroed pages come lazily from the system: a large block costs no RAM until touched.
            // SAFETY: the layout has a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            return if ptr.is_null() {
                Err(code::OUT_OF_MEMORY)
            } else {
                Ok(ptr as u64)
            };
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(code::OUT_OF_MEMORY);
        }
        // SAFETY: `ptr` is a fresh allocation of `layout.size()` bytes.
        unsafe { std::ptr::write_bytes(ptr, fill, layout.size()) };
        Ok(ptr as u64)
    }

    pub fn device_alloc(&mut self, size: usize) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(code::INVALID_VALUE);
        }
        if self.device_bytes.saturating_add(size as u64) > self.capacity {
            return Err(code::OUT_OF_MEMORY);
        }
        let fill = if size > FILL_LIMIT {
            0
        } else {
            FRESH_DEVICE_BYTE
        };
        let base = self.allocate(size, DEVICE_ALIGN, fill)?;
        let layout =
            Layout::from_size_align(size, DEVICE_ALIGN).map_err(|_| code::OUT_OF_MEMORY)?;
        self.device.insert(base, Block { size, layout });
        self.device_bytes += size as u64;
        Ok(base)
    }

    pub fn host_alloc(&mut self, size: usize) -> Result<u64, CUresult> {
        if size == 0 {
            return Err(code::INVALID_VALUE);
        }
        let base = self.allocate(size, HOST_ALIGN, 0)?;
        let layout = Layout::from_size_align(size, HOST_ALIGN).map_err(|_| code::OUT_OF_MEMORY)?;
        self.host.insert(base, Block { size, layout });
        Ok(base)
    }

    pub fn global_alloc(&mut self, size: usize) -> Result<u64, CUresult> {
        let base = self.allocate(size, DEVICE_ALIGN, 0)?;
        let layout =
            Layout::from_size_align(size, DEVICE_ALIGN).map_err(|_| code::OUT_OF_MEMORY)?;
        self.globals.insert(base, Block { size, layout });
        Ok(base)
    }

    pub fn free_block(map: &mut BTreeMap<u64, Block>, base: u64) -> Option<usize> {
        let block = map.remove(&base)?;
        // SAFETY: the block was allocated by `allocate` with exactly this layout.
        unsafe { std::alloc::dealloc(base as *mut u8, block.layout) };
        Some(block.size)
    }

    /// Whether `[addr, addr + len)` is memory the device may touch: a device allocation, a module
    /// global, pinned host memory or a registered host range.
    pub fn accessible(&self, addr: u64, len: u64) -> bool {
        if find(&self.device, addr, len)
            || find(&self.globals, addr, len)
            || find(&self.host, addr, len)
        {
            return true;
        }
        match self.registered.range(..=addr).next_back() {
            Some((base, size)) => addr
                .checked_add(len)
                .is_some_and(|e| e <= base.saturating_add(*size as u64)),
            None => false,
        }
    }

    /// The end address of the device allocation holding `addr`, if any.
    pub fn allocation_end(&self, addr: u64) -> Option<u64> {
        let (base, block) = self.device.range(..=addr).next_back()?;
        let end = base + block.size as u64;
        (addr < end).then_some(end)
    }

    pub fn overlaps_host(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        let hits = |base: u64, size: u64| base < end && addr < base.saturating_add(size);
        self.registered.iter().any(|(b, s)| hits(*b, *s as u64))
            || self.host.iter().any(|(b, blk)| hits(*b, blk.size as u64))
    }

    // ---- streams

    /// Maps a stream handle to its id (`Err(400)` for an unknown one).
    pub fn stream_id(&self, handle: u64) -> Result<u64, CUresult> {
        let id = if handle <= 2 { DEFAULT_STREAM } else { handle };
        if self.streams.contains_key(&id) {
            Ok(id)
        } else {
            Err(code::INVALID_HANDLE)
        }
    }

    /// Queues `op` on a stream, or records it into the stream's capture.
    pub fn submit(&mut self, stream: u64, op: Op) -> R {
        let id = self.stream_id(stream)?;
        let capture = self.streams.get(&id).and_then(|s| s.capture);
        if let Some(cap) = capture {
            if cap.invalidated {
                return Err(code::STREAM_CAPTURE_INVALIDATED);
            }
            if matches!(op, Op::Mark { .. } | Op::Wait { .. }) {
                return Ok(());
            }
            self.add_node(cap.graph, op)?;
            return Ok(());
        }
        self.seq += 1;
        let seq = self.seq;
        let delay = self.query_delay;
        let s = self.streams.get_mut(&id).ok_or(code::INVALID_HANDLE)?;
        if s.queue.is_empty() {
            s.not_ready_left = delay;
        }
        s.queue.push_back((seq, op));
        if let Some(Op::Mark { event }) = s.queue.back().map(|(_, op)| op.clone()) {
            if let Some(e) = self.events.get_mut(&event) {
                e.state = EventState::Pending { stream: id, seq };
            }
        }
        Ok(())
    }

    pub fn add_node(&mut self, graph: u64, op: Op) -> Result<u64, CUresult> {
        let handle = self.handle();
        let g = self.graphs.get_mut(&graph).ok_or(code::INVALID_HANDLE)?;
        g.nodes.push(handle);
        self.nodes.insert(handle, Node { graph, op });
        Ok(handle)
    }

    /// Runs a stream's queued work in order, up to and including `until` (a sequence number).
    pub fn run_stream(&mut self, id: u64, until: Option<u64>) -> R {
        loop {
            let Some(s) = self.streams.get_mut(&id) else {
                return Ok(());
            };
            let Some((seq, _)) = s.queue.front() else {
                return Ok(());
            };
            if until.is_some_and(|u| *seq > u) {
                return Ok(());
            }
            let Some((seq, op)) = s.queue.pop_front() else {
                return Ok(());
            };
            if let Err(c) = self.execute(id, seq, op) {
                if is_sticky(c) {
                    self.trip(c);
                }
                return Err(c);
            }
        }
    }

    fn stream_ids(&self, filter: impl Fn(&Stream) -> bool) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| filter(s))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Runs every queue (context synchronise, frees).
    pub fn run_all(&mut self) -> R {
        for id in self.stream_ids(|_| true) {
            self.run_stream(id, None)?;
        }
        Ok(())
    }

    /// What a synchronous call waits for: the default stream and every blocking stream.
    pub fn run_blocking(&mut self) -> R {
        for id in self.stream_ids(|s| s.flags & 1 == 0) {
            self.run_stream(id, None)?;
        }
        Ok(())
    }

    /// A call that is not allowed while a global-mode capture is active: invalidates such captures
    /// and answers `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
    pub fn refuse_during_capture(&mut self) -> R {
        let mut refused = false;
        for s in self.streams.values_mut() {
            if let Some(cap) = s.capture.as_mut() {
                if cap.mode != 2 {
                    cap.invalidated = true;
                    refused = true;
                }
            }
        }
        if refused {
            Err(code::STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// Answers a query on `stream`'s progress: `NOT_READY` for the configured number of queries
    /// after work was queued, then runs the work (through `until`) and answers its result.
    pub fn query(&mut self, id: u64, until: Option<u64>) -> R {
        let Some(s) = self.streams.get_mut(&id) else {
            return Ok(());
        };
        if s.queue.is_empty() {
            return Ok(());
        }
        if s.not_ready_left > 0 {
            s.not_ready_left -= 1;
            return Err(code::NOT_READY);
        }
        self.run_stream(id, until)
    }

    fn check_device(&self, addr: u64, len: u64, is_device: bool) -> R {
        if is_device && !self.accessible(addr, len) {
            return Err(code::ILLEGAL_ADDRESS);
        }
        Ok(())
    }

    fn execute(&mut self, _stream: u64, seq: u64, op: Op) -> R {
        self.clock_us += OP_MICROSECONDS;
        match op {
            Op::Copy {
                dst,
                src,
                len,
                dst_dev,
                src_dev,
            } => {
                self.check_device(dst, len, dst_dev)?;
                self.check_device(src, len, src_dev)?;
                if len > 0 {
                    // SAFETY: device sides were checked against live allocations; host sides are
                    // the caller's promise, as with the real driver's asynchronous copies.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
                }
                Ok(())
            }
            Op::Copy2D(c) => {
                for row in 0..c.height {
                    let at = |base: u64, pitch: u64| {
                        row.checked_mul(pitch)
                            .and_then(|o| base.checked_add(o))
                            .ok_or(code::ILLEGAL_ADDRESS)
                    };
                    let (src, dst) = (at(c.src, c.src_pitch)?, at(c.dst, c.dst_pitch)?);
                    self.check_device(src, c.width, c.src_dev)?;
                    self.check_device(dst, c.width, c.dst_dev)?;
                    // SAFETY: as for `Op::Copy`, one row at a time.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, c.width as usize) };
                }
                Ok(())
            }
            Op::Memset {
                dst,
                value,
                width,
                count,
            } => {
                let len = count
                    .checked_mul(width as u64)
                    .ok_or(code::ILLEGAL_ADDRESS)?;
                self.check_device(dst, len, true)?;
                match width {
                    // SAFETY: `[dst, dst + count)` is a live device range (checked above).
                    1 => unsafe {
                        std::ptr::write_bytes(dst as *mut u8, value as u8, count as usize)
                    },
                    _ => {
                        for i in 0..count {
                            // SAFETY: `[dst, dst + 4 * count)` is a live device range (checked above).
                            unsafe { ((dst + 4 * i) as *mut u32).write_unaligned(value) };
                        }
                    }
                }
                Ok(())
            }
            Op::Kernel(launch) => {
                self.clock_us += 9.0 * OP_MICROSECONDS;
                if let Some(fault) = launch.fault {
                    return Err(fault);
                }
                self.run_kernel(&launch)
            }
            Op::Mark { event } => {
                let now = self.clock_us;
                if let Some(e) = self.events.get_mut(&event) {
                    if e.state
                        == (EventState::Pending {
                            stream: _stream,
                            seq,
                        })
                    {
                        e.state = EventState::Done { time_us: now };
                    }
                }
                Ok(())
            }
            Op::Wait { stream, seq } => self.run_stream(stream, Some(seq)),
        }
    }

    fn run_kernel(&mut self, launch: &Launch) -> R {
        let name = KERNELS.get(launch.kernel).map(|k| k.name).unwrap_or("");
        let a = &launch.args;
        let bad = code::ILLEGAL_ADDRESS;
        match name {
            "fill_u32" => {
                let (ptr, value, n) = (
                    a.u64_at(0).ok_or(bad)?,
                    a.u32_at(1).ok_or(bad)?,
                    a.u64_at(2).ok_or(bad)?,
                );
                let len = n.checked_mul(4).ok_or(bad)?;
                self.check_device(ptr, len, true)?;
                for i in 0..n {
                    // SAFETY: the whole range was checked above.
                    unsafe { ((ptr + 4 * i) as *mut u32).write_unaligned(value) };
                }
                Ok(())
            }
            "add_f32" => {
                let (x, y, out, n) = (
                    a.u64_at(0).ok_or(bad)?,
                    a.u64_at(1).ok_or(bad)?,
                    a.u64_at(2).ok_or(bad)?,
                    a.u64_at(3).ok_or(bad)?,
                );
                let len = n.checked_mul(4).ok_or(bad)?;
                for p in [x, y, out] {
                    self.check_device(p, len, true)?;
                }
                for i in 0..n {
                    // SAFETY: all three ranges were checked above.
                    unsafe {
                        let sum = ((x + 4 * i) as *const f32).read_unaligned()
                            + ((y + 4 * i) as *const f32).read_unaligned();
                        ((out + 4 * i) as *mut f32).write_unaligned(sum);
                    }
                }
                Ok(())
            }
            "scale_f32" => {
                let (ptr, factor, n) = (
                    a.u64_at(0).ok_or(bad)?,
                    f32::from_bits(a.u32_at(1).ok_or(bad)?),
                    a.u64_at(2).ok_or(bad)?,
                );
                let len = n.checked_mul(4).ok_or(bad)?;
                self.check_device(ptr, len, true)?;
                for i in 0..n {
                    // SAFETY: the whole range was checked above.
                    unsafe {
                        let p = (ptr + 4 * i) as *mut f32;
                        p.write_unaligned(p.read_unaligned() * factor);
                    }
                }
                Ok(())
            }
            "write_oob" => {
                // Writes one u32 just past the end of the allocation holding `ptr`: never allowed.
                let ptr = a.u64_at(0).ok_or(bad)?;
                let target = self.allocation_end(ptr).unwrap_or(ptr);
                self.check_device(target, 4, true)?;
                Err(bad)
            }
            "trap" => Err(code::ASSERT),
            _ => Err(code::LAUNCH_FAILED),
        }
    }

    pub fn counter(&self, name: &str) -> Option<i64> {
        let n = |v: usize| v as i64;
        Some(match name {
            "device_bytes" => self.device_bytes as i64,
            "device_allocations" => n(self.device.len()),
            "host_bytes" => self.host.values().map(|b| b.size as i64).sum(),
            "host_allocations" => n(self.host.len()),
            "registered_bytes" => self.registered.values().map(|s| *s as i64).sum(),
            "registrations" => n(self.registered.len()),
            "streams" => n(self.streams.len().saturating_sub(1)),
            // Streams made with CU_STREAM_NON_BLOCKING (the default stream has flags 0).
            "nonblocking_streams" => n(self.streams.values().filter(|s| s.flags & 1 != 0).count()),
            "events" => n(self.events.len()),
            "modules" => n(self.modules.len()),
            "functions" => n(self.functions.len()),
            "graphs" => n(self.graphs.len()),
            "graph_nodes" => n(self.nodes.len()),
            "graph_execs" => n(self.execs.len()),
            "contexts_retained" => self.contexts.values().map(|c| c.retained as i64).sum(),
            "pending_work" => self.streams.values().map(|s| s.queue.len() as i64).sum(),
            "captures_active" => n(self
                .streams
                .values()
                .filter(|s| s.capture.is_some())
                .count()),
            "initialized" => self.initialized as i64,
            _ => return None,
        })
    }
}

/// Names accepted by `tftd_counter`.
pub const COUNTER_NAMES: &[&str] = &[
    "device_bytes",
    "device_allocations",
    "host_bytes",
    "host_allocations",
    "registered_bytes",
    "registrations",
    "streams",
    "nonblocking_streams",
    "events",
    "modules",
    "functions",
    "graphs",
    "graph_nodes",
    "graph_execs",
    "contexts_retained",
    "pending_work",
    "captures_active",
    "initialized",
];
