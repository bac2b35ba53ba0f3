//! The Qwen-Image 2.1 text-to-image pipeline: prompt to RGBA pixels, as the diffusers `QwenImage21Pipeline` runs
//! it.
//!
//! [`Pipeline::load`] opens a diffusers model folder (`model_index.json`, `transformer/`, `text_encoder/`, `vae/`,
//! `scheduler/`, and the tokenizer under `processor/` or `tokenizer/`) on the host reference or the GPU, and
//! reports resident bytes and load time. The memory plan ([`Pipeline::memory_plan`]) keeps the components
//! resident when they fit the budget ([`LoadOptions::device_budget`] caps it), else every request loads, runs
//! and frees them in turn, timing the loads in [`Timings::loads`]. [`Pipeline::generate`] checks the request before any work, then runs:
//! template + tokenize, prompt features (and the negative prompt's with true CFG), the sigma schedule (dynamic shift
//! from the folder's scheduler config, or the checkpoint's `sample_sigmas`), the initial noise (the portable
//! generator of [`crate::nn::sampling::noise`], or injected latents), the denoising steps (prefix KV cache extracted on step 0
//! and reused after when the DiT has `causal_condition`, timestep rounded to the latent dtype, Euler, optional true
//! CFG), and the VAE decode to 8-bit RGBA. Each phase is timed.
//!
//! The folder's [`Variant`] is found at load as diffusers finds it (non-empty `sample_sigmas`: Turbo) unless
//! [`LoadOptions::variant`] names one. Turbo samples its `sample_sigmas` (8 steps without them), runs no guidance,
//! and reports a negative prompt or guidance scale sent to it as [`Ignored`] rather than using it, as the
//! reference does ([`super::variant`]).
//!
//! Invariants: a request is validated completely before the first model call, and request-shaped errors are
//! [`PipelineError::InvalidRequest`] ([`PipelineError::is_invalid_request`]); nothing here panics on input.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline, Request};
//!
//! let mut pipeline = Pipeline::load(Path::new("model"), &LoadOptions::new(Backend::Host))?;
//! let request = Request { width: 64, height: 64, steps: Some(3), ..Request::new("a red fox") };
//! let result = pipeline.generate(&request, &mut |p| eprintln!("{p:?}"))?;
//! println!("{} x {}, {} bytes", result.image.width, result.image.height, result.image.pixels.len());
//! # Ok::<(), tf_engines::qwen_image::pipeline::PipelineError>(())
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use tf_tokenizer::templates::QwenImage21;
use tf_tokenizer::{Tokenizer, TokenizerError};
use thiserror::Error;

use super::components::{TextEncoderBackend, VaeBackend};
use super::config::{QwenImageDitConfig, TOKENS_PER_SLOT};
use super::dit::{DitBackend, DitError, DitInputs, KvMode, KvStep};
use super::dit_gpu::{DitPrecision, GpuDit};
use super::dit_host::HostDit;
use super::vae::{HostVaeDecoder, VaeConfig, VaeError};
use super::variant::{Ignored, Variant};
use crate::nn::backend_error::GpuError;
use crate::nn::config::parse_object;
use crate::nn::fp8_checkpoint::Fp8Checkpoint;
use crate::nn::gpu::GpuDevice;
use crate::nn::memory_plan::{Component, MemoryPlan, MemoryPlanError, Residency};
use crate::nn::sampling::flow_match::{
    cfg_combine, latent_grid, LatentDtype, SamplerError, Schedule, SchedulerConfig, SigmaSource,
};
use crate::nn::sampling::noise::{draw_beside, packed_latents, NoiseError};
use crate::nn::sampling::scheduler::Scheduler;
use crate::nn::tensor::{ShapeError, Tensor, TensorF32};
use crate::nn::upload::StagingConfig;
use crate::nn::weights::{ModelDir, WeightsError};
use crate::qwen3_vl::text_encoder::{HostTextEncoder, TextEncoderConfig, TextEncoderError};
use crate::qwen3_vl::text_encoder_gpu::check_supported;

mod loading;
use loading::{gpu_text_encoder_and_vae, Sequential};

/// The reference's default step count.
pub const DEFAULT_STEPS: usize = 40;
/// The reference's default side length (`output_resolution`).
pub const DEFAULT_SIDE: usize = 1024;
/// Pixel sides are floored to a multiple of this (VAE factor 16 times the 2x2 latent groups).
pub const SIDE_MULTIPLE: usize = 32;

