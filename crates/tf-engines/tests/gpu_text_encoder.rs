//! The GPU text encoder (`GpuTextEncoder`, shared norm, RoPE and embedding kernels) against the host reference.
//!
//! - `text_kernels_match_the_host_ops`: each new kernel on its own against `ops::host` / the host encoder's
//!   rotate-half RoPE (embedding gather exact; RMSNorm and QK-norm + RoPE within bf16 rounding).
//! - `tiny_encoder_matches_the_host_reference`: a tiny Qwen3-VL text config with head dim 128 (the committed
//!   transformers fixture has head dim 16, which the GPU path refuses), random weights written by the test
//!   as bf16-representable f32 so both sides use identical weights; prompts of 1, 7 and 130 rows with template
//!   rows dropped; relative L2 and cosine printed and bounded.
//! - `full_size_encode_timing`: the Qwen3-VL-8B text config with seeded random weights made on the device;
//!   128- and 512-token encodes timed (device ms, GB/s of weight streaming), resident bytes, and device
//!   memory back to where it was after drop.
//!
//! Tolerance of the tiny comparison: activations are stored as bf16 (unit roundoff 2^-9 relative, 2^-8
//! between neighbours) and rounded at about ten points per layer, so a two-layer encoder lands around 1e-2
//! relative L2 from the f32 reference; a wrong RoPE pairing, head mapping or causal mask gives errors of order
//! 1. `REL_L2_MAX` and `COSINE_MIN` sit between the two.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tf_engines::nn::sampling::seeded::SplitMix64 as Rng;

use tf_cuda::{Context, DeviceBuffer, Driver, Stream};
use tf_engines::nn::gpu::{rotate_half_rope_tables, NnKernels, QkNormRope};
use tf_engines::nn::gpu::{AttentionTile, Matrix};
use tf_engines::nn::host;
use tf_engines::nn::host::rope_rotate_half;
use tf_engines::nn::tensor::{relative_l2, Tensor};
use tf_engines::nn::upload::StagingConfig;
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir};
use tf_engines::qwen3_vl::text_encoder::{HostTextEncoder, TextEncoderConfig};
use tf_engines::qwen3_vl::text_encoder_gpu::GpuTextEncoder;
use tf_engines::qwen_image::components::TextEncoderBackend;

const REL_L2_MAX: f64 = 3e-2;
const COSINE_MIN: f64 = 0.999;
const EPS: f32 = 1e-6;

fn context() -> Context {
    let driver = Arc::new(Driver::open().expect("open the CUDA driver (libcuda.so.1)"));
    Context::new(driver, 0).expect("create a context on device 0")
}

/// `n` values uniform in [lo, hi), rounded to bf16 (so bf16 storage is exact).
fn bf16_values(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| bf16_round(rng.uniform(lo, hi))).collect()
}

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn to_bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect()
}

fn from_bf16_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
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
fn assert_close(what: &str, ours: &[f32], reference: &[f32], rel_max: f64, cos_min: f64) -> f64 {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let rel = relative_l2(ours, reference).expect("same length");
    let cos = cosine(ours, reference);
    let max_abs = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!(
        "{what}: {} values, relative L2 {rel:.3e} (max {rel_max:e}), cosine {cos:.6} (min {cos_min}), max abs {max_abs:.3e}",
        ours.len()
    );
    assert!(
        rel <= rel_max,
        "{what}: relative L2 {rel:.3e} > {rel_max:e}"
    );
    assert!(cos >= cos_min, "{what}: cosine {cos:.6} < {cos_min}");
    rel
}

/// Whether the attention kernels of this GPU include `tile` (a fresh load: the same rule the encoder uses).
fn gpu_has_tile(ctx: &Context, tile: AttentionTile) -> bool {
    NnKernels::load(ctx)
        .map(|k| k.has_tile(tile))
        .unwrap_or(false)
}

