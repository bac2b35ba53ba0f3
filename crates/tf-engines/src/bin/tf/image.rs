//! `tf image`: a prompt to a PNG through the whole Qwen-Image 2.1 pipeline.
//!
//! Progress goes to stderr (a bar on a terminal, plain lines otherwise), per-phase timings at the end; `--json`
//! prints a machine-readable summary on stdout.
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;
use tf_engines::nn::media::png::{write_png, ColorType};
use tf_engines::nn::sampling::noise::load_noise;
use tf_engines::nn::weights::{write_safetensors, AnyTensor};
use tf_engines::qwen_image::pipeline::{
    Backend, LoadOptions, LoadReport, Pipeline, PipelineError, Progress, Request,
};
use tf_engines::qwen_image::variant::{Ignored, Variant};

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
    /// Diffusers QwenImage21Pipeline folder (model_index.json, transformer/, text_encoder/, vae/, scheduler/,
    /// processor/).
    #[arg(long)]
    model: PathBuf,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Negative prompt for true classifier-free guidance (needs --cfg above 1; a Turbo checkpoint ignores it).
    #[arg(long)]
    negative: Option<String>,
    /// True CFG scale; guidance runs when it is above 1 and --negative is given (a Turbo checkpoint ignores it).
    #[arg(long, default_value_t = 1.0)]
    cfg: f32,
    /// Image size WIDTHxHEIGHT in pixels (each side floored to a multiple of 32).
    #[arg(long, default_value = "1024x1024", value_parser = parse_size)]
    size: (usize, usize),
    /// Sampling steps (default: the checkpoint's sample_sigmas, else 40, Turbo 8).
    #[arg(long)]
    steps: Option<usize>,
    /// Seed of the portable noise generator.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Initial latents from a safetensors file (tensor "latents" or "noise"; packed or planar), replacing the
    /// seeded noise.
    #[arg(long)]
    noise: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// Checkpoint variant: auto (the folder says: a non-empty `sample_sigmas` in model_index.json is Turbo),
    /// base, or turbo (the folder's sample_sigmas, else 8 steps; no guidance).
    #[arg(long, value_enum, default_value = "auto")]
    variant: VariantArg,
    /// Output PNG.
    #[arg(short = 'o', long = "out", default_value = "image.png")]
    out: PathBuf,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
    /// Write every step's velocity (`velocity.{i}`, the model output after CFG, before the Euler step) and
    /// latents (`latents.{i}`), and the decoded image (`image`, [1, 4, H, W] in [-1, 1]) to this safetensors
    /// file, all f32, for comparisons with a reference pipeline.
    #[arg(long = "dump-steps")]
    dump_steps: Option<PathBuf>,
    /// Skip the warm-up at load (a 2-step run at the requested size that plans the GEMMs, loads the kernels and
    /// allocates the workspaces, so the request itself runs warm). GPU only.
    #[arg(long = "no-warm-up")]
    no_warm_up: bool,
    /// Milliseconds the warm-up may spend timing GEMM algorithms for shapes the plan cache does not hold yet.
    #[arg(long = "gemm-budget-ms", default_value_t = 3000)]
    gemm_budget_ms: u64,
    /// Delete the persistent GEMM plan cache before loading (TF_PLAN_CACHE, else the user's cache folder).
    #[arg(long = "reset-plan-cache")]
    reset_plan_cache: bool,
    /// GEMM precision of the GPU DiT: bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    precision: tf_engines::qwen_image::dit_gpu::DitPrecision,
    /// Cap the memory plan's budget (40GiB, 512MiB, ...): the GPU plans against the smaller of this and its free
    /// memory less a reserve, the host against this alone. Below the components' sum, the request loads, runs
    /// and frees them in turn (and says how long the loads took).
    #[arg(long = "device-budget", value_parser = crate::parse_budget)]
    device_budget: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VariantArg {
    /// As the folder's model_index.json says (diffusers' rule).
    Auto,
    /// The base checkpoint (QwenImage21Pipeline).
    Base,
    /// The few-step Turbo checkpoint (QwenImage21TurboModularPipeline).
    Turbo,
}

