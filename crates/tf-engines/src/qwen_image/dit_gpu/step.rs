//! One DiT step enqueued on the stream: timestep embedding and modulation, the text and image projections into
//! the joint sequence, every block (fused QKV GEMM, QK-norm with RoPE, attention, gated residuals fused with the
//! next adaLN, SwiGLU MLP) and the output projection; and the step's capture into a graph and its replay.
//!
//! A block GEMM group in 8 bits reads the workspace's 8-bit rows, written by the 8-bit twin of the kernel that
//! produces its input: the adaLN (`nn_norm_modulate_fp8|int8`), the gated residual + adaLN
//! (`nn_gated_residual_norm_modulate_fp8|int8`), SwiGLU (`nn_swiglu_fp8|int8`); the attention output is quantized by
//! a pass of its own (`nn_quantize_rows_fp8|int8`). e4m3 rows go to cuBLASLt's row-wise FP8 GEMM, INT8 rows
//! (`gemm=int8`, the default) to our INT8 GEMM, whose q|k|v instance also runs the QK norm and RoPE in its epilogue
//! (`TF_QKV_GEMM`).

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::DeviceBuffer;

use super::kv::GpuKvCache;
use super::workspace::{Fp8Rows, Workspace};
use super::{cuda_err, span, Engine, NoProbe, PhaseWork, StepProbe, MAX_GRAPHS};
use crate::nn::backend_error::gpu_error;
use crate::nn::fp8::RowCodes;
use crate::nn::gpu::attention_8bit::attention_at;
use crate::nn::gpu::gemm::{Fp8Linear, Linear};
use crate::nn::gpu::gemm_int8::{
    EpilogueOperands, Int8GemmOperands, Int8GemmShape, QkvDest, QkvNormRope, QkvRope,
};
use crate::nn::gpu::graph_cache::GraphCache;
use crate::nn::gpu::quant::{
    plan_gated_residual_norm_modulate_with, plan_norm_modulate_codes, plan_quantize_rows,
    plan_swiglu_codes, Fp8Rows as Fp8Out, QuantKernels, ResidualGate,
};
use crate::nn::gpu::{
    attention_flops, AttentionInputs, Matrix, Modulation, ModulationRows, NormKind, NormModulate,
    QkvOutputs, RowModulation, Strides, SwigluOrder, HEAD_DIM,
};
use crate::nn::precision::Fp8Groups;
use crate::nn::weights::BF16;
use crate::qwen_image::config::TIMESTEP_DIM;
use crate::qwen_image::dit::{DitError, KvMode};
use crate::qwen_image::ops::{plan_adaln_modulate, plan_gated_residual_adaln};

