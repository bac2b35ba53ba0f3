//! The H3 DiT's device weights: the dimensions the kernels run at (every width padded to a multiple of 8, heads
//! zero-padded to 128 channels), the fused device layout (`q|k|v` as one `[3 * heads * 128, H]` weight, `fc1` as
//! `[value; gate]`, the f32 modules kept f32), the placement plan that maps every source tensor (diffusers or
//! original release names) onto it, and the upload through the one pinned ring (or a seeded fill for timing
//! runs without a checkpoint).
//!
//! A placement is a run of consecutive source elements written to consecutive device elements; the plan merges
//! runs, so an unpadded diffusers folder uploads one piece per tensor and the original release's per-head
//! interleaved `qkv_proj` one piece per head and part. Padding (tiny test models only) is zero: the allocation is
//! cleared before the pieces land.
//!
//! A checkpoint that stores weights in e4m3 with their scales ([`Fp8Checkpoint`]) feeds its codes as stored to the
//! FP8 matrices, each row with its file scale ([`code_row_scales`]); every other placement of such a weight is
//! dequantized (see [`upload`]).

use std::collections::HashMap;

use tf_cuda::{Context, DeviceBuffer, Stream};

use super::kernels::H3Kernels;
use super::{cuda_err, gpu_err};
use crate::minimax_h3::checkpoint::{self, QkvLayout};
use crate::minimax_h3::config::{MiniMaxH3Config, MODALITIES, MODULATION_CHUNKS};
use crate::minimax_h3::dit::H3Error;
use crate::nn::fp8::{RowCodes, RowQuantizer};
use crate::nn::fp8_checkpoint::{Fp8Checkpoint, Fp8CodeCheck, Fp8Dequantizer, Fp8Weight};
use crate::nn::gpu::quant::{plan_quantize_rows, Fp8Rows, QuantKernels};
use crate::nn::gpu::{plan_fill_uniform, Matrix, HEAD_DIM, MAX_NORM_COLS};
use crate::nn::precision::Fp8Groups;
use crate::nn::upload::{
    upload_pieces, ChunkTransform, Piece, StagingConfig, Transform, UploadError, UploadStats,
};
use crate::nn::weights::{Dtype, LayoutPlanner, ModelDir, BF16};

const F32: usize = 4;

/// `v` rounded up to a multiple of 8 (16-byte bf16 rows).
fn pad8(v: usize) -> usize {
    v.div_ceil(8) * 8
}

/// Column multiple of the hidden and feed-forward widths when some GEMM runs in FP8: cuBLASLt's FP8 GEMM needs
/// every dimension a multiple of 16 (16-byte e4m3 rows).
pub(super) const FP8_WIDTH_MULTIPLE: usize = 16;

/// The sizes the GPU forward runs at: the config's, with every width a multiple of 8 (`*_p`) and heads padded to
/// 128 channels. For the released model nothing is padded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Dims {
    pub hidden: usize,
    pub hp: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// heads x 128: the q, k, v and attention widths on the device.
    pub width: usize,
    pub ffn: usize,
    pub fp: usize,
    /// Video row channels (`in_channels * prod(patch)`) and audio channels (f32 layers: no padding).
    pub video: usize,
    pub audio: usize,
    pub text: usize,
    pub text_p: usize,
    pub freq: usize,
    pub time_hidden: usize,
    pub temb: usize,
    pub temb_p: usize,
    pub layers: usize,
    pub refiner_layers: usize,
    /// Rotated channels per head (`6 * rope_freq_dim`) and frequencies per axis.
    pub rotated: usize,
    pub rope_freq: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    pub qk_eps: f32,
    pub final_eps: f32,
    /// Whether some GEMM runs in FP8 (the workspace then holds the e4m3 activation rows).
    pub fp8: bool,
    /// Whether some main block runs its attention in 8 bits (the workspace then holds its quantized operands).
    pub attention8: bool,
    /// Whether some main block's adaLN projection is stored in 8 bits (a workspace over many timesteps then holds
    /// one block's projection dequantized to bf16, for a GEMM).
    pub adaln8: bool,
    /// Whether some main block runs its `fc1` gate half as an INT8 GEMM (the workspace then holds the INT8
    /// activation rows and the int32 products).
    pub gate_int8: bool,
}

impl Dims {
    /// The dimensions of a validated config, or why the GPU kernels cannot run it.
    #[cfg(test)]
    pub(super) fn of(config: &MiniMaxH3Config) -> Result<Dims, H3Error> {
        Dims::of_for(config, false)
    }

    /// [`Dims::of`] for a model that runs some GEMM in FP8 (`fp8`): the hidden, feed-forward and time-embedding
    /// widths are then padded to multiples of [`FP8_WIDTH_MULTIPLE`] (the released model's already are).
    pub(super) fn of_for(config: &MiniMaxH3Config, fp8: bool) -> Result<Dims, H3Error> {
        let pad = |v: usize| {
            if fp8 {
                v.div_ceil(FP8_WIDTH_MULTIPLE) * FP8_WIDTH_MULTIPLE
            } else {
                pad8(v)
            }
        };
        let unsupported = |why: String| {
            Err(H3Error::Backend(format!(
                "the GPU backend cannot run this config: {why}"
            )))
        };
        if config.attention_head_dim > HEAD_DIM {
            return unsupported(format!(
                "`attention_head_dim` {} > {HEAD_DIM} (the attention kernels take heads of at most {HEAD_DIM} channels)",
                config.attention_head_dim
            ));
        }
        let hp = pad(config.hidden_size);
        if hp > MAX_NORM_COLS {
            return unsupported(format!(
                "`hidden_size` {} exceeds the {MAX_NORM_COLS} columns the norm kernels hold per row",
                config.hidden_size
            ));
        }
        let width = config.num_attention_heads * HEAD_DIM;
        // The kernels take row widths and counts as 32-bit ints; the widest row is the fused fc1 output.
        let widest = [
            3 * width,
            2 * pad(config.ffn_dim),
            MODALITIES * MODULATION_CHUNKS * hp,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        if widest > i32::MAX as usize / 2 {
            return unsupported(format!("a row of {widest} elements is too wide"));
        }
        Ok(Dims {
            hidden: config.hidden_size,
            hp,
            heads: config.num_attention_heads,
            head_dim: config.attention_head_dim,
            width,
            ffn: config.ffn_dim,
            fp: pad(config.ffn_dim),
            video: config.video_patch_dim(),
            audio: config.audio_in_channels,
            text: config.text_dim,
            text_p: pad8(config.text_dim),
            freq: config.freq_dim,
            time_hidden: config.time_embed_hidden_dim,
            temb: config.time_embed_dim,
            temb_p: pad(config.time_embed_dim),
            layers: config.num_layers,
            refiner_layers: config.num_refiner_layers,
            rotated: config.rotary_dim(),
            rope_freq: config.rope_freq_dim,
            rope_theta: config.rope_theta as f32,
            norm_eps: config.norm_eps as f32,
            qk_eps: config.qk_norm_eps as f32,
            final_eps: config.final_norm_eps as f32,
            fp8,
            attention8: false,
            adaln8: false,
            gate_int8: false,
        })
    }

    /// Whether any width is padded (the allocation is then cleared before the upload).
    pub(super) fn padded(&self) -> bool {
        self.hp != self.hidden
            || self.fp != self.ffn
            || self.text_p != self.text
            || self.temb_p != self.temb
            || self.head_dim != HEAD_DIM
    }

    /// Columns of one adaLN table row: 6 chunks of the padded hidden width.
    pub(super) fn adaln_row(&self) -> usize {
        MODULATION_CHUNKS * self.hp
    }
}

/// Device offsets (bytes) of one attention block's weights (refiner and main blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AttnOffsets {
    pub norm1: usize,
    /// `[3 * width, hp]`: q, k, v.
    pub qkv: usize,
    pub norm_q: usize,
    pub norm_k: usize,
    /// `[hp, width]`.
    pub to_out: usize,
    pub norm2: usize,
    /// `[2 * fp, hp]`: value rows, then gate rows; only the value rows `[fp, hp]` when `fc1_gate` holds the gate
    /// rows apart (one half of `mlp_in` in FP8, the other in bf16: two GEMMs).
    pub fc1: usize,
    /// `[fp, hp]`: the gate rows, when they are a matrix of their own.
    pub fc1_gate: Option<usize>,
    /// `[hp, fp]`.
    pub fc2: usize,
    /// Where the f32 per-output-channel scales of the groups stored in FP8 lie (e4m3 codes at the offsets above).
    pub fp8: GroupScales,
}

