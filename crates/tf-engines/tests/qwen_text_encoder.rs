//! Text-encoder parity with tests/fixtures/qwen_te (a tiny random Qwen3-VL run through transformers the way the
//! Qwen-Image 2.1 pipeline reads it: last decoder layer before the final norm, system rows dropped, from a
//! left-padded batch of two prompts), and loads capped at fewer decoder layers (`LoadOptions::layers`): fewer
//! tensors read, the same features bit for bit up to the cap, a refusal past it.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use serde_json::Value;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{write_f32_safetensors, ModelDir, SafetensorsFile};
use tf_engines::qwen3_vl::text_encoder::{HostTextEncoder, LoadOptions, TextEncoderError};

const TOLERANCE: f64 = 1e-5;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_te")
}

fn check(what: &str, ours: &[f32], reference: &[f32]) -> f64 {
    let rel = relative_l2(ours, reference).unwrap_or_else(|| panic!("{what}: length differs"));
    println!("{what}: {} values, relative L2 {rel:.3e}", reference.len());
    assert!(
        rel <= TOLERANCE,
        "{what}: relative L2 {rel:e} > {TOLERANCE:e}"
    );
    rel
}

#[test]
fn prompt_features_match_the_pipeline() {
    let dir = fixture_dir();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let drop = manifest["drop_rows"].as_u64().unwrap() as usize;
    let pads: Vec<usize> = manifest["left_padding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let encoder = HostTextEncoder::load(&ModelDir::open(&dir.join("model")).unwrap()).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let h = encoder.config().hidden_size;
    for (i, &pad) in pads.iter().enumerate() {
        let ids = expected
            .to_i64(&format!("prompt{i}.ids"))
            .unwrap()
            .into_data();
        let reference = expected.to_f32(&format!("prompt{i}.hidden")).unwrap();
        assert_eq!(reference.shape(), &[ids.len() - drop, h]);
        // In the padded batch, the reference's positions start at the padding count.
        let full = encoder.forward(&ids, pad).unwrap();
        let ours = &full.data()[drop * h..];
        check(
            &format!("prompt{i} (positions from {pad})"),
            ours,
            reference.data(),
        );
        // The one-prompt path (positions from 0) agrees too: rotary attention sees only position differences.
        let features = encoder.prompt_features(&ids, drop).unwrap();
        check(
            &format!("prompt{i} alone"),
            features.data(),
            reference.data(),
        );
        // The final norm is what the pipeline avoids; applying it reproduces the normed output, and it differs.
        let normed_ref = expected.to_f32(&format!("prompt{i}.normed")).unwrap();
        let normed = encoder.final_norm(&features).unwrap();
        check(
            &format!("prompt{i} normed"),
            normed.data(),
            normed_ref.data(),
        );
        let apart = relative_l2(normed.data(), reference.data()).unwrap();
        assert!(
            apart > 0.1,
            "the normed and pre-norm states should differ ({apart})"
        );
    }
    let alone = expected.to_f32("prompt1.alone").unwrap();
    let ids = expected.to_i64("prompt1.ids").unwrap().into_data();
    check(
        "prompt1 unpadded reference",
        encoder.prompt_features(&ids, drop).unwrap().data(),
        alone.data(),
    );
}

#[test]
fn bad_inputs_are_errors() {
    let dir = fixture_dir();
    let encoder = HostTextEncoder::load(&ModelDir::open(&dir.join("model")).unwrap()).unwrap();
    let vocab = encoder.config().vocab_size as i64;
    assert!(encoder.forward(&[1, vocab], 0).is_err());
    assert!(encoder.forward(&[-1], 0).is_err());
    assert!(encoder.prompt_features(&[1u32, 2], 2).is_err());
    // Token ids as the tokenizer returns them (u32) give the same features as i64 ids.
    let ids: [u32; 3] = [3, 1, 4];
    let wide: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
    assert_eq!(
        encoder.forward(&ids, 0).unwrap(),
        encoder.forward(&wide, 0).unwrap()
    );
}

#[test]
fn features_at_a_layer_are_that_hidden_state() {
    let dir = fixture_dir();
    let model = ModelDir::open(&dir.join("model")).unwrap();
    let encoder = HostTextEncoder::load(&model).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let ids = expected.to_i64("prompt0.ids").unwrap().into_data();
    let layers = encoder.config().num_hidden_layers;
    let all = encoder.hidden_states(&ids, 0).unwrap();
    assert_eq!(all.len(), layers + 1);
    for (layer, state) in all.iter().enumerate() {
        // Stopping at `layer` gives exactly the full run's state there (same operations, same order).
        assert_eq!(
            &encoder.features_at(&ids, layer).unwrap(),
            state,
            "layer {layer}"
        );
    }
    // The last layer is the pipeline's features, bit for bit, and matches the committed reference.
    assert_eq!(
        encoder.features_at(&ids, layers).unwrap(),
        encoder.forward(&ids, 0).unwrap()
    );
    // Layer 0 is the embedding rows.
    let embed = ["model.language_model.", "language_model.model.", "model."]
        .iter()
        .find_map(|p| model.to_f32(&format!("{p}embed_tokens.weight")).ok())
        .unwrap();
    let h = encoder.config().hidden_size;
    let rows: Vec<f32> = ids
        .iter()
        .flat_map(|&id| embed.data()[id as usize * h..(id as usize + 1) * h].to_vec())
        .collect();
    assert_eq!(all[0].data(), rows.as_slice());
    assert!(encoder.features_at(&ids, layers + 1).is_err());
}

/// Writes the text-model tensors of `model` that `keep` accepts (as f32) and its config.json into `dir`.
fn write_subset(model: &ModelDir, dir: &std::path::Path, keep: impl Fn(&str) -> bool) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(model.dir().join("config.json"), dir.join("config.json")).unwrap();
    let tensors: Vec<(String, TensorF32)> = model
        .names()
        .filter(|n| keep(n))
        .map(|n| (n.to_string(), model.to_f32(n).unwrap()))
        .collect();
    write_f32_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
}

