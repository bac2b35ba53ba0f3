//! The step's GEMMs on our own kernels (`nn::gpu::gemm_int8`): the INT8 groups with their scales, and the bf16
//! groups whose SwiGLU or QK norm and RoPE run in the GEMM's epilogue (`TF_BF16_GEMM=ours`); which call runs where,
//! and the operands each reads from the workspace and the weights.

use tf_cuda::DeviceView;

use super::super::weights::AttnOffsets;
use super::super::Engine;
use super::{launch, Buf, GemmCall, Int8Epilogue, Workspace};
use crate::minimax_h3::dit::H3Error;
use crate::nn::gpu::gemm_int8::{
    EpilogueOperands, Int8GemmKernels, Int8GemmOperands, Int8GemmShape, QkvDest, QkvNormRope,
    QkvRope, HALF96_ROTATED,
};
use crate::nn::gpu::{SwigluOrder, HEAD_DIM};
use crate::nn::weights::BF16;

impl Engine {
    /// Our INT8 GEMM for `c` when it is loaded (`TF_INT8_GEMM=ours`), `c` is an INT8 call and its shape fits the
    /// kernel's tiles; otherwise `c` runs through cuBLASLt into int32 products.
    pub(super) fn int8_gemm_for(&self, c: &GemmCall) -> Option<&Int8GemmKernels> {
        let ours = self.int8_gemm.as_ref()?;
        let shape = Int8GemmShape {
            m: c.m,
            n: c.n,
            k: c.k,
        };
        (c.int8.is_some() && shape.check().is_ok()).then_some(ours)
    }

    /// An 8-bit call in INT8 codes (`gemm=int8`) through our scaled INT8 GEMM: the INT8 rows in [`Buf::Q8`] and
    /// their scales by the weight's codes and channel scales, as bf16 products into `c.y` (rows of `c.n`). With
    /// `swiglu` (`fc1` whole, the fused SwiGLU) the GEMM's epilogue applies the SwiGLU of its `[value | gate]`
    /// columns instead and writes act (`[c.m, c.n / 2]`).
    pub(super) fn scaled_int8_gemm(
        &self,
        ws: &mut Workspace,
        c: GemmCall,
        swiglu: bool,
    ) -> Result<(), H3Error> {
        let (Some(w_scales), Some(ours)) = (c.fp8, self.int8_gemm.as_ref()) else {
            return Err(H3Error::Backend(
                "internal: an INT8 GEMM group without its scales or our INT8 GEMM loaded".into(),
            ));
        };
        if c.m == 0 {
            return Ok(());
        }
        let bytes = |a: usize, b: usize, size: usize| c.bytes(a, b, size);
        let x = ws.q8.slice(0, bytes(c.m, c.k, 1)?).map_err(launch)?;
        let x_scale = ws.q8_scales.slice(0, bytes(c.m, 1, 4)?).map_err(launch)?;
        // The block GEMMs' outputs (fields apart from q8, so both borrows hold).
        let (y_buffer, y_off, y_cols) = match c.y {
            _ if swiglu => (&mut ws.act, 0, c.n / 2),
            Buf::Qkv => (&mut ws.qkv, c.y_off, c.n),
            Buf::Y => (&mut ws.y, c.y_off, c.n),
            Buf::Ff => (&mut ws.ff, c.y_off, c.n),
            other => {
                return Err(H3Error::Backend(format!(
                    "internal: an INT8 GEMM group writing {other:?}"
                )))
            }
        };
        let mut y = y_buffer
            .slice_mut(y_off, bytes(c.m, y_cols, BF16)?)
            .map_err(launch)?;
        let epilogue = if swiglu {
            Int8Epilogue::Swiglu
        } else {
            Int8Epilogue::Products
        };
        self.our_int8_gemm(ours, &c, w_scales, (&x, &x_scale), &mut y, epilogue)
    }

