//! The Qwen-Image 2.1 DiT on the GPU: bf16 storage, f32 accumulation, cuBLASLt GEMMs and the qwen_image kernels
//! ([`crate::nn::gpu`]), behind the same [`DitBackend`] interface as the host reference.
//!
//! - Weights stream from the safetensors map through pinned staging ([`crate::nn::upload`]) into one device
//!   allocation, in fused layouts: `q|k|v` as one `[3W, D]` weight, `gate|up` as one `[2F, D]`, and the shared
//!   modulation with the output norm as one `[5D, D]` (`scale1|gate1|scale2|gate2|out_scale`).
//! - Heads narrower than the kernels' 128 (the tiny test models) are zero-padded to 128 at upload; q and k rows
//!   are scaled by `sqrt(128 / head_dim)` and the QK-norm weights by the inverse, so the 128-wide RMSNorm sees
//!   the true mean square and the padded channels stay zero. Full-size models (head_dim 128) upload as stored.
//! - A forward uploads its inputs and the step's scalars (timesteps, in device memory), then runs the step:
//!   eagerly the first time a workspace is used, afterwards (with graphs on) as a CUDA graph captured once per
//!   (workspace, KV cache binding: the cache buffer's address, size and shape) and replayed; a later request whose
//!   cache lands at the same binding replays the same graph. The graph of an eager step is captured while the device
//!   runs that step (host time that would otherwise be spent waiting); a binding met in a replay is captured then.
//!   Workspaces are allocated once per joint layout and mode.
//! - The KV cache is `[layer][k|v][batch][prefix][heads * 128]` bf16 on the device, post-norm and post-RoPE.
//! - Masks: block-causal as per-query key limits, padded text rows as one key range per sample; padding in several
//!   ranges (full and extract steps) runs attention over the valid keys gathered per sample.
//!
//! - Precision ([`DitPrecision`]): bf16 by default; with FP8 the chosen block GEMM groups hold e4m3 weights with
//!   per-output-channel scales (quantized at load on the upload ring) and read e4m3 activations with per-token
//!   scales written by the kernel that produces them (`nn_quant`), through cuBLASLt's row-wise scaled FP8 GEMM
//!   (sm_90, cuBLASLt 12.9+). Everything else stays bf16.
//!
//! Invariant: no host synchronisation inside a step; the only syncs are after the step, before reading results.
//!
//! Submodules: `weights` (fused layout, head padding, upload, FP8 quantization; which GEMMs run in FP8 is
//! [`crate::nn::precision`]), `kv` (the device KV cache and its host conversion), `workspace` (per-layout buffers, mask and RoPE
//! tables, key compaction), `step` (the enqueued step and its graph replay) and, with the `bench` feature,
//! `bench` (step and phase timers).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::dit::{DitBackend, DitInputs, KvStep};
//! use tf_engines::qwen_image::dit_gpu::GpuDit;
//! use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
//!
//! let mut dit = GpuDit::load(&ModelDir::open(Path::new("transformer"))?)?;
//! println!("weights: {}", dit.load_stats());
//! let inputs = DitInputs::from_bundle(&SafetensorsFile::open(Path::new("step0.safetensors"))?)?;
//! let out = dit.forward(&inputs, KvStep::Extract)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use tf_cuda::cublaslt::{AlgoSelection, DeviceSpan, PlanChoice};
use tf_cuda::{Context, DeviceBuffer, Stream};

use super::config::{QwenImageDitConfig, TIMESTEP_DIM};
use super::dit::{
    check_folder, DitBackend, DitError, DitInputs, DitOutput, HostKvCache, JointLayout, KvMode,
    KvStep,
};
use super::ops::DitKernels;
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::fp8::RowCodes;
use crate::nn::gpu::attention_8bit::Attention8bitKernels;
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, GemmShape, StoredGemms};
use crate::nn::gpu::gemm_int8::{self, Int8GemmBackend, Int8GemmKernels};
use crate::nn::gpu::quant::QuantKernels;
use crate::nn::gpu::recent_set::RecentSet;
use crate::nn::gpu::spare_buffers::SpareBuffers;
use crate::nn::gpu::{AttentionTile, GpuDevice, HEAD_DIM};
use crate::nn::host_work;
use crate::nn::tensor::Tensor;
use crate::nn::upload::{StagingConfig, UploadStats};
use crate::nn::weights::{le_bytes, ModelDir, BF16};

#[cfg(feature = "bench")]
mod bench;
mod kv;
mod step;
mod weights;
mod workspace;

pub use crate::nn::precision::{DitPrecision, Fp8Accumulation, Fp8Groups, Fp8Layers};
#[cfg(feature = "bench")]
pub use bench::StepTimes;
pub use kv::GpuKvCache;
use weights::{Dims, WeightOffsets};
use workspace::{runs, Workspace};

