//! Flash attention launchers: the tile shapes ([`AttentionTile`]), the call's shape and operands, [`plan_attention`]
//! (the mma.sync and wgmma kernels) and [`plan_attention_tma`] (TMA tensor maps), the per-query key limits and key
//! padding the masks use, and the FLOP count. Kernel sets `nn_attention` (the tiles production selects) and, with
//! the `bench-kernels` feature, `nn_attention_bench`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::tensor_map::{encode_bf16_tiles, Bf16Tiles};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use super::launch::{
    check_aligned, check_bytes, invalid, to_i32, to_i64, to_u32, Launch, Operand, BF16,
};
use super::NnKernels;

/// Name of the kernel set holding the attention kernels production selects.
pub const ATTENTION_SET: &str = "nn_attention";

/// Head dimension the wgmma attention kernels and the QK-norm kernels are built for.
pub const HEAD_DIM: usize = 128;

/// Tile shape (and head dim) of the attention kernel: warps per CTA (16 query rows each) and cp.async stages of
/// 64 keys. Production selects [`AttentionTile::Sm90Tma`] on sm_90 and [`AttentionTile::W8S2`] elsewhere at head
/// dim 128, and [`AttentionTile::D64W8S2`] at head dim 64; the other tiles exist for benchmarks only (the
/// `bench-kernels` feature).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionTile {
    /// 128 query rows, 8 warps, 2 stages (96 KiB shared memory). The default, and the fallback off sm_90.
    #[default]
    W8S2,
    /// 128 query rows, 8 warps, 3 stages (128 KiB).
    #[cfg(feature = "bench-kernels")]
    W8S3,
    /// 64 query rows, 4 warps, 2 stages (80 KiB).
    #[cfg(feature = "bench-kernels")]
    W4S2,
    /// 64 query rows, 4 warps, 3 stages (112 KiB).
    #[cfg(feature = "bench-kernels")]
    W4S3,
    /// sm_90a only: 128 query rows in two warpgroups, wgmma, keys in tiles of 128 through 2 stages (161 KiB).
    #[cfg(feature = "bench-kernels")]
    Sm90,
    /// sm_90a only, warp-specialised: a producer warpgroup fills a 3-stage ring of 128-key tiles (mbarriers)
    /// while two consumer warpgroups take turns on the tensor cores, so one's softmax overlaps the other's
    /// GEMMs (225 KiB, 384 threads). Bit-identical to `Sm90`.
    #[cfg(feature = "bench-kernels")]
    Sm90Ws,
    /// sm_90a only: the warp-specialised wgmma kernel loading through TMA tensor maps (one producer thread,
    /// 128-row boxes in the 128-byte swizzle; 225 KiB, 384 threads). The cached prefix is tiled on its own, so
    /// with a prefix that is not a multiple of 128 keys it rounds differently from the other 128-key tiles (see
    /// [`AttentionTile::reduction_order`]).
    Sm90Tma,
    /// Head dim 64: 128 query rows, 8 warps, 2 stages of mma.sync (48 KiB), every GPU.
    D64W8S2,
}

impl AttentionTile {
    /// Every head-dim-128 tile shape of this build (benchmarks and tile comparisons loop over it).
    #[cfg(not(feature = "bench-kernels"))]
    pub const ALL: [AttentionTile; 2] = [AttentionTile::W8S2, AttentionTile::Sm90Tma];
    /// Every head-dim-128 tile shape of this build (benchmarks and tile comparisons loop over it).
    #[cfg(feature = "bench-kernels")]
    pub const ALL: [AttentionTile; 7] = [
        AttentionTile::W8S2,
        AttentionTile::W8S3,
        AttentionTile::W4S2,
        AttentionTile::W4S3,
        AttentionTile::Sm90,
        AttentionTile::Sm90Ws,
        AttentionTile::Sm90Tma,
    ];

    /// Whether the kernel uses sm_90a instructions (it traps on any other GPU, so it is only loaded on 9.0).
    pub fn needs_sm90(self) -> bool {
        match self {
            AttentionTile::Sm90Tma => true,
            #[cfg(feature = "bench-kernels")]
            AttentionTile::Sm90 | AttentionTile::Sm90Ws => true,
            _ => false,
        }
    }

    /// The head dim the kernel is built for.
    pub fn head_dim(self) -> usize {
        match self {
            AttentionTile::D64W8S2 => 64,
            _ => HEAD_DIM,
        }
    }

    /// What fixes the reduction order of a call with `prefix_len` cached keys: tile shapes with equal values
    /// give bit-identical results. The key-tile width, and where the tiles start: every 128 keys, or (TMA) every
    /// 128 keys of the prefix and again every 128 keys after it.
    pub fn reduction_order(self, prefix_len: usize) -> (u32, usize) {
        let keys = self.keys_per_tile();
        let shift = match self {
            AttentionTile::Sm90Tma => prefix_len % keys as usize,
            _ => 0,
        };
        (keys, shift)
    }

