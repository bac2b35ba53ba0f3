//! The MiniMax H3 video VAE decoder (`vae/` of a diffusers folder, class `AutoencoderKLMiniMaxH3`): its bounded,
//! validated config, the decoder's tensor list, the chunk and tile geometry of a decode, the backend-neutral
//! [`VideoVaeBackend`] interface with its output ([`VideoFrames`]), and the f32 host reference.
//!
//! The decode, in the reference's order (`_decode`, `_decode_clip`, the ViT decoder, then the pipeline's video
//! decode step around them):
//! - the pipeline de-normalizes `z * latents_std + latents_mean` per channel;
//! - temporal chunks ([`ChunkGeometry`]): `token_drop` latents are notionally appended, the latents are padded by
//!   repeating the last one to a whole number of chunks, and each chunk decodes `tokens_chunk_size +
//!   token_overlap` latents (5 + 2 as released) into a clip of pixel frames. Of the clip, frames
//!   `[pre, chunk_frames)` are the chunk (`pre = frame_pre_padding`, 3) and frames `[chunk_frames + pre, ..)` the
//!   overlap (5), cross-faded linearly into the first frames of the next chunk; the last overlap is appended, and
//!   the frames the padding latents produced are cut from the end;
//! - spatial tiles ([`TilePlan`], on by default: 256 px tiles with at least 64 px overlap, the slack spread over
//!   the overlaps in steps of the spatial ratio): each tile of each clip is decoded on its own, a tile is blended
//!   linearly with the original tile above it over their overlap, the result with the original tile to its left,
//!   then cropped and the tiles concatenated;
//! - per tile: `post_quant_conv` (1x1x1), one token per latent voxel (`proj_in`), the learned register tokens and
//!   one zero token appended (all at position 0), `decoder_num_layers` blocks (RMSNorm, attention with RMS-normed
//!   q and k without affine and rotate-half RoPE over the first `head_dim * rope_dim_ratio` channels, positions per
//!   axis `2 (i + 0.5) / n - 1` scaled by 2 pi with `theta = decoder_rope_theta`, the layer scale `scale1`;
//!   RMSNorm, SwiGLU `[value | gate]` with bias, `scale2`), LayerNorm, `proj_out`, and the un-patchify of every
//!   voxel token into `temporal_ratio x spatial_ratio x spatial_ratio` pixels of each output channel;
//! - the pipeline's ImageNet de-normalization `x * std + mean`, the clamp to `[0, 1]` and PIL's 8-bit conversion
//!   `round(x * 255)` (ties to even).
//!
//! The encoder side of the checkpoint (`encoder.`, `quant_conv.`) is not used by a decode and is ignored at load;
//! any other tensor the decoder does not know is an error.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

use crate::nn::backend_error::GpuError;
use crate::nn::config::{
    at_most, check_class_name, check_per_channel, checked_product, in_range, names_class,
    parse_validated,
};
use crate::nn::host::{
    add_bias, attention, linear, norm_modulate, rope_rotate_half_partial, swiglu_fused,
    AttentionMask, NormKind, NormModulation, RopeTableRounding,
};
use crate::nn::tensor::{ShapeError, TensorF32};
use crate::nn::weights::{ModelDir, TensorSpec, WeightsError, FLOAT_DTYPES};

pub mod geometry;
use geometry::blend_frames;
pub use geometry::{
    blend_weights, rope_tables, split_tiles, stitch_tiles, unpatchify, AxisTiles, ChunkGeometry,
    ChunkPlan, TilePlan, TilingOptions,
};

/// The diffusers class name this config describes.
pub const CLASS_NAME: &str = "AutoencoderKLMiniMaxH3";

/// Checkpoint prefixes of the encoder side, which a decode does not read.
pub const ENCODER_PREFIXES: [&str; 2] = ["encoder.", "quant_conv."];

/// The pipeline's pixel convention: ImageNet mean and standard deviation per RGB channel.
pub const PIXEL_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// See [`PIXEL_MEAN`].
pub const PIXEL_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// RoPE axes of the ViT decoder (frame, row, column).
const ROPE_AXES: usize = 3;

// Upper bounds, far above the released model (in the comment).
const MAX_CHANNELS: usize = 4096; // latent_channels 24, block_out_channels up to 1024
const MAX_STAGES: usize = 16; // 6 encoder stages
const MAX_FACTOR: usize = 8; // 2
const MAX_SPATIAL_RATIO: usize = 64; // 16
const MAX_TEMPORAL_RATIO: usize = 16; // 4
const MAX_LAYERS: usize = 1024; // 36
const MAX_HEADS: usize = 1024; // 32
const MAX_HEAD_DIM: usize = 1024; // 64
const MAX_WIDTH: usize = 1 << 15; // dim 2048
const MAX_REGISTERS: usize = 1024; // 4
const MAX_FFN_MULT: usize = 64; // 4
const MAX_CLIP_LENGTH: usize = 1024; // 17
const MAX_LAYERS_PER_BLOCK: usize = 64; // 2
/// Decoder parameters, at most (the released decoder has 2.4e9).
const MAX_PARAMETERS: usize = 1 << 36;
/// Latent frames per decode (5 n + 2 for 17 n + 5 pixel frames; 1 hour at 24 fps is about 21600).
pub const MAX_LATENT_FRAMES: usize = 1 << 15;
/// Latent rows or columns per decode (16 px each as released).
pub const MAX_LATENT_SIDE: usize = 1 << 12;
/// Values of the decoded video (`frames x height x width x 3`) a decode may produce.
pub const MAX_OUTPUT_VALUES: usize = 1 << 33;
/// Tokens of one decoded tile (voxels of a clip's tile plus the register and zero tokens).
pub const MAX_TILE_TOKENS: usize = 1 << 20;

