//! Scaled-FP8 checkpoints of the MiniMax H3 DiT on the host, no GPU: the committed fixtures
//! (tests/fixtures/minimax_h3_fp8, made from the fl2va_first fixture and its original-layout twin by
//! tests/python/h3_fp8_checkpoint_fixtures.py) load with exactly the file's codes and scales in both scale layouts
//! and both name layouts, the host reference runs on the dequantized weights near the f32 weights they were made
//! from, and malformed files are refused naming the file and the tensor.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tf_engines::minimax_h3::checkpoint::{check_folder, detect, CheckpointLayout, QkvLayout};
use tf_engines::minimax_h3::config::MiniMaxH3Config;
use tf_engines::minimax_h3::dit::{H3DitBackend, H3Error, H3Inputs};
use tf_engines::minimax_h3::dit_host::HostH3Dit;
use tf_engines::nn::fp8::{e4m3_decode, e4m3_encode};
use tf_engines::nn::fp8_checkpoint::{Fp8CheckpointError, ScaleLayout};
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::weights::{Dtype, ModelDir, SafetensorsFile};

#[path = "common/fixture_dir.rs"]
mod fixture_dir;
#[path = "common/scratch_model.rs"]
mod scratch_model;
use scratch_model::ScratchModel;

/// Bounds on the relative L2 of the host forward on an FP8 checkpoint against the same forward on the f32 weights
/// it was made from (only the weights are quantized; activations stay f32). Every block and refiner GEMM, the
/// adaLN projections and the text projection are e4m3 (3 mantissa bits) in a random-weight model. Measured
/// (`sample`, `audio_sample`): 8.9e-3 and 1.46e-2 per channel, 9.1e-3 and 1.66e-2 per tensor; the bounds leave
/// 1.5x. A wrong scale, row or layout gives errors of order 1.
const HOST_REL_L2_MAX_PER_CHANNEL: f64 = 0.022;
const HOST_REL_L2_MAX_PER_TENSOR: f64 = 0.025;

fn fp8_dir(variant: &str) -> PathBuf {
    fixture_dir::find("minimax_h3_fp8").join(variant)
}

fn source_dir(case: &str) -> PathBuf {
    fixture_dir::find("minimax_h3_dit").join(case)
}

fn config_of(model: &ModelDir) -> MiniMaxH3Config {
    MiniMaxH3Config::from_json(model.config_json()).unwrap()
}

/// The weights the fixture script stores in FP8, diffusers names.
fn quantized_diffusers() -> BTreeSet<String> {
    let mut names = BTreeSet::from(["context_embedder.weight".to_string()]);
    let common = [
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
    ];
    for i in 0..2 {
        for layer in common.iter().chain(&["adaln_proj.linear"]) {
            names.insert(format!("transformer_blocks.{i}.{layer}.weight"));
        }
        for layer in common {
            names.insert(format!("token_refiner.refiner_blocks.{i}.{layer}.weight"));
        }
    }
    names
}

#[test]
fn both_scale_layouts_load_exactly_the_files_codes_and_scales() {
    let source = ModelDir::open(&source_dir("fl2va_first").join("model")).unwrap();
    for (variant, layout) in [
        ("per_tensor", ScaleLayout::PerTensor),
        ("per_channel", ScaleLayout::PerChannel),
    ] {
        let model = ModelDir::open(&fp8_dir(variant)).unwrap();
        let config = config_of(&model);
        let ck = check_folder(&model, &config, CheckpointLayout::Diffusers).unwrap();
        println!("{variant}: {}", ck.describe());
        let names: BTreeSet<String> = ck.weights().keys().cloned().collect();
        assert_eq!(names, quantized_diffusers(), "{variant}: FP8 weights found");
        assert_eq!(ck.has_marker(), variant == "per_tensor");
        for (name, w) in ck.weights() {
            assert_eq!(w.layout, layout, "{variant}/{name}");
            assert_eq!(model.info(name).unwrap().dtype, Dtype::F8E4M3);
            let file_scale = model.to_f32(&w.scale_name).unwrap().into_data();
            let want: Vec<f32> = if file_scale.len() == 1 {
                vec![file_scale[0]; w.rows]
            } else {
                file_scale
            };
            assert_eq!(w.scales, want, "{variant}/{name}: scales");
            let codes = ck.codes(&model, name).unwrap();
            let original = source.to_f32(name).unwrap().into_data();
            assert_eq!(codes.len(), original.len());
            let dq = ck.to_f32(&model, name).unwrap();
            for (i, (&code, &v)) in codes.iter().zip(&original).enumerate() {
                let scale = w.scales[i / w.cols];
                assert_eq!(code, e4m3_encode(v / scale), "{variant}/{name}: code {i}");
                assert_eq!(
                    dq.data()[i],
                    e4m3_decode(code) * scale,
                    "{variant}/{name}: {i}"
                );
            }
        }
        // What the scan does not claim reads as stored.
        assert_eq!(
            ck.to_f32(&model, "proj_in.weight").unwrap().data(),
            source.to_f32("proj_in.weight").unwrap().data()
        );
    }
}

