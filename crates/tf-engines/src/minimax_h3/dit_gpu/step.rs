//! One H3 DiT step enqueued on the stream, and its capture into a graph and replay:
//!
//! 1. the time embedder in f32 (sinusoid uploaded per forward), `silu(temb)` rounded to bf16 once;
//! 2. every block's adaLN table `[T * 3, 6 * H]` and the output modulation `[T, 2 * H]` (bf16 GEMMs with bias);
//! 3. the video and audio rows through their f32 projections, written straight into their rows of x;
//! 4. the text rows through `context_embedder`, the token refiner (plain pre-norm blocks, no RoPE) and its final
//!    norm, which writes them into their rows of x;
//! 5. every block: fused q|k|v GEMM, QK norm + partial RoPE in place (in the GEMM's epilogue where it runs on our
//!    INT8 GEMM), attention, `to_out`, the gated residual fused
//!    with the next norm and modulation, `fc1` (`[value | gate]`), SwiGLU, `fc2`, and again the gated residual
//!    fused with the next block's norm (after the last block: `norm_out`, modulated by timestep);
//! 6. the f32 video and audio heads over the rows they select.
//!
//! Every GEMM of a step is described once ([`GemmCall`]): the step runs them and [`Engine::gemm_shapes`] lists their
//! plans, so planning ahead sees exactly the shapes the step runs. Nothing here synchronizes with the host.
//!
//! A main-block GEMM group in FP8 reads e4m3 rows with per-row scales from the workspace's `q8` buffers, written
//! by the kernel that produces its input (the shared `nn_quant` kernels): the gated residual + RMSNorm +
//! modulation before `qkv` and `fc1`, SwiGLU before `fc2`, a quantizing pass over the attention output before
//! `to_out`. The normed rows are then never written in bf16. In `gemm=int8` the same kernels write INT8 rows there
//! instead and our scaled INT8 GEMM runs the group.

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::{DeviceBuffer, DeviceView, Stream};

use super::kernels::{
    plan_linear_f32, plan_linear_w8, plan_qk_norm_rope, plan_residual_norm, Elem, LinearF32,
    LinearW8, NormModulation, QkNormRope, ResidualNorm, RowTable, RowsOperand,
};
use super::weights::AttnOffsets;
use super::workspace::{self_attention_shape, ShapeKey, StepGraph, Workspace, WorkspaceSizes};
use super::{cuda_err, Engine};
use crate::minimax_h3::config::MODALITIES;
use crate::minimax_h3::dit::H3Error;
use crate::nn::backend_error::gpu_error;
use crate::nn::fp8::RowCodes;
use crate::nn::gpu::attention_8bit::attention_at;
use crate::nn::gpu::gemm::{self, Fp8Linear, GemmShape, Linear};
use crate::nn::gpu::gemm_int8::{Int8GemmShape, QkvNormRope};
use crate::nn::gpu::graph_cache::GraphCache;
use crate::nn::gpu::quant::{
    plan_dequantize_rows_bf16, plan_gated_residual_norm_modulate_with, plan_norm_modulate_codes,
    plan_quantize_rows, plan_swiglu_codes, plan_swiglu_codes_apart, plan_swiglu_i32gate_fp8,
    Fp8Rows, Int32Gate, QuantKernels, ResidualGate, SecondRows,
};
use crate::nn::gpu::{
    attention_flops, plan_swiglu_apart, plan_swiglu_ordered, AttentionInputs, Matrix,
    ModulationRows, NormKind, NormModulate, RowModulation, Strides, SwigluOrder, HEAD_DIM,
};
use crate::nn::precision::{AttentionPrecision, Fp8Accumulation, Fp8Groups};
use crate::nn::weights::BF16;

mod our_gemm;

fn launch(e: tf_cuda::Error) -> H3Error {
    H3Error::Gpu(gpu_error("kernel launch", e))
}

/// A hook the step calls after each launch group of an eager step (never while a graph is captured). The
/// production step runs with [`NoProbe`], whose marks compile to nothing; the benchmarks (`bench` feature) pass a
/// timer that records an event per mark.
pub(super) trait StepProbe {
    /// Ends the phase `name` (everything enqueued since the previous mark), which did `flops` floating-point
    /// operations (GEMMs, attention) or moved `bytes` (elementwise kernels; 0 where not counted).
    fn mark(
        &mut self,
        stream: &Stream,
        name: &'static str,
        flops: f64,
        bytes: f64,
    ) -> Result<(), H3Error>;
}

/// The production step's probe: marks nothing.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct NoProbe;

impl StepProbe for NoProbe {
    #[inline(always)]
    fn mark(&mut self, _: &Stream, _: &'static str, _: f64, _: f64) -> Result<(), H3Error> {
        Ok(())
    }
}

/// A workspace buffer a GEMM reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Buf {
    Temb,
    Adaln,
    OutMod,
    TextIn,
    Tx,
    H,
    Qkv,
    Attn,
    Y,
    Ff,
    Act,
    /// The e4m3 rows of an FP8 GEMM (their scales in `q8_scales`).
    Q8,
    /// One block's 8-bit adaLN projection dequantized to bf16 (a GEMM's weight, [`GemmCall::w_buf`]).
    AdalnW8,
    /// The INT8 rows of an INT8 GEMM (`fc1`'s gate half; their scales in `q8i_scales`).
    Q8I,
    /// The int32 products of the INT8 gate GEMM.
    GateI32,
}

/// The GEMMs of one attention block over its rows, in the order the block runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockCalls {
    qkv: GemmCall,
    out: GemmCall,
    /// `fc1` whole (`[value | gate]` columns of [`Buf::Ff`]), or its value half when `fc1_gate` holds the gate half.
    fc1: GemmCall,
    /// The gate half of `fc1` run apart (one half of `mlp_in` in FP8): the value half's `[m, fp]` rows, then the gate
    /// half's, in [`Buf::Ff`].
    fc1_gate: Option<GemmCall>,
    fc2: GemmCall,
}

impl BlockCalls {
    fn all(&self) -> impl Iterator<Item = GemmCall> {
        [
            Some(self.qkv),
            Some(self.out),
            Some(self.fc1),
            self.fc1_gate,
            Some(self.fc2),
        ]
        .into_iter()
        .flatten()
    }
}

/// What [`Engine::our_int8_gemm`] writes (its INT8 GEMM's epilogue).
enum Int8Epilogue<'o, 'v, 'a> {
    /// The bf16 products.
    Products,
    /// The SwiGLU of a `[value | gate]` weight.
    Swiglu,
    /// A q|k|v weight's rows with the QK norm and rotate-half RoPE applied, in place.
    QkvInPlace(&'o QkvNormRope<'v, 'a>),
}

/// One bf16 GEMM of the step: `y[m, n] = x[m, k] w[n, k]^T (+ bias)`, operands at byte offsets of workspace
/// buffers (`x`, `y`) and of the weights (`w`, `bias`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GemmCall {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: Buf,
    pub x_off: usize,
    pub w: usize,
    /// Where `w` lies: the model's weights (`None`) or a workspace buffer.
    pub w_buf: Option<Buf>,
    pub y: Buf,
    pub y_off: usize,
    pub bias: Option<usize>,
    /// FP8: the byte offset of the weight's per-output-row f32 scales (the weight at `w` is then e4m3 and `x` is
    /// [`Buf::Q8`]).
    pub fp8: Option<usize>,
    /// INT8: the byte offset of the weight's per-output-row f32 scales (the weight at `w` is then INT8 codes, `x`
    /// is [`Buf::Q8I`] and `y` int32 products, which the SwiGLU dequantizes).
    pub int8: Option<usize>,
    /// The format of an 8-bit call's codes (`fp8` set): e4m3 (cuBLASLt's row-wise FP8 GEMM) or INT8 (`gemm=int8`:
    /// INT8 rows in [`Buf::Q8`], our scaled INT8 GEMM, bf16 products).
    pub codes: RowCodes,
}

