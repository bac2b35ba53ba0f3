//! Flash attention in 8 bits, an option beside the bf16 kernels ([`AttentionPrecision::Int8Fp8`]; bf16 stays the
//! default and nothing selects this on its own): kernel set `nn_attention_8bit` (`kernels/nn/attention_8bit.cu`),
//! sm_90a only.
//!
//! The scheme (SageAttention2's, on our warp-specialised wgmma kernel): Q in INT8 with one scale per query row
//! (the softmax scale and log2 e folded in); K smoothed (its per-(sample, kv head) mean over every key subtracted,
//! which shifts each query's scores by a constant the softmax ignores) and in INT8 with one scale per 128-key block;
//! S = Q K^T on INT8 wgmma with exact int32 sums, dequantized by the two scales; the online softmax in f32; P scaled
//! to e4m3's range (x 448) and V in e4m3 with one scale per channel (stored transposed, [head dim][keys], since
//! 8-bit wgmma reads both operands K-major) for P V on e4m3 wgmma with f32 accumulators; bf16 output.
//!
//! One call runs five kernels over a workspace the caller provides ([`Attention8bitLayout::for_shape`] sizes it):
//! K's per-block channel sums and V's per-block channel amax, their reduction to K's mean and V's scales, the K/V
//! quantization (written straight into the 128 x 128-byte swizzled tiles the attention kernel copies in whole), the
//! Q quantization, and the attention. Inputs, masks (per-query key limits, one padded key range per sample), the
//! cached prefix and GQA are those of [`super::attention`]; head dim 128.
//!
//! [`emulation`] repeats the quantization on the host, bit for bit (the tests compare the workspace with it), and
//! gives an attention over the dequantized operands.

use std::fmt;

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceViewMut, Stream};

use super::attention::{
    check_attention_call, push_kv_operands, AttentionInputs, AttentionShape, AttentionTile,
    Strides, HEAD_DIM,
};
use super::launch::{
    check_aligned_to, check_bytes, invalid, require_sm90, to_i32, to_i64, to_u32, Launch,
    LoadKernelsError, LoadedSet, Operand,
};
use super::NnKernels;

/// Name of the kernel set holding the 8-bit attention and its quantizing passes.
pub const ATTENTION_8BIT_SET: &str = "nn_attention_8bit";

/// The kernels of [`ATTENTION_8BIT_SET`], in the order one call runs them.
pub const ATTENTION_8BIT_KERNELS: &[&str] = &[
    "nn_attention_8bit_kv_stats",
    "nn_attention_8bit_kv_finalize",
    "nn_attention_8bit_quantize_kv",
    "nn_attention_8bit_quantize_q",
    "nn_attention_8bit_d128",
];

/// Query rows and keys per tile of the 8-bit kernel.
pub const TILE_ROWS: usize = 128;
/// Bytes of one quantized tile: 128 rows of 128 bytes.
pub const TILE_BYTES: usize = TILE_ROWS * HEAD_DIM;
/// Pipeline stages of K and V tiles (kA8Stages in the kernel).
const STAGES: u32 = 4;
/// Threads of the attention kernel: a producer warpgroup and two consumer warpgroups.
const ATTENTION_THREADS: u32 = 384;
/// Dynamic shared memory of the attention kernel: a 32 KiB Q region (the INT8 Q tile, then the bf16 output staged
/// through it), `STAGES` K and V tiles, 1 KiB to align the tiles to the 1024-byte swizzle pattern.
pub const ATTENTION_8BIT_SHARED_BYTES: u32 = 32768 + 2 * STAGES * TILE_BYTES as u32 + 1024;
/// Largest workspace a plan accepts (a bound on what a caller is asked to allocate).
pub const MAX_WORKSPACE_BYTES: usize = 1 << 36;
/// Largest grid y and z dimension.
const MAX_GRID_YZ: usize = 65_535;

pub use crate::nn::precision::{AttentionPrecision, ParseAttentionPrecisionError};

/// One part of the workspace: `offset` bytes from its start, `bytes` long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: usize,
    pub bytes: usize,
}

