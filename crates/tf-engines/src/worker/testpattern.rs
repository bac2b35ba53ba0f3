//! `testpattern`: a CPU engine that makes deterministic images without a model or a GPU, so the worker
//! protocol, the file outputs and a LocalRouter set-up can be checked on any machine.
//!
//! The image is colour bars shifted by the seed, with grain hashed from the prompt, the seed and the pixel
//! position: the same request always gives the same pixels, and a different prompt or seed gives different
//! ones. It reports one progress line per step (default 4 steps).

use super::{EngineError, ImageJob, Progress, RgbaImage, WorkerEngine};

/// The test-pattern engine. `resident_bytes` is what `load` reports.
#[derive(Debug, Clone, Default)]
pub struct TestPattern {
    /// Bytes reported as resident by `load` (nothing is really held).
    pub resident_bytes: u64,
    loaded: bool,
}

/// Default step count when the request gives none.
pub const DEFAULT_STEPS: u32 = 4;

impl WorkerEngine for TestPattern {
    fn load(&mut self) -> Result<u64, EngineError> {
        self.loaded = true;
        Ok(self.resident_bytes)
    }

    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        if !self.loaded {
            return Err(EngineError::Failed(
                "the test pattern engine is not loaded".into(),
            ));
        }
        let steps = job.steps.unwrap_or(DEFAULT_STEPS);
        for step in 1..=steps {
            progress(Progress {
                phase: "denoise",
                step,
                of: steps,
            });
        }
        Ok(render(job))
    }

    fn unload(&mut self) {
        self.loaded = false;
    }
}

const BARS: [[u8; 3]; 7] = [
    [192, 192, 192],
    [192, 192, 0],
    [0, 192, 192],
    [0, 192, 0],
    [192, 0, 192],
    [192, 0, 0],
    [0, 0, 192],
];

/// The pattern for `job` (width × height RGBA).
pub fn render(job: &ImageJob) -> RgbaImage {
    let (w, h) = (job.width as usize, job.height as usize);
    let prompt_hash = job.prompt.bytes().fold(0xcbf2_9ce4_8422_2325u64, |acc, b| {
        (acc ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let shift = (job.seed % BARS.len() as u64) as usize;
    let mut pixels = Vec::with_capacity(w * h * 4);
    for y in 0..h {
        for x in 0..w {
            let bar = BARS[(x * BARS.len() / w.max(1) + shift) % BARS.len()];
            let grain = splitmix(prompt_hash ^ job.seed.rotate_left(17) ^ ((y * w + x) as u64));
            for (channel, base) in bar.iter().enumerate() {
                let noise = ((grain >> (8 * channel)) & 0x3f) as u8;
                pixels.push(base.saturating_add(noise));
            }
            pixels.push(255);
        }
    }
    RgbaImage {
        width: job.width,
        height: job.height,
        pixels,
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(prompt: &str, seed: u64) -> ImageJob {
        ImageJob {
            prompt: prompt.into(),
            negative_prompt: None,
            width: 48,
            height: 32,
            steps: Some(3),
            seed,
            guidance: None,
        }
    }

    #[test]
    fn same_request_same_pixels_different_request_different_pixels() {
        let a = render(&job("a fox", 1));
        assert_eq!(a.pixels().len(), 48 * 32 * 4);
        assert_eq!(a, render(&job("a fox", 1)));
        assert_ne!(a, render(&job("a fox", 2)));
        assert_ne!(a, render(&job("a cat", 1)));
    }

    #[test]
    fn reports_each_step_and_refuses_before_load() {
        let mut engine = TestPattern::default();
        let mut seen = Vec::new();
        assert!(engine.generate(&job("x", 0), &mut |_| {}).is_err());
        engine.load().unwrap();
        engine
            .generate(&job("x", 0), &mut |p| seen.push((p.step, p.of)))
            .unwrap();
        assert_eq!(seen, [(1, 3), (2, 3), (3, 3)]);
    }
}
