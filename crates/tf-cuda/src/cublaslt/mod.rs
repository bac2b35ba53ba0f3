//! cuBLASLt GEMMs for row-major tensors, with the library loaded at run time (never linked).
//!
//! Engines compute `Y[M,N] = alpha · X[M,K] · W[N,K]ᵀ (+ bias[N]) (→ GELU) + beta · Y` in bf16
//! (or FP8 e4m3 with per-tensor scales) with f32 accumulation and bf16 or f32 output:
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tf_cuda::cublaslt::{AlgoSelection, CublasLt, Gemm, GemmShape, LtLibrary, PlanCache};
//! use tf_cuda::DeviceBuffer;
//! let lt = CublasLt::with_default_workspace(ctx, LtLibrary::open()?)?;
//! let (m, n, k) = (4096, 3072, 3072);
//! let x = DeviceBuffer::alloc(ctx, m * k * 2)?; // bf16 [M, K]
//! let w = DeviceBuffer::alloc(ctx, n * k * 2)?; // bf16 [N, K]
//! let y = DeviceBuffer::alloc(ctx, m * n * 2)?; // bf16 [M, N]
//! let gemm = Gemm::bf16(m, n, k, (&x).into(), (&w).into(), (&y).into());
//! // At model load: choose every shape's algorithm once, reusing the choices of earlier
//! // processes (the persistent plan cache), timing unseen shapes within a budget.
//! lt.set_algo_selection(AlgoSelection::Timed { candidates: 8, repeats: 5 })?;
//! lt.set_plan_cache(Arc::new(PlanCache::open_default()))?;
//! let report = lt.prepare(&[GemmShape::of(&gemm)], Duration::from_secs(2), stream)?;
//! for warning in &report.warnings {
//!     eprintln!("warning: {warning}");
//! }
//! // SAFETY: the spans are the live buffers above, kept until the stream is synchronized.
//! unsafe { lt.matmul(&gemm, stream)? };
//! stream.synchronize()?;
//! for choice in lt.plan_choices() {
//!     println!("{:?}: {:?} -> {:?} ms", choice.chosen_by, choice.heuristic_first_ms(), choice.chosen_ms());
//! }
//! # Ok(()) }
//! ```
//!
//! What is bit-reproducible, and across what:
//! - A GEMM's bytes depend on its inputs and on the algorithm cuBLASLt runs (tile, split-K and
//!   reduction order). cuBLAS documents bit-wise identical results run to run for one toolkit
//!   version on GPUs of one architecture and SM count (atomics mode off, as here); another
//!   algorithm can change the low bits.
//! - [`AlgoSelection::Heuristic`] (the default) runs the heuristic's first result. That is a
//!   function of the GPU model, driver, cuBLASLt version, workspace size and GEMM key, so the
//!   same stack gives the same algorithm, and the same bytes, in every process. The plan cache
//!   is not used.
//! - [`AlgoSelection::Timed`] measures, and a measurement can pick another candidate in another
//!   process. With a plan cache ([`CublasLt::set_plan_cache`]) the first choice made on a stack
//!   is stored and every later process with that cache file on that stack (same GPU model,
//!   driver, cuBLASLt, workspace size: the [`StackKey`]) re-validates and runs it: same
//!   algorithm, same bytes, and no timing. A different stack, a reset
//!   ([`reset_plan_cache`]) or `TF_PLAN_CACHE=off` starts afresh, and may choose differently.
//! - After [`CublasLt::prepare`], no request is ever timed: a shape it was not given runs the
//!   heuristic's first (and that choice is stored, so it stays put too).
//!
//! Invariants:
//! - Validation (shapes, sizes, alignment, aliasing, FP8 constraints) runs before any library
//!   call and names what is wrong ([`CublasLtError::Invalid`]).
//! - The row-major problem maps to cuBLASLt's column-major "TN" call as pure data
//!   ([`plan::ColumnMajorCall`], unit-tested on the host).
//! - A plan (descriptors + chosen algorithm) is cached per [`plan::PlanKey`] (shape, types,
//!   epilogue, operand alignment); a repeated shape never queries the heuristic again.
//! - The algorithm is picked once, when the plan is built (by [`CublasLt::prepare`] or the
//!   shape's first call), by the handle's [`AlgoSelection`]: the heuristic's first result (the
//!   default), a stored choice of the persistent plan cache ([`cache`]) that the heuristic still
//!   offers, or the fastest of several heuristic results timed on scratch operands (prepare) or
//!   on the first call's own operands (no prepare yet). Timing synchronizes the call's stream and runs the
//!   GEMM `candidates × (1 + TIMING_ROUNDS × repeats)` extra times; it never runs while the stream is being
//!   captured (the heuristic's first result is taken there) and never changes the caller's data:
//!   with `beta == 0` it writes the call's own output, which the real call then overwrites; with
//!   `beta != 0` it writes a scratch buffer freed before the real call. What each plan chose and
//!   why is kept ([`CublasLt::plan_choices`]).
//! - The handle owns one workspace that every call uses, so calls through one handle must be
//!   ordered on the GPU (one stream, or streams joined by events). Give each stream that runs
//!   GEMMs concurrently its own handle.
//! - The workspace outlives every plan and the library handle; drop a handle only after the work
//!   enqueued through it has finished (or been synchronized).

pub mod cache;
pub mod ffi;
mod live;
pub mod loader;
pub mod plan;
pub mod prepare;

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use cache::{
    plan_cache_path, reset_plan_cache, PlanCache, PlanCacheError, StackKey, StoredPlan,
    StoredSource, ENV_PLAN_CACHE, NEIGHBOUR_M_FRACTION,
};
pub use loader::{Attempt, LtLibrary};
pub use plan::{
    choose_candidate, fastest_candidate, Activation, AlgoSelection, ColumnMajorCall, DeviceSpan,
    Fp8ScaleMode, Fp8Scales, Gemm, InputType, OutputType, PlanKey, TimingData, SWITCH_MARGIN,
    TIMING_ROUNDS,
};
pub use prepare::{Clock, GemmShape, PrepareReport, WallClock};

use live::LivePlanner;
use prepare::{choose_plan, prepare_keys_with, CacheSlot, Timing};

use crate::context::Context;
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use crate::stream::{Event, Stream};
use ffi::{desc_attr, layout_attr, order, pref_attr, status, HeuristicResult, LtApi, MatmulAlgo};

/// Default workspace size: enough for every algorithm the heuristic picks on Hopper.
pub const DEFAULT_WORKSPACE_BYTES: usize = 32 << 20;

/// Device memory a handle uses as its workspace (a `DeviceBuffer`, usually).
pub trait Workspace: Send + Sync {
    /// The workspace's device address (256-byte aligned or better).
    fn device_addr(&self) -> u64;
    /// Its size in bytes.
    fn len_bytes(&self) -> usize;
}

/// What went wrong in the GEMM path.
#[derive(Debug, thiserror::Error)]
pub enum CublasLtError {
    #[error(
        "cuBLASLt could not be loaded; tried:\n  {}\nset {} to the library file (libcublasLt.so.13 or .so.12) or {} to the CUDA toolkit root",
        .tried.iter().map(|a| a.to_string()).collect::<Vec<_>>().join("\n  "),
        loader::ENV_PATH,
        loader::ENV_CUDA_HOME
    )]
    LibraryNotFound { tried: Vec<Attempt> },
    #[error("{call} failed: {name} ({code}): {text}")]
    Status {
        call: &'static str,
        code: i32,
        name: &'static str,
        text: String,
    },
    #[error(
        "cuBLASLt has no algorithm for {what} (workspace {workspace_bytes} bytes); \
         check the GPU supports these types (FP8 needs sm_89+) or align the operands to 16 bytes"
    )]
    NoAlgorithm {
        what: String,
        workspace_bytes: usize,
    },
    #[error("invalid GEMM: {what}")]
    Invalid { what: String },
    /// The context or the workspace allocation failed (a lost context fails fast here).
    #[error(transparent)]
    Runtime(#[from] crate::Error),
}

