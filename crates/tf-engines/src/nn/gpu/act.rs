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
    let halves = SwigluHalves::fused(OP, order, gate_up, gate_up_layout)?;
    let mut args = Args::new();
    args.push_addr(gate_up.addr())
        .push(to_i32(OP, "gate_up stride", gate_up_layout.stride)?);
    push_swiglu_out(OP, args, order.kernel(), halves, out, out_stride)
}

/// Builds `out = silu(gate) * value` from the two halves held apart, each `layout` (kernel nn_swiglu_apart): a
/// projection run as two GEMMs, one per half.
pub fn plan_swiglu_apart<'a>(
    value: &'a DeviceView<'_>,
    gate: &'a DeviceView<'_>,
    layout: Matrix,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    const OP: &str = "swiglu_apart";
    let halves = SwigluHalves::apart(OP, value, gate, layout)?;
    let mut args = Args::new();
    args.push_addr(halves.gate)
        .push_addr(halves.value)
        .push(to_i32(OP, "input stride", layout.stride)?);
    push_swiglu_out(OP, args, "nn_swiglu_apart", halves, out, out_stride)
}

/// Checks the bf16 output of a SwiGLU and finishes its launch (output, its stride, rows, hidden).
fn push_swiglu_out<'a>(
    op: &'static str,
    mut args: Args,
    kernel: &'static str,
    halves: SwigluHalves,
    out: &'a DeviceViewMut<'_>,
    out_stride: usize,
) -> Result<Launch<'a>, tf_cuda::Error> {
    check_matrix(
        op,
        "out",
        Operand::of_mut(out),
        Matrix {
            rows: halves.rows,
            cols: halves.hidden,
            stride: out_stride,
        },
    )?;
    args.push_addr(out.addr())
        .push(to_i32(op, "out stride", out_stride)?)
        .push(to_i32(op, "rows", halves.rows)?)
        .push(to_i32(op, "hidden", halves.hidden)?);
    Ok(Launch::new(
        kernel,
        row_grid(op, halves.rows, halves.hidden)?,
        args,
    ))
}

/// SwiGLU's two checked input halves: device addresses of each half's first row, the row stride they share (in
/// elements), the rows and the columns of one half.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SwigluHalves {
    pub gate: u64,
    pub value: u64,
    pub stride: usize,
    pub rows: usize,
    pub hidden: usize,
}

impl SwigluHalves {
    /// The halves of a fused matrix of `2 * hidden` columns, in `order`.
    pub(crate) fn fused(
        op: &str,
        order: SwigluOrder,
        fused: &DeviceView<'_>,
        layout: Matrix,
    ) -> Result<SwigluHalves, tf_cuda::Error> {
        if !layout.cols.is_multiple_of(16) {
            return Err(invalid(
                op,
                format!(
                    "the fused input has {} columns: it must be 2 * hidden with hidden a multiple of 8",
                    layout.cols
                ),
            ));
        }
        check_matrix(op, "fused input", Operand::of(fused), layout)?;
        let hidden = layout.cols / 2;
        let second = fused.addr() + (hidden * BF16) as u64;
        let (gate, value) = match order {
            SwigluOrder::GateValue => (fused.addr(), second),
            SwigluOrder::ValueGate => (second, fused.addr()),
        };
        Ok(SwigluHalves {
            gate,
            value,
            stride: layout.stride,
            rows: layout.rows,
            hidden,
        })
    }

    /// Two matrices of the same `layout`, one per half.
    pub(crate) fn apart(
        op: &str,
        value: &DeviceView<'_>,
        gate: &DeviceView<'_>,
        layout: Matrix,
    ) -> Result<SwigluHalves, tf_cuda::Error> {
        check_matrix(op, "value", Operand::of(value), layout)?;
        check_matrix(op, "gate", Operand::of(gate), layout)?;
        Ok(SwigluHalves {
            gate: gate.addr(),
            value: value.addr(),
            stride: layout.stride,
            rows: layout.rows,
            hidden: layout.cols,
        })
    }
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