/// Errors of loading or running the pipeline.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// The request cannot be served as asked (bad size, steps, prompt, ...). Nothing was run.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("model folder {}: {why}", path.display())]
    Folder { path: PathBuf, why: String },
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("text encoder: {0}")]
    TextEncoder(#[from] TextEncoderError),
    #[error("DiT: {0}")]
    Dit(#[from] DitError),
    #[error("VAE: {0}")]
    Vae(#[from] VaeError),
    #[error("sampler: {0}")]
    Sampler(#[from] SamplerError),
    #[error("noise: {0}")]
    Noise(#[from] NoiseError),
    #[error("weights: {0}")]
    Weights(#[from] WeightsError),
    #[error("shape: {0}")]
    Shape(#[from] ShapeError),
    /// A GPU call of the pipeline itself (driver, context) failed; the cause stays in the source chain.
    #[error("GPU: {0}")]
    Gpu(#[from] GpuError),
    #[error("internal: {0}")]
    Internal(String),
    /// The components do not fit on the device as this pipeline holds them.
    #[error("device memory: {0}")]
    Memory(String),
    #[error("device memory: {0}")]
    MemoryPlan(#[from] MemoryPlanError),
    /// The components do not fit the budget that [`LoadOptions::device_budget`] capped.
    #[error(
        "device memory: {source}; the budget is capped at {cap} B by the load options' device budget: raise the \
         cap or leave it unset"
    )]
    CappedBudget { source: MemoryPlanError, cap: u64 },
}

impl PipelineError {
    /// Whether the request itself was at fault (a worker answers these as `invalid_request_error`).
    pub fn is_invalid_request(&self) -> bool {
        matches!(self, PipelineError::InvalidRequest(_))
    }
}

fn invalid(why: impl Into<String>) -> PipelineError {
    PipelineError::InvalidRequest(why.into())
}

fn folder_err(path: &Path, why: impl Into<String>) -> PipelineError {
    PipelineError::Folder {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

pub use crate::nn::backend::Backend;

/// What a request may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest side in pixels (after flooring to 32).
    pub max_side: usize,
    /// Largest pixel count.
    pub max_pixels: usize,
    /// Most sampling steps.
    pub max_steps: usize,
    /// Most template tokens of one prompt (system block included).
    pub max_prompt_tokens: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_side: 2048,
            max_pixels: 2048 * 2048,
            max_steps: 200,
            max_prompt_tokens: 1024,
        }
    }
}

/// How to load a pipeline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    pub backend: Backend,
    /// The dtype latents are kept in between steps; `None` = f32 on the host (the fp32 reference), bf16 on the GPU
    /// (the reference run in bf16).
    pub latent_dtype: Option<LatentDtype>,
    pub limits: Limits,
    /// Caps the device budget the memory plan decides against, in bytes: the GPU plans against
    /// `min(free - DEVICE_RESERVE_BYTES, cap)`, the host (whose memory stands in for the device, otherwise
    /// unlimited) against the cap. `None`: no cap. A cap below the sum of the components selects the sequential
    /// mode (each request loads, runs and frees them in turn); one below the largest component is refused.
    pub device_budget: Option<u64>,
    /// The checkpoint variant to run the folder as; `None`: the one its `model_index.json` says
    /// ([`Variant::detect`]).
    pub variant: Option<Variant>,
    /// GEMM precision of the GPU DiT (bf16 unless set; FP8 runs on the GPU only).
    pub dit_precision: DitPrecision,
}

impl LoadOptions {
    /// Defaults for `backend`.
    pub fn new(backend: Backend) -> Self {
        LoadOptions {
            backend,
            latent_dtype: None,
            limits: Limits::default(),
            device_budget: None,
            variant: None,
            dit_precision: DitPrecision::Bf16,
        }
    }
}

/// One text-to-image request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt; empty becomes a single space, as in the reference.
    pub prompt: String,
    /// With `true_cfg_scale > 1`, the negative prompt of true classifier-free guidance (empty becomes a space).
    /// Turbo ignores it ([`Ignored`]).
    pub negative_prompt: Option<String>,
    /// True CFG scale; guidance runs only when it is above 1 and a negative prompt is given (reference default 1).
    /// Turbo ignores it ([`Ignored`]).
    pub true_cfg_scale: f32,
    /// Pixels; floored to a multiple of 32 like the reference.
    pub width: usize,
    pub height: usize,
    /// Sampling steps; `None` = the checkpoint's `sample_sigmas` if it has them, else the variant's default (40,
    /// Turbo 8). With `sample_sigmas`, only their count is accepted.
    pub steps: Option<usize>,
    /// Seed of the portable noise generator.
    pub seed: u64,
    /// Injected initial latents `[1, h * w, channels]` (packed), replacing the seeded noise.
    pub initial_latents: Option<TensorF32>,
}

impl Request {
    /// A request with the reference defaults (1024 x 1024, default steps, seed 0, no guidance).
    pub fn new(prompt: impl Into<String>) -> Request {
        Request {
            prompt: prompt.into(),
            negative_prompt: None,
            true_cfg_scale: 1.0,
            width: DEFAULT_SIDE,
            height: DEFAULT_SIDE,
            steps: None,
            seed: 0,
            initial_latents: None,
        }
    }
}

/// A request after validation: everything the run needs, derived before any model call.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Floored pixel size.
    pub width: usize,
    pub height: usize,
    /// Latent grid (rows, cols).
    pub latent_rows: usize,
    pub latent_cols: usize,
    pub schedule: Schedule,
    /// Template ids and dropped rows of the prompt.
    pub prompt_ids: Vec<u32>,
    pub prompt_drop: usize,
    /// The negative prompt's, when true CFG runs.
    pub negative: Option<(Vec<u32>, usize)>,
    /// The scale guidance runs at (1 when it does not).
    pub true_cfg_scale: f32,
    /// The variant the request runs as.
    pub variant: Variant,
    /// Request fields that variant does not use (the run goes on without them).
    pub ignored: Vec<Ignored>,
}

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Progress {
    /// The prompt features are ready.
    Encoded { seconds: f64 },
    /// Step `step` (from 1) of `steps` finished.
    Step {
        step: usize,
        steps: usize,
        seconds: f64,
    },
    /// The image is decoded.
    Decoded { seconds: f64 },
}

/// Wall time of each phase, in seconds.
///
/// `encode`, `steps` and `decode` time the work alone in either residency; in the sequential mode `loads` has
/// the time spent loading and freeing each component, and `total` (the whole request) includes it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    pub encode: f64,
    pub steps: Vec<f64>,
    pub decode: f64,
    pub total: f64,
    /// Loading and freeing the components inside the request (all zero when they stay resident).
    pub loads: ComponentLoads,
}

/// Seconds a request spent loading and then freeing each component ([`Residency::Sequential`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ComponentLoads {
    pub text_encoder: f64,
    pub dit: f64,
    pub vae: f64,
}

impl ComponentLoads {
    /// The three together.
    pub fn total(&self) -> f64 {
        self.text_encoder + self.dit + self.vae
    }
}

/// `2.345 s (text encoder 0.100, ...)`: the loads' total, then each component's, in seconds.
impl std::fmt::Display for ComponentLoads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} s (text encoder {:.3}, DiT {:.3}, VAE {:.3})",
            self.total(),
            self.text_encoder,
            self.dit,
            self.vae
        )
    }
}

/// The prompt of [`Pipeline::warm_up`]'s request.
pub const WARM_UP_PROMPT: &str = "A quiet harbour at dawn, small boats on still water, soft light";

/// What [`Pipeline::warm_up`] did.
#[derive(Debug, Clone)]
pub struct WarmUp {
    pub width: usize,
    pub height: usize,
    /// Wall time of the whole warm-up.
    pub seconds: f64,
    /// Its phases.
    pub timings: Timings,
    /// How its DiT GEMMs were planned (GPU DiT only).
    pub gemms: Option<GemmPlanSummary>,
    /// Why nothing ran, when the warm-up was skipped (the sequential mode: nothing stays loaded to warm).
    pub skipped: Option<&'static str>,
}

/// How the DiT's GEMMs of a request were planned ahead (counts of distinct shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmPlanSummary {
    pub shapes: usize,
    /// Found in the persistent plan cache: no timing.
    pub stored: usize,
    /// Timed now.
    pub timed: usize,
    /// cuBLASLt's first result (heuristic selection, budget spent, or nothing to time).
    pub heuristic: usize,
    /// Planned before.
    pub already_planned: usize,
    /// Plans run once ahead so that their kernels load outside the steps.
    pub primed: usize,
}

impl GemmPlanSummary {
    fn of(report: &tf_cuda::cublaslt::PrepareReport) -> GemmPlanSummary {
        GemmPlanSummary {
            shapes: report.shapes,
            stored: report.stored,
            timed: report.timed,
            heuristic: report.heuristic,
            already_planned: report.already_planned,
            primed: report.primed,
        }
    }
}

/// An 8-bit image, interleaved `[height, width, channels]` (channels 4 = RGBA, 3 = RGB).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
    pub pixels: Vec<u8>,
}

/// What a generate produced.
#[derive(Debug, Clone)]
pub struct Generation {
    pub image: Image,
    /// The VAE output `[1, channels, height, width]` in [-1, 1] (kept with the step latents: the GPU decoder
    /// otherwise brings back only the 8-bit pixels).
    pub decoded: Option<TensorF32>,
    /// The packed latents after each step, `[1, h * w, channels]` (kept when [`Pipeline::keep_step_latents`]).
    pub step_latents: Vec<TensorF32>,
    /// The velocity of each step (the model output on the target tokens, after CFG, before the Euler step),
    /// `[1, h * w, channels]` (kept with the step latents).
    pub step_velocities: Vec<TensorF32>,
    /// The prompt features the DiT read, `[rows, hidden]`.
    pub prompt_embeds: TensorF32,
    pub seed: u64,
    pub plan_steps: usize,
    pub timings: Timings,
    /// Request fields the loaded variant did not use ([`Plan::ignored`]).
    pub ignored: Vec<Ignored>,
}

/// Load figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadReport {
    pub backend: Backend,
    /// Bytes the loaded components hold (device memory taken on the GPU, f32 weights on the host); 0 in the
    /// sequential mode, where nothing stays loaded between requests ([`MemoryPlan::peak`] is what one holds).
    pub resident_bytes: u64,
    pub seconds: f64,
    /// Whether the text encoder runs on the device (false: the host reference).
    pub te_on_device: bool,
    /// Whether the VAE decoder runs on the device (false: the host reference).
    pub vae_on_device: bool,
    /// Both of the above.
    pub te_vae_on_device: bool,
    /// How the components are held ([`Pipeline::memory_plan`] has the figures).
    pub residency: Residency,
    /// The checkpoint variant the folder runs as.
    pub variant: Variant,
    /// GEMM precision of the GPU DiT, `fp8` resolved to the mode the DiT loads in; the host DiT computes in f32.
    pub dit_precision: DitPrecision,
    /// Weights the DiT checkpoint stores in FP8 e4m3 with their scales (0 for a bf16/f32 checkpoint): used as
    /// stored where the DiT runs FP8, dequantized elsewhere.
    pub dit_checkpoint_fp8: usize,
}

