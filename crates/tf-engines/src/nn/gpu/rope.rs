//! QK RMSNorm + RoPE launchers for a fused q|k|v GEMM output: interleaved pairs into the attention layout
//! ([`plan_qk_norm_rope`]), rotate-half over the whole head in place ([`plan_qk_norm_rope_half`]), and the cos/sin
//! tables of the rotate-half kernels, and rotate-half over a rotated width smaller than the head dim with an optional
//! norm ([`plan_rope_half_partial`]). Kernel set `nn_rope`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{DeviceView, DeviceViewMut, Stream};

use super::attention::HEAD_DIM;
use super::launch::{
    check_aligned_to, check_bytes, check_eps, check_matrix, invalid, to_i32, to_u32, Launch,
    Matrix, Operand,
};
use super::NnKernels;

/// Name of the kernel set holding the RoPE kernels.
pub const ROPE_SET: &str = "nn_rope";

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

impl<'v, 'a> QkvOutputs<'v, 'a> {
    /// q, k and v rows that share one row stride (the attention's layout).
    pub fn with_stride(
        (q, k, v): (
            &'v mut DeviceViewMut<'a>,
            &'v mut DeviceViewMut<'a>,
            &'v mut DeviceViewMut<'a>,
        ),
        stride: usize,
    ) -> QkvOutputs<'v, 'a> {
        QkvOutputs {
            q,
            q_stride: stride,
            k,
            k_stride: stride,
            v,
            v_stride: stride,
        }
    }
}

/// Builds the fused QK RMSNorm + RoPE + V copy (kernel nn_qk_norm_rope_interleaved).
pub fn plan_qk_norm_rope<'a>(
    inputs: &QkvInputs<'a, '_>,
    outputs: &QkvOutputs<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    check_interleaved_tables(
        OP,
        rows,
        (inputs.rope_cos, inputs.rope_sin),
        inputs.rope_stride,
    )?;
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
    Ok(Launch::new(
        "nn_qk_norm_rope_interleaved",
        LaunchConfig::new(to_u32(OP, "blocks", items.div_ceil(8).max(1))?, 256),
        args,
    ))
}

/// Checks the interleaved RoPE's cos/sin tables: f32 `[rows, rope_stride]`, 8-byte aligned, with the 64 used columns
/// of every row inside the views.
pub(crate) fn check_interleaved_tables(
    op: &str,
    rows: usize,
    (rope_cos, rope_sin): (&DeviceView<'_>, &DeviceView<'_>),
    rope_stride: usize,
) -> Result<(), tf_cuda::Error> {
    if rope_stride < HEAD_DIM / 2 || !rope_stride.is_multiple_of(2) {
        return Err(invalid(
            op,
            format!("rope stride {rope_stride} must be even and at least 64"),
        ));
    }
    let rope_bytes = match rows.checked_sub(1) {
        None => 0,
        Some(last) => last
            .checked_mul(rope_stride)
            .and_then(|e| e.checked_add(HEAD_DIM / 2))
            .and_then(|e| e.checked_mul(4))
            .ok_or_else(|| invalid(op, "rope table span overflows"))?,
    };
    for (name, table) in [("rope_cos", rope_cos), ("rope_sin", rope_sin)] {
        let operand = Operand::of(table);
        if !operand.addr.is_multiple_of(8) {
            return Err(invalid(
                op,
                format!(
                    "{name}: device address {:#x} is not 8-byte aligned",
                    operand.addr
                ),
            ));
        }
        check_bytes(op, name, operand, rope_bytes)?;
    }
    Ok(())
}

/// Operands of the in-place QK RMSNorm + rotate-half RoPE (kernel nn_qk_norm_rope_half).
#[derive(Debug)]
pub struct QkNormRope<'v, 'a> {
    /// The fused GEMM output, `rows` x `(q_heads + 2 kv_heads) * 128` (q | k | v) with any row stride; q and k
    /// are rewritten in place, v is left as it is.
    pub qkv: &'v mut DeviceViewMut<'a>,
    pub qkv_layout: Matrix,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// RMSNorm weights (bf16, 128 each).
    pub q_weight: &'v DeviceView<'a>,
    pub k_weight: &'v DeviceView<'a>,
    pub eps: f32,
    /// f32 `[rows, rope_stride]` tables; column j < 64 is the angle of frequency slot j at that row's position.
    pub rope_cos: &'v DeviceView<'a>,
    pub rope_sin: &'v DeviceView<'a>,
    pub rope_stride: usize,
}

