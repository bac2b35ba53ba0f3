//! The MiniMax H3 DiT's own kernels (`kernels/minimax_h3/dit.cu`, kernel set `minimax_h3_dit`): the gated
//! residual fused with the next RMSNorm and its adaLN modulation ([`plan_residual_norm`]), the per-head QK RMSNorm
//! with partial rotate-half RoPE on bf16 tables ([`plan_qk_norm_rope`]), and the f32 linear layers of the modules
//! the reference keeps in f32 ([`plan_linear_f32`]). Same conventions as [`crate::nn::gpu`]: one `plan_*` function
//! per kernel validates every operand and packs the arguments (unit-tested without a GPU); [`H3Kernels`] holds
//! these kernels beside the shared [`NnKernels`] and submits.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use crate::nn::fp8::RowCodes;
use crate::nn::gpu::launch::{check_aligned_to, check_bytes, check_operand};
use crate::nn::gpu::{
    check_matrix, invalid, to_i32, to_u32, Launch, LoadKernelsError, LoadedSet, Matrix, NnKernels,
    Operand, HEAD_DIM, MAX_NORM_COLS, ROW_THREADS,
};

/// Name of the kernel set.
pub const H3_SET: &str = "minimax_h3_dit";

const H3_KERNELS: &[&str] = &[
    "h3_residual_norm",
    "h3_qk_norm_rope",
    "h3_qk_norm_rope_shuffle",
    "h3_linear_f32_tile_xf_yf",
    "h3_linear_f32_tile_xf_yb",
    "h3_linear_f32_tile_xb_yf",
    "h3_linear_f32_rows_xf_yf",
    "h3_linear_f32_rows_xf_yb",
    "h3_linear_f32_rows_xb_yf",
    "h3_linear_fp8w_rows",
    "h3_linear_int8w_rows",
    "h3_linear_fp8w_rows_c1",
    "h3_linear_int8w_rows_c1",
    "h3_linear_fp8w_rows_c1t4",
    "h3_linear_int8w_rows_c1t4",
    "h3_linear_fp8w_rows_ring",
    "h3_linear_int8w_rows_ring",
];

/// The ring form's kernels: loaded only where they can run (sm_90 or newer, its shared memory opted in).
const RING_KERNELS: [&str; 2] = [H3_KERNELS[15], H3_KERNELS[16]];

/// Rows at most for which [`plan_linear_f32`] picks the few-rows kernel (one warp per output column).
pub const FEW_ROWS: usize = 8;

/// Rows of one per-row table (`rows` rows of `stride` bf16 elements) and the i32 index that picks each activation
/// row's table row. `data` starts at the first column used (the gate block, or the table's first column for
/// scale and shift offsets).
#[derive(Clone, Copy, Debug)]
pub struct RowTable<'v, 'a> {
    pub data: &'v DeviceView<'a>,
    pub rows: usize,
    pub stride: usize,
    /// One i32 per activation row (the kernel clamps each into `0..rows`; the caller checks them).
    pub index: &'v DeviceView<'a>,
}

/// The adaLN modulation after the norm: `* (1 + table[m, scale + c]) (+ table[m, shift + c])`.
#[derive(Clone, Copy, Debug)]
pub struct NormModulation<'v, 'a> {
    pub table: RowTable<'v, 'a>,
    pub scale_offset: usize,
    pub shift_offset: Option<usize>,
}

/// Operands of [`plan_residual_norm`]: `x (+= gate * y)` in place, then `out = RMSNorm(x) * weight` with an
/// optional modulation, written to `out` (scattered through `out_index` when given).
#[derive(Debug)]
pub struct ResidualNorm<'v, 'a> {
    /// The residual stream: `rows` x `cols` (padded width) with its stride.
    pub x: &'v DeviceViewMut<'a>,
    pub x_layout: Matrix,
    /// `(y, y_stride)`: added to x (times the gate) before the norm; `None`: x is normed as it is.
    pub residual: Option<(&'v DeviceView<'a>, usize)>,
    /// The gate's table, offset to the gate columns; `None`: gate 1 (a plain residual).
    pub gate: Option<RowTable<'v, 'a>>,
    /// The model's width: the mean square divides by it (columns past it are zero padding).
    pub norm_cols: usize,
    pub eps: f32,
    /// bf16 `[cols]`.
    pub weight: &'v DeviceView<'a>,
    pub modulation: Option<NormModulation<'v, 'a>>,
    pub out: &'v DeviceViewMut<'a>,
    pub out_stride: usize,
    /// `(index, out_rows)`: activation row r goes to row `index[r]` of an `out_rows`-row output.
    pub out_index: Option<(&'v DeviceView<'a>, usize)>,
}

fn check_index(
    op: &str,
    name: &str,
    index: &DeviceView<'_>,
    rows: usize,
) -> Result<(), tf_cuda::Error> {
    check_aligned_to(op, name, Operand::of(index), 4)?;
    let bytes = rows
        .checked_mul(4)
        .ok_or_else(|| invalid(op, format!("{name} size overflows")))?;
    check_bytes(op, name, Operand::of(index), bytes)
}

/// Checks a per-row table whose rows hold `cols` used columns starting at column `first`.
fn check_table(
    op: &str,
    name: &str,
    table: &RowTable<'_, '_>,
    first: usize,
    cols: usize,
    rows: usize,
) -> Result<(), tf_cuda::Error> {
    if table.rows == 0 {
        return Err(invalid(op, format!("{name}: the table has no rows")));
    }
    let end = first
        .checked_add(cols)
        .ok_or_else(|| invalid(op, format!("{name}: offset overflows")))?;
    if end > table.stride {
        return Err(invalid(
            op,
            format!(
                "{name}: columns [{first}, {end}) run past the row stride {}",
                table.stride
            ),
        ));
    }
    if !first.is_multiple_of(8) {
        return Err(invalid(
            op,
            format!("{name}: column offset {first} must be a multiple of 8"),
        ));
    }
    check_matrix(
        op,
        name,
        Operand::of(table.data),
        Matrix {
            rows: table.rows,
            cols: end,
            stride: table.stride,
        },
    )?;
    check_index(op, &format!("{name} index"), table.index, rows)
}

