//! The runtime on a real GPU and driver. Kernels are PTX text embedded below (the driver
//! JIT-compiles PTX, so no compiler is needed on the GPU machine).
//!
//! Run (on the GPU machine, from the bundle):
//!   gpu_runtime --include-ignored --test-threads=1 --nocapture --skip zz_
//!   gpu_runtime --include-ignored --test-threads=1 --nocapture --exact zz_sticky_fault_becomes_context_lost
//! The second run is separate because a real sticky fault breaks the process's primary context
//! for good: every later test in the same process would fail. (With one thread, tests also run
//! in name order, so `zz_` sorts last even in a single run.)
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Instant;

use tf_cuda::graph::Mode;
use tf_cuda::launch::KernelArg;
use tf_cuda::{
    Args, Context, DeviceBuffer, Error, Event, HostBuffer, LaunchConfig, Module, Priority, Stream,
};

/// `Stream::launch` for this file's tests. The launches here address `DeviceBuffer`s that the test holds
/// across the launch (or, in the fault tests, addresses meant to fault on the device), so the contract holds.
fn launch(
    stream: &tf_cuda::Stream,
    function: &tf_cuda::Function,
    cfg: &tf_cuda::LaunchConfig,
    args: &tf_cuda::Args,
) -> Result<(), tf_cuda::Error> {
    // SAFETY: see above: every address points into a live buffer of the stream's context (or is an
    // intended device fault); DeviceBuffer's Drop synchronizes the context before freeing.
    unsafe { stream.launch(function, cfg, args) }
}

const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry fill_u32(
    .param .u64 p_ptr,
    .param .u32 p_val,
    .param .u64 p_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_ptr];
    ld.param.u32 %r1, [p_val];
    ld.param.u64 %rd2, [p_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd5, %rd1;
    shl.b64 %rd6, %rd3, 2;
    add.u64 %rd5, %rd5, %rd6;
    st.global.u32 [%rd5], %r1;
DONE:
    ret;
}

.visible .entry add_u32(
    .param .u64 p_ptr,
    .param .u32 p_val,
    .param .u64 p_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<7>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_ptr];
    ld.param.u32 %r1, [p_val];
    ld.param.u64 %rd2, [p_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd3, %r2, %r3;
    cvt.u64.u32 %rd4, %r4;
    add.u64 %rd3, %rd3, %rd4;
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd5, %rd1;
    shl.b64 %rd6, %rd3, 2;
    add.u64 %rd5, %rd5, %rd6;
    ld.global.u32 %r5, [%rd5];
    add.u32 %r6, %r5, %r1;
    st.global.u32 [%rd5], %r6;
DONE:
    ret;
}

.visible .entry probe_args(
    .param .u64 p_out,
    .param .u32 p_a,
    .param .f64 p_b,
    .param .align 8 .b8 p_s[16]
)
{
    .reg .b32 %r<4>;
    .reg .f32 %f<2>;
    .reg .f64 %fd<2>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [p_a];
    cvt.u64.u32 %rd2, %r1;
    st.global.u64 [%rd1], %rd2;
    ld.param.f64 %fd1, [p_b];
    mov.b64 %rd3, %fd1;
    st.global.u64 [%rd1+8], %rd3;
    ld.param.u64 %rd4, [p_s];
    st.global.u64 [%rd1+16], %rd4;
    ld.param.s32 %r2, [p_s+8];
    cvt.s64.s32 %rd5, %r2;
    st.global.u64 [%rd1+24], %rd5;
    ld.param.f32 %f1, [p_s+12];
    mov.b32 %r3, %f1;
    cvt.u64.u32 %rd6, %r3;
    st.global.u64 [%rd1+32], %rd6;
    ret;
}

.visible .entry write_at(
    .param .u64 p_addr
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [p_addr];
    mov.u32 %r1, 42;
    st.global.u32 [%rd1], %r1;
    ret;
}
"#;

fn gpu() -> Context {
    let driver = match tf_cuda::open_driver() {
        Ok(d) => d,
        Err(e) => panic!("the CUDA driver did not open: {e}"),
    };
    Context::new(driver, 0).unwrap_or_else(|e| panic!("device 0's context: {e}"))
}

