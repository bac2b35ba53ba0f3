//! `tf bench h3-text`: MiniMax H3's text conditioning on the GPU, beside the transformers figures of the same run
//! (reference.json from tests/python/h3_text_reference.py).
//!
//! Two modes:
//! - timing (default): Qwen3-VL-32B's text path (hidden 5120, 64 query and 8 key/value heads of 128, MLP 25600,
//!   vocabulary 151936, 64 layers) capped at `--layers` decoder layers as H3's text component loads it, with
//!   seeded random bf16 weights **made on the device** (no checkpoint is read; the weight bytes reported are the
//!   capped ones, beside what all 64 layers would take), one forward of `--tokens` random ids to
//!   `hidden_states[layers]` timed with events (the mean of `--iters` after a warm-up), the wall time of a whole
//!   `features_at` call (ids up, features back), and the device bytes held at the peak.
//! - accuracy (`--model DIR`): the H3 text component on the GPU over a saved H3 folder (text_encoder/ +
//!   tokenizer/), one prompt to `hidden_states[--layer]` (the encoder capped at that layer; its weight bytes are
//!   reported beside the uncapped figure); the ids are compared with the reference's, the features with the
//!   reference's fp32 and bf16 features (relative L2), and optionally written out.
//!
//! The body needs tf-engines' `bench` feature (the GPU bundle builds `tf` with it).

use super::{BoxError, H3TextArgs};

#[cfg(feature = "bench")]
mod imp {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Instant;

    use tf_cuda::gpu_memory::Baseline;
    use tf_cuda::{Context, Driver};
    use tf_engines::minimax_h3::text::{H3TextEncoder, H3TextOptions};
    use tf_engines::nn::tensor::{relative_l2, Tensor};
    use tf_engines::nn::weights::{write_safetensors, AnyTensor, SafetensorsFile};
    use tf_engines::qwen3_vl::text_encoder::{LoadOptions, TextEncoderConfig};
    use tf_engines::qwen3_vl::text_encoder_gpu::GpuTextEncoder;

    use super::super::{BoxError, H3TextArgs};

    /// Decoder layers of Qwen3-VL-32B's text path.
    const QWEN3_VL_32B_LAYERS: usize = 64;

    /// Qwen3-VL-32B's text path with `layers` decoder layers.
    fn qwen3_vl_32b(layers: usize) -> TextEncoderConfig {
        TextEncoderConfig {
            vocab_size: 151_936,
            hidden_size: 5120,
            intermediate_size: 25_600,
            num_hidden_layers: layers,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 5_000_000.0,
        }
    }