/// Builds the fused gated residual + RMSNorm (+ adaLN modulation) (kernel h3_residual_norm).
pub fn plan_residual_norm<'a>(op: &ResidualNorm<'a, '_>) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "residual_norm";
    let (rows, cols) = (op.x_layout.rows, op.x_layout.cols);
    if cols == 0 || cols > MAX_NORM_COLS {
        return Err(invalid(
            OP,
            format!("rows of {cols} columns: the kernel normalises 8..={MAX_NORM_COLS} columns"),
        ));
    }
    if op.norm_cols == 0 || op.norm_cols > cols {
        return Err(invalid(
            OP,
            format!("the norm width {} must be within 1..={cols}", op.norm_cols),
        ));
    }
    if !(op.eps.is_finite() && op.eps >= 0.0) {
        return Err(invalid(
            OP,
            format!("eps {} must be finite and >= 0", op.eps),
        ));
    }
    check_matrix(OP, "x", Operand::of_mut(op.x), op.x_layout)?;
    check_matrix(OP, "weight", Operand::of(op.weight), Matrix::dense(1, cols))?;
    let (y_addr, y_stride) = match op.residual {
        Some((y, stride)) => {
            check_matrix(OP, "y", Operand::of(y), op.x_layout.with_stride(stride))?;
            (y.addr(), stride)
        }
        None => {
            if op.gate.is_some() {
                return Err(invalid(OP, "a gate needs a residual input y"));
            }
            (0, 0)
        }
    };
    if let Some(gate) = &op.gate {
        check_table(OP, "gate", gate, 0, cols, rows)?;
    }
    if let Some(m) = &op.modulation {
        check_table(OP, "modulation scale", &m.table, m.scale_offset, cols, rows)?;
        if let Some(shift) = m.shift_offset {
            check_table(OP, "modulation shift", &m.table, shift, cols, rows)?;
        }
    }
    let out_rows = match op.out_index {
        Some((index, out_rows)) => {
            check_index(OP, "out index", index, rows)?;
            out_rows
        }
        None => rows,
    };
    check_matrix(
        OP,
        "out",
        Operand::of_mut(op.out),
        Matrix {
            rows: out_rows,
            cols,
            stride: op.out_stride,
        },
    )?;
    let mut args = Args::new();
    args.push_addr(op.x.addr())
        .push(to_i32(OP, "x stride", op.x_layout.stride)?)
        .push_addr(y_addr)
        .push(to_i32(OP, "y stride", y_stride)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "cols", cols)?)
        .push(1.0f32 / op.norm_cols as f32)
        .push(op.eps)
        .push_addr(op.weight.addr());
    match &op.gate {
        Some(g) => args
            .push_addr(g.data.addr())
            .push(to_i32(OP, "gate stride", g.stride)?)
            .push(to_i32(OP, "gate rows", g.rows)?)
            .push_addr(g.index.addr()),
        None => args.push_addr(0).push(0i32).push(0i32).push_addr(0),
    };
    match &op.modulation {
        Some(m) => args
            .push_addr(m.table.data.addr())
            .push(to_i32(OP, "modulation stride", m.table.stride)?)
            .push(to_i32(OP, "modulation rows", m.table.rows)?)
            .push_addr(m.table.index.addr())
            .push(to_i32(OP, "scale offset", m.scale_offset)?)
            .push(match m.shift_offset {
                Some(s) => to_i32(OP, "shift offset", s)?,
                None => -1,
            }),
        None => args
            .push_addr(0)
            .push(0i32)
            .push(0i32)
            .push_addr(0)
            .push(0i32)
            .push(-1i32),
    };
    args.push_addr(op.out.addr())
        .push(to_i32(OP, "out stride", op.out_stride)?)
        .push_addr(op.out_index.map_or(0, |(index, _)| index.addr()))
        .push(to_i32(OP, "out rows", out_rows)?);
    Ok(Launch::new(
        "h3_residual_norm",
        LaunchConfig::new(to_u32(OP, "rows", rows.max(1))?, ROW_THREADS),
        args,
    ))
}

/// Operands of [`plan_qk_norm_rope`]: the fused q|k|v matrix (`rows` x `3 * heads * 128`, q and k rewritten in
/// place), the QK-norm weights and, optionally, the RoPE tables.
#[derive(Debug)]
pub struct QkNormRope<'v, 'a> {
    pub qkv: &'v DeviceViewMut<'a>,
    pub qkv_layout: Matrix,
    pub heads: usize,
    /// bf16 `[128]` each (zero past the true head dim).
    pub q_weight: &'v DeviceView<'a>,
    pub k_weight: &'v DeviceView<'a>,
    /// The true head dim (the mean square divides by it; channels past it are zero padding).
    pub norm_dim: usize,
    pub eps: f32,
    /// `(cos, sin, stride, rotated)`: bf16 `[rows, stride]` tables whose first `rotated / 2` columns hold the
    /// angles of each row; `rotated` channels of each head turn. `None`: the norm only.
    pub rope: Option<(&'v DeviceView<'a>, &'v DeviceView<'a>, usize, usize)>,
}

/// (row, head) items one block of h3_qk_norm_rope handles: 8 warps of `H3_QK_ITEMS_PER_WARP` (4: two half-warps
/// of 16 lanes, each taking one item in each of 2 slots) in kernels/minimax_h3/dit.cu.
const QK_ITEMS_PER_BLOCK: usize = 32;

