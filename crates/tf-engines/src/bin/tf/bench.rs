//! `tf bench`: GPU benchmarks, printed side by side with the reference implementation of the same work.
//!
//! `tf bench attention` times our flash attention at the DiT shapes (every tile shape the GPU fits; the Qwen-Image
//! cached step, and on request the MiniMax H3 steps at 768x448 and at the default canvas) with events after a
//! warm-up, and, when `python3` can import torch, runs `tests/python/bench_attention.py` in the
//! same process tree to time torch's SDPA (flash and cuDNN backends) on the same shape, then prints the ratios.
//! New benchmarks are new variants of [`Bench`] with their own args struct and function.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;

use tf_cuda::{Context, DeviceBuffer, Driver, Event, Stream};
use tf_engines::nn::gpu::{
    attention_flops, AttentionInputs, AttentionShape, AttentionTile, NnKernels, Strides,
};

#[derive(clap::Subcommand)]
pub enum Bench {
    /// Flash attention at the Qwen-Image cached-step shape (4096 x 4176, 32 heads, d 128), optionally the
    /// MiniMax H3 shapes (6026 x 6026 and the default canvas's 37838 x 37838, 56 heads), with torch SDPA flash /
    /// cuDNN side by side.
    Attention(AttentionArgs),
    /// The whole Qwen-Image 2.1 DiT step (full/extract and cached) at one image size, eager and CUDA-graph
    /// replay, with the diffusers eager / torch.compile times of the same run (reference.json) beside them.
    QwenDit(QwenDitArgs),
    /// The whole MiniMax H3 DiT step at one geometry (768x448, 56 frames, 128 text rows: S = 6026, or the
    /// default canvas), eager and CUDA-graph replay, with the diffusers eager / torch.compile times of the same run
    /// (reference.json) beside them.
    H3Dit(H3DitArgs),
    /// MiniMax H3's text conditioning: Qwen3-VL-32B width, random weights made on the device, a forward to
    /// hidden_states[50] timed (or, with --model, the accuracy case on a saved H3 folder), beside transformers.
    H3Text(H3TextArgs),
    /// The MiniMax H3 audio VAE decode on the GPU (f32) over a saved audio_vae/ folder, 5 s of stereo by default,
    /// with diffusers' fp32 / default / bf16 times, peaks and outputs of the same run (reference.json) beside it.
    H3AudioVae(H3AudioVaeArgs),
    /// The Qwen-Image VAE decode on the GPU over a saved vae/ folder at one size: first and warm decodes, the 8-bit
    /// conversion, and with --phases the device time of every kernel and GEMM kind, beside diffusers' decode phase
    /// of the same run (the pipeline reference.json).
    QwenVae(QwenVaeArgs),
    /// Our INT8 GEMM with a scaling epilogue (sm_90) beside cuBLASLt's row-wise FP8 and INT8 (int32) GEMMs at
    /// MiniMax H3's and Qwen-Image's block shapes, each timed sustained.
    Int8Gemm(int8_gemm::Int8GemmArgs),
}

