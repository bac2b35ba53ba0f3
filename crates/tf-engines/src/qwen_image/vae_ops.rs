//! GPU launchers for the Qwen-Image 2.1 VAE decoder kernels (`kernels/qwen_image/vae.cu`, kernel set
//! `qwen_image_vae`).
//!
//! The decoder works channels-last: an activation is a bf16 `[pixels][cp]` block, `cp` the channel count
//! rounded up to a multiple of 8 ([`padded_channels`]) with zeros in the padding channels. Operands are
//! [`DeviceSpan`]s (address and bytes), the same currency as the cuBLASLt GEMMs that do the convolutions, so one
//! activation buffer can be read by a GEMM and normalized in place by a kernel. Each `plan_*` function checks
//! sizes and alignment against the spans before anything reaches the driver and packs the arguments
//! (unit-tested without a GPU); [`VaeKernels`] holds the loaded kernels and submits launches on a stream.
//!
//! ```no_run
//! # fn demo(ctx: &tf_cuda::Context, stream: &tf_cuda::Stream, x: tf_cuda::cublaslt::DeviceSpan,
//! #         gamma: tf_cuda::cublaslt::DeviceSpan) -> Result<(), Box<dyn std::error::Error>> {
//! use tf_engines::qwen_image::vae_ops::{plan_rms_norm_silu, VaeKernels};
//! let kernels = VaeKernels::load(ctx)?;
//! // In place: 4096 pixels of 1152 channels, F.normalize * sqrt(1152) * gamma, then SiLU.
//! // SAFETY: `x` and `gamma` are spans of live buffers of the stream's context.
//! unsafe { kernels.submit(stream, &plan_rms_norm_silu(x, x, gamma, 4096, 1152, 1152, true)?)? };
//! # Ok(()) }
//! ```

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, Stream};

use crate::nn::gpu::launch::{bytes_of, check_span, stride_grid};
use crate::nn::gpu::{invalid, to_i32, to_u32, Launch, LoadKernelsError, LoadedSet};

/// Name of the kernel set.
pub const VAE_SET: &str = "qwen_image_vae";
/// Threads per block of every kernel (QV_THREADS in vae.cu).
const THREADS: u32 = 256;
/// Pixels per block of the norm kernel (one warp each).
const NORM_PIXELS_PER_BLOCK: usize = (THREADS / 32) as usize;
const BF16: usize = 2;
const F32: usize = 4;

const VAE_KERNELS: &[&str] = &[
    "qv_denormalize",
    "qv_rms_norm_silu",
    "qv_im2col3x3",
    "qv_dup_up",
    "qv_upsample2x",
    "qv_softmax_rows",
    "qv_planes_clamp",
    "qv_image_u8",
];

/// `channels` rounded up to a multiple of 8 (16-byte rows of bf16).
pub fn padded_channels(channels: usize) -> usize {
    channels.div_ceil(8) * 8
}

fn check_padded(op: &str, name: &str, cp: usize) -> Result<(), tf_cuda::Error> {
    if cp == 0 || !cp.is_multiple_of(8) {
        return Err(invalid(
            op,
            format!("{name} = {cp} must be a positive multiple of 8 (pad the channels)"),
        ));
    }
    Ok(())
}

/// Unpacks one image's packed latents `[pixels, z]` f32 into bf16 `[pixels, zp]`: `z * std + mean` per channel,
/// zeros in the padding channels (kernel qv_denormalize).
pub fn plan_denormalize(
    packed: DeviceSpan,
    pixels: usize,
    z: usize,
    mean: DeviceSpan,
    std: DeviceSpan,
    out: DeviceSpan,
    zp: usize,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae denormalize";
    check_padded(OP, "zp", zp)?;
    if z == 0 || z > zp {
        return Err(invalid(OP, format!("z = {z} must be in 1..={zp}")));
    }
    check_span(
        OP,
        "packed",
        packed,
        bytes_of(OP, "packed", &[pixels, z, F32])?,
        4,
    )?;
    check_span(OP, "mean", mean, z * F32, 4)?;
    check_span(OP, "std", std, z * F32, 4)?;
    check_span(
        OP,
        "out",
        out,
        bytes_of(OP, "out", &[pixels, zp, BF16])?,
        16,
    )?;
    let mut args = Args::new();
    args.push_addr(packed.addr)
        .push(to_i32(OP, "pixels", pixels)?)
        .push(to_i32(OP, "z", z)?)
        .push_addr(mean.addr)
        .push_addr(std.addr)
        .push_addr(out.addr)
        .push(to_i32(OP, "zp", zp)?);
    Ok(Launch::from_spans(
        "qv_denormalize",
        stride_grid(OP, pixels * zp, THREADS)?,
        args,
    ))
}

