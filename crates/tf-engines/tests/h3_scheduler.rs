//! The MiniMax H3 scheduler and noise layout against the diffusers 0.42.1 fp32 fixtures
//! (tests/fixtures/minimax_h3_scheduler, made by tests/python/h3_scheduler_fixtures.py), bit for bit: grids and
//! timesteps for many N at four shifts (video 12, audio 3, 1 and 7.3), every Euler step of the stepped cases, given
//! sigmas, forward noising at the anchors' 0.999, the injected noise and the video patchify; and hostile configs.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use tf_engines::minimax_h3::noise::{patchify, H3Noise, NoiseShape, AUDIO_NOISE, VIDEO_NOISE};
use tf_engines::minimax_h3::scheduler::{
    scale_noise, H3Schedule, H3SchedulerConfig, H3SchedulerConfigError, Modality,
    KEYFRAME_NOISE_AUG,
};
use tf_engines::nn::sampling::flow_match::{LatentDtype, SigmaSource};
use tf_engines::nn::sampling::scheduler::Scheduler;
use tf_engines::nn::tensor::{Tensor, TensorF32};
use tf_engines::nn::weights::{write_safetensors, AnyTensor, SafetensorsFile};

fn fixtures() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/minimax_h3_scheduler");
        if p.is_dir() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_scheduler")
}

fn manifest() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
        .unwrap()
}

fn file(name: &str) -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join(name)).unwrap()
}

fn assert_bits(what: &str, actual: &[f32], reference: &[f32]) {
    assert_eq!(actual.len(), reference.len(), "{what}: length");
    for (i, (a, r)) in actual.iter().zip(reference).enumerate() {
        assert_eq!(
            a.to_bits(),
            r.to_bits(),
            "{what}[{i}]: ours {a:e}, reference {r:e}"
        );
    }
}

fn rows(t: &TensorF32) -> Vec<&[f32]> {
    let width = t.shape()[1];
    t.data().chunks_exact(width).collect()
}

/// Runs every step of `schedule` from the fixture's start sample and checks each result bit for bit.
fn check_steps(case: &str, schedule: &H3Schedule, f: &SafetensorsFile) -> usize {
    let velocities = f.to_f32(&format!("{case}.velocities")).unwrap();
    let samples = f.to_f32(&format!("{case}.samples")).unwrap();
    let (v, xs) = (rows(&velocities), rows(&samples));
    assert_eq!(v.len(), schedule.steps(), "{case}: velocities");
    assert_eq!(xs.len(), schedule.steps() + 1, "{case}: samples");
    let mut x = xs[0].to_vec();
    for step in 0..schedule.steps() {
        Scheduler::step(schedule, step, &mut x, v[step], LatentDtype::F32).unwrap();
        assert_bits(&format!("{case} step {step}"), &x, xs[step + 1]);
    }
    schedule.steps()
}

