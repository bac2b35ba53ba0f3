//! The MiniMax H3 text-to-video-with-audio pipeline: a prompt to 24 fps RGB frames and a stereo waveform, as the
//! diffusers `MiniMaxH3ModularPipeline` (`t2va` workflow) runs it.
//!
//! [`H3Pipeline::load`] opens a diffusers MiniMax H3 folder ([`folder::FolderLayout`]: the index, `transformer/`,
//! `text_encoder/`, `tokenizer/`, `vae/`, `audio_vae/`, `scheduler/`, `audio_scheduler/`), checks every config
//! against the others, and decides the memory plan ([`H3Pipeline::memory_plan`]): the four components stay
//! resident when they fit the budget (free device memory less [`DEVICE_RESERVE_BYTES`], capped by
//! [`LoadOptions::device_budget`]; the host plans against the cap alone), else every request loads, runs and frees
//! them in turn (the load times in [`Timings::loads`]). On the GPU there is one driver, one context (device 0) and
//! one blocking stream ([`GpuDevice`]); the components borrow them and run one after another on that stream, each
//! waiting for its work before it hands host tensors on.
//!
//! [`H3Pipeline::generate`] checks the request completely first ([`H3Pipeline::plan`]: every field against the
//! model and [`Limits`], the prompt's tokens, the packed layout), then: the prompt features
//! (`hidden_states[50]`), the noise (video, then audio, from one generator, or injected), the steps (one DiT
//! forward over the packed `[text | audio | video]` sequence per step, the video rows stepped by the video
//! schedule (shift 12) and the audio rows by the audio schedule (shift 3)), the video decode and the audio decode.
//! Each phase is timed and reported through [`Progress`].
//!
//! What a request may ask ([`Limits`]): the model generates 24 fps; the frame count `round(seconds * 24)` snaps up
//! to `17 n + 5` as the reference does; the snapped clip may last from the shortest the video VAE decodes
//! (22 frames, 0.92 s) to 15 s. The reference refuses clips under 5 s because the released weights were trained
//! on 5 to 15 s clips; nothing in the computation needs that floor, so it is [`Limits::min_seconds`], 0 by
//! default (shorter clips run the same math, checked against the reference with its floor lifted; their quality
//! is outside what the release was trained for). Sides are multiples of the spatial ratio times the patch (32 as
//! released). The checkpoint is guidance-distilled: a negative prompt or a guidance scale is refused, and so is a
//! first frame (image to video is not supported yet).
//!
//! Invariants: nothing runs before a request is fully checked, and request-shaped errors are
//! [`PipelineError::InvalidRequest`] naming the field; nothing here panics on input; dropping the pipeline
//! releases every component, then the context and the driver.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions, Request};
//!
//! let mut pipeline = H3Pipeline::load(Path::new("MiniMax-H3"), &LoadOptions::new(Backend::Host))?;
//! let request = Request { width: 768, height: 448, seconds: 5.0, ..Request::new("waves at dusk") };
//! let made = pipeline.generate(&request, &mut |p| eprintln!("{p:?}"))?;
//! println!("{} frames, {:?}", made.frames.frames, made.audio.as_ref().map(|a| a.sample_rate));
//! # Ok::<(), tf_engines::minimax_h3::pipeline::PipelineError>(())
//! ```

pub mod components;
pub mod folder;
mod run;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

use self::components::{Components, Folders};
use self::folder::{folder_err, Configs, FolderLayout};
use super::dit::H3Error;
use super::layout::{
    align_num_frames, latent_frames, Geometry, LayoutError, LayoutRequest, PackedLayout,
    AUDIO_CHANNELS, FPS, TEXT_TAG,
};
use super::noise::{H3Noise, NoiseShape};
use super::scheduler::H3Schedule;
use super::text::{H3TextError, H3TextOptions, H3Tokenizer};
use super::vae_audio::AudioVaeError;
use super::vae_video::{VideoFrames, VideoVaeError};
use crate::nn::backend_error::GpuError;
use crate::nn::gpu::GpuDevice;
use crate::nn::memory_plan::{MemoryPlan, MemoryPlanError, Residency};
use crate::nn::precision::DitPrecision;
use crate::nn::sampling::flow_match::{SamplerError, SigmaSource};
use crate::nn::sampling::noise::NoiseError;
use crate::nn::sampling::scheduler::Scheduler;
use crate::nn::tensor::{ShapeError, TensorF32};
use crate::nn::weights::WeightsError;
use crate::qwen3_vl::text_encoder::TextEncoderError;

