//! Launch infrastructure shared by every GPU launcher: the [`Matrix`] and [`Operand`] descriptions the checks
//! work on, the checks themselves (shapes, strides, sizes, alignment, integer ranges), the validated and packed
//! [`Launch`], and `LoadedSet`, the loaded kernels of one or more kernel sets, which submits launches.

use std::collections::HashMap;
use std::marker::PhantomData;

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceView, DeviceViewMut, Function, Module, Stream};

/// Threads per block of the row kernels (NN_ROW_THREADS in kernels/nn/*.cu and kernels/qwen_image/adaln.cu).
pub(crate) const ROW_THREADS: u32 = 256;
/// bf16 size in bytes.
pub(crate) const BF16: usize = 2;

/// A bf16 matrix inside a device buffer: `rows` x `cols` elements, `stride` elements from one row to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

impl Matrix {
    /// A dense matrix (stride = cols).
    pub fn dense(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            stride: cols,
        }
    }

    /// The same rows and columns at another row stride (an output laid out like an input).
    pub fn with_stride(self, stride: usize) -> Matrix {
        Matrix { stride, ..self }
    }

    /// Bytes from the first element to one past the last one (0 for an empty matrix).
    pub(crate) fn span_bytes(&self) -> Option<usize> {
        if self.rows == 0 || self.cols == 0 {
            return Some(0);
        }
        (self.rows - 1)
            .checked_mul(self.stride)?
            .checked_add(self.cols)?
            .checked_mul(BF16)
    }
}

/// A device operand as the validation sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operand {
    pub(crate) addr: u64,
    pub(crate) bytes: usize,
}

impl Operand {
    pub(crate) fn of(view: &DeviceView<'_>) -> Operand {
        Operand {
            addr: view.addr(),
            bytes: view.len(),
        }
    }
    /// A raw span's address and extent.
    pub(crate) fn of_span(span: DeviceSpan) -> Operand {
        Operand {
            addr: span.addr,
            bytes: span.bytes,
        }
    }

    pub(crate) fn of_mut(view: &DeviceViewMut<'_>) -> Operand {
        Operand {
            addr: view.addr(),
            bytes: view.len(),
        }
    }
}

/// One kernel launch, validated and packed, not yet submitted.
///
/// A launch built by a `plan_*` function borrows, for `'a`, the device views whose addresses it packed (the
/// views the function checked), so none of their buffers can be freed before the launch is submitted; freeing
/// afterwards waits for the context (`DeviceBuffer`'s `Drop`). That is what makes [`LoadedSet`]'s safe `submit`
/// sound. Launches over raw [`tf_cuda::cublaslt::DeviceSpan`]s borrow nothing: they are marked raw and only an
/// `unsafe` submit takes them. The fields are read-only outside this crate, so a packed launch cannot be
/// pointed at another kernel or given other arguments.
#[derive(Debug)]
pub struct Launch<'a> {
    pub(crate) kernel: &'static str,
    pub(crate) config: LaunchConfig,
    pub(crate) args: Args,
    /// Built from raw device spans rather than borrowed views.
    raw: bool,
    views: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// A launch whose every address comes from a view the caller holds borrowed for `'a` (the `plan_*`
    /// functions: each takes its views as `&'a` and packs only their addresses).
    pub(crate) fn new(kernel: &'static str, config: LaunchConfig, args: Args) -> Launch<'a> {
        Launch {
            kernel,
            config,
            args,
            raw: false,
            views: PhantomData,
        }
    }

    /// A launch over raw device spans (no borrow): only `LoadedSet::submit_spans`, which is `unsafe`, takes it.
    pub(crate) fn from_spans(
        kernel: &'static str,
        config: LaunchConfig,
        args: Args,
    ) -> Launch<'static> {
        Launch {
            kernel,
            config,
            args,
            raw: true,
            views: PhantomData,
        }
    }

    /// The kernel's symbol.
    pub fn kernel(&self) -> &'static str {
        self.kernel
    }

    /// The launch geometry.
    pub fn config(&self) -> &LaunchConfig {
        &self.config
    }

    /// The packed arguments.
    pub fn args(&self) -> &Args {
        &self.args
    }

    /// True for a launch over raw device spans (see [`Launch`]).
    pub fn is_raw(&self) -> bool {
        self.raw
    }
}

