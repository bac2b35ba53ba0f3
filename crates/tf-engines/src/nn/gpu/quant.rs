//! Launchers of the FP8 quantizing kernels (`kernels/nn/quant.cu`, kernel set `nn_quant`): each writes an FP8
//! GEMM's input as e4m3 codes with one f32 scale per row, computed inside the kernel that produces the row, so
//! the activations are never read a second time to be quantized.
//!
//! - [`plan_norm_modulate_fp8`]: LayerNorm / RMSNorm, affine or not, optionally `* (1 + scale) (+ shift)`: the
//!   [`NormModulate`] of `nn_norm_modulate` with an FP8 output (the adaLN before a QKV or MLP-in GEMM).
//! - [`plan_gated_residual_norm_modulate_fp8`]: `x += g * y` (`g = tanh(gate)` or `gate`), stored in bf16, then the
//!   same norm with an FP8 output, in one pass (a block's residual fused with the next norm).
//! - [`plan_swiglu_fp8`]: SwiGLU of a fused GEMM output with an FP8 output (the MLP-out GEMM's input);
//!   [`plan_swiglu_fp8_apart`] over the two halves held apart (a projection run as two GEMMs).
//! - [`plan_quantize_rows_fp8`]: a bf16 matrix as FP8 rows (where the producer cannot quantize: the attention
//!   output before the output projection).
//!
//! The scale rule is [`crate::nn::fp8`]'s: `amax / 448` per row, codes `e4m3(value * (1 / scale))`; an FP8 GEMM
//! with row-wise scales ([`super::gemm::Fp8Linear`]) multiplies them back. Codes are written with a row stride in
//! bytes (a multiple of 16, the FP8 GEMM's alignment); scales are f32, 16-byte aligned.
//!
//! [`QuantKernels`] holds the loaded set on its own (a model loads it only when it runs FP8), and submits.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use super::act::SwigluHalves;
use super::launch::{
    bytes_of, check_aligned_to, check_bytes, check_matrix, check_operand, invalid, stride_grid,
    to_i32, to_u32, Launch, LoadKernelsError, LoadedSet, Matrix, Operand, ROW_THREADS,
};
use super::norm::{
    check_modulation, check_norm_cols, check_row_index, push_norm, Modulation, ModulationRows,
    NormKind, NormModulate,
};
use super::SwigluOrder;
use crate::nn::fp8::RowCodes;

/// Name of the kernel set holding the quantizing kernels.
pub const QUANT_SET: &str = "nn_quant";

/// The kernels of [`QUANT_SET`].
pub const QUANT_KERNELS: &[&str] = &[
    "nn_quantize_rows_fp8",
    "nn_quantize_rows_int8",
    "nn_dequantize_rows_bf16",
    "nn_norm_modulate_fp8",
    "nn_norm_modulate_fp8_c2",
    "nn_gated_residual_norm_modulate_fp8",
    "nn_gated_residual_norm_modulate_fp8_c2",
    "nn_gated_residual_norm_modulate_fp8_and_bf16",
    "nn_gated_residual_norm_modulate_fp8_and_bf16_c2",
    "nn_gated_residual_norm_modulate_fp8_and_int8",
    "nn_gated_residual_norm_modulate_fp8_and_int8_c2",
    "nn_norm_modulate_int8",
    "nn_norm_modulate_int8_c2",
    "nn_gated_residual_norm_modulate_int8",
    "nn_gated_residual_norm_modulate_int8_c2",
    "nn_swiglu_fp8",
    "nn_swiglu_int8",
    "nn_swiglu_i32gate_fp8",
];

/// Most columns the SwiGLU and plain row quantizers hold in registers (up to 1024 threads x 16 values). The norm
/// variants hold [`super::MAX_NORM_COLS`].
pub const MAX_QUANT_COLS: usize = 16384;

/// Columns each thread of the SwiGLU and plain row quantizers holds (NN_WIDE_CHUNKS x 8 in kernels/nn/quant.cu).
const WIDE_VALUES_PER_THREAD: usize = 16;
/// Dynamic shared memory of `nn_swiglu_i32gate_fp8` a thread: its 16 f32 results.
const SWIGLU_I32GATE_SHARED_PER_THREAD: u32 = (WIDE_VALUES_PER_THREAD * 4) as u32;
/// The most `nn_swiglu_i32gate_fp8` asks for (1024 threads), set as its limit at load.
const SWIGLU_I32GATE_MAX_SHARED: u32 = 1024 * SWIGLU_I32GATE_SHARED_PER_THREAD;

/// Most columns the norm kernels' `_c2` entry points hold (256 threads x 2 chunks of 8): the same results as the
/// plain entry points in fewer registers, so more rows share an SM.
const NARROW_NORM_COLS: usize = 4096;

/// The norm kernel for rows of `cols` columns: its `_c2` entry point when the row fits it.
fn norm_kernel(plain: &'static str, narrow: &'static str, cols: usize) -> &'static str {
    if cols <= NARROW_NORM_COLS {
        narrow
    } else {
        plain
    }
}

/// Alignment (bytes) of the code rows and the scales: the FP8 GEMM's operand alignment.
pub const FP8_ALIGN: usize = 16;

/// Where a quantizing kernel writes: e4m3 codes, `stride` bytes from one row to the next (a multiple of 16), and
/// one f32 scale per row in `scales`.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Rows<'v, 'a> {
    pub codes: &'v DeviceViewMut<'a>,
    pub stride: usize,
    pub scales: &'v DeviceViewMut<'a>,
}

/// Checks an FP8 output of `rows` x `cols` (cols already checked as a multiple of 8 by the input's matrix).
fn check_fp8_rows(
    op: &str,
    out: &Fp8Rows<'_, '_>,
    rows: usize,
    cols: usize,
) -> Result<(), tf_cuda::Error> {
    if out.stride < cols || !out.stride.is_multiple_of(FP8_ALIGN) {
        return Err(invalid(
            op,
            format!(
                "FP8 codes: row stride {} B must be at least the {cols} columns and a multiple of {FP8_ALIGN}",
                out.stride
            ),
        ));
    }
    let codes = Operand::of_mut(out.codes);
    let scales = Operand::of_mut(out.scales);
    check_aligned_to(op, "FP8 codes", codes, FP8_ALIGN as u64)?;
    check_aligned_to(op, "FP8 scales", scales, FP8_ALIGN as u64)?;
    let code_bytes = strided_bytes(rows, out.stride, cols, 1)
        .ok_or_else(|| invalid(op, "FP8 codes size overflows"))?;
    let scale_bytes = rows
        .checked_mul(4)
        .ok_or_else(|| invalid(op, "FP8 scales size overflows"))?;
    check_bytes(op, "FP8 codes", codes, code_bytes)?;
    check_bytes(op, "FP8 scales", scales, scale_bytes)?;
    let end = |o: Operand, len: usize| o.addr.saturating_add(len as u64);
    if code_bytes > 0
        && scale_bytes > 0
        && codes.addr < end(scales, scale_bytes)
        && scales.addr < end(codes, code_bytes)
    {
        return Err(invalid(op, "FP8 codes and scales overlap"));
    }
    Ok(())
}

/// Bytes `rows` rows of `cols` elements of `elem` bytes span, `stride` elements apart (the last row only up to its
/// `cols`); `None` on overflow.
fn strided_bytes(rows: usize, stride: usize, cols: usize, elem: usize) -> Option<usize> {
    match rows {
        0 => Some(0),
        _ => (rows - 1)
            .checked_mul(stride)
            .and_then(|n| n.checked_add(cols))
            .and_then(|n| n.checked_mul(elem)),
    }
}

