//! GPU launchers for the Qwen-Image DiT kernels (`kernels/qwen_image/*.cu`).
//!
//! One safe function per kernel. Each takes device views, the shapes that describe them, and a stream;
//! it checks every shape, stride, size and alignment against the views *before* anything reaches the
//! driver, then launches asynchronously on the stream. Failures are [`tf_cuda::Error`]s: validation
//! problems are [`tf_cuda::Error::Invalid`] naming the operand and the fix.
//!
//! Conventions shared by all launchers:
//! - Activations are bf16 matrices in row-major order described by a [`Matrix`] (rows, cols, and the
//!   element stride between rows, so a launcher can read a column slice of a wider buffer such as the fused
//!   qkv GEMM output).
//! - Row kernels move 16 bytes at a time: device addresses must be 16-byte aligned and column counts and
//!   strides multiples of 8 elements.
//! - Attention uses the token-major layout `[batch][token][head * 128 + d]` for q, k, v and o.
//!
//! Building a launch ([`Launch`]) is separate from submitting it, so the validation and the argument
//! packing are unit-tested without a GPU; [`QwenImageKernels`] holds the loaded kernels and submits.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: tf_cuda::DeviceView<'_>,
//! #         y: &mut tf_cuda::DeviceViewMut<'_>) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::nn::gpu::{Matrix, QwenImageKernels};
//! let kernels = QwenImageKernels::load(ctx)?;
//! let shape = Matrix::dense(16, 4096);
//! kernels.silu(stream, &x, y, shape.rows * shape.cols)?;
//! # Ok(()) }
//! ```

pub mod text;

use std::collections::HashMap;

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::tensor_map::{encode_bf16_tiles, Bf16Tiles};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Function, Module, Stream};

/// Name of the kernel set holding the elementwise and normalisation kernels.
pub const OPS_SET: &str = "qwen_image_ops";
/// Name of the kernel set holding the attention kernels.
pub const ATTENTION_SET: &str = "qwen_image_attention";

/// Threads per block of the row kernels (QI_ROW_THREADS in ops.cu).
const ROW_THREADS: u32 = 256;
/// Most columns a row-normalising kernel holds in registers (QI_ROW_THREADS * 8 * QI_ROW_CHUNKS).
pub const MAX_NORM_COLS: usize = 8192;
/// Head dimension the attention and QK-norm kernels are built for.
pub const HEAD_DIM: usize = 128;
/// bf16 size in bytes.
const BF16: usize = 2;

/// The kernels of both sets, by name.
const OPS_KERNELS: &[&str] = &[
    "qi_adaln_modulate",
    "qi_rms_norm_zc",
    "qi_gated_residual",
    "qi_gated_residual_adaln",
    "qi_swiglu",
    "qi_gelu_tanh",
    "qi_silu",
    "qi_timestep_embedding",
    "qi_qk_norm_rope",
    "qi_copy_rows",
    "qi_transpose",
];

/// Tile shape of the attention kernel: warps per CTA (16 query rows each) and cp.async stages of 64 keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionTile {
    /// 128 query rows, 8 warps, 2 stages (96 KiB shared memory). The default.
    #[default]
    W8S2,
    /// 128 query rows, 8 warps, 3 stages (128 KiB).
    W8S3,
    /// 64 query rows, 4 warps, 2 stages (80 KiB).
    W4S2,
    /// 64 query rows, 4 warps, 3 stages (112 KiB).
    W4S3,
    /// sm_90a only: 128 query rows in two warpgroups, wgmma, keys in tiles of 128 through 2 stages (161 KiB).
    Sm90,
    /// sm_90a only, warp-specialised: a producer warpgroup fills a 3-stage ring of 128-key tiles (mbarriers)
    /// while two consumer warpgroups take turns on the tensor cores, so one's softmax overlaps the other's
    /// GEMMs (225 KiB, 384 threads). Bit-identical to [`AttentionTile::Sm90`].
    Sm90Ws,
    /// [`AttentionTile::Sm90Ws`] loading through TMA tensor maps (one producer thread, 128-row boxes in the
    /// 128-byte swizzle). The cached prefix is tiled on its own, so with a prefix that is not a multiple of 128
    /// keys it rounds differently from the other 128-key tiles (see [`AttentionTile::reduction_order`]).
    Sm90Tma,
}

impl AttentionTile {
    /// Every tile shape, for benchmarks.
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
        matches!(
            self,
            AttentionTile::Sm90 | AttentionTile::Sm90Ws | AttentionTile::Sm90Tma
        )
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
            AttentionTile::W8S2 => "qi_attention_d128_w8s2",
            AttentionTile::W8S3 => "qi_attention_d128_w8s3",
            AttentionTile::W4S2 => "qi_attention_d128_w4s2",
            AttentionTile::W4S3 => "qi_attention_d128_w4s3",
            AttentionTile::Sm90 => "qi_attention_d128_sm90",
            AttentionTile::Sm90Ws => "qi_attention_d128_sm90_ws",
            AttentionTile::Sm90Tma => "qi_attention_d128_sm90_tma",
        }
    }

    /// Warps per CTA (the warp-specialised kernel adds a producer warpgroup to its 8 computing warps).
    pub fn warps(self) -> u32 {
        match self {
            AttentionTile::W8S2 | AttentionTile::W8S3 | AttentionTile::Sm90 => 8,
            AttentionTile::Sm90Ws | AttentionTile::Sm90Tma => 12,
            AttentionTile::W4S2 | AttentionTile::W4S3 => 4,
        }
    }

    /// cp.async stages.
    pub fn stages(self) -> u32 {
        match self {
            AttentionTile::W8S2 | AttentionTile::W4S2 | AttentionTile::Sm90 => 2,
            AttentionTile::W8S3
            | AttentionTile::W4S3
            | AttentionTile::Sm90Ws
            | AttentionTile::Sm90Tma => 3,
        }
    }

    /// Query rows per CTA (16 per computing warp).
    pub fn rows(self) -> u32 {
        match self {
            AttentionTile::Sm90Ws | AttentionTile::Sm90Tma => 128,
            _ => self.warps() * 16,
        }
    }

    /// Dynamic shared memory: the Q tile plus `stages` K and V tiles, 256 bytes per row (the sm_90 kernel adds
    /// 1 KiB to align its tiles to the 1024-byte swizzle pattern).
    pub fn shared_bytes(self) -> u32 {
        let rows = self.rows() + 2 * self.keys_per_tile() * self.stages();
        let align = if self.needs_sm90() { 1024 } else { 0 };
        rows * (HEAD_DIM * BF16) as u32 + align
    }
}

