//! The Qwen-Image 2.1 text encoder (the Qwen3-VL text path) on the GPU: bf16 storage, f32 accumulation,
//! cuBLASLt GEMMs, the shared norm, RoPE and embedding kernels ([`crate::nn::gpu`]) and the DiT's flash attention and
//! SwiGLU ([`crate::nn::gpu`]), with the same interface as the host reference
//! ([`super::text_encoder::HostTextEncoder`]).
//!
//! - Weights stream from the safetensors map through pinned staging ([`crate::nn::upload`]) into one device
//!   allocation, fused per layer: `q|k|v` as one `[(heads + 2 kv_heads) * 128, hidden]` weight and `gate|up` as
//!   one `[2 * intermediate, hidden]`. The final norm is not loaded: [`GpuTextEncoder::features_at`] returns
//!   `hidden_states[layer]` as the host reference does, running no layer past `layer` (Qwen-Image reads the last
//!   layer's output before the norm; MiniMax H3 reads layer 50). Prompt templates (the rows Qwen-Image drops) are
//!   the engines' own. A load capped at `n` layers ([`LoadOptions::layers`], [`GpuTextEncoder::load_with_options`])
//!   reads, uploads and allocates decoder layers `0..n` only (H3 at 50 of Qwen3-VL-32B's 64 layers holds about
//!   14 GB less) and refuses a hidden state past `n`.
//! - A layer is: RMSNorm, fused qkv GEMM, in-place per-head QK RMSNorm + rotate-half RoPE on the q and k columns,
//!   causal grouped-query attention reading q, k, v straight from the fused rows, o-proj GEMM accumulating into
//!   the residual stream (`beta = 1`), RMSNorm, gate|up GEMM, SwiGLU, down GEMM accumulating into the residual.
//! - Workspaces are sized for a row capacity (rounded up to [`ROW_QUANTUM`]) and grow when a longer prompt
//!   comes; the causal key limits and RoPE tables (positions from 0) are built once per capacity. The GEMMs run
//!   over the prompt's rows rounded up to the quantum, so prompts of similar length share GEMM plans and a new
//!   prompt length plans nothing inside a request.
//! - Only head dim 128 runs (the attention kernel's width): other configs are refused at load.
//!
//! Invariant: no host synchronisation inside a forward; the one sync is before reading the features back.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen3_vl::text_encoder_gpu::GpuTextEncoder;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let mut encoder = GpuTextEncoder::load(&ModelDir::open(Path::new("text_encoder"))?)?;
//! println!("{} B resident", encoder.resident_bytes());
//! let last = encoder.config().num_hidden_layers;
//! let features = encoder.features_at(&[151644, 8948, 198, 9707], last)?;
//! assert_eq!(features.shape(), &[4, encoder.config().hidden_size]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use tf_cuda::cublaslt::{AlgoSelection, DeviceSpan};
use tf_cuda::{Context, DeviceBuffer, Event, Stream};

use super::text_encoder::{check_reachable, LoadOptions, TextEncoderConfig, TextEncoderError};
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, GemmShape, Linear};
use crate::nn::gpu::{
    rotate_half_rope_tables, AttentionInputs, AttentionShape, AttentionTile, GpuDevice, Matrix,
    NnKernels, QkNormRope, Strides, HEAD_DIM, MAX_NORM_COLS as MAX_TEXT_NORM_COLS,
};
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::upload::{upload_pieces, Piece, StagingConfig, UploadStats};
use crate::nn::weights::{le_bytes, LayoutPlanner, ModelDir, ALIGN, BF16, FLOAT_DTYPES};

/// Workspaces hold a multiple of this many rows, so prompts of similar length share one.
pub const ROW_QUANTUM: usize = 128;
/// Tensor name prefixes of the language model, tried in order (the same list as the host reference):
/// Qwen3-VL saved by transformers, an older VL layout, a text-only Qwen3.
const PREFIXES: [&str; 3] = ["model.language_model.", "language_model.model.", "model."];

/// A GPU failure as a [`TextEncoderError`]: the message names the step that failed and the cause.
fn gpu_err<E: IntoGpuError>(what: &str) -> impl FnOnce(E) -> TextEncoderError + '_ {
    move |e| TextEncoderError::Gpu(gpu_error(what, e))
}

/// Refuses a config the kernels cannot run, saying which limit it breaks.
pub fn check_supported(config: &TextEncoderConfig) -> Result<(), TextEncoderError> {
    let refuse = |why: String| {
        Err(TextEncoderError::Config(format!(
            "the GPU text encoder cannot run this config: {why}"
        )))
    };
    if config.head_dim != HEAD_DIM {
        return refuse(format!(
            "head_dim {} (the attention and QK-norm kernels are built for {HEAD_DIM}; use the host encoder)",
            config.head_dim
        ));
    }
    if config.num_key_value_heads == 0
        || !config
            .num_attention_heads
            .is_multiple_of(config.num_key_value_heads)
    {
        return refuse(format!(
            "{} attention heads are not a multiple of {} kv heads",
            config.num_attention_heads, config.num_key_value_heads
        ));
    }
    for (name, v) in [
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
    ] {
        if v == 0 || !v.is_multiple_of(8) {
            return refuse(format!(
                "{name} {v} is not a positive multiple of 8 (16-byte rows)"
            ));
        }
    }
    if config.hidden_size > MAX_TEXT_NORM_COLS {
        return refuse(format!(
            "hidden_size {} exceeds the norm kernel's {MAX_TEXT_NORM_COLS} columns",
            config.hidden_size
        ));
    }
    if config.vocab_size == 0 || i32::try_from(config.vocab_size).is_err() {
        return refuse(format!(
            "vocab_size {} must be in 1..=i32::MAX",
            config.vocab_size
        ));
    }
    if !(config.rms_norm_eps.is_finite() && config.rms_norm_eps >= 0.0) {
        return refuse(format!(
            "rms_norm_eps {} must be finite and >= 0",
            config.rms_norm_eps
        ));
    }
    if !(config.rope_theta.is_finite() && config.rope_theta > 1.0) {
        return refuse(format!(
            "rope_theta {} must be finite and > 1",
            config.rope_theta
        ));
    }
    Ok(())
}