/// Builds the in-place per-head QK RMSNorm (+ partial rotate-half RoPE) (kernel h3_qk_norm_rope).
pub fn plan_qk_norm_rope<'a>(op: &QkNormRope<'a, '_>) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "qk_norm_rope";
    let rows = op.qkv_layout.rows;
    let width = op
        .heads
        .checked_mul(3 * HEAD_DIM)
        .ok_or_else(|| invalid(OP, "heads overflow"))?;
    if op.heads == 0 || op.qkv_layout.cols != width {
        return Err(invalid(
            OP,
            format!(
                "qkv has {} columns; {} heads of {HEAD_DIM} need {width} (q | k | v)",
                op.qkv_layout.cols, op.heads
            ),
        ));
    }
    if op.norm_dim == 0 || op.norm_dim > HEAD_DIM {
        return Err(invalid(
            OP,
            format!("head dim {} must be within 1..={HEAD_DIM}", op.norm_dim),
        ));
    }
    if !(op.eps.is_finite() && op.eps >= 0.0) {
        return Err(invalid(
            OP,
            format!("eps {} must be finite and >= 0", op.eps),
        ));
    }
    check_matrix(OP, "qkv", Operand::of_mut(op.qkv), op.qkv_layout)?;
    for (name, w) in [("q_weight", op.q_weight), ("k_weight", op.k_weight)] {
        check_matrix(OP, name, Operand::of(w), Matrix::dense(1, HEAD_DIM))?;
    }
    let (cos, sin, stride, rotated) = match op.rope {
        Some((cos, sin, stride, rotated)) => {
            if rotated < 2 || rotated > op.norm_dim || !rotated.is_multiple_of(2) {
                return Err(invalid(
                    OP,
                    format!(
                        "rotated width {rotated} must be even and within 2..={}",
                        op.norm_dim
                    ),
                ));
            }
            let half = rotated / 2;
            if stride < half {
                return Err(invalid(
                    OP,
                    format!("table stride {stride} is less than the {half} used columns"),
                ));
            }
            let bytes = if rows == 0 {
                0
            } else {
                (rows - 1)
                    .checked_mul(stride)
                    .and_then(|n| n.checked_add(half))
                    .and_then(|n| n.checked_mul(2))
                    .ok_or_else(|| invalid(OP, "table size overflows"))?
            };
            for (name, table) in [("rope_cos", cos), ("rope_sin", sin)] {
                check_aligned_to(OP, name, Operand::of(table), 2)?;
                check_bytes(OP, name, Operand::of(table), bytes)?;
            }
            (cos.addr(), sin.addr(), stride, rotated)
        }
        None => (0, 0, 0, 0),
    };
    let items = rows
        .checked_mul(2 * op.heads)
        .ok_or_else(|| invalid(OP, "rows * heads overflows"))?;
    let mut args = Args::new();
    args.push_addr(op.qkv.addr())
        .push(to_i32(OP, "qkv stride", op.qkv_layout.stride)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "heads", op.heads)?)
        .push_addr(op.q_weight.addr())
        .push_addr(op.k_weight.addr())
        .push(1.0f32 / op.norm_dim as f32)
        .push(op.eps)
        .push_addr(cos)
        .push_addr(sin)
        .push(to_i32(OP, "table stride", stride)?)
        .push(to_i32(OP, "rotated", rotated)?);
    // The shuffle-only entry point (fewer registers) where its preconditions hold: RoPE halves of whole 8-channel
    // lane groups, 16-byte table vectors, items within an int.
    let vectors = |addr: u64| addr.is_multiple_of(16) && stride.is_multiple_of(8);
    let shuffle = rotated > 0
        && (rotated / 2).is_multiple_of(8)
        && vectors(cos)
        && vectors(sin)
        && i32::try_from(items).is_ok();
    Ok(Launch::new(
        if shuffle {
            "h3_qk_norm_rope_shuffle"
        } else {
            "h3_qk_norm_rope"
        },
        LaunchConfig::new(
            to_u32(OP, "blocks", items.div_ceil(QK_ITEMS_PER_BLOCK).max(1))?,
            256,
        ),
        args,
    ))
}

/// Element type of an f32-linear operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
}

impl Elem {
    fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }
}

/// One row-major operand of [`plan_linear_f32`]: `rows` rows of `stride` elements (`cols` used), optionally
/// addressed through an i32 row index (the layer's row r reads or writes row `index[r]`).
#[derive(Clone, Copy, Debug)]
pub struct RowsOperand<'v, 'a> {
    pub elem: Elem,
    pub rows: usize,
    pub stride: usize,
    pub index: Option<&'v DeviceView<'a>>,
}

impl RowsOperand<'_, '_> {
    /// `rows` consecutive f32 rows of `stride` values.
    pub fn f32_rows(rows: usize, stride: usize) -> Self {
        RowsOperand {
            elem: Elem::F32,
            rows,
            stride,
            index: None,
        }
    }
}

/// Operands of [`plan_linear_f32`]: `y[yr(r), c] = act(sum_k x[xr(r), k] * w[c, k] + bias[c])` in f32 for
/// `r < m`, `c < n`.
#[derive(Debug)]
pub struct LinearF32<'v, 'a> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: &'v DeviceView<'a>,
    pub x_rows: RowsOperand<'v, 'a>,
    /// f32 `[n, k]`.
    pub w: &'v DeviceView<'a>,
    /// f32 `[n]`.
    pub bias: Option<&'v DeviceView<'a>>,
    pub y: &'v DeviceViewMut<'a>,
    pub y_rows: RowsOperand<'v, 'a>,
    /// SiLU after the bias.
    pub silu: bool,
}

fn check_rows_operand(
    op: &str,
    name: &str,
    operand: Operand,
    rows: RowsOperand<'_, '_>,
    cols: usize,
    m: usize,
) -> Result<(), tf_cuda::Error> {
    let unit = rows.elem.bytes();
    check_aligned_to(op, name, operand, unit as u64)?;
    if rows.stride < cols {
        return Err(invalid(
            op,
            format!(
                "{name}: row stride {} is less than its {cols} columns",
                rows.stride
            ),
        ));
    }
    let needed_rows = match rows.index {
        Some(index) => {
            check_index(op, &format!("{name} index"), index, m)?;
            rows.rows
        }
        None => {
            if rows.rows < m {
                return Err(invalid(
                    op,
                    format!("{name}: {} rows for a layer of {m} rows", rows.rows),
                ));
            }
            m
        }
    };
    let bytes = if needed_rows == 0 {
        0
    } else {
        (needed_rows - 1)
            .checked_mul(rows.stride)
            .and_then(|v| v.checked_add(cols))
            .and_then(|v| v.checked_mul(unit))
            .ok_or_else(|| invalid(op, format!("{name} size overflows")))?
    };
    check_bytes(op, name, operand, bytes)
}

