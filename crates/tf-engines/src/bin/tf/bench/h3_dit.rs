//! `tf bench h3-dit`: one whole MiniMax H3 DiT step on the GPU, eager and graph replay, beside the diffusers
//! eager and torch.compile times of the same run (`reference.json` of `tests/python/h3_dit_reference.py`).
//!
//! The model is either the full default config (33.1B) with random weights made on the device from a seed
//! (`--random-weights`, no file: the figures are speed only) or a diffusers folder (`--model`). The inputs are the
//! text-to-video layout of the geometry (`--width`, `--height`, `--frames`, `--text-rows`; 768x448, 56 frames and
//! 128 text rows give S = 6026; `--canvas-default` is the pipeline's default canvas, 1344x768 for 5 s, S = 37838)
//! from the layout builder, with the video and audio timesteps of one step of the pipeline's grids and seeded
//! noise rows. Times are device times of the engine's step timer after a warm-up.
//!
//! `--precision` picks the DiT's GEMM precision (bf16, or FP8 in chosen block groups; a seeded FP8 model is made
//! in bf16 one matrix at a time and quantized on the device); the output names it and the resident weight bytes.
//!
//! The timers are benchmark-only library code behind tf-engines' `bench` feature; without it this command says
//! how to rebuild.

#[cfg(any(feature = "bench", test))]
use std::path::Path;
#[cfg(feature = "bench")]
use std::time::Instant;

#[cfg(any(feature = "bench", test))]
use tf_engines::minimax_h3::config::MiniMaxH3Config;
#[cfg(feature = "bench")]
use tf_engines::minimax_h3::dit::H3DitBackend;
#[cfg(any(feature = "bench", test))]
use tf_engines::minimax_h3::dit::H3Inputs;
#[cfg(feature = "bench")]
use tf_engines::minimax_h3::dit_gpu::GpuH3Dit;
#[cfg(any(feature = "bench", test))]
use tf_engines::minimax_h3::layout::{
    Geometry, LayoutRequest, PackedLayout, SizeRules, StepTimesteps, TEXT_TAG,
};
#[cfg(any(feature = "bench", test))]
use tf_engines::minimax_h3::scheduler::{H3Schedule, H3SchedulerConfig};
#[cfg(feature = "bench")]
use tf_engines::nn::gpu::GpuDevice;
#[cfg(any(feature = "bench", test))]
use tf_engines::nn::sampling::scheduler::Scheduler;
#[cfg(any(feature = "bench", test))]
use tf_engines::nn::tensor::TensorF32;
#[cfg(feature = "bench")]
use tf_engines::nn::weights::ModelDir;

use super::{BoxError, H3DitArgs};

#[cfg(any(feature = "bench", test))]
/// The pipeline's default canvas: 1344 wide, 768 high (`resolve_canvas_size(16, 9)`), 5 s at 24 fps snapped up
/// to 124 frames.
pub const CANVAS_DEFAULT: (usize, usize, usize) = (1344, 768, 124);

#[cfg(any(feature = "bench", test))]
/// The geometry of a run: `(width, height, frames)`.
pub fn geometry(args: &H3DitArgs) -> (usize, usize, usize) {
    if args.canvas_default {
        CANVAS_DEFAULT
    } else {
        (args.width, args.height, args.frames)
    }
}

#[cfg(any(feature = "bench", test))]
/// The case name `WIDTHxHEIGHT_FRAMESf_TEXTt` both this command and the reference script use.
pub fn case_name(width: usize, height: usize, frames: usize, text_rows: usize) -> String {
    format!("{width}x{height}_{frames}f_{text_rows}t")
}

#[cfg(any(feature = "bench", test))]
/// Matmul and attention FLOPs of one step: the blocks over all `seq` rows, the refiner over the text rows (the
/// figure the reference script reports too).
pub fn step_flops(
    hidden: usize,
    inner: usize,
    ffn: usize,
    layers: usize,
    refiner_layers: usize,
    seq: usize,
    text_rows: usize,
) -> f64 {
    let (h, i, f) = (hidden as f64, inner as f64, ffn as f64);
    let per_row = 2.0 * (4.0 * h * i + 3.0 * h * f);
    let rows = |n: usize, l: usize| {
        let n = n as f64;
        l as f64 * (n * per_row + 4.0 * n * n * i)
    };
    rows(seq, layers) + rows(text_rows, refiner_layers)
}

