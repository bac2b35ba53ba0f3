//! Row norms: the affine RMSNorm of Qwen3-style text models ([`plan_rms_norm`]); LayerNorm or RMSNorm, affine or
//! not, optionally followed by `*(1 + scale)` or `*(1 + scale) + shift` per row ([`plan_norm_modulate`]); and the
//! pieces every adaLN-style kernel shares: the row-norm argument packing, the modulation-row rule ([`ModulationRows`]) and modulation
//! blocks ([`Modulation`]). Kernel set `nn_norm`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{DeviceView, DeviceViewMut, Stream};

use super::launch::{
    check_aligned_to, check_bytes, check_eps, check_matrix, invalid, to_i32, to_u32, Launch,
    Matrix, Operand, ROW_THREADS,
};
use super::NnKernels;

/// Name of the kernel set holding the norm kernels.
pub const NORM_SET: &str = "nn_norm";

/// Most columns a row-normalising kernel holds in registers (QI_ROW_THREADS * 8 * QI_ROW_CHUNKS).
pub const MAX_NORM_COLS: usize = 8192;

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

/// Checks a modulation block against `rows` x `cols` activations under the row rule `select`.
pub(crate) fn check_modulation(
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

/// Packs `(mod, mod_stride, mod_offset)`.
pub(crate) fn push_modulation(
    args: &mut Args,
    op: &str,
    modulation: &Modulation<'_, '_>,
) -> Result<(), tf_cuda::Error> {
    args.push_addr(modulation.data.addr())
        .push(to_i32(op, "modulation stride", modulation.stride)?)
        .push(to_i32(op, "modulation offset", modulation.offset)?);
    Ok(())
}

/// Packs `(seq_len, target_begin, prefix_row)`.
pub(crate) fn push_select(
    args: &mut Args,
    op: &str,
    select: ModulationRows,
) -> Result<(), tf_cuda::Error> {
    args.push(to_i32(op, "seq_len", select.seq_len)?)
        .push(to_i32(op, "target_begin", select.target_begin)?)
        .push(to_i32(op, "prefix_row", select.prefix_row)?);
    Ok(())
}

/// Refuses a row width the row-normalising kernels cannot hold in registers.
pub(crate) fn check_norm_cols(op: &str, cols: usize) -> Result<(), tf_cuda::Error> {
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
pub(crate) fn plan_weighted_row_norm<'a>(
    op: &'static str,
    kernel: &'static str,
    max_cols: usize,
    threads: u32,
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    y: &'a DeviceViewMut<'_>,
    y_stride: usize,
    weight: &'a DeviceView<'_>,
    eps: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    check_row_cols(op, x_layout.cols, max_cols)?;
    check_eps(op, eps)?;
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
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(to_u32(op, "rows", x_layout.rows.max(1))?, threads),
        args,
    ))
}