/// Graphs kept per workspace (one per KV cache binding used with it).
const MAX_GRAPHS: usize = 4;
/// Workspaces kept (one per step shape: the KV mode and the joint layout, which holds the text length; least
/// recently used dropped first). A guided request uses four (extract and cached, for the prompt and the negative
/// prompt), so a warm worker keeps every shape of a repeated request; a new prompt length costs new workspaces,
/// never more device memory than four of them. The one a full set gives up lends its buffers to the new one
/// ([`SpareBuffers`]), so a new prompt length allocates almost nothing once the set is full.
const MAX_WORKSPACES: usize = 4;
/// Spare buffers kept, in workspaces' worth (of the largest made): the buffers of the workspaces the warm-up leaves
/// behind, or what a new workspace did not take from the one it replaced.
const SPARE_WORKSPACES: usize = 2;

fn cuda_err(what: &str) -> impl FnOnce(tf_cuda::Error) -> DitError + '_ {
    move |e| DitError::Gpu(gpu_error(what, e))
}

/// A GPU failure of any cause the backend meets (runtime, cuBLASLt, kernels, upload), kept typed.
fn gpu_err<E: IntoGpuError>(what: &str) -> impl FnOnce(E) -> DitError + '_ {
    move |e| DitError::Gpu(gpu_error(what, e))
}

/// bf16 bits of `x` (round to nearest even).
fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

fn bf16_value(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

fn to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16_bits(v).to_le_bytes())
        .collect()
}

/// What the model load measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuLoadStats {
    pub upload: UploadStats,
    /// Bytes of the device weight allocation.
    pub weight_bytes: usize,
    /// The GEMM precision the weights were loaded for.
    pub precision: DitPrecision,
    /// Blocks of the model (what [`DitPrecision::describe`] needs).
    pub layers: usize,
    /// Weights the checkpoint stores in FP8 with their scales (0 for a bf16/f32 checkpoint).
    pub checkpoint_fp8: usize,
    /// Of those, the ones whose codes went to the device as stored; the rest were dequantized to bf16.
    pub checkpoint_fp8_as_stored: usize,
}

impl std::fmt::Display for GpuLoadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; precision {}",
            self.upload,
            self.precision.describe(self.layers)
        )?;
        if self.checkpoint_fp8 > 0 {
            write!(
                f,
                "; FP8 checkpoint: {} weights stored in e4m3, {} used as stored, {} dequantized to bf16",
                self.checkpoint_fp8,
                self.checkpoint_fp8_as_stored,
                self.checkpoint_fp8 - self.checkpoint_fp8_as_stored
            )?;
        }
        Ok(())
    }
}

/// What a step phase does, for its achieved rate: floating-point operations (GEMMs, attention) or bytes read
/// plus written (elementwise kernels and copies).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PhaseWork {
    Flops(f64),
    Bytes(f64),
}

/// Hooks a step calls after each launch group (eager steps only, never while a graph is captured). The
/// production step runs with [`NoProbe`], whose marks compile to nothing; benchmarks (the `bench` feature) pass
/// a timer that records an event per mark.
pub trait StepProbe {
    /// Ends the phase `name` (everything launched since the previous mark); `work` is evaluated only by probes
    /// that use it.
    fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        work: impl FnOnce() -> PhaseWork,
    ) -> Result<(), DitError>;
}

/// The production step's probe: marks nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProbe;

impl StepProbe for NoProbe {
    #[inline(always)]
    fn mark(
        &mut self,
        _stream: &Stream,
        _name: &'static str,
        _work: impl FnOnce() -> PhaseWork,
    ) -> Result<(), DitError> {
        Ok(())
    }
}

/// GEMM algorithm choice of the DiT: timed ([`gemm::TIMED`]), but only where it is planned ahead
/// ([`GpuDit::prepare_gemms`], at load) or found in the persistent plan cache; a shape first seen inside a request
/// takes cuBLASLt's first result. `TF_GEMM_SELECTION=heuristic` uses cuBLASLt's first result everywhere.
pub const DEFAULT_GEMM_SELECTION: AlgoSelection = gemm::TIMED;

/// The row counts of one step, shared by its GEMM planning and its workspace so that both see the same shapes.
pub(super) struct StepRows {
    /// First joint-sequence row the step computes (the prefix length when cached, else 0).
    pub first_row: usize,
    /// Rows computed per sample.
    pub rows: usize,
    /// Rows computed over the batch.
    pub total: usize,
    /// Timestep rows: one per sample, plus the t = 0 row of a causal condition.
    pub n_t: usize,
    /// Latent tokens per sample of the input.
    pub n_img: usize,
    /// Text rows per sample of the input.
    pub text: usize,
}