/// A bf16 matrix inside a device buffer: `rows` x `cols` elements, `stride` elements from one row to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl Matrix {
    /// A dense matrix (stride = cols).
    pub fn dense(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            stride: cols,
        }
    }

    /// The same rows and columns at another row stride (an output laid out like an input).
    pub fn with_stride(self, stride: usize) -> Matrix {
        Matrix { stride, ..self }
    }

    /// Bytes from the first element to one past the last one (0 for an empty matrix).
    fn span_bytes(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.stride)?
            .checked_add(self.cols)?
            .checked_mul(BF16)
    }
}

/// Which modulation row each token uses (the DiT's rule): tokens come in samples of `seq_len`; a token at
/// position >= `target_begin` in its sample uses row `sample`, every other token (text, condition images)
/// the t = 0 row `prefix_row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModulationRows {
    pub seq_len: usize,
    pub target_begin: usize,
    pub prefix_row: usize,
}

impl ModulationRows {
    /// Every token is a target token of its sample (the cached-prefix step).
    pub fn targets_only(seq_len: usize) -> ModulationRows {
        ModulationRows {
            seq_len,
            target_begin: 0,
            prefix_row: 0,
        }
    }

    /// The modulation row of token `row` (the same rule as the kernels).
    pub fn row_of(&self, row: usize) -> usize {
        let seq = self.seq_len.max(1);
        if row % seq >= self.target_begin {
            row / seq
        } else {
            self.prefix_row
        }
    }
}

/// A column block of the modulation tensor: `rows` modulation rows of `stride` bf16 elements; the block starts
/// at column `offset` (e.g. scale1 = 0, gate1 = D, scale2 = 2D, gate2 = 3D in the shared `[s1|g1|s2|g2]` layout).
#[derive(Clone, Copy, Debug)]
pub struct Modulation<'v, 'a> {
    pub data: &'v DeviceView<'a>,
    pub rows: usize,
    pub stride: usize,
    pub offset: usize,
}

/// Inputs of the fused QK-norm + RoPE kernel.
#[derive(Clone, Copy, Debug)]
pub struct QkvInputs<'v, 'a> {
    /// The fused qkv GEMM output: `rows` x (3 * heads * 128) (q | k | v), any row stride.
    pub qkv: &'v DeviceView<'a>,
    pub qkv_layout: Matrix,
    pub heads: usize,
    /// RMSNorm weights (bf16, 128 each).
    pub q_weight: &'v DeviceView<'a>,
    pub k_weight: &'v DeviceView<'a>,
    pub eps: f32,
    /// Rotation tables, f32 `[rows, rope_stride]` with 64 used columns: the angle of pair p of token r.
    pub rope_cos: &'v DeviceView<'a>,
    pub rope_sin: &'v DeviceView<'a>,
    pub rope_stride: usize,
}

/// Output rows of the QK-norm + RoPE kernel (row strides in elements; each holds `rows` x heads * 128).
#[derive(Debug)]
pub struct QkvOutputs<'v, 'a> {
    pub q: &'v mut DeviceViewMut<'a>,
    pub q_stride: usize,
    pub k: &'v mut DeviceViewMut<'a>,
    pub k_stride: usize,
    pub v: &'v mut DeviceViewMut<'a>,
    pub v_stride: usize,
}

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

/// The operands of one attention call (see `kernels/qwen_image/attention.cu`).
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

/// A device operand as the validation sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operand {
    pub(crate) addr: u64,
    pub(crate) bytes: usize,
}

impl Operand {
    pub(crate) fn of(view: &DeviceView<'_>) -> Operand {
        Operand {
            addr: view.addr(),
            bytes: view.len(),
        }
    }
    pub(crate) fn of_mut(view: &DeviceViewMut<'_>) -> Operand {
        Operand {
            addr: view.addr(),
            bytes: view.len(),
        }
    }
}

/// One kernel launch, validated and packed, not yet submitted.
#[derive(Debug)]
pub struct Launch {
    pub kernel: &'static str,
    pub config: LaunchConfig,
    pub args: Args,
}

pub(crate) fn invalid(op: &str, what: impl std::fmt::Display) -> tf_cuda::Error {
    tf_cuda::Error::Invalid {
        what: format!("{op}: {what}"),
    }
}

pub(crate) fn to_i32(op: &str, name: &str, value: usize) -> Result<i32, tf_cuda::Error> {
    i32::try_from(value).map_err(|_| {
        invalid(
            op,
            format!("{name} = {value} does not fit the kernel's 32-bit int"),
        )
    })
}

fn to_i64(op: &str, name: &str, value: usize) -> Result<i64, tf_cuda::Error> {
    i64::try_from(value)
        .map_err(|_| invalid(op, format!("{name} = {value} does not fit a 64-bit int")))
}

pub(crate) fn to_u32(op: &str, name: &str, value: usize) -> Result<u32, tf_cuda::Error> {
    u32::try_from(value).map_err(|_| {
        invalid(
            op,
            format!("{name} = {value} exceeds the launch grid limits"),
        )
    })
}

/// Checks a bf16 matrix operand: fits the view, 16-byte aligned address, cols and stride multiples of 8,
/// stride >= cols.
pub(crate) fn check_matrix(
    op: &str,
    name: &str,
    operand: Operand,
    m: Matrix,
) -> Result<(), tf_cuda::Error> {
    if m.stride < m.cols {
        return Err(invalid(
            op,
            format!(
                "{name}: row stride {} is less than its {} columns",
                m.stride, m.cols
            ),
        ));
    }
    if !m.cols.is_multiple_of(8) || !m.stride.is_multiple_of(8) {
        return Err(invalid(
            op,
            format!(
                "{name}: columns ({}) and row stride ({}) must be multiples of 8 elements (16-byte rows)",
                m.cols, m.stride
            ),
        ));
    }
    check_aligned(op, name, operand)?;
    let span = m
        .span_bytes()
        .ok_or_else(|| invalid(op, format!("{name}: {m:?} overflows the address space")))?;
    if span > operand.bytes {
        return Err(invalid(
            op,
            format!(
                "{name}: {} x {} bf16 with row stride {} needs {span} B but the view holds {} B",
                m.rows, m.cols, m.stride, operand.bytes
            ),
        ));
    }
    Ok(())
}

fn check_aligned(op: &str, name: &str, operand: Operand) -> Result<(), tf_cuda::Error> {
    check_aligned_to(op, name, operand, 16)
}

