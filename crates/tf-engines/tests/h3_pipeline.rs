//! The MiniMax H3 pipeline on the host reference against the diffusers 0.42.1 pipeline in fp32 on the committed
//! tiny folder (tests/fixtures/minimax_h3_pipeline, made by tests/python/h3_pipeline_fixtures.py): the same prompt
//! and injected noise give the same token ids, prompt features, rows after every step (video and audio), decoded
//! frames and audio samples, within relative L2 1e-4. Also: the seeded noise is the injected one, the sequential
//! residency gives the same bits as the resident one, and bad requests are refused naming the field before any
//! model runs.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use tf_engines::minimax_h3::noise::{H3Noise, NoiseShape};
use tf_engines::minimax_h3::pipeline::{
    Backend, H3Pipeline, Limits, LoadOptions, PipelineError, Request,
};
use tf_engines::nn::memory_plan::Residency;
use tf_engines::nn::tensor::{relative_l2, TensorF32};
use tf_engines::nn::weights::SafetensorsFile;

const TOLERANCE: f64 = 1e-4;

fn fixtures() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let p = PathBuf::from(bundle).join("tests/fixtures/minimax_h3_pipeline");
        if p.is_dir() {
            return p;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_pipeline")
}

fn manifest() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("manifest.json")).unwrap())
        .unwrap()
}

fn expected() -> SafetensorsFile {
    SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap()
}

