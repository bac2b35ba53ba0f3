//! The exported driver entry points, one per line of tf-sys's entry list, same C signatures.
#![allow(non_snake_case)]
#![allow(clippy::missing_safety_doc)]
#![allow(clippy::too_many_arguments)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

use tf_sys::result::{known_codes, known_description, known_name};
use tf_sys::types::*;

use crate::kernels::{param_offset, parse_image, KERNELS};
use crate::state::*;

const DEVICE_NAME: &CStr = c"TensorFold Test Driver (host memory)";
const MAX_THREADS_PER_BLOCK: u64 = 1024;
const STATIC_SHARED_LIMIT: c_uint = 48 * 1024;
const MAX_DYNAMIC_SHARED_OPTIN: c_int = 227 * 1024;
const PRIORITY_LEAST: c_int = 0;
const PRIORITY_GREATEST: c_int = -5;
/// Bounded read of a module image (the format is text; a real fatbin fails at the magic).
const MAX_IMAGE_BYTES: usize = 1 << 20;

fn handle_ptr(h: u64) -> *mut c_void {
    h as usize as *mut c_void
}

fn h(p: *mut c_void) -> u64 {
    p as usize as u64
}

fn device_ok(st: &State, dev: CUdevice) -> R {
    if dev >= 0 && dev < st.device_count {
        Ok(())
    } else {
        Err(code::INVALID_DEVICE)
    }
}

