//! The MiniMax H3 audio VAE decoder on the GPU (kernel set `minimax_h3_audio`, `kernels/minimax_h3/audio.cu`), f32
//! throughout as the reference pins it, behind the same [`AudioVaeDecoder`] trait as the host reference.
//!
//! - **Load.** The folder goes through [`HostAudioVae::load`] (the same validation and errors, the weight-normalized
//!   weights formed once), then every weight is laid out for the kernels in one f32 blob ([`AudioVaeLayout`]) and
//!   uploaded: convolution weights k-major (`wt[(ci * K + j) * cout + co]`), each transposed convolution as
//!   `stride` phase convolutions over reordered taps, each anti-aliased SnakeBeta as `exp(alpha)`,
//!   `1 / (exp(beta) + 1e-9)` and its two 12-tap filters from the state dict.
//! - **Decode.** The request is turned into a list of operations on named buffers ([`DecodePlan`]): `dec_in_proj`,
//!   `conv_pre`, per stage the phase convolutions of the up-sampler and, per AMP block and dilation, SnakeBeta,
//!   the dilated convolution, SnakeBeta and the second convolution, whose epilogue adds the residual in place (or,
//!   for a block's last unit, adds `1/blocks` of the block's output into the stage sum); then the last SnakeBeta
//!   and `conv_post` with the clamp in its epilogue. Stereo is a batch of 2 in every kernel. The latents are
//!   de-normalized on the host (`z * std + mean`, as the host reference) before the upload.
//! - **Kernels.** Convolutions are implicit GEMMs on CUDA cores in f32 (a tile of output channels x positions per
//!   block, weights and input window in shared memory; the tile is chosen per shape so the grid fills the GPU,
//!   [`choose_kernel`]), or a direct one-thread-per-output kernel for tiny ones (`conv_post`); the SnakeBeta is one
//!   fused kernel (up-sample, activation, down-sample; one read and one write of the activation).
//!
//! Invariant: no host synchronisation inside a decode; the one sync is before reading the waveform back. Results
//! are bit-identical from run to run (every sum runs in a fixed order).
//!
//! ```no_run
//! use std::path::Path;
//! use tf_engines::minimax_h3::vae_audio::AudioVaeDecoder;
//! use tf_engines::minimax_h3::vae_audio_gpu::GpuAudioVae;
//! use tf_engines::nn::tensor::TensorF32;
//! use tf_engines::nn::weights::ModelDir;
//!
//! let mut vae = GpuAudioVae::load(&ModelDir::open(Path::new("audio_vae"))?)?;
//! let latents = TensorF32::zeros(vec![2, 32, 200])?; // 5 s of stereo latents
//! let wave = vae.decode(&latents)?;
//! assert_eq!(wave.shape(), &[2, 1, 160_000]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, DeviceBuffer, Event, Stream};

use super::vae_audio::{
    AudioVaeConfig, AudioVaeDecoder, AudioVaeError, HostAudioVae, ACTIVATION_TAPS,
};
use crate::nn::backend_error::{gpu_error, IntoGpuError};
use crate::nn::gpu::gemm;
use crate::nn::gpu::launch::{check_aligned_to, check_bytes};
use crate::nn::gpu::{
    invalid, to_i32, to_u32, GpuDevice, Launch, LoadKernelsError, LoadedSet, Operand,
};
use crate::nn::tensor::{Tensor, TensorF32};
use crate::nn::weights::ModelDir;

mod plan;

use plan::{denormalize, index_of, Buf, DecodePlan, Op, BUFS};
pub use plan::{AudioVaeLayout, MAX_BUFFER_ELEMENTS};

/// Name of the kernel set.
pub const AUDIO_SET: &str = "minimax_h3_audio";
/// Threads per block of every kernel (H3A_THREADS in audio.cu).
const THREADS: u32 = 256;
/// Input channels a tiled convolution stages per step (H3A_BKC).
const BKC: usize = 8;
/// Outputs per block and row segment of the SnakeBeta kernel (H3A_SNAKE_T).
pub const SNAKE_TILE: usize = 512;
/// Shared memory a kernel may use without opting in.
const MAX_SHARED: usize = 48 * 1024;
/// Most blocks a grid-stride kernel is launched with, and the grid's y limit.
const MAX_GRID_YZ: usize = 65_535;
const F32: usize = 4;

/// A tiled convolution kernel: `bm` output channels x `bn` positions per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvTile {
    pub kernel: &'static str,
    pub bm: usize,
    pub bn: usize,
}