/// Where the quantized operands of one call live in its workspace (see `kernels/nn/attention_8bit.cu`): the tiles
/// (each [`TILE_BYTES`], at offsets that are multiples of 1024) first, then the f32 scales and statistics (16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attention8bitLayout {
    pub query_tiles: usize,
    pub key_tiles: usize,
    /// INT8 Q tiles `[batch][head][query tile]`.
    pub q8: Region,
    /// INT8 K tiles `[batch][kv head][key tile]`.
    pub k8: Region,
    /// e4m3 V^T tiles `[batch][kv head][key tile]`.
    pub v8: Region,
    /// f32 `[batch][head][query_tiles * 128]`: each query row's scale times the softmax scale and log2 e.
    pub q_scale: Region,
    /// f32 `[batch][kv head][key_tiles]`: each key block's scale.
    pub k_scale: Region,
    /// f32 `[batch][kv head][3][128]`: K's mean, V's scale, V's inverse scale per channel.
    pub kv_params: Region,
    /// f32 `[batch][kv head][key_tiles][2][128]`: per-block sums of K and amax of V.
    pub partial: Region,
    /// Bytes of the whole workspace.
    pub total: usize,
}

impl Attention8bitLayout {
    /// The workspace of a call of `shape` (every size checked; at most [`MAX_WORKSPACE_BYTES`]).
    pub fn for_shape(shape: AttentionShape) -> Result<Attention8bitLayout, tf_cuda::Error> {
        const OP: &str = "attention_8bit workspace";
        let overflow = || invalid(OP, format!("sizes of {shape:?} overflow"));
        if shape.num_keys == 0 || shape.num_queries == 0 || shape.batch == 0 {
            return Err(invalid(
                OP,
                "batch, num_queries and num_keys must be at least 1",
            ));
        }
        let query_tiles = shape.num_queries.div_ceil(TILE_ROWS);
        let key_tiles = shape.num_keys.div_ceil(TILE_ROWS);
        let mul = |f: &[usize]| f.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        let q_heads = mul(&[shape.batch, shape.num_heads]).ok_or_else(overflow)?;
        let kv_heads = mul(&[shape.batch, shape.num_kv_heads]).ok_or_else(overflow)?;
        let mut end = 0usize;
        let mut region = |bytes: Option<usize>, align: usize| -> Result<Region, tf_cuda::Error> {
            let bytes = bytes.ok_or_else(overflow)?;
            let offset = end.checked_next_multiple_of(align).ok_or_else(overflow)?;
            end = offset.checked_add(bytes).ok_or_else(overflow)?;
            Ok(Region { offset, bytes })
        };
        let q8 = region(mul(&[q_heads, query_tiles, TILE_BYTES]), 1024)?;
        let k8 = region(mul(&[kv_heads, key_tiles, TILE_BYTES]), 1024)?;
        let v8 = region(mul(&[kv_heads, key_tiles, TILE_BYTES]), 1024)?;
        let q_scale = region(mul(&[q_heads, query_tiles, TILE_ROWS, 4]), 16)?;
        let k_scale = region(mul(&[kv_heads, key_tiles, 4]), 16)?;
        let kv_params = region(mul(&[kv_heads, 3 * HEAD_DIM, 4]), 16)?;
        let partial = region(mul(&[kv_heads, key_tiles, 2 * HEAD_DIM, 4]), 16)?;
        let total = end;
        if total > MAX_WORKSPACE_BYTES {
            return Err(invalid(
                OP,
                format!("{total} B for {shape:?} exceeds the {MAX_WORKSPACE_BYTES} B bound"),
            ));
        }
        Ok(Attention8bitLayout {
            query_tiles,
            key_tiles,
            q8,
            k8,
            v8,
            q_scale,
            k_scale,
            kv_params,
            partial,
            total,
        })
    }
}