fn push_fp8_rows(args: &mut Args, op: &str, out: &Fp8Rows<'_, '_>) -> Result<(), tf_cuda::Error> {
    args.push_addr(out.codes.addr())
        .push(to_i32(op, "FP8 code stride", out.stride)?)
        .push_addr(out.scales.addr());
    Ok(())
}

fn row_config(op: &str, rows: usize) -> Result<LaunchConfig, tf_cuda::Error> {
    Ok(LaunchConfig::new(
        to_u32(op, "rows", rows.max(1))?,
        ROW_THREADS,
    ))
}

/// One block per row of `ceil(cols / 16)` threads rounded up to a warp: the SwiGLU and plain row quantizers'
/// grid (`cols <= MAX_QUANT_COLS`, checked first, so at most 1024 threads).
fn wide_config(op: &str, rows: usize, cols: usize) -> Result<LaunchConfig, tf_cuda::Error> {
    let threads = cols.div_ceil(WIDE_VALUES_PER_THREAD).next_multiple_of(32);
    Ok(LaunchConfig::new(
        to_u32(op, "rows", rows.max(1))?,
        to_u32(op, "threads", threads)?,
    ))
}

fn check_wide_cols(op: &str, cols: usize) -> Result<(), tf_cuda::Error> {
    if cols == 0 || cols > MAX_QUANT_COLS {
        return Err(invalid(
            op,
            format!("rows of {cols} columns: the kernel quantizes 8..={MAX_QUANT_COLS} columns"),
        ));
    }
    Ok(())
}

/// Builds `codes, scales = quantize(x)` row by row (kernel nn_quantize_rows_fp8), `cols <= 16384`.
pub fn plan_quantize_rows_fp8<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    out: &Fp8Rows<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_quantize_rows(x, x_layout, out, RowCodes::E4m3)
}

/// [`plan_quantize_rows_fp8`] into `codes`: e4m3 (kernel nn_quantize_rows_fp8) or INT8 rows with scale
/// `amax / 127` (kernel nn_quantize_rows_int8, the weight-only layers' format; [`crate::nn::fp8::RowCodes`]).
pub fn plan_quantize_rows<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    out: &Fp8Rows<'a, '_>,
    codes: RowCodes,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let (op, kernel) = match codes {
        RowCodes::E4m3 => ("quantize_rows_fp8", "nn_quantize_rows_fp8"),
        RowCodes::Int8 => ("quantize_rows_int8", "nn_quantize_rows_int8"),
    };
    check_wide_cols(op, x_layout.cols)?;
    check_matrix(op, "x", Operand::of(x), x_layout)?;
    check_fp8_rows(op, out, x_layout.rows, x_layout.cols)?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(op, "x stride", x_layout.stride)?);
    push_fp8_rows(&mut args, op, out)?;
    args.push(to_i32(op, "rows", x_layout.rows)?)
        .push(to_i32(op, "cols", x_layout.cols)?);
    Ok(Launch::new(
        kernel,
        wide_config(op, x_layout.rows, x_layout.cols)?,
        args,
    ))
}

/// Builds `w = dequantize(codes, scales)` (kernel nn_dequantize_rows_bf16): dense 8-bit rows `[rows, cols]` in the
/// format `format`, each code times its row's f32 scale, rounded once to bf16 into dense rows of `cols` (what
/// [`crate::nn::fp8::RowCodes::dequantize_rows`] computes, rounded to bf16). `cols` a multiple of 16.
pub fn plan_dequantize_rows_bf16<'a>(
    codes: &'a DeviceView<'_>,
    scales: &'a DeviceView<'_>,
    format: RowCodes,
    (rows, cols): (usize, usize),
    w: &'a DeviceViewMut<'_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "dequantize_rows_bf16";
    if rows == 0 || cols == 0 || !cols.is_multiple_of(16) {
        return Err(invalid(
            OP,
            format!("{rows} x {cols}: at least one row, columns a positive multiple of 16"),
        ));
    }
    let elements = bytes_of(OP, "codes", &[rows, cols])?;
    check_operand(OP, "codes", Operand::of(codes), elements, 16)?;
    check_operand(
        OP,
        "scales",
        Operand::of(scales),
        bytes_of(OP, "scales", &[rows, 4])?,
        4,
    )?;
    check_operand(
        OP,
        "w",
        Operand::of_mut(w),
        bytes_of(OP, "w", &[elements, 2])?,
        16,
    )?;
    let mut args = Args::new();
    args.push_addr(codes.addr())
        .push_addr(scales.addr())
        .push(i32::from(format == RowCodes::Int8))
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "cols", cols)?)
        .push_addr(w.addr());
    Ok(Launch::new(
        "nn_dequantize_rows_bf16",
        stride_grid(OP, elements / 16, 256)?,
        args,
    ))
}

/// Builds a [`NormModulate`] of `x` with an FP8 output (kernel nn_norm_modulate_fp8): the f32 values
/// `nn_norm_modulate` would round to bf16, quantized per row instead. `cols <= 8192`.
pub fn plan_norm_modulate_fp8<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    out: &Fp8Rows<'a, '_>,
    norm: &NormModulate<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_norm_modulate_codes(x, x_layout, x_layout.cols, (out, RowCodes::E4m3), norm)
}

/// Checks the width an RMSNorm divides by: the row's columns, or fewer when the columns past the model's width
/// are zero padding (RMSNorm only: a LayerNorm's mean would see the padding).
fn check_norm_width(
    op: &str,
    norm: &NormModulate<'_, '_>,
    cols: usize,
    norm_cols: usize,
) -> Result<(), tf_cuda::Error> {
    if norm_cols == 0 || norm_cols > cols {
        return Err(invalid(
            op,
            format!("the norm's width {norm_cols} must be 1..={cols} (the row's columns)"),
        ));
    }
    if norm_cols != cols && norm.kind == NormKind::LayerNorm {
        return Err(invalid(
            op,
            "a LayerNorm over zero-padded rows is not supported (only RMSNorm divides by the model's width)",
        ));
    }
    Ok(())
}

/// [`plan_norm_modulate_fp8`] of rows zero-padded past the model's width `norm_cols` (an RMSNorm divides the sum of
/// squares by `norm_cols`; the padding columns must hold zeros in `x` and in the weight and modulation, so their
/// codes are zero) into 8-bit codes of either format: `out` with its `codes`, e4m3 (kernel nn_norm_modulate_fp8) or
/// INT8 with scale `amax / 127` a row (kernel nn_norm_modulate_int8, the input of an INT8 GEMM).
pub fn plan_norm_modulate_codes<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    norm_cols: usize,
    (out, codes): (&Fp8Rows<'a, '_>, RowCodes),
    norm: &NormModulate<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    let (op, plain, narrow) = match codes {
        RowCodes::E4m3 => (
            "norm_modulate_fp8",
            "nn_norm_modulate_fp8",
            "nn_norm_modulate_fp8_c2",
        ),
        RowCodes::Int8 => (
            "norm_modulate_int8",
            "nn_norm_modulate_int8",
            "nn_norm_modulate_int8_c2",
        ),
    };
    check_norm_cols(op, x_layout.cols)?;
    check_norm_width(op, norm, x_layout.cols, norm_cols)?;
    check_matrix(op, "x", Operand::of(x), x_layout)?;
    check_fp8_rows(op, out, x_layout.rows, x_layout.cols)?;
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(op, "x stride", x_layout.stride)?);
    push_fp8_rows(&mut args, op, out)?;
    push_norm(
        &mut args,
        op,
        x_layout,
        norm,
        (ModulationRows::targets_only(1), 0),
    )?;
    args.push(to_i32(op, "norm width", norm_cols)?);
    Ok(Launch::new(
        norm_kernel(plain, narrow, x_layout.cols),
        row_config(op, x_layout.rows)?,
        args,
    ))
}