/// The tiles audio.cu instantiates.
pub const CONV_TILES: [ConvTile; 7] = [
    ConvTile {
        kernel: "h3a_conv_m64n128",
        bm: 64,
        bn: 128,
    },
    ConvTile {
        kernel: "h3a_conv_m64n64",
        bm: 64,
        bn: 64,
    },
    ConvTile {
        kernel: "h3a_conv_m32n256",
        bm: 32,
        bn: 256,
    },
    ConvTile {
        kernel: "h3a_conv_m32n128",
        bm: 32,
        bn: 128,
    },
    ConvTile {
        kernel: "h3a_conv_m32n64",
        bm: 32,
        bn: 64,
    },
    ConvTile {
        kernel: "h3a_conv_m16n256",
        bm: 16,
        bn: 256,
    },
    ConvTile {
        kernel: "h3a_conv_m8n256",
        bm: 8,
        bn: 256,
    },
];
/// One thread per output element.
pub const CONV_DIRECT: &str = "h3a_conv_direct";
/// The fused anti-aliased SnakeBeta.
pub const SNAKE: &str = "h3a_snake_aa";

const KERNELS: &[&str] = &[
    "h3a_conv_m64n128",
    "h3a_conv_m64n64",
    "h3a_conv_m32n256",
    "h3a_conv_m32n128",
    "h3a_conv_m32n64",
    "h3a_conv_m16n256",
    "h3a_conv_m8n256",
    CONV_DIRECT,
    SNAKE,
];

impl ConvTile {
    /// Dynamic shared memory of a convolution with kernel `k`, dilation `dil` and input stride `in_stride`.
    pub fn shared_bytes(&self, k: usize, dil: usize, in_stride: usize) -> Option<usize> {
        let window = (self.bn - 1)
            .checked_mul(in_stride)?
            .checked_add(k.checked_sub(1)?.checked_mul(dil)?)?
            .checked_add(1)?;
        BKC.checked_mul(k.checked_mul(self.bm)?.checked_add(window)?)?
            .checked_mul(F32)
    }

    /// Blocks of the grid for `cout` channels, `n_out` positions and `batch` items.
    pub fn blocks(&self, cout: usize, n_out: usize, batch: usize) -> usize {
        n_out
            .div_ceil(self.bn)
            .saturating_mul(cout.div_ceil(self.bm))
            .saturating_mul(batch)
    }
}

/// How a convolution runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvKernel {
    Tiled(ConvTile),
    Direct,
}

impl ConvKernel {
    /// The kernel's symbol.
    pub fn name(&self) -> &'static str {
        match self {
            ConvKernel::Tiled(t) => t.kernel,
            ConvKernel::Direct => CONV_DIRECT,
        }
    }
}

/// One convolution as the kernels compute it, for every item `b`, output channel `co` and `n < n_out`:
///
/// ```text
/// acc = sum_{ci, j} wt[(ci k + j) cout + co] * x[b, ci, n in_stride + in_offset + j dil]   (zero outside the input)
/// t = out_offset + n out_stride
/// out[b, co, t] = clamp?((acc + bias[co] + res[b, co, t]) * scale + (accumulate ? out[b, co, t] : 0))
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvShape {
    pub batch: usize,
    pub cin: usize,
    pub cout: usize,
    pub k: usize,
    pub dil: usize,
    pub in_len: usize,
    pub in_offset: i64,
    pub in_stride: usize,
    pub n_out: usize,
    pub out_offset: usize,
    pub out_stride: usize,
    pub out_len: usize,
    pub scale: f32,
    pub accumulate: bool,
    pub clamp: bool,
}

/// The tiled kernel whose grid fills `sms` multiprocessors with the most work per block, the direct kernel for
/// fewer than 8 output channels or when no tile's shared memory fits.
pub fn choose_kernel(shape: &ConvShape, sms: usize) -> ConvKernel {
    if shape.cout < 8 {
        return ConvKernel::Direct;
    }
    let cap = match shape.cout {
        64.. => 64,
        17..=63 => 32,
        9..=16 => 16,
        _ => 8,
    };
    let eligible = CONV_TILES.iter().filter(|t| {
        t.bm <= cap
            && t.shared_bytes(shape.k, shape.dil, shape.in_stride)
                .is_some_and(|b| b <= MAX_SHARED)
    });
    let target = sms.max(1);
    let filled = eligible
        .clone()
        .filter(|t| t.blocks(shape.cout, shape.n_out, shape.batch) >= target)
        .max_by_key(|t| (t.bm * t.bn, t.bm));
    let best = filled.or_else(|| {
        eligible.max_by_key(|t| {
            (
                t.blocks(shape.cout, shape.n_out, shape.batch),
                t.bm * t.bn,
                t.bm,
            )
        })
    });
    best.map_or(ConvKernel::Direct, |t| ConvKernel::Tiled(*t))
}

