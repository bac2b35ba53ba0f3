//! The worker protocol LocalRouter drives (`tf worker`): one JSON object per line on stdin, one per line on
//! stdout, logs on stderr. docs/WORKER.md is the full reference.
//!
//! ```text
//! -> {"op":"load"}                      <- {"ok":true,"resident":BYTES,"ms":T}
//! -> {"op":"generate","dir":D,"request":{"image":{"prompt":..,"width":..,"height":..,"steps":..,"seed":..}}}
//!                                       <- {"progress":{"phase":"denoise","step":1,"of":8,"steps":8}} ...
//!                                       <- {"ok":true,"files":["image_0.png"],"seed":S,"ms":T}
//!                                       or {"ok":false,"error":"...","type":"invalid_request_error"|"server_error"}
//! -> {"op":"generate","dir":D,"request":{"video":{"prompt":..,"seconds":..,"fps":..,"audio":true}}}
//!                                       <- progress lines, then {"ok":true,"files":["video.mp4"],"seed":S,"ms":T}
//! -> {"op":"exit"}                      <- {"ok":true,"device_bytes":0,"device_allocs":0}, then exit 0
//! ```
//!
//! Invariants: every input line gets exactly one final reply (a line with `ok`), preceded only by its own
//! progress lines; a malformed line is answered `invalid_request_error` and the worker keeps serving; an
//! engine failure is answered `server_error`; a lost device context or an engine panic is answered, then
//! [`Worker::serve`] returns an [`Ending`] whose exit code is non-zero, because the process must not serve
//! another job on a poisoned context. The engine is unloaded (every device buffer freed, the context
//! destroyed) before `exit` is answered and before `serve` returns.
//!
//! The protocol is engine-neutral: anything implementing [`WorkerEngine`] can be served.
//!
//! ```
//! use tf_engines::worker::{testpattern::TestPattern, Worker, WorkerLimits, Ending};
//!
//! let input = br#"{"op":"load"}
//! {"op":"exit"}
//! "#;
//! let mut output = Vec::new();
//! let mut worker = Worker::new(TestPattern::default(), WorkerLimits::default());
//! let ending = worker.serve(&input[..], &mut output)?;
//! assert_eq!(ending, Ending::Exit);
//! assert_eq!(ending.exit_code(), 0);
//! assert!(String::from_utf8_lossy(&output).starts_with(r#"{"ok":true,"#));
//! # Ok::<(), std::io::Error>(())
//! ```

/// Writes one log line to stderr and ignores every failure: a parent that closed (or stopped reading) the
/// pipe must never panic the worker, as `eprintln!` does on EPIPE.
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::worker::log_line(format_args!($($arg)*))
    };
}

/// Logs what a load's planning of the plan cache's stored GEMM shapes did (nothing when it did not run: a host
/// backend, a sequential memory plan).
pub(crate) fn log_stored_gemms(stored: Option<crate::nn::gpu::gemm::StoredGemms>) {
    if let Some(stored) = stored {
        log!("tf worker: stored GEMM shapes planned: {stored}");
    }
}

pub mod client;
pub mod minimax_h3;
pub mod qwen;
pub mod request;
pub mod testpattern;