/// Device offsets (bytes) of the f32 weight scales of a block's GEMM groups stored as e4m3 codes (one scale per
/// output row); `None`: the group is bf16.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct GroupScales {
    pub qkv: Option<usize>,
    pub to_out: Option<usize>,
    pub fc1: Option<usize>,
    /// The gate rows' scales when they are a matrix of their own in 8 bits (`AttnOffsets::fc1_gate`).
    pub fc1_gate: Option<usize>,
    /// The gate rows are INT8 codes (`mlp_gate=int8`: an INT8 GEMM), not e4m3.
    pub fc1_gate_int8: bool,
    pub fc2: Option<usize>,
    /// The format of the groups' codes above (`gemm=int8`: INT8 codes, run by our INT8 GEMM; the INT8 gate of an
    /// e4m3 block is `fc1_gate_int8`).
    pub codes: RowCodes,
}

/// One weight matrix stored as 8-bit codes `[rows, cols]` (rows of `cols` bytes) at `codes`, with one f32 scale per
/// row at `scales`: e4m3 (the FP8 GEMM groups, and `adaln`) or INT8 (`gemm=int8`, `mlp_gate=int8`, and `adaln=int8`,
/// read weight-only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CodedMatrix {
    pub codes: usize,
    pub scales: usize,
    pub rows: usize,
    pub cols: usize,
    pub format: RowCodes,
}

/// Device offsets (bytes) of one main block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BlockOffsets {
    pub attn: AttnOffsets,
    /// bf16 `[3 * 6 * hp, temb_p]` (or 8-bit codes, see `ada_scales`) and its bias `[3 * 6 * hp]`.
    pub ada_w: usize,
    pub ada_b: usize,
    /// The f32 per-output-row scales when `ada_w` is stored in 8 bits (the `adaln` group, weight-only).
    pub ada_scales: Option<usize>,
    /// The codes of `ada_w` when `ada_scales` is set: e4m3 (`adaln`) or INT8 (`adaln=int8`).
    pub ada_codes: RowCodes,
}

/// Device offsets (bytes) of every weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WeightOffsets {
    /// f32 `[hp, video]`, `[hp]`.
    pub proj_in_w: usize,
    pub proj_in_b: usize,
    /// f32 `[hp, audio]`, `[hp]`.
    pub audio_in_w: usize,
    pub audio_in_b: usize,
    /// bf16 `[hp, text_p]`, `[hp]`.
    pub ctx_w: usize,
    pub ctx_b: usize,
    /// f32 `[time_hidden, freq]`, `[time_hidden]`.
    pub time1_w: usize,
    pub time1_b: usize,
    /// f32 `[temb_p, time_hidden]`, `[temb_p]`.
    pub time2_w: usize,
    pub time2_b: usize,
    /// bf16 `[hp]`.
    pub refiner_norm: usize,
    pub norm_out: usize,
    /// bf16 `[2 * hp, temb_p]` (shift rows, then scale rows), `[2 * hp]`.
    pub norm_out_w: usize,
    pub norm_out_b: usize,
    /// f32 `[video, hp]`, `[video]`.
    pub proj_out_w: usize,
    pub proj_out_b: usize,
    /// f32 `[audio, hp]`, `[audio]`.
    pub audio_out_w: usize,
    pub audio_out_b: usize,
    pub refiner: Vec<AttnOffsets>,
    pub blocks: Vec<BlockOffsets>,
}

/// Element type of a weight on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Device {
    Bf16,
    F32,
    /// An 8-bit code (e4m3, or INT8 for a weight-only matrix) of [`WeightPlan::fp8`]'s matrix `matrix`.
    Coded {
        matrix: usize,
    },
}

impl Device {
    fn bytes(self) -> usize {
        match self {
            Device::Bf16 => BF16,
            Device::F32 => F32,
            Device::Coded { .. } => 1,
        }
    }
}

/// How a timing run without a checkpoint fills a weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Init {
    /// Uniform in `[-bound, bound)` (PyTorch's default for a linear layer of fan-in `1 / bound^2`).
    Uniform(f32),
    /// A norm weight: `1 +- 0.05`.
    Norm,
}

impl Init {
    /// `(offset, scale)` of the uniform fill.
    pub(super) fn range(self) -> (f32, f32) {
        match self {
            Init::Uniform(bound) => (0.0, bound),
            Init::Norm => (1.0, 0.05),
        }
    }

    fn fan_in(fan_in: usize) -> Init {
        Init::Uniform(1.0 / (fan_in.max(1) as f32).sqrt())
    }
}

/// One run of consecutive source elements written to consecutive device elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Placement {
    /// Index into [`WeightPlan::names`].
    pub tensor: usize,
    /// First source element.
    pub src_first: usize,
    /// Elements.
    pub len: usize,
    /// Device byte offset.
    pub dst: usize,
    pub device: Device,
    pub init: Init,
}

/// Which names the source tensors have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    /// diffusers names (also used for the seeded fill).
    Diffusers,
    /// The original release names, `qkv_proj` in the given row order.
    Original(QkvLayout),
}

/// The device layout and every placement onto it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct WeightPlan {
    pub offsets: WeightOffsets,
    /// Source tensor names (in the folder's naming).
    pub names: Vec<String>,
    pub placements: Vec<Placement>,
    /// Bytes of the allocation.
    pub total: usize,
    /// Whether any weight is padded (the allocation must be cleared first).
    pub padded: bool,
    /// The matrices stored in 8 bits: the FP8 GEMM groups the precision picks (e4m3) and its weight-only adaLN
    /// projections (e4m3 or INT8).
    pub fp8: Vec<CodedMatrix>,
}

/// Where each column run of a source row goes: `(source column, device column, length)`.
type Segments = Vec<(usize, usize, usize)>;

/// Builds the placements, merging runs that continue each other in the source and on the device.
struct Placer {
    source: Source,
    /// diffusers name -> original name (original sources only).
    original: HashMap<String, String>,
    names: Vec<String>,
    out: Vec<Placement>,
}

impl Placer {
    fn name_of(&self, diffusers: &str) -> Result<String, H3Error> {
        match self.source {
            Source::Diffusers => Ok(diffusers.to_string()),
            Source::Original(_) => self.original.get(diffusers).cloned().ok_or_else(|| {
                H3Error::Backend(format!(
                    "internal: no original-layout tensor stands for {diffusers:?}"
                ))
            }),
        }
    }

    fn push(&mut self, p: Placement) {
        if let Some(last) = self.out.last_mut() {
            if last.tensor == p.tensor
                && last.device == p.device
                && last.init == p.init
                && last.src_first + last.len == p.src_first
                && last.dst + last.len * p.device.bytes() == p.dst
            {
                last.len += p.len;
                return;
            }
        }
        self.out.push(p);
    }

    /// A `[rows, cols]` source tensor (by its source name): row `r`'s column runs `segments` go to device row
    /// `row_map(r)` of a `[.., dst_cols]` matrix at byte `base`. Every index stays inside the region the layout
    /// planner reserved (rows map below the region's rows, segments end within `dst_cols`), whose size it checked.
    #[allow(clippy::too_many_arguments)]
    fn matrix_named(
        &mut self,
        name: String,
        rows: usize,
        cols: usize,
        row_map: &dyn Fn(usize) -> usize,
        segments: &[(usize, usize, usize)],
        base: usize,
        dst_cols: usize,
        device: Device,
        init: Init,
    ) {
        self.matrix_rows(
            name,
            (rows, cols),
            std::slice::from_ref(&(0..rows)),
            &|r| (base, row_map(r), device),
            segments,
            dst_cols,
            init,
        );
    }

