//! `tf worker --engine qwen_image --backend gpu` on the tiny pipeline folder (tests/fixtures/qwen_pipeline/model),
//! driven by the protocol client: load, three generates (one invalid), exit. Checks the replies, the PNG
//! files, that the worker's own count of device bytes is zero after unload, and that the device's free memory
//! (seen by the driver from this process) returns to its level from before the worker started.
//!
//! Runs only on a GPU machine (through `cargo xtask gpu-bundle`); ignored elsewhere.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tf_engines::worker::client::WorkerProcess;

const MIB: f64 = (1u64 << 20) as f64;
/// Free memory after the worker exits may differ from before by at most this (other tenants, driver caches).
const FREE_MEMORY_TOLERANCE: u64 = 64 << 20;
const DEADLINE: Duration = Duration::from_secs(300);

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

fn free_bytes(ctx: &tf_cuda::Context) -> u64 {
    ctx.memory_info().expect("cuMemGetInfo").free
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_worker_serves_the_tiny_pipeline_and_returns_all_device_memory() {
    let driver = tf_cuda::open_driver().expect("open the CUDA driver");
    let ctx = tf_cuda::Context::new(Arc::clone(&driver), 0).expect("context on device 0");
    let free_before = free_bytes(&ctx);
    println!(
        "device free before the worker: {:.1} MiB",
        free_before as f64 / MIB
    );

    let tf = tf_binary();
    let model = tiny_qwen_folder();
    let out = std::env::temp_dir().join(format!("tf-gpu-worker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    println!(
        "tf: {}\nmodel: {}\noutput: {}",
        tf.display(),
        model.display(),
        out.display()
    );
    let model_arg = model.to_string_lossy().into_owned();
    let mut worker = WorkerProcess::spawn(
        &tf.to_string_lossy(),
        &[
            "worker",
            "--engine",
            "qwen_image",
            "--model",
            &model_arg,
            "--backend",
            "gpu",
        ],
    )
    .expect("start tf worker");

    let started = Instant::now();
    let loaded = worker
        .call(r#"{"op":"load"}"#, DEADLINE)
        .expect("load reply");
    println!(
        "load: {} ({:.2} s wall)",
        loaded.reply,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(loaded.reply["ok"], true, "load failed: {}", loaded.reply);
    let resident = loaded.reply["resident"]
        .as_u64()
        .expect("resident is a number");
    assert!(
        resident > 0,
        "a GPU load must report resident bytes: {}",
        loaded.reply
    );
    let free_loaded = free_bytes(&ctx);
    let taken = free_before.saturating_sub(free_loaded);
    println!(
        "device free while loaded: {:.1} MiB (the worker process takes {:.1} MiB; it reports {:.1} MiB resident)",
        free_loaded as f64 / MIB,
        taken as f64 / MIB,
        resident as f64 / MIB
    );
    assert!(
        taken > 0,
        "the loaded worker holds no device memory: is it on the GPU?"
    );

    let square = out.join("square");
    let first = worker
        .call(
            &json!({"op": "generate", "dir": square, "request": {"image": {"prompt": "a red fox in the snow", "width": 64, "height": 64, "steps": 3, "seed": 11}}}).to_string(),
            DEADLINE,
        )
        .expect("first generate reply");
    println!(
        "generate 64x64: {} after {} progress lines",
        first.reply,
        first.progress.len()
    );
    assert_eq!(first.reply["ok"], true, "{}", first.reply);
    assert_eq!(first.reply["files"], json!(["image_0.png"]));
    let denoise = first
        .progress
        .iter()
        .filter(|p| p["phase"] == "denoise")
        .count();
    assert_eq!(denoise, 3, "{:?}", first.progress);

    let invalid = worker
        .call(
            &json!({"op": "generate", "dir": out.join("invalid"), "request": {"image": {"prompt": "x", "width": 48, "height": 64}}}).to_string(),
            DEADLINE,
        )
        .expect("invalid generate reply");
    println!("generate 48x64 (invalid): {}", invalid.reply);
    assert_eq!(invalid.reply["ok"], false, "{}", invalid.reply);
    assert_eq!(
        invalid.reply["type"], "invalid_request_error",
        "{}",
        invalid.reply
    );

    let wide = out.join("wide.png");
    let third = worker
        .call(
            &json!({"op": "generate", "prompt": "a cat", "width": 96, "height": 64, "steps": 2, "seed": 2, "output": wide}).to_string(),
            DEADLINE,
        )
        .expect("third generate reply");
    println!("generate 96x64: {}", third.reply);
    assert_eq!(third.reply["ok"], true, "{}", third.reply);

    let (exit_reply, status) = worker.exit_with_reply(DEADLINE).expect("exit");
    println!("exit: {exit_reply}, status {status:?}");
    assert_eq!(exit_reply["ok"], true);
    assert_eq!(
        exit_reply["device_bytes"], 0,
        "device buffers still held after unload"
    );
    assert_eq!(
        exit_reply["device_allocs"], 0,
        "device allocations still live after unload"
    );
    assert_eq!(status.code(), Some(0), "the worker must exit 0 after exit");

    let (w, h, pixels) =
        decode_rgba(&std::fs::read(square.join("image_0.png")).expect("square PNG"))
            .expect("decode");
    assert_eq!((w, h), (64, 64));
    let mean = pixels.iter().map(|&b| f64::from(b)).sum::<f64>() / pixels.len() as f64;
    println!("square image: mean byte {mean:.1}");
    let (w, h, _) = decode_rgba(&std::fs::read(&wide).expect("wide PNG")).expect("decode");
    assert_eq!((w, h), (96, 64));
    assert!(
        !out.join("invalid/image_0.png").exists(),
        "the invalid request wrote a file"
    );

    // The driver frees a dead process's memory right after it exits; allow it a few seconds.
    let mut free_after = free_bytes(&ctx);
    let waited = Instant::now();
    while free_before.saturating_sub(free_after) > FREE_MEMORY_TOLERANCE
        && waited.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(100));
        free_after = free_bytes(&ctx);
    }
    let missing = free_before.saturating_sub(free_after);
    println!(
        "device free after the worker exited: {:.1} MiB ({:.1} MiB below before, tolerance {:.0} MiB, waited {:.1} s)",
        free_after as f64 / MIB,
        missing as f64 / MIB,
        FREE_MEMORY_TOLERANCE as f64 / MIB,
        waited.elapsed().as_secs_f64()
    );
    assert!(
        missing <= FREE_MEMORY_TOLERANCE,
        "device memory did not come back after the worker exited: {missing} bytes missing"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run through cargo xtask gpu-bundle"]
fn gpu_worker_exits_zero_at_end_of_input_while_loaded() {
    let tf = tf_binary();
    let model = tiny_qwen_folder();
    let model_arg = model.to_string_lossy().into_owned();
    let mut worker = WorkerProcess::spawn(
        &tf.to_string_lossy(),
        &[
            "worker",
            "--engine",
            "qwen_image",
            "--model",
            &model_arg,
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
    let status = worker
        .close_input(DEADLINE)
        .expect("worker ends at end of input");
    println!("status at end of input: {status:?}");
    assert_eq!(status.code(), Some(0));
}

/// `(width, height, rgba)` of a PNG file's bytes; panics (failing the test) on anything but 8-bit RGBA.
fn decode_rgba(bytes: &[u8]) -> Result<(u32, u32, Vec<u8>), tf_engines::nn::media::png::PngError> {
    let image = tf_engines::nn::media::png::decode_png(bytes)?;
    assert_eq!(
        image.color,
        tf_engines::nn::media::png::ColorType::Rgba,
        "the worker writes RGBA"
    );
    Ok((image.width as u32, image.height as u32, image.pixels))
}
