//! The geometry of a video VAE decode, as the reference lays it out: temporal chunks ([`ChunkGeometry`],
//! [`ChunkPlan`]), spatial tiles ([`TilingOptions`], [`split_tiles`], [`TilePlan`]), the ViT's RoPE tables over a
//! tile's normalized grid ([`rope_tables`]), and the host pieces that put decoded tiles and chunks together
//! ([`unpatchify`], [`stitch_tiles`], the `_blend` weights). The GPU backend plans with the same functions.

use super::ROPE_AXES;

/// The temporal chunking of a decode, derived from `clip_length`, the temporal ratio and `token_drop` as the
/// reference derives it (released: 5 latents per chunk, 2 overlap latents, 3 pre-padding frames, 5 cross-faded
/// frames, clips of 28 frames of which frames 3..20 are the chunk and 23..28 the overlap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkGeometry {
    /// Pixel frames per latent frame.
    pub temporal_ratio: usize,
    /// `clip_length`: pixel frames a chunk contributes.
    pub clip_length: usize,
    /// `token_drop`.
    pub token_drop: usize,
    /// `ceil(clip_length / temporal_ratio)`: latents per chunk.
    pub tokens_chunk_size: usize,
    /// `(-clip_length) mod temporal_ratio`: leading frames of every clip that are dropped.
    pub frame_pre_padding: usize,
    /// `(-token_drop) mod tokens_chunk_size`: latents a clip decodes past its chunk.
    pub token_overlap: usize,
    /// `max(token_overlap * temporal_ratio - frame_pre_padding, 0)`: frames cross-faded between chunks.
    pub frame_overlap: usize,
}

/// How a decode of a given number of latent frames is chunked ([`ChunkGeometry::plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Latent frames asked for.
    pub latent_frames: usize,
    /// Copies of the last latent appended to make whole chunks.
    pub pad_tokens: usize,
    /// Temporal chunks (clips) decoded.
    pub chunks: usize,
    /// Pixel frames cut from the end (produced by the padding latents).
    pub pad_frames: usize,
    /// Pixel frames of the decoded video.
    pub out_frames: usize,
}

impl ChunkGeometry {
    /// The geometry of `clip_length`, `temporal_ratio` and `token_drop` (all validated positive where needed).
    pub fn new(clip_length: usize, temporal_ratio: usize, token_drop: usize) -> ChunkGeometry {
        let pt = temporal_ratio.max(1);
        let chunk = clip_length.div_ceil(pt).max(1);
        let pre = (pt - clip_length % pt) % pt;
        let overlap = (chunk - token_drop % chunk) % chunk;
        ChunkGeometry {
            temporal_ratio: pt,
            clip_length,
            token_drop,
            tokens_chunk_size: chunk,
            frame_pre_padding: pre,
            token_overlap: overlap,
            frame_overlap: (overlap * pt).saturating_sub(pre),
        }
    }

    /// Latents one clip decodes: the chunk and its overlap.
    pub fn clip_latents(&self) -> usize {
        self.tokens_chunk_size + self.token_overlap
    }

    /// Pixel frames of one decoded clip.
    pub fn clip_frames(&self) -> usize {
        self.clip_latents() * self.temporal_ratio
    }

    /// Pixel frames per chunk before the pre-padding is dropped (`clip[:, :, :chunk_frames]`).
    pub fn chunk_frames(&self) -> usize {
        self.tokens_chunk_size * self.temporal_ratio
    }

    /// Frames a chunk contributes: `chunk_frames - frame_pre_padding` (= `clip_length`).
    pub fn head_frames(&self) -> usize {
        self.chunk_frames() - self.frame_pre_padding
    }

    /// Frames of a clip's overlap (cross-faded into the next chunk, or appended after the last one); 0 without a
    /// token drop.
    pub fn tail_frames(&self) -> usize {
        if self.token_drop == 0 {
            0
        } else {
            (self.clip_frames().min(2 * self.chunk_frames()) - self.chunk_frames())
                .saturating_sub(self.frame_pre_padding)
        }
    }

    /// Frames cross-faded where two chunks meet (`min(tail, head, frame_overlap)`).
    pub fn blend_frames(&self) -> usize {
        self.tail_frames()
            .min(self.head_frames())
            .min(self.frame_overlap)
    }

    /// The fewest latent frames the reference decodes (fewer give no chunk at all).
    pub fn min_latent_frames(&self) -> usize {
        let chunk = self.tokens_chunk_size;
        // chunks = ceil((F + drop) / chunk) - (drop > 0) >= 1  <=>  F + drop > chunk * (drop > 0).
        if self.token_drop > 0 {
            (chunk + 1).saturating_sub(self.token_drop).max(1)
        } else {
            1
        }
    }