impl GemmCall {
    /// Bytes of `a` x `b` elements of `size` bytes (an operand, a scale vector or an output of the call), checked.
    fn bytes(&self, a: usize, b: usize, size: usize) -> Result<usize, H3Error> {
        a.checked_mul(b)
            .and_then(|v| v.checked_mul(size))
            .ok_or_else(|| {
                H3Error::Backend(format!("GEMM {}x{}x{} overflows", self.m, self.n, self.k))
            })
    }

    /// True for an 8-bit call in INT8 codes (`gemm=int8`), which our INT8 GEMM runs instead of cuBLASLt.
    pub(super) fn scaled_int8(&self) -> bool {
        self.fp8.is_some() && self.codes == RowCodes::Int8
    }

    /// Floating-point operations of the call.
    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// The plan this call needs (an FP8 call accumulating as `accumulation` says).
    pub(super) fn shape(&self, accumulation: Fp8Accumulation) -> GemmShape {
        if self.int8.is_some() {
            return gemm::int8_shape_at_offsets(
                (self.m, self.n, self.k),
                (self.x_off, self.w, self.y_off),
            );
        }
        if self.fp8.is_some() {
            return gemm::fp8_shape_at_offsets(
                (self.m, self.n, self.k),
                (self.x_off, self.w, self.y_off),
                false,
                accumulation,
            );
        }
        let shape = gemm::shape_at_offsets(
            self.m,
            self.n,
            self.k,
            (self.x_off, self.w, self.y_off),
            false,
        );
        if self.bias.is_some() {
            shape.with_bias()
        } else {
            shape
        }
    }
}

/// Which rows a block runs over: the token refiner's text rows, or the packed sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    Text,
    Main,
}

/// What is added to the residual stream before the norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Residual {
    /// Nothing: the stream is normed as it is.
    None,
    /// `x += y`.
    Plain,
    /// `x += gate * y`, the gate at `column` of block `layer`'s adaLN rows.
    Gated { layer: usize, column: usize },
}

/// The modulation after the norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Modulate {
    None,
    /// `* (1 + scale) + shift` from block `layer`'s adaLN rows.
    Block {
        layer: usize,
        scale: usize,
        shift: usize,
    },
    /// `norm_out`'s `[shift | scale]`, indexed by timestep.
    Output,
}

/// Where the normed rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The normed-rows buffer h.
    H,
    /// Into x at the text rows (the refiner's final norm).
    TextRowsOfX,
    /// As e4m3 rows with per-row scales into the workspace's `q8` buffers (the input of an FP8 GEMM).
    Fp8,
    /// Both: e4m3 rows into `q8` and bf16 rows into h, in one pass (`fc1` with one half in FP8).
    Fp8AndH,
    /// Both: e4m3 rows into `q8` and INT8 rows into `q8i`, in one pass (`fc1`'s gate half in INT8).
    Fp8AndInt8,
}

