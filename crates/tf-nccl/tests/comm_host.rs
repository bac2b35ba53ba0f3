//! The communicator's state machine on the host: a fake NCCL (built from C, see `common`) on the fake CUDA
//! driver (tf-testdriver). Init and every collective settle through `ncclCommGetAsyncError`; a passed deadline,
//! an asynchronous NCCL error (a dead peer) or a lost context aborts the communicator exactly once and comes
//! back as an error naming the cause; later calls fail at once; a healthy drop finalizes and destroys.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::Fake;
use tf_cuda::{Context, DeviceBuffer, Driver, Stream};
use tf_nccl::{AllToAllCounts, Comm, CommOptions, DataType, Nccl, NcclError, ReduceOp, UniqueId};
use tf_testdriver::{library_path, test_lock, Control};

fn fake_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| common::build_library("comm_fake_nccl", common::FAKE_SOURCE))
}

/// The fake NCCL and the fake driver, fresh; holds the test driver's lock (which also serializes the fake).
struct Fixture {
    fake: Fake,
    nccl: Arc<Nccl>,
    control: Control,
    ctx: Context,
    _serial: MutexGuard<'static, ()>,
}

fn short() -> CommOptions {
    CommOptions {
        init_timeout: Duration::from_millis(300),
        op_timeout: Duration::from_millis(300),
        poll_interval: Duration::from_micros(100),
    }
}

impl Fixture {
    fn new() -> Fixture {
        let serial = test_lock();
        let control = Control::open().expect("open the test driver's controls");
        control.reset();
        let driver = Arc::new(Driver::open_path(&library_path().unwrap()).unwrap());
        let ctx = Context::new(driver, 0).unwrap();
        let fake = Fake::open(fake_path());
        let nccl = Nccl::open_path(fake_path()).unwrap();
        Fixture {
            fake,
            nccl,
            control,
            ctx,
            _serial: serial,
        }
    }

    fn stream(&self) -> Arc<Stream> {
        Arc::new(Stream::new(&self.ctx, false).unwrap())
    }

    fn id(&self) -> UniqueId {
        self.nccl.unique_id().unwrap()
    }

    fn comm(&self, rank: usize, world: usize) -> Comm {
        Comm::init_rank(&self.nccl, self.stream(), &self.id(), rank, world, short()).unwrap()
    }
}

#[test]
fn init_is_non_blocking_and_settles_by_polling() {
    let f = Fixture::new();
    f.fake.set("init_polls", 5);
    let comm = f.comm(1, 4);
    assert_eq!((comm.rank(), comm.world_size()), (1, 4));
    assert_eq!(f.fake.get("init"), 1);
    assert_eq!(
        f.fake.get("blocking"),
        0,
        "the config asks for a non-blocking communicator"
    );
    assert_eq!(f.fake.get("magic"), 0xcafe_beef);
    assert_eq!(f.fake.get("size"), 40);
    assert_eq!(f.fake.get("config_version"), 21700);
    assert_eq!((f.fake.get("world"), f.fake.get("rank")), (4, 1));
    assert_eq!(
        f.fake.get("id_ok"),
        1,
        "the unique id reaches NCCL by value"
    );
    assert_eq!(
        f.fake.get("nvls"),
        0,
        "NCCL sees NCCL_NVLS_ENABLE=0 when it initialises"
    );
    assert!(f.fake.get("async") >= 6, "polled until settled");
    assert!(comm.failure().is_none());
    drop(comm);
    assert_eq!(f.fake.get("finalize"), 1);
    assert_eq!(f.fake.get("destroy"), 1);
    assert_eq!(f.fake.get("abort"), 0);
}

#[test]
fn a_rank_that_never_joins_times_out_and_aborts() {
    let f = Fixture::new();
    f.fake.set("init_polls", -1); // the bootstrap never completes: a peer never joined
    let start = Instant::now();
    let err = Comm::init_rank(&f.nccl, f.stream(), &f.id(), 0, 2, short()).unwrap_err();
    let waited = start.elapsed();
    println!("{err}");
    assert!(err.is_timeout(), "{err:?}");
    assert!(err.aborted_the_communicator());
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("rank 0 of 2"), "{msg}");
    assert!(msg.contains("ncclCommInitRankConfig"), "{msg}");
    assert!(msg.contains("never joined"), "{msg}");
    assert_eq!(f.fake.get("abort"), 1);
    assert_eq!(f.fake.get("destroy"), 0);
}

