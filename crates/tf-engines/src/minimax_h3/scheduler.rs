//! The MiniMax H3 sampler (`MiniMaxH3Scheduler` of diffusers 0.42.1): a rectified-flow Euler schedule with an
//! exponential shift, one instance per modality (video shift 12, audio shift 3), reproduced to the last bit of f32.
//!
//! # The numerics (normative)
//!
//! 1. Base grid of `N` points, terminal 0 included: `step = -1 / (N - 1)` in f32; point `i < N / 2` is
//!    `fma(step, i, 1)` (one rounding, as torch's AVX2 and AVX-512 CPU kernels compute it), point `i >= N / 2` is
//!    `-(step * (N - 1 - i))`.
//! 2. Shift, in f32 arithmetic with `s = f32(shift)` and `s1 = f32(shift - 1)`: `sigma = (s * b) / (1 + s1 * b)`,
//!    every operation rounded to f32. The shift maps 0 to 0, so the terminal stays.
//! 3. Consecutive equal sigmas are collapsed (the shift compresses the grid near 1). `N` points thus give at most
//!    `N - 1` model calls.
//! 4. Timesteps are `t = 1 - sigma` (f32) for every sigma but the terminal one: `t = 0` is pure noise and `t = 1`
//!    is clean. The DiT receives this f32 value whatever the latent dtype.
//! 5. Step `k` (all f32): `x0 = x + (1 - t_k) * v` (the model predicts a data-ward velocity, and the sigma comes from
//!    the timestep, not the grid), `r = sigma_{k+1} / sigma_k`, `x' = r * x + (1 - r) * x0`.
//! 6. Forward noising of a conditioning anchor at level `t` ([`KEYFRAME_NOISE_AUG`] = 0.999 for keyframes):
//!    `x_t = t * x + (1 - t) * noise`, in f32.
//!
//! Given sigmas ([`SigmaSource::Explicit`]) are used verbatim after rounding to f32: no shift, no collapsing; they
//! must be finite, strictly decreasing and end at 0.
//!
//! ```
//! use tf_engines::minimax_h3::scheduler::{H3Schedule, H3SchedulerConfig};
//! use tf_engines::nn::sampling::flow_match::{LatentDtype, SigmaSource};
//! use tf_engines::nn::sampling::scheduler::Scheduler;
//!
//! let video = H3Schedule::grid(&H3SchedulerConfig::video(), SigmaSource::Steps(50), 0)?;
//! assert_eq!(video.steps(), 49); // 50 points, the terminal 0 included
//! assert_eq!(video.timesteps()[0], 0.0); // t = 1 - sigma: pure noise first
//! let mut x = vec![1.0f32; 4];
//! video.step(0, &mut x, &[0.5; 4], LatentDtype::F32)?;
//! # Ok::<(), tf_engines::nn::sampling::flow_match::SamplerError>(())
//! ```

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use crate::nn::config::parse_object;
use crate::nn::sampling::flow_match::{LatentDtype, SamplerError, SigmaSource};
use crate::nn::sampling::scheduler::{check_step, Scheduler};

/// The diffusers class name of a scheduler config this module reads.
pub const CLASS_NAME: &str = "MiniMaxH3Scheduler";
/// The video scheduler's shift in the release (also the class default).
pub const VIDEO_SHIFT: f64 = 12.0;
/// The audio scheduler's shift in the release.
pub const AUDIO_SHIFT: f64 = 3.0;
/// The level `t` the keyframe anchors are noised to and held at (just short of clean).
pub const KEYFRAME_NOISE_AUG: f32 = 0.999;

/// Upper bounds: far above every released value, low enough that the arithmetic stays finite and small.
pub mod limits {
    /// `shift` at most (the release uses 12 and 3).
    pub const SHIFT: f64 = 1e6;
    /// `shift` at least.
    pub const MIN_SHIFT: f64 = 1e-6;
    /// Grid points (`N`, or the length of given sigmas) at most.
    pub const GRID_POINTS: usize = 1 << 20;
}

/// Which of the two schedulers of an H3 folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Modality {
    /// `scheduler/`, shift 12.
    Video,
    /// `audio_scheduler/`, shift 3.
    Audio,
}

impl Modality {
    /// The folder of a diffusers model folder that holds this modality's `scheduler_config.json`.
    pub fn folder(self) -> &'static str {
        match self {
            Modality::Video => "scheduler",
            Modality::Audio => "audio_scheduler",
        }
    }

    /// The release's config for this modality (used when the folder has none).
    pub fn default_config(self) -> H3SchedulerConfig {
        match self {
            Modality::Video => H3SchedulerConfig::video(),
            Modality::Audio => H3SchedulerConfig::audio(),
        }
    }
}

