//! `testpattern`: a CPU engine that makes deterministic images without a model or a GPU, so the worker
//! protocol, the file outputs and a LocalRouter set-up can be checked on any machine.
//!
//! The image is colour bars shifted by the seed, with grain hashed from the prompt, the seed and the pixel
//! position: the same request always gives the same pixels, and a different prompt or seed gives different
//! ones. It reports one progress line per step (default 4 steps).
//!
//! It makes videos too ([`render_video`]): frame `i` is the pattern with the bars scrolled by `i` pixels and the
//! grain drawn afresh per frame, `round(seconds * fps)` frames at the requested rate, and with `audio` a stereo
//! tone at 32 kHz (left 440 Hz, right 660 Hz, both shifted by the seed) lasting as long as the frames. The worker
//! writes it through the same MP4 path as a model's video.

use super::{
    Audio, EngineError, EngineOutput, ImageJob, Progress, RgbaImage, VideoJob, WorkerEngine,
};

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
        check_size(job.width, job.height)?;
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

    fn makes_video(&self) -> bool {
        true
    }

    fn generate_video(
        &mut self,
        job: &VideoJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<EngineOutput, EngineError> {
        if !self.loaded {
            return Err(EngineError::Failed(
                "the test pattern engine is not loaded".into(),
            ));
        }
        check_video(job)?;
        let steps = job.steps.unwrap_or(DEFAULT_STEPS);
        for step in 1..=steps {
            progress(Progress {
                phase: "denoise",
                step,
                of: steps,
            });
        }
        let output = render_video(job);
        progress(Progress {
            phase: "decode",
            step: 1,
            of: 1,
        });
        Ok(output)
    }
}

/// Most bytes of RGBA frames one test-pattern video may hold (1 GiB).
pub const MAX_VIDEO_BYTES: u64 = 1 << 30;
/// Sample rate of the test tone (MiniMax H3's).
pub const TONE_SAMPLE_RATE: u32 = 32_000;

/// What the test pattern's sides must be multiples of: it stands in for a DiT's latent grid (16 pixels), so a
/// client checked against it sends sizes of that grid. Its own rule, as every engine has one; the worker checks
/// only its generic bounds.
pub const SIDE_MULTIPLE: u32 = 16;

/// Refuses a side that is not a multiple of [`SIDE_MULTIPLE`], naming the field and the rule.
fn check_size(width: u32, height: u32) -> Result<(), EngineError> {
    for (name, side) in [("width", width), ("height", height)] {
        if side == 0 || !side.is_multiple_of(SIDE_MULTIPLE) {
            return Err(EngineError::InvalidRequest(format!(
                "`{name}` must be a multiple of {SIDE_MULTIPLE} for the test pattern, got {side}"
            )));
        }
    }
    Ok(())
}

/// Refuses what the test pattern cannot make, naming the field.
fn check_video(job: &VideoJob) -> Result<(), EngineError> {
    check_size(job.width, job.height)?;
    if job.first_frame.is_some() {
        return Err(EngineError::InvalidRequest(
            "`first_frame` (image to video) is not supported yet; send a text-only video request"
                .into(),
        ));
    }
    let bytes = u64::from(job.width) * u64::from(job.height) * 4 * u64::from(job.frames());
    if bytes > MAX_VIDEO_BYTES {
        return Err(EngineError::InvalidRequest(format!(
            "`seconds` x `fps` x `width` x `height` make {} frames of {}x{} ({bytes} B), above the test pattern's \
             limit of {MAX_VIDEO_BYTES} B; ask for fewer seconds, a lower fps or a smaller size",
            job.frames(),
            job.width,
            job.height
        )));
    }
    Ok(())
}

/// The test video for `job`: `job.frames()` frames scrolling by one pixel a frame, and a stereo tone when
/// `job.audio`.
pub fn render_video(job: &VideoJob) -> EngineOutput {
    let frames = (0..job.frames())
        .map(|i| {
            let still = ImageJob {
                prompt: job.prompt.clone(),
                negative_prompt: None,
                width: job.width,
                height: job.height,
                steps: None,
                seed: job
                    .seed
                    .wrapping_add(u64::from(i).wrapping_mul(0x9E37_79B9)),
                guidance: None,
            };
            scrolled(
                &render(&ImageJob {
                    seed: job.seed,
                    ..still.clone()
                }),
                &render(&still),
                i,
            )
        })
        .collect();
    let audio = job.audio.then(|| tone(job));
    EngineOutput::Video {
        frames,
        fps: job.fps,
        audio,
    }
}