/// The gate of a gated residual `x += g * y`: a column block of a modulation-style table (`rows` rows of
/// `stride` bf16), `g = tanh(gate)` when `tanh` (Qwen-Image) else the gate itself (MiniMax H3). Row `r` uses the
/// table row its [`ModulationRows`] rule (or `row_index`) selects, clamped to the table.
#[derive(Clone, Copy, Debug)]
pub struct ResidualGate<'v, 'a> {
    pub data: &'v DeviceView<'a>,
    pub rows: usize,
    pub stride: usize,
    pub offset: usize,
    pub tanh: bool,
    pub select: ModulationRows,
    /// One i32 table row per activation row; when given it decides (for the norm's modulation too).
    pub row_index: Option<&'v DeviceView<'a>>,
}

/// Builds the gated residual `x += g * y` (in place on `x`, stored rounded to bf16) followed by the
/// [`NormModulate`] of the stored `x` with an FP8 output (kernel nn_gated_residual_norm_modulate_fp8), in one
/// pass. The norm's modulation, if any, must select rows the way the gate does (the same rule, or the same
/// row index); its table may differ from the gate's. With tanh gates and `LayerNorm * (1 + scale)` the residual
/// is bit-identical to Qwen-Image's `qi_gated_residual_adaln`. `cols <= 8192`.
#[allow(clippy::too_many_arguments)]
pub fn plan_gated_residual_norm_modulate_fp8<'a>(
    x: &'a DeviceViewMut<'_>,
    x_layout: Matrix,
    y: &'a DeviceView<'_>,
    y_stride: usize,
    gate: &ResidualGate<'a, '_>,
    out: &Fp8Rows<'a, '_>,
    norm: &NormModulate<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_gated_residual_norm_modulate_with(
        x,
        x_layout,
        x_layout.cols,
        (y, y_stride),
        gate,
        (out, RowCodes::E4m3),
        norm,
        None,
    )
}

/// A second copy of the normed rows a gated residual's FP8 norm writes in the same pass, for a GEMM beside the FP8
/// one over the same rows (MiniMax H3's `fc1` run as two halves).
#[derive(Clone, Copy)]
pub enum SecondRows<'v, 'a> {
    /// bf16 rows at `h`, `stride` elements apart (the input of a bf16 GEMM; kernel
    /// nn_gated_residual_norm_modulate_fp8_and_bf16).
    Bf16 {
        h: &'v DeviceViewMut<'a>,
        stride: usize,
    },
    /// INT8 codes with one f32 scale a row, amax / 127 (the input of an INT8 GEMM; kernel
    /// nn_gated_residual_norm_modulate_fp8_and_int8).
    Int8(&'v Fp8Rows<'v, 'a>),
}

/// [`plan_gated_residual_norm_modulate_fp8`] of rows zero-padded past the model's width `norm_cols` (as
/// [`plan_norm_modulate_codes`]; the padding columns of `x`, `y` and the gate must hold zeros) into 8-bit codes
/// of either format (`out` with its `codes`: e4m3, kernel nn_gated_residual_norm_modulate_fp8, or INT8 with scale
/// `amax / 127` a row, kernel nn_gated_residual_norm_modulate_int8) that, given `second` (e4m3 only), also writes the
/// normed rows in bf16 or as INT8 codes in the same pass ([`SecondRows`]).
#[allow(clippy::too_many_arguments)]
pub fn plan_gated_residual_norm_modulate_with<'a>(
    x: &'a DeviceViewMut<'_>,
    x_layout: Matrix,
    norm_cols: usize,
    (y, y_stride): (&'a DeviceView<'_>, usize),
    gate: &ResidualGate<'a, '_>,
    (out, codes): (&Fp8Rows<'a, '_>, RowCodes),
    norm: &NormModulate<'a, '_>,
    second: Option<SecondRows<'a, '_>>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "gated_residual_norm_modulate_fp8";
    if codes == RowCodes::Int8 && second.is_some() {
        return Err(invalid(
            OP,
            "INT8 rows come alone: no kernel writes a second copy beside them",
        ));
    }
    let cols = x_layout.cols;
    match second {
        Some(SecondRows::Bf16 { h, stride }) => {
            check_matrix(OP, "h", Operand::of_mut(h), x_layout.with_stride(stride))?
        }
        Some(SecondRows::Int8(rows)) => check_fp8_rows(OP, rows, x_layout.rows, cols)?,
        None => {}
    }
    check_norm_cols(OP, cols)?;
    check_norm_width(OP, norm, cols, norm_cols)?;
    check_matrix(OP, "x", Operand::of_mut(x), x_layout)?;
    check_matrix(OP, "y", Operand::of(y), x_layout.with_stride(y_stride))?;
    check_fp8_rows(OP, out, x_layout.rows, cols)?;
    if gate.rows == 0 {
        return Err(invalid(OP, "the gate table needs at least one row"));
    }
    let gate_block = Modulation {
        data: gate.data,
        rows: gate.rows,
        stride: gate.stride,
        offset: gate.offset,
    };
    let gate_index = match gate.row_index {
        Some(index) => {
            check_modulation(
                OP,
                &gate_block,
                cols,
                gate.rows,
                ModulationRows::targets_only(1),
            )?;
            Some(check_row_index(OP, index, x_layout.rows)?)
        }
        None => {
            check_modulation(OP, &gate_block, cols, x_layout.rows, gate.select)?;
            None
        }
    };
    if let Some(m) = &norm.modulation {
        let same = match (gate_index, m.row_index) {
            (Some(g), Some(n)) => g == n.addr(),
            (None, None) => m.select == gate.select,
            _ => false,
        };
        if !same {
            return Err(invalid(
                OP,
                "the norm's modulation must select rows as the gate does (the same rule, or the same row index)",
            ));
        }
    }
    let mut args = Args::new();
    args.push_addr(x.addr())
        .push(to_i32(OP, "x stride", x_layout.stride)?)
        .push_addr(y.addr())
        .push(to_i32(OP, "y stride", y_stride)?)
        .push_addr(gate.data.addr())
        .push(to_i32(OP, "gate stride", gate.stride)?)
        .push(to_i32(OP, "gate rows", gate.rows)?)
        .push(to_i32(OP, "gate offset", gate.offset)?)
        .push(i32::from(gate.tanh));
    push_fp8_rows(&mut args, OP, out)?;
    push_norm(
        &mut args,
        OP,
        x_layout,
        norm,
        (gate.select, gate_index.unwrap_or(0)),
    )?;
    args.push(to_i32(OP, "norm width", norm_cols)?);
    let (plain, narrow) = match second {
        Some(SecondRows::Bf16 { h, stride }) => {
            args.push_addr(h.addr())
                .push(to_i32(OP, "h stride", stride)?);
            (
                "nn_gated_residual_norm_modulate_fp8_and_bf16",
                "nn_gated_residual_norm_modulate_fp8_and_bf16_c2",
            )
        }
        Some(SecondRows::Int8(rows)) => {
            push_fp8_rows(&mut args, OP, rows)?;
            (
                "nn_gated_residual_norm_modulate_fp8_and_int8",
                "nn_gated_residual_norm_modulate_fp8_and_int8_c2",
            )
        }
        None => {
            args.push_addr(0).push(0i32);
            match codes {
                RowCodes::E4m3 => (
                    "nn_gated_residual_norm_modulate_fp8",
                    "nn_gated_residual_norm_modulate_fp8_c2",
                ),
                RowCodes::Int8 => (
                    "nn_gated_residual_norm_modulate_int8",
                    "nn_gated_residual_norm_modulate_int8_c2",
                ),
            }
        }
    };
    Ok(Launch::new(
        norm_kernel(plain, narrow, cols),
        row_config(OP, x_layout.rows)?,
        args,
    ))
}