/// A scheduler config this module cannot use. The message names the file and the key.
#[derive(Debug, Error)]
pub enum H3SchedulerConfigError {
    #[error("{file}: cannot read the MiniMax H3 scheduler config: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: MiniMax H3 scheduler config: {why}")]
    Invalid {
        /// The config file (or `scheduler_config.json` when parsed from a value).
        file: String,
        /// What is wrong, naming the key, and how to fix it.
        why: String,
    },
}

/// `scheduler_config.json` keys as the file spells them. `shift` is the only setting; the diffusers bookkeeping
/// keys (`_class_name`, `_diffusers_version`) are read or ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawConfig {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    shift: Option<f64>,
}

/// The settings of one `MiniMaxH3Scheduler` instance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct H3SchedulerConfig {
    /// The exponential shift `s * sigma / (1 + (s - 1) * sigma)`.
    pub shift: f64,
}

impl H3SchedulerConfig {
    /// The video instance (shift 12, the class default).
    pub fn video() -> Self {
        H3SchedulerConfig { shift: VIDEO_SHIFT }
    }

    /// The audio instance (shift 3).
    pub fn audio() -> Self {
        H3SchedulerConfig { shift: AUDIO_SHIFT }
    }

    /// Parses a `scheduler_config.json` value; an absent or null `shift` takes the class default (12).
    pub fn from_json(value: &Value) -> Result<Self, H3SchedulerConfigError> {
        Self::from_json_file(value, Path::new("scheduler_config.json"))
    }

    /// Parses and validates the value read from `file` (named in every error).
    pub fn from_json_file(value: &Value, file: &Path) -> Result<Self, H3SchedulerConfigError> {
        let invalid = |why: String| H3SchedulerConfigError::Invalid {
            file: file.display().to_string(),
            why,
        };
        let raw: RawConfig = parse_object(value).map_err(|why| {
            invalid(format!(
                "{why} (fix the key or remove it to take the default)"
            ))
        })?;
        if let Some(class) = &raw.class_name {
            if class != CLASS_NAME {
                return Err(invalid(format!(
                    "`_class_name` is {class:?}; this reader is for {CLASS_NAME} (the scheduler/ and \
                     audio_scheduler/ folders of a MiniMax H3 model)"
                )));
            }
        }
        let config = H3SchedulerConfig {
            shift: raw.shift.unwrap_or(VIDEO_SHIFT),
        };
        config.validate().map_err(invalid)?;
        Ok(config)
    }

    /// Reads and validates `scheduler_config.json` from `path`.
    pub fn from_file(path: &Path) -> Result<Self, H3SchedulerConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| H3SchedulerConfigError::Io {
            file: path.display().to_string(),
            source,
        })?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| H3SchedulerConfigError::Invalid {
                file: path.display().to_string(),
                why: format!("not valid JSON: {e}"),
            })?;
        Self::from_json_file(&value, path)
    }

    /// The config of `modality` in a diffusers model folder (`<dir>/scheduler/` or `<dir>/audio_scheduler/`), or
    /// the release's value when the folder has no such file.
    pub fn from_model_folder(
        dir: &Path,
        modality: Modality,
    ) -> Result<Self, H3SchedulerConfigError> {
        let path = dir.join(modality.folder()).join("scheduler_config.json");
        if path.exists() {
            Self::from_file(&path)
        } else {
            Ok(modality.default_config())
        }
    }

    /// Checks the shift: finite, within [`limits::MIN_SHIFT`] to [`limits::SHIFT`]. The error names the key.
    pub fn validate(&self) -> Result<(), String> {
        let s = self.shift;
        if !(s.is_finite() && (limits::MIN_SHIFT..=limits::SHIFT).contains(&s)) {
            return Err(format!(
                "`shift` must be a positive number from {} to {}, found {s} (the release uses 12 for video and 3 \
                 for audio)",
                limits::MIN_SHIFT,
                limits::SHIFT
            ));
        }
        Ok(())
    }
}

/// The base grid `linspace(1, 0, points)` in f32 as torch's vectorized CPU builds compute it (see the module docs).
fn base_grid(points: usize) -> Vec<f32> {
    let last = points - 1;
    let step = -1.0f32 / last as f32;
    let half = points / 2;
    (0..points)
        .map(|i| {
            if i < half {
                step.mul_add(i as f32, 1.0)
            } else {
                0.0 - step * (last - i) as f32
            }
        })
        .collect()
}

/// One MiniMax H3 schedule: `steps + 1` sigmas ending at 0 and `steps` timesteps `1 - sigma`.
#[derive(Debug, Clone, PartialEq)]
pub struct H3Schedule {
    sigmas: Vec<f32>,
    timesteps: Vec<f32>,
}

