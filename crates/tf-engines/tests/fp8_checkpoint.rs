//! FP8 checkpoints that carry their scales (`nn::fp8_checkpoint`) on the tiny Qwen-Image DiT, no GPU: the
//! committed scaled-FP8 fixtures (tests/fixtures/qwen_fp8, made from the t2i fixture by
//! tests/python/qwen_fp8_checkpoint_fixtures.py) load with exactly the file's codes and scales, the host reference
//! runs on them near the full-precision weights, and malformed files are refused naming the file and the tensor.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use tf_engines::nn::fp8::{e4m3_decode, e4m3_encode, RowCodes};
use tf_engines::nn::fp8_checkpoint::{Fp8Checkpoint, Fp8CheckpointError, ScaleLayout, WeightFeed};
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::weights::{Dtype, ModelDir, SafetensorsFile};
use tf_engines::qwen_image::config::QwenImageDitConfig;
use tf_engines::qwen_image::dit::{check_folder, DitBackend, DitError, KvStep};
use tf_engines::qwen_image::dit_host::HostDit;

#[path = "common/fixture_dir.rs"]
mod fixture_dir;
#[path = "common/qwen_fixtures.rs"]
mod qwen_fixtures;
#[path = "common/scratch_model.rs"]
mod scratch_model;
use scratch_model::ScratchModel;

/// Bounds on the relative L2 of the host forward on an FP8 checkpoint against the same forward on the f32
/// weights it was made from (the weights alone are quantized; the host runs f32 activations). Every GEMM weight
/// of the fixture, the input and text projections included, is e4m3 (3 mantissa bits, 2-3% error per weight),
/// in a random-weight model whose outputs are sensitive. Measured: 6.7e-2 per channel, 8.8e-2 per tensor (coarser:
/// rows far below the tensor's largest value use few code steps). The bounds leave 1.5x; a wrong scale, row or
/// layout gives errors of order 1.
const HOST_REL_L2_MAX_PER_CHANNEL: f64 = 0.10;
const HOST_REL_L2_MAX_PER_TENSOR: f64 = 0.13;

fn fp8_dir(variant: &str) -> PathBuf {
    fixture_dir::find("qwen_fp8").join(variant)
}

fn source_model() -> ModelDir {
    qwen_fixtures::model("t2i")
}

/// The layers the fixture script quantizes: every block GEMM and two outer projections.
fn quantized_weights() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = ["img_in.weight", "txt_in.out_layer.weight"]
        .into_iter()
        .map(String::from)
        .collect();
    for block in 0..2 {
        for layer in [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "img_mlp.gate_layer",
            "img_mlp.proj",
            "img_mlp.out",
        ] {
            names.insert(format!("transformer_blocks.{block}.{layer}.weight"));
        }
    }
    names
}

