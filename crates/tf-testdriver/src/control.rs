//! Exported control functions (`tftd_*`): configuration, fault injection and counters.

use std::ffi::{c_char, c_int, CStr};

use tf_sys::types::{CUresult, CUstream};

use crate::state::control;

fn entry_name(name: *const c_char) -> Option<&'static str> {
    if name.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated name (checked non-null).
    let name = unsafe { CStr::from_ptr(name) }.to_str().ok()?;
    tf_sys::ENTRIES
        .iter()
        .map(|e| e.name)
        .chain(crate::UNPINNED_ENTRIES.iter().copied())
        .find(|&e| e == name)
}

/// Frees everything and returns the driver to its fresh, uninitialised state: no faults, no
/// sticky code, default capacity/device count/version/query delay, call counts at zero.
#[no_mangle]
pub extern "C" fn tftd_reset() {
    control(|st| st.reset(), ())
}

/// Makes every later `cuInit` fail with `code` (0 lifts it). Cleared by `tftd_reset`.
#[no_mangle]
pub extern "C" fn tftd_fail_init(code: CUresult) {
    control(|st| st.init_fault = (code != 0).then_some(code), ())
}

/// Fails calls `nth .. nth + times` (1-based, counted from now) of the entry `name` with `code`;
/// `times == 0` fails every call from the nth on. A sticky code also trips the sticky state.
/// Returns 0, or -1 when `name` is not an entry of the table.
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tftd_fail_call(
    name: *const c_char,
    nth: u64,
    code: CUresult,
    times: u64,
) -> c_int {
    let Some(entry) = entry_name(name) else {
        return -1;
    };
    control(
        |st| {
            st.add_fault(entry, nth, code, times);
            0
        },
        -1,
    )
}

/// The next kernel launched on `stream` (null: on any stream) fails with `code` when it executes,
/// i.e. at the next synchronize/query that runs it. A sticky code (700, ...) trips the sticky state.
#[no_mangle]
pub extern "C" fn tftd_fault_next_launch(stream: CUstream, code: CUresult) {
    control(|st| st.add_launch_fault(stream as usize as u64, code), ())
}

/// Sets the device memory capacity (`cuMemGetInfo_v2` total; allocations past it fail with 2).
#[no_mangle]
pub extern "C" fn tftd_set_device_capacity(bytes: u64) {
    control(|st| st.capacity = bytes, ())
}

/// Sets how many devices the driver reports (0: `cuInit` fails with `CUDA_ERROR_NO_DEVICE`).
#[no_mangle]
pub extern "C" fn tftd_set_device_count(count: c_int) {
    control(|st| st.device_count = count.max(0), ())
}

/// Sets the version `cuDriverGetVersion` reports (`1000 * major + 10 * minor`).
#[no_mangle]
pub extern "C" fn tftd_set_driver_version(version: c_int) {
    control(|st| st.driver_version = version, ())
}

/// Sets how many queries (`cuStreamQuery`/`cuEventQuery`) answer `CUDA_ERROR_NOT_READY` after work
/// is queued on an idle stream, before a query runs the work (default 1).
#[no_mangle]
pub extern "C" fn tftd_set_query_delay(queries: u32) {
    control(|st| st.query_delay = queries, ())
}

/// How many times the entry `name` was called since the last reset (0 for an unknown name).
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tftd_call_count(name: *const c_char) -> u64 {
    let Some(entry) = entry_name(name) else {
        return 0;
    };
    control(|st| st.calls_of(entry), 0)
}

/// A counter of live objects or bytes (see `tf_testdriver::COUNTER_NAMES`); -1 for an unknown name.
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tftd_counter(name: *const c_char) -> i64 {
    if name.is_null() {
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated name (checked non-null).
    let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
        return -1;
    };
    control(|st| st.counter(name).unwrap_or(-1), -1)
}

/// The sticky fault code every call now answers, or 0.
#[no_mangle]
pub extern "C" fn tftd_sticky_code() -> CUresult {
    control(|st| st.sticky.unwrap_or(0), 0)
}
