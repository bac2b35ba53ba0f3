//! Backend-neutral interfaces of the Qwen-Image 2.1 pipeline's text encoder and VAE decoder.
//!
//! The pipeline drives every component through host tensors: prompt features go in once, packed latents go in
//! and out once per step (512 KiB at 1024x1024), so a backend may keep everything else on the device. The DiT
//! has its own trait, [`crate::qwen_image::dit::DitBackend`]. The host references implement these traits, and
//! the GPU backends implement the same ones, so one pipeline runs on either.

use crate::nn::tensor::TensorF32;
use crate::qwen3_vl::text_encoder::{HostTextEncoder, TextEncoderConfig, TextEncoderError};
use crate::qwen3_vl::text_encoder_gpu::GpuTextEncoder;
use crate::qwen_image::vae::{HostVaeDecoder, VaeConfig, VaeError};

/// The Qwen3-VL text path as the pipeline uses it.
pub trait TextEncoderBackend {
    /// The model config.
    fn config(&self) -> &TextEncoderConfig;

    /// Hidden states `[ids.len() - drop_rows, hidden]` of the last decoder layer before the final norm, with
    /// the first `drop_rows` rows (the template's system block) removed. Positions start at 0.
    fn prompt_features(
        &mut self,
        ids: &[u32],
        drop_rows: usize,
    ) -> Result<TensorF32, TextEncoderError>;
}

/// The VAE decoder as the pipeline uses it.
pub trait VaeBackend {
    /// The model config.
    fn config(&self) -> &VaeConfig;

    /// Decodes packed latents `[batch, h * w, z_dim]` (token = row * w + col) of an `h` x `w` latent grid:
    /// unpack, `z * std + mean`, decode, clamp. Returns images `[batch, out_channels, f h, f w]` in [-1, 1].
    fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError>;
}

impl TextEncoderBackend for HostTextEncoder {
    fn config(&self) -> &TextEncoderConfig {
        HostTextEncoder::config(self)
    }

    fn prompt_features(
        &mut self,
        ids: &[u32],
        drop_rows: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        HostTextEncoder::prompt_features(self, ids, drop_rows)
    }
}

impl VaeBackend for HostVaeDecoder {
    fn config(&self) -> &VaeConfig {
        HostVaeDecoder::config(self)
    }

    fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        HostVaeDecoder::decode_packed(self, packed, h, w)
    }
}

impl TextEncoderBackend for GpuTextEncoder {
    fn config(&self) -> &TextEncoderConfig {
        GpuTextEncoder::config(self)
    }

    fn prompt_features(
        &mut self,
        ids: &[u32],
        drop_rows: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        GpuTextEncoder::prompt_features(self, ids, drop_rows)
    }
}