/// A config that cannot describe a model this crate runs. The message names the file and the key.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{file}: MiniMax H3 video VAE config: {why}")]
pub struct VideoVaeConfigError {
    /// The config file (or `config.json` when it was parsed from a value).
    pub file: String,
    /// What is wrong, naming the key, and what would fix it.
    pub why: String,
}

/// Why a load or a decode failed.
#[derive(Debug, Error)]
pub enum VideoVaeError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] VideoVaeConfigError),
    #[error("shape mismatch: {0}")]
    Shape(#[from] ShapeError),
    /// A tensor present with the right shape whose values cannot be used.
    #[error("{file}: tensor {tensor:?}: {why}")]
    Checkpoint {
        file: String,
        tensor: String,
        why: String,
    },
    /// A decode request (latents, tiling) this decoder cannot take.
    #[error("invalid MiniMax H3 video VAE input: {0}")]
    Input(String),
    /// The GPU backend failed (driver, cuBLASLt, kernels, memory); the typed cause is the source.
    #[error("MiniMax H3 video VAE GPU backend: {0}")]
    Gpu(#[from] GpuError),
}

fn d_three() -> usize {
    3
}
fn d_latent_channels() -> usize {
    24
}
fn d_block_out_channels() -> Vec<usize> {
    vec![128, 256, 256, 512, 512, 1024]
}
fn d_layers_per_block() -> usize {
    2
}
fn d_spatial_factors() -> Vec<usize> {
    vec![2, 2, 2, 2, 1, 1]
}
fn d_temporal_factors() -> Vec<usize> {
    vec![1, 2, 2, 1, 1, 1]
}
fn d_norm_num_groups() -> usize {
    32
}
fn d_norm_eps() -> f64 {
    1e-6
}
fn d_padding_mode() -> String {
    "reflect".to_string()
}
fn d_decoder_layers() -> usize {
    36
}
fn d_decoder_heads() -> usize {
    32
}
fn d_decoder_head_dim() -> usize {
    64
}
fn d_registers() -> usize {
    4
}
fn d_ffn_mult() -> usize {
    4
}
fn d_rope_theta() -> f64 {
    100.0
}
fn d_rope_ratio() -> f64 {
    0.75
}
fn d_decoder_eps() -> f64 {
    1e-5
}
fn d_clip_length() -> usize {
    17
}
fn d_token_drop() -> usize {
    3
}
fn d_latents_mean() -> Vec<f64> {
    vec![0.0; 24]
}
fn d_latents_std() -> Vec<f64> {
    vec![1.0; 24]
}

/// `AutoencoderKLMiniMaxH3` hyper-parameters, with the diffusers defaults for absent keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VideoVaeConfig {
    #[serde(rename = "_class_name", default)]
    pub class_name: Option<String>,
    /// Encoder input channels (RGB).
    #[serde(default = "d_three")]
    pub in_channels: usize,
    /// Decoder output channels (RGB; the pipeline de-normalizes three).
    #[serde(default = "d_three")]
    pub out_channels: usize,
    #[serde(default = "d_latent_channels")]
    pub latent_channels: usize,
    /// Encoder widths (not used by a decode).
    #[serde(default = "d_block_out_channels")]
    pub block_out_channels: Vec<usize>,
    #[serde(default = "d_layers_per_block")]
    pub layers_per_block: usize,
    /// Their product is the spatial ratio: the decoder's patch size.
    #[serde(default = "d_spatial_factors")]
    pub spatial_downsample_factors: Vec<usize>,
    /// Their product is the temporal ratio: the decoder's temporal patch size.
    #[serde(default = "d_temporal_factors")]
    pub temporal_downsample_factors: Vec<usize>,
    #[serde(default = "d_norm_num_groups")]
    pub norm_num_groups: usize,
    #[serde(default = "d_norm_eps")]
    pub norm_eps: f64,
    #[serde(default = "d_padding_mode")]
    pub spatial_padding_mode: String,
    #[serde(default = "d_decoder_layers")]
    pub decoder_num_layers: usize,
    #[serde(default = "d_decoder_heads")]
    pub decoder_num_attention_heads: usize,
    #[serde(default = "d_decoder_head_dim")]
    pub decoder_attention_head_dim: usize,
    #[serde(default = "d_registers")]
    pub decoder_num_register_tokens: usize,
    #[serde(default = "d_ffn_mult")]
    pub decoder_ffn_mult: usize,
    #[serde(default = "d_rope_theta")]
    pub decoder_rope_theta: f64,
    #[serde(default = "d_rope_ratio")]
    pub decoder_rope_dim_ratio: f64,
    #[serde(default = "d_decoder_eps")]
    pub decoder_norm_eps: f64,
    /// Pixel frames per encoder chunk (17); fixes the decoder's chunk geometry.
    #[serde(default = "d_clip_length")]
    pub clip_length: usize,
    /// Trailing latents dropped per encoded chunk (3).
    #[serde(default = "d_token_drop")]
    pub token_drop: usize,
    /// Per-channel mean the pipeline adds back before the decode.
    #[serde(default = "d_latents_mean")]
    pub latents_mean: Vec<f64>,
    /// Per-channel standard deviation the pipeline multiplies by before the decode.
    #[serde(default = "d_latents_std")]
    pub latents_std: Vec<f64>,
}

/// Whether a parsed `config.json` names this class (`_class_name`).
pub fn names_this_class(config_json: &serde_json::Value) -> bool {
    names_class(config_json, CLASS_NAME)
}

