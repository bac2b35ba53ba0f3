//! The worker protocol (docs/WORKER.md): in-process with a scripted fake engine (good and bad requests,
//! ordering, progress, failures, exit), and as a real `tf worker` process driven by the client.
// A failed check in a test is meant to stop it: tests may unwrap, expect and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/worker_session.rs"]
mod worker_session;

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use serde_json::{json, Value};
use tf_engines::worker::client::WorkerProcess;
use tf_engines::worker::{
    Ending, EngineError, ImageJob, Progress, RgbaImage, Worker, WorkerEngine, WorkerLimits,
};
use worker_session::assert_budgeted_session_loads_per_request;

/// What the fake engine saw.
#[derive(Default, Debug)]
struct Calls {
    loads: u32,
    unloads: u32,
    jobs: Vec<ImageJob>,
    loaded: bool,
}

/// A scripted engine: the prompt picks the outcome ("refuse", "fail", "lost", "panic", "wrong size"),
/// anything else makes a flat image whose colour encodes the seed. Its first load fails when `fail_first_load`.
struct FakeEngine {
    calls: Rc<RefCell<Calls>>,
    fail_first_load: bool,
}

impl FakeEngine {
    fn new() -> (FakeEngine, Rc<RefCell<Calls>>) {
        let calls = Rc::new(RefCell::new(Calls::default()));
        (
            FakeEngine {
                calls: Rc::clone(&calls),
                fail_first_load: false,
            },
            calls,
        )
    }
}

impl WorkerEngine for FakeEngine {
    fn load(&mut self) -> Result<u64, EngineError> {
        let mut calls = self.calls.borrow_mut();
        assert!(!calls.loaded, "load while loaded");
        calls.loads += 1;
        if self.fail_first_load && calls.loads == 1 {
            return Err(EngineError::Failed("weights missing".into()));
        }
        calls.loaded = true;
        Ok(12_345)
    }

    fn generate(
        &mut self,
        job: &ImageJob,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        assert!(self.calls.borrow().loaded, "generate while unloaded");
        self.calls.borrow_mut().jobs.push(job.clone());
        let steps = job.steps.unwrap_or(2);
        progress(Progress {
            phase: "encode",
            step: 1,
            of: 1,
        });
        for step in 1..=steps {
            progress(Progress {
                phase: "denoise",
                step,
                of: steps,
            });
        }
        match job.prompt.as_str() {
            "refuse" => Err(EngineError::InvalidRequest(
                "width must be a multiple of 32".into(),
            )),
            "fail" => Err(EngineError::Failed("out of memory".into())),
            "lost" => Err(EngineError::DeviceLost("CUDA_ERROR_ILLEGAL_ADDRESS".into())),
            "panic" => panic!("fake engine bug"),
            "wrong size" => RgbaImage::new(16, 16, vec![0; 16 * 16 * 4]),
            _ => {
                let shade = (job.seed % 251) as u8;
                let (w, h) = (job.width, job.height);
                RgbaImage::new(w, h, [shade, 1, 2, 255].repeat((w * h) as usize))
            }
        }
    }

