//! One rank of an NCCL communicator, bound to a tf-cuda context and stream, with a deadline on every call.
//!
//! The communicator is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`): NCCL calls return at
//! once, possibly with `ncclInProgress`, and [`Comm`] polls `ncclCommGetAsyncError` until the call settles or
//! its deadline passes. Init waits at most [`CommOptions::init_timeout`]; enqueueing a collective and
//! [`Comm::synchronize`] (waiting for the stream) at most [`CommOptions::op_timeout`]. On a passed deadline,
//! an asynchronous NCCL error or a failed CUDA call (a lost context included) the communicator is aborted
//! (`ncclCommAbort`, which also stops NCCL kernels still waiting on the device) and the error says why; every
//! later call fails at once with [`NcclError::Aborted`]. So a dead or missing rank ends the job with an error
//! on every live rank instead of a hang.
//!
//! Wait for a communicator's work through [`Comm::synchronize`], never a plain `Stream::synchronize` (which
//! has no deadline), and before dropping the buffers it used: a `DeviceBuffer`'s drop synchronizes its
//! context, which waits for NCCL kernels too.

use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use crate::error::NcclError;
use crate::ffi::{self, NcclApi, NcclResult, RawComm, RawStream};
use crate::loader::{Nccl, UniqueId};

/// The most ranks a communicator may have here.
pub const MAX_WORLD: usize = 4096;

/// Deadlines and polling of a communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommOptions {
    /// How long init may take (every rank must join within it).
    pub init_timeout: Duration,
    /// How long enqueueing one operation, and [`Comm::synchronize`], may take.
    pub op_timeout: Duration,
    /// The sleep between polls once the first fast polls found the call still running.
    pub poll_interval: Duration,
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            init_timeout: Duration::from_secs(120),
            op_timeout: Duration::from_secs(60),
            poll_interval: Duration::from_micros(200),
        }
    }
}

/// Element types of the buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataType {
    /// Raw bytes (also FP8 payloads moved as bytes).
    U8,
    F16,
    Bf16,
    F32,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::F32 => 4,
        }
    }

    fn raw(self) -> ffi::RawDataType {
        match self {
            DataType::U8 => ffi::data_type::UINT8,
            DataType::F16 => ffi::data_type::FLOAT16,
            DataType::Bf16 => ffi::data_type::BFLOAT16,
            DataType::F32 => ffi::data_type::FLOAT32,
        }
    }
}

/// Reductions of [`Comm::all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
    Avg,
}

impl ReduceOp {
    fn raw(self) -> ffi::RawRedOp {
        match self {
            ReduceOp::Sum => ffi::red_op::SUM,
            ReduceOp::Max => ffi::red_op::MAX,
            ReduceOp::Min => ffi::red_op::MIN,
            ReduceOp::Avg => ffi::red_op::AVG,
        }
    }
}

/// One rank's all-to-all, in elements: for each peer (this rank included) how many go to it from which
/// offset of the send buffer, and how many come from it to which offset of the receive buffer. Every rank's
/// send count to a peer must equal that peer's receive count from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllToAllCounts {
    pub send_counts: Vec<usize>,
    pub send_offsets: Vec<usize>,
    pub recv_counts: Vec<usize>,
    pub recv_offsets: Vec<usize>,
}

impl AllToAllCounts {
    /// Equal blocks: `count` elements to and from every one of `world` ranks, packed by rank.
    pub fn uniform(world: usize, count: usize) -> AllToAllCounts {
        let offsets: Vec<usize> = (0..world).map(|p| p * count).collect();
        AllToAllCounts {
            send_counts: vec![count; world],
            send_offsets: offsets.clone(),
            recv_counts: vec![count; world],
            recv_offsets: offsets,
        }
    }
}

/// The communicator handle and why it was aborted, if it was.
struct State {
    /// Null once aborted or destroyed.
    raw: RawHandle,
    failure: Option<String>,
}

struct RawHandle(RawComm);

