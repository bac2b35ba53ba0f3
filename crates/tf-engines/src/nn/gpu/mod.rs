//! GPU launchers for the shared kernels (`kernels/nn/*.cu`, model-free names), each with its host twin in
//! [`crate::nn::host`].
//!
//! One safe function per kernel. Each takes device views, the shapes that describe them, and a stream;
//! it checks every shape, stride, size and alignment against the views *before* anything reaches the
//! driver, then launches asynchronously on the stream. Failures are [`tf_cuda::Error`]s: validation
//! problems are [`tf_cuda::Error::Invalid`] naming the operand and the fix.
//!
//! Conventions shared by all launchers:
//! - Activations are bf16 matrices in row-major order described by a [`Matrix`] (rows, cols, and the
//!   element stride between rows, so a launcher can read a column slice of a wider buffer such as the fused
//!   qkv GEMM output).
//! - Row kernels move 16 bytes at a time: device addresses must be 16-byte aligned and column counts and
//!   strides multiples of 8 elements.
//! - Attention uses the token-major layout `[batch][token][head * head_dim + d]` for q, k, v and o.
//!
//! Building a launch ([`Launch`], one `plan_*` function per kernel) is separate from submitting it, so the
//! validation and the argument packing are unit-tested without a GPU; [`NnKernels`] holds the loaded kernels of
//! every shared set and submits.
//!
//! Files: [`device`] (the context and the one blocking stream a pipeline's components borrow), [`launch`] (matrices, operands, checks, [`Launch`], loading), [`attention`], [`norm`], [`rope`],
//! [`act`] (SwiGLU, gelu, silu), [`copy`] (timestep embedding, embedding gather, copies, seeded fill), [`gemm`]
//! (the cuBLASLt GEMM wrapper, bf16 and FP8), [`conv`] (the implicit-GEMM 3x3 convolution), [`quant`] (the FP8 quantizing kernels, their own set),
//! [`graph_cache`] (captured step graphs), [`recent_set`] (the bounded per-shape workspaces of a DiT), [`spare_buffers`] (a dropped workspace's buffers kept for the next) and [`phases`] (device time per phase, for the benchmarks).
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: tf_cuda::DeviceView<'_>,
//! #         y: &mut tf_cuda::DeviceViewMut<'_>) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::nn::gpu::{Matrix, NnKernels};
//! let kernels = NnKernels::load(ctx)?;
//! let shape = Matrix::dense(16, 4096);
//! kernels.silu(stream, &x, y, shape.rows * shape.cols)?;
//! # Ok(()) }
//! ```

pub mod act;
pub mod attention;
pub mod attention_8bit;
pub mod conv;
pub mod copy;
pub mod device;
pub mod gemm;
pub mod gemm_int8;
pub mod graph_cache;
pub mod launch;
pub mod norm;
pub mod phases;
pub mod quant;
pub mod recent_set;
pub mod rope;
pub mod spare_buffers;

pub use act::*;
pub use attention::*;
pub use copy::*;
pub use device::GpuDevice;
pub(crate) use launch::{
    check_eps, check_matrix, invalid, row_grid, to_i32, to_u32, LoadedSet, Operand, ROW_THREADS,
};
pub use launch::{Launch, LoadKernelsError, Matrix};
pub use norm::*;
pub use rope::*;

use tf_cuda::{Context, Stream};

/// The kernels of the norm, RoPE, activation and copy sets, by name.
const SHARED_SETS: &[(&str, &[&str])] = &[
    (
        NORM_SET,
        &["nn_rms_norm", "nn_rms_norm_zc", "nn_norm_modulate"],
    ),
    (
        ROPE_SET,
        &[
            "nn_qk_norm_rope_interleaved",
            "nn_qk_norm_rope_half",
            "nn_rope_half_partial_d128_f32",
            "nn_rope_half_partial_d128_bf16",
            "nn_rope_half_partial_d64_f32",
            "nn_rope_half_partial_d64_bf16",
        ],
    ),
    (
        ACT_SET,
        &[
            "nn_swiglu",
            "nn_swiglu_value_gate",
            "nn_swiglu_apart",
            "nn_gelu_tanh",
            "nn_silu",
        ],
    ),
    (
        COPY_SET,
        &[
            "nn_timestep_embedding",
            "nn_embed_gather",
            "nn_copy_rows",
            "nn_transpose",
            "nn_fill_uniform",
        ],
    ),
];

/// The loaded shared kernel sets of one context, and the launchers (one `impl` block per concern file).
pub struct NnKernels {
    pub(crate) set: LoadedSet,
}

impl std::fmt::Debug for NnKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NnKernels").field("set", &self.set).finish()
    }
}

impl NnKernels {
    /// Loads every shared kernel set into `ctx`, looks every kernel up, and opts the attention kernels in to the
    /// shared memory they use. A tile shape that does not fit this GPU's shared memory, or needs sm_90a on
    /// another GPU, is left out (its launches then fail with a message naming it).
    pub fn load(ctx: &Context) -> Result<NnKernels, LoadKernelsError> {
        let mut set = LoadedSet::empty();
        for &(name, kernels) in SHARED_SETS {
            set.add(ctx, name, kernels, |_, _| Ok(true))?;
        }
        let sm90 = ctx
            .device_info()
            .map(|info| info.compute_capability == (9, 0))
            .unwrap_or(false);
        // Opts each tile in to its shared memory; leaves out what this GPU cannot run.
        let keep = |name: &'static str, function: &tf_cuda::Function| {
            let tiles = AttentionTile::ALL.iter().chain(&[AttentionTile::D64W8S2]);
            let Some(tile) = tiles.into_iter().find(|t| t.kernel() == name) else {
                return Ok(true);
            };
            if tile.needs_sm90() && !sm90 {
                return Ok(false);
            }
            Ok(function.set_max_dynamic_shared(tile.shared_bytes()).is_ok())
        };
        set.add(ctx, ATTENTION_SET, ATTENTION_KERNELS, keep)?;
        #[cfg(feature = "bench-kernels")]
        set.add(ctx, ATTENTION_BENCH_SET, ATTENTION_BENCH_KERNELS, keep)?;
        Ok(NnKernels { set })
    }

    /// Submits a launch built by one of the shared `plan_*` functions.
    pub fn submit(&self, stream: &Stream, launch: &Launch) -> Result<(), tf_cuda::Error> {
        self.set.submit(stream, launch)
    }
}

/// Test helpers: a context on the test driver (host memory stands in for the GPU) and buffers in it.
#[cfg(test)]
pub(crate) mod test_support {
    use std::sync::Arc;
    use tf_cuda::{Context, DeviceBuffer, Driver};
    use tf_testdriver::library_path;

    pub(crate) use super::launch::BF16;

    /// A context on the test driver: real views for the plans.
    pub(crate) fn context() -> Context {
        let driver = Arc::new(
            Driver::open_path(&library_path().expect("find the test driver")).expect("open it"),
        );
        Context::new(driver, 0).expect("context on device 0")
    }

    /// `bytes` of device memory on the test driver.
    pub(crate) fn buffer(ctx: &Context, bytes: usize) -> DeviceBuffer {
        DeviceBuffer::alloc(ctx, bytes).expect("allocate on the test driver")
    }
}
