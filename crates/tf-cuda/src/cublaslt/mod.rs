//! cuBLASLt GEMMs for row-major tensors, with the library loaded at run time (never linked).
//!
//! Engines compute `Y[M,N] = alpha · X[M,K] · W[N,K]ᵀ (+ bias[N]) (→ GELU) + beta · Y` in bf16
//! (or FP8 e4m3 with per-tensor scales) with f32 accumulation and bf16 or f32 output:
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_cuda::cublaslt::{CublasLt, Gemm, LtLibrary};
//! use tf_cuda::DeviceBuffer;
//! let lt = CublasLt::with_default_workspace(ctx, LtLibrary::open()?)?;
//! let (m, n, k) = (4096, 3072, 3072);
//! let x = DeviceBuffer::alloc(ctx, m * k * 2)?; // bf16 [M, K]
//! let w = DeviceBuffer::alloc(ctx, n * k * 2)?; // bf16 [N, K]
//! let y = DeviceBuffer::alloc(ctx, m * n * 2)?; // bf16 [M, N]
//! let gemm = Gemm::bf16(m, n, k, (&x).into(), (&w).into(), (&y).into());
//! // SAFETY: the spans are the live buffers above, kept until the stream is synchronized.
//! unsafe { lt.matmul(&gemm, stream)? };
//! stream.synchronize()?;
//! # Ok(()) }
//! ```
//!
//! Invariants:
//! - Validation (shapes, sizes, alignment, aliasing, FP8 constraints) runs before any library
//!   call and names what is wrong ([`CublasLtError::Invalid`]).
//! - The row-major problem maps to cuBLASLt's column-major "TN" call as pure data
//!   ([`plan::ColumnMajorCall`], unit-tested on the host).
//! - A plan (descriptors + chosen algorithm) is cached per [`plan::PlanKey`] (shape, types,
//!   epilogue, operand alignment); a repeated shape never queries the heuristic again.
//! - The handle owns one workspace that every call uses, so calls through one handle must be
//!   ordered on the GPU (one stream, or streams joined by events). Give each stream that runs
//!   GEMMs concurrently its own handle.
//! - The workspace outlives every plan and the library handle; drop a handle only after the work
//!   enqueued through it has finished (or been synchronized).

pub mod ffi;
pub mod loader;
pub mod plan;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use loader::{Attempt, LtLibrary};
pub use plan::{
    Activation, ColumnMajorCall, DeviceSpan, Fp8Scales, Gemm, InputType, OutputType, PlanKey,
};

