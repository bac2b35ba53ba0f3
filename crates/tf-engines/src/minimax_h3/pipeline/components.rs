//! The pipeline's four model components behind their backend traits, where they run, and how they are held: all
//! resident, or loaded, run and freed in turn by every request ([`Residency::Sequential`]).
//!
//! - text encoder: [`H3TextBackend`] (the host reference, or the GPU Qwen3-VL encoder), decoder layers
//!   `0..layer` only (what `hidden_states[layer]` needs);
//! - DiT: [`H3DitBackend`] (the host reference, or [`GpuH3Dit`]);
//! - video VAE: [`VideoVaeBackend`] (the host reference, or [`GpuVideoVae`]);
//! - audio VAE: [`AudioVaeDecoder`] (the host reference, or [`GpuAudioVae`]).
//!
//! The weight bytes the memory plan decides with are each component's tensors at the dtype its backend keeps
//! them in: f32 on the host; on the GPU bf16 for the text encoder, the DiT and the video VAE, f32 for the audio
//! VAE (the reference pins it to fp32). Workspaces are covered by the device reserve.
//!
//! [`Residency::Sequential`]: crate::nn::memory_plan::Residency::Sequential

use super::{folder::folder_err, Backend, PipelineError};
use crate::minimax_h3::config::MiniMaxH3Config;
use crate::minimax_h3::dit::H3DitBackend;
use crate::minimax_h3::dit_gpu::GpuH3Dit;
use crate::minimax_h3::dit_host::HostH3Dit;
use crate::minimax_h3::text::{load_gpu_backend, load_host_backend, load_options, H3TextBackend};
use crate::minimax_h3::vae_audio::{self, AudioVaeDecoder, HostAudioVae};
use crate::minimax_h3::vae_audio_gpu::GpuAudioVae;
use crate::minimax_h3::vae_video::{self, HostVideoVae, VideoVaeBackend};
use crate::minimax_h3::vae_video_gpu::GpuVideoVae;
use crate::nn::gpu::GpuDevice;
use crate::nn::memory_plan::Component;
use crate::nn::precision::DitPrecision;
use crate::nn::upload::StagingConfig;
use crate::nn::weights::ModelDir;
use crate::qwen3_vl::text_encoder::TextEncoderConfig;
use crate::qwen3_vl::text_encoder_gpu::GpuTextEncoder;

/// The component names of the memory plan and the load report, in pipeline order.
pub const TEXT_ENCODER: &str = "text encoder";
pub const DIT: &str = "DiT";
pub const VIDEO_VAE: &str = "video VAE";
pub const AUDIO_VAE: &str = "audio VAE";

/// The four components, loaded.
pub(super) struct Resident {
    pub text: Box<dyn H3TextBackend>,
    pub dit: Box<dyn H3DitBackend>,
    pub video_vae: Box<dyn VideoVaeBackend>,
    pub audio_vae: Box<dyn AudioVaeDecoder>,
}

/// Where the weights of one of the two large components (text encoder, DiT) come from.
pub(super) enum WeightSource {
    /// The folder's safetensors (headers checked, files mapped).
    Files(ModelDir),
    /// Made on the device from a seed, at the config's full size: timing only (the folder needs its
    /// `config.json` alone). See [`super::LoadOptions::random_weights`].
    Random { seed: u32 },
}

/// The opened folders (headers and file mappings, nothing on the device) that the sequential mode loads from.
pub(super) struct Folders {
    /// The hidden state the text encoder is read at (its layers past that are not loaded).
    pub text_layer: usize,
    /// The GEMM precision the GPU DiT is loaded in, as asked (`fp8` resolves at load, by the checkpoint).
    pub dit_precision: DitPrecision,
    /// The configs the random sources are made from (and the DiT's FP8 byte count).
    pub text_config: TextEncoderConfig,
    pub dit_config: MiniMaxH3Config,
    pub text_encoder: WeightSource,
    pub dit: WeightSource,
    pub video_vae: ModelDir,
    pub audio_vae: ModelDir,
}

/// How the components are held.
pub(super) enum Components {
    /// Loaded once and kept.
    Resident(Box<Resident>),
    /// Loaded, run and freed in turn by every request.
    Sequential(Box<Folders>),
}

impl Folders {
    pub fn text_encoder(
        &self,
        device: Option<&GpuDevice>,
    ) -> Result<Box<dyn H3TextBackend>, PipelineError> {
        Ok(match (device, &self.text_encoder) {
            (None, WeightSource::Files(model)) => {
                Box::new(load_host_backend(model, self.text_layer)?)
            }
            (Some(device), WeightSource::Files(model)) => {
                let te = load_gpu_backend(device, model, self.text_layer)?;
                uploads_done(device)?;
                Box::new(te)
            }
            (Some(device), WeightSource::Random { seed }) => Box::new(GpuTextEncoder::random_in(
                device,
                self.text_config.clone(),
                *seed,
                load_options(self.text_layer),
            )?),
            (None, WeightSource::Random { .. }) => return Err(random_on_host()),
        })
    }