/// A validation failure of operation `op`: [`tf_cuda::Error::Invalid`] naming it.
pub(crate) fn invalid(op: &str, what: impl std::fmt::Display) -> tf_cuda::Error {
    tf_cuda::Error::Invalid {
        what: format!("{op}: {what}"),
    }
}

/// A norm's epsilon must be finite and non-negative (a NaN or negative one gives NaN rows).
pub(crate) fn check_eps(op: &str, eps: f32) -> Result<(), tf_cuda::Error> {
    if eps.is_finite() && eps >= 0.0 {
        Ok(())
    } else {
        Err(invalid(op, format!("eps {eps} must be finite and >= 0")))
    }
}

/// `value` as the kernel's 32-bit int, or an error naming it.
pub(crate) fn to_i32(op: &str, name: &str, value: usize) -> Result<i32, tf_cuda::Error> {
    i32::try_from(value).map_err(|_| {
        invalid(
            op,
            format!("{name} = {value} does not fit the kernel's 32-bit int"),
        )
    })
}

/// `value` as a 64-bit int, or an error naming it.
pub(crate) fn to_i64(op: &str, name: &str, value: usize) -> Result<i64, tf_cuda::Error> {
    i64::try_from(value)
        .map_err(|_| invalid(op, format!("{name} = {value} does not fit a 64-bit int")))
}

/// `value` as a grid dimension, or an error naming it.
pub(crate) fn to_u32(op: &str, name: &str, value: usize) -> Result<u32, tf_cuda::Error> {
    u32::try_from(value).map_err(|_| {
        invalid(
            op,
            format!("{name} = {value} exceeds the launch grid limits"),
        )
    })
}

/// Checks a bf16 matrix operand: fits the view, 16-byte aligned address, cols and stride multiples of 8,
/// stride >= cols.
pub(crate) fn check_matrix(
    op: &str,
    name: &str,
    operand: Operand,
    m: Matrix,
) -> Result<(), tf_cuda::Error> {
    if m.stride < m.cols {
        return Err(invalid(
            op,
            format!(
                "{name}: row stride {} is less than its {} columns",
                m.stride, m.cols
            ),
        ));
    }
    if !m.cols.is_multiple_of(8) || !m.stride.is_multiple_of(8) {
        return Err(invalid(
            op,
            format!(
                "{name}: columns ({}) and row stride ({}) must be multiples of 8 elements (16-byte rows)",
                m.cols, m.stride
            ),
        ));
    }
    check_aligned(op, name, operand)?;
    let span = m
        .span_bytes()
        .ok_or_else(|| invalid(op, format!("{name}: {m:?} overflows the address space")))?;
    if span > operand.bytes {
        return Err(invalid(
            op,
            format!(
                "{name}: {} x {} bf16 with row stride {} needs {span} B but the view holds {} B",
                m.rows, m.cols, m.stride, operand.bytes
            ),
        ));
    }
    Ok(())
}

/// Refuses an operand whose device address is not 16-byte aligned.
pub(crate) fn check_aligned(op: &str, name: &str, operand: Operand) -> Result<(), tf_cuda::Error> {
    check_aligned_to(op, name, operand, 16)
}

/// Refuses an operand whose device address is not a multiple of `align` bytes.
pub(crate) fn check_aligned_to(
    op: &str,
    name: &str,
    operand: Operand,
    align: u64,
) -> Result<(), tf_cuda::Error> {
    if !operand.addr.is_multiple_of(align) {
        return Err(invalid(
            op,
            format!(
                "{name}: device address {:#x} is not {align}-byte aligned",
                operand.addr
            ),
        ));
    }
    Ok(())
}

/// Refuses an operand smaller than `needed` bytes.
pub(crate) fn check_bytes(
    op: &str,
    name: &str,
    operand: Operand,
    needed: usize,
) -> Result<(), tf_cuda::Error> {
    if needed > operand.bytes {
        return Err(invalid(
            op,
            format!(
                "{name}: needs {needed} B but the view holds {} B",
                operand.bytes
            ),
        ));
    }
    Ok(())
}

