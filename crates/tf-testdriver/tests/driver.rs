//! Behaviour of the test driver, exercised through tf-sys exactly as tf-cuda uses it.
//!
//! SAFETY (every `unsafe` call in this file): arguments are valid out-pointers, live host buffers
//! and handles obtained from the same driver, as the C API requires.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Each unsafe call here is covered by the SAFETY note at the top of this file.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::{null, null_mut};
use std::sync::MutexGuard;

use tf_sys::types::*;
use tf_sys::{Api, Driver};
use tf_testdriver::{
    library_path, module_image, module_image_with, test_lock, Control, FRESH_DEVICE_BYTE,
};

struct Fixture {
    control: Control,
    driver: Driver,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    /// A fresh driver with device 0's primary context current on this thread.
    fn new() -> Fixture {
        let serial = test_lock();
        let control = Control::open().expect("open control");
        control.reset();
        let driver = Driver::open_path(&library_path().unwrap()).expect("open the test driver");
        let f = Fixture {
            control,
            driver,
            _serial: serial,
        };
        let mut ctx: CUcontext = null_mut();
        f.ok(unsafe { (f.api().cuDevicePrimaryCtxRetain)(&mut ctx, 0) });
        f.ok(unsafe { (f.api().cuCtxSetCurrent)(ctx) });
        f
    }

    fn api(&self) -> &Api {
        self.driver.api()
    }

    #[track_caller]
    fn ok(&self, r: CUresult) {
        assert_eq!(
            r,
            0,
            "expected success, got {} ({r})",
            self.driver.error_name(r)
        );
    }

    fn alloc(&self, bytes: usize) -> CUdeviceptr {
        let mut p = 0;
        self.ok(unsafe { (self.api().cuMemAlloc_v2)(&mut p, bytes) });
        p
    }

    fn stream(&self, flags: c_uint) -> CUstream {
        let mut s = null_mut();
        self.ok(unsafe { (self.api().cuStreamCreate)(&mut s, flags) });
        s
    }

    fn module(&self, kernels: &[&str]) -> CUmodule {
        let image = module_image(kernels);
        let mut m = null_mut();
        self.ok(unsafe { (self.api().cuModuleLoadData)(&mut m, image.as_ptr().cast()) });
        m
    }

    fn function(&self, m: CUmodule, name: &CStr) -> CUfunction {
        let mut f = null_mut();
        self.ok(unsafe { (self.api().cuModuleGetFunction)(&mut f, m, name.as_ptr()) });
        f
    }

    fn read_u32(&self, p: CUdeviceptr, n: usize) -> Vec<u32> {
        let mut out = vec![0u32; n];
        self.ok(unsafe { (self.api().cuMemcpyDtoH_v2)(out.as_mut_ptr().cast(), p, n * 4) });
        out
    }

    fn launch(&self, f: CUfunction, stream: CUstream, args: &mut [*mut c_void]) -> CUresult {
        unsafe {
            (self.api().cuLaunchKernel)(
                f,
                1,
                1,
                1,
                128,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                null_mut(),
            )
        }
    }

    fn fill(
        &self,
        f: CUfunction,
        stream: CUstream,
        ptr: &mut CUdeviceptr,
        value: &mut u32,
        n: &mut u64,
    ) -> CUresult {
        let mut args = [
            ptr as *mut u64 as *mut c_void,
            value as *mut u32 as *mut c_void,
            n as *mut u64 as *mut c_void,
        ];
        self.launch(f, stream, &mut args)
    }
}

#[test]
fn calls_need_init_and_a_current_context() {
    let f = Fixture::new();
    let mut p = 0;
    // A context is current: fine.
    f.ok(unsafe { (f.api().cuMemAlloc_v2)(&mut p, 64) });
    // Another thread has no current context.
    let api = *f.api();
    let r = std::thread::spawn(move || {
        let mut q = 0;
        unsafe { (api.cuMemAlloc_v2)(&mut q, 64) }
    })
    .join()
    .unwrap();
    assert_eq!(r, code::INVALID_CONTEXT);
    // After a reset nothing is initialised.
    f.control.reset();
    assert_eq!(
        unsafe { (f.api().cuDeviceGetCount)(&mut 0) },
        code::NOT_INITIALIZED
    );
    let mut version = 0;
    f.ok(unsafe { (f.api().cuDriverGetVersion)(&mut version) });
}