impl StepRows {
    pub(super) fn of(
        config: &QwenImageDitConfig,
        layout: &JointLayout,
        inputs: &DitInputs,
        mode: KvMode,
    ) -> StepRows {
        let first_row = if mode == KvMode::Cached {
            layout.prefix_len
        } else {
            0
        };
        let rows = layout.seq_len - first_row;
        let second = |t: &crate::nn::tensor::TensorF32| t.shape().get(1).copied().unwrap_or(0);
        StepRows {
            first_row,
            rows,
            total: layout.batch * rows,
            n_t: layout.batch + usize::from(config.causal_condition),
            n_img: second(&inputs.hidden_states),
            text: second(&inputs.encoder_hidden_states),
        }
    }
}

/// Qwen-Image's `fp8` (the default 8-bit mode): every block's four GEMM groups in INT8 on our scaled INT8 GEMM
/// (`gemm=int8`: INT8 weights with per-output-channel scales, per-token INT8 activations written by the kernels that
/// produce them), the first and last block included (`ends=0`). Chosen from the full-size model's error against the
/// bf16 floor and its step (docs/ENGINES.md, "Precision"; docs/RESULTS.md, the eightieth and eighty-first calls, an
/// H100): 0.60-0.73x the floor and a 66.0-66.3 ms cached step at 1024x1024, 7.26 GB resident, against 0.62-0.74x,
/// 71.8-72.2 ms and 7.69 GB for the e4m3 mode it replaces ([`E4M3_FP8`], still available by name). Needs an sm_90
/// GPU, as the e4m3 mode does.
pub const DEFAULT_FP8: Fp8Layers = Fp8Layers {
    groups: Fp8Groups {
        gemm_codes: RowCodes::Int8,
        ..Fp8Groups::ALL
    },
    bf16_ends: 0,
    accumulation: Fp8Layers::DEFAULT.accumulation,
    attention: Fp8Layers::DEFAULT.attention,
};

/// Qwen-Image's e4m3 mode (the default before [`DEFAULT_FP8`], `fp8:all,ends=1`): the four groups in e4m3 on cuBLASLt,
/// the first and last block in bf16. A checkpoint that stores its weights in e4m3 runs `fp8` in this mode
/// ([`resolve_precision`]): INT8 GEMMs cannot take the file's codes.
pub const E4M3_FP8: Fp8Layers = Fp8Layers::DEFAULT;

/// `precision` with `fp8` (the model default) replaced by [`DEFAULT_FP8`], or by [`E4M3_FP8`] for a checkpoint
/// that stores weights in e4m3 (`stores_e4m3`); any other precision as given.
pub fn resolve_precision(precision: DitPrecision, stores_e4m3: bool) -> DitPrecision {
    precision.resolve(if stores_e4m3 { E4M3_FP8 } else { DEFAULT_FP8 })
}

/// Read-only engine state used by a step.
struct Engine {
    config: QwenImageDitConfig,
    dims: Dims,
    ctx: Context,
    /// The pipeline's stream (borrowed: every component of a pipeline runs on its one stream).
    stream: Arc<Stream>,
    kernels: DitKernels,
    attention_tile: AttentionTile,
    gemms: GemmRunner,
    weights: DeviceBuffer,
    offsets: WeightOffsets,
    precision: DitPrecision,
    /// Per block, the GEMM groups in FP8.
    fp8_groups: Vec<Fp8Groups>,
    /// The quantizing kernels, loaded when some block runs in FP8.
    quant: Option<QuantKernels>,
    /// Our INT8 GEMM, loaded when some block's 8-bit GEMM groups run in INT8 codes (`gemm=int8`).
    int8_gemm: Option<Int8GemmKernels>,
    /// The same set for the bf16 block GEMMs when `TF_BF16_GEMM=ours` (its bf16 kernel instead of cuBLASLt).
    bf16_gemm: Option<Int8GemmKernels>,
    /// The SwiGLU in the INT8 gate|up GEMM's epilogue where a block's MLP runs in INT8 (the default;
    /// `TF_SWIGLU_GEMM=apart` runs the SwiGLU kernel).
    swiglu_fused: bool,
    /// The QK norm and RoPE in the INT8 q|k|v GEMM's epilogue where a block's qkv group runs in INT8 (the default;
    /// `TF_QKV_GEMM=apart` runs the pass).
    qkv_fused: bool,
    /// The 8-bit attention kernels, loaded when some block runs its attention in 8 bits (`attn=int8-fp8`).
    attention8: Option<Attention8bitKernels>,
}

/// The GPU DiT backend.
pub struct GpuDit {
    engine: Engine,
    workspaces: RecentSet<Workspace>,
    /// Buffers of given-up workspaces, for the next ones.
    spares: SpareBuffers<DeviceBuffer>,
    /// Bytes of the largest workspace made (bounds the spares).
    largest_workspace: usize,
    use_graphs: bool,
    load_stats: GpuLoadStats,
}