#[test]
fn an_init_error_from_a_peer_names_the_code_and_aborts() {
    let f = Fixture::new();
    f.fake.set("init_polls", 2);
    f.fake.set("init_error", 6);
    let err = Comm::init_rank(&f.nccl, f.stream(), &f.id(), 0, 2, short()).unwrap_err();
    let msg = err.to_string();
    println!("{msg}");
    match &err {
        NcclError::Async { code, name, .. } => assert_eq!((*code, *name), (6, "ncclRemoteError")),
        other => panic!("expected Async, got {other:?}"),
    }
    assert!(msg.contains("remote process exited"), "{msg}");
    assert!(msg.contains("fake last error"), "{msg}");
    assert!(msg.contains("peer rank failed"), "{msg}");
    assert_eq!(f.fake.get("abort"), 1);
}

#[test]
fn bad_ranks_are_refused_before_nccl_is_called() {
    let f = Fixture::new();
    for (rank, world) in [(2, 2), (0, 0), (0, tf_nccl::MAX_WORLD + 1)] {
        let err = Comm::init_rank(&f.nccl, f.stream(), &f.id(), rank, world, short()).unwrap_err();
        assert!(matches!(err, NcclError::Invalid(_)), "{err:?}");
    }
    assert_eq!(f.fake.get("init"), 0);
}

#[test]
fn all_to_all_sends_each_nonempty_range_in_one_group() {
    let f = Fixture::new();
    let comm = f.comm(1, 3);
    // Rank 1 of 3, bf16: sends 4, 0, 2 elements; receives 3, 1, 0 (peers with nothing are skipped).
    let counts = AllToAllCounts {
        send_counts: vec![4, 0, 2],
        send_offsets: vec![0, 4, 4],
        recv_counts: vec![3, 1, 0],
        recv_offsets: vec![0, 3, 4],
    };
    let (q, k) = (
        DeviceBuffer::alloc(&f.ctx, 12).unwrap(),
        DeviceBuffer::alloc(&f.ctx, 12).unwrap(),
    );
    let (mut q_out, mut k_out) = (
        DeviceBuffer::alloc(&f.ctx, 8).unwrap(),
        DeviceBuffer::alloc(&f.ctx, 8).unwrap(),
    );
    f.fake.set("op_polls", 3);
    let mut pairs = [(q.view(), q_out.view_mut()), (k.view(), k_out.view_mut())];
    // SAFETY: every buffer is of the communicator's context and outlives the synchronize below.
    unsafe { comm.all_to_all(&mut pairs, &counts, DataType::Bf16) }.unwrap();
    comm.synchronize().unwrap();
    assert_eq!((f.fake.get("group_start"), f.fake.get("group_end")), (1, 1));
    let log = f.fake.log();
    let sends: Vec<(u64, i64, i64)> = log
        .iter()
        .filter(|l| l.kind == 1)
        .map(|l| (l.a, l.count, l.peer))
        .collect();
    let recvs: Vec<(u64, i64, i64)> = log
        .iter()
        .filter(|l| l.kind == 2)
        .map(|l| (l.a, l.count, l.peer))
        .collect();
    let (qa, ka, qo, ko) = (q.addr(), k.addr(), q_out.addr(), k_out.addr());
    assert_eq!(
        sends,
        vec![(qa, 4, 0), (qa + 8, 2, 2), (ka, 4, 0), (ka + 8, 2, 2)]
    );
    assert_eq!(
        recvs,
        vec![(qo, 3, 0), (qo + 6, 1, 1), (ko, 3, 0), (ko + 6, 1, 1)]
    );
    assert!(log.iter().all(|l| l.dtype == 9), "bf16 is ncclBfloat16 (9)");
    assert!(comm.failure().is_none());
}