/// Builds SwiGLU of a fused matrix of `2 * hidden` columns (halves in `order`) with an FP8 output (kernel
/// nn_swiglu_fp8): `silu(gate) * value` in f32, quantized per row. `hidden <= 16384`.
pub fn plan_swiglu_fp8<'a>(
    order: SwigluOrder,
    fused: &'a DeviceView<'_>,
    fused_layout: Matrix,
    out: &Fp8Rows<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_swiglu_codes(order, fused, fused_layout, out, RowCodes::E4m3)
}

/// [`plan_swiglu_fp8`] into 8-bit codes of either format: e4m3 (kernel nn_swiglu_fp8) or INT8 with scale
/// `amax / 127` a row (kernel nn_swiglu_int8, the input of an INT8 GEMM).
pub fn plan_swiglu_codes<'a>(
    order: SwigluOrder,
    fused: &'a DeviceView<'_>,
    fused_layout: Matrix,
    out: &Fp8Rows<'a, '_>,
    codes: RowCodes,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "swiglu_fp8";
    swiglu_fp8(
        OP,
        SwigluHalves::fused(OP, order, fused, fused_layout)?,
        out,
        codes,
    )
}

/// [`plan_swiglu_fp8`] over the two halves held apart, each `layout` (a projection run as two GEMMs, one per half).
pub fn plan_swiglu_fp8_apart<'a>(
    value: &'a DeviceView<'_>,
    gate: &'a DeviceView<'_>,
    layout: Matrix,
    out: &Fp8Rows<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_swiglu_codes_apart(value, gate, layout, out, RowCodes::E4m3)
}

/// [`plan_swiglu_fp8_apart`] into 8-bit codes of either format: e4m3 (kernel nn_swiglu_fp8) or INT8 with scale
/// `amax / 127` a row (kernel nn_swiglu_int8, the input of an INT8 GEMM).
pub fn plan_swiglu_codes_apart<'a>(
    value: &'a DeviceView<'_>,
    gate: &'a DeviceView<'_>,
    layout: Matrix,
    out: &Fp8Rows<'a, '_>,
    codes: RowCodes,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "swiglu_fp8_apart";
    swiglu_fp8(
        OP,
        SwigluHalves::apart(OP, value, gate, layout)?,
        out,
        codes,
    )
}

/// The gate half of a SwiGLU as an INT8 GEMM left it: exact int32 products `[rows, hidden]` (`stride` int32 apart),
/// with the activation rows' INT8 scales (`rows` f32) and the weight rows' (`hidden` f32).
pub struct Int32Gate<'v, 'a> {
    pub products: &'v DeviceView<'a>,
    pub stride: usize,
    pub row_scales: &'v DeviceView<'a>,
    pub col_scales: &'v DeviceView<'a>,
}

/// SwiGLU of a bf16 value half (`value_layout`) and an INT8 GEMM's gate half with an FP8 output (kernel
/// nn_swiglu_i32gate_fp8): the gate `float(product) * (row scale * column scale)` rounded to bf16, then
/// `silu(gate) * value` in f32, quantized per row. `hidden <= 16384`.
pub fn plan_swiglu_i32gate_fp8<'a>(
    value: &'a DeviceView<'_>,
    value_layout: Matrix,
    gate: &Int32Gate<'a, '_>,
    out: &Fp8Rows<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "swiglu_i32gate_fp8";
    let (rows, hidden) = (value_layout.rows, value_layout.cols);
    check_wide_cols(OP, hidden)?;
    check_matrix(OP, "value", Operand::of(value), value_layout)?;
    // int32 products, rows `stride` elements apart.
    if gate.stride < hidden || !gate.stride.is_multiple_of(4) {
        return Err(invalid(
            OP,
            format!(
                "gate products: row stride {} must be at least the {hidden} columns and a multiple of 4",
                gate.stride
            ),
        ));
    }
    let product_bytes = strided_bytes(rows, gate.stride, hidden, 4)
        .ok_or_else(|| invalid(OP, "gate products size overflows"))?;
    let scale_bytes = |n: usize| {
        n.checked_mul(4)
            .ok_or_else(|| invalid(OP, "gate scales size overflows"))
    };
    check_operand(
        OP,
        "gate products",
        Operand::of(gate.products),
        product_bytes,
        16,
    )?;
    check_operand(
        OP,
        "gate row scales",
        Operand::of(gate.row_scales),
        scale_bytes(rows)?,
        4,
    )?;
    check_operand(
        OP,
        "gate column scales",
        Operand::of(gate.col_scales),
        scale_bytes(hidden)?,
        16,
    )?;
    check_fp8_rows(OP, out, rows, hidden)?;
    let mut args = Args::new();
    args.push_addr(value.addr())
        .push(to_i32(OP, "value stride", value_layout.stride)?)
        .push_addr(gate.products.addr())
        .push(to_i32(OP, "gate stride", gate.stride)?)
        .push_addr(gate.row_scales.addr())
        .push_addr(gate.col_scales.addr());
    push_fp8_rows(&mut args, OP, out)?;
    args.push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "hidden", hidden)?);
    let config = wide_config(OP, rows, hidden)?;
    // Each thread parks its results in dynamic shared memory (the kernel's NN_SWIGLU_I32GATE_SHARED_PER_THREAD).
    let shared = config.block.x * SWIGLU_I32GATE_SHARED_PER_THREAD;
    Ok(Launch::new(
        "nn_swiglu_i32gate_fp8",
        config.with_shared(shared),
        args,
    ))
}

fn swiglu_fp8<'a>(
    op: &'static str,
    halves: SwigluHalves,
    out: &Fp8Rows<'a, '_>,
    codes: RowCodes,
) -> Result<Launch<'a>, tf_cuda::Error> {
    check_wide_cols(op, halves.hidden)?;
    check_fp8_rows(op, out, halves.rows, halves.hidden)?;
    let mut args = Args::new();
    args.push_addr(halves.gate)
        .push_addr(halves.value)
        .push(to_i32(op, "input stride", halves.stride)?);
    push_fp8_rows(&mut args, op, out)?;
    args.push(to_i32(op, "rows", halves.rows)?)
        .push(to_i32(op, "hidden", halves.hidden)?);
    let kernel = match codes {
        RowCodes::E4m3 => "nn_swiglu_fp8",
        RowCodes::Int8 => "nn_swiglu_int8",
    };
    Ok(Launch::new(
        kernel,
        wide_config(op, halves.rows, halves.hidden)?,
        args,
    ))
}