use std::io::{self, BufRead, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

/// Writes `args` and a newline to stderr in one locked write, ignoring errors (a closed or broken pipe): logging
/// must never take the worker down. Used for every log line of the worker and of `tf worker`.
pub fn log_line(args: std::fmt::Arguments<'_>) {
    let mut line = args.to_string();
    line.push('\n');
    let mut err = io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
}

use request::{Command, GenerateCommand, OutputTarget, VideoCommand};

/// Bytes in a GiB, for log lines.
const GIB: f64 = (1u64 << 30) as f64;

/// The line that ends a job: its wall time and the device memory the process holds afterwards (weights and the
/// engines' kept workspaces), so that a long run shows whether memory stays put from request to request.
fn log_job_done(id: &impl std::fmt::Debug, ms: u64, energy: JobEnergy) {
    let held = tf_cuda::usage();
    let energy = energy
        .and_then(|mark| mark.spent().ok())
        .map_or(String::new(), |spent| {
            format!(
                "; board energy {:.1} J ({:.0} W mean)",
                spent.joules,
                spent.mean_watts()
            )
        });
    log!(
        "tf worker: job {id:?} done in {ms} ms{energy}; device memory held: {:.2} GiB in {} allocations",
        held.device as f64 / GIB,
        held.device_allocs
    );
}

/// The meter of the board under `ctx` for [`WorkerEngine::power_meter`] (none for a host engine), from NVML opened
/// beside the load (`Backend::open_power_library`); logs why when NVML cannot be used, once a load.
pub(crate) fn open_power_meter(
    opening: Option<tf_cuda::power::OpeningLibrary>,
    ctx: Option<&tf_cuda::Context>,
) -> Option<std::sync::Arc<tf_cuda::power::PowerMeter>> {
    let ctx = ctx?;
    let opened = match opening {
        Some(opening) => opening.wait(),
        None => tf_cuda::power::PowerLibrary::open(),
    };
    match opened.and_then(|library| library.meter_for(ctx)) {
        Ok(meter) => Some(meter),
        Err(e) => {
            log!("tf worker: the board's energy per job is not logged: {e}");
            None
        }
    }
}

/// The board's energy counter at a job's start ([`WorkerEngine::power_meter`]): what the whole board spent while the
/// job ran, other work on it included. `None` without a meter or when the counter cannot be read.
type JobEnergy = Option<tf_cuda::power::EnergyMark>;

fn job_energy(meter: Option<std::sync::Arc<tf_cuda::power::PowerMeter>>) -> JobEnergy {
    meter?.mark().ok()
}

/// Logs the costly driver work (allocations, frees, graph captures and instantiations) done between a job's
/// progress notes, so a slow first step shows what it spent outside the kernels; quiet when there was none.
/// With it, the engine's host work ([`crate::nn::host_work`]) when a workspace was built or a step run eagerly, and
/// any launch that waited ([`tf_cuda::usage::SLOW_CALL`] or longer: kernels, graphs, cuBLASLt matmuls) by name.
struct DriverWorkTrail {
    last: tf_cuda::DriverCosts,
    last_host: crate::nn::host_work::HostWork,
}

impl DriverWorkTrail {
    fn start() -> Self {
        // Slow enqueues of earlier work (the load, a previous job) are not this job's.
        drop(tf_cuda::usage::take_slow_calls());
        DriverWorkTrail {
            last: tf_cuda::driver_costs(),
            last_host: crate::nn::host_work::read(),
        }
    }

    fn note(&mut self, p: &Progress) {
        let now = tf_cuda::driver_costs();
        let done = now.since(&self.last);
        self.last = now;
        let calls = done.device_allocs.calls
            + done.device_frees.calls
            + done.graph_captures.calls
            + done.graph_instantiations.calls;
        if calls > 0 {
            log!(
                "tf worker: driver work up to {} {}/{}: {done}",
                p.phase,
                p.step,
                p.of
            );
        }
        let host_now = crate::nn::host_work::read();
        let host = host_now.since(&self.last_host);
        self.last_host = host_now;
        if host.is_setup() {
            log!(
                "tf worker: host work up to {} {}/{}: {host}",
                p.phase,
                p.step,
                p.of
            );
        }
        let slow = tf_cuda::usage::take_slow_calls();
        if !slow.is_empty() {
            let list: Vec<String> = slow
                .iter()
                .map(|(ms, what)| format!("{what} {ms:.1} ms"))
                .collect();
            log!(
                "tf worker: slow enqueues up to {} {}/{}: {}",
                p.phase,
                p.step,
                p.of,
                list.join("; ")
            );
        }
    }
}

/// One image to make, validated against [`WorkerLimits`] (the engine may refuse more).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageJob {
    /// The prompt (may be empty; the engine decides what that means).
    pub prompt: String,
    /// A negative prompt, when one was given (non-empty).
    pub negative_prompt: Option<String>,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Sampling steps; `None` = the engine's default.
    pub steps: Option<u32>,
    /// The noise seed of this image.
    pub seed: u64,
    /// Guidance (true CFG) scale; `None` = the engine's default.
    pub guidance: Option<f32>,
}

/// One video (optionally with audio) to make, validated against [`WorkerLimits`] (the engine may refuse more).
#[derive(Debug, Clone, PartialEq)]
pub struct VideoJob {
    /// The prompt.
    pub prompt: String,
    /// A negative prompt, when one was given (non-empty).
    pub negative_prompt: Option<String>,
    /// Frame width and height in pixels.
    pub width: u32,
    pub height: u32,
    /// Length in seconds.
    pub seconds: f32,
    /// Frames per second.
    pub fps: u32,
    /// The noise seed.
    pub seed: u64,
    /// Sampling steps; `None` = the engine's default.
    pub steps: Option<u32>,
    /// Guidance scale; `None` = the engine's default.
    pub guidance: Option<f32>,
    /// Whether to make an audio track.
    pub audio: bool,
    /// An image file to start from (image-to-video), when given.
    pub first_frame: Option<PathBuf>,
}

impl VideoJob {
    /// Frames the video holds: `round(seconds * fps)`, at least 1.
    pub fn frames(&self) -> u32 {
        let n = (f64::from(self.seconds) * f64::from(self.fps)).round();
        if n < 1.0 {
            1
        } else if n > f64::from(u32::MAX) {
            u32::MAX
        } else {
            n as u32
        }
    }
}

/// An audio track: interleaved f32 samples in [-1, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct Audio {
    pub sample_rate: u32,
    pub channels: u16,
    /// `frames * channels` samples, interleaved.
    pub samples: Vec<f32>,
}

/// What an engine made: images, or a video with an optional audio track.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineOutput {
    Images(Vec<RgbaImage>),
    Video {
        frames: Vec<RgbaImage>,
        fps: u32,
        audio: Option<Audio>,
    },
}

/// A progress note from a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// What the engine is doing: "encode", "denoise", "decode"...
    pub phase: &'static str,
    /// Steps done in this phase.
    pub step: u32,
    /// Steps in this phase (0 = unknown).
    pub of: u32,
}

impl Progress {
    /// The prompt encoded (the protocol's `encode` 1/1).
    pub fn encoded() -> Progress {
        Progress {
            phase: "encode",
            step: 1,
            of: 1,
        }
    }

    /// Denoising step `step` of `steps` done (counts past `u32::MAX` saturate).
    pub fn denoised(step: usize, steps: usize) -> Progress {
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Progress {
            phase: "denoise",
            step: clamp(step),
            of: clamp(steps),
        }
    }