impl VariantArg {
    fn choice(self) -> Option<Variant> {
        match self {
            VariantArg::Auto => None,
            VariantArg::Base => Some(Variant::Base),
            VariantArg::Turbo => Some(Variant::Turbo),
        }
    }
}

/// This command's name for a request field the variant ignores.
fn flag_of(ignored: Ignored) -> &'static str {
    match ignored {
        Ignored::NegativePrompt => "--negative",
        Ignored::GuidanceScale => "--cfg",
    }
}

/// How the loaded variant samples, for the log.
fn variant_line(variant: Variant, sample_sigmas: Option<&[f64]>, steps: usize) -> String {
    let grid = match sample_sigmas {
        Some(sigmas) => format!(
            "{} sigmas from model_index.json's sample_sigmas",
            sigmas.len()
        ),
        None => "evenly spaced sigmas".to_string(),
    };
    let guidance = if variant.guidance() {
        "true CFG on request"
    } else {
        "no guidance"
    };
    format!("{variant}: {steps} steps on {grid}, {guidance}")
}

/// What each component computes in, as MiniMax H3's load report lists it for `tf video`: (name, precision, whether
/// it runs as the f32 host reference), the DiT, the text encoder and the VAE. On the GPU the DiT computes in the
/// report's `dit_precision` (its GEMM precision) and the text encoder and VAE in bf16 where they run on the device;
/// everything on the host is the f32 reference.
fn precision(load: &LoadReport) -> [(&'static str, String, bool); 3] {
    let gpu = load.backend == Backend::Gpu;
    let part = |name, on_device: bool, device_precision: String| {
        if gpu && on_device {
            (name, device_precision, false)
        } else {
            (name, "f32".to_string(), true)
        }
    };
    [
        part("DiT", true, load.dit_precision.to_string()),
        part("text encoder", load.te_on_device, "bf16".into()),
        part("VAE", load.vae_on_device, "bf16".into()),
    ]
}

/// The load report's precision line: [`precision`]'s list, the host reference marked, and the DiT checkpoint's FP8
/// weights when it stores some.
fn precision_line(load: &LoadReport) -> String {
    let checkpoint = match (load.dit_checkpoint_fp8, load.backend) {
        (0, _) => String::new(),
        (n, Backend::Host) => format!(
            " (its checkpoint stores {n} weights in FP8 e4m3 with their scales: dequantized to f32 by the host \
             reference)"
        ),
        (n, Backend::Gpu) => format!(
            " (its checkpoint stores {n} weights in FP8 e4m3 with their scales: used as stored where the DiT runs \
             FP8, dequantized to bf16 elsewhere)"
        ),
    };
    let parts: Vec<String> = precision(load)
        .into_iter()
        .map(|(component, precision, on_host)| {
            let host = if on_host { " (host reference)" } else { "" };
            let note = if component == "DiT" {
                checkpoint.as_str()
            } else {
                ""
            };
            format!("{component} {precision}{host}{note}")
        })
        .collect();
    format!("precision: {}", parts.join(", "))
}

fn parse_size(text: &str) -> Result<(usize, usize), String> {
    let (w, h) = text
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("size {text:?} is not WIDTHxHEIGHT (e.g. 1024x768)"))?;
    let side = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("size {text:?}: {s:?} is not a whole number of pixels"))
    };
    Ok((side(w)?, side(h)?))
}

