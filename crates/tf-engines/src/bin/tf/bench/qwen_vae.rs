//! `tf bench qwen-vae`: the Qwen-Image VAE decode on the GPU over a saved `vae/` folder at one image size: the
//! first decode (workspace and GEMM plans included), warm decodes with the f32 image brought back and converted on
//! the host, and as the pipeline runs them (8-bit pixels made on the device); with `--phases` the device time of
//! every kernel and GEMM kind of one decode. With `--reference` (the reference.json of
//! tests/python/qwen_pipeline_reference.py from the same run) diffusers' decode phase is printed beside the
//! pipeline's path, with the ratio. On a GPU with the implicit-GEMM 3x3 convolutions (sm_90) every conv path is
//! timed (implicit with row reuse, with 256- and with 128-pixel tiles, then im2col), and the default's image is compared with the
//! im2col path's (relative L2, largest difference).
//!
//! The body needs tf-engines' `bench` feature (the GPU bundle builds `tf` with it).

use super::{BoxError, QwenVaeArgs};

#[cfg(feature = "bench")]
mod imp {
    use std::time::Instant;

    use tf_engines::nn::sampling::seeded::SplitMix64;
    use tf_engines::nn::tensor::TensorF32;
    use tf_engines::nn::weights::ModelDir;
    use tf_engines::qwen_image::components::VaeBackend;
    use tf_engines::qwen_image::vae::to_u8_hwc;
    use tf_engines::qwen_image::vae_gpu::{ConvPath, GpuVaeBudget, GpuVaeDecoder, CONV_ENV};

