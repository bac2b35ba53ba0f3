//! Qwen-Image 2.1 VAE decoder, host reference (`AutoencoderKLQwenImage21`, one image frame).
//!
//! Decode of packed latents `[batch, h * w, z]`, as the pipeline does it:
//!
//! 1. unpack to `[z, h, w]` and de-normalize: `z * latents_std + latents_mean` per channel;
//! 2. `post_quant_conv` (1x1), `conv_in` (3x3);
//! 3. mid block: resnet, single-head spatial attention (channel RMS norm, 1x1 qkv, softmax over all `h * w`
//!    pixels with scale `1/sqrt(C)`, 1x1 proj, residual), resnet;
//! 4. up blocks: `num_res_blocks + 1` resnets, then (except the last block) nearest 2x upsample and a 3x3 conv, plus
//!    the `DupUp3D` shortcut of the block's input: channels repeated and spread over the 2x2 sub-pixels; for the
//!    first (only) frame the temporal sub-frame `factor_t - 1` is kept;
//! 5. channel RMS norm, SiLU, `conv_out` (3x3), clamp to [-1, 1].
//!
//! A resnet is `conv2(silu(rms2(conv1(silu(rms1(x)))))) + shortcut(x)` (1x1 shortcut when the width changes); the
//! channel RMS norm is `x / max(|x|_2, 1e-12) * sqrt(C) * gamma` over the channels of a pixel. Convolutions are
//! im2col in bands of output rows plus the host matmul.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::vae::HostVaeDecoder;
//! use tf_engines::nn::tensor::Tensor;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let vae = HostVaeDecoder::load(&ModelDir::open(Path::new("vae"))?)?;
//! let packed = Tensor::new(vec![1, 4 * 4, 64], vec![0f32; 16 * 64])?;
//! let image = vae.decode_packed(&packed, 4, 4)?; // [1, 4, 64, 64], RGBA in [-1, 1]
//! let rgba8 = tf_engines::qwen_image::vae::to_u8_hwc(&image, 0)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use crate::nn::backend_error::GpuError;
use crate::nn::config::{at_most, checked_product, in_range, parse_object};
use crate::nn::host;
use crate::nn::tensor::{ShapeError, Tensor, TensorF32};
use crate::nn::weights::{ModelDir, WeightsError};

/// The diffusers class this decoder reproduces.
pub const CLASS_NAME: &str = "AutoencoderKLQwenImage21";

/// Errors of the VAE decoder.
#[derive(Debug, Error)]
pub enum VaeError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error("VAE config.json: {0}")]
    Config(String),
    #[error("VAE input: {0}")]
    Input(String),
    /// A GPU call failed; the cause stays in the source chain (a lost context is visible there).
    #[error("VAE GPU backend: {0}")]
    Gpu(#[from] GpuError),
    /// A backend condition with no underlying error.
    #[error("VAE backend: {0}")]
    Backend(String),
}

fn config_err(why: impl Into<String>) -> VaeError {
    VaeError::Config(why.into())
}

/// Upper bounds of a VAE config this crate loads (the released decoder: z 64, base 144, 5 levels of at most 8x,
/// 2 resnets per block). They keep every width product, the spatial factor's shift and the per-block
/// allocations far from overflow before any weight is read.
pub mod limits {
    pub const Z_DIM: usize = 1024;
    pub const BASE_DIM: usize = 4096;
    /// Entries of `dim_mult` (levels; the spatial factor is `2^(levels - 1)`).
    pub const LEVELS: usize = 8;
    pub const DIM_MULT: usize = 64;
    /// A decoder width `dim_mult[i] * decoder_base_dim`.
    pub const WIDTH: usize = 1 << 16;
    pub const RES_BLOCKS: usize = 64;
    pub const OUT_CHANNELS: usize = 64;
}

/// The decoder-side hyper-parameters of `AutoencoderKLQwenImage21`.
#[derive(Debug, Clone, PartialEq)]
pub struct VaeConfig {
    pub z_dim: usize,
    pub decoder_base_dim: usize,
    pub dim_mult: Vec<usize>,
    pub num_res_blocks: usize,
    /// Per encoder level; the decoder uses it reversed.
    pub temperal_downsample: Vec<bool>,
    pub out_channels: usize,
    pub latents_mean: Vec<f32>,
    pub latents_std: Vec<f32>,
}

