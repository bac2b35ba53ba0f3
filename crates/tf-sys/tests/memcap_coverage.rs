//! memcap covers exactly the table's allocating entries, and only patches what it must.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use tf_sys::api::allocating_entries;
use tf_sys::{memcap, Allocation, Driver, ENTRIES};

/// Entry points of the CUDA driver API that allocate device or pinned host memory (or reserve
/// resources backed by it). None of them may join the table without memcap learning to patch it.
const KNOWN_ALLOCATING: &[&str] = &[
    "cuMemAlloc",
    "cuMemAlloc_v2",
    "cuMemAllocPitch",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemAllocHost",
    "cuMemAllocHost_v2",
    "cuMemHostAlloc",
    "cuMemHostAlloc_v2",
    "cuMemHostRegister",
    "cuMemHostRegister_v2",
    "cuMemCreate",
    "cuMemPoolCreate",
    "cuMemMap",
    "cuArrayCreate",
    "cuArrayCreate_v2",
    "cuArray3DCreate",
    "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate",
    "cuGraphAddMemAllocNode",
    "cuMulticastCreate",
];

/// The allocating entries memcap must wrap.
const COVERED: &[&str] = &["cuMemAlloc_v2", "cuMemHostAlloc", "cuMemHostRegister_v2"];

#[test]
fn allocating_entries_are_exactly_the_three() {
    let mut allocating: Vec<&str> = allocating_entries().map(|e| e.name).collect();
    allocating.sort_unstable();
    let mut expected = COVERED.to_vec();
    expected.sort_unstable();
    assert_eq!(allocating, expected);
}

#[test]
fn no_other_entry_is_a_known_allocator() {
    for e in ENTRIES {
        if KNOWN_ALLOCATING.contains(&e.name) {
            assert_eq!(
                e.allocation,
                Allocation::Allocates,
                "{} allocates but is not marked so",
                e.name
            );
            assert!(
                COVERED.contains(&e.name),
                "{} allocates but memcap does not cover it",
                e.name
            );
        }
    }
}

#[test]
fn memcap_patches_every_allocating_entry_and_nothing_unrelated() {
    let _serial = tf_testdriver::test_lock();
    tf_testdriver::Control::open().unwrap().reset();
    let driver = Driver::open_path(&tf_testdriver::library_path().unwrap()).unwrap();
    let before = *driver.api();
    let mut after = before;
    memcap::install(&mut after, 1 << 20).unwrap();
    for e in allocating_entries() {
        assert!(
            memcap::PATCHED_ENTRIES.contains(&e.name),
            "{} is not in PATCHED_ENTRIES",
            e.name
        );
    }
    for e in ENTRIES {
        let (b, a) = (before.address_of(e.name), after.address_of(e.name));
        assert!(b.is_some(), "{} resolved", e.name);
        if memcap::PATCHED_ENTRIES.contains(&e.name) {
            assert_ne!(b, a, "{} must be patched", e.name);
        } else {
            assert_eq!(b, a, "{} must be left alone", e.name);
        }
    }
    // Installing again replaces the cap without wrapping the wrappers.
    let once = after;
    memcap::install(&mut after, 2 << 20).unwrap();
    for name in memcap::PATCHED_ENTRIES {
        assert_eq!(once.address_of(name), after.address_of(name), "{name}");
    }
    assert_eq!(memcap::counters().cap_bytes, Some(2 << 20));
    memcap::restore(&mut after);
    for e in ENTRIES {
        assert_eq!(
            before.address_of(e.name),
            after.address_of(e.name),
            "{} restored",
            e.name
        );
    }
}