    fn describe(path: ConvPath) -> &'static str {
        match path {
            ConvPath::Implicit => {
                "implicit GEMM, 130-pixel input rows for three taps where they fit (the default)"
            }
            ConvPath::ImplicitTall => "implicit GEMM, 256-pixel tiles where they fit",
            ConvPath::Implicit128 => "implicit GEMM, 128-pixel tiles",
            ConvPath::Im2col => "im2col + cuBLASLt",
        }
    }

    use super::super::{BoxError, QwenVaeArgs};

    /// Diffusers' decode phase (ms) of the first case of a qwen_pipeline_reference.py reference.json, if any.
    fn reference_decode_ms(path: &std::path::Path) -> Result<Option<f64>, BoxError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            format!(
                "{}: {e} (run tests/python/qwen_pipeline_reference.py first)",
                path.display()
            )
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(json
            .pointer("/cases/0/timings/decode_ms")
            .and_then(|v| v.as_f64()))
    }

    pub fn run(args: &QwenVaeArgs) -> Result<(), BoxError> {
        let (width, height) = (args.width, args.height);
        let started = Instant::now();
        let mut vae = GpuVaeDecoder::load(&ModelDir::open(&args.model)?)?;
        let load_s = started.elapsed().as_secs_f64();
        let f = vae.config().spatial_factor();
        if f == 0 || width == 0 || height == 0 || width % f != 0 || height % f != 0 {
            return Err(format!(
                "--width {width} and --height {height} must be positive multiples of {f}"
            )
            .into());
        }
        let (rows, cols) = (height / f, width / f);
        let z = vae.config().z_dim;
        let tokens = rows
            .checked_mul(cols)
            .filter(|t| t.checked_mul(z).is_some_and(|n| n <= 1 << 28))
            .ok_or("the latent is too large for a benchmark")?;
        let packed = TensorF32::new(
            vec![1, tokens, z],
            SplitMix64::new(3).uniform_vec(tokens * z, -2.0, 2.0),
        )?;
        println!(
            "tf bench qwen-vae: {} loaded in {load_s:.2} s ({:.1} MB of weights); {width}x{height} from a {cols}x{rows} \
             latent of {z} channels (seeded random)",
            args.model.display(),
            vae.weight_bytes() as f64 / 1e6
        );
        let reference = match &args.reference {
            Some(path) => reference_decode_ms(path)?,
            None => None,
        };
        let default_budget = GpuVaeBudget::default();
        let budgets: Vec<GpuVaeBudget> = if args.cols_mib.is_empty() {
            vec![default_budget]
        } else {
            args.cols_mib
                .iter()
                .map(|&mib| {
                    mib.checked_mul(1 << 20)
                        .filter(|&b| b > 0)
                        .map(|cols_bytes| GpuVaeBudget {
                            cols_bytes,
                            ..default_budget
                        })
                        .ok_or_else(|| {
                            format!("--cols-mib {mib}: must be a positive number of MiB")
                        })
                })
                .collect::<Result<_, _>>()?
        };
        let paths: Vec<ConvPath> = if vae.set_conv_path(ConvPath::Implicit) {
            vec![
                ConvPath::Implicit,
                ConvPath::ImplicitTall,
                ConvPath::Implicit128,
                ConvPath::Im2col,
            ]
        } else {
            vec![ConvPath::Im2col]
        };
        let mut runs = Vec::new();
        for budget in budgets {
            vae.set_budget(budget);
            for &path in &paths {
                vae.set_conv_path(path);
                println!(
                    "  3x3 convs: {} ({CONV_ENV}={})",
                    describe(path),
                    path.name()
                );
                let mut run = time_one_budget(&mut vae, args, &packed, (rows, cols), reference)?;
                run["conv"] = serde_json::json!(path.name());
                runs.push(run);
            }
        }
        let paths_agree = if paths.len() > 1 {
            vae.set_conv_path(ConvPath::Implicit);
            let a = vae.decode_packed(&packed, rows, cols)?;
            vae.set_conv_path(ConvPath::Im2col);
            let b = vae.decode_packed(&packed, rows, cols)?;
            let (mut diff2, mut ref2, mut max_abs) = (0f64, 0f64, 0f64);
            for (x, y) in a.data().iter().zip(b.data()) {
                let d = f64::from(x - y);
                diff2 += d * d;
                ref2 += f64::from(*y) * f64::from(*y);
                max_abs = max_abs.max(d.abs());
            }
            let rel_l2 = (diff2 / ref2.max(f64::MIN_POSITIVE)).sqrt();
            println!(
                "  implicit against im2col images: relative L2 {rel_l2:.3e}, largest difference {max_abs:.3e}"
            );
            serde_json::json!({ "rel_l2": rel_l2, "max_abs": max_abs })
        } else {
            serde_json::Value::Null
        };
        if let Some(path) = &args.json {
            let json = serde_json::json!({
                "model": args.model.display().to_string(),
                "width": width,
                "height": height,
                "load_s": load_s,
                "reference_decode_ms": reference,
                "runs": runs,
                "implicit_vs_im2col": paths_agree,
            });
            std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }

    /// First and warm decodes (and phases) with the decoder's current budget; prints them and returns them as JSON.
    fn time_one_budget(
        vae: &mut GpuVaeDecoder,
        args: &QwenVaeArgs,
        packed: &TensorF32,
        (rows, cols): (usize, usize),
        reference: Option<f64>,
    ) -> Result<serde_json::Value, BoxError> {
        let started = Instant::now();
        let first = vae.decode_packed(packed, rows, cols)?;
        let first_ms = started.elapsed().as_secs_f64() * 1e3;
        if !first.data().iter().all(|v| v.is_finite()) {
            return Err("the decoded image is not finite".into());
        }
        let plan = vae.buffer_plan().ok_or("no buffer plan after a decode")?;
        let iters = args.iters.max(1);
        let (mut decode_ms, mut pixels_ms) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            let started = Instant::now();
            let image = vae.decode_packed(packed, rows, cols)?;
            decode_ms.push(started.elapsed().as_secs_f64() * 1e3);
            let started = Instant::now();
            let pixels = to_u8_hwc(&image, 0)?;
            pixels_ms.push(started.elapsed().as_secs_f64() * 1e3);
            if pixels.is_empty() {
                return Err("no pixels".into());
            }
        }
        // The pipeline's path: the pixels made on the device, no f32 image brought back.
        let mut device_pixels_ms = Vec::new();
        for _ in 0..iters {
            let started = Instant::now();
            let decoded = vae.decode_packed_pixels(packed, rows, cols, false)?;
            device_pixels_ms.push(started.elapsed().as_secs_f64() * 1e3);
            if decoded.pixels.is_empty() {
                return Err("no pixels".into());
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let ours_ms = mean(&device_pixels_ms);
        let cols_mib = plan.cols_elems as f64 * 2.0 / (1u64 << 20) as f64;
        println!(
            "  column buffer {cols_mib:.1} MiB: first decode {first_ms:.1} ms; warm f32 decode call {:.2} ms (min {:.2}) + \
             8-bit conversion on the host {:.2} ms; decode to 8-bit pixels on the device (the pipeline's path) \
             {ours_ms:.2} ms (min {:.2}) (means of {iters}); resident {:.1} MiB",
            mean(&decode_ms),
            decode_ms.iter().cloned().fold(f64::INFINITY, f64::min),
            mean(&pixels_ms),
            device_pixels_ms.iter().cloned().fold(f64::INFINITY, f64::min),
            vae.resident_bytes() as f64 / (1u64 << 20) as f64
        );
        if let Some(theirs) = reference {
            println!(
                "  diffusers decode phase (same run): {theirs:.2} ms; ours / diffusers {:.3}",
                ours_ms / theirs
            );
        }
        let mut phases = serde_json::Value::Null;
        if args.phases {
            phases = super::super::report_phases("decode", &vae.time_phases(packed, rows, cols)?);
        }
        Ok(serde_json::json!({
            "cols_bytes": plan.cols_elems * 2,
            "first_decode_ms": first_ms,
            "decode_call_ms": decode_ms,
            "pixels_ms": pixels_ms,
            "device_pixels_ms": device_pixels_ms,
            "ours_ms": ours_ms,
            "resident_bytes": vae.resident_bytes(),
            "phases": phases,
        }))
    }
}

#[cfg(feature = "bench")]
pub fn run(args: &QwenVaeArgs) -> Result<(), BoxError> {
    imp::run(args)
}

/// Without the `bench` feature the timers are not compiled in: says how to get them.
#[cfg(not(feature = "bench"))]
pub fn run(_args: &QwenVaeArgs) -> Result<(), BoxError> {
    Err("`tf bench qwen-vae` needs the phase timers: rebuild with `cargo build -p tf-engines --bin tf --features bench`".into())
}