/// The operands of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSpans {
    pub x: DeviceSpan,
    pub wt: DeviceSpan,
    pub bias: Option<DeviceSpan>,
    pub res: Option<DeviceSpan>,
    pub out: DeviceSpan,
}

fn bytes_of(op: &str, name: &str, factors: &[usize]) -> Result<usize, tf_cuda::Error> {
    factors
        .iter()
        .try_fold(F32, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| invalid(op, format!("{name}: size {factors:?} overflows")))
}

fn check_span(op: &str, name: &str, span: DeviceSpan, needed: usize) -> Result<(), tf_cuda::Error> {
    let operand = Operand {
        addr: span.addr,
        bytes: span.bytes,
    };
    check_aligned_to(op, name, operand, 4)?;
    check_bytes(op, name, operand, needed)
}

/// Checks a convolution against its operands and packs its launch.
pub fn plan_conv(
    spans: &ConvSpans,
    s: &ConvShape,
    kernel: ConvKernel,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 audio conv";
    for (name, v) in [
        ("batch", s.batch),
        ("cin", s.cin),
        ("cout", s.cout),
        ("k", s.k),
        ("dil", s.dil),
        ("in_len", s.in_len),
        ("in_stride", s.in_stride),
        ("n_out", s.n_out),
        ("out_stride", s.out_stride),
        ("out_len", s.out_len),
    ] {
        if v == 0 {
            return Err(invalid(OP, format!("{name} must be at least 1")));
        }
    }
    let last = (s.n_out - 1)
        .checked_mul(s.out_stride)
        .and_then(|v| v.checked_add(s.out_offset));
    if last.is_none_or(|t| t >= s.out_len) {
        return Err(invalid(
            OP,
            format!(
                "outputs {} + n x {} for n < {} pass the output length {}",
                s.out_offset, s.out_stride, s.n_out, s.out_len
            ),
        ));
    }
    check_span(
        OP,
        "x",
        spans.x,
        bytes_of(OP, "x", &[s.batch, s.cin, s.in_len])?,
    )?;
    check_span(
        OP,
        "wt",
        spans.wt,
        bytes_of(OP, "wt", &[s.cin, s.k, s.cout])?,
    )?;
    if let Some(bias) = spans.bias {
        check_span(OP, "bias", bias, bytes_of(OP, "bias", &[s.cout])?)?;
    }
    let out_bytes = bytes_of(OP, "out", &[s.batch, s.cout, s.out_len])?;
    if let Some(res) = spans.res {
        check_span(OP, "res", res, out_bytes)?;
    }
    check_span(OP, "out", spans.out, out_bytes)?;
    let in_offset = i32::try_from(s.in_offset)
        .map_err(|_| invalid(OP, format!("in_offset {} does not fit an i32", s.in_offset)))?;
    let mut args = Args::new();
    args.push_addr(spans.x.addr)
        .push_addr(spans.wt.addr)
        .push_addr(spans.bias.map_or(0, |b| b.addr))
        .push_addr(spans.res.map_or(0, |r| r.addr))
        .push_addr(spans.out.addr)
        .push(to_i32(OP, "cin", s.cin)?)
        .push(to_i32(OP, "cout", s.cout)?)
        .push(to_i32(OP, "k", s.k)?)
        .push(to_i32(OP, "dil", s.dil)?)
        .push(to_i32(OP, "in_len", s.in_len)?)
        .push(in_offset)
        .push(to_i32(OP, "in_stride", s.in_stride)?)
        .push(to_i32(OP, "n_out", s.n_out)?)
        .push(to_i32(OP, "out_offset", s.out_offset)?)
        .push(to_i32(OP, "out_stride", s.out_stride)?)
        .push(to_i32(OP, "out_len", s.out_len)?)
        .push(s.scale)
        .push(i32::from(s.accumulate))
        .push(i32::from(s.clamp));
    let config = match kernel {
        ConvKernel::Tiled(tile) => {
            let shared = tile
                .shared_bytes(s.k, s.dil, s.in_stride)
                .filter(|&b| b <= MAX_SHARED)
                .ok_or_else(|| {
                    invalid(
                        OP,
                        format!(
                            "{}: k {} and dilation {} need more than {MAX_SHARED} B of shared memory; use the direct kernel",
                            tile.kernel, s.k, s.dil
                        ),
                    )
                })?;
            let gy = s.cout.div_ceil(tile.bm);
            if gy > MAX_GRID_YZ || s.batch > MAX_GRID_YZ {
                return Err(invalid(
                    OP,
                    format!("{gy} channel tiles x {} items exceed the grid", s.batch),
                ));
            }
            LaunchConfig::new(
                (
                    to_u32(OP, "position tiles", s.n_out.div_ceil(tile.bn))?,
                    to_u32(OP, "channel tiles", gy)?,
                    to_u32(OP, "batch", s.batch)?,
                ),
                THREADS,
            )
            .with_shared(to_u32(OP, "shared bytes", shared)?)
        }
        ConvKernel::Direct => {
            args.push(to_i32(OP, "batch", s.batch)?);
            let total = s
                .batch
                .checked_mul(s.cout)
                .and_then(|v| v.checked_mul(s.n_out))
                .ok_or_else(|| invalid(OP, "output count overflows"))?;
            let blocks = total.div_ceil(THREADS as usize).clamp(1, MAX_GRID_YZ);
            LaunchConfig::new(to_u32(OP, "blocks", blocks)?, THREADS)
        }
    };
    Ok(Launch::from_spans(kernel.name(), config, args))
}