// SAFETY: an ncclComm_t points to a heap object any host thread may use; NCCL forbids concurrent calls on one
// communicator, and every call here holds the state's mutex.
unsafe impl Send for RawHandle {}

/// One rank of a communicator. Calls on it are serialized (an internal lock), so it may be shared between
/// threads; its NCCL work runs on its stream.
pub struct Comm {
    nccl: Arc<Nccl>,
    stream: Arc<Stream>,
    ctx: Context,
    rank: usize,
    world: usize,
    options: CommOptions,
    state: Mutex<State>,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Comm>();
};

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("failure", &self.state.lock().failure)
            .finish_non_exhaustive()
    }
}

/// What an enqueue gives NCCL: the table, the communicator, the stream.
type Enqueue<'a> = dyn FnMut(&NcclApi, RawComm, RawStream) -> NcclResult + 'a;

impl Comm {
    /// Joins rank `rank` of a `world`-rank communicator identified by `id`, on `stream` (and its context's
    /// device). Every rank must call this within `options.init_timeout`, else each one that did gets
    /// [`NcclError::Timeout`].
    pub fn init_rank(
        nccl: &Arc<Nccl>,
        stream: Arc<Stream>,
        id: &UniqueId,
        rank: usize,
        world: usize,
        options: CommOptions,
    ) -> Result<Comm, NcclError> {
        if world == 0 || world > MAX_WORLD || rank >= world {
            return Err(NcclError::Invalid(format!(
                "rank {rank} of a {world}-rank communicator: the world size must be 1..={MAX_WORLD} and the rank \
                 below it"
            )));
        }
        let ctx = stream.context();
        ctx.make_current().map_err(|source| NcclError::Cuda {
            rank,
            world,
            what: "binding the context before ncclCommInitRankConfig".into(),
            source: Box::new(source),
        })?;
        let mut config = ffi::RawConfig::new(false);
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: out-pointers to locals; the id is passed by value; world and rank were checked above and fit
        // c_int (MAX_WORLD); the config is the 2.17 layout with its size, magic and version set.
        let code = unsafe {
            (nccl.api().ncclCommInitRankConfig)(
                &mut raw,
                world as c_int,
                id.0,
                rank as c_int,
                &mut config,
            )
        };
        let settled = code == ffi::result::SUCCESS || code == ffi::result::IN_PROGRESS;
        if !settled || raw.is_null() {
            let last = last_error(nccl, raw);
            if !raw.is_null() {
                // SAFETY: a handle NCCL returned, aborted once and never used again.
                let _ = unsafe { (nccl.api().ncclCommAbort)(raw) };
            }
            return Err(NcclError::call(nccl, "ncclCommInitRankConfig", code, last));
        }
        let comm = Comm {
            nccl: Arc::clone(nccl),
            stream,
            ctx,
            rank,
            world,
            options,
            state: Mutex::new(State {
                raw: RawHandle(raw),
                failure: None,
            }),
        };
        {
            let mut st = comm.state.lock();
            let deadline = Instant::now() + options.init_timeout;
            comm.settle(
                &mut st,
                "ncclCommInitRankConfig (joining the communicator)",
                deadline,
            )?;
        }
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The stream the communicator's work runs on.
    pub fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// The loaded library.
    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.nccl
    }

    /// The deadlines in force.
    pub fn options(&self) -> CommOptions {
        self.options
    }

    /// Why the communicator was aborted, if it was.
    pub fn failure(&self) -> Option<String> {
        self.state.lock().failure.clone()
    }

    /// Aborts the communicator now (every later call fails with [`NcclError::Aborted`]); NCCL kernels still
    /// running for it stop. Other ranks see their next operation fail or time out.
    pub fn abort(&self) {
        let mut st = self.state.lock();
        self.abort_locked(&mut st, "aborted by the caller".into());
    }