#[test]
fn blocks_past_the_fill_limit_are_zeroed_not_filled() {
    let f = Fixture::new();
    let big = f.alloc(tf_testdriver::FILL_LIMIT + 256);
    let small = f.alloc(256);
    let mut bytes = [1u8; 8];
    let last = big + tf_testdriver::FILL_LIMIT as u64 + 248;
    for at in [big, last] {
        f.ok(unsafe { (f.api().cuMemcpyDtoH_v2)(bytes.as_mut_ptr().cast(), at, 8) });
        assert_eq!(bytes, [0; 8]);
    }
    f.ok(unsafe { (f.api().cuMemcpyDtoH_v2)(bytes.as_mut_ptr().cast(), small, 8) });
    assert_eq!(bytes, [FRESH_DEVICE_BYTE; 8]);
}

#[test]
fn memory_round_trip_capacity_and_fresh_bytes() {
    let f = Fixture::new();
    f.control.set_device_capacity(1 << 20);
    let p = f.alloc(4096);
    assert_eq!(p % 256, 0, "device allocations are 256-byte aligned");
    let mut fresh = [0u8; 8];
    f.ok(unsafe { (f.api().cuMemcpyDtoH_v2)(fresh.as_mut_ptr().cast(), p, 8) });
    assert_eq!(fresh, [FRESH_DEVICE_BYTE; 8]);
    let data: Vec<u32> = (0..1024).collect();
    f.ok(unsafe { (f.api().cuMemcpyHtoD_v2)(p, data.as_ptr().cast(), 4096) });
    assert_eq!(f.read_u32(p, 1024), data);
    let (mut free, mut total) = (0usize, 0usize);
    f.ok(unsafe { (f.api().cuMemGetInfo_v2)(&mut free, &mut total) });
    assert_eq!((free, total), ((1 << 20) - 4096, 1 << 20));
    let mut q = 0;
    assert_eq!(
        unsafe { (f.api().cuMemAlloc_v2)(&mut q, 1 << 20) },
        code::OUT_OF_MEMORY
    );
    assert_eq!(
        unsafe { (f.api().cuMemAlloc_v2)(&mut q, 0) },
        code::INVALID_VALUE
    );
    // Copies outside live allocations are refused.
    assert_eq!(
        unsafe { (f.api().cuMemcpyHtoD_v2)(p + 4000, data.as_ptr().cast(), 4096) },
        code::INVALID_VALUE
    );
    f.ok(unsafe { (f.api().cuMemsetD32_v2)(p, 7, 1024) });
    assert!(f.read_u32(p, 1024).iter().all(|v| *v == 7));
    f.ok(unsafe { (f.api().cuMemFree_v2)(p) });
    assert_eq!(
        unsafe { (f.api().cuMemFree_v2)(p) },
        code::INVALID_VALUE,
        "double free"
    );
    assert_eq!(f.control.counter("device_bytes"), Some(0));
}

#[test]
fn pinned_and_registered_host_memory() {
    let f = Fixture::new();
    let mut h: *mut c_void = null_mut();
    f.ok(unsafe { (f.api().cuMemHostAlloc)(&mut h, 4096, flags::HOST_ALLOC_PORTABLE) });
    let mut dptr = 0;
    f.ok(unsafe { (f.api().cuMemHostGetDevicePointer_v2)(&mut dptr, h, 0) });
    assert_eq!(dptr, h as u64);
    let mut buf = vec![0u8; 8192];
    f.ok(unsafe { (f.api().cuMemHostRegister_v2)(buf.as_mut_ptr().cast(), 8192, 0) });
    assert_eq!(
        unsafe { (f.api().cuMemHostRegister_v2)(buf.as_mut_ptr().add(16).cast(), 16, 0) },
        712
    );
    f.ok(unsafe { (f.api().cuMemHostUnregister)(buf.as_mut_ptr().cast()) });
    assert_eq!(
        unsafe { (f.api().cuMemHostUnregister)(buf.as_mut_ptr().cast()) },
        713
    );
    f.ok(unsafe { (f.api().cuMemFreeHost)(h) });
    assert_eq!(f.control.counter("host_allocations"), Some(0));
}

