//! One device's primary context, its health, and the checked call path every driver call takes.
//!
//! Health: the first sticky execution fault (`tf_sys::result::is_sticky`) seen by any call made
//! through a context marks it lost. From then on every call through it fails fast with
//! `ContextLost` without reaching the driver, and dropping it (or anything made in it) leaks
//! instead of calling in: after such a fault the driver cannot release anything, and the process
//! is expected to exit.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint};
use std::fmt;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use tf_sys::{Api, CUcontext, CUdevice, CUresult, Driver};

use crate::copy;
use crate::error::Error;

/// Host scheduling of the threads waiting on this device (`CU_CTX_SCHED_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Schedule {
    /// The driver picks (spin when there are fewer active contexts than cores).
    #[default]
    Auto,
    /// Spin: lowest latency, burns a core.
    Spin,
    /// Yield the thread while waiting.
    Yield,
    /// Block on a synchronization primitive: lowest CPU use.
    Blocking,
}

impl Schedule {
    fn flags(self) -> c_uint {
        match self {
            Schedule::Auto => tf_sys::flags::CTX_SCHED_AUTO,
            Schedule::Spin => tf_sys::flags::CTX_SCHED_SPIN,
            Schedule::Yield => tf_sys::flags::CTX_SCHED_YIELD,
            Schedule::Blocking => tf_sys::flags::CTX_SCHED_BLOCKING_SYNC,
        }
    }
}

/// Free and total device memory, from the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free: u64,
    pub total: u64,
}

/// Source of unique context ids (0 means "no context" in the thread-local binding).
static NEXT_CONTEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The context id this thread last made current (each thread binds its own context).
    static BOUND: Cell<u64> = const { Cell::new(0) };
}

/// The call path of one context: the driver, the handle, the health state. Shared by the
/// context, everything made in it, and the copy-source backend.
pub(crate) struct ContextCore {
    driver: Arc<Driver>,
    api: Api,
    pub(crate) ordinal: c_int,
    pub(crate) device: CUdevice,
    pub(crate) handle: CUcontext,
    id: u64,
    /// 0 while healthy; else the first sticky code seen.
    lost: AtomicI32,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver binds it per thread, which
// `call` does on first use); the rest of the state is immutable or atomic.
unsafe impl Send for ContextCore {}
// SAFETY: as above; shared access only reads immutable fields or atomics.
unsafe impl Sync for ContextCore {}

impl ContextCore {
    pub(crate) fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The first sticky code this context saw, if it is lost.
    pub(crate) fn lost_code(&self) -> Option<i32> {
        match self.lost.load(Ordering::Acquire) {
            0 => None,
            code => Some(code),
        }
    }

