//! The DiT's device weights: the fused layout (`q|k|v`, `gate|up`, modulation with the output norm), the padding
//! of heads narrower than the kernels' 128, and the upload through the pinned ring into one allocation.
//!
//! Block GEMM groups that run in FP8 ([`DitPrecision`]) are stored as e4m3 codes, quantized per output channel on
//! the ring itself ([`RowQuantizer`]: the staging slot receives the codes, no second host copy), with their f32
//! scales (one per output row, in the fused order) uploaded beside them once the ring is done.
//!
//! A checkpoint that already stores weights in FP8 with their scales ([`Fp8Checkpoint`]) feeds those codes to
//! the FP8 groups as they are (a per-tensor scale repeated per row; no re-quantization), and is dequantized to
//! bf16 on the ring wherever the precision keeps a weight in bf16 (`--precision bf16`, the bf16 end blocks, the
//! groups left out, the embedders).

use tf_cuda::{Context, DeviceBuffer, Stream};

use super::{cuda_err, gpu_err};
use crate::nn::fp8::{RowCodes, RowQuantizer};
use crate::nn::fp8_checkpoint::{Fp8Checkpoint, WeightFeed};
use crate::nn::gpu::HEAD_DIM;
use crate::nn::precision::DitPrecision;
use crate::nn::upload::{upload_pieces, Piece, StagingConfig, UploadStats};
use crate::nn::weights::{le_bytes, Dtype, LayoutPlanner, ModelDir, BF16};
use crate::qwen_image::config::{QwenImageDitConfig, TIMESTEP_DIM};
use crate::qwen_image::dit::DitError;

fn backend(what: &str) -> impl FnOnce(String) -> DitError + '_ {
    move |why| DitError::Backend(format!("{what}: {why}"))
}

/// Device offsets (bytes) of one block's fused weights.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockOffsets {
    pub(super) qkv: usize,
    pub(super) to_out: usize,
    pub(super) norm_q: usize,
    pub(super) norm_k: usize,
    pub(super) gate_up: usize,
    pub(super) mlp_out: usize,
    /// Where the f32 per-output-channel scales of each group stored in FP8 lie (`None`: the group is bf16).
    pub(super) scales: GroupScales,
}

/// Device offsets (bytes) of the FP8 scales of a block's GEMM groups; `None` for a group stored in bf16.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GroupScales {
    pub(super) qkv: Option<usize>,
    pub(super) to_out: Option<usize>,
    pub(super) gate_up: Option<usize>,
    pub(super) mlp_out: Option<usize>,
}

