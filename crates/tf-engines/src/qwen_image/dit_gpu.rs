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
//!   (workspace, KV cache) and replayed. Workspaces are allocated once per joint layout and mode.
//! - The KV cache is `[layer][k|v][batch][prefix][heads * 128]` bf16 on the device, post-norm and post-RoPE.
//! - Masks: block-causal as per-query key limits, padded text rows as one key range per sample; padding in several
//!   ranges (full and extract steps) runs attention over the valid keys gathered per sample.
//!
//! Invariant: no host synchronisation inside a step; the only syncs are after the step, before reading results.
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

use std::sync::atomic::{AtomicU64, Ordering};

use tf_cuda::cublaslt::{AlgoSelection, DeviceSpan, PlanChoice};
use tf_cuda::{Context, DeviceBuffer, Stream};

use super::config::{QwenImageDitConfig, ROPE_THETA, TIMESTEP_DIM};
use super::dit::{
    DitBackend, DitError, DitInputs, DitOutput, HostKvCache, JointLayout, KvMode, KvStep,
    TokenSource,
};
use super::ops::DitKernels;
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, GemmShape, Linear};
use crate::nn::gpu::graph_cache::GraphCache;
use crate::nn::gpu::{
    attention_flops, key_limits_from_blocks, key_pad_from_valid, AttentionInputs, AttentionShape,
    AttentionTile, Matrix, Modulation, ModulationRows, QkvInputs, QkvOutputs, Strides, HEAD_DIM,
};
use crate::nn::host;
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::upload::{upload_pieces, Piece, StagingConfig, UploadStats};
use crate::nn::weights::{le_bytes, Dtype, LayoutPlanner, ModelDir, BF16};

/// Graphs kept per workspace (one per KV cache used with it).
const MAX_GRAPHS: usize = 4;

fn backend(what: &str) -> impl FnOnce(String) -> DitError + '_ {
    move |why| DitError::Backend(format!("{what}: {why}"))
}

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

/// Device offsets (bytes) of one block's fused weights.
#[derive(Debug, Clone, Copy)]
struct BlockOffsets {
    qkv: usize,
    to_out: usize,
    norm_q: usize,
    norm_k: usize,
    gate_up: usize,
    mlp_out: usize,
}

/// Device offsets (bytes) of every weight group.
#[derive(Debug, Clone)]
struct WeightOffsets {
    img_in: usize,
    txt_norm: usize,
    txt_in: usize,
    txt_out: usize,
    time1: usize,
    time2: usize,
    /// `[5D, D]`: modulation.1 then norm_out.linear.
    mod_out: usize,
    proj_out: usize,
    blocks: Vec<BlockOffsets>,
}

/// How a source tensor is reshaped on its way to the device (identity for full-size models).
#[derive(Debug, Clone, Copy)]
enum Transform {
    Plain,
    /// `[heads * hd, cols]` -> `[heads * 128, cols]`, times `scale`.
    PadRows {
        cols: usize,
        scale: f32,
    },
    /// `[rows, heads * hd]` -> `[rows, heads * 128]`.
    PadCols {
        rows: usize,
    },
    /// `[hd]` -> `[128]`, times `scale`.
    PadVec {
        scale: f32,
    },
}

/// Dimensions the GPU forward uses.
#[derive(Debug, Clone, Copy)]
struct Dims {
    d: usize,
    heads: usize,
    head_dim: usize,
    /// Padded attention width: heads * 128.
    width: usize,
    ffn: usize,
    in_ch: usize,
    ctx: usize,
    out_ch: usize,
    layers: usize,
    eps: f32,
}

impl Dims {
    fn of(cfg: &QwenImageDitConfig) -> Result<Dims, DitError> {
        let dims = Dims {
            d: cfg.inner_dim(),
            heads: cfg.num_attention_heads,
            head_dim: cfg.attention_head_dim,
            width: cfg.num_attention_heads * HEAD_DIM,
            ffn: cfg.mlp_hidden(),
            in_ch: cfg.in_channels,
            ctx: cfg.context_in_dim,
            out_ch: cfg.out_channels(),
            layers: cfg.num_layers,
            eps: cfg.eps,
        };
        let unsupported = |why: String| {
            Err(DitError::Backend(format!(
                "the GPU backend cannot run this config: {why}"
            )))
        };
        if dims.head_dim > HEAD_DIM {
            return unsupported(format!("attention_head_dim {} > {HEAD_DIM}", dims.head_dim));
        }
        for (name, v) in [
            ("inner dim", dims.d),
            ("context_in_dim", dims.ctx),
            ("in_channels", dims.in_ch),
            ("mlp hidden", dims.ffn),
        ] {
            if v % 8 != 0 {
                return unsupported(format!("{name} {v} is not a multiple of 8 (16-byte rows)"));
            }
        }
        if dims.d > crate::nn::gpu::MAX_NORM_COLS || dims.ctx > crate::nn::gpu::MAX_NORM_COLS {
            return unsupported(format!(
                "norms of {} / {} columns exceed the kernels' {}",
                dims.d,
                dims.ctx,
                crate::nn::gpu::MAX_NORM_COLS
            ));
        }
        Ok(dims)
    }

    fn padded(&self) -> bool {
        self.head_dim != HEAD_DIM
    }

    /// Scale of the q/k rows that makes the 128-wide RMSNorm see the true mean square.
    fn qk_scale(&self) -> f32 {
        (HEAD_DIM as f32 / self.head_dim as f32).sqrt()
    }
}

/// What the model load measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuLoadStats {
    pub upload: UploadStats,
    /// Bytes of the device weight allocation.
    pub weight_bytes: usize,
}

impl std::fmt::Display for GpuLoadStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.upload)
    }
}

/// The prefix K/V of every layer on the device.
#[derive(Debug)]
pub struct GpuKvCache {
    id: u64,
    batch: usize,
    prefix_len: usize,
    /// Padded width per token (heads * 128).
    width: usize,
    layers: usize,
    buffer: DeviceBuffer,
}

impl GpuKvCache {
    /// Samples.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Cached tokens per sample.
    pub fn prefix_len(&self) -> usize {
        self.prefix_len
    }

    fn plane_bytes(&self) -> usize {
        self.batch * self.prefix_len * self.width * BF16
    }

    /// Byte offset of layer `layer`'s K (`which` 0) or V (1).
    fn offset(&self, layer: usize, which: usize) -> usize {
        (layer * 2 + which) * self.plane_bytes()
    }
}

static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(1);

/// One run of consecutive joint tokens from consecutive source rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    text: bool,
    /// First source row (text row `m` or image token `n`) of the run.
    src: usize,
    /// First joint position of the run.
    pos: usize,
    len: usize,
}

/// Runs of the joint sequence from `first_row` on.
fn runs(layout: &JointLayout, first_row: usize) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (pos, src) in layout.sources.iter().enumerate().skip(first_row) {
        let (text, s) = match *src {
            TokenSource::Text(m) => (true, m),
            TokenSource::Image(n) => (false, n),
        };
        match out.last_mut() {
            Some(run) if run.text == text && run.src + run.len == s && run.pos + run.len == pos => {
                run.len += 1
            }
            _ => out.push(Run {
                text,
                src: s,
                pos,
                len: 1,
            }),
        }
    }
    out
}