// ---------------------------------------------------------------- initialisation and devices

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry("cuInit", Needs::Nothing, |st| {
        if flags != 0 {
            return Err(code::INVALID_VALUE);
        }
        if let Some(c) = st.init_fault {
            return Err(c);
        }
        if st.device_count <= 0 {
            return Err(code::NO_DEVICE);
        }
        st.initialized = true;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    entry("cuDriverGetVersion", Needs::Nothing, |st| {
        put(version, st.driver_version)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    entry("cuDeviceGet", Needs::Init, |st| {
        device_ok(st, ordinal)?;
        put(device, ordinal)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    entry("cuDeviceGetCount", Needs::Init, |st| {
        put(count, st.device_count)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    entry("cuDeviceGetName", Needs::Init, |st| {
        device_ok(st, dev)?;
        if name.is_null() || len <= 0 {
            return Err(code::INVALID_VALUE);
        }
        let bytes = DEVICE_NAME.to_bytes();
        let n = bytes.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name as *mut u8, n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    entry("cuDeviceGetAttribute", Needs::Init, |st| {
        device_ok(st, dev)?;
        let v = match attrib {
            1 => 1024,              // max threads per block
            2 | 3 => 1024,          // max block dim x, y
            4 => 64,                // max block dim z
            5 => i32::MAX,          // max grid dim x
            6 | 7 => 65535,         // max grid dim y, z
            8 => 48 * 1024,         // shared memory per block
            10 => 32,               // warp size
            13 => 1_980_000,        // clock rate, kHz
            16 => 132,              // multiprocessors
            18 => 0,                // integrated
            38 => 50 * 1024 * 1024, // L2 bytes
            39 => 2048,             // threads per multiprocessor
            75 => 9,                // compute capability major
            76 => 0,                // compute capability minor
            81 => 228 * 1024,       // shared memory per multiprocessor
            97 => MAX_DYNAMIC_SHARED_OPTIN,
            102 | 110 => 1,
            a if (1..=200).contains(&a) => 0,
            _ => return Err(code::INVALID_VALUE),
        };
        put(value, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry("cuDeviceTotalMem_v2", Needs::Init, |st| {
        device_ok(st, dev)?;
        put(bytes, st.capacity as usize)
    })
}

// ---------------------------------------------------------------- primary context

fn context_of(st: &mut State, dev: CUdevice) -> u64 {
    if let Some((h, _)) = st.contexts.iter().find(|(_, c)| c.device == dev) {
        return *h;
    }
    let handle = st.handle();
    st.contexts.insert(
        handle,
        PrimaryContext {
            device: dev,
            retained: 0,
        },
    );
    handle
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    entry("cuDevicePrimaryCtxRetain", Needs::Init, |st| {
        device_ok(st, dev)?;
        if pctx.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let handle = context_of(st, dev);
        if let Some(c) = st.contexts.get_mut(&handle) {
            c.retained += 1;
        }
        put(pctx, handle_ptr(handle))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry("cuDevicePrimaryCtxRelease_v2", Needs::Init, |st| {
        device_ok(st, dev)?;
        let handle = context_of(st, dev);
        match st.contexts.get_mut(&handle) {
            Some(c) if c.retained > 0 => {
                c.retained -= 1;
                Ok(())
            }
            _ => Err(code::INVALID_CONTEXT),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    entry("cuDevicePrimaryCtxSetFlags_v2", Needs::Init, |st| {
        device_ok(st, dev)?;
        if flags & !0x1f != 0 {
            return Err(code::INVALID_VALUE);
        }
        st.ctx_flags.insert(dev, flags);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    entry("cuCtxSetCurrent", Needs::Init, |st| {
        let handle = h(ctx);
        if handle != 0 && !st.contexts.contains_key(&handle) {
            return Err(code::INVALID_CONTEXT);
        }
        set_current_context(handle);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    entry("cuCtxGetCurrent", Needs::Init, |_| {
        put(pctx, handle_ptr(current_context()))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    entry("cuCtxGetDevice", Needs::Context, |st| {
        let dev = st
            .contexts
            .get(&current_context())
            .map(|c| c.device)
            .ok_or(code::INVALID_CONTEXT)?;
        put(device, dev)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    entry("cuCtxSynchronize", Needs::Context, |st| {
        st.refuse_during_capture()?;
        st.run_all()
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CUresult {
    entry("cuCtxGetStreamPriorityRange", Needs::Context, |_| {
        if !least.is_null() {
            put(least, PRIORITY_LEAST)?;
        }
        if !greatest.is_null() {
            put(greatest, PRIORITY_GREATEST)?;
        }
        Ok(())
    })
}

// ---------------------------------------------------------------- memory

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry("cuMemGetInfo_v2", Needs::Context, |st| {
        put(free, st.capacity.saturating_sub(st.device_bytes) as usize)?;
        put(total, st.capacity as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    entry("cuMemAlloc_v2", Needs::Context, |st| {
        if dptr.is_null() {
            return Err(code::INVALID_VALUE);
        }
        st.refuse_during_capture()?;
        let base = st.device_alloc(bytesize)?;
        put(dptr, base)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    entry("cuMemFree_v2", Needs::Context, |st| {
        if dptr == 0 {
            return Ok(());
        }
        if !st.device.contains_key(&dptr) {
            return Err(code::INVALID_VALUE);
        }
        // Like the real driver, freeing waits for the device to finish its work.
        st.run_all()?;
        let size = State::free_block(&mut st.device, dptr).ok_or(code::INVALID_VALUE)?;
        st.device_bytes = st.device_bytes.saturating_sub(size as u64);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    entry("cuMemHostAlloc", Needs::Context, |st| {
        if pp.is_null() || flags & !0xf != 0 {
            return Err(code::INVALID_VALUE);
        }
        let base = st.host_alloc(bytesize)?;
        put(pp, handle_ptr(base))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    flags: c_uint,
) -> CUresult {
    entry("cuMemHostGetDevicePointer_v2", Needs::Context, |st| {
        let addr = h(p);
        if flags != 0 || addr == 0 || !st.accessible(addr, 1) || st.allocation_end(addr).is_some() {
            return Err(code::INVALID_VALUE);
        }
        put(pdptr, addr)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    entry("cuMemFreeHost", Needs::Context, |st| {
        if !st.host.contains_key(&h(p)) {
            return Err(code::INVALID_VALUE);
        }
        st.run_all()?;
        State::free_block(&mut st.host, h(p))
            .map(|_| ())
            .ok_or(code::INVALID_VALUE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    entry("cuMemHostRegister_v2", Needs::Context, |st| {
        let addr = h(p);
        if addr == 0 || bytesize == 0 || flags & !0xf != 0 {
            return Err(code::INVALID_VALUE);
        }
        if st.overlaps_host(addr, bytesize as u64) {
            return Err(712); // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        }
        st.registered.insert(addr, bytesize);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    entry("cuMemHostUnregister", Needs::Context, |st| {
        if !st.registered.contains_key(&h(p)) {
            return Err(713); // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        }
        st.run_all()?;
        st.registered.remove(&h(p));
        Ok(())
    })
}

/// A copy between host (`*_dev == false`) and device memory, synchronous (`stream == None`) or
/// queued on a stream. Device ranges must be live allocations.
fn copy(
    st: &mut State,
    dst: u64,
    src: u64,
    len: usize,
    dst_dev: bool,
    src_dev: bool,
    stream: Option<u64>,
) -> R {
    let len = len as u64;
    if len > 0 && (dst == 0 || src == 0) {
        return Err(code::INVALID_VALUE);
    }
    for (addr, dev) in [(dst, dst_dev), (src, src_dev)] {
        if dev && len > 0 && !st.accessible(addr, len) {
            return Err(code::INVALID_VALUE);
        }
    }
    let op = Op::Copy {
        dst,
        src,
        len,
        dst_dev,
        src_dev,
    };
    match stream {
        Some(s) => st.submit(s, op),
        None => {
            st.refuse_during_capture()?;
            st.run_blocking()?;
            st.submit(DEFAULT_STREAM, op)?;
            st.run_stream(DEFAULT_STREAM, None)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    entry("cuMemcpyHtoD_v2", Needs::Context, |st| {
        copy(st, dst, src as usize as u64, n, true, false, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    entry("cuMemcpyDtoH_v2", Needs::Context, |st| {
        copy(st, h(dst), src, n, false, true, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    entry("cuMemcpyDtoD_v2", Needs::Context, |st| {
        copy(st, dst, src, n, true, true, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: CUstream,
) -> CUresult {
    entry("cuMemcpyHtoDAsync_v2", Needs::Context, |st| {
        copy(st, dst, src as usize as u64, n, true, false, Some(h(s)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    entry("cuMemcpyDtoHAsync_v2", Needs::Context, |st| {
        copy(st, h(dst), src, n, false, true, Some(h(s)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: CUstream,
) -> CUresult {
    entry("cuMemcpyDtoDAsync_v2", Needs::Context, |st| {
        copy(st, dst, src, n, true, true, Some(h(s)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpy2DAsync_v2(p: *const Memcpy2D, s: CUstream) -> CUresult {
    entry("cuMemcpy2DAsync_v2", Needs::Context, |st| {
        let d = get(p)?;
        let side = |ty: c_uint, host: u64, dev: u64| match ty {
            flags::MEMORYTYPE_HOST => Ok((host, false)),
            flags::MEMORYTYPE_DEVICE | flags::MEMORYTYPE_UNIFIED => Ok((dev, true)),
            _ => Err(code::INVALID_VALUE),
        };
        let (src_base, src_dev) =
            side(d.src_memory_type, d.src_host as usize as u64, d.src_device)?;
        let (dst_base, dst_dev) =
            side(d.dst_memory_type, d.dst_host as usize as u64, d.dst_device)?;
        let (width, height) = (d.width_in_bytes as u64, d.height as u64);
        if height > 1 && (width > d.src_pitch as u64 || width > d.dst_pitch as u64) {
            return Err(code::INVALID_VALUE);
        }
        let origin = |base: u64, y: usize, pitch: usize, x: usize| {
            (y as u64)
                .checked_mul(pitch as u64)
                .and_then(|o| o.checked_add(x as u64))
                .and_then(|o| base.checked_add(o))
                .ok_or(code::INVALID_VALUE)
        };
        let src = origin(src_base, d.src_y, d.src_pitch, d.src_x_in_bytes)?;
        let dst = origin(dst_base, d.dst_y, d.dst_pitch, d.dst_x_in_bytes)?;
        let c = Copy2D {
            src,
            src_pitch: d.src_pitch as u64,
            src_dev,
            dst,
            dst_pitch: d.dst_pitch as u64,
            dst_dev,
            width,
            height,
        };
        for row in 0..height {
            for (base, pitch, dev) in [(c.src, c.src_pitch, src_dev), (c.dst, c.dst_pitch, dst_dev)]
            {
                let start = row
                    .checked_mul(pitch)
                    .and_then(|o| base.checked_add(o))
                    .ok_or(code::INVALID_VALUE)?;
                if dev && width > 0 && !st.accessible(start, width) {
                    return Err(code::INVALID_VALUE);
                }
            }
        }
        st.submit(h(s), Op::Copy2D(c))
    })
}

fn memset(st: &mut State, dst: u64, value: u32, width: u8, count: usize, stream: Option<u64>) -> R {
    let len = (count as u64)
        .checked_mul(width as u64)
        .ok_or(code::INVALID_VALUE)?;
    if (width == 4 && !dst.is_multiple_of(4)) || (len > 0 && !st.accessible(dst, len)) {
        return Err(code::INVALID_VALUE);
    }
    let op = Op::Memset {
        dst,
        value,
        width,
        count: count as u64,
    };
    match stream {
        Some(s) => st.submit(s, op),
        None => {
            st.refuse_during_capture()?;
            st.run_blocking()?;
            st.submit(DEFAULT_STREAM, op)?;
            st.run_stream(DEFAULT_STREAM, None)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, n: usize) -> CUresult {
    entry("cuMemsetD8_v2", Needs::Context, |st| {
        memset(st, dst, value as u32, 1, n, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, value: c_uint, n: usize) -> CUresult {
    entry("cuMemsetD32_v2", Needs::Context, |st| {
        memset(st, dst, value, 4, n, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    value: u8,
    n: usize,
    s: CUstream,
) -> CUresult {
    entry("cuMemsetD8Async", Needs::Context, |st| {
        memset(st, dst, value as u32, 1, n, Some(h(s)))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: CUdeviceptr,
    value: c_uint,
    n: usize,
    s: CUstream,
) -> CUresult {
    entry("cuMemsetD32Async", Needs::Context, |st| {
        memset(st, dst, value, 4, n, Some(h(s)))
    })
}

// ---------------------------------------------------------------- streams and events

fn create_stream(st: &mut State, ph: *mut CUstream, flags: c_uint, priority: c_int) -> R {
    if ph.is_null() || flags > 1 {
        return Err(code::INVALID_VALUE);
    }
    let handle = st.handle();
    // Priorities are accepted (clamped by the real driver) but do not change the order of work.
    let _ = priority.clamp(PRIORITY_GREATEST, PRIORITY_LEAST);
    st.streams.insert(
        handle,
        Stream {
            flags,
            ..Stream::default()
        },
    );
    put(ph, handle_ptr(handle))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) -> CUresult {
    entry("cuStreamCreate", Needs::Context, |st| {
        create_stream(st, ph, flags, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ph: *mut CUstream,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    entry("cuStreamCreateWithPriority", Needs::Context, |st| {
        create_stream(st, ph, flags, priority)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    entry("cuStreamDestroy_v2", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        if id == DEFAULT_STREAM {
            return Err(code::INVALID_HANDLE);
        }
        // Queued work still completes after a destroy; here it completes now. A fault it raises
        // is reported by later calls (sticky), not by the destroy.
        let _ = st.run_stream(id, None);
        if let Some(cap) = st.streams.get(&id).and_then(|s| s.capture) {
            remove_graph(st, cap.graph);
        }
        st.streams.remove(&id);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    entry("cuStreamSynchronize", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        if let Some(cap) = st.streams.get_mut(&id).and_then(|s| s.capture.as_mut()) {
            cap.invalidated = true;
            return Err(code::STREAM_CAPTURE_UNSUPPORTED);
        }
        st.run_stream(id, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    entry("cuStreamQuery", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        if let Some(cap) = st.streams.get_mut(&id).and_then(|s| s.capture.as_mut()) {
            cap.invalidated = true;
            return Err(code::STREAM_CAPTURE_UNSUPPORTED);
        }
        st.query(id, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) -> CUresult {
    entry("cuStreamWaitEvent", Needs::Context, |st| {
        st.stream_id(h(s))?;
        let event = st.events.get(&h(e)).ok_or(code::INVALID_HANDLE)?;
        if flags & !1 != 0 {
            return Err(code::INVALID_VALUE);
        }
        match event.state {
            EventState::Pending { stream, seq } => st.submit(h(s), Op::Wait { stream, seq }),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph: *mut CUevent, flags: c_uint) -> CUresult {
    entry("cuEventCreate", Needs::Context, |st| {
        if ph.is_null() || flags & !0xf != 0 {
            return Err(code::INVALID_VALUE);
        }
        let handle = st.handle();
        st.events.insert(
            handle,
            Event {
                flags,
                state: EventState::Never,
            },
        );
        put(ph, handle_ptr(handle))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    entry("cuEventDestroy_v2", Needs::Context, |st| {
        st.events
            .remove(&h(e))
            .map(|_| ())
            .ok_or(code::INVALID_HANDLE)
    })
}

fn record(st: &mut State, e: CUevent, s: CUstream, flags: c_uint) -> R {
    if !st.events.contains_key(&h(e)) {
        return Err(code::INVALID_HANDLE);
    }
    if flags & !1 != 0 {
        return Err(code::INVALID_VALUE);
    }
    st.submit(h(s), Op::Mark { event: h(e) })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    entry("cuEventRecord", Needs::Context, |st| record(st, e, s, 0))
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    e: CUevent,
    s: CUstream,
    flags: c_uint,
) -> CUresult {
    entry("cuEventRecordWithFlags", Needs::Context, |st| {
        record(st, e, s, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    entry("cuEventSynchronize", Needs::Context, |st| {
        match st.events.get(&h(e)).ok_or(code::INVALID_HANDLE)?.state {
            EventState::Pending { stream, seq } => st.run_stream(stream, Some(seq)),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    entry("cuEventQuery", Needs::Context, |st| {
        match st.events.get(&h(e)).ok_or(code::INVALID_HANDLE)?.state {
            EventState::Pending { stream, seq } => st.query(stream, Some(seq)),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    entry("cuEventElapsedTime", Needs::Context, |st| {
        let a = st.events.get(&h(start)).ok_or(code::INVALID_HANDLE)?;
        let b = st.events.get(&h(end)).ok_or(code::INVALID_HANDLE)?;
        if (a.flags | b.flags) & flags::EVENT_DISABLE_TIMING != 0 {
            return Err(code::INVALID_HANDLE);
        }
        match (a.state, b.state) {
            (EventState::Done { time_us: t0 }, EventState::Done { time_us: t1 }) => {
                put(ms, ((t1 - t0) / 1000.0) as f32)
            }
            (EventState::Never, _) | (_, EventState::Never) => Err(code::INVALID_HANDLE),
            _ => Err(code::NOT_READY),
        }
    })
}

// ---------------------------------------------------------------- modules and functions

/// Reads the NUL-terminated image, stopping at the first byte that differs from the magic (so a
/// binary image is never read past its header).
fn read_image(image: *const c_void) -> Result<String, CUresult> {
    if image.is_null() {
        return Err(code::INVALID_VALUE);
    }
    let p = image as *const u8;
    let magic = crate::kernels::MODULE_MAGIC.as_bytes();
    let mut bytes = Vec::new();
    for i in 0..MAX_IMAGE_BYTES {
        // SAFETY: the caller passes a NUL-terminated image; we stop at its NUL, or at the first
        // byte that differs from the fake magic.
        let b = unsafe { *p.add(i) };
        if b == 0 {
            return String::from_utf8(bytes).map_err(|_| code::INVALID_IMAGE);
        }
        if i < magic.len() && b != magic[i] {
            return Err(code::INVALID_IMAGE);
        }
        bytes.push(b);
    }
    Err(code::INVALID_IMAGE)
}

fn load_module(
    st: &mut State,
    pm: *mut CUmodule,
    image: *const c_void,
    error_log: Option<(*mut c_char, usize)>,
) -> R {
    if pm.is_null() {
        return Err(code::INVALID_VALUE);
    }
    let parsed = parse_image(&read_image(image)?)?;
    if let Some(message) = parsed.jit_error {
        if let Some((buf, size)) = error_log.filter(|(b, s)| !b.is_null() && *s > 0) {
            let text = format!("tf-testdriver JIT: {message}");
            let n = text.len().min(size - 1);
            // SAFETY: the caller's log buffer holds `size` bytes; we write `n + 1 <= size`.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
                *buf.add(n) = 0;
            }
        }
        return Err(code::INVALID_PTX);
    }
    let module = st.handle();
    let mut functions = Vec::new();
    for kernel in parsed.kernels {
        let f = st.handle();
        st.functions.insert(
            f,
            Function {
                kernel,
                max_dynamic_shared: 0,
            },
        );
        functions.push((kernel, f));
    }
    let mut globals = std::collections::BTreeMap::new();
    for (name, bytes) in parsed.globals {
        let addr = st.global_alloc(bytes)?;
        globals.insert(name, (addr, bytes));
    }
    st.modules.insert(module, Module { functions, globals });
    put(pm, handle_ptr(module))
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(pm: *mut CUmodule, image: *const c_void) -> CUresult {
    entry("cuModuleLoadData", Needs::Context, |st| {
        load_module(st, pm, image, None)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    pm: *mut CUmodule,
    image: *const c_void,
    num_options: c_uint,
    options: *mut c_int,
    values: *mut *mut c_void,
) -> CUresult {
    entry("cuModuleLoadDataEx", Needs::Context, |st| {
        let mut log: (*mut c_char, usize) = (std::ptr::null_mut(), 0);
        if num_options > 0 && (options.is_null() || values.is_null()) {
            return Err(code::INVALID_VALUE);
        }
        for i in 0..num_options as usize {
            // SAFETY: the caller passes `num_options` options and values (checked non-null).
            let (option, value) = unsafe { (*options.add(i), *values.add(i)) };
            match option {
                flags::JIT_ERROR_LOG_BUFFER => log.0 = value as *mut c_char,
                flags::JIT_ERROR_LOG_BUFFER_SIZE_BYTES => log.1 = value as usize,
                _ => {}
            }
        }
        load_module(st, pm, image, Some(log))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: CUmodule) -> CUresult {
    entry("cuModuleUnload", Needs::Context, |st| {
        let module = st.modules.remove(&h(m)).ok_or(code::INVALID_HANDLE)?;
        for (_, f) in module.functions {
            st.functions.remove(&f);
        }
        for (addr, _) in module.globals.into_values() {
            State::free_block(&mut st.globals, addr);
        }
        Ok(())
    })
}

fn c_name<'a>(name: *const c_char) -> Result<&'a str, CUresult> {
    if name.is_null() {
        return Err(code::INVALID_VALUE);
    }
    // SAFETY: the caller passes a NUL-terminated name (checked non-null).
    unsafe { CStr::from_ptr(name) }
        .to_str()
        .map_err(|_| code::NOT_FOUND)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    pf: *mut CUfunction,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    entry("cuModuleGetFunction", Needs::Context, |st| {
        let module = st.modules.get(&h(m)).ok_or(code::INVALID_HANDLE)?;
        let name = c_name(name)?;
        let f = module
            .functions
            .iter()
            .find(|(k, _)| KERNELS.get(*k).is_some_and(|spec| spec.name == name))
            .map(|(_, f)| *f)
            .ok_or(code::NOT_FOUND)?;
        put(pf, handle_ptr(f))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(
    pdptr: *mut CUdeviceptr,
    pbytes: *mut usize,
    m: CUmodule,
    name: *const c_char,
) -> CUresult {
    entry("cuModuleGetGlobal_v2", Needs::Context, |st| {
        let module = st.modules.get(&h(m)).ok_or(code::INVALID_HANDLE)?;
        let (addr, bytes) = *module.globals.get(c_name(name)?).ok_or(code::NOT_FOUND)?;
        if !pdptr.is_null() {
            put(pdptr, addr)?;
        }
        if !pbytes.is_null() {
            put(pbytes, bytes)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    f: CUfunction,
) -> CUresult {
    entry("cuFuncGetAttribute", Needs::Context, |st| {
        let func = st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
        let v = match attrib {
            0 => MAX_THREADS_PER_BLOCK as c_int,
            4 => 32,
            5 | 6 => 90,
            8 => func.max_dynamic_shared,
            a if (0..=20).contains(&a) => 0,
            _ => return Err(code::INVALID_VALUE),
        };
        put(value, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(
    f: CUfunction,
    attrib: c_int,
    value: c_int,
) -> CUresult {
    entry("cuFuncSetAttribute", Needs::Context, |st| {
        let func = st.functions.get_mut(&h(f)).ok_or(code::INVALID_HANDLE)?;
        match attrib {
            8 if (0..=MAX_DYNAMIC_SHARED_OPTIN).contains(&value) => {
                func.max_dynamic_shared = value;
                Ok(())
            }
            8 => Err(code::INVALID_VALUE),
            a if (0..=20).contains(&a) => Ok(()),
            _ => Err(code::INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetCacheConfig(f: CUfunction, config: c_int) -> CUresult {
    entry("cuFuncSetCacheConfig", Needs::Context, |st| {
        st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
        if (0..=3).contains(&config) {
            Ok(())
        } else {
            Err(code::INVALID_VALUE)
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetName(name: *mut *const c_char, f: CUfunction) -> CUresult {
    entry("cuFuncGetName", Needs::Context, |st| {
        let func = st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
        let spec = KERNELS.get(func.kernel).ok_or(code::INVALID_HANDLE)?;
        put(name, spec.c_name.as_ptr())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetParamInfo(
    f: CUfunction,
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> CUresult {
    entry("cuFuncGetParamInfo", Needs::Context, |st| {
        let func = st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
        let spec = KERNELS.get(func.kernel).ok_or(code::INVALID_HANDLE)?;
        let off = param_offset(spec, index).ok_or(code::INVALID_VALUE)?;
        let bytes = *spec.param_sizes.get(index).ok_or(code::INVALID_VALUE)?;
        if !offset.is_null() {
            put(offset, off)?;
        }
        if !size.is_null() {
            put(size, bytes)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    n: *mut c_int,
    f: CUfunction,
    block: c_int,
    _shared: usize,
) -> CUresult {
    entry(
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        Needs::Context,
        |st| {
            st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
            if block <= 0 || block as u64 > MAX_THREADS_PER_BLOCK {
                return Err(code::INVALID_VALUE);
            }
            put(n, (2048 / block).min(32))
        },
    )
}

// ---------------------------------------------------------------- launches

/// Validates a launch and packs its arguments (copied now, as the real driver does).
fn build_launch(
    st: &State,
    f: CUfunction,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared: c_uint,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<Launch, CUresult> {
    let func = st.functions.get(&h(f)).ok_or(code::INVALID_HANDLE)?;
    let spec = KERNELS.get(func.kernel).ok_or(code::INVALID_HANDLE)?;
    let threads = block.iter().map(|d| *d as u64).product::<u64>();
    if grid.contains(&0)
        || threads == 0
        || threads > MAX_THREADS_PER_BLOCK
        || block[2] > 64
        || grid[1] > 65535
        || grid[2] > 65535
        || grid[0] > i32::MAX as c_uint
    {
        return Err(code::INVALID_VALUE);
    }
    let shared_limit = STATIC_SHARED_LIMIT.max(func.max_dynamic_shared as c_uint);
    if shared > shared_limit {
        return Err(code::INVALID_VALUE);
    }
    if !extra.is_null() {
        // The `extra` argument buffer is not modelled; kernels take `kernelParams`.
        return Err(code::INVALID_VALUE);
    }
    if !spec.param_sizes.is_empty() && params.is_null() {
        return Err(code::INVALID_VALUE);
    }
    let mut bufs = Vec::with_capacity(spec.param_sizes.len());
    for (i, size) in spec.param_sizes.iter().enumerate() {
        // SAFETY: `params` holds one pointer per kernel parameter (the C launch contract).
        let arg = unsafe { *params.add(i) } as *const u8;
        if arg.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: each argument pointer points at a value of the parameter's size.
        let bytes = unsafe { std::slice::from_raw_parts(arg, *size) };
        bufs.push(bytes.to_vec().into_boxed_slice());
    }
    Ok(Launch {
        function: h(f),
        kernel: func.kernel,
        grid,
        block,
        shared,
        args: ArgPack::new(bufs),
        fault: None,
    })
}

fn launch(st: &mut State, mut l: Launch, stream: CUstream) -> R {
    let id = st.stream_id(h(stream))?;
    l.fault = st.take_launch_fault(if id == DEFAULT_STREAM { u64::MAX } else { id });
    st.submit(h(stream), Op::Kernel(l))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry("cuLaunchKernel", Needs::Context, |st| {
        let l = build_launch(st, f, [gx, gy, gz], [bx, by, bz], shared, params, extra)?;
        launch(st, l, stream)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const LaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry("cuLaunchKernelEx", Needs::Context, |st| {
        let c = get(config)?;
        if c.num_attrs > 0 && c.attrs.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let l = build_launch(
            st,
            f,
            [c.grid_x, c.grid_y, c.grid_z],
            [c.block_x, c.block_y, c.block_z],
            c.shared_bytes,
            params,
            extra,
        )?;
        launch(st, l, c.stream)
    })
}

// ---------------------------------------------------------------- graphs

fn remove_graph(st: &mut State, graph: u64) {
    if let Some(g) = st.graphs.remove(&graph) {
        for n in g.nodes {
            st.nodes.remove(&n);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(s: CUstream, mode: c_int) -> CUresult {
    entry("cuStreamBeginCapture_v2", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        if id == DEFAULT_STREAM {
            return Err(code::STREAM_CAPTURE_UNSUPPORTED);
        }
        if !(0..=2).contains(&mode) {
            return Err(code::INVALID_VALUE);
        }
        if st.streams.get(&id).is_some_and(|s| s.capture.is_some()) {
            return Err(401); // CUDA_ERROR_ILLEGAL_STATE
        }
        let graph = st.handle();
        st.graphs.insert(graph, Graph { nodes: Vec::new() });
        if let Some(stream) = st.streams.get_mut(&id) {
            stream.capture = Some(Capture {
                mode,
                graph,
                invalidated: false,
            });
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(s: CUstream, pgraph: *mut CUgraph) -> CUresult {
    entry("cuStreamEndCapture", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        if pgraph.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let cap = st
            .streams
            .get_mut(&id)
            .and_then(|s| s.capture.take())
            .ok_or(401)?;
        if cap.invalidated {
            remove_graph(st, cap.graph);
            put(pgraph, std::ptr::null_mut())?;
            return Err(code::STREAM_CAPTURE_INVALIDATED);
        }
        put(pgraph, handle_ptr(cap.graph))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(s: CUstream, status: *mut c_int) -> CUresult {
    entry("cuStreamIsCapturing", Needs::Context, |st| {
        let id = st.stream_id(h(s))?;
        let v = match st.streams.get(&id).and_then(|s| s.capture) {
            None => capture_status::NONE,
            Some(c) if c.invalidated => capture_status::INVALIDATED,
            Some(_) => capture_status::ACTIVE,
        };
        put(status, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphCreate(pgraph: *mut CUgraph, flags: c_uint) -> CUresult {
    entry("cuGraphCreate", Needs::Context, |st| {
        if flags != 0 || pgraph.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let graph = st.handle();
        st.graphs.insert(graph, Graph { nodes: Vec::new() });
        put(pgraph, handle_ptr(graph))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(g: CUgraph) -> CUresult {
    entry("cuGraphDestroy", Needs::Context, |st| {
        if !st.graphs.contains_key(&h(g)) {
            return Err(code::INVALID_HANDLE);
        }
        remove_graph(st, h(g));
        Ok(())
    })
}

fn check_deps(st: &State, graph: u64, deps: *const CUgraphNode, n: usize) -> R {
    if n > 0 && deps.is_null() {
        return Err(code::INVALID_VALUE);
    }
    for i in 0..n {
        // SAFETY: the caller passes `n` node handles (checked non-null).
        let node = h(unsafe { *deps.add(i) });
        if st.nodes.get(&node).map(|n| n.graph) != Some(graph) {
            return Err(code::INVALID_VALUE);
        }
    }
    Ok(())
}

fn launch_from_params(st: &State, p: &KernelNodeParams) -> Result<Launch, CUresult> {
    if !p.kern.is_null() {
        return Err(code::INVALID_VALUE);
    }
    build_launch(
        st,
        p.func,
        [p.grid_x, p.grid_y, p.grid_z],
        [p.block_x, p.block_y, p.block_z],
        p.shared_bytes,
        p.params,
        p.extra,
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddKernelNode_v2(
    pnode: *mut CUgraphNode,
    g: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    params: *const KernelNodeParams,
) -> CUresult {
    entry("cuGraphAddKernelNode_v2", Needs::Context, |st| {
        if !st.graphs.contains_key(&h(g)) {
            return Err(code::INVALID_HANDLE);
        }
        if pnode.is_null() {
            return Err(code::INVALID_VALUE);
        }
        check_deps(st, h(g), deps, ndeps)?;
        let l = launch_from_params(st, &get(params)?)?;
        let node = st.add_node(h(g), Op::Kernel(l))?;
        put(pnode, handle_ptr(node))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphKernelNodeGetParams_v2(
    node: CUgraphNode,
    params: *mut KernelNodeParams,
) -> CUresult {
    entry("cuGraphKernelNodeGetParams_v2", Needs::Context, |st| {
        let Some(Node {
            op: Op::Kernel(l), ..
        }) = st.nodes.get(&h(node))
        else {
            return Err(code::INVALID_VALUE);
        };
        put(
            params,
            KernelNodeParams {
                func: handle_ptr(l.function),
                grid_x: l.grid[0],
                grid_y: l.grid[1],
                grid_z: l.grid[2],
                block_x: l.block[0],
                block_y: l.block[1],
                block_z: l.block[2],
                shared_bytes: l.shared,
                // Points into the node's own copy; valid until the node changes or is destroyed.
                params: l.args.pointer_array(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: handle_ptr(current_context()),
            },
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphKernelNodeSetParams_v2(
    node: CUgraphNode,
    params: *const KernelNodeParams,
) -> CUresult {
    entry("cuGraphKernelNodeSetParams_v2", Needs::Context, |st| {
        if !matches!(
            st.nodes.get(&h(node)),
            Some(Node {
                op: Op::Kernel(_),
                ..
            })
        ) {
            return Err(code::INVALID_VALUE);
        }
        let l = launch_from_params(st, &get(params)?)?;
        if let Some(n) = st.nodes.get_mut(&h(node)) {
            n.op = Op::Kernel(l);
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphAddDependencies(
    g: CUgraph,
    from: *const CUgraphNode,
    to: *const CUgraphNode,
    n: usize,
) -> CUresult {
    entry("cuGraphAddDependencies", Needs::Context, |st| {
        if !st.graphs.contains_key(&h(g)) {
            return Err(code::INVALID_HANDLE);
        }
        // Nodes run in the order they were added; dependencies are validated, not reordered.
        check_deps(st, h(g), from, n)?;
        check_deps(st, h(g), to, n)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphGetNodes(
    g: CUgraph,
    nodes: *mut CUgraphNode,
    count: *mut usize,
) -> CUresult {
    entry("cuGraphGetNodes", Needs::Context, |st| {
        let graph = st.graphs.get(&h(g)).ok_or(code::INVALID_HANDLE)?;
        let total = graph.nodes.len();
        if !nodes.is_null() {
            let room = get(count as *const usize)?;
            for (i, node) in graph.nodes.iter().take(room).enumerate() {
                // SAFETY: the caller's array holds `room` entries.
                unsafe { nodes.add(i).write(handle_ptr(*node)) };
            }
        }
        put(count, total)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    pexec: *mut CUgraphExec,
    g: CUgraph,
    _flags: u64,
) -> CUresult {
    entry("cuGraphInstantiateWithFlags", Needs::Context, |st| {
        let graph = st.graphs.get(&h(g)).ok_or(code::INVALID_HANDLE)?;
        if pexec.is_null() {
            return Err(code::INVALID_VALUE);
        }
        let nodes: Vec<(u64, Op)> = graph
            .nodes
            .iter()
            .filter_map(|n| st.nodes.get(n).map(|node| (*n, node.op.clone())))
            .collect();
        let exec = st.handle();
        st.execs.insert(exec, Exec { nodes });
        put(pexec, handle_ptr(exec))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphUpload(e: CUgraphExec, s: CUstream) -> CUresult {
    entry("cuGraphUpload", Needs::Context, |st| {
        st.stream_id(h(s))?;
        st.execs.get(&h(e)).map(|_| ()).ok_or(code::INVALID_HANDLE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(e: CUgraphExec, s: CUstream) -> CUresult {
    entry("cuGraphLaunch", Needs::Context, |st| {
        st.stream_id(h(s))?;
        let ops: Vec<Op> = st
            .execs
            .get(&h(e))
            .ok_or(code::INVALID_HANDLE)?
            .nodes
            .iter()
            .map(|(_, op)| op.clone())
            .collect();
        for op in ops {
            st.submit(h(s), op)?;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(e: CUgraphExec) -> CUresult {
    entry("cuGraphExecDestroy", Needs::Context, |st| {
        st.execs
            .remove(&h(e))
            .map(|_| ())
            .ok_or(code::INVALID_HANDLE)
    })
}

fn same_kind(a: &Op, b: &Op) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecUpdate_v2(
    e: CUgraphExec,
    g: CUgraph,
    info: *mut ExecUpdateResultInfo,
) -> CUresult {
    entry("cuGraphExecUpdate_v2", Needs::Context, |st| {
        let graph = st.graphs.get(&h(g)).ok_or(code::INVALID_HANDLE)?;
        let exec = st.execs.get(&h(e)).ok_or(code::INVALID_HANDLE)?;
        let new: Vec<(u64, Op)> = graph
            .nodes
            .iter()
            .filter_map(|n| st.nodes.get(n).map(|node| (*n, node.op.clone())))
            .collect();
        let mut verdict = (exec_update_result::SUCCESS, 0u64, 0u64);
        if new.len() != exec.nodes.len() {
            verdict = (exec_update_result::TOPOLOGY_CHANGED, 0, 0);
        } else {
            for ((new_id, new_op), (old_id, old_op)) in new.iter().zip(&exec.nodes) {
                if !same_kind(new_op, old_op) {
                    verdict = (exec_update_result::NODE_TYPE_CHANGED, *new_id, *old_id);
                    break;
                }
                if let (Op::Kernel(a), Op::Kernel(b)) = (new_op, old_op) {
                    if a.kernel != b.kernel {
                        verdict = (exec_update_result::FUNCTION_CHANGED, *new_id, *old_id);
                        break;
                    }
                }
            }
        }
        put(
            info,
            ExecUpdateResultInfo {
                result: verdict.0,
                error_node: handle_ptr(verdict.1),
                error_from_node: handle_ptr(verdict.2),
            },
        )?;
        if verdict.0 != exec_update_result::SUCCESS {
            return Err(910); // CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE
        }
        if let Some(exec) = st.execs.get_mut(&h(e)) {
            exec.nodes = new;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecKernelNodeSetParams_v2(
    e: CUgraphExec,
    node: CUgraphNode,
    params: *const KernelNodeParams,
) -> CUresult {
    entry("cuGraphExecKernelNodeSetParams_v2", Needs::Context, |st| {
        let l = launch_from_params(st, &get(params)?)?;
        let exec = st.execs.get_mut(&h(e)).ok_or(code::INVALID_HANDLE)?;
        let slot = exec
            .nodes
            .iter_mut()
            .find(|(id, _)| *id == h(node))
            .ok_or(code::INVALID_VALUE)?;
        match &slot.1 {
            Op::Kernel(old) if old.kernel == l.kernel => {
                slot.1 = Op::Kernel(l);
                Ok(())
            }
            _ => Err(code::INVALID_VALUE),
        }
    })
}

// ---------------------------------------------------------------- TMA tensor maps (looked up by name, not pinned)

/// Bytes of each `CUtensorMapDataType` (uint8, uint16, uint32, int32, uint64, int64, float16, float32, float64,
/// bfloat16, float32_ftz, tfloat32, tfloat32_ftz).
const TENSOR_MAP_ELEMENT_BYTES: [u64; 13] = [1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4];

/// `cuTensorMapEncodeTiled` with the driver's argument rules (rank 1..=5, 16-byte aligned address and strides below
/// 2^40, dimensions 1..=2^32, boxes of 1..=256 with rows of a multiple of 16 bytes that fit the swizzle span,
/// element strides 1..=8, enums in range); the 128 bytes it writes are a deterministic digest of the arguments
/// (no TMA runs here): word 0 the type, rank, interleave, swizzle, L2 promotion and fill, word 1 the address,
/// then the dimensions, the strides and the box.
#[no_mangle]
pub unsafe extern "C" fn cuTensorMapEncodeTiled(
    map: *mut [u64; 16],
    data_type: c_uint,
    rank: c_uint,
    global: *mut c_void,
    dims: *const u64,
    strides: *const u64,
    box_dims: *const c_uint,
    element_strides: *const c_uint,
    interleave: c_uint,
    swizzle: c_uint,
    l2_promotion: c_uint,
    oob_fill: c_uint,
) -> CUresult {
    entry("cuTensorMapEncodeTiled", Needs::Init, |_| {
        let r = rank as usize;
        let element = *TENSOR_MAP_ELEMENT_BYTES
            .get(data_type as usize)
            .ok_or(code::INVALID_VALUE)?;
        let address = h(global);
        let ok = (1..=5).contains(&r)
            && !map.is_null()
            && address != 0
            && address.is_multiple_of(16)
            && !dims.is_null()
            && !box_dims.is_null()
            && !element_strides.is_null()
            && (r == 1 || !strides.is_null())
            && interleave <= 2
            && swizzle <= 3
            && l2_promotion <= 3
            && oob_fill <= 1;
        if !ok {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: the C API passes arrays of `rank` (strides: `rank - 1`) entries; checked non-null above.
        let (dims, boxes, steps) = unsafe {
            (
                std::slice::from_raw_parts(dims, r),
                std::slice::from_raw_parts(box_dims, r),
                std::slice::from_raw_parts(element_strides, r),
            )
        };
        let strides: &[u64] = if r > 1 {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(strides, r - 1) }
        } else {
            &[]
        };
        let span = [0u64, 32, 64, 128][swizzle as usize];
        let row_bytes = u64::from(boxes[0]) * element;
        let ok = dims.iter().all(|&d| (1..=1u64 << 32).contains(&d))
            && strides
                .iter()
                .all(|&st| st.is_multiple_of(16) && st < 1u64 << 40)
            && boxes.iter().all(|&b| (1..=256).contains(&b))
            && steps.iter().all(|&e| (1..=8).contains(&e))
            && row_bytes.is_multiple_of(16)
            && (span == 0 || row_bytes <= span);
        if !ok {
            return Err(code::INVALID_VALUE);
        }
        let mut words = [0u64; 16];
        words[0] = u64::from(data_type)
            | u64::from(rank) << 8
            | u64::from(interleave) << 16
            | u64::from(swizzle) << 24
            | u64::from(l2_promotion) << 32
            | u64::from(oob_fill) << 40;
        words[1] = address;
        for (slot, value) in words[2..].iter_mut().zip(
            dims.iter()
                .chain(strides)
                .copied()
                .chain(boxes.iter().map(|&b| u64::from(b))),
        ) {
            *slot = value;
        }
        put(map, words)
    })
}

// ---------------------------------------------------------------- error text

struct ErrorStrings {
    rows: Vec<(CUresult, CString, CString)>,
}

fn error_strings() -> &'static ErrorStrings {
    static STRINGS: OnceLock<ErrorStrings> = OnceLock::new();
    STRINGS.get_or_init(|| ErrorStrings {
        rows: known_codes()
            .filter_map(|c| {
                let name = CString::new(known_name(c)?).ok()?;
                let text =
                    CString::new(format!("[tf-testdriver] {}", known_description(c)?)).ok()?;
                Some((c, name, text))
            })
            .collect(),
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(result: CUresult, pstr: *mut *const c_char) -> CUresult {
    entry("cuGetErrorName", Needs::Nothing, |_| {
        match error_strings().rows.iter().find(|r| r.0 == result) {
            Some(row) => put(pstr, row.1.as_ptr()),
            None => {
                put(pstr, std::ptr::null())?;
                Err(code::INVALID_VALUE)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(result: CUresult, pstr: *mut *const c_char) -> CUresult {
    entry(
        "cuGetErrorString",
        Needs::Nothing,
        |_| match error_strings().rows.iter().find(|r| r.0 == result) {
            Some(row) => put(pstr, row.2.as_ptr()),
            None => {
                put(pstr, std::ptr::null())?;
                Err(code::INVALID_VALUE)
            }
        },
    )
}

/// Compile-time proof that every entry of tf-sys's list is exported here with its exact type:
/// the struct literal must name every field, and each function must match the field's type.
#[allow(dead_code)]
const _EVERY_ENTRY_EXPORTED: fn() -> tf_sys::Api = || tf_sys::Api {
    cuInit,
    cuDriverGetVersion,
    cuDeviceGet,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDeviceGetAttribute,
    cuDeviceTotalMem_v2,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxRelease_v2,
    cuDevicePrimaryCtxSetFlags_v2,
    cuCtxSetCurrent,
    cuCtxGetCurrent,
    cuCtxGetDevice,
    cuCtxSynchronize,
    cuCtxGetStreamPriorityRange,
    cuMemGetInfo_v2,
    cuMemAlloc_v2,
    cuMemFree_v2,
    cuMemHostAlloc,
    cuMemHostGetDevicePointer_v2,
    cuMemFreeHost,
    cuMemHostRegister_v2,
    cuMemHostUnregister,
    cuMemcpyHtoD_v2,
    cuMemcpyDtoH_v2,
    cuMemcpyDtoD_v2,
    cuMemcpyHtoDAsync_v2,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyDtoDAsync_v2,
    cuMemcpy2DAsync_v2,
    cuMemsetD8_v2,
    cuMemsetD32_v2,
    cuMemsetD8Async,
    cuMemsetD32Async,
    cuStreamCreate,
    cuStreamCreateWithPriority,
    cuStreamDestroy_v2,
    cuStreamSynchronize,
    cuStreamWaitEvent,
    cuStreamQuery,
    cuEventCreate,
    cuEventDestroy_v2,
    cuEventRecord,
    cuEventRecordWithFlags,
    cuEventSynchronize,
    cuEventQuery,
    cuEventElapsedTime,
    cuModuleLoadData,
    cuModuleLoadDataEx,
    cuModuleUnload,
    cuModuleGetFunction,
    cuModuleGetGlobal_v2,
    cuFuncGetAttribute,
    cuFuncSetAttribute,
    cuFuncSetCacheConfig,
    cuFuncGetName: Some(cuFuncGetName),
    cuFuncGetParamInfo: Some(cuFuncGetParamInfo),
    cuOccupancyMaxActiveBlocksPerMultiprocessor,
    cuLaunchKernel,
    cuLaunchKernelEx,
    cuStreamBeginCapture_v2,
    cuStreamEndCapture,
    cuStreamIsCapturing,
    cuGraphCreate,
    cuGraphDestroy,
    cuGraphAddKernelNode_v2,
    cuGraphKernelNodeGetParams_v2,
    cuGraphKernelNodeSetParams_v2,
    cuGraphAddDependencies,
    cuGraphGetNodes,
    cuGraphInstantiateWithFlags,
    cuGraphUpload,
    cuGraphLaunch,
    cuGraphExecDestroy,
    cuGraphExecUpdate_v2,
    cuGraphExecKernelNodeSetParams_v2,
    cuGetErrorName,
    cuGetErrorString,
};