#[test]
fn kernels_run_on_stream_work_and_queries_answer_not_ready_first() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32", "add_f32"]);
    let fill = f.function(m, c"fill_u32");
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let mut p = f.alloc(64 * 4);
    let (mut value, mut n) = (42u32, 64u64);
    f.ok(f.fill(fill, s, &mut p, &mut value, &mut n));
    value = 0; // arguments are copied at launch
    assert_eq!(f.control.counter("pending_work"), Some(1));
    assert_eq!(unsafe { (f.api().cuStreamQuery)(s) }, code::NOT_READY);
    assert_eq!(
        f.control.counter("pending_work"),
        Some(1),
        "a not-ready query runs nothing"
    );
    f.ok(unsafe { (f.api().cuStreamQuery)(s) });
    assert_eq!(f.control.counter("pending_work"), Some(0));
    assert_eq!(f.read_u32(p, 64), vec![42; 64]);

    // add_f32
    let add = f.function(m, c"add_f32");
    let (mut a, mut b, mut out) = (f.alloc(16), f.alloc(16), f.alloc(16));
    let xs = [1.0f32, 2.0, 3.0, 4.0];
    let ys = [10.0f32, 20.0, 30.0, 40.0];
    f.ok(unsafe { (f.api().cuMemcpyHtoD_v2)(a, xs.as_ptr().cast(), 16) });
    f.ok(unsafe { (f.api().cuMemcpyHtoD_v2)(b, ys.as_ptr().cast(), 16) });
    let mut n4 = 4u64;
    let mut args = [
        &mut a as *mut u64 as *mut c_void,
        &mut b as *mut u64 as *mut c_void,
        &mut out as *mut u64 as *mut c_void,
        &mut n4 as *mut u64 as *mut c_void,
    ];
    f.ok(f.launch(add, s, &mut args));
    f.ok(unsafe { (f.api().cuStreamSynchronize)(s) });
    let mut got = [0f32; 4];
    f.ok(unsafe { (f.api().cuMemcpyDtoH_v2)(got.as_mut_ptr().cast(), out, 16) });
    assert_eq!(got, [11.0, 22.0, 33.0, 44.0]);

    f.control.set_query_delay(0);
    f.ok(f.fill(fill, s, &mut p, &mut value, &mut n));
    f.ok(unsafe { (f.api().cuStreamQuery)(s) });
    assert_eq!(f.read_u32(p, 64), vec![0; 64]);
}

#[test]
fn write_oob_is_a_sticky_illegal_address() {
    let f = Fixture::new();
    let m = f.module(&["write_oob"]);
    let k = f.function(m, c"write_oob");
    let s = f.stream(0);
    let mut p = f.alloc(64);
    let mut args = [&mut p as *mut u64 as *mut c_void];
    f.ok(f.launch(k, s, &mut args));
    assert_eq!(
        unsafe { (f.api().cuStreamSynchronize)(s) },
        code::ILLEGAL_ADDRESS
    );
    assert_eq!(f.control.sticky_code(), Some(700));
    // Every later call answers the sticky code, like the real driver.
    let mut q = 0;
    assert_eq!(unsafe { (f.api().cuMemAlloc_v2)(&mut q, 64) }, 700);
    assert_eq!(unsafe { (f.api().cuCtxSynchronize)() }, 700);
    assert_eq!(unsafe { (f.api().cuMemFree_v2)(p) }, 700);
    // ... except naming the error.
    assert_eq!(f.driver.error_name(700), "CUDA_ERROR_ILLEGAL_ADDRESS");
    assert!(tf_sys::check(&f.driver, "cuStreamSynchronize", 700)
        .unwrap_err()
        .is_context_lost());
    f.control.reset();
    assert_eq!(f.control.sticky_code(), None);
}

#[test]
fn injected_launch_fault_is_reported_when_the_work_runs() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32"]);
    let fill = f.function(m, c"fill_u32");
    let s = f.stream(0);
    let mut p = f.alloc(16);
    let (mut v, mut n) = (1u32, 4u64);
    f.control.fault_next_launch(s, 719);
    f.ok(f.fill(fill, s, &mut p, &mut v, &mut n));
    assert_eq!(unsafe { (f.api().cuStreamQuery)(s) }, code::NOT_READY);
    assert_eq!(unsafe { (f.api().cuStreamQuery)(s) }, 719);
    assert_eq!(unsafe { (f.api().cuStreamQuery)(s) }, 719, "sticky");
}

