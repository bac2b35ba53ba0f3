//! The Qwen-Image 2.1 VAE decoder on the GPU: the same decode as [`super::vae::HostVaeDecoder`], channels-last
//! (NHWC) in bf16 with f32 accumulation, behind the same [`VaeBackend`](super::components::VaeBackend) interface.
//!
//! - Weights: one device allocation. Convolutions are GEMM matrices `[out_cp, taps * in_cp]` (tap-major, then
//!   channel), channel counts padded to multiples of 8 with zero rows and columns; biases bf16 (f32 for
//!   `conv_out`, whose GEMM writes f32); norm gammas f32, zero padded, so padding channels stay zero throughout.
//! - 3x3 convolutions: on sm_90, one implicit-GEMM launch each ([`crate::nn::gpu::conv`]: the input's taps are
//!   loaded from the map itself, no column matrix; on maps at least 128 wide one input row slice serves a stage's
//!   three horizontal taps), bias and residual in its epilogue. Elsewhere (another GPU, a map
//!   width the kernel does not tile, or `TF_VAE_CONV=im2col`): the `qwen_image_vae` kernels gather columns
//!   for a band of output rows (the nearest 2x upsample is folded into the gather), then one cuBLASLt GEMM per band
//!   writes the rows, bias in the epilogue. An implicit upsample conv reads a nearest-upsampled copy of its input
//!   (`qv_upsample2x` into a free activation buffer).
//!   Residuals are added by the GEMM itself (`beta = 1` on the output that already holds the shortcut), so a
//!   resnet's identity shortcut is updated in place and the DupUp shortcut is written before the upsample conv.
//! - Channel RMS norms (+ SiLU) run in f32 in one kernel; the mid attention is Q, K and Vᵀ GEMMs, f32 scores per
//!   chunk of query rows, a row softmax, and a probabilities x V GEMM (the V bias is added after the softmax:
//!   rows of probabilities sum to one).
//! - Memory: a [`BufferPlan`] per latent size: four activation buffers of the largest map, one column buffer
//!   bounded by [`GpuVaeBudget::cols_bytes`] and the attention scratch, allocated once and reused for every
//!   level and image of that size.
//!
//! Invariant: a decode enqueues everything on one stream and synchronizes once per image, before reading it.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::components::VaeBackend;
//! use tf_engines::qwen_image::vae_gpu::GpuVaeDecoder;
//! use tf_engines::nn::tensor::Tensor;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let mut vae = GpuVaeDecoder::load(&ModelDir::open(Path::new("vae"))?)?;
//! let packed = Tensor::new(vec![1, 64 * 64, 64], vec![0f32; 64 * 64 * 64])?;
//! let image = vae.decode_packed(&packed, 64, 64)?; // [1, 4, 1024, 1024] in [-1, 1]
//! println!("resident: {} B", vae.resident_bytes());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(feature = "bench")]
use std::sync::Mutex;

use tf_cuda::cublaslt::{AlgoSelection, DeviceSpan, OutputType};
use tf_cuda::{Context, DeviceBuffer, Stream};

use super::components::{DecodedPixels, VaeBackend};
use super::vae::{VaeConfig, VaeError};
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::conv::{plan_conv3x3_spans, Conv3x3Shape, ConvOutput, ConvTile};
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, Linear};
use crate::nn::gpu::gemm_int8::Int8GemmKernels;
#[cfg(feature = "bench")]
use crate::nn::gpu::phases::{PhaseTimer, PhaseTimes};
use crate::nn::gpu::Launch;
use crate::nn::gpu::LoadKernelsError;
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::upload::{upload_pieces, Piece, StagingConfig};
use crate::nn::weights::{le_bytes, Dtype, LayoutPlanner, ModelDir, WeightsError, BF16};
use crate::qwen_image::vae_ops::{
    padded_channels, plan_denormalize, plan_dup_up, plan_im2col3x3, plan_image_out,
    plan_rms_norm_silu, plan_softmax_rows, plan_upsample2x, DupUpShape, Im2colBand, ImageOut,
    VaeKernels,
};

const F32: usize = 4;
/// Activation buffers in the pool: a resnet's input, its two temporaries, and a held shortcut.
const POOL: usize = 4;

/// A failure of the GPU path (driver, cuBLASLt, kernels), as a [`VaeError`].
fn backend(what: &str, why: impl IntoGpuError) -> VaeError {
    VaeError::Gpu(gpu_error(format!("GPU decode: {what}"), why))
}

/// Device memory limits of the scratch buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuVaeBudget {
    /// Most bytes of the 3x3 convolution column buffer (it grows to hold at least one output row).
    pub cols_bytes: usize,
    /// Most bytes of one chunk of attention scores (f32) and probabilities (bf16).
    pub scores_bytes: usize,
}

impl Default for GpuVaeBudget {
    fn default() -> Self {
        GpuVaeBudget {
            cols_bytes: 512 << 20,
            scores_bytes: 256 << 20,
        }
    }
}

/// The device buffers one latent size needs, in elements (see [`BufferPlan::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferPlan {
    pub latent_h: usize,
    pub latent_w: usize,
    /// Elements (bf16) of each of the [`POOL`] activation buffers: the largest channels-last map.
    pub pool_elems: usize,
    /// Elements (bf16) of the column buffer: only the 3x3 convs the implicit GEMM does not take read one.
    pub cols_elems: usize,
    /// The conv path the plan was made for (`None`: every 3x3 conv through columns).
    pub implicit: Option<ConvPath>,
    /// Attention tokens (latent pixels) and padded width.
    pub tokens: usize,
    pub attention_cp: usize,
    /// Query rows per chunk of scores.
    pub score_rows: usize,
    /// Output pixels and padded output channels (the f32 conv_out result).
    pub out_pixels: usize,
    pub out_cp: usize,
    pub out_channels: usize,
    pub z: usize,
}

/// One 3x3 convolution of the decode: output size and padded channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ConvSite {
    out_h: usize,
    out_w: usize,
    in_cp: usize,
    out_cp: usize,
}

/// The implicit-GEMM tile that runs a 3x3 conv of `shape` on `path`, or `None` when the conv goes through columns
/// (no implicit path, or a map width no tile covers). The decoder and its [`BufferPlan`] decide by this one function.
fn implicit_tile(path: Option<ConvPath>, shape: Conv3x3Shape) -> Option<ConvTile> {
    let path = path.filter(|p| *p != ConvPath::Im2col)?;
    let short = ConvTile::for_channels(shape.n, false);
    let tall = ConvTile::for_channels(shape.n, true);
    let tile = if path == ConvPath::Implicit
        && short == ConvTile::Cols144
        && shape.check(ConvTile::Rows144).is_ok()
    {
        ConvTile::Rows144
    } else if path != ConvPath::Implicit128 && shape.check(tall).is_ok() {
        tall
    } else {
        short
    };
    shape.check(tile).is_ok().then_some(tile)
}

