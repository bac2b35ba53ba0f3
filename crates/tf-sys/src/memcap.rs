//! A process-wide cap on driver allocations, installed by patching the table.
//!
//! [`install`] replaces the table's allocating entries (`cuMemAlloc_v2`, `cuMemHostAlloc`,
//! `cuMemHostRegister_v2`) and their releases (`cuMemFree_v2`, `cuMemFreeHost`,
//! `cuMemHostUnregister`) with wrappers that count bytes and answer `CUDA_ERROR_OUT_OF_MEMORY` when
//! a request would take the bytes held (device plus pinned host, together) past the cap. The
//! original entries are kept in a process-wide static, so there is one cap per process; installing
//! again replaces the cap.
//!
//! Install before copying the [`Api`] anywhere: memory released through an unpatched copy is not
//! subtracted.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::api::Api;
use crate::error::Error;
use crate::types::{code, CUdeviceptr, CUresult};

/// The entries [`install`] replaces: the allocating ones first, then their releases.
pub const PATCHED_ENTRIES: &[&str] = &[
    "cuMemAlloc_v2",
    "cuMemHostAlloc",
    "cuMemHostRegister_v2",
    "cuMemFree_v2",
    "cuMemFreeHost",
    "cuMemHostUnregister",
];

type MemAllocFn = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type MemFreeFn = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
type HostAllocFn = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
type HostFreeFn = unsafe extern "C" fn(*mut c_void) -> CUresult;
type HostRegisterFn = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;

// The wrappers as typed pointers (compared by address against the table's entries).
const W_MEM_ALLOC: MemAllocFn = wrap_mem_alloc;
const W_MEM_FREE: MemFreeFn = wrap_mem_free;
const W_HOST_ALLOC: HostAllocFn = wrap_host_alloc;
const W_HOST_FREE: HostFreeFn = wrap_host_free;
const W_HOST_REGISTER: HostRegisterFn = wrap_host_register;
const W_HOST_UNREGISTER: HostFreeFn = wrap_host_unregister;

#[derive(Clone, Copy)]
struct Originals {
    mem_alloc: MemAllocFn,
    mem_free: MemFreeFn,
    host_alloc: HostAllocFn,
    host_free: HostFreeFn,
    host_register: HostRegisterFn,
    host_unregister: HostFreeFn,
}

