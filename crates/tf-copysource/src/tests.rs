//! Bookkeeping unit tests over the mock backend. Small buffers and no proptest, so they run under Miri.

use crate::classes::{PIPELINE_CHUNK_BYTES, PIPELINE_DEPTH, PIPELINE_LANES, PIPELINE_RING_BYTES};
use crate::mock::{MockBackend, MockContext, MockError, MockStream};
use crate::{Config, CopySource, DeviceAddress, Error, MarkerState, MAX_CONTEXTS};

type Source = CopySource<MockBackend>;

fn setup() -> (MockBackend, Source, crate::ContextId) {
    let gpu = MockBackend::new();
    let source = CopySource::new(gpu.clone());
    let context = source.register_context(MockContext(0)).unwrap();
    (gpu, source, context)
}

fn assert_clean(gpu: &MockBackend) {
    assert_eq!(gpu.violations(), Vec::<String>::new());
    assert!(gpu.copies().iter().all(|c| c.source_intact));
}

const S1: MockStream = MockStream(1);
const S2: MockStream = MockStream(2);

#[test]
fn types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Source>();
    check::<crate::CaptureScope<MockBackend>>();
    check::<crate::CapturedSources<MockBackend>>();
    check::<Error<MockError>>();
}

#[test]
fn async_upload_keeps_source_until_marker_done() {
    let (gpu, source, context) = setup();
    let mut bytes = vec![3u8; 100];
    source
        .upload_async(context, S1, DeviceAddress(0x100), &bytes)
        .unwrap();
    bytes.fill(0xEE);
    assert_eq!(source.stats().pending_blocks, 1);
    assert_eq!(gpu.queued(S1), 2, "one copy and one marker");

    // The GPU has not run: reaping releases nothing.
    assert_eq!(source.reap().unwrap(), 0);
    assert_eq!(source.stats().pending_blocks, 1);

    // Copy executed but marker not yet: still pending.
    gpu.advance(S1, 1);
    assert_eq!(source.reap().unwrap(), 0);
    gpu.advance(S1, 1);
    assert_eq!(source.reap().unwrap(), 1);
    let stats = source.stats();
    assert_eq!((stats.pending_blocks, stats.spare_blocks), (0, 1));
    assert_eq!(gpu.device_bytes(DeviceAddress(0x100)), Some(vec![3u8; 100]));
    assert_eq!(gpu.live_markers(), 0);
    assert_clean(&gpu);
}

#[test]
fn spares_are_reused() {
    let (gpu, source, context) = setup();
    for round in 0..5u8 {
        source
            .upload_async(context, S1, DeviceAddress(0x1000), &[round; 64])
            .unwrap();
        source.synchronize(S1).unwrap();
    }
    assert_eq!(gpu.allocations(), 1, "one 4 KiB block serves every round");
    assert_eq!(gpu.device_bytes(DeviceAddress(0x1000)), Some(vec![4u8; 64]));
    assert_clean(&gpu);
}

#[test]
fn upload_reaps_finished_front_of_its_stream() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    gpu.run_all();
    source
        .upload_async(context, S1, DeviceAddress(8), &[2; 10])
        .unwrap();
    assert_eq!(
        gpu.allocations(),
        1,
        "the finished block was reaped and reused"
    );
    assert_eq!(source.stats().pending_blocks, 1);
    assert_clean(&gpu);
}

#[test]
fn synchronize_and_query_release_only_their_stream() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    source
        .upload_async(context, S2, DeviceAddress(64), &[2; 10])
        .unwrap();
    source.synchronize(S1).unwrap();
    assert_eq!(source.stats().pending_blocks, 1);
    assert_eq!(source.query(S2).unwrap(), MarkerState::Pending);
    assert_eq!(source.stats().pending_blocks, 1);
    gpu.advance(S2, 2);
    assert_eq!(source.query(S2).unwrap(), MarkerState::Done);
    assert_eq!(source.stats().pending_blocks, 0);
    assert_clean(&gpu);
}

#[test]
fn retired_stream_releases_only_when_marker_done() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[9; 10])
        .unwrap();
    source.retire_stream(S1);
    assert_eq!(source.stats().pending_blocks, 1);
    assert_eq!(source.reap().unwrap(), 0);
    gpu.run_all();
    assert_eq!(source.reap().unwrap(), 1);
    assert_eq!(source.stats().pending_entries, 0);
    assert_clean(&gpu);
}