/// Refuses an operand whose device address is not a multiple of `align` bytes.
pub(crate) fn check_aligned_to(
    op: &str,
    name: &str,
    operand: Operand,
    align: u64,
) -> Result<(), tf_cuda::Error> {
    if !operand.addr.is_multiple_of(align) {
        return Err(invalid(
            op,
            format!(
                "{name}: device address {:#x} is not {align}-byte aligned",
                operand.addr
            ),
        ));
    }
    Ok(())
}

pub(crate) fn check_bytes(
    op: &str,
    name: &str,
    operand: Operand,
    needed: usize,
) -> Result<(), tf_cuda::Error> {
    if needed > operand.bytes {
        return Err(invalid(
            op,
            format!(
                "{name}: needs {needed} B but the view holds {} B",
                operand.bytes
            ),
        ));
    }
    Ok(())
}

fn row_grid(op: &str, rows: usize, cols: usize) -> Result<LaunchConfig, tf_cuda::Error> {
    let chunks = cols.div_ceil(8).div_ceil(ROW_THREADS as usize).max(1);
    Ok(LaunchConfig::new(
        (
            to_u32(op, "rows", rows.max(1))?,
            to_u32(op, "column blocks", chunks)?,
        ),
        ROW_THREADS,
    ))
}

fn check_modulation(
    op: &str,
    modulation: &Modulation<'_, '_>,
    cols: usize,
    rows: usize,
    select: ModulationRows,
) -> Result<(), tf_cuda::Error> {
    if select.seq_len == 0 {
        return Err(invalid(op, "modulation rows: seq_len must be at least 1"));
    }
    if !rows.is_multiple_of(select.seq_len) {
        return Err(invalid(
            op,
            format!(
                "{rows} rows are not a whole number of samples of seq_len {}",
                select.seq_len
            ),
        ));
    }
    let samples = rows / select.seq_len;
    let needs_targets = select.target_begin < select.seq_len;
    let needs_prefix = select.target_begin > 0;
    if needs_targets && samples > modulation.rows {
        return Err(invalid(
            op,
            format!(
                "{samples} samples need as many modulation rows but only {} are given",
                modulation.rows
            ),
        ));
    }
    if needs_prefix && select.prefix_row >= modulation.rows {
        return Err(invalid(
            op,
            format!(
                "the t = 0 modulation row {} is outside the {} modulation rows",
                select.prefix_row, modulation.rows
            ),
        ));
    }
    if !modulation.offset.is_multiple_of(8) {
        return Err(invalid(
            op,
            format!(
                "modulation column offset {} must be a multiple of 8",
                modulation.offset
            ),
        ));
    }
    let block_end = modulation
        .offset
        .checked_add(cols)
        .ok_or_else(|| invalid(op, "modulation offset overflows"))?;
    if block_end > modulation.stride {
        return Err(invalid(
            op,
            format!(
                "modulation columns [{}, {block_end}) run past the row stride {}",
                modulation.offset, modulation.stride
            ),
        ));
    }
    check_matrix(
        op,
        "modulation",
        Operand::of(modulation.data),
        Matrix {
            rows: modulation.rows,
            cols: modulation.stride,
            stride: modulation.stride,
        },
    )
}

fn push_modulation(
    args: &mut Args,
    op: &str,
    modulation: &Modulation<'_, '_>,
) -> Result<(), tf_cuda::Error> {
    args.push_addr(modulation.data.addr())
        .push(to_i32(op, "modulation stride", modulation.stride)?)
        .push(to_i32(op, "modulation offset", modulation.offset)?);
    Ok(())
}

fn push_select(args: &mut Args, op: &str, select: ModulationRows) -> Result<(), tf_cuda::Error> {
    args.push(to_i32(op, "seq_len", select.seq_len)?)
        .push(to_i32(op, "target_begin", select.target_begin)?)
        .push(to_i32(op, "prefix_row", select.prefix_row)?);
    Ok(())
}

/// Builds `y = LayerNorm(x) * (1 + scale)` (kernel qi_adaln_modulate).
pub fn plan_adaln_modulate(
    x: &DeviceView<'_>,
    x_layout: Matrix,
    y: &DeviceViewMut<'_>,
    y_stride: usize,
    scale: &Modulation<'_, '_>,
    select: ModulationRows,
    eps: f32,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "adaln_modulate";
    let y_layout = x_layout.with_stride(y_stride);
    check_norm_cols(OP, x_layout.cols)?;
    check_matrix(OP, "x", Operand::of(x), x_layout)?;
    check_matrix(OP, "y", Operand::of_mut(y), y_layout)?;
    check_modulation(OP, scale, x_layout.cols, x_layout.rows, select)?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(OP, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(OP, "y stride", y_stride)?);
    push_modulation(&mut args, OP, scale)?;
    args.push(to_i32(OP, "rows", x_layout.rows)?)
        .push(to_i32(OP, "cols", x_layout.cols)?);
    push_select(&mut args, OP, select)?;
    args.push(eps);
    Ok(Launch {
        kernel: "qi_adaln_modulate",
        config: LaunchConfig::new(to_u32(OP, "rows", x_layout.rows.max(1))?, ROW_THREADS),
        args,
    })
}

fn check_norm_cols(op: &str, cols: usize) -> Result<(), tf_cuda::Error> {
    check_row_cols(op, cols, MAX_NORM_COLS)
}

fn check_row_cols(op: &str, cols: usize, max_cols: usize) -> Result<(), tf_cuda::Error> {
    if cols == 0 || cols > max_cols {
        return Err(invalid(
            op,
            format!("rows of {cols} columns: the kernel normalises 8..={max_cols} columns"),
        ));
    }
    Ok(())
}

/// A row norm with a per-column weight, one block of `threads` per row: operands checked, arguments packed as
/// `(x, x_stride, y, y_stride, weight, rows, cols, eps)` (the zero-centred DiT norm and the Qwen3 text norm).
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_weighted_row_norm(
    op: &'static str,
    kernel: &'static str,
    max_cols: usize,
    threads: u32,
    x: &DeviceView<'_>,
    x_layout: Matrix,
    y: &DeviceViewMut<'_>,
    y_stride: usize,
    weight: &DeviceView<'_>,
    eps: f32,
) -> Result<Launch, tf_cuda::Error> {
    check_row_cols(op, x_layout.cols, max_cols)?;
    check_matrix(op, "x", Operand::of(x), x_layout)?;
    check_matrix(op, "y", Operand::of_mut(y), x_layout.with_stride(y_stride))?;
    check_matrix(
        op,
        "weight",
        Operand::of(weight),
        Matrix::dense(1, x_layout.cols),
    )?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(op, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(op, "y stride", y_stride)?)
        .push_addr(weight.addr())
        .push(to_i32(op, "rows", x_layout.rows)?)
        .push(to_i32(op, "cols", x_layout.cols)?)
        .push(eps);
    Ok(Launch {
        kernel,
        config: LaunchConfig::new(to_u32(op, "rows", x_layout.rows.max(1))?, threads),
        args,
    })
}