/// Builds the zero-centred RMSNorm `y = x * rsqrt(mean(x^2) + eps) * (1 + weight)` in f32, for checkpoints that
/// store `scale - 1` (kernel nn_rms_norm_zc).
pub fn plan_rms_norm_zc<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    y: &'a DeviceViewMut<'_>,
    y_stride: usize,
    weight: &'a DeviceView<'_>,
    eps: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_weighted_row_norm(
        "rms_norm_zc",
        "nn_rms_norm_zc",
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

/// Builds the Qwen3 RMSNorm `y = weight * bf16(x * rsqrt(mean(x^2) + eps))` (kernel nn_rms_norm).
pub fn plan_rms_norm<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    y: &'a DeviceViewMut<'_>,
    y_stride: usize,
    weight: &'a DeviceView<'_>,
    eps: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "rms_norm";
    check_eps(OP, eps)?;
    plan_weighted_row_norm(
        OP,
        "nn_rms_norm",
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

/// Which statistics a [`NormModulate`] row norm uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `(x - mean) * rsqrt(var + eps)`.
    LayerNorm,
    /// `x * rsqrt(mean(x^2) + eps)`.
    RmsNorm,
}

/// Per-row `(1 + scale)` and optional `+ shift` after a [`NormModulate`] norm: `scale` (and `shift`) are column
/// blocks of one modulation tensor (`rows` modulation rows of `stride` bf16 elements).
#[derive(Clone, Copy, Debug)]
pub struct RowModulation<'v, 'a> {
    pub data: &'v DeviceView<'a>,
    pub rows: usize,
    pub stride: usize,
    /// Column where the scale block starts.
    pub scale_offset: usize,
    /// Column where the shift block starts; `None`: scale only.
    pub shift_offset: Option<usize>,
    /// Which modulation row each activation row uses: the rule, unless `row_index` is given.
    pub select: ModulationRows,
    /// One i32 modulation row per activation row (`rows` of them; the caller checks them against `rows`: the
    /// kernel clamps an index out of range so it cannot read outside the tensor).
    pub row_index: Option<&'v DeviceView<'a>>,
}

/// A LayerNorm or RMSNorm, affine or not, optionally modulated (kernel nn_norm_modulate):
/// `n = norm(x) (* weight (+ bias)) (* (1 + scale) (+ shift))`, f32 throughout, rounded to bf16 once.
#[derive(Clone, Copy, Debug)]
pub struct NormModulate<'v, 'a> {
    pub kind: NormKind,
    /// Per-column weight (bf16, `cols`); `None`: no affine.
    pub weight: Option<&'v DeviceView<'a>>,
    /// Per-column bias (bf16, `cols`), only with a weight.
    pub bias: Option<&'v DeviceView<'a>>,
    pub eps: f32,
    pub modulation: Option<RowModulation<'v, 'a>>,
}

/// Checks and packs a [`NormModulate`]'s tail, `(weight, bias, rows, cols, eps, layer_norm, mod, mod_stride,
/// mod_rows, scale_offset, shift_offset, seq_len, target_begin, prefix_row, row_index)`, exactly as
/// `nn_norm_modulate` takes it. Without modulation the selection slots get `unmodulated` (rule, row index
/// address): a gate may still need them.
pub(crate) fn push_norm(
    args: &mut Args,
    op: &str,
    x_layout: Matrix,
    norm: &NormModulate<'_, '_>,
    unmodulated: (ModulationRows, u64),
) -> Result<(), tf_cuda::Error> {
    let cols = x_layout.cols;
    check_eps(op, norm.eps)?;
    if norm.bias.is_some() && norm.weight.is_none() {
        return Err(invalid(op, "a bias needs a weight (affine norm)"));
    }
    for (name, view) in [("weight", norm.weight), ("bias", norm.bias)] {
        if let Some(view) = view {
            check_matrix(op, name, Operand::of(view), Matrix::dense(1, cols))?;
        }
    }
    args.push_addr(norm.weight.map_or(0, |w| w.addr()))
        .push_addr(norm.bias.map_or(0, |b| b.addr()))
        .push(to_i32(op, "rows", x_layout.rows)?)
        .push(to_i32(op, "cols", cols)?)
        .push(norm.eps)
        .push(i32::from(norm.kind == NormKind::LayerNorm));
    let Some(m) = &norm.modulation else {
        args.push_addr(0)
            .push(0i32)
            .push(0i32)
            .push(0i32)
            .push(-1i32);
        push_select(args, op, unmodulated.0)?;
        args.push_addr(unmodulated.1);
        return Ok(());
    };
    if m.rows == 0 {
        return Err(invalid(op, "modulation needs at least one row"));
    }
    let block = |offset: usize| Modulation {
        data: m.data,
        rows: m.rows,
        stride: m.stride,
        offset,
    };
    let index = match m.row_index {
        Some(index) => Some(check_row_index(op, index, x_layout.rows)?),
        None => None,
    };
    let select = if index.is_some() {
        ModulationRows::targets_only(1)
    } else {
        m.select
    };
    for offset in std::iter::once(m.scale_offset).chain(m.shift_offset) {
        if index.is_some() {
            // Any row may be chosen: the whole table must be there.
            check_modulation(op, &block(offset), cols, m.rows, select)?;
        } else {
            check_modulation(op, &block(offset), cols, x_layout.rows, select)?;
        }
    }
    let shift = match m.shift_offset {
        Some(offset) => to_i32(op, "shift offset", offset)?,
        None => -1,
    };
    args.push_addr(m.data.addr())
        .push(to_i32(op, "modulation stride", m.stride)?)
        .push(to_i32(op, "modulation rows", m.rows)?)
        .push(to_i32(op, "scale offset", m.scale_offset)?)
        .push(shift);
    push_select(args, op, select)?;
    args.push_addr(index.unwrap_or(0));
    Ok(())
}

/// Checks an i32 row index of `rows` entries; returns its address.
pub(crate) fn check_row_index(
    op: &str,
    index: &DeviceView<'_>,
    rows: usize,
) -> Result<u64, tf_cuda::Error> {
    check_aligned_to(op, "row_index", Operand::of(index), 4)?;
    let bytes = rows
        .checked_mul(4)
        .ok_or_else(|| invalid(op, "row_index size overflows"))?;
    check_bytes(op, "row_index", Operand::of(index), bytes)?;
    Ok(index.addr())
}

/// Builds a [`NormModulate`] over `x` into `y` (kernel nn_norm_modulate).
pub fn plan_norm_modulate<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    y: &'a DeviceViewMut<'_>,
    y_stride: usize,
    norm: &NormModulate<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "norm_modulate";
    check_norm_cols(OP, x_layout.cols)?;
    check_matrix(OP, "x", Operand::of(x), x_layout)?;
    check_matrix(OP, "y", Operand::of_mut(y), x_layout.with_stride(y_stride))?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(OP, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(OP, "y stride", y_stride)?);
    push_norm(
        &mut args,
        OP,
        x_layout,
        norm,
        (ModulationRows::targets_only(1), 0),
    )?;
    Ok(Launch::new(
        "nn_norm_modulate",
        LaunchConfig::new(to_u32(OP, "rows", x_layout.rows.max(1))?, ROW_THREADS),
        args,
    ))
}

