//! The one GEMM wrapper every component uses: a [`Linear`] description over device spans, run through a
//! [`GemmRunner`] that owns the component's cuBLASLt handle.
//!
//! `Y[m, n] = alpha · X[m, k] · W[n, k]ᵀ (+ bias[n]) + beta · Y`, bf16 inputs, f32 accumulation, bf16 or f32
//! output; or [`Fp8Linear`]: e4m3 inputs with row-wise scales (per token, per output channel), run by
//! [`GemmRunner::run_fp8`]. [`Linear::gemm`] is exactly the [`Gemm`] the components built by hand before (same fields, so the
//! same plan key and the same algorithm). [`Linear::shape`] is what a plan depends on without the addresses:
//! each component lists the shapes of its GEMMs with it ([`GemmShape`]), so planning them ahead (a plan cache
//! or `prepare` at load) is one call per component.
//!
//! [`span`] is the one checked `(buffer, offset, bytes)` to [`DeviceSpan`] helper.

// `GemmError` keeps the typed cuBLASLt cause (whose runtime variant says whether the context is lost) rather
// than boxing it, so the error chain can be downcast; GEMM failures are cold paths.
#![allow(clippy::result_large_err)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tf_cuda::cublaslt::plan::alignment_of;
pub use tf_cuda::cublaslt::GemmShape;
use tf_cuda::cublaslt::{
    AlgoSelection, CublasLt, CublasLtError, DeviceSpan, Fp8Scales, Gemm, LtLibrary, OutputType,
    PlanCache, PlanChoice, PrepareReport, TimingData,
};
use tf_cuda::{Context, DeviceBuffer, Stream};
use thiserror::Error;

use crate::nn::precision::Fp8Accumulation;

/// Why a GEMM could not be described, planned or run.
#[derive(Debug, Error)]
pub enum GemmError {
    #[error("{SELECTION_ENV}={value:?} is not a GEMM selection: use `heuristic` or `timed`")]
    Selection { value: String },
    #[error("{TIMING_DATA_ENV}={value:?} is not GEMM timing data: use `constant` or `random`")]
    TimingData { value: String },
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

/// The error of a cuBLASLt call made while `what`.
fn library(what: &'static str) -> impl FnOnce(CublasLtError) -> GemmError {
    move |source| GemmError::Library { what, source }
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
        GemmShape::of(&self.gemm())
    }
}

/// One FP8 linear layer call with row-wise scales: `y[m, n] = (x_scale[r] · x[m, k]) · (w_scale[c] · w[n, k])ᵀ
/// (+ beta · y)`, e4m3 `x` and `w`, f32 accumulation, bf16 (or f32) output. `x` and its scales (one per row, per
/// token) come from a quantizing kernel ([`super::quant`]); `w` and its scales (one per output channel) from the
/// load-time quantizer ([`crate::nn::fp8::RowQuantizer`]). cuBLASLt runs it on sm_90 (12.9 and newer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Linear {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// e4m3 `[m, k]`, rows of `k` bytes.
    pub x: DeviceSpan,
    /// f32 `[m]`.
    pub x_scale: DeviceSpan,
    /// e4m3 `[n, k]`.
    pub w: DeviceSpan,
    /// f32 `[n]`.
    pub w_scale: DeviceSpan,
    pub y: DeviceSpan,
    pub beta: f32,
    pub output: OutputType,
    pub accumulation: Fp8Accumulation,
}

impl Fp8Linear {
    /// `y[m, n] = x[m, k] · w[n, k]ᵀ` with row-wise scales, bf16 output.
    pub fn new(
        (m, n, k): (usize, usize, usize),
        (x, x_scale): (DeviceSpan, DeviceSpan),
        (w, w_scale): (DeviceSpan, DeviceSpan),
        y: DeviceSpan,
    ) -> Fp8Linear {
        Fp8Linear {
            m,
            n,
            k,
            x,
            x_scale,
            w,
            w_scale,
            y,
            beta: 0.0,
            output: OutputType::Bf16,
            accumulation: Fp8Accumulation::Exact,
        }
    }

    /// How the products accumulate along `k`.
    pub fn accumulation(self, accumulation: Fp8Accumulation) -> Fp8Linear {
        Fp8Linear {
            accumulation,
            ..self
        }
    }

    /// Adds to what `y` holds (`beta = 1`).
    pub fn accumulate(self, on: bool) -> Fp8Linear {
        Fp8Linear {
            beta: if on { 1.0 } else { 0.0 },
            ..self
        }
    }