#[test]
fn trap_is_a_sticky_assert() {
    let f = Fixture::new();
    let m = f.module(&["trap"]);
    let trap = f.function(m, c"trap");
    f.ok(f.launch(trap, null_mut(), &mut []));
    assert_eq!(unsafe { (f.api().cuCtxSynchronize)() }, 710);
    assert_eq!(f.control.sticky_code(), Some(710));
}

#[test]
fn fail_the_nth_call_of_an_entry() {
    let f = Fixture::new();
    assert!(f
        .control
        .fail_call("cuMemAlloc_v2", 2, code::OUT_OF_MEMORY, 1));
    assert!(!f.control.fail_call("cuNoSuchEntry", 1, 1, 1));
    let mut p = 0;
    f.ok(unsafe { (f.api().cuMemAlloc_v2)(&mut p, 64) });
    assert_eq!(
        unsafe { (f.api().cuMemAlloc_v2)(&mut p, 64) },
        code::OUT_OF_MEMORY
    );
    f.ok(unsafe { (f.api().cuMemAlloc_v2)(&mut p, 64) });
    assert_eq!(f.control.call_count("cuMemAlloc_v2"), 3);
    // A sticky injected code trips the sticky state.
    assert!(f.control.fail_call("cuStreamSynchronize", 1, 700, 1));
    assert_eq!(unsafe { (f.api().cuStreamSynchronize)(null_mut()) }, 700);
    assert_eq!(unsafe { (f.api().cuMemAlloc_v2)(&mut p, 64) }, 700);
}

#[test]
fn async_copies_read_their_source_when_they_run() {
    let f = Fixture::new();
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let p = f.alloc(16);
    let mut src = [1u32, 2, 3, 4];
    f.ok(unsafe { (f.api().cuMemcpyHtoDAsync_v2)(p, src.as_ptr().cast(), 16, s) });
    // The hazard tf-copysource exists for: the source changes before the copy runs.
    src.copy_from_slice(&[9, 9, 9, 9]);
    f.ok(unsafe { (f.api().cuStreamSynchronize)(s) });
    assert_eq!(f.read_u32(p, 4), src.to_vec());
}

#[test]
fn events_order_streams_and_time_deterministically() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32"]);
    let fill = f.function(m, c"fill_u32");
    let (a, b) = (
        f.stream(flags::STREAM_NON_BLOCKING),
        f.stream(flags::STREAM_NON_BLOCKING),
    );
    let (mut start, mut end, mut never) = (null_mut(), null_mut(), null_mut());
    f.ok(unsafe { (f.api().cuEventCreate)(&mut start, 0) });
    f.ok(unsafe { (f.api().cuEventCreate)(&mut end, 0) });
    f.ok(unsafe { (f.api().cuEventCreate)(&mut never, flags::EVENT_DISABLE_TIMING) });
    f.ok(unsafe { (f.api().cuEventQuery)(never) }); // never recorded: complete
    let mut p = f.alloc(64);
    let (mut v, mut n) = (5u32, 16u64);
    f.ok(unsafe { (f.api().cuEventRecord)(start, a) });
    f.ok(f.fill(fill, a, &mut p, &mut v, &mut n));
    f.ok(unsafe { (f.api().cuEventRecord)(end, a) });
    let mut out = [0u32; 16];
    f.ok(unsafe { (f.api().cuStreamWaitEvent)(b, end, 0) });
    f.ok(unsafe { (f.api().cuMemcpyDtoHAsync_v2)(out.as_mut_ptr().cast(), p, 64, b) });
    let mut ms = 0f32;
    assert_eq!(
        unsafe { (f.api().cuEventElapsedTime)(&mut ms, start, end) },
        code::NOT_READY
    );
    f.ok(unsafe { (f.api().cuStreamSynchronize)(b) }); // runs a's work first, through the wait
    assert_eq!(out, [5; 16]);
    f.ok(unsafe { (f.api().cuEventQuery)(end) });
    f.ok(unsafe { (f.api().cuEventElapsedTime)(&mut ms, start, end) });
    println!("elapsed {ms} ms (virtual)");
    assert!(
        (ms - 0.011).abs() < 1e-6,
        "one kernel (10 us) and one marker (1 us): {ms}"
    );
    assert_eq!(
        unsafe { (f.api().cuEventElapsedTime)(&mut ms, never, end) },
        code::INVALID_HANDLE
    );
    f.ok(unsafe { (f.api().cuEventDestroy_v2)(never) });
    assert_eq!(f.control.counter("events"), Some(2));
}