    /// Decode `step` of `of` done (`step` held to `of`).
    pub fn decoded(step: u32, of: u32) -> Progress {
        Progress {
            phase: "decode",
            step: step.min(of),
            of,
        }
    }
}

/// An 8-bit RGBA image, rows top to bottom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbaImage {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

impl RgbaImage {
    /// Wraps `pixels` (`width * height * 4` bytes, RGBA, row-major).
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Result<RgbaImage, EngineError> {
        let expected = (width as u64)
            .checked_mul(height as u64)
            .and_then(|n| n.checked_mul(4));
        if width == 0 || height == 0 || expected != Some(pixels.len() as u64) {
            return Err(EngineError::Failed(format!(
                "the engine produced {} bytes for a {width}x{height} RGBA image (expected width*height*4)",
                pixels.len()
            )));
        }
        Ok(RgbaImage {
            width,
            height,
            pixels,
        })
    }

    /// Width in pixels.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Height in pixels.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// RGBA bytes, row-major.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }
}

/// How an engine call failed; decides the reply's `type` and whether the worker may go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served by this model (size, steps, prompt...): `invalid_request_error`. Returned by
    /// `load`, it means the engine refuses its configuration (backend, precision, ...): that load is answered
    /// `server_error` ([`load_failure`]), since no client sent it.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The job failed; the engine can take another: `server_error`.
    #[error("{0}")]
    Failed(String),
    /// The device context is poisoned (a sticky fault): `server_error`, then the worker exits non-zero so a
    /// fresh process (with a fresh context) serves the next job.
    #[error("the GPU context is lost: {0}; this worker exits so that a fresh process serves the next job")]
    DeviceLost(String),
}

/// An engine the worker can serve: a model that loads once and makes images until unloaded.
pub trait WorkerEngine {
    /// Loads weights and kernels; returns the resident bytes now held. Called only while unloaded. Every error is
    /// answered `server_error` ([`load_failure`]); a lost device context also ends serving.
    fn load(&mut self) -> Result<u64, EngineError>;

    /// Makes one image. Called only while loaded. Reports progress through `progress`. The worker checked the
    /// size only against [`WorkerLimits`]' bounds: the engine applies its own size rule (the multiple its latent
    /// grid needs) and refuses other sizes with [`EngineError::InvalidRequest`] naming the rule, before any work.
    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError>;

    /// Releases everything `load` took (device buffers, modules, streams, then the context and the driver).
    /// Must be safe to call when not loaded.
    fn unload(&mut self);

    /// Whether this engine makes videos; when false, the worker refuses `request.video` with an
    /// `invalid_request_error` before calling the engine.
    fn makes_video(&self) -> bool {
        false
    }

    /// The meter of the board the engine runs on, while loaded (none on the host, or where NVML is missing): the
    /// worker logs the board's energy over each job with it.
    fn power_meter(&self) -> Option<std::sync::Arc<tf_cuda::power::PowerMeter>> {
        None
    }

    /// Makes one video ([`EngineOutput::Video`]). Called only while loaded and only when [`Self::makes_video`].
    /// As for images, the size rule beyond [`WorkerLimits`]' bounds is the engine's to check.
    fn generate_video(
        &mut self,
        job: &VideoJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<EngineOutput, EngineError> {
        let _ = (job, progress);
        Err(EngineError::InvalidRequest(
            "this engine makes images; `request.video` is not supported by it".into(),
        ))
    }
}

impl<E: WorkerEngine + ?Sized> WorkerEngine for Box<E> {
    fn load(&mut self) -> Result<u64, EngineError> {
        (**self).load()
    }

    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        (**self).generate(job, progress)
    }

    fn unload(&mut self) {
        (**self).unload()
    }

    fn makes_video(&self) -> bool {
        (**self).makes_video()
    }

    fn power_meter(&self) -> Option<std::sync::Arc<tf_cuda::power::PowerMeter>> {
        (**self).power_meter()
    }

    fn generate_video(
        &mut self,
        job: &VideoJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<EngineOutput, EngineError> {
        (**self).generate_video(job, progress)
    }
}

/// Protocol-level limits, checked before the engine sees a request. They are generic bounds, so that nothing is
/// allocated from an unchecked value; the size rule of a model (Qwen-Image's multiples of 32, MiniMax H3's canvas
/// multiples, which its folder sets) is its engine's, checked by the engine before it runs anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLimits {
    /// Smallest side in pixels (1: a side of 0 makes no image; the engines' rules set their own smallest).
    pub min_side: u32,
    /// Largest side in pixels (`tf worker --max-side`).
    pub max_side: u32,
    /// Side used when `width`/`height` are absent.
    pub default_side: u32,
    /// Most sampling steps.
    pub max_steps: u32,
    /// Most images per request (`n`).
    pub max_images: u32,
    /// Longest prompt in bytes.
    pub max_prompt_bytes: usize,
    /// Longest input line in bytes.
    pub max_line_bytes: usize,
}

impl Default for WorkerLimits {
    fn default() -> Self {
        WorkerLimits {
            min_side: 1,
            max_side: 2048,
            default_side: 1024,
            max_steps: 200,
            max_images: 4,
            max_prompt_bytes: 16 * 1024,
            max_line_bytes: 1 << 20,
        }
    }
}

