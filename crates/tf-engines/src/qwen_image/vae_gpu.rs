//! The Qwen-Image 2.1 VAE decoder on the GPU: the same decode as [`super::vae::HostVaeDecoder`], channels-last
//! (NHWC) in bf16 with f32 accumulation, behind the same [`VaeBackend`](super::components::VaeBackend) interface.
//!
//! - Weights: one device allocation. Convolutions are GEMM matrices `[out_cp, taps * in_cp]` (tap-major, then
//!   channel), channel counts padded to multiples of 8 with zero rows and columns; biases bf16 (f32 for
//!   `conv_out`, whose GEMM writes f32); norm gammas f32, zero padded, so padding channels stay zero throughout.
//! - 3x3 convolutions: on sm_90, one implicit-GEMM launch each ([`crate::nn::gpu::conv`]: the input's taps are
//!   loaded from the map itself, no column matrix; on maps at least 128 wide one input row slice serves a stage's
//!   three horizontal taps), bias and residual in its epilogue. Elsewhere (another GPU, a map
//!   width the kernel does not tile, or `TF_VAE_CONV=im2col`): the `qwen_image_vae` kernels gather columns
//!   for a band of output rows (the nearest 2x upsample is folded into the gather), then one cuBLASLt GEMM per band
//!   writes the rows, bias in the epilogue. An implicit upsample conv reads a nearest-upsampled copy of its input
//!   (`qv_upsample2x` into a free activation buffer).
//!   Residuals are added by the GEMM itself (`beta = 1` on the output that already holds the shortcut), so a
//!   resnet's identity shortcut is updated in place and the DupUp shortcut is written before the upsample conv.
//! - Channel RMS norms (+ SiLU) run in f32 in one kernel; the mid attention is Q, K and Vᵀ GEMMs, f32 scores per
//!   chunk of query rows, a row softmax, and a probabilities x V GEMM (the V bias is added after the softmax:
//!   rows of probabilities sum to one).
//! - Memory: a [`BufferPlan`] per latent size: four activation buffers of the largest map, one column buffer
//!   bounded by [`GpuVaeBudget::cols_bytes`] and the attention scratch, allocated once and reused for every
//!   level and image of that size.
//!
//! Invariant: a decode enqueues everything on one stream and synchronizes once per image, before reading it.
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::qwen_image::components::VaeBackend;
//! use tf_engines::qwen_image::vae_gpu::GpuVaeDecoder;
//! use tf_engines::nn::tensor::Tensor;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let mut vae = GpuVaeDecoder::load(&ModelDir::open(Path::new("vae"))?)?;
//! let packed = Tensor::new(vec![1, 64 * 64, 64], vec![0f32; 64 * 64 * 64])?;
//! let image = vae.decode_packed(&packed, 64, 64)?; // [1, 4, 1024, 1024] in [-1, 1]
//! println!("resident: {} B", vae.resident_bytes());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;
#[cfg(feature = "bench")]
use std::sync::Mutex;

use tf_cuda::cublaslt::{AlgoSelection, DeviceSpan, OutputType};
use tf_cuda::{Context, DeviceBuffer, Stream};

use super::components::{DecodedPixels, VaeBackend};
use super::vae::{VaeConfig, VaeError};
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::conv::{plan_conv3x3_spans, Conv3x3Shape, ConvOutput};
use crate::nn::gpu::gemm::{self, GemmError, GemmRunner, Linear};
use crate::nn::gpu::gemm_int8::Int8GemmKernels;
#[cfg(feature = "bench")]
use crate::nn::gpu::phases::{PhaseTimer, PhaseTimes};
use crate::nn::gpu::LoadKernelsError;
use crate::nn::gpu::{GpuDevice, Launch};
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::upload::{upload_pieces, StagingConfig};
use crate::nn::weights::{le_bytes, ModelDir, BF16};
use crate::qwen_image::vae_ops::{
    padded_channels, plan_denormalize, plan_dup_up, plan_im2col3x3, plan_image_out,
    plan_rms_norm_silu, plan_softmax_rows, plan_upsample2x, DupUpShape, Im2colBand, ImageOut,
    VaeKernels,
};

mod load;
mod plan;

use load::{ConvW, Loader, Net, NormW, Packer, ResnetW};
use plan::implicit_tile;
pub use plan::{BufferPlan, ConvPath, GpuVaeBudget, CONV_ENV};

const F32: usize = 4;
/// Activation buffers in the pool: a resnet's input, its two temporaries, and a held shortcut.
const POOL: usize = 4;

/// A failure of the GPU path (driver, cuBLASLt, kernels), as a [`VaeError`].
fn backend(what: &str, why: impl IntoGpuError) -> VaeError {
    VaeError::Gpu(gpu_error(format!("GPU decode: {what}"), why))
}

