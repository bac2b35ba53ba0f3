//! `tf video`: a prompt to an MP4 (H.264 + AAC stereo) through the MiniMax H3 pipeline, or through the
//! `testpattern` engine (deterministic frames and a tone, no model) to check the output path.
//!
//! Progress goes to stderr (a bar on a terminal, plain lines otherwise), per-phase timings at the end; `--json`
//! prints a machine-readable summary on stdout. The MP4 is muxed by `ffmpeg` (`TF_FFMPEG`, else `PATH`); when it is
//! missing or fails, the raw frames (PNG) and the audio (WAV) are written instead and the command fails with the
//! install command. `--frames-dir` and `--wav` keep the raw outputs as well.
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use serde_json::json;
use tf_engines::minimax_h3::noise::{H3Noise, VIDEO_NOISE};
use tf_engines::minimax_h3::pipeline::{
    Backend, Generation, H3Pipeline, LoadOptions, PipelineError, Progress, Request,
};
use tf_engines::nn::media::mp4::{
    find_ffmpeg, write_mp4, AudioInput, Mp4Error, Mp4Report, PixelLayout, VideoInput,
};
use tf_engines::nn::media::png::{ColorType, PngError};
use tf_engines::nn::media::wav::{write_wav, WavError};
use tf_engines::nn::sampling::noise::NoiseError;
use tf_engines::nn::tensor::TensorF32;
use tf_engines::nn::weights::{write_safetensors, AnyTensor};
use tf_engines::worker::testpattern::TestPattern;
use tf_engines::worker::{EngineOutput, VideoJob, WorkerEngine};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
    /// MiniMax H3 from a diffusers-format folder (--model).
    #[value(name = "minimax_h3")]
    MinimaxH3,
    /// Deterministic test frames and a stereo tone, no model (checks the MP4 path on any machine).
    Testpattern,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// The GPU when a CUDA driver and a device are present, else the host reference.
    Auto,
    /// The f32 host reference.
    Host,
    /// The GPU engines on device 0.
    Gpu,
}

#[derive(clap::Args)]
pub struct Args {
    /// What makes the video.
    #[arg(long, value_enum, default_value = "minimax_h3")]
    engine: EngineArg,
    /// Diffusers MiniMax H3 folder (modular_model_index.json, transformer/, text_encoder/, tokenizer/, vae/,
    /// audio_vae/, scheduler/, audio_scheduler/).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Frame size WIDTHxHEIGHT in pixels (MiniMax H3: multiples of 32 as released).
    #[arg(long, default_value = "768x448", value_parser = parse_size)]
    size: (u32, u32),
    /// Length in seconds; MiniMax H3 snaps round(seconds * 24) frames up to 17n+5.
    #[arg(long, default_value_t = 5.0)]
    seconds: f32,
    /// Frames per second (MiniMax H3 makes 24).
    #[arg(long, default_value_t = 24)]
    fps: u32,
    /// Sampling steps. MiniMax H3: grid points of its schedules, the final 0 included (the reference's
    /// num_inference_steps; N points make N - 1 model calls), default 50.
    #[arg(long)]
    steps: Option<u32>,
    /// Noise seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Make no audio track (MiniMax H3 still samples the audio rows, one sequence holds both, but skips the audio
    /// decode).
    #[arg(long = "no-audio")]
    no_audio: bool,
    /// Initial noise from a safetensors file (`video_noise` [1, C, F, H, W], `audio_noise` [2 A, C]) instead of the
    /// seeded draw.
    #[arg(long)]
    noise: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// GEMM precision of the GPU DiT: bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    precision: tf_engines::nn::precision::DitPrecision,
    /// Cap the memory plan's budget (40GiB, 512MiB, ...): the GPU plans against the smaller of this and its free
    /// memory less a reserve, the host against this alone. Below the components' sum, the request loads, runs
    /// and frees them in turn (and says how long the loads took).
    #[arg(long = "device-budget", value_parser = crate::parse_budget)]
    device_budget: Option<u64>,
    /// Output MP4.
    #[arg(short = 'o', long = "out", default_value = "video.mp4")]
    out: PathBuf,
    /// Also write every frame as a PNG into this folder (frame_00000.png, ...).
    #[arg(long = "frames-dir")]
    frames_dir: Option<PathBuf>,
    /// Also write the audio track as a 32-bit float WAV file.
    #[arg(long)]
    wav: Option<PathBuf>,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
    /// Write the prompt features, the latent rows after every step, the decoded frames (f32 in [0, 1]) and the
    /// audio samples to this safetensors file (`prompt_embeds`, `latents.{i}`, `audio_latents.{i}`, `frames`,
    /// `audio`), for comparisons with a reference.
    #[arg(long = "dump-steps")]
    dump_steps: Option<PathBuf>,
    /// Timing only: make the text encoder's and the DiT's weights on the GPU from this seed instead of reading
    /// them (their folders need only config.json; the VAEs are still read). The video shows nothing.
    #[arg(long = "random-weights", value_name = "SEED")]
    random_weights: Option<u32>,
    #[command(flatten)]
    gpu: super::ranks::GpuArgs,
}

