//! The one GEMM wrapper every component uses: a [`Linear`] description over device spans, run through a
//! [`GemmRunner`] that owns the component's cuBLASLt handle.
//!
//! `Y[m, n] = alpha · X[m, k] · W[n, k]ᵀ (+ bias[n]) + beta · Y`, bf16 inputs, f32 accumulation, bf16 or f32
//! output. [`Linear::gemm`] is exactly the [`Gemm`] the components built by hand before (same fields, so the
//! same plan key and the same algorithm). [`Linear::shape`] is what a plan depends on without the addresses:
//! each component lists the shapes of its GEMMs with it ([`GemmShape`]), so planning them ahead (a plan cache
//! or `prepare` at load) is one call per component.
//!
//! [`span`] is the one checked `(buffer, offset, bytes)` to [`DeviceSpan`] helper.

// `GemmError` keeps the typed cuBLASLt cause (whose runtime variant says whether the context is lost) rather
// than boxing it, so the error chain can be downcast; GEMM failures are cold paths.
#![allow(clippy::result_large_err)]

use tf_cuda::cublaslt::plan::alignment_of;
use tf_cuda::cublaslt::{
    Activation, AlgoSelection, CublasLt, CublasLtError, DeviceSpan, Gemm, InputType, LtLibrary,
    OutputType, PlanChoice,
};
use tf_cuda::{Context, DeviceBuffer, Stream};
use thiserror::Error;

/// Why a GEMM could not be described, planned or run.
#[derive(Debug, Error)]
pub enum GemmError {
    #[error("cuBLASLt: {what}: {source}")]
    Library {
        what: &'static str,
        #[source]
        source: CublasLtError,
    },
    #[error("GEMM {m}x{n}x{k}: {source}")]
    Run {
        m: usize,
        n: usize,
        k: usize,
        #[source]
        source: CublasLtError,
    },
    #[error("internal: span {offset}+{bytes} outside a {len}-byte buffer (a layout or workspace plan is wrong)")]
    Span {
        offset: usize,
        bytes: usize,
        len: usize,
    },
}

/// `bytes` at `offset` of `buf` as a GEMM (or kernel) operand, checked against the buffer.
pub fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, GemmError> {
    let bad = || GemmError::Span {
        offset,
        bytes,
        len: buf.len(),
    };
    let end = offset.checked_add(bytes).ok_or_else(bad)?;
    if end > buf.len() {
        return Err(bad());
    }
    let addr = buf
        .addr()
        .checked_add(u64::try_from(offset).map_err(|_| bad())?)
        .ok_or_else(bad)?;
    Ok(DeviceSpan::new(addr, bytes))
}

/// `bytes` at `offset` inside `outer` (a span already checked against its buffer), checked.
pub fn sub_span(outer: DeviceSpan, offset: usize, bytes: usize) -> Result<DeviceSpan, GemmError> {
    let bad = || GemmError::Span {
        offset,
        bytes,
        len: outer.bytes,
    };
    let end = offset.checked_add(bytes).ok_or_else(bad)?;
    if end > outer.bytes {
        return Err(bad());
    }
    let addr = outer
        .addr
        .checked_add(u64::try_from(offset).map_err(|_| bad())?)
        .ok_or_else(bad)?;
    Ok(DeviceSpan::new(addr, bytes))
}

/// One linear layer call: `y = alpha · x · wᵀ (+ bias) + beta · y` over device spans.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Linear {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: DeviceSpan,
    pub w: DeviceSpan,
    pub y: DeviceSpan,
    /// Per-output-column bias (element type of the output), added in the epilogue.
    pub bias: Option<DeviceSpan>,
    pub alpha: f32,
    pub beta: f32,
    pub output: OutputType,
}

impl Linear {
    /// `y[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 in and out.
    pub fn new(
        m: usize,
        n: usize,
        k: usize,
        x: DeviceSpan,
        w: DeviceSpan,
        y: DeviceSpan,
    ) -> Linear {
        Linear {
            m,
            n,
            k,
            x,
            w,
            y,
            bias: None,
            alpha: 1.0,
            beta: 0.0,
            output: OutputType::Bf16,
        }
    }