impl BufferPlan {
    /// Sizes every buffer of a decode of an `h` x `w` latent whose 3x3 convs run on `implicit` (`None`: all through
    /// columns): walks the decoder as [`GpuVaeDecoder`] runs it. The column buffer serves only the convs the implicit
    /// GEMM does not take; when it takes them all, the buffer is empty.
    pub fn new(
        config: &VaeConfig,
        h: usize,
        w: usize,
        budget: GpuVaeBudget,
        implicit: Option<ConvPath>,
    ) -> Result<BufferPlan, VaeError> {
        if h == 0 || w == 0 {
            return Err(VaeError::Input(format!("a {h} x {w} latent is empty")));
        }
        let overflow = || VaeError::Input(format!("a {h} x {w} latent is too large to plan"));
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let dims = config.decoder_dims();
        let levels = config.dim_mult.len();
        let zp = padded_channels(config.z_dim);
        let mid_cp = padded_channels(dims.first().copied().unwrap_or(1));
        let p0 = mul(h, w)?;
        let mut pool = mul(p0, zp.max(mid_cp))?;
        let mut sites = vec![ConvSite {
            out_h: h,
            out_w: w,
            in_cp: zp,
            out_cp: mid_cp,
        }];
        // Mid block: two resnets at the mid width.
        sites.push(ConvSite {
            out_h: h,
            out_w: w,
            in_cp: mid_cp,
            out_cp: mid_cp,
        });
        let (mut hh, mut ww) = (h, w);
        for (i, pair) in dims.windows(2).enumerate() {
            let (in_cp, out_cp) = (padded_channels(pair[0]), padded_channels(pair[1]));
            let pixels = mul(hh, ww)?;
            pool = pool.max(mul(pixels, in_cp.max(out_cp))?);
            for cp in [in_cp, out_cp] {
                sites.push(ConvSite {
                    out_h: hh,
                    out_w: ww,
                    in_cp: cp,
                    out_cp,
                });
            }
            if i + 1 != levels {
                hh = mul(hh, 2)?;
                ww = mul(ww, 2)?;
                pool = pool.max(mul(mul(hh, ww)?, out_cp)?);
                sites.push(ConvSite {
                    out_h: hh,
                    out_w: ww,
                    in_cp: out_cp,
                    out_cp,
                });
            }
        }
        let last_cp = padded_channels(dims.last().copied().unwrap_or(1));
        let out_cp = padded_channels(config.out_channels);
        sites.push(ConvSite {
            out_h: hh,
            out_w: ww,
            in_cp: last_cp,
            out_cp,
        });
        let mut one_row = 0usize;
        let mut whole = 0usize;
        let through_columns = sites.iter().filter(|s| {
            let shape = Conv3x3Shape {
                h: s.out_h,
                w: s.out_w,
                cin: s.in_cp,
                n: s.out_cp,
            };
            implicit_tile(implicit, shape).is_none()
        });
        for s in through_columns {
            let row = mul(mul(s.out_w, 9)?, s.in_cp)?;
            one_row = one_row.max(row);
            whole = whole.max(mul(row, s.out_h)?);
        }
        // No conv through columns: one_row and whole stay 0, and so does the buffer.
        let cols_elems = (budget.cols_bytes / BF16).clamp(one_row, whole.max(one_row));
        // Scores f32 plus probabilities bf16 per query row.
        let score_row_bytes = mul(p0, F32 + BF16)?;
        let score_rows = (budget.scores_bytes / score_row_bytes).clamp(1, p0);
        Ok(BufferPlan {
            latent_h: h,
            latent_w: w,
            pool_elems: pool,
            cols_elems,
            implicit,
            tokens: p0,
            attention_cp: mid_cp,
            score_rows,
            out_pixels: mul(hh, ww)?,
            out_cp,
            out_channels: config.out_channels,
            z: config.z_dim,
        })
    }

    /// Output rows per band of a 3x3 convolution writing `out_h` rows of `out_w` pixels from `in_cp` channels.
    pub fn band_rows(&self, out_h: usize, out_w: usize, in_cp: usize) -> usize {
        let row = out_w.saturating_mul(9).saturating_mul(in_cp).max(1);
        (self.cols_elems / row).clamp(1, out_h.max(1))
    }

    /// Bytes of every buffer of a [`Workspace`] with this plan.
    pub fn bytes(&self) -> usize {
        let sizes = self.sizes();
        sizes.iter().sum()
    }

    /// Bytes of each buffer, in the order [`Workspace::new`] allocates them.
    fn sizes(&self) -> [usize; 8] {
        let act = self.pool_elems * BF16;
        let attn = self.tokens * self.attention_cp * BF16;
        [
            POOL * act,
            self.cols_elems * BF16,
            4 * attn,
            self.score_rows * self.tokens * F32,
            self.score_rows * self.tokens * BF16,
            self.tokens * self.z * F32,
            self.out_pixels * self.out_cp * F32,
            self.out_pixels * self.out_channels * (F32 + 1),
        ]
    }
}

/// A convolution's GEMM matrix and bias in the weight buffer.
#[derive(Clone, Copy, Debug)]
struct ConvW {
    weight: usize,
    bias: usize,
    in_cp: usize,
    out_cp: usize,
    /// 1 or 9.
    taps: usize,
}

impl ConvW {
    fn k(&self) -> usize {
        self.taps * self.in_cp
    }
}

#[derive(Clone, Copy, Debug)]
struct NormW {
    gamma: usize,
    channels: usize,
    cp: usize,
}

#[derive(Clone, Copy, Debug)]
struct ResnetW {
    norm1: NormW,
    conv1: ConvW,
    norm2: NormW,
    conv2: ConvW,
    shortcut: Option<ConvW>,
}

#[derive(Clone, Copy, Debug)]
struct AttentionW {
    norm: NormW,
    q: ConvW,
    k: ConvW,
    v: ConvW,
    proj: ConvW,
}

#[derive(Clone, Debug)]
struct UpBlockW {
    resnets: Vec<ResnetW>,
    /// The upsample conv and the DupUp shortcut `(in_c, out_c, factor_t)`; absent on the last block.
    upsample: Option<(ConvW, usize, usize, usize)>,
}

#[derive(Clone, Debug)]
struct Net {
    mean: usize,
    std: usize,
    post_quant: ConvW,
    conv_in: ConvW,
    mid: [ResnetW; 2],
    attention: AttentionW,
    blocks: Vec<UpBlockW>,
    norm_out: NormW,
    conv_out: ConvW,
}

/// The weight buffer, planned tensor by tensor: each tensor's host values (f32, little-endian) and where its
/// device image goes. The upload ring converts the bf16 ones on the way; the f32 ones are copied as they are.
struct Packer {
    planner: LayoutPlanner,
    /// (device offset, f32 bytes, stored as bf16).
    parts: Vec<(usize, Vec<u8>, bool)>,
}

impl Packer {
    fn new() -> Packer {
        Packer {
            planner: LayoutPlanner::default(),
            parts: Vec::new(),
        }
    }

    fn place(&mut self, values: &[f32], bf16: bool) -> Result<usize, VaeError> {
        let elem = if bf16 { BF16 } else { F32 };
        let bytes = values.len().checked_mul(elem).ok_or_else(|| {
            VaeError::Config(format!("a tensor of {} values is too large", values.len()))
        })?;
        let offset = self.planner.one(bytes)?;
        self.parts
            .push((offset, le_bytes(values, f32::to_le_bytes), bf16));
        Ok(offset)
    }

    fn bf16(&mut self, values: &[f32]) -> Result<usize, VaeError> {
        self.place(values, true)
    }

    fn f32(&mut self, values: &[f32]) -> Result<usize, VaeError> {
        self.place(values, false)
    }

    /// Bytes of the device buffer: up to the end of the last tensor.
    fn bytes(&self) -> usize {
        self.planner.end()
    }

    fn pieces(&self) -> Vec<Piece<'_>> {
        self.parts
            .iter()
            .map(|(offset, bytes, bf16)| {
                if *bf16 {
                    Piece::bf16(bytes, Dtype::F32, *offset)
                } else {
                    Piece::copy(bytes, *offset)
                }
            })
            .collect()
    }

    /// The device image the upload writes, built on the host (zeros between tensors).
    #[cfg(test)]
    fn host_image(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.bytes()];
        crate::nn::upload::fill_host(&mut out, &self.pieces(), 1 << 16, 2).unwrap();
        out
    }
}

/// A PyTorch conv weight `[out, in, taps]` (rows `row0..row0 + out` of a larger one) as the padded GEMM matrix
/// `[out_cp, taps * in_cp]`, tap-major.
fn gemm_matrix(weight: &[f32], row0: usize, out_c: usize, in_c: usize, taps: usize) -> Vec<f32> {
    let (out_cp, in_cp) = (padded_channels(out_c), padded_channels(in_c));
    let k = taps * in_cp;
    let mut m = vec![0f32; out_cp * k];
    for o in 0..out_c {
        let src = &weight[(row0 + o) * in_c * taps..(row0 + o + 1) * in_c * taps];
        for ci in 0..in_c {
            for t in 0..taps {
                m[o * k + t * in_cp + ci] = src[ci * taps + t];
            }
        }
    }
    m
}

fn padded(values: &[f32], len: usize) -> Vec<f32> {
    let mut v = values.to_vec();
    v.resize(len.max(values.len()), 0.0);
    v
}

/// Reads the decoder's tensors, checks their shapes and packs them.
struct Loader<'m> {
    model: &'m ModelDir,
    packer: Packer,
}