pub(crate) fn parse_size(text: &str) -> Result<(u32, u32), String> {
    let (w, h) = text
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("size {text:?} is not WIDTHxHEIGHT (e.g. 768x448)"))?;
    let side = |s: &str| {
        s.trim()
            .parse::<u32>()
            .map_err(|_| format!("size {text:?}: {s:?} is not a whole number of pixels"))
    };
    Ok((side(w)?, side(h)?))
}

pub fn run(args: Args) -> ExitCode {
    // A multi-GPU job ends on every rank: rank 0 waits for the others after success, stops them after a failure.
    match super::ranks::end(video(&args).map_err(|e| e.to_string())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tf video: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Errors of the command: the engine's, the media writers', or the command's own (with the fix).
#[derive(Debug, thiserror::Error)]
enum VideoError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Noise(#[from] NoiseError),
    #[error("{0}")]
    Engine(String),
    #[error(transparent)]
    Mp4(#[from] Mp4Error),
    #[error(transparent)]
    Png(#[from] PngError),
    #[error(transparent)]
    Wav(#[from] WavError),
    /// The MP4 could not be made; the raw outputs were written.
    #[error("{why}. The raw output was written instead: {kept}")]
    RawKept { why: Mp4Error, kept: String },
}

/// A made video, whatever made it.
struct Made {
    width: u32,
    height: u32,
    fps: u32,
    layout: PixelLayout,
    frames: Vec<Vec<u8>>,
    /// Sample rate, channels, interleaved samples.
    audio: Option<(u32, u16, Vec<f32>)>,
    /// Per-phase seconds, in order.
    phases: Vec<(&'static str, f64)>,
    steps: Vec<f64>,
    load_seconds: f64,
    extra: serde_json::Value,
}

/// Progress on stderr: a bar on a terminal, plain lines otherwise.
struct Reporter {
    terminal: bool,
}

impl Reporter {
    fn step(&self, step: usize, steps: usize, seconds: f64) {
        let mut err = std::io::stderr();
        if self.terminal {
            let filled = step * 30 / steps.max(1);
            let _ = write!(
                err,
                "\r[{}{}] step {step}/{steps} ({seconds:.3} s)",
                "#".repeat(filled),
                ".".repeat(30 - filled.min(30))
            );
            if step == steps {
                let _ = writeln!(err);
            }
        } else {
            let _ = writeln!(err, "tf video: step {step}/{steps} {seconds:.3} s");
        }
        let _ = err.flush();
    }

    fn phase(&self, what: &str, seconds: f64) {
        eprintln!("tf video: {what} in {seconds:.3} s");
    }
}

fn video(args: &Args) -> Result<(), VideoError> {
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(VideoError::Usage(format!(
                "the output folder {} does not exist; create it or choose another -o",
                parent.display()
            )));
        }
    }
    // Say now, not after minutes of sampling, that the MP4 will not be written.
    let ffmpeg = find_ffmpeg();
    if let Err(e) = &ffmpeg {
        eprintln!(
            "tf video: warning: {e}; the raw frames and audio will be written instead of the MP4"
        );
    }
    let reporter = Reporter {
        terminal: std::io::stderr().is_terminal(),
    };
    let started = Instant::now();
    let made = match args.engine {
        EngineArg::MinimaxH3 => minimax_h3(args, &reporter)?,
        EngineArg::Testpattern if args.gpu.gpus > 1 || args.gpu.force_nccl => {
            return Err(VideoError::Usage(format!(
                "--gpus {} spreads the MiniMax H3 DiT over GPUs; the testpattern engine runs in one process",
                args.gpu.gpus
            )))
        }
        EngineArg::Testpattern => testpattern(args, &reporter)?,
    };
    if !super::ranks::writes_output() {
        return Ok(());
    }
    finish(args, made, ffmpeg, started)
}

fn minimax_h3(args: &Args, reporter: &Reporter) -> Result<Made, VideoError> {
    let Some(model) = &args.model else {
        return Err(VideoError::Usage(
            "--engine minimax_h3 needs --model DIR (a diffusers MiniMax H3 folder)".into(),
        ));
    };
    let backend = match args.backend {
        BackendArg::Auto => Backend::detect(),
        BackendArg::Host => Backend::Host,
        BackendArg::Gpu => Backend::Gpu,
    };
    let options = LoadOptions {
        dit_precision: args.precision,
        random_weights: args.random_weights,
        device_budget: args.device_budget,
        ..LoadOptions::new(backend)
    };
    if let Some(seed) = args.random_weights {
        eprintln!(
            "tf video: RANDOM text-encoder and DiT weights made on the device from seed {seed} (timing only; the \
             video shows nothing)"
        );
    }
    let (width, height) = args.size;
    let mut request = Request::new(args.prompt.clone());
    request.width = width as usize;
    request.height = height as usize;
    request.seconds = f64::from(args.seconds);
    request.fps = args.fps;
    request.seed = args.seed;
    request.steps = args.steps.map(|s| s as usize);
    request.audio = !args.no_audio;
    // Size, length, rate, steps and the noise file are checked against the folder's configs before the load.
    let preflight = H3Pipeline::preflight(model, &options, &request)?;
    if let Some(path) = &args.noise {
        request.noise = Some(H3Noise::load(path, &preflight.noise_shape)?);
        eprintln!(
            "tf video: noise from {} ({VIDEO_NOISE} {:?})",
            path.display(),
            preflight.noise_shape.video_dims()
        );
    }
    if preflight.geometry.num_frames != preflight.requested_frames {
        eprintln!(
            "tf video: {} frames snap up to {} (17 n + 5), {:.3} s",
            preflight.requested_frames,
            preflight.geometry.num_frames,
            preflight.geometry.num_frames as f64 / 24.0
        );
    }
    // One GPU, or this process's rank of a `--gpus N` job (rank 0 starts the others here).
    let mut options = options;
    let agreed = format!("{options:?}");
    options.sequence_parallel = super::ranks::begin(&args.gpu, model, backend, &request, &agreed)
        .map_err(VideoError::Engine)?;
    eprintln!(
        "tf video: loading {} on the {}",
        model.display(),
        backend.name()
    );
    tf_cuda::usage::reset_peaks();
    // Every rank reports its load at the barrier, failed or not, so no rank waits out a failed one; a rank's own
    // load error comes first.
    let nvml = backend.open_power_library();
    let loaded = H3Pipeline::load(model, &options);
    let barrier = super::ranks::ready(loaded.is_ok());
    let mut pipeline = loaded?;
    barrier.map_err(VideoError::Engine)?;
    let load = pipeline.load_report().clone();
    eprintln!(
        "tf video: loaded in {:.2} s, {:.1} MiB resident",
        load.seconds,
        load.resident_bytes as f64 / f64::from(1u32 << 20)
    );
    for (component, precision) in &load.precision {
        eprintln!("tf video: {component} precision: {precision}");
    }
    eprintln!("tf video: {}", pipeline.memory_plan());
    pipeline.keep_step_latents(args.dump_steps.is_some());
    let driver_before = tf_cuda::driver_costs();
    let energy = super::energy::mark(nvml, pipeline.context());
    let made = pipeline.generate(&request, &mut |p| match p {
        Progress::Encoded { seconds } => reporter.phase("prompt encoded and noise drawn", seconds),
        Progress::Step {
            step,
            steps,
            seconds,
        } => reporter.step(step, steps, seconds),
        Progress::DecodedVideo { seconds } => reporter.phase("frames decoded", seconds),
        Progress::DecodedAudio { seconds } => reporter.phase("audio decoded", seconds),
    })?;
    let board_energy_j = super::energy::spent("tf video", energy);
    eprintln!(
        "tf video: driver work in the request: {}",
        tf_cuda::driver_costs().since(&driver_before)
    );
    let loads = &made.timings.loads;
    if loads.total() > 0.0 {
        // The sequential memory plan loads each component inside the request: say where that time went.
        eprintln!("tf video: component loads in the request {}", loads);
    }
    let peak_device_bytes = tf_cuda::usage().device_peak;
    if let Some(path) = &args.dump_steps {
        if super::ranks::writes_output() {
            dump_steps(path, &made)?;
        }
    }
    let f = &made.frames;
    let plane = f.width * f.height * 3;
    let frames: Vec<Vec<u8>> = f
        .rgb
        .chunks_exact(plane.max(1))
        .map(<[u8]>::to_vec)
        .collect();
    let t = &made.timings;
    Ok(Made {
        width: u32::try_from(f.width).unwrap_or(u32::MAX),
        height: u32::try_from(f.height).unwrap_or(u32::MAX),
        fps: made.fps,
        layout: PixelLayout::Rgb,
        frames,
        audio: made
            .audio
            .as_ref()
            .map(|a| (a.sample_rate, 2, a.interleaved())),
        phases: vec![
            ("encode", t.encode),
            ("decode_video", t.decode_video),
            ("decode_audio", t.decode_audio),
            ("component_loads", t.loads.total()),
        ],
        steps: t.steps.clone(),
        load_seconds: load.seconds,
        extra: json!({
            "name": "minimax_h3",
            "backend": backend.name(),
            "requested_frames": made.requested_frames,
            "tokens": made.prompt_ids.len(),
            "resident_bytes": load.resident_bytes,
            "residency": load.residency.name(),
            "precision": load
                .precision
                .iter()
                .map(|(component, p)| (component.to_string(), json!(p)))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "dit_precision": args.precision.to_string(),
            "random_weights": args.random_weights,
            "peak_device_bytes": peak_device_bytes,
            "board_energy_j": board_energy_j,
            "pipeline_total_s": t.total,
            "component_loads_s": {
                "text_encoder": t.loads.text_encoder,
                "dit": t.loads.dit,
                "video_vae": t.loads.video_vae,
                "audio_vae": t.loads.audio_vae,
            },
        }),
    })
}

/// Writes what `--dump-steps` promises (the names a reference comparison reads).
fn dump_steps(path: &Path, made: &Generation) -> Result<(), VideoError> {
    let f = &made.frames;
    let frames = TensorF32::new(vec![f.frames, f.height, f.width, 3], f.pixels.clone())
        .map_err(|e| VideoError::Engine(format!("the decoded frames: {e}")))?;
    let audio = match &made.audio {
        Some(a) => {
            let samples = a.left.len();
            let mut both = a.left.clone();
            both.extend_from_slice(&a.right);
            Some(
                TensorF32::new(vec![2, samples], both)
                    .map_err(|e| VideoError::Engine(format!("the decoded audio: {e}")))?,
            )
        }
        None => None,
    };
    let names: Vec<(String, String)> = (0..made.step_latents.len())
        .map(|i| (format!("latents.{i}"), format!("audio_latents.{i}")))
        .collect();
    let mut tensors: Vec<(&str, AnyTensor<'_>)> =
        vec![("prompt_embeds", AnyTensor::F32(&made.prompt_embeds))];
    for ((video_name, audio_name), step) in names.iter().zip(&made.step_latents) {
        tensors.push((video_name, AnyTensor::F32(&step.video)));
        tensors.push((audio_name, AnyTensor::F32(&step.audio)));
    }
    if let Some(init) = &made.initial_latents {
        tensors.push(("latents.init", AnyTensor::F32(&init.video)));
        tensors.push(("audio_latents.init", AnyTensor::F32(&init.audio)));
    }
    tensors.push(("frames", AnyTensor::F32(&frames)));
    if let Some(audio) = &audio {
        tensors.push(("audio", AnyTensor::F32(audio)));
    }
    write_safetensors(path, &tensors)
        .map_err(|e| VideoError::Engine(format!("writing {}: {e}", path.display())))?;
    eprintln!(
        "tf video: wrote the prompt features, {} steps of latents, the frames and the audio to {}",
        made.step_latents.len(),
        path.display()
    );
    Ok(())
}

fn testpattern(args: &Args, reporter: &Reporter) -> Result<Made, VideoError> {
    let (width, height) = args.size;
    let job = VideoJob {
        prompt: args.prompt.clone(),
        negative_prompt: None,
        width,
        height,
        seconds: args.seconds,
        fps: args.fps,
        seed: args.seed,
        steps: args.steps,
        guidance: None,
        audio: !args.no_audio,
        first_frame: None,
    };
    if !(args.seconds.is_finite() && args.seconds > 0.0) || args.fps == 0 {
        return Err(VideoError::Usage(format!(
            "--seconds {} and --fps {} must both be above 0",
            args.seconds, args.fps
        )));
    }
    if args.backend == BackendArg::Gpu {
        eprintln!("tf video: the test pattern is made on the host; --backend gpu does not apply");
    }
    let mut engine = TestPattern::default();
    engine
        .load()
        .map_err(|e| VideoError::Engine(e.to_string()))?;
    let t = Instant::now();
    let mut last = Instant::now();
    let mut steps = Vec::new();
    let output = engine
        .generate_video(&job, &mut |p| {
            if p.phase == "denoise" {
                let s = last.elapsed().as_secs_f64();
                last = Instant::now();
                steps.push(s);
                reporter.step(p.step as usize, p.of as usize, s);
            }
        })
        .map_err(|e| VideoError::Engine(e.to_string()))?;
    let EngineOutput::Video { frames, fps, audio } = output else {
        return Err(VideoError::Engine(
            "the test pattern returned images".into(),
        ));
    };
    let render = t.elapsed().as_secs_f64();
    reporter.phase("rendered", render);
    Ok(Made {
        width,
        height,
        fps,
        layout: PixelLayout::Rgba,
        frames: frames.into_iter().map(|f| f.pixels().to_vec()).collect(),
        audio: audio.map(|a| (a.sample_rate, a.channels, a.samples)),
        phases: vec![("render", render)],
        steps,
        load_seconds: 0.0,
        extra: json!({"name": "testpattern"}),
    })
}

/// Writes the MP4 (or, when that fails, the raw outputs), the asked raw outputs, and the summary.
fn finish(
    args: &Args,
    made: Made,
    ffmpeg: Result<PathBuf, Mp4Error>,
    started: Instant,
) -> Result<(), VideoError> {
    let t = Instant::now();
    let frames: &[Vec<u8>] = &made.frames;
    let video = VideoInput {
        width: made.width,
        height: made.height,
        fps: made.fps,
        layout: made.layout,
        frames,
    };
    let track = made
        .audio
        .as_ref()
        .map(|(sample_rate, channels, samples)| AudioInput {
            sample_rate: *sample_rate,
            channels: *channels,
            samples,
        });
    let muxed: Result<Mp4Report, Mp4Error> =
        ffmpeg.and_then(|ffmpeg| write_mp4(&ffmpeg, &args.out, &video, track.as_ref()));
    let mux_seconds = t.elapsed().as_secs_f64();

    let stem = args.out.with_extension("");
    let frames_dir = args.frames_dir.clone().or_else(|| {
        muxed
            .is_err()
            .then(|| PathBuf::from(format!("{}_frames", stem.display())))
    });
    let wav = args
        .wav
        .clone()
        .or_else(|| (muxed.is_err() && made.audio.is_some()).then(|| stem.with_extension("wav")));
    let mut kept = Vec::new();
    if let Some(dir) = &frames_dir {
        write_frames(dir, &made)?;
        kept.push(format!("{} frames in {}", made.frames.len(), dir.display()));
    }
    if let (Some(path), Some((rate, channels, samples))) = (&wav, &made.audio) {
        write_wav(path, *rate, *channels, samples)?;
        kept.push(format!("the audio in {}", path.display()));
    }
    let total = started.elapsed().as_secs_f64();
    let sampling: f64 = made.steps.iter().sum();
    // With --json the report is printed even when only the MP4 failed: the timings of a long run are not lost.
    let outcome = muxed.map_err(|why| VideoError::RawKept {
        why,
        kept: kept.join(", "),
    });
    match &outcome {
        Ok(report) => {
            let phases: Vec<String> = made
                .phases
                .iter()
                .map(|(name, s)| format!("{name} {s:.3} s"))
                .collect();
            eprintln!(
                "tf video: wrote {} ({}x{}, {} frames at {} fps, {:.3} s{}); {}, {} steps {:.3} s, mux {:.3} s, total {:.3} s",
                args.out.display(),
                made.width,
                made.height,
                report.frames,
                report.fps,
                report.seconds,
                report
                    .audio
                    .map_or(String::from(", no audio"), |(rate, ch)| format!(
                        ", AAC {ch} ch at {rate} Hz"
                    )),
                phases.join(", "),
                made.steps.len(),
                sampling,
                mux_seconds,
                total
            );
        }
        Err(_) => eprintln!(
            "tf video: made {} frames; {} steps {:.3} s, total {:.3} s (no MP4)",
            made.frames.len(),
            made.steps.len(),
            sampling,
            total
        ),
    }
    if args.json {
        let phase_map: serde_json::Map<String, serde_json::Value> = made
            .phases
            .iter()
            .map(|(name, s)| (format!("{name}_s"), json!(s)))
            .collect();
        // What the MP4 holds, else what was made (the raw frames and audio).
        let (frames, fps, seconds, audio, audio_trimmed) = match &outcome {
            Ok(report) => (
                report.frames,
                report.fps,
                report.seconds,
                report.audio,
                Some(report.audio_trimmed),
            ),
            Err(_) => (
                made.frames.len(),
                made.fps,
                made.frames.len() as f64 / f64::from(made.fps.max(1)),
                made.audio
                    .as_ref()
                    .map(|(rate, channels, _)| (*rate, *channels)),
                None,
            ),
        };
        let summary = json!({
            "ok": outcome.is_ok(),
            "error": outcome.as_ref().err().map(|e| e.to_string()),
            "file": outcome.is_ok().then(|| args.out.display().to_string()),
            "width": made.width,
            "height": made.height,
            "frames": frames,
            "fps": fps,
            "seconds": seconds,
            "audio": audio.map(|(rate, channels)| json!({"sample_rate": rate, "channels": channels})),
            "audio_trimmed_samples": audio_trimmed,
            "seed": args.seed,
            "frames_dir": frames_dir.as_ref().map(|p| p.display().to_string()),
            "wav": wav.as_ref().filter(|_| made.audio.is_some()).map(|p| p.display().to_string()),
            "load_s": made.load_seconds,
            "timings": {
                "phases": phase_map,
                "steps_s": made.steps,
                "mux_s": mux_seconds,
                "total_s": total,
            },
            "engine": made.extra,
        });
        println!("{summary}");
    }
    outcome.map(|_| ())
}

/// Writes every frame as `frame_<i>.png` into `dir` (created).
fn write_frames(dir: &Path, made: &Made) -> Result<(), VideoError> {
    std::fs::create_dir_all(dir).map_err(|e| {
        VideoError::Usage(format!(
            "cannot create the frames folder {}: {e}",
            dir.display()
        ))
    })?;
    let color = match made.layout {
        PixelLayout::Rgb => ColorType::Rgb,
        PixelLayout::Rgba => ColorType::Rgba,
    };
    for (i, frame) in made.frames.iter().enumerate() {
        let path = dir.join(tf_engines::worker::frame_file(i));
        let bytes = tf_engines::nn::media::png::encode_png(
            made.width as usize,
            made.height as usize,
            color,
            frame,
        )?;
        tf_engines::nn::media::write_atomically(&path, &bytes).map_err(|source| PngError::Io {
            what: "writing",
            path: path.clone(),
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("768x448"), Ok((768, 448)));
        assert!(parse_size("768").is_err());
    }
}
