//! The communicator's one error type.

use std::time::Duration;

use crate::ffi::{self, NcclResult};
use crate::loader::Nccl;

/// Why a communicator call failed. Every message names the rank, the call, NCCL's code where there is one,
/// and what to do. Every failure after the communicator exists aborts it ([`NcclError::Aborted`] from then
/// on), except [`NcclError::Invalid`], which is found before NCCL is called.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// An NCCL call returned an error.
    #[error("{call} failed: {name} ({code}) {text}{last}; {}", advice(*.code))]
    Call {
        call: &'static str,
        code: NcclResult,
        name: &'static str,
        text: String,
        /// `ncclGetLastError`'s detail, `": ..."`, or empty.
        last: String,
    },
    /// The deadline passed before the operation finished; the communicator was aborted.
    #[error(
        "rank {rank} of {world}: {what} did not finish within {waited:?}, so the communicator was aborted and \
         no rank waits forever: a peer rank is dead, stuck or never joined (check every rank's log), or the \
         timeout is too short for this size (CommOptions)"
    )]
    Timeout {
        rank: usize,
        world: usize,
        what: String,
        waited: Duration,
    },
    /// NCCL reported an asynchronous error; the communicator was aborted.
    #[error(
        "rank {rank} of {world}: {what}: NCCL reported {name} ({code}) {text}{last}; the communicator was \
         aborted; {}", advice(*.code)
    )]
    Async {
        rank: usize,
        world: usize,
        what: String,
        code: NcclResult,
        name: &'static str,
        text: String,
        last: String,
    },
    /// A CUDA call of the communicator's context or stream failed (a lost context stays findable through
    /// [`NcclError::is_context_lost`]); the communicator was aborted.
    #[error("rank {rank} of {world}: {what}: {source}; the communicator was aborted")]
    Cuda {
        rank: usize,
        world: usize,
        what: String,
        #[source]
        source: Box<tf_cuda::Error>,
    },
    /// An earlier failure (or the caller) aborted the communicator; nothing more goes to NCCL.
    #[error(
        "rank {rank} of {world}: {what}: the communicator was aborted ({reason}); end the job, or make a new \
         communicator on every rank"
    )]
    Aborted {
        rank: usize,
        world: usize,
        what: &'static str,
        reason: String,
    },
    /// A request that does not fit (buffer sizes, ranks, counts); found before NCCL is called, the
    /// communicator stays usable.
    #[error("{0}")]
    Invalid(String),
}

impl NcclError {
    /// A failed call, with NCCL's texts.
    pub(crate) fn call(
        nccl: &Nccl,
        call: &'static str,
        code: NcclResult,
        last: String,
    ) -> NcclError {
        NcclError::Call {
            call,
            code,
            name: ffi::result::name(code),
            text: nccl.error_string(code),
            last,
        }
    }

    /// True when the cause is a lost CUDA context (the process must exit).
    pub fn is_context_lost(&self) -> bool {
        matches!(self, NcclError::Cuda { source, .. } if source.is_context_lost())
    }

    /// True when the cause is a passed deadline.
    pub fn is_timeout(&self) -> bool {
        matches!(self, NcclError::Timeout { .. })
    }

    /// True when the communicator is aborted (every error but [`NcclError::Invalid`] and a failed
    /// [`NcclError::Call`] before a communicator existed).
    pub fn aborted_the_communicator(&self) -> bool {
        matches!(
            self,
            NcclError::Timeout { .. }
                | NcclError::Async { .. }
                | NcclError::Cuda { .. }
                | NcclError::Aborted { .. }
        )
    }
}

/// What to do about a code.
fn advice(code: NcclResult) -> &'static str {
    match code {
        ffi::result::REMOTE_ERROR => {
            "a peer rank failed or its connection closed: look at the other ranks' errors first"
        }
        ffi::result::SYSTEM_ERROR => {
            "a system call failed (sockets, shared memory, /dev/shm size): run with NCCL_DEBUG=WARN for detail"
        }
        ffi::result::UNHANDLED_CUDA_ERROR => {
            "a CUDA call inside NCCL failed: check the GPU with `nvidia-smi` and the device ordinals of the ranks"
        }
        ffi::result::INVALID_ARGUMENT | ffi::result::INVALID_USAGE => {
            "the call does not fit the communicator (rank, size, buffer or a missing group end); every rank \
             must issue the same collectives in the same order"
        }
        ffi::result::INTERNAL_ERROR => "NCCL hit an internal error: run with NCCL_DEBUG=WARN for detail",
        ffi::result::TIMEOUT => "NCCL itself timed out: a peer rank is likely gone",
        _ => "run with NCCL_DEBUG=WARN for detail",
    }
}