/// The device buffers of one latent size.
struct Workspace {
    plan: BufferPlan,
    pool: Vec<DeviceBuffer>,
    cols: DeviceBuffer,
    /// Q, K, Vᵀ and the attention output, each `tokens x attention_cp`.
    attention: [DeviceBuffer; 4],
    scores: DeviceBuffer,
    probs: DeviceBuffer,
    packed: DeviceBuffer,
    result: DeviceBuffer,
    image: DeviceBuffer,
}

impl Workspace {
    fn new(ctx: &Context, plan: BufferPlan) -> Result<Workspace, VaeError> {
        let alloc = |what: &str, bytes: usize| {
            DeviceBuffer::alloc(ctx, bytes.max(16)).map_err(|e| {
                backend(
                    &format!(
                        "allocating {bytes} B for the {what} of a {} x {} latent",
                        plan.latent_h, plan.latent_w
                    ),
                    e,
                )
            })
        };
        let act = plan.pool_elems * BF16;
        let attn = plan.tokens * plan.attention_cp * BF16;
        let mut pool = Vec::with_capacity(POOL);
        for _ in 0..POOL {
            pool.push(alloc("activations", act)?);
        }
        Ok(Workspace {
            plan,
            pool,
            cols: alloc("conv columns", plan.cols_elems * BF16)?,
            attention: [
                alloc("attention q", attn)?,
                alloc("attention k", attn)?,
                alloc("attention v", attn)?,
                alloc("attention output", attn)?,
            ],
            scores: alloc("attention scores", plan.score_rows * plan.tokens * F32)?,
            probs: alloc(
                "attention probabilities",
                plan.score_rows * plan.tokens * BF16,
            )?,
            packed: alloc("packed latents", plan.tokens * plan.z * F32)?,
            result: alloc("conv_out result", plan.out_pixels * plan.out_cp * F32)?,
            image: alloc(
                "image and its pixels",
                plan.out_pixels * plan.out_channels * (F32 + 1),
            )?,
        })
    }

    /// Pool buffer `index` as a `pixels x cp` bf16 map.
    fn act(&self, index: usize, pixels: usize, cp: usize) -> Result<DeviceSpan, VaeError> {
        let buf = self
            .pool
            .get(index)
            .ok_or_else(|| backend("internal", format!("no activation buffer {index}")))?;
        span(buf, 0, pixels * cp * BF16)
    }
}

/// `bytes` at `offset` of `buf` as a GEMM or kernel operand, checked.
fn span(buf: &DeviceBuffer, offset: usize, bytes: usize) -> Result<DeviceSpan, VaeError> {
    Ok(gemm::span(buf, offset, bytes)?)
}

impl From<GemmError> for VaeError {
    fn from(e: GemmError) -> VaeError {
        backend("GEMM", e)
    }
}

/// The first pool index not in `taken`.
fn free_index(taken: &[usize]) -> Result<usize, VaeError> {
    (0..POOL)
        .find(|i| !taken.contains(i))
        .ok_or_else(|| backend("internal", "every activation buffer is in use"))
}

/// What one GPU decode brought back.
struct Decoded {
    images: Option<TensorF32>,
    pixels: Option<Vec<u8>>,
}

/// The implicit-GEMM conv kernels when the GPU runs them (sm_90), else `None`.
fn load_implicit_convs(ctx: &Context) -> Result<Option<Int8GemmKernels>, VaeError> {
    match Int8GemmKernels::load(ctx) {
        Ok(k) => Ok(Some(k)),
        // Not sm_90 (or not built): the im2col path serves every conv.
        Err(LoadKernelsError::Missing { .. }) => Ok(None),
        Err(e) => Err(backend("loading the implicit-GEMM conv kernels", e)),
    }
}

/// The phase a 3x3 conv at output width `out_w` is timed in, by its path and its scale against the image width
/// `image_w` (the column path's GEMMs keep every scale from 1/8 down in one phase).
fn conv3x3_phase(out_w: usize, image_w: usize, implicit: bool) -> &'static str {
    const IMPLICIT: [&str; 5] = [
        "conv3x3 implicit GEMM, full size",
        "conv3x3 implicit GEMM, 1/2 size",
        "conv3x3 implicit GEMM, 1/4 size",
        "conv3x3 implicit GEMM, 1/8 size",
        "conv3x3 implicit GEMM, 1/16 size",
    ];
    const COLUMNS: [&str; 5] = [
        "conv3x3 GEMM, full size",
        "conv3x3 GEMM, 1/2 size",
        "conv3x3 GEMM, 1/4 size",
        "conv3x3 GEMM, 1/8 size",
        "conv3x3 GEMM, 1/8 size",
    ];
    let scale = match image_w.checked_div(out_w) {
        Some(1) => 0,
        Some(2) => 1,
        Some(4) => 2,
        Some(8) => 3,
        _ => 4,
    };
    if implicit {
        IMPLICIT[scale]
    } else {
        COLUMNS[scale]
    }
}