/// Why [`Worker::serve`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// `{"op":"exit"}` was answered.
    Exit,
    /// Standard input ended.
    EndOfInput,
    /// A job hit a sticky device fault; it was answered and the engine dropped.
    DeviceLost(String),
    /// The engine panicked; the job was answered `server_error`.
    EnginePanicked(String),
}

impl Ending {
    /// The process exit code: 0 for a requested exit or end of input, 3 after a lost device, 4 after a
    /// panic (1 is left for I/O failures on the pipes, 2 for bad command-line arguments).
    pub fn exit_code(&self) -> u8 {
        match self {
            Ending::Exit | Ending::EndOfInput => 0,
            Ending::DeviceLost(_) => 3,
            Ending::EnginePanicked(_) => 4,
        }
    }
}

/// What to do after one line.
enum Flow {
    Continue,
    Stop(Ending),
}

/// Serves one engine over the protocol.
pub struct Worker<E: WorkerEngine> {
    engine: E,
    limits: WorkerLimits,
    resident: Option<u64>,
    /// Whether video jobs write their files (false on the ranks other than 0 of a multi-GPU worker).
    writes_files: bool,
}

impl<E: WorkerEngine> Worker<E> {
    /// A worker for `engine`, not loaded yet.
    pub fn new(engine: E, limits: WorkerLimits) -> Worker<E> {
        Worker {
            engine,
            limits,
            resident: None,
            writes_files: true,
        }
    }

    /// A worker whose video jobs write no file (their reply lists none): a rank other than 0 of a multi-GPU worker,
    /// which runs every job with rank 0 while rank 0 holds the frames and writes them.
    pub fn without_files(mut self) -> Worker<E> {
        self.writes_files = false;
        self
    }

    /// Whether the engine is loaded.
    pub fn is_loaded(&self) -> bool {
        self.resident.is_some()
    }

    /// Reads commands from `input` until `exit`, end of input, or a fatal job; writes replies to `output`
    /// (flushed after every line). The engine is unloaded before this returns. `Err` only when reading
    /// `input` or writing `output` fails (the parent is gone).
    pub fn serve(&mut self, mut input: impl BufRead, mut output: impl Write) -> io::Result<Ending> {
        let mut line = Vec::new();
        let ending = loop {
            let flow = match read_line_capped(&mut input, &mut line, self.limits.max_line_bytes) {
                Ok(LineRead::EndOfInput) => Flow::Stop(Ending::EndOfInput),
                Ok(LineRead::TooLong) => {
                    let message = format!(
                        "the line is longer than {} bytes and was skipped",
                        self.limits.max_line_bytes
                    );
                    self.reply_error(&mut output, &message, ErrorType::InvalidRequest)
                        .map(|()| Flow::Continue)
                        .inspect_err(|_| self.unload())?
                }
                Ok(LineRead::Line) => self
                    .handle_line(&line, &mut output)
                    .inspect_err(|_| self.unload())?,
                Err(e) => {
                    self.unload();
                    return Err(e);
                }
            };
            if let Flow::Stop(ending) = flow {
                break ending;
            }
        };
        self.unload();
        Ok(ending)
    }

    fn handle_line(&mut self, raw: &[u8], output: &mut dyn Write) -> io::Result<Flow> {
        let text = match std::str::from_utf8(raw) {
            Ok(t) => t.trim(),
            Err(e) => {
                let message = format!("the line is not UTF-8 ({e}); send JSON text");
                self.reply_error(output, &message, ErrorType::InvalidRequest)?;
                return Ok(Flow::Continue);
            }
        };
        if text.is_empty() {
            return Ok(Flow::Continue); // blank lines are keep-alives, not commands
        }
        let command = match request::parse_command(text, &self.limits) {
            Ok(c) => c,
            Err(e) => {
                log!("tf worker: refused a line: {e}");
                self.reply_error(output, &e.0, ErrorType::InvalidRequest)?;
                return Ok(Flow::Continue);
            }
        };
        match command {
            Command::Load => self.load(output),
            Command::Generate(g) => self.generate(&g, output),
            Command::GenerateVideo(v) => self.generate_video(&v, output),
            Command::Exit => {
                self.unload();
                let usage = tf_cuda::usage();
                write_line(
                    output,
                    &Reply {
                        device_bytes: Some(usage.device),
                        device_allocs: Some(usage.device_allocs),
                        ..Reply::ok()
                    },
                )?;
                Ok(Flow::Stop(Ending::Exit))
            }
        }
    }