#[cfg(any(feature = "bench", test))]
/// Seeded normal-ish noise (sum of four uniforms, unit variance), f32.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| (next() + next() + next() + next() - 2.0) * 1.732)
        .collect()
}

#[cfg(any(feature = "bench", test))]
#[derive(Debug)]
/// One step of the pipeline at the run's geometry: its inputs over the text-to-video layout, and the request
/// around it.
struct StepCase {
    inputs: H3Inputs,
    /// The layout's rows.
    seq: usize,
    /// Every timestep value of the request's steps (step by step, repeats kept): what a request hands the DiT.
    schedule: Vec<f32>,
    /// Steps of the request.
    steps: usize,
}

#[cfg(any(feature = "bench", test))]
fn inputs(args: &H3DitArgs, config: &MiniMaxH3Config) -> Result<StepCase, BoxError> {
    let (width, height, frames) = geometry(args);
    let geometry = Geometry::for_request(height, width, frames, &SizeRules::TRANSFORMER)?;
    if geometry.num_frames != frames {
        return Err(format!(
            "{frames} frames is not of the form 17n+5 (the next one is {}); the reference names its cases by the \
             exact count",
            geometry.num_frames
        )
        .into());
    }
    let tags = vec![TEXT_TAG; args.text_rows];
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &tags,
        geometry,
        patch: config.patch_size,
        keyframes: &[],
    })?;
    let video = H3Schedule::from_points(&H3SchedulerConfig::video(), args.grid_points)?;
    let audio = H3Schedule::from_points(&H3SchedulerConfig::audio(), args.grid_points)?;
    let at = |s: &H3Schedule| {
        s.timesteps().get(args.step).copied().ok_or_else(|| {
            format!(
                "--step {} is outside the {} steps of a {}-point grid",
                args.step,
                s.timesteps().len(),
                args.grid_points
            )
        })
    };
    let t = layout.row_timesteps(StepTimesteps::pipeline(at(&video)?, at(&audio)?))?;
    let mut schedule = Vec::new();
    for (&v, &a) in video.timesteps().iter().zip(audio.timesteps()) {
        schedule.extend(layout.row_timesteps(StepTimesteps::pipeline(v, a))?.unique);
    }
    let (nv, na) = (layout.video_indices.len(), layout.audio_indices.len());
    let (vp, ac, td) = (
        config.video_patch_dim(),
        config.audio_in_channels,
        config.text_dim,
    );
    let inputs = H3Inputs::from_layout(
        &layout,
        &t,
        TensorF32::new(vec![1, nv, vp], noise(nv * vp, 1))?,
        TensorF32::new(vec![1, na, ac], noise(na * ac, 2))?,
        TensorF32::new(vec![1, args.text_rows, td], noise(args.text_rows * td, 3))?,
    )?;
    Ok(StepCase {
        inputs,
        seq: layout.seq_len,
        schedule,
        steps: video.timesteps().len(),
    })
}

#[cfg(any(feature = "bench", test))]
/// The case named `name` in reference.json, with the file's speed section (how its model was made).
fn reference_case(
    path: &Path,
    name: &str,
) -> Result<(serde_json::Value, serde_json::Value), BoxError> {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let case = summary
        .get("cases")
        .and_then(|c| c.as_array())
        .and_then(|cases| {
            cases
                .iter()
                .find(|c| c.get("name").and_then(|n| n.as_str()) == Some(name))
        })
        .cloned()
        .ok_or_else(|| format!("{}: no case named {name}", path.display()))?;
    let speed = summary
        .get("speed")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    Ok((case, speed))
}

#[cfg(feature = "bench")]
fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

