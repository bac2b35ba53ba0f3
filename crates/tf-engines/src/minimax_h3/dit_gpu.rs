//! The MiniMax H3 DiT on the GPU: bf16 weights and activations, f32 accumulation, cuBLASLt GEMMs, the shared
//! kernels of [`crate::nn::gpu`] (attention at head dim 128, SwiGLU) and the H3 kernels of
//! [`kernels`] (fused gated residual + RMSNorm + adaLN modulation, QK norm + partial RoPE, f32 linear layers), behind
//! the same [`H3DitBackend`] interface as the host reference.
//!
//! - Weights: a diffusers folder or the original release layout (mapped while uploading: the per-head interleaved
//!   `qkv_proj` de-interleaved, `fc1`'s `[gate; value]` swapped), every tensor checked against its spec first,
//!   streamed through the one pinned upload ring into one allocation: `q|k|v` fused as one GEMM weight, bf16
//!   everywhere except the modules the reference keeps in f32 (input projections, time embedder, output heads).
//!   Widths that are not multiples of 8 and heads narrower than 128 (tiny test models) are zero-padded on the device;
//!   the norms divide by the true widths.
//! - A forward validates its inputs ([`H3Rows`]), takes the workspace of its shape (allocated, and its GEMMs planned
//!   ahead, on first use), uploads what depends on the inputs' values (rows, row indices, RoPE tables, the
//!   sinusoid) and runs the step: eagerly the first time, afterwards (graphs on) as the CUDA graph captured for its
//!   shape. Batch items share the layout and run as one sequence of `batch * seq` rows (attention per item).
//! - No host synchronisation inside a step; the forward synchronizes once, before reading the outputs. `Drop`
//!   synchronizes the stream before anything is freed.
//! - Precision ([`DitPrecision`], shared with Qwen-Image): bf16 by default; with FP8 the chosen GEMM groups of
//!   the main blocks (`qkv`, `out`, `mlp_in` = `fc1`, `mlp_out` = `fc2`; the first and last `ends` blocks and the
//!   token refiner stay bf16) hold e4m3 weights with one f32 scale per output channel, quantized at load (on the
//!   upload ring, or from a bf16 scratch matrix on the device for zero-padded tiny models and seeded timing
//!   models), and read e4m3 activations with one scale per row written by the kernel that produces them
//!   (`nn_quant`: the gated residual + RMSNorm + modulation, SwiGLU, and a quantizing pass over the attention
//!   output), through cuBLASLt's row-wise scaled FP8 GEMM (sm_90, cuBLASLt 12.9+). The hidden and feed-forward
//!   widths are then padded to multiples of 16 (the released model's already are).
//!
//! Submodules: [`kernels`] (the H3 kernel launchers), `weights` (dimensions, device layout, placement plan, upload
//! and seeded fill), `workspace` (per-shape buffers and per-forward tables), `step` (the enqueued step, its GEMM
//! list, phase probe and graph replay) and, with the `bench` feature, `bench` (step and phase timing).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::minimax_h3::dit::{H3DitBackend, H3Inputs};
//! use tf_engines::minimax_h3::dit_gpu::GpuH3Dit;
//! use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
//!
//! let mut dit = GpuH3Dit::load(&ModelDir::open(Path::new("transformer"))?)?;
//! let inputs = H3Inputs::from_bundle(&SafetensorsFile::open(Path::new("step.safetensors"))?)?;
//! let out = dit.forward(&inputs)?;
//! println!("sample {:?}, audio_sample {:?}", out.sample.shape(), out.audio_sample.shape());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;
use std::time::Duration;

use tf_cuda::cublaslt::{AlgoSelection, PrepareReport};
use tf_cuda::{Context, DeviceBuffer, Stream};

use super::checkpoint::{self, CheckpointLayout, PRUNED_TABLE};
use super::config::{ConfigError, MiniMaxH3Config};
use super::dit::{H3DitBackend, H3Error, H3Inputs, H3Output, H3Rows};
use super::dit_host::LoadOptions;
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::fp8::RowCodes;
use crate::nn::fp8_checkpoint::Fp8Checkpoint;
use crate::nn::gpu::attention_8bit::Attention8bitKernels;
use crate::nn::gpu::gemm::{self, GemmRunner, StoredGemms};
use crate::nn::gpu::gemm_int8::{self, Int8GemmBackend, Int8GemmKernels};
use crate::nn::gpu::quant::QuantKernels;
use crate::nn::gpu::recent_set::RecentSet;
use crate::nn::gpu::{AttentionTile, GpuDevice};
pub use crate::nn::precision::{DitPrecision, Fp8Accumulation, Fp8Groups, Fp8Layers};
use crate::nn::tensor::Tensor;
use crate::nn::upload::{StagingConfig, UploadStats};
use crate::nn::weights::ModelDir;