/// Builds the zero-centred RMSNorm `y = x * rsqrt(mean(x^2) + eps) * (1 + weight)` (kernel qi_rms_norm_zc).
pub fn plan_rms_norm_zc(
    x: &DeviceView<'_>,
    x_layout: Matrix,
    y: &DeviceViewMut<'_>,
    y_stride: usize,
    weight: &DeviceView<'_>,
    eps: f32,
) -> Result<Launch, tf_cuda::Error> {
    plan_weighted_row_norm(
        "rms_norm_zc",
        "qi_rms_norm_zc",
        MAX_NORM_COLS,
        ROW_THREADS,
        x,
        x_layout,
        y,
        y_stride,
        weight,
        eps,
    )
}

/// Builds `x += tanh(gate) * y` in place on x (kernel qi_gated_residual).
pub fn plan_gated_residual(
    x: &DeviceViewMut<'_>,
    x_layout: Matrix,
    y: &DeviceView<'_>,
    y_stride: usize,
    gate: &Modulation<'_, '_>,
    select: ModulationRows,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "gated_residual";
    check_matrix(OP, "x", Operand::of_mut(x), x_layout)?;
    check_matrix(OP, "y", Operand::of(y), x_layout.with_stride(y_stride))?;
    check_modulation(OP, gate, x_layout.cols, x_layout.rows, select)?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(OP, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(OP, "y stride", y_stride)?);
    push_modulation(&mut args, OP, gate)?;
    args.push(to_i32(OP, "rows", x_layout.rows)?)
        .push(to_i32(OP, "cols", x_layout.cols)?);
    push_select(&mut args, OP, select)?;
    Ok(Launch {
        kernel: "qi_gated_residual",
        config: row_grid(OP, x_layout.rows, x_layout.cols)?,
        args,
    })
}

/// Builds the gated residual followed by the next adaLN in one pass (kernel qi_gated_residual_adaln):
/// `x += tanh(gate) * y` in place, then `out = LayerNorm(x) * (1 + scale)` from the stored (bf16) x. The result
/// is bit-identical to [`plan_gated_residual`] followed by [`plan_adaln_modulate`]. `gate` and `scale` must
/// name the same modulation rows (data, rows, stride) at two offsets.
#[allow(clippy::too_many_arguments)]
pub fn plan_gated_residual_adaln(
    x: &DeviceViewMut<'_>,
    x_layout: Matrix,
    y: &DeviceView<'_>,
    y_stride: usize,
    out: &DeviceViewMut<'_>,
    out_stride: usize,
    gate: &Modulation<'_, '_>,
    scale: &Modulation<'_, '_>,
    select: ModulationRows,
    eps: f32,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "gated_residual_adaln";
    check_norm_cols(OP, x_layout.cols)?;
    check_matrix(OP, "x", Operand::of_mut(x), x_layout)?;
    check_matrix(OP, "y", Operand::of(y), x_layout.with_stride(y_stride))?;
    check_matrix(
        OP,
        "out",
        Operand::of_mut(out),
        x_layout.with_stride(out_stride),
    )?;
    if gate.data.addr() != scale.data.addr()
        || gate.rows != scale.rows
        || gate.stride != scale.stride
    {
        return Err(invalid(
            OP,
            "gate and scale must be two column offsets of the same modulation rows",
        ));
    }
    check_modulation(OP, gate, x_layout.cols, x_layout.rows, select)?;
    check_modulation(OP, scale, x_layout.cols, x_layout.rows, select)?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(OP, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(OP, "y stride", y_stride)?)
        .push_addr(out.addr())
        .push(to_i32(OP, "out stride", out_stride)?)
        .push_addr(gate.data.addr())
        .push(to_i32(OP, "modulation stride", gate.stride)?)
        .push(to_i32(OP, "gate offset", gate.offset)?)
        .push(to_i32(OP, "scale offset", scale.offset)?)
        .push(to_i32(OP, "rows", x_layout.rows)?)
        .push(to_i32(OP, "cols", x_layout.cols)?);
    push_select(&mut args, OP, select)?;
    args.push(eps);
    Ok(Launch {
        kernel: "qi_gated_residual_adaln",
        config: LaunchConfig::new(to_u32(OP, "rows", x_layout.rows.max(1))?, ROW_THREADS),
        args,
    })
}

/// Builds `out = silu(gate) * up` from a fused `[gate | up]` matrix of 2 * hidden columns (kernel qi_swiglu).
pub fn plan_swiglu(
    gate_up: &DeviceView<'_>,
    gate_up_layout: Matrix,
    out: &DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "swiglu";
    if !gate_up_layout.cols.is_multiple_of(16) {
        return Err(invalid(
            OP,
            format!(
                "gate|up has {} columns: it must be 2 * hidden with hidden a multiple of 8",
                gate_up_layout.cols
            ),
        ));
    }
    let hidden = gate_up_layout.cols / 2;
    check_matrix(OP, "gate_up", Operand::of(gate_up), gate_up_layout)?;
    check_matrix(
        OP,
        "out",
        Operand::of_mut(out),
        Matrix {
            rows: gate_up_layout.rows,
            cols: hidden,
            stride: out_stride,
        },
    )?;
    let mut args = Args::new();
    args.push_addr(gate_up.addr())
        .push(to_i32(OP, "gate_up stride", gate_up_layout.stride)?)
        .push_addr(out.addr())
        .push(to_i32(OP, "out stride", out_stride)?)
        .push(to_i32(OP, "rows", gate_up_layout.rows)?)
        .push(to_i32(OP, "hidden", hidden)?);
    Ok(Launch {
        kernel: "qi_swiglu",
        config: row_grid(OP, gate_up_layout.rows, hidden)?,
        args,
    })
}

/// Builds an elementwise activation over `n` bf16 values (`kernel` is qi_gelu_tanh or qi_silu); `y` may be
/// a view of the same memory as `x`.
fn plan_elementwise(
    op: &'static str,
    kernel: &'static str,
    x: Operand,
    y: Operand,
    n: usize,
) -> Result<Launch, tf_cuda::Error> {
    check_aligned(op, "x", x)?;
    check_aligned(op, "y", y)?;
    let bytes = n
        .checked_mul(BF16)
        .ok_or_else(|| invalid(op, "n overflows"))?;
    check_bytes(op, "x", x, bytes)?;
    check_bytes(op, "y", y, bytes)?;
    let chunks = n.div_ceil(8);
    // Grid-stride kernel: enough blocks to fill the GPU, capped so huge n needs no huge grid.
    let blocks = chunks.div_ceil(ROW_THREADS as usize).clamp(1, 65_535);
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push_addr(y.addr)
        .push(to_i64(op, "n", n)?);
    Ok(Launch {
        kernel,
        config: LaunchConfig::new(to_u32(op, "blocks", blocks)?, ROW_THREADS),
        args,
    })
}

