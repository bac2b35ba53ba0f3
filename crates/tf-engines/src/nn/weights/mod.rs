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
//! - [`UploadPlan`] lays the tensors out at aligned device offsets and hands out `&[u8]` chunks of the map, each at
//!   most the staging size. Upload code copies each chunk into pinned staging memory and enqueues the
//!   host-to-device copy from there: the map is never the source of a device copy.
//!
//! Every error names the file and, where there is one, the tensor.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use memmap2::Mmap;
use thiserror::Error;

use crate::nn::tensor::{element_count, Tensor, TensorF32};

/// Largest header accepted, as the reference safetensors reader does.
pub const MAX_HEADER_BYTES: usize = 100_000_000;

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

/// One tensor's header entry. `begin..end` is relative to the data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    /// Byte length.
    pub fn len_bytes(&self) -> usize {
        self.end - self.begin
    }

    /// Element count.
    pub fn elements(&self) -> usize {
        self.len_bytes() / self.dtype.size_bytes()
    }
}

/// A validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Offset of the data section in the file (8 + header length).
    pub data_start: usize,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The optional `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
}

/// Why a safetensors header was refused (the file is named by [`WeightsError::Header`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HeaderError {
    #[error("file is {len} bytes, shorter than the 8-byte header length: the file is truncated or not safetensors")]
    TooShort { len: usize },
    #[error("header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit: not a safetensors file?")]
    HeaderTooLarge { header_len: u64 },
    #[error("header claims {header_len} bytes but only {available} follow the length: the file is truncated")]
    HeaderTruncated { header_len: u64, available: usize },
    #[error("header is not UTF-8 JSON: {why}")]
    Json { why: String },
    #[error("header must be a JSON object of tensor entries")]
    NotAnObject,
    #[error("tensor name {name:?} appears twice in the header")]
    DuplicateName { name: String },
    #[error("tensor {name:?}: malformed entry ({why}); expected {{\"dtype\", \"shape\", \"data_offsets\": [begin, end]}}")]
    BadEntry { name: String, why: String },
    #[error("tensor {name:?}: unknown dtype {dtype:?}")]
    UnknownDtype { name: String, dtype: String },
    #[error("tensor {name:?}: data_offsets [{begin}, {end}] are reversed")]
    ReversedOffsets {
        name: String,
        begin: usize,
        end: usize,
    },
    #[error("tensor {name:?}: shape {shape:?} of {dtype} needs {expected} bytes but data_offsets span {actual}")]
    SizeMismatch {
        name: String,
        shape: Vec<usize>,
        dtype: Dtype,
        expected: String,
        actual: usize,
    },
    #[error("tensor {name:?}: data ends at {end} but the data section has {data_len} bytes: truncated file or lying header")]
    OutOfBounds {
        name: String,
        end: usize,
        data_len: usize,
    },
    #[error("tensors {first:?} and {second:?} overlap")]
    Overlap { first: String, second: String },
    #[error(
        "bytes {gap_begin}..{gap_end} of the data section belong to no tensor (before {next:?})"
    )]
    Hole {
        gap_begin: usize,
        gap_end: usize,
        next: String,
    },
    #[error("the data section has {trailing} bytes after the last tensor")]
    TrailingBytes { trailing: usize },
    #[error("__metadata__ must map strings to strings")]
    BadMetadata,
}

/// A JSON object read as a list of entries, keeping duplicates (a plain map would silently keep the last one).
struct EntryList(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for EntryList {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = EntryList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<EntryList, A::Error> {
                let mut entries = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push((k, v));
                }
                Ok(EntryList(entries))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

fn bad_entry(name: &str, why: &str) -> HeaderError {
    HeaderError::BadEntry {
        name: name.to_string(),
        why: why.to_string(),
    }
}

fn parse_entry(name: &str, value: &serde_json::Value) -> Result<TensorInfo, HeaderError> {
    let obj = value
        .as_object()
        .ok_or_else(|| bad_entry(name, "not an object"))?;
    let dtype_name = obj
        .get("dtype")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad_entry(name, "missing string \"dtype\""))?;
    let dtype = Dtype::from_header(dtype_name).ok_or_else(|| HeaderError::UnknownDtype {
        name: name.to_string(),
        dtype: dtype_name.to_string(),
    })?;
    let shape = obj
        .get("shape")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad_entry(name, "missing array \"shape\""))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| bad_entry(name, "shape entries must be non-negative integers"))?;
    let offsets = obj
        .get("data_offsets")
        .and_then(|v| v.as_array())
        .ok_or_else(|| bad_entry(name, "missing array \"data_offsets\""))?;
    let [begin, end] = <[&serde_json::Value; 2]>::try_from(offsets.iter().collect::<Vec<_>>())
        .map_err(|_| bad_entry(name, "data_offsets must have two entries"))?
        .map(|v| v.as_u64().and_then(|d| usize::try_from(d).ok()));
    let (begin, end) = match (begin, end) {
        (Some(b), Some(e)) => (b, e),
        _ => {
            return Err(bad_entry(
                name,
                "data_offsets must be non-negative integers",
            ))
        }
    };
    if end < begin {
        return Err(HeaderError::ReversedOffsets {
            name: name.to_string(),
            begin,
            end,
        });
    }
    let expected = element_count(&shape).and_then(|n| n.checked_mul(dtype.size_bytes()));
    if expected != Some(end - begin) {
        return Err(HeaderError::SizeMismatch {
            name: name.to_string(),
            shape,
            dtype,
            expected: expected
                .map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
            actual: end - begin,
        });
    }
    Ok(TensorInfo {
        dtype,
        shape,
        begin,
        end,
    })
}

/// Parses and validates the header of a safetensors file given its full contents (or at least its header and a
/// correct total length: only `file.len()` is used past the header).
pub fn parse_header(file: &[u8]) -> Result<Header, HeaderError> {
    let len_bytes: [u8; 8] = file
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or(HeaderError::TooShort { len: file.len() })?;
    let header_len = u64::from_le_bytes(len_bytes);
    let header_len_usize = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= MAX_HEADER_BYTES)
        .ok_or(HeaderError::HeaderTooLarge { header_len })?;
    let available = file.len() - 8;
    let json = file
        .get(8..8 + header_len_usize)
        .ok_or(HeaderError::HeaderTruncated {
            header_len,
            available,
        })?;
    let text = std::str::from_utf8(json).map_err(|e| HeaderError::Json { why: e.to_string() })?;
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| HeaderError::Json { why: e.to_string() })?;
    if !value.is_object() {
        return Err(HeaderError::NotAnObject);
    }
    let EntryList(entries) =
        serde_json::from_str(text).map_err(|e| HeaderError::Json { why: e.to_string() })?;

    let data_start = 8 + header_len_usize;
    let data_len = file.len() - data_start;
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    let mut seen_metadata = false;
    for (name, value) in &entries {
        if name == "__metadata__" {
            if seen_metadata {
                return Err(HeaderError::DuplicateName { name: name.clone() });
            }
            seen_metadata = true;
            let obj = value.as_object().ok_or(HeaderError::BadMetadata)?;
            for (k, v) in obj {
                metadata.insert(
                    k.clone(),
                    v.as_str().ok_or(HeaderError::BadMetadata)?.to_string(),
                );
            }
            continue;
        }
        let info = parse_entry(name, value)?;
        if info.end > data_len {
            return Err(HeaderError::OutOfBounds {
                name: name.clone(),
                end: info.end,
                data_len,
            });
        }
        if tensors.insert(name.clone(), info).is_some() {
            return Err(HeaderError::DuplicateName { name: name.clone() });
        }
    }

    // Sorted by offset, the ranges must tile the data section exactly.
    let mut by_offset: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    by_offset.sort_by_key(|(_, t)| (t.begin, t.end));
    let mut cursor = 0usize;
    let mut previous: Option<&String> = None;
    for (name, info) in by_offset {
        if info.begin < cursor {
            return Err(HeaderError::Overlap {
                first: previous.cloned().unwrap_or_default(),
                second: name.clone(),
            });
        }
        if info.begin > cursor {
            return Err(HeaderError::Hole {
                gap_begin: cursor,
                gap_end: info.begin,
                next: name.clone(),
            });
        }
        cursor = info.end;
        previous = Some(name);
    }
    if cursor != data_len {
        return Err(HeaderError::TrailingBytes {
            trailing: data_len - cursor,
        });
    }
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
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
}

/// One memory-mapped safetensors file with a validated header.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Mmap,
    header: Header,
}

impl fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<SafetensorsFile, WeightsError> {
        let io = |source| WeightsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(WeightsError::Header {
                path: path.to_path_buf(),
                source: HeaderError::TooShort { len: len as usize },
            });
        }
        // SAFETY: the map is read-only and private to this process. A file truncated or rewritten by another
        // process while mapped is outside what a reader can guard against (it could raise SIGBUS); model folders
        // are treated as immutable while open, as every safetensors reader does.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse_header(&map).map_err(|source| WeightsError::Header {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.header.tensors.keys().map(String::as_str)
    }

    /// Whether the file has `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// The header entry of `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, WeightsError> {
        self.header
            .tensors
            .get(name)
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                place: self.path.display().to_string(),
            })
    }

    /// The raw little-endian bytes of `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8], WeightsError> {
        let info = self.info(name)?;
        let start = self.header.data_start + info.begin;
        // Validated against the file length by parse_header; `get` keeps this panic-free regardless.
        self.map
            .get(start..start + info.len_bytes())
            .ok_or_else(|| WeightsError::Header {
                path: self.path.clone(),
                source: HeaderError::OutOfBounds {
                    name: name.to_string(),
                    end: info.end,
                    data_len: self.map.len() - self.header.data_start,
                },
            })
    }

    fn conversion_error(&self, name: &str, dtype: Dtype, wanted: &'static str) -> WeightsError {
        WeightsError::Conversion {
            path: self.path.clone(),
            name: name.to_string(),
            dtype,
            wanted,
        }
    }

    /// `name` converted to f32 (from F32, BF16 or F16).
    pub fn to_f32(&self, name: &str) -> Result<TensorF32, WeightsError> {
        let info = self.info(name)?;
        let data = bytes_to_f32(info.dtype, self.bytes(name)?)
            .ok_or_else(|| self.conversion_error(name, info.dtype, "f32"))?;
        Tensor::new(info.shape.clone(), data)
            .map_err(|_| self.conversion_error(name, info.dtype, "f32"))
    }

    /// `name` as bytes (from U8 or BOOL; booleans are 0/1).
    pub fn to_u8(&self, name: &str) -> Result<Tensor<u8>, WeightsError> {
        let info = self.info(name)?;
        if !matches!(info.dtype, Dtype::U8 | Dtype::Bool) {
            return Err(self.conversion_error(name, info.dtype, "u8"));
        }
        Tensor::new(info.shape.clone(), self.bytes(name)?.to_vec())
            .map_err(|_| self.conversion_error(name, info.dtype, "u8"))
    }

    /// `name` as i64 (from I64 or I32).
    pub fn to_i64(&self, name: &str) -> Result<Tensor<i64>, WeightsError> {
        let info = self.info(name)?;
        let bytes = self.bytes(name)?;
        let data: Vec<i64> = match info.dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            other => return Err(self.conversion_error(name, other, "i64")),
        };
        Tensor::new(info.shape.clone(), data)
            .map_err(|_| self.conversion_error(name, info.dtype, "i64"))
    }
}

