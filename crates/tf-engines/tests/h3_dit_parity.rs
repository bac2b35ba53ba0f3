//! The MiniMax H3 host reference DiT against the diffusers 0.42.1 fp32 fixtures (tests/fixtures/minimax_h3_dit,
//! made by tests/python/h3_dit_fixtures.py): every case on both outputs, the original-layout twin, the layout
//! builder against the pipeline's own builders (bit for bit), and malformed configs and checkpoints.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/fixture_dir.rs"]
mod fixture_dir;

use std::path::PathBuf;

#[path = "common/scratch_model.rs"]
mod scratch_model;
use scratch_model::{rewrite, ScratchModel};
use tf_engines::minimax_h3::checkpoint::CheckpointLayout;
use tf_engines::minimax_h3::dit::{H3DitBackend, H3Error, H3Inputs};
use tf_engines::minimax_h3::dit_host::{HostH3Dit, RopeTables};
use tf_engines::minimax_h3::layout::{
    Geometry, KeyframeAnchor, LayoutRequest, PackedLayout, SizeRules, StepTimesteps,
};
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    fixture_dir::find("minimax_h3_dit")
}

fn manifest() -> serde_json::Value {
    fixture_dir::manifest(&fixtures())
}

fn cases() -> Vec<String> {
    fixture_dir::manifest_cases(&fixtures(), 5)
}

fn open(case: &str, file: &str) -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join(case).join(file)).unwrap()
}

fn assert_close(case: &str, what: &str, actual: &TensorF32, reference: &TensorF32) -> f64 {
    assert_eq!(actual.shape(), reference.shape(), "{case}/{what}: shape");
    let err = relative_l2(actual.data(), reference.data()).unwrap();
    println!(
        "{case}/{what}: shape {:?}, relative L2 {err:.3e}",
        actual.shape()
    );
    assert!(
        err <= TOLERANCE,
        "{case}/{what}: relative L2 {err:.3e} > {TOLERANCE:e}"
    );
    err
}

fn run_case(case: &str) -> HostH3Dit {
    let info = &manifest()["cases"][case];
    let mut dit =
        HostH3Dit::load(&ModelDir::open(&fixtures().join(case).join("model")).unwrap()).unwrap();
    if info["bf16_rope"].as_bool().unwrap() {
        dit.set_rope_tables(RopeTables::Bf16);
    }
    let inputs = H3Inputs::from_bundle(&open(case, "inputs.safetensors")).unwrap();
    let out = dit.forward(&inputs).unwrap();
    let expected = open(case, "expected.safetensors");
    assert_close(
        case,
        "sample",
        &out.sample,
        &expected.to_f32("sample").unwrap(),
    );
    assert_close(
        case,
        "audio_sample",
        &out.audio_sample,
        &expected.to_f32("audio_sample").unwrap(),
    );
    dit
}

#[test]
fn every_case_matches_diffusers_on_both_outputs() {
    for case in cases() {
        run_case(&case);
    }
}

#[test]
fn the_cases_cover_what_the_issue_asks() {
    let m = manifest();
    let cases = m["cases"].as_object().unwrap();
    let any = |f: &dyn Fn(&serde_json::Value) -> bool| cases.values().any(f);
    assert!(any(&|c| c["timesteps"].as_array().unwrap().len() >= 3));
    assert!(any(&|c| c["keyframes"].as_array().unwrap().len() == 2));
    assert!(any(&|c| {
        let g = c["latent_grid"].as_array().unwrap();
        g.iter().all(|v| (v.as_u64().unwrap() / 2) % 2 == 1)
    }));
    assert!(any(&|c| c["batch"].as_u64().unwrap() == 2));
    assert!(any(&|c| c["bf16_rope"].as_bool().unwrap()));
    assert!(any(&|c| c["twin_of"].is_string()));
    // Two refiner layers and pass-through RoPE channels in the base config.
    let base = &m["base_config"];
    assert_eq!(base["num_refiner_layers"], 2);
    assert!(
        base["rope_freq_dim"].as_u64().unwrap() * 6 < base["attention_head_dim"].as_u64().unwrap()
    );
}

#[test]
fn bf16_tables_change_the_result_and_f32_tables_do_not_match_a_bf16_run() {
    // The bf16 case against f32 tables must miss: the fixture really exercises the rounding.
    let case = "bf16_rope_last";
    let mut dit =
        HostH3Dit::load(&ModelDir::open(&fixtures().join(case).join("model")).unwrap()).unwrap();
    let inputs = H3Inputs::from_bundle(&open(case, "inputs.safetensors")).unwrap();
    let out = dit.forward(&inputs).unwrap();
    let expected = open(case, "expected.safetensors").to_f32("sample").unwrap();
    let err = relative_l2(out.sample.data(), expected.data()).unwrap();
    assert!(err > 10.0 * TOLERANCE, "f32 tables give {err:e}");
}

