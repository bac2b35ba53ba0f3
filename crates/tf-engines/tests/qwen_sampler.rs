//! Sampler and noise parity with the reference fixtures in tests/fixtures/qwen_sampler (made by
//! tests/python/qwen_pipeline_fixtures.py from diffusers' FlowMatchEulerDiscreteScheduler): every sigma,
//! timestep, model timestep, Euler step and CFG combine must match bit for bit.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use serde_json::Value;
use tf_engines::nn::sampling::flow_match::{
    cfg_combine, LatentDtype, Schedule, SchedulerConfig, SigmaSource,
};
use tf_engines::nn::sampling::noise::{load_noise, normals, packed_latents};
use tf_engines::nn::weights::SafetensorsFile;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_sampler")
}

fn manifest() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("cases.json")).expect("cases.json");
    serde_json::from_str(&text).expect("cases.json is JSON")
}

fn tensor(file: &SafetensorsFile, name: &str) -> Vec<f32> {
    file.to_f32(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .into_data()
}

/// Bitwise comparison (so -0.0 vs 0.0 and every last bit count); reports the first mismatch.
fn assert_bits(what: &str, ours: &[f32], reference: &[f32]) {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{what}[{i}]: ours {a:e} ({:#010x}), reference {b:e} ({:#010x})",
            a.to_bits(),
            b.to_bits()
        );
    }
}

#[test]
fn schedules_match_the_reference_scheduler() {
    let manifest = manifest();
    let file = SafetensorsFile::open(&fixture_dir().join("sampler.safetensors")).unwrap();
    let cases = manifest["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10);
    for case in cases {
        let index = case["index"].as_u64().unwrap();
        let config = SchedulerConfig::from_json(&case["scheduler_config"]).unwrap();
        let seq = case["image_seq_len"].as_u64().unwrap() as usize;
        let explicit: Option<Vec<f64>> = case["explicit_sigmas"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_f64().unwrap()).collect());
        let steps = case["steps"].as_u64().unwrap() as usize;
        let source = match &explicit {
            Some(list) => SigmaSource::Explicit(list),
            None => SigmaSource::Steps(steps),
        };
        // Stored as a string: parsing it with str::parse is correctly rounded.
        let mu: f64 = case["mu"].as_str().unwrap().parse().unwrap();
        assert_eq!(config.mu(seq).to_bits(), mu.to_bits(), "case{index} mu");
        let schedule = Schedule::new(&config, source, seq).unwrap();
        let p = format!("case{index}");
        assert_bits(
            &format!("{p}.sigmas"),
            schedule.sigmas(),
            &tensor(&file, &format!("{p}.sigmas")),
        );
        assert_bits(
            &format!("{p}.timesteps"),
            schedule.timesteps(),
            &tensor(&file, &format!("{p}.timesteps")),
        );
        for (dtype, name) in [(LatentDtype::Bf16, "bf16"), (LatentDtype::F32, "f32")] {
            let model_t: Vec<f32> = (0..schedule.steps())
                .map(|i| schedule.model_timestep(i, dtype).unwrap())
                .collect();
            assert_bits(
                &format!("{p}.model_t_{name}"),
                &model_t,
                &tensor(&file, &format!("{p}.model_t_{name}")),
            );
            let mut x = tensor(&file, &format!("{p}.{name}.x0"));
            for i in 0..case["euler_steps"].as_u64().unwrap() as usize {
                let v = tensor(&file, &format!("{p}.{name}.v{i}"));
                schedule.euler_step(i, &mut x, &v, dtype).unwrap();
                assert_bits(
                    &format!("{p}.{name}.x{}", i + 1),
                    &x,
                    &tensor(&file, &format!("{p}.{name}.x{}", i + 1)),
                );
            }
        }
        println!(
            "case{index}: {} steps, seq {seq}, first sigmas {:?}: bit-exact",
            schedule.steps(),
            &schedule.sigmas()[..schedule.sigmas().len().min(3)]
        );
    }
}

#[test]
fn cfg_combine_matches_the_reference() {
    let manifest = manifest();
    let scale = manifest["cfg_scale"].as_f64().unwrap() as f32;
    let file = SafetensorsFile::open(&fixture_dir().join("sampler.safetensors")).unwrap();
    for (dtype, name) in [(LatentDtype::Bf16, "bf16"), (LatentDtype::F32, "f32")] {
        let cond = tensor(&file, &format!("cfg.{name}.cond"));
        let neg = tensor(&file, &format!("cfg.{name}.neg"));
        let mut out = vec![0.0; cond.len()];
        cfg_combine(&cond, &neg, scale, dtype, &mut out).unwrap();
        assert_bits(
            &format!("cfg.{name}.out"),
            &out,
            &tensor(&file, &format!("cfg.{name}.out")),
        );
    }
}

#[test]
fn noise_matches_the_independent_implementation() {
    let manifest = manifest();
    let path = fixture_dir().join("noise.safetensors");
    let file = SafetensorsFile::open(&path).unwrap();
    for case in manifest["noise"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let seed: u64 = case["seed"].as_str().unwrap().parse().unwrap();
        if name == "packed" {
            let dims = |k: &str| case[k].as_u64().unwrap() as usize;
            let (b, c, h, w) = (
                dims("batch"),
                dims("channels"),
                dims("latent_height"),
                dims("latent_width"),
            );
            for (dtype, key) in [
                (LatentDtype::F32, "packed_f32"),
                (LatentDtype::Bf16, "packed_bf16"),
            ] {
                let ours = packed_latents(seed, b, c, h, w, dtype).unwrap();
                assert_eq!(ours.shape(), &[b, h * w, c]);
                assert_bits(key, ours.data(), &tensor(&file, key));
                // The packed fixture also loads as injected noise.
                let loaded = load_noise(&path, key, b, c, h, w).unwrap();
                assert_bits("load_noise packed", loaded.data(), ours.data());
            }
        } else {
            let count = case["count"].as_u64().unwrap() as usize;
            assert_bits(name, &normals(seed, count), &tensor(&file, name));
            println!("noise {name}: {count} samples bit-exact");
        }
    }
}

#[test]
fn injected_noise_accepts_the_draw_layouts() {
    use tf_engines::nn::tensor::Tensor;
    use tf_engines::nn::weights::{write_safetensors, AnyTensor};
    let (b, c, h, w) = (2usize, 3usize, 2usize, 4usize);
    let packed = packed_latents(5, b, c, h, w, LatentDtype::F32).unwrap();
    // Build the (B, 1, C, h, w) layout the pipeline draws in, from the packed tensor.
    let mut planar = vec![0f32; packed.data().len()];
    for bi in 0..b {
        for t in 0..h * w {
            for ci in 0..c {
                planar[(bi * c + ci) * h * w + t] = packed.data()[(bi * h * w + t) * c + ci];
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("tf-noise-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("noise.safetensors");
    let five = Tensor::new(vec![b, 1, c, h, w], planar.clone()).unwrap();
    let modular = Tensor::new(vec![b, c, 1, h, w], planar).unwrap();
    write_safetensors(
        &path,
        &[
            ("latents", AnyTensor::F32(&five)),
            ("modular", AnyTensor::F32(&modular)),
        ],
    )
    .unwrap();
    for name in ["latents", "modular"] {
        let loaded = load_noise(&path, name, b, c, h, w).unwrap();
        assert_bits(name, loaded.data(), packed.data());
    }
    let err = load_noise(&path, "latents", b, c, w, h).unwrap_err();
    assert!(err.to_string().contains("expected"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn scheduler_config_comes_from_the_model_folder() {
    let manifest = manifest();
    let case = &manifest["cases"][7]; // dynamic shift with shift_terminal
    let dir = std::env::temp_dir().join(format!("tf-scheduler-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("scheduler")).unwrap();
    // Without a scheduler folder: the Qwen-Image 2.1 assumption.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_eq!(
        SchedulerConfig::from_model_folder(&empty).unwrap(),
        SchedulerConfig::qwen_image()
    );
    std::fs::write(
        dir.join("scheduler").join("scheduler_config.json"),
        serde_json::to_string_pretty(&case["scheduler_config"]).unwrap(),
    )
    .unwrap();
    let config = SchedulerConfig::from_model_folder(&dir).unwrap();
    assert_eq!(
        config,
        SchedulerConfig::from_json(&case["scheduler_config"]).unwrap()
    );
    assert!(config.use_dynamic_shifting);
    assert_eq!(config.shift_terminal, Some(0.02));
    std::fs::write(
        dir.join("scheduler").join("scheduler_config.json"),
        "{not json",
    )
    .unwrap();
    assert!(SchedulerConfig::from_model_folder(&dir).is_err());
    std::fs::remove_dir_all(&dir).ok();
}