/// Converts little-endian F32/BF16/F16 bytes to f32; `None` for other dtypes.
pub fn bytes_to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

/// What a model expects of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// Accepted stored dtypes.
    pub dtypes: Vec<Dtype>,
}

/// Floating dtypes a host-converted weight may be stored in.
pub const FLOAT_DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::BF16, Dtype::F16];

/// Throughput of a pass over the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadStats {
    pub bytes: u64,
    pub seconds: f64,
}

impl LoadStats {
    /// Bytes per second (0 when nothing was timed).
    pub fn bytes_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

impl fmt::Display for LoadStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes in {:.3} s ({:.3} GB/s)",
            self.bytes,
            self.seconds,
            self.bytes_per_second() / 1e9
        )
    }
}

/// A diffusers-format model folder: `config.json` plus one or more safetensors shards.
#[derive(Debug)]
pub struct ModelDir {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<SafetensorsFile>,
    /// Tensor name -> index into `shards`.
    location: BTreeMap<String, usize>,
}

fn read_json(path: &Path) -> Result<serde_json::Value, WeightsError> {
    let text = std::fs::read_to_string(path).map_err(|source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| WeightsError::Config {
        path: path.to_path_buf(),
        why: format!("not valid JSON: {e}"),
    })
}

impl ModelDir {
    /// Opens `dir`: reads `config.json`, finds the weights (an index file wins over single files), maps and
    /// validates every shard, and checks that index and shards agree.
    pub fn open(dir: &Path) -> Result<ModelDir, WeightsError> {
        let config = read_json(&dir.join("config.json"))?;
        let listing = std::fs::read_dir(dir).map_err(|source| WeightsError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut indexes = Vec::new();
        let mut singles = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|source| WeightsError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".safetensors.index.json") {
                indexes.push(entry.path());
            } else if name.ends_with(".safetensors") {
                singles.push(entry.path());
            }
        }
        indexes.sort();
        singles.sort();
        match (indexes.as_slice(), singles.as_slice()) {
            ([index], _) => Self::open_sharded(dir, config, index),
            ([], [single]) => {
                let file = SafetensorsFile::open(single)?;
                let location = file.names().map(|n| (n.to_string(), 0)).collect();
                Ok(ModelDir {
                    dir: dir.to_path_buf(),
                    config,
                    shards: vec![file],
                    location,
                })
            }
            ([], []) => Err(WeightsError::NoWeights { dir: dir.to_path_buf() }),
            ([], _) => Err(WeightsError::Index {
                path: dir.to_path_buf(),
                why: format!("{} safetensors files but no *.safetensors.index.json saying which tensor is where", singles.len()),
            }),
            _ => Err(WeightsError::Index {
                path: dir.to_path_buf(),
                why: format!("more than one index file: {indexes:?}"),
            }),
        }
    }

    fn open_sharded(
        dir: &Path,
        config: serde_json::Value,
        index_path: &Path,
    ) -> Result<ModelDir, WeightsError> {
        let index_err = |why: String| WeightsError::Index {
            path: index_path.to_path_buf(),
            why,
        };
        let index = read_json(index_path)?;
        let weight_map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| index_err("missing object \"weight_map\"".into()))?;
        let mut shard_names: Vec<String> = Vec::new();
        let mut wanted: BTreeMap<String, String> = BTreeMap::new();
        for (tensor, file) in weight_map {
            let file = file
                .as_str()
                .ok_or_else(|| index_err(format!("weight_map[{tensor:?}] is not a file name")))?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(index_err(format!(
                    "shard name {file:?} must be a plain file name in the folder"
                )));
            }
            if !shard_names.iter().any(|s| s == file) {
                shard_names.push(file.to_string());
            }
            wanted.insert(tensor.clone(), file.to_string());
        }
        shard_names.sort();
        let mut shards = Vec::with_capacity(shard_names.len());
        for name in &shard_names {
            shards.push(SafetensorsFile::open(&dir.join(name))?);
        }
        let mut location = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            for name in shard.names() {
                if let Some(&first) = location.get(name) {
                    let first: &SafetensorsFile = &shards[first];
                    return Err(WeightsError::DuplicateTensor {
                        name: name.to_string(),
                        first: first.path().to_path_buf(),
                        second: shard.path().to_path_buf(),
                    });
                }
                match wanted.get(name) {
                    Some(file) if *file == shard_names[i] => {}
                    Some(file) => {
                        return Err(index_err(format!(
                            "tensor {name:?} is listed in {file} but stored in {}",
                            shard.path().display()
                        )))
                    }
                    None => {
                        return Err(index_err(format!(
                            "tensor {name:?} of {} is not in the weight_map",
                            shard.path().display()
                        )))
                    }
                }
                location.insert(name.to_string(), i);
            }
        }
        for (tensor, file) in &wanted {
            if !location.contains_key(tensor) {
                return Err(WeightsError::MissingTensor {
                    name: tensor.clone(),
                    place: format!("{} (the index lists it there)", dir.join(file).display()),
                });
            }
        }
        Ok(ModelDir {
            dir: dir.to_path_buf(),
            config,
            shards,
            location,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// The shards, in file-name order.
    pub fn shards(&self) -> &[SafetensorsFile] {
        &self.shards
    }

    /// The shard holding `name`.
    pub fn file_of(&self, name: &str) -> Result<&SafetensorsFile, WeightsError> {
        self.location
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(|| WeightsError::MissingTensor {
                name: name.to_string(),
                place: self.dir.display().to_string(),
            })
    }

    /// The header entry of `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo, WeightsError> {
        self.file_of(name)?.info(name)
    }

    /// Raw bytes of `name` in its map.
    pub fn bytes(&self, name: &str) -> Result<&[u8], WeightsError> {
        self.file_of(name)?.bytes(name)
    }

    /// `name` converted to f32.
    pub fn to_f32(&self, name: &str) -> Result<TensorF32, WeightsError> {
        self.file_of(name)?.to_f32(name)
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| s.header.tensors.values())
            .map(|t| t.len_bytes() as u64)
            .sum()
    }

    /// Checks the folder against a model's expectations: every spec present with its shape and an accepted
    /// dtype, and no tensor the model does not know.
    pub fn check(&self, specs: &[TensorSpec]) -> Result<(), WeightsError> {
        let mut known: HashMap<&str, ()> = HashMap::with_capacity(specs.len());
        for spec in specs {
            known.insert(spec.name.as_str(), ());
            let file = self.file_of(&spec.name)?;
            let info = file.info(&spec.name)?;
            if info.shape != spec.shape {
                return Err(WeightsError::ShapeMismatch {
                    path: file.path().to_path_buf(),
                    name: spec.name.clone(),
                    expected: spec.shape.clone(),
                    actual: info.shape.clone(),
                });
            }
            if !spec.dtypes.contains(&info.dtype) {
                return Err(WeightsError::DtypeNotAccepted {
                    path: file.path().to_path_buf(),
                    name: spec.name.clone(),
                    dtype: info.dtype,
                    allowed: spec
                        .dtypes
                        .iter()
                        .map(|d| d.header_name())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        let unexpected: Vec<String> = self
            .names()
            .filter(|n| !known.contains_key(n))
            .map(str::to_string)
            .collect();
        if !unexpected.is_empty() {
            return Err(WeightsError::UnexpectedTensors {
                path: self.dir.clone(),
                names: unexpected,
            });
        }
        Ok(())
    }

    /// Converts every tensor named in `names` to f32, timing the pass (host-reference load).
    pub fn load_f32(
        &self,
        names: &[&str],
    ) -> Result<(BTreeMap<String, TensorF32>, LoadStats), WeightsError> {
        let start = Instant::now();
        let mut bytes = 0u64;
        let mut out = BTreeMap::new();
        for &name in names {
            bytes += self.info(name)?.len_bytes() as u64;
            out.insert(name.to_string(), self.to_f32(name)?);
        }
        Ok((
            out,
            LoadStats {
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            },
        ))
    }

    /// Lays out `names` (in that order) at device offsets aligned to `align` bytes (a power of two).
    pub fn upload_plan(&self, names: &[&str], align: usize) -> Result<UploadPlan, WeightsError> {
        let align = align.max(1).next_power_of_two();
        let mut items = Vec::with_capacity(names.len());
        let mut offset = 0usize;
        for &name in names {
            let shard = *self
                .location
                .get(name)
                .ok_or_else(|| WeightsError::MissingTensor {
                    name: name.to_string(),
                    place: self.dir.display().to_string(),
                })?;
            let info = self.info(name)?;
            offset = offset.div_ceil(align) * align;
            items.push(UploadItem {
                name: name.to_string(),
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                device_offset: offset,
                len: info.len_bytes(),
            });
            offset += info.len_bytes();
        }
        Ok(UploadPlan {
            items,
            device_bytes: offset.div_ceil(align) * align,
        })
    }
}

/// Where one tensor goes in a device allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadItem {
    pub name: String,
    /// Index into [`ModelDir::shards`].
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset in the device allocation.
    pub device_offset: usize,
    /// Byte length.
    pub len: usize,
}

/// A device layout of a model's tensors, and the chunks to copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadPlan {
    pub items: Vec<UploadItem>,
    /// Size of the device allocation that holds every item.
    pub device_bytes: usize,
}

/// A slice of the map to copy into staging, then to `device_offset`.
#[derive(Debug, Clone, Copy)]
pub struct UploadChunk<'a> {
    /// The tensor this chunk belongs to.
    pub tensor: &'a str,
    /// Destination byte offset in the device allocation.
    pub device_offset: usize,
    /// Source bytes (a view of the file map: copy them into pinned staging first).
    pub bytes: &'a [u8],
}

