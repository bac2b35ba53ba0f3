//! The MiniMax H3 video VAE decoder on the GPU: the same decode as [`super::vae_video::HostVideoVae`], behind the
//! same [`VideoVaeBackend`] interface, on the shared layer.
//!
//! Precision (bf16 weights, f32 where the reference keeps f32):
//! - the latent de-normalization and `post_quant_conv` run on the host in f32 (a few MFLOP); `proj_in` (24 inputs
//!   per token), the register tokens and the residual stream stay f32 on the device, as the reference's residual
//!   stream is f32 in its bf16 mode too (the layer scales are f32);
//! - RMSNorm / LayerNorm read the f32 stream and write the bf16 GEMM inputs (kernel h3v_norm, f32 statistics);
//! - q|k|v, the attention output projection and the SwiGLU projections are bf16 cuBLASLt GEMMs with f32
//!   accumulation; the layer scales are folded into the output projections' rows and biases at load (`(W x + b) *
//!   s = (s W) x + s b`), whose GEMMs add into the f32 stream with an f32 bias (`beta = 1`), so a residual update
//!   costs no kernel;
//! - q/k RMSNorm (f32 statistics) and the rotate-half RoPE on 48 of 64 channels (f32 tables rounded to bf16 as the
//!   reference's bf16 run casts them) run in place on the fused q|k|v rows (shared `nn_rope_half_partial_d64_f32`),
//!   attention is the shared flash kernel at head dim 64 over each tile's tokens;
//! - `proj_out` writes f32, and the un-patchify, the tile blend, the temporal cross-fade, the ImageNet
//!   de-normalization and the 8-bit rounding run in f32 (kernels h3v_assemble, h3v_frames), where the reference's
//!   bf16 run blends in bf16.
//!
//! Tiles are batched: every tile of a decode has the same shape, so up to [`GpuVideoVaeBudget::max_rows`] tokens
//! of tiles (whole clips when they fit, several clips at once when small) run through the blocks as one batch of
//! GEMM rows, with attention batched over tiles. Each clip's tiles are then placed into the f32 video in clip
//! order, which is what the cross-fade needs. Only head dim 64 runs (the attention kernel's width and the
//! released model); other configs are refused at load.
//!
//! Invariant: a decode enqueues everything on one stream and synchronizes once, before reading the video back.
//! A decode spread over the ranks of a multi-GPU job ([`GpuVideoVae::decode_spread`], module [`spread`]) also
//! synchronizes around each transfer of decoded tiles to rank 0, which runs on the communicator's stream.

pub mod ops;
pub mod spread;

use std::sync::Arc;
use std::time::Duration;

use tf_cuda::cublaslt::{DeviceSpan, GemmShape};
use tf_cuda::{Context, DeviceBuffer, Stream};
use tf_nccl::{AllToAllCounts, Comm, DataType};

use super::vae_video::{
    check_latents, check_model, denormalize_latents, rope_tables, ChunkPlan, TilePlan,
    TilingOptions, VideoFrames, VideoVaeBackend, VideoVaeConfig, VideoVaeError, PIXEL_MEAN,
    PIXEL_STD,
};
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, Linear};
use crate::nn::gpu::{
    AttentionInputs, AttentionShape, GpuDevice, Launch, Matrix, NnKernels, PartialRope, RopeNorm,
    RopeTable, Strides, SwigluOrder,
};
use crate::nn::host::linear;
use crate::nn::tensor::TensorF32;
use crate::nn::upload::{upload_pieces, Piece, RowScaleToBf16, StagingConfig, Transform};
use crate::nn::weights::{le_bytes, LayoutPlanner, ModelDir, BF16};
use ops::{
    plan_assemble, plan_frames, plan_norm, plan_tokens, ClipFrames, ClipTiles, LatentVolume,
    RowNorm, TokenBatch, VideoBuffer, VideoVaeKernels, MAX_TOKEN_CHANNELS,
};

const F32: usize = 4;
/// The attention kernel's head dim (and the released model's).
pub const HEAD_DIM: usize = 64;
/// Host-built weight bytes per upload call (the folded output projections), at most.
const UPLOAD_GROUP_BYTES: usize = 512 << 20;

/// A failure of the GPU path (driver, cuBLASLt, kernels), as a [`VideoVaeError`].
fn backend(what: &str, why: impl IntoGpuError) -> VideoVaeError {
    VideoVaeError::Gpu(gpu_error(format!("GPU decode: {what}"), why))
}

impl From<GemmError> for VideoVaeError {
    fn from(e: GemmError) -> VideoVaeError {
        backend("GEMM", e)
    }
}

/// Device memory limits of a decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuVideoVaeBudget {
    /// Most token rows run through the blocks at once (a batch is whole tiles; at least one tile).
    pub max_rows: usize,
}

impl Default for GpuVideoVaeBudget {
    fn default() -> Self {
        // Eight released tiles of 1797 tokens (a 448 x 768 clip) in one batch: about 1.3 GB of activations.
        GpuVideoVaeBudget { max_rows: 16_384 }
    }
}

/// Whether the GPU path runs `config`: head dim 64 (the attention kernel), at most [`MAX_TOKEN_CHANNELS`] latent
/// channels (the token kernel).
pub fn check_supported(config: &VideoVaeConfig) -> Result<(), VideoVaeError> {
    if config.decoder_attention_head_dim != HEAD_DIM {
        return Err(VideoVaeError::Input(format!(
            "decoder_attention_head_dim {}: the GPU decoder runs head dim {HEAD_DIM} (the released model); use the host reference",
            config.decoder_attention_head_dim
        )));
    }
    if config.latent_channels > MAX_TOKEN_CHANNELS {
        return Err(VideoVaeError::Input(format!(
            "latent_channels {}: the GPU decoder takes at most {MAX_TOKEN_CHANNELS}",
            config.latent_channels
        )));
    }
    Ok(())
}

/// Device offsets of one block's weights.
#[derive(Clone, Copy, Debug)]
struct BlockW {
    norm1: usize,
    /// `[3 dim, dim]` bf16 (q, k, v rows) and its bf16 bias.
    qkv_w: usize,
    qkv_b: usize,
    /// `scale1`-folded `to_out` weight (bf16) and bias (f32).
    out_w: usize,
    out_b: usize,
    norm2: usize,
    /// `[2 inner, dim]` bf16 (value rows, then gate rows) and its bf16 bias.
    ff1_w: usize,
    ff1_b: usize,
    /// `scale2`-folded down projection (bf16) and bias (f32).
    ff2_w: usize,
    ff2_b: usize,
}

