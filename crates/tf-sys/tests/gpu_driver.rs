//! tf-sys against NVIDIA's real driver. Needs a GPU; run through `cargo xtask gpu-bundle`.
//!
//! SAFETY (every `unsafe` call in this file): arguments are valid out-pointers and handles from
//! the same driver, as the C API requires.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// Each unsafe call here is covered by the SAFETY note at the top of this file.
#![allow(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

use tf_sys::result::{is_sticky, known_codes, known_name};
use tf_sys::{check, memcap, Driver, Error, ENTRIES};

fn open() -> Driver {
    match Driver::open() {
        Ok(d) => d,
        Err(e) => panic!("the real CUDA driver must open here: {e}"),
    }
}

fn driver_name(driver: &Driver, code: i32) -> Option<String> {
    let mut p: *const c_char = std::ptr::null();
    let r = unsafe { (driver.api().cuGetErrorName)(code, &mut p) };
    (r == 0 && !p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn real_driver_opens_with_every_entry() {
    let driver = open();
    let version = driver.version().expect("cuDriverGetVersion");
    let devices = driver.device_count().expect("cuDeviceGetCount");
    println!(
        "driver {} version {version} devices {devices}",
        driver.path().display()
    );
    assert!(
        version >= 12000,
        "the table needs CUDA 12.0+, driver reports {version}"
    );
    assert!(devices >= 1);
    let mut absent = Vec::new();
    for e in ENTRIES {
        if driver.api().address_of(e.name).is_none() {
            absent.push(e.name);
        }
    }
    println!("optional entries absent: {absent:?}");
    assert!(absent
        .iter()
        .all(|n| tf_sys::api::entry(n)
            .is_some_and(|e| e.requirement == tf_sys::Requirement::Optional)));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn fallback_names_match_the_driver() {
    let driver = open();
    let mut mismatches = Vec::new();
    let mut unknown_to_driver = Vec::new();
    for code in known_codes() {
        match driver_name(&driver, code) {
            Some(name) if Some(name.as_str()) == known_name(code) => {}
            Some(name) => mismatches.push(format!(
                "{code}: driver {name}, table {:?}",
                known_name(code)
            )),
            None => unknown_to_driver.push(code),
        }
    }
    for code in tf_sys::result::STICKY_CODES {
        println!(
            "sticky {code}: driver calls it {:?}",
            driver_name(&driver, *code)
        );
        assert!(is_sticky(*code));
    }
    println!("codes in the table the driver does not name: {unknown_to_driver:?}");
    println!("text of 700: {}", driver.error_text(700));
    assert!(
        mismatches.is_empty(),
        "fallback names differ from the driver's: {mismatches:#?}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn memcap_caps_real_allocations() {
    let driver = open();
    let api = driver.api();
    let mut ctx = null_mut();
    check(&driver, "cuDevicePrimaryCtxRetain", unsafe {
        (api.cuDevicePrimaryCtxRetain)(&mut ctx, 0)
    })
    .unwrap();
    check(&driver, "cuCtxSetCurrent", unsafe {
        (api.cuCtxSetCurrent)(ctx)
    })
    .unwrap();
    let (mut free, mut total) = (0usize, 0usize);
    check(&driver, "cuMemGetInfo_v2", unsafe {
        (api.cuMemGetInfo_v2)(&mut free, &mut total)
    })
    .unwrap();
    println!("device memory: {free} free of {total}");

    let mut capped = *api;
    memcap::install(&mut capped, 64 << 20).unwrap();
    let mut a = 0;
    check(&driver, "cuMemAlloc_v2", unsafe {
        (capped.cuMemAlloc_v2)(&mut a, 32 << 20)
    })
    .expect("32 MiB under a 64 MiB cap");
    let mut b = 0;
    let refused = check(&driver, "cuMemAlloc_v2", unsafe {
        (capped.cuMemAlloc_v2)(&mut b, 48 << 20)
    });
    assert!(
        matches!(refused, Err(Error::OutOfMemory { .. })),
        "48 MiB more must be refused: {refused:?}"
    );
    let mut pinned: *mut c_void = null_mut();
    check(&driver, "cuMemHostAlloc", unsafe {
        (capped.cuMemHostAlloc)(&mut pinned, 16 << 20, 0)
    })
    .expect("16 MiB pinned");
    let c = memcap::counters();
    println!("memcap counters: {c:?}");
    assert_eq!(
        (c.device_bytes, c.host_bytes, c.refusals, c.live_allocations),
        (32 << 20, 16 << 20, 1, 2)
    );
    check(&driver, "cuMemFreeHost", unsafe {
        (capped.cuMemFreeHost)(pinned)
    })
    .unwrap();
    check(&driver, "cuMemFree_v2", unsafe { (capped.cuMemFree_v2)(a) }).unwrap();
    let c = memcap::counters();
    assert_eq!(
        (c.device_bytes, c.host_bytes, c.live_allocations),
        (0, 0, 0)
    );
    check(&driver, "cuDevicePrimaryCtxRelease_v2", unsafe {
        (api.cuDevicePrimaryCtxRelease_v2)(0)
    })
    .unwrap();
}
