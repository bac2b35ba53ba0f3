//! tf-testdriver: a fake CUDA driver library over host memory, for tests without a GPU.
//!
//! Built as a `cdylib` that exports every entry of tf-sys's table ([`tf_sys::ENTRIES`]) under its
//! exact name and C signature (checked at compile time), the entry points the runtime looks up by
//! name outside that table ([`UNPINNED_ENTRIES`]), plus control functions (`tftd_*`) for
//! configuration, fault injection and counters. The `rlib` half holds the helpers tests use:
//! [`library_path`], [`Control`], [`test_lock`], [`patched_copy`] and [`module_image`].
//!
//! # Finding the library from a test
//!
//! Add `tf-testdriver = { path = "../tf-testdriver" }` to the crate's `[dev-dependencies]`. Cargo
//! then builds this crate with both of its crate types, so `libtf_testdriver.so` lands in
//! `target/<profile>/deps/`, the directory of the test executables. [`library_path`] looks there
//! (and in its parent), after the `TF_TESTDRIVER_LIB` variable if set. Plain
//! `cargo test --workspace` on a clean clone works with no extra step.
//!
//! # Semantics (deterministic, single process-wide state)
//!
//! - Device memory is host heap memory: device pointers are host addresses, allocations are
//!   256-byte aligned and filled with `0xA5` ([`FRESH_DEVICE_BYTE`]; blocks over [`FILL_LIMIT`] are
//!   zeroed instead, so large allocations cost no RAM until touched) so reads of unwritten memory
//!   stand out. Pinned host allocations are zeroed. `cuMemGetInfo_v2` reports the capacity ([`DEFAULT_DEVICE_CAPACITY`], settable);
//!   allocations past it fail with `CUDA_ERROR_OUT_OF_MEMORY`. Device-side ranges of copies and
//!   memsets must lie inside live allocations, pinned host memory or registered ranges.
//! - Calls need `cuInit` (else 3) and, for context-bound calls, a current context (else 201). The
//!   current context is per thread, like the real driver.
//! - Streams are queues. Asynchronous work runs, in order, at `cuStreamSynchronize`,
//!   `cuEventSynchronize`, `cuCtxSynchronize`, a synchronous copy/memset (default and blocking
//!   streams), a free (`cuMemFree_v2` etc. wait for all work, as the real driver does), or
//!   `cuStreamDestroy_v2`. Queries: after work is queued on an idle stream, the first query
//!   (`cuStreamQuery`, or `cuEventQuery` on a pending event) answers `CUDA_ERROR_NOT_READY` (600)
//!   and runs nothing; the next query runs the work and answers its result. The number of
//!   not-ready answers is `tftd_set_query_delay` (default 1). Asynchronous copies read their host
//!   source when they run, not when queued, exactly the hazard tf-copysource guards against.
//! - Events record a marker; they complete when the marker runs. Time is virtual (1 µs per
//!   operation, 10 µs per kernel), so `cuEventElapsedTime` is deterministic.
//! - Stream capture (not on the default stream) records kernels, copies and memsets into a graph
//!   instead of running them; `cuGraphInstantiateWithFlags` snapshots it and `cuGraphLaunch`
//!   queues its nodes in order. Nodes run in insertion order (dependencies are validated, not
//!   used). While a global or thread-local capture is active, synchronous copies/memsets,
//!   `cuMemAlloc_v2` and `cuCtxSynchronize` answer 900 and invalidate it; a synchronize or query
//!   of the capturing stream too; `cuStreamEndCapture` then answers 901. Relaxed mode allows them.
//!   `cuGraphExecUpdate_v2` accepts graphs with the same node kinds and kernels, else 910.
//! - Sticky faults: once a sticky code (per [`tf_sys::result::is_sticky`]) is raised, by a kernel
//!   or by injection, every later call answers it (except `cuGetErrorName`, `cuGetErrorString` and
//!   `cuDriverGetVersion`), as with the real driver, until `tftd_reset`.
//!
//! # The fake module image format
//!
//! A NUL-terminated text (what `cuModuleLoadData` receives): the first line is
//! [`MODULE_MAGIC`] (`TFTD-MODULE 1`), then one directive per line: `kernel <name>` (one of the
//! built-in kernels), `global <name> <bytes>` (a zeroed module global for `cuModuleGetGlobal_v2`),
//! `jit-error <text>` (loading fails with 218 and `cuModuleLoadDataEx` writes the text into the
//! JIT error log buffer). Blank lines and `#` comments are ignored; anything else, or an image
//! that does not start with the magic, is `CUDA_ERROR_INVALID_IMAGE` (200). Build one with
//! [`module_image`] / [`module_image_with`].
//!
//! Built-in kernels (parameters in order, C layout; grid and block are validated, then the kernel
//! runs over all `n` elements at once):
//! - `fill_u32(u32* ptr, u32 value, u64 n)`: `ptr[i] = value`.
//! - `add_f32(const f32* a, const f32* b, f32* out, u64 n)`: `out[i] = a[i] + b[i]`.
//! - `scale_f32(f32* ptr, f32 factor, u64 n)`: `ptr[i] *= factor`.
//! - `write_oob(u32* ptr)`: writes just past the end of the allocation holding `ptr`: sticky
//!   `CUDA_ERROR_ILLEGAL_ADDRESS` (700) when it runs.
//! - `trap()`: a device-side assert, sticky `CUDA_ERROR_ASSERT` (710) when it runs.
//!
//! Any kernel touching memory outside live allocations faults with 700 (sticky).
//!
//! # Control functions (exported C symbols; [`Control`] wraps them)
//!
//! `tftd_reset()`, `tftd_fail_init(code)`, `tftd_fail_call(name, nth, code, times)`,
//! `tftd_fault_next_launch(stream, code)`, `tftd_set_device_capacity(bytes)`,
//! `tftd_set_device_count(n)`, `tftd_set_driver_version(v)`, `tftd_set_query_delay(n)`,
//! `tftd_call_count(name)`, `tftd_counter(name)` (names in [`COUNTER_NAMES`]),
//! `tftd_sticky_code()`.
//!
//! ```no_run
//! let _serial = tf_testdriver::test_lock();
//! let control = tf_testdriver::Control::open()?;
//! control.reset();
//! control.fail_call("cuGraphInstantiateWithFlags", 1, 800, 1);
//! let driver = tf_sys::Driver::open_path(&tf_testdriver::library_path()?)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// Entry points exported beside tf-sys's table, which the runtime looks up by name (`fail_call` takes them too):
/// `cuTensorMapEncodeTiled` checks its arguments as the driver does and writes a digest of them.
pub const UNPINNED_ENTRIES: &[&str] = &["cuTensorMapEncodeTiled"];