    /// The chunking of `latent_frames` latents, as `_decode` does it.
    pub fn plan(&self, latent_frames: usize) -> Result<ChunkPlan, String> {
        let chunk = self.tokens_chunk_size;
        let pt = self.temporal_ratio;
        if latent_frames < self.min_latent_frames() {
            return Err(format!(
                "{latent_frames} latent frames: the reference decodes at least {} (fewer make no chunk)",
                self.min_latent_frames()
            ));
        }
        let tokens = latent_frames + self.token_drop;
        let pad_tokens = (chunk - tokens % chunk) % chunk;
        let chunks = (tokens + pad_tokens) / chunk - usize::from(self.token_drop > 0);
        let intra_tail = self.clip_length % pt;
        let pad_frames: usize = (0..pad_tokens)
            .map(|k| {
                if intra_tail != 0 && (latent_frames + k).is_multiple_of(chunk) {
                    intra_tail
                } else {
                    pt
                }
            })
            .sum();
        let total = chunks * self.head_frames() + self.tail_frames();
        let out_frames = total
            .checked_sub(pad_frames)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{latent_frames} latent frames decode to no pixel frame"))?;
        Ok(ChunkPlan {
            latent_frames,
            pad_tokens,
            chunks,
            pad_frames,
            out_frames,
        })
    }
}

/// Spatial tiling of a decode: on by default with the released geometry (256 px tiles, at least 64 px overlap),
/// which is what the released frames were made with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TilingOptions {
    pub enabled: bool,
    /// Tile height and width in pixels.
    pub tile_height: usize,
    pub tile_width: usize,
    /// Least overlap between neighbouring tiles, in pixels.
    pub min_overlap_height: usize,
    pub min_overlap_width: usize,
}

impl Default for TilingOptions {
    fn default() -> Self {
        TilingOptions {
            enabled: true,
            tile_height: 256,
            tile_width: 256,
            min_overlap_height: 64,
            min_overlap_width: 64,
        }
    }
}

impl TilingOptions {
    /// No tiling: every clip decodes the whole frame at once.
    pub fn disabled() -> TilingOptions {
        TilingOptions {
            enabled: false,
            ..TilingOptions::default()
        }
    }

    /// Checks the geometry against the spatial ratio: tiles and overlaps whole multiples of it (so tiles cover a
    /// frame exactly on the latent grid), overlaps below the tile size.
    pub fn check(&self, spatial_ratio: usize) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        for (name, tile, overlap) in [
            ("height", self.tile_height, self.min_overlap_height),
            ("width", self.tile_width, self.min_overlap_width),
        ] {
            if tile == 0
                || !tile.is_multiple_of(spatial_ratio)
                || !overlap.is_multiple_of(spatial_ratio)
            {
                return Err(format!(
                    "tile {name} {tile} px and overlap {overlap} px must be multiples of the spatial ratio {spatial_ratio} (tile > 0)"
                ));
            }
            // An overlap of 0 would make the reference crop whole tiles away (`tile[..., :-0]` is empty).
            if overlap == 0 || overlap >= tile {
                return Err(format!(
                    "tile {name} overlap {overlap} px must be positive and below the tile size {tile} px"
                ));
            }
        }
        Ok(())
    }
}

/// Tiles along one axis, in pixels: where each starts, their common size, and the overlap of each with the next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AxisTiles {
    pub starts: Vec<usize>,
    pub size: usize,
    pub overlaps: Vec<usize>,
}

/// `_split_tiles`: the fewest `tile`-px tiles covering `length` px with overlaps of at least `min_overlap`, the
/// slack spread round-robin over the overlaps in steps of `ratio`. One tile of the whole length when it fits.
pub fn split_tiles(
    length: usize,
    tile: usize,
    min_overlap: usize,
    ratio: usize,
) -> Result<AxisTiles, String> {
    if tile >= length {
        return Ok(AxisTiles {
            starts: vec![0],
            size: length,
            overlaps: Vec::new(),
        });
    }
    if min_overlap >= tile || ratio == 0 {
        return Err(format!(
            "overlap {min_overlap} px must be below the tile size {tile} px"
        ));
    }
    // The reference's loop from ceil(length / tile) upwards stops at the first n with
    // n * (tile - overlap) >= length - overlap.
    let n = length
        .div_ceil(tile)
        .max((length - min_overlap).div_ceil(tile - min_overlap));
    let mut overlaps = vec![min_overlap; n - 1];
    let covered = tile * n - min_overlap * (n - 1);
    let remaining = covered - length;
    for i in 0..remaining / ratio {
        overlaps[i % (n - 1)] += ratio;
    }
    let mut starts = vec![0usize];
    for &o in &overlaps {
        if o >= tile {
            return Err(format!(
                "an overlap of {o} px reaches the tile size {tile} px over {length} px"
            ));
        }
        let last = starts.last().copied().unwrap_or(0);
        starts.push(last + tile - o);
    }
    if starts.last().copied().unwrap_or(0) + tile != length {
        return Err(format!(
            "{n} tiles of {tile} px do not cover {length} px exactly (sizes must be multiples of the spatial ratio {ratio})"
        ));
    }
    Ok(AxisTiles {
        starts,
        size: tile,
        overlaps,
    })
}

