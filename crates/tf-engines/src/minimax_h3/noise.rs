//! MiniMax H3 initial noise: every stream of a request from one portable generator
//! ([`crate::nn::sampling::noise::NormalStream`]) in f32 and in the reference's draw order, or injected from a
//! safetensors file for parity runs; and the patchify that turns the video draw into DiT rows.
//!
//! The reference draws from the request's one generator, in this order (batch 1):
//!
//! 1. each conditioning latent's noise (keyframes or references), in packed order, in its own latent shape;
//! 2. the video noise `(1, C, F, H, W)`;
//! 3. the audio noise, directly in row layout `(2 A, A_C)`: rows `[0, A)` are the left channel, `[A, 2 A)` the right.
//!
//! Here sample `k` of the stream for `seed` fills the tensors in that order, each in row-major order of its draw
//! shape. [`patchify`] packs the video `(1, C, F, H, W)` into rows `(F/pt * H/ph * W/pw, C * pt * ph * pw)`: rows
//! frame-major, then row, then column; feature `((c * pt + t) * ph + y) * pw + x`.
//!
//! ```
//! use tf_engines::minimax_h3::noise::{patchify, H3Noise, NoiseShape};
//! use tf_engines::nn::sampling::noise::normals;
//!
//! let shape = NoiseShape::new(24, 2, 4, 6, 10, 32)?;
//! let noise = H3Noise::generate(7, &shape)?;
//! let first = normals(7, shape.video_len()? + 1);
//! assert_eq!(noise.video.data()[0], first[0]); // video first
//! assert_eq!(noise.audio.data()[0], first[shape.video_len()?]); // then audio, same stream
//! let rows = patchify(&noise.video, [1, 2, 2])?;
//! assert_eq!(rows.shape(), &[2 * 2 * 3, 24 * 4]);
//! # Ok::<(), tf_engines::nn::sampling::noise::NoiseError>(())
//! ```

use std::path::Path;

use crate::nn::sampling::noise::{NoiseError, NormalStream};
use crate::nn::tensor::{element_count, Tensor, TensorF32};
use crate::nn::weights::SafetensorsFile;

/// Name of the video noise in an injection file (`(1, C, F, H, W)` or `(C, F, H, W)`).
pub const VIDEO_NOISE: &str = "video_noise";
/// Name of the audio noise in an injection file (rows `(2 A, A_C)`, or the pipeline's `(1, A_C, 2 A)`).
pub const AUDIO_NOISE: &str = "audio_noise";

/// Elements of one noise tensor at most (2^34 f32 = 64 GiB, far above a 5 s 1344x768 request).
pub const MAX_ELEMENTS: usize = 1 << 34;

/// The sizes of a request's video and audio noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoiseShape {
    /// Video latent channels `C` (24 in the release).
    pub channels: usize,
    /// Latent frames `F`.
    pub frames: usize,
    /// Latent height `H`.
    pub height: usize,
    /// Latent width `W`.
    pub width: usize,
    /// Audio rows `2 A` (both stereo channels).
    pub audio_rows: usize,
    /// Audio latent channels `A_C` (32 in the release).
    pub audio_channels: usize,
}

fn checked_len(what: &str, dims: &[usize]) -> Result<usize, NoiseError> {
    if dims.contains(&0) {
        return Err(NoiseError::Invalid(format!(
            "the {what} noise {dims:?} is empty; every size must be positive"
        )));
    }
    element_count(dims)
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| {
            NoiseError::Invalid(format!(
                "the {what} noise {dims:?} is above the limit of {MAX_ELEMENTS} elements"
            ))
        })
}

impl NoiseShape {
    /// Checked sizes: all positive, each tensor at most [`MAX_ELEMENTS`].
    pub fn new(
        channels: usize,
        frames: usize,
        height: usize,
        width: usize,
        audio_rows: usize,
        audio_channels: usize,
    ) -> Result<Self, NoiseError> {
        let shape = NoiseShape {
            channels,
            frames,
            height,
            width,
            audio_rows,
            audio_channels,
        };
        shape.video_len()?;
        shape.audio_len()?;
        Ok(shape)
    }

    /// The video draw shape `[1, C, F, H, W]`.
    pub fn video_dims(&self) -> [usize; 5] {
        [1, self.channels, self.frames, self.height, self.width]
    }

