//! The diffusers MiniMax H3 folder, as `ModularPipeline.save_pretrained` writes it and `from_pretrained` reads
//! it: `modular_model_index.json` (or a plain `model_index.json`), and one subfolder per component:
//! `transformer/`, `text_encoder/` and `tokenizer/` (or `processor/`), `vae/`, `audio_vae/`, `scheduler/` and
//! `audio_scheduler/`. [`FolderLayout::read`] finds them and [`Configs::read`] parses and cross-checks every
//! config before any weight is read, naming the file and key of whatever does not fit.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::PipelineError;
use crate::minimax_h3::config::MiniMaxH3Config;
use crate::minimax_h3::layout::{FRAMES_PER_CHUNK, LATENTS_PER_CHUNK};
use crate::minimax_h3::scheduler::{H3SchedulerConfig, Modality};
use crate::minimax_h3::text::H3TextFolder;
use crate::minimax_h3::vae_audio::AudioVaeConfig;
use crate::minimax_h3::vae_video::VideoVaeConfig;
use crate::qwen3_vl::text_encoder::TextEncoderConfig;

/// The index files a saved pipeline may carry, in the order they are read.
pub const INDEX_FILES: [&str; 2] = ["modular_model_index.json", "model_index.json"];

/// The components this pipeline reads, the class each must be, and its subfolder.
const COMPONENTS: [(&str, &str); 6] = [
    ("transformer", "MiniMaxH3Transformer3DModel"),
    ("text_encoder", "Qwen3VLForConditionalGeneration"),
    ("vae", "AutoencoderKLMiniMaxH3"),
    ("audio_vae", "AutoencoderKLMiniMaxH3Audio"),
    ("scheduler", "MiniMaxH3Scheduler"),
    ("audio_scheduler", "MiniMaxH3Scheduler"),
];

pub(super) fn folder_err(path: &Path, why: impl Into<String>) -> PipelineError {
    PipelineError::Folder {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// Where the components of a folder are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderLayout {
    pub dir: PathBuf,
    /// The index file read.
    pub index: PathBuf,
    pub transformer: PathBuf,
    pub text_encoder: PathBuf,
    pub tokenizer_json: PathBuf,
    pub vae: PathBuf,
    pub audio_vae: PathBuf,
}

/// The class name of an index entry: `[library, class]` (`model_index.json`) or `[library, class, spec]`
/// (`modular_model_index.json`).
fn entry_class(entry: &Value) -> Option<&str> {
    entry
        .as_array()
        .and_then(|a| a.get(1))
        .and_then(Value::as_str)
}

impl FolderLayout {
    /// Reads the index and finds the component folders; the error names what is missing and what to pass.
    pub fn read(dir: &Path) -> Result<FolderLayout, PipelineError> {
        let index = INDEX_FILES
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                folder_err(
                    dir,
                    "no modular_model_index.json or model_index.json; pass the folder of a diffusers MiniMax H3 \
                     pipeline (the one holding transformer/, text_encoder/, tokenizer/, vae/, audio_vae/)",
                )
            })?;
        let text = std::fs::read_to_string(&index)
            .map_err(|e| folder_err(&index, format!("cannot read it ({e})")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| folder_err(&index, format!("not valid JSON: {e}")))?;
        let Value::Object(fields) = &value else {
            return Err(folder_err(&index, "the index is not a JSON object"));
        };
        if let Some(class) = fields.get("_class_name") {
            let class = class.as_str().unwrap_or_default();
            if !class.starts_with("MiniMaxH3") {
                return Err(folder_err(
                    &index,
                    format!(
                        "`_class_name` is {class:?}; this pipeline runs MiniMax H3 folders (MiniMaxH3ModularPipeline)"
                    ),
                ));
            }
        }
        for (name, class) in COMPONENTS {
            if let Some(found) = fields.get(name).and_then(entry_class) {
                if found != class {
                    return Err(folder_err(
                        &index,
                        format!("`{name}` is a {found}; a MiniMax H3 folder has a {class} there"),
                    ));
                }
            }
        }
        let sub = |name: &str| -> Result<PathBuf, PipelineError> {
            let path = dir.join(name);
            if path.join("config.json").is_file() {
                Ok(path)
            } else {
                Err(folder_err(
                    dir,
                    format!("{name}/config.json is missing; the folder is incomplete (save or download it again)"),
                ))
            }
        };
        let text = H3TextFolder::locate(dir).map_err(|e| folder_err(dir, e.to_string()))?;
        Ok(FolderLayout {
            dir: dir.to_path_buf(),
            index,
            transformer: sub("transformer")?,
            text_encoder: text.text_encoder,
            tokenizer_json: text.tokenizer_json,
            vae: sub("vae")?,
            audio_vae: sub("audio_vae")?,
        })
    }
}

fn read_json(path: &Path) -> Result<Value, PipelineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| folder_err(path, format!("cannot read it ({e})")))?;
    serde_json::from_str(&text).map_err(|e| folder_err(path, format!("not valid JSON: {e}")))
}

