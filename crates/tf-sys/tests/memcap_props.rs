//! memcap accounting under random allocation/free sequences, against the test driver.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::c_void;

use proptest::prelude::*;
use tf_sys::{memcap, Api, CUcontext, CUdeviceptr, Driver};
use tf_testdriver::{library_path, test_lock, Control};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Device,
    Pinned,
    Registered,
}

#[derive(Clone, Debug)]
enum Step {
    Alloc(Kind, usize),
    Free(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (prop_oneof![Just(Kind::Device), Just(Kind::Pinned), Just(Kind::Registered)], 1usize..48 * 1024)
            .prop_map(|(k, n)| Step::Alloc(k, n)),
        2 => any::<usize>().prop_map(Step::Free),
    ]
}

enum Live {
    Device(CUdeviceptr),
    Pinned(*mut c_void),
    Registered(Vec<u8>),
}

struct Held {
    live: Live,
    bytes: u64,
}

fn make_current(api: &Api) {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer; device 0 exists in the test driver.
    assert_eq!(unsafe { (api.cuDevicePrimaryCtxRetain)(&mut ctx, 0) }, 0);
    // SAFETY: `ctx` was just retained.
    assert_eq!(unsafe { (api.cuCtxSetCurrent)(ctx) }, 0);
}

fn alloc(api: &Api, kind: Kind, bytes: usize) -> (i32, Option<Live>) {
    match kind {
        Kind::Device => {
            let mut p: CUdeviceptr = 0;
            // SAFETY: valid out-pointer.
            let r = unsafe { (api.cuMemAlloc_v2)(&mut p, bytes) };
            (r, (r == 0).then_some(Live::Device(p)))
        }
        Kind::Pinned => {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: valid out-pointer.
            let r = unsafe { (api.cuMemHostAlloc)(&mut p, bytes, 0) };
            (r, (r == 0).then_some(Live::Pinned(p)))
        }
        Kind::Registered => {
            let mut buf = vec![0u8; bytes];
            // SAFETY: `buf` is a live allocation of `bytes` bytes, kept until unregistered.
            let r = unsafe { (api.cuMemHostRegister_v2)(buf.as_mut_ptr().cast(), bytes, 0) };
            (r, (r == 0).then_some(Live::Registered(buf)))
        }
    }
}

fn free(api: &Api, live: &mut Live) -> i32 {
    // SAFETY: each handle came from the matching allocation and is released once.
    unsafe {
        match live {
            Live::Device(p) => (api.cuMemFree_v2)(*p),
            Live::Pinned(p) => (api.cuMemFreeHost)(*p),
            Live::Registered(buf) => (api.cuMemHostUnregister)(buf.as_mut_ptr().cast()),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn cap_is_never_exceeded_and_counters_return_to_zero(
        cap in 0u64..256 * 1024,
        steps in proptest::collection::vec(step(), 1..40),
    ) {
        let _serial = test_lock();
        let control = Control::open().unwrap();
        control.reset();
        let driver = Driver::open_path(&library_path().unwrap()).unwrap();
        let mut api = *driver.api();
        memcap::install(&mut api, cap).unwrap();
        make_current(&api);
        let start = memcap::counters();
        prop_assert_eq!(start.live_allocations, 0);
        prop_assert_eq!(start.device_bytes + start.host_bytes, 0);

        let mut held: Vec<Held> = Vec::new();
        let (mut device, mut host) = (0u64, 0u64);
        let mut refusals = start.refusals;
        for s in steps {
            match s {
                Step::Alloc(kind, bytes) => {
                    let fits = device + host + bytes as u64 <= cap;
                    let (r, live) = alloc(&api, kind, bytes);
                    if fits {
                        prop_assert_eq!(r, 0, "{:?} of {} under cap {}", kind, bytes, cap);
                        match kind { Kind::Device => device += bytes as u64, _ => host += bytes as u64 }
                        if let Some(live) = live { held.push(Held { live, bytes: bytes as u64 }); }
                    } else {
                        prop_assert_eq!(r, 2, "{:?} of {} past cap {} must be refused", kind, bytes, cap);
                        refusals += 1;
                    }
                }
                Step::Free(i) => {
                    if held.is_empty() { continue; }
                    let mut h = held.remove(i % held.len());
                    prop_assert_eq!(free(&api, &mut h.live), 0);
                    match h.live { Live::Device(_) => device -= h.bytes, _ => host -= h.bytes }
                }
            }
            let c = memcap::counters();
            prop_assert!(c.device_bytes + c.host_bytes <= cap, "held {} past cap {}", c.device_bytes + c.host_bytes, cap);
            prop_assert_eq!((c.device_bytes, c.host_bytes), (device, host));
            prop_assert_eq!(c.live_allocations, held.len() as u64);
            prop_assert_eq!(c.refusals, refusals);
            prop_assert!(c.device_peak_bytes >= c.device_bytes && c.host_peak_bytes >= c.host_bytes);
            prop_assert_eq!(control.counter("device_bytes"), Some(device as i64), "memcap and the driver agree");
        }
        for mut h in held.drain(..) {
            prop_assert_eq!(free(&api, &mut h.live), 0);
        }
        let end = memcap::counters();
        prop_assert_eq!((end.device_bytes, end.host_bytes, end.live_allocations), (0, 0, 0));
        prop_assert_eq!(control.counter("device_allocations"), Some(0));
        prop_assert_eq!(control.counter("host_allocations"), Some(0));
        prop_assert_eq!(control.counter("registrations"), Some(0));
        memcap::reset_peaks();
    }
}