    /// Waits until everything enqueued on the stream so far has finished, at most
    /// [`CommOptions::op_timeout`], watching NCCL's asynchronous errors meanwhile. A passed deadline, an
    /// NCCL error or a failed stream query aborts the communicator.
    pub fn synchronize(&self) -> Result<(), NcclError> {
        let what = "waiting for the stream";
        let mut st = self.state.lock();
        let raw = self.usable(&st, "synchronize")?;
        let start = Instant::now();
        let deadline = start + self.options.op_timeout;
        let mut polls = 0u32;
        loop {
            let done = match self.stream.query() {
                Ok(done) => done,
                Err(source) => return Err(self.fail_cuda(&mut st, what, source)),
            };
            match self.async_error(raw) {
                Ok(ffi::result::SUCCESS) | Ok(ffi::result::IN_PROGRESS) => {}
                Ok(code) => return Err(self.fail_async(&mut st, what, code)),
                Err(e) => return Err(self.fail_query(&mut st, e)),
            }
            if done {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(self.fail_timeout(&mut st, what, start.elapsed()));
            }
            self.pause(&mut polls);
        }
    }

    /// All-to-all with per-peer counts and offsets (elements of `dtype`), as one group of `ncclSend`/`ncclRecv`;
    /// each `(send, recv)` pair is exchanged with the same counts in the same group (e.g. Q, K and V). Peers
    /// with nothing to send or receive are skipped on both sides (the counts agree by contract). Returns once
    /// NCCL has enqueued the group on the stream; [`Comm::synchronize`] waits for it.
    ///
    /// # Safety
    /// Every view must lie in device memory of this communicator's context (the device of its stream); the
    /// tf-cuda views cannot prove which context they belong to. The views borrow their buffers only for the
    /// call: the work runs later, and a `DeviceBuffer` stays valid for it because its drop synchronizes its
    /// context first. Every rank must issue the same operations in the same order with matching counts.
    pub unsafe fn all_to_all(
        &self,
        pairs: &mut [(DeviceView<'_>, DeviceViewMut<'_>)],
        counts: &AllToAllCounts,
        dtype: DataType,
    ) -> Result<(), NcclError> {
        let what = "all-to-all";
        let w = self.world;
        for (name, v) in [
            ("send_counts", &counts.send_counts),
            ("send_offsets", &counts.send_offsets),
            ("recv_counts", &counts.recv_counts),
            ("recv_offsets", &counts.recv_offsets),
        ] {
            if v.len() != w {
                return Err(NcclError::Invalid(format!(
                    "{what}: {name} lists {} peers, the communicator has {w} ranks",
                    v.len()
                )));
            }
        }
        let size = dtype.size();
        for (i, (send, recv)) in pairs.iter().enumerate() {
            check_ranges(
                what,
                i,
                "send",
                send.len(),
                &counts.send_counts,
                &counts.send_offsets,
                size,
                false,
            )?;
            check_ranges(
                what,
                i,
                "receive",
                recv.len(),
                &counts.recv_counts,
                &counts.recv_offsets,
                size,
                true,
            )?;
        }
        // Element offsets to byte addresses, all checked above.
        let ops: Vec<(u64, u64)> = pairs.iter().map(|(s, r)| (s.addr(), r.addr())).collect();
        let raw_type = dtype.raw();
        self.enqueue(what, &mut |api, comm, stream| {
            // SAFETY: no arguments.
            let start = unsafe { (api.ncclGroupStart)() };
            if start != ffi::result::SUCCESS {
                return start;
            }
            let mut first = ffi::result::SUCCESS;
            'ops: for &(send, recv) in &ops {
                for peer in 0..w {
                    let (sc, so) = (counts.send_counts[peer], counts.send_offsets[peer]);
                    let (rc, ro) = (counts.recv_counts[peer], counts.recv_offsets[peer]);
                    if sc > 0 {
                        let buf = (send + (so * size) as u64) as *const c_void;
                        // SAFETY: the range so..so+sc (elements) lies inside the send view (checked); the
                        // caller vouches the view is memory of this context; peer < world fits c_int.
                        let code = unsafe {
                            (api.ncclSend)(buf, sc, raw_type, peer as c_int, comm, stream)
                        };
                        if code != ffi::result::SUCCESS && code != ffi::result::IN_PROGRESS {
                            first = code;
                            break 'ops;
                        }
                    }
                    if rc > 0 {
                        let buf = (recv + (ro * size) as u64) as *mut c_void;
                        // SAFETY: as above, for the receive view (its ranges do not overlap: checked).
                        let code = unsafe {
                            (api.ncclRecv)(buf, rc, raw_type, peer as c_int, comm, stream)
                        };
                        if code != ffi::result::SUCCESS && code != ffi::result::IN_PROGRESS {
                            first = code;
                            break 'ops;
                        }
                    }
                }
            }
            // The group is always closed, also after a failed call inside it.
            // SAFETY: no arguments; closes the group opened above.
            let end = unsafe { (api.ncclGroupEnd)() };
            if first != ffi::result::SUCCESS {
                first
            } else {
                end
            }
        })
    }

    /// All-gather: every rank contributes `count` elements of `send`; `recv` receives `world * count`,
    /// rank by rank. Returns once enqueued.
    ///
    /// # Safety
    /// As for [`Comm::all_to_all`].
    pub unsafe fn all_gather(
        &self,
        send: DeviceView<'_>,
        recv: DeviceViewMut<'_>,
        count: usize,
        dtype: DataType,
    ) -> Result<(), NcclError> {
        let what = "all-gather";
        let bytes = elements_bytes(what, count, dtype)?;
        let total = bytes.checked_mul(self.world).ok_or_else(|| {
            NcclError::Invalid(format!("{what}: {count} x {} overflows", self.world))
        })?;
        fits(what, "send", send.len(), bytes)?;
        fits(what, "receive", recv.len(), total)?;
        let (s, r, t) = (send.addr(), recv.addr(), dtype.raw());
        self.enqueue(what, &mut |api, comm, stream| {
            // SAFETY: both ranges were checked against their views; the caller vouches they are memory of
            // this context.
            unsafe {
                (api.ncclAllGather)(s as *const c_void, r as *mut c_void, count, t, comm, stream)
            }
        })
    }

    /// All-reduce of `count` elements from `send` into `recv` (the same on every rank). Returns once
    /// enqueued.
    ///
    /// # Safety
    /// As for [`Comm::all_to_all`].
    pub unsafe fn all_reduce(
        &self,
        send: DeviceView<'_>,
        recv: DeviceViewMut<'_>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        let what = "all-reduce";
        let bytes = elements_bytes(what, count, dtype)?;
        fits(what, "send", send.len(), bytes)?;
        fits(what, "receive", recv.len(), bytes)?;
        // SAFETY: the caller's contract is this function's.
        unsafe { self.reduce_raw(what, send.addr(), recv.addr(), count, dtype, op) }
    }

    /// All-reduce of the first `count` elements of `buf` in place. Returns once enqueued.
    ///
    /// # Safety
    /// As for [`Comm::all_to_all`].
    pub unsafe fn all_reduce_in_place(
        &self,
        buf: DeviceViewMut<'_>,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        let what = "all-reduce (in place)";
        let bytes = elements_bytes(what, count, dtype)?;
        fits(what, "buffer", buf.len(), bytes)?;
        // SAFETY: the caller's contract is this function's; NCCL allows send == receive.
        unsafe { self.reduce_raw(what, buf.addr(), buf.addr(), count, dtype, op) }
    }

    /// # Safety
    /// Both addresses hold `count` elements of `dtype` in memory of this context.
    unsafe fn reduce_raw(
        &self,
        what: &'static str,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        let (t, o) = (dtype.raw(), op.raw());
        self.enqueue(what, &mut |api, comm, stream| {
            // SAFETY: the function's contract.
            unsafe {
                (api.ncclAllReduce)(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    t,
                    o,
                    comm,
                    stream,
                )
            }
        })
    }

    /// Broadcast of the first `count` elements of `buf` from rank `root` to every rank, in place. Returns
    /// once enqueued.
    ///
    /// # Safety
    /// As for [`Comm::all_to_all`].
    pub unsafe fn broadcast_in_place(
        &self,
        buf: DeviceViewMut<'_>,
        count: usize,
        dtype: DataType,
        root: usize,
    ) -> Result<(), NcclError> {
        let what = "broadcast";
        if root >= self.world {
            return Err(NcclError::Invalid(format!(
                "{what}: root rank {root} is not below the world size {}",
                self.world
            )));
        }
        let bytes = elements_bytes(what, count, dtype)?;
        fits(what, "buffer", buf.len(), bytes)?;
        let (a, t) = (buf.addr(), dtype.raw());
        self.enqueue(what, &mut |api, comm, stream| {
            // SAFETY: the range was checked against the view; the caller vouches it is memory of this
            // context; root < world fits c_int.
            unsafe {
                (api.ncclBroadcast)(
                    a as *const c_void,
                    a as *mut c_void,
                    count,
                    t,
                    root as c_int,
                    comm,
                    stream,
                )
            }
        })
    }

    /// Runs `f` (NCCL calls that enqueue on the stream), then waits until NCCL has settled it.
    fn enqueue(&self, what: &'static str, f: &mut Enqueue<'_>) -> Result<(), NcclError> {
        let mut st = self.state.lock();
        let raw = self.usable(&st, what)?;
        if let Err(source) = self.ctx.make_current() {
            return Err(self.fail_cuda(&mut st, what, source));
        }
        let start = Instant::now();
        let code = f(self.nccl.api(), raw, self.stream.raw().cast::<c_void>());
        if code != ffi::result::SUCCESS && code != ffi::result::IN_PROGRESS {
            return Err(self.fail_async(&mut st, what, code));
        }
        self.settle(&mut st, what, start + self.options.op_timeout)
    }

    /// Polls the asynchronous state until it leaves `ncclInProgress`; aborts on an error or the deadline.
    fn settle(&self, st: &mut State, what: &str, deadline: Instant) -> Result<(), NcclError> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            let raw = self.usable(st, "settle")?;
            match self.async_error(raw) {
                Ok(ffi::result::SUCCESS) => return Ok(()),
                Ok(ffi::result::IN_PROGRESS) => {}
                Ok(code) => return Err(self.fail_async(st, what, code)),
                Err(e) => return Err(self.fail_query(st, e)),
            }
            if let Err(source) = self.ctx.ensure_healthy() {
                return Err(self.fail_cuda(st, what, source));
            }
            if Instant::now() >= deadline {
                return Err(self.fail_timeout(st, what, start.elapsed()));
            }
            self.pause(&mut polls);
        }
    }

    /// The first polls yield the thread; later ones sleep [`CommOptions::poll_interval`].
    fn pause(&self, polls: &mut u32) {
        *polls = polls.saturating_add(1);
        if *polls < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.options.poll_interval);
        }
    }

    /// The live handle, or `Aborted`.
    fn usable(&self, st: &State, what: &'static str) -> Result<RawComm, NcclError> {
        if st.raw.0.is_null() {
            return Err(NcclError::Aborted {
                rank: self.rank,
                world: self.world,
                what,
                reason: st.failure.clone().unwrap_or_else(|| "destroyed".into()),
            });
        }
        Ok(st.raw.0)
    }

    /// `ncclCommGetAsyncError`; `Err` carries the failed query's own code.
    fn async_error(&self, raw: RawComm) -> Result<NcclResult, NcclResult> {
        let mut state: NcclResult = ffi::result::SUCCESS;
        // SAFETY: a live handle (callers hold the lock and checked it is not null); out-pointer to a local.
        let code = unsafe { (self.nccl.api().ncclCommGetAsyncError)(raw, &mut state) };
        if code != ffi::result::SUCCESS {
            return Err(code);
        }
        Ok(state)
    }

    fn abort_locked(&self, st: &mut State, reason: String) {
        let raw = std::mem::replace(&mut st.raw.0, std::ptr::null_mut());
        if st.failure.is_none() {
            st.failure = Some(reason);
        }
        if !raw.is_null() {
            // SAFETY: the live handle, aborted once; the state's null handle keeps it from being used again.
            let _ = unsafe { (self.nccl.api().ncclCommAbort)(raw) };
        }
    }

    fn fail_async(&self, st: &mut State, what: &str, code: NcclResult) -> NcclError {
        let last = last_error(&self.nccl, st.raw.0);
        let err = NcclError::Async {
            rank: self.rank,
            world: self.world,
            what: what.to_string(),
            code,
            name: ffi::result::name(code),
            text: self.nccl.error_string(code),
            last,
        };
        self.abort_locked(st, err.to_string());
        err
    }

    fn fail_query(&self, st: &mut State, code: NcclResult) -> NcclError {
        let err = NcclError::call(
            &self.nccl,
            "ncclCommGetAsyncError",
            code,
            last_error(&self.nccl, st.raw.0),
        );
        self.abort_locked(st, err.to_string());
        err
    }

    fn fail_timeout(&self, st: &mut State, what: &str, waited: Duration) -> NcclError {
        let err = NcclError::Timeout {
            rank: self.rank,
            world: self.world,
            what: what.to_string(),
            waited,
        };
        self.abort_locked(st, err.to_string());
        err
    }

    fn fail_cuda(&self, st: &mut State, what: &str, source: tf_cuda::Error) -> NcclError {
        let err = NcclError::Cuda {
            rank: self.rank,
            world: self.world,
            what: what.to_string(),
            source: Box::new(source),
        };
        self.abort_locked(st, err.to_string());
        err
    }
}