pub fn run(args: Args) -> ExitCode {
    match image(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tf image: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Errors of the command: the pipeline's, or the command's own (with the fix).
#[derive(Debug, thiserror::Error)]
enum ImageError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Png(#[from] tf_engines::nn::media::png::PngError),
    #[error(transparent)]
    Noise(#[from] tf_engines::nn::sampling::noise::NoiseError),
    #[error(transparent)]
    Weights(#[from] tf_engines::nn::weights::WeightsError),
}

fn image(args: &Args) -> Result<(), ImageError> {
    let backend = match args.backend {
        BackendArg::Auto => Backend::detect(),
        BackendArg::Host => Backend::Host,
        BackendArg::Gpu => Backend::Gpu,
    };
    let (width, height) = args.size;
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(ImageError::Usage(format!(
                "the output folder {} does not exist; create it or choose another -o",
                parent.display()
            )));
        }
    }
    let options = LoadOptions {
        dit_precision: args.precision,
        device_budget: args.device_budget,
        ..LoadOptions::new(backend)
    };
    let options = LoadOptions {
        variant: args.variant.choice(),
        ..options
    };
    let mut request = Request::new(args.prompt.clone());
    request.negative_prompt = args.negative.clone();
    request.true_cfg_scale = args.cfg;
    request.width = width;
    request.height = height;
    request.steps = args.steps;
    request.seed = args.seed;
    // Size, steps, guidance and the noise file are checked against the folder's configs before the (slow) load.
    let preflight = Pipeline::preflight(&args.model, &options, &request)?;
    for ignored in &preflight.ignored {
        eprintln!("tf image: {}", ignored.message(flag_of(*ignored)));
    }
    if let Some(path) = &args.noise {
        let file = tf_engines::nn::weights::SafetensorsFile::open(path)
            .map_err(tf_engines::nn::sampling::noise::NoiseError::from)?;
        let name = ["latents", "noise"]
            .into_iter()
            .find(|n| file.contains(n))
            .ok_or_else(|| {
                ImageError::Usage(format!(
                    "{} holds neither a \"latents\" nor a \"noise\" tensor",
                    path.display()
                ))
            })?;
        request.initial_latents = Some(load_noise(
            path,
            name,
            1,
            preflight.latent_channels,
            preflight.latent_rows,
            preflight.latent_cols,
        )?);
    }
    eprintln!(
        "tf image: loading {} ({}) on the {}",
        args.model.display(),
        preflight.variant,
        backend.name()
    );
    if args.reset_plan_cache {
        match tf_cuda::cublaslt::reset_plan_cache() {
            Ok(Some(path)) => eprintln!("tf image: removed the GEMM plan cache {}", path.display()),
            Ok(None) => eprintln!("tf image: no GEMM plan cache to remove"),
            Err(e) => eprintln!("tf image: could not remove the GEMM plan cache: {e}"),
        }
    }
    tf_cuda::usage::reset_peaks();
    let nvml = backend.open_power_library();
    let mut pipeline = Pipeline::load(&args.model, &options)?;
    pipeline.keep_step_latents(args.dump_steps.is_some());
    let load = pipeline.load_report();
    eprintln!(
        "tf image: loaded in {:.2} s, {:.1} MiB resident (text encoder on {}, VAE on {})",
        load.seconds,
        load.resident_bytes as f64 / (1u64 << 20) as f64,
        if load.te_on_device { "device" } else { "host" },
        if load.vae_on_device { "device" } else { "host" },
    );
    eprintln!("tf image: {}", precision_line(&load));
    eprintln!(
        "tf image: {}",
        variant_line(load.variant, pipeline.sample_sigmas(), preflight.steps)
    );
    eprintln!("tf image: {}", pipeline.memory_plan());
    let warm_up = if pipeline.context().is_some() && !args.no_warm_up {
        let w = pipeline.warm_up(
            width,
            height,
            std::time::Duration::from_millis(args.gemm_budget_ms),
        )?;
        let gemms = w.gemms.map_or(String::new(), |g| {
            format!(
                "; DiT GEMM plans: {} shapes, {} from the plan cache, {} timed, {} heuristic",
                g.shapes, g.stored, g.timed, g.heuristic
            )
        });
        match w.skipped {
            Some(why) => eprintln!("tf image: no warm-up: {why}"),
            None => eprintln!(
                "tf image: warmed up at {width}x{height} in {:.2} s{gemms}",
                w.seconds
            ),
        }
        Some(w)
    } else {
        None
    };

    let plan = pipeline.plan(&request)?;
    if (plan.width, plan.height) != (width, height) {
        eprintln!(
            "tf image: size {width}x{height} floored to {}x{} (multiples of 32)",
            plan.width, plan.height
        );
    }

    let terminal = std::io::stderr().is_terminal();
    let mut report = |p: Progress| {
        let mut err = std::io::stderr();
        match p {
            Progress::Encoded { seconds } => {
                let _ = writeln!(err, "tf image: prompt encoded in {seconds:.3} s");
            }
            Progress::Step {
                step,
                steps,
                seconds,
            } => {
                if terminal {
                    let filled = step * 30 / steps.max(1);
                    let _ = write!(
                        err,
                        "\r[{}{}] step {step}/{steps} ({seconds:.3} s)",
                        "#".repeat(filled),
                        ".".repeat(30 - filled)
                    );
                    if step == steps {
                        let _ = writeln!(err);
                    }
                } else {
                    let _ = writeln!(err, "tf image: step {step}/{steps} {seconds:.3} s");
                }
            }
            Progress::Decoded { seconds } => {
                let _ = writeln!(err, "tf image: decoded in {seconds:.3} s");
            }
        }
        let _ = err.flush();
    };
    let driver_before = tf_cuda::driver_costs();
    let energy = super::energy::mark(nvml, pipeline.context());
    let result = pipeline.generate(&request, &mut report)?;
    let board_energy_j = super::energy::spent("tf image", energy);
    let driver = tf_cuda::driver_costs().since(&driver_before);
    let peak_device_bytes = tf_cuda::usage().device_peak;
    if let Some(path) = &args.dump_steps {
        let mut names = Vec::new();
        for i in 0..result.step_velocities.len() {
            names.push((format!("velocity.{i}"), format!("latents.{i}")));
        }
        let mut tensors: Vec<(&str, AnyTensor<'_>)> = Vec::new();
        for ((velocity_name, latents_name), (velocity, latents)) in names
            .iter()
            .zip(result.step_velocities.iter().zip(&result.step_latents))
        {
            tensors.push((velocity_name, AnyTensor::F32(velocity)));
            tensors.push((latents_name, AnyTensor::F32(latents)));
        }
        if let Some(decoded) = &result.decoded {
            tensors.push(("image", AnyTensor::F32(decoded)));
        }
        write_safetensors(path, &tensors)?;
        eprintln!(
            "tf image: wrote {} steps of velocities and latents to {}",
            result.step_velocities.len(),
            path.display()
        );
    }
    let image = &result.image;
    let color = ColorType::from_channels(image.channels)?;
    write_png(&args.out, image.width, image.height, color, &image.pixels)?;

    let t = &result.timings;
    let sampling: f64 = t.steps.iter().sum();
    eprintln!(
        "tf image: wrote {} ({}x{}, {} channels); encode {:.3} s, {} steps {:.3} s ({:.3} s/step), decode {:.3} s, \
         total {:.3} s",
        args.out.display(),
        image.width,
        image.height,
        image.channels,
        t.encode,
        t.steps.len(),
        sampling,
        sampling / t.steps.len().max(1) as f64,
        t.decode,
        t.total
    );
    if pipeline.context().is_some() {
        eprintln!("tf image: driver work in the request: {driver}");
    }
    if t.loads.total() > 0.0 {
        // The sequential memory plan loads each component inside the request: say where that time went.
        eprintln!("tf image: component loads in the request {}", t.loads);
    }
    if args.json {
        let precisions = precision(&load);
        let dit_precision = &precisions[0].1;
        let summary = json!({
            "ok": true,
            "file": args.out.display().to_string(),
            "width": image.width,
            "height": image.height,
            "channels": image.channels,
            "seed": result.seed,
            "steps": result.plan_steps,
            "backend": backend.name(),
            "variant": load.variant.name(),
            "ignored": result.ignored.iter().map(|i| i.field()).collect::<Vec<_>>(),
            "peak_device_bytes": peak_device_bytes,
            "board_energy_j": board_energy_j,
            "load": {
                "seconds": load.seconds,
                "resident_bytes": load.resident_bytes,
                "te_on_device": load.te_on_device,
                "vae_on_device": load.vae_on_device,
                "residency": load.residency.name(),
                "dit_precision": dit_precision,
                "precision": precisions
                    .iter()
                    .map(|(component, p, _)| (component.to_string(), json!(p)))
                    .collect::<serde_json::Map<String, serde_json::Value>>(),
                "dit_checkpoint_fp8_weights": load.dit_checkpoint_fp8,
                "warm_up_s": warm_up.as_ref().map(|w| w.seconds),
            },
            "gemm_plans": pipeline.gemm_plan_summary().map(|g| json!({
                "shapes": g.shapes, "stored": g.stored, "timed": g.timed, "heuristic": g.heuristic,
                "already_planned": g.already_planned,
                "primed": g.primed,
            })),
            "driver_work": {
                "device_allocs": driver.device_allocs.calls,
                "device_alloc_s": driver.device_allocs.seconds,
                "device_frees": driver.device_frees.calls,
                "device_free_s": driver.device_frees.seconds,
                "graph_captures": driver.graph_captures.calls,
                "graph_capture_s": driver.graph_captures.seconds,
                "graph_instantiations": driver.graph_instantiations.calls,
                "graph_instantiate_s": driver.graph_instantiations.seconds,
            },
            "timings": {
                "encode_s": t.encode,
                "steps_s": t.steps,
                "decode_s": t.decode,
                "total_s": t.total,
                "component_loads_s": {
                    "text_encoder": t.loads.text_encoder,
                    "dit": t.loads.dit,
                    "vae": t.loads.vae,
                },
            },
        });
        println!("{summary}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variant_line_says_how_it_samples() {
        let turbo = variant_line(Variant::Turbo, Some(&[1.0; 8]), 8);
        assert!(
            turbo.contains("Turbo: 8 steps on 8 sigmas from model_index.json's sample_sigmas"),
            "{turbo}"
        );
        assert!(turbo.ends_with("no guidance"), "{turbo}");
        let base = variant_line(Variant::Base, None, 40);
        assert!(
            base.contains("40 steps on evenly spaced sigmas, true CFG"),
            "{base}"
        );
        assert_eq!(VariantArg::Auto.choice(), None);
        assert_eq!(VariantArg::Turbo.choice(), Some(Variant::Turbo));
        assert_eq!(flag_of(Ignored::GuidanceScale), "--cfg");
    }

    fn report(backend: Backend, on_device: bool, fp8: usize) -> LoadReport {
        LoadReport {
            backend,
            resident_bytes: 0,
            seconds: 0.0,
            te_on_device: on_device,
            vae_on_device: on_device,
            te_vae_on_device: on_device,
            residency: tf_engines::nn::memory_plan::Residency::AllResident,
            variant: Variant::Base,
            dit_precision: tf_engines::nn::precision::DitPrecision::Bf16,
            dit_checkpoint_fp8: fp8,
        }
    }

    #[test]
    fn the_precision_line_says_what_each_component_computes_in() {
        // The host reference computes in f32, whatever the GPU DiT's precision field holds (bf16 by default).
        let host = precision_line(&report(Backend::Host, false, 0));
        assert_eq!(
            host,
            "precision: DiT f32 (host reference), text encoder f32 (host reference), VAE f32 (host reference)"
        );
        let host_fp8 = precision_line(&report(Backend::Host, false, 12));
        assert!(
            host_fp8
                .contains("DiT f32 (host reference) (its checkpoint stores 12 weights in FP8 e4m3")
                && host_fp8.contains("dequantized to f32"),
            "{host_fp8}"
        );
        let gpu = precision_line(&report(Backend::Gpu, true, 0));
        assert_eq!(gpu, "precision: DiT bf16, text encoder bf16, VAE bf16");
        let gpu_te_on_host = LoadReport {
            te_on_device: false,
            te_vae_on_device: false,
            ..report(Backend::Gpu, true, 0)
        };
        assert_eq!(
            precision_line(&gpu_te_on_host),
            "precision: DiT bf16, text encoder f32 (host reference), VAE bf16"
        );
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("64x96"), Ok((64, 96)));
        assert_eq!(parse_size("1024X768"), Ok((1024, 768)));
        assert!(parse_size("64").is_err());
        assert!(parse_size("64xq").is_err());
    }
}