mod control;
mod exports;
pub mod kernels;
mod state;

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

pub use kernels::{kernel_names, module_image, module_image_with, MODULE_MAGIC};
pub use state::{
    COUNTER_NAMES, DEFAULT_DEVICE_CAPACITY, DEFAULT_DRIVER_VERSION, FILL_LIMIT, FRESH_DEVICE_BYTE,
};
use tf_sys::types::{CUresult, CUstream};

/// Environment variable that overrides where [`library_path`] looks.
pub const LIBRARY_ENV: &str = "TF_TESTDRIVER_LIB";

/// The library's file name on this platform (`libtf_testdriver.so`).
pub fn library_file_name() -> String {
    format!(
        "{}tf_testdriver{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// Why the test driver library was not found or could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum TestDriverError {
    #[error("the test driver library {file} was not found; looked in: {}; add `tf-testdriver` to the crate's [dev-dependencies] (cargo then builds it next to the tests) or set {LIBRARY_ENV}", .searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    NotFound {
        file: String,
        searched: Vec<PathBuf>,
    },
    #[error("could not open the test driver library {path}: {reason}")]
    Open { path: PathBuf, reason: String },
    #[error("could not prepare a copy of the test driver at {path}: {reason}")]
    Copy { path: PathBuf, reason: String },
    #[error("symbol {name} does not occur in {path}; nothing was renamed")]
    SymbolNotFound { name: String, path: PathBuf },
}