impl UploadPlan {
    /// The chunks of every item in order, each at most `max_chunk` bytes (the staging buffer size, at least 1).
    pub fn chunks<'a>(
        &'a self,
        model: &'a ModelDir,
        max_chunk: usize,
    ) -> impl Iterator<Item = Result<UploadChunk<'a>, WeightsError>> + 'a {
        let max_chunk = max_chunk.max(1);
        self.items.iter().flat_map(move |item| {
            let bytes = model.bytes(&item.name);
            let pieces: Vec<Result<UploadChunk<'a>, WeightsError>> = match bytes {
                Err(e) => vec![Err(e)],
                Ok(bytes) => bytes
                    .chunks(max_chunk)
                    .enumerate()
                    .map(|(i, piece)| {
                        Ok(UploadChunk {
                            tensor: item.name.as_str(),
                            device_offset: item.device_offset + i * max_chunk,
                            bytes: piece,
                        })
                    })
                    .collect(),
            };
            pieces
        })
    }
}

/// A device upload that failed.
#[derive(Debug, Error)]
pub enum UploadError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("uploading {what}: {source}")]
    Cuda {
        what: String,
        #[source]
        source: Box<tf_cuda::Error>,
    },
    #[error("staging: {0}")]
    Staging(String),
}

fn cuda_err(what: impl Into<String>) -> impl FnOnce(tf_cuda::Error) -> UploadError {
    let what = what.into();
    move |source| UploadError::Cuda {
        what,
        source: Box::new(source),
    }
}

