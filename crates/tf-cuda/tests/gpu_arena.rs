//! The VMM arena and the resident-memory report on a real GPU.
//! Needs a GPU; run through `cargo xtask gpu-bundle`.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use tf_cuda::arena::{Arena, ArenaError, ArenaOptions, VmmBackend};
use tf_cuda::gpu_memory::Baseline;
use tf_cuda::{open_driver, usage, Context, DeviceBuffer};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

fn context() -> Context {
    let driver = open_driver().unwrap_or_else(|e| panic!("the CUDA driver must open here: {e}"));
    Context::new(driver, 0).unwrap_or_else(|e| panic!("context on device 0: {e}"))
}

fn options() -> ArenaOptions {
    ArenaOptions {
        small_max: MIB,
        chunk_bytes: 4 * MIB,
        alignment: 512,
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn arena_allocates_maps_writes_reads_and_frees() {
    let ctx = context();
    let backend = match VmmBackend::open(&ctx, 8 << 30) {
        Ok(b) => b,
        Err(ArenaError::Unsupported { why }) => panic!("H200 must support VMM: {why}"),
        Err(e) => panic!("VMM backend: {e}"),
    };
    println!("VMM reservation {:?}", backend);
    let arena = Arc::new(Arena::new(backend, options()).expect("arena"));

    // Direct use: aligned, disjoint, reused, large chunks released.
    let a = arena.alloc(4096).expect("a");
    let b = arena.alloc(4096).expect("b");
    let c = arena.alloc(100).expect("c");
    for p in [a, b, c] {
        assert_eq!(p % 512, 0, "{p:#x} not 512-aligned");
    }
    assert!(b >= a + 4096 || a >= b + 4096, "a and b overlap");
    assert!(arena.free(b));
    let b2 = arena.alloc(4000).expect("b2");
    assert_eq!(b2, b, "the freed 4 KiB range is reused");
    let big = arena.alloc(5 * MIB).expect("large");
    let s = arena.stats();
    println!("after direct allocations: {s:?}");
    assert_eq!(s.large_chunks, 1);
    assert!(arena.free(big));
    assert_eq!(arena.stats().large_chunks, 0);
    for p in [a, b2, c] {
        assert!(arena.free(p));
    }
    assert!(!arena.free(a), "double free refused");
    let s = arena.stats();
    assert_eq!((s.live_bytes, s.live_allocs), (0, 0));

    // Through DeviceBuffer once installed: the memory is mapped and readable/writable.
    let before = DeviceBuffer::alloc(&ctx, 4096).expect("driver buffer");
    assert!(!before.from_hook());
    arena
        .install()
        .expect("install the arena as the allocation hook");
    let small = pattern(64 * KIB / 4, 7);
    let large = pattern(6 * MIB / 4, 11);
    let mut bufs = Vec::new();
    for (i, data) in [&small, &large, &small].into_iter().enumerate() {
        let buf = DeviceBuffer::from_slice(&ctx, data).expect("upload through the arena");
        assert!(buf.from_hook(), "buffer {i} should come from the arena");
        assert_eq!(buf.addr() % 256, 0);
        assert!(arena.owns(buf.addr()));
        let back: Vec<u32> = buf.to_vec().expect("download");
        assert!(
            back == *data,
            "buffer {i}: bytes read back differ from those written"
        );
        bufs.push(buf);
    }
    let mut filled = DeviceBuffer::alloc(&ctx, 2 * MIB).expect("alloc");
    filled.fill_u32(0xA5A5_5A5A, None).expect("fill");
    assert!(filled
        .to_vec::<u32>()
        .expect("download")
        .iter()
        .all(|&v| v == 0xA5A5_5A5A));
    let live = arena.stats();
    println!(
        "with {} arena buffers live: {live:?}; usage {:?}",
        bufs.len() + 1,
        usage()
    );
    assert_eq!(live.live_allocs, 4);
    drop(bufs);
    drop(filled);
    drop(before);
    let s = arena.stats();
    assert_eq!((s.live_bytes, s.live_allocs), (0, 0));
    let released = arena.trim();
    let s = arena.stats();
    println!("after free + trim ({released} bytes unmapped): {s:?}");
    assert_eq!(s.mapped_bytes, 0);
    // Still serves after a trim.
    let again = DeviceBuffer::from_slice(&ctx, &small).expect("after trim");
    assert!(again.from_hook());
    assert!(again.to_vec::<u32>().expect("download") == small);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn resident_report_sees_a_gigabyte() {
    let ctx = context();
    let baseline = Baseline::capture(&ctx).expect("baseline");
    let bytes = 1usize << 30;
    let buf = DeviceBuffer::alloc(&ctx, bytes).expect("1 GiB");
    let report = baseline.report(&ctx).expect("report");
    println!("resident report with 1 GiB held: {report:?}");
    assert!(
        report.resident >= bytes as u64,
        "resident {} < 1 GiB",
        report.resident
    );
    // Slack: driver rounding, other processes; a job-sized error would be a bug.
    assert!(
        report.resident <= bytes as u64 + (512 << 20),
        "resident {} far above 1 GiB",
        report.resident
    );
    assert!(report.accounted >= bytes as u64);
    drop(buf);
    let after = baseline.report(&ctx).expect("report");
    println!("after freeing it: {after:?}");
    assert!(after.resident < bytes as u64 / 2);
}
