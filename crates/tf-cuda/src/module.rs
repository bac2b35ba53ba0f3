//! Loaded GPU code: modules (fatbin, cubin or PTX) and the kernels in them.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use tf_sys::{CUfunction, CUmodule};

use crate::context::{Context, ContextInner};
use crate::error::Error;
use crate::launch::DEFAULT_DYNAMIC_SHARED_LIMIT;

/// Bytes of each JIT log buffer.
const JIT_LOG_BYTES: usize = 16 * 1024;

struct ModuleInner {
    ctx: Arc<ContextInner>,
    handle: CUmodule,
}

// SAFETY: a CUmodule may be used from any thread; calls bind the context first.
unsafe impl Send for ModuleInner {}
// SAFETY: the handle is only read; the driver serializes module calls.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let m = self.handle;
        self.ctx.release_call("cuModuleUnload", |api| {
            // SAFETY: unloaded once, after every Function of it (they hold this value).
            unsafe { (api.cuModuleUnload)(m) }
        });
    }
}

/// Loaded GPU code. Cheap to clone; every [`Function`] keeps its module loaded.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Module")
            .field("handle", &self.inner.handle)
            .finish()
    }
}

fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(buf.get(..end).unwrap_or_default())
        .trim()
        .to_string()
}

impl Module {
    /// Loads a fatbin, cubin or PTX image (`cuModuleLoadDataEx`, with the JIT's error and info
    /// logs; a failure's error carries them).
    pub fn load(ctx: &Context, image: &[u8]) -> Result<Module, Error> {
        if image.is_empty() {
            return Err(Error::invalid(
                "empty GPU image: this build has no kernels; run `cargo xtask kernels` and rebuild",
            ));
        }
        // An 8-byte aligned private copy with a trailing NUL: fatbins need the alignment, PTX
        // text needs the terminator, and the caller's slice may be neither.
        let words = image.len().div_ceil(8) + 1;
        let mut aligned = vec![0u64; words];
        // SAFETY: `aligned` holds words * 8 > image.len() bytes; regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                image.as_ptr(),
                aligned.as_mut_ptr().cast::<u8>(),
                image.len(),
            )
        };
        let inner = Arc::clone(&ctx.inner);
        let mut error_log = vec![0u8; JIT_LOG_BYTES];
        let mut info_log = vec![0u8; JIT_LOG_BYTES];
        let mut options: [c_int; 4] = [
            tf_sys::flags::JIT_ERROR_LOG_BUFFER,
            tf_sys::flags::JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            tf_sys::flags::JIT_INFO_LOG_BUFFER,
            tf_sys::flags::JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        ];
        // The driver reads sizes passed by value in the pointer slot.
        let mut values: [*mut c_void; 4] = [
            error_log.as_mut_ptr().cast::<c_void>(),
            JIT_LOG_BYTES as *mut c_void,
            info_log.as_mut_ptr().cast::<c_void>(),
            JIT_LOG_BYTES as *mut c_void,
        ];
        let mut handle: CUmodule = std::ptr::null_mut();
        let result = inner.call("cuModuleLoadDataEx", |api| {
            // SAFETY: the image is a live, aligned, NUL-terminated copy; option and value arrays
            // hold 4 entries each; the log buffers outlive the call.
            unsafe {
                (api.cuModuleLoadDataEx)(
                    &mut handle,
                    aligned.as_ptr().cast::<c_void>(),
                    options.len() as c_uint,
                    options.as_mut_ptr(),
                    values.as_mut_ptr(),
                )
            }
        });
        match result {
            Ok(()) => Ok(Module {
                inner: Arc::new(ModuleInner { ctx: inner, handle }),
            }),
            Err(e @ tf_sys::Error::ContextLost { .. }) => Err(e.into()),
            Err(source) => {
                let errors = log_text(&error_log);
                let info = log_text(&info_log);
                let log = match (errors.is_empty(), info.is_empty()) {
                    (true, true) => "(empty)".to_string(),
                    (false, true) => errors,
                    (true, false) => info,
                    (false, false) => format!("{errors}\n{info}"),
                };
                Err(Error::ModuleLoad {
                    log,
                    source: Box::new(source),
                })
            }
        }
    }

    /// Loads PTX text (the driver JIT-compiles it for this GPU).
    pub fn load_ptx(ctx: &Context, ptx: &str) -> Result<Module, Error> {
        Module::load(ctx, ptx.as_bytes())
    }

    /// The raw `CUmodule`.
    pub fn raw(&self) -> CUmodule {
        self.inner.handle
    }

    fn lookup(&self, name: &str) -> Result<Result<CUfunction, tf_sys::Error>, Error> {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
        let mut f: CUfunction = std::ptr::null_mut();
        let m = self.inner.handle;
        let r = self.inner.ctx.call_raw("cuModuleGetFunction", |api| {
            // SAFETY: out-pointer to a local; `cname` is NUL-terminated and outlives the call.
            unsafe { (api.cuModuleGetFunction)(&mut f, m, cname.as_ptr()) }
        })?;
        Ok(self.inner.ctx.map("cuModuleGetFunction", r).map(|()| f))
    }

    /// The kernel `name` (its extern "C" symbol). A missing kernel's error names it.
    pub fn function(&self, name: &str) -> Result<Function, Error> {
        match self.lookup(name)? {
            Ok(handle) => Ok(Function {
                module: Arc::clone(&self.inner),
                handle,
                name: Arc::from(name),
                shared_limit: Arc::new(AtomicU32::new(DEFAULT_DYNAMIC_SHARED_LIMIT)),
            }),
            Err(source) => Err(Error::KernelNotFound {
                kernel: name.to_string(),
                source: Box::new(source),
            }),
        }
    }

    /// True when the module holds a kernel named `name` (false on any failure).
    pub fn holds(&self, name: &str) -> bool {
        matches!(self.lookup(name), Ok(Ok(_)))
    }

    /// A `__device__` global: its address and size.
    pub fn global(&self, name: &str) -> Result<(u64, usize), Error> {
        let cname = CString::new(name)
            .map_err(|_| Error::invalid(format!("global name {name:?} contains a NUL byte")))?;
        let (mut addr, mut len) = (0u64, 0usize);
        let m = self.inner.handle;
        self.inner.ctx.call("cuModuleGetGlobal_v2", |api| {
            // SAFETY: out-pointers to locals; the name outlives the call.
            unsafe { (api.cuModuleGetGlobal_v2)(&mut addr, &mut len, m, cname.as_ptr()) }
        })?;
        Ok((addr, len))
    }
}