/// The reference's default `num_inference_steps`: grid points, the terminal 0 included (49 forwards).
pub const DEFAULT_STEPS: usize = 50;
/// The reference's default canvas (16:9 at a 768 short edge).
pub const DEFAULT_WIDTH: usize = 1344;
pub const DEFAULT_HEIGHT: usize = 768;
/// The reference's default length: 124 frames (5.17 s) once 120 are snapped to `17 n + 5`.
pub const DEFAULT_SECONDS: f64 = 5.0;
/// The reference's shortest and longest clip, in seconds.
pub const REFERENCE_MIN_SECONDS: f64 = 5.0;
pub const REFERENCE_MAX_SECONDS: f64 = 15.0;
/// The prompt of the text encoder's warm-up forward at load: about as long as a typical request's (70 tokens).
const TEXT_WARM_UP_PROMPT: &str = "A red fox trots along a snowy ridge at sunrise, its breath steaming in the cold \
    air, while pine trees sway in the wind and a river winds through the quiet valley far below the hills, as \
    distant crows call and the first light turns the clouds gold.";

/// Device memory left free for workspaces, cuBLASLt and the driver when planning residency.
pub const DEVICE_RESERVE_BYTES: u64 = 4 << 30;

/// Errors of loading or running the pipeline.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// The request cannot be served as asked; the message names the field. Nothing was run.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("model folder {}: {why}", path.display())]
    Folder { path: PathBuf, why: String },
    /// A component or a backend this build cannot run.
    #[error("{0}")]
    Unsupported(String),
    #[error("text: {0}")]
    Text(#[from] H3TextError),
    #[error("text encoder: {0}")]
    TextEncoder(#[from] TextEncoderError),
    #[error("DiT: {0}")]
    Dit(#[from] H3Error),
    #[error("video VAE: {0}")]
    VideoVae(#[from] VideoVaeError),
    #[error("audio VAE: {0}")]
    AudioVae(#[from] AudioVaeError),
    #[error("sampler: {0}")]
    Sampler(#[from] SamplerError),
    #[error("noise: {0}")]
    Noise(#[from] NoiseError),
    #[error("layout: {0}")]
    Layout(#[from] LayoutError),
    #[error("weights: {0}")]
    Weights(#[from] WeightsError),
    #[error("shape: {0}")]
    Shape(#[from] ShapeError),
    /// A GPU call of the pipeline itself (driver, context) failed; the cause stays in the source chain.
    #[error("GPU: {0}")]
    Gpu(#[from] GpuError),
    #[error("device memory: {0}")]
    MemoryPlan(#[from] MemoryPlanError),
    /// The components do not fit the budget that [`LoadOptions::device_budget`] capped.
    #[error(
        "device memory: {source}; the budget is capped at {cap} B by the load options' device budget: raise the \
         cap or leave it unset"
    )]
    CappedBudget { source: MemoryPlanError, cap: u64 },
    #[error("internal: {0}")]
    Internal(String),
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

/// A failed call of the pipeline's own on the device.
fn gpu(what: &str, e: tf_cuda::Error) -> PipelineError {
    PipelineError::Gpu(crate::nn::backend_error::gpu_error(what, e))
}

pub use crate::nn::backend::Backend;

/// What a request may ask for (the model's own rules come on top: 24 fps, `17 n + 5` frames, canvas multiples).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Shortest clip, in seconds of the snapped frame count (0: anything the video VAE decodes, from 22 frames).
    pub min_seconds: f64,
    /// Longest clip, in seconds of the snapped frame count.
    pub max_seconds: f64,
    /// Largest side in pixels.
    pub max_side: usize,
    /// Largest frame area in pixels.
    pub max_pixels: usize,
    /// Most grid points (`steps`).
    pub max_steps: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            min_seconds: 0.0,
            max_seconds: REFERENCE_MAX_SECONDS,
            max_side: 2048,
            max_pixels: 1 << 21,
            max_steps: 200,
        }
    }
}

impl Limits {
    /// The reference's window: 5 to 15 seconds.
    pub fn reference() -> Limits {
        Limits {
            min_seconds: REFERENCE_MIN_SECONDS,
            ..Limits::default()
        }
    }

    fn check(&self) -> Result<(), PipelineError> {
        let ok = self.min_seconds.is_finite()
            && self.max_seconds.is_finite()
            && (0.0..=self.max_seconds).contains(&self.min_seconds)
            && self.max_seconds <= 3600.0
            && (1..=(1 << 15)).contains(&self.max_side)
            && (1..=(1 << 28)).contains(&self.max_pixels)
            && (2..=1000).contains(&self.max_steps);
        if ok {
            Ok(())
        } else {
            Err(PipelineError::Unsupported(format!(
                "load options: limits {self:?} are out of range (0 <= min_seconds <= max_seconds <= 3600, max_side \
                 1..=32768, max_pixels 1..=2^28, max_steps 2..=1000)"
            )))
        }
    }
}

/// How to load a pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadOptions {
    pub backend: Backend,
    /// This process's rank of a multi-GPU job (`tf video --gpus N`): the pipeline loads into the communicator's
    /// context (its device), and the DiT runs sequence-parallel over the ranks. `None`: one GPU, device 0.
    pub sequence_parallel: Option<super::dit_gpu::parallel::SequenceParallel>,
    pub limits: Limits,
    /// The text conditioning: the hidden state read (50), the prompt bounds, the markup rule.
    pub text: H3TextOptions,
    /// Caps the device budget the memory plan decides against, in bytes: the GPU plans against
    /// `min(free - DEVICE_RESERVE_BYTES, cap)`, the host against the cap. `None`: no cap. A cap below the sum of
    /// the components selects the sequential mode; one below the largest component is refused.
    pub device_budget: Option<u64>,
    /// The GEMM precision of the GPU DiT (bf16, or FP8 in chosen block groups); the host runs f32 and refuses
    /// anything but bf16 here.
    pub dit_precision: DitPrecision,
    /// Timing only: make the text encoder's and the DiT's weights on the device from this seed instead of reading
    /// them (their folders then need only `config.json`; the VAEs are still read). For full-size runs where the
    /// checkpoints do not fit a disk; the output says nothing about the model. GPU only.
    pub random_weights: Option<u32>,
}

impl LoadOptions {
    /// Defaults for `backend`.
    pub fn new(backend: Backend) -> Self {
        LoadOptions {
            backend,
            sequence_parallel: None,
            limits: Limits::default(),
            text: H3TextOptions::default(),
            device_budget: None,
            dit_precision: DitPrecision::Bf16,
            random_weights: None,
        }
    }
}

/// One text-to-video request, with the fields of LocalRouter's video request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub prompt: String,
    /// Refused when non-empty: the checkpoint is guidance-distilled.
    pub negative_prompt: Option<String>,
    /// Frame size in pixels.
    pub width: usize,
    pub height: usize,
    /// Length; `round(seconds * fps)` frames, snapped up to `17 n + 5`.
    pub seconds: f64,
    /// Must be 24, the model's rate.
    pub fps: u32,
    /// Seed of the portable noise generator.
    pub seed: u64,
    /// Grid points of both schedules, the terminal 0 included (the reference's `num_inference_steps`, so
    /// `steps - 1` forwards at most); `None` = 50.
    pub steps: Option<usize>,
    /// Refused unless `None` or 1: the checkpoint has no guidance scale.
    pub guidance: Option<f32>,
    /// Decode the audio track (the audio rows are sampled either way: one sequence holds both).
    pub audio: bool,
    /// Refused: image to video is not supported yet.
    pub first_frame: Option<PathBuf>,
    /// Injected initial noise in place of the seeded draw (its shapes are checked by [`H3Pipeline::plan`]).
    pub noise: Option<H3Noise>,
}

impl Request {
    /// A request with the reference's defaults (1344 x 768, 5 s at 24 fps, 50 grid points, seed 0, audio).
    pub fn new(prompt: impl Into<String>) -> Request {
        Request {
            prompt: prompt.into(),
            negative_prompt: None,
            width: DEFAULT_WIDTH,
            height: DEFAULT_HEIGHT,
            seconds: DEFAULT_SECONDS,
            fps: FPS as u32,
            seed: 0,
            steps: None,
            guidance: None,
            audio: true,
            first_frame: None,
            noise: None,
        }
    }
}

/// The sizes a request resolves to, checked against a folder's configs alone ([`H3Pipeline::preflight`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preflight {
    pub width: usize,
    pub height: usize,
    /// `round(seconds * fps)`, before snapping.
    pub requested_frames: usize,
    pub geometry: Geometry,
    /// The noise tensors' sizes (what an injected noise file must hold).
    pub noise_shape: NoiseShape,
    /// Grid points of the schedules.
    pub grid_points: usize,
}

/// A request after validation: everything the run needs, derived before any model call.
#[derive(Debug, Clone)]
pub struct Plan {
    pub sizes: Preflight,
    pub video_schedule: H3Schedule,
    pub audio_schedule: H3Schedule,
    pub prompt_ids: Vec<u32>,
    pub layout: PackedLayout,
    /// The DiT's `(1, ph, pw)` patch.
    pub patch: [usize; 3],
    pub audio: bool,
}

impl Plan {
    /// Model calls the request makes.
    pub fn steps(&self) -> usize {
        self.video_schedule.steps()
    }
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
    /// The frames are decoded.
    DecodedVideo { seconds: f64 },
    /// The audio is decoded.
    DecodedAudio { seconds: f64 },
}

/// Seconds a request spent loading and then freeing each component (sequential mode; zero when resident).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ComponentLoads {
    pub text_encoder: f64,
    pub dit: f64,
    pub video_vae: f64,
    pub audio_vae: f64,
}

impl ComponentLoads {
    /// All four together.
    pub fn total(&self) -> f64 {
        self.text_encoder + self.dit + self.video_vae + self.audio_vae
    }
}

/// `2.345 s (text encoder 0.100, ...)`: the loads' total, then each component's, in seconds.
impl std::fmt::Display for ComponentLoads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3} s (text encoder {:.3}, DiT {:.3}, video VAE {:.3}, audio VAE {:.3})",
            self.total(),
            self.text_encoder,
            self.dit,
            self.video_vae,
            self.audio_vae
        )
    }
}