#[test]
fn synchronous_upload_lands_and_is_refused_while_a_scope_is_open() {
    let (gpu, source, context) = setup();
    source
        .upload_sync(context, S1, DeviceAddress(0x40), &[5; 33])
        .unwrap();
    assert_eq!(gpu.device_bytes(DeviceAddress(0x40)), Some(vec![5; 33]));

    let scope = source.begin_capture(context, S2).unwrap();
    let refused = source.upload_sync(context, S1, DeviceAddress(0x40), &[6; 33]);
    match refused {
        Err(Error::UnownedCaptureSource { operation, stream }) => {
            assert_eq!(operation, "synchronous upload");
            assert!(stream.contains('2'), "names the capturing stream: {stream}");
        }
        other => panic!("expected UnownedCaptureSource, got {other:?}"),
    }
    let message = source
        .check_unowned_copy("pinned copy")
        .unwrap_err()
        .to_string();
    assert!(message.contains("pinned copy refused"), "{message}");
    assert_eq!(gpu.device_bytes(DeviceAddress(0x40)), Some(vec![5; 33]));

    drop(scope);
    source
        .upload_sync(context, S1, DeviceAddress(0x40), &[6; 33])
        .unwrap();
    assert!(source.check_unowned_copy("pinned copy").is_ok());
    assert_eq!(gpu.device_bytes(DeviceAddress(0x40)), Some(vec![6; 33]));
    assert_clean(&gpu);
}

#[test]
fn ended_scope_no_longer_refuses() {
    let (_gpu, source, context) = setup();
    let scope = source.begin_capture(context, S1).unwrap();
    assert!(matches!(
        source.begin_capture(context, S1),
        Err(Error::CaptureAlreadyOpen { .. })
    ));
    let sources = scope.end();
    assert_eq!(sources.block_count(), 0);
    source
        .upload_sync(context, S1, DeviceAddress(0), &[1])
        .unwrap();
    assert_eq!(source.stats().open_captures, 0);
}

#[test]
fn captured_upload_lives_with_the_graph_and_its_launches() {
    let (gpu, source, context) = setup();
    let scope = source.begin_capture(context, S1).unwrap();
    gpu.begin_capture(S1);
    let mut bytes = vec![0x42u8; 200];
    source
        .upload_async(context, S1, DeviceAddress(0x900), &bytes)
        .unwrap();
    bytes.fill(0);
    let adopted = scope.adopt(vec![1u8, 2, 3]);
    assert_eq!(adopted.len, 3);
    let graph = gpu.end_capture(S1).unwrap();
    let sources = scope.end();
    assert_eq!((sources.block_count(), sources.adopted_count()), (1, 1));
    assert_eq!(
        source.stats().pending_blocks,
        0,
        "captured staging is not pending on a stream"
    );

    gpu.launch(&graph, S2);
    source.graph_launched(&sources, S2).unwrap();
    // The executable and graph go away while the launch is still queued.
    drop(sources);
    drop(graph);
    assert_eq!(gpu.live_blocks(), 1);
    assert_eq!(source.reap().unwrap(), 0);
    gpu.run_all();
    assert_eq!(source.reap().unwrap(), 1);
    assert_eq!(
        gpu.device_bytes(DeviceAddress(0x900)),
        Some(vec![0x42; 200])
    );
    assert_eq!(
        source.stats().spare_blocks,
        1,
        "the block went back to the pool"
    );
    source.unregister_context(context).unwrap();
    assert_eq!(gpu.live_blocks(), 0);
    assert_clean(&gpu);
}

#[test]
fn teardown_frees_sources_of_a_dropped_executable_after_its_last_launch() {
    let (gpu, source, context) = setup();
    let scope = source.begin_capture(context, S1).unwrap();
    gpu.begin_capture(S1);
    source
        .upload_async(context, S1, DeviceAddress(0x40), &[8; 300])
        .unwrap();
    let graph = gpu.end_capture(S1).unwrap();
    let sources = scope.end();
    gpu.launch(&graph, S2);
    source.graph_launched(&sources, S2).unwrap();
    drop(graph);
    drop(sources);
    let report = source.unregister_context(context).unwrap();
    assert_eq!((report.released_blocks, report.leaked_blocks), (1, 0));
    assert_eq!(gpu.live_blocks(), 0);
    assert_eq!(gpu.device_bytes(DeviceAddress(0x40)), Some(vec![8; 300]));
    assert_clean(&gpu);
}