/// H3's `fp8` (the default 8-bit mode): every block's four GEMM groups in INT8 on our scaled INT8 GEMM (`gemm=int8`:
/// INT8 weights with per-output-channel scales, per-token INT8 activations written by the kernels that produce them),
/// the first and last block included (`ends=0`), and the adaLN projections weight-only in INT8 (`adaln=int8`).
/// Chosen from the error of each mode against the bf16 floor at full width and its step at S = 6026 (docs/ENGINES.md,
/// "MiniMax H3 DiT in FP8"; docs/RESULTS.md, seventy-fourth and seventy-fifth calls, an H100): 3.53x / 3.47x the floor
/// and 298.8-303.3 ms a step, against 3.96x / 3.90x and 321.1-322.4 ms for the e4m3 mode it replaces
/// (`fp8:qkv,out,mlp_value,mlp_gate=int8,mlp_out,adaln=int8,ends=1`, still available by name). INT8 rounds a third as
/// coarsely as e4m3 on rows without outliers, which buys the end blocks; our INT8 GEMM runs at 0.88-0.97 of
/// cuBLASLt's row-wise FP8 time. Both need an sm_90 GPU.
pub const DEFAULT_FP8: Fp8Layers = Fp8Layers {
    groups: Fp8Groups {
        adaln: Some(RowCodes::Int8),
        gemm_codes: RowCodes::Int8,
        ..Fp8Groups::ALL
    },
    bf16_ends: 0,
    accumulation: Fp8Accumulation::Fast,
    attention: crate::nn::precision::AttentionPrecision::Bf16,
};

/// H3's e4m3 mode (the default before [`DEFAULT_FP8`]): `qkv`, `out`, `mlp_out` and the value half of `mlp_in` in
/// e4m3 on cuBLASLt, the gate half as an INT8 GEMM, the adaLN projections weight-only in INT8, the first and last
/// block in bf16 (3.96x / 3.90x the floor). A checkpoint that stores its weights in e4m3 runs `fp8` in this mode
/// ([`for_checkpoint`]): `gemm=int8` would not re-round the file's codes (their blocks stay e4m3), and every block's
/// groups in e4m3 are past the 4x criterion.
pub const E4M3_FP8: Fp8Layers = Fp8Layers {
    groups: Fp8Groups {
        mlp_gate: false,
        mlp_gate_int8: true,
        adaln: Some(RowCodes::Int8),
        ..Fp8Groups::ALL
    },
    bf16_ends: 1,
    accumulation: Fp8Accumulation::Fast,
    attention: crate::nn::precision::AttentionPrecision::Bf16,
};

/// [`resolve_precision`] for a checkpoint that stores weights in e4m3 or not (`stores_e4m3`): on such a file `fp8`
/// (the model default, as typed) becomes [`E4M3_FP8`] (with the default's adaLN rule); a mode named in full, the
/// default's spelling included, is kept, its stored e4m3 blocks staying e4m3.
pub fn for_checkpoint(
    config: &MiniMaxH3Config,
    precision: DitPrecision,
    stores_e4m3: bool,
) -> DitPrecision {
    let resolved = resolve_precision(config, precision);
    if !stores_e4m3 || precision != DitPrecision::FP8 {
        return resolved;
    }
    let mut e4m3 = DitPrecision::Fp8(E4M3_FP8);
    if let (DitPrecision::Fp8(l), DitPrecision::Fp8(d)) = (&mut e4m3, resolved) {
        l.groups.adaln = d.groups.adaln;
    }
    e4m3
}

/// `precision` with `fp8` (the model default) replaced by [`DEFAULT_FP8`] for a model of `config`: its INT8 adaLN
/// projections need the weight-only kernel's widest row ([`kernels::LINEAR_W8_MAX_K`] inputs), so a model with a
/// wider time embedding keeps them bf16 in the default (a mode that names `adaln` is refused at load instead).
pub fn resolve_precision(config: &MiniMaxH3Config, precision: DitPrecision) -> DitPrecision {
    let mut resolved = precision.resolve(DEFAULT_FP8);
    if let (DitPrecision::Fp8ModelDefault, DitPrecision::Fp8(layers)) = (precision, &mut resolved) {
        if config.time_embed_dim.next_multiple_of(16) > kernels::LINEAR_W8_MAX_K {
            layers.groups.adaln = None;
        }
    }
    resolved
}

#[cfg(feature = "bench")]
mod bench;
pub mod kernels;
pub mod parallel;
mod step;
mod weights;
mod workspace;

use kernels::H3Kernels;
pub use weights::CheckpointFp8Use;
use weights::{Dims, Source, WeightOffsets};
use workspace::{ShapeKey, Workspace};

