//! Flow-matching Euler sampler: the sigma schedule, the timestep the DiT sees, the Euler step and true CFG.
//!
//! This reproduces diffusers' `FlowMatchEulerDiscreteScheduler` as the Qwen-Image 2.1 pipeline drives it, to the
//! last bit of f32 (and bf16) rounding:
//!
//! 1. Base sigmas: `linspace(1, 1/N, N)` computed in f64 (numpy's formula: `i * step + 1`, the last point set to
//!    `1/N`) or explicit sigmas (a Turbo checkpoint's `sample_sigmas`), then rounded to f32.
//! 2. Shift, in f32 arithmetic (numpy rounds every operation of an f32 array to f32):
//!    - dynamic exponential: `e^mu / (e^mu + (1/s - 1))` with `e^mu` rounded to f32;
//!    - dynamic linear: `mu / (mu + (1/s - 1))`;
//!    - fixed: `shift * s / (1 + (shift - 1) * s)` (identity for shift 1).
//!
//!    `mu` is [`calculate_shift`] of the image token count, in f64.
//! 3. Optional `shift_terminal` stretch: `1 - (1 - s) / ((1 - s_last) / (1 - shift_terminal))`.
//! 4. `timesteps = sigma * 1000` (f32), then a terminal sigma 0 is appended.
//!
//! The DiT receives `timestep / 1000` computed in the latent dtype: with bf16 latents the timestep is rounded to
//! bf16 first, divided, and rounded again ([`Schedule::model_timestep`]). The Euler step is
//! `x + (sigma_next - sigma) * v` with the sample upcast to f32; `dt` and the product are rounded to the velocity's
//! dtype and the result to the latent dtype, as torch's type promotion does ([`Schedule::euler_step`]).
//!
//! ```
//! use tf_engines::nn::sampling::flow_match::{LatentDtype, Schedule, SchedulerConfig, SigmaSource};
//!
//! let config = SchedulerConfig::qwen_image();
//! let schedule = Schedule::new(&config, SigmaSource::Steps(40), 64 * 64)?;
//! assert_eq!(schedule.steps(), 40);
//! assert_eq!(schedule.sigmas()[40], 0.0);
//! let mut x = vec![1.0f32; 4];
//! schedule.euler_step(0, &mut x, &[0.5; 4], LatentDtype::Bf16)?;
//! # Ok::<(), tf_engines::nn::sampling::flow_match::SamplerError>(())
//! ```

use std::path::Path;

use half::bf16;
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

use crate::nn::config::parse_object;

/// Errors of the sampler: a config it cannot reproduce, or bad arguments.
#[derive(Debug, Error)]
pub enum SamplerError {
    #[error("{path}: cannot read the scheduler config: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("scheduler_config.json: {0}")]
    Config(String),
    #[error("sampler: {0}")]
    Argument(String),
}

/// The element type the latents are kept in between steps (the pipeline's prompt-embeds dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatentDtype {
    /// f32 latents (a full-precision reference run).
    F32,
    /// bf16 latents (what the pipeline runs in practice).
    Bf16,
}

impl LatentDtype {
    /// Rounds `v` to this dtype (bf16: round to nearest even), returned as f32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            LatentDtype::F32 => v,
            LatentDtype::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
}

/// How the dynamic shift bends the schedule (`time_shift_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeShift {
    /// `e^mu / (e^mu + (1/s - 1))`.
    Exponential,
    /// `mu / (mu + (1/s - 1))`.
    Linear,
}

/// The `FlowMatchEulerDiscreteScheduler` settings that matter for inference.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// `num_train_timesteps` (1000): timesteps are `sigma * this`.
    pub num_train_timesteps: u32,
    /// Fixed shift, used when dynamic shifting is off.
    pub shift: f64,
    /// Shift by the image token count (`mu`) instead of `shift`.
    pub use_dynamic_shifting: bool,
    /// `mu` at `base_image_seq_len` tokens.
    pub base_shift: f64,
    /// `mu` at `max_image_seq_len` tokens.
    pub max_shift: f64,
    pub base_image_seq_len: u64,
    pub max_image_seq_len: u64,
    /// Stretch the shifted schedule so its last sigma equals this value.
    pub shift_terminal: Option<f64>,
    pub time_shift_type: TimeShift,
}

impl Default for SchedulerConfig {
    /// The diffusers class defaults (no dynamic shifting, shift 1).
    fn default() -> Self {
        SchedulerConfig {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            shift_terminal: None,
            time_shift_type: TimeShift::Exponential,
        }
    }
}