    /// The audio draw shape `[2 A, A_C]`.
    pub fn audio_dims(&self) -> [usize; 2] {
        [self.audio_rows, self.audio_channels]
    }

    /// Video elements (checked).
    pub fn video_len(&self) -> Result<usize, NoiseError> {
        checked_len("video", &self.video_dims())
    }

    /// Audio elements (checked).
    pub fn audio_len(&self) -> Result<usize, NoiseError> {
        checked_len("audio", &self.audio_dims())
    }
}

/// A request's initial noise in the reference's draw layouts.
#[derive(Debug, Clone, PartialEq)]
pub struct H3Noise {
    /// `[1, C, F, H, W]`.
    pub video: TensorF32,
    /// `[2 A, A_C]`, left channel rows first.
    pub audio: TensorF32,
}

/// What one generator gives a request: the conditioning noises (drawn first), then the video and audio noise.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    /// One tensor per conditioning latent, in the order asked, each in its own shape.
    pub conditions: Vec<TensorF32>,
    /// The generated rows' noise.
    pub noise: H3Noise,
}

fn take(stream: &mut NormalStream, what: &str, dims: &[usize]) -> Result<TensorF32, NoiseError> {
    let len = checked_len(what, dims)?;
    let data: Vec<f32> = stream.by_ref().take(len).collect();
    Tensor::new(dims.to_vec(), data).map_err(|e| NoiseError::Invalid(e.to_string()))
}

/// Draws, from the one stream of `seed`, the conditioning noises of `conditions` (each a latent shape such as
/// `[1, C, f, h, w]`) in order, then the video and the audio noise of `shape`.
pub fn draw(seed: u64, conditions: &[Vec<usize>], shape: &NoiseShape) -> Result<Drawn, NoiseError> {
    shape.video_len()?;
    shape.audio_len()?;
    let mut stream = NormalStream::new(seed);
    let conditions = conditions
        .iter()
        .map(|dims| take(&mut stream, "conditioning", dims))
        .collect::<Result<Vec<_>, _>>()?;
    let video = take(&mut stream, "video", &shape.video_dims())?;
    let audio = take(&mut stream, "audio", &shape.audio_dims())?;
    Ok(Drawn {
        conditions,
        noise: H3Noise { video, audio },
    })
}

impl H3Noise {
    /// The video then the audio noise of `shape` from the stream of `seed` (a request without conditioning).
    pub fn generate(seed: u64, shape: &NoiseShape) -> Result<H3Noise, NoiseError> {
        Ok(draw(seed, &[], shape)?.noise)
    }

    /// Injected noise from a safetensors file: [`VIDEO_NOISE`] as `[1, C, F, H, W]` or `[C, F, H, W]`, and
    /// [`AUDIO_NOISE`] as rows `[2 A, A_C]` or as the pipeline's `audio_latents` input `[1, A_C, 2 A]`. F32, BF16
    /// and F16 are read; the shapes are checked from the header before any data is converted.
    pub fn load(path: &Path, shape: &NoiseShape) -> Result<H3Noise, NoiseError> {
        shape.video_len()?;
        shape.audio_len()?;
        let file = SafetensorsFile::open(path)?;
        let video_shape = file.info(VIDEO_NOISE)?.shape.clone();
        let video_dims = shape.video_dims();
        if video_shape != video_dims && video_shape != video_dims[1..] {
            return Err(NoiseError::Invalid(format!(
                "{}: tensor {VIDEO_NOISE:?} has shape {video_shape:?}; expected {video_dims:?} or {:?}",
                path.display(),
                &video_dims[1..]
            )));
        }
        let audio_shape = file.info(AUDIO_NOISE)?.shape.clone();
        let rows = shape.audio_dims();
        let input = [1, shape.audio_channels, shape.audio_rows];
        let transposed = if audio_shape == rows {
            false
        } else if audio_shape == input {
            true
        } else {
            return Err(NoiseError::Invalid(format!(
                "{}: tensor {AUDIO_NOISE:?} has shape {audio_shape:?}; expected rows {rows:?} or the pipeline's \
                 input layout {input:?}",
                path.display()
            )));
        };
        let video = Tensor::new(video_dims.to_vec(), file.to_f32(VIDEO_NOISE)?.into_data())
            .map_err(|e| NoiseError::Invalid(e.to_string()))?;
        let audio_src = file.to_f32(AUDIO_NOISE)?.into_data();
        let audio_data = if transposed {
            let (r, c) = (shape.audio_rows, shape.audio_channels);
            let mut data = vec![0f32; audio_src.len()];
            for (ch, plane) in audio_src.chunks_exact(r).enumerate() {
                for (row, &v) in plane.iter().enumerate() {
                    data[row * c + ch] = v;
                }
            }
            data
        } else {
            audio_src
        };
        let audio = Tensor::new(rows.to_vec(), audio_data)
            .map_err(|e| NoiseError::Invalid(e.to_string()))?;
        Ok(H3Noise { video, audio })
    }
}

