//! MiniMax H3's text conditioning: a prompt to `hidden_states[layer]` of the Qwen3-VL text encoder (layer 50 by
//! default), from the `text_encoder/` and `tokenizer/` components of a diffusers MiniMax H3 folder.
//!
//! What diffusers' H3 text step does, and what this component does:
//!
//! - **Tokens.** The prompt is encoded with no template and no special tokens added
//!   ([`tf_tokenizer::templates::MiniMaxH3`]): `\(` and `\)` become `(` and `)`, the text is cut before every
//!   `embedding:` that follows whitespace and each piece is encoded alone, and an empty result is the pad id
//!   151643. The tokenizer must carry H3's seven extra special tokens at 151669-151675. With
//!   [`PromptMarkup::Allowed`] (the default, as the reference) a spelled added token (`<d>`, the lyrics markers)
//!   forms its id; with [`PromptMarkup::Forbidden`] nothing the prompt spells forms one. The reference encodes the
//!   prompt verbatim, so the ids are the reference's except for prompts with `\(`, `\)` or a whitespace-led
//!   `embedding:` (ComfyUI's prompt syntax, which the released workflow used), for an empty prompt (the reference
//!   has no rows to encode), and under `Forbidden`. A prompt spelling a vision placeholder (`<|image_pad|>`,
//!   `<|video_pad|>`) is refused: the text path has no image to put there.
//! - **Features.** `hidden_states[layer]` `[tokens, hidden]`: 0 is the embeddings, `k` the output of decoder layer
//!   `k`, never the final norm, positions from 0 (a text-only prompt has equal M-RoPE axes, i.e. plain RoPE). No
//!   layer past `layer` runs. As the reference, the encoder must have **more** than `layer` decoder layers: the
//!   last entry of transformers' `hidden_states` is the final norm's output, not a layer's, so a model with
//!   exactly `layer` layers is refused (the error names `text_config.num_hidden_layers` and its value).
//! - **Bounds.** The prompt's bytes ([`H3TextOptions::max_prompt_bytes`]) are checked before tokenizing and its
//!   tokens ([`H3TextOptions::max_tokens`]) before the encoder runs; both errors say which limit and how to
//!   change it ([`H3TextError::is_invalid_request`] tells them from load failures).
//!
//! Backends implement [`H3TextBackend`]: the f32 host reference ([`HostTextEncoder`]) and the GPU encoder
//! ([`GpuTextEncoder`], bf16 storage). Both load with their layer cap at `layer` ([`LoadOptions::layers`]):
//! `hidden_states[layer]` is the output of decoder layer `layer` (1-based; index `layer - 1`), so layers
//! `0..layer` are read and held and the checkpoint's later layers and final norm are never read (at layer 50 of
//! Qwen3-VL-32B's 64, about 14 GB of bf16 weights the GPU does not hold).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::minimax_h3::text::{H3TextEncoder, H3TextOptions};
//!
//! let mut text = H3TextEncoder::load_host(Path::new("MiniMax-H3"), H3TextOptions::default())?;
//! let encoded = text.encode("a red fox runs through fresh snow at dawn")?;
//! println!("{} tokens -> {:?}", encoded.ids.len(), encoded.features.shape());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::{Path, PathBuf};

use tf_tokenizer::templates::{MiniMaxH3, PromptMarkup};
use tf_tokenizer::{Tokenizer, TokenizerError};
use thiserror::Error;

use crate::nn::gpu::GpuDevice;
use crate::nn::tensor::TensorF32;
use crate::nn::upload::StagingConfig;
use crate::nn::weights::{ModelDir, WeightsError};
use crate::qwen3_vl::text_encoder::{
    HostTextEncoder, LoadOptions, TextEncoderConfig, TextEncoderError,
};
use crate::qwen3_vl::text_encoder_gpu::GpuTextEncoder;

/// The hidden state H3 conditions on: the output of decoder layer 50.
pub const DEFAULT_LAYER: usize = 50;
/// Default bound on a prompt's tokens.
pub const DEFAULT_MAX_TOKENS: usize = 4096;
/// The largest `max_tokens` an option may set.
pub const MAX_TOKENS_LIMIT: usize = 1 << 17;
/// Default bound on a prompt's UTF-8 bytes, checked before tokenizing.
pub const DEFAULT_MAX_PROMPT_BYTES: usize = 1 << 18;
/// The largest `max_prompt_bytes` an option may set.
pub const MAX_PROMPT_BYTES_LIMIT: usize = 1 << 26;
/// The config key that bounds the layer.
pub const LAYERS_KEY: &str = "text_config.num_hidden_layers";
/// Vision placeholders a text-only prompt may not spell (their rows would be image or video rows).
pub const VISION_PLACEHOLDERS: [&str; 2] = ["<|image_pad|>", "<|video_pad|>"];