/// The VAE decoder on the GPU.
pub struct GpuVaeDecoder {
    config: VaeConfig,
    ctx: Context,
    /// The pipeline's stream, shared by its components.
    stream: Arc<Stream>,
    kernels: VaeKernels,
    gemms: GemmRunner,
    /// The implicit-GEMM 3x3 convolutions (sm_90 only), and the path asked for ([`CONV_ENV`]).
    convs: Option<Int8GemmKernels>,
    conv_path: ConvPath,
    weights: DeviceBuffer,
    net: Net,
    budget: GpuVaeBudget,
    workspace: Option<Workspace>,
    /// Set only while `time_phases` (the `bench` feature) runs: an event after each launch.
    #[cfg(feature = "bench")]
    phase_timer: Mutex<Option<PhaseTimer>>,
}

impl std::fmt::Debug for GpuVaeDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuVaeDecoder")
            .field("config", &self.config)
            .field("weight_bytes", &self.weights.len())
            .field("workspace", &self.workspace.as_ref().map(|w| w.plan))
            .finish_non_exhaustive()
    }
}

impl Drop for GpuVaeDecoder {
    fn drop(&mut self) {
        // Work still queued (after an error mid-decode) must not outlive the buffers it reads. On a lost context
        // this fails fast without calling the driver (tf-cuda checks its health first), and the buffers leak.
        let _ = self.stream.synchronize();
    }
}

impl GpuVaeDecoder {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuVaeDecoder, VaeError> {
        let driver = tf_cuda::open_driver().map_err(|e| backend("opening the CUDA driver", e))?;
        let ctx =
            Context::new(driver, 0).map_err(|e| backend("creating a context on device 0", e))?;
        GpuVaeDecoder::load_on(&ctx, model)
    }

    /// [`GpuVaeDecoder::load_in`] on a blocking stream of its own in `ctx`.
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuVaeDecoder, VaeError> {
        let device = GpuDevice::on(ctx).map_err(|e| backend("creating a stream", e))?;
        GpuVaeDecoder::load_in(&device, model)
    }

    /// Loads the decoder weights of a diffusers VAE folder onto `device` (checking every shape against the
    /// config), the `qwen_image_vae` kernels and cuBLASLt; every decode runs on the device's stream.
    pub fn load_in(device: &GpuDevice, model: &ModelDir) -> Result<GpuVaeDecoder, VaeError> {
        let ctx = device.context();
        let config = VaeConfig::from_json(model.config_json())?;
        let mut loader = Loader {
            model,
            packer: Packer::new(),
        };
        let net = loader.net(&config)?;
        let packer = loader.packer;
        let stream = Arc::clone(device.stream());
        let kernels = VaeKernels::load(ctx).map_err(|e| backend("loading kernels", e))?;
        let gemms = GemmRunner::new(ctx, AlgoSelection::Heuristic)
            .map_err(|e| backend("loading cuBLASLt", e))?;
        let conv_path = ConvPath::parse(std::env::var(CONV_ENV).ok().as_deref())?;
        let convs = load_implicit_convs(ctx)?;
        let total = packer.bytes();
        let mut weights = DeviceBuffer::alloc(ctx, total)
            .map_err(|e| backend(&format!("allocating {total} B of weights"), e))?;
        // The alignment gaps between tensors read as zeros.
        weights
            .fill_u8(0, Some(&stream))
            .map_err(|e| backend("clearing the weights", e))?;
        upload_pieces(
            ctx,
            &stream,
            &mut weights,
            &packer.pieces(),
            StagingConfig::default(),
        )
        .map_err(|e| backend(&format!("uploading {total} B of weights"), e))?;
        Ok(GpuVaeDecoder {
            config,
            ctx: ctx.clone(),
            stream,
            kernels,
            gemms,
            convs,
            conv_path,
            weights,
            net,
            budget: GpuVaeBudget::default(),
            workspace: None,
            #[cfg(feature = "bench")]
            phase_timer: Mutex::new(None),
        })
    }

    /// Sets how the 3x3 convolutions run (the default comes from [`CONV_ENV`]); returns whether the implicit GEMMs
    /// now run (never on a GPU without them: there every path is im2col).
    pub fn set_conv_path(&mut self, path: ConvPath) -> bool {
        self.conv_path = path;
        self.uses_implicit_convs()
    }