    /// [`Placer::matrix_named`] with each source row's destination chosen apart: `row_dst(r)` is the matrix's
    /// byte offset, the device row in it and the device element type. Each of `parts` (source row ranges, in
    /// order, covering every row) gets placements of its own, never merged with the part before it.
    #[allow(clippy::too_many_arguments)]
    fn matrix_rows(
        &mut self,
        name: String,
        (rows, cols): (usize, usize),
        parts: &[std::ops::Range<usize>],
        row_dst: &dyn Fn(usize) -> (usize, usize, Device),
        segments: &[(usize, usize, usize)],
        dst_cols: usize,
        init: Init,
    ) {
        let tensor = self.names.len();
        self.names.push(name);
        for part in parts {
            let first_placement = self.out.len();
            for r in part.clone().filter(|&r| r < rows) {
                let (base, dr, device) = row_dst(r);
                let es = device.bytes();
                for &(sc, dc, len) in segments {
                    let p = Placement {
                        tensor,
                        src_first: r * cols + sc,
                        len,
                        dst: base + (dr * dst_cols + dc) * es,
                        device,
                        init,
                    };
                    if self.out.len() == first_placement {
                        self.out.push(p);
                    } else {
                        self.push(p);
                    }
                }
            }
        }
    }

    /// [`Placer::matrix_named`] for a tensor given by its diffusers name.
    #[allow(clippy::too_many_arguments)]
    fn matrix(
        &mut self,
        diffusers: &str,
        rows: usize,
        cols: usize,
        row_map: &dyn Fn(usize) -> usize,
        segments: &[(usize, usize, usize)],
        base: usize,
        dst_cols: usize,
        device: Device,
        init: Init,
    ) -> Result<(), H3Error> {
        let name = self.name_of(diffusers)?;
        self.matrix_named(
            name, rows, cols, row_map, segments, base, dst_cols, device, init,
        );
        Ok(())
    }

    /// A `[n]` vector whose element `i` goes to device element `map(i)` at `base`.
    fn vector(
        &mut self,
        diffusers: &str,
        n: usize,
        map: &dyn Fn(usize) -> usize,
        base: usize,
        device: Device,
        init: Init,
    ) -> Result<(), H3Error> {
        self.matrix(diffusers, n, 1, map, &[(0, 0, 1)], base, 1, device, init)
    }
}

/// Column runs of a `[.., heads * head_dim]` source row in a `[.., heads * 128]` device row (one run when the
/// heads are not padded).
fn head_segments(heads: usize, head_dim: usize) -> Segments {
    if head_dim == HEAD_DIM {
        return vec![(0, 0, heads * HEAD_DIM)];
    }
    (0..heads)
        .map(|h| (h * head_dim, h * HEAD_DIM, head_dim))
        .collect()
}

/// The diffusers -> original name map of every tensor that maps one to one.
fn original_names(config: &MiniMaxH3Config) -> HashMap<String, String> {
    checkpoint::original_tensor_specs(config, false)
        .into_iter()
        .filter_map(|s| checkpoint::diffusers_name(&s.name).map(|d| (d, s.name)))
        .collect()
}