impl Default for VideoVaeConfig {
    fn default() -> Self {
        VideoVaeConfig {
            class_name: Some(CLASS_NAME.to_string()),
            in_channels: 3,
            out_channels: 3,
            latent_channels: d_latent_channels(),
            block_out_channels: d_block_out_channels(),
            layers_per_block: d_layers_per_block(),
            spatial_downsample_factors: d_spatial_factors(),
            temporal_downsample_factors: d_temporal_factors(),
            norm_num_groups: d_norm_num_groups(),
            norm_eps: d_norm_eps(),
            spatial_padding_mode: d_padding_mode(),
            decoder_num_layers: d_decoder_layers(),
            decoder_num_attention_heads: d_decoder_heads(),
            decoder_attention_head_dim: d_decoder_head_dim(),
            decoder_num_register_tokens: d_registers(),
            decoder_ffn_mult: d_ffn_mult(),
            decoder_rope_theta: d_rope_theta(),
            decoder_rope_dim_ratio: d_rope_ratio(),
            decoder_norm_eps: d_decoder_eps(),
            clip_length: d_clip_length(),
            token_drop: d_token_drop(),
            latents_mean: d_latents_mean(),
            latents_std: d_latents_std(),
        }
    }
}

fn finite_positive(key: &str, v: f64, max: f64) -> Result<(), String> {
    if v.is_finite() && v > 0.0 && v <= max {
        Ok(())
    } else {
        Err(format!("`{key}` = {v} must be finite and in (0, {max}]"))
    }
}