/// Device buffers of one (layout, mode).
struct Workspace {
    mode: KvMode,
    layout: JointLayout,
    /// Rows per sample this step computes (S, or the target rows when cached).
    rows: usize,
    first_row: usize,
    n_t: usize,
    n_img: usize,
    l_vlm: usize,
    runs: Vec<Run>,
    timesteps: DeviceBuffer,
    sinusoid: DeviceBuffer,
    temb1: DeviceBuffer,
    temb2: DeviceBuffer,
    modulation: DeviceBuffer,
    hidden_in: DeviceBuffer,
    text_in: DeviceBuffer,
    text_normed: DeviceBuffer,
    text_hidden: DeviceBuffer,
    x: DeviceBuffer,
    normed: DeviceBuffer,
    qkv: DeviceBuffer,
    q: DeviceBuffer,
    k: DeviceBuffer,
    v: DeviceBuffer,
    attn: DeviceBuffer,
    proj: DeviceBuffer,
    gate_up: DeviceBuffer,
    act: DeviceBuffer,
    out: DeviceBuffer,
    rope_cos: DeviceBuffer,
    rope_sin: DeviceBuffer,
    key_limits: DeviceBuffer,
    key_pad: Option<DeviceBuffer>,
    /// Padding in several ranges: the gather plan and the compacted K and V.
    compact: Option<(CompactKeys, DeviceBuffer, DeviceBuffer)>,
    /// Extract mode: the prefix K/V written by the step, copied into a fresh cache after it.
    extract: Option<GpuKvCache>,
    /// True once an eager step ran (cuBLASLt plans are built; capture is safe).
    warmed: bool,
    /// The step captured per KV cache used with this workspace (key: the cache id, 0 for none).
    graphs: GraphCache<u64>,
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

#[cfg(feature = "bench")]
mod bench;
#[cfg(feature = "bench")]
pub use bench::{PhaseTimes, PhaseTotal, StepTimes};

/// GEMM algorithm choice of the DiT: timed ([`gemm::TIMED`]), but only where it is planned ahead
/// ([`GpuDit::prepare_gemms`], at load) or found in the persistent plan cache; a shape first seen inside a request
/// takes cuBLASLt's first result. `TF_GEMM_SELECTION=heuristic` uses cuBLASLt's first result everywhere.
pub const DEFAULT_GEMM_SELECTION: AlgoSelection = gemm::TIMED;

/// Read-only engine state used by a step.
struct Engine {
    config: QwenImageDitConfig,
    dims: Dims,
    ctx: Context,
    stream: Stream,
    kernels: DitKernels,
    attention_tile: AttentionTile,
    gemms: GemmRunner,
    weights: DeviceBuffer,
    offsets: WeightOffsets,
}

/// The GPU DiT backend.
pub struct GpuDit {
    engine: Engine,
    workspaces: Vec<Workspace>,
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

    /// Loads `model` into `ctx`: validates the folder, uploads fused bf16 weights, loads kernels and cuBLASLt.
    pub fn load_on(
        ctx: &Context,
        model: &ModelDir,
        staging: StagingConfig,
    ) -> Result<GpuDit, DitError> {
        let config = QwenImageDitConfig::from_json(model.config_json())?;
        model.check(&config.tensor_specs())?;
        let dims = Dims::of(&config)?;
        let stream = Stream::new(ctx, false).map_err(cuda_err("creating a stream"))?;
        let kernels = DitKernels::load(ctx).map_err(gpu_err("loading the DiT kernels"))?;
        let gemms =
            GemmRunner::new(ctx, DEFAULT_GEMM_SELECTION).map_err(gpu_err("opening cuBLASLt"))?;

        // Device layout of the fused groups.
        let (d, w, f) = (dims.d, dims.width, dims.ffn);
        let mut layout = LayoutPlanner::default();
        let img_in = layout.one(d * dims.in_ch * BF16)?;
        let txt_norm = layout.one(dims.ctx * BF16)?;
        let txt_in = layout.one(d * dims.ctx * BF16)?;
        let txt_out = layout.one(d * d * BF16)?;
        let time1 = layout.one(d * TIMESTEP_DIM * BF16)?;
        let time2 = layout.one(d * d * BF16)?;
        let mod_out = layout.group(&[4 * d * d * BF16, d * d * BF16])?;
        let proj_out = layout.one(dims.out_ch * d * BF16)?;
        let mut blocks = Vec::with_capacity(dims.layers);
        let mut block_parts = Vec::with_capacity(dims.layers);
        for _ in 0..dims.layers {
            let qkv = layout.group(&[w * d * BF16, w * d * BF16, w * d * BF16])?;
            let to_out = layout.one(d * w * BF16)?;
            let norm_q = layout.one(HEAD_DIM * BF16)?;
            let norm_k = layout.one(HEAD_DIM * BF16)?;
            let gate_up = layout.group(&[f * d * BF16, f * d * BF16])?;
            let mlp_out = layout.one(d * f * BF16)?;
            blocks.push(BlockOffsets {
                qkv: qkv[0],
                to_out,
                norm_q,
                norm_k,
                gate_up: gate_up[0],
                mlp_out,
            });
            block_parts.push((qkv, gate_up));
        }
        let total = layout.total()?;
        let offsets = WeightOffsets {
            img_in,
            txt_norm,
            txt_in,
            txt_out,
            time1,
            time2,
            mod_out: mod_out[0],
            proj_out,
            blocks,
        };

        // Source tensor -> (device offset, transform).
        let mut placements: Vec<(String, usize, Transform)> = vec![
            ("img_in.weight".into(), img_in, Transform::Plain),
            ("txt_in.text_norm.weight".into(), txt_norm, Transform::Plain),
            ("txt_in.in_layer.weight".into(), txt_in, Transform::Plain),
            ("txt_in.out_layer.weight".into(), txt_out, Transform::Plain),
            (
                "time_text_embed.timestep_embedder.linear_1.weight".into(),
                time1,
                Transform::Plain,
            ),
            (
                "time_text_embed.timestep_embedder.linear_2.weight".into(),
                time2,
                Transform::Plain,
            ),
            ("modulation.1.weight".into(), mod_out[0], Transform::Plain),
            (
                "norm_out.linear.weight".into(),
                mod_out[1],
                Transform::Plain,
            ),
            ("proj_out.weight".into(), proj_out, Transform::Plain),
        ];
        let padded = dims.padded();
        let s = dims.qk_scale();
        let rows_t = |scale: f32| {
            if padded {
                Transform::PadRows { cols: d, scale }
            } else {
                Transform::Plain
            }
        };
        let vec_t = |scale: f32| {
            if padded {
                Transform::PadVec { scale }
            } else {
                Transform::Plain
            }
        };
        for (i, (b, (qkv, gate_up))) in offsets.blocks.iter().zip(&block_parts).enumerate() {
            let p = format!("transformer_blocks.{i}.");
            placements.push((format!("{p}attn.to_q.weight"), qkv[0], rows_t(s)));
            placements.push((format!("{p}attn.to_k.weight"), qkv[1], rows_t(s)));
            placements.push((format!("{p}attn.to_v.weight"), qkv[2], rows_t(1.0)));
            let cols_t = if padded {
                Transform::PadCols { rows: d }
            } else {
                Transform::Plain
            };
            placements.push((format!("{p}attn.to_out.0.weight"), b.to_out, cols_t));
            placements.push((format!("{p}attn.norm_q.weight"), b.norm_q, vec_t(1.0 / s)));
            placements.push((format!("{p}attn.norm_k.weight"), b.norm_k, vec_t(1.0 / s)));
            placements.push((
                format!("{p}img_mlp.gate_layer.weight"),
                gate_up[0],
                Transform::Plain,
            ));
            placements.push((
                format!("{p}img_mlp.proj.weight"),
                gate_up[1],
                Transform::Plain,
            ));
            placements.push((
                format!("{p}img_mlp.out.weight"),
                b.mlp_out,
                Transform::Plain,
            ));
        }

        // Reshaped tensors are built in host memory first (small models only); the rest stream from the map.
        let mut owned: Vec<(usize, Vec<u8>)> = Vec::new();
        for (i, (name, _, transform)) in placements.iter().enumerate() {
            if !matches!(transform, Transform::Plain) {
                let values = model.to_f32(name)?.into_data();
                owned.push((
                    i,
                    reshape(&values, *transform, &dims).map_err(backend(name))?,
                ));
            }
        }
        let mut pieces = Vec::with_capacity(placements.len());
        for (i, (name, offset, _)) in placements.iter().enumerate() {
            match owned.iter().find(|(j, _)| *j == i) {
                Some((_, bytes)) => pieces.push(Piece::bf16(bytes, Dtype::F32, *offset)),
                None => pieces.push(Piece::bf16(
                    model.bytes(name)?,
                    model.info(name)?.dtype,
                    *offset,
                )),
            }
        }
        let mut weights =
            DeviceBuffer::alloc(ctx, total).map_err(cuda_err("allocating the weights"))?;
        if padded {
            // Padding must read as zeros.
            weights
                .fill_u8(0, Some(&stream))
                .map_err(cuda_err("clearing the weights"))?;
        }
        let upload = upload_pieces(ctx, &stream, &mut weights, &pieces, staging)
            .map_err(gpu_err("uploading the DiT weights"))?;
        Ok(GpuDit {
            engine: Engine {
                config,
                dims,
                ctx: ctx.clone(),
                stream,
                attention_tile: kernels.preferred_tile(),
                kernels,
                gemms,
                weights,
                offsets,
            },
            workspaces: Vec::new(),
            use_graphs: true,
            load_stats: GpuLoadStats {
                upload,
                weight_bytes: total,
            },
        })
    }