    /// f32 output when `on`.
    pub fn f32_output(self, on: bool) -> Fp8Linear {
        Fp8Linear {
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
        let scales = Fp8Scales {
            x_scale: self.x_scale,
            w_scale: self.w_scale,
        };
        let mut gemm =
            Gemm::fp8_e4m3_row_wise(self.m, self.n, self.k, self.x, self.w, self.y, scales)
                .with_scaling(1.0, self.beta)
                .with_fp8_fast_accum(self.accumulation.is_fast());
        if self.output == OutputType::F32 {
            gemm = gemm.with_f32_output();
        }
        gemm
    }

    /// What the call's plan depends on, without the addresses.
    pub fn shape(&self) -> GemmShape {
        GemmShape::of(&self.gemm())
    }
}

/// A row-wise FP8 GEMM shape accumulating as `accumulation` says, with operands at these byte offsets `(x, w, y)`
/// of 256-byte aligned allocations.
pub fn fp8_shape_at_offsets(
    (m, n, k): (usize, usize, usize),
    (x, w, y): (usize, usize, usize),
    f32_out: bool,
    accumulation: Fp8Accumulation,
) -> GemmShape {
    let shape = GemmShape::fp8_e4m3_row_wise(m, n, k);
    let shape = if accumulation.is_fast() {
        shape.with_fp8_fast_accum()
    } else {
        shape
    };
    at_offsets(shape, (x, w, y), f32_out)
}

/// An INT8 GEMM shape (exact int32 products, [`Gemm::int8`]) with operands at these byte offsets `(x, w, y)` of
/// 256-byte aligned allocations.
pub fn int8_shape_at_offsets(
    (m, n, k): (usize, usize, usize),
    (x, w, y): (usize, usize, usize),
) -> GemmShape {
    at_offsets(GemmShape::int8(m, n, k), (x, w, y), false)
}

/// The alignment cuBLASLt records for an operand at byte `offset` of a 256-byte aligned allocation.
pub fn offset_alignment(offset: usize) -> u32 {
    alignment_of(u64::try_from(offset).unwrap_or(0))
}

/// A bf16 GEMM shape with operands at these byte offsets `(x, w, y)` of 256-byte aligned allocations.
pub fn shape_at_offsets(
    m: usize,
    n: usize,
    k: usize,
    (x, w, y): (usize, usize, usize),
    f32_out: bool,
) -> GemmShape {
    at_offsets(GemmShape::bf16(m, n, k), (x, w, y), f32_out)
}

/// `shape` with the alignments of operands at byte offsets `(x, w, y)` of 256-byte aligned allocations, and an
/// f32 output when `f32_out`.
fn at_offsets(shape: GemmShape, (x, w, y): (usize, usize, usize), f32_out: bool) -> GemmShape {
    let shape = shape.with_alignment(
        offset_alignment(w),
        offset_alignment(x),
        offset_alignment(y),
    );
    if f32_out {
        shape.with_f32_output()
    } else {
        shape
    }
}

/// The distinct plans a list of calls needs, in first-call order.
pub fn distinct(shapes: Vec<GemmShape>) -> Vec<GemmShape> {
    let mut seen = std::collections::HashSet::with_capacity(shapes.len());
    shapes.into_iter().filter(|s| seen.insert(*s)).collect()
}

/// What [`GemmRunner::prepare_stored`] did at a worker's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredGemms {
    /// Stored shapes planned (those planned before included).
    pub shapes: usize,
    /// Kernels among them run once on scratch because they had not run yet.
    pub kernels_loaded: usize,
}

impl std::fmt::Display for StoredGemms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} kernels loaded)",
            self.shapes, self.kernels_loaded
        )
    }
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

/// The environment variable that overrides every component's GEMM algorithm selection: `heuristic` (cuBLASLt's
/// first result: the same algorithm in every process, no timing) or `timed` (the engine default for the DiT).
pub const SELECTION_ENV: &str = "TF_GEMM_SELECTION";

/// The selection a component asks for, unless [`SELECTION_ENV`] overrides it.
pub fn selection_from_env(default: AlgoSelection) -> Result<AlgoSelection, GemmError> {
    match std::env::var(SELECTION_ENV).as_deref() {
        Err(_) | Ok("") => Ok(default),
        Ok("heuristic") => Ok(AlgoSelection::Heuristic),
        Ok("timed") => Ok(match default {
            AlgoSelection::Heuristic => TIMED,
            timed => timed,
        }),
        Ok(other) => Err(GemmError::Selection {
            value: other.to_string(),
        }),
    }
}

/// The environment variable that sets what prepared GEMM shapes are timed on: `constant` (the default) or `random`
/// (operands whose bits toggle as a model's do, so a card at its power cap is timed at the clock it runs the model
/// at; see [`TimingData`]).
pub const TIMING_DATA_ENV: &str = "TF_GEMM_TIMING_DATA";