impl std::fmt::Debug for GpuDit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDit")
            .field("config", &self.engine.config)
            .field("workspaces", &self.workspaces.len())
            .field("use_graphs", &self.use_graphs)
            .finish_non_exhaustive()
    }
}

impl Drop for GpuDit {
    fn drop(&mut self) {
        // Work still queued (after an error mid-step) must not outlive the buffers it reads. On a lost context
        // this fails fast without calling the driver (tf-cuda checks its health first), and the buffers leak.
        let _ = self.engine.stream.synchronize();
    }
}

impl GpuDit {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuDit, DitError> {
        let driver = tf_cuda::open_driver().map_err(cuda_err("opening the CUDA driver"))?;
        let ctx = Context::new(driver, 0).map_err(cuda_err("creating a context on device 0"))?;
        GpuDit::load_on(&ctx, model, StagingConfig::default())
    }

    /// [`GpuDit::load`] in the given GEMM precision.
    pub fn load_with(model: &ModelDir, precision: DitPrecision) -> Result<GpuDit, DitError> {
        let driver = tf_cuda::open_driver().map_err(cuda_err("opening the CUDA driver"))?;
        let ctx = Context::new(driver, 0).map_err(cuda_err("creating a context on device 0"))?;
        GpuDit::load_on_with(&ctx, model, StagingConfig::default(), precision)
    }

    /// Loads `model` into `ctx`: validates the folder, uploads fused bf16 weights, loads kernels and cuBLASLt.
    pub fn load_on(
        ctx: &Context,
        model: &ModelDir,
        staging: StagingConfig,
    ) -> Result<GpuDit, DitError> {
        GpuDit::load_on_with(ctx, model, staging, DitPrecision::Bf16)
    }

    /// [`GpuDit::load_on`] in the given GEMM precision, on a blocking stream of its own (see [`GpuDit::load_in`]).
    pub fn load_on_with(
        ctx: &Context,
        model: &ModelDir,
        staging: StagingConfig,
        precision: DitPrecision,
    ) -> Result<GpuDit, DitError> {
        let device = GpuDevice::on(ctx).map_err(cuda_err("creating a stream"))?;
        GpuDit::load_in(&device, model, staging, precision)
    }

    /// Loads `model` onto `device`, whose stream every step runs on (a pipeline's components share it). With FP8,
    /// the chosen block GEMM groups are quantized on the way to the device (and the quantizing kernels loaded).
    /// FP8 needs an sm_90 GPU, cuBLASLt 12.9 or newer and GEMM dimensions that are multiples of 16; anything else
    /// is refused here, naming what is missing.
    pub fn load_in(
        device: &GpuDevice,
        model: &ModelDir,
        staging: StagingConfig,
        precision: DitPrecision,
    ) -> Result<GpuDit, DitError> {
        let ctx = device.context();
        let config = QwenImageDitConfig::from_json(model.config_json())?;
        let checkpoint = check_folder(model, &config)?;
        let precision = resolve_precision(precision, !checkpoint.is_empty());
        if let DitPrecision::Fp8(layers) = precision {
            if layers.groups.adaln.is_some() {
                return Err(DitError::Backend(
                    "the fp8 group `adaln` is MiniMax H3's per-block modulation; Qwen-Image's modulation is one \
                     shared layer and stays bf16: leave `adaln` out of --precision"
                        .into(),
                ));
            }
            if layers.groups.mlp_in_split() {
                return Err(DitError::Backend(
                    "the fp8 groups `mlp_value` and `mlp_gate` (one half of the MLP's input projection) are MiniMax                      H3's; Qwen-Image runs its gate|up projection as one GEMM: name `mlp_in`, or neither half"
                        .into(),
                ));
            }
        }
        let dims = Dims::of(&config)?;
        let stream = Arc::clone(device.stream());
        let kernels = DitKernels::load(ctx).map_err(gpu_err("loading the DiT kernels"))?;
        let gemms =
            GemmRunner::new(ctx, DEFAULT_GEMM_SELECTION).map_err(gpu_err("opening cuBLASLt"))?;
        let fp8_groups: Vec<Fp8Groups> = (0..dims.layers)
            .map(|l| precision.groups_of(l, dims.layers))
            .collect();
        let quant = if fp8_groups.iter().any(|g| g.any()) {
            check_fp8_support(ctx, &gemms, &dims)?;
            Some(QuantKernels::load(ctx).map_err(gpu_err("loading the FP8 quantizing kernels"))?)
        } else {
            None
        };

        let int8_gemm = if fp8_groups
            .iter()
            .any(|g| g.any() && g.gemm_codes == RowCodes::Int8)
        {
            Some(Int8GemmKernels::load(ctx).map_err(gpu_err(
                "loading our INT8 GEMM (gemm=int8 runs every 8-bit GEMM group on it; it needs an sm_90 GPU)",
            ))?)
        } else {
            None
        };
        let bf16_gemm = match Int8GemmBackend::bf16_from_env().map_err(DitError::Backend)? {
            Int8GemmBackend::Ours => Some(
                Int8GemmKernels::load(ctx)
                    .map_err(gpu_err("loading our bf16 GEMM (TF_BF16_GEMM=ours)"))?,
            ),
            Int8GemmBackend::Cublaslt => None,
        };
        let swiglu_fused =
            gemm_int8::swiglu_fused_for(int8_gemm.as_ref(), dims.ffn).map_err(DitError::Backend)?;
        let qkv_fused = gemm_int8::qkv_fused_for(int8_gemm.as_ref(), dims.heads * HEAD_DIM)
            .map_err(DitError::Backend)?;
        let attention8 = if precision.uses_8bit_attention(dims.layers) {
            Some(Attention8bitKernels::load(ctx).map_err(gpu_err(
                "loading the 8-bit attention kernels (attn=int8-fp8)",
            ))?)
        } else {
            None
        };
        let weights =
            weights::upload(ctx, &stream, model, &checkpoint, &dims, staging, &precision)?;
        Ok(GpuDit {
            engine: Engine {
                config,
                dims,
                ctx: ctx.clone(),
                stream,
                attention_tile: kernels.preferred_tile(),
                kernels,
                gemms,
                weights: weights.buffer,
                offsets: weights.offsets,
                precision,
                fp8_groups,
                quant,
                int8_gemm,
                bf16_gemm,
                swiglu_fused,
                qkv_fused,
                attention8,
            },
            workspaces: RecentSet::new(MAX_WORKSPACES),
            spares: SpareBuffers::new(0),
            largest_workspace: 0,
            use_graphs: true,
            load_stats: GpuLoadStats {
                upload: weights.upload,
                weight_bytes: weights.bytes,
                precision,
                layers: dims.layers,
                checkpoint_fp8: weights.checkpoint_fp8,
                checkpoint_fp8_as_stored: weights.checkpoint_fp8_as_stored,
            },
        })
    }