#[test]
fn the_original_layout_twin_gives_the_diffusers_outputs() {
    let m = manifest();
    let (twin, of) = m["cases"]
        .as_object()
        .unwrap()
        .iter()
        .find_map(|(k, v)| v["twin_of"].as_str().map(|of| (k.clone(), of.to_string())))
        .expect("an original-layout twin");
    let original = ModelDir::open(&fixtures().join(&twin).join("model")).unwrap();
    assert!(original
        .names()
        .any(|n| n.ends_with("attn.qkv_proj.weight")));
    assert!(original.names().any(|n| n == "rope.inv_freq"));
    let mut a = HostH3Dit::load(&original).unwrap();
    assert!(matches!(
        a.checkpoint_layout(),
        CheckpointLayout::Original(_)
    ));
    let mut b =
        HostH3Dit::load(&ModelDir::open(&fixtures().join(&of).join("model")).unwrap()).unwrap();
    assert_eq!(b.checkpoint_layout(), CheckpointLayout::Diffusers);
    let inputs = H3Inputs::from_bundle(&open(&of, "inputs.safetensors")).unwrap();
    let (oa, ob) = (a.forward(&inputs).unwrap(), b.forward(&inputs).unwrap());
    // The same weights after the mapping: the same f32 arithmetic, bit for bit.
    assert_eq!(oa, ob);
    run_case(&twin);
}

// ---- the layout builder against the pipeline's builders -------------------------------------------------