    fn unload(&mut self) {
        let mut calls = self.calls.borrow_mut();
        if calls.loaded {
            calls.unloads += 1;
        }
        calls.loaded = false;
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-worker-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `lines` through a worker; returns the ending and every output line as JSON.
fn serve(engine: FakeEngine, lines: &[String]) -> (Ending, Vec<Value>) {
    let input = lines.iter().map(|l| format!("{l}\n")).collect::<String>();
    let mut output = Vec::new();
    let mut worker = Worker::new(engine, WorkerLimits::default());
    let ending = worker.serve(input.as_bytes(), &mut output).unwrap();
    assert!(!worker.is_loaded(), "serve returned with the engine loaded");
    let text = String::from_utf8(output).unwrap();
    let values = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    (ending, values)
}

/// Splits output lines into one group per command: the progress lines, then the final reply.
fn per_command(values: &[Value]) -> Vec<(Vec<Value>, Value)> {
    let mut groups = Vec::new();
    let mut progress = Vec::new();
    for v in values {
        if v.get("ok").is_some() {
            assert!(v.get("progress").is_none(), "{v}");
            groups.push((std::mem::take(&mut progress), v.clone()));
        } else {
            let p = v
                .get("progress")
                .unwrap_or_else(|| panic!("neither ok nor progress: {v}"));
            progress.push(p.clone());
        }
    }
    assert!(
        progress.is_empty(),
        "progress after the last reply: {progress:?}"
    );
    groups
}

fn generate_line(dir: &Path, prompt: &str, extra: Value) -> String {
    let mut line = json!({"op": "generate", "dir": dir, "request": {"image": {"prompt": prompt, "width": 64, "height": 32, "steps": 3, "seed": 9}}});
    if let (Some(image), Value::Object(extra)) = (line["request"]["image"].as_object_mut(), extra) {
        image.extend(extra);
    }
    line.to_string()
}

fn assert_error(reply: &Value, kind: &str, contains: &str) {
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["type"], kind, "{reply}");
    let message = reply["error"].as_str().unwrap_or_default();
    assert!(message.contains(contains), "`{message}` lacks `{contains}`");
}

#[test]
fn load_generate_exit_in_order_with_progress_and_files() {
    let dir = temp_dir("happy");
    let (engine, calls) = FakeEngine::new();
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "a fox", json!({})),
        json!({"op": "exit"}).to_string(),
        json!({"op": "load"}).to_string(), // after exit: never read
    ];
    let (ending, values) = serve(engine, &lines);
    assert_eq!(ending, Ending::Exit);
    let groups = per_command(&values);
    assert_eq!(groups.len(), 3, "{values:?}");

    let (progress, loaded) = &groups[0];
    assert!(progress.is_empty());
    assert_eq!(loaded["ok"], true);
    assert_eq!(loaded["resident"], 12_345);
    assert!(loaded["ms"].is_u64());

    let (progress, done) = &groups[1];
    let phases: Vec<(&str, u64, u64)> = progress
        .iter()
        .map(|p| {
            (
                p["phase"].as_str().unwrap(),
                p["step"].as_u64().unwrap(),
                p["of"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        phases,
        [
            ("encode", 1, 1),
            ("denoise", 1, 3),
            ("denoise", 2, 3),
            ("denoise", 3, 3)
        ]
    );
    assert!(progress.iter().all(|p| p["steps"] == p["of"]));
    assert_eq!(done["ok"], true, "{done}");
    assert_eq!(done["seed"], 9);
    assert_eq!(done["files"], json!(["image_0.png"]));
    let (w, h, rgba) = decode_rgba(&std::fs::read(dir.join("image_0.png")).unwrap()).unwrap();
    assert_eq!((w, h), (64, 32));
    assert_eq!(&rgba[..4], &[9, 1, 2, 255]);

    let (_, exited) = &groups[2];
    assert_eq!(exited["ok"], true);
    assert_eq!(exited["device_bytes"], 0);
    let calls = calls.borrow();
    assert_eq!((calls.loads, calls.unloads), (1, 1));
    assert_eq!(calls.jobs.len(), 1);
    assert_eq!(calls.jobs[0].prompt, "a fox");
}

#[test]
fn bad_requests_are_answered_and_the_worker_keeps_serving() {
    let dir = temp_dir("bad");
    let (engine, calls) = FakeEngine::new();
    let flat_ok = json!({"op": "generate", "prompt": "flat", "width": 32, "height": 48, "seed": 4, "out_dir": dir.join("flat")});
    let cases: Vec<(String, Option<&str>)> = vec![
        (generate_line(&dir, "early", json!({})), Some("generate before load")),
        (json!({"op": "load"}).to_string(), None),
        ("this is not json".into(), Some("not valid JSON")),
        ("[]".into(), Some("expected a JSON object")),
        (json!({"op": "dance"}).to_string(), Some("unknown op `dance`")),
        (json!({"op": "generate", "dir": dir}).to_string(), Some("`prompt` is missing")),
        (generate_line(&dir, "x", json!({"width": "64"})), Some("`width` must be a whole number")),
        (generate_line(&dir, "x", json!({"width": 0})), Some("`width` must be 1 to 2048 pixels (the worker's bound")),
        (generate_line(&dir, "x", json!({"height": 4096})), Some("`height` must be 1 to 2048")),
        (generate_line(&dir, "x", json!({"steps": 1000})), Some("`steps` must be at most")),
        (generate_line(&dir, "x", json!({"seed": -3})), Some("`seed`")),
        (json!({"op": "generate", "prompt": "x"}).to_string(), Some("say where the images go")),
        (generate_line(&dir, "refuse", json!({})), Some("multiple of 32")),
        (json!({"op": "generate", "prompt": "x", "output": dir.join("x.png"), "request": {"image": {"prompt": "y"}}}).to_string(), Some("not both")),
        (flat_ok.to_string(), None),
        (json!({"op": "load"}).to_string(), None),
    ];
    let lines: Vec<String> = cases.iter().map(|(l, _)| l.clone()).collect();
    let (ending, values) = serve(engine, &lines);
    assert_eq!(ending, Ending::EndOfInput);
    let groups = per_command(&values);
    assert_eq!(
        groups.len(),
        cases.len(),
        "one final reply per line: {values:?}"
    );
    for ((line, expected), (_, reply)) in cases.iter().zip(&groups) {
        match expected {
            Some(text) => assert_error(reply, "invalid_request_error", text),
            None => assert_eq!(reply["ok"], true, "{line} -> {reply}"),
        }
    }
    // Only the engine-refused request and the good one reached the engine; the second load was a no-op.
    let calls = calls.borrow();
    let prompts: Vec<&str> = calls.jobs.iter().map(|j| j.prompt.as_str()).collect();
    assert_eq!(prompts, ["refuse", "flat"]);
    assert_eq!((calls.loads, calls.unloads), (1, 1));
    assert_eq!(
        groups.last().map(|g| &g.1["resident"]),
        Some(&json!(12_345))
    );
    let flat = &groups[groups.len() - 2].1;
    assert_eq!(flat["files"], json!(["image_0.png"]));
    let (w, h, _) = decode_rgba(&std::fs::read(dir.join("flat/image_0.png")).unwrap()).unwrap();
    assert_eq!((w, h), (32, 48));
}

#[test]
fn engine_failures_are_server_errors_and_serving_goes_on() {
    let dir = temp_dir("fail");
    let (engine, calls) = FakeEngine::new();
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "fail", json!({})),
        generate_line(&dir, "wrong size", json!({})),
        generate_line(&dir, "fine", json!({})),
    ];
    let (ending, values) = serve(engine, &lines);
    assert_eq!(ending, Ending::EndOfInput);
    let groups = per_command(&values);
    assert_error(&groups[1].1, "server_error", "out of memory");
    assert_error(
        &groups[2].1,
        "server_error",
        "16x16 image for a 64x32 request",
    );
    assert_eq!(groups[3].1["ok"], true);
    assert_eq!(calls.borrow().unloads, 1);
}

