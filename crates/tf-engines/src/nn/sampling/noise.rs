//! Seeded initial noise that any implementation can reproduce, and injected noise for parity runs.
//!
//! # The generator (normative)
//!
//! Standard normal samples for a 64-bit `seed`, numbered from 0:
//!
//! 1. Uniforms. The `k`-th uniform (`k = 0, 1, 2, ...`) is `splitmix64(seed + (k + 1) * 0x9E3779B97F4A7C15)` (all
//!    arithmetic wrapping mod 2^64), where `splitmix64(z)` is
//!    `z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB; z ^ (z >> 31)`,
//!    mapped to `[0, 1)` as `(z >> 11) * 2^-53` (exact in f64).
//! 2. Normals by the Marsaglia polar method, in f64: take the next two uniforms `u1, u2`; `a = 2 u1 - 1`,
//!    `b = 2 u2 - 1`, `s = a^2 + b^2`. If `s == 0` or `s >= 1` discard both and take the next two. Otherwise
//!    `f = sqrt(-2 ln(s) / s)` and the next two normals are `a f` then `b f`.
//! 3. Each normal is rounded to f32 (round to nearest even); bf16 latents round that f32 to bf16 (nearest even).
//!
//! Every step is IEEE-754 exact except `ln`, which comes from the platform's math library; a last-ulp
//! difference in the f64 logarithm changes the f32 result only when it straddles an f32 rounding boundary
//! (about one sample in 2^29), so runs agree across machines in practice. The stream is prefix-consistent: the
//! first `n` samples do not depend on how many are drawn.
//!
//! # Latent layout
//!
//! Image `b` of a batch uses seed `seed + b` (wrapping), so an image does not depend on the batch size. Its
//! samples fill the reference's drawing layout `(channels, height, width)` in row-major order, which is then packed
//! like the pipeline packs latents: `(height * width, channels)`, token `row * width + col`, channels last. The
//! result is `[batch, height * width, channels]`.
//!
//! ```
//! use tf_engines::nn::sampling::noise::{packed_latents, normals};
//! use tf_engines::nn::sampling::flow_match::LatentDtype;
//!
//! let first = normals(42, 4);
//! let latents = packed_latents(42, 1, 64, 2, 2, LatentDtype::F32)?;
//! assert_eq!(latents.shape(), &[1, 4, 64]);
//! assert_eq!(latents.data()[0], first[0]); // channel 0 of token 0 is the first sample
//! # Ok::<(), tf_engines::nn::sampling::noise::NoiseError>(())
//! ```

use std::path::Path;

use thiserror::Error;

use crate::nn::sampling::flow_match::LatentDtype;
use crate::nn::tensor::{element_count, Tensor, TensorF32};
use crate::nn::weights::{SafetensorsFile, WeightsError};

/// Errors of noise generation and loading.
#[derive(Debug, Error)]
pub enum NoiseError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("noise: {0}")]
    Invalid(String),
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 output function.
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// An endless stream of standard normal f32 samples for one seed (see the module docs for the algorithm).
#[derive(Debug, Clone)]
pub struct NormalStream {
    seed: u64,
    counter: u64,
    pending: Option<f32>,
}

impl NormalStream {
    /// The stream for `seed`, starting at sample 0.
    pub fn new(seed: u64) -> Self {
        NormalStream {
            seed,
            counter: 0,
            pending: None,
        }
    }

