//! `tf worker`: serves one engine over LocalRouter's worker protocol (JSON lines on stdin/stdout, logs on
//! stderr; docs/WORKER.md).
//!
//! Exit codes: 0 after `exit` or end of input; 1 when stdin/stdout fail (the parent is gone); 2 for bad
//! arguments; 3 after a lost GPU context; 4 after an engine panic. The process dies with its parent
//! (PR_SET_PDEATHSIG on Linux), so an orphan never keeps GPU memory.

use std::io::{self, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;

use tf_engines::minimax_h3::pipeline::{Backend, LoadOptions};
use tf_engines::nn::precision::DitPrecision;
use tf_engines::worker::log_line;
use tf_engines::worker::minimax_h3::MiniMaxH3Engine;
use tf_engines::worker::qwen::{self, QwenImageEngine};
use tf_engines::worker::testpattern::TestPattern;
use tf_engines::worker::{Worker, WorkerEngine, WorkerLimits};

/// A stderr line that ignores a closed pipe (`eprintln!` panics on EPIPE, and the parent may have closed it).
macro_rules! say {
    ($($arg:tt)*) => {
        log_line(format_args!($($arg)*))
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineName {
    /// Qwen-Image 2.1 from a diffusers-format model folder (`--model`).
    #[value(name = "qwen_image")]
    QwenImage,
    /// MiniMax H3 (text to video with stereo audio) from a diffusers-format model folder (`--model`).
    #[value(name = "minimax_h3")]
    MinimaxH3,
    /// Deterministic CPU test pattern: no model, no GPU (protocol and set-up checks).
    Testpattern,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// The GPU when a CUDA driver and device are present, else the host reference.
    Auto,
    /// The host (CPU) reference.
    Host,
    /// The GPU (device 0).
    Gpu,
}

#[derive(clap::Args)]
pub struct Args {
    /// Which engine to serve.
    #[arg(long, value_enum)]
    pub engine: EngineName,
    /// The model folder (diffusers layout) for engines that need one.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Where the engine runs.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendChoice,
    /// Largest image side accepted, in pixels.
    #[arg(long, default_value_t = 2048)]
    pub max_side: u32,
    /// GEMM precision of the engine's GPU DiT (qwen_image or minimax_h3): bf16, fp8, or
    /// fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8] (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    pub precision: DitPrecision,
    /// minimax_h3 on the GPU, timing only: make the text encoder's and the DiT's weights on the device from this
    /// seed instead of reading them (their folders need only config.json); every video shows nothing.
    #[arg(long = "random-weights", value_name = "SEED")]
    pub random_weights: Option<u32>,
    /// Cap the memory plan's budget (40GiB, 512MiB, ...): the GPU plans against the smaller of this and its free
    /// memory less a reserve, the host against this alone. Below the components' sum, every request loads, runs
    /// and frees them in turn (and its log says how long the loads took).
    #[arg(long = "device-budget", value_parser = crate::parse_budget)]
    pub device_budget: Option<u64>,
    #[command(flatten)]
    pub gpu: super::ranks::GpuArgs,
}

pub fn run(args: Args) -> ExitCode {
    die_with_parent();
    if args.random_weights.is_some() && args.engine != EngineName::MinimaxH3 {
        say!(
            "tf worker: --random-weights makes MiniMax H3's text-encoder and DiT weights on the GPU; {:?} reads its \
             weights from --model",
            args.engine
        );
        return ExitCode::from(2);
    }
    if (args.gpu.gpus > 1 || args.gpu.force_nccl) && args.engine != EngineName::MinimaxH3 {
        say!(
            "tf worker: --gpus {} spreads the MiniMax H3 DiT over GPUs; {:?} runs in one process",
            args.gpu.gpus,
            args.engine
        );
        return ExitCode::from(2);
    }
    let limits = WorkerLimits {
        max_side: args.max_side,
        ..WorkerLimits::default()
    };
    let engine: Box<dyn WorkerEngine> = match args.engine {
        EngineName::Testpattern => Box::new(TestPattern::default()),
        EngineName::QwenImage => {
            let Some(model) = args.model else {
                say!("tf worker: --engine qwen_image needs --model DIR (a diffusers-format Qwen-Image folder)");
                return ExitCode::from(2);
            };
            match qwen_engine(model, args.backend, args.precision, args.device_budget) {
                Ok(e) => e,
                Err(message) => {
                    say!("tf worker: {message}");
                    return ExitCode::from(2);
                }
            }
        }
        EngineName::MinimaxH3 => {
            let Some(model) = args.model else {
                say!("tf worker: --engine minimax_h3 needs --model DIR (a diffusers-format MiniMax H3 folder)");
                return ExitCode::from(2);
            };
            if !model.is_dir() {
                say!(
                    "tf worker: --model {} is not a folder; give the diffusers-format MiniMax H3 folder \
                     (modular_model_index.json, transformer/, text_encoder/, vae/, audio_vae/, ...)",
                    model.display()
                );
                return ExitCode::from(2);
            }
            let backend = backend_choice(args.backend);
            let options = LoadOptions {
                dit_precision: args.precision,
                random_weights: args.random_weights,
                device_budget: args.device_budget,
                ..LoadOptions::new(Backend::Host)
            };
            if let Some(seed) = args.random_weights {
                say!(
                    "tf worker: RANDOM text-encoder and DiT weights made on the device from seed {seed} (timing \
                     only; every video shows nothing)"
                );
            }
            // One GPU, or this process's rank of a `--gpus N` worker (rank 0 starts the others here).
            let mut options = options;
            let host = args.backend == BackendChoice::Host;
            match super::ranks::begin_worker(&args.gpu, &model, host, &format!("{options:?}")) {
                Ok(parallel) => options.sequence_parallel = parallel,
                Err(message) => {
                    say!("tf worker: {message}");
                    let _ = super::ranks::end(Err(message));
                    return ExitCode::from(2);
                }
            }
            let ranked = options.sequence_parallel.is_some();
            let engine = MiniMaxH3Engine::with_options(model, backend, options);
            if ranked {
                // Every rank confirms its load before rank 0 answers the load request.
                Box::new(engine.with_load_barrier(super::ranks::ready))
            } else {
                Box::new(engine)
            }
        }
    };
    say!(
        "tf worker: serving {:?} (pid {}); waiting for JSON lines on stdin",
        args.engine,
        std::process::id()
    );
    let mut worker = Worker::new(engine, limits);
    let stdin = io::stdin().lock();
    let stdout = BufWriter::new(io::stdout().lock());
    // A child rank of a multi-GPU worker reads the lines rank 0 forwards and answers nobody; rank 0 forwards every
    // line it reads. The job then ends on every rank (rank 0 waits for the others).
    let served = if super::ranks::is_child() {
        // Rank 0 holds the decoded frames and writes them; this rank's jobs write nothing.
        let mut worker = worker.without_files();
        worker.serve(stdin, io::sink())
    } else {
        worker.serve(super::ranks::tee_stdin(stdin), stdout)
    };
    if let Err(e) = super::ranks::end(Ok(())) {
        say!("tf worker: {e}");
    }
    match served {
        Ok(ending) => {
            say!("tf worker: {ending:?}; exiting with {}", ending.exit_code());
            ExitCode::from(ending.exit_code())
        }
        Err(e) => {
            say!("tf worker: stdin/stdout failed ({e}); the parent is gone, exiting");
            ExitCode::from(1)
        }
    }
}

fn qwen_engine(
    model: PathBuf,
    backend: BackendChoice,
    precision: DitPrecision,
    device_budget: Option<u64>,
) -> Result<Box<dyn WorkerEngine>, String> {
    if !model.is_dir() {
        return Err(format!(
            "--model {} is not a folder; give the diffusers-format Qwen-Image folder (model_index.json, transformer/, ...)",
            model.display()
        ));
    }
    Ok(Box::new(
        QwenImageEngine::new(model, backend_choice(backend))
            .with_dit_precision(precision)
            .with_device_budget(device_budget),
    ))
}

fn backend_choice(backend: BackendChoice) -> qwen::BackendChoice {
    match backend {
        BackendChoice::Auto => qwen::BackendChoice::Auto,
        BackendChoice::Host => qwen::BackendChoice::Host,
        BackendChoice::Gpu => qwen::BackendChoice::Gpu,
    }
}

/// Asks Linux to SIGKILL this process when its parent dies, then checks the parent is still the one that
/// started us (LOCALROUTER_PARENT, when set): a worker must never outlive the daemon holding GPU memory.
fn die_with_parent() {
    #[cfg(target_os = "linux")]
    {
        const PR_SET_PDEATHSIG: std::ffi::c_int = 1;
        const SIGKILL: std::ffi::c_ulong = 9;
        extern "C" {
            fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
        }
        // SAFETY: prctl(PR_SET_PDEATHSIG, sig) takes one unsigned long argument and touches no memory of ours.
        let rc = unsafe { prctl(PR_SET_PDEATHSIG, SIGKILL) };
        if rc != 0 {
            say!(
                "tf worker: could not ask to die with the parent: {}",
                io::Error::last_os_error()
            );
        }
    }
    // The parent may have died before prctl took effect; then we were re-parented.
    if let Some(expected) = std::env::var("LOCALROUTER_PARENT")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        .filter(|&p| p != 0)
    {
        let parent = std::os::unix::process::parent_id();
        if parent != expected {
            say!("tf worker: the parent {expected} is gone (now {parent}); exiting");
            std::process::exit(0);
        }
    }
}