/// Plans the device layout of `config` and the placement of every source tensor onto it: main block `i`'s GEMM
/// groups `fp8_groups[i]` (none past the list's end) as e4m3 codes with per-output-row scales, the rest as today.
pub(super) fn plan(
    config: &MiniMaxH3Config,
    dims: &Dims,
    source: Source,
    fp8_groups: &[Fp8Groups],
) -> Result<WeightPlan, H3Error> {
    let d = dims;
    let (hp, w, fp) = (d.hp, d.width, d.fp);
    let mut l = LayoutPlanner::default();
    let proj_in_w = l.one(hp * d.video * F32)?;
    let proj_in_b = l.one(hp * F32)?;
    let audio_in_w = l.one(hp * d.audio * F32)?;
    let audio_in_b = l.one(hp * F32)?;
    let ctx_w = l.one(hp * d.text_p * BF16)?;
    let ctx_b = l.one(hp * BF16)?;
    let time1_w = l.one(d.time_hidden * d.freq * F32)?;
    let time1_b = l.one(d.time_hidden * F32)?;
    let time2_w = l.one(d.temb_p * d.time_hidden * F32)?;
    let time2_b = l.one(d.temb_p * F32)?;
    let refiner_norm = l.one(hp * BF16)?;
    let norm_out = l.one(hp * BF16)?;
    let norm_out_w = l.one(2 * hp * d.temb_p * BF16)?;
    let norm_out_b = l.one(2 * hp * BF16)?;
    let proj_out_w = l.one(d.video * hp * F32)?;
    let proj_out_b = l.one(d.video * F32)?;
    let audio_out_w = l.one(d.audio * hp * F32)?;
    let audio_out_b = l.one(d.audio * F32)?;
    let mut fp8 = Vec::new();
    // A `[rows, cols]` weight: bf16, or (`Some(format)`) 8-bit codes after their f32 row scales.
    let coded = |l: &mut LayoutPlanner,
                 fp8: &mut Vec<CodedMatrix>,
                 rows: usize,
                 cols: usize,
                 format: Option<RowCodes>|
     -> Result<(usize, Option<usize>), H3Error> {
        let Some(format) = format else {
            return Ok((l.one(rows * cols * BF16)?, None));
        };
        let scales = l.one(rows * F32)?;
        let codes = l.one(rows * cols)?;
        fp8.push(CodedMatrix {
            codes,
            scales,
            rows,
            cols,
            format,
        });
        Ok((codes, Some(scales)))
    };
    // A GEMM group's weight: 8-bit codes of the block's GEMM format when `on`.
    let matrix =
        |l: &mut LayoutPlanner,
         fp8: &mut Vec<CodedMatrix>,
         rows: usize,
         cols: usize,
         on: bool,
         codes: RowCodes| { coded(l, fp8, rows, cols, on.then_some(codes)) };
    let attn = |l: &mut LayoutPlanner,
                fp8: &mut Vec<CodedMatrix>,
                groups: Fp8Groups|
     -> Result<AttnOffsets, H3Error> {
        let norm1 = l.one(hp * BF16)?;
        let (qkv, qkv_scales) = matrix(l, fp8, 3 * w, hp, groups.qkv, groups.gemm_codes)?;
        let norm_q = l.one(HEAD_DIM * BF16)?;
        let norm_k = l.one(HEAD_DIM * BF16)?;
        let (to_out, to_out_scales) = matrix(l, fp8, hp, w, groups.out, groups.gemm_codes)?;
        let norm2 = l.one(hp * BF16)?;
        // One fc1 matrix, or (one half of `mlp_in` in FP8) the value rows and the gate rows apart.
        let (fc1, fc1_scales, fc1_gate, fc1_gate_scales) = if groups.mlp_in_split() {
            let (value, value_scales) =
                matrix(l, fp8, fp, hp, groups.mlp_value, groups.gemm_codes)?;
            let gate_codes = if groups.mlp_gate_int8 {
                Some(RowCodes::Int8)
            } else {
                groups.mlp_gate.then_some(groups.gemm_codes)
            };
            let (gate, gate_scales) = coded(l, fp8, fp, hp, gate_codes)?;
            (value, value_scales, Some(gate), gate_scales)
        } else {
            let (fc1, scales) = matrix(l, fp8, 2 * fp, hp, groups.mlp_in(), groups.gemm_codes)?;
            (fc1, scales, None, None)
        };
        let (fc2, fc2_scales) = matrix(l, fp8, hp, fp, groups.mlp_out, groups.gemm_codes)?;
        Ok(AttnOffsets {
            norm1,
            qkv,
            norm_q,
            norm_k,
            to_out,
            norm2,
            fc1,
            fc1_gate,
            fc2,
            fp8: GroupScales {
                qkv: qkv_scales,
                to_out: to_out_scales,
                fc1: fc1_scales,
                fc1_gate: fc1_gate_scales,
                fc1_gate_int8: groups.mlp_in_split() && groups.mlp_gate_int8,
                fc2: fc2_scales,
                codes: groups.gemm_codes,
            },
        })
    };
    let mut refiner = Vec::with_capacity(d.refiner_layers);
    for _ in 0..d.refiner_layers {
        refiner.push(attn(&mut l, &mut fp8, Fp8Groups::NONE)?);
    }
    let ada_rows = MODALITIES * MODULATION_CHUNKS * hp;
    let mut blocks = Vec::with_capacity(d.layers);
    for layer in 0..d.layers {
        let groups = fp8_groups.get(layer).copied().unwrap_or(Fp8Groups::NONE);
        let a = attn(&mut l, &mut fp8, groups)?;
        let (ada_w, ada_scales) = coded(&mut l, &mut fp8, ada_rows, d.temb_p, groups.adaln)?;
        let ada_b = l.one(ada_rows * BF16)?;
        blocks.push(BlockOffsets {
            attn: a,
            ada_w,
            ada_b,
            ada_scales,
            ada_codes: groups.adaln.unwrap_or_default(),
        });
    }
    let total = l.total()?;
    let fp8_matrices = fp8;
    // The device element of a weight: bf16, or the e4m3 codes of the FP8 matrix at `codes`.
    let device_of = |codes: usize, scales: Option<usize>| -> Result<Device, H3Error> {
        match scales {
            None => Ok(Device::Bf16),
            Some(_) => fp8_matrices
                .iter()
                .position(|m| m.codes == codes)
                .map(|matrix| Device::Coded { matrix })
                .ok_or_else(|| H3Error::Backend("internal: an FP8 weight has no matrix".into())),
        }
    };
    let offsets = WeightOffsets {
        proj_in_w,
        proj_in_b,
        audio_in_w,
        audio_in_b,
        ctx_w,
        ctx_b,
        time1_w,
        time1_b,
        time2_w,
        time2_b,
        refiner_norm,
        norm_out,
        norm_out_w,
        norm_out_b,
        proj_out_w,
        proj_out_b,
        audio_out_w,
        audio_out_b,
        refiner,
        blocks,
    };

    let mut p = Placer {
        source,
        original: match source {
            Source::Diffusers => HashMap::new(),
            Source::Original(_) => original_names(config),
        },
        names: Vec::new(),
        out: Vec::new(),
    };
    let (h, hd, f) = (d.hidden, d.head_dim, d.ffn);
    let id = |r: usize| r;
    // Chunked rows: chunk c of `h` rows lands at chunk c of `hp` rows.
    let chunked = |r: usize| (r / h) * hp + r % h;
    let o = &offsets;
    let (bf, fl) = (Device::Bf16, Device::F32);
    let norm = Init::Norm;
    p.matrix(
        "proj_in.weight",
        h,
        d.video,
        &id,
        &[(0, 0, d.video)],
        o.proj_in_w,
        d.video,
        fl,
        Init::fan_in(d.video),
    )?;
    p.vector(
        "proj_in.bias",
        h,
        &id,
        o.proj_in_b,
        fl,
        Init::fan_in(d.video),
    )?;
    p.matrix(
        "audio_proj_in.weight",
        h,
        d.audio,
        &id,
        &[(0, 0, d.audio)],
        o.audio_in_w,
        d.audio,
        fl,
        Init::fan_in(d.audio),
    )?;
    p.vector(
        "audio_proj_in.bias",
        h,
        &id,
        o.audio_in_b,
        fl,
        Init::fan_in(d.audio),
    )?;
    p.matrix(
        "context_embedder.weight",
        h,
        d.text,
        &id,
        &[(0, 0, d.text)],
        o.ctx_w,
        d.text_p,
        bf,
        Init::fan_in(d.text),
    )?;
    p.vector(
        "context_embedder.bias",
        h,
        &id,
        o.ctx_b,
        bf,
        Init::fan_in(d.text),
    )?;
    p.matrix(
        "time_embedder.linear_1.weight",
        d.time_hidden,
        d.freq,
        &id,
        &[(0, 0, d.freq)],
        o.time1_w,
        d.freq,
        fl,
        Init::fan_in(d.freq),
    )?;
    p.vector(
        "time_embedder.linear_1.bias",
        d.time_hidden,
        &id,
        o.time1_b,
        fl,
        Init::fan_in(d.freq),
    )?;
    p.matrix(
        "time_embedder.linear_2.weight",
        d.temb,
        d.time_hidden,
        &id,
        &[(0, 0, d.time_hidden)],
        o.time2_w,
        d.time_hidden,
        fl,
        Init::fan_in(d.time_hidden),
    )?;
    p.vector(
        "time_embedder.linear_2.bias",
        d.temb,
        &id,
        o.time2_b,
        fl,
        Init::fan_in(d.time_hidden),
    )?;
    p.vector(
        "token_refiner.final_norm.weight",
        h,
        &id,
        o.refiner_norm,
        bf,
        norm,
    )?;
    p.vector("norm_out.norm.weight", h, &id, o.norm_out, bf, norm)?;
    p.matrix(
        "norm_out.linear.weight",
        2 * h,
        d.temb,
        &chunked,
        &[(0, 0, d.temb)],
        o.norm_out_w,
        d.temb_p,
        bf,
        Init::fan_in(d.temb),
    )?;
    p.vector(
        "norm_out.linear.bias",
        2 * h,
        &chunked,
        o.norm_out_b,
        bf,
        Init::fan_in(d.temb),
    )?;
    p.matrix(
        "proj_out.weight",
        d.video,
        h,
        &id,
        &[(0, 0, h)],
        o.proj_out_w,
        hp,
        fl,
        Init::fan_in(h),
    )?;
    p.vector(
        "proj_out.bias",
        d.video,
        &id,
        o.proj_out_b,
        fl,
        Init::fan_in(h),
    )?;
    p.matrix(
        "audio_proj_out.weight",
        d.audio,
        h,
        &id,
        &[(0, 0, h)],
        o.audio_out_w,
        hp,
        fl,
        Init::fan_in(h),
    )?;
    p.vector(
        "audio_proj_out.bias",
        d.audio,
        &id,
        o.audio_out_b,
        fl,
        Init::fan_in(h),
    )?;

    let head_rows = |r: usize| (r / hd) * HEAD_DIM + r % hd;
    let inner = d.heads * hd;
    let out_segments = head_segments(d.heads, hd);
    let attn_block =
        |p: &mut Placer, prefix: &str, original: &str, a: &AttnOffsets| -> Result<(), H3Error> {
            p.vector(&format!("{prefix}norm1.weight"), h, &id, a.norm1, bf, norm)?;
            let qkv_device = device_of(a.qkv, a.fp8.qkv)?;
            match source {
                Source::Diffusers => {
                    for (part, name) in ["to_q", "to_k", "to_v"].iter().enumerate() {
                        p.matrix(
                            &format!("{prefix}attn.{name}.weight"),
                            inner,
                            h,
                            &head_rows,
                            &[(0, 0, h)],
                            a.qkv + part * w * hp * qkv_device.bytes(),
                            hp,
                            qkv_device,
                            Init::fan_in(h),
                        )?;
                    }
                }
                Source::Original(layout) => {
                    // Fused rows: (head, part, i) interleaved, or (part, head, i) stacked, to part * width + head * 128 + i.
                    let fused = move |r: usize| {
                        let (part, head) = match layout {
                            QkvLayout::Interleaved => ((r / hd) % 3, r / (3 * hd)),
                            QkvLayout::Stacked => (r / inner, (r % inner) / hd),
                        };
                        part * w + head * HEAD_DIM + r % hd
                    };
                    p.matrix_named(
                        format!("{original}attn.qkv_proj.weight"),
                        3 * inner,
                        h,
                        &fused,
                        &[(0, 0, h)],
                        a.qkv,
                        hp,
                        qkv_device,
                        Init::fan_in(h),
                    );
                }
            }
            p.vector(
                &format!("{prefix}attn.norm_q.weight"),
                hd,
                &id,
                a.norm_q,
                bf,
                norm,
            )?;
            p.vector(
                &format!("{prefix}attn.norm_k.weight"),
                hd,
                &id,
                a.norm_k,
                bf,
                norm,
            )?;
            p.matrix(
                &format!("{prefix}attn.to_out.0.weight"),
                h,
                inner,
                &id,
                &out_segments,
                a.to_out,
                w,
                device_of(a.to_out, a.fp8.to_out)?,
                Init::fan_in(inner),
            )?;
            p.vector(&format!("{prefix}norm2.weight"), h, &id, a.norm2, bf, norm)?;
            // diffusers stores [value; gate], the release [gate; value]; the device holds [value; gate], as one
            // matrix or as two (`fc1_gate`). Each half is placed on its own, so a seeded fill gives every half the
            // same values whichever precision it is stored in.
            let value_device = device_of(a.fc1, a.fp8.fc1)?;
            let gate_device = match a.fc1_gate {
                Some(gate) => (gate, 0, device_of(gate, a.fp8.fc1_gate)?),
                None => (a.fc1, fp, value_device),
            };
            let fc1_rows = move |r: usize| -> (usize, usize, Device) {
                let (value, device_row) = match source {
                    Source::Diffusers => (r < f, (r / f) * fp + r % f),
                    Source::Original(_) if r < f => (false, fp + r),
                    Source::Original(_) => (true, r - f),
                };
                if value {
                    (a.fc1, device_row, value_device)
                } else {
                    let (base, first, device) = gate_device;
                    (base, device_row - fp + first, device)
                }
            };
            let fc1_name = p.name_of(&format!("{prefix}ff.net.0.proj.weight"))?;
            p.matrix_rows(
                fc1_name,
                (2 * f, h),
                &[0..f, f..2 * f],
                &fc1_rows,
                &[(0, 0, h)],
                hp,
                Init::fan_in(h),
            );
            p.matrix(
                &format!("{prefix}ff.net.2.weight"),
                h,
                f,
                &id,
                &[(0, 0, f)],
                a.fc2,
                fp,
                device_of(a.fc2, a.fp8.fc2)?,
                Init::fan_in(f),
            )?;
            Ok(())
        };
    for (j, a) in o.refiner.iter().enumerate() {
        attn_block(
            &mut p,
            &format!("token_refiner.refiner_blocks.{j}."),
            &format!("token_refiner.blocks.{j}."),
            a,
        )?;
    }
    let ada_rows_src = MODALITIES * MODULATION_CHUNKS * h;
    for (i, b) in o.blocks.iter().enumerate() {
        let prefix = format!("transformer_blocks.{i}.");
        attn_block(&mut p, &prefix, &format!("blocks.{i}."), &b.attn)?;
        p.matrix(
            &format!("{prefix}adaln_proj.linear.weight"),
            ada_rows_src,
            d.temb,
            &chunked,
            &[(0, 0, d.temb)],
            b.ada_w,
            d.temb_p,
            device_of(b.ada_w, b.ada_scales)?,
            Init::fan_in(d.temb),
        )?;
        p.vector(
            &format!("{prefix}adaln_proj.linear.bias"),
            ada_rows_src,
            &chunked,
            b.ada_b,
            bf,
            Init::fan_in(d.temb),
        )?;
    }
    Ok(WeightPlan {
        offsets,
        names: p.names,
        placements: p.out,
        total,
        padded: dims.padded(),
        fp8: fp8_matrices,
    })
}

