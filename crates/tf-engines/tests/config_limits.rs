//! Hostile config values: every config a model folder carries (DiT, text encoder, VAE, scheduler,
//! `model_index.json`) is refused with an error that names the key, never an abort or a panic, and before any
//! weight is read or anything is allocated for it.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tf_engines::nn::sampling::flow_match::SchedulerConfig;
use tf_engines::nn::tensor::Tensor;
use tf_engines::nn::weights::ModelDir;
use tf_engines::qwen3_vl::text_encoder::TextEncoderConfig;
use tf_engines::qwen_image::config::QwenImageDitConfig;
use tf_engines::qwen_image::pipeline::{Backend, FolderLayout, LoadOptions, Pipeline, Request};
use tf_engines::qwen_image::vae::{HostVaeDecoder, VaeConfig};

/// A value near `u64::MAX` (an integer: `1e19` would parse as a float).
const HUGE: u64 = 18_446_744_073_709_551_615;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `base` with `key` set to `value` (in `text_config` when the base has one).
fn with(base: &Value, key: &str, value: Value) -> Value {
    let mut v = base.clone();
    let obj = match v.get_mut("text_config") {
        Some(t) => t.as_object_mut().unwrap(),
        None => v.as_object_mut().unwrap(),
    };
    obj.insert(key.to_string(), value);
    v
}

/// Runs `parse` on `bad` in a thread, so a panic shows as a test failure naming the case rather than an abort.
fn refused<E: std::fmt::Display + 'static>(
    what: &str,
    bad: &Value,
    key: &str,
    parse: fn(&Value) -> Result<(), E>,
) {
    let bad_owned = bad.clone();
    let result = std::thread::spawn(move || parse(&bad_owned).map_err(|e| e.to_string()))
        .join()
        .unwrap_or_else(|_| panic!("{what}: parsing {bad} panicked"));
    let message = result
        .err()
        .unwrap_or_else(|| panic!("{what}: {bad} was accepted"));
    assert!(
        message.contains(key),
        "{what}: the error for {bad} does not name `{key}`: {message}"
    );
}

fn hostile_values() -> Vec<(&'static str, Value)> {
    vec![
        ("huge", json!(HUGE)),
        ("huge minus one", json!(HUGE - 1)),
        ("negative", json!(-1)),
        ("wrong type", json!("two")),
        ("float", json!(2.5)),
    ]
}

#[test]
fn text_encoder_config_refuses_hostile_values() {
    let base = read_json(&fixtures().join("qwen_te/model/config.json"));
    TextEncoderConfig::from_json(&base).unwrap();
    let parse = |v: &Value| TextEncoderConfig::from_json(v).map(|_| ());
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ] {
        for (what, value) in hostile_values() {
            refused(
                &format!("{key} {what}"),
                &with(&base, key, value),
                key,
                parse,
            );
        }
        refused(
            &format!("{key} zero"),
            &with(&base, key, json!(0)),
            key,
            parse,
        );
    }
    // Products of in-range values that overflow or exceed the width bound.
    let wide = with(
        &with(&base, "num_attention_heads", json!(1024)),
        "head_dim",
        json!(1024),
    );
    refused(
        "heads x head_dim",
        &with(&wide, "num_key_value_heads", json!(1)),
        "head_dim",
        parse,
    );
    refused(
        "rms_norm_eps",
        &with(&base, "rms_norm_eps", json!("tiny")),
        "rms_norm_eps",
        parse,
    );
    refused(
        "rope_parameters",
        &with(&base, "rope_parameters", json!({"rope_theta": "x"})),
        "rope_parameters",
        parse,
    );
    refused("not an object", &json!([1, 2]), "JSON object", parse);
    refused(
        "text_config not an object",
        &json!({"text_config": 3}),
        "JSON object",
        parse,
    );
}