impl Loader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, VaeError> {
        let t = self.model.to_f32(name)?;
        if t.shape() != shape {
            return Err(VaeError::Weights(WeightsError::ShapeMismatch {
                path: self.model.dir().to_path_buf(),
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: t.shape().to_vec(),
            }));
        }
        Ok(t.into_data())
    }

    /// Rows `part * out_c..(part + 1) * out_c` of a conv stored with `parts * out_c` output channels.
    #[allow(clippy::too_many_arguments)]
    fn conv_part(
        &mut self,
        name: &str,
        in_c: usize,
        out_c: usize,
        kernel: usize,
        part: usize,
        parts: usize,
        f32_bias: bool,
    ) -> Result<ConvW, VaeError> {
        let taps = kernel * kernel;
        let weight = self.tensor(
            &format!("{name}.weight"),
            &[out_c * parts, in_c, kernel, kernel],
        )?;
        let bias = self.tensor(&format!("{name}.bias"), &[out_c * parts])?;
        let out_cp = padded_channels(out_c);
        let matrix = gemm_matrix(&weight, part * out_c, out_c, in_c, taps);
        let bias = padded(&bias[part * out_c..(part + 1) * out_c], out_cp);
        let weight = self.packer.bf16(&matrix)?;
        let bias = if f32_bias {
            self.packer.f32(&bias)?
        } else {
            self.packer.bf16(&bias)?
        };
        Ok(ConvW {
            weight,
            bias,
            in_cp: padded_channels(in_c),
            out_cp,
            taps,
        })
    }

    fn conv(
        &mut self,
        name: &str,
        in_c: usize,
        out_c: usize,
        kernel: usize,
    ) -> Result<ConvW, VaeError> {
        self.conv_part(name, in_c, out_c, kernel, 0, 1, false)
    }

    fn norm(&mut self, name: &str, channels: usize, shape: &[usize]) -> Result<NormW, VaeError> {
        let gamma = self.tensor(name, shape)?;
        let cp = padded_channels(channels);
        Ok(NormW {
            gamma: self.packer.f32(&padded(&gamma, cp))?,
            channels,
            cp,
        })
    }

    fn resnet(&mut self, name: &str, in_c: usize, out_c: usize) -> Result<ResnetW, VaeError> {
        Ok(ResnetW {
            norm1: self.norm(&format!("{name}.norm1.gamma"), in_c, &[in_c, 1, 1, 1])?,
            conv1: self.conv(&format!("{name}.conv1"), in_c, out_c, 3)?,
            norm2: self.norm(&format!("{name}.norm2.gamma"), out_c, &[out_c, 1, 1, 1])?,
            conv2: self.conv(&format!("{name}.conv2"), out_c, out_c, 3)?,
            shortcut: if in_c != out_c {
                Some(self.conv(&format!("{name}.conv_shortcut"), in_c, out_c, 1)?)
            } else {
                None
            },
        })
    }

    fn net(&mut self, config: &VaeConfig) -> Result<Net, VaeError> {
        let z = config.z_dim;
        let dims = config.decoder_dims();
        let mid = dims[0];
        let levels = config.dim_mult.len();
        let temporal_up: Vec<bool> = config.temperal_downsample.iter().rev().copied().collect();
        let mean = self.packer.f32(&config.latents_mean)?;
        let std = self.packer.f32(&config.latents_std)?;
        let post_quant = self.conv("post_quant_conv", z, z, 1)?;
        let conv_in = self.conv("decoder.conv_in", z, mid, 3)?;
        let mid_resnets = [
            self.resnet("decoder.mid_block.resnets.0", mid, mid)?,
            self.resnet("decoder.mid_block.resnets.1", mid, mid)?,
        ];
        let a = "decoder.mid_block.attentions.0";
        let attention = AttentionW {
            norm: self.norm(&format!("{a}.norm.gamma"), mid, &[mid, 1, 1])?,
            q: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 0, 3, false)?,
            k: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 1, 3, false)?,
            v: self.conv_part(&format!("{a}.to_qkv"), mid, mid, 1, 2, 3, false)?,
            proj: self.conv(&format!("{a}.proj"), mid, mid, 1)?,
        };
        let mut blocks = Vec::with_capacity(levels);
        for (i, pair) in dims.windows(2).enumerate() {
            let (in_c, out_c) = (pair[0], pair[1]);
            let up = i + 1 != levels;
            let factor_t = if up && temporal_up.get(i).copied().unwrap_or(false) {
                2
            } else {
                1
            };
            let mut resnets = Vec::with_capacity(config.num_res_blocks + 1);
            for r in 0..=config.num_res_blocks {
                let from = if r == 0 { in_c } else { out_c };
                resnets.push(self.resnet(
                    &format!("decoder.up_blocks.{i}.resnets.{r}"),
                    from,
                    out_c,
                )?);
            }
            let upsample = if up {
                let shape = DupUpShape {
                    h: 1,
                    w: 1,
                    in_c,
                    out_c,
                    factor_t,
                };
                if shape.repeats().is_none() {
                    return Err(VaeError::Config(format!(
                        "up block {i}: {out_c} x {} sub-positions is not a multiple of {in_c} input channels",
                        factor_t * 4
                    )));
                }
                let conv = self.conv(
                    &format!("decoder.up_blocks.{i}.upsampler.resample.1"),
                    out_c,
                    out_c,
                    3,
                )?;
                Some((conv, in_c, out_c, factor_t))
            } else {
                None
            };
            blocks.push(UpBlockW { resnets, upsample });
        }
        let last = dims.last().copied().unwrap_or(mid);
        let norm_out = self.norm("decoder.norm_out.gamma", last, &[last, 1, 1, 1])?;
        let conv_out =
            self.conv_part("decoder.conv_out", last, config.out_channels, 3, 0, 1, true)?;
        Ok(Net {
            mean,
            std,
            post_quant,
            conv_in,
            mid: mid_resnets,
            attention,
            blocks,
            norm_out,
            conv_out,
        })
    }
}

/// The device buffers of one latent size.
struct Workspace {
    plan: BufferPlan,
    pool: Vec<DeviceBuffer>,
    cols: DeviceBuffer,
    /// Q, K, Vᵀ and the attention output, each `tokens x attention_cp`.
    attention: [DeviceBuffer; 4],
    scores: DeviceBuffer,
    probs: DeviceBuffer,
    packed: DeviceBuffer,
    result: DeviceBuffer,
    image: DeviceBuffer,
}

impl Workspace {
    fn new(ctx: &Context, plan: BufferPlan) -> Result<Workspace, VaeError> {
        let alloc = |what: &str, bytes: usize| {
            DeviceBuffer::alloc(ctx, bytes.max(16)).map_err(|e| {
                backend(
                    &format!(
                        "allocating {bytes} B for the {what} of a {} x {} latent",
                        plan.latent_h, plan.latent_w
                    ),
                    e,
                )
            })
        };
        let act = plan.pool_elems * BF16;
        let attn = plan.tokens * plan.attention_cp * BF16;
        let mut pool = Vec::with_capacity(POOL);
        for _ in 0..POOL {
            pool.push(alloc("activations", act)?);
        }
        Ok(Workspace {
            plan,
            pool,
            cols: alloc("conv columns", plan.cols_elems * BF16)?,
            attention: [
                alloc("attention q", attn)?,
                alloc("attention k", attn)?,
                alloc("attention v", attn)?,
                alloc("attention output", attn)?,
            ],
            scores: alloc("attention scores", plan.score_rows * plan.tokens * F32)?,
            probs: alloc(
                "attention probabilities",
                plan.score_rows * plan.tokens * BF16,
            )?,
            packed: alloc("packed latents", plan.tokens * plan.z * F32)?,
            result: alloc("conv_out result", plan.out_pixels * plan.out_cp * F32)?,
            image: alloc(
                "image and its pixels",
                plan.out_pixels * plan.out_channels * (F32 + 1),
            )?,
        })
    }

    /// Pool buffer `index` as a `pixels x cp` bf16 map.
    fn act(&self, index: usize, pixels: usize, cp: usize) -> Result<DeviceSpan, VaeError> {
        let buf = self
            .pool
            .get(index)
            .ok_or_else(|| backend("internal", format!("no activation buffer {index}")))?;
        span(buf, 0, pixels * cp * BF16)
    }
}

