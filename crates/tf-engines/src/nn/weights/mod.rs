//! Safetensors files and diffusers-format model folders.
//!
//! - [`parse_header`] validates a safetensors header against the file length: header length, JSON, dtypes,
//!   shapes against byte ranges, ranges in bounds, sorted without holes or overlaps, no duplicate names. It is a
//!   pure function on bytes (fuzzed by the crate's property tests).
//! - [`SafetensorsFile`] maps one file (memmap2) after validating its header; typed host access converts
//!   f32/bf16/f16 to f32.
//! - [`ModelDir`] opens a folder with `config.json` and either one `*.safetensors` file or a sharded set with its
//!   `*.safetensors.index.json`; index and shards must agree exactly. [`ModelDir::check`] compares the tensors with
//!   what a model expects (names, shapes, dtypes) before anything touches a GPU.
//! - [`LayoutPlanner`] places tensors (or fused groups of them) at aligned offsets of one device allocation, with
//!   checked arithmetic; the upload ring ([`crate::nn::upload`]) then streams them there.
//!
//! Every error names the file and, where there is one, the tensor.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

mod file;
mod header;
mod layout;
mod model_dir;
mod write;

pub use file::{bytes_to_f32, SafetensorsFile};
pub use header::{parse_header, Header, HeaderError, TensorInfo, MAX_HEADER_BYTES};
pub use layout::{le_bytes, LayoutPlanner, ALIGN, BF16};
pub use model_dir::{element_total, LoadStats, ModelDir, TensorSpec, FLOAT_DTYPES};
pub use write::{write_f32_safetensors, write_safetensors, AnyTensor};

/// Element types of safetensors files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl Dtype {
    /// Parses the header spelling (`"F32"`, `"BF16"`, `"F8_E4M3"`, ...).
    pub fn from_header(name: &str) -> Option<Dtype> {
        Some(match name {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "F8_E4M3" => Dtype::F8E4M3,
            "F8_E5M2" => Dtype::F8E5M2,
            "I16" => Dtype::I16,
            "U16" => Dtype::U16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "F32" => Dtype::F32,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }

    /// The header spelling.
    pub fn header_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.header_name())
    }
}
/// Errors of the weights reader. Each names the file (and tensor) involved.
#[derive(Debug, Error)]
pub enum WeightsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid safetensors header: {source}")]
    Header {
        path: PathBuf,
        #[source]
        source: HeaderError,
    },
    #[error("{path}: {why}")]
    Config { path: PathBuf, why: String },
    #[error("{path}: shard index: {why}")]
    Index { path: PathBuf, why: String },
    #[error("{dir}: no weights found: expected one *.safetensors file or a *.safetensors.index.json with its shards")]
    NoWeights { dir: PathBuf },
    #[error("tensor {name:?} not found in {place}")]
    MissingTensor { name: String, place: String },
    #[error("tensor {name:?} is in both {first} and {second}")]
    DuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("{path}: tensor {name:?} has shape {actual:?}, the model expects {expected:?} (is this folder for another model size or config?)")]
    ShapeMismatch {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{path}: tensor {name:?} is {dtype}, the model accepts {allowed}")]
    DtypeNotAccepted {
        path: PathBuf,
        name: String,
        dtype: Dtype,
        allowed: String,
    },
    #[error("{path}: tensors the model does not know: {names:?} (a different model, or a converted checkpoint?)")]
    UnexpectedTensors { path: PathBuf, names: Vec<String> },
    #[error("{path}: tensor {name:?} is {dtype}, which cannot be read as {wanted}")]
    Conversion {
        path: PathBuf,
        name: String,
        dtype: Dtype,
        wanted: &'static str,
    },
    #[error("device weight layout: {what} does not fit in usize bytes (a config far larger than any real model?)")]
    LayoutOverflow { what: String },
}
