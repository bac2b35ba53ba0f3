//! `request.video` over the worker protocol: an image engine refuses it as `invalid_request_error` (nothing is
//! run); a video engine's [`EngineOutput::Video`] becomes `video.mp4` (H.264 + AAC, read back with ffprobe); bad
//! video lines are each answered `invalid_request_error` while the worker keeps serving; without ffmpeg the job
//! fails with the install command and the raw frames and audio are kept, nothing half-written.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/media_probe.rs"]
mod media_probe;
#[path = "common/worker_session.rs"]
mod worker_session;

use std::process::{Command, Stdio};

use serde_json::{json, Value};
use tf_engines::worker::testpattern::TestPattern;
use tf_engines::worker::{
    Audio, EngineError, EngineOutput, ImageJob, Progress, RgbaImage, VideoJob, Worker,
    WorkerEngine, WorkerLimits,
};
use worker_session::{assert_budgeted_session_loads_per_request, session};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-worker-video-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn serve(engine: impl WorkerEngine, lines: &[Value]) -> Vec<Value> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    serve_text(engine, &input)
}

fn serve_text(engine: impl WorkerEngine, input: &str) -> Vec<Value> {
    let mut output = Vec::new();
    Worker::new(engine, WorkerLimits::default())
        .serve(input.as_bytes(), &mut output)
        .unwrap();
    String::from_utf8(output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Final replies only (lines with `ok`).
fn finals(replies: &[Value]) -> Vec<&Value> {
    replies.iter().filter(|r| r.get("ok").is_some()).collect()
}

/// The test pattern without its video side: an image-only engine.
struct ImagesOnly(TestPattern);

impl WorkerEngine for ImagesOnly {
    fn load(&mut self) -> Result<u64, EngineError> {
        self.0.load()
    }

    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        self.0.generate(job, progress)
    }

    fn unload(&mut self) {
        self.0.unload()
    }
}

#[test]
fn an_image_engine_refuses_a_video_request() {
    let dir = temp_dir("refused");
    let replies = serve(
        ImagesOnly(TestPattern::default()),
        &[
            json!({"op": "load"}),
            json!({"op": "generate", "dir": dir, "request": {"video": {"prompt": "waves", "seconds": 1}}}),
            json!({"op": "exit"}),
        ],
    );
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert_eq!(replies[1]["ok"], false);
    assert_eq!(replies[1]["type"], "invalid_request_error");
    assert!(
        replies[1]["error"]
            .as_str()
            .unwrap()
            .contains("makes images"),
        "{replies:?}"
    );
    assert!(!dir.exists(), "a refused request created its folder");
}

#[test]
fn the_test_pattern_makes_an_mp4_with_stereo_audio() {
    let dir = temp_dir("testpattern");
    let replies = serve(
        TestPattern::default(),
        &[
            json!({"op": "load"}),
            json!({"op": "generate", "id": "v1", "dir": dir, "request": {"video": {
                "prompt": "waves", "width": 64, "height": 48, "seconds": 1, "fps": 12, "seed": 9, "steps": 2,
                "audio": true}}}),
            json!({"op": "generate", "dir": dir.join("silent"), "request": {"video": {
                "prompt": "waves", "width": 32, "height": 32, "seconds": 0.5, "fps": 10}}}),
            json!({"op": "exit"}),
        ],
    );
    let done = finals(&replies);
    assert_eq!(done.len(), 4, "{replies:?}");
    assert_eq!(done[1]["files"], json!(["video.mp4"]), "{replies:?}");
    assert_eq!(done[1]["seed"], 9);
    let phases: Vec<&str> = replies
        .iter()
        .filter_map(|r| r["progress"]["phase"].as_str())
        .collect();
    assert_eq!(
        phases,
        ["denoise", "denoise", "decode", "denoise", "denoise", "denoise", "denoise", "decode"]
    );
    let p = media_probe::probe(&dir.join("video.mp4"));
    assert!(p.format.contains("mp4"), "{p:?}");
    assert_eq!(
        (p.video_codec.as_str(), p.pix_fmt.as_str()),
        ("h264", "yuv420p")
    );
    assert_eq!((p.width, p.height, p.frames), (64, 48, 12));
    assert_eq!(p.frame_rate, "12/1");
    let audio = p.audio.clone().expect("an audio stream");
    assert_eq!(
        (audio.codec.as_str(), audio.channels, audio.sample_rate),
        ("aac", 2, 32000)
    );
    assert!((audio.duration - 1.0).abs() < 0.05, "{audio:?}");
    assert!((p.duration - 1.0).abs() < 0.05, "{p:?}");

    let silent = media_probe::probe(&dir.join("silent").join("video.mp4"));
    assert_eq!((silent.frames, silent.frame_rate.as_str()), (5, "10/1"));
    assert!(silent.audio.is_none(), "{silent:?}");
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_video_lines_are_refused_and_the_worker_keeps_serving() {
    let dir = temp_dir("bad");
    let d = dir.display().to_string();
    let video = |fields: Value| {
        json!({"op": "generate", "dir": d, "request": {"video": fields}}).to_string()
    };
    let cases: Vec<(String, &str)> = vec![
        (
            "{\"op\":\"generate\",\"request\":{\"video\":".into(),
            "not valid JSON",
        ),
        (video(json!({"prompt": 7})), "`prompt` must be a string"),
        (video(json!({"width": 64})), "`prompt` is missing"),
        (
            video(json!({"prompt": "a", "width": "64"})),
            "`width` must be a whole number",
        ),
        // The size rule is the engine's (the test pattern's grid of 16), the bound the worker's.
        (
            video(json!({"prompt": "a", "width": 70})),
            "`width` must be a multiple of 16 for the test pattern, got 70",
        ),
        (
            video(json!({"prompt": "a", "height": 4096})),
            "`height` must be 1 to 2048 pixels (the worker's bound",
        ),
        (
            video(json!({"prompt": "a", "seconds": 0})),
            "`seconds` must be above 0",
        ),
        (
            video(json!({"prompt": "a", "seconds": 61})),
            "`seconds` must be above 0",
        ),
        (
            video(json!({"prompt": "a", "seconds": "5"})),
            "`seconds` must be a number",
        ),
        (
            video(json!({"prompt": "a", "fps": 0})),
            "`fps` must be 1 to",
        ),
        (
            video(json!({"prompt": "a", "fps": 500})),
            "`fps` must be 1 to",
        ),
        (
            video(json!({"prompt": "a", "fps": 23.5})),
            "`fps` must be a whole number",
        ),
        (
            video(json!({"prompt": "a", "audio": "yes"})),
            "`audio` must be true or false",
        ),
        (
            video(json!({"prompt": "a", "steps": -1})),
            "`steps` must be a whole number",
        ),
        (
            video(json!({"prompt": "a", "width": 64, "height": 64, "first_frame": "f.png"})),
            "`first_frame`",
        ),
        (
            video(json!({"prompt": "a", "first_frame": 3})),
            "`first_frame` must be a string",
        ),
        (
            video(json!({"prompt": "a", "width": 2048, "height": 2048, "seconds": 60, "fps": 120})),
            "`seconds`",
        ),
        (
            json!({"op": "generate", "output": "v.mp4", "request": {"video": {"prompt": "a"}}})
                .to_string(),
            "several files",
        ),
        (
            json!({"op": "generate", "dir": d, "request": {"video": []}}).to_string(),
            "must be an object",
        ),
    ];
    let mut input = String::from("{\"op\":\"load\"}\n");
    for (line, _) in &cases {
        input.push_str(line);
        input.push('\n');
    }
    input.push_str(&video(
        json!({"prompt": "ok", "width": 32, "height": 32, "seconds": 0.25, "fps": 8}),
    ));
    input.push('\n');
    let replies = serve_text(TestPattern::default(), &input);
    let done = finals(&replies);
    assert_eq!(done.len(), cases.len() + 2, "{replies:#?}");
    for ((line, needle), reply) in cases.iter().zip(&done[1..]) {
        assert_eq!(reply["ok"], false, "{line}: {reply}");
        assert_eq!(reply["type"], "invalid_request_error", "{line}: {reply}");
        let message = reply["error"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{line}: expected {needle:?} in {message:?}"
        );
    }
    let last = done.last().unwrap();
    assert_eq!(last["files"], json!(["video.mp4"]), "{replies:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Makes `frames()` flat frames and, when asked, stereo silence; frames may be made the wrong size.
struct FakeVideo {
    odd_frame: bool,
}

impl WorkerEngine for FakeVideo {
    fn load(&mut self) -> Result<u64, EngineError> {
        Ok(1)
    }

    fn generate(
        &mut self,
        _job: &ImageJob,
        _progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        Err(EngineError::InvalidRequest(
            "this engine makes videos".into(),
        ))
    }

    fn unload(&mut self) {}

    fn makes_video(&self) -> bool {
        true
    }

    fn generate_video(
        &mut self,
        job: &VideoJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<EngineOutput, EngineError> {
        let n = job.frames();
        let mut frames = Vec::new();
        for i in 0..n {
            progress(Progress {
                phase: "denoise",
                step: i + 1,
                of: n,
            });
            let w = if self.odd_frame && i == 1 {
                job.width / 2
            } else {
                job.width
            };
            let pixels = vec![i as u8; (w * job.height * 4) as usize];
            frames.push(RgbaImage::new(w, job.height, pixels)?);
        }
        let audio = job.audio.then(|| Audio {
            sample_rate: 8000,
            channels: 2,
            samples: vec![0.0; 16000],
        });
        Ok(EngineOutput::Video {
            frames,
            fps: job.fps,
            audio,
        })
    }
}

#[test]
fn a_video_engine_output_is_muxed_and_checked() {
    let dir = temp_dir("fake");
    let line = |sub: &str| {
        json!({"op": "generate", "dir": dir.join(sub), "request": {"video": {
            "prompt": "waves", "width": 32, "height": 16, "seconds": 0.5, "fps": 6, "audio": true}}})
    };
    let replies = serve(
        FakeVideo { odd_frame: false },
        &[json!({"op": "load"}), line("a"), json!({"op": "exit"})],
    );
    let done = finals(&replies);
    assert_eq!(done[1]["files"], json!(["video.mp4"]), "{replies:?}");
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.get("progress").is_some())
            .count(),
        3
    );
    let p = media_probe::probe(&dir.join("a").join("video.mp4"));
    assert_eq!((p.frames, p.width, p.height), (3, 32, 16));
    // 8 kHz stereo, cut to the video's half second.
    let audio = p.audio.unwrap();
    assert_eq!((audio.channels, audio.sample_rate), (2, 8000));
    assert!((audio.duration - 0.5).abs() < 0.06, "{audio:?}");

    let replies = serve(
        FakeVideo { odd_frame: true },
        &[json!({"op": "load"}), line("b"), json!({"op": "exit"})],
    );
    let done = finals(&replies);
    assert_eq!(done[1]["type"], "server_error", "{replies:?}");
    assert!(
        done[1]["error"].as_str().unwrap().contains("frame 1"),
        "{replies:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tf worker --engine testpattern` with `TF_FFMPEG` naming nothing: the job fails with the install command, the
/// raw frames and audio are written, no MP4 or partial file is left, and the worker serves on.
#[test]
fn without_ffmpeg_the_raw_output_is_kept() {
    let dir = temp_dir("no-ffmpeg");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_tf"));
    worker
        .args(["worker", "--engine", "testpattern"])
        .env("TF_FFMPEG", dir.join("missing-ffmpeg"));
    let out = session(
        worker,
        &[
            json!({"op": "load"}),
            json!({"op": "generate", "dir": dir, "request": {"video": {
                "prompt": "x", "width": 32, "height": 32, "seconds": 0.25, "fps": 8, "audio": true}}}),
            json!({"op": "generate", "prompt": "still", "width": 32, "height": 32, "steps": 1, "out_dir": dir}),
            json!({"op": "exit"}),
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("apt-get install"),
        "the load warns: {stderr}"
    );
    let replies: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let done = finals(&replies);
    assert_eq!(done.len(), 4, "{replies:?}");
    assert_eq!(done[1]["type"], "server_error");
    let message = done[1]["error"].as_str().unwrap();
    assert!(
        message.contains("TF_FFMPEG") && message.contains("apt-get install"),
        "{message}"
    );
    assert!(message.contains("frame_00000.png"), "{message}");
    assert_eq!(
        done[2]["files"],
        json!(["image_0.png"]),
        "the worker serves on"
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "audio.wav",
            "frame_00000.png",
            "frame_00001.png",
            "image_0.png"
        ]
    );
    let wav = tf_engines::nn::media::wav::read_wav(&dir.join("audio.wav")).unwrap();
    assert_eq!(
        (wav.sample_rate, wav.channels, wav.frames()),
        (32000, 2, 8000)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn h3_model() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/minimax_h3_pipeline/model")
}

/// `tf worker --engine minimax_h3` on the tiny folder (host reference): a good request makes an MP4 of 24 fps with
/// a stereo track; requests the model cannot serve are each refused as `invalid_request_error` naming the field,
/// before anything runs, and the worker keeps serving; `exit` reports no device memory held.
#[test]
fn the_h3_worker_serves_good_and_refuses_bad_video_requests() {
    use tf_engines::worker::minimax_h3::MiniMaxH3Engine;
    use tf_engines::worker::qwen::BackendChoice;
    let dir = temp_dir("h3");
    let d = dir.display().to_string();
    let video = |fields: Value| json!({"op": "generate", "dir": d, "request": {"video": fields}});
    let good = json!({"prompt": "waves break on the rocks", "width": 16, "height": 32, "seconds": 0.9,
        "steps": 3, "seed": 11, "audio": true});
    let with = |key: &str, value: Value| {
        let mut v = good.clone();
        v[key] = value;
        video(v)
    };
    let bad: Vec<(Value, &str)> = vec![
        (with("fps", json!(30)), "`fps` 30"),
        (with("seconds", json!(20)), "`seconds`"),
        (with("seconds", json!(0.1)), "`seconds`"),
        (
            {
                let mut v = good.clone();
                v["width"] = json!(2048);
                v["height"] = json!(2048);
                video(v)
            },
            "`width` x `height`",
        ),
        (with("first_frame", json!("start.png")), "`first_frame`"),
        (
            with("negative_prompt", json!("blurry")),
            "`negative_prompt`",
        ),
        (with("guidance", json!(4.5)), "`guidance`"),
        (with("steps", json!(1)), "`steps` 1"),
        // Off the folder's canvas multiple: refused by the engine's own rule, which the message names.
        (with("height", json!(20)), "`height` 20: give a multiple of"),
        (with("prompt", json!("<|video_pad|>")), "`prompt`"),
        (
            json!({"op": "generate", "dir": d, "request": {"image": {"prompt": "a still"}}}),
            "makes videos",
        ),
    ];
    let mut lines = vec![json!({"op": "load"}), video(good.clone())];
    lines.extend(bad.iter().map(|(l, _)| l.clone()));
    // The README's fixture size, 16x24: the worker leaves the size rule to the engine, whose canvas multiple
    // (the tiny folder's) takes it, as `tf video --size 16x24` does.
    let mut silent = good.clone();
    silent["audio"] = json!(false);
    silent["height"] = json!(24);
    lines.push(json!({"op": "generate", "dir": dir.join("silent"), "request": {"video": silent}}));
    lines.push(json!({"op": "exit"}));
    let replies = serve(
        MiniMaxH3Engine::new(h3_model(), BackendChoice::Host),
        &lines,
    );
    let done = finals(&replies);
    assert_eq!(done.len(), lines.len(), "{replies:#?}");
    assert!(done[0]["resident"].as_u64().unwrap() > 0);
    assert_eq!(done[1]["files"], json!(["video.mp4"]), "{replies:#?}");
    assert_eq!(done[1]["seed"], 11);
    for ((line, needle), reply) in bad.iter().zip(&done[2..]) {
        assert_eq!(reply["type"], "invalid_request_error", "{line}: {reply}");
        let message = reply["error"].as_str().unwrap();
        assert!(
            message.contains(needle),
            "{line}: expected {needle:?} in {message:?}"
        );
    }
    let n = done.len();
    assert_eq!(
        done[n - 2]["files"],
        json!(["video.mp4"]),
        "the worker served on: {replies:#?}"
    );
    assert_eq!(done[n - 1]["device_bytes"], 0);
    // Progress of the first job: encode, 2 steps (3 grid points), decode video then audio.
    let loaded = replies
        .iter()
        .position(|r| r.get("resident").is_some())
        .unwrap();
    let first: Vec<(String, u64, u64)> = replies[loaded + 1..]
        .iter()
        .take_while(|r| r.get("ok").is_none())
        .map(|r| {
            let p = &r["progress"];
            (
                p["phase"].as_str().unwrap().to_string(),
                p["step"].as_u64().unwrap(),
                p["of"].as_u64().unwrap(),
            )
        })
        .collect();
    let expect: Vec<(String, u64, u64)> = [
        ("encode", 1, 1),
        ("denoise", 1, 2),
        ("denoise", 2, 2),
        ("decode", 1, 2),
        ("decode", 2, 2),
    ]
    .iter()
    .map(|(p, s, o)| (p.to_string(), *s, *o))
    .collect();
    assert_eq!(first, expect);

    let p = media_probe::probe(&dir.join("video.mp4"));
    assert_eq!(
        (p.video_codec.as_str(), p.pix_fmt.as_str()),
        ("h264", "yuv420p")
    );
    // 0.9 s at 24 fps = 22 frames (17 n + 5).
    assert_eq!(
        (p.width, p.height, p.frames, p.frame_rate.as_str()),
        (16, 32, 22, "24/1")
    );
    let a = p.audio.clone().expect("a stereo track");
    assert_eq!(
        (a.codec.as_str(), a.channels, a.sample_rate),
        ("aac", 2, 8000)
    );
    assert!((p.duration - 22.0 / 24.0).abs() < 0.06, "{p:?}");
    let silent = media_probe::probe(&dir.join("silent").join("video.mp4"));
    assert!(silent.audio.is_none(), "{silent:?}");
    assert_eq!((silent.width, silent.height, silent.frames), (16, 24, 22));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tf_worker_minimax_h3_needs_a_model_folder() {
    for args in [
        vec!["worker", "--engine", "minimax_h3"],
        vec![
            "worker",
            "--engine",
            "minimax_h3",
            "--model",
            "/nonexistent/h3",
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tf"))
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("MiniMax H3"),
            "{args:?}"
        );
    }
}

#[test]
fn tf_worker_random_weights_are_for_minimax_h3_on_the_gpu_only() {
    // Another engine: refused at start, naming the reason.
    let out = Command::new(env!("CARGO_BIN_EXE_tf"))
        .args(["worker", "--engine", "testpattern", "--random-weights", "0"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--random-weights"));

    // MiniMax H3 on the host: the load is answered with the reason and the worker keeps serving until exit.
    let mut worker = Command::new(env!("CARGO_BIN_EXE_tf"));
    worker
        .args(["worker", "--engine", "minimax_h3", "--backend", "host"])
        .arg("--model")
        .arg(h3_model())
        .args(["--random-weights", "0"]);
    let out = session(worker, &[json!({"op": "load"}), json!({"op": "exit"})]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let replies: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let load = &replies[0];
    assert_eq!(load["ok"], false, "{replies:?}");
    // The worker's configuration, not a client's request: a server error.
    assert_eq!(load["type"], "server_error", "{replies:?}");
    assert!(
        load["error"].to_string().contains("GPU"),
        "{replies:?} / {stderr}"
    );
    assert!(stderr.contains("RANDOM"), "{stderr}");
}

/// `tf worker --engine minimax_h3 --device-budget` below the components' sum: the request loads, runs and frees
/// the four in turn, and the worker's log says how long the loads took.
#[test]
fn an_h3_worker_with_a_device_budget_loads_its_components_per_request_and_says_so() {
    use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions};
    let largest = H3Pipeline::load(&h3_model(), &LoadOptions::new(Backend::Host))
        .unwrap()
        .memory_plan()
        .largest();
    let dir = temp_dir("h3-budget");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_tf"));
    worker
        .args(["worker", "--engine", "minimax_h3", "--backend", "host"])
        .args(["--device-budget", &format!("{largest}B"), "--model"])
        .arg(h3_model());
    let request = json!({"op": "generate", "dir": dir.display().to_string(), "request": {"video": {
        "prompt": "waves", "width": 16, "height": 32, "seconds": 0.5, "steps": 2, "seed": 1, "audio": true}}});
    assert_budgeted_session_loads_per_request(worker, request);
    let _ = std::fs::remove_dir_all(&dir);
}