    /// Records a sticky fault (the first one wins).
    pub(crate) fn mark_lost(&self, code: CUresult) {
        let _ = self
            .lost
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Fails fast when the context is lost.
    pub(crate) fn ensure_healthy(&self, call: &'static str) -> Result<(), tf_sys::Error> {
        match self.lost_code() {
            None => Ok(()),
            Some(code) => Err(tf_sys::Error::ContextLost { call, code }),
        }
    }

    /// Maps a driver result, publishing a sticky fault to the context's health first.
    pub(crate) fn check(&self, call: &'static str, result: CUresult) -> Result<(), tf_sys::Error> {
        if result != tf_sys::code::SUCCESS && tf_sys::result::is_sticky(result) {
            self.mark_lost(result);
            return Err(tf_sys::Error::ContextLost { call, code: result });
        }
        tf_sys::check(&*self.driver, call, result)
    }

    /// Makes this context current on the calling thread if it is not already.
    fn bind(&self) -> Result<(), tf_sys::Error> {
        if BOUND.with(|b| b.get()) == self.id {
            return Ok(());
        }
        // SAFETY: the handle is this context's retained primary context.
        let r = unsafe { (self.api.cuCtxSetCurrent)(self.handle) };
        self.check("cuCtxSetCurrent", r)?;
        BOUND.with(|b| b.set(self.id));
        Ok(())
    }

    /// The checked call path: fail fast when lost, bind the context to this thread, call,
    /// publish a sticky fault, map the result.
    pub(crate) fn call(
        &self,
        call: &'static str,
        f: impl FnOnce(&Api) -> CUresult,
    ) -> Result<(), tf_sys::Error> {
        self.ensure_healthy(call)?;
        self.bind()?;
        let r = f(&self.api);
        self.check(call, r)
    }

    /// Like [`ContextCore::call`] but returns the raw result for codes the caller interprets
    /// itself (NOT_READY from queries, NOT_FOUND from probes, 800 from instantiate); sticky
    /// faults still mark the context lost and come back as `ContextLost`.
    pub(crate) fn call_raw(
        &self,
        call: &'static str,
        f: impl FnOnce(&Api) -> CUresult,
    ) -> Result<CUresult, tf_sys::Error> {
        self.ensure_healthy(call)?;
        self.bind()?;
        let r = f(&self.api);
        if r != tf_sys::code::SUCCESS && tf_sys::result::is_sticky(r) {
            self.mark_lost(r);
            return Err(tf_sys::Error::ContextLost { call, code: r });
        }
        Ok(r)
    }

    /// Maps a result obtained through [`ContextCore::call_raw`].
    pub(crate) fn map(&self, call: &'static str, result: CUresult) -> Result<(), tf_sys::Error> {
        self.check(call, result)
    }

    /// A call made during teardown: skipped on a lost context, result ignored, never panics.
    pub(crate) fn release_call(&self, call: &'static str, f: impl FnOnce(&Api) -> CUresult) {
        let _ = self.call(call, f);
    }
}

/// A context with its copy-source registration. Everything made in the context holds an
/// `Arc` of this, so the context is released after all of it.
pub(crate) struct ContextInner {
    pub(crate) core: Arc<ContextCore>,
    pub(crate) copy_id: tf_copysource::ContextId,
}

impl std::ops::Deref for ContextInner {
    type Target = ContextCore;
    fn deref(&self) -> &ContextCore {
        &self.core
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // Waits for this context's pending copies and frees its staging; on a lost context the
        // backend refuses every call, so the blocks are leaked instead.
        let _ = copy::hub().unregister_context(self.copy_id);
        copy::unregister_core(self.core.id);
        if self.core.lost_code().is_some() {
            // The driver cannot release anything after a sticky fault: leak.
            return;
        }
        self.core.release_call("cuCtxSynchronize", |api| {
            // SAFETY: no arguments; the context is current (bound by `call`).
            unsafe { (api.cuCtxSynchronize)() }
        });
        if self.core.lost_code().is_some() {
            return;
        }
        // SAFETY: releases the retain taken in `Context::open`; nothing made in the context is
        // alive (every object holds an Arc to this value).
        let _ = unsafe { (self.core.api.cuDevicePrimaryCtxRelease_v2)(self.core.device) };
        let id = self.core.id;
        BOUND.with(|b| {
            if b.get() == id {
                b.set(0);
            }
        });
    }
}

/// The primary context of one device, bound per thread on first use.
///
/// Cheap to clone (shared). Every stream, event, module, buffer and graph made in it keeps it
/// alive, so it is released after them.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("ordinal", &self.inner.ordinal)
            .field("lost", &self.inner.lost_code())
            .finish()
    }
}

impl Context {
    /// Retains the primary context of device `ordinal` and makes it current on this thread.
    pub fn new(driver: Arc<Driver>, ordinal: i32) -> Result<Context, Error> {
        Context::open(driver, ordinal, None)
    }

    /// Like [`Context::new`], first setting the host scheduling policy. The driver ignores the
    /// policy on a context that is already active, so this must come first in the process.
    pub fn with_schedule(
        driver: Arc<Driver>,
        ordinal: i32,
        schedule: Schedule,
    ) -> Result<Context, Error> {
        Context::open(driver, ordinal, Some(schedule))
    }

