//! Per-(joint layout, mode) workspaces of the DiT step: the joint sequence's runs of text and image rows, the
//! device buffers a step uses, its mask and RoPE tables, and the key compaction for padding in several ranges.

use tf_cuda::{Context, DeviceBuffer};

use super::kv::{CacheBinding, GpuKvCache};
use super::{cuda_err, Engine, StepRows, MAX_GRAPHS};
use crate::nn::backend_error::gpu_error;
use crate::nn::gpu::attention_8bit::Attention8bitKernels;
use crate::nn::gpu::graph_cache::GraphCache;
use crate::nn::gpu::spare_buffers::{with_headroom, SpareBuffers};
use crate::nn::gpu::{key_limits_from_blocks, key_pad_from_valid, AttentionShape, HEAD_DIM};
use crate::nn::host;
use crate::nn::weights::{le_bytes, BF16};
use crate::qwen_image::config::{ROPE_THETA, TIMESTEP_DIM};
use crate::qwen_image::dit::{DitError, DitInputs, JointLayout, KvMode, TokenSource};

/// One run of consecutive joint tokens from consecutive source rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) text: bool,
    /// First source row (text row `m` or image token `n`) of the run.
    pub(super) src: usize,
    /// First joint position of the run.
    pub(super) pos: usize,
    pub(super) len: usize,
}

/// Runs of the joint sequence from `first_row` on.
pub(super) fn runs(layout: &JointLayout, first_row: usize) -> Vec<Run> {
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
pub(super) struct Workspace {
    pub(super) mode: KvMode,
    pub(super) layout: JointLayout,
    /// Rows per sample this step computes (S, or the target rows when cached).
    pub(super) rows: usize,
    pub(super) first_row: usize,
    pub(super) n_t: usize,
    pub(super) n_img: usize,
    pub(super) l_vlm: usize,
    pub(super) runs: Vec<Run>,
    pub(super) timesteps: DeviceBuffer,
    pub(super) sinusoid: DeviceBuffer,
    pub(super) temb1: DeviceBuffer,
    pub(super) temb2: DeviceBuffer,
    pub(super) modulation: DeviceBuffer,
    pub(super) hidden_in: DeviceBuffer,
    pub(super) text_in: DeviceBuffer,
    pub(super) text_normed: DeviceBuffer,
    pub(super) text_hidden: DeviceBuffer,
    pub(super) x: DeviceBuffer,
    pub(super) normed: DeviceBuffer,
    pub(super) qkv: DeviceBuffer,
    pub(super) q: DeviceBuffer,
    pub(super) k: DeviceBuffer,
    pub(super) v: DeviceBuffer,
    pub(super) attn: DeviceBuffer,
    pub(super) proj: DeviceBuffer,
    pub(super) gate_up: DeviceBuffer,
    pub(super) act: DeviceBuffer,
    /// FP8 GEMM inputs (e4m3 rows up to the widest GEMM input, and one f32 scale per row), when some block runs
    /// in FP8. One pair serves every FP8 GEMM of the step: each producer writes it after the previous consumer
    /// ran (stream order).
    pub(super) fp8: Option<Fp8Rows>,
    /// The 8-bit attention's quantized operands, when some block runs its attention in 8 bits.
    pub(super) attn8: Option<DeviceBuffer>,
    pub(super) out: DeviceBuffer,
    pub(super) rope_cos: DeviceBuffer,
    pub(super) rope_sin: DeviceBuffer,
    pub(super) key_limits: DeviceBuffer,
    pub(super) key_pad: Option<DeviceBuffer>,
    /// Padding in several ranges: the gather plan and the compacted K and V.
    pub(super) compact: Option<(CompactKeys, DeviceBuffer, DeviceBuffer)>,
    /// Extract mode: the prefix K/V written by the step, copied into a fresh cache after it.
    pub(super) extract: Option<GpuKvCache>,
    /// True once an eager step ran (cuBLASLt plans are built; capture is safe).
    pub(super) warmed: bool,
    /// The step captured per KV cache binding used with this workspace (`None`: no cache).
    pub(super) graphs: GraphCache<Option<CacheBinding>>,
}

/// The FP8 input of a GEMM: e4m3 codes (rows of the GEMM's K bytes, dense) and per-row f32 scales.
pub(super) struct Fp8Rows {
    pub(super) codes: DeviceBuffer,
    pub(super) scales: DeviceBuffer,
}

/// Attention over the valid keys only, for padding in several ranges: invalid keys are never visible, so dropping
/// them and counting limits in valid keys keeps every query's visible set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CompactKeys {
    /// Per sample: `(source position, compacted position, length)` runs of valid keys.
    pub(super) runs: Vec<Vec<(usize, usize, usize)>>,
    /// Keys per sample after compaction (the most valid keys of any sample).
    pub(super) num_keys: usize,
    /// Key limits `[batch][queries]` in compacted positions.
    pub(super) limits: Vec<i32>,
    /// Per sample `[valid count, num_keys)`: the unused tail.
    pub(super) pads: Vec<i32>,
}