    /// Whether the 3x3 convolutions run as implicit GEMMs.
    pub fn uses_implicit_convs(&self) -> bool {
        self.implicit_path().is_some()
    }

    /// The parsed config.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// Sets the scratch limits; the next decode re-plans its buffers.
    pub fn set_budget(&mut self, budget: GpuVaeBudget) {
        self.budget = budget;
        // Nothing queued may still use the buffers (a failure here means the context is gone, and the
        // buffers with it).
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        self.weights.len()
    }

    /// The buffer plan of the latent size decoded last, if any.
    pub fn buffer_plan(&self) -> Option<BufferPlan> {
        self.workspace.as_ref().map(|w| w.plan)
    }

    /// Device bytes held now: weights, the workspace of the last latent size, the cuBLASLt workspace.
    pub fn resident_bytes(&self) -> usize {
        self.weights.len()
            + self.workspace.as_ref().map_or(0, |w| w.plan.bytes())
            + self.gemms.workspace_bytes()
    }

    /// Frees the workspace (the weights stay).
    pub fn release_workspace(&mut self) {
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// Decodes packed latents `[batch, h * w, z]`; see [`VaeBackend::decode_packed`](super::components::VaeBackend::decode_packed).
    pub fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        self.decode(packed, h, w, true, false)?
            .images
            .ok_or_else(|| backend("internal", "the decode kept no images"))
    }

    fn decode(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
        images: bool,
        pixels: bool,
    ) -> Result<Decoded, VaeError> {
        let z = self.config.z_dim;
        let [batch, tokens, channels] = packed.dims::<3>("packed latents")?;
        if batch == 0 || h == 0 || w == 0 || h.checked_mul(w) != Some(tokens) || channels != z {
            return Err(VaeError::Input(format!(
                "packed latents are [{batch}, {tokens}, {channels}]; expected [batch >= 1, h * w, {z}] for a non-empty \
                 {h} x {w} latent"
            )));
        }
        let reuse = self.workspace.as_ref().is_some_and(|ws| {
            ws.plan.latent_h == h
                && ws.plan.latent_w == w
                && ws.plan.implicit == self.implicit_path()
        });
        if !reuse {
            // Work of a failed decode may still read the old buffers.
            self.stream
                .synchronize()
                .map_err(|e| backend("waiting before re-planning the workspace", e))?;
            self.workspace = None;
            let plan = BufferPlan::new(&self.config, h, w, self.budget, self.implicit_path())?;
            self.workspace = Some(Workspace::new(&self.ctx, plan)?);
        }
        let mut ws = self
            .workspace
            .take()
            .ok_or_else(|| backend("internal", "no workspace"))?;
        let result = self.decode_batch(&mut ws, packed, batch, images, pixels);
        self.workspace = Some(ws);
        result
    }