    fn load(&mut self, output: &mut dyn Write) -> io::Result<Flow> {
        if let Some(resident) = self.resident {
            write_line(
                output,
                &Reply {
                    resident: Some(resident),
                    ms: Some(0),
                    ..Reply::ok()
                },
            )?;
            return Ok(Flow::Continue);
        }
        let started = Instant::now();
        let engine = &mut self.engine;
        match catch_unwind(AssertUnwindSafe(|| engine.load())) {
            Ok(Ok(resident)) => {
                let ms = millis(started);
                log!("tf worker: loaded in {ms} ms, {resident} bytes resident");
                if self.engine.makes_video() {
                    // Videos are muxed by ffmpeg; say now, not after the first job, when it is missing.
                    match crate::nn::media::mp4::find_ffmpeg() {
                        Ok(path) => log!("tf worker: videos are muxed by {}", path.display()),
                        Err(e) => log!("tf worker: warning: {e}; until then video jobs fail after writing their raw frames and audio"),
                    }
                }
                self.resident = Some(resident);
                write_line(
                    output,
                    &Reply {
                        resident: Some(resident),
                        ms: Some(ms),
                        ..Reply::ok()
                    },
                )?;
                Ok(Flow::Continue)
            }
            Ok(Err(e)) => {
                let message = load_failure(&e);
                log!("tf worker: {message}");
                self.unload_engine();
                // Always `server_error`: see [`load_failure`].
                self.reply_error(output, &message, ErrorType::Server)?;
                Ok(match e {
                    EngineError::DeviceLost(m) => Flow::Stop(Ending::DeviceLost(m)),
                    _ => Flow::Continue,
                })
            }
            Err(payload) => self.panicked("load", payload, output),
        }
    }

    fn generate(&mut self, command: &GenerateCommand, output: &mut dyn Write) -> io::Result<Flow> {
        if self.resident.is_none() {
            self.reply_error(
                output,
                "generate before load: send {\"op\":\"load\"} first",
                ErrorType::InvalidRequest,
            )?;
            return Ok(Flow::Continue);
        }
        let started = Instant::now();
        let energy = job_energy(self.engine.power_meter());
        let paths = match prepare_target(&command.target, command.count) {
            Ok(p) => p,
            Err(message) => {
                self.reply_error(output, &message, ErrorType::InvalidRequest)?;
                return Ok(Flow::Continue);
            }
        };
        log!(
            "tf worker: job {:?}: {}x{}, {} image(s), seed {}",
            command.id,
            command.job.width,
            command.job.height,
            command.count,
            command.job.seed
        );
        let mut files = Vec::with_capacity(paths.len());
        // A write error on a progress line (the reader is gone) ends serving once the engine returns.
        let mut progress_failed: Option<io::Error> = None;
        for (index, (path, listed)) in paths.into_iter().enumerate() {
            let index = index as u32; // at most max_images
            let mut job = command.job.clone();
            job.seed = command.job.seed.wrapping_add(u64::from(index));
            let count = command.count;
            let engine = &mut self.engine;
            let mut trail = DriverWorkTrail::start();
            let result = catch_unwind(AssertUnwindSafe(|| {
                engine.generate(&job, &mut |p: Progress| {
                    trail.note(&p);
                    let (step, of) = if count > 1 {
                        (
                            p.step.saturating_add(index.saturating_mul(p.of)),
                            p.of.saturating_mul(count),
                        )
                    } else {
                        (p.step, p.of)
                    };
                    write_progress(output, &mut progress_failed, p.phase, step, of);
                })
            }));
            if let Some(e) = progress_failed.take() {
                self.unload();
                return Err(e);
            }
            let image = match result {
                Ok(Ok(image)) => image,
                Ok(Err(e)) => return self.job_failed(e, output),
                Err(payload) => return self.panicked("generate", payload, output),
            };
            if (image.width(), image.height()) != (job.width, job.height) {
                let message = format!(
                    "the engine made a {}x{} image for a {}x{} request",
                    image.width(),
                    image.height(),
                    job.width,
                    job.height
                );
                return self.job_failed(EngineError::Failed(message), output);
            }
            match write_png_atomically(&path, &image) {
                Ok(written) => log!(
                    "tf worker: wrote {listed} ({} B): PNG encode {:.1} ms, file write {:.1} ms",
                    written.bytes,
                    written.encode_s * 1e3,
                    written.write_s * 1e3
                ),
                Err(e) => {
                    let message = format!("could not write {}: {e}", path.display());
                    self.reply_error(output, &message, ErrorType::Server)?;
                    return Ok(Flow::Continue);
                }
            }
            files.push(listed);
        }
        let ms = millis(started);
        log_job_done(&command.id, ms, energy);
        write_line(
            output,
            &Reply {
                files: Some(&files),
                seed: Some(command.job.seed),
                ms: Some(ms),
                ..Reply::ok()
            },
        )?;
        Ok(Flow::Continue)
    }