/// The operands of the fused SnakeBeta: `x` and `y` `[rows, len]` (row `r` is channel `r % channels`), per-channel
/// `freq` and `inv_mag`, the 12-tap `up` and `down` filters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnakeSpans {
    pub x: DeviceSpan,
    pub y: DeviceSpan,
    pub freq: DeviceSpan,
    pub inv_mag: DeviceSpan,
    pub up: DeviceSpan,
    pub down: DeviceSpan,
}

/// Checks the fused anti-aliased SnakeBeta against its operands and packs its launch.
pub fn plan_snake(
    spans: &SnakeSpans,
    channels: usize,
    rows: usize,
    len: usize,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 audio snake";
    if channels == 0 || rows == 0 || len == 0 || !rows.is_multiple_of(channels) {
        return Err(invalid(
            OP,
            format!("{rows} rows of {len} over {channels} channels: all positive, rows a multiple of channels"),
        ));
    }
    if len > (i32::MAX as usize) / 2 - SNAKE_TILE {
        return Err(invalid(OP, format!("length {len} is too long for one row")));
    }
    let bytes = bytes_of(OP, "x", &[rows, len])?;
    check_span(OP, "x", spans.x, bytes)?;
    check_span(OP, "y", spans.y, bytes)?;
    check_span(OP, "freq", spans.freq, channels * F32)?;
    check_span(OP, "inv_mag", spans.inv_mag, channels * F32)?;
    check_span(OP, "up", spans.up, ACTIVATION_TAPS * F32)?;
    check_span(OP, "down", spans.down, ACTIVATION_TAPS * F32)?;
    if spans.x.addr == spans.y.addr {
        return Err(invalid(OP, "x and y must be different buffers"));
    }
    let mut args = Args::new();
    args.push_addr(spans.x.addr)
        .push_addr(spans.y.addr)
        .push_addr(spans.freq.addr)
        .push_addr(spans.inv_mag.addr)
        .push_addr(spans.up.addr)
        .push_addr(spans.down.addr)
        .push(to_i32(OP, "channels", channels)?)
        .push(to_i32(OP, "rows", rows)?)
        .push(to_i32(OP, "len", len)?);
    let config = LaunchConfig::new(
        (
            to_u32(OP, "tiles", len.div_ceil(SNAKE_TILE))?,
            to_u32(OP, "rows", rows.min(MAX_GRID_YZ))?,
        ),
        THREADS,
    );
    Ok(Launch::from_spans(SNAKE, config, args))
}

/// The loaded `minimax_h3_audio` kernels of one context.
pub struct AudioKernels {
    set: LoadedSet,
}

impl std::fmt::Debug for AudioKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AudioKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl AudioKernels {
    /// Loads the set into `ctx` and looks every kernel up.
    pub fn load(ctx: &Context) -> Result<AudioKernels, LoadKernelsError> {
        Ok(AudioKernels {
            set: LoadedSet::load(ctx, AUDIO_SET, KERNELS)?,
        })
    }

    /// Submits a launch built by [`plan_conv`] or [`plan_snake`].
    ///
    /// # Safety
    ///
    /// Every span the launch was planned over lies in device memory of `stream`'s context that is allocated now (a
    /// `DeviceBuffer` then stays valid for the queued work: its `Drop` synchronizes the context before freeing).
    pub unsafe fn submit(
        &self,
        stream: &Stream,
        launch: &Launch<'_>,
    ) -> Result<(), tf_cuda::Error> {
        // SAFETY: forwarded contract: the caller vouches for the spans.
        unsafe { self.set.submit_spans(stream, launch) }
    }
}

