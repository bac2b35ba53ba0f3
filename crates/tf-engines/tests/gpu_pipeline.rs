//! The Qwen-Image pipeline on the GPU backend, on the tiny pipeline folder (tests/fixtures/qwen_pipeline/model):
//! loaded with a device budget of its largest component it runs sequentially (each request loads, runs and
//! frees the components in turn) and gives the same image bytes and step latents as the resident pipeline, and
//! the device memory a sequential request takes comes back when it returns.
//!
//! Runs only on a GPU machine (through `cargo xtask gpu-bundle`); ignored elsewhere.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use tf_engines::nn::memory_plan::Residency;
use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline, Request};

/// Free memory after a sequential request may differ from before by at most this (driver caches, other tenants).
const FREE_MEMORY_TOLERANCE: u64 = 64 << 20;

fn tiny_qwen_folder() -> PathBuf {
    let relative = "tests/fixtures/qwen_pipeline/model";
    let mut candidates = Vec::new();
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        candidates.push(PathBuf::from(bundle).join(relative));
    }
    candidates.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(relative),
    );
    candidates
        .iter()
        .find(|p| p.join("model_index.json").is_file())
        .cloned()
        .unwrap_or_else(|| panic!("the tiny pipeline folder is not in any of {candidates:?}"))
}

fn free_bytes(pipeline: &Pipeline) -> u64 {
    pipeline
        .context()
        .expect("a GPU pipeline has a context")
        .memory_info()
        .expect("cuMemGetInfo")
        .free
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_sequential_pipeline_gives_the_resident_bytes_and_frees_its_components() {
    let model = tiny_qwen_folder();
    let request = Request {
        width: 64,
        height: 96,
        steps: Some(3),
        seed: 7,
        negative_prompt: Some("blurry".into()),
        true_cfg_scale: 4.0,
        ..Request::new("a red fox in the snow")
    };

    let mut resident = Pipeline::load(&model, &LoadOptions::new(Backend::Gpu)).unwrap();
    resident.keep_step_latents(true);
    assert_eq!(resident.load_report().residency, Residency::AllResident);
    println!("resident: {}", resident.memory_plan());
    let largest = resident.memory_plan().largest();
    let ours = resident.generate(&request, &mut |_| {}).unwrap();
    drop(resident);

    let options = LoadOptions {
        device_budget: Some(largest),
        ..LoadOptions::new(Backend::Gpu)
    };
    let mut sequential = Pipeline::load(&model, &options).unwrap();
    sequential.keep_step_latents(true);
    let report = sequential.load_report();
    println!("sequential: {}", sequential.memory_plan());
    assert_eq!(report.residency, Residency::Sequential);
    assert_eq!(report.resident_bytes, 0);
    assert!(sequential
        .warm_up(64, 64, std::time::Duration::ZERO)
        .unwrap()
        .skipped
        .is_some());

    for round in 0..2 {
        let free_before = free_bytes(&sequential);
        let theirs = sequential.generate(&request, &mut |_| {}).unwrap();
        let free_after = free_bytes(&sequential);
        let loads = theirs.timings.loads;
        println!(
            "request {round}: loads te {:.4} s, DiT {:.4} s, VAE {:.4} s; total {:.4} s; free {} -> {} B",
            loads.text_encoder, loads.dit, loads.vae, theirs.timings.total, free_before, free_after
        );
        assert!(
            free_before.abs_diff(free_after) <= FREE_MEMORY_TOLERANCE,
            "request {round}: free memory {free_before} B before, {free_after} B after"
        );
        assert_eq!(
            theirs.image, ours.image,
            "request {round}: image bytes differ"
        );
        assert_eq!(theirs.step_latents.len(), ours.step_latents.len());
        for (i, (a, b)) in theirs
            .step_latents
            .iter()
            .zip(&ours.step_latents)
            .enumerate()
        {
            let bits = |t: &tf_engines::nn::tensor::TensorF32| {
                t.data().iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            assert!(
                bits(a) == bits(b),
                "request {round}: step {i} latents differ"
            );
        }
        assert!(loads.text_encoder > 0.0 && loads.dit > 0.0 && loads.vae > 0.0);
    }
}