/// Builds one f32 linear layer (kernels h3_linear_f32_{tile,rows}_{xf_yf,xf_yb,xb_yf}): the few-rows kernel up to
/// [`FEW_ROWS`] rows, 64x64 tiles above. f32 weights and bias; x or y (or both) f32.
pub fn plan_linear_f32<'a>(op: &LinearF32<'a, '_>) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "linear_f32";
    if op.m == 0 || op.n == 0 || op.k == 0 {
        return Err(invalid(
            OP,
            format!(
                "m = {}, n = {}, k = {} must all be at least 1",
                op.m, op.n, op.k
            ),
        ));
    }
    check_rows_operand(OP, "x", Operand::of(op.x), op.x_rows, op.k, op.m)?;
    check_rows_operand(OP, "y", Operand::of_mut(op.y), op.y_rows, op.n, op.m)?;
    let w_bytes =
        op.n.checked_mul(op.k)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(|| invalid(OP, "w size overflows"))?;
    check_operand(OP, "w", Operand::of(op.w), w_bytes, 4)?;
    if let Some(bias) = op.bias {
        check_operand(OP, "bias", Operand::of(bias), op.n * 4, 4)?;
    }
    let few = op.m <= FEW_ROWS;
    let kernel = match (few, op.x_rows.elem, op.y_rows.elem) {
        (false, Elem::F32, Elem::F32) => "h3_linear_f32_tile_xf_yf",
        (false, Elem::F32, Elem::Bf16) => "h3_linear_f32_tile_xf_yb",
        (false, Elem::Bf16, Elem::F32) => "h3_linear_f32_tile_xb_yf",
        (true, Elem::F32, Elem::F32) => "h3_linear_f32_rows_xf_yf",
        (true, Elem::F32, Elem::Bf16) => "h3_linear_f32_rows_xf_yb",
        (true, Elem::Bf16, Elem::F32) => "h3_linear_f32_rows_xb_yf",
        (_, Elem::Bf16, Elem::Bf16) => {
            return Err(invalid(
                OP,
                "bf16 in and bf16 out is not built (use the bf16 GEMMs); the f32 layers read or write f32",
            ))
        }
    };
    let grid = if few {
        (
            to_u32(OP, "column groups", op.n.div_ceil(8))?,
            to_u32(OP, "row groups", op.m.div_ceil(4))?,
        )
    } else {
        (
            to_u32(OP, "column tiles", op.n.div_ceil(64))?,
            to_u32(OP, "row tiles", op.m.div_ceil(64))?,
        )
    };
    let mut args = Args::new();
    args.push_addr(op.x.addr())
        .push(to_i32(OP, "x stride", op.x_rows.stride)?)
        .push_addr(op.x_rows.index.map_or(0, |i| i.addr()))
        .push(to_i32(OP, "x rows", op.x_rows.rows)?)
        .push_addr(op.w.addr())
        .push(to_i32(OP, "k", op.k)?)
        .push_addr(op.bias.map_or(0, |b| b.addr()))
        .push_addr(op.y.addr())
        .push(to_i32(OP, "y stride", op.y_rows.stride)?)
        .push_addr(op.y_rows.index.map_or(0, |i| i.addr()))
        .push(to_i32(OP, "y rows", op.y_rows.rows)?)
        .push(to_i32(OP, "m", op.m)?)
        .push(to_i32(OP, "n", op.n)?)
        .push(i32::from(op.silu));
    Ok(Launch::new(kernel, LaunchConfig::new(grid, 256), args))
}

/// Operands of [`plan_linear_w8`]: `y[r, c] = bf16(sum_k x[r, k] * w[c, k] * w_scale[c] + bias[c])` for
/// `r < m`, `c < n`: bf16 rows in and out, 8-bit weights (e4m3 or INT8 codes) with one f32 scale per output channel
/// (weight-only: the adaLN projections over the timestep rows).
#[derive(Debug)]
pub struct LinearW8<'v, 'a> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// The format of `w`'s codes.
    pub codes: RowCodes,
    /// bf16 rows of `x_stride`.
    pub x: &'v DeviceView<'a>,
    pub x_stride: usize,
    /// 8-bit codes `[n, k]`, rows of `k` bytes.
    pub w: &'v DeviceView<'a>,
    /// f32 `[n]`.
    pub w_scale: &'v DeviceView<'a>,
    /// bf16 `[n]`.
    pub bias: Option<&'v DeviceView<'a>>,
    /// bf16 rows of `y_stride`.
    pub y: &'v DeviceViewMut<'a>,
    pub y_stride: usize,
    /// The SMs [`LinearW8Columns::Ring`]'s persistent CTAs spread over ([`H3Kernels::sm_count`]); the other forms
    /// ignore it.
    pub sm_count: usize,
}

/// Rows of `x` one CTA of the weight-only linear layer takes (`H3_LINEAR_W8_ROWS` in `kernels/minimax_h3/dit.cu`):
/// the weights cross HBM once per this many rows.
const LINEAR_W8_ROWS: usize = 32;

/// Output columns a warp of the weight-only linear layer takes (its CTAs are 8 warps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearW8Columns {
    /// Two columns a warp (the default): each `x` row read serves both; 232 registers, one CTA an SM.
    Two,
    /// One column a warp (the `_c1` kernels): half the weight registers, two CTAs an SM, twice the CTAs. A column's
    /// sum is the same as with [`LinearW8Columns::Two`], so the outputs are bit-equal.
    One,
    /// One column a warp for four column groups in turn (the `_c1t4` kernels): a warp loads the next group's codes
    /// before it sums the current one, so its loads stay in flight through its sums; a quarter of
    /// [`LinearW8Columns::One`]'s CTAs. The same sums, bit-equal outputs.
    OneFourInTurn,
    /// Two columns a warp, the codes streamed through shared memory (the `_ring` kernels, sm_90 and newer): one
    /// persistent CTA an SM over column groups of 16, each group's codes one bulk copy into a ring of
    /// [`LINEAR_W8_RING_STAGES`] stages, so the next groups' copies are in flight while the warps sum the current
    /// one. The warps read the codes from the stage where [`LinearW8Columns::Two`] reads its registers: the same
    /// sums, bit-equal outputs.
    Ring,
}