/// `scheduler_config.json` keys as the file spells them; `None` = absent or null (then the class default).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawScheduler {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    num_train_timesteps: Option<u64>,
    shift: Option<f64>,
    use_dynamic_shifting: Option<bool>,
    base_shift: Option<f64>,
    max_shift: Option<f64>,
    base_image_seq_len: Option<u64>,
    max_image_seq_len: Option<u64>,
    shift_terminal: Option<f64>,
    time_shift_type: Option<String>,
    use_karras_sigmas: Option<bool>,
    use_exponential_sigmas: Option<bool>,
    use_beta_sigmas: Option<bool>,
    invert_sigmas: Option<bool>,
    stochastic_sampling: Option<bool>,
}

/// Upper bounds of a scheduler config: far above every released value, and low enough that the shift
/// arithmetic stays finite.
pub mod limits {
    /// `num_train_timesteps`.
    pub const TRAIN_TIMESTEPS: u64 = 1 << 20;
    /// `base_image_seq_len` and `max_image_seq_len`.
    pub const SEQ_LEN: u64 = 1 << 32;
    /// `|shift|`, `|base_shift|`, `|max_shift|`.
    pub const SHIFT: f64 = 1e6;
}

impl SchedulerConfig {
    /// The Qwen-Image 2.1 assumption when a model folder has no scheduler config: dynamic exponential shift,
    /// `mu` 0.5 at 256 tokens to 1.15 at 4096.
    pub fn qwen_image() -> Self {
        SchedulerConfig {
            use_dynamic_shifting: true,
            ..SchedulerConfig::default()
        }
    }