/// Device offsets of every weight.
#[derive(Clone, Debug)]
struct Net {
    /// proj_in transposed `[channels, dim]` f32, its bias f32, the register tokens f32.
    proj_in_wt: usize,
    proj_in_b: usize,
    registers: usize,
    blocks: Vec<BlockW>,
    norm_out_w: usize,
    norm_out_b: usize,
    /// `[patch, dim]` bf16 and its f32 bias.
    proj_out_w: usize,
    proj_out_b: usize,
    total: usize,
}

impl Net {
    fn plan(config: &VideoVaeConfig) -> Result<Net, VideoVaeError> {
        let (c, d, inner) = (config.latent_channels, config.dim(), config.ffn_inner());
        let (regs, p) = (config.decoder_num_register_tokens, config.patch_values());
        let mut l = LayoutPlanner::default();
        let proj_in_wt = l.one(c * d * F32)?;
        let proj_in_b = l.one(d * F32)?;
        let registers = l.one(regs * d * F32)?;
        let mut blocks = Vec::with_capacity(config.decoder_num_layers);
        for _ in 0..config.decoder_num_layers {
            blocks.push(BlockW {
                norm1: l.one(d * F32)?,
                qkv_w: l.one(3 * d * d * BF16)?,
                qkv_b: l.one(3 * d * BF16)?,
                out_w: l.one(d * d * BF16)?,
                out_b: l.one(d * F32)?,
                norm2: l.one(d * F32)?,
                ff1_w: l.one(2 * inner * d * BF16)?,
                ff1_b: l.one(2 * inner * BF16)?,
                ff2_w: l.one(d * inner * BF16)?,
                ff2_b: l.one(d * F32)?,
            });
        }
        let norm_out_w = l.one(d * F32)?;
        let norm_out_b = l.one(d * F32)?;
        let proj_out_w = l.one(p * d * BF16)?;
        let proj_out_b = l.one(p * F32)?;
        Ok(Net {
            proj_in_wt,
            proj_in_b,
            registers,
            blocks,
            norm_out_w,
            norm_out_b,
            proj_out_w,
            proj_out_b,
            total: l.total()?,
        })
    }
}

/// One weight's device image: read from the file (converted to bf16 on the way) or built on the host.
enum Source {
    /// The tensor as stored, to bf16.
    File(String),
    /// The tensor as stored, each row times its scale, to bf16 (a layer scale folded into an output projection
    /// on the upload ring's threads, with no host copy of the matrix).
    ScaledFile(String, RowScaleToBf16),
    /// Host-built f32 bytes, uploaded as they are.
    Host(Vec<u8>),
}

/// The tensors of one upload call and where they go.
struct UploadGroup(Vec<(Source, usize)>);

impl UploadGroup {
    fn host_bytes(&self) -> usize {
        self.0
            .iter()
            .map(|(s, _)| match s {
                Source::Host(b) => b.len(),
                Source::File(_) | Source::ScaledFile(..) => 0,
            })
            .sum()
    }

    fn pieces<'m>(&'m self, model: &'m ModelDir) -> Result<Vec<Piece<'m>>, VideoVaeError> {
        let mut out = Vec::with_capacity(self.0.len());
        for (source, offset) in &self.0 {
            out.push(match source {
                Source::File(name) => {
                    Piece::bf16(model.bytes(name)?, model.info(name)?.dtype, *offset)
                }
                Source::ScaledFile(name, rows) => Piece {
                    src: model.bytes(name)?,
                    transform: Transform::Custom(rows),
                    dst_offset: *offset,
                },
                Source::Host(bytes) => Piece::copy(bytes, *offset),
            });
        }
        Ok(out)
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    le_bytes(values, f32::to_le_bytes)
}

/// `values` (one scale a row) times `scale[row]`, f32: the biases of the scaled projections.
fn scale_rows(values: &[f32], scale: &[f32]) -> Vec<f32> {
    values.iter().zip(scale).map(|(&v, &s)| v * s).collect()
}

/// The weight `name` (`[scale.len(), cols]`) uploaded with each row times its scale, as bf16.
fn scaled_file(
    model: &ModelDir,
    name: &str,
    cols: usize,
    scale: &[f32],
) -> Result<Source, VideoVaeError> {
    let info = model.info(name)?;
    if info.shape != [scale.len(), cols] {
        return Err(backend(
            &format!("folding the layer scale into {name}"),
            format!(
                "{name} is {:?}, its scale has {} rows of {cols}",
                info.shape,
                scale.len()
            ),
        ));
    }
    let rows = RowScaleToBf16::new(info.dtype, cols, scale.to_vec())
        .map_err(|e| backend(&format!("folding the layer scale into {name}"), e))?;
    Ok(Source::ScaledFile(name.to_string(), rows))
}

/// Reads the f32 values of one tensor.
fn values(model: &ModelDir, name: &str) -> Result<Vec<f32>, VideoVaeError> {
    Ok(model.to_f32(name)?.into_data())
}

/// The global tensors, then the blocks in groups of at most [`UPLOAD_GROUP_BYTES`] of host-built bytes, each group
/// handed to `each` as soon as it is built (the host holds one group at a time).
fn upload_groups(
    model: &ModelDir,
    config: &VideoVaeConfig,
    net: &Net,
    mut each: impl FnMut(UploadGroup) -> Result<(), VideoVaeError>,
) -> Result<(), VideoVaeError> {
    let (c, d, inner) = (config.latent_channels, config.dim(), config.ffn_inner());
    let proj_in = values(model, "decoder.proj_in.weight")?;
    let mut proj_in_t = vec![0f32; c * d];
    for (o, row) in proj_in.chunks_exact(c).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            proj_in_t[i * d + o] = v;
        }
    }
    let host = |name: &str| values(model, name).map(|v| Source::Host(f32_bytes(&v)));
    each(UploadGroup(vec![
        (Source::Host(f32_bytes(&proj_in_t)), net.proj_in_wt),
        (host("decoder.proj_in.bias")?, net.proj_in_b),
        (host("decoder.register_tokens")?, net.registers),
        (host("decoder.norm_out.weight")?, net.norm_out_w),
        (host("decoder.norm_out.bias")?, net.norm_out_b),
        (
            Source::File("decoder.proj_out.weight".into()),
            net.proj_out_w,
        ),
        (host("decoder.proj_out.bias")?, net.proj_out_b),
    ]))?;
    let mut group = UploadGroup(Vec::new());
    for (i, b) in net.blocks.iter().enumerate() {
        let p = format!("decoder.transformer_blocks.{i}");
        let scale1 = values(model, &format!("{p}.scale1"))?;
        let scale2 = values(model, &format!("{p}.scale2"))?;
        let out_w = scaled_file(model, &format!("{p}.attn.to_out.0.weight"), d, &scale1)?;
        let out_b = scale_rows(&values(model, &format!("{p}.attn.to_out.0.bias"))?, &scale1);
        let ff2_w = scaled_file(model, &format!("{p}.ff.net.2.weight"), inner, &scale2)?;
        let ff2_b = scale_rows(&values(model, &format!("{p}.ff.net.2.bias"))?, &scale2);
        let file = |name: &str| Source::File(format!("{p}.{name}"));
        let row = d * d * BF16;
        let bias = d * BF16;
        group.0.extend([
            (host(&format!("{p}.norm1.weight"))?, b.norm1),
            (file("attn.to_q.weight"), b.qkv_w),
            (file("attn.to_k.weight"), b.qkv_w + row),
            (file("attn.to_v.weight"), b.qkv_w + 2 * row),
            (file("attn.to_q.bias"), b.qkv_b),
            (file("attn.to_k.bias"), b.qkv_b + bias),
            (file("attn.to_v.bias"), b.qkv_b + 2 * bias),
            (out_w, b.out_w),
            (Source::Host(f32_bytes(&out_b)), b.out_b),
            (host(&format!("{p}.norm2.weight"))?, b.norm2),
            (file("ff.net.0.proj.weight"), b.ff1_w),
            (file("ff.net.0.proj.bias"), b.ff1_b),
            (ff2_w, b.ff2_w),
            (Source::Host(f32_bytes(&ff2_b)), b.ff2_b),
        ]);
        if group.host_bytes() >= UPLOAD_GROUP_BYTES {
            each(std::mem::replace(&mut group, UploadGroup(Vec::new())))?;
        }
    }
    if !group.0.is_empty() {
        each(group)?;
    }
    Ok(())
}

