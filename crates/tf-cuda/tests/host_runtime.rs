//! The runtime against the test driver (a fake libcuda over host memory): context health,
//! capture refusals and the capture guard, graphs, launches, memory and accounting.
//!
//! Every test holds the test driver's lock and resets it, so they run one at a time.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Arc, MutexGuard};

use proptest::prelude::*;
use tf_cuda::graph::Mode;
use tf_cuda::{
    usage, Args, Context, DeviceBuffer, Error, Event, HostBuffer, LaunchConfig, Module, Priority,
    Stream,
};
use tf_sys::Driver;
use tf_testdriver::{library_path, module_image, module_image_with, test_lock, Control};

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

struct Fixture {
    control: Control,
    driver: Arc<Driver>,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn new() -> Fixture {
        let serial = test_lock();
        let control = Control::open().expect("open the test driver's controls");
        control.reset();
        let path = library_path().expect("find the test driver");
        let driver = Arc::new(Driver::open_path(&path).expect("open the test driver"));
        Fixture {
            control,
            driver,
            _serial: serial,
        }
    }

    fn context(&self) -> Context {
        Context::new(Arc::clone(&self.driver), 0).expect("context on device 0")
    }

    /// Calls of every entry of the table since the last reset.
    fn total_calls(&self) -> u64 {
        tf_sys::ENTRIES
            .iter()
            .map(|e| self.control.call_count(e.name))
            .sum()
    }

    fn counter(&self, name: &str) -> i64 {
        self.control
            .counter(name)
            .unwrap_or_else(|| panic!("counter {name}"))
    }
}

fn kernels(ctx: &Context) -> Module {
    Module::load(
        ctx,
        &module_image(&["fill_u32", "add_f32", "scale_f32", "write_oob", "trap"]),
    )
    .expect("load the fake module")
}

fn fill_args(buf: &DeviceBuffer, value: u32) -> Args {
    let mut args = Args::new();
    args.push_addr(buf.addr())
        .push(value)
        .push(buf.len_elems::<u32>() as u64);
    args
}

#[test]
fn upload_download_round_trip_and_fill() {
    let f = Fixture::new();
    let ctx = f.context();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut buf = DeviceBuffer::from_bytes(&ctx, &data).unwrap();
    assert_eq!(buf.addr() % 256, 0);
    let mut back = vec![0u8; data.len()];
    buf.download(0, &mut back).unwrap();
    assert_eq!(back, data);

    // Bounds are checked before the driver.
    let before = f.total_calls();
    assert!(matches!(
        buf.upload(99_999, &[1, 2]),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        buf.download(100_001, &mut []),
        Err(Error::Invalid { .. })
    ));
    assert!(buf.at(100_000).is_ok());
    assert!(buf.at(100_001).is_err());
    assert!(buf.slice(10, 99_991).is_err());
    assert_eq!(f.total_calls(), before);

    buf.fill_u32(0xdead_beef, None).unwrap();
    let words: Vec<u32> = buf.to_vec().unwrap();
    assert_eq!(words.len(), 25_000);
    assert!(words.iter().all(|&w| w == 0xdead_beef));
    let mut odd = DeviceBuffer::alloc(&ctx, 6).unwrap();
    assert!(matches!(odd.fill_u32(1, None), Err(Error::Invalid { .. })));
    odd.fill_u8(9, None).unwrap();
    assert_eq!(odd.to_vec::<u8>().unwrap(), vec![9; 6]);
}

#[test]
fn two_contexts_of_one_device_are_distinct_and_refuse_each_others_streams() {
    let f = Fixture::new();
    let first = f.context();
    let second = f.context();
    // The driver hands both the device's primary context; to tf-cuda they are two contexts.
    assert_eq!(first.raw(), second.raw());
    assert!(!first.same_as(&second));
    assert!(first.same_as(&first.clone()));
    let stream = Stream::new(&first, false).unwrap();
    assert!(stream.context().same_as(&first));
    let mut buf = DeviceBuffer::alloc(&second, 8).unwrap();
    let e = buf.upload_async(0, &[1; 8], &stream).unwrap_err();
    assert!(e.to_string().contains("another context"), "{e}");
    let mut own = DeviceBuffer::alloc(&first, 8).unwrap();
    own.upload_async(0, &[1; 8], &stream).unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn async_upload_delivers_the_bytes_of_the_call_even_if_the_caller_overwrites_them() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut buf = DeviceBuffer::alloc(&ctx, 4096).unwrap();
    let mut caller = vec![0x11u8; 4096];
    buf.upload_async(0, &caller, &stream).unwrap();
    // The test driver reads a copy's host source when the copy runs (at synchronize), so an
    // upload straight from `caller` would deliver 0x22 here.
    caller.fill(0x22);
    drop(caller);
    assert!(tf_cuda::copy::stats().pending_blocks >= 1);
    stream.synchronize().unwrap();
    assert_eq!(buf.to_vec::<u8>().unwrap(), vec![0x11; 4096]);
    assert_eq!(
        tf_cuda::copy::stats().pending_blocks,
        0,
        "synchronize releases finished staging"
    );
}

