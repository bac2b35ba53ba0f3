//! Project automation behind `cargo xtask`: builds the CUDA kernel sets, checks their SASS, verifies the
//! TensorFold runtime pin (including the Zig package hash) and assembles the GPU test bundle.
//!
//! Invariants:
//! - Nothing here probes a GPU; the kernel build needs only nvcc (found or installed into `.tools/`).
//! - Rebuild decisions use content hashes (sources, included headers, flags, `nvcc --version`), never mtimes.
//! - Every check reports all failures it finds, each saying what differs and how to fix it.
//!
//! Example (what `cargo xtask zig-hash DIR` does):
//! ```no_run
//! let hash = xtask::zighash::package_hash(std::path::Path::new("path/to/package"))?;
//! println!("{}", hash.text);
//! # Ok::<(), xtask::Error>(())
//! ```

pub mod bundle;
pub mod error;
pub mod kernels;
pub mod paths;
pub mod pin;
pub mod sass;
pub mod toolchain;
pub mod util;
pub mod zighash;
pub mod zon;

pub use error::Error;