/// Channel RMS norm over `channels` true channels (stored `cp` wide) with f32 `gamma[cp]` (zero padded), then
/// SiLU when `silu`; `y` may be `x` (kernel qv_rms_norm_silu).
pub fn plan_rms_norm_silu(
    x: DeviceSpan,
    y: DeviceSpan,
    gamma: DeviceSpan,
    pixels: usize,
    channels: usize,
    cp: usize,
    silu: bool,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae rms_norm_silu";
    check_padded(OP, "cp", cp)?;
    if channels == 0 || channels > cp {
        return Err(invalid(
            OP,
            format!("channels = {channels} must be in 1..={cp}"),
        ));
    }
    let bytes = bytes_of(OP, "x", &[pixels, cp, BF16])?;
    check_span(OP, "x", x, bytes, 16)?;
    check_span(OP, "y", y, bytes, 16)?;
    check_span(OP, "gamma", gamma, cp * F32, 4)?;
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push_addr(y.addr)
        .push_addr(gamma.addr)
        .push(to_i32(OP, "pixels", pixels)?)
        .push(to_i32(OP, "cp", cp)?)
        .push((channels as f32).sqrt())
        .push(i32::from(silu));
    let blocks = pixels.div_ceil(NORM_PIXELS_PER_BLOCK).max(1);
    Ok(Launch::from_spans(
        "qv_rms_norm_silu",
        LaunchConfig::new(to_u32(OP, "blocks", blocks)?, THREADS),
        args,
    ))
}

/// Where a 3x3 convolution's columns come from and which output rows they cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Im2colBand {
    /// Output map height and width.
    pub out_h: usize,
    pub out_w: usize,
    /// Channels of the source, padded.
    pub cp: usize,
    /// The source is the nearest 2x upsample of an `out_h / 2` x `out_w / 2` map.
    pub upsample: bool,
    /// First output row and number of rows.
    pub row0: usize,
    pub rows: usize,
}

impl Im2colBand {
    /// Elements of the band's column matrix: `rows * out_w` rows of `9 * cp`.
    pub fn elements(&self) -> Option<usize> {
        self.rows
            .checked_mul(self.out_w)?
            .checked_mul(9)?
            .checked_mul(self.cp)
    }
}

/// Columns `[rows * out_w, 9 * cp]` (tap-major, then channel) of a 3x3 "same" convolution (kernel qv_im2col3x3).
pub fn plan_im2col3x3(
    x: DeviceSpan,
    band: Im2colBand,
    cols: DeviceSpan,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae im2col3x3";
    check_padded(OP, "cp", band.cp)?;
    if band.upsample && (!band.out_h.is_multiple_of(2) || !band.out_w.is_multiple_of(2)) {
        return Err(invalid(
            OP,
            format!(
                "an upsampled source needs an even output size, got {} x {}",
                band.out_h, band.out_w
            ),
        ));
    }
    let end = band.row0.checked_add(band.rows);
    if band.rows == 0 || end.is_none_or(|e| e > band.out_h) {
        return Err(invalid(
            OP,
            format!(
                "rows [{}, +{}) must be a non-empty range inside the {} output rows",
                band.row0, band.rows, band.out_h
            ),
        ));
    }
    let shift = usize::from(band.upsample);
    let src_pixels = (band.out_h >> shift) * (band.out_w >> shift);
    check_span(
        OP,
        "x",
        x,
        bytes_of(OP, "x", &[src_pixels, band.cp, BF16])?,
        16,
    )?;
    let elements = band
        .elements()
        .ok_or_else(|| invalid(OP, "column matrix size overflows"))?;
    check_span(
        OP,
        "cols",
        cols,
        bytes_of(OP, "cols", &[elements, BF16])?,
        16,
    )?;
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push(to_i32(OP, "cp", band.cp)?)
        .push(to_i32(OP, "out_h", band.out_h)?)
        .push(to_i32(OP, "out_w", band.out_w)?)
        .push(i32::from(band.upsample))
        .push(to_i32(OP, "row0", band.row0)?)
        .push(to_i32(OP, "rows", band.rows)?)
        .push_addr(cols.addr);
    // One thread per 8-channel chunk of an output pixel (all 9 taps); the kernel indexes them in 32 bits.
    let chunks = elements / 9 / 8;
    to_i32(OP, "rows * out_w * cp / 8", chunks)?;
    Ok(Launch::from_spans(
        "qv_im2col3x3",
        stride_grid(OP, chunks, THREADS)?,
        args,
    ))
}