/// Cache counters (monotonic since the handle was made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Plans held now.
    pub plans: usize,
    /// Calls served by a cached plan.
    pub hits: u64,
    /// Calls that built a plan (one heuristic query each).
    pub misses: u64,
    /// Plans whose algorithm was chosen by timing ([`ChosenBy::Timed`]).
    pub timed: u64,
    /// Plans that run a re-validated choice of the persistent cache ([`ChosenBy::Stored`], or a neighbour's:
    /// [`ChosenBy::Neighbour`]).
    pub stored: u64,
    /// Distinct kernels launched through the handle (timing, [`CublasLt::prepare`]'s priming, calls).
    pub kernels: usize,
    /// Of those, kernels first launched by a call ([`CublasLt::matmul`]) rather than ahead of it by a prepare: each
    /// such first launch waited for the device to drain while its kernel loaded.
    pub kernels_first_run_by_calls: u64,
}

/// Plans built by a call's first use of a shape ([`CublasLt::matmul`] outside [`CublasLt::prepare`]), over every
/// handle of the process, and the wall time spent building them. A request that finds its shapes planned adds
/// nothing; the difference between two readings says what a request paid for shapes the load did not plan.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallPlanning {
    pub plans: u64,
    pub seconds: f64,
}

static CALL_PLANS: AtomicU64 = AtomicU64::new(0);
static CALL_PLAN_NANOS: AtomicU64 = AtomicU64::new(0);

/// The process's [`CallPlanning`] so far. Safe from any thread.
pub fn call_planning() -> CallPlanning {
    CallPlanning {
        plans: CALL_PLANS.load(Ordering::Relaxed),
        seconds: CALL_PLAN_NANOS.load(Ordering::Relaxed) as f64 * 1e-9,
    }
}

impl CallPlanning {
    /// What was built between `earlier` and this reading.
    pub fn since(&self, earlier: &CallPlanning) -> CallPlanning {
        CallPlanning {
            plans: self.plans.saturating_sub(earlier.plans),
            seconds: (self.seconds - earlier.seconds).max(0.0),
        }
    }
}

/// Why a plan runs the algorithm it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChosenBy {
    /// The handle's policy was [`AlgoSelection::Heuristic`]: the heuristic's first result.
    Heuristic,
    /// Timed policy, but the stream was being captured (nothing can run during a capture):
    /// the heuristic's first result.
    Capturing,
    /// Timed policy, but the heuristic gave one usable result: nothing to compare.
    OnlyCandidate,
    /// Timed policy with `beta != 0`, but the scratch output could not be allocated: the
    /// heuristic's first result.
    NoScratch,
    /// Timed policy, but every candidate's run failed: the heuristic's first result (whose real
    /// call then reports the library's error).
    AllFailed,
    /// Timed policy: the fastest measured candidate.
    Timed,
    /// Timed policy: the persistent plan cache's choice for this stack and shape, found again
    /// among the heuristic's results (nothing timed).
    Stored,
    /// Timed policy, no stored choice for this shape: the stored choice of a shape that differs only in `m`, by at
    /// most an eighth ([`PlanCache::neighbour`]), found among the heuristic's results (nothing timed, nothing
    /// stored: a later process finds the same neighbour).
    Neighbour,
    /// Timed policy: the persistent cache's choice is no longer among the heuristic's results;
    /// the heuristic's first (a [`PlanCacheError::StoredAlgoRejected`] warning says so).
    StoredRejected,
    /// Timed policy, during [`CublasLt::prepare`] after its time budget was spent: the
    /// heuristic's first.
    BudgetSpent,
    /// Timed policy, a call after [`CublasLt::prepare`] of a shape it was not given: the
    /// heuristic's first (a request is never timed).
    Unprepared,
}

/// What a plan chose, for benchmarks and logs.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanChoice {
    pub key: PlanKey,
    pub chosen_by: ChosenBy,
    /// Usable heuristic results (state success, workspace within the handle's), in the
    /// heuristic's order.
    pub candidates: usize,
    /// Index of the algorithm the plan runs (0 = the heuristic's first).
    pub chosen: usize,
    /// Timed runs per candidate (0 when nothing was timed).
    pub repeats: usize,
    /// Mean milliseconds per call of each candidate; `None` where its run failed. Empty when
    /// nothing was timed.
    pub times_ms: Vec<Option<f32>>,
    /// Workspace bytes each candidate asked for.
    pub workspace_bytes: Vec<usize>,
}

impl PlanChoice {
    /// The measured time of the heuristic's first result, if it was timed.
    pub fn heuristic_first_ms(&self) -> Option<f32> {
        self.times_ms.first().copied().flatten()
    }

    /// The measured time of the chosen algorithm, if it was timed.
    pub fn chosen_ms(&self) -> Option<f32> {
        self.times_ms.get(self.chosen).copied().flatten()
    }
}

/// Descriptors and the algorithm for one [`PlanKey`]. Pointer attributes are per call; the last
/// values set are remembered so repeated calls skip redundant attribute writes.
struct Plan {
    desc: ffi::MatmulDesc,
    a: ffi::MatrixLayout,
    b: ffi::MatrixLayout,
    d: ffi::MatrixLayout,
    algo: MatmulAlgo,
    bias_addr: u64,
    a_scale_addr: u64,
    b_scale_addr: u64,
    /// Build order within the handle, so choices are reported in first-call order.
    order: u64,
    choice: PlanChoice,
    /// The plan's algorithm has run through this handle (its kernel is loaded).
    ran: bool,
}

/// What selects the kernel cuBLASLt launches for a plan: the algorithm and every part of the plan key but the sizes
/// (types, epilogue, alignment, scale mode). A kernel is loaded on its first launch in a context, and that load waits
/// until the device has drained: launched first in the middle of an enqueued step, it stalls the host for the work
/// already queued, and the rest of the step reaches an idle GPU. [`CublasLt::prepare`] launches each new kernel once
/// on scratch operands instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct KernelKey {
    sizeless: PlanKey,
    algo: [u64; 8],
}

impl KernelKey {
    fn of(key: &PlanKey, algo: &MatmulAlgo) -> KernelKey {
        KernelKey {
            sizeless: PlanKey {
                m: 0,
                n: 0,
                k: 0,
                ..*key
            },
            algo: algo.data,
        }
    }
}

/// Most stored shapes [`CublasLt::prepare_stored`] plans (a bound on a worker's load time for a cache that has
/// grown over many prompt lengths).
pub const MAX_STORED_SHAPES_PREPARED: usize = 2048;

/// The keys of the stored plans whose algorithm parses, the fewest operand elements first (ties in `stored`'s
/// order), at most `limit` of them.
fn stored_shapes_smallest_first(stored: &[cache::StoredPlan], limit: usize) -> Vec<PlanKey> {
    let elements = |key: &PlanKey| {
        key.m
            .saturating_mul(key.k)
            .saturating_add(key.n.saturating_mul(key.k))
            .saturating_add(key.m.saturating_mul(key.n))
    };
    let mut keys: Vec<PlanKey> = stored
        .iter()
        .filter(|plan| plan.algo().is_some())
        .map(|plan| plan.key)
        .collect();
    keys.sort_by_key(elements);
    keys.truncate(limit);
    keys
}