/// Every config of a folder, parsed, validated and checked against each other.
#[derive(Debug, Clone, PartialEq)]
pub struct Configs {
    pub dit: MiniMaxH3Config,
    pub text_encoder: TextEncoderConfig,
    pub video_vae: VideoVaeConfig,
    pub audio_vae: AudioVaeConfig,
    pub video_scheduler: H3SchedulerConfig,
    pub audio_scheduler: H3SchedulerConfig,
}

impl Configs {
    /// Reads the configs of `layout` (no weights) and checks that the components fit together: the DiT's
    /// latent, audio and text widths against the VAEs and the text encoder, a `(1, ph, pw)` patch, and the video
    /// VAE's 17-frame clips of 5 latents that the layout's `17 n + 5` frame rule stands on.
    pub fn read(layout: &FolderLayout) -> Result<Configs, PipelineError> {
        let dit_file = layout.transformer.join("config.json");
        let dit = MiniMaxH3Config::from_json_file(&read_json(&dit_file)?, &dit_file)
            .map_err(|e| folder_err(&dit_file, e.to_string()))?;
        let te_file = layout.text_encoder.join("config.json");
        let text_encoder = TextEncoderConfig::from_json(&read_json(&te_file)?)
            .map_err(|e| folder_err(&te_file, e.to_string()))?;
        let vae_file = layout.vae.join("config.json");
        let video_vae = VideoVaeConfig::from_json_file(&read_json(&vae_file)?, &vae_file)
            .map_err(|e| folder_err(&vae_file, e.to_string()))?;
        let audio_file = layout.audio_vae.join("config.json");
        let audio_vae = AudioVaeConfig::from_json_file(&read_json(&audio_file)?, &audio_file)
            .map_err(|e| folder_err(&audio_file, e.to_string()))?;
        let video_scheduler = H3SchedulerConfig::from_model_folder(&layout.dir, Modality::Video)
            .map_err(|e| folder_err(&layout.dir, e.to_string()))?;
        let audio_scheduler = H3SchedulerConfig::from_model_folder(&layout.dir, Modality::Audio)
            .map_err(|e| folder_err(&layout.dir, e.to_string()))?;
        let configs = Configs {
            dit,
            text_encoder,
            video_vae,
            audio_vae,
            video_scheduler,
            audio_scheduler,
        };
        configs.check_agreement(layout)?;
        Ok(configs)
    }

    fn check_agreement(&self, layout: &FolderLayout) -> Result<(), PipelineError> {
        let dit_file = layout.transformer.join("config.json");
        let pairs = [
            (
                "in_channels",
                self.dit.in_channels,
                self.video_vae.latent_channels,
                layout.vae.join("config.json"),
                "latent_channels",
            ),
            (
                "audio_in_channels",
                self.dit.audio_in_channels,
                self.audio_vae.latent_channels,
                layout.audio_vae.join("config.json"),
                "latent_channels",
            ),
            (
                "text_dim",
                self.dit.text_dim,
                self.text_encoder.hidden_size,
                layout.text_encoder.join("config.json"),
                "text_config.hidden_size",
            ),
        ];
        for (key, ours, theirs, other, other_key) in pairs {
            if ours != theirs {
                return Err(folder_err(
                    &dit_file,
                    format!(
                        "`{key}` is {ours} but {} has `{other_key}` {theirs}; the components do not belong together",
                        other.display()
                    ),
                ));
            }
        }
        let [pt, ph, pw] = self.dit.patch_size;
        if pt != 1 || ph == 0 || pw == 0 {
            return Err(folder_err(
                &dit_file,
                format!(
                    "`patch_size` is {:?}; the pipeline packs (1, ph, pw) patches",
                    self.dit.patch_size
                ),
            ));
        }
        let chunk = self.video_vae.chunk_geometry();
        if chunk.clip_length != FRAMES_PER_CHUNK || chunk.tokens_chunk_size != LATENTS_PER_CHUNK {
            return Err(folder_err(
                &layout.vae.join("config.json"),
                format!(
                    "`clip_length` {} and `temporal_downsample_factors` {:?} make clips of {} frames and {} latents; \
                     the MiniMax H3 layout takes 17-frame clips of 5 latents (17 n + 5 frames)",
                    self.video_vae.clip_length,
                    self.video_vae.temporal_downsample_factors,
                    chunk.clip_length,
                    chunk.tokens_chunk_size
                ),
            ));
        }
        Ok(())
    }

    /// Pixels per latent row or column (the video VAE's spatial ratio).
    pub fn spatial_ratio(&self) -> usize {
        self.video_vae.spatial_ratio()
    }

    /// What height and width must be multiples of: the spatial ratio times the patch (32 as released).
    pub fn canvas_multiples(&self) -> (usize, usize) {
        let r = self.spatial_ratio();
        (r * self.dit.patch_size[1], r * self.dit.patch_size[2])
    }
}