#[test]
fn the_original_layout_scans_its_fused_weights() {
    let model = ModelDir::open(&fp8_dir("original_per_channel")).unwrap();
    let config = config_of(&model);
    let layout = detect(&model, QkvLayout::Interleaved);
    assert_eq!(layout, CheckpointLayout::Original(QkvLayout::Interleaved));
    let ck = check_folder(&model, &config, layout).unwrap();
    println!("original_per_channel: {}", ck.describe());
    assert_eq!(ck.weights().len(), 19);
    let qkv = ck.get("blocks.1.attn.qkv_proj.weight").unwrap();
    assert_eq!(
        [qkv.rows, qkv.cols],
        [3 * config.inner_dim(), config.hidden_size]
    );
    assert_eq!(qkv.layout, ScaleLayout::PerChannel);
    // A row block of the fused weight has its own scales.
    let hd = config.attention_head_dim;
    assert_eq!(qkv.row_scales(hd, hd).unwrap(), &qkv.scales[hd..2 * hd]);
    assert!(qkv.row_scales(qkv.rows - 1, 2).is_none());
}

/// `sample` and `audio_sample` of the host forward of `model` on the fl2va_first inputs.
fn host_forward(model: &Path) -> (Vec<f32>, Vec<f32>) {
    let mut dit = HostH3Dit::load(&ModelDir::open(model).unwrap()).unwrap();
    let inputs = H3Inputs::from_bundle(
        &SafetensorsFile::open(&source_dir("fl2va_first").join("inputs.safetensors")).unwrap(),
    )
    .unwrap();
    let out = dit.forward(&inputs).unwrap();
    (out.sample.into_data(), out.audio_sample.into_data())
}

#[test]
fn the_host_forward_on_fp8_checkpoints_stays_near_full_precision() {
    let (video, audio) = host_forward(&source_dir("fl2va_first").join("model"));
    let mut per_channel = None;
    for (variant, bound) in [
        ("per_tensor", HOST_REL_L2_MAX_PER_TENSOR),
        ("per_channel", HOST_REL_L2_MAX_PER_CHANNEL),
        ("original_per_channel", HOST_REL_L2_MAX_PER_CHANNEL),
    ] {
        let (v, a) = host_forward(&fp8_dir(variant));
        assert!(v.iter().chain(&a).all(|x| x.is_finite()));
        let ev = relative_l2(&v, &video).unwrap();
        let ea = relative_l2(&a, &audio).unwrap();
        println!("{variant}: host forward vs the f32 weights: sample rel L2 {ev:.3e}, audio_sample {ea:.3e}");
        for (what, e) in [("sample", ev), ("audio_sample", ea)] {
            assert!(
                e <= bound,
                "{variant}/{what}: relative L2 {e:.3e} > {bound}"
            );
            assert!(
                e > 0.0,
                "{variant}/{what}: the FP8 weights changed nothing?"
            );
        }
        // The original layout holds the same codes and row scales under other names: the same forward, bit for
        // bit (the fused qkv split and the fc1 halves swapped move whole rows with their scales).
        match variant {
            "per_channel" => per_channel = Some((v, a)),
            "original_per_channel" => {
                let (pv, pa) = per_channel.as_ref().unwrap();
                let dv = relative_l2(&v, pv).unwrap();
                let da = relative_l2(&a, pa).unwrap();
                println!("original vs diffusers per channel: {dv:.3e}, {da:.3e}");
                assert!(v == *pv && a == *pa, "{dv:.3e} {da:.3e}");
            }
            _ => {}
        }
    }
}