#[derive(clap::Args)]
pub struct QwenVaeArgs {
    /// Diffusers vae/ folder (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Image height in pixels.
    #[arg(long, default_value_t = 1024)]
    height: usize,
    /// Timed decodes (after the first).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Also time every kernel and GEMM kind of one decode.
    #[arg(long)]
    phases: bool,
    /// Column-buffer budgets to compare, in MiB (comma-separated; each re-plans the workspace): smaller budgets
    /// mean more, smaller 3x3 conv bands (default: the decoder's own budget only).
    #[arg(long, value_delimiter = ',')]
    cols_mib: Vec<usize>,
    /// reference.json written by tests/python/qwen_pipeline_reference.py in the same run.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct H3AudioVaeArgs {
    /// Diffusers audio_vae/ folder (config.json with latents_mean / latents_std, safetensors).
    #[arg(long)]
    model: PathBuf,
    /// safetensors holding `latents` [batch, latent_channels, frames], normalized as the DiT produces them
    /// (default: seeded random stereo latents of --frames frames).
    #[arg(long)]
    latents: Option<PathBuf>,
    /// Latent frames per channel without --latents (40 per second).
    #[arg(long, default_value_t = 200)]
    frames: usize,
    /// Timed decodes (after one warm-up).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// reference.json written by tests/python/h3_audio_vae_reference.py in the same run.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Write our waveform (`sample`) here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct H3TextArgs {
    /// Decoder layers of the random encoder timed (H3 reads hidden_states[50]).
    #[arg(long, default_value_t = 50)]
    layers: usize,
    /// Prompt tokens of the timed forward.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Timed forwards (after one warm-up).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Accuracy mode: a saved H3 folder (text_encoder/, tokenizer/) to encode one prompt with.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Accuracy mode: the hidden state to read.
    #[arg(long, default_value_t = 50)]
    layer: usize,
    /// Accuracy mode: the prompt.
    #[arg(long)]
    prompt: Option<String>,
    /// Accuracy mode: a file holding the prompt.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Accuracy mode: write the ids and features here (safetensors).
    #[arg(long)]
    out: Option<PathBuf>,
    /// reference.json written by tests/python/h3_text_reference.py in the same run.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct H3DitArgs {
    /// Diffusers (or original-layout) transformer folder.
    #[arg(long, required_unless_present = "random_weights")]
    model: Option<PathBuf>,
    /// The full default config (33.1B) with random weights made on the device from --seed: speed only.
    #[arg(long, conflicts_with = "model")]
    random_weights: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// GEMM precision of the DiT: bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    precision: tf_engines::minimax_h3::dit_gpu::DitPrecision,
    /// Canvas width in pixels (a multiple of 32).
    #[arg(long, default_value_t = 768)]
    width: usize,
    /// Canvas height in pixels (a multiple of 32).
    #[arg(long, default_value_t = 448)]
    height: usize,
    /// Frames, of the form 17n+5.
    #[arg(long, default_value_t = 56)]
    frames: usize,
    /// The pipeline's default canvas instead: 1344x768, 5 s (124 frames).
    #[arg(long, conflicts_with_all = ["width", "height", "frames"])]
    canvas_default: bool,
    /// Also time each phase of one eager step (events between launch groups), summed over the blocks.
    #[arg(long)]
    phases: bool,
    /// Text rows before the video.
    #[arg(long, default_value_t = 128)]
    text_rows: usize,
    /// Step of the pipeline's grids whose video (shift 12) and audio (shift 3) timesteps the inputs take.
    #[arg(long, default_value_t = 30)]
    step: usize,
    /// Points of those grids (the pipeline's default 50: 49 steps).
    #[arg(long, default_value_t = 50)]
    grid_points: usize,
    /// Untimed steps before each measurement.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps per measurement (the reported time is their mean).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// reference.json written by tests/python/h3_dit_reference.py in the same run (diffusers timings).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct QwenDitArgs {
    /// Diffusers transformer folder (config.json + safetensors).
    #[arg(long)]
    model: PathBuf,
    /// reference.json written by tests/python/qwen_dit_reference.py in the same run (diffusers timings).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Image width in pixels (16 pixels per latent token).
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// Image height in pixels.
    #[arg(long, default_value_t = 1024)]
    height: usize,
    /// Text rows before the image.
    #[arg(long, default_value_t = 80)]
    text_rows: usize,
    /// Timed steps per measurement (after one warm-up step).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also time each phase of one eager full and one eager cached step (events between launch groups),
    /// summed over the layers, with the achieved TFLOP/s or GB/s of each.
    #[arg(long)]
    phases: bool,
    /// How GEMM algorithms are chosen: `timed` (the engine default: the fastest of the heuristic's first
    /// candidates, measured on the first call of each shape) or `heuristic` (its first result).
    #[arg(long, default_value = "timed", value_parser = ["timed", "heuristic"])]
    gemm_selection: String,
    /// GEMM precision of the DiT: bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    precision: tf_engines::qwen_image::dit_gpu::DitPrecision,
}