/// The timing data [`TIMING_DATA_ENV`] asks for ([`TimingData::Constant`] when it is unset or empty).
pub fn timing_data_from_env() -> Result<TimingData, GemmError> {
    match std::env::var(TIMING_DATA_ENV).as_deref() {
        Err(_) | Ok("") => Ok(TimingData::default()),
        Ok(name) => TimingData::parse(name).ok_or_else(|| GemmError::TimingData {
            value: name.to_string(),
        }),
    }
}

/// Timed selection: the fastest of cuBLASLt's first 8 candidates over 3 interleaved rounds (kept only when
/// clearly faster than its first choice; see [`AlgoSelection::Timed`]).
pub const TIMED: AlgoSelection = AlgoSelection::Timed {
    candidates: 8,
    repeats: 3,
};

/// The process's persistent plan cache (`TF_PLAN_CACHE`, else the user's cache folder; see
/// [`tf_cuda::cublaslt::PlanCache`]), shared by every component's handle.
pub fn process_plan_cache() -> Arc<PlanCache> {
    static CACHE: OnceLock<Arc<PlanCache>> = OnceLock::new();
    Arc::clone(CACHE.get_or_init(|| Arc::new(PlanCache::open_default())))
}

impl GemmRunner {
    /// Loads cuBLASLt and makes a handle with the default workspace in `ctx`, choosing algorithms by
    /// `selection` (or [`SELECTION_ENV`]) and filing timed choices in the [`process_plan_cache`].
    pub fn new(ctx: &Context, selection: AlgoSelection) -> Result<GemmRunner, GemmError> {
        let selection = selection_from_env(selection)?;
        let lib = LtLibrary::open().map_err(library("loading the library"))?;
        let lt =
            CublasLt::with_default_workspace(ctx, lib).map_err(library("creating a handle"))?;
        lt.set_timing_data(timing_data_from_env()?)
            .map_err(library("setting the timing data"))?;
        lt.set_plan_cache(process_plan_cache())
            .map_err(library("attaching the plan cache"))?;
        let runner = GemmRunner { lt };
        runner.set_algo_selection(selection)?;
        Ok(runner)
    }

    /// Plans `shapes` ahead of the requests (at load): stored choices are reused, unseen shapes are timed within
    /// `budget` under timed selection, and from then on no call is timed inside a request (see
    /// [`CublasLt::prepare`]).
    pub fn prepare(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
    ) -> Result<PrepareReport, GemmError> {
        self.lt
            .prepare(shapes, budget, stream)
            .map_err(library("planning the GEMMs ahead"))
    }

    /// [`GemmRunner::prepare`] for shapes first used inside a request: a shape with a stored neighbour (the same
    /// GEMM but for `m`, within an eighth) takes its choice untimed; only shapes with neither are timed within
    /// `budget` (see [`CublasLt::prepare_first_use`]).
    pub fn prepare_first_use(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
    ) -> Result<PrepareReport, GemmError> {
        self.lt
            .prepare_first_use(shapes, budget, stream)
            .map_err(library("planning a new shape's GEMMs"))
    }

    /// Plans every shape the persistent plan cache stores for this GPU and loads their kernels (see
    /// [`CublasLt::prepare_stored`]): a worker's requests then find the plans and kernels of every shape an earlier
    /// process planned ready.
    pub fn prepare_stored(&self, stream: &Stream) -> Result<StoredGemms, GemmError> {
        self.lt
            .prepare_stored(stream)
            .map(|report| StoredGemms {
                shapes: report.shapes,
                kernels_loaded: report.primed,
            })
            .map_err(library("planning the plan cache's stored shapes"))
    }

    /// The handle (plan choices, cache statistics).
    pub fn lt(&self) -> &CublasLt {
        &self.lt
    }

    /// Why FP8 GEMMs cannot run on a device of `name` and `compute_capability` with this cuBLASLt (`None` when they
    /// can): the row-wise scaled FP8 GEMM needs sm_90 and cuBLASLt 12.9. The message names the fix.
    pub fn fp8_refusal(&self, name: &str, compute_capability: (i32, i32)) -> Option<String> {
        if compute_capability != (9, 0) {
            return Some(format!(
                "FP8 needs an sm_90 GPU (cuBLASLt runs row-wise scaled FP8 GEMMs there only); {name} is sm_{}{}: \
                 use --precision bf16",
                compute_capability.0, compute_capability.1
            ));
        }
        let version = self.lt.library().version();
        let needed = tf_cuda::cublaslt::Fp8ScaleMode::RowWise.min_cublaslt_version();
        (version < needed).then(|| {
            format!(
                "FP8 needs cuBLASLt {needed} or newer (row-wise scales); the loaded library is {version}: point \
                 TF_CUBLASLT at a newer libcublasLt or use --precision bf16"
            )
        })
    }

