//! Finding and opening `libnccl` at run time.
//!
//! Search order (the first library that opens, exports every required entry and is new enough wins):
//! 1. `TF_NCCL`: an explicit path. When set it is the only candidate: a library other than the one asked for
//!    is never loaded silently.
//! 2. `libnccl.so.2`, through the system loader's search.
//! 3. Only through [`Nccl::open_with_python_packages`]: `nvidia/nccl/lib/libnccl.so.2` below the Python
//!    package folders (where the `nvidia-nccl-cu12`/`-cu13` wheels put it): `PYTHONPATH`'s entries,
//!    `$VIRTUAL_ENV` and `$CONDA_PREFIX`, the usual system and user folders, then the `sys.path` of the
//!    interpreter named by `TF_PYTHON` (else `python3`).
//!
//! A failure lists every candidate tried and why each was refused (not found, missing entry points with all
//! of their names, unreadable or too old version). Nothing here panics.
//!
//! Before any library is opened the process gets `NCCL_NVLS_ENABLE=0`: NVLink multicast (NVLS) stays off.
//! NCCL reads its environment once, at its first communicator, so setting it here covers every communicator
//! of the process. An earlier different value is replaced and reported by [`Nccl::nvls_override`].

use std::ffi::{c_int, CStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::NcclError;
use crate::ffi::{self, NcclApi, NcclResult};

/// Environment variable naming the NCCL library explicitly (a full path).
pub const ENV_PATH: &str = "TF_NCCL";
/// Environment variable naming the Python interpreter asked for its package folders.
pub const ENV_PYTHON: &str = "TF_PYTHON";
/// NCCL's switch for NVLink multicast, held at `0` in every process that opens NCCL.
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";
/// The library name tried through the system loader.
pub const DEFAULT_NAMES: &[&str] = &["libnccl.so.2"];
/// Where the NVIDIA NCCL wheels put the library, below a Python package folder.
pub const WHEEL_PATH: &str = "nvidia/nccl/lib/libnccl.so.2";
/// The oldest NCCL accepted: non-blocking communicators with the 2.17 config layout.
pub const MIN_VERSION: i32 = ffi::version_code(2, 17, 0);

/// Why one candidate was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The system loader could not open it (its message).
    Open(String),
    /// It opened but lacks required entry points (all of them).
    MissingSymbols(Vec<&'static str>),
    /// `ncclGetVersion` failed.
    VersionUnreadable(NcclResult),
    /// Older than [`MIN_VERSION`].
    TooOld(i32),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Open(why) => write!(f, "{why}"),
            Refusal::MissingSymbols(names) => {
                write!(f, "not NCCL: lacks the entry points {}", names.join(", "))
            }
            Refusal::VersionUnreadable(code) => write!(
                f,
                "ncclGetVersion failed with {} ({code})",
                ffi::result::name(*code)
            ),
            Refusal::TooOld(v) => write!(
                f,
                "NCCL {} is older than {} (non-blocking communicators need it)",
                Version(*v),
                Version(MIN_VERSION)
            ),
        }
    }
}

/// One candidate the loader tried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// A path, or a bare file name handed to the system loader.
    pub path: PathBuf,
    pub refusal: Refusal,
}

/// Where the candidates came from (changes the advice in the message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathSource {
    /// The [`ENV_PATH`] variable.
    Environment,
    /// The system loader's search ([`DEFAULT_NAMES`]).
    Defaults,
    /// The defaults, then the Python package folders.
    PythonPackages,
    /// Paths given by the caller.
    Caller,
}

/// Why no NCCL library could be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// Every candidate was refused; each is listed with its reason.
    #[error("{}", no_library_message(.source_of_paths, .attempts))]
    NoLibrary {
        source_of_paths: PathSource,
        attempts: Vec<Attempt>,
    },
}

impl LoadError {
    /// The candidates tried, in order.
    pub fn attempts(&self) -> &[Attempt] {
        match self {
            LoadError::NoLibrary { attempts, .. } => attempts,
        }
    }
}

