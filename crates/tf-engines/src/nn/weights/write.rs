//! Writing f32/u8/i64 host tensors as a safetensors file (outputs, caches and test files).

use std::path::Path;

use super::WeightsError;
use crate::nn::tensor::Tensor;

/// [`write_safetensors`] of named f32 tensors (a test folder's weights, a seeded checkpoint).
pub fn write_f32_safetensors(
    path: &Path,
    tensors: &[(String, crate::nn::tensor::TensorF32)],
) -> Result<(), WeightsError> {
    let named: Vec<(&str, AnyTensor<'_>)> = tensors
        .iter()
        .map(|(name, t)| (name.as_str(), AnyTensor::F32(t)))
        .collect();
    write_safetensors(path, &named)
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