// --- Malformed files --------------------------------------------------------------------------------------

/// A scratch copy of `dir` whose weights file is rewritten with `edit` applied to (name, dtype, shape, bytes).
fn broken(
    dir: &Path,
    tag: &str,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> ScratchModel {
    let scratch = ScratchModel::copy_of(dir, &format!("tf_h3_fp8_{tag}"));
    let path = scratch.weights();
    let file = SafetensorsFile::open(&path).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = file
        .names()
        .map(|n| {
            let info = file.info(n).unwrap();
            let dtype = match info.dtype {
                Dtype::F32 => safetensors::Dtype::F32,
                Dtype::F8E4M3 => safetensors::Dtype::F8_E4M3,
                Dtype::U8 => safetensors::Dtype::U8,
                other => panic!("{n}: unexpected {other:?}"),
            };
            (
                n.to_string(),
                dtype,
                info.shape.clone(),
                file.bytes(n).unwrap().to_vec(),
            )
        })
        .collect();
    let metadata = file.header().metadata.clone();
    drop(file);
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let metadata = (!metadata.is_empty()).then(|| metadata.into_iter().collect());
    safetensors::serialize_to_file(views, metadata, &path).unwrap();
    scratch
}

/// The host loader's refusal: an FP8-checkpoint error naming the file and every one of `names`.
fn refused(scratch: &ScratchModel, names: &[&str]) -> Fp8CheckpointError {
    let model = scratch.open().unwrap();
    let err = match HostH3Dit::load(&model) {
        Ok(_) => panic!("{names:?}: the host DiT loaded"),
        Err(H3Error::Fp8Checkpoint(e)) => *e,
        Err(other) => panic!("{names:?}: another error: {other}"),
    };
    let text = err.to_string();
    println!("refused: {text}");
    let file = scratch.weights().display().to_string();
    assert!(
        text.contains(&file),
        "the error does not name the file: {text}"
    );
    for name in names {
        assert!(
            text.contains(name),
            "the error does not name {name}: {text}"
        );
    }
    err
}

#[test]
fn malformed_h3_checkpoints_are_refused_naming_file_and_tensor() {
    let q = "transformer_blocks.1.attn.to_q";
    // A missing scale.
    let s = broken(&fp8_dir("per_tensor"), "missing", |t| {
        t.retain(|x| x.0 != format!("{q}.scale_weight"))
    });
    assert!(matches!(
        refused(&s, &[&format!("{q}.weight")]),
        Fp8CheckpointError::MissingScale { .. }
    ));
    // A NaN code in a weight of the original layout's fused qkv.
    let qkv = "blocks.0.attn.qkv_proj.weight";
    let s = broken(&fp8_dir("original_per_channel"), "nan", |t| {
        let w = t.iter_mut().find(|x| x.0 == qkv).unwrap();
        w.3[5] = 0x7f;
    });
    assert!(matches!(
        refused(&s, &[qkv]),
        Fp8CheckpointError::NanCode { .. }
    ));
    // A per-channel scale with the wrong number of rows.
    let out = "token_refiner.refiner_blocks.0.attn.to_out.0";
    let s = broken(&fp8_dir("per_channel"), "rows", |t| {
        let sc = t
            .iter_mut()
            .find(|x| x.0 == format!("{out}.weight_scale"))
            .unwrap();
        sc.2 = vec![sc.2[0] - 1];
        sc.3.truncate(sc.3.len() - 4);
    });
    assert!(matches!(
        refused(&s, &[&format!("{out}.weight_scale")]),
        Fp8CheckpointError::ScaleShape { .. }
    ));
}
