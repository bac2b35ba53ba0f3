//! Finding, opening and initialising the driver library.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::api::Api;
use crate::error::{check, DescribeResult, Error};
use crate::result::{known_description, known_name, shutdown_note, UNKNOWN_CODE_NAME};
use crate::types::CUresult;

/// Environment variable naming the driver library explicitly (a full path).
pub const DRIVER_ENV: &str = "TF_CUDA_DRIVER";

/// Library names tried, in order, when [`DRIVER_ENV`] is not set.
#[cfg(not(windows))]
pub const DEFAULT_CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];
/// Library names tried, in order, when [`DRIVER_ENV`] is not set.
#[cfg(windows)]
pub const DEFAULT_CANDIDATES: &[&str] = &["nvcuda.dll"];

/// One library the loader tried to open, and why that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenAttempt {
    pub path: PathBuf,
    pub reason: String,
}

/// Where the tried paths came from (changes the advice in the message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathSource {
    /// The [`DRIVER_ENV`] variable.
    Environment,
    /// The default names ([`DEFAULT_CANDIDATES`]).
    Defaults,
    /// A path given by the caller ([`Driver::open_path`]).
    Caller,
}

/// Why the driver library could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// No library could be opened.
    #[error("{}", not_found_message(.source_of_paths, .attempts))]
    NotFound {
        source_of_paths: PathSource,
        attempts: Vec<OpenAttempt>,
    },
    /// The library opened but lacks required entry points (all of them are listed).
    #[error("{} lacks required CUDA driver entry points: {}; it is older than CUDA 12.0 or not NVIDIA's libcuda: update the NVIDIA driver (or point {DRIVER_ENV} at the right library)", .path.display(), .names.join(", "))]
    MissingSymbols {
        path: PathBuf,
        names: Vec<&'static str>,
    },
    /// `cuInit(0)` returned an error.
    #[error("cuInit(0) in {} failed: {name} ({code}) {text}{note}; check that `nvidia-smi` sees a GPU and that this process may use it (container: GPUs passed through, CUDA_VISIBLE_DEVICES not empty)", .path.display(), note = shutdown_note(*.code))]
    InitFailed {
        path: PathBuf,
        code: CUresult,
        name: String,
        text: String,
    },
}

fn not_found_message(source: &PathSource, attempts: &[OpenAttempt]) -> String {
    let tried = attempts
        .iter()
        .map(|a| format!("{} ({})", a.path.display(), a.reason))
        .collect::<Vec<_>>()
        .join("; ");
    let advice = match source {
        PathSource::Environment => format!(
            "fix or unset {DRIVER_ENV} (it must name the NVIDIA driver library, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1)"
        ),
        PathSource::Defaults => format!(
            "is the NVIDIA driver installed and, in a container, mounted (e.g. --gpus all with the NVIDIA container toolkit)? Or set {DRIVER_ENV} to the library's full path"
        ),
        PathSource::Caller => "check the path".to_string(),
    };
    format!("the CUDA driver library could not be opened; tried: {tried}; {advice}")
}

/// The loaded driver library and its entry-point table.
///
/// The library stays loaded as long as the `Driver` lives, so the table's function pointers stay
/// valid for that long. `Driver` is `Send + Sync`; the driver itself is thread-safe.
pub struct Driver {
    // Field order: `api` is dropped before `library`, which unloads the code it points into.
    api: Api,
    path: PathBuf,
    library: libloading::Library,
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Driver>();
};

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

type InitFn = unsafe extern "C" fn(c_uint) -> CUresult;
type ErrorTextFn = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;

impl Driver {
    /// Opens the driver: the path in `TF_CUDA_DRIVER` if set (only that path: an explicit choice
    /// is never silently replaced by another library), else `libcuda.so.1`, then `libcuda.so`
    /// (`nvcuda.dll` on Windows).
    pub fn open() -> Result<Driver, LoadError> {
        match std::env::var_os(DRIVER_ENV).filter(|v| !v.is_empty()) {
            Some(explicit) => Self::open_from(&[PathBuf::from(explicit)], PathSource::Environment),
            None => {
                let names: Vec<PathBuf> = DEFAULT_CANDIDATES.iter().map(PathBuf::from).collect();
                Self::open_from(&names, PathSource::Defaults)
            }
        }
    }

    /// Opens the driver library at `path` (a full path, or a bare name the system loader searches).
    pub fn open_path(path: &Path) -> Result<Driver, LoadError> {
        Self::open_from(&[path.to_path_buf()], PathSource::Caller)
    }

    fn open_from(paths: &[PathBuf], source: PathSource) -> Result<Driver, LoadError> {
        let mut attempts = Vec::new();
        for path in paths {
            // SAFETY: loading a library runs its initialisers; the driver library's are sound,
            // and a library named by the user is the user's choice.
            match unsafe { libloading::Library::new(path) } {
                Ok(library) => return Self::initialise(library, path.clone()),
                Err(err) => attempts.push(OpenAttempt {
                    path: path.clone(),
                    reason: err.to_string(),
                }),
            }
        }
        Err(LoadError::NotFound {
            source_of_paths: source,
            attempts,
        })
    }

