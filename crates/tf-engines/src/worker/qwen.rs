//! The Qwen-Image 2.1 pipeline as a [`WorkerEngine`]: `load` builds the [`Pipeline`] from a diffusers-format
//! folder, `generate` runs one request, `unload` drops the pipeline (every device buffer, module and stream,
//! then the context, then the driver).
//!
//! Sizes must be multiples of 32 here: the reference pipeline floors other sizes, which would hand back an
//! image smaller than the one asked for, so the worker refuses them instead (as LocalRouter does).
//!
//! The load log names the checkpoint variant (base or Turbo, as the folder says). A Turbo checkpoint runs without
//! guidance: a job's `negative_prompt` or `guidance` is ignored, as the reference ignores them, and the log says
//! so for that job.

use std::path::PathBuf;

use crate::nn::backend_error::chain_has_lost_context;

use crate::qwen_image::pipeline::{
    Backend, LoadOptions, Pipeline, PipelineError, Progress as PipelineProgress, Request,
    SIDE_MULTIPLE,
};

use crate::qwen_image::variant::Ignored;

use super::{EngineError, ImageJob, Progress, RgbaImage, WorkerEngine};

/// Where the pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// The GPU when a CUDA driver and device are present, else the host reference.
    Auto,
    /// The host (f32 reference).
    Host,
    /// The GPU (device 0).
    Gpu,
}

/// Qwen-Image 2.1 served by the worker.
pub struct QwenImageEngine {
    model: PathBuf,
    backend: BackendChoice,
    dit_precision: crate::nn::precision::DitPrecision,
    /// Caps the memory plan's budget (`LoadOptions::device_budget`).
    device_budget: Option<u64>,
    pipeline: Option<Pipeline>,
    /// The board's meter while loaded on a GPU (`WorkerEngine::power_meter`).
    meter: Option<std::sync::Arc<tf_cuda::power::PowerMeter>>,
}

impl QwenImageEngine {
    /// An engine for the model folder `model` (nothing is read until `load`).
    pub fn new(model: PathBuf, backend: BackendChoice) -> QwenImageEngine {
        QwenImageEngine {
            model,
            backend,
            dit_precision: crate::nn::precision::DitPrecision::Bf16,
            device_budget: None,
            pipeline: None,
            meter: None,
        }
    }

    /// The same engine planning its memory against at most `bytes` (below the components' sum, every request
    /// loads, runs and frees them in turn).
    pub fn with_device_budget(self, bytes: Option<u64>) -> QwenImageEngine {
        QwenImageEngine {
            device_budget: bytes,
            ..self
        }
    }

    /// The same engine loading its DiT in `precision` (GPU only; the host refuses anything but bf16).
    pub fn with_dit_precision(
        self,
        precision: crate::nn::precision::DitPrecision,
    ) -> QwenImageEngine {
        QwenImageEngine {
            dit_precision: precision,
            ..self
        }
    }

    /// The loaded pipeline, if any.
    pub fn pipeline(&self) -> Option<&Pipeline> {
        self.pipeline.as_ref()
    }
}

/// The size the worker warms up at load (LocalRouter's default image size).
const WARM_UP_SIZE: (usize, usize) = (1024, 1024);
/// Time the warm-up may spend timing GEMM algorithms the plan cache does not hold yet.
const WARM_UP_GEMM_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