/// What the component does with a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct H3TextOptions {
    /// The hidden state returned: 0 = the embeddings, `k` = decoder layer `k`'s output. The encoder must have more
    /// than `layer` layers.
    pub layer: usize,
    /// Most tokens a prompt may encode to (1..=[`MAX_TOKENS_LIMIT`]).
    pub max_tokens: usize,
    /// Most UTF-8 bytes a prompt may have (1..=[`MAX_PROMPT_BYTES_LIMIT`]).
    pub max_prompt_bytes: usize,
    /// Whether spelled added tokens form their ids.
    pub markup: PromptMarkup,
}

impl Default for H3TextOptions {
    fn default() -> Self {
        H3TextOptions {
            layer: DEFAULT_LAYER,
            max_tokens: DEFAULT_MAX_TOKENS,
            max_prompt_bytes: DEFAULT_MAX_PROMPT_BYTES,
            markup: PromptMarkup::Allowed,
        }
    }
}

impl H3TextOptions {
    /// Checks the bounds; the error names the option.
    pub fn validate(&self) -> Result<(), H3TextError> {
        if !(1..=MAX_TOKENS_LIMIT).contains(&self.max_tokens) {
            return Err(H3TextError::Options(format!(
                "max_tokens = {} must be in 1..={MAX_TOKENS_LIMIT}",
                self.max_tokens
            )));
        }
        if !(1..=MAX_PROMPT_BYTES_LIMIT).contains(&self.max_prompt_bytes) {
            return Err(H3TextError::Options(format!(
                "max_prompt_bytes = {} must be in 1..={MAX_PROMPT_BYTES_LIMIT}",
                self.max_prompt_bytes
            )));
        }
        Ok(())
    }
}

/// Why the component could not load or encode.
#[derive(Debug, Error)]
pub enum H3TextError {
    /// The folder lacks a component, or a file in it cannot be used.
    #[error("{0}")]
    Folder(String),
    #[error("invalid H3 text options: {0}")]
    Options(String),
    /// The tokenizer could not be read, is not H3's, or failed on the prompt.
    #[error("{path}: {source}")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: TokenizerError,
    },
    /// The encoder has too few layers for the layer asked for.
    #[error(
        "{file}: `{LAYERS_KEY}` is {layers}, but MiniMax H3 reads hidden_states[{layer}], which needs more than \
         {layer} decoder layers (the last hidden state, hidden_states[{layers}], is the final norm's output, not a \
         layer's); use the released text encoder or a layer below {layers}"
    )]
    Layer {
        file: PathBuf,
        layers: usize,
        layer: usize,
    },
    /// The tokenizer can produce ids the encoder has no embedding row for.
    #[error(
        "{file}: `text_config.vocab_size` is {encoder}, but the tokenizer produces ids up to {largest}; the \
         tokenizer and the text encoder come from different models"
    )]
    Vocabulary {
        file: PathBuf,
        encoder: usize,
        largest: u32,
    },
    #[error(
        "the prompt is {bytes} bytes, above the limit of {max} (H3TextOptions::max_prompt_bytes); shorten it or \
         raise the limit"
    )]
    PromptTooLarge { bytes: usize, max: usize },
    #[error(
        "the prompt encodes to {tokens} tokens, above the limit of {max} (H3TextOptions::max_tokens); shorten it or \
         raise the limit"
    )]
    PromptTooLong { tokens: usize, max: usize },
    #[error(
        "the prompt spells {token} (id {id}), a vision placeholder; the text conditioning has no image or video \
         for it: remove it, or encode with PromptMarkup::Forbidden to take it as plain text"
    )]
    VisionToken { token: String, id: u32 },
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("H3 text encoder: {0}")]
    Encoder(#[from] TextEncoderError),
}

impl H3TextError {
    /// True when the prompt itself is at fault (too long, a vision placeholder, text the tokenizer refuses): the
    /// component is fine and the next prompt may succeed.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            H3TextError::PromptTooLarge { .. }
                | H3TextError::PromptTooLong { .. }
                | H3TextError::VisionToken { .. }
                | H3TextError::Tokenizer {
                    source: TokenizerError::Encode { .. },
                    ..
                }
        )
    }
}

/// A text encoder the component can run: `hidden_states[layer]` of token ids.
pub trait H3TextBackend {
    /// The model config.
    fn config(&self) -> &TextEncoderConfig;

