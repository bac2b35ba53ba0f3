//! `tf bench h3-audio-vae`: the MiniMax H3 audio VAE decode on the GPU (f32, as the reference pins it) over a saved
//! `audio_vae/` folder, beside diffusers' figures from the same run (reference.json from
//! tests/python/h3_audio_vae_reference.py): device time per decode (events, the mean of `--iters` after a warm-up),
//! the wall time of a whole decode call (latents up, waveform back), the device bytes held at the peak, and the
//! waveform's relative L2 against diffusers' fp32 output (TF32 off: the truth), its default-settings output (cuDNN
//! may use TF32 for the convolutions) and its bf16 output (a floor; the reference keeps this VAE in fp32).
//!
//! The body needs tf-engines' `bench` feature (the GPU bundle builds `tf` with it).

use super::{BoxError, H3AudioVaeArgs};

#[cfg(feature = "bench")]
mod imp {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Instant;

    use tf_cuda::gpu_memory::Baseline;
    use tf_cuda::{Context, Driver};
    use tf_engines::minimax_h3::vae_audio::HostAudioVae;
    use tf_engines::minimax_h3::vae_audio_gpu::{AudioVaeLayout, GpuAudioVae};
    use tf_engines::nn::gpu::GpuDevice;
    use tf_engines::nn::sampling::seeded::SplitMix64;
    use tf_engines::nn::tensor::{relative_l2, TensorF32};
    use tf_engines::nn::weights::{write_safetensors, AnyTensor, ModelDir, SafetensorsFile};

    use super::super::{BoxError, H3AudioVaeArgs};