    /// What the load moved and how fast.
    pub fn load_stats(&self) -> GpuLoadStats {
        self.load_stats
    }

    /// Turns CUDA graph capture and replay on (the default) or off (every step eager).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.use_graphs = enabled;
    }

    /// The context the model lives in.
    pub fn context(&self) -> &Context {
        &self.engine.ctx
    }

    /// Frees every workspace and graph (weights stay).
    pub fn clear_workspaces(&mut self) {
        self.workspaces.clear();
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

    /// The GEMM plans built so far and how each algorithm was chosen (per-candidate times when timed).
    pub fn gemm_plan_choices(&self) -> Vec<PlanChoice> {
        self.engine.gemms.plan_choices()
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
        let index = match self
            .workspaces
            .iter()
            .position(|w| w.mode == mode && w.layout == layout)
        {
            Some(i) => i,
            None => {
                let ws = self.engine.workspace(layout, mode, inputs)?;
                self.workspaces.push(ws);
                self.workspaces.len() - 1
            }
        };
        let engine = &self.engine;
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
        let engine = &self.engine;
        let (dims, o) = (&engine.dims, &engine.offsets);
        let layout = JointLayout::build(&engine.config, inputs)?;
        let cached = mode == KvMode::Cached;
        let first_row = if cached { layout.prefix_len } else { 0 };
        let b = layout.batch;
        let total = b * (layout.seq_len - first_row);
        let n_t = b + usize::from(engine.config.causal_condition);
        let n_img = inputs.hidden_states.shape().get(1).copied().unwrap_or(0);
        let l = inputs
            .encoder_hidden_states
            .shape()
            .get(1)
            .copied()
            .unwrap_or(0);
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
        let rows = layout.seq_len - first_row;
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
        for bo in &o.blocks {
            out.extend([
                shape(total, 3 * w, d, (0, bo.qkv, 0), false),
                shape(total, d, w, (0, bo.to_out, 0), false),
                shape(total, 2 * f, d, (0, bo.gate_up, 0), false),
                shape(total, d, f, (0, bo.mlp_out, 0), false),
            ]);
        }
        out.push(shape(total, dims.out_ch, d, (0, o.proj_out, 0), true));
        out.retain(|s| s.m > 0);
        Ok(gemm::distinct(out))
    }

    fn alloc_cache(&self, batch: usize, prefix_len: usize) -> Result<GpuKvCache, DitError> {
        let dims = &self.engine.dims;
        let bytes = dims.layers * 2 * batch * prefix_len * dims.width * BF16;
        Ok(GpuKvCache {
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            batch,
            prefix_len,
            width: dims.width,
            layers: dims.layers,
            buffer: DeviceBuffer::alloc(&self.engine.ctx, bytes)
                .map_err(cuda_err("allocating a KV cache"))?,
        })
    }
}

/// Reshapes a padded-head tensor (f32 values) into its 128-wide device image (f32 little-endian bytes).
fn reshape(values: &[f32], transform: Transform, dims: &Dims) -> Result<Vec<u8>, String> {
    let (heads, hd) = (dims.heads, dims.head_dim);
    let out: Vec<f32> = match transform {
        Transform::Plain => values.to_vec(),
        Transform::PadRows { cols, scale } => {
            if values.len() != heads * hd * cols {
                return Err(format!(
                    "{} values, expected {heads} x {hd} x {cols}",
                    values.len()
                ));
            }
            let mut out = vec![0f32; heads * HEAD_DIM * cols];
            for h in 0..heads {
                for i in 0..hd {
                    let src = &values[(h * hd + i) * cols..(h * hd + i + 1) * cols];
                    let dst = &mut out[(h * HEAD_DIM + i) * cols..(h * HEAD_DIM + i + 1) * cols];
                    for (o, &v) in dst.iter_mut().zip(src) {
                        *o = v * scale;
                    }
                }
            }
            out
        }
        Transform::PadCols { rows } => {
            if values.len() != rows * heads * hd {
                return Err(format!(
                    "{} values, expected {rows} x {heads} x {hd}",
                    values.len()
                ));
            }
            let mut out = vec![0f32; rows * heads * HEAD_DIM];
            for r in 0..rows {
                for h in 0..heads {
                    let src = &values[r * heads * hd + h * hd..r * heads * hd + (h + 1) * hd];
                    let at = r * heads * HEAD_DIM + h * HEAD_DIM;
                    out[at..at + hd].copy_from_slice(src);
                }
            }
            out
        }
        Transform::PadVec { scale } => {
            if values.len() != hd {
                return Err(format!("{} values, expected {hd}", values.len()));
            }
            let mut out = vec![0f32; HEAD_DIM];
            for (o, &v) in out.iter_mut().zip(values) {
                *o = v * scale;
            }
            out
        }
    };
    Ok(le_bytes(&out, f32::to_le_bytes))
}

/// Attention over the valid keys only, for padding in several ranges: invalid keys are never visible, so dropping
/// them and counting limits in valid keys keeps every query's visible set.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CompactKeys {
    /// Per sample: `(source position, compacted position, length)` runs of valid keys.
    runs: Vec<Vec<(usize, usize, usize)>>,
    /// Keys per sample after compaction (the most valid keys of any sample).
    num_keys: usize,
    /// Key limits `[batch][queries]` in compacted positions.
    limits: Vec<i32>,
    /// Per sample `[valid count, num_keys)`: the unused tail.
    pads: Vec<i32>,
}