impl UploadPlan {
    /// Copies every item into one new device allocation of [`UploadPlan::device_bytes`], through a ring of
    /// `ring` (at least 2) pinned staging buffers of `staging_bytes` each: a chunk of the map is copied into a
    /// free staging buffer on the host, the host-to-device copy is enqueued from it on `stream`, and an event
    /// marks when the buffer may be refilled. Returns the allocation and the throughput (bytes, wall time
    /// until the stream has finished).
    pub fn upload(
        &self,
        model: &ModelDir,
        ctx: &tf_cuda::Context,
        stream: &tf_cuda::Stream,
        staging_bytes: usize,
        ring: usize,
    ) -> Result<(tf_cuda::DeviceBuffer, LoadStats), UploadError> {
        let start = Instant::now();
        let staging_bytes = staging_bytes.max(1);
        let mut device = tf_cuda::DeviceBuffer::alloc(ctx, self.device_bytes).map_err(cuda_err(
            format!("a {}-byte device allocation", self.device_bytes),
        ))?;
        let mut slots = Vec::with_capacity(ring.max(2));
        for _ in 0..ring.max(2) {
            let host = tf_cuda::HostBuffer::alloc(ctx, staging_bytes).map_err(cuda_err(
                format!("a {staging_bytes}-byte pinned staging buffer"),
            ))?;
            let done = tf_cuda::Event::new(ctx, false).map_err(cuda_err("a staging event"))?;
            slots.push((host, done, false));
        }
        let mut bytes = 0u64;
        let ring_len = slots.len();
        for (i, chunk) in self.chunks(model, staging_bytes).enumerate() {
            let chunk = chunk?;
            let (host, done, in_flight) = slots
                .get_mut(i % ring_len)
                .ok_or_else(|| UploadError::Staging(format!("no staging slot {}", i % ring_len)))?;
            if *in_flight {
                done.synchronize().map_err(cuda_err(format!(
                    "waiting for staging before {}",
                    chunk.tensor
                )))?;
            }
            let dst = host
                .as_mut_slice()
                .get_mut(..chunk.bytes.len())
                .ok_or_else(|| {
                    UploadError::Staging(format!(
                        "a {}-byte chunk exceeds the staging buffer",
                        chunk.bytes.len()
                    ))
                })?;
            dst.copy_from_slice(chunk.bytes);
            // SAFETY: the staging buffer stays alive (owned by `slots` until after the final synchronize) and
            // is not written again before `done` reports that the stream has passed this copy.
            unsafe {
                device.view_mut().upload_async_pinned(
                    chunk.device_offset,
                    host,
                    0,
                    chunk.bytes.len(),
                    stream,
                )
            }
            .map_err(cuda_err(format!("tensor {}", chunk.tensor)))?;
            done.record(stream)
                .map_err(cuda_err(format!("tensor {}", chunk.tensor)))?;
            *in_flight = true;
            bytes += chunk.bytes.len() as u64;
        }
        stream
            .synchronize()
            .map_err(cuda_err("the final stream synchronize"))?;
        drop(slots);
        Ok((
            device,
            LoadStats {
                bytes,
                seconds: start.elapsed().as_secs_f64(),
            },
        ))
    }
}