/// Wall time of each phase, in seconds. The phases time the work alone; `total` is the whole request, the
/// component loads of the sequential mode included.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Tokens, prompt features, noise and the packed layout: up to the first DiT call.
    pub encode: f64,
    pub steps: Vec<f64>,
    pub decode_video: f64,
    pub decode_audio: f64,
    pub total: f64,
    pub loads: ComponentLoads,
}

/// A stereo waveform.
#[derive(Debug, Clone, PartialEq)]
pub struct StereoAudio {
    pub sample_rate: u32,
    pub left: Vec<f32>,
    pub right: Vec<f32>,
}

impl StereoAudio {
    /// `l0 r0 l1 r1 ...`.
    pub fn interleaved(&self) -> Vec<f32> {
        self.left
            .iter()
            .zip(&self.right)
            .flat_map(|(&l, &r)| [l, r])
            .collect()
    }
}

/// The latent rows after one step (kept with [`H3Pipeline::keep_step_latents`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepLatents {
    /// `[video rows, in_channels * ph * pw]`.
    pub video: TensorF32,
    /// `[2 * audio latents, audio channels]`, left channel first.
    pub audio: TensorF32,
}

/// What a generate produced.
#[derive(Debug, Clone)]
pub struct Generation {
    /// 8-bit RGB frames (and the `[0, 1]` values they were rounded from). On a rank other than 0 of a multi-GPU
    /// job none (0 frames) and no audio: rank 0 holds the output.
    pub frames: VideoFrames,
    /// Frames per second (24).
    pub fps: u32,
    /// The decoded soundtrack, when the request asked for it.
    pub audio: Option<StereoAudio>,
    /// The request's frame count before snapping, and the snapped one (`frames.frames`).
    pub requested_frames: usize,
    /// The token ids and prompt features `[tokens, text_dim]` the DiT read.
    pub prompt_ids: Vec<u32>,
    pub prompt_embeds: TensorF32,
    /// The initial rows (patched video noise, audio noise) and the rows after every step (kept on request).
    pub initial_latents: Option<StepLatents>,
    pub step_latents: Vec<StepLatents>,
    /// The unpacked latents the VAEs decoded: video `[1, C, F, H, W]`, audio `[2, C, A]`.
    pub video_latents: TensorF32,
    pub audio_latents: TensorF32,
    pub seed: u64,
    pub timings: Timings,
}

