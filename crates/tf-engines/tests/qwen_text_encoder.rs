//! Text-encoder parity with tests/fixtures/qwen_te (a tiny random Qwen3-VL run through transformers the way the
//! Qwen-Image 2.1 pipeline reads it: last decoder layer before the final norm, system rows dropped, from a
//! left-padded batch of two prompts).
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use serde_json::Value;
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::weights::{ModelDir, SafetensorsFile};
use tf_engines::qwen3_vl::text_encoder::HostTextEncoder;

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