enum DitEngine {
    Host(Box<HostDit>),
    Gpu(Box<GpuDit>),
}

impl DitEngine {
    fn config(&self) -> &QwenImageDitConfig {
        match self {
            DitEngine::Host(d) => d.config(),
            DitEngine::Gpu(d) => d.config(),
        }
    }
}

/// The components as the memory plan holds them.
enum Components {
    /// Loaded once by [`Pipeline::load`] and kept.
    Resident(Resident),
    /// Loaded, run and freed in turn by every request.
    Sequential(Box<Sequential>),
}

struct Resident {
    text_encoder: Box<dyn TextEncoderBackend>,
    dit: DitEngine,
    vae: Box<dyn VaeBackend>,
}

impl Components {
    fn te_config(&self) -> &TextEncoderConfig {
        match self {
            Components::Resident(r) => r.text_encoder.config(),
            Components::Sequential(s) => &s.te_config,
        }
    }

    fn dit_config(&self) -> &QwenImageDitConfig {
        match self {
            Components::Resident(r) => r.dit.config(),
            Components::Sequential(s) => &s.dit_config,
        }
    }
}

/// The loaded pipeline. Components drop before the device context (field order).
pub struct Pipeline {
    tokenizer: Tokenizer,
    components: Components,
    scheduler: SchedulerConfig,
    sample_sigmas: Option<Vec<f64>>,
    variant: Variant,
    latent_dtype: LatentDtype,
    limits: Limits,
    keep_step_latents: bool,
    report: LoadReport,
    dir: PathBuf,
    memory_plan: MemoryPlan,
    /// How the last request's DiT GEMMs were planned.
    gemm_plan_summary: Option<GemmPlanSummary>,
    /// The context and the one blocking stream every GPU component borrows (`None` on the host).
    device: Option<GpuDevice>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("dir", &self.dir)
            .field("report", &self.report)
            .field("latent_dtype", &self.latent_dtype)
            .finish_non_exhaustive()
    }
}

/// Most entries of `model_index.json`'s `sample_sigmas`.
pub const MAX_SAMPLE_SIGMAS: usize = 1000;

/// `model_index.json` keys this pipeline reads; the component entries are checked as folders.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawModelIndex {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    sample_sigmas: Option<Vec<f64>>,
}

/// The folder's layout, checked before anything heavy is read.
#[derive(Debug, Clone, PartialEq)]
pub struct FolderLayout {
    pub transformer: PathBuf,
    pub text_encoder: PathBuf,
    pub vae: PathBuf,
    pub tokenizer_json: PathBuf,
    /// `sample_sigmas` of `model_index.json`, when the checkpoint fixes its grid.
    pub sample_sigmas: Option<Vec<f64>>,
    /// The variant diffusers loads the folder as ([`Variant::detect`] of `sample_sigmas`).
    pub variant: Variant,
}

impl FolderLayout {
    /// Reads `model_index.json` and finds the component folders and the tokenizer.
    pub fn read(dir: &Path) -> Result<FolderLayout, PipelineError> {
        let index_path = dir.join("model_index.json");
        let text = std::fs::read_to_string(&index_path).map_err(|e| {
            folder_err(
                dir,
                format!(
                    "cannot read model_index.json ({e}); pass the folder of a diffusers QwenImage21Pipeline \
                     (the one holding model_index.json, transformer/, text_encoder/, vae/)"
                ),
            )
        })?;
        let index: Value = serde_json::from_str(&text)
            .map_err(|e| folder_err(&index_path, format!("not valid JSON: {e}")))?;
        let raw: RawModelIndex = parse_object(&index).map_err(|e| folder_err(&index_path, e))?;
        if let Some(class) = &raw.class_name {
            if !class.starts_with("QwenImage21") {
                return Err(folder_err(
                    &index_path,
                    format!(
                        "`_class_name` is {class:?}; this engine runs QwenImage21Pipeline folders"
                    ),
                ));
            }
        }
        let sample_sigmas = raw.sample_sigmas;
        if let Some(sigmas) = &sample_sigmas {
            if sigmas.is_empty() || sigmas.len() > MAX_SAMPLE_SIGMAS {
                return Err(folder_err(
                    &index_path,
                    format!(
                        "`sample_sigmas` has {} entries; give 1 to {MAX_SAMPLE_SIGMAS}, or null",
                        sigmas.len()
                    ),
                ));
            }
            if let Some(bad) = sigmas
                .iter()
                .find(|s| !(s.is_finite() && **s > 0.0 && **s <= 1.0))
            {
                return Err(folder_err(
                    &index_path,
                    format!("`sample_sigmas` must lie in (0, 1], found {bad}"),
                ));
            }
        }
        let sub = |name: &str| -> Result<PathBuf, PipelineError> {
            let path = dir.join(name);
            if path.join("config.json").is_file() {
                Ok(path)
            } else {
                Err(folder_err(
                    dir,
                    format!(
                        "{name}/config.json is missing; the folder is incomplete (re-download it)"
                    ),
                ))
            }
        };
        let tokenizer_json = ["processor", "tokenizer"]
            .iter()
            .map(|d| dir.join(d).join("tokenizer.json"))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                folder_err(
                    dir,
                    "no processor/tokenizer.json or tokenizer/tokenizer.json; the folder is incomplete",
                )
            })?;
        Ok(FolderLayout {
            transformer: sub("transformer")?,
            text_encoder: sub("text_encoder")?,
            vae: sub("vae")?,
            tokenizer_json,
            variant: Variant::detect(sample_sigmas.as_deref()),
            sample_sigmas,
        })
    }
}

/// Device memory left free for workspaces, cuBLASLt and the driver when planning residency.
pub const DEVICE_RESERVE_BYTES: u64 = 1 << 30;

/// The bytes a component's weights take on `backend`: f32 on the host, bf16 on the device.
fn weight_bytes(model: &ModelDir, backend: Backend) -> u64 {
    match backend {
        Backend::Host => f32_bytes(model),
        Backend::Gpu => f32_bytes(model) / 2,
    }
}

fn f32_bytes(model: &ModelDir) -> u64 {
    model
        .names()
        .filter_map(|n| model.info(n).ok())
        .map(|i| i.elements() as u64 * 4)
        .sum()
}

