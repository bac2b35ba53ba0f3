//! The MiniMax H3 audio VAE decoder (`audio_vae/` of a diffusers folder, class `AutoencoderKLMiniMaxH3Audio`): its
//! bounded, validated config, the decoder's tensor list, and the f32 host reference of the decode.
//!
//! The decode, in the reference's order: the pipeline's de-normalization `z * latents_std + latents_mean` per
//! channel, `dec_in_proj` (1x1), then BigVGAN: `conv_pre` (k7), and per up-sampling stage a `ConvTranspose1d`
//! (stride `rate`, padding `(kernel - rate) / 2`) followed by the mean of the stage's AMP blocks. An AMP block adds,
//! for each of its dilations, `conv2(act(conv1(act(x))))` to `x`, where `act` is the anti-aliased SnakeBeta: a 2x
//! up-sampling by a Kaiser-sinc transposed filter over a replicate-padded input, SnakeBeta, and the matching strided
//! low-pass down-sampling, with both 12-tap filters read from the state dict. Then a last anti-aliased SnakeBeta,
//! `conv_post` (k7, no bias) and the clamp to `[-1, 1]`. Every convolution but `dec_in_proj` is weight-normalized
//! (`weight_g`, `weight_v`); the effective weights are formed once at load.
//!
//! The model is mono: stereo is a batch of two, `[2, latent_channels, frames]` in, `[2, 1, samples]` out. The
//! encoder side of the checkpoint (`encoder.`, `pre_block.`, `mean_proj.`, `logs_proj.`) is not used by a decode
//! and is ignored at load; any other tensor the decoder does not know is an error.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

use crate::nn::backend_error::GpuError;
use crate::nn::config::{
    check_class_name, check_per_channel, checked_product, in_range, names_class, parse_validated,
};
use crate::nn::host::{
    conv1d, conv_transpose1d, pad_replicate_1d, snake_beta, weight_norm, Conv1dGeometry,
};
use crate::nn::tensor::{ShapeError, TensorF32};
use crate::nn::weights::{ModelDir, TensorSpec, WeightsError, FLOAT_DTYPES};

/// The diffusers class name this config describes.
pub const CLASS_NAME: &str = "AutoencoderKLMiniMaxH3Audio";

/// Up-sampling ratio of the anti-aliased activation (fixed in the reference).
pub const ACTIVATION_RATIO: usize = 2;
/// Taps of its Kaiser-sinc up- and down-sampling filters (fixed in the reference).
pub const ACTIVATION_TAPS: usize = 12;

/// Checkpoint prefixes of the encoder side, which a decode does not read.
pub const ENCODER_PREFIXES: [&str; 4] = ["encoder.", "pre_block.", "mean_proj.", "logs_proj."];

// Upper bounds, far above the released model (in the comment).
const MAX_WIDTH: usize = 1 << 14; // latent_dim 2048, decoder_dim 1024
const MAX_CHANNELS: usize = 1 << 12; // latent_channels 32
const MAX_HEADS: usize = 1024; // 8
const MAX_STAGES: usize = 16; // 5 encoder, 7 decoder rates
const MAX_RATE: usize = 64; // 5
const MAX_KERNEL: usize = 128; // 9, 11
const MAX_RESBLOCKS: usize = 8; // 3
const MAX_DILATIONS: usize = 8; // 3
const MAX_DILATION: usize = 256; // 5
const MAX_SAMPLING_RATE: usize = 1 << 20; // 32000
/// Decoder parameters, at most (the released decoder has about 1e8).
const MAX_PARAMETERS: usize = 1 << 34;
/// Stereo is two; a few more mono items are accepted.
pub const MAX_BATCH: usize = 16;
/// Latent frames per decode (40 per second in the release: 10 minutes).
pub const MAX_FRAMES: usize = 24_000;
/// Elements of the largest intermediate the host decode allocates.
const MAX_ACTIVATION_ELEMENTS: usize = 1 << 30;

/// A config that cannot describe a model this crate runs. The message names the file and the key.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{file}: MiniMax H3 audio VAE config: {why}")]
pub struct AudioVaeConfigError {
    /// The config file (or `config.json` when it was parsed from a value).
    pub file: String,
    /// What is wrong, naming the key, and what would fix it.
    pub why: String,
}