#[test]
fn capture_records_a_graph_that_replays() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32", "scale_f32"]);
    let fill = f.function(m, c"fill_u32");
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let mut p = f.alloc(64);
    let (mut v, mut n) = (3u32, 16u64);
    f.ok(unsafe { (f.api().cuStreamBeginCapture_v2)(s, CaptureMode::ThreadLocal as c_int) });
    let mut status = -1;
    f.ok(unsafe { (f.api().cuStreamIsCapturing)(s, &mut status) });
    assert_eq!(status, capture_status::ACTIVE);
    f.ok(f.fill(fill, s, &mut p, &mut v, &mut n));
    assert_eq!(
        f.control.counter("pending_work"),
        Some(0),
        "captured work does not run"
    );
    let mut g = null_mut();
    f.ok(unsafe { (f.api().cuStreamEndCapture)(s, &mut g) });
    let mut count = 0usize;
    f.ok(unsafe { (f.api().cuGraphGetNodes)(g, null_mut(), &mut count) });
    assert_eq!(count, 1);
    let mut nodes = [null_mut(); 1];
    f.ok(unsafe { (f.api().cuGraphGetNodes)(g, nodes.as_mut_ptr(), &mut count) });
    let mut exec = null_mut();
    f.ok(unsafe { (f.api().cuGraphInstantiateWithFlags)(&mut exec, g, 0) });
    f.ok(unsafe { (f.api().cuGraphUpload)(exec, s) });
    f.ok(unsafe { (f.api().cuGraphLaunch)(exec, s) });
    f.ok(unsafe { (f.api().cuStreamSynchronize)(s) });
    assert_eq!(f.read_u32(p, 16), vec![3; 16]);

    // Change the node's value in the executable graph and replay.
    let mut params: KernelNodeParams = unsafe { std::mem::zeroed() };
    f.ok(unsafe { (f.api().cuGraphKernelNodeGetParams_v2)(nodes[0], &mut params) });
    assert_eq!(params.func, fill);
    let mut v2 = 8u32;
    let mut args = [
        &mut p as *mut u64 as *mut c_void,
        &mut v2 as *mut u32 as *mut c_void,
        &mut n as *mut u64 as *mut c_void,
    ];
    params.params = args.as_mut_ptr();
    f.ok(unsafe { (f.api().cuGraphExecKernelNodeSetParams_v2)(exec, nodes[0], &params) });
    f.ok(unsafe { (f.api().cuGraphLaunch)(exec, s) });
    f.ok(unsafe { (f.api().cuStreamSynchronize)(s) });
    assert_eq!(f.read_u32(p, 16), vec![8; 16]);

    // Whole-graph update: same topology is accepted; another kernel is refused with 910.
    let mut info: ExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    f.ok(unsafe { (f.api().cuGraphExecUpdate_v2)(exec, g, &mut info) });
    assert_eq!(info.result, exec_update_result::SUCCESS);
    let scale = f.function(m, c"scale_f32");
    params.func = scale;
    f.ok(unsafe { (f.api().cuGraphKernelNodeSetParams_v2)(nodes[0], &params) });
    assert_eq!(
        unsafe { (f.api().cuGraphExecUpdate_v2)(exec, g, &mut info) },
        910
    );
    assert_eq!(info.result, exec_update_result::FUNCTION_CHANGED);

    f.ok(unsafe { (f.api().cuGraphExecDestroy)(exec) });
    f.ok(unsafe { (f.api().cuGraphDestroy)(g) });
    assert_eq!(f.control.counter("graphs"), Some(0));
    assert_eq!(f.control.counter("graph_execs"), Some(0));
}