    /// The main rows' q|k|v GEMM `c` with the QK norm and rotate-half RoPE in its epilogue, in place on the q|k|v
    /// rows: on our INT8 GEMM where `c` runs in INT8 with scales, on our bf16 GEMM where `c` is a plain bf16 call and
    /// `TF_BF16_GEMM=ours`; where the fusion is on and the model's heads are the epilogue's (128 channels, 96 of them
    /// turned). False (nothing enqueued) where it does not apply.
    pub(super) fn qkv_fused_gemm(
        &self,
        ws: &mut Workspace,
        c: GemmCall,
        a: &AttnOffsets,
    ) -> Result<bool, H3Error> {
        let d = &self.dims;
        if !(self.qkv_fused
            && c.y == Buf::Qkv
            && d.head_dim == HEAD_DIM
            && d.rotated == HALF96_ROTATED)
        {
            return Ok(false);
        }
        let int8 = match (c.fp8, self.int8_gemm.as_ref()) {
            (Some(w_scales), Some(ours)) if c.scaled_int8() => Some((w_scales, ours)),
            _ => None,
        };
        let bf16 = self.bf16_epilogue_gemm_for(&c);
        if int8.is_none() && bf16.is_none() {
            return Ok(false);
        }
        if c.m == 0 {
            return Ok(true);
        }
        let qw = self.weight_view(a.norm_q, HEAD_DIM * BF16)?;
        let kw = self.weight_view(a.norm_k, HEAD_DIM * BF16)?;
        let (cos, sin) = (ws.rope_cos.view(), ws.rope_sin.view());
        let norm = QkvNormRope {
            heads: d.heads,
            q_weight: &qw,
            k_weight: &kw,
            eps: d.qk_eps,
            rope: QkvRope::Half96,
            rope_cos: &cos,
            rope_sin: &sin,
            rope_stride: d.rotated / 2,
        };
        let mut qkv = ws
            .qkv
            .slice_mut(c.y_off, c.bytes(c.m, c.n, BF16)?)
            .map_err(launch)?;
        let epilogue = Int8Epilogue::QkvInPlace(&norm);
        match (int8, bf16) {
            (Some((w_scales, ours)), _) => {
                let x = ws.q8.slice(0, c.bytes(c.m, c.k, 1)?).map_err(launch)?;
                let x_scale = ws.q8_scales.slice(0, c.bytes(c.m, 1, 4)?).map_err(launch)?;
                self.our_int8_gemm(ours, &c, w_scales, (&x, &x_scale), &mut qkv, epilogue)?;
            }
            (None, Some(ours)) => {
                let x =
                    ws.h.slice(c.x_off, c.bytes(c.m, c.k, BF16)?)
                        .map_err(launch)?;
                self.our_bf16_epilogue_gemm(ours, &c, &x, &mut qkv, epilogue)?;
            }
            (None, None) => {}
        }
        Ok(true)
    }

    /// Our bf16 GEMM when it is loaded (`TF_BF16_GEMM=ours`) for a bf16 call `c` of the normed rows h with no bias
    /// and its weight in the model's buffer, which its epilogue kernels (SwiGLU, q|k|v) can run.
    pub(super) fn bf16_epilogue_gemm_for(&self, c: &GemmCall) -> Option<&Int8GemmKernels> {
        let plain = c.fp8.is_none() && c.int8.is_none() && c.bias.is_none() && c.w_buf.is_none();
        let shape = Int8GemmShape {
            m: c.m,
            n: c.n,
            k: c.k,
        };
        let fits = plain && c.x == Buf::H && shape.check_bf16().is_ok();
        self.bf16_gemm.as_ref().filter(|_| fits)
    }

    /// Our bf16 GEMM for `c` over the bf16 rows `x` into `y` with `epilogue`'s SwiGLU (rows of `c.n / 2`) or q|k|v
    /// norm and RoPE in place (rows of `c.n`), the products rounded to bf16 as the plain GEMM stores them first.
    pub(super) fn our_bf16_epilogue_gemm(
        &self,
        ours: &Int8GemmKernels,
        c: &GemmCall,
        x: &DeviceView<'_>,
        y: &mut tf_cuda::DeviceViewMut<'_>,
        epilogue: Int8Epilogue<'_, '_, '_>,
    ) -> Result<(), H3Error> {
        let w = self.weight_view(c.w, c.bytes(c.n, c.k, BF16)?)?;
        let inputs = EpilogueOperands::Bf16 { x, w: &w };
        let (ctx, st) = (&self.ctx, &self.stream);
        match epilogue {
            Int8Epilogue::Swiglu => {
                let (hidden, order) = (c.n / 2, SwigluOrder::ValueGate);
                ours.gemm_swiglu(ctx, st, (c.m, hidden, c.k), order, inputs, y, hidden)
            }
            Int8Epilogue::QkvInPlace(norm) => {
                let dest = QkvDest::Joint {
                    qkv: y,
                    stride: c.n,
                };
                ours.gemm_qkv(ctx, st, (c.m, c.k), inputs, norm, dest)
            }
            Int8Epilogue::Products => {
                return Err(H3Error::Backend(
                    "internal: a bf16 GEMM without an epilogue runs through run_gemm".into(),
                ))
            }
        }
        .map_err(launch)
    }