#[test]
fn both_layouts_load_exactly_the_files_codes_and_scales() {
    let source = source_model();
    for (variant, layout) in [
        ("per_tensor", ScaleLayout::PerTensor),
        ("per_channel", ScaleLayout::PerChannel),
    ] {
        let model = ModelDir::open(&fp8_dir(variant)).unwrap();
        let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
        let ck = check_folder(&model, &config).unwrap();
        println!("{variant}: {}", ck.describe());
        let names: BTreeSet<String> = ck.weights().keys().cloned().collect();
        assert_eq!(names, quantized_weights(), "{variant}: FP8 weights found");
        assert_eq!(ck.has_marker(), variant == "per_tensor");
        assert!(!ck.full_precision_matmul());
        for (name, w) in ck.weights() {
            assert_eq!(w.layout, layout, "{variant}/{name}");
            let shape = &model.info(name).unwrap().shape;
            assert_eq!(model.info(name).unwrap().dtype, Dtype::F8E4M3);
            assert_eq!([w.rows, w.cols], [shape[0], shape[1]], "{variant}/{name}");
            // The scales: the file's scale tensor, a per-tensor one repeated on every row.
            let file_scale = model.to_f32(&w.scale_name).unwrap().into_data();
            let want: Vec<f32> = if file_scale.len() == 1 {
                vec![file_scale[0]; w.rows]
            } else {
                file_scale
            };
            assert_eq!(w.scales, want, "{variant}/{name}: scales");
            // The codes: the file's bytes, and each is the nearest e4m3 code of the source weight over its scale
            // (the script and the engine's encoder agree bit for bit).
            let codes = ck.codes(&model, name).unwrap();
            assert_eq!(codes, model.bytes(name).unwrap());
            let original = source.to_f32(name).unwrap().into_data();
            for (i, (&code, &v)) in codes.iter().zip(&original).enumerate() {
                assert_eq!(
                    code,
                    e4m3_encode(v / w.scales[i / w.cols]),
                    "{variant}/{name}: code {i}"
                );
            }
            // Dequantized: code times the row's scale, exactly; within half an e4m3 step of the source.
            let dq = ck.to_f32(&model, name).unwrap();
            assert_eq!(dq.shape(), &[w.rows, w.cols]);
            for (i, (&got, &v)) in dq.data().iter().zip(&original).enumerate() {
                let scale = w.scales[i / w.cols];
                assert_eq!(got, e4m3_decode(codes[i]) * scale, "{variant}/{name}: {i}");
                let tol = v.abs() / 16.0 + scale * 2f32.powi(-10) + 1e-12;
                assert!(
                    (got - v).abs() <= tol,
                    "{variant}/{name}: {i}: {v} -> {got}"
                );
            }
        }
        // Input scales: the legacy file's uncalibrated 1.0 on q/k/v, the other file's one calibrated value.
        let inputs: Vec<(&str, f32)> = ck
            .weights()
            .iter()
            .filter_map(|(n, w)| w.input_scale.map(|s| (n.as_str(), s)))
            .collect();
        if variant == "per_tensor" {
            assert_eq!(inputs.len(), 6);
            assert!(inputs
                .iter()
                .all(|(n, s)| *s == 1.0 && n.contains(".attn.to_")));
        } else {
            assert_eq!(
                inputs,
                [("transformer_blocks.0.img_mlp.out.weight", 0.0625)]
            );
        }
        // Tensors the scan does not claim are read as they are.
        assert_eq!(
            ck.to_f32(&model, "proj_out.weight").unwrap().data(),
            source.to_f32("proj_out.weight").unwrap().data()
        );
    }
}