/// `bytes` at `offset` of `buf` as a GEMM or kernel operand, checked.
fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, VaeError> {
    Ok(gemm::span(buf, offset, bytes)?)
}

impl From<GemmError> for VaeError {
    fn from(e: GemmError) -> VaeError {
        backend("GEMM", e)
    }
}

/// The first pool index not in `taken`.
fn free_index(taken: &[usize]) -> Result<usize, VaeError> {
    (0..POOL)
        .find(|i| !taken.contains(i))
        .ok_or_else(|| backend("internal", "every activation buffer is in use"))
}

/// What one GPU decode brought back.
struct Decoded {
    images: Option<TensorF32>,
    pixels: Option<Vec<u8>>,
}

/// The environment variable that picks how the decoder runs its 3x3 convolutions ([`ConvPath`]): `implicit` (the
/// default on sm_90), `implicit-tall`, `implicit128` or `im2col` (the only path on other GPUs).
pub const CONV_ENV: &str = "TF_VAE_CONV";

/// How the decoder runs its 3x3 convolutions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// One implicit-GEMM launch a conv ([`crate::nn::gpu::conv`]); where the channel count suits the 144-channel
    /// tile, the row-reuse tile on maps at least 128 wide and 256-pixel tiles on narrower ones (`implicit`, the
    /// default).
    Implicit,
    /// The same without the row-reuse tile: 256-pixel tiles wherever they fit (`implicit-tall`).
    ImplicitTall,
    /// The same with tiles of 128 pixels only, no row reuse (`implicit128`).
    Implicit128,
    /// A column matrix gathered per band of rows, then a cuBLASLt GEMM (`im2col`).
    Im2col,
}

impl ConvPath {
    /// The path [`CONV_ENV`]'s value names (the default when unset).
    pub fn parse(value: Option<&str>) -> Result<ConvPath, VaeError> {
        match value {
            None | Some("implicit") => Ok(ConvPath::Implicit),
            Some("implicit128") => Ok(ConvPath::Implicit128),
            Some("implicit-tall") => Ok(ConvPath::ImplicitTall),
            Some("im2col") => Ok(ConvPath::Im2col),
            Some(other) => Err(VaeError::Config(format!(
                "{CONV_ENV}={other:?} is not a conv path: use `implicit`, `implicit-tall`, `implicit128` or `im2col`"
            ))),
        }
    }

    /// The name [`Self::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            ConvPath::Implicit => "implicit",
            ConvPath::Implicit128 => "implicit128",
            ConvPath::ImplicitTall => "implicit-tall",
            ConvPath::Im2col => "im2col",
        }
    }
}

/// The implicit-GEMM conv kernels when the GPU runs them (sm_90), else `None`.
fn load_implicit_convs(ctx: &Context) -> Result<Option<Int8GemmKernels>, VaeError> {
    match Int8GemmKernels::load(ctx) {
        Ok(k) => Ok(Some(k)),
        // Not sm_90 (or not built): the im2col path serves every conv.
        Err(LoadKernelsError::Missing { .. }) => Ok(None),
        Err(e) => Err(backend("loading the implicit-GEMM conv kernels", e)),
    }
}

/// The phase an implicit-GEMM 3x3 conv at output width `out_w` is timed in.
fn conv3x3_implicit_phase(out_w: usize, image_w: usize) -> &'static str {
    match image_w.checked_div(out_w) {
        Some(1) => "conv3x3 implicit GEMM, full size",
        Some(2) => "conv3x3 implicit GEMM, 1/2 size",
        Some(4) => "conv3x3 implicit GEMM, 1/4 size",
        Some(8) => "conv3x3 implicit GEMM, 1/8 size",
        _ => "conv3x3 implicit GEMM, 1/16 size",
    }
}

/// The phase a 3x3 conv GEMM at output width `out_w` is timed in, by its scale against the image width `image_w`.
fn conv3x3_phase(out_w: usize, image_w: usize) -> &'static str {
    match image_w.checked_div(out_w) {
        Some(1) => "conv3x3 GEMM, full size",
        Some(2) => "conv3x3 GEMM, 1/2 size",
        Some(4) => "conv3x3 GEMM, 1/4 size",
        _ => "conv3x3 GEMM, 1/8 size",
    }
}

/// The VAE decoder on the GPU.
pub struct GpuVaeDecoder {
    config: VaeConfig,
    ctx: Context,
    stream: Stream,
    kernels: VaeKernels,
    gemms: GemmRunner,
    /// The implicit-GEMM 3x3 convolutions (sm_90 only), and the path asked for ([`CONV_ENV`]).
    convs: Option<Int8GemmKernels>,
    conv_path: ConvPath,
    weights: DeviceBuffer,
    net: Net,
    budget: GpuVaeBudget,
    workspace: Option<Workspace>,
    /// Set only while `time_phases` (the `bench` feature) runs: an event after each launch.
    #[cfg(feature = "bench")]
    phase_timer: Mutex<Option<PhaseTimer>>,
}

impl std::fmt::Debug for GpuVaeDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuVaeDecoder")
            .field("config", &self.config)
            .field("weight_bytes", &self.weights.len())
            .field("workspace", &self.workspace.as_ref().map(|w| w.plan))
            .finish_non_exhaustive()
    }
}

impl Drop for GpuVaeDecoder {
    fn drop(&mut self) {
        // Work still queued (after an error mid-decode) must not outlive the buffers it reads. On a lost context
        // this fails fast without calling the driver (tf-cuda checks its health first), and the buffers leak.
        let _ = self.stream.synchronize();
    }
}

impl GpuVaeDecoder {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuVaeDecoder, VaeError> {
        let driver = tf_cuda::open_driver().map_err(|e| backend("opening the CUDA driver", e))?;
        let ctx =
            Context::new(driver, 0).map_err(|e| backend("creating a context on device 0", e))?;
        GpuVaeDecoder::load_on(&ctx, model)
    }

    /// Loads the decoder weights of a diffusers VAE folder into `ctx` (checking every shape against the config),
    /// the `qwen_image_vae` kernels and cuBLASLt.
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuVaeDecoder, VaeError> {
        let config = VaeConfig::from_json(model.config_json())?;
        let mut loader = Loader {
            model,
            packer: Packer::new(),
        };
        let net = loader.net(&config)?;
        let packer = loader.packer;
        let stream = Stream::new(ctx, false).map_err(|e| backend("creating a stream", e))?;
        let kernels = VaeKernels::load(ctx).map_err(|e| backend("loading kernels", e))?;
        let gemms = GemmRunner::new(ctx, AlgoSelection::Heuristic)
            .map_err(|e| backend("loading cuBLASLt", e))?;
        let conv_path = ConvPath::parse(std::env::var(CONV_ENV).ok().as_deref())?;
        let convs = load_implicit_convs(ctx)?;
        let total = packer.bytes();
        let mut weights = DeviceBuffer::alloc(ctx, total)
            .map_err(|e| backend(&format!("allocating {total} B of weights"), e))?;
        // The alignment gaps between tensors read as zeros.
        weights
            .fill_u8(0, Some(&stream))
            .map_err(|e| backend("clearing the weights", e))?;
        upload_pieces(
            ctx,
            &stream,
            &mut weights,
            &packer.pieces(),
            StagingConfig::default(),
        )
        .map_err(|e| backend(&format!("uploading {total} B of weights"), e))?;
        Ok(GpuVaeDecoder {
            config,
            ctx: ctx.clone(),
            stream,
            kernels,
            gemms,
            convs,
            conv_path,
            weights,
            net,
            budget: GpuVaeBudget::default(),
            workspace: None,
            #[cfg(feature = "bench")]
            phase_timer: Mutex::new(None),
        })
    }

    /// Sets how the 3x3 convolutions run (the default comes from [`CONV_ENV`]); returns whether the implicit GEMMs
    /// now run (never on a GPU without them: there every path is im2col).
    pub fn set_conv_path(&mut self, path: ConvPath) -> bool {
        self.conv_path = path;
        self.uses_implicit_convs()
    }

    /// Whether the 3x3 convolutions run as implicit GEMMs.
    pub fn uses_implicit_convs(&self) -> bool {
        self.conv_path != ConvPath::Im2col && self.convs.is_some()
    }