    fn read_json(path: &Path) -> Result<serde_json::Value, BoxError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "{}: {e} (run tests/python/h3_audio_vae_reference.py first)",
                path.display()
            )
        })?;
        Ok(serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?)
    }

    fn mb(bytes: f64) -> f64 {
        bytes / 1e6
    }

    pub fn run(args: &H3AudioVaeArgs) -> Result<(), BoxError> {
        let reference = args.reference.as_deref().map(read_json).transpose()?;
        let ctx = Context::new(Arc::new(Driver::open()?), 0)?;
        let info = ctx.device_info()?;
        let baseline = Baseline::capture(&ctx)?;
        tf_cuda::usage::reset_peaks();
        // `GpuAudioVae::load_on` in its phases: the host reference's read and weight norm, the kernels' layout, the
        // upload with the kernels' module.
        let device = GpuDevice::on(&ctx)?;
        let started = Instant::now();
        let host = HostAudioVae::load(&ModelDir::open(&args.model)?)?;
        let read_s = started.elapsed().as_secs_f64();
        let layout = AudioVaeLayout::from_host(&host)?;
        drop(host);
        let layout_s = started.elapsed().as_secs_f64() - read_s;
        let mut vae = GpuAudioVae::with_layout(&device, layout)?;
        let load_s = started.elapsed().as_secs_f64();
        let upload_s = load_s - read_s - layout_s;
        let channels = vae.config().latent_channels;
        let latents = match &args.latents {
            Some(path) => SafetensorsFile::open(path)?.to_f32("latents")?,
            None => {
                let n = 2 * channels * args.frames;
                TensorF32::new(
                    vec![2, channels, args.frames],
                    SplitMix64::new(5).uniform_vec(n, -2.0, 2.0),
                )?
            }
        };
        let frames = latents.shape().get(2).copied().unwrap_or(0);
        println!(
            "tf bench h3-audio-vae on {}: {} loaded in {load_s:.2} s (read and weight norm {read_s:.3} s, layout \
             {layout_s:.3} s, upload {upload_s:.3} s; {:.1} MB of f32 weights); latents {:?} ({:.2} s \
             of {} audio at {} Hz)",
            info.name,
            args.model.display(),
            mb(vae.weight_bytes() as f64),
            latents.shape(),
            frames as f64 * vae.config().hop_length() as f64 / vae.config().sampling_rate as f64,
            if latents.shape().first() == Some(&2) {
                "stereo"
            } else {
                "mono"
            },
            vae.config().sampling_rate
        );
        let started = Instant::now();
        let wave = vae.decode(&latents)?;
        let first_ms = started.elapsed().as_secs_f64() * 1e3;
        if !wave.data().iter().all(|v| v.is_finite()) {
            return Err("the waveform is not finite".into());
        }
        let iters = args.iters.max(1);
        let device_ms = vae.time_decode(&latents, iters)?;
        let started = Instant::now();
        for _ in 0..iters {
            vae.decode(&latents)?;
        }
        let wall_ms = started.elapsed().as_secs_f64() * 1e3 / iters as f64;
        let peak = tf_cuda::usage().device_peak;
        let resident = baseline.report(&ctx)?;
        println!(
            "  ours (f32): {device_ms:.3} ms device per decode, {wall_ms:.3} ms per decode call (first call {first_ms:.1} \
             ms, workspace included); peak {:.1} MB in DeviceBuffers, {:.1} MB resident by cuMemGetInfo",
            mb(peak as f64),
            mb(resident.resident as f64)
        );
        let mut summary = serde_json::json!({
            "gpu": info.name,
            "model": args.model.display().to_string(),
            "latents_shape": latents.shape(),
            "ours": {
                "device_ms": device_ms,
                "decode_call_ms": wall_ms,
                "first_call_ms": first_ms,
                "peak_device_buffer_bytes": peak,
                "resident_bytes": resident.resident,
                "weight_bytes": vae.weight_bytes(),
                "load_s": load_s,
                "load_phases_s": {"read_and_weight_norm": read_s, "layout": layout_s, "upload": upload_s},
            },
        });
        if let Some(out) = &args.out {
            write_safetensors(out, &[("sample", AnyTensor::F32(&wave))])?;
            println!("  wrote {}", out.display());
        }
        if let Some(r) = &reference {
            for (key, label) in [
                ("fp32", "diffusers fp32 (TF32 off)"),
                ("tf32", "diffusers fp32, default settings (cuDNN TF32)"),
                ("bf16", "diffusers bf16 (floor; the reference pins fp32)"),
            ] {
                if let Some(run) = r.get("runs").and_then(|runs| runs.get(key)) {
                    let ms = run.get("ms").and_then(|v| v.as_f64()).unwrap_or(f64::NAN);
                    let peak = run
                        .get("peak_allocated_bytes")
                        .and_then(|v| v.as_f64())
                        .unwrap_or(f64::NAN);
                    println!(
                        "  {label}: {ms:.3} ms, peak {:.1} MB allocated -> ours is {:.2}x its speed",
                        mb(peak),
                        ms / device_ms
                    );
                }
            }
            let file = r
                .get("outputs_file")
                .and_then(|v| v.as_str())
                .ok_or("reference.json: outputs_file is missing")?;
            let outputs = SafetensorsFile::open(Path::new(file))?;
            let truth = outputs.to_f32("fp32")?;
            if truth.shape() != wave.shape() {
                return Err(format!(
                    "the reference waveform is {:?}, ours {:?}",
                    truth.shape(),
                    wave.shape()
                )
                .into());
            }
            let mut accuracy = serde_json::Map::new();
            let ours_vs_fp32 = relative_l2(wave.data(), truth.data()).ok_or("length mismatch")?;
            let max_abs = wave
                .data()
                .iter()
                .zip(truth.data())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!(
                "  relative L2 against diffusers fp32: ours {ours_vs_fp32:.3e} (max abs {max_abs:.3e})"
            );
            accuracy.insert("ours_vs_fp32".into(), serde_json::json!(ours_vs_fp32));
            accuracy.insert("ours_max_abs_vs_fp32".into(), serde_json::json!(max_abs));
            for key in ["tf32", "bf16"] {
                if let Ok(other) = outputs.to_f32(key) {
                    let rel = relative_l2(other.data(), truth.data()).ok_or("length mismatch")?;
                    println!("  relative L2 against diffusers fp32: diffusers {key} {rel:.3e}");
                    accuracy.insert(format!("{key}_vs_fp32"), serde_json::json!(rel));
                }
            }
            summary["accuracy"] = serde_json::Value::Object(accuracy);
            summary["reference"] = r.clone();
        }
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_vec_pretty(&summary)?)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }
}

#[cfg(feature = "bench")]
pub fn run(args: &H3AudioVaeArgs) -> Result<(), BoxError> {
    imp::run(args)
}

#[cfg(not(feature = "bench"))]
pub fn run(_args: &H3AudioVaeArgs) -> Result<(), BoxError> {
    Err("`tf bench h3-audio-vae` is benchmark code: rebuild with `cargo build -p tf-engines --bin tf --features bench`".into())
}