/// Builds the in-place QK RMSNorm + rotate-half RoPE of a fused q|k|v matrix.
pub fn plan_qk_norm_rope_half<'a>(
    op_args: &QkNormRope<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "qk_norm_rope_half";
    let a = op_args;
    let rows = a.qkv_layout.rows;
    let heads = a
        .q_heads
        .checked_add(a.kv_heads)
        .ok_or_else(|| invalid(OP, "heads overflow"))?;
    if a.q_heads == 0 || a.kv_heads == 0 || !a.q_heads.is_multiple_of(a.kv_heads) {
        return Err(invalid(
            OP,
            format!(
                "{} query heads must be a non-zero multiple of the {} kv heads",
                a.q_heads, a.kv_heads
            ),
        ));
    }
    let expected_cols = heads
        .checked_add(a.kv_heads)
        .and_then(|n| n.checked_mul(HEAD_DIM))
        .ok_or_else(|| invalid(OP, "width overflows"))?;
    if a.qkv_layout.cols != expected_cols {
        return Err(invalid(
            OP,
            format!(
                "qkv has {} columns; {} query and 2 x {} kv heads of {HEAD_DIM} need {expected_cols}",
                a.qkv_layout.cols, a.q_heads, a.kv_heads
            ),
        ));
    }
    check_eps(OP, a.eps)?;
    check_matrix(OP, "qkv", Operand::of_mut(a.qkv), a.qkv_layout)?;
    for (name, weight) in [("q_weight", a.q_weight), ("k_weight", a.k_weight)] {
        check_matrix(OP, name, Operand::of(weight), Matrix::dense(1, HEAD_DIM))?;
    }
    if a.rope_stride < HEAD_DIM / 2 || !a.rope_stride.is_multiple_of(4) {
        return Err(invalid(
            OP,
            format!(
                "rope stride {} must be a multiple of 4 and at least {}",
                a.rope_stride,
                HEAD_DIM / 2
            ),
        ));
    }
    let rope_bytes = if rows == 0 {
        0
    } else {
        (rows - 1)
            .checked_mul(a.rope_stride)
            .and_then(|n| n.checked_add(HEAD_DIM / 2))
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(|| invalid(OP, "rope table size overflows"))?
    };
    for (name, table) in [("rope_cos", a.rope_cos), ("rope_sin", a.rope_sin)] {
        // Each lane reads four consecutive f32 as one 16-byte load.
        check_aligned_to(OP, name, Operand::of(table), 16)?;
        check_bytes(OP, name, Operand::of(table), rope_bytes)?;
    }
    let items = rows
        .checked_mul(heads)
        .ok_or_else(|| invalid(OP, "rows * heads overflows"))?;
    let mut args = Args::new();
    args.push_addr(a.qkv.addr())
        .push(to_i32(OP, "qkv stride", a.qkv_layout.stride)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "q_heads", a.q_heads)?)
        .push(to_i32(OP, "kv_heads", a.kv_heads)?)
        .push_addr(a.q_weight.addr())
        .push_addr(a.k_weight.addr())
        .push(a.eps)
        .push_addr(a.rope_cos.addr())
        .push_addr(a.rope_sin.addr())
        .push(to_i32(OP, "rope stride", a.rope_stride)?);
    Ok(Launch::new(
        "nn_qk_norm_rope_half",
        LaunchConfig::new(to_u32(OP, "blocks", items.div_ceil(8).max(1))?, 256),
        args,
    ))
}

/// Cos/sin tables for [`plan_qk_norm_rope_half`]: `[rows, 64]` f32 for positions `0..rows`, angle
/// `f32(pos) * inv_freq[j]` with `inv_freq[j] = 1 / theta^(2j / 128)`, as the host reference computes them.
pub fn rotate_half_rope_tables(rows: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    crate::nn::host::rotate_half_tables(rows, 0, HEAD_DIM, theta)
}

/// The QK norm before a [`PartialRope`]'s rotation.
#[derive(Clone, Copy, Debug)]
pub enum RopeNorm<'v, 'a> {
    /// No norm: the rotation reads q and k as they are.
    None,
    /// `bf16(x * rsqrt(mean(x^2) + eps))` per head, no weight.
    Plain { eps: f32 },
    /// `bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight)` per head (bf16 weights, `head_dim` each).
    Affine {
        q_weight: &'v DeviceView<'a>,
        k_weight: &'v DeviceView<'a>,
        eps: f32,
    },
}