/// Load figures.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    pub backend: Backend,
    /// Bytes the loaded components hold (device memory taken on the GPU, f32 weights on the host); 0 in the
    /// sequential mode, where nothing stays loaded between requests ([`MemoryPlan::peak`] is what one holds).
    pub resident_bytes: u64,
    pub seconds: f64,
    pub residency: Residency,
    /// Where each component runs: (name, "host" or "gpu").
    pub placement: Vec<(&'static str, &'static str)>,
    /// The precision each component computes in: (name, description).
    pub precision: Vec<(&'static str, String)>,
}

/// The loaded pipeline. Components drop before the device context (field order).
pub struct H3Pipeline {
    tokenizer: H3Tokenizer,
    components: Components,
    configs: Configs,
    options: LoadOptions,
    keep_step_latents: bool,
    report: LoadReport,
    memory_plan: MemoryPlan,
    dir: PathBuf,
    /// The context and the one blocking stream every GPU component borrows (`None` on the host).
    device: Option<GpuDevice>,
}

impl std::fmt::Debug for H3Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3Pipeline")
            .field("dir", &self.dir)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

/// The process's one device context for the GPU pipeline and the stream every component runs on: a rank of a
/// multi-GPU job loads into its DiT communicator's context and runs on its stream (the DiT's collectives and
/// every component's kernels in one order; tf-cuda refuses the buffers and GEMM plans of any other context, even
/// one of the same device); one GPU opens device 0's context and a blocking stream.
fn open_device(options: &LoadOptions) -> Result<GpuDevice, PipelineError> {
    if let Some(sp) = &options.sequence_parallel {
        return Ok(GpuDevice::with_stream(sp.stream()));
    }
    GpuDevice::open().map_err(|e| {
        gpu(
            "opening the CUDA driver, a context on device 0 and its stream",
            e,
        )
    })
}