#[test]
fn dropped_scope_releases_its_staging() {
    let (gpu, source, context) = setup();
    let scope = source.begin_capture(context, S1).unwrap();
    gpu.begin_capture(S1);
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    // The driver's end-capture failed: the capture is abandoned, then the guard drops.
    gpu.abort_capture(S1);
    drop(scope);
    let stats = source.stats();
    assert_eq!((stats.open_captures, stats.spare_blocks), (0, 1));
    assert_clean(&gpu);
}

#[test]
fn context_table_holds_64() {
    let gpu = MockBackend::new();
    let source = CopySource::new(gpu);
    let ids: Vec<_> = (0..MAX_CONTEXTS as u32)
        .map(|i| source.register_context(MockContext(i)).unwrap())
        .collect();
    assert!(matches!(
        source.register_context(MockContext(99)),
        Err(Error::ContextTableFull { capacity: 64 })
    ));
    source.unregister_context(ids[7]).unwrap();
    let again = source.register_context(MockContext(100)).unwrap();
    assert_eq!(again.slot(), 7);
    assert_ne!(again, ids[7], "a reused slot gets a new generation");
    assert!(matches!(
        source.unregister_context(ids[7]),
        Err(Error::UnknownContext { slot: 7, .. })
    ));
    assert!(matches!(
        source.upload_async(ids[7], S1, DeviceAddress(0), &[1]),
        Err(Error::UnknownContext { .. })
    ));
    assert_eq!(source.context_handle(again).unwrap(), MockContext(100));
}

#[test]
fn teardown_waits_for_pending_and_frees_spares() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    source
        .upload_async(context, S1, DeviceAddress(16), &[2; 5000])
        .unwrap();
    source
        .upload_async(context, S2, DeviceAddress(9000), &[3; 10])
        .unwrap();
    source.synchronize(S2).unwrap();
    source.retire_stream(S2);
    let report = source.unregister_context(context).unwrap();
    assert_eq!(report.released_blocks, 2);
    assert_eq!(report.spares_freed, 1);
    assert_eq!(report.leaked_blocks, 0);
    assert_eq!(gpu.live_blocks(), 0);
    assert_eq!(gpu.live_markers(), 0);
    assert_eq!(gpu.device_bytes(DeviceAddress(16)), Some(vec![2; 5000]));
    assert_eq!(source.stats(), crate::Stats::default());
    assert_clean(&gpu);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "leaks a staging block on purpose, which Miri reports as a leak"
)]
fn execution_fault_leaks_instead_of_freeing() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    gpu.set_faulted(true);
    assert!(matches!(
        source.reap(),
        Err(Error::Backend {
            call: "query_marker",
            ..
        })
    ));
    let stats = source.stats();
    assert_eq!((stats.pending_blocks, stats.leaked_blocks), (0, 1));
    assert_eq!(
        gpu.live_blocks(),
        1,
        "never freed: the GPU may still read it"
    );
    assert_clean(&gpu);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "leaks a staging block on purpose, which Miri reports as a leak"
)]
fn teardown_after_fault_leaks_and_reports() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    gpu.set_faulted(true);
    assert!(matches!(
        source.unregister_context(context),
        Err(Error::Backend {
            call: "wait_marker",
            ..
        })
    ));
    assert_eq!(source.stats().leaked_blocks, 1);
    assert_eq!(gpu.live_blocks(), 1);
    assert_clean(&gpu);
}