/// Shape of a DupUp3D shortcut (first frame): `in_c` channels on an `h` x `w` map to `out_c` channels on
/// `2h` x `2w`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DupUpShape {
    pub h: usize,
    pub w: usize,
    pub in_c: usize,
    pub out_c: usize,
    pub factor_t: usize,
}

impl DupUpShape {
    /// How often each input channel is repeated: `out_c * factor_t * 4 / in_c`, when that divides.
    pub fn repeats(&self) -> Option<usize> {
        let slots = self.out_c.checked_mul(self.factor_t)?.checked_mul(4)?;
        (self.in_c > 0 && slots.is_multiple_of(self.in_c) && slots >= self.in_c)
            .then(|| slots / self.in_c)
    }

    /// The input channel that output channel `o` copies at sub-pixel `(i, j)` (the kernel's rule).
    pub fn source_channel(&self, o: usize, i: usize, j: usize) -> Option<usize> {
        let repeats = self.repeats()?;
        let ft = self.factor_t;
        Some((((o * ft + ft - 1) * 2 + i) * 2 + j) / repeats)
    }
}

/// The DupUp3D shortcut into `y` `[4 h w, padded(out_c)]` (kernel qv_dup_up).
pub fn plan_dup_up(
    x: DeviceSpan,
    shape: DupUpShape,
    y: DeviceSpan,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae dup_up";
    let repeats = shape.repeats().ok_or_else(|| {
        invalid(
            OP,
            format!(
                "{} output channels x {} sub-positions must be a positive multiple of {} input channels",
                shape.out_c,
                shape.factor_t * 4,
                shape.in_c
            ),
        )
    })?;
    if shape.factor_t == 0 {
        return Err(invalid(OP, "factor_t must be at least 1"));
    }
    let (in_cp, out_cp) = (padded_channels(shape.in_c), padded_channels(shape.out_c));
    check_span(
        OP,
        "x",
        x,
        bytes_of(OP, "x", &[shape.h, shape.w, in_cp, BF16])?,
        16,
    )?;
    let out_elems = bytes_of(OP, "y", &[4, shape.h, shape.w, out_cp])?;
    check_span(OP, "y", y, bytes_of(OP, "y", &[out_elems, BF16])?, 16)?;
    // The kernel indexes the output in 32 bits.
    to_i32(OP, "4 * h * w * out_cp", out_elems)?;
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push(to_i32(OP, "h", shape.h)?)
        .push(to_i32(OP, "w", shape.w)?)
        .push(to_i32(OP, "in_cp", in_cp)?)
        .push(to_i32(OP, "out_c", shape.out_c)?)
        .push(to_i32(OP, "out_cp", out_cp)?)
        .push(to_i32(OP, "factor_t", shape.factor_t)?)
        .push(to_i32(OP, "repeats", repeats)?)
        .push_addr(y.addr);
    Ok(Launch::from_spans(
        "qv_dup_up",
        stride_grid(OP, out_elems, THREADS)?,
        args,
    ))
}