/// Source elements of `from` (BF16 or F16) widened to f32 on their way to the device.
struct ToF32 {
    from: Dtype,
}

impl ChunkTransform for ToF32 {
    fn name(&self) -> &'static str {
        "f32"
    }
    fn src_elem_bytes(&self) -> usize {
        self.from.size_bytes()
    }
    fn dst_elem_bytes(&self) -> usize {
        F32
    }
    fn apply(&self, _first: usize, src: &[u8], dst: &mut [u8]) -> Result<(), UploadError> {
        for (out, v) in dst.chunks_exact_mut(F32).zip(src.chunks_exact(2)) {
            let bits = u16::from_le_bytes([v[0], v[1]]);
            let x = match self.from {
                Dtype::F16 => half::f16::from_bits(bits).to_f32(),
                _ => half::bf16::from_bits(bits).to_f32(),
            };
            out.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    }
}

static BF16_TO_F32: ToF32 = ToF32 { from: Dtype::BF16 };
static F16_TO_F32: ToF32 = ToF32 { from: Dtype::F16 };

/// The weights on the device and what the upload measured.
pub(super) struct DeviceWeights {
    pub buffer: DeviceBuffer,
    pub upload: Option<UploadStats>,
    /// What became of the checkpoint's own FP8 weights (all zero for a float checkpoint or a seeded model).
    pub checkpoint_fp8: CheckpointFp8Use,
}

/// Allocates the plan's buffer, cleared when anything is padded.
fn allocate(ctx: &Context, stream: &Stream, plan: &WeightPlan) -> Result<DeviceBuffer, H3Error> {
    let mut buffer =
        DeviceBuffer::alloc(ctx, plan.total).map_err(cuda_err("allocating the weights"))?;
    if plan.padded {
        // Padding must read as zeros.
        buffer
            .fill_u8(0, Some(stream))
            .map_err(cuda_err("clearing the weights"))?;
    }
    Ok(buffer)
}

/// The source bytes of placement `pl` (checked against its tensor) and their dtype. `fp8` says the folder stores
/// the tensor as e4m3 codes with scales (one byte per element, read by the caller as codes).
fn source_of<'m>(
    model: &'m ModelDir,
    plan: &WeightPlan,
    pl: &Placement,
    fp8: bool,
) -> Result<(&'m [u8], Dtype, String), H3Error> {
    let name = plan
        .names
        .get(pl.tensor)
        .ok_or_else(|| H3Error::Backend("internal: a placement names no tensor".into()))?;
    let file = model.file_of(name)?;
    let info = file.info(name)?;
    let bytes = file.bytes(name)?;
    let es = info.dtype.size_bytes();
    let range = pl
        .src_first
        .checked_mul(es)
        .and_then(|start| Some(start..start.checked_add(pl.len.checked_mul(es)?)?));
    let src = range
        .and_then(|r| bytes.get(r))
        .ok_or_else(|| H3Error::Checkpoint {
            file: file.path().display().to_string(),
            tensor: name.clone(),
            why: format!(
                "elements {}..+{} lie outside the tensor's {} bytes (shape {:?})",
                pl.src_first,
                pl.len,
                bytes.len(),
                info.shape
            ),
        })?;
    let float = matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
    let readable = if fp8 {
        info.dtype == Dtype::F8E4M3
    } else {
        float || pl.device == Device::Bf16
    };
    if !readable {
        return Err(H3Error::Checkpoint {
            file: file.path().display().to_string(),
            tensor: name.clone(),
            why: format!(
                "stored as {}; the f32 modules and FP8 weights read F32, BF16 or F16, or e4m3 codes with their scales",
                info.dtype
            ),
        });
    }
    Ok((src, info.dtype, name.clone()))
}

/// The FP8 matrix of placement `pl`, if it is stored in FP8.
fn fp8_matrix<'p>(
    plan: &'p WeightPlan,
    pl: &Placement,
) -> Result<Option<&'p CodedMatrix>, H3Error> {
    match pl.device {
        Device::Coded { matrix } => plan
            .fp8
            .get(matrix)
            .map(Some)
            .ok_or_else(|| H3Error::Backend("internal: a placement names no FP8 matrix".into())),
        _ => Ok(None),
    }
}