    /// Parses a diffusers `scheduler_config.json` value; absent keys take the diffusers class defaults. Settings
    /// this sampler does not reproduce (karras/exponential/beta sigmas, inverted sigmas, stochastic sampling) are
    /// refused rather than ignored.
    pub fn from_json(value: &Value) -> Result<Self, SamplerError> {
        let raw: RawScheduler = parse_object(value).map_err(SamplerError::Config)?;
        if let Some(class) = &raw.class_name {
            if class != "FlowMatchEulerDiscreteScheduler" {
                return Err(SamplerError::Config(format!(
                    "`_class_name` is {class:?}; only FlowMatchEulerDiscreteScheduler is supported"
                )));
            }
        }
        for (key, on) in [
            ("use_karras_sigmas", raw.use_karras_sigmas),
            ("use_exponential_sigmas", raw.use_exponential_sigmas),
            ("use_beta_sigmas", raw.use_beta_sigmas),
            ("invert_sigmas", raw.invert_sigmas),
            ("stochastic_sampling", raw.stochastic_sampling),
        ] {
            if on == Some(true) {
                return Err(SamplerError::Config(format!(
                    "`{key}` = true is not supported by this sampler (set it to false or remove it)"
                )));
            }
        }
        let d = SchedulerConfig::default();
        let time_shift_type = match raw.time_shift_type.as_deref() {
            None | Some("exponential") => TimeShift::Exponential,
            Some("linear") => TimeShift::Linear,
            Some(other) => {
                return Err(SamplerError::Config(format!(
                "`time_shift_type` {other:?} is unknown (expected \"exponential\" or \"linear\")"
            )))
            }
        };
        let num_train_timesteps = match raw.num_train_timesteps {
            None => d.num_train_timesteps,
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|&n| n > 0 && u64::from(n) <= limits::TRAIN_TIMESTEPS)
                .ok_or_else(|| {
                    SamplerError::Config(format!(
                        "`num_train_timesteps` {n} is out of range (1 to {})",
                        limits::TRAIN_TIMESTEPS
                    ))
                })?,
        };
        let config = SchedulerConfig {
            num_train_timesteps,
            shift: raw.shift.unwrap_or(d.shift),
            use_dynamic_shifting: raw.use_dynamic_shifting.unwrap_or(false),
            base_shift: raw.base_shift.unwrap_or(d.base_shift),
            max_shift: raw.max_shift.unwrap_or(d.max_shift),
            base_image_seq_len: raw.base_image_seq_len.unwrap_or(d.base_image_seq_len),
            max_image_seq_len: raw.max_image_seq_len.unwrap_or(d.max_image_seq_len),
            shift_terminal: raw.shift_terminal.filter(|&v| v != 0.0),
            time_shift_type,
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads `scheduler_config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, SamplerError> {
        let text = std::fs::read_to_string(path).map_err(|source| SamplerError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| {
            SamplerError::Config(format!("{}: not valid JSON: {e}", path.display()))
        })?;
        Self::from_json(&value)
    }

    /// The scheduler config of a diffusers model folder (`<dir>/scheduler/scheduler_config.json`), or
    /// [`SchedulerConfig::qwen_image`] when the folder has none.
    pub fn from_model_folder(dir: &Path) -> Result<Self, SamplerError> {
        let path = dir.join("scheduler").join("scheduler_config.json");
        if path.exists() {
            Self::from_file(&path)
        } else {
            Ok(Self::qwen_image())
        }
    }

    /// Checks the settings: positive finite shift, bounded ([`limits`]) sequence lengths and shifts.
    pub fn validate(&self) -> Result<(), SamplerError> {
        if self.num_train_timesteps == 0
            || u64::from(self.num_train_timesteps) > limits::TRAIN_TIMESTEPS
        {
            return Err(SamplerError::Config(format!(
                "`num_train_timesteps` {} is out of range (1 to {})",
                self.num_train_timesteps,
                limits::TRAIN_TIMESTEPS
            )));
        }
        for (key, v) in [
            ("base_image_seq_len", self.base_image_seq_len),
            ("max_image_seq_len", self.max_image_seq_len),
        ] {
            if v > limits::SEQ_LEN {
                return Err(SamplerError::Config(format!(
                    "`{key}` = {v} is above the supported limit of {}",
                    limits::SEQ_LEN
                )));
            }
        }
        for (key, v) in [
            ("base_shift", self.base_shift),
            ("max_shift", self.max_shift),
        ] {
            if !(v.is_finite() && v.abs() <= limits::SHIFT) {
                return Err(SamplerError::Config(format!(
                    "`{key}` must be a finite number of magnitude at most {}, found {v}",
                    limits::SHIFT
                )));
            }
        }
        if self.shift > limits::SHIFT {
            return Err(SamplerError::Config(format!(
                "`shift` {} is above the supported limit of {}",
                self.shift,
                limits::SHIFT
            )));
        }
        if self.use_dynamic_shifting && self.base_image_seq_len == self.max_image_seq_len {
            return Err(SamplerError::Config(
                "base_image_seq_len equals max_image_seq_len, so the dynamic shift is undefined"
                    .into(),
            ));
        }
        if !self.shift.is_finite() || self.shift <= 0.0 {
            return Err(SamplerError::Config(format!(
                "`shift` must be a positive number, found {}",
                self.shift
            )));
        }
        if let Some(t) = self.shift_terminal {
            if !(t.is_finite() && t < 1.0) {
                return Err(SamplerError::Config(format!(
                    "`shift_terminal` must be below 1, found {t}"
                )));
            }
        }
        Ok(())
    }

    /// `mu` for an image of `image_seq_len` latent tokens, with this config's line.
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        calculate_shift(
            image_seq_len,
            self.base_image_seq_len,
            self.max_image_seq_len,
            self.base_shift,
            self.max_shift,
        )
    }
}

/// The dynamic-shift parameter: the line through `(base_seq_len, base_shift)` and `(max_seq_len, max_shift)` at
/// `image_seq_len`, in f64 in the reference's operation order (it extrapolates past either end).
pub fn calculate_shift(
    image_seq_len: usize,
    base_seq_len: u64,
    max_seq_len: u64,
    base_shift: f64,
    max_shift: f64,
) -> f64 {
    let m = (max_shift - base_shift) / (max_seq_len as f64 - base_seq_len as f64);
    let b = base_shift - m * base_seq_len as f64;
    image_seq_len as f64 * m + b
}

/// The latent grid `(rows, cols)` of an image of `height x width` pixels: the pipeline floors each side to a
/// multiple of 32 pixels and one latent token covers 16 x 16 pixels. `rows * cols` is the image token count that
/// sets `mu`.
pub fn latent_grid(height: usize, width: usize) -> (usize, usize) {
    (2 * (height / 32), 2 * (width / 32))
}

/// Where the unshifted sigmas come from.
#[derive(Debug, Clone, Copy)]
pub enum SigmaSource<'a> {
    /// `linspace(1, 1/N, N)`.
    Steps(usize),
    /// Given sigmas (e.g. a Turbo checkpoint's `sample_sigmas`); they still go through the configured shift.
    Explicit(&'a [f64]),
}

/// numpy's `linspace(start, stop, num)` in f64 (endpoint included).
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f64;
    let mut out: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    if let Some(last) = out.last_mut() {
        *last = stop;
    }
    out
}

/// A sigma schedule: `steps + 1` sigmas (ending in 0) and `steps` timesteps.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    sigmas: Vec<f32>,
    timesteps: Vec<f32>,
}

impl Schedule {
    /// Builds the schedule the reference scheduler builds for an image of `image_seq_len` latent tokens.
    pub fn new(
        config: &SchedulerConfig,
        source: SigmaSource<'_>,
        image_seq_len: usize,
    ) -> Result<Schedule, SamplerError> {
        let base: Vec<f32> = match source {
            SigmaSource::Steps(0) => {
                return Err(SamplerError::Argument(
                    "at least one sampling step is needed".into(),
                ))
            }
            SigmaSource::Steps(n) => linspace(1.0, 1.0 / n as f64, n)
                .into_iter()
                .map(|s| s as f32)
                .collect(),
            SigmaSource::Explicit([]) => {
                return Err(SamplerError::Argument(
                    "the explicit sigma list is empty".into(),
                ))
            }
            SigmaSource::Explicit(list) => {
                if let Some(bad) = list
                    .iter()
                    .find(|s| !(s.is_finite() && **s > 0.0 && **s <= 1.0))
                {
                    return Err(SamplerError::Argument(format!(
                        "explicit sigmas must lie in (0, 1], found {bad}"
                    )));
                }
                list.iter().map(|&s| s as f32).collect()
            }
        };
        let mut sigmas: Vec<f32> = if config.use_dynamic_shifting {
            let mu = config.mu(image_seq_len);
            match config.time_shift_type {
                TimeShift::Exponential => {
                    let e = mu.exp() as f32;
                    base.iter().map(|&s| e / (e + (1.0 / s - 1.0))).collect()
                }
                TimeShift::Linear => {
                    let m = mu as f32;
                    base.iter().map(|&s| m / (m + (1.0 / s - 1.0))).collect()
                }
            }
        } else {
            let shift = config.shift as f32;
            let shift_minus_one = (config.shift - 1.0) as f32;
            base.iter()
                .map(|&s| shift * s / (1.0 + shift_minus_one * s))
                .collect()
        };
        if let Some(terminal) = config.shift_terminal {
            let last = sigmas.last().copied().unwrap_or(1.0);
            let scale = (1.0 - last) / ((1.0 - terminal) as f32);
            for s in &mut sigmas {
                *s = 1.0 - (1.0 - *s) / scale;
            }
        }
        if let Some(bad) = sigmas.iter().find(|s| !s.is_finite()) {
            return Err(SamplerError::Argument(format!(
                "the shifted schedule has a non-finite sigma ({bad}); check shift, base/max shift and the step count"
            )));
        }
        let train = config.num_train_timesteps as f32;
        let timesteps = sigmas.iter().map(|&s| s * train).collect();
        sigmas.push(0.0);
        Ok(Schedule { sigmas, timesteps })
    }

    /// Number of sampling steps (model evaluations).
    pub fn steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The `steps + 1` sigmas, the last one 0.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The `steps` timesteps (`sigma * 1000`).
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn check_step(&self, step: usize) -> Result<(), SamplerError> {
        super::scheduler::check_step(step, self.steps())
    }

    /// The timestep argument the DiT receives at `step`: `timestep` rounded to the latent dtype, divided by 1000
    /// in that dtype (f32 arithmetic, then rounded again).
    pub fn model_timestep(&self, step: usize, dtype: LatentDtype) -> Result<f32, SamplerError> {
        self.check_step(step)?;
        let t = dtype.round(self.timesteps[step]);
        Ok(dtype.round(t / 1000.0))
    }

    /// `sigma[step + 1] - sigma[step]` in f32.
    pub fn dt(&self, step: usize) -> Result<f32, SamplerError> {
        self.check_step(step)?;
        Ok(self.sigmas[step + 1] - self.sigmas[step])
    }

    /// One Euler step in place: `x = round(x + round(round(dt) * v))`, rounding to `dtype` (the dtype of both the
    /// latents and the velocity, as in the pipeline: `dt` is cast to the velocity's dtype, the product is rounded to
    /// it, the sum is taken in f32 and cast back).
    pub fn euler_step(
        &self,
        step: usize,
        x: &mut [f32],
        velocity: &[f32],
        dtype: LatentDtype,
    ) -> Result<(), SamplerError> {
        if x.len() != velocity.len() {
            return Err(SamplerError::Argument(format!(
                "latents have {} elements, the velocity {}",
                x.len(),
                velocity.len()
            )));
        }
        // torch casts the 0-dim f32 `dt` to the velocity's dtype before the multiply.
        let dt = dtype.round(self.dt(step)?);
        for (xv, &v) in x.iter_mut().zip(velocity) {
            *xv = dtype.round(*xv + dtype.round(dt * v));
        }
        Ok(())
    }
}

/// True classifier-free guidance: `out = neg + scale * (cond - neg)`, each operation rounded to `dtype` as the
/// reference's tensor arithmetic does. The pipeline leaves it off (`scale` 1 means: use `cond` alone).
pub fn cfg_combine(
    cond: &[f32],
    neg: &[f32],
    scale: f32,
    dtype: LatentDtype,
    out: &mut [f32],
) -> Result<(), SamplerError> {
    if cond.len() != neg.len() || out.len() != cond.len() {
        return Err(SamplerError::Argument(format!(
            "cfg_combine lengths differ: cond {}, neg {}, out {}",
            cond.len(),
            neg.len(),
            out.len()
        )));
    }
    for ((o, &c), &n) in out.iter_mut().zip(cond).zip(neg) {
        let diff = dtype.round(c - n);
        let scaled = dtype.round(scale * diff);
        *o = dtype.round(n + scaled);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mu_follows_the_line() {
        assert!((calculate_shift(256, 256, 4096, 0.5, 1.15) - 0.5).abs() < 1e-12);
        assert!((calculate_shift(4096, 256, 4096, 0.5, 1.15) - 1.15).abs() < 1e-12);
        assert!(calculate_shift(8192, 256, 4096, 0.5, 1.15) > 1.15);
    }

    #[test]
    fn latent_grid_floors_to_32_pixels() {
        assert_eq!(latent_grid(1024, 1024), (64, 64));
        assert_eq!(latent_grid(1000, 1056), (62, 66));
        assert_eq!(latent_grid(31, 64), (0, 4));
    }

    #[test]
    fn one_step_is_full_noise_to_zero() {
        let s = Schedule::new(&SchedulerConfig::qwen_image(), SigmaSource::Steps(1), 4096).unwrap();
        assert_eq!(s.sigmas(), &[1.0, 0.0]);
        assert_eq!(s.timesteps(), &[1000.0]);
        assert_eq!(s.dt(0).unwrap(), -1.0);
    }

    #[test]
    fn identity_config_keeps_linspace() {
        let s = Schedule::new(&SchedulerConfig::default(), SigmaSource::Steps(4), 1).unwrap();
        assert_eq!(s.sigmas(), &[1.0, 0.75, 0.5, 0.25, 0.0]);
    }

    #[test]
    fn bf16_timestep_is_quantized_twice() {
        let s =
            Schedule::new(&SchedulerConfig::qwen_image(), SigmaSource::Steps(40), 4096).unwrap();
        // 991.9... -> 992 (bf16) -> 0.992 -> 0.9921875 (bf16).
        assert_eq!(s.model_timestep(1, LatentDtype::Bf16).unwrap(), 0.992_187_5);
        assert!(s.model_timestep(40, LatentDtype::Bf16).is_err());
    }

    #[test]
    fn refuses_unsupported_configs() {
        let bad = serde_json::json!({"use_karras_sigmas": true});
        assert!(SchedulerConfig::from_json(&bad).is_err());
        let bad = serde_json::json!({"time_shift_type": "cosine"});
        assert!(SchedulerConfig::from_json(&bad).is_err());
        let bad = serde_json::json!({"_class_name": "EulerDiscreteScheduler"});
        assert!(SchedulerConfig::from_json(&bad).is_err());
        assert!(Schedule::new(&SchedulerConfig::default(), SigmaSource::Steps(0), 1).is_err());
        assert!(Schedule::new(
            &SchedulerConfig::default(),
            SigmaSource::Explicit(&[1.5]),
            1
        )
        .is_err());
    }

    #[test]
    fn cfg_scale_one_is_cond() {
        let mut out = [0.0; 2];
        cfg_combine(&[1.5, -2.0], &[0.25, 7.0], 1.0, LatentDtype::F32, &mut out).unwrap();
        assert_eq!(out, [1.5, -2.0]);
    }

    proptest! {
        #[test]
        fn sigmas_decrease_and_end_at_zero(steps in 1usize..200, seq in 1usize..20000, dynamic in any::<bool>(),
                                           shift in 0.5f64..8.0) {
            let config = SchedulerConfig { use_dynamic_shifting: dynamic, shift, ..SchedulerConfig::default() };
            let s = Schedule::new(&config, SigmaSource::Steps(steps), seq).unwrap();
            prop_assert_eq!(s.sigmas().len(), steps + 1);
            prop_assert_eq!(*s.sigmas().last().unwrap(), 0.0);
            prop_assert!(s.sigmas().windows(2).all(|w| w[0] >= w[1]), "{:?}", s.sigmas());
            // f32 rounding of a fixed shift can land one ulp above 1 at sigma 1, as in the reference.
            prop_assert!(s.sigmas().iter().all(|&v| (0.0..=1.0 + 1e-6).contains(&v)), "{:?}", s.sigmas());
        }
    }
}
