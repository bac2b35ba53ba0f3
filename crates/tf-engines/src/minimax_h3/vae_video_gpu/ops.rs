//! GPU launchers for the MiniMax H3 video VAE's own kernels (`kernels/minimax_h3/vae_video.cu`, kernel set
//! `minimax_h3_vae_video`): tile tokens, f32 row norms into bf16, clip assembly and the 8-bit frames.
//!
//! Operands are [`DeviceSpan`]s, the currency of the GEMMs around them. Each `plan_*` function checks sizes and
//! alignment against the spans and the integer ranges of the kernel's arguments before anything reaches the
//! driver, and packs the arguments (unit-tested without a GPU); [`VideoVaeKernels`] submits on a stream.

use tf_cuda::cublaslt::DeviceSpan;
use tf_cuda::launch::{Args, LaunchConfig};
use tf_cuda::{Context, Stream};

use crate::nn::gpu::launch::{bytes_of, check_span, stride_grid};
use crate::nn::gpu::{invalid, to_i32, to_u32, Launch, LoadKernelsError, LoadedSet};

/// Name of the kernel set.
pub const VIDEO_VAE_SET: &str = "minimax_h3_vae_video";
/// Threads per block (H3V_THREADS in vae_video.cu).
const THREADS: u32 = 256;
/// Most latent channels the token kernel caches (H3V_MAX_CHANNELS).
pub const MAX_TOKEN_CHANNELS: usize = 1024;
const F32: usize = 4;
const BF16: usize = 2;

const KERNELS: &[&str] = &["h3v_tokens", "h3v_norm", "h3v_assemble", "h3v_frames"];

/// The latent volume a batch of tiles reads: channels-last `[frames][height][width][channels]` f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentVolume {
    pub data: DeviceSpan,
    pub frames: usize,
    pub height: usize,
    pub width: usize,
    pub channels: usize,
}

/// The tokens of a batch of tiles (kernel h3v_tokens): `tiles` tiles of `frames x rows x cols` voxels whose
/// latent origins `(f0, y0, x0)` are the i32 triples of `origins`, each followed by `registers` register tokens
/// and a zero token, into f32 `x` `[tiles * tokens, dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    pub origins: DeviceSpan,
    pub tiles: usize,
    pub tile: (usize, usize, usize),
    pub registers: usize,
    /// proj_in's weight transposed, f32 `[channels, dim]`, and its f32 bias `[dim]`.
    pub weight_t: DeviceSpan,
    pub bias: DeviceSpan,
    /// f32 `[registers, dim]`.
    pub register_tokens: DeviceSpan,
    pub dim: usize,
    pub x: DeviceSpan,
}

impl TokenBatch {
    /// Tokens per tile: voxels, registers and the zero token.
    pub fn tokens(&self) -> Option<usize> {
        let (f, r, c) = self.tile;
        f.checked_mul(r)?
            .checked_mul(c)?
            .checked_add(self.registers)?
            .checked_add(1)
    }
}

