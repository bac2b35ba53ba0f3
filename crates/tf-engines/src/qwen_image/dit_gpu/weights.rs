//! The DiT's device weights: the fused layout (`q|k|v`, `gate|up`, modulation with the output norm), the padding
//! of heads narrower than the kernels' 128, and the upload through the pinned ring into one allocation.

use tf_cuda::{Context, DeviceBuffer, Stream};

use super::{cuda_err, gpu_err};
use crate::nn::gpu::HEAD_DIM;
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
}

/// Plans the fused layout of `model` and uploads it (bf16) into one fresh allocation of `ctx`, on `stream`.
pub(super) fn upload(
    ctx: &Context,
    stream: &Stream,
    model: &ModelDir,
    dims: &Dims,
    staging: StagingConfig,
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
                reshape(&values, *transform, dims).map_err(backend(name))?,
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
            .fill_u8(0, Some(stream))
            .map_err(cuda_err("clearing the weights"))?;
    }
    let upload = upload_pieces(ctx, stream, &mut weights, &pieces, staging)
        .map_err(gpu_err("uploading the DiT weights"))?;
    Ok(DeviceWeights {
        buffer: weights,
        offsets,
        upload,
        bytes: total,
    })
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