#[cfg(feature = "bench")]
pub fn run(args: &H3DitArgs) -> Result<(), BoxError> {
    let device = GpuDevice::open()?;
    let ctx = device.context();
    let info = ctx.device_info()?;
    println!("device: {info:?}");
    super::print_kernel_env();
    let before = tf_cuda::usage();
    let load_start = Instant::now();
    let (mut dit, weights) = match (&args.model, args.random_weights) {
        (Some(dir), false) => {
            let model = ModelDir::open(dir)?;
            (
                GpuH3Dit::load_in(
                    &device,
                    &model,
                    tf_engines::minimax_h3::dit_host::LoadOptions::default(),
                    tf_engines::nn::upload::StagingConfig::default(),
                    args.precision,
                )?,
                format!("loaded from {}", dir.display()),
            )
        }
        (None, true) => {
            let config = MiniMaxH3Config::default_full_size();
            (
                GpuH3Dit::random_in(&device, &config, args.seed, args.precision)?,
                format!(
                    "RANDOM, made on the device from seed {} (full default config; speed figures only)",
                    args.seed
                ),
            )
        }
        _ => return Err("give exactly one of --model DIR and --random-weights".into()),
    };
    let load_s = load_start.elapsed().as_secs_f64();
    let config = dit.config().clone();
    let weight_bytes = dit.weight_bytes();
    let precision = dit.describe_precision();
    println!(
        "weights: {weights}; {} blocks, {} refiner blocks, {:.2} GiB resident on the device ({:.2} GB), ready in \
         {load_s:.1} s",
        config.num_layers,
        config.num_refiner_layers,
        gib(weight_bytes as f64),
        weight_bytes as f64 / 1e9
    );
    // `fp8` as typed is H3's default FP8 mode: report the groups it resolved to.
    let resolved = dit.precision();
    println!("precision: {resolved} ({precision})");
    dit.set_graphs(true);

    let (width, height, frames) = geometry(args);
    let name = case_name(width, height, frames, args.text_rows);
    let StepCase {
        inputs,
        seq,
        schedule,
        steps,
    } = inputs(args, &config)?;
    let flops = step_flops(
        config.hidden_size,
        config.num_attention_heads * config.attention_head_dim,
        config.ffn_dim,
        config.num_layers,
        config.num_refiner_layers,
        seq,
        args.text_rows,
    );
    println!(
        "\n== MiniMax H3 DiT step, {name}: S = {seq} ({} text rows), timesteps {:?}; {} warm-up + {} timed steps",
        args.text_rows,
        inputs.timestep.data(),
        args.warmup,
        args.iters
    );
    tf_cuda::usage::reset_peaks();
    let times = dit.time_step(&inputs, args.warmup, args.iters)?;
    let tflops = |ms: f64| flops / (ms * 1e-3) / 1e12;
    println!(
        "  ours ({}): eager {:.2} ms ({:.1} TFLOP/s), graph replay {:.2} ms ({:.1} TFLOP/s)",
        resolved,
        times.eager_ms,
        tflops(times.eager_ms),
        times.graph_ms,
        tflops(times.graph_ms)
    );
    // The same step as a request runs it: the tables of its whole schedule made once, every step without them.
    let on_schedule = dit.time_step_on_schedule(&inputs, &schedule, args.warmup, args.iters)?;
    let per_step_tables = on_schedule.tables_ms / steps.max(1) as f64;
    let scheduled_ms = on_schedule.body_graph_ms + per_step_tables;
    println!(
        "  ours on the request's schedule ({} timestep values, {steps} steps): tables {:.2} ms once a request \
         ({per_step_tables:.2} ms a step), the step without them eager {:.2} ms, graph replay {:.2} ms; \
         per step with the tables spread: {scheduled_ms:.2} ms ({:.1} TFLOP/s)",
        on_schedule.timesteps,
        on_schedule.tables_ms,
        on_schedule.body_eager_ms,
        on_schedule.body_graph_ms,
        tflops(scheduled_ms)
    );
    // The goal of the speed issues at S = 6026: 420 ms in bf16, 300 ms in the 8-bit mode.
    let goal_ms = (seq == 6026).then(|| {
        if resolved.uses_fp8(config.num_layers) {
            300.0
        } else {
            420.0
        }
    });
    let energy = super::report_energy(ctx, times.graph_ms, goal_ms, |n| {
        Ok(dit.time_graph(&inputs, n)?)
    })?;
    let mut phases = serde_json::Value::Null;
    if args.phases {
        phases = super::report_phases("step", &dit.time_phases(&inputs)?);
    }
    let usage = tf_cuda::usage();
    let buffers_peak = usage.device_peak.saturating_sub(before.device);
    let memory = ctx.memory_info()?;
    let used = memory.total.saturating_sub(memory.free);
    println!(
        "  ours: peak device memory {:.2} GiB (the engine's figure, weights included); device buffers peak {:.2} GiB; \
         {:.2} GiB of the GPU in use after the step",
        gib(times.peak_device_bytes as f64),
        gib(buffers_peak as f64),
        gib(used as f64)
    );

    let mut reference = serde_json::Value::Null;
    if let Some(path) = &args.reference {
        match reference_case(path, &name) {
            Ok((case, speed)) => {
                if let Some(how) = speed.get("weights").and_then(|w| w.as_str()) {
                    println!("  diffusers weights: {how}");
                }
                let get = |k: &str| case.get(k).and_then(|v| v.as_f64());
                if get("seq_len").is_some_and(|s| s as usize != seq) {
                    println!(
                        "  reference: {name} has S = {:?}, ours {seq}: the figures are not comparable",
                        get("seq_len")
                    );
                }
                let compiled = format!(
                    "diffusers torch.compile ({}, mode {})",
                    case.get("compile_scope")
                        .and_then(|v| v.as_str())
                        .unwrap_or("?"),
                    case.get("compile_mode")
                        .and_then(|v| v.as_str())
                        .unwrap_or("?")
                );
                for (label, key) in [
                    ("diffusers eager", "eager_ms"),
                    (compiled.as_str(), "compiled_ms"),
                ] {
                    match get(key) {
                        Some(ms) => println!(
                            "  {label}: {ms:.2} ms ({:.1} TFLOP/s); ours graph / theirs = {:.3}, ours eager / theirs = {:.3}, \
                             ours on the schedule / theirs = {:.3} (< 1 means ours is faster)",
                            tflops(ms),
                            times.graph_ms / ms,
                            times.eager_ms / ms,
                            scheduled_ms / ms
                        ),
                        None => println!(
                            "  {label}: not in {} ({key} absent{})",
                            path.display(),
                            case.get("compile_error")
                                .filter(|_| key == "compiled_ms")
                                .map_or(String::new(), |e| format!(": {e}"))
                        ),
                    }
                }
                for key in ["eager_peak_allocated_bytes", "eager_peak_reserved_bytes"] {
                    if let Some(bytes) = get(key) {
                        println!(
                            "  diffusers {}: {:.2} GiB; ours / theirs = {:.3}",
                            key.trim_end_matches("_bytes").replace('_', " "),
                            gib(bytes),
                            times.peak_device_bytes as f64 / bytes
                        );
                    }
                }
                super::report_reference_energy(
                    &energy,
                    &case,
                    &[
                        ("diffusers eager energy", "eager_j"),
                        ("diffusers torch.compile energy", "compiled_j"),
                    ],
                );
                reference = case;
            }
            Err(e) => println!("  reference: {e}"),
        }
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "case": name,
            "device": super::device_json(&info),
            "kernel_env": super::kernel_env(),
            "width": width,
            "height": height,
            "frames": frames,
            "text_rows": args.text_rows,
            "seq_len": seq,
            "timesteps": inputs.timestep.data(),
            "weights": weights,
            "random_weights": args.random_weights,
            "num_layers": config.num_layers,
            "num_refiner_layers": config.num_refiner_layers,
            "precision": resolved.to_string(),
            "precision_description": precision,
            "weight_bytes": weight_bytes,
            "resident_weight_bytes": weight_bytes,
            "load_s": load_s,
            "flops": flops,
            "warmup": args.warmup,
            "iters": args.iters,
            "eager_ms": times.eager_ms,
            "graph_ms": times.graph_ms,
            "eager_tflops": tflops(times.eager_ms),
            "graph_tflops": tflops(times.graph_ms),
            "peak_device_bytes": times.peak_device_bytes,
            "device_buffers_peak_bytes": buffers_peak,
            "device_used_after_bytes": used,
            "schedule": {
                "timesteps": on_schedule.timesteps,
                "steps": steps,
                "tables_ms": on_schedule.tables_ms,
                "step_eager_ms": on_schedule.body_eager_ms,
                "step_graph_ms": on_schedule.body_graph_ms,
                "step_with_tables_spread_ms": scheduled_ms,
            },
            "phases": phases,
            "energy_graph_step": energy,
            "reference": reference,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Without the `bench` feature the timers are not compiled in: says how to get them.
#[cfg(not(feature = "bench"))]
pub fn run(_args: &H3DitArgs) -> Result<(), BoxError> {
    Err("`tf bench h3-dit` needs the step timers: rebuild with `cargo build -p tf-engines --bin tf --features bench`".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_flops_match_the_published_count() {
        // 768x448, 56 frames, 128 text rows at the release size: 284.5 TFLOP per step (blocks and refiner).
        let f = step_flops(5376, 7168, 14336, 50, 2, 6026, 128);
        assert!((f / 1e12 - 284.5).abs() < 0.5, "{}", f / 1e12);
        // One block's linear work per row is 770.7 MFLOP.
        let per_row = step_flops(5376, 7168, 14336, 1, 0, 1, 0) - 4.0 * 7168.0;
        assert!((per_row / 1e6 - 770.7).abs() < 0.1, "{per_row}");
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: H3DitArgs,
    }

    fn args(extra: &[&str]) -> H3DitArgs {
        use clap::Parser;
        let argv = ["h3-dit", "--random-weights"].iter().chain(extra);
        Cli::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn inputs_are_the_reference_layout_at_both_geometries() {
        use tf_engines::minimax_h3::dit::H3Rows;
        let config = MiniMaxH3Config::default_full_size();
        let StepCase {
            inputs: small,
            seq,
            schedule,
            steps,
        } = inputs(&args(&[]), &config).unwrap();
        // The request's schedule: the video and audio values of all 49 steps, the bench step's among them.
        assert_eq!(steps, 49);
        let mut distinct: Vec<u32> = schedule.iter().map(|t| t.to_bits()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(
            (steps..=2 * steps).contains(&schedule.len()),
            "{}",
            schedule.len()
        );
        assert!(distinct.len() <= tf_engines::minimax_h3::dit_gpu::MAX_SCHEDULE_TIMESTEPS);
        for t in small.timestep.data() {
            assert!(distinct.contains(&t.to_bits()), "{t} not in the schedule");
        }
        assert_eq!(seq, 6026);
        let rows = H3Rows::build(&config, &small).unwrap();
        assert_eq!(
            (
                rows.video_rows.len(),
                rows.audio_rows.len(),
                rows.text_rows.len()
            ),
            (5712, 186, 128)
        );
        // Step 30 of the 50-point grids, as tests/python/h3_dit_reference.py takes them (MiniMaxH3Scheduler with
        // shift 12 and 3): 0.116279125 (video) and 0.34482765 (audio), bit for bit.
        let bits: Vec<u32> = small.timestep.data().iter().map(|t| t.to_bits()).collect();
        assert_eq!(bits, [1039016896, 1051757888]);
        let StepCase {
            inputs: canvas,
            seq,
            ..
        } = inputs(&args(&["--canvas-default"]), &config).unwrap();
        assert_eq!(seq, 37838);
        assert_eq!(canvas.hidden_states.shape(), [1, 37 * 24 * 42, 96]);
        assert!(inputs(&args(&["--frames", "60"]), &config)
            .unwrap_err()
            .to_string()
            .contains("17n+5"));
        assert!(inputs(&args(&["--step", "49"]), &config).is_err());
    }

    #[test]
    fn reference_cases_are_found_by_name() {
        let dir = std::env::temp_dir().join(format!("tf-h3-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("reference.json");
        let json = serde_json::json!({
            "speed": {"weights": "random"},
            "cases": [{"name": "768x448_56f_128t", "eager_ms": 2.5}, {"name": "1344x768_124f_128t"}],
        });
        std::fs::write(&path, json.to_string()).unwrap();
        let (case, speed) = reference_case(&path, "768x448_56f_128t").unwrap();
        assert_eq!(case["eager_ms"], 2.5);
        assert_eq!(speed["weights"], "random");
        let err = reference_case(&path, "64x64_22f_8t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no case named 64x64_22f_8t"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn case_names_match_the_reference_script() {
        assert_eq!(case_name(768, 448, 56, 128), "768x448_56f_128t");
        let (w, h, f) = CANVAS_DEFAULT;
        assert_eq!(case_name(w, h, f, 128), "1344x768_124f_128t");
    }
}