    /// Keys per tile: tile shapes of equal width reduce in the same order and give bit-identical results.
    pub fn keys_per_tile(self) -> u32 {
        if self.needs_sm90() {
            128
        } else {
            64
        }
    }

    /// The kernel's symbol.
    pub fn kernel(self) -> &'static str {
        match self {
            AttentionTile::W8S2 => "nn_attention_d128_w8s2",
            #[cfg(feature = "bench-kernels")]
            AttentionTile::W8S3 => "nn_attention_d128_w8s3",
            #[cfg(feature = "bench-kernels")]
            AttentionTile::W4S2 => "nn_attention_d128_w4s2",
            #[cfg(feature = "bench-kernels")]
            AttentionTile::W4S3 => "nn_attention_d128_w4s3",
            #[cfg(feature = "bench-kernels")]
            AttentionTile::Sm90 => "nn_attention_d128_sm90",
            #[cfg(feature = "bench-kernels")]
            AttentionTile::Sm90Ws => "nn_attention_d128_sm90_ws",
            AttentionTile::Sm90Tma => "nn_attention_d128_sm90_tma",
            AttentionTile::D64W8S2 => "nn_attention_d64_w8s2",
        }
    }

    /// Warps per CTA (the warp-specialised kernels add a producer warpgroup to their 8 computing warps).
    pub fn warps(self) -> u32 {
        match self {
            AttentionTile::Sm90Tma => 12,
            #[cfg(feature = "bench-kernels")]
            AttentionTile::Sm90Ws => 12,
            #[cfg(feature = "bench-kernels")]
            AttentionTile::W4S2 | AttentionTile::W4S3 => 4,
            _ => 8,
        }
    }

    /// cp.async (or TMA) stages.
    pub fn stages(self) -> u32 {
        match self {
            AttentionTile::Sm90Tma => 3,
            #[cfg(feature = "bench-kernels")]
            AttentionTile::W8S3 | AttentionTile::W4S3 | AttentionTile::Sm90Ws => 3,
            _ => 2,
        }
    }

    /// Query rows per CTA (16 per computing warp).
    pub fn rows(self) -> u32 {
        match self {
            AttentionTile::Sm90Tma => 128,
            #[cfg(feature = "bench-kernels")]
            AttentionTile::Sm90Ws => 128,
            _ => self.warps() * 16,
        }
    }

    /// Dynamic shared memory: the Q tile plus `stages` K and V tiles, 2 * head_dim bytes per row (the sm_90
    /// kernels add 1 KiB to align their tiles to the 1024-byte swizzle pattern).
    pub fn shared_bytes(self) -> u32 {
        let rows = self.rows() + 2 * self.keys_per_tile() * self.stages();
        let align = if self.needs_sm90() { 1024 } else { 0 };
        rows * (self.head_dim() * BF16) as u32 + align
    }
}

/// The kernels of the production attention set.
pub(crate) const ATTENTION_KERNELS: &[&str] = &[
    "nn_attention_d128_w8s2",
    "nn_attention_d128_sm90_tma",
    "nn_attention_d64_w8s2",
];

/// Name of the kernel set holding the benchmark-only attention tiles.
#[cfg(feature = "bench-kernels")]
pub const ATTENTION_BENCH_SET: &str = "nn_attention_bench";

/// The kernels of the benchmark-only attention set.
#[cfg(feature = "bench-kernels")]
pub(crate) const ATTENTION_BENCH_KERNELS: &[&str] = &[
    "nn_attention_d128_w8s3",
    "nn_attention_d128_w4s2",
    "nn_attention_d128_w4s3",
    "nn_attention_d128_sm90",
    "nn_attention_d128_sm90_ws",
];

/// Element strides of one attention operand: between batches and between tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strides {
    pub batch: usize,
    pub row: usize,
}

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub num_queries: usize,
    /// All keys: `prefix_len` cached rows followed by `num_keys - prefix_len` current rows.
    pub num_keys: usize,
    pub prefix_len: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