#[test]
fn a_capped_load_reads_fewer_tensors_and_gives_the_same_features() {
    let dir = fixture_dir();
    let model = ModelDir::open(&dir.join("model")).unwrap();
    let full = HostTextEncoder::load(&model).unwrap();
    let layers = full.config().num_hidden_layers;
    assert!(layers >= 2, "the fixture has {layers} layers");
    assert_eq!(full.loaded_layers(), layers);
    // Embeddings, 11 tensors a layer, the final norm.
    assert_eq!(full.tensors_read(), 1 + 11 * layers + 1);
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let ids = expected.to_i64("prompt0.ids").unwrap().into_data();
    for cap in 0..=layers {
        let capped = HostTextEncoder::load_with(&model, LoadOptions::up_to_layer(cap)).unwrap();
        assert_eq!(
            capped.config(),
            full.config(),
            "the config stays the model's"
        );
        assert_eq!(capped.loaded_layers(), cap);
        assert_eq!(capped.tensors_read(), 1 + 11 * cap, "cap {cap}");
        assert!(capped.weight_bytes() < full.weight_bytes(), "cap {cap}");
        for layer in 0..=cap {
            assert_eq!(
                capped.features_at(&ids, layer).unwrap(),
                full.features_at(&ids, layer).unwrap(),
                "cap {cap}, hidden_states[{layer}]"
            );
        }
        assert_eq!(capped.hidden_states(&ids, 0).unwrap().len(), cap + 1);
        if cap < layers {
            let err = capped.features_at(&ids, cap + 1).unwrap_err();
            let TextEncoderError::BeyondCap {
                layer,
                cap: named_cap,
                layers: named_layers,
            } = err
            else {
                panic!("expected BeyondCap, got {err:?}");
            };
            assert_eq!((layer, named_cap, named_layers), (cap + 1, cap, layers));
            let text = err.to_string();
            assert!(
                text.contains(&format!("hidden_states[{}]", cap + 1))
                    && text.contains(&format!("0..{cap}"))
                    && text.contains(&format!("{layers}")),
                "{text}"
            );
            println!("cap {cap}: {text}");
            assert!(
                capped.forward(&ids, 0).is_err(),
                "the last layer is past the cap"
            );
            assert!(capped.final_norm(&full.forward(&ids, 0).unwrap()).is_err());
        }
    }
    // Each layer's weights: the bytes drop by one layer's worth per layer capped off (plus the final norm).
    let one = HostTextEncoder::load_with(&model, LoadOptions::up_to_layer(1)).unwrap();
    let none = HostTextEncoder::load_with(&model, LoadOptions::up_to_layer(0)).unwrap();
    let c = full.config();
    let (h, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (qo, kvo) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let per_layer = 4 * (2 * h + qo * h + 2 * kvo * h + h * qo + 2 * hd + 3 * f * h);
    assert_eq!(one.weight_bytes() - none.weight_bytes(), per_layer);
    assert_eq!(
        full.weight_bytes() - none.weight_bytes(),
        layers * per_layer + 4 * h
    );
    // A cap above the model's layers is refused, naming both numbers.
    let err = HostTextEncoder::load_with(&model, LoadOptions::up_to_layer(layers + 1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("{}", layers + 1))
            && err.contains(&format!("{layers} decoder layers")),
        "{err}"
    );
}

#[test]
fn a_capped_load_never_reads_the_later_layers() {
    let dir = fixture_dir();
    let model = ModelDir::open(&dir.join("model")).unwrap();
    let full = HostTextEncoder::load(&model).unwrap();
    let cap = full.config().num_hidden_layers - 1;
    // A folder without the last layer and the final norm: a capped load works, an uncapped one cannot.
    let scratch = std::env::temp_dir().join(format!("qwen_te_capped_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let last = format!("layers.{cap}.");
    write_subset(&model, &scratch, |n| {
        !n.contains(&last) && !n.ends_with("language_model.norm.weight") && !n.contains("visual")
    });
    let stripped = ModelDir::open(&scratch).unwrap();
    let err = HostTextEncoder::load(&stripped).unwrap_err().to_string();
    assert!(err.contains(&last) || err.contains("norm.weight"), "{err}");
    let capped = HostTextEncoder::load_with(&stripped, LoadOptions::up_to_layer(cap)).unwrap();
    let expected = SafetensorsFile::open(&dir.join("expected.safetensors")).unwrap();
    let ids = expected.to_i64("prompt1.ids").unwrap().into_data();
    for layer in 0..=cap {
        assert_eq!(
            capped.features_at(&ids, layer).unwrap(),
            full.features_at(&ids, layer).unwrap(),
            "hidden_states[{layer}]"
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