/// The nearest 2x upsample of `x` `[h, w, cp]` into `y` `[2 h, 2 w, cp]` (kernel qv_upsample2x).
pub fn plan_upsample2x(
    x: DeviceSpan,
    (h, w, cp): (usize, usize, usize),
    y: DeviceSpan,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae upsample2x";
    check_padded(OP, "cp", cp)?;
    if h == 0 || w == 0 {
        return Err(invalid(OP, format!("an empty {h} x {w} map")));
    }
    check_span(OP, "x", x, bytes_of(OP, "x", &[h, w, cp, BF16])?, 16)?;
    let out_elems = bytes_of(OP, "y", &[4, h, w, cp])?;
    check_span(OP, "y", y, bytes_of(OP, "y", &[out_elems, BF16])?, 16)?;
    // The kernel indexes in 32 bits.
    to_i32(OP, "4 * h * w * cp", out_elems)?;
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push(to_i32(OP, "h", h)?)
        .push(to_i32(OP, "w", w)?)
        .push(to_i32(OP, "cp", cp)?)
        .push_addr(y.addr);
    Ok(Launch::from_spans(
        "qv_upsample2x",
        stride_grid(OP, out_elems / 8, THREADS)?,
        args,
    ))
}

/// Row softmax of f32 scores `[rows, cols]` into bf16 probabilities of the same shape (kernel qv_softmax_rows).
pub fn plan_softmax_rows(
    scores: DeviceSpan,
    rows: usize,
    cols: usize,
    probs: DeviceSpan,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "vae softmax_rows";
    if rows == 0 || cols == 0 {
        return Err(invalid(
            OP,
            format!("{rows} x {cols} scores: both must be positive"),
        ));
    }
    check_span(
        OP,
        "scores",
        scores,
        bytes_of(OP, "scores", &[rows, cols, F32])?,
        4,
    )?;
    check_span(
        OP,
        "probs",
        probs,
        bytes_of(OP, "probs", &[rows, cols, BF16])?,
        2,
    )?;
    let mut args = Args::new();
    args.push_addr(scores.addr)
        .push(to_i32(OP, "cols", cols)?)
        .push_addr(probs.addr);
    Ok(Launch::from_spans(
        "qv_softmax_rows",
        LaunchConfig::new(to_u32(OP, "rows", rows)?, THREADS),
        args,
    ))
}

/// What a decode's last kernel makes of the channels-last f32 result `[pixels, cp]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageOut {
    /// One image's planes `[channels, pixels]` f32, clamped to [-1, 1] (kernel qv_planes_clamp).
    Planes,
    /// One image's 8-bit pixels `[pixels, channels]` (channel-interleaved, as a PNG row holds them): the bytes
    /// [`super::vae::to_u8_hwc`] makes from the clamped planes (kernel qv_image_u8).
    Pixels,
}

/// The launch writing `out` from the result `y` `[pixels, cp]` as `kind` asks.
pub fn plan_image_out(
    kind: ImageOut,
    y: DeviceSpan,
    (pixels, channels, cp): (usize, usize, usize),
    out: DeviceSpan,
) -> Result<Launch<'static>, tf_cuda::Error> {
    match kind {
        ImageOut::Planes => plan_from_result(
            "vae planes_clamp",
            "qv_planes_clamp",
            y,
            (pixels, channels, cp),
            out,
            F32,
        ),
        ImageOut::Pixels => plan_from_result(
            "vae image_u8",
            "qv_image_u8",
            y,
            (pixels, channels, cp),
            out,
            1,
        ),
    }
}

/// A kernel that reads the channels-last f32 result `y` `[pixels, cp]` and writes `pixels * channels` values of
/// `out_size` bytes, one thread per value (indexed in 32 bits by the kernel).
fn plan_from_result(
    op: &str,
    kernel: &'static str,
    y: DeviceSpan,
    (pixels, channels, cp): (usize, usize, usize),
    out: DeviceSpan,
    out_size: usize,
) -> Result<Launch<'static>, tf_cuda::Error> {
    if channels == 0 || channels > cp {
        return Err(invalid(
            op,
            format!("channels = {channels} must be in 1..={cp}"),
        ));
    }
    check_span(op, "y", y, bytes_of(op, "y", &[pixels, cp, F32])?, 4)?;
    let values = bytes_of(op, "out", &[pixels, channels])?;
    check_span(
        op,
        "out",
        out,
        bytes_of(op, "out", &[values, out_size])?,
        out_size as u64,
    )?;
    to_i32(op, "pixels * channels", values)?;
    let mut args = Args::new();
    args.push_addr(y.addr)
        .push(to_i32(op, "pixels", pixels)?)
        .push(to_i32(op, "channels", channels)?)
        .push(to_i32(op, "cp", cp)?)
        .push_addr(out.addr);
    Ok(Launch::from_spans(
        kernel,
        stride_grid(op, values, THREADS)?,
        args,
    ))
}