/// Builds the five launches of one 8-bit attention call (in submission order): the operands are checked as
/// [`super::attention::plan_attention`] checks them, the workspace against [`Attention8bitLayout::for_shape`] (at least `total` bytes,
/// 16-byte aligned: the bulk copies' alignment). `o` gets `[batch][num_queries][num_heads * 128]` bf16 with `o_strides`.
pub fn plan_attention_8bit<'a>(
    shape: AttentionShape,
    inputs: &AttentionInputs<'a, '_>,
    o: &'a DeviceViewMut<'_>,
    o_strides: Strides,
    workspace: &'a DeviceViewMut<'_>,
) -> Result<[Launch<'a>; 5], tf_cuda::Error> {
    const OP: &str = "attention_8bit";
    // The operand rules of every attention kernel (shapes, strides, sizes, alignment, masks).
    let checked = check_attention_call(HEAD_DIM, shape, inputs, o, o_strides)?;
    let s = shape;
    let layout = Attention8bitLayout::for_shape(s)?;
    let ws = Operand::of_mut(workspace);
    check_aligned_to(OP, "workspace", ws, 16)?;
    check_bytes(OP, "workspace", ws, layout.total)?;
    if s.num_heads > MAX_GRID_YZ || s.batch > MAX_GRID_YZ {
        return Err(invalid(
            OP,
            format!(
                "{} heads and a batch of {} must each be at most {MAX_GRID_YZ}",
                s.num_heads, s.batch
            ),
        ));
    }
    let at = |r: Region| ws.addr + r.offset as u64;
    let key_tiles = to_i32(OP, "key tiles", layout.key_tiles)?;
    let query_tiles = to_i32(OP, "query tiles", layout.query_tiles)?;
    let num_keys = to_i32(OP, "num_keys", s.num_keys)?;
    let kv_heads = to_i32(OP, "num_kv_heads", s.num_kv_heads)?;
    let kv_args = |args: &mut Args| -> Result<(), tf_cuda::Error> {
        push_kv_operands(args, OP, s, inputs, &checked)?;
        args.push(num_keys).push(kv_heads).push(key_tiles);
        Ok(())
    };
    let kv_grid = (
        to_u32(OP, "key tiles", layout.key_tiles)?,
        to_u32(OP, "kv heads", s.num_kv_heads)?,
        to_u32(OP, "batch", s.batch)?,
    );

    let mut stats = Args::new();
    kv_args(&mut stats)?;
    stats.push_addr(at(layout.partial));
    let stats = Launch::new(
        ATTENTION_8BIT_KERNELS[0],
        LaunchConfig::new(kv_grid, 128),
        stats,
    );

    let mut finalize = Args::new();
    finalize
        .push_addr(at(layout.partial))
        .push(num_keys)
        .push(kv_heads)
        .push(key_tiles)
        .push_addr(at(layout.kv_params));
    let finalize = Launch::new(
        ATTENTION_8BIT_KERNELS[1],
        LaunchConfig::new((kv_grid.1, kv_grid.2), 128),
        finalize,
    );

    let mut quantize_kv = Args::new();
    kv_args(&mut quantize_kv)?;
    quantize_kv
        .push_addr(at(layout.kv_params))
        .push_addr(at(layout.k8))
        .push_addr(at(layout.k_scale))
        .push_addr(at(layout.v8));
    let quantize_kv = Launch::new(
        ATTENTION_8BIT_KERNELS[2],
        LaunchConfig::new(kv_grid, 256),
        quantize_kv,
    );

    let num_heads = to_i32(OP, "num_heads", s.num_heads)?;
    let num_queries = to_i32(OP, "num_queries", s.num_queries)?;
    let mut quantize_q = Args::new();
    quantize_q
        .push_addr(inputs.q.addr())
        .push(to_i64(OP, "q batch stride", inputs.q_strides.batch)?)
        .push(to_i32(OP, "q row stride", inputs.q_strides.row)?)
        .push(num_queries)
        .push(num_heads)
        .push(query_tiles)
        .push(inputs.scale * std::f32::consts::LOG2_E)
        .push_addr(at(layout.q8))
        .push_addr(at(layout.q_scale));
    let q_rows_grid = layout
        .query_tiles
        .checked_mul(TILE_ROWS / 8)
        .ok_or_else(|| invalid(OP, "query row blocks overflow"))?;
    let quantize_q = Launch::new(
        ATTENTION_8BIT_KERNELS[3],
        LaunchConfig::new(
            (
                to_u32(OP, "query row blocks", q_rows_grid)?,
                to_u32(OP, "heads", s.num_heads)?,
                kv_grid.2,
            ),
            256,
        ),
        quantize_q,
    );

    let mut attention = Args::new();
    attention
        .push_addr(at(layout.q8))
        .push_addr(at(layout.q_scale))
        .push_addr(at(layout.k8))
        .push_addr(at(layout.k_scale))
        .push_addr(at(layout.v8))
        .push_addr(at(layout.kv_params))
        .push_addr(o.addr())
        .push(to_i64(OP, "o batch stride", o_strides.batch)?)
        .push(to_i32(OP, "o row stride", o_strides.row)?)
        .push(num_queries)
        .push(num_keys)
        .push(num_heads)
        .push(kv_heads)
        .push(query_tiles)
        .push(key_tiles)
        .push_addr(checked.limit_addr)
        .push(to_i64(OP, "key_limit batch stride", checked.limit_stride)?)
        .push_addr(checked.pad_addr);
    let attention = Launch::new(
        ATTENTION_8BIT_KERNELS[4],
        LaunchConfig::new(
            (
                to_u32(OP, "query tiles", layout.query_tiles)?,
                to_u32(OP, "heads", s.num_heads)?,
                kv_grid.2,
            ),
            ATTENTION_THREADS,
        )
        .with_shared(ATTENTION_8BIT_SHARED_BYTES),
        attention,
    );
    Ok([stats, finalize, quantize_kv, quantize_q, attention])
}