    /// `hidden_states[layer]` `[ids.len(), hidden]` from position 0: 0 = the embeddings, `k` = decoder layer `k`'s
    /// output, never the final norm; no layer past `layer` runs.
    fn features_at(&mut self, ids: &[u32], layer: usize) -> Result<TensorF32, TextEncoderError>;

    /// A short name for reports ("host", "gpu").
    fn name(&self) -> &'static str;

    /// Bytes of the weights held (f32 on the host, bf16 on the GPU).
    fn weight_bytes(&self) -> usize;
}

impl H3TextBackend for HostTextEncoder {
    fn config(&self) -> &TextEncoderConfig {
        HostTextEncoder::config(self)
    }

    fn features_at(&mut self, ids: &[u32], layer: usize) -> Result<TensorF32, TextEncoderError> {
        HostTextEncoder::features_at(self, ids, layer)
    }

    fn name(&self) -> &'static str {
        "host"
    }

    fn weight_bytes(&self) -> usize {
        HostTextEncoder::weight_bytes(self)
    }
}

impl H3TextBackend for GpuTextEncoder {
    fn config(&self) -> &TextEncoderConfig {
        GpuTextEncoder::config(self)
    }

    fn features_at(&mut self, ids: &[u32], layer: usize) -> Result<TensorF32, TextEncoderError> {
        GpuTextEncoder::features_at(self, ids, layer)
    }

    fn name(&self) -> &'static str {
        "gpu"
    }

    fn weight_bytes(&self) -> usize {
        GpuTextEncoder::weight_bytes(self)
    }
}

/// Where a diffusers MiniMax H3 folder keeps the text components.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct H3TextFolder {
    /// `text_encoder/` (a transformers Qwen3-VL folder).
    pub text_encoder: PathBuf,
    /// The tokenizer.json: `tokenizer/`, else `processor/`, else `text_encoder/`.
    pub tokenizer_json: PathBuf,
}

impl H3TextFolder {
    /// Finds the components under `dir`, the folder of a saved MiniMax H3 pipeline; the error lists what was tried.
    pub fn locate(dir: &Path) -> Result<H3TextFolder, H3TextError> {
        let text_encoder = dir.join("text_encoder");
        if !text_encoder.join("config.json").is_file() {
            return Err(H3TextError::Folder(format!(
                "{}: no text_encoder/config.json; pass the folder of a diffusers MiniMax H3 pipeline (the one \
                 holding text_encoder/ and tokenizer/)",
                dir.display()
            )));
        }
        let tried: Vec<PathBuf> = ["tokenizer", "processor", "text_encoder"]
            .iter()
            .map(|sub| dir.join(sub).join("tokenizer.json"))
            .collect();
        let tokenizer_json = tried.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
            H3TextError::Folder(format!(
                "{}: no tokenizer.json (tried {}); the H3 folder's tokenizer/ component is missing",
                dir.display(),
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        Ok(H3TextFolder {
            text_encoder,
            tokenizer_json,
        })
    }
}

/// One encoded prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct H3TextFeatures {
    /// The token ids, one per row.
    pub ids: Vec<u32>,
    /// `hidden_states[layer]`, `[ids.len(), hidden]`.
    pub features: TensorF32,
}

/// The H3 tokenizer: H3's prompt rules, the bounds, and the vision placeholders it refuses.
pub struct H3Tokenizer {
    tokenizer: Tokenizer,
    path: PathBuf,
    vision: Vec<(u32, String)>,
    largest_id: u32,
}

impl std::fmt::Debug for H3Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3Tokenizer")
            .field("path", &self.path)
            .field("vision", &self.vision)
            .field("largest_id", &self.largest_id)
            .finish_non_exhaustive()
    }
}

impl H3Tokenizer {
    /// Reads a tokenizer.json and checks it carries H3's extra special tokens.
    pub fn load(path: &Path) -> Result<H3Tokenizer, H3TextError> {
        let err = |source| H3TextError::Tokenizer {
            path: path.to_path_buf(),
            source,
        };
        let tokenizer = Tokenizer::from_file(path).map_err(err)?;
        MiniMaxH3::check(&tokenizer).map_err(err)?;
        Ok(H3Tokenizer::new(tokenizer, path))
    }