/// The loaded `nn_quant` set of one context.
pub struct QuantKernels {
    set: LoadedSet,
}

impl std::fmt::Debug for QuantKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl QuantKernels {
    /// Loads the `nn_quant` set into `ctx`.
    pub fn load(ctx: &Context) -> Result<QuantKernels, LoadKernelsError> {
        let mut set = LoadedSet::empty();
        set.add(ctx, QUANT_SET, QUANT_KERNELS, |name, function| {
            if name == "nn_swiglu_i32gate_fp8" {
                // Past the 48 KB a block gets without asking (57 KB at 14336 columns).
                function.set_max_dynamic_shared(SWIGLU_I32GATE_MAX_SHARED)?;
            }
            Ok(true)
        })?;
        Ok(QuantKernels { set })
    }

    /// Submits a launch built by one of this module's `plan_*` functions.
    pub fn submit(&self, stream: &Stream, launch: &Launch<'_>) -> Result<(), tf_cuda::Error> {
        self.set.submit(stream, launch)
    }

    /// Submits the launch a `plan_*` function built, or passes its error on.
    pub fn run(
        &self,
        stream: &Stream,
        plan: Result<Launch<'_>, tf_cuda::Error>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gpu::norm::NormKind;
    use crate::nn::gpu::test_support::{buffer, context, BF16};
    use crate::nn::gpu::RowModulation;
    use tf_testdriver::test_lock;

    #[test]
    fn dequantize_rows_packs_the_format_and_checks_sizes() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (7, 48);
        let codes = buffer(&ctx, rows * cols);
        let scales = buffer(&ctx, rows * 4);
        let mut w = buffer(&ctx, rows * cols * BF16);
        let (cv, sv, wv) = (codes.view(), scales.view(), w.view_mut());
        let launch =
            plan_dequantize_rows_bf16(&cv, &sv, RowCodes::Int8, (rows, cols), &wv).unwrap();
        assert_eq!(launch.kernel(), "nn_dequantize_rows_bf16");
        assert_eq!(launch.args().get::<u64>(0), Some(cv.addr()));
        assert_eq!(launch.args().get::<i32>(2), Some(1));
        assert_eq!(launch.args().get::<i32>(4), Some(cols as i32));
        assert_eq!(launch.args().get::<u64>(5), Some(wv.addr()));
        // 21 chunks of 16 codes: one block.
        assert_eq!(launch.config().grid.x, 1);
        let e4m3 = plan_dequantize_rows_bf16(&cv, &sv, RowCodes::E4m3, (rows, cols), &wv).unwrap();
        assert_eq!(e4m3.args().get::<i32>(2), Some(0));
        // Columns not a multiple of 16, more rows than the codes, scales or output hold: refused.
        assert!(plan_dequantize_rows_bf16(&cv, &sv, RowCodes::Int8, (rows, 40), &wv).is_err());
        assert!(
            plan_dequantize_rows_bf16(&cv, &sv, RowCodes::Int8, (rows + 1, cols), &wv).is_err()
        );
        assert!(plan_dequantize_rows_bf16(&cv, &sv, RowCodes::Int8, (0, cols), &wv).is_err());
    }

    #[test]
    fn quantize_rows_packs_codes_and_scales_and_checks_them() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (5, 96);
        let x = buffer(&ctx, rows * cols * BF16);
        let mut codes = buffer(&ctx, rows * 112);
        let mut scales = buffer(&ctx, rows * 4 + 12);
        let (xv, cv, sv) = (x.view(), codes.view_mut(), scales.view_mut());
        let _ = (&cv, &sv);
        let out = Fp8Rows {
            codes: &cv,
            stride: 112,
            scales: &sv,
        };
        let launch = plan_quantize_rows_fp8(&xv, Matrix::dense(rows, cols), &out).unwrap();
        assert_eq!(launch.kernel(), "nn_quantize_rows_fp8");
        assert_eq!(launch.args().len(), 7);
        assert_eq!(launch.args().get::<u64>(2), Some(cv.addr()));
        assert_eq!(launch.args().get::<i32>(3), Some(112));
        assert_eq!(launch.args().get::<u64>(4), Some(sv.addr()));
        assert_eq!(launch.args().get::<i32>(6), Some(cols as i32));
        assert_eq!(launch.config().grid.x, rows as u32);
        // 96 columns, 16 a thread: 6 threads, one warp.
        assert_eq!(launch.config().block.x, 32);
        // INT8 rows: the same arguments and grid, its own kernel.
        let int8 =
            plan_quantize_rows(&xv, Matrix::dense(rows, cols), &out, RowCodes::Int8).unwrap();
        assert_eq!(int8.kernel(), "nn_quantize_rows_int8");
        assert_eq!(int8.args().len(), launch.args().len());
        assert_eq!(int8.args().get::<u64>(2), Some(cv.addr()));
        assert_eq!(int8.config().grid.x, launch.config().grid.x);
        assert_eq!(int8.config().block.x, launch.config().block.x);
        // A stride that is not a multiple of 16, or shorter than the row: refused.
        for stride in [100, 80] {
            let bad = Fp8Rows { stride, ..out };
            let err = plan_quantize_rows_fp8(&xv, Matrix::dense(rows, cols), &bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains("row stride"), "{err}");
        }
        // Too few codes or scales for the rows, misaligned scales.
        let mut short_codes = buffer(&ctx, 4 * 112 + 95);
        let short = short_codes.view_mut();
        let err = plan_quantize_rows_fp8(
            &xv,
            Matrix::dense(rows, cols),
            &Fp8Rows {
                codes: &short,
                ..out
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("FP8 codes: needs 544 B"), "{err}");
        let mut few_scales = buffer(&ctx, 64);
        let few = few_scales.slice_mut(0, 16).unwrap();
        assert!(plan_quantize_rows_fp8(
            &xv,
            Matrix::dense(rows, cols),
            &Fp8Rows {
                scales: &few,
                ..out
            }
        )
        .is_err());
        let odd = few_scales.slice_mut(4, 32).unwrap();
        let err = plan_quantize_rows_fp8(
            &xv,
            Matrix::dense(rows, cols),
            &Fp8Rows {
                scales: &odd,
                ..out
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("16-byte aligned"), "{err}");
        // Wider than the kernel holds.
        let wide = buffer(&ctx, (MAX_QUANT_COLS + 8) * BF16);
        let err = plan_quantize_rows_fp8(&wide.view(), Matrix::dense(1, MAX_QUANT_COLS + 8), &out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("16384"), "{err}");
    }

    #[test]
    fn norm_modulate_fp8_packs_as_the_bf16_kernel_with_an_fp8_output() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (6, 64);
        let x = buffer(&ctx, rows * cols * BF16);
        let mut codes = buffer(&ctx, rows * cols);
        let mut scales = buffer(&ctx, rows * 4);
        let table = buffer(&ctx, 3 * 2 * cols * BF16);
        let w = buffer(&ctx, cols * BF16);
        let (xv, cv, sv, tv, wv) = (
            x.view(),
            codes.view_mut(),
            scales.view_mut(),
            table.view(),
            w.view(),
        );
        let out = Fp8Rows {
            codes: &cv,
            stride: cols,
            scales: &sv,
        };
        let modulation = RowModulation {
            data: &tv,
            rows: 3,
            stride: 2 * cols,
            scale_offset: cols,
            shift_offset: Some(0),
            select: ModulationRows::targets_only(2),
            row_index: None,
        };
        let norm = NormModulate {
            kind: NormKind::RmsNorm,
            weight: Some(&wv),
            bias: None,
            eps: 1e-6,
            modulation: Some(modulation),
        };
        let launch = plan_norm_modulate_fp8(&xv, Matrix::dense(rows, cols), &out, &norm).unwrap();
        assert_eq!(launch.kernel(), "nn_norm_modulate_fp8_c2");
        // nn_norm_modulate's 19 arguments with (q, q_stride, scales) in place of (y, y_stride), then the width.
        assert_eq!(launch.args().len(), 21);
        assert_eq!(launch.args().get::<i32>(20), Some(cols as i32));
        assert_eq!(launch.args().get::<u64>(5), Some(wv.addr()));
        assert_eq!(launch.args().get::<i32>(10), Some(0)); // RMSNorm
        assert_eq!(launch.args().get::<u64>(11), Some(tv.addr()));
        assert_eq!(launch.args().get::<i32>(13), Some(3));
        assert_eq!(launch.args().get::<i32>(14), Some(cols as i32));
        assert_eq!(launch.args().get::<i32>(15), Some(0));
        // INT8 codes: the same arguments to the INT8 entry point.
        let int8 = plan_norm_modulate_codes(
            &xv,
            Matrix::dense(rows, cols),
            cols,
            (&out, RowCodes::Int8),
            &norm,
        )
        .unwrap();
        assert_eq!(int8.kernel(), "nn_norm_modulate_int8_c2");
        assert!(same_args(int8.args(), launch.args()));
        assert_eq!(launch.args().get::<i32>(16), Some(2));
        // Samples of one row need 6 modulation rows: refused.
        let per_row = NormModulate {
            modulation: Some(RowModulation {
                select: ModulationRows::targets_only(1),
                ..modulation
            }),
            ..norm
        };
        assert!(plan_norm_modulate_fp8(&xv, Matrix::dense(rows, cols), &out, &per_row).is_err());
        let plain = NormModulate {
            kind: NormKind::LayerNorm,
            weight: None,
            bias: None,
            eps: 1e-6,
            modulation: None,
        };
        // An RMSNorm over rows zero-padded past the model's width divides by that width; a LayerNorm cannot.
        let padded = plan_norm_modulate_codes(
            &xv,
            Matrix::dense(rows, cols),
            60,
            (&out, RowCodes::E4m3),
            &norm,
        )
        .unwrap();
        assert_eq!(padded.args().get::<i32>(20), Some(60));
        for bad in [0, cols + 8] {
            assert!(plan_norm_modulate_codes(
                &xv,
                Matrix::dense(rows, cols),
                bad,
                (&out, RowCodes::E4m3),
                &norm
            )
            .is_err());
        }
        let err = plan_norm_modulate_codes(
            &xv,
            Matrix::dense(rows, cols),
            60,
            (&out, RowCodes::E4m3),
            &plain,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("LayerNorm"), "{err}");
        let launch = plan_norm_modulate_fp8(&xv, Matrix::dense(rows, cols), &out, &plain).unwrap();
        assert_eq!(launch.args().get::<i32>(10), Some(1));
        assert_eq!(launch.args().get::<u64>(11), Some(0));
        assert!(plan_norm_modulate_fp8(
            &xv,
            Matrix::dense(rows, cols),
            &out,
            &NormModulate {
                eps: f32::NAN,
                ..plain
            }
        )
        .is_err());
    }