/// The loaded `qwen_image_vae` kernels of one context.
pub struct VaeKernels {
    set: LoadedSet,
}

impl std::fmt::Debug for VaeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VaeKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl VaeKernels {
    /// Loads the `qwen_image_vae` set into `ctx` and looks every kernel up.
    pub fn load(ctx: &Context) -> Result<VaeKernels, LoadKernelsError> {
        Ok(VaeKernels {
            set: LoadedSet::load(ctx, VAE_SET, VAE_KERNELS)?,
        })
    }

    /// Submits a launch built by one of this module's `plan_*` functions.
    ///
    /// # Safety
    ///
    /// The launch addresses raw [`DeviceSpan`]s: every span it was planned over must lie in device memory of
    /// `stream`'s context that is allocated now (a `DeviceBuffer` then stays valid for the queued work, since
    /// its `Drop` synchronizes the context before freeing).
    pub unsafe fn submit(
        &self,
        stream: &Stream,
        launch: &Launch<'_>,
    ) -> Result<(), tf_cuda::Error> {
        // SAFETY: forwarded contract: the caller vouches for the spans.
        unsafe { self.set.submit_spans(stream, launch) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn span(addr: u64, bytes: usize) -> DeviceSpan {
        DeviceSpan::new(addr, bytes)
    }

    #[test]
    fn padding_rounds_up_to_eight() {
        assert_eq!(padded_channels(1), 8);
        assert_eq!(padded_channels(8), 8);
        assert_eq!(padded_channels(9), 16);
        assert_eq!(padded_channels(1152), 1152);
        assert_eq!(padded_channels(4), 8);
    }

    #[test]
    fn upsample_plan_counts_chunks_and_refuses_bad_operands() {
        // 3 x 5 pixels of 16 channels into 6 x 10: 4 * 15 * 16 / 8 = 120 chunks of 8 channels.
        let (x_bytes, y_bytes) = (3 * 5 * 16 * BF16, 4 * 3 * 5 * 16 * BF16);
        let launch =
            plan_upsample2x(span(0x1000, x_bytes), (3, 5, 16), span(0x8000, y_bytes)).unwrap();
        assert_eq!(launch.kernel, "qv_upsample2x");
        assert_eq!(launch.args.get::<i32>(3), Some(16));
        for (x, shape, y, rule) in [
            (
                span(0x1000, x_bytes),
                (3, 5, 12),
                span(0x8000, y_bytes),
                "multiple of 8",
            ),
            (
                span(0x1000, x_bytes),
                (0, 5, 16),
                span(0x8000, y_bytes),
                "empty",
            ),
            (
                span(0x1000, x_bytes),
                (3, 5, 16),
                span(0x8000, y_bytes - 16),
                "y: needs",
            ),
            (
                span(0x1008, x_bytes),
                (3, 5, 16),
                span(0x8000, y_bytes),
                "x",
            ),
        ] {
            let err = plan_upsample2x(x, shape, y).unwrap_err().to_string();
            assert!(err.contains(rule), "{shape:?}: {err}");
        }
    }

    #[test]
    fn norm_plan_packs_the_scale_and_refuses_short_spans() {
        let bytes = 10 * 16 * BF16;
        let launch = plan_rms_norm_silu(
            span(0x1000, bytes),
            span(0x1000, bytes),
            span(0x9000, 64),
            10,
            9,
            16,
            true,
        )
        .unwrap();
        assert_eq!(launch.kernel, "qv_rms_norm_silu");
        assert_eq!(launch.args.get::<f32>(5), Some(3.0));
        assert_eq!(launch.args.get::<i32>(6), Some(1));
        assert_eq!(launch.config.grid.x, 2); // 10 pixels, 8 per block
        let short = plan_rms_norm_silu(
            span(0x1000, bytes - 2),
            span(0x1000, bytes),
            span(0x9000, 64),
            10,
            9,
            16,
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(short.contains("x: needs"), "{short}");
        assert!(plan_rms_norm_silu(
            span(0x1008, bytes),
            span(0x1000, bytes),
            span(0x9000, 64),
            10,
            9,
            16,
            false
        )
        .is_err());
        assert!(plan_rms_norm_silu(
            span(0x1000, bytes),
            span(0x1000, bytes),
            span(0x9000, 64),
            10,
            17,
            16,
            false
        )
        .is_err());
        assert!(plan_rms_norm_silu(
            span(0x1000, bytes),
            span(0x1000, bytes),
            span(0x9000, 64),
            10,
            9,
            12,
            false
        )
        .is_err());
    }

    #[test]
    fn image_u8_plan_checks_channels_and_sizes() {
        let y = span(0x1000, 10 * 8 * F32);
        let px = |pixels, channels, bytes| {
            plan_image_out(
                ImageOut::Pixels,
                y,
                (pixels, channels, 8),
                span(0x9000, bytes),
            )
        };
        let launch = px(10, 3, 30).unwrap();
        assert_eq!(launch.kernel, "qv_image_u8");
        assert_eq!(launch.args.get::<i32>(2), Some(3));
        assert!(px(10, 3, 29).is_err());
        assert!(px(10, 9, 90).is_err());
        assert!(px(11, 3, 33).is_err());
        // The planes are f32: four bytes a value.
        let planes = plan_image_out(ImageOut::Planes, y, (10, 3, 8), span(0x9000, 120)).unwrap();
        assert_eq!(planes.kernel, "qv_planes_clamp");
        assert!(plan_image_out(ImageOut::Planes, y, (10, 3, 8), span(0x9000, 119)).is_err());
    }

    #[test]
    fn im2col_plan_checks_the_band_and_the_source() {
        let band = Im2colBand {
            out_h: 8,
            out_w: 6,
            cp: 16,
            upsample: true,
            row0: 2,
            rows: 3,
        };
        let src = span(0x1000, 4 * 3 * 16 * BF16); // the 4 x 3 map before the upsample
        let cols = span(0x100000, band.elements().unwrap() * BF16);
        let launch = plan_im2col3x3(src, band, cols).unwrap();
        assert_eq!(launch.args.get::<i32>(4), Some(1));
        assert_eq!(launch.args.get::<i32>(5), Some(2));
        // One thread per 8-channel chunk of an output pixel, for all 9 taps.
        assert_eq!(
            launch.config.grid.x as usize,
            (3 * 6 * 2usize).div_ceil(256)
        );
        // A source too small for the un-upsampled map, a band past the bottom, odd sizes with the upsample.
        let flat = Im2colBand {
            upsample: false,
            ..band
        };
        assert!(plan_im2col3x3(src, flat, cols).is_err());
        let past = Im2colBand { row0: 6, ..band };
        assert!(plan_im2col3x3(src, past, cols).is_err());
        let odd = Im2colBand { out_w: 5, ..band };
        assert!(plan_im2col3x3(src, odd, cols).is_err());
        let short = span(0x100000, band.elements().unwrap() * BF16 - 16);
        assert!(plan_im2col3x3(src, band, short).is_err());
    }

    #[test]
    fn dup_up_rule_matches_the_reference_examples() {
        // 8 -> 2 channels, factor_t 2: repeats 2, first frame keeps t = 1.
        let s = DupUpShape {
            h: 1,
            w: 1,
            in_c: 8,
            out_c: 2,
            factor_t: 2,
        };
        assert_eq!(s.repeats(), Some(2));
        let got: Vec<usize> = (0..2)
            .flat_map(|o| (0..4).map(move |ij| (o, ij)))
            .map(|(o, ij)| s.source_channel(o, ij / 2, ij % 2).unwrap())
            .collect();
        assert_eq!(got, vec![2, 2, 3, 3, 6, 6, 7, 7]);
        // Released widths: 1152 -> 576 with factor_t 2 repeats 4; 576 -> 288 without, repeats 2.
        let full = DupUpShape {
            h: 64,
            w: 64,
            in_c: 1152,
            out_c: 576,
            factor_t: 2,
        };
        assert_eq!(full.repeats(), Some(4));
        assert_eq!(full.source_channel(575, 1, 1), Some(1151));
        let bad = DupUpShape { in_c: 7, ..full };
        assert!(bad.repeats().is_none());
        let y_bytes = 4 * 64 * 64 * 576 * BF16;
        assert!(plan_dup_up(
            span(0x1000, 64 * 64 * 1152 * BF16),
            full,
            span(0x10_0000_0000, y_bytes)
        )
        .is_ok());
        assert!(plan_dup_up(
            span(0x1000, 64 * 64 * 1152 * BF16),
            bad,
            span(0x10_0000_0000, y_bytes)
        )
        .is_err());
        assert!(plan_dup_up(
            span(0x1000, 64 * 64 * 1152 * BF16),
            full,
            span(0x10_0000_0000, y_bytes - 2)
        )
        .is_err());
    }

    #[test]
    fn small_plans_check_their_operands() {
        assert!(
            plan_softmax_rows(span(0x1000, 24 * 24 * 4), 24, 24, span(0x8000, 24 * 24 * 2)).is_ok()
        );
        assert!(plan_softmax_rows(
            span(0x1000, 24 * 24 * 4 - 4),
            24,
            24,
            span(0x8000, 24 * 24 * 2)
        )
        .is_err());
        assert!(plan_softmax_rows(span(0x1000, 0), 0, 24, span(0x8000, 0)).is_err());
        // 4 of 8 padded channels fit; 9 do not.
        for (channels, fits) in [(4, true), (9, false)] {
            let out = span(0x8000, 16 * channels * 4);
            let planes = plan_image_out(
                ImageOut::Planes,
                span(0x1000, 16 * 8 * 4),
                (16, channels, 8),
                out,
            );
            assert_eq!(planes.is_ok(), fits, "{channels} channels");
        }
        let launch = plan_denormalize(
            span(0x1000, 24 * 4 * 4),
            24,
            4,
            span(0x2000, 16),
            span(0x3000, 16),
            span(0x4000, 24 * 8 * 2),
            8,
        )
        .unwrap();
        assert_eq!(launch.args.len(), 7);
        assert!(plan_denormalize(
            span(0x1000, 24 * 4 * 4),
            24,
            9,
            span(0x2000, 36),
            span(0x3000, 36),
            span(0x4000, 24 * 8 * 2),
            8
        )
        .is_err());
    }

    proptest! {
        /// Every output channel of a valid DupUp shape reads an input channel that exists, and every input
        /// channel is read by the same number of (channel, sub-pixel) slots when factor_t is 1.
        #[test]
        fn dup_up_sources_stay_in_range(in_c in 1usize..64, mult in 1usize..5, factor_t in 1usize..3) {
            let out_c = in_c * mult;
            let s = DupUpShape { h: 1, w: 1, in_c, out_c, factor_t };
            let repeats = s.repeats().unwrap();
            let mut reads = vec![0usize; in_c];
            for o in 0..out_c {
                for ij in 0..4 {
                    let c = s.source_channel(o, ij / 2, ij % 2).unwrap();
                    prop_assert!(c < in_c);
                    reads[c] += 1;
                }
            }
            if factor_t == 1 {
                prop_assert!(reads.iter().all(|&r| r == repeats));
            }
        }

        /// The grid-stride launch never asks for more than the cap and always at least one block.
        #[test]
        fn stride_grid_is_bounded(work in 0usize..1usize << 40) {
            let g = stride_grid("t", work, THREADS).unwrap();
            prop_assert!(g.grid.x >= 1 && g.grid.x as usize <= crate::nn::gpu::launch::MAX_STRIDE_BLOCKS);
        }
    }
}