impl CompactKeys {
    fn plan(key_valid: &[Vec<bool>], limits: &[i32]) -> Result<CompactKeys, DitError> {
        let mut runs = Vec::with_capacity(key_valid.len());
        let mut counts = Vec::with_capacity(key_valid.len());
        let mut compact_limits = Vec::with_capacity(key_valid.len() * limits.len());
        for valid in key_valid {
            // before[k] = valid keys at positions < k.
            let mut before = Vec::with_capacity(valid.len() + 1);
            before.push(0usize);
            let mut sample_runs: Vec<(usize, usize, usize)> = Vec::new();
            for (pos, &ok) in valid.iter().enumerate() {
                let count = *before.last().unwrap_or(&0);
                if ok {
                    match sample_runs.last_mut() {
                        Some(run) if run.0 + run.2 == pos => run.2 += 1,
                        _ => sample_runs.push((pos, count, 1)),
                    }
                }
                before.push(count + usize::from(ok));
            }
            for &limit in limits {
                let at = usize::try_from(limit).unwrap_or(0).min(valid.len());
                compact_limits.push(
                    i32::try_from(before[at])
                        .map_err(|_| DitError::Input("too many keys".into()))?,
                );
            }
            counts.push(*before.last().unwrap_or(&0));
            runs.push(sample_runs);
        }
        let num_keys = counts.iter().copied().max().unwrap_or(0).max(1);
        let mut pads = Vec::with_capacity(2 * counts.len());
        for &c in &counts {
            let to_i32 =
                |v: usize| i32::try_from(v).map_err(|_| DitError::Input("too many keys".into()));
            pads.extend([to_i32(c)?, to_i32(num_keys)?]);
        }
        Ok(CompactKeys {
            runs,
            num_keys,
            limits: compact_limits,
            pads,
        })
    }
}