fn no_library_message(source: &PathSource, attempts: &[Attempt]) -> String {
    let tried = if attempts.is_empty() {
        "nothing (no candidate)".to_string()
    } else {
        attempts
            .iter()
            .map(|a| format!("{} ({})", a.path.display(), a.refusal))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let advice = match source {
        PathSource::Environment => format!(
            "fix or unset {ENV_PATH} (it must name NCCL's libnccl.so.2, e.g. \
             .../site-packages/nvidia/nccl/lib/libnccl.so.2)"
        ),
        PathSource::Defaults => format!(
            "install NCCL 2.17 or newer where the system loader finds it (LD_LIBRARY_PATH), set {ENV_PATH} to \
             libnccl.so.2's full path, or search the Python packages (the nvidia-nccl wheels)"
        ),
        PathSource::PythonPackages => format!(
            "install the nvidia-nccl-cu13 (or -cu12) wheel, or set {ENV_PATH} to libnccl.so.2's full path"
        ),
        PathSource::Caller => "check the path".to_string(),
    };
    format!("no usable NCCL library; tried: {tried}; {advice}")
}

/// An NCCL version code (`major * 10000 + minor * 100 + patch`), displayed as `2.28.3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub i32);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        write!(f, "{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100)
    }
}

/// The loaded NCCL library and its entry-point table.
///
/// The library stays loaded as long as this value (shared through `Arc` by every communicator) lives.
pub struct Nccl {
    // Field order: `api` points into `_library`, which is dropped last.
    api: NcclApi,
    path: PathBuf,
    version: i32,
    nvls_override: Option<OsString>,
    _library: libloading::Library,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &Version(self.version))
            .finish_non_exhaustive()
    }
}

impl Nccl {
    /// Opens NCCL: `TF_NCCL` if set (only that path), else `libnccl.so.2` through the system loader.
    pub fn open() -> Result<Arc<Nccl>, LoadError> {
        let (paths, source) = candidates(|k| std::env::var_os(k));
        Nccl::open_first(&paths, source)
    }

    /// Like [`Nccl::open`], then (when `TF_NCCL` is unset and the system loader finds nothing) the Python
    /// package folders: see the module doc.
    pub fn open_with_python_packages() -> Result<Arc<Nccl>, LoadError> {
        let env = |k: &str| std::env::var_os(k);
        let (mut paths, source) = candidates(env);
        if source == PathSource::Environment {
            return Nccl::open_first(&paths, source);
        }
        paths.extend(
            python_package_dirs(env)
                .into_iter()
                .map(|d| d.join(WHEEL_PATH)),
        );
        dedup(&mut paths);
        let first = match Nccl::open_first(&paths, PathSource::PythonPackages) {
            Ok(nccl) => return Ok(nccl),
            Err(e) => e,
        };
        // Last: the folders the interpreter itself searches.
        let mut more: Vec<PathBuf> = interpreter_paths(env)
            .into_iter()
            .map(|d| d.join(WHEEL_PATH))
            .filter(|p| !paths.contains(p))
            .collect();
        dedup(&mut more);
        let mut attempts = first.attempts().to_vec();
        match Nccl::open_first(&more, PathSource::PythonPackages) {
            Ok(nccl) => Ok(nccl),
            Err(e) => {
                attempts.extend_from_slice(e.attempts());
                Err(LoadError::NoLibrary {
                    source_of_paths: PathSource::PythonPackages,
                    attempts,
                })
            }
        }
    }

    /// Opens exactly `path` (a full path, or a bare name the system loader searches).
    pub fn open_path(path: &Path) -> Result<Arc<Nccl>, LoadError> {
        Nccl::open_first(&[path.to_path_buf()], PathSource::Caller)
    }

    /// Tries `paths` in order; the error lists every attempt.
    pub fn open_first(paths: &[PathBuf], source: PathSource) -> Result<Arc<Nccl>, LoadError> {
        let nvls_override = keep_nvls_off();
        let mut attempts = Vec::with_capacity(paths.len());
        for path in paths {
            match Nccl::open_one(path, nvls_override.clone()) {
                Ok(nccl) => return Ok(Arc::new(nccl)),
                Err(refusal) => attempts.push(Attempt {
                    path: path.clone(),
                    refusal,
                }),
            }
        }
        Err(LoadError::NoLibrary {
            source_of_paths: source,
            attempts,
        })
    }