impl Pipeline {
    /// Loads the pipeline in `dir` on `options.backend`. The memory plan ([`Pipeline::memory_plan`]) decides
    /// from the components' sizes and the budget whether they are loaded now and kept, or loaded, run and
    /// freed in turn by every request (then only the folders are opened here and their headers checked).
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<Pipeline, PipelineError> {
        let started = Instant::now();
        if options.backend == Backend::Host && options.dit_precision != DitPrecision::Bf16 {
            return Err(invalid(format!(
                "DiT precision {} runs on the GPU only; the host reference computes in f32: load on the GPU \
                 backend, or in bf16 on the host",
                options.dit_precision
            )));
        }
        let layout = FolderLayout::read(dir)?;
        let scheduler = SchedulerConfig::from_model_folder(dir)?;
        let tokenizer = Tokenizer::from_file(&layout.tokenizer_json)?;
        let dit_dir = ModelDir::open(&layout.transformer)?;
        // A scaled-FP8 checkpoint is validated here, before any component loads, and counted for the report.
        let dit_checkpoint_fp8 = Fp8Checkpoint::scan(&dit_dir)
            .map_err(DitError::from)?
            .weights()
            .len();
        let te_dir = ModelDir::open(&layout.text_encoder)?;
        let vae_dir = ModelDir::open(&layout.vae)?;

        let components = vec![
            Component::new("text encoder", weight_bytes(&te_dir, options.backend)),
            Component::new("DiT", weight_bytes(&dit_dir, options.backend)),
            Component::new("VAE", weight_bytes(&vae_dir, options.backend)),
        ];
        let (components, device, resident_bytes, (te_on_device, vae_on_device), memory_plan) =
            match options.backend {
                Backend::Host => {
                    // Host memory stands in for the device: no limit to plan against unless the options cap it.
                    let plan = decide_residency(components, None, options.device_budget)?;
                    if plan.residency() == Residency::Sequential {
                        let parts = Sequential::open(te_dir, dit_dir, vae_dir)?;
                        let parts = Components::Sequential(Box::new(parts));
                        (parts, None, 0, (false, false), plan)
                    } else {
                        let resident =
                            f32_bytes(&dit_dir) + f32_bytes(&te_dir) + f32_bytes(&vae_dir);
                        let te: Box<dyn TextEncoderBackend> =
                            Box::new(HostTextEncoder::load(&te_dir)?);
                        let vae: Box<dyn VaeBackend> = Box::new(HostVaeDecoder::load(&vae_dir)?);
                        let dit = DitEngine::Host(Box::new(HostDit::load(&dit_dir)?));
                        let parts = Components::Resident(Resident {
                            text_encoder: te,
                            dit,
                            vae,
                        });
                        (parts, None, resident, (false, false), plan)
                    }
                }
                Backend::Gpu => {
                    let device = GpuDevice::open().map_err(|e| {
                        gpu(
                            "opening the CUDA driver, a context on device 0 and its stream",
                            e,
                        )
                    })?;
                    let ctx = device.context();
                    let free_before = ctx
                        .memory_info()
                        .map_err(|e| gpu("reading free memory", e))?
                        .free;
                    let plan = decide_residency(
                        components,
                        Some(free_before.saturating_sub(DEVICE_RESERVE_BYTES)),
                        options.device_budget,
                    )?;
                    if plan.residency() == Residency::Sequential {
                        let mut parts = Sequential::open(te_dir, dit_dir, vae_dir)?;
                        parts.dit_precision = options.dit_precision;
                        let te_on_device = check_supported(&parts.te_config).is_ok();
                        let parts = Components::Sequential(Box::new(parts));
                        (parts, Some(device), 0, (te_on_device, true), plan)
                    } else {
                        let dit = DitEngine::Gpu(Box::new(GpuDit::load_in(
                            &device,
                            &dit_dir,
                            StagingConfig::default(),
                            options.dit_precision,
                        )?));
                        let parts = gpu_text_encoder_and_vae(&device, &te_dir, &vae_dir)?;
                        ctx.synchronize()
                            .map_err(|e| gpu("waiting for the uploads", e))?;
                        let free_after = ctx
                            .memory_info()
                            .map_err(|e| gpu("reading free memory", e))?
                            .free;
                        let mut resident = free_before.saturating_sub(free_after);
                        if !parts.te_on_device {
                            resident += f32_bytes(&te_dir);
                        }
                        if !parts.vae_on_device {
                            resident += f32_bytes(&vae_dir);
                        }
                        let on_device = (parts.te_on_device, parts.vae_on_device);
                        let held = Components::Resident(Resident {
                            text_encoder: parts.te,
                            dit,
                            vae: parts.vae,
                        });
                        (held, Some(device), resident, on_device, plan)
                    }
                }
            };
        match &components {
            Components::Resident(r) => {
                check_agreement(r.dit.config(), r.text_encoder.config(), r.vae.config(), dir)?
            }
            Components::Sequential(s) => {
                check_agreement(&s.dit_config, &s.te_config, &s.vae_config, dir)?
            }
        }
        let latent_dtype = options.latent_dtype.unwrap_or(match options.backend {
            Backend::Host => LatentDtype::F32,
            Backend::Gpu => LatentDtype::Bf16,
        });
        let variant = options.variant.unwrap_or(layout.variant);
        Ok(Pipeline {
            tokenizer,
            components,
            scheduler,
            sample_sigmas: layout.sample_sigmas,
            variant,
            latent_dtype,
            limits: options.limits,
            keep_step_latents: false,
            gemm_plan_summary: None,
            report: LoadReport {
                residency: memory_plan.residency(),
                backend: options.backend,
                resident_bytes,
                seconds: started.elapsed().as_secs_f64(),
                te_on_device,
                vae_on_device,
                te_vae_on_device: te_on_device && vae_on_device,
                variant,
                // `fp8` as the DiT resolves it at load (INT8 GEMMs, or the e4m3 mode for an e4m3 checkpoint).
                dit_precision: crate::qwen_image::dit_gpu::resolve_precision(
                    options.dit_precision,
                    dit_checkpoint_fp8 > 0,
                ),
                dit_checkpoint_fp8,
            },
            dir: dir.to_path_buf(),
            memory_plan,
            device,
        })
    }