fn upload(ctx: &Context, bytes: &[u8]) -> DeviceBuffer {
    DeviceBuffer::from_bytes(ctx, bytes).expect("upload")
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn text_kernels_match_the_host_ops() {
    let ctx = context();
    let stream = Stream::new(&ctx, true).expect("stream");
    let kernels = NnKernels::load(&ctx).expect("load the shared kernel sets");
    let mut rng = Rng::new(11);

    // Embedding gather: exact copies of the selected rows.
    let (vocab, cols, rows) = (50, 264, 9);
    let table = bf16_values(&mut rng, vocab * cols, -1.0, 1.0);
    let ids: Vec<i32> = (0..rows).map(|_| rng.below(vocab) as i32).collect();
    let table_d = upload(&ctx, &to_bf16_bytes(&table));
    let ids_d = upload(
        &ctx,
        &ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
    );
    let mut out = DeviceBuffer::alloc(&ctx, rows * cols * 2).unwrap();
    kernels
        .embed_gather(
            &stream,
            &table_d.view(),
            vocab,
            cols,
            &ids_d.view(),
            rows,
            &mut out.view_mut(),
            cols,
        )
        .unwrap();
    stream.synchronize().unwrap();
    let got = from_bf16_bytes(&out.to_vec::<u8>().unwrap());
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        assert_eq!(
            &got[r * cols..(r + 1) * cols],
            &table[id * cols..(id + 1) * cols],
            "embedding row {r} (id {id})"
        );
    }
    println!("embed_gather: {rows} rows of {cols} from a {vocab}-row table, exact");

    // RMSNorm at a real width and an odd one: within a few bf16 roundings of the f32 reference.
    for (rows, cols) in [(5usize, 4096usize), (3, 136)] {
        let x: Vec<f32> = bf16_values(&mut rng, rows * cols, -3.0, 3.0);
        let w: Vec<f32> = bf16_values(&mut rng, cols, 0.5, 1.5);
        let x_d = upload(&ctx, &to_bf16_bytes(&x));
        let w_d = upload(&ctx, &to_bf16_bytes(&w));
        let mut y_d = DeviceBuffer::alloc(&ctx, rows * cols * 2).unwrap();
        kernels
            .rms_norm(
                &stream,
                &x_d.view(),
                Matrix::dense(rows, cols),
                &mut y_d.view_mut(),
                cols,
                &w_d.view(),
                EPS,
            )
            .unwrap();
        stream.synchronize().unwrap();
        let got = from_bf16_bytes(&y_d.to_vec::<u8>().unwrap());
        let mut want = vec![0f32; rows * cols];
        host::rms_norm(&x, rows, cols, &w, EPS, &mut want).unwrap();
        assert_close(
            &format!("rms_norm {rows}x{cols}"),
            &got,
            &want,
            2.0 / 256.0,
            0.9999,
        );
    }

    // QK norm + rotate-half RoPE in place on a fused q|k|v matrix (4 query, 2 kv heads), value columns untouched.
    let (rows, q_heads, kv_heads) = (37usize, 4usize, 2usize);
    let width = (q_heads + 2 * kv_heads) * 128;
    let qkv: Vec<f32> = bf16_values(&mut rng, rows * width, -2.0, 2.0);
    let qn: Vec<f32> = bf16_values(&mut rng, 128, 0.5, 1.5);
    let kn: Vec<f32> = bf16_values(&mut rng, 128, 0.5, 1.5);
    let theta = 5_000_000f32;
    let (cos, sin) = rotate_half_rope_tables(rows, theta);
    let mut qkv_d = upload(&ctx, &to_bf16_bytes(&qkv));
    let norms_d = upload(&ctx, &to_bf16_bytes(&[qn.clone(), kn.clone()].concat()));
    let cos_d = upload(
        &ctx,
        &cos.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
    );
    let sin_d = upload(
        &ctx,
        &sin.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
    );
    {
        let qw = norms_d.slice(0, 256).unwrap();
        let kw = norms_d.slice(256, 256).unwrap();
        let (cv, sv) = (cos_d.view(), sin_d.view());
        let mut view = qkv_d.view_mut();
        kernels
            .qk_norm_rope_half(
                &stream,
                &QkNormRope {
                    qkv: &mut view,
                    qkv_layout: Matrix::dense(rows, width),
                    q_heads,
                    kv_heads,
                    q_weight: &qw,
                    k_weight: &kw,
                    eps: EPS,
                    rope_cos: &cv,
                    rope_sin: &sv,
                    rope_stride: 64,
                },
            )
            .unwrap();
    }
    stream.synchronize().unwrap();
    let got = from_bf16_bytes(&qkv_d.to_vec::<u8>().unwrap());
    // Host: split, RMSNorm per head, rotate-half RoPE, in f32.
    let (qw_, kw_) = (q_heads * 128, kv_heads * 128);
    let mut q = Vec::new();
    let mut k = Vec::new();
    for r in 0..rows {
        q.extend_from_slice(&qkv[r * width..r * width + qw_]);
        k.extend_from_slice(&qkv[r * width + qw_..r * width + qw_ + kw_]);
    }
    let mut qh = vec![0f32; q.len()];
    let mut kh = vec![0f32; k.len()];
    host::rms_norm(&q, rows * q_heads, 128, &qn, EPS, &mut qh).unwrap();
    host::rms_norm(&k, rows * kv_heads, 128, &kn, EPS, &mut kh).unwrap();
    rope_rotate_half(&mut qh, rows, q_heads, 128, &cos, &sin).unwrap();
    rope_rotate_half(&mut kh, rows, kv_heads, 128, &cos, &sin).unwrap();
    let mut got_q = Vec::new();
    let mut got_k = Vec::new();
    for r in 0..rows {
        got_q.extend_from_slice(&got[r * width..r * width + qw_]);
        got_k.extend_from_slice(&got[r * width + qw_..r * width + qw_ + kw_]);
        assert_eq!(
            &got[r * width + qw_ + kw_..(r + 1) * width],
            &qkv[r * width + qw_ + kw_..(r + 1) * width],
            "row {r}: value columns must stay as they were"
        );
    }
    assert_close("qk_norm_rope_half q", &got_q, &qh, 4.0 / 256.0, 0.9998);
    assert_close("qk_norm_rope_half k", &got_k, &kh, 4.0 / 256.0, 0.9998);
    // The rotation matters: without it (position 0 only) the later rows would differ by order 1.
    let unrotated = relative_l2(&got_q[q_heads * 128 * (rows - 1)..], &{
        let mut plain = vec![0f32; q_heads * 128];
        host::rms_norm(
            &q[q_heads * 128 * (rows - 1)..],
            q_heads,
            128,
            &qn,
            EPS,
            &mut plain,
        )
        .unwrap();
        plain
    })
    .unwrap();
    println!("qk_norm_rope_half: last row against its unrotated norm: relative L2 {unrotated:.3}");
    assert!(unrotated > 0.1, "the last row should be rotated");

    // Seeded fill: deterministic, in range, mean and spread as asked.
    let n = 1 << 20;
    let mut a = DeviceBuffer::alloc(&ctx, n * 2).unwrap();
    let mut b = DeviceBuffer::alloc(&ctx, n * 2).unwrap();
    kernels
        .fill_uniform(&stream, &mut a.view_mut(), n, 5, 1.0, 0.5)
        .unwrap();
    kernels
        .fill_uniform(&stream, &mut b.view_mut(), n, 5, 1.0, 0.5)
        .unwrap();
    stream.synchronize().unwrap();
    let (va, vb) = (a.to_vec::<u8>().unwrap(), b.to_vec::<u8>().unwrap());
    assert_eq!(va, vb, "the same seed must give the same values");
    let values = from_bf16_bytes(&va);
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
    let var = values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    let (lo, hi) = values
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    println!(
        "fill_uniform: mean {mean:.4} (1), std {:.4} ({:.4}), range [{lo}, {hi}]",
        var.sqrt(),
        0.5 / 3f64.sqrt()
    );
    assert!((mean - 1.0).abs() < 2e-3, "mean {mean}");
    assert!(
        (var.sqrt() - 0.5 / 3f64.sqrt()).abs() < 2e-3,
        "std {}",
        var.sqrt()
    );
    assert!((0.5..=1.5).contains(&lo) && (0.5..=1.5).contains(&hi));
}