    /// (The `bench` feature.) Device time of each phase of one decode of `packed` (after an untimed decode that plans the workspace and
    /// the GEMMs): an event after every launch, summed per kernel and per GEMM kind (the 3x3 conv GEMMs per scale).
    /// The events add a little time; the decode itself is the normal one.
    #[cfg(feature = "bench")]
    pub fn time_phases(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<PhaseTimes, VaeError> {
        self.decode_packed(packed, h, w)?;
        let timer = PhaseTimer::begin(&self.ctx, &self.stream)
            .map_err(|e| backend("recording a phase event", e))?;
        self.set_phase_timer(Some(timer))?;
        let decoded = self.decode_packed(packed, h, w);
        let timer = self.set_phase_timer(None)?;
        decoded?;
        let timer = timer.ok_or_else(|| backend("phase timer", "it was gone after the decode"))?;
        timer
            .totals()
            .map_err(|e| backend("reading the phase events", e))
    }

    /// Replaces the phase timer, returning the previous one.
    #[cfg(feature = "bench")]
    fn set_phase_timer(&self, timer: Option<PhaseTimer>) -> Result<Option<PhaseTimer>, VaeError> {
        let mut slot = self
            .phase_timer
            .lock()
            .map_err(|_| backend("phase timer", "a panic left it poisoned"))?;
        Ok(std::mem::replace(&mut *slot, timer))
    }

    /// Decodes every image of `packed`, downloading the f32 images when `images` and the first image's 8-bit
    /// pixels when `pixels`.
    fn decode_batch(
        &self,
        ws: &mut Workspace,
        packed: &TensorF32,
        batch: usize,
        images: bool,
        pixels: bool,
    ) -> Result<Decoded, VaeError> {
        let plan = ws.plan;
        let per_image = plan.out_pixels * plan.out_channels;
        let result = span(&ws.result, 0, plan.out_pixels * plan.out_cp * F32)?;
        let planes = span(&ws.image, 0, per_image * F32)?;
        let bytes = span(&ws.image, per_image * F32, per_image)?;
        // The first image's download becomes the output as it is (the usual batch of one copies nothing more).
        let mut out: Vec<f32> = Vec::new();
        let mut out_pixels = None;
        let f = self.config.spatial_factor();
        for (index, src) in packed
            .data()
            .chunks_exact(plan.tokens * plan.z)
            .take(batch)
            .enumerate()
        {
            // On the decode's stream, so the copy is ordered before the kernels that read it.
            ws.packed
                .upload_async(0, &le_bytes(src, f32::to_le_bytes), &self.stream)
                .map_err(|e| backend("uploading latents", e))?;
            self.enqueue_image(ws)?;
            let first_pixels = pixels && index == 0;
            for (wanted, kind, out) in [
                (images, ImageOut::Planes, planes),
                (first_pixels, ImageOut::Pixels, bytes),
            ] {
                if wanted {
                    let dims = (plan.out_pixels, plan.out_channels, plan.out_cp);
                    self.submit(plan_image_out(kind, result, dims, out))?;
                }
            }
            self.stream
                .synchronize()
                .map_err(|e| backend("running the decode", e))?;
            if first_pixels {
                let mut px = vec![0u8; per_image];
                ws.image
                    .download(per_image * F32, &mut px)
                    .map_err(|e| backend("downloading the pixels", e))?;
                out_pixels = Some(px);
            }
            if !images {
                continue;
            }
            // Straight into f32 values: no byte copy and no second conversion pass over the image.
            let image: Vec<f32> = ws
                .image
                .slice(0, per_image * F32)
                .and_then(|view| view.to_vec())
                .map_err(|e| backend("downloading the image", e))?;
            if out.is_empty() {
                out = image;
                let rest = batch.saturating_sub(1).saturating_mul(per_image);
                out.try_reserve_exact(rest)
                    .map_err(|e| backend("holding the decoded images", e.to_string()))?;
            } else {
                out.extend_from_slice(&image);
            }
        }
        let images = if images {
            Some(Tensor::new(
                vec![
                    batch,
                    plan.out_channels,
                    plan.latent_h * f,
                    plan.latent_w * f,
                ],
                out,
            )?)
        } else {
            None
        };
        Ok(Decoded {
            images,
            pixels: out_pixels,
        })
    }

    fn weight(&self, offset: usize, bytes: usize) -> Result<DeviceSpan, VaeError> {
        span(&self.weights, offset, bytes)
    }

    fn submit(&self, launch: Result<Launch<'_>, tf_cuda::Error>) -> Result<(), VaeError> {
        let launch = launch.map_err(|e| backend("planning a kernel", e))?;
        // SAFETY: every span a VAE kernel is planned over lies inside a live buffer of this decoder (weights) or
        // of the workspace in use, all in the stream's context; their Drop synchronizes the context before freeing.
        unsafe { self.kernels.submit(&self.stream, &launch) }
            .map_err(|e| backend(launch.kernel, e))?;
        self.mark(launch.kernel, 0.0)
    }

    /// Enqueues `call`, timed as `phase` by `time_phases` (the `bench` feature).
    fn gemm(&self, phase: &'static str, call: Linear) -> Result<(), VaeError> {
        // SAFETY: every span lies inside a live buffer of this decoder (weights) or of the workspace in use
        // (checked by `span`); both outlive the work: the decode synchronizes the stream before returning and
        // before the workspace can be replaced or dropped, and Drop synchronizes first.
        unsafe { self.gemms.run(&call, &self.stream) }?;
        let flops = 2.0 * call.m as f64 * call.n as f64 * call.k as f64;
        self.mark(phase, flops)
    }

    /// Ends the phase `phase` when a phase timer runs (an event on the stream); nothing otherwise.
    #[cfg(feature = "bench")]
    fn mark(&self, phase: &'static str, flops: f64) -> Result<(), VaeError> {
        let mut timer = self
            .phase_timer
            .lock()
            .map_err(|_| backend("phase timer", "a panic left it poisoned"))?;
        if let Some(timer) = timer.as_mut() {
            timer
                .mark(&self.stream, phase, flops, 0.0)
                .map_err(|e| backend("recording a phase event", e))?;
        }
        Ok(())
    }

    /// Without the `bench` feature nothing is timed.
    #[cfg(not(feature = "bench"))]
    #[inline(always)]
    fn mark(&self, _phase: &'static str, _flops: f64) -> Result<(), VaeError> {
        Ok(())
    }

    /// `y = conv(x) + bias (+ y when accumulate)` for a 1x1 conv over `pixels`.
    fn conv1x1(
        &self,
        conv: &ConvW,
        x: DeviceSpan,
        pixels: usize,
        y: DeviceSpan,
        accumulate: bool,
    ) -> Result<(), VaeError> {
        self.gemm(
            "conv1x1 GEMM",
            Linear {
                m: pixels,
                n: conv.out_cp,
                k: conv.k(),
                x,
                w: self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?,
                y,
                bias: Some(self.weight(conv.bias, conv.out_cp * BF16)?),
                alpha: 1.0,
                beta: if accumulate { 1.0 } else { 0.0 },
                output: OutputType::Bf16,
            },
        )
    }

    /// The conv path the implicit GEMMs run on, or `None` where every conv goes through columns (another GPU, or
    /// [`ConvPath::Im2col`]).
    fn implicit_path(&self) -> Option<ConvPath> {
        self.convs
            .as_ref()
            .map(|_| self.conv_path)
            .filter(|p| *p != ConvPath::Im2col)
    }

    /// A 3x3 conv writing an `out_h` x `out_w` map into `y` (bf16, or f32 with `f32_out`), band by band.
    #[allow(clippy::too_many_arguments)]
    fn conv3x3(
        &self,
        ws: &Workspace,
        conv: &ConvW,
        x: DeviceSpan,
        (out_h, out_w): (usize, usize),
        upsample: bool,
        y: DeviceSpan,
        accumulate: bool,
        f32_out: bool,
    ) -> Result<(), VaeError> {
        let image_w = ws.plan.latent_w * self.config.spatial_factor();
        let shape = Conv3x3Shape {
            h: out_h,
            w: out_w,
            cin: conv.in_cp,
            n: conv.out_cp,
        };
        let implicit = implicit_tile(self.implicit_path(), shape);
        if let (Some(convs), Some(tile), false) = (&self.convs, implicit, upsample) {
            let (output, out_size) = if f32_out {
                (ConvOutput::F32, F32)
            } else {
                (ConvOutput::Bf16, BF16)
            };
            let operands = (
                x,
                self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?,
                self.weight(conv.bias, conv.out_cp * out_size)?,
            );
            let launch = plan_conv3x3_spans(
                &self.ctx,
                convs.sm_count(),
                (shape, tile),
                operands,
                (y, output),
                accumulate,
            )
            .map_err(|e| backend("planning an implicit-GEMM conv", e))?;
            // SAFETY: x, y and the weights lie inside live buffers of this decoder or of the workspace in use
            // (checked by `span`), in the stream's context; the decode synchronizes before they can be
            // replaced or dropped, and Drop synchronizes first. x and y are different buffers.
            unsafe { convs.submit_spans(&self.stream, &launch) }
                .map_err(|e| backend(launch.kernel, e))?;
            let flops = 2.0 * (out_h * out_w) as f64 * conv.out_cp as f64 * conv.k() as f64;
            return self.mark(conv3x3_phase(out_w, image_w, true), flops);
        }
        let out_size = if f32_out { F32 } else { BF16 };
        let band_rows = ws.plan.band_rows(out_h, out_w, conv.in_cp);
        let w = self.weight(conv.weight, conv.out_cp * conv.k() * BF16)?;
        let bias = self.weight(conv.bias, conv.out_cp * out_size)?;
        let mut row0 = 0;
        while row0 < out_h {
            let rows = band_rows.min(out_h - row0);
            let band = Im2colBand {
                out_h,
                out_w,
                cp: conv.in_cp,
                upsample,
                row0,
                rows,
            };
            let m = rows * out_w;
            let cols = span(&ws.cols, 0, m * conv.k() * BF16)?;
            self.submit(plan_im2col3x3(x, band, cols))?;
            let row_bytes = out_w * conv.out_cp * out_size;
            let y_band = gemm::sub_span(y, row0 * row_bytes, rows * row_bytes)?;
            self.gemm(
                conv3x3_phase(out_w, image_w, false),
                Linear {
                    m,
                    n: conv.out_cp,
                    k: conv.k(),
                    x: cols,
                    w,
                    y: y_band,
                    bias: Some(bias),
                    alpha: 1.0,
                    beta: if accumulate { 1.0 } else { 0.0 },
                    output: if f32_out {
                        OutputType::F32
                    } else {
                        OutputType::Bf16
                    },
                },
            )?;
            row0 += rows;
        }
        Ok(())
    }

    fn norm(
        &self,
        norm: &NormW,
        x: DeviceSpan,
        y: DeviceSpan,
        pixels: usize,
        silu: bool,
    ) -> Result<(), VaeError> {
        let gamma = self.weight(norm.gamma, norm.cp * F32)?;
        self.submit(plan_rms_norm_silu(
            x,
            y,
            gamma,
            pixels,
            norm.channels,
            norm.cp,
            silu,
        ))
    }

    /// One resnet on pool buffer `x` (never touching `held`); returns the buffer holding its output.
    fn resnet(
        &self,
        ws: &Workspace,
        r: &ResnetW,
        x: usize,
        held: Option<usize>,
        (h, w): (usize, usize),
    ) -> Result<usize, VaeError> {
        let pixels = h * w;
        let mut taken = vec![x];
        taken.extend(held);
        let b = free_index(&taken)?;
        taken.push(b);
        let c = free_index(&taken)?;
        let (in_cp, out_cp) = (r.conv1.in_cp, r.conv1.out_cp);
        let xs = ws.act(x, pixels, in_cp)?;
        let bs_in = ws.act(b, pixels, in_cp)?;
        let cs = ws.act(c, pixels, out_cp)?;
        self.norm(&r.norm1, xs, bs_in, pixels, true)?;
        self.conv3x3(ws, &r.conv1, bs_in, (h, w), false, cs, false, false)?;
        self.norm(&r.norm2, cs, cs, pixels, true)?;
        match &r.shortcut {
            Some(sc) => {
                let bs = ws.act(b, pixels, out_cp)?;
                self.conv1x1(sc, xs, pixels, bs, false)?;
                self.conv3x3(ws, &r.conv2, cs, (h, w), false, bs, true, false)?;
                Ok(b)
            }
            None => {
                self.conv3x3(ws, &r.conv2, cs, (h, w), false, xs, true, false)?;
                Ok(x)
            }
        }
    }

    /// The mid block's single-head attention, residual added in place into pool buffer `x`.
    fn attention(&self, ws: &Workspace, x: usize) -> Result<(), VaeError> {
        let a = &self.net.attention;
        let plan = ws.plan;
        let (p, cp) = (plan.tokens, a.norm.cp);
        let xs = ws.act(x, p, cp)?;
        let n = free_index(&[x])?;
        let ns = ws.act(n, p, cp)?;
        self.norm(&a.norm, xs, ns, p, false)?;
        let bytes = p * cp * BF16;
        let [q, k, vt, o] = &ws.attention;
        let (q, k, vt, o) = (
            span(q, 0, bytes)?,
            span(k, 0, bytes)?,
            span(vt, 0, bytes)?,
            span(o, 0, bytes)?,
        );
        self.conv1x1(&a.q, ns, p, q, false)?;
        self.conv1x1(&a.k, ns, p, k, false)?;
        // Vᵀ [cp, p] = Wv . normedᵀ; its bias is added to the output (probability rows sum to one).
        self.gemm(
            "attention GEMM",
            Linear {
                m: cp,
                n: p,
                k: cp,
                x: self.weight(a.v.weight, cp * cp * BF16)?,
                w: ns,
                y: vt,
                bias: None,
                alpha: 1.0,
                beta: 0.0,
                output: OutputType::Bf16,
            },
        )?;
        let scale = 1.0 / (a.norm.channels as f32).sqrt();
        let v_bias = self.weight(a.v.bias, cp * BF16)?;
        let mut row0 = 0;
        while row0 < p {
            let rows = plan.score_rows.min(p - row0);
            let scores = span(&ws.scores, 0, rows * p * F32)?;
            let probs = span(&ws.probs, 0, rows * p * BF16)?;
            let q_rows = gemm::sub_span(q, row0 * cp * BF16, rows * cp * BF16)?;
            self.gemm(
                "attention GEMM",
                Linear {
                    m: rows,
                    n: p,
                    k: cp,
                    x: q_rows,
                    w: k,
                    y: scores,
                    bias: None,
                    alpha: scale,
                    beta: 0.0,
                    output: OutputType::F32,
                },
            )?;
            self.submit(plan_softmax_rows(scores, rows, p, probs))?;
            let o_rows = gemm::sub_span(o, row0 * cp * BF16, rows * cp * BF16)?;
            self.gemm(
                "attention GEMM",
                Linear {
                    m: rows,
                    n: cp,
                    k: p,
                    x: probs,
                    w: vt,
                    y: o_rows,
                    bias: Some(v_bias),
                    alpha: 1.0,
                    beta: 0.0,
                    output: OutputType::Bf16,
                },
            )?;
            row0 += rows;
        }
        self.conv1x1(&a.proj, o, p, xs, true)
    }

    /// Enqueues the decode of the latents in `ws.packed` into `ws.image`.
    fn enqueue_image(&self, ws: &Workspace) -> Result<(), VaeError> {
        let net = &self.net;
        let plan = ws.plan;
        let (mut h, mut w) = (plan.latent_h, plan.latent_w);
        let p0 = h * w;
        let zp = net.post_quant.in_cp;
        let z = plan.z;
        self.submit(plan_denormalize(
            span(&ws.packed, 0, p0 * z * F32)?,
            p0,
            z,
            self.weight(net.mean, z * F32)?,
            self.weight(net.std, z * F32)?,
            ws.act(1, p0, zp)?,
            zp,
        ))?;
        self.conv1x1(
            &net.post_quant,
            ws.act(1, p0, zp)?,
            p0,
            ws.act(2, p0, zp)?,
            false,
        )?;
        let mid_cp = net.conv_in.out_cp;
        self.conv3x3(
            ws,
            &net.conv_in,
            ws.act(2, p0, zp)?,
            (h, w),
            false,
            ws.act(0, p0, mid_cp)?,
            false,
            false,
        )?;
        let mut x = self.resnet(ws, &net.mid[0], 0, None, (h, w))?;
        self.attention(ws, x)?;
        x = self.resnet(ws, &net.mid[1], x, None, (h, w))?;
        for block in &net.blocks {
            // The DupUp shortcut is written first into the buffer the upsample conv then adds to.
            let held = match block.upsample {
                Some((_, in_c, out_c, factor_t)) => {
                    let d = free_index(&[x])?;
                    let shape = DupUpShape {
                        h,
                        w,
                        in_c,
                        out_c,
                        factor_t,
                    };
                    let pixels = h * w;
                    self.submit(plan_dup_up(
                        ws.act(x, pixels, padded_channels(in_c))?,
                        shape,
                        ws.act(d, 4 * pixels, padded_channels(out_c))?,
                    ))?;
                    Some(d)
                }
                None => None,
            };
            for r in &block.resnets {
                x = self.resnet(ws, r, x, held, (h, w))?;
            }
            if let (Some((conv, ..)), Some(d)) = (&block.upsample, held) {
                let src = ws.act(x, h * w, conv.in_cp)?;
                let (src_h, src_w) = (h, w);
                h *= 2;
                w *= 2;
                let dst = ws.act(d, h * w, conv.out_cp)?;
                let implicit_shape = Conv3x3Shape {
                    h,
                    w,
                    cin: conv.in_cp,
                    n: conv.out_cp,
                };
                if implicit_tile(self.implicit_path(), implicit_shape).is_some() {
                    // The implicit GEMM reads the upsampled map itself: 4x the input, not 9x 4x of columns.
                    let up = ws.act(free_index(&[x, d])?, h * w, conv.in_cp)?;
                    self.submit(plan_upsample2x(src, (src_h, src_w, conv.in_cp), up))?;
                    self.conv3x3(ws, conv, up, (h, w), false, dst, true, false)?;
                } else {
                    self.conv3x3(ws, conv, src, (h, w), true, dst, true, false)?;
                }
                x = d;
            }
        }
        let pixels = h * w;
        let cp = net.norm_out.cp;
        let n = free_index(&[x])?;
        self.norm(
            &net.norm_out,
            ws.act(x, pixels, cp)?,
            ws.act(n, pixels, cp)?,
            pixels,
            true,
        )?;
        let result = span(&ws.result, 0, pixels * plan.out_cp * F32)?;
        self.conv3x3(
            ws,
            &net.conv_out,
            ws.act(n, pixels, cp)?,
            (h, w),
            false,
            result,
            false,
            true,
        )
    }
}

/// The GPU decoder makes the 8-bit pixels on the device (the bytes [`super::vae::to_u8_hwc`] gives, a quarter
/// of the f32 image's download) and brings the f32 images back only when asked.
impl VaeBackend for GpuVaeDecoder {
    fn config(&self) -> &VaeConfig {
        GpuVaeDecoder::config(self)
    }

    fn decode_packed(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
    ) -> Result<TensorF32, VaeError> {
        GpuVaeDecoder::decode_packed(self, packed, h, w)
    }

    fn decode_packed_pixels(
        &mut self,
        packed: &TensorF32,
        h: usize,
        w: usize,
        keep_images: bool,
    ) -> Result<DecodedPixels, VaeError> {
        let decoded = self.decode(packed, h, w, keep_images, true)?;
        let pixels = decoded
            .pixels
            .ok_or_else(|| backend("internal", "the decode made no pixels"))?;
        let f = self.config.spatial_factor();
        Ok(DecodedPixels {
            images: decoded.images,
            pixels,
            channels: self.config.out_channels,
            height: h * f,
            width: w * f,
        })
    }
}