    fn open_one(path: &Path, nvls_override: Option<OsString>) -> Result<Nccl, Refusal> {
        // SAFETY: loading runs the library's initialisers; NCCL's only set up its own state, and a library
        // named by the user is the user's choice.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| Refusal::Open(e.to_string()))?;
        let api = NcclApi::resolve(&library).map_err(Refusal::MissingSymbols)?;
        let mut version: c_int = 0;
        // SAFETY: the out-pointer is valid for the call; ncclGetVersion needs no GPU.
        let code = unsafe { (api.ncclGetVersion)(&mut version) };
        if code != ffi::result::SUCCESS {
            return Err(Refusal::VersionUnreadable(code));
        }
        if version < MIN_VERSION {
            return Err(Refusal::TooOld(version));
        }
        Ok(Nccl {
            api,
            path: path.to_path_buf(),
            version,
            nvls_override,
            _library: library,
        })
    }

    pub(crate) fn api(&self) -> &NcclApi {
        &self.api
    }

    /// The path (or bare name) the library was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The library's version.
    pub fn version(&self) -> Version {
        Version(self.version)
    }

    /// The value `NCCL_NVLS_ENABLE` had before this process set it to `0`, when it had another one.
    pub fn nvls_override(&self) -> Option<&OsString> {
        self.nvls_override.as_ref()
    }

    /// NCCL's text for a result code.
    pub fn error_string(&self, code: NcclResult) -> String {
        // SAFETY: ncclGetErrorString takes any code and returns a static NUL-terminated string (or null).
        let ptr = unsafe { (self.api.ncclGetErrorString)(code) };
        if ptr.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, static storage owned by the library.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }

    /// A fresh communicator id (`ncclGetUniqueId`). Rank 0 makes it and ships [`UniqueId::to_bytes`] to the
    /// other ranks out of band; it also starts NCCL's bootstrap listener, so make it on the rank that will be
    /// rank 0.
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = ffi::RawUniqueId {
            internal: [0; ffi::UNIQUE_ID_BYTES],
        };
        // SAFETY: the out-pointer is a valid 128-byte id for the call.
        let code = unsafe { (self.api.ncclGetUniqueId)(&mut raw) };
        if code != ffi::result::SUCCESS {
            return Err(NcclError::call(
                self,
                "ncclGetUniqueId",
                code,
                String::new(),
            ));
        }
        Ok(UniqueId(raw))
    }
}

/// A communicator id: 128 opaque bytes that every rank of one communicator must share.
#[derive(Clone, Copy)]
pub struct UniqueId(pub(crate) ffi::RawUniqueId);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// The bytes to ship to the other ranks.
    pub fn to_bytes(&self) -> [u8; ffi::UNIQUE_ID_BYTES] {
        // Each c_char reinterpreted as the byte it holds.
        self.0.internal.map(|c| c as u8)
    }

    /// The id rebuilt from [`UniqueId::to_bytes`] on another rank.
    pub fn from_bytes(bytes: [u8; ffi::UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(ffi::RawUniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        })
    }
}

/// Sets `NCCL_NVLS_ENABLE=0` unless it already is; returns an earlier different value.
fn keep_nvls_off() -> Option<OsString> {
    let previous = std::env::var_os(NVLS_ENV);
    if previous.as_deref() == Some(std::ffi::OsStr::new("0")) {
        return None;
    }
    std::env::set_var(NVLS_ENV, "0");
    previous
}

fn dedup(paths: &mut Vec<PathBuf>) {
    let mut seen = std::collections::HashSet::new();
    paths.retain(|p| seen.insert(p.clone()));
}

/// The candidates of [`Nccl::open`] from the given environment lookup (pure: no file access).
pub fn candidates(env: impl Fn(&str) -> Option<OsString>) -> (Vec<PathBuf>, PathSource) {
    match env(ENV_PATH).filter(|v| !v.is_empty()) {
        Some(explicit) => (vec![PathBuf::from(explicit)], PathSource::Environment),
        None => (
            DEFAULT_NAMES.iter().map(PathBuf::from).collect(),
            PathSource::Defaults,
        ),
    }
}