impl H3Schedule {
    /// The grid of `points` points (the terminal 0 included, so `points - 1` model calls at most) for `config`.
    pub fn from_points(config: &H3SchedulerConfig, points: usize) -> Result<Self, SamplerError> {
        config.validate().map_err(SamplerError::Config)?;
        if !(2..=limits::GRID_POINTS).contains(&points) {
            return Err(SamplerError::Argument(format!(
                "a MiniMax H3 grid needs 2 to {} points (the terminal 0 included), found {points}",
                limits::GRID_POINTS
            )));
        }
        let s = config.shift as f32;
        let s1 = (config.shift - 1.0) as f32;
        let mut sigmas: Vec<f32> = base_grid(points)
            .into_iter()
            .map(|b| (s * b) / (1.0 + s1 * b))
            .collect();
        // Collapse consecutive duplicates as the reference does (f32 equality).
        sigmas.dedup();
        Self::from_sigmas_f32(sigmas)
    }

    /// Given sigmas, used verbatim after rounding to f32: finite, strictly decreasing, ending at 0, at least two.
    pub fn from_sigmas(sigmas: &[f64]) -> Result<Self, SamplerError> {
        if !(2..=limits::GRID_POINTS).contains(&sigmas.len()) {
            return Err(SamplerError::Argument(format!(
                "given sigmas must hold 2 to {} values ending at 0, found {}",
                limits::GRID_POINTS,
                sigmas.len()
            )));
        }
        let rounded: Vec<f32> = sigmas.iter().map(|&s| s as f32).collect();
        if let Some(bad) = rounded.iter().find(|s| !s.is_finite()) {
            return Err(SamplerError::Argument(format!(
                "given sigmas must be finite, found {bad}"
            )));
        }
        if !rounded.windows(2).all(|w| w[1] < w[0]) || rounded.last() != Some(&0.0) {
            return Err(SamplerError::Argument(
                "given sigmas must be strictly decreasing (after rounding to f32) and end at 0.0"
                    .into(),
            ));
        }
        Self::from_sigmas_f32(rounded)
    }

    fn from_sigmas_f32(sigmas: Vec<f32>) -> Result<Self, SamplerError> {
        if sigmas.len() < 2 {
            return Err(SamplerError::Argument(format!(
                "the schedule collapsed to {} sigma(s); it needs at least 2",
                sigmas.len()
            )));
        }
        if let Some(bad) = sigmas.iter().find(|s| !s.is_finite()) {
            return Err(SamplerError::Argument(format!(
                "the shifted schedule has a non-finite sigma ({bad}); check `shift`"
            )));
        }
        let timesteps = sigmas[..sigmas.len() - 1]
            .iter()
            .map(|&s| 1.0 - s)
            .collect();
        Ok(H3Schedule { sigmas, timesteps })
    }

    fn check_step(&self, step: usize) -> Result<(), SamplerError> {
        check_step(step, self.timesteps.len())
    }

    /// One Euler step in f32, in place: `x0 = x + (1 - t) v`, `r = sigma_next / sigma`, `x = r x + (1 - r) x0`.
    pub fn step_f32(
        &self,
        step: usize,
        sample: &mut [f32],
        model_output: &[f32],
    ) -> Result<(), SamplerError> {
        self.check_step(step)?;
        if sample.len() != model_output.len() {
            return Err(SamplerError::Argument(format!(
                "the sample has {} elements, the model output {}",
                sample.len(),
                model_output.len()
            )));
        }
        let sigma_t = 1.0 - self.timesteps[step];
        let ratio = self.sigmas[step + 1] / self.sigmas[step];
        let keep = 1.0 - ratio;
        for (x, &v) in sample.iter_mut().zip(model_output) {
            let denoised = *x + sigma_t * v;
            *x = ratio * *x + keep * denoised;
        }
        Ok(())
    }
}

/// Forward noising at level `t` (1 is clean): `out = t * clean + (1 - t) * noise` in f32, as the reference noises
/// its conditioning anchors ([`KEYFRAME_NOISE_AUG`]).
pub fn scale_noise(
    clean: &[f32],
    noise: &[f32],
    t: f32,
    out: &mut [f32],
) -> Result<(), SamplerError> {
    if clean.len() != noise.len() || out.len() != clean.len() {
        return Err(SamplerError::Argument(format!(
            "scale_noise lengths differ: clean {}, noise {}, out {}",
            clean.len(),
            noise.len(),
            out.len()
        )));
    }
    if !(t.is_finite() && (0.0..=1.0).contains(&t)) {
        return Err(SamplerError::Argument(format!(
            "the noising level must lie in [0, 1], found {t}"
        )));
    }
    let rest = 1.0 - t;
    for ((o, &x), &n) in out.iter_mut().zip(clean).zip(noise) {
        *o = t * x + rest * n;
    }
    Ok(())
}

