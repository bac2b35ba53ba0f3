//! The MiniMax H3 pipeline as a video [`WorkerEngine`]: `load` builds the [`H3Pipeline`] from a diffusers-format
//! folder, `generate_video` runs one `request.video` (progress per phase and per step) and hands back the frames
//! and the stereo track, `unload` drops the pipeline (every component, then the context, then the driver).
//!
//! A request is checked completely by the pipeline before any model runs; what it refuses (a size off the canvas
//! multiple, a length outside the window, an fps other than 24, a negative prompt, guidance, `first_frame`) comes
//! back as `invalid_request_error` naming the field. Image requests are refused: this engine makes videos.

use std::path::PathBuf;

use crate::minimax_h3::pipeline::{
    Backend, H3Pipeline, LoadOptions, PipelineError, Progress as PipelineProgress, Request,
};
use crate::nn::backend_error::chain_has_lost_context;

use super::qwen::BackendChoice;
use super::{
    Audio, EngineError, EngineOutput, ImageJob, Progress, RgbaImage, VideoJob, WorkerEngine,
};

/// MiniMax H3 served by the worker.
pub struct MiniMaxH3Engine {
    model: PathBuf,
    backend: BackendChoice,
    options: Option<LoadOptions>,
    pipeline: Option<H3Pipeline>,
    /// The board's meter while loaded on a GPU (`WorkerEngine::power_meter`).
    meter: Option<std::sync::Arc<tf_cuda::power::PowerMeter>>,
    /// A multi-GPU job's after-load barrier: told whether this rank loaded, it answers whether every rank did.
    load_barrier: Option<LoadBarrier>,
}

/// See [`MiniMaxH3Engine::with_load_barrier`].
pub type LoadBarrier = Box<dyn FnMut(bool) -> Result<(), String>>;

impl MiniMaxH3Engine {
    /// An engine for the model folder `model` (nothing is read until `load`).
    pub fn new(model: PathBuf, backend: BackendChoice) -> MiniMaxH3Engine {
        MiniMaxH3Engine {
            model,
            backend,
            options: None,
            pipeline: None,
            meter: None,
            load_barrier: None,
        }
    }

    /// Makes every `load` wait at `barrier` (one rank of a multi-GPU job): it is told whether this rank's load
    /// succeeded and answers whether every rank's did. A rank that loaded drops its pipeline when another did not,
    /// and the load fails with the barrier's answer (the ranks that failed, named); this rank's own load error
    /// comes first.
    pub fn with_load_barrier(
        mut self,
        barrier: impl FnMut(bool) -> Result<(), String> + 'static,
    ) -> MiniMaxH3Engine {
        self.load_barrier = Some(Box::new(barrier));
        self
    }

    /// The same, with load options of the caller's (limits, budget); their backend is replaced by `backend`'s.
    pub fn with_options(
        model: PathBuf,
        backend: BackendChoice,
        options: LoadOptions,
    ) -> MiniMaxH3Engine {
        MiniMaxH3Engine {
            options: Some(options),
            ..MiniMaxH3Engine::new(model, backend)
        }
    }

    /// The loaded pipeline, if any.
    pub fn pipeline(&self) -> Option<&H3Pipeline> {
        self.pipeline.as_ref()
    }
}

impl WorkerEngine for MiniMaxH3Engine {
    fn load(&mut self) -> Result<u64, EngineError> {
        let backend = match self.backend {
            BackendChoice::Auto => Backend::detect(),
            BackendChoice::Host => Backend::Host,
            BackendChoice::Gpu => Backend::Gpu,
        };
        log!(
            "tf worker: loading MiniMax H3 from {} on the {} backend",
            self.model.display(),
            backend.name()
        );
        let mut options = self
            .options
            .clone()
            .unwrap_or_else(|| LoadOptions::new(backend));
        options.backend = backend;
        let nvml = backend.open_power_library();
        let loaded = H3Pipeline::load(&self.model, &options);
        if let Some(barrier) = self.load_barrier.as_mut() {
            let verdict = barrier(loaded.is_ok());
            if let (Ok(_), Err(why)) = (&loaded, verdict) {
                return Err(EngineError::Failed(why));
            }
        }
        let pipeline = loaded.map_err(|e| classify(&e, false))?;
        let report = pipeline.load_report();
        log!(
            "tf worker: loaded in {:.2} s, {} B resident",
            report.seconds,
            report.resident_bytes
        );
        for (component, precision) in &report.precision {
            log!("tf worker: {component} precision: {precision}");
        }
        log!("tf worker: {}", pipeline.memory_plan());
        let resident = report.resident_bytes;
        let mut pipeline = pipeline;
        // The first request must not plan or load the GEMM kernels of shapes an earlier process planned.
        let stored = pipeline
            .prepare_stored_gemms()
            .map_err(|e| classify(&e, pipeline.context().is_some_and(|c| c.is_lost())))?;
        super::log_stored_gemms(stored);
        self.meter = super::open_power_meter(nvml, pipeline.context());
        self.pipeline = Some(pipeline);
        Ok(resident)
    }

