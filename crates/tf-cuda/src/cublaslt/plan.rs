//! The GEMM description engines write, its validation, and its mapping onto cuBLASLt's
//! column-major call. Pure data: nothing here touches the library or the device.
//!
//! Row-major `Y[M,N] = X[M,K] · W[N,K]^T` is computed as the column-major product
//! `Yᵀ[N,M] = op(A) · op(B)` with `A = W` read as a K×N column-major matrix (ld K, op T), and
//! `B = X` read as a K×M column-major matrix (ld K, op N); `D = C = Y` is N×M column-major (ld N).
//! This is cuBLASLt's "TN" form, the one its FP8 kernels require. A per-output-column bias of
//! row-major `Y` is a per-row bias of the column-major `D`, which is what the bias epilogue adds.

use std::ffi::c_int;

use serde::{Deserialize, Serialize};

use super::ffi::{compute_type, data_type, epilogue, operation, scale_mode};
use super::CublasLtError;

/// A device address range: `bytes` readable (or writable) bytes at `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    pub addr: u64,
    pub bytes: usize,
}

impl DeviceSpan {
    pub const fn new(addr: u64, bytes: usize) -> DeviceSpan {
        DeviceSpan { addr, bytes }
    }
}

/// Element type of `X` and `W`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputType {
    Bf16,
    /// FP8 e4m3 with one f32 scale per tensor (sm_89 and newer).
    Fp8E4m3,
    /// Signed 8-bit integers: multiplied exactly into an int32 output ([`OutputType::I32`], the caller applies its
    /// scales afterwards), or with row-wise f32 scales into bf16 or f32 ([`Gemm::int8_row_wise`], where the loaded
    /// cuBLASLt offers it).
    Int8,
}

impl InputType {
    pub const fn size_bytes(self) -> usize {
        match self {
            InputType::Bf16 => 2,
            InputType::Fp8E4m3 | InputType::Int8 => 1,
        }
    }
    pub(crate) const fn cuda_type(self) -> c_int {
        match self {
            InputType::Bf16 => data_type::R_16BF,
            InputType::Fp8E4m3 => data_type::R_8F_E4M3,
            InputType::Int8 => data_type::R_8I,
        }
    }

    /// cuBLASLt's compute and scale types for this input with scales applied as `scale_mode` says: f32 for the
    /// floating types; int32 compute for INT8, with int32 scaling for its exact int32 output (`alpha` and `beta`
    /// then host int32 values) and f32 scaling with row-wise scales.
    pub(crate) const fn compute_and_scale_types(self, scale_mode: Fp8ScaleMode) -> (c_int, c_int) {
        match (self, scale_mode) {
            (InputType::Bf16 | InputType::Fp8E4m3, _) => {
                (compute_type::COMPUTE_32F, data_type::R_32F)
            }
            (InputType::Int8, Fp8ScaleMode::Tensor) => {
                (compute_type::COMPUTE_32I, data_type::R_32I)
            }
            (InputType::Int8, Fp8ScaleMode::RowWise | Fp8ScaleMode::ChannelAlpha) => {
                (compute_type::COMPUTE_32I, data_type::R_32F)
            }
        }
    }
}

/// Element type of `Y` (and of the bias, which always matches `Y`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputType {
    Bf16,
    F32,
    /// int32, the exact products of an [`InputType::Int8`] GEMM (and only of one).
    I32,
}

impl OutputType {
    pub const fn size_bytes(self) -> usize {
        match self {
            OutputType::Bf16 => 2,
            OutputType::F32 | OutputType::I32 => 4,
        }
    }
    pub(crate) const fn cuda_type(self) -> c_int {
        match self {
            OutputType::Bf16 => data_type::R_16BF,
            OutputType::F32 => data_type::R_32F,
            OutputType::I32 => data_type::R_32I,
        }
    }
}

/// Activation applied after the bias, fused into the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    None,
    /// GELU, tanh approximation (cuBLASLt's GELU epilogue).
    GeluTanh,
}

/// FP8 scales: `Y = alpha · (x_scale · X) · (w_scale · W)ᵀ (+ bias) + beta · Y`, f32 in device memory, read
/// when the GEMM runs. How many there are is the GEMM's [`Fp8ScaleMode`]: one each (per tensor), or one per
/// row of `X` and one per row of `W` (row-wise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Scales {
    pub x_scale: DeviceSpan,
    pub w_scale: DeviceSpan,
}

/// How an FP8 GEMM's f32 scales apply (cuBLASLt's `cublasLtMatmulMatrixScale_t` for `A = W` and `B = X`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8ScaleMode {
    /// One f32 for all of `X` and one for all of `W` (`SCALAR_32F`; every FP8 GPU, sm_89 and newer).
    #[default]
    Tensor,
    /// One f32 per row of `X` (per token: `M` of them) and one per row of `W` (per output channel: `N` of
    /// them): `Y[r, c] = x_scale[r] · w_scale[c] · Σ X[r, l] · W[c, l]`. cuBLASLt's outer-vector mode
    /// (`OUTER_VEC_32F` on both operands), which it runs on sm_90 from version 12.9.
    RowWise,
    /// INT8 only: one f32 per row of `W` (per output channel: `N` of them) as the GEMM's alpha, read from the
    /// device (cuBLASLt's `ALPHA_DEVICE_VECTOR_BETA_ZERO` pointer mode), and no scale of `X`:
    /// `Y[r, c] = w_scale[c] · Σ X[r, l] · W[c, l]` rounded once to bf16. The per-token scale of `X` is left to
    /// whatever reads `Y` (one f32 a row), so the output stays 2 bytes an element.
    ChannelAlpha,
}

impl Fp8ScaleMode {
    /// cuBLASLt's `cublasLtMatmulMatrixScale_t` value.
    pub(crate) const fn cuda_mode(self) -> i32 {
        match self {
            Fp8ScaleMode::Tensor => scale_mode::SCALAR_32F,
            Fp8ScaleMode::RowWise => scale_mode::OUTER_VEC_32F,
            // Not a matrix scale mode: the channel scales are the alpha vector.
            Fp8ScaleMode::ChannelAlpha => scale_mode::SCALAR_32F,
        }
    }

    /// f32 scales of `X` and of `W` a GEMM of this shape reads.
    pub const fn scale_counts(self, m: usize, n: usize) -> (usize, usize) {
        match self {
            Fp8ScaleMode::Tensor => (1, 1),
            Fp8ScaleMode::RowWise => (m, n),
            Fp8ScaleMode::ChannelAlpha => (0, n),
        }
    }

    /// The oldest cuBLASLt (`cublasLtGetVersion`) that has this mode.
    pub const fn min_cublaslt_version(self) -> usize {
        match self {
            Fp8ScaleMode::Tensor => 0,
            Fp8ScaleMode::RowWise => 120_900,
            Fp8ScaleMode::ChannelAlpha => 0,
        }
    }
}