#[test]
fn synchronous_calls_invalidate_a_global_capture() {
    let f = Fixture::new();
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let p = f.alloc(16);
    let src = [0u8; 16];
    f.ok(unsafe { (f.api().cuStreamBeginCapture_v2)(s, CaptureMode::Global as c_int) });
    assert_eq!(
        unsafe { (f.api().cuMemcpyHtoD_v2)(p, src.as_ptr().cast(), 16) },
        code::STREAM_CAPTURE_UNSUPPORTED
    );
    let mut status = -1;
    f.ok(unsafe { (f.api().cuStreamIsCapturing)(s, &mut status) });
    assert_eq!(status, capture_status::INVALIDATED);
    let mut g = null_mut();
    assert_eq!(
        unsafe { (f.api().cuStreamEndCapture)(s, &mut g) },
        code::STREAM_CAPTURE_INVALIDATED
    );
    assert!(g.is_null());
    // The default stream cannot be captured; ending a capture that never began is illegal.
    assert_eq!(
        unsafe { (f.api().cuStreamBeginCapture_v2)(null_mut(), 0) },
        code::STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(unsafe { (f.api().cuStreamEndCapture)(s, &mut g) }, 401);
    // Relaxed mode allows the synchronous copy.
    f.ok(unsafe { (f.api().cuStreamBeginCapture_v2)(s, CaptureMode::Relaxed as c_int) });
    f.ok(unsafe { (f.api().cuMemcpyHtoD_v2)(p, src.as_ptr().cast(), 16) });
    f.ok(unsafe { (f.api().cuStreamEndCapture)(s, &mut g) });
    assert!(!g.is_null());
}

#[test]
fn instantiate_can_be_refused_with_800() {
    let f = Fixture::new();
    let mut g = null_mut();
    f.ok(unsafe { (f.api().cuGraphCreate)(&mut g, 0) });
    assert!(f
        .control
        .fail_call("cuGraphInstantiateWithFlags", 1, code::NOT_PERMITTED, 1));
    let mut exec = null_mut();
    assert_eq!(
        unsafe { (f.api().cuGraphInstantiateWithFlags)(&mut exec, g, 0) },
        code::NOT_PERMITTED
    );
    f.ok(unsafe { (f.api().cuGraphInstantiateWithFlags)(&mut exec, g, 0) });
}

#[test]
fn graphs_built_by_hand() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32"]);
    let fill = f.function(m, c"fill_u32");
    let mut g = null_mut();
    f.ok(unsafe { (f.api().cuGraphCreate)(&mut g, 0) });
    let (mut p, mut v, mut n) = (f.alloc(32), 6u32, 8u64);
    let mut args = [
        &mut p as *mut u64 as *mut c_void,
        &mut v as *mut u32 as *mut c_void,
        &mut n as *mut u64 as *mut c_void,
    ];
    let params = KernelNodeParams {
        func: fill,
        grid_x: 1,
        grid_y: 1,
        grid_z: 1,
        block_x: 32,
        block_y: 1,
        block_z: 1,
        shared_bytes: 0,
        params: args.as_mut_ptr(),
        extra: null_mut(),
        kern: null_mut(),
        ctx: null_mut(),
    };
    let (mut a, mut b) = (null_mut(), null_mut());
    f.ok(unsafe { (f.api().cuGraphAddKernelNode_v2)(&mut a, g, null(), 0, &params) });
    f.ok(unsafe { (f.api().cuGraphAddKernelNode_v2)(&mut b, g, &a, 1, &params) });
    f.ok(unsafe { (f.api().cuGraphAddDependencies)(g, &a, &b, 1) });
    let mut exec = null_mut();
    f.ok(unsafe { (f.api().cuGraphInstantiateWithFlags)(&mut exec, g, 0) });
    f.ok(unsafe { (f.api().cuGraphLaunch)(exec, null_mut()) });
    f.ok(unsafe { (f.api().cuCtxSynchronize)() });
    assert_eq!(f.read_u32(p, 8), vec![6; 8]);
}