/// Builds the token kernel over `latents` (checks every origin's tile lies inside the volume on the host side:
/// `origins` are given as host values too).
pub fn plan_tokens(
    latents: LatentVolume,
    batch: &TokenBatch,
    origins: &[[i32; 3]],
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 video tokens";
    let l = latents;
    if l.channels == 0 || l.channels > MAX_TOKEN_CHANNELS {
        return Err(invalid(
            OP,
            format!(
                "{} latent channels: the kernel takes 1..={MAX_TOKEN_CHANNELS}",
                l.channels
            ),
        ));
    }
    if origins.len() != batch.tiles || batch.tiles == 0 || batch.dim == 0 {
        return Err(invalid(
            OP,
            format!(
                "{} origins for {} tiles of width {}",
                origins.len(),
                batch.tiles,
                batch.dim
            ),
        ));
    }
    let (tf, tr, tc) = batch.tile;
    for o in origins {
        let inside = |start: i32, len: usize, limit: usize| {
            usize::try_from(start)
                .ok()
                .and_then(|s| s.checked_add(len))
                .is_some_and(|end| end <= limit)
        };
        if !(inside(o[0], tf, l.frames) && inside(o[1], tr, l.height) && inside(o[2], tc, l.width))
        {
            return Err(invalid(
                OP,
                format!(
                    "a {tf} x {tr} x {tc} tile at {o:?} runs outside the {} x {} x {} latents",
                    l.frames, l.height, l.width
                ),
            ));
        }
    }
    let tokens = batch
        .tokens()
        .ok_or_else(|| invalid(OP, "tile size overflows"))?;
    let rows = bytes_of(OP, "rows", &[batch.tiles, tokens])?;
    check_span(
        OP,
        "latents",
        l.data,
        bytes_of(
            OP,
            "latents",
            &[l.frames, l.height, l.width, l.channels, F32],
        )?,
        4,
    )?;
    check_span(OP, "origins", batch.origins, batch.tiles * 3 * 4, 4)?;
    check_span(
        OP,
        "weight_t",
        batch.weight_t,
        bytes_of(OP, "weight_t", &[l.channels, batch.dim, F32])?,
        4,
    )?;
    check_span(OP, "bias", batch.bias, batch.dim * F32, 4)?;
    check_span(
        OP,
        "register_tokens",
        batch.register_tokens,
        bytes_of(OP, "register_tokens", &[batch.registers, batch.dim, F32])?,
        4,
    )?;
    check_span(
        OP,
        "x",
        batch.x,
        bytes_of(OP, "x", &[rows, batch.dim, F32])?,
        4,
    )?;
    let mut args = Args::new();
    args.push_addr(l.data.addr)
        .push(to_i32(OP, "height", l.height)?)
        .push(to_i32(OP, "width", l.width)?)
        .push(to_i32(OP, "channels", l.channels)?)
        .push_addr(batch.origins.addr)
        .push(to_i32(OP, "tile frames", tf)?)
        .push(to_i32(OP, "tile rows", tr)?)
        .push(to_i32(OP, "tile cols", tc)?)
        .push(to_i32(OP, "registers", batch.registers)?)
        .push_addr(batch.weight_t.addr)
        .push_addr(batch.bias.addr)
        .push_addr(batch.register_tokens.addr)
        .push(to_i32(OP, "dim", batch.dim)?)
        .push_addr(batch.x.addr);
    to_i32(OP, "tokens per tile", tokens)?;
    Ok(Launch::from_spans(
        "h3v_tokens",
        LaunchConfig::new(to_u32(OP, "rows", rows)?, THREADS),
        args,
    ))
}

/// Which row norm [`plan_norm`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowNorm {
    /// `x * rsqrt(mean(x^2) + eps) * weight`.
    Rms,
    /// `(x - mean) * rsqrt(var + eps) * weight + bias`.
    Layer { bias: DeviceSpan },
}

/// An f32 row norm of `x` `[rows, cols]` into bf16 `y` (kernel h3v_norm), f32 `weight` `[cols]`.
pub fn plan_norm(
    x: DeviceSpan,
    y: DeviceSpan,
    rows: usize,
    cols: usize,
    weight: DeviceSpan,
    kind: RowNorm,
    eps: f32,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 video norm";
    if cols == 0 || rows == 0 || !(eps.is_finite() && eps >= 0.0) {
        return Err(invalid(
            OP,
            format!("{rows} rows of {cols} columns, eps {eps}: rows and columns must be positive, eps finite"),
        ));
    }
    check_span(OP, "x", x, bytes_of(OP, "x", &[rows, cols, F32])?, 4)?;
    check_span(OP, "y", y, bytes_of(OP, "y", &[rows, cols, BF16])?, 2)?;
    check_span(OP, "weight", weight, cols * F32, 4)?;
    let (bias, layer) = match kind {
        RowNorm::Rms => (weight.addr, 0i32),
        RowNorm::Layer { bias } => {
            check_span(OP, "bias", bias, cols * F32, 4)?;
            (bias.addr, 1)
        }
    };
    let mut args = Args::new();
    args.push_addr(x.addr)
        .push_addr(y.addr)
        .push_addr(weight.addr)
        .push_addr(bias)
        .push(to_i32(OP, "cols", cols)?)
        .push(eps)
        .push(layer);
    Ok(Launch::from_spans(
        "h3v_norm",
        LaunchConfig::new(to_u32(OP, "rows", rows)?, THREADS),
        args,
    ))
}