impl NnKernels {
    /// LayerNorm / RMSNorm, affine or not, optionally modulated; see [`plan_norm_modulate`].
    pub fn norm_modulate(
        &self,
        stream: &Stream,
        x: &DeviceView<'_>,
        x_layout: Matrix,
        y: &mut DeviceViewMut<'_>,
        y_stride: usize,
        norm: &NormModulate<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_norm_modulate(x, x_layout, y, y_stride, norm)?)
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

    /// Affine RMSNorm (Qwen3 rounding); see [`plan_rms_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
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
            &plan_rms_norm(x, x_layout, y, y_stride, weight, eps)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gpu::test_support::{buffer, context, BF16};
    use tf_testdriver::test_lock;

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
    fn rms_norm_plan_checks_columns_weight_and_eps() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (3, 4096);
        let x = buffer(&ctx, rows * cols * BF16);
        let mut y = buffer(&ctx, rows * cols * BF16);
        let w = buffer(&ctx, cols * BF16);
        let layout = Matrix::dense(rows, cols);
        let (xv, yv, wv) = (x.view(), y.view_mut(), w.view());
        let launch = plan_rms_norm(&xv, layout, &yv, cols, &wv, 1e-6).unwrap();
        assert_eq!(launch.kernel, "nn_rms_norm");
        assert_eq!(launch.args.get::<i32>(6), Some(cols as i32));
        assert_eq!(launch.args.get::<f32>(7), Some(1e-6));
        assert_eq!(launch.config.grid.x, 3);
        let short_weight = w.slice(0, (cols - 8) * BF16).unwrap();
        assert!(
            plan_rms_norm(&x.view(), layout, &y.view_mut(), cols, &short_weight, 1e-6).is_err()
        );
        assert!(
            plan_rms_norm(&x.view(), layout, &y.view_mut(), cols, &w.view(), f32::NAN).is_err()
        );
        let wide = Matrix::dense(1, MAX_NORM_COLS + 8);
        let big = buffer(&ctx, (MAX_NORM_COLS + 8) * BF16);
        let mut big_out = buffer(&ctx, (MAX_NORM_COLS + 8) * BF16);
        let err = plan_rms_norm(
            &big.view(),
            wide,
            &big_out.view_mut(),
            wide.cols,
            &big.view(),
            1e-6,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("8192"), "{err}");
    }

    #[test]
    fn norm_modulate_plan_packs_each_variant_and_checks_the_tables() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (6, 64);
        let x = buffer(&ctx, rows * cols * BF16);
        let mut y = buffer(&ctx, rows * cols * BF16);
        let w = buffer(&ctx, 2 * cols * BF16);
        let table = buffer(&ctx, 3 * 2 * cols * BF16);
        let index = buffer(&ctx, rows * 4);
        let (xv, yv, tv, iv) = (x.view(), y.view_mut(), table.view(), index.view());
        let (wv, bv) = (
            w.slice(0, cols * BF16).unwrap(),
            w.slice(cols * BF16, cols * BF16).unwrap(),
        );
        let layout = Matrix::dense(rows, cols);
        let plain = NormModulate {
            kind: NormKind::RmsNorm,
            weight: None,
            bias: None,
            eps: 1e-6,
            modulation: None,
        };
        let launch = plan_norm_modulate(&xv, layout, &yv, cols, &plain).unwrap();
        assert_eq!(launch.kernel, "nn_norm_modulate");
        assert_eq!(launch.args.len(), 19);
        assert_eq!(launch.args.get::<u64>(4), Some(0));
        assert_eq!(launch.args.get::<i32>(9), Some(0));
        assert_eq!(launch.args.get::<i32>(14), Some(-1));
        assert_eq!(launch.config.grid.x, rows as u32);
        // LayerNorm with weight and bias, scale and shift from a [3, 2 * cols] tensor, samples of 2 rows.
        let modulation = RowModulation {
            data: &tv,
            rows: 3,
            stride: 2 * cols,
            scale_offset: cols,
            shift_offset: Some(0),
            select: ModulationRows::targets_only(2),
            row_index: None,
        };
        let full = NormModulate {
            kind: NormKind::LayerNorm,
            weight: Some(&wv),
            bias: Some(&bv),
            eps: 1e-6,
            modulation: Some(modulation),
        };
        let launch = plan_norm_modulate(&xv, layout, &yv, cols, &full).unwrap();
        assert_eq!(launch.args.get::<i32>(9), Some(1));
        assert_eq!(launch.args.get::<i32>(12), Some(3));
        assert_eq!(launch.args.get::<i32>(13), Some(cols as i32));
        assert_eq!(launch.args.get::<i32>(14), Some(0));
        // Samples of 1 row need 6 modulation rows: refused; a row index picks any of the 3.
        let mut per_row = full;
        per_row.modulation = Some(RowModulation {
            select: ModulationRows::targets_only(1),
            ..modulation
        });
        assert!(plan_norm_modulate(&xv, layout, &yv, cols, &per_row).is_err());
        per_row.modulation = Some(RowModulation {
            row_index: Some(&iv),
            ..modulation
        });
        let launch = plan_norm_modulate(&xv, layout, &yv, cols, &per_row).unwrap();
        assert_eq!(launch.args.get::<u64>(18), Some(iv.addr()));
        // A shift block past the row stride, a bias without a weight, a bad eps: refused.
        let mut bad = full;
        bad.modulation = Some(RowModulation {
            shift_offset: Some(2 * cols),
            ..modulation
        });
        assert!(plan_norm_modulate(&xv, layout, &yv, cols, &bad).is_err());
        let no_weight = NormModulate {
            weight: None,
            ..full
        };
        assert!(plan_norm_modulate(&xv, layout, &yv, cols, &no_weight).is_err());
        let nan = NormModulate {
            eps: f32::NAN,
            ..plain
        };
        assert!(plan_norm_modulate(&xv, layout, &yv, cols, &nan).is_err());
    }
}
