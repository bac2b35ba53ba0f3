//! MiniMax H3's text conditioning (`tf_engines::minimax_h3::text`) on the host reference against transformers
//! (tests/fixtures/minimax_h3_text, made by tests/python/h3_text_fixtures.py): token ids under H3's prompt rules
//! and `hidden_states[layer]` as diffusers' H3 text step reads them, for plain text, spelled H3 special tokens
//! (allowed and forbidden), `\(` / `\)` / `embedding:`, unicode, an empty prompt and a long one, at layer 4 and at
//! layer 5 (the last a 6-layer encoder has before its final norm); and the refusals: a layer the encoder cannot
//! give (naming the config key and its value), prompts over the bounds, vision placeholders, a tokenizer without
//! H3's tokens, a folder without its components; and that the component holds decoder layers `0..layer` only
//! (bit-identical features, fewer tensors read, a folder without the later layers still serves). Features within
//! relative L2 1e-5 of transformers' fp32.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use tf_engines::minimax_h3::text::{
    load_host_backend, H3TextEncoder, H3TextError, H3TextOptions, DEFAULT_LAYER, LAYERS_KEY,
};
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::{write_safetensors, AnyTensor, ModelDir, SafetensorsFile};
use tf_engines::qwen3_vl::text_encoder::HostTextEncoder;
use tf_tokenizer::templates::PromptMarkup;

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/minimax_h3_text");
        if p.is_dir() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_text")
}

fn manifest() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
        .unwrap()
}

/// `(case, prompt, markup)` of every fixture case.
fn cases() -> Vec<(String, String, PromptMarkup)> {
    manifest()["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let markup = match c["markup"].as_str().unwrap() {
                "allowed" => PromptMarkup::Allowed,
                "forbidden" => PromptMarkup::Forbidden,
                other => panic!("unknown markup {other}"),
            };
            (
                c["case"].as_str().unwrap().to_string(),
                c["prompt"].as_str().unwrap().to_string(),
                markup,
            )
        })
        .collect()
}

fn expected() -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap()
}

fn ids(file: &SafetensorsFile, name: &str) -> Vec<i64> {
    file.to_i64(name).unwrap().into_data()
}

fn options(layer: usize, markup: PromptMarkup) -> H3TextOptions {
    H3TextOptions {
        layer,
        markup,
        ..H3TextOptions::default()
    }
}

fn load(layer: usize, markup: PromptMarkup) -> H3TextEncoder {
    H3TextEncoder::load_host(&fixtures().join("model"), options(layer, markup)).unwrap()
}

fn assert_close(what: &str, actual: &TensorF32, reference: &TensorF32) -> f64 {
    assert_eq!(actual.shape(), reference.shape(), "{what}: shape");
    let err = relative_l2(actual.data(), reference.data()).unwrap();
    println!("{what}: shape {:?}, relative L2 {err:.3e}", actual.shape());
    assert!(
        err <= TOLERANCE,
        "{what}: relative L2 {err:.3e} > {TOLERANCE:e}"
    );
    err
}

#[test]
fn features_match_transformers_at_layers_4_and_5() {
    let expected = expected();
    let mut worst: f64 = 0.0;
    for layer in [4usize, 5] {
        for markup in [PromptMarkup::Allowed, PromptMarkup::Forbidden] {
            let mut text = load(layer, markup);
            assert_eq!(text.backend_name(), "host");
            for (case, prompt, case_markup) in cases() {
                if case_markup != markup {
                    continue;
                }
                let encoded = text.encode(&prompt).unwrap();
                let want_ids = ids(&expected, &format!("{case}.ids"));
                let got_ids: Vec<i64> = encoded.ids.iter().map(|&i| i64::from(i)).collect();
                assert_eq!(got_ids, want_ids, "{case}: token ids under H3's rules");
                let reference = expected.to_f32(&format!("{case}.layer{layer}")).unwrap();
                worst = worst.max(assert_close(
                    &format!("{case} hidden_states[{layer}] ({} tokens)", got_ids.len()),
                    &encoded.features,
                    &reference,
                ));
            }
        }
    }
    println!("worst relative L2 {worst:.3e} (bound {TOLERANCE:e})");
}