#[derive(clap::Args)]
pub struct AttentionArgs {
    /// Launches before timing.
    #[arg(long, default_value_t = 20)]
    warmup: u32,
    /// Timed launches (the reported time is their mean).
    #[arg(long, default_value_t = 100)]
    iters: u32,
    /// Also run the H3 shape (6026 x 6026, 56 heads: 768x448, 56 frames, 128 text rows).
    #[arg(long)]
    h3: bool,
    /// Also run the H3 default-canvas shape (37838 x 37838, 56 heads: 1344x768, 124 frames, 128 text rows), with
    /// at most 3 warm-up and 10 timed launches (one launch is about 40 TFLOP).
    #[arg(long)]
    h3_canvas: bool,
    /// Skip the Qwen-Image shape (to time only the H3 shapes).
    #[arg(long)]
    skip_qwen: bool,
    /// Skip the torch comparison.
    #[arg(long)]
    no_torch: bool,
    /// Python interpreter for the torch comparison.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The torch timing script (default: tests/python/bench_attention.py under the current directory or
    /// next to the executable).
    #[arg(long)]
    torch_script: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(b: Bench) -> ExitCode {
    let result = match b {
        Bench::Attention(args) => bench_attention(&args),
        Bench::QwenDit(args) => qwen_dit::run(&args),
        Bench::H3Dit(args) => h3_dit::run(&args),
        Bench::H3Text(args) => h3_text::run(&args),
        Bench::H3AudioVae(args) => h3_audio_vae::run(&args),
        Bench::QwenVae(args) => qwen_vae::run(&args),
        Bench::Int8Gemm(args) => int8_gemm::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tf bench: {e}");
            ExitCode::FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error>;

/// Prints the per-phase table of one timed run (`label`: what ran, "cached step") and returns it as JSON: per
/// phase its calls, milliseconds, share, work and rate (TFLOP/s where FLOPs are counted, else GB/s).
#[cfg(feature = "bench")]
fn report_phases(
    label: &str,
    times: &tf_engines::nn::gpu::phases::PhaseTimes,
) -> serde_json::Value {
    println!(
        "\n  phases of one eager {label}: {:.2} ms between the first and last event",
        times.total_ms
    );
    println!(
        "  {:<28} {:>6} {:>10} {:>7} {:>16}",
        "phase", "calls", "total ms", "share", "rate"
    );
    let mut rows = Vec::new();
    for phase in &times.phases {
        let share = if times.total_ms > 0.0 {
            phase.ms / times.total_ms
        } else {
            0.0
        };
        let (rate, unit) = if phase.flops > 0.0 {
            (phase.tflops(), "TFLOP/s")
        } else {
            (phase.gb_per_s(), "GB/s")
        };
        println!(
            "  {:<28} {:>6} {:>10.3} {:>6.1}% {:>8.1} {unit}",
            phase.name,
            phase.count,
            phase.ms,
            100.0 * share,
            rate
        );
        rows.push(serde_json::json!({
            "phase": phase.name,
            "calls": phase.count,
            "ms": phase.ms,
            "share": share,
            "flops": phase.flops,
            "bytes": phase.bytes,
            "rate": rate,
            "rate_unit": unit,
        }));
    }
    serde_json::json!({ "step_ms": times.total_ms, "phases": rows })
}

/// How long an energy window runs: NVML's energy counter moves in steps of a few tens of milliseconds, so a window
/// of two seconds reads it to about 1%.
#[cfg(feature = "bench")]
const ENERGY_WINDOW_MS: f64 = 2000.0;

/// Measures the board's energy (NVML) around graph replays of a step that takes about `step_ms`: `replay(n)` runs
/// `n` timed replays (plus any untimed ones it counts) and returns (ms a replay, replays run). Prints one line, and
/// beside a goal of `goal_ms` the joules a step may spend to meet it at the board's power limit. Returns the JSON
/// record; a machine without NVML gets the reason instead, and the benchmark goes on.
#[cfg(feature = "bench")]
fn report_energy(
    ctx: &Context,
    step_ms: f64,
    goal_ms: Option<f64>,
    mut replay: impl FnMut(usize) -> Result<(f64, usize), BoxError>,
) -> Result<serde_json::Value, BoxError> {
    let meter = match tf_cuda::power::PowerMeter::for_context(ctx) {
        Ok(meter) => meter,
        Err(e) => {
            println!("  energy: not measured ({e})");
            return Ok(serde_json::json!({ "error": e.to_string() }));
        }
    };
    // At least 3 replays, at most 1000: the window's length from the step's own time.
    let timed = (ENERGY_WINDOW_MS / step_ms.max(0.01))
        .ceil()
        .clamp(3.0, 1000.0) as usize;
    // One replay before the window: a graph the timings since evicted is captured again outside it.
    replay(1)?;
    let window = meter.window(std::time::Duration::from_millis(10));
    let (ms, replays) = replay(timed)?;
    let report = match window.finish() {
        Ok(report) => report,
        Err(e) => {
            println!("  energy: not measured ({e})");
            return Ok(serde_json::json!({ "error": e.to_string() }));
        }
    };
    println!(
        "  energy (NVML, graph replays at {ms:.2} ms): {}",
        report.describe(replays, "step")
    );
    let per_step = report.joules_per(replays);
    let mut goal = serde_json::Value::Null;
    if let Some(goal_ms) = goal_ms {
        let allowed = report.joules_allowed(goal_ms / 1000.0);
        println!(
            "  at the {:.0} W limit a {goal_ms} ms step may spend {allowed:.2} J; this one spends {per_step:.2} J \
             ({:.3}x)",
            report.limit_watts,
            per_step / allowed
        );
        goal = serde_json::json!({ "goal_ms": goal_ms, "joules_allowed": allowed, "ratio": per_step / allowed });
    }
    let clock = report.sm_clock;
    Ok(serde_json::json!({
        "replays": replays,
        "replay_ms": ms,
        "window_s": report.seconds,
        "joules": report.joules,
        "joules_per_step": per_step,
        "mean_watts": report.mean_watts(),
        "limit_watts": report.limit_watts,
        "limit_share": report.limit_share(),
        "max_sampled_watts": report.max_sampled_watts,
        "sm_clock_median_mhz": clock.map(|c| c.median),
        "sm_clock_min_mhz": clock.map(|c| c.min),
        "sm_clock_max_mhz": clock.map(|c| c.max),
        "power_capped_share": report.power_capped_share(),
        "slowed_samples": report.slowed_samples,
        "goal": goal,
    }))
}

/// The kernel choices set through the environment in this process (variable and value, only those set), so a
/// bench's figures say which forms ran: printed by [`print_kernel_env`], written as `kernel_env` by [`kernel_env`].
#[cfg(feature = "bench")]
fn kernel_env_vars() -> Vec<(&'static str, String)> {
    use tf_engines::minimax_h3::dit_gpu::kernels::LINEAR_W8_COLS_ENV;
    use tf_engines::nn::gpu::gemm::{SELECTION_ENV, TIMING_DATA_ENV};
    use tf_engines::nn::gpu::gemm_int8::{
        BACKEND_ENV, BAND_ENV, BF16_BACKEND_ENV, QKV_ENV, STORE_ENV, SWIGLU_ENV,
    };
    [
        STORE_ENV,
        BAND_ENV,
        BACKEND_ENV,
        BF16_BACKEND_ENV,
        QKV_ENV,
        SWIGLU_ENV,
        LINEAR_W8_COLS_ENV,
        SELECTION_ENV,
        TIMING_DATA_ENV,
    ]
    .into_iter()
    .filter_map(|name| Some((name, std::env::var(name).ok()?)))
    .collect()
}

/// [`kernel_env_vars`] as a JSON object.
#[cfg(feature = "bench")]
fn kernel_env() -> serde_json::Value {
    kernel_env_vars()
        .into_iter()
        .map(|(name, value)| (name.to_string(), serde_json::Value::String(value)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Prints [`kernel_env_vars`], when any is set.
#[cfg(feature = "bench")]
fn print_kernel_env() {
    let set = kernel_env_vars();
    if !set.is_empty() {
        let shown: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("kernel choices from the environment: {}", shown.join(" "));
    }
}

/// The board a bench ran on, for the scripts that read its JSON (`energy_budget.py` sizes the tensor cores' rate at
/// the measured clock from the SM count and compute capability).
#[cfg(feature = "bench")]
fn device_json(info: &tf_cuda::DeviceInfo) -> serde_json::Value {
    serde_json::json!({
        "name": info.name,
        "compute_capability": [info.compute_capability.0, info.compute_capability.1],
        "sm_count": info.sm_count,
        "total_memory_bytes": info.total_memory,
    })
}

/// Beside our joules a step (`ours`: [`report_energy`]'s record), the reference's from the same run (`case[key]`, the
/// reference scripts' board_energy.py figures) for each (label, key) of `rows` it holds, with the ratio. Prints nothing
/// where either side was not measured.
#[cfg(feature = "bench")]
fn report_reference_energy(
    ours: &serde_json::Value,
    case: &serde_json::Value,
    rows: &[(&str, &str)],
) {
    let Some(ours_j) = ours.get("joules_per_step").and_then(|v| v.as_f64()) else {
        return;
    };
    for (label, key) in rows {
        if let Some(theirs) = case.get(*key).and_then(|v| v.as_f64()).filter(|j| *j > 0.0) {
            println!(
                "  {label}: {theirs:.2} J a step; ours {ours_j:.2} J, ours / theirs = {:.3}",
                ours_j / theirs
            );
        }
    }
}

mod h3_audio_vae;
mod h3_dit;
mod h3_text;
mod int8_gemm;
mod qwen_dit;
mod qwen_vae;

/// Which model step a benchmark shape comes from (and the flag that selects it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum ShapeKind {
    QwenCached,
    H3Step,
    H3Canvas,
}

/// One benchmark shape.
struct Shape {
    name: &'static str,
    kind: ShapeKind,
    queries: usize,
    keys: usize,
    /// Keys read from a separate cached-prefix buffer.
    prefix: usize,
    heads: usize,
    /// Warm-up and timed launches at most (a large shape needs few for a stable mean).
    max_launches: Option<(u32, u32)>,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "qwen-image cached step",
        kind: ShapeKind::QwenCached,
        queries: 4096,
        keys: 4176,
        prefix: 80,
        heads: 32,
        max_launches: None,
    },
    // 768x448, 56 frames, 128 text rows: 128 text + 186 audio + 17 x 336 video rows.
    Shape {
        name: "h3 step",
        kind: ShapeKind::H3Step,
        queries: 6026,
        keys: 6026,
        prefix: 0,
        heads: 56,
        max_launches: None,
    },
    // The pipeline's default canvas, 1344x768 for 5 s (124 frames), 128 text rows: 128 text + 414 audio
    // + 37 x 1008 video rows.
    Shape {
        name: "h3 default canvas step",
        kind: ShapeKind::H3Canvas,
        queries: 37838,
        keys: 37838,
        prefix: 0,
        heads: 56,
        max_launches: Some((3, 10)),
    },
];

impl Shape {
    fn selected(&self, args: &AttentionArgs) -> bool {
        match self.kind {
            ShapeKind::QwenCached => !args.skip_qwen,
            ShapeKind::H3Step => args.h3,
            ShapeKind::H3Canvas => args.h3_canvas,
        }
    }

    /// The warm-up and timed launches of this shape under `args`.
    fn launches(&self, args: &AttentionArgs) -> (u32, u32) {
        let (warmup, iters) = (args.warmup, args.iters.max(1));
        match self.max_launches {
            Some((w, i)) => (warmup.min(w), iters.min(i)),
            None => (warmup, iters),
        }
    }
}

/// xorshift bf16 noise in [-2, 2): inputs only need realistic magnitudes.
fn noise(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let unit = (s >> 40) as f32 / (1u64 << 24) as f32;
            ((4.0 * unit - 2.0).to_bits() >> 16) as u16
        })
        .collect()
}

fn bench_attention(args: &AttentionArgs) -> Result<(), BoxError> {
    let driver = Arc::new(Driver::open()?);
    let ctx = Context::new(driver, 0)?;
    let stream = Stream::new(&ctx, true)?;
    let kernels = NnKernels::load(&ctx)?;
    let info = ctx.device_info()?;
    println!("device: {info:?}");
    let mut summary = Vec::new();
    if !SHAPES.iter().any(|s| s.selected(args)) {
        return Err("no shape selected: --skip-qwen needs --h3 or --h3-canvas".into());
    }
    for shape in SHAPES.iter().filter(|s| s.selected(args)) {
        summary.push(bench_shape(args, &ctx, &stream, &kernels, shape)?);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn bench_shape(
    args: &AttentionArgs,
    ctx: &Context,
    stream: &Stream,
    kernels: &NnKernels,
    shape: &Shape,
) -> Result<serde_json::Value, BoxError> {
    let width = shape.heads * 128;
    let current = shape.keys - shape.prefix;
    let q = DeviceBuffer::from_slice(ctx, &noise(shape.queries * width, 1))?;
    let k = DeviceBuffer::from_slice(ctx, &noise(current * width, 2))?;
    let v = DeviceBuffer::from_slice(ctx, &noise(current * width, 3))?;
    let prefix_rows = shape.prefix.max(1);
    let kp = DeviceBuffer::from_slice(ctx, &noise(prefix_rows * width, 4))?;
    let vp = DeviceBuffer::from_slice(ctx, &noise(prefix_rows * width, 5))?;
    let mut o = DeviceBuffer::alloc(ctx, shape.queries * width * 2)?;
    let dims = AttentionShape {
        batch: 1,
        num_queries: shape.queries,
        num_keys: shape.keys,
        prefix_len: shape.prefix,
        num_heads: shape.heads,
        num_kv_heads: shape.heads,
    };
    let (qv, kv, vv, kpv, vpv) = (q.view(), k.view(), v.view(), kp.view(), vp.view());
    let rows = |n: usize| Strides {
        batch: n * width,
        row: width,
    };
    let inputs = AttentionInputs {
        q: &qv,
        q_strides: rows(shape.queries),
        prefix: (shape.prefix > 0).then_some((&kpv, &vpv, rows(shape.prefix))),
        k: &kv,
        v: &vv,
        kv_strides: rows(current),
        key_limit: None,
        key_pad: None,
        scale: 1.0 / (128f32).sqrt(),
    };
    let flops = attention_flops(dims);
    let (warmup, iters) = shape.launches(args);
    println!(
        "\n== attention, {}: {} queries x {} keys ({} cached), {} heads, d 128, bf16; {warmup} warm-up + {iters} timed launches",
        shape.name, shape.queries, shape.keys, shape.prefix, shape.heads
    );
    let mut ours = Vec::new();
    for tile in AttentionTile::ALL {
        if !kernels.has_tile(tile) {
            println!(
                "  {tile:?}: not loaded on this GPU (shared memory or compute capability), skipped"
            );
            continue;
        }
        let launch = |o: &mut DeviceBuffer| {
            kernels.attention_with(
                stream,
                tile,
                dims,
                &inputs,
                &mut o.view_mut(),
                rows(shape.queries),
            )
        };
        for _ in 0..warmup {
            launch(&mut o)?;
        }
        let start = Event::new(ctx, true)?;
        let end = Event::new(ctx, true)?;
        start.record(stream)?;
        for _ in 0..iters {
            launch(&mut o)?;
        }
        end.record(stream)?;
        end.synchronize()?;
        let ms = f64::from(Event::elapsed_ms(&start, &end)?) / f64::from(iters);
        let tflops = flops / (ms * 1e-3) / 1e12;
        println!(
            "  ours {tile:?} ({}): {ms:.3} ms, {tflops:.1} TFLOP/s",
            tile.kernel()
        );
        ours.push((tile, ms, tflops));
    }
    let best = ours
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .copied()
        .ok_or("no attention tile shape fits this GPU")?;
    println!(
        "  ours best: {:?} {:.3} ms, {:.1} TFLOP/s",
        best.0, best.1, best.2
    );

    let torch = if args.no_torch {
        println!("  torch: skipped (--no-torch)");
        serde_json::Value::Null
    } else {
        torch_reference(args, shape)
    };
    if let Some(results) = torch.get("results") {
        for backend in ["flash", "cudnn"] {
            match results.get(backend).and_then(|r| r.get("ms")).and_then(|m| m.as_f64()) {
                Some(ms) => println!(
                    "  torch {backend}: {ms:.3} ms, {:.1} TFLOP/s; ours best / torch {backend} time ratio {:.2} \
                     (< 1 means ours is faster)",
                    flops / (ms * 1e-3) / 1e12,
                    best.1 / ms
                ),
                None => println!(
                    "  torch {backend}: not available ({})",
                    results.get(backend).map_or_else(|| "absent".to_string(), |r| r.to_string())
                ),
            }
        }
    }
    Ok(serde_json::json!({
        "shape": shape.name,
        "queries": shape.queries,
        "keys": shape.keys,
        "prefix": shape.prefix,
        "heads": shape.heads,
        "warmup": warmup,
        "iters": iters,
        "flops": flops,
        "ours": ours.iter().map(|(t, ms, tf)| serde_json::json!({"tile": format!("{t:?}"), "kernel": t.kernel(), "ms": ms, "tflops": tf})).collect::<Vec<_>>(),
        "torch": torch,
    }))
}

/// Finds the torch timing script: the explicit path, else under the current directory, else next to the
/// executable (a bundle keeps `tests/python/` beside `tf`).
fn torch_script(args: &AttentionArgs) -> Option<PathBuf> {
    if let Some(p) = &args.torch_script {
        return Some(p.clone());
    }
    let rel = Path::new("tests/python/bench_attention.py");
    if rel.is_file() {
        return Some(rel.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .skip(1)
        .take(4)
        .map(|dir| dir.join(rel))
        .find(|p| p.is_file())
}

/// Runs torch's SDPA timing in a child Python; returns its JSON (or a JSON object with "error").
fn torch_reference(args: &AttentionArgs, shape: &Shape) -> serde_json::Value {
    let skip = |why: String| {
        println!("  torch: skipped ({why})");
        serde_json::json!({ "error": why })
    };
    let Some(script) = torch_script(args) else {
        return skip("tests/python/bench_attention.py not found; pass --torch-script".into());
    };
    let probe = Command::new(&args.python)
        .args(["-c", "import torch"])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            return skip(format!(
                "`{} -c 'import torch'` failed: {}",
                args.python,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
        Err(e) => return skip(format!("cannot run {}: {e}", args.python)),
    }
    let output = Command::new(&args.python)
        .arg(&script)
        .args(["--queries", &shape.queries.to_string()])
        .args(["--keys", &shape.keys.to_string()])
        .args(["--heads", &shape.heads.to_string()])
        .args(["--warmup", &shape.launches(args).0.to_string()])
        .args(["--iters", &shape.launches(args).1.to_string()])
        .output();
    let output = match output {
        Ok(o) => o,
        Err(e) => return skip(format!("running {}: {e}", script.display())),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    match serde_json::from_str::<serde_json::Value>(last) {
        Ok(v) if output.status.success() => {
            println!(
                "  torch {} on {}",
                v.get("torch").and_then(|t| t.as_str()).unwrap_or("?"),
                v.get("device").and_then(|t| t.as_str()).unwrap_or("?")
            );
            v
        }
        _ => skip(format!(
            "{} exited with {}: {} {}",
            script.display(),
            output.status,
            last,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{ShapeKind, SHAPES};
    use tf_engines::minimax_h3::layout::{
        Geometry, LayoutRequest, PackedLayout, SizeRules, TEXT_TAG,
    };

    /// Rows of the text-to-video layout at `width` x `height`, `frames` frames and `text_rows` text rows.
    fn h3_rows(width: usize, height: usize, frames: usize, text_rows: usize) -> usize {
        let geometry =
            Geometry::for_request(height, width, frames, &SizeRules::TRANSFORMER).unwrap();
        let tags = vec![TEXT_TAG; text_rows];
        PackedLayout::build(&LayoutRequest {
            text_tags: &tags,
            geometry,
            patch: [1, 2, 2],
            keyframes: &[],
        })
        .unwrap()
        .seq_len
    }

    #[test]
    fn h3_shapes_are_the_layouts_rows() {
        let rows = |kind| {
            SHAPES
                .iter()
                .find(|s| s.kind == kind)
                .map(|s| (s.queries, s.keys, s.heads))
                .unwrap()
        };
        let step = h3_rows(768, 448, 56, 128);
        let canvas = h3_rows(1344, 768, 124, 128);
        assert_eq!((step, canvas), (6026, 37838));
        assert_eq!(rows(ShapeKind::H3Step), (step, step, 56));
        assert_eq!(rows(ShapeKind::H3Canvas), (canvas, canvas, 56));
    }
}