impl VideoVaeConfig {
    /// Parses and validates a `config.json` value; errors name `config.json`.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, VideoVaeConfigError> {
        Self::from_json_file(value, Path::new("config.json"))
    }

    /// Parses and validates the value read from `file` (named in every error).
    pub fn from_json_file(
        value: &serde_json::Value,
        file: &Path,
    ) -> Result<Self, VideoVaeConfigError> {
        parse_validated(value, file, VideoVaeConfig::validate)
            .map_err(|(file, why)| VideoVaeConfigError { file, why })
    }

    /// Checks the class name, every size against its upper bound, the rules the reference enforces (RoPE width a
    /// multiple of 6) and those a decode needs (RGB output, a drop shorter than a chunk, `latents_mean` and
    /// `latents_std` one finite value per channel, with a non-zero std), and the parameter count, with checked
    /// arithmetic. The error names the key and the rule.
    pub fn validate(&self) -> Result<(), String> {
        check_class_name(
            self.class_name.as_deref(),
            CLASS_NAME,
            "the vae/ folder of a MiniMax H3 model",
        )?;
        for (key, value, max) in [
            ("in_channels", self.in_channels, MAX_CHANNELS),
            ("latent_channels", self.latent_channels, MAX_CHANNELS),
            (
                "layers_per_block",
                self.layers_per_block,
                MAX_LAYERS_PER_BLOCK,
            ),
            ("norm_num_groups", self.norm_num_groups, MAX_CHANNELS),
            ("decoder_num_layers", self.decoder_num_layers, MAX_LAYERS),
            (
                "decoder_num_attention_heads",
                self.decoder_num_attention_heads,
                MAX_HEADS,
            ),
            (
                "decoder_attention_head_dim",
                self.decoder_attention_head_dim,
                MAX_HEAD_DIM,
            ),
            ("decoder_ffn_mult", self.decoder_ffn_mult, MAX_FFN_MULT),
            ("clip_length", self.clip_length, MAX_CLIP_LENGTH),
            (
                "block_out_channels (count)",
                self.block_out_channels.len(),
                MAX_STAGES,
            ),
            (
                "spatial_downsample_factors (count)",
                self.spatial_downsample_factors.len(),
                MAX_STAGES,
            ),
            (
                "temporal_downsample_factors (count)",
                self.temporal_downsample_factors.len(),
                MAX_STAGES,
            ),
        ] {
            in_range(key, value, max)?;
        }
        at_most(
            "decoder_num_register_tokens",
            self.decoder_num_register_tokens,
            MAX_REGISTERS,
        )?;
        if self.out_channels != 3 {
            return Err(format!(
                "`out_channels` = {}: the decode produces RGB frames (3 channels), which the pipeline de-normalizes with ImageNet's statistics",
                self.out_channels
            ));
        }
        for (i, &c) in self.block_out_channels.iter().enumerate() {
            in_range(&format!("block_out_channels[{i}]"), c, MAX_CHANNELS)?;
        }
        for (key, factors, max) in [
            (
                "spatial_downsample_factors",
                &self.spatial_downsample_factors,
                MAX_SPATIAL_RATIO,
            ),
            (
                "temporal_downsample_factors",
                &self.temporal_downsample_factors,
                MAX_TEMPORAL_RATIO,
            ),
        ] {
            for (i, &f) in factors.iter().enumerate() {
                in_range(&format!("{key}[{i}]"), f, MAX_FACTOR)?;
            }
            let product = checked_product(&format!("`{key}` product"), factors)?;
            if product > max {
                return Err(format!(
                    "`{key}` multiply to {product}, above the supported ratio {max}"
                ));
            }
        }
        finite_positive("norm_eps", self.norm_eps, 1.0)?;
        finite_positive("decoder_norm_eps", self.decoder_norm_eps, 1.0)?;
        finite_positive("decoder_rope_theta", self.decoder_rope_theta, 1e9)?;
        finite_positive("decoder_rope_dim_ratio", self.decoder_rope_dim_ratio, 1.0)?;
        let dim = self.dim_checked()?;
        if dim > MAX_WIDTH {
            return Err(format!(
                "`decoder_num_attention_heads` x `decoder_attention_head_dim` = {dim}, above the supported width {MAX_WIDTH}"
            ));
        }
        let rope = self.rope_dim();
        if rope == 0 || !rope.is_multiple_of(2 * ROPE_AXES) {
            return Err(format!(
                "`decoder_attention_head_dim` x `decoder_rope_dim_ratio` = {rope} rotated channels: the reference needs a positive multiple of {} (3 axes of cos/sin pairs)",
                2 * ROPE_AXES
            ));
        }
        // torch.arange(0, 1, 6 / rope) must give rope / 6 frequencies (it does for every multiple of 6 up to the
        // bound; checked so the tables can never disagree with the reference's).
        let step = (2 * ROPE_AXES) as f64 / rope as f64;
        if (1.0 / step).ceil() as usize != rope / (2 * ROPE_AXES) {
            return Err(format!(
                "`decoder_rope_dim_ratio`: {rope} rotated channels give a frequency count the reference rounds differently"
            ));
        }
        let chunk = self.clip_length.div_ceil(self.temporal_ratio());
        if self.token_drop >= chunk {
            return Err(format!(
                "`token_drop` = {} must be below the {chunk} latents of a chunk (`clip_length` {} over the temporal ratio {})",
                self.token_drop,
                self.clip_length,
                self.temporal_ratio()
            ));
        }
        for (key, values, nonzero) in [
            ("latents_mean", &self.latents_mean, false),
            ("latents_std", &self.latents_std, true),
        ] {
            check_per_channel(key, values, self.latent_channels, nonzero)?;
        }
        let params = self.parameter_count_checked()?;
        if params > MAX_PARAMETERS {
            return Err(format!(
                "the decoder has {params} parameters, above the supported {MAX_PARAMETERS} (check the decoder_* sizes)"
            ));
        }
        Ok(())
    }

    fn dim_checked(&self) -> Result<usize, String> {
        checked_product(
            "`decoder_num_attention_heads` x `decoder_attention_head_dim`",
            &[
                self.decoder_num_attention_heads,
                self.decoder_attention_head_dim,
            ],
        )
    }

    /// Width of the ViT decoder: heads x head dim.
    pub fn dim(&self) -> usize {
        self.dim_checked().unwrap_or(0)
    }

    /// Rotated channels per head: `int(head_dim * rope_dim_ratio)`, as the reference truncates it.
    pub fn rope_dim(&self) -> usize {
        let r = self.decoder_attention_head_dim as f64 * self.decoder_rope_dim_ratio;
        if r.is_finite() && r >= 0.0 {
            r as usize
        } else {
            0
        }
    }

    /// SwiGLU hidden width (`dim * ffn_mult`); the fused projection has twice as many rows.
    pub fn ffn_inner(&self) -> usize {
        self.dim().saturating_mul(self.decoder_ffn_mult)
    }

    /// Pixels per latent row or column: the product of `spatial_downsample_factors`.
    pub fn spatial_ratio(&self) -> usize {
        self.spatial_downsample_factors.iter().product()
    }

    /// Pixel frames per latent frame: the product of `temporal_downsample_factors`.
    pub fn temporal_ratio(&self) -> usize {
        self.temporal_downsample_factors.iter().product()
    }

    /// Output values of one voxel token: `out_channels x temporal x spatial x spatial`.
    pub fn patch_values(&self) -> usize {
        self.out_channels
            .saturating_mul(self.temporal_ratio())
            .saturating_mul(self.spatial_ratio())
            .saturating_mul(self.spatial_ratio())
    }

    /// The temporal chunking a decode applies.
    pub fn chunk_geometry(&self) -> ChunkGeometry {
        ChunkGeometry::new(self.clip_length, self.temporal_ratio(), self.token_drop)
    }

    fn parameter_count_checked(&self) -> Result<usize, String> {
        crate::nn::weights::element_total(&self.tensor_specs())
    }

    /// Decoder parameters (with `post_quant_conv`; a validated config never overflows).
    pub fn parameter_count(&self) -> usize {
        self.parameter_count_checked().unwrap_or(usize::MAX)
    }

    /// Every tensor a decode reads, in diffusers names: `post_quant_conv` and `decoder.*`.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let (c, d) = (self.latent_channels, self.dim());
        let inner = self.ffn_inner();
        let mut specs = vec![
            spec("post_quant_conv.weight", vec![c, c, 1, 1, 1]),
            spec("post_quant_conv.bias", vec![c]),
            spec(
                "decoder.register_tokens",
                vec![1, self.decoder_num_register_tokens, d],
            ),
            spec("decoder.proj_in.weight", vec![d, c]),
            spec("decoder.proj_in.bias", vec![d]),
        ];
        for i in 0..self.decoder_num_layers {
            let p = format!("decoder.transformer_blocks.{i}");
            for (name, shape) in [
                ("scale1", vec![d]),
                ("scale2", vec![d]),
                ("norm1.weight", vec![d]),
                ("norm2.weight", vec![d]),
                ("attn.to_q.weight", vec![d, d]),
                ("attn.to_q.bias", vec![d]),
                ("attn.to_k.weight", vec![d, d]),
                ("attn.to_k.bias", vec![d]),
                ("attn.to_v.weight", vec![d, d]),
                ("attn.to_v.bias", vec![d]),
                ("attn.to_out.0.weight", vec![d, d]),
                ("attn.to_out.0.bias", vec![d]),
                ("ff.net.0.proj.weight", vec![2 * inner, d]),
                ("ff.net.0.proj.bias", vec![2 * inner]),
                ("ff.net.2.weight", vec![d, inner]),
                ("ff.net.2.bias", vec![d]),
            ] {
                specs.push(spec(&format!("{p}.{name}"), shape));
            }
        }
        let p = self.patch_values();
        specs.extend([
            spec("decoder.norm_out.weight", vec![d]),
            spec("decoder.norm_out.bias", vec![d]),
            spec("decoder.proj_out.weight", vec![p, d]),
            spec("decoder.proj_out.bias", vec![p]),
        ]);
        specs
    }
}

fn spec(name: &str, shape: Vec<usize>) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        shape,
        dtypes: FLOAT_DTYPES.to_vec(),
    }
}

// ---- interface ----------------------------------------------------------------------------------------------------