impl Plan {
    /// Destroys the descriptors. Errors are ignored: there is nothing to do about them here.
    fn destroy(self, api: &LtApi) {
        // SAFETY: each handle was created by the matching Create call and is destroyed once.
        unsafe {
            (api.cublasLtMatrixLayoutDestroy)(self.a);
            (api.cublasLtMatrixLayoutDestroy)(self.b);
            (api.cublasLtMatrixLayoutDestroy)(self.d);
            (api.cublasLtMatmulDescDestroy)(self.desc);
        }
    }
}

/// Owns descriptors while a plan is being built, so an error part-way frees what was made.
struct PartialPlan<'a> {
    api: &'a LtApi,
    desc: ffi::MatmulDesc,
    layouts: Vec<ffi::MatrixLayout>,
    pref: ffi::MatmulPreference,
}

impl Drop for PartialPlan<'_> {
    fn drop(&mut self) {
        // SAFETY: every non-null handle here came from its Create call and is not used after.
        unsafe {
            for layout in self.layouts.drain(..) {
                (self.api.cublasLtMatrixLayoutDestroy)(layout);
            }
            if !self.desc.is_null() {
                (self.api.cublasLtMatmulDescDestroy)(self.desc);
            }
            if !self.pref.is_null() {
                (self.api.cublasLtMatmulPreferenceDestroy)(self.pref);
            }
        }
    }
}

/// A cuBLASLt handle with its workspace and plan cache.
pub struct CublasLt {
    plans: Mutex<HashMap<PlanKey, Plan>>,
    selection: parking_lot::Mutex<AlgoSelection>,
    timing_data: parking_lot::Mutex<TimingData>,
    /// The persistent cache and this handle's stack key, when one is set.
    plan_cache: parking_lot::Mutex<Option<(Arc<PlanCache>, StackKey)>>,
    /// Set by [`CublasLt::prepare`]: from then on no call is timed.
    prepared: AtomicBool,
    /// Kernels launched through this handle ([`KernelKey`]).
    kernels_run: parking_lot::Mutex<HashSet<KernelKey>>,
    /// [`CacheStats::kernels_first_run_by_calls`].
    kernels_first_run_by_calls: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    timed: AtomicU64,
    stored: AtomicU64,
    handle: ffi::LtHandle,
    workspace: Box<dyn Workspace>,
    lib: Arc<LtLibrary>,
    ctx: Context,
}

// SAFETY: the raw handles are only used under `plans`' mutex (descriptors) or through calls
// cuBLASLt documents as thread-safe on one handle; the workspace is `Send + Sync`.
unsafe impl Send for CublasLt {}
// SAFETY: as above: every mutation of plan state happens under the mutex.
unsafe impl Sync for CublasLt {}

impl std::fmt::Debug for CublasLt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CublasLt")
            .field("library", &self.lib)
            .field("workspace_bytes", &self.workspace.len_bytes())
            .field("algo_selection", &self.algo_selection())
            .field("cache", &self.cache_stats())
            .finish()
    }
}

impl CublasLt {
    /// Creates a handle in `ctx` that uses `workspace` (device memory of `ctx`) for every call.
    pub fn new(
        ctx: &Context,
        lib: Arc<LtLibrary>,
        workspace: Box<dyn Workspace>,
    ) -> Result<CublasLt, CublasLtError> {
        if !workspace.device_addr().is_multiple_of(256) || workspace.len_bytes() == 0 {
            return Err(CublasLtError::Invalid {
                what: format!(
                    "workspace at {:#x} ({} bytes) must be non-empty and 256-byte aligned",
                    workspace.device_addr(),
                    workspace.len_bytes()
                ),
            });
        }
        let mut handle: ffi::LtHandle = std::ptr::null_mut();
        let code = in_context(ctx, "cublasLtCreate", || {
            // SAFETY: `handle` is a valid out-pointer; the context is current.
            unsafe { (lib.api().cublasLtCreate)(&mut handle) }
        })?;
        check(&lib, "cublasLtCreate", code)?;
        Ok(CublasLt {
            plans: Mutex::new(HashMap::new()),
            selection: parking_lot::Mutex::new(AlgoSelection::default()),
            timing_data: parking_lot::Mutex::new(TimingData::default()),
            plan_cache: parking_lot::Mutex::new(None),
            prepared: AtomicBool::new(false),
            kernels_run: parking_lot::Mutex::new(HashSet::new()),
            kernels_first_run_by_calls: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            timed: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            handle,
            workspace,
            lib,
            ctx: ctx.clone(),
        })
    }

    /// Creates a handle with a [`DEFAULT_WORKSPACE_BYTES`] workspace allocated in `ctx`.
    pub fn with_default_workspace(
        ctx: &Context,
        lib: Arc<LtLibrary>,
    ) -> Result<CublasLt, CublasLtError> {
        let workspace = DeviceBuffer::alloc(ctx, DEFAULT_WORKSPACE_BYTES)?;
        CublasLt::new(ctx, lib, Box::new(workspace))
    }

    /// The library this handle calls.
    pub fn library(&self) -> &Arc<LtLibrary> {
        &self.lib
    }