// ---- the GPU backend ---------------------------------------------------------------------------------------

/// A GPU failure as an [`AudioVaeError`].
fn gpu_err<E: IntoGpuError>(what: &str) -> impl FnOnce(E) -> AudioVaeError + '_ {
    move |e| AudioVaeError::Gpu(gpu_error(what, e))
}

/// The device buffers of a decode, sized for a plan (grown when a larger request comes).
struct Workspace {
    elems: [usize; 7],
    bufs: Vec<DeviceBuffer>,
}

impl Workspace {
    fn bytes(&self) -> usize {
        self.bufs.iter().map(DeviceBuffer::len).sum()
    }
}

/// The audio VAE decoder on the GPU.
pub struct GpuAudioVae {
    layout: AudioVaeLayout,
    weights: DeviceBuffer,
    workspace: Option<Workspace>,
    kernels: AudioKernels,
    sms: usize,
    /// The pipeline's stream, shared by its components.
    stream: Arc<Stream>,
    ctx: Context,
}

impl std::fmt::Debug for GpuAudioVae {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuAudioVae")
            .field("config", &self.layout.config)
            .field("weight_bytes", &self.weights.len())
            .finish_non_exhaustive()
    }
}

impl Drop for GpuAudioVae {
    fn drop(&mut self) {
        // Work still queued (after an error mid-decode) must not outlive the buffers it reads; a failure here means
        // the context is gone, and the buffers with it.
        let _ = self.stream.synchronize();
    }
}

impl GpuAudioVae {
    /// Opens the driver, makes a context on device 0 and loads `model` onto it.
    pub fn load(model: &ModelDir) -> Result<GpuAudioVae, AudioVaeError> {
        let driver = tf_cuda::open_driver().map_err(gpu_err("opening the CUDA driver"))?;
        let ctx = Context::new(driver, 0).map_err(gpu_err("creating a context on device 0"))?;
        GpuAudioVae::load_on(&ctx, model)
    }

    /// Loads a diffusers `audio_vae/` folder into `ctx`: validated and weight-normalized as the host reference
    /// loads it, laid out for the kernels and uploaded.
    pub fn load_on(ctx: &Context, model: &ModelDir) -> Result<GpuAudioVae, AudioVaeError> {
        let device = GpuDevice::on(ctx).map_err(gpu_err("creating a stream"))?;
        GpuAudioVae::load_in(&device, model)
    }

    /// [`GpuAudioVae::load_on`] onto `device`, whose stream every decode runs on (a pipeline's components share
    /// it).
    pub fn load_in(device: &GpuDevice, model: &ModelDir) -> Result<GpuAudioVae, AudioVaeError> {
        let host = HostAudioVae::load(model)?;
        let layout = AudioVaeLayout::from_host(&host)?;
        drop(host);
        GpuAudioVae::with_layout(device, layout)
    }

    /// Uploads a laid-out decoder onto `device`.
    pub fn with_layout(
        device: &GpuDevice,
        mut layout: AudioVaeLayout,
    ) -> Result<GpuAudioVae, AudioVaeError> {
        let ctx = device.context();
        let stream = Arc::clone(device.stream());
        let kernels = AudioKernels::load(ctx).map_err(gpu_err("loading the audio VAE kernels"))?;
        let sms = ctx
            .device_info()
            .map(|info| usize::try_from(info.sm_count).unwrap_or(1).max(1))
            .map_err(gpu_err("reading the device's multiprocessor count"))?;
        let weights = DeviceBuffer::from_slice(ctx, &layout.blob).map_err(|e| {
            AudioVaeError::Gpu(gpu_error(
                format!(
                    "uploading {} f32 values of audio VAE weights",
                    layout.blob.len()
                ),
                e,
            ))
        })?;
        layout.blob = Vec::new();
        Ok(GpuAudioVae {
            layout,
            weights,
            workspace: None,
            kernels,
            sms,
            stream,
            ctx: ctx.clone(),
        })
    }

    /// The validated config.
    pub fn config(&self) -> &AudioVaeConfig {
        &self.layout.config
    }

    /// Output samples per item for `frames` latent frames.
    pub fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError> {
        self.layout.output_len(frames)
    }

    /// Bytes of the device weights.
    pub fn weight_bytes(&self) -> usize {
        self.weights.len()
    }