/// One GEMM as engines describe it: row-major `Y[M,N] = alpha · X[M,K] · W[N,K]ᵀ (+ bias[N])`,
/// then the activation, then `+ beta · Y` (the old `Y`); accumulation in f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub input: InputType,
    pub output: OutputType,
    pub x: DeviceSpan,
    pub w: DeviceSpan,
    pub y: DeviceSpan,
    pub bias: Option<DeviceSpan>,
    pub activation: Activation,
    pub scales: Option<Fp8Scales>,
    /// FP8 only: how `scales` apply (per tensor unless set).
    pub scale_mode: Fp8ScaleMode,
    pub alpha: f32,
    pub beta: f32,
    /// FP8 only: cuBLASLt's faster, less precise accumulation (off by default).
    pub fp8_fast_accum: bool,
}

impl Gemm {
    /// `Y = X · Wᵀ` in bf16 with bf16 output.
    pub fn bf16(m: usize, n: usize, k: usize, x: DeviceSpan, w: DeviceSpan, y: DeviceSpan) -> Gemm {
        Gemm {
            m,
            n,
            k,
            input: InputType::Bf16,
            output: OutputType::Bf16,
            x,
            w,
            y,
            bias: None,
            activation: Activation::None,
            scales: None,
            scale_mode: Fp8ScaleMode::Tensor,
            alpha: 1.0,
            beta: 0.0,
            fp8_fast_accum: false,
        }
    }

    /// `Y = (sx·X) · (sw·W)ᵀ` with e4m3 inputs and bf16 output.
    pub fn fp8_e4m3(
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        scales: Fp8Scales,
    ) -> Gemm {
        Gemm {
            input: InputType::Fp8E4m3,
            scales: Some(scales),
            ..Gemm::bf16(m, n, k, x, w, y)
        }
    }

    /// `Y = (sx[r] · X) · (sw[c] · W)ᵀ` with e4m3 inputs, bf16 output and row-wise scales: `scales.x_scale`
    /// holds `M` f32 (one per row of `X`), `scales.w_scale` `N` f32 (one per row of `W`, i.e. per output
    /// column). See [`Fp8ScaleMode::RowWise`].
    pub fn fp8_e4m3_row_wise(
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        scales: Fp8Scales,
    ) -> Gemm {
        Gemm::fp8_e4m3(m, n, k, x, w, y, scales).with_fp8_scale_mode(Fp8ScaleMode::RowWise)
    }

    /// `Y = X · Wᵀ` exactly, with signed 8-bit inputs and int32 output (no bias, activation or scales: the
    /// caller dequantizes `Y`, typically with one scale per row of `X` and one per row of `W`).
    pub fn int8(m: usize, n: usize, k: usize, x: DeviceSpan, w: DeviceSpan, y: DeviceSpan) -> Gemm {
        Gemm {
            input: InputType::Int8,
            output: OutputType::I32,
            ..Gemm::bf16(m, n, k, x, w, y)
        }
    }

    /// `Y = (sx[r] · X) · (sw[c] · W)ᵀ` with signed 8-bit inputs, exact int32 accumulation and bf16 output: the
    /// scales applied in the GEMM's epilogue as for [`Gemm::fp8_e4m3_row_wise`]. Planning fails with
    /// [`CublasLtError::NoAlgorithm`] where the loaded cuBLASLt has no such kernel.
    pub fn int8_row_wise(
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        scales: Fp8Scales,
    ) -> Gemm {
        Gemm {
            input: InputType::Int8,
            ..Gemm::fp8_e4m3_row_wise(m, n, k, x, w, y, scales)
        }
    }

    /// `Y[r, c] = sw[c] · Σ X[r, l] · W[c, l]` with signed 8-bit inputs, exact int32 accumulation and bf16
    /// output: `w_scale` (`N` f32, 16-byte aligned) is the alpha vector ([`Fp8ScaleMode::ChannelAlpha`]); the
    /// per-row scale of `X` is the reader's to apply. Planning fails with [`CublasLtError::NoAlgorithm`] where the
    /// loaded cuBLASLt has no such kernel.
    pub fn int8_channel_alpha(
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
        w_scale: DeviceSpan,
    ) -> Gemm {
        // No X scales are read (the count is 0); the span only fills the field.
        let scales = Fp8Scales {
            x_scale: DeviceSpan::new(w_scale.addr, 0),
            w_scale,
        };
        Gemm {
            input: InputType::Int8,
            ..Gemm::fp8_e4m3(m, n, k, x, w, y, scales)
        }
        .with_fp8_scale_mode(Fp8ScaleMode::ChannelAlpha)
    }

    /// FP8 only: cuBLASLt's fast accumulation (partial sums kept in the tensor cores' accumulator).
    pub fn with_fp8_fast_accum(self, on: bool) -> Gemm {
        Gemm {
            fp8_fast_accum: on,
            ..self
        }
    }

    /// How the FP8 scales apply.
    pub fn with_fp8_scale_mode(self, scale_mode: Fp8ScaleMode) -> Gemm {
        Gemm { scale_mode, ..self }
    }

    /// Adds `bias[N]` (element type of the output) to every row.
    pub fn with_bias(self, bias: DeviceSpan) -> Gemm {
        Gemm {
            bias: Some(bias),
            ..self
        }
    }

    /// Applies GELU (tanh approximation) after the bias.
    pub fn with_gelu_tanh(self) -> Gemm {
        Gemm {
            activation: Activation::GeluTanh,
            ..self
        }
    }

    /// f32 output (and f32 bias) instead of bf16.
    pub fn with_f32_output(self) -> Gemm {
        Gemm {
            output: OutputType::F32,
            ..self
        }
    }

    /// `Y = alpha · (...) + beta · Y`.
    pub fn with_scaling(self, alpha: f32, beta: f32) -> Gemm {
        Gemm {
            alpha,
            beta,
            ..self
        }
    }

    /// The cuBLASLt epilogue this description asks for.
    pub fn epilogue(&self) -> u32 {
        match (self.bias.is_some(), self.activation) {
            (false, Activation::None) => epilogue::DEFAULT,
            (true, Activation::None) => epilogue::BIAS,
            (false, Activation::GeluTanh) => epilogue::GELU,
            (true, Activation::GeluTanh) => epilogue::GELU_BIAS,
        }
    }