impl Originals {
    fn addresses(&self) -> [usize; 6] {
        [
            self.mem_alloc as usize,
            self.mem_free as usize,
            self.host_alloc as usize,
            self.host_free as usize,
            self.host_register as usize,
            self.host_unregister as usize,
        ]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Held {
    Device,
    HostAlloc,
    HostRegistered,
}

struct State {
    originals: Option<Originals>,
    cap: Option<u64>,
    held: BTreeMap<(Held, u64), u64>,
    /// Bytes held plus bytes reserved by calls in flight.
    committed: u64,
    device_bytes: u64,
    host_bytes: u64,
    device_peak: u64,
    host_peak: u64,
    refusals: u64,
}

static STATE: Mutex<State> = Mutex::new(State {
    originals: None,
    cap: None,
    held: BTreeMap::new(),
    committed: 0,
    device_bytes: 0,
    host_bytes: 0,
    device_peak: 0,
    host_peak: 0,
    refusals: 0,
});

fn state() -> MutexGuard<'static, State> {
    // A poisoned lock only means another thread panicked while counting; the counts stay usable.
    STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A snapshot of the accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// The cap in bytes, `None` when memcap is not installed.
    pub cap_bytes: Option<u64>,
    /// Device bytes held through `cuMemAlloc_v2`.
    pub device_bytes: u64,
    pub device_peak_bytes: u64,
    /// Pinned host bytes held through `cuMemHostAlloc` and `cuMemHostRegister_v2`.
    pub host_bytes: u64,
    pub host_peak_bytes: u64,
    /// Requests answered with out-of-memory because of the cap.
    pub refusals: u64,
    /// Allocations and registrations not yet released.
    pub live_allocations: u64,
}

/// The current accounting.
pub fn counters() -> Counters {
    let st = state();
    Counters {
        cap_bytes: st.cap,
        device_bytes: st.device_bytes,
        device_peak_bytes: st.device_peak,
        host_bytes: st.host_bytes,
        host_peak_bytes: st.host_peak,
        refusals: st.refusals,
        live_allocations: st.held.len() as u64,
    }
}

/// Sets both peaks to the bytes held now (between measurements).
pub fn reset_peaks() {
    let mut st = state();
    st.device_peak = st.device_bytes;
    st.host_peak = st.host_bytes;
}

/// Patches `api` so allocations past `cap_bytes` (device and pinned host together) fail with
/// out-of-memory. Installing again replaces the cap.
///
/// Refused (`Error::Invalid`) when memcap already wraps a different driver's entries and
/// allocations made through it are still live: their releases would reach the wrong library.
pub fn install(api: &mut Api, cap_bytes: u64) -> Result<(), Error> {
    let mut st = state();
    let unwrapped = Originals {
        mem_alloc: keep_original(
            api.cuMemAlloc_v2 as usize,
            W_MEM_ALLOC as usize,
            st.originals.map(|o| o.mem_alloc),
            api.cuMemAlloc_v2,
        ),
        mem_free: keep_original(
            api.cuMemFree_v2 as usize,
            W_MEM_FREE as usize,
            st.originals.map(|o| o.mem_free),
            api.cuMemFree_v2,
        ),
        host_alloc: keep_original(
            api.cuMemHostAlloc as usize,
            W_HOST_ALLOC as usize,
            st.originals.map(|o| o.host_alloc),
            api.cuMemHostAlloc,
        ),
        host_free: keep_original(
            api.cuMemFreeHost as usize,
            W_HOST_FREE as usize,
            st.originals.map(|o| o.host_free),
            api.cuMemFreeHost,
        ),
        host_register: keep_original(
            api.cuMemHostRegister_v2 as usize,
            W_HOST_REGISTER as usize,
            st.originals.map(|o| o.host_register),
            api.cuMemHostRegister_v2,
        ),
        host_unregister: keep_original(
            api.cuMemHostUnregister as usize,
            W_HOST_UNREGISTER as usize,
            st.originals.map(|o| o.host_unregister),
            api.cuMemHostUnregister,
        ),
    };
    if let Some(existing) = st.originals {
        if existing.addresses() != unwrapped.addresses() && !st.held.is_empty() {
            return Err(Error::Invalid {
                what: format!(
                    "memcap already wraps another driver library with {} live allocations; release them before installing on this one",
                    st.held.len()
                ),
            });
        }
    }
    st.originals = Some(unwrapped);
    st.cap = Some(cap_bytes);
    api.cuMemAlloc_v2 = W_MEM_ALLOC;
    api.cuMemFree_v2 = W_MEM_FREE;
    api.cuMemHostAlloc = W_HOST_ALLOC;
    api.cuMemFreeHost = W_HOST_FREE;
    api.cuMemHostRegister_v2 = W_HOST_REGISTER;
    api.cuMemHostUnregister = W_HOST_UNREGISTER;
    Ok(())
}

/// Puts the original entries back into `api` (where it holds memcap's wrappers) and lifts the cap.
/// Counting continues for memory released through other patched tables.
pub fn restore(api: &mut Api) {
    let mut st = state();
    let Some(o) = st.originals else { return };
    st.cap = None;
    if api.cuMemAlloc_v2 as usize == W_MEM_ALLOC as usize {
        api.cuMemAlloc_v2 = o.mem_alloc;
    }
    if api.cuMemFree_v2 as usize == W_MEM_FREE as usize {
        api.cuMemFree_v2 = o.mem_free;
    }
    if api.cuMemHostAlloc as usize == W_HOST_ALLOC as usize {
        api.cuMemHostAlloc = o.host_alloc;
    }
    if api.cuMemFreeHost as usize == W_HOST_FREE as usize {
        api.cuMemFreeHost = o.host_free;
    }
    if api.cuMemHostRegister_v2 as usize == W_HOST_REGISTER as usize {
        api.cuMemHostRegister_v2 = o.host_register;
    }
    if api.cuMemHostUnregister as usize == W_HOST_UNREGISTER as usize {
        api.cuMemHostUnregister = o.host_unregister;
    }
}

/// The entry to remember as the original: the table's own, unless the table already holds the
/// wrapper (re-install), in which case the remembered original stays.
fn keep_original<F: Copy>(
    current: usize,
    wrapper: usize,
    remembered: Option<F>,
    table_entry: F,
) -> F {
    match remembered {
        Some(original) if current == wrapper => original,
        _ => table_entry,
    }
}

/// Reserves `bytes` under the cap; returns the original entries, or the refusal code.
fn reserve(bytes: u64) -> Result<Originals, CUresult> {
    let mut st = state();
    let Some(originals) = st.originals else {
        return Err(code::NOT_INITIALIZED);
    };
    let cap = st.cap.unwrap_or(u64::MAX);
    match st.committed.checked_add(bytes) {
        Some(total) if total <= cap => {
            st.committed = total;
            Ok(originals)
        }
        _ => {
            st.refusals += 1;
            Err(code::OUT_OF_MEMORY)
        }
    }
}

/// Completes a reservation: records the allocation on success, returns the bytes otherwise.
fn settle(kind: Held, key: u64, bytes: u64, result: CUresult) {
    let mut st = state();
    if result != code::SUCCESS {
        st.committed = st.committed.saturating_sub(bytes);
        return;
    }
    if let Some(previous) = st.held.insert((kind, key), bytes) {
        // The driver reused a key we still count (released through an unpatched table).
        st.committed = st.committed.saturating_sub(previous);
        subtract(&mut st, kind, previous);
    }
    match kind {
        Held::Device => {
            st.device_bytes += bytes;
            st.device_peak = st.device_peak.max(st.device_bytes);
        }
        Held::HostAlloc | Held::HostRegistered => {
            st.host_bytes += bytes;
            st.host_peak = st.host_peak.max(st.host_bytes);
        }
    }
}

fn subtract(st: &mut State, kind: Held, bytes: u64) {
    match kind {
        Held::Device => st.device_bytes = st.device_bytes.saturating_sub(bytes),
        Held::HostAlloc | Held::HostRegistered => {
            st.host_bytes = st.host_bytes.saturating_sub(bytes)
        }
    }
}

fn release(kind: Held, key: u64) {
    let mut st = state();
    if let Some(bytes) = st.held.remove(&(kind, key)) {
        st.committed = st.committed.saturating_sub(bytes);
        subtract(&mut st, kind, bytes);
    }
}

fn originals() -> Option<Originals> {
    state().originals
}

unsafe extern "C" fn wrap_mem_alloc(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let bytes = bytesize as u64;
    let o = match reserve(bytes) {
        Ok(o) => o,
        Err(code) => return code,
    };
    // SAFETY: same contract as cuMemAlloc_v2; the caller's arguments are passed through.
    let r = unsafe { (o.mem_alloc)(dptr, bytesize) };
    let key = if r == code::SUCCESS && !dptr.is_null() {
        // SAFETY: on success the driver wrote the address through the caller's valid pointer.
        unsafe { *dptr }
    } else {
        0
    };
    settle(Held::Device, key, bytes, r);
    r
}

unsafe extern "C" fn wrap_mem_free(dptr: CUdeviceptr) -> CUresult {
    let Some(o) = originals() else {
        return code::NOT_INITIALIZED;
    };
    // SAFETY: same contract as cuMemFree_v2.
    let r = unsafe { (o.mem_free)(dptr) };
    if r == code::SUCCESS {
        release(Held::Device, dptr);
    }
    r
}

unsafe extern "C" fn wrap_host_alloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let bytes = bytesize as u64;
    let o = match reserve(bytes) {
        Ok(o) => o,
        Err(code) => return code,
    };
    // SAFETY: same contract as cuMemHostAlloc.
    let r = unsafe { (o.host_alloc)(pp, bytesize, flags) };
    let key = if r == code::SUCCESS && !pp.is_null() {
        // SAFETY: on success the driver wrote the pointer through the caller's valid pointer.
        unsafe { *pp as u64 }
    } else {
        0
    };
    settle(Held::HostAlloc, key, bytes, r);
    r
}

unsafe extern "C" fn wrap_host_free(p: *mut c_void) -> CUresult {
    let Some(o) = originals() else {
        return code::NOT_INITIALIZED;
    };
    // SAFETY: same contract as cuMemFreeHost.
    let r = unsafe { (o.host_free)(p) };
    if r == code::SUCCESS {
        release(Held::HostAlloc, p as u64);
    }
    r
}

unsafe extern "C" fn wrap_host_register(
    p: *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let bytes = bytesize as u64;
    let o = match reserve(bytes) {
        Ok(o) => o,
        Err(code) => return code,
    };
    // SAFETY: same contract as cuMemHostRegister_v2.
    let r = unsafe { (o.host_register)(p, bytesize, flags) };
    settle(Held::HostRegistered, p as u64, bytes, r);
    r
}

unsafe extern "C" fn wrap_host_unregister(p: *mut c_void) -> CUresult {
    let Some(o) = originals() else {
        return code::NOT_INITIALIZED;
    };
    // SAFETY: same contract as cuMemHostUnregister.
    let r = unsafe { (o.host_unregister)(p) };
    if r == code::SUCCESS {
        release(Held::HostRegistered, p as u64);
    }
    r
}
