//! `tf image` checks the request (size, steps, the noise file's shape) against the folder's configs before it
//! loads the model: a folder holding only configs (no weights) shows that nothing was loaded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tf() -> &'static str {
    env!("CARGO_BIN_EXE_tf")
}

/// The tiny pipeline folder with its JSON files and tokenizer, but no weights: a load would fail.
fn configs_only(name: &str) -> PathBuf {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_pipeline/model");
    let dir = std::env::temp_dir().join(format!("tf-image-cli-{}-{name}", std::process::id()));
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
            if entry.path().extension().is_some_and(|e| e == "safetensors") {
                continue;
            }
            std::fs::copy(entry.path(), dir.join(sub).join(entry.file_name())).unwrap();
        }
    }
    std::fs::copy(src.join("model_index.json"), dir.join("model_index.json")).unwrap();
    dir
}

fn image(model: &Path, extra: &[&str]) -> Output {
    Command::new(tf())
        .args(["image", "--backend", "host", "--prompt", "a fox", "--model"])
        .arg(model)
        .args(extra)
        .arg("-o")
        .arg(std::env::temp_dir().join(format!("tf-image-cli-{}.png", std::process::id())))
        .output()
        .unwrap()
}

fn refused_before_loading(out: &Output, expect: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(expect), "expected {expect:?} in: {stderr}");
    assert!(
        !stderr.contains("loading"),
        "the model was loaded first: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_sizes_and_steps_are_refused_before_the_model_loads() {
    let model = configs_only("size");
    refused_before_loading(&image(&model, &["--size", "16x64"]), "invalid request");
    refused_before_loading(&image(&model, &["--size", "99999x64"]), "largest side");
    refused_before_loading(&image(&model, &["--steps", "0"]), "steps");
    refused_before_loading(&image(&model, &["--steps", "100000"]), "steps");
    // A good request gets past the check and fails only in the load (no weights here).
    let out = image(&model, &["--size", "64x64", "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("loading"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn a_huge_size_with_a_noise_file_is_an_error_not_a_panic() {
    let model = configs_only("noise");
    let noise = std::env::temp_dir().join(format!(
        "tf-image-cli-{}-noise.safetensors",
        std::process::id()
    ));
    let latents = tf_engines::nn::tensor::Tensor::new(vec![1, 4, 4], vec![0f32; 16]).unwrap();
    tf_engines::nn::weights::write_safetensors(
        &noise,
        &[("noise", tf_engines::nn::weights::AnyTensor::F32(&latents))],
    )
    .unwrap();
    let huge = "137438953472x137438953472";
    refused_before_loading(
        &image(
            &model,
            &["--size", huge, "--noise", noise.to_str().unwrap()],
        ),
        "invalid request",
    );
    // A size that passes, with a noise tensor of the wrong shape: refused before the load too.
    refused_before_loading(
        &image(
            &model,
            &["--size", "64x64", "--noise", noise.to_str().unwrap()],
        ),
        "shape",
    );
    let _ = std::fs::remove_file(&noise);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn a_device_budget_below_the_components_loads_them_in_the_request_and_says_so() {
    use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline};
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_pipeline/model");
    // The largest component's bytes on the host: a cap there holds one component at a time.
    let pipeline = Pipeline::load(&model, &LoadOptions::new(Backend::Host)).unwrap();
    let largest = pipeline.memory_plan().largest();
    drop(pipeline);
    let budget = format!("{largest}B");
    let out = image(
        &model,
        &[
            "--size",
            "64x64",
            "--steps",
            "2",
            "--device-budget",
            &budget,
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("load, run and free in turn"), "{stderr}");
    assert!(
        stderr.contains("component loads in the request") && stderr.contains("text encoder"),
        "{stderr}"
    );
    // Without a cap everything stays resident and nothing is loaded inside the request.
    let out = image(&model, &["--size", "64x64", "--steps", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        !stderr.contains("component loads in the request"),
        "{stderr}"
    );
    // Below the largest component the load is refused, naming the cap; a budget without a unit is a usage error.
    let below = format!("{}B", largest - 1);
    let out = image(&model, &["--size", "64x64", "--device-budget", &below]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("device budget"), "{stderr}");
    let out = image(&model, &["--device-budget", "40GB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("GiB") && !stderr.contains("panicked"),
        "{stderr}"
    );
}