#[test]
fn launch_packs_arguments_and_runs_kernels() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let module = kernels(&ctx);
    assert!(module.holds("add_f32"));
    assert!(!module.holds("no_such_kernel"));
    let add = module.function("add_f32").unwrap();
    let n = 1000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| 0.5 * i as f32).collect();
    let da = DeviceBuffer::from_slice(&ctx, &a).unwrap();
    let db = DeviceBuffer::from_slice(&ctx, &b).unwrap();
    let out = DeviceBuffer::alloc_elems::<f32>(&ctx, n).unwrap();
    let mut args = Args::new();
    args.push_addr(da.addr())
        .push_addr(db.addr())
        .push_addr(out.addr())
        .push(n as u64);
    assert_eq!(args.offsets(), &[0, 8, 16, 24]);
    launch(
        &stream,
        &add,
        &LaunchConfig::for_items(n as u32, 256),
        &args,
    )
    .unwrap();
    stream.synchronize().unwrap();
    let got: Vec<f32> = out.to_vec().unwrap();
    for i in 0..n {
        assert_eq!(got[i], a[i] + b[i], "element {i}");
    }
}

#[test]
fn missing_kernel_and_bad_image_errors_name_the_cause() {
    let f = Fixture::new();
    let ctx = f.context();
    let module = kernels(&ctx);
    let err = module.function("softmax_rows").unwrap_err();
    assert!(matches!(err, Error::KernelNotFound { .. }));
    assert!(err.to_string().contains("softmax_rows"), "{err}");

    let bad = module_image_with(&["fill_u32"], &[], Some("ptxas fatal: unknown opcode foo"));
    let err = Module::load(&ctx, &bad).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::ModuleLoad { .. }), "{text}");
    assert!(
        text.contains("unknown opcode foo"),
        "the JIT log is in the error: {text}"
    );

    assert!(matches!(
        Module::load(&ctx, &[]),
        Err(Error::Invalid { .. })
    ));
}

#[test]
fn launch_config_is_validated_before_the_driver() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 1024).unwrap();
    let args = fill_args(&buf, 1);
    let before = f.control.call_count("cuLaunchKernel");
    for cfg in [
        LaunchConfig::new(1, 2048),
        LaunchConfig::new(0, 64),
        LaunchConfig::new(1, (32, 33)),
        LaunchConfig::new(1, 64).with_shared(64 * 1024),
    ] {
        let err = launch(&stream, &fill, &cfg, &args).unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{err}");
    }
    assert_eq!(f.control.call_count("cuLaunchKernel"), before);
    // Opting in raises the shared memory limit.
    fill.set_max_dynamic_shared(100 * 1024).unwrap();
    launch(
        &stream,
        &fill,
        &LaunchConfig::new(1, 64).with_shared(64 * 1024),
        &args,
    )
    .unwrap();
    assert_eq!(f.control.call_count("cuLaunchKernel"), before + 1);
}

#[test]
fn failed_launch_names_kernel_grid_block_and_shared_bytes() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 1024).unwrap();
    assert!(f.control.fail_call("cuLaunchKernel", 1, 1, 1));
    let err = launch(
        &stream,
        &fill,
        &LaunchConfig::new((4, 2), 64).with_shared(512),
        &fill_args(&buf, 7),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::LaunchFailed { .. }), "{text}");
    for part in [
        "fill_u32",
        "grid 4x2x1",
        "block 64x1x1",
        "shared 512 B",
        "cuLaunchKernel",
    ] {
        assert!(text.contains(part), "missing {part:?} in {text}");
    }
    assert!(
        !ctx.is_lost(),
        "an ordinary launch failure does not lose the context"
    );
}

#[test]
fn sticky_fault_loses_the_context_and_no_driver_call_follows() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let module = kernels(&ctx);
    let oob = module.function("write_oob").unwrap();
    let mut buf = DeviceBuffer::alloc(&ctx, 256).unwrap();
    let host = HostBuffer::alloc(&ctx, 64).unwrap();
    let event = Event::new(&ctx, true).unwrap();
    let mut args = Args::new();
    args.push_addr(buf.addr());
    launch(&stream, &oob, &LaunchConfig::new(1, 1), &args).unwrap();
    let err = stream.synchronize().unwrap_err();
    assert!(err.is_context_lost(), "{err}");
    assert_eq!(err.code(), Some(700));
    assert!(ctx.is_lost());
    assert_eq!(ctx.lost_code(), Some(700));
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{err}"
    );

    let calls = f.total_calls();
    let lost = |r: Result<(), Error>, what: &str| match r {
        Err(e) if e.is_context_lost() => {}
        other => panic!("{what}: expected ContextLost, got {other:?}"),
    };
    lost(stream.synchronize(), "synchronize");
    lost(stream.query().map(|_| ()), "query");
    lost(DeviceBuffer::alloc(&ctx, 1024).map(|_| ()), "alloc");
    lost(buf.upload(0, &[1, 2, 3]), "upload");
    lost(buf.upload_async(0, &[1, 2, 3], &stream), "upload_async");
    lost(buf.download(0, &mut [0u8; 4]), "download");
    lost(buf.fill_u8(0, Some(&stream)), "fill");
    lost(
        launch(&stream, &oob, &LaunchConfig::new(1, 1), &args),
        "launch",
    );
    lost(Event::new(&ctx, false).map(|_| ()), "event");
    lost(event.record(&stream), "record");
    lost(Stream::new(&ctx, true).map(|_| ()), "stream");
    lost(
        stream.begin_capture(Mode::ThreadLocal).map(|_| ()),
        "capture",
    );
    lost(
        Module::load(&ctx, &module_image(&["trap"])).map(|_| ()),
        "module",
    );
    lost(ctx.synchronize(), "context synchronize");
    lost(ctx.memory_info().map(|_| ()), "memory info");
    // Teardown of everything made in the lost context leaks instead of calling in.
    drop((buf, host, event, oob, module, stream));
    drop(ctx);
    assert_eq!(
        f.total_calls(),
        calls,
        "a lost context must never call the driver again"
    );
}