#[test]
fn weight_feeds_take_codes_dequantize_quantize_or_convert() {
    let model = ModelDir::open(&fp8_dir("per_channel")).unwrap();
    let ck = Fp8Checkpoint::scan(&model).unwrap();
    let q = "transformer_blocks.0.attn.to_q.weight";
    // A checkpoint FP8 weight the model runs in FP8: its codes as stored, its scales.
    let feed = WeightFeed::of(&model, &ck, q, Some((32, 32))).unwrap();
    assert!(feed.is_fp8() && feed.is_as_stored());
    assert_eq!(feed.scales().unwrap(), ck.get(q).unwrap().scales);
    let piece = feed.piece(64);
    assert_eq!(piece.src, model.bytes(q).unwrap());
    assert_eq!(
        (piece.dst_offset, piece.device_bytes().unwrap()),
        (64, 32 * 32)
    );
    // ... in bf16: dequantized, two bytes an element, no scales.
    let feed = WeightFeed::of(&model, &ck, q, None).unwrap();
    assert!(!feed.is_fp8() && feed.scales().is_none());
    assert_eq!(feed.piece(0).device_bytes().unwrap(), 2 * 32 * 32);
    // ... in FP8 at another shape: refused, naming it.
    match WeightFeed::of(&model, &ck, q, Some((64, 16))) {
        Err(e @ Fp8CheckpointError::Layout { .. }) => assert!(e.to_string().contains(q), "{e}"),
        other => panic!("{other:?}"),
    }
    // A float weight: converted, or quantized on the ring.
    let p = "proj_out.weight";
    assert!(matches!(
        WeightFeed::of(&model, &ck, p, None).unwrap(),
        WeightFeed::Bf16 {
            dtype: Dtype::F32,
            ..
        }
    ));
    let feed = WeightFeed::of(&model, &ck, p, Some((16, 32))).unwrap();
    assert!(feed.is_fp8() && !feed.is_as_stored());
    assert_eq!(feed.piece(0).device_bytes().unwrap(), 16 * 32);
    // ... into INT8 codes for our INT8 GEMM: one byte an element, a scale a row once the ring is done.
    let feed = WeightFeed::of_codes(&model, &ck, p, Some((16, 32)), RowCodes::Int8).unwrap();
    assert!(feed.is_fp8() && !feed.is_as_stored());
    assert_eq!(feed.piece(0).device_bytes().unwrap(), 16 * 32);
    // Stored e4m3 codes bound for INT8 GEMMs: refused, naming the tensor and the way out.
    match WeightFeed::of_codes(&model, &ck, q, Some((32, 32)), RowCodes::Int8) {
        Err(e @ Fp8CheckpointError::StoredCodes { .. }) => {
            let text = e.to_string();
            assert!(text.contains(q) && text.contains("gemm=int8"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    // ... and bound for bf16 they are dequantized as before.
    let feed = WeightFeed::of_codes(&model, &ck, q, None, RowCodes::Int8).unwrap();
    assert!(!feed.is_fp8());
}

#[test]
fn an_ordinary_checkpoint_scans_empty() {
    let ck = Fp8Checkpoint::scan(&source_model()).unwrap();
    assert!(ck.is_empty());
    assert_eq!(ck.companions().count(), 0);
    assert_eq!(ck.describe(), "no FP8 weights in the checkpoint");
}

#[test]
fn the_host_forward_on_fp8_checkpoints_stays_near_full_precision() {
    let step = qwen_fixtures::inputs("t2i", "step0");
    let reference = qwen_fixtures::expected("t2i")
        .to_f32("sample_full")
        .unwrap();
    let full = HostDit::load(&source_model())
        .unwrap()
        .forward(&step, KvStep::None)
        .unwrap()
        .sample;
    for (variant, bound) in [
        ("per_tensor", HOST_REL_L2_MAX_PER_TENSOR),
        ("per_channel", HOST_REL_L2_MAX_PER_CHANNEL),
    ] {
        let mut dit = HostDit::load(&ModelDir::open(&fp8_dir(variant)).unwrap()).unwrap();
        let out = dit.forward(&step, KvStep::None).unwrap().sample;
        assert!(out.data().iter().all(|v| v.is_finite()));
        let e = relative_l2(out.data(), full.data()).unwrap();
        let e_ref = relative_l2(out.data(), reference.data()).unwrap();
        println!(
            "{variant}: host forward vs f32 weights rel L2 {e:.3e}; vs the diffusers reference {e_ref:.3e}"
        );
        assert!(e <= bound, "{variant}: relative L2 {e:.3e} > {bound}");
        assert!(e > 0.0, "{variant}: the FP8 weights changed nothing?");
    }
}

// --- Malformed files --------------------------------------------------------------------------------------

/// One tensor of a rewritten file: name, header dtype, shape, raw bytes.
type Raw = (String, &'static str, Vec<usize>, Vec<u8>);

fn st_dtype(name: &str) -> safetensors::Dtype {
    match name {
        "F32" => safetensors::Dtype::F32,
        "BF16" => safetensors::Dtype::BF16,
        "F8_E4M3" => safetensors::Dtype::F8_E4M3,
        "F8_E5M2" => safetensors::Dtype::F8_E5M2,
        "U8" => safetensors::Dtype::U8,
        "I32" => safetensors::Dtype::I32,
        other => panic!("no safetensors dtype for {other}"),
    }
}

/// A scratch copy of `dir` whose weights file is rewritten by `edit` (tensors and `__metadata__`).
fn broken(
    dir: &Path,
    tag: &str,
    edit: impl FnOnce(&mut Vec<Raw>, &mut HashMap<String, String>),
) -> ScratchModel {
    let scratch = ScratchModel::copy_of(dir, &format!("tf_fp8_ck_{tag}"));
    let path = scratch.weights();
    let file = SafetensorsFile::open(&path).unwrap();
    let mut tensors: Vec<Raw> = file
        .names()
        .map(|n| {
            let info = file.info(n).unwrap();
            (
                n.to_string(),
                info.dtype.header_name(),
                info.shape.clone(),
                file.bytes(n).unwrap().to_vec(),
            )
        })
        .collect();
    let mut metadata: HashMap<String, String> = file
        .header()
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    drop(file);
    edit(&mut tensors, &mut metadata);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(st_dtype(d), s.clone(), b).unwrap(),
            )
        })
        .collect();
    let metadata = (!metadata.is_empty()).then_some(metadata);
    safetensors::serialize_to_file(views, metadata, &path).unwrap();
    scratch
}

fn set(tensors: &mut [Raw], name: &str, edit: impl FnOnce(&mut Raw)) {
    edit(
        tensors
            .iter_mut()
            .find(|t| t.0 == name)
            .unwrap_or_else(|| panic!("{name} not in the fixture")),
    );
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The refusal of the scan and of the host loader (never a panic); both name `names` and the file.
fn refused(scratch: &ScratchModel, names: &[&str]) -> Fp8CheckpointError {
    let model = scratch.open().unwrap();
    let err = match Fp8Checkpoint::scan(&model) {
        Ok(_) => panic!("{names:?}: the checkpoint was accepted"),
        Err(e) => e,
    };
    let text = err.to_string();
    println!("refused: {text}");
    let file = scratch.weights();
    assert!(
        text.contains(&file.display().to_string()),
        "the error does not name the file: {text}"
    );
    for name in names {
        assert!(
            text.contains(name),
            "the error does not name {name}: {text}"
        );
    }
    match HostDit::load(&model) {
        Ok(_) => panic!("{names:?}: the host DiT loaded"),
        Err(DitError::Fp8Checkpoint(e)) => assert_eq!(e.to_string(), text),
        Err(other) => panic!("{names:?}: another error: {other}"),
    }
    err
}

const Q: &str = "transformer_blocks.1.attn.to_q";

#[test]
fn malformed_scales_are_refused_naming_file_and_tensor() {
    let legacy = fp8_dir("per_tensor");
    let scale = format!("{Q}.scale_weight");
    // Missing.
    let s = broken(&legacy, "missing", |t, _| t.retain(|x| x.0 != scale));
    assert!(matches!(
        refused(&s, &[&format!("{Q}.weight")]),
        Fp8CheckpointError::MissingScale { .. }
    ));
    // Shapes that are neither per tensor nor per output channel (q is [32, 32]).
    for (tag, shape) in [
        ("two", vec![2]),
        ("cols", vec![1, 32]),
        ("rank3", vec![32, 1, 1]),
    ] {
        let n: usize = shape.iter().product();
        let s = broken(&legacy, tag, |t, _| {
            set(t, &scale, |x| {
                x.2 = shape.clone();
                x.3 = f32_bytes(&vec![0.01; n]);
            })
        });
        assert!(matches!(
            refused(&s, &[&scale]),
            Fp8CheckpointError::ScaleShape { .. }
        ));
    }
    // NaN, infinite, negative and zero values.
    for (tag, v) in [
        ("nan", f32::NAN),
        ("inf", f32::INFINITY),
        ("neg", -0.01),
        ("zero", 0.0),
    ] {
        let s = broken(&legacy, tag, |t, _| {
            set(t, &scale, |x| x.3 = f32_bytes(&[v]))
        });
        assert!(matches!(
            refused(&s, &[&scale]),
            Fp8CheckpointError::ScaleValue { .. }
        ));
    }
    // A per-channel scale with one bad row names the row.
    let channel = fp8_dir("per_channel");
    let wscale = format!("{Q}.weight_scale");
    let s = broken(&channel, "row", |t, _| {
        set(t, &wscale, |x| {
            x.3[4 * 7..4 * 8].copy_from_slice(&(-1f32).to_le_bytes())
        })
    });
    let err = refused(&s, &[&wscale]);
    assert!(err.to_string().contains("element 7"), "{err}");
    // A scale of the wrong type.
    let s = broken(&legacy, "i32", |t, _| {
        set(t, &scale, |x| {
            x.1 = "I32";
            x.3 = 7i32.to_le_bytes().to_vec();
        })
    });
    assert!(matches!(
        refused(&s, &[&scale, "I32"]),
        Fp8CheckpointError::Dtype { .. }
    ));
    // Both spellings of the scale.
    let s = broken(&legacy, "both", |t, _| {
        t.push((
            format!("{Q}.weight_scale"),
            "F32",
            vec![],
            f32_bytes(&[0.01]),
        ))
    });
    assert!(matches!(
        refused(&s, &[Q]),
        Fp8CheckpointError::TwoScales { .. }
    ));
    // An input scale that is not a positive scalar.
    let s = broken(&legacy, "input", |t, _| {
        set(t, &format!("{Q}.scale_input"), |x| x.3 = f32_bytes(&[-1.0]))
    });
    refused(&s, &[&format!("{Q}.scale_input")]);
}

#[test]
fn malformed_weights_and_declarations_are_refused() {
    let legacy = fp8_dir("per_tensor");
    let weight = format!("{Q}.weight");
    // e5m2 weights.
    let s = broken(&legacy, "e5m2", |t, _| set(t, &weight, |x| x.1 = "F8_E5M2"));
    assert!(matches!(
        refused(&s, &[&weight, "e5m2"]),
        Fp8CheckpointError::Dtype { .. }
    ));
    // An FP8 tensor that is not a 2-D weight.
    let norm = "transformer_blocks.1.attn.norm_q.weight";
    let s = broken(&legacy, "1d", |t, _| {
        set(t, norm, |x| {
            x.1 = "F8_E4M3";
            x.3 = vec![0x38; 16];
        });
        t.push((
            "transformer_blocks.1.attn.norm_q.scale_weight".into(),
            "F32",
            vec![],
            f32_bytes(&[1.0]),
        ));
    });
    assert!(matches!(
        refused(&s, &[norm]),
        Fp8CheckpointError::WeightShape { .. }
    ));
    // A marker with no FP8 weight: the f32 fixture plus the marker.
    let plain = qwen_fixtures::fixtures().join("t2i/model");
    let s = broken(&plain, "marker", |t, _| {
        t.push(("scaled_fp8".into(), "F8_E4M3", vec![0], vec![]))
    });
    assert!(matches!(
        refused(&s, &["scaled_fp8"]),
        Fp8CheckpointError::MarkerWithoutFp8 { .. }
    ));
    // An e5m2 marker.
    let s = broken(&legacy, "marker_e5m2", |t, _| {
        set(t, "scaled_fp8", |x| x.1 = "F8_E5M2")
    });
    assert!(matches!(
        refused(&s, &["scaled_fp8", "float8_e5m2"]),
        Fp8CheckpointError::UnsupportedFormat { .. }
    ));
    // A scale beside a weight that is not FP8.
    let s = broken(&plain, "orphan", |t, _| {
        t.push((
            "img_in.scale_weight".into(),
            "F32",
            vec![],
            f32_bytes(&[0.5]),
        ))
    });
    assert!(matches!(
        refused(&s, &["img_in.scale_weight", "img_in.weight", "F32"]),
        Fp8CheckpointError::Orphan { .. }
    ));
    // A format the engine does not run: a declaration tensor, the header metadata, a companion of another format.
    let channel = fp8_dir("per_channel");
    let mlp = "transformer_blocks.0.img_mlp.proj";
    let s = broken(&channel, "int8", |t, _| {
        set(t, &format!("{mlp}.comfy_quant"), |x| {
            x.3 = br#"{"format": "int8_blockwise", "group_size": 128}"#.to_vec();
            x.2 = vec![x.3.len()];
        })
    });
    assert!(matches!(
        refused(&s, &[&format!("{mlp}.comfy_quant"), "int8_blockwise"]),
        Fp8CheckpointError::UnsupportedFormat { .. }
    ));
    let s = broken(&channel, "meta", |_, m| {
        m.insert(
            "_quantization_metadata".into(),
            r#"{"layers": {"proj_out": {"format": "float8_e4m3fn"}}}"#.into(),
        );
    });
    refused(&s, &["_quantization_metadata", "proj_out"]);
    let s = broken(&channel, "meta_json", |_, m| {
        m.insert("_quantization_metadata".into(), "{not json".into());
    });
    refused(&s, &["_quantization_metadata", "not JSON"]);
    let s = broken(&channel, "nvfp4", |t, _| {
        t.push((
            format!("{mlp}.weight_scale_2"),
            "F32",
            vec![],
            f32_bytes(&[1.0]),
        ))
    });
    assert!(matches!(
        refused(&s, &[&format!("{mlp}.weight_scale_2")]),
        Fp8CheckpointError::UnsupportedCompanion { .. }
    ));
    // A stray tensor is still caught by the folder check, now with the FP8 specs.
    let s = broken(&channel, "stray", |t, _| {
        t.push(("stray.weight".into(), "F32", vec![2], f32_bytes(&[0.0; 2])))
    });
    let model = s.open().unwrap();
    let config = QwenImageDitConfig::from_json(model.config_json()).unwrap();
    let err = check_folder(&model, &config).unwrap_err().to_string();
    assert!(err.contains("stray.weight"), "{err}");
    // NaN codes: the scan accepts the file (it reads no codes), dequantizing refuses naming the element.
    let s = broken(&legacy, "nan_code", |t, _| {
        set(t, &weight, |x| x.3[5] = 0x7f)
    });
    let model = s.open().unwrap();
    let ck = Fp8Checkpoint::scan(&model).unwrap();
    let err = ck.to_f32(&model, &weight).unwrap_err().to_string();
    assert!(err.contains(&weight) && err.contains("element 5"), "{err}");
    let err = HostDit::load(&model).err().unwrap().to_string();
    assert!(err.contains(&weight), "{err}");
}
