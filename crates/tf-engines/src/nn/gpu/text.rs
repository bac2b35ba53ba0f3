//! GPU launchers for the Qwen3-VL text-encoder kernels (`kernels/qwen_image/text.cu`, kernel set
//! `qwen_image_text`).
//!
//! Same conventions as [`crate::nn::gpu`]: one `plan_*` function per kernel validates every shape, stride,
//! size and alignment against the device views and packs the arguments (unit-tested without a GPU);
//! [`TextKernels`] holds the loaded kernels and submits launches asynchronously on a stream. Validation failures
//! are [`tf_cuda::Error::Invalid`] naming the operand and the fix.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: tf_cuda::DeviceView<'_>,
//! #         w: tf_cuda::DeviceView<'_>, y: &mut tf_cuda::DeviceViewMut<'_>) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::nn::gpu::Matrix;
//! use tf_engines::nn::gpu::text::TextKernels;
//! let kernels = TextKernels::load(ctx)?;
//! kernels.rms_norm(stream, &x, Matrix::dense(16, 4096), y, 4096, &w, 1e-6)?;
//! # Ok(()) }
//! ```

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use crate::nn::gpu::{
    check_aligned_to, check_bytes, check_matrix, invalid, plan_weighted_row_norm, to_i32, to_u32,
    Launch, LoadKernelsError, LoadedSet, Matrix, Operand, HEAD_DIM,
};

/// Name of the kernel set.
pub const TEXT_SET: &str = "qwen_image_text";
/// Threads per block of the row kernels (QT_ROW_THREADS in text.cu).
const ROW_THREADS: u32 = 256;
/// Most columns `qt_rms_norm` holds in registers (QT_ROW_THREADS * 8 * QT_ROW_CHUNKS).
pub const MAX_TEXT_NORM_COLS: usize = 8192;
/// bf16 size in bytes.
const BF16: usize = 2;

const TEXT_KERNELS: &[&str] = &[
    "qt_embed_gather",
    "qt_rms_norm",
    "qt_qk_norm_rope_half",
    "qt_fill_uniform",
];

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

/// Builds the embedding gather `out[r] = table[ids[r]]` (kernel qt_embed_gather): `table` is `[vocab, cols]`
/// bf16, `ids` `rows` i32 values, `out` `rows` x `cols` with `out_stride`. Ids must be checked against the
/// vocabulary by the caller (the kernel writes a zero row for an id out of range rather than read past the
/// table).
pub fn plan_embed_gather(
    table: &DeviceView<'_>,
    vocab: usize,
    cols: usize,
    ids: &DeviceView<'_>,
    rows: usize,
    out: &DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "embed_gather";
    if cols == 0 || vocab == 0 {
        return Err(invalid(
            OP,
            "the table must have at least one row and column",
        ));
    }
    check_matrix(OP, "table", Operand::of(table), Matrix::dense(vocab, cols))?;
    check_aligned_to(OP, "ids", Operand::of(ids), 4)?;
    check_bytes(OP, "ids", Operand::of(ids), rows.saturating_mul(4))?;
    check_matrix(
        OP,
        "out",
        Operand::of_mut(out),
        Matrix {
            rows,
            cols,
            stride: out_stride,
        },
    )?;
    let mut args = Args::new();
    args.push_addr(table.addr())
        .push(to_i32(OP, "vocab", vocab)?)
        .push(to_i32(OP, "cols", cols)?)
        .push_addr(ids.addr())
        .push(to_i32(OP, "rows", rows)?)
        .push_addr(out.addr())
        .push(to_i32(OP, "out stride", out_stride)?);
    Ok(Launch {
        kernel: "qt_embed_gather",
        config: row_grid(OP, rows, cols)?,
        args,
    })
}

