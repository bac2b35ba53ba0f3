//! `tf worker` whose parent stops reading a pipe: logging to a stderr whose reader is gone must not panic the
//! worker (it keeps serving and exits 0), and a stdout whose reader is gone ends it with exit code 1, not a
//! panic (101).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

fn tf() -> &'static str {
    env!("CARGO_BIN_EXE_tf")
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tf-worker-pipes-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_worker_whose_stderr_reader_is_gone_keeps_serving_and_exits_cleanly() {
    let dir = temp_dir("stderr");
    let mut child = Command::new(tf())
        .args(["worker", "--engine", "testpattern"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end of stderr before the worker logs anything: every log line then meets EPIPE.
    drop(child.stderr.take());
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let generate = serde_json::json!({
        "op": "generate", "prompt": "a fox", "width": 32, "height": 32, "steps": 2, "out_dir": dir,
    });
    let mut finals = Vec::new();
    for line in [
        r#"{"op":"load"}"#.to_string(),
        generate.to_string(),
        r#"{"op":"dance"}"#.to_string(),
        r#"{"op":"exit"}"#.to_string(),
    ] {
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        loop {
            let mut reply = String::new();
            assert!(
                stdout.read_line(&mut reply).unwrap() > 0,
                "the worker ended early"
            );
            let value: serde_json::Value = serde_json::from_str(&reply).unwrap();
            if value.get("ok").is_some() {
                finals.push(value);
                break;
            }
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(finals[0]["ok"], true, "{finals:?}");
    assert_eq!(finals[1]["ok"], true, "{finals:?}");
    assert_eq!(finals[2]["type"], "invalid_request_error", "{finals:?}");
    assert_eq!(finals[3]["ok"], true, "{finals:?}");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(dir.join("image_0.png").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_worker_whose_stdout_reader_is_gone_exits_1_without_a_panic() {
    let mut child = Command::new(tf())
        .args(["worker", "--engine", "testpattern"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut stdin = child.stdin.take().unwrap();
    // Replies cannot be written; the worker must notice and end. Writing may fail once it has gone.
    let _ = writeln!(stdin, r#"{{"op":"load"}}"#);
    let _ = writeln!(stdin, r#"{{"op":"load"}}"#);
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "{:?}\n{stderr}", out.status);
}

#[test]
fn a_worker_with_both_output_readers_gone_still_exits_without_a_panic() {
    let mut child = Command::new(tf())
        .args(["worker", "--engine", "testpattern"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let mut stdin = child.stdin.take().unwrap();
    let _ = writeln!(stdin, r#"{{"op":"load"}}"#);
    drop(stdin);
    let status = child.wait().unwrap();
    // 101 is Rust's exit code for a panic; 1 is the worker's "the parent is gone".
    assert_eq!(status.code(), Some(1), "{status:?}");
}