    /// Device bytes held: weights and the current workspace.
    pub fn resident_bytes(&self) -> usize {
        self.weights.len() + self.workspace.as_ref().map_or(0, Workspace::bytes)
    }

    /// Frees the workspace (the weights stay).
    pub fn clear_workspace(&mut self) {
        let _ = self.stream.synchronize();
        self.workspace = None;
    }

    /// The context the decoder lives in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The kernel each convolution of a decode of `[batch, latent_channels, frames]` runs, in order (for reports).
    pub fn conv_kernels(
        &self,
        batch: usize,
        frames: usize,
    ) -> Result<Vec<&'static str>, AudioVaeError> {
        let plan = DecodePlan::new(
            &self.layout,
            &[batch, self.layout.config.latent_channels, frames],
        )?;
        Ok(plan
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Conv(c) => Some(choose_kernel(&c.shape, self.sms).name()),
                Op::Snake(_) => None,
            })
            .collect())
    }

    /// Normalized latents `[batch, latent_channels, frames]` to the clamped waveform `[batch, 1, samples]`.
    pub fn decode(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        self.run(latents, true)
    }

    /// The model's `decode` on de-normalized latents.
    pub fn decode_denormalized(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        self.run(latents, false)
    }

    /// Device milliseconds of one decode of `latents` (the mean of `iters` after a warm-up), without the upload
    /// and the read-back.
    pub fn time_decode(&mut self, latents: &TensorF32, iters: usize) -> Result<f64, AudioVaeError> {
        let plan = self.prepare(latents, true)?;
        let start = Event::new(&self.ctx, true).map_err(gpu_err("creating an event"))?;
        let end = Event::new(&self.ctx, true).map_err(gpu_err("creating an event"))?;
        self.enqueue(&plan)?;
        let iters = iters.max(1);
        start
            .record(&self.stream)
            .map_err(gpu_err("recording an event"))?;
        for _ in 0..iters {
            self.enqueue(&plan)?;
        }
        end.record(&self.stream)
            .map_err(gpu_err("recording an event"))?;
        end.synchronize().map_err(gpu_err("running the decode"))?;
        let ms = Event::elapsed_ms(&start, &end).map_err(gpu_err("reading an event"))?;
        Ok(f64::from(ms) / iters as f64)
    }

    fn run(&mut self, latents: &TensorF32, normalized: bool) -> Result<TensorF32, AudioVaeError> {
        let plan = self.prepare(latents, normalized)?;
        self.enqueue(&plan)?;
        self.stream
            .synchronize()
            .map_err(gpu_err("running the decode"))?;
        let n = plan.batch * plan.out_len;
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| AudioVaeError::Gpu(gpu_error("decode", "no workspace")))?;
        let wave: Vec<f32> = ws.bufs[index_of(Buf::Out)]
            .slice(0, n * F32)
            .and_then(|view| view.to_vec())
            .map_err(gpu_err("reading the waveform back"))?;
        Ok(Tensor::new(vec![plan.batch, 1, plan.out_len], wave)?)
    }

    /// Plans the decode, sizes the workspace and uploads the (de-normalized) latents on the stream.
    fn prepare(
        &mut self,
        latents: &TensorF32,
        normalized: bool,
    ) -> Result<DecodePlan, AudioVaeError> {
        let plan = DecodePlan::new(&self.layout, latents.shape())?;
        let input = if normalized {
            denormalize(latents, &self.layout.mean, &self.layout.std, plan.frames)
        } else {
            latents.data().to_vec()
        };
        self.ensure_workspace(&plan.elems)?;
        let bytes: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
        let ws = self
            .workspace
            .as_mut()
            .ok_or_else(|| AudioVaeError::Gpu(gpu_error("decode", "no workspace")))?;
        ws.bufs[index_of(Buf::Input)]
            .upload_async(0, &bytes, &self.stream)
            .map_err(gpu_err("uploading the latents"))?;
        Ok(plan)
    }

    fn ensure_workspace(&mut self, elems: &[usize; 7]) -> Result<(), AudioVaeError> {
        if self
            .workspace
            .as_ref()
            .is_some_and(|ws| ws.elems.iter().zip(elems).all(|(have, need)| have >= need))
        {
            return Ok(());
        }
        // Nothing queued may still use the old buffers when they are freed.
        self.stream
            .synchronize()
            .map_err(gpu_err("waiting before growing the workspace"))?;
        let grown: [usize; 7] = match &self.workspace {
            Some(ws) => std::array::from_fn(|i| ws.elems[i].max(elems[i])),
            None => *elems,
        };
        self.workspace = None;
        let mut bufs = Vec::with_capacity(BUFS.len());
        for (buf, &n) in BUFS.iter().zip(&grown) {
            let bytes = n.max(1) * F32;
            bufs.push(DeviceBuffer::alloc(&self.ctx, bytes).map_err(|e| {
                AudioVaeError::Gpu(gpu_error(
                    format!("allocating the {buf:?} buffer ({bytes} B)"),
                    e,
                ))
            })?);
        }
        self.workspace = Some(Workspace { elems: grown, bufs });
        Ok(())
    }

    /// Enqueues every operation of `plan` (no host synchronisation).
    fn enqueue(&self, plan: &DecodePlan) -> Result<(), AudioVaeError> {
        let ws = self
            .workspace
            .as_ref()
            .ok_or_else(|| AudioVaeError::Gpu(gpu_error("decode", "no workspace")))?;
        let buf = |b: Buf, elems: usize| -> Result<DeviceSpan, AudioVaeError> {
            gemm::span(&ws.bufs[index_of(b)], 0, elems * F32).map_err(gpu_err("a decode buffer"))
        };
        let weight = |offset: usize, elems: usize| -> Result<DeviceSpan, AudioVaeError> {
            gemm::span(&self.weights, offset * F32, elems * F32).map_err(gpu_err("a weight"))
        };
        for op in &plan.ops {
            let launch = match op {
                Op::Conv(c) => {
                    let s = &c.shape;
                    let out_elems = s.batch * s.cout * s.out_len;
                    let spans = ConvSpans {
                        x: buf(c.x, s.batch * s.cin * s.in_len)?,
                        wt: weight(c.wt, s.cin * s.k * s.cout)?,
                        bias: c.bias.map(|b| weight(b, s.cout)).transpose()?,
                        res: c.res.map(|r| buf(r, out_elems)).transpose()?,
                        out: buf(c.out, out_elems)?,
                    };
                    plan_conv(&spans, s, choose_kernel(s, self.sms))
                }
                Op::Snake(sn) => {
                    let a = sn.act;
                    let n = sn.rows * sn.len;
                    let spans = SnakeSpans {
                        x: buf(sn.x, n)?,
                        y: buf(sn.y, n)?,
                        freq: weight(a.freq, a.channels)?,
                        inv_mag: weight(a.inv_mag, a.channels)?,
                        up: weight(a.up, ACTIVATION_TAPS)?,
                        down: weight(a.down, ACTIVATION_TAPS)?,
                    };
                    plan_snake(&spans, a.channels, sn.rows, sn.len)
                }
            }
            .map_err(gpu_err("planning a kernel"))?;
            // SAFETY: every span lies inside this decoder's weight buffer or a buffer of the workspace in use, all in
            // the stream's context (checked by `gemm::span`); neither is freed before the stream is synchronised
            // (workspace growth, `clear_workspace` and Drop synchronise first).
            unsafe { self.kernels.submit(&self.stream, &launch) }
                .map_err(gpu_err(launch.kernel()))?;
        }
        Ok(())
    }
}

