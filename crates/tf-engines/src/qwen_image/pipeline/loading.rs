//! How the pipeline holds its components on the GPU: the sequential mode's opened folders and per-request loads,
//! and the resident mode's GPU text encoder and VAE decoder, all on the pipeline's one [`GpuDevice`].

use super::{gpu, DitEngine, PipelineError};
use crate::nn::gpu::GpuDevice;
use crate::nn::upload::StagingConfig;
use crate::nn::weights::ModelDir;
use crate::qwen3_vl::text_encoder::{HostTextEncoder, TextEncoderConfig};
use crate::qwen3_vl::text_encoder_gpu::{check_supported, GpuTextEncoder};
use crate::qwen_image::components::{TextEncoderBackend, VaeBackend};
use crate::qwen_image::config::QwenImageDitConfig;
use crate::qwen_image::dit::DitError;
use crate::qwen_image::dit_gpu::{DitPrecision, GpuDit};
use crate::qwen_image::dit_host::HostDit;
use crate::qwen_image::vae::{HostVaeDecoder, VaeConfig};
use crate::qwen_image::vae_gpu::GpuVaeDecoder;

/// What the sequential mode keeps between requests: the opened folders (headers and file mappings, nothing on
/// the device) and the configs that planning a request reads.
pub(super) struct Sequential {
    pub(super) te_dir: ModelDir,
    pub(super) dit_dir: ModelDir,
    pub(super) vae_dir: ModelDir,
    pub(super) te_config: TextEncoderConfig,
    pub(super) dit_config: QwenImageDitConfig,
    pub(super) vae_config: VaeConfig,
    pub(super) dit_precision: DitPrecision,
}

impl Sequential {
    /// Reads the components' configs and checks the DiT's tensor headers (nothing is loaded).
    pub(super) fn open(
        te_dir: ModelDir,
        dit_dir: ModelDir,
        vae_dir: ModelDir,
    ) -> Result<Sequential, PipelineError> {
        let te_config = TextEncoderConfig::from_json(te_dir.config_json())?;
        let dit_config =
            QwenImageDitConfig::from_json(dit_dir.config_json()).map_err(DitError::from)?;
        crate::qwen_image::dit::check_folder(&dit_dir, &dit_config)?;
        let vae_config = VaeConfig::from_json(vae_dir.config_json())?;
        Ok(Sequential {
            te_dir,
            dit_dir,
            vae_dir,
            te_config,
            dit_config,
            vae_config,
            dit_precision: DitPrecision::Bf16,
        })
    }

    /// The text encoder on `ctx`'s device (the host reference where the GPU encoder does not support the
    /// config), or the host reference without a context.
    pub(super) fn text_encoder(
        &self,
        device: Option<&GpuDevice>,
    ) -> Result<Box<dyn TextEncoderBackend>, PipelineError> {
        match device {
            None => Ok(Box::new(HostTextEncoder::load(&self.te_dir)?)),
            Some(device) => {
                let (te, _) = gpu_text_encoder(device, &self.te_dir)?;
                uploads_done(device)?;
                Ok(te)
            }
        }
    }

    pub(super) fn dit(&self, device: Option<&GpuDevice>) -> Result<DitEngine, PipelineError> {
        match device {
            None => Ok(DitEngine::Host(Box::new(HostDit::load(&self.dit_dir)?))),
            Some(device) => {
                let dit = GpuDit::load_in(
                    device,
                    &self.dit_dir,
                    StagingConfig::default(),
                    self.dit_precision,
                )?;
                uploads_done(device)?;
                Ok(DitEngine::Gpu(Box::new(dit)))
            }
        }
    }

    pub(super) fn vae(
        &self,
        device: Option<&GpuDevice>,
    ) -> Result<Box<dyn VaeBackend>, PipelineError> {
        match device {
            None => Ok(Box::new(HostVaeDecoder::load(&self.vae_dir)?)),
            Some(device) => {
                let vae = GpuVaeDecoder::load_in(device, &self.vae_dir)?;
                uploads_done(device)?;
                Ok(Box::new(vae))
            }
        }
    }
}

/// Waits for a component's uploads, so its load time is the whole load.
pub(super) fn uploads_done(device: &GpuDevice) -> Result<(), PipelineError> {
    device
        .wait_for_uploads()
        .map_err(|e| gpu("waiting for the uploads", e))
}

/// The GPU text encoder and VAE decoder (`GpuTextEncoder::load_on`, `GpuVaeDecoder::load_on`, both implementing the
/// component traits). The flags say which components run on the device; a host reference may stand in here.
pub(super) fn gpu_text_encoder_and_vae(
    device: &GpuDevice,
    te_dir: &ModelDir,
    vae_dir: &ModelDir,
) -> Result<GpuComponents, PipelineError> {
    let (te, te_on_device) = gpu_text_encoder(device, te_dir)?;
    let vae: Box<dyn VaeBackend> = Box::new(GpuVaeDecoder::load_in(device, vae_dir)?);
    Ok(GpuComponents {
        te,
        vae,
        te_on_device,
        vae_on_device: true,
    })
}

/// The GPU text encoder, and whether it is on the device: its kernels need head dim 128 (every released
/// Qwen3-VL); other configs (tiny test models) run on the host reference, and the load report says so.
pub(super) fn gpu_text_encoder(
    device: &GpuDevice,
    te_dir: &ModelDir,
) -> Result<(Box<dyn TextEncoderBackend>, bool), PipelineError> {
    let te_config = TextEncoderConfig::from_json(te_dir.config_json())?;
    let te_on_device = check_supported(&te_config).is_ok();
    let te: Box<dyn TextEncoderBackend> = if te_on_device {
        Box::new(GpuTextEncoder::load_in(
            device,
            te_dir,
            StagingConfig::default(),
            crate::qwen3_vl::text_encoder::LoadOptions::default(),
        )?)
    } else {
        Box::new(HostTextEncoder::load(te_dir)?)
    };
    Ok((te, te_on_device))
}

pub(super) struct GpuComponents {
    pub(super) te: Box<dyn TextEncoderBackend>,
    pub(super) vae: Box<dyn VaeBackend>,
    pub(super) te_on_device: bool,
    pub(super) vae_on_device: bool,
}