#[test]
fn ids_equal_the_verbatim_reference_except_where_the_rules_differ() {
    let expected = expected();
    let m = manifest();
    for (i, (case, prompt, markup)) in cases().into_iter().enumerate() {
        let ours = ids(&expected, &format!("{case}.ids"));
        let verbatim = ids(&expected, &format!("{case}.diffusers_ids"));
        // H3's rules change the ids only through `\(` / `\)`, a whitespace-led `embedding:`, an empty prompt, or
        // the forbidden markup on a prompt that spells added tokens.
        let escapes = prompt.contains("\\(") || prompt.contains("\\)");
        let split = prompt.match_indices("embedding:").any(|(at, _)| {
            prompt[..at]
                .chars()
                .next_back()
                .is_some_and(char::is_whitespace)
        });
        let differs = escapes
            || split
            || prompt.is_empty()
            || (markup == PromptMarkup::Forbidden && prompt.contains('<'));
        assert_eq!(
            ours != verbatim,
            differs,
            "{case}: {ours:?} vs {verbatim:?}"
        );
        assert_eq!(
            m["cases"][i]["same_as_diffusers"].as_bool().unwrap(),
            !differs,
            "{case}"
        );
    }
}

#[test]
fn spelled_special_tokens_form_their_ids_only_when_allowed() {
    let allowed = load(4, PromptMarkup::Allowed);
    let forbidden = load(4, PromptMarkup::Forbidden);
    let prompt = "<d>rain</d> <|cutoff|>";
    let a = allowed.tokenize(prompt).unwrap();
    let f = forbidden.tokenize(prompt).unwrap();
    for id in [151_669u32, 151_670, 151_671] {
        assert!(a.contains(&id), "allowed: {a:?} lacks {id}");
    }
    assert!(f.iter().all(|&id| id < 151_643), "forbidden: {f:?}");
    // An empty prompt is the pad id, whatever the markup.
    assert_eq!(allowed.tokenize("").unwrap(), vec![151_643]);
    assert_eq!(forbidden.tokenize("").unwrap(), vec![151_643]);
}

#[test]
fn the_layer_must_be_inside_the_encoder() {
    let dir = fixtures().join("model");
    // The default (layer 50) on a 6-layer encoder: refused before any weight is read, naming the key and value.
    let err = H3TextEncoder::load_host(&dir, H3TextOptions::default()).unwrap_err();
    let text = err.to_string();
    println!("default layer: {text}");
    assert!(matches!(
        err,
        H3TextError::Layer {
            layers: 6,
            layer: DEFAULT_LAYER,
            ..
        }
    ));
    assert!(
        text.contains(LAYERS_KEY) && text.contains("is 6") && text.contains("config.json"),
        "{text}"
    );
    // hidden_states[6] of a 6-layer encoder is the final norm's output: refused too, as the reference does.
    let err = H3TextEncoder::load_host(&dir, options(6, PromptMarkup::Allowed)).unwrap_err();
    assert!(err.to_string().contains("is 6"), "{err}");
    assert!(!err.is_invalid_request());
    // What the refusal protects from: the last hidden state differs from the last layer's output.
    let expected = expected();
    let normed = expected.to_f32("plain.layer6").unwrap();
    let last = expected.to_f32("plain.layer5").unwrap();
    let gap = relative_l2(normed.data(), last.data()).unwrap();
    println!("hidden_states[6] (final norm) against hidden_states[5]: relative L2 {gap:.3}");
    assert!(gap > 0.1, "{gap}");
    // Layer 0 (the embeddings) is inside.
    let mut zero = load(0, PromptMarkup::Allowed);
    let f = zero.encode("a red fox").unwrap();
    assert_eq!(f.features.shape(), &[f.ids.len(), 8]);
}