    /// The memory plan chosen at load (components, budget, all resident or in turn).
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.memory_plan
    }

    /// Load figures.
    pub fn load_report(&self) -> LoadReport {
        self.report
    }

    /// The checkpoint variant the folder runs as.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The folder's `sample_sigmas` (its own sigma grid), if it has them.
    pub fn sample_sigmas(&self) -> Option<&[f64]> {
        self.sample_sigmas.as_deref()
    }

    /// The latent dtype of the run.
    pub fn latent_dtype(&self) -> LatentDtype {
        self.latent_dtype
    }

    /// Keep a copy of the latents after every step in [`Generation::step_latents`], and the VAE's f32 output in
    /// [`Generation::decoded`] (for parity checks).
    pub fn keep_step_latents(&mut self, keep: bool) {
        self.keep_step_latents = keep;
    }

    /// The device context, when the pipeline runs on the GPU.
    pub fn context(&self) -> Option<&tf_cuda::Context> {
        self.device.as_ref().map(GpuDevice::context)
    }

    /// The context and the stream every GPU component runs on, when the pipeline runs on the GPU.
    pub fn device(&self) -> Option<&GpuDevice> {
        self.device.as_ref()
    }

    /// Latent channels (the DiT's `in_channels`).
    pub fn latent_channels(&self) -> usize {
        self.components.dit_config().in_channels
    }

    /// Checks `request` and derives everything the run needs; no model runs.
    pub fn plan(&self, request: &Request) -> Result<Plan, PipelineError> {
        let limits = &self.limits;
        let (width, height) = checked_size(limits, request)?;
        let variant = self.variant;
        let source = sigma_source(
            variant,
            self.sample_sigmas.as_deref(),
            request.steps,
            limits,
        )?;
        let (latent_rows, latent_cols) = latent_grid(height, width);
        let schedule = Schedule::new(&self.scheduler, source, latent_rows * latent_cols)
            .map_err(|e| invalid(format!("no schedule for this request: {e}")))?;

        let encode = |text: &str, what: &str| -> Result<(Vec<u32>, usize), PipelineError> {
            let encoded = QwenImage21::encode(&self.tokenizer, text)?;
            if encoded.ids.len() > limits.max_prompt_tokens {
                return Err(invalid(format!(
                    "the {what} is {} tokens with the template, over the limit of {}; shorten it",
                    encoded.ids.len(),
                    limits.max_prompt_tokens
                )));
            }
            let vocab = self.components.te_config().vocab_size;
            if let Some(bad) = encoded.ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(folder_err(
                    &self.dir,
                    format!(
                        "the tokenizer gave id {bad}, past the text encoder's vocabulary of {vocab}; tokenizer and \
                         text encoder do not belong together"
                    ),
                ));
            }
            Ok((encoded.ids, encoded.drop))
        };
        let (prompt_ids, prompt_drop) = encode(&request.prompt, "prompt")?;
        let ignored = variant.ignored(request.negative_prompt.as_deref(), request.true_cfg_scale);
        let guided = variant.guidance() && request.true_cfg_scale > 1.0;
        let negative = match &request.negative_prompt {
            Some(neg) if guided => Some(encode(neg, "negative prompt")?),
            _ => None,
        };

        if let Some(latents) = &request.initial_latents {
            let expected = [1, latent_rows * latent_cols, self.latent_channels()];
            if latents.shape() != expected {
                return Err(invalid(format!(
                    "injected latents have shape {:?}; a {width}x{height} image needs {expected:?} (packed)",
                    latents.shape()
                )));
            }
            if latents.data().iter().any(|v| !v.is_finite()) {
                return Err(invalid("injected latents hold a non-finite value"));
            }
        }
        Ok(Plan {
            width,
            height,
            latent_rows,
            latent_cols,
            schedule,
            prompt_ids,
            prompt_drop,
            negative,
            true_cfg_scale: if guided { request.true_cfg_scale } else { 1.0 },
            variant,
            ignored,
        })
    }

    /// Runs `request`, reporting progress; the request is checked first ([`Self::plan`]).
    pub fn generate(
        &mut self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Generation, PipelineError> {
        self.generate_planned(request, progress, Duration::ZERO)
    }

    /// Runs a short request (2 steps, a short prompt) at `width` x `height` so that the first real request of
    /// that size finds everything ready: the DiT's GEMMs of that size planned with up to `gemm_budget` of
    /// timing (stored in the persistent plan cache, so a later process reuses the choices without timing),
    /// kernels loaded, workspaces allocated (kept as the DiT's spare buffers, which the first request's workspaces
    /// are built from), the text encoder's and the VAE's plans built. What a request of another size or prompt
    /// length needs beyond that is planned without timing.
    ///
    /// In the sequential mode nothing stays loaded to warm, so this does nothing and says so
    /// ([`WarmUp::skipped`]); every request then plans its own GEMMs without timing.
    pub fn warm_up(
        &mut self,
        width: usize,
        height: usize,
        gemm_budget: Duration,
    ) -> Result<WarmUp, PipelineError> {
        if let Components::Sequential(_) = self.components {
            return Ok(WarmUp {
                width,
                height,
                seconds: 0.0,
                timings: Timings::default(),
                gemms: None,
                skipped: Some(WARM_UP_SKIPPED_SEQUENTIAL),
            });
        }
        let started = Instant::now();
        let mut request = Request::new(WARM_UP_PROMPT);
        request.width = width;
        request.height = height;
        // Two steps (the extract step and a cached one) whatever grid the folder fixes: `steps` stays unset so a
        // checkpoint's own `sample_sigmas` pass the request check, and the schedule is then cut to two steps.
        let mut plan = self.plan(&request)?;
        plan.schedule = Schedule::new(
            &self.scheduler,
            SigmaSource::Steps(WARM_UP_STEPS),
            plan.latent_rows * plan.latent_cols,
        )
        .map_err(|e| invalid(format!("no warm-up schedule: {e}")))?;
        let generation = self.run_planned(plan, &request, &mut |_| {}, gemm_budget)?;
        // The warm-up's prompt length is not a request's: its workspaces become spare buffers that the first
        // request's workspaces are built from, instead of new allocations inside that request.
        if let Components::Resident(Resident {
            dit: DitEngine::Gpu(dit),
            ..
        }) = &mut self.components
        {
            dit.recycle_workspaces()?;
        }
        Ok(WarmUp {
            width,
            height,
            seconds: secs(started.elapsed()),
            timings: generation.timings,
            gemms: self.gemm_plan_summary,
            skipped: None,
        })
    }

    /// Plans every GEMM shape the persistent plan cache stores for this GPU in the resident GPU DiT and loads their
    /// kernels, so that a request whose shapes an earlier process planned (other prompt lengths, other sizes) plans
    /// and loads nothing inside it: a worker's load, after [`Pipeline::warm_up`] (a one-shot command needs only its
    /// request's shapes, which the warm-up planned). `None` on the host DiT or in the sequential mode.
    pub fn prepare_stored_gemms(
        &mut self,
    ) -> Result<Option<crate::nn::gpu::gemm::StoredGemms>, PipelineError> {
        match &mut self.components {
            Components::Resident(Resident {
                dit: DitEngine::Gpu(dit),
                ..
            }) => Ok(Some(dit.prepare_stored_gemms()?)),
            _ => Ok(None),
        }
    }

    /// How the last request's DiT GEMMs were planned (GPU DiT only).
    pub fn gemm_plan_summary(&self) -> Option<GemmPlanSummary> {
        self.gemm_plan_summary
    }

    /// [`Pipeline::generate`], planning the DiT's GEMMs for this request first: stored choices are reused and
    /// unseen shapes are timed within `gemm_budget` (zero for a request: never timed inside one). Resident
    /// components run in place; in the sequential mode each is loaded, run and freed before the next loads.
    fn generate_planned(
        &mut self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        gemm_budget: Duration,
    ) -> Result<Generation, PipelineError> {
        let plan = self.plan(request)?;
        self.run_planned(plan, request, progress, gemm_budget)
    }

    /// Runs `plan` (made from `request` by [`Self::plan`]).
    fn run_planned(
        &mut self,
        plan: Plan,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        gemm_budget: Duration,
    ) -> Result<Generation, PipelineError> {
        let started = Instant::now();
        let mut timings = Timings::default();
        let run = Run {
            plan: &plan,
            dtype: self.latent_dtype,
            keep: self.keep_step_latents,
            gemm_budget,
            started,
        };
        let channels = self.latent_channels();
        let gemm_summary = &mut self.gemm_plan_summary;

        let (prompt_embeds, denoised, decoded) = match &mut self.components {
            Components::Resident(held) => {
                // The seeded noise is drawn on the host while the text encoder runs on the device.
                let (encoded, latents) = draw_beside(
                    || initial_latents(request, &run, channels),
                    || encode_phase(&mut *held.text_encoder, &run, &mut timings, progress),
                )?;
                let (prompt_embeds, negative_embeds) = encoded?;
                let latents = latents?;
                let denoised = dit_phase(
                    &mut held.dit,
                    &run,
                    (&prompt_embeds, negative_embeds.as_ref()),
                    latents,
                    gemm_summary,
                    &mut timings,
                    progress,
                )?;
                let decoded =
                    decode_phase(&mut *held.vae, &run, &denoised.0, &mut timings, progress)?;
                (prompt_embeds, denoised, decoded)
            }
            Components::Sequential(parts) => {
                let device = self.device.as_ref();
                let (mut te, seconds) = timed(|| parts.text_encoder(device))?;
                timings.loads.text_encoder = seconds;
                let (prompt_embeds, negative_embeds) =
                    encode_phase(&mut *te, &run, &mut timings, progress)?;
                timings.loads.text_encoder += free_timed(te);

                let latents = initial_latents(request, &run, channels)?;
                let (mut dit, seconds) = timed(|| parts.dit(device))?;
                timings.loads.dit = seconds;
                let denoised = dit_phase(
                    &mut dit,
                    &run,
                    (&prompt_embeds, negative_embeds.as_ref()),
                    latents,
                    gemm_summary,
                    &mut timings,
                    progress,
                )?;
                timings.loads.dit += free_timed(dit);

                let (mut vae, seconds) = timed(|| parts.vae(device))?;
                timings.loads.vae = seconds;
                let decoded = decode_phase(&mut *vae, &run, &denoised.0, &mut timings, progress)?;
                timings.loads.vae += free_timed(vae);
                (prompt_embeds, denoised, decoded)
            }
        };
        let (_, step_latents, step_velocities) = denoised;
        let (decoded, pixels, image_channels) = decoded;
        timings.total = secs(started.elapsed());
        Ok(Generation {
            image: Image {
                width: plan.width,
                height: plan.height,
                channels: image_channels,
                pixels,
            },
            decoded,
            step_latents,
            step_velocities,
            prompt_embeds,
            seed: request.seed,
            plan_steps: plan.schedule.steps(),
            timings,
            ignored: plan.ignored.clone(),
        })
    }
}