    #[test]
    fn gated_residual_fp8_checks_the_gate_and_the_shared_row_selection() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, cols) = (4, 32);
        let mut x = buffer(&ctx, rows * cols * BF16);
        let y = buffer(&ctx, rows * cols * BF16);
        let mut codes = buffer(&ctx, rows * cols);
        let mut scales = buffer(&ctx, rows * 4);
        let table = buffer(&ctx, 3 * 5 * cols * BF16);
        let index = buffer(&ctx, rows * 4);
        let (xv, yv, cv, sv, tv, iv) = (
            x.view_mut(),
            y.view(),
            codes.view_mut(),
            scales.view_mut(),
            table.view(),
            index.view(),
        );
        let out = Fp8Rows {
            codes: &cv,
            stride: cols,
            scales: &sv,
        };
        let select = ModulationRows {
            seq_len: 2,
            target_begin: 1,
            prefix_row: 2,
        };
        let gate = ResidualGate {
            data: &tv,
            rows: 3,
            stride: 5 * cols,
            offset: cols,
            tanh: true,
            select,
            row_index: None,
        };
        let norm = NormModulate {
            kind: NormKind::LayerNorm,
            weight: None,
            bias: None,
            eps: 1e-6,
            modulation: Some(RowModulation {
                data: &tv,
                rows: 3,
                stride: 5 * cols,
                scale_offset: 2 * cols,
                shift_offset: None,
                select,
                row_index: None,
            }),
        };
        let layout = Matrix::dense(rows, cols);
        let launch =
            plan_gated_residual_norm_modulate_fp8(&xv, layout, &yv, cols, &gate, &out, &norm)
                .unwrap();
        assert_eq!(launch.kernel(), "nn_gated_residual_norm_modulate_fp8_c2");
        // The norm width, then no bf16 rows (a null h and stride 0).
        assert_eq!(launch.args().len(), 30);
        assert_eq!(launch.args().get::<i32>(27), Some(cols as i32));
        assert_eq!(launch.args().get::<u64>(28), Some(0));
        assert_eq!(launch.args().get::<i32>(29), Some(0));
        let int8 = plan_gated_residual_norm_modulate_with(
            &xv,
            layout,
            cols,
            (&yv, cols),
            &gate,
            (&out, RowCodes::Int8),
            &norm,
            None,
        )
        .unwrap();
        assert_eq!(int8.kernel(), "nn_gated_residual_norm_modulate_int8_c2");
        assert!(same_args(int8.args(), launch.args()));
        // The same pass writing its normed rows in bf16 too, or as INT8 codes with their own scales: each its own
        // entry point, with h (or the codes), its stride (and the INT8 scales) last.
        let mut h = buffer(&ctx, rows * cols * BF16);
        let hv = h.view_mut();
        let mut h_short = buffer(&ctx, rows * cols * BF16 - 16);
        let short = h_short.view_mut();
        let mut i8_codes = buffer(&ctx, rows * cols);
        let mut i8_scales = buffer(&ctx, rows * 4);
        let (i8c, i8s) = (i8_codes.view_mut(), i8_scales.view_mut());
        let i8_rows = Fp8Rows {
            codes: &i8c,
            stride: cols,
            scales: &i8s,
        };
        let odd_stride = Fp8Rows {
            stride: cols + 8,
            ..i8_rows
        };
        let with_second = |second: SecondRows<'_, '_>| {
            plan_gated_residual_norm_modulate_with(
                &xv,
                layout,
                cols,
                (&yv, cols),
                &gate,
                (&out, RowCodes::E4m3),
                &norm,
                Some(second),
            )
            .map(|launch| {
                let args = launch.args();
                (
                    launch.kernel().to_string(),
                    args.get::<u64>(28),
                    args.get::<i32>(29),
                    args.get::<u64>(30),
                )
            })
        };
        let bf16_rows = |h| SecondRows::Bf16 { h, stride: cols };
        assert_eq!(
            with_second(bf16_rows(&hv)).unwrap(),
            (
                "nn_gated_residual_norm_modulate_fp8_and_bf16_c2".to_string(),
                Some(hv.addr()),
                Some(cols as i32),
                None
            )
        );
        assert!(with_second(bf16_rows(&short)).is_err());
        assert_eq!(
            with_second(SecondRows::Int8(&i8_rows)).unwrap(),
            (
                "nn_gated_residual_norm_modulate_fp8_and_int8_c2".to_string(),
                Some(i8c.addr()),
                Some(cols as i32),
                Some(i8s.addr())
            )
        );
        assert!(with_second(SecondRows::Int8(&odd_stride)).is_err());
        assert_eq!(launch.args().get::<i32>(6), Some(3));
        assert_eq!(launch.args().get::<i32>(7), Some(cols as i32));
        assert_eq!(launch.args().get::<i32>(8), Some(1)); // tanh
        assert_eq!(launch.args().get::<i32>(22), Some(-1)); // no shift
        assert_eq!(launch.args().get::<i32>(23), Some(2)); // seq_len
        assert_eq!(launch.args().get::<i32>(25), Some(2)); // prefix row
                                                           // A norm selecting rows differently from the gate: refused.
        let other = NormModulate {
            modulation: Some(RowModulation {
                select: ModulationRows::targets_only(2),
                ..norm.modulation.unwrap()
            }),
            ..norm
        };
        let err =
            plan_gated_residual_norm_modulate_fp8(&xv, layout, &yv, cols, &gate, &out, &other)
                .unwrap_err()
                .to_string();
        assert!(err.contains("select rows as the gate does"), "{err}");
        // A gate block past the table's row stride: refused.
        let wide_gate = ResidualGate {
            offset: 4 * cols + 8,
            ..gate
        };
        assert!(plan_gated_residual_norm_modulate_fp8(
            &xv, layout, &yv, cols, &wide_gate, &out, &norm
        )
        .is_err());
        // No modulation, plain gates, a row index: the gate's selection is packed.
        let indexed = ResidualGate {
            tanh: false,
            row_index: Some(&iv),
            ..gate
        };
        let unmodulated = NormModulate {
            modulation: None,
            ..norm
        };
        let launch = plan_gated_residual_norm_modulate_fp8(
            &xv,
            layout,
            &yv,
            cols,
            &indexed,
            &out,
            &unmodulated,
        )
        .unwrap();
        assert_eq!(launch.args().len(), 30);
        assert_eq!(launch.args().get::<i32>(8), Some(0));
        assert_eq!(launch.args().get::<u64>(18), Some(0)); // no modulation table
        assert_eq!(launch.args().get::<u64>(26), Some(iv.addr()));
    }

    /// The launches MiniMax H3's FP8 step makes, at its sizes (hidden 5376, or 24 padded to 32; attention width
    /// 7168; ffn 14336), with its argument pattern: one adaLN table slice per block (`[timesteps * 3, 6 * hidden]`),
    /// gate and modulation from column blocks of it, rows picked by one per-row index.
    #[test]
    fn h3_shaped_fp8_launches_pass_their_checks() {
        let _serial = test_lock();
        let ctx = context();
        let rows = 37;
        let table_rows = 9;
        for (cols, width) in [(5376, 5376), (32, 24)] {
            let stride = 6 * cols;
            let mut x = buffer(&ctx, rows * cols * BF16);
            let y = buffer(&ctx, rows * cols * BF16);
            let w = buffer(&ctx, cols * BF16);
            let table = buffer(&ctx, table_rows * stride * BF16);
            let next_table = buffer(&ctx, table_rows * stride * BF16);
            let index = buffer(&ctx, rows * 4);
            let mut q8 = buffer(&ctx, rows * 14336);
            let mut scales = buffer(&ctx, rows * 4);
            let (xv, yv, wv, tv, nv, iv, cv, sv) = (
                x.view_mut(),
                y.view(),
                w.view(),
                table.view(),
                next_table.view(),
                index.view(),
                q8.view_mut(),
                scales.view_mut(),
            );
            let select = ModulationRows::targets_only(1);
            let norm = NormModulate {
                kind: NormKind::RmsNorm,
                weight: Some(&wv),
                bias: None,
                eps: 1e-5,
                modulation: Some(RowModulation {
                    data: &nv,
                    rows: table_rows,
                    stride,
                    scale_offset: cols,
                    shift_offset: Some(0),
                    select,
                    row_index: Some(&iv),
                }),
            };
            let gate = ResidualGate {
                data: &tv,
                rows: table_rows,
                stride,
                offset: 5 * cols,
                tanh: false,
                select,
                row_index: Some(&iv),
            };
            let out = Fp8Rows {
                codes: &cv,
                stride: cols,
                scales: &sv,
            };
            let layout = Matrix::dense(rows, cols);
            let launch = plan_gated_residual_norm_modulate_with(
                &xv,
                layout,
                width,
                (&yv, cols),
                &gate,
                (&out, RowCodes::E4m3),
                &norm,
                None,
            )
            .unwrap();
            let wide = cols > NARROW_NORM_COLS;
            assert_eq!(
                launch.kernel(),
                if wide {
                    "nn_gated_residual_norm_modulate_fp8"
                } else {
                    "nn_gated_residual_norm_modulate_fp8_c2"
                }
            );
            assert_eq!(launch.config().grid.x, rows as u32);
            assert_eq!(launch.args().get::<i32>(8), Some(0)); // plain gates
            assert_eq!(launch.args().get::<i32>(17), Some(0)); // RMSNorm
            assert_eq!(launch.args().get::<i32>(27), Some(width as i32));
            let x_in = xv.as_view();
            assert!(
                plan_norm_modulate_codes(&x_in, layout, width, (&out, RowCodes::E4m3), &norm)
                    .is_ok()
            );
            // The attention output (heads x 128 columns) and SwiGLU of the [value | gate] fc1 rows.
            let attn = buffer(&ctx, rows * 7168 * BF16);
            let attn = attn.view();
            let launch = plan_quantize_rows_fp8(
                &attn,
                Matrix::dense(rows, 7168),
                &Fp8Rows {
                    stride: 7168,
                    ..out
                },
            )
            .unwrap();
            assert_eq!(launch.config().block.x, 448);
            let ff = buffer(&ctx, rows * 2 * 14336 * BF16);
            let ff = ff.view();
            let launch = plan_swiglu_fp8(
                SwigluOrder::ValueGate,
                &ff,
                Matrix::dense(rows, 2 * 14336),
                &Fp8Rows {
                    stride: 14336,
                    ..out
                },
            )
            .unwrap();
            assert_eq!(launch.config().block.x, 896);
            // [value | gate]: the gate half starts 14336 columns into the row.
            assert_eq!(
                launch.args().get::<u64>(0),
                Some(ff.addr() + (14336 * BF16) as u64)
            );
            assert_eq!(launch.args().get::<u64>(1), Some(ff.addr()));
            assert_eq!(launch.args().get::<i32>(2), Some(2 * 14336));
            assert_eq!(launch.args().get::<i32>(7), Some(14336));
        }
    }

    #[test]
    fn swiglu_of_an_int32_gate_packs_its_operands_and_checks_them() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, hidden) = (3, 48);
        let value = buffer(&ctx, rows * hidden * BF16);
        let products = buffer(&ctx, rows * hidden * 4);
        let row_scales = buffer(&ctx, rows * 4);
        let col_scales = buffer(&ctx, hidden * 4);
        let mut codes = buffer(&ctx, rows * 64);
        let mut scales = buffer(&ctx, rows * 4);
        let (vv, pv, rv, cv) = (
            value.view(),
            products.view(),
            row_scales.view(),
            col_scales.view(),
        );
        let (qv, sv) = (codes.view_mut(), scales.view_mut());
        let out = Fp8Rows {
            codes: &qv,
            stride: 64,
            scales: &sv,
        };
        let gate = Int32Gate {
            products: &pv,
            stride: hidden,
            row_scales: &rv,
            col_scales: &cv,
        };
        let layout = Matrix::dense(rows, hidden);
        let launch = plan_swiglu_i32gate_fp8(&vv, layout, &gate, &out).unwrap();
        assert_eq!(launch.kernel(), "nn_swiglu_i32gate_fp8");
        assert_eq!(launch.config().block.x, 32);
        // 16 f32 results parked a thread.
        assert_eq!(launch.config().shared_bytes, 32 * 64);
        let args = launch.args();
        assert_eq!(args.len(), 11);
        assert_eq!(args.get::<u64>(0), Some(vv.addr()));
        assert_eq!(args.get::<i32>(1), Some(hidden as i32));
        assert_eq!(args.get::<u64>(2), Some(pv.addr()));
        assert_eq!(args.get::<i32>(3), Some(hidden as i32));
        assert_eq!(args.get::<u64>(4), Some(rv.addr()));
        assert_eq!(args.get::<u64>(5), Some(cv.addr()));
        assert_eq!(args.get::<u64>(6), Some(qv.addr()));
        assert_eq!(args.get::<i32>(7), Some(64));
        assert_eq!(args.get::<u64>(8), Some(sv.addr()));
        assert_eq!(
            (args.get::<i32>(9), args.get::<i32>(10)),
            (Some(rows as i32), Some(hidden as i32))
        );
        // Too few products, a stride off a multiple of 4, too few scales of either kind: refused.
        let short = products.slice(0, rows * hidden * 4 - 16).unwrap();
        let few_rows = row_scales.slice(0, (rows - 1) * 4).unwrap();
        let few_cols = col_scales.slice(0, (hidden - 8) * 4).unwrap();
        for (what, bad) in [
            (
                "short products",
                Int32Gate {
                    products: &short,
                    ..gate
                },
            ),
            (
                "odd stride",
                Int32Gate {
                    stride: hidden + 2,
                    ..gate
                },
            ),
            (
                "few row scales",
                Int32Gate {
                    row_scales: &few_rows,
                    ..gate
                },
            ),
            (
                "few column scales",
                Int32Gate {
                    col_scales: &few_cols,
                    ..gate
                },
            ),
        ] {
            assert!(
                plan_swiglu_i32gate_fp8(&vv, layout, &bad, &out).is_err(),
                "{what}"
            );
        }
        assert!(plan_swiglu_i32gate_fp8(&vv, Matrix::dense(rows, 16392), &gate, &out).is_err());
    }

    /// Two argument lists of the same sizes and values (4- and 8-byte arguments).
    fn same_args(a: &tf_cuda::launch::Args, b: &tf_cuda::launch::Args) -> bool {
        a.sizes() == b.sizes()
            && (0..a.len()).all(|i| match a.sizes()[i] {
                4 => a.get::<u32>(i) == b.get::<u32>(i),
                8 => a.get::<u64>(i) == b.get::<u64>(i),
                _ => false,
            })
    }

    #[test]
    fn swiglu_fp8_takes_either_half_order() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, hidden) = (3, 48);
        let fused = buffer(&ctx, rows * 2 * hidden * BF16);
        let mut codes = buffer(&ctx, rows * 64);
        let mut scales = buffer(&ctx, rows * 4);
        let (fv, cv, sv) = (fused.view(), codes.view_mut(), scales.view_mut());
        let out = Fp8Rows {
            codes: &cv,
            stride: 64,
            scales: &sv,
        };
        let layout = Matrix::dense(rows, 2 * hidden);
        let gv = plan_swiglu_fp8(SwigluOrder::GateValue, &fv, layout, &out).unwrap();
        let vg = plan_swiglu_fp8(SwigluOrder::ValueGate, &fv, layout, &out).unwrap();
        assert_eq!(gv.kernel(), "nn_swiglu_fp8");
        // 48 columns, 16 a thread, rounded up to a warp; 12288 (Qwen-Image) takes 768 threads, 16384 1024.
        assert_eq!(gv.config().block.x, 32);
        assert_eq!(wide_config("t", 1, 12288).unwrap().block.x, 768);
        assert_eq!(wide_config("t", 1, 16384).unwrap().block.x, 1024);
        assert_eq!(
            norm_kernel("plain", "narrow", 4096),
            "narrow",
            "rows that fit two chunks a thread take the _c2 entry point"
        );
        assert_eq!(norm_kernel("plain", "narrow", 4104), "plain");
        let second = fv.addr() + (hidden * BF16) as u64;
        assert_eq!(gv.args().get::<u64>(0), Some(fv.addr()));
        assert_eq!(gv.args().get::<u64>(1), Some(second));
        assert_eq!(vg.args().get::<u64>(0), Some(second));
        assert_eq!(vg.args().get::<u64>(1), Some(fv.addr()));
        assert_eq!(gv.args().get::<i32>(2), Some(2 * hidden as i32));
        assert_eq!(gv.args().get::<i32>(6), Some(rows as i32));
        assert_eq!(gv.args().get::<i32>(7), Some(hidden as i32));
        assert!(
            plan_swiglu_fp8(SwigluOrder::GateValue, &fv, Matrix::dense(rows, 88), &out).is_err()
        );
        // The halves apart: two [rows, hidden] matrices, each checked on its own.
        let value = fused.slice(0, rows * hidden * BF16).unwrap();
        let gate = fused
            .slice(rows * hidden * BF16, rows * hidden * BF16)
            .unwrap();
        let each = Matrix::dense(rows, hidden);
        let apart = plan_swiglu_fp8_apart(&value, &gate, each, &out).unwrap();
        assert_eq!(apart.kernel(), "nn_swiglu_fp8");
        assert_eq!(apart.args().get::<u64>(0), Some(gate.addr()));
        assert_eq!(apart.args().get::<u64>(1), Some(value.addr()));
        assert_eq!(apart.args().get::<i32>(2), Some(hidden as i32));
        assert_eq!(apart.args().get::<i32>(7), Some(hidden as i32));
        let short = fused.slice(0, rows * hidden * BF16 - 16).unwrap();
        let err = plan_swiglu_fp8_apart(&value, &short, each, &out).unwrap_err();
        assert!(err.to_string().contains("gate"), "{err}");
        // INT8 codes: the same arguments to the INT8 entry point, fused or apart.
        let int8 =
            plan_swiglu_codes(SwigluOrder::GateValue, &fv, layout, &out, RowCodes::Int8).unwrap();
        assert_eq!(int8.kernel(), "nn_swiglu_int8");
        assert!(same_args(int8.args(), gv.args()));
        let int8_apart =
            plan_swiglu_codes_apart(&value, &gate, each, &out, RowCodes::Int8).unwrap();
        assert_eq!(int8_apart.kernel(), "nn_swiglu_int8");
        assert!(same_args(int8_apart.args(), apart.args()));
    }
}