#[test]
fn injected_sticky_fault_seen_by_any_call_loses_the_context() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 1024).unwrap();
    f.control.fault_next_launch(stream.raw(), 719);
    launch(
        &stream,
        &fill,
        &LaunchConfig::new(1, 256),
        &fill_args(&buf, 3),
    )
    .unwrap();
    // The fault surfaces at an event query, not at the stream: any call publishes it.
    let event = Event::new(&ctx, false).unwrap();
    event.record(&stream).unwrap();
    let mut seen = None;
    for _ in 0..4 {
        match event.query() {
            Ok(true) => break,
            Ok(false) => continue,
            Err(e) => {
                seen = Some(e);
                break;
            }
        }
    }
    let err = seen.expect("the injected fault surfaces at a query");
    assert!(err.is_context_lost(), "{err}");
    assert_eq!(ctx.lost_code(), Some(719));
    let calls = f.total_calls();
    assert!(buf.to_vec::<u32>().unwrap_err().is_context_lost());
    drop((event, buf, fill, module, stream, ctx));
    assert_eq!(f.total_calls(), calls);
}

#[test]
fn synchronous_upload_during_capture_is_refused_and_the_guard_closes_the_capture() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let mut buf = DeviceBuffer::alloc(&ctx, 1024).unwrap();
    {
        let capture = stream.begin_capture(Mode::ThreadLocal).unwrap();
        assert!(capture.stream().is_capturing().unwrap());
        assert_eq!(f.counter("captures_active"), 1);
        let copies = f.control.call_count("cuMemcpyHtoD_v2");
        let err = buf.upload(0, &[1, 2, 3, 4]).unwrap_err();
        assert!(matches!(err, Error::UnownedCaptureSource(_)), "{err}");
        assert!(err.to_string().contains("synchronous upload"), "{err}");
        assert_eq!(f.control.call_count("cuMemcpyHtoD_v2"), copies);
        // Also refused from a buffer made elsewhere and from a fresh allocation's fill path.
        assert!(matches!(
            DeviceBuffer::from_bytes(&ctx, &[9; 16]),
            Err(Error::UnownedCaptureSource(_)) | Err(Error::Driver(_))
        ));
        // `capture` dropped here without end().
    }
    assert_eq!(
        f.counter("captures_active"),
        0,
        "the guard ended the capture"
    );
    assert_eq!(f.counter("graphs"), 0, "the discarded graph was destroyed");
    assert!(!stream.is_capturing().unwrap());
    assert_eq!(tf_cuda::copy::stats().open_captures, 0);
    buf.upload(0, &[1, 2, 3, 4]).unwrap();
    assert_eq!(&buf.to_vec::<u8>().unwrap()[..4], &[1, 2, 3, 4]);
    // A new capture can begin on the same stream.
    let again = stream.begin_capture(Mode::ThreadLocal).unwrap();
    let graph = again.end().unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 0);
}

#[test]
fn captured_graph_replays_kernels_and_captured_uploads() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let module = kernels(&ctx);
    let scale = module.function("scale_f32").unwrap();
    let n = 256usize;
    let mut buf = DeviceBuffer::alloc_elems::<f32>(&ctx, n).unwrap();
    let ones = vec![1.0f32; n];
    let ones_bytes: Vec<u8> = ones.iter().flat_map(|v| v.to_le_bytes()).collect();
    let capture = stream.begin_capture(Mode::ThreadLocal).unwrap();
    // Reset to ones from owned staging, then double 3 times: each replay yields 8.
    buf.upload_async(0, &ones_bytes, &stream).unwrap();
    let mut args = Args::new();
    args.push_addr(buf.addr()).push(2.0f32).push(n as u64);
    for _ in 0..3 {
        launch(
            &stream,
            &scale,
            &LaunchConfig::for_items(n as u32, 128),
            &args,
        )
        .unwrap();
    }
    let graph = capture.end().unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 4);
    assert!(graph.owned_sources() >= 1, "captured staging is owned");
    let exec = graph.instantiate().unwrap();
    drop(graph);
    exec.upload(&stream).unwrap();
    for _ in 0..5 {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    let got: Vec<f32> = buf.to_vec().unwrap();
    assert!(got.iter().all(|&v| v == 8.0), "{:?}", &got[..4]);
}