#[test]
fn failed_allocation_retries_after_dropping_spares() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    source.synchronize(S1).unwrap();
    assert_eq!(source.stats().spare_blocks, 1);
    gpu.fail_next("alloc_staging", 1);
    // A different size class misses the pool, the first alloc fails, spares go, the retry succeeds.
    source
        .upload_async(context, S1, DeviceAddress(0), &[2; 10_000])
        .unwrap();
    assert_eq!(source.stats().spare_blocks, 0);
    gpu.fail_next("alloc_staging", 2);
    let error = source
        .upload_async(context, S1, DeviceAddress(0), &[2; 100_000])
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Backend {
                call: "alloc_staging",
                ..
            }
        ),
        "{error}"
    );
    source.synchronize(S1).unwrap();
    source.unregister_context(context).unwrap();
    assert_eq!(gpu.live_blocks(), 0);
    assert_clean(&gpu);
}

#[test]
fn failed_enqueue_returns_the_block() {
    let (gpu, source, context) = setup();
    gpu.fail_next("enqueue_copy", 1);
    let error = source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap_err();
    assert!(error.to_string().contains("enqueue_copy failed"), "{error}");
    let stats = source.stats();
    assert_eq!((stats.pending_entries, stats.spare_blocks), (0, 1));
    assert_eq!(gpu.queued(S1), 0);
    assert_clean(&gpu);
}

#[test]
fn failed_marker_keeps_block_until_synchronize() {
    let (gpu, source, context) = setup();
    gpu.fail_next("record_marker", 1);
    assert!(source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .is_err());
    assert_eq!(
        source.stats().pending_blocks,
        1,
        "the copy was enqueued: its block stays pending"
    );
    gpu.run_all();
    assert_eq!(
        source.reap().unwrap(),
        0,
        "no marker: only a synchronize proves it"
    );
    source.synchronize(S1).unwrap();
    assert_eq!(source.stats().pending_blocks, 0);
    assert_clean(&gpu);
}

#[test]
fn staging_limit_reports_out_of_staging() {
    let gpu = MockBackend::new();
    let config = Config {
        max_spare_bytes_per_context: 1 << 20,
        staging_limit_bytes: Some(8192),
    };
    let source = CopySource::with_config(gpu.clone(), config);
    let context = source.register_context(MockContext(0)).unwrap();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 4096])
        .unwrap();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 4096])
        .unwrap();
    let error = source
        .upload_async(context, S1, DeviceAddress(0), &[1; 4096])
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::OutOfStaging {
                requested: 4096,
                in_use: 8192,
                limit: 8192
            }
        ),
        "{error}"
    );
    // Once the GPU is done, a reap inside the next upload makes room.
    gpu.run_all();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 4096])
        .unwrap();
    assert!(source.stats().staging_bytes <= 8192);
    assert_clean(&gpu);
}

#[test]
fn zero_spare_cap_frees_at_once() {
    let gpu = MockBackend::new();
    let config = Config {
        max_spare_bytes_per_context: 0,
        staging_limit_bytes: None,
    };
    let source = CopySource::with_config(gpu.clone(), config);
    let context = source.register_context(MockContext(0)).unwrap();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    assert_eq!(gpu.live_blocks(), 1);
    source.synchronize(S1).unwrap();
    assert_eq!(gpu.live_blocks(), 0);
    assert_eq!(source.stats().staging_bytes, 0);
    assert_clean(&gpu);
}

#[test]
fn empty_and_overflowing_uploads() {
    let (gpu, source, context) = setup();
    source
        .upload_async(context, S1, DeviceAddress(0), &[])
        .unwrap();
    source
        .upload_sync(context, S1, DeviceAddress(0), &[])
        .unwrap();
    assert_eq!(gpu.queued(S1), 0);
    let error = source
        .upload_async(context, S1, DeviceAddress(u64::MAX - 1), &[1; 4])
        .unwrap_err();
    assert!(
        matches!(error, Error::AddressOverflow { len: 4, .. }),
        "{error}"
    );
    assert!(source
        .upload_sync(context, S1, DeviceAddress(u64::MAX), &[1])
        .is_err());
}

/// Reads back `len` bytes a chunked upload wrote from `base` (one mock record per chunk).
fn landed(gpu: &MockBackend, base: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for (offset, _) in crate::classes::chunks(len, PIPELINE_CHUNK_BYTES) {
        out.extend(
            gpu.device_bytes(DeviceAddress(base + offset as u64))
                .unwrap(),
        );
    }
    out
}

