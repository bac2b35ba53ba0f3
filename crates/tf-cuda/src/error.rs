//! The runtime's one error type.

use crate::launch::Dim3;

/// The copy-source bookkeeping's error, over this crate's driver backend.
pub type CopySourceError = tf_copysource::Error<tf_sys::Error>;

/// Why a runtime call failed. Every message names the call, the driver's code where there is
/// one, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A driver call failed (and the failure does not fall in a variant below).
    #[error(transparent)]
    Driver(tf_sys::Error),

    /// An execution fault left the context unusable. Raised by the call that saw the fault and by
    /// every later call through the context, which no longer reaches the driver.
    #[error(
        "{call}: the CUDA context is lost ({name}, code {code}): an earlier GPU execution fault \
         left it unusable, so no further work is sent to the driver; treat the job as failed and \
         restart the process (look for an out-of-bounds access in the last kernels launched)"
    )]
    ContextLost {
        /// The call that saw the fault or was refused because of it.
        call: &'static str,
        /// The first sticky code the context saw.
        code: i32,
        /// Its CUDA_ERROR_* name.
        name: &'static str,
    },

    /// The driver refused a graph operation (code 800, CUDA_ERROR_NOT_PERMITTED).
    #[error(
        "{call}: the driver does not permit this graph (CUDA_ERROR_NOT_PERMITTED, 800): the captured \
         work holds an operation a graph may not contain (a synchronous call, an allocation, or a \
         copy from pageable memory); capture only stream-ordered work"
    )]
    GraphNotPermitted {
        /// The refused call.
        call: &'static str,
    },

    /// A capture scope is open and the copy would read host memory the capture does not own.
    #[error("{0}")]
    UnownedCaptureSource(CopySourceError),

    /// Other copy-source bookkeeping failures (staging limit, context table full, ...).
    #[error("{0}")]
    CopySource(CopySourceError),

    /// A kernel launch failed at the driver.
    #[error(
        "kernel launch failed: kernel {kernel}, grid {grid}, block {block}, shared {shared_bytes} B: {source}"
    )]
    LaunchFailed {
        /// The kernel's name (`cuFuncGetName` when the driver has it, else the looked-up name).
        kernel: String,
        grid: Dim3,
        block: Dim3,
        shared_bytes: u32,
        #[source]
        source: Box<tf_sys::Error>,
    },

    /// A module was loaded but a kernel it should hold is absent.
    #[error(
        "kernel {kernel} is not in the loaded module ({source}); rebuild the kernels (`cargo xtask \
         kernels`) or check the kernel's extern \"C\" name"
    )]
    KernelNotFound {
        kernel: String,
        #[source]
        source: Box<tf_sys::Error>,
    },

    /// The driver could not load a GPU image.
    #[error(
        "cuModuleLoadDataEx failed: {source}; the JIT log says: {log}; check the image targets this \
         GPU's architecture (or ships PTX) and that the driver is new enough"
    )]
    ModuleLoad {
        /// The JIT error log followed by the info log (may be empty).
        log: String,
        #[source]
        source: Box<tf_sys::Error>,
    },

    /// Device memory could not be allocated.
    #[error(
        "{call}: out of memory allocating {bytes} B ({why}); free buffers, lower the batch or \
         resolution, or raise the limit"
    )]
    OutOfMemory {
        call: &'static str,
        bytes: u64,
        /// The driver refused, or the process limit was reached.
        why: String,
    },

    /// Refused before any driver call: a bound, a size, a geometry.
    #[error("invalid request: {what}")]
    Invalid { what: String },
}

impl Error {
    pub(crate) fn invalid(what: impl Into<String>) -> Error {
        Error::Invalid { what: what.into() }
    }

    /// True when the context is lost and the process should stop using the GPU.
    pub fn is_context_lost(&self) -> bool {
        matches!(self, Error::ContextLost { .. })
    }

    /// The driver's `CUresult` when the failure came from the driver.
    pub fn code(&self) -> Option<i32> {
        match self {
            Error::ContextLost { code, .. } => Some(*code),
            Error::GraphNotPermitted { .. } => Some(tf_sys::code::NOT_PERMITTED),
            _ => None,
        }
    }
}

impl From<CopySourceError> for Error {
    fn from(e: CopySourceError) -> Error {
        match e {
            e @ tf_copysource::Error::UnownedCaptureSource { .. } => Error::UnownedCaptureSource(e),
            tf_copysource::Error::Backend { source, .. } => Error::from(source),
            e => Error::CopySource(e),
        }
    }
}

impl From<tf_sys::Error> for Error {
    fn from(e: tf_sys::Error) -> Error {
        match e {
            tf_sys::Error::ContextLost { call, code } => Error::ContextLost {
                call,
                code,
                name: code_name(code),
            },
            tf_sys::Error::GraphNotPermitted => Error::GraphNotPermitted { call: "graph" },
            tf_sys::Error::OutOfMemory { call } => Error::OutOfMemory {
                call,
                bytes: 0,
                why: "the driver has no room".into(),
            },
            tf_sys::Error::Invalid { what } => Error::Invalid { what },
            e => Error::Driver(e),
        }
    }
}

/// The CUDA_ERROR_* name of `code`, from the fallback table (works during process exit).
pub(crate) fn code_name(code: i32) -> &'static str {
    tf_sys::result::known_name(code).unwrap_or("CUDA_ERROR_UNKNOWN_CODE")
}
