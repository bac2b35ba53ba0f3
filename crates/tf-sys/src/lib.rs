//! tf-sys: the CUDA driver ABI, loaded at run time.
//!
//! What it is for: opening NVIDIA's driver library (`libcuda.so.1`) without linking to it, holding
//! its entry points in one table ([`Api`], generated from the declarative list in [`api`]), and
//! turning result codes into [`Error`]s that say what failed and what to do.
//!
//! Invariants:
//! - tf-sys never panics: a missing library, a missing symbol, a failing `cuInit` and every
//!   result code come back as values ([`LoadError`], [`Error`]).
//! - Only tf-cuda calls tf-sys; everything above it uses tf-cuda's safe types.
//! - The entry list in [`api`] is the single source of truth for the ABI (the memcap coverage
//!   test and `cargo xtask verify-pin` read [`ENTRIES`]).
//! - Every struct passed to the driver has its size and field offsets asserted at compile time
//!   ([`types`]).
//! - `cuInit(0)` is called before the table is resolved; a [`Driver`] keeps its library loaded as
//!   long as its table lives, and is `Send + Sync`.
//! - Sticky execution faults (see [`result::is_sticky`]) map to [`Error::ContextLost`].
//!
//! ```no_run
//! use tf_sys::{check, Driver};
//!
//! let driver = Driver::open()?; // TF_CUDA_DRIVER, else libcuda.so.1, else libcuda.so
//! println!("CUDA driver {} with {} devices", driver.version()?, driver.device_count()?);
//! let mut count = 0;
//! // SAFETY: the out-pointer is valid for the call.
//! let r = unsafe { (driver.api().cuDeviceGetCount)(&mut count) };
//! check(&driver, "cuDeviceGetCount", r)?;
//! # Ok::<(), tf_sys::Error>(())
//! ```
pub mod api;
pub mod error;
pub mod loader;
pub mod memcap;
pub mod result;
pub mod types;

pub use api::{Allocation, Api, EntrySpec, Requirement, ENTRIES};
pub use error::{check, DescribeResult, Error, FallbackText};
pub use loader::{Driver, LoadError, OpenAttempt, PathSource, DEFAULT_CANDIDATES, DRIVER_ENV};
pub use types::*;
