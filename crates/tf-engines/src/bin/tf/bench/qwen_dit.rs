//! `tf bench qwen-dit`: the whole DiT step at one image size on the GPU, eager and graph replay, beside the
//! diffusers timings of the same run.
//!
//! Inputs are synthetic with the text-to-image layout (`--text-rows` text rows, then the target image), seeded so
//! runs repeat. Times are device times between events around `--iters` steps after a warm-up step.
//!
//! The timers are benchmark-only library code behind tf-engines' `bench` feature; without it this command says
//! how to rebuild.

#[cfg(feature = "bench")]
use std::path::Path;

#[cfg(feature = "bench")]
use tf_cuda::cublaslt::AlgoSelection;
#[cfg(feature = "bench")]
use tf_engines::nn::gpu::AttentionTile;
#[cfg(feature = "bench")]
use tf_engines::nn::tensor::Tensor;
#[cfg(feature = "bench")]
use tf_engines::nn::weights::ModelDir;
#[cfg(feature = "bench")]
use tf_engines::qwen_image::dit::{DitBackend, DitInputs, KvStep};
#[cfg(feature = "bench")]
use tf_engines::qwen_image::dit_gpu::GpuDit;

use super::{BoxError, QwenDitArgs};

#[cfg(feature = "bench")]
/// Seeded normal-ish noise (sum of uniforms), f32.
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| (next() + next() + next() + next() - 2.0) * 1.7)
        .collect()
}

#[cfg(feature = "bench")]
fn inputs(
    args: &QwenDitArgs,
    in_ch: usize,
    ctx: usize,
    t: f32,
    seed: u64,
) -> Result<DitInputs, BoxError> {
    let (h, w) = (args.height / 16, args.width / 16);
    let n = h * w;
    if n == 0 || n % 4 != 0 {
        return Err(format!(
            "{}x{} gives {n} latent tokens; need a positive multiple of 4",
            args.width, args.height
        )
        .into());
    }
    let mut mask = vec![0u8; args.text_rows];
    mask.extend(std::iter::repeat_n(1u8, n / 4));
    Ok(DitInputs {
        hidden_states: Tensor::new(vec![1, n, in_ch], noise(n * in_ch, seed))?,
        encoder_hidden_states: Tensor::new(
            vec![1, args.text_rows, ctx],
            noise(args.text_rows * ctx, 7),
        )?,
        timestep: Tensor::new(vec![1], vec![t])?,
        img_mask: Tensor::new(vec![1, mask.len()], mask)?,
        encoder_hidden_states_mask: None,
        img_shapes: Tensor::new(vec![1, 1, 3], vec![1, h as i64, w as i64])?,
    })
}

#[cfg(feature = "bench")]
/// The diffusers timings of the case named `WxH` in reference.json.
fn reference_case(path: &Path, name: &str) -> Result<serde_json::Value, BoxError> {
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    summary
        .get("cases")
        .and_then(|c| c.as_array())
        .and_then(|cases| {
            cases
                .iter()
                .find(|c| c.get("name").and_then(|n| n.as_str()) == Some(name))
        })
        .cloned()
        .ok_or_else(|| format!("{}: no case named {name}", path.display()).into())
}

#[cfg(feature = "bench")]
/// Prints, per GEMM shape planned so far, how its algorithm was chosen and (when timed) the heuristic's first
/// candidate against the chosen one.
fn report_gemm_choices(dit: &GpuDit) -> serde_json::Value {
    println!("\n  GEMM plans (M x N x K: how chosen, heuristic-first ms -> chosen ms)");
    let mut rows = Vec::new();
    for choice in dit.gemm_plan_choices() {
        let k = &choice.key;
        let first = choice.heuristic_first_ms();
        let chosen = choice.chosen_ms();
        let gain = match (first, chosen) {
            (Some(f), Some(c)) if c > 0.0 => format!(" ({:+.1}%)", (f / c - 1.0) * 100.0),
            _ => String::new(),
        };
        println!(
            "  {:>5} x {:>5} x {:>5}: {:?}, candidate {} of {}: {} -> {}{gain}",
            k.m,
            k.n,
            k.k,
            choice.chosen_by,
            choice.chosen,
            choice.candidates,
            first.map_or("-".into(), |t| format!("{t:.3}")),
            chosen.map_or("-".into(), |t| format!("{t:.3}")),
        );
        rows.push(serde_json::json!({
            "m": k.m, "n": k.n, "k": k.k,
            "chosen_by": format!("{:?}", choice.chosen_by),
            "chosen": choice.chosen,
            "candidates": choice.candidates,
            "times_ms": choice.times_ms,
        }));
    }
    serde_json::Value::Array(rows)
}