/// Widths (elements) the forward uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dims {
    hidden: usize,
    ffn: usize,
    q_heads: usize,
    kv_heads: usize,
    /// Decoder layers held: `num_hidden_layers`, or the load's cap.
    layers: usize,
    vocab: usize,
}

impl Dims {
    fn of(config: &TextEncoderConfig, options: LoadOptions) -> Result<Dims, TextEncoderError> {
        check_supported(config)?;
        Ok(Dims {
            hidden: config.hidden_size,
            ffn: config.intermediate_size,
            q_heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            layers: options.kept_layers(config)?,
            vocab: config.vocab_size,
        })
    }

    /// Query width: q_heads * 128.
    fn q_width(&self) -> usize {
        self.q_heads * HEAD_DIM
    }

    /// Key (and value) width: kv_heads * 128.
    fn kv_width(&self) -> usize {
        self.kv_heads * HEAD_DIM
    }

    /// Fused q|k|v row width.
    fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
}

/// Device byte offsets of one layer's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LayerOffsets {
    input_norm: usize,
    /// `[qkv_width, hidden]`: q_proj, k_proj, v_proj rows.
    qkv: usize,
    /// q_norm then k_norm, 128 each.
    qk_norm: usize,
    o_proj: usize,
    post_norm: usize,
    /// `[2 ffn, hidden]`: gate_proj then up_proj rows.
    gate_up: usize,
    down: usize,
}

/// Device layout of every weight: one allocation of `total` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WeightLayout {
    embed: usize,
    layers: Vec<LayerOffsets>,
    total: usize,
}

/// A source tensor (relative to the model prefix), where it goes, and its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placement {
    name: String,
    offset: usize,
    shape: Vec<usize>,
}

impl WeightLayout {
    fn plan(d: &Dims) -> Result<WeightLayout, TextEncoderError> {
        let mut planner = LayoutPlanner::new(ALIGN);
        let h = d.hidden;
        let embed = planner.one(d.vocab * h * BF16)?;
        let mut layers = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            let input_norm = planner.one(h * BF16)?;
            let qkv = planner.one(d.qkv_width() * h * BF16)?;
            let qk_norm = planner.one(2 * HEAD_DIM * BF16)?;
            let o_proj = planner.one(h * d.q_width() * BF16)?;
            let post_norm = planner.one(h * BF16)?;
            let gate_up = planner.one(2 * d.ffn * h * BF16)?;
            let down = planner.one(h * d.ffn * BF16)?;
            layers.push(LayerOffsets {
                input_norm,
                qkv,
                qk_norm,
                o_proj,
                post_norm,
                gate_up,
                down,
            });
        }
        Ok(WeightLayout {
            embed,
            layers,
            total: planner.total()?,
        })
    }

    /// Every checkpoint tensor the encoder reads, with its device offset (fused groups split into parts).
    fn placements(&self, d: &Dims) -> Vec<Placement> {
        let (h, f) = (d.hidden, d.ffn);
        let mut out = vec![Placement {
            name: "embed_tokens.weight".into(),
            offset: self.embed,
            shape: vec![d.vocab, h],
        }];
        for (i, l) in self.layers.iter().enumerate() {
            let p = |name: &str, offset: usize, shape: Vec<usize>| Placement {
                name: format!("layers.{i}.{name}"),
                offset,
                shape,
            };
            let (qw, kw) = (d.q_width(), d.kv_width());
            out.extend([
                p("input_layernorm.weight", l.input_norm, vec![h]),
                p("self_attn.q_proj.weight", l.qkv, vec![qw, h]),
                p(
                    "self_attn.k_proj.weight",
                    l.qkv + qw * h * BF16,
                    vec![kw, h],
                ),
                p(
                    "self_attn.v_proj.weight",
                    l.qkv + (qw + kw) * h * BF16,
                    vec![kw, h],
                ),
                p("self_attn.q_norm.weight", l.qk_norm, vec![HEAD_DIM]),
                p(
                    "self_attn.k_norm.weight",
                    l.qk_norm + HEAD_DIM * BF16,
                    vec![HEAD_DIM],
                ),
                p("self_attn.o_proj.weight", l.o_proj, vec![h, qw]),
                p("post_attention_layernorm.weight", l.post_norm, vec![h]),
                p("mlp.gate_proj.weight", l.gate_up, vec![f, h]),
                p("mlp.up_proj.weight", l.gate_up + f * h * BF16, vec![f, h]),
                p("mlp.down_proj.weight", l.down, vec![h, f]),
            ]);
        }
        out
    }
}

/// Rows a workspace is sized for, for a prompt of `rows` rows.
fn capacity_for(rows: usize) -> usize {
    rows.max(1).div_ceil(ROW_QUANTUM) * ROW_QUANTUM
}

/// Causal key limits for positions `0..rows`: query `i` sees keys `0..=i`.
fn causal_limits(rows: usize) -> Result<Vec<i32>, TextEncoderError> {
    (1..=rows)
        .map(|limit| {
            i32::try_from(limit).map_err(|_| {
                TextEncoderError::Input(format!(
                    "{rows} rows do not fit the attention kernel's 32-bit positions"
                ))
            })
        })
        .collect()
}

/// Token ids as the kernel's i32 values, each checked against the vocabulary.
fn ids_to_i32(ids: &[u32], vocab: usize) -> Result<Vec<i32>, TextEncoderError> {
    ids.iter()
        .map(|&id| {
            usize::try_from(id)
                .ok()
                .filter(|&i| i < vocab)
                .and_then(|i| i32::try_from(i).ok())
                .ok_or_else(|| {
                    TextEncoderError::Input(format!(
                        "token id {id} is outside the vocabulary (0..{vocab})"
                    ))
                })
        })
        .collect()
}

/// Device buffers for prompts of up to `capacity` rows.
struct Workspace {
    capacity: usize,
    ids: DeviceBuffer,
    key_limits: DeviceBuffer,
    rope_cos: DeviceBuffer,
    rope_sin: DeviceBuffer,
    x: DeviceBuffer,
    normed: DeviceBuffer,
    qkv: DeviceBuffer,
    attn: DeviceBuffer,
    gate_up: DeviceBuffer,
    act: DeviceBuffer,
}