/// Steps of [`Pipeline::warm_up`]'s request.
const WARM_UP_STEPS: usize = 2;

/// [`WarmUp::skipped`] in the sequential mode.
pub const WARM_UP_SKIPPED_SEQUENTIAL: &str =
    "the components are loaded, run and freed in turn by every request, so nothing stays loaded to warm up";

/// What every phase of one request reads.
struct Run<'a> {
    plan: &'a Plan,
    dtype: LatentDtype,
    keep: bool,
    gemm_budget: Duration,
    /// When the request started: `encode` runs from here to the first DiT call, as the reference measures it.
    started: Instant,
}

/// The prompt features (and the negative prompt's), in the latent dtype as the reference keeps them; timed as
/// `encode`.
fn encode_phase(
    text_encoder: &mut dyn TextEncoderBackend,
    run: &Run<'_>,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<(TensorF32, Option<TensorF32>), PipelineError> {
    let plan = run.plan;
    let t = Instant::now();
    let prompt_embeds = text_encoder.prompt_features(&plan.prompt_ids, plan.prompt_drop)?;
    let negative_embeds = match &plan.negative {
        Some((ids, drop)) => Some(text_encoder.prompt_features(ids, *drop)?),
        None => None,
    };
    let prompt_embeds = round_tensor(prompt_embeds, run.dtype);
    let negative_embeds = negative_embeds.map(|e| round_tensor(e, run.dtype));
    timings.encode = secs(t.elapsed());
    progress(Progress::Encoded {
        seconds: timings.encode,
    });
    Ok((prompt_embeds, negative_embeds))
}

/// The injected latents in the latent dtype, else the seeded noise.
fn initial_latents(
    request: &Request,
    run: &Run<'_>,
    channels: usize,
) -> Result<TensorF32, PipelineError> {
    Ok(match &request.initial_latents {
        Some(given) => round_tensor(given.clone(), run.dtype),
        None => packed_latents(
            request.seed,
            1,
            channels,
            run.plan.latent_rows,
            run.plan.latent_cols,
            run.dtype,
        )?,
    })
}

/// The final latents, and the kept latents and velocities of every step.
type Denoised = (TensorF32, Vec<TensorF32>, Vec<TensorF32>);