/// Packs video latents `[1, C, F, H, W]` into DiT rows `[F/pt * H/ph * W/pw, C * pt * ph * pw]` (see the module
/// docs for the order). Each latent size must be a multiple of its patch size.
pub fn patchify(video: &TensorF32, patch: [usize; 3]) -> Result<TensorF32, NoiseError> {
    let [b, c, f, h, w] = video
        .dims::<5>("video latents")
        .map_err(|e| NoiseError::Invalid(e.to_string()))?;
    let [pt, ph, pw] = patch;
    if b != 1 || patch.contains(&0) || f % pt != 0 || h % ph != 0 || w % pw != 0 {
        return Err(NoiseError::Invalid(format!(
            "video latents {:?} cannot be patched by {patch:?}: batch 1, and frames, height and width multiples \
             of the patch",
            video.shape()
        )));
    }
    let (nf, nh, nw) = (f / pt, h / ph, w / pw);
    let row_dim = checked_len("row", &[c, pt, ph, pw])?;
    let rows = checked_len("patched video", &[nf, nh, nw])?;
    let src = video.data();
    let mut out = Vec::with_capacity(video.data().len());
    for fi in 0..nf {
        for yi in 0..nh {
            for xi in 0..nw {
                for ci in 0..c {
                    for t in 0..pt {
                        for y in 0..ph {
                            let frame = fi * pt + t;
                            let row_start = ((ci * f + frame) * h + yi * ph + y) * w + xi * pw;
                            out.extend_from_slice(&src[row_start..row_start + pw]);
                        }
                    }
                }
            }
        }
    }
    Tensor::new(vec![rows, row_dim], out).map_err(|e| NoiseError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::sampling::noise::normals;

    #[test]
    fn conditions_then_video_then_audio() {
        let shape = NoiseShape::new(2, 1, 2, 2, 3, 4).unwrap();
        let drawn = draw(5, &[vec![1, 2, 1, 2, 2], vec![3]], &shape).unwrap();
        let all = normals(5, 8 + 3 + 8 + 12);
        assert_eq!(drawn.conditions[0].data(), &all[..8]);
        assert_eq!(drawn.conditions[1].data(), &all[8..11]);
        assert_eq!(drawn.noise.video.data(), &all[11..19]);
        assert_eq!(drawn.noise.audio.data(), &all[19..]);
        assert_eq!(drawn.noise.audio.shape(), &[3, 4]);
    }

    #[test]
    fn hostile_sizes_are_errors() {
        assert!(NoiseShape::new(0, 1, 2, 2, 3, 4).is_err());
        assert!(NoiseShape::new(24, usize::MAX, 2, 2, 3, 4).is_err());
        assert!(NoiseShape::new(24, 1 << 20, 1 << 20, 2, 3, 4).is_err());
        let shape = NoiseShape::new(2, 1, 2, 2, 3, 4).unwrap();
        assert!(draw(0, &[vec![usize::MAX, 2]], &shape).is_err());
        let v = Tensor::new(vec![1, 1, 1, 3, 2], vec![0.0; 6]).unwrap();
        assert!(patchify(&v, [1, 2, 2]).is_err());
        assert!(patchify(&v, [0, 1, 1]).is_err());
    }

    #[test]
    fn patchify_feature_order() {
        // C 2, F 1, H 2, W 2: one row, features c * 4 + y * 2 + x.
        let v = Tensor::new(vec![1, 2, 1, 2, 2], (0..8).map(|i| i as f32).collect()).unwrap();
        let rows = patchify(&v, [1, 2, 2]).unwrap();
        assert_eq!(rows.shape(), &[1, 8]);
        assert_eq!(rows.data(), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    }
}
