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
use tf_engines::nn::media::mp4::{
    find_ffmpeg, write_mp4, AudioInput, Mp4Error, Mp4Report, PixelLayout, VideoInput,
};
use tf_engines::nn::media::png::{ColorType, PngError};
use tf_engines::nn::media::wav::{write_wav, WavError};
use tf_engines::worker::testpattern::TestPattern;
use tf_engines::worker::{EngineOutput, VideoJob, WorkerEngine};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineArg {
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
    #[arg(long, value_enum)]
    engine: EngineArg,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Frame size WIDTHxHEIGHT in pixels.
    #[arg(long, default_value = "64x64", value_parser = parse_size)]
    size: (u32, u32),
    /// Length in seconds.
    #[arg(long, default_value_t = 1.0)]
    seconds: f32,
    /// Frames per second.
    #[arg(long, default_value_t = 24)]
    fps: u32,
    /// Sampling steps.
    #[arg(long)]
    steps: Option<u32>,
    /// Noise seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Make no audio track.
    #[arg(long = "no-audio")]
    no_audio: bool,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
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
    match video(&args) {
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
        EngineArg::Testpattern => testpattern(args, &reporter)?,
    };
    finish(args, made, ffmpeg, started)
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
        extra: json!({}),
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
    let report = match muxed {
        Ok(report) => report,
        Err(why) => {
            return Err(VideoError::RawKept {
                why,
                kept: kept.join(", "),
            })
        }
    };
    let total = started.elapsed().as_secs_f64();
    let sampling: f64 = made.steps.iter().sum();
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
    if args.json {
        let phase_map: serde_json::Map<String, serde_json::Value> = made
            .phases
            .iter()
            .map(|(name, s)| (format!("{name}_s"), json!(s)))
            .collect();
        let summary = json!({
            "ok": true,
            "file": args.out.display().to_string(),
            "width": made.width,
            "height": made.height,
            "frames": report.frames,
            "fps": report.fps,
            "seconds": report.seconds,
            "audio": report.audio.map(|(rate, channels)| json!({"sample_rate": rate, "channels": channels})),
            "audio_trimmed_samples": report.audio_trimmed,
            "seed": args.seed,
            "frames_dir": args.frames_dir.as_ref().map(|p| p.display().to_string()),
            "wav": args.wav.as_ref().map(|p| p.display().to_string()),
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
    Ok(())
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