/// Plans the GPU DiT's GEMMs of this request (within `run.gemm_budget`), then runs the steps.
fn dit_phase(
    dit: &mut DitEngine,
    run: &Run<'_>,
    (prompt_embeds, negative_embeds): (&TensorF32, Option<&TensorF32>),
    latents: TensorF32,
    gemm_summary: &mut Option<GemmPlanSummary>,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<Denoised, PipelineError> {
    let plan = run.plan;
    if let DitEngine::Gpu(dit) = dit {
        let modes: &[KvMode] = if dit.config().causal_condition {
            &[KvMode::Extract, KvMode::Cached]
        } else {
            &[KvMode::None]
        };
        let (rows, cols) = (plan.latent_rows, plan.latent_cols);
        let mut branches = vec![t2i_inputs(&latents, prompt_embeds, 1.0, rows, cols)?];
        if let Some(negative) = negative_embeds {
            branches.push(t2i_inputs(&latents, negative, 1.0, rows, cols)?);
        }
        let steps: Vec<(&DitInputs, KvMode)> = branches
            .iter()
            .flat_map(|inputs| modes.iter().map(move |&mode| (inputs, mode)))
            .collect();
        let report = dit.prepare_gemms(&steps, run.gemm_budget)?;
        *gemm_summary = Some(GemmPlanSummary::of(&report));
    }
    // The encode phase ends at the first DiT call: prompt features, initial latents and this planning (component
    // loads of the sequential mode are counted apart).
    timings.encode =
        (secs(run.started.elapsed()) - timings.loads.text_encoder - timings.loads.dit).max(0.0);

    let conditions = Conditions {
        prompt: prompt_embeds,
        negative: negative_embeds,
        cfg_scale: plan.true_cfg_scale,
    };
    let (dtype, keep) = (run.dtype, run.keep);
    match dit {
        DitEngine::Host(dit) => denoise(
            &mut **dit,
            plan,
            &conditions,
            latents,
            dtype,
            keep,
            timings,
            progress,
        ),
        DitEngine::Gpu(dit) => denoise(
            &mut **dit,
            plan,
            &conditions,
            latents,
            dtype,
            keep,
            timings,
            progress,
        ),
    }
}

/// The decoded image `[1, channels, height, width]` (when the run keeps it), its 8-bit pixels and its channel
/// count; timed as `decode`.
fn decode_phase(
    vae: &mut dyn VaeBackend,
    run: &Run<'_>,
    latents: &TensorF32,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<(Option<TensorF32>, Vec<u8>, usize), PipelineError> {
    let plan = run.plan;
    let t = Instant::now();
    let decoded =
        vae.decode_packed_pixels(latents, plan.latent_rows, plan.latent_cols, run.keep)?;
    if (decoded.height, decoded.width) != (plan.height, plan.width) {
        return Err(PipelineError::Internal(format!(
            "the VAE decoded {}x{} for a {}x{} request",
            decoded.width, decoded.height, plan.width, plan.height
        )));
    }
    timings.decode = secs(t.elapsed());
    progress(Progress::Decoded {
        seconds: timings.decode,
    });
    Ok((decoded.images, decoded.pixels, decoded.channels))
}

/// Runs `load` and times it.
fn timed<T>(load: impl FnOnce() -> Result<T, PipelineError>) -> Result<(T, f64), PipelineError> {
    let t = Instant::now();
    let value = load()?;
    Ok((value, secs(t.elapsed())))
}

/// Frees a component (its `Drop` waits for the work still queued on its stream) and times it.
fn free_timed<T>(component: T) -> f64 {
    let t = Instant::now();
    drop(component);
    secs(t.elapsed())
}

/// A failed call of the pipeline's own on the device.
fn gpu(what: &str, e: tf_cuda::Error) -> PipelineError {
    PipelineError::Gpu(crate::nn::backend_error::gpu_error(what, e))
}

/// The budget the memory plan decides against: what the device offers (`None` on the host: unlimited), capped
/// by [`LoadOptions::device_budget`].
fn planning_budget(available: Option<u64>, cap: Option<u64>) -> u64 {
    available.unwrap_or(u64::MAX).min(cap.unwrap_or(u64::MAX))
}

/// [`MemoryPlan::decide`] against [`planning_budget`]; a refusal under a cap that set the budget says so.
fn decide_residency(
    components: Vec<Component>,
    available: Option<u64>,
    cap: Option<u64>,
) -> Result<MemoryPlan, PipelineError> {
    let budget = planning_budget(available, cap);
    MemoryPlan::decide(components, budget).map_err(|source| match cap {
        Some(cap) if cap == budget && available.is_none_or(|a| cap < a) => {
            PipelineError::CappedBudget { source, cap }
        }
        _ => PipelineError::MemoryPlan(source),
    })
}

/// A request checked against a model folder before any weight is read ([`Pipeline::preflight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preflight {
    /// Floored pixel size.
    pub width: usize,
    pub height: usize,
    /// Latent grid (rows, cols) and channels (the DiT's `in_channels`).
    pub latent_rows: usize,
    pub latent_cols: usize,
    pub latent_channels: usize,
    /// Sampling steps the request will run.
    pub steps: usize,
    /// The variant the folder runs as, and the request fields it will not use.
    pub variant: Variant,
    pub ignored: Vec<Ignored>,
}

impl Pipeline {
    /// Checks `request`'s size, steps and guidance against the folder in `dir` (its `model_index.json`, scheduler
    /// config and transformer config; no weights, no tokenizer, no device), so a command can refuse a bad request
    /// before the minutes a load takes. [`Pipeline::plan`] repeats these checks and adds the prompt's.
    pub fn preflight(
        dir: &Path,
        options: &LoadOptions,
        request: &Request,
    ) -> Result<Preflight, PipelineError> {
        let limits = &options.limits;
        let (width, height) = checked_size(limits, request)?;
        let layout = FolderLayout::read(dir)?;
        let scheduler = SchedulerConfig::from_model_folder(dir)?;
        let config_path = layout.transformer.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| folder_err(&config_path, format!("cannot read it ({e})")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| folder_err(&config_path, format!("not valid JSON: {e}")))?;
        let dit = QwenImageDitConfig::from_json(&value)
            .map_err(|e| folder_err(&config_path, e.to_string()))?;
        let variant = options.variant.unwrap_or(layout.variant);
        let source = sigma_source(
            variant,
            layout.sample_sigmas.as_deref(),
            request.steps,
            limits,
        )?;
        let (latent_rows, latent_cols) = latent_grid(height, width);
        let schedule = Schedule::new(&scheduler, source, latent_rows * latent_cols)
            .map_err(|e| invalid(format!("no schedule for this request: {e}")))?;
        Ok(Preflight {
            width,
            height,
            latent_rows,
            latent_cols,
            latent_channels: dit.in_channels,
            steps: schedule.steps(),
            variant,
            ignored: variant.ignored(request.negative_prompt.as_deref(), request.true_cfg_scale),
        })
    }
}

/// The request's size floored to multiples of 32 and checked against `limits`.
fn checked_size(limits: &Limits, request: &Request) -> Result<(usize, usize), PipelineError> {
    let (width, height) = (
        request.width / SIDE_MULTIPLE * SIDE_MULTIPLE,
        request.height / SIDE_MULTIPLE * SIDE_MULTIPLE,
    );
    if width == 0 || height == 0 {
        return Err(invalid(format!(
            "size {}x{} is below {SIDE_MULTIPLE} pixels on a side; sides are floored to a multiple of \
             {SIDE_MULTIPLE}, so ask for at least {SIDE_MULTIPLE}x{SIDE_MULTIPLE}",
            request.width, request.height
        )));
    }
    if width > limits.max_side || height > limits.max_side {
        return Err(invalid(format!(
            "size {width}x{height} exceeds the largest side of {} pixels",
            limits.max_side
        )));
    }
    if width.saturating_mul(height) > limits.max_pixels {
        return Err(invalid(format!(
            "size {width}x{height} exceeds the limit of {} pixels",
            limits.max_pixels
        )));
    }
    if !request.true_cfg_scale.is_finite() {
        return Err(invalid(format!(
            "true_cfg_scale must be a finite number, got {}",
            request.true_cfg_scale
        )));
    }
    Ok((width, height))
}

/// Where the request's sigmas come from: the checkpoint's fixed grid, the asked step count, or the variant's
/// default.
fn sigma_source<'a>(
    variant: Variant,
    sample_sigmas: Option<&'a [f64]>,
    steps: Option<usize>,
    limits: &Limits,
) -> Result<SigmaSource<'a>, PipelineError> {
    Ok(match (sample_sigmas, steps) {
        (_, Some(0)) => return Err(invalid("steps must be at least 1")),
        (_, Some(n)) if n > limits.max_steps => {
            return Err(invalid(format!(
                "{n} steps exceed the limit of {}",
                limits.max_steps
            )));
        }
        (Some(fixed), Some(n)) if n != fixed.len() => {
            return Err(invalid(format!(
                "this checkpoint samples with its own {} sigmas (sample_sigmas); ask for {} steps or leave \
                 steps unset",
                fixed.len(),
                fixed.len()
            )));
        }
        (Some(fixed), _) => SigmaSource::Explicit(fixed),
        (None, Some(n)) => SigmaSource::Steps(n),
        (None, None) => SigmaSource::Steps(variant.default_steps()),
    })
}

/// The three components must agree on widths.
fn check_agreement(
    dit: &QwenImageDitConfig,
    te: &TextEncoderConfig,
    vae: &VaeConfig,
    dir: &Path,
) -> Result<(), PipelineError> {
    let te_hidden = te.hidden_size;
    if dit.context_in_dim != te_hidden {
        return Err(folder_err(
            dir,
            format!(
                "the transformer reads {}-wide text features but the text encoder makes {te_hidden}; the components \
                 come from different checkpoints",
                dit.context_in_dim
            ),
        ));
    }
    let z_dim = vae.z_dim;
    if dit.in_channels != z_dim || dit.out_channels() != z_dim {
        return Err(folder_err(
            dir,
            format!(
                "the transformer has {} in / {} out latent channels but the VAE has {z_dim}; the components come from \
                 different checkpoints",
                dit.in_channels,
                dit.out_channels()
            ),
        ));
    }
    if dit.patch_size != 1 {
        return Err(folder_err(
            dir,
            format!(
                "transformer patch_size {} is not 1; Qwen-Image 2.1 consumes latents unpatched",
                dit.patch_size
            ),
        ));
    }
    Ok(())
}

struct Conditions<'a> {
    prompt: &'a TensorF32,
    negative: Option<&'a TensorF32>,
    cfg_scale: f32,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn round_vec(mut v: Vec<f32>, dtype: LatentDtype) -> Vec<f32> {
    if dtype != LatentDtype::F32 {
        for x in &mut v {
            *x = dtype.round(*x);
        }
    }
    v
}

fn round_tensor(mut t: TensorF32, dtype: LatentDtype) -> TensorF32 {
    if dtype != LatentDtype::F32 {
        for v in t.data_mut() {
            *v = dtype.round(*v);
        }
    }
    t
}

/// The DiT inputs of one text-to-image forward: one sample, text rows then the target's slots.
fn t2i_inputs(
    latents: &TensorF32,
    text: &TensorF32,
    timestep: f32,
    rows: usize,
    cols: usize,
) -> Result<DitInputs, PipelineError> {
    let [text_rows, width] = text.dims::<2>("prompt features")?;
    let n_target = rows * cols;
    let mut img_mask = vec![0u8; text_rows];
    img_mask.extend(std::iter::repeat_n(1u8, n_target / TOKENS_PER_SLOT));
    let mask_len = img_mask.len();
    Ok(DitInputs {
        hidden_states: latents.clone(),
        encoder_hidden_states: Tensor::new(vec![1, text_rows, width], text.data().to_vec())
            .map_err(DitError::from)?,
        timestep: Tensor::new(vec![1], vec![timestep]).map_err(DitError::from)?,
        img_mask: Tensor::new(vec![1, mask_len], img_mask).map_err(DitError::from)?,
        encoder_hidden_states_mask: None,
        img_shapes: Tensor::new(vec![1, 1, 3], vec![1, rows as i64, cols as i64])
            .map_err(DitError::from)?,
    })
}