impl AudioVaeDecoder for GpuAudioVae {
    fn config(&self) -> &AudioVaeConfig {
        GpuAudioVae::config(self)
    }

    fn output_len(&self, frames: usize) -> Result<usize, AudioVaeError> {
        GpuAudioVae::output_len(self, frames)
    }

    fn decode(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        GpuAudioVae::decode(self, latents)
    }

    fn decode_denormalized(&mut self, latents: &TensorF32) -> Result<TensorF32, AudioVaeError> {
        GpuAudioVae::decode_denormalized(self, latents)
    }

    fn name(&self) -> &'static str {
        "gpu"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(cout: usize, n_out: usize, k: usize, dil: usize) -> ConvShape {
        ConvShape {
            batch: 2,
            cin: cout,
            cout,
            k,
            dil,
            in_len: n_out,
            in_offset: 0,
            in_stride: 1,
            n_out,
            out_offset: 0,
            out_stride: 1,
            out_len: n_out,
            scale: 1.0,
            accumulate: false,
            clamp: false,
        }
    }

    #[test]
    fn tiles_fill_an_h200_at_the_released_shapes() {
        let sms = 132;
        let pick = |cout, n, k, dil| choose_kernel(&shape(cout, n, k, dil), sms).name();
        // 5 s of stereo: stage 0 (512 channels, 1000 samples), stage 1 (256, 5000), stages 2-6 (128 .. 8 channels).
        assert_eq!(pick(512, 1000, 11, 5), "h3a_conv_m64n64");
        assert_eq!(pick(256, 5000, 11, 5), "h3a_conv_m64n128");
        assert_eq!(pick(128, 10_000, 7, 3), "h3a_conv_m64n128");
        assert_eq!(pick(32, 40_000, 3, 1), "h3a_conv_m32n256");
        assert_eq!(pick(16, 80_000, 11, 5), "h3a_conv_m16n256");
        assert_eq!(pick(8, 160_000, 11, 5), "h3a_conv_m8n256");
        // conv_post (one channel) and shapes whose window would not fit shared memory run the direct kernel.
        assert_eq!(pick(1, 160_000, 7, 1), CONV_DIRECT);
        assert_eq!(pick(64, 1000, 101, 200), CONV_DIRECT);
        for tile in CONV_TILES {
            assert!(
                tile.shared_bytes(11, 5, 1).unwrap() <= MAX_SHARED,
                "{tile:?}"
            );
            assert!(KERNELS.contains(&tile.kernel));
        }
    }

