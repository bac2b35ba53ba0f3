//! What a pipeline needs from a scheduler: the grid for N steps, the timestep the model sees, and the step.
//!
//! [`Scheduler`] is implemented by the flow-match Euler sampler ([`Schedule`]); another model's scheduler (MiniMax
//! H3's) implements the same trait, so a denoising loop is written once:
//!
//! ```
//! use tf_engines::nn::sampling::flow_match::{LatentDtype, Schedule, SchedulerConfig, SigmaSource};
//! use tf_engines::nn::sampling::scheduler::Scheduler;
//!
//! fn denoise<S: Scheduler>(s: &S, x: &mut [f32]) -> Result<(), tf_engines::nn::sampling::flow_match::SamplerError> {
//!     for step in 0..s.steps() {
//!         let _t = s.model_timestep(step, LatentDtype::F32)?; // what the model would see
//!         let velocity = vec![0.5; x.len()];
//!         s.step(step, x, &velocity, LatentDtype::F32)?;
//!     }
//!     Ok(())
//! }
//! let s = <Schedule as Scheduler>::grid(&SchedulerConfig::qwen_image(), SigmaSource::Steps(4), 4096)?;
//! let mut x = vec![1.0f32; 3];
//! denoise(&s, &mut x)?;
//! # Ok::<(), tf_engines::nn::sampling::flow_match::SamplerError>(())
//! ```

use super::flow_match::{LatentDtype, SamplerError, Schedule, SchedulerConfig, SigmaSource};

/// A sampling schedule a pipeline drives step by step.
pub trait Scheduler: Sized {
    /// The settings a grid is built from (a model folder's scheduler config).
    type Config;

    /// The grid for `source` (N steps, or given sigmas) at an image of `image_seq_len` latent tokens.
    fn grid(
        config: &Self::Config,
        source: SigmaSource<'_>,
        image_seq_len: usize,
    ) -> Result<Self, SamplerError>;

    /// Model evaluations: one per timestep.
    fn steps(&self) -> usize {
        self.timesteps().len()
    }

    /// The `steps + 1` noise levels, ending at the clean sample.
    fn sigmas(&self) -> &[f32];

    /// The `steps` timesteps on the training scale.
    fn timesteps(&self) -> &[f32];

    /// The timestep argument the model receives at `step`, rounded as the reference rounds it in `dtype`.
    fn model_timestep(&self, step: usize, dtype: LatentDtype) -> Result<f32, SamplerError>;

    /// Advances `sample` in place by one step from the model's output at `step`.
    fn step(
        &self,
        step: usize,
        sample: &mut [f32],
        model_output: &[f32],
        dtype: LatentDtype,
    ) -> Result<(), SamplerError>;
}

impl Scheduler for Schedule {
    type Config = SchedulerConfig;

    fn grid(
        config: &SchedulerConfig,
        source: SigmaSource<'_>,
        image_seq_len: usize,
    ) -> Result<Schedule, SamplerError> {
        Schedule::new(config, source, image_seq_len)
    }

    fn sigmas(&self) -> &[f32] {
        Schedule::sigmas(self)
    }

    fn timesteps(&self) -> &[f32] {
        Schedule::timesteps(self)
    }

    fn model_timestep(&self, step: usize, dtype: LatentDtype) -> Result<f32, SamplerError> {
        Schedule::model_timestep(self, step, dtype)
    }

    fn step(
        &self,
        step: usize,
        sample: &mut [f32],
        model_output: &[f32],
        dtype: LatentDtype,
    ) -> Result<(), SamplerError> {
        self.euler_step(step, sample, model_output, dtype)
    }
}

/// Refuses a step index past the last of `steps` model calls.
pub fn check_step(step: usize, steps: usize) -> Result<(), SamplerError> {
    if step < steps {
        Ok(())
    } else {
        Err(SamplerError::Argument(format!(
            "step {step} is past the last step ({steps} steps)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trait_gives_the_flow_match_numbers_unchanged() {
        let config = SchedulerConfig::qwen_image();
        let direct = Schedule::new(&config, SigmaSource::Steps(8), 4096).unwrap();
        let through = <Schedule as Scheduler>::grid(&config, SigmaSource::Steps(8), 4096).unwrap();
        assert_eq!(direct, through);
        let (mut a, mut b) = (vec![0.25f32, -1.0, 3.0], vec![0.25f32, -1.0, 3.0]);
        for step in 0..8 {
            let v = [0.5f32, 0.125, -2.0];
            assert_eq!(
                direct.model_timestep(step, LatentDtype::Bf16).unwrap(),
                Scheduler::model_timestep(&through, step, LatentDtype::Bf16).unwrap()
            );
            direct
                .euler_step(step, &mut a, &v, LatentDtype::Bf16)
                .unwrap();
            Scheduler::step(&through, step, &mut b, &v, LatentDtype::Bf16).unwrap();
            assert_eq!(a, b);
        }
        assert!(Scheduler::step(&through, 8, &mut b, &[0.0; 3], LatentDtype::F32).is_err());
    }
}