#[test]
fn prompts_over_the_bounds_are_refused_with_the_limit() {
    let dir = fixtures().join("model");
    let long = &cases().into_iter().find(|(c, _, _)| c == "long").unwrap().1;
    let mut text = H3TextEncoder::load_host(
        &dir,
        H3TextOptions {
            max_tokens: 64,
            ..options(4, PromptMarkup::Allowed)
        },
    )
    .unwrap();
    let err = text.encode(long).unwrap_err();
    println!("too many tokens: {err}");
    assert!(matches!(err, H3TextError::PromptTooLong { max: 64, .. }));
    assert!(err.is_invalid_request() && err.to_string().contains("max_tokens"));
    // The component still works after a refusal.
    assert!(text.encode("a red fox").is_ok());

    let text = H3TextEncoder::load_host(
        &dir,
        H3TextOptions {
            max_prompt_bytes: 100,
            ..options(4, PromptMarkup::Allowed)
        },
    )
    .unwrap();
    let err = text.tokenize(long).unwrap_err();
    println!("too many bytes: {err}");
    assert!(matches!(err, H3TextError::PromptTooLarge { max: 100, .. }));
    assert!(err.to_string().contains("max_prompt_bytes"));
    let err = H3TextEncoder::load_host(
        &dir,
        H3TextOptions {
            max_tokens: 0,
            ..options(4, PromptMarkup::Allowed)
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("max_tokens"), "{err}");
}

#[test]
fn vision_placeholders_are_refused_unless_plain_text() {
    let allowed = load(4, PromptMarkup::Allowed);
    let err = allowed
        .tokenize("a cat <|image_pad|> on a mat")
        .unwrap_err();
    println!("vision placeholder: {err}");
    assert!(matches!(err, H3TextError::VisionToken { id: 151_655, .. }));
    assert!(err.is_invalid_request());
    assert!(allowed.tokenize("<|video_pad|>").is_err());
    // As plain text it is just characters.
    let forbidden = load(4, PromptMarkup::Forbidden);
    let ids = forbidden.tokenize("a cat <|image_pad|> on a mat").unwrap();
    assert!(ids.iter().all(|&id| id < 151_643));
}

/// A copy of the fixture's model folder (with its component subfolders) that a test may break.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("h3_text_{tag}_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&fixtures().join("model"), &dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(entry.file_name()));
        } else {
            std::fs::copy(&path, to.join(entry.file_name())).unwrap();
        }
    }
}