/// Stages of [`LinearW8Columns::Ring`]'s ring (`H3_LINEAR_W8_STAGES` in `kernels/minimax_h3/dit.cu`).
pub const LINEAR_W8_RING_STAGES: usize = 4;

/// Dynamic shared memory of a [`LinearW8Columns::Ring`] CTA: its stages of 16 columns of [`LINEAR_W8_MAX_K`] codes.
pub const LINEAR_W8_RING_SHARED: u32 = (LINEAR_W8_RING_STAGES * 16 * LINEAR_W8_MAX_K) as u32;

/// The environment variable that picks [`LinearW8Columns`]: `2` (the default), `1`, `1t4` or `ring`.
pub const LINEAR_W8_COLS_ENV: &str = "TF_LINEAR_W8_COLS";

impl LinearW8Columns {
    /// From [`LINEAR_W8_COLS_ENV`], read once a process (every launch the planner packs asks); unset or empty is
    /// [`LinearW8Columns::Two`].
    pub fn from_env() -> Result<LinearW8Columns, tf_cuda::Error> {
        static ASKED: std::sync::OnceLock<Result<LinearW8Columns, String>> =
            std::sync::OnceLock::new();
        ASKED
            .get_or_init(|| match std::env::var(LINEAR_W8_COLS_ENV).as_deref() {
                Err(_) | Ok("") | Ok("2") => Ok(LinearW8Columns::Two),
                Ok("1") => Ok(LinearW8Columns::One),
                Ok("1t4") => Ok(LinearW8Columns::OneFourInTurn),
                Ok("ring") => Ok(LinearW8Columns::Ring),
                Ok(other) => Err(format!(
                    "{LINEAR_W8_COLS_ENV}={other}: expected 2 or 1 (output columns a warp), 1t4 (one column \
                     a warp, four column groups in turn) or ring (the codes streamed through shared memory)"
                )),
            })
            .clone()
            .map_err(|message| invalid("linear_w8", message))
    }

    /// Output columns of one CTA: 8 warps of this many columns, for this many turns.
    fn cta_columns(self) -> usize {
        match self {
            LinearW8Columns::Two | LinearW8Columns::Ring => 16,
            LinearW8Columns::One => 8,
            LinearW8Columns::OneFourInTurn => 32,
        }
    }
}

/// The widest `k` the weight-only linear layer holds in registers: 32 lanes x 16 codes x `H3_LINEAR_W8_CHUNKS` (6).
pub const LINEAR_W8_MAX_K: usize = 32 * 16 * 6;

/// Builds the weight-only 8-bit linear layer (kernel h3_linear_fp8w_rows or h3_linear_int8w_rows by `codes`, their
/// `_c1` forms under `TF_LINEAR_W8_COLS=1`, `_c1t4` under `1t4`): one warp per two output columns (or one, or one
/// for four column groups in turn) and up to 32 rows, 4 at a time, every weight chunk of the warp's columns loaded
/// once into registers. `k` a multiple of 16 (16-byte rows of codes), at most [`LINEAR_W8_MAX_K`].
pub fn plan_linear_w8<'a>(op: &LinearW8<'a, '_>) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_linear_w8_columns(op, LinearW8Columns::from_env()?)
}

/// [`plan_linear_w8`] with the columns a warp given instead of read from [`LINEAR_W8_COLS_ENV`].
pub fn plan_linear_w8_columns<'a>(
    op: &LinearW8<'a, '_>,
    columns: LinearW8Columns,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "linear_w8";
    if op.m == 0 || op.n == 0 || op.k == 0 || !op.k.is_multiple_of(16) || op.k > LINEAR_W8_MAX_K {
        return Err(invalid(
            OP,
            format!(
                "m = {}, n = {}, k = {}: all at least 1, k a multiple of 16 and at most {LINEAR_W8_MAX_K}",
                op.m, op.n, op.k
            ),
        ));
    }
    check_matrix(
        OP,
        "x",
        Operand::of(op.x),
        Matrix {
            rows: op.m,
            cols: op.k,
            stride: op.x_stride,
        },
    )?;
    check_matrix(
        OP,
        "y",
        Operand::of_mut(op.y),
        Matrix {
            rows: op.m,
            cols: op.n,
            stride: op.y_stride,
        },
    )?;
    let w_bytes =
        op.n.checked_mul(op.k)
            .ok_or_else(|| invalid(OP, "w size overflows"))?;
    check_operand(OP, "w", Operand::of(op.w), w_bytes, 16)?;
    check_operand(OP, "w_scale", Operand::of(op.w_scale), op.n * 4, 4)?;
    if let Some(bias) = op.bias {
        check_operand(OP, "bias", Operand::of(bias), op.n * 2, 2)?;
    }
    let column_groups = op.n.div_ceil(columns.cta_columns());
    let (ctas, shared) = match columns {
        // One persistent CTA an SM (its shared memory allows no second), never more than the groups.
        LinearW8Columns::Ring => (column_groups.min(op.sm_count.max(1)), LINEAR_W8_RING_SHARED),
        _ => (column_groups, 0),
    };
    let grid = (
        to_u32(OP, "column groups", ctas)?,
        to_u32(OP, "row groups", op.m.div_ceil(LINEAR_W8_ROWS))?,
    );
    let mut args = Args::new();
    args.push_addr(op.x.addr())
        .push(to_i32(OP, "x stride", op.x_stride)?)
        .push_addr(op.w.addr())
        .push_addr(op.w_scale.addr())
        .push(to_i32(OP, "k", op.k)?)
        .push_addr(op.bias.map_or(0, |b| b.addr()))
        .push_addr(op.y.addr())
        .push(to_i32(OP, "y stride", op.y_stride)?)
        .push(to_i32(OP, "m", op.m)?)
        .push(to_i32(OP, "n", op.n)?);
    let kernel = match (op.codes, columns) {
        (RowCodes::E4m3, LinearW8Columns::Two) => "h3_linear_fp8w_rows",
        (RowCodes::Int8, LinearW8Columns::Two) => "h3_linear_int8w_rows",
        (RowCodes::E4m3, LinearW8Columns::One) => "h3_linear_fp8w_rows_c1",
        (RowCodes::Int8, LinearW8Columns::One) => "h3_linear_int8w_rows_c1",
        (RowCodes::E4m3, LinearW8Columns::OneFourInTurn) => "h3_linear_fp8w_rows_c1t4",
        (RowCodes::Int8, LinearW8Columns::OneFourInTurn) => "h3_linear_int8w_rows_c1t4",
        (RowCodes::E4m3, LinearW8Columns::Ring) => RING_KERNELS[0],
        (RowCodes::Int8, LinearW8Columns::Ring) => RING_KERNELS[1],
    };
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(grid, 256).with_shared(shared),
        args,
    ))
}

