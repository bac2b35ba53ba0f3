//! Activation launchers: SwiGLU of a fused GEMM output, gelu_tanh and silu. Kernel set `nn_act`.

use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{DeviceView, DeviceViewMut, Stream};

use super::launch::{
    check_aligned, check_bytes, check_matrix, invalid, row_grid, to_i32, to_i64, to_u32, Launch,
    Matrix, Operand, BF16, ROW_THREADS,
};
use super::NnKernels;

/// Name of the kernel set holding the activation kernels.
pub const ACT_SET: &str = "nn_act";

/// Which half of a fused SwiGLU GEMM output holds the gate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SwigluOrder {
    /// `[gate | value]` (Qwen-Image, Qwen3): kernel nn_swiglu.
    #[default]
    GateValue,
    /// `[value | gate]` (MiniMax H3): kernel nn_swiglu_value_gate.
    ValueGate,
}

impl SwigluOrder {
    /// The kernel's symbol.
    pub fn kernel(self) -> &'static str {
        match self {
            SwigluOrder::GateValue => "nn_swiglu",
            SwigluOrder::ValueGate => "nn_swiglu_value_gate",
        }
    }
}

/// Builds `out = silu(gate) * up` from a fused `[gate | up]` matrix of 2 * hidden columns (kernel nn_swiglu).
pub fn plan_swiglu<'a>(
    gate_up: &'a DeviceView<'_>,
    gate_up_layout: Matrix,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    plan_swiglu_ordered(
        SwigluOrder::GateValue,
        gate_up,
        gate_up_layout,
        out,
        out_stride,
    )
}

/// Builds `out = silu(gate) * value` from a fused matrix of 2 * hidden columns whose halves are in `order`.
pub fn plan_swiglu_ordered<'a>(
    order: SwigluOrder,
    gate_up: &'a DeviceView<'_>,
    gate_up_layout: Matrix,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    Ok(Launch::new(
        order.kernel(),
        row_grid(OP, gate_up_layout.rows, hidden)?,
        args,
    ))
}

/// Builds an elementwise activation over `n` bf16 values (`kernel` is nn_gelu_tanh or nn_silu); `y` may be
/// a view of the same memory as `x`.
fn plan_elementwise<'a>(
    op: &'static str,
    kernel: &'static str,
    x: Operand,
    y: Operand,
    n: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
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
    Ok(Launch::new(
        kernel,
        LaunchConfig::new(to_u32(op, "blocks", blocks)?, ROW_THREADS),
        args,
    ))
}

impl NnKernels {
    /// SwiGLU of a fused matrix with its halves in `order`; see [`plan_swiglu_ordered`].
    pub fn swiglu_ordered(
        &self,
        stream: &Stream,
        order: SwigluOrder,
        fused: &DeviceView<'_>,
        fused_layout: Matrix,
        out: &mut DeviceViewMut<'_>,
        out_stride: usize,
    ) -> Result<(), tf_cuda::Error> {
        self.submit(
            stream,
            &plan_swiglu_ordered(order, fused, fused_layout, out, out_stride)?,
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
            "nn_gelu_tanh",
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
            &plan_elementwise("gelu_tanh", "nn_gelu_tanh", operand, operand, n)?,
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
        let launch = plan_elementwise("silu", "nn_silu", Operand::of(x), Operand::of_mut(y), n)?;
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
            &plan_elementwise("silu", "nn_silu", operand, operand, n)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_plan_validates_sizes() {
        let x = Operand {
            addr: 0x2000,
            bytes: 2 * 1003,
        };
        let launch = plan_elementwise("silu", "nn_silu", x, x, 1003).unwrap();
        assert_eq!(launch.kernel, "nn_silu");
        assert_eq!(launch.args.len(), 3);
        assert_eq!(launch.args.get::<i64>(2), Some(1003));
        assert_eq!(launch.config.grid.x, 1);
        assert!(plan_elementwise("silu", "nn_silu", x, x, 1004).is_err());
    }

    #[test]
    fn swiglu_order_picks_the_kernel() {
        assert_eq!(SwigluOrder::default().kernel(), "nn_swiglu");
        assert_eq!(SwigluOrder::ValueGate.kernel(), "nn_swiglu_value_gate");
    }
}