    fn open(
        driver: Arc<Driver>,
        ordinal: i32,
        schedule: Option<Schedule>,
    ) -> Result<Context, Error> {
        let api = *driver.api();
        let device = device_of(&driver, ordinal)?;
        if let Some(s) = schedule {
            // SAFETY: plain value arguments; the device came from cuDeviceGet.
            let r = unsafe { (api.cuDevicePrimaryCtxSetFlags_v2)(device, s.flags()) };
            tf_sys::check(&*driver, "cuDevicePrimaryCtxSetFlags_v2", r)?;
        }
        let mut handle: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device came from cuDeviceGet.
        let r = unsafe { (api.cuDevicePrimaryCtxRetain)(&mut handle, device) };
        tf_sys::check(&*driver, "cuDevicePrimaryCtxRetain", r)?;
        let id = NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed);
        let core = Arc::new(ContextCore {
            driver,
            api,
            ordinal,
            device,
            handle,
            id,
            lost: AtomicI32::new(0),
        });
        copy::register_core(&core);
        let copy_id = match copy::hub().register_context(copy::CtxKey(id)) {
            Ok(copy_id) => copy_id,
            Err(e) => {
                copy::unregister_core(id);
                // SAFETY: undoes the retain above; nothing was made in the context.
                unsafe { (api.cuDevicePrimaryCtxRelease_v2)(device) };
                return Err(e.into());
            }
        };
        let inner = Arc::new(ContextInner { core, copy_id });
        // Dropping `inner` on failure releases the retain.
        inner.bind()?;
        Ok(Context { inner })
    }

    /// Sets the host scheduling policy of device `ordinal`'s primary context; must run before
    /// any context of that device is made (the driver ignores it on an active context).
    pub fn set_schedule(driver: &Driver, ordinal: i32, schedule: Schedule) -> Result<(), Error> {
        let device = device_of(driver, ordinal)?;
        // SAFETY: plain value arguments.
        let r = unsafe { (driver.api().cuDevicePrimaryCtxSetFlags_v2)(device, schedule.flags()) };
        tf_sys::check(driver, "cuDevicePrimaryCtxSetFlags_v2", r)?;
        Ok(())
    }

    /// The driver this context was opened on.
    pub fn driver(&self) -> &Arc<Driver> {
        self.inner.driver()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.ordinal
    }

    /// True when `other` is this context (a clone, or the context of a stream made in it). Two
    /// `Context::new` calls on one device give two contexts here, though the driver hands both the
    /// device's primary context: a stream of one is refused with buffers and libraries of the other.
    pub fn same_as(&self, other: &Context) -> bool {
        self.inner.id() == other.inner.id()
    }

    /// The raw `CUcontext` (for libraries such as cuBLASLt that take it).
    pub fn raw(&self) -> CUcontext {
        self.inner.handle
    }

    /// Makes this context current on the calling thread (done automatically by every call;
    /// useful before handing the thread to a library that calls the driver itself).
    pub fn make_current(&self) -> Result<(), Error> {
        self.inner.ensure_healthy("cuCtxSetCurrent")?;
        // Force the call even if this thread believes it is bound: a library may have changed it.
        BOUND.with(|b| b.set(0));
        self.inner.bind()?;
        Ok(())
    }

    /// Waits for all work in the context.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.inner.call("cuCtxSynchronize", |api| {
            // SAFETY: no arguments; the context is current.
            unsafe { (api.cuCtxSynchronize)() }
        })?;
        Ok(())
    }

    /// True once a sticky fault was seen; every later call fails with `ContextLost`.
    pub fn is_lost(&self) -> bool {
        self.inner.lost_code().is_some()
    }

    /// The sticky code that lost the context, if any.
    pub fn lost_code(&self) -> Option<i32> {
        self.inner.lost_code()
    }

    /// Fails with `ContextLost` when the context is lost.
    pub fn ensure_healthy(&self) -> Result<(), Error> {
        self.inner.ensure_healthy("health check")?;
        Ok(())
    }

    /// Free and total device memory.
    pub fn memory_info(&self) -> Result<MemoryInfo, Error> {
        let mut free = 0usize;
        let mut total = 0usize;
        self.inner.call("cuMemGetInfo_v2", |api| {
            // SAFETY: out-pointers to locals.
            unsafe { (api.cuMemGetInfo_v2)(&mut free, &mut total) }
        })?;
        Ok(MemoryInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    /// A device attribute (`CUdevice_attribute`, see `tf_sys::device_attribute`).
    pub fn attribute(&self, attribute: c_int) -> Result<i32, Error> {
        let mut value = 0;
        self.inner.call("cuDeviceGetAttribute", |api| {
            // SAFETY: out-pointer to a local; device handle from cuDeviceGet.
            unsafe { (api.cuDeviceGetAttribute)(&mut value, attribute, self.inner.device) }
        })?;
        Ok(value)
    }

    /// Device facts: name, compute capability, SM count, total memory.
    pub fn device_info(&self) -> Result<DeviceInfo, Error> {
        self.inner.ensure_healthy("device_info")?;
        DeviceInfo::query(&self.inner.driver, self.inner.ordinal)
    }

    /// `(least, greatest)` stream priorities; lower numbers run first, so `greatest` is the
    /// most urgent (numerically smallest).
    pub fn stream_priority_range(&self) -> Result<(i32, i32), Error> {
        let mut least = 0;
        let mut greatest = 0;
        self.inner.call("cuCtxGetStreamPriorityRange", |api| {
            // SAFETY: out-pointers to locals.
            unsafe { (api.cuCtxGetStreamPriorityRange)(&mut least, &mut greatest) }
        })?;
        Ok((least, greatest))
    }
}

fn device_of(driver: &Driver, ordinal: i32) -> Result<CUdevice, Error> {
    if ordinal < 0 {
        return Err(Error::invalid(format!(
            "device ordinal {ordinal} is negative; ordinals count from 0"
        )));
    }
    let mut device: CUdevice = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { (driver.api().cuDeviceGet)(&mut device, ordinal) };
    tf_sys::check(driver, "cuDeviceGet", r)?;
    Ok(device)
}

/// What the driver says about a device, read without creating a context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100/H200.
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub total_memory: u64,
    /// Dynamic shared memory a block may opt in to.
    pub max_shared_per_block_optin: i32,
}

