//! The MiniMax H3 video VAE decoder on the GPU against the f32 host reference and diffusers: the tiny fixture
//! (tests/fixtures/minimax_h3_video_vae, every case, two tile batchings), a wider random config (4 blocks of 4
//! heads x 64, spatial ratio 8, 2 x 3 tiles, two chunks), and the full-size decode of a 768 x 448, 124-frame clip
//! against diffusers fp32 and bf16 (`full_size_decode_against_diffusers`, run by the bundle's command step
//! `h3-video-vae-ours` after `tests/python/h3_video_vae_reference.py` made the model and the references).
//!
//! Bounds: the GPU path keeps the residual stream, the norms' statistics, `proj_in`, `proj_out`'s output and the
//! blending in f32 and rounds GEMM inputs, q/k/v and the attention to bf16 (2^-8 relative), so its distance to an
//! f32 reference is a few bf16 roundings compounded over the blocks: `REL_L2_MAX` 3e-2 and `COSINE_MIN` 0.999 on
//! the samples (a wrong tile, blend, patch or head layout gives errors of order one), 8-bit frames within
//! `MAX_MEAN_BYTE_DIFF` 1.0 on average. At full size the bound is relative to diffusers' own bf16 run (the floor):
//! our relative L2 to the fp32 reference at most `FLOOR_RATIO_MAX` 1.5 times the floor's.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/gpu.rs"]
mod gpu_support;
use gpu_support::{context, cosine};
#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use tf_cuda::Context;
use tf_engines::minimax_h3::vae_video::{
    denormalize_latents, HostVideoVae, TilingOptions, VideoVaeBackend, VideoVaeConfig,
};
use tf_engines::minimax_h3::vae_video_gpu::{GpuVideoVae, GpuVideoVaeBudget};
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;
use tf_engines::nn::tensor::{relative_l2, Tensor, TensorF32};
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir, SafetensorsFile};

const REL_L2_MAX: f64 = 3e-2;
const COSINE_MIN: f64 = 0.999;
const MAX_MEAN_BYTE_DIFF: f64 = 1.0;
const FLOOR_RATIO_MAX: f64 = 1.5;

/// tests/fixtures/minimax_h3_video_vae: in the GPU bundle (`TF_BUNDLE_DIR`), in the checkout, or next to the
/// test binary.
fn fixture_dir() -> PathBuf {
    fixture_dir::find("minimax_h3_video_vae")
}

/// Relative L2 and cosine of `actual` against `reference`, printed.
fn compare(what: &str, actual: &TensorF32, reference: &TensorF32) -> (f64, f64) {
    assert_eq!(actual.shape(), reference.shape(), "{what}: shape");
    assert!(
        actual.data().iter().all(|v| v.is_finite()),
        "{what}: non-finite values"
    );
    let rel = relative_l2(actual.data(), reference.data()).expect("same length");
    let cos = cosine(actual.data(), reference.data());
    let max_abs = actual
        .data()
        .iter()
        .zip(reference.data())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "{what}: {:?} relative L2 {rel:.3e}, cosine {cos:.6}, max |diff| {max_abs:.3e}",
        actual.shape()
    );
    (rel, cos)
}

fn assert_close(what: &str, actual: &TensorF32, reference: &TensorF32) {
    let (rel, cos) = compare(what, actual, reference);
    assert!(
        rel <= REL_L2_MAX,
        "{what}: relative L2 {rel:e} > {REL_L2_MAX:e}"
    );
    assert!(cos >= COSINE_MIN, "{what}: cosine {cos} < {COSINE_MIN}");
}

/// Mean and largest absolute difference of two 8-bit frame sets, and the fraction of values that differ.
fn byte_stats(a: &[u8], b: &[u8]) -> (f64, u8, f64) {
    assert_eq!(a.len(), b.len());
    let (mut sum, mut max, mut n) = (0u64, 0u8, 0usize);
    for (&x, &y) in a.iter().zip(b) {
        let d = x.abs_diff(y);
        sum += u64::from(d);
        max = max.max(d);
        n += usize::from(d > 0);
    }
    let len = a.len().max(1) as f64;
    (sum as f64 / len, max, n as f64 / len)
}

