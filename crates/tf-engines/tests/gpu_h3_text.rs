//! MiniMax H3's text conditioning on the GPU (`H3TextEncoder::load_gpu`, the shared Qwen3-VL GPU encoder behind
//! `H3TextBackend`) against transformers and the host reference.
//!
//! - `tiny_fixture_matches_transformers_and_the_host`: the committed fixture (tests/fixtures/minimax_h3_text: 6
//!   layers, head dim 128) through the whole component on the GPU, every case at layers 4 and 5, against the
//!   transformers fp32 features and the host component; ids identical to the host's.
//! - `full_width_layers_match_the_host`: Qwen3-VL-32B's width (hidden 5120, 64 query and 8 key/value heads of 128,
//!   MLP 25600) with 4 random layers written by the test as bf16 (so both sides read identical weights), 1, 37 and
//!   150 rows, hidden states 1, 2 and 4 of the GPU backend against the host backend through `H3TextBackend`; device
//!   time of a 128-row forward to layer 4 printed; there, an encoder capped at 2 layers against the uncapped one.
//! - `capped_loads_match_the_full_load_bit_for_bit`: the fixture's encoder loaded as H3's component loads it
//!   (capped at the layer read, 4 and 5 of 6) against the uncapped load: every reachable hidden state identical
//!   bit for bit, smaller weight and resident bytes, a layer past the cap refused naming both numbers.
//!
//! Bounds: the GPU keeps activations in bf16 (unit roundoff 2^-9, rounded about ten times per layer), so a few
//! layers land around 1e-2 relative L2 from the f32 reference; a wrong head mapping, RoPE pairing or causal mask
//! gives order-1 errors. `REL_L2_MAX` and `COSINE_MIN` sit between the two, as in gpu_text_encoder.rs.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tf_cuda::{Context, Driver};
use tf_engines::minimax_h3::text::{load_gpu_backend, H3TextBackend, H3TextEncoder, H3TextOptions};
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::upload::StagingConfig;
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen3_vl::text_encoder::{HostTextEncoder, LoadOptions, TextEncoderConfig};
use tf_engines::qwen3_vl::text_encoder_gpu::GpuTextEncoder;
use tf_tokenizer::templates::PromptMarkup;

const REL_L2_MAX: f64 = 3e-2;
const COSINE_MIN: f64 = 0.999;

fn context() -> Context {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    Context::new(driver, 0).expect("create a context on device 0")
}

fn fixtures() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/minimax_h3_text");
        if p.is_dir() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_text")
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += f64::from(x) * f64::from(y);
        aa += f64::from(x) * f64::from(x);
        bb += f64::from(y) * f64::from(y);
    }
    ab / (aa.sqrt() * bb.sqrt()).max(f64::MIN_POSITIVE)
}