#[test]
fn graph_kernel_node_params_and_exec_update() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 1024).unwrap();
    let capture = stream.begin_capture(Mode::ThreadLocal).unwrap();
    launch(
        &stream,
        &fill,
        &LaunchConfig::new(2, 128),
        &fill_args(&buf, 5),
    )
    .unwrap();
    let graph = capture.end().unwrap();
    let nodes = graph.nodes().unwrap();
    assert_eq!(nodes.len(), 1);
    let node = graph.kernel_node(nodes[0]).unwrap();
    assert_eq!(node.config, LaunchConfig::new(2, 128));
    let mut exec = graph.instantiate().unwrap();
    exec.set_kernel_node(
        nodes[0],
        &fill,
        &LaunchConfig::new(2, 128),
        &fill_args(&buf, 6),
    )
    .unwrap();
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(buf.to_vec::<u32>().unwrap().iter().all(|&v| v == 6));

    // Same topology: the update is accepted.
    let capture = stream.begin_capture(Mode::ThreadLocal).unwrap();
    launch(
        &stream,
        &fill,
        &LaunchConfig::new(2, 128),
        &fill_args(&buf, 9),
    )
    .unwrap();
    let same = capture.end().unwrap();
    assert_eq!(
        exec.update(&same).unwrap(),
        tf_cuda::graph::UpdateResult::Success
    );
    exec.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(buf.to_vec::<u32>().unwrap().iter().all(|&v| v == 9));
}

#[test]
fn instantiate_not_permitted_maps_to_graph_not_permitted() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let graph = stream
        .begin_capture(Mode::ThreadLocal)
        .unwrap()
        .end()
        .unwrap();
    assert!(f
        .control
        .fail_call("cuGraphInstantiateWithFlags", 1, 800, 1));
    let err = graph.instantiate().unwrap_err();
    assert!(matches!(err, Error::GraphNotPermitted { .. }), "{err}");
    assert_eq!(err.code(), Some(800));
    assert!(graph.instantiate().is_ok(), "only the injected call fails");
}

#[test]
fn zero_byte_buffers_never_call_the_driver() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let before_usage = usage();
    let calls = f.total_calls();
    let mut empty = DeviceBuffer::alloc(&ctx, 0).unwrap();
    assert_eq!(empty.addr(), 0);
    assert!(empty.is_empty());
    empty.upload(0, &[]).unwrap();
    empty.upload_async(0, &[], &stream).unwrap();
    empty.download(0, &mut []).unwrap();
    empty.fill_u8(1, None).unwrap();
    empty.fill_u32(1, Some(&stream)).unwrap();
    assert!(empty.to_vec::<u32>().unwrap().is_empty());
    let from_empty = DeviceBuffer::from_bytes(&ctx, &[]).unwrap();
    let host = HostBuffer::alloc(&ctx, 0).unwrap();
    assert!(host.as_slice().is_empty());
    drop((empty, from_empty, host));
    assert_eq!(f.total_calls(), calls);
    assert_eq!(
        usage().device_allocs_total,
        before_usage.device_allocs_total
    );
}

#[test]
fn allocation_limit_refuses_before_the_driver() {
    let f = Fixture::new();
    let ctx = f.context();
    let held = usage().device;
    tf_cuda::usage::set_device_limit(Some(held + 4096));
    let a = DeviceBuffer::alloc(&ctx, 4096);
    let allocs = f.control.call_count("cuMemAlloc_v2");
    let b = DeviceBuffer::alloc(&ctx, 1);
    tf_cuda::usage::set_device_limit(None);
    assert!(a.is_ok());
    let err = b.unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(f.control.call_count("cuMemAlloc_v2"), allocs);
    // Driver out-of-memory also comes back as OutOfMemory, and the counts stay exact.
    f.control.set_device_capacity(1 << 20);
    let before = usage();
    let err = DeviceBuffer::alloc(&ctx, 2 << 20).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    assert_eq!(usage().device, before.device);
    assert_eq!(usage().device_allocs, before.device_allocs);
}