    /// Checks everything that can be checked before a call and maps the GEMM to cuBLASLt's
    /// column-major form.
    pub fn plan(&self) -> Result<ColumnMajorCall, CublasLtError> {
        let invalid = |what: String| CublasLtError::Invalid { what };
        let shape = Shape(self.m, self.n, self.k);
        for (name, dim) in [("M", self.m), ("N", self.n), ("K", self.k)] {
            if dim == 0 || dim > i32::MAX as usize {
                return Err(invalid(format!(
                    "{name} = {dim} in {shape}: every dimension must be in 1..={}",
                    i32::MAX
                )));
            }
        }
        if !self.alpha.is_finite() || !self.beta.is_finite() {
            return Err(invalid(format!(
                "alpha = {} and beta = {} must be finite",
                self.alpha, self.beta
            )));
        }
        let in_size = self.input.size_bytes();
        let out_size = self.output.size_bytes();
        let bytes_of = |rows: usize, cols: usize, elem: usize, what: &str| {
            rows.checked_mul(cols)
                .and_then(|n| n.checked_mul(elem))
                .ok_or_else(|| invalid(format!("{what} of {rows}x{cols} does not fit in memory")))
        };
        let x_need = bytes_of(self.m, self.k, in_size, "X")?;
        let w_need = bytes_of(self.n, self.k, in_size, "W")?;
        let y_need = bytes_of(self.m, self.n, out_size, "Y")?;
        let input_align = match self.input {
            InputType::Bf16 => in_size as u64,
            // cuBLASLt's 8-bit kernels need 16-byte aligned operands.
            InputType::Fp8E4m3 | InputType::Int8 => 16,
        };
        let output_align = match self.input {
            InputType::Bf16 => out_size as u64,
            InputType::Fp8E4m3 | InputType::Int8 => 16,
        };
        let exact_int8 = self.input == InputType::Int8 && self.scales.is_none();
        if exact_int8 != (self.output == OutputType::I32) {
            return Err(invalid(format!(
                "{:?} input with {:?} output in {shape}: an INT8 GEMM without scales writes int32, and only it does",
                self.input, self.output
            )));
        }
        if self.input == InputType::Int8
            && self.scales.is_some()
            && !matches!(
                self.scale_mode,
                Fp8ScaleMode::RowWise | Fp8ScaleMode::ChannelAlpha
            )
        {
            return Err(invalid(format!(
                "an INT8 GEMM ({shape}) takes row-wise scales, channel alphas or none"
            )));
        }
        if self.scale_mode == Fp8ScaleMode::ChannelAlpha {
            if self.input != InputType::Int8 || self.output != OutputType::Bf16 {
                return Err(invalid(format!(
                    "channel alphas ({shape}) apply to INT8 GEMMs with bf16 output only, not {:?} -> {:?}",
                    self.input, self.output
                )));
            }
            if self.alpha != 1.0 || self.beta != 0.0 {
                return Err(invalid(format!(
                    "alpha = {} and beta = {} with channel alphas ({shape}): the alphas are the W scales and beta is 0",
                    self.alpha, self.beta
                )));
            }
        }
        if self.input == InputType::Int8 {
            if self.bias.is_some() || self.activation != Activation::None {
                return Err(invalid(format!(
                    "an INT8 GEMM ({shape}) takes no bias or activation: apply them when dequantizing"
                )));
            }
            if !self.k.is_multiple_of(16) || !self.n.is_multiple_of(16) {
                return Err(invalid(format!(
                    "INT8 GEMMs need K and N to be multiples of 16 ({shape}); pad the weights"
                )));
            }
            for (name, value) in [("alpha", self.alpha), ("beta", self.beta)] {
                if exact_int8 && (value.fract() != 0.0 || value.abs() > 65_536.0) {
                    return Err(invalid(format!(
                        "{name} = {value} for an INT8 GEMM: it is an int32 there, so a whole number up to 65536"
                    )));
                }
            }
        }
        check_span("X", self.x, x_need, input_align, shape)?;
        check_span("W", self.w, w_need, input_align, shape)?;
        check_span("Y", self.y, y_need, output_align, shape)?;
        for (name, input, need) in [("X", self.x, x_need), ("W", self.w, w_need)] {
            if overlaps(self.y.addr, y_need, input.addr, need) {
                return Err(invalid(format!(
                    "Y [{:#x}, +{y_need}) overlaps {name} [{:#x}, +{need}): the output must not alias an input",
                    self.y.addr, input.addr
                )));
            }
        }
        let bias_addr = match self.bias {
            Some(bias) => {
                let need = bytes_of(1, self.n, out_size, "bias")?;
                check_span("bias", bias, need, out_size as u64, shape)?;
                bias.addr
            }
            None => 0,
        };
        let (a_scale_addr, b_scale_addr) = match (self.input, self.scales) {
            (InputType::Bf16 | InputType::Int8, None) => (0, 0),
            (InputType::Bf16, Some(_)) => {
                return Err(invalid(
                    "FP8 scales were given for a bf16 GEMM: scales apply to 8-bit inputs only"
                        .into(),
                ))
            }
            (InputType::Fp8E4m3, None) => {
                return Err(invalid(
                    "an FP8 GEMM needs per-tensor scales (one f32 each for X and W)".into(),
                ))
            }
            (InputType::Fp8E4m3 | InputType::Int8, Some(scales)) => {
                if !self.k.is_multiple_of(16) || !self.n.is_multiple_of(16) {
                    return Err(invalid(format!(
                        "FP8 GEMMs need K and N to be multiples of 16 ({shape}); pad the weights"
                    )));
                }
                let (x_count, w_count) = self.scale_mode.scale_counts(self.m, self.n);
                // Scale vectors are read with vector loads: 16-byte aligned, like the FP8 operands.
                let align = match self.scale_mode {
                    Fp8ScaleMode::Tensor => 4,
                    Fp8ScaleMode::RowWise | Fp8ScaleMode::ChannelAlpha => 16,
                };
                let x_need = bytes_of(1, x_count, 4, "X scales")?;
                let w_need = bytes_of(1, w_count, 4, "W scales")?;
                if x_count > 0 {
                    check_span("X scale", scales.x_scale, x_need, align, shape)?;
                }
                check_span("W scale", scales.w_scale, w_need, align, shape)?;
                if self.scale_mode != Fp8ScaleMode::Tensor {
                    for (name, scale, need) in [
                        ("X scales", scales.x_scale, x_need),
                        ("W scales", scales.w_scale, w_need),
                    ] {
                        if overlaps(self.y.addr, y_need, scale.addr, need) {
                            return Err(invalid(format!(
                                "Y [{:#x}, +{y_need}) overlaps the {name} [{:#x}, +{need}): the output must not alias an input",
                                self.y.addr, scale.addr
                            )));
                        }
                    }
                }
                if self.scale_mode == Fp8ScaleMode::ChannelAlpha {
                    // The W scales go in as the alpha vector, not as a matrix scale.
                    (0, 0)
                } else {
                    // A is W and B is X in the column-major call.
                    (scales.w_scale.addr, scales.x_scale.addr)
                }
            }
        };
        let alpha_vector_addr = match (self.scale_mode, self.scales) {
            (Fp8ScaleMode::ChannelAlpha, Some(scales)) => scales.w_scale.addr,
            _ => 0,
        };
        if self.scale_mode != Fp8ScaleMode::Tensor && self.input == InputType::Bf16 {
            return Err(invalid(format!(
                "scale mode {:?} applies to FP8 GEMMs only",
                self.scale_mode
            )));
        }
        if self.fp8_fast_accum && self.input != InputType::Fp8E4m3 {
            return Err(invalid(
                "fast accumulation applies to FP8 GEMMs only".into(),
            ));
        }

        let (m, n, k) = (self.m as u64, self.n as u64, self.k as u64);
        let a = LayoutSpec {
            dtype: self.input.cuda_type(),
            rows: k,
            cols: n,
            ld: k as i64,
        };
        let b = LayoutSpec {
            dtype: self.input.cuda_type(),
            rows: k,
            cols: m,
            ld: k as i64,
        };
        let d = LayoutSpec {
            dtype: self.output.cuda_type(),
            rows: n,
            cols: m,
            ld: n as i64,
        };
        let key = PlanKey {
            m: self.m,
            n: self.n,
            k: self.k,
            input: self.input,
            output: self.output,
            epilogue: self.epilogue(),
            align_a: alignment_of(self.w.addr),
            align_b: alignment_of(self.x.addr),
            align_cd: alignment_of(self.y.addr),
            fast_accum: self.fp8_fast_accum,
            scale_mode: self.scale_mode,
        };
        Ok(ColumnMajorCall {
            lt_m: n,
            lt_n: m,
            lt_k: k,
            transa: operation::T,
            transb: operation::N,
            a,
            b,
            c: d,
            d,
            a_addr: self.w.addr,
            b_addr: self.x.addr,
            c_addr: self.y.addr,
            d_addr: self.y.addr,
            bias_addr,
            a_scale_addr,
            b_scale_addr,
            alpha_vector_addr,
            alpha: self.alpha,
            beta: self.beta,
            key,
        })
    }
}