/// A decoded video as the pipeline hands it on.
#[derive(Clone, Debug, PartialEq)]
pub struct VideoFrames {
    pub frames: usize,
    pub height: usize,
    pub width: usize,
    /// 8-bit RGB `[frames, height, width, 3]`: `round(pixels * 255)`, ties to even, as PIL's conversion.
    pub rgb: Vec<u8>,
    /// The de-normalized, clamped frames before quantization, `[frames, height, width, 3]` in `[0, 1]`.
    pub pixels: Vec<f32>,
}

/// The video VAE decoder as a pipeline uses it; the host reference and the GPU backend implement it.
pub trait VideoVaeBackend {
    /// The model config.
    fn config(&self) -> &VideoVaeConfig;

    /// The spatial tiling decodes use.
    fn tiling(&self) -> TilingOptions;

    /// Sets the tiling of later decodes (checked against the spatial ratio).
    fn set_tiling(&mut self, tiling: TilingOptions) -> Result<(), VideoVaeError>;

    /// The model's `decode`: de-normalized latents `[1, latent_channels, frames, h, w]` to the sample `[1, 3,
    /// out_frames, h * ratio, w * ratio]` (ImageNet-normalized, not clamped).
    fn decode_sample(&mut self, latents: &TensorF32) -> Result<TensorF32, VideoVaeError>;

    /// The pipeline's video decode: normalized latents (the DiT's output) `[1, latent_channels, frames, h, w]` to
    /// 8-bit frames: `z * latents_std + latents_mean`, the model's decode, `x * std + mean` (ImageNet), the clamp
    /// to `[0, 1]` and the 8-bit rounding.
    fn decode(&mut self, latents: &TensorF32) -> Result<VideoFrames, VideoVaeError>;

    /// Frees the memory a decode works in (the weights stay); the next decode makes it again. A resident
    /// pipeline calls it after the decode, so the next request's DiT never runs beside it.
    fn release_workspace(&mut self) {}

    /// [`Self::decode`] spread over the ranks of a multi-GPU job (`comm`: the job's DiT communicator): every rank
    /// calls it with the same latents; rank 0 gets the frames, the other ranks `None`. Only the GPU backend can;
    /// the others refuse.
    fn decode_spread(
        &mut self,
        latents: &TensorF32,
        comm: &tf_nccl::Comm,
    ) -> Result<Option<VideoFrames>, VideoVaeError> {
        let _ = latents;
        Err(VideoVaeError::Input(format!(
            "this video VAE backend decodes in one process; spreading the decode over {} ranks needs the GPU backend",
            comm.world_size()
        )))
    }
}

/// Checks decode latents `[1, latent_channels, frames, h, w]` and the output they make before anything is
/// allocated; returns `(frames, h, w)` and the chunk plan.
pub fn check_latents(
    config: &VideoVaeConfig,
    shape: &[usize],
) -> Result<((usize, usize, usize), ChunkPlan), VideoVaeError> {
    let c = config.latent_channels;
    let &[b, ch, f, h, w] = shape else {
        return Err(VideoVaeError::Input(format!(
            "latents must be [1, {c}, frames, height, width], got shape {shape:?}"
        )));
    };
    if b != 1 || ch != c {
        return Err(VideoVaeError::Input(format!(
            "latents are {shape:?}; this VAE decodes one video of {c} channels: [1, {c}, frames, height, width]"
        )));
    }
    if f > MAX_LATENT_FRAMES || h == 0 || w == 0 || h > MAX_LATENT_SIDE || w > MAX_LATENT_SIDE {
        return Err(VideoVaeError::Input(format!(
            "a {f} x {h} x {w} latent video: the decode takes up to {MAX_LATENT_FRAMES} frames of 1..={MAX_LATENT_SIDE} rows and columns"
        )));
    }
    let plan = config
        .chunk_geometry()
        .plan(f)
        .map_err(VideoVaeError::Input)?;
    let r = config.spatial_ratio();
    let values = checked_product("decoded video", &[plan.out_frames, h, r, w, r, 3])
        .map_err(VideoVaeError::Input)?;
    if values > MAX_OUTPUT_VALUES {
        return Err(VideoVaeError::Input(format!(
            "{f} x {h} x {w} latents decode to {values} values, above the supported {MAX_OUTPUT_VALUES}"
        )));
    }
    Ok(((f, h, w), plan))
}

/// The pipeline's latent de-normalization `z * latents_std + latents_mean` per channel (f32), on checked latents.
pub fn denormalize_latents(
    config: &VideoVaeConfig,
    latents: &TensorF32,
) -> Result<TensorF32, VideoVaeError> {
    let ((f, h, w), _) = check_latents(config, latents.shape())?;
    let voxels = f * h * w;
    let mut z = latents.data().to_vec();
    for (ch, plane) in z.chunks_exact_mut(voxels).enumerate() {
        let (s, m) = (
            config.latents_std[ch] as f32,
            config.latents_mean[ch] as f32,
        );
        plane.iter_mut().for_each(|v| *v = *v * s + m);
    }
    Ok(TensorF32::new(latents.shape().to_vec(), z)?)
}

/// The pipeline's conversion of one value of output channel `c`: ImageNet de-normalization, clamp, and the 8-bit
/// value `round(x * 255)` (ties to even).
pub fn finalize_value(x: f32, c: usize) -> (f32, u8) {
    let v = (x * PIXEL_STD[c] + PIXEL_MEAN[c]).clamp(0.0, 1.0);
    (v, (v * 255.0).round_ties_even() as u8)
}

/// The pipeline's 8-bit frames of a model sample `[1, 3, frames, height, width]`.
pub fn frames_from_sample(sample: &TensorF32) -> Result<VideoFrames, VideoVaeError> {
    let [_, c, f, h, w] = sample.dims::<5>("video sample")?;
    if c != 3 {
        return Err(VideoVaeError::Input(format!(
            "a sample of {c} channels; the frames are RGB"
        )));
    }
    let plane = f * h * w;
    let mut pixels = vec![0f32; plane * 3];
    let mut rgb = vec![0u8; plane * 3];
    for (ch, src) in sample.data().chunks_exact(plane).enumerate().take(3) {
        for (i, &x) in src.iter().enumerate() {
            let (v, b) = finalize_value(x, ch);
            pixels[i * 3 + ch] = v;
            rgb[i * 3 + ch] = b;
        }
    }
    Ok(VideoFrames {
        frames: f,
        height: h,
        width: w,
        rgb,
        pixels,
    })
}