/// The loaded `nn_attention_8bit` set (sm_90 only), and the call that runs its five kernels.
pub struct Attention8bitKernels {
    set: LoadedSet,
}

impl fmt::Debug for Attention8bitKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Attention8bitKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl Attention8bitKernels {
    /// Loads the set into `ctx` and opts the attention kernel in to its shared memory. The set holds sm_90a code
    /// only: on any other GPU this fails with [`LoadKernelsError::Missing`] saying so.
    pub fn load(ctx: &Context) -> Result<Attention8bitKernels, LoadKernelsError> {
        require_sm90(ctx, ATTENTION_8BIT_SET, "the 8-bit attention")?;
        let mut set = LoadedSet::empty();
        set.add(
            ctx,
            ATTENTION_8BIT_SET,
            ATTENTION_8BIT_KERNELS,
            |name, function| {
                if name == ATTENTION_8BIT_KERNELS[4] {
                    function.set_max_dynamic_shared(ATTENTION_8BIT_SHARED_BYTES)?;
                }
                Ok(true)
            },
        )?;
        Ok(Attention8bitKernels { set })
    }

    /// Bytes of the workspace a call of `shape` needs.
    pub fn workspace_bytes(shape: AttentionShape) -> Result<usize, tf_cuda::Error> {
        Attention8bitLayout::for_shape(shape).map(|l| l.total)
    }

    /// Submits one launch of [`plan_attention_8bit`] (benchmarks time the passes one by one).
    pub fn submit(&self, stream: &Stream, launch: &Launch<'_>) -> Result<(), tf_cuda::Error> {
        self.set.submit(stream, launch)
    }

    /// Runs one 8-bit attention call on `stream`; see [`plan_attention_8bit`].
    pub fn attention(
        &self,
        stream: &Stream,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_, '_>,
        o: &mut DeviceViewMut<'_>,
        o_strides: Strides,
        workspace: &mut DeviceViewMut<'_>,
    ) -> Result<(), tf_cuda::Error> {
        let launches = plan_attention_8bit(shape, inputs, o, o_strides, workspace)?;
        for launch in &launches {
            self.set.submit(stream, launch)?;
        }
        Ok(())
    }
}