    /// The GEMM precision the model was loaded in.
    pub fn precision(&self) -> DitPrecision {
        self.engine.precision
    }

    /// What the load moved and how fast.
    pub fn load_stats(&self) -> GpuLoadStats {
        self.load_stats
    }

    /// Turns CUDA graph capture and replay on (the default) or off (every step eager).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.use_graphs = enabled;
    }

    /// Step graphs captured and held across every workspace (a warm worker's count stays put from request to
    /// request when its KV caches land at the same binding).
    pub fn captured_graphs(&self) -> usize {
        self.workspaces.iter().map(|ws| ws.graphs.len()).sum()
    }

    /// Workspaces held now (one per step shape seen recently), and the most it keeps.
    pub fn workspaces_held(&self) -> (usize, usize) {
        (self.workspaces.len(), self.workspaces.capacity())
    }

    /// The context the model lives in.
    pub fn context(&self) -> &Context {
        &self.engine.ctx
    }

    /// Frees every workspace, graph and spare buffer (weights stay).
    pub fn clear_workspaces(&mut self) {
        self.workspaces.clear();
        self.spares.clear();
    }

    /// Gives up every workspace and graph but keeps their buffers as spares for the next workspaces (up to
    /// [`SPARE_WORKSPACES`] of them): what a warm-up leaves for the first request, whose prompt length differs.
    pub fn recycle_workspaces(&mut self) -> Result<(), DitError> {
        // Host uploads into a reused buffer must not race a step still running over it.
        self.engine
            .stream
            .synchronize()
            .map_err(cuda_err("waiting before reusing workspaces"))?;
        // Most recently used first: the bound keeps the buffers of the latest shapes.
        for ws in self.workspaces.take_all().into_iter().rev() {
            self.spares.give_all(ws.into_buffers());
        }
        Ok(())
    }

    /// Spare buffers held (kept from given-up workspaces) and their bytes.
    pub fn spare_buffers(&self) -> (usize, usize) {
        (self.spares.len(), self.spares.held_bytes())
    }

    /// How the GEMM algorithm of a new shape is chosen ([`DEFAULT_GEMM_SELECTION`] unless set). Shapes already
    /// planned keep their algorithm; set this before the first step.
    pub fn set_gemm_selection(&self, selection: AlgoSelection) -> Result<(), DitError> {
        self.engine
            .gemms
            .set_algo_selection(selection)
            .map_err(gpu_err("setting the GEMM selection"))
    }

    /// Plans the GEMMs of the given steps ahead of the requests (at load): choices stored in the persistent plan
    /// cache are reused, unseen shapes are timed within `budget` (under timed selection), and afterwards no GEMM is
    /// timed inside a request: a shape not prepared takes cuBLASLt's first result.
    pub fn prepare_gemms(
        &self,
        steps: &[(&DitInputs, KvMode)],
        budget: std::time::Duration,
    ) -> Result<tf_cuda::cublaslt::PrepareReport, DitError> {
        let mut shapes = Vec::new();
        for (inputs, mode) in steps {
            shapes.extend(self.gemm_shapes(inputs, *mode)?);
        }
        self.engine
            .gemms
            .prepare(&gemm::distinct(shapes), budget, &self.engine.stream)
            .map_err(gpu_err("planning the GEMMs ahead"))
    }

    /// Plans every GEMM shape the persistent plan cache stores for this GPU and loads their kernels (at load, after
    /// the warm-up), so that a request whose shapes an earlier process planned builds no plan and loads no kernel
    /// inside it.
    pub fn prepare_stored_gemms(&self) -> Result<StoredGemms, DitError> {
        self.engine
            .gemms
            .prepare_stored(&self.engine.stream)
            .map_err(gpu_err("planning the plan cache's stored GEMM shapes"))
    }

    /// The GEMM plans built so far and how each algorithm was chosen (per-candidate times when timed).
    pub fn gemm_plan_choices(&self) -> Vec<PlanChoice> {
        self.engine.gemms.plan_choices()
    }

    /// The GEMM handle's counters: plans, and the kernels launched (and how many a step launched first).
    pub fn gemm_cache_stats(&self) -> tf_cuda::cublaslt::CacheStats {
        self.engine.gemms.lt().cache_stats()
    }

    /// The attention kernel's tile shape (the preferred one for this GPU unless set).
    pub fn attention_tile(&self) -> AttentionTile {
        self.engine.attention_tile
    }

    /// Uses `tile` for attention from now on (benchmarks compare tile shapes). Drops the captured graphs, which
    /// hold the previous kernel. Fails when the tile's kernel is not loaded on this GPU.
    pub fn set_attention_tile(&mut self, tile: AttentionTile) -> Result<(), DitError> {
        if !self.engine.kernels.has_tile(tile) {
            return Err(DitError::Backend(format!(
                "attention tile {tile:?} ({}) is not loaded on this GPU",
                tile.kernel()
            )));
        }
        self.engine.attention_tile = tile;
        self.clear_workspaces();
        Ok(())
    }

    /// Validates the request, finds or allocates its workspace, and uploads the inputs (on the stream).
    fn prepare(
        &mut self,
        inputs: &DitInputs,
        kv: &KvStep<'_, GpuKvCache>,
    ) -> Result<usize, DitError> {
        let cfg = &self.engine.config;
        let layout = JointLayout::build(cfg, inputs)?;
        let mode = kv.mode();
        if mode != KvMode::None && !cfg.causal_condition {
            return Err(DitError::KvCache(
                "a KV cache needs causal_condition = true (prefix tokens must not depend on the timestep)".into(),
            ));
        }
        if let KvStep::Cached(cache) = kv {
            if cache.batch != layout.batch
                || cache.prefix_len != layout.prefix_len
                || cache.layers != self.engine.dims.layers
            {
                return Err(DitError::KvCache(format!(
                    "the cache holds {} samples x {} prefix tokens x {} layers, the inputs need {} x {} x {}; \
                     extract the cache from the same model and prefix",
                    cache.batch, cache.prefix_len, cache.layers, layout.batch, layout.prefix_len, self.engine.dims.layers
                )));
            }
        }
        let engine = &self.engine;
        let spares = &mut self.spares;
        let largest = &mut self.largest_workspace;
        let index = self.workspaces.find_or_remake(
            |w| w.mode == mode && w.layout == layout,
            |given_up| {
                if let Some(old) = given_up {
                    // Host uploads into a reused buffer must not race a step still running over it.
                    engine
                        .stream
                        .synchronize()
                        .map_err(cuda_err("waiting before reusing a workspace"))?;
                    spares.give_all(old.into_buffers());
                }
                let started = std::time::Instant::now();
                // The new shape's GEMMs are planned before its first step is enqueued: a kernel that has not run
                // yet is launched once here, while the device has little or nothing queued, instead of stalling
                // the step's enqueue until the device drains (cuBLASLt loads a kernel on its first launch).
                engine
                    .gemms
                    .prepare(
                        &engine.gemm_shapes(inputs, mode)?,
                        std::time::Duration::ZERO,
                        &engine.stream,
                    )
                    .map_err(gpu_err("planning the new shape's GEMMs"))?;
                let made = engine.workspace(layout.clone(), mode, inputs, spares);
                host_work::WORKSPACE_BUILDS.record(started);
                let made = made?;
                let bytes = made.buffer_bytes();
                if bytes > *largest {
                    *largest = bytes;
                    spares.set_max_bytes(bytes.saturating_mul(SPARE_WORKSPACES));
                }
                Ok::<_, DitError>(made)
            },
        )?;
        let ws = &mut self.workspaces[index];
        let stream = &engine.stream;
        let mut t = inputs.timestep.data().to_vec();
        if cfg.causal_condition {
            t.push(0.0);
        }
        let t_bytes = le_bytes(&t, f32::to_le_bytes);
        ws.timesteps
            .upload_async(0, &t_bytes, stream)
            .map_err(cuda_err("uploading timesteps"))?;
        ws.hidden_in
            .upload_async(0, &to_bf16_bytes(inputs.hidden_states.data()), stream)
            .map_err(cuda_err("uploading hidden_states"))?;
        if mode != KvMode::Cached {
            ws.text_in
                .upload_async(
                    0,
                    &to_bf16_bytes(inputs.encoder_hidden_states.data()),
                    stream,
                )
                .map_err(cuda_err("uploading encoder_hidden_states"))?;
        }
        Ok(index)
    }

    /// The GEMMs a step of `inputs` in `mode` runs, one entry per distinct plan in first-call order: what
    /// planning the step's GEMMs ahead (at load, for the request shapes it will serve) takes.
    pub fn gemm_shapes(
        &self,
        inputs: &DitInputs,
        mode: KvMode,
    ) -> Result<Vec<GemmShape>, DitError> {
        self.engine.gemm_shapes(inputs, mode)
    }
}