/// Where the decoded tiles of one clip are and how they are laid out (see [`plan_assemble`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClipTiles {
    /// f32 proj_out rows, `tokens` per tile, `patch` values each.
    pub out: DeviceSpan,
    /// Tiles the buffer holds; this clip's tile (0, 0) is tile `tile0`.
    pub tiles_held: usize,
    pub tile0: usize,
    pub tokens: usize,
    pub patch: usize,
    /// The tile grid (i32): `ny` row starts, `ny - 1` row overlaps, `nx` column starts, `nx - 1` column overlaps.
    pub grid: DeviceSpan,
    pub ny: usize,
    pub nx: usize,
    /// Tile size in pixels and in latents.
    pub tile_px: (usize, usize),
    pub tile_latents: (usize, usize, usize),
    /// Temporal and spatial patch sizes, output channels.
    pub pt: usize,
    pub ps: usize,
    pub channels: usize,
}

/// Where a clip's frames go in the video (see [`plan_assemble`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClipFrames {
    pub clip: usize,
    pub clip_frames: usize,
    pub pre: usize,
    pub chunk_frames: usize,
    pub head: usize,
    pub tail: usize,
    pub blend: usize,
}

/// The decoded video: f32 `[frames, height, width, channels]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VideoBuffer {
    pub data: DeviceSpan,
    pub frames: usize,
    pub height: usize,
    pub width: usize,
}

/// Places one clip's decoded tiles into the video (kernel h3v_assemble): un-patchify, blend with the tiles above
/// and to the left, cross-fade with the previous clip's overlap, skip the frames past the video's end.
pub fn plan_assemble(
    tiles: &ClipTiles,
    frames: &ClipFrames,
    video: &VideoBuffer,
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 video assemble";
    let t = tiles;
    let (tf, tr, tc) = t.tile_latents;
    let (th, tw) = t.tile_px;
    if t.ny == 0
        || t.nx == 0
        || t.tile0 + t.ny * t.nx > t.tiles_held
        || tr * t.ps != th
        || tc * t.ps != tw
        || tf * t.pt != frames.clip_frames
        || t.patch != t.channels * t.pt * t.ps * t.ps
        || t.tokens < tf * tr * tc
    {
        return Err(invalid(
            OP,
            format!("inconsistent clip tiles {t:?} for {frames:?}"),
        ));
    }
    let grid_len = 2 * t.ny + 2 * t.nx - 2;
    check_span(OP, "grid", t.grid, grid_len * 4, 4)?;
    check_span(
        OP,
        "out",
        t.out,
        bytes_of(OP, "out", &[t.tiles_held, t.tokens, t.patch, F32])?,
        4,
    )?;
    // The kernel indexes the video and the tiles in 64 bits.
    let video_bytes = bytes_of(
        OP,
        "video",
        &[video.frames, video.height, video.width, t.channels, F32],
    )?;
    check_span(OP, "video", video.data, video_bytes, 4)?;
    let f = frames;
    if f.chunk_frames > f.clip_frames || f.pre > f.chunk_frames || f.blend > f.tail.max(f.head) {
        return Err(invalid(OP, format!("inconsistent clip frames {f:?}")));
    }
    let mut args = Args::new();
    args.push_addr(t.out.addr)
        .push(to_i32(OP, "tile0", t.tile0)?)
        .push(to_i32(OP, "tokens", t.tokens)?)
        .push(to_i32(OP, "patch", t.patch)?)
        .push_addr(t.grid.addr)
        .push(to_i32(OP, "ny", t.ny)?)
        .push(to_i32(OP, "nx", t.nx)?)
        .push(to_i32(OP, "tile height", th)?)
        .push(to_i32(OP, "tile width", tw)?)
        .push(to_i32(OP, "tile rows", tr)?)
        .push(to_i32(OP, "tile cols", tc)?)
        .push(to_i32(OP, "pt", t.pt)?)
        .push(to_i32(OP, "ps", t.ps)?)
        .push(to_i32(OP, "channels", t.channels)?)
        .push(to_i32(OP, "clip", f.clip)?)
        .push(to_i32(OP, "clip frames", f.clip_frames)?)
        .push(to_i32(OP, "pre", f.pre)?)
        .push(to_i32(OP, "chunk frames", f.chunk_frames)?)
        .push(to_i32(OP, "head", f.head)?)
        .push(to_i32(OP, "tail", f.tail)?)
        .push(to_i32(OP, "blend", f.blend)?)
        .push_addr(video.data.addr)
        .push(to_i32(OP, "video frames", video.frames)?)
        .push(to_i32(OP, "height", video.height)?)
        .push(to_i32(OP, "width", video.width)?);
    let work = bytes_of(OP, "pixels", &[f.clip_frames, video.height, video.width])?;
    Ok(Launch::from_spans(
        "h3v_assemble",
        stride_grid(OP, work, THREADS)?,
        args,
    ))
}