fn f64s(file: &SafetensorsFile, name: &str) -> Vec<f64> {
    let bytes = file.bytes(name).unwrap();
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn usizes(file: &SafetensorsFile, name: &str) -> Vec<usize> {
    file.to_i64(name)
        .unwrap()
        .data()
        .iter()
        .map(|&v| v as usize)
        .collect()
}

#[test]
fn layouts_match_the_pipeline_bit_for_bit() {
    let m = manifest();
    let file = SafetensorsFile::open(&fixtures().join("layouts.safetensors")).unwrap();
    let mut checked = 0;
    for (name, info) in m["layouts"].as_object().unwrap() {
        if name == "last_anchor" {
            continue;
        }
        let tags: Vec<u8> = info["text_tags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u8)
            .collect();
        let keyframes: Vec<KeyframeAnchor> = info["keyframes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().parse().unwrap())
            .collect();
        let grid = info["latent_grid"].as_array().unwrap();
        let geometry = Geometry::from_latents(
            info["frames"].as_u64().unwrap() as usize,
            grid[0].as_u64().unwrap() as usize,
            grid[1].as_u64().unwrap() as usize,
        )
        .unwrap();
        assert_eq!(
            geometry.latent_frames as u64,
            info["latent_frames"].as_u64().unwrap()
        );
        assert_eq!(
            geometry.audio_latents as u64,
            info["audio_latents"].as_u64().unwrap()
        );
        let layout = PackedLayout::build(&LayoutRequest {
            text_tags: &tags,
            geometry,
            patch: [1, 2, 2],
            keyframes: &keyframes,
        })
        .unwrap();
        assert_eq!(
            layout.seq_len as u64,
            info["seq_len"].as_u64().unwrap(),
            "{name}"
        );
        let positions: Vec<f64> = layout.positions.iter().flatten().copied().collect();
        let reference = f64s(&file, &format!("{name}.position_ids"));
        assert_eq!(positions.len(), reference.len(), "{name}");
        for (i, (a, b)) in positions.iter().zip(&reference).enumerate() {
            assert!(
                a.to_bits() == b.to_bits(),
                "{name}: position {} axis {}: {a:?} vs the pipeline's {b:?}",
                i / 3,
                i % 3
            );
        }
        let tags: Vec<usize> = layout.tags.iter().map(|&t| t as usize).collect();
        assert_eq!(tags, usizes(&file, &format!("{name}.token_tags")), "{name}");
        assert_eq!(
            layout.video_indices,
            usizes(&file, &format!("{name}.video_indices"))
        );
        assert_eq!(
            layout.audio_indices,
            usizes(&file, &format!("{name}.audio_indices"))
        );
        assert_eq!(
            layout.text_indices,
            usizes(&file, &format!("{name}.text_indices"))
        );
        let t = layout
            .row_timesteps(StepTimesteps::pipeline(
                info["t_video"].as_f64().unwrap() as f32,
                info["t_audio"].as_f64().unwrap() as f32,
            ))
            .unwrap();
        assert_eq!(
            t.unique,
            file.to_f32(&format!("{name}.timestep")).unwrap().data(),
            "{name}"
        );
        assert_eq!(
            t.indices,
            usizes(&file, &format!("{name}.timestep_indices")),
            "{name}"
        );
        checked += 1;
    }
    assert!(checked >= 3);
}

#[test]
fn last_keyframe_anchor_matches_the_pipeline_over_a_sweep() {
    let file = SafetensorsFile::open(&fixtures().join("layouts.safetensors")).unwrap();
    let frames = usizes(&file, "last_anchor.frames");
    let times = f64s(&file, "last_anchor.time");
    for (&f, &t) in frames.iter().zip(&times) {
        let layout = PackedLayout::build(&LayoutRequest {
            text_tags: &[1, 1, 1],
            geometry: Geometry::from_latents(f, 2, 2).unwrap(),
            patch: [1, 2, 2],
            keyframes: &[KeyframeAnchor::Last],
        })
        .unwrap();
        assert_eq!(layout.positions[3][0].to_bits(), t.to_bits(), "{f} frames");
    }
    assert!(frames.len() >= 50);
}

#[test]
fn full_size_layout_sizes() {
    // 768x448, 2 s asked -> 56 frames, 17 latent frames, 93 audio latents per channel; S = 128 + 186 + 5712.
    let g = Geometry::for_request(448, 768, 48, &SizeRules::TRANSFORMER).unwrap();
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &[1; 128],
        geometry: g,
        patch: [1, 2, 2],
        keyframes: &[],
    })
    .unwrap();
    assert_eq!(layout.seq_len, 6026);
    // The pipeline default canvas: 768x1344, 124 frames -> S = 37838 with 128 text rows.
    let g = Geometry::for_request(768, 1344, 124, &SizeRules::PIPELINE).unwrap();
    let layout = PackedLayout::build(&LayoutRequest {
        text_tags: &[1; 128],
        geometry: g,
        patch: [1, 2, 2],
        keyframes: &[],
    })
    .unwrap();
    assert_eq!(layout.seq_len, 37838);
}

// ---- hostile configs and checkpoints ---------------------------------------------------------------------

/// A scratch copy of one fixture case's model folder.
fn scratch(tag: &str, case: &str) -> ScratchModel {
    ScratchModel::copy_of(
        &fixtures().join(case).join("model"),
        &format!("h3_parity_{tag}"),
    )
}

fn load(s: &ScratchModel) -> Result<HostH3Dit, H3Error> {
    HostH3Dit::load(&s.open().map_err(H3Error::Weights)?)
}

#[test]
fn hostile_configs_are_refused_with_the_file_and_key() {
    let s = scratch("config", "fl2va_first");
    let base = s.config();
    for (key, value) in [
        ("num_layers", serde_json::json!(100_000)),
        ("hidden_size", serde_json::json!(0)),
        ("ffn_dim", serde_json::json!(-3)),
        ("attention_head_dim", serde_json::json!("sixteen")),
        ("rope_freq_dim", serde_json::json!(1000)),
        ("patch_size", serde_json::json!([1, 2])),
        ("norm_eps", serde_json::json!(f64::MAX)),
        (
            "_class_name",
            serde_json::json!("QwenImage21Transformer2DModel"),
        ),
    ] {
        let mut c = base.clone();
        c[key] = value;
        s.set_config(&c);
        let err = load(&s).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains(key),
            "{key}: {err}"
        );
    }
    // A config that disagrees with the weights: the tensor is named.
    let mut c = base.clone();
    c["ffn_dim"] = serde_json::json!(41);
    s.set_config(&c);
    let err = load(&s).unwrap_err().to_string();
    assert!(
        err.contains("ff.net.0.proj.weight") && err.contains("shape"),
        "{err}"
    );
    std::fs::write(s.0.join("config.json"), "{not json").unwrap();
    assert!(load(&s).unwrap_err().to_string().contains("config.json"));
}