impl Engine {
    /// [`GpuDit::gemm_shapes`].
    fn gemm_shapes(&self, inputs: &DitInputs, mode: KvMode) -> Result<Vec<GemmShape>, DitError> {
        let engine = self;
        let (dims, o) = (&engine.dims, &engine.offsets);
        let layout = JointLayout::build(&engine.config, inputs)?;
        let cached = mode == KvMode::Cached;
        let StepRows {
            first_row,
            rows,
            total,
            n_t,
            n_img,
            text: l,
        } = StepRows::of(&engine.config, &layout, inputs, mode);
        let b = layout.batch;
        let (d, w, f) = (dims.d, dims.width, dims.ffn);
        let shape = gemm::shape_at_offsets;
        let mut out = vec![
            shape(n_t, d, TIMESTEP_DIM, (0, o.time1, 0), false),
            shape(n_t, d, d, (0, o.time2, 0), false),
            shape(n_t, 5 * d, d, (0, o.mod_out, 0), false),
        ];
        if !cached && l > 0 {
            out.push(shape(b * l, d, dims.ctx, (0, o.txt_in, 0), false));
        }
        for bi in 0..b {
            for run in &runs(&layout, first_row) {
                let y = (bi * rows + run.pos - first_row) * d * BF16;
                out.push(if run.text {
                    shape(
                        run.len,
                        d,
                        d,
                        ((bi * l + run.src) * d * BF16, o.txt_out, y),
                        false,
                    )
                } else {
                    let x = (bi * n_img + run.src) * dims.in_ch * BF16;
                    shape(run.len, d, dims.in_ch, (x, o.img_in, y), false)
                });
            }
        }
        for (bo, fp8) in o.blocks.iter().zip(&engine.fp8_groups) {
            // A group in FP8 reads its input from the workspace's FP8 rows (offset 0).
            let accumulation = engine.precision.fp8_accumulation();
            let pick = |on: bool| {
                move |m, n, k, offsets, f32_out| {
                    if on {
                        gemm::fp8_shape_at_offsets((m, n, k), offsets, f32_out, accumulation)
                    } else {
                        shape(m, n, k, offsets, f32_out)
                    }
                }
            };
            out.extend([
                pick(fp8.qkv)(total, 3 * w, d, (0, bo.qkv, 0), false),
                pick(fp8.out)(total, d, w, (0, bo.to_out, 0), false),
                pick(fp8.mlp_in())(total, 2 * f, d, (0, bo.gate_up, 0), false),
                pick(fp8.mlp_out)(total, d, f, (0, bo.mlp_out, 0), false),
            ]);
        }
        out.push(shape(total, dims.out_ch, d, (0, o.proj_out, 0), true));
        out.retain(|s| s.m > 0);
        Ok(gemm::distinct(out))
    }
}