    /// The parsed config.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// Sets the scratch limits; the next decode re-plans its buffers.
    pub fn set_budget(&mut self, budget: GpuVaeBudget) {
        self.budget = budget;
        // Nothing queued may still use the buffers (a failure here means the context is gone, and the
        // buffers with it).
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        self.weights.len()
    }

    /// The buffer plan of the latent size decoded last, if any.
    pub fn buffer_plan(&self) -> Option<BufferPlan> {
        self.workspace.as_ref().map(|w| w.plan)
    }

    /// Device bytes held now: weights, the workspace of the last latent size, the cuBLASLt workspace.
    pub fn resident_bytes(&self) -> usize {
        self.weights.len()
            + self.workspace.as_ref().map_or(0, |w| w.plan.bytes())
            + self.gemms.workspace_bytes()
    }

    /// Frees the workspace (the weights stay).
    pub fn release_workspace(&mut self) {
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Decodes packed latents `[batch, h * w, z]`; see [`VaeBackend::decode_packed`](super::components::VaeBackend::decode_packed).
    pub fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        self.decode(packed, h, w, true, false)?
            .images
            .ok_or_else(|| backend("internal", "the decode kept no images"))
    }

    fn decode(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
        images: bool,
        pixels: bool,
    ) -> Result<Decoded, VaeError> {
        let z = self.config.z_dim;
        let [batch, tokens, channels] = packed.dims::<3>("packed latents")?;
        if batch == 0 || h == 0 || w == 0 || h.checked_mul(w) != Some(tokens) || channels != z {
            return Err(VaeError::Input(format!(
                "packed latents are [{batch}, {tokens}, {channels}]; expected [batch >= 1, h * w, {z}] for a non-empty \
                 {h} x {w} latent"
            )));
        }
        let reuse = self.workspace.as_ref().is_some_and(|ws| {
            ws.plan.latent_h == h
                && ws.plan.latent_w == w
                && ws.plan.implicit == self.implicit_path()
        });
        if !reuse {
            // Work of a failed decode may still read the old buffers.
            self.stream
                .synchronize()
                .map_err(|e| backend("waiting before re-planning the workspace", e))?;
            self.workspace = None;
            let plan = BufferPlan::new(&self.config, h, w, self.budget, self.implicit_path())?;
            self.workspace = Some(Workspace::new(&self.ctx, plan)?);
        }
        let mut ws = self
            .workspace
            .take()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let result = self.decode_batch(&mut ws, packed, batch, images, pixels);
        self.workspace = Some(ws);
        result
    }