/// The H3 DiT's kernels of one context: the `minimax_h3_dit` set beside the shared [`NnKernels`] (reachable
/// through `Deref`), so one handle runs the whole step.
pub struct H3Kernels {
    nn: NnKernels,
    h3: LoadedSet,
    sm_count: usize,
}

impl std::fmt::Debug for H3Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H3Kernels")
            .field("nn", &self.nn)
            .field("h3", &self.h3)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl std::ops::Deref for H3Kernels {
    type Target = NnKernels;
    fn deref(&self) -> &NnKernels {
        &self.nn
    }
}

impl H3Kernels {
    /// Loads the shared sets and the `minimax_h3_dit` set into `ctx`. The ring form's kernels are kept only on
    /// sm_90 and newer where their shared memory is granted ([`H3Kernels::has_ring`]).
    pub fn load(ctx: &Context) -> Result<H3Kernels, LoadKernelsError> {
        let info = ctx.device_info().ok();
        let sm90 = info
            .as_ref()
            .is_some_and(|i| i.compute_capability >= (9, 0));
        let sm_count = info.map_or(1, |i| usize::try_from(i.sm_count).unwrap_or(1).max(1));
        let mut h3 = LoadedSet::empty();
        h3.add(ctx, H3_SET, H3_KERNELS, |name, function| {
            if RING_KERNELS.contains(&name) {
                return Ok(sm90
                    && function
                        .set_max_dynamic_shared(LINEAR_W8_RING_SHARED)
                        .is_ok());
            }
            Ok(true)
        })?;
        Ok(H3Kernels {
            nn: NnKernels::load(ctx)?,
            h3,
            sm_count,
        })
    }

    /// The SMs of the device the kernels were loaded for ([`LinearW8::sm_count`]).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// True when [`LinearW8Columns::Ring`]'s kernels run on this device (sm_90 or newer, its shared memory granted).
    pub fn has_ring(&self) -> bool {
        RING_KERNELS.iter().all(|k| self.h3.has(k))
    }