fn assert_frames(what: &str, ours: &[u8], reference: &[u8]) {
    let (mean, max, frac) = byte_stats(ours, reference);
    println!(
        "{what}: 8-bit frames: mean |diff| {mean:.3}, max {max}, {:.2}% of values differ",
        100.0 * frac
    );
    assert!(
        mean <= MAX_MEAN_BYTE_DIFF,
        "{what}: mean byte difference {mean} > {MAX_MEAN_BYTE_DIFF}"
    );
}

fn tiling_of(manifest: &Value, case: &str) -> TilingOptions {
    let c = &manifest["cases"][case];
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    TilingOptions {
        enabled: c["tiling"].as_bool().unwrap(),
        tile_height: n("tile_sample_min_height"),
        tile_width: n("tile_sample_min_width"),
        min_overlap_height: n("tile_sample_min_overlap_height"),
        min_overlap_width: n("tile_sample_min_overlap_width"),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn tiny_fixture_matches_the_host_and_diffusers() {
    let dir = fixture_dir();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let model = ModelDir::open(&dir.join("model")).unwrap();
    let inputs = SafetensorsFile::open(&dir.join("inputs.safetensors")).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let ctx = context();
    let mut gpu = GpuVideoVae::load_on(&ctx, &model).expect("load the video VAE on the GPU");
    let mut host = HostVideoVae::load(&model).unwrap();
    println!(
        "tiny video VAE: {} B of weights on the device",
        gpu.weight_bytes()
    );
    for case in ["tiled", "untiled_3chunks", "min_frames", "no_tiling"] {
        let tiling = tiling_of(&manifest, case);
        gpu.set_tiling(tiling).unwrap();
        host.set_tiling(tiling).unwrap();
        let z = inputs.to_f32(&format!("{case}.latents")).unwrap();
        let lat = denormalize_latents(gpu.config(), &z).unwrap();
        let start = Instant::now();
        let sample = gpu.decode_sample(&lat).expect("GPU decode");
        println!(
            "{case}: {:?} -> {:?} in {:.2?}; plan {:?}",
            z.shape(),
            sample.shape(),
            start.elapsed(),
            gpu.plan()
                .map(|p| (p.tiles_per_batch, p.clips_per_group, p.tokens))
        );
        let reference = expected.to_f32(&format!("{case}.sample")).unwrap();
        assert_close(&format!("{case} vs diffusers"), &sample, &reference);
        let host_sample = host.decode_sample(&lat).unwrap();
        assert_close(&format!("{case} vs host"), &sample, &host_sample);
        let frames = VideoVaeBackend::decode(&mut gpu, &z).unwrap();
        let want = expected.to_u8(&format!("{case}.frames")).unwrap();
        assert_frames(case, &frames.rgb, want.data());
        assert!(frames.pixels.iter().all(|v| (0.0..=1.0).contains(v)));
        // One tile per batch gives the same decode up to GEMM algorithm choices.
        gpu.set_budget(GpuVideoVaeBudget { max_rows: 1 });
        let one = gpu.decode_sample(&lat).unwrap();
        assert_eq!(gpu.plan().unwrap().tiles_per_batch, 1);
        let (rel, _) = compare(
            &format!("{case}: one tile per batch vs batched"),
            &one,
            &sample,
        );
        assert!(rel <= 1e-2, "{rel}");
        gpu.set_budget(GpuVideoVaeBudget::default());
    }
    // A config the GPU path cannot run is refused at load; bad latents are refused before any work.
    let c = gpu.config().latent_channels;
    let bad = TensorF32::new(vec![1, c, 2, 3, 6], vec![0.0; c * 36]).unwrap();
    assert!(gpu.decode_sample(&bad).is_err());
}

/// A seeded random model folder of `config` (f32 weights).
fn write_random_model(dir: &Path, config: &Value, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let parsed = VideoVaeConfig::from_json(config).unwrap();
    let mut rng = Rng::new(seed);
    let mut owned: Vec<(String, TensorF32)> = Vec::new();
    for spec in parsed.tensor_specs() {
        let n: usize = spec.shape.iter().product();
        let name = spec.name.clone();
        let values: Vec<f32> = if name.ends_with("scale1") || name.ends_with("scale2") {
            rng.uniform_vec(n, -0.6, 0.6)
        } else if name.contains("norm") && name.ends_with(".weight") {
            rng.uniform_vec(n, 0.7, 1.3)
        } else if name.ends_with("register_tokens") {
            rng.uniform_vec(n, -1.7, 1.7)
        } else if name.ends_with(".bias") {
            rng.uniform_vec(n, -0.2, 0.2)
        } else {
            // Uniform with standard deviation 1 / sqrt(fan_in).
            let fan_in = spec.shape[1..].iter().product::<usize>().max(1) as f32;
            let a = (3.0 / fan_in).sqrt();
            rng.uniform_vec(n, -a, a)
        };
        owned.push((name, Tensor::new(spec.shape.clone(), values).unwrap()));
    }
    write_f32_safetensors(&dir.join("diffusion_pytorch_model.safetensors"), &owned).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn wider_random_config_matches_the_host() {
    let dir = std::env::temp_dir().join(format!("h3_video_vae_wide_{}", std::process::id()));
    let mut rng = Rng::new(7);
    let c = 16;
    let config = serde_json::json!({
        "_class_name": "AutoencoderKLMiniMaxH3",
        "latent_channels": c,
        "spatial_downsample_factors": [2, 2, 2, 1, 1, 1],
        "decoder_num_layers": 4,
        "decoder_num_attention_heads": 4,
        "decoder_attention_head_dim": 64,
        "decoder_num_register_tokens": 4,
        "decoder_ffn_mult": 4,
        "latents_mean": rng.uniform_vec(c, -0.5, 0.5),
        "latents_std": rng.uniform_vec(c, 0.5, 1.5),
    });
    write_random_model(&dir, &config, 11);
    let model = ModelDir::open(&dir).unwrap();
    let ctx = context();
    let mut gpu = GpuVideoVae::load_on(&ctx, &model).unwrap();
    let mut host = HostVideoVae::load(&model).unwrap();
    // 64 px tiles with 16 px overlap over 96 x 160 px: 2 x 3 tiles of 8 x 8 latents; 12 latent frames: two chunks.
    let tiling = TilingOptions {
        enabled: true,
        tile_height: 64,
        tile_width: 64,
        min_overlap_height: 16,
        min_overlap_width: 16,
    };
    gpu.set_tiling(tiling).unwrap();
    host.set_tiling(tiling).unwrap();
    let shape = vec![1, c, 12, 12, 20];
    let n: usize = shape.iter().product();
    let z = TensorF32::new(shape, rng.uniform_vec(n, -1.7, 1.7)).unwrap();
    let lat = denormalize_latents(gpu.config(), &z).unwrap();
    let start = Instant::now();
    let reference = host.decode_sample(&lat).unwrap();
    println!(
        "wide: host decode {:?} in {:.2?}",
        reference.shape(),
        start.elapsed()
    );
    let start = Instant::now();
    let sample = gpu.decode_sample(&lat).unwrap();
    println!(
        "wide: GPU decode in {:.2?}; plan {:?}",
        start.elapsed(),
        gpu.plan().map(|p| (
            p.tiles_per_clip,
            p.tiles_per_batch,
            p.clips_per_group,
            p.tokens
        ))
    );
    assert_eq!(gpu.plan().unwrap().tiles_per_clip, 6);
    assert_close("wide vs host", &sample, &reference);
    let frames = VideoVaeBackend::decode(&mut gpu, &z).unwrap();
    let host_frames = host.decode(&z).unwrap();
    assert_frames("wide", &frames.rgb, &host_frames.rgb);
    // Two tiles per batch (a clip in three batches) decodes the same video.
    gpu.set_budget(GpuVideoVaeBudget {
        max_rows: 2 * gpu.plan().unwrap().tokens,
    });
    let split = gpu.decode_sample(&lat).unwrap();
    assert_eq!(gpu.plan().unwrap().tiles_per_batch, 2);
    assert_close("wide, two tiles per batch, vs host", &split, &reference);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `tests/python/h3_video_vae_reference.py` left in `TF_H3_VIDEO_VAE_DIR`.
fn full_size_dir() -> PathBuf {
    let dir = std::env::var_os("TF_H3_VIDEO_VAE_DIR").map(PathBuf::from).expect(
        "set TF_H3_VIDEO_VAE_DIR to the folder tests/python/h3_video_vae_reference.py wrote (the bundle step h3-video-vae-ours does)",
    );
    assert!(
        dir.join("reference.json").is_file(),
        "{}: no reference.json",
        dir.display()
    );
    dir
}

fn used_bytes(ctx: &Context) -> u64 {
    let info = ctx.memory_info().expect("cuMemGetInfo");
    info.total - info.free
}

#[test]
#[ignore = "needs an NVIDIA GPU and the folder of tests/python/h3_video_vae_reference.py (bundle step h3-video-vae-ours)"]
fn full_size_decode_against_diffusers() {
    let dir = full_size_dir();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ctx = context();
    let before = used_bytes(&ctx);
    let start = Instant::now();
    let model = ModelDir::open(&dir.join("vae")).unwrap();
    let mut vae = GpuVideoVae::load_on(&ctx, &model).expect("load the full-size decoder");
    let load_s = start.elapsed().as_secs_f64();
    let z = SafetensorsFile::open(&dir.join("latents.safetensors"))
        .unwrap()
        .to_f32("latents")
        .unwrap();
    let start = Instant::now();
    vae.warm_up(z.shape(), Duration::from_secs(60)).unwrap();
    let warm_s = start.elapsed().as_secs_f64();
    let lat = denormalize_latents(vae.config(), &z).unwrap();
    // The model's decode: the first run, then timed runs (the video stays on the device; host post_quant and the
    // latent upload are included).
    let sample = vae.decode_sample(&lat).unwrap();
    let mut decode_s = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        vae.decode_on_device(&lat).unwrap();
        decode_s.push(start.elapsed().as_secs_f64());
    }
    // The pipeline's decode: de-normalization, decode, 8-bit frames, everything read back.
    let start = Instant::now();
    let frames = VideoVaeBackend::decode(&mut vae, &z).unwrap();
    let pipeline_s = start.elapsed().as_secs_f64();
    let peak = used_bytes(&ctx).saturating_sub(before);
    let fp32 = SafetensorsFile::open(&dir.join("sample_fp32.safetensors"))
        .unwrap()
        .to_f32("sample")
        .unwrap();
    let (rel, cos) = compare("full size vs diffusers fp32", &sample, &fp32);
    let floor = reference["floor_rel_l2"].as_f64().unwrap();
    let ratio = rel / floor;
    let frames_fp32 = SafetensorsFile::open(&dir.join("frames_fp32.safetensors"))
        .unwrap()
        .to_u8("frames")
        .unwrap();
    let (mean, max, frac) = byte_stats(&frames.rgb, frames_fp32.data());
    decode_s.sort_by(f64::total_cmp);
    let ours = decode_s[decode_s.len() / 2];
    let theirs = reference["bf16_decode_s_median"].as_f64().unwrap();
    let summary = serde_json::json!({
        "latents_shape": z.shape(),
        "video": [frames.frames, frames.height, frames.width],
        "load_s": load_s,
        "warm_up_s": warm_s,
        "decode_s": decode_s,
        "decode_s_median": ours,
        "pipeline_decode_s": pipeline_s,
        "diffusers_bf16_decode_s_median": theirs,
        "diffusers_pipeline_decode_s": reference["bf16_pipeline_decode_s"],
        "speedup_vs_diffusers_bf16": theirs / ours,
        "rel_l2_vs_fp32": rel,
        "cosine_vs_fp32": cos,
        "floor_rel_l2": floor,
        "ratio_to_floor": ratio,
        "frames_mean_abs_diff_vs_fp32": mean,
        "frames_max_diff_vs_fp32": max,
        "frames_fraction_differing_vs_fp32": frac,
        "floor_frames_mean_abs_diff": reference["floor_frames_mean_abs_diff"],
        "floor_frames_fraction_differing": reference["floor_frames_fraction_differing"],
        "device_bytes_used": peak,
        "resident_bytes": vae.resident_bytes(),
        "weight_bytes": vae.weight_bytes(),
        "diffusers_bf16_peak_bytes": reference["bf16_peak_bytes"],
        "plan": vae.plan().map(|p| format!("{p:?}")),
    });
    println!("{}", serde_json::to_string_pretty(&summary).unwrap());
    if let Some(out) = std::env::var_os("TF_H3_VIDEO_VAE_JSON") {
        std::fs::write(out, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    }
    println!(
        "full size: decode {ours:.3} s (diffusers bf16 {theirs:.3} s, {:.2}x), relative L2 {rel:.3e} = {ratio:.2} x the bf16 floor {floor:.3e}",
        theirs / ours
    );
    assert!(
        ratio <= FLOOR_RATIO_MAX,
        "relative L2 {rel:e} is {ratio:.2} x the floor {floor:e} (> {FLOOR_RATIO_MAX})"
    );
    assert!(cos >= COSINE_MIN, "cosine {cos}");
}