/// Element type of a [`PartialRope`]'s cos/sin tables (the kernel rounds f32 entries to bf16, as the reference
/// casts its tables to the activations' dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeTable {
    F32,
    Bf16,
}

/// Operands of the in-place rotate-half RoPE over the first `rotated` channels of each q and k head (kernels
/// nn_rope_half_partial_d{64,128}_{f32,bf16}); channels `rotated..head_dim` pass through (normalised when a norm
/// is asked for). The fused matrix holds `q_heads` query heads, then `kv_heads` key heads, then `kv_heads` value
/// heads (left as they are), `head_dim` channels each.
#[derive(Debug)]
pub struct PartialRope<'v, 'a> {
    pub qkv: &'v mut DeviceViewMut<'a>,
    pub qkv_layout: Matrix,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// 64 or 128.
    pub head_dim: usize,
    /// Rotated channels per head: even, 2..=head_dim (H3: 96 of 128; its VAE: 48 of 64).
    pub rotated: usize,
    pub norm: RopeNorm<'v, 'a>,
    /// `[rows, rope_stride]` tables; column j < rotated / 2 is the angle of frequency slot j at that row.
    pub rope_cos: &'v DeviceView<'a>,
    pub rope_sin: &'v DeviceView<'a>,
    pub rope_stride: usize,
    pub table: RopeTable,
}

/// Builds the in-place (QK norm +) partial rotate-half RoPE of a fused q|k|v matrix.
pub fn plan_rope_half_partial<'a>(
    op_args: &PartialRope<'a, '_>,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "rope_half_partial";
    let a = op_args;
    let kernel = match (a.head_dim, a.table) {
        (128, RopeTable::F32) => "nn_rope_half_partial_d128_f32",
        (128, RopeTable::Bf16) => "nn_rope_half_partial_d128_bf16",
        (64, RopeTable::F32) => "nn_rope_half_partial_d64_f32",
        (64, RopeTable::Bf16) => "nn_rope_half_partial_d64_bf16",
        (d, _) => {
            return Err(invalid(
                OP,
                format!("head dim {d}: the kernels are built for 64 and 128"),
            ))
        }
    };
    if a.rotated < 2 || a.rotated > a.head_dim || !a.rotated.is_multiple_of(2) {
        return Err(invalid(
            OP,
            format!(
                "rotated width {} must be even and within 2..={}",
                a.rotated, a.head_dim
            ),
        ));
    }
    if a.q_heads == 0 || a.kv_heads == 0 || !a.q_heads.is_multiple_of(a.kv_heads) {
        return Err(invalid(
            OP,
            format!(
                "{} query heads must be a non-zero multiple of the {} kv heads",
                a.q_heads, a.kv_heads
            ),
        ));
    }
    let rows = a.qkv_layout.rows;
    let heads = a
        .q_heads
        .checked_add(a.kv_heads)
        .ok_or_else(|| invalid(OP, "heads overflow"))?;
    let expected_cols = heads
        .checked_add(a.kv_heads)
        .and_then(|n| n.checked_mul(a.head_dim))
        .ok_or_else(|| invalid(OP, "width overflows"))?;
    if a.qkv_layout.cols != expected_cols {
        return Err(invalid(
            OP,
            format!(
                "qkv has {} columns; {} query and 2 x {} kv heads of {} need {expected_cols}",
                a.qkv_layout.cols, a.q_heads, a.kv_heads, a.head_dim
            ),
        ));
    }
    check_matrix(OP, "qkv", Operand::of_mut(a.qkv), a.qkv_layout)?;
    let (norm, q_weight, k_weight, eps) = match a.norm {
        RopeNorm::None => (0i32, 0u64, 0u64, 0.0f32),
        RopeNorm::Plain { eps } => (1, 0, 0, eps),
        RopeNorm::Affine {
            q_weight,
            k_weight,
            eps,
        } => {
            for (name, weight) in [("q_weight", q_weight), ("k_weight", k_weight)] {
                check_matrix(OP, name, Operand::of(weight), Matrix::dense(1, a.head_dim))?;
            }
            (2, q_weight.addr(), k_weight.addr(), eps)
        }
    };
    check_eps(OP, eps)?;
    let half = a.rotated / 2;
    if a.rope_stride < half {
        return Err(invalid(
            OP,
            format!(
                "rope stride {} is less than the {half} used columns",
                a.rope_stride
            ),
        ));
    }
    let element = match a.table {
        RopeTable::F32 => 4,
        RopeTable::Bf16 => 2,
    };
    let rope_bytes = if rows == 0 {
        0
    } else {
        (rows - 1)
            .checked_mul(a.rope_stride)
            .and_then(|n| n.checked_add(half))
            .and_then(|n| n.checked_mul(element))
            .ok_or_else(|| invalid(OP, "rope table size overflows"))?
    };
    for (name, table) in [("rope_cos", a.rope_cos), ("rope_sin", a.rope_sin)] {
        check_aligned_to(OP, name, Operand::of(table), element as u64)?;
        check_bytes(OP, name, Operand::of(table), rope_bytes)?;
    }
    let items = rows
        .checked_mul(heads)
        .ok_or_else(|| invalid(OP, "rows * heads overflows"))?;
    let mut args = Args::new();
    args.push_addr(a.qkv.addr())
        .push(to_i32(OP, "qkv stride", a.qkv_layout.stride)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "q_heads", a.q_heads)?)
        .push(to_i32(OP, "kv_heads", a.kv_heads)?)
        .push_addr(q_weight)
        .push_addr(k_weight)
        .push(eps)
        .push(norm)
        .push_addr(a.rope_cos.addr())
        .push_addr(a.rope_sin.addr())
        .push(to_i32(OP, "rope stride", a.rope_stride)?)
        .push(to_i32(OP, "rotated", a.rotated)?);
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(
            to_u32(
                OP,
                "blocks",
                items.div_ceil(PARTIAL_ROPE_ITEMS_PER_BLOCK).max(1),
            )?,
            256,
        ),
        args,
    ))
}