#[cfg(not(miri))]
#[test]
fn large_uploads_are_pipelined_through_a_bounded_ring() {
    let (gpu, source, context) = setup();
    let len = (64 << 20) + 4097;
    let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    source
        .upload_async(context, S1, DeviceAddress(0), &bytes)
        .unwrap();
    let stats = source.stats();
    // 9 chunks; at most the ring's worth of them still owned by the stream.
    assert!(stats.pending_blocks >= 1);
    assert!(
        stats.pending_blocks <= PIPELINE_LANES * PIPELINE_DEPTH,
        "{stats:?}"
    );
    assert!(stats.staging_bytes <= PIPELINE_RING_BYTES, "{stats:?}");
    source.synchronize(S1).unwrap();
    assert_eq!(landed(&gpu, 0, len), bytes);
    let copies = gpu.copies();
    assert_eq!(copies.len(), 9);
    assert!(copies.iter().all(|c| c.bytes.len() <= PIPELINE_CHUNK_BYTES));
    // The ring reused its blocks: fewer allocations than chunks.
    assert!(gpu.allocations() < 9, "{} allocations", gpu.allocations());

    let before = gpu.allocations();
    source
        .upload_sync(context, S1, DeviceAddress(1 << 30), &bytes)
        .unwrap();
    assert_eq!(landed(&gpu, 1 << 30, len), bytes);
    let stats = source.stats();
    assert_eq!(stats.pending_blocks, 0, "landed and back in the pool");
    // Pooled from the first upload: no new pinned memory.
    assert_eq!(gpu.allocations(), before);
    assert!(gpu.copies().iter().all(|c| c.stream == Some(S1)));
    assert_clean(&gpu);
}

#[cfg(not(miri))]
#[test]
fn repeated_large_uploads_stay_within_the_spare_pool() {
    let (gpu, source, context) = setup();
    let len = 3 * PIPELINE_RING_BYTES + 123;
    let mut bytes: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
    for round in 0..3u8 {
        bytes[0] = round;
        source
            .upload_async(context, S1, DeviceAddress(0x10_0000_0000), &bytes)
            .unwrap();
        source.synchronize(S1).unwrap();
        assert_eq!(landed(&gpu, 0x10_0000_0000, len), bytes);
        assert!(source.stats().staging_bytes <= PIPELINE_RING_BYTES);
    }
    assert!(gpu.allocations() <= (PIPELINE_LANES * PIPELINE_DEPTH) as u64);
    assert_clean(&gpu);
}

#[cfg(not(miri))]
#[test]
fn a_failed_wait_in_the_ring_leaks_that_batch_and_reports() {
    let (gpu, source, context) = setup();
    let len = 2 * PIPELINE_RING_BYTES;
    let bytes = vec![3u8; len];
    gpu.fail_next("wait_marker", 1);
    let err = source
        .upload_async(context, S1, DeviceAddress(0), &bytes)
        .unwrap_err();
    assert!(err.to_string().contains("wait_marker"), "{err}");
    assert!(source.stats().leaked_blocks >= 1);
    source.synchronize(S1).unwrap();
    assert_clean(&gpu);
}

#[test]
fn concurrent_uploads_from_threads() {
    let (gpu, source, context) = setup();
    let threads = if cfg!(miri) { 2 } else { 4 };
    std::thread::scope(|scope| {
        for t in 0..threads {
            let source = source.clone();
            scope.spawn(move || {
                let stream = MockStream(10 + t);
                for i in 0..8u64 {
                    let bytes = vec![(t as u8) ^ (i as u8); 50];
                    source
                        .upload_async(
                            context,
                            stream,
                            DeviceAddress(u64::from(t) << 32 | i << 8),
                            &bytes,
                        )
                        .unwrap();
                    if i % 3 == 0 {
                        source.synchronize(stream).unwrap();
                    }
                }
            });
        }
    });
    gpu.run_all();
    source.reap().unwrap();
    assert_eq!(source.stats().pending_entries, 0);
    for t in 0..threads {
        for i in 0..8u64 {
            let expected = vec![(t as u8) ^ (i as u8); 50];
            assert_eq!(
                gpu.device_bytes(DeviceAddress(u64::from(t) << 32 | i << 8)),
                Some(expected)
            );
        }
    }
    source.unregister_context(context).unwrap();
    assert_eq!(gpu.live_blocks(), 0);
    assert_clean(&gpu);
}