/// Device offsets (bytes) of every weight group.
#[derive(Debug, Clone)]
pub(super) struct WeightOffsets {
    pub(super) img_in: usize,
    pub(super) txt_norm: usize,
    pub(super) txt_in: usize,
    pub(super) txt_out: usize,
    pub(super) time1: usize,
    pub(super) time2: usize,
    /// `[5D, D]`: modulation.1 then norm_out.linear.
    pub(super) mod_out: usize,
    pub(super) proj_out: usize,
    pub(super) blocks: Vec<BlockOffsets>,
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
pub(super) struct Dims {
    pub(super) d: usize,
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    /// Padded attention width: heads * 128.
    pub(super) width: usize,
    pub(super) ffn: usize,
    pub(super) in_ch: usize,
    pub(super) ctx: usize,
    pub(super) out_ch: usize,
    pub(super) layers: usize,
    pub(super) eps: f32,
}

impl Dims {
    pub(super) fn of(cfg: &QwenImageDitConfig) -> Result<Dims, DitError> {
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

    pub(super) fn padded(&self) -> bool {
        self.head_dim != HEAD_DIM
    }

    /// Scale of the q/k rows that makes the 128-wide RMSNorm see the true mean square.
    pub(super) fn qk_scale(&self) -> f32 {
        (HEAD_DIM as f32 / self.head_dim as f32).sqrt()
    }
}

/// The weights on the device: one allocation holding every fused group, where each group lies, and what the
/// upload measured.
pub(super) struct DeviceWeights {
    pub(super) buffer: DeviceBuffer,
    pub(super) offsets: WeightOffsets,
    pub(super) upload: UploadStats,
    /// Bytes of the allocation.
    pub(super) bytes: usize,
    /// Weights the checkpoint stores in FP8, and how many of them went to the device as stored (the rest were
    /// dequantized to bf16).
    pub(super) checkpoint_fp8: usize,
    pub(super) checkpoint_fp8_as_stored: usize,
}

/// A reshaped tensor built in host memory.
enum Staged {
    /// f32 little-endian values.
    Values(Vec<u8>),
    /// A checkpoint's e4m3 codes and their per-row scales.
    Codes(Vec<u8>, Vec<f32>),
}

/// An FP8 source tensor: `[rows, cols]`, its scales at `scale_at` (bytes) in the allocation.
#[derive(Debug, Clone, Copy)]
struct Fp8Target {
    rows: usize,
    cols: usize,
    scale_at: usize,
    /// e4m3, or INT8 for our INT8 GEMM (`gemm=int8`).
    codes: RowCodes,
}

/// Plans the fused layout of `model` and uploads it into one fresh allocation of `ctx`, on `stream`: bf16, and
/// e4m3 codes with f32 scales for the block GEMM groups `precision` runs in FP8. `checkpoint` names the weights
/// the folder already stores in FP8 (empty for an ordinary checkpoint).
pub(super) fn upload(
    ctx: &Context,
    stream: &Stream,
    model: &ModelDir,
    checkpoint: &Fp8Checkpoint,
    dims: &Dims,
    staging: StagingConfig,
    precision: &DitPrecision,
) -> Result<DeviceWeights, DitError> {
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
    for layer in 0..dims.layers {
        let fp8 = precision.groups_of(layer, dims.layers);
        // Bytes per weight element of a group, and its scales (one f32 per output row) when in FP8.
        let elem = |on: bool| if on { 1 } else { BF16 };
        let mut scales_of = |on: bool, rows: usize| -> Result<Option<usize>, DitError> {
            Ok(if on {
                Some(layout.one(rows * 4)?)
            } else {
                None
            })
        };
        let scales = GroupScales {
            qkv: scales_of(fp8.qkv, 3 * w)?,
            to_out: scales_of(fp8.out, d)?,
            gate_up: scales_of(fp8.mlp_in(), 2 * f)?,
            mlp_out: scales_of(fp8.mlp_out, d)?,
        };
        let e = elem(fp8.qkv);
        let qkv = layout.group(&[w * d * e, w * d * e, w * d * e])?;
        let to_out = layout.one(d * w * elem(fp8.out))?;
        let norm_q = layout.one(HEAD_DIM * BF16)?;
        let norm_k = layout.one(HEAD_DIM * BF16)?;
        let e = elem(fp8.mlp_in());
        let gate_up = layout.group(&[f * d * e, f * d * e])?;
        let mlp_out = layout.one(d * f * elem(fp8.mlp_out))?;
        blocks.push(BlockOffsets {
            qkv: qkv[0],
            to_out,
            norm_q,
            norm_k,
            gate_up: gate_up[0],
            mlp_out,
            scales,
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

    // Source tensor -> (device offset, transform, FP8 target when quantized).
    type Placement = (String, usize, Transform, Option<Fp8Target>);
    let plain =
        |name: &str, offset: usize| -> Placement { (name.into(), offset, Transform::Plain, None) };
    let mut placements: Vec<Placement> = vec![
        plain("img_in.weight", img_in),
        plain("txt_in.text_norm.weight", txt_norm),
        plain("txt_in.in_layer.weight", txt_in),
        plain("txt_in.out_layer.weight", txt_out),
        plain("time_text_embed.timestep_embedder.linear_1.weight", time1),
        plain("time_text_embed.timestep_embedder.linear_2.weight", time2),
        plain("modulation.1.weight", mod_out[0]),
        plain("norm_out.linear.weight", mod_out[1]),
        plain("proj_out.weight", proj_out),
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
        // An 8-bit tensor of `rows` output rows of `cols`, its scales `first_row` rows into the group's scales.
        let codes = precision.groups_of(i, dims.layers).gemm_codes;
        let fp8_at = |scales: Option<usize>, rows: usize, cols: usize, first_row: usize| {
            scales.map(|at| Fp8Target {
                rows,
                cols,
                scale_at: at + first_row * 4,
                codes,
            })
        };
        let p = format!("transformer_blocks.{i}.");
        let sc = b.scales;
        placements.push((
            format!("{p}attn.to_q.weight"),
            qkv[0],
            rows_t(s),
            fp8_at(sc.qkv, w, d, 0),
        ));
        placements.push((
            format!("{p}attn.to_k.weight"),
            qkv[1],
            rows_t(s),
            fp8_at(sc.qkv, w, d, w),
        ));
        placements.push((
            format!("{p}attn.to_v.weight"),
            qkv[2],
            rows_t(1.0),
            fp8_at(sc.qkv, w, d, 2 * w),
        ));
        let cols_t = if padded {
            Transform::PadCols { rows: d }
        } else {
            Transform::Plain
        };
        placements.push((
            format!("{p}attn.to_out.0.weight"),
            b.to_out,
            cols_t,
            fp8_at(sc.to_out, d, w, 0),
        ));
        placements.push((
            format!("{p}attn.norm_q.weight"),
            b.norm_q,
            vec_t(1.0 / s),
            None,
        ));
        placements.push((
            format!("{p}attn.norm_k.weight"),
            b.norm_k,
            vec_t(1.0 / s),
            None,
        ));
        placements.push((
            format!("{p}img_mlp.gate_layer.weight"),
            gate_up[0],
            Transform::Plain,
            fp8_at(sc.gate_up, f, d, 0),
        ));
        placements.push((
            format!("{p}img_mlp.proj.weight"),
            gate_up[1],
            Transform::Plain,
            fp8_at(sc.gate_up, f, d, f),
        ));
        placements.push((
            format!("{p}img_mlp.out.weight"),
            b.mlp_out,
            Transform::Plain,
            fp8_at(sc.mlp_out, d, f, 0),
        ));
    }

    // Reshaped tensors are built in host memory first (small models only); the rest stream from the map. A
    // checkpoint's FP8 weight bound for an FP8 group is padded as codes (its scales carried along); any other
    // reshaped tensor goes through f32 (an FP8 one dequantized).
    let mut owned: Vec<Option<Staged>> = Vec::with_capacity(placements.len());
    for (name, _, transform, target) in &placements {
        if let Some(t) = target {
            checkpoint.check_codes(name, t.codes)?;
        }
        owned.push(if matches!(transform, Transform::Plain) {
            None
        } else if let (Some(w), Some(_)) = (checkpoint.get(name), target) {
            let codes = checkpoint.codes(model, name)?;
            let (codes, scales) =
                reshape_fp8(codes, &w.scales, *transform, dims).map_err(backend(name))?;
            Some(Staged::Codes(codes, scales))
        } else {
            let values = checkpoint.to_f32(model, name)?.into_data();
            Some(Staged::Values(
                reshape(&values, *transform, dims).map_err(backend(name))?,
            ))
        });
    }
    let mut feeds: Vec<WeightFeed<'_>> = Vec::with_capacity(placements.len());
    let mut checkpoint_fp8 = 0;
    let mut checkpoint_fp8_as_stored = 0;
    for ((name, _, _, target), owned) in placements.iter().zip(&owned) {
        checkpoint_fp8 += usize::from(checkpoint.get(name).is_some());
        let feed = match (owned, target) {
            (Some(Staged::Codes(codes, scales)), _) => WeightFeed::Codes {
                src: codes,
                scales: scales.clone(),
            },
            (Some(Staged::Values(f32_bytes)), Some(t)) => WeightFeed::Quantize {
                src: f32_bytes,
                quantizer: RowQuantizer::with_codes(Dtype::F32, t.rows, t.cols, t.codes)
                    .map_err(gpu_err(name))?,
            },
            (Some(Staged::Values(f32_bytes)), None) => WeightFeed::Bf16 {
                src: f32_bytes,
                dtype: Dtype::F32,
            },
            (None, target) => WeightFeed::of_codes(
                model,
                checkpoint,
                name,
                target.map(|t| (t.rows, t.cols)),
                target.map_or(RowCodes::E4m3, |t| t.codes),
            )?,
        };
        if let (WeightFeed::Codes { src, scales }, Some(t)) = (&feed, target) {
            checkpoint_fp8_as_stored += 1;
            if scales.len() != t.rows || Some(src.len()) != t.rows.checked_mul(t.cols) {
                return Err(DitError::Backend(format!(
                    "{name}: the checkpoint's FP8 weight gives {} codes and {} scales, the device layout wants \
                     [{}, {}]",
                    src.len(),
                    scales.len(),
                    t.rows,
                    t.cols
                )));
            }
        }
        feeds.push(feed);
    }
    let pieces: Vec<Piece<'_>> = placements
        .iter()
        .zip(&feeds)
        .map(|((_, offset, _, _), feed)| feed.piece(*offset))
        .collect();
    let mut weights =
        DeviceBuffer::alloc(ctx, total).map_err(cuda_err("allocating the weights"))?;
    if padded {
        // Padding must read as zeros.
        weights
            .fill_u8(0, Some(stream))
            .map_err(cuda_err("clearing the weights"))?;
    }
    let mut upload = upload_pieces(ctx, stream, &mut weights, &pieces, staging)
        .map_err(gpu_err("uploading the DiT weights"))?;
    // The FP8 tensors' scales, now that every row went through its quantizer.
    let mut scale_images: Vec<(usize, Vec<u8>)> = Vec::new();
    for ((name, _, _, target), feed) in placements.iter().zip(&feeds) {
        if let Some(t) = target {
            let scales = feed.scales().ok_or_else(|| {
                DitError::Backend(format!("{name}: an FP8 group's weight was planned as bf16"))
            })?;
            if scales.len() != t.rows || scales.iter().any(|v| !v.is_finite() || *v <= 0.0) {
                return Err(DitError::Backend(format!(
                    "{name}: the FP8 quantizer did not produce a finite scale for every one of its {} rows \
                     (non-finite weights in the checkpoint?)",
                    t.rows
                )));
            }
            scale_images.push((t.scale_at, le_bytes(&scales, f32::to_le_bytes)));
        }
    }
    if !scale_images.is_empty() {
        let scale_pieces: Vec<Piece<'_>> = scale_images
            .iter()
            .map(|(at, bytes)| Piece::copy(bytes, *at))
            .collect();
        let scales_upload = upload_pieces(ctx, stream, &mut weights, &scale_pieces, staging)
            .map_err(gpu_err("uploading the DiT's FP8 weight scales"))?;
        upload.device_bytes += scales_upload.device_bytes;
        upload.seconds += scales_upload.seconds;
    }
    Ok(DeviceWeights {
        buffer: weights,
        offsets,
        upload,
        bytes: total,
        checkpoint_fp8,
        checkpoint_fp8_as_stored,
    })
}

/// Pads a checkpoint's FP8 weight (e4m3 `codes`, one scale per row) into its 128-wide device image, as
/// [`reshape`] does for values: padded rows and columns are zero codes (padded rows get scale 1), and a row
/// factor multiplies the row's scale rather than the codes, so no code changes.
fn reshape_fp8(
    codes: &[u8],
    scales: &[f32],
    transform: Transform,
    dims: &Dims,
) -> Result<(Vec<u8>, Vec<f32>), String> {
    let (heads, hd) = (dims.heads, dims.head_dim);
    match transform {
        Transform::Plain => Ok((codes.to_vec(), scales.to_vec())),
        Transform::PadRows { cols, scale } => {
            if codes.len() != heads * hd * cols || scales.len() != heads * hd {
                return Err(format!(
                    "{} codes and {} scales, expected {heads} x {hd} rows of {cols}",
                    codes.len(),
                    scales.len()
                ));
            }
            let mut out = vec![0u8; heads * HEAD_DIM * cols];
            let mut out_scales = vec![1f32; heads * HEAD_DIM];
            for h in 0..heads {
                for i in 0..hd {
                    let (src_row, dst_row) = (h * hd + i, h * HEAD_DIM + i);
                    out[dst_row * cols..(dst_row + 1) * cols]
                        .copy_from_slice(&codes[src_row * cols..(src_row + 1) * cols]);
                    out_scales[dst_row] = scales[src_row] * scale;
                }
            }
            Ok((out, out_scales))
        }
        Transform::PadCols { rows } => {
            if codes.len() != rows * heads * hd || scales.len() != rows {
                return Err(format!(
                    "{} codes and {} scales, expected {rows} rows of {heads} x {hd}",
                    codes.len(),
                    scales.len()
                ));
            }
            let mut out = vec![0u8; rows * heads * HEAD_DIM];
            for r in 0..rows {
                for h in 0..heads {
                    let src = &codes[r * heads * hd + h * hd..r * heads * hd + (h + 1) * hd];
                    let at = r * heads * HEAD_DIM + h * HEAD_DIM;
                    out[at..at + hd].copy_from_slice(src);
                }
            }
            Ok((out, scales.to_vec()))
        }
        Transform::PadVec { .. } => Err("a 1-D tensor cannot be an FP8 weight".into()),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn fp8_groups_upload_as_per_channel_codes_with_their_scales() {
        use crate::nn::fp8;
        use crate::nn::gpu::test_support::context;
        use crate::nn::precision::{Fp8Accumulation, Fp8Groups, Fp8Layers};
        let _serial = tf_testdriver::test_lock();
        let ctx = context();
        let stream = Stream::new(&ctx, false).unwrap();
        let model = ModelDir::open(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/qwen_dit/t2i/model"),
        )
        .unwrap();
        let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
        let dims = Dims::of(&config).unwrap();
        assert!(
            dims.padded(),
            "the fixture has 16-wide heads, padded to 128"
        );
        // Small slots: the quantizer sees rows split over many chunks and threads.
        let staging = StagingConfig {
            slot_bytes: 8192,
            slots: 2,
            threads: 3,
        };
        let groups = Fp8Groups {
            out: false,
            ..Fp8Groups::ALL
        };
        let precision = DitPrecision::Fp8(Fp8Layers {
            groups,
            bf16_ends: 0,
            accumulation: Fp8Accumulation::Exact,
            attention: crate::nn::precision::AttentionPrecision::Bf16,
        });
        let fp8_up = upload(
            &ctx,
            &stream,
            &model,
            &Fp8Checkpoint::default(),
            &dims,
            staging,
            &precision,
        )
        .unwrap();
        let bf16_up = upload(
            &ctx,
            &stream,
            &model,
            &Fp8Checkpoint::default(),
            &dims,
            staging,
            &DitPrecision::Bf16,
        )
        .unwrap();
        assert!(fp8_up.bytes < bf16_up.bytes);
        let image: Vec<u8> = fp8_up.buffer.to_vec().unwrap();
        let bf16_image: Vec<u8> = bf16_up.buffer.to_vec().unwrap();
        let (d, w, f) = (dims.d, dims.width, dims.ffn);
        let s = dims.qk_scale();
        let f32s = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        // The device image of a tensor before quantization, as bf16 values (what the ring converts first).
        let device_values = |name: &str, transform: Transform| -> Vec<f32> {
            let values = model.to_f32(name).unwrap().into_data();
            f32s(&reshape(&values, transform, &dims).unwrap())
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_f32())
                .collect()
        };
        for (layer, (b8, b16)) in fp8_up
            .offsets
            .blocks
            .iter()
            .zip(&bf16_up.offsets.blocks)
            .enumerate()
        {
            let p = format!("transformer_blocks.{layer}.");
            // q|k|v in FP8: each projection's rows quantized, the scales in fused order.
            let mut want_codes = Vec::new();
            let mut want_scales = Vec::new();
            for (name, scale) in [("to_q", s), ("to_k", s), ("to_v", 1.0)] {
                let v = device_values(
                    &format!("{p}attn.{name}.weight"),
                    Transform::PadRows { cols: d, scale },
                );
                // Quantized from the checkpoint's f32 values (the fixture stores f32), not from bf16.
                let raw = model.to_f32(&format!("{p}attn.{name}.weight")).unwrap();
                let exact = f32s(
                    &reshape(raw.data(), Transform::PadRows { cols: d, scale }, &dims).unwrap(),
                );
                assert_eq!(v.len(), exact.len());
                let (codes, scales) = fp8::quantize_rows(&exact, d);
                want_codes.extend(codes);
                want_scales.extend(scales);
            }
            assert_eq!(
                &image[b8.qkv..b8.qkv + 3 * w * d],
                &want_codes[..],
                "layer {layer} qkv codes"
            );
            let at = b8.scales.qkv.unwrap();
            assert_eq!(
                f32s(&image[at..at + 3 * w * 4]),
                want_scales,
                "layer {layer} qkv scales"
            );
            // The output projection stayed bf16: the same bytes as the bf16 upload.
            assert_eq!(b8.scales.to_out, None);
            assert_eq!(
                &image[b8.to_out..b8.to_out + d * w * BF16],
                &bf16_image[b16.to_out..b16.to_out + d * w * BF16]
            );
            // gate|up and the down projection in FP8.
            for (offset, scales, names, rows, cols) in [
                (
                    b8.gate_up,
                    b8.scales.gate_up,
                    vec!["gate_layer", "proj"],
                    f,
                    d,
                ),
                (b8.mlp_out, b8.scales.mlp_out, vec!["out"], d, f),
            ] {
                let mut codes_all = Vec::new();
                let mut scales_all = Vec::new();
                for n in names {
                    let raw = model.to_f32(&format!("{p}img_mlp.{n}.weight")).unwrap();
                    let (codes, scales) = fp8::quantize_rows(raw.data(), cols);
                    codes_all.extend(codes);
                    scales_all.extend(scales);
                }
                let at = scales.unwrap();
                let n_rows = codes_all.len() / cols;
                assert_eq!(n_rows % rows, 0);
                assert_eq!(&image[offset..offset + codes_all.len()], &codes_all[..]);
                assert_eq!(f32s(&image[at..at + n_rows * 4]), scales_all);
            }
            // The norms are untouched.
            assert_eq!(
                &image[b8.norm_q..b8.norm_q + HEAD_DIM * BF16],
                &bf16_image[b16.norm_q..b16.norm_q + HEAD_DIM * BF16]
            );
        }
    }

    #[test]
    fn checkpoint_fp8_codes_upload_as_stored_and_dequantize_where_bf16() {
        use crate::nn::fp8::e4m3_decode;
        use crate::nn::gpu::test_support::context;
        use crate::nn::precision::{Fp8Accumulation, Fp8Groups, Fp8Layers};
        use crate::qwen_image::dit::check_folder;
        let _serial = tf_testdriver::test_lock();
        let ctx = context();
        let stream = Stream::new(&ctx, false).unwrap();
        let staging = StagingConfig {
            slot_bytes: 4096,
            slots: 2,
            threads: 3,
        };
        let bf16_of = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
        let bf16_image =
            |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|&v| bf16_of(v)).collect() };
        for variant in ["per_tensor", "per_channel"] {
            let model = ModelDir::open(
                &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../tests/fixtures/qwen_fp8")
                    .join(variant),
            )
            .unwrap();
            let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
            let ck = check_folder(&model, &config).unwrap();
            assert_eq!(ck.weights().len(), 16);
            let dims = Dims::of(&config).unwrap();
            let (d, w, f, hd) = (dims.d, dims.width, dims.ffn, dims.head_dim);
            // q|k|v and the MLP from the file's codes; the output projection (and img_in, txt_in) in bf16.
            let precision = DitPrecision::Fp8(Fp8Layers {
                groups: Fp8Groups {
                    out: false,
                    ..Fp8Groups::ALL
                },
                bf16_ends: 0,
                accumulation: Fp8Accumulation::Exact,
                attention: crate::nn::precision::AttentionPrecision::Bf16,
            });
            let up = upload(&ctx, &stream, &model, &ck, &dims, staging, &precision).unwrap();
            assert_eq!((up.checkpoint_fp8, up.checkpoint_fp8_as_stored), (16, 12));
            let image: Vec<u8> = up.buffer.to_vec().unwrap();
            let f32s = |bytes: &[u8]| -> Vec<f32> {
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            let s = dims.qk_scale();
            for (layer, b) in up.offsets.blocks.iter().enumerate() {
                let p = format!("transformer_blocks.{layer}.");
                let scales = f32s(&image[b.scales.qkv.unwrap()..][..3 * w * 4]);
                for (k, (name, factor)) in [("to_q", s), ("to_k", s), ("to_v", 1.0)]
                    .into_iter()
                    .enumerate()
                {
                    let name = format!("{p}attn.{name}.weight");
                    let fw = ck.get(&name).unwrap();
                    let codes = model.bytes(&name).unwrap();
                    for head in 0..dims.heads {
                        for i in 0..HEAD_DIM {
                            let row = k * w + head * HEAD_DIM + i;
                            let got = &image[b.qkv + row * d..][..d];
                            if i < hd {
                                let src = head * hd + i;
                                assert_eq!(
                                    got,
                                    &codes[src * d..(src + 1) * d],
                                    "{variant} {name} row {row}"
                                );
                                assert_eq!(
                                    scales[row],
                                    fw.scales[src] * factor,
                                    "{variant} {name} scale {row}"
                                );
                            } else {
                                assert!(
                                    got.iter().all(|&c| c == 0),
                                    "{variant} {name}: padding row {row}"
                                );
                                assert_eq!(scales[row], 1.0);
                            }
                        }
                    }
                }
                // gate|up: the two files' codes and scales back to back.
                let gate = format!("{p}img_mlp.gate_layer.weight");
                let proj = format!("{p}img_mlp.proj.weight");
                let mut codes = model.bytes(&gate).unwrap().to_vec();
                codes.extend_from_slice(model.bytes(&proj).unwrap());
                assert_eq!(&image[b.gate_up..][..2 * f * d], &codes[..]);
                let mut want = ck.get(&gate).unwrap().scales.clone();
                want.extend_from_slice(&ck.get(&proj).unwrap().scales);
                assert_eq!(f32s(&image[b.scales.gate_up.unwrap()..][..2 * f * 4]), want);
                // The output projection in bf16: dequantized, its head columns padded to 128.
                assert_eq!(b.scales.to_out, None);
                let out = ck
                    .to_f32(&model, &format!("{p}attn.to_out.0.weight"))
                    .unwrap();
                let padded =
                    f32s(&reshape(out.data(), Transform::PadCols { rows: d }, &dims).unwrap());
                assert_eq!(&image[b.to_out..][..d * w * BF16], &bf16_image(&padded)[..]);
            }
            // img_in, never FP8 on the device: dequantized on the ring, code times its row's scale, as bf16.
            let fw = ck.get("img_in.weight").unwrap();
            let codes = model.bytes("img_in.weight").unwrap();
            let want: Vec<f32> = codes
                .iter()
                .enumerate()
                .map(|(i, &c)| e4m3_decode(c) * fw.scales[i / fw.cols])
                .collect();
            assert_eq!(
                &image[up.offsets.img_in..][..d * dims.in_ch * BF16],
                &bf16_image(&want)[..]
            );
            // In bf16 everything is dequantized.
            let bf16 = upload(
                &ctx,
                &stream,
                &model,
                &ck,
                &dims,
                staging,
                &DitPrecision::Bf16,
            )
            .unwrap();
            assert_eq!(
                (bf16.checkpoint_fp8, bf16.checkpoint_fp8_as_stored),
                (16, 0)
            );
            let image16: Vec<u8> = bf16.buffer.to_vec().unwrap();
            assert_eq!(
                &image16[bf16.offsets.img_in..][..d * dims.in_ch * BF16],
                &bf16_image(&want)[..]
            );
        }
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
