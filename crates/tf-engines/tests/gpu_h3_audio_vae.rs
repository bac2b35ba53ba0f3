//! The MiniMax H3 audio VAE decoder on the GPU (`GpuAudioVae`, kernel set `minimax_h3_audio`) against diffusers and
//! the host reference (`HostAudioVae`), through the shared `AudioVaeDecoder` trait.
//!
//! - `tiny_fixture_matches_diffusers_and_the_host`: the committed fixture (tests/fixtures/minimax_h3_audio_vae:
//!   three up-samplers, one with an odd kernel - rate, two AMP blocks of two and three dilations, perturbed
//!   filters) decoded from normalized latents against the diffusers fp32 output and the host; the model's decode on
//!   de-normalized latents; one channel alone bit-identical to its half of the stereo batch; repeats bit-identical.
//! - `released_config_matches_the_host_and_decodes_5_s`: the released config (decoder_dim 1024, rates
//!   5,5,2,2,2,2,2, AMP kernels 3/7/11 with dilations 1/3/5) with seeded random weights written by the test; 8
//!   frames of stereo against the host reference; then 5 s (200 frames per channel) on the GPU alone: finite, inside
//!   the clamp, device time, peak device memory and the kernel each convolution runs.
//! - `bad_requests_are_refused_and_memory_is_freed`.
//!
//! Bounds. The tiny decode against diffusers and the host: relative L2 <= 2e-5 (the host reference holds 1e-5
//! against diffusers; the GPU sums in f32 in a different order than the host's f64 accumulation, and CUDA's sinf is
//! within 2 ulp). The released width against the host: 1e-4 (sums of up to 5632 products per output in f32, about
//! sqrt(5632) ulp ~ 5e-6 relative each, compounded over seven stages); a wrong tap order, phase or residual gives
//! order-1 errors.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tf_cuda::{Context, Driver};
use tf_engines::minimax_h3::vae_audio::{AudioVaeConfig, AudioVaeDecoder, HostAudioVae};
use tf_engines::minimax_h3::vae_audio_gpu::GpuAudioVae;
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir, SafetensorsFile};

const TINY_BOUND: f64 = 2e-5;
const RELEASED_BOUND: f64 = 1e-4;

fn context() -> Context {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    Context::new(driver, 0).expect("create a context on device 0")
}

fn fixtures() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/minimax_h3_audio_vae");
        if p.is_dir() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_audio_vae")
}

fn tensor(file: &str, name: &str) -> TensorF32 {
    SafetensorsFile::open(&fixtures().join(file))
        .unwrap()
        .to_f32(name)
        .unwrap()
}

