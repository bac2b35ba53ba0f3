//! One memory-mapped safetensors file with a validated header, and typed host access to its tensors.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{parse_header, Dtype, Header, HeaderError, TensorInfo, WeightsError};
use crate::nn::tensor::{Tensor, TensorF32};

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

#[cfg(test)]
mod tests {
    use super::*;

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