/// Refuses an operand smaller than `needed` bytes or not starting on an `align`-byte boundary.
pub(crate) fn check_operand(
    op: &str,
    name: &str,
    operand: Operand,
    needed: usize,
    align: u64,
) -> Result<(), tf_cuda::Error> {
    check_aligned_to(op, name, operand, align)?;
    check_bytes(op, name, operand, needed)
}

/// [`check_operand`] on a raw span.
pub(crate) fn check_span(
    op: &str,
    name: &str,
    span: DeviceSpan,
    needed: usize,
    align: u64,
) -> Result<(), tf_cuda::Error> {
    check_operand(op, name, Operand::of_span(span), needed, align)
}

/// The product of `factors` (an operand's size), or an error naming the operand when it overflows.
pub(crate) fn bytes_of(op: &str, name: &str, factors: &[usize]) -> Result<usize, tf_cuda::Error> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| invalid(op, format!("{name}: size {factors:?} overflows")))
}

/// Most blocks a grid-stride kernel is launched with.
pub(crate) const MAX_STRIDE_BLOCKS: usize = 65_535;

/// Blocks of `threads` for a grid-stride kernel over `work` items: one item a thread, at least one block and at
/// most [`MAX_STRIDE_BLOCKS`].
pub(crate) fn stride_grid(
    op: &str,
    work: usize,
    threads: u32,
) -> Result<LaunchConfig, tf_cuda::Error> {
    let blocks = work.div_ceil(threads as usize).clamp(1, MAX_STRIDE_BLOCKS);
    Ok(LaunchConfig::new(to_u32(op, "blocks", blocks)?, threads))
}

/// One block row per matrix row, one thread per 8 columns: the grid of the elementwise row kernels.
pub(crate) fn row_grid(op: &str, rows: usize, cols: usize) -> Result<LaunchConfig, tf_cuda::Error> {
    let chunks = cols.div_ceil(8).div_ceil(ROW_THREADS as usize).max(1);
    Ok(LaunchConfig::new(
        (
            to_u32(op, "rows", rows.max(1))?,
            to_u32(op, "column blocks", chunks)?,
        ),
        ROW_THREADS,
    ))
}

/// Why the kernels could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadKernelsError {
    /// The fatbin was not built into this binary.
    #[error("kernel set {set} is not available: {reason}")]
    Missing { set: &'static str, reason: String },
    /// The driver refused the image or a kernel is absent from it.
    #[error("loading kernel set {set}: {source}")]
    Cuda {
        set: &'static str,
        #[source]
        source: tf_cuda::Error,
    },
}

/// Refuses a GPU other than sm_90 for `set`, whose fatbin holds sm_90a code only (`what` names the kernels in the
/// message); returns the device's SM count.
pub(crate) fn require_sm90(
    ctx: &Context,
    set: &'static str,
    what: &str,
) -> Result<usize, LoadKernelsError> {
    let info = ctx.device_info().ok();
    let cc = info.as_ref().map(|i| i.compute_capability);
    if cc != Some((9, 0)) {
        return Err(LoadKernelsError::Missing {
            set,
            reason: format!("{what} is built for sm_90a only (this GPU: {cc:?})"),
        });
    }
    Ok(info.map_or(1, |i| usize::try_from(i.sm_count).unwrap_or(1)))
}

/// Loaded kernels of one or more kernel sets: their modules (which own the code the functions point into) and the
/// kernels looked up, so a launch names its kernel by symbol; and the kernels `keep` left out, which still belong
/// to these sets ([`LoadedSet::owns`]).
pub(crate) struct LoadedSet {
    sets: Vec<&'static str>,
    modules: Vec<Module>,
    functions: HashMap<&'static str, Function>,
    left_out: Vec<&'static str>,
}

impl std::fmt::Debug for LoadedSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedSet")
            .field("sets", &self.sets)
            .field("modules", &self.modules.len())
            .field("kernels", &self.functions.len())
            .field("left_out", &self.left_out)
            .finish()
    }
}

impl LoadedSet {
    /// Nothing loaded yet.
    pub(crate) fn empty() -> LoadedSet {
        LoadedSet {
            sets: Vec::new(),
            modules: Vec::new(),
            functions: HashMap::new(),
            left_out: Vec::new(),
        }
    }

