//! tf-sys: the CUDA driver ABI, loaded at run time.
pub mod api;
pub mod types;
pub use api::{Allocation, Api, EntrySpec, Requirement, ENTRIES};
pub use types::*;

/// Placeholder until the loader lands.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("missing symbols: {0:?}")]
    MissingSymbols(Vec<&'static str>),
}