/// The tiles of a `height x width` px frame (latent grid `h x w` at `ratio` px per latent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TilePlan {
    pub y: AxisTiles,
    pub x: AxisTiles,
    pub ratio: usize,
}

impl TilePlan {
    /// Lays the tiles of `options` over an `h x w` latent grid (one tile when tiling is off).
    pub fn new(
        h: usize,
        w: usize,
        ratio: usize,
        options: &TilingOptions,
    ) -> Result<TilePlan, String> {
        options.check(ratio)?;
        let (height, width) = (h * ratio, w * ratio);
        if !options.enabled {
            let one = |n| AxisTiles {
                starts: vec![0],
                size: n,
                overlaps: Vec::new(),
            };
            return Ok(TilePlan {
                y: one(height),
                x: one(width),
                ratio,
            });
        }
        Ok(TilePlan {
            y: split_tiles(
                height,
                options.tile_height,
                options.min_overlap_height,
                ratio,
            )?,
            x: split_tiles(width, options.tile_width, options.min_overlap_width, ratio)?,
            ratio,
        })
    }

    /// Tiles per clip.
    pub fn count(&self) -> usize {
        self.y.starts.len() * self.x.starts.len()
    }

    /// Latent rows and columns of every tile.
    pub fn latent_size(&self) -> (usize, usize) {
        (self.y.size / self.ratio, self.x.size / self.ratio)
    }

    /// Latent origin (row, column) of tile `(i, j)`.
    pub fn latent_origin(&self, i: usize, j: usize) -> (usize, usize) {
        (self.y.starts[i] / self.ratio, self.x.starts[j] / self.ratio)
    }
}

/// `2 (i + 0.5) / n - 1` for `i < n`, in f32 as the reference computes its grid.
fn axis_grid(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| 2.0f32 * ((i as f32 + 0.5) / n as f32) - 1.0)
        .collect()
}

/// Rotate-half RoPE tables of one decoded tile: `[tokens, rope_dim / 2]` cos and sin, tokens in the decoder's
/// order (`frames x rows x cols` voxels, then `registers + 1` tokens at position 0). Column `a * k + j` (`k =
/// rope_dim / 6`) is axis `a`'s frequency `j`: angle `f32(2 pi) * pos_a * inv_freq_j`, `inv_freq_j = 1 / theta^(j
/// * 6 / rope_dim)`, all in f32 as the reference computes them.
pub fn rope_tables(
    (frames, rows, cols): (usize, usize, usize),
    registers: usize,
    rope_dim: usize,
    theta: f64,
) -> (Vec<f32>, Vec<f32>) {
    let k = rope_dim / (2 * ROPE_AXES);
    let step = (2 * ROPE_AXES) as f64 / rope_dim as f64;
    let theta = theta as f32;
    let inv_freq: Vec<f32> = (0..k)
        .map(|j| 1.0f32 / theta.powf((j as f64 * step) as f32))
        .collect();
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    let (gt, gy, gx) = (axis_grid(frames), axis_grid(rows), axis_grid(cols));
    let half = ROPE_AXES * k;
    let tokens = frames * rows * cols + registers + 1;
    let mut cos = vec![1.0f32; tokens * half];
    let mut sin = vec![0.0f32; tokens * half];
    let mut n = 0;
    for &t in &gt {
        for &y in &gy {
            for &x in &gx {
                for (a, &p) in [t, y, x].iter().enumerate() {
                    let scaled = two_pi * p;
                    for (j, &f) in inv_freq.iter().enumerate() {
                        let angle = scaled * f;
                        cos[n * half + a * k + j] = angle.cos();
                        sin[n * half + a * k + j] = angle.sin();
                    }
                }
                n += 1;
            }
        }
    }
    (cos, sin)
}

