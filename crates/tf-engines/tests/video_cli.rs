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
    let out = dir.join("clip.mp4");
    let res = run(
        &[
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
        ],
        &out,
        &[("TF_FFMPEG", &dir.join("nowhere").join("ffmpeg"))],
    );
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