// ---- host reference -----------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct HostLinear {
    weight: Vec<f32>,
    bias: Vec<f32>,
    out: usize,
    inp: usize,
}

impl HostLinear {
    fn run(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, VideoVaeError> {
        let mut y = vec![0f32; rows * self.out];
        linear(x, rows, self.inp, &self.weight, self.out, &mut y)?;
        add_bias(&mut y, rows, self.out, &self.bias)?;
        Ok(y)
    }
}

#[derive(Debug, Clone)]
struct HostBlock {
    norm1: Vec<f32>,
    q: HostLinear,
    k: HostLinear,
    v: HostLinear,
    out: HostLinear,
    scale1: Vec<f32>,
    norm2: Vec<f32>,
    ff_in: HostLinear,
    ff_out: HostLinear,
    scale2: Vec<f32>,
}

/// The f32 host reference of the video VAE decode.
#[derive(Debug, Clone)]
pub struct HostVideoVae {
    config: VideoVaeConfig,
    tiling: TilingOptions,
    post_quant: HostLinear,
    proj_in: HostLinear,
    registers: Vec<f32>,
    blocks: Vec<HostBlock>,
    norm_out_weight: Vec<f32>,
    norm_out_bias: Vec<f32>,
    proj_out: HostLinear,
}

struct Take<'a> {
    tensors: &'a mut BTreeMap<String, TensorF32>,
    place: String,
}

impl Take<'_> {
    fn take(&mut self, name: &str) -> Result<Vec<f32>, VideoVaeError> {
        let values = self
            .tensors
            .remove(name)
            .map(TensorF32::into_data)
            .ok_or_else(|| {
                VideoVaeError::Weights(WeightsError::MissingTensor {
                    name: name.to_string(),
                    place: self.place.clone(),
                })
            })?;
        if values.iter().any(|v| !v.is_finite()) {
            return Err(VideoVaeError::Checkpoint {
                file: self.place.clone(),
                tensor: name.to_string(),
                why: "holds a value that is not finite".into(),
            });
        }
        Ok(values)
    }

    fn linear(&mut self, p: &str, out: usize, inp: usize) -> Result<HostLinear, VideoVaeError> {
        Ok(HostLinear {
            weight: self.take(&format!("{p}.weight"))?,
            bias: self.take(&format!("{p}.bias"))?,
            out,
            inp,
        })
    }
}

/// Checks a model folder's config and tensors for a decode: the config (errors name `config.json` in the folder),
/// every decoder tensor's presence, shape and dtype, the encoder side accepted as stored, nothing else.
pub fn check_model(model: &ModelDir) -> Result<VideoVaeConfig, VideoVaeError> {
    let file = model.dir().join("config.json");
    let config = VideoVaeConfig::from_json_file(model.config_json(), &file)?;
    let mut specs = config.tensor_specs();
    for name in model.names() {
        if ENCODER_PREFIXES.iter().any(|p| name.starts_with(p)) {
            let info = model.info(name)?;
            specs.push(TensorSpec {
                name: name.to_string(),
                shape: info.shape.clone(),
                dtypes: vec![info.dtype],
            });
        }
    }
    model.check(&specs)?;
    Ok(config)
}