/// The GEMM's dimensions, formatted only when an error needs them.
#[derive(Clone, Copy)]
struct Shape(usize, usize, usize);

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "M={} N={} K={}", self.0, self.1, self.2)
    }
}

fn check_span(
    name: &str,
    span: DeviceSpan,
    need: usize,
    align: u64,
    shape: Shape,
) -> Result<(), CublasLtError> {
    let invalid = |what: String| Err(CublasLtError::Invalid { what });
    if span.addr == 0 {
        return invalid(format!("{name} is a null device address ({shape})"));
    }
    if span.bytes < need {
        return invalid(format!(
            "{name} holds {} bytes but {shape} needs {need}",
            span.bytes
        ));
    }
    if span.addr.checked_add(need as u64).is_none() {
        return invalid(format!(
            "{name} at {:#x} + {need} bytes wraps the address space",
            span.addr
        ));
    }
    if !span.addr.is_multiple_of(align) {
        return invalid(format!(
            "{name} at {:#x} is not {align}-byte aligned (its element type needs it)",
            span.addr
        ));
    }
    Ok(())
}

fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    let a_end = a.saturating_add(a_len as u64);
    let b_end = b.saturating_add(b_len as u64);
    a < b_end && b < a_end
}

/// The largest power of two dividing `addr`, capped at 256 (cuBLASLt's default assumption).
pub fn alignment_of(addr: u64) -> u32 {
    if addr == 0 {
        return 256;
    }
    let tz = addr.trailing_zeros().min(8);
    1u32 << tz
}

/// A column-major matrix layout as `cublasLtMatrixLayoutCreate` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutSpec {
    pub dtype: c_int,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// What selects a cached plan (descriptors + algorithm): everything the heuristic sees. It is
/// also the shape part of a persistent plan-cache entry ([`super::cache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlanKey {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub input: InputType,
    pub output: OutputType,
    pub epilogue: u32,
    /// Alignment (bytes, power of two up to 256) of `A = W`, `B = X`, `C = D = Y`.
    pub align_a: u32,
    pub align_b: u32,
    pub align_cd: u32,
    pub fast_accum: bool,
    /// FP8 scale mode (per tensor in plan-cache files written before it existed).
    #[serde(default)]
    pub scale_mode: Fp8ScaleMode,
}

/// The `cublasLtMatmul` call a [`Gemm`] becomes (column-major names: `lt_m` rows of `D`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColumnMajorCall {
    pub lt_m: u64,
    pub lt_n: u64,
    pub lt_k: u64,
    pub transa: c_int,
    pub transb: c_int,
    pub a: LayoutSpec,
    pub b: LayoutSpec,
    pub c: LayoutSpec,
    pub d: LayoutSpec,
    pub a_addr: u64,
    pub b_addr: u64,
    pub c_addr: u64,
    pub d_addr: u64,
    /// 0 when the epilogue has no bias.
    pub bias_addr: u64,
    /// 0 unless FP8.
    pub a_scale_addr: u64,
    pub b_scale_addr: u64,
    /// The device alpha vector (one f32 per row of the column-major `D`, `lt_m` of them) of a
    /// [`Fp8ScaleMode::ChannelAlpha`] call; 0 for the host-scalar alpha of every other call.
    pub alpha_vector_addr: u64,
    pub alpha: f32,
    pub beta: f32,
    pub key: PlanKey,
}

/// The operands a prepared shape is timed on (a first call is timed on its own operands; see
/// [`super::CublasLt::set_timing_data`]).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TimingData {
    /// One small value in every element: no bit toggles, so the GEMM draws little power and is timed at the
    /// highest clock.
    #[default]
    Constant,
    /// Pseudo-random small values whose every byte toggles, as a model's activations and weights do: the GEMM
    /// draws the power it draws in a model, and a card at its power cap is timed at the clock it runs there.
    Random,
}

impl TimingData {
    /// The names `constant` and `random`.
    pub fn parse(name: &str) -> Option<TimingData> {
        match name {
            "constant" => Some(TimingData::Constant),
            "random" => Some(TimingData::Random),
            _ => None,
        }
    }
}

/// How a handle picks the algorithm of a new plan (see [`super::CublasLt::set_algo_selection`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AlgoSelection {
    /// The heuristic's first result. No extra GPU work: the plan costs one heuristic query.
    #[default]
    Heuristic,
    /// Up to `candidates` heuristic results, each run once to warm up and then timed over
    /// `repeats` runs in each of [`TIMING_ROUNDS`] interleaved rounds on the first call's real
    /// operands; [`choose_candidate`] keeps the heuristic's first unless another is faster by
    /// more than [`SWITCH_MARGIN`]. That first call of a shape synchronizes its stream and runs
    /// the GEMM `candidates × (1 + TIMING_ROUNDS × repeats)` extra times; later calls cost nothing
    /// extra. While the stream is being captured nothing can be timed, so the heuristic's first
    /// result is taken.
    Timed { candidates: usize, repeats: usize },
}

impl AlgoSelection {
    /// Largest number of heuristic results a timed selection may ask for.
    pub const MAX_CANDIDATES: usize = 32;
    /// Largest number of timed runs per candidate.
    pub const MAX_REPEATS: usize = 100;