/// Refuses FP8 where it cannot run: cuBLASLt's row-wise scaled FP8 GEMM needs sm_90 and version 12.9, and every
/// FP8 GEMM dimension (hidden, attention width, MLP width) must be a multiple of 16.
fn check_fp8_support(ctx: &Context, gemms: &GemmRunner, dims: &Dims) -> Result<(), DitError> {
    let info = ctx
        .device_info()
        .map_err(cuda_err("reading the device's compute capability"))?;
    if let Some(why) = gemms.fp8_refusal(&info.name, info.compute_capability) {
        return Err(DitError::Backend(why));
    }
    for (name, v) in [
        ("hidden size", dims.d),
        ("attention width", dims.width),
        ("MLP width", dims.ffn),
    ] {
        if v % 16 != 0 {
            return Err(DitError::Backend(format!(
                "FP8 GEMMs need dimensions that are multiples of 16; the {name} is {v}: use --precision bf16"
            )));
        }
    }
    Ok(())
}

/// `bytes` at `offset` of `buf` as a GEMM operand, checked.
fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, DitError> {
    Ok(gemm::span(buf, offset, bytes)?)
}

impl From<GemmError> for DitError {
    fn from(e: GemmError) -> DitError {
        DitError::Gpu(gpu_error("GEMM", e))
    }
}