impl HostVideoVae {
    /// Loads a diffusers `vae/` folder: validates `config.json`, checks every decoder tensor (see [`check_model`]),
    /// converts them to f32 and refuses a non-finite value, naming the tensor.
    pub fn load(model: &ModelDir) -> Result<HostVideoVae, VideoVaeError> {
        let config = check_model(model)?;
        let names: Vec<String> = config.tensor_specs().into_iter().map(|s| s.name).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let (mut tensors, _) = model.load_f32(&refs)?;
        let mut t = Take {
            tensors: &mut tensors,
            place: model.dir().display().to_string(),
        };
        let (c, d, inner) = (config.latent_channels, config.dim(), config.ffn_inner());
        let post_quant = t.linear("post_quant_conv", c, c)?;
        let proj_in = t.linear("decoder.proj_in", d, c)?;
        let registers = t.take("decoder.register_tokens")?;
        let mut blocks = Vec::with_capacity(config.decoder_num_layers);
        for i in 0..config.decoder_num_layers {
            let p = format!("decoder.transformer_blocks.{i}");
            blocks.push(HostBlock {
                norm1: t.take(&format!("{p}.norm1.weight"))?,
                q: t.linear(&format!("{p}.attn.to_q"), d, d)?,
                k: t.linear(&format!("{p}.attn.to_k"), d, d)?,
                v: t.linear(&format!("{p}.attn.to_v"), d, d)?,
                out: t.linear(&format!("{p}.attn.to_out.0"), d, d)?,
                scale1: t.take(&format!("{p}.scale1"))?,
                norm2: t.take(&format!("{p}.norm2.weight"))?,
                ff_in: t.linear(&format!("{p}.ff.net.0.proj"), 2 * inner, d)?,
                ff_out: t.linear(&format!("{p}.ff.net.2"), d, inner)?,
                scale2: t.take(&format!("{p}.scale2"))?,
            });
        }
        Ok(HostVideoVae {
            norm_out_weight: t.take("decoder.norm_out.weight")?,
            norm_out_bias: t.take("decoder.norm_out.bias")?,
            proj_out: t.linear("decoder.proj_out", config.patch_values(), d)?,
            tiling: TilingOptions::default(),
            config,
            post_quant,
            proj_in,
            registers,
            blocks,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &VideoVaeConfig {
        &self.config
    }

    /// The spatial tiling decodes use.
    pub fn tiling(&self) -> TilingOptions {
        self.tiling
    }

    /// Sets the tiling of later decodes.
    pub fn set_tiling(&mut self, tiling: TilingOptions) -> Result<(), VideoVaeError> {
        tiling
            .check(self.config.spatial_ratio())
            .map_err(VideoVaeError::Input)?;
        self.tiling = tiling;
        Ok(())
    }

    /// The ViT decoder on one tile of post-quant latents `[C, frames, rows, cols]` (channel-first): the sample
    /// `[3, frames * pt, rows * ps, cols * ps]` (`decoder(post_quant_conv(tile))` without the post-quant conv).
    pub fn decode_tile(
        &self,
        z: &[f32],
        (frames, rows, cols): (usize, usize, usize),
    ) -> Result<Vec<f32>, VideoVaeError> {
        let cfg = &self.config;
        let (c, d) = (cfg.latent_channels, cfg.dim());
        let (heads, hd) = (
            cfg.decoder_num_attention_heads,
            cfg.decoder_attention_head_dim,
        );
        let voxels = frames * rows * cols;
        let regs = cfg.decoder_num_register_tokens;
        let s = voxels + regs + 1;
        if s > MAX_TILE_TOKENS || z.len() != c * voxels {
            return Err(VideoVaeError::Input(format!(
                "a tile of {frames} x {rows} x {cols} latents ({} values) makes {s} tokens; at most {MAX_TILE_TOKENS}",
                z.len()
            )));
        }
        let eps = cfg.decoder_norm_eps as f32;
        // Tokens: voxels (frame, row, column order) through proj_in, the registers, a zero token.
        let mut tokens = vec![0f32; voxels * c];
        for ch in 0..c {
            for v in 0..voxels {
                tokens[v * c + ch] = z[ch * voxels + v];
            }
        }
        let mut x = self.proj_in.run(&tokens, voxels)?;
        x.extend_from_slice(&self.registers);
        x.resize(s * d, 0.0);
        let rope = cfg.rope_dim();
        let (cos, sin) = rope_tables((frames, rows, cols), regs, rope, cfg.decoder_rope_theta);
        let block_ids = vec![0i32; s];
        let valid = vec![true; s];
        let mask = AttentionMask {
            q_offset: 0,
            block_ids: &block_ids,
            key_valid: &valid,
        };
        let rms = |w: Option<&[f32]>, input: &[f32], rows: usize, cols: usize| {
            let mut out = vec![0f32; input.len()];
            norm_modulate(
                input,
                rows,
                cols,
                NormKind::RmsNorm,
                NormModulation {
                    weight: w,
                    bias: None,
                    scale: None,
                    shift: None,
                    n_mod: 0,
                    row_mod: &[],
                },
                eps,
                &mut out,
            )
            .map(|()| out)
        };
        let inner = cfg.ffn_inner();
        for b in &self.blocks {
            let n = rms(Some(&b.norm1), &x, s, d)?;
            let mut q = rms(None, &b.q.run(&n, s)?, s * heads, hd)?;
            let mut k = rms(None, &b.k.run(&n, s)?, s * heads, hd)?;
            let v = b.v.run(&n, s)?;
            for t in [&mut q, &mut k] {
                rope_rotate_half_partial(
                    t,
                    s,
                    heads,
                    hd,
                    rope,
                    &cos,
                    &sin,
                    RopeTableRounding::F32,
                )?;
            }
            let mut o = vec![0f32; s * d];
            attention(&q, &k, &v, s, s, heads, hd, mask, &mut o)?;
            let a = b.out.run(&o, s)?;
            residual(&mut x, &a, &b.scale1);
            let n = rms(Some(&b.norm2), &x, s, d)?;
            let fused = b.ff_in.run(&n, s)?;
            let mut act = vec![0f32; s * inner];
            swiglu_fused(&fused, s, inner, false, &mut act)?;
            let f = b.ff_out.run(&act, s)?;
            residual(&mut x, &f, &b.scale2);
        }
        let mut n = vec![0f32; s * d];
        norm_modulate(
            &x,
            s,
            d,
            NormKind::LayerNorm,
            NormModulation {
                weight: Some(&self.norm_out_weight),
                bias: Some(&self.norm_out_bias),
                scale: None,
                shift: None,
                n_mod: 0,
                row_mod: &[],
            },
            eps,
            &mut n,
        )?;
        let out = self.proj_out.run(&n[..voxels * d], voxels)?;
        Ok(unpatchify(
            &out,
            (frames, rows, cols),
            cfg.out_channels,
            cfg.temporal_ratio(),
            cfg.spatial_ratio(),
        ))
    }

    /// `post_quant_conv` over latents `[C, n]` (channel-first), as a 1x1x1 convolution.
    fn post_quant(&self, z: &[f32], n: usize) -> Result<Vec<f32>, VideoVaeError> {
        let c = self.config.latent_channels;
        let mut out = vec![0f32; c * n];
        // [C_out, C_in] x [C_in, n]: one linear per voxel, voxels as rows.
        let mut tokens = vec![0f32; n * c];
        for ch in 0..c {
            for v in 0..n {
                tokens[v * c + ch] = z[ch * n + v];
            }
        }
        let y = self.post_quant.run(&tokens, n)?;
        for v in 0..n {
            for ch in 0..c {
                out[ch * n + v] = y[v * c + ch];
            }
        }
        Ok(out)
    }

    /// One clip `[C, clip_latents, h, w]` of post-quant latents: decoded tile by tile and stitched into `[3,
    /// clip_frames, H, W]` (`_decode_clip`).
    fn decode_clip(
        &self,
        z: &[f32],
        (frames, h, w): (usize, usize, usize),
        tiles: &TilePlan,
    ) -> Result<Vec<f32>, VideoVaeError> {
        let c = self.config.latent_channels;
        let (th, tw) = tiles.latent_size();
        let mut decoded = Vec::with_capacity(tiles.count());
        for i in 0..tiles.y.starts.len() {
            for j in 0..tiles.x.starts.len() {
                let (y0, x0) = tiles.latent_origin(i, j);
                let mut tile = Vec::with_capacity(c * frames * th * tw);
                for ch in 0..c {
                    for f in 0..frames {
                        for y in 0..th {
                            let row = ((ch * frames + f) * h + y0 + y) * w + x0;
                            tile.extend_from_slice(&z[row..row + tw]);
                        }
                    }
                }
                decoded.push(self.decode_tile(&tile, (frames, th, tw))?);
            }
        }
        let pt = self.config.temporal_ratio();
        Ok(stitch_tiles(
            &decoded,
            tiles,
            self.config.out_channels * frames * pt,
        ))
    }

    /// The model's decode; see [`VideoVaeBackend::decode_sample`].
    pub fn decode_sample(&self, latents: &TensorF32) -> Result<TensorF32, VideoVaeError> {
        let cfg = &self.config;
        let ((f, h, w), plan) = check_latents(cfg, latents.shape())?;
        let tiles =
            TilePlan::new(h, w, cfg.spatial_ratio(), &self.tiling).map_err(VideoVaeError::Input)?;
        let (c, geo) = (cfg.latent_channels, cfg.chunk_geometry());
        // Pad by repeating the last latent, then post_quant_conv (per voxel, so it commutes with the slicing).
        let fp = f + plan.pad_tokens;
        let plane = h * w;
        let mut z = Vec::with_capacity(c * fp * plane);
        for ch in latents.data().chunks_exact(f * plane) {
            z.extend_from_slice(ch);
            let last = &ch[(f - 1) * plane..];
            for _ in 0..plan.pad_tokens {
                z.extend_from_slice(last);
            }
        }
        let z = self.post_quant(&z, fp * plane)?;
        let clip_latents = geo.clip_latents();
        let (oc, pt, ps) = (cfg.out_channels, geo.temporal_ratio, cfg.spatial_ratio());
        let (hh, ww) = (h * ps, w * ps);
        let frame = hh * ww;
        let clip_frames = clip_latents * pt;
        // Chunks as the reference lists them: (chunk frames, previous overlap).
        let mut chunks: Vec<Vec<f32>> = Vec::new();
        let mut overlap: Option<Vec<f32>> = None;
        for i in 0..plan.chunks {
            let start = i * geo.tokens_chunk_size;
            let mut clip_z = Vec::with_capacity(c * clip_latents * plane);
            for ch in 0..c {
                let at = (ch * fp + start) * plane;
                clip_z.extend_from_slice(&z[at..at + clip_latents * plane]);
            }
            let clip = self.decode_clip(&clip_z, (clip_latents, h, w), &tiles)?;
            let frames_of = |from: usize, to: usize| {
                let (from, to) = (from.min(clip_frames), to.min(clip_frames));
                let mut out = Vec::with_capacity(oc * (to - from) * frame);
                for ch in 0..oc {
                    let at = ch * clip_frames * frame;
                    out.extend_from_slice(&clip[at + from * frame..at + to * frame]);
                }
                out
            };
            let cf = geo.chunk_frames();
            let pre = geo.frame_pre_padding;
            let mut head = frames_of(pre, cf);
            if let Some(prev) = overlap.take() {
                blend_frames(&prev, &mut head, oc, frame, geo.frame_overlap);
            }
            chunks.push(head);
            if geo.token_drop > 0 {
                overlap = Some(frames_of(cf + pre, 2 * cf));
            }
        }
        if let Some(last) = overlap {
            chunks.push(last);
        }
        // Concatenate along frames, per channel, and cut the padding frames.
        let out_frames = plan.out_frames;
        let mut sample = Vec::with_capacity(oc * out_frames * frame);
        for ch in 0..oc {
            let mut n = 0;
            for chunk in &chunks {
                let len = chunk.len() / (oc * frame);
                let take = len.min(out_frames - n);
                let at = ch * len * frame;
                sample.extend_from_slice(&chunk[at..at + take * frame]);
                n += take;
            }
        }
        Ok(TensorF32::new(vec![1, oc, out_frames, hh, ww], sample)?)
    }

    /// The pipeline's decode; see [`VideoVaeBackend::decode`].
    pub fn decode(&self, latents: &TensorF32) -> Result<VideoFrames, VideoVaeError> {
        let z = denormalize_latents(&self.config, latents)?;
        frames_from_sample(&self.decode_sample(&z)?)
    }
}

impl VideoVaeBackend for HostVideoVae {
    fn config(&self) -> &VideoVaeConfig {
        HostVideoVae::config(self)
    }

    fn tiling(&self) -> TilingOptions {
        HostVideoVae::tiling(self)
    }

    fn set_tiling(&mut self, tiling: TilingOptions) -> Result<(), VideoVaeError> {
        HostVideoVae::set_tiling(self, tiling)
    }

    fn decode_sample(&mut self, latents: &TensorF32) -> Result<TensorF32, VideoVaeError> {
        HostVideoVae::decode_sample(self, latents)
    }

    fn decode(&mut self, latents: &TensorF32) -> Result<VideoFrames, VideoVaeError> {
        HostVideoVae::decode(self, latents)
    }
}

/// `x += y * scale` per column (f32, as the reference's residual with a layer scale).
fn residual(x: &mut [f32], y: &[f32], scale: &[f32]) {
    let d = scale.len().max(1);
    for (xr, yr) in x.chunks_exact_mut(d).zip(y.chunks_exact(d)) {
        for ((a, &b), &s) in xr.iter_mut().zip(yr).zip(scale) {
            *a += b * s;
        }
    }
}

#[cfg(test)]
mod tests;