/// The operands of one attention call (see `kernels/nn/attention.cuh`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<'v, 'a> {
    pub q: &'v DeviceView<'a>,
    pub q_strides: Strides,
    /// Cached prefix K and V (`prefix_len` rows per batch); required when `prefix_len > 0`.
    pub prefix: Option<(&'v DeviceView<'a>, &'v DeviceView<'a>, Strides)>,
    /// Current K and V (`num_keys - prefix_len` rows per batch).
    pub k: &'v DeviceView<'a>,
    pub v: &'v DeviceView<'a>,
    pub kv_strides: Strides,
    /// Per-query key limits (i32, query q sees keys < limit): `[batch][num_queries]` with the given batch
    /// stride in elements (0 shares one row of limits across the batch).
    pub key_limit: Option<(&'v DeviceView<'a>, usize)>,
    /// Key padding (i32 pairs `[batch][2]`: keys in [begin, end) are never seen).
    pub key_pad: Option<&'v DeviceView<'a>>,
    /// Softmax scale (1/sqrt(128) for the DiT).
    pub scale: f32,
}

impl<'v, 'a> AttentionInputs<'v, 'a> {
    /// Attention of one sequence over itself: Q, K and V with the same strides, no cached prefix, no key limits
    /// and no padding (add them with [`AttentionInputs::with_key_limit`]).
    pub fn self_attention(
        q: &'v DeviceView<'a>,
        k: &'v DeviceView<'a>,
        v: &'v DeviceView<'a>,
        strides: Strides,
        scale: f32,
    ) -> AttentionInputs<'v, 'a> {
        AttentionInputs {
            q,
            q_strides: strides,
            prefix: None,
            k,
            v,
            kv_strides: strides,
            key_limit: None,
            key_pad: None,
            scale,
        }
    }

    /// The same inputs with per-query key limits (`[batch][num_queries]` i32, `batch_stride` elements apart; 0
    /// shares one row across the batch).
    pub fn with_key_limit(
        self,
        limits: &'v DeviceView<'a>,
        batch_stride: usize,
    ) -> AttentionInputs<'v, 'a> {
        AttentionInputs {
            key_limit: Some((limits, batch_stride)),
            ..self
        }
    }
}

/// Bytes an attention operand needs: `batch` blocks of `rows` tokens, `width` elements used per token.
fn attention_span(batch: usize, rows: usize, strides: Strides, width: usize) -> Option<usize> {
    if batch == 0 || rows == 0 {
        return Some(0);
    }
    (batch - 1)
        .checked_mul(strides.batch)?
        .checked_add((rows - 1).checked_mul(strides.row)?)?
        .checked_add(width)?
        .checked_mul(BF16)
}

fn check_attention_operand(
    name: &str,
    operand: Operand,
    batch: usize,
    rows: usize,
    strides: Strides,
    width: usize,
) -> Result<(), tf_cuda::Error> {
    const OP: &str = "attention";
    check_aligned(OP, name, operand)?;
    if !strides.row.is_multiple_of(8) || !strides.batch.is_multiple_of(8) {
        return Err(invalid(
            OP,
            format!("{name}: strides {strides:?} must be multiples of 8 elements (16-byte rows)"),
        ));
    }
    if rows > 0 && strides.row < width {
        return Err(invalid(
            OP,
            format!(
                "{name}: row stride {} is less than the {width} elements of a token",
                strides.row
            ),
        ));
    }
    let span = attention_span(batch, rows, strides, width)
        .ok_or_else(|| invalid(OP, format!("{name}: size overflows")))?;
    check_bytes(OP, name, operand, span)
}

/// What an attention call passes to its kernels once [`check_attention_call`] accepted its operands, beside q, o and
/// the shape: the prefix K/V (the current ones stand in without a prefix: the kernels never read them then), the
/// key limits and the key pads (address 0: none).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CheckedAttention {
    prefix_k: u64,
    prefix_v: u64,
    prefix_strides: Strides,
    pub(crate) limit_addr: u64,
    pub(crate) limit_stride: usize,
    pub(crate) pad_addr: u64,
}