/// The VAE's `config.json` keys as the file spells them; `None` = absent or null (then the diffusers default).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawVae {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    is_residual: Option<bool>,
    attn_scales: Option<Vec<f64>>,
    patch_size: Option<Value>,
    base_dim: Option<usize>,
    z_dim: Option<usize>,
    decoder_base_dim: Option<usize>,
    dim_mult: Option<Vec<usize>>,
    num_res_blocks: Option<usize>,
    temperal_downsample: Option<Vec<bool>>,
    out_channels: Option<usize>,
    latents_mean: Option<Vec<f32>>,
    latents_std: Option<Vec<f32>>,
}

impl VaeConfig {
    /// Parses the VAE's `config.json`; absent keys take the diffusers defaults (except the latent statistics,
    /// which a decoder needs and must be present). Every value is bounded ([`limits`]) before anything is
    /// allocated; an error names the key.
    pub fn from_json(value: &Value) -> Result<Self, VaeError> {
        let raw: RawVae = parse_object(value).map_err(config_err)?;
        if let Some(class) = &raw.class_name {
            if class != CLASS_NAME {
                return Err(config_err(format!(
                    "`_class_name` is {class:?}; this decoder is for {CLASS_NAME} (the vae/ folder of Qwen-Image 2.1)"
                )));
            }
        }
        if raw.is_residual == Some(false) {
            return Err(config_err(
                "`is_residual` = false is not supported (Qwen-Image 2.1 uses true)",
            ));
        }
        if raw.attn_scales.as_ref().is_some_and(|a| !a.is_empty()) {
            return Err(config_err(
                "`attn_scales` must be empty (the decoder has no attention outside the mid block)",
            ));
        }
        if raw.patch_size.is_some() {
            return Err(config_err("`patch_size` must be null (no pixel unshuffle)"));
        }
        let base_dim = raw.base_dim.unwrap_or(96);
        in_range("base_dim", base_dim, limits::BASE_DIM).map_err(config_err)?;
        let config = VaeConfig {
            z_dim: raw.z_dim.unwrap_or(64),
            decoder_base_dim: raw.decoder_base_dim.unwrap_or(base_dim),
            dim_mult: raw.dim_mult.unwrap_or_else(|| vec![1, 2, 4, 8, 8]),
            num_res_blocks: raw.num_res_blocks.unwrap_or(2),
            temperal_downsample: raw
                .temperal_downsample
                .unwrap_or_else(|| vec![false, true, true, true]),
            out_channels: raw.out_channels.unwrap_or(4),
            latents_mean: raw.latents_mean.unwrap_or_default(),
            latents_std: raw.latents_std.unwrap_or_default(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks that the numbers describe a decoder this crate can run, within [`limits`].
    pub fn validate(&self) -> Result<(), VaeError> {
        in_range("z_dim", self.z_dim, limits::Z_DIM).map_err(config_err)?;
        in_range("decoder_base_dim", self.decoder_base_dim, limits::BASE_DIM)
            .map_err(config_err)?;
        in_range("out_channels", self.out_channels, limits::OUT_CHANNELS).map_err(config_err)?;
        at_most("num_res_blocks", self.num_res_blocks, limits::RES_BLOCKS).map_err(config_err)?;
        in_range("dim_mult (entries)", self.dim_mult.len(), limits::LEVELS).map_err(config_err)?;
        for &m in &self.dim_mult {
            in_range("dim_mult", m, limits::DIM_MULT).map_err(config_err)?;
            let width = checked_product("dim_mult x decoder_base_dim", &[m, self.decoder_base_dim])
                .map_err(config_err)?;
            at_most("dim_mult x decoder_base_dim", width, limits::WIDTH).map_err(config_err)?;
        }
        if self.temperal_downsample.len() + 1 != self.dim_mult.len() {
            return Err(config_err(format!(
                "`temperal_downsample` has {} entries, `dim_mult` {} (expected one fewer)",
                self.temperal_downsample.len(),
                self.dim_mult.len()
            )));
        }
        if self.latents_mean.len() != self.z_dim || self.latents_std.len() != self.z_dim {
            return Err(config_err(format!(
                "`latents_mean` and `latents_std` need {} values each (z_dim), found {} and {}",
                self.z_dim,
                self.latents_mean.len(),
                self.latents_std.len()
            )));
        }
        if let Some(bad) = self
            .latents_mean
            .iter()
            .chain(&self.latents_std)
            .find(|v| !v.is_finite())
        {
            return Err(config_err(format!(
                "`latents_mean` and `latents_std` must be finite f32 values, found {bad}"
            )));
        }
        Ok(())
    }

    /// Decoder widths: the mid block's, then each up block's output.
    pub fn decoder_dims(&self) -> Vec<usize> {
        let last = self.dim_mult.last().copied().unwrap_or(1);
        std::iter::once(last)
            .chain(self.dim_mult.iter().rev().copied())
            .map(|m| m.saturating_mul(self.decoder_base_dim))
            .collect()
    }

    /// Pixels per latent pixel along each side (2 per upsampling block). Saturates for a config that
    /// [`Self::validate`] refuses.
    pub fn spatial_factor(&self) -> usize {
        let shifts = self.dim_mult.len().saturating_sub(1);
        u32::try_from(shifts)
            .ok()
            .and_then(|s| 1usize.checked_shl(s))
            .unwrap_or(usize::MAX)
    }
}

/// A 2-D convolution with bias, stride 1, "same" zero padding, PyTorch weight layout `[out, in, k, k]`.
struct Conv {
    weight: Vec<f32>,
    bias: Vec<f32>,
    in_ch: usize,
    out_ch: usize,
    kernel: usize,
}

impl Conv {
    /// `x` is `[in_ch, h, w]`; returns `[out_ch, h, w]`.
    fn forward(&self, x: &[f32], h: usize, w: usize) -> Result<Vec<f32>, ShapeError> {
        let (k, pad) = (self.kernel, self.kernel / 2);
        let hw = h * w;
        if x.len() != self.in_ch * hw {
            return Err(ShapeError::new(
                "conv input",
                format!("{} x {h} x {w}", self.in_ch),
                format!("{} elements", x.len()),
            ));
        }
        let patch = self.in_ch * k * k;
        let mut out = vec![0f32; self.out_ch * hw];
        // Bands of output rows keep the column matrix near 16M elements.
        let band_rows = ((1usize << 24) / (w * patch).max(1)).clamp(1, h.max(1));
        let mut cols = Vec::new();
        let mut band_out = Vec::new();
        let mut row0 = 0;
        while row0 < h {
            let rows = band_rows.min(h - row0);
            cols.clear();
            cols.resize(rows * w * patch, 0f32);
            for (p, col) in cols.chunks_exact_mut(patch).enumerate() {
                let (y, xx) = (row0 + p / w, p % w);
                for ci in 0..self.in_ch {
                    let plane = &x[ci * hw..(ci + 1) * hw];
                    for ky in 0..k {
                        let sy = (y + ky).wrapping_sub(pad);
                        if sy >= h {
                            continue;
                        }
                        for kx in 0..k {
                            let sx = (xx + kx).wrapping_sub(pad);
                            if sx < w {
                                col[(ci * k + ky) * k + kx] = plane[sy * w + sx];
                            }
                        }
                    }
                }
            }
            band_out.clear();
            band_out.resize(rows * w * self.out_ch, 0f32);
            host::linear(
                &cols,
                rows * w,
                patch,
                &self.weight,
                self.out_ch,
                &mut band_out,
            )?;
            for (p, pix) in band_out.chunks_exact(self.out_ch).enumerate() {
                let dst = row0 * w + p;
                for (co, (&v, &b)) in pix.iter().zip(&self.bias).enumerate() {
                    out[co * hw + dst] = v + b;
                }
            }
            row0 += rows;
        }
        Ok(out)
    }
}

/// Channel RMS norm of a `[c, hw]` map: each pixel's channel vector scaled to norm `sqrt(c)`, times `gamma`.
fn channel_rms_norm(x: &[f32], c: usize, hw: usize, gamma: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    let scale = (c as f64).sqrt();
    for p in 0..hw {
        let norm = (0..c)
            .map(|ci| f64::from(x[ci * hw + p]).powi(2))
            .sum::<f64>()
            .sqrt()
            .max(1e-12);
        for (ci, &g) in gamma.iter().enumerate().take(c) {
            out[ci * hw + p] = (f64::from(x[ci * hw + p]) / norm * scale * f64::from(g)) as f32;
        }
    }
    out
}

struct Resnet {
    norm1: Vec<f32>,
    conv1: Conv,
    norm2: Vec<f32>,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl Resnet {
    fn forward(&self, x: &[f32], h: usize, w: usize) -> Result<Vec<f32>, ShapeError> {
        let hw = h * w;
        let shortcut = match &self.shortcut {
            Some(conv) => conv.forward(x, h, w)?,
            None => x.to_vec(),
        };
        let mut t = channel_rms_norm(x, self.conv1.in_ch, hw, &self.norm1);
        host::silu_inplace(&mut t);
        let t = self.conv1.forward(&t, h, w)?;
        let mut t = channel_rms_norm(&t, self.conv1.out_ch, hw, &self.norm2);
        host::silu_inplace(&mut t);
        let mut t = self.conv2.forward(&t, h, w)?;
        for (a, b) in t.iter_mut().zip(&shortcut) {
            *a += b;
        }
        Ok(t)
    }
}

struct Attention {
    norm: Vec<f32>,
    to_qkv: Conv,
    proj: Conv,
}

impl Attention {
    fn forward(&self, x: &[f32], c: usize, h: usize, w: usize) -> Result<Vec<f32>, ShapeError> {
        let hw = h * w;
        let normed = channel_rms_norm(x, c, hw, &self.norm);
        let qkv = self.to_qkv.forward(&normed, h, w)?; // [3c, hw]
                                                       // Token-major q, k, v [hw, c].
        let token_major = |part: usize| {
            let mut t = vec![0f32; hw * c];
            for ci in 0..c {
                for p in 0..hw {
                    t[p * c + ci] = qkv[(part * c + ci) * hw + p];
                }
            }
            t
        };
        let (q, k, v) = (token_major(0), token_major(1), token_major(2));
        let block_ids = vec![0i32; hw];
        let key_valid = vec![true; hw];
        let mask = host::AttentionMask {
            q_offset: 0,
            block_ids: &block_ids,
            key_valid: &key_valid,
        };
        let mut attn = vec![0f32; hw * c];
        host::attention(&q, &k, &v, hw, hw, 1, c, mask, &mut attn)?;
        let mut planar = vec![0f32; c * hw];
        for p in 0..hw {
            for ci in 0..c {
                planar[ci * hw + p] = attn[p * c + ci];
            }
        }
        let mut out = self.proj.forward(&planar, h, w)?;
        for (a, b) in out.iter_mut().zip(x) {
            *a += b;
        }
        Ok(out)
    }
}

struct UpBlock {
    resnets: Vec<Resnet>,
    /// The 3x3 conv after the nearest 2x upsample (absent on the last block).
    upsample_conv: Option<Conv>,
    /// `(in_ch, out_ch, factor_t)` of the DupUp3D shortcut (with the upsample).
    dup_up: Option<(usize, usize, usize)>,
}

/// Nearest 2x upsample of a `[c, h, w]` map.
fn upsample_nearest_2x(x: &[f32], c: usize, h: usize, w: usize) -> Vec<f32> {
    let (h2, w2) = (2 * h, 2 * w);
    let mut out = vec![0f32; c * h2 * w2];
    for ci in 0..c {
        for y in 0..h2 {
            for xx in 0..w2 {
                out[(ci * h2 + y) * w2 + xx] = x[(ci * h + y / 2) * w + xx / 2];
            }
        }
    }
    out
}

/// The DupUp3D shortcut for a first frame: output `[out_ch, 2h, 2w]`, channel `o` at sub-pixel `(i, j)` copies
/// input channel `((o * factor_t + factor_t - 1) * 2 + i) * 2 + j` divided by the repeat count.
fn dup_up(x: &[f32], in_ch: usize, out_ch: usize, factor_t: usize, h: usize, w: usize) -> Vec<f32> {
    let repeats = out_ch * factor_t * 4 / in_ch;
    let (h2, w2) = (2 * h, 2 * w);
    let mut out = vec![0f32; out_ch * h2 * w2];
    for o in 0..out_ch {
        for i in 0..2 {
            for j in 0..2 {
                let src = (((o * factor_t + factor_t - 1) * 2 + i) * 2 + j) / repeats;
                for y in 0..h {
                    for xx in 0..w {
                        out[(o * h2 + 2 * y + i) * w2 + 2 * xx + j] = x[(src * h + y) * w + xx];
                    }
                }
            }
        }
    }
    out
}

/// The decoder half of the VAE on the host, f32 weights.
pub struct HostVaeDecoder {
    config: VaeConfig,
    post_quant_conv: Conv,
    conv_in: Conv,
    mid_resnets: [Resnet; 2],
    mid_attention: Attention,
    up_blocks: Vec<UpBlock>,
    norm_out: Vec<f32>,
    conv_out: Conv,
}

impl std::fmt::Debug for HostVaeDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostVaeDecoder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl HostVaeDecoder {
    /// Loads the decoder weights of a diffusers VAE folder, checking every shape against the config.
    pub fn load(model: &ModelDir) -> Result<Self, VaeError> {
        let config = VaeConfig::from_json(model.config_json())?;
        let tensor = |name: &str, shape: &[usize]| -> Result<Vec<f32>, VaeError> {
            let t = model.to_f32(name)?;
            if t.shape() != shape {
                return Err(VaeError::Weights(WeightsError::ShapeMismatch {
                    path: model.dir().to_path_buf(),
                    name: name.to_string(),
                    expected: shape.to_vec(),
                    actual: t.shape().to_vec(),
                }));
            }
            Ok(t.into_data())
        };
        let conv =
            |name: &str, in_ch: usize, out_ch: usize, kernel: usize| -> Result<Conv, VaeError> {
                Ok(Conv {
                    weight: tensor(&format!("{name}.weight"), &[out_ch, in_ch, kernel, kernel])?,
                    bias: tensor(&format!("{name}.bias"), &[out_ch])?,
                    in_ch,
                    out_ch,
                    kernel,
                })
            };
        let resnet = |name: &str, in_ch: usize, out_ch: usize| -> Result<Resnet, VaeError> {
            Ok(Resnet {
                norm1: tensor(&format!("{name}.norm1.gamma"), &[in_ch, 1, 1, 1])?,
                conv1: conv(&format!("{name}.conv1"), in_ch, out_ch, 3)?,
                norm2: tensor(&format!("{name}.norm2.gamma"), &[out_ch, 1, 1, 1])?,
                conv2: conv(&format!("{name}.conv2"), out_ch, out_ch, 3)?,
                shortcut: if in_ch != out_ch {
                    Some(conv(&format!("{name}.conv_shortcut"), in_ch, out_ch, 1)?)
                } else {
                    None
                },
            })
        };
        let z = config.z_dim;
        let dims = config.decoder_dims();
        let mid = dims[0];
        let temporal_up: Vec<bool> = config.temperal_downsample.iter().rev().copied().collect();
        let levels = config.dim_mult.len();
        let mut up_blocks = Vec::with_capacity(levels);
        for (i, pair) in dims.windows(2).enumerate() {
            let (in_ch, out_ch) = (pair[0], pair[1]);
            let up = i != levels - 1;
            let factor_t = if up && temporal_up.get(i).copied().unwrap_or(false) {
                2
            } else {
                1
            };
            if up && !(out_ch * factor_t * 4).is_multiple_of(in_ch) {
                return Err(config_err(format!(
                    "up block {i}: {out_ch} x {} sub-positions is not a multiple of {in_ch} input channels",
                    factor_t * 4
                )));
            }
            let mut resnets = Vec::with_capacity(config.num_res_blocks + 1);
            for r in 0..=config.num_res_blocks {
                let from = if r == 0 { in_ch } else { out_ch };
                resnets.push(resnet(
                    &format!("decoder.up_blocks.{i}.resnets.{r}"),
                    from,
                    out_ch,
                )?);
            }
            up_blocks.push(UpBlock {
                resnets,
                upsample_conv: if up {
                    Some(conv(
                        &format!("decoder.up_blocks.{i}.upsampler.resample.1"),
                        out_ch,
                        out_ch,
                        3,
                    )?)
                } else {
                    None
                },
                dup_up: up.then_some((in_ch, out_ch, factor_t)),
            });
        }
        let last = dims.last().copied().unwrap_or(mid);
        Ok(HostVaeDecoder {
            post_quant_conv: conv("post_quant_conv", z, z, 1)?,
            conv_in: conv("decoder.conv_in", z, mid, 3)?,
            mid_resnets: [
                resnet("decoder.mid_block.resnets.0", mid, mid)?,
                resnet("decoder.mid_block.resnets.1", mid, mid)?,
            ],
            mid_attention: Attention {
                norm: tensor("decoder.mid_block.attentions.0.norm.gamma", &[mid, 1, 1])?,
                to_qkv: conv("decoder.mid_block.attentions.0.to_qkv", mid, 3 * mid, 1)?,
                proj: conv("decoder.mid_block.attentions.0.proj", mid, mid, 1)?,
            },
            up_blocks,
            norm_out: tensor("decoder.norm_out.gamma", &[last, 1, 1, 1])?,
            conv_out: conv("decoder.conv_out", last, config.out_channels, 3)?,
            config,
        })
    }

    /// The parsed config.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// Unpacks `[batch, h * w, z]` latents to `[batch, z, h, w]` and de-normalizes them (`z * std + mean`).
    pub fn denormalize_packed(
        &self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        let z = self.config.z_dim;
        let [batch, tokens, channels] = packed.dims::<3>("packed latents")?;
        let Some(hw) = h.checked_mul(w) else {
            return Err(VaeError::Input(format!(
                "a {h} x {w} latent grid is too large (h x w overflows)"
            )));
        };
        if tokens != hw || channels != z {
            return Err(VaeError::Input(format!(
                "packed latents are [{batch}, {tokens}, {channels}]; expected [{batch}, {hw}, {z}] for a {h} x {w} latent"
            )));
        }
        let mut out = vec![0f32; packed.data().len()];
        for (src, dst) in packed
            .data()
            .chunks_exact(tokens * z)
            .zip(out.chunks_exact_mut(tokens * z))
        {
            for t in 0..tokens {
                for c in 0..z {
                    dst[c * tokens + t] =
                        src[t * z + c] * self.config.latents_std[c] + self.config.latents_mean[c];
                }
            }
        }
        Ok(Tensor::new(vec![batch, z, h, w], out)?)
    }

    /// Decodes de-normalized latents `[batch, z, h, w]` to images `[batch, out_channels, f h, f w]` in [-1, 1]
    /// (`f` = [`VaeConfig::spatial_factor`], 16 for the released model).
    pub fn decode(&self, latents: &TensorF32) -> Result<TensorF32, VaeError> {
        let [batch, z, h, w] = latents.dims::<4>("VAE latents")?;
        if z != self.config.z_dim || h == 0 || w == 0 {
            return Err(VaeError::Input(format!(
                "latents are [{batch}, {z}, {h}, {w}]; the VAE needs {} channels and a non-empty grid",
                self.config.z_dim
            )));
        }
        let f = self.config.spatial_factor();
        let too_large = || {
            VaeError::Input(format!(
                "a {h} x {w} latent decodes to an image too large to hold (factor {f})"
            ))
        };
        let (oh, ow) = (
            h.checked_mul(f).ok_or_else(too_large)?,
            w.checked_mul(f).ok_or_else(too_large)?,
        );
        let per_image = checked_product("image", &[self.config.out_channels, oh, ow])
            .map_err(|_| too_large())?;
        let total = per_image.checked_mul(batch).ok_or_else(too_large)?;
        let mut out = Vec::with_capacity(total);
        for image in latents.data().chunks_exact(z * h * w) {
            let decoded = self.decode_one(image, h, w)?;
            out.extend(decoded.into_iter().map(|v| v.clamp(-1.0, 1.0)));
        }
        Ok(Tensor::new(
            vec![batch, self.config.out_channels, oh, ow],
            out,
        )?)
    }

    /// [`Self::denormalize_packed`] then [`Self::decode`].
    pub fn decode_packed(
        &self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        self.decode(&self.denormalize_packed(packed, h, w)?)
    }

    fn decode_one(&self, z: &[f32], mut h: usize, mut w: usize) -> Result<Vec<f32>, VaeError> {
        let x = self.post_quant_conv.forward(z, h, w)?;
        let mut x = self.conv_in.forward(&x, h, w)?;
        x = self.mid_resnets[0].forward(&x, h, w)?;
        x = self.mid_attention.forward(&x, self.conv_in.out_ch, h, w)?;
        x = self.mid_resnets[1].forward(&x, h, w)?;
        for block in &self.up_blocks {
            let input = x.clone();
            for resnet in &block.resnets {
                x = resnet.forward(&x, h, w)?;
            }
            if let (Some(conv), Some((in_ch, out_ch, factor_t))) =
                (&block.upsample_conv, block.dup_up)
            {
                let up = upsample_nearest_2x(&x, out_ch, h, w);
                let shortcut = dup_up(&input, in_ch, out_ch, factor_t, h, w);
                h *= 2;
                w *= 2;
                x = conv.forward(&up, h, w)?;
                for (a, b) in x.iter_mut().zip(&shortcut) {
                    *a += b;
                }
            }
        }
        let mut x = channel_rms_norm(&x, self.conv_out.in_ch, h * w, &self.norm_out);
        host::silu_inplace(&mut x);
        Ok(self.conv_out.forward(&x, h, w)?)
    }
}

/// Image `index` of a decoded batch `[batch, c, h, w]` as 8-bit interleaved pixels `[h, w, c]`, mapped as the
/// diffusers image processor does: `round(clamp(x / 2 + 0.5, 0, 1) * 255)`.
pub fn to_u8_hwc(images: &TensorF32, index: usize) -> Result<Vec<u8>, VaeError> {
    let [batch, c, h, w] = images.dims::<4>("decoded images")?;
    if index >= batch {
        return Err(VaeError::Input(format!(
            "image {index} of a batch of {batch}"
        )));
    }
    let plane = h * w;
    let image = &images.data()[index * c * plane..(index + 1) * c * plane];
    let mut out = vec![0u8; c * plane];
    if c == 0 || plane == 0 {
        return Ok(out);
    }
    // Pixel rows in parallel (a 1024x1024 image is 4 M values): each thread writes its own run of pixels.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    let pixels_per_part = plane.div_ceil(threads);
    std::thread::scope(|scope| {
        for (part, chunk) in out.chunks_mut(pixels_per_part * c).enumerate() {
            scope.spawn(move || {
                let first = part * pixels_per_part;
                for (i, px) in chunk.chunks_exact_mut(c).enumerate() {
                    for (ci, o) in px.iter_mut().enumerate() {
                        let v = (image[ci * plane + first + i] / 2.0 + 0.5).clamp(0.0, 1.0);
                        *o = (v * 255.0).round() as u8;
                    }
                }
            });
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u8_conversion_matches_the_plain_loop_at_any_size() {
        for (batch, c, h, w) in [(1, 4, 17, 33), (2, 3, 1, 1), (1, 1, 64, 7), (1, 4, 0, 5)] {
            let n = batch * c * h * w;
            let data: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 2003) as f32) / 500.0 - 2.0)
                .collect();
            let images = Tensor::new(vec![batch, c, h, w], data.clone()).unwrap();
            for index in 0..batch {
                let image = &data[index * c * h * w..(index + 1) * c * h * w];
                let mut want = vec![0u8; c * h * w];
                for ci in 0..c {
                    for p in 0..h * w {
                        let v = (image[ci * h * w + p] / 2.0 + 0.5).clamp(0.0, 1.0);
                        want[p * c + ci] = (v * 255.0).round() as u8;
                    }
                }
                assert_eq!(
                    to_u8_hwc(&images, index).unwrap(),
                    want,
                    "{batch}x{c}x{h}x{w}"
                );
            }
        }
    }

    #[test]
    fn dup_up_spreads_channels_over_subpixels() {
        // 8 input channels -> 2 output channels with factor_t 2: 16 slots, repeats 2; first frame keeps t = 1.
        let x: Vec<f32> = (0..8).map(|c| c as f32).collect(); // 8 channels, 1x1
        let out = dup_up(&x, 8, 2, 2, 1, 1);
        // o = 0, t = 1: slots 4..8 -> input channels 2, 2, 3, 3; o = 1, t = 1: slots 12..16 -> 6, 6, 7, 7.
        assert_eq!(out, vec![2.0, 2.0, 3.0, 3.0, 6.0, 6.0, 7.0, 7.0]);
        // factor_t 1: 4 input channels -> 2 output, repeats 2: o = 0 slots 0..4 -> 0, 0, 1, 1.
        let out = dup_up(&x[..4], 4, 2, 1, 1, 1);
        assert_eq!(out, vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    }

    #[test]
    fn conv_matches_a_direct_sum() {
        let (cin, cout, h, w) = (2, 3, 4, 5);
        let weight: Vec<f32> = (0..cout * cin * 9)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0)
            .collect();
        let conv = Conv {
            weight: weight.clone(),
            bias: vec![0.5, -1.0, 0.0],
            in_ch: cin,
            out_ch: cout,
            kernel: 3,
        };
        let x: Vec<f32> = (0..cin * h * w)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let out = conv.forward(&x, h, w).unwrap();
        for co in 0..cout {
            for y in 0..h {
                for xx in 0..w {
                    let mut acc = f64::from(conv.bias[co]);
                    for ci in 0..cin {
                        for ky in 0..3 {
                            for kx in 0..3 {
                                let (sy, sx) =
                                    (y as i64 + ky as i64 - 1, xx as i64 + kx as i64 - 1);
                                if (0..h as i64).contains(&sy) && (0..w as i64).contains(&sx) {
                                    acc += f64::from(weight[((co * cin + ci) * 3 + ky) * 3 + kx])
                                        * f64::from(x[(ci * h + sy as usize) * w + sx as usize]);
                                }
                            }
                        }
                    }
                    let got = out[(co * h + y) * w + xx];
                    assert!(
                        (f64::from(got) - acc).abs() < 1e-5,
                        "{co},{y},{xx}: {got} vs {acc}"
                    );
                }
            }
        }
    }

    #[test]
    fn channel_norm_scales_each_pixel_to_sqrt_c() {
        let out = channel_rms_norm(&[3.0, 0.0, 4.0, 2.0], 2, 2, &[1.0, 1.0]);
        let s = 2f32.sqrt();
        assert!((out[0] - 0.6 * s).abs() < 1e-6 && (out[2] - 0.8 * s).abs() < 1e-6);
        assert!((out[1]).abs() < 1e-6 && (out[3] - s).abs() < 1e-6);
    }

    #[test]
    fn released_config_has_the_released_widths() {
        let v = serde_json::json!({"_class_name": "AutoencoderKLQwenImage21", "base_dim": 96, "decoder_base_dim": 144,
            "z_dim": 64, "latents_mean": vec![0.0; 64], "latents_std": vec![1.0; 64], "patch_size": null,
            "attn_scales": [], "is_residual": true});
        let c = VaeConfig::from_json(&v).unwrap();
        assert_eq!(c.decoder_dims(), vec![1152, 1152, 1152, 576, 288, 144]);
        assert_eq!(c.spatial_factor(), 16);
        assert_eq!(c.out_channels, 4);
        let short = serde_json::json!({"z_dim": 64, "latents_mean": [0.0], "latents_std": [1.0]});
        assert!(VaeConfig::from_json(&short).is_err());
        let other = serde_json::json!({"_class_name": "AutoencoderKLWan", "z_dim": 1, "latents_mean": [0.0],
            "latents_std": [1.0]});
        assert!(VaeConfig::from_json(&other).is_err());
    }

    #[test]
    fn to_u8_maps_minus_one_to_zero() {
        let t = Tensor::new(vec![1, 2, 1, 1], vec![-1.0, 1.0]).unwrap();
        assert_eq!(to_u8_hwc(&t, 0).unwrap(), vec![0, 255]);
        assert!(to_u8_hwc(&t, 1).is_err());
    }
}