/// The budget the memory plan decides against: what the device offers (`None` on the host: unlimited), capped
/// by [`LoadOptions::device_budget`].
fn decide_residency(
    components: Vec<crate::nn::memory_plan::Component>,
    available: Option<u64>,
    cap: Option<u64>,
) -> Result<MemoryPlan, PipelineError> {
    let budget = available.unwrap_or(u64::MAX).min(cap.unwrap_or(u64::MAX));
    MemoryPlan::decide(components, budget).map_err(|source| match cap {
        Some(cap) if cap == budget && available.is_none_or(|a| cap < a) => {
            PipelineError::CappedBudget { source, cap }
        }
        _ => PipelineError::MemoryPlan(source),
    })
}

impl H3Pipeline {
    /// Loads the pipeline in `dir` on `options.backend`: every config is checked first, then the memory plan
    /// decides whether the components are loaded now and kept, or loaded, run and freed by every request.
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<H3Pipeline, PipelineError> {
        let started = Instant::now();
        options.limits.check()?;
        options.text.validate()?;
        let layout = FolderLayout::read(dir)?;
        let configs = Configs::read(&layout)?;
        let te_file = layout.text_encoder.join("config.json");
        super::text::check_layer(&configs.text_encoder, options.text.layer, &te_file)?;
        let tokenizer = H3Tokenizer::load(&layout.tokenizer_json)?;
        if usize::try_from(tokenizer.largest_id())
            .map_or(true, |id| id >= configs.text_encoder.vocab_size)
        {
            return Err(folder_err(
                &te_file,
                format!(
                    "the tokenizer makes ids up to {} but the text encoder has {} embeddings; tokenizer and text \
                     encoder do not belong together",
                    tokenizer.largest_id(),
                    configs.text_encoder.vocab_size
                ),
            ));
        }
        if options.backend == Backend::Host && options.dit_precision != DitPrecision::Bf16 {
            return Err(PipelineError::InvalidRequest(format!(
                "DiT precision {} runs on the GPU only; the host reference computes in f32",
                options.dit_precision
            )));
        }
        if options.backend == Backend::Host && options.random_weights.is_some() {
            return Err(PipelineError::InvalidRequest(
                "random weights are made on the GPU; the host reference reads the folder's weights (drop the \
                 random weights or run on the GPU)"
                    .into(),
            ));
        }
        let folders = Folders::open(
            &layout,
            &configs,
            options.text.layer,
            options.dit_precision,
            options.random_weights,
        )?;
        let parts = folders.plan_components(options.backend);
        let (device, available, free_before) = match options.backend {
            Backend::Host => (None, None, 0),
            Backend::Gpu => {
                let device = open_device(options)?;
                let free = device
                    .context()
                    .memory_info()
                    .map_err(|e| gpu("reading free memory", e))?
                    .free;
                (
                    Some(device),
                    Some(free.saturating_sub(DEVICE_RESERVE_BYTES)),
                    free,
                )
            }
        };
        let memory_plan = decide_residency(parts, available, options.device_budget)?;
        let (components, resident_bytes) = if memory_plan.residency() == Residency::Sequential {
            (Components::Sequential(Box::new(folders)), 0)
        } else {
            let mut resident = folders.load_all(device.as_ref())?;
            if device.is_some() {
                // One text forward at load: a fresh process's first encode otherwise pays the text path's
                // first-use costs (kernel and GEMM-plan loading, about 90 ms on the H200) inside the request.
                let ids = tokenizer
                    .encode(TEXT_WARM_UP_PROMPT, &options.text)
                    .map_err(PipelineError::Text)?;
                if !ids.is_empty() {
                    resident.text.features_at(&ids, options.text.layer)?;
                }
            }
            let bytes = match &device {
                None => memory_plan.total(),
                Some(device) => {
                    let free_after = device
                        .context()
                        .memory_info()
                        .map_err(|e| gpu("reading free memory", e))?
                        .free;
                    free_before.saturating_sub(free_after)
                }
            };
            (Components::Resident(Box::new(resident)), bytes)
        };
        let placement = [
            components::TEXT_ENCODER,
            components::DIT,
            components::VIDEO_VAE,
            components::AUDIO_VAE,
        ]
        .into_iter()
        .map(|c| (c, options.backend.name()))
        .collect();
        let precision = components::precisions(
            options.backend,
            options.dit_precision,
            configs.dit.num_layers,
        );
        Ok(H3Pipeline {
            tokenizer,
            components,
            configs,
            options: options.clone(),
            keep_step_latents: false,
            report: LoadReport {
                backend: options.backend,
                resident_bytes,
                seconds: started.elapsed().as_secs_f64(),
                residency: memory_plan.residency(),
                placement,
                precision,
            },
            memory_plan,
            dir: dir.to_path_buf(),
            device,
        })
    }

