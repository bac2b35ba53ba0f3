//! The MiniMax H3 pipeline on the GPU backend, on the tiny folder (tests/fixtures/minimax_h3_pipeline/model):
//!
//! - `gpu_h3_pipeline_matches_the_reference_and_runs_sequentially`: the resident pipeline on the `short` case with
//!   its injected noise against the diffusers fp32 result (bf16 weights on the device, so the bounds are the
//!   structural ones: a wrong row order or channel gives errors of order 1; the measured figures are printed);
//!   the sequential residency (a budget of the largest component) gives the same frames and audio as the resident
//!   one, twice, and the device memory of a sequential request comes back when it returns.
//! - `gpu_h3_worker_session_returns_all_device_memory`: `tf worker --engine minimax_h3 --backend gpu` driven by the
//!   protocol client: load, two generates, one invalid request, exit; the replies, the files, no device bytes held
//!   after unload, and the device's free memory back to its level from before the worker started.
//!
//! - `gpu_h3_pipeline_with_random_weights_reads_no_dit_or_text_weights`: the tiny folder with the DiT's and the
//!   text encoder's weight files deleted loads with `random_weights` (and only with it), generates finite frames
//!   and audio, and the same seed gives the same output resident and sequential.
//!
//! Runs only on a GPU machine (through `cargo xtask gpu-bundle`); ignored elsewhere.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tf_engines::minimax_h3::noise::H3Noise;
use tf_engines::minimax_h3::pipeline::{Backend, H3Pipeline, LoadOptions, Request};
use tf_engines::nn::memory_plan::Residency;
use tf_engines::nn::tensor::relative_l2;
use tf_engines::nn::weights::SafetensorsFile;
use tf_engines::worker::client::WorkerProcess;

const MIB: f64 = (1u64 << 20) as f64;
/// Free memory after a request or a worker may differ from before by at most this (driver caches, other tenants).
const FREE_MEMORY_TOLERANCE: u64 = 64 << 20;
const DEADLINE: Duration = Duration::from_secs(300);
/// Structural bounds against the fp32 reference: bf16 weights and activations through 4 steps and two decoders
/// stay well inside these; a misplaced row, channel or frame does not.
const ROWS_BOUND: f64 = 0.1;
const FRAMES_BOUND: f64 = 0.1;
const AUDIO_BOUND: f64 = 0.25;

fn fixtures() -> PathBuf {
    let relative = "tests/fixtures/minimax_h3_pipeline";
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
        .find(|p| p.join("model/modular_model_index.json").is_file())
        .cloned()
        .unwrap_or_else(|| panic!("the tiny H3 folder is not in any of {candidates:?}"))
}

/// The bundled `tf` when running from a GPU bundle, else the one cargo built.
fn tf_binary() -> PathBuf {
    if let Some(bundle) = std::env::var_os("TF_BUNDLE_DIR") {
        let tf = PathBuf::from(bundle).join("bin/tf");
        if tf.is_file() {
            return tf;
        }
    }
    PathBuf::from(env!("CARGO_BIN_EXE_tf"))
}

fn short_request() -> Request {
    let e = SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap();
    Request {
        width: 16,
        height: 24,
        seconds: 22.0 / 24.0,
        steps: Some(5),
        seed: 7,
        noise: Some(H3Noise {
            video: e.to_f32("short.video_noise").unwrap(),
            audio: e.to_f32("short.audio_noise").unwrap(),
        }),
        ..Request::new("waves break on the rocks below the lighthouse")
    }
}