impl Workspace {
    fn bytes(&self) -> usize {
        [
            &self.ids,
            &self.key_limits,
            &self.rope_cos,
            &self.rope_sin,
            &self.x,
            &self.normed,
            &self.qkv,
            &self.attn,
            &self.gate_up,
            &self.act,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// The Qwen3-VL text encoder on the GPU.
pub struct GpuTextEncoder {
    config: TextEncoderConfig,
    dims: Dims,
    layout: WeightLayout,
    workspace: Option<Workspace>,
    weights: DeviceBuffer,
    gemms: GemmRunner,
    kernels: NnKernels,
    /// The pipeline's stream, shared by its components.
    stream: Arc<Stream>,
    ctx: Context,
    upload: Option<UploadStats>,
    /// `None`: the attention kernels' preferred tile for this GPU.
    attention_tile: Option<AttentionTile>,
}

impl std::fmt::Debug for GpuTextEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTextEncoder")
            .field("config", &self.config)
            .field("weight_bytes", &self.weights.len())
            .field(
                "workspace_rows",
                &self.workspace.as_ref().map(|w| w.capacity),
            )
            .finish_non_exhaustive()
    }
}

impl Drop for GpuTextEncoder {
    fn drop(&mut self) {
        // Work still queued (after an error mid-forward) must not outlive the buffers it reads; a failure here
        // means the context is gone, and then the buffers are gone with it.
        let _ = self.stream.synchronize();
    }
}

impl GpuTextEncoder {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuTextEncoder, TextEncoderError> {
        let driver = tf_cuda::open_driver().map_err(gpu_err("opening the CUDA driver"))?;
        let ctx = Context::new(driver, 0).map_err(gpu_err("creating a context on device 0"))?;
        GpuTextEncoder::load_on(&ctx, model)
    }

    /// Loads the language model of a transformers folder into `ctx` with the default staging.
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuTextEncoder, TextEncoderError> {
        GpuTextEncoder::load_with(ctx, model, StagingConfig::default())
    }

    /// Loads the language model of a transformers folder into `ctx`: checks the config and every tensor's
    /// shape, then streams the weights through `staging` into their fused device layout.
    pub fn load_with(
        ctx: &Context,
        model: &ModelDir,
        staging: StagingConfig,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        GpuTextEncoder::load_with_options(ctx, model, staging, LoadOptions::default())
    }

    /// [`Self::load_with`] keeping what `options` says: with a cap of `n`, the tensors of decoder layers `n..`
    /// are neither checked, read nor uploaded, the device allocation holds layers `0..n` only, and
    /// [`Self::features_at`] refuses a layer past `n`.
    pub fn load_with_options(
        ctx: &Context,
        model: &ModelDir,
        staging: StagingConfig,
        options: LoadOptions,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        let device = GpuDevice::on(ctx).map_err(gpu_err("creating a stream"))?;
        GpuTextEncoder::load_in(&device, model, staging, options)
    }

    /// [`Self::load_with_options`] onto `device`, whose stream every forward runs on (a pipeline's components
    /// share it).
    pub fn load_in(
        device: &GpuDevice,
        model: &ModelDir,
        staging: StagingConfig,
        options: LoadOptions,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        let ctx = device.context();
        let config = TextEncoderConfig::from_json(model.config_json())?;
        let dims = Dims::of(&config, options)?;
        let prefix = PREFIXES
            .iter()
            .find(|p| model.info(&format!("{p}embed_tokens.weight")).is_ok())
            .ok_or_else(|| {
                TextEncoderError::Config(format!(
                    "no embed_tokens.weight under any of the prefixes {PREFIXES:?}: not a Qwen3(-VL) checkpoint?"
                ))
            })?;
        let layout = WeightLayout::plan(&dims)?;
        let placements = layout.placements(&dims);
        for placement in &placements {
            let name = format!("{prefix}{}", placement.name);
            let info = model.info(&name)?;
            if info.shape != placement.shape {
                return Err(TextEncoderError::Weights(
                    crate::nn::weights::WeightsError::ShapeMismatch {
                        path: model.dir().to_path_buf(),
                        name,
                        expected: placement.shape.clone(),
                        actual: info.shape.clone(),
                    },
                ));
            }
            if !FLOAT_DTYPES.contains(&info.dtype) {
                return Err(TextEncoderError::Config(format!(
                    "{name} is stored as {}; the GPU upload reads F32, BF16 or F16",
                    info.dtype.header_name()
                )));
            }
        }
        let mut encoder = GpuTextEncoder::with_layout(device, config, dims, layout)?;
        let mut pieces = Vec::with_capacity(placements.len());
        for placement in &placements {
            let name = format!("{prefix}{}", placement.name);
            pieces.push(Piece::bf16(
                model.bytes(&name)?,
                model.info(&name)?.dtype,
                placement.offset,
            ));
        }
        let stats = upload_pieces(ctx, &encoder.stream, &mut encoder.weights, &pieces, staging)
            .map_err(gpu_err("uploading the weights"))?;
        encoder.upload = Some(stats);
        Ok(encoder)
    }

    /// An encoder of `config` with seeded random weights generated on the device (no file): linear and
    /// embedding weights uniform with standard deviation 0.02, norm weights uniform in [0.9, 1.1]. For
    /// benchmarks at full size; the same seed gives the same weights.
    pub fn random_on(
        ctx: &Context,
        config: TextEncoderConfig,
        seed: u32,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        GpuTextEncoder::random_with(ctx, config, seed, LoadOptions::default())
    }

    /// [`Self::random_on`] holding only the layers `options` keeps (the kept layers get the same weights as an
    /// uncapped encoder of the same seed).
    pub fn random_with(
        ctx: &Context,
        config: TextEncoderConfig,
        seed: u32,
        options: LoadOptions,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        let device = GpuDevice::on(ctx).map_err(gpu_err("creating a stream"))?;
        GpuTextEncoder::random_in(&device, config, seed, options)
    }