/// Builds the sinusoidal timestep embedding `[cos | sin]` of `batch` f32 timesteps into `[batch, dim]` bf16.
pub fn plan_timestep_embedding(
    t: &DeviceView<'_>,
    out: &DeviceViewMut<'_>,
    batch: usize,
    dim: usize,
    t_scale: f32,
    max_period: f32,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "timestep_embedding";
    if dim == 0 || !dim.is_multiple_of(2) || dim / 2 > 1024 {
        return Err(invalid(
            OP,
            format!("dim {dim} must be even and at most 2048"),
        ));
    }
    check_bytes(OP, "t", Operand::of(t), batch.saturating_mul(4))?;
    check_bytes(
        OP,
        "out",
        Operand::of_mut(out),
        batch.saturating_mul(dim).saturating_mul(BF16),
    )?;
    let mut args = Args::new();
    args.push_addr(t.addr())
        .push_addr(out.addr())
        .push(to_i32(OP, "batch", batch)?)
        .push(to_i32(OP, "dim", dim)?)
        .push(t_scale)
        .push(max_period);
    Ok(Launch {
        kernel: "qi_timestep_embedding",
        config: LaunchConfig::new(
            to_u32(OP, "batch", batch.max(1))?,
            to_u32(OP, "dim / 2", dim / 2)?,
        ),
        args,
    })
}

/// Builds the fused QK RMSNorm + RoPE + V copy (kernel qi_qk_norm_rope).
pub fn plan_qk_norm_rope(
    inputs: &QkvInputs<'_, '_>,
    outputs: &QkvOutputs<'_, '_>,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "qk_norm_rope";
    let rows = inputs.qkv_layout.rows;
    let width = inputs
        .heads
        .checked_mul(HEAD_DIM)
        .ok_or_else(|| invalid(OP, "heads overflow"))?;
    if inputs.heads == 0 || inputs.qkv_layout.cols != 3 * width {
        return Err(invalid(
            OP,
            format!(
                "qkv has {} columns; {} heads of {HEAD_DIM} need 3 * {width} (q | k | v)",
                inputs.qkv_layout.cols, inputs.heads
            ),
        ));
    }
    check_matrix(OP, "qkv", Operand::of(inputs.qkv), inputs.qkv_layout)?;
    check_matrix(
        OP,
        "q_weight",
        Operand::of(inputs.q_weight),
        Matrix::dense(1, HEAD_DIM),
    )?;
    check_matrix(
        OP,
        "k_weight",
        Operand::of(inputs.k_weight),
        Matrix::dense(1, HEAD_DIM),
    )?;
    if inputs.rope_stride < HEAD_DIM / 2 || !inputs.rope_stride.is_multiple_of(2) {
        return Err(invalid(
            OP,
            format!(
                "rope stride {} must be even and at least 64",
                inputs.rope_stride
            ),
        ));
    }
    let rope_bytes = if rows == 0 {
        0
    } else {
        ((rows - 1) * inputs.rope_stride + HEAD_DIM / 2) * 4
    };
    for (name, table) in [("rope_cos", inputs.rope_cos), ("rope_sin", inputs.rope_sin)] {
        let operand = Operand::of(table);
        if !operand.addr.is_multiple_of(8) {
            return Err(invalid(
                OP,
                format!(
                    "{name}: device address {:#x} is not 8-byte aligned",
                    operand.addr
                ),
            ));
        }
        check_bytes(OP, name, operand, rope_bytes)?;
    }
    for (name, view, stride) in [
        ("q", &*outputs.q, outputs.q_stride),
        ("k", &*outputs.k, outputs.k_stride),
        ("v", &*outputs.v, outputs.v_stride),
    ] {
        check_matrix(
            OP,
            name,
            Operand::of_mut(view),
            Matrix {
                rows,
                cols: width,
                stride,
            },
        )?;
    }
    let items = rows
        .checked_mul(inputs.heads)
        .ok_or_else(|| invalid(OP, "rows * heads overflows"))?;
    let mut args = Args::new();
    args.push_addr(inputs.qkv.addr())
        .push(to_i32(OP, "qkv stride", inputs.qkv_layout.stride)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "heads", inputs.heads)?)
        .push_addr(inputs.q_weight.addr())
        .push_addr(inputs.k_weight.addr())
        .push(inputs.eps)
        .push_addr(inputs.rope_cos.addr())
        .push_addr(inputs.rope_sin.addr())
        .push(to_i32(OP, "rope stride", inputs.rope_stride)?)
        .push_addr(outputs.q.addr())
        .push(to_i32(OP, "q stride", outputs.q_stride)?)
        .push_addr(outputs.k.addr())
        .push(to_i32(OP, "k stride", outputs.k_stride)?)
        .push_addr(outputs.v.addr())
        .push(to_i32(OP, "v stride", outputs.v_stride)?);
    Ok(Launch {
        kernel: "qi_qk_norm_rope",
        config: LaunchConfig::new(to_u32(OP, "blocks", items.div_ceil(8).max(1))?, 256),
        args,
    })
}

/// Builds a strided row copy of a `[rows, cols]` bf16 block (kernel qi_copy_rows).
pub fn plan_copy_rows(
    src: &DeviceView<'_>,
    src_layout: Matrix,
    dst: &DeviceViewMut<'_>,
    dst_stride: usize,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "copy_rows";
    check_matrix(OP, "src", Operand::of(src), src_layout)?;
    check_matrix(
        OP,
        "dst",
        Operand::of_mut(dst),
        Matrix {
            stride: dst_stride,
            ..src_layout
        },
    )?;
    let mut args = Args::new();
    args.push_addr(src.addr())
        .push(to_i32(OP, "src stride", src_layout.stride)?)
        .push_addr(dst.addr())
        .push(to_i32(OP, "dst stride", dst_stride)?)
        .push(to_i32(OP, "rows", src_layout.rows)?)
        .push(to_i32(OP, "cols", src_layout.cols)?);
    Ok(Launch {
        kernel: "qi_copy_rows",
        config: row_grid(OP, src_layout.rows, src_layout.cols)?,
        args,
    })
}