/// Why a load or a decode failed.
#[derive(Debug, Error)]
pub enum AudioVaeError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error(transparent)]
    Config(#[from] AudioVaeConfigError),
    #[error("shape mismatch: {0}")]
    Shape(#[from] ShapeError),
    /// A tensor present with the right shape whose values cannot be used.
    #[error("{file}: tensor {tensor:?}: {why}")]
    Checkpoint {
        file: String,
        tensor: String,
        why: String,
    },
    #[error("invalid MiniMax H3 audio VAE input: {0}")]
    Input(String),
    /// A GPU call failed; the cause stays in the source chain (a lost context is visible there).
    #[error("MiniMax H3 audio VAE GPU backend: {0}")]
    Gpu(#[from] GpuError),
}

impl AudioVaeError {
    /// True when the request itself is at fault (its shape or size), not the decoder.
    pub fn is_invalid_request(&self) -> bool {
        matches!(self, AudioVaeError::Input(_))
    }
}

/// The audio VAE decode as a pipeline drives it: the f32 host reference ([`HostAudioVae`]) and the GPU backend
/// (`super::vae_audio_gpu::GpuAudioVae`) implement it, so a pipeline picks either.
pub trait AudioVaeDecoder {
    /// The validated config.
    fn config(&self) -> &AudioVaeConfig;

    /// Output samples per item for `frames` latent frames.
    fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError>;

    /// Normalized latents `[batch, latent_channels, frames]` (the DiT's; stereo is batch 2) to the clamped waveform
    /// `[batch, 1, samples]`: `z * latents_std + latents_mean` per channel, then the decoder.
    fn decode(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError>;

    /// The model's `decode` on de-normalized latents.
    fn decode_denormalized(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError>;

    /// A short name for reports ("host", "gpu").
    fn name(&self) -> &'static str;
}

impl AudioVaeDecoder for HostAudioVae {
    fn config(&self) -> &AudioVaeConfig {
        HostAudioVae::config(self)
    }

    fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError> {
        HostAudioVae::output_len(self, frames)
    }

    fn decode(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        HostAudioVae::decode(self, latents)
    }

    fn decode_denormalized(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        HostAudioVae::decode_denormalized(self, latents)
    }

    fn name(&self) -> &'static str {
        "host"
    }
}

fn d_encoder_dim() -> usize {
    64
}
fn d_encoder_rates() -> Vec<usize> {
    vec![2, 4, 4, 5, 5]
}
fn d_latent_dim() -> usize {
    2048
}
fn d_latent_channels() -> usize {
    32
}
fn d_heads() -> usize {
    8
}
fn d_decoder_dim() -> usize {
    1024
}
fn d_decoder_rates() -> Vec<usize> {
    vec![5, 5, 2, 2, 2, 2, 2]
}
fn d_decoder_kernels() -> Vec<usize> {
    vec![9, 9, 4, 4, 4, 4, 4]
}
fn d_resblock_kernels() -> Vec<usize> {
    vec![3, 7, 11]
}
fn d_resblock_dilations() -> Vec<Vec<usize>> {
    vec![vec![1, 3, 5]; 3]
}
fn d_sampling_rate() -> usize {
    32000
}

/// `AutoencoderKLMiniMaxH3Audio` hyper-parameters, with the diffusers defaults for absent keys.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AudioVaeConfig {
    #[serde(rename = "_class_name", default)]
    pub class_name: Option<String>,
    #[serde(default = "d_encoder_dim")]
    pub encoder_dim: usize,
    /// Encoder strides; their product is the hop (samples per latent frame).
    #[serde(default = "d_encoder_rates")]
    pub encoder_rates: Vec<usize>,
    /// Width of `dec_in_proj`'s output, the decoder's input.
    #[serde(default = "d_latent_dim")]
    pub latent_dim: usize,
    /// Channels of a latent frame.
    #[serde(default = "d_latent_channels")]
    pub latent_channels: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// BigVGAN's first width; stage `i` outputs `decoder_dim / 2^(i+1)` channels.
    #[serde(default = "d_decoder_dim")]
    pub decoder_dim: usize,
    #[serde(default = "d_decoder_rates")]
    pub decoder_rates: Vec<usize>,
    #[serde(default = "d_decoder_kernels")]
    pub decoder_kernel_sizes: Vec<usize>,
    /// One AMP block per entry at every stage.
    #[serde(default = "d_resblock_kernels")]
    pub resblock_kernel_sizes: Vec<usize>,
    #[serde(default = "d_resblock_dilations")]
    pub resblock_dilation_sizes: Vec<Vec<usize>>,
    #[serde(default = "d_sampling_rate")]
    pub sampling_rate: usize,
    /// Per-channel mean the pipeline adds back before the decode.
    #[serde(default)]
    pub latents_mean: Option<Vec<f64>>,
    /// Per-channel standard deviation the pipeline multiplies by before the decode.
    #[serde(default)]
    pub latents_std: Option<Vec<f64>>,
}

/// Whether a parsed `config.json` names this class (`_class_name`).
pub fn names_this_class(config_json: &serde_json::Value) -> bool {
    names_class(config_json, CLASS_NAME)
}

impl Default for AudioVaeConfig {
    fn default() -> Self {
        AudioVaeConfig {
            class_name: Some(CLASS_NAME.to_string()),
            encoder_dim: d_encoder_dim(),
            encoder_rates: d_encoder_rates(),
            latent_dim: d_latent_dim(),
            latent_channels: d_latent_channels(),
            num_attention_heads: d_heads(),
            decoder_dim: d_decoder_dim(),
            decoder_rates: d_decoder_rates(),
            decoder_kernel_sizes: d_decoder_kernels(),
            resblock_kernel_sizes: d_resblock_kernels(),
            resblock_dilation_sizes: d_resblock_dilations(),
            sampling_rate: d_sampling_rate(),
            latents_mean: None,
            latents_std: None,
        }
    }
}

impl AudioVaeConfig {
    /// Parses and validates a `config.json` value; errors name `config.json`.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, AudioVaeConfigError> {
        Self::from_json_file(value, Path::new("config.json"))
    }

    /// Parses and validates the value read from `file` (named in every error).
    pub fn from_json_file(
        value: &serde_json::Value,
        file: &Path,
    ) -> Result<Self, AudioVaeConfigError> {
        parse_validated(value, file, AudioVaeConfig::validate)
            .map_err(|(file, why)| AudioVaeConfigError { file, why })
    }

    /// Checks the class name, every size against its upper bound, the rules the reference enforces (the decoder
    /// up-samples by the encoder hop, `latent_dim` a multiple of `latent_channels`) and those its decode needs
    /// (a kernel at least its rate, odd AMP kernels so a block keeps the length, a channel left after every
    /// halving, `latents_mean` / `latents_std` one finite value per channel), and the parameter count, with
    /// checked arithmetic. The error names the key and the rule.
    pub fn validate(&self) -> Result<(), String> {
        check_class_name(
            self.class_name.as_deref(),
            CLASS_NAME,
            "the audio_vae/ folder of a MiniMax H3 model",
        )?;
        for (key, value, max) in [
            ("encoder_dim", self.encoder_dim, MAX_WIDTH),
            ("latent_dim", self.latent_dim, MAX_WIDTH),
            ("latent_channels", self.latent_channels, MAX_CHANNELS),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("decoder_dim", self.decoder_dim, MAX_WIDTH),
            ("sampling_rate", self.sampling_rate, MAX_SAMPLING_RATE),
            (
                "encoder_rates (count)",
                self.encoder_rates.len(),
                MAX_STAGES,
            ),
            (
                "decoder_rates (count)",
                self.decoder_rates.len(),
                MAX_STAGES,
            ),
            (
                "resblock_kernel_sizes (count)",
                self.resblock_kernel_sizes.len(),
                MAX_RESBLOCKS,
            ),
        ] {
            in_range(key, value, max)?;
        }
        for (i, &r) in self.encoder_rates.iter().enumerate() {
            in_range(&format!("encoder_rates[{i}]"), r, MAX_RATE)?;
        }
        if self.decoder_kernel_sizes.len() != self.decoder_rates.len() {
            return Err(format!(
                "`decoder_kernel_sizes` has {} entries but `decoder_rates` has {}: one kernel per up-sampler",
                self.decoder_kernel_sizes.len(),
                self.decoder_rates.len()
            ));
        }
        for (i, (&r, &k)) in self
            .decoder_rates
            .iter()
            .zip(&self.decoder_kernel_sizes)
            .enumerate()
        {
            in_range(&format!("decoder_rates[{i}]"), r, MAX_RATE)?;
            in_range(&format!("decoder_kernel_sizes[{i}]"), k, MAX_KERNEL)?;
            if k < r {
                return Err(format!(
                    "`decoder_kernel_sizes[{i}]` = {k} is below `decoder_rates[{i}]` = {r}: the up-sampler's padding (kernel - rate) / 2 would be negative"
                ));
            }
        }
        let hop = checked_product("`encoder_rates` product", &self.encoder_rates)?;
        let up = checked_product("`decoder_rates` product", &self.decoder_rates)?;
        if up != hop {
            return Err(format!(
                "`decoder_rates` up-sample by {up} but `encoder_rates` down-sample by {hop}; the decoder must restore the hop"
            ));
        }
        if !self.latent_dim.is_multiple_of(self.latent_channels) {
            return Err(format!(
                "`latent_dim` = {} must be a multiple of `latent_channels` = {}",
                self.latent_dim, self.latent_channels
            ));
        }
        if self.decoder_dim >> self.decoder_rates.len() == 0 {
            return Err(format!(
                "`decoder_dim` = {} halves to 0 channels over {} up-samplers; it must be at least 2^{}",
                self.decoder_dim,
                self.decoder_rates.len(),
                self.decoder_rates.len()
            ));
        }
        if self.resblock_dilation_sizes.len() != self.resblock_kernel_sizes.len() {
            return Err(format!(
                "`resblock_dilation_sizes` has {} entries but `resblock_kernel_sizes` has {}: one dilation list per AMP block",
                self.resblock_dilation_sizes.len(),
                self.resblock_kernel_sizes.len()
            ));
        }
        for (j, &k) in self.resblock_kernel_sizes.iter().enumerate() {
            in_range(&format!("resblock_kernel_sizes[{j}]"), k, MAX_KERNEL)?;
            if k.is_multiple_of(2) {
                return Err(format!(
                    "`resblock_kernel_sizes[{j}]` = {k} must be odd: an even kernel changes the length and the residual sum fails"
                ));
            }
        }
        for (j, dilations) in self.resblock_dilation_sizes.iter().enumerate() {
            in_range(
                &format!("resblock_dilation_sizes[{j}] (count)"),
                dilations.len(),
                MAX_DILATIONS,
            )?;
            for (m, &d) in dilations.iter().enumerate() {
                in_range(
                    &format!("resblock_dilation_sizes[{j}][{m}]"),
                    d,
                    MAX_DILATION,
                )?;
            }
        }
        for (key, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if let Some(v) = values {
                check_per_channel(key, v, self.latent_channels, false)?;
            }
        }
        let params = self.parameter_count_checked()?;
        if params > MAX_PARAMETERS {
            return Err(format!(
                "the decoder has {params} parameters, above the supported {MAX_PARAMETERS} (check `latent_dim`, `decoder_dim`, the kernel sizes)"
            ));
        }
        Ok(())
    }

    /// Samples per latent frame: the product of `decoder_rates`.
    pub fn hop_length(&self) -> usize {
        self.decoder_rates.iter().product()
    }

    /// Input and output channels of up-sampler `i`: `decoder_dim / 2^i` and `decoder_dim / 2^(i+1)`.
    pub fn stage_channels(&self, i: usize) -> (usize, usize) {
        (
            self.decoder_dim.checked_shr(i as u32).unwrap_or(0),
            self.decoder_dim.checked_shr(i as u32 + 1).unwrap_or(0),
        )
    }

    /// Channels after the last up-sampler (the input of `conv_post`).
    pub fn final_channels(&self) -> usize {
        self.stage_channels(self.decoder_rates.len().saturating_sub(1))
            .1
    }

    fn parameter_count_checked(&self) -> Result<usize, String> {
        crate::nn::weights::element_total(&self.tensor_specs())
    }

    /// Decoder parameters, buffers included (a validated config never overflows).
    pub fn parameter_count(&self) -> usize {
        self.parameter_count_checked().unwrap_or(usize::MAX)
    }

    /// Every tensor a decode reads, in diffusers names: `dec_in_proj` and `decoder.*` with the filter buffers.
    pub fn tensor_specs(&self) -> Vec<TensorSpec> {
        let (lc, ld, dd) = (self.latent_channels, self.latent_dim, self.decoder_dim);
        let mut specs = vec![
            spec("dec_in_proj.weight", vec![ld, lc, 1]),
            spec("dec_in_proj.bias", vec![ld]),
        ];
        wn_conv_specs(&mut specs, "decoder.conv_pre", dd, ld, 7, true);
        for (i, &k) in self.decoder_kernel_sizes.iter().enumerate() {
            let (cin, cout) = self.stage_channels(i);
            let p = format!("decoder.ups.{i}.0");
            specs.push(spec(&format!("{p}.weight_g"), vec![cin, 1, 1]));
            specs.push(spec(&format!("{p}.weight_v"), vec![cin, cout, k]));
            specs.push(spec(&format!("{p}.bias"), vec![cout]));
        }
        let n_kernels = self.resblock_kernel_sizes.len();
        for i in 0..self.decoder_rates.len() {
            let c = self.stage_channels(i).1;
            for (j, (&k, dilations)) in self
                .resblock_kernel_sizes
                .iter()
                .zip(&self.resblock_dilation_sizes)
                .enumerate()
            {
                let p = format!("decoder.resblocks.{}", i * n_kernels + j);
                for m in 0..dilations.len() {
                    wn_conv_specs(&mut specs, &format!("{p}.convs1.{m}"), c, c, k, true);
                    wn_conv_specs(&mut specs, &format!("{p}.convs2.{m}"), c, c, k, true);
                }
                for a in 0..2 * dilations.len() {
                    activation_specs(&mut specs, &format!("{p}.activations.{a}"), c);
                }
            }
        }
        let c = self.final_channels();
        activation_specs(&mut specs, "decoder.activation_post", c);
        wn_conv_specs(&mut specs, "decoder.conv_post", 1, c, 7, false);
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

fn wn_conv_specs(
    specs: &mut Vec<TensorSpec>,
    p: &str,
    out: usize,
    inp: usize,
    k: usize,
    bias: bool,
) {
    specs.push(spec(&format!("{p}.weight_g"), vec![out, 1, 1]));
    specs.push(spec(&format!("{p}.weight_v"), vec![out, inp, k]));
    if bias {
        specs.push(spec(&format!("{p}.bias"), vec![out]));
    }
}

fn activation_specs(specs: &mut Vec<TensorSpec>, p: &str, c: usize) {
    specs.push(spec(&format!("{p}.act.alpha"), vec![c]));
    specs.push(spec(&format!("{p}.act.beta"), vec![c]));
    specs.push(spec(
        &format!("{p}.upsample.filter"),
        vec![1, 1, ACTIVATION_TAPS],
    ));
    specs.push(spec(
        &format!("{p}.downsample.lowpass.filter"),
        vec![1, 1, ACTIVATION_TAPS],
    ));
}

/// A convolution with its effective (weight-normalized) weight.
#[derive(Debug, Clone)]
pub(super) struct Conv {
    pub(super) geo: Conv1dGeometry,
    pub(super) weight: Vec<f32>,
    pub(super) bias: Option<Vec<f32>>,
}

/// The anti-aliased SnakeBeta: parameters and both resampling filters.
#[derive(Debug, Clone)]
pub(super) struct Activation {
    pub(super) alpha: Vec<f32>,
    pub(super) beta: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) down: Vec<f32>,
}

#[derive(Debug, Clone)]
pub(super) struct AmpBlock {
    /// `(conv1, conv2, act1, act2)` per dilation.
    pub(super) units: Vec<(Conv, Conv, Activation, Activation)>,
}

#[derive(Debug, Clone)]
pub(super) struct Stage {
    pub(super) up: Conv,
    pub(super) blocks: Vec<AmpBlock>,
}

/// A `[batch, channels, len]` activation.
struct Signal {
    data: Vec<f32>,
    batch: usize,
    channels: usize,
    len: usize,
}

/// The f32 host reference of the audio VAE decode.
#[derive(Debug, Clone)]
pub struct HostAudioVae {
    config: AudioVaeConfig,
    pub(super) mean: Vec<f32>,
    pub(super) std: Vec<f32>,
    pub(super) dec_in: Conv,
    pub(super) conv_pre: Conv,
    pub(super) stages: Vec<Stage>,
    pub(super) act_post: Activation,
    pub(super) conv_post: Conv,
}

struct Take<'a> {
    tensors: &'a mut BTreeMap<String, TensorF32>,
    place: String,
}

impl Take<'_> {
    fn take(&mut self, name: &str) -> Result<Vec<f32>, AudioVaeError> {
        self.tensors
            .remove(name)
            .map(TensorF32::into_data)
            .ok_or_else(|| {
                AudioVaeError::Weights(WeightsError::MissingTensor {
                    name: name.to_string(),
                    place: self.place.clone(),
                })
            })
    }

    fn wn_conv(
        &mut self,
        p: &str,
        geo: Conv1dGeometry,
        rows: usize,
        bias: bool,
    ) -> Result<Conv, AudioVaeError> {
        let g = self.take(&format!("{p}.weight_g"))?;
        let v = self.take(&format!("{p}.weight_v"))?;
        if g.iter().any(|x| !x.is_finite()) || v.iter().all(|&x| x == 0.0) {
            return Err(AudioVaeError::Checkpoint {
                file: self.place.clone(),
                tensor: format!("{p}.weight_g / weight_v"),
                why: "weight normalization needs finite gains and a non-zero direction".into(),
            });
        }
        let weight = weight_norm(&v, &g, rows)?;
        let bias = if bias {
            Some(self.take(&format!("{p}.bias"))?)
        } else {
            None
        };
        Ok(Conv { geo, weight, bias })
    }

    fn activation(&mut self, p: &str) -> Result<Activation, AudioVaeError> {
        Ok(Activation {
            alpha: self.take(&format!("{p}.act.alpha"))?,
            beta: self.take(&format!("{p}.act.beta"))?,
            up: self.take(&format!("{p}.upsample.filter"))?,
            down: self.take(&format!("{p}.downsample.lowpass.filter"))?,
        })
    }
}