#[test]
fn vae_config_refuses_hostile_values() {
    let base = read_json(&fixtures().join("qwen_vae/model/config.json"));
    VaeConfig::from_json(&base).unwrap();
    let parse = |v: &Value| VaeConfig::from_json(v).map(|_| ());
    for key in [
        "z_dim",
        "decoder_base_dim",
        "base_dim",
        "num_res_blocks",
        "out_channels",
    ] {
        for (what, value) in hostile_values() {
            refused(
                &format!("{key} {what}"),
                &with(&base, key, value),
                key,
                parse,
            );
        }
    }
    for key in ["z_dim", "decoder_base_dim", "out_channels"] {
        refused(
            &format!("{key} zero"),
            &with(&base, key, json!(0)),
            key,
            parse,
        );
    }
    // 65 levels: the spatial factor's shift would overflow.
    let deep = with(
        &with(&base, "dim_mult", json!(vec![1; 65])),
        "temperal_downsample",
        json!(vec![false; 64]),
    );
    refused("65 dim_mult entries", &deep, "dim_mult", parse);
    refused(
        "dim_mult huge",
        &with(&base, "dim_mult", json!([1, 2, 4, 8, HUGE])),
        "dim_mult",
        parse,
    );
    // In range alone, but `m * decoder_base_dim` is too wide.
    let wide = with(
        &with(&base, "decoder_base_dim", json!(4096)),
        "dim_mult",
        json!([1, 2, 4, 8, 64]),
    );
    refused("m x decoder_base_dim", &wide, "decoder_base_dim", parse);
    refused(
        "dim_mult wrong type",
        &with(&base, "dim_mult", json!("1,2,4")),
        "dim_mult",
        parse,
    );
    refused(
        "latents_mean wrong type",
        &with(&base, "latents_mean", json!(["a", 0.0, 0.0, 0.0])),
        "latents_mean",
        parse,
    );
    refused(
        "latents_std overflowing f32",
        &with(&base, "latents_std", json!([1e300, 1.0, 1.0, 1.0])),
        "latents_std",
        parse,
    );
    refused(
        "temperal_downsample wrong length",
        &with(&base, "temperal_downsample", json!([true])),
        "temperal_downsample",
        parse,
    );
}

#[test]
fn dit_config_refuses_hostile_values() {
    let base = read_json(&fixtures().join("qwen_pipeline/model/transformer/config.json"));
    QwenImageDitConfig::from_json(&base).unwrap();
    let parse = |v: &Value| QwenImageDitConfig::from_json(v).map(|_| ());
    for key in [
        "in_channels",
        "num_layers",
        "attention_head_dim",
        "num_attention_heads",
        "context_in_dim",
        "mlp_ratio",
    ] {
        for (what, value) in hostile_values() {
            refused(
                &format!("{key} {what}"),
                &with(&base, key, value),
                key,
                parse,
            );
        }
        refused(
            &format!("{key} zero"),
            &with(&base, key, json!(0)),
            key,
            parse,
        );
    }
    refused(
        "axes_dims_rope overflowing sum",
        &with(&base, "axes_dims_rope", json!([HUGE - 1, HUGE - 1, 2])),
        "axes_dims_rope",
        parse,
    );
    refused(
        "axes_dims_rope wrong type",
        &with(&base, "axes_dims_rope", json!("16,56,56")),
        "axes_dims_rope",
        parse,
    );
}

#[test]
fn scheduler_config_refuses_hostile_values() {
    let base = read_json(&fixtures().join("qwen_pipeline/model/scheduler/scheduler_config.json"));
    SchedulerConfig::from_json(&base).unwrap();
    let parse = |v: &Value| SchedulerConfig::from_json(v).map(|_| ());
    for key in [
        "num_train_timesteps",
        "base_image_seq_len",
        "max_image_seq_len",
    ] {
        for (what, value) in hostile_values() {
            refused(
                &format!("{key} {what}"),
                &with(&base, key, value),
                key,
                parse,
            );
        }
    }
    for (key, value) in [
        ("num_train_timesteps", json!(0)),
        ("shift", json!(-1.0)),
        ("shift", json!(1e300)),
        ("shift", json!("1")),
        ("base_shift", json!(1e300)),
        ("max_shift", json!(false)),
        ("use_dynamic_shifting", json!(1)),
        ("use_karras_sigmas", json!("yes")),
        ("time_shift_type", json!(3)),
        ("shift_terminal", json!(2.0)),
    ] {
        refused(
            &format!("{key} = {value}"),
            &with(&base, key, value.clone()),
            key,
            parse,
        );
    }
}