    /// Our INT8 GEMM for `c` (its INT8 weight with channel scales at `w_scales`) over the INT8 rows `x` with their
    /// scales into `y`, by `epilogue`: bf16 products (rows of `c.n`); `silu(gate) * value` of its `[value | gate]`
    /// columns (rows of `c.n / 2`); or the q|k|v rows (rows of `c.n`) with q and k normed and rotated in place.
    pub(super) fn our_int8_gemm(
        &self,
        ours: &Int8GemmKernels,
        c: &GemmCall,
        w_scales: usize,
        (x, x_scale): (&DeviceView<'_>, &DeviceView<'_>),
        y: &mut tf_cuda::DeviceViewMut<'_>,
        epilogue: Int8Epilogue<'_, '_, '_>,
    ) -> Result<(), H3Error> {
        let w = self.weight_view(c.w, c.bytes(c.n, c.k, 1)?)?;
        let w_scale = self.weight_view(w_scales, c.bytes(c.n, 1, 4)?)?;
        let inputs = Int8GemmOperands {
            x,
            x_scale,
            w: &w,
            w_scale: &w_scale,
        };
        let (ctx, st) = (&self.ctx, &self.stream);
        match epilogue {
            Int8Epilogue::Products => {
                let shape = Int8GemmShape {
                    m: c.m,
                    n: c.n,
                    k: c.k,
                };
                ours.gemm(ctx, st, shape, &inputs, y, c.n)
            }
            Int8Epilogue::Swiglu => {
                let hidden = c.n / 2;
                let order = SwigluOrder::ValueGate;
                ours.gemm_swiglu(
                    ctx,
                    st,
                    (c.m, hidden, c.k),
                    order,
                    EpilogueOperands::Int8(&inputs),
                    y,
                    hidden,
                )
            }
            Int8Epilogue::QkvInPlace(norm) => {
                let dest = QkvDest::Joint {
                    qkv: y,
                    stride: c.n,
                };
                ours.gemm_qkv(
                    ctx,
                    st,
                    (c.m, c.k),
                    EpilogueOperands::Int8(&inputs),
                    norm,
                    dest,
                )
            }
        }
        .map_err(launch)
    }

    /// The INT8 gate GEMM through our kernel ([`Int8GemmKernels`], `TF_INT8_GEMM=ours`): the INT8 rows and their
    /// scales by the weight's codes and channel scales, as bf16 products in ff's gate half (`[m, fp]` after the
    /// value half), which the SwiGLU of split halves reads.
    pub(super) fn int8_gate_ours(
        &self,
        ws: &mut Workspace,
        ours: &Int8GemmKernels,
        c: GemmCall,
    ) -> Result<(), H3Error> {
        let Some(w_scales) = c.int8 else {
            return Err(H3Error::Backend(
                "internal: our INT8 GEMM needs an INT8 gate call".into(),
            ));
        };
        if c.m == 0 {
            return Ok(());
        }
        let bytes = |a: usize, b: usize, size: usize| c.bytes(a, b, size);
        let x = ws.q8i.slice(c.x_off, bytes(c.m, c.k, 1)?).map_err(launch)?;
        let x_scale = ws.q8i_scales.slice(0, bytes(c.m, 1, 4)?).map_err(launch)?;
        // The gate half of ff, where a bf16 or FP8 gate GEMM run apart writes it: the SwiGLU of split halves reads it.
        let half = bytes(c.m, c.n, BF16)?;
        let mut y = ws.ff.slice_mut(half, half).map_err(launch)?;
        self.our_int8_gemm(
            ours,
            &c,
            w_scales,
            (&x, &x_scale),
            &mut y,
            Int8Epilogue::Products,
        )
    }
}