fn shape_err(what: &str, why: String) -> AudioVaeError {
    AudioVaeError::Shape(ShapeError::new(
        what,
        "a size the host decode supports",
        why,
    ))
}

impl Conv {
    fn run(&self, x: &Signal, transpose: bool) -> Result<Signal, AudioVaeError> {
        let f = if transpose { conv_transpose1d } else { conv1d };
        let (data, len) = f(
            &x.data,
            x.batch,
            x.len,
            &self.geo,
            &self.weight,
            self.bias.as_deref(),
        )?;
        Ok(Signal {
            data,
            batch: x.batch,
            channels: self.geo.out_channels,
            len,
        })
    }
}

impl Activation {
    /// 2x up-sampling, SnakeBeta, 2x down-sampling, as the reference's alias-free activation.
    fn run(&self, x: &Signal) -> Result<Signal, AudioVaeError> {
        let (r, k, c) = (ACTIVATION_RATIO, ACTIVATION_TAPS, x.channels);
        let rows = checked_product("activation rows", &[x.batch, c])
            .map_err(|e| shape_err("activation", e))?;
        // Up: replicate pad by k/r - 1, depthwise transposed conv with stride r, times r, crop.
        let pad = k / r - 1;
        let crop_left = pad * r + (k - r) / 2;
        let crop_right = pad * r + (k - r).div_ceil(2);
        let padded = pad_replicate_1d(&x.data, rows, x.len, pad, pad)?;
        let plen = x.len + 2 * pad;
        let depthwise = Conv1dGeometry {
            in_channels: c,
            out_channels: c,
            kernel: k,
            stride: r,
            padding: 0,
            dilation: 1,
            groups: c,
        };
        let up_w: Vec<f32> = self.up.iter().copied().cycle().take(c * k).collect();
        let (mut up, ulen) = conv_transpose1d(&padded, x.batch, plen, &depthwise, &up_w, None)?;
        let keep = ulen
            .checked_sub(crop_left + crop_right)
            .filter(|&n| n > 0)
            .ok_or_else(|| shape_err("activation up-sampling", format!("length {ulen}")))?;
        up.iter_mut().for_each(|v| *v *= r as f32);
        let mut cropped = Vec::with_capacity(rows * keep);
        for row in up.chunks_exact(ulen) {
            cropped.extend_from_slice(&row[crop_left..crop_left + keep]);
        }
        snake_beta(&mut cropped, x.batch, c, keep, &self.alpha, &self.beta)?;
        // Down: replicate pad (k/2 - 1, k/2) for an even k, depthwise low-pass with stride r.
        let (left, right) = (k / 2 - usize::from(k % 2 == 0), k / 2);
        let padded = pad_replicate_1d(&cropped, rows, keep, left, right)?;
        let down_w: Vec<f32> = self.down.iter().copied().cycle().take(c * k).collect();
        let (data, len) = conv1d(
            &padded,
            x.batch,
            keep + left + right,
            &depthwise,
            &down_w,
            None,
        )?;
        Ok(Signal {
            data,
            batch: x.batch,
            channels: c,
            len,
        })
    }
}