    /// Checks the timed parameters' ranges (`candidates` in 1..=32, `repeats` in 1..=100).
    pub fn validate(self) -> Result<AlgoSelection, CublasLtError> {
        if let AlgoSelection::Timed {
            candidates,
            repeats,
        } = self
        {
            if !(1..=Self::MAX_CANDIDATES).contains(&candidates) {
                return Err(CublasLtError::Invalid {
                    what: format!(
                        "timed algorithm selection with candidates = {candidates}: allowed 1..={}",
                        Self::MAX_CANDIDATES
                    ),
                });
            }
            if !(1..=Self::MAX_REPEATS).contains(&repeats) {
                return Err(CublasLtError::Invalid {
                    what: format!(
                        "timed algorithm selection with repeats = {repeats}: allowed 1..={}",
                        Self::MAX_REPEATS
                    ),
                });
            }
        }
        Ok(self)
    }

    /// How many heuristic results a new plan asks for.
    pub fn requested_results(self) -> usize {
        match self {
            AlgoSelection::Heuristic => 1,
            AlgoSelection::Timed { candidates, .. } => candidates,
        }
    }
}

/// The index of the fastest measured candidate: the smallest finite time, the lowest index on a
/// tie (the heuristic's order). `None` (a failed run) and non-finite times never win; `None`
/// when every candidate failed.
pub fn fastest_candidate(times_ms: &[Option<f32>]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (index, time) in times_ms.iter().enumerate() {
        let Some(time) = time.filter(|t| t.is_finite()) else {
            continue;
        };
        // Strictly less: an equal later time keeps the earlier (heuristic-preferred) index.
        if best.is_none_or(|(_, fastest)| time < fastest) {
            best = Some((index, time));
        }
    }
    best.map(|(index, _)| index)
}

/// Rounds of timing per candidate (each candidate's fastest round counts): interleaving the
/// rounds spreads clock and power drift over every candidate instead of favouring the last.
pub const TIMING_ROUNDS: usize = 3;

/// How much faster than the heuristic's first result a candidate must measure to replace it
/// (0.03: 3%). Smaller differences are within the run-to-run spread of a GEMM on a busy GPU, and
/// switching on them picks noise.
pub const SWITCH_MARGIN: f32 = 0.03;

