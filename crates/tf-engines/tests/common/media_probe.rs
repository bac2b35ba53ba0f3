//! Reads an MP4 back with `ffprobe` (beside the `ffmpeg` that `tf_engines::nn::media::mp4::find_ffmpeg` finds, or
//! on PATH) for the video tests. A missing `ffprobe` fails the test loudly with the install command: CI installs
//! ffmpeg (`.ci/run`), and so does the README's set-up.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// What `ffprobe` says about a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    pub format: String,
    pub duration: f64,
    pub video_codec: String,
    pub pix_fmt: String,
    pub width: u64,
    pub height: u64,
    /// `r_frame_rate` as a fraction, e.g. `24/1`.
    pub frame_rate: String,
    /// Frames counted by decoding the stream.
    pub frames: u64,
    pub audio: Option<AudioProbe>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AudioProbe {
    pub codec: String,
    pub channels: u64,
    pub sample_rate: u64,
    pub duration: f64,
}

/// The `ffprobe` to run: next to the `ffmpeg` the library would use, else on PATH; panics with the install
/// command when there is none.
pub fn ffprobe() -> PathBuf {
    let ffmpeg = tf_engines::nn::media::mp4::find_ffmpeg().unwrap_or_else(|e| {
        panic!(
            "the video tests need ffmpeg and ffprobe ({e}); .ci/run installs them, see the README"
        )
    });
    let beside = ffmpeg.with_file_name("ffprobe");
    if beside.is_file() {
        return beside;
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("ffprobe"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no ffprobe beside {} or on PATH; install ffmpeg (`sudo apt-get install -y ffmpeg`), which ships it",
                ffmpeg.display()
            )
        })
}

fn text(v: &serde_json::Value, key: &str) -> String {
    v[key].as_str().unwrap_or_default().to_string()
}

fn number(v: &serde_json::Value, key: &str) -> f64 {
    match &v[key] {
        serde_json::Value::String(s) => s.parse().unwrap_or(f64::NAN),
        serde_json::Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
        _ => f64::NAN,
    }
}

/// Probes `file`: container, streams, codecs, frame count (decoded), rate, durations, audio layout.
pub fn probe(file: &Path) -> Probe {
    let out = Command::new(ffprobe())
        .args([
            "-v",
            "error",
            "-count_frames",
            "-show_entries",
            "format=format_name,duration:stream=codec_type,codec_name,pix_fmt,width,height,r_frame_rate,\
             nb_read_frames,channels,sample_rate,duration",
            "-of",
            "json",
        ])
        .arg(file)
        .output()
        .expect("running ffprobe");
    assert!(
        out.status.success(),
        "ffprobe {} failed: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ffprobe JSON");
    let streams = json["streams"].as_array().expect("streams").clone();
    let video: Vec<_> = streams
        .iter()
        .filter(|s| s["codec_type"] == "video")
        .collect();
    let audio: Vec<_> = streams
        .iter()
        .filter(|s| s["codec_type"] == "audio")
        .collect();
    assert_eq!(video.len(), 1, "one video stream expected: {json}");
    assert!(
        audio.len() <= 1,
        "at most one audio stream expected: {json}"
    );
    let v = video[0];
    Probe {
        format: text(&json["format"], "format_name"),
        duration: number(&json["format"], "duration"),
        video_codec: text(v, "codec_name"),
        pix_fmt: text(v, "pix_fmt"),
        width: v["width"].as_u64().unwrap_or(0),
        height: v["height"].as_u64().unwrap_or(0),
        frame_rate: text(v, "r_frame_rate"),
        frames: number(v, "nb_read_frames") as u64,
        audio: audio.first().map(|a| AudioProbe {
            codec: text(a, "codec_name"),
            channels: a["channels"].as_u64().unwrap_or(0),
            sample_rate: number(a, "sample_rate") as u64,
            duration: number(a, "duration"),
        }),
    }
}