impl WorkerEngine for QwenImageEngine {
    fn load(&mut self) -> Result<u64, EngineError> {
        let backend = match self.backend {
            BackendChoice::Auto => Backend::detect(),
            BackendChoice::Host => Backend::Host,
            BackendChoice::Gpu => Backend::Gpu,
        };
        log!(
            "tf worker: loading Qwen-Image from {} on the {} backend",
            self.model.display(),
            backend.name()
        );
        let options = LoadOptions {
            dit_precision: self.dit_precision,
            device_budget: self.device_budget,
            ..LoadOptions::new(backend)
        };
        let nvml = backend.open_power_library();
        let pipeline = Pipeline::load(&self.model, &options).map_err(|e| classify(&e, false))?;
        let report = pipeline.load_report();
        log!(
            "tf worker: loaded {} in {:.2} s; text encoder and VAE on the device: {}; DiT precision {}",
            report.variant,
            report.seconds,
            report.te_vae_on_device,
            match backend {
                Backend::Host => "f32 (host)".to_string(),
                Backend::Gpu => report.dit_precision.to_string(),
            }
        );
        log!("tf worker: {}", pipeline.memory_plan());
        let mut pipeline = pipeline;
        if pipeline.context().is_some() {
            // The first request of the default size must not pay for first-call planning: warm that size now.
            let (w, h) = WARM_UP_SIZE;
            match pipeline.warm_up(w, h, WARM_UP_GEMM_BUDGET) {
                Ok(warm) => match warm.skipped {
                    Some(why) => log!("tf worker: no warm-up: {why}"),
                    None => log!("tf worker: warmed up at {w}x{h} in {:.2} s", warm.seconds),
                },
                Err(e) if e.is_invalid_request() => {
                    log!("tf worker: no warm-up at {w}x{h}, the model's limits refuse it: {e}")
                }
                Err(e) => {
                    return Err(classify(
                        &e,
                        pipeline.context().is_some_and(|c| c.is_lost()),
                    ))
                }
            }
            // Nor may a request of a prompt length or size an earlier process planned plan or load GEMM kernels.
            let stored = pipeline
                .prepare_stored_gemms()
                .map_err(|e| classify(&e, pipeline.context().is_some_and(|c| c.is_lost())))?;
            super::log_stored_gemms(stored);
        }
        self.meter = super::open_power_meter(nvml, pipeline.context());
        self.pipeline = Some(pipeline);
        Ok(report.resident_bytes)
    }

    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        let pipeline = self
            .pipeline
            .as_mut()
            .ok_or_else(|| EngineError::Failed("the Qwen-Image pipeline is not loaded".into()))?;
        for (name, side) in [("width", job.width), ("height", job.height)] {
            if !(side as usize).is_multiple_of(SIDE_MULTIPLE) {
                return Err(EngineError::InvalidRequest(format!(
                    "`{name}` must be a multiple of {SIDE_MULTIPLE} for Qwen-Image, got {side}"
                )));
            }
        }
        let request = Request {
            negative_prompt: job.negative_prompt.clone(),
            true_cfg_scale: job.guidance.unwrap_or(1.0),
            width: job.width as usize,
            height: job.height as usize,
            steps: job.steps.map(|s| s as usize),
            seed: job.seed,
            ..Request::new(job.prompt.clone())
        };
        let planning_before = tf_cuda::cublaslt::call_planning();
        let driver_before = tf_cuda::driver_costs();
        let result = pipeline.generate(&request, &mut |p| progress(translate(p)));
        let planning = tf_cuda::cublaslt::call_planning().since(&planning_before);
        let driver = tf_cuda::driver_costs().since(&driver_before);
        let generation = match result {
            Ok(g) => g,
            Err(e) => {
                let lost = pipeline.context().is_some_and(|c| c.is_lost());
                return Err(classify(&e, lost));
            }
        };
        for ignored in &generation.ignored {
            log!("tf worker: {}", ignored.message(job_field(*ignored)));
        }
        let t = &generation.timings;
        log!(
            "tf worker: encode {:.3} s, {} steps {:.3} s, decode {:.3} s, total {:.3} s; GEMM plans built in the \
             request: {} ({:.1} ms); {}",
            t.encode,
            t.steps.len(),
            t.steps.iter().sum::<f64>(),
            t.decode,
            t.total,
            planning.plans,
            planning.seconds * 1e3,
            driver
        );
        if t.loads.total() > 0.0 {
            // The sequential memory plan loads each component inside the request: say where that time went.
            log!("tf worker: component loads in the request {}", t.loads);
        }
        let image = generation.image;
        let pixels = match image.channels {
            4 => image.pixels,
            3 => image
                .pixels
                .chunks_exact(3)
                .flat_map(|rgb| [rgb[0], rgb[1], rgb[2], 255])
                .collect(),
            other => {
                return Err(EngineError::Failed(format!(
                    "the pipeline returned an image with {other} channels (expected 3 or 4)"
                )))
            }
        };
        let width = u32::try_from(image.width)
            .map_err(|_| EngineError::Failed("image width out of range".into()))?;
        let height = u32::try_from(image.height)
            .map_err(|_| EngineError::Failed("image height out of range".into()))?;
        RgbaImage::new(width, height, pixels)
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
                usage.device, usage.device_allocs
            );
        }
    }
}

/// The job field (LocalRouter's name) of a request field the variant ignores.
fn job_field(ignored: Ignored) -> &'static str {
    match ignored {
        Ignored::NegativePrompt => "`negative_prompt`",
        Ignored::GuidanceScale => "`guidance`",
    }
}