    /// [`Self::random_with`] on `device`'s stream.
    pub fn random_in(
        device: &GpuDevice,
        config: TextEncoderConfig,
        seed: u32,
        options: LoadOptions,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        let dims = Dims::of(&config, options)?;
        let layout = WeightLayout::plan(&dims)?;
        let placements = layout.placements(&dims);
        let mut encoder = GpuTextEncoder::with_layout(device, config, dims, layout)?;
        let uniform_std = 0.02f32 * 3f32.sqrt();
        for (i, placement) in placements.iter().enumerate() {
            let n: usize = placement.shape.iter().product();
            let (offset, scale) = if placement.shape.len() == 1 {
                (1.0, 0.1)
            } else {
                (0.0, uniform_std)
            };
            let mut view = encoder
                .weights
                .slice_mut(placement.offset, n * BF16)
                .map_err(gpu_err("slicing the weights"))?;
            let piece_seed = seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u32);
            encoder
                .kernels
                .fill_uniform(&encoder.stream, &mut view, n, piece_seed, offset, scale)
                .map_err(gpu_err("filling random weights"))?;
        }
        encoder
            .stream
            .synchronize()
            .map_err(gpu_err("filling random weights"))?;
        Ok(encoder)
    }

    /// Stream, kernels, cuBLASLt and the (uninitialised) weight allocation.
    fn with_layout(
        device: &GpuDevice,
        config: TextEncoderConfig,
        dims: Dims,
        layout: WeightLayout,
    ) -> Result<GpuTextEncoder, TextEncoderError> {
        let ctx = device.context();
        let stream = Arc::clone(device.stream());
        let kernels = NnKernels::load(ctx).map_err(gpu_err("loading kernels"))?;
        let gemms =
            GemmRunner::new(ctx, AlgoSelection::Heuristic).map_err(gpu_err("opening cuBLASLt"))?;
        let weights = DeviceBuffer::alloc(ctx, layout.total).map_err(|e| {
            TextEncoderError::Gpu(gpu_error(
                format!("allocating {} B of weights", layout.total),
                e,
            ))
        })?;
        Ok(GpuTextEncoder {
            config,
            dims,
            layout,
            workspace: None,
            weights,
            gemms,
            kernels,
            stream,
            ctx: ctx.clone(),
            upload: None,
            attention_tile: None,
        })
    }

    /// What the weight upload moved and how fast (`None` for random weights).
    pub fn upload_stats(&self) -> Option<UploadStats> {
        self.upload
    }

    /// Bytes of the device weight allocation.
    pub fn weight_bytes(&self) -> usize {
        self.weights.len()
    }

    /// Bytes of the device weight allocation a load of `config` with `options` makes (nothing is allocated).
    pub fn planned_weight_bytes(
        config: &TextEncoderConfig,
        options: LoadOptions,
    ) -> Result<usize, TextEncoderError> {
        Ok(WeightLayout::plan(&Dims::of(config, options)?)?.total)
    }

    /// Decoder layers held: `num_hidden_layers`, or the cap of a capped load. `hidden_states[0..=loaded_layers()]`
    /// are reachable.
    pub fn loaded_layers(&self) -> usize {
        self.layout.layers.len()
    }

    /// Device bytes this encoder holds: weights, the current workspace and the cuBLASLt workspace.
    pub fn resident_bytes(&self) -> usize {
        self.weights.len()
            + self.workspace.as_ref().map_or(0, Workspace::bytes)
            + self.gemms.workspace_bytes()
    }

    /// Rows the current workspace holds (0 before the first encode).
    pub fn workspace_rows(&self) -> usize {
        self.workspace.as_ref().map_or(0, |w| w.capacity)
    }

