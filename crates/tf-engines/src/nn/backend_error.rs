//! One typed error for a failed GPU backend call, shared by every component.
//!
//! A component's GPU path fails in the runtime (`tf_cuda::Error`, including a lost context), in cuBLASLt, while
//! loading its kernels or while uploading its weights. [`GpuError`] keeps that cause as a typed
//! [`std::error::Error::source`], beside a short note of what the component was doing, so a caller several
//! layers up can still ask whether the device context is lost ([`chain_has_lost_context`]) instead of parsing
//! text or polling the context.
//!
//! ```
//! use tf_engines::nn::backend_error::{chain_has_lost_context, GpuError};
//!
//! let e = GpuError::message("planning the step", "no workspace");
//! assert_eq!(e.to_string(), "planning the step: no workspace");
//! assert!(!chain_has_lost_context(&e));
//! ```

use std::error::Error as StdError;

use tf_cuda::cublaslt::CublasLtError;
use thiserror::Error;

use crate::nn::gpu::gemm::GemmError;
use crate::nn::gpu::LoadKernelsError;
use crate::nn::upload::UploadError;

/// A GPU backend call that failed: `what` names the step, the variant keeps the cause. Boxed inside
/// [`GpuError`] so the component errors that carry it stay small.
#[derive(Debug, Error)]
pub enum GpuFailure {
    /// A runtime call (driver, memory, stream, launch) failed.
    #[error("{what}: {source}")]
    Cuda {
        what: String,
        #[source]
        source: tf_cuda::Error,
    },
    /// A cuBLASLt call (library load, handle, plan, matmul) failed.
    #[error("{what}: {source}")]
    Gemm {
        what: String,
        #[source]
        source: CublasLtError,
    },
    /// The shared GEMM runner failed (its cuBLASLt cause stays in the chain).
    #[error("{what}: {source}")]
    GemmRunner {
        what: String,
        #[source]
        source: GemmError,
    },
    /// A kernel set could not be loaded.
    #[error("{what}: {source}")]
    Kernels {
        what: String,
        #[source]
        source: LoadKernelsError,
    },
    /// The weights could not be uploaded.
    #[error("{what}: {source}")]
    Upload {
        what: String,
        #[source]
        source: UploadError,
    },
    /// A backend condition with no underlying error (an unsupported shape, a missing workspace).
    /// A collective of a multi-GPU communicator (the communicator is aborted; a lost context stays findable).
    #[error("{what}: {source}")]
    Collective {
        what: String,
        #[source]
        source: tf_nccl::NcclError,
    },
    #[error("{what}: {why}")]
    Message { what: String, why: String },
}

/// A failed GPU backend call ([`GpuFailure`], boxed). Its [`std::error::Error::source`] is the cause's.
#[derive(Debug)]
pub struct GpuError(Box<GpuFailure>);

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl StdError for GpuError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

impl From<GpuFailure> for GpuError {
    fn from(failure: GpuFailure) -> GpuError {
        GpuError(Box::new(failure))
    }
}

impl GpuError {
    /// A failure with no underlying error value.
    pub fn message(what: impl Into<String>, why: impl Into<String>) -> GpuError {
        GpuFailure::Message {
            what: what.into(),
            why: why.into(),
        }
        .into()
    }

    /// What failed and why.
    pub fn failure(&self) -> &GpuFailure {
        &self.0
    }

    /// Whether this failure, or anything in its source chain, is a lost device context.
    pub fn is_context_lost(&self) -> bool {
        chain_has_lost_context(self)
    }
}

/// A cause that a [`GpuError`] can keep: implemented for the error types a GPU path meets.
pub trait IntoGpuError {
    /// Wraps `self` with the step `what` that failed.
    fn into_gpu_error(self, what: String) -> GpuError;
}

impl IntoGpuError for tf_cuda::Error {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Cuda { what, source: self }.into()
    }
}

impl IntoGpuError for CublasLtError {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Gemm { what, source: self }.into()
    }
}

impl IntoGpuError for GemmError {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::GemmRunner { what, source: self }.into()
    }
}

impl IntoGpuError for LoadKernelsError {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Kernels { what, source: self }.into()
    }
}

impl IntoGpuError for UploadError {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Upload { what, source: self }.into()
    }
}

impl IntoGpuError for tf_nccl::NcclError {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Collective { what, source: self }.into()
    }
}

impl IntoGpuError for String {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Message { what, why: self }.into()
    }
}

impl IntoGpuError for &str {
    fn into_gpu_error(self, what: String) -> GpuError {
        GpuFailure::Message {
            what,
            why: self.to_string(),
        }
        .into()
    }
}

/// `cause` wrapped with the step `what` that failed.
pub fn gpu_error(what: impl Into<String>, cause: impl IntoGpuError) -> GpuError {
    cause.into_gpu_error(what.into())
}

/// Whether `error` or any error in its source chain is a lost device context (tf-cuda's `ContextLost`, or a
/// cuBLASLt call refused because of one). Errors that forward their source transparently
/// (or box it) are looked through as well.
pub fn chain_has_lost_context(error: &(dyn StdError + 'static)) -> bool {
    let mut next: Option<&(dyn StdError + 'static)> = Some(error);
    // A chain is finite, but a cap keeps a buggy cyclic `source` from looping forever.
    for _ in 0..64 {
        let Some(e) = next else {
            return false;
        };
        if says_lost(e) {
            return true;
        }
        next = e.source();
    }
    false
}

fn says_lost(e: &(dyn StdError + 'static)) -> bool {
    let cuda = |c: &tf_cuda::Error| c.is_context_lost();
    if let Some(c) = e.downcast_ref::<tf_cuda::Error>() {
        return cuda(c);
    }
    if let Some(c) = e.downcast_ref::<Box<tf_cuda::Error>>() {
        return cuda(c);
    }
    // `CublasLtError::Runtime` is transparent: its `source()` skips the runtime error it holds.
    if let Some(CublasLtError::Runtime(c)) = e.downcast_ref::<CublasLtError>() {
        return cuda(c);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost() -> tf_cuda::Error {
        tf_cuda::Error::ContextLost {
            call: "cuStreamSynchronize",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS",
        }
    }

    #[test]
    fn a_lost_context_is_found_through_every_wrapper() {
        assert!(gpu_error("running the step", lost()).is_context_lost());
        assert!(gpu_error("GEMM 1x1x1", CublasLtError::Runtime(lost())).is_context_lost());
        assert!(gpu_error(
            "loading kernels",
            LoadKernelsError::Cuda {
                set: "x",
                source: lost()
            }
        )
        .is_context_lost());
        assert!(gpu_error(
            "uploading",
            UploadError::Cuda {
                what: "copy",
                source: lost()
            }
        )
        .is_context_lost());
    }

    #[test]
    fn other_failures_are_not_a_lost_context() {
        let oom = tf_cuda::Error::OutOfMemory {
            call: "cuMemAlloc_v2",
            bytes: 1 << 40,
            why: "the driver has no room".into(),
        };
        assert!(!gpu_error("allocating", oom).is_context_lost());
        assert!(!gpu_error("planning", "no workspace").is_context_lost());
        let e = gpu_error("running the step", lost());
        assert!(e.to_string().starts_with("running the step: "), "{e}");
    }
}