    fn new(tokenizer: Tokenizer, path: &Path) -> H3Tokenizer {
        let vision = VISION_PLACEHOLDERS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t).map(|id| (id, t.to_string())))
            .collect();
        let largest_id = tokenizer
            .inner()
            .get_vocab(true)
            .into_values()
            .max()
            .unwrap_or(0);
        H3Tokenizer {
            tokenizer,
            path: path.to_path_buf(),
            vision,
            largest_id,
        }
    }

    /// The largest id the tokenizer can produce.
    pub fn largest_id(&self) -> u32 {
        self.largest_id
    }

    /// The underlying tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The prompt's ids under H3's rules, within the options' bounds.
    pub fn encode(&self, prompt: &str, options: &H3TextOptions) -> Result<Vec<u32>, H3TextError> {
        if prompt.len() > options.max_prompt_bytes {
            return Err(H3TextError::PromptTooLarge {
                bytes: prompt.len(),
                max: options.max_prompt_bytes,
            });
        }
        let ids = MiniMaxH3::encode(&self.tokenizer, prompt, options.markup).map_err(|source| {
            H3TextError::Tokenizer {
                path: self.path.clone(),
                source,
            }
        })?;
        if let Some((id, token)) = self.vision.iter().find(|(v, _)| ids.contains(v)) {
            return Err(H3TextError::VisionToken {
                token: token.clone(),
                id: *id,
            });
        }
        if ids.len() > options.max_tokens {
            return Err(H3TextError::PromptTooLong {
                tokens: ids.len(),
                max: options.max_tokens,
            });
        }
        Ok(ids)
    }
}

/// Checks that `config` has more than `layer` decoder layers; `file` is named in the error.
pub fn check_layer(
    config: &TextEncoderConfig,
    layer: usize,
    file: &Path,
) -> Result<(), H3TextError> {
    if config.num_hidden_layers <= layer {
        return Err(H3TextError::Layer {
            file: file.to_path_buf(),
            layers: config.num_hidden_layers,
            layer,
        });
    }
    Ok(())
}

/// MiniMax H3's text conditioning over one backend.
pub struct H3TextEncoder {
    tokenizer: H3Tokenizer,
    backend: Box<dyn H3TextBackend>,
    options: H3TextOptions,
}

impl std::fmt::Debug for H3TextEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3TextEncoder")
            .field("backend", &self.backend.name())
            .field("config", self.backend.config())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// What a load checks before any weight is read: the options, the folder, the tokenizer, and the encoder's config
/// against the layer and the tokenizer's ids.
fn open_checked(
    dir: &Path,
    options: &H3TextOptions,
) -> Result<(H3Tokenizer, ModelDir), H3TextError> {
    options.validate()?;
    let folder = H3TextFolder::locate(dir)?;
    let tokenizer = H3Tokenizer::load(&folder.tokenizer_json)?;
    let model = ModelDir::open(&folder.text_encoder)?;
    let config = TextEncoderConfig::from_json(model.config_json())?;
    let file = folder.text_encoder.join("config.json");
    check_layer(&config, options.layer, &file)?;
    check_vocabulary(&config, &tokenizer, &file)?;
    Ok((tokenizer, model))
}

fn check_vocabulary(
    config: &TextEncoderConfig,
    tokenizer: &H3Tokenizer,
    file: &Path,
) -> Result<(), H3TextError> {
    if usize::try_from(tokenizer.largest_id()).map_or(true, |id| id >= config.vocab_size) {
        return Err(H3TextError::Vocabulary {
            file: file.to_path_buf(),
            encoder: config.vocab_size,
            largest: tokenizer.largest_id(),
        });
    }
    Ok(())
}

/// The encoder load options for reading `hidden_states[layer]`: decoder layers `0..layer` only.
pub fn load_options(layer: usize) -> LoadOptions {
    LoadOptions::up_to_layer(layer)
}

/// The host encoder of `model` holding only what `hidden_states[layer]` needs (see [`load_options`]).
pub fn load_host_backend(
    model: &ModelDir,
    layer: usize,
) -> Result<HostTextEncoder, TextEncoderError> {
    HostTextEncoder::load_with(model, load_options(layer))
}

/// The GPU encoder of `model` on `device` holding only what `hidden_states[layer]` needs (see
/// [`load_options`]).
pub fn load_gpu_backend(
    device: &GpuDevice,
    model: &ModelDir,
    layer: usize,
) -> Result<GpuTextEncoder, TextEncoderError> {
    GpuTextEncoder::load_in(device, model, StagingConfig::default(), load_options(layer))
}

impl H3TextEncoder {
    /// Loads the text components of the H3 folder `dir` on the host (f32 reference), decoder layers
    /// `0..options.layer` only. The options, the tokenizer and the encoder's config are checked before any weight
    /// is read.
    pub fn load_host(dir: &Path, options: H3TextOptions) -> Result<H3TextEncoder, H3TextError> {
        let (tokenizer, model) = open_checked(dir, &options)?;
        let backend = load_host_backend(&model, options.layer)?;
        Ok(H3TextEncoder {
            tokenizer,
            backend: Box::new(backend),
            options,
        })
    }