#[test]
fn grids_and_steps_are_bit_exact() {
    let m = manifest();
    let f = file("scheduler.safetensors");
    let cases = m["cases"].as_object().unwrap();
    let (mut grids, mut steps) = (0, 0);
    let mut shifts = std::collections::BTreeSet::new();
    let mut stepped_points = std::collections::BTreeSet::new();
    for (case, c) in cases {
        let config = H3SchedulerConfig {
            shift: c["shift"].as_f64().unwrap(),
        };
        let schedule = match c.get("points") {
            Some(n) => {
                let n = n.as_u64().unwrap() as usize;
                if c["stepped"].as_bool().unwrap() {
                    stepped_points.insert((config.shift.to_bits(), n));
                }
                H3Schedule::grid(&config, SigmaSource::Steps(n), 0).unwrap()
            }
            None => {
                let sigmas: Vec<f64> = c["sigmas"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                H3Schedule::grid(&config, SigmaSource::Explicit(&sigmas), 0).unwrap()
            }
        };
        let sigmas = f.to_f32(&format!("{case}.sigmas")).unwrap();
        let timesteps = f.to_f32(&format!("{case}.timesteps")).unwrap();
        assert_bits(&format!("{case} sigmas"), schedule.sigmas(), sigmas.data());
        assert_bits(
            &format!("{case} timesteps"),
            schedule.timesteps(),
            timesteps.data(),
        );
        for step in 0..schedule.steps() {
            assert_eq!(
                schedule.model_timestep(step, LatentDtype::F32).unwrap(),
                schedule.timesteps()[step]
            );
        }
        shifts.insert(config.shift.to_bits());
        grids += 1;
        if c["stepped"].as_bool().unwrap() {
            steps += check_steps(case, &schedule, &f);
        }
    }
    // Both release shifts, and several N stepped for each.
    for shift in [12.0f64, 3.0] {
        assert!(shifts.contains(&shift.to_bits()), "shift {shift} missing");
        for n in [2, 3, 8, 30, 50] {
            assert!(
                stepped_points.contains(&(shift.to_bits(), n)),
                "shift {shift} N {n} not stepped"
            );
        }
    }
    println!("{grids} grids and {steps} steps bit-exact");
    assert!(grids >= 100 && steps >= 300, "{grids} grids, {steps} steps");
}

#[test]
fn forward_noising_is_bit_exact() {
    let m = manifest();
    let f = file("scheduler.safetensors");
    let clean = f.to_f32("noising.clean").unwrap();
    let noise = f.to_f32("noising.noise").unwrap();
    let levels = m["noise_levels"].as_array().unwrap();
    assert_eq!(levels[0].as_f64().unwrap() as f32, KEYFRAME_NOISE_AUG);
    for (k, level) in levels.iter().enumerate() {
        let t = level.as_f64().unwrap() as f32;
        let mut out = vec![0f32; clean.data().len()];
        scale_noise(clean.data(), noise.data(), t, &mut out).unwrap();
        let reference = f.to_f32(&format!("noising.t{k}")).unwrap();
        assert_bits(&format!("noising at {t}"), &out, reference.data());
    }
}

fn fixture_shape() -> NoiseShape {
    let m = manifest();
    let v: Vec<usize> = m["noise"]["video"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    let a: Vec<usize> = m["noise"]["audio"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    NoiseShape::new(v[1], v[2], v[3], v[4], a[0], a[1]).unwrap()
}

#[test]
fn injected_noise_and_patchify_match_the_pipeline() {
    let shape = fixture_shape();
    let path = fixtures().join("noise.safetensors");
    let noise = H3Noise::load(&path, &shape).unwrap();
    let f = file("noise.safetensors");
    assert_bits(
        "video noise",
        noise.video.data(),
        f.to_f32(VIDEO_NOISE).unwrap().data(),
    );
    assert_bits(
        "audio noise",
        noise.audio.data(),
        f.to_f32(AUDIO_NOISE).unwrap().data(),
    );
    let expected = f.to_f32("video_rows").unwrap();
    let packed = patchify(&noise.video, [1, 2, 2]).unwrap();
    assert_eq!(packed.shape(), expected.shape());
    assert_bits("video rows", packed.data(), expected.data());

    // The pipeline's `audio_latents` input layout [1, A_C, 2 A] and a batchless video load to the same noise.
    let (r, c) = (shape.audio_rows, shape.audio_channels);
    let mut transposed = vec![0f32; r * c];
    for row in 0..r {
        for ch in 0..c {
            transposed[ch * r + row] = noise.audio.data()[row * c + ch];
        }
    }
    let audio_in = Tensor::new(vec![1, c, r], transposed).unwrap();
    let video_in = Tensor::new(
        noise.video.shape()[1..].to_vec(),
        noise.video.data().to_vec(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("tf-engines-h3-noise-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let other = dir.join("noise.safetensors");
    write_safetensors(
        &other,
        &[
            (VIDEO_NOISE, AnyTensor::F32(&video_in)),
            (AUDIO_NOISE, AnyTensor::F32(&audio_in)),
        ],
    )
    .unwrap();
    assert_eq!(H3Noise::load(&other, &shape).unwrap(), noise);

    // A file of another shape is refused, naming the file and the tensor.
    let wrong = NoiseShape::new(
        shape.channels,
        shape.frames + 1,
        shape.height,
        shape.width,
        r,
        c,
    )
    .unwrap();
    let e = H3Noise::load(&other, &wrong).unwrap_err().to_string();
    assert!(
        e.contains("noise.safetensors") && e.contains(VIDEO_NOISE),
        "{e}"
    );
    let wrong = NoiseShape::new(
        shape.channels,
        shape.frames,
        shape.height,
        shape.width,
        r + 1,
        c,
    )
    .unwrap();
    let e = H3Noise::load(&other, &wrong).unwrap_err().to_string();
    assert!(e.contains(AUDIO_NOISE), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn generated_noise_is_video_then_audio_from_one_stream() {
    let shape = NoiseShape::new(24, 2, 4, 6, 20, 32).unwrap();
    let noise = H3Noise::generate(11, &shape).unwrap();
    let all = tf_engines::nn::sampling::noise::normals(11, 24 * 2 * 4 * 6 + 20 * 32);
    assert_eq!(noise.video.shape(), &[1, 24, 2, 4, 6]);
    assert_eq!(noise.audio.shape(), &[20, 32]);
    assert_eq!(noise.video.data(), &all[..1152]);
    assert_eq!(noise.audio.data(), &all[1152..]);
}

fn invalid(value: serde_json::Value) -> String {
    let e =
        H3SchedulerConfig::from_json_file(&value, Path::new("m/scheduler/scheduler_config.json"))
            .unwrap_err();
    assert!(matches!(e, H3SchedulerConfigError::Invalid { .. }), "{e:?}");
    let s = e.to_string();
    assert!(s.contains("m/scheduler/scheduler_config.json"), "{s}");
    s
}

#[test]
fn hostile_configs_are_clear_errors() {
    use serde_json::json;
    for (value, key) in [
        (json!({"shift": "twelve"}), "`shift`"),
        (json!({"shift": -3.0}), "`shift`"),
        (json!({"shift": 0.0}), "`shift`"),
        (json!({"shift": 1e300}), "`shift`"),
        (json!({"shift": [12]}), "`shift`"),
        (
            json!({"_class_name": "FlowMatchEulerDiscreteScheduler"}),
            "`_class_name`",
        ),
        (json!({"_class_name": 7}), "`_class_name`"),
    ] {
        let s = invalid(value.clone());
        assert!(s.contains(key), "{value}: {s}");
    }
    for value in [json!([1, 2]), json!("x"), json!(null)] {
        invalid(value);
    }
    // The real file's keys parse; bookkeeping keys are ignored, null takes the default.
    let ok = H3SchedulerConfig::from_json(&json!({
        "_class_name": "MiniMaxH3Scheduler", "_diffusers_version": "0.42.1", "shift": 3.0
    }))
    .unwrap();
    assert_eq!(ok, H3SchedulerConfig::audio());
    assert_eq!(
        H3SchedulerConfig::from_json(&json!({"shift": null})).unwrap(),
        H3SchedulerConfig::video()
    );

    // Files: missing folders take the release values; bad JSON and unreadable files name the path.
    let dir = std::env::temp_dir().join(format!("tf-engines-h3-sched-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("audio_scheduler")).unwrap();
    assert_eq!(
        H3SchedulerConfig::from_model_folder(&dir, Modality::Video).unwrap(),
        H3SchedulerConfig::video()
    );
    assert_eq!(
        H3SchedulerConfig::from_model_folder(&dir, Modality::Audio).unwrap(),
        H3SchedulerConfig::audio()
    );
    let audio = dir.join("audio_scheduler/scheduler_config.json");
    std::fs::write(&audio, r#"{"shift": 4.5}"#).unwrap();
    assert_eq!(
        H3SchedulerConfig::from_model_folder(&dir, Modality::Audio)
            .unwrap()
            .shift,
        4.5
    );
    std::fs::write(&audio, "{\"shift\": ").unwrap();
    let e = H3SchedulerConfig::from_model_folder(&dir, Modality::Audio).unwrap_err();
    assert!(
        e.to_string()
            .contains("audio_scheduler/scheduler_config.json"),
        "{e}"
    );
    std::fs::write(&audio, r#"{"shift": -1}"#).unwrap();
    let e = H3SchedulerConfig::from_model_folder(&dir, Modality::Audio).unwrap_err();
    assert!(e.to_string().contains("`shift`"), "{e}");
    let e = H3SchedulerConfig::from_file(&dir.join("missing.json")).unwrap_err();
    assert!(matches!(e, H3SchedulerConfigError::Io { .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();

    // A config built in code is validated by the grid too.
    for shift in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e12] {
        let c = H3SchedulerConfig { shift };
        assert!(
            H3Schedule::grid(&c, SigmaSource::Steps(8), 0).is_err(),
            "{shift}"
        );
        assert!(H3Schedule::grid(&c, SigmaSource::Explicit(&[1.0, 0.0]), 0).is_err());
    }
    for n in [0, 1, usize::MAX] {
        assert!(H3Schedule::grid(&H3SchedulerConfig::video(), SigmaSource::Steps(n), 0).is_err());
    }
}

#[test]
fn the_extreme_bounds_give_finite_grids() {
    for shift in [1e-6, 1e6] {
        let s = H3Schedule::from_points(&H3SchedulerConfig { shift }, 1000).unwrap();
        assert!(s.sigmas().iter().all(|v| v.is_finite()));
        assert!(s.sigmas().windows(2).all(|w| w[1] < w[0]));
        assert_eq!(*s.sigmas().last().unwrap(), 0.0);
    }
}