/// The last `n_target` rows of a `[1, S, C]` sample.
fn target_rows(sample: TensorF32, n_target: usize) -> Result<Vec<f32>, PipelineError> {
    let [_, seq, channels] = sample.dims::<3>("DiT sample")?;
    if seq < n_target {
        return Err(PipelineError::Internal(format!(
            "the DiT returned {seq} rows, fewer than the {n_target} target tokens"
        )));
    }
    let mut data = sample.into_data();
    Ok(data.split_off((seq - n_target) * channels))
}

/// One guidance branch: its text features and its prefix cache.
struct Branch<'a, C> {
    text: &'a TensorF32,
    cache: Option<C>,
}

impl<C> Branch<'_, C> {
    fn velocity<D: DitBackend<KvCache = C>>(
        &mut self,
        dit: &mut D,
        latents: &TensorF32,
        timestep: f32,
        plan: &Plan,
        use_cache: bool,
    ) -> Result<Vec<f32>, PipelineError> {
        let inputs = t2i_inputs(
            latents,
            self.text,
            timestep,
            plan.latent_rows,
            plan.latent_cols,
        )?;
        let n_target = plan.latent_rows * plan.latent_cols;
        let output = match (&self.cache, use_cache) {
            (_, false) => dit.forward(&inputs, KvStep::None)?,
            (None, true) => dit.forward(&inputs, KvStep::Extract)?,
            (Some(cache), true) => dit.forward(&inputs, KvStep::Cached(cache))?,
        };
        if let Some(cache) = output.kv_cache {
            self.cache = Some(cache);
        } else if use_cache && self.cache.is_none() {
            return Err(PipelineError::Internal(
                "the DiT returned no prefix cache from an extract step".into(),
            ));
        }
        target_rows(output.sample, n_target)
    }
}

#[allow(clippy::too_many_arguments)]
fn denoise<D: DitBackend>(
    dit: &mut D,
    plan: &Plan,
    conditions: &Conditions<'_>,
    mut latents: TensorF32,
    dtype: LatentDtype,
    keep: bool,
    timings: &mut Timings,
    progress: &mut dyn FnMut(Progress),
) -> Result<(TensorF32, Vec<TensorF32>, Vec<TensorF32>), PipelineError> {
    let use_cache = dit.config().causal_condition;
    let mut cond = Branch {
        text: conditions.prompt,
        cache: None,
    };
    let mut neg = conditions.negative.map(|text| Branch { text, cache: None });
    let steps = Scheduler::steps(&plan.schedule);
    let mut kept = Vec::new();
    let mut kept_velocities = Vec::new();
    for step in 0..steps {
        let t = Instant::now();
        let timestep = Scheduler::model_timestep(&plan.schedule, step, dtype)?;
        // The model's output is in the latent dtype.
        let mut velocity = round_vec(
            cond.velocity(dit, &latents, timestep, plan, use_cache)?,
            dtype,
        );
        if let Some(neg) = neg.as_mut() {
            let negative = round_vec(
                neg.velocity(dit, &latents, timestep, plan, use_cache)?,
                dtype,
            );
            let mut combined = vec![0f32; velocity.len()];
            cfg_combine(
                &velocity,
                &negative,
                conditions.cfg_scale,
                dtype,
                &mut combined,
            )?;
            velocity = combined;
        }
        Scheduler::step(&plan.schedule, step, latents.data_mut(), &velocity, dtype)?;
        if keep {
            kept.push(latents.clone());
            kept_velocities.push(Tensor::new(latents.shape().to_vec(), velocity)?);
        }
        let seconds = secs(t.elapsed());
        timings.steps.push(seconds);
        progress(Progress::Step {
            step: step + 1,
            steps,
            seconds,
        });
    }
    Ok((latents, kept, kept_velocities))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn component_loads_print_their_total_then_each() {
        let loads = ComponentLoads {
            text_encoder: 0.25,
            dit: 1.5,
            vae: 0.125,
        };
        assert_eq!(
            loads.to_string(),
            "1.875 s (text encoder 0.250, DiT 1.500, VAE 0.125)"
        );
    }

    #[test]
    fn invalid_request_is_distinguishable() {
        assert!(invalid("x").is_invalid_request());
        assert!(!PipelineError::Internal("x".into()).is_invalid_request());
        assert!(!folder_err(Path::new("m"), "x").is_invalid_request());
    }

    #[test]
    fn target_rows_take_the_tail() {
        let sample = Tensor::new(vec![1, 3, 2], vec![0., 1., 2., 3., 4., 5.]).unwrap();
        assert_eq!(target_rows(sample, 2).unwrap(), vec![2., 3., 4., 5.]);
        let sample = Tensor::new(vec![1, 1, 2], vec![0., 1.]).unwrap();
        assert!(target_rows(sample, 2).is_err());
    }

    #[test]
    fn t2i_inputs_append_one_slot_per_four_tokens() {
        let latents = Tensor::new(vec![1, 24, 2], vec![0.0; 48]).unwrap();
        let text = Tensor::new(vec![5, 3], vec![0.0; 15]).unwrap();
        let inputs = t2i_inputs(&latents, &text, 0.5, 4, 6).unwrap();
        assert_eq!(inputs.img_mask.shape(), &[1, 11]);
        assert_eq!(&inputs.img_mask.data()[..5], &[0; 5]);
        assert_eq!(&inputs.img_mask.data()[5..], &[1; 6]);
        assert_eq!(inputs.img_shapes.data(), &[1, 4, 6]);
        assert_eq!(inputs.encoder_hidden_states.shape(), &[1, 5, 3]);
    }

    #[test]
    fn the_budget_is_the_device_capped_by_the_option() {
        assert_eq!(planning_budget(None, None), u64::MAX);
        assert_eq!(planning_budget(None, Some(7)), 7);
        assert_eq!(planning_budget(Some(10), None), 10);
        assert_eq!(planning_budget(Some(10), Some(5)), 5);
        assert_eq!(planning_budget(Some(5), Some(10)), 5);
    }

    #[test]
    fn residency_follows_the_budget_and_a_binding_cap_is_named() {
        let parts = || {
            vec![
                Component::new("text encoder", 40),
                Component::new("DiT", 60),
            ]
        };
        let plan = decide_residency(parts(), None, None).unwrap();
        assert_eq!(plan.residency(), Residency::AllResident);
        let plan = decide_residency(parts(), Some(1000), Some(60)).unwrap();
        assert_eq!(
            (plan.residency(), plan.budget()),
            (Residency::Sequential, 60)
        );
        // The cap set the budget (host, or below the device's): the refusal names it.
        for available in [None, Some(1000)] {
            match decide_residency(parts(), available, Some(59)) {
                Err(PipelineError::CappedBudget { source, cap }) => {
                    assert_eq!((source.name.as_str(), source.bytes, cap), ("DiT", 60, 59));
                }
                other => panic!("{other:?}"),
            }
        }
        // The device set it (the cap is no lower): the plain refusal.
        for cap in [None, Some(59), Some(100)] {
            match decide_residency(parts(), Some(59), cap) {
                Err(PipelineError::MemoryPlan(e)) => assert_eq!((e.bytes, e.budget), (60, 59)),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn component_loads_add_up() {
        let loads = ComponentLoads {
            text_encoder: 1.0,
            dit: 2.0,
            vae: 0.5,
        };
        assert_eq!(loads.total(), 3.5);
        assert_eq!(Timings::default().loads.total(), 0.0);
    }

    #[test]
    fn folder_without_index_explains_itself() {
        let err = FolderLayout::read(Path::new("/nonexistent/model")).unwrap_err();
        assert!(err.to_string().contains("model_index.json"), "{err}");
    }
}