/// Runs attention at `precision`: bf16 through `nn` with `tile` (the engine's choice, or
/// [`NnKernels::preferred_tile`]), or the 8-bit kernels, which need their loaded set and a workspace of
/// [`Attention8bitKernels::workspace_bytes`].
#[allow(clippy::too_many_arguments)]
pub fn attention_at(
    precision: AttentionPrecision,
    nn: &NnKernels,
    tile: AttentionTile,
    eight_bit: Option<(&Attention8bitKernels, &mut DeviceViewMut<'_>)>,
    stream: &Stream,
    shape: AttentionShape,
    inputs: &AttentionInputs<'_, '_>,
    o: &mut DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<(), tf_cuda::Error> {
    match (precision, eight_bit) {
        (AttentionPrecision::Bf16, _) => {
            nn.attention_with(stream, tile, shape, inputs, o, o_strides)
        }
        (AttentionPrecision::Int8Fp8, Some((kernels, workspace))) => {
            kernels.attention(stream, shape, inputs, o, o_strides, workspace)
        }
        (AttentionPrecision::Int8Fp8, None) => Err(invalid(
            "attention",
            "the int8-fp8 precision needs the nn_attention_8bit kernels and a workspace",
        )),
    }
}

/// The quantization of the 8-bit attention on the host, repeating the kernels' f32 arithmetic step for step (so
/// codes and scales match the workspace bit for bit), the tile layout, and an attention over the dequantized
/// operands. Rows are one head's 128 channels.
pub mod emulation {
    use super::{HEAD_DIM, TILE_ROWS};
    use crate::nn::fp8::{e4m3_decode, e4m3_encode};

    /// Largest INT8 code magnitude.
    pub const INT8_MAX: f32 = 127.0;
    /// Largest e4m3 value (P is scaled to it, V's channels are scaled to it).
    pub const FP8_MAX: f32 = 448.0;

    /// Byte offset of byte `col` of row `row` in a swizzled 128 x 128-byte tile (the 128-byte swizzle: the 16-byte
    /// chunk index XOR the row's low three bits).
    pub fn swizzle(row: usize, col: usize) -> usize {
        row * 128 + ((((col >> 4) ^ (row & 7)) & 7) << 4) + (col & 15)
    }

    /// Where key `key` (0..128) of a tile sits along V^T's rows: within each group of 16, key `8h + 2t + j` goes to
    /// position `4t + 2h + j`, the order in which a thread's P values fill an 8-bit wgmma A operand.
    pub fn key_position(key: usize) -> usize {
        let k16 = key & 15;
        (key & !15) | (((k16 >> 1) & 3) << 2) | (((k16 >> 3) & 1) << 1) | (k16 & 1)
    }

    fn to_int8(x: f32, inv: f32) -> i8 {
        // x * inv rounded to nearest even (cvt.rni), clamped to +-127.
        (x * inv).round_ties_even().clamp(-INT8_MAX, INT8_MAX) as i8
    }

    /// INT8 codes of one row with one scale (`amax / 127`, 1 for an all-zero row): `round(x * (127 / amax))`.
    pub fn quantize_int8(values: &[f32]) -> (Vec<i8>, f32) {
        let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if amax > 0.0 { INT8_MAX / amax } else { 1.0 };
        let scale = if amax > 0.0 { amax / INT8_MAX } else { 1.0 };
        (values.iter().map(|&x| to_int8(x, inv)).collect(), scale)
    }

    /// K's mean and V's scale and inverse scale per channel, over `num_keys` rows of 128 (K and V of one sample and
    /// kv head): sums in key order within each 128-key block, then the blocks in order, as the kernels add them.
    #[derive(Clone, Debug, PartialEq)]
    pub struct KvParams {
        pub mean: Vec<f32>,
        pub v_scale: Vec<f32>,
        pub v_inv: Vec<f32>,
    }

    /// [`KvParams`] of one sample and kv head; `k` and `v` are `[num_keys][128]`.
    pub fn kv_params(k: &[f32], v: &[f32]) -> KvParams {
        let num_keys = k.len() / HEAD_DIM;
        let mut mean = vec![0f32; HEAD_DIM];
        let mut v_scale = vec![0f32; HEAD_DIM];
        let mut v_inv = vec![0f32; HEAD_DIM];
        for c in 0..HEAD_DIM {
            let (mut sum, mut amax) = (0f32, 0f32);
            for block in (0..num_keys).step_by(TILE_ROWS) {
                let (mut block_sum, mut block_amax) = (0f32, 0f32);
                for key in block..(block + TILE_ROWS).min(num_keys) {
                    block_sum += k[key * HEAD_DIM + c];
                    block_amax = block_amax.max(v[key * HEAD_DIM + c].abs());
                }
                sum += block_sum;
                amax = amax.max(block_amax);
            }
            mean[c] = sum / num_keys as f32;
            (v_scale[c], v_inv[c]) = if amax > 0.0 {
                (amax / FP8_MAX, FP8_MAX / amax)
            } else {
                (1.0, 1.0)
            };
        }
        KvParams {
            mean,
            v_scale,
            v_inv,
        }
    }

    /// The INT8 codes (`[keys][128]`, unswizzled) and the scale of one block of up to 128 keys of K, smoothed by
    /// `mean`.
    pub fn quantize_k_block(k: &[f32], mean: &[f32]) -> (Vec<i8>, f32) {
        let smoothed: Vec<f32> = k
            .chunks_exact(HEAD_DIM)
            .flat_map(|row| row.iter().zip(mean).map(|(&x, &m)| x - m))
            .collect();
        quantize_int8(&smoothed)
    }

    /// The e4m3 codes of V rows (`[keys][128]`, not transposed) with per-channel inverse scales `v_inv`.
    pub fn quantize_v(v: &[f32], v_inv: &[f32]) -> Vec<u8> {
        v.chunks_exact(HEAD_DIM)
            .flat_map(|row| row.iter().zip(v_inv).map(|(&x, &inv)| e4m3_encode(x * inv)))
            .collect()
    }

    /// Attention of one head over the dequantized operands, in f64: queries `[nq][128]`, keys and values
    /// `[nk][128]`, `visible(q, k)` the mask, `scale` the softmax scale. Q is quantized per row and K per 128-key
    /// block after smoothing, V per channel; P (relative to the row maximum, x 448) is rounded to e4m3 as the kernel
    /// rounds it, the row sums take the unrounded P. A row that sees no key is zero.
    pub fn attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        scale: f32,
        visible: impl Fn(usize, usize) -> bool,
    ) -> Vec<f32> {
        let nk = k.len() / HEAD_DIM;
        let params = kv_params(k, v);
        let mut k_deq = vec![0f64; k.len()];
        for block in (0..nk).step_by(TILE_ROWS) {
            let end = (block + TILE_ROWS).min(nk);
            let (codes, s) = quantize_k_block(&k[block * HEAD_DIM..end * HEAD_DIM], &params.mean);
            for (i, &c) in codes.iter().enumerate() {
                k_deq[block * HEAD_DIM + i] = f64::from(c) * f64::from(s);
            }
        }
        let v_deq: Vec<f64> = quantize_v(v, &params.v_inv)
            .iter()
            .enumerate()
            .map(|(i, &c)| f64::from(e4m3_decode(c)) * f64::from(params.v_scale[i % HEAD_DIM]))
            .collect();
        let mut out = vec![0f32; q.len()];
        let mut scores = vec![0f64; nk];
        for (qi, q_row) in q.chunks_exact(HEAD_DIM).enumerate() {
            let (codes, qs) = quantize_int8(q_row);
            let mut max = f64::NEG_INFINITY;
            for (key, score) in scores.iter_mut().enumerate() {
                *score = f64::NEG_INFINITY;
                if visible(qi, key) {
                    let dot: f64 = codes
                        .iter()
                        .zip(&k_deq[key * HEAD_DIM..(key + 1) * HEAD_DIM])
                        .map(|(&c, &kk)| f64::from(c) * kk)
                        .sum();
                    *score = dot * f64::from(qs) * f64::from(scale);
                    max = max.max(*score);
                }
            }
            if max == f64::NEG_INFINITY {
                continue;
            }
            let mut acc = vec![0f64; HEAD_DIM];
            let mut denom = 0f64;
            for (key, &score) in scores.iter().enumerate() {
                if score == f64::NEG_INFINITY {
                    continue;
                }
                let p = (score - max).exp() * f64::from(FP8_MAX);
                denom += p;
                let p8 = f64::from(e4m3_decode(e4m3_encode(p as f32)));
                for (a, &vv) in acc
                    .iter_mut()
                    .zip(&v_deq[key * HEAD_DIM..(key + 1) * HEAD_DIM])
                {
                    *a += p8 * vv;
                }
            }
            for (dst, a) in out[qi * HEAD_DIM..(qi + 1) * HEAD_DIM].iter_mut().zip(acc) {
                *dst = (a / denom) as f32;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::emulation::*;
    use super::*;
    use crate::nn::fp8::e4m3_decode;
    use crate::nn::gpu::test_support::{buffer, context, BF16};
    use proptest::prelude::*;

    fn shape(nq: usize, nk: usize, heads: usize, kv_heads: usize) -> AttentionShape {
        AttentionShape {
            batch: 2,
            num_queries: nq,
            num_keys: nk,
            prefix_len: 0,
            num_heads: heads,
            num_kv_heads: kv_heads,
        }
    }

    #[test]
    fn precision_parses_and_defaults_to_bf16() {
        assert_eq!(AttentionPrecision::default(), AttentionPrecision::Bf16);
        for p in [AttentionPrecision::Bf16, AttentionPrecision::Int8Fp8] {
            assert_eq!(p.to_string().parse::<AttentionPrecision>().unwrap(), p);
        }
        assert!("fp8".parse::<AttentionPrecision>().is_err());
    }

    #[test]
    fn layout_places_aligned_regions_without_overlap() {
        let l = Attention8bitLayout::for_shape(shape(300, 129, 4, 2)).unwrap();
        assert_eq!((l.query_tiles, l.key_tiles), (3, 2));
        assert_eq!(l.q8.bytes, 2 * 4 * 3 * TILE_BYTES);
        assert_eq!(l.k8.bytes, 2 * 2 * 2 * TILE_BYTES);
        assert_eq!(l.q_scale.bytes, 2 * 4 * 3 * 128 * 4);
        assert_eq!(l.partial.bytes, 2 * 2 * 2 * 256 * 4);
        let regions = [
            l.q8,
            l.k8,
            l.v8,
            l.q_scale,
            l.k_scale,
            l.kv_params,
            l.partial,
        ];
        for (i, a) in regions.iter().enumerate() {
            assert!(a.offset.is_multiple_of(16));
            assert!(a.offset + a.bytes <= l.total);
            for b in &regions[i + 1..] {
                assert!(a.offset + a.bytes <= b.offset, "{a:?} overlaps {b:?}");
            }
        }
        for tiles in [l.q8, l.k8, l.v8] {
            assert!(tiles.offset.is_multiple_of(1024));
        }
        assert!(Attention8bitLayout::for_shape(shape(1, 0, 1, 1)).is_err());
        let huge = shape(usize::MAX / 2, 1 << 20, 1 << 10, 1);
        assert!(Attention8bitLayout::for_shape(huge).is_err());
        let big = shape(1 << 24, 1 << 24, 64, 64);
        let err = Attention8bitLayout::for_shape(big).unwrap_err();
        assert!(err.to_string().contains("bound"), "{err}");
    }

    #[test]
    fn key_positions_permute_each_group_of_16() {
        let first: Vec<usize> = (0..16).map(key_position).collect();
        // Position p holds key [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15][p].
        let order = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15];
        for (p, &key) in order.iter().enumerate() {
            assert_eq!(first[key], p);
        }
        let mut seen = [false; 128];
        for key in 0..128 {
            let p = key_position(key);
            assert_eq!(p & !15, key & !15);
            assert!(!seen[p]);
            seen[p] = true;
        }
    }

    #[test]
    fn swizzle_is_a_bijection_within_16_byte_chunks() {
        let mut seen = vec![false; TILE_BYTES];
        for row in 0..128 {
            for col in 0..128 {
                let o = swizzle(row, col);
                assert_eq!(o / 128, row);
                assert_eq!(o % 16, col % 16);
                assert!(!seen[o]);
                seen[o] = true;
            }
        }
    }

    #[test]
    fn smoothing_centres_k_and_uses_block_order_sums() {
        // 300 keys: channel c is 5 + c/128 plus a ramp; the mean is the offset plus the ramp's mean.
        let nk = 300;
        let k: Vec<f32> = (0..nk * HEAD_DIM)
            .map(|i| 5.0 + (i % HEAD_DIM) as f32 / 128.0 + ((i / HEAD_DIM) as f32 - 149.5) * 0.01)
            .collect();
        let v = vec![0f32; nk * HEAD_DIM];
        let p = kv_params(&k, &v);
        for (c, &m) in p.mean.iter().enumerate() {
            assert!((m - (5.0 + c as f32 / 128.0)).abs() < 1e-4, "{c}: {m}");
        }
        // All-zero V channels: scale and inverse 1, codes 0.
        assert!(p.v_scale.iter().chain(&p.v_inv).all(|&s| s == 1.0));
        let (codes, s) = quantize_k_block(&k[..128 * HEAD_DIM], &p.mean);
        assert!(s < 0.02, "the smoothed block spans +-1.5 only: scale {s}");
        assert!(codes.iter().any(|&c| c.unsigned_abs() == 127));
    }

    proptest! {
        /// INT8: codes within +-127, the amax reaches 127, and each value is within half a step of its code.
        #[test]
        fn int8_codes_are_within_half_a_step(values in proptest::collection::vec(-50f32..50.0, 1..300)) {
            let (codes, scale) = quantize_int8(&values);
            let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
            prop_assert!(codes.iter().all(|c| c.unsigned_abs() <= 127));
            if amax > 0.0 {
                prop_assert!(codes.iter().any(|c| c.unsigned_abs() == 127));
                // Measured in f64: in f32 the difference itself rounds by up to half an ulp of x (1.9e-6 near
                // 40), as much as the slack. The code is chosen from x * inv in f32 (inv rounded, the product
                // rounded): at most about 2e-5 of a step off the exact half-way point, as the kernel's cvt.rni.
                for (&x, &c) in values.iter().zip(&codes) {
                    let err = (f64::from(c) * f64::from(scale) - f64::from(x)).abs();
                    prop_assert!(err <= (0.5 + 2e-5) * f64::from(scale), "{} -> {} ({})", x, c, scale);
                }
            } else {
                prop_assert!(codes.iter().all(|&c| c == 0));
                prop_assert_eq!(scale, 1.0);
            }
        }

        /// FP8 V: each channel's amax maps to 448, and every value is within e4m3's half step (2^-4 relative,
        /// or the subnormal step 2^-10 absolute at the channel's scale).
        #[test]
        fn v_codes_are_within_e4m3_rounding(values in proptest::collection::vec(-8f32..8.0, HEAD_DIM..HEAD_DIM * 6)) {
            let rows = values.len() / HEAD_DIM;
            let v = &values[..rows * HEAD_DIM];
            let p = kv_params(&vec![0f32; v.len()], v);
            let codes = quantize_v(v, &p.v_inv);
            for c in 0..HEAD_DIM {
                let amax = (0..rows).fold(0f32, |m, r| m.max(v[r * HEAD_DIM + c].abs()));
                let mut reached = amax == 0.0;
                for r in 0..rows {
                    let i = r * HEAD_DIM + c;
                    let got = e4m3_decode(codes[i]) * p.v_scale[c];
                    let tol = v[i].abs() / 16.0 + p.v_scale[c] * 2f32.powi(-10) + 1e-6 * amax;
                    prop_assert!((got - v[i]).abs() <= tol, "{} -> {}", v[i], got);
                    reached |= e4m3_decode(codes[i]).abs() == 448.0;
                }
                prop_assert!(reached, "channel {c}: amax {amax} does not map to 448");
            }
        }

        /// Smoothing leaves the attention unchanged: the emulated output of K + a per-channel offset equals that of K
        /// up to rounding.
        #[test]
        fn smoothing_makes_a_key_offset_harmless(seed in 0u64..1000, offset in -4f32..4.0) {
            let mut rng = crate::nn::sampling::seeded::SplitMix64::new(seed);
            let (nq, nk) = (3, 70);
            let q: Vec<f32> = (0..nq * HEAD_DIM).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let k: Vec<f32> = (0..nk * HEAD_DIM).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let v: Vec<f32> = (0..nk * HEAD_DIM).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let shifted: Vec<f32> = k.iter().enumerate().map(|(i, &x)| x + offset * ((i % HEAD_DIM) as f32 / 64.0 - 1.0)).collect();
            let a = attention(&q, &k, &v, 0.088, |_, _| true);
            let b = attention(&q, &shifted, &v, 0.088, |_, _| true);
            let diff: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            prop_assert!(diff < 0.05, "max diff {}", diff);
        }
    }

    /// The plan on the test driver: five launches with the kernels' grids, the operand checks of the bf16 kernels,
    /// and the workspace checks.
    #[test]
    fn plan_builds_five_launches_and_checks_the_workspace() {
        let _serial = tf_testdriver::test_lock();
        let ctx = context();
        let (heads, kv_heads, nq, nk) = (4usize, 2usize, 200usize, 130usize);
        let (qw, kvw) = (heads * HEAD_DIM, kv_heads * HEAD_DIM);
        let q = buffer(&ctx, nq * qw * BF16);
        let k = buffer(&ctx, nk * kvw * BF16);
        let v = buffer(&ctx, nk * kvw * BF16);
        let mut o = buffer(&ctx, nq * qw * BF16);
        let s = AttentionShape {
            batch: 1,
            ..shape(nq, nk, heads, kv_heads)
        };
        let layout = Attention8bitLayout::for_shape(s).unwrap();
        let mut ws = buffer(&ctx, layout.total + 1024);
        let (qv, kv, vv) = (q.view(), k.view(), v.view());
        let q_strides = Strides {
            batch: nq * qw,
            row: qw,
        };
        let kv_strides = Strides {
            batch: nk * kvw,
            row: kvw,
        };
        let inputs = AttentionInputs {
            kv_strides,
            ..AttentionInputs::self_attention(&qv, &kv, &vv, q_strides, 0.088)
        };
        let ov = o.view_mut();
        {
            let wsv = ws.view_mut();
            let launches = plan_attention_8bit(s, &inputs, &ov, q_strides, &wsv).unwrap();
            let names: Vec<&str> = launches.iter().map(|l| l.kernel()).collect();
            assert_eq!(names, ATTENTION_8BIT_KERNELS);
            let grid = |i: usize| {
                let g = launches[i].config().grid;
                (g.x, g.y, g.z)
            };
            assert_eq!(grid(0), (2, 2, 1));
            assert_eq!(grid(1), (2, 1, 1));
            assert_eq!(grid(2), (2, 2, 1));
            assert_eq!(grid(3), (32, 4, 1));
            assert_eq!(grid(4), (2, 4, 1));
            assert_eq!(launches[4].config().block.x, 384);
            assert_eq!(
                launches[4].config().shared_bytes,
                ATTENTION_8BIT_SHARED_BYTES
            );
        }
        const { assert!(ATTENTION_8BIT_SHARED_BYTES <= 227 * 1024) };
        // A workspace one byte short, or not 16-byte aligned, is refused.
        {
            let short = ws.slice_mut(0, layout.total - 1).unwrap();
            let err = plan_attention_8bit(s, &inputs, &ov, q_strides, &short).unwrap_err();
            assert!(err.to_string().contains("workspace"), "{err}");
        }
        {
            let shifted = ws.slice_mut(8, layout.total).unwrap();
            let err = plan_attention_8bit(s, &inputs, &ov, q_strides, &shifted).unwrap_err();
            assert!(err.to_string().contains("aligned"), "{err}");
        }
        // The bf16 kernels' operand checks apply: a q too small for the heads is refused.
        let small = AttentionShape {
            num_heads: 8,
            num_kv_heads: 2,
            ..s
        };
        let wsv = ws.view_mut();
        assert!(plan_attention_8bit(small, &inputs, &ov, q_strides, &wsv).is_err());
    }
}