/// Delegates to the mock, but runs a hook right after a stream synchronize returns: another thread's upload
/// landing between the driver's synchronize and the bookkeeping that follows it.
struct RacingBackend {
    inner: MockBackend,
    after_synchronize: parking_lot::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl crate::Backend for RacingBackend {
    type Context = MockContext;
    type Stream = MockStream;
    type Marker = crate::mock::MockMarker;
    type Staging = crate::mock::MockStaging;
    type Error = MockError;

    fn alloc_staging(&self, c: MockContext, len: usize) -> Result<Self::Staging, MockError> {
        self.inner.alloc_staging(c, len)
    }
    fn staging_len(&self, block: &Self::Staging) -> usize {
        self.inner.staging_len(block)
    }
    fn write_staging(&self, block: &mut Self::Staging, bytes: &[u8]) {
        self.inner.write_staging(block, bytes)
    }
    fn free_staging(&self, c: MockContext, block: Self::Staging) -> Result<(), MockError> {
        self.inner.free_staging(c, block)
    }
    unsafe fn enqueue_copy(
        &self,
        s: MockStream,
        d: DeviceAddress,
        src: &Self::Staging,
        len: usize,
    ) -> Result<(), MockError> {
        // SAFETY: forwarded under the caller's guarantee.
        unsafe { self.inner.enqueue_copy(s, d, src, len) }
    }
    unsafe fn enqueue_download(
        &self,
        s: MockStream,
        from: DeviceAddress,
        dst: &mut Self::Staging,
        len: usize,
    ) -> Result<(), MockError> {
        // SAFETY: forwarded under the caller's guarantee.
        unsafe { self.inner.enqueue_download(s, from, dst, len) }
    }
    fn read_staging(&self, block: &Self::Staging, out: &mut [std::mem::MaybeUninit<u8>]) {
        self.inner.read_staging(block, out)
    }
    fn record_marker(&self, s: MockStream) -> Result<Self::Marker, MockError> {
        self.inner.record_marker(s)
    }
    fn query_marker(&self, m: &Self::Marker) -> Result<MarkerState, MockError> {
        self.inner.query_marker(m)
    }
    fn wait_marker(&self, m: &Self::Marker) -> Result<(), MockError> {
        self.inner.wait_marker(m)
    }
    fn destroy_marker(&self, m: Self::Marker) {
        self.inner.destroy_marker(m)
    }
    fn synchronize_stream(&self, s: MockStream) -> Result<(), MockError> {
        let result = self.inner.synchronize_stream(s);
        let hook = self.after_synchronize.lock().take();
        if let Some(hook) = hook {
            hook();
        }
        result
    }
    fn query_stream(&self, s: MockStream) -> Result<MarkerState, MockError> {
        self.inner.query_stream(s)
    }
    fn copy_sync(&self, c: MockContext, d: DeviceAddress, src: &[u8]) -> Result<(), MockError> {
        self.inner.copy_sync(c, d, src)
    }
}

#[test]
fn synchronize_releases_only_what_was_pending_before_it() {
    use crate::Backend as _;
    let gpu = MockBackend::new();
    let backend = RacingBackend {
        inner: gpu.clone(),
        after_synchronize: parking_lot::Mutex::new(None),
    };
    let config = Config {
        max_spare_bytes_per_context: 0,
        staging_limit_bytes: None,
    };
    let source = CopySource::with_config(backend, config);
    let context = source.register_context(MockContext(0)).unwrap();
    source
        .upload_async(context, S1, DeviceAddress(0), &[1; 10])
        .unwrap();
    let late = source.clone();
    *source.backend().after_synchronize.lock() = Some(Box::new(move || {
        late.upload_async(context, S1, DeviceAddress(64), &[2; 10])
            .unwrap();
    }));
    source.synchronize(S1).unwrap();
    assert_eq!(
        source.stats().pending_blocks,
        1,
        "the late upload stays pending"
    );
    assert_eq!(gpu.live_blocks(), 1);
    assert_eq!(gpu.queued(S1), 2);
    source.backend().synchronize_stream(S1).unwrap();
    source.reap().unwrap();
    assert_eq!(gpu.device_bytes(DeviceAddress(64)), Some(vec![2; 10]));
    assert_eq!(gpu.live_blocks(), 0);
    assert_clean(&gpu);
}

// ----- staged downloads -----

/// Device bytes at `base` for the download tests: a pattern that differs from chunk to chunk.
fn on_device(gpu: &MockBackend, base: u64, len: usize) -> Vec<u8> {
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 257) as u8).collect();
    gpu.set_device_bytes(DeviceAddress(base), bytes.clone());
    bytes
}