    /// How new plans pick their algorithm.
    pub fn set_algo_selection(&self, selection: AlgoSelection) -> Result<(), GemmError> {
        self.lt
            .set_algo_selection(selection)
            .map_err(library("setting the algorithm selection"))
    }

    /// What every plan built so far chose.
    pub fn plan_choices(&self) -> Vec<PlanChoice> {
        self.lt.plan_choices()
    }

    /// Device bytes of the handle's workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.lt.workspace_bytes()
    }

    /// Enqueues the FP8 `linear` on `stream`; a call with no rows (`m == 0`) is nothing to do.
    ///
    /// # Safety
    /// As [`GemmRunner::run`]: every span (operands and scales) must lie in live device memory of the handle's
    /// context until the stream has run the GEMM.
    pub unsafe fn run_fp8(&self, linear: &Fp8Linear, stream: &Stream) -> Result<(), GemmError> {
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

    /// Enqueues the INT8 GEMM `y[m, n] = x[m, k] · w[n, k]ᵀ` (signed 8-bit codes, exact int32 products; the caller
    /// applies the row scales); no rows (`m == 0`) is nothing to do.
    ///
    /// # Safety
    /// As [`GemmRunner::run`].
    pub unsafe fn run_int8(
        &self,
        (m, n, k): (usize, usize, usize),
        (x, w, y): (DeviceSpan, DeviceSpan, DeviceSpan),
        stream: &Stream,
    ) -> Result<(), GemmError> {
        if m == 0 {
            return Ok(());
        }
        // SAFETY: this function's contract is `matmul`'s.
        unsafe { self.lt.matmul(&Gemm::int8(m, n, k, x, w, y), stream) }
            .map_err(|source| GemmError::Run { m, n, k, source })
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
    use tf_cuda::cublaslt::Fp8ScaleMode;

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
        assert!(shape.bias);
        assert_eq!(
            shape_at_offsets(3, 5, 7, (0, 16, 2), false).with_bias(),
            GemmShape {
                align_x: 256,
                ..shape
            }
        );
        assert_eq!(distinct(vec![shape, shape]).len(), 1);
    }

    #[test]
    fn fp8_linear_is_a_row_wise_gemm_and_its_shape_matches() {
        let (x, xs, w, ws, y) = (
            s(0x1000, 4096),
            s(0x2000, 64),
            s(0x3000, 4096),
            s(0x4000, 256),
            s(0x8000, 8192),
        );
        let l = Fp8Linear::new((16, 64, 32), (x, xs), (w, ws), y);
        let g = l.gemm();
        assert_eq!(g.scale_mode, Fp8ScaleMode::RowWise);
        assert_eq!(
            g.scales,
            Some(Fp8Scales {
                x_scale: xs,
                w_scale: ws
            })
        );
        assert_eq!((g.alpha, g.beta), (1.0, 0.0));
        let key = g.plan().unwrap().key;
        assert_eq!(l.shape().key().unwrap(), key);
        let at = |accumulation| {
            fp8_shape_at_offsets((16, 64, 32), (0x1000, 0x3000, 0x8000), false, accumulation)
        };
        assert_eq!(at(Fp8Accumulation::Exact), l.shape());
        assert!(!g.fp8_fast_accum);
        // Fast accumulation is part of the plan key, and the shape the plans are prepared for says so too.
        let fast = l.accumulation(Fp8Accumulation::Fast);
        assert!(fast.gemm().fp8_fast_accum);
        assert_eq!(at(Fp8Accumulation::Fast), fast.shape());
        assert_ne!(fast.shape(), l.shape());
        assert_eq!(fast.shape().key().unwrap(), fast.gemm().plan().unwrap().key);
        let acc = l.accumulate(true).f32_output(true).gemm();
        assert_eq!((acc.beta, acc.output), (1.0, OutputType::F32));
        // Scales too short for the rows are refused before the library.
        let short = Fp8Linear::new((32, 64, 32), (x, xs), (w, ws), y);
        assert!(short.gemm().plan().is_err());
    }

    #[test]
    fn spans_are_checked() {
        let outer = s(0x1000, 100);
        assert_eq!(sub_span(outer, 10, 90).unwrap(), s(0x100a, 90));
        assert!(sub_span(outer, 10, 91).is_err());
        assert!(sub_span(outer, usize::MAX, 2).is_err());
    }
}