    fn generate_video(
        &mut self,
        command: &VideoCommand,
        output: &mut dyn Write,
    ) -> io::Result<Flow> {
        if !self.engine.makes_video() {
            self.reply_error(
                output,
                "this engine makes images; `request.video` is not supported by it (send `request.image`)",
                ErrorType::InvalidRequest,
            )?;
            return Ok(Flow::Continue);
        }
        if self.resident.is_none() {
            self.reply_error(
                output,
                "generate before load: send {\"op\":\"load\"} first",
                ErrorType::InvalidRequest,
            )?;
            return Ok(Flow::Continue);
        }
        if let Err(e) = std::fs::create_dir_all(&command.dir) {
            let message = format!(
                "cannot create the output folder {}: {e}",
                command.dir.display()
            );
            self.reply_error(output, &message, ErrorType::InvalidRequest)?;
            return Ok(Flow::Continue);
        }
        let started = Instant::now();
        let energy = job_energy(self.engine.power_meter());
        log!(
            "tf worker: video job {:?}: {}x{}, {} s at {} fps, seed {}",
            command.id,
            command.job.width,
            command.job.height,
            command.job.seconds,
            command.job.fps,
            command.job.seed
        );
        let mut progress_failed: Option<io::Error> = None;
        let engine = &mut self.engine;
        let mut trail = DriverWorkTrail::start();
        let result = catch_unwind(AssertUnwindSafe(|| {
            engine.generate_video(&command.job, &mut |p: Progress| {
                trail.note(&p);
                write_progress(output, &mut progress_failed, p.phase, p.step, p.of);
            })
        }));
        if let Some(e) = progress_failed.take() {
            self.unload();
            return Err(e);
        }
        let made = match result {
            Ok(Ok(made)) => made,
            Ok(Err(e)) => return self.job_failed(e, output),
            Err(payload) => return self.panicked("generate", payload, output),
        };
        let written = if self.writes_files {
            write_video(&command.dir, &made)
        } else {
            Ok(Vec::new())
        };
        let files = match written {
            Ok(files) => files,
            Err(message) => {
                self.reply_error(output, &message, ErrorType::Server)?;
                return Ok(Flow::Continue);
            }
        };
        let ms = millis(started);
        log_job_done(&command.id, ms, energy);
        write_line(
            output,
            &Reply {
                files: Some(&files),
                seed: Some(command.job.seed),
                ms: Some(ms),
                ..Reply::ok()
            },
        )?;
        Ok(Flow::Continue)
    }

    fn job_failed(&mut self, error: EngineError, output: &mut dyn Write) -> io::Result<Flow> {
        log!("tf worker: job failed: {error}");
        match error {
            EngineError::InvalidRequest(m) => {
                self.reply_error(output, &m, ErrorType::InvalidRequest)?;
                Ok(Flow::Continue)
            }
            EngineError::Failed(m) => {
                self.reply_error(output, &format!("generate failed: {m}"), ErrorType::Server)?;
                Ok(Flow::Continue)
            }
            EngineError::DeviceLost(m) => {
                let e = EngineError::DeviceLost(m.clone());
                self.reply_error(output, &format!("generate failed: {e}"), ErrorType::Server)?;
                self.unload();
                Ok(Flow::Stop(Ending::DeviceLost(m)))
            }
        }
    }

    fn panicked(
        &mut self,
        what: &str,
        payload: Box<dyn std::any::Any + Send>,
        output: &mut dyn Write,
    ) -> io::Result<Flow> {
        let why = panic_text(payload.as_ref());
        log!("tf worker: the engine panicked during {what}: {why}");
        let message = format!(
            "{what} failed: internal error in the engine ({why}); this worker exits, a fresh one can serve the next job"
        );
        self.reply_error(output, &message, ErrorType::Server)?;
        self.unload();
        Ok(Flow::Stop(Ending::EnginePanicked(why)))
    }

    fn reply_error(
        &self,
        output: &mut dyn Write,
        message: &str,
        kind: ErrorType,
    ) -> io::Result<()> {
        write_line(
            output,
            &Reply {
                ok: Some(false),
                error: Some(message),
                kind: Some(kind.as_str()),
                ..Reply::default()
            },
        )
    }

    /// Unloads if loaded. Engine panics here are caught: unloading must not take the process down.
    fn unload(&mut self) {
        if self.resident.take().is_some() {
            self.unload_engine();
        }
    }

    fn unload_engine(&mut self) {
        let engine = &mut self.engine;
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| engine.unload())) {
            log!(
                "tf worker: the engine panicked while unloading: {}",
                panic_text(payload.as_ref())
            );
        }
    }
}

impl<E: WorkerEngine> Drop for Worker<E> {
    fn drop(&mut self) {
        self.unload();
    }
}

#[derive(Debug, Clone, Copy)]
enum ErrorType {
    InvalidRequest,
    Server,
}

impl ErrorType {
    fn as_str(self) -> &'static str {
        match self {
            ErrorType::InvalidRequest => "invalid_request_error",
            ErrorType::Server => "server_error",
        }
    }
}

/// The message of a failed `load`, answered `server_error` whatever the engine called the failure: a load is the
/// operator's configuration (the worker's command line, its model folder), never a client's request, so a router
/// must not turn it into a client error (HTTP 400). An engine that refuses its configuration
/// ([`EngineError::InvalidRequest`] from `load`, e.g. an FP8 DiT on the host) is named as such, with the fix.
pub fn load_failure(error: &EngineError) -> String {
    match error {
        EngineError::InvalidRequest(why) => format!(
            "load failed: the worker's configuration is refused: {why}. Change the worker's command line \
             (--backend, --precision, ...) or its model folder and start it again"
        ),
        other => format!("load failed: {other}"),
    }
}

/// The file paths to write and the names to list in the reply; creates the folder.
fn prepare_target(target: &OutputTarget, count: u32) -> Result<Vec<(PathBuf, String)>, String> {
    match target {
        OutputTarget::Folder(dir) => {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create the output folder {}: {e}", dir.display()))?;
            Ok((0..count)
                .map(|i| {
                    let name = format!("image_{i}.png");
                    (dir.join(&name), name)
                })
                .collect())
        }
        OutputTarget::File(file) => {
            if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("cannot create the folder of {}: {e}", file.display()))?;
            }
            if file.is_dir() {
                return Err(format!(
                    "`output` {} is a folder; give a file path, or the folder in `dir`",
                    file.display()
                ));
            }
            Ok(vec![(file.clone(), file.to_string_lossy().into_owned())])
        }
    }
}