    /// Frees the workspace (the weights stay); the next encode allocates it again.
    pub fn clear_workspace(&mut self) {
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Runs attention with `tile` (`None`: the preferred tile of this GPU, the default). A tile this GPU cannot
    /// run makes the next encode fail with a message naming it.
    pub fn set_attention_tile(&mut self, tile: Option<AttentionTile>) {
        self.attention_tile = tile;
    }

    /// The attention tile encodes use.
    pub fn attention_tile(&self) -> AttentionTile {
        self.attention_tile
            .unwrap_or_else(|| self.kernels.preferred_tile())
    }

    /// The context the encoder lives in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Makes sure the workspace holds `rows` rows, allocating a larger one if needed.
    fn ensure_workspace(&mut self, rows: usize) -> Result<(), TextEncoderError> {
        if self.workspace.as_ref().is_some_and(|w| w.capacity >= rows) {
            return Ok(());
        }
        // Nothing queued may still use the old buffers when they are freed.
        self.stream
            .synchronize()
            .map_err(gpu_err("waiting before growing the workspace"))?;
        self.workspace = None;
        let cap = capacity_for(rows);
        let d = self.dims;
        let ctx = &self.ctx;
        let alloc = |bytes: usize, what: &str| {
            DeviceBuffer::alloc(ctx, bytes.div_ceil(ALIGN) * ALIGN).map_err(|e| {
                TextEncoderError::Gpu(gpu_error(
                    format!("allocating the {what} workspace ({bytes} B for {cap} rows)"),
                    e,
                ))
            })
        };
        let mut key_limits = alloc(cap * 4, "key limit")?;
        key_limits
            .upload(0, &le_bytes(&causal_limits(cap)?, i32::to_le_bytes))
            .map_err(gpu_err("uploading key limits"))?;
        let (cos, sin) = rotate_half_rope_tables(cap, self.config.rope_theta as f32);
        let mut rope_cos = alloc(cos.len() * 4, "rope")?;
        rope_cos
            .upload(0, &le_bytes(&cos, f32::to_le_bytes))
            .map_err(gpu_err("uploading rope tables"))?;
        let mut rope_sin = alloc(sin.len() * 4, "rope")?;
        rope_sin
            .upload(0, &le_bytes(&sin, f32::to_le_bytes))
            .map_err(gpu_err("uploading rope tables"))?;
        self.workspace = Some(Workspace {
            capacity: cap,
            ids: alloc(cap * 4, "token id")?,
            key_limits,
            rope_cos,
            rope_sin,
            x: alloc(cap * d.hidden * BF16, "hidden state")?,
            normed: alloc(cap * d.hidden * BF16, "normed")?,
            qkv: alloc(cap * d.qkv_width() * BF16, "qkv")?,
            attn: alloc(cap * d.q_width() * BF16, "attention")?,
            gate_up: alloc(cap * 2 * d.ffn * BF16, "mlp")?,
            act: alloc(cap * d.ffn * BF16, "mlp")?,
        });
        Ok(())
    }

    /// Validates the ids, sizes the workspace and uploads them (on the stream). Returns the row count.
    fn prepare(&mut self, ids: &[u32]) -> Result<usize, TextEncoderError> {
        if ids.is_empty() {
            return Err(TextEncoderError::Input("no token ids to encode".into()));
        }
        let values = ids_to_i32(ids, self.dims.vocab)?;
        let rows = ids.len();
        self.ensure_workspace(rows)?;
        let ws = self
            .workspace
            .as_mut()
            .ok_or_else(|| TextEncoderError::Backend("GPU backend: no workspace".into()))?;
        ws.ids
            .upload_async(0, &le_bytes(&values, i32::to_le_bytes), &self.stream)
            .map_err(gpu_err("uploading token ids"))?;
        Ok(rows)
    }

    /// Device milliseconds of one forward over `ids` (the mean of `iters` after one warm-up), without the id
    /// upload and the read-back: the figure to compare with the weight-streaming bound.
    pub fn time_forward(&mut self, ids: &[u32], iters: usize) -> Result<f64, TextEncoderError> {
        let rows = self.prepare(ids)?;
        let layers = self.layout.layers.len();
        let start = Event::new(&self.ctx, true).map_err(gpu_err("creating an event"))?;
        let end = Event::new(&self.ctx, true).map_err(gpu_err("creating an event"))?;
        self.enqueue_forward(rows, layers)?;
        let iters = iters.max(1);
        start
            .record(&self.stream)
            .map_err(gpu_err("recording an event"))?;
        for _ in 0..iters {
            self.enqueue_forward(rows, layers)?;
        }
        end.record(&self.stream)
            .map_err(gpu_err("recording an event"))?;
        end.synchronize().map_err(gpu_err("running the forward"))?;
        let ms = Event::elapsed_ms(&start, &end).map_err(gpu_err("reading an event"))?;
        Ok(f64::from(ms) / iters as f64)
    }

    /// The GEMMs a forward over `rows` rows runs (over the rows rounded up to [`ROW_QUANTUM`]), one entry per
    /// distinct plan in first-call order: what planning the encoder's GEMMs ahead takes.
    pub fn gemm_shapes(&self, rows: usize) -> Vec<GemmShape> {
        let rows = capacity_for(rows);
        let d = self.dims;
        let (h, f) = (d.hidden, d.ffn);
        let (qw, qkvw) = (d.q_width(), d.qkv_width());
        let mut out = Vec::with_capacity(4 * self.layout.layers.len());
        for l in &self.layout.layers {
            out.extend([
                gemm::shape_at_offsets(rows, qkvw, h, (0, l.qkv, 0), false),
                gemm::shape_at_offsets(rows, h, qw, (0, l.o_proj, 0), false),
                gemm::shape_at_offsets(rows, 2 * f, h, (0, l.gate_up, 0), false),
                gemm::shape_at_offsets(rows, h, f, (0, l.down, 0), false),
            ]);
        }
        gemm::distinct(out)
    }

    fn weight_span(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, TextEncoderError> {
        span(&self.weights, offset, bytes)
    }

    /// Enqueues `linear` on the stream.
    fn gemm(&self, linear: Linear) -> Result<(), TextEncoderError> {
        // SAFETY: every span lies inside a live buffer of this encoder (the weights or the workspace; checked by
        // `span`); neither is freed before the stream is synchronised (workspace growth, `clear_workspace` and
        // Drop synchronise first), and the stream belongs to the handle's context.
        Ok(unsafe { self.gemms.run(&linear, &self.stream) }?)
    }

    /// Enqueues the embedding and the first `layers` decoder layers over the `rows` ids already in the workspace
    /// (no host synchronisation); no layer past them runs, and the final norm never does. The result,
    /// `hidden_states[layers]`, is left in the workspace's `x`.
    fn enqueue_forward(&mut self, rows: usize, layers: usize) -> Result<(), TextEncoderError> {
        if rows == 0 || self.workspace_rows() < rows {
            return Err(TextEncoderError::Backend(
                "GPU backend: internal: no workspace for this prompt".into(),
            ));
        }
        let Some(mut ws) = self.workspace.take() else {
            return Err(TextEncoderError::Backend(
                "GPU backend: internal: no workspace".into(),
            ));
        };
        let result = self.enqueue_forward_in(&mut ws, rows, layers);
        self.workspace = Some(ws);
        result
    }

    fn enqueue_forward_in(
        &self,
        ws: &mut Workspace,
        rows: usize,
        layers: usize,
    ) -> Result<(), TextEncoderError> {
        let d = self.dims;
        let (h, f) = (d.hidden, d.ffn);
        let (qw, kw, qkvw) = (d.q_width(), d.kv_width(), d.qkv_width());
        let st = &self.stream;
        let eps = self.config.rms_norm_eps;
        let launch = gpu_err::<tf_cuda::Error>;
        let weight_view = |offset: usize, bytes: usize| {
            self.weights
                .slice(offset, bytes)
                .map_err(gpu_err("slicing the weights"))
        };
        self.kernels
            .embed_gather(
                st,
                &weight_view(self.layout.embed, d.vocab * h * BF16)?,
                d.vocab,
                h,
                &ws.ids.view(),
                rows,
                &mut ws.x.view_mut(),
                h,
            )
            .map_err(launch("embedding gather"))?;

        // The GEMMs run over the rows rounded up to the quantum: every prompt in one quantum runs the same GEMM
        // shapes (planned once, timed at load by the warm-up) instead of planning new ones inside a request, at no
        // cost below the compute bound (a weight read serves up to ROW_QUANTUM rows). A GEMM's rows are
        // independent, so the rows past `rows` (stale, never read back) cannot touch the prompt's.
        let m = capacity_for(rows);
        if m > ws.capacity {
            return Err(TextEncoderError::Backend(
                "GPU backend: internal: the workspace is smaller than its row quantum".into(),
            ));
        }
        let x_span = span(&ws.x, 0, m * h * BF16)?;
        let normed_span = span(&ws.normed, 0, m * h * BF16)?;
        let qkv_span = span(&ws.qkv, 0, m * qkvw * BF16)?;
        let attn_span = span(&ws.attn, 0, m * qw * BF16)?;
        let gate_up_span = span(&ws.gate_up, 0, m * 2 * f * BF16)?;
        let act_span = span(&ws.act, 0, m * f * BF16)?;
        let limits = ws.key_limits.view();
        let scale = 1.0 / (HEAD_DIM as f32).sqrt();

        for l in self.layout.layers.iter().take(layers) {
            self.kernels
                .rms_norm(
                    st,
                    &ws.x.view(),
                    Matrix::dense(rows, h),
                    &mut ws.normed.view_mut(),
                    h,
                    &weight_view(l.input_norm, h * BF16)?,
                    eps,
                )
                .map_err(launch("input RMSNorm"))?;
            self.gemm(Linear::new(
                m,
                qkvw,
                h,
                normed_span,
                self.weight_span(l.qkv, qkvw * h * BF16)?,
                qkv_span,
            ))?;
            {
                let q_weight = weight_view(l.qk_norm, HEAD_DIM * BF16)?;
                let k_weight = weight_view(l.qk_norm + HEAD_DIM * BF16, HEAD_DIM * BF16)?;
                let (cos, sin) = (ws.rope_cos.view(), ws.rope_sin.view());
                let mut qkv = ws.qkv.view_mut();
                self.kernels
                    .qk_norm_rope_half(
                        st,
                        &QkNormRope {
                            qkv: &mut qkv,
                            qkv_layout: Matrix::dense(rows, qkvw),
                            q_heads: d.q_heads,
                            kv_heads: d.kv_heads,
                            q_weight: &q_weight,
                            k_weight: &k_weight,
                            eps,
                            rope_cos: &cos,
                            rope_sin: &sin,
                            rope_stride: HEAD_DIM / 2,
                        },
                    )
                    .map_err(launch("QK norm + RoPE"))?;
            }
            {
                let qkv_len = ws.qkv.len();
                let q = ws.qkv.view();
                let k = ws
                    .qkv
                    .slice(qw * BF16, qkv_len - qw * BF16)
                    .map_err(launch("slicing k"))?;
                let v = ws
                    .qkv
                    .slice((qw + kw) * BF16, qkv_len - (qw + kw) * BF16)
                    .map_err(launch("slicing v"))?;
                let fused = Strides {
                    batch: rows * qkvw,
                    row: qkvw,
                };
                let inputs = AttentionInputs::self_attention(&q, &k, &v, fused, scale)
                    .with_key_limit(&limits, 0);
                let shape = AttentionShape {
                    batch: 1,
                    num_queries: rows,
                    num_keys: rows,
                    prefix_len: 0,
                    num_heads: d.q_heads,
                    num_kv_heads: d.kv_heads,
                };
                self.kernels
                    .attention_with(
                        st,
                        self.attention_tile(),
                        shape,
                        &inputs,
                        &mut ws.attn.view_mut(),
                        Strides {
                            batch: rows * qw,
                            row: qw,
                        },
                    )
                    .map_err(launch("causal attention"))?;
            }
            self.gemm(
                Linear::new(
                    m,
                    h,
                    qw,
                    attn_span,
                    self.weight_span(l.o_proj, h * qw * BF16)?,
                    x_span,
                )
                .accumulate(true),
            )?;
            self.kernels
                .rms_norm(
                    st,
                    &ws.x.view(),
                    Matrix::dense(rows, h),
                    &mut ws.normed.view_mut(),
                    h,
                    &weight_view(l.post_norm, h * BF16)?,
                    eps,
                )
                .map_err(launch("post-attention RMSNorm"))?;
            self.gemm(Linear::new(
                m,
                2 * f,
                h,
                normed_span,
                self.weight_span(l.gate_up, 2 * f * h * BF16)?,
                gate_up_span,
            ))?;
            self.kernels
                .swiglu(
                    st,
                    &ws.gate_up.view(),
                    Matrix::dense(rows, 2 * f),
                    &mut ws.act.view_mut(),
                    f,
                )
                .map_err(launch("SwiGLU"))?;
            self.gemm(
                Linear::new(
                    m,
                    h,
                    f,
                    act_span,
                    self.weight_span(l.down, h * f * BF16)?,
                    x_span,
                )
                .accumulate(true),
            )?;
        }
        Ok(())
    }

    /// The model config.
    pub fn config(&self) -> &TextEncoderConfig {
        &self.config
    }

    /// `hidden_states[layer]` `[ids.len(), hidden]` from position 0, as the host reference's
    /// [`super::text_encoder::HostTextEncoder::features_at`]: 0 = the embedding rows, `k` = decoder layer `k`'s
    /// output (`num_hidden_layers`: the last layer's), never the final norm. No layer past `layer` runs. A layer
    /// past the cap of a capped load is refused ([`TextEncoderError::BeyondCap`], naming both).
    pub fn features_at(
        &mut self,
        ids: &[u32],
        layer: usize,
    ) -> Result<TensorF32, TextEncoderError> {
        check_reachable(
            layer,
            self.layout.layers.len(),
            self.config.num_hidden_layers,
        )?;
        if ids.is_empty() {
            return Ok(Tensor::new(vec![0, self.dims.hidden], Vec::new())?);
        }
        let rows = self.prepare(ids)?;
        self.enqueue_forward(rows, layer)?;
        self.read_features(rows)
    }

    /// Waits for the forward and reads the `rows` rows of the workspace's `x` back as f32.
    fn read_features(&self, rows: usize) -> Result<TensorF32, TextEncoderError> {
        self.stream
            .synchronize()
            .map_err(gpu_err("running the text encoder"))?;
        let h = self.dims.hidden;
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| TextEncoderError::Backend("GPU backend: no workspace".into()))?;
        let mut bytes = vec![0u8; rows * h * BF16];
        ws.x.download(0, &mut bytes)
            .map_err(gpu_err("reading the features back"))?;
        let values: Vec<f32> = bytes
            .chunks_exact(BF16)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        Ok(Tensor::new(vec![rows, h], values)?)
    }
}

/// `bytes` at `offset` of `buf` as a GEMM operand, checked.
fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, TextEncoderError> {
    Ok(gemm::span(buf, offset, bytes)?)
}

impl From<GemmError> for TextEncoderError {
    fn from(e: GemmError) -> TextEncoderError {
        TextEncoderError::Gpu(gpu_error("GEMM", e))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use proptest::prelude::*;
    use tf_cuda::Driver;

    fn full_size() -> TextEncoderConfig {
        TextEncoderConfig::qwen3_vl_8b()
    }

    #[test]
    fn the_released_config_runs_and_other_head_dims_are_refused() {
        assert!(check_supported(&full_size()).is_ok());
        // The committed transformers fixture has head_dim 16: refused with a message naming the limit.
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen_te/model/config.json");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        let tiny = TextEncoderConfig::from_json(&json).unwrap();
        let err = check_supported(&tiny).unwrap_err().to_string();
        assert!(err.contains("head_dim 16") && err.contains("128"), "{err}");
        let mut c = full_size();
        c.intermediate_size = 12_290;
        assert!(check_supported(&c)
            .unwrap_err()
            .to_string()
            .contains("multiple of 8"));
        let mut c = full_size();
        c.hidden_size = 8200;
        assert!(check_supported(&c).is_err());
        let mut c = full_size();
        c.rope_theta = f64::NAN;
        assert!(check_supported(&c).is_err());
        let mut c = full_size();
        c.num_key_value_heads = 6;
        assert!(check_supported(&c).is_err());
    }

    #[test]
    fn full_size_layout_holds_the_8b_text_weights() {
        let d = Dims::of(&full_size(), LoadOptions::default()).unwrap();
        assert_eq!(
            (d.q_width(), d.kv_width(), d.qkv_width()),
            (4096, 1024, 6144)
        );
        let layout = WeightLayout::plan(&d).unwrap();
        let params_per_layer = 2 * 4096 + 6144 * 4096 + 256 + 4096 * 4096 + 3 * 12_288 * 4096;
        let params = 151_936 * 4096 + 36 * params_per_layer;
        // Alignment padding only (each group rounds up to 256 B).
        assert!(layout.total >= params * BF16);
        assert!(layout.total <= params * BF16 + 36 * 7 * ALIGN + 2 * ALIGN);
        assert_eq!(layout.layers.len(), 36);
    }

    #[test]
    fn placements_tile_the_fused_groups_without_overlap() {
        let config = TextEncoderConfig {
            vocab_size: 300,
            hidden_size: 256,
            intermediate_size: 384,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
        };
        let d = Dims::of(&config, LoadOptions::default()).unwrap();
        let layout = WeightLayout::plan(&d).unwrap();
        let mut placed: Vec<(usize, usize, String)> = layout
            .placements(&d)
            .into_iter()
            .map(|p| {
                let bytes = p.shape.iter().product::<usize>() * BF16;
                (p.offset, p.offset + bytes, p.name)
            })
            .collect();
        assert_eq!(placed.len(), 1 + 2 * 11);
        placed.sort();
        for pair in placed.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "{:?} overlaps {:?}",
                pair[0],
                pair[1]
            );
        }
        assert!(placed.last().unwrap().1 <= layout.total);
        // q|k|v and gate|up are contiguous, in that order, so one GEMM reads each group.
        let at = |name: &str| placed.iter().find(|p| p.2 == name).unwrap().clone();
        let (q, k, v) = (
            at("layers.1.self_attn.q_proj.weight"),
            at("layers.1.self_attn.k_proj.weight"),
            at("layers.1.self_attn.v_proj.weight"),
        );
        assert_eq!((q.1, k.1), (k.0, v.0));
        assert_eq!(v.1 - q.0, d.qkv_width() * 256 * BF16);
        let (g, u) = (
            at("layers.0.mlp.gate_proj.weight"),
            at("layers.0.mlp.up_proj.weight"),
        );
        assert_eq!(g.1, u.0);
        let (qn, kn) = (
            at("layers.0.self_attn.q_norm.weight"),
            at("layers.0.self_attn.k_norm.weight"),
        );
        assert_eq!(qn.1, kn.0);
        for (offset, _, name) in &placed {
            if !name.contains("k_proj")
                && !name.contains("v_proj")
                && !name.contains("up_proj")
                && !name.contains("k_norm")
            {
                assert!(offset.is_multiple_of(ALIGN), "{name} at {offset}");
            }
        }
    }