/// Downloads `len` bytes from `base` into a fresh, uninitialized buffer.
fn download(
    source: &Source,
    context: crate::ContextId,
    stream: MockStream,
    base: u64,
    len: usize,
) -> Result<Vec<u8>, Error<MockError>> {
    let mut out: Vec<u8> = Vec::with_capacity(len);
    source.download_staged(
        context,
        stream,
        DeviceAddress(base),
        &mut out.spare_capacity_mut()[..len],
        "test download",
    )?;
    // SAFETY: download_staged returned Ok, so it initialized all `len` bytes.
    unsafe { out.set_len(len) };
    Ok(out)
}

/// Nothing pending, queued or held by a marker; only spares left; no early release seen.
fn assert_settled(gpu: &MockBackend, source: &Source) {
    let stats = source.stats();
    assert_eq!(
        (stats.pending_entries, stats.pending_blocks),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(gpu.queued_total(), 0, "every enqueued download ran");
    assert_eq!(gpu.live_markers(), 0);
    assert_eq!(gpu.live_blocks(), stats.spare_blocks + stats.leaked_blocks);
    assert_clean(gpu);
}

#[test]
fn small_staged_downloads_round_trip() {
    let (gpu, source, context) = setup();
    let bytes = on_device(&gpu, 0x1000, 300);
    assert_eq!(download(&source, context, S1, 0x1000, 0).unwrap(), vec![]);
    assert_eq!(gpu.downloads(), 0, "an empty download enqueues nothing");
    for len in [1, 7, 300] {
        assert_eq!(
            download(&source, context, S1, 0x1000, len).unwrap(),
            bytes[..len]
        );
    }
    // An offset inside the device bytes.
    assert_eq!(
        download(&source, context, S1, 0x1000 + 5, 100).unwrap(),
        bytes[5..105]
    );
    assert_eq!(gpu.allocations(), 1, "one 4 KiB block served every call");
    assert_settled(&gpu, &source);
}

#[cfg(not(miri))]
#[test]
fn staged_downloads_round_trip_around_chunk_boundaries() {
    let (gpu, source, context) = setup();
    let c = PIPELINE_CHUNK_BYTES;
    let most = PIPELINE_RING_BYTES + 2 * c + 4099;
    let bytes = on_device(&gpu, 0x4000_0000, most);
    for len in [1, c - 1, c, c + 1, 3 * c + 12_345, most] {
        let got = download(&source, context, S1, 0x4000_0000, len).unwrap();
        assert!(got == bytes[..len], "{len} bytes differ");
        assert_eq!(gpu.downloads() as usize, {
            let mut total = 0;
            for n in [1, c - 1, c, c + 1, 3 * c + 12_345, most] {
                total += n.div_ceil(c);
                if n == len {
                    break;
                }
            }
            total
        });
        assert!(source.stats().staging_bytes <= PIPELINE_RING_BYTES);
        assert_settled(&gpu, &source);
    }
    // The ring reused its blocks: at most one ring of chunk blocks (and the small tails') pinned.
    let allocations = gpu.allocations();
    assert!(
        allocations <= (PIPELINE_LANES * PIPELINE_DEPTH + 4) as u64,
        "{allocations} allocations"
    );
    // Repeated downloads come from the pool.
    let again = download(&source, context, S2, 0x4000_0000, most).unwrap();
    assert!(again == bytes);
    assert_eq!(gpu.allocations(), allocations, "no new pinned memory");
    // An upload's ring and a download's share one pool.
    source
        .upload_async(context, S1, DeviceAddress(0x8000_0000), &bytes[..3 * c])
        .unwrap();
    source.synchronize(S1).unwrap();
    assert_eq!(gpu.allocations(), allocations);
    assert_settled(&gpu, &source);
    source.unregister_context(context).unwrap();
    assert_eq!(gpu.live_blocks(), 0);
}

#[cfg(not(miri))]
#[test]
fn staged_download_errors_midway_wait_for_everything_in_flight() {
    let c = PIPELINE_CHUNK_BYTES;
    let len = 9 * c + 77;
    // (call failing, at which call, what the error names)
    let cases: [(&'static str, u32, &str); 5] = [
        ("enqueue_download", 6, "enqueue_download"),
        ("record_marker", 2, "record_marker"),
        ("wait_marker", 2, "wait_marker"),
        // The third block is past the staging limit (the retry after dropping spares fails too).
        ("alloc_staging", 3, "alloc_staging"),
        ("enqueue_download", 1, "enqueue_download"),
    ];
    for (call, nth, named) in cases {
        let (gpu, source, context) = setup();
        let bytes = on_device(&gpu, 0, len);
        if call == "alloc_staging" {
            gpu.set_staging_limit(Some(2 * c));
        } else {
            gpu.fail_nth(call, nth);
        }
        let Err(err) = download(&source, context, S1, 0, len) else {
            panic!("{call}: the download succeeded");
        };
        gpu.set_staging_limit(None);
        assert!(err.to_string().contains(named), "{call}: {err}");
        assert_eq!(
            source.stats().leaked_blocks,
            0,
            "{call}: proven, not leaked"
        );
        assert_settled(&gpu, &source);
        // The pool is intact: the next download lands exactly.
        assert!(download(&source, context, S1, 0, len).unwrap() == bytes);
        assert_settled(&gpu, &source);
        source.unregister_context(context).unwrap();
        assert_eq!(gpu.live_blocks(), 0, "{call}");
    }
}

#[cfg(not(miri))]
#[test]
fn staged_download_leaks_a_batch_nothing_proves_landed() {
    let (gpu, source, context) = setup();
    let len = 5 * PIPELINE_CHUNK_BYTES;
    on_device(&gpu, 0, len);
    // The wait fails and so does the synchronize that would prove the batch landed.
    gpu.fail_nth("wait_marker", 1);
    gpu.fail_next("synchronize_stream", 1);
    let err = download(&source, context, S1, 0, len).unwrap_err();
    assert!(err.to_string().contains("wait_marker"), "{err}");
    let stats = source.stats();
    assert!(stats.leaked_blocks >= 1, "{stats:?}");
    assert_eq!((stats.pending_entries, stats.pending_blocks), (0, 0));
    assert_eq!(gpu.live_markers(), 0);
    assert_clean(&gpu);
}

#[test]
fn staged_downloads_refuse_open_captures_and_bad_requests() {
    let (gpu, source, context) = setup();
    let bytes = on_device(&gpu, 0x1000, 64);
    let scope = source.begin_capture(context, S2).unwrap();
    let err = download(&source, context, S1, 0x1000, 64).unwrap_err();
    assert!(
        matches!(
            err,
            Error::CaptureOpen {
                operation: "test download",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("capture scope is open"), "{err}");
    drop(scope);
    assert_eq!(download(&source, context, S1, 0x1000, 64).unwrap(), bytes);
    // Nothing on the device there: typed, and nothing left behind.
    let err = download(&source, context, S1, 0x9000, 64).unwrap_err();
    assert!(err.to_string().contains("no device bytes"), "{err}");
    // A range that wraps the address space.
    let err = download(&source, context, S1, u64::MAX, 2).unwrap_err();
    assert!(matches!(err, Error::AddressOverflow { .. }), "{err}");
    // A capturing stream the copy source did not open a scope for: the backend refuses.
    gpu.begin_capture(S1);
    let err = download(&source, context, S1, 0x1000, 64).unwrap_err();
    assert!(err.to_string().contains("capturing"), "{err}");
    gpu.abort_capture(S1);
    source.unregister_context(context).unwrap();
    let err = download(&source, context, S1, 0x1000, 64).unwrap_err();
    assert!(matches!(err, Error::UnknownContext { .. }), "{err}");
    assert_eq!(gpu.live_blocks(), 0);
    assert_eq!(gpu.live_markers(), 0);
    assert_clean(&gpu);
}
