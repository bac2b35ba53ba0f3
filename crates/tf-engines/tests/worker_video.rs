//! `request.video` over the worker protocol: an image engine refuses it as `invalid_request_error` (nothing is
//! run), and a video engine's [`EngineOutput::Video`] is written as frames plus an audio track.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};
use tf_engines::worker::testpattern::TestPattern;
use tf_engines::worker::{
    Audio, EngineError, EngineOutput, ImageJob, Progress, RgbaImage, VideoJob, Worker,
    WorkerEngine, WorkerLimits,
};

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-worker-video-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn serve(engine: impl WorkerEngine, lines: &[Value]) -> Vec<Value> {
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
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

#[test]
fn an_image_engine_refuses_a_video_request() {
    let dir = temp_dir("refused");
    let replies = serve(
        TestPattern::default(),
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

/// Makes `frames()` flat frames and, when asked, a second of stereo silence.
struct FakeVideo;

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
            let pixels = vec![i as u8; (job.width * job.height * 4) as usize];
            frames.push(RgbaImage::new(job.width, job.height, pixels)?);
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
fn a_video_engine_writes_frames_and_audio() {
    let dir = temp_dir("written");
    let replies = serve(
        FakeVideo,
        &[
            json!({"op": "load"}),
            json!({"op": "generate", "dir": dir, "request": {"video": {
                "prompt": "waves", "width": 32, "height": 16, "seconds": 0.5, "fps": 6, "audio": true}}}),
            json!({"op": "exit"}),
        ],
    );
    let done = replies
        .iter()
        .find(|r| r.get("files").is_some())
        .unwrap_or_else(|| panic!("{replies:?}"));
    assert_eq!(
        done["files"],
        json!([
            "frame_00000.png",
            "frame_00001.png",
            "frame_00002.png",
            "audio.wav"
        ])
    );
    let progress = replies
        .iter()
        .filter(|r| r.get("progress").is_some())
        .count();
    assert_eq!(progress, 3);
    let wav = std::fs::read(dir.join("audio.wav")).unwrap();
    assert_eq!(&wav[..4], b"RIFF");
    assert_eq!(wav.len(), 44 + 16000 * 4);
    assert!(dir.join("frame_00002.png").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