/// Checks one attention call of `head_dim`-wide heads (shapes, strides, sizes, alignment, masks): the rules of every
/// attention kernel.
pub(crate) fn check_attention_call(
    head_dim: usize,
    shape: AttentionShape,
    inputs: &AttentionInputs<'_, '_>,
    o: &DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<CheckedAttention, tf_cuda::Error> {
    const OP: &str = "attention";
    let s = shape;
    if s.num_heads == 0 || s.num_kv_heads == 0 || !s.num_heads.is_multiple_of(s.num_kv_heads) {
        return Err(invalid(
            OP,
            format!(
                "{} query heads must be a non-zero multiple of the {} kv heads",
                s.num_heads, s.num_kv_heads
            ),
        ));
    }
    if s.prefix_len > s.num_keys {
        return Err(invalid(
            OP,
            format!(
                "prefix of {} keys is longer than the {} keys",
                s.prefix_len, s.num_keys
            ),
        ));
    }
    if s.batch == 0 || s.num_queries == 0 {
        return Err(invalid(OP, "batch and num_queries must be at least 1"));
    }
    if !inputs.scale.is_finite() {
        return Err(invalid(OP, format!("scale {} is not finite", inputs.scale)));
    }
    let q_width = s
        .num_heads
        .checked_mul(head_dim)
        .ok_or_else(|| invalid(OP, "num_heads * head_dim overflows"))?;
    let kv_width = s.num_kv_heads * head_dim;
    let current = s.num_keys - s.prefix_len;
    check_attention_operand(
        "q",
        Operand::of(inputs.q),
        s.batch,
        s.num_queries,
        inputs.q_strides,
        q_width,
    )?;
    check_attention_operand(
        "o",
        Operand::of_mut(o),
        s.batch,
        s.num_queries,
        o_strides,
        q_width,
    )?;
    check_attention_operand(
        "k",
        Operand::of(inputs.k),
        s.batch,
        current,
        inputs.kv_strides,
        kv_width,
    )?;
    check_attention_operand(
        "v",
        Operand::of(inputs.v),
        s.batch,
        current,
        inputs.kv_strides,
        kv_width,
    )?;
    // Without a prefix the kernel never reads the prefix pointers; pass k/v so they are valid addresses.
    let (prefix_k, prefix_v, prefix_strides) = match inputs.prefix {
        Some((kp, vp, strides)) => {
            check_attention_operand(
                "k_prefix",
                Operand::of(kp),
                s.batch,
                s.prefix_len,
                strides,
                kv_width,
            )?;
            check_attention_operand(
                "v_prefix",
                Operand::of(vp),
                s.batch,
                s.prefix_len,
                strides,
                kv_width,
            )?;
            (kp.addr(), vp.addr(), strides)
        }
        None if s.prefix_len > 0 => {
            return Err(invalid(
                OP,
                format!(
                    "prefix_len is {} but no cached prefix K/V was given",
                    s.prefix_len
                ),
            ));
        }
        None => (inputs.k.addr(), inputs.v.addr(), inputs.kv_strides),
    };
    let (limit_addr, limit_stride) = match inputs.key_limit {
        Some((limits, batch_stride)) => {
            let last = (s.batch - 1)
                .checked_mul(batch_stride)
                .and_then(|n| n.checked_add(s.num_queries))
                .and_then(|n| n.checked_mul(4))
                .ok_or_else(|| invalid(OP, "key_limit size overflows"))?;
            check_bytes(OP, "key_limit", Operand::of(limits), last)?;
            if !limits.addr().is_multiple_of(4) {
                return Err(invalid(
                    OP,
                    "key_limit: device address is not 4-byte aligned",
                ));
            }
            (limits.addr(), batch_stride)
        }
        None => (0, 0),
    };
    let pad_addr = match inputs.key_pad {
        Some(pad) => {
            check_bytes(OP, "key_pad", Operand::of(pad), s.batch * 2 * 4)?;
            if !pad.addr().is_multiple_of(4) {
                return Err(invalid(OP, "key_pad: device address is not 4-byte aligned"));
            }
            pad.addr()
        }
        None => 0,
    };
    Ok(CheckedAttention {
        prefix_k,
        prefix_v,
        prefix_strides,
        limit_addr,
        limit_stride,
        pad_addr,
    })
}

/// Pushes the K/V operands as every attention kernel takes them: the prefix k and v, their batch and row strides,
/// `prefix_len`, then the current k and v and their strides.
pub(crate) fn push_kv_operands(
    args: &mut Args,
    op: &str,
    shape: AttentionShape,
    inputs: &AttentionInputs<'_, '_>,
    checked: &CheckedAttention,
) -> Result<(), tf_cuda::Error> {
    args.push_addr(checked.prefix_k)
        .push_addr(checked.prefix_v)
        .push(to_i64(
            op,
            "prefix batch stride",
            checked.prefix_strides.batch,
        )?)
        .push(to_i32(op, "prefix row stride", checked.prefix_strides.row)?)
        .push(to_i32(op, "prefix_len", shape.prefix_len)?)
        .push_addr(inputs.k.addr())
        .push_addr(inputs.v.addr())
        .push(to_i64(op, "kv batch stride", inputs.kv_strides.batch)?)
        .push(to_i32(op, "kv row stride", inputs.kv_strides.row)?);
    Ok(())
}

/// Builds one flash-attention launch (kernels nn_attention_d128_*). `o` gets `[batch][num_queries][num_heads *
/// 128]` with `o_strides`.
pub fn plan_attention<'a>(
    tile: AttentionTile,
    shape: AttentionShape,
    inputs: &AttentionInputs<'a, '_>,
    o: &'a DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "attention";
    let s = shape;
    let checked = check_attention_call(tile.head_dim(), shape, inputs, o, o_strides)?;
    let mut args = Args::new();
    args.push_addr(inputs.q.addr())
        .push(to_i64(OP, "q batch stride", inputs.q_strides.batch)?)
        .push(to_i32(OP, "q row stride", inputs.q_strides.row)?);
    push_kv_operands(&mut args, OP, s, inputs, &checked)?;
    args.push_addr(o.addr())
        .push(to_i64(OP, "o batch stride", o_strides.batch)?)
        .push(to_i32(OP, "o row stride", o_strides.row)?)
        .push(to_i32(OP, "num_queries", s.num_queries)?)
        .push(to_i32(OP, "num_keys", s.num_keys)?)
        .push(to_i32(OP, "num_heads", s.num_heads)?)
        .push(to_i32(OP, "num_kv_heads", s.num_kv_heads)?)
        .push_addr(checked.limit_addr)
        .push(to_i64(OP, "key_limit batch stride", checked.limit_stride)?)
        .push_addr(checked.pad_addr)
        .push(inputs.scale * std::f32::consts::LOG2_E);
    let grid = (
        to_u32(
            OP,
            "query tiles",
            s.num_queries.div_ceil(tile.rows() as usize),
        )?,
        to_u32(OP, "heads", s.num_heads)?,
        to_u32(OP, "batch", s.batch)?,
    );
    Ok(Launch::new(
        tile.kernel(),
        LaunchConfig::new(grid, tile.warps() * 32).with_shared(tile.shared_bytes()),
        args,
    ))
}