/// Most distinct timestep values a schedule ([`GpuH3Dit::set_timestep_schedule`]) may hold: its tables take about
/// 9.7 MB a value at full size (50 blocks), 1.2 GB at this bound. The pipeline's default 49 steps hold 97 (a video
/// and an audio value each, one step's two equal).
pub const MAX_SCHEDULE_TIMESTEPS: usize = 128;
/// Graphs kept per workspace: the whole step and the step without its timestep tables (see
/// [`GpuH3Dit::set_timestep_schedule`]).
const MAX_GRAPHS: usize = 2;
/// Workspaces kept (one per shape, least recently used dropped first).
const MAX_WORKSPACES: usize = 2;
/// Time a new shape may spend timing GEMM algorithms the plan cache does not hold yet, before its first step (a
/// shape whose neighbour in `m` is stored takes that choice instead, untimed: a new prompt length is not timed).
pub const FIRST_USE_GEMM_BUDGET: Duration = Duration::from_secs(20);
/// GEMM algorithm choice: timed, but only where planned ahead (a new shape is planned before its first step) or
/// found in the persistent plan cache; `TF_GEMM_SELECTION=heuristic` takes cuBLASLt's first result everywhere.
pub const DEFAULT_GEMM_SELECTION: AlgoSelection = gemm::TIMED;

fn cuda_err(what: &str) -> impl FnOnce(tf_cuda::Error) -> H3Error + '_ {
    move |e| H3Error::Gpu(gpu_error(what, e))
}

/// A GPU failure of any cause the backend meets (runtime, cuBLASLt, kernels, upload), kept typed.
fn gpu_err<E: IntoGpuError>(what: &str) -> impl FnOnce(E) -> H3Error + '_ {
    move |e| H3Error::Gpu(gpu_error(what, e))
}

/// Device times of one forward's step (milliseconds per step) and the process's peak of device memory held
/// in buffers (weights, workspaces, cuBLASLt's workspace) since the last `tf_cuda::usage::reset_peaks`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct H3StepTimes {
    pub eager_ms: f64,
    pub graph_ms: f64,
    pub peak_device_bytes: u64,
}

/// Device times of a step on a request's timestep schedule ([`GpuH3Dit::set_timestep_schedule`]), milliseconds:
/// making the tables of the whole schedule (once per request), and the step without them, eager and replayed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct H3ScheduleTimes {
    /// Distinct timestep values of the schedule.
    pub timesteps: usize,
    pub tables_ms: f64,
    pub body_eager_ms: f64,
    pub body_graph_ms: f64,
}

/// Read-only state a step uses.
struct Engine {
    config: MiniMaxH3Config,
    dims: Dims,
    ctx: Context,
    /// Shared with the communicator of a sequence-parallel run, whose collectives run on it.
    stream: Arc<Stream>,
    kernels: H3Kernels,
    tile: AttentionTile,
    gemms: GemmRunner,
    weights: DeviceBuffer,
    offsets: WeightOffsets,
    precision: DitPrecision,
    /// Per main block, the GEMM groups in FP8.
    fp8_groups: Vec<Fp8Groups>,
    /// The quantizing kernels, loaded when some block runs in FP8.
    quant: Option<QuantKernels>,
    /// The 8-bit attention kernels, loaded when some main block runs its attention in 8 bits (`attn=int8-fp8`).
    attention8: Option<Attention8bitKernels>,
    /// Our INT8 GEMM, loaded when the INT8 gate runs through it (`TF_INT8_GEMM=ours`) instead of cuBLASLt.
    int8_gemm: Option<Int8GemmKernels>,
    /// The same set for the bf16 GEMMs without bias when `TF_BF16_GEMM=ours` (its bf16 kernel instead of cuBLASLt).
    bf16_gemm: Option<Int8GemmKernels>,
    /// The SwiGLU in the INT8 fc1 GEMM's epilogue where a block's MLP runs in INT8 (the default;
    /// `TF_SWIGLU_GEMM=apart` runs the SwiGLU kernel).
    swiglu_fused: bool,
    /// The main rows' QK norm and RoPE in the INT8 q|k|v GEMM's epilogue where that group runs in INT8 (the default;
    /// `TF_QKV_GEMM=apart` runs the pass).
    qkv_fused: bool,
    /// This rank's communicator when the step runs sequence-parallel ([`parallel`]).
    parallel: Option<parallel::SpState>,
}

/// The GPU DiT backend.
pub struct GpuH3Dit {
    engine: Engine,
    workspaces: RecentSet<Workspace>,
    use_graphs: bool,
    layout: Option<CheckpointLayout>,
    upload: Option<UploadStats>,
    /// The checkpoint's FP8 weights: how many, used as stored, dequantized.
    checkpoint_fp8: CheckpointFp8Use,
    /// The timestep values of the request under way ([`GpuH3Dit::set_timestep_schedule`]; empty: none).
    schedule: Vec<f32>,
    /// Forwards that made their timestep tables ([`GpuH3Dit::timestep_tables_made`]).
    tables_made: u64,
}