/// A kernel in a loaded module. Cheap to clone; keeps its module loaded.
#[derive(Clone)]
pub struct Function {
    module: Arc<ModuleInner>,
    handle: CUfunction,
    name: Arc<str>,
    /// Dynamic shared memory this kernel may use (48 KiB until it opts in to more).
    shared_limit: Arc<AtomicU32>,
}

// SAFETY: a CUfunction may be used from any thread; calls bind the context first.
unsafe impl Send for Function {}
// SAFETY: the handle is only read; the limit is atomic.
unsafe impl Sync for Function {}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Function")
            .field("name", &self.name)
            .finish()
    }
}

/// Resource use of a compiled kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FunctionAttributes {
    pub registers: i32,
    pub local_bytes: i32,
    pub static_shared_bytes: i32,
    pub max_threads_per_block: i32,
}

impl Function {
    /// The name it was looked up with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw `CUfunction`.
    pub fn raw(&self) -> CUfunction {
        self.handle
    }

    pub(crate) fn context_id(&self) -> u64 {
        self.module.ctx.id()
    }

    /// The name the driver knows (`cuFuncGetName`, CUDA 12.3+), else the looked-up name.
    pub fn driver_name(&self) -> String {
        let Some(get_name) = self.module.ctx.driver().api().cuFuncGetName else {
            return self.name.to_string();
        };
        let mut ptr: *const c_char = std::ptr::null();
        let f = self.handle;
        let r = self.module.ctx.call_raw("cuFuncGetName", |_| {
            // SAFETY: out-pointer to a local; the function handle is live.
            unsafe { get_name(&mut ptr, f) }
        });
        match r {
            Ok(0) if !ptr.is_null() => {
                // SAFETY: the driver returns a NUL-terminated name owned by the module.
                unsafe { CStr::from_ptr(ptr) }
                    .to_string_lossy()
                    .into_owned()
            }
            _ => self.name.to_string(),
        }
    }

    /// A function attribute (`CUfunction_attribute`, see `tf_sys::function_attribute`).
    pub fn attribute(&self, attribute: c_int) -> Result<i32, Error> {
        let mut v = 0;
        let f = self.handle;
        self.module.ctx.call("cuFuncGetAttribute", |api| {
            // SAFETY: out-pointer to a local; the function handle is live.
            unsafe { (api.cuFuncGetAttribute)(&mut v, attribute, f) }
        })?;
        Ok(v)
    }

    /// Registers, local memory, static shared memory and the thread limit.
    pub fn attributes(&self) -> Result<FunctionAttributes, Error> {
        use tf_sys::function_attribute as fa;
        Ok(FunctionAttributes {
            registers: self.attribute(fa::NUM_REGS)?,
            local_bytes: self.attribute(fa::LOCAL_SIZE_BYTES)?,
            static_shared_bytes: self.attribute(fa::SHARED_SIZE_BYTES)?,
            max_threads_per_block: self.attribute(fa::MAX_THREADS_PER_BLOCK)?,
        })
    }

    /// Opts the kernel in to `bytes` of dynamic shared memory (needed above 48 KiB; the device
    /// caps it). Launches asking for more are refused before the driver.
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<(), Error> {
        let value = c_int::try_from(bytes).map_err(|_| {
            Error::invalid(format!(
                "{bytes} B of dynamic shared memory is not a valid size"
            ))
        })?;
        let f = self.handle;
        self.module.ctx.call("cuFuncSetAttribute", |api| {
            // SAFETY: plain value arguments; the function handle is live.
            unsafe {
                (api.cuFuncSetAttribute)(
                    f,
                    tf_sys::function_attribute::MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    value,
                )
            }
        })?;
        self.shared_limit.store(bytes, Ordering::Release);
        Ok(())
    }

    /// The dynamic shared memory launches of this kernel may ask for.
    pub fn dynamic_shared_limit(&self) -> u32 {
        self.shared_limit.load(Ordering::Acquire)
    }

    /// Active blocks per SM at `threads` per block and `shared_bytes` of dynamic shared memory.
    pub fn occupancy(&self, threads: u32, shared_bytes: usize) -> Result<u32, Error> {
        let threads = c_int::try_from(threads)
            .map_err(|_| Error::invalid(format!("{threads} threads is not a valid block size")))?;
        let mut blocks = 0;
        let f = self.handle;
        self.module
            .ctx
            .call("cuOccupancyMaxActiveBlocksPerMultiprocessor", |api| {
                // SAFETY: out-pointer to a local; the function handle is live.
                unsafe {
                    (api.cuOccupancyMaxActiveBlocksPerMultiprocessor)(
                        &mut blocks,
                        f,
                        threads,
                        shared_bytes,
                    )
                }
            })?;
        Ok(u32::try_from(blocks).unwrap_or(0))
    }
}