fn assert_close(what: &str, ours: &TensorF32, reference: &TensorF32, bound: f64) -> f64 {
    assert_eq!(ours.shape(), reference.shape(), "{what}: shape");
    assert!(
        ours.data().iter().all(|v| v.is_finite()),
        "{what}: non-finite"
    );
    let err = relative_l2(ours.data(), reference.data()).unwrap();
    let max_abs = ours
        .data()
        .iter()
        .zip(reference.data())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "{what}: shape {:?}, relative L2 {err:.3e} (bound {bound:e}), max abs {max_abs:.3e}",
        ours.shape()
    );
    assert!(err <= bound, "{what}: relative L2 {err:.3e} > {bound:e}");
    err
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn tiny_fixture_matches_diffusers_and_the_host() {
    let ctx = context();
    let model = ModelDir::open(&fixtures().join("model")).unwrap();
    let mut gpu = GpuAudioVae::load_on(&ctx, &model).expect("GPU load");
    let mut host = HostAudioVae::load(&model).unwrap();
    let decoders: [&mut dyn AudioVaeDecoder; 2] = [&mut gpu, &mut host];
    let [gpu, host] = decoders;
    assert_eq!((gpu.name(), host.name()), ("gpu", "host"));
    assert_eq!(gpu.config(), host.config());
    let z = tensor("inputs.safetensors", "latents");
    let expected = tensor("expected.safetensors", "sample");
    let ours = gpu.decode(&z).expect("GPU decode");
    assert_close(
        "stereo sample vs diffusers fp32",
        &ours,
        &expected,
        TINY_BOUND,
    );
    assert_close(
        "stereo sample vs the host",
        &ours,
        &host.decode(&z).unwrap(),
        TINY_BOUND,
    );
    assert_eq!(gpu.output_len(z.shape()[2]).unwrap(), expected.shape()[2]);
    // Bit-identical on a repeat, and per item: each output sums its inputs in one fixed order whatever the tile.
    assert_eq!(
        gpu.decode(&z).unwrap(),
        ours,
        "a repeat must be bit-identical"
    );
    let (c, frames) = (z.shape()[1], z.shape()[2]);
    let per = c * frames;
    let right = TensorF32::new(vec![1, c, frames], z.data()[per..].to_vec()).unwrap();
    let one = gpu.decode(&right).unwrap();
    let n = expected.shape()[2];
    assert_eq!(
        one.data(),
        &ours.data()[n..],
        "one channel alone vs its half of the batch"
    );
    // The model's decode on de-normalized latents gives the same waveform.
    let cfg = gpu.config().clone();
    let (mean, std) = (cfg.latents_mean.unwrap(), cfg.latents_std.unwrap());
    let mut lat = z.data().to_vec();
    for (i, row) in lat.chunks_exact_mut(frames).enumerate() {
        let ch = i % c;
        row.iter_mut()
            .for_each(|v| *v = *v * std[ch] as f32 + mean[ch] as f32);
    }
    let lat = TensorF32::new(z.shape().to_vec(), lat).unwrap();
    assert_eq!(gpu.decode_denormalized(&lat).unwrap(), ours);
    // One frame, and a length whose SnakeBeta rows cross a 512-sample tile.
    for frames in [1usize, 60] {
        let mut rng = Rng::new(frames as u64);
        let z = TensorF32::new(
            vec![2, c, frames],
            rng.uniform_vec(2 * c * frames, -1.5, 1.5),
        )
        .unwrap();
        assert_close(
            &format!("{frames} frames vs the host"),
            &gpu.decode(&z).unwrap(),
            &host.decode(&z).unwrap(),
            TINY_BOUND,
        );
    }
}