/// Where the built test driver library is: `TF_TESTDRIVER_LIB` if set, else next to the running
/// test executable (`target/<profile>/deps/`) or one directory up.
pub fn library_path() -> Result<PathBuf, TestDriverError> {
    let file = library_file_name();
    let mut searched = Vec::new();
    if let Some(explicit) = std::env::var_os(LIBRARY_ENV).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(explicit);
        if path.is_file() {
            return Ok(path);
        }
        searched.push(path);
    }
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(2) {
            let candidate = dir.join(&file);
            if candidate.is_file() {
                return Ok(candidate);
            }
            searched.push(candidate);
        }
    }
    Err(TestDriverError::NotFound { file, searched })
}

/// Serialises tests that use the test driver's process-wide state (hold the guard for the whole
/// test). Tolerates poisoning: a failed test does not fail the others.
pub fn test_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The control functions of a loaded test driver.
pub struct Control {
    fns: ControlFns,
    path: PathBuf,
    _library: libloading::Library,
}

#[derive(Clone, Copy)]
struct ControlFns {
    reset: extern "C" fn(),
    fail_init: extern "C" fn(CUresult),
    fail_call: unsafe extern "C" fn(*const c_char, u64, CUresult, u64) -> c_int,
    fault_next_launch: extern "C" fn(CUstream, CUresult),
    set_device_capacity: extern "C" fn(u64),
    set_device_count: extern "C" fn(c_int),
    set_driver_version: extern "C" fn(c_int),
    set_query_delay: extern "C" fn(u32),
    call_count: unsafe extern "C" fn(*const c_char) -> u64,
    counter: unsafe extern "C" fn(*const c_char) -> i64,
    sticky_code: extern "C" fn() -> CUresult,
}

macro_rules! control_symbol {
    ($lib:expr, $path:expr, $name:literal) => {
        // SAFETY: the symbol is one of this crate's own exports, with the type declared in ControlFns.
        match unsafe { $lib.get(concat!($name, "\0").as_bytes()) } {
            Ok(symbol) => *symbol,
            Err(err) => return Err(TestDriverError::Open { path: $path.to_path_buf(), reason: format!("{}: {err}", $name) }),
        }
    };
}

impl Control {
    /// Opens the test driver at [`library_path`]. The same loaded instance (and state) as a
    /// `tf_sys::Driver` opened from the same path.
    pub fn open() -> Result<Control, TestDriverError> {
        Control::open_path(&library_path()?)
    }

    /// Opens the test driver at `path`.
    pub fn open_path(path: &Path) -> Result<Control, TestDriverError> {
        // SAFETY: the test driver's initialisers are Rust's own; loading it has no other effect.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| TestDriverError::Open {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let fns = ControlFns {
            reset: control_symbol!(library, path, "tftd_reset"),
            fail_init: control_symbol!(library, path, "tftd_fail_init"),
            fail_call: control_symbol!(library, path, "tftd_fail_call"),
            fault_next_launch: control_symbol!(library, path, "tftd_fault_next_launch"),
            set_device_capacity: control_symbol!(library, path, "tftd_set_device_capacity"),
            set_device_count: control_symbol!(library, path, "tftd_set_device_count"),
            set_driver_version: control_symbol!(library, path, "tftd_set_driver_version"),
            set_query_delay: control_symbol!(library, path, "tftd_set_query_delay"),
            call_count: control_symbol!(library, path, "tftd_call_count"),
            counter: control_symbol!(library, path, "tftd_counter"),
            sticky_code: control_symbol!(library, path, "tftd_sticky_code"),
        };
        Ok(Control {
            fns,
            path: path.to_path_buf(),
            _library: library,
        })
    }

    /// The path this control was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Frees everything; back to a fresh, uninitialised driver with no faults.
    pub fn reset(&self) {
        (self.fns.reset)()
    }

    /// Every later `cuInit` fails with `code` (0 lifts it).
    pub fn fail_init(&self, code: CUresult) {
        (self.fns.fail_init)(code)
    }

    /// Fails calls `nth .. nth + times` (1-based, from now) of entry `name` with `code`
    /// (`times == 0`: every call from the nth on). Returns false for a name not in the table.
    pub fn fail_call(&self, name: &str, nth: u64, code: CUresult, times: u64) -> bool {
        let Ok(name) = CString::new(name) else {
            return false;
        };
        // SAFETY: `name` is NUL-terminated and outlives the call.
        unsafe { (self.fns.fail_call)(name.as_ptr(), nth, code, times) == 0 }
    }

    /// The next kernel launched on `stream` (null: any stream) fails with `code` when it runs.
    pub fn fault_next_launch(&self, stream: CUstream, code: CUresult) {
        (self.fns.fault_next_launch)(stream, code)
    }

    pub fn set_device_capacity(&self, bytes: u64) {
        (self.fns.set_device_capacity)(bytes)
    }

    pub fn set_device_count(&self, count: c_int) {
        (self.fns.set_device_count)(count)
    }

    pub fn set_driver_version(&self, version: c_int) {
        (self.fns.set_driver_version)(version)
    }

    /// How many queries answer not-ready before they run queued work (default 1).
    pub fn set_query_delay(&self, queries: u32) {
        (self.fns.set_query_delay)(queries)
    }

    /// Calls of entry `name` since the last reset.
    pub fn call_count(&self, name: &str) -> u64 {
        let Ok(name) = CString::new(name) else {
            return 0;
        };
        // SAFETY: `name` is NUL-terminated and outlives the call.
        unsafe { (self.fns.call_count)(name.as_ptr()) }
    }

    /// A counter from [`COUNTER_NAMES`] (`None` for an unknown name).
    pub fn counter(&self, name: &str) -> Option<i64> {
        let name = CString::new(name).ok()?;
        // SAFETY: `name` is NUL-terminated and outlives the call.
        let v = unsafe { (self.fns.counter)(name.as_ptr()) };
        (v >= 0).then_some(v)
    }

    /// The sticky code every call answers now, if any.
    pub fn sticky_code(&self) -> Option<CUresult> {
        let c = (self.fns.sticky_code)();
        (c != 0).then_some(c)
    }
}