/// The pipeline's frames (kernel h3v_frames): `video` (f32 RGB, `pixels * 3`) becomes the clamped de-normalized
/// values in place and `rgb` their 8-bit rounding.
pub fn plan_frames(
    video: DeviceSpan,
    rgb: DeviceSpan,
    pixels: usize,
    mean: [f32; 3],
    std: [f32; 3],
) -> Result<Launch<'static>, tf_cuda::Error> {
    const OP: &str = "h3 video frames";
    let values = bytes_of(OP, "values", &[pixels, 3])?;
    check_span(
        OP,
        "video",
        video,
        bytes_of(OP, "video", &[values, F32])?,
        4,
    )?;
    check_span(OP, "rgb", rgb, values, 1)?;
    let mut args = Args::new();
    args.push_addr(video.addr)
        .push_addr(rgb.addr)
        .push(i64::try_from(pixels).map_err(|_| invalid(OP, "pixels overflow"))?)
        .push(mean[0])
        .push(mean[1])
        .push(mean[2])
        .push(std[0])
        .push(std[1])
        .push(std[2]);
    Ok(Launch::from_spans(
        "h3v_frames",
        stride_grid(OP, values, THREADS)?,
        args,
    ))
}

/// The loaded `minimax_h3_vae_video` kernels of one context.
pub struct VideoVaeKernels {
    set: LoadedSet,
}

impl std::fmt::Debug for VideoVaeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VideoVaeKernels")
            .field("set", &self.set)
            .finish()
    }
}