impl std::fmt::Debug for GpuH3Dit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuH3Dit")
            .field("config", &self.engine.config)
            .field("layout", &self.layout)
            .field("workspaces", &self.workspaces.len())
            .field("use_graphs", &self.use_graphs)
            .finish_non_exhaustive()
    }
}

impl Drop for GpuH3Dit {
    fn drop(&mut self) {
        // Work still queued (after an error mid-step) must not outlive the buffers it reads. On a lost context this
        // fails fast without calling the driver (tf-cuda checks its health first), and the buffers leak.
        let _ = self.engine.stream.synchronize();
    }
}

/// Refuses a pruned original-layout checkpoint, naming the table.
fn check_pruned(model: &ModelDir) -> Result<(), H3Error> {
    if let Ok(info) = model.info(PRUNED_TABLE) {
        return Err(H3Error::Checkpoint {
            file: model.file_of(PRUNED_TABLE)?.path().display().to_string(),
            tensor: PRUNED_TABLE.into(),
            why: format!(
                "a pruned checkpoint (shape {:?} instead of the time embedder) is not supported; use the unpruned release",
                info.shape
            ),
        });
    }
    Ok(())
}

/// Refuses FP8 where it cannot run: cuBLASLt's row-wise scaled FP8 GEMM needs sm_90 and cuBLASLt 12.9.
fn check_fp8_support(ctx: &Context, gemms: &GemmRunner) -> Result<(), H3Error> {
    let info = ctx
        .device_info()
        .map_err(cuda_err("reading the device's compute capability"))?;
    if let Some(why) = gemms.fp8_refusal(&info.name, info.compute_capability) {
        return Err(H3Error::Backend(why));
    }
    Ok(())
}

/// What making the device weights reported: the upload's measurements and the checkpoint's FP8 weights' fate.
struct DeviceWeightsReport {
    upload: Option<UploadStats>,
    checkpoint_fp8: CheckpointFp8Use,
}

/// What a weights maker gets from the engine under construction.
struct Makers<'e> {
    stream: &'e Stream,
    kernels: &'e H3Kernels,
    quant: Option<&'e QuantKernels>,
    plan: &'e weights::WeightPlan,
}