/// The MP4 a video job writes into its folder.
pub const VIDEO_FILE: &str = "video.mp4";
/// The audio track kept beside the raw frames when the MP4 cannot be made.
pub const AUDIO_FILE: &str = "audio.wav";

/// The name of raw frame `i` (`frame_00000.png`, ...).
pub fn frame_file(i: usize) -> String {
    format!("frame_{i:05}.png")
}

/// Writes a video into `dir` as [`VIDEO_FILE`] (H.264 + AAC through `ffmpeg`, see [`crate::nn::media::mp4`]) and
/// returns the file names. When the MP4 cannot be made (no `ffmpeg`, or it fails), the raw frames
/// ([`frame_file`]) and the audio ([`AUDIO_FILE`], 32-bit float WAV) are written instead and the error says so;
/// every file goes through a temporary name, so nothing half-written is left.
pub fn write_video(dir: &std::path::Path, made: &EngineOutput) -> Result<Vec<String>, String> {
    use crate::nn::media::mp4::{find_ffmpeg, write_mp4, AudioInput, PixelLayout, VideoInput};
    let EngineOutput::Video { frames, fps, audio } = made else {
        return Err("the engine returned images for a video request".into());
    };
    let first = frames
        .first()
        .ok_or("the engine returned a video without frames")?;
    let (width, height) = (first.width(), first.height());
    if let Some((i, f)) = frames
        .iter()
        .enumerate()
        .find(|(_, f)| (f.width(), f.height()) != (width, height))
    {
        return Err(format!(
            "the engine made frame {i} at {}x{} and frame 0 at {width}x{height}",
            f.width(),
            f.height()
        ));
    }
    let pixels: Vec<&[u8]> = frames.iter().map(RgbaImage::pixels).collect();
    let video = VideoInput {
        width,
        height,
        fps: *fps,
        layout: PixelLayout::Rgba,
        frames: &pixels,
    };
    let track = audio.as_ref().map(|a| AudioInput {
        sample_rate: a.sample_rate,
        channels: a.channels,
        samples: &a.samples,
    });
    let muxed = find_ffmpeg()
        .and_then(|ffmpeg| write_mp4(&ffmpeg, &dir.join(VIDEO_FILE), &video, track.as_ref()));
    match muxed {
        Ok(_) => Ok(vec![VIDEO_FILE.to_string()]),
        Err(e) => Err(match write_raw_video(dir, frames, audio.as_ref()) {
            Ok(files) => format!(
                "could not write {VIDEO_FILE}: {e}. The raw output was written instead: {} files in {} ({} ... {})",
                files.len(),
                dir.display(),
                files.first().map_or("", String::as_str),
                files.last().map_or("", String::as_str)
            ),
            Err(raw) => format!("could not write {VIDEO_FILE}: {e}; writing the raw frames failed too: {raw}"),
        }),
    }
}

/// Writes the frames as [`frame_file`] PNGs and the audio as [`AUDIO_FILE`]; returns the file names.
pub fn write_raw_video(
    dir: &std::path::Path,
    frames: &[RgbaImage],
    audio: Option<&Audio>,
) -> Result<Vec<String>, String> {
    let mut files = Vec::with_capacity(frames.len() + 1);
    for (i, frame) in frames.iter().enumerate() {
        let name = frame_file(i);
        write_png_atomically(&dir.join(&name), frame)
            .map_err(|e| format!("could not write {}: {e}", dir.join(&name).display()))?;
        files.push(name);
    }
    if let Some(audio) = audio {
        let path = dir.join(AUDIO_FILE);
        crate::nn::media::wav::write_wav(&path, audio.sample_rate, audio.channels, &audio.samples)
            .map_err(|e| format!("could not write {}: {e}", path.display()))?;
        files.push(AUDIO_FILE.to_string());
    }
    Ok(files)
}

/// What writing one PNG took: its size, the encoding and the file write.
#[derive(Clone, Copy, Debug)]
struct PngWritten {
    bytes: usize,
    encode_s: f64,
    write_s: f64,
}

/// Writes `image` as a PNG through a temporary file renamed into place, so a reader never sees half a file.
fn write_png_atomically(path: &std::path::Path, image: &RgbaImage) -> Result<PngWritten, String> {
    let started = Instant::now();
    let bytes = crate::nn::media::png::encode_png(
        image.width() as usize,
        image.height() as usize,
        crate::nn::media::png::ColorType::Rgba,
        image.pixels(),
    )
    .map_err(|e| e.to_string())?;
    let encoded = Instant::now();
    crate::nn::media::write_atomically(path, &bytes).map_err(|e| e.to_string())?;
    Ok(PngWritten {
        bytes: bytes.len(),
        encode_s: encoded.duration_since(started).as_secs_f64(),
        write_s: encoded.elapsed().as_secs_f64(),
    })
}

/// One output line; absent fields are left out, present ones keep this order (`ok` first).
#[derive(Serialize, Default)]
struct Reply<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    ok: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: Option<ProgressNote>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resident: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    files: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_allocs: Option<u64>,
}

impl Reply<'_> {
    fn ok() -> Self {
        Reply {
            ok: Some(true),
            ..Reply::default()
        }
    }
}