    /// Seeded ids below the first added token (plain text rows).
    fn random_ids(n: usize, seed: u64) -> Vec<u32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 151_643) as u32
            })
            .collect()
    }

    fn read_json(path: &Path) -> Result<serde_json::Value, BoxError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "{}: {e} (run tests/python/h3_text_reference.py first)",
                path.display()
            )
        })?;
        Ok(serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?)
    }

    fn gb(bytes: f64) -> f64 {
        bytes / 1e9
    }

    fn context() -> Result<Context, BoxError> {
        Ok(Context::new(Arc::new(Driver::open()?), 0)?)
    }

    pub fn run(args: &H3TextArgs) -> Result<(), BoxError> {
        let reference = args.reference.as_deref().map(read_json).transpose()?;
        let summary = match &args.model {
            Some(model) => accuracy(args, model, reference.as_ref())?,
            None => timing(args, reference.as_ref())?,
        };
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_vec_pretty(&summary)?)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }

    fn timing(
        args: &H3TextArgs,
        reference: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, BoxError> {
        if args.layers == 0 || args.tokens == 0 {
            return Err("--layers and --tokens must be at least 1".into());
        }
        let ctx = context()?;
        let info = ctx.device_info()?;
        let baseline = Baseline::capture(&ctx)?;
        tf_cuda::usage::reset_peaks();
        // The model's layers (more if --layers asks for more), capped at --layers as H3's component loads it.
        let total_layers = QWEN3_VL_32B_LAYERS.max(args.layers);
        let config = qwen3_vl_32b(total_layers);
        let options = LoadOptions::up_to_layer(args.layers);
        let uncapped = GpuTextEncoder::planned_weight_bytes(&config, LoadOptions::default())?;
        let started = Instant::now();
        let mut encoder = GpuTextEncoder::random_with(&ctx, config.clone(), 42, options)?;
        let made_s = started.elapsed().as_secs_f64();
        println!(
            "tf bench h3-text on {} (cc {}.{}): Qwen3-VL-32B text path capped at {} of its {total_layers} layers, \
             RANDOM bf16 weights made on the device ({:.2} GB in {made_s:.1} s, {:.2} GB less than all \
             {total_layers} layers; no checkpoint read)",
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            encoder.loaded_layers(),
            gb(encoder.weight_bytes() as f64),
            gb(uncapped.saturating_sub(encoder.weight_bytes()) as f64)
        );
        let ids = random_ids(args.tokens, 7);
        let features = encoder.features_at(&ids, args.layers)?;
        if !features.data().iter().all(|v| v.is_finite()) {
            return Err("the features are not finite".into());
        }
        let iters = args.iters.max(1);
        let device_ms = encoder.time_forward(&ids, iters)?;
        let wall = Instant::now();
        for _ in 0..iters {
            encoder.features_at(&ids, args.layers)?;
        }
        let wall_ms = wall.elapsed().as_secs_f64() * 1e3 / iters as f64;
        let peak = tf_cuda::usage().device_peak;
        let resident = baseline.report(&ctx)?;
        println!(
            "  ours: {} tokens to hidden_states[{}]: {device_ms:.3} ms device per forward, {wall_ms:.3} ms per \
             features_at call (ids up, bf16 features back to f32)",
            args.tokens, args.layers
        );
        println!(
            "  ours: peak {:.2} GB in DeviceBuffers (weights {:.2} GB + workspace), {:.2} GB resident by \
             cuMemGetInfo (context and cuBLASLt included)",
            gb(peak as f64),
            gb(encoder.weight_bytes() as f64),
            gb(resident.resident as f64)
        );
        let mut summary = serde_json::json!({
            "mode": "timing",
            "gpu": info.name,
            "weights": "random bf16 made on the device",
            "layers": args.layers,
            "model_layers": total_layers,
            "tokens": args.tokens,
            "ours": {
                "device_ms": device_ms,
                "features_at_ms": wall_ms,
                "peak_device_buffer_bytes": peak,
                "weight_bytes": encoder.weight_bytes(),
                "weight_bytes_uncapped": uncapped,
                "resident_bytes": resident.resident,
            },
        });
        if let Some(r) = reference.and_then(|r| r.get("timing")) {
            let ms = r.get("ms").and_then(|v| v.as_f64());
            let peak_ref = r.get("peak_allocated_bytes").and_then(|v| v.as_f64());
            if let (Some(ms), Some(peak_ref)) = (ms, peak_ref) {
                println!(
                    "  transformers bf16 (same run): {ms:.3} ms per forward, peak {:.2} GB allocated -> ours is \
                     {:.2}x its speed",
                    gb(peak_ref),
                    ms / device_ms
                );
            }
            if let Some(full) = r.get("full_stack") {
                if let Some(ms) = full.get("ms").and_then(|v| v.as_f64()) {
                    println!(
                        "  transformers bf16, the whole {}-layer stack the reference pipeline runs for the same \
                         hidden state: {ms:.3} ms -> ours is {:.2}x its speed",
                        full.get("layers").and_then(|v| v.as_u64()).unwrap_or(0),
                        ms / device_ms
                    );
                }
            }
            summary["reference"] = r.clone();
        }
        Ok(summary)
    }

    fn accuracy(
        args: &H3TextArgs,
        model: &Path,
        reference: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, BoxError> {
        let prompt = match (&args.prompt, &args.prompt_file) {
            (Some(p), None) => p.clone(),
            (None, Some(f)) => {
                std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?
            }
            _ => return Err("accuracy mode takes one of --prompt or --prompt-file".into()),
        };
        let ctx = context()?;
        let baseline = Baseline::capture(&ctx)?;
        tf_cuda::usage::reset_peaks();
        let options = H3TextOptions {
            layer: args.layer,
            ..H3TextOptions::default()
        };
        let started = Instant::now();
        let mut text = H3TextEncoder::load_gpu(&ctx, model, options)?;
        let load_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let encoded = text.encode(&prompt)?;
        let encode_ms = started.elapsed().as_secs_f64() * 1e3;
        let peak = tf_cuda::usage().device_peak;
        let resident = baseline.report(&ctx)?;
        let weight_bytes = text.weight_bytes();
        let uncapped = GpuTextEncoder::planned_weight_bytes(text.config(), LoadOptions::default())?;
        println!(
            "tf bench h3-text (accuracy): {} loaded on the GPU in {load_s:.1} s; {} tokens to hidden_states[{}] in \
             {encode_ms:.1} ms (first call); peak {:.2} GB in DeviceBuffers, {:.2} GB resident",
            model.display(),
            encoded.ids.len(),
            args.layer,
            gb(peak as f64),
            gb(resident.resident as f64)
        );
        println!(
            "  weights: {:.2} GB for decoder layers 0..{} (all {} layers would take {:.2} GB)",
            gb(weight_bytes as f64),
            args.layer,
            text.config().num_hidden_layers,
            gb(uncapped as f64)
        );
        let mut summary = serde_json::json!({
            "mode": "accuracy",
            "model": model.display().to_string(),
            "layer": args.layer,
            "tokens": encoded.ids.len(),
            "load_s": load_s,
            "encode_ms": encode_ms,
            "peak_device_buffer_bytes": peak,
            "weight_bytes": weight_bytes,
            "weight_bytes_uncapped": uncapped,
            "resident_bytes": resident.resident,
        });
        if let Some(out) = &args.out {
            let ids = Tensor::new(
                vec![encoded.ids.len()],
                encoded.ids.iter().map(|&i| i64::from(i)).collect(),
            )?;
            write_safetensors(
                out,
                &[
                    ("ids", AnyTensor::I64(&ids)),
                    ("features", AnyTensor::F32(&encoded.features)),
                ],
            )?;
            println!("  wrote {}", out.display());
        }
        let Some(r) = reference.and_then(|r| r.get("accuracy")) else {
            return Ok(summary);
        };
        let file = r
            .get("features_file")
            .and_then(|v| v.as_str())
            .ok_or("reference.json: accuracy.features_file is missing")?;
        let expected = SafetensorsFile::open(Path::new(file))?;
        let ids_ref: Vec<i64> = expected.to_i64("ids")?.into_data();
        let ids_ours: Vec<i64> = encoded.ids.iter().map(|&i| i64::from(i)).collect();
        let same_ids = ids_ref == ids_ours;
        println!(
            "  ids: {} (ours {}, transformers {})",
            if same_ids { "identical" } else { "DIFFERENT" },
            ids_ours.len(),
            ids_ref.len()
        );
        summary["same_ids"] = serde_json::json!(same_ids);
        if !same_ids {
            return Err("our token ids differ from the reference's".into());
        }
        let fp32 = expected.to_f32("fp32")?;
        let bf16 = expected.to_f32("bf16")?;
        let ours_vs_fp32 =
            relative_l2(encoded.features.data(), fp32.data()).ok_or("shape mismatch")?;
        let bf16_vs_fp32 = relative_l2(bf16.data(), fp32.data()).ok_or("shape mismatch")?;
        let ours_vs_bf16 =
            relative_l2(encoded.features.data(), bf16.data()).ok_or("shape mismatch")?;
        println!(
            "  relative L2 against transformers fp32: ours {ours_vs_fp32:.3e}, transformers bf16 \
             {bf16_vs_fp32:.3e} (the bf16 floor); ours against transformers bf16 {ours_vs_bf16:.3e}"
        );
        summary["rel_l2"] = serde_json::json!({
            "ours_vs_fp32": ours_vs_fp32,
            "bf16_vs_fp32": bf16_vs_fp32,
            "ours_vs_bf16": ours_vs_bf16,
        });
        summary["reference"] = r.clone();
        Ok(summary)
    }
}

#[cfg(feature = "bench")]
pub fn run(args: &H3TextArgs) -> Result<(), BoxError> {
    imp::run(args)
}

#[cfg(not(feature = "bench"))]
pub fn run(_args: &H3TextArgs) -> Result<(), BoxError> {
    Err("`tf bench h3-text` is benchmark code: rebuild with `cargo build -p tf-engines --bin tf --features bench`".into())
}