    /// Qwen3-VL-32B's text path (what MiniMax H3 reads layer 50 of).
    fn qwen3_vl_32b() -> TextEncoderConfig {
        TextEncoderConfig {
            hidden_size: 5120,
            intermediate_size: 25_600,
            num_hidden_layers: 64,
            num_attention_heads: 64,
            ..full_size()
        }
    }

    #[test]
    fn a_capped_layout_holds_only_the_kept_layers() {
        let config = qwen3_vl_32b();
        let full = GpuTextEncoder::planned_weight_bytes(&config, LoadOptions::default()).unwrap();
        let capped =
            GpuTextEncoder::planned_weight_bytes(&config, LoadOptions::up_to_layer(50)).unwrap();
        let all =
            GpuTextEncoder::planned_weight_bytes(&config, LoadOptions::up_to_layer(64)).unwrap();
        assert_eq!(all, full);
        // One 32B layer: norms, q|k|v (8192 + 2 x 1024 rows), q/k norms, o_proj, gate|up and down, in bf16, each
        // group rounded up to ALIGN.
        let per_layer = (2 * 5120 + 10_240 * 5120 + 256 + 5120 * 8192 + 3 * 25_600 * 5120) * BF16;
        let saved = full - capped;
        assert!(
            saved >= 14 * per_layer && saved <= 14 * (per_layer + 7 * ALIGN),
            "{saved} B saved for 14 layers of {per_layer} B"
        );
        println!(
            "Qwen3-VL-32B text weights: {:.2} GB for 64 layers, {:.2} GB capped at 50",
            full as f64 / 1e9,
            capped as f64 / 1e9
        );
        // The kept layers sit where an uncapped load puts them, and nothing of layer 50 or the norm is placed.
        let d = Dims::of(&config, LoadOptions::up_to_layer(50)).unwrap();
        let layout = WeightLayout::plan(&d).unwrap();
        let full_layout =
            WeightLayout::plan(&Dims::of(&config, LoadOptions::default()).unwrap()).unwrap();
        assert_eq!(layout.layers[..], full_layout.layers[..50]);
        let placements = layout.placements(&d);
        assert_eq!(placements.len(), 1 + 50 * 11);
        assert!(placements
            .iter()
            .all(|p| !p.name.starts_with("layers.50.") && !p.name.starts_with("norm")));
        let err = GpuTextEncoder::planned_weight_bytes(&config, LoadOptions::up_to_layer(65))
            .unwrap_err()
            .to_string();
        assert!(err.contains("65") && err.contains("64"), "{err}");
    }

