//! `tf video` writes an MP4 that ffprobe reads back as asked (streams, codecs, frame count, rate, duration, audio
//! channels and sample rate); without ffmpeg it fails with the install command and keeps the raw frames and audio,
//! leaving no half-written file. The test fails loudly when ffmpeg is missing: `.ci/run` installs it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/media_probe.rs"]
mod media_probe;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tf() -> &'static str {
    env!("CARGO_BIN_EXE_tf")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-video-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str], out: &Path, env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(tf());
    cmd.arg("video").args(args).arg("-o").arg(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// `tf video --engine testpattern` for two 32x32 frames into `dir/clip.mp4`, with `TF_FFMPEG` naming nothing.
fn two_test_pattern_frames_without_ffmpeg(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "--engine",
        "testpattern",
        "--prompt",
        "bars",
        "--size",
        "32x32",
        "--seconds",
        "0.25",
        "--fps",
        "8",
    ];
    args.extend_from_slice(extra);
    run(
        &args,
        &dir.join("clip.mp4"),
        &[("TF_FFMPEG", &dir.join("nowhere").join("ffmpeg"))],
    )
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_test_pattern_mp4_reads_back_as_asked() {
    let dir = scratch("testpattern");
    let out = dir.join("clip.mp4");
    let frames = dir.join("frames");
    let wav = dir.join("clip.wav");
    let res = Command::new(tf())
        .args([
            "video",
            "--engine",
            "testpattern",
            "--prompt",
            "bars",
            "--size",
            "96x64",
            "--seconds",
            "2",
            "--fps",
            "15",
            "--seed",
            "4",
            "--json",
            "-o",
        ])
        .arg(&out)
        .arg("--frames-dir")
        .arg(&frames)
        .arg("--wav")
        .arg(&wav)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(summary["frames"], 30);
    assert_eq!(summary["audio"]["channels"], 2);
    assert!(summary["timings"]["total_s"].as_f64().unwrap() > 0.0);

    let p = media_probe::probe(&out);
    assert!(p.format.contains("mp4"), "{p:?}");
    assert_eq!(
        (p.video_codec.as_str(), p.pix_fmt.as_str()),
        ("h264", "yuv420p")
    );
    assert_eq!((p.width, p.height, p.frames), (96, 64, 30));
    assert_eq!(p.frame_rate, "15/1");
    assert!((p.duration - 2.0).abs() < 0.05, "{p:?}");
    let a = p.audio.clone().expect("an audio stream");
    assert_eq!(
        (a.codec.as_str(), a.channels, a.sample_rate),
        ("aac", 2, 32000)
    );
    assert!((a.duration - 2.0).abs() < 0.05, "{a:?}");

    assert_eq!(names(&frames).len(), 30);
    let back = tf_engines::nn::media::wav::read_wav(&wav).unwrap();
    assert_eq!(
        (back.sample_rate, back.channels, back.frames()),
        (32000, 2, 64000)
    );
    assert_eq!(names(&dir), ["clip.mp4", "clip.wav", "frames"]);

    // --no-audio: one stream.
    let silent = dir.join("silent.mp4");
    let res = run(
        &[
            "--engine",
            "testpattern",
            "--prompt",
            "bars",
            "--size",
            "32x32",
            "--seconds",
            "0.5",
            "--no-audio",
        ],
        &silent,
        &[],
    );
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let p = media_probe::probe(&silent);
    assert_eq!((p.frames, p.frame_rate.as_str()), (12, "24/1"));
    assert!(p.audio.is_none(), "{p:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_ffmpeg_the_raw_output_is_kept_and_the_error_says_how_to_install() {
    let dir = scratch("no-ffmpeg");
    let res = two_test_pattern_frames_without_ffmpeg(&dir, &[]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("apt-get install -y ffmpeg"), "{stderr}");
    assert!(stderr.contains("raw output was written"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(names(&dir), ["clip.wav", "clip_frames"]);
    assert_eq!(
        names(&dir.join("clip_frames")),
        ["frame_00000.png", "frame_00001.png"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_ffmpeg_the_json_report_still_carries_the_timings_and_the_kept_files() {
    let dir = scratch("no-ffmpeg-json");
    let res = two_test_pattern_frames_without_ffmpeg(&dir, &["--json"]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&res.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON report ({e}): {stderr}"));
    assert_eq!(report["ok"], false);
    assert!(report["file"].is_null());
    let error = report["error"].as_str().unwrap_or_default();
    assert!(error.contains("apt-get install -y ffmpeg"), "{error}");
    assert_eq!(report["frames"], 2);
    assert_eq!(report["fps"], 8);
    assert_eq!(
        report["frames_dir"].as_str(),
        Some(dir.join("clip_frames").to_string_lossy().as_ref())
    );
    assert_eq!(
        report["wav"].as_str(),
        Some(dir.join("clip.wav").to_string_lossy().as_ref())
    );
    assert!(report["timings"]["total_s"]
        .as_f64()
        .is_some_and(|t| t >= 0.0));
    assert!(report["timings"]["steps_s"]
        .as_array()
        .is_some_and(|steps| !steps.is_empty()));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_output_folder_is_refused_before_anything_runs() {
    let dir = scratch("no-folder");
    let res = run(
        &["--engine", "testpattern", "--prompt", "bars"],
        &dir.join("absent").join("clip.mp4"),
        &[],
    );
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("does not exist"), "{stderr}");
    assert!(!stderr.contains("step"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn h3() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/minimax_h3_pipeline")
}

/// `tf video` on the tiny MiniMax H3 folder (host reference) with the `short` case's prompt, size and noise: the
/// MP4 reads back as 22 frames at 24 fps with an 8 kHz stereo AAC track, and the frames it kept as PNGs are the
/// diffusers pipeline's frames rounded to 8 bits.
#[test]
fn tf_video_on_the_tiny_h3_folder_writes_the_reference_frames() {
    let dir = scratch("h3");
    let out = dir.join("fox.mp4");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(h3().join("manifest.json")).unwrap())
            .unwrap();
    let case = &manifest["cases"][1];
    assert_eq!(case["case"], "short");
    let size = format!("{}x{}", case["width"], case["height"]);
    let steps = case["num_inference_steps"].to_string();
    let res = Command::new(tf())
        .args([
            "video",
            "--backend",
            "host",
            "--prompt",
            case["prompt"].as_str().unwrap(),
            "--size",
            &size,
        ])
        .args(["--seconds", "0.9", "--steps", &steps, "--json", "--model"])
        .arg(h3().join("model"))
        .arg("--noise")
        .arg(h3().join("noise_short.safetensors"))
        .arg("--frames-dir")
        .arg(dir.join("frames"))
        .arg("--dump-steps")
        .arg(dir.join("steps.safetensors"))
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{stderr}");
    assert!(stderr.contains("step 4/4"), "progress per step: {stderr}");
    dump_matches_the_reference(&dir.join("steps.safetensors"), "short", 4);
    assert!(stderr.contains("memory plan"), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    assert_eq!(summary["frames"], 22);
    assert_eq!(summary["engine"]["requested_frames"], 22);
    for phase in ["encode_s", "decode_video_s", "decode_audio_s"] {
        assert!(
            summary["timings"]["phases"][phase].as_f64().unwrap() > 0.0,
            "{phase}: {summary}"
        );
    }
    assert_eq!(summary["timings"]["steps_s"].as_array().unwrap().len(), 4);

    let p = media_probe::probe(&out);
    assert_eq!(
        (p.video_codec.as_str(), p.pix_fmt.as_str()),
        ("h264", "yuv420p")
    );
    assert_eq!(
        (p.width, p.height, p.frames, p.frame_rate.as_str()),
        (16, 24, 22, "24/1")
    );
    assert!((p.duration - 22.0 / 24.0).abs() < 0.06, "{p:?}");
    let a = p.audio.clone().expect("a stereo track");
    assert_eq!(
        (a.codec.as_str(), a.channels, a.sample_rate),
        ("aac", 2, 8000)
    );

    let expected =
        tf_engines::nn::weights::SafetensorsFile::open(&h3().join("expected.safetensors"))
            .unwrap()
            .to_f32("short.frames")
            .unwrap();
    let plane = 16 * 24 * 3;
    let mut worst = 0i32;
    for i in 0..22 {
        let png = tf_engines::nn::media::png::read_png(
            &dir.join("frames").join(format!("frame_{i:05}.png")),
        )
        .unwrap();
        assert_eq!((png.width, png.height, png.color.channels()), (16, 24, 3));
        for (got, want) in png
            .pixels
            .iter()
            .zip(&expected.data()[i * plane..(i + 1) * plane])
        {
            worst = worst.max((i32::from(*got) - (want * 255.0).round() as i32).abs());
        }
    }
    assert!(
        worst <= 1,
        "a frame differs from the reference by {worst} levels"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `--dump-steps` file holds the reference's names, and its tensors are the diffusers pipeline's (relative L2
/// at most 1e-4): the prompt features, the rows after each of `steps` steps, the frames and the audio.
fn dump_matches_the_reference(path: &Path, case: &str, steps: usize) {
    let ours = tf_engines::nn::weights::SafetensorsFile::open(path).unwrap();
    let expected =
        tf_engines::nn::weights::SafetensorsFile::open(&h3().join("expected.safetensors")).unwrap();
    let mut names = vec![
        ("prompt_embeds".to_string(), "prompt_embeds".to_string()),
        ("frames".into(), "frames".into()),
        ("audio".into(), "audio".into()),
    ];
    for i in 0..steps {
        names.push((format!("latents.{i}"), format!("latents.{i}")));
        names.push((format!("audio_latents.{i}"), format!("audio_latents.{i}")));
    }
    assert!(
        ours.to_f32(&format!("latents.{steps}")).is_err(),
        "one entry a step"
    );
    for (name, reference) in names {
        let got = ours.to_f32(&name).unwrap();
        let want = expected.to_f32(&format!("{case}.{reference}")).unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}");
        let (mut diff, mut norm) = (0f64, 0f64);
        for (a, b) in got.data().iter().zip(want.data()) {
            diff += f64::from(a - b).powi(2);
            norm += f64::from(*b).powi(2);
        }
        let rel = (diff / norm.max(1e-30)).sqrt();
        assert!(
            rel <= 1e-4,
            "{name}: relative L2 {rel:.3e} against the reference"
        );
    }
}

#[test]
fn random_weights_are_refused_on_the_host_with_the_reason() {
    let dir = scratch("h3-random-host");
    let res = Command::new(tf())
        .args(["video", "--backend", "host", "--random-weights", "0"])
        .args([
            "--prompt",
            "x",
            "--size",
            "16x24",
            "--seconds",
            "0.9",
            "--model",
        ])
        .arg(h3().join("model"))
        .arg("-o")
        .arg(dir.join("x.mp4"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("random weights are made on the GPU"),
        "{stderr}"
    );
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn h3_requests_the_model_cannot_serve_are_refused_before_loading() {
    let dir = scratch("h3-refused");
    let model = h3().join("model");
    for (size, seconds, extra, needle) in [
        ("20x24", "0.9", vec![], "`width` 20"),
        ("16x24", "0.9", vec!["--fps", "30"], "`fps` 30"),
        ("16x24", "16", vec![], "`seconds`"),
        ("16x24", "0.9", vec!["--steps", "1"], "`steps` 1"),
    ] {
        let res = Command::new(tf())
            .args([
                "video",
                "--backend",
                "host",
                "--prompt",
                "x",
                "--size",
                size,
                "--seconds",
                seconds,
            ])
            .args(&extra)
            .arg("--model")
            .arg(&model)
            .arg("-o")
            .arg(dir.join("x.mp4"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(
            res.status.code(),
            Some(1),
            "{size} {seconds} {extra:?}: {stderr}"
        );
        assert!(stderr.contains(needle), "expected {needle:?} in {stderr}");
        assert!(
            !stderr.contains("loading"),
            "the model was loaded first: {stderr}"
        );
    }
    // A noise file of another request's shape.
    let res = Command::new(tf())
        .args([
            "video",
            "--backend",
            "host",
            "--prompt",
            "x",
            "--size",
            "16x24",
            "--seconds",
            "0.9",
            "--model",
        ])
        .arg(&model)
        .arg("--noise")
        .arg(h3().join("noise_five_seconds.safetensors"))
        .arg("-o")
        .arg(dir.join("x.mp4"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("video_noise"), "{stderr}");
    assert!(!stderr.contains("loading"), "{stderr}");
    // --model is required for the H3 engine.
    let res = Command::new(tf())
        .args(["video", "--prompt", "x"])
        .output()
        .unwrap();
    assert_eq!(res.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&res.stderr).contains("needs --model DIR"));
    assert!(names(&dir).is_empty(), "{:?}", names(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A device budget that holds one component at a time: the request loads, runs and frees the four in turn and says
/// how long the loads took; without it nothing loads inside the request.
#[test]
fn a_device_budget_below_the_components_loads_them_in_the_request_and_says_so() {
    use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions};
    let model = h3().join("model");
    let pipeline = H3Pipeline::load(&model, &LoadOptions::new(Backend::Host)).unwrap();
    let largest = pipeline.memory_plan().largest();
    drop(pipeline);
    let dir = scratch("budget");
    for (budget, sequential) in [(Some(format!("{largest}B")), true), (None, false)] {
        let mut args = vec![
            "--backend",
            "host",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "waves",
            "--size",
            "16x24",
            "--seconds",
            "0.5",
            "--steps",
            "2",
        ];
        if let Some(budget) = &budget {
            args.extend(["--device-budget", budget.as_str()]);
        }
        let res = run(&args, &dir.join("clip.mp4"), &[]);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(0), "{stderr}");
        assert_eq!(
            stderr.contains("component loads in the request"),
            sequential,
            "{stderr}"
        );
        assert_eq!(
            stderr.contains("load, run and free in turn"),
            sequential,
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