/// Builds the transpose of a dense `[rows, cols]` bf16 matrix into `[cols, rows]` (kernel qi_transpose).
pub fn plan_transpose(
    src: &DeviceView<'_>,
    dst: &DeviceViewMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "transpose";
    let bytes = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(BF16))
        .ok_or_else(|| invalid(OP, "rows * cols overflows"))?;
    check_bytes(OP, "src", Operand::of(src), bytes)?;
    check_bytes(OP, "dst", Operand::of_mut(dst), bytes)?;
    let mut args = Args::new();
    args.push_addr(src.addr())
        .push_addr(dst.addr())
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "cols", cols)?);
    Ok(Launch {
        kernel: "qi_transpose",
        config: LaunchConfig::new(
            (
                to_u32(OP, "column tiles", cols.div_ceil(32).max(1))?,
                to_u32(OP, "row tiles", rows.div_ceil(32).max(1))?,
            ),
            (32, 8),
        ),
        args,
    })
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

/// Builds one flash-attention launch (kernels qi_attention_d128_*). `o` gets `[batch][num_queries][num_heads *
/// 128]` with `o_strides`.
pub fn plan_attention(
    tile: AttentionTile,
    shape: AttentionShape,
    inputs: &AttentionInputs<'_, '_>,
    o: &DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<Launch, tf_cuda::Error> {
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
    let q_width = s.num_heads * HEAD_DIM;
    let kv_width = s.num_kv_heads * HEAD_DIM;
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
    let (kp, vp, prefix_strides) = match inputs.prefix {
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
    let mut args = Args::new();
    args.push_addr(inputs.q.addr())
        .push(to_i64(OP, "q batch stride", inputs.q_strides.batch)?)
        .push(to_i32(OP, "q row stride", inputs.q_strides.row)?)
        .push_addr(kp)
        .push_addr(vp)
        .push(to_i64(OP, "prefix batch stride", prefix_strides.batch)?)
        .push(to_i32(OP, "prefix row stride", prefix_strides.row)?)
        .push(to_i32(OP, "prefix_len", s.prefix_len)?)
        .push_addr(inputs.k.addr())
        .push_addr(inputs.v.addr())
        .push(to_i64(OP, "kv batch stride", inputs.kv_strides.batch)?)
        .push(to_i32(OP, "kv row stride", inputs.kv_strides.row)?)
        .push_addr(o.addr())
        .push(to_i64(OP, "o batch stride", o_strides.batch)?)
        .push(to_i32(OP, "o row stride", o_strides.row)?)
        .push(to_i32(OP, "num_queries", s.num_queries)?)
        .push(to_i32(OP, "num_keys", s.num_keys)?)
        .push(to_i32(OP, "num_heads", s.num_heads)?)
        .push(to_i32(OP, "num_kv_heads", s.num_kv_heads)?)
        .push_addr(limit_addr)
        .push(to_i64(OP, "key_limit batch stride", limit_stride)?)
        .push_addr(pad_addr)
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
    Ok(Launch {
        kernel: tile.kernel(),
        config: LaunchConfig::new(grid, tile.warps() * 32).with_shared(tile.shared_bytes()),
        args,
    })
}

/// [`plan_attention`] for [`AttentionTile::Sm90Tma`]: the same arguments followed by the five tensor maps the
/// kernel loads through (q, k, v, k prefix, v prefix; the current k/v stand in for an absent prefix).
/// [`plan_attention`]'s operand rules (16-byte aligned bases, strides in multiples of 8 elements) are the ones
/// TMA needs, so every operand it accepts can be mapped.
pub fn plan_attention_tma(
    ctx: &Context,
    shape: AttentionShape,
    inputs: &AttentionInputs<'_, '_>,
    o: &DeviceViewMut<'_>,
    o_strides: Strides,
) -> Result<Launch, tf_cuda::Error> {
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

/// FLOPs of one attention call (the 4 * q * k * d * heads * batch convention; masked work included).
pub fn attention_flops(shape: AttentionShape) -> f64 {
    4.0 * shape.batch as f64
        * shape.num_heads as f64
        * shape.num_queries as f64
        * shape.num_keys as f64
        * HEAD_DIM as f64
}

/// Why the kernels could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadKernelsError {
    /// The fatbin was not built into this binary.
    #[error("kernel set {set} is not available: {reason}")]
    Missing { set: &'static str, reason: String },
    /// The driver refused the image or a kernel is absent from it.
    #[error("loading kernel set {set}: {source}")]
    Cuda {
        set: &'static str,
        #[source]
        source: tf_cuda::Error,
    },
}

/// One loaded kernel set: its module (which owns the code the functions point into) and every listed kernel
/// looked up, so a launch names its kernel by symbol.
pub(crate) struct LoadedSet {
    set: &'static str,
    _module: Module,
    functions: HashMap<&'static str, Function>,
}

impl std::fmt::Debug for LoadedSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedSet")
            .field("set", &self.set)
            .field("kernels", &self.functions.len())
            .finish()
    }
}

impl LoadedSet {
    /// Loads the embedded set `set` into `ctx` and looks up each of `kernels`.
    pub(crate) fn load(
        ctx: &Context,
        set: &'static str,
        kernels: &[&'static str],
    ) -> Result<LoadedSet, LoadKernelsError> {
        let image = crate::nn::kernels::image(set).map_err(|e| LoadKernelsError::Missing {
            set,
            reason: e.to_string(),
        })?;
        let cuda = |source| LoadKernelsError::Cuda { set, source };
        let module = Module::load(ctx, image).map_err(cuda)?;
        let mut functions = HashMap::new();
        for &name in kernels {
            functions.insert(name, module.function(name).map_err(cuda)?);
        }
        Ok(LoadedSet {
            set,
            _module: module,
            functions,
        })
    }

    /// Submits a launch of one of this set's kernels.
    pub(crate) fn submit(&self, stream: &Stream, launch: &Launch) -> Result<(), tf_cuda::Error> {
        let function = self.functions.get(launch.kernel).ok_or_else(|| {
            invalid(
                launch.kernel,
                format!(
                    "not a kernel of the {} set (or the set is stale: run `cargo xtask kernels`)",
                    self.set
                ),
            )
        })?;
        stream.launch(function, &launch.config, &launch.args)
    }
}

/// The loaded qwen_image kernel sets of one context, and the launchers.
pub struct QwenImageKernels {
    // The modules own the code the functions point into: kept alive with them.
    _ops: Module,
    _attention: Module,
    functions: HashMap<&'static str, Function>,
}

impl std::fmt::Debug for QwenImageKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenImageKernels")
            .field("kernels", &self.functions.len())
            .finish()
    }
}