impl Engine {
    fn weight_view(&self, offset: usize, bytes: usize) -> Result<DeviceView<'_>, H3Error> {
        self.weights
            .slice(offset, bytes)
            .map_err(cuda_err("addressing a weight"))
    }

    /// Block `layer`'s adaLN table as a bf16 GEMM; `None` when its projection is stored in 8 bits (the `adaln` group:
    /// [`Engine::adaln_fp8`] makes the table).
    fn adaln_call(
        &self,
        sizes: &WorkspaceSizes,
        timesteps: usize,
        layer: usize,
    ) -> Option<GemmCall> {
        let b = self.offsets.blocks.get(layer)?;
        if b.ada_scales.is_some() {
            return None;
        }
        Some(self.adaln_gemm(sizes, timesteps, layer, b.ada_w, None))
    }

    /// The GEMM that makes block `layer`'s adaLN table from a bf16 projection at `w` (in `w_buf`, or the weights).
    fn adaln_gemm(
        &self,
        sizes: &WorkspaceSizes,
        timesteps: usize,
        layer: usize,
        w: usize,
        w_buf: Option<Buf>,
    ) -> GemmCall {
        let d = &self.dims;
        GemmCall {
            m: timesteps,
            n: MODALITIES * d.adaln_row(),
            k: d.temb_p,
            x: Buf::Temb,
            x_off: 0,
            w,
            w_buf,
            y: Buf::Adaln,
            y_off: layer * sizes.adaln_block,
            bias: self.offsets.blocks.get(layer).map(|b| b.ada_b),
            fp8: None,
            int8: None,
            codes: RowCodes::E4m3,
        }
    }

    /// Block `layer`'s adaLN table from its 8-bit projection (weight-only: the bf16 timestep rows times the e4m3 or
    /// INT8 weights, one f32 scale per output row, plus the bias): by the weight-only kernel for a few timestep
    /// rows, else (a workspace over a request's schedule) by a bf16 GEMM over the projection dequantized into the
    /// workspace. The bytes it moves, or `None` when the block's projection is bf16.
    fn adaln_fp8(&self, ws: &mut Workspace, layer: usize) -> Result<Option<f64>, H3Error> {
        let d = &self.dims;
        let Some(b) = self.offsets.blocks.get(layer) else {
            return Ok(None);
        };
        let Some(scales) = b.ada_scales else {
            return Ok(None);
        };
        let (m, n, k) = (ws.key.timesteps, MODALITIES * d.adaln_row(), d.temb_p);
        let z = ws.sizes;
        let w = self.weight_view(b.ada_w, n * k)?;
        let w_scale = self.weight_view(scales, n * 4)?;
        if z.adaln_w8 > 0 {
            // Many timestep rows (a request's schedule): the projection in bf16, then a GEMM.
            {
                let dequantized = ws.adaln_w8.view_mut();
                self.quant()?
                    .run(
                        &self.stream,
                        plan_dequantize_rows_bf16(&w, &w_scale, b.ada_codes, (n, k), &dequantized),
                    )
                    .map_err(launch)?;
            }
            self.run_gemm(ws, self.adaln_gemm(&z, m, layer, 0, Some(Buf::AdalnW8)))?;
            // Codes read, bf16 written and read again by the GEMM: 5 bytes a weight.
            return Ok(Some(5.0 * n as f64 * k as f64));
        }
        let bias = self.weight_view(b.ada_b, n * BF16)?;
        let x = ws.temb.view();
        let y = ws
            .adaln
            .slice_mut(layer * z.adaln_block, m * n * BF16)
            .map_err(launch)?;
        self.kernels
            .run(
                &self.stream,
                plan_linear_w8(&LinearW8 {
                    m,
                    n,
                    k,
                    codes: b.ada_codes,
                    x: &x,
                    x_stride: k,
                    w: &w,
                    w_scale: &w_scale,
                    bias: Some(&bias),
                    y: &y,
                    y_stride: n,
                    sm_count: self.kernels.sm_count(),
                }),
            )
            .map_err(launch)?;
        Ok(Some((n * k) as f64))
    }

    fn norm_out_call(&self, timesteps: usize) -> GemmCall {
        let d = &self.dims;
        GemmCall {
            m: timesteps,
            n: 2 * d.hp,
            k: d.temb_p,
            x: Buf::Temb,
            x_off: 0,
            w: self.offsets.norm_out_w,
            w_buf: None,
            y: Buf::OutMod,
            y_off: 0,
            bias: Some(self.offsets.norm_out_b),
            fp8: None,
            int8: None,
            codes: RowCodes::E4m3,
        }
    }

    fn context_call(&self, text_rows: usize) -> GemmCall {
        let d = &self.dims;
        GemmCall {
            m: text_rows,
            n: d.hp,
            k: d.text_p,
            x: Buf::TextIn,
            x_off: 0,
            w: self.offsets.ctx_w,
            w_buf: None,
            y: Buf::Tx,
            y_off: 0,
            bias: Some(self.offsets.ctx_b),
            fp8: None,
            int8: None,
            codes: RowCodes::E4m3,
        }
    }

    /// The GEMMs of one attention block over `m` rows: q|k|v, `to_out`, `fc1` (one GEMM, or one per half), `fc2`
    /// (an FP8 group reads its e4m3 input rows from [`Buf::Q8`]).
    fn block_calls(&self, a: &AttnOffsets, m: usize) -> BlockCalls {
        let d = &self.dims;
        let s = a.fp8;
        let call = |n, k, x, w, y, y_off, fp8: Option<usize>| GemmCall {
            m,
            n,
            k,
            x: if fp8.is_some() { Buf::Q8 } else { x },
            x_off: 0,
            w,
            w_buf: None,
            y,
            y_off,
            bias: None,
            fp8,
            int8: None,
            codes: s.codes,
        };
        let (fc1, fc1_gate) = match a.fc1_gate {
            None => (call(2 * d.fp, d.hp, Buf::H, a.fc1, Buf::Ff, 0, s.fc1), None),
            Some(gate) if s.fc1_gate_int8 => (
                call(d.fp, d.hp, Buf::H, a.fc1, Buf::Ff, 0, s.fc1),
                Some(GemmCall {
                    int8: s.fc1_gate,
                    ..call(d.fp, d.hp, Buf::Q8I, gate, Buf::GateI32, 0, None)
                }),
            ),
            Some(gate) => (
                call(d.fp, d.hp, Buf::H, a.fc1, Buf::Ff, 0, s.fc1),
                Some(call(
                    d.fp,
                    d.hp,
                    Buf::H,
                    gate,
                    Buf::Ff,
                    m * d.fp * BF16,
                    s.fc1_gate,
                )),
            ),
        };
        BlockCalls {
            qkv: call(3 * d.width, d.hp, Buf::H, a.qkv, Buf::Qkv, 0, s.qkv),
            out: call(d.hp, d.width, Buf::Attn, a.to_out, Buf::Y, 0, s.to_out),
            fc1,
            fc1_gate,
            fc2: call(d.hp, d.fp, Buf::Act, a.fc2, Buf::Y, 0, s.fc2),
        }
    }

    /// Where the norm before main block `layer`'s GEMM group goes: e4m3 rows when `group` of that block runs in
    /// FP8, else the bf16 rows h.
    fn block_norm_target(&self, layer: usize, group: fn(&Fp8Groups) -> bool) -> Target {
        match self.fp8_groups.get(layer) {
            Some(g) if group(g) => Target::Fp8,
            _ => Target::H,
        }
    }

    /// Where the norm before main block `layer`'s `fc1` goes: e4m3 rows for an FP8 `fc1`, e4m3 and INT8 rows for
    /// an FP8 value half beside an INT8 gate half, both e4m3 and bf16 rows when one of its halves runs in FP8, else
    /// the bf16 rows h.
    fn fc1_norm_target(&self, layer: usize) -> Target {
        match self.fp8_groups.get(layer) {
            Some(g) if g.mlp_in() => Target::Fp8,
            Some(g) if g.mlp_in_split() && g.mlp_gate_int8 => Target::Fp8AndInt8,
            Some(g) if g.mlp_in_split() => Target::Fp8AndH,
            _ => Target::H,
        }
    }

    /// The quantizing kernels (loaded when some block runs in FP8).
    fn quant(&self) -> Result<&QuantKernels, H3Error> {
        self.quant.as_ref().ok_or_else(|| {
            H3Error::Backend("internal: an FP8 step without the quantizing kernels".into())
        })
    }

    /// The workspace's FP8 rows (`cols` bytes each) and their scales, as a quantizing kernel's output.
    fn q8_out<'v, 'a>(
        codes: &'v tf_cuda::DeviceViewMut<'a>,
        scales: &'v tf_cuda::DeviceViewMut<'a>,
        cols: usize,
    ) -> Fp8Rows<'v, 'a> {
        Fp8Rows {
            codes,
            stride: cols,
            scales,
        }
    }

    /// The gated residual (or none) + RMSNorm + block modulation over the main rows with an FP8 output into the
    /// workspace's `q8` buffers (the shared `nn_quant` kernels; the residual stream is updated in bf16 as
    /// h3_residual_norm updates it).
    fn residual_norm_fp8(
        &self,
        ws: &mut Workspace,
        residual: Residual,
        weight: usize,
        eps: f32,
        modulate: Modulate,
        target: Target,
    ) -> Result<(), H3Error> {
        let d = &self.dims;
        let z = ws.sizes;
        let hp = d.hp;
        let table_rows = ws.key.timesteps * MODALITIES;
        let row = d.adaln_row();
        let table_bytes = table_rows * row * BF16;
        let Modulate::Block {
            layer: mod_layer,
            scale,
            shift,
        } = modulate
        else {
            return Err(H3Error::Backend(
                "internal: only a block's modulated norm writes FP8 rows".into(),
            ));
        };
        let wv = self.weight_view(weight, hp * BF16)?;
        let ada_index = ws.adaln_index.view();
        let mod_view = ws
            .adaln
            .slice(mod_layer * z.adaln_block, table_bytes)
            .map_err(launch)?;
        let select = ModulationRows::targets_only(1);
        // The rows' codes: the format of the GEMM group they feed (the block being normed for).
        let codes_format = self
            .fp8_groups
            .get(mod_layer)
            .map_or(RowCodes::E4m3, |g| g.gemm_codes);
        let norm = NormModulate {
            kind: NormKind::RmsNorm,
            weight: Some(&wv),
            bias: None,
            eps,
            modulation: Some(RowModulation {
                data: &mod_view,
                rows: table_rows,
                stride: row,
                scale_offset: scale,
                shift_offset: Some(shift),
                select,
                row_index: Some(&ada_index),
            }),
        };
        let layout = Matrix::dense(z.rows, hp);
        let codes = ws.q8.view_mut();
        let scales = ws.q8_scales.view_mut();
        let out = Self::q8_out(&codes, &scales, hp);
        let i8_codes = ws.q8i.view_mut();
        let i8_scales = ws.q8i_scales.view_mut();
        let i8_out = Self::q8_out(&i8_codes, &i8_scales, hp);
        match residual {
            Residual::None if matches!(target, Target::Fp8AndH | Target::Fp8AndInt8) => {
                Err(H3Error::Backend(
                    "internal: only a gated residual's norm writes two kinds of rows together"
                        .into(),
                ))
            }
            Residual::None => {
                let xv = ws.x.view();
                self.quant()?
                    .run(
                        &self.stream,
                        plan_norm_modulate_codes(
                            &xv,
                            layout,
                            d.hidden,
                            (&out, codes_format),
                            &norm,
                        ),
                    )
                    .map_err(launch)
            }
            Residual::Gated { layer, column } => {
                let gate_view = ws
                    .adaln
                    .slice(layer * z.adaln_block, table_bytes)
                    .map_err(launch)?;
                let gate = ResidualGate {
                    data: &gate_view,
                    rows: table_rows,
                    stride: row,
                    offset: column,
                    tanh: false,
                    select,
                    row_index: Some(&ada_index),
                };
                let xv = ws.x.view_mut();
                let yv = ws.y.view();
                let hv = ws.h.view_mut();
                let second = match target {
                    Target::Fp8AndH => Some(SecondRows::Bf16 { h: &hv, stride: hp }),
                    Target::Fp8AndInt8 => Some(SecondRows::Int8(&i8_out)),
                    _ => None,
                };
                let plan = plan_gated_residual_norm_modulate_with(
                    &xv,
                    layout,
                    d.hidden,
                    (&yv, hp),
                    &gate,
                    (&out, codes_format),
                    &norm,
                    second,
                );
                self.quant()?.run(&self.stream, plan).map_err(launch)
            }
            Residual::Plain => Err(H3Error::Backend(
                "internal: the refiner's plain residual has no FP8 output".into(),
            )),
        }
    }

    /// Every GEMM plan a step of `key` runs, one entry per distinct plan in first-call order.
    pub(super) fn gemm_shapes(&self, key: &ShapeKey) -> Result<Vec<GemmShape>, H3Error> {
        let sizes = WorkspaceSizes::of(&self.dims, key)?;
        let mut calls: Vec<GemmCall> = (0..self.offsets.blocks.len())
            .filter_map(|i| self.adaln_call(&sizes, key.timesteps, i))
            .collect();
        calls.push(self.norm_out_call(key.timesteps));
        if sizes.text_rows > 0 {
            calls.push(self.context_call(sizes.text_rows));
            for a in &self.offsets.refiner {
                calls.extend(self.block_calls(a, sizes.text_rows).all());
            }
        }
        for b in &self.offsets.blocks {
            calls.extend(self.block_calls(&b.attn, sizes.rows).all());
        }
        // Where our kernel runs an INT8 GEMM, cuBLASLt has nothing to plan for it.
        calls.retain(|c| self.int8_gemm_for(c).is_none() && !c.scaled_int8());
        Ok(gemm::distinct(
            calls
                .iter()
                .filter(|c| c.m > 0)
                .map(|c| c.shape(self.precision.fp8_accumulation()))
                .collect(),
        ))
    }

    fn buffer(ws: &Workspace, buf: Buf) -> &DeviceBuffer {
        match buf {
            Buf::Temb => &ws.temb,
            Buf::Adaln => &ws.adaln,
            Buf::OutMod => &ws.out_mod,
            Buf::TextIn => &ws.text_in,
            Buf::Tx => &ws.tx,
            Buf::H => &ws.h,
            Buf::Qkv => &ws.qkv,
            Buf::Attn => &ws.attn,
            Buf::Y => &ws.y,
            Buf::Ff => &ws.ff,
            Buf::Act => &ws.act,
            Buf::Q8 => &ws.q8,
            Buf::AdalnW8 => &ws.adaln_w8,
            Buf::Q8I => &ws.q8i,
            Buf::GateI32 => &ws.gate_i32,
        }
    }

    /// Enqueues one GEMM (nothing for no rows).
    fn run_gemm(&self, ws: &mut Workspace, c: GemmCall) -> Result<(), H3Error> {
        if c.m == 0 {
            return Ok(());
        }
        let gemm_err = |e| H3Error::Gpu(gpu_error("GEMM", e));
        // Bytes of bf16 operands, and of 8-bit operands (one byte each) and f32 or int32 rows.
        let bytes = |a: usize, b: usize| c.bytes(a, b, BF16);
        let codes = |a: usize, b: usize| c.bytes(a, b, 1);
        if c.scaled_int8() {
            return self.scaled_int8_gemm(ws, c, false);
        }
        if c.int8.is_some() {
            // INT8 operands and int32 products; the scales apply in the SwiGLU.
            let x =
                gemm::span(Self::buffer(ws, c.x), c.x_off, codes(c.m, c.k)?).map_err(gemm_err)?;
            let w = gemm::span(&self.weights, c.w, codes(c.n, c.k)?).map_err(gemm_err)?;
            let y = gemm::span(Self::buffer(ws, c.y), c.y_off, codes(c.m, c.n * 4)?)
                .map_err(gemm_err)?;
            // SAFETY: as for the bf16 GEMM below: every span lies inside the engine's weights or the workspace in
            // use, both of which outlive the enqueued work.
            return unsafe {
                self.gemms
                    .run_int8((c.m, c.n, c.k), (x, w, y), &self.stream)
            }
            .map_err(gemm_err);
        }
        if let Some(w_scales) = c.fp8 {
            // e4m3 operands with f32 row scales: x's per row, w's per output channel.
            let x = gemm::span(&ws.q8, 0, codes(c.m, c.k)?).map_err(gemm_err)?;
            let x_scale = gemm::span(&ws.q8_scales, 0, codes(c.m, 4)?).map_err(gemm_err)?;
            let w = gemm::span(&self.weights, c.w, codes(c.n, c.k)?).map_err(gemm_err)?;
            let w_scale = gemm::span(&self.weights, w_scales, codes(c.n, 4)?).map_err(gemm_err)?;
            let y =
                gemm::span(Self::buffer(ws, c.y), c.y_off, bytes(c.m, c.n)?).map_err(gemm_err)?;
            let linear = Fp8Linear::new((c.m, c.n, c.k), (x, x_scale), (w, w_scale), y)
                .accumulation(self.precision.fp8_accumulation());
            // SAFETY: as for the bf16 GEMM below: every span (operands and scales) lies inside the engine's
            // weights or the workspace in use, both of which outlive the enqueued work.
            return unsafe { self.gemms.run_fp8(&linear, &self.stream) }.map_err(gemm_err);
        }
        let x: DeviceSpan =
            gemm::span(Self::buffer(ws, c.x), c.x_off, bytes(c.m, c.k)?).map_err(gemm_err)?;
        let w_in = c.w_buf.map_or(&self.weights, |buf| Self::buffer(ws, buf));
        let w = gemm::span(w_in, c.w, bytes(c.n, c.k)?).map_err(gemm_err)?;
        let y = gemm::span(Self::buffer(ws, c.y), c.y_off, bytes(c.m, c.n)?).map_err(gemm_err)?;
        let bias = match c.bias {
            Some(b) => Some(gemm::span(&self.weights, b, bytes(1, c.n)?).map_err(gemm_err)?),
            None => None,
        };
        let shape = Int8GemmShape {
            m: c.m,
            n: c.n,
            k: c.k,
        };
        if let Some(ours) = self.bf16_gemm.as_ref() {
            let aligned = [x.addr, w.addr, y.addr].iter().all(|a| a % 16 == 0);
            if bias.is_none() && aligned && shape.check_bf16().is_ok() {
                // SAFETY: as for cuBLASLt's call below: every span lies inside a live buffer that outlives the work.
                return unsafe {
                    ours.gemm_bf16_spans(&self.ctx, &self.stream, shape, (x, w), y, c.n)
                }
                .map_err(launch);
            }
        }
        let linear = Linear::new(c.m, c.n, c.k, x, w, y).with_bias(bias);
        // SAFETY: every span lies inside a live buffer of this engine (the weights) or of the workspace in use
        // (checked by `gemm::span`); those buffers outlive the work: the forward synchronizes the stream before
        // returning, `GpuH3Dit`'s Drop synchronizes it before anything is freed, and a workspace's graph is stored
        // with (and dropped with) the workspace whose buffers it references.
        unsafe { self.gemms.run(&linear, &self.stream) }.map_err(gemm_err)
    }

    fn linear_f32(&self, op: &LinearF32<'_, '_>) -> Result<(), H3Error> {
        self.kernels
            .run(&self.stream, plan_linear_f32(op))
            .map_err(launch)
    }

    /// The fused residual + RMSNorm (+ modulation) over the text or main rows.
    #[allow(clippy::too_many_arguments)]
    fn residual_norm(
        &self,
        ws: &mut Workspace,
        rows: Rows,
        residual: Residual,
        weight: usize,
        eps: f32,
        modulate: Modulate,
        target: Target,
    ) -> Result<(), H3Error> {
        if matches!(target, Target::Fp8 | Target::Fp8AndH | Target::Fp8AndInt8) {
            if rows != Rows::Main {
                return Err(H3Error::Backend(
                    "internal: only the main rows feed FP8 GEMMs".into(),
                ));
            }
            return self.residual_norm_fp8(ws, residual, weight, eps, modulate, target);
        }
        let d = &self.dims;
        let z = ws.sizes;
        let hp = d.hp;
        let timesteps = ws.key.timesteps;
        let table_rows = timesteps * MODALITIES;
        let row = d.adaln_row();
        let table_bytes = table_rows * row * BF16;
        let n = match rows {
            Rows::Text => z.text_rows,
            Rows::Main => z.rows,
        };
        let wv = self.weight_view(weight, hp * BF16)?;
        let yv = ws.y.view();
        let ada_index = ws.adaln_index.view();
        let t_index = ws.timestep_index.view();
        let text_index = ws.text_index.view();
        let gate_view = match residual {
            Residual::Gated { layer, column } => Some(
                ws.adaln
                    .slice(
                        layer * z.adaln_block + column * BF16,
                        table_bytes - column * BF16,
                    )
                    .map_err(launch)?,
            ),
            _ => None,
        };
        let mod_view = match modulate {
            Modulate::Block { layer, .. } => Some(
                ws.adaln
                    .slice(layer * z.adaln_block, table_bytes)
                    .map_err(launch)?,
            ),
            Modulate::Output => Some(ws.out_mod.view()),
            Modulate::None => None,
        };
        let (xv, ov) = match (rows, target) {
            (Rows::Text, Target::H) => (ws.tx.view_mut(), ws.h.view_mut()),
            (Rows::Text, Target::TextRowsOfX) => (ws.tx.view_mut(), ws.x.view_mut()),
            (Rows::Main, Target::H) => (ws.x.view_mut(), ws.h.view_mut()),
            (Rows::Main, Target::TextRowsOfX) => {
                return Err(H3Error::Backend(
                    "internal: only the refiner's rows are scattered into x".into(),
                ))
            }
            (_, Target::Fp8 | Target::Fp8AndH | Target::Fp8AndInt8) => {
                return Err(H3Error::Backend(
                    "internal: FP8 norms run in residual_norm_fp8".into(),
                ))
            }
        };
        let op = ResidualNorm {
            x: &xv,
            x_layout: Matrix::dense(n, hp),
            residual: match residual {
                Residual::None => None,
                _ => Some((&yv, hp)),
            },
            gate: gate_view.as_ref().map(|g| RowTable {
                data: g,
                rows: table_rows,
                stride: row,
                index: &ada_index,
            }),
            norm_cols: d.hidden,
            eps,
            weight: &wv,
            modulation: match (modulate, mod_view.as_ref()) {
                (Modulate::Block { scale, shift, .. }, Some(m)) => Some(NormModulation {
                    table: RowTable {
                        data: m,
                        rows: table_rows,
                        stride: row,
                        index: &ada_index,
                    },
                    scale_offset: scale,
                    shift_offset: Some(shift),
                }),
                (Modulate::Output, Some(m)) => Some(NormModulation {
                    table: RowTable {
                        data: m,
                        rows: timesteps,
                        stride: 2 * hp,
                        index: &t_index,
                    },
                    scale_offset: hp,
                    shift_offset: Some(0),
                }),
                _ => None,
            },
            out: &ov,
            out_stride: hp,
            out_index: match target {
                Target::H | Target::Fp8 | Target::Fp8AndH | Target::Fp8AndInt8 => None,
                Target::TextRowsOfX => Some((&text_index, z.rows)),
            },
        };
        self.kernels
            .run(&self.stream, plan_residual_norm(&op))
            .map_err(launch)
    }

    /// The attention half of a block on the normed rows h: q|k|v, QK norm (+ RoPE on the main rows), attention
    /// (at `attention`'s precision), `to_out` into y.
    fn attention_half<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        a: &AttnOffsets,
        rows: Rows,
        attention: AttentionPrecision,
        probe: &mut P,
    ) -> Result<(), H3Error> {
        let d = &self.dims;
        let key = ws.key;
        let seq = match rows {
            Rows::Text => key.text,
            Rows::Main => key.seq,
        };
        let (qkv_name, qk_name, attention_name, out_name) = match rows {
            Rows::Text => (
                "refiner qkv GEMM",
                "refiner QK norm",
                "refiner attention",
                "refiner out GEMM",
            ),
            Rows::Main => ("qkv GEMM", "QK norm + RoPE", "attention", "out GEMM"),
        };
        let m = key.batch * seq;
        let calls = self.block_calls(a, m);
        let (qkv_call, out_call) = (calls.qkv, calls.out);
        // The main rows' QK norm and RoPE run in our INT8 q|k|v GEMM's epilogue where that GEMM runs in INT8.
        if rows == Rows::Main && self.qkv_fused_gemm(ws, qkv_call, a)? {
            probe.mark(
                &self.stream,
                "qkv GEMM + QK norm + RoPE",
                qkv_call.flops(),
                0.0,
            )?;
        } else {
            self.run_gemm(ws, qkv_call)?;
            probe.mark(&self.stream, qkv_name, qkv_call.flops(), 0.0)?;
            let qkv = ws.qkv.view_mut();
            let (cos, sin) = (ws.rope_cos.view(), ws.rope_sin.view());
            let qw = self.weight_view(a.norm_q, HEAD_DIM * BF16)?;
            let kw = self.weight_view(a.norm_k, HEAD_DIM * BF16)?;
            let op = QkNormRope {
                qkv: &qkv,
                qkv_layout: Matrix::dense(m, 3 * d.width),
                heads: d.heads,
                q_weight: &qw,
                k_weight: &kw,
                norm_dim: d.head_dim,
                eps: d.qk_eps,
                rope: match rows {
                    Rows::Main => Some((&cos, &sin, d.rotated / 2, d.rotated)),
                    Rows::Text => None,
                },
            };
            self.kernels
                .run(&self.stream, plan_qk_norm_rope(&op))
                .map_err(launch)?;
            probe.mark(&self.stream, qk_name, 0.0, (4 * m * d.width * BF16) as f64)?;
        }
        // A sequence-parallel rank's main rows attend across the ranks instead (super::parallel).
        if !self.sequence_parallel_attention(ws, rows == Rows::Main)? {
            let qkv = ws.qkv.view();
            let part = d.width * BF16;
            let len = qkv.len();
            let k = qkv.slice(part, len - part).map_err(launch)?;
            let v = qkv.slice(2 * part, len - 2 * part).map_err(launch)?;
            let strides = Strides {
                batch: seq * 3 * d.width,
                row: 3 * d.width,
            };
            let scale = 1.0 / (d.head_dim as f32).sqrt();
            let inputs = AttentionInputs::self_attention(&qkv, &k, &v, strides, scale);
            let shape = self_attention_shape(d, key.batch, seq);
            let mut o = ws.attn.view_mut();
            let o_strides = Strides {
                batch: seq * d.width,
                row: d.width,
            };
            let mut attn8 = ws.attn8.view_mut();
            attention_at(
                attention,
                &self.kernels,
                self.tile,
                self.attention8.as_ref().map(|k8| (k8, &mut attn8)),
                &self.stream,
                shape,
                &inputs,
                &mut o,
                o_strides,
            )
            .map_err(launch)?;
            probe.mark(&self.stream, attention_name, attention_flops(shape), 0.0)?;
        }
        if out_call.fp8.is_some() {
            self.quantize_to_q8(ws, Buf::Attn, (m, d.width), out_call.codes)?;
            probe.mark(
                &self.stream,
                "attention output to FP8",
                0.0,
                (m * d.width * (BF16 + 1)) as f64,
            )?;
        }
        self.run_gemm(ws, out_call)?;
        probe.mark(&self.stream, out_name, out_call.flops(), 0.0)
    }

    /// The feed-forward half of a block on the normed rows h: `fc1` (`[value | gate]`), SwiGLU, `fc2` into y.
    fn mlp<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        a: &AttnOffsets,
        rows: Rows,
        probe: &mut P,
    ) -> Result<(), H3Error> {
        let fp = self.dims.fp;
        let m = match rows {
            Rows::Text => ws.sizes.text_rows,
            Rows::Main => ws.sizes.rows,
        };
        let (fc1_name, act_name, fc2_name) = match rows {
            Rows::Text => ("refiner fc1 GEMM", "refiner SwiGLU", "refiner fc2 GEMM"),
            Rows::Main => ("fc1 GEMM", "SwiGLU", "fc2 GEMM"),
        };
        let calls = self.block_calls(a, m);
        let fc1_flops: f64 = [Some(calls.fc1), calls.fc1_gate]
            .iter()
            .flatten()
            .map(GemmCall::flops)
            .sum();
        if self.swiglu_fused
            && calls.fc1.scaled_int8()
            && calls.fc1_gate.is_none()
            && calls.fc2.scaled_int8()
        {
            // The SwiGLU in the INT8 fc1 GEMM's epilogue (the default, `TF_SWIGLU_GEMM`): act in bf16, then its
            // INT8 rows.
            self.scaled_int8_gemm(ws, calls.fc1, true)?;
            probe.mark(&self.stream, fc1_name, fc1_flops, 0.0)?;
            self.quantize_to_q8(ws, Buf::Act, (m, fp), RowCodes::Int8)?;
            probe.mark(&self.stream, act_name, 0.0, (m * fp * (BF16 + 1)) as f64)?;
            self.run_gemm(ws, calls.fc2)?;
            return probe.mark(&self.stream, fc2_name, calls.fc2.flops(), 0.0);
        }
        let plain_fc2 = calls.fc2.fp8.is_none() && calls.fc2.int8.is_none();
        let bf16_fused = self.bf16_epilogue_gemm_for(&calls.fc1);
        if let (true, None, true, Some(ours)) =
            (self.swiglu_fused, calls.fc1_gate, plain_fc2, bf16_fused)
        {
            // The SwiGLU in our bf16 fc1 GEMM's epilogue (`TF_BF16_GEMM=ours`): act in bf16 for fc2.
            if m > 0 {
                let fc1 = calls.fc1;
                let x =
                    ws.h.slice(fc1.x_off, fc1.bytes(m, fc1.k, BF16)?)
                        .map_err(launch)?;
                let mut act = ws
                    .act
                    .slice_mut(0, fc1.bytes(m, fp, BF16)?)
                    .map_err(launch)?;
                self.our_bf16_epilogue_gemm(ours, &fc1, &x, &mut act, Int8Epilogue::Swiglu)?;
            }
            probe.mark(&self.stream, fc1_name, fc1_flops, 0.0)?;
            probe.mark(&self.stream, act_name, 0.0, 0.0)?;
            self.run_gemm(ws, calls.fc2)?;
            return probe.mark(&self.stream, fc2_name, calls.fc2.flops(), 0.0);
        }
        self.run_gemm(ws, calls.fc1)?;
        let ours = calls.fc1_gate.and_then(|gate| self.int8_gemm_for(&gate));
        match (calls.fc1_gate, ours) {
            (Some(gate), Some(ours)) => self.int8_gate_ours(ws, ours, gate)?,
            (Some(gate), None) => self.run_gemm(ws, gate)?,
            (None, _) => {}
        }
        probe.mark(&self.stream, fc1_name, fc1_flops, 0.0)?;
        match calls.fc1_gate {
            // Our INT8 GEMM wrote the gate half in bf16, as a split bf16 or FP8 gate GEMM does.
            Some(gate) if gate.int8.is_some() && ours.is_none() => {
                self.swiglu_int32_gate(ws, m, gate)?
            }
            _ => self.swiglu(
                ws,
                m,
                calls.fc1_gate.is_some(),
                calls.fc2.fp8.map(|_| calls.fc2.codes),
            )?,
        }
        probe.mark(&self.stream, act_name, 0.0, (3 * m * fp * BF16) as f64)?;
        self.run_gemm(ws, calls.fc2)?;
        probe.mark(&self.stream, fc2_name, calls.fc2.flops(), 0.0)
    }

    /// A quantizing pass over `rows` x `cols` bf16 rows of `source` ([`Buf::Attn`]: the attention output, written
    /// by a kernel that never holds a token's whole row; [`Buf::Act`]: the fused SwiGLU's activation) into the
    /// workspace's 8-bit rows (`codes_format`) and scales, for the next 8-bit GEMM.
    fn quantize_to_q8(
        &self,
        ws: &mut Workspace,
        source: Buf,
        (rows, cols): (usize, usize),
        codes_format: RowCodes,
    ) -> Result<(), H3Error> {
        let input = match source {
            Buf::Attn => ws.attn.view(),
            Buf::Act => ws.act.view(),
            other => {
                return Err(H3Error::Backend(format!(
                    "internal: a quantizing pass over {other:?}"
                )))
            }
        };
        let codes = ws.q8.view_mut();
        let scales = ws.q8_scales.view_mut();
        self.quant()?
            .run(
                &self.stream,
                plan_quantize_rows(
                    &input,
                    Matrix::dense(rows, cols),
                    &Self::q8_out(&codes, &scales, cols),
                    codes_format,
                ),
            )
            .map_err(launch)
    }

    /// SwiGLU of ff's `[m, 2 * fp]` `[value | gate]` rows (or, `apart`, its value half's `[m, fp]` rows, then the
    /// gate half's) into the next GEMM's input: 8-bit rows in the format `codes8`, or (`None`) act in bf16.
    fn swiglu(
        &self,
        ws: &mut Workspace,
        m: usize,
        apart: bool,
        codes8: Option<RowCodes>,
    ) -> Result<(), H3Error> {
        let fp = self.dims.fp;
        let codes = ws.q8.view_mut();
        let scales = ws.q8_scales.view_mut();
        let q8 = Self::q8_out(&codes, &scales, fp);
        let act = ws.act.view_mut();
        let half = m * fp * BF16;
        let ff = ws.ff.view();
        let value = ws.ff.slice(0, half).map_err(launch)?;
        let gate = ws.ff.slice(half, half).map_err(launch)?;
        let (fused, each) = (Matrix::dense(m, 2 * fp), Matrix::dense(m, fp));
        let order = SwigluOrder::ValueGate;
        match (apart, codes8) {
            (false, Some(f)) => self
                .quant()?
                .run(&self.stream, plan_swiglu_codes(order, &ff, fused, &q8, f)),
            (true, Some(f)) => self.quant()?.run(
                &self.stream,
                plan_swiglu_codes_apart(&value, &gate, each, &q8, f),
            ),
            (false, None) => self.kernels.run(
                &self.stream,
                plan_swiglu_ordered(order, &ff, fused, &act, fp),
            ),
            (true, None) => self.kernels.run(
                &self.stream,
                plan_swiglu_apart(&value, &gate, each, &act, fp),
            ),
        }
        .map_err(launch)
    }

    /// SwiGLU of ff's value half (`[m, fp]` bf16, the FP8 GEMM's) and the INT8 `gate` GEMM's int32 products into
    /// the e4m3 rows of `fc2` (the precision requires `mlp_out` beside `mlp_gate=int8`).
    fn swiglu_int32_gate(
        &self,
        ws: &mut Workspace,
        m: usize,
        gate: GemmCall,
    ) -> Result<(), H3Error> {
        let fp = self.dims.fp;
        let Some(w_scales) = gate.int8 else {
            return Err(H3Error::Backend(
                "internal: the INT8 SwiGLU needs an INT8 gate GEMM".into(),
            ));
        };
        let codes = ws.q8.view_mut();
        let scales = ws.q8_scales.view_mut();
        let q8 = Self::q8_out(&codes, &scales, fp);
        let value = ws.ff.slice(0, m * fp * BF16).map_err(launch)?;
        let products = ws.gate_i32.view();
        let row_scales = ws.q8i_scales.view();
        let col_scales = self.weight_view(w_scales, fp * 4)?;
        let gate_rows = Int32Gate {
            products: &products,
            stride: fp,
            row_scales: &row_scales,
            col_scales: &col_scales,
        };
        self.quant()?
            .run(
                &self.stream,
                plan_swiglu_i32gate_fp8(&value, Matrix::dense(m, fp), &gate_rows, &q8),
            )
            .map_err(launch)
    }

    /// Enqueues one step on the stream (no host synchronisation), calling `probe` after each launch group: the
    /// timestep tables ([`Engine::enqueue_tables`]), then the rest ([`Engine::enqueue_body`]).
    pub(super) fn enqueue_step<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        probe: &mut P,
    ) -> Result<(), H3Error> {
        self.enqueue_tables(ws, probe)?;
        self.enqueue_body(ws, probe)
    }

    /// The step's first two phases, which depend on the timestep values only: the time embedder, every block's
    /// adaLN table and the output modulation, for all `key.timesteps` rows of the workspace. A workspace laid out
    /// over a request's whole timestep schedule makes them once for all its steps.
    pub(super) fn enqueue_tables<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        probe: &mut P,
    ) -> Result<(), H3Error> {
        let d = self.dims;
        let o = &self.offsets;
        let key = ws.key;
        let z = ws.sizes;
        let nt = key.timesteps;
        let f32_rows = RowsOperand::f32_rows;

        // 1. Time embedder (f32): linear_1 + SiLU, linear_2 + SiLU (temb only enters the model through SiLU).
        self.linear_f32(&LinearF32 {
            m: nt,
            n: d.time_hidden,
            k: d.freq,
            x: &ws.sinusoid.view(),
            x_rows: f32_rows(nt, d.freq),
            w: &self.weight_view(o.time1_w, d.time_hidden * d.freq * 4)?,
            bias: Some(&self.weight_view(o.time1_b, d.time_hidden * 4)?),
            y: &ws.time_hidden.view_mut(),
            y_rows: f32_rows(nt, d.time_hidden),
            silu: true,
        })?;
        self.linear_f32(&LinearF32 {
            m: nt,
            n: d.temb_p,
            k: d.time_hidden,
            x: &ws.time_hidden.view(),
            x_rows: f32_rows(nt, d.time_hidden),
            w: &self.weight_view(o.time2_w, d.temb_p * d.time_hidden * 4)?,
            bias: Some(&self.weight_view(o.time2_b, d.temb_p * 4)?),
            y: &ws.temb.view_mut(),
            y_rows: RowsOperand {
                elem: Elem::Bf16,
                rows: nt,
                stride: d.temb_p,
                index: None,
            },
            silu: true,
        })?;
        let time_flops = 2.0 * nt as f64 * d.time_hidden as f64 * (d.freq + d.temb_p) as f64;
        probe.mark(&self.stream, "time embedder", time_flops, 0.0)?;

        // 2. The adaLN tables of every block and the output modulation.
        let mut table_bytes = 0.0;
        for layer in 0..o.blocks.len() {
            if let Some(call) = self.adaln_call(&z, nt, layer) {
                self.run_gemm(ws, call)?;
                table_bytes += (call.n * call.k * BF16) as f64;
            } else if let Some(bytes) = self.adaln_fp8(ws, layer)? {
                table_bytes += bytes;
            }
        }
        self.run_gemm(ws, self.norm_out_call(nt))?;
        // Memory-bound (a few rows): the weights read is the work.
        probe.mark(&self.stream, "adaLN tables", 0.0, table_bytes)
    }

    /// Every phase of the step after the timestep tables, which it reads from the workspace.
    pub(super) fn enqueue_body<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        probe: &mut P,
    ) -> Result<(), H3Error> {
        let d = self.dims;
        let o = &self.offsets;
        let key = ws.key;
        let z = ws.sizes;
        let hp = d.hp;
        let f32_rows = RowsOperand::f32_rows;
        // Bytes a norm over the main or text rows moves: `passes` row-sized reads and writes.
        let norm_bytes = |passes: usize| (passes * z.rows * hp * BF16) as f64;
        let text_norm_bytes = |passes: usize| (passes * z.text_rows * hp * BF16) as f64;

        // 3. Video and audio rows (f32 projections) straight into their rows of x.
        let heads_in = [
            (key.video, d.video, o.proj_in_w, o.proj_in_b, true),
            (key.audio, d.audio, o.audio_in_w, o.audio_in_b, false),
        ];
        for (per_item, channels, w, b, video) in heads_in {
            let m = key.batch * per_item;
            if m == 0 {
                continue;
            }
            let (input, index) = if video {
                (ws.video_in.view(), ws.video_index.view())
            } else {
                (ws.audio_in.view(), ws.audio_index.view())
            };
            self.linear_f32(&LinearF32 {
                m,
                n: hp,
                k: channels,
                x: &input,
                x_rows: f32_rows(m, channels),
                w: &self.weight_view(w, hp * channels * 4)?,
                bias: Some(&self.weight_view(b, hp * 4)?),
                y: &ws.x.view_mut(),
                y_rows: RowsOperand {
                    elem: Elem::Bf16,
                    rows: z.rows,
                    stride: hp,
                    index: Some(&index),
                },
                silu: false,
            })?;
        }

        probe.mark(
            &self.stream,
            "input projections",
            2.0 * (key.batch * (key.video * d.video + key.audio * d.audio) * hp) as f64,
            0.0,
        )?;

        // 4. Text rows: context_embedder, the token refiner, its final norm written into x.
        let text = z.text_rows;
        if text > 0 {
            let context = self.context_call(text);
            self.run_gemm(ws, context)?;
            probe.mark(&self.stream, "context embedder", context.flops(), 0.0)?;
            let refiner = &o.refiner;
            if let Some(first) = refiner.first() {
                self.residual_norm(
                    ws,
                    Rows::Text,
                    Residual::None,
                    first.norm1,
                    d.norm_eps,
                    Modulate::None,
                    Target::H,
                )?;
                probe.mark(&self.stream, "refiner norms", 0.0, text_norm_bytes(2))?;
            }
            for (j, a) in refiner.iter().enumerate() {
                self.attention_half(ws, a, Rows::Text, AttentionPrecision::Bf16, probe)?;
                self.residual_norm(
                    ws,
                    Rows::Text,
                    Residual::Plain,
                    a.norm2,
                    d.norm_eps,
                    Modulate::None,
                    Target::H,
                )?;
                probe.mark(&self.stream, "refiner norms", 0.0, text_norm_bytes(4))?;
                self.mlp(ws, a, Rows::Text, probe)?;
                match refiner.get(j + 1) {
                    Some(next) => self.residual_norm(
                        ws,
                        Rows::Text,
                        Residual::Plain,
                        next.norm1,
                        d.norm_eps,
                        Modulate::None,
                        Target::H,
                    )?,
                    None => self.residual_norm(
                        ws,
                        Rows::Text,
                        Residual::Plain,
                        o.refiner_norm,
                        d.final_eps,
                        Modulate::None,
                        Target::TextRowsOfX,
                    )?,
                }
                probe.mark(&self.stream, "refiner norms", 0.0, text_norm_bytes(4))?;
            }
            if refiner.is_empty() {
                self.residual_norm(
                    ws,
                    Rows::Text,
                    Residual::None,
                    o.refiner_norm,
                    d.final_eps,
                    Modulate::None,
                    Target::TextRowsOfX,
                )?;
                probe.mark(&self.stream, "refiner norms", 0.0, text_norm_bytes(2))?;
            }
        }

        // 5. The blocks; each norm after the first is fused with the gated residual before it.
        let (shift1, scale1, gate1) = (0, hp, 2 * hp);
        let (shift2, scale2, gate2) = (3 * hp, 4 * hp, 5 * hp);
        match o.blocks.first() {
            Some(first) => self.residual_norm(
                ws,
                Rows::Main,
                Residual::None,
                first.attn.norm1,
                d.norm_eps,
                Modulate::Block {
                    layer: 0,
                    scale: scale1,
                    shift: shift1,
                },
                self.block_norm_target(0, |g| g.qkv),
            )?,
            None => self.residual_norm(
                ws,
                Rows::Main,
                Residual::None,
                o.norm_out,
                d.final_eps,
                Modulate::Output,
                Target::H,
            )?,
        }
        probe.mark(&self.stream, "norm (block 0)", 0.0, norm_bytes(2))?;
        for (layer, b) in o.blocks.iter().enumerate() {
            let attention = self.precision.attention_of(layer, d.layers);
            self.attention_half(ws, &b.attn, Rows::Main, attention, probe)?;
            self.residual_norm(
                ws,
                Rows::Main,
                Residual::Gated {
                    layer,
                    column: gate1,
                },
                b.attn.norm2,
                d.norm_eps,
                Modulate::Block {
                    layer,
                    scale: scale2,
                    shift: shift2,
                },
                self.fc1_norm_target(layer),
            )?;
            probe.mark(
                &self.stream,
                "residual + norm (attention)",
                0.0,
                norm_bytes(4),
            )?;
            self.mlp(ws, &b.attn, Rows::Main, probe)?;
            let gate = Residual::Gated {
                layer,
                column: gate2,
            };
            match o.blocks.get(layer + 1) {
                Some(next) => self.residual_norm(
                    ws,
                    Rows::Main,
                    gate,
                    next.attn.norm1,
                    d.norm_eps,
                    Modulate::Block {
                        layer: layer + 1,
                        scale: scale1,
                        shift: shift1,
                    },
                    self.block_norm_target(layer + 1, |g| g.qkv),
                )?,
                None => self.residual_norm(
                    ws,
                    Rows::Main,
                    gate,
                    o.norm_out,
                    d.final_eps,
                    Modulate::Output,
                    Target::H,
                )?,
            }
            probe.mark(
                &self.stream,
                "residual + norm (feed-forward)",
                0.0,
                norm_bytes(4),
            )?;
        }

        // 6. The f32 heads over the rows they select (norm_out's bf16 rows read as f32).
        let heads_out = [
            (key.video, d.video, o.proj_out_w, o.proj_out_b, true),
            (key.audio, d.audio, o.audio_out_w, o.audio_out_b, false),
        ];
        for (per_item, channels, w, b, video) in heads_out {
            let m = key.batch * per_item;
            if m == 0 {
                continue;
            }
            let index = if video {
                ws.video_index.view()
            } else {
                ws.audio_index.view()
            };
            let hv = ws.h.view();
            let out = if video {
                ws.sample.view_mut()
            } else {
                ws.audio_sample.view_mut()
            };
            self.linear_f32(&LinearF32 {
                m,
                n: channels,
                k: hp,
                x: &hv,
                x_rows: RowsOperand {
                    elem: Elem::Bf16,
                    rows: z.rows,
                    stride: hp,
                    index: Some(&index),
                },
                w: &self.weight_view(w, channels * hp * 4)?,
                bias: Some(&self.weight_view(b, channels * 4)?),
                y: &out,
                y_rows: f32_rows(m, channels),
                silu: false,
            })?;
        }
        probe.mark(
            &self.stream,
            "heads",
            2.0 * (key.batch * (key.video * d.video + key.audio * d.audio) * hp) as f64,
            0.0,
        )
    }

    /// Captures the step of this workspace unless it is captured, then replays it on the stream: the whole step
    /// with `tables`, else its body alone (the workspace's timestep tables are current).
    pub(super) fn replay(&self, ws: &mut Workspace, tables: bool) -> Result<(), H3Error> {
        let key = StepGraph {
            key: ws.key,
            tables,
        };
        // The graph cache lives in the workspace whose buffers the capture records; it is out of it while capturing.
        let mut graphs = std::mem::replace(&mut ws.graphs, GraphCache::new(1));
        let result = graphs
            .capture(
                key,
                &self.stream,
                || {
                    if tables {
                        self.enqueue_step(ws, &mut NoProbe)
                    } else {
                        self.enqueue_body(ws, &mut NoProbe)
                    }
                },
                |what, e| cuda_err(what)(e),
            )
            .and_then(|graph| {
                graph
                    .launch(&self.stream)
                    .map_err(cuda_err("replaying the step graph"))
            });
        ws.graphs = graphs;
        result
    }
}
