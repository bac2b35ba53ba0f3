//! Embedding and copy launchers: the sinusoidal timestep embedding, the embedding gather, strided row copies, the
//! transpose, and a seeded uniform fill (benchmarks and tests). Kernel set `nn_copy`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{DeviceView, DeviceViewMut, Stream};

use super::launch::{
    check_aligned_to, check_bytes, check_matrix, check_operand, invalid, row_grid, to_i32, to_u32,
    Launch, Matrix, Operand, BF16,
};
use super::NnKernels;

/// Name of the kernel set holding the embedding and copy kernels.
pub const COPY_SET: &str = "nn_copy";

/// Builds the sinusoidal timestep embedding `[cos | sin]` of `batch` f32 timesteps into `[batch, dim]` bf16.
pub fn plan_timestep_embedding<'a>(
    t: &'a DeviceView<'_>,
    out: &'a DeviceViewMut<'_>,
    batch: usize,
    dim: usize,
    t_scale: f32,
    max_period: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "timestep_embedding";
    if dim == 0 || !dim.is_multiple_of(2) || dim / 2 > 1024 {
        return Err(invalid(
            OP,
            format!("dim {dim} must be even and at most 2048"),
        ));
    }
    // The kernel reads f32 timesteps and writes bf16 values one at a time: 4- and 2-byte aligned.
    check_operand(OP, "t", Operand::of(t), batch.saturating_mul(4), 4)?;
    check_operand(
        OP,
        "out",
        Operand::of_mut(out),
        batch.saturating_mul(dim).saturating_mul(BF16),
        2,
    )?;
    let mut args = Args::new();
    args.push_addr(t.addr())
        .push_addr(out.addr())
        .push(to_i32(OP, "batch", batch)?)
        .push(to_i32(OP, "dim", dim)?)
        .push(t_scale)
        .push(max_period);
    Ok(Launch::new(
        "nn_timestep_embedding",
        LaunchConfig::new(
            to_u32(OP, "batch", batch.max(1))?,
            to_u32(OP, "dim / 2", dim / 2)?,
        ),
        args,
    ))
}

/// Builds a strided row copy of a `[rows, cols]` bf16 block (kernel nn_copy_rows).
pub fn plan_copy_rows<'a>(
    src: &'a DeviceView<'_>,
    src_layout: Matrix,
    dst: &'a DeviceViewMut<'_>,
    dst_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    Ok(Launch::new(
        "nn_copy_rows",
        row_grid(OP, src_layout.rows, src_layout.cols)?,
        args,
    ))
}

/// Builds the transpose of a dense `[rows, cols]` bf16 matrix into `[cols, rows]` (kernel nn_transpose).
pub fn plan_transpose<'a>(
    src: &'a DeviceView<'_>,
    dst: &'a DeviceViewMut<'_>,
    rows: usize,
    cols: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "transpose";
    let bytes = rows
        .checked_mul(cols)
        .and_then(|n| n.checked_mul(BF16))
        .ok_or_else(|| invalid(OP, "rows * cols overflows"))?;
    // The kernel moves bf16 elements one at a time: 2-byte aligned.
    check_operand(OP, "src", Operand::of(src), bytes, 2)?;
    check_operand(OP, "dst", Operand::of_mut(dst), bytes, 2)?;
    let mut args = Args::new();
    args.push_addr(src.addr())
        .push_addr(dst.addr())
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "cols", cols)?);
    Ok(Launch::new(
        "nn_transpose",
        LaunchConfig::new(
            (
                to_u32(OP, "column tiles", cols.div_ceil(32).max(1))?,
                to_u32(OP, "row tiles", rows.div_ceil(32).max(1))?,
            ),
            (32, 8),
        ),
        args,
    ))
}

/// Builds the embedding gather `out[r] = table[ids[r]]` (kernel nn_embed_gather): `table` is `[vocab, cols]`
/// bf16, `ids` `rows` i32 values, `out` `rows` x `cols` with `out_stride`. Ids must be checked against the
/// vocabulary by the caller (the kernel writes a zero row for an id out of range rather than read past the
/// table).
pub fn plan_embed_gather<'a>(
    table: &'a DeviceView<'_>,
    vocab: usize,
    cols: usize,
    ids: &'a DeviceView<'_>,
    rows: usize,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "embed_gather";
    if cols == 0 || vocab == 0 {
        return Err(invalid(
            OP,
            "the table must have at least one row and column",
        ));
    }
    check_matrix(OP, "table", Operand::of(table), Matrix::dense(vocab, cols))?;
    check_operand(OP, "ids", Operand::of(ids), rows.saturating_mul(4), 4)?;
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
    Ok(Launch::new(
        "nn_embed_gather",
        row_grid(OP, rows, cols)?,
        args,
    ))
}

/// Builds the seeded fill `out[i] = bf16(offset + scale * u_i)`, `u_i` uniform in [-1, 1) from `(seed, i)`
/// (kernel nn_fill_uniform): deterministic, independent of the launch geometry.
pub fn plan_fill_uniform<'a>(
    out: &'a DeviceViewMut<'_>,
    n: usize,
    seed: u32,
    offset: f32,
    scale: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    Ok(Launch::new(
        "nn_fill_uniform",
        LaunchConfig::new(to_u32(OP, "blocks", blocks)?, 256),
        args,
    ))
}

impl NnKernels {
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
    use crate::nn::gpu::test_support::{buffer, context};
    use tf_testdriver::test_lock;

    #[test]
    fn embed_gather_plan_checks_table_ids_and_output() {
        let _serial = test_lock();
        let ctx = context();
        let (vocab, cols, rows) = (10, 64, 5);
        let table = buffer(&ctx, vocab * cols * BF16);
        let ids = buffer(&ctx, rows * 4);
        let mut out = buffer(&ctx, rows * cols * BF16);
        let (table_view, ids_view, out_view) = (table.view(), ids.view(), out.view_mut());
        let launch =
            plan_embed_gather(&table_view, vocab, cols, &ids_view, rows, &out_view, cols).unwrap();
        assert_eq!(launch.kernel, "nn_embed_gather");
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
    fn fill_plan_checks_size_and_values() {
        let _serial = test_lock();
        let ctx = context();
        let mut out = buffer(&ctx, 1000 * BF16);
        let out_view = out.view_mut();
        let launch = plan_fill_uniform(&out_view, 1000, 7, 1.0, 0.02).unwrap();
        assert_eq!(launch.kernel, "nn_fill_uniform");
        assert_eq!(launch.args.get::<i64>(1), Some(1000));
        assert_eq!(launch.args.get::<u64>(2), Some(7));
        assert_eq!(launch.config.grid.x, 4);
        assert!(plan_fill_uniform(&out_view, 1001, 7, 0.0, 1.0).is_err());
        assert!(plan_fill_uniform(&out_view, 10, 7, f32::NAN, 1.0).is_err());
        let empty = plan_fill_uniform(&out_view, 0, 7, 0.0, 1.0).unwrap();
        assert_eq!(empty.config.grid.x, 1);
    }
}