    /// Submits the launch a `plan_*` function of this module or of [`crate::nn::gpu`] built, or passes its error
    /// on.
    pub fn run(
        &self,
        stream: &Stream,
        plan: Result<Launch<'_>, tf_cuda::Error>,
    ) -> Result<(), tf_cuda::Error> {
        let launch = plan?;
        if self.h3.owns(launch.kernel()) {
            self.h3.submit(stream, &launch)
        } else {
            self.nn.submit(stream, &launch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gpu::test_support::{buffer, context, BF16};
    use tf_testdriver::test_lock;

    #[test]
    fn residual_norm_packs_every_variant_and_checks_tables() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (6, 24);
        let mut x = buffer(&ctx, rows * cols * BF16);
        let y = buffer(&ctx, rows * cols * BF16);
        let mut out = buffer(&ctx, 2 * rows * cols * BF16);
        let w = buffer(&ctx, cols * BF16);
        let table = buffer(&ctx, 3 * 6 * cols * BF16);
        let index = buffer(&ctx, rows * 4);
        let (xv, yv, ov, wv, tv, iv) = (
            x.view_mut(),
            y.view(),
            out.view_mut(),
            w.view(),
            table.view(),
            index.view(),
        );
        let layout = Matrix::dense(rows, cols);
        let plain = ResidualNorm {
            x: &xv,
            x_layout: layout,
            residual: None,
            gate: None,
            norm_cols: 20,
            eps: 1e-5,
            weight: &wv,
            modulation: None,
            out: &ov,
            out_stride: cols,
            out_index: None,
        };
        let launch = plan_residual_norm(&plain).unwrap();
        assert_eq!(launch.kernel(), "h3_residual_norm");
        assert_eq!(launch.args().len(), 23);
        assert_eq!(launch.args().get::<f32>(6), Some(1.0 / 20.0));
        assert_eq!(launch.args().get::<u64>(2), Some(0));
        assert_eq!(launch.args().get::<i32>(18), Some(-1));
        assert_eq!(launch.config().grid.x, rows as u32);
        // Gate from column 2 * cols of a [3, 6 * cols] table, scale and shift from another block.
        let gate_view = tv
            .slice(2 * cols * BF16, tv.len() - 2 * cols * BF16)
            .unwrap();
        let gate = RowTable {
            data: &gate_view,
            rows: 3,
            stride: 6 * cols,
            index: &iv,
        };
        let full = ResidualNorm {
            residual: Some((&yv, cols)),
            gate: Some(gate),
            modulation: Some(NormModulation {
                table: RowTable {
                    data: &tv,
                    rows: 3,
                    stride: 6 * cols,
                    index: &iv,
                },
                scale_offset: 4 * cols,
                shift_offset: Some(3 * cols),
            }),
            out_index: Some((&iv, 2 * rows)),
            ..plain
        };
        let launch = plan_residual_norm(&full).unwrap();
        assert_eq!(launch.args().get::<u64>(9), Some(gate_view.addr()));
        assert_eq!(launch.args().get::<i32>(10), Some(6 * cols as i32));
        assert_eq!(launch.args().get::<i32>(17), Some(4 * cols as i32));
        assert_eq!(launch.args().get::<i32>(18), Some(3 * cols as i32));
        assert_eq!(launch.args().get::<i32>(22), Some(2 * rows as i32));
        // Refusals: a gate without a residual, a norm width past the row, a shift past the stride, a short index,
        // an out too small for its scattered rows.
        let gate_only = ResidualNorm {
            residual: None,
            ..full
        };
        assert!(plan_residual_norm(&gate_only).is_err());
        let wide = ResidualNorm {
            norm_cols: cols + 1,
            ..plain
        };
        assert!(plan_residual_norm(&wide).is_err());
        let past = ResidualNorm {
            modulation: Some(NormModulation {
                table: RowTable {
                    data: &tv,
                    rows: 3,
                    stride: 6 * cols,
                    index: &iv,
                },
                scale_offset: 4 * cols,
                shift_offset: Some(6 * cols),
            }),
            ..plain
        };
        assert!(plan_residual_norm(&past)
            .unwrap_err()
            .to_string()
            .contains("row stride"));
        let short = iv.slice(0, (rows - 1) * 4).unwrap();
        let short_index = ResidualNorm {
            out_index: Some((&short, rows)),
            ..plain
        };
        assert!(plan_residual_norm(&short_index).is_err());
        let too_many = ResidualNorm {
            out_index: Some((&iv, 3 * rows)),
            ..plain
        };
        assert!(plan_residual_norm(&too_many)
            .unwrap_err()
            .to_string()
            .contains("out"));
    }

    #[test]
    fn linear_w8_picks_the_kernel_of_its_codes_and_checks_shapes() {
        let _serial = test_lock();
        let ctx = context();
        let (m, n, k) = (97, 24, 32);
        let x = buffer(&ctx, m * k * BF16);
        let w = buffer(&ctx, n * k);
        let scales = buffer(&ctx, n * 4);
        let mut y = buffer(&ctx, m * n * BF16);
        let (xv, wv, sv, yv) = (x.view(), w.view(), scales.view(), y.view_mut());
        let op = LinearW8 {
            m,
            n,
            k,
            codes: RowCodes::Int8,
            x: &xv,
            x_stride: k,
            w: &wv,
            w_scale: &sv,
            bias: None,
            y: &yv,
            y_stride: n,
            sm_count: 132,
        };
        let launch = plan_linear_w8(&op).unwrap();
        assert_eq!(launch.kernel(), "h3_linear_int8w_rows");
        // 16 columns a CTA; a request's 97 timestep rows in 4 row groups of 32 (the weights read 4 times, not 25).
        assert_eq!(launch.config().grid.x, 2);
        assert_eq!(launch.config().grid.y, 4);
        let fp8 = LinearW8 {
            codes: RowCodes::E4m3,
            ..op
        };
        assert_eq!(
            plan_linear_w8(&fp8).unwrap().kernel(),
            "h3_linear_fp8w_rows"
        );
        // The other forms, by the columns a CTA covers (the same row groups): one column a warp, the _c1 kernels
        // over twice the column groups; four column groups a warp in turn, 32 columns a CTA, so the 24 take one.
        for (columns, int8, e4m3, column_groups) in [
            (
                LinearW8Columns::One,
                "h3_linear_int8w_rows_c1",
                "h3_linear_fp8w_rows_c1",
                3,
            ),
            (
                LinearW8Columns::OneFourInTurn,
                "h3_linear_int8w_rows_c1t4",
                "h3_linear_fp8w_rows_c1t4",
                1,
            ),
            // The ring: 16 columns a group, persistent CTAs, never more than the groups.
            (
                LinearW8Columns::Ring,
                "h3_linear_int8w_rows_ring",
                "h3_linear_fp8w_rows_ring",
                2,
            ),
        ] {
            let launch = plan_linear_w8_columns(&op, columns).unwrap();
            assert_eq!(launch.kernel(), int8);
            assert_eq!(
                (launch.config().grid.x, launch.config().grid.y),
                (column_groups, 4)
            );
            assert_eq!(
                plan_linear_w8_columns(&fp8, columns).unwrap().kernel(),
                e4m3
            );
            let shared = if columns == LinearW8Columns::Ring {
                LINEAR_W8_RING_SHARED
            } else {
                0
            };
            assert_eq!(launch.config().shared_bytes, shared);
        }
        // The release's adaLN width (18 x 5376 columns, 6048 groups of 16): the ring's CTAs stop at the SM count.
        let wide_n = 18 * 5376;
        let wide_w = buffer(&ctx, wide_n * k);
        let wide_s = buffer(&ctx, wide_n * 4);
        let mut wide_y = buffer(&ctx, wide_n * BF16);
        let (wwv, wsv, wyv) = (wide_w.view(), wide_s.view(), wide_y.view_mut());
        let wide = LinearW8 {
            m: 1,
            n: wide_n,
            w: &wwv,
            w_scale: &wsv,
            y: &wyv,
            y_stride: wide_n,
            ..op
        };
        for (columns, ctas) in [(LinearW8Columns::Two, 6048), (LinearW8Columns::Ring, 132)] {
            let grid = plan_linear_w8_columns(&wide, columns)
                .unwrap()
                .config()
                .grid;
            assert_eq!((grid.x, grid.y), (ctas, 1), "{columns:?}");
        }
        // k not a multiple of 16, weights shorter than n x k, no rows: refused.
        assert!(plan_linear_w8(&LinearW8 {
            k: 24,
            x_stride: 24,
            ..op
        })
        .is_err());
        assert!(plan_linear_w8(&LinearW8 { n: 25, ..op }).is_err());
        assert!(plan_linear_w8(&LinearW8 { m: 0, ..op }).is_err());
        // k past what a warp holds in registers: refused (the release's adaLN has k = 2688).
        assert!(plan_linear_w8(&LinearW8 {
            k: LINEAR_W8_MAX_K + 16,
            x_stride: LINEAR_W8_MAX_K + 16,
            ..op
        })
        .is_err());
    }

    #[test]
    fn qk_norm_rope_checks_widths_and_tables() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, heads) = (5, 2);
        let mut qkv = buffer(&ctx, rows * 3 * heads * HEAD_DIM * BF16);
        let w = buffer(&ctx, 2 * HEAD_DIM * BF16);
        let tables = buffer(&ctx, 2 * rows * 48 * BF16);
        let qv = qkv.view_mut();
        let (qw, kw) = (
            w.slice(0, HEAD_DIM * BF16).unwrap(),
            w.slice(HEAD_DIM * BF16, HEAD_DIM * BF16).unwrap(),
        );
        let (cos, sin) = (
            tables.slice(0, rows * 48 * BF16).unwrap(),
            tables.slice(rows * 48 * BF16, rows * 48 * BF16).unwrap(),
        );
        let op = QkNormRope {
            qkv: &qv,
            qkv_layout: Matrix::dense(rows, 3 * heads * HEAD_DIM),
            heads,
            q_weight: &qw,
            k_weight: &kw,
            norm_dim: 128,
            eps: 1e-5,
            rope: Some((&cos, &sin, 48, 96)),
        };
        let launch = plan_qk_norm_rope(&op).unwrap();
        // 48-channel halves from 16-byte table vectors: the shuffle-only entry point; else the general one.
        assert_eq!(launch.kernel(), "h3_qk_norm_rope_shuffle");
        let odd_stride = QkNormRope {
            rope: Some((&cos, &sin, 44, 80)),
            ..op
        };
        let half_not_of_lanes = QkNormRope {
            rope: Some((&cos, &sin, 48, 40)),
            norm_dim: 128,
            ..op
        };
        let shifted = tables.slice(2, rows * 48 * BF16).unwrap();
        let unaligned_table = QkNormRope {
            rope: Some((&shifted, &sin, 48, 96)),
            ..op
        };
        for general in [&odd_stride, &half_not_of_lanes, &unaligned_table] {
            assert_eq!(
                plan_qk_norm_rope(general).unwrap().kernel(),
                "h3_qk_norm_rope"
            );
        }
        assert_eq!(
            launch.config().grid.x,
            (rows * 2 * heads).div_ceil(QK_ITEMS_PER_BLOCK) as u32
        );
        assert_eq!(launch.args().get::<i32>(11), Some(96));
        let norm_only = QkNormRope { rope: None, ..op };
        let launch = plan_qk_norm_rope(&norm_only).unwrap();
        assert_eq!(launch.args().get::<u64>(8), Some(0));
        assert_eq!(launch.kernel(), "h3_qk_norm_rope");
        // Rotated past the true head dim, a short table, an odd width: refused.
        let narrow = QkNormRope { norm_dim: 16, ..op };
        assert!(plan_qk_norm_rope(&narrow).is_err());
        let short = tables.slice(0, (rows * 48 - 1) * BF16).unwrap();
        let short_table = QkNormRope {
            rope: Some((&short, &sin, 48, 96)),
            ..op
        };
        assert!(plan_qk_norm_rope(&short_table).is_err());
        let odd = QkNormRope {
            rope: Some((&cos, &sin, 48, 95)),
            ..op
        };
        assert!(plan_qk_norm_rope(&odd).is_err());
        let wrong_cols = QkNormRope {
            qkv_layout: Matrix::dense(rows, 2 * heads * HEAD_DIM),
            ..op
        };
        assert!(plan_qk_norm_rope(&wrong_cols).is_err());
    }