/// Serializes f32/u8/i64 host tensors to a safetensors file (for outputs, caches and test files).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(&str, AnyTensor<'_>)],
) -> Result<(), WeightsError> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (dtype, shape, bytes): (safetensors::Dtype, Vec<usize>, Vec<u8>) = match t {
            AnyTensor::F32(t) => (
                safetensors::Dtype::F32,
                t.shape().to_vec(),
                t.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            AnyTensor::U8(t) => (
                safetensors::Dtype::U8,
                t.shape().to_vec(),
                t.data().to_vec(),
            ),
            AnyTensor::I64(t) => (
                safetensors::Dtype::I64,
                t.shape().to_vec(),
                t.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        };
        views.push((name.to_string(), dtype, shape, bytes));
    }
    let mut owned = Vec::with_capacity(views.len());
    for (name, dtype, shape, bytes) in &views {
        let view =
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                WeightsError::Config {
                    path: path.to_path_buf(),
                    why: format!("cannot serialize tensor {name:?}: {e}"),
                }
            })?;
        owned.push((name.clone(), view));
    }
    safetensors::serialize_to_file(owned, None, path).map_err(|e| WeightsError::Config {
        path: path.to_path_buf(),
        why: format!("cannot write safetensors: {e}"),
    })
}

/// A borrowed host tensor of one of the element types [`write_safetensors`] writes.
#[derive(Debug, Clone, Copy)]
pub enum AnyTensor<'a> {
    F32(&'a Tensor<f32>),
    U8(&'a Tensor<u8>),
    I64(&'a Tensor<i64>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(header: &str, data_len: usize) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend(std::iter::repeat_n(0u8, data_len));
        out
    }

    #[test]
    fn accepts_a_valid_header() {
        let h = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[8,12]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let header = parse_header(&file_with(h, 12)).unwrap();
        assert_eq!(header.tensors.len(), 2);
        assert_eq!(header.tensors["b"].dtype, Dtype::BF16);
        assert_eq!(header.metadata["format"], "pt");
        assert_eq!(header.data_start, 8 + h.len());
    }

    #[test]
    fn refuses_lies_and_truncation() {
        let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(matches!(
            parse_header(&file_with(ok, 4)),
            Err(HeaderError::OutOfBounds { .. })
        ));
        assert!(matches!(
            parse_header(&file_with(ok, 9)),
            Err(HeaderError::TrailingBytes { trailing: 1 })
        ));
        let mut truncated = file_with(ok, 8);
        truncated.truncate(20);
        assert!(matches!(
            parse_header(&truncated),
            Err(HeaderError::HeaderTruncated { .. })
        ));
        assert!(matches!(
            parse_header(&[1, 2, 3]),
            Err(HeaderError::TooShort { len: 3 })
        ));
        let wrong_size = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(matches!(
            parse_header(&file_with(wrong_size, 8)),
            Err(HeaderError::SizeMismatch { .. })
        ));
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert!(matches!(
            parse_header(&file_with(dup, 2)),
            Err(HeaderError::DuplicateName { .. })
        ));
        let overlap = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        assert!(matches!(
            parse_header(&file_with(overlap, 3)),
            Err(HeaderError::Overlap { .. })
        ));
        let hole = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert!(matches!(
            parse_header(&file_with(hole, 2)),
            Err(HeaderError::Hole { .. })
        ));
        let dtype = r#"{"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}"#;
        assert!(matches!(
            parse_header(&file_with(dtype, 1)),
            Err(HeaderError::UnknownDtype { .. })
        ));
        let huge = r#"{"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}}"#;
        assert!(matches!(
            parse_header(&file_with(huge, 8)),
            Err(HeaderError::SizeMismatch { .. })
        ));
        let mut big = file_with(ok, 8);
        big[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            parse_header(&big),
            Err(HeaderError::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn converts_half_types_to_f32() {
        let bf = half::bf16::from_f32(1.5).to_le_bytes();
        let f16 = half::f16::from_f32(-2.25).to_le_bytes();
        assert_eq!(bytes_to_f32(Dtype::BF16, &bf), Some(vec![1.5]));
        assert_eq!(bytes_to_f32(Dtype::F16, &f16), Some(vec![-2.25]));
        assert_eq!(
            bytes_to_f32(Dtype::F32, &0.25f32.to_le_bytes()),
            Some(vec![0.25])
        );
        assert_eq!(bytes_to_f32(Dtype::I32, &[0; 4]), None);
    }
}