/// One batch of tiles run through the blocks together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileBatch {
    /// `(clip, tile row, tile column)` of each tile, in order.
    pub tiles: Vec<(usize, usize, usize)>,
    /// The last batch of its group: the group's clips are placed into the video after it.
    pub ends_group: bool,
}

/// How one decode request runs: its chunks and tiles, and how tiles are batched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// Latent frames, rows, columns asked for; latent frames after padding.
    pub latents: (usize, usize, usize),
    pub padded_frames: usize,
    pub chunks: ChunkPlan,
    pub tiles: TilePlan,
    /// Latent frames, rows, columns of every decoded tile, and its tokens (voxels, registers, zero token).
    pub tile_latents: (usize, usize, usize),
    pub tokens: usize,
    /// Tiles per clip, tiles per batch of rows, clips whose tiles are held at once, and those tiles.
    pub tiles_per_clip: usize,
    pub tiles_per_batch: usize,
    pub clips_per_group: usize,
    pub group_tiles: usize,
    /// Output frames, height, width (pixels).
    pub video: (usize, usize, usize),
}

impl DecodePlan {
    /// Plans a decode of latents `shape` under `tiling` and `budget`.
    pub fn new(
        config: &VideoVaeConfig,
        shape: &[usize],
        tiling: &TilingOptions,
        budget: GpuVideoVaeBudget,
    ) -> Result<DecodePlan, VideoVaeError> {
        let ((f, h, w), chunks) = check_latents(config, shape)?;
        let ratio = config.spatial_ratio();
        let tiles = TilePlan::new(h, w, ratio, tiling).map_err(VideoVaeError::Input)?;
        let geo = config.chunk_geometry();
        let (th, tw) = tiles.latent_size();
        let tile_frames = geo.clip_latents();
        let tokens = tile_frames * th * tw + config.decoder_num_register_tokens + 1;
        let tiles_per_clip = tiles.count();
        let fit = (budget.max_rows / tokens).max(1);
        let (tiles_per_batch, clips_per_group) = if fit >= tiles_per_clip {
            let clips = (fit / tiles_per_clip).clamp(1, chunks.chunks);
            (clips * tiles_per_clip, clips)
        } else {
            (fit, 1)
        };
        Ok(DecodePlan {
            latents: (f, h, w),
            padded_frames: f + chunks.pad_tokens,
            tiles_per_batch,
            clips_per_group,
            group_tiles: clips_per_group * tiles_per_clip,
            tile_latents: (tile_frames, th, tw),
            tokens,
            tiles_per_clip,
            video: (chunks.out_frames, h * ratio, w * ratio),
            chunks,
            tiles,
        })
    }

    /// Token rows of a full batch.
    pub fn batch_rows(&self) -> usize {
        self.tiles_per_batch * self.tokens
    }

    /// The batches of the decode in order, within groups of `clips_per_group` clips.
    pub fn batches(&self) -> Vec<TileBatch> {
        let (ny, nx) = (self.tiles.y.starts.len(), self.tiles.x.starts.len());
        let mut out = Vec::new();
        let mut c0 = 0;
        while c0 < self.chunks.chunks {
            let c1 = (c0 + self.clips_per_group).min(self.chunks.chunks);
            let jobs: Vec<(usize, usize, usize)> = (c0..c1)
                .flat_map(|c| (0..ny).flat_map(move |i| (0..nx).map(move |j| (c, i, j))))
                .collect();
            let n = jobs.chunks(self.tiles_per_batch.max(1)).count();
            for (k, batch) in jobs.chunks(self.tiles_per_batch.max(1)).enumerate() {
                out.push(TileBatch {
                    tiles: batch.to_vec(),
                    ends_group: k + 1 == n,
                });
            }
            c0 = c1;
        }
        out
    }
}

/// The device buffers of one decode plan.
struct Workspace {
    plan: DecodePlan,
    latents: DeviceBuffer,
    origins: DeviceBuffer,
    grid: DeviceBuffer,
    rope_cos: DeviceBuffer,
    rope_sin: DeviceBuffer,
    x: DeviceBuffer,
    normed: DeviceBuffer,
    qkv: DeviceBuffer,
    attn: DeviceBuffer,
    ff: DeviceBuffer,
    act: DeviceBuffer,
    out: DeviceBuffer,
    video: DeviceBuffer,
    rgb: DeviceBuffer,
}