/// Copies the test driver into a fresh directory under the system temp dir, renaming each symbol
/// in `hide` (every exact occurrence of the NUL-delimited name in the file, in particular in the
/// dynamic string table, replaced by a same-length name with its last letter changed), so
/// `dlsym` no longer finds it. The copy has its own state (a different file is a different
/// library to the loader). Used by the "missing symbol" loader tests. The directory is removed
/// when the returned [`PatchedCopy`] drops (a loaded library stays mapped).
pub fn patched_copy(hide: &[&str]) -> Result<PatchedCopy, TestDriverError> {
    let source = library_path()?;
    let mut bytes = std::fs::read(&source).map_err(|e| TestDriverError::Copy {
        path: source.clone(),
        reason: e.to_string(),
    })?;
    for name in hide {
        let target = name.as_bytes();
        let Some((&last, stem)) = target.split_last() else {
            return Err(TestDriverError::SymbolNotFound {
                name: name.to_string(),
                path: source,
            });
        };
        let renamed_last = if last == b'X' { b'Y' } else { b'X' };
        // One pass over the NUL-separated segments: a segment equal to the name is an exact,
        // NUL-delimited occurrence (string tables hold names that way).
        let mut offsets = Vec::new();
        let mut offset = 0usize;
        for segment in bytes.split(|b| *b == 0) {
            if segment.len() == target.len()
                && segment.starts_with(stem)
                && segment.last() == Some(&last)
            {
                offsets.push(offset + segment.len() - 1);
            }
            offset += segment.len() + 1;
        }
        for at in &offsets {
            if let Some(byte) = bytes.get_mut(*at) {
                *byte = renamed_last;
            }
        }
        let found = !offsets.is_empty();
        if !found {
            return Err(TestDriverError::SymbolNotFound {
                name: name.to_string(),
                path: source,
            });
        }
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tf-testdriver-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| TestDriverError::Copy {
        path: dir.clone(),
        reason: e.to_string(),
    })?;
    let path = dir.join(library_file_name());
    std::fs::write(&path, &bytes).map_err(|e| TestDriverError::Copy {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    Ok(PatchedCopy { path, dir })
}

/// A patched copy of the test driver in its own temporary directory (removed on drop).
#[derive(Debug)]
pub struct PatchedCopy {
    path: PathBuf,
    dir: PathBuf,
}

impl PatchedCopy {
    /// The copy's path, for `tf_sys::Driver::open_path`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PatchedCopy {
    fn drop(&mut self) {
        // Best effort: a leftover temp directory is harmless.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