#[test]
fn events_time_and_order_work_and_priorities_exist() {
    let f = Fixture::new();
    let ctx = f.context();
    let (least, greatest) = ctx.stream_priority_range().unwrap();
    assert!(greatest <= least);
    let urgent = Stream::with_priority(&ctx, false, Priority::Highest).unwrap();
    assert_eq!(urgent.priority(), greatest);
    let other = Stream::new(&ctx, false).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 4096).unwrap();
    let start = Event::new(&ctx, true).unwrap();
    let end = Event::new(&ctx, true).unwrap();
    start.record(&urgent).unwrap();
    for v in 0..4 {
        launch(
            &urgent,
            &fill,
            &LaunchConfig::new(4, 256),
            &fill_args(&buf, v),
        )
        .unwrap();
    }
    end.record_external(&urgent).unwrap();
    other.wait(&end).unwrap();
    end.synchronize().unwrap();
    assert!(end.query().unwrap());
    let ms = Event::elapsed_ms(&start, &end).unwrap();
    assert!(ms > 0.0, "elapsed {ms} ms");
    let untimed = Event::new(&ctx, false).unwrap();
    assert!(Event::elapsed_ms(&start, &untimed).is_err());
    assert!(buf.to_vec::<u32>().unwrap().iter().all(|&v| v == 3));
}

#[test]
fn two_dimensional_copy_moves_a_strided_block() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    // 8 rows of 64 bytes; copy a 5x16-byte block from column 8 to a packed destination.
    let src_bytes: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    let src = DeviceBuffer::from_bytes(&ctx, &src_bytes).unwrap();
    let mut dst = DeviceBuffer::alloc(&ctx, 80).unwrap();
    let src_view = src.slice(8, 512 - 8).unwrap();
    tf_cuda::copy_2d(&mut dst.view_mut(), 16, src_view, 64, 16, 5, &stream).unwrap();
    stream.synchronize().unwrap();
    let got = dst.to_vec::<u8>().unwrap();
    for row in 0..5 {
        for col in 0..16 {
            assert_eq!(got[row * 16 + col], src_bytes[row * 64 + 8 + col]);
        }
    }
    // Regions that do not fit are refused.
    assert!(tf_cuda::copy_2d(&mut dst.view_mut(), 16, src.view(), 64, 16, 9, &stream).is_err());
    assert!(tf_cuda::copy_2d(&mut dst.view_mut(), 8, src.view(), 64, 16, 2, &stream).is_err());
}

#[test]
fn host_buffer_is_pinned_mapped_and_counted() {
    let f = Fixture::new();
    let ctx = f.context();
    let before = usage();
    let mut host = HostBuffer::alloc(&ctx, 1000).unwrap();
    assert_ne!(host.device_addr(), 0);
    host.as_mut_slice()[..3].copy_from_slice(&[7, 8, 9]);
    let mid = usage();
    assert_eq!(mid.host, before.host + 1000);
    assert!(mid.host_peak >= mid.host);
    assert_eq!(mid.host_allocs, before.host_allocs + 1);
    let dev = DeviceBuffer::from_bytes(&ctx, &host.as_slice()[..3]).unwrap();
    assert_eq!(dev.to_vec::<u8>().unwrap(), vec![7, 8, 9]);
    drop(host);
    assert_eq!(usage().host, before.host);
    assert_eq!(f.counter("host_allocations"), 0);
}