    /// (The `bench` feature.) Device time of each phase of one decode of `packed` (after an untimed decode that plans the workspace and
    /// the GEMMs): an event after every launch, summed per kernel and per GEMM kind (the 3x3 conv GEMMs per scale).
    /// The events add a little time; the decode itself is the normal one.
    #[cfg(feature = "bench")]
    pub fn time_phases(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<PhaseTimes, VaeError> {
        self.decode_packed(packed, h, w)?;
        let timer = PhaseTimer::begin(&self.ctx, &self.stream)
            .map_err(|e| backend("recording a phase event", e))?;
        self.set_phase_timer(Some(timer))?;
        let decoded = self.decode_packed(packed, h, w);
        let timer = self.set_phase_timer(None)?;
        decoded?;
        let timer = timer.ok_or_else(|| backend("phase timer", "it was gone after the decode"))?;
        timer
            .totals()
            .map_err(|e| backend("reading the phase events", e))
    }

    /// Replaces the phase timer, returning the previous one.
    #[cfg(feature = "bench")]
    fn set_phase_timer(&self, timer: Option<PhaseTimer>) -> Result<Option<PhaseTimer>, VaeError> {
        let mut slot = self
            .phase_timer
            .lock()
            .map_err(|_| backend("phase timer", "a panic left it poisoned"))?;
        Ok(std::mem::replace(&mut *slot, timer))
    }

    /// Decodes every image of `packed`, downloading the f32 images when `images` and the first image's 8-bit
    /// pixels when `pixels`.
    fn decode_batch(
        &self,
        ws: &mut Workspace,
        packed: &TensorF32,
        batch: usize,
        images: bool,
        pixels: bool,
    ) -> Result<Decoded, VaeError> {
        let plan = ws.plan;
        let per_image = plan.out_pixels * plan.out_channels;
        let result = span(&ws.result, 0, plan.out_pixels * plan.out_cp * F32)?;
        let planes = span(&ws.image, 0, per_image * F32)?;
        let bytes = span(&ws.image, per_image * F32, per_image)?;
        // The first image's download becomes the output as it is (the usual batch of one copies nothing more).
        let mut out: Vec<f32> = Vec::new();
        let mut out_pixels = None;
        let f = self.config.spatial_factor();
        for (index, src) in packed
            .data()
            .chunks_exact(plan.tokens * plan.z)
            .take(batch)
            .enumerate()
        {
            // On the decode's stream, so the copy is ordered before the kernels that read it.
            ws.packed
                .upload_async(0, &le_bytes(src, f32::to_le_bytes), &self.stream)
                .map_err(|e| backend("uploading latents", e))?;
            self.enqueue_image(ws)?;
            let first_pixels = pixels && index == 0;
            for (wanted, kind, out) in [
                (images, ImageOut::Planes, planes),
                (first_pixels, ImageOut::Pixels, bytes),
            ] {
                if wanted {
                    let dims = (plan.out_pixels, plan.out_channels, plan.out_cp);
                    self.submit(plan_image_out(kind, result, dims, out))?;
                }
            }
            self.stream
                .synchronize()
                .map_err(|e| backend("running the decode", e))?;
            if first_pixels {
                let mut px = vec![0u8; per_image];
                ws.image
                    .download(per_image * F32, &mut px)
                    .map_err(|e| backend("downloading the pixels", e))?;
                out_pixels = Some(px);
            }
            if !images {
                continue;
            }
            // Straight into f32 values: no byte copy and no second conversion pass over the image.
            let image: Vec<f32> = ws
                .image
                .slice(0, per_image * F32)
                .and_then(|view| view.to_vec())
                .map_err(|e| backend("downloading the image", e))?;
            if out.is_empty() {
                out = image;
                let rest = batch.saturating_sub(1).saturating_mul(per_image);
                out.try_reserve_exact(rest)
                    .map_err(|e| backend("holding the decoded images", e.to_string()))?;
            } else {
                out.extend_from_slice(&image);
            }
        }
        let images = if images {
            Some(Tensor::new(
                vec![
                    batch,
                    plan.out_channels,
                    plan.latent_h * f,
                    plan.latent_w * f,
                ],
                out,
            )?)
        } else {
            None
        };
        Ok(Decoded {
            images,
            pixels: out_pixels,
        })
    }

    fn weight(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, VaeError> {
        span(&self.weights, offset, bytes)
    }

    fn submit(&self, launch: Result<Launch<'_>, tf_cuda::Error>) -> Result<(), VaeError> {
        let launch = launch.map_err(|e| backend("planning a kernel", e))?;
        // SAFETY: every span a VAE kernel is planned over lies inside a live buffer of this decoder (weights) or
        // of the workspace in use, all in the stream's context; their Drop synchronizes the context before freeing.
        unsafe { self.kernels.submit(&self.stream, &launch) }
            .map_err(|e| backend(launch.kernel, e))?;
        self.mark(launch.kernel, 0.0)
    }

    /// Enqueues `call`, timed as `phase` by `time_phases` (the `bench` feature).
    fn gemm(&self, phase: &'static str, call: Linear) -> Result<(), VaeError> {
        // SAFETY: every span lies inside a live buffer of this decoder (weights) or of the workspace in use
        // (checked by `span`); both outlive the work: the decode synchronizes the stream before returning and
        // before the workspace can be replaced or dropped, and Drop synchronizes first.
        unsafe { self.gemms.run(&call, &self.stream) }?;
        let flops = 2.0 * call.m as f64 * call.n as f64 * call.k as f64;
        self.mark(phase, flops)
    }

    /// Ends the phase `phase` when a phase timer runs (an event on the stream); nothing otherwise.
    #[cfg(feature = "bench")]
    fn mark(&self, phase: &'static str, flops: f64) -> Result<(), VaeError> {
        let mut timer = self
            .phase_timer
            .lock()
            .map_err(|_| backend("phase timer", "a panic left it poisoned"))?;
        if let Some(timer) = timer.as_mut() {
            timer
                .mark(&self.stream, phase, flops, 0.0)
                .map_err(|e| backend("recording a phase event", e))?;
        }
        Ok(())
    }

    /// Without the `bench` feature nothing is timed.
    #[cfg(not(feature = "bench"))]
    #[inline(always)]
    fn mark(&self, _phase: &'static str, _flops: f64) -> Result<(), VaeError> {
        Ok(())
    }

    /// `y = conv(x) + bias (+ y when accumulate)` for a 1x1 conv over `pixels`.
    fn conv1x1(
        &self,
        conv: &ConvW,
        x: DeviceSpan,
        pixels: usize,
        y: DeviceSpan,
        accumulate: bool,
    ) -> Result<(), VaeError> {
        self.gemm(
            "conv1x1 GEMM",
            Linear {
                m: pixels,
                n: conv.out_cp,
                k: conv.k(),
                x,
                w: self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?,
                y,
                bias: Some(self.weight(conv.bias, conv.out_cp * BF16)?),
                alpha: 1.0,
                beta: if accumulate { 1.0 } else { 0.0 },
                output: OutputType::Bf16,
            },
        )
    }

    /// The conv path the implicit GEMMs run on, or `None` where every conv goes through columns (another GPU, or
    /// [`ConvPath::Im2col`]).
    fn implicit_path(&self) -> Option<ConvPath> {
        self.convs
            .as_ref()
            .map(|_| self.conv_path)
            .filter(|p| *p != ConvPath::Im2col)
    }

    /// A 3x3 conv writing an `out_h` x `out_w` map into `y` (bf16, or f32 with `f32_out`), band by band.
    #[allow(clippy::too_many_arguments)]
    fn conv3x3(
        &self,
        ws: &Workspace,
        conv: &ConvW,
        x: DeviceSpan,
        (out_h, out_w): (usize, usize),
        upsample: bool,
        y: DeviceSpan,
        accumulate: bool,
        f32_out: bool,
    ) -> Result<(), VaeError> {
        let image_w = ws.plan.latent_w * self.config.spatial_factor();
        let shape = Conv3x3Shape {
            h: out_h,
            w: out_w,
            cin: conv.in_cp,
            n: conv.out_cp,
        };
        let implicit = implicit_tile(self.implicit_path(), shape);
        if let (Some(convs), Some(tile), false) = (&self.convs, implicit, upsample) {
            let (output, out_size) = if f32_out {
                (ConvOutput::F32, F32)
            } else {
                (ConvOutput::Bf16, BF16)
            };
            let operands = (
                x,
                self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?,
                self.weight(conv.bias, conv.out_cp * out_size)?,
            );
            let launch = plan_conv3x3_spans(
                &self.ctx,
                convs.sm_count(),
                (shape, tile),
                operands,
                (y, output),
                accumulate,
            )
            .map_err(|e| backend("planning an implicit-GEMM conv", e))?;
            // SAFETY: x, y and the weights lie inside live buffers of this decoder or of the workspace in use
            // (checked by `span`), in the stream's context; the decode synchronizes before they can be
            // replaced or dropped, and Drop synchronizes first. x and y are different buffers.
            unsafe { convs.submit_spans(&self.stream, &launch) }
                .map_err(|e| backend(launch.kernel, e))?;
            let flops = 2.0 * (out_h * out_w) as f64 * conv.out_cp as f64 * conv.k() as f64;
            return self.mark(conv3x3_implicit_phase(out_w, image_w), flops);
        }
        let out_size = if f32_out { F32 } else { BF16 };
        let band_rows = ws.plan.band_rows(out_h, out_w, conv.in_cp);
        let w = self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?;
        let bias = self.weight(conv.bias, conv.out_cp * out_size)?;
        let mut row0 = 0;
        while row0 < out_h {
            let rows = band_rows.min(out_h - row0);
            let band = Im2colBand {
                out_h,
                out_w,
                cp: conv.in_cp,
                upsample,
                row0,
                rows,
            };
            let m = rows * out_w;
            let cols = span(&ws.cols, 0, m * conv.k() * BF16)?;
            self.submit(plan_im2col3x3(x, band, cols))?;
            let row_bytes = out_w * conv.out_cp * out_size;
            let y_band = gemm::sub_span(y, row0 * row_bytes, rows * row_bytes)?;
            self.gemm(
                conv3x3_phase(out_w, image_w),
                Linear {
                    m,
                    n: conv.out_cp,
                    k: conv.k(),
                    x: cols,
                    w,
                    y: y_band,
                    bias: Some(bias),
                    alpha: 1.0,
                    beta: if accumulate { 1.0 } else { 0.0 },
                    output: if f32_out {
                        OutputType::F32
                    } else {
                        OutputType::Bf16
                    },
                },
            )?;
            row0 += rows;
        }
        Ok(())
    }

    fn norm(
        &self,
        norm: &NormW,
        x: DeviceSpan,
        y: DeviceSpan,
        pixels: usize,
        silu: bool,
    ) -> Result<(), VaeError> {
        let gamma = self.weight(norm.gamma, norm.cp * F32)?;
        self.submit(plan_rms_norm_silu(
            x,
            y,
            gamma,
            pixels,
            norm.channels,
            norm.cp,
            silu,
        ))
    }

    /// One resnet on pool buffer `x` (never touching `held`); returns the buffer holding its output.
    fn resnet(
        &self,
        ws: &Workspace,
        r: &ResnetW,
        x: usize,
        held: Option<usize>,
        (h, w): (usize, usize),
    ) -> Result<usize, VaeError> {
        let pixels = h * w;
        let mut taken = vec![x];
        taken.extend(held);
        let b = free_index(&taken)?;
        taken.push(b);
        let c = free_index(&taken)?;
        let (in_cp, out_cp) = (r.conv1.in_cp, r.conv1.out_cp);
        let xs = ws.act(x, pixels, in_cp)?;
        let bs_in = ws.act(b, pixels, in_cp)?;
        let cs = ws.act(c, pixels, out_cp)?;
        self.norm(&r.norm1, xs, bs_in, pixels, true)?;
        self.conv3x3(ws, &r.conv1, bs_in, (h, w), false, cs, false, false)?;
        self.norm(&r.norm2, cs, cs, pixels, true)?;
        match &r.shortcut {
            Some(sc) => {
                let bs = ws.act(b, pixels, out_cp)?;
                self.conv1x1(sc, xs, pixels, bs, false)?;
                self.conv3x3(ws, &r.conv2, cs, (h, w), false, bs, true, false)?;
                Ok(b)
            }
            None => {
                self.conv3x3(ws, &r.conv2, cs, (h, w), false, xs, true, false)?;
                Ok(x)
            }
        }
    }

    /// The mid block's single-head attention, residual added in place into pool buffer `x`.
    fn attention(&self, ws: &Workspace, x: usize) -> Result<(), VaeError> {
        let a = &self.net.attention;
        let plan = ws.plan;
        let (p, cp) = (plan.tokens, a.norm.cp);
        let xs = ws.act(x, p, cp)?;
        let n = free_index(&[x])?;
        let ns = ws.act(n, p, cp)?;
        self.norm(&a.norm, xs, ns, p, false)?;
        let bytes = p * cp * BF16;
        let [q, k, vt, o] = &ws.attention;
        let (q, k, vt, o) = (
            span(q, 0, bytes)?,
            span(k, 0, bytes)?,
            span(vt, 0, bytes)?,
            span(o, 0, bytes)?,
        );
        self.conv1x1(&a.q, ns, p, q, false)?;
        self.conv1x1(&a.k, ns, p, k, false)?;
        // Vᵀ [cp, p] = Wv . normedᵀ; its bias is added to the output (probability rows sum to one).
        self.gemm(
            "attention GEMM",
            Linear {
                m: cp,
                n: p,
                k: cp,
                x: self.weight(a.v.weight, cp * cp * BF16)?,
                w: ns,
                y: vt,
                bias: None,
                alpha: 1.0,
                beta: 0.0,
                output: OutputType::Bf16,
            },
        )?;
        let scale = 1.0 / (a.norm.channels as f32).sqrt();
        let v_bias = self.weight(a.v.bias, cp * BF16)?;
        let mut row0 = 0;
        while row0 < p {
            let rows = plan.score_rows.min(p - row0);
            let scores = span(&ws.scores, 0, rows * p * F32)?;
            let probs = span(&ws.probs, 0, rows * p * BF16)?;
            let q_rows = gemm::sub_span(q, row0 * cp * BF16, rows * cp * BF16)?;
            self.gemm(
                "attention GEMM",
                Linear {
                    m: rows,
                    n: p,
                    k: cp,
                    x: q_rows,
                    w: k,
                    y: scores,
                    bias: None,
                    alpha: scale,
                    beta: 0.0,
                    output: OutputType::F32,
                },
            )?;
            self.submit(plan_softmax_rows(scores, rows, p, probs))?;
            let o_rows = gemm::sub_span(o, row0 * cp * BF16, rows * cp * BF16)?;
            self.gemm(
                "attention GEMM",
                Linear {
                    m: rows,
                    n: cp,
                    k: p,
                    x: probs,
                    w: vt,
                    y: o_rows,
                    bias: Some(v_bias),
                    alpha: 1.0,
                    beta: 0.0,
                    output: OutputType::Bf16,
                },
            )?;
            row0 += rows;
        }
        self.conv1x1(&a.proj, o, p, xs, true)
    }

    /// Enqueues the decode of the latents in `ws.packed` into `ws.image`.
    fn enqueue_image(&self, ws: &Workspace) -> Result<(), VaeError> {
        let net = &self.net;
        let plan = ws.plan;
        let (mut h, mut w) = (plan.latent_h, plan.latent_w);
        let p0 = h * w;
        let zp = net.post_quant.in_cp;
        let z = plan.z;
        self.submit(plan_denormalize(
            span(&ws.packed, 0, p0 * z * F32)?,
            p0,
            z,
            self.weight(net.mean, z * F32)?,
            self.weight(net.std, z * F32)?,
            ws.act(1, p0, zp)?,
            zp,
        ))?;
        self.conv1x1(
            &net.post_quant,
            ws.act(1, p0, zp)?,
            p0,
            ws.act(2, p0, zp)?,
            false,
        )?;
        let mid_cp = net.conv_in.out_cp;
        self.conv3x3(
            ws,
            &net.conv_in,
            ws.act(2, p0, zp)?,
            (h, w),
            false,
            ws.act(0, p0, mid_cp)?,
            false,
            false,
        )?;
        let mut x = self.resnet(ws, &net.mid[0], 0, None, (h, w))?;
        self.attention(ws, x)?;
        x = self.resnet(ws, &net.mid[1], x, None, (h, w))?;
        for block in &net.blocks {
            // The DupUp shortcut is written first into the buffer the upsample conv then adds to.
            let held = match block.upsample {
                Some((_, in_c, out_c, factor_t)) => {
                    let d = free_index(&[x])?;
                    let shape = DupUpShape {
                        h,
                        w,
                        in_c,
                        out_c,
                        factor_t,
                    };
                    let pixels = h * w;
                    self.submit(plan_dup_up(
                        ws.act(x, pixels, padded_channels(in_c))?,
                        shape,
                        ws.act(d, 4 * pixels, padded_channels(out_c))?,
                    ))?;
                    Some(d)
                }
                None => None,
            };
            for r in &block.resnets {
                x = self.resnet(ws, r, x, held, (h, w))?;
            }
            if let (Some((conv, ..)), Some(d)) = (&block.upsample, held) {
                let src = ws.act(x, h * w, conv.in_cp)?;
                let (src_h, src_w) = (h, w);
                h *= 2;
                w *= 2;
                let dst = ws.act(d, h * w, conv.out_cp)?;
                let implicit_shape = Conv3x3Shape {
                    h,
                    w,
                    cin: conv.in_cp,
                    n: conv.out_cp,
                };
                if implicit_tile(self.implicit_path(), implicit_shape).is_some() {
                    // The implicit GEMM reads the upsampled map itself: 4x the input, not 9x 4x of columns.
                    let up = ws.act(free_index(&[x, d])?, h * w, conv.in_cp)?;
                    self.submit(plan_upsample2x(src, (src_h, src_w, conv.in_cp), up))?;
                    self.conv3x3(ws, conv, up, (h, w), false, dst, true, false)?;
                } else {
                    self.conv3x3(ws, conv, src, (h, w), true, dst, true, false)?;
                }
                x = d;
            }
        }
        let pixels = h * w;
        let cp = net.norm_out.cp;
        let n = free_index(&[x])?;
        self.norm(
            &net.norm_out,
            ws.act(x, pixels, cp)?,
            ws.act(n, pixels, cp)?,
            pixels,
            true,
        )?;
        let result = span(&ws.result, 0, pixels * plan.out_cp * F32)?;
        self.conv3x3(
            ws,
            &net.conv_out,
            ws.act(n, pixels, cp)?,
            (h, w),
            false,
            result,
            false,
            true,
        )
    }
}

/// The GPU decoder makes the 8-bit pixels on the device (the bytes [`super::vae::to_u8_hwc`] gives, a quarter
/// of the f32 image's download) and brings the f32 images back only when asked.
impl VaeBackend for GpuVaeDecoder {
    fn config(&self) -> &VaeConfig {
        GpuVaeDecoder::config(self)
    }

    fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        GpuVaeDecoder::decode_packed(self, packed, h, w)
    }

    fn decode_packed_pixels(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
        keep_images: bool,
    ) -> Result<DecodedPixels, VaeError> {
        let decoded = self.decode(packed, h, w, keep_images, true)?;
        let pixels = decoded
            .pixels
            .ok_or_else(|| backend("internal", "the decode made no pixels"))?;
        let f = self.config.spatial_factor();
        Ok(DecodedPixels {
            images: decoded.images,
            pixels,
            channels: self.config.out_channels,
            height: h * f,
            width: w * f,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config(base: usize, z: usize) -> VaeConfig {
        let v = serde_json::json!({"_class_name": "AutoencoderKLQwenImage21", "decoder_base_dim": base,
            "z_dim": z, "latents_mean": vec![0.0; z], "latents_std": vec![1.0; z]});
        VaeConfig::from_json(&v).unwrap()
    }

    #[test]
    fn released_plan_at_1024_fits_the_largest_map() {
        let plan =
            BufferPlan::new(&config(144, 64), 64, 64, GpuVaeBudget::default(), None).unwrap();
        // Largest map: the 1024 x 1024 x 288 output of up block 3's upsample conv.
        assert_eq!(plan.pool_elems, 1024 * 1024 * 288);
        assert_eq!(plan.out_pixels, 1024 * 1024);
        assert_eq!((plan.out_cp, plan.out_channels), (8, 4));
        assert_eq!((plan.tokens, plan.attention_cp), (4096, 1152));
        assert_eq!(plan.cols_elems, (512 << 20) / 2);
        // All 4096 query rows' scores fit 256 MiB in one chunk.
        assert_eq!(plan.score_rows, 4096);
        // The widest row of columns: 1024 pixels x 9 taps x 288 channels.
        assert_eq!(
            plan.band_rows(1024, 1024, 288),
            (512 << 20) / 2 / (1024 * 9 * 288)
        );
        let gib = plan.bytes() as f64 / f64::from(1u32 << 30);
        assert!(gib > 2.0 && gib < 3.5, "{gib} GiB");
    }

    #[test]
    fn implicit_convs_need_columns_only_where_no_tile_covers_the_map() {
        let cfg = config(144, 64);
        let budget = GpuVaeBudget::default();
        // 1024x1024: every map is 64 wide (two rows a 256-pixel tile) or at least 128 (row reuse): no columns.
        for path in [
            ConvPath::Implicit,
            ConvPath::ImplicitTall,
            ConvPath::Implicit128,
        ] {
            let plan = BufferPlan::new(&cfg, 64, 64, budget, Some(path)).unwrap();
            assert_eq!(plan.cols_elems, 0, "{path:?}");
            assert_eq!(plan.implicit, Some(path));
        }
        let im2col = BufferPlan::new(&cfg, 64, 64, budget, Some(ConvPath::Im2col)).unwrap();
        assert_eq!(im2col.cols_elems, (512 << 20) / 2);
        // A 41 x 41 latent: the 41- and 82-pixel-wide maps fit no tile and go through columns (their widest row: 82
        // pixels x 9 taps x 1152 channels); the maps from 164 pixels on run on the row-reuse tile.
        let odd = BufferPlan::new(&cfg, 41, 41, budget, Some(ConvPath::Implicit)).unwrap();
        let all = BufferPlan::new(&cfg, 41, 41, budget, None).unwrap();
        assert_eq!(odd.band_rows(82, 82, 1152), 82);
        assert_eq!(odd.cols_elems, 82 * 82 * 9 * 1152);
        assert!(odd.cols_elems < all.cols_elems);
        // The decoder's choice and the plan's agree, by one function: the widths the plan sends to columns are
        // exactly those no tile takes.
        for (w, n, taken) in [
            (41, 1152, false),
            (82, 1152, false),
            (164, 1152, true),
            (64, 1152, true),
        ] {
            let shape = Conv3x3Shape {
                h: w,
                w,
                cin: 1152,
                n,
            };
            assert_eq!(
                implicit_tile(Some(ConvPath::Implicit), shape).is_some(),
                taken,
                "{w}"
            );
        }
        assert_eq!(
            implicit_tile(
                Some(ConvPath::Implicit),
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 144
                }
            ),
            Some(ConvTile::Rows144)
        );
        assert_eq!(
            implicit_tile(
                Some(ConvPath::ImplicitTall),
                Conv3x3Shape {
                    h: 4,
                    w: 64,
                    cin: 144,
                    n: 144
                }
            ),
            Some(ConvTile::Tall144)
        );
        assert_eq!(
            implicit_tile(
                Some(ConvPath::Implicit128),
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 256
                }
            ),
            Some(ConvTile::Cols256)
        );
        assert_eq!(
            implicit_tile(
                None,
                Conv3x3Shape {
                    h: 4,
                    w: 300,
                    cin: 144,
                    n: 144
                }
            ),
            None
        );
    }

    #[test]
    fn tiny_plan_covers_padded_channels() {
        // The fixture's widths 16, 16, 16, 8, 4, 2 pad to 16, 16, 16, 8, 8, 8; z 4 to 8.
        let plan = BufferPlan::new(&config(2, 4), 4, 6, GpuVaeBudget::default(), None).unwrap();
        assert_eq!(plan.out_pixels, 64 * 96);
        // Largest map: the 64 x 96 output at 8 (padded) channels, larger than 16 x 24 at 16.
        assert_eq!(plan.pool_elems, 64 * 96 * 8);
        // A small budget still holds one full row of the widest conv.
        let tight = BufferPlan::new(
            &config(2, 4),
            4,
            6,
            GpuVaeBudget {
                cols_bytes: 1,
                scores_bytes: 1,
            },
            None,
        )
        .unwrap();
        assert_eq!(tight.score_rows, 1);
        assert!(tight.cols_elems >= 96 * 9 * 8);
        assert_eq!(tight.band_rows(64, 96, 8), 1);
        assert!(BufferPlan::new(&config(2, 4), 0, 6, GpuVaeBudget::default(), None).is_err());
    }

    #[test]
    fn conv_path_names() {
        assert_eq!(ConvPath::parse(None).unwrap(), ConvPath::Implicit);
        for path in [
            ConvPath::Implicit,
            ConvPath::ImplicitTall,
            ConvPath::Implicit128,
            ConvPath::Im2col,
        ] {
            assert_eq!(ConvPath::parse(Some(path.name())).unwrap(), path);
        }
        let err = ConvPath::parse(Some("direct")).unwrap_err().to_string();
        assert!(
            err.contains("TF_VAE_CONV") && err.contains("im2col"),
            "{err}"
        );
    }

    #[test]
    fn gemm_matrix_is_tap_major_and_zero_padded() {
        // 2 out x 3 in x 9 taps: element (o, ci, t) = 100 o + 10 ci + t.
        let w: Vec<f32> = (0..2 * 3 * 9)
            .map(|i| (100 * (i / 27) + 10 * (i / 9 % 3) + i % 9) as f32)
            .collect();
        let m = gemm_matrix(&w, 0, 2, 3, 9);
        assert_eq!(m.len(), 8 * 9 * 8);
        let k = 9 * 8;
        assert_eq!(m[k + 4 * 8 + 2], 124.0); // o = 1, tap 4, ci 2
        assert_eq!(m[3], 0.0); // padding input channel
        assert!(m[2 * k..].iter().all(|&v| v == 0.0)); // padding output rows
                                                       // Rows 1.. of a fused [3, 1, 1, 1] weight: part 1 of 3 with one output.
        let fused = [5.0, 6.0, 7.0];
        assert_eq!(gemm_matrix(&fused, 1, 1, 1, 1)[0], 6.0);
    }

    #[test]
    fn fixture_weights_pack_into_the_decoder_layout() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen_vae/model");
        let model = ModelDir::open(&dir).unwrap();
        let config = VaeConfig::from_json(model.config_json()).unwrap();
        let mut loader = Loader {
            model: &model,
            packer: Packer::new(),
        };
        let net = loader.net(&config).unwrap();
        // Five up blocks of three resnets; DupUp on the first four, temporal factor 2 except the last one.
        assert_eq!(net.blocks.len(), 5);
        assert!(net.blocks.iter().all(|b| b.resnets.len() == 3));
        let factors: Vec<Option<usize>> = net
            .blocks
            .iter()
            .map(|b| b.upsample.map(|(_, _, _, ft)| ft))
            .collect();
        assert_eq!(factors, vec![Some(2), Some(2), Some(2), Some(1), None]);
        // Width changes (16 -> 8 -> 4 -> 2) get 1x1 shortcuts, nothing else does.
        let shortcuts: Vec<bool> = net
            .blocks
            .iter()
            .map(|b| b.resnets[0].shortcut.is_some())
            .collect();
        assert_eq!(shortcuts, vec![false, false, true, true, true]);
        assert_eq!((net.conv_out.out_cp, net.conv_out.k()), (8, 9 * 8));
        assert_eq!(
            (
                net.attention.q.in_cp,
                net.attention.q.out_cp,
                net.attention.q.taps
            ),
            (16, 16, 1)
        );
        // The q, k and v parts are distinct rows of to_qkv: packed apart and all different.
        let image = loader.packer.host_image();
        let bytes = &image;
        let part = |c: &ConvW| bytes[c.weight..c.weight + 16 * 16 * BF16].to_vec();
        assert_ne!(part(&net.attention.q), part(&net.attention.k));
        assert_ne!(part(&net.attention.k), part(&net.attention.v));
        // The first q row equals row 0 of the stored to_qkv weight, rounded to bf16.
        let stored = model
            .to_f32("decoder.mid_block.attentions.0.to_qkv.weight")
            .unwrap();
        let first = half::bf16::from_le_bytes([
            bytes[net.attention.q.weight],
            bytes[net.attention.q.weight + 1],
        ]);
        assert_eq!(
            first.to_f32(),
            half::bf16::from_f32(stored.data()[0]).to_f32()
        );
        // A missing tensor is a weights error naming it.
        let err = Loader {
            model: &model,
            packer: Packer::new(),
        }
        .conv("decoder.no_such_conv", 2, 2, 3)
        .unwrap_err()
        .to_string();
        assert!(err.contains("decoder.no_such_conv"), "{err}");
    }

    proptest! {
        /// Bands tile the output rows exactly and each band's columns fit the column buffer.
        #[test]
        fn bands_fit_the_column_buffer(h in 1usize..9, w in 1usize..9, budget in 1usize..1 << 22, cp8 in 1usize..40) {
            let plan = BufferPlan::new(&config(8, 16), h, w, GpuVaeBudget { cols_bytes: budget, scores_bytes: budget }, None)
                .unwrap();
            let f = 16;
            let (oh, ow, cp) = (h * f, w * f, (cp8 * 8).min(64));
            let rows = plan.band_rows(oh, ow, cp);
            prop_assert!(rows >= 1 && rows <= oh);
            prop_assert!(rows * ow * 9 * cp <= plan.cols_elems.max(ow * 9 * cp));
            prop_assert!(plan.score_rows >= 1 && plan.score_rows <= plan.tokens);
        }
    }
}