    /// The workspace size in bytes.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.len_bytes()
    }

    /// Plans held and hit/miss counts.
    pub fn cache_stats(&self) -> CacheStats {
        let plans = self.plans.lock().map(|p| p.len()).unwrap_or(0);
        CacheStats {
            plans,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            timed: self.timed.load(Ordering::Relaxed),
            stored: self.stored.load(Ordering::Relaxed),
            kernels: self.kernels_run.lock().len(),
            kernels_first_run_by_calls: self.kernels_first_run_by_calls.load(Ordering::Relaxed),
        }
    }

    /// Sets how plans built from now on pick their algorithm (plans already cached keep
    /// theirs). [`AlgoSelection::Timed`] makes the first call of each shape synchronize its
    /// stream and run the GEMM `candidates × (1 + TIMING_ROUNDS × repeats)` extra times on that call's
    /// operands; `candidates` must be in 1..=32 and `repeats` in 1..=100.
    pub fn set_algo_selection(&self, selection: AlgoSelection) -> Result<(), CublasLtError> {
        *self.selection.lock() = selection.validate()?;
        Ok(())
    }

    /// How new plans pick their algorithm.
    pub fn algo_selection(&self) -> AlgoSelection {
        *self.selection.lock()
    }

    /// What prepared shapes are timed on from now on ([`TimingData::Constant`] unless set). It is part of the
    /// stack key under which timed choices are stored, so an attached cache files them apart.
    pub fn set_timing_data(&self, data: TimingData) -> Result<(), CublasLtError> {
        *self.timing_data.lock() = data;
        let mut attached = self.plan_cache.lock();
        if let Some((_, stack)) = attached.as_mut() {
            *stack = self.stack_key()?;
        }
        Ok(())
    }

    /// What prepared shapes are timed on.
    pub fn timing_data(&self) -> TimingData {
        *self.timing_data.lock()
    }

    /// What every cached plan chose, in the order the shapes were first called.
    pub fn plan_choices(&self) -> Vec<PlanChoice> {
        let Ok(plans) = self.plans.lock() else {
            return Vec::new();
        };
        let mut ordered: Vec<&Plan> = plans.values().collect();
        ordered.sort_by_key(|plan| plan.order);
        ordered.iter().map(|plan| plan.choice.clone()).collect()
    }

    /// Uses `cache` (shared by the handles of a process) for the choices of timed selection:
    /// a shape's first call or [`CublasLt::prepare`] reuses a stored choice that the
    /// heuristic still offers instead of timing, and stores what it chose. Returns the stack
    /// key the entries are filed under (GPU model, driver, cuBLASLt, workspace). Under
    /// [`AlgoSelection::Heuristic`] the cache is neither read nor written.
    pub fn set_plan_cache(&self, cache: Arc<PlanCache>) -> Result<StackKey, CublasLtError> {
        let stack = self.stack_key()?;
        *self.plan_cache.lock() = Some((cache, stack.clone()));
        Ok(stack)
    }

    /// The persistent cache in use, if any.
    pub fn plan_cache(&self) -> Option<Arc<PlanCache>> {
        self.plan_cache
            .lock()
            .as_ref()
            .map(|(cache, _)| Arc::clone(cache))
    }

    /// What this handle's stored choices depend on besides the shape.
    pub fn stack_key(&self) -> Result<StackKey, CublasLtError> {
        let info = self.ctx.device_info()?;
        let driver_version = self.ctx.driver().version().map_err(crate::Error::from)?;
        Ok(StackKey {
            gpu_name: info.name,
            compute_capability: info.compute_capability,
            sm_count: info.sm_count,
            driver_version,
            driver_release: cache::driver_release(),
            cublaslt_version: self.lib.version(),
            workspace_bytes: self.workspace.len_bytes(),
            timing_data: self.timing_data(),
        })
    }

    /// Writes the choices recorded since the last save to the cache file (see
    /// [`PlanCache::save`]); `Ok(None)` when there is no cache or nothing new. Prepare saves on
    /// its own, and dropping the handle saves what later calls recorded (ignoring errors).
    pub fn save_plan_cache(&self) -> Result<Option<PathBuf>, PlanCacheError> {
        match self.plan_cache() {
            Some(cache) => cache.save(),
            None => Ok(None),
        }
    }

    /// True once [`CublasLt::prepare`] has run: calls of shapes it was not given take the
    /// heuristic's first result and are never timed.
    pub fn is_prepared(&self) -> bool {
        self.prepared.load(Ordering::Acquire)
    }

    /// Plans `shapes` ahead of the requests (at model load), on `stream`:
    /// - under [`AlgoSelection::Heuristic`]: each shape's plan with the heuristic's first
    ///   result (what its first call would build; no timing, no cache);
    /// - under [`AlgoSelection::Timed`]: a shape with a stored choice in the plan cache that the
    ///   heuristic still offers reuses it (no timing); other shapes are timed on scratch
    ///   operands while `budget` lasts (a shape starts only within the budget), then take the
    ///   heuristic's first; every choice is stored, and the cache file is written when a shape was
    ///   timed or a stale entry replaced (a request's planning, which never times, does not wait
    ///   for the file: its heuristic picks go out with the next save or the handle's drop).
    ///
    /// Then every plan built here whose kernel has not run through this handle yet is run once
    /// on scratch operands ([`PrepareReport::primed`]): cuBLASLt loads a kernel on its first
    /// launch, and the load waits for the device to drain, so a kernel first launched inside a
    /// request's enqueued step would stall it. Prepare a request's new shapes before enqueuing
    /// its step (a zero budget) and their new kernels load while the device is idle.
    ///
    /// From then on, a call of a shape not prepared takes a stored neighbour's choice (the same
    /// shape but for `m`, within an eighth: [`ChosenBy::Neighbour`]) or else the heuristic's
    /// first result (recorded as such); no call is timed inside a request. A shape of this
    /// prepare that cannot be timed (budget spent) takes a neighbour's choice the same way. Shapes already planned are
    /// left as they are. Timing synchronizes `stream` and allocates scratch operands the size
    /// of the largest shape timed (freed before returning; a shape whose scratch does not fit
    /// takes the heuristic's first). Problems with the cache file are warnings in the report.
    pub fn prepare(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
    ) -> Result<PrepareReport, CublasLtError> {
        self.prepare_with_clock(shapes, budget, stream, &WallClock(Instant::now()))
    }

    /// Plans every shape the persistent plan cache stores for this GPU and library (at most
    /// [`MAX_STORED_SHAPES_PREPARED`], the smallest first) with a zero budget, so their stored choices are reused and
    /// each of their kernels not yet run through this handle runs once on scratch operands ([`CublasLt::prepare`]:
    /// the smallest shape of a kernel loads it). A request whose shapes an earlier process planned then builds no
    /// plan and loads no kernel inside it. Without a cache nothing is planned. Afterwards no call is timed, as after
    /// any prepare. Meant for a worker's load, after its warm-up (planning takes about 0.15 ms a shape).
    pub fn prepare_stored(&self, stream: &Stream) -> Result<PrepareReport, CublasLtError> {
        let cache = self.plan_cache.lock().clone();
        let shapes: Vec<GemmShape> = match cache {
            Some((cache, stack)) => {
                stored_shapes_smallest_first(&cache.stored(&stack), MAX_STORED_SHAPES_PREPARED)
                    .iter()
                    .filter_map(GemmShape::from_key)
                    .collect()
            }
            None => Vec::new(),
        };
        self.prepare(&shapes, Duration::ZERO, stream)
    }

    /// [`CublasLt::prepare`] for a shape's first use inside a request: a shape with no stored
    /// choice but a stored neighbour (the same shape but for `m`, within an eighth) takes the
    /// neighbour's choice untimed, and only shapes with neither are timed within `budget`. A
    /// prompt a few tokens longer than one seen before then costs no timing.
    pub fn prepare_first_use(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
    ) -> Result<PrepareReport, CublasLtError> {
        self.prepare_inner(shapes, budget, stream, &WallClock(Instant::now()), true)
    }

    /// [`CublasLt::prepare`] with the budget measured by `clock`.
    pub fn prepare_with_clock(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
        clock: &dyn Clock,
    ) -> Result<PrepareReport, CublasLtError> {
        self.prepare_inner(shapes, budget, stream, clock, false)
    }

    fn prepare_inner(
        &self,
        shapes: &[GemmShape],
        budget: Duration,
        stream: &Stream,
        clock: &dyn Clock,
        neighbours_first: bool,
    ) -> Result<PrepareReport, CublasLtError> {
        stream.same_context(&self.ctx.inner, "CublasLt::prepare")?;
        let mut keys = Vec::with_capacity(shapes.len());
        let mut shape_of = HashMap::with_capacity(shapes.len());
        for shape in shapes {
            let key = shape.key()?;
            keys.push(key);
            shape_of.insert(key, *shape);
        }
        let selection = self.algo_selection();
        let cache = self.plan_cache.lock().clone();
        let mut plans = self.plans.lock().map_err(|_| CublasLtError::Invalid {
            what: "the plan cache was poisoned by a panic in another thread".into(),
        })?;
        let mut planner = LivePlanner::new(self, stream, None, selection, plans.len() as u64);
        planner.shapes = shape_of;
        let report = {
            let planned = |key: &PlanKey| plans.contains_key(key);
            prepare_keys_with(
                &mut planner,
                &keys,
                &planned,
                selection,
                cache
                    .as_ref()
                    .map(|(cache, stack)| CacheSlot { cache, stack }),
                budget,
                clock,
                neighbours_first,
            )?
        };
        let primed = planner.prime_new_kernels();
        for plan in planner.finish() {
            self.count_new_plan(plan.choice.chosen_by);
            plans.insert(plan.choice.key, plan);
        }
        self.prepared.store(true, Ordering::Release);
        Ok(PrepareReport {
            primed: primed?,
            ..report
        })
    }

    fn count_new_plan(&self, chosen_by: ChosenBy) {
        self.misses.fetch_add(1, Ordering::Relaxed);
        match chosen_by {
            ChosenBy::Timed => self.timed.fetch_add(1, Ordering::Relaxed),
            ChosenBy::Stored | ChosenBy::Neighbour => self.stored.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    /// Validates `gemm`, then enqueues it on `stream`.
    ///
    /// The first call of a shape not prepared builds its plan. Under [`AlgoSelection::Timed`],
    /// before any [`CublasLt::prepare`], without a stored choice and outside a stream capture,
    /// that call also times the candidates on `gemm`'s operands: it blocks until `stream` is
    /// idle and holds the plan cache meanwhile. After a prepare it never times (the heuristic's
    /// first result), so prepare the model's shapes at load.
    ///
    /// # Safety
    /// Every address in `gemm` must be a live device allocation in the current context with at
    /// least the bytes its span states, not freed before the GEMM has run; `stream` must be a
    /// stream of the handle's context.
    pub unsafe fn matmul(&self, gemm: &Gemm, stream: &Stream) -> Result<(), CublasLtError> {
        let call = gemm.plan()?;
        let mut plans = self.plans.lock().map_err(|_| CublasLtError::Invalid {
            what: "the plan cache was poisoned by a panic in another thread".into(),
        })?;
        let plans_len = plans.len() as u64;
        let plan = match plans.entry(call.key) {
            Entry::Occupied(hit) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                hit.into_mut()
            }
            Entry::Vacant(slot) => {
                let planning_started = Instant::now();
                let selection = self.algo_selection();
                let timing = if self.prepared.load(Ordering::Acquire) {
                    Timing::Unprepared
                } else {
                    Timing::Allowed
                };
                let cache = self.plan_cache.lock().clone();
                // Plans are never evicted, so the count so far is this plan's build order.
                let mut planner = LivePlanner::new(self, stream, Some(&call), selection, plans_len);
                let chosen_by = choose_plan(
                    &mut planner,
                    &call.key,
                    selection,
                    cache
                        .as_ref()
                        .map(|(cache, stack)| CacheSlot { cache, stack }),
                    timing,
                )?;
                let Some(plan) = planner.finish().pop() else {
                    return Err(CublasLtError::Invalid {
                        what: "internal: a plan was chosen but not built".into(),
                    });
                };
                self.count_new_plan(chosen_by);
                CALL_PLANS.fetch_add(1, Ordering::Relaxed);
                let nanos =
                    u64::try_from(planning_started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                CALL_PLAN_NANOS.fetch_add(nanos, Ordering::Relaxed);
                slot.insert(plan)
            }
        };
        set_pointers(&self.lib, plan, &call)?;
        let started = Instant::now();
        // SAFETY: the plan is live under the lock and built for this call; the addresses are
        // the caller's promise.
        let code =
            unsafe { self.enqueue(plan, &plan.algo, &call, call.c_addr, call.d_addr, stream) };
        crate::usage::note_slow_call(started, || {
            format!(
                "cuBLASLt matmul {}x{}x{} {:?}",
                gemm.m, gemm.n, gemm.k, gemm.input
            )
        });
        check(&self.lib, "cublasLtMatmul", code?)?;
        if !plan.ran {
            plan.ran = true;
            if self.note_kernel_run(&plan.choice.key, &plan.algo) {
                self.kernels_first_run_by_calls
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Records that `algo`'s kernel for `key` ran; true when it had not run through this handle before.
    fn note_kernel_run(&self, key: &PlanKey, algo: &MatmulAlgo) -> bool {
        self.kernels_run.lock().insert(KernelKey::of(key, algo))
    }

    /// True when `plan`'s kernel has been launched through this handle (by this plan or another of the same kind).
    fn kernel_has_run(&self, plan: &Plan) -> bool {
        plan.ran
            || self
                .kernels_run
                .lock()
                .contains(&KernelKey::of(&plan.choice.key, &plan.algo))
    }

    /// Enqueues `call` with `algo` on `stream`, reading `C` (when beta != 0) at `c_addr` and
    /// writing `D` at `d_addr`; returns the library's status.
    ///
    /// # Safety
    /// The call's input addresses, `c_addr` and `d_addr` must be live device memory of the sizes
    /// the call states; `algo` must be one the heuristic returned for this plan within the
    /// workspace.
    unsafe fn enqueue(
        &self,
        plan: &Plan,
        algo: &MatmulAlgo,
        call: &ColumnMajorCall,
        c_addr: u64,
        d_addr: u64,
        stream: &Stream,
    ) -> Result<ffi::Status, CublasLtError> {
        let api = self.lib.api();
        let raw_stream = stream.raw();
        // An exact INT8 plan's scale type is int32 (whole numbers, checked when the call was planned).
        let int_scaling =
            call.key.input == InputType::Int8 && call.key.scale_mode == Fp8ScaleMode::Tensor;
        let (alpha, beta) = (call.alpha, call.beta);
        let (alpha_i32, beta_i32) = (alpha as i32, beta as i32);
        let (alpha_ptr, beta_ptr) = if call.alpha_vector_addr != 0 {
            // ALPHA_DEVICE_VECTOR_BETA_ZERO: alpha is the device vector; beta is zero and not read.
            (
                call.alpha_vector_addr as *const c_void,
                (&beta as *const f32).cast::<c_void>(),
            )
        } else if int_scaling {
            (
                (&alpha_i32 as *const i32).cast::<c_void>(),
                (&beta_i32 as *const i32).cast::<c_void>(),
            )
        } else {
            (
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
            )
        };
        let (handle, ws_addr, ws_len) = (
            self.handle,
            self.workspace.device_addr(),
            self.workspace.len_bytes(),
        );
        in_context(&self.ctx, "cublasLtMatmul", || {
            // SAFETY: descriptors are live (owned by the cache, under the lock); the addresses
            // are the caller's promise; alpha/beta are host values of the plan's scale type (the
            // default pointer mode), alive for the call, or alpha the call's device vector (checked
            // when the call was planned); the workspace holds what the algorithm
            // asked for (checked when the plan was built).
            unsafe {
                (api.cublasLtMatmul)(
                    handle,
                    plan.desc,
                    alpha_ptr,
                    call.a_addr as *const c_void,
                    plan.a,
                    call.b_addr as *const c_void,
                    plan.b,
                    beta_ptr,
                    c_addr as *const c_void,
                    plan.d,
                    d_addr as *mut c_void,
                    plan.d,
                    algo,
                    ws_addr as *mut c_void,
                    ws_len,
                    raw_stream,
                )
            }
        })
    }

    /// Times each candidate on the call's operands and sets the plan's algorithm to the
    /// fastest; leaves the heuristic's first where nothing can or could be timed.
    ///
    /// # Safety
    /// As [`CublasLt::matmul`]; `candidates` are the plan's usable heuristic results.
    unsafe fn choose_by_timing(
        &self,
        plan: &mut Plan,
        candidates: &[HeuristicResult],
        call: &ColumnMajorCall,
        repeats: usize,
        stream: &Stream,
    ) -> Result<(), CublasLtError> {
        if candidates.len() < 2 {
            plan.choice.chosen_by = ChosenBy::OnlyCandidate;
            return Ok(());
        }
        if stream.is_capturing()? {
            plan.choice.chosen_by = ChosenBy::Capturing;
            return Ok(());
        }
        set_pointers(&self.lib, plan, call)?;
        // With beta != 0 the output is also an input: time into scratch so the caller's data
        // is never changed. cuMemAlloc returns 256-byte aligned memory, at least the plan's.
        let scratch = if call.beta != 0.0 {
            match self.timing_scratch(call, stream)? {
                Some(buffer) => Some(buffer),
                None => {
                    plan.choice.chosen_by = ChosenBy::NoScratch;
                    return Ok(());
                }
            }
        } else {
            None
        };
        let (c_addr, d_addr) = match &scratch {
            Some(buffer) => (buffer.addr(), buffer.addr()),
            None => (call.c_addr, call.d_addr),
        };
        // One warm-up run of every candidate, then TIMING_ROUNDS rounds that time each in turn
        // (so clock and power drift spread over all of them), keeping each one's fastest round.
        let mut usable = vec![true; candidates.len()];
        let mut rounds: Vec<Vec<(Event, Event)>> = candidates.iter().map(|_| Vec::new()).collect();
        let timed = (|| -> Result<(), CublasLtError> {
            for (candidate, ok) in candidates.iter().zip(usable.iter_mut()) {
                // SAFETY: C/D are the call's output or the scratch buffer of its size; the
                // candidate is one of this plan's heuristic results.
                let code =
                    unsafe { self.enqueue(plan, &candidate.algo, call, c_addr, d_addr, stream)? };
                *ok = code == status::SUCCESS;
                if *ok {
                    self.note_kernel_run(&call.key, &candidate.algo);
                }
            }
            for _ in 0..TIMING_ROUNDS {
                for ((candidate, ok), pairs) in candidates
                    .iter()
                    .zip(usable.iter_mut())
                    .zip(rounds.iter_mut())
                {
                    if !*ok {
                        continue;
                    }
                    // SAFETY: as above.
                    match unsafe {
                        self.time_candidate(
                            plan,
                            &candidate.algo,
                            call,
                            (c_addr, d_addr),
                            repeats,
                            stream,
                        )?
                    } {
                        Some(pair) => pairs.push(pair),
                        None => *ok = false,
                    }
                }
            }
            Ok(())
        })();
        if let Err(error) = timed {
            // Let enqueued work finish before the scratch buffer is freed.
            let _ = stream.synchronize();
            return Err(error);
        }
        stream.synchronize()?;
        drop(scratch);
        let mut times_ms = Vec::with_capacity(candidates.len());
        for (ok, pairs) in usable.iter().zip(&rounds) {
            let mut best: Option<f32> = None;
            if *ok {
                for (start, end) in pairs {
                    let ms = Event::elapsed_ms(start, end)? / repeats as f32;
                    best = Some(best.map_or(ms, |b| b.min(ms)));
                }
            }
            times_ms.push(best);
        }
        plan.choice.repeats = repeats;
        match choose_candidate(&times_ms, SWITCH_MARGIN)
            .and_then(|i| candidates.get(i).map(|c| (i, c)))
        {
            Some((index, candidate)) => {
                plan.algo = candidate.algo;
                plan.choice.chosen = index;
                plan.choice.chosen_by = ChosenBy::Timed;
                plan.ran = true;
            }
            None => plan.choice.chosen_by = ChosenBy::AllFailed,
        }
        plan.choice.times_ms = times_ms;
        Ok(())
    }

    /// `repeats` runs between two timing events; `None` when the library refused a run.
    ///
    /// # Safety
    /// As [`CublasLt::enqueue`].
    unsafe fn time_candidate(
        &self,
        plan: &Plan,
        algo: &MatmulAlgo,
        call: &ColumnMajorCall,
        (c_addr, d_addr): (u64, u64),
        repeats: usize,
        stream: &Stream,
    ) -> Result<Option<(Event, Event)>, CublasLtError> {
        let start = Event::new(&self.ctx, true)?;
        let end = Event::new(&self.ctx, true)?;
        start.record(stream)?;
        for _ in 0..repeats {
            // SAFETY: the caller's contract.
            if unsafe { self.enqueue(plan, algo, call, c_addr, d_addr, stream)? } != status::SUCCESS
            {
                return Ok(None);
            }
        }
        end.record(stream)?;
        Ok(Some((start, end)))
    }

    /// A zeroed device buffer the size of the call's output, or `None` when it cannot be
    /// allocated (timing is then skipped rather than failing the GEMM).
    fn timing_scratch(
        &self,
        call: &ColumnMajorCall,
        stream: &Stream,
    ) -> Result<Option<DeviceBuffer>, CublasLtError> {
        let key = &call.key;
        let Some(bytes) = key
            .m
            .checked_mul(key.n)
            .and_then(|elems| elems.checked_mul(key.output.size_bytes()))
            .and_then(|bytes| bytes.checked_next_multiple_of(4))
        else {
            return Ok(None);
        };
        let Ok(mut scratch) = DeviceBuffer::alloc(&self.ctx, bytes) else {
            return Ok(None);
        };
        // Zeros keep beta · C finite, like real data.
        scratch.fill_u32(0, Some(stream))?;
        Ok(Some(scratch))
    }

    /// Builds the descriptors and asks the heuristic for up to `requested` results; returns the
    /// plan (running the first usable result) and every usable result in the heuristic's order.
    fn build_plan(
        &self,
        call: &ColumnMajorCall,
        requested: usize,
        order: u64,
    ) -> Result<(Plan, Vec<HeuristicResult>), CublasLtError> {
        let lib = &self.lib;
        check_scale_mode_support(call.key.scale_mode, lib.version())?;
        let api = lib.api();
        let mut partial = PartialPlan {
            api,
            desc: std::ptr::null_mut(),
            layouts: Vec::with_capacity(3),
            pref: std::ptr::null_mut(),
        };
        // SAFETY: (for every call in this function) out-pointers are valid locals; attribute
        // buffers are live values of the C type the header documents for that attribute.
        unsafe {
            let (compute, scale) = call.key.input.compute_and_scale_types(call.key.scale_mode);
            let code = (api.cublasLtMatmulDescCreate)(&mut partial.desc, compute, scale);
            check(lib, "cublasLtMatmulDescCreate", code)?;
            set_desc(lib, partial.desc, desc_attr::TRANSA, &call.transa)?;
            set_desc(lib, partial.desc, desc_attr::TRANSB, &call.transb)?;
            set_desc(lib, partial.desc, desc_attr::EPILOGUE, &call.key.epilogue)?;
            if call.bias_addr != 0 {
                set_desc(lib, partial.desc, desc_attr::BIAS_DATA_TYPE, &call.d.dtype)?;
                set_desc(lib, partial.desc, desc_attr::BIAS_POINTER, &call.bias_addr)?;
            }
            if call.key.scale_mode == Fp8ScaleMode::ChannelAlpha {
                let mode = ffi::pointer_mode::ALPHA_DEVICE_VECTOR_BETA_ZERO;
                set_desc(lib, partial.desc, desc_attr::POINTER_MODE, &mode)?;
            }
            let row_wise_int8 =
                call.key.input == InputType::Int8 && call.key.scale_mode == Fp8ScaleMode::RowWise;
            if call.key.input == InputType::Fp8E4m3 || row_wise_int8 {
                set_desc(
                    lib,
                    partial.desc,
                    desc_attr::A_SCALE_POINTER,
                    &call.a_scale_addr,
                )?;
                set_desc(
                    lib,
                    partial.desc,
                    desc_attr::B_SCALE_POINTER,
                    &call.b_scale_addr,
                )?;
                if call.key.input == InputType::Fp8E4m3 {
                    let fast: i8 = i8::from(call.key.fast_accum);
                    set_desc(lib, partial.desc, desc_attr::FAST_ACCUM, &fast)?;
                }
                if call.key.scale_mode != Fp8ScaleMode::Tensor {
                    // Set only for vector modes: a per-tensor plan's descriptor stays what it always was
                    // (and works with libraries older than the attribute).
                    let mode: i32 = call.key.scale_mode.cuda_mode();
                    set_desc(lib, partial.desc, desc_attr::A_SCALE_MODE, &mode)?;
                    set_desc(lib, partial.desc, desc_attr::B_SCALE_MODE, &mode)?;
                }
            }
            for spec in [call.a, call.b, call.d] {
                let mut layout: ffi::MatrixLayout = std::ptr::null_mut();
                let code = (api.cublasLtMatrixLayoutCreate)(
                    &mut layout,
                    spec.dtype,
                    spec.rows,
                    spec.cols,
                    spec.ld,
                );
                check(lib, "cublasLtMatrixLayoutCreate", code)?;
                partial.layouts.push(layout);
                let col = order::COL;
                let code = (api.cublasLtMatrixLayoutSetAttribute)(
                    layout,
                    layout_attr::ORDER,
                    (&col as *const i32).cast(),
                    std::mem::size_of_val(&col),
                );
                check(lib, "cublasLtMatrixLayoutSetAttribute(ORDER)", code)?;
            }
            let code = (api.cublasLtMatmulPreferenceCreate)(&mut partial.pref);
            check(lib, "cublasLtMatmulPreferenceCreate", code)?;
            let max_ws = self.workspace.len_bytes() as u64;
            set_pref(lib, partial.pref, pref_attr::MAX_WORKSPACE_BYTES, &max_ws)?;
            set_pref(
                lib,
                partial.pref,
                pref_attr::MIN_ALIGNMENT_A_BYTES,
                &call.key.align_a,
            )?;
            set_pref(
                lib,
                partial.pref,
                pref_attr::MIN_ALIGNMENT_B_BYTES,
                &call.key.align_b,
            )?;
            set_pref(
                lib,
                partial.pref,
                pref_attr::MIN_ALIGNMENT_C_BYTES,
                &call.key.align_cd,
            )?;
            set_pref(
                lib,
                partial.pref,
                pref_attr::MIN_ALIGNMENT_D_BYTES,
                &call.key.align_cd,
            )?;

            let (a, b, d) = match partial.layouts[..] {
                [a, b, d] => (a, b, d),
                _ => {
                    return Err(CublasLtError::Invalid {
                        what: "internal: expected three layouts".into(),
                    })
                }
            };
            let requested = requested.clamp(1, AlgoSelection::MAX_CANDIDATES);
            let mut results = vec![HeuristicResult::default(); requested];
            let mut found: i32 = 0;
            let code = (api.cublasLtMatmulAlgoGetHeuristic)(
                self.handle,
                partial.desc,
                a,
                b,
                d,
                d,
                partial.pref,
                requested as i32,
                results.as_mut_ptr(),
                &mut found,
            );
            let what = || {
                let k = &call.key;
                let mode = match k.scale_mode {
                    Fp8ScaleMode::Tensor => String::new(),
                    Fp8ScaleMode::ChannelAlpha => {
                        ", the W scales as a device alpha vector (ALPHA_DEVICE_VECTOR_BETA_ZERO)".into()
                    }
                    other => format!(
                        ", {other:?} FP8 scales (cuBLASLt runs these on sm_90 only, from version 12.9)"
                    ),
                };
                format!(
                    "M={} N={} K={} {:?} -> {:?}, epilogue {}, alignment W/X/Y {}/{}/{}{mode}",
                    k.m, k.n, k.k, k.input, k.output, k.epilogue, k.align_a, k.align_b, k.align_cd
                )
            };
            if code == status::NOT_SUPPORTED || (code == status::SUCCESS && found < 1) {
                return Err(CublasLtError::NoAlgorithm {
                    what: what(),
                    workspace_bytes: self.workspace.len_bytes(),
                });
            }
            check(lib, "cublasLtMatmulAlgoGetHeuristic", code)?;
            results.truncate(usize::try_from(found).unwrap_or(0).min(requested));
            let (usable, refused) = usable_results(results, self.workspace.len_bytes());
            let Some(first) = usable.first() else {
                return Err(CublasLtError::NoAlgorithm {
                    what: format!(
                        "{} (heuristic results refused: {})",
                        what(),
                        refused.join("; ")
                    ),
                    workspace_bytes: self.workspace.len_bytes(),
                });
            };
            let plan = Plan {
                desc: partial.desc,
                a,
                b,
                d,
                algo: first.algo,
                bias_addr: call.bias_addr,
                a_scale_addr: call.a_scale_addr,
                b_scale_addr: call.b_scale_addr,
                order,
                ran: false,
                choice: PlanChoice {
                    key: call.key,
                    chosen_by: ChosenBy::Heuristic,
                    candidates: usable.len(),
                    chosen: 0,
                    repeats: 0,
                    times_ms: Vec::new(),
                    workspace_bytes: usable.iter().map(|r| r.workspace_size).collect(),
                },
            };
            // Ownership moved into `plan`; the preference is no longer needed.
            partial.desc = std::ptr::null_mut();
            partial.layouts.clear();
            Ok((plan, usable))
        }
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
        // Host-only: keep what later calls recorded (a failed save cannot be acted on here).
        if let Some((cache, _)) = self.plan_cache.get_mut().take() {
            let _ = cache.save();
        }
        let api = self.lib.api();
        let plans = match self.plans.get_mut() {
            Ok(plans) => std::mem::take(plans),
            Err(poisoned) => std::mem::take(poisoned.into_inner()),
        };
        if self.ctx.is_lost() {
            // The context cannot be used after a sticky fault: leak the descriptors.
            std::mem::forget(plans);
            return;
        }
        let handle = self.handle;
        let _ = in_context(&self.ctx, "cublasLtDestroy", || {
            for (_, plan) in plans {
                plan.destroy(api);
            }
            // SAFETY: created in `new`, destroyed once; errors cannot be acted on in Drop.
            unsafe { (api.cublasLtDestroy)(handle) }
        });
    }
}

/// Refuses an FP8 scale mode the loaded cuBLASLt (`cublasLtGetVersion`) predates, naming both versions.
fn check_scale_mode_support(mode: Fp8ScaleMode, version: usize) -> Result<(), CublasLtError> {
    let needed = mode.min_cublaslt_version();
    if version < needed {
        return Err(CublasLtError::Invalid {
            what: format!(
                "{mode:?} FP8 scales need cuBLASLt {}.{} or newer, but the loaded library is version {version}; \
                 point TF_CUBLASLT at a newer libcublasLt or use per-tensor scales",
                needed / 10_000,
                needed / 100 % 100
            ),
        });
    }
    Ok(())
}

/// Splits heuristic results into those a call can run (state success, workspace within
/// `workspace_bytes`, order kept) and a description of each refused one.
fn usable_results(
    results: Vec<HeuristicResult>,
    workspace_bytes: usize,
) -> (Vec<HeuristicResult>, Vec<String>) {
    let mut usable = Vec::with_capacity(results.len());
    let mut refused = Vec::new();
    for (index, result) in results.into_iter().enumerate() {
        if result.state != status::SUCCESS {
            refused.push(format!(
                "#{index} state {} ({})",
                status::name(result.state),
                result.state
            ));
        } else if result.workspace_size > workspace_bytes {
            refused.push(format!(
                "#{index} wants {} workspace bytes",
                result.workspace_size
            ));
        } else {
            usable.push(result);
        }
    }
    if refused.is_empty() && usable.is_empty() {
        refused.push("none returned".into());
    }
    (usable, refused)
}

/// Writes the per-call pointer attributes that differ from what the plan last used.
fn set_pointers(
    lib: &LtLibrary,
    plan: &mut Plan,
    call: &ColumnMajorCall,
) -> Result<(), CublasLtError> {
    if call.bias_addr != plan.bias_addr {
        // SAFETY: the descriptor is live; the value is a u64 device address.
        unsafe { set_desc(lib, plan.desc, desc_attr::BIAS_POINTER, &call.bias_addr)? };
        plan.bias_addr = call.bias_addr;
    }
    if call.a_scale_addr != plan.a_scale_addr {
        // SAFETY: as above.
        unsafe {
            set_desc(
                lib,
                plan.desc,
                desc_attr::A_SCALE_POINTER,
                &call.a_scale_addr,
            )?
        };
        plan.a_scale_addr = call.a_scale_addr;
    }
    if call.b_scale_addr != plan.b_scale_addr {
        // SAFETY: as above.
        unsafe {
            set_desc(
                lib,
                plan.desc,
                desc_attr::B_SCALE_POINTER,
                &call.b_scale_addr,
            )?
        };
        plan.b_scale_addr = call.b_scale_addr;
    }
    Ok(())
}

/// # Safety
/// `desc` must be live and `T` the attribute's documented C type.
unsafe fn set_desc<T>(
    lib: &LtLibrary,
    desc: ffi::MatmulDesc,
    attr: i32,
    value: &T,
) -> Result<(), CublasLtError> {
    // SAFETY: the caller's contract; `value` is live for the call and its size is exact.
    let code = unsafe {
        (lib.api().cublasLtMatmulDescSetAttribute)(
            desc,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    };
    check(lib, "cublasLtMatmulDescSetAttribute", code)
}

/// # Safety
/// `pref` must be live and `T` the attribute's documented C type.
unsafe fn set_pref<T>(
    lib: &LtLibrary,
    pref: ffi::MatmulPreference,
    attr: i32,
    value: &T,
) -> Result<(), CublasLtError> {
    // SAFETY: the caller's contract; `value` is live for the call and its size is exact.
    let code = unsafe {
        (lib.api().cublasLtMatmulPreferenceSetAttribute)(
            pref,
            attr,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    };
    check(lib, "cublasLtMatmulPreferenceSetAttribute", code)
}

/// Runs `f` with `ctx` current on this thread; fails fast (without running it) on a lost context.
fn in_context<T>(
    ctx: &Context,
    call: &'static str,
    f: impl FnOnce() -> T,
) -> Result<T, CublasLtError> {
    let mut out = None;
    ctx.inner
        .call_raw(call, |_| {
            out = Some(f());
            tf_sys::code::SUCCESS
        })
        .map_err(crate::Error::from)?;
    out.ok_or_else(|| CublasLtError::Invalid {
        what: format!("internal: {call} did not run"),
    })
}

impl Workspace for DeviceBuffer {
    fn device_addr(&self) -> u64 {
        self.addr()
    }
    fn len_bytes(&self) -> usize {
        self.len()
    }
}

impl From<&DeviceBuffer> for DeviceSpan {
    fn from(buffer: &DeviceBuffer) -> DeviceSpan {
        DeviceSpan::new(buffer.addr(), buffer.len())
    }
}

impl From<DeviceView<'_>> for DeviceSpan {
    fn from(view: DeviceView<'_>) -> DeviceSpan {
        DeviceSpan::new(view.addr(), view.len())
    }
}

impl From<&DeviceViewMut<'_>> for DeviceSpan {
    fn from(view: &DeviceViewMut<'_>) -> DeviceSpan {
        DeviceSpan::new(view.addr(), view.len())
    }
}

fn check(lib: &LtLibrary, call: &'static str, code: ffi::Status) -> Result<(), CublasLtError> {
    if code == status::SUCCESS {
        return Ok(());
    }
    Err(CublasLtError::Status {
        call,
        code,
        name: status::name(code),
        text: lib.status_text(code),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_is_the_algorithm_and_the_key_without_its_sizes() {
        let key = PlanKey {
            n: 64,
            k: 4096,
            ..cache::tests::key(4131)
        };
        let algo = MatmulAlgo {
            data: [7, 0, 0, 0, 0, 0, 0, 1],
        };
        let other_sizes = PlanKey {
            m: 4176,
            n: 128,
            k: 3072,
            ..key
        };
        assert_eq!(
            KernelKey::of(&key, &algo),
            KernelKey::of(&other_sizes, &algo)
        );
        let other_algo = MatmulAlgo {
            data: [8, 0, 0, 0, 0, 0, 0, 1],
        };
        assert_ne!(KernelKey::of(&key, &algo), KernelKey::of(&key, &other_algo));
        for changed in [
            PlanKey {
                align_cd: 16,
                ..key
            },
            PlanKey {
                output: OutputType::F32,
                ..key
            },
            PlanKey { epilogue: 2, ..key },
        ] {
            assert_ne!(KernelKey::of(&key, &algo), KernelKey::of(&changed, &algo));
        }
    }

    #[test]
    fn stored_shapes_are_planned_smallest_first_up_to_the_limit() {
        let stored = |m: usize| {
            cache::StoredPlan::new(
                cache::tests::key(m),
                &MatmulAlgo {
                    data: [1, 0, 0, 0, 0, 0, 0, 1],
                },
                cache::StoredSource::Timed,
                0,
                8,
            )
        };
        let mut broken = stored(64);
        broken.algo = "not hex".into();
        let plans = [
            stored(4131),
            stored(128),
            broken,
            stored(8192),
            stored(4096),
        ];
        let ms = |limit: usize| -> Vec<usize> {
            stored_shapes_smallest_first(&plans, limit)
                .iter()
                .map(|k| k.m)
                .collect()
        };
        assert_eq!(ms(10), vec![128, 4096, 4131, 8192]);
        assert_eq!(ms(2), vec![128, 4096]);
        assert!(ms(0).is_empty());
        assert!(stored_shapes_smallest_first(&[], 10).is_empty());
    }

    #[test]
    fn call_planning_difference_never_goes_negative() {
        let earlier = CallPlanning {
            plans: 5,
            seconds: 0.25,
        };
        let later = CallPlanning {
            plans: 7,
            seconds: 0.5,
        };
        assert_eq!(
            later.since(&earlier),
            CallPlanning {
                plans: 2,
                seconds: 0.25
            }
        );
        assert_eq!(earlier.since(&later), CallPlanning::default());
        // Readings only grow: a later reading never reports fewer plans than an earlier one.
        let first = call_planning();
        assert!(call_planning().plans >= first.plans);
    }

    fn result(tag: u64, state: ffi::Status, workspace_size: usize) -> HeuristicResult {
        let mut r = HeuristicResult {
            state,
            workspace_size,
            ..HeuristicResult::default()
        };
        r.algo.data[0] = tag;
        r
    }

    #[test]
    fn usable_results_keep_the_heuristic_order_and_name_what_was_refused() {
        let results = vec![
            result(1, status::NOT_SUPPORTED, 0),
            result(2, status::SUCCESS, 1024),
            result(3, status::SUCCESS, 64 << 20),
            result(4, status::SUCCESS, 32 << 20),
        ];
        let (usable, refused) = usable_results(results, 32 << 20);
        let tags: Vec<u64> = usable.iter().map(|r| r.algo.data[0]).collect();
        assert_eq!(tags, [2, 4]);
        assert_eq!(refused.len(), 2);
        assert!(refused[0].contains("#0 state CUBLAS_STATUS_NOT_SUPPORTED"));
        assert!(refused[1].contains("#2 wants 67108864 workspace bytes"));
        let (usable, refused) = usable_results(Vec::new(), 1 << 20);
        assert!(usable.is_empty());
        assert_eq!(refused, ["none returned"]);
    }

    #[test]
    fn plan_choice_reports_first_and_chosen_times() {
        let key = Gemm::bf16(
            8,
            8,
            8,
            DeviceSpan::new(0x1000, 1024),
            DeviceSpan::new(0x2000, 1024),
            DeviceSpan::new(0x3000, 1024),
        )
        .plan()
        .map(|call| call.key);
        let Ok(key) = key else {
            panic!("valid GEMM refused: {key:?}");
        };
        let choice = PlanChoice {
            key,
            chosen_by: ChosenBy::Timed,
            candidates: 3,
            chosen: 2,
            repeats: 5,
            times_ms: vec![Some(1.5), None, Some(1.25)],
            workspace_bytes: vec![0, 0, 0],
        };
        assert_eq!(choice.heuristic_first_ms(), Some(1.5));
        assert_eq!(choice.chosen_ms(), Some(1.25));
        let untimed = PlanChoice {
            chosen_by: ChosenBy::Heuristic,
            chosen: 0,
            times_ms: Vec::new(),
            ..choice
        };
        assert_eq!(untimed.heuristic_first_ms(), None);
        assert_eq!(untimed.chosen_ms(), None);
    }
}