#[test]
fn a_context_is_usable_from_another_thread() {
    let f = Fixture::new();
    let ctx = f.context();
    let c2 = ctx.clone();
    let got = std::thread::spawn(move || -> Result<Vec<u8>, Error> {
        let buf = DeviceBuffer::from_bytes(&c2, &[4, 5, 6])?;
        buf.to_vec()
    })
    .join()
    .expect("thread");
    assert_eq!(got.unwrap(), vec![4, 5, 6]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Threads allocating and freeing real buffers at once: the process counts match what is
    /// held, the driver agrees, and the peak covers every moment.
    #[test]
    fn usage_accounting_is_exact_under_concurrent_threads(
        plans in proptest::collection::vec(
            proptest::collection::vec((1usize..50_000, any::<bool>()), 1..12), 2..5)
    ) {
        let f = Fixture::new();
        let ctx = f.context();
        tf_cuda::usage::reset_peaks();
        let before = usage();
        let driver_before = f.counter("device_bytes");
        let handles: Vec<_> = plans.iter().cloned().map(|plan| {
            let ctx = ctx.clone();
            std::thread::spawn(move || -> Result<(Vec<DeviceBuffer>, u64), Error> {
                let mut kept = Vec::new();
                let mut own_peak = 0u64;
                let mut own = 0u64;
                for (len, free_it) in plan {
                    let b = DeviceBuffer::alloc(&ctx, len)?;
                    own += len as u64;
                    own_peak = own_peak.max(own);
                    if free_it {
                        drop(b);
                        own -= len as u64;
                    } else {
                        kept.push(b);
                    }
                }
                Ok((kept, own_peak))
            })
        }).collect();
        let mut kept = Vec::new();
        let mut max_own = 0;
        for h in handles {
            let (k, p) = h.join().map_err(|_| TestCaseError::fail("thread panicked"))?
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            kept.extend(k);
            max_own = max_own.max(p);
        }
        let kept_bytes: u64 = kept.iter().map(|b| b.len() as u64).sum();
        let now = usage();
        prop_assert_eq!(now.device - before.device, kept_bytes);
        prop_assert_eq!(now.device_allocs - before.device_allocs, kept.len() as u64);
        let all: u64 = plans.iter().flatten().count() as u64;
        prop_assert_eq!(now.device_allocs_total - before.device_allocs_total, all);
        prop_assert!(now.device_peak >= before.device + max_own);
        prop_assert!(now.device_peak >= now.device);
        // The driver holds at least the kept bytes (it rounds allocations up).
        prop_assert!(f.counter("device_bytes") - driver_before >= kept_bytes as i64);
        drop(kept);
        prop_assert_eq!(usage().device, before.device);
    }
}

#[test]
fn tensor_maps_check_operands_first_and_name_the_entry_point_that_fails() {
    use tf_cuda::tensor_map::{encode_bf16_tiles, encode_int8_tiles, Bf16Tiles};
    let fx = Fixture::new();
    let ctx = fx.context();
    let tiles = Bf16Tiles {
        base: 0x10_0000,
        cols: 4096,
        rows: 4096,
        batch: 1,
        row_stride_bytes: 8192,
        batch_stride_bytes: 0,
        box_cols: 64,
        box_rows: 128,
    };
    // A misaligned row stride is refused before the driver is asked.
    let bad = Bf16Tiles {
        row_stride_bytes: 8200,
        ..tiles
    };
    let err = encode_bf16_tiles(&ctx, &bad).expect_err("misaligned stride");
    assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
    // A valid map encodes (the test driver checks the driver's rules and writes a digest of the arguments), the same
    // way every time; another geometry gives another map.
    let map = encode_bf16_tiles(&ctx, &tiles).expect("encode");
    assert_eq!(map, encode_bf16_tiles(&ctx, &tiles).expect("encode again"));
    let taller = Bf16Tiles {
        rows: 4097,
        ..tiles
    };
    assert_ne!(
        map,
        encode_bf16_tiles(&ctx, &taller).expect("encode taller")
    );
    // Bytes: 128 a box row.
    let codes = Bf16Tiles {
        cols: 8192,
        box_cols: 128,
        ..tiles
    };
    assert!(encode_int8_tiles(&ctx, &codes).is_ok());
    // A refusal from the driver names the entry point.
    assert!(fx.control.fail_call("cuTensorMapEncodeTiled", 1, 1, 1));
    let err = encode_bf16_tiles(&ctx, &tiles).expect_err("injected failure");
    assert!(err.to_string().contains("cuTensorMapEncodeTiled"), "{err}");
}

#[test]
fn upload_async_pinned_refuses_a_stream_of_another_context() {
    let f = Fixture::new();
    let ctx = f.context();
    let other = f.context();
    let mut dst = DeviceBuffer::alloc(&ctx, 64).unwrap();
    let src = HostBuffer::from_bytes(&ctx, &[5u8; 64]).unwrap();
    let foreign = Stream::new(&other, true).unwrap();
    // SAFETY: `src` outlives the stream's work (the call is refused before any copy; the
    // accepted one below is synchronized before `src` drops).
    let refused = unsafe { dst.view_mut().upload_async_pinned(0, &src, 0, 64, &foreign) };
    let text = refused.unwrap_err().to_string();
    assert!(text.contains("another context"), "{text}");
    let own = Stream::new(&ctx, true).unwrap();
    // SAFETY: as above.
    unsafe { dst.view_mut().upload_async_pinned(0, &src, 0, 64, &own) }.unwrap();
    own.synchronize().unwrap();
    assert_eq!(dst.to_vec::<u8>().unwrap(), vec![5u8; 64]);
}

#[test]
fn large_uploads_are_pipelined_and_land_exactly() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    // Several 8 MiB chunks and a ragged tail, more than one ring of staging.
    let len = (100 << 20) + 3;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    let mut sync_dst = DeviceBuffer::alloc(&ctx, len).unwrap();
    sync_dst.upload(0, &bytes).unwrap();
    assert_eq!(sync_dst.to_vec::<u8>().unwrap(), bytes);
    assert_eq!(
        tf_cuda::copy::stats().pending_blocks,
        0,
        "synchronous: nothing left pending"
    );
    let mut async_dst = DeviceBuffer::alloc(&ctx, len).unwrap();
    let mut source = bytes.clone();
    async_dst.upload_async(0, &source, &stream).unwrap();
    // The caller's buffer is free at once.
    source.fill(0);
    assert!(
        tf_cuda::copy::stats().staging_bytes <= tf_copysource::classes::PIPELINE_RING_BYTES * 2
    );
    stream.synchronize().unwrap();
    assert_eq!(async_dst.to_vec::<u8>().unwrap(), bytes);
}

/// Bytes that differ from chunk to chunk and within each, so a misplaced chunk shows.
fn download_pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 13 % 251) as u8 ^ (i >> 23) as u8)
        .collect()
}