/// How the ring writes one FP8 placement: whole device rows of its matrix (`first_row`, `rows` of them), when
/// the placement covers whole rows with nothing padded (every full-size checkpoint); `None` otherwise.
pub(super) fn whole_rows(m: &CodedMatrix, pl: &Placement) -> Option<(usize, usize)> {
    let at = pl.dst.checked_sub(m.codes)?;
    let cols = m.cols.max(1);
    let rows = pl.len / cols;
    let first_row = at / cols;
    let whole = at.is_multiple_of(cols)
        && pl.len.is_multiple_of(cols)
        && pl.src_first.is_multiple_of(cols)
        && rows > 0
        && first_row + rows <= m.rows;
    whole.then_some((first_row, rows))
}

/// The device rows of FP8 matrix `m` that placement `pl` of a checkpoint FP8 weight `w` writes, each with the scale
/// of the source row it comes from. A placement may cover several whole rows or a piece of one (a head's columns);
/// a source row's run must stay inside one device row.
pub(super) fn code_row_scales(
    w: &Fp8Weight,
    m: &CodedMatrix,
    pl: &Placement,
) -> Result<Vec<(usize, f32)>, String> {
    let (wc, mc) = (w.cols.max(1), m.cols.max(1));
    let at = pl
        .dst
        .checked_sub(m.codes)
        .ok_or("the placement lies before its matrix")?;
    let last = pl
        .src_first
        .checked_add(pl.len)
        .and_then(|e| e.checked_sub(1))
        .ok_or("an empty placement")?;
    let mut out = Vec::new();
    for r in pl.src_first / wc..=last / wc {
        let first_elem = (r * wc).max(pl.src_first) - pl.src_first;
        let last_elem = ((r + 1) * wc - 1).min(last) - pl.src_first;
        let row = (at + first_elem) / mc;
        if (at + last_elem) / mc != row || row >= m.rows {
            return Err(format!(
                "source row {r} does not land inside one of the {} device rows",
                m.rows
            ));
        }
        let scale = *w
            .scales
            .get(r)
            .ok_or_else(|| format!("source row {r} has no scale"))?;
        out.push((row, scale));
    }
    Ok(out)
}