/// Writes a tiny Qwen3-VL text model (head dim 128) with bf16-representable random weights; returns its folder.
fn tiny_model(dir: &Path, config: &TextEncoderConfig, seed: u64) {
    std::fs::create_dir_all(dir).expect("create the model folder");
    let c = config;
    let json = serde_json::json!({
        "model_type": "qwen3_vl",
        "text_config": {
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}
        }
    });
    std::fs::write(dir.join("config.json"), json.to_string()).expect("write config.json");
    let mut rng = Rng::new(seed);
    let (h, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (qo, kvo) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let mut tensors: Vec<(String, Tensor<f32>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, lo: f32, hi: f32| {
        let n = shape.iter().product();
        tensors.push((
            name,
            Tensor::new(shape, bf16_values(&mut rng, n, lo, hi)).unwrap(),
        ));
    };
    let p = "model.language_model.";
    // Linear weights ~ U(-a, a) with a = 1/sqrt(fan_in), so activations keep their scale through the layers.
    let lin = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    add(
        format!("{p}embed_tokens.weight"),
        vec![c.vocab_size, h],
        -1.0,
        1.0,
    );
    add(format!("{p}norm.weight"), vec![h], 0.8, 1.2);
    for i in 0..c.num_hidden_layers {
        let l = format!("{p}layers.{i}.");
        add(format!("{l}input_layernorm.weight"), vec![h], 0.8, 1.2);
        add(
            format!("{l}self_attn.q_proj.weight"),
            vec![qo, h],
            -lin(h),
            lin(h),
        );
        add(
            format!("{l}self_attn.k_proj.weight"),
            vec![kvo, h],
            -lin(h),
            lin(h),
        );
        add(
            format!("{l}self_attn.v_proj.weight"),
            vec![kvo, h],
            -lin(h),
            lin(h),
        );
        add(format!("{l}self_attn.q_norm.weight"), vec![hd], 0.8, 1.2);
        add(format!("{l}self_attn.k_norm.weight"), vec![hd], 0.8, 1.2);
        add(
            format!("{l}self_attn.o_proj.weight"),
            vec![h, qo],
            -lin(qo),
            lin(qo),
        );
        add(
            format!("{l}post_attention_layernorm.weight"),
            vec![h],
            0.8,
            1.2,
        );
        add(
            format!("{l}mlp.gate_proj.weight"),
            vec![f, h],
            -lin(h),
            lin(h),
        );
        add(
            format!("{l}mlp.up_proj.weight"),
            vec![f, h],
            -lin(h),
            lin(h),
        );
        add(
            format!("{l}mlp.down_proj.weight"),
            vec![h, f],
            -lin(f),
            lin(f),
        );
    }
    write_f32_safetensors(&dir.join("model.safetensors"), &tensors).expect("write the weights");
}

fn tiny_config() -> TextEncoderConfig {
    TextEncoderConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 384,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 5_000_000.0,
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tf-gpu-te-{name}-{}", std::process::id()))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn tiny_encoder_matches_the_host_reference() {
    let dir = scratch_dir("tiny");
    tiny_model(&dir, &tiny_config(), 2026);
    let model = ModelDir::open(&dir).expect("open the tiny model");
    let mut host_encoder = HostTextEncoder::load(&model).expect("host load");
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    // Small slots so the tiny model still goes through the ring of pinned staging slots.
    let staging = StagingConfig {
        slot_bytes: 16 << 10,
        slots: 2,
        threads: 3,
    };
    let mut gpu = GpuTextEncoder::load_with(&ctx, &model, staging).expect("GPU load");
    println!(
        "tiny encoder: {:?}; upload {}; weights {} B",
        gpu.config(),
        gpu.upload_stats()
            .map(|s| s.to_string())
            .unwrap_or_default(),
        gpu.weight_bytes()
    );
    assert_eq!(gpu.config(), host_encoder.config());

    let vocab = tiny_config().vocab_size;
    let mut rng = Rng::new(7);
    let mut prompts: Vec<(Vec<u32>, usize)> = [(1usize, 0usize), (7, 3), (130, 14)]
        .iter()
        .map(|&(rows, drop)| ((0..rows).map(|_| rng.below(vocab) as u32).collect(), drop))
        .collect();
    // The 7-row prompt again, after the 130-row one grew the workspace.
    prompts.push(prompts[1].clone());
    // Every attention tile this GPU loads (the preferred one first), each against the host reference.
    let preferred = gpu.attention_tile();
    let mut tiles = vec![preferred];
    tiles.extend(
        AttentionTile::ALL
            .into_iter()
            .filter(|&t| t != preferred && gpu_has_tile(&ctx, t)),
    );
    let mut by_tile: Vec<(AttentionTile, Vec<f32>)> = Vec::new();
    for &tile in &tiles {
        gpu.set_attention_tile(Some(tile));
        println!("attention tile {tile:?}");
        let mut first_seven: Option<Vec<f32>> = None;
        for (i, (ids, drop)) in prompts.iter().enumerate() {
            let want = TextEncoderBackend::prompt_features(&mut host_encoder, ids, *drop).unwrap();
            let got = gpu.prompt_features(ids, *drop).expect("GPU encode");
            assert_eq!(got.shape(), want.shape(), "prompt {i}: shape");
            println!(
                "prompt {i}: {} rows, {drop} dropped, workspace {} rows, resident {} B",
                ids.len(),
                gpu.workspace_rows(),
                gpu.resident_bytes()
            );
            assert_close(
                &format!("{tile:?} prompt {i} ({} rows, drop {drop})", ids.len()),
                got.data(),
                want.data(),
                REL_L2_MAX,
                COSINE_MIN,
            );
            if ids.len() == 7 {
                match &first_seven {
                    None => first_seven = Some(got.data().to_vec()),
                    Some(first) => assert_eq!(
                        first,
                        got.data(),
                        "the same prompt after a larger workspace must give bit-identical features"
                    ),
                }
            }
            if ids.len() == 130 {
                by_tile.push((tile, got.data().to_vec()));
            }
        }
    }
    if let Some((first_tile, first)) = by_tile.first() {
        for (tile, other) in &by_tile[1..] {
            let rel = relative_l2(other, first).unwrap();
            println!("130 rows: {tile:?} against {first_tile:?}: relative L2 {rel:.3e}");
        }
    }
    gpu.set_attention_tile(None);
    assert_eq!(
        gpu.workspace_rows(),
        256,
        "130 rows grow the workspace to two quanta"
    );

    // A new prompt length inside a planned row quantum plans no GEMM: the GEMMs run over the quantum's rows.
    let planning_before = tf_cuda::cublaslt::call_planning();
    let five = gpu.prompt_features(&prompts[1].0[..5], 0).unwrap();
    let built = tf_cuda::cublaslt::call_planning()
        .since(&planning_before)
        .plans;
    println!("a 5-row prompt after 7-row ones: {built} GEMM plans built");
    assert_eq!(five.shape()[0], 5);
    assert_eq!(
        built, 0,
        "a prompt in an already planned row quantum built GEMM plans"
    );

    // A causal encoder: the features of a prefix do not depend on what follows it.
    let (long, _) = &prompts[2];
    let full = gpu.prompt_features(long, 0).unwrap();
    let prefix = gpu.prompt_features(&long[..40], 0).unwrap();
    let h = tiny_config().hidden_size;
    let prefix_rel = relative_l2(prefix.data(), &full.data()[..40 * h]).unwrap();
    println!("causality: first 40 rows alone vs inside 130: relative L2 {prefix_rel:.3e}");
    // GEMMs of 40 and 130 rows may take different cuBLASLt algorithms (a few bf16 roundings apart); attention
    // that saw later keys would move the rows by order 1.
    assert!(
        prefix_rel < 1e-2,
        "prefix rows changed with the suffix: {prefix_rel:e}"
    );

    // Bad requests are refused before anything runs, and the encoder keeps working.
    let bad_id = gpu.prompt_features(&[1, vocab as u32, 2], 0).unwrap_err();
    println!("out-of-vocabulary id: {bad_id}");
    assert!(bad_id.to_string().contains("outside the vocabulary"));
    let bad_drop = gpu.prompt_features(&[1, 2], 2).unwrap_err();
    println!("all rows dropped: {bad_drop}");
    assert!(gpu.prompt_features(&[1, 2], 1).is_ok());

    drop(gpu);
    let after = tf_cuda::usage().device;
    println!("device bytes: {baseline} before load, {after} after drop");
    assert_eq!(after, baseline, "the encoder must free every device buffer");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn features_at_a_middle_layer_match_the_host_reference() {
    let config = TextEncoderConfig {
        num_hidden_layers: 4,
        ..tiny_config()
    };
    let dir = scratch_dir("layers");
    tiny_model(&dir, &config, 2027);
    let model = ModelDir::open(&dir).expect("open the tiny model");
    let host_encoder = HostTextEncoder::load(&model).expect("host load");
    let ctx = context();
    let mut gpu = GpuTextEncoder::load_on(&ctx, &model).expect("GPU load");
    let mut rng = Rng::new(11);
    let ids: Vec<u32> = (0..37)
        .map(|_| rng.below(config.vocab_size) as u32)
        .collect();
    let last = config.num_hidden_layers;
    let mut by_layer = Vec::new();
    for layer in [0, 2, last] {
        let want = host_encoder
            .features_at(&ids, layer)
            .expect("host features");
        let got = gpu.features_at(&ids, layer).expect("GPU features");
        assert_eq!(got.shape(), &[ids.len(), config.hidden_size]);
        assert_eq!(got.shape(), want.shape(), "layer {layer}: shape");
        assert_close(
            &format!("hidden_states[{layer}] of {} rows", ids.len()),
            got.data(),
            want.data(),
            REL_L2_MAX,
            COSINE_MIN,
        );
        by_layer.push(got.into_data());
    }
    // The middle layer is its own state, not the last layer's (the forward stopped there).
    let rel = relative_l2(&by_layer[1], &by_layer[2]).unwrap();
    println!("hidden_states[2] against hidden_states[{last}]: relative L2 {rel:.3e}");
    assert!(rel > 1e-2, "layer 2 and the last layer agree: {rel:e}");
    // The last layer is what Qwen-Image's prompt features read, bit for bit.
    let prompt = gpu.prompt_features(&ids, 0).expect("prompt features");
    assert_eq!(
        prompt.data(),
        &by_layer[2][..],
        "features_at(last) must be the prompt features"
    );
    let err = gpu.features_at(&ids, last + 1).unwrap_err();
    println!("layer past the last: {err}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert_eq!(
        gpu.features_at(&[], 2).expect("no ids").shape(),
        &[0, config.hidden_size]
    );
    drop(gpu);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Qwen3-VL-8B text config (the encoder Qwen-Image 2.1 uses).
fn full_size_config() -> TextEncoderConfig {
    TextEncoderConfig::qwen3_vl_8b()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn full_size_encode_timing() {
    let ctx = context();
    let baseline = tf_cuda::usage().device;
    let started = Instant::now();
    let mut gpu =
        GpuTextEncoder::random_on(&ctx, full_size_config(), 42).expect("random full-size encoder");
    let weight_bytes = gpu.weight_bytes();
    println!(
        "full size: {:.3} GB of bf16 weights made on the device in {:.2} s",
        weight_bytes as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    assert!(
        weight_bytes > 15_000_000_000,
        "8B text weights are about 15 GB in bf16"
    );
    let vocab = full_size_config().vocab_size;
    let mut rng = Rng::new(3);
    for rows in [128usize, 512] {
        let ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
        let first = gpu.prompt_features(&ids, 14).expect("encode");
        assert_eq!(first.shape(), &[rows - 14, 4096]);
        assert!(
            first.data().iter().all(|v| v.is_finite()),
            "non-finite features"
        );
        let rms = (first
            .data()
            .iter()
            .map(|&v| f64::from(v).powi(2))
            .sum::<f64>()
            / first.data().len() as f64)
            .sqrt();
        println!("{rows} tokens: feature rms {rms:.4}");
        assert!(rms > 1e-3, "features are (nearly) zero: rms {rms}");
        let second = gpu.prompt_features(&ids, 14).expect("encode again");
        assert_eq!(
            first.data(),
            second.data(),
            "{rows} tokens: two encodes must be bit-identical"
        );
        let iters = 5;
        let wall = Instant::now();
        for _ in 0..iters {
            gpu.prompt_features(&ids, 14).expect("encode");
        }
        let wall_ms = wall.elapsed().as_secs_f64() * 1e3 / iters as f64;
        let device_ms = gpu.time_forward(&ids, 10).expect("time the forward");
        // Every layer weight is read once per forward; the embedding table only for the rows gathered.
        let streamed = weight_bytes as f64 - (vocab * 4096 * 2) as f64;
        let gbps = streamed / (device_ms * 1e-3) / 1e9;
        let flops = 2.0 * rows as f64 * (weight_bytes as f64 / 2.0 - (vocab * 4096) as f64);
        println!(
            "{rows} tokens: {device_ms:.3} ms device per forward ({gbps:.0} GB/s of layer weights streamed, {:.0} TFLOP/s GEMM-equivalent), \
             {wall_ms:.3} ms per prompt_features call (ids up, features back); resident {:.3} GB",
            flops / (device_ms * 1e-3) / 1e12,
            gpu.resident_bytes() as f64 / 1e9
        );
    }
    drop(gpu);
    let after = tf_cuda::usage().device;
    println!("device bytes: {baseline} before, {after} after drop");
    assert_eq!(after, baseline, "the encoder must free every device buffer");
}