fn case(name: &str) -> serde_json::Value {
    manifest()["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["case"] == name)
        .unwrap()
        .clone()
}

fn int(v: &serde_json::Value, key: &str) -> usize {
    v[key].as_u64().unwrap() as usize
}

/// The case's request with its injected noise.
fn request(name: &str) -> Request {
    let c = case(name);
    let e = expected();
    let mut r = Request::new(c["prompt"].as_str().unwrap());
    r.width = int(&c, "width");
    r.height = int(&c, "height");
    r.seconds = int(&c, "num_frames") as f64 / 24.0;
    r.steps = Some(int(&c, "num_inference_steps"));
    r.seed = c["seed"].as_u64().unwrap();
    r.noise = Some(H3Noise {
        video: e.to_f32(&format!("{name}.video_noise")).unwrap(),
        audio: e.to_f32(&format!("{name}.audio_noise")).unwrap(),
    });
    r
}

fn load(options: &LoadOptions) -> H3Pipeline {
    H3Pipeline::load(&fixtures().join("model"), options).unwrap()
}

fn close(what: &str, actual: &[f32], reference: &TensorF32) -> f64 {
    assert_eq!(actual.len(), reference.data().len(), "{what}: length");
    let err = relative_l2(actual, reference.data()).unwrap();
    println!("{what}: {} values, relative L2 {err:.3e}", actual.len());
    assert!(
        err <= TOLERANCE,
        "{what}: relative L2 {err:.3e} > {TOLERANCE:e}"
    );
    err
}

fn check_case(pipeline: &mut H3Pipeline, name: &str) {
    let c = case(name);
    let e = expected();
    let mut phases = Vec::new();
    let made = pipeline
        .generate(&request(name), &mut |p| phases.push(p))
        .unwrap();
    let ids: Vec<u32> = e
        .to_i64(&format!("{name}.prompt_ids"))
        .unwrap()
        .data()
        .iter()
        .map(|&i| i as u32)
        .collect();
    assert_eq!(made.prompt_ids, ids, "{name}: token ids");
    close(
        &format!("{name} prompt features"),
        made.prompt_embeds.data(),
        &e.to_f32(&format!("{name}.prompt_embeds")).unwrap(),
    );
    let forwards = int(&c, "forwards");
    assert_eq!(made.step_latents.len(), forwards, "{name}: steps");
    let mut worst: f64 = 0.0;
    for (i, rows) in made.step_latents.iter().enumerate() {
        let v = e.to_f32(&format!("{name}.latents.{i}")).unwrap();
        let a = e.to_f32(&format!("{name}.audio_latents.{i}")).unwrap();
        assert_eq!(rows.video.shape(), v.shape(), "{name} step {i}");
        assert_eq!(rows.audio.shape(), a.shape(), "{name} step {i}");
        worst = worst.max(close(
            &format!("{name} video rows after step {i}"),
            rows.video.data(),
            &v,
        ));
        worst = worst.max(close(
            &format!("{name} audio rows after step {i}"),
            rows.audio.data(),
            &a,
        ));
    }
    let frames = e.to_f32(&format!("{name}.frames")).unwrap();
    assert_eq!(
        [made.frames.frames, made.frames.height, made.frames.width, 3],
        frames.shape(),
        "{name}: frames"
    );
    assert_eq!(made.frames.frames, int(&c, "aligned_frames"));
    let f = close(
        &format!("{name} decoded frames"),
        &made.frames.pixels,
        &frames,
    );
    let audio = e.to_f32(&format!("{name}.audio")).unwrap();
    let stereo = made.audio.as_ref().unwrap();
    assert_eq!(stereo.sample_rate, 8000);
    let samples: Vec<f32> = stereo.left.iter().chain(&stereo.right).copied().collect();
    let a = close(&format!("{name} audio samples"), &samples, &audio);
    println!(
        "{name}: worst rows {worst:.3e}, frames {f:.3e}, audio {a:.3e}; timings {:?}",
        made.timings
    );
    assert_eq!(
        phases.len(),
        1 + forwards + 2,
        "{name}: progress {phases:?}"
    );
}

#[test]
fn the_host_pipeline_matches_the_diffusers_pipeline() {
    let mut pipeline = load(&LoadOptions::new(Backend::Host));
    assert_eq!(pipeline.load_report().residency, Residency::AllResident);
    pipeline.keep_step_latents(true);
    check_case(&mut pipeline, "five_seconds");
    check_case(&mut pipeline, "short");
}

#[test]
fn the_seeded_noise_is_the_injected_noise() {
    for name in ["five_seconds", "short"] {
        let r = request(name);
        let injected = r.noise.clone().unwrap();
        let pre = H3Pipeline::preflight(
            &fixtures().join("model"),
            &LoadOptions::new(Backend::Host),
            &r,
        )
        .unwrap();
        let v = injected.video.shape();
        assert_eq!(
            pre.noise_shape,
            NoiseShape::new(
                v[1],
                v[2],
                v[3],
                v[4],
                injected.audio.shape()[0],
                injected.audio.shape()[1]
            )
            .unwrap()
        );
        let drawn = H3Noise::generate(r.seed, &pre.noise_shape).unwrap();
        assert_eq!(
            drawn, injected,
            "{name}: the portable generator draws the fixture's noise"
        );
        let file = H3Noise::load(
            &fixtures().join(format!("noise_{name}.safetensors")),
            &pre.noise_shape,
        )
        .unwrap();
        assert_eq!(file, injected, "{name}: the noise file for tf video");
    }
}

#[test]
fn sequential_residency_gives_the_same_bits() {
    let mut resident = load(&LoadOptions::new(Backend::Host));
    let total = resident.memory_plan().total();
    let largest = resident.memory_plan().largest();
    let mut options = LoadOptions::new(Backend::Host);
    options.device_budget = Some(largest);
    let mut sequential = load(&options);
    assert_eq!(sequential.load_report().residency, Residency::Sequential);
    assert_eq!(sequential.load_report().resident_bytes, 0);
    assert!(largest < total);
    let mut r = request("short");
    r.noise = None;
    let a = resident.generate(&r, &mut |_| {}).unwrap();
    for _ in 0..2 {
        let b = sequential.generate(&r, &mut |_| {}).unwrap();
        assert_eq!(a.frames, b.frames);
        assert_eq!(a.audio, b.audio);
        assert!(b.timings.loads.total() > 0.0);
        let line = b.timings.loads.to_string();
        assert!(
            line.starts_with(&format!("{:.3} s (text encoder ", b.timings.loads.total()))
                && line.contains(", audio VAE "),
            "{line}"
        );
    }
    assert_eq!(a.timings.loads.total(), 0.0);
    options.device_budget = Some(largest - 1);
    let e = H3Pipeline::load(&fixtures().join("model"), &options).unwrap_err();
    assert!(matches!(e, PipelineError::CappedBudget { .. }), "{e}");
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let mut pipeline = load(&LoadOptions::new(Backend::Host));
    let base = || {
        let mut r = request("short");
        r.noise = None;
        r
    };
    let cases: Vec<(Request, &str)> = vec![
        (
            Request {
                first_frame: Some("f.png".into()),
                ..base()
            },
            "`first_frame`",
        ),
        (
            Request {
                negative_prompt: Some("blurry".into()),
                ..base()
            },
            "`negative_prompt`",
        ),
        (
            Request {
                guidance: Some(5.0),
                ..base()
            },
            "`guidance`",
        ),
        (Request { fps: 30, ..base() }, "`fps` 30"),
        (
            Request {
                seconds: 0.0,
                ..base()
            },
            "`seconds`",
        ),
        (
            Request {
                seconds: f64::NAN,
                ..base()
            },
            "`seconds`",
        ),
        (
            Request {
                seconds: 0.1,
                ..base()
            },
            "takes 0.917 to 15 s",
        ),
        (
            Request {
                seconds: 16.0,
                ..base()
            },
            "`seconds`",
        ),
        (
            Request {
                width: 20,
                ..base()
            },
            "`width` 20: give a multiple of 8",
        ),
        (
            Request {
                height: 0,
                ..base()
            },
            "`height` 0",
        ),
        (
            Request {
                width: 4096,
                ..base()
            },
            "`width` 4096",
        ),
        (
            Request {
                steps: Some(1),
                ..base()
            },
            "`steps` 1",
        ),
        (
            Request {
                steps: Some(5000),
                ..base()
            },
            "`steps` 5000",
        ),
        (
            Request {
                prompt: "<|image_pad|>".into(),
                ..base()
            },
            "`prompt`",
        ),
        (
            Request {
                noise: Some(H3Noise {
                    video: TensorF32::zeros(vec![1, 4, 7, 6, 4]).unwrap(),
                    audio: TensorF32::zeros(vec![3, 4]).unwrap(),
                }),
                ..base()
            },
            "injected noise",
        ),
    ];
    for (r, needle) in cases {
        let mut ran = false;
        let e = pipeline.generate(&r, &mut |_| ran = true).unwrap_err();
        assert!(e.is_invalid_request(), "{needle}: {e}");
        assert!(e.to_string().contains(needle), "expected {needle:?} in {e}");
        assert!(!ran, "{needle}: a phase ran before the refusal");
    }
    // The reference's own window refuses the short clip.
    let mut options = LoadOptions::new(Backend::Host);
    options.limits = Limits::reference();
    let e = H3Pipeline::preflight(&fixtures().join("model"), &options, &base()).unwrap_err();
    assert!(e.to_string().contains("takes 5 to 15 s"), "{e}");
}

#[test]
fn folders_that_do_not_fit_are_refused_before_loading() {
    let e =
        H3Pipeline::load(Path::new("/nonexistent"), &LoadOptions::new(Backend::Host)).unwrap_err();
    assert!(e.to_string().contains("modular_model_index.json"), "{e}");
    // A folder whose DiT expects other latents than its VAE makes.
    let dir = std::env::temp_dir().join(format!("tf-h3-pipeline-mismatch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_dir(&fixtures().join("model"), &dir);
    let path = dir.join("transformer/config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["in_channels"] = 8.into();
    std::fs::write(&path, config.to_string()).unwrap();
    let e = H3Pipeline::load(&dir, &LoadOptions::new(Backend::Host)).unwrap_err();
    assert!(e.to_string().contains("`in_channels` is 8"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}