    fn uniform(&mut self) -> f64 {
        self.counter = self.counter.wrapping_add(1);
        let z = splitmix64(
            self.seed
                .wrapping_add(self.counter.wrapping_mul(GOLDEN_GAMMA)),
        );
        (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

impl Iterator for NormalStream {
    type Item = f32;

    fn next(&mut self) -> Option<f32> {
        if let Some(v) = self.pending.take() {
            return Some(v);
        }
        loop {
            let a = 2.0 * self.uniform() - 1.0;
            let b = 2.0 * self.uniform() - 1.0;
            let s = a * a + b * b;
            if s == 0.0 || s >= 1.0 {
                continue;
            }
            let f = (-2.0 * s.ln() / s).sqrt();
            self.pending = Some((b * f) as f32);
            return Some((a * f) as f32);
        }
    }
}

/// Runs `draw` (host work, such as drawing a request's initial noise) on a second thread while `work` runs on this
/// one, and returns both results. A pipeline draws its noise beside the text encoder, which waits on the GPU: the
/// draw (2.8 ms at Qwen-Image's 1024x1024, 9.9 ms for a 5 s MiniMax H3 clip on the 2-core host; `cargo bench -p
/// tf-engines --bench noise`) then costs no time of its own. The draw is sequential and seeded, so its result is
/// the same on either thread. When no thread can be started the draw runs here after `work`.
pub fn draw_beside<T: Send, R>(
    draw: impl Fn() -> T + Sync,
    work: impl FnOnce() -> R,
) -> Result<(R, T), NoiseError> {
    let draw = &draw;
    std::thread::scope(|scope| {
        let spawned = std::thread::Builder::new()
            .name("tf-noise".into())
            .spawn_scoped(scope, draw);
        let result = work();
        match spawned {
            Ok(handle) => handle.join().map(|drawn| (result, drawn)).map_err(|_| {
                NoiseError::Invalid("the thread drawing the noise stopped with a panic".into())
            }),
            Err(_) => Ok((result, draw())),
        }
    })
}

/// The first `count` samples for `seed`.
pub fn normals(seed: u64, count: usize) -> Vec<f32> {
    NormalStream::new(seed).take(count).collect()
}

fn latent_len(
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
) -> Result<usize, NoiseError> {
    if [batch, channels, height, width].contains(&0) {
        return Err(NoiseError::Invalid(format!(
            "a latent of {batch} x {channels} x {height} x {width} is empty; every size must be positive"
        )));
    }
    element_count(&[batch, channels, height, width]).ok_or_else(|| {
        NoiseError::Invalid(format!(
            "a latent of {batch} x {channels} x {height} x {width} does not fit in memory"
        ))
    })
}

/// Initial latents `[batch, height * width, channels]` for `seed`, rounded to `dtype` (values returned as f32).
pub fn packed_latents(
    seed: u64,
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
    dtype: LatentDtype,
) -> Result<TensorF32, NoiseError> {
    let len = latent_len(batch, channels, height, width)?;
    let tokens = height * width;
    let mut data = vec![0f32; len];
    for (b, image) in data.chunks_exact_mut(tokens * channels).enumerate() {
        let mut stream = NormalStream::new(seed.wrapping_add(b as u64));
        for c in 0..channels {
            for (t, v) in stream.by_ref().take(tokens).enumerate() {
                image[t * channels + c] = dtype.round(v);
            }
        }
    }
    Tensor::new(vec![batch, tokens, channels], data).map_err(|e| NoiseError::Invalid(e.to_string()))
}

/// Loads injected noise (e.g. dumped from the reference pipeline) as packed latents
/// `[batch, height * width, channels]`. Accepted layouts of the tensor `name`: the pipeline's draw shape
/// `[batch, 1, channels, height, width]`, the modular pipeline's `[batch, channels, 1, height, width]`, the plain
/// `[batch, channels, height, width]`, or already packed `[batch, height * width, channels]`. F32, BF16 and F16
/// are read.
pub fn load_noise(
    path: &Path,
    name: &str,
    batch: usize,
    channels: usize,
    height: usize,
    width: usize,
) -> Result<TensorF32, NoiseError> {
    // The sizes may come straight from a command line: check their product before using it.
    latent_len(batch, channels, height, width)?;
    let tokens = height * width;
    let file = SafetensorsFile::open(path)?;
    // The shape is checked from the header, before the data is converted.
    let shape = file.info(name)?.shape.clone();
    let packed = [batch, tokens, channels];
    let planar = [
        vec![batch, 1, channels, height, width],
        vec![batch, channels, 1, height, width],
        vec![batch, channels, height, width],
    ];
    if shape == packed {
        return Ok(file.to_f32(name)?);
    }
    if !planar.contains(&shape) {
        return Err(NoiseError::Invalid(format!(
            "{}: tensor {name:?} has shape {shape:?}; expected [{batch}, 1, {channels}, {height}, {width}], \
             [{batch}, {channels}, 1, {height}, {width}], [{batch}, {channels}, {height}, {width}] or \
             [{batch}, {tokens}, {channels}]",
            path.display()
        )));
    }
    let tensor = file.to_f32(name)?;
    let src = tensor.data();
    let mut data = vec![0f32; src.len()];
    for (dst_image, src_image) in data
        .chunks_exact_mut(tokens * channels)
        .zip(src.chunks_exact(tokens * channels))
    {
        for (c, plane) in src_image.chunks_exact(tokens).enumerate() {
            for (t, &v) in plane.iter().enumerate() {
                dst_image[t * channels + c] = v;
            }
        }
    }
    Tensor::new(packed.to_vec(), data).map_err(|e| NoiseError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn drawing_beside_other_work_gives_the_same_noise() {
        let (answer, drawn) = draw_beside(|| normals(11, 1000), || 6 * 7).unwrap();
        assert_eq!(answer, 42);
        assert_eq!(drawn, normals(11, 1000));
        let latents = |seed| packed_latents(seed, 1, 4, 3, 5, LatentDtype::Bf16).unwrap();
        let (_, beside) = draw_beside(|| latents(3), || ()).unwrap();
        assert_eq!(beside.data(), latents(3).data());
    }

    #[test]
    fn splitmix_reference_value() {
        // splitmix64 seeded with 0: the first output of the reference generator (state 0 + gamma).
        assert_eq!(splitmix64(GOLDEN_GAMMA), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn moments_are_standard_normal() {
        let v = normals(123, 200_000);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "variance {var}");
    }

    #[test]
    fn hostile_sizes_are_errors_not_panics() {
        assert!(packed_latents(0, 1, 0, 2, 2, LatentDtype::F32).is_err());
        assert!(packed_latents(0, 1, 64, usize::MAX, 2, LatentDtype::F32).is_err());
        let path = std::path::Path::new("/nonexistent/noise.safetensors");
        let huge = 137_438_953_472;
        let e = load_noise(path, "noise", 1, 64, huge, huge).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        assert!(load_noise(path, "noise", 1, 0, 2, 2).is_err());
    }

    #[test]
    fn batch_images_use_consecutive_seeds() {
        let two = packed_latents(9, 2, 3, 2, 2, LatentDtype::F32).unwrap();
        let second = packed_latents(10, 1, 3, 2, 2, LatentDtype::F32).unwrap();
        assert_eq!(&two.data()[12..], second.data());
    }

    proptest! {
        #[test]
        fn prefix_consistent(seed in any::<u64>(), n in 0usize..300, extra in 0usize..50) {
            let short = normals(seed, n);
            let long = normals(seed, n + extra);
            prop_assert_eq!(&long[..n], short.as_slice());
        }

        #[test]
        fn bf16_latents_are_rounded_f32(seed in any::<u64>()) {
            let f = packed_latents(seed, 1, 4, 2, 3, LatentDtype::F32).unwrap();
            let b = packed_latents(seed, 1, 4, 2, 3, LatentDtype::Bf16).unwrap();
            for (x, y) in f.data().iter().zip(b.data()) {
                prop_assert_eq!(half::bf16::from_f32(*x).to_f32(), *y);
            }
        }
    }
}