fn translate(p: PipelineProgress) -> Progress {
    match p {
        PipelineProgress::Encoded { .. } => Progress::encoded(),
        PipelineProgress::Step { step, steps, .. } => Progress::denoised(step, steps),
        PipelineProgress::Decoded { .. } => Progress::decoded(1, 1),
    }
}

/// Maps a pipeline error to the worker's three kinds. A lost context is found in the error's source chain (the
/// components keep `tf_cuda::Error` as a typed source). `context_says_lost` is the context's own flag, a
/// second witness only: when it alone says lost, some path flattened the cause, and that is logged.
fn classify(error: &PipelineError, context_says_lost: bool) -> EngineError {
    if error.is_invalid_request() {
        // The pipeline's own message already starts with "invalid request".
        let text = error.to_string();
        let text = text.strip_prefix("invalid request: ").unwrap_or(&text);
        return EngineError::InvalidRequest(text.to_string());
    }
    let in_chain = chain_says_context_lost(error);
    if context_says_lost && !in_chain {
        log!("tf worker: the context is lost but the error chain does not say so (a cause was flattened): {error}");
    }
    if in_chain || context_says_lost {
        return EngineError::DeviceLost(error.to_string());
    }
    EngineError::Failed(error.to_string())
}

/// Whether `error` or any error in its source chain is a lost device context.
fn chain_says_context_lost(error: &PipelineError) -> bool {
    chain_has_lost_context(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_requests_stay_request_errors_even_on_a_lost_context() {
        let e = PipelineError::InvalidRequest("steps must be at least 1".into());
        assert_eq!(
            classify(&e, true),
            EngineError::InvalidRequest("steps must be at least 1".into())
        );
    }

    #[test]
    fn a_lost_context_is_fatal_and_other_errors_are_not() {
        let e = PipelineError::Internal("kernel launch failed".into());
        assert!(matches!(classify(&e, true), EngineError::DeviceLost(_)));
        assert!(matches!(classify(&e, false), EngineError::Failed(_)));
    }

    #[test]
    fn a_lost_context_deep_in_the_chain_is_found_without_the_flag() {
        use crate::nn::backend_error::gpu_error;
        use crate::qwen_image::dit::DitError;
        use crate::qwen_image::vae::VaeError;
        let lost = || tf_cuda::Error::ContextLost {
            call: "cuStreamSynchronize",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS",
        };
        let gemm = tf_cuda::cublaslt::CublasLtError::Runtime(lost());
        let cases = [
            PipelineError::Dit(DitError::Gpu(gpu_error("running the DiT step", lost()))),
            PipelineError::Dit(DitError::Gpu(gpu_error("GEMM 64x64x64", gemm))),
            PipelineError::Vae(VaeError::Gpu(gpu_error("running the decode", lost()))),
            PipelineError::Gpu(gpu_error("reading free memory", lost())),
        ];
        for e in cases {
            assert!(
                matches!(classify(&e, false), EngineError::DeviceLost(_)),
                "{e}"
            );
        }
        let oom = tf_cuda::Error::OutOfMemory {
            call: "cuMemAlloc_v2",
            bytes: 1 << 40,
            why: "the driver has no room".into(),
        };
        let e = PipelineError::Dit(DitError::Gpu(gpu_error("allocating", oom)));
        assert!(matches!(classify(&e, false), EngineError::Failed(_)));
    }

    #[test]
    fn progress_phases_translate() {
        assert_eq!(
            translate(PipelineProgress::Step {
                step: 2,
                steps: 8,
                seconds: 0.1
            }),
            Progress {
                phase: "denoise",
                step: 2,
                of: 8
            }
        );
        assert_eq!(
            translate(PipelineProgress::Decoded { seconds: 0.0 }).phase,
            "decode"
        );
    }

    #[test]
    fn generate_before_load_and_bad_sizes_fail_cleanly() {
        let mut engine = QwenImageEngine::new(PathBuf::from("/nonexistent"), BackendChoice::Host);
        let job = ImageJob {
            prompt: "x".into(),
            negative_prompt: None,
            width: 48,
            height: 64,
            steps: Some(1),
            seed: 0,
            guidance: None,
        };
        assert!(matches!(
            engine.generate(&job, &mut |_| {}),
            Err(EngineError::Failed(_))
        ));
        assert!(matches!(engine.load(), Err(EngineError::Failed(_))));
        engine.unload();
    }
}