impl DitBackend for GpuDit {
    type KvCache = GpuKvCache;

    fn config(&self) -> &QwenImageDitConfig {
        &self.engine.config
    }

    fn forward(
        &mut self,
        inputs: &DitInputs,
        kv: KvStep<'_, GpuKvCache>,
    ) -> Result<DitOutput<GpuKvCache>, DitError> {
        let index = self.prepare(inputs, &kv)?;
        let cache = kv.cache();
        let fresh = if matches!(kv, KvStep::Extract) {
            let ws = &self.workspaces[index];
            Some(self.alloc_cache(ws.layout.batch, ws.layout.prefix_len)?)
        } else {
            None
        };
        let engine = &self.engine;
        let ws = &mut self.workspaces[index];
        if self.use_graphs && ws.warmed {
            engine.replay(ws, cache)?;
        } else {
            let started = std::time::Instant::now();
            engine.enqueue_step(ws, cache, &mut NoProbe)?;
            host_work::EAGER_STEPS.record(started);
            ws.warmed = true;
            if self.use_graphs {
                // The eager step built the GEMM plans; the host would only wait for the device now.
                engine.capture_ahead(ws, cache)?;
            }
        }
        let mut kv_cache = None;
        if let (Some(mut fresh), Some(extract)) = (fresh, ws.extract.as_ref()) {
            fresh
                .buffer
                .copy_from(0, extract.buffer.view(), Some(&engine.stream))
                .map_err(cuda_err("copying the extracted KV cache"))?;
            kv_cache = Some(fresh);
        }
        let waited = std::time::Instant::now();
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the DiT step"))?;
        host_work::STEP_WAITS.record(waited);
        let values: Vec<f32> = ws
            .out
            .to_vec()
            .map_err(cuda_err("downloading the sample"))?;
        let sample = Tensor::new(vec![ws.layout.batch, ws.rows, engine.dims.out_ch], values)?;
        Ok(DitOutput { sample, kv_cache })
    }

    fn kv_to_host(&self, cache: &GpuKvCache) -> Result<HostKvCache, DitError> {
        self.cache_to_host(cache)
    }

    fn kv_from_host(&mut self, cache: HostKvCache) -> Result<GpuKvCache, DitError> {
        self.cache_from_host(cache)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_resolves_to_int8_gemms_or_to_e4m3_for_an_e4m3_checkpoint() {
        let default = resolve_precision(DitPrecision::FP8, false);
        assert_eq!(default, DitPrecision::Fp8(DEFAULT_FP8));
        assert_eq!(
            default.to_string(),
            "fp8:qkv,out,mlp_in,mlp_out,ends=0,gemm=int8"
        );
        // Every block, the ends included, on the INT8 GEMM.
        for layer in [0, 15, 31] {
            let g = default.groups_of(layer, 32);
            assert!(g.qkv && g.out && g.mlp_in() && g.mlp_out, "block {layer}");
            assert_eq!(g.gemm_codes, RowCodes::Int8);
        }
        // A checkpoint stored in e4m3 runs the e4m3 mode: its codes feed cuBLASLt's FP8 GEMM as stored.
        let stored = resolve_precision(DitPrecision::FP8, true);
        assert_eq!(stored, DitPrecision::Fp8(E4M3_FP8));
        assert_eq!(stored.groups_of(0, 32), Fp8Groups::NONE);
        assert_eq!(stored.groups_of(1, 32).gemm_codes, RowCodes::E4m3);
        // Named modes and bf16 are kept as given, whatever the checkpoint.
        let named: DitPrecision = "fp8:qkv,ends=2".parse().unwrap();
        assert!(matches!(named, DitPrecision::Fp8(_)));
        assert_eq!(resolve_precision(named, true), named);
        assert_eq!(
            resolve_precision(DitPrecision::Bf16, true),
            DitPrecision::Bf16
        );
    }
}