impl QwenImageKernels {
    /// Loads both kernel sets into `ctx`, looks every kernel up, and opts the attention kernels in to the
    /// shared memory they use. A tile shape that does not fit this GPU's shared memory is left out (its
    /// launches then fail with a message naming it).
    pub fn load(ctx: &Context) -> Result<QwenImageKernels, LoadKernelsError> {
        let image = |set: &'static str| {
            crate::nn::kernels::image(set).map_err(|e| LoadKernelsError::Missing {
                set,
                reason: e.to_string(),
            })
        };
        let cuda = |set: &'static str| move |source| LoadKernelsError::Cuda { set, source };
        let ops = Module::load(ctx, image(OPS_SET)?).map_err(cuda(OPS_SET))?;
        let attention = Module::load(ctx, image(ATTENTION_SET)?).map_err(cuda(ATTENTION_SET))?;
        let mut functions = HashMap::new();
        for &name in OPS_KERNELS {
            functions.insert(name, ops.function(name).map_err(cuda(OPS_SET))?);
        }
        let sm90 = ctx
            .device_info()
            .map(|info| info.compute_capability == (9, 0))
            .unwrap_or(false);
        for tile in AttentionTile::ALL {
            if tile.needs_sm90() && !sm90 {
                continue;
            }
            let function = attention
                .function(tile.kernel())
                .map_err(cuda(ATTENTION_SET))?;
            if function.set_max_dynamic_shared(tile.shared_bytes()).is_ok() {
                functions.insert(tile.kernel(), function);
            }
        }
        Ok(QwenImageKernels {
            _ops: ops,
            _attention: attention,
            functions,
        })
    }

    /// True when the attention kernel of `tile` fits this GPU.
    pub fn has_tile(&self, tile: AttentionTile) -> bool {
        self.functions.contains_key(tile.kernel())
    }

    /// Submits a launch built by one of the `plan_*` functions.
    pub fn submit(&self, stream: &Stream, launch: &Launch) -> Result<(), tf_cuda::Error> {
        let function = self.functions.get(launch.kernel).ok_or_else(|| {
            invalid(
                launch.kernel,
                "kernel not loaded (its shared memory does not fit this GPU, or the kernel set is stale: \
                 run `cargo xtask kernels`)",
            )
        })?;
        stream.launch(function, &launch.config, &launch.args)
    }

    /// `y = LayerNorm(x) * (1 + scale)` with per-row modulation rows; see [`plan_adaln_modulate`].
    #[allow(clippy::too_many_arguments)]
    pub fn adaln_modulate(
        &self,
        stream: &Stream,
        x: &DeviceView<'_>,
        x_layout: Matrix,
        y: &mut DeviceViewMut<'_>,
        y_stride: usize,
        scale: &Modulation<'_, '_>,
        select: ModulationRows,
        eps: f32,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_adaln_modulate(x, x_layout, y, y_stride, scale, select, eps)?,
        )
    }

    /// Gated residual then adaLN in one pass; see [`plan_gated_residual_adaln`].
    #[allow(clippy::too_many_arguments)]
    pub fn gated_residual_adaln(
        &self,
        stream: &Stream,
        x: &mut DeviceViewMut<'_>,
        x_layout: Matrix,
        y: &DeviceView<'_>,
        y_stride: usize,
        out: &mut DeviceViewMut<'_>,
        out_stride: usize,
        gate: &Modulation<'_, '_>,
        scale: &Modulation<'_, '_>,
        select: ModulationRows,
        eps: f32,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_gated_residual_adaln(
                x, x_layout, y, y_stride, out, out_stride, gate, scale, select, eps,
            )?,
        )
    }

    /// Zero-centred RMSNorm; see [`plan_rms_norm_zc`].
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_zc(
        &self,
        stream: &Stream,
        x: &DeviceView<'_>,
        x_layout: Matrix,
        y: &mut DeviceViewMut<'_>,
        y_stride: usize,
        weight: &DeviceView<'_>,
        eps: f32,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_rms_norm_zc(x, x_layout, y, y_stride, weight, eps)?,
        )
    }

    /// `x += tanh(gate) * y`; see [`plan_gated_residual`].
    #[allow(clippy::too_many_arguments)]
    pub fn gated_residual(
        &self,
        stream: &Stream,
        x: &mut DeviceViewMut<'_>,
        x_layout: Matrix,
        y: &DeviceView<'_>,
        y_stride: usize,
        gate: &Modulation<'_, '_>,
        select: ModulationRows,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_gated_residual(x, x_layout, y, y_stride, gate, select)?,
        )
    }

    /// SwiGLU of a fused gate|up matrix; see [`plan_swiglu`].
    pub fn swiglu(
        &self,
        stream: &Stream,
        gate_up: &DeviceView<'_>,
        gate_up_layout: Matrix,
        out: &mut DeviceViewMut<'_>,
        out_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_swiglu(gate_up, gate_up_layout, out, out_stride)?,
        )
    }

    /// `y = gelu_tanh(x)` over `n` values.
    pub fn gelu_tanh(
        &self,
        stream: &Stream,
        x: &DeviceView<'_>,
        y: &mut DeviceViewMut<'_>,
        n: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_elementwise(
            "gelu_tanh",
            "qi_gelu_tanh",
            Operand::of(x),
            Operand::of_mut(y),
            n,
        )?;
        self.submit(stream, &launch)
    }

    /// `x = gelu_tanh(x)` in place over `n` values.
    pub fn gelu_tanh_inplace(
        &self,
        stream: &Stream,
        x: &mut DeviceViewMut<'_>,
        n: usize,
    ) -> Result<(), tf_cuda::Error> {
        let operand = Operand::of_mut(x);
        self.submit(
            stream,
            &plan_elementwise("gelu_tanh", "qi_gelu_tanh", operand, operand, n)?,
        )
    }

    /// `y = silu(x)` over `n` values.
    pub fn silu(
        &self,
        stream: &Stream,
        x: &DeviceView<'_>,
        y: &mut DeviceViewMut<'_>,
        n: usize,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan_elementwise("silu", "qi_silu", Operand::of(x), Operand::of_mut(y), n)?;
        self.submit(stream, &launch)
    }

    /// `x = silu(x)` in place over `n` values.
    pub fn silu_inplace(
        &self,
        stream: &Stream,
        x: &mut DeviceViewMut<'_>,
        n: usize,
    ) -> Result<(), tf_cuda::Error> {
        let operand = Operand::of_mut(x);
        self.submit(
            stream,
            &plan_elementwise("silu", "qi_silu", operand, operand, n)?,
        )
    }

    /// Timestep embedding; see [`plan_timestep_embedding`].
    #[allow(clippy::too_many_arguments)]
    pub fn timestep_embedding(
        &self,
        stream: &Stream,
        t: &DeviceView<'_>,
        out: &mut DeviceViewMut<'_>,
        batch: usize,
        dim: usize,
        t_scale: f32,
        max_period: f32,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_timestep_embedding(t, out, batch, dim, t_scale, max_period)?,
        )
    }

    /// QK RMSNorm + RoPE + V copy; see [`plan_qk_norm_rope`].
    pub fn qk_norm_rope(
        &self,
        stream: &Stream,
        inputs: &QkvInputs<'_, '_>,
        outputs: &mut QkvOutputs<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_qk_norm_rope(inputs, outputs)?)
    }

    /// Strided row copy; see [`plan_copy_rows`].
    pub fn copy_rows(
        &self,
        stream: &Stream,
        src: &DeviceView<'_>,
        src_layout: Matrix,
        dst: &mut DeviceViewMut<'_>,
        dst_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_copy_rows(src, src_layout, dst, dst_stride)?)
    }

    /// Transpose `[rows, cols]` -> `[cols, rows]`; see [`plan_transpose`].
    pub fn transpose(
        &self,
        stream: &Stream,
        src: &DeviceView<'_>,
        dst: &mut DeviceViewMut<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_transpose(src, dst, rows, cols)?)
    }

    /// The tile shape [`Self::attention`] uses: the warp-specialised wgmma kernel with TMA loads where it is
    /// loaded (sm_90), else the plain wgmma kernel, else [`AttentionTile::default`].
    pub fn preferred_tile(&self) -> AttentionTile {
        if self.has_tile(AttentionTile::Sm90Tma) {
            AttentionTile::Sm90Tma
        } else if self.has_tile(AttentionTile::Sm90Ws) {
            AttentionTile::Sm90Ws
        } else if self.has_tile(AttentionTile::Sm90) {
            AttentionTile::Sm90
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

    /// Flash attention with an explicit tile shape (benchmarks compare them).
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

    /// The TMA launch on the test driver (host memory; it has no cuTensorMapEncodeTiled): bad operands are refused
    /// by the common checks before any map is made; good ones ask the driver, whose missing entry point is named.
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
                .map(|l| (l.kernel, l.args.len()))
        };
        // Rows 4 elements longer than the heads: strides TMA (and every attention kernel) cannot step by.
        let err = plan(width + 4).expect_err("strides of 260 elements");
        assert!(err.to_string().contains("multiples of 8 elements"), "{err}");
        // Good operands reach the driver, which here lacks the entry point: the error names it.
        let err = plan(width).expect_err("the test driver has no TMA");
        assert!(err.to_string().contains("cuTensorMapEncodeTiled"), "{err}");
    }

    #[test]
    fn tile_shared_memory_matches_the_kernel_layout() {
        // Q tile (16 rows per warp) plus K and V tiles of 64 keys per stage, 256 bytes per row.
        assert_eq!(AttentionTile::W8S2.shared_bytes(), (128 + 256) * 256);
        assert_eq!(AttentionTile::W8S3.shared_bytes(), 131_072);
        assert_eq!(AttentionTile::W4S2.shared_bytes(), 81_920);
        assert_eq!(AttentionTile::W4S3.shared_bytes(), 114_688);
        // 128 query rows, 2 stages of 128-key K and V tiles, 1 KiB of alignment slack.
        assert_eq!(AttentionTile::Sm90.shared_bytes(), (128 + 512) * 256 + 1024);
        assert_eq!(AttentionTile::Sm90.rows(), 128);
        // The warp-specialised kernel: 3 stages, 12 warps of which 8 compute 128 query rows.
        assert_eq!(
            AttentionTile::Sm90Ws.shared_bytes(),
            (128 + 768) * 256 + 1024
        );
        assert_eq!(AttentionTile::Sm90Ws.rows(), 128);
        assert_eq!(AttentionTile::Sm90Ws.warps() * 32, 384);
        for tile in AttentionTile::ALL {
            assert!(
                tile.shared_bytes() <= 227 * 1024,
                "{tile:?} must fit an sm_90 SM"
            );
            assert!(tile.kernel().starts_with("qi_attention_d128_"));
        }
    }

    #[test]
    fn modulation_rows_follow_the_dit_rule() {
        let rule = ModulationRows {
            seq_len: 5,
            target_begin: 2,
            prefix_row: 7,
        };
        let rows: Vec<usize> = (0..10).map(|r| rule.row_of(r)).collect();
        assert_eq!(rows, [7, 7, 0, 0, 0, 7, 7, 1, 1, 1]);
        let cached = ModulationRows::targets_only(3);
        assert_eq!(
            (0..6).map(|r| cached.row_of(r)).collect::<Vec<_>>(),
            [0, 0, 0, 1, 1, 1]
        );
    }

    #[test]
    fn matrix_checks_refuse_what_the_kernels_cannot_read() {
        let op = Operand {
            addr: 0x1000,
            bytes: 4 * 64 * 2,
        };
        assert!(check_matrix("t", "x", op, Matrix::dense(4, 64)).is_ok());
        let too_small = check_matrix("t", "x", op, Matrix::dense(5, 64))
            .unwrap_err()
            .to_string();
        assert!(too_small.contains("needs 640 B"), "{too_small}");
        assert!(check_matrix(
            "t",
            "x",
            op,
            Matrix {
                rows: 2,
                cols: 60,
                stride: 64
            }
        )
        .is_err());
        assert!(check_matrix(
            "t",
            "x",
            op,
            Matrix {
                rows: 2,
                cols: 64,
                stride: 32
            }
        )
        .is_err());
        let unaligned = Operand { addr: 0x1008, ..op };
        assert!(check_matrix("t", "x", unaligned, Matrix::dense(1, 8)).is_err());
        // A column slice of a wider buffer: the last row only needs its used columns.
        assert!(check_matrix(
            "t",
            "x",
            Operand {
                addr: 0x1000,
                bytes: (3 * 96 + 32) * 2
            },
            Matrix {
                rows: 4,
                cols: 32,
                stride: 96
            }
        )
        .is_ok());
    }

    #[test]
    fn elementwise_plan_validates_sizes() {
        let x = Operand {
            addr: 0x2000,
            bytes: 2 * 1003,
        };
        let launch = plan_elementwise("silu", "qi_silu", x, x, 1003).unwrap();
        assert_eq!(launch.kernel, "qi_silu");
        assert_eq!(launch.args.len(), 3);
        assert_eq!(launch.args.get::<i64>(2), Some(1003));
        assert_eq!(launch.config.grid.x, 1);
        assert!(plan_elementwise("silu", "qi_silu", x, x, 1004).is_err());
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
}
