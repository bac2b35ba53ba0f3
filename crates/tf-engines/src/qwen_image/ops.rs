//! The Qwen-Image DiT's own kernels (`kernels/qwen_image/adaln.cu`, kernel set `qwen_image_dit`): adaLN (LayerNorm
//! without affine times `(1 + scale)`), the tanh-gated residual and the fused residual + adaLN. Same conventions as [`crate::nn::gpu`]: one `plan_*` function per kernel validates
//! and packs (unit-tested without a GPU); [`DitKernels`] holds these kernels beside the shared [`NnKernels`] and
//! submits.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: tf_cuda::DeviceView<'_>,
//! #         w: tf_cuda::DeviceView<'_>, y: &mut tf_cuda::DeviceViewMut<'_>) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::nn::gpu::Matrix;
//! use tf_engines::qwen_image::ops::DitKernels;
//! let kernels = DitKernels::load(ctx)?;
//! kernels.rms_norm_zc(stream, &x, Matrix::dense(16, 3072), y, 3072, &w, 1e-6)?; // a shared op, through NnKernels
//! # Ok(()) }
//! ```

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Stream};

use crate::nn::gpu::{
    check_eps, check_matrix, check_modulation, check_norm_cols, invalid, push_modulation,
    push_select, row_grid, to_i32, to_u32, Launch, LoadKernelsError, LoadedSet, Matrix, Modulation,
    ModulationRows, NnKernels, Operand, ROW_THREADS,
};

/// Name of the kernel set.
pub const DIT_SET: &str = "qwen_image_dit";

const DIT_KERNELS: &[&str] = &[
    "qi_adaln_modulate",
    "qi_gated_residual",
    "qi_gated_residual_adaln",
];

/// Builds `y = LayerNorm(x) * (1 + scale)` (kernel qi_adaln_modulate).
pub fn plan_adaln_modulate<'a>(
    x: &'a DeviceView<'_>,
    x_layout: Matrix,
    y: &'a DeviceViewMut<'_>,
    y_stride: usize,
    scale: &Modulation<'a, '_>,
    select: ModulationRows,
    eps: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "adaln_modulate";
    let y_layout = x_layout.with_stride(y_stride);
    check_norm_cols(OP, x_layout.cols)?;
    check_eps(OP, eps)?;
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
    Ok(Launch::new(
        "qi_adaln_modulate",
        LaunchConfig::new(to_u32(OP, "rows", x_layout.rows.max(1))?, ROW_THREADS),
        args,
    ))
}

/// Builds `x += tanh(gate) * y` in place on x (kernel qi_gated_residual).
pub fn plan_gated_residual<'a>(
    x: &'a DeviceViewMut<'_>,
    x_layout: Matrix,
    y: &'a DeviceView<'_>,
    y_stride: usize,
    gate: &Modulation<'a, '_>,
    select: ModulationRows,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    Ok(Launch::new(
        "qi_gated_residual",
        row_grid(OP, x_layout.rows, x_layout.cols)?,
        args,
    ))
}

/// Builds the gated residual followed by the next adaLN in one pass (kernel qi_gated_residual_adaln):
/// `x += tanh(gate) * y` in place, then `out = LayerNorm(x) * (1 + scale)` from the stored (bf16) x. The result
/// is bit-identical to [`plan_gated_residual`] followed by [`plan_adaln_modulate`]. `gate` and `scale` must
/// name the same modulation rows (data, rows, stride) at two offsets.
#[allow(clippy::too_many_arguments)]
pub fn plan_gated_residual_adaln<'a>(
    x: &'a DeviceViewMut<'_>,
    x_layout: Matrix,
    y: &'a DeviceView<'_>,
    y_stride: usize,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
    gate: &Modulation<'a, '_>,
    scale: &Modulation<'a, '_>,
    select: ModulationRows,
    eps: f32,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "gated_residual_adaln";
    check_norm_cols(OP, x_layout.cols)?;
    check_eps(OP, eps)?;
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
    Ok(Launch::new(
        "qi_gated_residual_adaln",
        LaunchConfig::new(to_u32(OP, "rows", x_layout.rows.max(1))?, ROW_THREADS),
        args,
    ))
}

/// The DiT's kernels of one context: the `qwen_image_dit` set beside the shared [`NnKernels`], whose launchers it
/// also offers (through `Deref`), so one handle runs the whole DiT step.
pub struct DitKernels {
    nn: NnKernels,
    dit: LoadedSet,
}

impl std::fmt::Debug for DitKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DitKernels")
            .field("nn", &self.nn)
            .field("dit", &self.dit)
            .finish()
    }
}

impl std::ops::Deref for DitKernels {
    type Target = NnKernels;
    fn deref(&self) -> &NnKernels {
        &self.nn
    }
}

impl DitKernels {
    /// Loads the shared sets and the `qwen_image_dit` set into `ctx`.
    pub fn load(ctx: &Context) -> Result<DitKernels, LoadKernelsError> {
        Ok(DitKernels {
            nn: NnKernels::load(ctx)?,
            dit: LoadedSet::load(ctx, DIT_SET, DIT_KERNELS)?,
        })
    }

    /// The shared kernels.
    pub fn nn(&self) -> &NnKernels {
        &self.nn
    }

    /// Submits a launch built by a `plan_*` function of this module or of [`crate::nn::gpu`].
    pub fn submit(&self, stream: &Stream, launch: &Launch<'_>) -> Result<(), tf_cuda::Error> {
        if self.dit.owns(launch.kernel) {
            self.dit.submit(stream, launch)
        } else {
            self.nn.submit(stream, launch)
        }
    }

    /// Submits the launch a `plan_*` function built, or passes its error on: `kernels.run(stream,
    /// plan_adaln_modulate(..))`.
    pub fn run(
        &self,
        stream: &Stream,
        plan: Result<Launch<'_>, tf_cuda::Error>,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(stream, &plan?)
    }
}