    #[test]
    fn linear_f32_picks_the_kernel_and_checks_gathers() {
        let _serial = test_lock();
        let ctx = context();
        let (m, n, k, rows) = (10, 40, 24, 30);
        let x = buffer(&ctx, m * k * 4);
        let w = buffer(&ctx, n * k * 4);
        let b = buffer(&ctx, n * 4);
        let mut y = buffer(&ctx, rows * n * BF16);
        let index = buffer(&ctx, m * 4);
        let (xv, wv, bv, yv, iv) = (x.view(), w.view(), b.view(), y.view_mut(), index.view());
        let op = LinearF32 {
            m,
            n,
            k,
            x: &xv,
            x_rows: RowsOperand {
                elem: Elem::F32,
                rows: m,
                stride: k,
                index: None,
            },
            w: &wv,
            bias: Some(&bv),
            y: &yv,
            y_rows: RowsOperand {
                elem: Elem::Bf16,
                rows,
                stride: n,
                index: Some(&iv),
            },
            silu: true,
        };
        let launch = plan_linear_f32(&op).unwrap();
        assert_eq!(launch.kernel(), "h3_linear_f32_tile_xf_yb");
        assert_eq!((launch.config().grid.x, launch.config().grid.y), (1, 1));
        assert_eq!(launch.args().get::<i32>(13), Some(1));
        let few = LinearF32 { m: 3, ..op };
        let launch = plan_linear_f32(&few).unwrap();
        assert_eq!(launch.kernel(), "h3_linear_f32_rows_xf_yb");
        assert_eq!((launch.config().grid.x, launch.config().grid.y), (5, 1));
        // Four rows a CTA: 7 rows take two row groups.
        let seven = LinearF32 { m: 7, ..op };
        assert_eq!(plan_linear_f32(&seven).unwrap().config().grid.y, 2);
        // A scatter target smaller than its declared rows, an x with fewer rows than the layer: refused.
        let small = LinearF32 {
            y_rows: RowsOperand {
                rows: rows + 1,
                ..op.y_rows
            },
            ..op
        };
        assert!(plan_linear_f32(&small).is_err());
        let short_x = LinearF32 { m: m + 1, ..op };
        assert!(plan_linear_f32(&short_x).is_err());
        let empty = LinearF32 { n: 0, ..op };
        assert!(plan_linear_f32(&empty).is_err());
        let both_bf16 = LinearF32 {
            x_rows: RowsOperand {
                elem: Elem::Bf16,
                ..op.x_rows
            },
            ..op
        };
        assert!(plan_linear_f32(&both_bf16)
            .unwrap_err()
            .to_string()
            .contains("bf16"));
    }
}