#[test]
fn counts_that_do_not_fit_are_refused_and_the_communicator_stays_usable() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let send = DeviceBuffer::alloc(&f.ctx, 16).unwrap();
    let mut recv = DeviceBuffer::alloc(&f.ctx, 16).unwrap();
    let too_long = AllToAllCounts::uniform(2, 3); // 6 f32 = 24 B > 16 B
    let mut pairs = [(send.view(), recv.view_mut())];
    // SAFETY: the buffers are of the communicator's context (and the call is refused before NCCL anyway).
    let err = unsafe { comm.all_to_all(&mut pairs, &too_long, DataType::F32) }.unwrap_err();
    assert!(
        err.to_string().contains("ends past the 16-byte view"),
        "{err}"
    );
    let wrong_world = AllToAllCounts::uniform(3, 1);
    // SAFETY: as above.
    let err = unsafe { comm.all_to_all(&mut pairs, &wrong_world, DataType::F32) }.unwrap_err();
    assert!(
        err.to_string().contains("the communicator has 2 ranks"),
        "{err}"
    );
    // SAFETY: as above.
    let err =
        unsafe { comm.all_gather(send.view(), recv.view_mut(), 3, DataType::F32) }.unwrap_err();
    assert!(err.to_string().contains("needs 24 B"), "{err}");
    // SAFETY: as above.
    let err = unsafe { comm.broadcast_in_place(recv.view_mut(), 1, DataType::F32, 2) }.unwrap_err();
    assert!(err.to_string().contains("root rank 2"), "{err}");
    assert!(!err.aborted_the_communicator());
    assert_eq!(f.fake.get("log_len"), 0, "nothing reached NCCL");
    // Still usable.
    // SAFETY: as above; the buffers outlive the synchronize.
    unsafe { comm.all_gather(send.view(), recv.view_mut(), 2, DataType::F32) }.unwrap();
    comm.synchronize().unwrap();
    assert_eq!(f.fake.get("gather"), 1);
}

#[test]
fn collectives_pass_their_buffers_types_and_ops() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let send = DeviceBuffer::alloc(&f.ctx, 64).unwrap();
    let mut recv = DeviceBuffer::alloc(&f.ctx, 128).unwrap();
    // SAFETY: the buffers are of the communicator's context and outlive the synchronize below.
    unsafe {
        comm.all_gather(send.view(), recv.view_mut(), 16, DataType::F32)
            .unwrap();
        comm.all_reduce(
            send.view(),
            recv.view_mut(),
            32,
            DataType::Bf16,
            ReduceOp::Max,
        )
        .unwrap();
        comm.all_reduce_in_place(recv.view_mut(), 8, DataType::F32, ReduceOp::Sum)
            .unwrap();
        comm.broadcast_in_place(recv.view_mut(), 5, DataType::U8, 1)
            .unwrap();
    }
    comm.synchronize().unwrap();
    let log = f.fake.log();
    let (s, r) = (send.addr(), recv.addr());
    let got: Vec<(i64, u64, u64, i64, i64, i64)> = log
        .iter()
        .map(|l| (l.kind, l.a, l.b, l.count, l.peer, l.dtype))
        .collect();
    assert_eq!(
        got,
        vec![
            (3, s, r, 16, -1, 7),
            (4, s, r, 32, -1, 9),
            (4, r, r, 8, -1, 7),
            (5, r, r, 5, 1, 1),
        ]
    );
}

#[test]
fn an_operation_that_never_settles_times_out_then_every_call_fails_at_once() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let send = DeviceBuffer::alloc(&f.ctx, 64).unwrap();
    let mut recv = DeviceBuffer::alloc(&f.ctx, 128).unwrap();
    f.fake.set("op_polls", -1);
    let start = Instant::now();
    // SAFETY: the buffers are of the communicator's context and outlive the communicator.
    let err =
        unsafe { comm.all_gather(send.view(), recv.view_mut(), 16, DataType::F32) }.unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(
        err.to_string().contains("all-gather did not finish within"),
        "{err}"
    );
    assert_eq!(f.fake.get("abort"), 1);
    assert!(comm.failure().unwrap().contains("all-gather"));
    let calls = f.fake.get("async");
    // SAFETY: as above.
    let again =
        unsafe { comm.all_gather(send.view(), recv.view_mut(), 16, DataType::F32) }.unwrap_err();
    assert!(matches!(again, NcclError::Aborted { .. }), "{again:?}");
    assert!(
        again.to_string().contains("make a new communicator"),
        "{again}"
    );
    assert!(matches!(comm.synchronize(), Err(NcclError::Aborted { .. })));
    assert_eq!(f.fake.get("gather"), 1, "nothing more reached NCCL");
    assert_eq!(f.fake.get("async"), calls);
    drop(comm);
    assert_eq!(
        f.fake.get("abort"),
        1,
        "aborted once, never destroyed after"
    );
    assert_eq!(f.fake.get("destroy"), 0);
}

