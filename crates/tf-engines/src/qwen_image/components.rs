//! Backend-neutral interfaces of the Qwen-Image 2.1 pipeline's text encoder and VAE decoder.
//!
//! The pipeline drives every component through host tensors: prompt features go in once, packed latents go in
//! and out once per step (512 KiB at 1024x1024), so a backend may keep everything else on the device. The DiT
//! has its own trait, [`crate::qwen_image::dit::DitBackend`]. The host references implement these traits, and
//! the GPU backends implement the same ones, so one pipeline runs on either.

use crate::nn::tensor::{rows_after_drop, TensorF32};
use crate::qwen3_vl::text_encoder::{HostTextEncoder, TextEncoderConfig, TextEncoderError};
use crate::qwen3_vl::text_encoder_gpu::GpuTextEncoder;
use crate::qwen_image::vae::{to_u8_hwc, HostVaeDecoder, VaeConfig, VaeError};

/// The Qwen3-VL text path as the pipeline uses it.
pub trait TextEncoderBackend {
    /// The model config.
    fn config(&self) -> &TextEncoderConfig;

    /// `hidden_states[layer]` `[ids.len(), hidden]`: 0 = the embeddings, `k` = decoder layer `k`'s output (the
    /// final norm never applied), positions from 0. The pipeline asks for the last layer
    /// (`config().num_hidden_layers`) and drops its template's system rows itself.
    fn features_at(&mut self, ids: &[u32], layer: usize) -> Result<TensorF32, TextEncoderError>;

    /// Qwen-Image's text context for one templated prompt: the last layer's features with the template's first
    /// `drop_rows` rows (its system block) removed, `[ids.len() - drop_rows, hidden]`.
    fn prompt_features(
        &mut self,
        ids: &[u32],
        drop_rows: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        rows_after_drop(ids.len(), drop_rows)
            .map_err(|e| TextEncoderError::Input(e.to_string()))?;
        let last = self.config().num_hidden_layers;
        let all = self.features_at(ids, last)?;
        let [rows, _] = all.dims::<2>("text features")?;
        if rows != ids.len() {
            return Err(TextEncoderError::Input(format!(
                "the encoder returned {rows} rows for {} tokens",
                ids.len()
            )));
        }
        Ok(all.skip_rows(drop_rows)?)
    }
}

/// A decode's 8-bit image, and the f32 images when they were asked for.
#[derive(Debug, Clone)]
pub struct DecodedPixels {
    /// `[batch, channels, height, width]` in [-1, 1], when kept.
    pub images: Option<TensorF32>,
    /// The first image's pixels, `[height, width, channels]` (as [`to_u8_hwc`] makes them).
    pub pixels: Vec<u8>,
    pub channels: usize,
    pub height: usize,
    pub width: usize,
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

    /// [`VaeBackend::decode_packed`] and the first image's 8-bit pixels; the f32 images are returned only when
    /// `keep_images` (a backend may then skip bringing them back).
    fn decode_packed_pixels(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
        keep_images: bool,
    ) -> Result<DecodedPixels, VaeError> {
        let images = self.decode_packed(packed, h, w)?;
        let [_, channels, height, width] = images.dims::<4>("decoded images")?;
        let pixels = to_u8_hwc(&images, 0)?;
        Ok(DecodedPixels {
            images: keep_images.then_some(images),
            pixels,
            channels,
            height,
            width,
        })
    }
}

/// Implements the component traits for encoders and decoders whose inherent methods of the same names are the
/// implementation (the host references and the GPU backends alike).
macro_rules! by_inherent_methods {
    (TextEncoderBackend for $($encoder:ty),+) => {$(
        impl TextEncoderBackend for $encoder {
            fn config(&self) -> &TextEncoderConfig {
                <$encoder>::config(self)
            }

            fn features_at(
                &mut self,
                ids: &[u32],
                layer: usize,
            ) -> Result<TensorF32, TextEncoderError> {
                <$encoder>::features_at(self, ids, layer)
            }
        }
    )+};
    (VaeBackend for $($decoder:ty),+) => {$(
        impl VaeBackend for $decoder {
            fn config(&self) -> &VaeConfig {
                <$decoder>::config(self)
            }

            fn decode_packed(
                &mut self,
                packed: &TensorF32,
                h: usize,
                w: usize,
            ) -> Result<TensorF32, VaeError> {
                <$decoder>::decode_packed(self, packed, h, w)
            }
        }
    )+};
}

by_inherent_methods!(TextEncoderBackend for HostTextEncoder, GpuTextEncoder);
by_inherent_methods!(VaeBackend for HostVaeDecoder);
