//! The error type of driver calls and the one function that maps a `CUresult` to it.

use crate::loader::LoadError;
use crate::result::{is_sticky, known_description, known_name, shutdown_note, UNKNOWN_CODE_NAME};
use crate::types::{code, CUresult};

/// A failed driver call, classified so callers can react without reading codes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device (or pinned host memory, or the memcap cap) has no room for the request.
    #[error("{call}: out of memory (CUDA_ERROR_OUT_OF_MEMORY); free buffers, lower the batch or resolution, or use a GPU with more memory")]
    OutOfMemory { call: &'static str },
    /// The queried work has not completed yet. A state, not a failure.
    #[error("the queried work has not completed yet (CUDA_ERROR_NOT_READY)")]
    NotReady,
    /// A named symbol (kernel, global) is not in the module.
    #[error("{call}: not found (CUDA_ERROR_NOT_FOUND); the module was built without that symbol: rebuild the kernels")]
    NotFound { call: &'static str },
    /// A sticky execution fault: the context is unusable; only a new process can use the GPU.
    #[error("{call}: the CUDA context is lost after {name} ({code}); every later call fails: restart the process", name = known_name(*code).unwrap_or(UNKNOWN_CODE_NAME))]
    ContextLost { call: &'static str, code: CUresult },
    /// Graph instantiation refused (CUDA_ERROR_NOT_PERMITTED); mapped by tf-cuda at instantiate.
    #[error("graph instantiation is not permitted here (CUDA_ERROR_NOT_PERMITTED); run the work without a graph")]
    GraphNotPermitted,
    /// The driver library could not be loaded.
    #[error(transparent)]
    DriverUnavailable(#[from] LoadError),
    /// An optional entry point the call needs is absent from this driver.
    #[error("the CUDA driver lacks {name}; update the NVIDIA driver")]
    MissingSymbol { name: &'static str },
    /// Any other failure, with the driver's own name and description of the code.
    #[error("{call} failed: {name} ({code}) {text}{note}", note = shutdown_note(*code))]
    Failed {
        call: &'static str,
        code: CUresult,
        name: String,
        text: String,
    },
    /// An argument was rejected before any driver call.
    #[error("invalid argument: {what}")]
    Invalid { what: String },
}

impl Error {
    /// The raw driver code behind this error, where there is one.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::OutOfMemory { .. } => Some(code::OUT_OF_MEMORY),
            Error::NotReady => Some(code::NOT_READY),
            Error::NotFound { .. } => Some(code::NOT_FOUND),
            Error::ContextLost { code, .. } | Error::Failed { code, .. } => Some(*code),
            Error::GraphNotPermitted => Some(code::NOT_PERMITTED),
            Error::DriverUnavailable(_) | Error::MissingSymbol { .. } | Error::Invalid { .. } => {
                None
            }
        }
    }

    /// Whether this error means the context can no longer be used.
    pub fn is_context_lost(&self) -> bool {
        matches!(self, Error::ContextLost { .. })
    }
}

/// Something that can name and describe a result code: the loaded [`crate::Driver`], its
/// [`crate::Api`], or [`FallbackText`] when no driver is at hand.
pub trait DescribeResult {
    /// The code's `CUDA_ERROR_*` name.
    fn error_name(&self, result: CUresult) -> String;
    /// The code's description.
    fn error_text(&self, result: CUresult) -> String;
}

/// Names and describes codes from the built-in table only.
#[derive(Clone, Copy, Debug, Default)]
pub struct FallbackText;

impl DescribeResult for FallbackText {
    fn error_name(&self, result: CUresult) -> String {
        known_name(result).unwrap_or(UNKNOWN_CODE_NAME).to_string()
    }
    fn error_text(&self, result: CUresult) -> String {
        known_description(result).unwrap_or("").to_string()
    }
}

/// Maps a driver result to `Ok` or the matching [`Error`]: 2 -> `OutOfMemory`, 500 -> `NotFound`,
/// 600 -> `NotReady`, sticky faults -> `ContextLost`, anything else -> `Failed` with the name and
/// text from `source`.
pub fn check<S: DescribeResult + ?Sized>(
    source: &S,
    call: &'static str,
    result: CUresult,
) -> Result<(), Error> {
    match result {
        code::SUCCESS => Ok(()),
        code::OUT_OF_MEMORY => Err(Error::OutOfMemory { call }),
        code::NOT_FOUND => Err(Error::NotFound { call }),
        code::NOT_READY => Err(Error::NotReady),
        c if is_sticky(c) => Err(Error::ContextLost { call, code: c }),
        c => Err(Error::Failed {
            call,
            code: c,
            name: source.error_name(c),
            text: source.error_text(c),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_the_special_codes() {
        let f = FallbackText;
        assert!(check(&f, "x", 0).is_ok());
        assert!(matches!(
            check(&f, "cuMemAlloc_v2", 2),
            Err(Error::OutOfMemory {
                call: "cuMemAlloc_v2"
            })
        ));
        assert!(matches!(
            check(&f, "cuModuleGetFunction", 500),
            Err(Error::NotFound { .. })
        ));
        assert!(matches!(
            check(&f, "cuStreamQuery", 600),
            Err(Error::NotReady)
        ));
        assert!(matches!(
            check(&f, "cuStreamSynchronize", 700),
            Err(Error::ContextLost { code: 700, .. })
        ));
        assert!(matches!(
            check(&f, "x", 999),
            Err(Error::Failed { code: 999, .. })
        ));
    }

    #[test]
    fn failed_message_names_call_code_and_note() {
        let err = check(&FallbackText, "cuCtxSynchronize", 4).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("cuCtxSynchronize"), "{msg}");
        assert!(msg.contains("CUDA_ERROR_DEINITIALIZED"), "{msg}");
        assert!(msg.contains("(4)"), "{msg}");
        assert!(msg.contains("process is exiting"), "{msg}");
        let lost = check(&FallbackText, "cuStreamSynchronize", 719)
            .unwrap_err()
            .to_string();
        assert!(
            lost.contains("CUDA_ERROR_LAUNCH_FAILED") && lost.contains("restart"),
            "{lost}"
        );
    }

    #[test]
    fn unknown_code_gets_the_placeholder_name() {
        let err = check(&FallbackText, "x", 4242).unwrap_err();
        match err {
            Error::Failed { name, .. } => assert_eq!(name, UNKNOWN_CODE_NAME),
            other => panic!("expected Failed, got {other:?}"),
        }
    }
}
