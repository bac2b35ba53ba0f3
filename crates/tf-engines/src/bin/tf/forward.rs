//! `tf forward`: one Qwen-Image 2.1 DiT forward from an input bundle, or one MiniMax H3 DiT forward when the
//! folder's `config.json` names `MiniMaxH3Transformer3DModel` (host reference or GPU; outputs `sample` and
//! `audio_sample`).
//!
//! The bundle holds the diffusers forward arguments by name (`hidden_states`, `encoder_hidden_states`,
//! `timestep`, `img_mask`, optional `encoder_hidden_states_mask`, `img_shapes`); the output file gets `sample`.
//! The prefix KV cache crosses invocations through `--kv-file`: `--kv-cache extract` writes it (safetensors,
//! `kv.{layer}.k` / `kv.{layer}.v`, f32 `[B, prefix, heads, head_dim]`), `--kv-cache cached` reads it.
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use tf_engines::minimax_h3::dit::{H3DitBackend, H3Error, H3Inputs};
use tf_engines::minimax_h3::dit_gpu::GpuH3Dit;
use tf_engines::nn::tensor::TensorF32;
use tf_engines::nn::weights::{write_safetensors, AnyTensor, ModelDir, SafetensorsFile};
use tf_engines::qwen_image::dit::{DitBackend, DitError, DitInputs, HostKvCache, KvMode, KvStep};
use tf_engines::qwen_image::dit_gpu::{DitPrecision, GpuDit};
use tf_engines::qwen_image::dit_host::HostDit;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The f32 host reference.
    Host,
    /// The GPU engine.
    Gpu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheArg {
    /// No cache: the whole joint sequence.
    None,
    /// Run the whole sequence and write the prefix K/V to --kv-file.
    Extract,
    /// Run only the target rows against the prefix K/V read from --kv-file.
    Cached,
}

#[derive(clap::Args)]
pub struct Args {
    /// Diffusers transformer folder (config.json + safetensors, single or sharded).
    #[arg(long)]
    model: PathBuf,
    /// Input bundle (safetensors) with the forward arguments.
    #[arg(long)]
    inputs: PathBuf,
    /// Output safetensors file; receives `sample`.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, value_enum, default_value = "host")]
    backend: Backend,
    #[arg(long = "kv-cache", value_enum, default_value = "none")]
    kv_cache: KvCacheArg,
    /// KV cache file: written by --kv-cache extract, read by --kv-cache cached.
    #[arg(long = "kv-file")]
    kv_file: Option<PathBuf>,
    /// GEMM precision of the GPU DiT (Qwen-Image or MiniMax H3): bf16, fp8, or fp8:GROUP[,GROUP...][,ends=N][,accum=fast|exact][,attn=bf16|int8-fp8][,gemm=e4m3|int8]
    /// (docs/ENGINES.md).
    #[arg(long, default_value = "bf16")]
    precision: DitPrecision,
}

pub fn run(args: Args) -> ExitCode {
    match forward(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tf forward: {e}");
            ExitCode::FAILURE
        }
    }
}

fn kv_file(args: &Args) -> Result<&Path, DitError> {
    args.kv_file.as_deref().ok_or_else(|| {
        DitError::KvCache(
            "--kv-cache extract/cached needs --kv-file FILE (written by extract, read by cached)"
                .into(),
        )
    })
}

/// Time `tf forward` may spend timing GEMM algorithms the plan cache does not hold yet.
const GEMM_BUDGET: std::time::Duration = std::time::Duration::from_secs(3);