impl Engine {
    /// The engine of `config` on `device` in `precision` around weights made by `make`.
    fn new(
        device: &GpuDevice,
        config: MiniMaxH3Config,
        source: Source,
        precision: DitPrecision,
        stored: Option<&Fp8Checkpoint>,
        make: impl FnOnce(&Makers<'_>) -> Result<weights::DeviceWeights, H3Error>,
    ) -> Result<(Engine, DeviceWeightsReport), H3Error> {
        let precision = for_checkpoint(&config, precision, stored.is_some_and(|c| !c.is_empty()));
        let layers = config.num_layers;
        let mut fp8_groups: Vec<Fp8Groups> = (0..layers)
            .map(|l| precision.groups_of(l, layers))
            .collect();
        let fp8 = fp8_groups.iter().any(|g| g.any());
        let mut dims = Dims::of_for(&config, fp8)?;
        dims.attention8 = precision.uses_8bit_attention(layers);
        dims.adaln8 = fp8_groups.iter().any(|g| g.adaln.is_some());
        dims.gate_int8 = fp8_groups.iter().any(|g| g.mlp_gate_int8);
        if dims.adaln8 && dims.temb_p > kernels::LINEAR_W8_MAX_K {
            return Err(H3Error::Backend(format!(
                "--precision {precision}: the adaLN projections in 8 bits read at most {} inputs a row \
                 (time_embed_dim is {}): leave `adaln` out of --precision",
                kernels::LINEAR_W8_MAX_K,
                config.time_embed_dim
            )));
        }
        let mut plan = weights::plan(&config, &dims, source, &fp8_groups)?;
        // A weight the checkpoint stores in e4m3 never becomes INT8 (that would round the file's codes again).
        let mut kept = weights::KeptCodes::default();
        if let Some(checkpoint) = stored {
            kept = weights::keep_stored_codes(&mut fp8_groups, &plan, checkpoint);
            if kept.any() {
                plan = weights::plan(&config, &dims, source, &fp8_groups)?;
            }
        }
        let ctx = device.context();
        let stream = Arc::clone(device.stream());
        let kernels = H3Kernels::load(ctx).map_err(gpu_err("loading the H3 DiT kernels"))?;
        let gemms =
            GemmRunner::new(ctx, DEFAULT_GEMM_SELECTION).map_err(gpu_err("opening cuBLASLt"))?;
        let quant = if fp8 {
            check_fp8_support(ctx, &gemms)?;
            Some(QuantKernels::load(ctx).map_err(gpu_err("loading the FP8 quantizing kernels"))?)
        } else {
            None
        };
        let attention8 = if dims.attention8 {
            Some(Attention8bitKernels::load(ctx).map_err(gpu_err(
                "loading the 8-bit attention kernels (attn=int8-fp8)",
            ))?)
        } else {
            None
        };
        let scaled_int8 = fp8_groups
            .iter()
            .any(|g| g.any_gemm() && g.gemm_codes == RowCodes::Int8);
        let int8_gemm = match Int8GemmBackend::from_env().map_err(H3Error::Backend)? {
            _ if scaled_int8 => Some(Int8GemmKernels::load(ctx).map_err(gpu_err(
                "loading our INT8 GEMM (gemm=int8 runs every 8-bit GEMM group on it; it needs an sm_90 GPU)",
            ))?),
            Int8GemmBackend::Ours if dims.gate_int8 => Some(
                Int8GemmKernels::load(ctx)
                    .map_err(gpu_err("loading our INT8 GEMM (TF_INT8_GEMM=ours)"))?,
            ),
            _ => None,
        };
        let bf16_gemm = match Int8GemmBackend::bf16_from_env().map_err(H3Error::Backend)? {
            Int8GemmBackend::Ours => Some(
                Int8GemmKernels::load(ctx)
                    .map_err(gpu_err("loading our bf16 GEMM (TF_BF16_GEMM=ours)"))?,
            ),
            Int8GemmBackend::Cublaslt => None,
        };
        // The epilogues run on our INT8 GEMM where a group runs in INT8, on our bf16 GEMM where a bf16 one does.
        let epilogue_gemm = int8_gemm.as_ref().or(bf16_gemm.as_ref());
        let swiglu_fused =
            gemm_int8::swiglu_fused_for(epilogue_gemm, dims.fp).map_err(H3Error::Backend)?;
        let qkv_fused =
            gemm_int8::qkv_fused_for(epilogue_gemm, dims.width).map_err(H3Error::Backend)?;
        let made = make(&Makers {
            stream: &stream,
            kernels: &kernels,
            quant: quant.as_ref(),
            plan: &plan,
        })?;
        Ok((
            Engine {
                config,
                dims,
                ctx: ctx.clone(),
                stream,
                tile: kernels.preferred_tile(),
                kernels,
                gemms,
                weights: made.buffer,
                offsets: plan.offsets,
                precision,
                fp8_groups,
                quant,
                attention8,
                int8_gemm,
                bf16_gemm,
                swiglu_fused,
                qkv_fused,
                parallel: None,
            },
            DeviceWeightsReport {
                upload: made.upload,
                checkpoint_fp8: CheckpointFp8Use {
                    kept,
                    ..made.checkpoint_fp8
                },
            },
        ))
    }
}

impl GpuH3Dit {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuH3Dit, H3Error> {
        let driver = tf_cuda::open_driver().map_err(cuda_err("opening the CUDA driver"))?;
        let ctx = Context::new(driver, 0).map_err(cuda_err("creating a context on device 0"))?;
        GpuH3Dit::load_on(&ctx, model)
    }

    /// Loads `model` (a diffusers or original-layout folder) into `ctx`: validates the config and every tensor,
    /// uploads the weights, loads the kernels and cuBLASLt.
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuH3Dit, H3Error> {
        GpuH3Dit::load_with(ctx, model, LoadOptions::default(), StagingConfig::default())
    }

    /// [`GpuH3Dit::load_on`] with the host loader's options (the qkv order of an original folder) and a staging
    /// geometry for the upload ring.
    pub fn load_with(
        ctx: &Context,
        model: &ModelDir,
        options: LoadOptions,
        staging: StagingConfig,
    ) -> Result<GpuH3Dit, H3Error> {
        let device = GpuDevice::on(ctx).map_err(cuda_err("creating a stream"))?;
        GpuH3Dit::load_in(&device, model, options, staging, DitPrecision::Bf16)
    }

    /// [`GpuH3Dit::load_with`] in the given GEMM precision: with FP8 the chosen block GEMM groups are quantized on
    /// their way to the device (and the quantizing kernels loaded), or taken as stored where the folder already
    /// holds them in e4m3 with their scales (a scaled-FP8 checkpoint; its other FP8 weights are dequantized). FP8 needs an sm_90 GPU and cuBLASLt 12.9 or
    /// newer; anything else is refused here, naming what is missing.
    /// Every step runs on `device`'s stream (a pipeline's components share it).
    pub fn load_in(
        device: &GpuDevice,
        model: &ModelDir,
        options: LoadOptions,
        staging: StagingConfig,
        precision: DitPrecision,
    ) -> Result<GpuH3Dit, H3Error> {
        let ctx = device.context();
        let config =
            MiniMaxH3Config::from_json_file(model.config_json(), &model.dir().join("config.json"))?;
        let layout = checkpoint::detect(model, options.qkv);
        let source = match layout {
            CheckpointLayout::Diffusers => Source::Diffusers,
            CheckpointLayout::Original(qkv) => {
                check_pruned(model)?;
                Source::Original(qkv)
            }
        };
        // Weights stored in FP8 with their scales are found and checked with the names and shapes.
        let fp8_checkpoint = checkpoint::check_folder(model, &config, layout)?;
        let (engine, report) = Engine::new(
            device,
            config,
            source,
            precision,
            Some(&fp8_checkpoint),
            |m| {
                weights::upload(
                    ctx,
                    m.stream,
                    m.quant,
                    model,
                    &fp8_checkpoint,
                    m.plan,
                    staging,
                )
            },
        )?;
        Ok(GpuH3Dit {
            engine,
            workspaces: RecentSet::new(MAX_WORKSPACES),
            use_graphs: true,
            layout: Some(layout),
            upload: report.upload,
            schedule: Vec::new(),
            tables_made: 0,
            checkpoint_fp8: report.checkpoint_fp8,
        })
    }