impl DeviceInfo {
    /// Queries device `ordinal` through `driver` (no context needed).
    pub fn query(driver: &Driver, ordinal: i32) -> Result<DeviceInfo, Error> {
        let api = driver.api();
        let device = device_of(driver, ordinal)?;
        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer holds 256 bytes and its length is passed.
        let r = unsafe { (api.cuDeviceGetName)(name_buf.as_mut_ptr(), 256, device) };
        tf_sys::check(driver, "cuDeviceGetName", r)?;
        // Force termination in case the driver filled the buffer.
        name_buf[255] = 0;
        // SAFETY: NUL-terminated within the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let attr = |a: c_int, call: &'static str| -> Result<i32, Error> {
            let mut v = 0;
            // SAFETY: out-pointer to a local.
            let r = unsafe { (api.cuDeviceGetAttribute)(&mut v, a, device) };
            tf_sys::check(driver, call, r)?;
            Ok(v)
        };
        use tf_sys::device_attribute as da;
        let major = attr(da::COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute")?;
        let minor = attr(da::COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute")?;
        let sm_count = attr(da::MULTIPROCESSOR_COUNT, "cuDeviceGetAttribute")?;
        let optin = attr(
            da::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "cuDeviceGetAttribute",
        )?;
        let mut total = 0usize;
        // SAFETY: out-pointer to a local.
        let r = unsafe { (api.cuDeviceTotalMem_v2)(&mut total, device) };
        tf_sys::check(driver, "cuDeviceTotalMem_v2", r)?;
        Ok(DeviceInfo {
            ordinal,
            name,
            compute_capability: (major, minor),
            sm_count,
            total_memory: total as u64,
            max_shared_per_block_optin: optin,
        })
    }
}