impl Workspace {
    fn bytes(&self) -> usize {
        [
            &self.latents,
            &self.origins,
            &self.grid,
            &self.rope_cos,
            &self.rope_sin,
            &self.x,
            &self.normed,
            &self.qkv,
            &self.attn,
            &self.ff,
            &self.act,
            &self.out,
            &self.video,
            &self.rgb,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

/// `bytes` at `offset` of `buf` as a GEMM or kernel operand, checked.
fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, VideoVaeError> {
    Ok(gemm::span(buf, offset, bytes)?)
}

/// Host side of a decode: pads the de-normalized latents `[1, C, F, h, w]` by repeating the last frame and applies
/// `post_quant_conv` (`(weight [C, C], bias)`) in f32, channels-last `[padded frames, h, w, C]`.
fn post_quant_latents(
    (weight, bias): &(Vec<f32>, Vec<f32>),
    latents: &TensorF32,
    plan: &DecodePlan,
) -> Result<Vec<f32>, VideoVaeError> {
    let c = bias.len();
    let (f, h, w) = plan.latents;
    let plane = h * w;
    let voxels = plan.padded_frames * plane;
    let mut tokens = vec![0f32; voxels * c];
    for (ch, data) in latents.data().chunks_exact(f * plane).enumerate() {
        for v in 0..voxels {
            let frame = (v / plane).min(f - 1);
            tokens[v * c + ch] = data[frame * plane + v % plane];
        }
    }
    let mut out = vec![0f32; voxels * c];
    linear(&tokens, voxels, c, weight, c, &mut out)?;
    crate::nn::host::add_bias(&mut out, voxels, c, bias)?;
    Ok(out)
}

/// The video VAE decoder on the GPU.
pub struct GpuVideoVae {
    config: VideoVaeConfig,
    tiling: TilingOptions,
    budget: GpuVideoVaeBudget,
    ctx: Context,
    /// The pipeline's stream, shared by its components.
    stream: Arc<Stream>,
    nn: NnKernels,
    kernels: VideoVaeKernels,
    gemms: GemmRunner,
    weights: DeviceBuffer,
    net: Net,
    /// `post_quant_conv` (host, f32): weight `[C, C]` and bias.
    post_quant: (Vec<f32>, Vec<f32>),
    workspace: Option<Workspace>,
}

impl std::fmt::Debug for GpuVideoVae {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuVideoVae")
            .field("weight_bytes", &self.weights.len())
            .field("tiling", &self.tiling)
            .field("budget", &self.budget)
            .field("plan", &self.workspace.as_ref().map(|w| &w.plan))
            .finish_non_exhaustive()
    }
}

impl Drop for GpuVideoVae {
    fn drop(&mut self) {
        // Work still queued (after an error mid-decode) must not outlive the buffers it reads. On a lost context
        // this fails fast without calling the driver, and the buffers leak.
        let _ = self.stream.synchronize();
    }
}

impl GpuVideoVae {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuVideoVae, VideoVaeError> {
        let driver = tf_cuda::open_driver().map_err(|e| backend("opening the CUDA driver", e))?;
        let ctx =
            Context::new(driver, 0).map_err(|e| backend("creating a context on device 0", e))?;
        GpuVideoVae::load_on(&ctx, model)
    }

    /// Loads a diffusers `vae/` folder into `ctx`: the config and every decoder tensor checked as the host
    /// reference checks them, the weights converted (bf16 matrices, f32 norms, biases of f32 outputs, the layer
    /// scales folded into the output projections) and streamed through the upload ring; the kernels and cuBLASLt.
    /// On a blocking stream of its own in `ctx` (see [`GpuVideoVae::load_in`]).
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuVideoVae, VideoVaeError> {
        let device = GpuDevice::on(ctx).map_err(|e| backend("creating a stream", e))?;
        GpuVideoVae::load_in(&device, model)
    }

    /// [`GpuVideoVae::load_on`] onto `device`, whose stream every decode runs on (a pipeline's components share
    /// it).
    pub fn load_in(device: &GpuDevice, model: &ModelDir) -> Result<GpuVideoVae, VideoVaeError> {
        let ctx = device.context();
        let config = check_model(model)?;
        check_supported(&config)?;
        let net = Net::plan(&config)?;
        let post_quant = (
            values(model, "post_quant_conv.weight")?,
            values(model, "post_quant_conv.bias")?,
        );
        let stream = Arc::clone(device.stream());
        let nn = NnKernels::load(ctx).map_err(|e| backend("loading the shared kernels", e))?;
        let kernels = VideoVaeKernels::load(ctx).map_err(|e| backend("loading kernels", e))?;
        let gemms =
            GemmRunner::new(ctx, gemm::TIMED).map_err(|e| backend("loading cuBLASLt", e))?;
        let total = net.total;
        let mut weights = DeviceBuffer::alloc(ctx, total)
            .map_err(|e| backend(&format!("allocating {total} B of weights"), e))?;
        weights
            .fill_u8(0, Some(&stream))
            .map_err(|e| backend("clearing the weights", e))?;
        upload_groups(model, &config, &net, |group| {
            let pieces = group.pieces(model)?;
            upload_pieces(
                ctx,
                &stream,
                &mut weights,
                &pieces,
                StagingConfig::default(),
            )
            .map_err(|e| backend(&format!("uploading {total} B of weights"), e))?;
            Ok(())
        })?;
        stream
            .synchronize()
            .map_err(|e| backend("uploading the weights", e))?;
        Ok(GpuVideoVae {
            tiling: TilingOptions::default(),
            budget: GpuVideoVaeBudget::default(),
            config,
            ctx: ctx.clone(),
            stream,
            nn,
            kernels,
            gemms,
            weights,
            net,
            post_quant,
            workspace: None,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &VideoVaeConfig {
        &self.config
    }

    /// The spatial tiling decodes use.
    pub fn tiling(&self) -> TilingOptions {
        self.tiling
    }

    /// Sets the tiling of later decodes.
    pub fn set_tiling(&mut self, tiling: TilingOptions) -> Result<(), VideoVaeError> {
        tiling
            .check(self.config.spatial_ratio())
            .map_err(VideoVaeError::Input)?;
        self.tiling = tiling;
        Ok(())
    }

    /// Sets the row budget; the next decode re-plans its buffers.
    pub fn set_budget(&mut self, budget: GpuVideoVaeBudget) {
        self.budget = GpuVideoVaeBudget {
            max_rows: budget.max_rows.max(1),
        };
        self.release_workspace();
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        self.weights.len()
    }

    /// Device bytes held now: weights, the workspace of the last plan, the cuBLASLt workspace.
    pub fn resident_bytes(&self) -> usize {
        self.weights.len()
            + self.workspace.as_ref().map_or(0, Workspace::bytes)
            + self.gemms.workspace_bytes()
    }

    /// The plan of the last decode, if any.
    pub fn plan(&self) -> Option<&DecodePlan> {
        self.workspace.as_ref().map(|w| &w.plan)
    }

    /// The context the decoder runs in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The GEMM handle (plan choices, cache statistics).
    pub fn gemms(&self) -> &GemmRunner {
        &self.gemms
    }

    /// Frees the workspace (the weights stay).
    pub fn release_workspace(&mut self) {
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Plans the GEMMs of a decode of latents `shape` ahead, timing unseen shapes within `budget` (stored in the
    /// persistent plan cache); a decode then never times a GEMM. Allocates that decode's workspace.
    pub fn warm_up(&mut self, shape: &[usize], budget: Duration) -> Result<(), VideoVaeError> {
        let plan = DecodePlan::new(&self.config, shape, &self.tiling, self.budget)?;
        self.ensure_workspace(plan)?;
        let shapes = self.gemm_shapes()?;
        self.gemms
            .prepare(&shapes, budget, &self.stream)
            .map_err(|e| backend("planning the GEMMs", e))?;
        Ok(())
    }

    fn ensure_workspace(&mut self, plan: DecodePlan) -> Result<(), VideoVaeError> {
        if self.workspace.as_ref().is_some_and(|w| w.plan == plan) {
            return Ok(());
        }
        // Work of an earlier decode may still read the old buffers.
        self.stream
            .synchronize()
            .map_err(|e| backend("waiting before re-planning the workspace", e))?;
        self.workspace = None;
        let ws = self.workspace_for(plan)?;
        self.workspace = Some(ws);
        Ok(())
    }

    fn workspace_for(&self, plan: DecodePlan) -> Result<Workspace, VideoVaeError> {
        let cfg = &self.config;
        let (d, inner, c) = (cfg.dim(), cfg.ffn_inner(), cfg.latent_channels);
        let rows = plan.batch_rows();
        let (f, hh, ww) = plan.video;
        let (_, h, w) = plan.latents;
        let overflow =
            || VideoVaeError::Input("the decode's buffers overflow the address space".into());
        let mul = |f: &[usize]| -> Result<usize, VideoVaeError> {
            f.iter()
                .try_fold(1usize, |a, &b| a.checked_mul(b))
                .ok_or_else(overflow)
        };
        let ctx = &self.ctx;
        let alloc = |what: &str, bytes: usize| {
            DeviceBuffer::alloc(ctx, bytes.max(16))
                .map_err(|e| backend(&format!("allocating {bytes} B for the {what}"), e))
        };
        let half = cfg.rope_dim() / 2;
        let (cos, sin) = rope_tables(
            plan.tile_latents,
            cfg.decoder_num_register_tokens,
            cfg.rope_dim(),
            cfg.decoder_rope_theta,
        );
        let mut rope_cos = alloc("RoPE tables", mul(&[rows, half, F32])?)?;
        let mut rope_sin = alloc("RoPE tables", mul(&[rows, half, F32])?)?;
        let repeat = |t: &[f32]| -> Vec<u8> { f32_bytes(&t.repeat(plan.tiles_per_batch)) };
        rope_cos
            .upload_async(0, &repeat(&cos), &self.stream)
            .map_err(|e| backend("uploading the RoPE tables", e))?;
        rope_sin
            .upload_async(0, &repeat(&sin), &self.stream)
            .map_err(|e| backend("uploading the RoPE tables", e))?;
        let t = &plan.tiles;
        let grid: Vec<i32> =
            t.y.starts
                .iter()
                .chain(&t.y.overlaps)
                .chain(&t.x.starts)
                .chain(&t.x.overlaps)
                .map(|&v| i32::try_from(v).unwrap_or(i32::MAX))
                .collect();
        let mut grid_buf = alloc("tile grid", grid.len() * 4)?;
        grid_buf
            .upload_async(0, &le_bytes(&grid, i32::to_le_bytes), &self.stream)
            .map_err(|e| backend("uploading the tile grid", e))?;
        let video_values = mul(&[f, hh, ww, 3])?;
        Ok(Workspace {
            latents: alloc("latents", mul(&[plan.padded_frames, h, w, c, F32])?)?,
            origins: alloc("tile origins", mul(&[plan.tiles_per_batch, 3, 4])?)?,
            grid: grid_buf,
            rope_cos,
            rope_sin,
            x: alloc("residual stream", mul(&[rows, d, F32])?)?,
            normed: alloc("normed rows", mul(&[rows, d, BF16])?)?,
            qkv: alloc("q|k|v", mul(&[rows, 3 * d, BF16])?)?,
            attn: alloc("attention output", mul(&[rows, d, BF16])?)?,
            ff: alloc("SwiGLU projection", mul(&[rows, 2 * inner, BF16])?)?,
            act: alloc("SwiGLU output", mul(&[rows, inner, BF16])?)?,
            out: alloc(
                "decoded tiles",
                mul(&[plan.group_tiles, plan.tokens, cfg.patch_values(), F32])?,
            )?,
            video: alloc("video", mul(&[video_values, F32])?)?,
            rgb: alloc("8-bit frames", video_values)?,
            plan,
        })
    }

    fn weight(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, VideoVaeError> {
        span(&self.weights, offset, bytes)
    }

    fn submit(&self, launch: Result<Launch<'_>, tf_cuda::Error>) -> Result<(), VideoVaeError> {
        let launch = launch.map_err(|e| backend("planning a kernel", e))?;
        // SAFETY: every span a kernel of this decoder is planned over lies inside a live buffer of this decoder
        // (weights) or of the workspace in use, all in the stream's context; the workspace is only replaced or
        // dropped after the stream is synchronized, and the weights live as long as the decoder, whose Drop
        // synchronizes first.
        unsafe { self.kernels.submit(&self.stream, &launch) }.map_err(|e| backend(launch.kernel, e))
    }

    fn gemm(&self, call: Linear) -> Result<(), VideoVaeError> {
        // SAFETY: every span lies inside a live buffer of this decoder (weights) or of the workspace in use
        // (checked by `span`); both outlive the work: the decode synchronizes the stream before returning and
        // before the workspace can be replaced or dropped, and Drop synchronizes first.
        Ok(unsafe { self.gemms.run(&call, &self.stream) }?)
    }

    /// The GEMM calls of one batch of `tiles` tiles whose decoded rows go to tile slot `slot` of the output
    /// buffer, in order: per block q|k|v, output projection, SwiGLU in, SwiGLU out; then proj_out.
    fn batch_gemms(
        &self,
        ws: &Workspace,
        tiles: usize,
        slot: usize,
    ) -> Result<Vec<Vec<Linear>>, VideoVaeError> {
        let cfg = &self.config;
        let (d, inner, p) = (cfg.dim(), cfg.ffn_inner(), cfg.patch_values());
        let rows = tiles * ws.plan.tokens;
        let x = span(&ws.x, 0, rows * d * F32)?;
        let normed = span(&ws.normed, 0, rows * d * BF16)?;
        let qkv = span(&ws.qkv, 0, rows * 3 * d * BF16)?;
        let attn = span(&ws.attn, 0, rows * d * BF16)?;
        let ff = span(&ws.ff, 0, rows * 2 * inner * BF16)?;
        let act = span(&ws.act, 0, rows * inner * BF16)?;
        let mut out = Vec::with_capacity(self.net.blocks.len() + 1);
        for b in &self.net.blocks {
            out.push(vec![
                Linear::new(
                    rows,
                    3 * d,
                    d,
                    normed,
                    self.weight(b.qkv_w, 3 * d * d * BF16)?,
                    qkv,
                )
                .with_bias(Some(self.weight(b.qkv_b, 3 * d * BF16)?)),
                Linear::new(rows, d, d, attn, self.weight(b.out_w, d * d * BF16)?, x)
                    .f32_output(true)
                    .accumulate(true)
                    .with_bias(Some(self.weight(b.out_b, d * F32)?)),
                Linear::new(
                    rows,
                    2 * inner,
                    d,
                    normed,
                    self.weight(b.ff1_w, 2 * inner * d * BF16)?,
                    ff,
                )
                .with_bias(Some(self.weight(b.ff1_b, 2 * inner * BF16)?)),
                Linear::new(
                    rows,
                    d,
                    inner,
                    act,
                    self.weight(b.ff2_w, d * inner * BF16)?,
                    x,
                )
                .f32_output(true)
                .accumulate(true)
                .with_bias(Some(self.weight(b.ff2_b, d * F32)?)),
            ]);
        }
        let row_bytes = ws.plan.tokens * p * F32;
        let y = span(&ws.out, slot * row_bytes, tiles * row_bytes)?;
        out.push(vec![Linear::new(
            rows,
            p,
            d,
            normed,
            self.weight(self.net.proj_out_w, p * d * BF16)?,
            y,
        )
        .f32_output(true)
        .with_bias(Some(self.weight(self.net.proj_out_b, p * F32)?))]);
        Ok(out)
    }

    /// Every distinct GEMM shape of the planned decode.
    fn gemm_shapes(&self) -> Result<Vec<GemmShape>, VideoVaeError> {
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let mut shapes = Vec::new();
        let group = ws.plan.group_tiles;
        let mut slot = 0;
        for batch in ws.plan.batches() {
            for calls in self.batch_gemms(ws, batch.tiles.len(), slot)? {
                shapes.extend(calls.iter().map(Linear::shape));
            }
            slot = if batch.ends_group {
                0
            } else {
                (slot + batch.tiles.len()) % group.max(1)
            };
        }
        Ok(gemm::distinct(shapes))
    }

    /// Enqueues the decode of de-normalized latents into the workspace's f32 video (not synchronized).
    fn enqueue(&mut self, latents: &TensorF32) -> Result<(), VideoVaeError> {
        self.enqueue_spread(latents, None)
    }

    /// [`Self::enqueue`], the groups spread over the ranks of `spread` when given (rank 0's video is the whole
    /// decode; the other ranks' is not written).
    fn enqueue_spread(
        &mut self,
        latents: &TensorF32,
        spread: Option<&Comm>,
    ) -> Result<(), VideoVaeError> {
        let plan = DecodePlan::new(&self.config, latents.shape(), &self.tiling, self.budget)?;
        let z = post_quant_latents(&self.post_quant, latents, &plan)?;
        self.ensure_workspace(plan)?;
        // A shape not planned ahead takes a stored choice, else cuBLASLt's first: no GEMM is timed in a decode.
        let shapes = self.gemm_shapes()?;
        self.gemms
            .prepare(&shapes, Duration::ZERO, &self.stream)
            .map_err(|e| backend("planning the GEMMs", e))?;
        let mut ws = self
            .workspace
            .take()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let result = ws
            .latents
            .upload_async(0, &f32_bytes(&z), &self.stream)
            .map_err(|e| backend("uploading the latents", e))
            .and_then(|()| self.enqueue_in(&mut ws, spread));
        self.workspace = Some(ws);
        result
    }

    /// The plan's groups in order: a group's batches run through the ViT into tile slots from 0, then its clips
    /// are placed into the video. Spread over `spread`'s ranks, each group is decoded by its owner and moved to
    /// rank 0, which alone places clips ([`spread::unit_role`]); one rank runs exactly the one-GPU sequence.
    fn enqueue_in(&self, ws: &mut Workspace, spread: Option<&Comm>) -> Result<(), VideoVaeError> {
        let plan = ws.plan.clone();
        let geo = self.config.chunk_geometry();
        let batches = plan.batches();
        let units = spread::decode_units(&batches, plan.tiles_per_clip)
            .ok_or_else(|| backend("internal", "the plan's batches do not make whole groups"))?;
        let (rank, world) = spread.map_or((0, 1), |c| (c.rank(), c.world_size()));
        for (u, unit) in units.iter().enumerate() {
            let role = spread::unit_role(u, world, rank);
            if role.decode {
                let slots = spread::batch_slots(unit, &batches);
                for (batch, slot) in batches[unit.batches.clone()].iter().zip(slots) {
                    let origins: Vec<[i32; 3]> = batch
                        .tiles
                        .iter()
                        .map(|&(c, i, j)| {
                            let (y0, x0) = plan.tiles.latent_origin(i, j);
                            [c * geo.tokens_chunk_size, y0, x0]
                                .map(|v| i32::try_from(v).unwrap_or(i32::MAX))
                        })
                        .collect();
                    let flat: Vec<i32> = origins.iter().flatten().copied().collect();
                    ws.origins
                        .upload_async(0, &le_bytes(&flat, i32::to_le_bytes), &self.stream)
                        .map_err(|e| backend("uploading tile origins", e))?;
                    self.run_batch(ws, &origins, slot)?;
                }
            }
            if let Some(comm) = spread {
                if role.send_to_root || role.receive_from.is_some() {
                    self.move_unit(ws, comm, unit, role)?;
                }
            }
            if role.blend {
                for (k, clip) in unit.clips.clone().enumerate() {
                    self.assemble(ws, clip, k * plan.tiles_per_clip)?;
                }
            }
        }
        Ok(())
    }

    /// Moves one group's decoded tile slots from its owner to rank 0 (the same slots on both), on the
    /// communicator's stream with its deadline. The decoder's stream is drained first (the owner's batches wrote
    /// the slots; rank 0's blends of the previous group read them) and the transfer is waited for before the
    /// decoder's stream touches them again.
    fn move_unit(
        &self,
        ws: &mut Workspace,
        comm: &Comm,
        unit: &spread::DecodeUnit,
        role: spread::UnitRole,
    ) -> Result<(), VideoVaeError> {
        let slot_values = ws.plan.tokens * self.config.patch_values();
        let values = spread::unit_values(unit, slot_values)
            .ok_or_else(|| backend("internal", "a group's tiles overflow"))?
            .len();
        let world = comm.world_size();
        let mut counts = AllToAllCounts {
            send_counts: vec![0; world],
            send_offsets: vec![0; world],
            recv_counts: vec![0; world],
            recv_offsets: vec![0; world],
        };
        if role.send_to_root {
            counts.send_counts[0] = values;
        }
        if let Some(owner) = role.receive_from {
            counts.recv_counts[owner] = values;
        }
        let what = format!(
            "moving the decoded tiles of clips {:?} to rank 0",
            unit.clips
        );
        self.stream
            .synchronize()
            .map_err(|e| backend(&format!("{what}: waiting for the decode"), e))?;
        // The side that moves nothing is a buffer of this workspace with a count of 0: NCCL never touches it.
        let (send, recv) = if role.send_to_root {
            (ws.out.view(), ws.origins.view_mut())
        } else {
            (ws.origins.view(), ws.out.view_mut())
        };
        // SAFETY: both views are buffers of this decoder's workspace, in the decoder's context, which is the
        // communicator's (checked by `decode_spread`); they stay alive until the synchronize below returns.
        unsafe { comm.all_to_all(&mut [(send, recv)], &counts, DataType::F32) }
            .and_then(|()| comm.synchronize())
            .map_err(|e| backend(&what, e))
    }

    /// The ViT over one batch of tiles, its decoded rows into tile slots `slot..` of the output buffer.
    fn run_batch(
        &self,
        ws: &mut Workspace,
        origins: &[[i32; 3]],
        slot: usize,
    ) -> Result<(), VideoVaeError> {
        let cfg = &self.config;
        let (d, inner, c) = (cfg.dim(), cfg.ffn_inner(), cfg.latent_channels);
        let heads = cfg.decoder_num_attention_heads;
        let tiles = origins.len();
        let s = ws.plan.tokens;
        let rows = tiles * s;
        let eps = cfg.decoder_norm_eps as f32;
        let (_, h, w) = ws.plan.latents;
        let regs = cfg.decoder_num_register_tokens;
        let x = span(&ws.x, 0, rows * d * F32)?;
        let normed = span(&ws.normed, 0, rows * d * BF16)?;
        self.submit(plan_tokens(
            LatentVolume {
                data: span(&ws.latents, 0, ws.plan.padded_frames * h * w * c * F32)?,
                frames: ws.plan.padded_frames,
                height: h,
                width: w,
                channels: c,
            },
            &TokenBatch {
                origins: span(&ws.origins, 0, tiles * 12)?,
                tiles,
                tile: ws.plan.tile_latents,
                registers: regs,
                weight_t: self.weight(self.net.proj_in_wt, c * d * F32)?,
                bias: self.weight(self.net.proj_in_b, d * F32)?,
                register_tokens: self.weight(self.net.registers, regs * d * F32)?,
                dim: d,
                x,
            },
            origins,
        ))?;
        let gemms = self.batch_gemms(ws, tiles, slot)?;
        let launch = |what: &'static str| move |e: tf_cuda::Error| backend(what, e);
        let half = cfg.rope_dim() / 2;
        for (b, calls) in self.net.blocks.iter().zip(&gemms) {
            let [qkv_call, out_call, ff1_call, ff2_call] = calls.as_slice() else {
                return Err(backend("internal", "a block has four GEMMs"));
            };
            self.submit(plan_norm(
                x,
                normed,
                rows,
                d,
                self.weight(b.norm1, d * F32)?,
                RowNorm::Rms,
                eps,
            ))?;
            self.gemm(*qkv_call)?;
            {
                let (cos, sin) = (ws.rope_cos.view(), ws.rope_sin.view());
                let mut qkv = ws.qkv.view_mut();
                self.nn
                    .rope_half_partial(
                        &self.stream,
                        &PartialRope {
                            qkv: &mut qkv,
                            qkv_layout: Matrix::dense(rows, 3 * d),
                            q_heads: heads,
                            kv_heads: heads,
                            head_dim: HEAD_DIM,
                            rotated: cfg.rope_dim(),
                            norm: RopeNorm::Plain { eps },
                            rope_cos: &cos,
                            rope_sin: &sin,
                            rope_stride: half,
                            table: RopeTable::F32,
                        },
                    )
                    .map_err(launch("q/k RMSNorm + RoPE"))?;
            }
            {
                let len = ws.qkv.len();
                let q = ws.qkv.view();
                let k = ws
                    .qkv
                    .slice(d * BF16, len - d * BF16)
                    .map_err(launch("slicing k"))?;
                let v = ws
                    .qkv
                    .slice(2 * d * BF16, len - 2 * d * BF16)
                    .map_err(launch("slicing v"))?;
                let fused = Strides {
                    batch: s * 3 * d,
                    row: 3 * d,
                };
                let inputs = AttentionInputs::self_attention(
                    &q,
                    &k,
                    &v,
                    fused,
                    1.0 / (HEAD_DIM as f32).sqrt(),
                );
                let shape = AttentionShape {
                    batch: tiles,
                    num_queries: s,
                    num_keys: s,
                    prefix_len: 0,
                    num_heads: heads,
                    num_kv_heads: heads,
                };
                self.nn
                    .attention_d64(
                        &self.stream,
                        shape,
                        &inputs,
                        &mut ws.attn.view_mut(),
                        Strides {
                            batch: s * d,
                            row: d,
                        },
                    )
                    .map_err(launch("attention"))?;
            }
            self.gemm(*out_call)?;
            self.submit(plan_norm(
                x,
                normed,
                rows,
                d,
                self.weight(b.norm2, d * F32)?,
                RowNorm::Rms,
                eps,
            ))?;
            self.gemm(*ff1_call)?;
            self.nn
                .swiglu_ordered(
                    &self.stream,
                    SwigluOrder::ValueGate,
                    &ws.ff.view(),
                    Matrix::dense(rows, 2 * inner),
                    &mut ws.act.view_mut(),
                    inner,
                )
                .map_err(launch("SwiGLU"))?;
            self.gemm(*ff2_call)?;
        }
        self.submit(plan_norm(
            x,
            normed,
            rows,
            d,
            self.weight(self.net.norm_out_w, d * F32)?,
            RowNorm::Layer {
                bias: self.weight(self.net.norm_out_b, d * F32)?,
            },
            eps,
        ))?;
        let last = gemms.last().and_then(|g| g.first()).copied();
        self.gemm(last.ok_or_else(|| backend("internal", "no proj_out GEMM"))?)
    }

    /// Places clip `clip`, whose tiles start at tile slot `tile0` of the output buffer, into the video.
    fn assemble(&self, ws: &Workspace, clip: usize, tile0: usize) -> Result<(), VideoVaeError> {
        let cfg = &self.config;
        let plan = &ws.plan;
        let geo = cfg.chunk_geometry();
        let (f, hh, ww) = plan.video;
        let p = cfg.patch_values();
        let t = &plan.tiles;
        self.submit(plan_assemble(
            &ClipTiles {
                out: span(&ws.out, 0, plan.group_tiles * plan.tokens * p * F32)?,
                tiles_held: plan.group_tiles,
                tile0,
                tokens: plan.tokens,
                patch: p,
                grid: span(
                    &ws.grid,
                    0,
                    (2 * t.y.starts.len() + 2 * t.x.starts.len() - 2) * 4,
                )?,
                ny: t.y.starts.len(),
                nx: t.x.starts.len(),
                tile_px: (t.y.size, t.x.size),
                tile_latents: plan.tile_latents,
                pt: geo.temporal_ratio,
                ps: cfg.spatial_ratio(),
                channels: cfg.out_channels,
            },
            &ClipFrames {
                clip,
                clip_frames: geo.clip_frames(),
                pre: geo.frame_pre_padding,
                chunk_frames: geo.chunk_frames(),
                head: geo.head_frames(),
                tail: geo.tail_frames(),
                blend: geo.blend_frames(),
            },
            &VideoBuffer {
                data: span(&ws.video, 0, f * hh * ww * 3 * F32)?,
                frames: f,
                height: hh,
                width: ww,
            },
        ))
    }

    /// The model's decode of de-normalized latents, left on the device (for timing): everything
    /// [`GpuVideoVae::decode_sample`] does but the read-back.
    pub fn decode_on_device(&mut self, latents: &TensorF32) -> Result<(), VideoVaeError> {
        self.enqueue(latents)?;
        self.stream
            .synchronize()
            .map_err(|e| backend("running the decode", e))
    }

    /// The model's decode; see [`VideoVaeBackend::decode_sample`]. The sample is read back channels-last and
    /// transposed on the host.
    pub fn decode_sample(&mut self, latents: &TensorF32) -> Result<TensorF32, VideoVaeError> {
        self.enqueue(latents)?;
        self.stream
            .synchronize()
            .map_err(|e| backend("running the decode", e))?;
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let (f, hh, ww) = ws.plan.video;
        let n = f * hh * ww;
        let video: Vec<f32> = ws
            .video
            .slice(0, n * 3 * F32)
            .and_then(|v| v.to_vec())
            .map_err(|e| backend("downloading the video", e))?;
        let mut sample = vec![0f32; n * 3];
        for (i, px) in video.chunks_exact(3).enumerate() {
            for (c, &v) in px.iter().enumerate() {
                sample[c * n + i] = v;
            }
        }
        Ok(TensorF32::new(vec![1, 3, f, hh, ww], sample)?)
    }

    /// The pipeline's decode; see [`VideoVaeBackend::decode`]. The frames are made on the device.
    pub fn decode(&mut self, latents: &TensorF32) -> Result<VideoFrames, VideoVaeError> {
        let z = denormalize_latents(&self.config, latents)?;
        self.enqueue(&z)?;
        self.frames()
    }

    /// The pipeline's decode spread over the ranks of a multi-GPU job (`comm`, in this decoder's context; module
    /// [`spread`]): every rank calls it with the same latents; rank 0 gets the frames, bit for bit those of
    /// [`GpuVideoVae::decode`] where the ranks run the same GEMM algorithms, and the other ranks `None`.
    pub fn decode_spread(
        &mut self,
        latents: &TensorF32,
        comm: &Comm,
    ) -> Result<Option<VideoFrames>, VideoVaeError> {
        if !comm.stream().context().same_as(&self.ctx) {
            return Err(VideoVaeError::Input(format!(
                "rank {}: the communicator belongs to another context than the video decoder; load the decoder \
                 into the communicator's context",
                comm.rank()
            )));
        }
        let z = denormalize_latents(&self.config, latents)?;
        self.enqueue_spread(&z, Some(comm))?;
        if comm.rank() != 0 {
            self.stream
                .synchronize()
                .map_err(|e| backend("running the decode", e))?;
            return Ok(None);
        }
        self.frames().map(Some)
    }

    /// The 8-bit frames of the decoded video in the workspace: the de-normalization and rounding on the device,
    /// then both read back.
    fn frames(&self) -> Result<VideoFrames, VideoVaeError> {
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let (f, hh, ww) = ws.plan.video;
        let pixels = f * hh * ww;
        self.submit(plan_frames(
            span(&ws.video, 0, pixels * 3 * F32)?,
            span(&ws.rgb, 0, pixels * 3)?,
            pixels,
            PIXEL_MEAN,
            PIXEL_STD,
        ))?;
        self.stream
            .synchronize()
            .map_err(|e| backend("running the decode", e))?;
        let download = |what: &str, e| backend(what, e);
        let values: Vec<f32> = ws
            .video
            .slice(0, pixels * 3 * F32)
            .and_then(|v| v.to_vec())
            .map_err(|e| download("downloading the frames", e))?;
        let rgb: Vec<u8> = ws
            .rgb
            .slice(0, pixels * 3)
            .and_then(|v| v.to_vec())
            .map_err(|e| download("downloading the 8-bit frames", e))?;
        Ok(VideoFrames {
            frames: f,
            height: hh,
            width: ww,
            rgb,
            pixels: values,
        })
    }
}

impl VideoVaeBackend for GpuVideoVae {
    fn config(&self) -> &VideoVaeConfig {
        GpuVideoVae::config(self)
    }

    fn release_workspace(&mut self) {
        GpuVideoVae::release_workspace(self);
    }

    fn tiling(&self) -> TilingOptions {
        GpuVideoVae::tiling(self)
    }

    fn set_tiling(&mut self, tiling: TilingOptions) -> Result<(), VideoVaeError> {
        GpuVideoVae::set_tiling(self, tiling)
    }

    fn decode_sample(&mut self, latents: &TensorF32) -> Result<TensorF32, VideoVaeError> {
        GpuVideoVae::decode_sample(self, latents)
    }

    fn decode(&mut self, latents: &TensorF32) -> Result<VideoFrames, VideoVaeError> {
        GpuVideoVae::decode(self, latents)
    }

    fn decode_spread(
        &mut self,
        latents: &TensorF32,
        comm: &Comm,
    ) -> Result<Option<VideoFrames>, VideoVaeError> {
        GpuVideoVae::decode_spread(self, latents, comm)
    }
}

#[cfg(test)]
mod tests;