    /// Full-size timing without a checkpoint: every weight made on the device from `seed` (uniform, scaled like a
    /// default init: `+-1/sqrt(fan_in)` for linear layers, `1 +- 0.05` for norm weights, so activations stay finite
    /// through every block); says nothing about accuracy.
    pub fn random_on(
        ctx: &Context,
        config: &MiniMaxH3Config,
        seed: u64,
    ) -> Result<GpuH3Dit, H3Error> {
        let device = GpuDevice::on(ctx).map_err(cuda_err("creating a stream"))?;
        GpuH3Dit::random_in(&device, config, seed, DitPrecision::Bf16)
    }

    /// [`GpuH3Dit::random_on`] in the given GEMM precision: each FP8 matrix is seeded in bf16 (the values its bf16
    /// twin holds) in one scratch matrix on the device and quantized from there, so the bf16 model never exists.
    /// Every step runs on `device`'s stream.
    pub fn random_in(
        device: &GpuDevice,
        config: &MiniMaxH3Config,
        seed: u64,
        precision: DitPrecision,
    ) -> Result<GpuH3Dit, H3Error> {
        let ctx = device.context();
        config.validate().map_err(|why| ConfigError {
            file: "config".into(),
            why,
        })?;
        let (engine, _) = Engine::new(
            device,
            config.clone(),
            Source::Diffusers,
            precision,
            None,
            |m| weights::random(ctx, m.stream, m.kernels, m.quant, m.plan, seed),
        )?;
        Ok(GpuH3Dit {
            engine,
            workspaces: RecentSet::new(MAX_WORKSPACES),
            use_graphs: true,
            layout: None,
            upload: None,
            checkpoint_fp8: CheckpointFp8Use::default(),
            schedule: Vec::new(),
            tables_made: 0,
        })
    }

    /// The context the model lives in.
    pub fn context(&self) -> &Context {
        &self.engine.ctx
    }

    /// Turns CUDA graph capture and replay on (the default) or off (every step eager).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.use_graphs = enabled;
    }

    /// How the GEMM algorithm of a new shape is chosen ([`DEFAULT_GEMM_SELECTION`] unless set); shapes already
    /// planned keep theirs. `AlgoSelection::Heuristic` gives every process (and every model instance) the same
    /// algorithms without a plan cache.
    pub fn set_gemm_selection(&self, selection: AlgoSelection) -> Result<(), H3Error> {
        self.engine
            .gemms
            .set_algo_selection(selection)
            .map_err(gpu_err("setting the GEMM selection"))
    }

    /// Bytes of the device weight allocation (resident weights: e4m3 codes and their scales where FP8).
    pub fn weight_bytes(&self) -> u64 {
        self.engine.weights.len() as u64
    }

    /// The GEMM precision the model was loaded in.
    pub fn precision(&self) -> DitPrecision {
        self.engine.precision
    }

    /// What a load report says about the precision: where FP8 runs, or bf16; and, for a checkpoint that stores
    /// weights in FP8 with their scales, how many there are, how many went to the device as stored and how many
    /// were dequantized.
    pub fn describe_precision(&self) -> String {
        let mut precision = self
            .engine
            .precision
            .describe(self.engine.config.num_layers);
        if self.engine.int8_gemm.is_some() && self.engine.dims.gate_int8 {
            precision.push_str(
                "; the INT8 gate through our INT8 GEMM (TF_INT8_GEMM=ours, bf16 products) where its shape fits",
            );
        }
        if self.checkpoint_fp8.stored == 0 {
            return precision;
        }
        format!("{precision}; {}", self.checkpoint_fp8.describe())
    }

    /// The checkpoint's FP8 weights: how many the folder stores, used as stored, dequantized (zeros for a float
    /// checkpoint or a seeded model).
    pub fn checkpoint_fp8(&self) -> CheckpointFp8Use {
        self.checkpoint_fp8
    }