    /// The memory plan chosen at load.
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.memory_plan
    }

    /// Load figures.
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// The folder's configs.
    pub fn configs(&self) -> &Configs {
        &self.configs
    }

    /// The device context, when the pipeline runs on the GPU.
    pub fn context(&self) -> Option<&tf_cuda::Context> {
        self.device.as_ref().map(GpuDevice::context)
    }

    /// The context and the stream every GPU component runs on, when the pipeline runs on the GPU.
    pub fn device(&self) -> Option<&GpuDevice> {
        self.device.as_ref()
    }

    /// Plans every GEMM shape the persistent plan cache stores for this GPU in the resident DiT and loads their
    /// kernels (a worker's load), so that a request of a shape an earlier process planned plans and loads nothing
    /// inside it. `None` in the sequential mode (nothing stays loaded) or on the host backend.
    pub fn prepare_stored_gemms(
        &mut self,
    ) -> Result<Option<crate::nn::gpu::gemm::StoredGemms>, PipelineError> {
        match &mut self.components {
            Components::Resident(held) => Ok(held.dit.prepare_stored_gemms()?),
            Components::Sequential(_) => Ok(None),
        }
    }

    /// Keep the initial rows and the rows after every step in [`Generation`] (for parity checks).
    pub fn keep_step_latents(&mut self, keep: bool) {
        self.keep_step_latents = keep;
    }

    /// Checks a request's size, length, rate and steps against the folder in `dir` (its index and configs; no
    /// weights, no tokenizer, no device), so a command can refuse it, and size an injected noise file, before
    /// the minutes a load takes. [`H3Pipeline::plan`] repeats these checks and adds the prompt's.
    pub fn preflight(
        dir: &Path,
        options: &LoadOptions,
        request: &Request,
    ) -> Result<Preflight, PipelineError> {
        options.limits.check()?;
        let layout = FolderLayout::read(dir)?;
        let configs = Configs::read(&layout)?;
        sizes(&configs, &options.limits, request)
    }

    /// Checks `request` completely and derives everything the run needs; no model runs.
    pub fn plan(&self, request: &Request) -> Result<Plan, PipelineError> {
        let sizes = sizes(&self.configs, &self.options.limits, request)?;
        let source = SigmaSource::Steps(sizes.grid_points);
        let video_schedule =
            H3Schedule::grid(&self.configs.video_scheduler, source, 0).map_err(|e| {
                invalid(format!(
                    "`steps`: no video schedule of {} points: {e}",
                    sizes.grid_points
                ))
            })?;
        let audio_schedule =
            H3Schedule::grid(&self.configs.audio_scheduler, source, 0).map_err(|e| {
                invalid(format!(
                    "`steps`: no audio schedule of {} points: {e}",
                    sizes.grid_points
                ))
            })?;
        if video_schedule.steps() != audio_schedule.steps() {
            return Err(invalid(format!(
                "`steps` {}: the video schedule (shift {}) collapses to {} steps and the audio schedule (shift {}) to \
                 {}; both step inside one forward, so choose another step count",
                sizes.grid_points,
                self.configs.video_scheduler.shift,
                video_schedule.steps(),
                self.configs.audio_scheduler.shift,
                audio_schedule.steps()
            )));
        }
        let prompt_ids = self
            .tokenizer
            .encode(&request.prompt, &self.options.text)
            .map_err(|e| {
                if e.is_invalid_request() {
                    invalid(format!("`prompt`: {e}"))
                } else {
                    PipelineError::Text(e)
                }
            })?;
        if prompt_ids.is_empty() {
            return Err(invalid("`prompt` encodes to no token; give some text"));
        }
        let text_tags = vec![TEXT_TAG; prompt_ids.len()];
        let layout = PackedLayout::build(&LayoutRequest {
            text_tags: &text_tags,
            geometry: sizes.geometry,
            patch: self.configs.dit.patch_size,
            keyframes: &[],
        })
        .map_err(|e| invalid(format!("the request does not fit one sequence: {e}")))?;
        if let Some(noise) = &request.noise {
            check_noise(noise, &sizes.noise_shape)?;
        }
        Ok(Plan {
            sizes,
            video_schedule,
            audio_schedule,
            prompt_ids,
            layout,
            patch: self.configs.dit.patch_size,
            audio: request.audio,
        })
    }

    /// Runs `request`, reporting progress; the request is checked first ([`Self::plan`]).
    pub fn generate(
        &mut self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Generation, PipelineError> {
        let plan = self.plan(request)?;
        run::generate(self, &plan, request, progress)
    }
}

