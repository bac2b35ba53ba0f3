//! Finding and opening `libcublasLt` at run time.
//!
//! Search order (first that opens and exports every entry wins):
//! 1. `TF_CUBLASLT`: an explicit path. When set, it is the only candidate: a library other than
//!    the one asked for is never loaded silently.
//! 2. `$CUDA_HOME/lib64` and `$CUDA_HOME/targets/<arch>-linux/lib` (`.so.13`, then `.so.12`).
//! 3. The system loader's search (`libcublasLt.so.13`, then `.so.12`), then the toolkit's usual
//!    install places under `/usr/local/cuda`.
//!
//! A failure lists every candidate tried and why each was refused.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::ffi::LtApi;
use super::CublasLtError;

/// Environment variable naming the library file explicitly.
pub const ENV_PATH: &str = "TF_CUBLASLT";
/// The toolkit root searched before the system.
pub const ENV_CUDA_HOME: &str = "CUDA_HOME";
/// The oldest cuBLASLt major version accepted (FP8 scales and bias types need 12.x).
pub const MIN_MAJOR_VERSION: usize = 12;

#[cfg(not(windows))]
const FILE_NAMES: &[&str] = &["libcublasLt.so.13", "libcublasLt.so.12"];
#[cfg(windows)]
const FILE_NAMES: &[&str] = &["cublasLt64_13.dll", "cublasLt64_12.dll"];

/// One place the loader looked, and why it was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// A path, or a bare file name handed to the system loader.
    pub candidate: PathBuf,
    pub reason: String,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.candidate.display(), self.reason)
    }
}

/// The directory name of the toolkit's per-target libraries on this architecture.
fn target_dir_name() -> &'static str {
    match std::env::consts::ARCH {
        "aarch64" => "sbsa-linux",
        _ => "x86_64-linux",
    }
}

/// The candidates in search order, from the given environment lookup (pure: no file access).
pub fn candidates(env: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    if let Some(explicit) = env(ENV_PATH).filter(|v| !v.is_empty()) {
        return vec![PathBuf::from(explicit)];
    }
    let mut out = Vec::new();
    if let Some(home) = env(ENV_CUDA_HOME).filter(|v| !v.is_empty()) {
        let home = PathBuf::from(home);
        for dir in [
            home.join("lib64"),
            home.join("targets").join(target_dir_name()).join("lib"),
        ] {
            for name in FILE_NAMES {
                out.push(dir.join(name));
            }
        }
    }
    for name in FILE_NAMES {
        out.push(PathBuf::from(name));
    }
    if cfg!(not(windows)) {
        let root = Path::new("/usr/local/cuda");
        for dir in [
            root.join("targets").join(target_dir_name()).join("lib"),
            root.join("lib64"),
        ] {
            for name in FILE_NAMES {
                out.push(dir.join(name));
            }
        }
    }
    out
}

/// An opened cuBLASLt: the library, its resolved entries and its version.
///
/// Shared by every [`super::CublasLt`] handle made from it; the library stays loaded while any
/// of them lives.
pub struct LtLibrary {
    api: LtApi,
    path: PathBuf,
    version: usize,
    // Last: the entry points above point into it.
    _lib: libloading::Library,
}