    /// Device bytes of the workspaces held now (one per shape seen, at most two).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspaces.iter().map(|w| w.sizes.total() as u64).sum()
    }

    /// Which layout the folder held (`None` for a seeded model).
    pub fn checkpoint_layout(&self) -> Option<CheckpointLayout> {
        self.layout
    }

    /// What the weight upload moved and how fast (`None` for a seeded model).
    pub fn upload_stats(&self) -> Option<UploadStats> {
        self.upload
    }

    /// Frees every workspace and captured graph (weights stay).
    pub fn clear_workspaces(&mut self) {
        self.workspaces.clear();
    }

    /// Plans the GEMMs of the steps of `inputs` ahead of them: choices stored in the persistent plan cache are
    /// reused, unseen shapes are timed within `budget` (under timed selection); afterwards no GEMM is timed inside a
    /// step. A shape's first forward does this by itself (within [`FIRST_USE_GEMM_BUDGET`]).
    pub fn prepare_gemms(
        &self,
        inputs: &[&H3Inputs],
        budget: Duration,
    ) -> Result<PrepareReport, H3Error> {
        let mut shapes = Vec::new();
        for i in inputs {
            let rows = H3Rows::build(&self.engine.config, i)?;
            shapes.extend(self.engine.gemm_shapes(&ShapeKey::of(&rows))?);
        }
        self.engine
            .gemms
            .prepare(&gemm::distinct(shapes), budget, &self.engine.stream)
            .map_err(gpu_err("planning the GEMMs ahead"))
    }

    /// The workspace of `rows`' shape, made (and its GEMMs planned) on first use.
    fn workspace_index(&mut self, rows: &H3Rows) -> Result<usize, H3Error> {
        let key = ShapeKey::of(rows);
        let engine = &self.engine;
        // A full set drops its least recently used workspace before this one is planned and allocated (a freed
        // buffer waits for the device first).
        self.workspaces.find_or_make(
            |w| w.key == key,
            || {
                let shapes = engine.gemm_shapes(&key)?;
                engine
                    .gemms
                    .prepare_first_use(&shapes, FIRST_USE_GEMM_BUDGET, &engine.stream)
                    .map_err(gpu_err("planning the step's GEMMs"))?;
                Workspace::new(&engine.ctx, &engine.dims, key)
            },
        )
    }

    /// Validates `inputs`, takes their workspace and uploads what depends on their values (on the stream).
    /// Also returns the timestep values (f32 bits) whose tables the step reads: the schedule's when it holds every
    /// timestep of `inputs`, else the forward's own.
    fn prepare(&mut self, inputs: &H3Inputs) -> Result<(usize, Vec<u32>), H3Error> {
        let mut rows = H3Rows::build(&self.engine.config, inputs)?;
        if let Some(on_schedule) = rows.on_schedule(&self.schedule) {
            rows = on_schedule;
        }
        let index = self.workspace_index(&rows)?;
        self.engine
            .upload_inputs(&mut self.workspaces[index], &rows, inputs)?;
        Ok((index, rows.timesteps.iter().map(|t| t.to_bits()).collect()))
    }

    /// How many forwards made their timestep tables (the others read tables a schedule's first step made).
    pub fn timestep_tables_made(&self) -> u64 {
        self.tables_made
    }

    /// [`H3DitBackend::set_timestep_schedule`]: with a schedule, every step whose timesteps it holds runs on one
    /// workspace whose timestep tables (the time embedder, 50 blocks' adaLN tables, the output modulation) cover
    /// the whole schedule. The first such step makes them, in one GEMM per block over all the schedule's values
    /// (the adaLN weights, 26 GB in bf16 at full size, read once per request instead of once per step); later
    /// steps skip that phase (their graph leaves it out). Values must be finite; repeats are dropped; more than
    /// [`MAX_SCHEDULE_TIMESTEPS`] distinct values, or a sequence-parallel DiT, leave the schedule unused (`false`).
    pub fn set_timestep_schedule(&mut self, timesteps: &[f32]) -> Result<bool, H3Error> {
        self.schedule.clear();
        if let Some(bad) = timesteps.iter().find(|t| !t.is_finite()) {
            return Err(H3Error::Input(format!(
                "the timestep schedule holds {bad}; timesteps are finite"
            )));
        }
        let mut distinct: Vec<f32> =
            Vec::with_capacity(timesteps.len().min(MAX_SCHEDULE_TIMESTEPS));
        for &t in timesteps {
            if !distinct.iter().any(|d| d.to_bits() == t.to_bits()) {
                if distinct.len() == MAX_SCHEDULE_TIMESTEPS {
                    return Ok(false);
                }
                distinct.push(t);
            }
        }
        if self.engine.parallel.is_some() || distinct.is_empty() {
            return Ok(false);
        }
        self.schedule = distinct;
        Ok(true)
    }
}

impl H3DitBackend for GpuH3Dit {
    fn config(&self) -> &MiniMaxH3Config {
        &self.engine.config
    }