/// (row, head) items one block of the partial RoPE kernels handles: 8 warps of `ROPE_ITEMS_PER_WARP` (4) in
/// kernels/nn/rope.cu.
const PARTIAL_ROPE_ITEMS_PER_BLOCK: usize = 32;

impl NnKernels {
    /// In-place (QK norm +) partial rotate-half RoPE; see [`plan_rope_half_partial`].
    pub fn rope_half_partial(
        &self,
        stream: &Stream,
        op_args: &PartialRope<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_rope_half_partial(op_args)?)
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

    /// In-place QK RMSNorm + rotate-half RoPE; see [`plan_qk_norm_rope_half`].
    pub fn qk_norm_rope_half(
        &self,
        stream: &Stream,
        op_args: &QkNormRope<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_qk_norm_rope_half(op_args)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gpu::test_support::{buffer, context, BF16};
    use tf_testdriver::test_lock;

    #[test]
    fn rope_tables_hold_the_host_angles() {
        let (cos, sin) = rotate_half_rope_tables(3, 10_000.0);
        assert_eq!(cos.len(), 3 * 64);
        assert_eq!(sin.len(), 3 * 64);
        // Position 0 does not rotate; position 1, slot 0 turns by exactly one radian.
        assert!(cos[..64].iter().all(|&c| c == 1.0) && sin[..64].iter().all(|&s| s == 0.0));
        assert!((cos[64] - 1f32.cos()).abs() < 1e-7 && (sin[64] - 1f32.sin()).abs() < 1e-7);
        // The last slot turns slowest: 1 / theta^(126/128) radians per position.
        let slowest = 2.0 * 10_000f64.powf(-126.0 / 128.0);
        assert!((f64::from(sin[2 * 64 + 63]) - slowest.sin()).abs() < 1e-6);
    }

    #[test]
    fn qk_norm_rope_plan_checks_the_fused_layout() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, q_heads, kv_heads) = (7, 4, 2);
        let cols = (q_heads + 2 * kv_heads) * HEAD_DIM;
        let mut qkv = buffer(&ctx, rows * cols * BF16);
        let weights = buffer(&ctx, 2 * HEAD_DIM * BF16);
        let cos = buffer(&ctx, rows * 64 * 4);
        let sin = buffer(&ctx, rows * 64 * 4);
        let qw = weights.slice(0, HEAD_DIM * BF16).unwrap();
        let kw = weights.slice(HEAD_DIM * BF16, HEAD_DIM * BF16).unwrap();
        let (cv, sv) = (cos.view(), sin.view());
        let mut view = qkv.view_mut();
        let mut args = QkNormRope {
            qkv: &mut view,
            qkv_layout: Matrix::dense(rows, cols),
            q_heads,
            kv_heads,
            q_weight: &qw,
            k_weight: &kw,
            eps: 1e-6,
            rope_cos: &cv,
            rope_sin: &sv,
            rope_stride: 64,
        };
        let launch = plan_qk_norm_rope_half(&args).unwrap();
        assert_eq!(launch.kernel, "nn_qk_norm_rope_half");
        // One warp per (row, q or k head), 8 warps per block.
        assert_eq!(launch.config.grid.x, (7 * 6usize).div_ceil(8) as u32);
        assert_eq!(launch.args.get::<i32>(3), Some(4));
        assert_eq!(launch.args.get::<i32>(4), Some(2));
        // Query heads not a multiple of the kv heads.
        args.q_heads = 3;
        args.qkv_layout = Matrix::dense(rows, (3 + 4) * HEAD_DIM);
        assert!(plan_qk_norm_rope_half(&args).is_err());
        // Columns that do not match the heads.
        args.q_heads = 4;
        args.qkv_layout = Matrix::dense(rows, cols - HEAD_DIM);
        let err = plan_qk_norm_rope_half(&args).unwrap_err().to_string();
        assert!(err.contains("need"), "{err}");
        args.qkv_layout = Matrix::dense(rows, cols);
        // Tables shorter than the rows.
        args.qkv_layout.rows = rows + 1;
        assert!(plan_qk_norm_rope_half(&args).is_err());
        args.qkv_layout.rows = rows;
        args.rope_stride = 62;
        assert!(plan_qk_norm_rope_half(&args).is_err());
        args.rope_stride = 64;
        args.eps = f32::INFINITY;
        assert!(plan_qk_norm_rope_half(&args).is_err());
    }

    #[test]
    fn partial_rope_plan_checks_widths_tables_and_norm() {
        let _serial = test_lock();
        let ctx = context();
        let (rows, q_heads, kv_heads, head_dim, rotated) = (5, 4, 2, 128, 96);
        let cols = (q_heads + 2 * kv_heads) * head_dim;
        let mut qkv = buffer(&ctx, rows * cols * BF16);
        let weights = buffer(&ctx, 2 * head_dim * BF16);
        let tables = buffer(&ctx, 2 * rows * 48 * 2);
        let qw = weights.slice(0, head_dim * BF16).unwrap();
        let kw = weights.slice(head_dim * BF16, head_dim * BF16).unwrap();
        let cos = tables.slice(0, rows * 48 * 2).unwrap();
        let sin = tables.slice(rows * 48 * 2, rows * 48 * 2).unwrap();
        let mut view = qkv.view_mut();
        let mut args = PartialRope {
            qkv: &mut view,
            qkv_layout: Matrix::dense(rows, cols),
            q_heads,
            kv_heads,
            head_dim,
            rotated,
            norm: RopeNorm::Affine {
                q_weight: &qw,
                k_weight: &kw,
                eps: 1e-6,
            },
            rope_cos: &cos,
            rope_sin: &sin,
            rope_stride: 48,
            table: RopeTable::Bf16,
        };
        let launch = plan_rope_half_partial(&args).unwrap();
        assert_eq!(launch.kernel, "nn_rope_half_partial_d128_bf16");
        assert_eq!(launch.args.len(), 13);
        assert_eq!(launch.args.get::<i32>(8), Some(2));
        assert_eq!(launch.args.get::<i32>(12), Some(96));
        assert_eq!(
            launch.config.grid.x,
            (5 * 6usize).div_ceil(PARTIAL_ROPE_ITEMS_PER_BLOCK) as u32
        );
        // f32 tables are twice as large: these ones are too short.
        args.table = RopeTable::F32;
        assert!(plan_rope_half_partial(&args).is_err());
        args.table = RopeTable::Bf16;
        // An odd or too wide rotated width, a head dim without kernels, columns that do not match.
        args.rotated = 95;
        assert!(plan_rope_half_partial(&args).is_err());
        args.rotated = 130;
        assert!(plan_rope_half_partial(&args).is_err());
        args.rotated = 96;
        args.head_dim = 96;
        assert!(plan_rope_half_partial(&args).is_err());
        args.head_dim = 128;
        args.norm = RopeNorm::None;
        let launch = plan_rope_half_partial(&args).unwrap();
        assert_eq!(launch.args.get::<i32>(8), Some(0));
        assert_eq!(launch.args.get::<u64>(5), Some(0));
        args.qkv_layout = Matrix::dense(rows, cols - 8);
        assert!(plan_rope_half_partial(&args).is_err());
    }
}