/// Builds the Qwen3 RMSNorm `y = weight * bf16(x * rsqrt(mean(x^2) + eps))` (kernel qt_rms_norm).
pub fn plan_rms_norm(
    x: &DeviceView<'_>,
    x_layout: Matrix,
    y: &DeviceViewMut<'_>,
    y_stride: usize,
    weight: &DeviceView<'_>,
    eps: f32,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "rms_norm";
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(invalid(OP, format!("eps {eps} must be finite and >= 0")));
    }
    plan_weighted_row_norm(
        OP,
        "qt_rms_norm",
        MAX_TEXT_NORM_COLS,
        ROW_THREADS,
        x,
        x_layout,
        y,
        y_stride,
        weight,
        eps,
    )
}

/// Operands of the in-place QK RMSNorm + rotate-half RoPE (kernel qt_qk_norm_rope_half).
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
pub fn plan_qk_norm_rope_half(op_args: &QkNormRope<'_, '_>) -> Result<Launch, tf_cuda::Error> {
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
    if !(a.eps.is_finite() && a.eps >= 0.0) {
        return Err(invalid(
            OP,
            format!("eps {} must be finite and >= 0", a.eps),
        ));
    }
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
    Ok(Launch {
        kernel: "qt_qk_norm_rope_half",
        config: LaunchConfig::new(to_u32(OP, "blocks", items.div_ceil(8).max(1))?, 256),
        args,
    })
}

/// Builds the seeded fill `out[i] = bf16(offset + scale * u_i)`, `u_i` uniform in [-1, 1) from `(seed, i)`
/// (kernel qt_fill_uniform): deterministic, independent of the launch geometry.
pub fn plan_fill_uniform(
    out: &DeviceViewMut<'_>,
    n: usize,
    seed: u32,
    offset: f32,
    scale: f32,
) -> Result<Launch, tf_cuda::Error> {
    const OP: &str = "fill_uniform";
    if !(offset.is_finite() && scale.is_finite()) {
        return Err(invalid(
            OP,
            format!("offset {offset} and scale {scale} must be finite"),
        ));
    }
    check_aligned_to(OP, "out", Operand::of_mut(out), 2)?;
    let bytes = n
        .checked_mul(BF16)
        .ok_or_else(|| invalid(OP, "n overflows"))?;
    check_bytes(OP, "out", Operand::of_mut(out), bytes)?;
    let n_i64 =
        i64::try_from(n).map_err(|_| invalid(OP, format!("n = {n} does not fit a 64-bit int")))?;
    // Grid-stride kernel: enough blocks to fill the GPU, capped so huge n needs no huge grid.
    let blocks = n.div_ceil(256).clamp(1, 65_535);
    let mut args = Args::new();
    args.push_addr(out.addr())
        .push(n_i64)
        .push(u64::from(seed))
        .push(offset)
        .push(scale);
    Ok(Launch {
        kernel: "qt_fill_uniform",
        config: LaunchConfig::new(to_u32(OP, "blocks", blocks)?, 256),
        args,
    })
}

/// Cos/sin tables for [`plan_qk_norm_rope_half`]: `[rows, 64]` f32 for positions `0..rows`, angle
/// `f32(pos) * inv_freq[j]` with `inv_freq[j] = 1 / theta^(2j / 128)`, as the host reference computes them.
pub fn rotate_half_rope_tables(rows: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    crate::nn::host::rotate_half_tables(rows, 0, HEAD_DIM, theta)
}

/// The loaded `qwen_image_text` kernels of one context, and the launchers.
pub struct TextKernels {
    set: LoadedSet,
}

impl std::fmt::Debug for TextKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl TextKernels {
    /// Loads the `qwen_image_text` set into `ctx` and looks every kernel up.
    pub fn load(ctx: &Context) -> Result<TextKernels, LoadKernelsError> {
        Ok(TextKernels {
            set: LoadedSet::load(ctx, TEXT_SET, TEXT_KERNELS)?,
        })
    }

    /// Submits a launch built by one of the `plan_*` functions of this module.
    pub fn submit(&self, stream: &Stream, launch: &Launch) -> Result<(), tf_cuda::Error> {
        self.set.submit(stream, launch)
    }