    fn generate(
        &mut self,
        _job: &ImageJob,
        _progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        Err(EngineError::InvalidRequest(
            "this engine makes videos; send `request.video`".into(),
        ))
    }

    fn power_meter(&self) -> Option<std::sync::Arc<tf_cuda::power::PowerMeter>> {
        self.meter.clone()
    }

    fn unload(&mut self) {
        self.meter = None;
        if let Some(pipeline) = self.pipeline.take() {
            drop(pipeline);
            let usage = tf_cuda::usage();
            log!(
                "tf worker: unloaded; device bytes still held through tf-cuda: {} in {} allocations",
                usage.device,
                usage.device_allocs
            );
        }
    }

    fn makes_video(&self) -> bool {
        true
    }

    fn generate_video(
        &mut self,
        job: &VideoJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<EngineOutput, EngineError> {
        let pipeline = self
            .pipeline
            .as_mut()
            .ok_or_else(|| EngineError::Failed("the MiniMax H3 pipeline is not loaded".into()))?;
        let request = request_of(job);
        let audio = request.audio;
        let mut decode_steps = 0;
        let planning_before = tf_cuda::cublaslt::call_planning();
        let driver_before = tf_cuda::driver_costs();
        let result = pipeline.generate(&request, &mut |p| {
            progress(translate(p, audio, &mut decode_steps))
        });
        let planning = tf_cuda::cublaslt::call_planning().since(&planning_before);
        let driver = tf_cuda::driver_costs().since(&driver_before);
        let made = match result {
            Ok(made) => made,
            Err(e) => {
                let lost = pipeline.context().is_some_and(|c| c.is_lost());
                return Err(classify(&e, lost));
            }
        };
        let t = &made.timings;
        log!(
            "tf worker: encode {:.3} s, {} steps {:.3} s, decode video {:.3} s, audio {:.3} s, total {:.3} s; {} frames \
             ({} asked); GEMM plans built in the request: {} ({:.1} ms); {}",
            t.encode,
            t.steps.len(),
            t.steps.iter().sum::<f64>(),
            t.decode_video,
            t.decode_audio,
            t.total,
            made.frames.frames,
            made.requested_frames,
            planning.plans,
            planning.seconds * 1e3,
            driver
        );
        if t.loads.total() > 0.0 {
            // The sequential memory plan loads each component inside the request: say where that time went.
            log!("tf worker: component loads in the request {}", t.loads);
        }
        let (w, h) = (made.frames.width, made.frames.height);
        let width = u32::try_from(w).map_err(|_| EngineError::Failed("frame width".into()))?;
        let height = u32::try_from(h).map_err(|_| EngineError::Failed("frame height".into()))?;
        let plane = w * h * 3;
        let frames = made
            .frames
            .rgb
            .chunks_exact(plane.max(1))
            .map(|rgb| {
                let rgba = rgb
                    .chunks_exact(3)
                    .flat_map(|p| [p[0], p[1], p[2], 255])
                    .collect();
                RgbaImage::new(width, height, rgba)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let audio = made.audio.map(|a| Audio {
            sample_rate: a.sample_rate,
            channels: 2,
            samples: a.interleaved(),
        });
        Ok(EngineOutput::Video {
            frames,
            fps: made.fps,
            audio,
        })
    }
}

/// The pipeline request of a worker job (fields checked by the pipeline, which names them when it refuses).
pub fn request_of(job: &VideoJob) -> Request {
    Request {
        negative_prompt: job.negative_prompt.clone(),
        width: job.width as usize,
        height: job.height as usize,
        seconds: f64::from(job.seconds),
        fps: job.fps,
        seed: job.seed,
        steps: job.steps.map(|s| s as usize),
        guidance: job.guidance,
        audio: job.audio,
        first_frame: job.first_frame.clone(),
        ..Request::new(job.prompt.clone())
    }
}

/// The protocol's phases: `encode` 1/1, `denoise` per step, `decode` 1/2 (video) and 2/2 (audio), or 1/1 without
/// audio.
fn translate(p: PipelineProgress, audio: bool, decodes: &mut u32) -> Progress {
    match p {
        PipelineProgress::Encoded { .. } => Progress::encoded(),
        PipelineProgress::Step { step, steps, .. } => Progress::denoised(step, steps),
        PipelineProgress::DecodedVideo { .. } | PipelineProgress::DecodedAudio { .. } => {
            *decodes = decodes.saturating_add(1);
            Progress::decoded(*decodes, if audio { 2 } else { 1 })
        }
    }
}

/// Maps a pipeline error to the worker's three kinds; a lost context is found in the error's source chain (the
/// context's own flag is the second witness).
fn classify(error: &PipelineError, context_says_lost: bool) -> EngineError {
    if error.is_invalid_request() {
        let text = error.to_string();
        let text = text.strip_prefix("invalid request: ").unwrap_or(&text);
        return EngineError::InvalidRequest(text.to_string());
    }
    if chain_has_lost_context(error) || context_says_lost {
        return EngineError::DeviceLost(error.to_string());
    }
    EngineError::Failed(error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_errors_stay_request_errors_and_lost_contexts_are_fatal() {
        let e = PipelineError::InvalidRequest("`fps` 30: ask for 24".into());
        assert_eq!(
            classify(&e, true),
            EngineError::InvalidRequest("`fps` 30: ask for 24".into())
        );
        let lost = tf_cuda::Error::ContextLost {
            call: "cuStreamSynchronize",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS",
        };
        let e = PipelineError::Gpu(crate::nn::backend_error::gpu_error(
            "reading free memory",
            lost,
        ));
        assert!(matches!(classify(&e, false), EngineError::DeviceLost(_)));
        let e = PipelineError::Internal("odd".into());
        assert!(matches!(classify(&e, false), EngineError::Failed(_)));
        assert!(matches!(classify(&e, true), EngineError::DeviceLost(_)));
    }

    #[test]
    fn phases_translate() {
        let mut d = 0;
        assert_eq!(
            translate(PipelineProgress::Encoded { seconds: 0.0 }, true, &mut d).phase,
            "encode"
        );
        let s = translate(
            PipelineProgress::Step {
                step: 2,
                steps: 7,
                seconds: 0.0,
            },
            true,
            &mut d,
        );
        assert_eq!((s.phase, s.step, s.of), ("denoise", 2, 7));
        let v = translate(
            PipelineProgress::DecodedVideo { seconds: 0.0 },
            true,
            &mut d,
        );
        let a = translate(
            PipelineProgress::DecodedAudio { seconds: 0.0 },
            true,
            &mut d,
        );
        assert_eq!(((v.step, v.of), (a.step, a.of)), ((1, 2), (2, 2)));
        let mut d = 0;
        let v = translate(
            PipelineProgress::DecodedVideo { seconds: 0.0 },
            false,
            &mut d,
        );
        assert_eq!((v.step, v.of), (1, 1));
    }

    #[test]
    fn a_failed_load_still_reports_at_the_barrier_and_keeps_its_own_error() {
        let told = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let seen = std::rc::Rc::clone(&told);
        let mut engine = MiniMaxH3Engine::new(PathBuf::from("/nonexistent"), BackendChoice::Host)
            .with_load_barrier(move |loaded| {
                seen.borrow_mut().push(loaded);
                Err("rank(s) [0] could not load the model".into())
            });
        let err = engine.load().unwrap_err().to_string();
        assert_eq!(*told.borrow(), vec![false]);
        assert!(err.contains("/nonexistent"), "{err}");
        assert!(engine.pipeline().is_none());
    }

    #[test]
    fn a_rank_that_loaded_drops_its_pipeline_when_another_rank_failed() {
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/minimax_h3_pipeline/model");
        let told = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let seen = std::rc::Rc::clone(&told);
        let mut verdicts = vec![
            Ok(()),
            Err("rank(s) [1] could not load the model".to_string()),
        ];
        let mut engine =
            MiniMaxH3Engine::new(model, BackendChoice::Host).with_load_barrier(move |loaded| {
                seen.borrow_mut().push(loaded);
                verdicts.pop().unwrap_or(Ok(()))
            });
        let err = engine.load().unwrap_err();
        assert!(
            matches!(&err, EngineError::Failed(m) if m.contains("rank(s) [1]")),
            "{err}"
        );
        assert!(engine.pipeline().is_none());
        // Every rank loaded the second time: the pipeline is kept.
        engine.load().unwrap();
        assert!(engine.pipeline().is_some());
        assert_eq!(*told.borrow(), vec![true, true]);
    }

    #[test]
    fn before_load_and_image_requests_fail_cleanly() {
        let mut engine = MiniMaxH3Engine::new(PathBuf::from("/nonexistent"), BackendChoice::Host);
        let job = VideoJob {
            prompt: "x".into(),
            negative_prompt: None,
            width: 64,
            height: 64,
            seconds: 1.0,
            fps: 24,
            seed: 0,
            steps: None,
            guidance: None,
            audio: false,
            first_frame: None,
        };
        assert!(matches!(
            engine.generate_video(&job, &mut |_| {}),
            Err(EngineError::Failed(_))
        ));
        assert!(matches!(engine.load(), Err(EngineError::Failed(_))));
        let image = ImageJob {
            prompt: "x".into(),
            negative_prompt: None,
            width: 64,
            height: 64,
            steps: None,
            seed: 0,
            guidance: None,
        };
        assert!(matches!(
            engine.generate(&image, &mut |_| {}),
            Err(EngineError::InvalidRequest(_))
        ));
        engine.unload();
    }
}