    pub fn dit(&self, device: Option<&GpuDevice>) -> Result<Box<dyn H3DitBackend>, PipelineError> {
        Ok(match (device, &self.dit) {
            (None, WeightSource::Files(model)) => Box::new(HostH3Dit::load(model)?),
            (Some(device), WeightSource::Files(model)) => {
                let dit = GpuH3Dit::load_in(
                    device,
                    model,
                    crate::minimax_h3::dit_host::LoadOptions::default(),
                    StagingConfig::default(),
                    self.dit_precision,
                )?;
                uploads_done(device)?;
                Box::new(dit)
            }
            (Some(device), WeightSource::Random { seed }) => Box::new(GpuH3Dit::random_in(
                device,
                &self.dit_config,
                u64::from(*seed),
                self.dit_precision,
            )?),
            (None, WeightSource::Random { .. }) => return Err(random_on_host()),
        })
    }

    pub fn video_vae(
        &self,
        device: Option<&GpuDevice>,
    ) -> Result<Box<dyn VideoVaeBackend>, PipelineError> {
        Ok(match device {
            None => Box::new(HostVideoVae::load(&self.video_vae)?),
            Some(device) => {
                let vae = GpuVideoVae::load_in(device, &self.video_vae)?;
                uploads_done(device)?;
                Box::new(vae)
            }
        })
    }

    pub fn audio_vae(
        &self,
        device: Option<&GpuDevice>,
    ) -> Result<Box<dyn AudioVaeDecoder>, PipelineError> {
        Ok(match device {
            None => Box::new(HostAudioVae::load(&self.audio_vae)?),
            Some(device) => {
                let vae = GpuAudioVae::load_in(device, &self.audio_vae)?;
                uploads_done(device)?;
                Box::new(vae)
            }
        })
    }

    /// All four, loaded now.
    pub fn load_all(&self, device: Option<&GpuDevice>) -> Result<Resident, PipelineError> {
        Ok(Resident {
            text: self.text_encoder(device)?,
            dit: self.dit(device)?,
            video_vae: self.video_vae(device)?,
            audio_vae: self.audio_vae(device)?,
        })
    }

    /// The memory plan's components: each one's weights at its backend's dtype.
    pub fn plan_components(&self, backend: Backend) -> Vec<Component> {
        let text_layer = self.text_layer;
        let device = |model: &ModelDir, skip: &[&str], bytes_per_value: u64| {
            let values = values_of(model, skip, text_layer);
            match backend {
                Backend::Host => values.saturating_mul(4),
                Backend::Gpu => values.saturating_mul(bytes_per_value),
            }
        };
        // A GEMM group in FP8 holds one byte a weight instead of two (its row scales are within the reserve).
        let dit = match &self.dit {
            WeightSource::Files(model) => device(model, &[], 2),
            WeightSource::Random { .. } => {
                (self.dit_config.parameter_count() as u64).saturating_mul(2)
            }
        };
        let dit = match backend {
            Backend::Host => dit,
            Backend::Gpu => dit.saturating_sub(fp8_weights(
                &self.dit_config,
                crate::minimax_h3::dit_gpu::resolve_precision(&self.dit_config, self.dit_precision),
            )),
        };
        let text_encoder = match &self.text_encoder {
            WeightSource::Files(model) => device(model, &[], 2),
            WeightSource::Random { .. } => GpuTextEncoder::planned_weight_bytes(
                &self.text_config,
                load_options(self.text_layer),
            )
            .map_or(u64::MAX, |b| b as u64),
        };
        vec![
            Component::new(TEXT_ENCODER, text_encoder),
            Component::new(DIT, dit),
            Component::new(
                VIDEO_VAE,
                device(&self.video_vae, &vae_video::ENCODER_PREFIXES, 2),
            ),
            Component::new(
                AUDIO_VAE,
                device(&self.audio_vae, &vae_audio::ENCODER_PREFIXES, 4),
            ),
        ]
    }

    /// Opens the four component folders (headers checked, nothing converted or uploaded); the text encoder will
    /// be read at `text_layer`. With `random_weights`, the text encoder and the DiT are not opened: their weights
    /// will be made on the device from that seed.
    pub fn open(
        layout: &super::folder::FolderLayout,
        configs: &super::folder::Configs,
        text_layer: usize,
        dit_precision: DitPrecision,
        random_weights: Option<u32>,
    ) -> Result<Folders, PipelineError> {
        let open = |path: &std::path::Path| {
            ModelDir::open(path).map_err(|e| folder_err(path, e.to_string()))
        };
        let source = |path: &std::path::Path| -> Result<WeightSource, PipelineError> {
            Ok(match random_weights {
                Some(seed) => WeightSource::Random { seed },
                None => WeightSource::Files(open(path)?),
            })
        };
        Ok(Folders {
            text_layer,
            // As typed: the DiT resolves `fp8` at load, where it knows whether the file stores e4m3.
            dit_precision,
            text_config: configs.text_encoder.clone(),
            dit_config: configs.dit.clone(),
            text_encoder: source(&layout.text_encoder)?,
            dit: source(&layout.transformer)?,
            video_vae: open(&layout.vae)?,
            audio_vae: open(&layout.audio_vae)?,
        })
    }
}