    /// Adds to what `y` holds (`beta = 1`): a residual added by the GEMM itself.
    pub fn accumulate(self, on: bool) -> Linear {
        Linear {
            beta: if on { 1.0 } else { 0.0 },
            ..self
        }
    }

    /// `y = alpha · (...) + beta · y`.
    pub fn scaled(self, alpha: f32, beta: f32) -> Linear {
        Linear {
            alpha,
            beta,
            ..self
        }
    }

    /// Adds `bias[n]` in the epilogue.
    pub fn with_bias(self, bias: Option<DeviceSpan>) -> Linear {
        Linear { bias, ..self }
    }

    /// f32 output (and f32 bias) when `on`.
    pub fn f32_output(self, on: bool) -> Linear {
        Linear {
            output: if on {
                OutputType::F32
            } else {
                OutputType::Bf16
            },
            ..self
        }
    }

    /// The cuBLASLt description.
    pub fn gemm(&self) -> Gemm {
        let mut gemm = Gemm::bf16(self.m, self.n, self.k, self.x, self.w, self.y)
            .with_scaling(self.alpha, self.beta);
        if self.output == OutputType::F32 {
            gemm = gemm.with_f32_output();
        }
        if let Some(bias) = self.bias {
            gemm = gemm.with_bias(bias);
        }
        gemm
    }

    /// What the call's plan depends on, without the addresses.
    pub fn shape(&self) -> GemmShape {
        GemmShape {
            m: self.m,
            n: self.n,
            k: self.k,
            input: InputType::Bf16,
            output: self.output,
            bias: self.bias.is_some(),
            activation: Activation::None,
            accumulate: self.beta != 0.0,
            align_x: alignment_of(self.x.addr),
            align_w: alignment_of(self.w.addr),
            align_y: alignment_of(self.y.addr),
        }
    }
}

/// The plan-relevant part of one GEMM: sizes, types, epilogue and operand alignment (bytes, power of two up
/// to 256, as cuBLASLt's plan key records it). `accumulate` says whether the call reads `y` (`beta != 0`),
/// which a timed selection must run on scratch instead of the real output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub input: InputType,
    pub output: OutputType,
    pub bias: bool,
    pub activation: Activation,
    pub accumulate: bool,
    pub align_x: u32,
    pub align_w: u32,
    pub align_y: u32,
}

/// The alignment cuBLASLt records for an operand at byte `offset` of a 256-byte aligned allocation.
pub fn offset_alignment(offset: usize) -> u32 {
    alignment_of(u64::try_from(offset).unwrap_or(0))
}

impl GemmShape {
    /// A shape with operands at these byte offsets of 256-byte aligned allocations.
    #[allow(clippy::too_many_arguments)]
    pub fn at_offsets(
        m: usize,
        n: usize,
        k: usize,
        (x, w, y): (usize, usize, usize),
        bias: bool,
        accumulate: bool,
        f32_out: bool,
    ) -> GemmShape {
        GemmShape {
            m,
            n,
            k,
            input: InputType::Bf16,
            output: if f32_out {
                OutputType::F32
            } else {
                OutputType::Bf16
            },
            bias,
            activation: Activation::None,
            accumulate,
            align_x: offset_alignment(x),
            align_w: offset_alignment(w),
            align_y: offset_alignment(y),
        }
    }
}

/// The distinct plans a list of calls needs, in first-call order.
pub fn distinct(shapes: Vec<GemmShape>) -> Vec<GemmShape> {
    let mut seen = std::collections::HashSet::with_capacity(shapes.len());
    shapes.into_iter().filter(|s| seen.insert(*s)).collect()
}

/// A component's cuBLASLt handle (with its workspace), through which it runs every [`Linear`].
pub struct GemmRunner {
    lt: CublasLt,
}

impl std::fmt::Debug for GemmRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GemmRunner")
            .field("workspace_bytes", &self.lt.workspace_bytes())
            .finish_non_exhaustive()
    }
}

impl GemmRunner {
    /// Loads cuBLASLt and makes a handle with the default workspace in `ctx`.
    pub fn new(ctx: &Context) -> Result<GemmRunner, GemmError> {
        let lib = LtLibrary::open().map_err(|source| GemmError::Library {
            what: "loading the library",
            source,
        })?;
        let lt =
            CublasLt::with_default_workspace(ctx, lib).map_err(|source| GemmError::Library {
                what: "creating a handle",
                source,
            })?;
        Ok(GemmRunner { lt })
    }