#[test]
fn broken_folders_name_what_is_wrong() {
    let opts = || options(4, PromptMarkup::Allowed);
    // No tokenizer anywhere: the error lists the places tried.
    let s = Scratch::new("no_tokenizer");
    std::fs::remove_dir_all(s.0.join("tokenizer")).unwrap();
    let err = H3TextEncoder::load_host(&s.0, opts())
        .unwrap_err()
        .to_string();
    println!("no tokenizer: {err}");
    assert!(
        err.contains("tokenizer/tokenizer.json") && err.contains("processor"),
        "{err}"
    );
    // A tokenizer in processor/ (where a saved processor keeps it) is found.
    let s = Scratch::new("processor");
    std::fs::rename(s.0.join("tokenizer"), s.0.join("processor")).unwrap();
    assert!(H3TextEncoder::load_host(&s.0, opts()).is_ok());
    // A Qwen tokenizer without H3's extra tokens.
    let s = Scratch::new("not_h3");
    let path = s.0.join("tokenizer/tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["id"].as_u64().unwrap() < 151_669);
    std::fs::write(&path, json.to_string()).unwrap();
    let err = H3TextEncoder::load_host(&s.0, opts())
        .unwrap_err()
        .to_string();
    println!("not H3's tokenizer: {err}");
    assert!(
        err.contains("151669") && err.contains("tokenizer.json"),
        "{err}"
    );
    // An encoder whose vocabulary is smaller than the tokenizer's ids.
    let s = Scratch::new("vocab");
    let path = s.0.join("text_encoder/config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["text_config"]["vocab_size"] = serde_json::json!(4096);
    std::fs::write(&path, json.to_string()).unwrap();
    let err = H3TextEncoder::load_host(&s.0, opts())
        .unwrap_err()
        .to_string();
    println!("small vocabulary: {err}");
    assert!(
        err.contains("vocab_size") && err.contains("4096") && err.contains("151675"),
        "{err}"
    );
    // No text encoder.
    let s = Scratch::new("no_encoder");
    std::fs::remove_dir_all(s.0.join("text_encoder")).unwrap();
    let err = H3TextEncoder::load_host(&s.0, opts())
        .unwrap_err()
        .to_string();
    assert!(err.contains("text_encoder/config.json"), "{err}");
}

#[test]
fn the_component_holds_only_the_layers_it_reads() {
    let te = fixtures().join("model/text_encoder");
    let model = ModelDir::open(&te).unwrap();
    let full = HostTextEncoder::load(&model).unwrap();
    let layers = full.config().num_hidden_layers;
    let (_, prompt, _) = cases().into_iter().next().unwrap();
    for layer in [4usize, 5] {
        // hidden_states[layer] is decoder layer `layer`'s output: the component keeps layers 0..layer.
        let mut text = load(layer, PromptMarkup::Allowed);
        let encoded = text.encode(&prompt).unwrap();
        assert_eq!(
            encoded.features,
            full.features_at(&encoded.ids, layer).unwrap(),
            "hidden_states[{layer}]: capped and uncapped loads agree bit for bit"
        );
        let capped = load_host_backend(&model, layer).unwrap();
        assert_eq!(capped.loaded_layers(), layer);
        assert_eq!(capped.tensors_read(), 1 + 11 * layer);
        assert!(full.tensors_read() > capped.tensors_read());
        assert_eq!(text.weight_bytes(), capped.weight_bytes());
        assert!(text.weight_bytes() < full.weight_bytes());
        println!(
            "layer {layer}: {} of {} B of f32 weights held ({} of {} tensors read)",
            text.weight_bytes(),
            full.weight_bytes(),
            capped.tensors_read(),
            full.tensors_read()
        );
        // The backend refuses a layer past its cap, naming both.
        let err = text
            .backend_mut()
            .features_at(&encoded.ids, layer + 1)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("hidden_states[{}]", layer + 1))
                && err.contains(&format!("0..{layer}"))
                && err.contains(&format!("{layers}")),
            "{err}"
        );
    }
    // A folder without the layers past 4 and the final norm serves layer 4, and refuses layer 5 by naming the
    // missing tensor.
    let s = Scratch::new("capped");
    let te_copy = s.0.join("text_encoder");
    let tensors: Vec<(String, TensorF32)> = model
        .names()
        .filter(|n| {
            !n.contains("layers.4.") && !n.contains("layers.5.") && !n.ends_with(".norm.weight")
        })
        .map(|n| (n.to_string(), model.to_f32(n).unwrap()))
        .collect();
    let refs: Vec<(&str, AnyTensor<'_>)> = tensors
        .iter()
        .map(|(n, t)| (n.as_str(), AnyTensor::F32(t)))
        .collect();
    std::fs::remove_file(te_copy.join("model.safetensors")).unwrap();
    write_safetensors(&te_copy.join("model.safetensors"), &refs).unwrap();
    let mut text = H3TextEncoder::load_host(&s.0, options(4, PromptMarkup::Allowed)).unwrap();
    let encoded = text.encode(&prompt).unwrap();
    assert_eq!(encoded.features, full.features_at(&encoded.ids, 4).unwrap());
    let err = H3TextEncoder::load_host(&s.0, options(5, PromptMarkup::Allowed))
        .unwrap_err()
        .to_string();
    assert!(err.contains("layers.4."), "{err}");
}