fn module(ctx: &Context) -> Module {
    Module::load_ptx(ctx, PTX).unwrap_or_else(|e| panic!("the test PTX did not load: {e}"))
}

/// A deterministic byte pattern (xorshift64 words), different per seed.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[track_caller]
fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    match first_difference(got, want) {
        None => println!("{what}: {} bytes identical", want.len()),
        Some(i) => panic!(
            "{what}: differs at byte {i} of {} (got {:?}, want {:?})",
            want.len(),
            got.get(i),
            want.get(i)
        ),
    }
}

fn fill_args(addr: u64, value: u32, n: usize) -> Args {
    let mut args = Args::new();
    args.push_addr(addr).push(value).push(n as u64);
    args
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn device_report() {
    let ctx = gpu();
    let info = tf_cuda::driver_info(ctx.driver()).expect("driver info");
    println!(
        "driver {} (CUDA {}), {} devices; optional entries {:?}",
        info.path.display(),
        info.version_text(),
        info.device_count,
        info.optional_entries
    );
    let dev = ctx.device_info().expect("device info");
    let mem = ctx.memory_info().expect("memory info");
    let (least, greatest) = ctx.stream_priority_range().expect("priority range");
    println!(
        "device 0: {} sm_{}{} {} SMs, {:.1} GiB total, {:.1} GiB free, opt-in shared {} B, stream priorities {least}..{greatest}",
        dev.name,
        dev.compute_capability.0,
        dev.compute_capability.1,
        dev.sm_count,
        mem.total as f64 / (1u64 << 30) as f64,
        mem.free as f64 / (1u64 << 30) as f64,
        dev.max_shared_per_block_optin
    );
    assert!(info.device_count >= 1);
    assert!(dev.sm_count > 0);
    assert!(mem.free > 0 && mem.free <= mem.total);
    assert!(greatest <= least);
    assert!(!ctx.is_lost());
}

fn round_trip(ctx: &Context, len: usize) {
    let stream = Stream::new(ctx, false).expect("stream");
    let label = if len >= 1 << 30 { "1 GiB" } else { "1 MiB" };

    // Synchronous, pageable.
    let data = pattern(len, 1);
    let mut buf = DeviceBuffer::alloc(ctx, len).expect("alloc");
    assert_eq!(buf.addr() % 256, 0, "256-byte aligned");
    let t = Instant::now();
    buf.upload(0, &data).expect("sync upload");
    let up = t.elapsed();
    let mut back = vec![0u8; len];
    let t = Instant::now();
    buf.download(0, &mut back).expect("sync download");
    let down = t.elapsed();
    assert_same(&format!("{label} sync pageable round trip"), &back, &data);
    println!(
        "{label} sync pageable: upload {:.2} GB/s, download {:.2} GB/s",
        len as f64 / up.as_secs_f64() / 1e9,
        len as f64 / down.as_secs_f64() / 1e9
    );

    // Asynchronous through private staging, pageable source.
    let data2 = pattern(len, 2);
    buf.upload_async(0, &data2, &stream).expect("async upload");
    stream.synchronize().expect("synchronize");
    back.fill(0);
    // SAFETY: `back` stays alive and untouched until the stream is synchronized below.
    unsafe { buf.view().download_async(0, &mut back, &stream) }.expect("async download");
    stream.synchronize().expect("synchronize");
    assert_same(&format!("{label} async pageable round trip"), &back, &data2);

    // Asynchronous from pinned memory both ways.
    let data3 = pattern(len, 3);
    let pinned = HostBuffer::from_bytes(ctx, &data3).expect("pinned source");
    let mut pinned_back = HostBuffer::alloc(ctx, len).expect("pinned destination");
    // SAFETY: `pinned` lives until after the synchronize below and is not modified.
    unsafe {
        buf.view_mut()
            .upload_async_pinned(0, &pinned, 0, len, &stream)
    }
    .expect("pinned upload");
    // SAFETY: `pinned_back` stays alive and untouched until the synchronize below.
    unsafe {
        buf.view()
            .download_async(0, pinned_back.as_mut_slice(), &stream)
    }
    .expect("pinned download");
    stream.synchronize().expect("synchronize");
    assert_same(
        &format!("{label} async pinned round trip"),
        pinned_back.as_slice(),
        &data3,
    );

    // Synchronous, pinned source and destination.
    let data4 = pattern(len, 4);
    pinned_back.as_mut_slice().copy_from_slice(&data4);
    buf.upload(0, pinned_back.as_slice())
        .expect("sync upload from pinned");
    pinned_back.as_mut_slice().fill(0);
    buf.download(0, pinned_back.as_mut_slice())
        .expect("sync download to pinned");
    assert_same(
        &format!("{label} sync pinned round trip"),
        pinned_back.as_slice(),
        &data4,
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn round_trips_1_mib() {
    round_trip(&gpu(), 1 << 20);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn round_trips_1_gib() {
    round_trip(&gpu(), 1 << 30);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn async_upload_survives_the_caller_overwriting_its_buffer() {
    let ctx = gpu();
    let stream = Stream::new(&ctx, false).expect("stream");
    let len = 256 << 20;
    let original = pattern(len, 7);
    let mut caller = original.clone();
    let mut buf = DeviceBuffer::alloc(&ctx, len).expect("alloc");
    // Keep the stream busy first so the copy cannot have run when the call returns.
    let m = module(&ctx);
    let add = m.function("add_u32").expect("add_u32");
    let mut scratch = DeviceBuffer::alloc_elems::<u32>(&ctx, 1 << 24).expect("scratch");
    scratch.fill_u32(0, Some(&stream)).expect("fill");
    let n = 1usize << 24;
    for _ in 0..50 {
        launch(
            &stream,
            &add,
            &LaunchConfig::for_items(n as u32, 256),
            &fill_args(scratch.addr(), 1, n),
        )
        .expect("busy launch");
    }
    buf.upload_async(0, &caller, &stream).expect("async upload");
    caller.fill(0xEE);
    drop(caller);
    stream.synchronize().expect("synchronize");
    let got = buf.to_vec::<u8>().expect("download");
    assert_same(
        "async upload after the caller overwrote and dropped its buffer",
        &got,
        &original,
    );
    let busy: Vec<u32> = scratch
        .slice(0, 16)
        .expect("slice")
        .to_vec()
        .expect("download");
    assert!(
        busy.iter().all(|&v| v == 50),
        "busy kernels ran: {:?}",
        &busy[..4]
    );
    println!(
        "copy-source stats after synchronize: {:?}",
        tf_cuda::copy::stats()
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn argument_packing_matches_the_kernel_abi() {
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Triple {
        x: u64,
        y: i32,
        z: f32,
    }
    // SAFETY: repr(C) of scalars, matching the PTX `.align 8 .b8 p_s[16]` parameter.
    unsafe impl KernelArg for Triple {}

    let ctx = gpu();
    let stream = Stream::new(&ctx, true).expect("stream");
    let m = module(&ctx);
    let probe = m.function("probe_args").expect("probe_args");
    let out = DeviceBuffer::alloc_elems::<u64>(&ctx, 5).expect("alloc");
    let mut args = Args::new();
    args.push_addr(out.addr())
        .push(0xC0FF_EE01u32)
        .push(-2.75f64)
        .push(Triple {
            x: 0x0123_4567_89AB_CDEF,
            y: -12345,
            z: 3.5,
        });
    println!(
        "probe_args offsets {:?}, {} bytes",
        args.offsets(),
        args.byte_len()
    );
    assert_eq!(args.offsets(), &[0, 8, 16, 24]);
    launch(&stream, &probe, &LaunchConfig::new(1, 1), &args).expect("launch");
    stream.synchronize().expect("synchronize");
    let got: Vec<u64> = out.to_vec().expect("download");
    println!("probe_args wrote {got:x?}");
    assert_eq!(got[0], 0xC0FF_EE01);
    assert_eq!(f64::from_bits(got[1]), -2.75);
    assert_eq!(got[2], 0x0123_4567_89AB_CDEF);
    assert_eq!(got[3] as i64, -12345);
    assert_eq!(f32::from_bits(got[4] as u32), 3.5);
    let attrs = probe.attributes().expect("attributes");
    println!("probe_args: {attrs:?}, driver name {}", probe.driver_name());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn kernels_fill_and_mapped_host_memory() {
    let ctx = gpu();
    let stream = Stream::new(&ctx, true).expect("stream");
    let m = module(&ctx);
    let fill = m.function("fill_u32").expect("fill_u32");
    let n = 100_000usize;
    let buf = DeviceBuffer::alloc_elems::<u32>(&ctx, n).expect("alloc");
    launch(
        &stream,
        &fill,
        &LaunchConfig::for_items(n as u32, 256),
        &fill_args(buf.addr(), 77, n),
    )
    .expect("launch");
    stream.synchronize().expect("synchronize");
    let got: Vec<u32> = buf.to_vec().expect("download");
    assert!(got.iter().all(|&v| v == 77), "fill over {n}");

    // A kernel writes pinned mapped host memory directly.
    let host = HostBuffer::alloc(&ctx, 4 * 1000).expect("mapped host");
    launch(
        &stream,
        &fill,
        &LaunchConfig::for_items(1000, 128),
        &fill_args(host.device_addr(), 5, 1000),
    )
    .expect("launch on mapped memory");
    stream.synchronize().expect("synchronize");
    let words: Vec<u32> = host
        .as_slice()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert!(
        words.iter().all(|&v| v == 5),
        "mapped host memory written by the kernel"
    );

    // Dynamic shared memory above 48 KiB needs the opt-in.
    let cfg = LaunchConfig::new(1, 32).with_shared(96 * 1024);
    assert!(matches!(
        launch(&stream, &fill, &cfg, &fill_args(buf.addr(), 1, 32)),
        Err(Error::Invalid { .. })
    ));
    fill.set_max_dynamic_shared(96 * 1024).expect("opt in");
    launch(&stream, &fill, &cfg, &fill_args(buf.addr(), 1, 32)).expect("launch with 96 KiB shared");
    stream.synchronize().expect("synchronize");

    // Refusals before the driver, and errors naming the cause.
    let err = launch(
        &stream,
        &fill,
        &LaunchConfig::new(1, 2048),
        &fill_args(buf.addr(), 1, 1),
    )
    .unwrap_err();
    println!("2048-thread block: {err}");
    assert!(matches!(err, Error::Invalid { .. }));
    let err = m.function("not_in_module").unwrap_err();
    println!("missing kernel: {err}");
    assert!(err.to_string().contains("not_in_module"));
    assert!(m.holds("fill_u32") && !m.holds("not_in_module"));
    let broken = PTX.replace("st.global.u32 [%rd5], %r1;", "st.global.bogus [%rd5], %r1;");
    let err = Module::load_ptx(&ctx, &broken).unwrap_err();
    println!("broken PTX: {err}");
    match &err {
        Error::ModuleLoad { log, .. } => assert!(log != "(empty)", "the JIT log is reported"),
        other => panic!("expected ModuleLoad, got {other:?}"),
    }
    assert!(!ctx.is_lost());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn captured_graph_of_1000_launches_replays() {
    let ctx = gpu();
    let stream = Stream::new(&ctx, false).expect("stream");
    let m = module(&ctx);
    let add = m.function("add_u32").expect("add_u32");
    let n = 4096usize;
    let mut buf = DeviceBuffer::alloc_elems::<u32>(&ctx, n).expect("alloc");
    buf.fill_u32(0, None).expect("zero");
    let cfg = LaunchConfig::for_items(n as u32, 256);
    let args = fill_args(buf.addr(), 1, n);
    let zeros = vec![0u8; 4 * n];

    let t = Instant::now();
    let capture = stream
        .begin_capture(Mode::ThreadLocal)
        .expect("begin capture");
    // The graph starts by resetting the buffer from owned staging.
    buf.upload_async(0, &zeros, &stream)
        .expect("captured upload");
    for _ in 0..1000 {
        launch(&stream, &add, &cfg, &args).expect("captured launch");
    }
    let graph = capture.end().expect("end capture");
    let nodes = graph.nodes().expect("nodes").len();
    let exec = graph.instantiate().expect("instantiate");
    exec.upload(&stream).expect("graph upload");
    println!(
        "captured {nodes} nodes ({} owned staging blocks), instantiated in {:.1} ms",
        graph.owned_sources(),
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(nodes, 1001);
    drop(graph);

    let start = Event::new(&ctx, true).expect("event");
    let end = Event::new(&ctx, true).expect("event");
    for replay in 1..=3u32 {
        start.record(&stream).expect("record");
        exec.launch(&stream).expect("graph launch");
        end.record(&stream).expect("record");
        stream.synchronize().expect("synchronize");
        let got: Vec<u32> = buf.to_vec().expect("download");
        assert!(
            got.iter().all(|&v| v == 1000),
            "replay {replay}: {:?}",
            &got[..4]
        );
        println!(
            "replay {replay}: 1000 launches in {:.3} ms",
            Event::elapsed_ms(&start, &end).expect("elapsed")
        );
    }
    // The same 1000 launches eagerly, for comparison.
    start.record(&stream).expect("record");
    for _ in 0..1000 {
        launch(&stream, &add, &cfg, &args).expect("eager launch");
    }
    end.record(&stream).expect("record");
    stream.synchronize().expect("synchronize");
    println!(
        "eager: 1000 launches in {:.3} ms",
        Event::elapsed_ms(&start, &end).expect("elapsed")
    );
    let got: Vec<u32> = buf.to_vec().expect("download");
    assert!(got.iter().all(|&v| v == 2000));

    // An un-ended capture is discarded: nothing it recorded runs, and uploads work again.
    {
        let _discarded = stream
            .begin_capture(Mode::ThreadLocal)
            .expect("begin capture");
        launch(&stream, &add, &cfg, &args).expect("captured launch");
        assert!(matches!(
            buf.upload(0, &zeros),
            Err(Error::UnownedCaptureSource(_))
        ));
    }
    assert!(!stream.is_capturing().expect("capture status"));
    stream.synchronize().expect("synchronize");
    let got: Vec<u32> = buf.to_vec().expect("download");
    assert!(
        got.iter().all(|&v| v == 2000),
        "the discarded capture never ran"
    );
    buf.upload(0, &zeros)
        .expect("sync upload after the discarded capture");
    println!("un-ended capture discarded; synchronous uploads allowed again");

    // Exec update and kernel-node parameters on the real driver.
    let capture = stream
        .begin_capture(Mode::ThreadLocal)
        .expect("begin capture");
    launch(&stream, &add, &cfg, &fill_args(buf.addr(), 5, n)).expect("launch");
    let small = capture.end().expect("end");
    let nodes = small.nodes().expect("nodes");
    let node = small.kernel_node(nodes[0]).expect("kernel node");
    assert_eq!(node.config, cfg);
    let mut exec = small.instantiate().expect("instantiate");
    exec.set_kernel_node(nodes[0], &add, &cfg, &fill_args(buf.addr(), 7, n))
        .expect("exec kernel node params");
    exec.launch(&stream).expect("launch");
    stream.synchronize().expect("synchronize");
    let got: Vec<u32> = buf.to_vec().expect("download");
    assert!(got.iter().all(|&v| v == 7), "{:?}", &got[..4]);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn two_dimensional_copies() {
    let ctx = gpu();
    let stream = Stream::new(&ctx, false).expect("stream");
    let (rows, pitch, width, col) = (300usize, 1024usize, 200usize, 96usize);
    let src_bytes = pattern(rows * pitch, 11);
    let src = DeviceBuffer::from_bytes(&ctx, &src_bytes).expect("source");
    let mut dst = DeviceBuffer::alloc(&ctx, rows * width).expect("destination");
    tf_cuda::copy_2d(
        &mut dst.view_mut(),
        width,
        src.slice(col, rows * pitch - col).expect("slice"),
        pitch,
        width,
        rows,
        &stream,
    )
    .expect("2-D copy");
    stream.synchronize().expect("synchronize");
    let got = dst.to_vec::<u8>().expect("download");
    let want: Vec<u8> = (0..rows)
        .flat_map(|r| {
            src_bytes[r * pitch + col..r * pitch + col + width]
                .iter()
                .copied()
        })
        .collect();
    assert_same("2-D copy of a 300x200 block at pitch 1024", &got, &want);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn events_priorities_and_copy_bandwidth() {
    let ctx = gpu();
    let (least, greatest) = ctx.stream_priority_range().expect("range");
    let urgent = Stream::with_priority(&ctx, false, Priority::Highest).expect("urgent stream");
    let lazy = Stream::with_priority(&ctx, false, Priority::Lowest).expect("lazy stream");
    println!(
        "stream priorities: range {least}..{greatest}; urgent {}, lazy {}",
        urgent.priority(),
        lazy.priority()
    );
    assert_eq!(urgent.priority(), greatest);
    assert_eq!(lazy.priority(), least);

    let len = 1usize << 30;
    let start = Event::new(&ctx, true).expect("event");
    let end = Event::new(&ctx, true).expect("event");

    // Host to device from pinned memory (no private copy): the DMA rate.
    let pinned = HostBuffer::from_bytes(&ctx, &pattern(len, 5)).expect("pinned");
    let mut dev = DeviceBuffer::alloc(&ctx, len).expect("alloc");
    for round in 0..3 {
        start.record(&urgent).expect("record");
        // SAFETY: `pinned` outlives the synchronize below and is not modified.
        unsafe {
            dev.view_mut()
                .upload_async_pinned(0, &pinned, 0, len, &urgent)
        }
        .expect("pinned upload");
        end.record(&urgent).expect("record");
        end.synchronize().expect("synchronize");
        let ms = Event::elapsed_ms(&start, &end).expect("elapsed");
        println!(
            "H2D from pinned, 1 GiB, round {round}: {ms:.3} ms = {:.1} GB/s",
            len as f64 / (ms as f64 * 1e-3) / 1e9
        );
    }

    // Host to device through the copy source's pinned staging (pageable caller bytes).
    let pageable = pattern(len, 6);
    for round in 0..2 {
        let t = Instant::now();
        dev.upload_async(0, &pageable, &urgent)
            .expect("staged upload");
        urgent.synchronize().expect("synchronize");
        let s = t.elapsed().as_secs_f64();
        println!(
            "H2D through staging (copy into pinned + DMA), 1 GiB, round {round}: {:.1} ms = {:.1} GB/s",
            s * 1e3,
            len as f64 / s / 1e9
        );
    }

    // Device to device.
    let mut dev2 = DeviceBuffer::alloc(&ctx, len).expect("alloc");
    start.record(&lazy).expect("record");
    dev2.copy_from(0, dev.view(), Some(&lazy)).expect("d2d");
    end.record_external(&lazy).expect("record external");
    urgent.wait(&end).expect("cross-stream wait");
    urgent.synchronize().expect("synchronize");
    assert!(end.query().expect("query"));
    let ms = Event::elapsed_ms(&start, &end).expect("elapsed");
    println!(
        "D2D 1 GiB: {ms:.3} ms = {:.1} GB/s (read + write)",
        2.0 * len as f64 / (ms as f64 * 1e-3) / 1e9
    );
    let a = dev
        .slice(len - 4096, 4096)
        .expect("slice")
        .to_vec::<u8>()
        .expect("d");
    let b = dev2
        .slice(len - 4096, 4096)
        .expect("slice")
        .to_vec::<u8>()
        .expect("d");
    assert_same("D2D tail", &b, &a);
    let usage = tf_cuda::usage();
    println!("usage: {usage:?}");
    assert!(usage.device >= 2 * len as u64);
    assert!(usage.host >= len as u64);
}

/// Copies of 1 GiB between pageable host memory and the device through the runtime's own
/// paths (pipelined pinned staging): each direction must reach 10 GB/s (best of three rounds).
#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn staged_copies_of_1_gib_reach_10_gb_per_s() {
    const TARGET_GBPS: f64 = 10.0;
    let ctx = gpu();
    let stream = Stream::new(&ctx, true).expect("stream");
    let len = 1usize << 30;
    let data = pattern(len, 11);
    let mut dev = DeviceBuffer::alloc(&ctx, len).expect("alloc");
    let mut back = vec![0u8; len];
    let gbps = |s: f64| len as f64 / s / 1e9;
    let mut best = [0.0f64; 4];
    for round in 0..3 {
        let t = Instant::now();
        dev.upload(0, &data).expect("sync upload");
        let sync_up = gbps(t.elapsed().as_secs_f64());
        back.fill(0);
        let t = Instant::now();
        dev.download(0, &mut back).expect("sync download");
        let sync_down = gbps(t.elapsed().as_secs_f64());
        assert_same("1 GiB sync round trip", &back, &data);

        let t = Instant::now();
        dev.upload_async(0, &data, &stream).expect("async upload");
        stream.synchronize().expect("synchronize");
        let async_up = gbps(t.elapsed().as_secs_f64());
        back.fill(0);
        let t = Instant::now();
        // SAFETY: `back` stays alive and untouched until the stream is synchronized below.
        unsafe { dev.view().download_async(0, &mut back, &stream) }.expect("async download");
        stream.synchronize().expect("synchronize");
        let async_down = gbps(t.elapsed().as_secs_f64());
        assert_same("1 GiB async round trip", &back, &data);
        println!(
            "1 GiB staged copies, round {round}: sync upload {sync_up:.1} GB/s, sync download {sync_down:.1} GB/s, \
             async upload {async_up:.1} GB/s, async download {async_down:.1} GB/s"
        );
        for (b, v) in best
            .iter_mut()
            .zip([sync_up, sync_down, async_up, async_down])
        {
            *b = b.max(v);
        }
    }
    let stats = tf_cuda::copy::stats();
    println!(
        "best of 3: sync upload {:.1}, sync download {:.1}, async upload {:.1}, async download {:.1} GB/s (target {TARGET_GBPS}); copy source {stats:?}",
        best[0], best[1], best[2], best[3]
    );
    let names = [
        "sync upload",
        "sync download",
        "async upload",
        "async download",
    ];
    let slow: Vec<String> = names
        .iter()
        .zip(best)
        .filter(|(_, v)| *v < TARGET_GBPS)
        .map(|(n, v)| format!("{n} {v:.1} GB/s"))
        .collect();
    assert!(
        slow.is_empty(),
        "below {TARGET_GBPS} GB/s: {}",
        slow.join(", ")
    );
}

/// Runs last (name order) and best alone: it breaks the process's context on purpose.
#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn zz_sticky_fault_becomes_context_lost() {
    let ctx = gpu();
    let stream = Stream::new(&ctx, false).expect("stream");
    let m = module(&ctx);
    let write_at = m.function("write_at").expect("write_at");
    let mut buf = DeviceBuffer::alloc(&ctx, 4096).expect("alloc");
    let mut args = Args::new();
    args.push_addr(0x10);
    launch(&stream, &write_at, &LaunchConfig::new(1, 1), &args)
        .expect("the launch itself is accepted");
    let err = stream
        .synchronize()
        .expect_err("a store to address 0x10 faults");
    println!("fault seen at synchronize: {err}");
    assert!(err.is_context_lost(), "expected ContextLost, got {err:?}");
    assert!(ctx.is_lost());
    println!("sticky code: {:?}", ctx.lost_code());
    assert!(matches!(ctx.lost_code(), Some(700) | Some(719)));
    // Every later call fails fast without reaching the driver.
    let t = Instant::now();
    let results: Vec<(&str, Result<(), Error>)> = vec![
        ("synchronize", stream.synchronize()),
        ("alloc", DeviceBuffer::alloc(&ctx, 1024).map(|_| ())),
        ("upload", buf.upload(0, &[1, 2, 3])),
        ("download", buf.download(0, &mut [0u8; 4])),
        (
            "launch",
            launch(&stream, &write_at, &LaunchConfig::new(1, 1), &args),
        ),
        ("event", Event::new(&ctx, true).map(|_| ())),
        ("memory info", ctx.memory_info().map(|_| ())),
    ];
    for (what, r) in &results {
        match r {
            Err(e) if e.is_context_lost() => println!("{what}: ContextLost (as expected)"),
            other => panic!("{what}: expected ContextLost, got {other:?}"),
        }
    }
    println!(
        "{} refused calls took {:.1} us in all",
        results.len(),
        t.elapsed().as_secs_f64() * 1e6
    );
    // Dropping everything made in the lost context leaks quietly and does not panic.
    drop((buf, write_at, m, stream));
    let ctx2 = Arc::new(ctx);
    drop(ctx2);
    println!("lost context torn down without driver calls; test finished cleanly");
}