/// What each component computes in on `backend` (the load report's precision lines): the host runs f32; on the
/// GPU the text encoder and the video VAE run bf16, the DiT `dit` (over its `layers` blocks), the audio VAE f32.
pub(super) fn precisions(
    backend: Backend,
    dit: DitPrecision,
    layers: usize,
) -> Vec<(&'static str, String)> {
    let on_gpu = |gpu: String| match backend {
        Backend::Host => "f32".to_string(),
        Backend::Gpu => gpu,
    };
    let dit = dit.resolve(crate::minimax_h3::dit_gpu::DEFAULT_FP8);
    vec![
        (TEXT_ENCODER, on_gpu("bf16".into())),
        (DIT, on_gpu(dit.describe(layers))),
        (VIDEO_VAE, on_gpu("bf16".into())),
        (AUDIO_VAE, "f32".into()),
    ]
}

/// The error of a random-weight source asked for on the host (the load refuses that combination first).
fn random_on_host() -> PipelineError {
    PipelineError::InvalidRequest(
        "random weights are made on the GPU; the host reference reads the folder's weights".into(),
    )
}

/// Weights of a DiT of `config` that `precision` stores in 8 bits (the chosen GEMM groups of the blocks it runs in
/// FP8); 0 in bf16.
fn fp8_weights(config: &MiniMaxH3Config, precision: DitPrecision) -> u64 {
    let (h, f) = (config.hidden_size as u64, config.ffn_dim as u64);
    let inner = (config.num_attention_heads * config.attention_head_dim) as u64;
    let adaln = (crate::minimax_h3::config::MODALITIES
        * crate::minimax_h3::config::MODULATION_CHUNKS) as u64
        * h
        * config.time_embed_dim as u64;
    (0..config.num_layers)
        .map(|layer| {
            let g = precision.groups_of(layer, config.num_layers);
            [
                (g.qkv, 3 * inner * h),
                (g.out, h * inner),
                (g.mlp_value, f * h),
                (g.mlp_gate || g.mlp_gate_int8, f * h),
                (g.mlp_out, h * f),
                (g.adaln.is_some(), adaln),
            ]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .sum::<u64>()
        })
        .sum()
}

/// Values of the tensors of `model` a load keeps: names starting with none of `skip`, and no decoder layer at or
/// past `text_layer` (`...layers.{i}.`; only the text encoder's names have that form), nor a vision tower.
fn values_of(model: &ModelDir, skip: &[&str], text_layer: usize) -> u64 {
    model
        .names()
        .filter(|n| !skip.iter().any(|p| n.starts_with(p)))
        .filter(|n| !n.contains("visual."))
        .filter(|n| layer_index(n).is_none_or(|i| i < text_layer))
        .filter_map(|n| model.info(n).ok())
        .map(|i| i.elements() as u64)
        .fold(0u64, u64::saturating_add)
}

/// The `i` of a `...language_model.layers.{i}....` tensor name.
fn layer_index(name: &str) -> Option<usize> {
    let rest = name.split_once("language_model.layers.")?.1;
    rest.split('.').next()?.parse().ok()
}

/// Waits for a component's uploads, so its load time is the whole load.
fn uploads_done(device: &GpuDevice) -> Result<(), PipelineError> {
    device
        .wait_for_uploads()
        .map_err(|e| super::gpu("waiting for the uploads", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_weights_count_the_chosen_groups_of_the_fp8_blocks() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/minimax_h3_dit/fl2va_first/model");
        let model = ModelDir::open(&dir).unwrap();
        let config = MiniMaxH3Config::from_json(model.config_json()).unwrap();
        // Hidden 24, two heads of 16, ffn 40, two blocks.
        let (qkv, out, fc1, fc2) = (3 * 32 * 24, 24 * 32, 2 * 40 * 24, 24 * 40);
        let of = |spec: &str| fp8_weights(&config, spec.parse().unwrap());
        assert_eq!(fp8_weights(&config, DitPrecision::Bf16), 0);
        // The default keeps the first and last block in bf16: both of these.
        assert_eq!(fp8_weights(&config, DitPrecision::FP8), 0);
        assert_eq!(of("fp8:all,ends=0"), 2 * (qkv + out + fc1 + fc2));
        assert_eq!(of("fp8:qkv,mlp_out,ends=0"), 2 * (qkv + fc2));
        assert_eq!(of("fp8:mlp_value,ends=0"), fc1);
        assert_eq!(of("fp8:mlp_gate,mlp_value,ends=0"), 2 * fc1);
        // The adaLN projection: 3 modalities x 6 chunks x hidden rows of time_embed_dim (12).
        assert_eq!(of("fp8:adaln,ends=0"), 2 * 18 * 24 * 12);
    }
}