/// A copy of the tiny pipeline folder's small files (configs and tokenizer, weights linked), with
/// `model_index.json` replaced.
fn folder_with_index(name: &str, index: &Value) -> PathBuf {
    let src = fixtures().join("qwen_pipeline/model");
    let dir = std::env::temp_dir().join(format!("tf-config-limits-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in [
        "transformer",
        "text_encoder",
        "vae",
        "scheduler",
        "processor",
    ] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        for entry in std::fs::read_dir(src.join(sub)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(sub).join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(dir.join("model_index.json"), index.to_string()).unwrap();
    dir
}

#[test]
fn model_index_refuses_hostile_values() {
    let base = read_json(&fixtures().join("qwen_pipeline/model/model_index.json"));
    for (name, key, value) in [
        ("sigmas-type", "sample_sigmas", json!("0.5")),
        ("sigmas-item", "sample_sigmas", json!([1.0, "x"])),
        ("sigmas-range", "sample_sigmas", json!([1.0, 2.0])),
        ("sigmas-empty", "sample_sigmas", json!([])),
        ("sigmas-long", "sample_sigmas", json!(vec![0.5; 100_000])),
        ("class", "_class_name", json!(3)),
        ("class-other", "_class_name", json!("FluxPipeline")),
    ] {
        let dir = folder_with_index(name, &with(&base, key, value));
        let err = FolderLayout::read(&dir).unwrap_err();
        assert!(err.to_string().contains(key), "{name}: {err}");
        assert!(
            err.to_string().contains("model_index.json"),
            "{name}: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    let dir = folder_with_index("not-object", &json!([1]));
    assert!(FolderLayout::read(&dir).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hostile_component_config_fails_the_load_cleanly() {
    let base = read_json(&fixtures().join("qwen_pipeline/model/model_index.json"));
    let dir = folder_with_index("hostile-te", &base);
    let te = dir.join("text_encoder/config.json");
    let config = with(
        &read_json(&te),
        "num_hidden_layers",
        json!(1_000_000_000_000_000u64),
    );
    std::fs::write(&te, config.to_string()).unwrap();
    let err = Pipeline::load(&dir, &LoadOptions::new(Backend::Host)).unwrap_err();
    assert!(err.to_string().contains("num_hidden_layers"), "{err}");
    let vae = dir.join("vae/config.json");
    std::fs::copy(
        fixtures().join("qwen_pipeline/model/text_encoder/config.json"),
        &te,
    )
    .unwrap();
    let config = with(&read_json(&vae), "num_res_blocks", json!(HUGE));
    std::fs::write(&vae, config.to_string()).unwrap();
    let err = Pipeline::load(&dir, &LoadOptions::new(Backend::Host)).unwrap_err();
    assert!(err.to_string().contains("num_res_blocks"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn preflight_checks_the_request_without_loading() {
    let dir = fixtures().join("qwen_pipeline/model");
    let options = LoadOptions::new(Backend::Host);
    let ok = Pipeline::preflight(
        &dir,
        &options,
        &Request {
            width: 64,
            height: 96,
            steps: Some(3),
            ..Request::new("x")
        },
    )
    .unwrap();
    assert_eq!((ok.width, ok.height, ok.steps), (64, 96, 3));
    assert_eq!((ok.latent_rows, ok.latent_cols), (6, 4));
    for request in [
        Request {
            width: usize::MAX,
            height: usize::MAX,
            ..Request::new("x")
        },
        Request {
            width: 16,
            ..Request::new("x")
        },
        Request {
            steps: Some(0),
            ..Request::new("x")
        },
        Request {
            true_cfg_scale: f32::NAN,
            ..Request::new("x")
        },
    ] {
        let err = Pipeline::preflight(&dir, &options, &request).unwrap_err();
        assert!(err.is_invalid_request(), "{err}");
    }
}

#[test]
fn host_vae_decode_refuses_an_overflowing_grid() {
    let vae =
        HostVaeDecoder::load(&ModelDir::open(&fixtures().join("qwen_vae/model")).unwrap()).unwrap();
    let packed = Tensor::new(vec![1, 4, 4], vec![0f32; 16]).unwrap();
    let err = vae
        .decode_packed(&packed, usize::MAX, usize::MAX)
        .unwrap_err();
    assert!(err.to_string().contains("too large"), "{err}");
    assert!(vae.decode_packed(&packed, 2, 3).is_err());
}