/// The request's fields checked against the model and the limits, in the order a sender reads them: what is
/// refused outright, then rate, length, size and steps. Every message names the field.
fn sizes(
    configs: &Configs,
    limits: &Limits,
    request: &Request,
) -> Result<Preflight, PipelineError> {
    if let Some(path) = &request.first_frame {
        return Err(invalid(format!(
            "`first_frame` ({}): image to video is not supported yet; send a text-only request",
            path.display()
        )));
    }
    if request
        .negative_prompt
        .as_ref()
        .is_some_and(|n| !n.trim().is_empty())
    {
        return Err(invalid(
            "`negative_prompt`: MiniMax H3 is guidance-distilled (one forward per step, no unconditional branch), so \
             it takes no negative prompt; leave it empty",
        ));
    }
    if let Some(g) = request.guidance {
        if g != 1.0 {
            return Err(invalid(format!(
                "`guidance` {g}: MiniMax H3 is guidance-distilled and has no guidance scale; leave it unset (or 0)"
            )));
        }
    }
    if request.fps as usize != FPS {
        return Err(invalid(format!(
            "`fps` {}: MiniMax H3 generates {FPS} frames per second; ask for {FPS}",
            request.fps
        )));
    }
    let seconds = request.seconds;
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= limits.max_seconds) {
        return Err(invalid(format!(
            "`seconds` {seconds}: give a length above 0 and at most {} s",
            limits.max_seconds
        )));
    }
    let requested_frames = ((seconds * FPS as f64).round() as usize).max(1);
    let aligned = align_num_frames(requested_frames)
        .map_err(|e| invalid(format!("`seconds` {seconds}: {e}")))?;
    let snapped = aligned as f64 / FPS as f64;
    // The shortest 17 n + 5 whose latent frames the video VAE decodes (22 frames as released).
    let chunk = configs.video_vae.chunk_geometry();
    let min_frames = (0..64)
        .map(|n| 17 * n + 5)
        .find(|&f| latent_frames(f).is_ok_and(|l| chunk.plan(l).is_ok()))
        .ok_or_else(|| PipelineError::Internal("the video VAE decodes no short clip".into()))?;
    let shortest = min_frames as f64 / FPS as f64;
    if aligned < min_frames || snapped < limits.min_seconds || snapped > limits.max_seconds {
        return Err(invalid(format!(
            "`seconds` {seconds}: {requested_frames} frames snap up to {aligned} (17 n + 5) = {snapped:.3} s; this \
             pipeline takes {} to {} s at {FPS} fps",
            short_number(shortest.max(limits.min_seconds)),
            short_number(limits.max_seconds)
        )));
    }
    let (mh, mw) = configs.canvas_multiples();
    for (name, side, multiple) in [("width", request.width, mw), ("height", request.height, mh)] {
        if side == 0 || side > limits.max_side || !side.is_multiple_of(multiple) {
            return Err(invalid(format!(
                "`{name}` {side}: give a multiple of {multiple} from {multiple} to {}",
                limits.max_side - limits.max_side % multiple
            )));
        }
    }
    if request.width.saturating_mul(request.height) > limits.max_pixels {
        return Err(invalid(format!(
            "`width` x `height` {}x{}: at most {} pixels a frame",
            request.width, request.height, limits.max_pixels
        )));
    }
    let grid_points = request.steps.unwrap_or(DEFAULT_STEPS);
    if !(2..=limits.max_steps).contains(&grid_points) {
        return Err(invalid(format!(
            "`steps` {grid_points}: give 2 to {} (grid points, the final 0 included: N points make N - 1 model \
             calls)",
            limits.max_steps
        )));
    }
    let ratio = configs.spatial_ratio();
    let geometry = Geometry::from_latents(aligned, request.height / ratio, request.width / ratio)
        .map_err(|e| invalid(format!("`width`/`height`/`seconds`: {e}")))?;
    let noise_shape = NoiseShape::new(
        configs.dit.in_channels,
        geometry.latent_frames,
        geometry.latent_height,
        geometry.latent_width,
        geometry.audio_latents * AUDIO_CHANNELS,
        configs.dit.audio_in_channels,
    )
    .map_err(|e| invalid(format!("`width`/`height`/`seconds`: {e}")))?;
    Ok(Preflight {
        width: request.width,
        height: request.height,
        requested_frames,
        geometry,
        noise_shape,
        grid_points,
    })
}

/// Injected noise must have the request's shapes and finite values.
fn check_noise(noise: &H3Noise, shape: &NoiseShape) -> Result<(), PipelineError> {
    if noise.video.shape() != shape.video_dims() || noise.audio.shape() != shape.audio_dims() {
        return Err(invalid(format!(
            "injected noise has video {:?} and audio {:?}; this request needs {:?} and {:?}",
            noise.video.shape(),
            noise.audio.shape(),
            shape.video_dims(),
            shape.audio_dims()
        )));
    }
    if noise
        .video
        .data()
        .iter()
        .chain(noise.audio.data())
        .any(|v| !v.is_finite())
    {
        return Err(invalid("injected noise holds a non-finite value"));
    }
    Ok(())
}

/// `x` with at most three decimals and no trailing zeros (`5`, `0.917`).
fn short_number(x: f64) -> String {
    let text = format!("{x:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Seconds of a duration.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