/// `of` is LocalRouter's name for the step count, `steps` the same number under a self-explaining name.
#[derive(Serialize)]
struct ProgressNote {
    phase: &'static str,
    step: u32,
    of: u32,
    steps: u32,
}

/// Writes one progress line (`step` of `of` in `phase`) unless an earlier one failed; a write error is kept in
/// `failed` (the reader is gone: serving ends once the engine returns).
fn write_progress(
    output: &mut dyn Write,
    failed: &mut Option<io::Error>,
    phase: &'static str,
    step: u32,
    of: u32,
) {
    if failed.is_some() {
        return;
    }
    let line = Reply {
        progress: Some(ProgressNote {
            phase,
            step,
            of,
            steps: of,
        }),
        ..Reply::default()
    };
    if let Err(e) = write_line(output, &line) {
        *failed = Some(e);
    }
}

fn write_line(output: &mut dyn Write, reply: &Reply<'_>) -> io::Result<()> {
    let mut text = serde_json::to_string(reply).map_err(io::Error::other)?;
    text.push('\n');
    output.write_all(text.as_bytes())?;
    output.flush()
}

fn millis(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

enum LineRead {
    Line,
    TooLong,
    EndOfInput,
}

/// Reads one line into `line` (without the newline). A line over `max` bytes is consumed and skipped.
/// A last line without a newline still counts.
fn read_line_capped(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    line.clear();
    let mut too_long = false;
    let mut saw_any = false;
    loop {
        let chunk = match input.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            return Ok(match (saw_any, too_long) {
                (false, _) => LineRead::EndOfInput,
                (true, true) => LineRead::TooLong,
                (true, false) => LineRead::Line,
            });
        }
        saw_any = true;
        let (part, used, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(at) => (&chunk[..at], at + 1, true),
            None => (chunk, chunk.len(), false),
        };
        if !too_long {
            if line.len() + part.len() > max {
                too_long = true;
                line.clear();
            } else {
                line.extend_from_slice(part);
            }
        }
        input.consume(used);
        if done {
            return Ok(if too_long {
                LineRead::TooLong
            } else {
                LineRead::Line
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_without_a_meter_measures_no_energy() {
        assert!(job_energy(None).is_none());
        assert!(open_power_meter(None, None).is_none());
    }

    #[test]
    fn progress_notes_name_the_protocol_phases_and_saturate() {
        assert_eq!(
            Progress::encoded(),
            Progress {
                phase: "encode",
                step: 1,
                of: 1
            }
        );
        let d = Progress::denoised(3, 8);
        assert_eq!((d.phase, d.step, d.of), ("denoise", 3, 8));
        let huge = Progress::denoised(usize::MAX, usize::MAX);
        assert_eq!((huge.step, huge.of), (u32::MAX, u32::MAX));
        let v = Progress::decoded(3, 2);
        assert_eq!(
            (v.phase, v.step, v.of),
            ("decode", 2, 2),
            "a step past its phase is held to it"
        );
    }

    #[test]
    fn capped_reader_splits_lines_and_skips_long_ones() {
        let data = b"short\nthis line is too long\nok\nlast";
        let mut input = &data[..];
        let mut line = Vec::new();
        let mut seen = Vec::new();
        loop {
            match read_line_capped(&mut input, &mut line, 8).unwrap() {
                LineRead::Line => seen.push(String::from_utf8(line.clone()).unwrap()),
                LineRead::TooLong => seen.push("<long>".to_string()),
                LineRead::EndOfInput => break,
            }
        }
        assert_eq!(seen, ["short", "<long>", "ok", "last"]);
    }

    #[test]
    fn rgba_image_checks_its_length() {
        assert!(RgbaImage::new(2, 2, vec![0; 16]).is_ok());
        assert!(RgbaImage::new(2, 2, vec![0; 15]).is_err());
        assert!(RgbaImage::new(0, 2, vec![]).is_err());
    }

    #[test]
    fn exit_codes_are_distinct() {
        let codes = [
            Ending::Exit.exit_code(),
            Ending::DeviceLost(String::new()).exit_code(),
            Ending::EnginePanicked(String::new()).exit_code(),
        ];
        assert_eq!(codes, [0, 3, 4]);
        assert_eq!(Ending::EndOfInput.exit_code(), 0);
    }

    proptest::proptest! {
        #[test]
        fn capped_reader_never_loses_short_lines(
            lines in proptest::collection::vec("[a-z ]{0,12}", 0..20),
            chunk in 1usize..7,
        ) {
            let text = lines.iter().map(|l| format!("{l}\n")).collect::<String>();
            let mut input = io::BufReader::with_capacity(chunk, text.as_bytes());
            let mut line = Vec::new();
            let mut seen = Vec::new();
            loop {
                match read_line_capped(&mut input, &mut line, 8).unwrap() {
                    LineRead::Line => seen.push(String::from_utf8(line.clone()).unwrap()),
                    LineRead::TooLong => seen.push("<long>".to_string()),
                    LineRead::EndOfInput => break,
                }
            }
            let expected: Vec<String> = lines
                .iter()
                .map(|l| if l.len() > 8 { "<long>".to_string() } else { l.clone() })
                .collect();
            proptest::prop_assert_eq!(seen, expected);
        }
    }
}