impl Drop for Comm {
    /// Waits (at most the op timeout) for the stream and NCCL to finish, then finalizes and destroys the
    /// communicator; when that does not settle in time, or anything failed, aborts it instead. Never panics,
    /// never waits without a deadline.
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.state.get_mut().raw.0, std::ptr::null_mut());
        if raw.is_null() {
            return;
        }
        let deadline = Instant::now() + self.options.op_timeout;
        let clean = self.ctx.make_current().is_ok()
            && self.stream_done_by(deadline)
            && self.quiet_by(raw, deadline)
            && self.finalize(raw)
            && self.quiet_by(raw, deadline);
        let api = self.nccl.api();
        if clean {
            // SAFETY: finalized above; destroyed once and never used again (the state holds null).
            let _ = unsafe { (api.ncclCommDestroy)(raw) };
        } else {
            // SAFETY: the live handle, aborted once and never used again.
            let _ = unsafe { (api.ncclCommAbort)(raw) };
        }
    }
}

impl Comm {
    /// Drop's wait for the stream: true once it is idle, false on an error or the deadline.
    fn stream_done_by(&self, deadline: Instant) -> bool {
        loop {
            match self.stream.query() {
                Ok(true) => return true,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(self.options.poll_interval)
                }
                _ => return false,
            }
        }
    }

    /// Drop's wait for NCCL: true once the asynchronous state is success, false on an error or the deadline.
    fn quiet_by(&self, raw: RawComm, deadline: Instant) -> bool {
        loop {
            match self.async_error(raw) {
                Ok(ffi::result::SUCCESS) => return true,
                Ok(ffi::result::IN_PROGRESS) if Instant::now() < deadline => {
                    std::thread::sleep(self.options.poll_interval)
                }
                _ => return false,
            }
        }
    }

    /// `ncclCommFinalize` (non-blocking: [`Comm::quiet_by`] waits for it).
    fn finalize(&self, raw: RawComm) -> bool {
        // SAFETY: the live handle, finalized once (only from Drop).
        let code = unsafe { (self.nccl.api().ncclCommFinalize)(raw) };
        code == ffi::result::SUCCESS || code == ffi::result::IN_PROGRESS
    }
}