    /// Embedding gather; see [`plan_embed_gather`].
    #[allow(clippy::too_many_arguments)]
    pub fn embed_gather(
        &self,
        stream: &Stream,
        table: &DeviceView<'_>,
        vocab: usize,
        cols: usize,
        ids: &DeviceView<'_>,
        rows: usize,
        out: &mut DeviceViewMut<'_>,
        out_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_embed_gather(table, vocab, cols, ids, rows, out, out_stride)?,
        )
    }

    /// Qwen3 RMSNorm; see [`plan_rms_norm`].
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

    /// In-place QK RMSNorm + rotate-half RoPE; see [`plan_qk_norm_rope_half`].
    pub fn qk_norm_rope_half(
        &self,
        stream: &Stream,
        op_args: &QkNormRope<'_, '_>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_qk_norm_rope_half(op_args)?)
    }

    /// Seeded uniform fill; see [`plan_fill_uniform`].
    pub fn fill_uniform(
        &self,
        stream: &Stream,
        out: &mut DeviceViewMut<'_>,
        n: usize,
        seed: u32,
        offset: f32,
        scale: f32,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan_fill_uniform(out, n, seed, offset, scale)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use tf_cuda::{DeviceBuffer, Driver};
    use tf_testdriver::{library_path, test_lock};

    fn op(addr: u64, bytes: usize) -> Operand {
        Operand { addr, bytes }
    }

    /// A context on the test driver (host memory stands in for the GPU): real views for the plans.
    fn context() -> Context {
        let driver = Arc::new(
            Driver::open_path(&library_path().expect("find the test driver")).expect("open it"),
        );
        Context::new(driver, 0).expect("context on device 0")
    }

    fn buffer(ctx: &Context, bytes: usize) -> DeviceBuffer {
        DeviceBuffer::alloc(ctx, bytes).expect("allocate on the test driver")
    }

    #[test]
    fn matrix_check_accepts_column_slices_and_refuses_bad_layouts() {
        // The k columns of a fused q|k|v row: 4 rows of stride 96, 32 used columns, starting mid-buffer.
        let k = Matrix {
            rows: 4,
            cols: 32,
            stride: 96,
        };
        assert!(check_matrix("t", "k", op(0x1000, (3 * 96 + 32) * 2), k).is_ok());
        let short = check_matrix("t", "x", op(0x1000, 100), Matrix::dense(4, 16))
            .unwrap_err()
            .to_string();
        assert!(short.contains("needs 128 B"), "{short}");
        assert!(check_matrix("t", "x", op(0x1008, 4096), Matrix::dense(1, 8)).is_err());
        let ragged = Matrix {
            rows: 2,
            cols: 12,
            stride: 16,
        };
        assert!(check_matrix("t", "x", op(0x1000, 4096), ragged).is_err());
        let overlapping = Matrix {
            rows: 2,
            cols: 16,
            stride: 8,
        };
        assert!(check_matrix("t", "x", op(0x1000, 4096), overlapping).is_err());
        assert!(check_matrix("t", "x", op(0x1000, 0), Matrix::dense(0, 16)).is_ok());
    }

    #[test]
    fn row_grid_covers_every_column_chunk() {
        let g = row_grid("t", 7, 4096).unwrap();
        assert_eq!((g.grid.x, g.grid.y), (7, 2));
        assert_eq!(g.block.x, ROW_THREADS);
        let g = row_grid("t", 0, 8).unwrap();
        assert_eq!((g.grid.x, g.grid.y), (1, 1));
        let g = row_grid("t", 1, 2049 * 8).unwrap();
        assert_eq!(g.grid.y, 9);
        assert!(row_grid("t", usize::MAX, 8).is_err());
    }

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
    fn embed_gather_plan_checks_table_ids_and_output() {
        let _serial = test_lock();
        let ctx = context();
        let (vocab, cols, rows) = (10, 64, 5);
        let table = buffer(&ctx, vocab * cols * BF16);
        let ids = buffer(&ctx, rows * 4);
        let mut out = buffer(&ctx, rows * cols * BF16);
        let launch = plan_embed_gather(
            &table.view(),
            vocab,
            cols,
            &ids.view(),
            rows,
            &out.view_mut(),
            cols,
        )
        .unwrap();
        assert_eq!(launch.kernel, "qt_embed_gather");
        assert_eq!(launch.args.len(), 7);
        assert_eq!(launch.args.get::<i32>(1), Some(vocab as i32));
        assert_eq!(launch.args.get::<i32>(4), Some(rows as i32));
        assert_eq!((launch.config.grid.x, launch.config.grid.y), (5, 1));
        // A table claimed larger than the buffer, too few ids, an output too small: all refused.
        let err = plan_embed_gather(
            &table.view(),
            vocab + 1,
            cols,
            &ids.view(),
            rows,
            &out.view_mut(),
            cols,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("table"), "{err}");
        assert!(plan_embed_gather(
            &table.view(),
            vocab,
            cols,
            &ids.view(),
            rows + 1,
            &out.view_mut(),
            cols
        )
        .is_err());
        assert!(plan_embed_gather(
            &table.view(),
            vocab,
            cols,
            &ids.view(),
            rows,
            &out.view_mut(),
            2 * cols
        )
        .is_err());
        assert!(plan_embed_gather(
            &table.view(),
            0,
            cols,
            &ids.view(),
            rows,
            &out.view_mut(),
            cols
        )
        .is_err());
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
        let launch =
            plan_rms_norm(&x.view(), layout, &y.view_mut(), cols, &w.view(), 1e-6).unwrap();
        assert_eq!(launch.kernel, "qt_rms_norm");
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
        let wide = Matrix::dense(1, MAX_TEXT_NORM_COLS + 8);
        let big = buffer(&ctx, (MAX_TEXT_NORM_COLS + 8) * BF16);
        let mut big_out = buffer(&ctx, (MAX_TEXT_NORM_COLS + 8) * BF16);
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
        assert_eq!(launch.kernel, "qt_qk_norm_rope_half");
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
    fn fill_plan_checks_size_and_values() {
        let _serial = test_lock();
        let ctx = context();
        let mut out = buffer(&ctx, 1000 * BF16);
        let launch = plan_fill_uniform(&out.view_mut(), 1000, 7, 1.0, 0.02).unwrap();
        assert_eq!(launch.kernel, "qt_fill_uniform");
        assert_eq!(launch.args.get::<i64>(1), Some(1000));
        assert_eq!(launch.args.get::<u64>(2), Some(7));
        assert_eq!(launch.config.grid.x, 4);
        assert!(plan_fill_uniform(&out.view_mut(), 1001, 7, 0.0, 1.0).is_err());
        assert!(plan_fill_uniform(&out.view_mut(), 10, 7, f32::NAN, 1.0).is_err());
        let empty = plan_fill_uniform(&out.view_mut(), 0, 7, 0.0, 1.0).unwrap();
        assert_eq!(empty.config.grid.x, 1);
    }

    proptest! {
        /// A matrix is accepted exactly when its last used element lies inside the view.
        #[test]
        fn matrix_check_is_exact_about_the_span(rows in 1usize..20, cols8 in 1usize..8, extra8 in 0usize..4,
                                                slack in 0usize..64) {
            let (cols, stride) = (cols8 * 8, (cols8 + extra8) * 8);
            let needed = ((rows - 1) * stride + cols) * 2;
            let m = Matrix { rows, cols, stride };
            prop_assert!(check_matrix("t", "x", op(0x100, needed + slack), m).is_ok());
            prop_assert!(check_matrix("t", "x", op(0x100, needed - 1), m).is_err());
        }
    }
}