#[test]
fn large_downloads_are_staged_and_round_trip_exactly_around_chunk_boundaries() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let chunk = tf_copysource::classes::PIPELINE_CHUNK_BYTES;
    let most = 5 * chunk + 4097;
    let data = download_pattern(most);
    let buf = DeviceBuffer::from_bytes(&ctx, &data).unwrap();
    let events = f.counter("events");
    let leaked = tf_cuda::copy::stats().leaked_blocks;
    for len in [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 12_345, most] {
        let view = buf.slice(0, len).unwrap();
        let direct = f.control.call_count("cuMemcpyDtoH_v2");
        let staged = f.control.call_count("cuMemcpyDtoHAsync_v2");
        let mut out = vec![0xEEu8; len];
        view.download(0, &mut out).unwrap();
        assert!(out == data[..len], "download of {len} bytes differs");
        let (direct, staged) = (
            f.control.call_count("cuMemcpyDtoH_v2") - direct,
            f.control.call_count("cuMemcpyDtoHAsync_v2") - staged,
        );
        match len {
            0 => assert_eq!((direct, staged), (0, 0)),
            // Up to one chunk: today's single synchronous copy.
            n if n <= chunk => assert_eq!((direct, staged), (1, 0), "{n}"),
            // Above it: the first chunk synchronously (which orders the download), then one staged
            // copy a chunk.
            n => assert_eq!(
                (direct, staged),
                (1, (n - chunk).div_ceil(chunk) as u64),
                "{n}"
            ),
        }
        assert!(
            view.to_vec::<u8>().unwrap() == data[..len],
            "to_vec of {len} bytes"
        );
        // An offset that is not a multiple of anything.
        if len > 3 {
            let mut tail = vec![0u8; len - 3];
            view.download(3, &mut tail).unwrap();
            assert!(tail == data[3..len], "download at offset 3 of {len}");
        }
        let mut out = vec![0u8; len];
        // SAFETY: `out` stays alive and untouched until the stream is synchronized below.
        unsafe { view.download_async(0, &mut out, &stream) }.unwrap();
        stream.synchronize().unwrap();
        assert!(out == data[..len], "async download of {len} bytes differs");
        let stats = tf_cuda::copy::stats();
        assert_eq!(
            (stats.pending_entries, stats.pending_blocks),
            (0, 0),
            "{stats:?}"
        );
        assert!(
            stats.staging_bytes <= tf_copysource::classes::PIPELINE_RING_BYTES,
            "{stats:?}"
        );
    }
    // u32 elements through to_vec (the staged path writes uninitialized capacity).
    let words: Vec<u32> = buf.to_vec().unwrap();
    assert_eq!(words.len(), most / 4);
    assert!(words
        .iter()
        .zip(data.chunks_exact(4))
        .all(|(w, b)| w.to_ne_bytes() == b));
    assert_eq!(f.counter("events"), events, "every marker destroyed");
    assert_eq!(tf_cuda::copy::stats().leaked_blocks, leaked);
    // Repeated large downloads reuse the pool: no pinned allocation per call.
    let pinned = f.control.call_count("cuMemHostAlloc");
    for _ in 0..3 {
        assert!(buf.to_vec::<u8>().unwrap() == data);
    }
    assert_eq!(f.control.call_count("cuMemHostAlloc"), pinned);
}

#[test]
fn staged_downloads_are_ordered_after_their_stream() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let module = kernels(&ctx);
    let fill = module.function("fill_u32").unwrap();
    let len = 3 * tf_copysource::classes::PIPELINE_CHUNK_BYTES + 8;
    let buf = DeviceBuffer::alloc(&ctx, len).unwrap();
    let mut args = Args::new();
    args.push_addr(buf.addr())
        .push(0x0102_0304u32)
        .push((len / 4) as u64);
    launch(
        &stream,
        &fill,
        &LaunchConfig::for_items((len / 4) as u32, 256),
        &args,
    )
    .unwrap();
    // The kernel is still queued on a non-blocking stream: the staged copies run after it on that
    // stream.
    let mut out = vec![0u8; len];
    // SAFETY: `out` stays alive and untouched until the stream is synchronized below.
    unsafe { buf.view().download_async(0, &mut out, &stream) }.unwrap();
    stream.synchronize().unwrap();
    assert!(out
        .chunks_exact(4)
        .all(|w| w == 0x0102_0304u32.to_ne_bytes()));
    // A blocking stream's work is ordered before a synchronous download (legacy default stream).
    let blocking = Stream::new(&ctx, true).unwrap();
    let mut args = Args::new();
    args.push_addr(buf.addr())
        .push(0x0A0B_0C0Du32)
        .push((len / 4) as u64);
    launch(
        &blocking,
        &fill,
        &LaunchConfig::for_items((len / 4) as u32, 256),
        &args,
    )
    .unwrap();
    buf.download(0, &mut out).unwrap();
    assert!(out
        .chunks_exact(4)
        .all(|w| w == 0x0A0B_0C0Du32.to_ne_bytes()));
}