impl VideoVaeKernels {
    /// Loads the set into `ctx` and looks every kernel up.
    pub fn load(ctx: &Context) -> Result<VideoVaeKernels, LoadKernelsError> {
        Ok(VideoVaeKernels {
            set: LoadedSet::load(ctx, VIDEO_VAE_SET, KERNELS)?,
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

    fn s(addr: u64, bytes: usize) -> DeviceSpan {
        DeviceSpan::new(addr, bytes)
    }

    fn batch(x_bytes: usize) -> TokenBatch {
        TokenBatch {
            origins: s(0x1000, 2 * 12),
            tiles: 2,
            tile: (7, 2, 3),
            registers: 3,
            weight_t: s(0x2000, 4 * 128 * 4),
            bias: s(0x3000, 128 * 4),
            register_tokens: s(0x4000, 3 * 128 * 4),
            dim: 128,
            x: s(0x10000, x_bytes),
        }
    }

    #[test]
    fn tokens_check_the_tiles_against_the_latents() {
        let latents = LatentVolume {
            data: s(0x100000, 12 * 3 * 6 * 4 * 4),
            frames: 12,
            height: 3,
            width: 6,
            channels: 4,
        };
        let rows = 2 * (42 + 4);
        let launch = plan_tokens(latents, &batch(rows * 128 * 4), &[[0, 0, 0], [5, 1, 3]]).unwrap();
        assert_eq!(launch.kernel(), "h3v_tokens");
        assert_eq!(launch.config().grid.x as usize, rows);
        // A tile running past the latents, a short x, a wrong origin count: refused.
        let err = plan_tokens(latents, &batch(rows * 128 * 4), &[[0, 0, 0], [6, 1, 3]])
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside"), "{err}");
        assert!(plan_tokens(latents, &batch(rows * 128 * 4 - 4), &[[0, 0, 0], [5, 1, 3]]).is_err());
        assert!(plan_tokens(latents, &batch(rows * 128 * 4), &[[0, 0, 0]]).is_err());
        let wide = LatentVolume {
            channels: MAX_TOKEN_CHANNELS + 1,
            ..latents
        };
        assert!(plan_tokens(wide, &batch(rows * 128 * 4), &[[0, 0, 0], [5, 1, 3]]).is_err());
    }

    #[test]
    fn norms_and_frames_check_their_spans() {
        let x = s(0x1000, 10 * 64 * 4);
        let y = s(0x8000, 10 * 64 * 2);
        let w = s(0xc000, 64 * 4);
        assert!(plan_norm(x, y, 10, 64, w, RowNorm::Rms, 1e-5).is_ok());
        assert!(plan_norm(x, y, 11, 64, w, RowNorm::Rms, 1e-5).is_err());
        assert!(plan_norm(
            x,
            y,
            10,
            64,
            w,
            RowNorm::Layer {
                bias: s(0xd000, 60)
            },
            1e-5
        )
        .is_err());
        assert!(plan_norm(x, y, 10, 64, w, RowNorm::Rms, f32::NAN).is_err());
        assert!(plan_frames(s(0x1000, 30 * 4), s(0x2000, 30), 10, [0.0; 3], [1.0; 3]).is_ok());
        assert!(plan_frames(s(0x1000, 30 * 4), s(0x2000, 29), 10, [0.0; 3], [1.0; 3]).is_err());
    }

    #[test]
    fn assemble_checks_the_clip_geometry() {
        let tiles = ClipTiles {
            out: s(0x1000, 6 * 46 * 192 * 4),
            tiles_held: 6,
            tile0: 0,
            tokens: 46,
            patch: 192,
            grid: s(0x100, (2 + 1 + 3 + 2) * 4),
            ny: 2,
            nx: 3,
            tile_px: (8, 12),
            tile_latents: (7, 2, 3),
            pt: 4,
            ps: 4,
            channels: 3,
        };
        let frames = ClipFrames {
            clip: 1,
            clip_frames: 28,
            pre: 3,
            chunk_frames: 20,
            head: 17,
            tail: 5,
            blend: 5,
        };
        let video = VideoBuffer {
            data: s(0x1000000, 30 * 12 * 24 * 3 * 4),
            frames: 30,
            height: 12,
            width: 24,
        };
        let launch = plan_assemble(&tiles, &frames, &video).unwrap();
        assert_eq!(launch.kernel(), "h3v_assemble");
        for bad in [
            ClipTiles { tile0: 1, ..tiles },
            ClipTiles {
                patch: 190,
                ..tiles
            },
            ClipTiles {
                tile_px: (8, 16),
                ..tiles
            },
            ClipTiles {
                grid: s(0x100, 4),
                ..tiles
            },
        ] {
            assert!(plan_assemble(&bad, &frames, &video).is_err(), "{bad:?}");
        }
        let short = VideoBuffer {
            data: s(0x1000000, 100),
            ..video
        };
        assert!(plan_assemble(&tiles, &frames, &short).is_err());
    }
}