fn add_into(acc: &mut Signal, x: &Signal) -> Result<(), AudioVaeError> {
    if acc.data.len() != x.data.len() || acc.len != x.len {
        return Err(shape_err(
            "residual sum",
            format!("length {} against {}", acc.len, x.len),
        ));
    }
    acc.data.iter_mut().zip(&x.data).for_each(|(a, b)| *a += b);
    Ok(())
}

impl AmpBlock {
    fn run(&self, x: &Signal) -> Result<Signal, AudioVaeError> {
        let mut h = Signal {
            data: x.data.clone(),
            ..*x
        };
        for (conv1, conv2, act1, act2) in &self.units {
            let r = conv1.run(&act1.run(&h)?, false)?;
            let r = conv2.run(&act2.run(&r)?, false)?;
            add_into(&mut h, &r)?;
        }
        Ok(h)
    }
}

impl HostAudioVae {
    /// Loads a diffusers `audio_vae/` folder: validates `config.json` (which must carry `latents_mean` and
    /// `latents_std`, as the pipeline uses them), checks every decoder tensor's presence, shape and dtype (the
    /// encoder side is ignored, anything else unknown is an error), and forms the weight-normalized weights.
    pub fn load(model: &ModelDir) -> Result<HostAudioVae, AudioVaeError> {
        let file = model.dir().join("config.json");
        let config = AudioVaeConfig::from_json_file(model.config_json(), &file)?;
        let missing = |key: &str| {
            AudioVaeConfigError {
            file: file.display().to_string(),
            why: format!("`{key}` is missing; the decode de-normalizes the latents with it (add the released values)"),
        }
        };
        let mean = config
            .latents_mean
            .clone()
            .ok_or_else(|| missing("latents_mean"))?;
        let std = config
            .latents_std
            .clone()
            .ok_or_else(|| missing("latents_std"))?;
        let mut specs = config.tensor_specs();
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        // The encoder side is accepted as it is stored.
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
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let (mut tensors, _) = model.load_f32(&refs)?;
        let mut t = Take {
            tensors: &mut tensors,
            place: model.dir().display().to_string(),
        };

        let (lc, ld, dd) = (
            config.latent_channels,
            config.latent_dim,
            config.decoder_dim,
        );
        let dec_in = Conv {
            geo: Conv1dGeometry::plain(lc, ld, 1, 0),
            weight: t.take("dec_in_proj.weight")?,
            bias: Some(t.take("dec_in_proj.bias")?),
        };
        let conv_pre = t.wn_conv(
            "decoder.conv_pre",
            Conv1dGeometry::plain(ld, dd, 7, 3),
            dd,
            true,
        )?;
        let n_kernels = config.resblock_kernel_sizes.len();
        let mut stages = Vec::with_capacity(config.decoder_rates.len());
        for (i, (&rate, &kernel)) in config
            .decoder_rates
            .iter()
            .zip(&config.decoder_kernel_sizes)
            .enumerate()
        {
            let (cin, cout) = config.stage_channels(i);
            let up = t.wn_conv(
                &format!("decoder.ups.{i}.0"),
                Conv1dGeometry {
                    stride: rate,
                    ..Conv1dGeometry::plain(cin, cout, kernel, (kernel - rate) / 2)
                },
                cin,
                true,
            )?;
            let mut blocks = Vec::with_capacity(n_kernels);
            for (j, (&k, dilations)) in config
                .resblock_kernel_sizes
                .iter()
                .zip(&config.resblock_dilation_sizes)
                .enumerate()
            {
                let p = format!("decoder.resblocks.{}", i * n_kernels + j);
                let mut units = Vec::with_capacity(dilations.len());
                for (m, &d) in dilations.iter().enumerate() {
                    let conv1 = t.wn_conv(
                        &format!("{p}.convs1.{m}"),
                        Conv1dGeometry {
                            dilation: d,
                            ..Conv1dGeometry::plain(cout, cout, k, (k * d - d) / 2)
                        },
                        cout,
                        true,
                    )?;
                    let conv2 = t.wn_conv(
                        &format!("{p}.convs2.{m}"),
                        Conv1dGeometry::plain(cout, cout, k, (k - 1) / 2),
                        cout,
                        true,
                    )?;
                    let act1 = t.activation(&format!("{p}.activations.{}", 2 * m))?;
                    let act2 = t.activation(&format!("{p}.activations.{}", 2 * m + 1))?;
                    units.push((conv1, conv2, act1, act2));
                }
                blocks.push(AmpBlock { units });
            }
            stages.push(Stage { up, blocks });
        }
        let c = config.final_channels();
        let act_post = t.activation("decoder.activation_post")?;
        let conv_post = t.wn_conv(
            "decoder.conv_post",
            Conv1dGeometry::plain(c, 1, 7, 3),
            1,
            false,
        )?;
        Ok(HostAudioVae {
            mean: mean.iter().map(|&v| v as f32).collect(),
            std: std.iter().map(|&v| v as f32).collect(),
            config,
            dec_in,
            conv_pre,
            stages,
            act_post,
            conv_post,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &AudioVaeConfig {
        &self.config
    }

    /// Output samples per item for `frames` latent frames (the up-samplers' lengths, `frames * hop` when every
    /// `kernel - rate` is even).
    pub fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError> {
        let mut len = frames;
        for s in &self.stages {
            len = s.up.geo.transpose_out_len(len)?;
        }
        Ok(len)
    }

    /// Checks a decode request before anything is allocated: `[batch, latent_channels, frames]` with batch and
    /// frames in range, and the largest intermediate (the 2x up-sampled activation of the widest stage) bounded.
    fn check_request(&self, shape: &[usize]) -> Result<[usize; 3], AudioVaeError> {
        let &[b, c, a] = shape else {
            return Err(AudioVaeError::Input(format!(
                "latents must be [batch, {}, frames], got shape {shape:?}",
                self.config.latent_channels
            )));
        };
        if c != self.config.latent_channels {
            return Err(AudioVaeError::Input(format!(
                "latents have {c} channels; this VAE takes {} (shape [batch, channels, frames])",
                self.config.latent_channels
            )));
        }
        if b == 0 || b > MAX_BATCH {
            return Err(AudioVaeError::Input(format!(
                "batch {b} must be 1..={MAX_BATCH} (stereo is 2)"
            )));
        }
        if a == 0 || a > MAX_FRAMES {
            return Err(AudioVaeError::Input(format!(
                "{a} latent frames: the decode takes 1..={MAX_FRAMES}"
            )));
        }
        let mut len = a;
        let width = self.config.latent_dim.max(self.config.decoder_dim);
        let mut largest =
            checked_product("decode size", &[b, width, a]).map_err(|e| shape_err("latents", e))?;
        for s in &self.stages {
            len = s.up.geo.transpose_out_len(len)?;
            let n = checked_product(
                "decode size",
                &[b, s.up.geo.out_channels, len, 2 * ACTIVATION_RATIO],
            )
            .map_err(|e| shape_err("latents", e))?;
            largest = largest.max(n);
        }
        if largest > MAX_ACTIVATION_ELEMENTS {
            return Err(AudioVaeError::Input(format!(
                "{b} x {a} frames need an intermediate of {largest} values, above the host limit {MAX_ACTIVATION_ELEMENTS}; decode fewer frames"
            )));
        }
        Ok([b, c, a])
    }

    /// Decodes normalized latents `[batch, latent_channels, frames]` (the DiT's output; stereo is batch 2): applies
    /// `z * latents_std + latents_mean` per channel, then [`HostAudioVae::decode_denormalized`].
    pub fn decode(&self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        let [_, c, a] = self.check_request(latents.shape())?;
        let mut z = latents.data().to_vec();
        for (i, row) in z.chunks_exact_mut(a).enumerate() {
            let ch = i % c;
            let (s, m) = (self.std[ch], self.mean[ch]);
            row.iter_mut().for_each(|v| *v = *v * s + m);
        }
        self.decode_denormalized(&TensorF32::new(latents.shape().to_vec(), z)?)
    }

    /// The model's `decode`: de-normalized latents `[batch, latent_channels, frames]` to the clamped waveform
    /// `[batch, 1, samples]`.
    pub fn decode_denormalized(&self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        let [b, c, a] = self.check_request(latents.shape())?;
        let x = Signal {
            data: latents.data().to_vec(),
            batch: b,
            channels: c,
            len: a,
        };
        let x = self.dec_in.run(&x, false)?;
        let mut x = self.conv_pre.run(&x, false)?;
        for stage in &self.stages {
            let h = stage.up.run(&x, true)?;
            let mut sum: Option<Signal> = None;
            for block in &stage.blocks {
                let y = block.run(&h)?;
                match sum.as_mut() {
                    None => sum = Some(y),
                    Some(acc) => add_into(acc, &y)?,
                }
            }
            let mut s = sum.ok_or_else(|| shape_err("AMP blocks", "none".into()))?;
            let n = stage.blocks.len() as f32;
            s.data.iter_mut().for_each(|v| *v /= n);
            x = s;
        }
        let x = self.act_post.run(&x)?;
        let mut y = self.conv_post.run(&x, false)?;
        y.data.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
        Ok(TensorF32::new(vec![b, 1, y.len], y.data)?)
    }

    /// `dec_in_proj` alone on de-normalized latents (`[batch, latent_dim, frames]`), for diagnosis.
    pub fn dec_in_proj(&self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        let [b, c, a] = self.check_request(latents.shape())?;
        let x = self.dec_in.run(
            &Signal {
                data: latents.data().to_vec(),
                batch: b,
                channels: c,
                len: a,
            },
            false,
        )?;
        Ok(TensorF32::new(vec![b, x.channels, x.len], x.data)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::config::test_support::{
        assert_each_key_under_hostile_values, assert_refused_naming_key,
    };

    fn parse(value: serde_json::Value) -> Result<AudioVaeConfig, AudioVaeConfigError> {
        AudioVaeConfig::from_json(&value)
    }

    #[test]
    fn defaults_are_the_release() {
        let c = parse(serde_json::json!({})).unwrap();
        assert_eq!(c.hop_length(), 800);
        assert_eq!(c.stage_channels(0), (1024, 512));
        assert_eq!(c.final_channels(), 8);
        // dec_in 2 + conv_pre 3 + 7 x (3 + 3 blocks x 3 dilations x (6 + 8)) + post 4 + 2.
        assert_eq!(c.tensor_specs().len(), 2 + 3 + 7 * (3 + 3 * 3 * 14) + 4 + 2);
        // The diffusers state dict of the default model holds 914 decoder tensors of 64,939,353 values.
        assert_eq!(c.parameter_count(), 64_939_353);
    }

    #[test]
    fn hostile_configs_name_the_key() {
        assert_refused_naming_key(
            parse,
            &[
                (serde_json::json!({"latent_dim": 0}), "latent_dim"),
                (serde_json::json!({"latent_dim": "wide"}), "latent_dim"),
                (serde_json::json!({"decoder_dim": u64::MAX}), "decoder_dim"),
                (serde_json::json!({"latent_channels": 30}), "latent_dim"),
                (
                    serde_json::json!({"decoder_rates": [5, 5, 2, 2, 2, 2, 4]}),
                    "decoder_rates",
                ),
                (
                    serde_json::json!({"decoder_rates": [0, 5], "decoder_kernel_sizes": [9, 9]}),
                    "decoder_rates[0]",
                ),
                (
                    serde_json::json!({"decoder_kernel_sizes": [9, 9]}),
                    "decoder_kernel_sizes",
                ),
                (
                    serde_json::json!({"decoder_kernel_sizes": [9, 4, 4, 4, 4, 4, 4]}),
                    "decoder_kernel_sizes[1]",
                ),
                (
                    serde_json::json!({"resblock_kernel_sizes": [3, 4, 11]}),
                    "resblock_kernel_sizes[1]",
                ),
                (
                    serde_json::json!({"resblock_kernel_sizes": [3]}),
                    "resblock_dilation_sizes",
                ),
                (
                    serde_json::json!({"resblock_dilation_sizes": [[1], [], [1]]}),
                    "resblock_dilation_sizes[1]",
                ),
                (
                    serde_json::json!({"resblock_dilation_sizes": [[1], [1, 100000], [1]]}),
                    "resblock_dilation_sizes[1][1]",
                ),
                (serde_json::json!({"decoder_dim": 64}), "decoder_dim"),
                (
                    serde_json::json!({"latents_mean": [0.0, 1.0]}),
                    "latents_mean",
                ),
                (serde_json::json!({"latents_std": "one"}), "latents_std"),
                (serde_json::json!({"encoder_rates": []}), "encoder_rates"),
                (
                    serde_json::json!({"_class_name": "AutoencoderKLMiniMaxH3"}),
                    "_class_name",
                ),
                (
                    serde_json::json!({"latent_dim": 16384, "decoder_dim": 16384,
                    "resblock_kernel_sizes": [127, 127, 127, 127, 127, 127, 127, 127],
                    "resblock_dilation_sizes": [[1,1,1,1,1,1,1,1],[1],[1],[1],[1],[1],[1],[1]]}),
                    "parameters",
                ),
            ],
        );
        assert!(names_this_class(
            &serde_json::json!({"_class_name": CLASS_NAME})
        ));
    }

    #[test]
    fn every_key_under_hostile_values_parses_or_fails_cleanly() {
        let keys = [
            "encoder_dim",
            "encoder_rates",
            "latent_dim",
            "latent_channels",
            "num_attention_heads",
            "decoder_dim",
            "decoder_rates",
            "decoder_kernel_sizes",
            "resblock_kernel_sizes",
            "resblock_dilation_sizes",
            "sampling_rate",
            "latents_mean",
            "latents_std",
            "_class_name",
        ];
        assert_each_key_under_hostile_values(&keys, parse, |config| {
            assert!(config.parameter_count() <= MAX_PARAMETERS)
        });
    }
}