/// [`plan_attention`] for [`AttentionTile::Sm90Tma`]: the same arguments followed by the five tensor maps the
/// kernel loads through (q, k, v, k prefix, v prefix; the current k/v stand in for an absent prefix).
/// [`plan_attention`]'s operand rules (16-byte aligned bases, strides in multiples of 8 elements) are the ones
/// TMA needs, so every operand it accepts can be mapped.
pub fn plan_attention_tma<'a>(
    ctx: &Context,
    shape: AttentionShape,
    inputs: &AttentionInputs<'a, '_>,
    o: &'a DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let mut launch = plan_attention(AttentionTile::Sm90Tma, shape, inputs, o, o_strides)?;
    let tiles = |base: u64, width: usize, rows: usize, strides: Strides| Bf16Tiles {
        base,
        cols: width as u64,
        // A tensor of no rows (every key cached) is never read; the driver wants at least one.
        rows: rows.max(1) as u64,
        batch: shape.batch as u64,
        row_stride_bytes: (strides.row * BF16) as u64,
        batch_stride_bytes: (strides.batch * BF16) as u64,
        box_cols: 64,
        box_rows: 128,
    };
    let q_width = shape.num_heads * HEAD_DIM;
    let kv_width = shape.num_kv_heads * HEAD_DIM;
    let current = shape.num_keys - shape.prefix_len;
    let (k, v) = (inputs.k.addr(), inputs.v.addr());
    let (kp, vp, prefix_rows, prefix_strides) = match inputs.prefix {
        Some((kp, vp, strides)) => (kp.addr(), vp.addr(), shape.prefix_len, strides),
        None => (k, v, current, inputs.kv_strides),
    };
    let specs = [
        tiles(
            inputs.q.addr(),
            q_width,
            shape.num_queries,
            inputs.q_strides,
        ),
        tiles(k, kv_width, current, inputs.kv_strides),
        tiles(v, kv_width, current, inputs.kv_strides),
        tiles(kp, kv_width, prefix_rows, prefix_strides),
        tiles(vp, kv_width, prefix_rows, prefix_strides),
    ];
    for spec in &specs {
        launch.args.push(encode_bf16_tiles(ctx, spec)?.words());
    }
    Ok(launch)
}

/// Per-query key limits for the attention kernel from the block-causal rule of the host reference
/// ([`crate::nn::host::AttentionMask`]): query `i` sits at key position `q_offset + i`; it sees keys `k <= q_pos`
/// and every key of its own image block (`block_ids[q_pos] >= 0`). Blocks must be contiguous runs of one id; the
/// result is `limit[i]` = one past the last key query `i` sees (the mask is then exactly `k < limit[i]`).
pub fn key_limits_from_blocks(
    block_ids: &[i32],
    q_offset: usize,
    num_queries: usize,
) -> Result<Vec<i32>, tf_cuda::Error> {
    const OP: &str = "key_limits_from_blocks";
    let end = q_offset
        .checked_add(num_queries)
        .filter(|&e| e <= block_ids.len())
        .ok_or_else(|| {
            invalid(
                OP,
                format!(
                    "queries {q_offset}..+{num_queries} run past {} keys",
                    block_ids.len()
                ),
            )
        })?;
    // One past the last position of the block that starts at or contains each position.
    let mut block_end = vec![0usize; block_ids.len()];
    let mut next = block_ids.len();
    for pos in (0..block_ids.len()).rev() {
        if pos + 1 < block_ids.len() && block_ids[pos + 1] != block_ids[pos] {
            next = pos + 1;
        }
        block_end[pos] = next;
    }
    let mut seen = std::collections::HashSet::new();
    for (pos, &id) in block_ids.iter().enumerate() {
        if id >= 0 && (pos == 0 || block_ids[pos - 1] != id) && !seen.insert(id) {
            return Err(invalid(
                OP,
                format!("image block {id} is not one contiguous run of keys"),
            ));
        }
    }
    (q_offset..end)
        .map(|pos| {
            let limit = if block_ids[pos] >= 0 {
                block_end[pos]
            } else {
                pos + 1
            };
            to_i32(OP, "key limit", limit)
        })
        .collect()
}