#[test]
fn a_lost_device_is_answered_then_the_worker_stops_non_zero() {
    let dir = temp_dir("lost");
    let (engine, calls) = FakeEngine::new();
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "lost", json!({})),
        generate_line(&dir, "never run", json!({})),
    ];
    let (ending, values) = serve(engine, &lines);
    assert!(
        matches!(&ending, Ending::DeviceLost(m) if m.contains("ILLEGAL_ADDRESS")),
        "{ending:?}"
    );
    assert_eq!(ending.exit_code(), 3);
    let groups = per_command(&values);
    assert_eq!(
        groups.len(),
        2,
        "nothing is served after a lost device: {values:?}"
    );
    assert_error(&groups[1].1, "server_error", "context is lost");
    let calls = calls.borrow();
    assert_eq!(calls.jobs.len(), 1);
    assert_eq!(calls.unloads, 1);
}

#[test]
fn an_engine_panic_is_answered_and_ends_serving() {
    let dir = temp_dir("panic");
    let (engine, calls) = FakeEngine::new();
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "panic", json!({})),
        generate_line(&dir, "never run", json!({})),
    ];
    let (ending, values) = serve(engine, &lines);
    assert_eq!(ending, Ending::EnginePanicked("fake engine bug".into()));
    assert_eq!(ending.exit_code(), 4);
    let groups = per_command(&values);
    assert_eq!(groups.len(), 2);
    assert_error(&groups[1].1, "server_error", "fake engine bug");
    assert_eq!(calls.borrow().unloads, 1);
}