fn forward(args: &Args) -> Result<(), DitError> {
    let started = Instant::now();
    let model = ModelDir::open(&args.model)?;
    if args.backend == Backend::Host && args.precision != DitPrecision::Bf16 {
        return Err(DitError::Backend(format!(
            "--precision {} runs on the GPU only (--backend gpu); the host reference computes in f32",
            args.precision
        )));
    }
    if tf_engines::minimax_h3::config::names_this_class(model.config_json()) {
        return forward_minimax_h3(args, &model);
    }
    if args.backend == Backend::Host && args.precision != DitPrecision::Bf16 {
        return Err(DitError::Backend(format!(
            "--precision {} runs on the GPU only (--backend gpu); the host reference computes in f32",
            args.precision
        )));
    }
    let inputs = DitInputs::from_bundle(&SafetensorsFile::open(&args.inputs)?)?;
    let output = match args.backend {
        Backend::Host => {
            let mut dit = HostDit::load(&model)?;
            eprintln!(
                "tf forward: loaded {} ({})",
                args.model.display(),
                dit.load_stats()
            );
            run_backend(&mut dit, &inputs, args)?
        }
        Backend::Gpu => {
            let mut dit = GpuDit::load_with(&model, args.precision)?;
            eprintln!(
                "tf forward: loaded {} on the GPU ({})",
                args.model.display(),
                dit.load_stats()
            );
            // Plan this step's GEMMs before it runs (reusing the persistent plan cache), never inside it.
            let mode = match args.kv_cache {
                KvCacheArg::None => KvMode::None,
                KvCacheArg::Extract => KvMode::Extract,
                KvCacheArg::Cached => KvMode::Cached,
            };
            let report = dit.prepare_gemms(&[(&inputs, mode)], GEMM_BUDGET)?;
            eprintln!(
                "tf forward: {} GEMM shapes planned ({} from the plan cache, {} timed, {} heuristic)",
                report.shapes, report.stored, report.timed, report.heuristic
            );
            run_backend(&mut dit, &inputs, args)?
        }
    };
    write_safetensors(&args.out, &[("sample", AnyTensor::F32(&output.0))])?;
    eprintln!(
        "tf forward: sample {:?} -> {} (forward {:.3} s, total {:.3} s)",
        output.0.shape(),
        args.out.display(),
        output.1,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A MiniMax H3 folder: the host reference or the GPU backend on the bundle's forward arguments (by name),
/// `sample` and `audio_sample` written to --out.
fn forward_minimax_h3(args: &Args, model: &ModelDir) -> Result<(), DitError> {
    if args.kv_cache != KvCacheArg::None {
        return Err(DitError::Backend(
            "MiniMax H3 has no prefix KV cache: run it with --kv-cache none".into(),
        ));
    }
    let h3 = |e: H3Error| DitError::Backend(format!("MiniMax H3: {e}"));
    if args.backend == Backend::Host {
        let report =
            tf_engines::minimax_h3::dit_host::forward_files(model, &args.inputs, &args.out)
                .map_err(h3)?;
        eprintln!(
            "tf forward: MiniMax H3 {} ({:?} layout, {}): sample {:?}, audio_sample {:?} -> {} (forward {:.3} s)",
            args.model.display(),
            report.layout,
            report.load,
            report.sample_shape,
            report.audio_sample_shape,
            args.out.display(),
            report.forward_seconds
        );
        return Ok(());
    }
    // The model is named in every GPU failure, so a driverless machine's refusal says what it was asked to run.
    let h3_gpu = |why: String| DitError::Backend(format!("MiniMax H3 on the GPU: {why}"));
    let device = tf_engines::nn::gpu::GpuDevice::open().map_err(|e| {
        h3_gpu(format!(
            "opening the CUDA driver, a context on device 0 and its stream: {e}"
        ))
    })?;
    let mut dit = GpuH3Dit::load_in(
        &device,
        model,
        tf_engines::minimax_h3::dit_host::LoadOptions::default(),
        tf_engines::nn::upload::StagingConfig::default(),
        args.precision,
    )
    .map_err(h3)?;
    eprintln!(
        "tf forward: loaded MiniMax H3 {} on the GPU ({:?} layout, {}; precision {}; {:.3} GB resident)",
        args.model.display(),
        dit.checkpoint_layout(),
        dit.upload_stats()
            .map_or_else(|| "no upload".to_string(), |s| s.to_string()),
        dit.describe_precision(),
        dit.weight_bytes() as f64 / 1e9
    );
    let inputs = H3Inputs::from_bundle(&SafetensorsFile::open(&args.inputs)?).map_err(h3)?;
    // Plan this step's GEMMs before it runs (reusing the persistent plan cache), never inside it.
    let report = dit.prepare_gemms(&[&inputs], GEMM_BUDGET).map_err(h3)?;
    eprintln!(
        "tf forward: {} GEMM shapes planned ({} from the plan cache, {} timed, {} heuristic)",
        report.shapes, report.stored, report.timed, report.heuristic
    );
    let start = Instant::now();
    let output = dit.forward(&inputs).map_err(h3)?;
    let seconds = start.elapsed().as_secs_f64();
    write_safetensors(
        &args.out,
        &[
            ("sample", AnyTensor::F32(&output.sample)),
            ("audio_sample", AnyTensor::F32(&output.audio_sample)),
        ],
    )?;
    eprintln!(
        "tf forward: MiniMax H3 sample {:?}, audio_sample {:?} -> {} (forward {seconds:.3} s)",
        output.sample.shape(),
        output.audio_sample.shape(),
        args.out.display()
    );
    Ok(())
}

/// One forward on any backend, with the KV cache crossing invocations through --kv-file; returns the sample
/// and the forward's seconds.
fn run_backend<B: DitBackend>(
    dit: &mut B,
    inputs: &DitInputs,
    args: &Args,
) -> Result<(TensorF32, f64), DitError> {
    let forward_start = Instant::now();
    let output = match args.kv_cache {
        KvCacheArg::None => dit.forward(inputs, KvStep::None)?,
        KvCacheArg::Extract => {
            let path = kv_file(args)?;
            let output = dit.forward(inputs, KvStep::Extract)?;
            let cache = output
                .kv_cache
                .as_ref()
                .ok_or_else(|| DitError::Backend("extract returned no cache".into()))?;
            dit.kv_to_host(cache)?.save(path)?;
            eprintln!(
                "tf forward: wrote the prefix KV cache to {}",
                path.display()
            );
            output
        }
        KvCacheArg::Cached => {
            let host = HostKvCache::load(kv_file(args)?)?;
            let cache = dit.kv_from_host(host)?;
            dit.forward(inputs, KvStep::Cached(&cache))?
        }
    };
    Ok((output.sample, forward_start.elapsed().as_secs_f64()))
}