/// `ncclGetLastError`'s text as `": ..."`, or empty.
fn last_error(nccl: &Nccl, raw: RawComm) -> String {
    let Some(f) = nccl.api().ncclGetLastError else {
        return String::new();
    };
    // SAFETY: takes a communicator or null and returns a NUL-terminated string owned by NCCL (or null).
    let ptr = unsafe { f(raw) };
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated; copied out at once.
    let text = unsafe { CStr::from_ptr(ptr) }.to_string_lossy();
    if text.trim().is_empty() {
        String::new()
    } else {
        format!(": {}", text.trim())
    }
}

fn elements_bytes(what: &str, count: usize, dtype: DataType) -> Result<usize, NcclError> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| NcclError::Invalid(format!("{what}: {count} elements overflow")))
}

fn fits(what: &str, which: &str, len: usize, need: usize) -> Result<(), NcclError> {
    if need > len {
        return Err(NcclError::Invalid(format!(
            "{what}: the {which} buffer holds {len} B, the call needs {need} B"
        )));
    }
    Ok(())
}

/// Every `offset..offset+count` (elements) lies in a `len`-byte view; with `disjoint`, no two overlap.
#[allow(clippy::too_many_arguments)]
fn check_ranges(
    what: &str,
    pair: usize,
    which: &str,
    len: usize,
    counts: &[usize],
    offsets: &[usize],
    size: usize,
    disjoint: bool,
) -> Result<(), NcclError> {
    let mut ranges = Vec::with_capacity(counts.len());
    for (peer, (&c, &o)) in counts.iter().zip(offsets).enumerate() {
        let end = o
            .checked_add(c)
            .and_then(|e| e.checked_mul(size))
            .ok_or_else(|| {
                NcclError::Invalid(format!(
                    "{what}: pair {pair}, peer {peer}: offset {o} + count {c} overflows"
                ))
            })?;
        if end > len {
            return Err(NcclError::Invalid(format!(
                "{what}: pair {pair}, peer {peer}: the {which} range {o}..{} (elements of {size} B) ends past the \
                 {len}-byte view",
                o + c
            )));
        }
        if c > 0 {
            ranges.push((o, o + c, peer));
        }
    }
    if disjoint {
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(NcclError::Invalid(format!(
                    "{what}: pair {pair}: the {which} ranges of peers {} and {} overlap",
                    w[0].2, w[1].2
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_against_the_view() {
        assert!(check_ranges("t", 0, "send", 16, &[2, 2], &[0, 2], 4, false).is_ok());
        let err = check_ranges("t", 0, "send", 15, &[2, 2], &[0, 2], 4, false).unwrap_err();
        assert!(
            err.to_string().contains("ends past the 15-byte view"),
            "{err}"
        );
        let err = check_ranges("t", 1, "receive", 64, &[2, 2], &[0, 1], 4, true).unwrap_err();
        assert!(err.to_string().contains("peers 0 and 1 overlap"), "{err}");
        // Sends may overlap (the same block sent to several peers); empty ranges never collide.
        assert!(check_ranges("t", 0, "send", 8, &[2, 2], &[0, 0], 4, false).is_ok());
        assert!(check_ranges("t", 0, "receive", 8, &[2, 0], &[0, 0], 4, true).is_ok());
        let err = check_ranges("t", 0, "send", 8, &[usize::MAX], &[1], 4, false).unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
    }

    #[test]
    fn uniform_counts_pack_by_rank() {
        let c = AllToAllCounts::uniform(3, 5);
        assert_eq!(c.send_offsets, vec![0, 5, 10]);
        assert_eq!(c.recv_counts, vec![5, 5, 5]);
    }

    #[test]
    fn element_sizes() {
        assert_eq!(DataType::Bf16.size(), 2);
        assert_eq!(DataType::F32.size(), 4);
        assert_eq!(DataType::U8.size(), 1);
        assert!(elements_bytes("t", usize::MAX, DataType::F32).is_err());
    }
}