impl fmt::Debug for LtLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LtLibrary")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl LtLibrary {
    /// Searches `TF_CUBLASLT`, `CUDA_HOME`, then the system (see the module doc).
    pub fn open() -> Result<Arc<LtLibrary>, CublasLtError> {
        Self::open_first(&candidates(|k| std::env::var_os(k)))
    }

    /// Opens exactly `path`.
    pub fn open_path(path: &Path) -> Result<Arc<LtLibrary>, CublasLtError> {
        Self::open_first(&[path.to_path_buf()])
    }

    /// Tries `candidates` in order; the error lists every attempt.
    pub fn open_first(candidates: &[PathBuf]) -> Result<Arc<LtLibrary>, CublasLtError> {
        let mut tried = Vec::with_capacity(candidates.len());
        for candidate in candidates {
            match Self::open_one(candidate) {
                Ok(lib) => return Ok(Arc::new(lib)),
                Err(reason) => tried.push(Attempt {
                    candidate: candidate.clone(),
                    reason,
                }),
            }
        }
        Err(CublasLtError::LibraryNotFound { tried })
    }

    fn open_one(candidate: &Path) -> Result<LtLibrary, String> {
        // SAFETY: loading runs the library's initialisers; cuBLASLt's only set up its own state.
        let lib = unsafe { libloading::Library::new(candidate) }.map_err(|e| e.to_string())?;
        let api = LtApi::resolve(&lib)
            .map_err(|missing| format!("not cuBLASLt: missing symbols {}", missing.join(", ")))?;
        // SAFETY: `cublasLtGetVersion` takes no arguments and only returns a number.
        let version = unsafe { (api.cublasLtGetVersion)() };
        let major = version / 10_000;
        if major < MIN_MAJOR_VERSION {
            return Err(format!(
                "version {version} is older than {MIN_MAJOR_VERSION}.0 (FP8 scales and bias types need it)"
            ));
        }
        Ok(LtLibrary {
            api,
            path: candidate.to_path_buf(),
            version,
            _lib: lib,
        })
    }

    pub(crate) fn api(&self) -> &LtApi {
        &self.api
    }

    /// The path (or bare name) the library was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `cublasLtGetVersion()`: major * 10000 + minor * 100 + patch.
    pub fn version(&self) -> usize {
        self.version
    }

    /// The library's own text for a status code.
    pub fn status_text(&self, code: super::ffi::Status) -> String {
        // SAFETY: the function returns a pointer to a static NUL-terminated string (or null).
        let ptr = unsafe { (self.api.cublasLtGetStatusString)(code) };
        if ptr.is_null() {
            return String::from("(no description)");
        }
        // SAFETY: non-null, NUL-terminated, static storage owned by the library.
        unsafe { std::ffi::CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |key| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn explicit_path_is_the_only_candidate() {
        let c = candidates(env_of(&[
            (ENV_PATH, "/opt/x/libcublasLt.so.13"),
            (ENV_CUDA_HOME, "/c"),
        ]));
        assert_eq!(c, vec![PathBuf::from("/opt/x/libcublasLt.so.13")]);
    }

    #[cfg(not(windows))]
    #[test]
    fn cuda_home_comes_before_the_system_and_13_before_12() {
        let c = candidates(env_of(&[(ENV_CUDA_HOME, "/cuda")]));
        let shown: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
        let arch = target_dir_name();
        assert_eq!(shown[0], "/cuda/lib64/libcublasLt.so.13");
        assert_eq!(shown[1], "/cuda/lib64/libcublasLt.so.12");
        assert_eq!(
            shown[2],
            format!("/cuda/targets/{arch}/lib/libcublasLt.so.13")
        );
        assert_eq!(
            shown[3],
            format!("/cuda/targets/{arch}/lib/libcublasLt.so.12")
        );
        assert_eq!(shown[4], "libcublasLt.so.13");
        assert_eq!(shown[5], "libcublasLt.so.12");
        assert!(shown.contains(&format!(
            "/usr/local/cuda/targets/{arch}/lib/libcublasLt.so.13"
        )));
    }

    #[test]
    fn empty_variables_are_ignored() {
        let c = candidates(env_of(&[(ENV_PATH, ""), (ENV_CUDA_HOME, "")]));
        assert_eq!(c[0], PathBuf::from(FILE_NAMES[0]));
    }

    #[test]
    fn no_library_found_lists_every_path_tried() {
        let dir = std::env::temp_dir().join("tf-cuda-cublaslt-missing");
        let tried: Vec<PathBuf> = ["a.so", "b.so", "c.so"]
            .iter()
            .map(|n| dir.join(n))
            .collect();
        let err = LtLibrary::open_first(&tried).expect_err("nothing there to open");
        let text = err.to_string();
        for path in &tried {
            assert!(text.contains(&path.display().to_string()), "{text}");
        }
        match err {
            CublasLtError::LibraryNotFound { tried: attempts } => {
                assert_eq!(attempts.len(), 3);
                assert!(attempts.iter().all(|a| !a.reason.is_empty()));
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(
            text.contains(ENV_PATH),
            "the error says how to fix it: {text}"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_library_without_the_entries_is_refused_by_name() {
        // libc opens everywhere on Linux but exports no cuBLASLt symbol.
        let err = LtLibrary::open_path(Path::new("libc.so.6")).expect_err("libc is not cuBLASLt");
        let text = err.to_string();
        assert!(text.contains("libc.so.6"), "{text}");
        assert!(text.contains("cublasLtMatmul"), "{text}");
        assert!(text.contains("cublasLtCreate"), "{text}");
    }
}