#[cfg(feature = "bench")]
pub fn run(args: &QwenDitArgs) -> Result<(), BoxError> {
    let model = ModelDir::open(&args.model)?;
    let before = tf_cuda::usage();
    let mut dit = GpuDit::load_with(&model, args.precision)?;
    if args.gemm_selection == "heuristic" {
        dit.set_gemm_selection(AlgoSelection::Heuristic)?;
    }
    println!("GEMM algorithm selection: {:?}", args.gemm_selection);
    super::print_kernel_env();
    println!(
        "precision: {} ({})",
        args.precision,
        dit.precision().describe(dit.config().num_layers)
    );
    let load = dit.load_stats();
    println!("weights: {load}");
    let info = dit.context().device_info()?;
    println!("device: {info:?}");
    let (in_ch, ctx) = (dit.config().in_channels, dit.config().context_in_dim);
    let step0 = inputs(args, in_ch, ctx, 0.9, 1)?;
    let step1 = inputs(args, in_ch, ctx, 0.6, 2)?;
    let name = format!("{}x{}", args.width, args.height);
    let seq = args.text_rows + (args.width / 16) * (args.height / 16);
    println!(
        "\n== qwen-image DiT step, {name}: {} text rows + {} image tokens = {seq}, {} layers, {} timed steps",
        args.text_rows,
        seq - args.text_rows,
        dit.config().num_layers,
        args.iters
    );
    tf_cuda::usage::reset_peaks();
    let full = dit.time_step(&step0, KvStep::Extract, args.iters)?;
    println!(
        "  full step (extract): eager {:.2} ms, graph replay {:.2} ms",
        full.eager_ms, full.graph_ms
    );
    let cache = dit
        .forward(&step0, KvStep::Extract)?
        .kv_cache
        .ok_or("extract returned no cache")?;
    let cached = dit.time_step(&step1, KvStep::Cached(&cache), args.iters)?;
    println!(
        "  cached step: eager {:.2} ms, graph replay {:.2} ms (attention {:?})",
        cached.eager_ms,
        cached.graph_ms,
        dit.attention_tile()
    );
    let gemms = report_gemm_choices(&dit);
    // The other wgmma attention variants, for comparison; the default stays in use afterwards.
    let default_tile = dit.attention_tile();
    let mut other_tiles = Vec::new();
    // The wgmma tiles of this build (the plain and cp.async ones only with the `bench-kernels` feature).
    for tile in AttentionTile::ALL.into_iter().filter(|t| t.needs_sm90()) {
        if tile == default_tile || dit.set_attention_tile(tile).is_err() {
            continue;
        }
        let t = dit.time_step(&step1, KvStep::Cached(&cache), args.iters)?;
        println!(
            "  cached step with attention {tile:?}: eager {:.2} ms, graph replay {:.2} ms",
            t.eager_ms, t.graph_ms
        );
        other_tiles.push(serde_json::json!({"tile": format!("{tile:?}"), "eager_ms": t.eager_ms, "graph_ms": t.graph_ms}));
    }
    dit.set_attention_tile(default_tile)?;
    // The default again: the spread between the two is the machine's drift over the comparison.
    let again = dit.time_step(&step1, KvStep::Cached(&cache), args.iters)?;
    println!(
        "  cached step again with attention {default_tile:?}: eager {:.2} ms, graph replay {:.2} ms",
        again.eager_ms, again.graph_ms
    );
    other_tiles.push(serde_json::json!({"tile": format!("{default_tile:?} (again)"), "eager_ms": again.eager_ms, "graph_ms": again.graph_ms}));
    let mut phases = serde_json::Value::Null;
    if args.phases {
        let full_phases = dit.time_phases(&step0, KvStep::Extract)?;
        let cached_phases = dit.time_phases(&step1, KvStep::Cached(&cache))?;
        phases = serde_json::json!({
            "full": super::report_phases("full (extract) step", &full_phases),
            "cached": super::report_phases("cached step", &cached_phases),
        });
        println!();
    }
    let usage = tf_cuda::usage();
    let peak = usage.device_peak.saturating_sub(before.device);
    println!(
        "  device memory: peak {:.2} GiB (weights {:.2} GiB); weight load {:.2} GB/s",
        peak as f64 / (1u64 << 30) as f64,
        load.weight_bytes as f64 / (1u64 << 30) as f64,
        load.upload.source_gb_per_s()
    );
    // The cached-step goals of the speed issue: 100 ms in bf16, 60 ms with 8-bit GEMMs.
    let eight_bit = dit.precision().uses_fp8(dit.config().num_layers);
    let (goal_label, goal_ms) = if eight_bit {
        ("8-bit", 60.0)
    } else {
        ("bf16", 100.0)
    };
    println!(
        "  goal: {goal_label} cached step <= {goal_ms} ms: {}",
        if cached.graph_ms <= goal_ms {
            "met"
        } else {
            "NOT met"
        }
    );
    let ctx = dit.context().clone();
    let energy = super::report_energy(&ctx, cached.graph_ms, Some(goal_ms), |n| {
        Ok(dit.time_graph(&step1, KvStep::Cached(&cache), n)?)
    })?;

    let mut reference = serde_json::Value::Null;
    if let Some(path) = &args.reference {
        match reference_case(path, &name) {
            Ok(case) => {
                let get = |k: &str| case.get(k).and_then(|v| v.as_f64());
                let mut rows = vec![
                    ("diffusers eager full", "eager_full_ms", full.graph_ms),
                    ("diffusers eager cached", "eager_cached_ms", cached.graph_ms),
                    (
                        "diffusers torch.compile cached",
                        "compiled_cached_ms",
                        cached.graph_ms,
                    ),
                ];
                // A reference made with --fp8 also carries torch's FP8 (row-wise _scaled_mm) times.
                if case.get("fp8_eager_cached_ms").is_some() {
                    rows.extend([
                        (
                            "diffusers torch FP8 eager full",
                            "fp8_eager_full_ms",
                            full.graph_ms,
                        ),
                        (
                            "diffusers torch FP8 eager cached",
                            "fp8_eager_cached_ms",
                            cached.graph_ms,
                        ),
                        (
                            "diffusers torch FP8 torch.compile cached",
                            "fp8_compiled_cached_ms",
                            cached.graph_ms,
                        ),
                    ]);
                }
                for (label, key, ours) in rows {
                    match get(key) {
                        Some(ms) => println!(
                            "  {label}: {ms:.2} ms; ours (graph) / theirs = {:.3}",
                            ours / ms
                        ),
                        None => println!("  {label}: not in {} ({key} absent)", path.display()),
                    }
                }
                if let Some(bytes) = get("eager_peak_bytes") {
                    println!(
                        "  diffusers eager peak memory: {:.2} GiB",
                        bytes / (1u64 << 30) as f64
                    );
                }
                super::report_reference_energy(
                    &energy,
                    &case,
                    &[
                        ("diffusers eager cached energy", "eager_cached_j"),
                        ("diffusers torch.compile cached energy", "compiled_cached_j"),
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
            "precision": args.precision.to_string(),
            "precision_resolved": dit.precision().to_string(),
            "text_rows": args.text_rows,
            "seq_len": seq,
            "full_eager_ms": full.eager_ms,
            "full_graph_ms": full.graph_ms,
            "cached_eager_ms": cached.eager_ms,
            "cached_graph_ms": cached.graph_ms,
            "peak_device_bytes": peak,
            "weight_bytes": load.weight_bytes,
            "weight_load_gb_per_s": load.upload.source_gb_per_s(),
            "weight_load_s": load.upload.seconds,
            "reference": reference,
            "phases": phases,
            "gemm_plans": gemms,
            "cached_other_attention_tiles": other_tiles,
            "energy_cached_step": energy,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Without the `bench` feature the timers are not compiled in: says how to get them.
#[cfg(not(feature = "bench"))]
pub fn run(_args: &QwenDitArgs) -> Result<(), BoxError> {
    Err("`tf bench qwen-dit` needs the step timers: rebuild with `cargo build -p tf-engines --bin tf --features bench`".into())
}