    /// Loads the embedded set `set` into `ctx` and looks up each of `kernels`.
    pub(crate) fn load(
        ctx: &Context,
        set: &'static str,
        kernels: &[&'static str],
    ) -> Result<LoadedSet, LoadKernelsError> {
        let mut loaded = LoadedSet::empty();
        loaded.add(ctx, set, kernels, |_, _| Ok(true))?;
        Ok(loaded)
    }

    /// Loads the embedded set `set` into `ctx` as well and looks up each of `kernels`; `keep` prepares each
    /// function (e.g. opts it in to its shared memory) and says whether to keep it (a kernel left out fails at
    /// submit with a message naming it).
    pub(crate) fn add(
        &mut self,
        ctx: &Context,
        set: &'static str,
        kernels: &[&'static str],
        keep: impl Fn(&'static str, &Function) -> Result<bool, tf_cuda::Error>,
    ) -> Result<(), LoadKernelsError> {
        let image = crate::nn::kernels::image(set).map_err(|e| LoadKernelsError::Missing {
            set,
            reason: e.to_string(),
        })?;
        let cuda = |source| LoadKernelsError::Cuda { set, source };
        let module = Module::load(ctx, image).map_err(cuda)?;
        let mut found = Vec::with_capacity(kernels.len());
        for &name in kernels {
            let function = module.function(name).map_err(cuda)?;
            if keep(name, &function).map_err(cuda)? {
                found.push((name, function));
            } else {
                self.left_out.push(name);
            }
        }
        self.functions.extend(found);
        self.sets.push(set);
        self.modules.push(module);
        Ok(())
    }

    /// True when `kernel` is loaded.
    pub(crate) fn has(&self, kernel: &str) -> bool {
        self.functions.contains_key(kernel)
    }

    /// True when `kernel` is one of these sets' kernels, loaded or left out: a component holding several
    /// `LoadedSet`s submits a launch to the one that owns it, whose error then names the sets and why.
    pub(crate) fn owns(&self, kernel: &str) -> bool {
        self.has(kernel) || self.left_out.contains(&kernel)
    }

    fn function(&self, launch: &Launch<'_>) -> Result<&Function, tf_cuda::Error> {
        self.functions.get(launch.kernel).ok_or_else(|| {
            invalid(
                launch.kernel,
                format!(
                    "not loaded from the {} kernel set(s): its shared memory does not fit this GPU, it needs \
                     another GPU, or the sets are stale (run `cargo xtask kernels`)",
                    self.sets.join(", ")
                ),
            )
        })
    }

    /// Submits a launch of one of the loaded kernels built from borrowed views (a `plan_*` function over views).
    /// A launch over raw spans is refused: see [`LoadedSet::submit_spans`].
    pub(crate) fn submit(
        &self,
        stream: &Stream,
        launch: &Launch<'_>,
    ) -> Result<(), tf_cuda::Error> {
        if launch.raw {
            return Err(invalid(
                launch.kernel,
                "this launch addresses raw device spans; submit it through the component's unsafe submit",
            ));
        }
        let function = self.function(launch)?;
        // SAFETY: a launch that is not raw packs only addresses of device views its `plan_*` function took
        // borrowed for the launch's lifetime, so each points into a buffer alive now (the borrow outlives this
        // call); every view's extent was checked against what the kernel addresses; and a `DeviceBuffer` that is
        // freed later synchronizes its context first, so the queued kernel never sees it freed.
        unsafe { stream.launch(function, &launch.config, &launch.args) }
    }

    /// Submits a launch of one of the loaded kernels built from raw device spans.
    ///
    /// # Safety
    ///
    /// Every span the launch was planned over lies in device memory of `stream`'s context that is allocated now.
    /// Memory owned by a `DeviceBuffer` then stays valid for the queued work (its `Drop` synchronizes the context
    /// before freeing); any other memory must outlive the work on the stream.
    pub(crate) unsafe fn submit_spans(
        &self,
        stream: &Stream,
        launch: &Launch<'_>,
    ) -> Result<(), tf_cuda::Error> {
        let function = self.function(launch)?;
        // SAFETY: the plan checked each span's extent against what the kernel addresses; the caller guarantees the
        // spans are live allocations of the stream's context (this function's contract).
        unsafe { stream.launch(function, &launch.config, &launch.args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op(addr: u64, bytes: usize) -> Operand {
        Operand { addr, bytes }
    }

    #[test]
    fn matrix_checks_refuse_what_the_kernels_cannot_read() {
        let op = Operand {
            addr: 0x1000,
            bytes: 4 * 64 * 2,
        };
        assert!(check_matrix("t", "x", op, Matrix::dense(4, 64)).is_ok());
        let too_small = check_matrix("t", "x", op, Matrix::dense(5, 64))
            .unwrap_err()
            .to_string();
        assert!(too_small.contains("needs 640 B"), "{too_small}");
        assert!(check_matrix(
            "t",
            "x",
            op,
            Matrix {
                rows: 2,
                cols: 60,
                stride: 64
            }
        )
        .is_err());
        assert!(check_matrix(
            "t",
            "x",
            op,
            Matrix {
                rows: 2,
                cols: 64,
                stride: 32
            }
        )
        .is_err());
        let unaligned = Operand { addr: 0x1008, ..op };
        assert!(check_matrix("t", "x", unaligned, Matrix::dense(1, 8)).is_err());
        // A column slice of a wider buffer: the last row only needs its used columns.
        assert!(check_matrix(
            "t",
            "x",
            Operand {
                addr: 0x1000,
                bytes: (3 * 96 + 32) * 2
            },
            Matrix {
                rows: 4,
                cols: 32,
                stride: 96
            }
        )
        .is_ok());
    }

    #[test]
    fn matrix_check_accepts_column_slices_and_refuses_bad_layouts() {
        // The k columns of a fused q|k|v row: 4 rows of stride 96, 32 used columns, starting mid-buffer.
        let k = Matrix {
            rows: 4,
            cols: 32,
            stride: 96,
        };
        assert!(check_matrix("t", "k", op(0x1000, (3 * 96 + 32) * 2), k).is_ok());
        let short = check_matrix("t", "x", op(0x1000, 100), Matrix::dense(4, 16))
            .unwrap_err()
            .to_string();
        assert!(short.contains("needs 128 B"), "{short}");
        assert!(check_matrix("t", "x", op(0x1008, 4096), Matrix::dense(1, 8)).is_err());
        let ragged = Matrix {
            rows: 2,
            cols: 12,
            stride: 16,
        };
        assert!(check_matrix("t", "x", op(0x1000, 4096), ragged).is_err());
        let overlapping = Matrix {
            rows: 2,
            cols: 16,
            stride: 8,
        };
        assert!(check_matrix("t", "x", op(0x1000, 4096), overlapping).is_err());
        assert!(check_matrix("t", "x", op(0x1000, 0), Matrix::dense(0, 16)).is_ok());
    }

    #[test]
    fn row_grid_covers_every_column_chunk() {
        let g = row_grid("t", 7, 4096).unwrap();
        assert_eq!((g.grid.x, g.grid.y), (7, 2));
        assert_eq!(g.block.x, ROW_THREADS);
        let g = row_grid("t", 0, 8).unwrap();
        assert_eq!((g.grid.x, g.grid.y), (1, 1));
        let g = row_grid("t", 1, 2049 * 8).unwrap();
        assert_eq!(g.grid.y, 9);
        assert!(row_grid("t", usize::MAX, 8).is_err());
    }

    proptest! {
        /// A matrix is accepted exactly when its last used element lies inside the view.
        #[test]
        fn matrix_check_is_exact_about_the_span(rows in 1usize..20, cols8 in 1usize..8, extra8 in 0usize..4,
                                                slack in 0usize..64) {
            let (cols, stride) = (cols8 * 8, (cols8 + extra8) * 8);
            let needed = ((rows - 1) * stride + cols) * 2;
            let m = Matrix { rows, cols, stride };
            prop_assert!(check_matrix("t", "x", op(0x100, needed + slack), m).is_ok());
            prop_assert!(check_matrix("t", "x", op(0x100, needed - 1), m).is_err());
        }
    }
}
