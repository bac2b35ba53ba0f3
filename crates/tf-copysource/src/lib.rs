//! tf-copysource: who owns the host bytes a host-to-device copy reads.
//!
//! (Crate documentation in progress.)

pub mod backend;
pub mod classes;
mod error;
pub mod mock;
mod source;

pub use backend::{Backend, DeviceAddress, MarkerState};
pub use error::Error;
pub use source::{
    CaptureScope, CapturedSources, Config, ContextId, CopySource, HostRange, HostSource, Result,
    Stats, TeardownReport, MAX_CONTEXTS,
};