fn alloc(ctx: &Context, bytes: usize, what: &str) -> Result<DeviceBuffer, DitError> {
    DeviceBuffer::alloc(ctx, bytes).map_err(|e| {
        DitError::Gpu(gpu_error(
            format!("allocating the {what} workspace ({bytes} B)"),
            e,
        ))
    })
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

impl Engine {
    /// Allocates the buffers of one (layout, mode) and uploads its layout-dependent tables.
    fn workspace(
        &self,
        layout: JointLayout,
        mode: KvMode,
        inputs: &DitInputs,
    ) -> Result<Workspace, DitError> {
        let dims = &self.dims;
        let ctx = &self.ctx;
        let (b, s) = (layout.batch, layout.seq_len);
        let cached = mode == KvMode::Cached;
        let first_row = if cached { layout.prefix_len } else { 0 };
        let rows = s - first_row;
        let total = b * rows;
        let n_t = b + usize::from(self.config.causal_condition);
        let n_img = inputs.hidden_states.shape().get(1).copied().unwrap_or(0);
        let l_vlm = inputs
            .encoder_hidden_states
            .shape()
            .get(1)
            .copied()
            .unwrap_or(0);
        let (d, w, f) = (dims.d, dims.width, dims.ffn);

        // Mask tables: per-query key limits (shared by the batch) and one padding range per sample.
        let mut limits = key_limits_from_blocks(&layout.block_ids, first_row, rows)
            .map_err(cuda_err("attention mask"))?;
        let mut pads = Vec::with_capacity(2 * b);
        let mut any_pad = false;
        let mut scattered = false;
        for valid in &layout.key_valid {
            match key_pad_from_valid(valid) {
                Ok(pad) => {
                    let (lo, hi) = pad.unwrap_or((0, 0));
                    any_pad |= pad.is_some();
                    pads.extend([lo, hi]);
                }
                Err(_) => scattered = true,
            }
        }
        // Padded keys in several ranges: attention runs over the valid keys only, gathered per sample.
        let mut compact = None;
        if scattered {
            if cached {
                return Err(DitError::Input(
                    "padded text rows in several ranges of the prefix: the cached step needs them in one contiguous \
                     range per sample"
                        .into(),
                ));
            }
            let plan = CompactKeys::plan(&layout.key_valid, &limits)?;
            limits = plan.limits.clone();
            pads = plan.pads.clone();
            any_pad = true;
            let bytes = b * plan.num_keys * w * BF16;
            let mut k = alloc(ctx, bytes, "compacted keys")?;
            let mut v = alloc(ctx, bytes, "compacted values")?;
            // Rows past a sample's valid keys are masked, but must hold finite values.
            k.fill_u8(0, None)
                .map_err(cuda_err("clearing compacted keys"))?;
            v.fill_u8(0, None)
                .map_err(cuda_err("clearing compacted values"))?;
            compact = Some((plan, k, v));
        }
        // RoPE tables, 64 pairs per row (unused pairs rotate by 0), repeated per sample.
        let (cos, sin) = host::rope_tables(
            &layout.positions[first_row..],
            self.config.axes_dims_rope,
            ROPE_THETA,
        );
        let half = dims.head_dim / 2;
        let mut cos_t = vec![1f32; total * HEAD_DIM / 2];
        let mut sin_t = vec![0f32; total * HEAD_DIM / 2];
        for bi in 0..b {
            for r in 0..rows {
                let at = (bi * rows + r) * HEAD_DIM / 2;
                cos_t[at..at + half].copy_from_slice(&cos[r * half..(r + 1) * half]);
                sin_t[at..at + half].copy_from_slice(&sin[r * half..(r + 1) * half]);
            }
        }
        let mut rope_cos = alloc(ctx, cos_t.len() * 4, "rope")?;
        rope_cos
            .upload(0, &le_bytes(&cos_t, f32::to_le_bytes))
            .map_err(cuda_err("uploading rope tables"))?;
        let mut rope_sin = alloc(ctx, sin_t.len() * 4, "rope")?;
        rope_sin
            .upload(0, &le_bytes(&sin_t, f32::to_le_bytes))
            .map_err(cuda_err("uploading rope tables"))?;
        let mut key_limits = alloc(ctx, limits.len() * 4, "mask")?;
        key_limits
            .upload(0, &le_bytes(&limits, i32::to_le_bytes))
            .map_err(cuda_err("uploading key limits"))?;
        let key_pad = if any_pad {
            let mut buf = alloc(ctx, pads.len() * 4, "mask")?;
            buf.upload(0, &le_bytes(&pads, i32::to_le_bytes))
                .map_err(cuda_err("uploading key padding"))?;
            Some(buf)
        } else {
            None
        };
        let extract = if mode == KvMode::Extract {
            let bytes = dims.layers * 2 * b * layout.prefix_len * w * BF16;
            Some(GpuKvCache {
                id: 0,
                batch: b,
                prefix_len: layout.prefix_len,
                width: w,
                layers: dims.layers,
                buffer: alloc(ctx, bytes, "KV extract")?,
            })
        } else {
            None
        };
        let text_rows = if cached { 0 } else { b * l_vlm };
        Ok(Workspace {
            mode,
            rows,
            first_row,
            n_t,
            n_img,
            l_vlm,
            runs: runs(&layout, first_row),
            layout,
            timesteps: alloc(ctx, n_t * 4, "timestep")?,
            sinusoid: alloc(ctx, n_t * TIMESTEP_DIM * BF16, "timestep")?,
            temb1: alloc(ctx, n_t * d * BF16, "timestep")?,
            temb2: alloc(ctx, n_t * d * BF16, "timestep")?,
            modulation: alloc(ctx, n_t * 5 * d * BF16, "modulation")?,
            hidden_in: alloc(ctx, b * n_img * dims.in_ch * BF16, "input")?,
            text_in: alloc(ctx, text_rows * dims.ctx * BF16, "input")?,
            text_normed: alloc(ctx, text_rows * dims.ctx * BF16, "text")?,
            text_hidden: alloc(ctx, text_rows * d * BF16, "text")?,
            x: alloc(ctx, total * d * BF16, "activation")?,
            normed: alloc(ctx, total * d * BF16, "activation")?,
            qkv: alloc(ctx, total * 3 * w * BF16, "qkv")?,
            q: alloc(ctx, total * w * BF16, "q")?,
            k: alloc(ctx, total * w * BF16, "k")?,
            v: alloc(ctx, total * w * BF16, "v")?,
            attn: alloc(ctx, total * w * BF16, "attention")?,
            proj: alloc(ctx, total * d * BF16, "activation")?,
            gate_up: alloc(ctx, total * 2 * f * BF16, "mlp")?,
            act: alloc(ctx, total * f * BF16, "mlp")?,
            out: alloc(ctx, total * dims.out_ch * 4, "output")?,
            rope_cos,
            rope_sin,
            key_limits,
            key_pad,
            compact,
            extract,
            warmed: false,
            graphs: GraphCache::new(MAX_GRAPHS),
        })
    }

    fn weight(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, DitError> {
        span(&self.weights, offset, bytes)
    }

    /// `y[m, n] = x[m, k] . w[n, k]^T` on the stream.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        f32_out: bool,
    ) -> Result<(), DitError> {
        let linear = Linear::new(m, n, k, x, w, y).f32_output(f32_out);
        // SAFETY: every span lies inside a live buffer of this engine or of the workspace in use (checked by
        // `span`); those buffers outlive the step: the forward synchronizes the stream before returning, and
        // graphs are stored with (and dropped before reuse of) the workspace whose buffers they reference.
        Ok(unsafe { self.gemms.run(&linear, &self.stream) }?)
    }

    /// Enqueues one step on the stream (no host synchronisation), calling `probe` after each launch group.
    fn enqueue_step<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        cache: Option<&GpuKvCache>,
        probe: &mut P,
    ) -> Result<(), DitError> {
        let dims = &self.dims;
        let (d, w, f) = (dims.d, dims.width, dims.ffn);
        let k_ = &self.kernels;
        let st = &self.stream;
        let o = &self.offsets;
        let b = ws.layout.batch;
        let s = ws.layout.seq_len;
        let p = ws.layout.prefix_len;
        let rows = ws.rows;
        let total = b * rows;
        let n_t = ws.n_t;
        let cached = ws.mode == KvMode::Cached;
        let launch = |e: tf_cuda::Error| DitError::Gpu(gpu_error("kernel launch", e));
        // Ends a phase for the probe; the work is evaluated only by probes that use it.
        macro_rules! phase {
            ($name:expr, $kind:ident, $amount:expr) => {
                probe.mark(st, $name, || PhaseWork::$kind(($amount) as f64))?;
            };
        }

        // Timestep embedding -> shared modulation [n_t, 5D].
        k_.timestep_embedding(
            st,
            &ws.timesteps.view(),
            &mut ws.sinusoid.view_mut(),
            n_t,
            TIMESTEP_DIM,
            1000.0,
            10000.0,
        )
        .map_err(launch)?;
        self.gemm(
            n_t,
            d,
            TIMESTEP_DIM,
            (&ws.sinusoid).into(),
            self.weight(o.time1, d * TIMESTEP_DIM * BF16)?,
            (&ws.temb1).into(),
            false,
        )?;
        k_.silu_inplace(st, &mut ws.temb1.view_mut(), n_t * d)
            .map_err(launch)?;
        self.gemm(
            n_t,
            d,
            d,
            (&ws.temb1).into(),
            self.weight(o.time2, d * d * BF16)?,
            (&ws.temb2).into(),
            false,
        )?;
        k_.silu_inplace(st, &mut ws.temb2.view_mut(), n_t * d)
            .map_err(launch)?;
        self.gemm(
            n_t,
            5 * d,
            d,
            (&ws.temb2).into(),
            self.weight(o.mod_out, 5 * d * d * BF16)?,
            (&ws.modulation).into(),
            false,
        )?;
        phase!(
            "timestep+modulation",
            Bytes,
            (TIMESTEP_DIM + 6 * d) * d * BF16
        );

        // Text rows through txt_in (not needed when the prefix is cached).
        let l = ws.l_vlm;
        if !cached && l > 0 {
            k_.rms_norm_zc(
                st,
                &ws.text_in.view(),
                Matrix::dense(b * l, dims.ctx),
                &mut ws.text_normed.view_mut(),
                dims.ctx,
                &self
                    .weights
                    .slice(o.txt_norm, dims.ctx * BF16)
                    .map_err(launch)?,
                dims.eps,
            )
            .map_err(launch)?;
            self.gemm(
                b * l,
                d,
                dims.ctx,
                (&ws.text_normed).into(),
                self.weight(o.txt_in, d * dims.ctx * BF16)?,
                (&ws.text_hidden).into(),
                false,
            )?;
            k_.gelu_tanh_inplace(st, &mut ws.text_hidden.view_mut(), b * l * d)
                .map_err(launch)?;
            phase!("txt_in", Flops, 2 * b * l * d * dims.ctx);
        }
        // The joint sequence: each run of text rows / image tokens projected straight into its rows of x.
        for bi in 0..b {
            for run in &ws.runs {
                let dst_row = bi * rows + run.pos - ws.first_row;
                let y = span(&ws.x, dst_row * d * BF16, run.len * d * BF16)?;
                if run.text {
                    let x = span(
                        &ws.text_hidden,
                        (bi * l + run.src) * d * BF16,
                        run.len * d * BF16,
                    )?;
                    self.gemm(
                        run.len,
                        d,
                        d,
                        x,
                        self.weight(o.txt_out, d * d * BF16)?,
                        y,
                        false,
                    )?;
                } else {
                    let x = span(
                        &ws.hidden_in,
                        (bi * ws.n_img + run.src) * dims.in_ch * BF16,
                        run.len * dims.in_ch * BF16,
                    )?;
                    self.gemm(
                        run.len,
                        d,
                        dims.in_ch,
                        x,
                        self.weight(o.img_in, d * dims.in_ch * BF16)?,
                        y,
                        false,
                    )?;
                }
            }
        }

        phase!(
            "img_in+txt_out",
            Flops,
            ws.runs
                .iter()
                .map(|r| 2 * b * r.len * d * if r.text { d } else { dims.in_ch })
                .sum::<usize>()
        );

        let select = if cached {
            ModulationRows::targets_only(rows)
        } else if self.config.causal_condition {
            ModulationRows {
                seq_len: s,
                target_begin: p,
                prefix_row: b,
            }
        } else {
            ModulationRows {
                seq_len: s,
                target_begin: 0,
                prefix_row: 0,
            }
        };
        let mod_view = ws.modulation.view();
        let modulation = |offset: usize| Modulation {
            data: &mod_view,
            rows: n_t,
            stride: 5 * d,
            offset,
        };
        let x_layout = Matrix::dense(total, d);
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let row_strides = |n: usize| Strides {
            batch: n * w,
            row: w,
        };
        let limits_view = ws.key_limits.view();
        let pad_view = ws.key_pad.as_ref().map(DeviceBuffer::view);

        // The first block's adaLN runs alone; every later norm is fused with the gated residual before it.
        k_.adaln_modulate(
            st,
            &ws.x.view(),
            x_layout,
            &mut ws.normed.view_mut(),
            d,
            &modulation(0),
            select,
            dims.eps,
        )
        .map_err(launch)?;
        phase!("adaln1 (block 0)", Bytes, 2 * total * d * BF16);
        let last_layer = o.blocks.len().saturating_sub(1);
        for (layer, bo) in o.blocks.iter().enumerate() {
            // Attention half (its adaLN ran at the end of the previous block).
            self.gemm(
                total,
                3 * w,
                d,
                (&ws.normed).into(),
                self.weight(bo.qkv, 3 * w * d * BF16)?,
                (&ws.qkv).into(),
                false,
            )?;
            phase!("qkv GEMM", Flops, 2 * total * 3 * w * d);
            {
                let qkv_view = ws.qkv.view();
                let qw = self
                    .weights
                    .slice(bo.norm_q, HEAD_DIM * BF16)
                    .map_err(launch)?;
                let kw = self
                    .weights
                    .slice(bo.norm_k, HEAD_DIM * BF16)
                    .map_err(launch)?;
                let (cos_v, sin_v) = (ws.rope_cos.view(), ws.rope_sin.view());
                let inputs = QkvInputs {
                    qkv: &qkv_view,
                    qkv_layout: Matrix::dense(total, 3 * w),
                    heads: dims.heads,
                    q_weight: &qw,
                    k_weight: &kw,
                    eps: dims.eps,
                    rope_cos: &cos_v,
                    rope_sin: &sin_v,
                    rope_stride: HEAD_DIM / 2,
                };
                let (mut qv, mut kv, mut vv) = (ws.q.view_mut(), ws.k.view_mut(), ws.v.view_mut());
                let mut outputs = QkvOutputs {
                    q: &mut qv,
                    q_stride: w,
                    k: &mut kv,
                    k_stride: w,
                    v: &mut vv,
                    v_stride: w,
                };
                k_.qk_norm_rope(st, &inputs, &mut outputs).map_err(launch)?;
                phase!("qk-norm+rope", Bytes, 2 * total * 3 * w * BF16);
            }
            if let Some(extract) = ws.extract.as_mut() {
                let plane = extract.plane_bytes();
                for (which, src) in [(0usize, &ws.k), (1, &ws.v)] {
                    let at = extract.offset(layer, which);
                    for bi in 0..b {
                        let src_view =
                            src.slice(bi * s * w * BF16, p * w * BF16).map_err(launch)?;
                        let mut dst = extract
                            .buffer
                            .slice_mut(at + bi * (plane / b.max(1)), p * w * BF16)
                            .map_err(launch)?;
                        if p > 0 {
                            k_.copy_rows(st, &src_view, Matrix::dense(p, w), &mut dst, w)
                                .map_err(launch)?;
                        }
                    }
                }
                phase!("kv extract copy", Bytes, 2 * 2 * b * p * w * BF16);
            }
            {
                if let Some((plan, ck, cv)) = ws.compact.as_mut() {
                    for (src, dst) in [(&ws.k, &mut *ck), (&ws.v, &mut *cv)] {
                        for (bi, sample) in plan.runs.iter().enumerate() {
                            for &(from, to, len) in sample {
                                let src_view = src
                                    .slice((bi * s + from) * w * BF16, len * w * BF16)
                                    .map_err(launch)?;
                                let mut dst_view = dst
                                    .slice_mut((bi * plan.num_keys + to) * w * BF16, len * w * BF16)
                                    .map_err(launch)?;
                                k_.copy_rows(
                                    st,
                                    &src_view,
                                    Matrix::dense(len, w),
                                    &mut dst_view,
                                    w,
                                )
                                .map_err(launch)?;
                            }
                        }
                    }
                    phase!(
                        "key compaction copy",
                        Bytes,
                        2 * 2 * plan.runs.iter().flatten().map(|r| r.2).sum::<usize>() * w * BF16
                    );
                }
                let (num_keys, limit_stride, kv_rows) = match &ws.compact {
                    Some((plan, _, _)) => (plan.num_keys, rows, plan.num_keys),
                    None => (s, 0, rows),
                };
                let (kv, vv) = match &ws.compact {
                    Some((_, ck, cv)) => (ck.view(), cv.view()),
                    None => (ws.k.view(), ws.v.view()),
                };
                let qv = ws.q.view();
                let prefix_views = match cache {
                    Some(c) if cached => Some((
                        c.buffer
                            .slice(c.offset(layer, 0), c.plane_bytes())
                            .map_err(launch)?,
                        c.buffer
                            .slice(c.offset(layer, 1), c.plane_bytes())
                            .map_err(launch)?,
                    )),
                    _ => None,
                };
                let inputs = AttentionInputs {
                    q: &qv,
                    q_strides: row_strides(rows),
                    prefix: prefix_views
                        .as_ref()
                        .map(|(kp, vp)| (kp, vp, row_strides(p))),
                    k: &kv,
                    v: &vv,
                    kv_strides: row_strides(kv_rows),
                    key_limit: Some((&limits_view, limit_stride)),
                    key_pad: pad_view.as_ref(),
                    scale,
                };
                let shape = AttentionShape {
                    batch: b,
                    num_queries: rows,
                    num_keys,
                    prefix_len: if cached { p } else { 0 },
                    num_heads: dims.heads,
                    num_kv_heads: dims.heads,
                };
                k_.attention_with(
                    st,
                    self.attention_tile,
                    shape,
                    &inputs,
                    &mut ws.attn.view_mut(),
                    row_strides(rows),
                )
                .map_err(launch)?;
                phase!("attention", Flops, attention_flops(shape));
            }
            self.gemm(
                total,
                d,
                w,
                (&ws.attn).into(),
                self.weight(bo.to_out, d * w * BF16)?,
                (&ws.proj).into(),
                false,
            )?;
            phase!("out GEMM", Flops, 2 * total * d * w);
            k_.gated_residual_adaln(
                st,
                &mut ws.x.view_mut(),
                x_layout,
                &ws.proj.view(),
                d,
                &mut ws.normed.view_mut(),
                d,
                &modulation(d),
                &modulation(2 * d),
                select,
                dims.eps,
            )
            .map_err(launch)?;
            phase!("residual1+adaln2", Bytes, 4 * total * d * BF16);

            // MLP half.
            self.gemm(
                total,
                2 * f,
                d,
                (&ws.normed).into(),
                self.weight(bo.gate_up, 2 * f * d * BF16)?,
                (&ws.gate_up).into(),
                false,
            )?;
            phase!("gate_up GEMM", Flops, 2 * total * 2 * f * d);
            k_.swiglu(
                st,
                &ws.gate_up.view(),
                Matrix::dense(total, 2 * f),
                &mut ws.act.view_mut(),
                f,
            )
            .map_err(launch)?;
            phase!("swiglu", Bytes, 3 * total * f * BF16);
            self.gemm(
                total,
                d,
                f,
                (&ws.act).into(),
                self.weight(bo.mlp_out, d * f * BF16)?,
                (&ws.proj).into(),
                false,
            )?;
            phase!("down GEMM", Flops, 2 * total * d * f);
            // The next block's adaLN, or norm_out after the last block.
            let next_scale = if layer == last_layer { 4 * d } else { 0 };
            k_.gated_residual_adaln(
                st,
                &mut ws.x.view_mut(),
                x_layout,
                &ws.proj.view(),
                d,
                &mut ws.normed.view_mut(),
                d,
                &modulation(3 * d),
                &modulation(next_scale),
                select,
                dims.eps,
            )
            .map_err(launch)?;
            phase!("residual2+adaln1", Bytes, 4 * total * d * BF16);
        }
        if o.blocks.is_empty() {
            // No block: norm_out reads x as embedded (a degenerate config, kept correct).
            k_.adaln_modulate(
                st,
                &ws.x.view(),
                x_layout,
                &mut ws.normed.view_mut(),
                d,
                &modulation(4 * d),
                select,
                dims.eps,
            )
            .map_err(launch)?;
            phase!("norm_out", Bytes, 2 * total * d * BF16);
        }
        self.gemm(
            total,
            dims.out_ch,
            d,
            (&ws.normed).into(),
            self.weight(o.proj_out, dims.out_ch * d * BF16)?,
            (&ws.out).into(),
            true,
        )?;
        phase!("proj_out GEMM", Flops, 2 * total * dims.out_ch * d);
        Ok(())
    }

    /// Captures the graph of this workspace for `cache` unless it is cached, then replays it on the stream.
    fn replay(&self, ws: &mut Workspace, cache: Option<&GpuKvCache>) -> Result<(), DitError> {
        let key = cache.map_or(0, |c| c.id);
        // The cache lives in the workspace whose buffers the capture records; it is out of it while capturing.
        let mut graphs = std::mem::replace(&mut ws.graphs, GraphCache::new(MAX_GRAPHS));
        let result = graphs
            .capture(
                key,
                &self.stream,
                || self.enqueue_step(ws, cache, &mut NoProbe),
                |what, e| cuda_err(what)(e),
            )
            .and_then(|graph| {
                graph
                    .launch(&self.stream)
                    .map_err(cuda_err("replaying the step graph"))
            });
        ws.graphs = graphs;
        result
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
        let cache = match kv {
            KvStep::Cached(c) => Some(c),
            _ => None,
        };
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
            engine.enqueue_step(ws, cache, &mut NoProbe)?;
            ws.warmed = true;
        }
        let mut kv_cache = None;
        if let (Some(mut fresh), Some(extract)) = (fresh, ws.extract.as_ref()) {
            fresh
                .buffer
                .copy_from(0, extract.buffer.view(), Some(&engine.stream))
                .map_err(cuda_err("copying the extracted KV cache"))?;
            kv_cache = Some(fresh);
        }
        engine
            .stream
            .synchronize()
            .map_err(cuda_err("running the DiT step"))?;
        let values: Vec<f32> = ws
            .out
            .to_vec()
            .map_err(cuda_err("downloading the sample"))?;
        let sample = Tensor::new(vec![ws.layout.batch, ws.rows, engine.dims.out_ch], values)?;
        Ok(DitOutput { sample, kv_cache })
    }

    fn kv_to_host(&self, cache: &GpuKvCache) -> Result<HostKvCache, DitError> {
        let dims = &self.engine.dims;
        let bits: Vec<u16> = cache
            .buffer
            .to_vec()
            .map_err(cuda_err("downloading the KV cache"))?;
        let (b, p, w) = (cache.batch, cache.prefix_len, cache.width);
        let mut layers = Vec::with_capacity(cache.layers);
        for layer in 0..cache.layers {
            let mut kv = Vec::with_capacity(2);
            for which in 0..2 {
                let base = cache.offset(layer, which) / BF16;
                let mut values = Vec::with_capacity(b * p * dims.heads * dims.head_dim);
                for t in 0..b * p {
                    for h in 0..dims.heads {
                        let at = base + t * w + h * HEAD_DIM;
                        let src = bits.get(at..at + dims.head_dim).ok_or_else(|| {
                            DitError::KvCache("device cache is shorter than its shape".into())
                        })?;
                        values.extend(src.iter().map(|&x| bf16_value(x)));
                    }
                }
                kv.push(TensorF32::new(
                    vec![b, p, dims.heads, dims.head_dim],
                    values,
                )?);
            }
            let v = kv.pop();
            let k = kv.pop();
            if let (Some(k), Some(v)) = (k, v) {
                layers.push((k, v));
            }
        }
        Ok(HostKvCache {
            batch: b,
            prefix_len: p,
            heads: dims.heads,
            head_dim: dims.head_dim,
            layers,
        })
    }

    fn kv_from_host(&mut self, cache: HostKvCache) -> Result<GpuKvCache, DitError> {
        cache.check(&self.engine.config, cache.batch, cache.prefix_len)?;
        let dims = self.engine.dims;
        let mut gpu = self.alloc_cache(cache.batch, cache.prefix_len)?;
        let (b, p, w) = (cache.batch, cache.prefix_len, dims.width);
        let mut bits = vec![0u16; gpu.buffer.len() / BF16];
        for (layer, (k, v)) in cache.layers.iter().enumerate() {
            for (which, t) in [(0usize, k), (1, v)] {
                let base = gpu.offset(layer, which) / BF16;
                for (token, row) in t
                    .data()
                    .chunks_exact(dims.heads * dims.head_dim)
                    .enumerate()
                    .take(b * p)
                {
                    for (h, head) in row.chunks_exact(dims.head_dim).enumerate() {
                        let at = base + token * w + h * HEAD_DIM;
                        for (dst, &x) in bits[at..at + dims.head_dim].iter_mut().zip(head) {
                            *dst = bf16_bits(x);
                        }
                    }
                }
            }
        }
        let bytes: Vec<u8> = bits.iter().flat_map(|x| x.to_le_bytes()).collect();
        gpu.buffer
            .upload(0, &bytes)
            .map_err(cuda_err("uploading the KV cache"))?;
        Ok(gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qwen_image::dit::TokenSource::{Image, Text};

    fn layout_of(sources: Vec<TokenSource>, prefix_len: usize) -> JointLayout {
        let seq_len = sources.len();
        JointLayout {
            batch: 1,
            seq_len,
            n_target: seq_len - prefix_len,
            prefix_len,
            block_ids: vec![-1; seq_len],
            positions: vec![[0; 3]; seq_len],
            row_mod: vec![0; seq_len],
            n_mod: 1,
            key_valid: vec![vec![true; seq_len]],
            sources,
        }
    }

    #[test]
    fn runs_split_on_kind_and_on_the_first_row() {
        let l = layout_of(
            vec![
                Text(0),
                Text(1),
                Image(0),
                Image(1),
                Image(2),
                Image(3),
                Text(2),
                Image(4),
                Image(5),
            ],
            8,
        );
        assert_eq!(
            runs(&l, 0),
            vec![
                Run {
                    text: true,
                    src: 0,
                    pos: 0,
                    len: 2
                },
                Run {
                    text: false,
                    src: 0,
                    pos: 2,
                    len: 4
                },
                Run {
                    text: true,
                    src: 2,
                    pos: 6,
                    len: 1
                },
                Run {
                    text: false,
                    src: 4,
                    pos: 7,
                    len: 2
                },
            ]
        );
        // Cached: only the rows from the target on; a run straddling the boundary is clipped.
        assert_eq!(
            runs(&l, 8),
            vec![Run {
                text: false,
                src: 5,
                pos: 8,
                len: 1
            }]
        );
        let total: usize = runs(&l, 3).iter().map(|r| r.len).sum();
        assert_eq!(total, 6);
    }

    #[test]
    fn compaction_keeps_every_visible_set() {
        // Two samples of 6 keys; sample 1 has padding at 1 and 4 (two ranges).
        let valid = vec![vec![true; 6], vec![true, false, true, true, false, true]];
        let limits = vec![1, 2, 3, 4, 5, 6];
        let plan = CompactKeys::plan(&valid, &limits).unwrap();
        assert_eq!(plan.num_keys, 6);
        assert_eq!(plan.runs[0], vec![(0, 0, 6)]);
        assert_eq!(plan.runs[1], vec![(0, 0, 1), (2, 1, 2), (5, 3, 1)]);
        assert_eq!(&plan.limits[..6], &limits[..]);
        assert_eq!(&plan.limits[6..], &[1, 1, 2, 3, 3, 4]);
        assert_eq!(plan.pads, vec![6, 6, 4, 6]);
        // Visible sets agree: key k of sample 1 is seen by query q iff valid and k < limit[q].
        for (q, &limit) in limits.iter().enumerate() {
            let original: Vec<usize> = (0..6)
                .filter(|&k| valid[1][k] && (k as i32) < limit)
                .collect();
            let compacted = plan.limits[6 + q] as usize;
            let mut kept = Vec::new();
            for &(from, to, len) in &plan.runs[1] {
                for i in 0..len {
                    if to + i < compacted {
                        kept.push(from + i);
                    }
                }
            }
            assert_eq!(kept, original, "query {q}");
        }
    }

    fn tiny_dims() -> Dims {
        Dims {
            d: 32,
            heads: 2,
            head_dim: 16,
            width: 256,
            ffn: 96,
            in_ch: 16,
            ctx: 24,
            out_ch: 16,
            layers: 2,
            eps: 1e-6,
        }
    }

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn padded_heads_keep_the_rms_and_the_products() {
        let dims = tiny_dims();
        let s = dims.qk_scale();
        // q rows: head h, channel i, column c = 100 h + 10 i + c.
        let cols = 3;
        let q: Vec<f32> = (0..dims.heads * dims.head_dim * cols)
            .map(|j| j as f32)
            .collect();
        let padded = f32s(&reshape(&q, Transform::PadRows { cols, scale: s }, &dims).unwrap());
        assert_eq!(padded.len(), dims.heads * HEAD_DIM * cols);
        for h in 0..dims.heads {
            for i in 0..HEAD_DIM {
                for c in 0..cols {
                    let got = padded[(h * HEAD_DIM + i) * cols + c];
                    let want = if i < dims.head_dim {
                        q[(h * dims.head_dim + i) * cols + c] * s
                    } else {
                        0.0
                    };
                    assert_eq!(got, want);
                }
            }
        }
        // A 128-wide mean square of the scaled, padded head equals the true head_dim-wide mean square.
        let head: Vec<f32> = (0..dims.head_dim).map(|i| (i as f32 - 7.5) * 0.3).collect();
        let true_ms: f32 = head.iter().map(|v| v * v).sum::<f32>() / dims.head_dim as f32;
        let padded_ms: f32 = head.iter().map(|v| (v * s) * (v * s)).sum::<f32>() / HEAD_DIM as f32;
        assert!((true_ms - padded_ms).abs() <= 1e-5 * true_ms);
        // to_out columns: [rows, heads * hd] -> [rows, heads * 128], zeros in the padding.
        let out: Vec<f32> = (0..2 * dims.heads * dims.head_dim)
            .map(|j| 1.0 + j as f32)
            .collect();
        let padded = f32s(&reshape(&out, Transform::PadCols { rows: 2 }, &dims).unwrap());
        assert_eq!(padded.len(), 2 * dims.width);
        assert_eq!(padded[HEAD_DIM], out[dims.head_dim]);
        assert_eq!(padded[dims.head_dim], 0.0);
        assert_eq!(
            padded[dims.width + HEAD_DIM + 1],
            out[dims.heads * dims.head_dim + dims.head_dim + 1]
        );
        let norm = f32s(&reshape(&[2.0; 16], Transform::PadVec { scale: 1.0 / s }, &dims).unwrap());
        assert_eq!(norm.len(), HEAD_DIM);
        assert!((norm[0] - 2.0 / s).abs() < 1e-6 && norm[16] == 0.0);
        assert!(reshape(&[1.0; 5], Transform::PadVec { scale: 1.0 }, &dims).is_err());
    }

    #[test]
    fn dims_refuse_what_the_kernels_cannot_run() {
        let mut cfg = QwenImageDitConfig::default_full_size();
        assert!(Dims::of(&cfg).is_ok());
        assert!(!Dims::of(&cfg).unwrap().padded());
        cfg.attention_head_dim = 256;
        cfg.axes_dims_rope = [32, 112, 112];
        assert!(Dims::of(&cfg)
            .unwrap_err()
            .to_string()
            .contains("attention_head_dim"));
        let mut cfg = QwenImageDitConfig::default_full_size();
        cfg.context_in_dim = 4100;
        assert!(Dims::of(&cfg)
            .unwrap_err()
            .to_string()
            .contains("multiple of 8"));
    }
}
