//! Row norms: the affine RMSNorm of Qwen3-style text models ([`plan_rms_norm`]), plus the pieces every adaLN-style
//! kernel shares: the row-norm argument packing, the modulation-row rule ([`ModulationRows`]) and modulation
//! blocks ([`Modulation`]). Kernel set `nn_norm`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{DeviceView, DeviceViewMut, Stream};

use super::launch::{check_matrix, invalid, to_i32, to_u32, Launch, Matrix, Operand, ROW_THREADS};
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
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(invalid(OP, format!("eps {eps} must be finite and >= 0")));
    }
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

impl NnKernels {
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
}