/// The candidate a timed plan runs: the fastest ([`fastest_candidate`]) when it beats the
/// heuristic's first result by more than `margin` (a fraction), else the first. When the first
/// failed or has no time, the fastest. `None` only when every run failed.
pub fn choose_candidate(times_ms: &[Option<f32>], margin: f32) -> Option<usize> {
    let fastest = fastest_candidate(times_ms)?;
    let first = times_ms
        .first()
        .copied()
        .flatten()
        .filter(|t| t.is_finite());
    let best = times_ms.get(fastest).copied().flatten()?;
    match first {
        Some(first) if best * (1.0 + margin) >= first => Some(0),
        _ => Some(fastest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const MIB: usize = 1 << 20;

    fn spans() -> (DeviceSpan, DeviceSpan, DeviceSpan) {
        (
            DeviceSpan::new(0x1000_0000, 64 * MIB),
            DeviceSpan::new(0x2000_0000, 64 * MIB),
            DeviceSpan::new(0x3000_0000, 64 * MIB),
        )
    }

    fn invalid_text(g: &Gemm) -> String {
        match g.plan() {
            Err(CublasLtError::Invalid { what }) => what,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn int8_channel_alphas_are_the_alpha_vector_and_nothing_else() {
        let (x, w, y) = spans();
        let alphas = DeviceSpan::new(0x4000_0000, 4096);
        let gemm = Gemm::int8_channel_alpha(6026, 512, 5376, x, w, y, alphas);
        let call = gemm.plan().expect("INT8 with channel alphas");
        assert_eq!(call.key.scale_mode, Fp8ScaleMode::ChannelAlpha);
        assert_eq!(
            call.key.input.compute_and_scale_types(call.key.scale_mode),
            (compute_type::COMPUTE_32I, data_type::R_32F)
        );
        // bf16 out; the W scales go in as alpha, no matrix scale pointer is set.
        assert_eq!(
            (
                call.d.dtype,
                call.a_scale_addr,
                call.b_scale_addr,
                call.alpha_vector_addr
            ),
            (data_type::R_16BF, 0, 0, alphas.addr)
        );
        assert_eq!(Fp8ScaleMode::ChannelAlpha.scale_counts(6026, 512), (0, 512));
        // Every other call keeps the host-scalar alpha.
        assert_eq!(
            Gemm::int8(64, 64, 64, x, w, y)
                .plan()
                .expect("int8")
                .alpha_vector_addr,
            0
        );
        // One alpha per output channel, 16-byte aligned; alpha 1 and beta 0 only; INT8 into bf16 only.
        let short = DeviceSpan::new(alphas.addr, 511 * 4);
        assert!(
            invalid_text(&Gemm::int8_channel_alpha(64, 512, 64, x, w, y, short))
                .contains("W scale")
        );
        let misaligned = DeviceSpan::new(alphas.addr + 4, 4092);
        assert!(
            invalid_text(&Gemm::int8_channel_alpha(64, 512, 64, x, w, y, misaligned))
                .contains("W scale")
        );
        assert!(invalid_text(&gemm.with_scaling(0.5, 0.0)).contains("the alphas are the W scales"));
        assert!(invalid_text(&gemm.with_scaling(1.0, 1.0)).contains("beta is 0"));
        let scales = Fp8Scales {
            x_scale: alphas,
            w_scale: alphas,
        };
        let fp8 = Gemm::fp8_e4m3(64, 64, 64, x, w, y, scales)
            .with_fp8_scale_mode(Fp8ScaleMode::ChannelAlpha);
        assert!(invalid_text(&fp8).contains("INT8 GEMMs with bf16 output only"));
        let f32_out = Gemm {
            output: OutputType::F32,
            ..Gemm::int8_channel_alpha(64, 64, 64, x, w, y, alphas)
        };
        assert!(invalid_text(&f32_out).contains("INT8 GEMMs with bf16 output only"));
    }

    #[test]
    fn int8_gemms_write_int32_and_take_no_float_extras() {
        let (x, w, y) = spans();
        let call = Gemm::int8(6026, 64, 5376, x, w, y)
            .plan()
            .expect("valid INT8 GEMM");
        assert_eq!(
            (call.a.dtype, call.d.dtype),
            (data_type::R_8I, data_type::R_32I)
        );
        assert_eq!(
            call.key.input.compute_and_scale_types(call.key.scale_mode),
            (compute_type::COMPUTE_32I, data_type::R_32I)
        );
        assert_eq!(
            InputType::Bf16.compute_and_scale_types(Fp8ScaleMode::Tensor),
            (compute_type::COMPUTE_32F, data_type::R_32F)
        );
        let int8 = Gemm::int8(64, 64, 64, x, w, y);
        let text = invalid_text(&Gemm {
            output: OutputType::Bf16,
            ..int8
        });
        assert!(text.contains("without scales writes int32"), "{text}");
        let text = invalid_text(&Gemm {
            output: OutputType::I32,
            ..Gemm::bf16(64, 64, 64, x, w, y)
        });
        assert!(text.contains("without scales writes int32"), "{text}");
        assert!(invalid_text(&int8.with_bias(x)).contains("no bias or activation"));
        assert!(invalid_text(&int8.with_gelu_tanh()).contains("no bias or activation"));
        assert!(invalid_text(&Gemm::int8(64, 64, 40, x, w, y)).contains("multiples of 16"));
        assert!(invalid_text(&int8.with_scaling(0.5, 0.0)).contains("alpha = 0.5"));
        assert!(invalid_text(&int8.with_scaling(1.0, 1e9)).contains("beta"));
        let scales = Fp8Scales {
            x_scale: x,
            w_scale: w,
        };
        assert!(invalid_text(&Gemm {
            scales: Some(scales),
            ..int8
        })
        .contains("without scales writes int32"));
        // With row-wise scales: f32 scaling of the exact products into bf16, the scales read as FP8's are.
        let row_wise = Gemm::int8_row_wise(64, 64, 64, x, w, y, scales).with_scaling(0.5, 0.0);
        let call = row_wise.plan().expect("row-wise INT8");
        assert_eq!(
            call.key.input.compute_and_scale_types(call.key.scale_mode),
            (compute_type::COMPUTE_32I, data_type::R_32F)
        );
        assert_eq!(
            (call.d.dtype, call.a_scale_addr, call.b_scale_addr),
            (data_type::R_16BF, w.addr, x.addr)
        );
        let per_tensor = row_wise.with_fp8_scale_mode(Fp8ScaleMode::Tensor);
        assert!(invalid_text(&per_tensor).contains("row-wise scales, channel alphas or none"));
        assert!(invalid_text(
            &Gemm::bf16(64, 64, 64, x, w, y).with_fp8_scale_mode(Fp8ScaleMode::RowWise)
        )
        .contains("FP8 GEMMs only"));
        assert!(invalid_text(&int8.with_fp8_fast_accum(true)).contains("FP8 GEMMs only"));
        let misaligned = DeviceSpan::new(x.addr + 4, x.bytes - 4);
        assert!(invalid_text(&Gemm::int8(64, 64, 64, misaligned, w, y)).contains("X"));
        // Two elements of output per bf16 product, four per INT8 product.
        let small = DeviceSpan::new(y.addr, 64 * 64 * 2);
        assert!(invalid_text(&Gemm::int8(64, 64, 64, x, w, small)).contains("holds"));
    }

    #[test]
    fn row_major_maps_to_transposed_tn_call() {
        let (x, w, y) = spans();
        let call = Gemm::bf16(5, 7, 3, x, w, y).plan().expect("valid");
        assert_eq!((call.lt_m, call.lt_n, call.lt_k), (7, 5, 3));
        assert_eq!((call.transa, call.transb), (operation::T, operation::N));
        assert_eq!((call.a.rows, call.a.cols, call.a.ld), (3, 7, 3));
        assert_eq!((call.b.rows, call.b.cols, call.b.ld), (3, 5, 3));
        assert_eq!((call.d.rows, call.d.cols, call.d.ld), (7, 5, 7));
        assert_eq!(call.c, call.d);
        assert_eq!((call.a_addr, call.b_addr), (w.addr, x.addr));
        assert_eq!((call.c_addr, call.d_addr), (y.addr, y.addr));
        assert_eq!(call.a.dtype, data_type::R_16BF);
        assert_eq!(call.d.dtype, data_type::R_16BF);
        assert_eq!(call.bias_addr, 0);
        assert_eq!(call.key.epilogue, epilogue::DEFAULT);
    }

    #[test]
    fn f32_output_changes_only_c_and_d_types() {
        let (x, w, y) = spans();
        let call = Gemm::bf16(4, 4, 4, x, w, y)
            .with_f32_output()
            .plan()
            .expect("valid");
        assert_eq!(call.a.dtype, data_type::R_16BF);
        assert_eq!(call.b.dtype, data_type::R_16BF);
        assert_eq!(call.c.dtype, data_type::R_32F);
        assert_eq!(call.d.dtype, data_type::R_32F);
    }

    #[test]
    fn epilogues_follow_bias_and_activation() {
        let (x, w, y) = spans();
        let b = DeviceSpan::new(0x4000_0000, 4096);
        let g = Gemm::bf16(2, 8, 8, x, w, y);
        assert_eq!(g.epilogue(), epilogue::DEFAULT);
        assert_eq!(g.with_bias(b).epilogue(), epilogue::BIAS);
        assert_eq!(g.with_gelu_tanh().epilogue(), epilogue::GELU);
        assert_eq!(
            g.with_gelu_tanh().with_bias(b).epilogue(),
            epilogue::GELU_BIAS
        );
        assert_eq!(g.with_bias(b).plan().expect("valid").bias_addr, b.addr);
    }

    #[test]
    fn fp8_scales_map_w_to_a_and_x_to_b() {
        let (x, w, y) = spans();
        let scales = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0000, 4),
            w_scale: DeviceSpan::new(0x5000_0100, 4),
        };
        let call = Gemm::fp8_e4m3(32, 32, 64, x, w, y, scales)
            .plan()
            .expect("valid");
        assert_eq!(call.a_scale_addr, scales.w_scale.addr);
        assert_eq!(call.b_scale_addr, scales.x_scale.addr);
        assert_eq!(call.a.dtype, data_type::R_8F_E4M3);
        assert_eq!(call.d.dtype, data_type::R_16BF);
    }

    #[test]
    fn row_wise_scales_are_vectors_mapped_w_to_a_and_x_to_b() {
        let (x, w, y) = spans();
        let (m, n, k) = (48, 64, 128);
        let scales = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0000, m * 4),
            w_scale: DeviceSpan::new(0x5100_0000, n * 4),
        };
        let g = Gemm::fp8_e4m3_row_wise(m, n, k, x, w, y, scales);
        assert_eq!(g.scale_mode, Fp8ScaleMode::RowWise);
        let call = g.plan().expect("valid");
        // A = W: one scale per output column of Y (N); B = X: one per row of Y (M).
        assert_eq!(call.a_scale_addr, scales.w_scale.addr);
        assert_eq!(call.b_scale_addr, scales.x_scale.addr);
        assert_eq!(call.key.scale_mode, Fp8ScaleMode::RowWise);
        assert_eq!(Fp8ScaleMode::RowWise.cuda_mode(), scale_mode::OUTER_VEC_32F);
        assert_eq!(Fp8ScaleMode::Tensor.cuda_mode(), scale_mode::SCALAR_32F);
        assert_eq!(Fp8ScaleMode::RowWise.scale_counts(m, n), (m, n));
        assert_eq!(Fp8ScaleMode::Tensor.scale_counts(m, n), (1, 1));
        // Per tensor and row-wise are different plans.
        let tensor = Gemm::fp8_e4m3(m, n, k, x, w, y, scales)
            .plan()
            .expect("valid");
        assert_ne!(tensor.key, call.key);
        assert_eq!(tensor.key.scale_mode, Fp8ScaleMode::Tensor);
    }

    #[test]
    fn row_wise_scales_are_checked_for_length_alignment_and_aliasing() {
        let (x, w, y) = spans();
        let (m, n, k) = (48, 64, 128);
        let good = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0000, m * 4),
            w_scale: DeviceSpan::new(0x5100_0000, n * 4),
        };
        let g = |scales| Gemm::fp8_e4m3_row_wise(m, n, k, x, w, y, scales);
        let short_x = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0000, m * 4 - 4),
            ..good
        };
        assert!(invalid_text(&g(short_x)).contains("X scale holds 188 bytes"));
        let short_w = Fp8Scales {
            w_scale: DeviceSpan::new(0x5100_0000, 4),
            ..good
        };
        assert!(invalid_text(&g(short_w)).contains("W scale holds 4 bytes"));
        let unaligned = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0004, m * 4),
            ..good
        };
        assert!(invalid_text(&g(unaligned)).contains("16-byte aligned"));
        let aliased = Fp8Scales {
            w_scale: DeviceSpan::new(y.addr + 64, n * 4),
            ..good
        };
        assert!(invalid_text(&g(aliased)).contains("overlaps the W scales"));
        // A per-tensor GEMM still takes one f32 each, 4-byte aligned.
        let scalar = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0004, 4),
            w_scale: DeviceSpan::new(0x5100_0008, 4),
        };
        assert!(Gemm::fp8_e4m3(m, n, k, x, w, y, scalar).plan().is_ok());
        // A scale mode on a bf16 GEMM is refused.
        let bf16 = Gemm::bf16(m, n, k, x, w, y).with_fp8_scale_mode(Fp8ScaleMode::RowWise);
        assert!(invalid_text(&bf16).contains("FP8 GEMMs only"));
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let (x, w, y) = spans();
        let g = Gemm::bf16(4, 4, 4, x, w, y);
        assert!(invalid_text(&Gemm { m: 0, ..g }).contains("M = 0"));
        assert!(invalid_text(&Gemm { k: 1 << 40, ..g }).contains("K ="));
        let short = DeviceSpan::new(x.addr, 31);
        assert!(invalid_text(&Gemm { x: short, ..g })
            .contains("X holds 31 bytes but M=4 N=4 K=4 needs 32"));
        assert!(invalid_text(&Gemm {
            w: DeviceSpan::new(0, 4096),
            ..g
        })
        .contains("W is a null"));
        assert!(invalid_text(&Gemm {
            y: DeviceSpan::new(y.addr + 1, 4096),
            ..g
        })
        .contains("not 2-byte aligned"));
        assert!(invalid_text(&g.with_scaling(f32::NAN, 0.0)).contains("finite"));
        let bias = DeviceSpan::new(0x4000_0000, 7);
        assert!(invalid_text(&g.with_bias(bias)).contains("bias holds 7 bytes"));
        let alias = DeviceSpan::new(x.addr + 8, 4096);
        assert!(invalid_text(&Gemm { y: alias, ..g }).contains("overlaps X"));
        let scales = Fp8Scales {
            x_scale: DeviceSpan::new(0x5000_0000, 4),
            w_scale: DeviceSpan::new(0x5000_0100, 4),
        };
        assert!(invalid_text(&Gemm {
            scales: Some(scales),
            ..g
        })
        .contains("bf16 GEMM"));
        let fp8 = Gemm::fp8_e4m3(16, 24, 32, x, w, y, scales);
        assert!(invalid_text(&fp8).contains("multiples of 16"));
        let fp8 = Gemm::fp8_e4m3(16, 32, 32, DeviceSpan::new(x.addr + 8, 4096), w, y, scales);
        assert!(invalid_text(&fp8).contains("16-byte aligned"));
        assert!(invalid_text(&Gemm {
            fp8_fast_accum: true,
            ..g
        })
        .contains("FP8 GEMMs only"));
    }

    #[test]
    fn cache_key_separates_what_the_heuristic_sees() {
        let (x, w, y) = spans();
        let base = Gemm::bf16(64, 64, 64, x, w, y);
        let key = |g: Gemm| g.plan().expect("valid").key;
        // Same shape at other 256-aligned addresses: same plan.
        let moved = Gemm {
            x: DeviceSpan::new(x.addr + 4096, x.bytes),
            ..base
        };
        assert_eq!(key(base), key(moved));
        // Alpha/beta and bias address are per call, not per plan.
        let b1 = DeviceSpan::new(0x4000_0000, 4096);
        let b2 = DeviceSpan::new(0x4100_0000, 4096);
        assert_eq!(key(base.with_bias(b1)), key(base.with_bias(b2)));
        assert_eq!(key(base), key(base.with_scaling(0.5, 1.0)));
        let distinct = [
            key(base),
            key(Gemm { m: 65, ..base }),
            key(Gemm { n: 65, ..base }),
            key(Gemm { k: 65, ..base }),
            key(base.with_f32_output()),
            key(base.with_bias(b1)),
            key(base.with_gelu_tanh()),
            key(Gemm {
                y: DeviceSpan::new(y.addr + 2, y.bytes),
                ..base
            }),
            key(Gemm {
                x: DeviceSpan::new(x.addr + 16, x.bytes),
                ..base
            }),
        ];
        for (i, a) in distinct.iter().enumerate() {
            for b in &distinct[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn alignment_is_capped_power_of_two() {
        assert_eq!(alignment_of(0x1000), 256);
        assert_eq!(alignment_of(0x1002), 2);
        assert_eq!(alignment_of(0x1010), 16);
        assert_eq!(alignment_of(0x1080), 128);
        assert_eq!(alignment_of(3), 1);
    }

    #[test]
    fn algo_selection_ranges_are_checked() {
        let timed = |candidates, repeats| AlgoSelection::Timed {
            candidates,
            repeats,
        };
        assert!(AlgoSelection::Heuristic.validate().is_ok());
        assert!(timed(1, 1).validate().is_ok());
        assert!(timed(32, 100).validate().is_ok());
        let text = |s: AlgoSelection| match s.validate() {
            Err(CublasLtError::Invalid { what }) => what,
            other => panic!("expected Invalid, got {other:?}"),
        };
        assert!(text(timed(0, 5)).contains("candidates = 0: allowed 1..=32"));
        assert!(text(timed(33, 5)).contains("candidates = 33"));
        assert!(text(timed(8, 0)).contains("repeats = 0: allowed 1..=100"));
        assert!(text(timed(8, 101)).contains("repeats = 101"));
        assert_eq!(AlgoSelection::default(), AlgoSelection::Heuristic);
        assert_eq!(AlgoSelection::Heuristic.requested_results(), 1);
        assert_eq!(timed(8, 5).requested_results(), 8);
    }

    #[test]
    fn fastest_candidate_examples() {
        assert_eq!(fastest_candidate(&[]), None);
        assert_eq!(fastest_candidate(&[None, None]), None);
        assert_eq!(fastest_candidate(&[Some(f32::NAN), None]), None);
        assert_eq!(fastest_candidate(&[Some(1.0)]), Some(0));
        assert_eq!(
            fastest_candidate(&[Some(2.0), Some(1.0), Some(1.5)]),
            Some(1)
        );
        assert_eq!(fastest_candidate(&[Some(1.0), Some(1.0)]), Some(0));
        assert_eq!(fastest_candidate(&[None, Some(3.0), Some(3.0)]), Some(1));
        assert_eq!(
            fastest_candidate(&[Some(f32::INFINITY), Some(9.0)]),
            Some(1)
        );
    }

    #[test]
    fn choose_candidate_keeps_the_first_unless_clearly_beaten() {
        // 2% faster: within the margin, the heuristic's first stays.
        assert_eq!(choose_candidate(&[Some(1.0), Some(0.98)], 0.03), Some(0));
        // 10% faster: switch.
        assert_eq!(choose_candidate(&[Some(1.0), Some(0.9)], 0.03), Some(1));
        // The first failed: the fastest of the rest.
        assert_eq!(
            choose_candidate(&[None, Some(2.0), Some(1.0)], 0.03),
            Some(2)
        );
        assert_eq!(
            choose_candidate(&[Some(f32::NAN), Some(2.0)], 0.03),
            Some(1)
        );
        assert_eq!(choose_candidate(&[None, None], 0.03), None);
        assert_eq!(choose_candidate(&[], 0.03), None);
        // No margin: the plain fastest rule.
        assert_eq!(choose_candidate(&[Some(1.0), Some(0.99)], 0.0), Some(1));
    }

    /// cuBLASLt's semantics, executed on the host: `D = alpha·op(A)·op(B) + beta·C`, with
    /// column-major layouts. Memory is a map from base address to f32 elements.
    fn run_column_major(call: &ColumnMajorCall, mem: &mut HashMap<u64, Vec<f32>>) {
        let at = |layout: &LayoutSpec, data: &[f32], r: u64, c: u64| {
            data[(r + c * layout.ld as u64) as usize]
        };
        let a = mem[&call.a_addr].clone();
        let b = mem[&call.b_addr].clone();
        let c = mem[&call.c_addr].clone();
        let mut d = vec![0.0f32; (call.d.ld as u64 * call.d.cols) as usize];
        for i in 0..call.lt_m {
            for j in 0..call.lt_n {
                let mut acc = 0.0f32;
                for l in 0..call.lt_k {
                    let av = if call.transa == operation::T {
                        at(&call.a, &a, l, i)
                    } else {
                        at(&call.a, &a, i, l)
                    };
                    let bv = if call.transb == operation::T {
                        at(&call.b, &b, j, l)
                    } else {
                        at(&call.b, &b, l, j)
                    };
                    acc += av * bv;
                }
                let mut v = call.alpha * acc;
                if call.bias_addr != 0 {
                    v += mem[&call.bias_addr][i as usize];
                }
                v += call.beta * at(&call.c, &c, i, j);
                d[(i + j * call.d.ld as u64) as usize] = v;
            }
        }
        mem.insert(call.d_addr, d);
    }

    proptest! {
        #[test]
        fn column_major_call_computes_the_row_major_product(
            m in 1usize..6, n in 1usize..6, k in 1usize..6,
            seed in any::<u64>(), with_bias in any::<bool>(), beta in prop_oneof![Just(0.0f32), Just(0.5f32)],
        ) {
            // Small integers keep every sum exact in f32.
            let mut state = seed | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state % 7) as f32) - 3.0
            };
            let xs: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let ws: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let y0: Vec<f32> = (0..m * n).map(|_| next()).collect();
            let bias: Vec<f32> = (0..n).map(|_| next()).collect();
            let (xa, wa, ya, ba) = (0x1000u64, 0x2000u64, 0x3000u64, 0x4000u64);
            let mut g = Gemm::bf16(m, n, k,
                DeviceSpan::new(xa, 4096), DeviceSpan::new(wa, 4096), DeviceSpan::new(ya, 4096))
                .with_scaling(2.0, beta);
            if with_bias {
                g = g.with_bias(DeviceSpan::new(ba, 4096));
            }
            let call = g.plan().expect("valid");
            let mut mem = HashMap::from([(xa, xs.clone()), (wa, ws.clone()), (ya, y0.clone()), (ba, bias.clone())]);
            run_column_major(&call, &mut mem);
            let got = &mem[&ya];
            for r in 0..m {
                for c in 0..n {
                    let dot: f32 = (0..k).map(|l| xs[r * k + l] * ws[c * k + l]).sum();
                    let want = 2.0 * dot + if with_bias { bias[c] } else { 0.0 } + beta * y0[r * n + c];
                    prop_assert_eq!(got[r * n + c], want, "Y[{}][{}]", r, c);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn choose_candidate_switches_only_for_a_clear_gain(
            times in proptest::collection::vec(proptest::option::of(1u8..40), 0..10),
            margin_pct in 0u8..10,
        ) {
            let times: Vec<Option<f32>> = times.iter().map(|t| t.map(|v| f32::from(v) * 0.1)).collect();
            let margin = f32::from(margin_pct) / 100.0;
            match choose_candidate(&times, margin) {
                None => prop_assert!(times.iter().all(Option::is_none)),
                Some(chosen) => {
                    let t = times[chosen];
                    prop_assert!(t.is_some(), "chose failed candidate {}", chosen);
                    let t = t.unwrap_or(f32::NAN);
                    if let Some(Some(first)) = times.first() {
                        if chosen != 0 {
                            prop_assert!(t * (1.0 + margin) < *first, "switched for {} vs first {}", t, first);
                        } else if let Some(fastest) = fastest_candidate(&times) {
                            let best = times[fastest].unwrap_or(f32::NAN);
                            prop_assert!(best * (1.0 + margin) >= *first, "kept first {} over {}", first, best);
                        }
                    }
                }
            }
        }

        #[test]
        fn fastest_candidate_picks_the_first_minimum_of_the_runs_that_worked(
            times in proptest::collection::vec(proptest::option::of(0u8..6), 0..12),
        ) {
            // Few distinct values make ties common.
            let times: Vec<Option<f32>> = times.iter().map(|t| t.map(|v| f32::from(v) * 0.25)).collect();
            match fastest_candidate(&times) {
                None => prop_assert!(times.iter().all(Option::is_none)),
                Some(chosen) => {
                    let best = times[chosen];
                    prop_assert!(best.is_some(), "chose failed candidate {}", chosen);
                    let best = best.unwrap_or(f32::NAN);
                    for (i, t) in times.iter().enumerate() {
                        if let Some(t) = t {
                            prop_assert!(best <= *t, "candidate {} ({}) beats chosen {} ({})", i, t, chosen, best);
                            if i < chosen {
                                prop_assert!(*t > best, "tie at {} should win over {}", i, chosen);
                            }
                        }
                    }
                }
            }
        }
    }
}