/// The bars of `bars` scrolled left by `shift` pixels, with the grain of `grain` (same size).
fn scrolled(bars: &RgbaImage, grain: &RgbaImage, shift: u32) -> RgbaImage {
    let (w, h) = (bars.width as usize, bars.height as usize);
    let mut pixels = Vec::with_capacity(w * h * 4);
    for y in 0..h {
        for x in 0..w {
            let from = (y * w + (x + shift as usize) % w) * 4;
            let here = (y * w + x) * 4;
            for c in 0..3 {
                // Bars from the scrolled position, grain (the low 6 bits) from this frame's own draw.
                let bar = bars.pixels[from + c] & 0xc0;
                pixels.push(bar | (grain.pixels[here + c] & 0x3f));
            }
            pixels.push(255);
        }
    }
    RgbaImage {
        width: bars.width,
        height: bars.height,
        pixels,
    }
}

/// A stereo sine tone as long as the video: left 440 Hz, right 660 Hz, both raised by `seed mod 100` Hz.
fn tone(job: &VideoJob) -> Audio {
    let rate = TONE_SAMPLE_RATE;
    let n =
        (f64::from(job.frames()) * f64::from(rate) / f64::from(job.fps.max(1))).round() as usize;
    let lift = (job.seed % 100) as f64;
    let (fl, fr) = (440.0 + lift, 660.0 + lift);
    let mut samples = Vec::with_capacity(2 * n);
    for k in 0..n {
        let t = k as f64 / f64::from(rate);
        samples.push((0.25 * (std::f64::consts::TAU * fl * t).sin()) as f32);
        samples.push((0.25 * (std::f64::consts::TAU * fr * t).sin()) as f32);
    }
    Audio {
        sample_rate: rate,
        channels: 2,
        samples,
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

    fn video(audio: bool) -> VideoJob {
        VideoJob {
            prompt: "waves".into(),
            negative_prompt: None,
            width: 32,
            height: 16,
            seconds: 0.5,
            fps: 8,
            seed: 3,
            steps: Some(2),
            guidance: None,
            audio,
            first_frame: None,
        }
    }

    #[test]
    fn videos_are_deterministic_and_move() {
        let EngineOutput::Video { frames, fps, audio } = render_video(&video(true)) else {
            panic!("expected a video");
        };
        assert_eq!((frames.len(), fps), (4, 8));
        assert_eq!(
            EngineOutput::Video {
                frames: frames.clone(),
                fps,
                audio: audio.clone()
            },
            render_video(&video(true))
        );
        assert_ne!(frames[0], frames[1], "consecutive frames differ");
        let audio = audio.unwrap();
        assert_eq!((audio.sample_rate, audio.channels), (TONE_SAMPLE_RATE, 2));
        assert_eq!(audio.samples.len(), 2 * 16000, "half a second of stereo");
        assert!(audio.samples.iter().all(|s| s.abs() <= 0.25));
        assert_ne!(audio.samples[2], audio.samples[3], "left and right differ");
        let EngineOutput::Video { audio, .. } = render_video(&video(false)) else {
            panic!("expected a video");
        };
        assert!(audio.is_none());
    }

    #[test]
    fn video_refusals_name_the_field() {
        let mut engine = TestPattern::default();
        engine.load().unwrap();
        let mut job = video(false);
        job.first_frame = Some("f.png".into());
        let e = engine.generate_video(&job, &mut |_| {}).unwrap_err();
        assert!(
            matches!(&e, EngineError::InvalidRequest(m) if m.contains("first_frame")),
            "{e}"
        );
        let mut job = video(false);
        (job.width, job.height, job.seconds, job.fps) = (2048, 2048, 60.0, 120);
        let e = engine.generate_video(&job, &mut |_| {}).unwrap_err();
        assert!(
            matches!(&e, EngineError::InvalidRequest(m) if m.contains("`seconds`")),
            "{e}"
        );
        let mut seen = Vec::new();
        engine
            .generate_video(&video(false), &mut |p| seen.push((p.phase, p.step, p.of)))
            .unwrap();
        assert_eq!(
            seen,
            [("denoise", 1, 2), ("denoise", 2, 2), ("decode", 1, 1)]
        );
    }

    #[test]
    fn sizes_off_its_grid_are_refused_naming_the_rule() {
        let mut engine = TestPattern::default();
        engine.load().unwrap();
        let mut still = job("x", 0);
        still.height = 24;
        let mut steps = 0;
        let e = engine.generate(&still, &mut |_| steps += 1).unwrap_err();
        assert_eq!(
            e,
            EngineError::InvalidRequest(
                "`height` must be a multiple of 16 for the test pattern, got 24".into()
            )
        );
        assert_eq!(steps, 0, "refused before any step");
        let mut clip = video(false);
        clip.width = 40;
        let e = engine.generate_video(&clip, &mut |_| {}).unwrap_err();
        assert!(
            matches!(&e, EngineError::InvalidRequest(m) if m.contains("`width` must be a multiple of 16")),
            "{e}"
        );
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