/// The decoder's un-patchify: `proj_out` rows `[frames * rows * cols, oc * pt * ps * ps]` to `[oc, frames * pt,
/// rows * ps, cols * ps]`; value `(c, t, y, x)` of the token `(t / pt, y / ps, x / ps)` is its column `c pt ps^2 +
/// (t % pt) ps^2 + (y % ps) ps + x % ps`.
pub fn unpatchify(
    out: &[f32],
    (frames, rows, cols): (usize, usize, usize),
    oc: usize,
    pt: usize,
    ps: usize,
) -> Vec<f32> {
    let p = oc * pt * ps * ps;
    let (ft, hh, ww) = (frames * pt, rows * ps, cols * ps);
    let mut video = vec![0f32; oc * ft * hh * ww];
    for c in 0..oc {
        for t in 0..ft {
            for y in 0..hh {
                for x in 0..ww {
                    let token = ((t / pt) * rows + y / ps) * cols + x / ps;
                    let col = ((c * pt + t % pt) * ps + y % ps) * ps + x % ps;
                    video[((c * ft + t) * hh + y) * ww + x] = out[token * p + col];
                }
            }
        }
    }
    video
}

/// `_blend` weights at position `p` of an `extent`-long overlap: `(1 - p / extent, p / extent)` in f32.
pub fn blend_weights(p: usize, extent: usize) -> (f32, f32) {
    let b = p as f32 / extent as f32;
    (1.0 - b, b)
}

/// The temporal cross-fade: the first `extent` frames of `head` (`[oc, frames, frame]`) become `prev[-extent + p]
/// * (1 - p / extent) + head[p] * (p / extent)`.
pub(super) fn blend_frames(
    prev: &[f32],
    head: &mut [f32],
    oc: usize,
    frame: usize,
    overlap: usize,
) {
    let (pn, hn) = (prev.len() / (oc * frame), head.len() / (oc * frame));
    let extent = pn.min(hn).min(overlap);
    for c in 0..oc {
        for p in 0..extent {
            let (wa, wb) = blend_weights(p, extent);
            let a = &prev[(c * pn + pn - extent + p) * frame..][..frame];
            let b = &mut head[(c * hn + p) * frame..][..frame];
            for (bv, &av) in b.iter_mut().zip(a) {
                *bv = av * wa + *bv * wb;
            }
        }
    }
}

/// `_stitch_tiles`: decoded tiles (row-major over the tile grid, each `[planes, size_y, size_x]`) blended with the
/// original tile above and the original tile to the left over their overlaps, cropped, and concatenated into
/// `[planes, height, width]`.
pub fn stitch_tiles(tiles: &[Vec<f32>], plan: &TilePlan, planes: usize) -> Vec<f32> {
    let (ny, nx) = (plan.y.starts.len(), plan.x.starts.len());
    let (ty, tx) = (plan.y.size, plan.x.size);
    let height = plan.y.starts.last().copied().unwrap_or(0) + ty;
    let width = plan.x.starts.last().copied().unwrap_or(0) + tx;
    let mut out = vec![0f32; planes * height * width];
    for i in 0..ny {
        for j in 0..nx {
            let tile = &tiles[i * nx + j];
            let up = (i > 0).then(|| (&tiles[(i - 1) * nx + j], plan.y.overlaps[i - 1].min(ty)));
            let left = (j > 0).then(|| (&tiles[i * nx + j - 1], plan.x.overlaps[j - 1].min(tx)));
            let keep_y = if i + 1 < ny {
                ty - plan.y.overlaps[i]
            } else {
                ty
            };
            let keep_x = if j + 1 < nx {
                tx - plan.x.overlaps[j]
            } else {
                tx
            };
            let (y0, x0) = (plan.y.starts[i], plan.x.starts[j]);
            for p in 0..planes {
                for y in 0..keep_y {
                    for x in 0..keep_x {
                        let at = (p * ty + y) * tx + x;
                        let mut v = tile[at];
                        if let Some((a, ext)) = up {
                            if y < ext {
                                let (wa, wb) = blend_weights(y, ext);
                                v = a[(p * ty + ty - ext + y) * tx + x] * wa + v * wb;
                            }
                        }
                        if let Some((a, ext)) = left {
                            if x < ext {
                                let (wa, wb) = blend_weights(x, ext);
                                v = a[(p * ty + y) * tx + tx - ext + x] * wa + v * wb;
                            }
                        }
                        out[(p * height + y0 + y) * width + x0 + x] = v;
                    }
                }
            }
        }
    }
    out
}