    /// Loads the text components of the H3 folder `dir` onto the GPU of `ctx` (bf16 weights, decoder layers
    /// `0..options.layer` only). The options, the tokenizer and the encoder's config are checked before any
    /// weight is read.
    pub fn load_gpu(
        ctx: &tf_cuda::Context,
        dir: &Path,
        options: H3TextOptions,
    ) -> Result<H3TextEncoder, H3TextError> {
        let (tokenizer, model) = open_checked(dir, &options)?;
        let device = GpuDevice::on(ctx).map_err(|e| {
            TextEncoderError::Gpu(crate::nn::backend_error::gpu_error("creating a stream", e))
        })?;
        let backend = load_gpu_backend(&device, &model, options.layer)?;
        Ok(H3TextEncoder {
            tokenizer,
            backend: Box::new(backend),
            options,
        })
    }

    /// The component over a backend built elsewhere (a seeded random encoder, a shared one); the same checks as a
    /// load (`source` names where the backend's config came from in errors).
    pub fn with_backend(
        tokenizer: H3Tokenizer,
        backend: Box<dyn H3TextBackend>,
        options: H3TextOptions,
        source: &Path,
    ) -> Result<H3TextEncoder, H3TextError> {
        options.validate()?;
        check_layer(backend.config(), options.layer, source)?;
        check_vocabulary(backend.config(), &tokenizer, source)?;
        Ok(H3TextEncoder {
            tokenizer,
            backend,
            options,
        })
    }

    /// The options in force.
    pub fn options(&self) -> &H3TextOptions {
        &self.options
    }

    /// The encoder's config.
    pub fn config(&self) -> &TextEncoderConfig {
        self.backend.config()
    }

    /// The backend's name ("host", "gpu").
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Bytes of the encoder weights the backend holds (a load keeps decoder layers `0..options().layer` only).
    pub fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &H3Tokenizer {
        &self.tokenizer
    }

    /// The backend (for timing or diagnosis).
    pub fn backend_mut(&mut self) -> &mut dyn H3TextBackend {
        self.backend.as_mut()
    }

    /// The prompt's token ids under H3's rules, bounded.
    pub fn tokenize(&self, prompt: &str) -> Result<Vec<u32>, H3TextError> {
        self.tokenizer.encode(prompt, &self.options)
    }

    /// Tokenizes `prompt` and returns its ids and `hidden_states[layer]`.
    pub fn encode(&mut self, prompt: &str) -> Result<H3TextFeatures, H3TextError> {
        let ids = self.tokenize(prompt)?;
        let features = self.backend.features_at(&ids, self.options.layer)?;
        Ok(H3TextFeatures { ids, features })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layers: usize) -> TextEncoderConfig {
        TextEncoderConfig {
            num_hidden_layers: layers,
            ..TextEncoderConfig::qwen3_vl_8b()
        }
    }

    #[test]
    fn the_layer_needs_more_layers_than_its_index() {
        let file = Path::new("text_encoder/config.json");
        assert!(check_layer(&config(64), 50, file).is_ok());
        assert!(check_layer(&config(51), 50, file).is_ok());
        let err = check_layer(&config(50), 50, file).unwrap_err().to_string();
        assert!(
            err.contains(LAYERS_KEY)
                && err.contains("is 50")
                && err.contains("text_encoder/config.json"),
            "{err}"
        );
        assert!(check_layer(&config(6), 50, file).is_err());
        assert!(check_layer(&config(1), 0, file).is_ok());
    }

    #[test]
    fn options_are_bounded() {
        assert!(H3TextOptions::default().validate().is_ok());
        for bad in [
            H3TextOptions {
                max_tokens: 0,
                ..Default::default()
            },
            H3TextOptions {
                max_tokens: MAX_TOKENS_LIMIT + 1,
                ..Default::default()
            },
            H3TextOptions {
                max_prompt_bytes: 0,
                ..Default::default()
            },
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains("max_"), "{err}");
        }
    }

    #[test]
    fn request_errors_are_told_from_load_errors() {
        assert!(H3TextError::PromptTooLong { tokens: 5, max: 4 }.is_invalid_request());
        assert!(!H3TextError::Options("x".into()).is_invalid_request());
        assert!(!H3TextError::Layer {
            file: PathBuf::from("c"),
            layers: 6,
            layer: 50
        }
        .is_invalid_request());
    }
}