use crate::context::Context;
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use crate::stream::Stream;
use ffi::{
    compute_type, desc_attr, layout_attr, order, pref_attr, status, HeuristicResult, LtApi,
    MatmulAlgo,
};

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
    hits: AtomicU64,
    misses: AtomicU64,
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
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
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
        }
    }

    /// Validates `gemm`, then enqueues it on `stream`.
    ///
    /// # Safety
    /// Every address in `gemm` must be a live device allocation in the current context with at
    /// least the bytes its span states, not freed before the GEMM has run; `stream` must be a
    /// stream of the handle's context.
    pub unsafe fn matmul(&self, gemm: &Gemm, stream: &Stream) -> Result<(), CublasLtError> {
        let raw_stream = stream.raw();
        let call = gemm.plan()?;
        let api = self.lib.api();
        let mut plans = self.plans.lock().map_err(|_| CublasLtError::Invalid {
            what: "the plan cache was poisoned by a panic in another thread".into(),
        })?;
        let plan = match plans.entry(call.key) {
            Entry::Occupied(hit) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                hit.into_mut()
            }
            Entry::Vacant(slot) => {
                let plan = in_context(&self.ctx, "cuBLASLt plan", || self.build_plan(&call))??;
                self.misses.fetch_add(1, Ordering::Relaxed);
                slot.insert(plan)
            }
        };
        set_pointers(&self.lib, plan, &call)?;
        let alpha = call.alpha;
        let beta = call.beta;
        let (handle, ws_addr, ws_len) = (
            self.handle,
            self.workspace.device_addr(),
            self.workspace.len_bytes(),
        );
        let code = in_context(&self.ctx, "cublasLtMatmul", || {
            // SAFETY: descriptors are live (owned by the cache, under the lock); the addresses
            // are the caller's promise; alpha/beta are host f32 (the default pointer mode); the
            // workspace holds what the algorithm asked for (checked when the plan was built).
            unsafe {
                (api.cublasLtMatmul)(
                    handle,
                    plan.desc,
                    (&alpha as *const f32).cast::<c_void>(),
                    call.a_addr as *const c_void,
                    plan.a,
                    call.b_addr as *const c_void,
                    plan.b,
                    (&beta as *const f32).cast::<c_void>(),
                    call.c_addr as *const c_void,
                    plan.d,
                    call.d_addr as *mut c_void,
                    plan.d,
                    &plan.algo,
                    ws_addr as *mut c_void,
                    ws_len,
                    raw_stream,
                )
            }
        })?;
        check(&self.lib, "cublasLtMatmul", code)
    }

    fn build_plan(&self, call: &ColumnMajorCall) -> Result<Plan, CublasLtError> {
        let lib = &self.lib;
        let api = lib.api();
        let mut partial = PartialPlan {
            api,
            desc: std::ptr::null_mut(),
            layouts: Vec::with_capacity(3),
            pref: std::ptr::null_mut(),
        };
        // SAFETY (for every call in this function): out-pointers are valid locals; attribute
        // buffers are live values of the C type the header documents for that attribute.
        unsafe {
            let code = (api.cublasLtMatmulDescCreate)(
                &mut partial.desc,
                compute_type::COMPUTE_32F,
                ffi::data_type::R_32F,
            );
            check(lib, "cublasLtMatmulDescCreate", code)?;
            set_desc(lib, partial.desc, desc_attr::TRANSA, &call.transa)?;
            set_desc(lib, partial.desc, desc_attr::TRANSB, &call.transb)?;
            set_desc(lib, partial.desc, desc_attr::EPILOGUE, &call.key.epilogue)?;
            if call.bias_addr != 0 {
                set_desc(lib, partial.desc, desc_attr::BIAS_DATA_TYPE, &call.d.dtype)?;
                set_desc(lib, partial.desc, desc_attr::BIAS_POINTER, &call.bias_addr)?;
            }
            if call.key.input == InputType::Fp8E4m3 {
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
                let fast: i8 = i8::from(call.key.fast_accum);
                set_desc(lib, partial.desc, desc_attr::FAST_ACCUM, &fast)?;
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
            let mut result = HeuristicResult::default();
            let mut found: i32 = 0;
            let code = (api.cublasLtMatmulAlgoGetHeuristic)(
                self.handle,
                partial.desc,
                a,
                b,
                d,
                d,
                partial.pref,
                1,
                &mut result,
                &mut found,
            );
            let what = || {
                let k = &call.key;
                format!(
                    "M={} N={} K={} {:?} -> {:?}, epilogue {}, alignment W/X/Y {}/{}/{}",
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
            check(
                lib,
                "cublasLtMatmulAlgoGetHeuristic (result state)",
                result.state,
            )?;
            if result.workspace_size > self.workspace.len_bytes() {
                return Err(CublasLtError::NoAlgorithm {
                    what: format!(
                        "{} (the algorithm wants {} bytes)",
                        what(),
                        result.workspace_size
                    ),
                    workspace_bytes: self.workspace.len_bytes(),
                });
            }
            let plan = Plan {
                desc: partial.desc,
                a,
                b,
                d,
                algo: result.algo,
                bias_addr: call.bias_addr,
                a_scale_addr: call.a_scale_addr,
                b_scale_addr: call.b_scale_addr,
            };
            // Ownership moved into `plan`; the preference is no longer needed.
            partial.desc = std::ptr::null_mut();
            partial.layouts.clear();
            Ok(plan)
        }
    }
}

impl Drop for CublasLt {
    fn drop(&mut self) {
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