#[test]
fn a_failed_load_can_be_retried() {
    let dir = temp_dir("retry");
    let (mut engine, calls) = FakeEngine::new();
    engine.fail_first_load = true;
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "x", json!({})),
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "x", json!({})),
    ];
    let (_, values) = serve(engine, &lines);
    let groups = per_command(&values);
    assert_error(&groups[0].1, "server_error", "load failed: weights missing");
    assert_error(&groups[1].1, "invalid_request_error", "before load");
    assert_eq!(groups[2].1["ok"], true);
    assert_eq!(groups[3].1["ok"], true);
    assert_eq!(calls.borrow().loads, 2);
}

/// An engine whose load refuses its configuration, as Qwen-Image does an FP8 DiT on the host.
struct RefusesItsConfiguration;

impl WorkerEngine for RefusesItsConfiguration {
    fn load(&mut self) -> Result<u64, EngineError> {
        Err(EngineError::InvalidRequest(
            "DiT precision fp8 runs on the GPU only".into(),
        ))
    }

    fn generate(
        &mut self,
        _job: &ImageJob,
        _progress: &mut dyn FnMut(Progress),
    ) -> Result<RgbaImage, EngineError> {
        panic!("generate without a load");
    }

    fn unload(&mut self) {}
}

#[test]
fn a_load_the_engine_refuses_is_a_server_error_naming_the_cause_and_the_fix() {
    let input = "{\"op\":\"load\"}\n{\"op\":\"exit\"}\n";
    let mut output = Vec::new();
    let ending = Worker::new(RefusesItsConfiguration, WorkerLimits::default())
        .serve(input.as_bytes(), &mut output)
        .unwrap();
    assert_eq!(ending, Ending::Exit);
    let replies: Vec<Value> = String::from_utf8(output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Not `invalid_request_error`: a router would answer the client 400 for the operator's configuration.
    assert_error(
        &replies[0],
        "server_error",
        "DiT precision fp8 runs on the GPU only",
    );
    assert_error(
        &replies[0],
        "server_error",
        "Change the worker's command line",
    );
    let message = replies[0]["error"].as_str().unwrap();
    assert!(!message.contains("invalid request"), "{message}");
    assert_eq!(replies[1]["ok"], true);
}

#[test]
fn tf_worker_qwen_image_in_fp8_on_the_host_fails_its_load_as_a_server_error() {
    let model = tiny_qwen_folder();
    let mut worker = spawn_qwen_worker(&model, &["--precision", "fp8"]);
    let loaded = worker.call(r#"{"op":"load"}"#, DEADLINE).unwrap();
    println!("{}", loaded.reply);
    // The cause, its fix, and what to change: the worker's command line.
    for needle in [
        "load failed: the worker's configuration is refused",
        "DiT precision fp8 runs on the GPU only",
        "load on the GPU backend, or in bf16 on the host",
        "Change the worker's command line",
    ] {
        assert_error(&loaded.reply, "server_error", needle);
    }
    let (exit_reply, status) = worker.exit_with_reply(DEADLINE).unwrap();
    assert_eq!(exit_reply["ok"], true);
    assert_eq!(status.code(), Some(0));
}

#[test]
fn several_images_use_consecutive_seeds_and_cumulative_progress() {
    let dir = temp_dir("many");
    let (engine, calls) = FakeEngine::new();
    let lines = [
        json!({"op": "load"}).to_string(),
        generate_line(&dir, "x", json!({"n": 3, "seed": 100, "steps": 2})),
    ];
    let (_, values) = serve(engine, &lines);
    let groups = per_command(&values);
    let (progress, done) = &groups[1];
    assert_eq!(
        done["files"],
        json!(["image_0.png", "image_1.png", "image_2.png"])
    );
    assert_eq!(done["seed"], 100);
    let seeds: Vec<u64> = calls.borrow().jobs.iter().map(|j| j.seed).collect();
    assert_eq!(seeds, [100, 101, 102]);
    let denoise: Vec<(u64, u64)> = progress
        .iter()
        .filter(|p| p["phase"] == "denoise")
        .map(|p| (p["step"].as_u64().unwrap(), p["of"].as_u64().unwrap()))
        .collect();
    assert_eq!(denoise, [(1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6)]);
    for (i, seed) in [100u8, 101, 102].iter().enumerate() {
        let (_, _, rgba) =
            decode_rgba(&std::fs::read(dir.join(format!("image_{i}.png"))).unwrap()).unwrap();
        assert_eq!(rgba[0], *seed);
    }
}

#[test]
fn long_lines_binary_lines_and_blank_lines() {
    let (engine, _) = FakeEngine::new();
    let mut input = b"\n   \n".to_vec();
    input.extend_from_slice(&[0xff, 0xfe, b'\n']);
    input.extend_from_slice(&vec![b'x'; (1 << 20) + 10]);
    input.extend_from_slice(b"\n{\"op\":\"load\"}");
    let mut output = Vec::new();
    let ending = Worker::new(engine, WorkerLimits::default())
        .serve(&input[..], &mut output)
        .unwrap();
    assert_eq!(ending, Ending::EndOfInput);
    let values: Vec<Value> = String::from_utf8(output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(values.len(), 3, "{values:?}");
    assert_error(&values[0], "invalid_request_error", "not UTF-8");
    assert_error(&values[1], "invalid_request_error", "longer than");
    assert_eq!(values[2]["ok"], true);
}

/// A writer that fails after `left` bytes, like a pipe whose reader died.
struct BrokenPipe {
    left: usize,
}

impl std::io::Write for BrokenPipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.left < buf.len() {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        self.left -= buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_dead_reader_ends_serving_with_an_error_and_unloads() {
    let dir = temp_dir("pipe");
    let (engine, calls) = FakeEngine::new();
    let input = format!(
        "{}\n{}\n",
        json!({"op": "load"}),
        generate_line(&dir, "x", json!({}))
    );
    let mut worker = Worker::new(engine, WorkerLimits::default());
    let result = worker.serve(input.as_bytes(), BrokenPipe { left: 60 });
    assert!(result.is_err());
    assert!(!worker.is_loaded());
    assert_eq!(calls.borrow().unloads, 1);
}

fn tf() -> &'static str {
    env!("CARGO_BIN_EXE_tf")
}

const DEADLINE: Duration = Duration::from_secs(120);

#[test]
fn the_tf_worker_process_serves_load_three_generates_and_exit() {
    let dir = temp_dir("process");
    let mut worker = WorkerProcess::spawn(tf(), &["worker", "--engine", "testpattern"]).unwrap();
    let loaded = worker.call(r#"{"op":"load"}"#, DEADLINE).unwrap();
    assert_eq!(loaded.reply["ok"], true, "{}", loaded.reply);

    let first = worker
        .call(
            &generate_line(&dir.join("a"), "a fox", json!({"steps": 5})),
            DEADLINE,
        )
        .unwrap();
    assert_eq!(first.reply["ok"], true, "{}", first.reply);
    assert_eq!(first.progress.len(), 5);
    assert_eq!(
        first.progress.last().map(|p| (&p["step"], &p["of"])),
        Some((&json!(5), &json!(5)))
    );

    let invalid = worker
        .call(
            &generate_line(&dir.join("b"), "x", json!({"width": 100})),
            DEADLINE,
        )
        .unwrap();
    assert_error(
        &invalid.reply,
        "invalid_request_error",
        "`width` must be a multiple of 16 for the test pattern, got 100",
    );
    assert!(invalid.progress.is_empty());

    let out_file = dir.join("c/picture.png");
    let third = worker
        .call(
            &json!({"op": "generate", "prompt": "a fox", "width": 48, "height": 80, "seed": 3, "output": out_file}).to_string(),
            DEADLINE,
        )
        .unwrap();
    assert_eq!(third.reply["ok"], true, "{}", third.reply);
    assert_eq!(third.reply["files"], json!([out_file]));
    assert!(third.reply["ms"].is_u64());

    let (exit_reply, status) = worker.exit_with_reply(DEADLINE).unwrap();
    assert_eq!(exit_reply["ok"], true);
    assert_eq!(status.code(), Some(0), "{status:?}");

    let (w, h, first_pixels) =
        decode_rgba(&std::fs::read(dir.join("a/image_0.png")).unwrap()).unwrap();
    assert_eq!((w, h), (64, 32));
    assert!(
        !dir.join("b").join("image_0.png").exists(),
        "the invalid request wrote a file"
    );
    let (w, h, third_pixels) = decode_rgba(&std::fs::read(&out_file).unwrap()).unwrap();
    assert_eq!((w, h), (48, 80));
    assert_ne!(
        first_pixels[..48 * 4],
        third_pixels[..48 * 4],
        "different seeds, same pixels"
    );
}

#[test]
fn the_tf_worker_process_exits_zero_at_end_of_input() {
    let mut worker = WorkerProcess::spawn(tf(), &["worker", "--engine", "testpattern"]).unwrap();
    assert_eq!(
        worker.call(r#"{"op":"load"}"#, DEADLINE).unwrap().reply["ok"],
        true
    );
    let status = worker.close_input(DEADLINE).unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn every_job_ends_with_a_log_line_of_the_device_memory_held() {
    use std::io::Write;
    let dir = temp_dir("held");
    let mut child = std::process::Command::new(tf())
        .args(["worker", "--engine", "testpattern"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    for line in [
        r#"{"op":"load"}"#.to_string(),
        json!({"op": "generate", "id": "job1", "dir": dir.join("a"),
               "request": {"image": {"prompt": "a fox", "width": 64, "height": 32, "steps": 2, "seed": 9}}})
        .to_string(),
        r#"{"op":"exit"}"#.to_string(),
    ] {
        writeln!(input, "{line}").unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{:?}", out.status);
    let log = String::from_utf8_lossy(&out.stderr);
    let done = log
        .lines()
        .find(|l| l.contains("\"job1\" done in"))
        .unwrap_or_else(|| panic!("no done line for job1 in:\n{log}"));
    println!("{done}");
    // The test pattern engine holds no device memory.
    assert!(
        done.ends_with("ms; device memory held: 0.00 GiB in 0 allocations"),
        "{done}"
    );
}

#[test]
fn the_tf_worker_refuses_bad_arguments_with_exit_code_2() {
    let out = std::process::Command::new(tf())
        .args(["worker", "--engine", "qwen_image"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--model"),
        "{out:?}"
    );
    let out = std::process::Command::new(tf())
        .args([
            "worker",
            "--engine",
            "qwen_image",
            "--model",
            "/definitely/not/here",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not a folder"),
        "{out:?}"
    );
}

/// `tf worker` for Qwen-Image on the host backend over `model`, with `extra` arguments.
fn spawn_qwen_worker(model: &std::path::Path, extra: &[&str]) -> WorkerProcess {
    let model_arg = model.to_string_lossy().into_owned();
    let mut args = vec![
        "worker",
        "--engine",
        "qwen_image",
        "--model",
        &model_arg,
        "--backend",
        "host",
    ];
    args.extend_from_slice(extra);
    WorkerProcess::spawn(tf(), &args).unwrap()
}

/// The tiny complete Qwen-Image folder committed under tests/fixtures/qwen_pipeline/model.
fn tiny_qwen_folder() -> PathBuf {
    let folder =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen_pipeline/model");
    assert!(
        folder.join("model_index.json").is_file(),
        "the tiny pipeline fixture is missing at {}",
        folder.display()
    );
    folder
}

#[test]
fn the_tf_worker_process_runs_the_tiny_qwen_pipeline_on_the_host() {
    use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline, Request};

    let model = tiny_qwen_folder();
    let dir = temp_dir("qwen-host");
    let mut worker = spawn_qwen_worker(&model, &[]);
    let loaded = worker.call(r#"{"op":"load"}"#, DEADLINE).unwrap();
    assert_eq!(loaded.reply["ok"], true, "{}", loaded.reply);
    assert!(
        loaded.reply["resident"].as_u64().unwrap_or(0) > 0,
        "{}",
        loaded.reply
    );

    let first = worker
        .call(
            &generate_line(
                &dir.join("a"),
                "a red fox in the snow",
                json!({"width": 64, "height": 64, "steps": 3, "seed": 11}),
            ),
            DEADLINE,
        )
        .unwrap();
    assert_eq!(first.reply["ok"], true, "{}", first.reply);
    let denoise = first
        .progress
        .iter()
        .filter(|p| p["phase"] == "denoise")
        .count();
    assert_eq!(denoise, 3, "{:?}", first.progress);

    let refused = worker
        .call(
            &generate_line(&dir.join("b"), "x", json!({"width": 48, "height": 64})),
            DEADLINE,
        )
        .unwrap();
    assert_error(&refused.reply, "invalid_request_error", "multiple of 32");

    let wide = dir.join("c/wide.png");
    let third = worker
        .call(&json!({"op": "generate", "prompt": "a cat", "width": 96, "height": 64, "steps": 2, "seed": 2, "output": wide}).to_string(), DEADLINE)
        .unwrap();
    assert_eq!(third.reply["ok"], true, "{}", third.reply);

    let (exit_reply, status) = worker.exit_with_reply(DEADLINE).unwrap();
    assert_eq!(exit_reply["ok"], true);
    assert_eq!(status.code(), Some(0));

    let (w, h, fox) = decode_rgba(&std::fs::read(dir.join("a/image_0.png")).unwrap()).unwrap();
    assert_eq!((w, h), (64, 64));
    let (w, h, _) = decode_rgba(&std::fs::read(&wide).unwrap()).unwrap();
    assert_eq!((w, h), (96, 64));
    assert!(!dir.join("b/image_0.png").exists());

    // The worker's file holds exactly the pipeline's pixels for the same request.
    let mut pipeline = Pipeline::load(&model, &LoadOptions::new(Backend::Host)).unwrap();
    let request = Request {
        width: 64,
        height: 64,
        steps: Some(3),
        seed: 11,
        ..Request::new("a red fox in the snow")
    };
    let image = pipeline.generate(&request, &mut |_| {}).unwrap().image;
    assert_eq!((image.width, image.height, image.channels), (64, 64, 4));
    let differing = image
        .pixels
        .iter()
        .zip(&fox)
        .filter(|(a, b)| a != b)
        .count();
    println!(
        "worker PNG vs in-process pipeline: {differing} of {} bytes differ",
        fox.len()
    );
    assert_eq!(differing, 0);
}

fn arbitrary_line() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let generate = (
        prop_oneof![Just("fine"), Just("fail"), Just("refuse"), Just("")],
        prop_oneof![Just(json!(64)), Just(json!(65)), Just(json!(0)), Just(json!("64")), Just(json!(-1))],
        prop_oneof![Just(json!(2)), Just(json!(0)), Just(json!(1000)), Just(Value::Null)],
        0u32..4,
    )
        .prop_map(|(prompt, width, steps, n)| {
            json!({"op": "generate", "prompt": prompt, "width": width, "height": 32, "steps": steps, "n": n,
                   "out_dir": std::env::temp_dir().join(format!("tf-worker-{}-prop", std::process::id()))})
            .to_string()
        });
    prop_oneof![
        Just(json!({"op": "load"}).to_string()),
        Just(json!({"op": "exit"}).to_string()),
        generate,
        "[ -~]{0,40}",
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Every non-blank line up to `exit` gets exactly one final reply with a known error type, nothing
    /// follows the exit reply, and the engine is unloaded at the end.
    #[test]
    fn any_line_sequence_gets_one_reply_per_line(lines in proptest::collection::vec(arbitrary_line(), 0..12)) {
        let (engine, calls) = FakeEngine::new();
        let (ending, values) = serve(engine, &lines);
        let served: Vec<&String> = match lines.iter().position(|l| l == r#"{"op":"exit"}"#) {
            Some(at) => lines[..=at].iter().collect(),
            None => lines.iter().collect(),
        };
        let expected = served.iter().filter(|l| !l.trim().is_empty()).count();
        let groups = per_command(&values);
        proptest::prop_assert_eq!(groups.len(), expected, "{:?} -> {:?}", lines, values);
        for (_, reply) in &groups {
            if reply["ok"] == false {
                let kind = reply["type"].as_str().unwrap_or_default();
                proptest::prop_assert!(kind == "invalid_request_error" || kind == "server_error", "{}", reply);
                proptest::prop_assert!(reply["error"].as_str().is_some_and(|e| !e.is_empty()), "{}", reply);
            } else {
                proptest::prop_assert_eq!(&reply["ok"], &json!(true));
            }
        }
        let exited = served.last().is_some_and(|l| *l == r#"{"op":"exit"}"#);
        proptest::prop_assert_eq!(ending, if exited { Ending::Exit } else { Ending::EndOfInput });
        let calls = calls.borrow();
        proptest::prop_assert!(!calls.loaded);
        proptest::prop_assert_eq!(calls.loads, calls.unloads);
    }
}

#[cfg(target_os = "linux")]
#[test]
fn the_tf_worker_dies_with_its_parent() {
    // The shell starts the worker with a stdin that stays open for 30 s, prints its pid and exits: only the
    // parent-death signal can end the worker sooner.
    let script = format!(
        "sleep 30 | '{}' worker --engine testpattern 2>/dev/null & echo $!; sleep 0.5",
        tf()
    );
    let mut shell = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first_line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(shell.stdout.take().unwrap()),
        &mut first_line,
    )
    .unwrap();
    let pid: u32 = first_line.trim().parse().unwrap();
    // Only the shell is waited for: the leftover `sleep` keeps the pipe open.
    assert!(shell.wait().unwrap().success());
    let gone_or_zombie = || match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    };
    let started = std::time::Instant::now();
    while !gone_or_zombie() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "worker {pid} ended {:?} after its parent",
        started.elapsed()
    );
    assert!(gone_or_zombie(), "worker {pid} outlived its parent");
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

#[test]
fn a_gpu_load_that_fails_on_the_fake_driver_is_a_server_error_and_releases_everything() {
    // The fake driver opens and makes contexts but cannot load real kernel images, so the GPU load fails
    // midway: the worker must answer server_error, keep serving, hold no device bytes, and exit 0.
    let _guard = tf_testdriver::test_lock();
    let driver = tf_testdriver::library_path().unwrap();
    let model = tiny_qwen_folder();
    let mut child = std::process::Command::new(tf())
        .args([
            "worker",
            "--engine",
            "qwen_image",
            "--backend",
            "gpu",
            "--model",
        ])
        .arg(&model)
        .env("TF_CUDA_DRIVER", &driver)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        std::io::Write::write_all(&mut stdin, b"{\"op\":\"load\"}\n{\"op\":\"generate\",\"prompt\":\"x\",\"width\":64,\"height\":64,\"out_dir\":\"/nonexistent-never-written\"}\n{\"op\":\"exit\"}\n").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    println!("{lines:?}");
    assert_eq!(
        lines.len(),
        3,
        "{lines:?}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_error(&lines[0], "server_error", "load failed");
    assert_error(&lines[1], "invalid_request_error", "before load");
    assert_eq!(lines[2]["ok"], true);
    assert_eq!(lines[2]["device_bytes"], 0);
    assert_eq!(lines[2]["device_allocs"], 0);
    assert_eq!(out.status.code(), Some(0));
}

/// `tf worker --device-budget` below the components' sum: the load picks the sequential plan and every request's
/// log says how long loading its components took (stderr is the worker's log).
#[test]
fn a_worker_with_a_device_budget_loads_its_components_per_request_and_says_so() {
    use tf_engines::qwen_image::pipeline::{Backend, LoadOptions, Pipeline};
    let model = tiny_qwen_folder();
    let largest = Pipeline::load(&model, &LoadOptions::new(Backend::Host))
        .unwrap()
        .memory_plan()
        .largest();
    let dir = temp_dir("budget");
    let mut worker = std::process::Command::new(tf());
    worker
        .args(["worker", "--engine", "qwen_image", "--backend", "host"])
        .args(["--device-budget", &format!("{largest}B"), "--model"])
        .arg(&model);
    let generate: Value =
        serde_json::from_str(&generate_line(&dir, "a fox", json!({"steps": 2}))).unwrap();
    assert_budgeted_session_loads_per_request(worker, generate);
    let _ = std::fs::remove_dir_all(&dir);
}