    #[test]
    fn ids_are_checked_against_the_vocabulary() {
        assert_eq!(ids_to_i32(&[0, 5, 9], 10).unwrap(), vec![0, 5, 9]);
        let err = ids_to_i32(&[0, 10], 10).unwrap_err().to_string();
        assert!(
            err.contains("token id 10") && err.contains("0..10"),
            "{err}"
        );
        assert!(ids_to_i32(&[u32::MAX], usize::MAX).is_err());
    }

    #[test]
    fn causal_limits_see_up_to_the_query() {
        assert_eq!(causal_limits(4).unwrap(), vec![1, 2, 3, 4]);
        assert!(causal_limits(0).unwrap().is_empty());
    }

    /// Writes a one-layer head-dim-128 model (zeros) whose `k_proj` has `k_rows` rows (2 x 128 is right).
    fn write_model(dir: &std::path::Path, k_rows: usize) {
        use crate::nn::weights::write_f32_safetensors;
        std::fs::create_dir_all(dir).unwrap();
        let config = serde_json::json!({"text_config": {"vocab_size": 4, "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}});
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let p = "model.language_model.";
        let specs: Vec<(String, Vec<usize>)> = vec![
            (format!("{p}embed_tokens.weight"), vec![4, 8]),
            (format!("{p}norm.weight"), vec![8]),
            (format!("{p}layers.0.input_layernorm.weight"), vec![8]),
            (format!("{p}layers.0.self_attn.q_proj.weight"), vec![256, 8]),
            (
                format!("{p}layers.0.self_attn.k_proj.weight"),
                vec![k_rows, 8],
            ),
            (format!("{p}layers.0.self_attn.v_proj.weight"), vec![128, 8]),
            (format!("{p}layers.0.self_attn.q_norm.weight"), vec![128]),
            (format!("{p}layers.0.self_attn.k_norm.weight"), vec![128]),
            (format!("{p}layers.0.self_attn.o_proj.weight"), vec![8, 256]),
            (
                format!("{p}layers.0.post_attention_layernorm.weight"),
                vec![8],
            ),
            (format!("{p}layers.0.mlp.gate_proj.weight"), vec![16, 8]),
            (format!("{p}layers.0.mlp.up_proj.weight"), vec![16, 8]),
            (format!("{p}layers.0.mlp.down_proj.weight"), vec![8, 16]),
        ];
        let tensors: Vec<(String, TensorF32)> = specs
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                (name, Tensor::new(shape, vec![0.0; n]).unwrap())
            })
            .collect();
        write_f32_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    }

    #[test]
    fn load_checks_the_folder_and_frees_everything_on_failure() {
        use tf_testdriver::{library_path, test_lock};
        let _serial = test_lock();
        let driver =
            Arc::new(Driver::open_path(&library_path().expect("find the test driver")).unwrap());
        let ctx = Context::new(driver, 0).unwrap();
        let before = tf_cuda::usage().device;
        // The committed transformers fixture (head_dim 16) is refused by its config.
        let fixture = ModelDir::open(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/qwen_te/model"),
        )
        .unwrap();
        let err = GpuTextEncoder::load_on(&ctx, &fixture)
            .unwrap_err()
            .to_string();
        assert!(err.contains("head_dim 16"), "{err}");
        // A wrong tensor shape is named before anything is allocated.
        let root = std::env::temp_dir().join(format!("tf-te-gpu-unit-{}", std::process::id()));
        let bad = root.join("bad");
        write_model(&bad, 64);
        let err = GpuTextEncoder::load_on(&ctx, &ModelDir::open(&bad).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("k_proj"), "{err}");
        // A valid folder gets as far as the kernels, which the test driver cannot run (or this build lacks):
        // the error says so, and nothing stays allocated.
        let good = root.join("good");
        write_model(&good, 128);
        let err = GpuTextEncoder::load_on(&ctx, &ModelDir::open(&good).unwrap())
            .unwrap_err()
            .to_string();
        println!("valid folder on the test driver: {err}");
        assert!(err.contains("GPU backend"), "{err}");
        // Capped at 0 layers, the bad folder's layer-0 tensors are never looked at: the load gets as far as the
        // valid one did.
        let err = GpuTextEncoder::load_with_options(
            &ctx,
            &ModelDir::open(&bad).unwrap(),
            StagingConfig::default(),
            LoadOptions::up_to_layer(0),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("GPU backend") && !err.contains("k_proj"),
            "{err}"
        );
        assert_eq!(
            tf_cuda::usage().device,
            before,
            "a failed load must free what it allocated"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    proptest! {
        /// A workspace holds the prompt, in whole quanta, wasting less than one quantum.
        #[test]
        fn capacity_is_the_next_quantum(rows in 0usize..100_000) {
            let cap = capacity_for(rows);
            prop_assert!(cap >= rows.max(1));
            prop_assert!(cap.is_multiple_of(ROW_QUANTUM));
            prop_assert!(cap < rows.max(1) + ROW_QUANTUM);
        }
    }
}