#[test]
fn staged_download_errors_midway_leave_nothing_pending() {
    let f = Fixture::new();
    let ctx = f.context();
    let chunk = tf_copysource::classes::PIPELINE_CHUNK_BYTES;
    let len = 9 * chunk + 5;
    let data = download_pattern(len);
    let buf = DeviceBuffer::from_bytes(&ctx, &data).unwrap();
    let events = f.counter("events");
    let leaked = tf_cuda::copy::stats().leaked_blocks;
    // (entry failing, at which call from now): non-sticky failures mid-way. (Staging comes from
    // the pool the upload above filled; a failed allocation is covered by the copy source's tests.)
    for (entry, nth) in [
        ("cuMemcpyDtoHAsync_v2", 6),
        ("cuMemcpyDtoHAsync_v2", 1),
        ("cuEventRecord", 2),
        ("cuEventSynchronize", 2),
    ] {
        assert!(f.control.fail_call(entry, nth, 1, 1), "{entry}");
        let mut out = vec![0u8; len];
        let Err(err) = buf.download(0, &mut out) else {
            panic!("{entry}: the download succeeded");
        };
        assert!(err.to_string().contains(entry), "{entry}: {err}");
        assert!(!err.is_context_lost());
        let stats = tf_cuda::copy::stats();
        assert_eq!(
            (stats.pending_entries, stats.pending_blocks),
            (0, 0),
            "{entry}: {stats:?}"
        );
        assert_eq!(
            stats.leaked_blocks, leaked,
            "{entry}: every block proven landed"
        );
        assert_eq!(
            f.counter("events"),
            events,
            "{entry}: every marker destroyed"
        );
        // Nothing is left queued that could still write a staging block.
        ctx.synchronize().unwrap();
        assert!(
            buf.to_vec::<u8>().unwrap() == data,
            "{entry}: the next download is exact"
        );
    }
    // A sticky fault mid-way: the context is lost, its blocks are leaked, not reused.
    assert!(f.control.fail_call("cuEventSynchronize", 1, 700, 1));
    let mut out = vec![0u8; len];
    let err = buf.download(0, &mut out).unwrap_err();
    assert!(err.is_context_lost(), "{err}");
    let stats = tf_cuda::copy::stats();
    assert_eq!(
        (stats.pending_entries, stats.pending_blocks),
        (0, 0),
        "{stats:?}"
    );
    assert!(stats.leaked_blocks > leaked, "{stats:?}");
}

#[test]
fn large_synchronous_downloads_are_refused_while_a_capture_is_open() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, false).unwrap();
    let other = Stream::new(&ctx, true).unwrap();
    let len = tf_copysource::classes::PIPELINE_CHUNK_BYTES + 1;
    let data = download_pattern(len);
    let buf = DeviceBuffer::from_bytes(&ctx, &data).unwrap();
    let mut out = vec![0u8; len];
    {
        let _capture = stream.begin_capture(Mode::ThreadLocal).unwrap();
        let calls = f.total_calls();
        let err = buf.download(0, &mut out).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::CopySource(tf_copysource::Error::CaptureOpen { .. })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("synchronous download"), "{err}");
        assert_eq!(f.total_calls(), calls, "refused before the driver");
        // The async variant keeps its direct copy while a capture is open (on another stream
        // here, so the copy runs).
        // SAFETY: `out` stays alive and untouched until `other` is synchronized below.
        unsafe { buf.view().download_async(0, &mut out, &other) }.unwrap();
        other.synchronize().unwrap();
        assert!(out == data);
        assert_eq!(f.counter("captures_active"), 1, "the capture is intact");
    }
    out.fill(0);
    buf.download(0, &mut out).unwrap();
    assert!(out == data);
    // A stream of another context is refused.
    let other_ctx = f.context();
    let foreign = Stream::new(&other_ctx, true).unwrap();
    // SAFETY: refused before any copy.
    let err = unsafe { buf.view().download_async(0, &mut out, &foreign) }.unwrap_err();
    assert!(err.to_string().contains("another context"), "{err}");
}

#[test]
fn download_async_pinned_lands_in_the_host_buffer() {
    let f = Fixture::new();
    let ctx = f.context();
    let stream = Stream::new(&ctx, true).unwrap();
    let len = tf_copysource::classes::PIPELINE_CHUNK_BYTES + 3;
    let data = download_pattern(len);
    let buf = DeviceBuffer::from_bytes(&ctx, &data).unwrap();
    let mut pinned = HostBuffer::alloc(&ctx, len + 16).unwrap();
    let staged = f.control.call_count("cuMemcpyDtoHAsync_v2");
    // SAFETY: `pinned` stays alive and untouched until the stream is synchronized below.
    unsafe {
        buf.view()
            .download_async_pinned(0, &mut pinned, 16, len, &stream)
    }
    .unwrap();
    assert_eq!(
        f.control.call_count("cuMemcpyDtoHAsync_v2") - staged,
        1,
        "one direct copy"
    );
    stream.synchronize().unwrap();
    assert!(pinned.as_slice()[16..] == data[..]);
    assert!(pinned.as_slice()[..16].iter().all(|&b| b == 0));
    // SAFETY: refused before any copy.
    let err = unsafe {
        buf.view()
            .download_async_pinned(0, &mut pinned, 17, len, &stream)
    }
    .unwrap_err();
    assert!(err.to_string().contains("destination"), "{err}");
}