/// Python package folders named by the environment and the usual install places that exist here, in
/// search order: `PYTHONPATH`, `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `/usr/local/lib/python3*/`, `/usr/lib/python3*/`,
/// `~/.local/lib/python3*/` (`site-packages` and `dist-packages`).
pub fn python_package_dirs(env: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(pp) = env("PYTHONPATH") {
        out.extend(std::env::split_paths(&pp).filter(|p| !p.as_os_str().is_empty()));
    }
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|k| env(k).filter(|v| !v.is_empty()).map(PathBuf::from))
        .collect();
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    if let Some(home) = env("HOME").filter(|v| !v.is_empty()) {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let mut versions: Vec<PathBuf> = std::fs::read_dir(&lib)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        // Newest first (python3.12 before python3.9): longer names first, then descending.
        versions.sort_by(|a, b| {
            b.as_os_str()
                .len()
                .cmp(&a.as_os_str().len())
                .then_with(|| b.cmp(a))
        });
        for v in versions {
            out.push(v.join("site-packages"));
            out.push(v.join("dist-packages"));
        }
    }
    dedup(&mut out);
    out
}

/// The `sys.path` of the interpreter named by `TF_PYTHON` (else `python3`); empty when it does not run.
pub fn interpreter_paths(env: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let python = env(ENV_PYTHON)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| OsString::from("python3"));
    let output = std::process::Command::new(python)
        .args(["-c", "import sys\nfor p in sys.path: print(p)"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match output {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
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
    fn an_explicit_path_is_the_only_candidate() {
        let (c, source) = candidates(env_of(&[(ENV_PATH, "/opt/x/libnccl.so.2")]));
        assert_eq!(c, vec![PathBuf::from("/opt/x/libnccl.so.2")]);
        assert_eq!(source, PathSource::Environment);
        let (c, source) = candidates(env_of(&[(ENV_PATH, "")]));
        assert_eq!(c, vec![PathBuf::from("libnccl.so.2")]);
        assert_eq!(source, PathSource::Defaults);
    }

    #[test]
    fn python_folders_come_from_the_environment_first() {
        let dirs = python_package_dirs(env_of(&[
            ("PYTHONPATH", "/a/site-packages:/b"),
            ("HOME", "/nonexistent/home"),
        ]));
        assert_eq!(dirs[0], PathBuf::from("/a/site-packages"));
        assert_eq!(dirs[1], PathBuf::from("/b"));
        // Folders that do not exist add nothing.
        assert!(!dirs.iter().any(|d| d.starts_with("/nonexistent/home")));
    }

    #[test]
    fn versions_display_as_dotted_triples() {
        assert_eq!(Version(22803).to_string(), "2.28.3");
        assert_eq!(Version(MIN_VERSION).to_string(), "2.17.0");
        assert!(Version(21905) > Version(21800));
    }

    #[test]
    fn unique_ids_survive_the_byte_round_trip() {
        let mut bytes = [0u8; 128];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 + 200) as u8;
        }
        assert_eq!(UniqueId::from_bytes(bytes).to_bytes(), bytes);
    }

    #[test]
    fn the_message_lists_each_attempt_and_advice() {
        let err = LoadError::NoLibrary {
            source_of_paths: PathSource::Defaults,
            attempts: vec![
                Attempt {
                    path: PathBuf::from("libnccl.so.2"),
                    refusal: Refusal::Open("cannot open shared object file".into()),
                },
                Attempt {
                    path: PathBuf::from("/x/libc.so.6"),
                    refusal: Refusal::MissingSymbols(vec!["ncclSend", "ncclRecv"]),
                },
                Attempt {
                    path: PathBuf::from("/y/libnccl.so.2"),
                    refusal: Refusal::TooOld(21605),
                },
            ],
        };
        let msg = err.to_string();
        for part in [
            "libnccl.so.2 (cannot open",
            "/x/libc.so.6 (not NCCL: lacks the entry points ncclSend, ncclRecv)",
            "NCCL 2.16.5 is older than 2.17.0",
            ENV_PATH,
        ] {
            assert!(msg.contains(part), "{part:?} in {msg}");
        }
    }
}