impl Scheduler for H3Schedule {
    type Config = H3SchedulerConfig;

    /// `Steps(N)` is the number of grid points, the terminal 0 included (N - 1 model calls); `Explicit` sigmas are
    /// taken verbatim. The image size does not enter the H3 schedule.
    fn grid(
        config: &H3SchedulerConfig,
        source: SigmaSource<'_>,
        _image_seq_len: usize,
    ) -> Result<Self, SamplerError> {
        match source {
            SigmaSource::Steps(points) => H3Schedule::from_points(config, points),
            SigmaSource::Explicit(list) => {
                config.validate().map_err(SamplerError::Config)?;
                H3Schedule::from_sigmas(list)
            }
        }
    }

    /// The `steps + 1` sigmas, the last one 0.
    fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The `steps` timesteps `1 - sigma` (0 is noise, 1 is clean).
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// The f32 timestep `1 - sigma`: the reference builds its per-row timesteps in f32 whatever the latent dtype.
    fn model_timestep(&self, step: usize, _dtype: LatentDtype) -> Result<f32, SamplerError> {
        self.check_step(step)?;
        Ok(self.timesteps[step])
    }

    /// The f32 step ([`H3Schedule::step_f32`]); the reference keeps the H3 state in f32, so bf16 is refused.
    fn step(
        &self,
        step: usize,
        sample: &mut [f32],
        model_output: &[f32],
        dtype: LatentDtype,
    ) -> Result<(), SamplerError> {
        if dtype != LatentDtype::F32 {
            return Err(SamplerError::Argument(
                "the MiniMax H3 state is f32 (as in the reference); step it with LatentDtype::F32"
                    .into(),
            ));
        }
        self.step_f32(step, sample, model_output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_grid_ends_are_exact() {
        assert_eq!(base_grid(2), vec![1.0, 0.0]);
        assert_eq!(base_grid(5), vec![1.0, 0.75, 0.5, 0.25, 0.0]);
        // The fused first half: 1 + (-1/9) * 3 rounds once (torch AVX2 gives 0.6666666865...).
        assert_eq!(base_grid(10)[3], 0.666_666_7);
    }

    #[test]
    fn n_points_give_n_minus_one_calls() {
        for n in [2, 3, 8, 50] {
            let s = H3Schedule::from_points(&H3SchedulerConfig::video(), n).unwrap();
            assert_eq!(s.steps(), n - 1);
            assert_eq!(s.sigmas()[0], 1.0);
            assert_eq!(*s.sigmas().last().unwrap(), 0.0);
            assert_eq!(s.timesteps()[0], 0.0);
        }
    }

    #[test]
    fn duplicates_collapse() {
        // A huge shift pushes the first points onto 1.0 in f32.
        let s = H3Schedule::from_points(&H3SchedulerConfig { shift: 1e6 }, 64).unwrap();
        assert!(s.steps() < 63, "{}", s.steps());
        assert!(s.sigmas().windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn last_step_lands_on_the_estimate() {
        let s = H3Schedule::from_points(&H3SchedulerConfig::audio(), 2).unwrap();
        let mut x = [2.0f32, -1.0];
        s.step_f32(0, &mut x, &[0.5, 4.0]).unwrap();
        // sigma 1, t 0: x0 = x + v; r = 0.
        assert_eq!(x, [2.5, 3.0]);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let c = H3SchedulerConfig::video();
        assert!(H3Schedule::from_points(&c, 1).is_err());
        assert!(H3Schedule::from_points(&c, usize::MAX).is_err());
        assert!(H3Schedule::from_sigmas(&[1.0]).is_err());
        assert!(H3Schedule::from_sigmas(&[1.0, 0.5]).is_err());
        assert!(H3Schedule::from_sigmas(&[0.5, 1.0, 0.0]).is_err());
        assert!(H3Schedule::from_sigmas(&[f64::INFINITY, 0.0]).is_err());
        assert!(H3Schedule::from_sigmas(&[1.0, 1.0 + 1e-12, 0.0]).is_err());
        let s = H3Schedule::from_points(&c, 3).unwrap();
        assert!(s.step_f32(2, &mut [0.0], &[0.0]).is_err());
        assert!(s.step_f32(0, &mut [0.0], &[0.0, 1.0]).is_err());
        assert!(Scheduler::step(&s, 0, &mut [0.0], &[0.0], LatentDtype::Bf16).is_err());
        assert!(scale_noise(&[1.0], &[0.0], 1.5, &mut [0.0]).is_err());
        assert!(scale_noise(&[1.0], &[0.0], 0.5, &mut []).is_err());
    }
}
