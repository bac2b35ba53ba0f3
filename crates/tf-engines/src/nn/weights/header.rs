//! The safetensors header: parsed and validated as a pure function on bytes (fuzzed by the crate's property
//! tests) before anything reads a tensor.

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

use super::Dtype;
use crate::nn::tensor::element_count;

/// Largest header accepted, as the reference safetensors reader does.
pub const MAX_HEADER_BYTES: usize = 100_000_000;
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
}