    fn attach_sequence_parallel(&mut self, sp: &parallel::SequenceParallel) -> Result<(), H3Error> {
        self.attach(sp)
    }

    fn release_workspaces(&mut self) {
        // Every forward synchronizes its stream before returning, so no queued work reads these buffers.
        self.clear_workspaces();
    }

    fn set_timestep_schedule(&mut self, timesteps: &[f32]) -> Result<bool, H3Error> {
        GpuH3Dit::set_timestep_schedule(self, timesteps)
    }

    fn prepare_stored_gemms(&mut self) -> Result<Option<StoredGemms>, H3Error> {
        self.engine
            .gemms
            .prepare_stored(&self.engine.stream)
            .map(Some)
            .map_err(gpu_err("planning the plan cache's stored GEMM shapes"))
    }

    fn forward(&mut self, inputs: &H3Inputs) -> Result<H3Output, H3Error> {
        if self.engine.parallel.is_some() {
            return self.forward_parallel(inputs);
        }
        let (index, timesteps) = self.prepare(inputs)?;
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        // The tables are made again unless the workspace holds those of these very values (a schedule's).
        let tables = ws.tables_for.as_ref() != Some(&timesteps);
        ws.tables_for = None;
        self.tables_made += u64::from(tables);
        if self.use_graphs && ws.warmed {
            engine.replay(ws, tables)?;
        } else if tables {
            engine.enqueue_step(ws, &mut step::NoProbe)?;
            ws.warmed = true;
        } else {
            engine.enqueue_body(ws, &mut step::NoProbe)?;
            ws.warmed = true;
        }
        ws.tables_for = Some(timesteps);
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the H3 DiT step"))?;
        let download = |buf: &DeviceBuffer, what: &str| -> Result<Vec<f32>, H3Error> {
            if buf.is_empty() {
                return Ok(Vec::new());
            }
            buf.to_vec().map_err(cuda_err(what))
        };
        let key = ws.key;
        let d = &engine.dims;
        Ok(H3Output {
            sample: Tensor::new(
                vec![key.batch, key.video, d.video],
                download(&ws.sample, "downloading the sample")?,
            )?,
            audio_sample: Tensor::new(
                vec![key.batch, key.audio, d.audio],
                download(&ws.audio_sample, "downloading the audio sample")?,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::fp8::RowCodes;

    #[test]
    fn the_default_keeps_adaln_in_bf16_only_where_the_kernel_cannot_take_it() {
        let release = MiniMaxH3Config::default_full_size();
        let groups = |p: DitPrecision| match p {
            DitPrecision::Fp8(l) => l.groups,
            other => panic!("{other:?}"),
        };
        let default = resolve_precision(&release, DitPrecision::FP8);
        assert_eq!(default, DitPrecision::Fp8(DEFAULT_FP8));
        assert_eq!(groups(default).adaln, Some(RowCodes::Int8));
        assert_eq!(groups(default).gemm_codes, RowCodes::Int8);
        assert!(groups(default).mlp_in() && !groups(default).mlp_gate_int8);
        assert_eq!(
            default.to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,adaln=int8,ends=0,gemm=int8"
        );
        let wide = MiniMaxH3Config {
            time_embed_dim: kernels::LINEAR_W8_MAX_K + 16,
            ..release.clone()
        };
        let on_wide = groups(resolve_precision(&wide, DitPrecision::FP8));
        assert_eq!(on_wide.adaln, None);
        assert_eq!(
            on_wide,
            Fp8Groups {
                adaln: None,
                ..DEFAULT_FP8.groups
            }
        );
        // A checkpoint stored in e4m3 runs `fp8` as the e4m3 mode (with the same adaLN rule); a named mode, the
        // default's own spelling included, or a float checkpoint, keeps what was resolved.
        assert_eq!(
            for_checkpoint(&release, DitPrecision::FP8, true),
            DitPrecision::Fp8(E4M3_FP8)
        );
        assert_eq!(for_checkpoint(&release, DitPrecision::FP8, false), default);
        assert_eq!(for_checkpoint(&release, default, true), default);
        let e4m3_wide = for_checkpoint(&wide, DitPrecision::FP8, true);
        assert_eq!(groups(e4m3_wide).adaln, None);
        assert_eq!(groups(e4m3_wide).gemm_codes, RowCodes::E4m3);
        let all_int8: DitPrecision = "fp8:all,ends=1,gemm=int8".parse().unwrap();
        assert_eq!(for_checkpoint(&release, all_int8, true), all_int8);
        // A named mode is kept as typed (the load refuses it with the reason), and bf16 stays bf16.
        let named: DitPrecision = "fp8:qkv,adaln=int8,ends=1".parse().unwrap();
        assert_eq!(resolve_precision(&wide, named), named);
        assert_eq!(
            resolve_precision(&release, DitPrecision::Bf16),
            DitPrecision::Bf16
        );
    }
}