fn free_bytes(pipeline: &H3Pipeline) -> u64 {
    pipeline
        .context()
        .expect("a GPU pipeline has a context")
        .memory_info()
        .expect("cuMemGetInfo")
        .free
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_h3_pipeline_matches_the_reference_and_runs_sequentially() {
    let model = fixtures().join("model");
    let e = SafetensorsFile::open(&fixtures().join("expected.safetensors")).unwrap();
    let mut resident = H3Pipeline::load(&model, &LoadOptions::new(Backend::Gpu)).unwrap();
    let report = resident.load_report().clone();
    println!("load: {report:?}\n{}", resident.memory_plan());
    assert_eq!(report.residency, Residency::AllResident);
    assert!(report.resident_bytes > 0, "a GPU load holds device memory");
    resident.keep_step_latents(true);
    let made = resident
        .generate(&short_request(), &mut |p| println!("{p:?}"))
        .unwrap();
    println!("timings: {:?}", made.timings);
    assert_eq!(
        (made.frames.frames, made.frames.height, made.frames.width),
        (22, 24, 16)
    );
    for (i, rows) in made.step_latents.iter().enumerate() {
        let v = relative_l2(
            rows.video.data(),
            e.to_f32(&format!("short.latents.{i}")).unwrap().data(),
        )
        .unwrap();
        let a = relative_l2(
            rows.audio.data(),
            e.to_f32(&format!("short.audio_latents.{i}"))
                .unwrap()
                .data(),
        )
        .unwrap();
        println!("step {i}: video rows relative L2 {v:.3e}, audio rows {a:.3e}");
        assert!(
            v <= ROWS_BOUND && a <= ROWS_BOUND,
            "step {i}: {v:.3e} / {a:.3e}"
        );
    }
    let frames = relative_l2(
        &made.frames.pixels,
        e.to_f32("short.frames").unwrap().data(),
    )
    .unwrap();
    let stereo = made.audio.clone().unwrap();
    let samples: Vec<f32> = stereo.left.iter().chain(&stereo.right).copied().collect();
    let audio = relative_l2(&samples, e.to_f32("short.audio").unwrap().data()).unwrap();
    println!("frames relative L2 {frames:.3e}, audio {audio:.3e}");
    assert!(frames <= FRAMES_BOUND, "frames {frames:.3e}");
    assert!(audio <= AUDIO_BOUND, "audio {audio:.3e}");

    let largest = resident.memory_plan().largest();
    let mut options = LoadOptions::new(Backend::Gpu);
    options.device_budget = Some(largest);
    drop(resident);
    let mut sequential = H3Pipeline::load(&model, &options).unwrap();
    assert_eq!(sequential.load_report().residency, Residency::Sequential);
    for run in 0..2 {
        let free_before = free_bytes(&sequential);
        let again = sequential.generate(&short_request(), &mut |_| {}).unwrap();
        let free_after = free_bytes(&sequential);
        println!(
            "sequential run {run}: loads {:?}; free {:.1} MiB before, {:.1} MiB after",
            again.timings.loads,
            free_before as f64 / MIB,
            free_after as f64 / MIB
        );
        assert_eq!(
            again.frames, made.frames,
            "run {run}: frames differ from the resident run"
        );
        assert_eq!(
            again.audio, made.audio,
            "run {run}: audio differs from the resident run"
        );
        assert!(
            free_before.abs_diff(free_after) <= FREE_MEMORY_TOLERANCE,
            "run {run}: a sequential request kept device memory"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_h3_worker_session_returns_all_device_memory() {
    let driver = tf_cuda::open_driver().expect("open the CUDA driver");
    let ctx = tf_cuda::Context::new(Arc::clone(&driver), 0).expect("context on device 0");
    let free_before = ctx.memory_info().expect("cuMemGetInfo").free;
    let model = fixtures().join("model").to_string_lossy().into_owned();
    let out = std::env::temp_dir().join(format!("tf-gpu-h3-worker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let ffmpeg = tf_engines::nn::media::mp4::find_ffmpeg();
    println!("ffmpeg: {ffmpeg:?}");
    let tf = tf_binary();
    let mut worker = WorkerProcess::spawn(
        &tf.to_string_lossy(),
        &[
            "worker",
            "--engine",
            "minimax_h3",
            "--model",
            &model,
            "--backend",
            "gpu",
        ],
    )
    .expect("start tf worker");
    let loaded = worker
        .call(r#"{"op":"load"}"#, DEADLINE)
        .expect("load reply");
    println!("load: {}", loaded.reply);
    assert_eq!(loaded.reply["ok"], true, "{}", loaded.reply);
    assert!(loaded.reply["resident"].as_u64().unwrap() > 0);

    let jobs = [
        (
            "first",
            json!({"prompt": "a red fox runs through fresh snow", "width": 16, "height": 32,
            "seconds": 0.9, "steps": 4, "seed": 3, "audio": true}),
        ),
        (
            "second",
            json!({"prompt": "waves at dusk", "width": 32, "height": 16, "seconds": 1.6,
            "steps": 3, "seed": 4, "audio": false}),
        ),
    ];
    for (name, video) in &jobs {
        let dir = out.join(name);
        let started = Instant::now();
        let done = worker
            .call(
                &json!({"op": "generate", "dir": dir, "request": {"video": video}}).to_string(),
                DEADLINE,
            )
            .expect("generate reply");
        println!(
            "{name}: {} after {} progress lines, {:.2} s",
            done.reply,
            done.progress.len(),
            started.elapsed().as_secs_f64()
        );
        let steps = video["steps"].as_u64().unwrap() - 1;
        let denoise = done
            .progress
            .iter()
            .filter(|p| p["phase"] == "denoise")
            .count() as u64;
        assert_eq!(denoise, steps, "{:?}", done.progress);
        match &ffmpeg {
            Ok(_) => {
                assert_eq!(done.reply["ok"], true, "{}", done.reply);
                assert_eq!(done.reply["files"], json!(["video.mp4"]));
                assert!(dir.join("video.mp4").is_file());
            }
            Err(_) => {
                // No ffmpeg on this machine: the job fails with the install command and keeps the raw output.
                assert_eq!(done.reply["type"], "server_error", "{}", done.reply);
                assert!(done.reply["error"]
                    .as_str()
                    .unwrap()
                    .contains("install ffmpeg"));
                assert!(dir.join("frame_00000.png").is_file());
            }
        }
    }
    let invalid = worker
        .call(
            &json!({"op": "generate", "dir": out.join("invalid"), "request": {"video": {
                "prompt": "x", "width": 16, "height": 32, "seconds": 0.9, "fps": 30}}})
            .to_string(),
            DEADLINE,
        )
        .expect("invalid reply");
    println!("invalid: {}", invalid.reply);
    assert_eq!(
        invalid.reply["type"], "invalid_request_error",
        "{}",
        invalid.reply
    );
    assert!(
        invalid.progress.is_empty(),
        "the invalid request ran: {:?}",
        invalid.progress
    );

    let (exit_reply, status) = worker.exit_with_reply(DEADLINE).expect("exit");
    println!("exit: {exit_reply}, status {status:?}");
    assert_eq!(
        exit_reply["device_bytes"], 0,
        "device buffers still held after unload"
    );
    assert_eq!(
        exit_reply["device_allocs"], 0,
        "device allocations still live after unload"
    );
    assert_eq!(status.code(), Some(0));

    let mut free_after = ctx.memory_info().expect("cuMemGetInfo").free;
    let waited = Instant::now();
    while free_before.saturating_sub(free_after) > FREE_MEMORY_TOLERANCE
        && waited.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(100));
        free_after = ctx.memory_info().expect("cuMemGetInfo").free;
    }
    let missing = free_before.saturating_sub(free_after);
    println!(
        "device free: {:.1} MiB before the worker, {:.1} MiB after it exited ({:.1} MiB missing)",
        free_before as f64 / MIB,
        free_after as f64 / MIB,
        missing as f64 / MIB
    );
    assert!(
        missing <= FREE_MEMORY_TOLERANCE,
        "{missing} bytes did not come back"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Copies the folder tree `from` into `to`, leaving out the `*.safetensors` files of the sub-folders in `strip`.
fn copy_without_weights(from: &Path, to: &Path, strip: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if src.is_dir() {
            let name = entry.file_name().to_string_lossy().into_owned();
            copy_dir(&src, &dst, strip.contains(&name.as_str()));
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

fn copy_dir(from: &Path, to: &Path, drop_weights: bool) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let src = entry.unwrap().path();
        let dst = to.join(src.file_name().unwrap());
        if src.is_dir() {
            copy_dir(&src, &dst, drop_weights);
        } else if !(drop_weights && src.to_string_lossy().contains(".safetensors")) {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_h3_pipeline_with_random_weights_reads_no_dit_or_text_weights() {
    let dir = std::env::temp_dir().join(format!("tf-h3-random-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_without_weights(
        &fixtures().join("model"),
        &dir,
        &["transformer", "text_encoder"],
    );
    let Err(refused) = H3Pipeline::load(&dir, &LoadOptions::new(Backend::Gpu)) else {
        panic!("a folder without DiT weights loads only with random weights");
    };
    println!("without random weights: {refused}");
    let options = LoadOptions {
        random_weights: Some(3),
        ..LoadOptions::new(Backend::Gpu)
    };
    let mut resident = H3Pipeline::load(&dir, &options).unwrap();
    println!(
        "load: {:?}\n{}",
        resident.load_report(),
        resident.memory_plan()
    );
    let made = resident.generate(&short_request(), &mut |_| {}).unwrap();
    assert_eq!(
        (made.frames.frames, made.frames.height, made.frames.width),
        (22, 24, 16)
    );
    assert!(made.frames.pixels.iter().all(|v| v.is_finite()));
    let audio = made.audio.clone().unwrap();
    assert!(audio.left.iter().chain(&audio.right).all(|v| v.is_finite()));
    assert!(
        made.prompt_embeds.data().iter().any(|v| *v != 0.0),
        "random text features are not all zero"
    );
    let largest = resident.memory_plan().largest();
    drop(resident);
    let sequential_options = LoadOptions {
        device_budget: Some(largest),
        ..options.clone()
    };
    let mut sequential = H3Pipeline::load(&dir, &sequential_options).unwrap();
    assert_eq!(sequential.load_report().residency, Residency::Sequential);
    let again = sequential.generate(&short_request(), &mut |_| {}).unwrap();
    assert_eq!(
        again.frames, made.frames,
        "the same seed makes the same weights"
    );
    assert_eq!(again.audio, made.audio);
    drop(sequential);
    let _ = std::fs::remove_dir_all(&dir);
}