#[test]
fn malformed_checkpoints_name_the_tensor() {
    // Missing, misshapen and unknown tensors in a diffusers folder.
    let s = scratch("diffusers", "fl2va_first");
    rewrite(&s.weights(), |t| {
        t.retain(|(n, _, _)| n != "norm_out.linear.bias")
    });
    let err = load(&s).unwrap_err().to_string();
    assert!(err.contains("norm_out.linear.bias"), "{err}");
    let s = scratch("diffusers2", "fl2va_first");
    rewrite(&s.weights(), |t| {
        t.push(("extra.weight".into(), vec![2], vec![0.0; 2]))
    });
    let err = load(&s).unwrap_err().to_string();
    assert!(err.contains("extra.weight"), "{err}");

    // An original folder with a misshapen fused qkv, a pruned time table, a stray diffusers name.
    let twin = "original_fl2va_first";
    let s = scratch("orig1", twin);
    rewrite(&s.weights(), |t| {
        for (n, shape, data) in t.iter_mut() {
            if n == "blocks.1.attn.qkv_proj.weight" {
                shape[0] -= 1;
                data.truncate(shape[0] * shape[1]);
            }
        }
    });
    let err = load(&s).unwrap_err().to_string();
    assert!(err.contains("blocks.1.attn.qkv_proj.weight"), "{err}");
    let s = scratch("orig2", twin);
    rewrite(&s.weights(), |t| {
        t.push(("adaln_t_table".into(), vec![4, 2], vec![0.0; 8]))
    });
    let err = load(&s).unwrap_err().to_string();
    assert!(
        err.contains("adaln_t_table") && err.contains("pruned"),
        "{err}"
    );
    let s = scratch("orig3", twin);
    rewrite(&s.weights(), |t| {
        for (n, _, _) in t.iter_mut() {
            if n == "final_layer.video_out.bias" {
                *n = "proj_out.bias".into();
            }
        }
    });
    let err = load(&s).unwrap_err().to_string();
    assert!(err.contains("final_layer.video_out.bias"), "{err}");
}

#[test]
fn malformed_inputs_never_panic() {
    let case = "fl2va_first";
    let mut dit =
        HostH3Dit::load(&ModelDir::open(&fixtures().join(case).join("model")).unwrap()).unwrap();
    let good = H3Inputs::from_bundle(&open(case, "inputs.safetensors")).unwrap();
    let mut bad = good.clone();
    bad.position_ids = tf_engines::nn::tensor::Tensor::new(vec![2, 3], vec![0.0; 6]).unwrap();
    assert!(dit.forward(&bad).is_err());
    let mut bad = good.clone();
    bad.video_indices.data_mut()[0] = -1;
    assert!(dit
        .forward(&bad)
        .unwrap_err()
        .to_string()
        .contains("video_indices"));
    let mut bad = good;
    bad.timestep = TensorF32::new(vec![0], vec![]).unwrap();
    assert!(dit
        .forward(&bad)
        .unwrap_err()
        .to_string()
        .contains("timestep"));
}

#[test]
fn forward_files_writes_both_outputs() {
    // What `tf forward --model DIR` runs for a MiniMax H3 folder (sharded case: the reader's index path too).
    let case = "t2va_b2_full_rotary";
    let model = ModelDir::open(&fixtures().join(case).join("model")).unwrap();
    assert!(tf_engines::minimax_h3::config::names_this_class(
        model.config_json()
    ));
    let out = std::env::temp_dir().join(format!("h3_forward_{}.safetensors", std::process::id()));
    let report = tf_engines::minimax_h3::dit_host::forward_files(
        &model,
        &fixtures().join(case).join("inputs.safetensors"),
        &out,
    )
    .unwrap();
    assert_eq!(report.sample_shape, vec![2, 28, 16]);
    let written = SafetensorsFile::open(&out).unwrap();
    let expected = open(case, "expected.safetensors");
    for name in ["sample", "audio_sample"] {
        assert_close(
            case,
            name,
            &written.to_f32(name).unwrap(),
            &expected.to_f32(name).unwrap(),
        );
    }
    let _ = std::fs::remove_file(&out);
}

#[test]
fn tf_forward_binary_runs_an_h3_folder() {
    let case = "original_fl2va_first";
    let out =
        std::env::temp_dir().join(format!("h3_tf_forward_{}.safetensors", std::process::id()));
    let model = fixtures().join(case).join("model");
    let inputs = fixtures().join(case).join("inputs.safetensors");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_tf"))
        .arg("forward")
        .arg("--model")
        .arg(&model)
        .arg("--inputs")
        .arg(&inputs)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("{stderr}");
    assert!(run.status.success(), "{stderr}");
    let written = SafetensorsFile::open(&out).unwrap();
    let expected = open(case, "expected.safetensors");
    for name in ["sample", "audio_sample"] {
        assert_close(
            case,
            name,
            &written.to_f32(name).unwrap(),
            &expected.to_f32(name).unwrap(),
        );
    }
    let _ = std::fs::remove_file(&out);
    // A GPU request is refused with one line, not a crash.
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_tf"))
        .arg("forward")
        .arg("--model")
        .arg(&model)
        .arg("--inputs")
        .arg(&inputs)
        .arg("--out")
        .arg(&out)
        .args(["--backend", "gpu"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("MiniMax H3"));
}