#[test]
fn modules_functions_and_globals() {
    let f = Fixture::new();
    let mut m = null_mut();
    let bad = b"\x7fELF not a fake image\0";
    assert_eq!(
        unsafe { (f.api().cuModuleLoadData)(&mut m, bad.as_ptr().cast()) },
        code::INVALID_IMAGE
    );

    let image = module_image_with(
        &["fill_u32"],
        &[("step", 16)],
        Some("ptxas fatal: unknown target"),
    );
    let mut log = [0 as c_char; 256];
    let mut options = [
        flags::JIT_ERROR_LOG_BUFFER,
        flags::JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let r = unsafe {
        (f.api().cuModuleLoadDataEx)(
            &mut m,
            image.as_ptr().cast(),
            2,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    assert_eq!(r, code::INVALID_PTX);
    let text = unsafe { CStr::from_ptr(log.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    assert!(text.contains("ptxas fatal: unknown target"), "{text}");

    let image = module_image_with(&["fill_u32", "add_f32"], &[("step", 16)], None);
    f.ok(unsafe { (f.api().cuModuleLoadData)(&mut m, image.as_ptr().cast()) });
    let mut func = null_mut();
    assert_eq!(
        unsafe { (f.api().cuModuleGetFunction)(&mut func, m, c"nope".as_ptr()) },
        code::NOT_FOUND
    );
    let add = f.function(m, c"add_f32");
    let mut name: *const c_char = null();
    let get_name = f.api().cuFuncGetName.expect("optional entry present");
    f.ok(unsafe { get_name(&mut name, add) });
    assert_eq!(unsafe { CStr::from_ptr(name) }, c"add_f32");
    let get_param = f.api().cuFuncGetParamInfo.expect("optional entry present");
    let (mut off, mut size) = (0usize, 0usize);
    f.ok(unsafe { get_param(add, 3, &mut off, &mut size) });
    assert_eq!((off, size), (24, 8));
    assert_eq!(
        unsafe { get_param(add, 4, &mut off, &mut size) },
        code::INVALID_VALUE
    );
    let (mut gptr, mut gbytes) = (0, 0usize);
    f.ok(unsafe { (f.api().cuModuleGetGlobal_v2)(&mut gptr, &mut gbytes, m, c"step".as_ptr()) });
    assert_eq!(gbytes, 16);
    f.ok(unsafe { (f.api().cuMemsetD8_v2)(gptr, 1, 16) });
    // Launch validation happens before anything is queued.
    let mut v = 0u64;
    let mut args = [&mut v as *mut u64 as *mut c_void; 4];
    let r = unsafe {
        (f.api().cuLaunchKernel)(
            add,
            1,
            1,
            1,
            2048,
            1,
            1,
            0,
            null_mut(),
            args.as_mut_ptr(),
            null_mut(),
        )
    };
    assert_eq!(r, code::INVALID_VALUE, "2048 threads per block");
    let r = unsafe {
        (f.api().cuLaunchKernel)(
            add,
            1,
            1,
            1,
            32,
            1,
            1,
            64 * 1024,
            null_mut(),
            args.as_mut_ptr(),
            null_mut(),
        )
    };
    assert_eq!(r, code::INVALID_VALUE, "64 KiB shared without opting in");
    f.ok(unsafe {
        (f.api().cuFuncSetAttribute)(
            add,
            function_attribute::MAX_DYNAMIC_SHARED_SIZE_BYTES,
            64 * 1024,
        )
    });
    let mut attr = 0;
    f.ok(unsafe {
        (f.api().cuFuncGetAttribute)(
            &mut attr,
            function_attribute::MAX_DYNAMIC_SHARED_SIZE_BYTES,
            add,
        )
    });
    assert_eq!(attr, 64 * 1024);
    f.ok(unsafe { (f.api().cuModuleUnload)(m) });
    assert_eq!(f.control.counter("modules"), Some(0));
    assert_eq!(f.control.counter("functions"), Some(0));
}

#[test]
fn launch_kernel_ex_and_copy_2d() {
    let f = Fixture::new();
    let m = f.module(&["fill_u32"]);
    let fill = f.function(m, c"fill_u32");
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let (mut p, mut v, mut n) = (f.alloc(4 * 4 * 4), 2u32, 16u64);
    let mut args = [
        &mut p as *mut u64 as *mut c_void,
        &mut v as *mut u32 as *mut c_void,
        &mut n as *mut u64 as *mut c_void,
    ];
    let config = LaunchConfig {
        grid_x: 1,
        grid_y: 1,
        grid_z: 1,
        block_x: 16,
        block_y: 1,
        block_z: 1,
        shared_bytes: 0,
        stream: s,
        attrs: null_mut(),
        num_attrs: 0,
    };
    f.ok(unsafe { (f.api().cuLaunchKernelEx)(&config, fill, args.as_mut_ptr(), null_mut()) });
    // Copy the 2x2 top-left block of the 4x4 u32 matrix out, pitched.
    let mut out = [0u32; 4];
    let mut d = Memcpy2D::zeroed();
    d.src_memory_type = flags::MEMORYTYPE_DEVICE;
    d.src_device = p;
    d.src_pitch = 16;
    d.dst_memory_type = flags::MEMORYTYPE_HOST;
    d.dst_host = out.as_mut_ptr().cast();
    d.dst_pitch = 8;
    d.width_in_bytes = 8;
    d.height = 2;
    f.ok(unsafe { (f.api().cuMemcpy2DAsync_v2)(&d, s) });
    f.ok(unsafe { (f.api().cuStreamSynchronize)(s) });
    assert_eq!(out, [2; 4]);
}

#[test]
fn destroying_a_stream_runs_its_work_and_counters_track_objects() {
    let f = Fixture::new();
    let s = f.stream(0);
    assert_eq!(f.control.counter("streams"), Some(1));
    assert_eq!(f.control.counter("nonblocking_streams"), Some(0));
    let side = f.stream(1);
    assert_eq!(f.control.counter("nonblocking_streams"), Some(1));
    f.ok(unsafe { (f.api().cuStreamDestroy_v2)(side) });
    assert_eq!(f.control.counter("nonblocking_streams"), Some(0));
    let p = f.alloc(4);
    let src = 77u32;
    f.ok(unsafe { (f.api().cuMemcpyHtoDAsync_v2)(p, (&src as *const u32).cast(), 4, s) });
    f.ok(unsafe { (f.api().cuStreamDestroy_v2)(s) });
    assert_eq!(f.control.counter("streams"), Some(0));
    assert_eq!(f.read_u32(p, 1), vec![77]);
    assert_eq!(unsafe { (f.api().cuStreamQuery)(s) }, code::INVALID_HANDLE);
    assert_eq!(f.control.counter("no_such_counter"), None);
    for name in tf_testdriver::COUNTER_NAMES {
        assert!(f.control.counter(name).is_some(), "{name}");
    }
}

#[test]
fn device_queries() {
    let f = Fixture::new();
    let mut name = [0 as c_char; 64];
    f.ok(unsafe { (f.api().cuDeviceGetName)(name.as_mut_ptr(), 64, 0) });
    assert!(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .contains("Test Driver"));
    let mut major = 0;
    f.ok(unsafe {
        (f.api().cuDeviceGetAttribute)(&mut major, device_attribute::COMPUTE_CAPABILITY_MAJOR, 0)
    });
    assert_eq!(major, 9);
    let mut dev = -1;
    assert_eq!(
        unsafe { (f.api().cuDeviceGet)(&mut dev, 1) },
        code::INVALID_DEVICE
    );
    f.ok(unsafe { (f.api().cuCtxGetDevice)(&mut dev) });
    assert_eq!(dev, 0);
    let (mut least, mut greatest) = (1, 1);
    f.ok(unsafe { (f.api().cuCtxGetStreamPriorityRange)(&mut least, &mut greatest) });
    assert!(greatest < least);
    f.ok(unsafe { (f.api().cuDevicePrimaryCtxRelease_v2)(0) });
    let mut p = 0;
    assert_eq!(
        unsafe { (f.api().cuMemAlloc_v2)(&mut p, 4) },
        code::INVALID_CONTEXT,
        "released context"
    );
}

#[test]
fn a_free_waits_for_all_queued_work_but_a_synchronous_copy_does_not_wait_for_non_blocking_streams()
{
    let f = Fixture::new();
    let s = f.stream(flags::STREAM_NON_BLOCKING);
    let (p, q) = (f.alloc(4), f.alloc(4));
    let src = 5u32;
    f.ok(unsafe { (f.api().cuMemcpyHtoDAsync_v2)(p, (&src as *const u32).cast(), 4, s) });
    let mut out = 0u32;
    f.ok(unsafe { (f.api().cuMemcpyDtoH_v2)((&mut out as *mut u32).cast(), p, 4) });
    assert_eq!(
        out,
        u32::from_ne_bytes([FRESH_DEVICE_BYTE; 4]),
        "the non-blocking stream's copy has not run"
    );
    assert_eq!(f.control.counter("pending_work"), Some(1));
    f.ok(unsafe { (f.api().cuMemFree_v2)(q) });
    assert_eq!(f.control.counter("pending_work"), Some(0));
    assert_eq!(f.read_u32(p, 1), vec![5]);
}