    /// The handle (plan choices, cache statistics).
    pub fn lt(&self) -> &CublasLt {
        &self.lt
    }

    /// How new plans pick their algorithm.
    pub fn set_algo_selection(&self, selection: AlgoSelection) -> Result<(), GemmError> {
        self.lt
            .set_algo_selection(selection)
            .map_err(|source| GemmError::Library {
                what: "setting the algorithm selection",
                source,
            })
    }

    /// What every plan built so far chose.
    pub fn plan_choices(&self) -> Vec<PlanChoice> {
        self.lt.plan_choices()
    }

    /// Device bytes of the handle's workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.lt.workspace_bytes()
    }

    /// Enqueues `linear` on `stream`; a call with no rows (`m == 0`) is nothing to do.
    ///
    /// # Safety
    /// Every span of `linear` must lie in live device memory of the handle's context and stay allocated until
    /// the stream has run the GEMM (or been synchronized); `stream` must belong to that context.
    pub unsafe fn run(&self, linear: &Linear, stream: &Stream) -> Result<(), GemmError> {
        if linear.m == 0 {
            return Ok(());
        }
        // SAFETY: this function's contract is `matmul`'s.
        unsafe { self.lt.matmul(&linear.gemm(), stream) }.map_err(|source| GemmError::Run {
            m: linear.m,
            n: linear.n,
            k: linear.k,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(addr: u64, bytes: usize) -> DeviceSpan {
        DeviceSpan::new(addr, bytes)
    }

    #[test]
    fn linear_builds_the_gemms_the_components_built() {
        let (x, w, y, b) = (s(0x1000, 64), s(0x2000, 64), s(0x3000, 64), s(0x4000, 8));
        // The DiT: plain bf16, or f32 output.
        assert_eq!(
            Linear::new(2, 4, 8, x, w, y).gemm(),
            Gemm::bf16(2, 4, 8, x, w, y)
        );
        assert_eq!(
            Linear::new(2, 4, 8, x, w, y).f32_output(true).gemm(),
            Gemm::bf16(2, 4, 8, x, w, y).with_f32_output()
        );
        // The text encoder: accumulate into the residual.
        assert_eq!(
            Linear::new(2, 4, 8, x, w, y).accumulate(true).gemm(),
            Gemm::bf16(2, 4, 8, x, w, y).with_scaling(1.0, 1.0)
        );
        // The VAE: scaling always set, then f32 output, then the bias.
        assert_eq!(
            Linear::new(2, 4, 8, x, w, y)
                .scaled(0.5, 0.0)
                .f32_output(true)
                .with_bias(Some(b))
                .gemm(),
            Gemm::bf16(2, 4, 8, x, w, y)
                .with_scaling(0.5, 0.0)
                .with_f32_output()
                .with_bias(b)
        );
    }

    #[test]
    fn shapes_record_what_the_plan_key_records() {
        let l = Linear::new(3, 5, 7, s(0x1000, 64), s(0x2010, 70), s(0x3002, 30))
            .accumulate(true)
            .with_bias(Some(s(0x4000, 10)));
        let shape = l.shape();
        let key = l.gemm().plan().unwrap().key;
        assert_eq!((shape.m, shape.n, shape.k), (key.m, key.n, key.k));
        assert_eq!(
            (shape.align_w, shape.align_x, shape.align_y),
            (key.align_a, key.align_b, key.align_cd)
        );
        assert!(shape.bias && shape.accumulate);
        assert_eq!(
            GemmShape::at_offsets(3, 5, 7, (0, 16, 2), true, true, false),
            GemmShape {
                align_x: 256,
                ..shape
            }
        );
        assert_eq!(distinct(vec![shape, shape]).len(), 1);
    }

    #[test]
    fn spans_are_checked() {
        let outer = s(0x1000, 100);
        assert_eq!(sub_span(outer, 10, 90).unwrap(), s(0x100a, 90));
        assert!(sub_span(outer, 10, 91).is_err());
        assert!(sub_span(outer, usize::MAX, 2).is_err());
    }
}