    /// Resolves cuInit and the error-text entries, calls `cuInit(0)`, then resolves the table (so a
    /// profiler injected by cuInit is in place before the rest is resolved).
    fn initialise(library: libloading::Library, path: PathBuf) -> Result<Driver, LoadError> {
        // SAFETY: the types are cuInit's, cuGetErrorName's and cuGetErrorString's from cuda.h.
        let init = unsafe { library.get::<InitFn>(b"cuInit\0") }.map(|s| *s);
        // SAFETY: as above.
        let name = unsafe { library.get::<ErrorTextFn>(b"cuGetErrorName\0") }.map(|s| *s);
        // SAFETY: as above.
        let text = unsafe { library.get::<ErrorTextFn>(b"cuGetErrorString\0") }.map(|s| *s);
        let (init, name, text) = match (init, name, text) {
            (Ok(init), Ok(name), Ok(text)) => (init, name, text),
            (init, name, text) => {
                // Without these the library is unusable; list everything it lacks in one report.
                let names = match Api::resolve(&library) {
                    Err(missing) => missing,
                    Ok(_) => [
                        ("cuInit", init.is_err()),
                        ("cuGetErrorName", name.is_err()),
                        ("cuGetErrorString", text.is_err()),
                    ]
                    .into_iter()
                    .filter_map(|(n, absent)| absent.then_some(n))
                    .collect(),
                };
                return Err(LoadError::MissingSymbols { path, names });
            }
        };
        // SAFETY: cuInit takes flags (must be 0) and has no other preconditions.
        let result = unsafe { init(0) };
        if result != 0 {
            return Err(LoadError::InitFailed {
                code: result,
                name: name_via(name, result),
                text: text_via(text, result),
                path,
            });
        }
        match Api::resolve(&library) {
            Ok(api) => Ok(Driver { api, path, library }),
            Err(names) => Err(LoadError::MissingSymbols { path, names }),
        }
    }

    /// The entry-point table.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// The table, for patching entries (see [`crate::memcap::install`]).
    pub fn api_mut(&mut self) -> &mut Api {
        &mut self.api
    }

    /// The path (or name) the library was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The underlying library, for looking up entries outside the table (e.g. VMM calls).
    pub fn library(&self) -> &libloading::Library {
        &self.library
    }

    /// The driver's CUDA version, `1000 * major + 10 * minor` (13.0 -> 13000).
    pub fn version(&self) -> Result<i32, Error> {
        let mut version: c_int = 0;
        // SAFETY: the out-pointer is valid for the call.
        let r = unsafe { (self.api.cuDriverGetVersion)(&mut version) };
        check(self, "cuDriverGetVersion", r)?;
        Ok(version)
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count(&self) -> Result<i32, Error> {
        let mut count: c_int = 0;
        // SAFETY: the out-pointer is valid for the call.
        let r = unsafe { (self.api.cuDeviceGetCount)(&mut count) };
        check(self, "cuDeviceGetCount", r)?;
        Ok(count)
    }

    /// The code's `CUDA_ERROR_*` name: the driver's, else the built-in table's, else
    /// `CUDA_ERROR_UNKNOWN_CODE` (during exit's teardown the driver cannot answer).
    pub fn error_name(&self, result: CUresult) -> String {
        self.api.error_name(result)
    }

    /// The driver's description of the code, else the built-in one, else empty.
    pub fn error_text(&self, result: CUresult) -> String {
        self.api.error_text(result)
    }
}

fn string_via(f: ErrorTextFn, result: CUresult) -> Option<String> {
    let mut ptr: *const c_char = std::ptr::null();
    // SAFETY: the out-pointer is valid; the driver stores a pointer to a static string or fails.
    let r = unsafe { f(result, &mut ptr) };
    if r != 0 || ptr.is_null() {
        return None;
    }
    // SAFETY: on success the driver returned a NUL-terminated static string.
    let text = unsafe { CStr::from_ptr(ptr) };
    Some(text.to_string_lossy().into_owned())
}

fn name_via(f: ErrorTextFn, result: CUresult) -> String {
    string_via(f, result)
        .or_else(|| known_name(result).map(str::to_string))
        .unwrap_or_else(|| UNKNOWN_CODE_NAME.to_string())
}

fn text_via(f: ErrorTextFn, result: CUresult) -> String {
    string_via(f, result)
        .or_else(|| known_description(result).map(str::to_string))
        .unwrap_or_default()
}

impl DescribeResult for Api {
    fn error_name(&self, result: CUresult) -> String {
        name_via(self.cuGetErrorName, result)
    }
    fn error_text(&self, result: CUresult) -> String {
        text_via(self.cuGetErrorString, result)
    }
}

impl DescribeResult for Driver {
    fn error_name(&self, result: CUresult) -> String {
        self.api.error_name(result)
    }
    fn error_text(&self, result: CUresult) -> String {
        self.api.error_text(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_lists_every_attempt() {
        let paths = [
            PathBuf::from("/nonexistent/tf-a/libcuda.so.1"),
            PathBuf::from("/nonexistent/tf-b/libcuda.so"),
        ];
        let err = Driver::open_from(&paths, PathSource::Defaults).unwrap_err();
        let LoadError::NotFound { attempts, .. } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(attempts.len(), 2);
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/tf-a/libcuda.so.1"), "{msg}");
        assert!(msg.contains("/nonexistent/tf-b/libcuda.so"), "{msg}");
        assert!(msg.contains("mounted"), "{msg}");
    }
}