/// Writes the released decoder config with seeded random weights (f32) and returns its folder.
fn write_released_model(dir: &Path, seed: u64) -> AudioVaeConfig {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = Rng::new(seed);
    let json = serde_json::json!({
        "_class_name": "AutoencoderKLMiniMaxH3Audio",
        "latents_mean": rng.uniform_vec(32, -0.5, 0.5),
        "latents_std": rng.uniform_vec(32, 0.5, 1.5),
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let config = AudioVaeConfig::from_json(&json).unwrap();
    let tensors: Vec<(String, TensorF32)> = config
        .tensor_specs()
        .into_iter()
        .map(|spec| {
            let n = spec.shape.iter().product();
            let values = if spec.name == "decoder.conv_post.weight_g" {
                // Keeps most samples inside the clamp.
                rng.uniform_vec(n, 0.05, 0.06)
            } else if spec.name.ends_with("weight_g") {
                rng.uniform_vec(n, 0.6, 1.4)
            } else if spec.name.ends_with(".alpha") || spec.name.ends_with(".beta") {
                rng.uniform_vec(n, -0.5, 0.5)
            } else if spec.name.ends_with("filter") {
                let raw = rng.uniform_vec(n, 0.0, 1.0);
                let sum: f32 = raw.iter().sum();
                raw.iter().map(|v| v / sum).collect()
            } else if spec.name.ends_with("bias") {
                rng.uniform_vec(n, -0.1, 0.1)
            } else {
                rng.uniform_vec(n, -1.0, 1.0)
            };
            (spec.name, TensorF32::new(spec.shape, values).unwrap())
        })
        .collect();
    write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &tensors).unwrap();
    config
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn released_config_matches_the_host_and_decodes_5_s() {
    let dir = std::env::temp_dir().join(format!("tf-gpu-h3-audio-{}", std::process::id()));
    let config = write_released_model(&dir, 2031);
    println!(
        "released config: {} decoder parameters (random, seeded)",
        config.parameter_count()
    );
    let model = ModelDir::open(&dir).unwrap();
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    tf_cuda::usage::reset_peaks();
    let started = Instant::now();
    let mut gpu = GpuAudioVae::load_on(&ctx, &model).expect("GPU load");
    println!(
        "GPU load {:.2} s, {:.1} MB of f32 weights",
        started.elapsed().as_secs_f64(),
        gpu.weight_bytes() as f64 / 1e6
    );
    let host = HostAudioVae::load(&model).unwrap();
    let mut rng = Rng::new(9);
    let z = TensorF32::new(vec![2, 32, 8], rng.uniform_vec(2 * 32 * 8, -2.0, 2.0)).unwrap();
    let started = Instant::now();
    let want = host.decode(&z).unwrap();
    println!(
        "host decode of 8 frames: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let got = gpu.decode(&z).unwrap();
    let rms = (want
        .data()
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum::<f64>()
        / want.data().len() as f64)
        .sqrt();
    let clamped = want.data().iter().filter(|v| v.abs() >= 1.0).count();
    println!(
        "8 frames: host output rms {rms:.3}, {clamped} of {} samples clamped",
        want.data().len()
    );
    assert!(
        rms > 1e-3 && clamped * 2 < want.data().len(),
        "degenerate output"
    );
    assert_close(
        "8 frames of stereo vs the host",
        &got,
        &want,
        RELEASED_BOUND,
    );

    // 5 s of stereo: 200 latent frames per channel.
    let z = TensorF32::new(vec![2, 32, 200], rng.uniform_vec(2 * 32 * 200, -2.0, 2.0)).unwrap();
    let wave = gpu.decode(&z).expect("decode 5 s");
    assert_eq!(wave.shape(), &[2, 1, 160_000]);
    assert!(wave.data().iter().all(|v| v.is_finite() && v.abs() <= 1.0));
    let clamped = wave.data().iter().filter(|v| v.abs() >= 1.0).count();
    println!("5 s: {clamped} of {} samples clamped", wave.data().len());
    assert_eq!(
        gpu.decode(&z).unwrap(),
        wave,
        "a repeat must be bit-identical"
    );
    let ms = gpu.time_decode(&z, 10).expect("time the decode");
    let wall = Instant::now();
    gpu.decode(&z).unwrap();
    let wall_ms = wall.elapsed().as_secs_f64() * 1e3;
    println!(
        "5 s of stereo: {ms:.3} ms device per decode, {wall_ms:.3} ms per decode call (latents up, waveform back); \
         peak {:.1} MB in DeviceBuffers, resident {:.1} MB",
        tf_cuda::usage().device_peak as f64 / 1e6,
        gpu.resident_bytes() as f64 / 1e6
    );
    let kernels = gpu.conv_kernels(2, 200).unwrap();
    let mut counts = std::collections::BTreeMap::new();
    for k in &kernels {
        *counts.entry(*k).or_insert(0usize) += 1;
    }
    println!("convolution kernels of the 5 s decode: {counts:?}");
    drop(gpu);
    assert_eq!(
        tf_cuda::usage().device,
        baseline,
        "the decoder must free its buffers"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn bad_requests_are_refused_and_memory_is_freed() {
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    let model = ModelDir::open(&fixtures().join("model")).unwrap();
    let mut gpu = GpuAudioVae::load_on(&ctx, &model).unwrap();
    let c = gpu.config().latent_channels;
    for shape in [
        vec![2, c],
        vec![2, c + 1, 4],
        vec![0, c, 4],
        vec![2, c, 0],
        vec![17, c, 4],
        vec![1, 2, c, 4],
    ] {
        let n: usize = shape.iter().product();
        let z = TensorF32::new(shape.clone(), vec![0.0; n]).unwrap();
        let err = gpu.decode(&z).unwrap_err();
        println!("{shape:?}: {err}");
        assert!(
            err.is_invalid_request() && err.to_string().contains("input"),
            "{err}"
        );
    }
    // Still usable, and a larger request grows the workspace.
    let z = TensorF32::new(vec![2, c, 2], vec![0.1; 2 * c * 2]).unwrap();
    let small = gpu.decode(&z).unwrap();
    let before = gpu.resident_bytes();
    let z = TensorF32::new(vec![2, c, 40], vec![0.1; 2 * c * 40]).unwrap();
    gpu.decode(&z).unwrap();
    assert!(gpu.resident_bytes() > before);
    let z = TensorF32::new(vec![2, c, 2], vec![0.1; 2 * c * 2]).unwrap();
    assert_eq!(
        gpu.decode(&z).unwrap(),
        small,
        "the same request after growing"
    );
    drop(gpu);
    assert_eq!(tf_cuda::usage().device, baseline, "every buffer freed");
}