/// The key-padding range `[begin, end)` of a validity mask, for the attention kernel: `None` when every key is
/// valid; an error when the invalid keys are not one contiguous range.
pub fn key_pad_from_valid(key_valid: &[bool]) -> Result<Option<(i32, i32)>, tf_cuda::Error> {
    const OP: &str = "key_pad_from_valid";
    let Some(begin) = key_valid.iter().position(|&v| !v) else {
        return Ok(None);
    };
    let end = key_valid.iter().rposition(|&v| !v).map_or(begin, |p| p + 1);
    if key_valid[begin..end].iter().any(|&v| v) {
        return Err(invalid(
            OP,
            "the padded keys are not one contiguous range; the kernel takes one [begin, end) range per sample",
        ));
    }
    Ok(Some((
        to_i32(OP, "pad begin", begin)?,
        to_i32(OP, "pad end", end)?,
    )))
}

/// FLOPs of one head-dim-128 attention call (the 4 * q * k * d * heads * batch convention; masked work
/// included).
pub fn attention_flops(shape: AttentionShape) -> f64 {
    4.0 * shape.batch as f64
        * shape.num_heads as f64
        * shape.num_queries as f64
        * shape.num_keys as f64
        * HEAD_DIM as f64
}

impl NnKernels {
    /// True when the attention kernel of `tile` fits this GPU.
    pub fn has_tile(&self, tile: AttentionTile) -> bool {
        self.set.has(tile.kernel())
    }

    /// The head-dim-128 tile shape [`Self::attention`] uses: the warp-specialised wgmma kernel with TMA loads where
    /// it is loaded (sm_90), else the mma.sync fallback [`AttentionTile::default`].
    pub fn preferred_tile(&self) -> AttentionTile {
        if self.has_tile(AttentionTile::Sm90Tma) {
            AttentionTile::Sm90Tma
        } else {
            AttentionTile::default()
        }
    }

    /// Flash attention with the preferred tile shape; see [`plan_attention`].
    pub fn attention(
        &self,
        stream: &Stream,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_, '_>,
        o: &mut DeviceViewMut<'_>,
        o_strides: Strides,
    ) -> Result<(), tf_cuda::Error> {
        self.attention_with(stream, self.preferred_tile(), shape, inputs, o, o_strides)
    }

    /// Flash attention at head dim 64 (no wgmma variant: the mma.sync kernel on every GPU); the operands are as
    /// [`Self::attention`]'s with 64 channels per head.
    pub fn attention_d64(
        &self,
        stream: &Stream,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_, '_>,
        o: &mut DeviceViewMut<'_>,
        o_strides: Strides,
    ) -> Result<(), tf_cuda::Error> {
        self.attention_with(stream, AttentionTile::D64W8S2, shape, inputs, o, o_strides)
    }