/// How one placement's elements reach the device.
enum Feed<'a> {
    /// Float elements: the file's, or a checkpoint FP8 weight dequantized to f32 on the host.
    Float(&'a [u8], Dtype),
    /// A checkpoint's e4m3 codes as stored, bound for an FP8 matrix.
    Codes(&'a [u8]),
    /// A checkpoint's e4m3 codes dequantized to bf16 on the ring (whole source rows).
    Dequantize(&'a [u8], Fp8Dequantizer),
}

/// Whether every placement of FP8 matrix `index` reads a weight the checkpoint stores in FP8.
fn all_stored(plan: &WeightPlan, checkpoint: &Fp8Checkpoint, index: usize) -> bool {
    plan.placements
        .iter()
        .filter(|pl| pl.device == (Device::Coded { matrix: index }))
        .all(|pl| {
            plan.names
                .get(pl.tensor)
                .is_some_and(|n| checkpoint.get(n).is_some())
        })
}

/// Uploads every placement of `plan` from `model` (already checked against its tensor specs, FP8 weights found
/// by `checkpoint`) through the pinned ring: bf16 weights converted on the way, f32 modules kept (or widened to)
/// f32, and the FP8 matrices quantized per output row: on the ring itself (the staging slot receives the e4m3
/// codes, no second host copy; their scales are uploaded once the ring is done) when every placement is whole
/// rows, else (zero-padded tiny models) through a bf16 scratch matrix on the device that `quant` quantizes.
///
/// A weight the checkpoint stores in FP8 with its scales goes to an FP8 matrix as the file's codes, its row
/// scales beside them (no re-quantization; padding rows read code 0 with scale 1), whenever the ring can write the
/// matrix (every full-size checkpoint) or every weight of the matrix is stored in FP8 (tiny padded models). Every
/// other placement of it is dequantized: to bf16 on the ring when it is whole source rows, else through f32 on
/// the host (split rows of padded models, the f32 modules, a padded matrix that mixes stored and float weights,
/// which is then quantized on the device).
pub(super) fn upload(
    ctx: &Context,
    stream: &Stream,
    quant: Option<&QuantKernels>,
    model: &ModelDir,
    checkpoint: &Fp8Checkpoint,
    plan: &WeightPlan,
    staging: StagingConfig,
) -> Result<DeviceWeights, H3Error> {
    let on_ring = !plan.padded;
    // The matrices the ring writes (the rest are quantized on the device): every one of a full-size model, and a
    // matrix of a padded one whose every weight the file stores as codes.
    let stored_matrices: Vec<bool> = (0..plan.fp8.len())
        .map(|i| on_ring || all_stored(plan, checkpoint, i))
        .collect();
    // The file's codes are e4m3: an INT8 matrix never takes them (the engine keeps them out, `keep_stored_codes`).
    for pl in &plan.placements {
        let name = plan.names.get(pl.tensor).map_or("", String::as_str);
        if let (Some(m), Some(_)) = (fp8_matrix(plan, pl)?, checkpoint.get(name)) {
            if m.format != RowCodes::E4m3 {
                return Err(H3Error::Backend(format!(
                    "internal: {name}: the file's e4m3 codes planned into an INT8 matrix (keep_stored_codes \
                     keeps them out)"
                )));
            }
        }
    }
    // Checkpoint FP8 weights read through f32 on the host, by tensor index.
    let mut host_f32: HashMap<usize, Vec<u8>> = HashMap::new();
    for pl in &plan.placements {
        let name = plan.names.get(pl.tensor).map_or("", String::as_str);
        let Some(w) = checkpoint.get(name) else {
            continue;
        };
        let whole_source_rows =
            pl.src_first.is_multiple_of(w.cols.max(1)) && pl.len.is_multiple_of(w.cols.max(1));
        let needs_host = match pl.device {
            Device::F32 => true,
            Device::Bf16 => !whole_source_rows,
            Device::Coded { matrix } => !stored_matrices.get(matrix).copied().unwrap_or(false),
        };
        if needs_host && !host_f32.contains_key(&pl.tensor) {
            let values = checkpoint.to_f32(model, name)?;
            host_f32.insert(
                pl.tensor,
                values.data().iter().flat_map(|v| v.to_le_bytes()).collect(),
            );
        }
    }
    // What each placement reads, and which checkpoint FP8 tensors went entirely as codes.
    let mut feeds: Vec<Feed<'_>> = Vec::with_capacity(plan.placements.len());
    let mut as_codes: HashMap<usize, bool> = HashMap::new();
    for pl in &plan.placements {
        let name = plan.names.get(pl.tensor).map_or("", String::as_str);
        let feed = match (checkpoint.get(name), host_f32.get(&pl.tensor)) {
            (Some(_), Some(image)) => {
                let range = pl
                    .src_first
                    .checked_mul(F32)
                    .and_then(|start| Some(start..start.checked_add(pl.len.checked_mul(F32)?)?));
                let src = range.and_then(|r| image.get(r)).ok_or_else(|| {
                    H3Error::Backend(format!("internal: {name}: a placement past the tensor"))
                })?;
                Feed::Float(src, Dtype::F32)
            }
            (Some(w), None) => {
                let (src, _, _) = source_of(model, plan, pl, true)?;
                match pl.device {
                    Device::Coded { .. } => Feed::Codes(src),
                    _ => {
                        let cols = w.cols.max(1);
                        let dq = Fp8Dequantizer::for_rows(w, pl.src_first / cols, pl.len / cols)
                            .ok_or_else(|| {
                                H3Error::Backend(format!(
                                    "internal: {name}: a placement past the weight's rows"
                                ))
                            })?;
                        Feed::Dequantize(src, dq)
                    }
                }
            }
            (None, _) => {
                let (src, dtype, _) = source_of(model, plan, pl, false)?;
                Feed::Float(src, dtype)
            }
        };
        if checkpoint.get(name).is_some() {
            let codes = matches!(feed, Feed::Codes(_));
            *as_codes.entry(pl.tensor).or_insert(true) &= codes;
        }
        feeds.push(feed);
    }
    // One row quantizer per float FP8 placement the ring quantizes; it keeps the scales of the rows it is handed.
    let mut quantizers: Vec<Option<(RowQuantizer, usize)>> =
        Vec::with_capacity(plan.placements.len());
    for (pl, feed) in plan.placements.iter().zip(&feeds) {
        let quantizer = match (fp8_matrix(plan, pl)?, feed) {
            (Some(m), Feed::Float(_, dtype)) if on_ring => {
                let name = plan.names.get(pl.tensor).map_or("?", String::as_str);
                let (first_row, rows) = whole_rows(m, pl).ok_or_else(|| {
                    H3Error::Backend(format!(
                        "internal: {name}: an FP8 placement of {} elements at byte {} is not whole rows of {}",
                        pl.len, pl.dst, m.cols
                    ))
                })?;
                let q = RowQuantizer::with_codes(*dtype, rows, m.cols, m.format)
                    .map_err(gpu_err(name))?;
                Some((q, m.scales + first_row * F32))
            }
            _ => None,
        };
        quantizers.push(quantizer);
    }
    static CODE_CHECK: Fp8CodeCheck = Fp8CodeCheck;
    let mut pieces = Vec::with_capacity(plan.placements.len());
    for ((pl, feed), quantizer) in plan.placements.iter().zip(&feeds).zip(&quantizers) {
        let (src, transform) = match (pl.device, feed, quantizer) {
            (Device::Coded { .. }, Feed::Codes(src), _) => (*src, Transform::Custom(&CODE_CHECK)),
            (Device::Coded { .. }, Feed::Float(src, _), Some((q, _))) => {
                (*src, Transform::Custom(q))
            }
            // Quantized on the device below.
            (Device::Coded { .. }, _, _) => continue,
            (Device::Bf16, Feed::Dequantize(src, dq), _) => (*src, Transform::Custom(dq)),
            (Device::Bf16, Feed::Float(src, from), _) => (*src, Transform::ToBf16 { from: *from }),
            (Device::F32, Feed::Float(src, Dtype::F32), _) => (*src, Transform::Copy),
            (Device::F32, Feed::Float(src, Dtype::F16), _) => {
                (*src, Transform::Custom(&F16_TO_F32))
            }
            (Device::F32, Feed::Float(src, _), _) => (*src, Transform::Custom(&BF16_TO_F32)),
            (_, Feed::Codes(_) | Feed::Dequantize(..), _) => {
                return Err(H3Error::Backend(
                    "internal: checkpoint FP8 codes fed to a float placement".into(),
                ))
            }
        };
        pieces.push(Piece {
            src,
            transform,
            dst_offset: pl.dst,
        });
    }
    let mut buffer = allocate(ctx, stream, plan)?;
    let mut stats = upload_pieces(ctx, stream, &mut buffer, &pieces, staging)
        .map_err(gpu_err("uploading the H3 DiT weights"))?;
    // The FP8 scales, now that every row went through the ring: one image per matrix that holds checkpoint codes
    // (padding rows 1), else one per ring-quantized placement.
    let mut code_scales: HashMap<usize, Vec<f32>> = HashMap::new();
    for (pl, feed) in plan.placements.iter().zip(&feeds) {
        let (Device::Coded { matrix }, Feed::Codes(_)) = (pl.device, feed) else {
            continue;
        };
        let name = plan.names.get(pl.tensor).map_or("?", String::as_str);
        let (Some(m), Some(w)) = (plan.fp8.get(matrix), checkpoint.get(name)) else {
            return Err(H3Error::Backend(format!(
                "internal: {name}: FP8 codes without their matrix or scales"
            )));
        };
        let image = code_scales
            .entry(matrix)
            .or_insert_with(|| vec![1.0; m.rows]);
        for (row, scale) in code_row_scales(w, m, pl)
            .map_err(|why| H3Error::Backend(format!("internal: {name}: {why}")))?
        {
            image[row] = scale;
        }
    }
    let mut scale_images: Vec<(usize, Vec<u8>)> = Vec::new();
    for ((q, at), pl) in quantizers
        .iter()
        .zip(&plan.placements)
        .filter_map(|(q, pl)| q.as_ref().map(|q| (q, pl)))
    {
        let scales = q.scales();
        let name = plan.names.get(pl.tensor).map_or("?", String::as_str);
        if scales.iter().any(|v| !v.is_finite() || *v <= 0.0) {
            return Err(H3Error::Backend(format!(
                "{name}: the FP8 quantizer did not produce a finite scale for every row (non-finite weights in the \
                 checkpoint?)"
            )));
        }
        let matrix = match pl.device {
            Device::Coded { matrix } => matrix,
            _ => usize::MAX,
        };
        match (code_scales.get_mut(&matrix), plan.fp8.get(matrix)) {
            // A matrix mixing the file's codes and quantized float weights: one image for both.
            (Some(image), Some(m)) => {
                let first = (at - m.scales) / F32;
                image
                    .get_mut(first..first + scales.len())
                    .ok_or_else(|| {
                        H3Error::Backend(format!("internal: {name}: scales past the matrix"))
                    })?
                    .copy_from_slice(&scales);
            }
            _ => scale_images.push((*at, scales.iter().flat_map(|v| v.to_le_bytes()).collect())),
        }
    }
    for (matrix, image) in &code_scales {
        if let Some(m) = plan.fp8.get(*matrix) {
            scale_images.push((
                m.scales,
                image.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
        }
    }
    if !scale_images.is_empty() {
        let scale_pieces: Vec<Piece<'_>> = scale_images
            .iter()
            .map(|(at, bytes)| Piece::copy(bytes, *at))
            .collect();
        let more = upload_pieces(ctx, stream, &mut buffer, &scale_pieces, staging)
            .map_err(gpu_err("uploading the FP8 weight scales"))?;
        stats.device_bytes += more.device_bytes;
        stats.seconds += more.seconds;
    }
    let device_quantized: Vec<usize> = (0..plan.fp8.len())
        .filter(|&i| !stored_matrices.get(i).copied().unwrap_or(false))
        .collect();
    if !device_quantized.is_empty() {
        // Each such FP8 matrix as bf16 into a scratch matrix (zero padding included), then quantized on the device.
        let quant = quant.ok_or_else(|| {
            H3Error::Backend("internal: FP8 weights without the quantizing kernels".into())
        })?;
        let mut scratch = Scratch::new(ctx, plan)?;
        for index in device_quantized {
            let Some(m) = plan.fp8.get(index) else {
                continue;
            };
            let mut matrix_pieces = Vec::new();
            for (pl, feed) in plan.placements.iter().zip(&feeds) {
                if pl.device == (Device::Coded { matrix: index }) {
                    let at = pl.dst.checked_sub(m.codes).ok_or_else(|| {
                        H3Error::Backend("internal: an FP8 placement before its matrix".into())
                    })?;
                    let Feed::Float(src, dtype) = feed else {
                        return Err(H3Error::Backend(
                            "internal: checkpoint codes in a matrix quantized on the device".into(),
                        ));
                    };
                    matrix_pieces.push(Piece::bf16(src, *dtype, at * BF16));
                }
            }
            scratch.clear(stream)?;
            let more = upload_pieces(ctx, stream, &mut scratch.buffer, &matrix_pieces, staging)
                .map_err(gpu_err("uploading an FP8 weight for quantization"))?;
            stats.device_bytes += more.device_bytes;
            stats.seconds += more.seconds;
            scratch.quantize_into(&mut buffer, m, quant, stream)?;
        }
        stream
            .synchronize()
            .map_err(cuda_err("quantizing the FP8 weights"))?;
    }
    let stored = as_codes.len();
    let as_stored = as_codes.values().filter(|&&c| c).count();
    Ok(DeviceWeights {
        buffer,
        upload: Some(stats),
        checkpoint_fp8: CheckpointFp8Use {
            stored,
            as_stored,
            kept: KeptCodes::default(),
        },
    })
}

/// A bf16 matrix on the device as large as the largest FP8 matrix: where one weight is made (uploaded or
/// seeded) before it is quantized into its resident e4m3 codes, so bf16 copies of the whole model never exist;
/// and the row scales of one matrix, copied beside its codes.
struct Scratch {
    buffer: DeviceBuffer,
    scales: DeviceBuffer,
}

impl Scratch {
    fn new(ctx: &Context, plan: &WeightPlan) -> Result<Scratch, H3Error> {
        let elems = plan
            .fp8
            .iter()
            .map(|m| m.rows.saturating_mul(m.cols))
            .max()
            .unwrap_or(0);
        let bytes = elems
            .checked_mul(BF16)
            .ok_or_else(|| H3Error::Backend("an FP8 weight is too large".into()))?;
        let rows = plan.fp8.iter().map(|m| m.rows).max().unwrap_or(0);
        let scale_bytes = rows
            .checked_mul(F32)
            .ok_or_else(|| H3Error::Backend("an FP8 weight is too large".into()))?;
        Ok(Scratch {
            buffer: DeviceBuffer::alloc(ctx, bytes.max(16))
                .map_err(cuda_err("allocating the FP8 quantization scratch"))?,
            scales: DeviceBuffer::alloc(ctx, scale_bytes.max(16))
                .map_err(cuda_err("allocating the FP8 quantization scratch"))?,
        })
    }

    /// Zeros (the padding of the next matrix), on the stream.
    fn clear(&mut self, stream: &Stream) -> Result<(), H3Error> {
        self.buffer
            .fill_u8(0, Some(stream))
            .map_err(cuda_err("clearing the FP8 quantization scratch"))
    }

    /// Quantizes the scratch's first `m.rows x m.cols` bf16 values into `m`'s codes and scales in `weights`, one
    /// scale per row (nn_quantize_rows_fp8 writes the scales into the scratch, then they are copied), on the
    /// stream.
    fn quantize_into(
        &mut self,
        weights: &mut DeviceBuffer,
        m: &CodedMatrix,
        quant: &QuantKernels,
        stream: &Stream,
    ) -> Result<(), H3Error> {
        let code_bytes = m.rows * m.cols;
        let x = self
            .buffer
            .slice(0, code_bytes * BF16)
            .map_err(cuda_err("addressing the FP8 quantization scratch"))?;
        let scale_bytes = m.rows * F32;
        {
            let codes = weights
                .slice_mut(m.codes, code_bytes)
                .map_err(cuda_err("addressing an FP8 weight"))?;
            let scales = self
                .scales
                .slice_mut(0, scale_bytes)
                .map_err(cuda_err("addressing the FP8 quantization scratch"))?;
            let out = Fp8Rows {
                codes: &codes,
                stride: m.cols,
                scales: &scales,
            };
            quant
                .run(
                    stream,
                    plan_quantize_rows(&x, Matrix::dense(m.rows, m.cols), &out, m.format),
                )
                .map_err(cuda_err("quantizing an 8-bit weight"))?;
        }
        let scales = self
            .scales
            .slice(0, scale_bytes)
            .map_err(cuda_err("addressing the FP8 quantization scratch"))?;
        weights
            .slice_mut(m.scales, scale_bytes)
            .map_err(cuda_err("addressing an FP8 weight"))?
            .copy_from(0, scales, Some(stream))
            .map_err(cuda_err("quantizing an FP8 weight"))
    }
}

/// SplitMix64 of one counter value (the golden-gamma step, then the output function), as nn_fill_uniform mixes.
fn splitmix64(z: u64) -> u64 {
    crate::nn::sampling::noise::splitmix64(z.wrapping_add(0x9E37_79B9_7F4A_7C15))
}

/// The 32-bit seed of placement `index` under the run's `seed`.
fn placement_seed(seed: u64, index: usize) -> u32 {
    (splitmix64(seed ^ splitmix64(index as u64)) >> 32) as u32
}

/// `n` values `offset + scale * u`, `u` uniform in `[-1, 1)` from `(seed, i)` (the f32 twin of nn_fill_uniform).
fn host_uniform(n: usize, seed: u32, offset: f32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let bits = splitmix64((u64::from(seed) << 32).wrapping_add(i as u64));
            let u = (bits >> 40) as f32 * (1.0 / 8_388_608.0) - 1.0;
            offset + scale * u
        })
        .collect()
}

/// Fills every placement of `plan` from `seed` (bf16 weights on the device with nn_fill_uniform, the f32 modules
/// on the host through the ring): a timing model with a default-like init, no checkpoint. An FP8 matrix is made
/// the same way as bf16 in a scratch matrix (the same values its bf16 twin would hold) and quantized from there
/// into its resident codes, one matrix at a time.
pub(super) fn random(
    ctx: &Context,
    stream: &Stream,
    kernels: &H3Kernels,
    quant: Option<&QuantKernels>,
    plan: &WeightPlan,
    seed: u64,
) -> Result<DeviceWeights, H3Error> {
    let mut buffer = allocate(ctx, stream, plan)?;
    let mut host: Vec<(usize, Vec<u8>)> = Vec::new();
    for (i, pl) in plan.placements.iter().enumerate() {
        let (offset, scale) = pl.init.range();
        let s = placement_seed(seed, i);
        match pl.device {
            Device::Bf16 => {
                let view = buffer
                    .slice_mut(pl.dst, pl.len * BF16)
                    .map_err(cuda_err("addressing a weight"))?;
                kernels
                    .run(stream, plan_fill_uniform(&view, pl.len, s, offset, scale))
                    .map_err(cuda_err("filling a weight"))?;
            }
            Device::F32 => {
                let values = host_uniform(pl.len, s, offset, scale);
                host.push((
                    pl.dst,
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ));
            }
            Device::Coded { .. } => {}
        }
    }
    if !plan.fp8.is_empty() {
        let quant = quant.ok_or_else(|| {
            H3Error::Backend("internal: FP8 weights without the quantizing kernels".into())
        })?;
        let mut scratch = Scratch::new(ctx, plan)?;
        for (index, m) in plan.fp8.iter().enumerate() {
            if plan.padded {
                scratch.clear(stream)?;
            }
            for (i, pl) in plan.placements.iter().enumerate() {
                if pl.device != (Device::Coded { matrix: index }) {
                    continue;
                }
                let (offset, scale) = pl.init.range();
                let at = pl.dst.checked_sub(m.codes).ok_or_else(|| {
                    H3Error::Backend("internal: an FP8 placement before its matrix".into())
                })?;
                let view = scratch
                    .buffer
                    .slice_mut(at * BF16, pl.len * BF16)
                    .map_err(cuda_err("addressing the FP8 quantization scratch"))?;
                kernels
                    .run(
                        stream,
                        plan_fill_uniform(&view, pl.len, placement_seed(seed, i), offset, scale),
                    )
                    .map_err(cuda_err("filling a weight"))?;
            }
            scratch.quantize_into(&mut buffer, m, quant, stream)?;
        }
        // The scratch is freed on return: the work that reads it must be done.
        stream
            .synchronize()
            .map_err(cuda_err("quantizing the FP8 weights"))?;
    }
    let pieces: Vec<Piece<'_>> = host
        .iter()
        .map(|(dst, bytes)| Piece::copy(bytes, *dst))
        .collect();
    upload_pieces(ctx, stream, &mut buffer, &pieces, StagingConfig::default())
        .map_err(gpu_err("uploading the f32 modules"))?;
    Ok(DeviceWeights {
        buffer,
        upload: None,
        checkpoint_fp8: CheckpointFp8Use::default(),
    })
}

mod stored_codes;
pub(super) use stored_codes::keep_stored_codes;
pub use stored_codes::{CheckpointFp8Use, KeptCodes};

#[cfg(test)]
mod tests;