#[test]
fn a_peer_dying_while_the_stream_runs_ends_the_wait_with_its_error() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let mut buf = DeviceBuffer::alloc(&f.ctx, 64).unwrap();
    // Work on the stream that stays not-ready for a long time, like a collective waiting for a peer.
    f.control.set_query_delay(1_000_000);
    buf.fill_u32(7, Some(comm.stream())).unwrap();
    // SAFETY: the buffer is of the communicator's context and outlives the communicator.
    unsafe { comm.all_reduce_in_place(buf.view_mut(), 16, DataType::F32, ReduceOp::Sum) }.unwrap();
    f.fake.set("pending_error", 6); // the peer's process exits
    let err = comm.synchronize().unwrap_err();
    println!("{err}");
    assert!(matches!(err, NcclError::Async { code: 6, .. }), "{err:?}");
    assert!(err.to_string().contains("waiting for the stream"), "{err}");
    assert_eq!(f.fake.get("abort"), 1);
    f.control.set_query_delay(0);
    comm.stream().synchronize().unwrap();
}

#[test]
fn a_stream_that_never_finishes_times_out() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let mut buf = DeviceBuffer::alloc(&f.ctx, 64).unwrap();
    f.control.set_query_delay(1_000_000);
    buf.fill_u32(7, Some(comm.stream())).unwrap();
    let start = Instant::now();
    let err = comm.synchronize().unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(f.fake.get("abort"), 1);
    f.control.set_query_delay(0);
    comm.stream().synchronize().unwrap();
}

#[test]
fn a_lost_context_ends_the_job_with_a_context_lost_error() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    let mut buf = DeviceBuffer::alloc(&f.ctx, 64).unwrap();
    f.control.set_query_delay(1_000_000);
    buf.fill_u32(7, Some(comm.stream())).unwrap();
    // The next stream query meets an execution fault (CUDA_ERROR_ILLEGAL_ADDRESS, sticky).
    assert!(f.control.fail_call("cuStreamQuery", 1, 700, 0));
    let err = comm.synchronize().unwrap_err();
    println!("{err}");
    assert!(err.is_context_lost(), "{err:?}");
    assert!(
        err.to_string().contains("the CUDA context is lost"),
        "{err}"
    );
    assert_eq!(f.fake.get("abort"), 1);
    assert!(f.ctx.is_lost());
    // Later collectives fail at once without reaching NCCL.
    // SAFETY: the buffer is of the communicator's context.
    let again =
        unsafe { comm.all_reduce_in_place(buf.view_mut(), 1, DataType::F32, ReduceOp::Sum) };
    assert!(matches!(again, Err(NcclError::Aborted { .. })));
    assert_eq!(f.fake.get("reduce"), 0);
    drop(comm);
    assert_eq!(f.fake.get("abort"), 1);
    // The buffer of a lost context leaks on drop (tf-cuda's rule); nothing hangs.
    drop(buf);
}

#[test]
fn an_explicit_abort_is_final_and_drop_then_does_nothing() {
    let f = Fixture::new();
    let comm = f.comm(0, 1);
    comm.abort();
    comm.abort();
    assert_eq!(f.fake.get("abort"), 1);
    assert_eq!(comm.failure().as_deref(), Some("aborted by the caller"));
    assert!(matches!(comm.synchronize(), Err(NcclError::Aborted { .. })));
    drop(comm);
    assert_eq!(
        (
            f.fake.get("abort"),
            f.fake.get("finalize"),
            f.fake.get("destroy")
        ),
        (1, 0, 0)
    );
}

#[test]
fn a_drop_that_cannot_finalize_in_time_aborts() {
    let f = Fixture::new();
    let comm = f.comm(0, 2);
    f.fake.set("finalize_polls", -1); // a peer is gone, so finalize never completes
    let start = Instant::now();
    drop(comm);
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(
        (
            f.fake.get("finalize"),
            f.fake.get("abort"),
            f.fake.get("destroy")
        ),
        (1, 1, 0)
    );
}