/// Where [`Engine::our_int8_gemm`] writes: the products of the weight's `n` rows (dense rows of `n` in the buffer),
/// `silu(gate) * up` of a `[gate | up]` weight's `2 n` rows (rows of `n`), or, with the QK norm and RoPE in the
/// epilogue, q, k and v from a q|k|v weight's `n = 3 width` rows.
enum Int8Out<'o, 'v, 'a> {
    Products(&'o mut DeviceBuffer),
    Swiglu(&'o mut DeviceBuffer),
    Qkv(&'o QkvNormRope<'v, 'a>, &'o QkvOutputs<'v, 'a>),
}

impl Engine {
    fn weight(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, DitError> {
        span(&self.weights, offset, bytes)
    }

    /// Enqueues `linear` on the stream.
    fn gemm(&self, linear: Linear) -> Result<(), DitError> {
        // SAFETY: every span lies inside a live buffer of this engine or of the workspace in use (checked by
        // `span`); those buffers outlive the step: the forward synchronizes the stream before returning, and
        // graphs are stored with (and dropped before reuse of) the workspace whose buffers they reference.
        Ok(unsafe { self.gemms.run(&linear, &self.stream) }?)
    }

    /// A block GEMM `y[m, n] = x · wᵀ` into the dense rows of `y`: in 8 bits when `codes` is given (`x` the
    /// workspace's 8-bit rows `x8`, the weight's codes at `w_offset` with its scales), else in bf16 (`x` =
    /// `x_bf16`, the bf16 weight at `w_offset`).
    #[allow(clippy::too_many_arguments)]
    fn block_gemm(
        &self,
        codes: Option<RowCodes>,
        x8: &Option<Fp8Rows>,
        x_bf16: DeviceSpan,
        (m, n, k): (usize, usize, usize),
        w_offset: usize,
        scales: Option<usize>,
        y: &mut DeviceBuffer,
    ) -> Result<(), DitError> {
        let Some(codes) = codes else {
            let w = self.weight(w_offset, n * k * BF16)?;
            let shape = Int8GemmShape { m, n, k };
            if let Some(ours) = self
                .bf16_gemm
                .as_ref()
                .filter(|_| shape.check_bf16().is_ok())
            {
                let launch = |e: tf_cuda::Error| DitError::Gpu(gpu_error("bf16 GEMM", e));
                // SAFETY: as `gemm`: every span lies in a live buffer of this engine or of the workspace in use.
                return unsafe {
                    ours.gemm_bf16_spans(
                        &self.ctx,
                        &self.stream,
                        shape,
                        (x_bf16, w),
                        (&*y).into(),
                        n,
                    )
                }
                .map_err(launch);
            }
            return self.gemm(Linear::new(m, n, k, x_bf16, w, (&*y).into()));
        };
        self.gemm_8bit(fp8_ref(x8)?, codes, (m, n, k), w_offset, scales, y)
    }

    /// Enqueues the 8-bit GEMM `y[m, n] = x · wᵀ` with `x` the workspace's 8-bit rows (rows of `k` bytes, with
    /// their scales) and the weight's codes at `w_offset` with its per-output-channel scales at `scales`: e4m3
    /// through cuBLASLt's row-wise FP8 GEMM, INT8 through our INT8 GEMM (`gemm=int8`); bf16 out, dense in `y`.
    fn gemm_8bit(
        &self,
        x: &Fp8Rows,
        codes: RowCodes,
        (m, n, k): (usize, usize, usize),
        w_offset: usize,
        scales: Option<usize>,
        y: &mut DeviceBuffer,
    ) -> Result<(), DitError> {
        let scales = scales.ok_or_else(|| {
            DitError::Backend("internal: an 8-bit GEMM group without weight scales".into())
        })?;
        if codes == RowCodes::Int8 {
            return self.our_int8_gemm(x, (m, n, k), (w_offset, scales), Int8Out::Products(y));
        }
        let linear = Fp8Linear::new(
            (m, n, k),
            (span(&x.codes, 0, m * k)?, span(&x.scales, 0, m * 4)?),
            (self.weight(w_offset, n * k)?, self.weight(scales, n * 4)?),
            (&*y).into(),
        )
        .accumulation(self.precision.fp8_accumulation());
        // SAFETY: as `gemm`: every span lies in a live buffer of this engine or of the workspace in use.
        Ok(unsafe { self.gemms.run_fp8(&linear, &self.stream) }?)
    }

    /// Our INT8 GEMM over the workspace's INT8 rows `x` (`m` rows of `k`) and the INT8 weight at `w_offset` with its
    /// channel scales at `scales`, into `out` (see [`Int8Out`] for the weight's rows each form reads).
    fn our_int8_gemm(
        &self,
        x: &Fp8Rows,
        (m, n, k): (usize, usize, usize),
        (w_offset, scales): (usize, usize),
        out: Int8Out<'_, '_, '_>,
    ) -> Result<(), DitError> {
        let ours = self.int8_gemm.as_ref().ok_or_else(|| {
            DitError::Backend("internal: an INT8 GEMM group without our INT8 GEMM loaded".into())
        })?;
        let launch = |e: tf_cuda::Error| DitError::Gpu(gpu_error("INT8 GEMM", e));
        let bytes = |a: usize, b: usize| {
            a.checked_mul(b).ok_or_else(|| {
                DitError::Backend(format!("INT8 GEMM {m} x {n} x {k}: size overflows"))
            })
        };
        let w_rows = match out {
            Int8Out::Swiglu(_) => bytes(n, 2)?,
            Int8Out::Products(_) | Int8Out::Qkv(..) => n,
        };
        let xv = x.codes.slice(0, bytes(m, k)?).map_err(launch)?;
        let x_scale = x.scales.slice(0, bytes(m, 4)?).map_err(launch)?;
        let w = self
            .weights
            .slice(w_offset, bytes(w_rows, k)?)
            .map_err(launch)?;
        let w_scale = self
            .weights
            .slice(scales, bytes(w_rows, 4)?)
            .map_err(launch)?;
        let inputs = Int8GemmOperands {
            x: &xv,
            x_scale: &x_scale,
            w: &w,
            w_scale: &w_scale,
        };
        let (ctx, st) = (&self.ctx, &self.stream);
        match out {
            Int8Out::Products(y) => {
                let mut yv = y.slice_mut(0, bytes(m, n * BF16)?).map_err(launch)?;
                ours.gemm(ctx, st, Int8GemmShape { m, n, k }, &inputs, &mut yv, n)
            }
            Int8Out::Swiglu(y) => {
                let mut yv = y.slice_mut(0, bytes(m, n * BF16)?).map_err(launch)?;
                let order = SwigluOrder::GateValue;
                ours.gemm_swiglu(
                    ctx,
                    st,
                    (m, n, k),
                    order,
                    EpilogueOperands::Int8(&inputs),
                    &mut yv,
                    n,
                )
            }
            Int8Out::Qkv(norm, outputs) => ours.gemm_qkv(
                ctx,
                st,
                (m, k),
                EpilogueOperands::Int8(&inputs),
                norm,
                QkvDest::Apart(outputs),
            ),
        }
        .map_err(launch)
    }

    /// SwiGLU of the workspace's `[gate | up]` GEMM output (`total` rows): into 8-bit rows for the down GEMM when
    /// `fp8` runs it in 8 bits, else into the bf16 activation.
    fn swiglu_apart(
        &self,
        (gate_up, rows8, act): (&DeviceBuffer, &mut Option<Fp8Rows>, &mut DeviceBuffer),
        fp8: Fp8Groups,
        total: usize,
    ) -> Result<(), DitError> {
        let f = self.dims.ffn;
        let st = &self.stream;
        let launch = |e: tf_cuda::Error| DitError::Gpu(gpu_error("kernel launch", e));
        if let Some(codes) = fp8.codes_of(|g| g.mlp_out) {
            let rows8 = fp8_rows(rows8)?;
            let (cv, sv) = (rows8.codes.view_mut(), rows8.scales.view_mut());
            let out = Fp8Out {
                codes: &cv,
                stride: f,
                scales: &sv,
            };
            self.quant()?
                .run(
                    st,
                    plan_swiglu_codes(
                        SwigluOrder::GateValue,
                        &gate_up.view(),
                        Matrix::dense(total, 2 * f),
                        &out,
                        codes,
                    ),
                )
                .map_err(launch)
        } else {
            self.kernels
                .swiglu(
                    st,
                    &gate_up.view(),
                    Matrix::dense(total, 2 * f),
                    &mut act.view_mut(),
                    f,
                )
                .map_err(launch)
        }
    }

    /// The quantizing kernels (loaded whenever some block runs in FP8).
    fn quant(&self) -> Result<&QuantKernels, DitError> {
        self.quant.as_ref().ok_or_else(|| {
            DitError::Backend("internal: an FP8 block without the quantizing kernels".into())
        })
    }

    /// The GEMM groups block `layer` runs in FP8.
    fn fp8_of(&self, layer: usize) -> Fp8Groups {
        self.fp8_groups
            .get(layer)
            .copied()
            .unwrap_or(Fp8Groups::NONE)
    }

    /// Enqueues one step on the stream (no host synchronisation), calling `probe` after each launch group.
    pub(super) fn enqueue_step<P: StepProbe>(
        &self,
        ws: &mut Workspace,
        cache: Option<&GpuKvCache>,
        probe: &mut P,
    ) -> Result<(), DitError> {
        let dims = &self.dims;
        let (d, w, f) = (dims.d, dims.width, dims.ffn);
        let k_ = &self.kernels;
        let st = &self.stream;
        let o = &self.offsets;
        let b = ws.layout.batch;
        let s = ws.layout.seq_len;
        let p = ws.layout.prefix_len;
        let rows = ws.rows;
        let total = b * rows;
        let n_t = ws.n_t;
        let cached = ws.mode == KvMode::Cached;
        let launch = |e: tf_cuda::Error| DitError::Gpu(gpu_error("kernel launch", e));
        // Ends a phase for the probe; the work is evaluated only by probes that use it.
        macro_rules! phase {
            ($name:expr, $kind:ident, $amount:expr) => {
                probe.mark(st, $name, || PhaseWork::$kind(($amount) as f64))?;
            };
        }
        // Runs a quantizing kernel's launch, planned by `$plan` into `$out`: the workspace's 8-bit rows of `$stride`
        // columns with their scales.
        macro_rules! into_rows8 {
            ($stride:expr, |$out:ident| $plan:expr) => {{
                let rows8 = fp8_rows(&mut ws.fp8)?;
                let (cv, sv) = (rows8.codes.view_mut(), rows8.scales.view_mut());
                let $out = Fp8Out {
                    codes: &cv,
                    stride: $stride,
                    scales: &sv,
                };
                self.quant()?.run(st, $plan).map_err(launch)?;
            }};
        }

        // Timestep embedding -> shared modulation [n_t, 5D].
        k_.timestep_embedding(
            st,
            &ws.timesteps.view(),
            &mut ws.sinusoid.view_mut(),
            n_t,
            TIMESTEP_DIM,
            1000.0,
            10000.0,
        )
        .map_err(launch)?;
        self.gemm(Linear::new(
            n_t,
            d,
            TIMESTEP_DIM,
            (&ws.sinusoid).into(),
            self.weight(o.time1, d * TIMESTEP_DIM * BF16)?,
            (&ws.temb1).into(),
        ))?;
        k_.silu_inplace(st, &mut ws.temb1.view_mut(), n_t * d)
            .map_err(launch)?;
        self.gemm(Linear::new(
            n_t,
            d,
            d,
            (&ws.temb1).into(),
            self.weight(o.time2, d * d * BF16)?,
            (&ws.temb2).into(),
        ))?;
        k_.silu_inplace(st, &mut ws.temb2.view_mut(), n_t * d)
            .map_err(launch)?;
        self.gemm(Linear::new(
            n_t,
            5 * d,
            d,
            (&ws.temb2).into(),
            self.weight(o.mod_out, 5 * d * d * BF16)?,
            (&ws.modulation).into(),
        ))?;
        phase!(
            "timestep+modulation",
            Bytes,
            (TIMESTEP_DIM + 6 * d) * d * BF16
        );

        // Text rows through txt_in (not needed when the prefix is cached).
        let l = ws.l_vlm;
        if !cached && l > 0 {
            k_.rms_norm_zc(
                st,
                &ws.text_in.view(),
                Matrix::dense(b * l, dims.ctx),
                &mut ws.text_normed.view_mut(),
                dims.ctx,
                &self
                    .weights
                    .slice(o.txt_norm, dims.ctx * BF16)
                    .map_err(launch)?,
                dims.eps,
            )
            .map_err(launch)?;
            self.gemm(Linear::new(
                b * l,
                d,
                dims.ctx,
                (&ws.text_normed).into(),
                self.weight(o.txt_in, d * dims.ctx * BF16)?,
                (&ws.text_hidden).into(),
            ))?;
            k_.gelu_tanh_inplace(st, &mut ws.text_hidden.view_mut(), b * l * d)
                .map_err(launch)?;
            phase!("txt_in", Flops, 2 * b * l * d * dims.ctx);
        }
        // The joint sequence: each run of text rows / image tokens projected straight into its rows of x.
        for bi in 0..b {
            for run in &ws.runs {
                let dst_row = bi * rows + run.pos - ws.first_row;
                let y = span(&ws.x, dst_row * d * BF16, run.len * d * BF16)?;
                if run.text {
                    let x = span(
                        &ws.text_hidden,
                        (bi * l + run.src) * d * BF16,
                        run.len * d * BF16,
                    )?;
                    self.gemm(Linear::new(
                        run.len,
                        d,
                        d,
                        x,
                        self.weight(o.txt_out, d * d * BF16)?,
                        y,
                    ))?;
                } else {
                    let x = span(
                        &ws.hidden_in,
                        (bi * ws.n_img + run.src) * dims.in_ch * BF16,
                        run.len * dims.in_ch * BF16,
                    )?;
                    self.gemm(Linear::new(
                        run.len,
                        d,
                        dims.in_ch,
                        x,
                        self.weight(o.img_in, d * dims.in_ch * BF16)?,
                        y,
                    ))?;
                }
            }
        }

        phase!(
            "img_in+txt_out",
            Flops,
            ws.runs
                .iter()
                .map(|r| 2 * b * r.len * d * if r.text { d } else { dims.in_ch })
                .sum::<usize>()
        );

        let select = if cached {
            ModulationRows::targets_only(rows)
        } else if self.config.causal_condition {
            ModulationRows {
                seq_len: s,
                target_begin: p,
                prefix_row: b,
            }
        } else {
            ModulationRows {
                seq_len: s,
                target_begin: 0,
                prefix_row: 0,
            }
        };
        let mod_view = ws.modulation.view();
        let modulation = |offset: usize| Modulation {
            data: &mod_view,
            rows: n_t,
            stride: 5 * d,
            offset,
        };
        let x_layout = Matrix::dense(total, d);
        let scale = 1.0 / (dims.head_dim as f32).sqrt();
        let row_strides = |n: usize| Strides {
            batch: n * w,
            row: w,
        };
        let limits_view = ws.key_limits.view();
        let pad_view = ws.key_pad.as_ref().map(DeviceBuffer::view);

        // The FP8 twins of the adaLN and of the gated residual + adaLN: LayerNorm without affine times
        // (1 + scale), tanh gates, the same modulation rows.
        let adaln_fp8 = |scale_offset: usize| NormModulate {
            kind: NormKind::LayerNorm,
            weight: None,
            bias: None,
            eps: dims.eps,
            modulation: Some(RowModulation {
                data: &mod_view,
                rows: n_t,
                stride: 5 * d,
                scale_offset,
                shift_offset: None,
                select,
                row_index: None,
            }),
        };
        let tanh_gate = |offset: usize| ResidualGate {
            data: &mod_view,
            rows: n_t,
            stride: 5 * d,
            offset,
            tanh: true,
            select,
            row_index: None,
        };

        // The first block's adaLN runs alone; every later norm is fused with the gated residual before it.
        if let Some(codes) = self.fp8_of(0).codes_of(|g| g.qkv) {
            into_rows8!(d, |out| plan_norm_modulate_codes(
                &ws.x.view(),
                x_layout,
                d,
                (&out, codes),
                &adaln_fp8(0),
            ));
        } else {
            k_.run(
                st,
                plan_adaln_modulate(
                    &ws.x.view(),
                    x_layout,
                    &ws.normed.view_mut(),
                    d,
                    &modulation(0),
                    select,
                    dims.eps,
                ),
            )
            .map_err(launch)?;
        }
        phase!("adaln1 (block 0)", Bytes, 2 * total * d * BF16);
        let last_layer = o.blocks.len().saturating_sub(1);
        for (layer, bo) in o.blocks.iter().enumerate() {
            let fp8 = self.fp8_of(layer);
            // Attention half (its adaLN ran at the end of the previous block). With the qkv group in INT8 the QK
            // norm and RoPE run in our GEMM's epilogue, which writes q, k and v where the attention reads them.
            let qw = self
                .weights
                .slice(bo.norm_q, HEAD_DIM * BF16)
                .map_err(launch)?;
            let kw = self
                .weights
                .slice(bo.norm_k, HEAD_DIM * BF16)
                .map_err(launch)?;
            {
                let (cos_v, sin_v) = (ws.rope_cos.view(), ws.rope_sin.view());
                let (mut qv, mut kv, mut vv) = (ws.q.view_mut(), ws.k.view_mut(), ws.v.view_mut());
                let mut outputs = QkvOutputs::with_stride((&mut qv, &mut kv, &mut vv), w);
                let norm = QkvNormRope {
                    heads: dims.heads,
                    q_weight: &qw,
                    k_weight: &kw,
                    eps: dims.eps,
                    rope: QkvRope::Interleaved,
                    rope_cos: &cos_v,
                    rope_sin: &sin_v,
                    rope_stride: HEAD_DIM / 2,
                };
                if self.qkv_fused && fp8.codes_of(|g| g.qkv) == Some(RowCodes::Int8) {
                    let scales = bo.scales.qkv.ok_or_else(|| {
                        DitError::Backend(
                            "internal: an 8-bit GEMM group without weight scales".into(),
                        )
                    })?;
                    self.our_int8_gemm(
                        fp8_ref(&ws.fp8)?,
                        (total, 3 * w, d),
                        (bo.qkv, scales),
                        Int8Out::Qkv(&norm, &outputs),
                    )?;
                    phase!("qkv GEMM+qk-norm+rope", Flops, 2 * total * 3 * w * d);
                } else {
                    self.block_gemm(
                        fp8.codes_of(|g| g.qkv),
                        &ws.fp8,
                        (&ws.normed).into(),
                        (total, 3 * w, d),
                        bo.qkv,
                        bo.scales.qkv,
                        &mut ws.qkv,
                    )?;
                    phase!("qkv GEMM", Flops, 2 * total * 3 * w * d);
                    let qkv_view = ws.qkv.view();
                    let inputs = norm
                        .interleaved_pass(&qkv_view, Matrix::dense(total, 3 * w))
                        .map_err(launch)?;
                    k_.qk_norm_rope(st, &inputs, &mut outputs).map_err(launch)?;
                    phase!("qk-norm+rope", Bytes, 2 * total * 3 * w * BF16);
                }
            }
            if let Some(extract) = ws.extract.as_mut() {
                let plane = extract.plane_bytes();
                for (which, src) in [(0usize, &ws.k), (1, &ws.v)] {
                    let at = extract.offset(layer, which);
                    for bi in 0..b {
                        let src_view =
                            src.slice(bi * s * w * BF16, p * w * BF16).map_err(launch)?;
                        let mut dst = extract
                            .buffer
                            .slice_mut(at + bi * (plane / b.max(1)), p * w * BF16)
                            .map_err(launch)?;
                        if p > 0 {
                            k_.copy_rows(st, &src_view, Matrix::dense(p, w), &mut dst, w)
                                .map_err(launch)?;
                        }
                    }
                }
                phase!("kv extract copy", Bytes, 2 * 2 * b * p * w * BF16);
            }
            {
                if let Some((plan, ck, cv)) = ws.compact.as_mut() {
                    for (src, dst) in [(&ws.k, &mut *ck), (&ws.v, &mut *cv)] {
                        for (bi, sample) in plan.runs.iter().enumerate() {
                            for &(from, to, len) in sample {
                                let src_view = src
                                    .slice((bi * s + from) * w * BF16, len * w * BF16)
                                    .map_err(launch)?;
                                let mut dst_view = dst
                                    .slice_mut((bi * plan.num_keys + to) * w * BF16, len * w * BF16)
                                    .map_err(launch)?;
                                k_.copy_rows(
                                    st,
                                    &src_view,
                                    Matrix::dense(len, w),
                                    &mut dst_view,
                                    w,
                                )
                                .map_err(launch)?;
                            }
                        }
                    }
                    phase!(
                        "key compaction copy",
                        Bytes,
                        2 * 2 * plan.runs.iter().flatten().map(|r| r.2).sum::<usize>() * w * BF16
                    );
                }
                let (limit_stride, kv_rows) = match &ws.compact {
                    Some((plan, _, _)) => (rows, plan.num_keys),
                    None => (0, rows),
                };
                let (kv, vv) = match &ws.compact {
                    Some((_, ck, cv)) => (ck.view(), cv.view()),
                    None => (ws.k.view(), ws.v.view()),
                };
                let qv = ws.q.view();
                let prefix_views = match cache {
                    Some(c) if cached => Some((
                        c.buffer
                            .slice(c.offset(layer, 0), c.plane_bytes())
                            .map_err(launch)?,
                        c.buffer
                            .slice(c.offset(layer, 1), c.plane_bytes())
                            .map_err(launch)?,
                    )),
                    _ => None,
                };
                let inputs = AttentionInputs {
                    q: &qv,
                    q_strides: row_strides(rows),
                    prefix: prefix_views
                        .as_ref()
                        .map(|(kp, vp)| (kp, vp, row_strides(p))),
                    k: &kv,
                    v: &vv,
                    kv_strides: row_strides(kv_rows),
                    key_limit: Some((&limits_view, limit_stride)),
                    key_pad: pad_view.as_ref(),
                    scale,
                };
                let shape = ws.attention_shape(dims.heads);
                let mut attn8 = ws.attn8.as_mut().map(DeviceBuffer::view_mut);
                attention_at(
                    self.precision.attention_of(layer, dims.layers),
                    k_,
                    self.attention_tile,
                    self.attention8.as_ref().zip(attn8.as_mut()),
                    st,
                    shape,
                    &inputs,
                    &mut ws.attn.view_mut(),
                    row_strides(rows),
                )
                .map_err(launch)?;
                phase!("attention", Flops, attention_flops(shape));
            }
            if let Some(codes) = fp8.codes_of(|g| g.out) {
                // The attention kernel writes bf16: its output is quantized by a pass of its own.
                into_rows8!(w, |out| plan_quantize_rows(
                    &ws.attn.view(),
                    Matrix::dense(total, w),
                    &out,
                    codes
                ));
                phase!("attention quantize", Bytes, 3 * total * w);
                self.gemm_8bit(
                    fp8_ref(&ws.fp8)?,
                    codes,
                    (total, d, w),
                    bo.to_out,
                    bo.scales.to_out,
                    &mut ws.proj,
                )?;
            } else {
                self.block_gemm(
                    None,
                    &ws.fp8,
                    (&ws.attn).into(),
                    (total, d, w),
                    bo.to_out,
                    None,
                    &mut ws.proj,
                )?;
            }
            phase!("out GEMM", Flops, 2 * total * d * w);
            if let Some(codes) = fp8.codes_of(Fp8Groups::mlp_in) {
                into_rows8!(d, |out| plan_gated_residual_norm_modulate_with(
                    &ws.x.view_mut(),
                    x_layout,
                    d,
                    (&ws.proj.view(), d),
                    &tanh_gate(d),
                    (&out, codes),
                    &adaln_fp8(2 * d),
                    None,
                ));
            } else {
                k_.run(
                    st,
                    plan_gated_residual_adaln(
                        &ws.x.view_mut(),
                        x_layout,
                        &ws.proj.view(),
                        d,
                        &ws.normed.view_mut(),
                        d,
                        &modulation(d),
                        &modulation(2 * d),
                        select,
                        dims.eps,
                    ),
                )
                .map_err(launch)?;
            }
            phase!("residual1+adaln2", Bytes, 4 * total * d * BF16);

            // MLP half. With the SwiGLU in the INT8 gate|up GEMM's epilogue (the default, `TF_SWIGLU_GEMM`) the GEMM
            // writes the bf16 activation and a row pass quantizes it for the down GEMM.
            let int8_mlp = fp8.codes_of(Fp8Groups::mlp_in) == Some(RowCodes::Int8)
                && fp8.codes_of(|g| g.mlp_out) == Some(RowCodes::Int8);
            if self.swiglu_fused && int8_mlp {
                let scales = bo.scales.gate_up.ok_or_else(|| {
                    DitError::Backend("internal: an 8-bit GEMM group without weight scales".into())
                })?;
                self.our_int8_gemm(
                    fp8_ref(&ws.fp8)?,
                    (total, f, d),
                    (bo.gate_up, scales),
                    Int8Out::Swiglu(&mut ws.act),
                )?;
                phase!("gate_up GEMM", Flops, 2 * total * 2 * f * d);
                into_rows8!(f, |out| plan_quantize_rows(
                    &ws.act.view(),
                    Matrix::dense(total, f),
                    &out,
                    RowCodes::Int8,
                ));
                phase!("swiglu", Bytes, total * f * (BF16 + 1));
            } else {
                self.block_gemm(
                    fp8.codes_of(Fp8Groups::mlp_in),
                    &ws.fp8,
                    (&ws.normed).into(),
                    (total, 2 * f, d),
                    bo.gate_up,
                    bo.scales.gate_up,
                    &mut ws.gate_up,
                )?;
                phase!("gate_up GEMM", Flops, 2 * total * 2 * f * d);
                self.swiglu_apart((&ws.gate_up, &mut ws.fp8, &mut ws.act), fp8, total)?;
                phase!("swiglu", Bytes, 3 * total * f * BF16);
            }
            self.block_gemm(
                fp8.codes_of(|g| g.mlp_out),
                &ws.fp8,
                (&ws.act).into(),
                (total, d, f),
                bo.mlp_out,
                bo.scales.mlp_out,
                &mut ws.proj,
            )?;
            phase!("down GEMM", Flops, 2 * total * d * f);
            // The next block's adaLN (FP8 when its qkv GEMM is), or norm_out after the last block.
            let next_codes = (layer != last_layer)
                .then(|| self.fp8_of(layer + 1).codes_of(|g| g.qkv))
                .flatten();
            if let Some(codes) = next_codes {
                into_rows8!(d, |out| plan_gated_residual_norm_modulate_with(
                    &ws.x.view_mut(),
                    x_layout,
                    d,
                    (&ws.proj.view(), d),
                    &tanh_gate(3 * d),
                    (&out, codes),
                    &adaln_fp8(0),
                    None,
                ));
            } else {
                let next_scale = if layer == last_layer { 4 * d } else { 0 };
                k_.run(
                    st,
                    plan_gated_residual_adaln(
                        &ws.x.view_mut(),
                        x_layout,
                        &ws.proj.view(),
                        d,
                        &ws.normed.view_mut(),
                        d,
                        &modulation(3 * d),
                        &modulation(next_scale),
                        select,
                        dims.eps,
                    ),
                )
                .map_err(launch)?;
            }
            phase!("residual2+adaln1", Bytes, 4 * total * d * BF16);
        }
        if o.blocks.is_empty() {
            // No block: norm_out reads x as embedded (a degenerate config, kept correct).
            k_.run(
                st,
                plan_adaln_modulate(
                    &ws.x.view(),
                    x_layout,
                    &ws.normed.view_mut(),
                    d,
                    &modulation(4 * d),
                    select,
                    dims.eps,
                ),
            )
            .map_err(launch)?;
            phase!("norm_out", Bytes, 2 * total * d * BF16);
        }
        self.gemm(
            Linear::new(
                total,
                dims.out_ch,
                d,
                (&ws.normed).into(),
                self.weight(o.proj_out, dims.out_ch * d * BF16)?,
                (&ws.out).into(),
            )
            .f32_output(true),
        )?;
        phase!("proj_out GEMM", Flops, 2 * total * dims.out_ch * d);
        Ok(())
    }

    /// Captures the graph of this workspace for `cache` unless it is cached, then replays it on the stream.
    pub(super) fn replay(
        &self,
        ws: &mut Workspace,
        cache: Option<&GpuKvCache>,
    ) -> Result<(), DitError> {
        self.with_graph(ws, cache, |graph| {
            graph
                .launch(&self.stream)
                .map_err(cuda_err("replaying the step graph"))
        })
    }

    /// Captures the graph of this workspace for `cache` unless it is cached, without running it: called right
    /// after an eager step is enqueued, the capture and instantiation take host time while the device runs that
    /// step, instead of delaying the next one.
    pub(super) fn capture_ahead(
        &self,
        ws: &mut Workspace,
        cache: Option<&GpuKvCache>,
    ) -> Result<(), DitError> {
        self.with_graph(ws, cache, |_| Ok(()))
    }

    /// Runs `then` on the graph of this workspace for `cache`, captured first if it is not cached.
    fn with_graph(
        &self,
        ws: &mut Workspace,
        cache: Option<&GpuKvCache>,
        then: impl FnOnce(&tf_cuda::GraphExec) -> Result<(), DitError>,
    ) -> Result<(), DitError> {
        let key = cache.map(GpuKvCache::binding);
        // The cache lives in the workspace whose buffers the capture records; it is out of it while capturing.
        let mut graphs = std::mem::replace(&mut ws.graphs, GraphCache::new(MAX_GRAPHS));
        let result = graphs
            .capture(
                key,
                &self.stream,
                || self.enqueue_step(ws, cache, &mut NoProbe),
                |what, e| cuda_err(what)(e),
            )
            .and_then(then);
        ws.graphs = graphs;
        result
    }
}

/// The workspace's FP8 rows, to be written.
fn fp8_rows(fp8: &mut Option<Fp8Rows>) -> Result<&mut Fp8Rows, DitError> {
    fp8.as_mut().ok_or_else(missing_fp8_rows)
}

/// The workspace's FP8 rows, to be read by a GEMM.
fn fp8_ref(fp8: &Option<Fp8Rows>) -> Result<&Fp8Rows, DitError> {
    fp8.as_ref().ok_or_else(missing_fp8_rows)
}

fn missing_fp8_rows() -> DitError {
    DitError::Backend("internal: an FP8 block in a workspace without FP8 rows".into())
}
