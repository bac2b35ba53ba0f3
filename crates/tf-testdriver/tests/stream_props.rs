//! Property: whatever the interleaving of launches, queries, synchronizations and frees, each
//! stream's work lands in program order, nothing runs twice or is lost, and the memory
//! accounting matches a simple model.
//!
//! SAFETY (every `unsafe` call in this file): arguments are valid out-pointers, live host buffers
//! and handles obtained from the same driver, as the C API requires.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Each unsafe call here is covered by the SAFETY note at the top of this file.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::c_void;
use std::ptr::null_mut;

use proptest::prelude::*;
use tf_sys::types::*;
use tf_sys::Driver;
use tf_testdriver::{library_path, module_image, test_lock, Control};

const STREAMS: usize = 3;
const CAPACITY: u64 = 64 * 1024;

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
    Fill { buffer: usize, value: u32 },
    Query(usize),
    Sync(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1usize..4096).prop_map(|words| Op::Alloc(words * 4)),
        1 => any::<usize>().prop_map(Op::Free),
        4 => (any::<usize>(), any::<u32>()).prop_map(|(buffer, value)| Op::Fill { buffer, value }),
        2 => (0..STREAMS).prop_map(Op::Query),
        1 => (0..STREAMS).prop_map(Op::Sync),
    ]
}

struct Buffer {
    ptr: CUdeviceptr,
    bytes: usize,
    /// Each buffer belongs to one stream, so its final value is defined by program order.
    stream: usize,
    /// The value the last launch writes (None: never filled).
    expected: Option<u32>,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn stream_work_lands_in_program_order(ops in proptest::collection::vec(op(), 1..60)) {
        let _serial = test_lock();
        let control = Control::open().unwrap();
        control.reset();
        control.set_device_capacity(CAPACITY);
        let driver = Driver::open_path(&library_path().unwrap()).unwrap();
        let api = *driver.api();
        let mut ctx = null_mut();
        prop_assert_eq!(unsafe { (api.cuDevicePrimaryCtxRetain)(&mut ctx, 0) }, 0);
        prop_assert_eq!(unsafe { (api.cuCtxSetCurrent)(ctx) }, 0);
        let image = module_image(&["fill_u32"]);
        let mut module = null_mut();
        prop_assert_eq!(unsafe { (api.cuModuleLoadData)(&mut module, image.as_ptr().cast()) }, 0);
        let mut fill = null_mut();
        prop_assert_eq!(unsafe { (api.cuModuleGetFunction)(&mut fill, module, c"fill_u32".as_ptr()) }, 0);
        let mut streams = [null_mut(); STREAMS];
        for s in streams.iter_mut() {
            prop_assert_eq!(unsafe { (api.cuStreamCreate)(s, flags::STREAM_NON_BLOCKING) }, 0);
        }

        let mut buffers: Vec<Buffer> = Vec::new();
        let mut next_stream = 0usize;
        let mut held = 0u64;
        let verify = |b: &Buffer| -> Vec<u32> {
            let mut out = vec![0u32; b.bytes / 4];
            assert_eq!(unsafe { (api.cuMemcpyDtoH_v2)(out.as_mut_ptr().cast(), b.ptr, b.bytes) }, 0);
            out
        };
        for op in ops {
            match op {
                Op::Alloc(bytes) => {
                    let mut ptr = 0;
                    let r = unsafe { (api.cuMemAlloc_v2)(&mut ptr, bytes) };
                    if held + bytes as u64 <= CAPACITY {
                        prop_assert_eq!(r, 0);
                        held += bytes as u64;
                        buffers.push(Buffer { ptr, bytes, stream: next_stream % STREAMS, expected: None });
                        next_stream += 1;
                    } else {
                        prop_assert_eq!(r, code::OUT_OF_MEMORY);
                    }
                }
                Op::Free(i) => {
                    if buffers.is_empty() { continue; }
                    let b = buffers.remove(i % buffers.len());
                    // A synchronous copy does not wait for non-blocking streams (as on the real
                    // driver), so synchronize the owner before reading back.
                    prop_assert_eq!(unsafe { (api.cuStreamSynchronize)(streams[b.stream]) }, 0);
                    if let Some(v) = b.expected {
                        prop_assert!(verify(&b).iter().all(|x| *x == v));
                    }
                    prop_assert_eq!(unsafe { (api.cuMemFree_v2)(b.ptr) }, 0);
                    held -= b.bytes as u64;
                }
                Op::Fill { buffer, value } => {
                    if buffers.is_empty() { continue; }
                    let i = buffer % buffers.len();
                    let b = &mut buffers[i];
                    let (mut ptr, mut v, mut n) = (b.ptr, value, (b.bytes / 4) as u64);
                    let mut args = [&mut ptr as *mut u64 as *mut c_void, &mut v as *mut u32 as *mut c_void, &mut n as *mut u64 as *mut c_void];
                    let r = unsafe { (api.cuLaunchKernel)(fill, 1, 1, 1, 256, 1, 1, 0, streams[b.stream], args.as_mut_ptr(), null_mut()) };
                    prop_assert_eq!(r, 0);
                    b.expected = Some(value);
                }
                Op::Query(s) => {
                    let r = unsafe { (api.cuStreamQuery)(streams[s]) };
                    prop_assert!(r == 0 || r == code::NOT_READY, "query answered {}", r);
                }
                Op::Sync(s) => {
                    prop_assert_eq!(unsafe { (api.cuStreamSynchronize)(streams[s]) }, 0);
                    for b in buffers.iter().filter(|b| b.stream == s) {
                        if let Some(v) = b.expected {
                            prop_assert!(verify(b).iter().all(|x| *x == v), "stream {} buffer at {:#x}", s, b.ptr);
                        }
                    }
                }
            }
            prop_assert_eq!(control.counter("device_bytes"), Some(held as i64));
            prop_assert!(held <= CAPACITY);
        }
        prop_assert_eq!(unsafe { (api.cuCtxSynchronize)() }, 0);
        prop_assert_eq!(control.counter("pending_work"), Some(0));
        for b in &buffers {
            match b.expected {
                Some(v) => prop_assert!(verify(b).iter().all(|x| *x == v)),
                None => prop_assert!(verify(b).iter().all(|x| *x == u32::from_ne_bytes([tf_testdriver::FRESH_DEVICE_BYTE; 4]))),
            }
        }
        for b in buffers.drain(..) {
            prop_assert_eq!(unsafe { (api.cuMemFree_v2)(b.ptr) }, 0);
        }
        prop_assert_eq!(control.counter("device_bytes"), Some(0));
        prop_assert_eq!(control.sticky_code(), None);
    }
}
