//! The GPU VAE decoder against the diffusers fixture (tests/fixtures/qwen_vae) and the host reference, and at
//! the released widths (decoder_base_dim 144, z 64) with seeded random weights: parity with the host decoder on
//! a 4 x 4 latent, then the time and device memory of a 64 x 64 latent (a 1024 x 1024 image). On sm_90 both
//! 3x3 conv paths (implicit GEMM, the default, and im2col + cuBLASLt) are held to the host and to each other.
//!
//! Tolerance: weights and activations are bf16 with f32 accumulation and f32 norms, so the distance to the f32
//! references is a few bf16 roundoffs (2^-8) compounded over ~40 layers. `REL_L2_MAX` 5e-2 and `COSINE_MIN`
//! 0.998 separate that from structural errors (a wrong tap order, channel map or residual gives errors of order
//! one). Every comparison prints both figures.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/gpu.rs"]
mod gpu_support;
use gpu_support::{context, cosine};
#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::{Path, PathBuf};
use std::time::Instant;
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;

use serde_json::Value;
use tf_cuda::Context;
use tf_engines::nn::tensor::{relative_l2, Tensor, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen_image::components::VaeBackend;
use tf_engines::qwen_image::vae::{to_u8_hwc, HostVaeDecoder, VaeConfig};
use tf_engines::qwen_image::vae_gpu::{ConvPath, GpuVaeBudget, GpuVaeDecoder};

const REL_L2_MAX: f64 = 5e-2;
const COSINE_MIN: f64 = 0.998;

/// tests/fixtures/qwen_vae: in the GPU bundle (`TF_BUNDLE_DIR`), in the checkout, or next to the test binary.
fn fixture_dir() -> PathBuf {
    fixture_dir::find("qwen_vae")
}

fn assert_close(what: &str, actual: &TensorF32, reference: &TensorF32) {
    assert_eq!(actual.shape(), reference.shape(), "{what}: shape");
    assert!(
        actual
            .data()
            .iter()
            .all(|v| v.is_finite() && v.abs() <= 1.0),
        "{what}: values outside [-1, 1] or not finite"
    );
    let rel = relative_l2(actual.data(), reference.data()).expect("same length");
    let cos = cosine(actual.data(), reference.data());
    let max_abs = actual
        .data()
        .iter()
        .zip(reference.data())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let clamped = reference.data().iter().filter(|v| v.abs() >= 1.0).count();
    println!(
        "{what}: {:?} relative L2 {rel:.3e}, cosine {cos:.6}, max |diff| {max_abs:.3e} ({clamped} of {} reference values clamped)",
        actual.shape(),
        reference.data().len()
    );
    assert!(
        rel <= REL_L2_MAX,
        "{what}: relative L2 {rel:e} > {REL_L2_MAX:e}"
    );
    assert!(cos >= COSINE_MIN, "{what}: cosine {cos} < {COSINE_MIN}");
}

fn used_bytes(ctx: &Context) -> u64 {
    let info = ctx.memory_info().expect("cuMemGetInfo");
    info.total - info.free
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn tiny_fixture_matches_diffusers_and_the_host_decoder() {
    let dir = fixture_dir();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let (h, w) = (
        manifest["latent_height"].as_u64().unwrap() as usize,
        manifest["latent_width"].as_u64().unwrap() as usize,
    );
    let model = ModelDir::open(&dir.join("model")).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let packed = expected.to_f32("packed_latents").unwrap();
    let reference = expected.to_f32("image").unwrap();
    let ctx = context();
    let mut gpu = GpuVaeDecoder::load_on(&ctx, &model).expect("load the VAE on the GPU");
    println!(
        "tiny VAE: {} B of weights on the device",
        gpu.weight_bytes()
    );
    let start = Instant::now();
    let image = gpu.decode_packed(&packed, h, w).expect("GPU decode");
    println!(
        "tiny VAE decode {:?} -> {:?} in {:.2?} (first call, plans and allocates); plan {:?}",
        packed.shape(),
        image.shape(),
        start.elapsed(),
        gpu.buffer_plan()
    );
    assert_close("tiny vs diffusers", &image, &reference);
    let mut host = HostVaeDecoder::load(&model).unwrap();
    let host_image = VaeBackend::decode_packed(&mut host, &packed, h, w).unwrap();
    assert_close("tiny vs host", &image, &host_image);

    // The second image of the batch alone gives the second image of the batch.
    let one = Tensor::new(
        vec![1, h * w, packed.shape()[2]],
        packed.data()[h * w * packed.shape()[2]..].to_vec(),
    )
    .unwrap();
    let single = gpu.decode_packed(&one, h, w).unwrap();
    let per_image = image.data().len() / 2;
    assert_eq!(
        single.data(),
        &image.data()[per_image..],
        "batch of one vs batch of two"
    );

    // The pixels made on the device are the host conversion's bytes of the same decode, with or without the f32
    // images brought back.
    let expected_pixels = to_u8_hwc(&image, 0).unwrap();
    let kept = gpu.decode_packed_pixels(&packed, h, w, true).unwrap();
    let kept_images = kept.images.as_ref().expect("images kept when asked");
    assert_eq!(
        kept_images.data(),
        image.data(),
        "decode_packed_pixels changed the images"
    );
    assert_eq!(kept.pixels, expected_pixels, "device pixels vs to_u8_hwc");
    let lean = gpu.decode_packed_pixels(&packed, h, w, false).unwrap();
    assert!(lean.images.is_none(), "images brought back unasked");
    assert_eq!(lean.pixels, expected_pixels, "pixels without the images");
    let [_, channels, height, width] = image.dims::<4>("image").unwrap();
    assert_eq!(
        (lean.channels, lean.height, lean.width),
        (channels, height, width)
    );
    println!(
        "device pixels: {} bytes, equal to the host conversion of the f32 image",
        lean.pixels.len()
    );

    // Tiny budgets: conv bands of one row and one query row per score chunk; same result up to GEMM order.
    gpu.set_budget(GpuVaeBudget {
        cols_bytes: 1,
        scores_bytes: 1,
    });
    let banded = gpu.decode_packed(&packed, h, w).unwrap();
    let plan = gpu.buffer_plan().unwrap();
    println!("banded plan: {plan:?}");
    assert_eq!(plan.score_rows, 1);
    let rel = relative_l2(banded.data(), image.data()).unwrap();
    println!("one-row bands vs whole-map bands: relative L2 {rel:.3e}");
    assert!(rel < 1e-2, "banding changed the result: {rel:e}");

    // Bad shapes are errors, not launches.
    assert!(gpu.decode_packed(&packed, w, h + 1).is_err());
    assert!(gpu.decode_packed(&packed, 0, 0).is_err());
}

/// Every decoder tensor of `config` with its shape and how it is drawn: (name, shape, offset, scale).
fn decoder_tensors(config: &VaeConfig) -> Vec<(String, Vec<usize>, f32, f32)> {
    let mut out = Vec::new();
    let conv = |out: &mut Vec<(String, Vec<usize>, f32, f32)>,
                name: &str,
                i: usize,
                o: usize,
                k: usize,
                gain: f32| {
        // Uniform with variance 1 / fan_in (times gain^2): unit-scale outputs from unit-scale inputs.
        let bound = gain * (3.0 / (i * k * k) as f32).sqrt();
        out.push((format!("{name}.weight"), vec![o, i, k, k], 0.0, bound));
        out.push((format!("{name}.bias"), vec![o], 0.0, 0.05));
    };
    let norm = |out: &mut Vec<(String, Vec<usize>, f32, f32)>, name: &str, shape: Vec<usize>| {
        out.push((name.to_string(), shape, 1.0, 0.2));
    };
    let resnet = |out: &mut Vec<(String, Vec<usize>, f32, f32)>, name: &str, i: usize, o: usize| {
        norm(out, &format!("{name}.norm1.gamma"), vec![i, 1, 1, 1]);
        conv(out, &format!("{name}.conv1"), i, o, 3, 1.0);
        norm(out, &format!("{name}.norm2.gamma"), vec![o, 1, 1, 1]);
        conv(out, &format!("{name}.conv2"), o, o, 3, 0.5);
        if i != o {
            conv(out, &format!("{name}.conv_shortcut"), i, o, 1, 1.0);
        }
    };
    let z = config.z_dim;
    let dims = config.decoder_dims();
    let mid = dims[0];
    conv(&mut out, "post_quant_conv", z, z, 1, 1.0);
    conv(&mut out, "decoder.conv_in", z, mid, 3, 1.0);
    resnet(&mut out, "decoder.mid_block.resnets.0", mid, mid);
    resnet(&mut out, "decoder.mid_block.resnets.1", mid, mid);
    let a = "decoder.mid_block.attentions.0";
    norm(&mut out, &format!("{a}.norm.gamma"), vec![mid, 1, 1]);
    conv(&mut out, &format!("{a}.to_qkv"), mid, 3 * mid, 1, 1.0);
    conv(&mut out, &format!("{a}.proj"), mid, mid, 1, 0.5);
    let levels = config.dim_mult.len();
    for (i, pair) in dims.windows(2).enumerate() {
        for r in 0..=config.num_res_blocks {
            let from = if r == 0 { pair[0] } else { pair[1] };
            resnet(
                &mut out,
                &format!("decoder.up_blocks.{i}.resnets.{r}"),
                from,
                pair[1],
            );
        }
        if i + 1 != levels {
            conv(
                &mut out,
                &format!("decoder.up_blocks.{i}.upsampler.resample.1"),
                pair[1],
                pair[1],
                3,
                0.5,
            );
        }
    }
    let last = *dims.last().unwrap();
    norm(&mut out, "decoder.norm_out.gamma", vec![last, 1, 1, 1]);
    conv(
        &mut out,
        "decoder.conv_out",
        last,
        config.out_channels,
        3,
        0.3,
    );
    out
}

/// Writes a VAE folder with the released config and seeded bf16 weights; returns the folder.
fn write_full_size_model(dir: &Path, seed: u64) -> VaeConfig {
    let mut rng = Rng::new(seed);
    let z = 64;
    let mean: Vec<f32> = (0..z).map(|_| 0.5 * rng.uniform(-1.0, 1.0)).collect();
    let std: Vec<f32> = (0..z).map(|_| 1.0 + 0.5 * rng.uniform(-1.0, 1.0)).collect();
    let json = serde_json::json!({"_class_name": "AutoencoderKLQwenImage21", "attn_scales": [], "base_dim": 96,
        "decoder_base_dim": 144, "dim_mult": [1, 2, 4, 8, 8], "in_channels": 4, "is_residual": true,
        "latents_mean": mean, "latents_std": std, "num_res_blocks": 2, "out_channels": 4, "patch_size": null,
        "temperal_downsample": [false, true, true, true], "z_dim": z});
    let config = VaeConfig::from_json(&json).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&json).unwrap(),
    )
    .unwrap();
    let specs = decoder_tensors(&config);
    let mut blobs = Vec::with_capacity(specs.len());
    let mut params = 0usize;
    for (name, shape, offset, scale) in &specs {
        let n: usize = shape.iter().product();
        params += n;
        let mut bytes = Vec::with_capacity(2 * n);
        for _ in 0..n {
            let v = offset + scale * rng.uniform(-1.0, 1.0);
            bytes.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
        }
        blobs.push((name.clone(), shape.clone(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = blobs
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                shape.clone(),
                bytes,
            )
            .expect("tensor view");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(
        views,
        None,
        &dir.join("diffusion_pytorch_model.safetensors"),
    )
    .expect("write the weights");
    println!(
        "full-size VAE: {params} decoder parameters written as bf16 to {}",
        dir.display()
    );
    config
}

fn random_packed(seed: u64, tokens: usize, z: usize) -> TensorF32 {
    let mut rng = Rng::new(seed);
    let data = (0..tokens * z)
        .map(|_| 1.7 * rng.uniform(-1.0, 1.0))
        .collect();
    Tensor::new(vec![1, tokens, z], data).unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn full_size_matches_the_host_and_decodes_1024_squared() {
    let dir = std::env::temp_dir().join(format!("tf-gpu-vae-full-{}", std::process::id()));
    let started = Instant::now();
    let config = write_full_size_model(&dir, 0x5eed_0001);
    println!("weights generated and written in {:.2?}", started.elapsed());
    let model = ModelDir::open(&dir).unwrap();
    let ctx = context();
    let before = used_bytes(&ctx);
    let start_usage = tf_cuda::usage();
    {
        let started = Instant::now();
        let mut gpu =
            GpuVaeDecoder::load_on(&ctx, &model).expect("load the full-size VAE on the GPU");
        let after_load = used_bytes(&ctx);
        println!(
            "loaded in {:.2?}: {:.1} MiB of weights, device usage +{:.1} MiB",
            started.elapsed(),
            gpu.weight_bytes() as f64 / 1048576.0,
            (after_load - before) as f64 / 1048576.0
        );

        // Parity at full width on a 4 x 4 latent (64 x 64 image) against the f32 host decoder.
        let small = random_packed(7, 16, config.z_dim);
        let started = Instant::now();
        let gpu_small = gpu.decode_packed(&small, 4, 4).expect("GPU decode 4x4");
        println!("GPU 4x4 decode (first call) {:.2?}", started.elapsed());
        let host = HostVaeDecoder::load(&model).unwrap();
        let started = Instant::now();
        let host_small = host.decode_packed(&small, 4, 4).unwrap();
        println!("host 4x4 decode {:.2?}", started.elapsed());
        drop(host);
        assert_close("full-size 4x4 vs host", &gpu_small, &host_small);
        // On sm_90 the 3x3 convs run as implicit GEMMs by default: the column-matrix path must agree too.
        let implicit = gpu.uses_implicit_convs();
        println!("3x3 convs as implicit GEMMs: {implicit}");
        if implicit {
            gpu.set_conv_path(ConvPath::Im2col);
            let im2col_small = gpu
                .decode_packed(&small, 4, 4)
                .expect("GPU decode 4x4, im2col");
            assert_close(
                "full-size 4x4 (im2col convs) vs host",
                &im2col_small,
                &host_small,
            );
            gpu.set_conv_path(ConvPath::Implicit);
        }
        let spread = host_small
            .data()
            .iter()
            .map(|v| f64::from(v.abs()))
            .sum::<f64>()
            / host_small.data().len() as f64;
        println!("host image mean |value| {spread:.3}");
        assert!(
            spread > 0.01,
            "the random model decodes to a flat image: nothing is tested"
        );

        // 64 x 64 latent -> 1024 x 1024: first call plans and allocates, the next ones are timed.
        let big = random_packed(11, 64 * 64, config.z_dim);
        let started = Instant::now();
        let first = gpu.decode_packed(&big, 64, 64).expect("GPU decode 64x64");
        println!("GPU 64x64 decode (first call) {:.2?}", started.elapsed());
        assert_eq!(first.shape(), &[1, 4, 1024, 1024]);
        assert!(
            first.data().iter().all(|v| v.is_finite()),
            "non-finite pixels"
        );
        if implicit {
            gpu.set_conv_path(ConvPath::Im2col);
            let im2col = gpu
                .decode_packed(&big, 64, 64)
                .expect("GPU decode 64x64, im2col");
            gpu.set_conv_path(ConvPath::Implicit);
            assert_close("1024x1024 implicit vs im2col convs", &first, &im2col);
            gpu.set_conv_path(ConvPath::ImplicitTall);
            let tall = gpu
                .decode_packed(&big, 64, 64)
                .expect("GPU decode 64x64, 256-pixel tiles");
            gpu.set_conv_path(ConvPath::Implicit);
            assert_close(
                "1024x1024 implicit (256-pixel tiles) vs im2col convs",
                &tall,
                &im2col,
            );
        }
        let mut times = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let again = gpu.decode_packed(&big, 64, 64).unwrap();
            times.push(started.elapsed().as_secs_f64() * 1e3);
            let drift = relative_l2(again.data(), first.data()).unwrap();
            assert!(
                drift <= 1e-6,
                "repeated decode differs: relative L2 {drift:e}"
            );
        }
        // The pipeline's path: the 8-bit pixels made on the device. With the images kept, they are the host
        // conversion's bytes of the same decode; without (what the pipeline runs), timed.
        let kept = gpu.decode_packed_pixels(&big, 64, 64, true).unwrap();
        let kept_images = kept.images.as_ref().expect("images kept when asked");
        assert!(
            kept.pixels == to_u8_hwc(kept_images, 0).unwrap(),
            "1024x1024 device pixels differ from the host conversion of the same decode"
        );
        let mut pixel_times = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            let lean = gpu.decode_packed_pixels(&big, 64, 64, false).unwrap();
            pixel_times.push(started.elapsed().as_secs_f64() * 1e3);
            let worst = lean
                .pixels
                .iter()
                .zip(&kept.pixels)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap_or(0);
            assert!(worst <= 1, "repeated decode to pixels differs by {worst}");
        }
        println!("1024x1024 decode to 8-bit pixels (no f32 image back): {pixel_times:.1?} ms");
        let after_decode = used_bytes(&ctx);
        let plan = gpu.buffer_plan().unwrap();
        println!(
            "1024x1024 decode: {:.1} ms (best of 3; all {times:.1?}); resident {:.1} MiB (weights {:.1}, workspace {:.1}); \
             device usage +{:.1} MiB over the start; plan {plan:?}",
            times.iter().copied().fold(f64::INFINITY, f64::min),
            gpu.resident_bytes() as f64 / 1048576.0,
            gpu.weight_bytes() as f64 / 1048576.0,
            plan.bytes() as f64 / 1048576.0,
            (after_decode - before) as f64 / 1048576.0
        );
        let mean_abs = first.data().iter().map(|v| f64::from(v.abs())).sum::<f64>()
            / first.data().len() as f64;
        let clamped = first.data().iter().filter(|v| v.abs() >= 1.0).count();
        println!(
            "1024x1024 image: mean |value| {mean_abs:.3}, {clamped} of {} values clamped",
            first.data().len()
        );
    }
    ctx.synchronize().unwrap();
    let after_drop = used_bytes(&ctx);
    let end_usage = tf_cuda::usage();
    println!(
        "after drop: driver-reported usage {:+.1} MiB relative to before the load (library code included); \
         runtime buffers {:?} (peak {:.1} MiB) -> {:?}",
        (after_drop as f64 - before as f64) / 1048576.0,
        start_usage.device,
        end_usage.device_peak as f64 / 1048576.0,
        end_usage.device
    );
    assert_eq!(
        end_usage.device, start_usage.device,
        "device bytes left behind after drop"
    );
    assert_eq!(
        end_usage.device_allocs, start_usage.device_allocs,
        "device allocations left behind after drop"
    );
    std::fs::remove_dir_all(&dir).ok();
}