impl CompactKeys {
    pub(super) fn plan(key_valid: &[Vec<bool>], limits: &[i32]) -> Result<CompactKeys, DitError> {
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

/// A buffer of at least `bytes` for a part of a workspace that only kernels address (never read back whole or
/// copied whole): a spare when one fits, else a new one with headroom so a slightly longer prompt fits it later.
fn reuse_or_alloc(
    ctx: &Context,
    spares: &mut SpareBuffers<DeviceBuffer>,
    bytes: usize,
    what: &str,
) -> Result<DeviceBuffer, DitError> {
    if bytes == 0 {
        // An empty part stays empty (no allocation), as `alloc` makes it.
        return alloc(ctx, 0, what);
    }
    match spares.take(bytes) {
        Some(buffer) => Ok(buffer),
        None => alloc(ctx, with_headroom(bytes), what),
    }
}

/// The shape of a block's attention call: the step's query rows against every key (the compacted keys when
/// padding comes in several ranges), the cached prefix read in place in cached mode.
pub(super) fn attention_shape(
    layout: &JointLayout,
    mode: KvMode,
    rows: usize,
    compact_keys: Option<usize>,
    heads: usize,
) -> AttentionShape {
    AttentionShape {
        batch: layout.batch,
        num_queries: rows,
        num_keys: compact_keys.unwrap_or(layout.seq_len),
        prefix_len: if mode == KvMode::Cached {
            layout.prefix_len
        } else {
            0
        },
        num_heads: heads,
        num_kv_heads: heads,
    }
}

impl Workspace {
    /// The shape of this workspace's attention calls ([`attention_shape`]).
    pub(super) fn attention_shape(&self, heads: usize) -> AttentionShape {
        let compact_keys = self.compact.as_ref().map(|(plan, _, _)| plan.num_keys);
        attention_shape(&self.layout, self.mode, self.rows, compact_keys, heads)
    }

    /// The buffers a later workspace may reuse (every one [`reuse_or_alloc`] made), graphs dropped first: the
    /// exact-size ones (the output, the KV extract, the compacted keys) are freed.
    pub(super) fn into_buffers(self) -> Vec<DeviceBuffer> {
        drop(self.graphs);
        let mut out = vec![
            self.timesteps,
            self.sinusoid,
            self.temb1,
            self.temb2,
            self.modulation,
            self.hidden_in,
            self.text_in,
            self.text_normed,
            self.text_hidden,
            self.x,
            self.normed,
            self.qkv,
            self.q,
            self.k,
            self.v,
            self.attn,
            self.proj,
            self.gate_up,
            self.act,
            self.rope_cos,
            self.rope_sin,
            self.key_limits,
        ];
        out.extend(self.key_pad);
        if let Some(fp8) = self.fp8 {
            out.extend([fp8.codes, fp8.scales]);
        }
        out.extend(self.attn8);
        out.retain(|b| !b.is_empty());
        out
    }

    /// Device bytes this workspace holds.
    pub(super) fn buffer_bytes(&self) -> usize {
        let fixed = [
            &self.timesteps,
            &self.sinusoid,
            &self.temb1,
            &self.temb2,
            &self.modulation,
            &self.hidden_in,
            &self.text_in,
            &self.text_normed,
            &self.text_hidden,
            &self.x,
            &self.normed,
            &self.qkv,
            &self.q,
            &self.k,
            &self.v,
            &self.attn,
            &self.proj,
            &self.gate_up,
            &self.act,
            &self.out,
            &self.rope_cos,
            &self.rope_sin,
            &self.key_limits,
        ]
        .iter()
        .map(|b| b.len())
        .sum::<usize>();
        let optional = self.key_pad.as_ref().map_or(0, DeviceBuffer::len)
            + self
                .fp8
                .as_ref()
                .map_or(0, |f| f.codes.len() + f.scales.len())
            + self.attn8.as_ref().map_or(0, DeviceBuffer::len)
            + self
                .compact
                .as_ref()
                .map_or(0, |(_, k, v)| k.len() + v.len())
            + self.extract.as_ref().map_or(0, |e| e.buffer.len());
        fixed + optional
    }
}

impl Engine {
    /// Allocates the buffers of one (layout, mode) and uploads its layout-dependent tables.
    pub(super) fn workspace(
        &self,
        layout: JointLayout,
        mode: KvMode,
        inputs: &DitInputs,
        spares: &mut SpareBuffers<DeviceBuffer>,
    ) -> Result<Workspace, DitError> {
        let dims = &self.dims;
        let ctx = &self.ctx;
        let b = layout.batch;
        let cached = mode == KvMode::Cached;
        let StepRows {
            first_row,
            rows,
            total,
            n_t,
            n_img,
            text: l_vlm,
        } = StepRows::of(&self.config, &layout, inputs, mode);
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
        let mut rope_cos = reuse_or_alloc(ctx, spares, cos_t.len() * 4, "rope")?;
        rope_cos
            .upload(0, &le_bytes(&cos_t, f32::to_le_bytes))
            .map_err(cuda_err("uploading rope tables"))?;
        let mut rope_sin = reuse_or_alloc(ctx, spares, sin_t.len() * 4, "rope")?;
        rope_sin
            .upload(0, &le_bytes(&sin_t, f32::to_le_bytes))
            .map_err(cuda_err("uploading rope tables"))?;
        let mut key_limits = reuse_or_alloc(ctx, spares, limits.len() * 4, "mask")?;
        key_limits
            .upload(0, &le_bytes(&limits, i32::to_le_bytes))
            .map_err(cuda_err("uploading key limits"))?;
        let key_pad = if any_pad {
            let mut buf = reuse_or_alloc(ctx, spares, pads.len() * 4, "mask")?;
            buf.upload(0, &le_bytes(&pads, i32::to_le_bytes))
                .map_err(cuda_err("uploading key padding"))?;
            Some(buf)
        } else {
            None
        };
        let extract = if mode == KvMode::Extract {
            let bytes = dims.layers * 2 * b * layout.prefix_len * w * BF16;
            Some(GpuKvCache {
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
        let fp8 = if self.quant.is_some() {
            let widest = d.max(w).max(f);
            Some(Fp8Rows {
                codes: reuse_or_alloc(ctx, spares, (total * widest).max(16), "FP8 activation")?,
                scales: reuse_or_alloc(
                    ctx,
                    spares,
                    (total * 4).next_multiple_of(16).max(16),
                    "FP8 scale",
                )?,
            })
        } else {
            None
        };
        let attn8 = if self.attention8.is_some() {
            let compact_keys = compact.as_ref().map(|(plan, _, _)| plan.num_keys);
            let shape = attention_shape(&layout, mode, rows, compact_keys, dims.heads);
            let bytes = Attention8bitKernels::workspace_bytes(shape)
                .map_err(cuda_err("sizing the 8-bit attention workspace"))?;
            Some(reuse_or_alloc(ctx, spares, bytes, "8-bit attention")?)
        } else {
            None
        };
        Ok(Workspace {
            mode,
            rows,
            first_row,
            n_t,
            n_img,
            l_vlm,
            runs: runs(&layout, first_row),
            layout,
            timesteps: reuse_or_alloc(ctx, spares, n_t * 4, "timestep")?,
            sinusoid: reuse_or_alloc(ctx, spares, n_t * TIMESTEP_DIM * BF16, "timestep")?,
            temb1: reuse_or_alloc(ctx, spares, n_t * d * BF16, "timestep")?,
            temb2: reuse_or_alloc(ctx, spares, n_t * d * BF16, "timestep")?,
            modulation: reuse_or_alloc(ctx, spares, n_t * 5 * d * BF16, "modulation")?,
            hidden_in: reuse_or_alloc(ctx, spares, b * n_img * dims.in_ch * BF16, "input")?,
            text_in: reuse_or_alloc(ctx, spares, text_rows * dims.ctx * BF16, "input")?,
            text_normed: reuse_or_alloc(ctx, spares, text_rows * dims.ctx * BF16, "text")?,
            text_hidden: reuse_or_alloc(ctx, spares, text_rows * d * BF16, "text")?,
            x: reuse_or_alloc(ctx, spares, total * d * BF16, "activation")?,
            normed: reuse_or_alloc(ctx, spares, total * d * BF16, "activation")?,
            qkv: reuse_or_alloc(ctx, spares, total * 3 * w * BF16, "qkv")?,
            q: reuse_or_alloc(ctx, spares, total * w * BF16, "q")?,
            k: reuse_or_alloc(ctx, spares, total * w * BF16, "k")?,
            v: reuse_or_alloc(ctx, spares, total * w * BF16, "v")?,
            attn: reuse_or_alloc(ctx, spares, total * w * BF16, "attention")?,
            proj: reuse_or_alloc(ctx, spares, total * d * BF16, "activation")?,
            gate_up: reuse_or_alloc(ctx, spares, total * 2 * f * BF16, "mlp")?,
            act: reuse_or_alloc(ctx, spares, total * f * BF16, "mlp")?,
            fp8,
            attn8,
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qwen_image::dit::TokenSource;
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

    /// The attention shape both the 8-bit workspace and the step take: the cached prefix only in cached mode,
    /// compacted keys in place of the sequence when given.
    #[test]
    fn attention_shape_follows_the_mode_and_the_compaction() {
        let layout = layout_of(vec![Text(0), Text(1), Image(0), Image(1), Image(2)], 2);
        let full = attention_shape(&layout, KvMode::None, 5, None, 3);
        assert_eq!(
            (
                full.batch,
                full.num_queries,
                full.num_keys,
                full.prefix_len,
                full.num_heads
            ),
            (1, 5, 5, 0, 3)
        );
        assert_eq!(attention_shape(&layout, KvMode::Extract, 5, None, 3), full);
        let cached = attention_shape(&layout, KvMode::Cached, 3, None, 3);
        assert_eq!(
            (cached.num_queries, cached.num_keys, cached.prefix_len),
            (3, 5, 2)
        );
        let compacted = attention_shape(&layout, KvMode::None, 5, Some(4), 3);
        assert_eq!((compacted.num_keys, compacted.num_kv_heads), (4, 3));
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
}