    fn span(addr: u64, bytes: usize) -> DeviceSpan {
        DeviceSpan::new(addr, bytes)
    }

    #[test]
    fn plans_check_their_operands() {
        let s = shape(64, 1000, 11, 5);
        let act = 2 * 64 * 1000 * F32;
        let spans = ConvSpans {
            x: span(0x10000, act),
            wt: span(0x100_0000, 64 * 11 * 64 * F32),
            bias: Some(span(0x200_0000, 64 * F32)),
            res: None,
            out: span(0x1000_0000, act),
        };
        let tile = ConvKernel::Tiled(CONV_TILES[1]);
        let launch = plan_conv(&spans, &s, tile).unwrap();
        assert_eq!(launch.kernel(), "h3a_conv_m64n64");
        assert_eq!(launch.args().len(), 19);
        assert_eq!(
            (
                launch.config().grid.x,
                launch.config().grid.y,
                launch.config().grid.z
            ),
            (16, 1, 2)
        );
        assert_eq!(
            launch.config().shared_bytes as usize,
            CONV_TILES[1].shared_bytes(11, 5, 1).unwrap()
        );
        let direct = plan_conv(&spans, &s, ConvKernel::Direct).unwrap();
        assert_eq!(direct.args().len(), 20);
        // Short operands, outputs past the buffer, zero sizes, an offset past i32.
        let short = ConvSpans {
            out: span(0x1000_0000, act - 4),
            ..spans
        };
        assert!(plan_conv(&short, &s, tile).is_err());
        let short_w = ConvSpans {
            wt: span(0x100_0000, 64 * 11 * 64 * F32 - 4),
            ..spans
        };
        assert!(plan_conv(&short_w, &s, tile).is_err());
        let past = ConvShape { out_offset: 1, ..s };
        assert!(plan_conv(&spans, &past, tile).is_err());
        let strided = ConvShape {
            out_stride: 2,
            n_out: 500,
            ..s
        };
        assert!(plan_conv(&spans, &strided, tile).is_ok());
        let zero = ConvShape { k: 0, ..s };
        assert!(plan_conv(&spans, &zero, tile).is_err());
        let far = ConvShape {
            in_offset: i64::from(i32::MIN) - 1,
            ..s
        };
        assert!(plan_conv(&spans, &far, tile).is_err());
        let big = ConvShape {
            k: 101,
            dil: 200,
            ..s
        };
        let big_w = ConvSpans {
            wt: span(0x100_0000, 64 * 101 * 64 * F32),
            ..spans
        };
        assert!(plan_conv(&big_w, &big, tile).is_err());
        assert!(plan_conv(&big_w, &big, ConvKernel::Direct).is_ok());

        let rows = 2 * 64;
        let snake = SnakeSpans {
            x: span(0x10000, act),
            y: span(0x1000_0000, act),
            freq: span(0x200_0000, 64 * F32),
            inv_mag: span(0x300_0000, 64 * F32),
            up: span(0x400_0000, 12 * F32),
            down: span(0x500_0000, 12 * F32),
        };
        let launch = plan_snake(&snake, 64, rows, 1000).unwrap();
        assert_eq!((launch.config().grid.x, launch.config().grid.y), (2, 128));
        assert!(plan_snake(&snake, 64, rows + 1, 1000).is_err());
        assert!(plan_snake(
            &SnakeSpans {
                y: snake.x,
                ..snake
            },
            64,
            rows,
            1000
        )
        .is_err());
        assert!(plan_snake(
            &SnakeSpans {
                up: span(0x400_0000, 44),
                ..snake
            },
            64,
            rows,
            1000
        )
        .is_err());
        assert!(plan_snake(&snake, 64, rows, 1001).is_err());
    }
}