/// Compares, prints and bounds; returns the relative L2.
fn assert_close(what: &str, ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    assert!(ours.iter().all(|v| v.is_finite()), "{what}: non-finite");
    let rel = relative_l2(ours, reference).unwrap();
    let cos = cosine(ours, reference);
    println!(
        "{what}: {} values, relative L2 {rel:.3e} (max {REL_L2_MAX:e}), cosine {cos:.6} (min {COSINE_MIN})",
        ours.len()
    );
    assert!(rel <= REL_L2_MAX, "{what}: relative L2 {rel:.3e}");
    assert!(cos >= COSINE_MIN, "{what}: cosine {cos:.6}");
    rel
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn tiny_fixture_matches_transformers_and_the_host() {
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
            .unwrap();
    let expected = SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap();
    let dir = fixtures().join("model");
    let mut worst = (0f64, 0f64);
    for layer in [4usize, 5] {
        for markup in [PromptMarkup::Allowed, PromptMarkup::Forbidden] {
            let options = H3TextOptions {
                layer,
                markup,
                ..H3TextOptions::default()
            };
            let mut gpu = H3TextEncoder::load_gpu(&ctx, &dir, options.clone()).expect("GPU load");
            let mut host = H3TextEncoder::load_host(&dir, options).expect("host load");
            assert_eq!(gpu.backend_name(), "gpu");
            for case in manifest["cases"].as_array().unwrap() {
                let name = case["case"].as_str().unwrap();
                let case_markup = match case["markup"].as_str().unwrap() {
                    "forbidden" => PromptMarkup::Forbidden,
                    _ => PromptMarkup::Allowed,
                };
                if case_markup != markup {
                    continue;
                }
                let prompt = case["prompt"].as_str().unwrap();
                let ours = gpu.encode(prompt).expect("GPU encode");
                let reference = host.encode(prompt).expect("host encode");
                assert_eq!(ours.ids, reference.ids, "{name}: ids");
                let want: Vec<i64> = expected.to_i64(&format!("{name}.ids")).unwrap().into_data();
                let got: Vec<i64> = ours.ids.iter().map(|&i| i64::from(i)).collect();
                assert_eq!(got, want, "{name}: ids against the fixture");
                let transformers = expected.to_f32(&format!("{name}.layer{layer}")).unwrap();
                assert_eq!(ours.features.shape(), transformers.shape());
                let a = assert_close(
                    &format!(
                        "{name} hidden_states[{layer}] ({} tokens) vs transformers fp32",
                        got.len()
                    ),
                    ours.features.data(),
                    transformers.data(),
                );
                let b = assert_close(
                    &format!("{name} hidden_states[{layer}] vs the host component"),
                    ours.features.data(),
                    reference.features.data(),
                );
                worst = (worst.0.max(a), worst.1.max(b));
            }
        }
    }
    println!(
        "worst relative L2: {:.3e} against transformers, {:.3e} against the host",
        worst.0, worst.1
    );
    let after = tf_cuda::usage().device;
    assert_eq!(
        after, baseline,
        "every encoder must free its device buffers"
    );
}

/// Qwen3-VL-32B's text width with `layers` layers and a small vocabulary.
fn full_width(layers: usize) -> TextEncoderConfig {
    TextEncoderConfig {
        vocab_size: 4096,
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

/// Writes a Qwen3-VL text model of `config` with seeded bf16 weights (linear ~ U(-a, a), a = 1/sqrt(fan_in);
/// norms in [0.8, 1.2]; embeddings in [-1, 1]).
fn write_random_model(dir: &Path, c: &TextEncoderConfig, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let json = serde_json::json!({
        "model_type": "qwen3_vl",
        "text_config": {
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": "silu", "attention_bias": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": true}
        }
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let (h, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (qo, kvo) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    let p = "model.language_model.";
    let mut specs: Vec<(String, Vec<usize>, f32, f32)> = vec![
        (
            format!("{p}embed_tokens.weight"),
            vec![c.vocab_size, h],
            -1.0,
            1.0,
        ),
        (format!("{p}norm.weight"), vec![h], 0.8, 1.2),
    ];
    for i in 0..c.num_hidden_layers {
        let l = format!("{p}layers.{i}.");
        specs.extend([
            (format!("{l}input_layernorm.weight"), vec![h], 0.8, 1.2),
            (
                format!("{l}self_attn.q_proj.weight"),
                vec![qo, h],
                -lin(h),
                lin(h),
            ),
            (
                format!("{l}self_attn.k_proj.weight"),
                vec![kvo, h],
                -lin(h),
                lin(h),
            ),
            (
                format!("{l}self_attn.v_proj.weight"),
                vec![kvo, h],
                -lin(h),
                lin(h),
            ),
            (format!("{l}self_attn.q_norm.weight"), vec![hd], 0.8, 1.2),
            (format!("{l}self_attn.k_norm.weight"), vec![hd], 0.8, 1.2),
            (
                format!("{l}self_attn.o_proj.weight"),
                vec![h, qo],
                -lin(qo),
                lin(qo),
            ),
            (
                format!("{l}post_attention_layernorm.weight"),
                vec![h],
                0.8,
                1.2,
            ),
            (
                format!("{l}mlp.gate_proj.weight"),
                vec![f, h],
                -lin(h),
                lin(h),
            ),
            (
                format!("{l}mlp.up_proj.weight"),
                vec![f, h],
                -lin(h),
                lin(h),
            ),
            (
                format!("{l}mlp.down_proj.weight"),
                vec![h, f],
                -lin(f),
                lin(f),
            ),
        ]);
    }
    let mut rng = Rng::new(seed);
    let blobs: Vec<(String, Vec<usize>, Vec<u8>)> = specs
        .into_iter()
        .map(|(name, shape, lo, hi)| {
            let n: usize = shape.iter().product();
            let mut bytes = Vec::with_capacity(2 * n);
            for _ in 0..n {
                bytes.extend_from_slice(&half::bf16::from_f32(rng.uniform(lo, hi)).to_le_bytes());
            }
            (name, shape, bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = blobs
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                shape.clone(),
                bytes,
            )
            .unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn full_width_layers_match_the_host() {
    let config = full_width(4);
    let dir = std::env::temp_dir().join(format!("tf-gpu-h3-text-{}", std::process::id()));
    let started = Instant::now();
    write_random_model(&dir, &config, 2030);
    println!(
        "full width, 4 layers: bf16 folder written in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let model = ModelDir::open(&dir).unwrap();
    let started = Instant::now();
    let host = HostTextEncoder::load(&model).expect("host load");
    println!("host load {:.1} s", started.elapsed().as_secs_f64());
    let ctx = context();
    let mut gpu = GpuTextEncoder::load_on(&ctx, &model).expect("GPU load");
    println!(
        "GPU: {:.2} GB of weights; upload {}",
        gpu.weight_bytes() as f64 / 1e9,
        gpu.upload_stats()
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert_eq!(H3TextBackend::config(&gpu), host.config());
    let mut rng = Rng::new(5);
    for rows in [1usize, 37, 150] {
        let ids: Vec<u32> = (0..rows)
            .map(|_| rng.below(config.vocab_size) as u32)
            .collect();
        // Every hidden state of the host reference in one pass.
        let started = Instant::now();
        let states = host.hidden_states(&ids, 0).expect("host");
        let host_s = started.elapsed().as_secs_f64();
        for layer in [1usize, 2, 4] {
            let got = H3TextBackend::features_at(&mut gpu, &ids, layer).expect("GPU");
            assert_eq!(got.shape(), &[rows, config.hidden_size]);
            assert_close(
                &format!("{rows} rows, hidden_states[{layer}] (host pass {host_s:.1} s)"),
                got.data(),
                states[layer].data(),
            );
        }
    }
    let ids: Vec<u32> = (0..128)
        .map(|_| rng.below(config.vocab_size) as u32)
        .collect();
    let ms = gpu.time_forward(&ids, 10).expect("time the forward");
    println!(
        "128 rows to hidden_states[4] at full width: {ms:.3} ms device ({:.3} ms per layer)",
        ms / 4.0
    );
    // Capped at 2 layers: hidden states 0..=2 are the uncapped encoder's bit for bit, with 2 layers fewer held.
    let mut capped = GpuTextEncoder::load_with_options(
        &ctx,
        &model,
        StagingConfig::default(),
        LoadOptions::up_to_layer(2),
    )
    .expect("capped GPU load");
    assert_eq!(capped.loaded_layers(), 2);
    let layer_bytes = (gpu.weight_bytes() - capped.weight_bytes()) / 2;
    println!(
        "capped at 2 of 4 layers: {:.2} GB of weights instead of {:.2} GB ({:.3} GB a layer)",
        capped.weight_bytes() as f64 / 1e9,
        gpu.weight_bytes() as f64 / 1e9,
        layer_bytes as f64 / 1e9
    );
    assert!(
        layer_bytes > 400_000_000,
        "{layer_bytes} B a full-width layer"
    );
    for layer in 0..=2 {
        assert_eq!(
            capped.features_at(&ids, layer).expect("capped"),
            gpu.features_at(&ids, layer).expect("uncapped"),
            "full width, hidden_states[{layer}]"
        );
    }
    assert!(capped.resident_bytes() < gpu.resident_bytes());
    assert!(capped.features_at(&ids, 3).is_err());
    drop(capped);
    drop(gpu);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn capped_loads_match_the_full_load_bit_for_bit() {
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    let model = ModelDir::open(&fixtures().join("model/text_encoder")).unwrap();
    let mut full = GpuTextEncoder::load_on(&ctx, &model).expect("GPU load");
    let layers = full.config().num_hidden_layers;
    assert_eq!(full.loaded_layers(), layers);
    let mut rng = Rng::new(11);
    let vocab = full.config().vocab_size;
    let ids: Vec<u32> = (0..77).map(|_| rng.below(vocab) as u32).collect();
    let reference: Vec<_> = (0..=layers)
        .map(|layer| full.features_at(&ids, layer).expect("uncapped features"))
        .collect();
    // The capped loads share one device stream, as a pipeline's components do.
    let device = tf_engines::nn::gpu::GpuDevice::on(&ctx).expect("a stream");
    for layer in [4usize, 5] {
        let mut capped = load_gpu_backend(&device, &model, layer).expect("capped GPU load");
        assert_eq!(capped.loaded_layers(), layer);
        assert_eq!(capped.config(), full.config());
        for (k, want) in reference.iter().enumerate().take(layer + 1) {
            let got = capped.features_at(&ids, k).expect("capped features");
            assert!(got.data().iter().all(|v| v.is_finite()));
            assert_eq!(&got, want, "capped at {layer}: hidden_states[{k}]");
        }
        println!(
            "capped at {layer} of {layers}: weights {} B (uncapped {} B), resident {} B (uncapped {} B)",
            capped.weight_bytes(),
            full.weight_bytes(),
            capped.resident_bytes(),
            full.resident_bytes()
        );
        assert!(capped.weight_bytes() < full.weight_bytes());
        assert!(capped.resident_bytes() < full.resident_bytes());
        let err = capped.features_at(&ids, layer + 1).unwrap_err().to_string();
        assert!(
            err.contains(&format!("hidden_states[{}]", layer + 1))
                && err.contains(&format!("0..{layer}"))
                && err.contains(&format!("{layers}")),
            "{err}"
        );
        // The component loads with the same cap.
        let options = H3TextOptions {
            layer,
            ..H3TextOptions::default()
        };
        let text = H3TextEncoder::load_gpu(&ctx, &fixtures().join("model"), options).expect("load");
        assert_eq!(text.weight_bytes(), capped.weight_bytes());
    }
    drop(full);
    assert_eq!(
        tf_cuda::usage().device,
        baseline,
        "every encoder must free its device buffers"
    );
}