    /// Flash attention with an explicit tile shape (benchmarks compare them; the tile fixes the head dim).
    pub fn attention_with(
        &self,
        stream: &Stream,
        tile: AttentionTile,
        shape: AttentionShape,
        inputs: &AttentionInputs<'_, '_>,
        o: &mut DeviceViewMut<'_>,
        o_strides: Strides,
    ) -> Result<(), tf_cuda::Error> {
        let launch = if tile == AttentionTile::Sm90Tma {
            plan_attention_tma(&stream.context(), shape, inputs, o, o_strides)?
        } else {
            plan_attention(tile, shape, inputs, o, o_strides)?
        };
        self.submit(stream, &launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The TMA launch on the test driver (host memory; its cuTensorMapEncodeTiled checks the driver's rules): bad
    /// operands are refused by the common checks before any map is made; good ones pack the kernel's arguments with
    /// its five tensor maps last, and a driver refusal names the entry point.
    #[test]
    fn tma_attention_checks_operands_then_asks_the_driver_for_maps() {
        use std::sync::Arc;
        let _serial = tf_testdriver::test_lock();
        let path = tf_testdriver::library_path().expect("find the test driver");
        let driver = Arc::new(tf_cuda::Driver::open_path(&path).expect("open it"));
        let ctx = Context::new(driver, 0).expect("context on device 0");
        let (heads, rows) = (2usize, 40usize);
        let width = heads * HEAD_DIM;
        let plan = |row: usize| {
            let buf = |n: usize| tf_cuda::DeviceBuffer::alloc(&ctx, n * row * BF16).expect("alloc");
            let (q, k, v, mut o) = (buf(rows), buf(rows), buf(rows), buf(rows));
            let (qv, kv, vv) = (q.view(), k.view(), v.view());
            let strides = Strides {
                batch: rows * row,
                row,
            };
            let inputs = AttentionInputs {
                q: &qv,
                q_strides: strides,
                prefix: None,
                k: &kv,
                v: &vv,
                kv_strides: strides,
                key_limit: None,
                key_pad: None,
                scale: 0.125,
            };
            let shape = AttentionShape {
                batch: 1,
                num_queries: rows,
                num_keys: rows,
                prefix_len: 0,
                num_heads: heads,
                num_kv_heads: heads,
            };
            let o_strides = Strides {
                batch: rows * width,
                row: width,
            };
            plan_attention_tma(&ctx, shape, &inputs, &o.view_mut(), o_strides)
                .map(|l| (l.kernel, l.args.sizes().to_vec()))
        };
        // Rows 4 elements longer than the heads: strides TMA (and every attention kernel) cannot step by.
        let err = plan(width + 4).expect_err("strides of 260 elements");
        assert!(err.to_string().contains("multiples of 8 elements"), "{err}");
        // Good operands: the TMA kernel, its five maps (128 bytes each) the last arguments.
        let (kernel, sizes) = plan(width).expect("valid operands");
        assert_eq!(kernel, AttentionTile::Sm90Tma.kernel());
        assert!(sizes.len() > 5, "{sizes:?}");
        assert!(
            sizes[sizes.len() - 5..].iter().all(|&b| b == 128),
            "{sizes:?}"
        );
        // A refusal from the driver names the entry point.
        let control = tf_testdriver::Control::open().expect("the test driver's controls");
        assert!(control.fail_call("cuTensorMapEncodeTiled", 1, 1, 1));
        let err = plan(width).expect_err("injected refusal");
        assert!(err.to_string().contains("cuTensorMapEncodeTiled"), "{err}");
    }

    #[test]
    fn tile_shared_memory_matches_the_kernel_layout() {
        // Q tile (16 rows per warp) plus K and V tiles of 64 keys per stage, 256 bytes per row.
        assert_eq!(AttentionTile::W8S2.shared_bytes(), (128 + 256) * 256);
        // Head dim 64: 128 bytes per row.
        assert_eq!(AttentionTile::D64W8S2.shared_bytes(), (128 + 256) * 128);
        assert_eq!(AttentionTile::D64W8S2.head_dim(), 64);
        assert_eq!(AttentionTile::D64W8S2.kernel(), "nn_attention_d64_w8s2");
        // The warp-specialised TMA kernel: 3 stages of 128-key K and V tiles, 12 warps of which 8 compute 128
        // query rows, 1 KiB of alignment slack.
        assert_eq!(
            AttentionTile::Sm90Tma.shared_bytes(),
            (128 + 768) * 256 + 1024
        );
        assert_eq!(AttentionTile::Sm90Tma.rows(), 128);
        assert_eq!(AttentionTile::Sm90Tma.warps() * 32, 384);
        for tile in AttentionTile::ALL {
            assert!(
                tile.shared_bytes() <= 227 * 1024,
                "{tile:?} must fit an sm_90 SM"
            );
            assert!(tile.kernel().starts_with("nn_attention_d128_"));
            assert_eq!(tile.head_dim(), HEAD_DIM);
        }
    }

    #[cfg(feature = "bench-kernels")]
    #[test]
    fn bench_tile_shared_memory_matches_the_kernel_layout() {
        assert_eq!(AttentionTile::W8S3.shared_bytes(), 131_072);
        assert_eq!(AttentionTile::W4S2.shared_bytes(), 81_920);
        assert_eq!(AttentionTile::W4S3.shared_bytes(), 114_688);
        // 128 query rows, 2 stages of 128-key K and V tiles, 1 KiB of alignment slack.
        assert_eq!(AttentionTile::Sm90.shared_bytes(), (128 + 512) * 256 + 1024);
        assert_eq!(AttentionTile::Sm90.rows(), 128);
        assert_eq!(
            AttentionTile::Sm90Ws.shared_bytes(),
            AttentionTile::Sm90Tma.shared_bytes()
        );
        assert_eq!(AttentionTile::Sm90Ws.warps() * 32, 384);
    }

    #[test]
    fn key_pad_is_one_contiguous_range() {
        assert_eq!(key_pad_from_valid(&[true; 4]).unwrap(), None);
        assert_eq!(
            key_pad_from_valid(&[true, false, false, true]).unwrap(),
            Some((1, 3))
        );
        assert_eq!(key_pad_from_valid(&[false, true]).unwrap(), Some((0, 1)));
        assert!(key_pad_from_valid(&[false, true, false]).is_err());
    }

    #[test]
    fn key_limits_refuse_split_blocks() {
        assert!(key_limits_from_blocks(&[0, 0, -1, 0], 0, 4).is_err());
        assert!(key_limits_from_blocks(&[-1, -1], 1, 2).is_err());
        assert_eq!(
            key_limits_from_blocks(&[-1, -1, 3, 3, -1, 5, 5], 0, 7).unwrap(),
            [1, 2, 4, 4, 5, 7, 7]
        );
    }

    fn blocks() -> impl Strategy<Value = Vec<i32>> {
        // Runs of text (-1) and image blocks with fresh ids, in any order.
        proptest::collection::vec((any::<bool>(), 1usize..6), 1..8).prop_map(|runs| {
            let mut ids = Vec::new();
            for (i, (image, len)) in runs.into_iter().enumerate() {
                let id = if image { i as i32 } else { -1 };
                ids.extend(std::iter::repeat_n(id, len));
            }
            ids
        })
    }

    proptest! {
        /// `k < limit[q]` is exactly the host reference's block-causal visibility rule.
        #[test]
        fn key_limits_reproduce_the_block_causal_rule(ids in blocks(), offset_frac in 0.0f64..1.0) {
            let q_offset = ((ids.len() as f64) * offset_frac) as usize;
            let num_queries = ids.len() - q_offset;
            let limits = key_limits_from_blocks(&ids, q_offset, num_queries).unwrap();
            for (i, &limit) in limits.iter().enumerate() {
                let q_pos = q_offset + i;
                for (k, &kid) in ids.iter().enumerate() {
                    let same_block = ids[q_pos] >= 0 && kid == ids[q_pos];
                    let visible = k <= q_pos || same_block;
                    prop_assert_eq!((k as i32) < limit, visible, "q {} k {} ids {:?}", q_pos, k, &ids);
                }
            }
        }

        /// The padding range covers exactly the invalid keys.
        #[test]
        fn key_pad_covers_exactly_the_invalid_keys(len in 1usize..40, a in 0usize..40, b in 0usize..40) {
            let (lo, hi) = (a.min(b).min(len), a.max(b).min(len));
            let valid: Vec<bool> = (0..len).map(|k| !(lo..hi).contains(&k)).collect();
            let pad = key_pad_from_valid(&valid).unwrap();
            for (k, &v) in valid.iter().enumerate() {
                let padded = pad.is_some_and(|(b, e)| (b as usize..e as usize).contains(&k));
                prop_assert_eq!(padded, !v);
            }
        }
    }

    /// Head dim 64: the operands are checked at 64 channels per head and the d64 kernel is named.
    #[test]
    fn d64_attention_plans_at_64_channels_per_head() {
        let _serial = tf_testdriver::test_lock();
        let ctx = crate::nn::gpu::test_support::context();
        let (heads, rows) = (32usize, 20usize);
        let width = heads * 64;
        let buf = |n: usize| crate::nn::gpu::test_support::buffer(&ctx, n);
        let (q, k, v, mut o) = (
            buf(rows * width * BF16),
            buf(rows * width * BF16),
            buf(rows * width * BF16),
            buf(rows * width * BF16),
        );
        let (qv, kv, vv, ov) = (q.view(), k.view(), v.view(), o.view_mut());
        let strides = Strides {
            batch: rows * width,
            row: width,
        };
        let inputs = AttentionInputs::self_attention(&qv, &kv, &vv, strides, 0.125);
        let shape = AttentionShape {
            batch: 1,
            num_queries: rows,
            num_keys: rows,
            prefix_len: 0,
            num_heads: heads,
            num_kv_heads: heads,
        };
        let launch = plan_attention(AttentionTile::D64W8S2, shape, &inputs, &ov, strides).unwrap();
        assert_eq!(launch.kernel, "nn_attention_d64_w8s2");
        assert_eq!(
            launch.config.shared_bytes,
            AttentionTile::D64W8S2.shared_bytes()
        );
        assert_eq!((launch.config.grid.x, launch.config.grid.y), (1, 32));
        // The same buffers hold only half of what 32 heads of 128 need.
        let err = plan_attention(AttentionTile::W8S2, shape, &inputs, &ov, strides).unwrap_err();
        assert!(err.to_string().contains("row stride"), "{err}");
    }
}
